"""How a run stops: SIGTERM/SIGINT write an ``interrupted`` summary; ``kill -9`` leaves metric lines that
read back whole and a folder that a rerun completes; a non-finite reward, loss or gradient stops the run as
``diverged`` before the weights take that step."""
from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import agg_bench.runtime.session as session_module
from agg_bench.cli import main
from agg_bench.config import load_config
from agg_bench.io import read_jsonl
from agg_bench.results.records import TIMING_KEYS
from agg_bench.runtime.train import Interrupted, Session, StopSignals, train
from baselines.full import FullEstimator

ROOT = Path(__file__).resolve().parents[1]
SMALL = ["model.resolution=32", "sampling.steps=4", "grpo.group_size=2", "progress=false", "telemetry.enabled=false"]
SET = [a for o in SMALL for a in ("--set", o)]


def records(out: Path) -> list[dict]:
    return list(read_jsonl(out / "metrics.jsonl"))


def summary(out: Path) -> dict:
    return json.loads((out / "summary.json").read_text())


# ----- signals ------------------------------------------------------------------------------------
@pytest.mark.parametrize("signum, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_signal_writes_an_interrupted_summary(tmp_path, monkeypatch, capsys, signum, code):
    collect = Session.collect

    def collect_then_signal(self, iteration, telemetry=None):
        if iteration == 1:
            os.kill(os.getpid(), signum)
        return collect(self, iteration, telemetry)

    monkeypatch.setattr(Session, "collect", collect_then_signal)
    handler = signal.getsignal(signum)
    out = tmp_path / "run"
    assert main(["run", *SET, "--set", "train.iterations=3", "--out", str(out)]) == code
    assert capsys.readouterr().err.strip().endswith("interrupted")
    s = summary(out)
    assert (s["status"], s["last_good_iteration"]) == ("interrupted", 0)
    assert signal.Signals(signum).name in s["error"]
    assert [r["iteration"] for r in records(out)] == [0]
    assert signal.getsignal(signum) is handler  # the caller's handler is back


def test_runs_in_one_process_leave_nothing_behind(tmp_path, monkeypatch):
    """A command that runs several configs calls train() again and again in one process: a call that ends
    interrupted or failed between two good ones leaves the handlers, threads and process group as it found
    them, and the next call's records are those of the first (timing aside)."""
    cfg = load_config(None, [*SMALL, "telemetry.enabled=true", "train.iterations=2", "train.checkpoint_every=1"])

    def state() -> tuple:
        # tqdm keeps one monitor thread per process, whatever the bars: not the run's
        threads = sorted(t.name for t in threading.enumerate() if t.name != "tqdm_monitor")
        return ({s: signal.getsignal(s) for s in StopSignals.SIGNALS}, threads, dist.is_initialized(),
                torch.is_grad_enabled(), torch.get_default_dtype())

    def untimed(out: Path) -> list[dict]:
        return [{k: v for k, v in r.items() if k not in TIMING_KEYS} for r in records(out)]

    before = state()
    train(cfg, tmp_path / "first" / "run")
    assert state() == before
    collect = Session.collect

    def collect_then_stop(self, iteration, telemetry=None):
        if iteration == 1 and self.cfg.seed == cfg.seed:
            os.kill(os.getpid(), signal.SIGTERM)
        elif iteration == 1:
            raise ValueError("a bug in iteration 1")
        return collect(self, iteration, telemetry)

    monkeypatch.setattr(Session, "collect", collect_then_stop)
    with pytest.raises(Interrupted):
        train(cfg, tmp_path / "interrupted" / "run")
    assert state() == before and summary(tmp_path / "interrupted" / "run")["status"] == "interrupted"
    with pytest.raises(ValueError):
        train(load_config(None, [*SMALL, "seed=7", "train.iterations=2"]), tmp_path / "failed" / "run")
    assert state() == before and summary(tmp_path / "failed" / "run")["status"] == "error"
    monkeypatch.undo()
    train(cfg, tmp_path / "second" / "run")
    assert state() == before
    assert untimed(tmp_path / "second" / "run") == untimed(tmp_path / "first" / "run")
    assert summary(tmp_path / "second" / "run") == summary(tmp_path / "first" / "run")


def test_a_signal_waits_for_the_record_being_written():
    stop = StopSignals()
    with stop:
        with pytest.raises(Interrupted):
            with stop.deferred():
                os.kill(os.getpid(), signal.SIGTERM)
                finished = True  # still runs: the block is not cut short
        assert finished and stop.received == signal.SIGTERM
        os.kill(os.getpid(), signal.SIGTERM)  # a second signal is ignored while stopping
        with stop.deferred():
            pass


@pytest.mark.slow
def wait_for_lines(proc: subprocess.Popen, metrics: Path, count: int, log: Path) -> None:
    """Wait (at most 10 minutes) until ``metrics`` holds ``count`` whole lines; the process must still run."""
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline and proc.poll() is None:
        if metrics.exists() and metrics.read_text().count("\n") >= count:
            break
        time.sleep(0.02)
    assert proc.poll() is None, "the run ended before it was killed: " + log.read_text()[-3000:]


def test_kill_9_leaves_whole_lines_and_a_folder_that_a_rerun_completes(tmp_path):
    out = tmp_path / "run"
    iterations = 12
    args = [sys.executable, "-m", "agg_bench", "run", *SET, "--set", f"train.iterations={iterations}",
            "--checkpoint-every", "1", "--out", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    log = open(tmp_path / "run.log", "w")
    proc = subprocess.Popen(args, cwd=tmp_path, env=env, stdout=log, stderr=log)
    metrics = out / "metrics.jsonl"
    wait_for_lines(proc, metrics, 2, tmp_path / "run.log")
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    log.close()
    lines = metrics.read_text().split("\n")
    for line in lines[:-1]:  # every line but an unfinished last one is a whole record
        json.loads(line)
    killed_at = len(records(out))
    assert 2 <= killed_at < iterations
    assert not (out / "summary.json").exists()  # the workflow's declared output: absent, so the job reruns
    with open(metrics, "a") as fh:  # the worst case: the kill came in the middle of a line
        fh.write('{"iteration": 99, "loss": 0.')
    assert len(records(out)) == killed_at  # readers skip the torn line
    rerun = subprocess.run([*args, "--resume"], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert summary(out)["status"] == "ok" and summary(out)["resumed_from"] is not None  # from its checkpoint
    assert [r["iteration"] for r in records(out)] == list(range(iterations))
    assert all(line.strip() for line in metrics.read_text().splitlines())


@pytest.mark.slow
def test_killed_workflow_reruns_the_incomplete_run(tmp_path):
    import shutil

    import yaml

    work = tmp_path / "work"
    work.mkdir()
    shutil.copy(ROOT / "Snakefile", work)
    shutil.copytree(ROOT / "workflow", work / "workflow")
    shutil.copytree(ROOT / "config", work / "config")
    sweep = yaml.safe_load((work / "config/test.yaml").read_text())
    iterations = 12
    sweep["set"].update({"train.iterations": iterations, "train.checkpoint_every": 1})
    sweep["methods"] = {"full": {"method": {"name": "full"}}}
    (work / "kill.yaml").write_text(yaml.safe_dump(sweep, sort_keys=False))
    run_dir = work / "results/runs/full_sd3_32px_s0_cpu"
    target = str((run_dir / "summary.json").relative_to(work))
    command = [sys.executable, "-m", "snakemake", target, "--cores", "1", "--configfile", "kill.yaml"]
    log = open(tmp_path / "snakemake.log", "w")
    proc = subprocess.Popen(command, cwd=work, stdout=log, stderr=log, start_new_session=True)
    metrics = run_dir / "metrics.jsonl"
    wait_for_lines(proc, metrics, 2, tmp_path / "snakemake.log")
    os.killpg(proc.pid, signal.SIGKILL)  # snakemake, the job's shell and the run, at once
    proc.wait()
    log.close()
    assert not (run_dir / "summary.json").exists()
    # a killed snakemake leaves its lock and marks the job's outputs incomplete: --unlock, then rerun them
    assert subprocess.run([*command, "--unlock"], cwd=work, capture_output=True).returncode == 0
    rerun = subprocess.run([*command, "--rerun-incomplete"], cwd=work, capture_output=True, text=True, timeout=900)
    assert rerun.returncode == 0, rerun.stderr[-4000:]
    assert summary(run_dir)["status"] == "ok"
    assert [r["iteration"] for r in records(run_dir)] == list(range(iterations))


# ----- divergence ---------------------------------------------------------------------------------
class Poisoned(FullEstimator):
    """``full``, then a non-finite gradient element or loss, as a numerical blow-up would leave them."""

    name = "poisoned"

    def __init__(self, what: str):
        super().__init__()
        self.what = what

    def accumulate(self, policy, batch, stats, reference=None):
        super().accumulate(policy, batch, stats, reference)
        if self.what == "gradient":
            next(p for p in policy.parameters() if p.grad is not None).grad.view(-1)[0] = math.inf
        else:
            stats.loss_sum = math.nan


@pytest.mark.parametrize("what", ["gradient", "loss"])
def test_a_non_finite_update_never_reaches_the_weights(what):
    cfg = load_config(None, [*SMALL, "train.max_grad_norm=null"])
    session = Session(cfg, estimator=Poisoned(what))
    before = [p.detach().clone() for p in session.policy.parameters()]
    learn = session.update(session.collect(0).batch)
    assert learn["diverged"] == what
    assert session.policy.version == 0
    assert all(torch.equal(a, p) for a, p in zip(before, session.policy.parameters()))
    assert not session.optimizer.state  # no step was taken


def test_a_nan_reward_stops_the_run_as_diverged(tmp_path, monkeypatch):
    build = session_module.build_reward

    def nan_on_second_call(*args, **kwargs):
        reward = build(*args, **kwargs)
        calls = []

        def wrapped(images, prompts):
            calls.append(1)
            out = reward(images, prompts)
            return out.fill_(math.nan) if len(calls) == 2 else out

        return wrapped

    monkeypatch.setattr(session_module, "build_reward", nan_on_second_call)
    out = tmp_path / "run"
    assert main(["run", *SET, "--set", "train.iterations=3", "--set", "train.checkpoint_every=1",
                 "--out", str(out)]) == 0
    s = summary(out)
    assert (s["status"], s["last_good_iteration"], s["checkpoint_iteration"]) == ("diverged", 0, 0)
    assert "iteration 1" in s["error"]
    recs = records(out)
    assert [(r["iteration"], r["status"]) for r in recs] == [(0, "ok"), (1, "diverged")]
    assert recs[1]["reward_mean"] is None  # NaN is written as null
