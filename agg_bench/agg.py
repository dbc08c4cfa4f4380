"""AGG: Jacobian-Aggregated Group Gradient.

Each sample's trained steps (``batch.train_steps``) are cut into groups of W consecutive entries
``j_0 < ... < j_{W-1}``. Full GRPO needs ``sum_k J(x_{j_k})^T u_k`` (J the DiT's Jacobian in the
parameters, ``u_k = d(loss_scale * l_k)/dv_k``), i.e. W backward passes. AGG gets ``v_k`` from no-grad
forwards (or from the rollout while the parameters are still the rollout's), ``u_k`` analytically,
and interpolates the Jacobian linearly between the group's first and last step:

    u_base = sum_k (1 - a_k) u_k,   u_corr = sum_k a_k u_k,
    v(x_{j_0}).backward(u_base),    v(x_{j_{W-1}}).backward(u_corr)

so a group costs 2 forwards-with-grad and 2 backwards instead of W. Groups of 1 or 2 steps get
exact per-step backward (AGG would cost the same). Routing sends only the ``route_frac`` most linear
groups through AGG and the rest through exact per-step backward; ``route_frac = 0`` is full GRPO.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

import torch
import torch.nn.functional as F

from baselines.full import exact_backward

from . import distributed
from .errors import ConfigError
from .fsdp import lockstep
from .grpo import TrainBatch, UpdateStats, micro_batches, upstream_grad
from .methods import Estimator, register_method
from .models import Policy
from .plan import steps_per_sample

# Groups at most this long are trained exactly: two endpoint backwards are all the steps they have.
EXACT_GROUP_MAX = 2


@dataclass
class AGGConfig:
    """Options of the AGG estimator (config keys ``method.<field>``).

    ``window`` (5): W, trained steps per group; groups are consecutive chunks of W entries of
      ``train_steps`` (the last may be shorter). Use ``train.plan: groups`` with ``train.plan_window = W``
      so that every chunk is a run of W consecutive denoising steps.
    ``alpha`` ("index"): interpolation weight of step k in its group: ``index`` k/(W-1), or ``sigma``
      (s_{j_k} - s_{j_0}) / (s_{j_{W-1}} - s_{j_0}), which is exact when the velocity is affine in (x, t)
      along a straight segment of states.
    ``route_frac`` (1.0): fraction in [0, 1] of the groups of 3 or more steps that use AGG, the highest
      ``route_score`` first; the others get exact per-step backward. 0 is full GRPO, 1 routes them all.
    ``route_score`` ("velocity_cosine"): how linear a group is. ``velocity_cosine``: mean cosine of
      consecutive velocity increments v_{k+1} - v_k (needs every group's velocities, so groups left
      exact also pay their no-grad forwards unless reused); ``state_cosine``: the same on the states
      x_{j_k} (costs nothing; only routed groups run no-grad forwards).
    ``reuse_rollout_velocity`` (False): while the policy's ``version`` equals the rollout's, take v_k from
      the rollout instead of running the no-grad forwards; after any optimizer step they are recomputed.
    ``nograd_batch`` (None): latents per no-grad forward; None runs all of an update's in one call.
    ``micro_batch`` (None): latents per forward-with-grad; None uses the batch size, the per-call
      activation memory of ``full``.
    """

    window: int = 5
    alpha: Literal["index", "sigma"] = "index"
    route_frac: float = 1.0
    route_score: Literal["velocity_cosine", "state_cosine"] = "velocity_cosine"
    reuse_rollout_velocity: bool = False
    nograd_batch: int | None = None
    micro_batch: int | None = None

    def validate(self) -> None:
        if self.window < 1:
            raise ConfigError("method.window", self.window, "an integer >= 1")
        if not 0.0 <= self.route_frac <= 1.0:
            raise ConfigError("method.route_frac", self.route_frac, "a number in [0, 1]")
        for key in ("nograd_batch", "micro_batch"):
            value = getattr(self, key)
            if value is not None and value < 1:
                raise ConfigError(f"method.{key}", value, "null or an integer >= 1")


def group_bounds(steps_per_sample: int, window: int) -> list[tuple[int, int]]:
    """[start, stop) entry ranges of the groups: consecutive chunks of ``window`` entries."""
    return [(start, min(start + window, steps_per_sample)) for start in range(0, steps_per_sample, window)]


def interpolation_weights(alpha: str, sigmas: torch.Tensor) -> torch.Tensor:
    """a_k (r, m) for groups whose steps have noise levels ``sigmas`` (r, m), m >= 2."""
    m = sigmas.shape[1]
    if alpha == "index":
        return (torch.arange(m, dtype=sigmas.dtype, device=sigmas.device) / (m - 1)).expand_as(sigmas)
    if alpha == "sigma":
        first, last = sigmas[:, :1], sigmas[:, -1:]
        return (sigmas - first) / (last - first)
    raise ConfigError("method.alpha", alpha, "one of ['index', 'sigma']")


def linearity(sequence: torch.Tensor) -> torch.Tensor:
    """Mean cosine of consecutive increments of ``sequence`` (r, m, ...) along dim 1, m >= 3: (r,).

    1 for points on a straight line traversed in one direction; zero increments count as cosine 0.
    """
    flat = sequence.flatten(2).double()
    inc = flat[:, 1:] - flat[:, :-1]
    return F.cosine_similarity(inc[:, :-1], inc[:, 1:], dim=-1).mean(dim=1)


@dataclass
class _Groups:
    """Groups of r samples at the same entries of ``train_steps`` (CPU index tensors)."""

    rows: torch.Tensor          # (r,)
    steps: torch.Tensor         # (r, m) denoising steps of each sample's group

    @property
    def pairs(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Flat (row, step) pairs, group-major."""
        m = self.steps.shape[1]
        return self.rows.repeat_interleave(m), self.steps.reshape(-1)

    def subset(self, keep: torch.Tensor) -> "_Groups":
        return _Groups(self.rows[keep], self.steps[keep])


