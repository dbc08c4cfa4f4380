"""The report's tables, computed from the records, gradcheck rows and calibrations that
:mod:`agg_bench.results.loading` reads (:func:`build_tables`; :mod:`agg_bench.results.formatting` writes them):

- ``efficiency``: one row per method x model x resolution x hardware (seeds averaged): seconds per
  iteration split into rollout / reward / train, speedups over ``full`` (whole iteration, train phase,
  rollout) with their predictions from counted passes, passes per iteration, peak
  memory, images/s, final reward, mean reward over a common wall-clock horizon, gradient cosine;
- ``summary``: the efficiency table in a few readable columns (time per iteration as median [IQR],
  speedup [95 % CI], backward passes, peak memory, gradient cosine, final reward +- spread);
- ``ablation``: gradcheck rows, W x alpha x route_frac x reuse -> cosine, relative error, passes, time;
- ``gpus``: the efficiency table pivoted by hardware (GPU name, or the device label without a GPU).

Conventions: a value that was not measured is empty (NaN), never 0; a run that ended in OOM, divergence
or an error keeps its status.

Timings: every iteration after ``warmup`` (the first pays one-off costs) of every seed of a cell is one
sample; a cell shows the median of its samples and their 25th / 75th percentiles, and a speedup is the
ratio of two cells' medians with a seeded percentile-bootstrap 95 % interval (:mod:`agg_bench.results.stats`).
Which seconds: ``time="auto"`` takes the process's CPU time (``t_*_cpu_s``) on the CPU, where it does
not grow while other work shares the cores, and the wall-clock time (CUDA events) on a GPU; ``"cpu"``
and ``"wall"`` force one (a run without CPU times, e.g. an imported log, falls back to wall). The
``time_basis`` column says which one each row used. With calibration files (``agg-bench calibrate``),
``predicted_train_speedup`` is the train-phase speedup that the counted work explains at the measured
unit costs (calls and latents of the updates the calibration timed, each call priced per call and per
latent; else the runs' passes per sample), and ``prediction_check`` says whether the measured 95 %
interval contains it. With the calibration's paired rollout rounds, ``rollout_speedup`` is the rollout's,
beside ``predicted_rollout_speedup``, priced the same way from the counted rollout calls and forwards
(``rollout_prediction_check``).
"""
from __future__ import annotations

import math
from typing import Any, Iterable

import numpy as np
import pandas as pd

from .loading import ADDED_COLUMNS, ROW_KEYS, as_bool, check_time_basis, is_number
from ..records import (GRADCHECK_OPTION_COLUMNS, IMPORTED_KEYS, PASS_KEYS, PHASE_PEAK_KEY, PHASE_TIME_KEYS, RECORD_KEYS,
                      STANDARD_PHASES, TRAIN_PASS_KEYS)
from ..jsonfiles import loads
from .costmodel import calibration_of, counted_seconds, per_sample_seconds
from .stats import paired_speedup, quartiles, ratios_of_medians_ci

MIB = 1024 ** 2
PHASES = PHASE_TIME_KEYS
MEMORY_KEYS = {  # record key (bytes, max over a run) -> table column (MiB)
    "peak_alloc_bytes": "peak_alloc_mib",
    # each standard phase's own CUDA peak (records.PHASE_PEAK_KEYS; CUDA runs only)
    **{PHASE_PEAK_KEY.format(phase=phase): f"peak_{phase}_mib" for phase in STANDARD_PHASES},
    "nvml_peak_used_bytes": "nvml_peak_mib",
    "saved_activation_peak_bytes": "saved_act_mib",
    "rss_peak_bytes": "rss_peak_mib",
    # the run's plan.json (agg_bench.runtime.memplan), shown beside the peaks it predicts
    "planned_activation_bytes": "planned_act_mib",
    "planned_total_bytes": "planned_total_mib",
}
# rows compared with each other: speedup and the wall-clock horizon are taken within these
GROUP_KEYS = ["model", "resolution", "hardware", "source"]
STATUS_ORDER = ("error", "oom", "diverged", "interrupted", "ok")
# estimator options a gradcheck row is matched on: those with their own gradcheck column
GRADCHECK_OPTIONS = GRADCHECK_OPTION_COLUMNS

