"""The AGG estimator: exactness where the rule is exact, pass counts, rollout-velocity reuse, routing,
the reference preset's backward ratio, and `replay --method agg` against an independent computation."""
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from agg_bench.config import load_config
from agg_bench.runtime.config_check import check_config
from agg_bench.engine.grpo import TrainBatch, UpdateStats, micro_batches
from agg_bench.engine.models import Conditioning, Policy
from agg_bench.engine.sampler import flow_sigmas, sde_step
from agg_bench.errors import ConfigError
from agg_bench.machine.telemetry import Telemetry
from agg_bench.methods.agg import group_bounds
from agg_bench.methods.base import build_estimator, build_method
from agg_bench.runtime.train import Session
from agg_bench.tools.snapshot import replay, save_snapshot
from helpers import (counted, fresh_seed, gaussian_log_prob, linearity_reference, move_off_policy, relative_error,
                     sde_reference, seeded, tiny_config)

ROOT = Path(__file__).resolve().parents[2]
PRESET = ROOT / "config/presets/tiny_sd3_reference_cpu.yaml"


def gradient(estimator, policy, batch, reference=None):
    """(estimator's d L / d theta, pass counts, update stats) on ``batch``; leaves .grad cleared."""
    for p in policy.parameters():
        p.grad = None
    stats = UpdateStats(batch.clip_range)
    with counted(policy) as passes:
        estimator.accumulate(policy, batch, stats, reference)
    grads = {n: p.grad.detach().clone() for n, p in policy.named_parameters()}
    for p in policy.parameters():
        p.grad = None
    return grads, passes.as_dict(), stats


def agg(**options):
    return build_method("agg", options)


# ----- a velocity model affine in (x, t) on states along a straight line ---------------------------
class AffineVelocity(torch.nn.Module):
    """v = A x + t w + c, with x flattened: affine in (x, t), so J(x, t)^T u is linear in (x, t)."""

    def __init__(self, dim: int, generator: torch.Generator):
        super().__init__()
        self.linear = torch.nn.Linear(dim, dim, dtype=torch.float64)
        with torch.no_grad():
            self.linear.weight.copy_(0.3 * torch.randn(dim, dim, generator=generator, dtype=torch.float64))
            self.linear.bias.copy_(torch.randn(dim, generator=generator, dtype=torch.float64))
        self.time_weight = torch.nn.Parameter(1e-3 * torch.randn(dim, generator=generator, dtype=torch.float64))

    def forward(self, x, t):
        return (self.linear(x.flatten(1)) + t[:, None] * self.time_weight).view_as(x)


class AffinePolicy(Policy):
    family = "affine"

    def _forward(self, latents, timesteps, cond):
        return self.transformer(latents, timesteps)


def collinear_batch(policy: Policy, generator: torch.Generator, sde: str, beta: float = 0.0,
                    batch_size: int = 3, steps: int = 8, shape=(2, 2, 2)) -> TrainBatch:
    """Latents x_j = p + s_j q (a straight line parametrised by sigma), old log-probs near the
    policy's so that ratios differ from 1 and half of them are clipped."""
    sigmas = flow_sigmas(steps, 3.0)
    p = torch.randn(batch_size, *shape, generator=generator, dtype=torch.float64)
    q = torch.randn(batch_size, *shape, generator=generator, dtype=torch.float64)
    latents = p[:, None] + sigmas[None, :, None, None, None] * q[:, None]
    timesteps = sigmas[:-1] * 1000
    log_probs = torch.zeros(batch_size, steps, dtype=torch.float64)
    cond = Conditioning(torch.zeros(batch_size, 1, 4, dtype=torch.float64))
    with torch.no_grad():
        for j in range(steps):
            v = policy.velocity(latents[:, j], timesteps[j].expand(batch_size), cond)
            log_probs[:, j] = sde_step(sde, v, latents[:, j], sigmas, j, 0.7, prev_sample=latents[:, j + 1]).log_prob
    # the new log-prob minus the old is minus this shift: every other term is moved by 0.025 or more (its ratio
    # leaves the clip range 0.02 on any draw), the rest by less than 0.01 (inside it)
    z = torch.randn(batch_size, steps, generator=generator, dtype=torch.float64)
    outside = (torch.arange(batch_size * steps).reshape(batch_size, steps) % 2).bool()
    log_probs += torch.where(outside, 0.05 * z.sign() * (0.5 + z.abs()), 0.01 * torch.tanh(z))
    return TrainBatch(
        latents=latents, log_probs=log_probs, sigmas=sigmas, timesteps=timesteps,
        advantages=torch.randn(batch_size, generator=generator, dtype=torch.float64).float(),
        train_steps=torch.arange(steps).expand(batch_size, steps).contiguous(),
        cond=cond, sde=sde, eta=0.7, clip_range=0.02, beta=beta,
    )


