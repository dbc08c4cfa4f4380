"""Comparison tables (CSV + Markdown) and plots (PNG) from run folders and gradcheck CSVs.

Inputs are what other commands wrote: run folders (``metrics.jsonl``, ``summary.json``,
``config.json``) from ``agg-bench run`` or ``agg-bench import-log``, and gradcheck CSVs from
``agg-bench gradcheck``. The workflow passes a manifest (JSON) that names every run with its sweep
labels; without one, labels come from the records themselves.

Tables (``write_tables``):
- ``records``: every iteration record with its labels (the long format the plots read);
- ``efficiency``: one row per method x model x resolution x hardware (seeds averaged): seconds per
  iteration split into rollout / reward / train, speedup over ``full``, passes per iteration, peak
  memory, images/s, final reward, mean reward over a common wall-clock horizon, gradient cosine;
- ``ablation``: gradcheck rows, W x alpha x route_frac x reuse -> cosine, relative error, passes, time;
- ``gpus``: the efficiency table pivoted by hardware (GPU name, or the device label without a GPU).

Conventions: a value that was not measured is empty (NaN), never 0; a run that ended in OOM, divergence
or an error keeps its status, and the Markdown tables show that status in the cells it left empty.
Timings average the iterations after ``warmup`` (the first iteration pays one-off costs).
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

import numpy as np
import pandas as pd

from .errors import UserError
from .gradcheck import OPTION_COLUMNS
from .io import atomic_path, read_jsonl
from .train import RECORD_KEYS

MIB = 1024 ** 2
PHASES = ("t_rollout_s", "t_reward_s", "t_train_s")
PASS_KEYS = ("forward_nograd", "forward_grad", "backward")
MEMORY_KEYS = {  # record key (bytes, max over a run) -> table column (MiB)
    "peak_alloc_bytes": "peak_alloc_mib",
    "nvml_peak_used_bytes": "nvml_peak_mib",
    "saved_activation_peak_bytes": "saved_act_mib",
    "rss_peak_bytes": "rss_peak_mib",
    # the run's plan.json (agg_bench.memplan), shown beside the peaks it predicts
    "planned_activation_bytes": "planned_act_mib",
    "planned_total_bytes": "planned_total_mib",
}
# columns that identify a row of the efficiency table; seeds are averaged inside a row
ROW_KEYS = ["method", "model", "resolution", "hardware", "source"]
# rows compared with each other: speedup and the wall-clock horizon are taken within these
GROUP_KEYS = ["model", "resolution", "hardware", "source"]
STATUS_ORDER = ("error", "oom", "diverged", "interrupted", "ok")
# estimator options a gradcheck row is matched on: those with their own gradcheck column
GRADCHECK_OPTIONS = OPTION_COLUMNS
# record keys that are identity, not measurements (method extras are everything else that is numeric)
_IDENTITY = {"run_id", "method", "model", "resolution", "device", "gpu_name", "n_gpus", "seed", "iteration",
             "status", "source", "weights", *MEMORY_KEYS}


@dataclass
class RunEntry:
    """One run folder and the labels it is shown under (None: taken from its records)."""

    dir: Path
    method: str | None = None
    model: str | None = None
    resolution: int | None = None
    device: str | None = None
    seed: int | None = None
    method_options: dict | None = None


@dataclass
class GradcheckEntry:
    """One gradcheck CSV and the model label / resolution it was measured at."""

    file: Path
    model: str | None = None
    resolution: int | None = None


@dataclass
class Manifest:
    runs: list[RunEntry] = field(default_factory=list)
    gradcheck: list[GradcheckEntry] = field(default_factory=list)
    warmup: int = 1


def load_manifest(path: str | Path) -> Manifest:
    """Read the workflow's manifest: ``{"runs": [...], "gradcheck": [...], "warmup": 1}``."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"manifest {path}: no such file")
    data = json.loads(path.read_text())
    runs = [RunEntry(**{**r, "dir": Path(r["dir"])}) for r in data.get("runs", [])]
    checks = [GradcheckEntry(**{**g, "file": Path(g["file"])}) for g in data.get("gradcheck", [])]
    return Manifest(runs, checks, int(data.get("warmup", 1)))


def discover_runs(paths: Iterable[str | Path]) -> list[RunEntry]:
    """Run folders in ``paths``: each path is a run folder or a folder of run folders."""
    out = []
    for path in map(Path, paths):
        if (path / "summary.json").exists() or (path / "metrics.jsonl").exists():
            out.append(RunEntry(path))
        elif path.is_dir():
            out.extend(RunEntry(p) for p in sorted(path.iterdir())
                       if (p / "summary.json").exists() or (p / "metrics.jsonl").exists())
        else:
            raise UserError(f"--runs {path}: not a run folder or a folder of run folders")
    return out


