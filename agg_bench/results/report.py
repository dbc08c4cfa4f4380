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

- ``summary``: the efficiency table in a few readable columns (time per iteration as median [IQR],
  speedup [95 % CI], backward passes, peak memory, gradient cosine, final reward +- spread).
Each table is also written as HTML (``<name>.html``), the form the Snakemake report shows in the page.

Conventions: a value that was not measured is empty (NaN), never 0; a run that ended in OOM, divergence
or an error keeps its status, and the Markdown tables show that status in the cells it left empty.

Timings: every iteration after ``warmup`` (the first pays one-off costs) of every seed of a cell is one
sample; a cell shows the median of its samples and their 25th / 75th percentiles, and a speedup is the
ratio of two cells' medians with a seeded percentile-bootstrap 95 % interval (:mod:`agg_bench.results.stats`).
Which seconds: ``time="auto"`` takes the process's CPU time (``t_*_cpu_s``) on the CPU, where it does
not grow while other work shares the cores, and the wall-clock time (CUDA events) on a GPU; ``"cpu"``
and ``"wall"`` force one (a run without CPU times, e.g. an imported log, falls back to wall). The
``time_basis`` column says which one each row used. With calibration files (``agg-bench calibrate``),
``predicted_train_speedup`` is the train-phase speedup that the counted passes explain at the measured
unit costs, and ``prediction_check`` says whether the measured 95 % interval contains it.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

import numpy as np
import pandas as pd

from ..errors import ConfigError, UserError, quote
from ..io import read_jsonl, save_figure, write_text
from ..jsonfiles import read_json_object
from ..outdir import Contents, claimed_folders
from .plotting import pyplot
from .records import (
    GRADCHECK_OPTION_COLUMNS, PASS_KEYS, PHASE_TIME_KEYS, PLOTS, RECORD_KEYS, STANDARD_PHASES, TABLE_FORMATS, TABLES,
    TRAIN_PASS_KEYS, record_problem,
)
from .stats import paired_ratio_of_medians_ci, predicted_seconds, quartiles, ratio_of_medians_ci

MIB = 1024 ** 2
PHASES = PHASE_TIME_KEYS
MEMORY_KEYS = {  # record key (bytes, max over a run) -> table column (MiB)
    "peak_alloc_bytes": "peak_alloc_mib",
    "nvml_peak_used_bytes": "nvml_peak_mib",
    "saved_activation_peak_bytes": "saved_act_mib",
    "rss_peak_bytes": "rss_peak_mib",
    # the run's plan.json (agg_bench.runtime.memplan), shown beside the peaks it predicts
    "planned_activation_bytes": "planned_act_mib",
    "planned_total_bytes": "planned_total_mib",
}
# columns that identify a row of the efficiency table; seeds are averaged inside a row
ROW_KEYS = ["method", "model", "resolution", "hardware", "source"]
# rows compared with each other: speedup and the wall-clock horizon are taken within these
GROUP_KEYS = ["model", "resolution", "hardware", "source"]
STATUS_ORDER = ("error", "oom", "diverged", "interrupted", "ok")
# estimator options a gradcheck row is matched on: those with their own gradcheck column
GRADCHECK_OPTIONS = GRADCHECK_OPTION_COLUMNS
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
class CalibrationEntry:
    """One ``agg-bench calibrate`` JSON and the model label, resolution and device label it is matched
    to (None: taken from the file)."""

    file: Path
    model: str | None = None
    resolution: int | None = None
    device: str | None = None


TIME_BASES = ("auto", "cpu", "wall")


@dataclass
class Manifest:
    """What a report reads. ``warmup``: iterations of each run left out of the timings; ``time``: which
    seconds the timings and speedups use (``TIME_BASES``, see the module docstring)."""

    runs: list[RunEntry] = field(default_factory=list)
    gradcheck: list[GradcheckEntry] = field(default_factory=list)
    warmup: int = 1
    time: str = "auto"
    calibration: list[CalibrationEntry] = field(default_factory=list)


def check_time_basis(value, key: str = "report.time") -> str:
    """``value`` if it is one of ``TIME_BASES``; else a UserError naming ``key``."""
    if not isinstance(value, str) or value not in TIME_BASES:
        raise UserError(f"{key} = {value!r}: expected one of {', '.join(TIME_BASES)}")
    return value