# phases a table times (``t_<phase>_s``): the standard ones and the whole iteration
TIME_PHASES = (*STANDARD_PHASES, "iter")
# timing columns: median and quartiles of each phase's seconds
TIME_COLUMNS = [f"t_{phase}_{stat}" for phase in TIME_PHASES for stat in ("s", "p25_s", "p75_s")]
# the efficiency table's columns, in order; the methods' own numbers and method_options follow them
EFFICIENCY_COLUMNS = [
    "method", "model", "resolution", "hardware", "source", "weights", "status", "method_name", "n_gpus", "seeds",
    "iterations", "time_basis", *TIME_COLUMNS,
    "speedup", "speedup_lo", "speedup_hi", "train_speedup", "train_speedup_lo", "train_speedup_hi",
    "train_speedup_basis", "predicted_train_speedup", "prediction_check", "predicted_t_train_s", "t_train_paired_s",
    "run_train_speedup", "run_train_speedup_lo", "run_train_speedup_hi",
    "rollout_speedup", "rollout_speedup_lo", "rollout_speedup_hi", "rollout_forwards", "predicted_rollout_speedup",
    "rollout_prediction_check",
    "forward_nograd", "forward_grad", "backward", *TRAIN_PASS_KEYS,
    "peak_alloc_mib", *(f"peak_{phase}_mib" for phase in STANDARD_PHASES), "nvml_peak_mib", "saved_act_mib",
    "planned_act_mib", "planned_total_mib", "planned_over_peak",
    "rss_peak_mib", "images_per_s", "energy_j",
    "final_reward", "final_reward_std", "reward_area", "wall_s", "grad_cosine", "grad_rel_error",
]
# the ablation table's columns, in order
ABLATION_COLUMNS = ["model", "resolution", "method", "window", "alpha", "route_frac", "reuse_rollout_velocity",
                    "endpoint_velocity", "cache", "cosine_to_full", "relative_error", "forward_nograd", "forward_grad", "backward",
                    "backward_vs_full", "seconds", "speedup_vs_full", "cache_hit_rate"]


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
    """Method-specific numeric record fields (cache_hit_rate, ratio_dev, ...), averaged per run: the numeric
    columns that are neither a record key, a phase's CUDA peak (the table shows the standard phases' in MiB)
    nor a column :func:`load_records` adds."""
    known = {*RECORD_KEYS, *IMPORTED_KEYS, *ADDED_COLUMNS}
    prefix, suffix = PHASE_PEAK_KEY.split("{phase}")
    return [c for c in records.columns if c not in known and not (c.startswith(prefix) and c.endswith(suffix))
            and pd.api.types.is_numeric_dtype(records[c]) and records[c].notna().any()]


def run_table(records: pd.DataFrame, warmup: int = 1, extras: list[str] | None = None) -> pd.DataFrame:
    """One row per run folder: status, mean phase times after ``warmup``, passes, memory peaks, rewards."""
    extras = _extra_keys(records) if extras is None else extras
    out = []
    for _run_dir, run in records.groupby("run_dir", sort=False):
        first = run.iloc[0]
        ok = run[run["status"] == "ok"].sort_values("iteration") if "iteration" in run else run.iloc[0:0]
        timed = _after_warmup(ok, warmup)
        row: dict[str, Any] = {k: first.get(k) for k in (*ROW_KEYS, "method_name", "method_options", "device",
                                                         "gpu_name", "n_gpus", "seed", "run_dir", "weights")}
        record_status = combine_status(run["status"]) if "status" in run else "ok"
        row["status"] = combine_status([first["run_status"], record_status])
        row["iterations"] = len(ok)
        for key in (*PHASES, "t_iter_s", "images_per_s", "energy_j"):  # energy: joules per iteration (NVML)
            row[key] = _mean(timed, key)
        for key in (*PASS_KEYS, *TRAIN_PASS_KEYS):
            row[key] = _mean(ok, key)
        row["rollout_forwards"] = _rollout_forwards(ok)
        for key, column in MEMORY_KEYS.items():
            peak = pd.to_numeric(run[key], errors="coerce").max() if key in run else float("nan")
            row[column] = peak / MIB if is_number(peak) else float("nan")
        rewards = ok["reward_mean"].dropna() if "reward_mean" in ok else pd.Series(dtype=float)
        row["final_reward"] = float(rewards.iloc[-1]) if len(rewards) else float("nan")
        # the spread of the final iteration's sample rewards
        final_std = ok.loc[rewards.index[-1], "reward_std"] if len(rewards) and "reward_std" in ok else None
        row["final_reward_std"] = float(final_std) if is_number(final_std) else float("nan")
        times, values = reward_curve(run) if {"t_iter_s", "reward_mean"} <= set(run) else (np.array([]),) * 2
        if row["weights"] == "random":  # random weights: rewards say nothing about quality
            row["final_reward"], values = float("nan"), np.full(len(values), np.nan)
        row["wall_s"] = float(times[-1]) if len(times) else float("nan")
        row["_curve"] = (times, values)
        for key in extras:
            row[key] = _mean(ok, key)
        out.append(row)
    return pd.DataFrame(out)


