"""``agg-bench report``: comparison tables (CSV, Markdown, HTML) from run folders, gradcheck CSVs and
calibrations, and plots (PNG) from those tables.

Inputs are what other commands wrote: run folders (``metrics.jsonl``, ``summary.json``,
``config.json``) from ``agg-bench run`` or ``agg-bench import-log``, gradcheck CSVs from
``agg-bench gradcheck`` and calibrations from ``agg-bench calibrate``. The plots are drawn from the
tables as written (``records.csv``, ``efficiency.csv``, ``ablation.csv``), so that the workflow's plots
job reads its tables job's outputs (``--tables-in``) and a report that writes both draws the same plots.
Both folders hold the same ``stamp.json`` (the digests of the manifest read and of the tables the plots are
drawn from): a report killed between renaming the two into place leaves stamps that differ, which
:func:`~agg_bench.results.loading.check_report` (``agg-bench report --check``) tells.
The rooms of the report:

- :mod:`~agg_bench.results.loading`: the manifest and every input, checked as it is read; the written tables;
- :mod:`~agg_bench.results.tables`: the tables (what every column means, and the timing statistics);
- :mod:`~agg_bench.results.formatting`: the tables as CSV, Markdown and HTML files;
- :mod:`~agg_bench.results.plots`: the plots.
"""
from __future__ import annotations

import io
import sys
from pathlib import Path
from typing import Callable

import pandas as pd

from ..errors import PROGRESS_EVERY_S, Progress, UserError, counted, shown
from ..outdir import claimed_folders, replaced_folders
from ..io import write_json
from ..outputs import REPORT_CONTENTS, STAMP_FILE  # what --tables DIR and --plots DIR may hold
from .formatting import table_csv, write_tables
from .loading import (PLOT_CELLS, PLOT_COLUMNS, Manifest, folder_tables_digest, load_calibration, load_gradcheck,
                      load_records, load_tables_and_digest, parse_table, read_stamp, tables_digest)
from .plots import write_plots
from ..records import PLOT_TABLES
from .tables import build_tables, timed_whole, unmatched_gradcheck


def build_report(manifest: Manifest, tables_dir: str | Path | None = None,
                 plots_dir: str | Path | None = None) -> dict[str, pd.DataFrame]:
    """Load ``manifest``'s runs, gradcheck CSVs and calibrations; write the tables and/or the plots (drawn
    from the tables as written: read back from ``tables_dir``, or from their CSV text without one); return
    the tables. Both folders are replaced whole once every file is written (:func:`~agg_bench.outdir.
    replaced_folders`): a report that fails or is stopped leaves the earlier report's files as they were."""
    if not manifest.runs:
        raise UserError("no runs to report (give --manifest or --runs)")
    with claimed_folders([(tables_dir, REPORT_CONTENTS), (plots_dir, REPORT_CONTENTS)], ("--tables", "--plots"),
                         replaced_whole=True):
        return write_report(manifest, tables_dir, plots_dir, Progress("report", PROGRESS_EVERY_S))


def write_report(manifest: Manifest, tables_dir: str | Path | None = None, plots_dir: str | Path | None = None,
                 progress: Callable[[str], None] = lambda what: None) -> dict[str, pd.DataFrame]:
    """What :func:`build_report` writes, for a caller that holds the folders' claims itself (replaced whole: their
    locks beside them), from before it changes what the report reads (``campaign unpack``: its reference's tables);
    ``progress`` is told of each step done (:class:`Progress`; ``build_report``'s)."""
    records = load_records(manifest.runs, progress, manifest.file)
    gradcheck = load_gradcheck(manifest.gradcheck)
    calibration = load_calibration(manifest.calibration)
    tables = build_tables(records, gradcheck, manifest.warmup, manifest.time, calibration)
    progress(f"tables of {counted(len(records), 'record')} computed")
    whole = timed_whole(records, manifest.warmup)
    if whole:
        print(f"agg-bench report: {counted(len(whole), 'run')} ({shown(whole[0])}"
              f"{f' and {len(whole) - 1} more' if len(whole) > 1 else ''}) had no more ok iterations than the "
              f"warm-up (report.warmup_iterations or --warmup: {manifest.warmup}); their timings include it",
              file=sys.stderr)
    unmatched = unmatched_gradcheck(tables["efficiency"], gradcheck)
    if unmatched:
        runs = [f"{m} at {r} px" for m, r in sorted(set(zip(records["model"], records["resolution"])))]
        print(f"agg-bench report: no run matches the gradcheck rows of {', '.join(unmatched)} "
              f"(the runs: {', '.join(runs)}); "
              "their grad_cosine stays empty (a manifest's gradcheck entry names the model and resolution "
              "a CSV was measured at)", file=sys.stderr)
    with replaced_folders(tables_dir, plots_dir) as staged:
        if tables_dir is not None:
            write_tables(records, tables, staged(tables_dir))
            digest = folder_tables_digest(staged(tables_dir))
            progress("tables written")
        else:
            digest = tables_digest({name: table_csv({"records": records, **tables}[name]).encode()
                                    for name in PLOT_TABLES})
        if plots_dir is not None:
            written = load_tables_and_digest(staged(tables_dir))[0] if tables_dir is not None else \
                _as_written({"records": records, **tables})
            write_plots(written, staged(plots_dir))
        # the same stamp in both folders, which are renamed into place one after the other: a report killed
        # between the two renames leaves stamps that differ (check_report)
        for folder in (tables_dir, plots_dir):
            if folder is not None:
                write_json(staged(folder) / STAMP_FILE, {"manifest": manifest.digest(), "tables": digest})
        # under the claims, before the swap: a writer of the manifest that writes these tables after it (an
        # unpack into its reference) holds them from before, so tables that pass here are never of an earlier
        # manifest than the one beside them
        manifest.check_unchanged()
    return tables


def plot_tables(tables_dir: str | Path, plots_dir: str | Path) -> dict[str, pd.DataFrame]:
    """The plots of the tables that ``agg-bench report --tables tables_dir`` wrote, into ``plots_dir``
    (which may be that folder; replaced whole once every plot is drawn, as :func:`build_report` replaces it);
    returns the tables read."""
    with claimed_folders([(plots_dir, REPORT_CONTENTS)], ("--plots",), replaced_whole=True):
        tables, digest = load_tables_and_digest(tables_dir)
        # the tables' stamp's manifest where it names these tables (a report's whole folder), else none known
        stamp = read_stamp(Path(tables_dir))
        made_from = stamp["manifest"] if stamp is not None and stamp["tables"] == digest else None
        with replaced_folders(plots_dir) as staged:
            write_plots(tables, staged(plots_dir))
            write_json(staged(plots_dir) / STAMP_FILE, {"manifest": made_from, "tables": digest})
        return tables


def _as_written(tables: dict[str, pd.DataFrame]) -> dict[str, pd.DataFrame]:
    """The tables the plots read as their CSV files would give them back, without writing the files."""
    return {name: parse_table(io.StringIO(table_csv(tables[name])), f"the {name} table", PLOT_COLUMNS[name],
                              PLOT_CELLS[name], quoted=True)
            for name in PLOT_TABLES}
