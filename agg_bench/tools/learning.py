"""The learning sweep's tables and plots: does each method raise the reward, how reliably, how fast?

The command, ``agg-bench learning --manifest FILE [--tables DIR] [--plots DIR] ...``
(:func:`learning_report`), reads the runs of the workflow's manifest, evaluates the starting weights and
each run's final checkpoint on held-out noise (:class:`CheckpointEvaluation`, which samples the models: the
engine and torch are imported there, not in the results wing, nor with this module) and writes the tables and plots of
:mod:`agg_bench.results.learning_tables` and :mod:`agg_bench.results.curves` (their docstrings say what every
column and plot is), the latter from the runs' own in-run evaluations. Every input is checked before a
model is sampled or a file written (:func:`learning_report`), run folders through the one reader of a run
folder (:mod:`agg_bench.reading`) and checkpoints through the resume validator
(:func:`agg_bench.runtime.checkpoint.read_checkpoint`).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from ..config import dotted_value
from ..config.sections import SAMPLERS
from ..errors import ConfigError, UserError, counted, quote, shown
from ..io import write_text
from ..outdir import claimed_folders, replaced_folders
from ..outputs import LEARNING_CONTENTS
from ..results.formatting import csv_text
from ..results.learning_tables import (EVAL_SOURCES, Run, held_out_curves, learning_table, load_runs, plot_held_out,
                                       plot_rewards, write_curves, write_table)
from ..results.loading import MAX_ITERATIONS, Manifest, load_manifest
from ..reading import CONFIG_FILE, RunFolder, run_config
from ..records import MAX_LABEL
from .sweep import MeasuredAlike

GRID_CAPTIONS = 6  # the sample grid's columns: the first captions of the evaluation's first noise
MAX_EVAL_SEED = 2**32 - 1  # eval.seed's maximum: the seed of the first chunk's generator
DEFAULT_REFERENCE = "full"  # the reference method when --reference is not given


class CheckpointEvaluation:
    """The held-out evaluation (:class:`agg_bench.runtime.evaluation.Evaluation`) of the runs' starting
    weights and of each run's final ``checkpoint.pt``: the model, prompts, schedule, SDE and reward of the
    first run's ``config`` (the typed run config its folder holds; its paths checked as a run's are,
    :func:`~agg_bench.runtime.config_check.check_paths`), ``noises`` fixed noises per caption
    seeded by ``seed``, ``sampler`` ``ode`` or ``sde``. A run's in-run evaluations (``eval.every``) are the
    same evaluation of its weights along the way. ``grid``: the sample grid will score the first images
    with the scene reward, so their captions must be scene captions. The captions are checked against the
    reward before the model is loaded, and the model folder by the memory planner
    (:func:`agg_bench.runtime.memplan.check_weights_fit`)."""

    def __init__(self, runs: list[Run], noises: int = 16, seed: int = 0, sampler: str = "ode",
                 config=None, grid: bool = False):
        from ..engine.models import load_policy, unreplaced_folder
        from ..engine.rewards import build_reward
        from ..engine.scenes import caption_problem
        from ..engine.text import prompt_conditioning, prompt_set
        from ..runtime.config_check import check_paths
        from ..runtime.evaluation import Evaluation
        from ..runtime.memplan import check_weights_fit
        from ..runtime.session import run_sigmas

        if sampler not in SAMPLERS:
            raise UserError(f"evaluation sampler {sampler!r}: expected one of {', '.join(SAMPLERS)}")
        config = config if config is not None else RunFolder(runs[0].dir).config()
        try:  # a config read from a run folder was never checked: a quoted ~, a closed folder, as a run refuses
            check_paths(config)
        except ConfigError as err:
            raise UserError(f"{shown(runs[0].dir / 'config.json')}: {err}") from None
        model = config.model
        prompts = prompt_set(config.prompts.file)
        self.keep = min(len(prompts.prompts), GRID_CAPTIONS)  # what the sample grid shows of each state
        where = f"{shown(runs[0].dir / 'config.json')}: prompts.file"
        if config.reward.name == "scene" and (problem := caption_problem(prompts.prompts)):
            raise UserError(f"{where}: {problem}; the run's reward 'scene' scores scene captions only")
        if grid and (problem := caption_problem(prompts.prompts[:self.keep])):
            raise UserError(f"{where}: {problem}; --plots scores the sample grid (samples.png) with the scene "
                            "reward, which scores scene captions only")
        check_weights_fit(config)
        with unreplaced_folder(model.pretrained):  # the model and its conditioning from one model folder
            policy = load_policy(model.family, model.preset, model.pretrained, model.dtype,
                                 guidance=model.guidance)
            conditioning = prompt_conditioning(config, policy.transformer, prompts)
        latent_shape = policy.latent_shape(model.resolution)
        self.evaluation = Evaluation(
            policy, prompts.prompts, conditioning, latent_shape,
            run_sigmas(config, policy, latent_shape), config.sampling.sde, config.sampling.eta,
            build_reward(config.reward.name, config.reward.options), noises, seed, sampler, config.eval.batch_size)
        self.captions = self.evaluation.captions
        self.base = {k: v.clone() for k, v in policy.transformer.state_dict().items()}

    def evaluate_weights(self, run: Run | None) -> tuple | None:
        """The evaluation's means and first images (:meth:`Evaluation.evaluate`, ``keep`` of them) of the
        starting weights (``run`` None) or of the run's final ``checkpoint.pt``, read and checked by
        :func:`agg_bench.runtime.checkpoint.read_checkpoint` and loaded strictly (every trainable parameter
        of the model, each of its shape): the evaluation average's weights where the run kept one
        (``train.eval_ema``), else the trained ones (:func:`~agg_bench.runtime.checkpoint.evaluated_parameters`);
        None if the run saved no checkpoint. A checkpoint of another iteration than the run's last ok record is
        refused: its evaluation would stand as the final state's."""
        from ..runtime.checkpoint import evaluated_parameters, load_parameters, read_checkpoint

        transformer = self.evaluation.policy.transformer
        transformer.load_state_dict(self.base)
        if run is not None:
            path = run.dir / "checkpoint.pt"
            # the final state of the attempt whose records the tables read, not a checkpoint another process
            # wrote or replaced since
            with RunFolder(run.dir).whole(since=run.state):
                if not path.is_file():
                    return None
                state = read_checkpoint(path)
            last = int(run.records["iteration"].iloc[-1]) if len(run.records) else None
            if state["iteration"] != last:  # e.g. the checkpoint a resumed attempt that kept none started from
                raise UserError(f"{shown(path)}: holds iteration {state['iteration']}, not the run's last good "
                                f"iteration {last}; expected the run's final state (train.checkpoint_every > 0 writes "
                                "it at the end of a run)")
            if "shards" in state:  # a sharded run's checkpoint names its shard folder instead
                raise UserError(f"{shown(path)}: holds no whole parameters (a sharded run's checkpoint); the "
                                "evaluation reads unsharded runs")
            params = {name: p for name, p in transformer.named_parameters() if p.requires_grad}
            load_parameters(params, evaluated_parameters(state), path)
        return self.evaluation.evaluate(self.keep)


