"""MixGRPO-Flash (baselines/mixgrpo_flash.py): Euler before the window, the SDE in it, DPM-Solver++ on a
compressed grid after it; the rollout against a float64 reference written here from the paper's update
equations, its forward count, the gradient of the window steps, the options and the preset."""
import math
from pathlib import Path

import pytest
import torch

from agg_bench.cli import main
from agg_bench.config import load_config
from agg_bench.runtime.config_check import check_config
from agg_bench.engine.sampler import flow_sigmas
from agg_bench.errors import ConfigError
from agg_bench.io import read_jsonl
from agg_bench.methods.base import build_method
from agg_bench.runtime.train import Session
from baselines.mixgrpo_flash import post_window_grid
from helpers import (estimator_gradient, gaussian_log_prob, move_off_policy, one_graph_gradient, relative_error,
                     sde_reference, seeded, tiny_config)

ROOT = Path(__file__).resolve().parents[2]
PRESET = ROOT / "config/presets/mixgrpo_flash.yaml"
STEPS = 10
SMALL = ["--set", "model.resolution=32", "--set", f"sampling.steps={STEPS}", "--set", "train.iterations=2",
         "--set", "progress=false", "--set", "grpo.prompts_per_iteration=1", "--set", "grpo.group_size=3"]


def flash(*overrides, dtype="float64"):
    return tiny_config("method.name=mixgrpo_flash", f"sampling.steps={STEPS}", *overrides, dtype=dtype)


def shift_grid(t, a):
    return [a * u / (1 + (a - 1) * u) for u in t]


def reference_grid(sigmas, last, ratio, a):
    """MixGRPO-Flash's grid (run_sample_step): num_post = max(int((T - L) r), 1) points from s_{L+1} to 0,
    linear in the unshifted time, at least 2 so that it reaches 0."""
    s = [float(v) for v in sigmas]
    steps = len(s) - 1
    if last + 1 >= steps:
        return s
    n = max(int((steps - last) * ratio), 1)
    n = max(n, 2)
    t0 = s[last + 1] / (a - (a - 1) * s[last + 1])
    post = shift_grid([t0 * (1 - i / (n - 1)) for i in range(n)], a)
    return s[: last + 1] + [s[last + 1]] + post[1:]


@torch.no_grad()
def reference_rollout(policy, cond, noise, grid, start, last, sde, eta, order, generator):
    """Float64 rollout written from the update equations: Euler x + (s' - s) v before the window; the SDE
    transition (helpers.sde_reference) with noise drawn from ``generator`` inside it; after it DPM-Solver++
    (arXiv 2211.01095, Algorithm 2, alpha = 1 - s, sigma = s, x0 = x - s v), second order on the prediction
    of the step before (the window's last step included), first order into sigma 0."""
    lam = [math.log((1 - s) / s) if 0 < s < 1 else (math.inf if s == 0 else -math.inf) for s in grid]
    x = noise.to(torch.float64)
    states, log_probs, x0_before = [x], [], None
    for j in range(len(grid) - 1):
        s, s_next = grid[j], grid[j + 1]
        t = torch.full((x.shape[0],), s * policy.timestep_scale, dtype=policy.dtype)
        v = policy.velocity(x, t, cond).to(torch.float64)
        x0 = x - s * v
        lp = torch.zeros(x.shape[0], dtype=torch.float64)
        if j < start:
            x = x + (s_next - s) * v
        elif j <= last:
            mean, sd = sde_reference(sde, v, x, s, s_next, eta, grid[1])
            x = mean + sd * torch.randn(x.shape, generator=generator, dtype=torch.float64)
            lp = torch.stack([gaussian_log_prob(x[i], mean[i], sd) for i in range(x.shape[0])])
        else:
            h = lam[j + 1] - lam[j]
            d = x0
            if order == 2 and s_next > 0:
                r = (lam[j] - lam[j - 1]) / h
                d = (1 + 1 / (2 * r)) * x0 - 1 / (2 * r) * x0_before
            x = (s_next / s) * x - (1 - s_next) * (math.exp(-h) - 1) * d
        x0_before = x0
        states.append(x)
        log_probs.append(lp)
    return torch.stack(states, 1), torch.stack(log_probs, 1)


