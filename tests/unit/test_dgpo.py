"""DGPO (`dgpo`): the ODE rollout, the group preference loss's gradient against the paper's equation written
out here, the reference, the pass counts, a CLI run and the preset's values (bad options, the replay scope
and a run of the preset: tests/unit/test_final_latent.py, for the three likelihood-free methods); the public
sampler (`method.sampler: sana`): the scheduler's grid and integer timesteps against diffusers' own, the rollout
against DPM-Solver++(2M) written out here, the training noise level timestep / 1000 as the code computes it,
its counted forwards and its bad values."""
import math
from pathlib import Path

import pytest
import torch
from diffusers import DPMSolverMultistepScheduler

from agg_bench.cli import main
from agg_bench.config import load_config
from agg_bench.runtime.config_check import check_config
from agg_bench.engine.grpo import UpdateStats
from agg_bench.io import read_jsonl
from agg_bench.runtime.train import Session
from helpers import counted, move_off_policy, relative_error, seeded, tiny_config

ROOT = Path(__file__).resolve().parents[2]
PRESET = ROOT / "config/presets/dgpo.yaml"
STEPS = 6  # sampling.steps in helpers.TINY
G = 3  # grpo.group_size in helpers.TINY
DGPO = ("method.name=dgpo", "sampling.same_noise_per_group=false", "reward.name=smoothness")
SMALL = ["--set", "model.resolution=32", "--set", f"sampling.steps={STEPS}", "--set", "train.iterations=2",
         "--set", "progress=false", "--set", "sampling.same_noise_per_group=false"]


def session(*overrides):
    return Session(tiny_config(*DGPO, *overrides))


def collect(s, seed=0):
    """The iteration-0 batch with advantages spread over [-2, 2] summing to 0 in each group (the tiny model's
    rewards barely differ), so that every term of the loss matters."""
    batch = s.collect(0).batch
    a = torch.randn(batch.batch_size, generator=torch.Generator().manual_seed(seeded(seed)), dtype=batch.latents.dtype)
    a = a.view(-1, G)
    batch.advantages = (a - a.mean(1, keepdim=True)).reshape(-1)
    return batch


def reference_gradient(policy, ref, batch, eps, t, timesteps, beta, kl_beta=0.0, kl_ref=None):
    """d L / d theta from the paper's DGPO objective, one graph in float64:
    L = 1/(K P beta) sum_k sum_g -log sigmoid(-beta/G [sum_{G+} |A| (l_theta - l_ref) - sum_{G-} |A| (l_theta - l_ref)])
    with l_m = mean (v_m(x_t, t) - (eps - x0))^2, x_t = (1-t) x0 + t eps; plus kl_beta/(B K) sum mean (v - v_kl)^2,
    v_kl the velocity of ``kl_ref`` (default: ``ref``)."""
    kl_ref = ref if kl_ref is None else kl_ref
    params = [p for _, p in policy.named_parameters()]
    b, k = batch.train_steps.shape
    p = b // G
    total = 0
    for s in range(k):
        for g in range(p):
            positive, negative = 0, 0
            for i in range(g * G, (g + 1) * G):
                x0 = batch.latents[i, -1]
                x_t = (1 - t[i, s]) * x0 + t[i, s] * eps[i, s]
                args = (x_t[None], timesteps[i, s].reshape(1), batch.cond[torch.tensor([i])])
                v = policy.velocity(*args)[0]
                with torch.no_grad():
                    v_ref = ref.velocity(*args)[0]
                    v_kl = kl_ref.velocity(*args)[0] if kl_beta else None
                target = eps[i, s] - x0
                delta = ((v - target) ** 2).mean() - ((v_ref - target) ** 2).mean()
                a = batch.advantages[i]
                if a > 0:
                    positive = positive + a.abs() * delta
                else:
                    negative = negative + a.abs() * delta
                if kl_beta:
                    total = total + kl_beta * ((v - v_kl) ** 2).mean() / (b * k)
            z = -beta / G * (positive - negative)
            total = total - torch.nn.functional.logsigmoid(z) / (k * p * beta)
    grads = torch.autograd.grad(total, params)
    return {n: g for (n, _), g in zip(policy.named_parameters(), grads)}


def grads_of(policy):
    return {n: p.grad.clone() for n, p in policy.named_parameters()}


