"""Data-parallel training: every process's share of the batch is exactly its slice of the single-process
batch, the averaged gradient equals the single-process gradient, and a torchrun run writes the records
of a single-process run.

The torchrun tests start ``torch.distributed.run`` with two CPU processes (gloo): the session's one launch of the model
code (tests/integration/two_processes.py, which runs :func:`two_process_part`), and launches of the error contract,
whose worker is this file (``python -m torch.distributed.run ... tests/integration/test_distributed.py OUT
--user-error WHICH``).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from agg_bench import errors
from agg_bench.cli import main
from agg_bench.config import load_config
from agg_bench.errors import ConfigError
from agg_bench.io import read_jsonl
from agg_bench.machine import distributed
from helpers import relative_error, torchrun

# the trainer (agg_bench.runtime.train) is imported where it is used: the workers that check the error contract
# (--user-error) need none of it, and its imports (the model libraries) doubled each one's start-up

ROOT = Path(__file__).resolve().parents[2]
# float64, so that the only difference between one and two processes is the order of additions. Each
# process runs the transformer on its share only, so the kernels see other batch shapes and the latents
# differ from one process's in the last bits: the reward must be continuous in the pixels (smoothness),
# not a JPEG byte count, which a last-bit change of one decoded pixel can move by whole bytes.
DDP = ["model.resolution=32", "model.dtype=float64", "reward.name=smoothness", "sampling.steps=6", "grpo.group_size=3",
       "grpo.prompts_per_iteration=4", "train.plan=groups", "train.plan_window=3", "progress=false",
       "telemetry.enabled=false"]
# the raw gradient is compared: clipping would scale a wrong gradient to the right norm
METHODS = {"full": ["method.name=full", "train.max_grad_norm=null"],
           "agg": ['method={"name": "agg", "window": 3, "alpha": "sigma"}', "train.max_grad_norm=null"]}
GRAD_TOL = 1e-6


def config(*overrides: str):
    return load_config(None, [*DDP, *overrides])



def one_update_gradient(cfg) -> dict[str, torch.Tensor]:
    """``.grad`` after the first update of iteration 0 (averaged over the processes under torchrun)."""
    from agg_bench.runtime.train import Session

    session = Session(cfg)
    session.update(session.collect(0).batch)
    return {name: p.grad.detach().clone() for name, p in session.policy.named_parameters()}


# ----- one process, as each rank would see it ---------------------------------------------------
@pytest.mark.parametrize("method", ["full", "window"])
def test_each_share_is_its_slice_of_the_single_process_batch(monkeypatch, method):
    from agg_bench.runtime.train import Session

    overrides = [f"method.name={method}"] + (["method.window_size=3", "method.window_mode=random"]
                                             if method == "window" else [])
    cfg = config(*overrides)
    whole = Session(cfg).collect(1)
    b = whole.batch.batch_size
    for rank in range(2):
        monkeypatch.setattr(distributed, "current", lambda rank=rank: distributed.Shard(rank, 2))
        session = Session(cfg)
        share = session.collect(1)
        rows = slice(rank * b // 2, (rank + 1) * b // 2)
        assert share.prompts == whole.prompts[rows]
        assert torch.equal(share.batch.train_steps, whole.batch.train_steps[rows])  # the same plan draws
        for name in ("latents", "log_probs", "velocities", "advantages"):
            torch.testing.assert_close(getattr(share.batch, name), getattr(whole.batch, name)[rows],
                                       rtol=1e-12, atol=1e-12, msg=name)
        # float64 rewards of float64 images that differ in the last bits: continuous, so as close
        torch.testing.assert_close(share.rewards, whole.rewards[rows], rtol=1e-12, atol=1e-12)
        # the transformer ran on this share only: T rollout forwards per sample of the share
        assert session.policy.counter.forward_nograd == (b // 2) * cfg.sampling.steps


def test_prompts_must_split_into_whole_groups():
    with pytest.raises(ConfigError) as err:
        distributed.Shard(0, 3).check_run(config())
    assert err.value.key == "grpo.prompts_per_iteration"
    with pytest.raises(ConfigError) as err:
        distributed.Shard(1, 2).check_run(config("device=cuda:1"))
    assert err.value.key == "device"
    distributed.Shard(1, 2).check_run(config())  # 4 prompts over 2 processes
    distributed.Shard(0, 1).check_run(config("grpo.prompts_per_iteration=3"))


@pytest.mark.parametrize("env, name", [
    ({"WORLD_SIZE": "abc"}, "WORLD_SIZE"), ({"WORLD_SIZE": "0"}, "WORLD_SIZE"), ({"WORLD_SIZE": "-2"}, "WORLD_SIZE"),
    ({"WORLD_SIZE": "2.0"}, "WORLD_SIZE"), ({"WORLD_SIZE": ""}, "WORLD_SIZE"),
    ({"RANK": "abc"}, "RANK"), ({"RANK": "-1"}, "RANK"), ({"RANK": "1"}, "RANK"),  # one process: rank 0 only
    ({"WORLD_SIZE": "2", "RANK": "2"}, "RANK"),
    ({"LOCAL_RANK": "x"}, "LOCAL_RANK"), ({"LOCAL_RANK": "-1"}, "LOCAL_RANK"),
])
def test_a_bad_launcher_variable_is_one_line_before_anything_runs(tmp_path, capsys, monkeypatch, env, name):
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    out = tmp_path / "out"
    assert main(["run", "--set", "model.resolution=32", "--set", "sampling.steps=4", "--set", "train.iterations=1",
                 "--set", "progress=false", "--out", str(out)]) == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"agg-bench run: environment variable {name}="), lines
    assert "expected an integer" in lines[0] and not out.exists()


@pytest.mark.parametrize("env, name", [
    ({"WORLD_SIZE": "2"}, "RANK"), ({"WORLD_SIZE": "2", "RANK": "1"}, "MASTER_ADDR"),
    ({"WORLD_SIZE": "2", "RANK": "0", "MASTER_ADDR": "127.0.0.1"}, "MASTER_PORT"),
    ({"WORLD_SIZE": "2", "RANK": "0", "MASTER_ADDR": "", "MASTER_PORT": "29500"}, "MASTER_ADDR"),
    ({"WORLD_SIZE": "2", "RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "99999"}, "MASTER_PORT"),
    ({"MASTER_ADDR": "127.0.0.1"}, "WORLD_SIZE"),  # with train.shard: fsdp, the rendezvous torchrun's variables name
])
def test_launcher_variables_set_in_part_are_one_line_before_anything_runs(tmp_path, capsys, monkeypatch, env, name):
    """A WORLD_SIZE left in the shell, or set by hand without the rest of torchrun's variables, is a user error
    naming the variable missing (torch's rendezvous raised a ValueError, reported as a bug)."""
    for key in ("WORLD_SIZE", "RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    out = tmp_path / "out"
    assert main(["run", "--set", "model.resolution=32", "--set", "sampling.steps=4", "--set", "train.iterations=1",
                 "--set", "train.shard=fsdp", "--set", "progress=false", "--out", str(out)]) == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"agg-bench run: environment variable {name}"), lines
    assert not out.exists()


@pytest.mark.slow
def test_sigterm_ends_a_rendezvous_waiting_for_processes_that_never_come(tmp_path):
    """WORLD_SIZE=2 and the rest of torchrun's variables set by hand, no second process: the rendezvous waits in
    C++ up to the collective timeout, where a first signal was only remembered; SIGTERM now ends it (under
    ``timeout`` the run waited the whole AGG_BENCH_DIST_TIMEOUT_S)."""
    import signal
    import socket
    import time

    with socket.socket() as sock:  # a free port for the rendezvous
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {**os.environ, "WORLD_SIZE": "2", "RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
           distributed.TIMEOUT_ENV: "600", "OMP_NUM_THREADS": "1"}
    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, "-m", "agg_bench", "run", "--set", "model.resolution=32",
                             "--set", "sampling.steps=2", "--set", "progress=false", "--out", str(out)],
                            env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(600):  # until rank 0 listens: it is in the rendezvous
            with socket.socket() as probe:
                if probe.connect_ex(("127.0.0.1", port)) == 0:
                    break
            assert proc.poll() is None, proc.returncode
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) == -signal.SIGTERM
    finally:
        proc.kill()
        proc.wait()
    assert not out.exists()


