"""DGPO: Direct Group Preference Optimization (Luo, Hu and Tang, "Reinforcing Diffusion Models by Direct Group
Preference Optimization", arXiv 2510.08425; public code github.com/Luo-Yihong/DGPO,
``scripts/train_sd3_dgpo.py``: ``compute_group_dgpo_loss_allreduce``, the training loop; ``config/base.py``,
``config/dgpo.py``: defaults).

DGPO has no per-step likelihood. The rollout is deterministic: the public code samples with its SDE
pipeline at ``sample.noise_level = 0``, which is the Euler ODE on the run's grid, the engine's ODE here
(every step deterministic, ``sampling.steps`` steps). Only each sample's final latent x0 and its reward are kept.

The group preference (the paper's DGPO objective, §3: DPO's Bradley-Terry likelihood between a positive
group G+ and a negative group G- of one prompt's G samples, in place of a pair). A sample belongs to G+ when
its advantage A (GRPO's group-standardised reward, clipped to +-``grpo.adv_clip_max``) is positive and to
G- when negative, with weight |A| (the paper's advantage-based weights, which make the intractable
normalisers of the two groups cancel because sum_G A = 0). The implicit reward of a sample is the
difference of the denoising errors of the policy and the reference at a noised time t: with fresh noise eps,
``x_t = (1 - t) x0 + t eps`` and the flow-matching target ``eps - x0``,

    Delta_i = l_theta(i) - l_ref(i),   l_m(i) = mean (v_m(x_t, t) - (eps - x0))^2   (mean over elements).

The loss of a group g at one time is

    -log sigmoid(z_g),   z_g = -beta / G * (sum_{i in G+} |A_i| Delta_i - sum_{i in G-} |A_i| Delta_i)
                             = -beta / G * sum_{i in g} A_i Delta_i,

(the 1/G is the code's ``per_sample_term = A * beta_dpo * delta / group_size``). Its gradient is
``sigmoid(-z_g) * beta / G * sum_i A_i grad l_theta(i)``: the code's surrogate
``mean_i(w_g A_i l_theta(i))`` with the detached group weight ``w_g = sigmoid(-z_g)`` drops the factor
beta / G, so the loss here is the paper's divided by beta (the gradient's size is independent of beta, as
in the code):

    L = 1 / (K P beta) sum_k sum_g -log sigmoid(z_gk)   (P groups of G, B = P G rows, K times),

whose gradient is ``1/(B K) sum_k sum_i w_gk A_i grad l_theta(i, k)``, what ``accumulate`` adds (the code
averages over the batch, and its gradient accumulation over the K times averages over them). With
``grpo.beta > 0`` the code's KL term ``grpo.beta * mean (v_theta - v_ref)^2`` is added to every (row, time).

The reference. In the code it is the base model (the LoRA adapter disabled), the policy at the start of the
run. Here: the session's reference when ``grpo.beta > 0`` (the same frozen start), otherwise a frozen copy of
the policy (:meth:`agg_bench.engine.models.Policy.frozen_copy`) made at the first rollout of the estimator;
a resumed run takes it from the weights it resumes from. Its velocity at every (row, time) is one no-grad
forward (shared with the KL term). Passes per inner epoch: B K forward_grad, B K backward, B K forward_nograd.

The K times per sample (``time_distribution``):
- ``schedule`` (the code): K distinct steps j of the rollout's own schedule among its first
  ``trunc_steps + 1`` (the noisiest; the code's timestep clip ``train_timesteps = range(trunc_steps + 1)``),
  drawn without replacement once for the whole batch (``generate_shared_sampled_timesteps``),
  t = sigma_j, the model given timestep_j;
- ``uniform``: t ~ U(0, 1) per (sample, slot).
Noise: with ``shared_noise`` (the code's ``use_shared_noise = True``) the G samples of a group share eps at
each time (``generate_shared_noise_for_groups``); otherwise each row draws its own. The steps are drawn in
:meth:`DGPOEstimator.plan` from the iteration's generator, then the seed of a generator that draws the noise
(and uniform times): deterministic given the run's seed, and the same in every inner epoch of a rollout.

``micro_batch`` splits the forwards with grad; the graphs of one time stay alive until its group weights are
known (a weight needs every member's error; the code all-reduces the group sums), then one backward.

Not ported: the PPO-style clip of the DSM loss against an EMA "old" model (``clip_dsm``, ``clip_range``) and
the EMA reference (``use_ema_ref``, ``switch_ema_ref``), CFG in training (``train.cfg``), the batch-wide reward
std (``sample.global_std``; the group's here, ``grpo.adv_std``), LoRA. An ODE rollout from one noise is one
image, so ``sampling.same_noise_per_group`` must be false.

Replay: ``not_applicable``, there is no per-step GRPO gradient to compare.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from agg_bench.engine.grpo import micro_batches
from agg_bench.errors import ConfigError
from agg_bench.methods.base import register_method
from baselines.final_latent import FinalLatentEstimator, noised_draws

TIME_DISTRIBUTIONS = ("schedule", "uniform")


@dataclass
class DGPOConfig:
    """DGPO's options (defaults from github.com/Luo-Yihong/DGPO ``config/dgpo.py``, ``config/base.py``).

    ``beta`` (100.0; ``config.train.beta_dpo = 100``, 10 for pickscore): the DPO temperature, > 0.
    ``times_per_sample`` (4; ``config.num_train_timesteps = 4``): K >= 1 noised copies of each final latent;
      at most ``trunc_steps + 1`` with the ``schedule`` distribution, and at most 4 x sampling.steps with
      ``uniform`` (each time is a forward and a backward per sample: :data:`baselines.final_latent.TIMES_PER_STEP`).
    ``time_distribution`` ("schedule", the code): where t comes from (module docstring); or ``uniform``.
    ``trunc_steps`` (4; ``config.trunc_steps = 4`` for geneval, 6 in ``compressibility``): the schedule's steps
      0..trunc_steps are eligible (the timestep clip, t >= sigma_{trunc_steps}); less than sampling.steps.
    ``shared_noise`` (true; ``config.use_shared_noise = True``): the samples of a group share the noise at a time.
    ``micro_batch``: samples per forward with grad (None: the whole batch).
    """

    beta: float = 100.0
    times_per_sample: int = 4
    time_distribution: Literal["schedule", "uniform"] = "schedule"
    trunc_steps: int = 4
    shared_noise: bool = True
    micro_batch: int | None = None

    def validate(self) -> None:
        if not self.beta > 0:
            raise ConfigError("method.beta", self.beta, "a number > 0 (DGPO's DPO temperature)")
        if self.times_per_sample < 1:
            raise ConfigError("method.times_per_sample", self.times_per_sample, "an integer >= 1")
        if self.trunc_steps < 0:
            raise ConfigError("method.trunc_steps", self.trunc_steps, "an integer >= 0")
        if self.time_distribution == "schedule" and self.times_per_sample > self.trunc_steps + 1:
            raise ConfigError("method.times_per_sample", self.times_per_sample,
                              f"an integer in [1, {self.trunc_steps + 1}] (method.trunc_steps + 1; distinct steps "
                              "of the schedule with method.time_distribution=schedule)")


def group_weights(advantages: torch.Tensor, delta: torch.Tensor, group_size: int, beta: float) -> torch.Tensor:
    """w (B,): sigmoid(beta / G * sum_{j in g} A_j Delta_j) of each row's group g (rows grouped consecutively)."""
    sums = (advantages * delta).view(-1, group_size).sum(dim=1)
    return torch.sigmoid(beta / group_size * sums).repeat_interleave(group_size)


