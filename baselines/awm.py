"""Advantage-Weighted Matching (Xue et al., arXiv 2509.25050; public code github.com/scxue/advantage_weighted_matching,
``advantage_weighted_matching/scripts/train_sd3_awm.py`` and ``config/dgx_awm.py``).

AWM keeps diffusion RL on the pre-training objective: no per-step likelihood, only each sample's FINAL latent x0
and its reward. The rollout is on the run's ``sampling.steps`` grid (the code samples 14 steps,
``sample.num_steps``), one forward per step: ``method.solver`` ``euler`` (the default) is the engine's Euler ODE;
``sa_solver`` (the preset) is the code's sampler, ``train.use_sa_solver``: SA-Solver
(``flow_grpo/diffusers_patch/sa_solver.py``, ``SASolver.sample`` with predictor and corrector of order 2, PEC) as
called by ``flow_grpo/diffusers_patch/sd3_pipeline_with_logprob.py``, on the scheduler's sigmas with the first set
to 1 - 1e-3 and the last nonzero one to half the one before
(:class:`agg_bench.engine.solvers.SASolver`, :func:`~agg_bench.engine.solvers.sa_solver_grid`). Its noise level tau
is ``sa_solver_tau`` on the steps into sigmas in [0.3, 0.9] of that grid and 0 elsewhere, as the pipeline's
``stochasticity_control_function`` gives the code's ``sample.noise_level``
(:func:`~agg_bench.engine.solvers.sa_solver_taus`; ``sample.sde_frac`` is read only by the code's Euler sampler):
0, the default, is the ODE (the pickscore configs); 0.4 in the geneval and ocr configs (``config/dgx_awm.py``
``geneval_sd3_no_cfg_1node``; the preset), whose rollout adds ``s' sqrt(1 - e^{-2 tau^2 h}) xi`` on those steps,
xi of the latents' shape drawn from the iteration's generator on each step with tau > 0 (the code draws every
step's from torch's global generator), one draw shared by a step's predictor and corrector. The rollout needs no log-probability (the update uses only the final latents), and each
step with or without noise records log-probability 0. The rollout records the states the model was given
(SA-Solver's predicted ones, with their noise), the code the corrected ones; the final latents are the same. The
schedule times the update draws (``discrete``) are the run schedule's, as the code draws them from its scheduler's
timesteps (they differ from the grid's at 2 steps only).

The loss (the paper's AWM objective, §3: the flow-matching loss of each sample weighted by its advantage).
x0 is noised at K times ``t`` with fresh noise ``eps``: ``x_t = (1 - t) x0 + t eps``, target ``eps - x0``
(``compute_log_prob_awm``). With the current policy's velocity ``v_theta(x_t, t)`` (with grad),

    e_ik = mean over elements (v_theta(x_t, t) - (eps - x0))^2,
    L = 1/(B K) sum_i sum_k A_i w(e_ik, t_k)  [+ grpo.beta * 1/(B K) sum_i sum_k mean (v_theta - v_ref)^2],

``A_i`` the group-standardised reward clipped to +-``grpo.adv_clip_max`` and rescaled to +-``advantage_max``
(the code: ``clamp(A, -adv_clip_max, adv_clip_max) / adv_clip_max * advantage_max``, advantage_max = 1).
Minimising L lowers the matching error of samples with A > 0 and raises it for A < 0 (the sign of the paper's
equation). ``w`` (``weighting``): ``uniform`` w = e (the paper's equation), or ``ghuber`` (the code's default,
power p = ``ghuber_power``): ``w = ((e + 1e-10)^p - 1e-10^p) t / p``.
The code writes the loss as a PPO ratio surrogate ``-A exp(log_p - log_p_old)`` with ``log_p = -w``: on the
policy that sampled the rollout the ratio is 1 and its gradient is exactly dL/dtheta above. Only that case
is built here, so ``train.inner_epochs`` must be 1 (refused otherwise). The ODE rollout being deterministic, the
G samples of a prompt need their own initial noise (the code draws one per image, with or without tau):
``sampling.same_noise_per_group`` must be false.
The KL option is the code's ``train.beta`` (``kl_weight = 'Uniform'``): velocity matching to the base model,
here the session's reference policy (a frozen copy, or the LoRA base) when ``grpo.beta > 0``; one no-grad
forward per (sample, time), counted.

EMA-KL (the code's second term, ``train.ema_beta`` with ``kl_ema_weight = 'Uniform'``):
``+ ema_kl_beta * 1/(B K) sum_ik mean (v_theta - v_ema)^2``, v_ema the velocity of an
:class:`~baselines.final_latent.EMAPolicy` of the policy, which after each iteration takes in the trained
weights with the decay ``min(ema_decay_max, ema_decay_rate * n)`` after n optimizer steps (the code's
``kl_ema_decay_type = 'linear'``: ``min(kl_ema_decay, 0.001 * global_step)``, kl_ema_decay 0.3). Every public
config sets ``ema_beta = 1``; the code adds the term only inside its ``train.beta > 0`` branch (every config
has one), here it does not depend on ``grpo.beta``. One no-grad forward of the moving average per (sample,
time), counted and charged; none while its weights are the policy's (the first iteration: the term and its
gradient are then exactly 0). ``ema_kl_beta`` 0, the default, keeps no moving average.

The K times per sample (``time_distribution``), one t per slot shared by ``times_shared_by`` samples: null
(the default), the whole batch; a number n, as the code's micro-batches of ``train.batch_size`` = 3 samples each
draw their own (it shuffles the rollout's samples, then cuts them into micro-batches): a random permutation
of the batch's rows, cut into consecutive sets of n (the last one smaller where n does not divide B), each set
drawing its K times in turn:
- ``discrete`` (the code's default ``time_type = 'discrete_wo_init'``): schedule indices stratified over
  [1, int(steps * 0.9)] (``timestep_fraction = 0.9``) in K strata, one uniform index per stratum,
  t = the rollout's sigma at it;
- ``logit_normal`` (the code's ``logit_normal``): K stratified quantiles of N(0, 1), shuffled, t = sigmoid(u)
  shifted by ``sampling.shift`` (``time_shift = 3``, a number of the recipe's own), at least 0.01; a null
  ``sampling.shift`` (the schedule from the model's scheduler config) is refused with it;
- ``uniform``: t ~ U(0, 1) per (sample, slot).
The times and the seed of the noise generator are drawn in :meth:`AWMEstimator.plan` from the iteration's
generator: deterministic given the run's seed. Passes: B*T rollout forwards, B*K forward_grad and B*K backward,
plus B*K forward_nograd with ``grpo.beta > 0`` and B*K more for the EMA-KL term where its moving average differs
from the policy.

The code's advantages take the batch-wide reward std plus 1e-4 (``sample.global_std = True``): here
``grpo.adv_std: global``, ``grpo.adv_eps: 1e-4`` (the preset). The EMA of the trained weights that only evaluations
and checkpoints use (``train.ema``, decay 0.99, ``update_step_interval`` 1) is the run key ``train.eval_ema`` (0.99 in
the preset). Not ported: LoRA. The code skips its
first two epochs, whose groups it says its sampler gets wrong (a workaround: the harness's groups are right from
the first iteration).

Replay: ``not_applicable``, there is no per-step GRPO gradient to compare.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from agg_bench.config.options import MAX_BATCH, Options, batch_option, option
from agg_bench.engine.grpo import grpo_advantages, micro_batches
from agg_bench.errors import ConfigError
from agg_bench.methods.base import register_method
from baselines.final_latent import EMAPolicy, FinalLatentEstimator, ema_decay, noised_draws

GHUBER_EPS = 1e-10  # the code's offset inside the generalised Huber power
DISCRETE_FRACTION = 0.9  # the code's train.timestep_fraction for discrete_wo_init
MIN_TIME = 0.01  # the code's clamp(min=0.01) on logit-normal times
# SA-Solver's tau is at most this: 1 is the reverse SDE's noise (tau = 0 the ODE), the public configs take 0.4
SA_SOLVER_MAX_TAU = 10.0


@dataclass
class AWMConfig(Options):
    """Options of AWM (defaults from github.com/scxue/advantage_weighted_matching ``config/dgx_awm.py``). The
    KL coefficient is the run's ``grpo.beta`` (the code's ``train.beta``, 0.001 for PickScore)."""

    times_per_sample: int = option(
        6, "K noised copies of each final latent (`train.train_timesteps = 6`), at most 4 x sampling.steps (each "
        "time is a forward and a backward per sample: `baselines.final_latent.TIMES_PER_STEP`)",
        minimum=1, maximum=10**9)
    time_distribution: Literal["discrete", "logit_normal", "uniform"] = option(
        "discrete", "where t comes from: `discrete` (the code's `discrete_wo_init`: stratified schedule steps in "
        "[1, 0.9 T]), `logit_normal` (shift `sampling.shift`, which must be a number with it) or `uniform` "
        "(module docstring)")
    weighting: Literal["uniform", "ghuber"] = option(
        "uniform", "`uniform` (the paper's equation) or `ghuber` (the code's `train.weighting`, every public config)")
    ghuber_power: float = option(0.25, "p of the `ghuber` weighting (`train.ghuber_power`)",
                                 exclusive_minimum=0, maximum=1)
    advantage_max: float = option(1.0, "clipped advantages are rescaled to +-this (`train.advantage_max`)",
                                  exclusive_minimum=0, maximum=1e6)
    micro_batch: int | None = batch_option("samples per forward-with-grad; null: the whole batch")
    ema_kl_beta: float = option(0.0, "the weight of the EMA-KL term (0: no term; the code's `train.ema_beta = 1`)",
                                minimum=0, maximum=1e6)
    ema_decay_rate: float = option(0.001, "its moving average's decay grows by this per optimizer step: min(max, "
                                          "rate x optimizer steps)", minimum=0, maximum=1)
    ema_decay_max: float = option(0.3, "the largest decay of that moving average (the code's `kl_ema_decay`)",
                                  minimum=0, maximum=1)
    times_shared_by: int | None = option(
        None, "samples that share one draw of the K times: null, the whole batch; n, sets of n of the shuffled "
        "batch, each drawing its own (the code's micro-batches of `train.batch_size = 3`; module docstring)",
        minimum=1, maximum=MAX_BATCH)
    solver: Literal["euler", "sa_solver"] = option(
        "euler", "the ODE rollout's sampler: `euler`, or `sa_solver`, SA-Solver's ODE with predictor and corrector "
        "of order 2 (PEC: one forward per step, as Euler) on the code's grid, its first sigma 1 - 1e-3 and its last "
        "nonzero one half the one before (the code's `train.use_sa_solver`; `agg_bench.engine.solvers.SASolver`); "
        "`sa_solver` needs sampling.steps >= 2")
    sa_solver_tau: float = option(
        0.0, "SA-Solver's noise level tau on the steps into sigmas in [0.3, 0.9], 0 on the others (the code's "
        "`sample.noise_level`: 0.4 in its geneval and ocr configs, 0 in its pickscore ones); 0, the ODE; above 0 "
        "needs `solver: sa_solver`, whose rollout then draws its noise from the iteration's generator (1 is the "
        "paper's reverse SDE)", minimum=0, maximum=SA_SOLVER_MAX_TAU)

    def check(self) -> None:
        if self.sa_solver_tau > 0 and self.solver != "sa_solver":
            raise ConfigError("method.sa_solver_tau", self.sa_solver_tau,
                              f"0 with method.solver={self.solver} (it is SA-Solver's noise level: method.solver="
                              "sa_solver takes it)")


def matching_error(v: torch.Tensor, x0: torch.Tensor, eps: torch.Tensor) -> torch.Tensor:
    """e (rows,): the mean squared flow-matching error of ``v`` against the target ``eps - x0``."""
    return ((v - (eps - x0)) ** 2).mean(dim=tuple(range(1, v.dim())))


def weighted(error: torch.Tensor, t: torch.Tensor, weighting: str, power: float) -> torch.Tensor:
    """w(e, t) of the module docstring."""
    if weighting == "uniform":
        return error
    floor = torch.tensor(GHUBER_EPS, dtype=error.dtype, device=error.device) ** power
    return ((error + GHUBER_EPS) ** power - floor) * t / power


def draw_times(kind: str, k: int, batch_size: int, sigmas: torch.Tensor, shift: float,
               generator: torch.Generator) -> torch.Tensor:
    """t (B, K) float64 of the K slots (module docstring)."""
    if kind == "uniform":
        return torch.rand((batch_size, k), generator=generator, dtype=torch.float64)
    if kind == "discrete":
        steps = sigmas.numel() - 1
        bounds = torch.linspace(1, max(1, int(steps * DISCRETE_FRACTION)), k + 1, dtype=torch.float64).long()
        u = torch.rand(k, generator=generator, dtype=torch.float64)
        index = bounds[:-1] + (u * (bounds[1:] - bounds[:-1])).long()
        t = sigmas.detach().cpu().double()[index]
    else:
        base = (torch.arange(k, dtype=torch.float64) + torch.rand(k, generator=generator, dtype=torch.float64)) / k
        u = torch.distributions.Normal(0.0, 1.0).icdf(base.clamp(1e-7, 1 - 1e-7))
        t = torch.sigmoid(u[torch.randperm(k, generator=generator)])
        t = (shift * t / (1 + (shift - 1) * t)).clamp(min=MIN_TIME)
    return t.expand(batch_size, k).clone()


@register_method
class AWMEstimator(FinalLatentEstimator):
    """Advantage-weighted flow-matching loss on each final latent at K noised times."""

    name = "awm"
    config_cls = AWMConfig
    config: AWMConfig
    paper, trains = "AWM", "an advantage-weighted flow-matching loss on final latents"

    def __init__(self, config: AWMConfig | None = None):
        super().__init__(config)
        self.times = torch.zeros(0, 0, dtype=torch.float64)
        self.shift = 1.0
        self.ema: EMAPolicy | None = None  # the EMA-KL term's moving average
        self.schedule: torch.Tensor | None = None  # the run's schedule the last rollout was given

    def moving_average(self) -> str | None:
        return "ema_kl_beta" if self.config.ema_kl_beta > 0 else None

    def rollout(self, policy, cond, noise, sigmas, sampling, generator, iteration, group_size):
        """The policy's own rollout, on SA-Solver's grid with ``solver: sa_solver``; the EMA-KL term's moving
        average takes in the steps since the last one."""
        c = self.config
        if c.ema_kl_beta > 0:
            if self.ema is None:
                self.ema = EMAPolicy(policy)
            elif policy.version != self.ema.steps:
                self.ema.update(policy, ema_decay(policy.version, c.ema_decay_rate, c.ema_decay_max))
        self.schedule = sigmas
        if c.solver == "sa_solver":
            sigmas = self.solver_grid(sigmas)
        return super().rollout(policy, cond, noise, sigmas, sampling, generator, iteration, group_size)

    @staticmethod
    def solver_grid(sigmas: torch.Tensor) -> torch.Tensor:
        """SA-Solver's grid made from the schedule ``sigmas``; a ConfigError where it does not decrease (a schedule
        whose second sigma is 1 - 1e-3 or more: shift 3 from about 335 steps)."""
        from agg_bench.engine.solvers import sa_solver_grid

        grid = sa_solver_grid(sigmas)
        if not bool((grid[:-1] > grid[1:]).all()):
            raise ConfigError("sampling.steps", sigmas.numel() - 1,
                              f"fewer with method.solver=sa_solver: its grid's first sigma, {float(grid[0])}, must "
                              f"lie above the schedule's second, {float(sigmas[1])}")
        return grid

    def check_schedule(self, cfg, sigmas) -> None:
        if self.config.solver == "sa_solver":
            self.solver_grid(sigmas)

    def ode_rule(self, sigmas, generator):
        """SA-Solver's step on its grid with ``solver: sa_solver`` (the rollout samples on that grid), with the noise
        level ``sa_solver_tau`` on the steps the code's window selects, its noise drawn from ``generator``; Euler
        otherwise."""
        from agg_bench.engine.solvers import SASolver, sa_solver_taus

        if self.config.solver != "sa_solver":
            return None
        return SASolver(sigmas, sa_solver_taus(sigmas, self.config.sa_solver_tau), generator).step

    def check_run(self, cfg) -> None:
        super().check_run(cfg)
        if self.config.solver == "sa_solver" and cfg.sampling.steps < 2:
            raise ConfigError("sampling.steps", cfg.sampling.steps,
                              "at least 2 with method.solver=sa_solver (its grid sets the last nonzero sigma to "
                              "half the one before it; the code asserts 2 steps)")
        if self.config.time_distribution == "logit_normal" and cfg.sampling.shift is None:
            raise ConfigError("sampling.shift", None,
                              "a number for method 'awm' with method.time_distribution=logit_normal (its times are "
                              "shifted by it, the public code's time_shift; a null shift leaves the schedule to "
                              "the model's scheduler config, which gives the times no shift of their own)")
        self.shift = cfg.sampling.shift
        if cfg.train.inner_epochs != 1:
            raise ConfigError("train.inner_epochs", cfg.train.inner_epochs,
                              "1 with method.name=awm (the on-policy ratio-1 gradient of the code's surrogate)")

    def advantages(self, rewards, trajectory, grpo):
        """A (B,): group-standardised, clipped to +-adv_clip_max, rescaled to +-advantage_max."""
        a = grpo_advantages(rewards, grpo, torch.float64)
        return (a / grpo.adv_clip_max * self.config.advantage_max).to(trajectory.latents.dtype)

    def trained_steps(self, train, trajectory, batch_size, generator):
        """(B, K) slots 0..K-1; the times and then the seed of the noise generator are drawn here."""
        c = self.config
        k = c.times_per_sample
        # the schedule's sigmas, as the code draws from its scheduler's timesteps: at 2 steps the discrete index 1
        # is the sigma SA-Solver's grid halves
        sigmas = self.schedule if self.schedule is not None else trajectory.sigmas
        if c.times_shared_by is None:
            self.times = draw_times(c.time_distribution, k, batch_size, sigmas, self.shift, generator)
        else:
            self.times = torch.empty(batch_size, k, dtype=torch.float64)
            order = torch.randperm(batch_size, generator=generator)
            for rows in order.split(c.times_shared_by):
                self.times[rows] = draw_times(c.time_distribution, k, rows.numel(), sigmas, self.shift,
                                              generator)
        self.draw_noise_seed(generator)
        return torch.arange(k).expand(batch_size, k).clone()

    def draws(self, policy, batch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """eps (B, K, ...), t (B, K) and the model's timesteps (B, K) of every (sample, slot)."""
        return noised_draws(policy, batch, self.noise_seed, self.times)

    def accumulate(self, policy, batch, stats, reference=None):
        c = self.config
        x0 = batch.latents[:, -1]
        b, k = batch.train_steps.shape
        eps, t, timesteps = self.draws(policy, batch)
        a = batch.advantages.to(x0.dtype)
        shape = (-1, *([1] * (x0.dim() - 1)))
        dims = tuple(range(1, x0.dim()))
        # the EMA-KL term is exactly 0, gradient included, while the moving average is the policy itself
        ema = self.ema if c.ema_kl_beta > 0 and self.ema is not None and not self.ema.equals(policy) else None
        for slot in range(k):
            for rows in micro_batches(b, c.micro_batch):
                te = t[rows, slot]
                x_t = (1 - te.view(shape)) * x0[rows] + te.view(shape) * eps[rows, slot]
                cond = batch.cond[rows]
                v = policy.velocity(x_t, timesteps[rows, slot], cond).to(x0.dtype)
                terms = a[rows] * weighted(matching_error(v, x0[rows], eps[rows, slot]), te, c.weighting,
                                           c.ghuber_power)
                terms = self.with_velocity_kl(terms, v, reference, x_t, timesteps[rows, slot], cond, batch.beta)
                if ema is not None:
                    with torch.no_grad():
                        v_ema = ema.policy.velocity(x_t, timesteps[rows, slot], cond).to(v.dtype)
                    terms = terms + c.ema_kl_beta * ((v - v_ema) ** 2).mean(dim=dims)
                self.backward(terms, batch, stats)
