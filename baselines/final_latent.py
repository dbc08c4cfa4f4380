"""What the likelihood-free methods (``nft``, ``awm``, ``dgpo``) share: each trains on a rollout's final latent
x0 noised at K times, ``x_t = (1 - t) x0 + t eps``, with fresh noise from a generator seeded in the method's
``plan`` (so the draws are deterministic given the run's seed and the same in every inner epoch).

:class:`FinalLatentEstimator` is their common base: an ODE rollout (no step is sampled with the SDE), one
noise per image (a group sharing its noise would give one image and one reward), no frozen-rollout replay
(there is no per-step GRPO gradient to compare), and the noise seed drawn in ``plan``.

:func:`noised_draws` draws, in this order from one generator seeded by ``seed``: the noise ``eps`` (B, K, ...)
(one per group and slot, repeated over the group's rows, when ``group_size`` is given), then, for
``times="uniform"``, t ~ U(0, 1) per (sample, slot). ``times="schedule"`` takes t at the schedule steps the
plan put in ``batch.train_steps`` (the model given those steps' timesteps); a tensor of times (B, K) is used
as it is. The model's timestep of a time that is not a schedule step is ``t * policy.timestep_scale``, as
:meth:`agg_bench.engine.models.Policy.timestep_values` scales a sigma.

:class:`EMAPolicy` is the moving average of the policy that the public recipes keep beside it (DiffusionNFT's
"old" adapter, AWM's EMA for its second KL term, DGPO's ``ema_ref``): a frozen copy of the weights updated as
``w_ema <- w_ema + (1 - d)(w - w_ema)`` with the decay d of :func:`ema_decay` after n optimizer steps
(:class:`agg_bench.engine.moving_average.MovingAverage`, whose tensors are the copy's weights). Its
forwards go through the policy's counter, so they are charged; while its weights are exactly the policy's (made
from it, or updated with d = 0, and no optimizer step since) a forward of it would repeat one the method makes
anyway, and the methods use the policy's own value instead (:meth:`EMAPolicy.equals`).
"""
from __future__ import annotations

from typing import Any, ClassVar

import torch

from agg_bench.engine.moving_average import MovingAverage
from agg_bench.errors import ConfigError
from agg_bench.methods.base import Estimator, ReplayCase

# K, the noised times per final latent, is at most this many times sampling.steps. Every (sample, time) costs
# a forward with grad and a backward, and the noise of all K times is drawn at once (B, K, latent): at this
# bound an update does at most 4x the train-phase passes of full GRPO on the same schedule (T per sample), and
# the draws hold at most 4x the rollout's own trajectory (B, T + 1, latent). The public recipes use K <= T
# (DiffusionNFT 9 of 10 steps, AWM 6 of 14, DGPO 4); times drawn off the schedule (``uniform``, ``logit_normal``)
# may usefully exceed T as a finer sample of t, but not by orders of magnitude.
TIMES_PER_STEP = 4


def ema_decay(steps: int, rate: float, maximum: float, after: int = 0) -> float:
    """The decay of the moving average's update after ``steps`` optimizer steps: 0 before ``after`` steps, then
    ``rate * (steps - after)``, at most ``maximum`` (DiffusionNFT's ``return_decay``: rate 0.001, maximum 0.5,
    after 0 for its sd3 configs' ``decay_type = 1``; AWM's and DGPO's ``min(0.3, 0.001 * global_step)``)."""
    if steps < after:
        return 0.0
    return min(rate * (steps - after), maximum)


class EMAPolicy(MovingAverage):
    """A moving average of the policy's trainable weights (module docstring), as a frozen policy that shares
    the policy's counter: its weights are those of a frozen copy of the transformer (``policy``), which the
    methods call. ``steps``: the optimizer steps it has taken in; ``version``: the policy version its weights
    are exactly (None after an update with a decay above 0)."""

    def __init__(self, policy):
        self.policy = policy.weights_copy()
        own = dict(self.policy.transformer.named_parameters())
        super().__init__(policy, {name: own[name] for name, _ in policy.named_parameters()})


