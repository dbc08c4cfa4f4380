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
  run being its final evaluation minus its starting one. A method's held-out curve is the mean over its
  seeds (:func:`mean_curve`: evaluations matched by position, each coordinate averaged, up to the shortest
  run: the curve the plots draw; the reader refuses seeds of one method evaluated on other schedules,
  :func:`agg_bench.results.learning_tables.check_one_schedule`). It reaches the target at the first evaluation whose mean reward is at
  least its starting reward + target; ``target_cost`` is the cost there, linearly interpolated between that
  evaluation and the one before (the curve is taken as straight between evaluations: cost = c0 + (start +
  target - r0) / (r1 - r0) x (c1 - c0)), and ``target_cpu_s`` the same for CPU seconds; NaN where the mean
  curve never reaches it (*not reached*). ``target_cost_lo`` / ``_hi``: a 95 % percentile bootstrap interval
  over seeds: 2,000 resamples of the method's seeds with replacement, each one's mean curve crossed the same
  way; a resample whose curve never reaches the target counts as infinitely costly, so ``_hi`` is ``inf``
  where more than 2.5 % of them do not. The mean curve, not the mean of each seed's crossing, because one
  noisy seed that ends below the target would otherwise leave the whole method, the reference included, with
  no cost at all. ``target_reached`` counts the seeds whose own curve reaches it. ``speedup_to_target`` =
  the reference's target cost / the method's, its interval from the two methods' resamples drawn
  independently (separate runs), paired replicate by replicate (a replicate where neither reaches it is left
  out).
- the held-out gain columns of ``learning.csv`` from the runs' curves (:func:`curve_gain_columns`): the starting
  and final reward, the gain and its standard deviation over seeds, each sub-score's gain
  (``eval_reward_<sub-score>_gain``) with its standard deviation (``_std``), and ``unseen_change``: the mean gain
  of the sub-scores the reward does not weigh (``unseen``: e.g. colour, position and count for the learning
  sweep's shape reward), per seed and then averaged, with ``unseen_change_std``; NaN where the reward weighs
  every sub-score or the runs do not say.
- ``eval_reward_cost.png`` / ``eval_reward_cpu.png``: the mean held-out reward over seeds against cost
  units / CPU seconds, with a band of +- one standard deviation over seeds (evaluations matched by their
  position in each run, the x value their mean over seeds; a method's curve ends at its shortest run's);
  ``eval_pareto.png``: what the reward sees against what it does not: each method's held-out gain of the
  trained reward (y) against its ``unseen_change`` (x), means over seeds with +- one standard deviation (ddof 1)
  as error bars. Every method has its own colour and marker in every plot (:func:`~agg_bench.results.plotting.
  method_style`).
"""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pandas as pd

from ..errors import UserError, counted
from ..io import save_figure
from .plotting import method_style, pyplot
from .stats import BOOTSTRAP_RESAMPLES, BOOTSTRAP_SEED

CURVE_COLUMNS = ("method", "seed", "iteration", "cost", "cpu_s", "eval_reward")
TARGET_COLUMNS = ("target_reached", "target_cost", "target_cost_lo", "target_cost_hi", "target_cpu_s",
                  "speedup_to_target", "speedup_to_target_lo", "speedup_to_target_hi")


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
            raise UserError(f"an evaluation after {counted(n, 'iteration')} without an ok record of iteration {n - 1}")
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


def _seed_mean(values: np.ndarray) -> np.ndarray:
    """The mean over the seeds' axis (-2) of ``values``, added one seed after another in their order (as
    ``np.mean`` adds along the first axis of a curve of two evaluations or more), for any number of mean
    curves at once."""
    total = values[..., 0, :].copy()
    for k in range(1, values.shape[-2]):
        total += values[..., k, :]
    return total / values.shape[-2]


def _stacked(curves: list[pd.DataFrame], key: str, pad: bool = False) -> np.ndarray:
    """(seeds, evaluations): column ``key`` of each curve up to the shortest (:func:`mean_curve`), or, with
    ``pad``, up to the longest with NaN after each curve's end."""
    n = (max if pad else min)(len(c) for c in curves)
    return np.stack([np.pad(c[key].to_numpy(float)[:n], (0, n - min(n, len(c))), constant_values=np.nan)
                     for c in curves])


