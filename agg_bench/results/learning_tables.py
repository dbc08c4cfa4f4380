"""The learning sweep's tables and plots: does each method raise the reward, how reliably, how fast?

Input: the workflow's manifest (``{"runs": [{"dir", "method", "seed", ...}]}``) of runs on one model
(config/learning.yaml). Per run, the *initial* and *final* rewards are the means of ``reward_mean``
over its first and last ``average`` iterations; its *gain* is final - initial. Per method:

- ``learning.csv`` / ``.md``: seeds, initial, final, gain (mean over seeds), ``gain_std`` (standard
  deviation of the gain over seeds, ddof 1), ``gain_over_spread`` = gain / gain_std, the sub-score gains
  of the scene reward, the CPU seconds per iteration, and ``cpu_s_to_target``: the CPU time (cumulative
  ``t_iter_cpu_s``, or ``t_iter_s`` where a record has no CPU time: ``time_key`` says which) a run takes
  until its running mean reward over ``average`` iterations first reaches initial + ``fraction`` x the
  mean gain of ``full`` (mean over the seeds that reach it; ``reached`` counts them).
- the held-out evaluation's columns (``eval_initial``, ``eval_final``, ``eval_gain``, ``eval_gain_std``,
  ``eval_gain_over_spread``, ``eval_reward_<sub-score>_gain`` and ``_std``, ``unseen_change`` and
  ``unseen_change_std``: :func:`agg_bench.results.curves.gain_columns`; ``eval_source`` says whence): from the
  runs' in-run evaluations (``eval.every``: the last one minus the starting one, per seed) where every
  run of the method has them, else from ``agg-bench learning``'s own evaluation of the starting weights
  and each run's final checkpoint (``--eval-noises``: :func:`evaluation_columns`); NaN without either.
  ``--eval-source checkpoint`` takes every method's from the checkpoint evaluation: one with more noises
  than the runs' own (a gain measured more precisely; the curves and target columns stay the runs').
  The two agree where their settings do (the same weights, noise, sampler and reward), up to the
  arithmetic of the thread counts they ran with.
- the equal-compute columns (``target_reached``, ``target_cost`` ..., ``speedup_to_target`` ...) and
  ``curves.csv``, ``eval_reward_cost.png``, ``eval_reward_cpu.png``, ``eval_pareto.png``: from the in-run
  evaluations, :mod:`agg_bench.results.curves` (its docstring says what each is).
- ``reward_iteration.png`` / ``reward_time.png``: mean reward over seeds against iteration / cumulative
  CPU time, with a band of +- one standard deviation over seeds.
- ``samples.png`` (:func:`agg_bench.tools.learning.sample_grids`): the same captions and noise sampled
  from the pre-trained model and from each method's final weights (``checkpoint.pt`` of one seed).

The held-out evaluation samples models, so it lives with the tools (:mod:`agg_bench.tools.learning`,
also the command that writes these files); this module reads records only and imports no torch.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from ..config import dotted_value
from ..errors import UserError, counted, quote, shown
from ..io import save_figure, write_text
from ..jsonfiles import check_path, read_json_object
from .formatting import csv_text, markdown_text
from .curves import (TARGET_COLUMNS, curve_gain_columns, curves_table, gain_columns, plot_curves,
                     plot_pareto, run_curve, target_columns)
from .plotting import method_style, pyplot
from ..config.reward_options import SCENE_PARTS
from ..reading import CONFIG_FILE, FolderState, METRICS_FILE, RunFolder, SUMMARY_FILE, check_entry_names_run

SUBSCORES = tuple(f"reward_{part}" for part in SCENE_PARTS)  # the scene reward's sub-scores' record keys
TIME_KEYS = ("t_iter_cpu_s", "t_iter_s")  # preferred first
# the held-out gain: the runs' in-run evaluations where all of a method's have them / always agg-bench learning's
EVAL_SOURCES = ("auto", "checkpoint")


@dataclass
class Run:
    """One run of the manifest: its ok records in iteration order, and its in-run evaluations in order
    (None: the run has none)."""

    method: str
    seed: int
    dir: Path
    records: pd.DataFrame
    evaluations: pd.DataFrame | None = None
    unseen: tuple[str, ...] | None = None  # the sub-scores its reward does not weigh (None: it does not say)
    config: dict | None = None  # its config.json as read with its records (None: it has none)
    state: FolderState | None = None  # its folder's files when its records were read (RunFolder.whole)


def unweighted_parts(config: dict | None, path: Path) -> tuple[str, ...] | None:
    """The scene reward's sub-scores a run gave weight 0 (its ``config.json``'s ``reward.options.weights``, read
    from ``path`` as ``config``; unnamed ones weigh 0): what its reward does not see. () where it weighs all four
    (no weights: their mean); None for a run without ``config.json`` (``config`` None) or with another reward."""
    if config is None:
        return None
    reward = config.get("reward")
    if not isinstance(reward, dict) or reward.get("name") != "scene":
        return None
    weights = (reward.get("options") or {}).get("weights") if isinstance(reward.get("options"), dict) else None
    if weights is None:
        return ()
    if not isinstance(weights, dict):
        raise UserError(f"{shown(path)}: reward.options.weights = {quote(weights)}: expected a mapping of sub-scores")
    return tuple(part for part in SCENE_PARTS if not weights.get(part))


def load_runs(manifest: str | Path) -> list[Run]:
    """Every run of the manifest, its records ordered by iteration (a run without a record is refused). Each run folder is read by
    :class:`agg_bench.reading.RunFolder`: every record by the record contract, with ``status`` and
    ``iteration``, and ``reward_mean`` in an ok one; the in-run evaluations checked. A folder listed twice,
    two runs of one method and seed (a seed counts once), an entry whose seed or method is not its run's
    (:func:`check_entry_names_run`), a run that has not ended and one that ended other
    than ok (diverged, oom, error) are refused."""
    path = Path(manifest)
    check_path(path, "manifest")
    runs = []
    entries = read_json_object(path, "a learning manifest (an object with a list of runs)").get("runs", [])
    if not isinstance(entries, list):
        raise UserError(f"manifest {shown(path)}: runs = {quote(entries)}: expected a list")
    folders: dict[Path, int] = {}
    seeds: dict[tuple[str, int], int] = {}
    for i, entry in enumerate(entries):
        if not (isinstance(entry, dict) and isinstance(entry.get("dir"), str) and entry["dir"] != ""
                and isinstance(entry.get("method"), str) and type(entry.get("seed")) in (int, type(None))):
            raise UserError(f"manifest {shown(path)}: runs[{i}] = {quote(entry)}: expected an object with the run's "
                            "dir (a folder name, not '') and method (strings) and its seed (an integer)")
        method, seed, folder = entry["method"], int(entry.get("seed") or 0), RunFolder(entry["dir"])
        where = f"manifest {shown(path)}: runs[{i}]"
        resolved = folder.dir.resolve()
        if resolved in folders:
            raise UserError(f"{where}: dir {quote(entry['dir'])} is also runs[{folders[resolved]}]'s; expected each "
                            "run once")
        if (method, seed) in seeds:
            raise UserError(f"{where}: method {quote(method)} seed {seed} is also runs[{seeds[method, seed]}]'s; "
                            "expected one run per method and seed (each counts as a seed)")
        folders[resolved], seeds[method, seed] = i, i
        check_path(folder.dir, f"{where}: dir", "a run folder (what agg-bench run --out writes)", folder=True)
        # one attempt's files, never a run's that another process is resuming or replacing; what is read of the
        # folder later (a checkpoint) is read against this state
        with folder.whole() as state:
            if not folder.has(METRICS_FILE):
                raise UserError(f"{where}: {shown(folder.path(METRICS_FILE))}: no such file (has the run finished?)")
            lines = folder.records()
            summary = folder.summary()
            evaluations = folder.evaluations()
            config = folder.config_object() if folder.has(CONFIG_FILE) else None
        check_entry_names_run(where, entry, folder, lines, summary, config)
        unweighted = unweighted_parts(config, folder.path(CONFIG_FILE))
        missing = next((k for k, r in enumerate(lines, 1) if r["status"] == "ok" and r.get("reward_mean") is None),
                       None)
        if missing is not None:
            raise UserError(f"{shown(folder.path(METRICS_FILE))}: record {missing}: no 'reward_mean' (an ok record "
                            "has one)")
        if not lines:  # skipped, the method would lose a seed without a word (killed before its first record)
            raise UserError(f"{where}: {shown(folder.path(METRICS_FILE))} holds no record (was the run killed before "
                            "its first iteration?); expected a run with records, or the entry left out")
        folder.check_records_ended(summary, lines)
        # its last evaluation would stand as its final one, a gain of fewer iterations than its seeds'
        if summary.get("status") in (None, "interrupted"):
            ended = f"{SUMMARY_FILE} says it was interrupted" if summary else f"it has no {SUMMARY_FILE}"
            raise UserError(f"{where}: run {shown(folder.dir)} has not ended ({ended}); expected runs that ended "
                            "(agg-bench run --resume ends it), or the entry left out")
        # a run that diverged (or ran out of memory, or failed) has no final state of its iterations: its last ok
        # records and checkpoint would stand as the method's gain and cost, shortening every seed's curve to its
        # own, and leaving it out silently would show the method better than it ran
        if summary.get("status") != "ok":
            error = summary.get("error")
            raise UserError(f"{where}: run {shown(folder.dir)} ended {quote(summary.get('status'))}"
                            + (f" ({error.splitlines()[0]})" if isinstance(error, str) and error.strip() else "")
                            + "; expected runs that ended ok (a gain and a target cost are of whole runs), "
                              "or the entry left out")
        records = pd.DataFrame(lines)
        records = records[records["status"] == "ok"].sort_values("iteration").reset_index(drop=True)
        runs.append(Run(method, seed, folder.dir, records,
                        None if evaluations is None else
                        pd.DataFrame(evaluations).sort_values("iteration").reset_index(drop=True),
                        unweighted, config, state))
    if not runs:
        raise UserError(f"manifest {shown(path)}: lists no run; expected at least one")
    return runs


def held_out_curves(runs: list[Run]) -> tuple[dict[int, pd.DataFrame], dict[str, list[int]]]:
    """The runs' held-out curves (:func:`agg_bench.results.curves.run_curve`) by their index in ``runs``
    (runs without in-run evaluations have none), and each method's run indices (order of first appearance).
    A UserError names the run whose evaluations its records cannot place, and two runs of one method evaluated on
    other schedules (:func:`check_one_schedule`)."""
    curves = {}
    for i, run in enumerate(runs):
        if run.evaluations is not None:
            try:
                curves[i] = run_curve(run.evaluations, run.records, iteration_times(run.records)[0])
            except UserError as err:
                raise UserError(f"run {run.method}/{run.seed} ({shown(run.dir)}): {err}") from None
    methods: dict[str, list[int]] = {}
    for i, run in enumerate(runs):
        methods.setdefault(run.method, []).append(i)
    for indices in methods.values():
        check_one_schedule([(runs[i], curves[i]) for i in indices if i in curves])
    return curves, methods


def check_one_schedule(seeds: list[tuple[Run, pd.DataFrame]]) -> None:
    """A UserError naming two runs of one method (``seeds``: each run with its held-out curve) evaluated on other
    schedules: another ``eval.every`` in their ``config.json``, or, whatever their configs say, other iterations
    among their evaluations before each one's last (the one after its last iteration, which a run that its budget
    ended takes where it ended). A method's mean curve and its resamples pair the k-th evaluation of every seed
    (:func:`agg_bench.results.curves.mean_curve`): seeds of ``eval.every`` 5 and 10 were averaged at iterations
    5 and 10 as one point."""
    if not seeds:
        return
    first, first_curve = seeds[0]
    every = dotted_value(first.config or {}, "eval.every")
    regular = first_curve["iteration"].to_numpy(int)[:-1]
    for run, curve in seeds[1:]:
        other_every = dotted_value(run.config or {}, "eval.every")
        other = curve["iteration"].to_numpy(int)[:-1]
        n = min(len(regular), len(other))
        if (every is not None and other_every is not None and every != other_every) \
                or not np.array_equal(regular[:n], other[:n]):
            def schedule(who: Run, value, iterations: np.ndarray) -> str:
                shown = ", ".join(map(str, iterations[:6])) + (", ..." if len(iterations) > 6 else "")
                return (f"run {who.method}/{who.seed} ({who.dir}) eval.every = {quote(value)}, evaluated after "
                        f"iterations {shown}")
            raise UserError(f"{schedule(run, other_every, curve['iteration'].to_numpy(int))}, where "
                            f"{schedule(first, every, first_curve['iteration'].to_numpy(int))}; expected the seeds of "
                            "a method evaluated on one schedule (its mean curve pairs their k-th evaluations)")


def iteration_times(records: pd.DataFrame) -> tuple[np.ndarray, str]:
    """Per-iteration CPU seconds (wall seconds where a record has no CPU time) and the key used."""
    for key in TIME_KEYS:
        if key in records and records[key].notna().all():
            return records[key].to_numpy(float), key
    raise UserError("records without t_iter_s: cannot place them in time")


def run_gain(records: pd.DataFrame, average: int) -> dict:
    """Initial, final and gain of one run's reward (and of each scene sub-score it records)."""
    if len(records) < 2 * average:
        raise UserError(f"a run of {counted(len(records), 'iteration')}: the learning table needs at least {2 * average}")
    out = {}
    for key in ("reward_mean", *SUBSCORES):
        if key in records and records[key].notna().all():
            values = records[key].to_numpy(float)
            first, last = values[:average].mean(), values[-average:].mean()
            name = "reward" if key == "reward_mean" else key
            out[f"{name}_initial"], out[f"{name}_final"], out[f"{name}_gain"] = first, last, last - first
    return out


