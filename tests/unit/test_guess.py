"""Method `guess` (guessed rollouts, MTA-AB2): the guessed velocity, the rollout and the update against
float64 references written here from the formulas of baselines/guess.py's docstring; exact pass counts."""
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from agg_bench.cli import main
from agg_bench.config import load_config
from agg_bench.runtime.config_check import check_config
from agg_bench.engine.grpo import UpdateStats, minibatch_rows, step_terms
from agg_bench.engine.trained_steps import NO_STEP
from agg_bench.errors import ConfigError
from agg_bench.io import read_jsonl
from agg_bench.methods.base import build_method
from agg_bench.runtime.train import Session
from baselines.guess import GuessConfig
from helpers import (TINY, counted, gaussian_log_prob, move_off_policy, relative_error, sde_reference, seeded,
                     tiny_config)

ROOT = Path(__file__).resolve().parents[2]
PRESET = ROOT / "config/presets/guess_ab2.yaml"
STEPS = 6  # sampling.steps in helpers.TINY
# groups of 4 with 2 guessed from step 1: the cosine blend at steps 1, 2 (< 0.5 * 6), pure AB2 at 3, 4
GUESS = ["method.name=guess", "grpo.group_size=4", "method.guessed=2", "method.guess_from=1"]


def rollout(session, seed=3):
    """The estimator's rollout of prompts 0 and 1 from fresh noise, its pass counts, and the conditioning,
    the noise and a generator in the state the rollout's generator started from (for a reference rollout)."""
    cfg = session.cfg
    g = cfg.grpo.group_size
    cond = session.cond_all[torch.tensor([0, 1])].repeat_interleave(g)
    noise = torch.randn((2 * g, *session.latent_shape), generator=torch.Generator().manual_seed(seeded(seed)),
                        dtype=torch.float64)
    session.policy.counter.reset()
    traj = session.estimator.rollout(session.policy, cond, noise, session.sigmas, cfg.sampling,
                                     torch.Generator().manual_seed(seeded(seed + 1)), 0, g)
    return traj, session.policy.counter.as_dict(), cond, noise, torch.Generator().manual_seed(seeded(seed + 1))


def guessed_velocity(j, steps, own, group_real, blend, c1=1.5, c2=-0.5, blend_until=0.5):
    """v_hat of one row in float64: ``own`` its velocities before step j, ``group_real`` the real velocities
    of its group at step j. As the code's ``run_sample_step``: the history starts as zeros (step 0: v_so = 0),
    first order at step 1."""
    prev = own[j - 1] if j >= 1 else torch.zeros_like(group_real[0])
    v_so = c1 * prev + c2 * own[j - 2] if j >= 2 else prev
    if j >= blend_until * steps:
        return v_so
    v_group = sum(group_real) / len(group_real)
    if blend == "cosine":
        a, b = v_so.flatten(), v_group.flatten()
        cos = min(max(float(a @ b) / max(float(a.norm() * b.norm()), 1e-8), -1.0), 1.0)
        alpha = (1 + cos) / 2
    else:
        alpha = blend
    return alpha * v_so + (1 - alpha) * v_group


def reference_choice(counts, last, group, guessed):
    """The rows of ``group`` guessed at a step: not guessed at the step before, fewest guesses, lower row."""
    eligible = [i for i in group if not last[i]]
    return sorted(eligible, key=lambda i: (counts[i], i))[:guessed]