# --------------------------------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------------------------------


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return {}


def load_records(entries: Iterable[RunEntry]) -> pd.DataFrame:
    """One row per iteration record, with the labels the tables group by.

    Added columns: ``method_name`` (the estimator), ``method_options`` (JSON), ``hardware``, ``source``
    (measured | imported), ``run_status`` (the summary's status) and ``run_dir``. A run that wrote no
    record (it failed while starting) still gets one row, with its status and no measurements.
    """
    rows = []
    for entry in entries:
        run_dir = Path(entry.dir)
        summary = _read_json(run_dir / "summary.json")
        config = _read_json(run_dir / "config.json")
        metrics = run_dir / "metrics.jsonl"
        records = list(read_jsonl(metrics)) if metrics.exists() else []
        if not summary and not records:
            raise UserError(f"run {run_dir}: no summary.json or metrics.jsonl")
        # a run killed before writing its summary has records but no final status
        status = summary.get("status") or "interrupted"
        if not records:
            records = [{k: summary.get(k) for k in ("run_id", "method", "model", "resolution", "device",
                                                    "gpu_name", "n_gpus", "seed")}]
            records[0]["status"] = status
        options = entry.method_options
        if options is None:
            options = dict(config.get("method") or {"name": records[0].get("method")})
        source = summary.get("source") or records[0].get("source") or "measured"
        planned = _read_json(run_dir / "plan.json").get("bytes") or {}
        for record in records:
            row = dict(record)
            row["method_name"] = options.get("name", record.get("method"))
            row["method_options"] = json.dumps(options, sort_keys=True)
            for key in ("method", "model", "resolution", "device", "seed"):
                value = getattr(entry, key)
                if value is not None:
                    row[key] = value
            row["source"] = source
            row["weights"] = record.get("weights") or summary.get("weights")
            row["planned_activation_bytes"] = planned.get("activations")
            row["planned_total_bytes"] = planned.get("total_per_gpu")
            row["run_status"] = status
            row["run_dir"] = str(run_dir)
            rows.append(row)
    df = pd.DataFrame(rows)
    if df.empty:
        return df
    for key in ("gpu_name", "n_gpus", "device", "status"):
        if key not in df:
            df[key] = None
    df["hardware"] = [_hardware(g, n, d) for g, n, d in zip(df["gpu_name"], df["n_gpus"], df["device"])]
    return df


def _hardware(gpu_name, n_gpus, device) -> str:
    """"NVIDIA H200", "8x NVIDIA H200", or the device label when no GPU is named."""
    if isinstance(gpu_name, str) and gpu_name:
        n = int(n_gpus) if _is_number(n_gpus) else 1
        return gpu_name if n <= 1 else f"{n}x {gpu_name}"
    return str(device) if isinstance(device, str) and device else "unknown"


def _is_number(value) -> bool:
    return isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool) \
        and math.isfinite(float(value))


def load_gradcheck(entries: Iterable[GradcheckEntry]) -> pd.DataFrame:
    """All gradcheck rows, the model column holding the manifest's label (the family is kept as
    ``family``) and ``resolution`` added."""
    frames = []
    for entry in entries:
        if not Path(entry.file).exists():
            raise UserError(f"gradcheck {entry.file}: no such file")
        df = pd.read_csv(entry.file)
        if "model" in df:
            df = df.rename(columns={"model": "family"})
        df["model"] = entry.model if entry.model is not None else df.get("family", pd.Series([None] * len(df)))
        df["resolution"] = entry.resolution
        frames.append(df)
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()


# --------------------------------------------------------------------------------------------------
# Tables
# --------------------------------------------------------------------------------------------------


def combine_status(statuses: Iterable[str]) -> str:
    """The status of a cell that averages several runs: the worst of theirs."""
    present = {s if s in STATUS_ORDER else "error" for s in statuses if isinstance(s, str)}
    for status in STATUS_ORDER:
        if status in present:
            return status
    return "ok"


def reward_curve(run: pd.DataFrame) -> tuple[np.ndarray, np.ndarray]:
    """(cumulative wall-clock seconds at the end of each ok iteration, its reward)."""
    ok = run[(run["status"] == "ok") & run["t_iter_s"].notna() & run["reward_mean"].notna()]
    ok = ok.sort_values("iteration")
    return np.cumsum(ok["t_iter_s"].to_numpy(float)), ok["reward_mean"].to_numpy(float)


