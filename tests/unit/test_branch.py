"""BranchGRPO (method `branch`): the tree rollout and its pass counts, the depth-wise advantages computed by
hand, the update against a single-graph float64 reference, pruning, bad options, replay scope and the preset."""
import math
from pathlib import Path

import pytest
import torch

from agg_bench.cli import main
from agg_bench.config import load_config
from agg_bench.runtime.config_check import check_config
from agg_bench.engine.rollout import Trajectory, initial_noise
from agg_bench.engine.sampler import sde_step
from agg_bench.errors import ConfigError
from agg_bench.io import read_jsonl
from agg_bench.machine import distributed
from agg_bench.methods.base import build_estimator, build_method
from agg_bench.runtime.train import Session, iteration_generator
from helpers import (counted, estimator_gradient, gaussian_log_prob, move_off_policy, relative_error, sde_reference,
                     tiny_config)

ROOT = Path(__file__).resolve().parents[2]
PRESET = ROOT / "config/presets/branchgrpo.yaml"
# the small tree of the hand computations: 2 prompts, factor 2, splits at steps 0 and 2 of 4 -> 4 leaves
TREE = ["method.name=branch", "method.branch_points=[0,2]", "method.branch_factor=2", "grpo.group_size=4",
        "sampling.steps=4", "sampling.sde=dance_grpo", "sampling.eta=0.3"]
NODES = [2, 2, 4, 4]  # nodes (= transitions) per prompt that steps 0..3 produce
FORWARDS = [1, 2, 2, 4]  # nodes alive before steps 0..3: one forward each
SMALL = ["--set", "model.resolution=32", "--set", "progress=false"]


def tree_session(*overrides, dtype="float64"):
    return Session(tiny_config(*TREE, *overrides, dtype=dtype))


# ----- rollout ------------------------------------------------------------------------------

def test_rollout_shares_prefixes_and_counts_each_node_once():
    session = tree_session()
    cfg = session.cfg
    with counted(session.policy) as work:
        batch = session.collect(0).batch
    prompts, group = cfg.grpo.prompts_per_iteration, cfg.grpo.group_size
    assert work.as_dict() == {"forward_nograd": prompts * sum(FORWARDS), "forward_grad": 0, "backward": 0}
    assert batch.latents.shape[:2] == (prompts * group, 5)

    # one root per prompt: the first noise row of its group
    gen = iteration_generator(cfg.seed, 0)
    idx = session.pick_prompts(gen)
    noise = initial_noise(len(idx), group, session.latent_shape, cfg.sampling.same_noise_per_group, gen,
                          torch.float64)
    assert torch.equal(batch.latents[:, 0], noise[::group].repeat_interleave(group, 0))

    ids = batch.transitions
    for j, n in enumerate(NODES):  # leaf l of prompt p is below node l // (group / n) of step j
        leaves_below = group // n
        expected = sum(prompts * m for m in NODES[:j]) + torch.arange(prompts * group) // leaves_below
        assert torch.equal(ids[:, j], expected)
    for j in range(4):
        for row in range(1, prompts * group):
            same = bool(ids[row, j] == ids[row - 1, j])
            assert torch.equal(batch.latents[row, j + 1], batch.latents[row - 1, j + 1]) == same
            assert bool(batch.log_probs[row, j] == batch.log_probs[row - 1, j]) == same


@pytest.mark.parametrize("scale", [1.0, 4.0])
def test_children_share_their_parents_mean_and_the_log_probs_are_the_trained_density(scale):
    """At a split both children leave one parent's state with one velocity; the stored log-prob is the
    Gaussian of the unscaled std (the public code's), so the ratio of the unchanged policy is 1."""
    session = tree_session(f"method.split_noise_scale={scale}")
    batch = session.collect(0).batch
    sigmas = batch.sigmas
    for j in range(4):
        out = sde_step("dance_grpo", batch.velocities[:, j], batch.latents[:, j], sigmas, j, 0.3,
                       prev_sample=batch.latents[:, j + 1])
        assert torch.allclose(out.log_prob, batch.log_probs[:, j], rtol=0, atol=1e-12)
    children = batch.latents[0:2, 3] - batch.latents[0:2, 2]  # step 2 splits leaves 0 and 1's common node
    assert torch.equal(batch.latents[0, 2], batch.latents[1, 2]) and torch.equal(batch.velocities[0, 2],
                                                                                 batch.velocities[1, 2])
    assert not torch.equal(children[0], children[1])
    std = 0.3 * math.sqrt(float(sigmas[2] - sigmas[3]))
    mean = sde_reference("dance_grpo", batch.velocities[0, 2], batch.latents[0, 2], float(sigmas[2]),
                         float(sigmas[3]), 0.3, float(sigmas[1]))[0]
    spread = float((batch.latents[0:2, 3] - mean).std())  # the children's noise, ~ scale * std
    assert 0.7 * scale * std < spread < 1.3 * scale * std