class FinalLatentEstimator(Estimator):
    """A method that trains a loss on each final latent at K noised times (module docstring); a subclass
    names its paper and what it trains instead of a per-step GRPO gradient (``paper``, ``trains``) and what
    a group sharing its noise would break (``shared_noise_breaks``), and calls :meth:`draw_noise_seed` at
    the end of its plan."""

    config: Any  # each method's own options class, which declares times_per_sample
    paper: ClassVar[str]  # the method's name in its paper, e.g. "DGPO"
    ema: EMAPolicy | None = None  # the run's moving average of the policy, where moving_average() names an option
    trains: ClassVar[str]  # e.g. "a flow-matching loss on final latents"
    shared_noise_breaks: ClassVar[str] = "every advantage is 0"

    def __init__(self, config=None):
        super().__init__(config)
        self.noise_seed = 0

    def check_run(self, cfg) -> None:
        if cfg.train.ignore_last:
            raise ConfigError("train.ignore_last", True,
                              f"false for method '{self.name}' (it trains the final latent at times of its own, "
                              "not denoising steps a plan draws)")
        if cfg.train.timestep_fraction != 1.0:
            raise ConfigError("train.timestep_fraction", cfg.train.timestep_fraction,
                              f"1.0 for method '{self.name}' (it trains the final latent at times of its own, "
                              "not denoising steps a plan draws: a fraction would change nothing)")
        if cfg.train.minibatches > 1:
            raise ConfigError("train.minibatches", cfg.train.minibatches,
                              f"1 for method '{self.name}' (its noise and times are drawn for the whole batch at "
                              "once, from one seed per rollout: a mini-batch would draw other ones)")
        if cfg.sampling.same_noise_per_group:
            raise ConfigError("sampling.same_noise_per_group", True,
                              f"false for method '{self.name}' (its ODE rollout turns one noise into one image, "
                              f"so a group sharing its noise has one reward and {self.shared_noise_breaks})")
        if self.moving_average() is not None and cfg.train.shard == "fsdp":
            raise ConfigError("train.shard", "fsdp", f"'none' with method.{self.moving_average()} (the moving "
                                                     "average of the policy is a whole copy of its weights)")
        steps = cfg.sampling.steps
        if self.times_per_sample(steps) > TIMES_PER_STEP * steps:
            raise ConfigError("method.times_per_sample", self.config.times_per_sample,
                              f"an integer in [1, {TIMES_PER_STEP * steps}] ({TIMES_PER_STEP} x sampling.steps: "
                              "each time costs a forward and a backward per sample, and its noise is held "
                              "beside the others)")

    def times_per_sample(self, steps: int) -> int:
        """K for a ``steps``-step rollout (a subclass whose K has a default from the schedule says so)."""
        return self.config.times_per_sample

    def average(self) -> EMAPolicy:
        """The moving average :meth:`take_in` keeps, where :meth:`moving_average` names an option."""
        assert self.ema is not None, f"method '{self.name}' keeps no moving average"
        return self.ema

    def moving_average(self) -> str | None:
        """The option that makes this run keep an :class:`EMAPolicy` (None: it keeps none)."""
        return None

    def state_dict(self) -> dict | None:
        """The moving average, so that a resumed run goes on with it (a checkpoint holds it)."""
        return None if self.ema is None else {"ema": self.ema.state_dict()}

    def load_state_dict(self, state: dict, policy) -> None:
        """The moving average of ``state`` (into the one this estimator holds, in place, where it holds one)."""
        if isinstance(state.get("ema"), dict):
            if self.ema is None:
                self.ema = EMAPolicy.from_state(policy, state["ema"])
            else:
                self.ema.load_state_dict(state["ema"])

    def replay_case(self, cfg, stochastic, batch_size, generator):
        return ReplayCase("not_applicable", note=f"{self.paper} trains {self.trains}: there is no per-step GRPO "
                                                 "gradient to compare")

    def sde_mask(self, iteration, steps, generator):
        return torch.zeros(steps, dtype=torch.bool)

    @staticmethod
    def with_velocity_kl(terms: torch.Tensor, v: torch.Tensor, reference, x_t: torch.Tensor,
                         timesteps: torch.Tensor, cond, beta: float) -> torch.Tensor:
        """``terms`` plus the KL term of ``grpo.beta``: beta x the mean squared difference of the policy's
        velocity ``v`` and the reference's at the same ``x_t`` (no gradient through the reference); as they
        are without a reference or with beta 0."""
        if beta > 0 and reference is not None:
            with torch.no_grad():
                v_ref = reference.velocity(x_t, timesteps, cond).to(v.dtype)
            terms = terms + beta * ((v - v_ref) ** 2).mean(dim=tuple(range(1, v.dim())))
        return terms

    @staticmethod
    def backward(terms: torch.Tensor, batch, stats) -> None:
        """Back-propagates the rows' loss ``terms`` (B_rows,) scaled by the batch's share of the update,
        and adds their value and count to ``stats``."""
        (terms.sum() * batch.loss_scale).backward()
        stats.loss_sum += float(terms.detach().double().sum()) * batch.loss_scale
        stats.count += int(terms.numel())

    def draw_noise_seed(self, generator: torch.Generator) -> None:
        """The seed of this update's noise (:func:`noised_draws`), drawn after the plan's own draws."""
        self.noise_seed = int(torch.randint(0, 2**62, (1,), generator=generator))


def noised_draws(policy, batch, seed: int, times: str | torch.Tensor,
                 group_size: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """eps (B, K, ...), t (B, K) and the model's timesteps (B, K) of every (sample, slot), in the latents'
    dtype and device (module docstring)."""
    x0 = batch.latents[:, -1]
    b, k = batch.train_steps.shape
    gen = torch.Generator().manual_seed(seed)
    if group_size is None:
        eps = torch.randn((b, k, *x0.shape[1:]), generator=gen, dtype=x0.dtype)
    else:
        eps = torch.randn((b // group_size, k, *x0.shape[1:]), generator=gen, dtype=x0.dtype)
        eps = eps.repeat_interleave(group_size, dim=0)
    eps = eps.to(x0.device)
    if isinstance(times, str) and times == "schedule":
        steps = batch.train_steps
        t = batch.sigmas[steps.to(batch.sigmas.device)].to(x0.device, x0.dtype)
        return eps, t, batch.timesteps[steps.to(batch.timesteps.device)]
    if isinstance(times, str):  # "uniform"
        times = torch.rand((b, k), generator=gen, dtype=torch.float64)
    t = times.to(x0.device, x0.dtype)
    return eps, t, (t * policy.timestep_scale).to(batch.timesteps.dtype)
