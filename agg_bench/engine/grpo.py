"""GRPO pieces that every method shares: advantages, the clipped per-step loss, its gradient with
respect to the velocity, and ratio statistics.

The objective of one iteration is ``L = 1/(B*N) * sum_i sum_{j in steps(i)} l_ij`` with
``l_ij = max(-A_i r_ij, -A_i clamp(r_ij, 1-eps, 1+eps)) + beta * KL_ij``.

Conventions that differ between the public implementations are options:
- the advantage ``A = (r - mean of the group) / (std + grpo.adv_eps)``: ``grpo.adv_std`` (:data:`ADV_STD`) takes
  the std over the ``group`` (the default) or over the whole batch's rewards (``global``: Flow-GRPO's
  ``sample.global_std``, DiffusionNFT, AWM), ``grpo.adv_ddof`` its delta degrees of freedom (0, numpy's
  ``np.std`` of the Flow-GRPO family, the default; 1, torch's ``.std()`` of DanceGRPO, MixGRPO, BranchGRPO and
  eff_grpo) and ``grpo.adv_eps`` the constant (1e-8, the default and the DanceGRPO family's; 1e-4, Flow-GRPO's
  stat tracker);
- ``grpo.kl_form`` (:data:`KL_FORMS`): ``transition`` is the KL between the policy's and the reference's
  Gaussian transitions, ``||mu - mu_ref||^2 / (2 std^2)`` with ``std = std_t sqrt(|dt|)`` (the Flow-GRPO
  paper; the default); ``no_dt`` divides by ``2 std_t^2`` instead, without the step size (the form in
  Flow-GRPO's public training code), i.e. the transition KL times ``|dt|``. Both average over elements,
  as the log-probability does.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from ..errors import ConfigError
from .sampler import SDEStepOutput, sde_step

if TYPE_CHECKING:  # annotations only: checking a method's options imports neither the models nor diffusers
    from ..config.sections import GRPOConfig
    from .models import Conditioning, Policy

ADV_STD = ("group", "global")
KL_FORMS = ("transition", "no_dt")


def group_advantages(rewards: torch.Tensor, group_size: int, adv_clip_max: float, std: str = "group",
                     dtype: torch.dtype = torch.float32, ddof: int = 0, eps: float = 1e-8) -> torch.Tensor:
    """Rewards minus their group's mean, divided by ``std`` (``group``: each group's std; ``global``: the std
    of all of ``rewards``) with ``ddof`` plus ``eps``, clamped to +-adv_clip_max; ``rewards`` are grouped
    consecutively (module docstring). Computed in float64 and returned in ``dtype``, the latents' dtype."""
    if std not in ADV_STD:
        raise ConfigError("grpo.adv_std", std, f"one of {list(ADV_STD)}")
    r = rewards.to(torch.float64).view(-1, group_size)
    if std == "group":
        spread = r.std(dim=1, correction=ddof, keepdim=True)
    else:
        spread = r.std(correction=ddof)
    adv = (r - r.mean(dim=1, keepdim=True)) / (spread + eps)
    return adv.clamp(-adv_clip_max, adv_clip_max).reshape(-1).to(dtype)