def test_a_split_under_cps_unscaled_stores_the_public_codes_log_probability():
    """With ``cps_unscaled`` and a scaled split noise the stored log-prob of every stochastic step, the splits
    included, is -(x' - mean)^2 of the unscaled step (what training recomputes), not the Gaussian one."""
    session = tree_session("sampling.sde=cps_unscaled", "sampling.eta=0.7", "method.split_noise_scale=4.0")
    batch = session.collect(0).batch
    for j in range(3):  # the step into sigma 0 has no density
        out = sde_step("cps_unscaled", batch.velocities[:, j], batch.latents[:, j], batch.sigmas, j, 0.7,
                       prev_sample=batch.latents[:, j + 1])
        assert torch.allclose(out.log_prob, batch.log_probs[:, j], rtol=0, atol=1e-12)
        gaussian = sde_step("cps", batch.velocities[:, j], batch.latents[:, j], batch.sigmas, j, 0.7,
                            prev_sample=batch.latents[:, j + 1])
        assert not torch.allclose(gaussian.log_prob, batch.log_probs[:, j], rtol=0, atol=1e-6)


# ----- advantages by hand ---------------------------------------------------------------------

def hand_trajectory(log_probs_step2=(0.0,) * 8):
    log_probs = torch.zeros(8, 4, dtype=torch.float64)
    log_probs[:, 2] = torch.tensor(log_probs_step2, dtype=torch.float64)
    zeros = torch.zeros(8, 5, 1, dtype=torch.float64)
    return Trajectory(latents=zeros, velocities=zeros[:, :4], log_probs=log_probs,
                      sigmas=torch.linspace(1, 0, 5), timesteps=torch.linspace(1, 0.25, 4),
                      sde_mask=torch.ones(4, dtype=torch.bool), policy_version=0)


REWARDS = torch.tensor([1.0, 2.0, 4.0, 7.0, 5.0, 3.0, 5.0, 3.0], dtype=torch.float64)


def advantages(*overrides):
    cfg = tiny_config(*TREE, *overrides)
    return build_estimator(cfg).advantages(REWARDS, hand_trajectory(), cfg.grpo)


def test_depth_wise_advantages_by_hand_sample_std():
    """Prompt 0: leaves 1, 2, 4, 7; nodes of steps 0-1 (means of their leaves) 1.5 and 5.5: sample std
    2 sqrt 2, so -+2 / (2 sqrt 2). Leaves: mean 3.5, sample std sqrt 7. Prompt 1: leaves 5, 3, 5, 3;
    nodes 4 and 4 (std 0 < 1e-6: A = 0); leaves: mean 4, sample std 2 / sqrt 3."""
    a = advantages("grpo.adv_ddof=1", "grpo.adv_clip_max=5")
    two = 2 / (2 * math.sqrt(2) + 1e-8)
    p0 = [(r - 3.5) / (math.sqrt(7) + 1e-8) for r in (1, 2, 4, 7)]
    p1 = [s / (2 / math.sqrt(3) + 1e-8) for s in (1, -1, 1, -1)]
    expected = torch.tensor([
        [-two, -two, p0[0], p0[0]], [-two, -two, p0[1], p0[1]], [two, two, p0[2], p0[2]], [two, two, p0[3], p0[3]],
        [0, 0, p1[0], p1[0]], [0, 0, p1[1], p1[1]], [0, 0, p1[2], p1[2]], [0, 0, p1[3], p1[3]],
    ], dtype=torch.float64)
    assert torch.allclose(a, expected, rtol=0, atol=1e-14)