def rollout_of(session, iteration=0, seed=7):
    """The session's method's rollout of iteration ``iteration`` on fresh noise, its generator's state before,
    and the rollout's forwards."""
    gen = torch.Generator().manual_seed(seeded(seed))
    b = 3
    noise = torch.randn((b, *session.latent_shape), generator=gen, dtype=torch.float64)
    cond = session.cond_all[torch.zeros(b, dtype=torch.long)]
    state = gen.get_state()
    session.policy.counter.reset()
    traj = session.estimator.rollout(session.policy, cond, noise, session.sigmas, session.cfg.sampling, gen, iteration,
                                     session.cfg.grpo.group_size)
    return traj, noise, cond, state, session.policy.counter.forward_nograd


# ----- the grid -------------------------------------------------------------------------------

@pytest.mark.parametrize("last, ratio, steps_after", [
    (3, 0.4, 7),    # Flash, window 0..3 of 25: 22 * 0.4 -> 8 points, 7 solver steps
    (3, 0.2, 3),    # Flash*: 22 * 0.2 -> 4 points
    (14, 0.4, 3),   # Flash, window 11..14: 11 * 0.4 -> 4 points
    (22, 0.4, 1),   # 3 * 0.4 -> 1 point in the public code, a grid that never reaches 0: 2 here
    (23, 0.4, 1),   # one step left after the window: the same step
    (24, 0.4, 0),   # the window ends the schedule: nothing after it
    (3, 1.0, 21),
])
def test_the_grid_after_the_window_is_compressed_as_mixgrpo_flash_does(last, ratio, steps_after):
    sigmas = flow_sigmas(25, 3.0)
    grid = post_window_grid(sigmas, last, ratio, 3.0)
    assert grid.numel() - 1 == min(last + 1 + steps_after, 25)
    assert torch.equal(grid[: last + 2], sigmas[: last + 2])  # the window's steps keep their sigmas
    assert float(grid[-1]) == 0 and bool(torch.all(grid[1:] < grid[:-1]))
    expected = torch.tensor(reference_grid(sigmas, last, ratio, 3.0), dtype=torch.float64)
    assert float((grid - expected).abs().max()) <= 1e-15


# ----- the rollout --------------------------------------------------------------------------

@pytest.mark.parametrize("sde, start, size, order, ratio", [
    ("flow_grpo", 2, 3, 2, 0.8),    # (10 - 4) * 0.8 -> 4 points: three solver steps, the first on step 4's x0
    ("flow_grpo", 0, 4, 2, 0.2),    # 7 * 0.2 -> 1 point, 2 with the guard: one step into 0
    ("dance_grpo", 1, 2, 1, 0.7),
    ("cps", 3, 2, 2, 1.0),
])
def test_rollout_equals_the_float64_reference_on_the_same_noise(sde, start, size, order, ratio):
    session = Session(flash("method.window_mode=fixed", f"method.window_start={start}", f"method.window_size={size}",
                            f"method.solver_order={order}", f"method.post_compress_ratio={ratio}",
                            f"sampling.sde={sde}", "sampling.eta=0.7", "model.resolution=16"))
    traj, noise, cond, state, forwards = rollout_of(session)
    last = start + size - 1
    grid = reference_grid(session.sigmas, last, ratio, session.cfg.sampling.shift)
    gen = torch.Generator()
    gen.set_state(state)
    latents, log_probs = reference_rollout(session.policy, cond, noise, grid, start, last, sde, 0.7, order, gen)

    assert traj.sigmas.numel() == len(grid)
    assert float((traj.sigmas - torch.tensor(grid, dtype=torch.float64)).abs().max()) <= 1e-15
    assert float((traj.latents - latents).abs().max() / latents.abs().max()) <= 1e-12
    assert float((traj.log_probs - log_probs).abs().max()) <= 1e-10 * float(log_probs.abs().max())
    window = torch.zeros(len(grid) - 1, dtype=torch.bool)
    window[start: last + 1] = True
    assert torch.equal(traj.sde_mask, window)
    assert torch.all(traj.log_probs[:, ~window] == 0) and torch.all(traj.log_probs[:, window] != 0)
    assert forwards == noise.shape[0] * (len(grid) - 1)