def _rollout_forwards(ok: pd.DataFrame) -> float:
    """The rollout's no-grad forwards per sample, averaged over a run's ok iterations: the iteration's
    forwards less its train phase's, over its images (``images_per_s`` x ``t_iter_s``, the count it was
    computed from); NaN where a record lacks one of them."""
    keys = ("forward_nograd", "train_forward_nograd", "images_per_s", "t_iter_s")
    if ok.empty or not set(keys) <= set(ok):
        return float("nan")
    nograd, train_nograd, per_s, seconds = (pd.to_numeric(ok[key], errors="coerce").to_numpy(float) for key in keys)
    per_sample = (nograd - train_nograd) / np.round(per_s * seconds)
    per_sample = per_sample[np.isfinite(per_sample)]
    return float(per_sample.mean()) if len(per_sample) == len(ok) else float("nan")


def _after_warmup(ok: pd.DataFrame, warmup: int) -> pd.DataFrame:
    """The ok iterations of one run (sorted) that timings use: all but the first ``warmup``, or all of
    them when the run has no more than that."""
    return ok.iloc[warmup:] if len(ok) > warmup else ok


def timed_whole(records: pd.DataFrame, warmup: int) -> list[str]:
    """The run folders whose timings include their warm-up: those with at least one and no more than ``warmup`` ok
    iterations, which :func:`_after_warmup` times whole (a sweep's ``report.warmup_iterations`` left at its
    default, 1, on runs of one iteration)."""
    if warmup < 1 or records.empty or "iteration" not in records:
        return []
    counts = records[records["status"] == "ok"].groupby("run_dir", sort=False).size()
    return [str(run_dir) for run_dir, count in counts.items() if count <= warmup]


