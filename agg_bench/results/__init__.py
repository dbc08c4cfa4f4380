"""The results readers: records, tables, statistics and plots, without torch.

Record keys and file names (records), medians and bootstrap intervals (stats), the benchmark's report
(report: its inputs in loading, its tables in tables, their files in formatting, its plots in plots and
plotting) and the learning sweep's tables and plots (learning). They read what runs wrote and import only
the top-level basics, so reading results never imports the engine (``tests/test_import_graph.py``).
"""