def check_warmup(value, key: str = "report.warmup") -> int:
    """``value`` if it is an integer >= 0 (iterations left out of the timings); else a ConfigError naming ``key``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(key, value, "an integer >= 0 (iterations of each run left out of the timings)")
    return value


def _is_integer(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


# what a value of a report input holds: (test, words for the error)
TEXT = (lambda v: isinstance(v, str), "a string")
INTEGER = (_is_integer, "an integer")
NUMBER = (lambda v: _is_number(v) or (isinstance(v, float) and math.isnan(v)), "a number")
OBJECT = (lambda v: isinstance(v, dict), "an object")
# manifest section -> (its entry class, the key every entry needs, the keys an entry may have)
MANIFEST_SECTIONS = {
    "runs": (RunEntry, "dir", {"dir": TEXT, "method": TEXT, "model": TEXT, "resolution": INTEGER, "device": TEXT,
                               "seed": INTEGER, "method_options": OBJECT}),
    "gradcheck": (GradcheckEntry, "file", {"file": TEXT, "model": TEXT, "resolution": INTEGER}),
    "calibration": (CalibrationEntry, "file", {"file": TEXT, "model": TEXT, "resolution": INTEGER, "device": TEXT}),
}


def _check(where: str, value, kind: tuple, nullable: bool = True) -> None:
    """A UserError naming ``where`` unless ``value`` is of ``kind`` (or None, when ``nullable``)."""
    test, words = kind
    if not (test(value) or (nullable and value is None)):
        raise UserError(f"{where} = {quote(value)}: expected {words}{' or null' if nullable else ''}")


def load_manifest(path: str | Path) -> Manifest:
    """Read the workflow's manifest: ``{"runs": [...], "gradcheck": [...], "calibration": [...],
    "warmup": 1, "time": "auto"}`` (each entry an object; see ``MANIFEST_SECTIONS``). Anything else is a
    UserError naming the manifest and the key."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"manifest {path}: no such file")
    data = read_json_object(path, "a report manifest (an object with runs, gradcheck, calibration, warmup, time)")
    unknown = sorted(set(data) - {*MANIFEST_SECTIONS, "warmup", "time"})
    if unknown:
        raise UserError(f"manifest {path}: unknown key {unknown[0]!r}; expected some of "
                        f"{', '.join([*MANIFEST_SECTIONS, 'warmup', 'time'])}")
    sections = {}
    for section, (entry_class, required, keys) in MANIFEST_SECTIONS.items():
        entries = data.get(section, [])
        _check(f"manifest {path}: {section}", entries, (lambda v: isinstance(v, list), "a list"))
        sections[section] = []
        for i, entry in enumerate(entries or []):
            where = f"manifest {path}: {section}[{i}]"
            _check(where, entry, OBJECT, nullable=False)
            if required not in entry:
                raise UserError(f"{where}: missing {required!r}")
            for key, value in entry.items():
                if key not in keys:
                    raise UserError(f"{where}: unknown key {key!r}; expected some of {', '.join(keys)}")
                _check(f"{where}.{key}", value, keys[key], nullable=key != required)
            sections[section].append(entry_class(**{**entry, required: Path(entry[required])}))
    warmup = check_warmup(data.get("warmup", 1), f"manifest {path}: warmup")
    return Manifest(sections["runs"], sections["gradcheck"], warmup,
                    check_time_basis(data.get("time", "auto"), f"manifest {path}: time"), sections["calibration"])


def load_calibration(entries: Iterable[CalibrationEntry]) -> pd.DataFrame:
    """One row per calibration file: model, resolution, device labels and the unit costs as columns
    ``unit_<basis>_<kind>`` (seconds per sample, per optimizer step for ``optimizer_step``). A file that
    is not what ``agg-bench calibrate`` writes is a UserError naming it and the key."""
    rows = []
    for entry in entries:
        path = Path(entry.file)
        data = read_json_object(path, "an agg-bench calibrate JSON")
        where = f"calibration {path}"
        for key, kind in (("model", TEXT), ("resolution", INTEGER), ("device", TEXT),
                          ("unit_s_per_sample", OBJECT), ("methods", OBJECT)):
            _check(f"{where}: {key}", data.get(key), kind)
        row = {"model": entry.model if entry.model is not None else data.get("model"),
               "resolution": entry.resolution if entry.resolution is not None else data.get("resolution"),
               "device": entry.device if entry.device is not None else data.get("device")}
        for kind, by_basis in (data.get("unit_s_per_sample") or {}).items():
            _check(f"{where}: unit_s_per_sample.{kind}", by_basis, OBJECT, nullable=False)
            for basis, values in by_basis.items():
                _check(f"{where}: unit_s_per_sample.{kind}.{basis}", values, OBJECT, nullable=False)
                _check(f"{where}: unit_s_per_sample.{kind}.{basis}.median", values.get("median"), NUMBER)
                row[f"unit_{basis}_{kind}"] = values.get("median")
        # method label -> its train phase's seconds per round, timed side by side ({basis}_s lists)
        for label, timed in (data.get("methods") or {}).items():
            _check(f"{where}: methods.{label}", timed, OBJECT, nullable=False)
            for basis in TIME_BASES:
                seconds = timed.get(f"{basis}_s")
                _check(f"{where}: methods.{label}.{basis}_s", seconds,
                       (lambda v: isinstance(v, list) and all(NUMBER[0](x) for x in v), "a list of numbers"))
        row["methods"] = data.get("methods") or {}
        rows.append(row)
    return pd.DataFrame(rows)


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


def _run_file(run_dir: Path, name: str) -> dict:
    """The JSON object in the run folder's file ``name`` ({} when the run did not write one); a UserError
    naming the file when it is not a JSON object."""
    path = run_dir / name
    return read_json_object(path, f"the {name} of an agg-bench run (a JSON object)") if path.exists() else {}


def _run_section(data: dict, key: str, where: str) -> dict:
    """``data[key]``, an object ({} when absent or null); a UserError naming ``where`` and ``key`` otherwise."""
    _check(f"{where}: {key}", data.get(key), OBJECT)
    return data.get(key) or {}


def load_records(entries: Iterable[RunEntry]) -> pd.DataFrame:
    """One row per iteration record, with the labels the tables group by.

    Added columns: ``method_name`` (the estimator), ``method_options`` (JSON), ``hardware``, ``source``
    (measured | imported), ``run_status`` (the summary's status) and ``run_dir``. A run that wrote no
    record (it failed while starting) still gets one row, with its status and no measurements.
    """
    rows = []
    for entry in entries:
        run_dir = Path(entry.dir)
        summary = _run_file(run_dir, "summary.json")
        config = _run_file(run_dir, "config.json")
        metrics = run_dir / "metrics.jsonl"
        records = list(read_jsonl(metrics)) if metrics.exists() else []
        if not summary and not records:
            raise UserError(f"run {run_dir}: no summary.json or metrics.jsonl")
        for where, record in [(run_dir / "summary.json", summary),
                              *((f"{metrics}: record {i + 1}", r) for i, r in enumerate(records))]:
            problem = record_problem(record)
            if problem is not None:
                raise UserError(f"{where}: {problem}")
        # a run killed before writing its summary has records but no final status
        status = summary.get("status") or "interrupted"
        if not records:
            records = [{k: summary.get(k) for k in ("run_id", "method", "model", "resolution", "device",
                                                    "gpu_name", "n_gpus", "seed")}]
            records[0]["status"] = status
        options = entry.method_options
        if options is None:
            options = dict(_run_section(config, "method", run_dir / "config.json")
                           or {"name": records[0].get("method")})
        source = summary.get("source") or records[0].get("source") or "measured"
        planned = _run_section(_run_file(run_dir, "plan.json"), "bytes", run_dir / "plan.json")
        # optimizer steps per iteration, which the cost model prices; unknown without a config
        optimizer_steps = _run_section(config, "train", run_dir / "config.json").get("inner_epochs", 1) \
            if config else None
        _check(f"{run_dir / 'config.json'}: train.inner_epochs", optimizer_steps, INTEGER)
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
            row["optimizer_steps"] = optimizer_steps
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
                                           "hardware", "source", "run_status", "run_dir", "optimizer_steps"}
    return [c for c in records.columns if c not in known and pd.api.types.is_numeric_dtype(records[c])
            and records[c].notna().any()]