@pytest.mark.parametrize("start, ratio, steps", [(0, 0.4, 5), (0, 0.2, 5), (2, 0.4, 7), (6, 0.4, 10), (3, 1.0, 10)])
def test_rollout_forwards_drop_to_the_compressed_grid(start, ratio, steps):
    """Forwards of one rollout of 10 steps, window of 4 starting at ``start`` (``window``: 10 per sample):
    start 0 leaves (10 - 3) * 0.4 -> 2 points after the window, one step; start 6 ends the schedule."""
    options = ("method.window_mode=fixed", f"method.window_start={start}", "model.resolution=16")
    session = Session(flash(*options, f"method.post_compress_ratio={ratio}"))
    traj, noise, *_, forwards = rollout_of(session)
    b = noise.shape[0]
    assert forwards == b * steps and traj.latents.shape[1] == steps + 1
    session.estimator = build_method("window", {"window_mode": "fixed", "window_start": start})
    assert rollout_of(session)[-1] == b * STEPS


def test_a_window_that_ends_the_schedule_is_windows_rollout():
    options = ("method.window_mode=fixed", "method.window_start=6", "model.resolution=16", "sampling.sde=flow_grpo")
    session = Session(flash(*options))
    ours = rollout_of(session)[0]
    session.estimator = build_method("window", {"window_mode": "fixed", "window_start": 6})
    theirs = rollout_of(session)[0]
    assert torch.equal(ours.latents, theirs.latents) and torch.equal(ours.log_probs, theirs.log_probs)


def test_progressive_window_moves_and_the_grid_follows():
    session = Session(flash("method.window_size=2", "method.window_interval=1", "model.resolution=16"))
    for m, start in enumerate([0, 1, 2]):
        traj = rollout_of(session, iteration=m)[0]
        assert torch.equal(torch.nonzero(traj.sde_mask).flatten(), torch.tensor([start, start + 1]))
        assert traj.sigmas.numel() - 1 == start + 2 + max(int((STEPS - start - 1) * 0.4), 2) - 1
        assert session.estimator.iteration_metrics() == {"window_start": start}


# ----- training -----------------------------------------------------------------------------

def test_gradient_of_the_window_steps_equals_one_graph_gradient():
    session = Session(flash("method.window_mode=fixed", "method.window_start=2", "method.window_size=3"))
    batch = session.collect(0).batch
    assert batch.latents.shape[1] - 1 == 2 + 3 + int((STEPS - 4) * 0.4) - 1  # 2 Euler, 3 SDE, 1 solver step
    assert torch.equal(batch.train_steps.cpu(), torch.arange(2, 5).expand(batch.batch_size, 3))
    move_off_policy(session.policy)
    reference = one_graph_gradient(session.policy, batch)
    grads = estimator_gradient(session, batch)
    assert relative_error(grads, reference) <= 1e-10
    b = batch.batch_size
    assert session.policy.counter.as_dict() == {"forward_nograd": 0, "forward_grad": 3 * b, "backward": 3 * b}


def test_replay_is_partial_with_the_window_steps():
    cfg = flash("method.window_mode=fixed", "method.window_start=1", "method.window_size=2")
    estimator = build_method("mixgrpo_flash", {"window_mode": "fixed", "window_start": 1, "window_size": 2})
    stochastic = torch.ones(STEPS, dtype=torch.bool)
    case = estimator.replay_case(cfg, stochastic, 3, torch.Generator().manual_seed(0))
    assert case.scope == "partial" and "DPM-Solver++" in case.note
    assert torch.equal(case.train_steps, torch.tensor([[1, 2]] * 3))
    own = torch.zeros(STEPS, dtype=torch.bool)
    own[1:3] = True  # the snapshot of its own rollout: the window's steps as they were, still partial
    case = estimator.replay_case(cfg, own, 3, torch.Generator().manual_seed(0))
    assert case.scope == "partial" and case.train_steps is None


# ----- options ------------------------------------------------------------------------------

@pytest.mark.parametrize("override, key", [
    ("method.solver_order=3", "method.solver_order"),
    ("method.solver_order=0", "method.solver_order"),
    ("method.post_compress_ratio=0", "method.post_compress_ratio"),
    ("method.post_compress_ratio=1.5", "method.post_compress_ratio"),
    ("method.window_size=11", "method.window_size"),
    ("sampling.shift=null", "sampling.shift"),
])
def test_bad_options_are_config_errors_naming_the_key(override, key):
    with pytest.raises(ConfigError) as err:
        Session(flash(override))
    assert err.value.key == key and "\n" not in str(err.value)


