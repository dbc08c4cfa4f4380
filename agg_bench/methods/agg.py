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
groups through AGG and the rest through exact per-step backward; ``route_frac = 0`` is full GRPO. The
fraction is an epoch's (:meth:`AGGEstimator.epoch`), however the epoch is split into optimizer steps.

The endpoint forwards-with-grad compute v at x_{j_0} and x_{j_{W-1}} anyway; with
``endpoint_velocity: reuse`` those outputs (detached) are the endpoints' v_k, so a group needs only
W - 2 no-grad forwards. The gradient is unchanged: a_0 = 0 and a_{W-1} = 1 exactly, so u_base does
not involve v_{W-1} and u_corr does not involve v_0, and each endpoint's upstream gradient is complete
once its own forward and the interior's no-grad forwards have run.
"""
from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

import torch
import torch.nn.functional as F

from ..config.options import Options, batch_option, option
from ..config.sections import CPS_KINDS
from ..engine.grpo import TrainBatch, UpdateStats, exact_backward, micro_batches, upstream_grad
from ..engine.trained_steps import steps_per_sample
from ..errors import ConfigError
from ..machine import distributed
from ..machine.fsdp import lockstep
from .base import Estimator, register_method

if TYPE_CHECKING:  # annotations only: checking a method's options imports neither the models nor diffusers
    from ..engine.models import Policy

# Groups at most this long are trained exactly: two endpoint backwards are all the steps they have.
EXACT_GROUP_MAX = 2


@dataclass
class AGGConfig(Options):
    """Options of the AGG estimator (config keys ``method.<option>``).

    Every group AGG aggregates must be a run of consecutive denoising steps. A run checks that
    (:meth:`AGGEstimator.check_run`): with ``train.plan: groups``, no group may join two plan groups (W =
    ``train.plan_window`` or a divisor of it) unless every plan group is trained; with ``train.plan: steps``,
    ``train.timestep_fraction`` must train every step. Otherwise a group would interpolate across steps that
    are not adjacent, which the rule does not describe, and the run is refused (``replay`` and ``gradcheck``
    too). W <= 2 and ``route_frac = 0`` aggregate nothing, so they accept any plan.

    ``endpoint_velocity: reuse`` in detail: a_0 = 0 and a_{W-1} = 1, so the first endpoint's upstream gradient
    u_base needs v_0 and the interior, never v_{W-1} (and u_corr the reverse), so each endpoint forward is
    followed by its own backward at once, as with ``recompute``: the same ``micro_batch`` latents per
    forward-with-grad and the same peak of what the network saves (tests/unit/test_agg.py measures both equal). On
    top of it, while an endpoint's graph is alive, its SDE-step and loss tensors (elementwise, one latent's size
    each) are saved for the analytic u: tiny SD3, B = 8, W = 5, 64 px: network peak 2,515,968 B either way, all
    saved tensors 2,524,416 B (reuse) vs 2,515,968 B (+0.3 %). Meanwhile ``reuse`` holds the interior's
    velocities and upstream gradients, W - 2 latents per group without a graph, instead of W.
    """

    window: int = option(5, "W, trained steps per group; groups are consecutive chunks of W entries of "
                            "`train_steps` (the last may be shorter); each must be consecutive denoising steps "
                            "(class docstring)", minimum=1, maximum=1000)
    alpha: Literal["index", "sigma"] = option(
        "index", "interpolation weight of step k in its group: `index` k/(W-1), or `sigma` (s_{j_k} - s_{j_0}) / "
        "(s_{j_{W-1}} - s_{j_0}), exact when the velocity is affine in (x, t) along a straight segment of states")
    route_frac: float = option(
        1.0, "fraction of the groups of 3 or more steps that use AGG, the highest `route_score` first; the others "
        "get exact per-step backward. 0 is full GRPO, 1 routes them all. It is each epoch's, whatever its split "
        "(`train.minibatches`): of an epoch's parts in order, part p routes its highest-scored groups, "
        "round_half_up(route_frac x the candidate groups of parts 1 to p) less those the earlier parts routed, "
        "so the epoch routes round_half_up(route_frac x all its candidates)", minimum=0, maximum=1)
    route_score: Literal["velocity_cosine", "state_cosine"] = option(
        "velocity_cosine", "how linear a group is: `velocity_cosine`, the mean cosine of consecutive velocity "
        "increments v_{k+1} - v_k (needs every group's velocities, so groups left exact also pay their no-grad "
        "forwards unless reused); `state_cosine`, the same on the states x_{j_k} (costs nothing; only routed "
        "groups run no-grad forwards)")
    reuse_rollout_velocity: bool = option(
        False, "while the policy's version equals the rollout's, take v_k from the rollout instead of running the "
        "no-grad forwards; after any optimizer step they are recomputed")
    endpoint_velocity: Literal["recompute", "reuse"] = option(
        "recompute", "where a routed group's v at its first and last step come from: `recompute` (the authors' "
        "recipe), W no-grad forwards per group, then the two endpoint forwards-with-grad compute those two "
        "again; `reuse`, the endpoint forwards-with-grad run first and their detached outputs are the endpoints' "
        "v, so only the W - 2 interior steps get no-grad forwards: the same gradient (up to float rounding of "
        "differently batched calls) and the same saved-activation peak (class docstring). While "
        "`reuse_rollout_velocity` applies both do the same; `route_frac` < 1 with `route_score: "
        "velocity_cosine` needs every v first and is refused with `reuse`")
    nograd_batch: int | None = batch_option("latents per no-grad forward; null runs all of an update's in one call")
    micro_batch: int | None = batch_option("latents per forward-with-grad; null uses the batch size, the per-call "
                                           "activation memory of `full`")

    def check(self) -> None:
        if self.endpoint_velocity == "reuse" and self.route_frac < 1 and self.route_score == "velocity_cosine":
            raise ConfigError("method.endpoint_velocity", self.endpoint_velocity,
                              "'recompute' when method.route_frac < 1 with method.route_score=velocity_cosine "
                              "(scoring needs every step's velocity before an endpoint forward runs; "
                              "route_score=state_cosine scores from the states)")


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
class _RouteCarry:
    """An epoch's routing so far: the candidate groups its earlier parts scored (every process's) and how many of
    them they routed."""

    candidates: int = 0
    routed: int = 0


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
    config: AGGConfig

    def __init__(self, config: AGGConfig | None = None):
        super().__init__(config)
        self._log = _IterationLog()
        # per update, for inspection: scores (B, groups of >= 3 steps) and which groups were routed
        self.last_scores: torch.Tensor | None = None
        self.last_routed: torch.Tensor | None = None
        self._carry: _RouteCarry | None = None  # inside an epoch: what its earlier parts routed

    @contextlib.contextmanager
    def epoch(self) -> Iterator[None]:
        """An epoch's parts route together (:meth:`_quota`); the carry starts with the epoch and ends with it, so
        nothing outlives an update (a resumed run routes as an uninterrupted one, with nothing checkpointed)."""
        self._carry = _RouteCarry()
        try:
            yield
        finally:
            self._carry = None

    def check_train_steps(self, train_steps):
        """Every group AGG may aggregate (more than two entries, route_frac > 0) a run of consecutive denoising
        steps in every row: a frozen rollout of another method (GUESS's, DGPO's) may train steps that are not."""
        if self.config.route_frac == 0:
            return None
        steps = train_steps.cpu()
        for start, stop in group_bounds(steps.shape[1], self.config.window):
            if stop - start <= EXACT_GROUP_MAX:
                continue
            chunk = steps[:, start:stop]
            apart = ((chunk[:, 1:] - chunk[:, :-1]) != 1).any(dim=1).nonzero()
            if len(apart):
                row = int(apart[0])
                return (f"its group of entries {start} to {stop - 1} holds steps {chunk[row].tolist()} in row {row}: "
                        "AGG aggregates consecutive denoising steps only")
        return None

    def check_run(self, cfg) -> None:
        """W <= N, and the groups AGG aggregates are runs of consecutive steps (:class:`AGGConfig`)."""
        train, window, steps = cfg.train, self.config.window, cfg.sampling.steps
        # the steps a plan draws from: all but the last with train.ignore_last or a cps SDE (its step into
        # sigma 0 has no density); whole, they are 0 .. drawable - 1, so any chunk of them is consecutive
        without_last = train.ignore_last or cfg.sampling.sde in CPS_KINDS
        drawable = steps - without_last
        n = steps_per_sample(train.plan, drawable, train.timestep_fraction, train.plan_window)
        if window > n:
            raise ConfigError("method.window", window,
                              f"at most the {n} trained steps per sample (train.plan={train.plan}, "
                              f"train.timestep_fraction={train.timestep_fraction}, "
                              f"sampling.steps={steps}"
                              f"{', train.ignore_last=true' if train.ignore_last else ''}"
                              f"{f', sampling.sde={cfg.sampling.sde}' if cfg.sampling.sde in CPS_KINDS else ''})")
        if window <= EXACT_GROUP_MAX or self.config.route_frac == 0:
            return  # every group is trained exactly: adjacency does not matter
        if train.plan == "groups":
            plan_window = train.plan_window
            every_group = n == (drawable // plan_window) * plan_window  # the trained steps are 0 .. n-1
            straddling = [(start, stop) for start, stop in group_bounds(n, window)
                          if stop - start > EXACT_GROUP_MAX and start // plan_window != (stop - 1) // plan_window]
            if straddling and not every_group:
                raise ConfigError("method.window", window,
                                  f"train.plan_window = {plan_window} or a divisor of it, with train.plan=groups "
                                  f"and train.timestep_fraction={train.timestep_fraction} (the AGG group of "
                                  f"entries {list(range(*straddling[0]))} would join steps of two plan groups, "
                                  "which need not be adjacent)")
        elif n < drawable:
            raise ConfigError("train.timestep_fraction", train.timestep_fraction,
                              f"1.0 for method 'agg' with train.plan={train.plan} (a random subset of steps "
                              "puts steps that are not adjacent into one group); train a fraction of whole "
                              "groups with train.plan=groups and train.plan_window=method.window")

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
            assert batch.velocities is not None  # reuse is can_reuse's answer, which checked them
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

    def _quota(self, candidates: int) -> int:
        """How many of a part's ``candidates`` groups to route: round_half_up(route_frac x the epoch's candidates
        so far, these included) less what its earlier parts routed. A part alone (one part per epoch, or a call
        outside :meth:`epoch`) routes round_half_up(route_frac x ``candidates``)."""
        carry = _RouteCarry() if self._carry is None else self._carry
        frac, seen = self.config.route_frac, carry.candidates + candidates
        due = seen if frac >= 1 else int(math.floor(frac * seen + 0.5))
        k = min(candidates, max(0, due - carry.routed))  # within [0, candidates] exactly; the bounds guard rounding
        carry.candidates, carry.routed = seen, carry.routed + k
        return k

    def _route(self, scores: torch.Tensor) -> torch.Tensor:
        """Mask (B, G) of the part's :meth:`_quota` of B * G candidates, the highest scores; ties go to earlier
        groups."""
        total = scores.numel()
        k = self._quota(total)
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
        # with the rollout's velocities there is no endpoint no-grad forward left to save
        endpoints_from_grad = cfg.endpoint_velocity == "reuse" and not reuse
        self._log.groups += b * len(bounds)
        self.last_scores = self.last_routed = None
        if eligible and cfg.route_frac > 0:
            every = torch.arange(b)
            candidates = [_Groups(every, train_steps[:, slice(*bounds[i])]) for i in eligible]
            if endpoints_from_grad and cfg.route_score == "velocity_cosine":
                # AGGConfig.validate: route_frac is 1 here, so every group is routed; the scores (for the
                # record) follow from the velocities the update computes anyway
                scores, velocities = None, None
                chosen = torch.ones(b, len(candidates), dtype=torch.bool)
            else:
                scores, velocities = self._scores(policy, batch, candidates, reuse)
                chosen = self._route_shared(scores)
            routed[:, eligible] = chosen
            groups = [g.subset(chosen[:, c]) for c, g in enumerate(candidates)]
            if endpoints_from_grad:
                velocities = None
            elif velocities is None:
                velocities = self._group_velocities(policy, batch, groups, reuse)
            else:
                velocities = [v[chosen[:, c].to(v.device)] for c, v in enumerate(velocities)]
            velocities = self._aggregate(policy, batch, groups, velocities, stats, reference)
            if scores is None:
                scores = torch.stack([linearity(v) for v in velocities], dim=1).cpu()
            self.last_scores, self.last_routed = scores, chosen
            self._log.routed += int(chosen.sum())
            self._log.scores.extend(float(x) for x in scores[chosen])
            self._log.reused_updates += int(reuse)
        self._exact(policy, batch, bounds, routed, stats, reference)

    def _aggregate(self, policy: Policy, batch: TrainBatch, groups: list[_Groups],
                   velocities: list[torch.Tensor] | None, stats: UpdateStats,
                   reference: Policy | None) -> list[torch.Tensor]:
        """The AGG rule for routed groups: analytic u_k, weighted sums, two endpoint backwards each.

        ``velocities``: each group's v (r, m, ...); None takes the endpoints' v from the endpoint
        forwards-with-grad and runs no-grad forwards for the interior steps only. Returns the velocities
        (r, m, ...) of the groups that have rows."""
        groups = [g for g in groups if g.rows.numel()]
        if velocities is not None:
            velocities = [v for v in velocities if v.shape[0]]
        if not groups:
            # none routed here; a sharded model still joins the passes the other processes make
            nothing = torch.zeros(0, dtype=torch.long)
            if batch.beta > 0 and reference is not None:
                self.velocities(reference, batch, nothing, nothing, reuse=False)
            if velocities is None:  # the interior's no-grad forwards
                self.velocities(policy, batch, nothing, nothing, reuse=False)
            self._endpoint_backwards(policy, batch, None, None, None, None, None, stats)
            return []
        device = batch.latents.device
        shapes = [g.steps.shape for g in groups]
        ref_v = None
        if batch.beta > 0 and reference is not None:
            rows, steps = (torch.cat(t) for t in zip(*(g.pairs for g in groups)))
            ref_flat = self.velocities(reference, batch, rows, steps, reuse=False)
            ref_v = [r.view(*shape, *r.shape[1:]) for r, shape in zip(ref_flat.split([s.numel() for s in shapes]), shapes)]
        weights = [interpolation_weights(self.config.alpha, batch.sigmas[g.steps.to(device)].to(batch.latents.dtype))
                   for g in groups]
        if velocities is not None:
            # every v known: the endpoint backwards take the whole weighted sums
            sum_groups, sum_v, sum_ref, sum_w = groups, velocities, ref_v, weights
            own_weights = own_ref = None
        else:
            # a_0 = 0 and a_{m-1} = 1 exactly (both weightings), so u_base = sum (1 - a_k) u_k never needs the
            # last step's v, and u_corr = sum a_k u_k never the first's: the interior's part of each sum is
            # known before the endpoint forwards, and each endpoint adds its own term from its own output
            inner = slice(1, -1)
            sum_groups = [_Groups(g.rows, g.steps[:, inner]) for g in groups]
            sum_v = self._group_velocities(policy, batch, sum_groups, reuse=False)
            sum_ref = None if ref_v is None else [r[:, inner] for r in ref_v]
            sum_w = [a[:, inner] for a in weights]
            own_weights = torch.cat([torch.cat([1 - a[:, 0], a[:, -1]]) for a in weights])
            own_ref = None if ref_v is None else torch.cat([torch.cat([r[:, 0], r[:, -1]]) for r in ref_v])
        sum_u = self._upstream(batch, sum_groups, sum_v, sum_ref, stats)

        end_rows, end_steps, end_grads = [], [], []
        for g, ug, a in zip(groups, sum_u, sum_w):
            a = a.to(ug.dtype).view(*a.shape, *([1] * (ug.dim() - 2)))
            end_rows += [g.rows, g.rows]
            end_steps += [g.steps[:, 0], g.steps[:, -1]]
            end_grads += [((1 - a) * ug).sum(dim=1), (a * ug).sum(dim=1)]
        rows, steps = torch.cat(end_rows).to(device), torch.cat(end_steps).to(device)
        grads = torch.cat(end_grads)
        end_v = self._endpoint_backwards(policy, batch, rows, steps, grads, own_weights, own_ref, stats)
        if velocities is not None:
            return velocities
        # every group's velocities in step order, from its two endpoints and its interior
        assert end_v is not None  # with own_weights the endpoint backwards return their velocities
        out, start = [], 0
        for g, vg in zip(groups, sum_v):
            r = g.rows.numel()
            first, last = end_v[start: start + r], end_v[start + r: start + 2 * r]
            out.append(torch.cat([first[:, None], vg, last[:, None]], dim=1))
            start += 2 * r
        return out

    def _upstream(self, batch: TrainBatch, groups: list[_Groups], velocities: list[torch.Tensor],
                  ref_v: list[torch.Tensor] | None, stats: UpdateStats) -> list[torch.Tensor]:
        """u_k (r, m, ...) of every (sample, step) of ``groups`` given their velocities, in one call (the
        SDE step is elementwise); their terms enter ``stats``."""
        device = batch.latents.device
        rows, steps = (torch.cat(t).to(device) for t in zip(*(g.pairs for g in groups)))
        v = torch.cat([vg.flatten(0, 1) for vg in velocities])
        ref = None if ref_v is None else torch.cat([r.flatten(0, 1) for r in ref_v])
        u, terms = upstream_grad(batch, rows, steps, v, ref)
        stats.add(terms, batch.log_probs[rows, steps], batch.loss_scale)
        return [ug.view(*g.steps.shape, *ug.shape[1:]) for g, ug in zip(groups, u.split([g.steps.numel() for g in groups]))]

    def _endpoint_backwards(self, policy: Policy, batch: TrainBatch, rows: torch.Tensor | None,
                            steps: torch.Tensor | None, grads: torch.Tensor | None, own_weights: torch.Tensor | None, own_ref: torch.Tensor | None,
                            stats: UpdateStats) -> torch.Tensor | None:
        """A forward-with-grad at each endpoint (``rows``, ``steps``) and a backward of ``grads`` through it,
        ``micro_batch`` latents per call. With ``own_weights``, each endpoint's own term is added:
        ``own_weights`` x its u, from the forward's detached output (and ``own_ref``, the reference's v);
        those outputs are returned."""
        if rows is None or steps is None or grads is None:
            # none here; a sharded model still makes as many calls as the other processes
            list(lockstep(policy, batch, [], "grad"))
            return None
        outputs = []
        chunks = micro_batches(rows.numel(), self.config.micro_batch or batch.batch_size)
        for idx in lockstep(policy, batch, chunks, "grad"):
            idx = idx.to(rows.device)
            r, s = rows[idx], steps[idx]
            out = policy.velocity(batch.states(r, s), batch.timestep_values(s), batch.cond[r])
            grad = grads[idx]
            if own_weights is not None:
                v = out.detach().to(batch.latents.dtype)
                u, terms = upstream_grad(batch, r, s, v, None if own_ref is None else own_ref[idx])
                stats.add(terms, batch.log_probs[r, s], batch.loss_scale)
                grad = grad + own_weights[idx].view(-1, *([1] * (u.dim() - 1))) * u
                outputs.append(v)
            out.backward(grad.to(out.dtype))
        return torch.cat(outputs) if outputs else None

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
        ``agg_velocity_reused``: gradients (one per optimizer step: per mini-batch and epoch) that took the
        velocities from the rollout.
        """
        log, self._log = self._log, _IterationLog()
        mean = sum(log.scores) / len(log.scores) if log.scores else None
        return {"agg_window": self.config.window, "agg_groups": log.groups, "agg_groups_routed": log.routed,
                "agg_route_score_mean": mean, "agg_route_scores": log.scores,
                "agg_velocity_reused": log.reused_updates}