def run_table(records: pd.DataFrame, warmup: int = 1, extras: list[str] | None = None) -> pd.DataFrame:
    """One row per run folder: status, mean phase times after ``warmup``, passes, memory peaks, rewards."""
    extras = _extra_keys(records) if extras is None else extras
    out = []
    for run_dir, run in records.groupby("run_dir", sort=False):
        first = run.iloc[0]
        ok = run[run["status"] == "ok"].sort_values("iteration") if "iteration" in run else run.iloc[0:0]
        timed = _after_warmup(ok, warmup)
        row: dict[str, Any] = {k: first.get(k) for k in (*ROW_KEYS, "method_name", "method_options", "device",
                                                         "gpu_name", "n_gpus", "seed", "run_dir", "weights")}
        record_status = combine_status(run["status"]) if "status" in run else "ok"
        row["status"] = combine_status([first["run_status"], record_status])
        row["iterations"] = len(ok)
        for key in (*PHASES, "t_iter_s", "images_per_s"):
            row[key] = _mean(timed, key)
        for key in (*PASS_KEYS, *TRAIN_PASS_KEYS):
            row[key] = _mean(ok, key)
        for key, column in MEMORY_KEYS.items():
            peak = pd.to_numeric(run[key], errors="coerce").max() if key in run else float("nan")
            row[column] = peak / MIB if _is_number(peak) else float("nan")
        rewards = ok["reward_mean"].dropna() if "reward_mean" in ok else pd.Series(dtype=float)
        row["final_reward"] = float(rewards.iloc[-1]) if len(rewards) else float("nan")
        # the spread of the final iteration's sample rewards
        final_std = ok.loc[rewards.index[-1], "reward_std"] if len(rewards) and "reward_std" in ok else None
        row["final_reward_std"] = float(final_std) if _is_number(final_std) else float("nan")
        times, values = reward_curve(run) if {"t_iter_s", "reward_mean"} <= set(run) else (np.array([]),) * 2
        if row["weights"] == "random":  # random weights: rewards say nothing about quality
            row["final_reward"], values = float("nan"), np.full(len(values), np.nan)
        row["wall_s"] = float(times[-1]) if len(times) else float("nan")
        row["_curve"] = (times, values)
        for key in extras:
            row[key] = _mean(ok, key)
        out.append(row)
    return pd.DataFrame(out)


def _after_warmup(ok: pd.DataFrame, warmup: int) -> pd.DataFrame:
    """The ok iterations of one run (sorted) that timings use: all but the first ``warmup``, or all of
    them when the run has no more than that."""
    return ok.iloc[warmup:] if len(ok) > warmup else ok


def timed_records(records: pd.DataFrame, warmup: int = 1) -> pd.DataFrame:
    """Every record that timings sample: each run's ok iterations after its first ``warmup``."""
    if records.empty or "iteration" not in records:
        return records.iloc[0:0]
    ok = records[records["status"] == "ok"].sort_values("iteration", kind="stable")
    parts = [_after_warmup(run, warmup) for _, run in ok.groupby("run_dir", sort=False)]
    return pd.concat(parts) if parts else ok


# phases a table times (``t_<phase>_s``): the standard ones and the whole iteration
TIME_PHASES = (*STANDARD_PHASES, "iter")


def time_key(phase: str, basis: str) -> str:
    """The record key of ``phase``'s seconds in ``basis`` ("cpu": process CPU time, "wall")."""
    return f"t_{phase}_cpu_s" if basis == "cpu" else f"t_{phase}_s"


def time_basis(rows: pd.DataFrame, time: str) -> str:
    """The seconds a group of comparable rows is timed in: "wall" on a GPU under ``auto`` (CUDA-event
    times) or when ``time`` is "wall"; else "cpu" when every row has its CPU time, "wall" when not."""
    on_gpu = "gpu_name" in rows and rows["gpu_name"].map(lambda g: isinstance(g, str) and bool(g)).any()
    if time == "wall" or (time == "auto" and on_gpu):
        return "wall"
    cpu = pd.to_numeric(rows["t_iter_cpu_s"], errors="coerce") if "t_iter_cpu_s" in rows else None
    return "cpu" if cpu is not None and len(cpu) and cpu.notna().all() else "wall"


def _group_key(values) -> tuple:
    return tuple(str(v) for v in values)


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


