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
from agg_bench.records import TIMING_KEYS
from agg_bench import stopping
from agg_bench.runtime.train import Interrupted, Session, train
from baselines.full import FullEstimator
from helpers import interrupted_updates

ROOT = Path(__file__).resolve().parents[2]
SMALL = ["model.resolution=32", "sampling.steps=4", "grpo.group_size=2", "progress=false", "telemetry.enabled=false"]
SET = [a for o in SMALL for a in ("--set", o)]


def records(out: Path) -> list[dict]:
    return list(read_jsonl(out / "metrics.jsonl"))


def summary(out: Path) -> dict:
    return json.loads((out / "summary.json").read_text())


# ----- signals ------------------------------------------------------------------------------------
def test_processes_stop_together_at_a_common_check():
    """Under stopping.together (a run on several processes) every check exchanges the pending signal, and
    every process raises the one some process received, a process that received none included; a check
    that the processes do not reach in step (check_alone) leaves a pending signal to the next check."""
    exchanged = []

    def exchange(mine):  # what another process would answer: it received SIGTERM once this one asks twice
        exchanged.append(mine)
        return signal.SIGTERM if len(exchanged) >= 2 else mine

    with stopping.stop_signals("test"), stopping.safe_points(), stopping.together(exchange):
        stopping.check()  # neither process has a signal
        stopping.check_alone()  # not a common point: no exchange
        assert exchanged == [0]
        with pytest.raises(Interrupted) as first:
            stopping.check()  # the other process received one: this one stops with it
        assert first.value.signum == signal.SIGTERM and exchanged == [0, 0]
        with pytest.raises(Interrupted):
            stopping.check()  # raised again until reported, without exchanging again
        assert exchanged == [0, 0]
        stopping.handled(first.value)
        stopping.check()
    # its own SIGTERM, delivered afterwards, is the stop it already made: no exchange outside together
    with stopping.stop_signals("test"), stopping.safe_points(), stopping.together(exchange):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.01)
        stopping.check_alone()  # deferred
        with pytest.raises(Interrupted):
            stopping.check()
        assert exchanged[-1] == signal.SIGTERM  # this process offered its own signal
        stopping.handled(Interrupted(signal.SIGTERM))


@pytest.mark.parametrize("after_records", [2, 5])
def test_torchrun_processes_stopped_by_sigterm_end_interrupted_together(tmp_path, after_records):
    """A SIGTERM to torchrun reaches each process at a slightly different moment: one used to stop at its next
    transformer call while the other went on into the update's all-reduce, failed there ("connection closed
    by peer") and ended the run as an internal error (2 of 4 trials). The processes now stop together at a
    common check: the summary says interrupted, and the checkpoint matches the records."""
    out = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m", "agg_bench",
         "run", "--config", "config/run.yaml", *SET, "--set", "train.iterations=5000", "--set",
         "grpo.prompts_per_iteration=2", "--set", "train.checkpoint_every=1", "--out", str(out)],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 300
        while not (out / "metrics.jsonl").exists() or len((out / "metrics.jsonl").read_text().splitlines()) < after_records:
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()[-3000:] if proc.poll() else ""
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert "internal error" not in err and "Connection closed" not in err, err[-4000:]
    assert err.count("agg-bench run: interrupted") == 2, err[-4000:]
    assert summary(out)["status"] == "interrupted"
    lines = records(out)
    checkpoint = torch.load(out / "checkpoint.pt", weights_only=False, map_location="cpu")
    assert checkpoint["iteration"] == lines[-1]["iteration"] and len(lines) >= after_records


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
        return ({s: signal.getsignal(s) for s in stopping.SIGNALS}, threads, dist.is_initialized(),
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


class Marker(Exception):
    """Raised by the test's own SIGTERM handler: a signal that reached it was not taken by the run."""


@pytest.fixture
def sigterm_marker():
    """A SIGTERM handler of the test's own while it runs, so that a signal the run does not take raises
    :class:`Marker` instead of ending pytest; the run's handlers replace it for the run's duration."""
    def raise_marker(signum, frame):
        raise Marker(signum)

    previous = signal.signal(signal.SIGTERM, raise_marker)
    yield
    signal.signal(signal.SIGTERM, previous)


def test_a_signal_in_a_finaliser_stays_pending():
    """A signal whose handler runs inside a finaliser, where an exception can only be printed and dropped,
    is still raised at the next safe point; outside safe points too, where the handler raises at once."""
    class Finalised:
        def __del__(self):
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0)  # a call: the handler runs here, inside the finaliser

    with stopping.stop_signals():
        with pytest.raises(Interrupted) as raised:
            with stopping.safe_points():
                Finalised()  # dropped at once: its finaliser sends the signal
                assert stopping.pending() == signal.SIGTERM
                stopping.check()
        assert raised.value.signum == signal.SIGTERM
        stopping.handled(raised.value)
        stopping.check()  # reported: no longer raised
    with pytest.raises(Interrupted):  # caught but never reported: the end of the outermost block raises it
        with stopping.stop_signals():
            with pytest.raises(Interrupted):
                old_hook, sys.unraisablehook = sys.unraisablehook, lambda unraisable: None
                try:
                    Finalised()  # the handler raises inside __del__, where Python drops the exception
                finally:
                    sys.unraisablehook = old_hook
                assert stopping.pending() == signal.SIGTERM
                stopping.check()
    assert stopping.pending() is None  # the outermost block ended: nothing stays pending