@pytest.mark.parametrize("options", [
    (),
    ("method.beta=0.5", "method.micro_batch=4", "method.shared_noise=false"),
    ("method.time_distribution=uniform", "method.times_per_sample=3", "method.beta=20"),
    ("grpo.beta=0.05", "method.times_per_sample=2"),
    ("method.sampler=sana", "method.clip_dsm=false"),
])
def test_gradient_equals_the_papers_loss_written_out(options):
    s = session(*options)
    batch = collect(s)
    c = s.estimator.config
    eps, t, timesteps = s.estimator.draws(s.policy, batch)
    move_off_policy(s.policy, 3e-2)  # away from the reference: the implicit rewards differ from 0
    ref = s.reference if s.reference is not None else s.estimator.frozen
    s.estimator.accumulate(s.policy, batch, UpdateStats(0.1), s.reference)
    expected = reference_gradient(s.policy, ref, batch, eps, t, timesteps, c.beta, s.cfg.grpo.beta)
    assert relative_error(grads_of(s.policy), expected) <= 1e-10


@pytest.mark.parametrize("options", [
    (),
    ("method.clip_dsm=true", "grpo.clip_range=100", "grpo.beta=0.05", "method.micro_batch=4"),
])
def test_the_moving_average_as_the_dpo_reference(options):
    """``method.ema_reference`` (the code's ``use_ema_ref``): the gradient is the paper's loss written out with the
    moving average's errors as l_ref, the KL term's reference the starting weights. While the average is the policy
    every implicit reward is 0 and it is not forwarded; once it differs, one forward of it per (row, time) serves
    the clip (here too wide to act) and the reference, and the starting weights are forwarded only for the KL term
    (with grpo.beta = 0 no copy of them is kept)."""
    s = session("method.ema_reference=true", "method.ema_decay_rate=0.3", *options)
    est, kl = s.estimator, s.cfg.grpo.beta
    assert not est.keeps_reference(s.cfg) and est.frozen is None
    batch = collect(s)
    b, k = batch.train_steps.shape
    eps, t, timesteps = est.draws(s.policy, batch)
    move_off_policy(s.policy, 3e-2)
    with counted(s.policy) as work:  # the average made at the rollout is the policy of version 0
        est.accumulate(s.policy, batch, UpdateStats(0.1), s.reference)
    assert work.as_dict() == {"forward_nograd": b * k if kl else 0, "forward_grad": b * k, "backward": b * k}
    expected = reference_gradient(s.policy, s.policy, batch, eps, t, timesteps, est.config.beta, kl, s.reference)
    assert relative_error(grads_of(s.policy), expected) <= 1e-10

    s.policy.version = 2  # two optimizer steps: the average takes in the weights with a decay of 0.3
    for p in s.policy.parameters():
        p.grad = None
    stats = UpdateStats(0.1)
    with counted(s.policy) as work:
        est.accumulate(s.policy, batch, stats, s.reference)
    assert work.as_dict() == {"forward_nograd": b * k * (2 if kl else 1), "forward_grad": b * k, "backward": b * k}
    assert stats.clipped == 0 and not est.ema.equals(s.policy)
    expected = reference_gradient(s.policy, est.ema.policy, batch, eps, t, timesteps, est.config.beta, kl,
                                  s.reference)
    assert relative_error(grads_of(s.policy), expected) <= 1e-10
    if kl:  # not the starting weights' loss
        start = reference_gradient(s.policy, s.reference, batch, eps, t, timesteps, est.config.beta, kl)
        assert relative_error(grads_of(s.policy), start) > 1e-3


