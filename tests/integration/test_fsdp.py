"""FSDP2 sharding (``train.shard: fsdp``): two CPU processes (gloo) give the single-process update of the
same global batch for every method, make the same sequence of transformer calls on every process, and a
sharded checkpoint resumes to the uninterrupted run's records.

The session's one two-process torchrun launch (tests/integration/two_processes.py) runs every two-process case and a
sharded ``agg-bench calibrate`` (:func:`two_process_part`); the tests compare its files with single-process sessions
here, and resume a copy of its sharded checkpoint. float64 throughout (``model.dtype: float64``), so two processes differ
from one only in the order of additions: relative error <= 1e-6 is float64 rounding with a wide margin.
"""
from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest
import torch

from agg_bench.config import load_config
from agg_bench.engine.models import Policy
from agg_bench.errors import ConfigError
from agg_bench.io import read_jsonl
from agg_bench.machine import distributed, fsdp
from agg_bench.runtime.train import TIMING_KEYS, Session, train
from helpers import Calls, relative_error, torchrun

ROOT = Path(__file__).resolve().parents[2]
BASE = ["model.resolution=32", "model.dtype=float64", "sampling.steps=6", "grpo.group_size=3",
        "grpo.prompts_per_iteration=4", "train.plan=groups", "train.plan_window=3", "progress=false",
        "telemetry.enabled=false", "train.lr=0.001", "train.max_grad_norm=0.001"]  # clipping is active
AGG = 'method={"name": "agg", "window": 3, "alpha": "sigma", "route_frac": %s, "reuse_rollout_velocity": %s}'
CASES = {
    "full": ["method.name=full"],
    "agg_1": [AGG % (1.0, "false")],
    "agg_half": [AGG % (0.5, "false")],
    "agg_1_reuse": [AGG % (1.0, "true")],
    "agg_half_reuse": [AGG % (0.5, "true")],
    "agg_half_state": [AGG % (0.5, "false"), "method.route_score=state_cosine", "method.nograd_batch=2"],
    # a separate sharded KL reference, and its passes padded in lockstep too
    "agg_half_kl": [AGG % (0.5, "false"), "method.route_score=state_cosine", "grpo.beta=0.1"],
    # endpoint velocities from the endpoint forwards-with-grad: interior no-grad passes only
    "agg_half_endpoints_kl": [AGG % (0.5, "false"), "method.route_score=state_cosine",
                              "method.endpoint_velocity=reuse", "grpo.beta=0.1"],
    # LoRA (the KL reference is the policy's own sharded transformer, adapters off) and checkpointing
    "full_lora_checkpointing": ["method.name=full", "train.lora_rank=2", "train.gradient_checkpointing=true",
                                "grpo.beta=0.1"],
    "fraction": ["method.name=fraction", "train.plan=steps", "train.timestep_fraction=0.5"],
    "window": ['method={"name": "window", "window_size": 3, "window_mode": "random"}', "train.plan=steps"],
    "cached_train": ['method={"name": "cached", "cache": "fora", "cache_in": "train"}', "train.plan=steps",
                     "train.timestep_fraction=0.5"],
}
RESUME = [*BASE, 'method={"name": "agg", "window": 3, "route_frac": 0.5}']
TOL = 1e-6
# the sharded calibration the launch runs after its other cases: two timed rounds of the methods (the test counts
# them), but one measurement of each kind of pass and no warm-up round, since what the test checks (the processes,
# the batch, the passes, one file) does not depend on those counts
CALIBRATE = ["calibrate", "--config", "config/run.yaml",
             *[a for item in ("model.resolution=32", "sampling.steps=4", "grpo.prompts_per_iteration=2",
                              "train.shard=fsdp", "progress=false") for a in ("--set", item)],
             "--repeats", "1", "--warmup", "0", "--method-repeats", "2", "--method", "full", "{method: {name: full}}",
             "--method", "agg", "{method: {name: agg, window: 4}}"]


def config(*overrides: str):
    return load_config(None, [*BASE, *overrides])