def timed_records(records: pd.DataFrame, warmup: int = 1) -> pd.DataFrame:
    """Every record that timings sample: each run's ok iterations after its first ``warmup``."""
    if records.empty or "iteration" not in records:
        return records.iloc[0:0]
    ok = records[records["status"] == "ok"].sort_values("iteration", kind="stable")
    parts = [_after_warmup(run, warmup) for _, run in ok.groupby("run_dir", sort=False)]
    return pd.concat(parts) if parts else ok


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
    after ``warmup``, seeds pooled), speedups with 95 % intervals, the cost model's predicted train and
    rollout speedups (with ``calibration``, from :func:`load_calibration`), passes, memory, rewards, gradient
    cosine to ``full``; other numbers averaged over seeds; OOM/diverged runs keep their status. A cell whose
    seeds partly ended ok averages the ok runs only, and ``seeds`` counts those; its ``status`` is the worst of
    all its runs' (:func:`combine_status`)."""
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
                    status=combine_status(group["status"]))
        ok = group[group["status"] == "ok"]
        measured = ok if len(ok) else group  # a failed cell shows what its runs measured before failing
        # the seeds the row's numbers average: a seed that diverged beside ok ones is in the status, not the means
        cell["seeds"] = int(measured["seed"].nunique(dropna=False))
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
        # the cost model (agg_bench.results.costmodel): the runs' passes, the calibration's counted work
        # (a reference row's from the reference's calibrations; the last one that timed this method)
        units = calibration_of(calibration, cell["model"], cell["resolution"], cell["device"], cell["method"],
                               "reference" if cell["source"] == "reference" else "measured")
        cell["_units"], cell["_basis"] = units, basis
        cell["_predicted_runs"] = per_sample_seconds({kind: _mean(samples, f"train_{kind}") for kind in PASS_KEYS},
                                                     _mean(samples, "optimizer_steps"), units, basis)
        cell.update(_timed_fields(units, cell["method"], basis))
        if not is_number(cell.get("rollout_forwards")):  # the runs' records do not say: the calibration's count
            cell["rollout_forwards"] = cell["_timed_rollout_forwards"]
        cell["t_train_paired_s"] = float(np.median(cell["_paired"])) if len(cell["_paired"]) else float("nan")
        if cell["status"] == "oom":  # the iteration that ran out of memory has no times or rewards
            for column in (*TIME_COLUMNS, "images_per_s", "final_reward", "final_reward_std", "reward_area", "wall_s"):
                cell[column] = float("nan")
        cells.append(cell)
    table = pd.DataFrame(cells)

    # speedup over the group's `full` row; only between cells that both finished ok
    base = table[_baseline_mask(table)].drop_duplicates(GROUP_KEYS)
    base = base[GROUP_KEYS + ["method", "t_iter_s", "t_train_s", "status", "_samples", "_predicted_runs",
                              "_predicted_timed", "_paired", "_paired_rollout", "rollout_forwards",
                              "_timed_rollout_forwards", "_priced_rollout_s"]].rename(
        columns={"method": "_ref_method", "t_iter_s": "_ref_iter", "t_train_s": "_ref_train", "status": "_ref_status",
                 "_samples": "_ref_samples", "_predicted_runs": "_ref_predicted_runs",
                 "_predicted_timed": "_ref_predicted_timed", "_paired": "_ref_paired",
                 "_paired_rollout": "_ref_paired_rollout", "rollout_forwards": "_ref_rollout_forwards",
                 "_timed_rollout_forwards": "_ref_timed_rollout_forwards",
                 "_priced_rollout_s": "_ref_priced_rollout_s"})
    table = table.merge(base, on=GROUP_KEYS, how="left")
    # the reference's side-by-side timings from the calibration that timed this row's method (the same
    # rounds, when a cell has several calibrations), where it timed the reference too
    for i, (units, reference, basis) in enumerate(zip(table["_units"], table["_ref_method"], table["_basis"])):
        timed = _timed_fields(units, reference, basis) if isinstance(reference, str) else None
        if timed is not None and len(timed["_paired"]):
            for key, value in timed.items():
                table.at[i, f"_ref{key}"] = value
    usable = (table["_ref_status"] == "ok") & (table["status"] == "ok")
    table["speedup"] = (table["_ref_iter"] / table["t_iter_s"]).where(usable)
    table["run_train_speedup"] = (table["_ref_train"] / table["t_train_s"]).where(usable)
    # each row's two intervals at once: a row's phases hold as many iterations, so they take the same draws
    speedups = (("speedup", "iter"), ("run_train_speedup", "train"))
    bounds = [ratios_of_medians_ci([(ref[phase], own[phase]) for _, phase in speedups])
              if ok and isinstance(ref, dict) else [(float("nan"),) * 2] * len(speedups)
              for ok, ref, own in zip(usable, table["_ref_samples"], table["_samples"])]
    for j, (name, _) in enumerate(speedups):
        table[f"{name}_lo"] = [row[j][0] for row in bounds]
        table[f"{name}_hi"] = [row[j][1] for row in bounds]
    # the train speedup from the calibration's side-by-side timings where both rows have them (paired
    # rounds: one machine state for both), else from the runs' own iterations
    paired = [bool(ok) and isinstance(ref, np.ndarray) and len(ref) > 0 and len(ref) == len(own)
              for ok, ref, own in zip(usable, table["_ref_paired"], table["_paired"])]
    table["train_speedup_basis"] = ["paired" if p else ("runs" if ok else None) for p, ok in zip(paired, usable)]
    runs_speedup = table[["run_train_speedup", "run_train_speedup_lo", "run_train_speedup_hi"]].to_numpy(float)
    table["train_speedup"], table["train_speedup_lo"], table["train_speedup_hi"] = zip(*[
        paired_speedup(ref, own) if p else tuple(run)
        for p, ref, own, run in zip(paired, table["_ref_paired"], table["_paired"], runs_speedup)])
    # predicted from the work counted in the very updates the paired rounds timed (calls and latents, priced
    # per call and per latent) where both rows have it, else from the runs' mean passes at the per-sample
    # unit costs; predicted_t_train_s is the row's seconds on the basis its prediction uses
    timed_basis = table["_predicted_timed"].notna() & table["_ref_predicted_timed"].notna()
    table["predicted_t_train_s"] = table["_predicted_timed"].where(timed_basis, table["_predicted_runs"])
    reference = table["_ref_predicted_timed"].where(timed_basis, table["_ref_predicted_runs"])
    table["predicted_train_speedup"] = (reference / table["predicted_t_train_s"]).where(usable)
    table["prediction_check"] = [
        _prediction_check(*values) for values in
        zip(table["train_speedup"], table["train_speedup_lo"], table["train_speedup_hi"], table["predicted_train_speedup"])]
    # the rollout's speedup from the calibration's paired rollout rounds only (a run's rollout phase shares
    # its iteration with the others' costs)
    table["rollout_speedup"], table["rollout_speedup_lo"], table["rollout_speedup_hi"] = zip(*[
        paired_speedup(ref, own) if ok else (float("nan"),) * 3
        for ok, ref, own in zip(usable, table["_ref_paired_rollout"], table["_paired_rollout"])])
    # predicted from the very rollouts the rounds timed where both rows have them (a method whose rollout
    # changes over a run, e.g. a moving window, was timed on iteration 0's): their calls and forwards priced
    # per call and per latent, else the ratio of their forwards per sample; else of the runs' forwards (every
    # forward taken for a call of the batch)
    priced = table["_ref_priced_rollout_s"] / table["_priced_rollout_s"]
    timed = table["_ref_timed_rollout_forwards"] / table["_timed_rollout_forwards"]
    runs = table["_ref_rollout_forwards"] / table["rollout_forwards"]
    table["predicted_rollout_speedup"] = priced.where(priced.notna(), timed.where(timed.notna(), runs)).where(usable)
    table["rollout_prediction_check"] = [
        _prediction_check(*values) for values in zip(table["rollout_speedup"], table["rollout_speedup_lo"],
                                                     table["rollout_speedup_hi"], table["predicted_rollout_speedup"])]

    # the planner's total over torch's CUDA peak (both per GPU): how far the plan was off (CUDA runs only)
    table["planned_over_peak"] = table["planned_total_mib"] / table["peak_alloc_mib"]
    table["grad_cosine"], table["grad_rel_error"] = _match_gradcheck(table, gradcheck)
    columns = [c for c in EFFICIENCY_COLUMNS if c in table] + extras + ["method_options"]
    table = table.assign(_imported=table["source"] == "imported")[columns + ["_imported"]]
    table = table.sort_values(["_imported", "model", "resolution", "hardware"], kind="stable")
    return table.drop(columns="_imported").reset_index(drop=True)


