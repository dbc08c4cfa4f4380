"""DiffusionNFT (`nft`): the ODE rollout, the optimality probability, the loss's gradient against the paper's
equation written out here, the pass counts, a CLI run and the preset's values (bad options, the replay scope
and a run of the preset: tests/unit/test_final_latent.py, for the three likelihood-free methods)."""
from pathlib import Path

import pytest
import torch

from agg_bench.cli import main
from agg_bench.config import load_config
from agg_bench.runtime.config_check import check_config
from agg_bench.engine.grpo import UpdateStats
from agg_bench.io import read_jsonl
from agg_bench.runtime.train import Session
from helpers import counted, move_off_policy, nft_dpm2_reference, relative_error, seeded, tiny_config

ROOT = Path(__file__).resolve().parents[2]
PRESET = ROOT / "config/presets/diffusionnft.yaml"
STEPS = 6  # sampling.steps in helpers.TINY
NFT = ("method.name=nft", "sampling.same_noise_per_group=false", "reward.name=smoothness")
SMALL = ["--set", "model.resolution=32", "--set", f"sampling.steps={STEPS}", "--set", "train.iterations=2",
         "--set", "progress=false", "--set", "sampling.same_noise_per_group=false"]


def session(*overrides):
    return Session(tiny_config(*NFT, *overrides))


def collect(s, seed=0):
    """The iteration-0 batch with optimality probabilities spread over [0, 1] (the tiny model's rewards
    barely differ), so that every term of the loss matters."""
    batch = s.collect(0).batch
    batch.advantages = torch.rand(batch.batch_size, generator=torch.Generator().manual_seed(seeded(seed)),
                                  dtype=batch.latents.dtype)
    return batch


def reference_gradient(policy, batch, v_old, eps, t, timesteps, beta, z, weighting):
    """d L / d theta from the paper's NFT objective, one graph in float64:
    L = 1/(B K) sum_ik z/beta [r_i l(v+_ik) + (1 - r_i) l(v-_ik)], v+ = (1-beta) v_old + beta v_theta,
    v- = (1+beta) v_old - beta v_theta, x_t = (1-t) x0 + t eps, target eps - x0; l is the mean squared
    velocity error, or the code's x0-space error divided by its (constant) mean absolute value."""
    params = [p for _, p in policy.named_parameters()]
    b, k = batch.train_steps.shape
    total = 0
    for i in range(b):
        x0 = batch.latents[i, -1]
        r = batch.advantages[i]
        for s in range(k):
            ti = t[i, s]
            x_t = (1 - ti) * x0 + ti * eps[i, s]
            v = policy.velocity(x_t[None], timesteps[i, s].reshape(1), batch.cond[torch.tensor([i])])[0]
            vp = (1 - beta) * v_old[i, s] + beta * v
            vn = (1 + beta) * v_old[i, s] - beta * v

            def loss(u, i=i, s=s, x0=x0, x_t=x_t, ti=ti):  # bound now, called in this iteration
                if weighting == "velocity":
                    return ((u - (eps[i, s] - x0)) ** 2).mean()
                err = (x_t - ti * u) - x0
                return (err ** 2).mean() / err.detach().abs().mean().clamp(min=1e-5)

            total = total + z / beta * (r * loss(vp) + (1 - r) * loss(vn))
    grads = torch.autograd.grad(total / (b * k), params)
    return {n: g for (n, _), g in zip(policy.named_parameters(), grads)}


def old_velocities(policy, batch, eps, t, timesteps):
    b, k = batch.train_steps.shape
    with torch.no_grad():
        return torch.stack([torch.stack([
            policy.velocity(((1 - t[i, s]) * batch.latents[i, -1] + t[i, s] * eps[i, s])[None],
                            timesteps[i, s].reshape(1), batch.cond[torch.tensor([i])])[0]
            for s in range(k)]) for i in range(b)])


def grads_of(policy):
    return {n: p.grad.clone() for n, p in policy.named_parameters()}