def affine_policy(generator, shape=(2, 2, 2)) -> AffinePolicy:
    return AffinePolicy(AffineVelocity(math.prod(shape), generator), None, shape[0])


@pytest.mark.parametrize("sde", ["flow_grpo", "dance_grpo"])
@pytest.mark.parametrize("beta", [0.0, 0.3])
def test_sigma_weights_are_exact_for_an_affine_velocity_on_collinear_states(sde, beta):
    gen = torch.Generator().manual_seed(fresh_seed())
    policy = affine_policy(gen)
    reference = None
    if beta > 0:  # a reference policy that differs from the policy, so the KL term has a gradient
        reference = affine_policy(gen)
        reference.counter = policy.counter
    batch = collinear_batch(policy, gen, sde, beta)
    full, _, stats = gradient(build_method("full"), policy, batch, reference)
    assert stats.clipped == stats.count // 2  # the clip is active for half the terms (collinear_batch)
    for window in (3, 4, 5, 8):
        approx, counts, _ = gradient(agg(window=window, alpha="sigma"), policy, batch, reference)
        assert relative_error(approx, full) <= 1e-10, window
        assert counts["backward"] < batch.batch_size * batch.steps_per_sample
    # index weights interpolate at the wrong points on a shifted schedule: the test can tell them apart
    approx, _, _ = gradient(agg(window=5, alpha="index"), policy, batch, reference)
    assert relative_error(approx, full) > 1e-6


@pytest.mark.parametrize("steps, window, sizes", [(8, 8, [8]), (7, 3, [3, 3, 1]), (8, 3, [3, 3, 2]), (6, 4, [4, 2])])
@pytest.mark.parametrize("reuse", [False, True])
def test_pass_counts_per_group(steps, window, sizes, reuse):
    """A group of W >= 3 costs W no-grad forwards (0 reused), 2 forwards-with-grad and 2 backwards per
    sample; groups of 1 or 2 steps cost one forward-with-grad and one backward per step."""
    gen = torch.Generator().manual_seed(seeded(5))
    policy = affine_policy(gen)
    batch = collinear_batch(policy, gen, "flow_grpo", steps=steps)
    with torch.no_grad():
        batch.velocities = torch.stack([policy.velocity(batch.latents[:, j], batch.timesteps[j].expand(3),
                                                        batch.cond) for j in range(steps)], 1)
    assert [b - a for a, b in group_bounds(steps, window)] == sizes
    _, counts, stats = gradient(agg(window=window, reuse_rollout_velocity=reuse), policy, batch)
    b = batch.batch_size
    big = [m for m in sizes if m >= 3]
    small = [m for m in sizes if m < 3]
    assert counts == {"forward_nograd": 0 if reuse else b * sum(big),
                      "forward_grad": b * (2 * len(big) + sum(small)),
                      "backward": b * (2 * len(big) + sum(small))}
    assert stats.count == b * steps  # every (sample, step) term enters the ratio statistics once


def test_short_windows_and_route_frac_zero_equal_full():
    session = Session(tiny_config("train.timestep_fraction=0.7", "grpo.beta=0.05"))
    batch = session.collect(0).batch
    move_off_policy(session.policy)
    full, full_counts, full_stats = gradient(build_method("full"), session.policy, batch, session.reference)
    for options in (dict(window=1), dict(window=2), dict(window=2, alpha="sigma"),
                    dict(window=3, route_frac=0.0), dict(window=8, route_frac=0.0, reuse_rollout_velocity=True),
                    dict(window=3, route_frac=0.01, route_score="state_cosine")):  # rounds to no group
        grads, counts, stats = gradient(agg(**options), session.policy, batch, session.reference)
        assert relative_error(grads, full) <= 1e-10, options
        assert counts == full_counts, options
        assert stats.as_dict() == pytest.approx(full_stats.as_dict(), rel=1e-12), options