def mean_reward_until(times: np.ndarray, rewards: np.ndarray, horizon: float) -> float:
    """Mean of the reward-vs-wall-clock curve over [0, horizon] (area / horizon).

    The curve joins the (end-of-iteration time, reward) points linearly and holds the first reward before
    the first point, so runs of different speeds are compared over the same seconds.
    """
    if len(times) == 0 or not horizon > 0 or times[-1] < horizon * (1 - 1e-9):
        return float("nan")
    xs = np.concatenate([[0.0], times])
    ys = np.concatenate([[rewards[0]], rewards])
    inside = xs < horizon
    xs = np.concatenate([xs[inside], [horizon]])
    ys = np.concatenate([ys[inside], [np.interp(horizon, times, rewards)]])
    area = float(np.sum((xs[1:] - xs[:-1]) * (ys[1:] + ys[:-1]) / 2))
    return area / horizon


def _extra_keys(records: pd.DataFrame) -> list[str]:
    """Method-specific numeric record fields (cache_hit_rate, ratio_dev, ...), averaged per run."""
    known = set(RECORD_KEYS) | _IDENTITY | {"gpu_util_mean", "power_mean_w", "method_name", "method_options",
                                           "hardware", "source", "run_status", "run_dir"}
    return [c for c in records.columns if c not in known and pd.api.types.is_numeric_dtype(records[c])
            and records[c].notna().any()]


def run_table(records: pd.DataFrame, warmup: int = 1, extras: list[str] | None = None) -> pd.DataFrame:
    """One row per run folder: status, mean phase times after ``warmup``, passes, memory peaks, rewards."""
    extras = _extra_keys(records) if extras is None else extras
    out = []
    for run_dir, run in records.groupby("run_dir", sort=False):
        first = run.iloc[0]
        ok = run[run["status"] == "ok"].sort_values("iteration") if "iteration" in run else run.iloc[0:0]
        timed = ok.iloc[warmup:] if len(ok) > warmup else ok
        row: dict[str, Any] = {k: first.get(k) for k in (*ROW_KEYS, "method_name", "method_options", "device",
                                                         "gpu_name", "n_gpus", "seed", "run_dir", "weights")}
        record_status = combine_status(run["status"]) if "status" in run else "ok"
        row["status"] = combine_status([first["run_status"], record_status])
        row["iterations"] = len(ok)
        for key in (*PHASES, "t_iter_s", "images_per_s"):
            row[key] = _mean(timed, key)
        for key in PASS_KEYS:
            row[key] = _mean(ok, key)
        for key, column in MEMORY_KEYS.items():
            peak = pd.to_numeric(run[key], errors="coerce").max() if key in run else float("nan")
            row[column] = peak / MIB if _is_number(peak) else float("nan")
        rewards = ok["reward_mean"].dropna() if "reward_mean" in ok else pd.Series(dtype=float)
        row["final_reward"] = float(rewards.iloc[-1]) if len(rewards) else float("nan")
        times, values = reward_curve(run) if {"t_iter_s", "reward_mean"} <= set(run) else (np.array([]),) * 2
        if row["weights"] == "random":  # random weights: rewards say nothing about quality
            row["final_reward"], values = float("nan"), np.full(len(values), np.nan)
        row["wall_s"] = float(times[-1]) if len(times) else float("nan")
        row["_curve"] = (times, values)
        for key in extras:
            row[key] = _mean(ok, key)
        out.append(row)
    return pd.DataFrame(out)


def _mean(df: pd.DataFrame, key: str) -> float:
    if key not in df:
        return float("nan")
    values = pd.to_numeric(df[key], errors="coerce").dropna()
    return float(values.mean()) if len(values) else float("nan")


def _baseline_mask(df: pd.DataFrame) -> pd.Series:
    """Rows that are the ``full`` reference of their group (label ``full`` preferred over other
    labels of the same estimator)."""
    is_full = df["method_name"] == "full"
    labelled = is_full & (df["method"] == "full")
    has_label = labelled.groupby([df[k] for k in GROUP_KEYS], dropna=False).transform("any")
    return labelled | (is_full & ~has_label)


