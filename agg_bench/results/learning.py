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
- ``reward_iteration.png`` / ``reward_time.png``: mean reward over seeds against iteration / cumulative
  CPU time, with a band of +- one standard deviation over seeds.
- ``samples.png`` (:func:`sample_grids`): the same captions and noise sampled from the pre-trained model
  and from each method's final weights (``checkpoint.pt`` of one seed).
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from ..errors import UserError, quote, run_command
from ..io import read_jsonl, save_figure, write_text
from ..jsonfiles import read_json_object
from ..outdir import Contents, claimed_folders
from .plotting import pyplot
from .records import record_problem

SUBSCORES = ("reward_color", "reward_shape", "reward_position", "reward_count")
TIME_KEYS = ("t_iter_cpu_s", "t_iter_s")  # preferred first
SAMPLERS = ("ode", "sde")  # the held-out evaluation's
# what --tables DIR and --plots DIR hold (the workflow writes its manifest.json beside them)
TABLES_CONTENTS = Contents("learning tables", ("learning.csv", "learning.md", "evaluation.csv", "manifest.json"))
PLOTS_CONTENTS = Contents("learning plots", ("reward_iteration.png", "reward_time.png", "samples.png",
                                             "manifest.json"))


@dataclass
class Run:
    method: str
    seed: int
    dir: Path
    records: pd.DataFrame


def load_runs(manifest: str | Path) -> list[Run]:
    """Every run of the manifest that has records, ordered by iteration."""
    path = Path(manifest)
    if not path.is_file():
        raise UserError(f"manifest {path}: no such file")
    runs = []
    entries = read_json_object(path, "a learning manifest (an object with a list of runs)").get("runs", [])
    if not isinstance(entries, list):
        raise UserError(f"manifest {path}: runs = {quote(entries)}: expected a list")
    for i, entry in enumerate(entries):
        if not (isinstance(entry, dict) and isinstance(entry.get("dir"), str) and isinstance(entry.get("method"), str)
                and type(entry.get("seed")) in (int, type(None))):
            raise UserError(f"manifest {path}: runs[{i}] = {quote(entry)}: expected an object with the run's "
                            "dir and method (strings) and its seed (an integer)")
        metrics = Path(entry["dir"]) / "metrics.jsonl"
        if not metrics.is_file():
            raise UserError(f"{metrics}: no such file (has the run finished?)")
        lines = list(read_jsonl(metrics))
        for k, record in enumerate(lines):
            if record_problem(record) is not None:
                raise UserError(f"{metrics}: record {k + 1}: {record_problem(record)}")
        records = pd.DataFrame(lines)
        if records.empty:
            continue
        records = records[records["status"] == "ok"].sort_values("iteration").reset_index(drop=True)
        runs.append(Run(entry["method"], int(entry.get("seed") or 0), Path(entry["dir"]), records))
    if not runs:
        raise UserError(f"manifest {path}: no run with records")
    return runs


def iteration_times(records: pd.DataFrame) -> tuple[np.ndarray, str]:
    """Per-iteration CPU seconds (wall seconds where a record has no CPU time) and the key used."""
    for key in TIME_KEYS:
        if key in records and records[key].notna().all():
            return records[key].to_numpy(float), key
    raise UserError("records without t_iter_s: cannot place them in time")


def run_gain(records: pd.DataFrame, average: int) -> dict:
    """Initial, final and gain of one run's reward (and of each scene sub-score it records)."""
    if len(records) < 2 * average:
        raise UserError(f"a run of {len(records)} iterations: the learning table needs at least {2 * average}")
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
                   evaluation: pd.DataFrame | None = None) -> pd.DataFrame:
    """One row per method (order of first appearance); see the module docstring for the columns.
    ``evaluation`` (:func:`evaluate`'s scores) adds the held-out evaluation's columns."""
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
        row["reached"] = f"{len(hits)}/{len(mine)}" if target and target > 0 else "no full gain"
        row["cpu_s_to_target"] = float(np.mean(hits)) if hits else math.nan
        if evaluation is not None:
            row.update(evaluation_columns(evaluation, method))
        rows.append(row)
    table = pd.DataFrame(rows)
    leading = ["method", "seeds", "eval_initial", "eval_final", "eval_gain", "eval_gain_std", "eval_gain_over_spread",
               "reward_initial", "reward_final", "reward_gain", "gain_std", "gain_over_spread",
               "cpu_s_to_target", "reached", "cpu_s_per_iteration", "time_key"]
    return table[[c for c in leading if c in table] + [c for c in table if c not in leading]]