def reference_rollout(session, cond, noise, generator, guessed, first, until, blend="cosine"):
    """The whole rollout row by row in float64: which rows are guessed, their velocities, the SDE steps."""
    policy, sigmas, cfg = session.policy, session.sigmas, session.cfg
    g, eta = cfg.grpo.group_size, cfg.sampling.eta
    b, steps = noise.shape[0], sigmas.numel() - 1
    timesteps = policy.timestep_values(sigmas).to(torch.float64)
    counts, last = [0] * b, [False] * b
    x = noise.clone()
    latents, velocities, log_probs = [x], [[] for _ in range(b)], []
    forwarded = torch.ones(b, steps, dtype=torch.bool)
    for j in range(steps):
        chosen = set()
        if first <= j < until:
            for start in range(0, b, g):
                chosen |= set(reference_choice(counts, last, range(start, start + g), guessed))
        real = {i: policy.velocity(x[i:i + 1], timesteps[j:j + 1], cond[[i]])[0]
                for i in range(b) if i not in chosen}
        v = []
        for i in range(b):
            if i in real:
                v.append(real[i])
            else:
                group = range(i - i % g, i - i % g + g)
                v.append(guessed_velocity(j, steps, velocities[i], [real[k] for k in group if k in real], blend))
                forwarded[i, j] = False
        noise_j = torch.randn(x.shape, generator=generator, dtype=torch.float64)
        s, s_next = float(sigmas[j]), float(sigmas[j + 1])
        x_next, logp = [], []
        for i in range(b):
            mean, sd = sde_reference(cfg.sampling.sde, v[i], x[i], s, s_next, eta, float(sigmas[1]))
            x_next.append(mean + sd * noise_j[i])
            logp.append(gaussian_log_prob(x_next[-1], mean, sd))
            velocities[i].append(v[i])
        x = torch.stack(x_next)
        latents.append(x)
        log_probs.append(torch.stack(logp))
        for i in range(b):
            counts[i] += i in chosen
            last[i] = i in chosen
    return (torch.stack(latents, 1), torch.stack([torch.stack(r) for r in velocities]),
            torch.stack(log_probs, 1), forwarded)


def guessed_count(rows, groups, guessed, first, until):
    """Rollout forwards of a guessed rollout: every (row, step) but ``guessed`` per group per guessed step."""
    return rows * STEPS - groups * guessed * (until - first)


# ----- the rollout ------------------------------------------------------------------------------

@pytest.mark.parametrize("blend", ["cosine", 0.3])
@torch.no_grad()
def test_rollout_equals_a_float64_reference_rollout(blend):
    session = Session(tiny_config(*GUESS, f"method.blend={blend}"))
    traj, work, cond, noise, generator = rollout(session)
    latents, velocities, log_probs, forwarded = reference_rollout(session, cond, noise, generator, 2, 1, STEPS - 1,
                                                                  blend)
    assert torch.equal(traj.forwarded, forwarded)
    assert float((traj.velocities - velocities).abs().max()) <= 1e-10
    assert float((traj.latents - latents).abs().max()) <= 1e-10
    assert float((traj.log_probs - log_probs).abs().max()) <= 1e-10
    # only the real rows were forwarded: the forward batch shrank at every guessed step
    assert work == {
        "forward_nograd": guessed_count(8, 2, 2, 1, STEPS - 1), "forward_grad": 0, "backward": 0}
    assert session.estimator.iteration_metrics() == {"guessed_velocities": 2 * 2 * (STEPS - 2)}


@pytest.mark.parametrize("group, guessed, blend, forwards", [
    (4, 2, "cosine", 8 * STEPS - 2 * 2 * 5),  # 2 of 4 at each of steps 0..4
    (4, 2, 0.3, 8 * STEPS - 2 * 2 * 5),
    # 2 of 3: rows 0, 1 at steps 0, 2, 4, row 2 alone at 1, 3 (the others were guessed the step before), so the
    # guesses stored at step 0 are the v_{j-2} of step 2's AB2
    (3, 2, "cosine", 6 * STEPS - 2 * (2 + 1 + 2 + 1 + 2)),
])
@torch.no_grad()
def test_rollout_from_step_0_equals_the_codes_zero_history_in_float64(group, guessed, blend, forwards):
    """guess_from 0 as the public code: zero history at step 0 (v_so = 0, cosine 0, v = v_group / 2 with the
    cosine blend), first order at step 1, the guesses stored as the rows' velocities for later AB2 steps."""
    session = Session(tiny_config("method.name=guess", f"grpo.group_size={group}", f"method.guessed={guessed}",
                                  "method.guess_from=0", f"method.blend={blend}"))
    traj, work, cond, noise, generator = rollout(session)
    latents, velocities, log_probs, forwarded = reference_rollout(session, cond, noise, generator, guessed, 0,
                                                                  STEPS - 1, blend)
    assert torch.equal(traj.forwarded, forwarded)
    assert float((traj.velocities - velocities).abs().max()) <= 1e-10
    assert float((traj.latents - latents).abs().max()) <= 1e-10
    assert float((traj.log_probs - log_probs).abs().max()) <= 1e-10
    step0 = (~traj.forwarded[:, 0]).view(2, group)
    assert torch.equal(step0, torch.arange(group).lt(guessed).expand(2, group))  # the first rows of each group
    v0 = traj.velocities[:, 0].view(2, group, -1)
    real_mean = torch.stack([v0[p][~step0[p]].mean(0) for p in range(2)])
    share = 0.5 if blend == "cosine" else 1 - blend  # the blend's (1 - a) on v_group, v_so being 0
    assert torch.allclose(v0[step0], (share * real_mean).repeat_interleave(guessed, 0), rtol=0, atol=1e-12)
    assert not torch.any(~traj.forwarded[:, 1] & ~traj.forwarded[:, 0])  # step 1 skips step 0's rows
    assert work == {"forward_nograd": forwards, "forward_grad": 0, "backward": 0}
    assert session.estimator.iteration_metrics() == {"guessed_velocities": 2 * group * STEPS - forwards}