@dataclass
class _IterationLog:
    """What the estimator did since the last :meth:`AGGEstimator.iteration_metrics`."""

    groups: int = 0
    routed: int = 0
    reused_updates: int = 0
    scores: list = field(default_factory=list)


@register_method
class AGGEstimator(Estimator):
    """Two endpoint backwards per routed group of W trained steps; exact backward elsewhere."""

    name = "agg"
    config_cls = AGGConfig

    def __init__(self, config: AGGConfig | None = None):
        super().__init__(config)
        self._log = _IterationLog()
        # per update, for inspection: scores (B, groups of >= 3 steps) and which groups were routed
        self.last_scores: torch.Tensor | None = None
        self.last_routed: torch.Tensor | None = None

    def check_run(self, cfg) -> None:
        n = steps_per_sample(cfg.train.plan, cfg.sampling.steps, cfg.train.timestep_fraction,
                             cfg.train.plan_window)
        if self.config.window > n:
            raise ConfigError("method.window", self.config.window,
                              f"at most the {n} trained steps per sample (train.plan={cfg.train.plan}, "
                              f"train.timestep_fraction={cfg.train.timestep_fraction}, "
                              f"sampling.steps={cfg.sampling.steps})")

    # ----- velocities ------------------------------------------------------------------------
    def can_reuse(self, policy: Policy, batch: TrainBatch) -> bool:
        """True when the rollout's velocities are the current parameters' (no optimizer step since)."""
        return (self.config.reuse_rollout_velocity and batch.velocities is not None
                and policy.version == batch.policy_version)

    def velocities(self, policy: Policy, batch: TrainBatch, rows: torch.Tensor, steps: torch.Tensor,
                   reuse: bool) -> torch.Tensor:
        """v(x_j) for the flat (row, step) pairs, in the latents' dtype: from the rollout when ``reuse``,
        else from no-grad forwards of up to ``nograd_batch`` latents each."""
        rows, steps = rows.to(batch.latents.device), steps.to(batch.latents.device)
        if reuse:
            return batch.velocities[rows, steps].to(batch.latents.dtype)
        chunks = micro_batches(rows.numel(), self.config.nograd_batch) if rows.numel() else []
        out = [batch.latents.new_zeros((0, *batch.latents.shape[2:]))]
        with torch.no_grad():
            for idx in lockstep(policy, batch, chunks, "nograd"):  # a sharded model: as many calls as the others
                r, s = rows[idx], steps[idx]
                out.append(policy.velocity(batch.states(r, s), batch.timestep_values(s), batch.cond[r]))
        return torch.cat(out).to(batch.latents.dtype)

    def _group_velocities(self, policy: Policy, batch: TrainBatch, groups: list[_Groups],
                          reuse: bool) -> list[torch.Tensor]:
        """Velocities (r, m, ...) of every group in ``groups``, computed in as few calls as allowed."""
        if not groups:
            return []
        rows, steps = (torch.cat(t) for t in zip(*(g.pairs for g in groups)))
        flat = self.velocities(policy, batch, rows, steps, reuse)
        sizes = [g.steps.numel() for g in groups]
        return [v.view(*g.steps.shape, *v.shape[1:]) for v, g in zip(flat.split(sizes), groups)]

    # ----- routing ----------------------------------------------------------------------------
    def _scores(self, policy: Policy, batch: TrainBatch, candidates: list[_Groups],
                reuse: bool) -> tuple[torch.Tensor, list[torch.Tensor] | None]:
        """Linearity scores (B, G) on the CPU, and the velocities when scoring needed them."""
        if self.config.route_score == "velocity_cosine":
            velocities = self._group_velocities(policy, batch, candidates, reuse)
            return torch.stack([linearity(v) for v in velocities], dim=1).cpu(), velocities
        device = batch.latents.device
        states = [batch.latents[g.rows[:, None].to(device), g.steps.to(device)] for g in candidates]
        return torch.stack([linearity(x) for x in states], dim=1).cpu(), None

    def _route_shared(self, scores: torch.Tensor) -> torch.Tensor:
        """:meth:`_route` over the scores of every process's samples at once (the single-process batch),
        this process's rows of it: the routed set is the single-process one, whatever the process count."""
        shard = distributed.current()
        if not shard.distributed:
            return self._route(scores)
        everyone = torch.cat(distributed.gather(scores))
        return self._route(everyone)[shard.rows(everyone.shape[0])]

    def _route(self, scores: torch.Tensor) -> torch.Tensor:
        """Mask (B, G) of the route_frac * B * G (rounded half up) highest scores; ties go to earlier groups."""
        total = scores.numel()
        k = total if self.config.route_frac >= 1 else int(math.floor(self.config.route_frac * total + 0.5))
        order = torch.sort(scores.t().reshape(-1), descending=True, stable=True).indices[:k]
        routed = torch.zeros(total, dtype=torch.bool)
        routed[order] = True
        return routed.view(scores.shape[1], scores.shape[0]).t()

    # ----- the estimator ------------------------------------------------------------------------
    def accumulate(self, policy, batch, stats, reference=None):
        cfg = self.config
        b, n = batch.train_steps.shape
        train_steps = batch.train_steps.cpu()
        bounds = group_bounds(n, cfg.window)
        routed = torch.zeros(b, len(bounds), dtype=torch.bool)
        eligible = [i for i, (start, stop) in enumerate(bounds) if stop - start > EXACT_GROUP_MAX]
        reuse = self.can_reuse(policy, batch)
        self._log.groups += b * len(bounds)
        self.last_scores = self.last_routed = None
        if eligible and cfg.route_frac > 0:
            every = torch.arange(b)
            candidates = [_Groups(every, train_steps[:, slice(*bounds[i])]) for i in eligible]
            scores, velocities = self._scores(policy, batch, candidates, reuse)
            chosen = self._route_shared(scores)
            routed[:, eligible] = chosen
            groups = [g.subset(chosen[:, c]) for c, g in enumerate(candidates)]
            if velocities is None:
                velocities = self._group_velocities(policy, batch, groups, reuse)
            else:
                velocities = [v[chosen[:, c].to(v.device)] for c, v in enumerate(velocities)]
            self._aggregate(policy, batch, groups, velocities, stats, reference)
            self.last_scores, self.last_routed = scores, chosen
            self._log.routed += int(chosen.sum())
            self._log.scores.extend(float(x) for x in scores[chosen])
            self._log.reused_updates += int(reuse)
        self._exact(policy, batch, bounds, routed, stats, reference)

    def _aggregate(self, policy: Policy, batch: TrainBatch, groups: list[_Groups],
                   velocities: list[torch.Tensor], stats: UpdateStats, reference: Policy | None) -> None:
        """The AGG rule for routed groups: analytic u_k, weighted sums, two endpoint backwards each."""
        keep = [c for c, g in enumerate(groups) if g.rows.numel()]
        groups, velocities = [groups[c] for c in keep], [velocities[c] for c in keep]
        if not groups:
            # none routed here; a sharded model still joins the passes the other processes make
            if batch.beta > 0 and reference is not None:
                nothing = torch.zeros(0, dtype=torch.long)
                self.velocities(reference, batch, nothing, nothing, reuse=False)
            for _ in lockstep(policy, batch, [], "grad"):
                pass
            return
        device = batch.latents.device
        rows, steps = (torch.cat(t).to(device) for t in zip(*(g.pairs for g in groups)))
        v = torch.cat([vg.flatten(0, 1) for vg in velocities])
        ref_v = None
        if batch.beta > 0 and reference is not None:
            ref_v = self.velocities(reference, batch, rows, steps, reuse=False)
        u, terms = upstream_grad(batch, rows, steps, v, ref_v)  # one call: the SDE step is elementwise
        stats.add(terms, batch.log_probs[rows, steps], batch.loss_scale)

        end_rows, end_steps, end_grads = [], [], []
        for g, ug in zip(groups, u.split([g.steps.numel() for g in groups])):
            ug = ug.view(*g.steps.shape, *ug.shape[1:])
            a = interpolation_weights(self.config.alpha, batch.sigmas[g.steps.to(device)].to(ug.dtype))
            a = a.view(*a.shape, *([1] * (ug.dim() - 2)))
            end_rows += [g.rows, g.rows]
            end_steps += [g.steps[:, 0], g.steps[:, -1]]
            end_grads += [((1 - a) * ug).sum(dim=1), (a * ug).sum(dim=1)]
        end_rows_t = torch.cat(end_rows).to(device)
        end_steps_t = torch.cat(end_steps).to(device)
        end_grads_t = torch.cat(end_grads)
        chunks = micro_batches(end_rows_t.numel(), self.config.micro_batch or batch.batch_size)
        for idx in lockstep(policy, batch, chunks, "grad"):
            r, s = end_rows_t[idx.to(device)], end_steps_t[idx.to(device)]
            out = policy.velocity(batch.states(r, s), batch.timestep_values(s), batch.cond[r])
            out.backward(end_grads_t[idx.to(device)].to(out.dtype))

    def _exact(self, policy: Policy, batch: TrainBatch, bounds: list[tuple[int, int]], routed: torch.Tensor,
               stats: UpdateStats, reference: Policy | None) -> None:
        """Exact per-step backward for every (sample, step) of the groups not routed, in ``full``'s order."""
        device = batch.train_steps.device
        for g, (start, stop) in enumerate(bounds):
            rows = torch.nonzero(~routed[:, g], as_tuple=False).flatten().to(device)
            calls = [(entry, idx) for entry in range(start, stop)
                     for idx in micro_batches(rows.numel(), self.config.micro_batch)] if rows.numel() else []
            for entry, idx in lockstep(policy, batch, calls, "exact", reference):
                r = rows[idx.to(device)]
                exact_backward(policy, batch, r, batch.train_steps[r, entry], stats, reference)

    def iteration_metrics(self) -> dict:
        """Routing record since the last call (one iteration's updates), then starts a new record.

        ``agg_groups``: (sample, group) pairs seen; ``agg_groups_routed``: those trained with AGG;
        ``agg_route_scores`` / ``agg_route_score_mean``: the routed groups' linearity scores;
        ``agg_velocity_reused``: updates that took the velocities from the rollout.
        """
        log, self._log = self._log, _IterationLog()
        mean = sum(log.scores) / len(log.scores) if log.scores else None
        return {"agg_window": self.config.window, "agg_groups": log.groups, "agg_groups_routed": log.routed,
                "agg_route_score_mean": mean, "agg_route_scores": log.scores,
                "agg_velocity_reused": log.reused_updates}