def to_markdown(table: pd.DataFrame, caption: str) -> str:
    def cell(value) -> str:
        if isinstance(value, float):
            return "—" if math.isnan(value) else f"{value:.3f}" if abs(value) < 100 else f"{value:.0f}"
        return str(value)

    lines = [caption, "", "| " + " | ".join(table.columns) + " |", "|" + "---|" * len(table.columns)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in table.itertuples(index=False)]
    return "\n".join(lines) + "\n"


def write_table(table: pd.DataFrame, out_dir: str | Path, average: int, fraction: float) -> list[Path]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    csv, md = out / "learning.csv", out / "learning.md"
    write_text(csv, table.to_csv(index=False))
    caption = (f"Reward gain per method (final - initial: means of the last and first {average} iterations), "
               f"mean and standard deviation over seeds; CPU seconds until the running reward first gains "
               f"{fraction:g} x full's mean gain.")
    write_text(md, to_markdown(table, caption))
    return [csv, md]


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
        color = plt.get_cmap("tab10")(k % 10)
        ax.plot(xs, mean, color=color, label=f"{method} ({len(mine)} seeds)")
        ax.fill_between(xs, mean - std, mean + std, color=color, alpha=0.15, linewidth=0)
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


class Evaluation:
    """The held-out evaluation: every caption of the runs' prompt file x ``noises`` fixed noises (seeded
    by ``seed``: identical for every method, seed and model state), sampled with the runs' step count and
    shift, and scored by the scene reward. ``sampler``: ``ode`` (the deterministic Euler sampler) or
    ``sde`` (the rollouts' own SDE and eta, :func:`~agg_bench.engine.rollout.rollout`, its step noise drawn from
    the same seeded generator for every state). Either way a model state's score depends on its weights
    alone, so the pre-trained weights' score is one number shared by every run and a run's gain differs
    from another's only by what training did."""

    def __init__(self, runs: list[Run], noises: int = 16, seed: int = 0, sampler: str = "ode"):
        from ..config import RunConfig
        from ..engine.models import load_policy
        from ..engine.text import prompt_conditioning, prompt_set

        config = RunConfig(json.loads((runs[0].dir / "config.json").read_text()))
        model = config["model"]
        self.policy = load_policy(model["family"], model["preset"], model["pretrained"], model["dtype"])
        prompts = prompt_set(config["prompts"]["file"])
        # noise-major: the first len(prompts) images are each caption with the first noise
        index = [i for _ in range(noises) for i in range(len(prompts.prompts))]
        self.captions = [prompts.prompts[i] for i in index]
        self.cond = prompt_conditioning(config, self.policy.transformer, prompts)[index]
        self.latent_shape = self.policy.latent_shape(model["resolution"])
        self.steps, self.shift = config["sampling"]["steps"], config["sampling"]["shift"] or 3.0
        self.sde, self.eta = config["sampling"]["sde"], config["sampling"]["eta"]
        if sampler not in SAMPLERS:
            raise UserError(f"evaluation sampler {sampler!r}: expected one of {', '.join(SAMPLERS)}")
        self.sampler, self.seed = sampler, seed
        self.base = {k: v.clone() for k, v in self.policy.transformer.state_dict().items()}

    def images(self, run: Run | None):
        """Images of the pre-trained weights (``run`` None) or of the run's final ``checkpoint.pt``; None if
        the run saved no checkpoint."""
        import torch

        from ..engine.rollout import rollout
        from ..engine.sde import flow_sigmas
        from ..runtime.checkpoint import read_checkpoint
        from ..tools.pretrain import sample

        self.policy.transformer.load_state_dict(self.base)
        if run is not None:
            state = run.dir / "checkpoint.pt"
            if not state.is_file():
                return None
            params = read_checkpoint(state).get("parameters")
            if not isinstance(params, dict):  # a sharded run's checkpoint names its shard folder instead
                raise UserError(f"{state}: holds no whole parameters (a sharded run's checkpoint); the "
                                "evaluation reads unsharded runs")
            unexpected = self.policy.transformer.load_state_dict(params, strict=False).unexpected_keys
            if unexpected:  # a checkpoint of another model: its weights would be silently ignored
                raise UserError(f"{state}: parameters the model does not have ({unexpected[0]}, ...)")
        generator = torch.Generator().manual_seed(self.seed)
        if self.sampler == "ode":
            return sample(self.policy, self.cond, self.latent_shape, self.steps, self.shift, generator)
        noise = torch.randn((self.cond.batch_size, *self.latent_shape), generator=generator)
        sigmas = flow_sigmas(self.steps, self.shift)
        latents = rollout(self.policy, self.cond, noise, sigmas, self.sde, self.eta, generator).latents[:, -1]
        return self.policy.decode(latents.float())

    def score(self, images) -> dict[str, np.ndarray]:
        """Per-image scene reward (``reward``) and sub-scores (``reward_color`` ...)."""
        from ..engine.scene_reward import SceneReward

        reward = SceneReward()
        total = reward(images, self.captions)
        return {"reward": total.numpy(), **{k: v.numpy() for k, v in reward.details.items()}}


