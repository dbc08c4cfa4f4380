"""Quality at equal compute: the held-out reward of the learning sweep's runs against what they spent.

Input: the runs' in-run evaluations (``eval.every`` > 0: ``evaluations.jsonl``, one line per evaluated
state, ``iteration`` n = the iterations trained before it, 0 = the starting weights) and their records
(``cost``: cumulative cost units of ``train.pass_costs``; ``t_iter_cpu_s``). Outputs:

- ``curves.csv``: one row per evaluation of every run, columns exactly :data:`CURVE_COLUMNS`: the
  method, seed, ``iteration``, ``cost`` and ``cpu_s`` (cumulative ``t_iter_cpu_s``, or ``t_iter_s``
  where a record has no CPU time: the learning table's ``time_key``) after those iterations (0 and 0 for
  the starting weights) and ``eval_reward``.
- the equal-compute columns of ``learning.csv`` (:func:`target_columns`): the *target* is
  ``target_fraction`` (default 0.9) x the reference method's (``full``) mean held-out gain, the gain of a
  run being its final evaluation minus its starting one. A run reaches it at the first evaluation whose
  reward is at least its starting reward + target; its ``target_cost`` is the cost there, linearly
  interpolated between that evaluation and the one before (the curve is taken as straight between
  evaluations: cost = c0 + (start + target - r0) / (r1 - r0) x (c1 - c0)), and ``target_cpu_s`` the same
  for CPU seconds. A method's value is the mean over its seeds with a 95 % bootstrap interval over seeds
  (``_lo``, ``_hi``: :func:`~agg_bench.results.stats.mean_ci`); ``target_reached`` counts the seeds that
  reach it, and a method with a seed that never does is *not reached* (NaN in every numeric target
  column). ``speedup_to_target`` = the reference's mean target cost / the method's, its interval
  resampling both methods' seeds independently (:func:`~agg_bench.results.stats.ratio_of_means_ci`).
- ``eval_reward_cost.png`` / ``eval_reward_cpu.png``: the mean held-out reward over seeds against cost
  units / CPU seconds, with a band of +- one standard deviation over seeds (evaluations matched by their
  position in each run, the x value their mean over seeds; a method's curve ends at its shortest run's);
  ``eval_pareto.png``: each method's final held-out reward against its total cost, means over seeds with
  +- one standard deviation as error bars.
"""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pandas as pd

from ..errors import UserError
from ..io import save_figure
from .plotting import pyplot
from .stats import mean_ci, ratio_of_means_ci

CURVE_COLUMNS = ("method", "seed", "iteration", "cost", "cpu_s", "eval_reward")
TARGET_COLUMNS = ("target_reached", "target_cost", "target_cost_lo", "target_cost_hi", "target_cpu_s",
                  "speedup_to_target", "speedup_to_target_lo", "speedup_to_target_hi")
CURVE_PLOTS = ("eval_reward_cost", "eval_reward_cpu", "eval_pareto")


def run_curve(evaluations: pd.DataFrame, records: pd.DataFrame, times: np.ndarray) -> pd.DataFrame:
    """One run's evaluations with the ``cost`` and ``cpu_s`` at each (``times``: its records' seconds per
    iteration, in their order): the record of iteration n - 1 holds what n iterations spent."""
    spent = {0: (0.0, 0.0)}
    costs = records["cost"].to_numpy(float) if "cost" in records else np.full(len(records), np.nan)
    for iteration, cost, cpu in zip(records["iteration"].astype(int), costs, np.cumsum(times)):
        spent[iteration + 1] = (float(cost), float(cpu))
    rows = []
    for _, line in evaluations.iterrows():
        n = int(line["iteration"])
        if n not in spent:
            raise UserError(f"an evaluation after {n} iterations without the record of iteration {n - 1}")
        rows.append({"iteration": n, "cost": spent[n][0], "cpu_s": spent[n][1], **line.drop("iteration").to_dict()})
    return pd.DataFrame(rows)