def cpu_time_to_reach(records: pd.DataFrame, target_gain: float, average: int) -> float | None:
    """Cumulative seconds until the running mean reward (window ``average``) first exceeds the run's
    initial reward by ``target_gain``; None if it never does."""
    rewards = records["reward_mean"].to_numpy(float)
    times, _ = iteration_times(records)
    initial = rewards[:average].mean()
    running = np.convolve(rewards, np.ones(average) / average, mode="valid")  # ends at iteration average-1+i
    for i, value in enumerate(running):
        if value - initial >= target_gain and i > 0:
            return float(times[: i + average].sum())
    return None


def learning_table(runs: list[Run], average: int = 3, fraction: float = 0.8, baseline: str = "full",
                   evaluation: pd.DataFrame | None = None, target_fraction: float = 0.9,
                   eval_source: str = "auto") -> pd.DataFrame:
    """One row per method (order of first appearance); see the module docstring for the columns.
    ``baseline`` is the reference method of both targets (``fraction`` of its rollout gain,
    ``target_fraction`` of its held-out gain); ``evaluation`` (:func:`agg_bench.tools.learning.evaluate`'s
    scores) gives the held-out evaluation's columns of methods without in-run evaluations
    (``eval_source`` ``auto``), or of every method (``checkpoint``)."""
    if eval_source not in EVAL_SOURCES:
        raise ValueError(f"eval_source {eval_source!r}: expected one of {', '.join(EVAL_SOURCES)}")
    curves, by_method = held_out_curves(runs)
    targets = target_columns(curves, by_method, baseline, target_fraction)
    gains = {id(run): run_gain(run.records, average) for run in runs}
    base = [gains[id(r)]["reward_gain"] for r in runs if r.method == baseline]
    target = fraction * float(np.mean(base)) if base else None
    rows = []
    for method in dict.fromkeys(r.method for r in runs):
        mine = [r for r in runs if r.method == method]
        frame = pd.DataFrame([gains[id(r)] for r in mine])
        row: dict = {"method": method, "seeds": len(mine)}
        for column in frame.columns:
            row[column] = float(frame[column].mean())
        row["gain_std"] = float(frame["reward_gain"].std(ddof=1)) if len(mine) > 1 else math.nan
        row["gain_over_spread"] = row["reward_gain"] / row["gain_std"] if row["gain_std"] > 0 else math.nan
        cpu, key = zip(*(iteration_times(r.records) for r in mine))
        row["time_key"] = ",".join(sorted(set(key)))
        row["cpu_s_per_iteration"] = float(np.mean([c.mean() for c in cpu]))
        reached = [cpu_time_to_reach(r.records, target, average) for r in mine] if target and target > 0 else []
        hits = [t for t in reached if t is not None]
        row["reached"] = f"{len(hits)}/{len(mine)}" if target and target > 0 else f"no {baseline} gain"
        row["cpu_s_to_target"] = float(np.mean(hits)) if hits else math.nan
        unseen = mine[0].unseen
        if eval_source == "auto" and all(i in curves for i in by_method[method]):
            row.update(curve_gain_columns([curves[i] for i in by_method[method]], unseen), eval_source="in-run")
        elif evaluation is not None and (checkpoint := evaluation_columns(evaluation, method, unseen)):
            row.update(checkpoint, eval_source="checkpoint")
        row.update(targets[method])
        rows.append(row)
    table = pd.DataFrame(rows)
    # the table's contract, even with no evaluation or no sub-score the reward leaves out
    for column in ("eval_gain", "eval_gain_std", "eval_source", "unseen_change", "unseen_change_std"):
        if column not in table:
            table[column] = math.nan
    table["target_reached"] = table["target_reached"].astype("Int64")  # a count, empty where there is no target
    leading = ["method", "seeds", "eval_initial", "eval_final", "eval_gain", "eval_gain_std", "eval_gain_over_spread",
               "unseen_change", "unseen_change_std", "eval_source", *TARGET_COLUMNS, "reward_initial", "reward_final",
               "reward_gain", "gain_std",
               "gain_over_spread", "cpu_s_to_target", "reached", "cpu_s_per_iteration", "time_key"]
    return table[[c for c in leading if c in table] + [c for c in table if c not in leading]]


