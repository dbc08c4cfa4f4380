"""The learning sweep's tables and plots: does each method raise the reward, how reliably, how fast?

The command, ``agg-bench learning --manifest FILE [--tables DIR] [--plots DIR] ...``
(:func:`learning_report`), reads the runs of the workflow's manifest, evaluates the starting weights and
each run's final checkpoint on held-out noise (:class:`CheckpointEvaluation`, which samples the models: the
engine and torch are imported here, not in the results wing) and writes the tables and plots of
:mod:`agg_bench.results.learning` and :mod:`agg_bench.results.curves` (their docstrings say what every
column and plot is), the latter from the runs' own in-run evaluations.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from ..errors import UserError
from ..io import write_text
from ..outdir import claimed_folders
from ..results.learning import (EVAL_SOURCES, PLOTS_CONTENTS, TABLES_CONTENTS, Run, learning_table, load_runs,
                                plot_held_out, plot_rewards, write_curves, write_table)
from ..runtime.evaluation import SAMPLERS

GRID_CAPTIONS = 6  # the sample grid's columns: the first captions of the evaluation's first noise


class CheckpointEvaluation:
    """The held-out evaluation (:class:`agg_bench.runtime.evaluation.Evaluation`) of the runs' starting
    weights and of each run's final ``checkpoint.pt``: the model, prompts, schedule, SDE and reward of the
    first run's config, ``noises`` fixed noises per caption seeded by ``seed``, ``sampler`` ``ode`` or
    ``sde``. A run's in-run evaluations (``eval.every``) are the same evaluation of its weights along the
    way."""

    def __init__(self, runs: list[Run], noises: int = 16, seed: int = 0, sampler: str = "ode"):
        from ..config import RunConfig
        from ..engine.models import load_policy
        from ..engine.rewards import build_reward
        from ..engine.text import prompt_conditioning, prompt_set
        from ..runtime.evaluation import Evaluation
        from ..runtime.session import run_sigmas

        config = RunConfig.from_dict(json.loads((runs[0].dir / "config.json").read_text()))
        model = config.model
        policy = load_policy(model.family, model.preset, model.pretrained, model.dtype)
        prompts = prompt_set(config.prompts.file)
        latent_shape = policy.latent_shape(model.resolution)
        self.evaluation = Evaluation(
            policy, prompts.prompts, prompt_conditioning(config, policy.transformer, prompts), latent_shape,
            run_sigmas(config, policy, latent_shape), config.sampling.sde, config.sampling.eta,
            build_reward(config.reward.name, config.reward.options), noises, seed, sampler, config.eval.batch_size)
        self.captions = self.evaluation.captions
        self.keep = min(len(prompts.prompts), GRID_CAPTIONS)  # what the sample grid shows of each state
        self.base = {k: v.clone() for k, v in policy.transformer.state_dict().items()}

    def evaluate_weights(self, run: Run | None) -> tuple | None:
        """The evaluation's means and first images (:meth:`Evaluation.evaluate`, ``keep`` of them) of the
        starting weights (``run`` None) or of the run's final ``checkpoint.pt``; None if the run saved no
        checkpoint."""
        from ..runtime.checkpoint import read_checkpoint

        transformer = self.evaluation.policy.transformer
        transformer.load_state_dict(self.base)
        if run is not None:
            state = run.dir / "checkpoint.pt"
            if not state.is_file():
                return None
            params = read_checkpoint(state).get("parameters")
            if not isinstance(params, dict):  # a sharded run's checkpoint names its shard folder instead
                raise UserError(f"{state}: holds no whole parameters (a sharded run's checkpoint); the "
                                "evaluation reads unsharded runs")
            unexpected = transformer.load_state_dict(params, strict=False).unexpected_keys
            if unexpected:  # a checkpoint of another model: its weights would be silently ignored
                raise UserError(f"{state}: parameters the model does not have ({unexpected[0]}, ...)")
        return self.evaluation.evaluate(self.keep)


def evaluate(runs: list[Run], evaluation: CheckpointEvaluation) -> tuple[pd.DataFrame, dict]:
    """One row per model state (``pre-trained``, then every run with a checkpoint): method, seed and the
    mean evaluation reward and sub-scores (``eval_reward``, ``eval_reward_color`` ...); and the first images
    of each state (the captions of the first noise, as many as the sample grid shows), by label
    (``pre-trained`` or ``method/seed``)."""
    rows, images = [], {}
    for run in [None, *runs]:
        evaluated = evaluation.evaluate_weights(run)
        if evaluated is None:
            continue
        label = "pre-trained" if run is None else f"{run.method}/{run.seed}"
        means, images[label] = evaluated
        rows.append({"state": label, "method": None if run is None else run.method,
                     "seed": None if run is None else run.seed, **means})
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
    fraction: the rollout reward's target, as a fraction of the reference's mean gain; in (0, 1].
    eval_noises: the checkpoint evaluation's noises per caption, 0 to 1024 (0: none, and no evaluation
        columns for methods without in-run evaluations).
    eval_seed: the seed of the checkpoint evaluation's noise, >= 0.
    eval_sampler: ``ode`` (deterministic Euler) or ``sde`` (the rollouts' SDE, step noise seeded).
    target_fraction: the held-out target (``target_cost`` ...), as a fraction of the reference's mean
        held-out gain; in (0, 1].
    reference: the method label both targets and ``speedup_to_target`` refer to.
    eval_source: where the held-out gain columns come from: ``auto`` (each method's in-run evaluations
        where all its runs have them, else the checkpoint evaluation) or ``checkpoint`` (the checkpoint
        evaluation for every method; needs ``eval_noises`` >= 1).
    """

    average: int = 3
    fraction: float = 0.8
    eval_noises: int = 0
    eval_seed: int = 0
    eval_sampler: str = "ode"
    target_fraction: float = 0.9
    reference: str = "full"
    eval_source: str = "auto"

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
        if not 0 < self.target_fraction <= 1:
            raise UserError(f"--target-fraction {self.target_fraction}: expected a number in (0, 1]")
        if not self.reference:
            raise UserError("--reference '': expected a method label of the manifest, e.g. full")
        if self.eval_source not in EVAL_SOURCES:
            raise UserError(f"--eval-source {self.eval_source!r}: expected one of {', '.join(EVAL_SOURCES)}")
        if self.eval_source == "checkpoint" and not self.eval_noises:
            raise UserError("--eval-source checkpoint: the checkpoint evaluation needs --eval-noises >= 1")


