"""The runtime: one training run.

The configured run and one iteration (session), the GRPO loop that turns iterations into metric
records (train), the run folder's files and rules (runfolder), resumable checkpoints (checkpoint) and
the memory planner that a run and ``agg-bench plan`` consult (memplan).
It imports every wing below it (basics, results, machine, engine, methods); never the tools
(``tests/test_import_graph.py``).
"""
