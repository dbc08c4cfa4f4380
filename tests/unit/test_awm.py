"""Advantage-Weighted Matching: the update against a float64 reference written from the paper's equation,
pass counts, the time distributions and the preset's values (bad options, the replay scope and a run of the
preset: tests/unit/test_final_latent.py, for the three likelihood-free methods)."""
from pathlib import Path

import pytest
import torch

from agg_bench.config import load_config
from agg_bench.runtime.config_check import check_config
from agg_bench.engine.grpo import UpdateStats
from agg_bench.runtime.train import Session
from baselines.awm import draw_times
from helpers import counted, move_off_policy, relative_error, sa_solver_reference, seeded, tiny_config

ROOT = Path(__file__).resolve().parents[2]
PRESET = ROOT / "config/presets/awm.yaml"
STEPS = 6  # sampling.steps in helpers.TINY
K = 3
AWM = ["method.name=awm", "sampling.same_noise_per_group=false"]  # an ODE group needs its own noises
NOISY = [*AWM, f"method.times_per_sample={K}", "method.solver=sa_solver", "method.sa_solver_tau=0.4"]


def reference_gradient(session, batch, weighting="uniform", power=0.25):
    """dL/dtheta of the paper's loss, one graph over every (sample, time), float64, from the rewards:
    L = 1/(BK) sum_ik A_i w(||v_theta(x_t, t) - (eps - x0)||^2 mean, t) + beta mean ||v_theta - v_ref||^2."""
    est, policy = session.estimator, session.policy
    cfg = session.cfg
    r = session.last_rewards.view(-1, cfg.grpo.group_size)
    a = ((r - r.mean(1, keepdim=True)) / (r.std(1, unbiased=False, keepdim=True) + 1e-8)).view(-1)
    a = a.clamp(-cfg.grpo.adv_clip_max, cfg.grpo.adv_clip_max) / cfg.grpo.adv_clip_max * est.config.advantage_max
    x0 = batch.latents[:, -1]
    b = x0.shape[0]
    eps = torch.randn((b, K, *x0.shape[1:]), generator=torch.Generator().manual_seed(est.noise_seed),
                      dtype=torch.float64)
    for p in policy.parameters():
        p.grad = None
    total = 0
    for i in range(b):
        for k in range(K):
            t = est.times[i, k]
            x_t = (1 - t) * x0[i:i + 1] + t * eps[i:i + 1, k]
            ts = (t * 1000).view(1)
            v = policy.velocity(x_t, ts, batch.cond[[i]])
            e = ((v - (eps[i:i + 1, k] - x0[i:i + 1])) ** 2).mean()
            if weighting == "ghuber":
                e = ((e + 1e-10) ** power - 1e-10 ** power) * t / power
            term = a[i] * e
            if cfg.grpo.beta > 0:
                with torch.no_grad():
                    v_ref = session.reference.velocity(x_t, ts, batch.cond[[i]])
                term = term + cfg.grpo.beta * ((v - v_ref) ** 2).mean()
            total = total + term
    (total / (b * K)).backward()
    grads = {n: p.grad.clone() for n, p in policy.named_parameters()}
    for p in policy.parameters():
        p.grad = None
    return grads


@pytest.mark.parametrize("options", [["method.time_distribution=uniform"],
                                     ["method.time_distribution=discrete", "method.weighting=ghuber"],
                                     ["method.time_distribution=logit_normal", "grpo.beta=0.01",
                                      "method.micro_batch=4"],
                                     ["method.time_distribution=logit_normal", "method.times_shared_by=4"]])
def test_gradient_equals_the_papers_loss_and_counts_passes(options):
    session = Session(tiny_config(*AWM, f"method.times_per_sample={K}", *options))
    rollout = session.collect(0)
    batch = rollout.batch
    session.last_rewards = rollout.rewards
    assert torch.equal(batch.train_steps, torch.arange(K).expand(batch.batch_size, K))
    move_off_policy(session.policy)
    c = session.estimator.config
    reference = reference_gradient(session, batch, c.weighting, c.ghuber_power)
    session.policy.counter.reset()
    session.estimator.accumulate(session.policy, batch, UpdateStats(batch.clip_range), session.reference)
    grads = {n: p.grad for n, p in session.policy.named_parameters()}
    assert relative_error(grads, reference) <= 1e-10
    b = batch.batch_size
    nograd = b * K if session.cfg.grpo.beta > 0 else 0
    assert session.policy.counter.as_dict() == {"forward_nograd": nograd, "forward_grad": b * K, "backward": b * K}