def efficiency_table(records: pd.DataFrame, gradcheck: pd.DataFrame | None = None, warmup: int = 1,
                     time: str = "auto", calibration: pd.DataFrame | None = None) -> pd.DataFrame:
    """method x model x resolution x hardware (x source) -> times (median and quartiles of the iterations
    after ``warmup``, seeds pooled), speedups with 95 % intervals, the cost model's predicted train
    speedup (with ``calibration``, from :func:`load_calibration`), passes, memory, rewards, gradient
    cosine to ``full``; other numbers averaged over seeds; OOM/diverged runs keep their status."""
    check_time_basis(time, "time")
    if records.empty:
        return pd.DataFrame(columns=EFFICIENCY_COLUMNS)
    extras = _extra_keys(records)
    runs = run_table(records, warmup, extras)
    runs["resolution"] = runs["resolution"].astype("Int64")
    timed = timed_records(records, warmup)
    basis_of = {_group_key(key): time_basis(rows, time) for key, rows in timed.groupby(GROUP_KEYS, dropna=False)}

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
                                                     "gpu_name", "seed", "run_dir", "status", "_curve", *PHASES,
                                                     "t_iter_s", "weights")]
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
        samples = timed[timed["run_dir"].isin(set(measured["run_dir"]))]
        cell["time_basis"] = basis = basis_of.get(_group_key(cell[k] for k in GROUP_KEYS), "wall")
        cell["_samples"] = {}
        for phase in TIME_PHASES:
            key = time_key(phase, basis)
            values = pd.to_numeric(samples[key], errors="coerce").to_numpy(float) if key in samples else np.array([])
            cell[f"t_{phase}_p25_s"], cell[f"t_{phase}_s"], cell[f"t_{phase}_p75_s"] = quartiles(values)
            cell["_samples"][phase] = values
        cell["predicted_t_train_s"] = _predicted_train_seconds(cell, samples, calibration, basis)
        cell["_paired"] = _paired_train_seconds(cell, calibration, basis)
        cell["t_train_paired_s"] = float(np.median(cell["_paired"])) if len(cell["_paired"]) else float("nan")
        if cell["status"] == "oom":  # the iteration that ran out of memory has no times or rewards
            for column in (*TIME_COLUMNS, "images_per_s", "final_reward", "final_reward_std", "reward_area", "wall_s"):
                cell[column] = float("nan")
        cells.append(cell)
    table = pd.DataFrame(cells)

    # speedup over the group's `full` row; only between cells that both finished ok
    base = table[_baseline_mask(table)].drop_duplicates(GROUP_KEYS)
    base = base[GROUP_KEYS + ["t_iter_s", "t_train_s", "status", "_samples", "predicted_t_train_s", "_paired"]].rename(
        columns={"t_iter_s": "_ref_iter", "t_train_s": "_ref_train", "status": "_ref_status",
                 "_samples": "_ref_samples", "predicted_t_train_s": "_ref_predicted", "_paired": "_ref_paired"})
    table = table.merge(base, on=GROUP_KEYS, how="left")
    usable = (table["_ref_status"] == "ok") & (table["status"] == "ok")
    table["speedup"] = (table["_ref_iter"] / table["t_iter_s"]).where(usable)
    table["run_train_speedup"] = (table["_ref_train"] / table["t_train_s"]).where(usable)
    for name, phase in (("speedup", "iter"), ("run_train_speedup", "train")):
        bounds = [ratio_of_medians_ci(ref[phase], own[phase]) if ok and isinstance(ref, dict) else (float("nan"),) * 2
                  for ok, ref, own in zip(usable, table["_ref_samples"], table["_samples"])]
        table[f"{name}_lo"] = [lo for lo, _ in bounds]
        table[f"{name}_hi"] = [hi for _, hi in bounds]
    # the train speedup from the calibration's side-by-side timings where both rows have them (paired
    # rounds: one machine state for both), else from the runs' own iterations
    paired = [bool(ok) and isinstance(ref, np.ndarray) and len(ref) > 0 and len(ref) == len(own)
              for ok, ref, own in zip(usable, table["_ref_paired"], table["_paired"])]
    table["train_speedup_basis"] = ["paired" if p else ("runs" if ok else None) for p, ok in zip(paired, usable)]
    table["train_speedup"] = [
        float(np.median(ref) / np.median(own)) if p else run
        for p, ref, own, run in zip(paired, table["_ref_paired"], table["_paired"], table["run_train_speedup"])]
    for side, index in (("lo", 0), ("hi", 1)):
        table[f"train_speedup_{side}"] = [
            paired_ratio_of_medians_ci(ref, own)[index] if p else run
            for p, ref, own, run in zip(paired, table["_ref_paired"], table["_paired"], table[f"run_train_speedup_{side}"])]
    table["predicted_train_speedup"] = (table["_ref_predicted"] / table["predicted_t_train_s"]).where(usable)
    table["prediction_check"] = [
        _prediction_check(*values) for values in
        zip(table["train_speedup"], table["train_speedup_lo"], table["train_speedup_hi"], table["predicted_train_speedup"])]

    table["grad_cosine"], table["grad_rel_error"] = _match_gradcheck(table, gradcheck)
    columns = [c for c in EFFICIENCY_COLUMNS if c in table] + extras + ["method_options"]
    table = table.assign(_imported=table["source"] == "imported")[columns + ["_imported"]]
    table = table.sort_values(["_imported", "model", "resolution", "hardware"], kind="stable")
    return table.drop(columns="_imported").reset_index(drop=True)


def _predicted_train_seconds(cell: dict, samples: pd.DataFrame, calibration: pd.DataFrame | None, basis: str) -> float:
    """Seconds the cell's train phase costs at its calibration's unit costs: the mean counted train
    passes of its timed iterations and its optimizer steps, priced (NaN without a calibration)."""
    if calibration is None or calibration.empty or samples.empty:
        return float("nan")
    match = calibration[(calibration["model"].astype(str) == str(cell["model"]))
                        & (pd.to_numeric(calibration["resolution"], errors="coerce") == cell["resolution"])
                        & (calibration["device"].astype(str) == str(cell["device"]))]
    if match.empty:
        return float("nan")
    units = match.iloc[-1]
    kinds = (*PASS_KEYS, "optimizer_step")
    columns = (*TRAIN_PASS_KEYS, "optimizer_steps")
    counts = {kind: _mean(samples, column) for kind, column in zip(kinds, columns)}
    return predicted_seconds(counts, {kind: units.get(f"unit_{basis}_{kind}", float("nan")) for kind in kinds})


