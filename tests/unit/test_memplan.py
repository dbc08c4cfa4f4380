"""The memory planner (`agg-bench plan`): its counts against what a real tiny run holds and measures,
its suggestions, its CLI and bad input. Runtime: about 20 s on 2 cores."""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from helpers import exit_code, tiny_config

from agg_bench.cli import main
from agg_bench.machine import telemetry as tel
from agg_bench.machine.activations import WorkingMemory
from agg_bench.runtime.memplan import (PHASES, gpu_memory_bytes, ShapeModel, _Search, optimizer_step_bytes, plan_memory,
                                      run_layout, shape_key)
from agg_bench.runtime.train import Session, run_iteration

ROOT = Path(__file__).parents[2]

CASES = {
    # family, dtype, extra settings: full with the whole batch per forward; AGG with micro-batches under
    # bf16 autocast and a KL reference copy; LoRA with gradient checkpointing in float64
    "sd3-full": ("sd3", "float32", ["method.name=full", "sampling.steps=3"]),
    "flux-agg-bf16-kl": ("flux", "bfloat16", ['method={"name": "agg", "window": 3, "micro_batch": 4}',
                                             "train.plan=groups", "train.plan_window=3", "grpo.beta=0.1",
                                             "sampling.steps=3"]),
    "qwen-lora-ckpt": ("qwenimage", "float64", ["train.lora_rank=4", "train.gradient_checkpointing=true",
                                                "sampling.steps=3"]),
}


def _storage_bytes(tensors) -> int:
    return sum(t.untyped_storage().nbytes() for t in tensors)


@pytest.mark.parametrize("case", list(CASES))
def test_plan_equals_what_a_run_holds_and_measures(case):
    family, dtype, extra = CASES[case]
    cfg = tiny_config("telemetry.enabled=true", "telemetry.saved_activations=every", *extra,
                      family=family, dtype=dtype)
    plan = plan_memory(cfg, suggest=False)
    session = Session(cfg)
    telemetry = tel.Telemetry(session.device, saved_activations="every")
    fields = run_iteration(session, telemetry, 0)
    # activations: the same accounting on fake tensors as the run's on real ones, so equal exactly
    # (with gradient checkpointing the plan adds the blocks' inputs kept for recompute, which the run's
    # saved-tensor count does not see)
    assert (plan.checkpoint_input_bytes > 0) == ("ckpt" in case)
    assert fields["saved_activation_peak_bytes"] == plan.bytes["activations"] - plan.checkpoint_input_bytes
    assert plan.layout["micro_batch"] == (4 if "agg" in case else 6)
    policy = session.policy
    modules = [policy.transformer, policy.vae]
    if session.reference is not None and session.reference.transformer is not policy.transformer:
        modules.append(session.reference.transformer)
    held = _storage_bytes([t for m in modules for t in (*m.parameters(), *m.buffers())])
    assert plan.bytes["params"] == held
    trainable = policy.parameters()
    # one gradient and two AdamW moments per trainable parameter; a parameter the forward never reaches
    # (the text output of Qwen-Image's last block) gets none, so there the plan is an upper bound
    # (the iteration freed the gradients after its step: the parameters it reached are those AdamW stepped)
    assert all(p.grad is None for p in trainable)
    reached = [p for p in trainable if p in session.optimizer.state]
    assert len(reached) == len(trainable) or case == "qwen-lora-ckpt"
    assert plan.bytes["grads"] == _storage_bytes(trainable) >= _storage_bytes(reached)
    moments = [state[k] for state in session.optimizer.state.values() for k in ("exp_avg", "exp_avg_sq")]
    assert _storage_bytes(moments) == 2 * _storage_bytes(reached)
    assert plan.bytes["optimizer"] == 2 * plan.bytes["grads"]
    assert plan.trainable_parameters == sum(p.numel() for p in trainable)
    assert plan.parameters == sum(p.numel() for p in policy.transformer.parameters())
    # the decode's working memory: the run's own decode of its rollout batch, counted on real tensors, is
    # what the plan counted on fake ones
    rows = cfg.grpo.prompts_per_iteration * cfg.grpo.group_size
    latents = torch.zeros(rows, *session.latent_shape)
    with WorkingMemory() as decode:
        policy.decode(latents)
    assert decode.peak_bytes == plan.bytes["decode"] > 0
    # the step's temporaries: a real AdamW step in its one-tensor form (the CPU's default) and its foreach form
    # (a GPU's) holds what optimizer_step_bytes says; a parameter without a gradient is skipped by the step
    for parameter in reached:  # the run freed its own gradients after its step; the step needs some
        parameter.grad = torch.zeros_like(parameter)
    for device_type, foreach in (("cpu", False), ("cuda", True)):
        optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-6, foreach=foreach)
        optimizer.load_state_dict(session.optimizer.state_dict())
        optimizer.param_groups[0]["foreach"] = foreach  # the loaded group's own (None) would choose
        with WorkingMemory() as step:
            optimizer.step()
        planned = optimizer_step_bytes(trainable, 1, device_type)
        assert step.peak_bytes == optimizer_step_bytes(reached, 1, device_type) <= planned
        assert (step.peak_bytes == planned) == (case != "qwen-lora-ckpt" or device_type == "cpu")
    assert plan.bytes["optimizer_step"] == optimizer_step_bytes(trainable, 1, "cpu")
    # the weights and the moments throughout; the gradients in the train phase and the step, not in the decode
    kept = plan.bytes["params"] + plan.bytes["optimizer"]
    phases = {"train": kept + plan.bytes["grads"] + plan.bytes["activations"],
              "optimizer step": kept + plan.bytes["grads"] + plan.bytes["optimizer_step"],
              "decode": kept + plan.bytes["decode"]}
    assert set(phases) == set(PHASES)
    assert plan.bytes["total_per_gpu"] == max(phases.values())
    assert phases[plan.peak_phase] == max(phases.values())