@pytest.mark.parametrize("options", [
    ("method.weighting=adaptive", "method.beta=1.0"),
    ("method.weighting=velocity", "method.beta=0.1"),
    ("method.weighting=adaptive", "method.beta=0.3", "method.time_distribution=uniform", "method.times_per_sample=3"),
])
def test_gradient_equals_the_papers_loss_written_out(options):
    s = session(*options)
    batch = collect(s)
    c = s.estimator.config
    eps, t, timesteps = s.estimator.draws(s.policy, batch)
    v_old = old_velocities(s.policy, batch, eps, t, timesteps)
    # first inner epoch: on policy (v_theta = v_old, the gradient comes from r alone)
    s.estimator.accumulate(s.policy, batch, UpdateStats(0.1))
    ref = reference_gradient(s.policy, batch, v_old, eps, t, timesteps, c.beta, 5.0, c.weighting)
    assert relative_error(grads_of(s.policy), ref) <= 1e-10
    # a later inner epoch: the policy moved, v_old stays the rollout's and the draws are the same
    for p in s.policy.parameters():
        p.grad = None
    move_off_policy(s.policy)
    s.policy.version += 1
    s.estimator.accumulate(s.policy, batch, UpdateStats(0.1))
    ref = reference_gradient(s.policy, batch, v_old, eps, t, timesteps, c.beta, 5.0, c.weighting)
    assert relative_error(grads_of(s.policy), ref) <= 1e-10


def test_rollout_is_ode_and_r_is_the_clipped_normalised_advantage():
    s = session("grpo.adv_clip_max=1.5")
    batch = s.collect(0).batch
    assert torch.all(batch.log_probs == 0)
    for j in range(STEPS):  # Euler: x_{j+1} = x_j + (sigma_{j+1} - sigma_j) v_j
        x_next = batch.latents[:, j] + (batch.sigmas[j + 1] - batch.sigmas[j]) * batch.velocities[:, j]
        torch.testing.assert_close(x_next, batch.latents[:, j + 1], rtol=0, atol=1e-12)
    est = s.estimator
    rewards = torch.tensor([0.0, 1.0, 3.0, 2.0, 2.0, 2.0], dtype=torch.float64)
    r = est.advantages(rewards, batch, s.cfg.grpo)
    g = rewards.view(2, 3)
    a = ((g - g.mean(1, keepdim=True)) / (g.std(1, unbiased=False, keepdim=True) + 1e-8)).reshape(-1)
    expected = 0.5 + 0.5 * (a / 1.5).clamp(-1, 1)
    torch.testing.assert_close(r, expected.to(r.dtype))
    assert torch.all((r >= 0) & (r <= 1))


@pytest.mark.parametrize("old_decay_rate", [0.0, 0.001])
def test_dpm2_rollout_is_the_public_sampler_at_one_forward_per_step(old_decay_rate):
    """``method.solver=dpm2``: every state of the rollout is DiffusionNFT's ``dpm2`` step (tests/helpers.py) from
    the velocities the rollout recorded, by the policy or by its moving average, with one no-grad forward per
    sample and step, as the Euler rollout; the images differ from Euler's from the third step on."""
    s = session("method.solver=dpm2", f"method.old_decay_rate={old_decay_rate}")
    with counted(s.policy) as passes:
        batch = s.collect(0).batch
    assert passes.as_dict() == {"forward_nograd": batch.batch_size * STEPS, "forward_grad": 0, "backward": 0}
    assert float(batch.sigmas[0]) == 1.0 and torch.all(batch.log_probs == 0)
    expected = nft_dpm2_reference(batch.sigmas, batch.latents[:, 0], list(batch.velocities.unbind(1)))
    torch.testing.assert_close(torch.stack(expected, 1), batch.latents, rtol=0, atol=1e-12)
    euler = session(f"method.old_decay_rate={old_decay_rate}").collect(0).batch
    # the two first steps are first order: Euler's states, up to rounding
    torch.testing.assert_close(euler.latents[:, :3], batch.latents[:, :3], rtol=0, atol=1e-12)
    assert not torch.allclose(euler.latents[:, -1], batch.latents[:, -1])


