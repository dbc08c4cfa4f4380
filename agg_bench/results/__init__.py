"""The results readers: tables, statistics and plots of what runs wrote, without torch.

Medians and bootstrap intervals (stats), the cost model (costmodel), the benchmark's report (report: its
inputs in loading, its tables in tables, their files in formatting, its plots in plots and plotting) and the
learning sweep's tables and plots (learning, curves). They stand above the runtime, as code that reads what
runs wrote: the record contract and the one reader of a run folder they read through are basics
(:mod:`agg_bench.records`, :mod:`agg_bench.reading`), which the writers import too. Every reader imports no
torch (``tests/integration/test_fresh_interpreters.py`` imports each in a fresh interpreter).
"""