def test_guessed_velocities_follow_the_formulas_from_the_stored_ones():
    """Each guessed velocity from the trajectory's own earlier velocities and its group's real ones."""
    session = Session(tiny_config(*GUESS, "method.ab2=[2, -1]", "method.blend_until=0.4"))
    traj, work, *_ = rollout(session)
    v, fwd = traj.velocities, traj.forwarded
    guesses = 0
    for i, j in torch.nonzero(~fwd).tolist():
        group = range(i - i % 4, i - i % 4 + 4)
        real = [v[k, j] for k in group if fwd[k, j]]
        expected = guessed_velocity(j, STEPS, v[i], real, "cosine", c1=2.0, c2=-1.0, blend_until=0.4)
        assert float((v[i, j] - expected).abs().max()) <= 1e-12 * float(expected.abs().max())
        guesses += 1
    assert guesses == 2 * 2 * (STEPS - 2)
    assert work["forward_nograd"] == guessed_count(8, 2, 2, 1, STEPS - 1)


def test_who_is_guessed():
    """Exactly `guessed` per group at each guessed step, never two steps in a row, evenly spread."""
    session = Session(tiny_config("method.name=guess", "grpo.group_size=6", "method.guessed=2",
                                  "method.guess_until=6", "sampling.steps=6"))
    traj, work, *_ = rollout(session)
    guessed = (~traj.forwarded).view(2, 6, STEPS)
    assert guessed[:, :, :2].sum() == 0  # guess_from 2: AB2 needs two earlier velocities
    assert torch.all(guessed[:, :, 2:].sum(1) == 2)
    assert not torch.any(guessed[:, :, 1:] & guessed[:, :, :-1])
    per_row = guessed.sum(2)
    assert torch.all(per_row.max(1).values - per_row.min(1).values <= 1)
    assert work["forward_nograd"] == guessed_count(12, 2, 2, 2, STEPS) == 12 * STEPS - 16  # the last step too


def test_no_guesses_is_full_bit_for_bit():
    """guessed 0 forwards every row: the rollout and the update are full's exactly."""
    work, grads, batches = {}, {}, {}
    for name in ("full", "guess"):
        options = ["method.guessed=0"] if name == "guess" else []
        session = Session(tiny_config(f"method.name={name}", *options))
        batch = session.collect(0).batch
        move_off_policy(session.policy)
        with counted(session.policy) as passes:
            session.estimator.accumulate(session.policy, batch, UpdateStats(batch.clip_range))
        work[name] = passes.as_dict()
        grads[name] = {n: p.grad for n, p in session.policy.named_parameters()}
        batches[name] = batch
    assert torch.equal(batches["full"].latents, batches["guess"].latents)
    assert not torch.any(~batches["guess"].forwarded)
    assert work["full"] == work["guess"]
    assert all(torch.equal(grads["full"][n], grads["guess"][n]) for n in grads["full"])


# ----- the update -------------------------------------------------------------------------------

def weighted_one_graph_gradient(policy, batch, guessed_weight):
    """d L / d theta with L = 1/(B N) sum_i sum_j w_ij l_ij as one autograd graph, w_ij = guessed_weight
    where the rollout guessed (i, j), 1 elsewhere."""
    params = list(policy.parameters())
    total = 0
    for i in range(batch.batch_size):
        rows = torch.tensor([i])
        for j in batch.train_steps[i].tolist():
            steps = torch.tensor([j])
            v = policy.velocity(batch.states(rows, steps), batch.timestep_values(steps), batch.cond[rows])
            weight = 1.0 if batch.forwarded[i, j] else guessed_weight
            total = total + weight * step_terms(batch, rows, steps, v).loss.sum()
    grads = torch.autograd.grad(total * batch.loss_scale, params)
    return {n: g for (n, _), g in zip(policy.named_parameters(), grads)}