def efficiency_table(records: pd.DataFrame, gradcheck: pd.DataFrame | None = None, warmup: int = 1) -> pd.DataFrame:
    """method x model x resolution x hardware (x source) -> times, speedup, passes, memory, rewards,
    gradient cosine to ``full``; seeds averaged; OOM/diverged runs keep their status."""
    if records.empty:
        return pd.DataFrame(columns=EFFICIENCY_COLUMNS)
    extras = _extra_keys(records)
    runs = run_table(records, warmup, extras)
    runs["resolution"] = runs["resolution"].astype("Int64")

    # common wall-clock horizon per group: the shortest run that finished ok
    runs["reward_area"] = float("nan")
    for _, group in runs.groupby(GROUP_KEYS, dropna=False):
        finished = group[(group["status"] == "ok") & group["wall_s"].notna()]
        if finished.empty:
            continue
        horizon = float(finished["wall_s"].min())
        for idx in finished.index:
            times, values = runs.at[idx, "_curve"]
            runs.at[idx, "reward_area"] = mean_reward_until(times, values, horizon)

    numeric = [c for c in runs.columns if c not in (*ROW_KEYS, "method_name", "method_options", "device",
                                                     "gpu_name", "seed", "run_dir", "status", "_curve", "weights")]
    cells = []
    for key, group in runs.groupby(ROW_KEYS, dropna=False, sort=False):
        cell = dict(zip(ROW_KEYS, key))
        first = group.iloc[0]
        cell.update(method_name=first["method_name"], method_options=first["method_options"],
                    device=first["device"], gpu_name=first["gpu_name"], weights=first["weights"],
                    status=combine_status(group["status"]), seeds=int(group["seed"].nunique(dropna=False)))
        ok = group[group["status"] == "ok"]
        measured = ok if len(ok) else group  # a failed cell shows what its runs measured before failing
        for column in numeric:
            values = pd.to_numeric(measured[column], errors="coerce").dropna()
            cell[column] = float(values.mean()) if len(values) else float("nan")
        if cell["status"] == "oom":  # the iteration that ran out of memory has no times or rewards
            for column in (*PHASES, "t_iter_s", "images_per_s", "final_reward", "reward_area", "wall_s"):
                cell[column] = float("nan")
        cells.append(cell)
    table = pd.DataFrame(cells)

    # speedup over the group's `full` row; only between cells that both finished ok
    base = table[_baseline_mask(table)].drop_duplicates(GROUP_KEYS)
    base = base[GROUP_KEYS + ["t_iter_s", "t_train_s", "status"]].rename(
        columns={"t_iter_s": "_ref_iter", "t_train_s": "_ref_train", "status": "_ref_status"})
    table = table.merge(base, on=GROUP_KEYS, how="left")
    usable = (table["_ref_status"] == "ok") & (table["status"] == "ok")
    table["speedup"] = (table["_ref_iter"] / table["t_iter_s"]).where(usable)
    table["train_speedup"] = (table["_ref_train"] / table["t_train_s"]).where(usable)

    table["grad_cosine"], table["grad_rel_error"] = _match_gradcheck(table, gradcheck)
    columns = [c for c in EFFICIENCY_COLUMNS if c in table] + extras + ["method_options"]
    table = table.assign(_imported=table["source"] == "imported")[columns + ["_imported"]]
    table = table.sort_values(["_imported", "model", "resolution", "hardware"], kind="stable")
    return table.drop(columns="_imported").reset_index(drop=True)


EFFICIENCY_COLUMNS = [
    "method", "model", "resolution", "hardware", "source", "weights", "status", "method_name", "n_gpus", "seeds",
    "iterations", "t_rollout_s", "t_reward_s", "t_train_s", "t_iter_s", "speedup", "train_speedup",
    "forward_nograd", "forward_grad", "backward",
    "peak_alloc_mib", "nvml_peak_mib", "saved_act_mib", "planned_act_mib", "planned_total_mib", "rss_peak_mib",
    "images_per_s",
    "final_reward", "reward_area", "wall_s", "grad_cosine", "grad_rel_error",
]


def _same(a, b) -> bool:
    if isinstance(a, bool) or isinstance(b, bool):
        return _as_bool(a) == _as_bool(b)
    if _is_number(a) and _is_number(b):
        return math.isclose(float(a), float(b), rel_tol=1e-9, abs_tol=1e-12)
    return str(a) == str(b)


def _as_bool(value) -> bool | None:
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    if isinstance(value, str):
        return {"true": True, "false": False}.get(value.strip().lower())
    if _is_number(value):
        return bool(value)
    return None


