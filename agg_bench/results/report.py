"""``agg-bench report``: comparison tables (CSV, Markdown, HTML) and plots (PNG) from run folders,
gradcheck CSVs and calibrations.

Inputs are what other commands wrote: run folders (``metrics.jsonl``, ``summary.json``,
``config.json``) from ``agg-bench run`` or ``agg-bench import-log``, gradcheck CSVs from
``agg-bench gradcheck`` and calibrations from ``agg-bench calibrate``. The rooms of the report:

- :mod:`~agg_bench.results.loading`: the manifest and every input, checked as it is read;
- :mod:`~agg_bench.results.tables`: the tables (what every column means, and the timing statistics);
- :mod:`~agg_bench.results.formatting`: the tables as CSV, Markdown and HTML files;
- :mod:`~agg_bench.results.plots`: the plots.
"""
from __future__ import annotations

from pathlib import Path

import pandas as pd

from ..errors import UserError
from ..outdir import Contents, claimed_folders
from .formatting import write_tables
from .loading import Manifest, load_calibration, load_gradcheck, load_records
from .plots import write_plots
from .records import PLOTS, TABLE_FORMATS, TABLES
from .tables import build_tables

# what --tables DIR and --plots DIR hold; any other file there is someone else's
TABLES_CONTENTS = Contents("agg-bench report tables",
                           ("records.csv", *(f"{name}.{ext}" for name in TABLES for ext in TABLE_FORMATS)))
PLOTS_CONTENTS = Contents("agg-bench report plots", tuple(f"{name}.png" for name in PLOTS))


def build_report(manifest: Manifest, tables_dir: str | Path | None = None,
                 plots_dir: str | Path | None = None) -> dict[str, pd.DataFrame]:
    """Load ``manifest``'s runs, gradcheck CSVs and calibrations; write the tables and/or the plots;
    return the tables."""
    if not manifest.runs:
        raise UserError("report: no runs to report (give --manifest or --runs)")
    with claimed_folders([(tables_dir, TABLES_CONTENTS), (plots_dir, PLOTS_CONTENTS)], ("--tables", "--plots")):
        records = load_records(manifest.runs)
        gradcheck = load_gradcheck(manifest.gradcheck)
        calibration = load_calibration(manifest.calibration)
        tables = build_tables(records, gradcheck, manifest.warmup, manifest.time, calibration)
        if tables_dir is not None:
            write_tables(records, tables, tables_dir)
        if plots_dir is not None:
            write_plots(records, tables, plots_dir)
        return tables