def evaluate(runs: list[Run], evaluation: Evaluation) -> tuple[pd.DataFrame, dict]:
    """One row per model state (``pre-trained``, then every run with a checkpoint): method, seed and the
    mean evaluation reward and sub-scores (``eval_reward``, ``eval_reward_color`` ...); and the images of
    each state, by label (``pre-trained`` or ``method/seed``)."""
    rows, images = [], {}
    for run in [None, *runs]:
        sampled = evaluation.images(run)
        if sampled is None:
            continue
        label = "pre-trained" if run is None else f"{run.method}/{run.seed}"
        images[label] = sampled
        scores = evaluation.score(sampled)
        rows.append({"state": label, "method": None if run is None else run.method,
                     "seed": None if run is None else run.seed,
                     **{f"eval_{k}": float(v.mean()) for k, v in scores.items()}})
    return pd.DataFrame(rows), images


def evaluation_columns(scores: pd.DataFrame, method: str) -> dict:
    """A method's evaluation columns: the pre-trained score (``eval_initial``), the mean final score over
    its seeds, the gain with its standard deviation over seeds (ddof 1) and their ratio, and the sub-scores'
    gains. Empty if the method has no evaluated run."""
    initial = scores[scores["state"] == "pre-trained"].iloc[0]
    mine = scores[scores["method"] == method]
    if mine.empty:
        return {}
    gains = mine["eval_reward"] - initial["eval_reward"]
    std = float(gains.std(ddof=1)) if len(gains) > 1 else math.nan
    row = {"eval_initial": float(initial["eval_reward"]), "eval_final": float(mine["eval_reward"].mean()),
           "eval_gain": float(gains.mean()), "eval_gain_std": std,
           "eval_gain_over_spread": float(gains.mean()) / std if std > 0 else math.nan}
    for key in SUBSCORES:
        if f"eval_{key}" in mine:
            row[f"eval_{key}_gain"] = float((mine[f"eval_{key}"] - initial[f"eval_{key}"]).mean())
    return row


