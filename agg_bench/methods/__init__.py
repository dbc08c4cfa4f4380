"""The methods: how the gradient of one update is accumulated.

``base``: the Estimator interface and the method registry; ``agg``: the AGG estimator. The baselines
(``baselines/``) are methods too and follow the same rules. A method imports the basics, the results
readers, the machine and the engine; never the runtime or the tools (``tests/test_import_graph.py``).
"""