@pytest.mark.parametrize("weight", [0.1, 0.0, 1.0])
def test_update_equals_a_weighted_one_graph_reference(weight):
    session = Session(tiny_config(*GUESS, f"method.guessed_weight={weight}", "train.timestep_fraction=0.67",
                                  "method.micro_batch=3"))
    batch = session.collect(0).batch
    move_off_policy(session.policy)
    reference = weighted_one_graph_gradient(session.policy, batch, weight)
    with counted(session.policy) as work:
        session.estimator.accumulate(session.policy, batch, UpdateStats(batch.clip_range))
    grads = {n: p.grad for n, p in session.policy.named_parameters()}
    assert relative_error(grads, reference) <= 1e-10
    b, n = batch.train_steps.shape
    trained_guesses = int((~batch.forwarded.gather(1, batch.train_steps.cpu())).sum())
    assert trained_guesses > 0  # the weights are exercised
    terms = b * n - (trained_guesses if weight == 0 else 0)  # weight 0 skips the guessed terms' passes
    assert work.as_dict() == {"forward_nograd": 0, "forward_grad": terms, "backward": terms}


# ----- zero_loss_on_guess: the ablation's forwarded-only plan -----------------------------------------

# groups of 3 with 1 guessed at steps 1..4 (every step but the last): 4 guesses over 3 rows, so one row of each
# group is guessed twice and has 3 of the 5 drawable steps forwarded, the two others 4 (k_i 1 and 2 at 0.6)
ZERO_LOSS = ["method.name=guess", "method.guessed=1", "method.guess_from=1", "method.zero_loss_on_guess=true",
             "sampling.sde=dance_grpo", "train.ignore_last=true", "train.timestep_fraction=0.6"]


def codes_trained_counts(forwarded, fraction, drawable):
    """k_i of ``_batched_infer_shuffle_sel``: int(float32 count x float32 fraction), at most the count, over the
    forwarded ones of the ``drawable`` steps (the code's ``mock_flags[:, :-1] < 0.5``), all of them for a row with
    none (the code's fallback)."""
    candidates = forwarded[:, :drawable]
    counts = (candidates | (candidates.sum(1, keepdim=True) == 0)).sum(1).tolist()
    return [min(int(np.float32(c) * np.float32(fraction)), c) for c in counts]


def codes_draw(forwarded, fraction, drawable, generator):
    """The steps each row trains under ``--zero_loss_on_guess``, written from ``_batched_infer_shuffle_sel``: one
    uniform per (row, drawable step), +inf on the guessed ones, the k_i smallest; as sets of steps."""
    candidates = forwarded[:, :drawable]
    candidates = candidates | (candidates.sum(1, keepdim=True) == 0)  # no forwarded step: every one
    noise = torch.rand((forwarded.shape[0], drawable), generator=generator, dtype=torch.float32)
    noise = torch.where(candidates, noise, torch.tensor(float("inf")))
    perm = torch.argsort(noise, dim=-1)
    return [sorted(perm[i, :k].tolist()) for i, k in
            enumerate(codes_trained_counts(forwarded, fraction, drawable))]


def codes_loss(policy, batch, rows, fraction, drawable):
    """The code's ``--zero_loss_on_guess`` loss of the optimizer step on ``rows`` in float64, its terms written
    from ``train_one_step`` and ``flux_step`` (DanceGRPO's SDE): sum_i sum_j max(-A r, -A clamp(r)) / (B k_i),
    B = len(rows) the step's rows, r = exp(log p - log p_old), the trained steps taken from ``batch``'s plan."""
    k = codes_trained_counts(batch.forwarded.cpu(), fraction, drawable)
    sigmas, eps, total = batch.sigmas.tolist(), batch.clip_range, 0
    for i in rows:
        steps = [j for j in batch.train_steps[i].tolist() if j >= 0]
        assert len(steps) == k[i] and all(batch.forwarded[i, j] for j in steps)  # forwarded ones only
        for j in steps:
            x = batch.latents[i, j]
            v = policy.velocity(x[None], batch.timesteps[j:j + 1], batch.cond[[i]])[0].to(torch.float64)
            mean, sd = sde_reference("dance_grpo", v, x, sigmas[j], sigmas[j + 1], batch.eta, sigmas[1])
            ratio = torch.exp(gaussian_log_prob(batch.latents[i, j + 1], mean, sd) - batch.log_probs[i, j])
            adv = batch.advantages[i]
            total = total + torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - eps, 1 + eps)) / (len(rows) * k[i])
    return total


