"""The public recipes (issue: each method as its authors run it, charged for what it computes): the run options
the recipes need (sampling.schedule, grpo.adv_std / adv_ddof / adv_eps, reward.on) against float64 references and
refused when bad; an older run's written values read as today's keys; the moving averages (EMA old / reference
policies) and what they are charged; DGPO's clip and guided rollout; MixGRPO-Flash's truncated, rolled-back window
and second-order steps; and every preset's counted passes, each derived from its algorithm's description (not
from the code), with its cost their sum at the prices."""
from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import pytest
import torch

from agg_bench.cli import main
from agg_bench.config import DEFAULTS, RunConfig, check_data_parallel, load_config
from agg_bench.engine.grpo import UpdateStats
from agg_bench.errors import ConfigError
from agg_bench.io import read_jsonl
from agg_bench.records import passes_cost
from agg_bench.runtime.session import Session, rewarded_latents
from agg_bench.runtime.train import train
from helpers import counted, fresh_seed, move_off_policy, relative_error, tiny_config

ROOT = Path(__file__).resolve().parents[2]
PRESETS = ROOT / "config" / "presets"
FINAL = ("sampling.same_noise_per_group=false", "reward.name=smoothness")


def fresh_generator() -> torch.Generator:
    return torch.Generator().manual_seed(fresh_seed())


def grads_of(policy):
    return {n: p.grad.clone() for n, p in policy.named_parameters()}


# ----- the run options ------------------------------------------------------------------------------

def test_linspace_schedule_is_the_shifted_linspace():
    """sigma_j = a u / (1 + (a - 1) u), u = 1 - j / T, written out in float64 for a fresh shift."""
    shift = 1 + 4 * float(torch.rand(1, generator=fresh_generator()))
    cfg = tiny_config("sampling.schedule=linspace", f"sampling.shift={shift}", "sampling.steps=7")
    sigmas = Session(cfg).sigmas
    expected = [shift * (1 - j / 7) / (1 + (shift - 1) * (1 - j / 7)) for j in range(8)]
    assert sigmas.dtype == torch.float64 and sigmas.numel() == 8
    assert max(abs(float(s) - e) for s, e in zip(sigmas, expected)) <= 1e-15
    assert float(sigmas[0]) == 1.0 and float(sigmas[-1]) == 0.0
    diffusers = Session(tiny_config(f"sampling.shift={shift}", "sampling.steps=7")).sigmas
    assert not torch.equal(diffusers, sigmas)  # the default stays the scheduler's


def test_reward_on_x0_scores_the_last_steps_data_prediction(monkeypatch):
    """x0 = x_{T-1} - s_{T-1} v_{T-1}; with an SDE last step it is not the final latent, with an ODE one it is."""
    session = Session(tiny_config("reward.on=x0", "sampling.sde=dance_grpo"))
    seen = []
    decode = session.policy.decode
    monkeypatch.setattr(session.policy, "decode", lambda latents: seen.append(latents) or decode(latents))
    batch = session.collect(0).batch
    expected = batch.latents[:, -2] - float(batch.sigmas[-2]) * batch.velocities[:, -1]
    (scored,) = seen
    torch.testing.assert_close(scored, expected, rtol=0, atol=1e-15)
    assert (scored - batch.latents[:, -1]).abs().max() > 1e-6
    final = tiny_config("reward.on=final")
    assert final.reward.on == "final" and DEFAULTS["reward"]["on"] == "final"
    ode = Session(tiny_config("method.name=nft", *FINAL)).collect(0).batch  # Euler into 0: x0 is the final latent
    trajectory = type("T", (), {"latents": ode.latents, "velocities": ode.velocities, "sigmas": ode.sigmas})
    assert torch.equal(rewarded_latents(trajectory, "x0"), ode.latents[:, -1])


def test_reward_on_x0_without_an_sde_step_before_it_is_refused():
    """With the group's shared noise and no SDE step before the last one, the last step's data prediction is the
    same for the whole group: one reward, every advantage 0, an update that trains nothing."""
    shared = Session(tiny_config("reward.on=x0", "sampling.steps=2", "sampling.sde=dance_grpo"))
    rewards = shared.collect(0).rewards.view(-1, shared.cfg.grpo.group_size)
    assert (rewards.std(dim=1) > 0).all()  # one SDE step before the last one is enough
    with pytest.raises(ConfigError) as err:
        tiny_config("reward.on=x0", "sampling.steps=1")
    assert err.value.key == "reward.on"
    assert tiny_config("reward.on=x0", "sampling.steps=1", "sampling.same_noise_per_group=false").reward.on == "x0"
    last = tiny_config().sampling.steps - 1
    for name in ("window", "mixgrpo_flash"):  # a window on the last step alone: the steps before it follow the ODE
        cfg = tiny_config(f"method.name={name}", "method.window_size=1", "method.window_mode=fixed",
                          f"method.window_start={last}", "reward.on=x0")
        with pytest.raises(ConfigError) as err:
            Session(cfg)
        assert err.value.key == "reward.on"