def test_rollout_is_ode_and_times_are_shared_schedule_steps():
    a, b = session(), session()
    ba, bb = a.collect(0).batch, b.collect(0).batch
    assert torch.all(ba.log_probs == 0)
    for j in range(STEPS):  # Euler: x_{j+1} = x_j + (sigma_{j+1} - sigma_j) v_j
        x_next = ba.latents[:, j] + (ba.sigmas[j + 1] - ba.sigmas[j]) * ba.velocities[:, j]
        torch.testing.assert_close(x_next, ba.latents[:, j + 1], rtol=0, atol=1e-12)
    k = 4
    assert ba.train_steps.shape == (ba.batch_size, k) and torch.equal(ba.train_steps, bb.train_steps)
    assert torch.all(ba.train_steps == ba.train_steps[0]) and len(set(ba.train_steps[0].tolist())) == k
    assert int(ba.train_steps.max()) <= 4  # method.trunc_steps
    ea, ta, _ = a.estimator.draws(a.policy, ba)
    eb, tb, _ = b.estimator.draws(b.policy, bb)
    assert torch.equal(ea, eb) and torch.equal(ta, tb)
    torch.testing.assert_close(ta, ba.sigmas[ba.train_steps].to(ta.dtype))
    for g in range(ba.batch_size // G):  # shared_noise: one eps per group and time
        assert torch.equal(ea[g * G], ea[g * G + G - 1]) and not torch.equal(ea[0], ea[G])


def test_reference_is_the_start_of_the_run():
    s = session()
    frozen = s.estimator.frozen  # made when the run is set up, before a resumed run's checkpoint is loaded
    assert frozen is not None
    batch = s.collect(0).batch
    assert s.estimator.frozen is frozen
    x, ts, cond = batch.latents[:, 2], batch.timesteps[2].expand(batch.batch_size), batch.cond
    with torch.no_grad():
        before = frozen.velocity(x, ts, cond)
    s.update(batch)
    with torch.no_grad():
        assert not torch.equal(s.policy.velocity(x, ts, cond), before)
        assert torch.equal(frozen.velocity(x, ts, cond), before)
    s.collect(1)
    assert s.estimator.frozen is frozen
    with_kl = session("grpo.beta=0.01")  # the session's reference serves: no copy of its own
    with_kl.collect(0)
    assert with_kl.estimator.frozen is None and with_kl.reference is not None


@pytest.mark.parametrize("epochs", [1, 2])
def test_pass_counts(epochs):
    k = 3
    s = session(f"method.times_per_sample={k}", f"train.inner_epochs={epochs}", "method.micro_batch=4")
    batch = collect(s)
    with counted(s.policy) as passes:
        s.update(batch)
    b = batch.batch_size
    assert passes.as_dict() == {
        "forward_nograd": epochs * b * k, "forward_grad": epochs * b * k, "backward": epochs * b * k}


def test_kl_shares_the_reference_forward():
    s = session("method.times_per_sample=2", "grpo.beta=0.01")
    batch = collect(s)
    with counted(s.policy) as passes:
        s.update(batch)
    b = batch.batch_size
    assert passes.as_dict() == {"forward_nograd": b * 2, "forward_grad": b * 2, "backward": b * 2}


def test_uniform_times_accept_more_than_the_clip():
    s = session("method.times_per_sample=8", "method.time_distribution=uniform")
    batch = s.collect(0).batch
    assert torch.equal(batch.train_steps[0], torch.arange(8))


def test_runs_through_the_cli(tmp_path):
    out = tmp_path / "dgpo"
    assert main(["run", *SMALL, "--set", "method.name=dgpo", "--set", "method.times_per_sample=3",
                 "--out", str(out)]) == 0
    recs = list(read_jsonl(out / "metrics.jsonl"))
    assert [r["iteration"] for r in recs] == [0, 1]
    b = 4 * 2  # default grpo.group_size * grpo.prompts_per_iteration
    for r in recs:
        assert r["status"] == "ok" and r["method"] == "dgpo"
        assert r["forward_nograd"] == b * STEPS + b * 3  # the rollout, then the reference's velocities
        assert r["backward"] == r["forward_grad"] == b * 3


def test_preset_scales_the_public_schedule_and_loads_with_random_weights():
    cfg = check_config(load_config(PRESET))
    o = cfg.method.options
    assert cfg.method.name == "dgpo" and cfg.model.preset == "tiny" and cfg.device == "cpu"
    assert (o.beta, o.times_per_sample, o.time_distribution, o.trunc_steps, o.shared_noise, o.sampler) == \
        (100.0, 4, "schedule", 4, True, "sana")
    assert cfg.sampling.shift == 3.0  # the scheduler's flow_shift
    assert (cfg.sampling.steps, cfg.grpo.adv_clip_max, cfg.grpo.beta, cfg.train.lr) == (10, 5.0, 0.02, 3e-4)
    # train.ema: decay 0.9, update_step_interval 8, ema.step after each of the epoch's 2 batches
    assert (cfg.train.eval_ema, cfg.train.eval_ema_every, cfg.train.eval_ema_updates) == (0.9, 8, 2)
    assert check_config(load_config(PRESET, ["model.preset=random"])).model.preset == "random"



def sana_scheduler(steps: int) -> DPMSolverMultistepScheduler:
    """The public sampler: Sana_1600M's scheduler config with flow_shift 3 (``scripts/train_sd3_dgpo.py``), the
    values its diffusers conversion writes and the rest the scheduler's defaults."""
    scheduler = DPMSolverMultistepScheduler(flow_shift=3, use_flow_sigmas=True, prediction_type="flow_prediction")
    scheduler.set_timesteps(steps)
    return scheduler


def dpm_solver_2m_reference(velocity, x, sigmas, timesteps):
    """The rollout written out in float64: at each step the model's velocity at the integer timestep, the data
    prediction D_j = x_j - s_j v_j, lambda_j = log((1 - s_j) / s_j), h = lambda_{j+1} - lambda_j, and
    x_{j+1} = (s_{j+1} / s_j) x_j - (1 - s_{j+1}) (e^{-h} - 1) D with D = D_j at the first step, D_j
    (= x_{j+1}) into sigma 0, and D = (1 + 1 / (2 r)) D_j - D_{j-1} / (2 r), r = (lambda_j - lambda_{j-1}) / h,
    between (DPM-Solver++(2M), arXiv 2211.01095 Algorithm 2)."""
    s = [float(v) for v in sigmas]
    lam = [math.log((1 - v) / v) for v in s[:-1]]
    states, previous = [x], None
    for j in range(len(s) - 1):
        d_j = x - s[j] * velocity(x, timesteps[j])
        if s[j + 1] == 0:
            x = d_j
        else:
            h = math.log((1 - s[j + 1]) / s[j + 1]) - lam[j]
            d = d_j
            if previous is not None:
                r = (lam[j] - lam[j - 1]) / h
                d = (1 + 1 / (2 * r)) * d_j - previous / (2 * r)
            x = (s[j + 1] / s[j]) * x - (1 - s[j + 1]) * math.expm1(-h) * d
        states.append(x)
        previous = d_j
    return torch.stack(states, 1)


@pytest.mark.parametrize("guidance", [1.0, 4.5])
def test_sana_rollout_is_dpm_solver_2m_on_the_schedulers_grid_at_integer_timesteps(guidance):
    """``method.sampler=sana``: the rollout's grid and the transformer's timesteps are the public scheduler's, every
    state is DPM-Solver++(2M) written out here with the model evaluated afresh at the integer timesteps, one
    forward per sample and step (two with guidance), as the Euler rollout."""
    s = session("method.sampler=sana", f"method.rollout_guidance={guidance}")
    with counted(s.policy) as passes:
        batch = s.collect(0).batch
    b = batch.batch_size
    calls = 1 if guidance == 1 else 2
    assert passes.as_dict() == {"forward_nograd": calls * b * STEPS, "forward_grad": 0, "backward": 0}
    scheduler = sana_scheduler(STEPS)
    assert torch.equal(batch.sigmas, scheduler.sigmas.to(torch.float64))
    assert torch.equal(batch.timesteps, scheduler.timesteps.to(batch.timesteps.dtype))
    assert torch.all(batch.log_probs == 0)
    empty = None if guidance == 1 else s.estimator.unconditional.repeat_interleave(b)

    def velocity(x, timestep):
        with torch.no_grad():
            t = torch.tensor(float(timestep), dtype=torch.float64).expand(b)
            v_c = s.policy.velocity(x, t, batch.cond)
            if empty is None:
                return v_c
            v_u = s.policy.velocity(x, t, empty)
            return v_u + guidance * (v_c - v_u)

    expected = dpm_solver_2m_reference(velocity, batch.latents[:, 0], scheduler.sigmas, scheduler.timesteps.tolist())
    assert float((batch.latents - expected).abs().max() / expected.abs().max()) <= 1e-12
    euler = session(f"method.rollout_guidance={guidance}").collect(0).batch
    assert torch.equal(euler.latents[:, 0], batch.latents[:, 0])  # the same noise, another sampler
    assert not torch.allclose(euler.latents[:, -1], batch.latents[:, -1])


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_sana_training_noise_level_is_the_timestep_over_1000(dtype):
    """The training step noises x0 at t = timestep / 1000 of the drawn schedule steps, as the code's
    ``sigmas_t = (t / 1000)`` of the scheduler's int64 timesteps (not the grid's sigma), and gives the
    transformer the integer timestep; the steps are drawn as the Euler sampler's."""
    s = Session(tiny_config(*DGPO, "method.sampler=sana", "method.times_per_sample=3", dtype=dtype))
    batch = s.collect(0).batch
    eps, t, timesteps = s.estimator.draws(s.policy, batch)
    steps = batch.train_steps
    public = sana_scheduler(STEPS).timesteps.repeat(batch.batch_size, 1)  # the code's samples["timesteps"]
    code_t = torch.stack([public[:, j] / 1000 for j in steps[0].tolist()], 1)  # int64 / 1000: float32
    assert torch.equal(t, code_t.to(t.dtype) if dtype == "float32" else public.gather(1, steps).double() / 1000)
    assert t.dtype == batch.latents.dtype and torch.equal(timesteps, public.gather(1, steps).to(timesteps.dtype))
    assert not torch.equal(t, batch.sigmas[steps].to(t.dtype))  # the grid's sigma is not the noise level
    assert float((t - batch.sigmas[steps].to(t.dtype)).abs().max()) < 1e-3
    euler = Session(tiny_config(*DGPO, "method.times_per_sample=3", dtype=dtype)).collect(0).batch
    assert torch.equal(euler.train_steps, steps)


def test_sana_refuses_a_schedule_it_would_not_use():
    """``method.sampler=sana`` samples and draws its times on its scheduler's own grid: ``sampling.schedule:
    linspace`` would change nothing, so it is refused naming the key (as the sweep's check refuses it)."""
    from agg_bench.errors import ConfigError

    with pytest.raises(ConfigError) as err:
        session("method.sampler=sana", "sampling.schedule=linspace")
    assert err.value.key == "sampling.schedule" and "method.sampler=sana" in str(err.value)
    assert "\n" not in str(err.value)
    session("method.sampler=euler", "sampling.schedule=linspace")  # Euler samples on the run's schedule


def test_sana_needs_a_shift_number(tmp_path, capsys):
    """With ``sampling.shift: null`` (the model's own scheduler shift) the scheduler has no flow_shift: one line
    naming sampling.shift, exit 2, nothing written."""
    from agg_bench.errors import ConfigError

    with pytest.raises(ConfigError) as err:
        session("method.sampler=sana", "sampling.shift=null")
    assert err.value.key == "sampling.shift" and "method.sampler=sana" in str(err.value)
    out = tmp_path / "x"
    capsys.readouterr()
    assert main(["run", *SMALL, "--set", "method.name=dgpo", "--set", "method.sampler=sana",
                 "--set", "sampling.shift=null", "--out", str(out)]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "sampling.shift" in lines[0] and "Traceback" not in lines[0]
    assert not out.exists()


@pytest.mark.parametrize("method, value, allowed", [
    ("dgpo", "dpm2", "expected one of ['euler', 'sana']"),  # the step alone is nft's solver, not a dgpo sampler
    ("dgpo", "1", "expected one of ['euler', 'sana']"),
    ("dgpo", "[sana]", "expected one of ['euler', 'sana']"),
    ("dgpo", "null", "expected one of ['euler', 'sana']"),
    ("nft", "sana", "a known option of method 'nft'"),  # DGPO's option alone
    ("awm", "sana", "a known option of method 'awm'"),
])
def test_bad_sampler_values_are_one_line_exit_2(method, value, allowed, tmp_path, capsys):
    from baselines.dgpo import DGPOConfig

    assert DGPOConfig().sampler == "euler"  # the default keeps the Euler rollout of the records made before it
    out = tmp_path / "x"
    capsys.readouterr()
    assert main(["run", *SMALL, "--set", f"method.name={method}", "--set", f"method.sampler={value}",
                 "--out", str(out)]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "method.sampler" in line and allowed in line and "Traceback" not in line
    assert not out.exists()


@pytest.mark.parametrize("section, key, value", [
    ("method", "ema_reference", "yes"), ("method", "ema_reference", 1), ("method", "ema_reference", None),
    ("method", "ema_reference", ""), ("train", "eval_ema_updates", 0), ("train", "eval_ema_updates", -2),
    ("train", "eval_ema_updates", 2.5), ("train", "eval_ema_updates", "two"), ("train", "eval_ema_updates", 10**9),
    ("train", "eval_ema_updates", float("nan")),
])
def test_a_bad_value_of_the_public_recipes_keys_in_a_config_is_one_line_exit_2(section, key, value, tmp_path, capsys):
    """The preset with one bad value of ``method.ema_reference`` or ``train.eval_ema_updates``, run with ``--config``:
    one line naming the key, exit 2, no output folder."""
    import yaml

    config = yaml.safe_load(PRESET.read_text())
    config[section][key] = value
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(config))
    out = tmp_path / "x"
    capsys.readouterr()
    assert main(["run", "--config", str(path), "--out", str(out)]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert f"{section}.{key} = " in line and "Traceback" not in line, line
    assert not out.exists()