def test_the_decode_and_the_rollout_hold_no_gradients_of_the_last_step():
    """The plan's decode phase holds the weights and moments but not the gradients: a run frees them after its
    update, so the second iteration's rollout and decode find none, while its train phase had them."""
    cfg = tiny_config("train.iterations=2", "grpo.beta=0")
    session = Session(cfg)
    telemetry = tel.Telemetry(session.device)
    seen = []
    decode, update = session.policy.decode, session.update

    def watched_decode(latents):
        seen.append(("decode", sum(p.grad is not None for p in session.policy.parameters())))
        return decode(latents)

    def watched_update(batch):
        out = update(batch)
        seen.append(("after update", sum(p.grad is not None for p in session.policy.parameters())))
        return out

    session.policy.decode, session.update = watched_decode, watched_update
    for iteration in range(2):
        run_iteration(session, telemetry, iteration)
    trainable = len(session.policy.parameters())
    assert seen == [("decode", 0), ("after update", trainable), ("decode", 0), ("after update", trainable)]
    assert session.optimizer.state and all(p.grad is None for p in session.policy.parameters())

MOVING_AVERAGES = {
    # a method's moving average of the policy is a whole frozen copy of the transformer, LoRA or not
    "nft": ['method={"name": "nft", "times_per_sample": 2, "old_decay_rate": 0.001}'],
    "nft-lora": ['method={"name": "nft", "times_per_sample": 2, "old_decay_rate": 0.001}', "train.lora_rank=4"],
    "awm": ['method={"name": "awm", "times_per_sample": 2, "ema_kl_beta": 1.0}'],
    # DGPO keeps a frozen reference of its own without grpo.beta: the session's, with it
    "dgpo": ['method={"name": "dgpo", "times_per_sample": 2, "clip_dsm": true}', "grpo.beta=0.1"],
    "dgpo-own-reference": ['method={"name": "dgpo", "times_per_sample": 2, "clip_dsm": true}', "grpo.beta=0"],
}