def _match_gradcheck(table: pd.DataFrame, gradcheck: pd.DataFrame | None) -> tuple[list, list]:
    """Each row's cosine / relative error to ``full`` from the gradcheck row of the same model,
    resolution, estimator and options (NaN when none, or more than one, matches)."""
    cos, rel = [], []
    for _, row in table.iterrows():
        c = r = float("nan")
        if gradcheck is not None and not gradcheck.empty and row["source"] == "measured":
            options = json.loads(row["method_options"]) if isinstance(row["method_options"], str) else {}
            here = gradcheck[(gradcheck["model"] == row["model"])
                             & (pd.to_numeric(gradcheck["resolution"]) == row["resolution"])
                             & (gradcheck["method"] == row["method_name"])]
            keep = []
            for _, g in here.iterrows():
                if all(key not in options or pd.isna(g.get(key)) or _same(g[key], options[key])
                       for key in GRADCHECK_OPTIONS):
                    keep.append(g)
            if len(keep) == 1:
                c = float(keep[0].get("cosine_to_full", float("nan")))
                rel_value = keep[0].get("relative_error", float("nan"))
                r = float(rel_value) if _is_number(rel_value) else float("nan")
        cos.append(c)
        rel.append(r)
    return cos, rel


ABLATION_COLUMNS = ["model", "resolution", "method", "window", "alpha", "route_frac", "reuse_rollout_velocity",
                    "cache", "cosine_to_full", "relative_error", "forward_nograd", "forward_grad", "backward",
                    "backward_vs_full", "seconds", "speedup_vs_full", "cache_hit_rate"]


def ablation_table(gradcheck: pd.DataFrame) -> pd.DataFrame:
    """Gradcheck rows: W x alpha x route_frac x reuse -> cosine, relative error, passes, replay seconds,
    with the backward passes and the time relative to the ``full`` replay of the same snapshot."""
    if gradcheck.empty:
        return pd.DataFrame(columns=ABLATION_COLUMNS)
    df = gradcheck.copy()
    for column in ABLATION_COLUMNS:
        if column not in df:
            df[column] = float("nan")
    ref = df[df["method"] == "full"].groupby(["model", "resolution"])[["backward", "seconds"]].first()
    key = list(zip(df["model"], df["resolution"]))
    ref_back = pd.Series([ref["backward"].get(k, float("nan")) for k in key], index=df.index, dtype=float)
    ref_secs = pd.Series([ref["seconds"].get(k, float("nan")) for k in key], index=df.index, dtype=float)
    df["backward_vs_full"] = df["backward"].astype(float) / ref_back
    df["speedup_vs_full"] = ref_secs / df["seconds"].astype(float)
    order = {"full": 0, "agg": 1}
    df["_order"] = df["method"].map(lambda m: order.get(m, 2))
    df = df.sort_values(["model", "resolution", "_order", "method", "window", "alpha", "route_frac",
                         "reuse_rollout_velocity"], kind="stable", na_position="first")
    return df[ABLATION_COLUMNS].reset_index(drop=True)


def peak_memory_mib(table: pd.DataFrame) -> pd.Series:
    """The most telling peak per row: NVML device memory, else CUDA allocated, else process RSS."""
    out = pd.Series(float("nan"), index=table.index)
    for column in ("rss_peak_mib", "peak_alloc_mib", "nvml_peak_mib"):
        if column in table:
            out = table[column].where(table[column].notna(), out)
    return out


def gpus_table(efficiency: pd.DataFrame) -> pd.DataFrame:
    """The efficiency table pivoted by hardware: per hardware, s/iter, speedup and peak memory."""
    keys = ["method", "model", "resolution", "source"]
    if efficiency.empty:
        return pd.DataFrame(columns=keys)
    df = efficiency.assign(peak_mem_mib=peak_memory_mib(efficiency))
    wide = df[keys].drop_duplicates()
    for hardware, part in df.groupby("hardware", sort=False):
        part = part[keys + ["t_iter_s", "speedup", "peak_mem_mib"]].drop_duplicates(keys)
        part = part.rename(columns={v: f"{v} [{hardware}]" for v in ("t_iter_s", "speedup", "peak_mem_mib")})
        wide = wide.merge(part, on=keys, how="left")
    return wide.reset_index(drop=True)


# --------------------------------------------------------------------------------------------------
# Writing
# --------------------------------------------------------------------------------------------------

FORMATS: dict[str, Callable[[float], str]] = {
    "speedup": lambda v: f"{v:.2f}x", "train_speedup": lambda v: f"{v:.2f}x",
    "speedup_vs_full": lambda v: f"{v:.2f}x", "backward_vs_full": lambda v: f"{v:.2f}",
    "cosine_to_full": lambda v: f"{v:.5f}", "grad_cosine": lambda v: f"{v:.5f}",
    "relative_error": lambda v: f"{v:.3g}", "grad_rel_error": lambda v: f"{v:.3g}",
}


# cells a failed run leaves empty; the Markdown shows the run's status there
FAILURE_COLUMNS = (*PHASES, "t_iter_s", "speedup", "train_speedup", "images_per_s", "final_reward",
                   "reward_area", "wall_s")