def mean_curve(curves: list[pd.DataFrame]) -> pd.DataFrame:
    """The seeds' mean curve: evaluations matched by their position in each run (the same iterations for
    every seed of a method), up to the shortest run, ``iteration``, ``cost``, ``cpu_s`` and ``eval_reward``
    each the mean over the runs (:func:`_seed_mean`)."""
    return pd.DataFrame({k: _seed_mean(_stacked(curves, k)) for k in ("iteration", "cost", "cpu_s", "eval_reward")})


def resampled_costs(curves: list[pd.DataFrame], target: float) -> np.ndarray:
    """The target cost of the mean curve of each of :data:`BOOTSTRAP_RESAMPLES` resamples of ``curves``
    (with replacement, seeded); ``inf`` where it is not reached. The resamples' mean curves are crossed all at
    once, with the arithmetic of :func:`mean_curve` and :func:`seed_targets`: the same numbers as one at a time.
    Each mean curve ends at its shortest pick's end, where the padding's NaN starts."""
    rng = np.random.default_rng(BOOTSTRAP_SEED)
    picks = rng.integers(0, len(curves), size=(BOOTSTRAP_RESAMPLES, len(curves)))
    iterations, costs, rewards = (_seed_mean(_stacked(curves, key, pad=True)[picks])
                                  for key in ("iteration", "cost", "eval_reward"))
    rows = np.arange(len(picks))
    starts = iterations == 0
    # each resample's threshold: its mean curve's first evaluation of the starting weights, + target
    threshold = np.where(starts.any(axis=1), rewards[rows, starts.argmax(axis=1)], np.nan) + target
    above = rewards >= threshold[:, None]
    k = above.argmax(axis=1)
    before = np.maximum(k - 1, 0)
    r0, r1, c0, c1 = rewards[rows, before], rewards[rows, k], costs[rows, before], costs[rows, k]
    with np.errstate(divide="ignore", invalid="ignore"):
        crossed = np.where(k == 0, costs[rows, 0], c0 + (threshold - r0) / (r1 - r0) * (c1 - c0))
    return np.where(above.any(axis=1), crossed, np.inf)


def _interval(values: np.ndarray) -> tuple[float, float]:
    """2.5 and 97.5 % quantiles of ``values`` as drawn (inverted CDF: no interpolation, so an ``inf`` stays
    one); NaNs without a value."""
    values = values[~np.isnan(values)]
    if values.size == 0:
        return math.nan, math.nan
    lo, hi = np.quantile(values, [0.025, 0.975], method="inverted_cdf")
    return float(lo), float(hi)


def target_columns(curves: dict, methods: dict, reference: str, fraction: float) -> dict[str, dict]:
    """method -> its :data:`TARGET_COLUMNS` (module docstring); ``curves`` maps a run's key to its curve,
    ``methods`` a method to its runs' keys. All NaN for a method without curves or without a target."""
    target = target_gain(curves, methods, reference, fraction)
    found: dict[str, tuple[tuple[float, float], np.ndarray] | None] = {}
    out = {}
    for method, keys in methods.items():
        row = dict.fromkeys(TARGET_COLUMNS, math.nan)
        mine = [curves[key] for key in keys if key in curves]
        out[method], found[method] = row, None
        if target is None or not mine or len(mine) < len(keys):
            continue
        row["target_reached"] = int(sum(np.isfinite(seed_targets(c, target)[0]) for c in mine))
        point = seed_targets(mean_curve(mine), target)
        resampled = resampled_costs(mine, target)
        found[method] = (point, resampled)
        row["target_cost_lo"], row["target_cost_hi"] = _interval(resampled)
        if np.isfinite(point[0]):
            row["target_cost"], row["target_cpu_s"] = point
    ref = found.get(reference)
    if ref is None:
        return out
    # the reference's resamples in another order, so that its replicates pair with a method's independently
    ref_costs = ref[1][np.random.default_rng(BOOTSTRAP_SEED + 1).permutation(ref[1].size)]
    for method, row in out.items():
        entry = found[method]
        if entry is None:
            continue
        (cost, _), costs = entry
        with np.errstate(divide="ignore", invalid="ignore"):
            if np.isfinite(ref[0][0]) and np.isfinite(cost):
                row["speedup_to_target"] = ref[0][0] / cost
            row["speedup_to_target_lo"], row["speedup_to_target_hi"] = _interval(ref_costs / costs)
    return out


def seed_std(values: np.ndarray) -> float:
    """The standard deviation over seeds (ddof 1); NaN for one seed."""
    return float(values.std(ddof=1)) if len(values) > 1 else math.nan


