"""LoRA via peft: only adapters train, the KL reference is the base model (adapters off), snapshots replay."""
import json

import pytest
import torch
from helpers import fresh_seed, relative_error, tiny_config
from safetensors.torch import load, load_file

from agg_bench.engine.grpo import UpdateStats, step_terms
from agg_bench.engine.lora import LORA_TARGETS, lora_info
from agg_bench.engine.models import TRANSFORMER_CLASSES, build_tiny_transformer
from agg_bench.errors import ConfigError, UserError
from agg_bench.runtime.memplan import SUGGESTED_LORA_RANK, ShapeModel, plan_memory
from agg_bench.runtime.train import Session
from agg_bench.tools.snapshot import load_snapshot, replay_gradient, save_snapshot
from baselines.full import FullEstimator

LORA = ("train.lora_rank=4", "train.lora_alpha=8")


def perturb_adapters(policy, scale=0.05):
    """Move the adapters off their no-op start so that the adapted model differs from the base."""
    gen = torch.Generator().manual_seed(fresh_seed())
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(scale * torch.randn(p.shape, generator=gen, dtype=p.dtype))


@pytest.mark.parametrize("family", ["sd3", "flux", "qwenimage"])
def test_only_adapter_parameters_receive_gradients(family):
    session = Session(tiny_config(*LORA, "grpo.beta=0.1", "sampling.steps=3", family=family))
    named = dict(session.policy.named_parameters())
    assert named and all(".lora_A." in n or ".lora_B." in n for n in named)
    adapted = {n.split(".lora_")[0] for n in named}
    assert all(any(n.endswith("." + t) for t in LORA_TARGETS[family]) for n in adapted)
    before = {n: p.detach().clone() for n, p in session.policy.transformer.named_parameters()}
    batch = session.collect(0).batch
    session.update(batch)
    for name, p in session.policy.transformer.named_parameters():
        if name not in named:
            assert not p.requires_grad and p.grad is None
            assert torch.equal(p, before[name]), name  # base weights never move
    # B starts at 0, so the B matrices get the first nonzero gradients and move (an adapter whose output
    # never reaches the velocity, e.g. on the text stream of the last block, gets none)
    assert sum(float(p.grad.abs().sum()) for n, p in named.items() if ".lora_B." in n and p.grad is not None) > 0
    assert any(not torch.equal(p, before[n]) for n, p in named.items())
    assert {id(p) for g in session.optimizer.param_groups for p in g["params"]} == {id(p) for p in named.values()}


def test_reference_with_adapters_off_equals_the_base_model():
    session = Session(tiny_config(*LORA, "grpo.beta=0.1"))
    policy, reference = session.policy, session.reference
    assert reference.transformer is policy.transformer  # no copy of the weights
    assert reference.parameters() == []
    perturb_adapters(policy)
    base = build_tiny_transformer("sd3", seed=session.cfg.seed, dtype=torch.float64)
    gen = torch.Generator().manual_seed(fresh_seed())
    x = torch.randn(3, 4, 4, 4, generator=gen, dtype=torch.float64)
    t = torch.rand(3, generator=gen, dtype=torch.float64) * 1000
    cond = session.cond_all[torch.tensor([0, 1, 2])].to(dtype=torch.float64)
    flags = {n: p.requires_grad for n, p in policy.transformer.named_parameters()}
    with torch.no_grad():
        ref_v = reference.velocity(x, t, cond)
        base_v = base(hidden_states=x, timestep=t, encoder_hidden_states=cond.encoder_hidden_states,
                      pooled_projections=cond.pooled_projections, return_dict=False)[0]
        policy_v = policy.velocity(x, t, cond)
    assert torch.equal(ref_v, base_v)  # the same operations on the same weights: exact
    assert not torch.allclose(policy_v, base_v)  # the adapters are back on after the reference call
    assert flags == {n: p.requires_grad for n, p in policy.transformer.named_parameters()}


def test_kl_gradient_with_lora_matches_a_float64_finite_difference():
    """d(beta*KL)/d(adapter) through the adapters-off reference, against central differences."""
    session = Session(tiny_config(*LORA, "grpo.beta=1.0", "sampling.steps=3"))
    batch = session.collect(0).batch
    perturb_adapters(session.policy)
    batch.advantages.zero_()  # only the KL term remains
    policy, reference = session.policy, session.reference
    for p in policy.parameters():
        p.grad = None
    FullEstimator().accumulate(policy, batch, UpdateStats(batch.clip_range), reference)
    name, param = next((n, p) for n, p in policy.named_parameters() if ".lora_B." in n)
    idx = (0, 0)

    def objective() -> float:
        """beta * KL part of L, recomputed without autograd."""
        total = 0.0
        with torch.no_grad():
            for n in range(batch.steps_per_sample):
                rows = torch.arange(batch.batch_size)
                steps = batch.train_steps[rows, n]
                args = (batch.states(rows, steps), batch.timestep_values(steps), batch.cond[rows])
                terms = step_terms(batch, rows, steps, policy.velocity(*args), reference.velocity(*args))
                total += float(terms.loss.sum()) * batch.loss_scale
        return total

    assert objective() > 0  # the reference (adapters off) differs from the adapted policy
    h = 1e-6
    with torch.no_grad():
        param[idx] += h
        up = objective()
        param[idx] -= 2 * h
        down = objective()
        param[idx] += h
    assert abs(float(param.grad[idx]) - (up - down) / (2 * h)) <= 1e-6 * max(1.0, abs((up - down) / (2 * h)))