def test_depth_wise_advantages_by_hand_population_std_and_clamp():
    a = advantages("grpo.adv_ddof=0", "grpo.adv_clip_max=0.9")
    two = 2 / (2 + 1e-8)  # population std of 1.5, 5.5 is 2
    p0 = [min(max((r - 3.5) / (math.sqrt(21 / 4) + 1e-8), -0.9), 0.9) for r in (1, 2, 4, 7)]
    p1 = [min(max(s / (1 + 1e-8), -0.9), 0.9) for s in (1, -1, 1, -1)]
    assert torch.allclose(a[0:4, 0], torch.tensor([-0.9, -0.9, 0.9, 0.9], dtype=torch.float64), rtol=0, atol=0)
    assert two > 0.9
    assert torch.allclose(a[0:4, 3], torch.tensor(p0, dtype=torch.float64), rtol=0, atol=1e-14)
    assert torch.allclose(a[4:8, 2], torch.tensor(p1, dtype=torch.float64), rtol=0, atol=1e-14)
    assert torch.equal(a[4:8, :2], torch.zeros(4, 2, dtype=torch.float64))


def test_prob_weighted_fusion_by_hand():
    """The node of step 1 above leaves 0, 1 has child edges at step 2 with log-probs 0 and log 3: weights
    1/4, 3/4, so R = 1/4 + 3/4 * 2 = 1.75; the other's log 3, 0 give 3/4 * 4 + 1/4 * 7 = 4.75; step 0's
    nodes have one child each and take its reward."""
    est = build_method("branch", {"branch_points": [0, 2], "reward_fusion": "prob_weighted"})
    log3 = math.log(3)
    traj = hand_trajectory((0.0, log3, log3, 0.0, 0.0, 0.0, 0.0, log3))
    fused = est.node_rewards(REWARDS, traj.log_probs)
    expected_p1 = [(5 + 3) / 2, 1 / 4 * 5 + 3 / 4 * 3]
    for j in (0, 1):
        assert torch.allclose(fused[j], torch.tensor([[1.75, 4.75], expected_p1], dtype=torch.float64),
                              rtol=0, atol=1e-15)
    assert torch.equal(fused[2], REWARDS.view(2, 4)) and torch.equal(fused[3], REWARDS.view(2, 4))
    grpo = tiny_config(*TREE, "grpo.adv_ddof=1").grpo
    a = est.advantages(REWARDS, traj, grpo)
    b = (4.75 - 1.75) / 2 / (math.sqrt(2 * 1.5**2) + 1e-8)
    assert torch.allclose(a[0:4, 0], torch.tensor([-b, -b, b, b], dtype=torch.float64), rtol=0, atol=1e-14)
    b1 = (expected_p1[0] - expected_p1[1]) / 2 / (abs(expected_p1[0] - expected_p1[1]) / math.sqrt(2) + 1e-8)
    assert torch.allclose(a[4:8, 1], torch.tensor([b1, b1, -b1, -b1], dtype=torch.float64), rtol=0, atol=1e-14)


def test_leaf_depth_advantages_are_the_groups_grpo_advantages():
    from agg_bench.engine.grpo import group_advantages
    a = advantages("grpo.adv_ddof=1")
    assert torch.allclose(a[:, 3], group_advantages(REWARDS, 4, 5.0, "group", torch.float64, 1), rtol=0, atol=1e-15)


# ----- the update against a single graph --------------------------------------------------------