@pytest.mark.parametrize("fraction, ignore_last", [(0.6, True), (0.8, False), (1.0, True)])
def test_zero_loss_plan_is_the_codes_draw_among_forwarded_steps(fraction, ignore_last):
    session = Session(tiny_config(*ZERO_LOSS, f"train.timestep_fraction={fraction}",
                                  f"train.ignore_last={str(ignore_last).lower()}"))
    traj, *_ = rollout(session)
    drawable = STEPS - ignore_last
    plan = session.estimator.trained_steps(session.cfg.train, traj, 6, torch.Generator().manual_seed(seeded(11)))
    expected = codes_draw(traj.forwarded, fraction, drawable, torch.Generator().manual_seed(seeded(11)))
    assert [[j for j in row if j != NO_STEP] for row in plan.tolist()] == expected
    k = [len(row) for row in expected]
    assert plan.shape == (6, max(k)) and all(plan[i, k[i]:].eq(NO_STEP).all() for i in range(6))
    counts = traj.forwarded[:, :drawable].sum(1).tolist()
    assert sorted(counts) == sorted([3, 4, 4] * 2 if ignore_last else [4, 5, 5] * 2)
    assert k == [min(int(c * fraction + 1e-9), c) for c in counts] and len(set(k)) > 1  # rows of their own lengths


@pytest.mark.parametrize("sets", [[], ["method.micro_batch=2", "method.guessed_weight=0.5"],
                                  ["train.timestep_fraction=0.8", "train.minibatches=2"]])
def test_zero_loss_update_equals_the_codes_loss_and_gradient_in_float64(sets):
    """The loss and its gradient against the code's, each row's terms over its own k_i, the step's rows B;
    ``guessed_weight`` weighs nothing (no guessed term is trained); the passes are the sum of the k_i."""
    session = Session(tiny_config(*ZERO_LOSS, *sets))
    cfg = session.cfg
    batch = session.collect(0).batch
    move_off_policy(session.policy)
    part, rows = batch, list(range(batch.batch_size))
    if cfg.train.minibatches > 1:  # the first mini-batch: groups 0, 2, ... of the batch
        rows = minibatch_rows(batch.batch_size, 3, 2)[0].tolist()
        (part, _) = session.estimator.update_parts(batch, cfg.train, 3)
    params = list(session.policy.parameters())
    loss = codes_loss(session.policy, batch, rows, cfg.train.timestep_fraction, STEPS - 1)
    reference = dict(zip([n for n, _ in session.policy.named_parameters()], torch.autograd.grad(loss, params)))
    stats = UpdateStats(part.clip_range)
    with counted(session.policy) as work:
        session.estimator.accumulate(session.policy, part, stats)
    grads = {n: p.grad for n, p in session.policy.named_parameters()}
    assert relative_error(grads, reference) <= 1e-12
    assert abs(stats.loss_sum - float(loss.detach())) <= 1e-12 * abs(float(loss.detach()))
    trained = sum(codes_trained_counts(batch.forwarded.cpu(), cfg.train.timestep_fraction, STEPS - 1)[i]
                  for i in rows)
    assert stats.count == trained
    assert work.as_dict() == {"forward_nograd": 0, "forward_grad": trained, "backward": trained}


def test_zero_loss_row_without_a_forwarded_step_draws_among_all_as_the_code():
    """2 steps, the last never trained: step 0, guessed from the code's zero history, is the only drawable step, so
    the row guessed there has no forwarded one and trains its guessed step 0 (the code's fallback), k = 1."""
    session = Session(tiny_config(*ZERO_LOSS, "method.guess_from=0", "sampling.steps=2",
                                  "train.timestep_fraction=1.0"))
    batch = session.collect(0).batch
    forwarded = batch.forwarded.cpu()
    assert forwarded[:, 0].tolist() == [False, True, True] * 2  # the first row of each group guessed at step 0
    expected = codes_draw(forwarded, 1.0, 1, torch.Generator().manual_seed(seeded(11)))
    assert expected == [[0]] * 6 and batch.train_steps.tolist() == expected
    stats = UpdateStats(batch.clip_range)
    with counted(session.policy) as work:
        session.estimator.accumulate(session.policy, batch, stats)
    assert work.as_dict() == {"forward_nograd": 0, "forward_grad": 6, "backward": 6} and stats.count == 6