def learning_report(manifest: str | Path, tables: Path | None, plots: Path | None,
                    options: LearningOptions | None = None) -> list[Run]:
    """The tables (``learning.csv``, ``learning.md``, ``curves.csv``, and ``evaluation.csv`` with a
    checkpoint evaluation) into ``tables`` and the plots (``reward_iteration.png``, ``reward_time.png``,
    ``samples.png``, ``eval_reward_cost.png``, ``eval_reward_cpu.png``, ``eval_pareto.png``) into ``plots``
    of the manifest's runs (``options``: :class:`LearningOptions`, its defaults without); returns the runs."""
    options = options or LearningOptions()
    options.check()
    runs = load_runs(manifest)
    with claimed_folders([(tables, TABLES_CONTENTS), (plots, PLOTS_CONTENTS)], ("--tables", "--plots")):
        scores = images = None
        if options.eval_noises or plots:  # the sample grid shows the evaluation's first images
            evaluation = CheckpointEvaluation(runs, max(options.eval_noises, 1), options.eval_seed,
                                              options.eval_sampler)
            scores, images = evaluate(runs, evaluation)
        if tables:
            table = learning_table(runs, options.average, options.fraction, options.reference,
                                   scores if options.eval_noises else None, options.target_fraction,
                                   options.eval_source)
            write_table(table, tables, options.average, options.fraction, options.target_fraction, options.reference)
            write_curves(runs, tables)
            if options.eval_noises:
                write_text(tables / "evaluation.csv", scores.to_csv(index=False))
        if plots:
            plot_rewards(runs, plots / "reward_iteration.png", "iteration")
            plot_rewards(runs, plots / "reward_time.png", "time")
            plot_held_out(runs, plots)
            sample_grids(runs, images, evaluation.captions, plots / "samples.png", evaluation.keep)
    return runs