def evaluate(runs: list[Run], evaluation: CheckpointEvaluation) -> tuple[pd.DataFrame, dict]:
    """One row per model state (``pre-trained``, then every run with a checkpoint): method, seed and the
    mean evaluation reward and sub-scores (``eval_reward``, ``eval_reward_color`` ...); and the first images
    of each state (the captions of the first noise, as many as the sample grid shows), by label
    (``pre-trained`` or ``method/seed``). An error names the run it came from, a mean that is not finite (any
    sub-score's) included."""
    from ..runtime.evaluation import non_finite_key  # the model code: imported with the evaluation already

    rows, images = [], {}
    for run in [None, *runs]:
        try:
            evaluated = evaluation.evaluate_weights(run)
        except UserError as err:
            if run is None:
                raise
            raise UserError(f"run {run.method}/{run.seed} ({shown(run.dir)}): {err}") from None
        if evaluated is None:
            continue
        label = "pre-trained" if run is None else f"{run.method}/{run.seed}"
        means, images[label] = evaluated
        # a NaN or infinite mean (the weights blew up under this sampler) would stand in the tables as a gain
        if (key := non_finite_key(means)) is not None:
            where = "the pre-trained weights" if run is None else f"run {label} ({shown(run.dir)})"
            raise UserError(f"{where}: non-finite {key} in the checkpoint evaluation; expected finite scores "
                            "(the evaluated weights blew up)")
        rows.append({"state": label, "method": None if run is None else run.method,
                     "seed": None if run is None else run.seed, **means})
    # the pre-trained row has no seed: a nullable integer column keeps the runs' seeds integers in evaluation.csv
    return pd.DataFrame(rows).astype({"seed": "Int64"}), images