def _paired_train_seconds(cell: dict, calibration: pd.DataFrame | None, basis: str) -> np.ndarray:
    """The cell's method's train-phase seconds per round from its calibration's side-by-side timings
    (``agg-bench calibrate --method``), in ``basis``; empty when it has none."""
    if calibration is None or calibration.empty or "methods" not in calibration:
        return np.array([])
    match = calibration[(calibration["model"].astype(str) == str(cell["model"]))
                        & (pd.to_numeric(calibration["resolution"], errors="coerce") == cell["resolution"])
                        & (calibration["device"].astype(str) == str(cell["device"]))]
    if match.empty:
        return np.array([])
    timed = (match.iloc[-1]["methods"] or {}).get(str(cell["method"])) or {}
    return np.asarray(timed.get(f"{basis}_s") or [], dtype=np.float64)


def _prediction_check(measured, lo, hi, predicted) -> str | None:
    """Whether the measured speedup's interval contains the predicted one: "agrees", "faster than
    predicted", "slower than predicted"; None when either is missing."""
    if not all(_is_number(v) for v in (measured, lo, hi, predicted)):
        return None
    if lo <= predicted <= hi:
        return "agrees"
    return "faster than predicted" if measured > predicted else "slower than predicted"


# timing columns: median and quartiles of each phase's seconds
TIME_COLUMNS = [f"t_{phase}_{stat}" for phase in TIME_PHASES for stat in ("s", "p25_s", "p75_s")]

EFFICIENCY_COLUMNS = [
    "method", "model", "resolution", "hardware", "source", "weights", "status", "method_name", "n_gpus", "seeds",
    "iterations", "time_basis", *TIME_COLUMNS,
    "speedup", "speedup_lo", "speedup_hi", "train_speedup", "train_speedup_lo", "train_speedup_hi",
    "train_speedup_basis", "predicted_train_speedup", "prediction_check", "predicted_t_train_s", "t_train_paired_s",
    "run_train_speedup", "run_train_speedup_lo", "run_train_speedup_hi",
    "forward_nograd", "forward_grad", "backward", *TRAIN_PASS_KEYS,
    "peak_alloc_mib", "nvml_peak_mib", "saved_act_mib", "planned_act_mib", "planned_total_mib", "rss_peak_mib",
    "images_per_s",
    "final_reward", "final_reward_std", "reward_area", "wall_s", "grad_cosine", "grad_rel_error",
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
                    "endpoint_velocity", "cache", "cosine_to_full", "relative_error", "forward_nograd", "forward_grad", "backward",
                    "backward_vs_full", "seconds", "speedup_vs_full", "cache_hit_rate"]


def ablation_table(gradcheck: pd.DataFrame) -> pd.DataFrame:
    """Gradcheck rows: W x alpha x route_frac x reuse (x endpoint velocity) -> cosine, relative error, passes, replay seconds,
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
                         "reuse_rollout_velocity", "endpoint_velocity"], kind="stable", na_position="first")
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
    """``df`` with every count column whose values are all whole numbers as a nullable integer column
    (written ``40``, not ``40.0``; missing values stay empty)."""
    out = df.copy()
    for column in out.columns:
        if not _is_count_column(column) or not pd.api.types.is_numeric_dtype(out[column]) \
                or pd.api.types.is_bool_dtype(out[column]):
            continue
        values = pd.to_numeric(out[column], errors="coerce")
        present = values.dropna()
        if len(present) and np.all(np.isfinite(present)) and np.all(present == np.round(present)):
            out[column] = values.round().astype("Int64")
    return out


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
    lines = ["| " + " | ".join(columns) + " |", "|" + "|".join("---" for _ in columns) + "|"]
    lines += ["| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |" for cells in rows]
    return "\n".join(lines) + "\n"


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


def write_table(df: pd.DataFrame, out_dir: str | Path, name: str, status_column: str | None = "status") -> list[Path]:
    """``out_dir/name.csv`` (every column, NaN as empty, counts as integers), ``name.md`` and
    ``name.html``, each written atomically; returns their paths."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    df = integer_columns(df)
    status = status_column if status_column in df.columns else None
    paths = [out_dir / f"{name}.{ext}" for ext in TABLE_FORMATS]
    for path in paths:
        if path.suffix == ".csv":
            write_text(path, df.to_csv(index=False))
        elif path.suffix == ".md":
            write_text(path, to_markdown(df, status))
        else:
            write_text(path, to_html(df, name, status))
    return paths


def _interval(value, lo, hi, digits: int = 2, suffix: str = "x") -> str:
    if not _is_number(value):
        return ""
    text = f"{value:.{digits}f}{suffix}"
    return text + (f" [{lo:.{digits}f}, {hi:.{digits}f}]" if _is_number(lo) and _is_number(hi) else "")