def test_times_are_distinct_schedule_steps_and_reproducible():
    a, b = session(), session()
    ba, bb = a.collect(0).batch, b.collect(0).batch
    k = int(STEPS * 0.99)
    assert ba.train_steps.shape == (ba.batch_size, k) and torch.equal(ba.train_steps, bb.train_steps)
    for row in ba.train_steps:
        assert len(set(row.tolist())) == k and int(row.max()) < STEPS
    ea, ta, _ = a.estimator.draws(a.policy, ba)
    eb, tb, _ = b.estimator.draws(b.policy, bb)
    assert torch.equal(ea, eb) and torch.equal(ta, tb)
    torch.testing.assert_close(ta, ba.sigmas[ba.train_steps].to(ta.dtype))


@pytest.mark.parametrize("epochs", [1, 2])
def test_pass_counts(epochs):
    """The old policy is the rollout's weights: in the first inner epoch they are the policy's, so v_old is the
    forward with grad's own value and no no-grad forward is made (or charged); later epochs keep it."""
    k = 4
    s = session(f"method.times_per_sample={k}", f"train.inner_epochs={epochs}", "method.micro_batch=4")
    batch = collect(s)
    with counted(s.policy) as passes:
        s.update(batch)
    b = batch.batch_size
    assert passes.as_dict() == {
        "forward_nograd": 0, "forward_grad": epochs * b * k, "backward": epochs * b * k}


def test_kl_to_the_reference_counts_its_forward():
    s = session("method.times_per_sample=2", "grpo.beta=0.01")
    batch = collect(s)
    with counted(s.policy) as passes:
        s.update(batch)
    b = batch.batch_size
    assert passes.as_dict() == {"forward_nograd": b * 2, "forward_grad": b * 2, "backward": b * 2}


def test_uniform_times_accept_more_than_the_schedule():
    s = session(f"method.times_per_sample={STEPS + 2}", "method.time_distribution=uniform")
    batch = s.collect(0).batch
    assert torch.equal(batch.train_steps[0], torch.arange(STEPS + 2))


def test_runs_through_the_cli(tmp_path):
    out = tmp_path / "nft"
    assert main(["run", *SMALL, "--set", "method.name=nft", "--set", "method.times_per_sample=3",
                 "--out", str(out)]) == 0
    recs = list(read_jsonl(out / "metrics.jsonl"))
    assert [r["iteration"] for r in recs] == [0, 1]
    b = 4 * 2  # default grpo.group_size * grpo.prompts_per_iteration
    for r in recs:
        assert r["status"] == "ok" and r["method"] == "nft"
        assert r["forward_nograd"] == b * STEPS  # the rollout; the old policy's velocities are the policy's own
        assert r["backward"] == r["forward_grad"] == b * 3


def test_preset_scales_the_public_schedule_and_loads_with_random_weights():
    cfg = check_config(load_config(PRESET))
    o = cfg.method.options
    assert cfg.method.name == "nft" and cfg.model.preset == "tiny" and cfg.device == "cpu"
    assert (o.beta, o.times_per_sample, o.time_distribution, o.adv_mode, o.weighting) == \
        (1.0, 9, "schedule", "all", "adaptive")
    assert (o.old_decay_rate, o.old_decay_max, o.old_decay_after) == (0.001, 0.5, 0)  # decay_type 1
    assert o.solver == "dpm2"  # sample.solver, sample.deterministic
    assert (cfg.sampling.steps, cfg.grpo.adv_clip_max, cfg.train.lr) == (10, 5.0, 3e-4)
    assert (cfg.grpo.adv_std, cfg.grpo.adv_ddof, cfg.grpo.adv_eps) == ("global", 0, 1e-4)
    assert cfg.train.eval_ema == 0.9  # train.ema: EMAModuleWrapper(decay=0.9, update_step_interval=1)
    assert check_config(load_config(PRESET, ["model.preset=random"])).model.preset == "random"