def test_a_signal_while_autograd_frees_saved_tensors_stops_the_run(tmp_path, monkeypatch, sigterm_marker):
    """Issue 37's lost SIGTERM: the signal lands while a saved activation's finaliser runs (the graph of the
    train phase being freed; saved activations are counted in a run's first iteration). The run stops at
    its next safe point with an interrupted summary, and the iteration of the signal has no record."""
    from agg_bench.machine import activations

    updates, sent = [], []
    update, release = Session.update, activations._SavedHandle.__del__

    def counted_update(self, batch):
        updates.append(1)
        return update(self, batch)

    def release_then_signal(self):
        if updates and not sent:
            sent.append(1)
            os.kill(os.getpid(), signal.SIGTERM)
        release(self)  # a call: the handler runs inside this finaliser

    monkeypatch.setattr(Session, "update", counted_update)
    monkeypatch.setattr(activations._SavedHandle, "__del__", release_then_signal)
    out = tmp_path / "run"
    cfg = load_config(None, [*SMALL, "telemetry.enabled=true", "train.iterations=3"])
    with pytest.raises(Interrupted):
        train(cfg, out)
    assert sent
    s = summary(out)
    assert (s["status"], s["last_good_iteration"]) == ("interrupted", None)
    assert records(out) == []


@pytest.mark.parametrize("earlier", [False, True], ids=["new folder", "earlier attempt"])
def test_a_signal_while_the_model_is_built_leaves_no_folder_and_no_lock(tmp_path, monkeypatch, sigterm_marker,
                                                                      earlier):
    """SIGTERM in start-up, after the folder is claimed and before anything is written: a folder the claim
    made goes again, an earlier attempt's files stay as they were, and no lock file is left."""
    out = tmp_path / "run"
    cfg = load_config(None, [*SMALL, "train.iterations=1"])
    if earlier:
        train(cfg, out)
    before = {p.name: p.read_bytes() for p in out.iterdir()} if earlier else None
    build = session_module.build_policy

    def build_with_signal(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)
        return build(*args, **kwargs)

    monkeypatch.setattr(session_module, "build_policy", build_with_signal)
    with pytest.raises(Interrupted):
        train(cfg, out)
    if earlier:
        assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    else:
        assert not out.exists()


def test_a_signal_while_the_files_are_started_gives_an_interrupted_summary(tmp_path, monkeypatch, sigterm_marker):
    from agg_bench.runtime import runfolder

    start = runfolder.start_files

    def start_with_signal(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)
        start(*args, **kwargs)

    monkeypatch.setattr(runfolder, "start_files", start_with_signal)
    out = tmp_path / "run"
    with pytest.raises(Interrupted):
        train(load_config(None, [*SMALL, "train.iterations=2"]), out)
    assert summary(out)["status"] == "interrupted" and records(out) == []
    assert [p.name for p in out.iterdir() if p.name.startswith(".")] == []  # no lock left