def sample_grids(runs: list[Run], images: dict, captions: list[str], path: str | Path, n_captions: int) -> Path:
    """One row per model state: the pre-trained model, then each method's final weights (its first seed);
    the first ``n_captions`` evaluation images of each (the same captions and noise in every row)."""
    import torch

    from ..engine.scene_reward import SceneReward
    from ..tools.pretrain import save_grid

    first = {}
    for run in runs:
        first.setdefault(run.method, run)
    rows, labels, values = [], [], []
    reward = SceneReward()
    for label in ["pre-trained", *(f"{r.method}/{r.seed}" for r in first.values())]:
        if label not in images:
            continue
        picked = images[label][:n_captions]
        rows.append(picked)
        values += reward(picked, captions[:n_captions]).tolist()
        labels += [f"{label}: {c}" for c in captions[:n_captions]]
    path = Path(path)
    save_grid(path, torch.cat(rows), labels, values, columns=n_captions,
              title="rows: pre-trained, then each method's final weights (same noise per column)")
    return path


def write_outputs(args: argparse.Namespace, runs: list[Run]) -> None:
    """The tables and plots that the command line asks for."""
    scores = images = None
    if args.eval_noises or args.plots:  # the sample grid shows the evaluation's first images
        evaluation = Evaluation(runs, max(args.eval_noises, 1), args.eval_seed, args.eval_sampler)
        scores, images = evaluate(runs, evaluation)
    if args.tables:
        table = learning_table(runs, args.average, args.fraction, evaluation=scores if args.eval_noises else None)
        write_table(table, args.tables, args.average, args.fraction)
        if args.eval_noises:
            write_text(args.tables / "evaluation.csv", scores.to_csv(index=False))
    if args.plots:
        plot_rewards(runs, args.plots / "reward_iteration.png", "iteration")
        plot_rewards(runs, args.plots / "reward_time.png", "time")
        n_captions = len(evaluation.captions) // max(args.eval_noises, 1)
        sample_grids(runs, images, evaluation.captions, args.plots / "samples.png", min(n_captions, 6))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m agg_bench.results.learning", description=__doc__.splitlines()[0])
    parser.add_argument("--manifest", required=True, type=Path)
    parser.add_argument("--tables", type=Path, help="write learning.csv, learning.md (and evaluation.csv) here")
    parser.add_argument("--plots", type=Path, help="write reward_iteration.png, reward_time.png, samples.png here")
    parser.add_argument("--average", type=int, default=3, help="iterations averaged at each end (default 3)")
    parser.add_argument("--fraction", type=float, default=0.8, help="fraction of full's gain to reach (default 0.8)")
    parser.add_argument("--eval-noises", type=int, default=0,
                        help="held-out evaluation: noises per caption (default 0: no evaluation columns)")
    parser.add_argument("--eval-seed", type=int, default=0, help="seed of the evaluation's noise (default 0)")
    parser.add_argument("--eval-sampler", default="ode", choices=SAMPLERS,
                        help="ode: deterministic Euler; sde: the rollouts' SDE with seeded step noise (default ode)")
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parser.parse_args(argv)

    def body() -> int:
        if args.average < 1:
            raise UserError(f"--average {args.average}: expected an integer >= 1")
        if not 0 < args.fraction <= 1:
            raise UserError(f"--fraction {args.fraction}: expected a number in (0, 1]")
        if not 0 <= args.eval_noises <= 1024:
            raise UserError(f"--eval-noises {args.eval_noises}: expected an integer from 0 to 1024")
        if args.eval_seed < 0:
            raise UserError(f"--eval-seed {args.eval_seed}: expected an integer >= 0")
        runs = load_runs(args.manifest)
        with claimed_folders([(args.tables, TABLES_CONTENTS), (args.plots, PLOTS_CONTENTS)], ("--tables", "--plots")):
            write_outputs(args, runs)
        return 0

    return run_command("agg_bench.results.learning", body, ["python", "-m", "agg_bench.results.learning", *argv])


if __name__ == "__main__":
    sys.exit(main())
