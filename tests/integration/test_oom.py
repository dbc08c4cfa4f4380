"""Memory in the metric record: out-of-memory failures end a run cleanly with ``status: oom``, a CPU
run fills every docs/design.md record key with null for the GPU-only fields, and the saved-activation peak of one
backward is the same for AGG as for full GRPO."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from agg_bench.cli import main
from agg_bench.engine.grpo import step_terms
from agg_bench.engine.models import Policy
from agg_bench.io import read_jsonl
from agg_bench.machine.telemetry import SavedActivations, Telemetry
from agg_bench.methods.base import available_methods
from agg_bench.records import RECORD_KEYS
from agg_bench.runtime import session as session_module
from agg_bench.runtime import train as train_module
from agg_bench.runtime.train import Session
from helpers import tiny_config

ROOT = Path(__file__).resolve().parents[2]
SMALL = ["--set", "model.resolution=32", "--set", "sampling.steps=4", "--set", "grpo.group_size=2",
         "--set", "grpo.prompts_per_iteration=1", "--set", "progress=false"]

# The metric record of docs/design.md, written out here so that a key dropped from the code is caught.
DESIGN_KEYS = (
    "run_id", "method", "model", "resolution", "device", "gpu_name", "n_gpus", "seed", "iteration",
    "reward_mean", "reward_std", "loss", "grad_norm", "clip_frac", "approx_kl",
    "t_rollout_s", "t_reward_s", "t_train_s", "t_iter_s", "images_per_s",
    "t_rollout_cpu_s", "t_reward_cpu_s", "t_train_cpu_s", "t_iter_cpu_s",
    "forward_nograd", "forward_grad", "backward",
    "peak_alloc_bytes", "peak_reserved_bytes", "nvml_peak_used_bytes", "saved_activation_peak_bytes",
    "rss_peak_bytes", "energy_j", "status",
)
GPU_ONLY_KEYS = ("gpu_name", "peak_alloc_bytes", "peak_reserved_bytes", "nvml_peak_used_bytes", "energy_j")
MEMORY_AT_FAILURE_KEYS = ("allocated_bytes", "reserved_bytes")


def run_cli(out: Path, *extra: str) -> int:
    return main(["run", *SMALL, *extra, "--out", str(out)])


def records(out: Path) -> list[dict]:
    return list(read_jsonl(out / "metrics.jsonl"))


def summary(out: Path) -> dict:
    return json.loads((out / "summary.json").read_text())


def inject_failure(monkeypatch, phase: str, error: BaseException) -> None:
    """Make the second iteration (policy version 1) fail with ``error`` in ``phase``: on its first
    rollout forward, or on its second forward-with-grad (after one backward has saved and freed
    activations, so the failed iteration has a saved-activation peak to report)."""
    original = Policy.velocity
    grad_calls = []

    def velocity(self, latents, timesteps, cond):
        in_train = torch.is_grad_enabled()
        if self.version == 1 and phase == ("train" if in_train else "rollout"):
            grad_calls.append(1)
            if phase == "rollout" or len(grad_calls) == 2:
                raise error
        return original(self, latents, timesteps, cond)

    monkeypatch.setattr(Policy, "velocity", velocity)


@pytest.mark.parametrize("phase, error", [
    ("train", torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")),
    ("train", RuntimeError("HIP out of memory: tried to allocate 512 MiB")),
    ("rollout", MemoryError()),
], ids=["torch-oom-in-train", "runtime-oom-in-train", "host-oom-in-rollout"])
def test_oom_ends_the_run_with_status_oom_and_exit_code_0(tmp_path, monkeypatch, capsys, phase, error):
    inject_failure(monkeypatch, phase, error)
    out = tmp_path / "run"
    # counted in every iteration, so the failed one (the second) has its own saved-activation peak
    assert run_cli(out, "--set", "train.iterations=3", "--set", "telemetry.saved_activations=every") == 0
    assert json.loads(capsys.readouterr().out) == {"out": str(out), "status": "oom"}

    ok, oom = records(out)  # the run stops at the failed iteration
    assert ok["status"] == "ok" and ok["iteration"] == 0
    assert oom["status"] == "oom" and oom["iteration"] == 1
    assert set(DESIGN_KEYS) <= set(oom)
    for key in MEMORY_AT_FAILURE_KEYS:  # the allocator's bytes at failure; none on CPU
        assert key in oom and oom[key] is None
    # the record keeps what was measured up to the failure
    assert oom["t_iter_s"] > 0 and oom["t_rollout_s"] > 0 and oom["rss_peak_bytes"] > 0
    if phase == "train":
        assert oom["t_reward_s"] > 0 and oom["t_train_s"] > 0
        assert oom["saved_activation_peak_bytes"] > 0
    else:
        assert oom["t_reward_s"] is None and oom["t_train_s"] is None
    assert oom["reward_mean"] is None and oom["loss"] is None

    s = summary(out)
    assert s["status"] == "oom" and s["last_good_iteration"] == 0 and s["error"] is None


def test_oom_in_the_evaluation_ends_the_run_as_oom(tmp_path, monkeypatch, capsys):
    """The periodic evaluation (eval.every) generates images on the run's device and can run out of memory
    where training did not: the run ends oom with exit code 0 (it was an error, exit code 1 and a traceback
    reported as a bug), its records and evaluations up to the failure kept."""
    from agg_bench.runtime.evaluation import Evaluation

    original, calls = Evaluation.evaluate, []

    def evaluate(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 2:  # after the first iteration
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return original(self, *args, **kwargs)

    monkeypatch.setattr(Evaluation, "evaluate", evaluate)
    out = tmp_path / "run"
    assert run_cli(out, "--set", "train.iterations=2", "--set", "eval.every=1") == 0
    assert json.loads(capsys.readouterr().out) == {"out": str(out), "status": "oom"}
    assert [(r["iteration"], r["status"]) for r in records(out)] == [(0, "ok")]
    s = summary(out)
    assert s["status"] == "oom" and s["last_good_iteration"] == 0
    assert s["error"].startswith("out of memory in the evaluation after 1 iterations: OutOfMemoryError")


def test_agg_bench_run_process_exits_0_on_oom(tmp_path):
    out = tmp_path / "run"
    script = (
        "import sys, torch\n"
        "from agg_bench.cli import main\n"
        "from agg_bench.engine.models import Policy\n"
        "def velocity(self, *args):\n"
        "    raise torch.OutOfMemoryError('CUDA out of memory. Tried to allocate 80.00 GiB')\n"
        "Policy.velocity = velocity\n"
        "sys.exit(main(sys.argv[1:]))\n"
    )
    proc = subprocess.run([sys.executable, "-c", script, "run", *SMALL, "--out", str(out)],
                          capture_output=True, text=True, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    assert json.loads(proc.stdout.strip().splitlines()[-1])["status"] == "oom"
    (oom,) = records(out)
    assert oom["status"] == "oom" and oom["iteration"] == 0
    assert all(key in oom for key in MEMORY_AT_FAILURE_KEYS)
    assert summary(out)["status"] == "oom" and summary(out)["last_good_iteration"] is None


def test_other_errors_are_not_taken_for_oom(tmp_path, monkeypatch, capsys):
    inject_failure(monkeypatch, "train", RuntimeError("CUDA error: an illegal memory access was encountered"))
    out = tmp_path / "run"
    capsys.readouterr()
    assert run_cli(out, "--set", "train.iterations=2") == 1  # not anticipated: a bug line, then the traceback
    err = capsys.readouterr().err
    assert "bug in agg-bench" in err and "RuntimeError: CUDA error: an illegal memory access" in err
    assert [r["status"] for r in records(out)] == ["ok"]
    s = summary(out)
    assert s["status"] == "error" and "illegal memory access" in s["error"]


def test_a_real_cpu_allocation_failure_is_an_oom(tmp_path):
    # 2**29 px FLUX latents: the rollout's initial noise asks for 2**56 bytes, which no machine maps. The
    # config's bounds refuse such a resolution, so it is set after validation, as a bug could set it.
    out = tmp_path / "run"
    cfg = tiny_config("model.resolution=32", "train.iterations=1", "progress=false", family="flux", dtype="float32")
    cfg.model.resolution = 2 ** 29
    assert train_module.train(cfg, out)["status"] == "oom"
    assert records(out)[0]["status"] == "oom"
    assert summary(out)["status"] == "oom"


def test_cpu_record_has_every_design_key_and_null_gpu_fields(tmp_path):
    out = tmp_path / "run"
    assert run_cli(out, "--set", "train.iterations=1", "--set", "telemetry.enabled=true") == 0
    (record,) = records(out)
    assert set(DESIGN_KEYS) <= set(record)
    assert record["device"] == "cpu" and record["n_gpus"] == 0 and record["status"] == "ok"
    for key in GPU_ONLY_KEYS:
        assert record[key] is None, key  # not measurable here: null, never 0
    # everything else applies on CPU and is measured
    measured = [k for k in DESIGN_KEYS if k not in GPU_ONLY_KEYS]
    assert [k for k in measured if record[k] is None] == []
    for key in ("t_rollout_s", "t_reward_s", "t_train_s", "t_iter_s", "images_per_s",
                "saved_activation_peak_bytes", "rss_peak_bytes", "forward_grad", "backward"):
        assert record[key] > 0, key
    # full GRPO runs no no-grad forward in training; the rollout's 4 steps x 2 samples are all no-grad
    assert record["forward_nograd"] == 4 * 2


# --------------------------------------------------------------------------------------------------
# Saved activations per backward: AGG removes backward passes, not the size of one
# --------------------------------------------------------------------------------------------------


def saved_peak_of_update(method: str, *overrides: str) -> tuple[int, Session, object]:
    # one group of W = 5 trained steps per sample: full runs 5 backwards per sample, AGG 2
    cfg = tiny_config("sampling.steps=5", "train.plan=groups", "train.plan_window=5",
                      f"method.name={method}", *overrides, dtype="float32")
    session = Session(cfg)
    batch = session.collect(0).batch
    tracker = SavedActivations()
    with tracker:
        session.update(batch)
    return tracker.peak_bytes, session, batch


@pytest.mark.skipif("agg" not in available_methods(), reason="the agg method is not registered")
@pytest.mark.parametrize("resolution", [32, 64])
def test_agg_saved_activation_peak_per_backward_equals_full(resolution):
    full_peak, session, batch = saved_peak_of_update("full", f"model.resolution={resolution}")
    agg_peak, agg_session, agg_batch = saved_peak_of_update("agg", f"model.resolution={resolution}", "method.window=5")
    assert torch.equal(batch.train_steps, agg_batch.train_steps)  # same trained steps

    # One transformer forward-with-grad on the B latents that one backward covers (both methods use
    # the whole batch per call), and the GRPO loss graph full builds on top of its output.
    rows = torch.arange(batch.batch_size)
    steps = batch.train_steps[:, 0]
    dit = SavedActivations()
    with dit:
        v = session.policy.velocity(batch.states(rows, steps), batch.timestep_values(steps), batch.cond[rows])
    loss = SavedActivations()
    with loss:
        step_terms(batch, rows, steps, v.detach().requires_grad_(True))

    assert dit.peak_bytes > 0 and loss.peak_bytes > 0
    # What the policy network saves for one backward is the same for both methods: one forward with
    # grad over the B latents. AGG's endpoint backward starts from the aggregated upstream
    # gradient; full's per-step graph also holds the GRPO loss's own tensors on top of it.
    assert agg_peak == dit.peak_bytes
    assert full_peak == dit.peak_bytes + loss.peak_bytes
    # The training loop counts the network's tensors (phase "regions", the policy's forward marks
    # its region): there AGG's peak per backward equals full's exactly.
    assert regions_peak_of_update(session, batch) == dit.peak_bytes
    assert regions_peak_of_update(agg_session, agg_batch) == dit.peak_bytes


def regions_peak_of_update(session: Session, batch) -> int:
    with Telemetry(session.device) as telemetry:
        with telemetry.iteration():
            with telemetry.phase("train", saved_activations="regions"):
                session.update(batch)
        return telemetry.record()["saved_activation_peak_bytes"]


def test_oom_while_building_the_model_is_an_oom_run(tmp_path, monkeypatch, capsys):
    def build(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")

    monkeypatch.setattr(session_module, "build_policy", build)
    out = tmp_path / "run"
    assert run_cli(out) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out) == {"out": str(out), "status": "oom"}
    assert "out of memory while building the model" in captured.err
    (record,) = records(out)
    assert record["status"] == "oom" and record["iteration"] == 0 and record["method"] == "full"
    assert set(DESIGN_KEYS) <= set(record)
    assert list(record)[:len(RECORD_KEYS)] == list(RECORD_KEYS)  # every key, as every record holds them
    assert record["rss_peak_bytes"] > 0 and record["t_iter_s"] is None and record["reward_mean"] is None
    assert all(record[key] is None for key in MEMORY_AT_FAILURE_KEYS)  # no allocator on CPU
    assert summary(out)["status"] == "oom" and (out / "config.json").exists() and (out / "env.json").exists()

    # other errors while building stay errors
    monkeypatch.setattr(session_module, "build_policy", lambda *a, **k: (_ for _ in ()).throw(ValueError("bad")))
    capsys.readouterr()
    assert run_cli(tmp_path / "other") == 1
    assert "bug in agg-bench" in capsys.readouterr().err


def test_oom_while_building_keeps_a_resumed_runs_records_and_replaces_a_rerun(tmp_path, monkeypatch, capsys):
    out = tmp_path / "run"
    assert run_cli(tmp_path / "first", "--checkpoint-every", "1") == 0
    (tmp_path / "first").rename(out)  # the summary names the run of the records it keeps, not the renamed folder
    earlier = records(out)
    monkeypatch.setattr(session_module, "build_policy",
                        lambda *a, **k: (_ for _ in ()).throw(torch.OutOfMemoryError("out of memory")))
    assert run_cli(out, "--checkpoint-every", "1", "--resume") == 0
    assert records(out) == earlier and (out / "checkpoint.pt").exists()  # the resumed run's state stays
    assert summary(out)["status"] == "oom" and summary(out)["run_id"] == "first"
    # an oom end over ok records, as this attempt leaves them, is one run's files to the report
    assert main(["report", "--runs", str(out), "--tables", str(tmp_path / "tables")]) == 0
    assert run_cli(out, "--checkpoint-every", "1") == 0  # not resumed: the folder is this attempt's alone
    (record,) = records(out)
    assert record["status"] == "oom" and not (out / "checkpoint.pt").exists()