def test_one_process_communicates_nothing():
    p = torch.nn.Parameter(torch.ones(3))
    p.grad = torch.full((3,), 2.0)
    assert distributed.average_gradients([p], 1.5, float("nan"))[0] == 1.5
    assert torch.equal(p.grad, torch.full((3,), 2.0))
    assert distributed.gather({"a": 1}) == [{"a": 1}]


def test_combine_rules():
    a = {"forward_grad": 8, "t_train_s": 1.0, "peak_alloc_bytes": 10, "loss": 0.2, "ratio_dev": 0.1,
         "agg_route_scores": [0.9], "cache": "fora", "gpu_name": None, "grad_norm": 3.0}
    b = {"forward_grad": 8, "t_train_s": 2.0, "peak_alloc_bytes": 30, "loss": 0.4, "ratio_dev": 0.3,
         "agg_route_scores": [0.5, 0.7], "cache": "fora", "gpu_name": None, "grad_norm": 3.0}
    out = distributed.combine([a, b])
    assert out == {"forward_grad": 16, "t_train_s": 2.0, "peak_alloc_bytes": 30, "loss": pytest.approx(0.3),
                   "ratio_dev": 0.3, "agg_route_scores": [0.9, 0.5, 0.7], "cache": "fora", "gpu_name": None,
                   "grad_norm": 3.0}
    assert distributed.combine([a]) == a
    # a mean over a list the processes hold unequal shares of (AGG's routed groups at route_frac < 1) is the
    # joined list's, not the mean of the processes' means; None where the joined list is empty
    a["agg_route_score_mean"], b["agg_route_score_mean"] = 0.9, 0.6
    assert distributed.combine([a, b])["agg_route_score_mean"] == pytest.approx((0.9 + 0.5 + 0.7) / 3, rel=1e-15)
    empty = {"agg_route_scores": [], "agg_route_score_mean": None}
    assert distributed.combine([empty, dict(empty)]) == empty