@pytest.mark.parametrize("case", list(MOVING_AVERAGES))
def test_a_methods_moving_average_of_the_policy_is_charged_as_the_copy_it_holds(case):
    settings = ["sampling.same_noise_per_group=false", *MOVING_AVERAGES[case]]
    plan = plan_memory(tiny_config(*settings, dtype="float32"), suggest=False)
    session = Session(tiny_config(*settings, dtype="float32"))
    session.collect(0)  # the method makes its moving average at its first rollout
    policy, average = session.policy, session.estimator.ema
    modules = [policy.transformer, policy.vae, average.policy.transformer]
    for reference in (session.reference, getattr(session.estimator, "frozen", None)):  # the session's, DGPO's own
        if reference is not None and reference.transformer is not policy.transformer:
            modules.append(reference.transformer)
    assert plan.bytes["params"] == _storage_bytes([t for m in modules for t in (*m.parameters(), *m.buffers())])
    without = plan_memory(tiny_config(settings[0], *MOVING_AVERAGES[case][1:], f"method.name={case.split('-')[0]}",
                                      "method.times_per_sample=2", dtype="float32"), suggest=False)
    assert plan.bytes["params"] - without.bytes["params"] == \
        _storage_bytes([*average.policy.transformer.parameters(), *average.policy.transformer.buffers()])


