"""The methods: how the gradient of one update is accumulated.

``base``: the Estimator interface and the method registry; ``agg``: the AGG estimator; ``option_tables``:
docs/methods.md's option tables and the method section's JSON schema. The baselines (``baselines/``) are
methods too and follow the same rules. A method imports the basics, the machine and the engine; never the
runtime, the results readers or the tools (``tests/unit/test_import_graph.py``).
"""
