"""The runtime: one training run, or several in one process.

The checks of a loaded config that need the engine and the method (config_check), the configured run and
one iteration (session), the GRPO loop that turns iterations into metric records (train), the run folder's
files and rules (runfolder), resumable checkpoints (checkpoint), the memory planner that a run and
``agg-bench plan`` consult (memplan) and the cell job that runs a workflow cell's runs one after the other in
one process (cell).
It imports every wing below it (basics, machine, engine, methods); never the results readers or the tools
(``tests/unit/test_import_graph.py``).
"""