def summary_table(efficiency: pd.DataFrame) -> pd.DataFrame:
    """The efficiency table in a few readable columns, one row per cell: seconds per iteration as
    median [p25, p75] (in the row's ``time`` basis), speedup and train speedup over ``full`` with
    their 95 % intervals (the train speedup's basis: paired rounds or the runs), the predicted train
    speedup, backward passes per iteration, peak memory (MiB,
    :func:`peak_memory_mib`), gradient cosine to ``full`` and the final reward +- the standard
    deviation of that iteration's sample rewards."""
    columns = ["method", "model", "resolution", "hardware", "source", "status", "time", "s_per_iter", "speedup",
               "train_speedup", "train_speedup_basis", "predicted_train_speedup", "backward", "peak_mib", "grad_cosine",
               "final_reward_pm"]
    if efficiency.empty:
        return pd.DataFrame(columns=columns)
    peak = peak_memory_mib(efficiency)
    rows = []
    for idx, r in efficiency.iterrows():
        med, p25, p75 = r.get("t_iter_s"), r.get("t_iter_p25_s"), r.get("t_iter_p75_s")
        reward, spread = r.get("final_reward"), r.get("final_reward_std")
        rows.append({
            "method": r["method"], "model": r["model"], "resolution": r["resolution"], "hardware": r["hardware"],
            "source": r["source"], "status": r["status"], "time": r.get("time_basis"),
            "s_per_iter": _interval(med, p25, p75, 3, "") if _is_number(med) else "",
            "speedup": _interval(r.get("speedup"), r.get("speedup_lo"), r.get("speedup_hi")),
            "train_speedup": _interval(r.get("train_speedup"), r.get("train_speedup_lo"), r.get("train_speedup_hi")),
            "train_speedup_basis": r.get("train_speedup_basis"),
            "predicted_train_speedup": r.get("predicted_train_speedup"),
            "backward": r.get("backward"),
            "peak_mib": round(float(peak[idx]), 1) if _is_number(peak[idx]) else float("nan"),
            "grad_cosine": r.get("grad_cosine"),
            "final_reward_pm": (f"{reward:.4g} ± {spread:.2g}" if _is_number(spread) else f"{reward:.4g}")
            if _is_number(reward) else "",
        })
    return pd.DataFrame(rows, columns=columns)


def build_tables(records: pd.DataFrame, gradcheck: pd.DataFrame, warmup: int = 1, time: str = "auto",
                 calibration: pd.DataFrame | None = None) -> dict[str, pd.DataFrame]:
    """Every table of ``TABLES`` from the records, gradcheck rows and calibrations."""
    efficiency = efficiency_table(records, gradcheck, warmup, time, calibration)
    return {"summary": summary_table(efficiency), "efficiency": efficiency, "ablation": ablation_table(gradcheck),
            "gpus": gpus_table(efficiency)}


def write_tables(records: pd.DataFrame, gradcheck: pd.DataFrame, out_dir: str | Path, warmup: int = 1,
                 time: str = "auto", calibration: pd.DataFrame | None = None) -> dict[str, pd.DataFrame]:
    """Write records.csv and every table (CSV, Markdown, HTML) under ``out_dir``; return the tables."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    write_text(out_dir / "records.csv", integer_columns(records).to_csv(index=False))
    tables = build_tables(records, gradcheck, warmup, time, calibration)
    for name, table in tables.items():
        write_table(table, out_dir, name, status_column="status" if name in ("summary", "efficiency") else None)
    return tables


# --------------------------------------------------------------------------------------------------
# Plots
# --------------------------------------------------------------------------------------------------


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


def _empty_figure(plt, path: Path, message: str) -> None:
    fig, ax = plt.subplots(figsize=(5, 2))
    ax.axis("off")
    ax.text(0.5, 0.5, message, ha="center", va="center")
    save_figure(fig, path)
    plt.close(fig)


def _label(row) -> str:
    return f"{row['method']} (imported)" if row.get("source") == "imported" else str(row["method"])


def reward_curves(panel: pd.DataFrame, x: str) -> dict[str, dict]:
    """Per method label of one panel: x (iteration, or the median over seeds of the cumulative wall
    seconds at each iteration), the mean reward over seeds and its band: +-1 standard deviation over
    seeds, or with one seed over the iteration's images (``reward_std``); ``band`` names which."""
    curves = {}
    for label, rows in panel.assign(label=panel.apply(_label, axis=1)).groupby("label", sort=False):
        rows = rows.sort_values("iteration").assign(_t=lambda d: d.groupby("run_dir")["t_iter_s"].cumsum())
        by_iteration = rows.groupby("iteration", sort=True)
        seeds = rows["run_dir"].nunique()
        mean = by_iteration["reward_mean"].mean()
        spread = by_iteration["reward_mean"].std(ddof=0) if seeds > 1 else by_iteration["reward_std"].mean()
        xs = mean.index.to_numpy(float) if x == "iteration" else by_iteration["_t"].median().to_numpy(float)
        curves[label] = {"x": xs, "mean": mean.to_numpy(float), "spread": spread.fillna(0).to_numpy(float),
                         "band": f"+-1 std over {seeds} seeds" if seeds > 1 else "+-1 std over the images"}
    return curves


def plot_rewards(records: pd.DataFrame, path: Path, x: str) -> None:
    """Reward per iteration (``x="iteration"``) or per wall-clock second (``x="wallclock"``), one line
    per method (the mean over seeds) with its band (:func:`reward_curves`), one panel per model x
    resolution x hardware."""
    plt = pyplot()
    ok = records[(records["status"] == "ok") & records["reward_mean"].notna()] if not records.empty else records
    if "weights" in ok:  # random-weight rewards compare nothing
        ok = ok[ok["weights"] != "random"]
    if ok.empty:
        return _empty_figure(plt, path, "no iteration finished")
    keys = list(dict.fromkeys(zip(ok["model"], ok["resolution"], ok["hardware"])))
    fig, axes = _panels(plt, keys, ncols=min(3, len(keys)))
    colors = _colors(ok.apply(_label, axis=1))
    for ax, key in zip(axes, keys):
        panel = ok[(ok["model"] == key[0]) & (ok["resolution"] == key[1]) & (ok["hardware"] == key[2])]
        bands = set()
        for label, curve in reward_curves(panel, x).items():
            style = "--" if "(imported)" in label else "-"
            ax.plot(curve["x"], curve["mean"], style, marker=".", color=colors[label], label=label)
            ax.fill_between(curve["x"], curve["mean"] - curve["spread"], curve["mean"] + curve["spread"],
                            color=colors[label], alpha=0.15, linewidth=0)
            bands.add(curve["band"])
        ax.set_title(f"{key[0]} {key[1]} px, {key[2]}\nbands: {'; '.join(sorted(bands))}", fontsize=8)
        ax.set_xlabel("iteration" if x == "iteration" else "cumulative wall-clock (s; with seeds, their median)")
        ax.set_ylabel("mean reward")
        ax.grid(alpha=0.3)
    _legend(fig, axes)
    save_figure(fig, path)
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