def crossing(xs: np.ndarray, rewards: np.ndarray, threshold: float) -> float:
    """``xs`` where the curve (``rewards`` at ``xs``, straight between points) first reaches ``threshold``:
    at the first point at or above it, interpolated from the point before; NaN if none is."""
    above = np.flatnonzero(rewards >= threshold)
    if above.size == 0:
        return math.nan
    k = int(above[0])
    if k == 0:
        return float(xs[0])
    r0, r1, x0, x1 = rewards[k - 1], rewards[k], xs[k - 1], xs[k]
    return float(x0 + (threshold - r0) / (r1 - r0) * (x1 - x0))


def curve_gain(curve: pd.DataFrame) -> float:
    """Final minus starting held-out reward of one run's curve (NaN without the starting evaluation)."""
    start = curve.loc[curve["iteration"] == 0, "eval_reward"]
    return float(curve["eval_reward"].iloc[-1] - start.iloc[0]) if len(start) else math.nan


def target_gain(curves: dict, methods: dict, reference: str, fraction: float) -> float | None:
    """``fraction`` x the reference method's mean held-out gain over its runs' curves; None when the
    reference has no curve or does not gain."""
    gains = [curve_gain(curves[key]) for key in methods.get(reference, []) if key in curves]
    gains = [g for g in gains if np.isfinite(g)]
    mean = float(np.mean(gains)) if gains else math.nan
    return fraction * mean if mean > 0 else None


def seed_targets(curve: pd.DataFrame, target: float) -> tuple[float, float]:
    """(cost, CPU seconds) at which one run's curve first reaches its starting reward + ``target``."""
    rewards = curve["eval_reward"].to_numpy(float)
    threshold = float(curve.loc[curve["iteration"] == 0, "eval_reward"].iloc[0]) + target
    return (crossing(curve["cost"].to_numpy(float), rewards, threshold),
            crossing(curve["cpu_s"].to_numpy(float), rewards, threshold))


def target_columns(curves: dict, methods: dict, reference: str, fraction: float) -> dict[str, dict]:
    """method -> its :data:`TARGET_COLUMNS` (module docstring); ``curves`` maps a run's key to its curve,
    ``methods`` a method to its runs' keys. All NaN for a method without curves or without a target."""
    target = target_gain(curves, methods, reference, fraction)
    reached: dict[str, tuple[np.ndarray, np.ndarray] | None] = {}
    for method, keys in methods.items():
        mine = [curves[key] for key in keys if key in curves]
        if target is None or not mine or len(mine) < len(keys):
            reached[method] = None
            continue
        reached[method] = tuple(np.array(v) for v in zip(*(seed_targets(c, target) for c in mine)))
    out = {}
    for method in methods:
        row = dict.fromkeys(TARGET_COLUMNS, math.nan)
        if reached[method] is not None:
            costs, cpus = reached[method]
            row["target_reached"] = int(np.isfinite(costs).sum())
            if np.isfinite(costs).all():
                row["target_cost"] = float(costs.mean())
                row["target_cost_lo"], row["target_cost_hi"] = mean_ci(costs)
                row["target_cpu_s"] = float(cpus.mean())
                ref = reached.get(reference)
                if ref is not None and np.isfinite(ref[0]).all():
                    row["speedup_to_target"] = float(ref[0].mean() / costs.mean())
                    row["speedup_to_target_lo"], row["speedup_to_target_hi"] = ratio_of_means_ci(ref[0], costs)
        out[method] = row
    return out