def one_model(runs: list[Run]):
    """The typed run config of the first run, after checking that every run of the manifest trained the
    same model (its ``model`` section): the starting weights are evaluated once, and each checkpoint is
    loaded into that model. A UserError names the first run of another model and the key."""
    configs = [run_config(run.config, run.dir / CONFIG_FILE) if run.config is not None else RunFolder(run.dir).config()
               for run in runs]  # as read with each run's records; a run without one refused by config()
    first = configs[0].model.to_dict()
    for run, config in zip(runs[1:], configs[1:]):
        other = config.model.to_dict()
        key = next((k for k in first if first[k] != other.get(k)), None)
        if key is not None:
            raise UserError(f"run {run.method}/{run.seed} ({shown(run.dir)}) trains model.{key} = "
                            f"{quote(other.get(key))}, run {runs[0].method}/{runs[0].seed} model.{key} = "
                            f"{quote(first[key])}; expected one model per manifest (the evaluation loads every "
                            "checkpoint into the first run's model)")
    return configs[0]


def one_measure(runs: list[Run]) -> None:
    """Every run of the manifest with a ``config.json`` measured as the first such run is
    (:class:`agg_bench.tools.sweep.MeasuredAlike`: the reward and captions, and between runs with in-run
    evaluations their noise and sampler): the table compares their gains and costs against one target. A
    UserError names the first run that differs, the key and both values."""
    measured = MeasuredAlike()
    for run in runs:
        # the config.json as written with the run's records: the resolved config, every key present (typed, with
        # an evaluation: one_model)
        config = run.config
        if config is None:
            continue
        found = measured.add(run, config, run.evaluations is not None)
        if found is not None:
            key, first, first_config = found
            raise UserError(f"run {run.method}/{run.seed} ({shown(run.dir)}) has {key} = "
                            f"{quote(dotted_value(config, key))}, run {first.method}/{first.seed} {key} = "
                            f"{quote(dotted_value(first_config, key))}; expected the runs of one manifest "
                            "measured alike (the table compares their gains against one target)")