def test_zero_loss_rows_without_a_trained_step_train_nothing():
    """k_i = int(0.2 x 3 or 4 forwarded steps) = 0 for every row (the code's k 0; a row with all 5 drawable steps
    forwarded would train one, so the run is taken): no pass, a zero loss, no gradient."""
    session = Session(tiny_config(*ZERO_LOSS, "train.timestep_fraction=0.2"))
    batch = session.collect(0).batch
    assert batch.train_steps.eq(NO_STEP).all() and batch.train_steps.shape == (6, 1)
    stats = UpdateStats(batch.clip_range)
    with counted(session.policy) as work:
        session.estimator.accumulate(session.policy, batch, stats)
    assert work.as_dict() == {"forward_nograd": 0, "forward_grad": 0, "backward": 0} and stats.loss_sum == 0
    assert all(p.grad is None for p in session.policy.parameters())


def test_zero_loss_run_records_its_passes(tmp_path):
    """Through the CLI: the rollout's forwards as without the option, the trained terms the sum of the k_i: per
    group of 3 (one row with 3 forwarded drawable steps, two with 4) int(0.6 x 3) + 2 int(0.6 x 4) = 5."""
    out = tmp_path / "run"
    sets = [a for s in [*TINY, "model.dtype=float32", "train.iterations=1", *ZERO_LOSS] for a in ("--set", s)]
    assert main(["run", *sets, "--out", str(out)]) == 0
    (record,) = [r for r in read_jsonl(out / "metrics.jsonl") if "iteration" in r]
    assert record["guessed_velocities"] == 2 * 4
    assert record["forward_nograd"] == 6 * STEPS - 2 * 4
    assert record["forward_grad"] == record["backward"] == 2 * 5
    assert math.isfinite(record["loss"])


@pytest.mark.parametrize("sets, key, expected", [
    (["method.zero_loss_on_guess=1"], "method.zero_loss_on_guess", "true or false"),
    (["method.zero_loss_on_guess=sometimes"], "method.zero_loss_on_guess", "true or false"),
    (["method.zero_loss_on_guess=true", "method.guessed=0"], "method.zero_loss_on_guess", "no trained step is guessed"),
    # the only guessed step is the last, which the plan never draws
    (["method.zero_loss_on_guess=true", "method.guess_from=5", "method.guess_until=6", "train.ignore_last=true"],
     "method.zero_loss_on_guess", "no trained step is guessed"),
    (["method.zero_loss_on_guess=true", "train.plan=groups", "train.plan_window=2"], "train.plan", "`steps` with"),
    (["method.zero_loss_on_guess=true", "train.timestep_fraction=0.1"], "train.timestep_fraction",
     "int(fraction x 6) >= 1"),  # int(0.6)
])
def test_zero_loss_bad_settings_are_one_line_naming_the_key(sets, key, expected, tmp_path, capsys):
    with pytest.raises(ConfigError) as err:
        Session(tiny_config("method.name=guess", *sets))
    assert err.value.key == key and expected in err.value.expected and "\n" not in str(err.value)
    args = [a for s in [*TINY, "method.name=guess", *sets] for a in ("--set", s)]
    code = main(["run", *args, "--out", str(tmp_path / "x")])
    err_text = capsys.readouterr().err
    lines = err_text.strip().splitlines()
    assert code == 2 and len(lines) == 1 and key in lines[0] and expected in lines[0] and "Traceback" not in err_text
    assert list(tmp_path.iterdir()) == []  # refused before the run folder is made