def test_rollout_is_ode_and_update_counts():
    session = Session(tiny_config(*AWM, f"method.times_per_sample={K}"))
    with counted(session.policy) as rollout:
        batch = session.collect(0).batch
    b = batch.batch_size
    assert rollout.as_dict() == {"forward_nograd": b * STEPS, "forward_grad": 0, "backward": 0}
    with counted(session.policy) as update:
        session.update(batch)
    assert update.as_dict() == {"forward_nograd": 0, "forward_grad": b * K, "backward": b * K}


def test_sa_solver_rollout_is_the_public_sampler_at_one_forward_per_step():
    """``method.solver=sa_solver``: the rollout samples on AWM's grid (first sigma 1 - 1e-3, the last nonzero one
    half the one before) and every state is SA-Solver's (tests/helpers.py, from the paper's equations) from the
    velocities the rollout recorded, with one no-grad forward per sample and step, as the Euler rollout; the
    schedule times the update draws are the schedule's own (never the two changed sigmas); the final images
    differ from Euler's."""
    from agg_bench.engine.solvers import sa_solver_grid

    session = Session(tiny_config(*AWM, f"method.times_per_sample={K}", "method.solver=sa_solver"))
    with counted(session.policy) as passes:
        batch = session.collect(0).batch
    b = batch.batch_size
    assert passes.as_dict() == {"forward_nograd": b * STEPS, "forward_grad": 0, "backward": 0}
    assert torch.equal(batch.sigmas.cpu(), sa_solver_grid(session.sigmas).to(batch.sigmas.dtype))
    assert float(batch.sigmas[0]) == 1 - 1e-3 and torch.all(batch.log_probs == 0)
    expected = sa_solver_reference(batch.sigmas, batch.latents[:, 0], lambda j, y: batch.velocities[:, j])
    torch.testing.assert_close(torch.stack(expected["states"], 1), batch.latents, rtol=1e-10, atol=1e-12)
    times = session.estimator.times.to(session.sigmas.dtype)
    assert all(bool((session.sigmas[1:-2] == t).any()) for t in times.flatten())
    euler = Session(tiny_config(*AWM, f"method.times_per_sample={K}")).collect(0).batch
    assert torch.equal(euler.latents[:, 0], batch.latents[:, 0])
    assert not torch.allclose(euler.latents[:, -1], batch.latents[:, -1])


def noisy_rollout(*options, monkeypatch=None):
    """A tiny run with SA-Solver's noise (tau 0.4, the preset's) after ``options``: its first rollout's batch,
    the draws its rule took (recorded where ``monkeypatch`` is given) and its forwards."""
    from agg_bench.engine.solvers import SASolver

    draws: list = []
    if monkeypatch is not None:
        draw = SASolver.draw
        monkeypatch.setattr(SASolver, "draw", lambda self, j, like: (draws.append(draw(self, j, like)), draws[-1])[1])
    session = Session(tiny_config(*NOISY, *options))
    with counted(session.policy) as passes:
        batch = session.collect(0).batch
    return session, batch, draws, passes.as_dict()


def test_sa_solver_noise_is_drawn_on_the_windows_steps_at_one_forward_per_step(monkeypatch):
    """``method.sa_solver_tau=0.4``: the tiny schedule's grid steps into sigmas in [0.3, 0.9] at steps 1, 2 and 3;
    the rule draws one noise of the batch's shape there and nowhere else, from the iteration's generator after the
    initial noise, and every state is SA-Solver's with that
    noise (tests/helpers.py, the paper's stochastic equations fed the same draws) from the velocities the rollout
    recorded; one no-grad forward per sample and step; log-probability 0 on every step (the update needs none).
    The states are the ODE's up to the first noisy step's, then differ."""
    from agg_bench.engine.solvers import sa_solver_taus

    session, batch, draws, passes = noisy_rollout(monkeypatch=monkeypatch)
    b = batch.batch_size
    assert passes == {"forward_nograd": b * STEPS, "forward_grad": 0, "backward": 0}
    taus = sa_solver_taus(batch.sigmas, 0.4)
    assert taus == [0.0, 0.4, 0.4, 0.4, 0.0, 0.0]
    assert [d is not None for d in draws] == [tau > 0 for tau in taus[:-1]]  # the last step draws nothing
    gen, prompts, _ = session.rollout_prompts(0)  # the iteration's generator after its prompts, its noise, then xi
    assert torch.equal(session.rollout_noise(len(prompts), gen).to(batch.latents.dtype), batch.latents[:, 0])
    for d in draws:
        assert d is None or torch.equal(d, torch.randn(batch.latents[:, 0].shape, generator=gen, dtype=d.dtype))
    assert torch.all(batch.log_probs == 0)
    expected = sa_solver_reference(batch.sigmas, batch.latents[:, 0], lambda j, y: batch.velocities[:, j], taus,
                                   [*draws, None])
    torch.testing.assert_close(torch.stack(expected["states"], 1), batch.latents, rtol=1e-10, atol=1e-12)
    ode = Session(tiny_config(*AWM, f"method.times_per_sample={K}", "method.solver=sa_solver")).collect(0).batch
    assert torch.equal(ode.latents[:, :2], batch.latents[:, :2])
    assert not torch.allclose(ode.latents[:, 2], batch.latents[:, 2])
    assert not torch.allclose(ode.latents[:, -1], batch.latents[:, -1])