def test_reuse_gives_the_recomputed_gradient_and_stops_after_an_optimizer_step():
    cfg = tiny_config("method.name=agg", "method.window=3", "method.reuse_rollout_velocity=true",
                      "train.plan=groups", "train.plan_window=3", "train.inner_epochs=2")
    session = Session(cfg)
    batch = session.collect(0).batch
    policy = session.policy
    b, n = batch.train_steps.shape
    assert policy.version == batch.policy_version
    reused, reused_counts, reused_stats = gradient(session.estimator, policy, batch)
    recomputed, counts, stats = gradient(agg(window=3), policy, batch)
    assert reused_counts["forward_nograd"] == 0 and counts["forward_nograd"] == b * n
    # the same numbers up to the summation order of differently batched transformer calls (float64)
    assert relative_error(reused, recomputed) <= 1e-12
    # both ratios are 1 up to rounding: the reused velocities are the rollout's own, the recomputed ones come
    # from a differently batched forward and differ in the last bits (float64: |ratio - 1| ~ 1e-16); the
    # two paths are not compared with each other, each is bounded by float64 rounding (1e-12 ~ 4500 ulp)
    assert reused_stats.ratio_dev <= 1e-12 and stats.ratio_dev <= 1e-12
    session.estimator.iteration_metrics()  # start a fresh record for the update below

    with counted(policy) as spent:
        session.update(batch)  # two optimizer steps on one rollout
    groups = b * n // 3
    # reuse in the first update only: after the first optimizer step the rollout's velocities are stale
    assert spent.as_dict() == {"forward_nograd": b * n, "forward_grad": 2 * 2 * groups, "backward": 2 * 2 * groups}
    assert policy.version == batch.policy_version + 2
    assert not session.estimator.can_reuse(policy, batch)
    metrics = session.estimator.iteration_metrics()
    assert metrics["agg_velocity_reused"] == 1
    assert metrics["agg_groups"] == metrics["agg_groups_routed"] == 2 * groups
    assert session.estimator.iteration_metrics()["agg_groups"] == 0  # each record covers one iteration


# ----- endpoint_velocity: reuse ----------------------------------------------------------------------
@pytest.mark.parametrize("options, overrides", [
    (dict(window=5, alpha="sigma"), ("train.plan=groups", "train.plan_window=5", "sampling.steps=10")),
    (dict(window=3, alpha="index", route_frac=0.5, route_score="state_cosine"),
     ("train.plan=groups", "train.plan_window=3", "grpo.beta=0.05")),
    (dict(window=4, alpha="sigma", micro_batch=4), ("train.plan=steps",)),  # groups of 4 and 2 steps
])
def test_endpoint_reuse_gives_the_recomputed_gradient_with_two_fewer_nograd_forwards(options, overrides):
    session = Session(tiny_config(*overrides))
    batch = session.collect(0).batch
    seed = fresh_seed()  # fresh parameters off the rollout's, so ratios differ from 1
    move_off_policy(session.policy)
    policy, reference = session.policy, session.reference
    recompute = agg(**options)
    reuse = agg(**options, endpoint_velocity="reuse")
    expected, counts, stats = gradient(recompute, policy, batch, reference)
    got, reuse_counts, reuse_stats = gradient(reuse, policy, batch, reference)
    # the same sums; the endpoints' v come from differently batched calls (float64 rounding)
    assert relative_error(got, expected) <= 1e-12, seed
    routed = int(recompute.last_routed.sum())
    assert routed > 0 and torch.equal(reuse.last_routed, recompute.last_routed)
    assert reuse.last_scores == pytest.approx(recompute.last_scores, abs=1e-10)
    # W - 2 no-grad forwards per routed group instead of W; the rest of the work is the same
    assert reuse_counts == {**counts, "forward_nograd": counts["forward_nograd"] - 2 * routed}
    if batch.beta == 0 and options.get("route_score") != "state_cosine":
        assert reuse_counts["forward_nograd"] == routed * (options["window"] - 2)
    assert reuse_stats.count == stats.count == batch.batch_size * batch.steps_per_sample
    # continuous statistics agree to rounding (clip_frac counts a threshold crossing: not compared)
    for key in ("loss", "approx_kl", "ratio_dev"):
        assert reuse_stats.as_dict()[key] == pytest.approx(stats.as_dict()[key], rel=1e-9, abs=1e-300), key