def gain_columns(first: pd.DataFrame, last: pd.DataFrame, unseen: tuple[str, ...] | None) -> dict:
    """The held-out gain columns of one method from its runs' starting and final scores (a row per run, with
    ``eval_reward`` and the sub-scores ``eval_reward_<name>``): the module docstring's, the same names whether
    the scores come from the runs' curves or from agg-bench learning's checkpoint evaluation."""
    gains = last["eval_reward"].to_numpy(float) - first["eval_reward"].to_numpy(float)
    std = seed_std(gains)
    # a seed whose score is NaN (its final weights gave images that are not finite) leaves the mean empty, as it leaves
    # the gain: a mean of the other seeds would stand for every seed the row counts
    row = {"eval_initial": float(first["eval_reward"].mean(skipna=False)),
           "eval_final": float(last["eval_reward"].mean(skipna=False)),
           "eval_gain": float(gains.mean()), "eval_gain_std": std,
           "eval_gain_over_spread": float(gains.mean()) / std if std > 0 else math.nan}
    changes = {}
    for key in [c for c in last.columns if c.startswith("eval_reward_") and c in first]:
        changes[key] = last[key].to_numpy(float) - first[key].to_numpy(float)
        row[f"{key}_gain"], row[f"{key}_std"] = float(changes[key].mean()), seed_std(changes[key])
    unseen_keys = [f"eval_reward_{name}" for name in unseen or ()]
    if unseen_keys and all(key in changes for key in unseen_keys):
        per_seed = np.mean([changes[key] for key in unseen_keys], axis=0)
        row["unseen_change"], row["unseen_change_std"] = float(per_seed.mean()), seed_std(per_seed)
    return row


def curve_gain_columns(curves: list[pd.DataFrame], unseen: tuple[str, ...] | None = None) -> dict:
    """A method's held-out evaluation columns from its runs' in-run curves (:func:`gain_columns`): from each
    curve's starting evaluation to its last; ``unseen``: the sub-scores the reward does not weigh."""
    first = pd.DataFrame([c[c["iteration"] == 0].iloc[0] for c in curves])
    last = pd.DataFrame([c.iloc[-1] for c in curves])
    return gain_columns(first, last, unseen)


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
        style = method_style(k)
        ax.plot(xs, mean, **style, markersize=4, label=f"{method} ({counted(len(mine), 'seed')})")
        ax.fill_between(xs, mean - std, mean + std, color=style["color"], alpha=0.15, linewidth=0)
    ax.set_title("mean over seeds, band +- 1 std", fontsize=8)
    _finish(ax, "cost units (train.pass_costs)" if x == "cost" else f"cumulative {time_label}", curves)
    fig.tight_layout()
    save_figure(fig, path)
    plt.close(fig)
    return Path(path)


def plot_pareto(curves: dict, methods: dict, path: str | Path, unseen: dict | None = None) -> Path:
    """Each method's held-out gain of the trained reward (y) against its ``unseen_change`` (x; ``unseen``:
    method -> the sub-scores its reward does not weigh): means over seeds, +- 1 std bars (ddof 1)."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    drawn = False
    for k, (method, keys) in enumerate(methods.items()):
        mine = [curves[key] for key in keys if key in curves]
        columns = curve_gain_columns(mine, (unseen or {}).get(method)) if mine else {}
        if "unseen_change" not in columns:
            continue
        bars = [0.0 if math.isnan(v) else v for v in (columns["unseen_change_std"], columns["eval_gain_std"])]
        style = method_style(k)
        ax.errorbar(columns["unseen_change"], columns["eval_gain"], xerr=bars[0], yerr=bars[1], fmt=style["marker"],
                    color=style["color"], capsize=3, label=f"{method} ({counted(len(mine), 'seed')})")
        drawn = True
    ax.axhline(0, color="0.6", linewidth=0.8)
    ax.axvline(0, color="0.6", linewidth=0.8)
    ax.set_title("means over seeds, bars +- 1 std: what the reward sees against what it does not", fontsize=8)
    ax.set_xlabel("unseen_change: held-out change of the sub-scores the reward does not weigh")
    ax.set_ylabel("held-out gain of the trained reward (eval_gain)")
    ax.grid(alpha=0.3)
    if drawn:
        ax.legend(fontsize=7)
    else:  # no in-run evaluations, or a reward that weighs every sub-score
        ax.text(0.5, 0.5, "no unseen sub-scores (in-run evaluations of a reward that leaves some out)",
                ha="center", va="center", transform=ax.transAxes)
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
