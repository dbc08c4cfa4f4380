"""The tools: the commands built on runs.

Frozen rollouts and their replay (snapshot), gradient fidelity (gradcheck), pass costs (calibrate),
the scene model of the learning testbed (pretrain), its held-out evaluation and command (learning),
imported logs (importlog), the profiler (profiling), the GPU check's summary (gpucheck) and the
workflow's sweep (sweep). A tool may import every other wing (``tests/unit/test_import_graph.py``).
"""
