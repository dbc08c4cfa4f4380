"""The learning sweep's tables and plots: does each method raise the reward, how reliably, how fast?

The command, ``agg-bench learning --manifest FILE [--tables DIR] [--plots DIR] ...``
(:func:`learning_report`), reads the runs of the workflow's manifest, evaluates each model state on
held-out noise (:class:`Evaluation`, which samples the models: the engine and torch are imported here, not
in the results wing) and writes the tables and plots of :mod:`agg_bench.results.learning` (its docstring
says what every column and plot is).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from ..errors import UserError
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


@dataclass
class LearningOptions:
    """What ``agg-bench learning`` computes (each field is the command's option of the same name).

    average: iterations averaged at each end of a run (its initial and final reward); at least 1.
    fraction: the target, as a fraction of ``full``'s mean gain; in (0, 1].
    eval_noises: the held-out evaluation's noises per caption, 0 to 1024 (0: no evaluation columns).
    eval_seed: the seed of the evaluation's noise, >= 0.
    eval_sampler: ``ode`` (deterministic Euler) or ``sde`` (the rollouts' SDE, step noise seeded).
    """

    average: int = 3
    fraction: float = 0.8
    eval_noises: int = 0
    eval_seed: int = 0
    eval_sampler: str = "ode"

    def check(self) -> None:
        """A UserError naming the option of the first field out of range."""
        if self.average < 1:
            raise UserError(f"--average {self.average}: expected an integer >= 1")
        if not 0 < self.fraction <= 1:
            raise UserError(f"--fraction {self.fraction}: expected a number in (0, 1]")
        if not 0 <= self.eval_noises <= 1024:
            raise UserError(f"--eval-noises {self.eval_noises}: expected an integer from 0 to 1024")
        if self.eval_seed < 0:
            raise UserError(f"--eval-seed {self.eval_seed}: expected an integer >= 0")
        if self.eval_sampler not in SAMPLERS:
            raise UserError(f"--eval-sampler {self.eval_sampler!r}: expected one of {', '.join(SAMPLERS)}")


def learning_report(manifest: str | Path, tables: Path | None, plots: Path | None,
                    options: LearningOptions | None = None) -> list[Run]:
    """The tables (``learning.csv``, ``learning.md``, and ``evaluation.csv`` with an evaluation) into
    ``tables`` and the plots (``reward_iteration.png``, ``reward_time.png``, ``samples.png``) into ``plots``
    of the manifest's runs (``options``: :class:`LearningOptions`, its defaults without); returns the runs."""
    options = options or LearningOptions()
    options.check()
    runs = load_runs(manifest)
    with claimed_folders([(tables, TABLES_CONTENTS), (plots, PLOTS_CONTENTS)], ("--tables", "--plots")):
        scores = images = None
        if options.eval_noises or plots:  # the sample grid shows the evaluation's first images
            evaluation = Evaluation(runs, max(options.eval_noises, 1), options.eval_seed, options.eval_sampler)
            scores, images = evaluate(runs, evaluation)
        if tables:
            table = learning_table(runs, options.average, options.fraction,
                                   evaluation=scores if options.eval_noises else None)
            write_table(table, tables, options.average, options.fraction)
            if options.eval_noises:
                write_text(tables / "evaluation.csv", scores.to_csv(index=False))
        if plots:
            plot_rewards(runs, plots / "reward_iteration.png", "iteration")
            plot_rewards(runs, plots / "reward_time.png", "time")
            n_captions = len(evaluation.captions) // max(options.eval_noises, 1)
            sample_grids(runs, images, evaluation.captions, plots / "samples.png", min(n_captions, 6))
    return runs