def test_share_view_runs_the_transformer_on_its_rows_only():
    calls = []

    class Recorder:
        dtype = torch.float64

        def velocity(self, x, t, cond):
            calls.append(x.shape[0])
            return x * 2

    view = distributed.ShareView(Recorder(), slice(2, 4))
    x = torch.arange(6.0, dtype=torch.float64).view(6, 1)
    out = view.velocity(x, torch.zeros(6), torch.zeros(6, 1))
    assert calls == [2]
    assert out.flatten().tolist() == [0, 0, 4, 6, 0, 0]
    assert view.dtype == torch.float64  # everything else is the policy's


# ----- two processes ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def launched(two_processes) -> tuple[Path, subprocess.CompletedProcess]:
    """The folder :func:`two_process_part` wrote in the session's two-process torchrun launch, and that launch's
    process."""
    out, proc = two_processes
    return out / "ddp", proc


@pytest.mark.slow
def test_two_process_gradient_equals_single_process_gradient_and_failures_stop_both(launched):
    out, proc = launched
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    for method, overrides in METHODS.items():
        single = one_update_gradient(config(*overrides))
        both = torch.load(out / f"{method}.pt")
        assert set(both) == set(single)
        err = relative_error(both, single)
        assert err <= GRAD_TOL, (method, err)
        print(f"{method}: relative gradient error, 2 processes vs 1: {err:.2e}")
    # an OOM on process 1 stopped both processes; rank 0 wrote it down and both exited normally
    summary = json.loads((out / "oom/summary.json").read_text())
    assert (summary["status"], summary["last_good_iteration"], summary["world_size"]) == ("oom", 0, 2)
    assert [r["status"] for r in read_jsonl(out / "oom/metrics.jsonl")] == ["ok", "oom"]