@register_method
class DGPOEstimator(FinalLatentEstimator):
    """Group DPO on flow-matching errors of each final latent at K noised times, against a frozen reference."""

    name = "dgpo"
    config_cls = DGPOConfig
    paper, trains = "DGPO", "a group preference loss on flow-matching errors of final latents"

    def __init__(self, config: DGPOConfig | None = None):
        super().__init__(config)
        self.group_size = 1
        self.frozen = None  # the reference when the session has none (grpo.beta = 0)
        self.own_reference = True

    def check_run(self, cfg) -> None:
        super().check_run(cfg)
        c = self.config
        self.group_size = cfg.grpo.group_size
        self.own_reference = not cfg.grpo.beta > 0
        if c.time_distribution == "schedule" and c.trunc_steps >= cfg.sampling.steps:
            raise ConfigError("method.trunc_steps", c.trunc_steps,
                              f"an integer in [0, {cfg.sampling.steps - 1}] (below sampling.steps)")

    def rollout(self, policy, cond, noise, sigmas, sampling, generator, iteration, group_size):
        self.group_size = group_size
        if self.own_reference and self.frozen is None:
            self.frozen = policy.frozen_copy()
        return super().rollout(policy, cond, noise, sigmas, sampling, generator, iteration, group_size)

    def plan(self, train, trajectory, batch_size, generator):
        """(B, K): the K schedule steps shared by the batch (``schedule``) or the slots 0..K-1 (``uniform``);
        the seed of the noise generator is drawn after them."""
        k = self.config.times_per_sample
        if self.config.time_distribution == "schedule":
            planned = torch.randperm(self.config.trunc_steps + 1, generator=generator)[:k].expand(batch_size, k)
        else:
            planned = torch.arange(k).expand(batch_size, k)
        self.draw_noise_seed(generator)
        return planned.clone()

    def draws(self, policy, batch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """eps (B, K, ...), t (B, K) and the model's timesteps (B, K) of every (sample, slot)."""
        return noised_draws(policy, batch, self.noise_seed, self.config.time_distribution,
                            self.group_size if self.config.shared_noise else None)

    def accumulate(self, policy, batch, stats, reference=None):
        c = self.config
        ref = reference if reference is not None else self.frozen
        if ref is None:
            raise RuntimeError("method 'dgpo' needs a reference policy: none was passed and no rollout made one")
        x0 = batch.latents[:, -1]
        b, k = batch.train_steps.shape
        dims = tuple(range(1, x0.dim()))
        eps, t, timesteps = self.draws(policy, batch)
        a = batch.advantages.to(x0.dtype)
        kl_beta = batch.beta if reference is not None else 0.0
        for slot in range(k):
            errors, ref_errors, kls = [], [], []
            for rows in micro_batches(b, c.micro_batch):
                te = t[rows, slot].view(-1, *([1] * (x0.dim() - 1)))
                x_t = (1 - te) * x0[rows] + te * eps[rows, slot]
                target = eps[rows, slot] - x0[rows]
                cond = batch.cond[rows]
                with torch.no_grad():
                    v_ref = ref.velocity(x_t, timesteps[rows, slot], cond).to(x0.dtype)
                v = policy.velocity(x_t, timesteps[rows, slot], cond).to(x0.dtype)
                errors.append(((v - target) ** 2).mean(dim=dims))
                ref_errors.append(((v_ref - target) ** 2).mean(dim=dims))
                if kl_beta > 0:
                    kls.append(kl_beta * ((v - v_ref) ** 2).mean(dim=dims))
            error, ref_error = torch.cat(errors), torch.cat(ref_errors)
            w = group_weights(a, error.detach() - ref_error, self.group_size, c.beta)
            terms = w * a * error
            if kls:
                terms = terms + torch.cat(kls)
            (terms.sum() * batch.loss_scale).backward()
            # the loss value: the paper's per-group -log sigmoid(z) / beta, spread over its G rows
            z = -c.beta / self.group_size * (a * (error.detach() - ref_error)).view(-1, self.group_size).sum(1)
            value = -torch.nn.functional.logsigmoid(z) / c.beta
            stats.loss_sum += float(value.double().sum()) * self.group_size * batch.loss_scale
            if kls:
                stats.loss_sum += float(torch.cat(kls).detach().double().sum()) * batch.loss_scale
            stats.count += b