def test_a_signal_after_the_summary_is_still_raised(tmp_path, monkeypatch, sigterm_marker):
    """A signal that comes once the run has written its summary (``ok``: every iteration is done) is not
    dropped: the call raises it, so a command exits with 128 + N and a cell starts no further run."""
    from agg_bench.runtime import runfolder

    write = runfolder.write_summary

    def write_then_signal(*args, **kwargs):
        write(*args, **kwargs)
        os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(runfolder, "write_summary", write_then_signal)
    out = tmp_path / "run"
    with pytest.raises(Interrupted):
        train(load_config(None, [*SMALL, "train.iterations=1"]), out)
    assert summary(out)["status"] == "ok"


SECOND_SIGNAL = """
import os, signal, sys, time
from pathlib import Path
from agg_bench import stopping
from agg_bench.errors import run_command
from agg_bench.outdir import Claim

def body():
    with stopping.safe_points(), Claim(Path(sys.argv[1]), folder=True, lock_inside=True):
        os.kill(os.getpid(), signal.SIGTERM)  # remembered: the block stops at its next safe point
        time.sleep(0)
        os.kill(os.getpid(), signal.SIGTERM)  # the second ends the process at once
        time.sleep(30)
        print("not reached")
    return 0

sys.exit(run_command("agg-bench test", body, []))
"""