RECORDS = {"one-step": [], "minibatches": ["train.minibatches=2"],
           "minibatches-routed": ["train.minibatches=2", "method.route_frac=0.3"]}


def records_args(steps: list[str]) -> list[str]:
    return [a for o in [*DDP, 'method={"name": "agg", "window": 3}', *steps] for a in ("--set", o)] + [
        "--set", "train.iterations=2", "--set", "run_id=ddp", "--set", "eval.every=1", "--set", "eval.noises=2"]


@pytest.mark.slow
@pytest.mark.parametrize("case", list(RECORDS))
def test_torchrun_run_writes_the_single_process_records(launched, tmp_path, case):
    """With train.minibatches, each process's k-th mini-batch is part of the single-process k-th one, so the
    records are the single-process run's too; with a partial route, so is the count each mini-batch routes (0.3 of
    the epoch's 24 candidate groups so far: 4, then 3). The launch runs ``agg-bench run`` (:func:`main`, as
    ``python -m agg_bench run`` does) once per case, one after the other."""
    from agg_bench.runtime.train import TIMING_KEYS

    launch, proc = launched
    steps, two = RECORDS[case], launch / case
    codes = [(launch / f"{case}.{rank}.code").read_text() if (launch / f"{case}.{rank}.code").exists() else None
             for rank in (0, 1)]
    assert codes == ["0", "0"], proc.stdout[-3000:] + proc.stderr[-5000:]
    # one result line for the run: rank 0's, not one per process
    results = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert [r for r in results if r.get("out") == str(two)] == [{"out": str(two), "status": "ok"}], results
    args = records_args(steps)
    assert main(["run", *args, "--out", str(tmp_path / "one")]) == 0
    two_records = list(read_jsonl(two / "metrics.jsonl"))
    one = list(read_jsonl(tmp_path / "one/metrics.jsonl"))
    assert [r["iteration"] for r in two_records] == [0, 1]
    if "method.route_frac=0.3" in steps:
        assert [r["agg_groups_routed"] for r in two_records] == [4 + 3] * 2
    summary = json.loads((two / "summary.json").read_text())
    assert summary["status"] == "ok" and summary["world_size"] == 2 and summary["n_gpus"] == 0
    skip = set(TIMING_KEYS) | {"saved_activation_peak_bytes"}
    # float64 throughout, with a continuous reward (DDP): the two runs differ by the order of additions,
    # ~1e-16 relative per operation, grown by at most a few orders of magnitude over two iterations of
    # this small model; 1e-9 leaves room for that and still catches any real difference.
    for r2, r1 in zip(two_records, one):
        assert set(r2) == set(r1)
        for key in set(r1) - skip:
            if isinstance(r1[key], float):
                assert r2[key] == pytest.approx(r1[key], rel=1e-9, abs=1e-12), key
            elif isinstance(r1[key], list) and r1[key] and isinstance(r1[key][0], float):
                # the processes' lists are joined in rank order; with mini-batches one process lists them
                # mini-batch after mini-batch, so only the items are the same
                order = sorted if steps else list
                assert order(r2[key]) == pytest.approx(order(r1[key]), rel=1e-9), key
            else:
                assert r2[key] == r1[key], key
    # work is counted over both processes: the same total as one process, and so is the cost
    assert [r["backward"] for r in two_records] == [r["backward"] for r in one]
    assert [r["cost"] for r in two_records] == [r["cost"] for r in one]
    # every process evaluates (a sharded forward needs them all), rank 0 writes each evaluation once
    evals_two = list(read_jsonl(two / "evaluations.jsonl"))
    evals_one = list(read_jsonl(tmp_path / "one/evaluations.jsonl"))
    assert [e["iteration"] for e in evals_two] == [0, 1, 2]
    for e2, e1 in zip(evals_two, evals_one):
        assert e2["eval_reward"] == pytest.approx(e1["eval_reward"], rel=1e-9, abs=1e-12)