def sample_grids(runs: list[Run], images: dict, captions: list[str], path: str | Path, n_captions: int) -> Path:
    """One row per model state: the pre-trained model, then each method's final weights (its first seed);
    the first ``n_captions`` evaluation images of each (the same captions and noise in every row)."""
    import torch

    from ..engine.scene_reward import SceneReward
    from ..tools.pretrain import save_grid

    first: dict[str, Run] = {}
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

    average: iterations averaged at each end of a run (its initial and final reward); 1 to train.iterations'
        maximum.
    fraction: the rollout reward's target, as a fraction of the reference's mean gain; in (0, 1].
    eval_noises: the checkpoint evaluation's noises per caption, 0 to 1024 (0: none, and no evaluation
        columns for methods without in-run evaluations).
    eval_seed: the seed of the checkpoint evaluation's noise, 0 to 2^32 - 1 (``eval.seed``'s range).
    eval_sampler: ``ode`` (deterministic Euler) or ``sde`` (the rollouts' SDE, step noise seeded).
    target_fraction: the held-out target (``target_cost`` ...), as a fraction of the reference's mean
        held-out gain; in (0, 1].
    reference: the method label both targets and ``speedup_to_target`` refer to, a method of the manifest;
        None: ``full`` (:data:`DEFAULT_REFERENCE`), whose targets are left empty in a manifest without it.
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
    reference: str | None = None
    eval_source: str = "auto"

    def check(self) -> None:
        """A ConfigError naming the option of the first field out of range (the runs are not read yet)."""
        if not 1 <= self.average <= MAX_ITERATIONS:
            raise ConfigError("--average", self.average, f"an integer from 1 to {MAX_ITERATIONS:,} (iterations "
                              "averaged at each end of a run; train.iterations is at most that)")
        if not 0 < self.fraction <= 1:
            raise ConfigError("--fraction", self.fraction, "a number in (0, 1]")
        if not 0 <= self.eval_noises <= 1024:
            raise ConfigError("--eval-noises", self.eval_noises, "an integer from 0 to 1024")
        if not 0 <= self.eval_seed <= MAX_EVAL_SEED:
            raise ConfigError("--eval-seed", self.eval_seed, f"an integer from 0 to {MAX_EVAL_SEED} (eval.seed's range)")
        if self.eval_sampler not in SAMPLERS:
            raise ConfigError("--eval-sampler", self.eval_sampler, f"one of {', '.join(SAMPLERS)}")
        if not 0 < self.target_fraction <= 1:
            raise ConfigError("--target-fraction", self.target_fraction, "a number in (0, 1]")
        if self.reference is not None and not self.reference:
            raise ConfigError("--reference", self.reference, "a method label of the manifest, e.g. full")
        if self.reference is not None and len(self.reference) > MAX_LABEL:
            raise ConfigError("--reference", self.reference, "a method label of the manifest")
        if self.eval_source not in EVAL_SOURCES:
            raise ConfigError("--eval-source", self.eval_source, f"one of {', '.join(EVAL_SOURCES)}")
        if self.eval_source == "checkpoint" and not self.eval_noises:
            raise UserError("--eval-source checkpoint: the checkpoint evaluation needs --eval-noises >= 1")


def check_manifest(manifest: str | Path) -> Manifest:
    """The manifest as read (:func:`agg_bench.results.loading.load_manifest`), its form checked before any run
    folder is read: the report's manifest (``agg-bench report
    --manifest``, :func:`agg_bench.results.loading.load_manifest`: its keys and each entry's, each of its
    kind, each label 1 to :data:`MAX_LABEL` printable characters: a row of learning.md and a label in every plot;
    the workflow writes one manifest for both). A UserError naming the manifest and the entry otherwise."""
    return load_manifest(manifest)


def check_lengths(runs: list[Run], average: int) -> None:
    """Every run has the ``2 * average`` ok iterations the learning table averages at its two ends; a
    UserError naming the first run (method, seed and folder) that has fewer."""
    for run in runs:
        if len(run.records) < 2 * average:
            raise UserError(f"run {run.method}/{run.seed} ({shown(run.dir)}): "
                            f"{counted(len(run.records), 'iteration')} with status ok; the learning table needs at "
                            f"least {2 * average} (--average {average} at each end)")


def check_checkpoints(runs: list[Run], eval_source: str) -> None:
    """Every run whose held-out columns come from the checkpoint evaluation has its final ``checkpoint.pt``:
    with ``eval_source`` ``checkpoint`` every run, with ``auto`` the runs of each method that some of its runs
    lack in-run evaluations for, unless none of them has one (its columns then stay empty). A run without it
    was skipped, so the method's held-out gain averaged fewer seeds than its ``seeds`` column says. A
    UserError names the first such run."""
    methods: dict[str, list[Run]] = {}
    for run in runs:
        methods.setdefault(run.method, []).append(run)
    for method, mine in methods.items():
        if eval_source == "auto" and all(run.evaluations is not None for run in mine):
            continue
        missing = [run for run in mine if not (run.dir / "checkpoint.pt").is_file()]
        if missing and (eval_source == "checkpoint" or len(missing) < len(mine)):
            run = missing[0]
            raise UserError(f"run {run.method}/{run.seed} ({shown(run.dir)}): no checkpoint.pt, whose evaluation gives "
                            f"the held-out columns of method {quote(method)} (--eval-source {eval_source}); expected every run "
                            "of the method with its final checkpoint (train.checkpoint_every)")


def learning_tables_into(folder: Path, runs: list[Run], options: LearningOptions, reference: str,
                         scores: pd.DataFrame | None = None) -> None:
    """``learning.csv``, ``learning.md`` and ``curves.csv`` of ``runs`` into ``folder``, with ``scores`` (this
    command's held-out evaluation) as ``evaluation.csv``; without them an earlier command's ``evaluation.csv``
    goes, as the new ``learning.csv`` was not made from it. ``agg-bench learning`` and a campaign's reference
    (:mod:`agg_bench.tools.archive`) write their tables through this, so that the two agree byte for byte."""
    table = learning_table(runs, options.average, options.fraction, reference, scores, options.target_fraction,
                           options.eval_source)
    write_table(table, folder, options.average, options.fraction, options.target_fraction, reference)
    write_curves(runs, folder)
    if scores is not None:
        write_text(folder / "evaluation.csv", csv_text(scores))
    else:
        (folder / "evaluation.csv").unlink(missing_ok=True)


def learning_plots_into(folder: Path, runs: list[Run]) -> None:
    """The plots drawn from the runs' own records into ``folder``: the reward against iteration and time, the
    held-out reward against cost and CPU time, and the Pareto plot (the sample grid needs an evaluation)."""
    plot_rewards(runs, folder / "reward_iteration.png", "iteration")
    plot_rewards(runs, folder / "reward_time.png", "time")
    plot_held_out(runs, folder)


def learning_report(manifest: str | Path, tables: Path | None, plots: Path | None,
                    options: LearningOptions | None = None) -> list[Run]:
    """The tables (``learning.csv``, ``learning.md``, ``curves.csv``, and ``evaluation.csv`` with a
    checkpoint evaluation) into ``tables`` and the plots (``reward_iteration.png``, ``reward_time.png``,
    ``samples.png``, ``eval_reward_cost.png``, ``eval_reward_cpu.png``, ``eval_pareto.png``) into ``plots``
    of the manifest's runs (``options``: :class:`LearningOptions`, its defaults without); returns the runs.

    Everything it reads is checked before a model is sampled and before anything is written: the options,
    the manifest's keys and method labels (:func:`check_manifest`), every run folder
    (:func:`agg_bench.results.learning_tables.load_runs`: records, evaluations, no run twice; each in-run
    evaluation placed on its run's records: :func:`~agg_bench.results.learning_tables.held_out_curves`), every run
    measured alike (:func:`one_measure`), with tables
    each run's length (:func:`check_lengths`), the reference's name, the checkpoints the held-out columns are
    evaluated from (:func:`check_checkpoints`), and with an evaluation one model for
    every run (:func:`one_model`), the captions against the reward and the model folder
    (:class:`CheckpointEvaluation`); each checkpoint is checked as it is evaluated, still before anything
    is written, its error naming the run. Torch and the model code are imported by the evaluation alone, after
    every check but its own (the captions against the reward, the config's paths and the model folder, which
    read the model code): a refusal of an option, the manifest or a run folder imports none of it, and tables
    without an evaluation never do."""
    options = options or LearningOptions()
    options.check()
    read = check_manifest(manifest)
    runs = load_runs(manifest)  # every run folder read and checked (records, evaluations, duplicates)
    one_measure(runs)
    if tables:
        check_lengths(runs, options.average)
    methods = list(dict.fromkeys(run.method for run in runs))
    if options.reference is not None and options.reference not in methods:
        raise ConfigError("--reference", options.reference, "a method label of the manifest "
                          f"({', '.join(quote(m) for m in methods[:12])}{', ...' if len(methods) > 12 else ''})")
    reference = options.reference or DEFAULT_REFERENCE
    held_out_curves(runs)  # every run's in-run evaluations placed on its records before a model is sampled
    if tables and options.eval_noises:
        check_checkpoints(runs, options.eval_source)
    evaluation = None
    if options.eval_noises or plots:  # the sample grid shows the evaluation's first images
        # every input of the evaluation checked before the model is sampled and before anything is written
        evaluation = CheckpointEvaluation(runs, max(options.eval_noises, 1), options.eval_seed, options.eval_sampler,
                                          one_model(runs), grid=plots is not None)
    with claimed_folders([(tables, LEARNING_CONTENTS), (plots, LEARNING_CONTENTS)], ("--tables", "--plots"),
                         replaced_whole=True):
        scores = images = None
        if evaluation is not None:
            scores, images = evaluate(runs, evaluation)
        # each folder replaced whole once every file is written: a stopped command leaves the earlier set
        with replaced_folders(tables, plots) as staged:
            if tables:
                assert scores is not None or not options.eval_noises  # eval_noises made the evaluation above
                learning_tables_into(staged(tables), runs, options, reference,
                                     scores if options.eval_noises else None)
            if plots:
                learning_plots_into(staged(plots), runs)
                assert evaluation is not None and images is not None  # plots made the evaluation above
                sample_grids(runs, images, evaluation.captions, staged(plots) / "samples.png", evaluation.keep)
            # before the swap, as the report checks it (:func:`agg_bench.results.report.build_report`): tables of an
            # earlier manifest never land beside a later one (an unpack into the reference meanwhile)
            read.check_unchanged()
    return runs