def test_zero_loss_snapshot_is_refused_in_one_line(tmp_path, capsys):
    """A snapshot's train_steps (B, N) holds no shorter row: refused, and the folder is left as it was."""
    args = [a for s in [*TINY, "train.ignore_last=true", *ZERO_LOSS] for a in ("--set", s)]
    assert main(["snapshot", *args, "--out", str(tmp_path / "snap")]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "method.zero_loss_on_guess false" in lines[0] and "train_steps (B, N)" in lines[0]
    assert not (tmp_path / "snap").exists()


def test_replay_is_not_applicable():
    case = build_method("guess").replay_case(tiny_config("method.name=guess"), torch.ones(STEPS, dtype=torch.bool),
                                             6, torch.Generator())
    assert case.scope == "not_applicable" and "frozen rollout" in case.note


# ----- options ----------------------------------------------------------------------------------

def test_default_guesses_a_third_of_the_group():
    assert [GuessConfig().guessed_per_group(g) for g in (12, 6, 3, 2)] == [4, 2, 1, 0]
    assert list(GuessConfig().guessed_steps(20)) == list(range(2, 19))  # every step but the last, from 2


@pytest.mark.parametrize("override, key", [
    ("method.guessed=3", "method.guessed"),  # group_size 3: no real generation left for the mean
    ("method.guessed=-1", "method.guessed"),
    ("method.guess_from=-1", "method.guess_from"),
    (f"method.guess_from={STEPS + 1}", "method.guess_from"),
    (f"method.guess_until={STEPS + 1}", "method.guess_until"),
    ("method.guess_until=1", "method.guess_until"),
    ("method.blend_until=1.5", "method.blend_until"),
    ("method.blend=2", "method.blend"),
    ("method.blend=linear", "method.blend"),
    ("method.ab2=[1, 2, 3]", "method.ab2"),
    ("method.guessed_weight=-0.1", "method.guessed_weight"),
])
def test_bad_options_are_a_config_error_naming_the_key(override, key, tmp_path, capsys):
    with pytest.raises(ConfigError) as err:
        Session(tiny_config("method.name=guess", override))
    assert err.value.key == key and "\n" not in str(err.value)
    name, value = override.split("=", 1)
    code = main(["run", "--set", "model.resolution=32", "--set", f"sampling.steps={STEPS}", "--set",
                 "grpo.group_size=3", "--set", "progress=false", "--set", "method.name=guess",
                 "--set", f"{name}={value}", "--out", str(tmp_path / "x")])
    err_text = capsys.readouterr().err
    lines = err_text.strip().splitlines()
    assert code == 2 and len(lines) == 1 and key in lines[0] and "Traceback" not in err_text
    assert not (tmp_path / "x" / "metrics.jsonl").exists()


# ----- the preset -------------------------------------------------------------------------------

def test_preset_scales_the_authors_run():
    cfg = check_config(load_config(PRESET))
    assert (cfg.sampling.steps, cfg.sampling.sde, cfg.sampling.eta, cfg.sampling.shift) == (20, "dance_grpo", 0.3, 3.0)
    assert (cfg.grpo.group_size, cfg.method.options.guessed) == (6, 2)  # the authors' 12 with 4 guessed, halved
    assert (cfg.method.options.guess_from, cfg.method.options.guess_until) == (0, None)  # steps 0 .. 18, the code's
    assert (cfg.method.options.ab2, cfg.method.options.blend_until, cfg.method.options.guessed_weight) == \
        ([1.5, -0.5], 0.5, 0.1)
    assert (cfg.train.plan, cfg.train.timestep_fraction, cfg.grpo.clip_range, cfg.grpo.adv_clip_max) == \
        ("steps", 0.6, 0.1, 5.0)
    assert check_config(load_config(PRESET, ["model.preset=random"])).model.preset == "random"


def test_preset_runs_through_the_cli_and_records_its_forwards(tmp_path):
    out = tmp_path / "run"
    assert main(["run", "--config", str(PRESET), "--set", "train.iterations=1", "--set", "progress=false",
                 "--set", "telemetry.enabled=false", "--out", str(out)]) == 0
    (record,) = [r for r in read_jsonl(out / "metrics.jsonl") if "iteration" in r]
    guesses = 2 * (20 - 1)  # 2 per step at steps 0..18
    assert record["guessed_velocities"] == guesses
    assert record["forward_nograd"] == 6 * 20 - guesses == 82  # against 120 for full at group 6
    assert record["forward_grad"] == record["backward"] == 6 * round(0.6 * 19)  # never the last step
    assert json.loads((out / "config.json").read_text())["method"]["name"] == "guess"
    assert math.isfinite(record["loss"])