def _resolution_panels(plt, df: pd.DataFrame):
    """A figure of one panel per model x hardware, each with a line per method over resolution:
    ``(fig, axes, [(ax, panel rows, [(method, its rows by resolution, color), ...]), ...])``."""
    keys = list(dict.fromkeys(zip(df["model"], df["hardware"])))
    fig, axes = _panels(plt, keys, ncols=min(3, len(keys)))
    colors = _colors(df["method"])
    panels = []
    for ax, (model, hardware) in zip(axes, keys):
        panel = df[(df["model"] == model) & (df["hardware"] == hardware)]
        lines = [(method, line.sort_values("resolution"), colors[method])
                 for method, line in panel.groupby("method", sort=False)]
        ax.set_title(f"{model}, {hardware}", fontsize=9)
        ax.set_xlabel("resolution (px)")
        ax.grid(alpha=0.3)
        panels.append((ax, panel, lines))
    return fig, axes, panels


def plot_memory(efficiency: pd.DataFrame, path: Path) -> None:
    """Peak memory vs resolution per method, one panel per model x hardware. CUDA allocator peak where
    measured, else the peak of saved activations (on CPU the allocator has no peak)."""
    plt = pyplot()
    df = efficiency[efficiency["source"] == "measured"] if not efficiency.empty else efficiency
    if df.empty:
        return _empty_figure(plt, path, "no measured runs")
    use_alloc = df["peak_alloc_mib"].notna().any()
    column = "peak_alloc_mib" if use_alloc else "saved_act_mib"
    what = "peak allocated (MiB)" if use_alloc else "peak saved activations (MiB)"
    fig, axes, panels = _resolution_panels(plt, df)
    for ax, _, lines in panels:
        for method, line, color in lines:
            ax.plot(line["resolution"].astype(float), line[column], marker="o", color=color, label=method)
            for _, bad in line[line["status"] == "oom"].iterrows():
                ax.annotate("OOM", (float(bad["resolution"]), 0), color=color, fontsize=7)
        ax.set_ylabel(what)
    _legend(fig, axes)
    save_figure(fig, path)
    plt.close(fig)


def plot_time_breakdown(efficiency: pd.DataFrame, path: Path) -> None:
    """Stacked seconds per iteration (rollout / reward / train / the rest) per method, one panel per
    model x resolution x hardware."""
    plt = pyplot()
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
        # the spread: the iteration's interquartile range around its median (the top of the stack)
        top = bottom + rest
        ax.errorbar(range(len(panel)), top, yerr=_iqr_err(panel, "iter", top), fmt="none", ecolor="black",
                    capsize=3, lw=1, label="iteration IQR")
        ax.set_xticks(range(len(panel)), labels, rotation=60, ha="right", fontsize=7)
        ax.set_title(f"{key[0]} {key[1]} px, {key[2]}", fontsize=9)
        ax.set_ylabel(f"seconds per iteration, median ({_basis_label(panel)})")
        ax.grid(alpha=0.3, axis="y")
    _legend(fig, axes)
    save_figure(fig, path)
    plt.close(fig)


def plot_gradcheck(ablation: pd.DataFrame, path: Path) -> None:
    """Gradient cosine to ``full`` vs W, one line per alpha x route_frac x reuse, one panel per model x
    resolution."""
    plt = pyplot()
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
        _integer_axis(ax.xaxis)
        ax.set_ylabel("gradient cosine to full")
        ax.grid(alpha=0.3)
    _legend(fig, axes)
    save_figure(fig, path)
    plt.close(fig)


def _integer_axis(axis) -> None:
    """Ticks at whole numbers only: for axes that count things (passes, W, pixels)."""
    from matplotlib.ticker import MaxNLocator

    axis.set_major_locator(MaxNLocator(integer=True))


def _iqr_err(df: pd.DataFrame, phase: str, center) -> np.ndarray:
    """(2, n) error-bar lengths from ``center`` down to p25 and up to p75 of ``phase``'s seconds."""
    center = np.asarray(center, dtype=float)
    lo = df[f"t_{phase}_p25_s"].to_numpy(float)
    hi = df[f"t_{phase}_p75_s"].to_numpy(float)
    return np.vstack([np.clip(center - lo, 0, None), np.clip(hi - center, 0, None)])


def _basis_label(df: pd.DataFrame) -> str:
    bases = sorted(set(df["time_basis"].dropna())) if "time_basis" in df else []
    names = {"cpu": "process CPU time", "wall": "wall clock / CUDA events"}
    return ", ".join(names.get(b, b) for b in bases) or "wall clock"


def plot_time_resolution(efficiency: pd.DataFrame, path: Path) -> None:
    """Seconds per iteration (median, with the p25-p75 band and error bars) against resolution, one
    line per method, one panel per model x hardware."""
    plt = pyplot()
    df = efficiency[(efficiency["source"] == "measured") & efficiency["t_iter_s"].notna()] \
        if not efficiency.empty else efficiency
    if df.empty:
        return _empty_figure(plt, path, "no timed iterations")
    fig, axes, panels = _resolution_panels(plt, df)
    for ax, panel, lines in panels:
        for method, line, color in lines:
            xs, med = line["resolution"].astype(float).to_numpy(), line["t_iter_s"].to_numpy(float)
            ax.errorbar(xs, med, yerr=_iqr_err(line, "iter", med), marker="o", capsize=3, color=color, label=method)
            ax.fill_between(xs, line["t_iter_p25_s"].to_numpy(float), line["t_iter_p75_s"].to_numpy(float),
                            color=color, alpha=0.15, lw=0)
        ax.set_xticks(sorted(panel["resolution"].astype(int).unique()))
        ax.set_ylabel(f"s / iteration, median + IQR ({_basis_label(panel)})", fontsize=8)
        ax.set_yscale("log")
    _legend(fig, axes)
    save_figure(fig, path)
    plt.close(fig)