@pytest.mark.parametrize("std", ["group", "global"])
def test_run_advantages_follow_the_std_ddof_and_eps(std):
    """The batch's advantages from its rewards: each group's mean, the group's or the batch's std with the
    run's ddof, plus its eps (float64 written out)."""
    cfg = tiny_config(f"grpo.adv_std={std}", "grpo.adv_ddof=1", "grpo.adv_eps=1e-4", "grpo.adv_clip_max=100")
    session = Session(cfg)
    rollout = session.collect(0)
    rewards = [float(r) for r in rollout.rewards]
    g = cfg.grpo.group_size

    def std_of(xs):
        m = sum(xs) / len(xs)
        return math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1))

    for k in range(len(rewards) // g):
        group = rewards[k * g:(k + 1) * g]
        spread = std_of(group if std == "group" else rewards) + 1e-4
        expected = torch.tensor([(r - sum(group) / g) / spread for r in group], dtype=torch.float64)
        torch.testing.assert_close(rollout.batch.advantages[k * g:(k + 1) * g], expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("override, key", [
    ("sampling.schedule=cosine", "sampling.schedule"), ("sampling.schedule=1", "sampling.schedule"),
    ("grpo.adv_std=batch", "grpo.adv_std"), ("grpo.adv_std=[group]", "grpo.adv_std"),
    ("grpo.adv_ddof=2", "grpo.adv_ddof"), ("grpo.adv_ddof=-1", "grpo.adv_ddof"), ("grpo.adv_ddof=1.0", "grpo.adv_ddof"),
    ("grpo.adv_ddof=true", "grpo.adv_ddof"), ("grpo.adv_eps=0", "grpo.adv_eps"), ("grpo.adv_eps=-1e-4", "grpo.adv_eps"),
    ("grpo.adv_eps=.nan", "grpo.adv_eps"), ("grpo.adv_eps=1e300", "grpo.adv_eps"), ("grpo.adv_eps=tiny", "grpo.adv_eps"),
    ("reward.on=latent", "reward.on"), ("reward.on=true", "reward.on"),
    ("grpo.adv_std=population", "grpo.adv_std"), ("grpo.adv_std=sample", "grpo.adv_std"),
    ("sampling.shift=null", "sampling.shift"),  # with the linspace schedule below
])
def test_bad_run_options_are_one_line_naming_the_key(override, key):
    with pytest.raises(ConfigError) as err:
        tiny_config("sampling.schedule=linspace", override)
    assert err.value.key == key and "\n" not in str(err.value)


@pytest.mark.parametrize("method", ["nft", "awm", "dgpo"])
def test_ignore_last_is_refused_where_times_are_the_methods_own(method):
    cfg = tiny_config(f"method.name={method}", "sampling.same_noise_per_group=false", "train.ignore_last=true")
    with pytest.raises(ConfigError) as err:
        Session(cfg)
    assert err.value.key == "train.ignore_last" and method in str(err.value) and "\n" not in str(err.value)


def test_a_bad_option_through_the_cli_is_one_line_exit_2(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["run", "--set", "grpo.adv_std=population", "--out", str(out)]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "grpo.adv_std" in line and "grpo.adv_ddof: 0" in line and not out.exists()


def test_global_std_needs_one_process_and_branch_its_groups():
    cfg = tiny_config("grpo.adv_std=global", "grpo.prompts_per_iteration=2")
    check_data_parallel(cfg, 1)
    with pytest.raises(ConfigError, match="grpo.adv_std"):
        check_data_parallel(cfg, 2)
    with pytest.raises(ConfigError, match="grpo.adv_std"):
        Session(tiny_config("method={name: branch, branch_points: [0, 1]}", "grpo.group_size=4",
                            "grpo.adv_std=global"))


@pytest.mark.parametrize("written, ddof", [("population", 0), ("sample", 1)])
def test_an_older_runs_adv_std_reads_as_todays_keys(written, ddof, tmp_path):
    """config.json and checkpoints written before grpo.adv_std took group | global: 'population' was the group's
    np.std (ddof 0), 'sample' its torch std (ddof 1), both + 1e-8 (the default eps); the file reads as that run
    and compares equal to it, while a config written today must say it the new way."""
    from agg_bench.runtime.checkpoint import check_same_run, first_difference

    today = tiny_config(f"grpo.adv_ddof={ddof}").to_dict()
    older = copy.deepcopy(today)
    older["grpo"]["adv_std"] = written
    del older["grpo"]["adv_ddof"], older["grpo"]["adv_eps"]
    cfg = RunConfig.from_dict(json.loads(json.dumps(older)))
    assert (cfg.grpo.adv_std, cfg.grpo.adv_ddof, cfg.grpo.adv_eps) == ("group", ddof, 1e-8)
    check_same_run(older, today, tmp_path)
    assert first_difference(older, today, (), DEFAULTS) is None
    other = tiny_config(f"grpo.adv_ddof={1 - ddof}").to_dict()
    assert first_difference(older, other, (), DEFAULTS)[0] == "grpo.adv_ddof"
    with pytest.raises(ConfigError, match="older run folders"):
        load_config(None, [f"grpo.adv_std={written}"])


def test_an_older_runs_config_without_model_guidance_reads_as_the_default(tmp_path):
    """A run folder's config.json written before model.guidance (every FLUX run then embedded 1) reads as that
    run: the key takes its default, the config compares equal to today's and differs from a guided one there."""
    from agg_bench.reading import RunFolder
    from agg_bench.runtime.checkpoint import check_same_run, first_difference

    today = tiny_config(family="flux").to_dict()
    older = copy.deepcopy(today)
    del older["model"]["guidance"]
    (tmp_path / "config.json").write_text(json.dumps(older))
    cfg = RunFolder(tmp_path).config()
    assert cfg.model.guidance == 1.0 and cfg.to_dict() == today
    check_same_run(older, today, tmp_path)
    assert first_difference(older, today, (), DEFAULTS) is None
    guided = tiny_config("model.guidance=3.5", family="flux").to_dict()
    assert first_difference(older, guided, (), DEFAULTS) == ("model.guidance", 1.0, 3.5)


def test_a_config_with_reward_options_is_the_same_as_itself_beside_the_defaults():
    """reward.options defaults to {}: a config that sets options (the learning sweeps' scene weights) compares
    equal to itself with the defaults filled in, so that a campaign counts its finished runs done and a rerun
    takes its folder, and differs from one with other options at the key that differs."""
    from agg_bench.config.load import first_difference

    weighted = tiny_config("reward.options={weights: {shape: 1}}").to_dict()
    assert first_difference(weighted, copy.deepcopy(weighted), (), DEFAULTS) is None
    other = tiny_config("reward.options={weights: {shape: 2}}").to_dict()
    assert first_difference(weighted, other, (), DEFAULTS) == ("reward.options.weights.shape", 1, 2)


# ----- the moving averages ------------------------------------------------------------------------

def test_moving_average_update_and_swap_are_exact():
    """w_ema <- w_ema + (1 - d)(w - w_ema) (the public EMAModuleWrapper.step), d 0 an exact copy; the swap puts the
    average's weights into the policy and the policy's back, bit for bit."""
    from baselines.final_latent import EMAPolicy, ema_decay

    session = Session(tiny_config())
    policy = session.policy
    ema = EMAPolicy(policy)
    assert ema.equals(policy) and ema.policy.counter is policy.counter
    start = {n: p.detach().clone() for n, p in policy.named_parameters()}
    move_off_policy(policy, 1e-2)
    policy.version += 1
    assert not ema.equals(policy)
    d = float(torch.rand(1, generator=fresh_generator()))
    ema.update(policy, d)
    own = dict(ema.policy.transformer.named_parameters())
    for name, w in policy.named_parameters():  # add_(alpha=) may fuse the multiply-add: one rounding apart
        torch.testing.assert_close(own[name], start[name] + (1 - d) * (w - start[name]), rtol=0, atol=1e-15)
    assert not ema.equals(policy) and ema.steps == 1
    mine = {n: p.detach().clone() for n, p in policy.named_parameters()}
    with ema.weights_in(policy):
        assert all(torch.equal(p, own[n]) for n, p in policy.named_parameters())
    assert all(torch.equal(p, mine[n]) for n, p in policy.named_parameters())
    ema.update(policy, 0.0)
    assert ema.equals(policy) and all(torch.equal(own[n], p) for n, p in policy.named_parameters())
    # the schedules: DiffusionNFT's return_decay types 1 and 2, AWM's and DGPO's min(0.3, 0.001 step)
    assert [ema_decay(n, 0.001, 0.5) for n in (0, 1, 600)] == [0.0, 0.001, 0.5]
    assert [ema_decay(n, 0.0075, 0.999, 75) for n in (74, 75, 76)] == [0.0, 0.0, 0.0075]
    assert [ema_decay(n, 0.001, 0.3, 1) for n in (1, 2)] == [0.0, 0.001]


def counts(session, iterations):
    """Per iteration: (rollout passes, train passes), each {forward_nograd, forward_grad, backward}."""
    out = []
    for iteration in range(iterations):
        with counted(session.policy) as rollout:
            batch = session.collect(iteration).batch
        with counted(session.policy) as train:
            session.update(batch)
        out.append((rollout.as_dict(), train.as_dict()))
    return out


def test_nft_old_policy_is_charged_only_where_it_is_not_the_policy():
    """DiffusionNFT: B T rollout forwards; per update B K forwards with grad and backwards; the old policy's
    v_old a no-grad forward only where the old policy is a moving average that differs from the policy
    (decay_type 1: from the second iteration). At rate 0 the old policy is the rollout's weights: never."""
    b, t, k = 6, 6, 2
    rate0 = counts(Session(tiny_config("method={name: nft, times_per_sample: 2}", *FINAL)), 2)
    ema = counts(Session(tiny_config("method={name: nft, times_per_sample: 2, old_decay_rate: 0.001}", *FINAL)), 2)
    for rollout, update in rate0:
        assert rollout == {"forward_nograd": b * t, "forward_grad": 0, "backward": 0}
        assert update == {"forward_nograd": 0, "forward_grad": b * k, "backward": b * k}
    for it, (rollout, update) in enumerate(ema):
        assert rollout == {"forward_nograd": b * t, "forward_grad": 0, "backward": 0}
        assert update == {"forward_nograd": 0 if it == 0 else b * k, "forward_grad": b * k, "backward": b * k}


def test_nft_old_policy_samples_and_gives_v_old():
    """With a moving-average old policy the rollout's velocities are the average's, and the gradient is the
    paper's loss with v_old its no-grad velocities (tests/unit/test_nft.py's reference, written out there)."""
    from test_nft import collect, reference_gradient

    session = Session(tiny_config("method={name: nft, times_per_sample: 3, old_decay_rate: 0.3, old_decay_max: 0.5}",
                                  *FINAL))
    est = session.estimator
    session.update(session.collect(0).batch)
    move_off_policy(session.policy, 1e-2)  # a step that moves the weights far enough to see
    batch = collect(session)  # iteration 0's prompts and noise again, sampled by the average after one step
    old = est.ema.policy
    assert not est.ema.equals(session.policy)
    with torch.no_grad():
        v = old.velocity(batch.latents[:, 2], batch.timesteps[2].expand(batch.batch_size), batch.cond)
    torch.testing.assert_close(batch.velocities[:, 2], v, rtol=0, atol=1e-12)
    eps, t, timesteps = est.draws(session.policy, batch)
    with torch.no_grad():
        b, k = batch.train_steps.shape
        v_old = torch.stack([torch.stack([
            old.velocity(((1 - t[i, s]) * batch.latents[i, -1] + t[i, s] * eps[i, s])[None],
                         timesteps[i, s].reshape(1), batch.cond[torch.tensor([i])])[0] for s in range(k)])
            for i in range(b)])
    for p in session.policy.parameters():
        p.grad = None
    est.accumulate(session.policy, batch, UpdateStats(0.1))
    ref = reference_gradient(session.policy, batch, v_old, eps, t, timesteps, 1.0, 5.0, "adaptive")
    assert relative_error(grads_of(session.policy), ref) <= 1e-10


def test_awm_ema_kl_term_and_its_charge():
    """AWM: the EMA-KL term adds ema_kl_beta / (B K) sum mean (v - v_ema)^2 to the gradient (written out in
    float64), one no-grad forward of the average per (sample, time) where it differs from the policy."""
    b, k = 6, 2
    opts = f"method={{name: awm, times_per_sample: {k}, ema_kl_beta: 0.7}}"
    with_term, without = (Session(tiny_config(o, *FINAL)) for o in (opts, opts.replace("0.7", "0")))
    assert counts(with_term, 1)[0][1] == {"forward_nograd": 0, "forward_grad": b * k, "backward": b * k}
    counts(without, 1)
    without.policy.transformer.load_state_dict(with_term.policy.transformer.state_dict())
    without.policy.version = with_term.policy.version
    batches = [s.collect(1).batch for s in (with_term, without)]
    for s, batch in zip((with_term, without), batches):
        for p in s.policy.parameters():
            p.grad = None
        with counted(s.policy) as passes:
            s.estimator.accumulate(s.policy, batch, UpdateStats(0.1))
        ema = b * k if s is with_term else 0  # the second iteration: the average differs from the policy
        assert passes.as_dict() == {"forward_nograd": ema, "forward_grad": b * k, "backward": b * k}
    difference = {n: g - grads_of(without.policy)[n] for n, g in grads_of(with_term.policy).items()}
    policy, ema, batch = with_term.policy, with_term.estimator.ema.policy, batches[0]
    eps, t, timesteps = with_term.estimator.draws(policy, batch)
    params = [p for _, p in policy.named_parameters()]
    total = 0
    for i in range(b):
        for s in range(k):
            x_t = (1 - t[i, s]) * batch.latents[i, -1] + t[i, s] * eps[i, s]
            args = (x_t[None], timesteps[i, s].reshape(1), batch.cond[torch.tensor([i])])
            with torch.no_grad():
                v_ema = ema.velocity(*args)
            total = total + 0.7 * ((policy.velocity(*args) - v_ema) ** 2).mean() / (b * k)
    expected = dict(zip((n for n, _ in policy.named_parameters()), torch.autograd.grad(total, params)))
    assert relative_error(difference, expected) <= 1e-9


def test_dgpo_clip_detaches_the_clipped_samples_errors():
    """clip_dsm: with ratio = exp(l_old - l_theta), a sample's l_theta is detached where A > 0 and ratio > 1 + eps
    or A <= 0 and ratio < 1 - eps; the gradient is 1/(B K) sum_k sum_i w_gk A_i grad l_theta(i, k) over the kept
    ones, w_gk = sigmoid(beta / G sum_{j in g} A_j (l_theta - l_ref)(j, k)) (the code's surrogate, written out)."""
    from test_dgpo import G, collect

    session = Session(tiny_config("method={name: dgpo, clip_dsm: true, times_per_sample: 2}", "grpo.clip_range=1e-9",
                                  *FINAL))
    est = session.estimator
    batch = collect(session)
    move_off_policy(session.policy, 3e-2)
    session.policy.version = 2  # two optimizer steps since the rollout: the average takes in a decay of 0.001
    stats = UpdateStats(0.1)
    est.accumulate(session.policy, batch, stats)
    assert 0 < stats.clipped < stats.count  # both kinds of sample
    policy, old, ref = session.policy, est.ema.policy, est.frozen
    eps, t, timesteps = est.draws(policy, batch)
    b, k = batch.train_steps.shape
    params = [p for _, p in policy.named_parameters()]
    total, clipped = 0, 0
    for s in range(k):
        errors, deltas, kept = [], [], []
        for i in range(b):
            x0 = batch.latents[i, -1]
            x_t = (1 - t[i, s]) * x0 + t[i, s] * eps[i, s]
            args = (x_t[None], timesteps[i, s].reshape(1), batch.cond[torch.tensor([i])])
            target = eps[i, s] - x0
            error = ((policy.velocity(*args)[0] - target) ** 2).mean()
            with torch.no_grad():
                ref_error = ((ref.velocity(*args)[0] - target) ** 2).mean()
                old_error = ((old.velocity(*args)[0] - target) ** 2).mean()
            ratio = math.exp(float(old_error - error.detach()))
            a = float(batch.advantages[i])
            kept.append(not (ratio > 1 + 1e-9 if a > 0 else ratio < 1 - 1e-9))
            errors.append(error)
            deltas.append(float(error.detach()) - float(ref_error))
        for g in range(b // G):
            rows = range(g * G, (g + 1) * G)
            w = 1 / (1 + math.exp(-100.0 / G * sum(float(batch.advantages[i]) * deltas[i] for i in rows)))
            for i in rows:
                if kept[i]:
                    total = total + w * float(batch.advantages[i]) * errors[i] / (b * k)
        clipped += kept.count(False)
    assert stats.clipped == clipped
    expected = dict(zip((n for n, _ in policy.named_parameters()), torch.autograd.grad(total, params)))
    assert relative_error(grads_of(policy), expected) <= 1e-9


def test_dgpo_charges_its_guided_rollout_and_its_clip():
    """DGPO: with guidance g every rollout step forwards the prompt and the empty prompt (2 B T), v = v_u + g (v_c
    - v_u); per update B K forwards with grad, backwards and reference forwards, and with clip_dsm B K of the
    moving average once it differs from the policy (its first update has a decay of 0: from the third
    iteration)."""
    b, t, k = 6, 6, 2
    session = Session(tiny_config(f"method={{name: dgpo, times_per_sample: {k}, clip_dsm: true, "
                                  "rollout_guidance: 4.5}", *FINAL))
    seen = counts(session, 3)
    for it, (rollout, update) in enumerate(seen):
        assert rollout == {"forward_nograd": 2 * b * t, "forward_grad": 0, "backward": 0}
        assert update == {"forward_nograd": b * k + (b * k if it >= 2 else 0), "forward_grad": b * k,
                          "backward": b * k}
    from agg_bench.engine.prompts import hash_embed
    from agg_bench.engine.models import text_dims

    policy = session.policy
    dim, pooled = text_dims(policy.transformer)
    empty = session.estimator.unconditional
    assert torch.equal(empty.encoder_hidden_states, hash_embed([""], dim, pooled, 16, session.cfg.seed).encoder_hidden_states)
    batch = session.collect(3).batch
    x, ts = batch.latents[:, 1], batch.timesteps[1].expand(b)
    with torch.no_grad():
        v_c = policy.velocity(x, ts, batch.cond)
        v_u = policy.velocity(x, ts, empty.repeat_interleave(b).to(x.device, x.dtype))
    torch.testing.assert_close(batch.velocities[:, 1], v_u + 4.5 * (v_c - v_u), rtol=0, atol=1e-12)


# ----- MixGRPO-Flash's window -------------------------------------------------------------------------

def test_mixgrpo_flash_preset_truncates_rolls_back_and_takes_second_order_steps():
    """The public run: 25 steps, windows of 4 moving by 1 every 20 iterations, cut at T - 2 = 23
    (range(cur, min(cur + 4, 23))) and back to 0 once the start passes it; after the first window (steps 0-3)
    the compressed grid has int((25 - 3) * 0.4) = 8 points: 7 solver steps, the last (into 0) first order and
    the 6 before it second order (DPM-Solver++ 2M)."""
    cfg = load_config(PRESETS / "mixgrpo_flash.yaml", ["model.resolution=32", "telemetry.enabled=false"])
    session = Session(cfg)
    est = session.estimator
    assert [est.window_start(20 * m, 25) for m in (0, 1, 19, 22, 23, 24)] == [0, 1, 19, 22, 0, 1]
    assert torch.nonzero(est.window_mask(21, 25)).flatten().tolist() == [21, 22]
    batch = session.collect(0).batch
    assert est.solver_orders == [2] * 6 + [1]
    assert batch.sigmas.numel() - 1 == 4 + 7 and batch.train_steps[0].tolist() == [0, 1, 2, 3]
    first_order = load_config(PRESETS / "mixgrpo_flash.yaml", ["model.resolution=32", "telemetry.enabled=false",
                                                                 "method.solver_order=1"])
    session = Session(first_order)
    session.collect(0)
    assert session.estimator.solver_orders == [1] * 7


# ----- every preset: counted passes and their cost ---------------------------------------------------

def described_passes(cfg: RunConfig, iteration: int) -> dict[str, int]:
    """The passes of one iteration of ``cfg``'s method, from its algorithm's description (docs/methods.md). Every
    sample's trained steps are passed once per epoch however many mini-batches it takes (``train.minibatches``
    adds optimizer steps, not passes; a preset with several is also compared with its one-mini-batch run)."""
    o, b, steps = cfg.method.options, cfg.grpo.group_size * cfg.grpo.prompts_per_iteration, cfg.sampling.steps
    name, kl = cfg.method.name, cfg.grpo.beta > 0
    last = int(cfg.train.ignore_last)  # the last step is then never trained
    # every step with a density (cps: not the one into 0), or a fraction of them; a cache in the rollout only leaves
    # the counted passes as they are (its skipped blocks are counted apart, as cache work)
    if name in ("full", "fraction") or (name == "cached" and o.cache_in == "rollout"):
        dense = steps - max(last, int(cfg.sampling.sde in ("cps", "cps_unscaled")))
        trained = b * round(cfg.train.timestep_fraction * dense)
        return {"forward_nograd": b * steps + trained * kl, "forward_grad": trained, "backward": trained}
    if name == "window":  # a forward per step; the window's steps trained exactly
        return {"forward_nograd": b * steps, "forward_grad": b * o.window_size, "backward": b * o.window_size}
    if name == "mixgrpo_flash":  # window 0..3 (start 0 for the first 20 iterations), then 8 grid points
        post = max(int((steps - (o.window_size - 1)) * o.post_compress_ratio), 2) - 1
        return {"forward_nograd": b * (o.window_size + post), "forward_grad": b * o.window_size,
                "backward": b * o.window_size}
    if name == "branch":  # a forward per node, a trained transition per edge
        points = o.branch_points
        nodes = sum(o.branch_factor ** sum(p < j for p in points) for j in range(steps))
        edges = sum(o.branch_factor ** sum(p <= j for p in points) for j in range(steps - last))
        p = cfg.grpo.prompts_per_iteration
        return {"forward_nograd": p * nodes, "forward_grad": p * edges, "backward": p * edges}
    if name == "guess":  # guessed rows skip their forward at steps guess_from .. T - 2
        p, guessed_steps = cfg.grpo.prompts_per_iteration, steps - 1 - o.guess_from
        trained = b * round(cfg.train.timestep_fraction * (steps - last))
        return {"forward_nograd": b * steps - p * o.guessed * guessed_steps, "forward_grad": trained,
                "backward": trained}
    if name == "agg":  # plan groups: round(0.6 x the whole groups of W) trained; W no-grad + 2 with grad each
        groups = round(cfg.train.timestep_fraction * ((steps - last) // cfg.train.plan_window))
        return {"forward_nograd": b * steps + b * groups * o.window, "forward_grad": b * groups * 2,
                "backward": b * groups * 2}
    k = o.times_per_sample
    if name == "nft":  # the old policy: a moving average that is not the policy from the second iteration
        old = k if o.old_decay_rate > 0 and iteration >= 1 else 0
        return {"forward_nograd": b * steps + b * (k * kl + old), "forward_grad": b * k, "backward": b * k}
    if name == "awm":
        ema = k if o.ema_kl_beta > 0 and iteration >= 1 else 0
        return {"forward_nograd": b * steps + b * (k * kl + ema), "forward_grad": b * k, "backward": b * k}
    if name == "dgpo":  # guided: two rollout forwards per step; the reference always; the clip's average from 2
        guided = 2 if o.rollout_guidance != 1 else 1
        old = k if o.clip_dsm and iteration >= 2 else 0
        return {"forward_nograd": guided * b * steps + b * (k + old), "forward_grad": b * k, "backward": b * k}
    raise AssertionError(f"no description for method {name}")


@pytest.mark.parametrize("sets", [
    ["method.name=full"], ["method.name=full", "grpo.beta=0.04"], ["method.name=full", "sampling.sde=cps"],
    ["method.name=full", "sampling.sde=cps_unscaled"], ["method.name=fraction", "train.timestep_fraction=0.5"],
    ["method.name=full", "train.ignore_last=true"], ["method.name=full", "train.ignore_last=true", "sampling.sde=cps"],
    ["method.name=fraction", "train.timestep_fraction=0.6", "train.ignore_last=true"],
])
def test_grpo_methods_run_with_their_described_passes(sets, tmp_path):
    """Full GRPO (with the KL reference's forward per trained step, with cps) and DanceGRPO's fraction."""
    cfg = tiny_config(*sets, "train.iterations=1", "model.dtype=float32")
    train(cfg, tmp_path / "run")
    (record,) = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert {k: record[k] for k in ("forward_nograd", "forward_grad", "backward")} == described_passes(cfg, 0)


def test_cps_unscaled_samples_as_cps_and_trains_on_the_public_codes_log_probability(tmp_path):
    """The same seed draws the same rollout under ``cps`` and ``cps_unscaled`` (the same rewards and passes);
    only the log-probability differs: on-policy the ratio is 1 for both, and the gradient is cps's with each
    step's term times 2 std^2, so its norm differs."""
    records = {}
    for kind in ("cps", "cps_unscaled"):
        cfg = tiny_config("method.name=full", f"sampling.sde={kind}", "train.iterations=1", "model.dtype=float64")
        train(cfg, tmp_path / kind)
        (records[kind],) = read_jsonl(tmp_path / kind / "metrics.jsonl")
    cps, unscaled = records["cps"], records["cps_unscaled"]
    for key in ("reward_mean", "reward_std", "forward_nograd", "forward_grad", "backward", "cost"):
        assert cps[key] == unscaled[key], key
    assert cps["loss"] == pytest.approx(unscaled["loss"], rel=1e-12)  # ratio 1: -A averaged, either way
    assert cps["grad_norm"] != pytest.approx(unscaled["grad_norm"], rel=1e-3)


@pytest.mark.parametrize("preset", sorted(p.stem for p in PRESETS.glob("*.yaml")))
def test_every_preset_runs_with_its_described_passes_and_their_cost(preset, tmp_path):
    sets = ["model.resolution=32", "train.iterations=2", "progress=false", "telemetry.enabled=false"]
    if preset == "qwenimage_720_reference":  # its algorithm on the tiny model: the same sampling, plan and AGG
        sets += ["device=cpu", "model.family=sd3", "model.preset=tiny", "model.pretrained=null",
                 "model.dtype=float32", "reward.options={}", "reward.name=jpeg_compressibility",
                 "grpo.prompts_per_iteration=1",
                 "method.nograd_batch=null", "method.micro_batch=null"]
    cfg = load_config(PRESETS / f"{preset}.yaml", sets)
    train(cfg, tmp_path / preset)
    records = list(read_jsonl(tmp_path / preset / "metrics.jsonl"))
    cost = 0.0
    for record in records:
        assert record["status"] == "ok"
        passes = {key: record[key] for key in ("forward_nograd", "forward_grad", "backward")}
        assert passes == described_passes(cfg, record["iteration"]), (preset, record["iteration"])
        cost += passes_cost(record, cfg.train.pass_costs.to_dict())
        assert record["cost"] == cost
    if cfg.train.minibatches > 1:  # the same rollouts and passes in one optimizer step per epoch
        one = load_config(PRESETS / f"{preset}.yaml", [*sets, "train.minibatches=1"])
        train(one, tmp_path / f"{preset}-1")
        singles = list(read_jsonl(tmp_path / f"{preset}-1" / "metrics.jsonl"))
        keys = ("forward_nograd", "forward_grad", "backward", "train_forward_grad", "train_backward", "cost")
        for record, single in zip(records, singles, strict=True):
            assert {k: record[k] for k in keys} == {k: single[k] for k in keys}, preset
        assert records[0]["reward_mean"] == singles[0]["reward_mean"]  # the first rollout is the same


@pytest.mark.parametrize("method, override, key", [
    *[("nft", f"method.{k}={v}", f"method.{k}") for k, v in (
        ("old_decay_rate", -0.1), ("old_decay_rate", 2), ("old_decay_rate", "fast"), ("old_decay_rate", ".nan"),
        ("old_decay_max", 1.5), ("old_decay_max", -1), ("old_decay_after", -1), ("old_decay_after", 1.5),
        ("old_decay_after", 10**12), ("solver", "dpm3"), ("solver", 2), ("solver", "null"), ("solver", ".nan"))],
    *[("awm", f"method.{k}={v}", f"method.{k}") for k, v in (
        ("ema_kl_beta", -1), ("ema_kl_beta", 1e300), ("ema_kl_beta", ".inf"), ("ema_kl_beta", "[1]"),
        ("ema_decay_rate", -0.001), ("ema_decay_max", 3), ("times_shared_by", 0), ("times_shared_by", -3),
        ("times_shared_by", 2.5), ("times_shared_by", ".nan"), ("times_shared_by", 10**12),
        ("times_shared_by", "three"), ("solver", "dpm2"), ("solver", 2), ("solver", "null"), ("solver", ".nan"),
        ("sa_solver_tau", -0.1), ("sa_solver_tau", ".nan"), ("sa_solver_tau", ".inf"), ("sa_solver_tau", 1e300),
        ("sa_solver_tau", 11), ("sa_solver_tau", "high"), ("sa_solver_tau", "[0.4]"), ("sa_solver_tau", 0.4))],
    *[("dgpo", f"method.{k}={v}", f"method.{k}") for k, v in (
        ("clip_dsm", "yes please"), ("clip_dsm", 1), ("ema_reference", "yes please"), ("ema_reference", 1),
        ("ema_decay_rate", 1.5), ("ema_rollout_after", -1),
        ("ema_rollout_after", 2.5), ("ema_rollout_after", 10**12), ("rollout_guidance", 0.5),
        ("rollout_guidance", 1e9), ("rollout_guidance", ".nan"), ("rollout_guidance", "cfg"))],
    *[("window", f"method.window_end={v}", "method.window_end") for v in (0, -3, 2.0, 7, 10**6, "end")],
])
def test_bad_method_options_are_one_line_naming_the_key(method, override, key):
    """Every option the recipes added refuses a wrong type, a negative, NaN or infinity and a huge value; the
    window's end must hold a whole window and stay in the schedule (6 steps, windows of 4 here)."""
    with pytest.raises(ConfigError) as err:
        Session(tiny_config(f"method.name={method}", *FINAL, "method.window_size=4" if method == "window" else
                            "progress=false", override))
    assert err.value.key == key and "\n" not in str(err.value) and len(str(err.value)) < 400


def test_a_checkpoints_moving_average_that_does_not_fit_is_one_line():
    from agg_bench.errors import UserError
    from baselines.final_latent import EMAPolicy

    policy = Session(tiny_config()).policy
    state = EMAPolicy(policy).state_dict()
    assert EMAPolicy.from_state(policy, state).equals(policy)
    name = next(iter(state["weights"]))
    for bad in ({**state, "weights": {**state["weights"], name: torch.zeros(3)}},
                {**state, "weights": {}}, {**state, "steps": "two"}, {**state, "weights": "x"}):
        with pytest.raises(UserError, match="--resume: the checkpoint's moving average"):
            EMAPolicy.from_state(policy, bad)
