"""The engine: rollout ratios, the full estimator against a one-graph reference, snapshot/replay."""
import json

import pytest
import torch
from safetensors.torch import load_file

from agg_bench.grpo import UpdateStats, group_advantages, step_terms
from agg_bench.snapshot import load_snapshot, replay, save_snapshot
from agg_bench.train import Session
from helpers import estimator_gradient, move_off_policy, one_graph_gradient, relative_error, tiny_config


def test_group_advantages_match_float64_reference():
    r = torch.randn(12, generator=torch.Generator().manual_seed(torch.seed() % 2**31))
    adv = group_advantages(r, 4, 1.5)
    for g in range(3):
        x = r[4 * g: 4 * g + 4].double()
        ref = ((x - x.mean()) / (x.std(unbiased=False) + 1e-8)).clamp(-1.5, 1.5)
        torch.testing.assert_close(adv[4 * g: 4 * g + 4].double(), ref, rtol=1e-6, atol=1e-6)
    assert adv.abs().max() <= 1.5


@pytest.mark.parametrize("family", ["sd3", "flux"])
def test_ratios_are_exactly_one_right_after_rollout(family):
    session = Session(tiny_config(family=family, dtype="float32"))
    batch = session.collect(0).batch
    stats = UpdateStats(batch.clip_range)
    session.estimator.accumulate(session.policy, batch, stats)
    assert stats.ratio_dev == 0.0
    assert stats.clipped == 0
    assert stats.count == batch.batch_size * batch.steps_per_sample


@pytest.mark.parametrize("family", ["sd3", "flux"])
def test_full_estimator_equals_one_graph_gradient(family):
    session = Session(tiny_config("train.timestep_fraction=0.5", family=family))
    batch = session.collect(0).batch
    # move off-policy so that ratios differ from 1 and the clip matters for some terms
    move_off_policy(session.policy)
    reference = one_graph_gradient(session.policy, batch)
    grads = estimator_gradient(session, batch)
    assert relative_error(grads, reference) <= 1e-10
    b, n = batch.train_steps.shape
    assert session.policy.counter.as_dict() == {"forward_nograd": 0, "forward_grad": b * n, "backward": b * n}


def test_snapshot_then_replay_full_reproduces_gradient(tmp_path):
    cfg = tiny_config("train.timestep_fraction=0.5")
    snap = save_snapshot(cfg, tmp_path / "snap")
    tensors = load_file(str(snap / "rollout.safetensors"))
    meta = json.loads((snap / "rollout.json").read_text())
    assert {"family", "sde", "eta", "clip_range", "beta"} <= set(meta)
    b = cfg.grpo.group_size * cfg.grpo.prompts_per_iteration
    t = cfg.sampling.steps
    assert tensors["latents"].shape[:2] == (b, t + 1)
    assert tensors["log_probs"].shape == (b, t) and tensors["sigmas"].shape == (t + 1,)
    assert tensors["timesteps"].shape == (t,) and tensors["train_steps"].dtype == torch.int64
    assert tensors["train_steps"].shape == (b, 3)
    assert {"advantages", "encoder_hidden_states", "pooled_projections"} <= set(tensors)

    snapshot = load_snapshot(snap)
    reference = one_graph_gradient(snapshot.policy, snapshot.batch)
    counts = replay(snap, "full", [], tmp_path / "full.safetensors")
    grads = load_file(str(tmp_path / "full.safetensors"))
    assert relative_error(grads, reference) <= 1e-10
    n = snapshot.batch.steps_per_sample
    assert counts == {"forward_nograd": 0, "forward_grad": b * n, "backward": b * n}
    assert json.loads((tmp_path / "full.json").read_text())["backward"] == b * n


def test_step_terms_clip_is_pessimistic():
    """l = max(-A r, -A clip(r)): for A>0 and r above 1+eps the clipped value wins."""
    from agg_bench.grpo import TrainBatch
    from agg_bench.models import Conditioning
    from agg_bench.sde import flow_sigmas

    sig = flow_sigmas(2, 1.0)
    lat = torch.randn(2, 3, 1, 2, 2, dtype=torch.float64)
    batch = TrainBatch(latents=lat, log_probs=torch.full((2, 2), -50.0, dtype=torch.float64), sigmas=sig,
                       timesteps=sig[:-1] * 1000, advantages=torch.tensor([1.0, -1.0]),
                       train_steps=torch.zeros(2, 1, dtype=torch.int64),
                       cond=Conditioning(torch.zeros(2, 1, 4)), sde="flow_grpo", eta=0.7, clip_range=0.2)
    terms = step_terms(batch, torch.arange(2), torch.zeros(2, dtype=torch.int64), torch.zeros(2, 1, 2, 2))
    assert torch.all(terms.ratio > 1.2)
    assert terms.loss[0].item() == pytest.approx(-1.2)   # A=+1: -min(r, 1.2)
    assert terms.loss[1].item() == pytest.approx(terms.ratio[1].item())  # A=-1: max(r, clip(r)) = r