def agg_bench_lines(proc: subprocess.CompletedProcess) -> list[str]:
    return [line for line in proc.stderr.splitlines() if line.startswith("agg-bench run:")]


def as_each_process(monkeypatch, capsys, command) -> list[tuple[object, list[str], list[float]]]:
    """``command()`` in this process as each of torchrun's two processes in turn (its variables set, those
    of a job whose collectives would fail at once): per process its exit code, its ``agg-bench run:`` lines
    and how long it waited to be ended, leaving its line to another process. torchrun ends a process that
    waits once another has failed; here the wait is ended at once, as that end is (a signal, which the
    process takes as an interruption)."""
    waits: list[float] = []

    def ended_by_torchrun(seconds: float) -> None:
        waits.append(seconds)
        raise KeyboardInterrupt

    monkeypatch.setattr(errors, "time", SimpleNamespace(sleep=ended_by_torchrun))
    for key, value in {"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "9",
                       errors.TORCHRUN_AGENT_VARIABLE: "none", distributed.TIMEOUT_ENV: "1"}.items():
        monkeypatch.setenv(key, value)
    seen = []
    for rank in (0, 1):
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("LOCAL_RANK", str(rank))
        capsys.readouterr()
        try:
            code: object = command()
        except SystemExit as end:  # argparse's usage error
            code = end.code
        lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("agg-bench run:")]
        seen.append((code, lines, list(waits)))
        waits.clear()
    return seen


EVERY_PROCESS = [
    (["--set", "train.iterations=abc"], "agg-bench run: config error: train.iterations = 'abc': expected an integer"),
    (["--resume", "--resume-stopped"], "agg-bench run: --resume and --resume-stopped: give one"),
    ([], "agg-bench run: the following arguments are required: --out"),  # argparse
]


@pytest.mark.parametrize("args, error", EVERY_PROCESS)
def test_a_user_error_every_process_raises_is_printed_by_process_0_alone(tmp_path, capsys, monkeypatch, args, error):
    """Raised alike before the processes join a group: process 0 prints the line, process 1 prints none and waits
    to be ended by torchrun, which ends the job once process 0 has failed (as the launch below shows)."""
    out = [] if not args else ["--set", "progress=false", "--set", "telemetry.enabled=false", "--out", str(tmp_path / "o")]
    (code0, lines0, waits0), (code1, lines1, waits1) = as_each_process(
        monkeypatch, capsys, lambda: main(["run", *args, *out]))
    assert code0 == 2 and len(lines0) == 1 and lines0[0].startswith(error) and waits0 == [], (code0, lines0, waits0)
    assert code1 != 0 and lines1 == [] and waits1 == [errors.ALIKE_WAIT_S], (code1, lines1, waits1)
    assert not (tmp_path / "o").exists()


def test_a_user_error_every_process_raises_is_printed_once(tmp_path):
    """After the processes joined the group, from the config alone: process 0 prints it, torchrun ends process 1."""
    error = "agg-bench run: config error: grpo.prompts_per_iteration = 3: expected a multiple of the 2 data-parallel processes"
    proc = torchrun("-m", "agg_bench", "run", "--set", "grpo.prompts_per_iteration=3", "--set", "progress=false",
                    "--set", "telemetry.enabled=false", "--out", str(tmp_path / "o"), timeout=240)
    lines = agg_bench_lines(proc)
    assert proc.returncode != 0 and len(lines) == 1 and lines[0].startswith(error), proc.stderr[-3000:]
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("which, expected", [
    ("one", ["agg-bench run: rank 1: process 1's own problem"]),
    ("each", ["agg-bench run: process 0's own problem", "agg-bench run: rank 1: process 1's own problem"]),
])
def test_a_user_error_of_one_process_is_printed_by_it(capsys, monkeypatch, which, expected):
    """An error that not every process raised alike is printed by each process that raised it, which says whose
    it is, at once: none is left to another process that does not have it."""
    seen = as_each_process(monkeypatch, capsys, lambda: _user_error(which))
    assert [code for code, _, _ in seen] == [2 if which == "each" else 0, 2]
    assert sorted(line for _, lines, _ in seen for line in lines) == expected, seen
    assert [waits for _, _, waits in seen] == [[], []]


