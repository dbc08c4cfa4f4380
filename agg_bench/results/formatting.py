"""The report's tables as files: CSV (every column, empty where not measured, counts as integers),
GitHub Markdown and a standalone HTML page (what the Snakemake report shows in place).

Every CSV that ``report``, ``learning`` and ``campaign`` write goes through :func:`csv_text`, and every cell of
``gradcheck``'s CSV and ``profile``'s ``operators.csv`` (written row by row) through :func:`csv_cell`: a text cell
that a spreadsheet program would run as a formula (one beginning with ``=``, ``+``, ``-``, ``@``, a tab or a
carriage return: a label, a GPU name or a run folder's path from shared results, an operator's name) is written with
a single quote before it (OWASP's CSV injection advice), and so is one beginning with a single quote, so that
:func:`~agg_bench.results.loading.parse_table` (``quoted``) gives every cell back as it was; numbers are written as
numbers, a negative one too. A cell holding a carriage return or a newline is quoted, so that a row is never split.

Every cell and column name of the Markdown and HTML is shown as text (escaped: a label is never markup). In
both, a row whose run did not finish shows its status (``OOM``, ``DIVERGED``, ...) in the time, speedup and
reward cells it left empty, and an imported row is marked in the method column.
"""
from __future__ import annotations

import csv
import io
import math
from pathlib import Path
from typing import Callable

import numpy as np
import pandas as pd

from ..io import write_text
from .loading import is_number
from ..records import PASS_KEYS, TABLE_FORMATS, TRAIN_PASS_KEYS
from .tables import TIME_COLUMNS

FORMATS: dict[str, Callable[[float], str]] = {
    "speedup": lambda v: f"{v:.2f}x", "train_speedup": lambda v: f"{v:.2f}x",
    "speedup_lo": lambda v: f"{v:.2f}x", "speedup_hi": lambda v: f"{v:.2f}x",
    "train_speedup_lo": lambda v: f"{v:.2f}x", "train_speedup_hi": lambda v: f"{v:.2f}x",
    "predicted_train_speedup": lambda v: f"{v:.2f}x", "run_train_speedup": lambda v: f"{v:.2f}x",
    "run_train_speedup_lo": lambda v: f"{v:.2f}x", "run_train_speedup_hi": lambda v: f"{v:.2f}x",
    "speedup_vs_full": lambda v: f"{v:.2f}x", "backward_vs_full": lambda v: f"{v:.2f}",
    "cosine_to_full": lambda v: f"{v:.5f}", "grad_cosine": lambda v: f"{v:.5f}",
    "relative_error": lambda v: f"{v:.3g}", "grad_rel_error": lambda v: f"{v:.3g}",
}
# columns that count things: written as integers wherever every value is one
COUNT_COLUMNS = {*PASS_KEYS, *TRAIN_PASS_KEYS, "seeds", "iterations", "n_gpus", "resolution", "window",
                 "batch_size", "steps_per_sample", "groups_routed", "iteration", "seed", "optimizer_steps"}


# cells a failed run leaves empty; the Markdown shows the run's status there
FAILURE_COLUMNS = (*TIME_COLUMNS, "speedup", "train_speedup", "images_per_s", "final_reward", "reward_area", "wall_s",
                   "s_per_iter", "final_reward_pm")


def _is_count_column(column: str) -> bool:
    return column.split(" [")[0] in COUNT_COLUMNS


def integer_columns(df: pd.DataFrame) -> pd.DataFrame:
    """``df`` with every count column whose values are all whole numbers within 2**53 (where a float holds every
    integer, and an int64 each) as a nullable integer column (written ``40``, not ``40.0``; missing values stay
    empty); a larger count stays a float."""
    out = df.copy()
    for column in out.columns:
        if not _is_count_column(column) or not pd.api.types.is_numeric_dtype(out[column]) \
                or pd.api.types.is_bool_dtype(out[column]):
            continue
        values = pd.to_numeric(out[column], errors="coerce")
        present = values.dropna()
        if len(present) and np.all(np.isfinite(present)) and np.all(np.abs(present) <= 2**53) \
                and np.all(present == np.round(present)):
            out[column] = values.round().astype("Int64")
    return out