def _seconds(values) -> np.ndarray:
    """Seconds per round (a calibration's list; missing: none)."""
    return np.asarray(values or [], dtype=np.float64)


def _timed_fields(units: pd.Series | None, method, basis: str) -> dict[str, Any]:
    """What calibration ``units`` timed of ``method`` side by side: its train phase's and rollout's seconds
    per round (``_paired``, ``_paired_rollout``), their counted work priced (``_predicted_timed``,
    ``_priced_rollout_s``) and the rollout's forwards per sample (``_timed_rollout_forwards``)."""
    methods = None if units is None else units.get("methods")
    timed = (methods.get(str(method)) if isinstance(methods, dict) else None) or {}
    counted = timed.get("rollout_forwards")
    return {"_predicted_timed": counted_seconds(timed, units, basis),
            "_priced_rollout_s": counted_seconds(timed, units, basis, rollout=True),
            "_paired": _seconds(timed.get(f"{basis}_s")),
            "_paired_rollout": _seconds(timed.get(f"rollout_{basis}_s")),
            "_timed_rollout_forwards": float(counted) if is_number(counted) else float("nan")}


def _prediction_check(measured, lo, hi, predicted) -> str | None:
    """Whether the measured speedup's interval contains the predicted one: "agrees", "faster than
    predicted", "slower than predicted"; None when either is missing."""
    if not all(is_number(v) for v in (measured, lo, hi, predicted)):
        return None
    if lo <= predicted <= hi:
        return "agrees"
    return "faster than predicted" if measured > predicted else "slower than predicted"


def _same(a, b) -> bool:
    if isinstance(a, bool) or isinstance(b, bool):
        return as_bool(a) == as_bool(b)
    if is_number(a) and is_number(b):
        return math.isclose(float(a), float(b), rel_tol=1e-9, abs_tol=1e-12)
    return str(a) == str(b)



def unmatched_gradcheck(efficiency: pd.DataFrame, gradcheck: pd.DataFrame | None) -> list[str]:
    """The models and resolutions (``"<model> at <resolution> px"``, or ``"<model> (no resolution)"``) of gradcheck
    rows that no measured row of the efficiency table has, in the order the rows give them: their ``grad_cosine``
    fills no cell (e.g. a CSV whose ``model`` column names another label than the runs record)."""
    if gradcheck is None or gradcheck.empty:
        return []
    measured = efficiency[efficiency["source"] == "measured"]
    have = set(zip(measured["model"].astype(str), pd.to_numeric(measured["resolution"])))
    out: list[str] = []
    for model, resolution in zip(gradcheck["model"].astype(str), pd.to_numeric(gradcheck["resolution"])):
        label = f"{model} at {int(resolution)} px" if pd.notna(resolution) else f"{model} (no resolution)"
        if (model, resolution) not in have and label not in out:
            out.append(label)
    return out


