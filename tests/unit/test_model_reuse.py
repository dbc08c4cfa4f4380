"""Runs that share one built model (agg_bench.runtime.model_reuse, what a cell job does) write the records of
runs that each build their own, bit for bit in every non-timing field: the same operations on the same
values, since every run starts from the modules, the trainable weights and the random generators as
built. The runs below leave behind what a kept model must not carry into the next run: trained weights
(full fine-tune and LoRA), a KL reference, an inference cache's hooks, AdamW steps; and one run of another
seed and one of another model configuration must build their own."""
from __future__ import annotations

from pathlib import Path

import torch

from agg_bench.config import load_config
from agg_bench.io import read_jsonl
from agg_bench.runtime import memplan, model_reuse
from agg_bench.runtime.train import train
from pinned import pinned_fields

TINY = ["model.preset=tiny", "model.resolution=32", "train.iterations=1", "sampling.steps=6", "grpo.group_size=2",
        "grpo.prompts_per_iteration=1", "progress=false", "model.dtype=float64"]
RUNS = {  # label -> overrides, in the order they run
    "fora": ["method={name: cached, cache: fora, cache_in: rollout}"],
    "agg-kl": ["method={name: agg, window: 3}", "train.plan_window=3", "grpo.beta=0.1"],
    "awm-ema": ["method={name: awm, ema_kl_beta: 0.5}", "sampling.same_noise_per_group=false"],  # a moving average
    "seed1": ["method={name: full}", "seed=1"],  # another seed: another build
    "lora-kl": ["method={name: full}", "train.lora_rank=2", "grpo.beta=0.1"],  # adapters: another build
    "lora": ["method={name: full}", "train.lora_rank=2"],
    "full": ["method={name: full}"],  # seed 0 without adapters again: built anew (one model kept at a time)
}


def records(folder: Path) -> list[dict]:
    return [pinned_fields(r) for r in read_jsonl(folder / "metrics.jsonl")]


def run_all(root: Path, runs: dict[str, list[str]]) -> dict[str, list[dict]]:
    out = {}
    for label, overrides in runs.items():
        train(load_config(None, [*TINY, *overrides]), root / label)
        out[label] = records(root / label)
    return out


def test_runs_that_share_a_model_write_the_records_of_runs_that_build_their_own(tmp_path):
    runs = RUNS
    apart = run_all(tmp_path / "apart", runs)
    with model_reuse.reusing_models() as reuse:
        together = run_all(tmp_path / "together", runs)
    for label in runs:
        assert len(together[label]) == 1 and together[label][0]["status"] == "ok"
        assert together[label] == apart[label], label
    # seed 0, seed 1, LoRA, seed 0 again: four builds for seven runs
    assert reuse.builds == 4
    assert model_reuse._active is None  # nothing kept after the block


def test_a_kept_model_is_restored_as_built(tmp_path):
    cfg = load_config(None, [*TINY, "method={name: full}"])
    with model_reuse.reusing_models() as reuse:
        first = model_reuse.policy_for(cfg, torch.device("cpu"))
        built = {n: p.detach().clone() for n, p in first.transformer.named_parameters()}
        state = torch.random.get_rng_state()
        with torch.no_grad():
            for p in first.parameters():
                p.add_(1.0)
                p.grad = torch.ones_like(p)
        torch.rand(3)  # the generator moves on, as a run's draws move it
        second = model_reuse.policy_for(cfg, torch.device("cpu"))
        assert second is not first and second.transformer is first.transformer and reuse.builds == 1
        assert second.counter.as_dict() == {"forward_nograd": 0, "forward_grad": 0, "backward": 0}
        for name, p in second.transformer.named_parameters():
            assert torch.equal(p, built[name]) and p.grad is None, name
        assert torch.equal(torch.random.get_rng_state(), state)
        # a module that does not look as built (here: a train flag flipped) is built anew
        second.transformer.train(not second.transformer.training)
        third = model_reuse.policy_for(cfg, torch.device("cpu"))
        assert third.transformer is not first.transformer and reuse.builds == 2


def test_outside_the_block_every_run_builds(tmp_path):
    cfg = load_config(None, [*TINY, "method={name: full}"])
    a = model_reuse.policy_for(cfg, torch.device("cpu"))
    b = model_reuse.policy_for(cfg, torch.device("cpu"))
    assert a.transformer is not b.transformer


def counted_shape_models(monkeypatch) -> list:
    """The memory planner's kept plans and counts cleared, and a list that grows by one with each model it builds
    on fake tensors (each count)."""
    memplan._RUN_PLANS.clear()
    memplan._SHAPES.clear()
    calls: list = []
    original = memplan.ShapeModel.__init__

    def counting(self, *args, **kwargs):
        calls.append(1)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(memplan.ShapeModel, "__init__", counting)
    return calls


def test_a_process_counts_a_memory_plan_once_per_model(tmp_path, monkeypatch):
    """The runs of a cell job differ in their method: the model on fake tensors is built and counted once,
    and every run's plan.json is the plan a run of its own counts, its method's copies of the policy
    included (DGPO's frozen reference: a cell once gave it the plan of the method before it)."""
    calls = counted_shape_models(monkeypatch)
    full, agg, dgpo = (load_config(None, [*TINY, m]) for m in ("method={name: full}", "method={name: agg, window: 3}",
                                                               "method={name: dgpo}"))
    first, second, third = (memplan.run_memory_plan(c, 1) for c in (full, agg, dgpo))
    assert len(calls) == 1
    own = [memplan.plan_memory(c, 1, suggest=False).as_dict() for c in (full, agg, dgpo)]
    assert len(calls) == 4 and [first, second, third] == own
    assert first == second and third["bytes"]["params"] > first["bytes"]["params"]
    micro = load_config(None, [*TINY, "method={name: full, micro_batch: 1}"])  # the micro-batch counts
    assert memplan.run_memory_plan(micro, 1) != first and len(calls) == 4


def test_runs_that_differ_only_in_their_schedule_share_a_memory_plan(monkeypatch):
    """train.iterations and train.checkpoint_every build nothing: a run that differs from another only in
    them is planned from the same count, and its plan is the plan a count of its own gives."""
    calls = counted_shape_models(monkeypatch)
    short, long = (load_config(None, [*TINY, *sets]) for sets in (
        ["train.iterations=1"], ["train.iterations=5", "train.checkpoint_every=2"]))
    first, second = (memplan.run_memory_plan(c, 1) for c in (short, long))
    assert len(calls) == 1 and "error" not in first
    assert first == second == memplan.plan_memory(long, 1, suggest=False).as_dict() and len(calls) == 2
    other = load_config(None, [*TINY, "train.iterations=5", "train.gradient_checkpointing=true"])
    memplan.run_memory_plan(other, 1)  # a key that builds: a count of its own
    assert len(calls) == 3