def test_endpoint_reuse_is_moot_while_rollout_velocities_apply():
    """The first update takes every v from the rollout (no no-grad forward either way); after an optimizer
    step the rollout's v are stale and the endpoints come from the forwards-with-grad."""
    cfg = tiny_config("method.name=agg", "method.window=3", "method.reuse_rollout_velocity=true",
                      "method.endpoint_velocity=reuse", "train.plan=groups", "train.plan_window=3",
                      "train.inner_epochs=2")
    session = Session(cfg)
    batch = session.collect(0).batch
    policy = session.policy
    b, n = batch.train_steps.shape
    groups = b * n // 3
    both, both_counts, _ = gradient(session.estimator, policy, batch)
    rollout_only, rollout_counts, _ = gradient(agg(window=3, reuse_rollout_velocity=True), policy, batch)
    assert both_counts == rollout_counts == {"forward_nograd": 0, "forward_grad": 2 * groups, "backward": 2 * groups}
    assert relative_error(both, rollout_only) == 0.0  # the same computation: identical by construction

    with counted(policy) as passes:
        session.update(batch)  # two optimizer steps: the rollout's v, then W - 2 = 1 no-grad forward per group
    assert passes.as_dict() == {"forward_nograd": groups, "forward_grad": 2 * 2 * groups, "backward": 2 * 2 * groups}


def test_endpoint_reuse_keeps_the_saved_activation_peak():
    """Each endpoint's backward runs right after its own forward, so the policy network never holds more
    than one forward-with-grad of ``micro_batch`` latents: the peak equals recompute's."""
    peaks = {}
    for mode in ("recompute", "reuse"):
        cfg = tiny_config("sampling.steps=5", "train.plan=groups", "train.plan_window=5", "method.name=agg",
                          "method.window=5", f"method.endpoint_velocity={mode}", dtype="float32")
        session = Session(cfg)
        batch = session.collect(0).batch
        with Telemetry(session.device) as telemetry:
            with telemetry.iteration():
                with telemetry.phase("train", saved_activations="regions"):
                    session.update(batch)
            peaks[mode] = telemetry.record()["saved_activation_peak_bytes"]
    assert peaks["reuse"] == peaks["recompute"] > 0