def grpo_advantages(rewards: torch.Tensor, grpo: GRPOConfig, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """:func:`group_advantages` with the run's ``grpo`` settings (group size, clamp, std, ddof, eps)."""
    return group_advantages(rewards, grpo.group_size, grpo.adv_clip_max, grpo.adv_std, dtype, grpo.adv_ddof,
                            grpo.adv_eps)


def transition_kl(policy: SDEStepOutput, reference: SDEStepOutput, form: str = "transition") -> torch.Tensor:
    """KL_ij (B,) between the policy's and the reference's transition of one step, in ``form``
    (:data:`KL_FORMS`); both transitions share their std, so only the means differ."""
    b = policy.mean.shape[0]
    dims = tuple(range(1, policy.mean.dim()))
    if form == "transition":
        variance = policy.std.reshape(b) ** 2
    elif form == "no_dt":
        variance = policy.std_t.reshape(b) ** 2
    else:
        raise ConfigError("grpo.kl_form", form, f"one of {list(KL_FORMS)}")
    return ((policy.mean - reference.mean) ** 2).mean(dim=dims) / (2 * variance)


@dataclass
class TrainBatch:
    """One iteration's rollout as the methods see it.

    ``latents`` (B, T+1, C, H, W); ``velocities`` (B, T, C, H, W) from the rollout or None;
    ``log_probs`` (B, T) old log-probs; ``sigmas`` (T+1); ``timesteps`` (T) the exact values given to
    the model; ``advantages`` (B,), or (B, T) where a method gives each step its own (BranchGRPO's
    depth-wise ones); ``train_steps`` (B, N) step indices in denoising order, a row that trains fewer than N
    steps ending in :data:`~agg_bench.engine.trained_steps.NO_STEP` entries (only ``guess``'s
    ``zero_loss_on_guess`` plans such rows, and only ``guess`` reads them). ``policy_version`` is the
    policy's version when the rollout was made; ``kl_form`` the form of the ``beta`` term
    (:func:`transition_kl`). ``transitions`` and ``forwarded`` are the trajectory's
    (:class:`agg_bench.engine.rollout.Trajectory`): shared transitions and guessed velocities.
    ``clip_gradient``: whether the optimizer step on this batch clips its gradient (``train.max_grad_norm``);
    False only for a part of a method's own update that its public code leaves unclipped (BranchGRPO's).
    """

    latents: torch.Tensor
    log_probs: torch.Tensor
    sigmas: torch.Tensor
    timesteps: torch.Tensor
    advantages: torch.Tensor
    train_steps: torch.Tensor
    cond: Conditioning
    sde: str
    eta: float
    clip_range: float
    beta: float = 0.0
    velocities: torch.Tensor | None = None
    policy_version: int = 0
    kl_form: str = "transition"
    transitions: torch.Tensor | None = None
    forwarded: torch.Tensor | None = None
    clip_gradient: bool = True

    @property
    def batch_size(self) -> int:
        return self.latents.shape[0]

    @property
    def steps_per_sample(self) -> int:
        return self.train_steps.shape[1]

    @property
    def loss_scale(self) -> float:
        """1/(B*N): the weight of one (sample, step) term in L."""
        return 1.0 / (self.batch_size * self.steps_per_sample)

    def states(self, rows: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
        """x_j for each (row, step) pair."""
        return self.latents[rows, steps]

    def timestep_values(self, steps: torch.Tensor) -> torch.Tensor:
        return self.timesteps[steps.to(self.timesteps.device)]

    def advantage(self, rows: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
        """A_i of each (row, step) pair: the sample's, or the step's own where advantages are per step."""
        if self.advantages.dim() == 1:
            return self.advantages[rows]
        return self.advantages[rows, steps.to(self.advantages.device)]

    def take_rows(self, rows: torch.Tensor) -> TrainBatch:
        """The batch of samples ``rows`` (a 1-D index tensor) alone, in that order: every per-sample field
        (:data:`ROW_FIELDS`) indexed on its own device, the schedule, the settings and ``policy_version`` as they
        are. Its ``loss_scale`` is then 1 / (len(rows) N): its loss is the mean over its own terms. A copy of
        the rows' data; the same class, so a subclass's own fields are kept."""
        def take(value):
            if value is None:
                return None
            if isinstance(value, torch.Tensor):
                return value[rows.to(value.device)]
            return value[rows.to(value.encoder_hidden_states.device)]  # Conditioning

        return dataclasses.replace(self, **{name: take(getattr(self, name)) for name in ROW_FIELDS})


# TrainBatch's fields indexed by sample (batch-first), which TrainBatch.take_rows takes; every other field is the
# whole rollout's (the schedule: sigmas, timesteps) or a setting (sde, eta, clip_range, beta, kl_form,
# policy_version, clip_gradient). transitions' ids stay the rollout's: rows that shared a transition still share its id.
ROW_FIELDS = ("latents", "log_probs", "advantages", "train_steps", "cond", "velocities", "transitions", "forwarded")


def minibatch_rows(batch_size: int, group_size: int, minibatches: int, unit: str = "groups") -> list[torch.Tensor]:
    """The rows of each of ``minibatches`` mini-batches of a batch of ``batch_size`` rows in consecutive GRPO
    groups of ``group_size``, each mini-batch's rows in increasing order. ``unit`` ``groups``: group g goes to
    mini-batch g mod ``minibatches`` (groups dealt in order; equally many in every mini-batch); ``slices``: each
    group is cut into ``minibatches`` consecutive slices and mini-batch k holds the k-th slice of every group.
    Either way the k-th mini-batches of data-parallel processes (each holding whole groups) make up the single
    process's k-th. The run config checks that the split is even (:func:`agg_bench.config.load.check_minibatches`)."""
    groups = batch_size // group_size
    if groups * group_size != batch_size or (groups if unit == "groups" else group_size) % minibatches:
        raise ValueError(f"{batch_size} rows in groups of {group_size} cannot be split into {minibatches} "
                         f"mini-batches of equal {unit}")
    if unit == "slices":
        width = group_size // minibatches
        return [(torch.arange(groups)[:, None] * group_size + k * width + torch.arange(width)).reshape(-1)
                for k in range(minibatches)]
    per_group = torch.arange(group_size)
    return [(torch.arange(k, groups, minibatches)[:, None] * group_size + per_group).reshape(-1)
            for k in range(minibatches)]


@dataclass
class StepTerms:
    """Per-sample quantities of one trained step for a batch of samples."""

    loss: torch.Tensor
    ratio: torch.Tensor
    log_prob: torch.Tensor


def step_terms(batch: TrainBatch, rows: torch.Tensor, steps: torch.Tensor, velocity: torch.Tensor,
               ref_velocity: torch.Tensor | None = None) -> StepTerms:
    """The GRPO loss l_ij (unscaled) for samples ``rows`` at steps ``steps`` given velocities at x_j."""
    x = batch.states(rows, steps)
    x_next = batch.latents[rows, steps + 1]
    out = sde_step(batch.sde, velocity, x, batch.sigmas, steps, batch.eta, prev_sample=x_next)
    ratio = torch.exp(out.log_prob - batch.log_probs[rows, steps].to(out.log_prob.dtype))
    adv = batch.advantage(rows, steps).to(ratio.dtype)
    eps = batch.clip_range
    loss = torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - eps, 1 + eps))
    if batch.beta > 0:
        if ref_velocity is None:
            raise ValueError("beta > 0 needs the reference policy's velocity")
        ref = sde_step(batch.sde, ref_velocity, x, batch.sigmas, steps, batch.eta, prev_sample=x_next)
        loss = loss + batch.beta * transition_kl(out, ref, batch.kl_form)
    return StepTerms(loss=loss, ratio=ratio, log_prob=out.log_prob)


def upstream_grad(batch: TrainBatch, rows: torch.Tensor, steps: torch.Tensor, velocity: torch.Tensor,
                  ref_velocity: torch.Tensor | None = None) -> tuple[torch.Tensor, StepTerms]:
    """u = d(loss_scale * l_ij)/dv for each (row, step), by autograd through the SDE step and loss only."""
    with torch.enable_grad():
        v = velocity.detach().requires_grad_(True)
        terms = step_terms(batch, rows, steps, v, ref_velocity)
        (u,) = torch.autograd.grad(terms.loss.sum() * batch.loss_scale, v)
    return u, StepTerms(terms.loss.detach(), terms.ratio.detach(), terms.log_prob.detach())


def exact_backward(policy: Policy, batch: TrainBatch, rows: torch.Tensor, steps: torch.Tensor,
                   stats: "UpdateStats", reference: Policy | None = None,
                   weights: torch.Tensor | None = None) -> None:
    """Exact gradient of the (row, step) terms, the per-step backward of full GRPO (and of every method
    where it trains a step exactly): forward with grad at x_j, loss, backward, scaled by ``loss_scale``.
    ``weights`` (len(rows),): each term's loss times its weight (``guess``'s guessed terms); None: all 1."""
    ref_v = None
    if batch.beta > 0 and reference is not None:
        with torch.no_grad():
            ref_v = reference.velocity(batch.states(rows, steps), batch.timestep_values(steps), batch.cond[rows])
    v = policy.velocity(batch.states(rows, steps), batch.timestep_values(steps), batch.cond[rows])
    terms = step_terms(batch, rows, steps, v, ref_v)
    if weights is not None:
        terms.loss = terms.loss * weights.to(device=terms.loss.device, dtype=terms.loss.dtype)
    (terms.loss.sum() * batch.loss_scale).backward()
    stats.add(terms, batch.log_probs[rows, steps], batch.loss_scale)


@dataclass
class UpdateStats:
    """Accumulates ratio and loss statistics over all (sample, step) terms of one update."""

    clip_range: float
    loss_sum: float = 0.0
    count: int = 0
    clipped: int = 0
    sq_logratio_sum: float = 0.0
    ratio_dev: float = 0.0
    extras: dict = field(default_factory=dict)

    def add(self, terms: StepTerms, log_prob_old: torch.Tensor, scale: float) -> None:
        ratio = terms.ratio.detach().double()
        self.loss_sum += float(terms.loss.detach().double().sum()) * scale
        self.count += ratio.numel()
        self.clipped += int(((ratio - 1).abs() > self.clip_range).sum())
        self.sq_logratio_sum += float(((terms.log_prob.detach().double() - log_prob_old.double()) ** 2).sum())
        self.ratio_dev = max(self.ratio_dev, float((ratio - 1).abs().max()) if ratio.numel() else 0.0)

    def as_dict(self) -> dict:
        n = max(self.count, 1)
        return {"loss": self.loss_sum, "clip_frac": self.clipped / n,
                "approx_kl": 0.5 * self.sq_logratio_sum / n, "ratio_dev": self.ratio_dev, **self.extras}


def micro_batches(n: int, size: int | None):
    """Index tensors covering range(n) in chunks of ``size`` (all at once when size is None)."""
    size = n if not size else size
    for start in range(0, n, size):
        yield torch.arange(start, min(start + size, n))