def test_sa_solver_noise_is_the_seeds():
    """The same seed samples the same images (and a run that starts at iteration 1, as a resumed one, draws what
    the uninterrupted one drew there: each iteration's draws come from its own generator); another seed others."""
    first, batch, _, _ = noisy_rollout()
    again = noisy_rollout()[1]
    assert torch.equal(batch.latents, again.latents)
    other = noisy_rollout("seed=1")[1]
    assert not torch.allclose(other.latents[:, -1], batch.latents[:, -1])
    resumed = Session(tiny_config(*NOISY))
    assert torch.equal(first.collect(1).batch.latents, resumed.collect(1).batch.latents)


def test_sa_solver_times_are_the_schedules_at_two_steps():
    """At 2 steps the discrete times' one index, 1, is the sigma SA-Solver's grid halves: the times are the run
    schedule's, as the code draws them from its scheduler's timesteps."""
    session = Session(tiny_config(*AWM, "method.times_per_sample=2", "method.solver=sa_solver", "sampling.steps=2"))
    batch = session.collect(0).batch
    assert float(batch.sigmas[1]) == float(session.sigmas[0]) / 2 != float(session.sigmas[1])
    assert torch.all(session.estimator.times == float(session.sigmas[1]))


def test_sa_solver_needs_a_known_name_and_a_schedule_it_takes(tmp_path, capsys):
    """A bad ``method.solver``, or ``sa_solver`` with one step or with so many that the schedule's second sigma
    is above its grid's first (1 - 1e-3; shift 3, 400 steps: 0.99917): one line naming the key, exit 2, nothing
    written."""
    from agg_bench.cli import main

    for sets in (["method.solver=sa_solver", "method.times_per_sample=2", "sampling.steps=1"],
                 ["method.solver=sa_solver", "sampling.steps=400"],
                 ["method.solver=rk4"], ["method.solver=dpm2"], ["method.solver=2"], ["method.solver=null"],
                 ["method.solver=.nan"], ["method.solver=euler", "method.sa_solver_tau=0.4"]):
        key = sets[-1].split("=")[0]
        out = tmp_path / "run"
        args = [a for item in ["model.resolution=32", "train.iterations=1", "progress=false", *sets]
                for a in ("--set", item)]
        capsys.readouterr()
        assert main(["run", "--config", str(PRESET), *args, "--out", str(out)]) == 2
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and f"{key} = " in lines[0], lines
        assert "nan" in sets[-1] or "sa_solver" in lines[0]  # what is allowed (NaN: a finite number)
        assert not out.exists()


def test_times_follow_the_distributions():
    sigmas = torch.linspace(1, 0, 15, dtype=torch.float64)
    t = draw_times("discrete", 6, 4, sigmas, 3.0, torch.Generator().manual_seed(seeded(0)))
    index = [int((sigmas - s).abs().argmin()) for s in t[0]]
    bounds = torch.linspace(1, 12, 7).long()  # int(14 * 0.9) = 12, 6 strata
    assert all(int(lo) <= j <= max(int(lo), int(hi) - 1) for j, lo, hi in zip(index, bounds[:-1], bounds[1:]))
    assert torch.equal(t, t[:1].expand(4, 6))  # one time per slot, shared by the samples
    t = draw_times("logit_normal", 6, 2, sigmas, 3.0, torch.Generator().manual_seed(seeded(0)))
    assert bool(((t >= 0.01) & (t < 1)).all()) and torch.equal(t[0], t[1])
    t = draw_times("uniform", 6, 2, sigmas, 3.0, torch.Generator().manual_seed(seeded(0)))
    assert not torch.equal(t[0], t[1])