def _format(column: str, value) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)) or value is pd.NA:
        return ""
    if isinstance(value, (bool, np.bool_)):
        return "yes" if value else "no"
    kind = column.split(" [")[0]  # "speedup [NVIDIA H200]" is formatted as "speedup"
    if kind in FORMATS and _is_number(value):
        return FORMATS[kind](float(value))
    if isinstance(value, (int, np.integer)):
        return str(int(value))
    if isinstance(value, (float, np.floating)):
        v = float(value)
        if v.is_integer() and abs(v) < 1e6 and (column in PASS_KEYS or column in ("seeds", "iterations", "n_gpus")):
            return str(int(v))
        return f"{v:.4g}"
    return str(value).replace("|", "\\|")


def to_markdown(df: pd.DataFrame, status_column: str | None = "status", empty: str = "—") -> str:
    """A GitHub Markdown table. In a row whose status is not ok, the time, speedup and reward cells it
    left empty show the status (``OOM``, ``DIVERGED``, ...); other empty cells show ``empty``. Imported
    rows are marked in the method column."""
    columns = [c for c in df.columns if c != "method_options"]
    lines = ["| " + " | ".join(columns) + " |", "|" + "|".join("---" for _ in columns) + "|"]
    for _, row in df.iterrows():
        status = row.get(status_column) if status_column else None
        fill = status.upper() if isinstance(status, str) and status != "ok" else empty
        cells = []
        for column in columns:
            text = _format(column, row[column])
            if column == "method" and row.get("source") == "imported":
                text = f"{text} (imported)"
            cells.append(text or (fill if column in FAILURE_COLUMNS else empty))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def write_table(df: pd.DataFrame, out_dir: str | Path, name: str, status_column: str | None = "status") -> tuple[Path, Path]:
    """``out_dir/name.csv`` (every column, NaN as empty) and ``out_dir/name.md``, each written atomically."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    csv_path, md_path = out_dir / f"{name}.csv", out_dir / f"{name}.md"
    tmp = atomic_path(csv_path)
    df.to_csv(tmp, index=False)
    tmp.replace(csv_path)
    tmp = atomic_path(md_path)
    tmp.write_text(to_markdown(df, status_column if status_column in df.columns else None))
    tmp.replace(md_path)
    return csv_path, md_path


TABLES = ("efficiency", "ablation", "gpus")


def write_tables(records: pd.DataFrame, gradcheck: pd.DataFrame, out_dir: str | Path, warmup: int = 1) -> dict[str, pd.DataFrame]:
    """Write records.csv and every table (CSV + Markdown) under ``out_dir``; return the tables."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = atomic_path(out_dir / "records.csv")
    records.to_csv(tmp, index=False)
    tmp.replace(out_dir / "records.csv")
    efficiency = efficiency_table(records, gradcheck, warmup)
    tables = {"efficiency": efficiency, "ablation": ablation_table(gradcheck), "gpus": gpus_table(efficiency)}
    write_table(tables["efficiency"], out_dir, "efficiency")
    write_table(tables["ablation"], out_dir, "ablation", status_column=None)
    write_table(tables["gpus"], out_dir, "gpus", status_column=None)
    return tables


# --------------------------------------------------------------------------------------------------
# Plots
# --------------------------------------------------------------------------------------------------

PLOTS = ("reward_iteration", "reward_wallclock", "memory_resolution", "time_breakdown", "gradcheck_cosine")


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _panels(plt, keys: list, ncols: int, width: float = 4.2, height: float = 3.2):
    nrows = max(1, math.ceil(len(keys) / ncols))
    fig, axes = plt.subplots(nrows, ncols, figsize=(width * ncols, height * nrows), squeeze=False)
    for ax in axes.flat[len(keys):]:
        ax.set_visible(False)
    return fig, list(axes.flat)


def _colors(labels: list[str]) -> dict[str, Any]:
    import matplotlib

    cmap = matplotlib.colormaps["tab10" if len(set(labels)) <= 10 else "tab20"]
    return {label: cmap(i % cmap.N) for i, label in enumerate(dict.fromkeys(labels))}


