"""DiffusionNFT: negative-aware finetuning on the forward process (Zheng et al., arXiv 2509.16117;
public code github.com/NVlabs/DiffusionNFT, ``scripts/train_nft_sd3.py`` and ``config/nft.py``).

DiffusionNFT has no per-step likelihood. The rollout is deterministic (ODE; the public code samples with
``config.sample.deterministic = True`` and ``solver = "dpm2"``, DPM-Solver++(2M) on the SD3 scheduler's sigmas,
``flow_grpo/diffusers_patch/solver.py``): ``method.solver`` takes ``dpm2`` (the preset) or the engine's Euler step
(the default), on the run's ``sampling.steps`` grid; both make one forward per step. Only each sample's final
latent x0 and its reward are kept. The code evaluates with ``solver="flow"`` and no noise, the Euler ODE.

Rewards become an optimality probability per sample (the paper's reward normalisation, in its method section):
``r = 1/2 + 1/2 clip(A / Z, -1, 1)`` with ``A`` the group-standardised reward (GRPO's, clipped to
+-``grpo.adv_clip_max``) and ``Z = grpo.adv_clip_max`` (the code divides by ``train.adv_clip_max``, 5,
after clipping to it, then clamps to [0, 1]). ``method.adv_mode`` transforms ``A`` first as the code's
``train.adv_mode`` does.

The loss (the paper's NFT objective, in its method section, and the code's ``policy_loss``): x0 is noised at K times
``t`` with fresh noise ``eps``, ``x_t = (1 - t) x0 + t eps``, whose flow-matching target is ``v = eps - x0``.
With the current policy's velocity ``v_theta(x_t, t)`` (with grad) and the old policy's ``v_old`` (no grad),
the implicit positive and negative policies are

    v+ = (1 - beta) v_old + beta v_theta,        v- = (1 + beta) v_old - beta v_theta,

and each (sample, time) term is ``Z / beta * (r l(v+) + (1 - r) l(v-))`` where
- ``weighting: velocity``: ``l(u) = mean ||u - v||^2`` (the paper's equation, mean over elements);
- ``weighting: adaptive`` (the code's default and only form): the x0-space error ``x0(u) = x_t - t u``,
  ``l(u) = mean (x0(u) - x0)^2 / w`` with ``w = max(mean |x0(u) - x0|, 1e-5)`` held constant (no grad).
The factor ``Z / beta`` is the code's (``ori_policy_loss / beta * adv_clip_max``): it keeps the gradient's
size independent of beta. ``L = 1/(B*K) sum_i sum_k term_ik`` (the code averages over the batch and
accumulates over its K times); with ``grpo.beta > 0`` the code's KL term ``grpo.beta * mean ||v_theta - v_ref||^2``
(the reference being the run's frozen reference policy) is added to every term.

The old policy (``scripts/train_nft_sd3.py``: the "old" adapter, ``return_decay``). In the code it samples the
rollout and stays fixed through the update; after each epoch it takes in the trained weights,
``old <- d old + (1 - d) theta`` with ``d = return_decay(global_step, decay_type)``: ``decay_type`` 0 is d = 0
(the old policy is the rollout's weights, the trained ones), 1 (its sd3 configs) d = min(0.001 n, 0.5) after n
optimizer steps, 2 (``sd3_ocr``) 0 for 75 steps, then min(0.0075 (n - 75), 0.999). Here ``old_decay_rate``,
``old_decay_max`` and ``old_decay_after`` are that schedule (:func:`baselines.final_latent.ema_decay`): rate 0 (the
default) keeps no copy, the old policy being the weights that sampled the rollout; a rate above 0 keeps an
:class:`~baselines.final_latent.EMAPolicy` that samples the rollout (its weights swapped into the policy, as the
code swaps adapters) and gives v_old.
Charged for what is computed: where the old policy's weights are the policy's own (rate 0 in the first inner
epoch, whose update has not stepped yet; or an EMA equal to the policy, at the first iteration), v_old is the
forward with grad's own value (``v_theta.detach()``, which a no-grad forward would only repeat: the two agree
exactly), and no no-grad forward is made. Otherwise v_old is a no-grad forward of the moving average. The first
inner epoch's v_old are kept for the later inner epochs of the same rollout, whose (t, eps) draws are the same
and whose old policy has not changed.
Passes per iteration: B*T rollout forwards; per inner epoch B*K forward_grad and B*K backward (B*K forward_nograd
more for the reference when ``grpo.beta > 0``); and B*K forward_nograd of the old policy once per rollout where
it is a moving average that differs from the policy.

The K times per sample (``time_distribution``):
- ``schedule`` (the code): K distinct steps of the rollout's own schedule per sample, drawn without
  replacement (``torch.randperm`` per sample, the first K), t = sigma_j, the model given timestep_j;
  the code's K is ``int(sample.num_steps * train.timestep_fraction)`` = int(10 * 0.99) = 9;
- ``uniform``: t ~ U(0, 1) per (sample, slot).
The steps (schedule) are drawn in :meth:`NFTEstimator.plan` from the iteration's generator, as is the seed of
a generator that draws the noise (and uniform times): deterministic given the run's seed.

The code's advantages take the batch-wide reward std (``sample.global_std = True``) plus 1e-4: here
``grpo.adv_std: global``, ``grpo.adv_eps: 1e-4`` (the preset). The EMA of the trained weights that only evaluations
and checkpoints use (``train.ema``, decay 0.9) is the run's ``train.eval_ema``
(:mod:`agg_bench.engine.moving_average`), not this method's. Not ported: LoRA. An ODE rollout from one noise is one
image, so ``sampling.same_noise_per_group`` must be false.

Replay: ``not_applicable``, there is no per-step GRPO gradient to compare.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Literal

import torch

from agg_bench.config.options import Options, batch_option, option
from agg_bench.engine.grpo import grpo_advantages, micro_batches
from agg_bench.errors import ConfigError
from agg_bench.methods.base import register_method
from baselines.final_latent import EMAPolicy, FinalLatentEstimator, ema_decay, noised_draws

ADV_MODES = ("all", "positive_only", "negative_only", "one_only", "binary")
WEIGHT_FLOOR = 1e-5  # the code's clip(min=0.00001) on the adaptive weight


@dataclass
class NFTConfig(Options):
    """Options of DiffusionNFT (defaults from github.com/NVlabs/DiffusionNFT ``config/nft.py``)."""

    beta: float = option(1.0, "the step of the implicit policies v+- = v_old +- beta (v_theta - v_old) "
                              "(`config.beta = 1.0`, 0.1 for OCR and multi-reward)", exclusive_minimum=0, maximum=1)
    times_per_sample: int | None = option(
        None, "K noised copies of each final latent; at most sampling.steps with the `schedule` distribution and "
        "4 x sampling.steps with `uniform` (each time is a forward and a backward per sample: "
        "`baselines.final_latent.TIMES_PER_STEP`); null: int(0.99 * sampling.steps) (at least 1), the code's "
        "`num_steps * timestep_fraction`", minimum=1, maximum=10**9)
    time_distribution: Literal["schedule", "uniform"] = option(
        "schedule", "where t comes from: `schedule` (the code; module docstring) or `uniform`")
    adv_mode: Literal["all", "positive_only", "negative_only", "one_only", "binary"] = option(
        "all", "the code's `train.adv_mode`: `all` keeps A, `positive_only` / `negative_only` clamp it to [0, Z] / "
        "[-Z, 0], `one_only` maps A > 0 to 1 and else 0, `binary` takes sign(A)")
    weighting: Literal["adaptive", "velocity"] = option(
        "adaptive", "`adaptive` (the code's x0-space adaptive weight) or `velocity` (the paper's equation)")
    micro_batch: int | None = batch_option("samples per forward-with-grad; null: the whole batch")
    old_decay_rate: float = option(
        0.0, "the old policy's moving-average schedule (module docstring): 0, the rollout's weights (the code's "
        "`decay_type = 0`); 0.001 for its sd3 configs' `decay_type = 1`, 0.0075 for `decay_type = 2`",
        minimum=0, maximum=1)
    old_decay_max: float = option(0.5, "the largest decay of the old policy's moving average (0.999 for "
                                       "`decay_type = 2`)", minimum=0, maximum=1)
    old_decay_after: int = option(0, "optimizer steps before the old policy's moving average starts to move (75 for "
                                     "`decay_type = 2`)", minimum=0, maximum=10**9)
    solver: Literal["euler", "dpm2"] = option(
        "euler", "the ODE rollout's sampler: `euler`, or `dpm2`, DPM-Solver++(2M) with one velocity per step as "
        "Euler, first order at the first step and into sigma 0 (the code's `sample.solver = \"dpm2\"`; "
        "`agg_bench.engine.solvers.ode_solver`)")

    def times(self, steps: int) -> int:
        """K for a ``steps``-step rollout."""
        return self.times_per_sample if self.times_per_sample is not None else max(1, int(steps * 0.99))


def optimality(advantages: torch.Tensor, clip: float, mode: str = "all") -> torch.Tensor:
    """r in [0, 1] from advantages already clipped to +-``clip`` (the code's normalisation)."""
    a = advantages
    if mode == "positive_only":
        a = a.clamp(0, clip)
    elif mode == "negative_only":
        a = a.clamp(-clip, 0)
    elif mode == "one_only":
        a = (a > 0).to(a.dtype)
    elif mode == "binary":
        a = torch.sign(a)
    return (a / clip / 2 + 0.5).clamp(0, 1)


def nft_terms(v: torch.Tensor, v_old: torch.Tensor, x_t: torch.Tensor, x0: torch.Tensor, eps: torch.Tensor,
              t: torch.Tensor, r: torch.Tensor, beta: float, scale: float, weighting: str) -> torch.Tensor:
    """The per-sample term ``scale / beta * (r l(v+) + (1 - r) l(v-))`` (rows,) (module docstring)."""
    dims = tuple(range(1, v.dim()))
    positive = (1 - beta) * v_old + beta * v
    negative = (1 + beta) * v_old - beta * v

    def error(u: torch.Tensor) -> torch.Tensor:
        if weighting == "velocity":
            return ((u - (eps - x0)) ** 2).mean(dim=dims)
        te = t.view(-1, *([1] * (v.dim() - 1)))
        diff = x_t - te * u - x0
        weight = diff.detach().abs().mean(dim=dims).clamp(min=WEIGHT_FLOOR)
        return (diff ** 2).mean(dim=dims) / weight

    return scale / beta * (r * error(positive) + (1 - r) * error(negative))


@register_method
class NFTEstimator(FinalLatentEstimator):
    """Flow-matching loss on each final latent at K noised times, contrasting implicit +- policies."""

    name = "nft"
    config_cls = NFTConfig
    config: NFTConfig
    paper, trains, shared_noise_breaks = "DiffusionNFT", "a flow-matching loss on final latents", "every r is 1/2"
    draws_step_order = True  # each sample's K steps in torch.randperm's order, its noises drawn in that order

    def __init__(self, config: NFTConfig | None = None):
        super().__init__(config)
        # (the rollout's batch, weakly: an id could be reused by the next one; its old velocities)
        self.old: tuple[weakref.ref, torch.Tensor] | None = None
        self.clip = 1.0
        self.ema: EMAPolicy | None = None  # the old policy, where it is a moving average

    def moving_average(self) -> str | None:
        return "old_decay_rate" if self.config.old_decay_rate > 0 else None

    def rollout(self, policy, cond, noise, sigmas, sampling, generator, iteration, group_size):
        """Sampled by the old policy: the policy itself, or its moving average (taken in first)."""
        c = self.config
        if c.old_decay_rate == 0:
            return super().rollout(policy, cond, noise, sigmas, sampling, generator, iteration, group_size)
        if self.ema is None:
            self.ema = EMAPolicy(policy)
        elif policy.version != self.ema.steps:
            self.ema.update(policy, ema_decay(policy.version, c.old_decay_rate, c.old_decay_max, c.old_decay_after))
        if self.ema.equals(policy):
            return super().rollout(policy, cond, noise, sigmas, sampling, generator, iteration, group_size)
        with self.ema.weights_in(policy) as sampler:
            return super().rollout(sampler, cond, noise, sigmas, sampling, generator, iteration, group_size)

    def ode_rule(self, sigmas, generator):
        from agg_bench.engine.solvers import ode_solver

        return ode_solver(self.config.solver, sigmas)

    def check_run(self, cfg) -> None:
        super().check_run(cfg)
        c = self.config
        self.clip = cfg.grpo.adv_clip_max
        k = self.times_per_sample(cfg.sampling.steps)
        if c.time_distribution == "schedule" and k > cfg.sampling.steps:
            raise ConfigError("method.times_per_sample", c.times_per_sample,
                              f"null or an integer in [1, {cfg.sampling.steps}] (sampling.steps; distinct steps "
                              "of the schedule with method.time_distribution=schedule)")

    def times_per_sample(self, steps: int) -> int:
        return self.config.times(steps)

    def advantages(self, rewards, trajectory, grpo):
        """r (B,) in [0, 1], the optimality probability of each sample."""
        self.clip = grpo.adv_clip_max
        a = grpo_advantages(rewards, grpo, torch.float64)
        return optimality(a, grpo.adv_clip_max, self.config.adv_mode).to(trajectory.latents.dtype)

    def trained_steps(self, train, trajectory, batch_size, generator):
        """(B, K): the schedule steps of each sample's K times (``schedule``) or the slots 0..K-1 (``uniform``);
        the seed of the noise generator is drawn after them."""
        steps = trajectory.sigmas.numel() - 1
        k = self.config.times(steps)
        if self.config.time_distribution == "schedule":
            planned = torch.stack([torch.randperm(steps, generator=generator)[:k] for _ in range(batch_size)])
        else:
            planned = torch.arange(k).expand(batch_size, k).clone()
        self.draw_noise_seed(generator)
        return planned

    def draws(self, policy, batch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """eps (B, K, ...), t (B, K) and the model's timesteps (B, K) of every (sample, slot)."""
        return noised_draws(policy, batch, self.noise_seed, self.config.time_distribution)

    def accumulate(self, policy, batch, stats, reference=None):
        c = self.config
        x0 = batch.latents[:, -1]
        b, k = batch.train_steps.shape
        eps, t, timesteps = self.draws(policy, batch)
        fresh = self.old is None or self.old[0]() is not batch
        if fresh:
            if policy.version != batch.policy_version:
                raise RuntimeError("method 'nft' needs the old policy's velocities: the policy stepped "
                                   "before the first inner epoch on this rollout")
            self.old = (weakref.ref(batch), torch.empty((b, k, *x0.shape[1:]), dtype=x0.dtype, device=x0.device))
        assert self.old is not None  # this rollout's, set above when fresh
        old = self.old[1]
        # the old policy's velocity is the policy's own while their weights are the same (module docstring)
        moving = self.ema is not None and not self.ema.equals(policy)
        r = batch.advantages.to(x0.dtype)
        for slot in range(k):
            for rows in micro_batches(b, c.micro_batch):
                te = t[rows, slot].view(-1, *([1] * (x0.dim() - 1)))
                x_t = (1 - te) * x0[rows] + te * eps[rows, slot]
                cond = batch.cond[rows]
                v = policy.velocity(x_t, timesteps[rows, slot], cond).to(x0.dtype)
                if fresh and moving:
                    with torch.no_grad():
                        old[rows, slot] = self.average().policy.velocity(x_t, timesteps[rows, slot], cond).to(x0.dtype)
                elif fresh:
                    old[rows, slot] = v.detach()
                terms = nft_terms(v, old[rows, slot], x_t, x0[rows], eps[rows, slot], t[rows, slot], r[rows],
                                  c.beta, self.clip, c.weighting)
                terms = self.with_velocity_kl(terms, v, reference, x_t, timesteps[rows, slot], cond, batch.beta)
                self.backward(terms, batch, stats)
