"""Checkpoint and resume: a run stopped at iteration k and resumed writes the records of an uninterrupted
run (every field but timings), with no iteration duplicated or missing; reruns start clean."""
from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
import torch

from agg_bench.cli import main
from agg_bench.config import load_config
from agg_bench.errors import UserError
from agg_bench.io import read_jsonl
from agg_bench.runtime.checkpoint import CHECKPOINT_NAME
from agg_bench.runtime.train import TIMING_KEYS, Interrupted, Session, train
from helpers import crafted_checkpoint, signal_after_first_optimizer_step

# telemetry on, with its default saved_activations: first, so that the comparison covers the saved-activation
# count of the run's first iteration (and its absence after)
SMALL = ["model.resolution=32", "sampling.steps=4", "grpo.group_size=2", "progress=false", "run_id=resume"]
METHODS = {
    "full": ["method.name=full"],
    # reuse needs the restored policy version; several optimizer steps per iteration need the optimizer state; a
    # partial route over two mini-batches routes 1 then 0 of their 2 + 2 groups in each epoch (nothing carried over)
    "agg": ['method={"name": "agg", "window": 4, "reuse_rollout_velocity": true, "route_frac": 0.3}',
            "train.inner_epochs=2", "train.minibatches=2"],
    # a moving average of the policy (the old policy: it samples the rollout and is charged) kept across iterations
    "nft": ['method={"name": "nft", "times_per_sample": 2, "old_decay_rate": 0.3, "old_decay_max": 0.6}',
            "sampling.same_noise_per_group=false"],
    # its own frozen reference (grpo.beta = 0): the starting policy, not the weights the run resumed from
    "dgpo": ['method={"name": "dgpo", "trunc_steps": 2, "times_per_sample": 2}', "sampling.same_noise_per_group=false"],
}
ITERATIONS = 4


def config(method: str, *overrides: str):
    return load_config(None, [*SMALL, *METHODS[method], f"train.iterations={ITERATIONS}", *overrides])


def records(out: Path) -> list[dict]:
    return list(read_jsonl(out / "metrics.jsonl"))


def summary(out: Path) -> dict:
    return json.loads((out / "summary.json").read_text())


def learned(recs: list[dict]) -> list[dict]:
    """Records without the fields that depend on the machine's speed or load (the saved-activation count is
    exact: it stays)."""
    return [{k: v for k, v in r.items() if k not in TIMING_KEYS} for r in recs]


_REFERENCE: dict[str, list[dict]] = {}


def reference(method: str, tmp_path_factory) -> list[dict]:
    """Records of the uninterrupted run (made once per method)."""
    if method not in _REFERENCE:
        out = tmp_path_factory.mktemp(f"reference-{method}")
        train(config(method), out)
        _REFERENCE[method] = records(out)
    return _REFERENCE[method]