def full_tensor(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


def one_update(cfg) -> dict:
    """Loss, gradient norm, (clipped) gradients and parameter change of the first update of iteration 0,
    with the pass counts of this process."""
    session = Session(cfg)
    before = {n: full_tensor(p) for n, p in session.policy.named_parameters()}
    out = session.update(session.collect(0).batch)
    after = {n: full_tensor(p) for n, p in session.policy.named_parameters()}
    return {"loss": out["loss"], "grad_norm": out["grad_norm"],
            "grads": {n: full_tensor(p.grad) for n, p in session.policy.named_parameters()},
            "delta": {n: after[n] - before[n] for n in after},
            "counts": session.policy.counter.as_dict(), "padding": session.policy.padding_passes}


# ----- one process -------------------------------------------------------------------------------
def test_options_are_checked():
    with pytest.raises(ConfigError) as err:
        load_config(None, ["train.shard=zero3"])
    assert err.value.key == "train.shard"
    for bad in ("1", "null", "nan"):
        with pytest.raises(ConfigError) as err:
            load_config(None, [f"train.cpu_offload={bad}"])
        assert err.value.key == "train.cpu_offload"
    for offload_error in (["train.cpu_offload=true"], ["train.cpu_offload=true", "train.shard=fsdp"]):
        with pytest.raises(ConfigError) as err:  # without sharding; on the CPU
            fsdp.check_run(load_config(None, offload_error))
        assert err.value.key == "train.cpu_offload"
    # a cache that decides per sample which blocks to skip would desynchronise the processes
    with pytest.raises(ConfigError) as err:
        Session(config("train.shard=fsdp", 'method={"name": "cached", "cache": "teacache"}'))
    assert err.value.key == "method.cache"


def test_sharding_needs_the_run_process_group():
    """Outside ``agg-bench run`` (here: a bare Session) there is no process group: one clear error."""
    with pytest.raises(ConfigError) as err:
        Session(config("train.shard=fsdp"))
    assert err.value.key == "train.shard"


@pytest.mark.slow
def test_single_process_fsdp_run_equals_the_unsharded_run_and_resumes(tmp_path):
    """Without torchrun, ``train.shard: fsdp`` runs on a process group of one process: the same records
    as ``none`` (one process: nothing is split, so the update is the same arithmetic), and a sharded
    checkpoint resumes to the uninterrupted records."""
    from agg_bench.cli import main

    args = [a for o in RESUME for a in ("--set", o)] + ["--set", "train.iterations=2"]
    assert main(["run", *args, "--out", str(tmp_path / "none")]) == 0
    part = [*args, "--set", "train.shard=fsdp", "--checkpoint-every", "1", "--out", str(tmp_path / "fsdp")]
    assert main(["run", *part, "--set", "train.iterations=1"]) == 0
    assert main(["run", *part, "--resume"]) == 0
    # iteration 0 sharded from the start, 1 after the resume
    assert_same_records(list(read_jsonl(tmp_path / "fsdp/metrics.jsonl")),
                        list(read_jsonl(tmp_path / "none/metrics.jsonl")), rel=1e-12)
    # only the newest shard folder is kept, the one checkpoint.pt names
    assert sorted(p.name for p in (tmp_path / "fsdp").glob("checkpoint_shards_*")) == ["checkpoint_shards_000001"]
    assert json.loads((tmp_path / "fsdp/summary.json").read_text())["resumed_from"] == 0


@pytest.mark.parametrize("damage", ["removed", "truncated"])
def test_a_damaged_shard_folder_refuses_the_resume_in_one_line(tmp_path, capsys, damage):
    """A shard file removed or cut by hand: torch.distributed.checkpoint reports it as a CheckpointException, a
    BaseException that passed every handler (a traceback, exit 1); now one line naming the folder, exit 2, and
    the folder as it was."""
    from agg_bench.cli import main

    out = tmp_path / "run"
    args = ["run", "--set", "model.resolution=32", "--set", "sampling.steps=2", "--set", "grpo.group_size=2",
            "--set", "grpo.prompts_per_iteration=2", "--set", "progress=false", "--set", "telemetry.enabled=false",
            "--set", "train.shard=fsdp", "--checkpoint-every", "1", "--out", str(out)]
    assert main([*args, "--set", "train.iterations=1"]) == 0
    shard_file = next((out / "checkpoint_shards_000000").glob("*.distcp"))
    if damage == "removed":
        shard_file.unlink()
    else:
        shard_file.write_bytes(shard_file.read_bytes()[:100])
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    capsys.readouterr()
    assert main([*args, "--set", "train.iterations=2", "--resume"]) == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("agg-bench run: --resume: ") and "checkpoint_shards_000000" in lines[0]
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before


def test_a_full_disk_while_the_shards_are_saved_is_a_full_disk(tmp_path, capsys, monkeypatch):
    """torch.distributed.checkpoint wraps a process's error in a CheckpointException (a BaseException, which the
    run's handlers let pass: no summary, a traceback); the run reports the error inside as any other."""
    import errno

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    from agg_bench.cli import main

    def full_disk(*args, **kwargs):
        raise CheckpointException("save", {0: (OSError(errno.ENOSPC, "No space left on device"), None)})

    monkeypatch.setattr(dcp, "save", full_disk)
    out = tmp_path / "run"
    assert main(["run", "--set", "model.resolution=32", "--set", "sampling.steps=2", "--set", "grpo.group_size=2",
                 "--set", "grpo.prompts_per_iteration=2", "--set", "progress=false", "--set", "telemetry.enabled=false",
                 "--set", "train.shard=fsdp", "--set", "train.iterations=1", "--checkpoint-every", "1",
                 "--out", str(out)]) == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and "no space left on device" in lines[0], lines
    assert json.loads((out / "summary.json").read_text())["status"] == "error"


def test_bfloat16_shards_compute_in_bfloat16_and_keep_float32_weights_and_gradients():
    """``model.dtype: bfloat16`` under FSDP: the forward gathers bfloat16 parameters (MixedPrecisionPolicy),
    while the sharded master weights and the reduced gradients stay float32."""
    from torch.distributed.fsdp import FSDPModule

    with distributed.process_group(torch.device("cpu"), single=True):
        session = Session(config("train.shard=fsdp", "model.dtype=bfloat16"))
        gathered = []
        block = session.policy.transformer.transformer_blocks[0]
        assert isinstance(block, FSDPModule)
        hook = block.register_forward_pre_hook(lambda module, args: gathered.append(module.attn.to_q.weight.dtype))
        out = session.update(session.collect(0).batch)
        hook.remove()
    assert gathered and set(gathered) == {torch.bfloat16}
    params = session.policy.parameters()
    assert {p.dtype for p in params} == {p.grad.dtype for p in params if p.grad is not None} == {torch.float32}
    assert math.isfinite(out["grad_norm"]) and out["grad_norm"] > 0


def assert_same_records(got: list[dict], want: list[dict], rel: float) -> None:
    assert [r["iteration"] for r in got] == [r["iteration"] for r in want]
    skip = set(TIMING_KEYS) | {"saved_activation_peak_bytes", "run_id"}
    for g, w in zip(got, want):
        for key in set(w) - skip:
            if isinstance(w[key], float):
                assert g[key] == pytest.approx(w[key], rel=rel, abs=1e-15), key
            elif isinstance(w[key], list) and w[key] and isinstance(w[key][0], float):
                assert g[key] == pytest.approx(w[key], rel=rel), key
            else:
                assert g[key] == w[key], key


# ----- two processes ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def launched(two_processes):
    """The files :func:`two_process_part` wrote in the session's two-process torchrun launch."""
    out, proc = two_processes
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return out / "fsdp"


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_two_sharded_processes_give_the_single_process_update(launched, case):
    two = torch.load(launched / f"{case}.pt")
    one = one_update(config(*CASES[case]))
    # the loss is near 0 on the first update (ratios 1, advantages summing to 0 per group): a sum of
    # terms of size ~1/(B N) that cancel, so its float64 rounding is absolute, far below 1e-12
    assert two["loss"] == pytest.approx(one["loss"], rel=TOL, abs=1e-12)
    assert two["grad_norm"] == pytest.approx(one["grad_norm"], rel=TOL)
    assert set(two["grads"]) == set(one["grads"])
    assert relative_error(two["grads"], one["grads"]) <= TOL
    assert relative_error(two["delta"], one["delta"]) <= TOL
    # every process made the same sequence of transformer calls (no-grad, with grad, backward)
    calls = two["calls"]
    assert calls[0] == calls[1] and len(calls[0]) > 0
    # the work of both processes is the single-process work plus the padding passes, which are counted
    padding = sum(two["padding"])
    forwards = lambda c: c["forward_nograd"] + c["forward_grad"]
    assert sum(forwards(c) for c in two["counts"]) == forwards(one["counts"]) + padding
    extra_backward = sum(c["backward"] for c in two["counts"]) - one["counts"]["backward"]
    assert 0 <= extra_backward <= padding
    if case in ("full", "agg_1", "agg_1_reuse", "fraction", "window"):
        assert padding == 0  # equal work on every process by construction


@pytest.mark.slow
def test_two_process_sharded_resume_equals_the_uninterrupted_run(launched):
    whole = list(read_jsonl(launched / "whole/metrics.jsonl"))
    resumed = list(read_jsonl(launched / "resumed/metrics.jsonl"))
    # the same computations in the same order on the same processes: equal up to float64 rounding of
    # the gloo reductions, which are deterministic too; the tolerance leaves room for nothing else
    assert_same_records(resumed, whole, rel=1e-12)
    summary = json.loads((launched / "resumed/summary.json").read_text())
    assert (summary["status"], summary["resumed_from"], summary["world_size"]) == ("ok", 0, 2)


# process 1 hangs (alive, never joining the second collective) longer than the launch may take; a worker of its
# own, which imports no trainer (two processes importing the model libraries cost more than the rest of the test)
HANG_WORKER = """
import sys, time
from pathlib import Path
import torch
from agg_bench.machine import distributed
with distributed.process_group(torch.device("cpu")) as shard:
    try:
        distributed.gather()  # on a loaded machine a process may reach this one seconds late: a timeout too
        if shard.rank == 1:
            time.sleep(float(sys.argv[2]))
        distributed.gather()
    except RuntimeError as err:
        (Path(sys.argv[1]) / f"hang.{shard.rank}.txt").write_text(f"rank {shard.rank}: {err}")
        raise
"""
HANG_S = 200


@pytest.mark.slow
def test_a_stuck_process_ends_the_job_at_the_collective_timeout(tmp_path):
    """Process 1 hangs (alive, never joining); process 0's next collective fails after
    AGG_BENCH_DIST_TIMEOUT_S, and torchrun ends the job. Without the timeout the launch would wait
    past the subprocess timeout (process 1 sleeps longer) and the test would fail. On a loaded machine a process
    may reach the first collective seconds after the other, which then times out there: the job ends the same way."""
    worker = tmp_path / "hang.py"
    worker.write_text(HANG_WORKER)
    proc = torchrun(str(worker), str(tmp_path), str(HANG_S + 60), env={distributed.TIMEOUT_ENV: "3"}, timeout=240)
    assert proc.returncode != 0
    timed_out = sorted(p.read_text() for p in tmp_path.glob("hang.*.txt"))
    assert timed_out and all("timed out" in text.lower() for text in timed_out), (timed_out, proc.stderr[-3000:])


@pytest.mark.slow
def test_two_processes_refuse_a_crafted_shard_metadata_in_one_line_unexecuted(launched, tmp_path):
    """A two-process sharded checkpoint (a copy of the launch's resumed run) whose ``.metadata`` was crafted to run a
    command: every process refuses it unread (the command runs on none), one line names the file, and the run
    folder is as it was."""
    import pickle  # noqa: TID251 (crafts the file the resume must refuse)
    import shutil

    out, marker = tmp_path / "run", tmp_path / "ran"
    shutil.copytree(launched / "resumed", out)
    sets = [a for item in [*RESUME, "train.shard=fsdp", "train.checkpoint_every=1"] for a in ("--set", item)]
    metadata = out / "checkpoint_shards_000001" / ".metadata"
    assert metadata.is_file()
    metadata.write_bytes(pickle.dumps(Calls(os.system, f"touch {marker}")))
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    proc = torchrun("-m", "agg_bench", "run", *sets, "--set", "train.iterations=3", "--resume", "--out", str(out),
                    timeout=300)
    lines = [line for line in proc.stderr.splitlines() if line.startswith("agg-bench run:")]
    assert proc.returncode != 0 and len(lines) == 1, proc.stderr[-3000:]
    assert str(metadata) in lines[0] and "posix.system" in lines[0] and "refused unread" in lines[0]
    assert not marker.exists()
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before


def test_timeout_variable_is_checked(monkeypatch):
    monkeypatch.setenv(distributed.TIMEOUT_ENV, "12.5")
    assert distributed.collective_timeout().total_seconds() == 12.5
    for bad in ("0", "0.001", "0.5", "-1", "nan", "inf", "soon", "1e12"):
        monkeypatch.setenv(distributed.TIMEOUT_ENV, bad)
        with pytest.raises(Exception) as err:
            distributed.collective_timeout()
        assert distributed.TIMEOUT_ENV in str(err.value)


# ----- the worker ---------------------------------------------------------------------------------
def _record_calls() -> list[str]:
    """Record every transformer call of this process: "n" no-grad forward, "g" forward with grad,
    "b" the backward through its output."""
    calls: list[str] = []
    velocity = Policy.velocity

    def recorded(self, latents, timesteps, cond):
        out = velocity(self, latents, timesteps, cond)
        calls.append("g" if out.requires_grad else "n")
        if out.requires_grad:
            out.register_hook(lambda grad: calls.append("b"))
        return out

    Policy.velocity = recorded
    return calls


def two_process_part(out: Path) -> None:
    """Run in each process of the session's two-process launch (tests/integration/two_processes.py)."""
    torch.set_num_threads(1)
    velocity = Policy.velocity
    with distributed.process_group(torch.device("cpu")) as shard:
        assert shard.world_size == 2
        calls = _record_calls()
        for case, overrides in CASES.items():
            calls.clear()
            result = one_update(config(*overrides, "train.shard=fsdp"))
            parts = distributed.gather((list(calls), result["counts"], result["padding"], result["loss"]))
            if shard.is_main:
                # each process's loss is the mean over its share; the run's record averages them
                result.update(calls=[p[0] for p in parts], counts=[p[1] for p in parts],
                              padding=[p[2] for p in parts], loss=sum(p[3] for p in parts) / len(parts))
                torch.save(result, out / f"{case}.pt")
        cfg = lambda *o: load_config(None, [*RESUME, "train.shard=fsdp", *o])
        assert train(cfg("train.iterations=2"), out / "whole")["status"] == "ok"
        assert train(cfg("train.iterations=1", "train.checkpoint_every=1"), out / "resumed")["status"] == "ok"
        assert train(cfg("train.iterations=2", "train.checkpoint_every=1"), out / "resumed", resume=True)["status"] == "ok"
        # `agg-bench calibrate` (main, as `python -m agg_bench calibrate` runs it) in the launch's process group: a
        # gloo group joined again after one was left may read the address the last one left
        from agg_bench.cli import main

        Policy.velocity = velocity
        (out / "calibration").mkdir(exist_ok=True)
        code = main([*CALIBRATE, "--out", str(out / "calibration" / "cal.json")])
        (out / f"calibrate.{shard.rank}.code").write_text(str(code))



@pytest.mark.slow
def test_a_sharded_calibration_runs_on_two_processes_and_rank_0_writes_it(launched, two_processes):
    """The workflow calibrates a sharded cell on its runs' GPUs: every process measures its share with
    the collectives the runs pay (the model may fit only when sharded), and one file is written (the launch ran
    ``agg-bench calibrate``, :data:`CALIBRATE`, last)."""
    codes = [(launched / f"calibrate.{rank}.code").read_text() for rank in (0, 1)]
    assert codes == ["0", "0"], codes
    folder = launched / "calibration"
    # one result line for the job, rank 0's: two processes' lines on one pipe may run into each other
    lines = [line for line in two_processes[1].stdout.splitlines() if str(folder) in line]
    assert len(lines) == 1 and json.loads(lines[0])["out"] == str(folder / "cal.json"), lines
    result = json.loads((folder / "cal.json").read_text())
    b, steps = 4, 4  # each process: one of the 2 groups of 4 images
    assert (result["processes"], result["batch"]) == (2, b)
    assert result["methods"]["full"]["passes"] == {"forward_nograd": 0, "forward_grad": b * steps, "backward": b * steps}
    assert result["methods"]["agg"]["passes"] == {"forward_nograd": b * steps, "forward_grad": 2 * b, "backward": 2 * b}
    assert all(len(m["cpu_s"]) == 2 for m in result["methods"].values())
    assert [p.name for p in folder.iterdir()] == ["cal.json"]