def test_a_user_error_passed_on_is_printed_by_the_process_that_raised_it(tmp_path):
    """Passed on to process 0 at a point both reach: printed by process 1, whose error it is, alone (torchrun
    ends process 0, which leaves it to process 1), and not twice."""
    proc = torchrun(__file__, str(tmp_path), "--user-error", "passed", timeout=240)
    assert agg_bench_lines(proc) == ["agg-bench run: rank 1: process 1's own problem"], proc.stderr[-3000:]


def test_an_error_of_process_0_alone_passed_on_to_the_others_is_printed_once(tmp_path):
    """An output folder holding someone's files is refused by process 0, which claims it, and passed on to process
    1: one line, process 0's, and the folder as it was."""
    out = tmp_path / "o"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    proc = torchrun("-m", "agg_bench", "run", "--set", "progress=false", "--set", "telemetry.enabled=false",
                    "--out", str(out), timeout=240)
    lines = agg_bench_lines(proc)
    assert proc.returncode != 0 and len(lines) == 1, proc.stderr[-3000:]
    assert lines[0].startswith(f"agg-bench run: --out {out}: ") and "notes.txt" in lines[0]
    assert [p.name for p in out.iterdir()] == ["notes.txt"] and (out / "notes.txt").read_text() == "mine"


def _user_error(which: str) -> int:
    """Run by torchrun: the error contract of a command whose process 1 ("one") or every process ("each") raises
    a user error of its own, or process 1 in a block that every process ends together ("passed")."""
    from agg_bench.errors import UserError, run_command

    rank = int(os.environ["RANK"])

    def raise_own() -> None:
        if which == "each" or rank == 1:
            raise UserError(f"process {rank}'s own problem")

    def body() -> int:
        if which != "passed":
            raise_own()
            return 0
        with distributed.process_group(torch.device("cpu")), distributed.failures_shared():
            raise_own()
        return 0

    return run_command("agg-bench run", body, ["agg-bench", "run"])


def two_process_part(out: Path) -> None:
    """Run in each process of the session's two-process launch (tests/integration/two_processes.py): ``agg-bench run`` of each RECORDS case (:func:`main`, as ``python -m agg_bench run`` runs
    it, in the process group of the launch: a gloo group joined again after one was left may read the address
    the last one left), its exit code written per process; then one update per method, rank 0 saving the
    averaged gradients; then a run in which process 1 runs out of memory in its second update."""
    torch.set_num_threads(1)
    with distributed.process_group(torch.device("cpu")) as shard:
        assert shard.world_size == 2
        for case, steps in RECORDS.items():
            code = main(["run", *records_args(steps), "--out", str(out / case)])
            (out / f"{case}.{shard.rank}.code").write_text(str(code))
        for method, overrides in METHODS.items():
            grads = one_update_gradient(config(*overrides))
            if shard.is_main:
                torch.save(grads, out / f"{method}.pt")
        oom_on_rank_1(shard, out)


def oom_on_rank_1(shard, out: Path) -> None:
    from agg_bench.engine.models import Policy
    from agg_bench.runtime.train import train

    velocity = Policy.velocity

    def out_of_memory_on_rank_1(self, latents, timesteps, cond):
        if shard.rank == 1 and self.version == 1 and torch.is_grad_enabled():
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (injected)")
        return velocity(self, latents, timesteps, cond)

    Policy.velocity = out_of_memory_on_rank_1
    summary = train(config("train.iterations=3"), out / "oom")
    assert summary["status"] == "oom", summary


if __name__ == "__main__":
    assert "--user-error" in sys.argv, sys.argv
    sys.exit(_user_error(sys.argv[-1]))