def signal_at(monkeypatch, name: str, call: int, after: bool = False) -> None:
    """Send this process SIGTERM at the ``call``-th (1-based) call of ``Session.<name>``, before it or after it."""
    original = getattr(Session, name)
    calls = []

    def wrapped(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == call and not after:
            os.kill(os.getpid(), signal.SIGTERM)
        out = original(self, *args, **kwargs)
        if len(calls) == call and after:
            os.kill(os.getpid(), signal.SIGTERM)
        return out

    monkeypatch.setattr(Session, name, wrapped)


@pytest.mark.parametrize("method", list(METHODS))
def test_interrupted_between_iterations_then_resumed_equals_uninterrupted(tmp_path, monkeypatch, method,
                                                                          tmp_path_factory):
    expected = reference(method, tmp_path_factory)
    out = tmp_path / "run"
    signal_at(monkeypatch, "collect", 4)  # during iteration 3, before any optimizer step in it
    with pytest.raises(Interrupted):
        train(config(method, "train.checkpoint_every=2"), out)
    monkeypatch.undo()
    s = summary(out)
    # the periodic checkpoint was after iteration 1; the interruption saved the state after iteration 2
    assert (s["status"], s["last_good_iteration"], s["checkpoint_iteration"]) == ("interrupted", 2, 2)
    assert [r["iteration"] for r in records(out)] == [0, 1, 2]
    train(config(method, "train.checkpoint_every=2"), out, resume=True)
    assert summary(out)["status"] == "ok" and summary(out)["resumed_from"] == 2
    assert learned(records(out)) == learned(expected)
    if method == "agg":
        assert [r["agg_groups_routed"] for r in records(out)] == [2 * (1 + 0)] * ITERATIONS
    # counted in the run's first iteration only, resumed or not
    assert [r["saved_activation_peak_bytes"] is not None for r in records(out)] == [True] + [False] * (ITERATIONS - 1)


@pytest.mark.parametrize("where", ["after the update", "between its first two optimizer steps"])
def test_a_signal_after_an_optimizer_step_waits_for_the_record_and_the_checkpoint_keeps_it(
        tmp_path, monkeypatch, tmp_path_factory, where):
    """A signal that comes once the weights moved (iteration 2 of agg's four optimizer steps: after its update, or
    between its first two steps) is taken when the iteration's record is written: the checkpoint then holds that
    iteration (it used to be lost, with every iteration since the periodic checkpoint, and recomputed)."""
    expected = reference("agg", tmp_path_factory)
    out = tmp_path / "run"
    if where == "after the update":
        signal_at(monkeypatch, "update", 3, after=True)
    else:
        steps = signal_after_first_optimizer_step(monkeypatch, 3)
    with pytest.raises(Interrupted):
        train(config("agg", "train.checkpoint_every=2"), out)
    monkeypatch.undo()
    if where != "after the update":
        assert len(steps) == 4  # the update took all its steps: 2 epochs of 2 mini-batches
    s = summary(out)
    # the periodic checkpoint was after iteration 1; the held signal's after iteration 2
    assert (s["status"], s["last_good_iteration"], s["checkpoint_iteration"]) == ("interrupted", 2, 2)
    assert [r["iteration"] for r in records(out)] == [0, 1, 2]
    train(config("agg", "train.checkpoint_every=2"), out, resume=True)
    assert summary(out)["resumed_from"] == 2 and learned(records(out)) == learned(expected)


def test_a_finished_run_resumes_to_more_iterations(tmp_path, tmp_path_factory):
    expected = reference("full", tmp_path_factory)
    out = tmp_path / "run"
    train(config("full", "train.iterations=3", "train.checkpoint_every=10"), out)
    assert summary(out)["checkpoint_iteration"] == 2  # the end of a run is checkpointed
    train(config("full", "train.iterations=3", "train.checkpoint_every=10"), out, resume=True)
    assert [r["iteration"] for r in records(out)] == [0, 1, 2]  # nothing left to do
    train(config("full", "train.checkpoint_every=10"), out, resume=True)
    assert learned(records(out)) == learned(expected)


def test_a_run_resumed_in_a_renamed_folder_keeps_its_run_id(tmp_path):
    """A run without run_id is named after its folder. Resumed after the folder was renamed, its later records and
    summary took the new name beside the checkpoint's records of the old one, and the report refused the folder's two
    run ids; they keep the run id of the records the run continues."""
    first, out = tmp_path / "first", tmp_path / "renamed"
    train(config("full", "run_id=null", "train.iterations=2", "train.checkpoint_every=1"), first)
    first.rename(out)
    train(config("full", "run_id=null", "train.iterations=3", "train.checkpoint_every=1"), out, resume=True)
    assert [r["run_id"] for r in records(out)] == ["first"] * 3 and summary(out)["run_id"] == "first"
    assert main(["report", "--runs", str(out), "--tables", str(tmp_path / "tables")]) == 0


def test_a_run_resumed_without_checkpoints_leaves_no_checkpoint_of_an_earlier_iteration(tmp_path, monkeypatch,
                                                                                          tmp_path_factory):
    """Resumed with --checkpoint-every 0, a run that ended ok left the checkpoint it resumed from (iteration 0)
    beside the records of iterations 0..3, and agg-bench learning evaluated it as the run's final state. It now
    leaves what a fresh run of its config leaves, no checkpoint; stopped, it keeps the one it can continue from."""
    expected = reference("full", tmp_path_factory)
    out = tmp_path / "run"
    args = ["run", *[a for o in [*SMALL, *METHODS["full"]] for a in ("--set", o)], "--out", str(out)]
    assert main([*args, "--set", "train.iterations=1", "--checkpoint-every", "1"]) == 0
    signal_at(monkeypatch, "collect", 2)  # in iteration 2, the resumed attempt's second
    with pytest.raises(Interrupted):
        train(config("full", "train.checkpoint_every=0"), out, resume=True)
    monkeypatch.undo()
    s = summary(out)
    assert (s["status"], s["last_good_iteration"], s["checkpoint_iteration"]) == ("interrupted", 1, 0)
    assert torch.load(out / CHECKPOINT_NAME, weights_only=True)["iteration"] == 0
    assert main([*args, "--set", f"train.iterations={ITERATIONS}", "--checkpoint-every", "0", "--resume"]) == 0
    s = summary(out)
    assert (s["status"], s["resumed_from"], s["last_good_iteration"], s["checkpoint_iteration"]) == \
        ("ok", 0, ITERATIONS - 1, None)
    assert not (out / CHECKPOINT_NAME).exists()
    assert learned(records(out)) == learned(expected)


def test_a_loss_past_the_records_magnitude_is_a_divergence(tmp_path, monkeypatch, capsys):
    """A finite loss of 1e305 (a float64 run) was an ok record that no reader took back (the record contract bounds
    magnitudes): the run diverged there, its record says so with the loss null, and the report reads the folder."""
    from agg_bench.runtime import train as train_module

    original = train_module.run_iteration

    def huge_loss(session, telemetry, iteration):
        fields = original(session, telemetry, iteration)
        return {**fields, "loss": 1e305} if iteration == 1 else fields

    monkeypatch.setattr(train_module, "run_iteration", huge_loss)
    out = tmp_path / "run"
    s = train(config("full", "train.iterations=3"), out)
    assert (s["status"], s["last_good_iteration"], s["error"]) == ("diverged", 0, "non-finite loss at iteration 1")
    assert [(r["status"], r["loss"] is None) for r in records(out)] == [("ok", False), ("diverged", True)]
    assert main(["report", "--runs", str(out), "--tables", str(tmp_path / "tables")]) == 0


def test_resume_with_another_config_is_refused(tmp_path, capsys):
    out = tmp_path / "run"
    args = ["run", *[a for o in SMALL for a in ("--set", o)], "--set", "train.iterations=2", "--checkpoint-every", "1",
            "--out", str(out)]
    assert main(args) == 0
    before = (out / "metrics.jsonl").read_text()
    capsys.readouterr()
    assert main([*args, "--set", "train.lr=0.001", "--resume"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "train.lr" in err[0] and "--resume" in err[0]
    assert (out / "metrics.jsonl").read_text() == before
    # keys that do not change what is computed may differ
    assert main([*args, "--set", "train.iterations=3", "--set", "telemetry.enabled=false", "--resume"]) == 0
    assert [r["iteration"] for r in records(out)] == [0, 1, 2]


def test_a_checkpoint_copied_into_another_finished_run_does_not_replace_it(tmp_path, capsys):
    """The folder of a finished run of another config, with a checkpoint of this config copied in: --resume
    replaced that run's records without --overwrite (only the checkpoint's config was compared)."""
    args = ["run", *[a for o in SMALL for a in ("--set", o)], "--set", "train.iterations=1", "--checkpoint-every", "1"]
    assert main([*args, "--out", str(tmp_path / "a")]) == 0
    other = tmp_path / "b"
    assert main([*args, "--set", "train.lr=0.001", "--out", str(other)]) == 0
    (other / CHECKPOINT_NAME).write_bytes((tmp_path / "a" / CHECKPOINT_NAME).read_bytes())
    before = {p.name: p.read_bytes() for p in other.iterdir()}
    capsys.readouterr()
    assert main([*args, "--set", "train.iterations=2", "--resume", "--out", str(other)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "finished run of another config" in err[0] and "train.lr" in err[0], err
    assert {p.name: p.read_bytes() for p in other.iterdir()} == before


def test_a_damaged_checkpoint_is_a_user_error(tmp_path, capsys):
    out = tmp_path / "run"
    out.mkdir()
    (out / CHECKPOINT_NAME).write_bytes(b"not a checkpoint")
    assert main(["run", *[a for o in SMALL for a in ("--set", o)], "--resume", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and CHECKPOINT_NAME in err[0]


def test_rerun_starts_clean_and_resume_without_checkpoint_starts_over(tmp_path, capsys):
    out = tmp_path / "run"
    out.mkdir()
    cfg = load_config(None, [*SMALL, "train.iterations=2"])
    # what a killed attempt can leave: its config, records, a torn line, a summary of an older attempt,
    # temporaries; and a file of the user's that looks like a temporary, which is not the harness's
    (out / "config.json").write_text(json.dumps(cfg.to_dict()))
    (out / "metrics.jsonl").write_text('{"iteration": 0, "status": "ok"}\n{"iteration": 1, "sta')
    (out / "summary.json").write_text('{"status": "ok"}')
    (out / ".checkpoint.agg-bench-tmp123.pt").write_bytes(b"half")
    (out / ".summary.agg-bench-tmp99.json").write_text("{")
    (out / ".bashrc.tmpl").write_text("mine")
    with pytest.raises(UserError, match=r"not an agg-bench run \(.bashrc.tmpl\)"):  # the user's: refused, kept
        train(cfg, out, resume=True)
    assert (out / ".bashrc.tmpl").read_text() == "mine" and (out / ".summary.agg-bench-tmp99.json").exists()
    (out / ".bashrc.tmpl").unlink()
    train(cfg, out, resume=True)
    assert "no checkpoint" in capsys.readouterr().err
    assert [r["iteration"] for r in records(out)] == [0, 1]
    assert all("loss" in r for r in records(out))  # the old lines are gone
    assert not list(out.glob(".*"))  # the temporaries of the killed attempt are gone
    # another config over a finished run: only with overwrite
    train(load_config(None, [*SMALL, "train.iterations=1", "train.checkpoint_every=1"]), out, overwrite=True)
    assert (out / CHECKPOINT_NAME).exists()
    train(load_config(None, [*SMALL, "train.iterations=1", "train.checkpoint_every=1"]), out)  # same config
    assert (out / CHECKPOINT_NAME).exists()
    train(load_config(None, [*SMALL, "train.iterations=1"]), out, overwrite=True)  # no --resume: the old checkpoint goes
    assert not (out / CHECKPOINT_NAME).exists()
    assert [r["iteration"] for r in records(out)] == [0]


def test_a_checkpoint_from_before_a_key_existed_reads_it_as_its_default(tmp_path):
    import copy

    from agg_bench.errors import ConfigError
    from agg_bench.runtime.checkpoint import check_same_run

    cfg = config("full").to_dict()
    older = copy.deepcopy(cfg)
    del older["grpo"]["kl_form"], older["grpo"]["adv_std"]  # keys added after that checkpoint was written
    check_same_run(older, cfg, tmp_path)  # the defaults: the same run
    with pytest.raises(ConfigError, match="grpo.kl_form"):
        check_same_run(older, config("full", "grpo.kl_form=no_dt").to_dict(), tmp_path)


@pytest.fixture(scope="module")
def checkpointed(tmp_path_factory):
    """A finished run of 2 iterations with a checkpoint after each, and its run arguments."""
    out = tmp_path_factory.mktemp("checkpointed") / "run"
    args = [a for o in [*SMALL, "train.iterations=2"] for a in ("--set", o)]
    assert main(["run", *args, "--checkpoint-every", "1", "--out", str(out)]) == 0
    return out, args


def _first(state):
    return next(iter(state["parameters"]))


# what a crafted checkpoint.pt changes, and what the one line then says
CRAFTED = {
    "no config": (lambda s: s.pop("config"), "config"),
    "config of another shape": (lambda s: s.update(config=[1, 2]), "config"),
    "config out of bounds": (lambda s: s["config"]["sampling"].update(steps=10_000_000), "sampling.steps"),
    "records not JSON": (lambda s: s.update(records=["{not json"]), "records line 1"),
    "records not lines": (lambda s: s.update(records="x"), "records"),
    "a record's text iteration": (lambda s: s["records"].__setitem__(0, '{"iteration": "0"}'), "iteration"),
    "records of other iterations": (lambda s: s["records"].reverse(), "expected the iterations in increasing order"),
    "text iteration": (lambda s: s.update(iteration="1"), "iteration = '1'"),
    "negative iteration": (lambda s: s.update(iteration=-5), "iteration = -5"),
    "negative policy version": (lambda s: s.update(policy_version=-1), "policy_version"),
    "wrong-shape parameter": (lambda s: s["parameters"].__setitem__(_first(s), torch.zeros(3)), "shape (3,)"),
    "integer parameter": (lambda s: s["parameters"].__setitem__(_first(s), s["parameters"][_first(s)].long()),
                          "torch.int64"),
    "no parameters": (lambda s: s.update(parameters={}), "parameters"),
    "half the parameters": (lambda s: s.update(parameters=dict(list(s["parameters"].items())[::2])), "missing"),
    "another model's parameter": (lambda s: s["parameters"].update(extra=torch.zeros(1)), "'extra'"),
    "optimizer state of another shape": (
        lambda s: next(iter(s["optimizer"]["state"].values())).update(exp_avg=torch.zeros(7)), "optimizer state"),
    "random states of another kind": (lambda s: s["rng"].update(torch=torch.zeros(3)), "rng.torch"),
    "shard folder outside the run": (lambda s: s.update(shards="../../elsewhere"), "shards"),
    # a checkpoint continued in a folder whose env.json says nothing of its records (copied in, say)
    "records of another machine": (lambda s: s.update(records=[
        json.dumps({**json.loads(line), "device": "cuda", "gpu_name": "NVIDIA H100 80GB HBM3", "n_gpus": 2})
        for line in s["records"]]), "measured on 2 GPUs (NVIDIA H100 80GB HBM3), this run on the CPU"),
}


@pytest.mark.parametrize("case", list(CRAFTED))
def test_a_crafted_checkpoint_is_refused_in_one_line_and_nothing_is_touched(case, checkpointed, tmp_path, capsys):
    """--resume reads checkpoint.pt through one validator (keys, types, shapes, iteration >= 0, records 0..k,
    every trainable parameter and nothing else, strict loading): each crafted file is one line, exit 2, and
    the run folder is left as it was (an iteration of -5 used to give status ok and records -4..-1, then
    0..2 again)."""
    source, args = checkpointed
    out = tmp_path / "run"
    change, expected = CRAFTED[case]
    before = crafted_checkpoint(source, out, change)
    capsys.readouterr()
    assert main(["run", *args, "--set", "train.iterations=3", "--resume", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and CHECKPOINT_NAME in err[0] and expected in err[0] and "Traceback" not in err[0], err
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()} == before


# what env.json says of the attempt that wrote the checkpoint, and what a refusal to resume it then says
OTHER_MACHINE = {
    "GPU": ({"gpu_name": "NVIDIA H100 80GB HBM3"}, "env.json says NVIDIA H100 80GB HBM3, this machine the CPU"),
    "CPU model": ({"cpu_model": "Another CPU 9000"}, "env.json says the CPU Another CPU 9000, this machine the CPU"),
    "code": ({"source_digest": "0" * 64}, "env.json names source_digest 000000000000..., this code"),
    "no env.json": (None, "env.json names no source_digest"),
}


def _moved(checkpointed, out: Path, change: dict | None) -> dict:
    """A copy of the checkpointed run at ``out`` whose env.json ``change`` edits (None: removes); its files' bytes."""
    import shutil

    shutil.copytree(checkpointed[0], out)
    if change is None:
        (out / "env.json").unlink()
    else:
        env = json.loads((out / "env.json").read_text())
        (out / "env.json").write_text(json.dumps({**env, **change}))
    return {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}


@pytest.mark.parametrize("case", list(OTHER_MACHINE))
def test_resume_on_another_machine_or_code_is_refused_and_nothing_is_touched(case, checkpointed, tmp_path, capsys):
    """--resume continued a run started on another GPU (or CPU, or by other code) and rewrote env.json with this
    machine's: the records then came from two machines while env.json named one. It is refused in one line naming
    both, exit 2, the folder as it was; a workflow's --resume-stopped starts such an attempt over instead."""
    from agg_bench.runtime.runfolder import stopped_attempt

    out = tmp_path / "run"
    change, expected = OTHER_MACHINE[case]
    before = _moved(checkpointed, out, change)
    capsys.readouterr()
    assert main(["run", *checkpointed[1], "--set", "train.iterations=3", "--resume", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"agg-bench run: --resume: {out}: {expected}"), err
    assert "--overwrite" in err[0]
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()} == before
    (out / "summary.json").unlink()  # a killed attempt, which --resume-stopped would continue on this machine
    assert not stopped_attempt(out, load_config(None, [*SMALL, "train.iterations=3"]).to_dict())


def test_resume_on_another_host_of_the_same_kind_continues(checkpointed, tmp_path):
    """A job requeued onto another node with the same GPU (here the CPU) and code continues its run."""
    from agg_bench.runtime.runfolder import stopped_attempt

    out = tmp_path / "run"
    _moved(checkpointed, out, {"hostname": "another-node", "timestamp": "2000-01-01T00:00:00+00:00"})
    (out / "summary.json").unlink()
    assert stopped_attempt(out, load_config(None, [*SMALL, "train.iterations=3"]).to_dict())
    assert main(["run", *checkpointed[1], "--set", "train.iterations=3", "--resume", "--out", str(out)]) == 0
    assert summary(out)["resumed_from"] == 1 and [r["iteration"] for r in records(out)] == [0, 1, 2]


@pytest.mark.parametrize("archive", ["not a checkpoint", "another file"])
def test_resume_stopped_refuses_a_whole_archive_that_is_no_checkpoint_naming_its_own_flag(checkpointed, tmp_path,
                                                                                          capsys, archive):
    """A checkpoint.pt that is a whole zip archive (no power cut left it) of a stopped attempt but no checkpoint
    of this run is refused untouched, as --resume refuses it; the line started "--resume:" and advised running
    without --resume, a flag the user had not given."""
    import zipfile

    out = tmp_path / "run"
    _moved(checkpointed, out, {})
    (out / "summary.json").unlink()
    if archive == "not a checkpoint":
        with zipfile.ZipFile(out / CHECKPOINT_NAME, "w") as fh:
            fh.writestr("data.txt", "not a pickle")
    else:
        torch.save({"other": torch.zeros(1)}, out / CHECKPOINT_NAME)
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    capsys.readouterr()
    assert main(["run", *checkpointed[1], "--set", "train.iterations=3", "--resume-stopped", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and err[0].startswith("agg-bench run: continuing the stopped attempt"), err
    assert err[1].startswith(f"agg-bench run: --resume-stopped: {out / CHECKPOINT_NAME}"), err
    assert err[1].endswith("delete it or run without --resume-stopped"), err
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()} == before


@pytest.mark.parametrize("size", [0, 1000])
def test_resume_stopped_starts_over_from_a_cut_checkpoint(checkpointed, tmp_path, capsys, size):
    """A node that lost power after the rename of checkpoint.pt but before its data reached the disk leaves an
    empty or cut file. --resume-stopped took it for a stopped attempt's checkpoint and refused it (exit 2, naming
    --resume), so the workflow's rerun of the job failed until someone removed the file; such a folder is no
    attempt to continue, and the run starts over."""
    from agg_bench.runtime.runfolder import stopped_attempt

    out = tmp_path / "run"
    _moved(checkpointed, out, {})
    (out / "summary.json").unlink()
    with open(out / CHECKPOINT_NAME, "r+b") as fh:
        fh.truncate(size)
    assert not stopped_attempt(out, load_config(None, [*SMALL, "train.iterations=3"]).to_dict())
    capsys.readouterr()
    assert main(["run", *checkpointed[1], "--set", "train.iterations=3", "--resume-stopped", "--out", str(out)]) == 0
    assert summary(out)["resumed_from"] is None and [r["iteration"] for r in records(out)] == [0, 1, 2]
