"""Guessed rollouts (MTA-AB2): some generations of a group skip the transformer at a step and take a
velocity extrapolated from their own past velocities, blended early on with the group's real ones.

Source: the public code of the AGG authors, github.com/SchumiDing/eff_grpo (HEAD ae14d64),
``fastvideo/train_grpo_qwenimage_eff_mta_ab2.py`` (rollout ``run_sample_step``, blend weight
``_velocity_mix_alpha``, loss ``train_one_step``), its algorithm note
``fastvideo/train_grpo_qwenimage_eff_mta_ab2_algorithm.md`` and the ablation script
``fastvideo/train_grpo_qwenimage_eff_mta_ab2_ablate.py`` (presets ``canonical`` and ``ef04_strong``);
the run script ``run_eff_mta_ab2.sh`` at commit b695a45 (12 generations: 8 forwarded + 4 guessed, 20 steps).
There is no paper section; the formulas below are written from that code.

At step j of a rollout with T steps, in each group of G generations (consecutive rows):
- which rows are guessed: at most ``guessed`` rows, only at steps ``guess_from <= j < guess_until``; a row
  guessed at step j - 1 is not guessed at j (so its last velocity is always a real one), and among the
  others the rows guessed least often so far come first (ties: the lower row), the code's round robin;
- the other rows are forwarded, and only they: the forward batch shrinks by the guessed rows;
- ``v_group`` is the mean of the real velocities of the group at step j (guessed rows excluded);
- ``v_so = c1 v_{j-1} + c2 v_{j-2}`` from the row's own stored velocities (a guess where it was guessed),
  ``(c1, c2) = ab2``; at j = 1 only ``v_so = v_0`` exists (first order, as the code does at step 1);
- for ``j < blend_until * T``: ``v_hat = a v_so + (1 - a) v_group`` with ``a = (1 + cos(v_so, v_group)) / 2``
  per row over the whole latent (denominator clamped to 1e-8, cosine clamped to [-1, 1]) for
  ``blend: cosine``, or the fixed number ``a = blend``; later ``v_hat = v_so``;
- at j = 0 no velocity is stored yet: the code's history starts as zeros, so ``v_so = 0``, the cosine with a
  zero vector is 0 (its denominator clamped to 1e-8), ``a = 1/2`` and ``v_hat = v_group / 2`` (``blend: a``:
  ``(1 - a) v_group``; from ``blend_until * T`` on, 0); that guess is the row's stored velocity, its v_{j-1} and
  v_{j-2} at later AB2 steps, as every guess is;
- the guessed row then takes the ordinary SDE step with ``v_hat``, and its log-probability is that of
  the guessed mean, which the ratio of its training term divides by.
``guess_from: 0`` is the code's (the preset's): step 0 guesses the first ``guessed`` rows of each group (no row
has a guess yet), step 1 the next ones (those of step 0 are skipped). The rows chosen among at steps 0 and 1
are alike in law (one prompt, every velocity so far real), so the code's order among equal counts (its CUDA
``argsort`` is not stable) changes nothing there; at later ties the lower row goes first here. The option's default stays 2, the first step
with the two velocities AB2 needs, as the sweeps' and the pinned records' runs have it.

Training is GRPO's on ``train.plan``'s steps, each term recomputed with the real policy (a guessed term
too, as the code does), with the loss of a guessed (row, step) weighted by ``guessed_weight`` (the code's
``1 - 0.9 mock_flag``); weight 0 skips those terms' forward and backward. The advantages are GRPO's over
all G rewards, guessed generations included. The code never trains the last step (``train_one_step`` slices it
off, whatever its parsed but unread ``--ignore_last`` says): ``train.ignore_last``, which the preset sets.

``zero_loss_on_guess`` is the ablation script's ``--zero_loss_on_guess``
(``fastvideo/train_grpo_qwenimage_eff_mta_ab2_ablate.py``: ``train_one_step`` and ``_batched_infer_shuffle_sel``):
the trained steps are drawn among the forwarded ones only, each row its own number of them, and no guessed term
is trained (that branch of the code has no ``loss_weight``, so ``guessed_weight`` weighs nothing). With F_i the
forwarded steps of row i among the steps a plan may draw (``train.ignore_last``, :func:`plan_steps`):
- ``k_i = min(int(|F_i| * fraction), |F_i|)`` with the product in float32, as the code computes it
  (``fraction`` = ``train.timestep_fraction``); k_i may be 0, and that row trains nothing;
- one float32 uniform per (row, drawable step) from the run's generator (the code: ``torch.rand(B, T)``);
  row i trains the k_i steps of F_i with the smallest numbers (the code's ``argsort`` with the guessed
  steps' numbers set to inf);
- ``L = 1/B sum_i 1/k_i sum_{j trained by i} l_ij`` over the B rows of an optimizer step (rows with k_i = 0
  count in B: the code's ``loss / (gradient_accumulation_steps * k_i)``).
``train_steps`` is then (B, max_i k_i), each row's steps in denoising order followed by ``NO_STEP``.
Differences: the numbers the code's draw takes come from the training device's generator, here from the run's
(the same law); a row without a forwarded step among the drawable ones (only where step 0, guessed, is the only
drawable step) draws among all of them, as the code falls back to; the code's rows are trained one after another with their steps in the draw's order,
here step by step: the same sum.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from agg_bench.config.options import Options, batch_option, option
from agg_bench.engine.grpo import exact_backward, micro_batches
from agg_bench.engine.trained_steps import KINDS, NO_STEP, plan_steps
from agg_bench.errors import ConfigError
from agg_bench.machine import distributed
from agg_bench.methods.base import Estimator, ReplayCase, register_method


@dataclass
class GuessConfig(Options):
    """Options of guessed rollouts (module docstring); defaults are the code's canonical preset but `guess_from`
    (2 here, 0 in the code). The bounds
    against the group and the schedule are checked when a run is set up (``check_run``)."""

    guessed: int | None = option(
        None, "generations of each group guessed at each guessed step, less than `grpo.group_size` (one real "
        "generation at least, for the group mean); null: `grpo.group_size // 3`, the code's 4 of 12",
        minimum=0, maximum=255)
    guess_from: int = option(
        2, "the first step that may be guessed: 0, the code's, guesses step 0 from a zero history (v_group / 2 with "
        "the cosine blend) and step 1 to first order, module docstring; 2, the first with two velocities for AB2",
        minimum=0, maximum=1000)
    guess_until: int | None = option(
        None, "guessed steps are guess_from <= j < guess_until, with guess_from <= guess_until <= sampling.steps; "
        "null: sampling.steps - 1, every step but the last as in the code", minimum=0, maximum=1000)
    blend_until: float = option(
        0.5, "steps j < blend_until * T blend the extrapolation with the group's mean velocity (the code's "
        "`early_frac`; 0.4 in `ef04_strong`)", minimum=0, maximum=1)
    blend: Literal["cosine"] | float = option(
        "cosine", "the extrapolation's weight in the blend: `cosine`, (1 + cos(v_so, v_group)) / 2 per row (the "
        "code's `_velocity_mix_alpha`), or a fixed number", minimum=0, maximum=1,
        expected="'cosine' or a number in [0, 1]")
    ab2: list[float] = option(
        [1.5, -0.5], "(c1, c2) in v_so = c1 v_{j-1} + c2 v_{j-2}: equal-step Adams-Bashforth 2; `ef04_strong`: "
        "[2, -1], linear extrapolation", min_items=2, max_items=2, items={"minimum": -1000, "maximum": 1000},
        expected="two numbers [c1, c2] (v_so = c1 v_{j-1} + c2 v_{j-2})")
    guessed_weight: float = option(
        0.1, "the loss weight of a guessed (row, step) term (the code's `1 - 0.9 mock_flag`); 0 skips those terms; "
        "none is trained with `zero_loss_on_guess`",
        minimum=0, maximum=1000)
    zero_loss_on_guess: bool = option(
        False, "train forwarded terms only, in place of `train.plan`: each row draws int(`train.timestep_fraction` x "
        "its own number of forwarded steps) of its forwarded steps, and its loss is the mean of those terms (the "
        "ablation's `--zero_loss_on_guess`, module docstring); no guessed term is trained, so `guessed_weight` "
        "weighs none. Needs a guessed step among those the plan draws from, and `train.plan: steps`")
    micro_batch: int | None = batch_option("samples per forward-with-grad; null: the whole batch, as for `full`")

    def guessed_per_group(self, group_size: int) -> int:
        return group_size // 3 if self.guessed is None else self.guessed

    def guessed_steps(self, steps: int) -> range:
        return range(self.guess_from, steps - 1 if self.guess_until is None else self.guess_until)


def forwarded_counts_trained(counts: torch.Tensor, fraction: float) -> torch.Tensor:
    """k_i of ``zero_loss_on_guess``: int(count x fraction) for each of ``counts`` (int64), the product in float32 as
    the code computes it, at most the count."""
    return torch.minimum((counts.to(torch.float32) * fraction).to(torch.int64), counts)


def draw_forwarded_steps(forwarded: torch.Tensor, drawable: torch.Tensor, fraction: float,
                         generator: torch.Generator) -> torch.Tensor:
    """``train_steps`` (B, max k_i) of ``zero_loss_on_guess`` (module docstring): row i's k_i forwarded steps among
    the ``drawable`` (T,) ones, in denoising order, then ``NO_STEP``; ``forwarded`` (B, T) the rollout's."""
    steps = torch.nonzero(drawable.cpu(), as_tuple=False).flatten()
    if steps.numel() == 0:
        raise ConfigError("train.plan", "steps", "at least one step with a log-probability")
    candidates = forwarded.cpu()[:, steps]
    candidates |= candidates.sum(1, keepdim=True) == 0  # no forwarded step: all of them, the code's fallback
    counts = forwarded_counts_trained(candidates.sum(1), fraction)
    noise = torch.rand(candidates.shape, generator=generator, dtype=torch.float32)
    order = torch.argsort(torch.where(candidates, noise, torch.inf), dim=1, stable=True)
    plan = torch.full((candidates.shape[0], max(1, int(counts.max()))), NO_STEP, dtype=torch.int64)
    for row, k in enumerate(counts.tolist()):
        plan[row, :k] = steps[order[row, :k]].sort().values
    return plan