def to_markdown(table: pd.DataFrame, caption: str) -> str:
    def cell(value) -> str:
        if isinstance(value, float):
            return "—" if math.isnan(value) else f"{value:.3f}" if abs(value) < 100 else f"{value:.0f}"
        return str(value)

    lines = [caption, "", "| " + " | ".join(markdown_text(str(c)) for c in table.columns) + " |",
             "|" + "---|" * len(table.columns)]
    lines += ["| " + " | ".join(markdown_text(cell(v)) for v in row) + " |" for row in table.itertuples(index=False)]
    return "\n".join(lines) + "\n"


def write_table(table: pd.DataFrame, out_dir: str | Path, average: int, fraction: float,
                target_fraction: float = 0.9, reference: str = "full") -> list[Path]:
    """``learning.csv`` and ``learning.md`` of ``table``; in the Markdown ``target_reached`` reads
    ``k/n`` (seeds whose own curve reaches the target) and a method whose mean curve never reaches it shows
    ``not reached``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    csv, md = out / "learning.csv", out / "learning.md"
    write_text(csv, csv_text(table))
    caption = (f"Reward gain per method (final - initial: means of the last and first {average} iterations), "
               f"mean and standard deviation over seeds; CPU seconds until the running reward first gains "
               f"{fraction:g} x {reference}'s mean gain. Held-out evaluation (eval_*; eval_source: in-run or "
               f"checkpoint): final - starting score; target: {target_fraction:g} x {reference}'s mean held-out "
               f"gain, target_cost in cost units (train.pass_costs) where the seeds' mean curve reaches it, with a "
               f"95 % bootstrap interval over seeds (inf: resamples that do not reach it), "
               f"speedup_to_target = {reference}'s target cost / the method's. unseen_change: the mean held-out change "
               f"of the sub-scores the reward does not weigh (eval_reward_<sub-score>_gain, each with its _std over "
               f"seeds).")
    shown = table.astype(object)
    for i, row in table.iterrows():
        if not pd.isna(row["target_reached"]):
            shown.at[i, "target_reached"] = f"{int(row['target_reached'])}/{row['seeds']}"
            if pd.isna(row["target_cost"]):
                shown.at[i, "target_cost"] = "not reached"
    write_text(md, to_markdown(shown.where(shown.notna(), math.nan), caption))
    return [csv, md]


def write_curves(runs: list[Run], out_dir: str | Path) -> Path:
    """``curves.csv``: one row per in-run evaluation of every run (:data:`~agg_bench.results.curves.CURVE_COLUMNS`;
    only the header when no run evaluated)."""
    curves, _ = held_out_curves(runs)
    table = curves_table(curves, {i: (runs[i].method, runs[i].seed) for i in curves})
    path = Path(out_dir) / "curves.csv"
    write_text(path, csv_text(table))
    return path


def plot_held_out(runs: list[Run], out_dir: str | Path) -> list[Path]:
    """The held-out curves against cost and CPU time, and the final reward against total cost
    (:data:`~agg_bench.outputs.CURVE_PLOTS`)."""
    curves, methods = held_out_curves(runs)
    key = iteration_times(runs[0].records)[1]
    out = Path(out_dir)
    unseen = {method: runs[keys[0]].unseen for method, keys in methods.items()}
    return [plot_curves(curves, methods, out / "eval_reward_cost.png", "cost"),
            plot_curves(curves, methods, out / "eval_reward_cpu.png", "cpu_s",
                        "CPU seconds" if key == "t_iter_cpu_s" else "wall seconds"),
            plot_pareto(curves, methods, out / "eval_pareto.png", unseen)]


def plot_rewards(runs: list[Run], path: str | Path, x: str) -> Path:
    """Mean reward over seeds against ``x`` ("iteration" or "time"), with a +- 1 std band."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for k, method in enumerate(dict.fromkeys(r.method for r in runs)):
        mine = [r for r in runs if r.method == method]
        n = min(len(r.records) for r in mine)
        rewards = np.stack([r.records["reward_mean"].to_numpy(float)[:n] for r in mine])
        if x == "iteration":
            xs = np.arange(n)
        else:
            xs = np.stack([np.cumsum(iteration_times(r.records)[0][:n]) for r in mine]).mean(0)
        mean, std = rewards.mean(0), rewards.std(0)
        style = method_style(k)
        ax.plot(xs, mean, **style, markersize=3, markevery=max(1, n // 10), label=f"{method} ({counted(len(mine), 'seed')})")
        ax.fill_between(xs, mean - std, mean + std, color=style["color"], alpha=0.15, linewidth=0)
    key = iteration_times(runs[0].records)[1]
    ax.set_xlabel("iteration" if x == "iteration" else
                  ("cumulative CPU seconds" if key == "t_iter_cpu_s" else "cumulative wall seconds"))
    ax.set_ylabel("scene reward (batch mean)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    save_figure(fig, path)
    plt.close(fig)
    return Path(path)


def evaluation_columns(scores: pd.DataFrame, method: str, unseen: tuple[str, ...] | None = None) -> dict:
    """A method's evaluation columns from the checkpoint evaluation (:func:`~agg_bench.results.curves.
    gain_columns`): each seed's final weights against the pre-trained score; ``unseen``: the sub-scores its
    reward does not weigh. Empty if the method has no evaluated run."""
    initial = scores[scores["state"] == "pre-trained"].iloc[0]
    mine = scores[scores["method"] == method]
    if mine.empty:
        return {}
    keys = ["eval_reward", *(f"eval_{key}" for key in SUBSCORES if f"eval_{key}" in mine)]
    first = pd.DataFrame([initial[keys]] * len(mine)).reset_index(drop=True)
    # one starting score for every seed: itself, not a mean of its copies (which can round)
    return {**gain_columns(first, mine[keys].reset_index(drop=True), unseen), "eval_initial": float(initial["eval_reward"])}