def _format(column: str, value) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)) or value is pd.NA:
        return ""
    if isinstance(value, (bool, np.bool_)):
        return "yes" if value else "no"
    kind = column.split(" [")[0]  # "speedup [NVIDIA H200]" is formatted as "speedup"
    if kind in FORMATS and is_number(value):
        return FORMATS[kind](float(value))
    if isinstance(value, (int, np.integer)):
        return str(int(value))
    if isinstance(value, (float, np.floating)):
        v = float(value)
        if v.is_integer() and abs(v) < 1e6 and _is_count_column(column):
            return str(int(v))
        return f"{v:.4g}"
    return str(value)


def formatted_cells(df: pd.DataFrame, status_column: str | None = "status", empty: str = "—") -> tuple[list[str], list[list[str]]]:
    """(header, rows of cell texts) of ``df`` as the Markdown and HTML tables show it. In a row whose
    status is not ok, the time, speedup and reward cells it left empty show the status (``OOM``,
    ``DIVERGED``, ...); other empty cells show ``empty``. Imported rows are marked in the method column."""
    columns = [c for c in df.columns if c != "method_options"]
    rows = []
    for _, row in df.iterrows():
        status = row.get(status_column) if status_column else None
        fill = status.upper() if isinstance(status, str) and status != "ok" else empty
        cells = []
        for column in columns:
            text = _format(column, row[column])
            if column == "method" and row.get("source") == "imported":
                text = f"{text} (imported)"
            cells.append(text or (fill if column in FAILURE_COLUMNS else empty))
        rows.append(cells)
    return columns, rows


def to_markdown(df: pd.DataFrame, status_column: str | None = "status", empty: str = "—") -> str:
    """A GitHub Markdown table (cells as :func:`formatted_cells` gives them)."""
    columns, rows = formatted_cells(df, status_column, empty)
    lines = ["| " + " | ".join(map(markdown_text, columns)) + " |", "|" + "|".join("---" for _ in columns) + "|"]
    lines += ["| " + " | ".join(map(markdown_text, cells)) + " |" for cells in rows]
    return "\n".join(lines) + "\n"


# what a Markdown table cell shows as the text itself: a backslash and a pipe escaped (an unescaped pipe ends the
# cell, and a backslash before one escapes it), and the characters of HTML as entities (a Markdown viewer renders
# inline HTML: a label from a shared run folder such as <img src=x onerror=...> was markup, not text)
_MARKDOWN_ESCAPES = str.maketrans({"\\": "\\\\", "|": "\\|", "&": "&amp;", "<": "&lt;", ">": "&gt;"})


def markdown_text(text: str) -> str:
    """``text`` (a label, a column name or a formatted number) as a Markdown table cell shows it, unchanged."""
    return text.translate(_MARKDOWN_ESCAPES)


_HTML_STYLE = ("body{font-family:sans-serif;font-size:13px;margin:0}"
               "table{border-collapse:collapse}th,td{border:1px solid #ccc;padding:2px 6px;white-space:nowrap}"
               "th{background:#f2f2f2;position:sticky;top:0}td.n{text-align:right}tr:nth-child(even){background:#fafafa}")


def to_html(df: pd.DataFrame, title: str, status_column: str | None = "status", empty: str = "—") -> str:
    """A standalone HTML page holding the table (cells as :func:`formatted_cells` gives them), for the
    Snakemake report, which shows HTML results in the page."""
    from html import escape

    columns, rows = formatted_cells(df, status_column, empty)
    numeric = [pd.api.types.is_numeric_dtype(df[c]) for c in columns]
    head = "".join(f"<th>{escape(c)}</th>" for c in columns)
    body = "".join("<tr>" + "".join(f'<td{" class=n" if n else ""}>{escape(cell)}</td>' for cell, n in zip(cells, numeric))
                   + "</tr>" for cells in rows)
    return (f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{escape(title)}</title>"
            f"<style>{_HTML_STYLE}</style></head><body><table><thead><tr>{head}</tr></thead>"
            f"<tbody>{body}</tbody></table></body></html>\n")