@pytest.mark.parametrize("override, key", [("method.solver_order=3", "method.solver_order"),
                                           ("method.post_compress_ratio=0", "method.post_compress_ratio")])
def test_bad_options_through_the_cli_exit_2_before_anything_is_written(tmp_path, capsys, override, key):
    out = tmp_path / "x"
    code = main(["run", *SMALL, "--set", "method.name=mixgrpo_flash", "--set", override, "--out", str(out)])
    err = capsys.readouterr().err
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and key in lines[0] and "Traceback" not in err
    assert not (out / "metrics.jsonl").exists()


def test_a_short_run_writes_records(tmp_path):
    out = tmp_path / "flash"
    assert main(["run", *SMALL, "--set", "method.name=mixgrpo_flash", "--set", "method.window_interval=1",
                 "--out", str(out)]) == 0
    recs = list(read_jsonl(out / "metrics.jsonl"))
    assert [r["iteration"] for r in recs] == [0, 1]
    assert [r["window_start"] for r in recs] == [0, 1]
    b = 3
    # window 0..3: 4 + (7 * 0.4 -> 2 points) - 1 = 5 steps; window 1..4: 5 + (6 * 0.4 -> 2) - 1 = 6
    assert [r["forward_nograd"] for r in recs] == [b * 5, b * 6]
    for r in recs:
        assert r["status"] == "ok" and r["method"] == "mixgrpo_flash"
        assert r["forward_grad"] == r["backward"] == b * 4


# ----- the preset ---------------------------------------------------------------------------

def test_preset_scales_the_public_schedule_and_loads_with_random_weights():
    cfg = check_config(load_config(PRESET))
    options = cfg.method.options
    assert cfg.method.name == "mixgrpo_flash" and cfg.model.preset == "tiny" and cfg.device == "cpu"
    assert (options.window_size, options.window_mode, options.window_stride) == (4, "progressive", 1)
    assert (options.solver_order, options.post_compress_ratio) == (2, 0.4)
    assert (cfg.sampling.sde, cfg.sampling.eta, cfg.sampling.shift) == ("flow_grpo", 0.7, 3.0)
    assert check_config(load_config(PRESET, ["model.preset=random"])).model.preset == "random"


def test_preset_runs_one_iteration_through_the_cli(tmp_path):
    out = tmp_path / "preset"
    assert main(["run", "--config", str(PRESET), "--set", "train.iterations=1", "--set", "progress=false",
                 "--out", str(out)]) == 0
    (rec,) = list(read_jsonl(out / "metrics.jsonl"))
    assert rec["status"] == "ok" and rec["method"] == "mixgrpo_flash" and rec["window_start"] == 0


def test_a_one_step_grid_after_the_window_is_first_order_at_order_2():
    """The public code's ``dpm_step`` takes the schedule's last step to first order whatever
    ``--dpm_solver_order`` (``lower_order_final = step_index == len(timesteps) - 1``; into sigma 0 the 2M step
    is not even defined, its h = lambda' - lambda being infinite); a compressed grid of one step is that step.
    So at ``solver_order: 2`` it is the first-order step, which into 0 returns the prediction x0 = x - s v:
    the rollout equals that of ``solver_order: 1`` bit for bit."""
    rollouts = {}
    for order in (1, 2):
        session = Session(flash("method.window_mode=fixed", "method.window_start=0", "method.window_size=4",
                                f"method.solver_order={order}", "method.post_compress_ratio=0.2", "model.resolution=16"))
        traj = rollout_of(session)[0]
        rollouts[order] = (traj, list(session.estimator.solver_orders))
    (first, first_orders), (second, second_orders) = rollouts[1], rollouts[2]
    assert second.sigmas.numel() == 6 and float(second.sigmas[-1]) == 0.0  # window 0..3, then one step into 0
    assert first_orders == second_orders == [1]
    assert torch.equal(second.latents, first.latents)
    x0 = second.latents[:, -2] - float(second.sigmas[-2]) * second.velocities[:, -1]
    assert float((second.latents[:, -1] - x0).abs().max()) <= 1e-12 * float(x0.abs().max())