def test_lora_snapshot_keeps_plain_base_weights_and_replays_the_same_gradient(tmp_path):
    cfg = tiny_config(*LORA, "train.timestep_fraction=0.5")
    snap = save_snapshot(cfg, tmp_path / "snap")
    meta = json.loads((snap / "rollout.json").read_text())
    assert meta["lora"] == {"rank": 4, "alpha": 8.0, "target_modules": LORA_TARGETS["sd3"]}
    # transformer/ is a plain diffusers folder of the base weights
    plain = TRANSFORMER_CLASSES["sd3"].from_pretrained(snap / "transformer", torch_dtype=torch.float64)
    base = build_tiny_transformer("sd3", seed=cfg.seed, dtype=torch.float64)
    assert all(torch.equal(a, b) for a, b in zip(plain.state_dict().values(), base.state_dict().values()))
    assert all(".lora_" in k for k in load_file(str(snap / "lora" / "adapter_model.safetensors")))

    loaded = load_snapshot(snap)
    names = [n for n, _ in loaded.policy.named_parameters()]
    assert names and all(".lora_" in n for n in names)
    grads, counts, _ = replay_gradient(loaded, FullEstimator())

    session = Session(cfg)
    batch = session.collect(0).batch
    session.estimator.accumulate(session.policy, batch, UpdateStats(batch.clip_range))
    expected = {n: p.grad for n, p in session.policy.named_parameters()}
    assert set(grads) == set(expected)
    assert relative_error(grads, expected) <= 1e-10
    b, n = batch.train_steps.shape
    assert counts == {"forward_nograd": 0, "forward_grad": b * n, "backward": b * n}

    # another training state of the adapter, of the same shapes and loadable (one weight's lowest bit flipped):
    # replayed as the gradient of a model the rollout was not sampled from, until rollout.json recorded its digest
    adapter = snap / "lora" / "adapter_model.safetensors"
    written = adapter.read_bytes()
    data = bytearray(written)
    data[8 + int.from_bytes(data[:8], "little")] ^= 1  # the first byte after the header: a weight's mantissa
    adapter.write_bytes(bytes(data))
    before, after = load(written), load_file(str(adapter))
    assert before.keys() == after.keys() and any(not torch.equal(before[k], after[k]) for k in before)
    with pytest.raises(UserError) as err:
        load_snapshot(snap)
    assert str(err.value).startswith(f"{adapter}: not the weight file this snapshot recorded: "), err.value


def test_unknown_target_module_is_a_config_error():
    with pytest.raises(ConfigError) as err:
        Session(tiny_config(*LORA, "train.lora_target_modules=[no_such_layer]"))
    assert err.value.key == "train.lora_target_modules"


def test_lora_with_gradient_checkpointing_gives_the_same_adapter_gradient():
    grads = []
    for checkpointing in ("false", "true"):
        session = Session(tiny_config(*LORA, "sampling.steps=3", f"train.gradient_checkpointing={checkpointing}"))
        batch = session.collect(0).batch
        session.estimator.accumulate(session.policy, batch, UpdateStats(batch.clip_range))
        grads.append({n: p.grad if p.grad is not None else torch.zeros_like(p)
                      for n, p in session.policy.named_parameters()})
    assert sum(float(g.abs().sum()) for g in grads[0].values()) > 0
    assert relative_error(grads[1], grads[0]) <= 1e-12


@pytest.mark.parametrize("family", ["sd3", "flux", "qwenimage"])
def test_a_rank_above_the_narrowest_adapted_layer_is_a_config_error(family):
    transformer = build_tiny_transformer(family)
    width = min(min(m.in_features, m.out_features) for name, m in transformer.named_modules()
                if isinstance(m, torch.nn.Linear) and name.endswith(tuple("." + t for t in LORA_TARGETS[family])))
    assert lora_info(Session(tiny_config(f"train.lora_rank={width}", family=family)).policy.transformer)["rank"] == width
    with pytest.raises(ConfigError) as err:
        Session(tiny_config(f"train.lora_rank={width + 1}", family=family))
    assert (err.value.key, err.value.value) == ("train.lora_rank", width + 1)
    with pytest.raises(ConfigError) as err:  # the memory planner, which builds the model on the meta device
        plan_memory(tiny_config(f"train.lora_rank={width + 1}", family=family), 1)
    assert err.value.key == "train.lora_rank"


def test_the_memory_planner_draws_no_adapter_weights(monkeypatch):
    # a full-size model's adapters drawn on the CPU took minutes and GiBs before they went to the meta device
    from peft.tuners.lora.layer import LoraLayer

    devices = []
    reset = LoraLayer.reset_lora_parameters

    def recorded(self, adapter_name, *args, **kwargs):
        devices.append(self.lora_A[adapter_name].weight.device.type)
        return reset(self, adapter_name, *args, **kwargs)

    monkeypatch.setattr(LoraLayer, "reset_lora_parameters", recorded)
    plan = plan_memory(tiny_config(*LORA), 1)
    assert 0 < plan.trainable_parameters < plan.parameters
    assert devices and set(devices) == {"meta"}


@pytest.mark.parametrize("family", ["sd3", "flux", "qwenimage"])
def test_the_planners_suggested_adapter_is_no_wider_than_the_narrowest_adapted_layer(family):
    # a rank the user never set must not end the plan: tiny qwenimage's narrowest adapted layer is narrower than
    # SUGGESTED_LORA_RANK, and the search's adapter was refused as train.lora_rank
    cfg = tiny_config(family=family)
    width = min(min(m.in_features, m.out_features) for name, m in build_tiny_transformer(family).named_modules()
                if isinstance(m, torch.nn.Linear) and name.endswith(tuple("." + t for t in LORA_TARGETS[family])))
    assert ShapeModel(cfg).suggested_lora_rank(False) == min(SUGGESTED_LORA_RANK, width)
    plan = plan_memory(cfg, 1, gpu_memory=1)  # fits nothing: every suggestion, adapters included, is tried
    assert not plan.fits and plan.suggestions == []