def curve_gain_columns(curves: list[pd.DataFrame]) -> dict:
    """A method's held-out evaluation columns from its runs' in-run curves: the starting and final rewards
    (means over seeds), the gain (final - starting) with its standard deviation over seeds (ddof 1) and
    their ratio, and the sub-scores' gains; the same names as the checkpoint evaluation's
    (:func:`agg_bench.results.learning.evaluation_columns`)."""
    first = pd.DataFrame([c[c["iteration"] == 0].iloc[0] for c in curves])
    last = pd.DataFrame([c.iloc[-1] for c in curves])
    gains = last["eval_reward"].to_numpy(float) - first["eval_reward"].to_numpy(float)
    std = float(gains.std(ddof=1)) if len(gains) > 1 else math.nan
    row = {"eval_initial": float(first["eval_reward"].mean()), "eval_final": float(last["eval_reward"].mean()),
           "eval_gain": float(gains.mean()), "eval_gain_std": std,
           "eval_gain_over_spread": float(gains.mean()) / std if std > 0 else math.nan}
    for key in [c for c in last.columns if c.startswith("eval_reward_")]:
        row[f"{key}_gain"] = float((last[key].to_numpy(float) - first[key].to_numpy(float)).mean())
    return row


def curves_table(curves: dict, labels: dict) -> pd.DataFrame:
    """``curves.csv``: every curve's rows with its method and seed (``labels``: key -> (method, seed))."""
    frames = [curve.assign(method=labels[key][0], seed=labels[key][1]) for key, curve in curves.items()]
    if not frames:
        return pd.DataFrame(columns=list(CURVE_COLUMNS))
    return pd.concat(frames, ignore_index=True)[list(CURVE_COLUMNS)]


def plot_curves(curves: dict, methods: dict, path: str | Path, x: str, time_label: str = "CPU seconds") -> Path:
    """Mean held-out reward over seeds against ``x`` (``cost`` or ``cpu_s``), with a +- 1 std band."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for k, (method, keys) in enumerate(methods.items()):
        mine = [curves[key] for key in keys if key in curves]
        if not mine:
            continue
        n = min(len(c) for c in mine)
        rewards = np.stack([c["eval_reward"].to_numpy(float)[:n] for c in mine])
        xs = np.stack([c[x].to_numpy(float)[:n] for c in mine]).mean(0)
        mean, std = rewards.mean(0), rewards.std(0)
        color = plt.get_cmap("tab10")(k % 10)
        ax.plot(xs, mean, color=color, marker=".", label=f"{method} ({len(mine)} seeds)")
        ax.fill_between(xs, mean - std, mean + std, color=color, alpha=0.15, linewidth=0)
    ax.set_title("mean over seeds, band +- 1 std", fontsize=8)
    _finish(ax, "cost units (train.pass_costs)" if x == "cost" else f"cumulative {time_label}", curves)
    fig.tight_layout()
    save_figure(fig, path)
    plt.close(fig)
    return Path(path)


def plot_pareto(curves: dict, methods: dict, path: str | Path) -> Path:
    """Each method's final held-out reward against its total cost: means over seeds, +- 1 std bars."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for k, (method, keys) in enumerate(methods.items()):
        finals = np.array([[curves[key]["cost"].iloc[-1], curves[key]["eval_reward"].iloc[-1]]
                           for key in keys if key in curves], dtype=float)
        if not len(finals):
            continue
        mean, std = finals.mean(0), finals.std(0)
        ax.errorbar(mean[0], mean[1], xerr=std[0], yerr=std[1], fmt="o", capsize=3,
                    color=plt.get_cmap("tab10")(k % 10), label=f"{method} ({len(finals)} seeds)")
    ax.set_title("means over seeds, bars +- 1 std", fontsize=8)
    _finish(ax, "total cost units (train.pass_costs)", curves, "final held-out reward")
    fig.tight_layout()
    save_figure(fig, path)
    plt.close(fig)
    return Path(path)


def _finish(ax, xlabel: str, curves: dict, ylabel: str = "held-out reward (eval_reward)") -> None:
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    if curves:
        ax.legend(fontsize=7)
    else:  # a sweep without in-run evaluations still gets its files
        ax.text(0.5, 0.5, "no in-run evaluations (eval.every: 0)", ha="center", va="center", transform=ax.transAxes)