def plot_backward_passes(efficiency: pd.DataFrame, path: Path) -> None:
    """Backward passes per iteration (counted, per sample) per method, one panel per model x resolution
    (counts do not depend on the hardware)."""
    plt = pyplot()
    df = efficiency[(efficiency["source"] == "measured") & efficiency["backward"].notna()] \
        if not efficiency.empty else efficiency
    if df.empty:
        return _empty_figure(plt, path, "no counted passes")
    df = df.drop_duplicates(["method", "model", "resolution"])
    keys = list(dict.fromkeys(zip(df["model"], df["resolution"])))
    fig, axes = _panels(plt, keys, ncols=min(3, len(keys)))
    colors = _colors(df["method"])
    for ax, (model, resolution) in zip(axes, keys):
        panel = df[(df["model"] == model) & (df["resolution"] == resolution)]
        labels = list(panel["method"])
        ax.bar(range(len(panel)), panel["backward"].to_numpy(float), color=[colors[m] for m in labels])
        ax.set_xticks(range(len(panel)), labels, rotation=60, ha="right", fontsize=7)
        _integer_axis(ax.yaxis)
        ax.set_title(f"{model} {resolution} px", fontsize=9)
        ax.set_ylabel("backward passes per iteration")
        ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    save_figure(fig, path)
    plt.close(fig)


def plot_cosine_cost(efficiency: pd.DataFrame, path: Path) -> None:
    """The accuracy / cost frontier: gradient cosine to ``full`` against the train phase's time relative
    to ``full`` (1 / train speedup, with its 95 % interval as error bars), one point per method, one
    panel per model x resolution x hardware with gradient checks."""
    plt = pyplot()
    df = efficiency[efficiency["grad_cosine"].notna() & efficiency["train_speedup"].notna()] \
        if not efficiency.empty else efficiency
    if df.empty:
        return _empty_figure(plt, path, "no run with both a gradient check and a train speedup")
    keys = list(dict.fromkeys(zip(df["model"], df["resolution"], df["hardware"])))
    fig, axes = _panels(plt, keys, ncols=min(3, len(keys)))
    colors = _colors(df["method"])
    for ax, key in zip(axes, keys):
        panel = df[(df["model"] == key[0]) & (df["resolution"] == key[1]) & (df["hardware"] == key[2])]
        for _, row in panel.iterrows():
            cost = 1 / row["train_speedup"]
            lo = 1 / row["train_speedup_hi"] if _is_number(row["train_speedup_hi"]) else cost
            hi = 1 / row["train_speedup_lo"] if _is_number(row["train_speedup_lo"]) else cost
            ax.errorbar([cost], [row["grad_cosine"]], xerr=[[max(cost - lo, 0)], [max(hi - cost, 0)]], fmt="o",
                        capsize=3, color=colors[row["method"]], label=row["method"])
        ax.set_title(f"{key[0]} {key[1]} px, {key[2]}", fontsize=9)
        ax.set_xlabel(f"train time relative to full ({_basis_label(panel)})", fontsize=8)
        ax.set_ylabel("gradient cosine to full")
        ax.grid(alpha=0.3)
    _legend(fig, axes)
    save_figure(fig, path)
    plt.close(fig)


def write_plots(records: pd.DataFrame, tables: dict[str, pd.DataFrame], out_dir: str | Path) -> list[Path]:
    """Every plot of PLOTS as ``out_dir/<name>.png``; a plot without data says so in its image."""
    out_dir = Path(out_dir)
    paths = {name: out_dir / f"{name}.png" for name in PLOTS}
    efficiency = tables["efficiency"]
    plot_rewards(records, paths["reward_iteration"], "iteration")
    plot_rewards(records, paths["reward_wallclock"], "wallclock")
    plot_memory(efficiency, paths["memory_resolution"])
    plot_time_breakdown(efficiency, paths["time_breakdown"])
    plot_time_resolution(efficiency, paths["time_resolution"])
    plot_backward_passes(efficiency, paths["backward_passes"])
    plot_cosine_cost(efficiency, paths["cosine_cost"])
    plot_gradcheck(tables["ablation"], paths["gradcheck_cosine"])
    return list(paths.values())


# what --tables DIR and --plots DIR hold; any other file there is someone else's
TABLES_CONTENTS = Contents("agg-bench report tables",
                           ("records.csv", *(f"{name}.{ext}" for name in TABLES for ext in TABLE_FORMATS)))
PLOTS_CONTENTS = Contents("agg-bench report plots", tuple(f"{name}.png" for name in PLOTS))


def build_report(manifest: Manifest, tables_dir: str | Path | None = None, plots_dir: str | Path | None = None) -> dict:
    """Load ``manifest``'s runs, gradcheck CSVs and calibrations; write the tables and/or the plots."""
    if not manifest.runs:
        raise UserError("report: no runs to report (give --manifest or --runs)")
    with claimed_folders([(tables_dir, TABLES_CONTENTS), (plots_dir, PLOTS_CONTENTS)], ("--tables", "--plots")):
        return _build_report(manifest, tables_dir, plots_dir)


def _build_report(manifest: Manifest, tables_dir: str | Path | None, plots_dir: str | Path | None) -> dict:
    records = load_records(manifest.runs)
    gradcheck = load_gradcheck(manifest.gradcheck)
    calibration = load_calibration(manifest.calibration)
    if tables_dir is not None:
        tables = write_tables(records, gradcheck, tables_dir, manifest.warmup, manifest.time, calibration)
    else:
        tables = build_tables(records, gradcheck, manifest.warmup, manifest.time, calibration)
    if plots_dir is not None:
        write_plots(records, tables, plots_dir)
    return tables