def test_fsdp_divides_the_model_state_and_the_batch():
    cfg = tiny_config("grpo.prompts_per_iteration=4", "train.shard=fsdp", "telemetry.enabled=true")
    one, four = plan_memory(cfg, 1, suggest=False), plan_memory(cfg, 4, suggest=False)
    shapes = ShapeModel(cfg)
    transformer = shapes.policy(False, 0).transformer
    expected = sum(-(-p.shape[0] // 4) * (p.numel() // p.shape[0]) * p.element_size() for p in transformer.parameters())
    assert four.bytes["grads"] == expected and four.bytes["optimizer"] == 2 * expected
    assert four.bytes["grads"] < one.bytes["grads"]
    # every process trains 3 of the 12 samples
    assert four.layout["micro_batch"] == 3 and one.layout["micro_batch"] == 12
    assert four.bytes["activations"] == shapes.activations(3, False, 0)
    offloaded = plan_memory(tiny_config("grpo.prompts_per_iteration=4", "train.shard=fsdp", "train.cpu_offload=true"),
                            4, suggest=False)
    assert offloaded.bytes["grads"] == offloaded.bytes["optimizer"] == 0


def test_suggestions_fit_and_the_run_does_not():
    cfg = tiny_config(family="flux", dtype="float32")
    shapes = ShapeModel(cfg)
    base = run_layout(cfg)
    total = shapes.bytes_per_gpu(base)["total_per_gpu"]
    half = shapes.bytes_per_gpu(replace(base, micro_batch=base.micro_batch // 2))["total_per_gpu"]
    budget = (total + half) // 2  # between: half the micro-batch fits, the whole one does not
    # the plan counts on the model its search is checked on below (plan_memory's own search shares its model too)
    plan = plan_memory(cfg, gpu_memory=budget / 0.9 + 1, shapes=shapes)
    assert not plan.fits
    assert plan.suggestions and plan.suggestions[0].startswith(f"method.micro_batch={base.micro_batch // 2}:")
    search = _Search(shapes, base, plan.gpu_memory_bytes - plan.reserve_bytes, True, cfg.grpo.group_size)
    layouts = search.suggestions()
    assert len(layouts) == len(plan.suggestions)
    assert all(search.fits(layout) for layout in layouts)
    # a suggestion applied to the config is a plan that fits
    applied = plan_memory(tiny_config(f"method.micro_batch={base.micro_batch // 2}", family="flux", dtype="float32"),
                          gpu_memory=plan.gpu_memory_bytes, suggest=False)
    assert applied.fits


def test_cli_plan_json_and_nowhere_to_fit(capsys):
    assert main(["plan", "--set", "model.resolution=32", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert set(plan) >= {"parameters", "trainable_parameters", "bytes", "fits", "suggestions"}
    assert set(plan["bytes"]) == {"params", "grads", "optimizer", "activations", "optimizer_step", "decode",
                                  "total_per_gpu"}
    assert plan["peak_phase"] in ("train", "optimizer step", "decode")
    assert plan["fits"] is True and plan["suggestions"] == []
    # one KiB fits nothing: it says so and exits 0
    assert main(["plan", "--set", "model.resolution=32", "--gpu-memory", str(1 / 1024 ** 2), "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["fits"] is False and plan["suggestions"] == []
    assert main(["plan", "--set", "model.resolution=32", "--gpu-memory", "0.5"]) == 0
    assert "fits: " in capsys.readouterr().out


@pytest.mark.parametrize("args, key", [
    (["--gpu-memory", "-1"], "--gpu-memory"), (["--gpu-memory", "nan"], "--gpu-memory"),
    (["--gpu-memory", "inf"], "--gpu-memory"), (["--gpus", "0"], "--gpus"),
    # under one byte: planned as 0 bytes, against the bound the message gave
    (["--gpu-memory", "1e-300"], "--gpu-memory = 1e-300: expected a number of GiB of at least 9.31e-10 (one byte)"),
    (["--gpus", "3"], "grpo.prompts_per_iteration"),
    # far past any batch: the message named grpo.prompts_per_iteration's multiple, not --gpus and its bound
    (["--gpus", str(10**12)], "--gpus = 1000000000000: expected an integer from 1 to 1,024"),
    (["--set", "model.preset=random", "--set", "model.architecture=sd4"], "model.architecture"),
])
def test_cli_plan_bad_input(args, key, capsys):
    assert exit_code(["plan", *args]) == 2  # nan and inf refused as argparse reads them (SystemExit 2)
    err = capsys.readouterr().err
    assert key in err and len(err.strip().splitlines()) == 1


def test_run_records_its_plan(tmp_path):
    from agg_bench.config import load_config
    from agg_bench.runtime.train import train

    cfg = load_config(None, ["model.resolution=32", "sampling.steps=3", "train.iterations=1", "progress=false"])
    train(cfg, tmp_path / "run")
    plan = json.loads((tmp_path / "run" / "plan.json").read_text())
    record = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    assert plan["bytes"]["activations"] == record["saved_activation_peak_bytes"]
    assert record["weights"] == "tiny"




def _sweep(name: str) -> dict:
    import yaml

    return yaml.safe_load((ROOT / "config" / name).read_text())


def test_gpu_sweeps_share_their_layouts():
    """config/gpu.yaml and gpu_random.yaml differ only in where the weights come from (and the reward)."""
    real, random = _sweep("gpu.yaml"), _sweep("gpu_random.yaml")
    for key in ("devices", "resolutions", "methods", "exclude"):
        assert real[key] == random[key], key
    drop = ("model.preset", "model.pretrained", "model.architecture")
    for label in real["models"]:
        assert {k: v for k, v in real["models"][label].items() if k not in drop} == \
            {k: v for k, v in random["models"][label].items() if k not in drop}
    assert {k: v for k, v in real["base"].items() if k != "reward"} == \
        {k: v for k, v in random["base"].items() if k != "reward"}


@pytest.mark.slow
def test_every_paper_scale_layout_fits_one_8_gpu_node(tmp_path):
    """Each run of config/gpu_random.yaml (the layouts of gpu.yaml, see above), planned on its own layout
    (the GPUs of its device label) with an H200's memory, fits. Activations grow with the resolution, so
    each layout is planned at the largest resolution it runs at."""
    import fnmatch

    import yaml

    from agg_bench.config import load_config

    sweep = _sweep("gpu_random.yaml")
    base = tmp_path / "base.yaml"
    base.write_text(yaml.safe_dump(sweep["base"]))

    def excluded(labels):
        return any(all(fnmatch.fnmatchcase(str(labels[k]), str(p)) for k, p in entry.items())
                   for entry in sweep.get("exclude", []))

    largest = {}  # (model, device, the method's memory settings) -> (resolution, run labels, overrides)
    for model, model_set in sweep["models"].items():
        for method, method_set in sweep["methods"].items():
            for device, spec in sweep["devices"].items():
                for resolution in sorted(sweep["resolutions"]):
                    labels = dict(model=model, resolution=resolution, method=method, device=device, seed=0)
                    if excluded(labels):
                        continue
                    memory = {k: v for k, v in method_set.items() if k.startswith("train.")}
                    memory["micro_batch"] = method_set["method"].get("micro_batch")
                    key = (model, device, json.dumps(memory, sort_keys=True))
                    pairs = {**model_set, "model.resolution": resolution, **method_set, "device": "cuda"}
                    largest[key] = (resolution, labels, pairs, spec["gpus"])
    shapes: dict[str, ShapeModel] = {}  # the methods of one model share its counts on fake tensors, as runs do
    for _resolution, labels, pairs, gpus in largest.values():
        cfg = load_config(base, [f"{k}={json.dumps(v)}" for k, v in pairs.items()])
        shaped = shapes.get(shape_key(cfg))
        if shaped is None:
            shaped = shapes[shape_key(cfg)] = ShapeModel(cfg)
        plan = plan_memory(cfg, gpus, gpu_memory=139 * 1024 ** 3, suggest=False, shapes=shaped)
        assert plan.fits, (labels, plan.bytes)
    # one count per model and gradient checkpointing: the methods differ in keys that only schedule
    assert len(shapes) == 4, list(shapes)
    assert {gpus for *_, gpus in largest.values()} == {1, 8}
    assert {labels["resolution"] for _, labels, _, _ in largest.values()} == {720, 1024}


def test_the_shape_model_casts_no_float32_model(monkeypatch, caplog):
    # diffusers warns about any dtype cast of a model; a float32 plan (its adapters too) has nothing to cast, and
    # a `plan` printed four such warnings on stderr
    import logging

    monkeypatch.setattr(logging.getLogger("diffusers"), "propagate", True)  # diffusers' own handler: stderr
    with caplog.at_level(logging.WARNING, logger="diffusers"):
        plan = plan_memory(tiny_config("train.lora_rank=4", dtype="float32"), 1, gpu_memory=1)
    assert not plan.fits and 0 < plan.trainable_parameters < plan.parameters
    assert not [r.getMessage() for r in caplog.records if "Casting directly" in r.getMessage()]


def test_the_gpu_budget_is_the_current_devices_not_device_0(monkeypatch):
    """The planner's default budget on a node whose GPUs all stay visible: the current device's memory (a rank
    on device 1 has set it), or that of the device a run names; a run on cuda:1 planned against device 0's
    memory was told that a model fits (or not) by the wrong GPU."""
    from helpers import FAKE_GPUS, fake_two_gpus

    fake_two_gpus(monkeypatch, current=1)
    assert gpu_memory_bytes("cuda") == FAKE_GPUS[1][1]
    assert gpu_memory_bytes("cuda:0") == FAKE_GPUS[0][1]
    assert gpu_memory_bytes("cuda:1") == FAKE_GPUS[1][1]
    cfg = tiny_config("device=cuda:1")
    assert plan_memory(cfg, suggest=False).gpu_memory_bytes == FAKE_GPUS[1][1]
    fake_two_gpus(monkeypatch, current=0)
    assert plan_memory(cfg, suggest=False).gpu_memory_bytes == FAKE_GPUS[1][1]