def partition(times: torch.Tensor) -> list[tuple[int, ...]]:
    """The sets of rows that share their times, each in row order, sorted."""
    sets: dict[tuple, list[int]] = {}
    for i, row in enumerate(times.tolist()):
        sets.setdefault(tuple(row), []).append(i)
    return sorted(tuple(v) for v in sets.values())


@pytest.mark.parametrize("n", [None, 1, 2, 4])
def test_times_are_drawn_per_set_of_shuffled_samples(n):
    """``times_shared_by`` n: the batch's rows, shuffled, in sets of n (the last smaller), each with its own
    draw of the K times; null: one draw for the whole batch. The same seed draws the same sets."""
    opts = [*AWM, f"method.times_per_sample={K}", "method.time_distribution=logit_normal",
            f"method.times_shared_by={'null' if n is None else n}"]
    a, b = Session(tiny_config(*opts)), Session(tiny_config(*opts))
    partitions = []
    for it in range(3):
        a.collect(it)
        b.collect(it)
        assert torch.equal(a.estimator.times, b.estimator.times)
        rows = a.estimator.times.shape[0]
        got = partition(a.estimator.times)
        size = rows if n is None else n
        assert sorted(len(p) for p in got) == sorted([size] * (rows // size) + ([rows % size] if rows % size else []))
        assert sorted(i for p in got for i in p) == list(range(rows))
        partitions.append(got)
    consecutive = sorted(tuple(range(i, min(i + (n or rows), rows))) for i in range(0, rows, n or rows))
    if n not in (None, 1):  # the sets are drawn, not consecutive rows (a group's samples would share them)
        assert any(p != consecutive for p in partitions)


def test_preset_scales_the_public_setting_and_loads_with_random_weights():
    cfg = check_config(load_config(PRESET))
    options = cfg.method.options
    assert (cfg.sampling.steps, cfg.sampling.shift, cfg.grpo.beta, cfg.grpo.adv_clip_max) == (14, 3.0, 0.001, 5.0)
    assert (options.times_per_sample, options.time_distribution, options.advantage_max) == (6, "discrete", 1.0)
    assert options.times_shared_by == 3  # train.batch_size
    assert options.solver == "sa_solver"  # train.use_sa_solver
    assert (cfg.train.eval_ema, cfg.train.eval_ema_every) == (0.99, 1)  # train.ema, ema_decay, its interval
    assert check_config(load_config(PRESET, ["model.preset=random"])).model.preset == "random"



def test_logit_normal_times_need_a_shift_of_their_own(tmp_path, capsys):
    """A null sampling.shift leaves the schedule to the model's scheduler config; logit-normal times are
    shifted by the recipe's own number (time_shift), so that pair is refused by the method's run check, which
    the workflow's method check also runs (it ended in a TypeError in the first update). Schedule times
    (discrete) take their sigmas from the rollout and run with a null shift."""
    from agg_bench.cli import main
    from agg_bench.errors import ConfigError, UserError
    from agg_bench.methods.base import build_estimator
    from agg_bench.tools.sweep import check_methods

    bad = [*AWM, "method.time_distribution=logit_normal", "sampling.shift=null"]
    cfg = tiny_config(*bad)
    with pytest.raises(ConfigError) as err:
        build_estimator(cfg).check_run(cfg)
    assert err.value.key == "sampling.shift" and "logit_normal" in str(err.value)
    with pytest.raises(UserError, match="sampling.shift"):
        check_methods(str(PRESET), {"job": [("method.time_distribution", "logit_normal"), ("sampling.shift", None)]})
    out = tmp_path / "run"
    args = [a for item in ["model.resolution=32", "train.iterations=1", "progress=false",
                           "method.time_distribution=logit_normal", "sampling.shift=null"] for a in ("--set", item)]
    capsys.readouterr()
    assert main(["run", "--config", str(PRESET), *args, "--out", str(out)]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "sampling.shift" in lines[0] and not out.exists()
    discrete = tiny_config(*AWM, "sampling.shift=null")
    build_estimator(discrete).check_run(discrete)
    session = Session(discrete)
    session.update(session.collect(0).batch)  # the schedule's times: no shift needed