class GuessedVelocity:
    """The engine rollout's ``velocity`` rule of one rollout (module docstring): forwards the real rows
    of each step, guesses the others, and records which were forwarded (``forwarded`` (B, T))."""

    def __init__(self, config: GuessConfig, policy, group_size: int, rows: int, steps: int):
        self.config = config
        self.policy = policy
        self.group_size = group_size
        self.guessed = config.guessed_per_group(group_size)
        self.window = config.guessed_steps(steps)
        self.blend_steps = config.blend_until * steps
        self.history: list[torch.Tensor] = []  # v_{j-1}, v_{j-2} of every row, newest first
        self.guessed_last = torch.zeros(rows, dtype=torch.bool)
        self.guess_counts = torch.zeros(rows, dtype=torch.int64)
        self.forwarded = torch.ones(rows, steps, dtype=torch.bool)

    def pick(self, j: int) -> torch.Tensor:
        """(B,) True on the rows guessed at step ``j``."""
        rows = self.guessed_last.numel()
        chosen = torch.zeros(rows, dtype=torch.bool)
        if self.guessed == 0 or j not in self.window:
            return chosen
        for start in range(0, rows, self.group_size):
            group = torch.arange(start, start + self.group_size)
            eligible = group[~self.guessed_last[group]]
            order = torch.argsort(self.guess_counts[eligible], stable=True)
            chosen[eligible[order[: self.guessed]]] = True
        return chosen

    def guess(self, j: int, v_group: torch.Tensor) -> torch.Tensor:
        """v_hat of every row at step ``j`` from its stored velocities and the group's mean ``v_group``."""
        c1, c2 = self.config.ab2
        if not self.history:  # step 0: the code's history starts as zeros
            v_so = torch.zeros_like(v_group)
        else:
            v_so = c1 * self.history[0] + c2 * self.history[1] if j >= 2 else self.history[0]
        if j >= self.blend_steps:
            return v_so
        if self.config.blend == "cosine":
            a, b = v_so.flatten(1), v_group.flatten(1)
            cos = ((a * b).sum(1) / (a.norm(dim=1) * b.norm(dim=1)).clamp_min(1e-8)).clamp(-1, 1)
            alpha = ((1 + cos) / 2).view(-1, *[1] * (v_so.dim() - 1))
        else:
            alpha = self.config.blend
        return alpha * v_so + (1 - alpha) * v_group

    def __call__(self, j: int, x: torch.Tensor, timesteps: torch.Tensor, cond) -> torch.Tensor:
        compute = torch.float64 if self.policy.dtype == torch.float64 else torch.float32
        guessed = self.pick(j)
        if not guessed.any():
            v = self.policy.velocity(x, timesteps, cond).to(compute)
        else:
            real = torch.nonzero(~guessed).flatten()
            on = real.to(x.device)
            v = torch.zeros(x.shape, dtype=compute, device=x.device)
            v[on] = self.policy.velocity(x[on], timesteps[on], cond[on]).to(compute)
            mask = (~guessed).to(device=x.device, dtype=compute).view(-1, self.group_size, *[1] * (x.dim() - 1))
            grouped = v.view(-1, self.group_size, *x.shape[1:])
            mean = (grouped * mask).sum(1) / mask.sum(1)
            v_group = mean.repeat_interleave(self.group_size, dim=0)
            g = guessed.to(x.device)
            v[g] = self.guess(j, v_group)[g]
        self.forwarded[:, j] = ~guessed
        self.guess_counts += guessed.to(torch.int64)
        self.guessed_last = guessed
        self.history = [v, *self.history[:1]]
        return v