def test_a_second_signal_ends_the_process_at_once_without_a_lone_lock(tmp_path):
    out = tmp_path / "new" / "run"
    proc = subprocess.run([sys.executable, "-c", SECOND_SIGNAL, str(out)], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM, proc.stderr
    assert proc.stderr.strip() == "agg-bench test: SIGTERM again: stopping at once"
    assert "not reached" not in proc.stdout
    assert not (tmp_path / "new").exists()  # the folders the claim made, and its lock, are gone


@pytest.mark.slow
def wait_for_lines(proc: subprocess.Popen, metrics: Path, count: int, log: Path) -> None:
    """Wait (at most 10 minutes) until ``metrics`` holds ``count`` whole lines; the process must still run."""
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline and proc.poll() is None:
        if metrics.exists() and metrics.read_text().count("\n") >= count:
            break
        time.sleep(0.02)
    assert proc.poll() is None, "the run ended before it was killed: " + log.read_text()[-3000:]


LEFT_ITERATIONS = 12  # the run killed once 2 records are written: the rest keep it going past the kill


def left_args(out: Path) -> list[str]:
    return ["run", *SET, "--set", f"train.iterations={LEFT_ITERATIONS}", "--checkpoint-every", "1", "--out", str(out)]


def test_kill_9_leaves_whole_lines_and_a_folder_that_a_rerun_completes(killed_runs, tmp_path, capsys):
    """A run killed (SIGKILL, by another process: :func:`killed_runs`) once 2 records are written, as it goes on."""
    outs, ends, killed = killed_runs
    out = outs["left"]
    assert ends["left"] == -signal.SIGKILL, ("the run ended before it was killed", ends, killed.stderr[-3000:])
    metrics = out / "metrics.jsonl"
    lines = metrics.read_text().split("\n")
    for line in lines[:-1]:  # every line but an unfinished last one is a whole record
        json.loads(line)
    killed_at = len(records(out))
    assert 2 <= killed_at < LEFT_ITERATIONS
    assert not (out / "summary.json").exists()  # the workflow's declared output: absent, so the job reruns
    with open(metrics, "a") as fh:  # the worst case: the kill came in the middle of a line
        fh.write('{"iteration": 99, "loss": 0.')
    assert len(records(out)) == killed_at  # readers skip the torn line
    # the rerun in this process: none of the killed process's memory, only the folder it left
    capsys.readouterr()
    assert main([*left_args(out), "--resume"]) == 0, capsys.readouterr().err[-3000:]
    assert summary(out)["status"] == "ok" and summary(out)["resumed_from"] is not None  # from its checkpoint
    assert [r["iteration"] for r in records(out)] == list(range(LEFT_ITERATIONS))
    assert all(line.strip() for line in metrics.read_text().splitlines())
    # the resumed run's records, in order, under one identity, read as one run
    assert main(["report", "--runs", str(out), "--tables", str(tmp_path / "tables")]) == 0


# One process of the model code for the runs that are killed (SIGKILL): it imports the model libraries once (about 6
# CPU-seconds a process), then forks one process per run, one after the other, each a process of its own running
# ``agg-bench run`` with the arguments given. A run is given as JSON: {"argv": [...], "kill_at": K} kills itself
# before its K-th rollout; {"argv": [...], "kill_after": [FILE, N]} is killed by this process once FILE holds N
# whole lines (looked at every 0.02 s, as long as the run goes on). It prints each run's wait status (the negative
# signal that ended it, or its exit code) as a JSON list.
KILLED_AT = """
import json, os, signal, sys, time
import agg_bench.engine.models, agg_bench.runtime.train  # the model libraries, before the forks
from agg_bench.cli import main
from agg_bench.runtime.session import Session
ends = []
for spec in map(json.loads, sys.argv[1:]):
    pid = os.fork()
    if pid == 0:
        collect, calls = Session.collect, []
        def collect_or_die(self, *args, **kwargs):
            calls.append(1)
            if len(calls) == spec.get("kill_at"):
                os.kill(os.getpid(), signal.SIGKILL)
            return collect(self, *args, **kwargs)
        Session.collect = collect_or_die
        try:
            code = main(spec["argv"])
        finally:
            sys.stdout.flush(), sys.stderr.flush()
        os._exit(code)
    ended = None
    if "kill_after" in spec:
        path, count = spec["kill_after"]
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            done, ended = os.waitpid(pid, os.WNOHANG)
            if done:
                break  # it ended before it was killed
            ended = None
            if os.path.exists(path) and open(path).read().count("\\n") >= count:
                os.kill(pid, signal.SIGKILL)  # still running (not reaped)
                break
            time.sleep(0.02)
    status = os.waitpid(pid, 0)[1] if ended is None else ended
    ends.append(-os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status))
print(json.dumps(ends))
"""
# the runs with the most state a process holds between iterations: AWM's EMA-KL average, SA-Solver noise and the
# evaluation average; DGPO's ema_ref as sampler, clip and reference
KILLED = {
    "awm": ["--config", str(ROOT / "config/presets/awm.yaml"), "--set", "grpo.group_size=2"],
    "dgpo": ["--set", 'method={"name": "dgpo", "trunc_steps": 2, "times_per_sample": 2, "ema_reference": true, '
             '"clip_dsm": true, "ema_rollout_after": 1}', "--set", "sampling.same_noise_per_group=false"],
}


def killed_args(method: str) -> list[str]:
    return ["run", *KILLED[method], *SET, "--set", "train.iterations=4", "--set", "run_id=killed"]


def killed_command(method: str, out: Path) -> list[str]:
    return [*killed_args(method), "--checkpoint-every", "2", "--out", str(out)]


@pytest.fixture(scope="module")
def killed_runs(tmp_path_factory) -> tuple[dict[str, Path], dict[str, int], subprocess.CompletedProcess]:
    """The run folders of the killed runs (:data:`KILLED_AT`, one process that forks one per run): each
    :data:`KILLED` method's, killed before the rollout of iteration 3, and "left", killed by that process once 2
    records are written; each run's wait status, and that process."""
    folder = tmp_path_factory.mktemp("killed")
    outs = {name: folder / name / "run" for name in [*KILLED, "left"]}
    specs = [{"argv": killed_command(method, outs[method]), "kill_at": 4} for method in KILLED]
    specs.append({"argv": left_args(outs["left"]), "kill_after": [str(outs["left"] / "metrics.jsonl"), 2]})
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", KILLED_AT, *map(json.dumps, specs)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return outs, dict(zip(outs, json.loads(proc.stdout.strip().splitlines()[-1]))), proc


@pytest.mark.parametrize("method", list(KILLED))
def test_kill_9_then_resume_writes_the_records_of_an_uninterrupted_run(killed_runs, tmp_path, capsys, method):
    """A process killed (SIGKILL) before the rollout of iteration 3, with a checkpoint after iteration 1 only, and a
    resumption of it in another process: the records of a run never stopped, every field but timings. The
    in-process cases (tests/unit/test_resume_every_method.py) go on in the process that failed; here nothing of
    the killed process's memory is left. The killed process is forked, per method, from one process that imported
    the model code once (:func:`killed_runs`). The resumption runs in this process (as the rerun of
    test_kill_9_leaves_whole_lines_and_a_folder_that_a_rerun_completes does): it is not the killed one, and a
    child of its own would import the model code again; it runs before the reference run, so this process has
    not run this config when it resumes."""
    outs, ends, killed = killed_runs
    out = outs[method]
    assert ends[method] == -signal.SIGKILL, (ends, killed.stderr[-3000:])
    assert [r["iteration"] for r in records(out)] == [0, 1, 2] and not (out / "summary.json").exists()
    capsys.readouterr()
    assert main([*killed_command(method, out), "--resume"]) == 0, capsys.readouterr().err[-3000:]
    assert summary(out)["resumed_from"] == 1
    assert main([*killed_args(method), "--out", str(tmp_path / "reference")]) == 0
    learned = lambda folder: [{k: v for k, v in r.items() if k not in TIMING_KEYS} for r in records(folder)]
    assert learned(out) == learned(tmp_path / "reference")


@pytest.mark.parametrize("change, resumes", [
    ("none", True),  # interrupted: continues from its last checkpoint
    ("killed", True),  # no summary at all, as after kill -9 or a workflow that removed it
    ("ended", False),  # a run that ended starts over
    ("config", False),  # another config (a resumable key aside) starts over
    ("iterations", True),  # train.iterations may change between a run and its resumption
    ("code", False),  # written by other code (env.json's source_digest)
])
def test_resume_stopped_continues_only_a_stopped_attempt(tmp_path, monkeypatch, capsys, change, resumes):
    out = tmp_path / "run"
    base = ["run", "--config", "config/run.yaml", *SET, "--set", "train.iterations=3", "--set",
            "train.checkpoint_every=1", "--out", str(out)]
    monkeypatch.chdir(ROOT)
    if change == "ended":
        assert main(base) == 0
    else:
        with interrupted_updates(lambda session: session.policy.version == 2):
            assert main(base) == 130 and summary(out)["status"] == "interrupted"
    if change == "killed":
        (out / "summary.json").unlink()
    elif change == "code":
        env = json.loads((out / "env.json").read_text())
        (out / "env.json").write_text(json.dumps({**env, "source_digest": "0" * 64}))
    extra = {"config": ["--set", "train.lr=0.0002"], "iterations": ["--set", "train.iterations=4"]}.get(change, [])
    capsys.readouterr()
    assert main([*base, *extra, "--resume-stopped", "--overwrite", "--done", str(tmp_path / "done.json")]) == 0
    err = capsys.readouterr().err
    assert summary(out)["status"] == "ok" and summary(out)["resumed_from"] == (1 if resumes else None)
    assert ("continuing the stopped attempt" in err) == resumes
    assert [r["iteration"] for r in records(out)] == list(range(4 if change == "iterations" else 3))
    assert json.loads((tmp_path / "done.json").read_text()) == {"out": str(out), "status": "ok"}


@pytest.mark.parametrize("flags, words", [
    (["--resume", "--resume-stopped"], ["--resume and --resume-stopped", "give one"]),
    (["--done", "{out}/done.json"], ["--done", "inside --out", "outside the run folder"]),
    (["--done", "{tmp}/folder"], ["--done", "is a folder", "expected a file path"]),
    (["--done", "{tmp}/notes.txt"], ["--done", "the file exists and is not a run's marker"]),
    (["--journal", "{out}/journal.json"], ["--journal", "inside --out", "outside the run folder"]),
    (["--journal", "{tmp}/folder"], ["--journal", "is a folder", "expected a file path"]),
    # a path the user chose: another is given, as for --done (the message told to remove the user's own file)
    (["--journal", "{tmp}/notes.txt"], ["--journal", "the file exists and is not a cell job's journal",
                                        "give a new path"]),
    (["--done", "{tmp}/done.json", "--journal", "{tmp}/done.json"], ["--journal", "the same file as --done"]),
    # one inside the other's path: the run made a folder there, and the file failed to be written at its end
    (["--out", "{tmp}/m/run", "--done", "{tmp}/m"], ["--out", "inside --done", "outside the marker"]),
    (["--out", "{tmp}/j/run", "--journal", "{tmp}/j"], ["--out", "inside --journal", "outside the journal"]),
    (["--done", "{tmp}/j/done.json", "--journal", "{tmp}/j"], ["--done", "inside --journal", "outside the journal"]),
    (["--done", "{tmp}/m", "--journal", "{tmp}/m/j.json"], ["--journal", "inside --done", "outside the marker"]),
    # written when the run has ended: a place they cannot be written failed with a traceback after the whole run
    (["--done", "{tmp}/notes.txt/done.json"], ["--done", "notes.txt is not a folder", "expected a file path"]),
    (["--journal", "{tmp}/notes.txt/sub/journal.json"], ["--journal", "notes.txt is not a folder"]),
    (["--done", "/proc/agg-bench-done.json"], ["--done", "cannot write in /proc"]),
    (["--journal", "/proc/agg-bench-journal.json"], ["--journal", "cannot write in /proc"]),
])
def test_run_flags_that_cannot_go_together_are_one_line(tmp_path, capsys, flags, words):
    out = tmp_path / "run"
    (tmp_path / "folder").mkdir()
    (tmp_path / "notes.txt").write_text("mine")
    flags = [f.format(out=out, tmp=tmp_path) for f in flags]
    if flags[:1] == ["--out"]:  # a case's own run folder
        out, flags = Path(flags[1]), flags[2:]
    assert main(["run", "--config", str(ROOT / "config/run.yaml"), *SET, "--out", str(out), *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and all(word in err for word in words), err
    assert not out.exists() and (tmp_path / "notes.txt").read_text() == "mine"
    assert sorted(os.listdir(tmp_path)) == ["folder", "notes.txt"]  # the check's trial file made and removed


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
    # killed once 2 records are written: the other 6 keep the run going past the kill (this test looks every
    # 0.02 s) and leave checkpoints the rerun continues from; each of them runs twice more (the rerun, the forced one)
    iterations = 8
    sweep["set"].update({"train.iterations": iterations, "train.checkpoint_every": 1})
    sweep["methods"] = {"full": {"method": {"name": "full"}}}
    (work / "kill.yaml").write_text(yaml.safe_dump(sweep, sort_keys=False))
    run_dir = work / "results/runs/full_sd3_32px_s0_cpu"
    target = "results/done/full_sd3_32px_s0_cpu.json"  # the run job's output: its marker
    command = [sys.executable, "-m", "snakemake", target, "--cores", "1", "--configfile", "kill.yaml"]
    # Snakemake's entry point in this process (tests/integration/test_pipeline.py) wherever no signal or exit code
    # of a snakemake process is at stake: a real run there still starts its job as a process of its own. This dry
    # run also keeps the sweep's methods check in work/.snakemake/agg-bench, where the snakemake process started
    # below finds it instead of starting a child process of the model code to make it.
    from test_pipeline import snakemake_here

    planned = snakemake_here(work, *command[3:], "-n")
    assert planned.returncode == 0 and "run_id=full_sd3_32px_s0_cpu" in planned.stdout, planned.stderr[-3000:]
    log = open(tmp_path / "snakemake.log", "w")
    proc = subprocess.Popen(command, cwd=work, stdout=log, stderr=log, start_new_session=True)
    metrics = run_dir / "metrics.jsonl"
    wait_for_lines(proc, metrics, 2, tmp_path / "snakemake.log")
    os.killpg(proc.pid, signal.SIGKILL)  # snakemake, the job's shell and the run, at once
    proc.wait()
    log.close()
    assert not (run_dir / "summary.json").exists()
    # a killed snakemake leaves its lock and marks the job's outputs incomplete: --unlock (it only removes the
    # lock), then rerun them
    unlocked = snakemake_here(work, *command[3:], "--unlock")
    assert unlocked.returncode == 0, unlocked.stderr[-3000:]
    rerun = snakemake_here(work, *command[3:], "--rerun-incomplete")
    assert rerun.returncode == 0, rerun.stderr[-4000:]
    assert summary(run_dir)["status"] == "ok"
    assert [r["iteration"] for r in records(run_dir)] == list(range(iterations))
    # the killed attempt left checkpoints (train.checkpoint_every: 1): the rerun continued from the last one
    resumed = summary(run_dir)["resumed_from"]
    assert resumed is not None and 0 <= resumed < iterations, rerun.stderr[-3000:]
    assert json.loads((work / target).read_text()) == {"out": "results/runs/full_sd3_32px_s0_cpu", "status": "ok"}
    # a forced rerun of the run that ended starts over
    forced = snakemake_here(work, *command[3:], "--forcerun", "run")
    assert forced.returncode == 0, forced.stderr[-4000:]
    assert summary(run_dir)["resumed_from"] is None and len(records(run_dir)) == iterations


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


# the cases of the two-process launch: the signal at the 2nd sampler step, or at the 1st forward with grad of the
# update (its K-th transformer call of iteration 1)
STOP_STEPS = 4  # the 2nd step of the rollout is inside it, the update's first forward after the whole rollout
STOP_BASE = [*SMALL, f"sampling.steps={STOP_STEPS}", "grpo.prompts_per_iteration=2", "train.iterations=3",
             "train.checkpoint_every=1"]
STOP_CASES = {"rollout": (STOP_BASE, 2), "rollout_fsdp": ([*STOP_BASE, "train.shard=fsdp"], 2),
              "update_fsdp": ([*STOP_BASE, "train.shard=fsdp"], STOP_STEPS + 1)}


def two_process_part(out: Path) -> None:
    """Run in each process of the session's two-process launch (tests/integration/two_processes.py): rank 1 sends
    itself SIGTERM at its K-th transformer call of iteration 1 (rank 0 receives none); every process writes how many
    calls it made in iteration 1 before the run stopped."""
    from agg_bench.engine.models import Policy
    from agg_bench.machine import distributed

    torch.set_num_threads(1)
    calls, iteration, stop_at = [], [None], [0]
    velocity, collect = Policy.velocity, Session.collect

    def counted(self, latents, timesteps, cond):
        if iteration[0] == 1:
            calls.append(torch.is_grad_enabled())
            if distributed.current().rank == 1 and len(calls) == stop_at[0]:
                os.kill(os.getpid(), signal.SIGTERM)
        return velocity(self, latents, timesteps, cond)

    def collecting(self, it, *args, **kwargs):
        iteration[0] = it
        return collect(self, it, *args, **kwargs)

    Policy.velocity, Session.collect = counted, collecting
    with distributed.process_group(torch.device("cpu")) as shard:
        for name, (overrides, stop) in STOP_CASES.items():
            calls.clear()
            iteration[0], stop_at[0] = None, stop
            try:
                train(load_config(None, overrides), out / name)
                ended = "finished"
            except Interrupted:
                ended = "interrupted"
            (out / f"{name}.{shard.rank}.json").write_text(json.dumps({"calls": len(calls), "ended": ended}))
            if name == "update_fsdp":  # continued, and a run that was not stopped
                stop_at[0] = 0
                train(load_config(None, overrides), out / name, resume=True)
                train(load_config(None, overrides), out / "whole")


@pytest.fixture
def stop_launch(two_processes) -> Path:
    """The folder :func:`two_process_part` wrote in the session's two-process torchrun launch."""
    out, proc = two_processes
    assert proc.returncode == 0, proc.stderr[-4000:]  # a hang fails the launch
    return out / "stop"


def test_torchrun_processes_stop_together_at_the_next_sampler_step_or_sharded_call(stop_launch):
    """Under torchrun a signal used to wait for the end of the phase (the whole rollout, the whole update):
    on a large model minutes past a scheduler's deadline. The processes now stop together at the next sampler
    step (every process samples the whole batch) and, for a sharded model, at the next transformer call (its
    forward is a collective): one process received the signal, both stop after exactly as many calls, before
    the update's optimizer step, with the records and checkpoint of iteration 0."""
    for name, (_, stop_at) in STOP_CASES.items():
        ranks = [json.loads((stop_launch / f"{name}.{rank}.json").read_text()) for rank in (0, 1)]
        assert ranks == [{"calls": stop_at, "ended": "interrupted"}] * 2, name
        out = stop_launch / name
        if name == "update_fsdp":  # continued from its checkpoint: the records of the run that was not stopped
            assert summary(out)["status"] == "ok"
            untimed = lambda folder: [{k: v for k, v in r.items() if k not in TIMING_KEYS and k != "run_id"}
                                      for r in records(folder)]
            assert untimed(out) == untimed(stop_launch / "whole") and len(untimed(out)) == 3
            continue
        assert summary(out)["status"] == "interrupted"
        assert [r["iteration"] for r in records(out)] == [0]
        checkpoint = torch.load(out / "checkpoint.pt", weights_only=False, map_location="cpu")
        assert checkpoint["iteration"] == 0