def _match_gradcheck(table: pd.DataFrame, gradcheck: pd.DataFrame | None) -> tuple[list, list]:
    """Each row's cosine / relative error to ``full`` from the gradcheck row of the same model,
    resolution, estimator and options (NaN when none, or more than one, matches). A row that runs ``full``
    under another label (another sampler, e.g. ``cps``) has none: the replayed snapshot is the sweep's own
    sampler's, so ``full``'s cosine of 1 would say nothing about it."""
    cos, rel = [], []
    for _, row in table.iterrows():
        c = r = float("nan")
        other_full = row["method_name"] == "full" and row["method"] != "full"
        if gradcheck is not None and not gradcheck.empty and row["source"] == "measured" and not other_full:
            options = loads(row["method_options"]) if isinstance(row["method_options"], str) else {}
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
                r = float(rel_value) if is_number(rel_value) else float("nan")
        cos.append(c)
        rel.append(r)
    return cos, rel


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


def _interval(value, lo, hi, digits: int = 2, suffix: str = "x") -> str:
    if not is_number(value):
        return ""
    text = f"{value:.{digits}f}{suffix}"
    return text + (f" [{lo:.{digits}f}, {hi:.{digits}f}]" if is_number(lo) and is_number(hi) else "")


def summary_table(efficiency: pd.DataFrame) -> pd.DataFrame:
    """The efficiency table in a few readable columns, one row per cell: seconds per iteration as
    median [p25, p75] (in the row's ``time`` basis), speedup and train speedup over ``full`` with
    their 95 % intervals (the train speedup's basis: paired rounds or the runs), the predicted train
    speedup, the rollout speedup from paired rounds with its interval, backward passes per iteration, peak memory (MiB,
    :func:`peak_memory_mib`), gradient cosine to ``full`` and the final reward +- the standard
    deviation of that iteration's sample rewards."""
    columns = ["method", "model", "resolution", "hardware", "source", "status", "time", "s_per_iter", "speedup",
               "train_speedup", "train_speedup_basis", "predicted_train_speedup", "rollout_speedup", "backward",
               "peak_mib", "grad_cosine", "final_reward_pm"]
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
            "s_per_iter": _interval(med, p25, p75, 3, "") if is_number(med) else "",
            "speedup": _interval(r.get("speedup"), r.get("speedup_lo"), r.get("speedup_hi")),
            "train_speedup": _interval(r.get("train_speedup"), r.get("train_speedup_lo"), r.get("train_speedup_hi")),
            "train_speedup_basis": r.get("train_speedup_basis"),
            "predicted_train_speedup": r.get("predicted_train_speedup"),
            "rollout_speedup": _interval(r.get("rollout_speedup"), r.get("rollout_speedup_lo"),
                                         r.get("rollout_speedup_hi")),
            "backward": r.get("backward"),
            "peak_mib": round(float(peak[idx]), 1) if is_number(peak[idx]) else float("nan"),
            "grad_cosine": r.get("grad_cosine"),
            "final_reward_pm": (f"{reward:.4g} ± {spread:.2g}" if is_number(spread) else f"{reward:.4g}")
            if is_number(reward) else "",
        })
    return pd.DataFrame(rows, columns=columns)


def build_tables(records: pd.DataFrame, gradcheck: pd.DataFrame, warmup: int = 1, time: str = "auto",
                 calibration: pd.DataFrame | None = None) -> dict[str, pd.DataFrame]:
    """Every table of ``TABLES`` from the records, gradcheck rows and calibrations. A ratio over a time of 0 (a
    record may hold one) is not defined: an empty cell, never an infinity (:func:`finite_only`)."""
    efficiency = finite_only(efficiency_table(records, gradcheck, warmup, time, calibration))
    return {"summary": summary_table(efficiency), "efficiency": efficiency,
            "ablation": finite_only(ablation_table(gradcheck)), "gpus": gpus_table(efficiency)}


def finite_only(table: pd.DataFrame) -> pd.DataFrame:
    """``table`` with every infinity in its float columns NaN (a table holds finite numbers or empty cells)."""
    out = table.copy()
    for column in out.columns:
        if pd.api.types.is_float_dtype(out[column]):
            out[column] = out[column].where(np.isfinite(out[column]) | out[column].isna())
    return out