@pytest.mark.parametrize("route_score", ["velocity_cosine", "state_cosine"])
def test_routing_sends_the_most_linear_groups_through_agg(route_score):
    session = Session(tiny_config("train.plan=groups", "train.plan_window=3"))
    batch = session.collect(0).batch
    b, n = batch.train_steps.shape
    # 6 rows x 2 groups, 5 of them routed: 5 is no multiple of 6, so some group leaves 0 < m < 6 rows exact
    # whatever the scores (with 6 routed, a draw could route one whole group and no small call would be made)
    estimator = agg(window=3, route_frac=0.4, route_score=route_score)
    _, counts, _ = gradient(estimator, session.policy, batch)
    scores, routed = estimator.last_scores, estimator.last_routed
    assert scores.shape == routed.shape == (b, n // 3)
    source = batch.velocities if route_score == "velocity_cosine" else batch.latents
    for i in range(b):
        for g in range(n // 3):
            seq = source[i, batch.train_steps[i, 3 * g: 3 * g + 3]].flatten(1)
            assert float(scores[i, g]) == pytest.approx(linearity_reference(seq), abs=1e-10)
    k = round(0.4 * scores.numel())
    assert int(routed.sum()) == k
    assert float(scores[routed].min()) >= float(scores[~routed].max())
    exact = scores.numel() - k
    # velocity_cosine scores every group from no-grad forwards; state_cosine only the routed ones
    nograd = scores.numel() * 3 if route_score == "velocity_cosine" else k * 3
    assert counts == {"forward_nograd": nograd, "forward_grad": 2 * k + 3 * exact, "backward": 2 * k + 3 * exact}
    metrics = estimator.iteration_metrics()
    assert metrics["agg_groups_routed"] == k and metrics["agg_groups"] == scores.numel()
    assert metrics["agg_route_scores"] == pytest.approx(scores[routed].tolist())
    assert metrics["agg_route_score_mean"] == pytest.approx(float(scores[routed].mean()))


@pytest.mark.parametrize("route_score", ["velocity_cosine", "state_cosine"])
def test_routing_counts_the_calls_it_makes(route_score):
    """Routing trains the groups it leaves exact one step at a time on the rows left in each group: calls of
    fewer latents than the batch, which the cost model prices per call. The counter's calls and latents are
    those the transformer saw (observed around it), and they follow from the routed mask."""
    session = Session(tiny_config())
    batch = session.collect(0).batch
    policy, (b, n) = session.policy, batch.train_steps.shape
    seen = {"forward_nograd": [], "forward_grad": [], "backward": []}
    forward = policy._forward

    def observed(latents, timesteps, cond):
        out = forward(latents, timesteps, cond)
        if out.requires_grad:
            seen["forward_grad"].append(len(latents))
            out.register_hook(lambda grad: seen["backward"].append(len(grad)))
        else:
            seen["forward_nograd"].append(len(latents))
        return out

    policy._forward = observed
    # 6 rows x 2 groups, 5 of them routed: 5 is no multiple of 6, so some group leaves 0 < m < 6 rows exact
    # whatever the scores (with 6 routed, a draw could route one whole group and no small call would be made)
    estimator = agg(window=3, route_frac=0.4, route_score=route_score)
    with counted(policy) as work:
        gradient(estimator, policy, batch)
    assert work.calls() == {kind: len(sizes) for kind, sizes in seen.items()}
    assert work.as_dict() == {kind: sum(sizes) for kind, sizes in seen.items()}
    routed = estimator.last_routed
    k, left = int(routed.sum()), (~routed).sum(dim=0).tolist()  # rows each group leaves exact
    assert (b, routed.shape[1], k) == (6, 2, 5) and any(0 < m < b for m in left)  # some exact calls are small
    # the endpoint backwards in calls of the batch's size, then each group's steps on its rows left exact
    calls = [len(idx) for idx in micro_batches(2 * k, b)] + [m for m in left if m for _ in range(3)]
    assert seen["forward_grad"] == seen["backward"] == calls
    # velocity_cosine scores every group from one no-grad call; state_cosine recomputes the routed ones'
    assert seen["forward_nograd"] == [b * n if route_score == "velocity_cosine" else 3 * k]


# ----- routing over an update's parts: the fraction is the update's, whatever the split ----------------------
def routed_per_part(session, batch) -> tuple[list[int], dict, dict]:
    """One ``session.update(batch)``: the groups routed by each part's gradient in order, the pass counts and the
    iteration record's routing fields."""
    estimator, per_part = session.estimator, []
    accumulate = estimator.accumulate

    def recorded(*args, **kwargs):
        accumulate(*args, **kwargs)
        per_part.append(int(estimator.last_routed.sum()))

    estimator.accumulate = recorded
    with counted(session.policy) as passes:
        session.update(batch)
    return per_part, passes.as_dict(), estimator.iteration_metrics()


# (prompts, group size, mini-batches, unit, W, route_frac, inner epochs): the groups each part routes, written
# out by hand from round_half_up(route_frac x the epoch's candidates so far) less what the earlier parts routed,
# and the update's backwards (2 per routed group, one per step of the others). 6 trained steps per sample.
ROUTE_SPLITS = {
    # one sample, one group per slice: 0.5 x 1, 2, 3 candidates -> 1, 1, 2 routed so far
    "slices, one candidate each": ((1, 3, 3, "slices", 6, 0.5, 1), [1, 0, 1], 2 * 2 + 1 * 6),
    # 6 candidates per mini-batch: 0.25 x 6, 12 -> 2, 3
    "groups": ((2, 3, 2, "groups", 3, 0.25, 1), [2, 1], 3 * 2 + 9 * 3),
    # 2 candidates per slice: 0.4 x 2, 4, 6, 8 -> 1, 2, 2, 3
    "slices, two candidates each": ((1, 4, 4, "slices", 3, 0.4, 1), [1, 1, 0, 1], 3 * 2 + 5 * 3),
    # every epoch starts afresh: 2 of its 3 groups, not 1 in the second epoch
    "two epochs": ((1, 3, 3, "slices", 6, 0.5, 2), [1, 0, 1, 1, 0, 1], 2 * (2 * 2 + 1 * 6)),
    # one part: what it always routed
    "one part": ((1, 3, 1, "groups", 6, 0.5, 1), [2], 2 * 2 + 1 * 6),
    # W = 4: groups of 4 and 2 steps, one candidate per sample: 0.3 x 2, 4 -> 1, 1; the pairs are exact
    "short groups": ((2, 2, 2, "slices", 4, 0.3, 1), [1, 0], 1 * 2 + 3 * 4 + 4 * 2),
}


@pytest.mark.parametrize("case", list(ROUTE_SPLITS))
def test_an_updates_routed_fraction_does_not_depend_on_its_split(case):
    (prompts, group_size, minibatches, unit, window, frac, epochs), per_part, backward = ROUTE_SPLITS[case]
    session = Session(tiny_config(
        f"grpo.prompts_per_iteration={prompts}", f"grpo.group_size={group_size}", f"train.minibatches={minibatches}",
        f"train.minibatch_unit={unit}", f"train.inner_epochs={epochs}",
        f"method={{name: agg, window: {window}, route_frac: {frac}, route_score: state_cosine}}"))
    batch = session.collect(0).batch
    b = prompts * group_size
    assert batch.train_steps.shape == (b, 6)
    got, passes, record = routed_per_part(session, batch)
    assert got == per_part
    assert passes["backward"] == passes["forward_grad"] == backward
    assert record["agg_groups_routed"] == sum(per_part)
    assert record["agg_groups"] == epochs * b * len(group_bounds(6, window))
    # the next update routes as the first did: nothing is carried from one update to the next
    assert routed_per_part(session, batch)[0] == per_part


@pytest.mark.parametrize("option, value", [("window", 0), ("route_frac", 1.5), ("route_frac", -0.1),
                                           ("alpha", "linear"), ("nograd_batch", 0), ("route_score", "x"),
                                           ("endpoint_velocity", "both"), ("endpoint_velocity", None)])
def test_bad_options_name_their_key(option, value):
    with pytest.raises(ConfigError) as err:
        build_method("agg", {option: value})
    assert err.value.key == f"method.{option}"


def test_endpoint_reuse_refuses_velocity_scores_on_a_partial_route():
    with pytest.raises(ConfigError) as err:
        build_method("agg", {"endpoint_velocity": "reuse", "route_frac": 0.5})
    assert err.value.key == "method.endpoint_velocity"
    assert "state_cosine" in str(err.value)
    build_method("agg", {"endpoint_velocity": "reuse", "route_frac": 0.5, "route_score": "state_cosine"})
    build_method("agg", {"endpoint_velocity": "reuse", "route_frac": 1.0})


def test_reference_preset_backward_ratio_is_two_over_window():
    """On the CPU copy of the authors' schedule, AGG and full train the same steps of the same rollout;
    AGG's backward passes per iteration are 2/W of full's."""
    cfg = check_config(load_config(PRESET, ["progress=false", "telemetry.enabled=false"]))
    window = cfg.method.options.window
    session = Session(cfg)
    batch = session.collect(0).batch
    b, n = batch.train_steps.shape
    assert (cfg.sampling.steps, window, n) == (21, 5, 10)  # 4 whole groups of 5, 0.6 of them -> 2
    work = {}
    for name in ("full", "agg"):
        session.estimator = build_method("full") if name == "full" else build_estimator(cfg)
        with counted(session.policy) as passes:
            session.update(batch)
        work[name] = passes.as_dict()
    assert work["full"]["backward"] == b * n
    assert work["agg"]["backward"] * window == work["full"]["backward"] * 2
    assert work["agg"]["forward_grad"] * window == work["full"]["forward_grad"] * 2
    assert session.estimator.iteration_metrics()["agg_groups_routed"] == b * n // window


def test_presets_share_the_reference_schedule():
    qwen = check_config(load_config(ROOT / "config/presets/qwenimage_720_reference.yaml"))
    tiny = check_config(load_config(PRESET))
    assert (qwen.model.family, qwen.model.resolution, qwen.sampling.steps, qwen.sampling.sde) == \
        ("qwenimage", 720, 21, "dance_grpo")
    assert (qwen.sampling.eta, qwen.sampling.shift) == (0.3, 3.0)
    assert (qwen.grpo.clip_range, qwen.grpo.adv_clip_max) == (0.1, 5.0)
    assert (qwen.grpo.group_size, qwen.sampling.same_noise_per_group) == (8, True)
    assert (qwen.train.plan, qwen.train.plan_window, qwen.train.timestep_fraction) == ("groups", 5, 0.6)
    assert (qwen.method.name, qwen.method.options.window) == ("agg", 5)
    assert tiny.sampling == qwen.sampling
    for key in ("group_size", "clip_range", "adv_clip_max", "beta"):
        assert getattr(tiny.grpo, key) == getattr(qwen.grpo, key), key
    for key in ("plan", "plan_window", "timestep_fraction", "inner_epochs"):
        assert getattr(tiny.train, key) == getattr(qwen.train, key), key
    assert tiny.method.name == qwen.method.name
    for key in ("window", "alpha", "route_frac", "reuse_rollout_velocity"):
        assert getattr(tiny.method.options, key) == getattr(qwen.method.options, key), key


# ----- replay --method agg against the rule written out independently ------------------------------
def independent_sde_log_prob(kind, v, x, x_next, s, s_next, eta):
    """docs/design.md's transition log-density (mean over elements), written without agg_bench.engine.sampler."""
    # s == 1 only at step 0, whose next sigma is the schedule's second
    mean, sd = sde_reference(kind, v, x, s, s_next, eta, s1=s_next)
    return gaussian_log_prob(x_next, mean, sd)


@pytest.mark.parametrize("sde, alpha", [("flow_grpo", "sigma"), ("dance_grpo", "index")])
def test_replay_agg_matches_an_independent_computation_of_the_rule(tmp_path, sde, alpha):
    cfg = tiny_config(f"sampling.sde={sde}", "train.plan=groups", "train.plan_window=3",
                      "train.timestep_fraction=1.0", "sampling.steps=7", "grpo.clip_range=0.1",
                      "grpo.prompts_per_iteration=1", dtype="float32")
    snap = save_snapshot(cfg, tmp_path / "snap")
    counts = replay(snap, "agg", ["method.window=3", f"method.alpha={alpha}"], tmp_path / "agg.safetensors")
    got = load_file(str(tmp_path / "agg.safetensors"))

    from diffusers import SD3Transformer2DModel
    model = SD3Transformer2DModel.from_pretrained(snap / "transformer").float()
    params = {k: v.detach() for k, v in model.named_parameters()}
    t = load_file(str(snap / "rollout.safetensors"))
    lat, sig, ts, adv = t["latents"], t["sigmas"].double(), t["timesteps"], t["advantages"]
    old, steps = t["log_probs"], t["train_steps"]
    b, n = steps.shape
    scale, eps, eta = 1.0 / (b * n), cfg.grpo.clip_range, cfg.sampling.eta

    def velocity(p, i, j, x):
        return torch.func.functional_call(model, p, (), dict(
            hidden_states=x[None], timestep=ts[j:j + 1], encoder_hidden_states=t["encoder_hidden_states"][i:i + 1],
            pooled_projections=t["pooled_projections"][i:i + 1], return_dict=False))[0][0]

    def loss(i, j, v):
        ratio = torch.exp(independent_sde_log_prob(sde, v, lat[i, j], lat[i, j + 1], float(sig[j]), float(sig[j + 1]),
                                                   eta) - old[i, j])
        return scale * torch.maximum(-adv[i] * ratio, -adv[i] * ratio.clamp(1 - eps, 1 + eps))

    total = {k: torch.zeros_like(v, dtype=torch.float64) for k, v in params.items()}
    for i in range(b):
        for start in range(0, n, 3):
            js = steps[i, start: start + 3].tolist()
            us = []
            for j in js:
                with torch.no_grad():
                    v = velocity(params, i, j, lat[i, j])
                us.append(torch.func.grad(lambda v_, i=i, j=j: loss(i, j, v_))(v))
            if alpha == "index":
                a = [k / (len(js) - 1) for k in range(len(js))]
            else:
                a = [float((sig[j] - sig[js[0]]) / (sig[js[-1]] - sig[js[0]])) for j in js]
            u_base = sum((1 - ak) * uk for ak, uk in zip(a, us))
            u_corr = sum(ak * uk for ak, uk in zip(a, us))
            for j, u in ((js[0], u_base), (js[-1], u_corr)):
                _, vjp = torch.func.vjp(lambda p, i=i, j=j: velocity(p, i, j, lat[i, j]), params)
                for k, g in vjp(u)[0].items():
                    total[k] += g.double()
    assert relative_error(got, total) <= 1e-4
    assert counts == {"forward_nograd": b * n, "forward_grad": 2 * b * n // 3, "backward": 2 * b * n // 3}


# ----- one W: the groups AGG aggregates are runs of consecutive denoising steps --------------------
def _aggregated_groups_are_consecutive(cfg, window: int, draws: int = 60) -> bool:
    """Whether every group of more than two entries is a run of consecutive steps in ``draws`` seeded plans."""
    from agg_bench.engine.trained_steps import draw_trained_steps, plan_steps

    available = torch.ones(cfg.sampling.steps, dtype=torch.bool)
    if cfg.sampling.sde.startswith("cps"):
        available[-1] = False  # the step into sigma 0 has no density
    available = plan_steps(available, cfg.train.ignore_last)
    for seed in range(draws):  # fixed seeds: the same plans on every run
        steps = draw_trained_steps(cfg.train.plan, 1, available, cfg.train.timestep_fraction, cfg.train.plan_window,
                           torch.Generator().manual_seed(seed))[0]
        for start, stop in group_bounds(steps.numel(), window):
            chunk = steps[start:stop]
            if chunk.numel() > 2 and not torch.equal(chunk, torch.arange(int(chunk[0]), int(chunk[0]) + chunk.numel())):
                return False
    return True


def test_agg_run_check_accepts_exactly_the_plans_whose_groups_are_consecutive():
    """Over a grid of plans and windows, check_run refuses a run exactly when some seeded plan puts steps
    that are not adjacent into one aggregated group; the refusal names method.window (plan groups) or
    train.timestep_fraction (plan steps). The plan draws from the steps it may train: without the last one
    with train.ignore_last or a cps SDE (whose step into sigma 0 has no density)."""
    from agg_bench.engine.trained_steps import steps_per_sample

    refused = accepted = 0
    for plan, plan_window, fraction, *extra in [
            ("groups", 5, 0.5), ("groups", 5, 1.0), ("groups", 3, 0.5), ("groups", 2, 0.4), ("groups", 6, 1.0),
            ("steps", 5, 0.5), ("steps", 5, 1.0), ("groups", 4, 0.5), ("steps", 5, 1.0, "train.ignore_last=true"),
            ("steps", 5, 1.0, "sampling.sde=cps", "sampling.eta=0.5"), ("steps", 5, 0.9, "train.ignore_last=true"),
            ("groups", 3, 1.0, "train.ignore_last=true"), ("groups", 4, 1.0, "sampling.sde=cps", "sampling.eta=0.5"),
            ("groups", 3, 0.7, "train.ignore_last=true")]:
        cfg = tiny_config("sampling.steps=12", f"train.plan={plan}", f"train.plan_window={plan_window}",
                          f"train.timestep_fraction={fraction}", *extra)
        n = steps_per_sample(plan, 12 - bool(extra), fraction, plan_window)
        for window in range(1, n + 1):
            consecutive = _aggregated_groups_are_consecutive(cfg, window)
            try:
                agg(window=window).check_run(cfg)
            except ConfigError as err:
                assert not consecutive, (plan, plan_window, fraction, window)
                assert err.key == ("method.window" if plan == "groups" else "train.timestep_fraction")
                refused += 1
                continue
            assert consecutive, (plan, plan_window, fraction, window)
            accepted += 1
            # route_frac = 0 aggregates nothing: any plan is accepted
            agg(window=window, route_frac=0.0).check_run(cfg)
    assert refused and accepted
    # the window the plan groups by, and a mismatch: 2 of 3 groups of 5 steps, W = 3 joins entries 3..5
    plan = ("sampling.steps=15", "train.plan=groups", "train.plan_window=5", "train.timestep_fraction=0.67")
    agg(window=5).check_run(tiny_config(*plan))
    with pytest.raises(ConfigError, match=r"train.plan_window = 5 .*\[3, 4, 5\]"):
        agg(window=3).check_run(tiny_config(*plan))