# the first characters that make a spreadsheet program take a cell for a formula (OWASP: CSV injection)
FORMULA_STARTS = ("=", "+", "-", "@", "\t", "\r")
CSV_QUOTE = "'"  # what a text cell that begins with one of them (or with it) is written after


def csv_cell(value: object) -> object:
    """``value`` as a CSV cell holds it: a text that begins with one of :data:`FORMULA_STARTS` or with
    :data:`CSV_QUOTE` after a :data:`CSV_QUOTE`; anything else (a number, a negative one too) as it is."""
    if isinstance(value, str) and value.startswith((*FORMULA_STARTS, CSV_QUOTE)):
        return CSV_QUOTE + value
    return value


def csv_text(df: pd.DataFrame) -> str:
    """``df`` as a CSV file of agg-bench holds it, every text cell as :func:`csv_cell` writes it (the module
    docstring): every CSV the report, ``learning`` and ``campaign`` write. Rows end in a newline; a cell holding a
    carriage return or a newline (a run folder's path may) is quoted, so that a reader gives it back whole."""
    out = df.copy()
    for column in out.columns:
        if pd.api.types.is_object_dtype(out[column]) or pd.api.types.is_string_dtype(out[column]):  # text, or mixed
            out[column] = out[column].map(csv_cell)
    text = out.to_csv(index=False, lineterminator="\n")
    if "\r" not in text:
        return text
    # Python's csv writer (pandas' too) quotes a field holding a character of its line terminator, so under "\n"
    # a lone "\r" went unquoted and a reader ended the row there: the rows are written with "\r\n", which quotes
    # every field holding either, and each is given its "\n" back (the quoted fields as written)
    rows = csv.reader(io.StringIO(out.to_csv(index=False, lineterminator="\r\n"), newline=""))
    return "".join(map(_csv_line, rows))


def _csv_line(cells: list[str]) -> str:
    """One row of cells as :func:`csv_text` writes it: quoted where pandas quotes, and where a cell holds a
    carriage return."""
    line = io.StringIO()
    csv.writer(line, lineterminator="\r\n").writerow(cells)
    return line.getvalue()[:-2] + "\n"


def table_csv(df: pd.DataFrame) -> str:
    """``df`` as its CSV file holds it: every column, NaN as empty, counts as integers, text cells as
    :func:`csv_text` writes them."""
    return csv_text(integer_columns(df))


def write_table(df: pd.DataFrame, out_dir: str | Path, name: str, status_column: str | None = "status") -> list[Path]:
    """``out_dir/name.csv`` (:func:`table_csv`), ``name.md`` and ``name.html``, each written atomically;
    returns their paths."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    df = integer_columns(df)
    status = status_column if status_column in df.columns else None
    paths = [out_dir / f"{name}.{ext}" for ext in TABLE_FORMATS]
    for path in paths:
        if path.suffix == ".csv":
            write_text(path, csv_text(df))
        elif path.suffix == ".md":
            write_text(path, to_markdown(df, status))
        else:
            write_text(path, to_html(df, name, status))
    return paths


# tables whose Markdown and HTML show a failed run's status in the cells it left empty
STATUS_TABLES = ("summary", "efficiency")


def write_tables(records: pd.DataFrame, tables: dict[str, pd.DataFrame], out_dir: str | Path) -> list[Path]:
    """``out_dir/records.csv`` and every table of ``tables`` (CSV, Markdown, HTML); returns their paths."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    write_text(out_dir / "records.csv", table_csv(records))
    paths = [out_dir / "records.csv"]
    for name, table in tables.items():
        paths += write_table(table, out_dir, name, status_column="status" if name in STATUS_TABLES else None)
    return paths
