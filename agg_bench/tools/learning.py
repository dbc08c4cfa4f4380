"""The learning sweep's tables and plots: does each method raise the reward, how reliably, how fast?

The command, ``python -m agg_bench.tools.learning --manifest FILE [--tables DIR] [--plots DIR] ...``,
reads the runs of the workflow's manifest, evaluates each model state on held-out noise
(:class:`Evaluation`, which samples the models: the engine and torch are imported here, not in the
results wing) and writes the tables and plots of :mod:`agg_bench.results.learning` (its docstring
says what every column and plot is).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import pandas as pd

from ..errors import UserError, run_command
from ..io import write_text
from ..outdir import claimed_folders
from ..results.learning import (PLOTS_CONTENTS, TABLES_CONTENTS, Run, learning_table, load_runs, plot_rewards,
                                write_table)

SAMPLERS = ("ode", "sde")  # the held-out evaluation's


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

        config = RunConfig.from_dict(json.loads((runs[0].dir / "config.json").read_text()))
        model = config.model
        self.policy = load_policy(model.family, model.preset, model.pretrained, model.dtype)
        prompts = prompt_set(config.prompts.file)
        # noise-major: the first len(prompts) images are each caption with the first noise
        index = [i for _ in range(noises) for i in range(len(prompts.prompts))]
        self.captions = [prompts.prompts[i] for i in index]
        self.cond = prompt_conditioning(config, self.policy.transformer, prompts)[index]
        self.latent_shape = self.policy.latent_shape(model.resolution)
        self.steps, self.shift = config.sampling.steps, config.sampling.shift or 3.0
        self.sde, self.eta = config.sampling.sde, config.sampling.eta
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
    parser = argparse.ArgumentParser(prog="python -m agg_bench.tools.learning", description=__doc__.splitlines()[0])
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

    return run_command("agg_bench.tools.learning", body, ["python", "-m", "agg_bench.tools.learning", *argv])


if __name__ == "__main__":
    sys.exit(main())