@register_method
class GuessEstimator(Estimator):
    """Guessed velocities in the rollout; exact per-step training with guessed terms down-weighted."""

    name = "guess"
    config_cls = GuessConfig
    config: GuessConfig

    def __init__(self, config: GuessConfig | None = None):
        super().__init__(config)
        self.last_guessed: int | None = None

    def check_run(self, cfg) -> None:
        """The options against the group and the schedule, and a single process."""
        c, group, steps = self.config, cfg.grpo.group_size, cfg.sampling.steps
        guessed = c.guessed_per_group(group)
        if guessed >= group:
            raise ConfigError("method.guessed", guessed,
                              f"an integer in [0, {group - 1}]: fewer guessed generations than grpo.group_size "
                              f"= {group} (the group mean needs at least one real generation)")
        if c.guess_from > steps:
            raise ConfigError("method.guess_from", c.guess_from, f"an integer in [0, {steps}] (sampling.steps)")
        if c.guess_until is not None and not c.guess_from <= c.guess_until <= steps:
            raise ConfigError("method.guess_until", c.guess_until,
                              f"null or an integer in [{c.guess_from}, {steps}] (method.guess_from .. sampling.steps)")
        if distributed.current().distributed:
            raise ConfigError("method.name", self.name, "a single-process run (a step's group mean needs every "
                              "real velocity of the group, and each process samples only its own rows)")
        if c.zero_loss_on_guess:
            self.check_zero_loss_on_guess(cfg)

    def check_zero_loss_on_guess(self, cfg) -> None:
        """``zero_loss_on_guess`` against the plan: a draw per step, a guessed step among the drawable ones,
        and a fraction that gives a row with every drawable step forwarded at least one."""
        c, train, steps = self.config, cfg.train, cfg.sampling.steps
        if train.plan != "steps":
            raise ConfigError("train.plan", train.plan, f"`steps` with method.zero_loss_on_guess (its draw is per "
                              f"step); one of {list(KINDS)} otherwise")
        drawable = steps - int(train.ignore_last)
        if c.guessed_per_group(cfg.grpo.group_size) == 0 or not any(j < drawable for j in c.guessed_steps(steps)):
            raise ConfigError("method.zero_loss_on_guess", True,
                              "false where no trained step is guessed (method.guessed 0, or no step of "
                              "method.guess_from .. method.guess_until among the steps the plan draws)")
        if int(forwarded_counts_trained(torch.tensor([drawable]), train.timestep_fraction)) == 0:
            raise ConfigError("train.timestep_fraction", train.timestep_fraction,
                              f"with method.zero_loss_on_guess, a number in (0, 1] whose int(fraction x "
                              f"{drawable}) >= 1 (each row trains int(fraction x its forwarded steps among the "
                              f"{drawable} the plan draws from))")

    def rollout(self, policy, cond, noise, sigmas, sampling, generator, iteration, group_size):
        from agg_bench.engine.rollout import rollout  # imports the models (diffusers); the options do not

        rule = GuessedVelocity(self.config, policy, group_size, noise.shape[0], sigmas.numel() - 1)
        traj = rollout(policy, cond, noise, sigmas, sampling.sde, sampling.eta, generator, velocity=rule)
        traj.forwarded = rule.forwarded
        self.last_guessed = int((~rule.forwarded).sum())
        return traj

    def trained_steps(self, train, trajectory, batch_size, generator):
        """``train.plan``'s steps; with ``zero_loss_on_guess`` each row's own draw among its forwarded steps."""
        if not self.config.zero_loss_on_guess:
            return super().trained_steps(train, trajectory, batch_size, generator)
        return draw_forwarded_steps(trajectory.forwarded, plan_steps(trajectory.sde_mask, train.ignore_last),
                                    train.timestep_fraction, generator)

    def term_weights(self, batch, rows: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
        """(len(rows),) the loss weight of each (row, step) term against ``batch.loss_scale`` = 1/(B N): 1, or
        ``guessed_weight`` where guessed; with ``zero_loss_on_guess`` N / k_i (the row's loss the mean of its own
        k_i terms); 0 where the row has no step (``NO_STEP``)."""
        rows, steps = rows.cpu(), steps.cpu()
        ones = torch.ones(rows.numel(), dtype=torch.float64)
        if self.config.zero_loss_on_guess:
            counts = (batch.train_steps.cpu()[rows] != NO_STEP).sum(1)
            weights = batch.steps_per_sample / counts.clamp_min(1).to(torch.float64)
        elif batch.forwarded is None:
            weights = ones
        else:
            weights = torch.where(batch.forwarded.cpu()[rows, steps], ones, self.config.guessed_weight)
        return torch.where(steps != NO_STEP, weights, 0.0)

    def accumulate(self, policy, batch, stats, reference=None):
        """Exact per-step backward (``full``'s), each term's loss times its weight; weight-0 terms skipped."""
        for n in range(batch.steps_per_sample):
            for rows in micro_batches(batch.batch_size, self.config.micro_batch):
                steps = batch.train_steps[rows, n]
                weights = self.term_weights(batch, rows, steps)
                keep = weights != 0
                if not keep.any():
                    continue
                rows, steps, weights = rows[keep], steps[keep.to(steps.device)], weights[keep]
                exact_backward(policy, batch, rows, steps, stats, reference, weights)

    def replay_case(self, cfg, stochastic, batch_size, generator):
        return ReplayCase("not_applicable", None,
                          "every velocity of a frozen rollout was forwarded, so guess's gradient on it is full's; "
                          "what guess changes (guessed velocities in the rollout, down-weighted guessed terms) "
                          "exists only in its own rollout")

    def iteration_metrics(self) -> dict:
        return {"guessed_velocities": self.last_guessed}