def _save(fig, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = atomic_path(path)
    fig.savefig(tmp, dpi=110, bbox_inches="tight", format="png")
    tmp.replace(path)


def _empty_figure(plt, path: Path, message: str) -> None:
    fig, ax = plt.subplots(figsize=(5, 2))
    ax.axis("off")
    ax.text(0.5, 0.5, message, ha="center", va="center")
    _save(fig, path)
    plt.close(fig)


def _label(row) -> str:
    return f"{row['method']} (imported)" if row.get("source") == "imported" else str(row["method"])


def plot_rewards(records: pd.DataFrame, path: Path, x: str) -> None:
    """Reward per iteration (``x="iteration"``) or per wall-clock second (``x="wallclock"``), one line
    per method, one panel per model x resolution x hardware."""
    plt = _pyplot()
    ok = records[(records["status"] == "ok") & records["reward_mean"].notna()] if not records.empty else records
    if "weights" in ok:  # random-weight rewards compare nothing
        ok = ok[ok["weights"] != "random"]
    if ok.empty:
        return _empty_figure(plt, path, "no iteration finished")
    ok = ok.sort_values("iteration")
    keys = list(dict.fromkeys(zip(ok["model"], ok["resolution"], ok["hardware"])))
    fig, axes = _panels(plt, keys, ncols=min(3, len(keys)))
    colors = _colors(ok.apply(_label, axis=1))
    for ax, key in zip(axes, keys):
        panel = ok[(ok["model"] == key[0]) & (ok["resolution"] == key[1]) & (ok["hardware"] == key[2])]
        for (label, _), curve in panel.assign(label=panel.apply(_label, axis=1)).groupby(["label", "run_dir"], sort=False):
            xs = curve["iteration"] if x == "iteration" else curve["t_iter_s"].cumsum()
            style = "--" if "(imported)" in label else "-"
            ax.plot(xs, curve["reward_mean"], style, marker=".", color=colors[label], label=label)
        ax.set_title(f"{key[0]} {key[1]} px, {key[2]}", fontsize=9)
        ax.set_xlabel("iteration" if x == "iteration" else "wall-clock (s)")
        ax.set_ylabel("mean reward")
        ax.grid(alpha=0.3)
    _legend(fig, axes)
    _save(fig, path)
    plt.close(fig)


def _legend(fig, axes) -> None:
    handles, labels = {}, []
    for ax in axes:
        for h, label in zip(*ax.get_legend_handles_labels()):
            if label not in handles:
                handles[label] = h
                labels.append(label)
    if handles:
        fig.legend([handles[k] for k in labels], labels, loc="upper center", bbox_to_anchor=(0.5, 0.0),
                   ncol=min(5, len(labels)), fontsize=8, frameon=False)
        fig.tight_layout()


def plot_memory(efficiency: pd.DataFrame, path: Path) -> None:
    """Peak memory vs resolution per method, one panel per model x hardware. CUDA allocator peak where
    measured, else the peak of saved activations (on CPU the allocator has no peak)."""
    plt = _pyplot()
    df = efficiency[efficiency["source"] == "measured"] if not efficiency.empty else efficiency
    if df.empty:
        return _empty_figure(plt, path, "no measured runs")
    use_alloc = df["peak_alloc_mib"].notna().any()
    column = "peak_alloc_mib" if use_alloc else "saved_act_mib"
    what = "peak allocated (MiB)" if use_alloc else "peak saved activations (MiB)"
    keys = list(dict.fromkeys(zip(df["model"], df["hardware"])))
    fig, axes = _panels(plt, keys, ncols=min(3, len(keys)))
    colors = _colors(df["method"])
    for ax, (model, hardware) in zip(axes, keys):
        panel = df[(df["model"] == model) & (df["hardware"] == hardware)]
        for method, line in panel.groupby("method", sort=False):
            line = line.sort_values("resolution")
            ax.plot(line["resolution"].astype(float), line[column], marker="o", color=colors[method], label=method)
            for _, bad in line[line["status"] == "oom"].iterrows():
                ax.annotate("OOM", (float(bad["resolution"]), 0), color=colors[method], fontsize=7)
        ax.set_title(f"{model}, {hardware}", fontsize=9)
        ax.set_xlabel("resolution (px)")
        ax.set_ylabel(what)
        ax.grid(alpha=0.3)
    _legend(fig, axes)
    _save(fig, path)
    plt.close(fig)


def plot_time_breakdown(efficiency: pd.DataFrame, path: Path) -> None:
    """Stacked seconds per iteration (rollout / reward / train / the rest) per method, one panel per
    model x resolution x hardware."""
    plt = _pyplot()
    df = efficiency[efficiency["t_iter_s"].notna()] if not efficiency.empty else efficiency
    if df.empty:
        return _empty_figure(plt, path, "no timed iterations")
    keys = list(dict.fromkeys(zip(df["model"], df["resolution"], df["hardware"])))
    fig, axes = _panels(plt, keys, ncols=min(3, len(keys)), width=5.0)
    phase_colors = {"t_rollout_s": "#4c72b0", "t_reward_s": "#dd8452", "t_train_s": "#55a868"}
    names = {"t_rollout_s": "rollout", "t_reward_s": "reward", "t_train_s": "train"}
    for ax, key in zip(axes, keys):
        panel = df[(df["model"] == key[0]) & (df["resolution"] == key[1]) & (df["hardware"] == key[2])]
        labels = [_label(r) for _, r in panel.iterrows()]
        bottom = np.zeros(len(panel))
        for phase in PHASES:
            values = panel[phase].fillna(0).to_numpy(float)
            ax.bar(range(len(panel)), values, bottom=bottom, color=phase_colors[phase], label=names[phase])
            bottom += values
        # the rest of the iteration (advantages, optimizer step), or all of it for a log without phases
        rest = np.clip(panel["t_iter_s"].to_numpy(float) - bottom, 0, None)
        ax.bar(range(len(panel)), rest, bottom=bottom, color="#b0b0b0", label="other / not split")
        ax.set_xticks(range(len(panel)), labels, rotation=60, ha="right", fontsize=7)
        ax.set_title(f"{key[0]} {key[1]} px, {key[2]}", fontsize=9)
        ax.set_ylabel("seconds per iteration")
        ax.grid(alpha=0.3, axis="y")
    _legend(fig, axes)
    _save(fig, path)
    plt.close(fig)


def plot_gradcheck(ablation: pd.DataFrame, path: Path) -> None:
    """Gradient cosine to ``full`` vs W, one line per alpha x route_frac x reuse, one panel per model x
    resolution."""
    plt = _pyplot()
    df = ablation[(ablation["method"] == "agg") & ablation["window"].notna()] if not ablation.empty else ablation
    if df.empty:
        return _empty_figure(plt, path, "no AGG gradcheck results")
    keys = list(dict.fromkeys(zip(df["model"], df["resolution"])))
    fig, axes = _panels(plt, keys, ncols=min(3, len(keys)))
    series = ["alpha", "route_frac", "reuse_rollout_velocity"]
    # color: alpha x route_frac; dashed: rollout-velocity reuse (same gradient, fewer no-grad passes)
    colors = _colors([f"alpha={a}, route={r:g}" for a, r in zip(df["alpha"], df["route_frac"].astype(float))])
    for ax, (model, resolution) in zip(axes, keys):
        panel = df[(df["model"] == model) & (df["resolution"] == resolution)]
        for key, line in panel.groupby(series, dropna=False, sort=False):
            line = line.sort_values("window")
            base = f"alpha={key[0]}, route={float(key[1]):g}"
            reuse = _as_bool(key[2])
            ax.plot(line["window"].astype(float), line["cosine_to_full"].astype(float), "--" if reuse else "-",
                    marker="o", color=colors[base], label=base + (", reuse" if reuse else ""))
        ax.set_title(f"{model} {resolution} px", fontsize=9)
        ax.set_xlabel("W (steps per group)")
        ax.set_ylabel("gradient cosine to full")
        ax.grid(alpha=0.3)
    _legend(fig, axes)
    _save(fig, path)
    plt.close(fig)


def write_plots(records: pd.DataFrame, tables: dict[str, pd.DataFrame], out_dir: str | Path) -> list[Path]:
    """Every plot of PLOTS as ``out_dir/<name>.png``; a plot without data says so in its image."""
    out_dir = Path(out_dir)
    paths = {name: out_dir / f"{name}.png" for name in PLOTS}
    plot_rewards(records, paths["reward_iteration"], "iteration")
    plot_rewards(records, paths["reward_wallclock"], "wallclock")
    plot_memory(tables["efficiency"], paths["memory_resolution"])
    plot_time_breakdown(tables["efficiency"], paths["time_breakdown"])
    plot_gradcheck(tables["ablation"], paths["gradcheck_cosine"])
    return list(paths.values())


def build_report(manifest: Manifest, tables_dir: str | Path | None = None, plots_dir: str | Path | None = None) -> dict:
    """Load ``manifest``'s runs and gradcheck CSVs; write the tables and/or the plots."""
    if not manifest.runs:
        raise UserError("report: no runs to report (give --manifest or --runs)")
    records = load_records(manifest.runs)
    gradcheck = load_gradcheck(manifest.gradcheck)
    if tables_dir is not None:
        tables = write_tables(records, gradcheck, tables_dir, manifest.warmup)
    else:
        efficiency = efficiency_table(records, gradcheck, manifest.warmup)
        tables = {"efficiency": efficiency, "ablation": ablation_table(gradcheck), "gpus": gpus_table(efficiency)}
    if plots_dir is not None:
        write_plots(records, tables, plots_dir)
    return tables