def reference_gradient(policy, batch, trained_steps):
    """d/dtheta of 1/K sum over the tree's distinct transitions at ``trained_steps`` of the clipped
    GRPO term, one autograd graph; the transitions enumerated from the tree's shape (NODES), the SDE
    transition and its log-density written out (helpers.sde_reference, dance_grpo)."""
    params = [p for _, p in policy.named_parameters()]
    sig = [float(s) for s in batch.sigmas]
    eps = batch.clip_range
    terms = []
    for p in range(2):
        for j in trained_steps:
            for node in range(NODES[j]):
                row = torch.tensor([p * 4 + node * (4 // NODES[j])])
                step = torch.tensor([j])
                x, x_next = batch.latents[row, j], batch.latents[row, j + 1]
                v = policy.velocity(x, batch.timestep_values(step), batch.cond[row])
                mean, sd = sde_reference("dance_grpo", v, x, sig[j], sig[j + 1], batch.eta, sig[1])
                ratio = torch.exp(gaussian_log_prob(x_next, mean, sd) - batch.log_probs[row, j])
                adv = batch.advantages[row, j]
                terms.append(torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - eps, 1 + eps)))
    total = torch.stack(terms).sum() / len(terms)
    grads = torch.autograd.grad(total, params)
    return {n: g for (n, _), g in zip(policy.named_parameters(), grads)}, len(terms)


@pytest.mark.parametrize("overrides, trained_steps", [
    ((), [0, 1, 2, 3]),
    (("method.depth_pruning=[4]",), [0, 1, 2]),
    (("method.depth_pruning=[1,4]", "method.micro_batch=1"), [1, 2]),
])
def test_update_equals_the_single_graph_reference_and_trains_each_transition_once(overrides, trained_steps):
    session = tree_session("grpo.clip_range=1e-3", *overrides)
    batch = session.collect(0).batch
    move_off_policy(session.policy)
    reference, count = reference_gradient(session.policy, batch, trained_steps)
    assert count == 2 * sum(NODES[j] for j in trained_steps)
    grads = estimator_gradient(session, batch)
    work = session.policy.counter.as_dict()
    assert relative_error(grads, reference) <= 1e-10
    assert work == {"forward_nograd": 0, "forward_grad": count, "backward": count}
    assert session.estimator.iteration_metrics() == {"trained_transitions": count}


# ----- an optimizer step every n transitions (method.transitions_per_step) ----------------------------
MAX_NORM = 1e-9  # the clip acts at every step, and the clipped gradient is of AdamW's eps (1e-8)

def reference_steps(policy, batch, parts, trees, n, lr, weight_decay, max_grad_norm, clip_every_step=False):
    """The public loop of optimizer steps (train_one_step_tree), in float64 on a copy of ``policy``: for each part
    (its (row, step) transitions), the sum of their clipped GRPO terms at the current weights over n floor(K / trees)
    (K: the transitions of all parts), backward, an AdamW step. The gradient-norm clip as the code's: after each
    full part of n, and at a shorter last part only where no full part came before it (its grad_norm still None).
    ``clip_every_step``: clip after every part instead. The terms written out as in reference_gradient. Returns the
    weights after the last step and which steps were clipped."""
    import copy

    policy = copy.deepcopy(policy)
    params = list(policy.parameters())
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
    total = sum(len(part) for part in parts)
    sig = [float(s) for s in batch.sigmas]
    eps = batch.clip_range
    grad_norm, clipped = None, []
    for part in parts:
        optimizer.zero_grad()
        terms = []
        for row, j in part:
            rows, step = torch.tensor([row]), torch.tensor([j])
            x, x_next = batch.latents[rows, j], batch.latents[rows, j + 1]
            v = policy.velocity(x, batch.timestep_values(step), batch.cond[rows])
            mean, sd = sde_reference("dance_grpo", v, x, sig[j], sig[j + 1], batch.eta, sig[1])
            ratio = torch.exp(gaussian_log_prob(x_next, mean, sd) - batch.log_probs[rows, j])
            adv = batch.advantages[rows, j]
            terms.append(torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - eps, 1 + eps)).sum())
        (torch.stack(terms).sum() / (n * (total // trees))).backward()
        clip = clip_every_step or len(part) == n or grad_norm is None
        if clip:
            grad_norm = torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
        clipped.append(clip)
        optimizer.step()
    return {name: p.detach() for name, p in policy.named_parameters()}, clipped


@pytest.mark.parametrize("n, clipped", [
    (3, [True] * 8),  # 8 full steps
    (5, [True] * 4 + [False]),  # a shorter last step after full ones: not clipped
    (100, [True]),  # a shorter step and no full one before it: clipped
])
def test_a_step_every_n_shuffled_transitions_is_the_public_loop(n, clipped):
    """The iteration's 24 trained transitions (2 trees of 2 + 2 + 4 + 4), shuffled, cut into parts of n (the last
    shorter), an optimizer step after each on the sum of its terms over n x 12 (the code's accumulation steps x
    transitions per tree), at the weights the earlier steps moved, the gradient clipped as the code clips it: the
    weights after the update equal the float64 loop of reference_steps; each transition is trained once, and
    ceil(24 / n) steps are taken and recorded. The clip norm is small enough that where the rule skips a clip the
    weights differ from clipping every step (AdamW's eps sees the gradient's scale)."""
    session = tree_session("grpo.clip_range=1e-3", f"method.transitions_per_step={n}", "train.lr=1e-2",
                           f"train.max_grad_norm={MAX_NORM}")
    batch = session.collect(0).batch
    cfg = session.cfg
    parts = session.estimator.update_parts(batch, cfg.train, cfg.grpo.group_size)
    picks = [[tuple(pair) for pair in part.picked.tolist()] for part in parts]
    trained = torch.nonzero(session.estimator.trained_mask(batch)).tolist()
    assert sorted(p for part in picks for p in part) == sorted(map(tuple, trained)) and len(trained) == 24
    assert [len(part) for part in picks] == [min(n, 24 - start) for start in range(0, 24, n)]
    if n < 24:  # drawn, not in the tree's order
        assert [p for part in picks for p in part] != sorted(map(tuple, trained))
    expected, reference_clipped = reference_steps(session.policy, batch, picks, 2, n, 1e-2, cfg.train.weight_decay,
                                                  MAX_NORM)
    assert [part.clip_gradient for part in parts] == reference_clipped == clipped
    every, _ = reference_steps(session.policy, batch, picks, 2, n, 1e-2, cfg.train.weight_decay, MAX_NORM,
                               clip_every_step=True)
    version = session.policy.version
    with counted(session.policy) as work:
        session.update(batch)
    weights = {k: p.detach() for k, p in session.policy.named_parameters()}
    assert relative_error(weights, expected) <= 1e-10
    assert (relative_error(weights, every) > 1e-6) == (not all(clipped))
    assert work.as_dict() == {"forward_nograd": 0, "forward_grad": 24, "backward": 24}
    assert session.steps_taken == session.policy.version - version == math.ceil(24 / n)
    assert session.estimator.iteration_metrics() == {"trained_transitions": 24}
    assert session.estimator.records_optimizer_steps()  # the record's optimizer_steps: session.steps_taken


def test_the_shuffle_is_drawn_from_the_run_and_the_one_step_update_is_unchanged():
    """The same seed draws the same parts; another iteration other parts. Without the option the update is one
    step on the mean, and the record has no optimizer_steps (the config's count holds)."""
    def parts(seed, iteration):
        session = tree_session("method.transitions_per_step=5", f"seed={seed}")
        batch = session.collect(iteration).batch
        return [part.picked.tolist() for part in session.estimator.update_parts(batch, session.cfg.train, 4)]

    assert parts(0, 0) == parts(0, 0)
    assert parts(0, 0) != parts(0, 1)
    session = tree_session()
    batch = session.collect(0).batch
    assert session.estimator.update_parts(batch, session.cfg.train, 4) == [batch]
    session.update(batch)
    assert session.steps_taken == 1 and session.estimator.iteration_metrics() == {"trained_transitions": 24}
    assert not session.estimator.records_optimizer_steps()


def test_a_run_records_its_optimizer_steps_and_report_prices_them(tmp_path, capsys):
    """The records carry the steps taken, and the report's rows price them (not the config's one step); a record
    whose optimizer_steps is not a count is one line naming it."""
    import json

    from agg_bench.results.loading import RunEntry, load_records

    out = tmp_path / "run"
    assert main(["run", "--config", str(PRESET), *SMALL, "--set", "train.iterations=1", "--set", "sampling.steps=6",
                 "--set", "method.branch_points=[0,1,2,3]", "--set", "method.transitions_per_step=12",
                 "--out", str(out)]) == 0
    [record] = read_jsonl(out / "metrics.jsonl")
    # 2 + 4 + 8 + 16 + 16 + 16 transitions, the last step's 16 not trained: 46, in steps of 12, 12, 12 and 10
    assert (record["trained_transitions"], record["optimizer_steps"]) == (46, 4)
    assert load_records([RunEntry(out)])["optimizer_steps"].tolist() == [4]
    lines = (out / "metrics.jsonl").read_text().splitlines()
    (out / "metrics.jsonl").write_text(json.dumps({**json.loads(lines[0]), "optimizer_steps": -1}) + "\n")
    capsys.readouterr()
    assert main(["report", "--runs", str(out), "--tables", str(tmp_path / "t")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "'optimizer_steps' = -1: expected an integer" in err[0]


def test_a_diverged_update_records_the_steps_it_took(tmp_path, monkeypatch):
    """An update whose second step's gradient is not finite stops there: its record says one optimizer step, the
    one taken, not the parts' four."""
    from agg_bench.runtime import session as session_module

    norms = []
    original = session_module.fsdp.gradient_norm

    def diverging(params):
        norms.append(1)
        return torch.tensor(float("nan")) if len(norms) == 2 else original(params)

    monkeypatch.setattr(session_module.fsdp, "gradient_norm", diverging)
    out = tmp_path / "run"
    main(["run", "--config", str(PRESET), *SMALL, "--set", "train.iterations=1", "--set", "sampling.steps=6",
          "--set", "method.branch_points=[0,1,2,3]", "--set", "method.transitions_per_step=12", "--out", str(out)])
    [record] = read_jsonl(out / "metrics.jsonl")
    assert record["status"] == "diverged" and record["optimizer_steps"] == 1


# ----- width pruning ------------------------------------------------------------------------------

def pruned(mode):
    """A 6-step tree with splits at 0 and 2: steps 3-5 are the leaves' own chains (3 per leaf)."""
    session = Session(tiny_config(*TREE, "sampling.steps=6", f"method.width_pruning={mode}", "method.width_ratio=0.5"))
    batch = session.collect(0).batch
    estimator_gradient(session, batch)
    return batch, session.estimator.trained_mask(batch), session.policy.counter.as_dict()


def test_width_pruning_best_per_branch_keeps_each_leafs_first_post_split_step():
    batch, mask, work = pruned("best_per_branch")
    # int(0.5 * 3) = 1 of each leaf's 3 chain steps, which share one advantage: the earliest
    assert torch.equal(mask[:, 3:], torch.tensor([[True, False, False]]).expand(8, 3))
    assert torch.equal(batch.advantages[:, 3], batch.advantages[:, 5])
    assert work["forward_grad"] == work["backward"] == 2 * (2 + 2 + 4) + 8 == int(mask.sum())


def test_width_pruning_best_worst_keeps_the_extremes_of_the_pooled_chains():
    batch, mask, work = pruned("best_worst")
    assert torch.equal(mask[:, :3].sum(0), torch.tensor([4, 4, 8]))  # before the last split: all distinct ones
    adv = batch.advantages[:, 3:].cpu()
    kept, dropped = adv[mask[:, 3:]], adv[~mask[:, 3:]]
    assert kept.numel() == 12 and dropped.numel() == 12  # max(2, int(0.5 * 24))
    ordered = kept.sort(descending=True).values
    assert ordered[:6].min() >= dropped.max() and ordered[6:].max() <= dropped.min()
    assert work["backward"] == 16 + 12


# ----- options and run settings -------------------------------------------------------------------

@pytest.mark.parametrize("override, key", [
    ("method.branch_factor=1", "method.branch_factor"),
    ("method.branch_factor=0", "method.branch_factor"),
    ("method.branch_points=[0,4]", "method.branch_points"),
    ("method.branch_points=[2,1]", "method.branch_points"),
    ("method.branch_points=[]", "method.branch_points"),
    ("grpo.group_size=8", "grpo.group_size"),
    ("method.depth_pruning=[5]", "method.depth_pruning"),
    ("method.depth_pruning=[1,2,3,4]", "method.depth_pruning"),
    ("method.split_noise_scale=0", "method.split_noise_scale"),
    ("method.width_ratio=0", "method.width_ratio"),
    ("method.width_pruning=1", "method.width_pruning"),
    ("method.reward_fusion=max", "method.reward_fusion"),
    ("train.timestep_fraction=0.5", "train.timestep_fraction"),
])
def test_bad_options_are_config_errors_naming_the_key(override, key):
    with pytest.raises(ConfigError) as err:
        tree_session(override)
    assert err.value.key == key
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("overrides, key", [
    (("method.branch_points=[0,3]", "method.width_pruning=best_per_branch"), "method.width_pruning"),  # no step after
    (("method.width_pruning=best_per_branch",), "method.width_ratio"),  # 1 step after the split: max(1, 0) keeps it
    (("sampling.steps=6", "method.width_pruning=best_per_branch", "method.width_ratio=1.0"), "method.width_ratio"),
    (("sampling.steps=6", "method.width_pruning=best_worst", "method.width_ratio=1.0"), "method.width_ratio"),
    (("sampling.steps=5", "train.ignore_last=true", "method.width_pruning=best_per_branch"), "method.width_ratio"),
    (("sampling.steps=6", "method.depth_pruning=[4,5,6]", "method.width_pruning=best_per_branch"),
     "method.width_pruning"),
])
def test_width_pruning_that_would_keep_every_transition_is_refused(overrides, key):
    """Width pruning that keeps all of the trained transitions after the last branch point (none there, or a
    ratio whose count is all of them) would train what `none` trains: refused naming the key, as the sweep's
    check refuses it."""
    cfg = tiny_config(*TREE, *overrides)
    with pytest.raises(ConfigError) as err:
        build_estimator(cfg).check_run(cfg)
    assert err.value.key == key and "\n" not in str(err.value)
    # the same trees with a pruning that prunes: 2 trained steps after the split at 2, one kept per leaf
    build_estimator(ok := tiny_config(*TREE, "sampling.steps=5", "method.width_pruning=best_per_branch")).check_run(ok)
    build_estimator(ok := tiny_config(*TREE, "sampling.steps=4", "method.width_pruning=best_worst")).check_run(ok)


def test_group_size_error_says_it_is_the_leaves():
    with pytest.raises(ConfigError, match="leaves per prompt"):
        tree_session("grpo.group_size=3")


def test_branch_point_without_a_density_is_refused():
    """cps's last step (into sigma 0) is an Euler step: children split there would be identical."""
    with pytest.raises(ConfigError) as err:
        tree_session("sampling.sde=cps", "sampling.eta=0.5", "method.branch_points=[0,3]")
    assert err.value.key == "method.branch_points"


def test_data_parallel_runs_are_refused(monkeypatch):
    monkeypatch.setattr(distributed, "launched_world_size", lambda: 2)
    with pytest.raises(ConfigError) as err:
        build_estimator(tiny_config(*TREE)).check_run(tiny_config(*TREE))
    assert err.value.key == "method.name" and "2 data-parallel processes" in str(err.value)


def test_default_branch_points_scale_the_papers():
    est = build_method("branch")
    assert est.points(20) == [0, 3, 6, 9] and est.points(10) == [0, 1, 3, 4] and est.points(6) == [0, 1, 2]
    assert sum(est.forwards(20)) == 203 and sum(est.nodes(20)) == 218  # the notes' count for the paper's tree


@pytest.mark.parametrize("override, key", [("method.branch_factor=1", "method.branch_factor"),
                                           ("method.branch_points=[0,10]", "method.branch_points"),
                                           *(("method.transitions_per_step=" + v, "method.transitions_per_step")
                                             for v in ("0", "-12", "2.5", "twelve", ".nan", "1e12", "[12]"))])
def test_bad_options_exit_2_through_the_cli_before_anything_is_written(tmp_path, capsys, override, key):
    out = tmp_path / "x"
    code = main(["run", "--config", str(PRESET), *SMALL, "--set", override, "--out", str(out)])
    err = capsys.readouterr().err
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and key in lines[0] and "Traceback" not in err
    assert not (out / "metrics.jsonl").exists()


def test_replay_is_not_applicable():
    cfg = tiny_config(*TREE)
    case = build_estimator(cfg).replay_case(cfg, torch.ones(4, dtype=torch.bool), 8, torch.Generator())
    assert case.scope == "not_applicable" and case.train_steps is None and "tree" in case.note


def test_replay_refuses_and_gradcheck_lists_without_numbers(tmp_path, capsys):
    """On a snapshot whose run settings the method accepts (4 steps: its default splits 0, 1 give the
    group's 4 leaves), ``replay`` is one line and exit 2, and ``gradcheck`` writes the row without numbers."""
    import csv
    settings = [arg for item in ["model.resolution=32", "sampling.steps=4", "grpo.group_size=4",
                                 "grpo.prompts_per_iteration=1", "progress=false", "telemetry.enabled=false"]
                for arg in ("--set", item)]
    snap = tmp_path / "snap"
    assert main(["snapshot", *settings, "--out", str(snap)]) == 0
    capsys.readouterr()
    assert main(["replay", str(snap), "--method", "branch", "--out", str(tmp_path / "g.safetensors")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "frozen rollout" in err[0]
    out = tmp_path / "table.csv"
    assert main(["gradcheck", "--snapshot", str(snap), "--windows", "2", "--alphas", "index", "--route-fracs", "1",
                 "--methods", "branch", "--out", str(out)]) == 0
    with open(out, newline="") as fh:
        row = list(csv.DictReader(fh))[-1]
    assert (row["method"], row["replay"], row["relative_error"]) == ("branch", "not_applicable", "")
    assert not (tmp_path / "g.safetensors").exists()


# ----- the preset -----------------------------------------------------------------------------------

def test_preset_scales_the_public_setting_and_loads_with_random_weights():
    cfg = check_config(load_config(PRESET))
    options = cfg.method.options
    assert (cfg.sampling.steps, cfg.sampling.sde, cfg.sampling.eta, cfg.sampling.shift) == (20, "dance_grpo", 0.3, 3.0)
    assert (options.branch_points, options.branch_factor, cfg.grpo.group_size) == ([0, 3, 6, 9], 2, 16)
    assert options.branch_points == build_method("branch").points(20)  # the released script's 0,3,6,9 of 20
    assert (cfg.grpo.clip_range, cfg.grpo.adv_clip_max, cfg.grpo.beta) == (1e-3, 5.0, 0)
    assert (cfg.grpo.adv_std, cfg.grpo.adv_ddof, cfg.grpo.adv_eps) == ("group", 1, 1e-8)  # torch's std() + 1e-8
    assert (cfg.sampling.schedule, cfg.reward.on, options.split_noise_scale) == ("linspace", "x0", 4.0)
    assert options.transitions_per_step == 12  # --gradient_accumulation_steps 12
    assert check_config(load_config(PRESET, ["model.preset=random"])).model.preset == "random"


def test_preset_pass_counts_against_full_with_the_same_group():
    """Per prompt and iteration, from the tree (splits in two at steps 0, 3, 6, 9 of 20): a forward per node,
    1 + 2 * 3 + 4 * 3 + 8 * 3 + 16 * 10 = 203, and a trained transition per edge, 2 * 3 + 4 * 3 + 8 * 3 + 16 * 11
    = 218; full GRPO on 16 chains of 20 steps: 320 and 320."""
    cfg = load_config(PRESET, ["progress=false", "telemetry.enabled=false", "model.resolution=32"])
    session = Session(cfg)
    with counted(session.policy) as rollout:
        batch = session.collect(0).batch
    with counted(session.policy) as train:
        session.update(batch)
    assert rollout.forward_nograd == 1 + 2 * 3 + 4 * 3 + 8 * 3 + 16 * 10
    # --ignore_last: the last step's 16 transitions are not trained
    assert train.forward_grad == train.backward == 2 * 3 + 4 * 3 + 8 * 3 + 16 * 10
    full = Session(load_config(PRESET, ["progress=false", "telemetry.enabled=false", "model.resolution=32",
                                        "method={name: full}"]))
    with counted(full.policy) as passes:
        full.update(full.collect(0).batch)
    assert passes.as_dict() == {"forward_nograd": 320, "forward_grad": 304, "backward": 304}


def test_preset_runs_through_the_cli(tmp_path):
    out = tmp_path / "run"
    assert main(["run", "--config", str(PRESET), "--set", "train.iterations=1", "--set", "progress=false",
                 "--out", str(out)]) == 0
    records = list(read_jsonl(out / "metrics.jsonl"))
    assert len(records) == 1 and records[0]["method"] == "branch" and records[0]["trained_transitions"] == 202
    assert records[0]["optimizer_steps"] == 17  # ceil(202 / 12)
