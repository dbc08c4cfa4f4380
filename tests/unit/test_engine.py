"""The engine: rollout ratios, the full estimator against a one-graph reference, snapshot/replay."""
import dataclasses
import json
import math

import pytest
import torch
from safetensors.torch import load_file

from agg_bench.engine.grpo import UpdateStats, group_advantages, step_terms
from agg_bench.errors import ConfigError
from agg_bench.runtime.train import Session
from agg_bench.tools.snapshot import load_snapshot, replay, save_snapshot
from helpers import (estimator_gradient, fresh_seed, move_off_policy, one_graph_gradient, relative_error, sde_reference,
                     tiny_config)


@pytest.mark.parametrize("std", ["group", "global"])
@pytest.mark.parametrize("ddof, eps", [(0, 1e-8), (1, 1e-8), (0, 1e-4)])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_group_advantages_match_float64_reference(std, ddof, eps, dtype):
    """ddof 0 divides the squared deviations by n (numpy: Flow-GRPO), 1 by n - 1 (torch: DanceGRPO); ``group``
    takes them over the group, ``global`` over the whole batch (Flow-GRPO's global_std), the mean is the group's
    either way; the result has the requested dtype (the run's latents')."""
    r = torch.randn(12, generator=torch.Generator().manual_seed(fresh_seed()))
    adv = group_advantages(r, 4, 1.5, std, dtype, ddof, eps)
    assert adv.dtype == dtype
    every = [float(v) for v in r]

    def spread_of(x):
        mean = sum(x) / len(x)
        return math.sqrt(sum((v - mean) ** 2 for v in x) / (len(x) - ddof))

    for g in range(3):
        x = [float(v) for v in r[4 * g: 4 * g + 4]]
        mean = sum(x) / 4
        spread = spread_of(x if std == "group" else every)
        ref = torch.tensor([min(1.5, max(-1.5, (v - mean) / (spread + eps))) for v in x], dtype=torch.float64)
        # float64: rounding of a few operations; float32: one rounding of the float64 result
        tol = 1e-12 if dtype == torch.float64 else 2e-7
        torch.testing.assert_close(adv[4 * g: 4 * g + 4].double(), ref, rtol=tol, atol=tol)
    assert adv.abs().max() <= 1.5
    with pytest.raises(ConfigError, match="grpo.adv_std"):
        group_advantages(r, 4, 1.5, "biased")


@pytest.mark.parametrize("kind", ["flow_grpo", "dance_grpo"])
@pytest.mark.parametrize("kl_form", ["transition", "no_dt"])
def test_kl_forms_match_float64_reference(kind, kl_form):
    """With zero advantages the loss is beta * KL; KL against DESIGN's transition written out in float64:
    mean squared difference of the two means over 2 std^2 (transition) or over 2 std_t^2 (no_dt)."""
    from agg_bench.engine.grpo import TrainBatch
    from agg_bench.engine.models import Conditioning
    from agg_bench.engine.sampler import flow_sigmas

    gen = torch.Generator().manual_seed(fresh_seed())
    b, steps = 5, 9
    sig = flow_sigmas(steps, 3.0)
    lat = torch.randn(b, steps + 1, 2, 3, 3, generator=gen, dtype=torch.float64)
    eta = 0.2 + torch.rand((), generator=gen).item()
    beta = 0.1 + torch.rand((), generator=gen).item()
    index = torch.tensor([0, 2, 4, 7, 8])
    v = torch.randn(b, 2, 3, 3, generator=gen, dtype=torch.float64)
    v_ref = v + 0.1 * torch.randn(b, 2, 3, 3, generator=gen, dtype=torch.float64)
    batch = TrainBatch(latents=lat, log_probs=torch.zeros(b, steps, dtype=torch.float64), sigmas=sig,
                       timesteps=sig[:-1] * 1000, advantages=torch.zeros(b, dtype=torch.float64),
                       train_steps=index[:, None], cond=Conditioning(torch.zeros(b, 1, 4)), sde=kind, eta=eta,
                       clip_range=0.2, beta=beta, kl_form=kl_form)
    rows = torch.arange(b)
    loss = step_terms(batch, rows, index, v, v_ref).loss
    for i in range(b):
        j = int(index[i])
        s, s_next = float(sig[j]), float(sig[j + 1])
        x = lat[i, j]
        mean, sd = sde_reference(kind, v[i], x, s, s_next, eta, float(sig[1]))
        mean_ref, _ = sde_reference(kind, v_ref[i], x, s, s_next, eta, float(sig[1]))
        if kl_form == "transition":
            variance = sd**2
        elif kind == "flow_grpo":  # std_t: the noise level before the step size
            variance = eta**2 * s / (1 - (float(sig[1]) if s == 1 else s))
        else:
            variance = eta**2
        kl = ((mean - mean_ref) ** 2).mean().item() / (2 * variance)
        assert loss[i].item() == pytest.approx(beta * kl, rel=1e-10)
    with pytest.raises(ConfigError, match="grpo.kl_form"):
        step_terms(dataclasses.replace(batch, kl_form="reverse"), rows, index, v, v_ref)


def test_advantages_keep_the_latents_dtype_and_the_conventions_reach_the_batch():
    session = Session(tiny_config("grpo.adv_ddof=1", "grpo.kl_form=no_dt", "grpo.prompts_per_iteration=1"))
    batch = session.collect(0).batch
    assert batch.latents.dtype == batch.advantages.dtype == torch.float64
    assert batch.kl_form == "no_dt"
    for key, value in (("grpo.adv_std", "unbiased"), ("grpo.kl_form", 3), ("grpo.kl_form", "nan")):
        with pytest.raises(ConfigError, match=key):
            tiny_config(f"{key}={value}")


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


def test_a_replay_killed_between_its_two_files_leaves_no_pair_of_two_replays(tmp_path, monkeypatch):
    """A replay renames its gradient into place, then writes its pass counts beside it. Killed between the two,
    it left the new gradient beside the earlier replay's counts, which a reader took for this gradient's. The
    earlier counts go before the gradient is replaced; the same command run again writes both."""
    from safetensors import safe_open

    from agg_bench.tools import snapshot as snapshots

    snap = save_snapshot(tiny_config("train.timestep_fraction=0.5"), tmp_path / "snap")
    out, counts = tmp_path / "grad.safetensors", tmp_path / "grad.json"

    def pair() -> tuple[str, str | None]:
        with safe_open(str(out), "pt") as handle:
            written = handle.metadata()["method"]
        return written, json.loads(counts.read_text())["method"] if counts.exists() else None

    replay(snap, "full", [], out)
    assert pair() == ("full", "full")

    def killed(path, data):
        raise KeyboardInterrupt  # the process ends after the gradient's rename, before the counts are written

    monkeypatch.setattr(snapshots, "write_json", killed)
    with pytest.raises(KeyboardInterrupt):
        replay(snap, "fraction", [], out)
    assert pair() == ("fraction", None)  # the new gradient alone, not beside full's counts
    monkeypatch.undo()
    replay(snap, "fraction", [], out)  # the same replay again takes its own gradient file
    assert pair() == ("fraction", "fraction")


def test_step_terms_clip_is_pessimistic():
    """l = max(-A r, -A clip(r)): for A>0 and r above 1+eps the clipped value wins."""
    from agg_bench.engine.grpo import TrainBatch
    from agg_bench.engine.models import Conditioning
    from agg_bench.engine.sampler import flow_sigmas

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
