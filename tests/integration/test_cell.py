"""agg-bench cell: a cell's runs in one process write what separate `agg-bench run` processes write (every
non-timing record field, as tests/pinned.py compares them), a bad job file writes nothing, and one run's
failure neither stops the others nor hides in the exit code."""
from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import pytest
import yaml

from agg_bench.cli import main
from agg_bench.config import load_config
from agg_bench.io import atomic_path, read_jsonl
from agg_bench.runtime import train as train_module
from agg_bench.tools.sweep import Sweep
from helpers import ENDED_PID, agg_bench_processes, interrupted_updates, running_process
from pinned import pinned_fields
from test_pinned_records import differences

ROOT = Path(__file__).resolve().parents[2]
SCHEMA = ROOT / "workflow" / "schemas" / "config.schema.yaml"
TINY = ["model.preset=tiny", "model.resolution=32", "train.iterations=2", "sampling.steps=6", "grpo.group_size=2",
        "grpo.prompts_per_iteration=1", "progress=false"]


def small_cell() -> Sweep:
    """Two methods of the embedded default (a stateful estimator, a cache's hooks) x two seeds on the tiny
    SD3 at 32 px, two iterations in float64 (as tests/pinned.py runs them): one cell job."""
    sweep = yaml.safe_load((ROOT / "config" / "config.yaml").read_text())
    sweep["base"] = str(ROOT / sweep["base"])
    sweep["set"].update({"train.iterations": 2, "model.dtype": "float64"})
    del sweep["gradcheck"]
    sweep.update(models={"sd3": sweep["models"]["sd3"]}, resolutions=[32], seeds=[0, 1],
                 methods={label: sweep["methods"][label] for label in ("agg-w5-sigma-reuse", "cache-fora")})
    return Sweep(sweep, SCHEMA, cache_dir=None)


def test_a_cell_writes_the_records_of_separate_runs(tmp_path):
    sweep = small_cell()
    [cell] = sweep.cells
    assert len(sweep.cells[cell]) == 4 and not sweep.single_runs
    together, apart = tmp_path / "cell", tmp_path / "runs"
    (together / "results" / "cells").mkdir(parents=True)
    (together / "results" / "cells" / f"{cell}.json").write_text(json.dumps(sweep.cell_jobs(cell)))
    apart.mkdir()
    # the cell's process and each run's: each forked from one interpreter that only imported the model code,
    # so each starts with no other command's state, and the five pay the imports once
    agg_bench_processes([(sweep.cell_command(cell), together), *((sweep.run_command(run_id), apart)
                                                                  for run_id in sweep.cells[cell])],
                        {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"})  # as the workflow's jobs run
    for run_id in sweep.cells[cell]:
        a, b = together / "results" / "runs" / run_id, apart / "results" / "runs" / run_id
        assert sorted(p.name for p in a.iterdir()) == sorted(p.name for p in b.iterdir())
        expected = [pinned_fields(r) for r in read_jsonl(b / "metrics.jsonl")]
        actual = [pinned_fields(r) for r in read_jsonl(a / "metrics.jsonl")]
        assert len(actual) == 2 and not differences(expected, actual, run_id), differences(expected, actual, run_id)
        for name in ("summary.json", "config.json"):
            assert json.loads((a / name).read_text()) == json.loads((b / name).read_text()), (run_id, name)
        env_a, env_b = (json.loads((folder / "env.json").read_text()) for folder in (a, b))
        assert env_a.pop("timestamp") and env_b.pop("timestamp") and env_a == env_b


def job_file(tmp_path: Path, runs: list) -> Path:
    path = tmp_path / "jobs.json"
    path.write_text(json.dumps({"runs": runs}))
    return path


def run(out: Path, *overrides: str) -> dict:
    return {"config": None, "set": [*TINY, *overrides], "out": str(out)}


@pytest.mark.parametrize("make, words", [
    (lambda t: "not json", ["jobs.json", "is not JSON"]),
    (lambda t: {"runs": []}, ["runs is an empty list"]),
    # a key left out was "null", a value the file does not hold
    (lambda t: {}, ["jobs.json: runs is not given; expected a list of one or more runs"]),
    (lambda t: {"runs": [{"set": []}]}, ["runs[0].out is not given; expected the run folder"]),
    (lambda t: {"runs": [{"set": [], "out": None}]}, ["runs[0].out is null; expected the run folder"]),
    (lambda t: {"runs": [run(t / "a"), {**run(t / "b"), "resume": True}]},
     ["runs[1]: unknown key 'resume' (allowed in a run: config, set, out, done)"]),
    (lambda t: {"runs": [run(t / "a"), {**run(t / "b"), "bogus": 1, "x": 2}]},
     ["runs[1]: unknown keys 'bogus', 'x' (allowed in a run: config, set, out, done)"]),
    # a key of the file other than runs was ignored, and the runs ran
    (lambda t: {"runs": [run(t / "a")], "x": 1}, ["jobs.json: unknown key 'x' (allowed: runs, the list of runs; calibrations, the calibrations to take after them)"]),
    # an empty string was "a string"
    (lambda t: {"runs": [{**run(t / "a"), "out": ""}]}, ["runs[0].out '': an empty path, which names the current folder"]),
    (lambda t: {"runs": [{**run(t / "a"), "config": ""}]}, ["runs[0].config '': an empty path, which names the"]),
    (lambda t: {"runs": [{**run(t / "a"), "done": ""}]}, ["runs[0].done '': an empty path, which names the current"]),
    (lambda t: {"runs": [run(t / "a"), {**run(t / "b"), "set": "seed=1"}]}, ["runs[1].set", "a string", "KEY=VALUE"]),
    (lambda t: {"runs": [run(t / "a"), {**run(t / "b"), "set": ["seed=1", 3]}]},
     ["runs[1].set[1] is a number; expected a KEY=VALUE string"]),
    (lambda t: {"runs": [run(t / "a"), run(t / "a")]}, ["runs[1].out", "also runs[0].out"]),
    # issue 37: a run folder inside another's, in either order, is refused before either run writes
    (lambda t: {"runs": [run(t / "n1"), run(t / "n1" / "inner")]}, ["runs[1].out", "inside runs[0].out"]),
    (lambda t: {"runs": [run(t / "n1" / "inner"), run(t / "n1")]}, ["runs[0].out", "inside runs[1].out"]),
    (lambda t: {"runs": [run(t / "n1"), run(t / "x"), run(t / "x" / ".." / "n1" / "deep" / "er")]},
     ["runs[2].out", "inside runs[0].out"]),
    (lambda t: {"runs": [run(t / f"r{i}") for i in range(4097)]}, ["4,097 runs", "at most 4,096"]),
    # a run's marker is the cell's file: never inside a run folder, one per run
    (lambda t: {"runs": [run(t / "a"), {**run(t / "b"), "done": str(t / "a" / "b.done")}]},
     ["runs[1].done", "inside runs[0].out", "outside every run folder"]),
    (lambda t: {"runs": [{**run(t / "a"), "done": str(t / "m")}, {**run(t / "b"), "done": str(t / "m")}]},
     ["runs[1].done", "also runs[0].done"]),
    # a run folder or another marker below a marker's path: the marker could not be written (a traceback)
    (lambda t: {"runs": [{**run(t / "m" / "a"), "done": str(t / "m")}]},
     ["runs[0].out", "is inside runs[0].done", "expected a path outside every marker"]),
    (lambda t: {"runs": [{**run(t / "a"), "done": str(t / "m")}, {**run(t / "b"), "done": str(t / "m" / "b")}]},
     ["runs[1].done", "is inside runs[0].done", "expected a path outside every marker"]),
    (lambda t: {"runs": [{**run(t / "a"), "done": 3}]}, ["runs[0].done is a number", "a marker file or null"]),
    # pathlib drops a trailing slash: the marker was written as a file named m
    (lambda t: {"runs": [{**run(t / "a"), "done": str(t / "m") + "/"}]},
     ["runs[0].done", "m/': ends with /, which names a folder; expected a marker file"]),
    (lambda t: (t / "m").mkdir() or {"runs": [{**run(t / "a"), "done": str(t / "m")}]},
     ["runs[0].done", "is a folder", "expected a file path"]),
    # a file that is not a marker is someone's: never replaced
    (lambda t: (t / "m").write_text("notes") and {"runs": [{**run(t / "a"), "done": str(t / "m")}]},
     ["runs[0].done", "the file exists and is not a run's marker"]),
    # the job's journal beside the job file is the cell's: a marker there replaced it, a run folder there blocked it
    (lambda t: {"runs": [{**run(t / "a"), "done": str(t / "jobs.progress.json")}]},
     ["runs[0].done", "is the job's journal", "jobs.progress.json"]),
    (lambda t: {"runs": [run(t / "jobs.progress.json")]}, ["runs[0].out", "is the job's journal"]),
    # a path inside it: the run wrote its folder, then its journal could not be written (exit 2)
    (lambda t: {"runs": [run(t / "jobs.progress.json" / "r")]}, ["runs[0].out", "is inside the job's journal"]),
    (lambda t: {"runs": [{**run(t / "a"), "done": str(t / "jobs.progress.json" / "d")}]},
     ["runs[0].done", "is inside the job's journal"]),
    (lambda t: " " * (64 * 2**20 + 1), ["jobs.json", "over the 64 MiB"]),
    # a config error in a later run: found before the first run writes anything
    (lambda t: {"runs": [run(t / "a"), run(t / "b", "train.lr=fast")]}, ["runs[1]", "train.lr", "'fast'"]),
])
def test_a_bad_job_file_is_one_line_and_writes_nothing(tmp_path, capsys, make, words):
    content = make(tmp_path)
    path = tmp_path / "jobs.json"
    path.write_text(content if isinstance(content, str) else json.dumps(content))
    assert main(["cell", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("agg-bench cell: "), err
    for word in words:
        assert word in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["jobs.json", *(["m"] if (tmp_path / "m").exists() else [])])


def _finished_run(t: Path) -> Path:
    assert main(["run", "--set", "seed=5", *[word for item in TINY for word in ("--set", item)], "--set",
                 "train.iterations=1", "--out", str(t / "theirs")]) == 0
    return t / "theirs"


@pytest.mark.parametrize("make, words", [
    (lambda t: (t / "theirs").mkdir() or ((t / "theirs" / "notes.txt").write_text("mine") and t / "theirs"),
     "the folder holds files that are not an agg-bench run (notes.txt)"),
    (lambda t: (t / "theirs").write_text("mine") and t / "theirs", "exists and is not a folder"),
    (lambda t: (t / "folder").mkdir() or (t / "theirs").symlink_to(t / "folder") or t / "theirs",
     "is a symbolic link"),
    (_finished_run, "holds a finished run of another config (seed = 5 there, 0 here); pass --overwrite"),
])
@pytest.mark.parametrize("flags", [[], ["--keep-going"]])
def test_a_later_runs_folder_that_takes_no_run_is_refused_before_the_first_run(tmp_path, capsys, make, words, flags):
    """A later run's folder that its run refuses (someone's files, a file, a link, a finished run of another
    config) was found only when the cell reached that run, after the runs before it had written their folders."""
    theirs = make(tmp_path)
    before = {str(p): None if p.is_dir() else p.read_bytes() for p in sorted(tmp_path.rglob("*"))}
    path = job_file(tmp_path, [run(tmp_path / "a", "method={name: full}"), run(theirs, "method={name: full}")])
    capsys.readouterr()
    assert main(["cell", *flags, str(path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"jobs.json: runs[1] (--out {theirs}): --out {theirs}: {words}" in err[0], err
    path.unlink()
    assert {str(p): None if p.is_dir() else p.read_bytes() for p in sorted(tmp_path.rglob("*"))} == before


def test_with_resume_a_later_finished_run_of_another_config_that_kept_its_checkpoint_is_refused_first(tmp_path,
                                                                                                     capsys):
    """With --resume (the workflow's cell jobs) a run continues only a stopped attempt; a finished run of another
    config that kept its checkpoint.pt (train.checkpoint_every) passed the check before the first run, and was
    refused only when the cell reached it, after the runs before it had written theirs."""
    assert main(["run", "--set", "seed=5", *[word for item in TINY for word in ("--set", item)], "--set",
                 "train.iterations=1", "--set", "train.checkpoint_every=1", "--out", str(tmp_path / "theirs")]) == 0
    theirs = tmp_path / "theirs"
    assert (theirs / "checkpoint.pt").is_file() and (theirs / "summary.json").is_file()
    before = {str(p): None if p.is_dir() else p.read_bytes() for p in sorted(tmp_path.rglob("*"))}
    path = job_file(tmp_path, [run(tmp_path / "a", "method={name: full}"), run(theirs, "method={name: full}")])
    capsys.readouterr()
    assert main(["cell", "--resume", str(path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"jobs.json: runs[1] (--out {theirs}): --out {theirs}: holds a finished run of another " \
        "config (seed = 5 there, 0 here)" in err[0], err
    path.unlink()
    assert {str(p): None if p.is_dir() else p.read_bytes() for p in sorted(tmp_path.rglob("*"))} == before


@pytest.mark.parametrize("name", ["config.yaml", "h200.yaml", "learning_gpu.yaml"])
def test_the_workflow_s_job_files_hold_only_the_keys_a_cell_reads(tmp_path, monkeypatch, name):
    """Every cell job file the workflow writes for a committed sweep (Sweep.cell_jobs) is read as it is,
    unknown keys refused."""
    from agg_bench.runtime.cell import read_jobs

    monkeypatch.chdir(ROOT)
    sweep = Sweep(yaml.safe_load((ROOT / "config" / name).read_text()), SCHEMA, cache_dir=None)
    assert sweep.cells
    for n, cell in enumerate(sweep.cells):
        path = tmp_path / f"{n}.json"
        path.write_text(json.dumps(sweep.cell_jobs(cell)))
        assert [str(job.out) for job in read_jobs(path)] == [f"results/runs/{r}" for r in sweep.cells[cell]]


@pytest.mark.parametrize("kind, words", [
    ("folder", ["is a folder"]),
    ("link", ["is a symbolic link"]),
    ("not json", ["is not a cell job's journal", "remove it"]),
    ("another object", ["is not a cell job's journal", "remove it"]),
])
def test_a_journal_that_is_not_one_is_refused_before_any_run(tmp_path, capsys, kind, words):
    """The journal's place holds something else: refused with one line before any run, and left as it was."""
    path = job_file(tmp_path, [run(tmp_path / "a")])
    journal = tmp_path / "jobs.progress.json"
    if kind == "folder":
        journal.mkdir()
    elif kind == "link":
        (tmp_path / "elsewhere.json").write_text("{}")
        journal.symlink_to(tmp_path / "elsewhere.json")
    else:
        journal.write_text("{not json" if kind == "not json" else json.dumps({"mine": [1, 2]}))
    before = journal.read_text() if journal.is_file() and not journal.is_symlink() else None
    assert main(["cell", "--resume", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "its journal" in err and all(word in err for word in words), err
    assert not (tmp_path / "a").exists()
    assert journal.is_dir() if kind == "folder" else journal.is_symlink() if kind == "link" else \
        journal.read_text() == before


@pytest.mark.parametrize("outcomes, code, started", [
    (["oom", "diverged", "ok"], 0, 3),
    (["oom", "user", "ok"], 2, 3),  # the next runs still run
    (["bug", "user", "ok"], 1, 3),  # a bug is the worse failure
    (["ok", "interrupt", "ok"], 130, 2),  # a signal stops the cell
])
def test_each_run_ends_on_its_own(tmp_path, capsys, monkeypatch, outcomes, code, started):
    from agg_bench.errors import UserError

    calls = []

    def fake_train(cfg, out, resume=False, overwrite=False, resume_stopped=False, resume_flag=None):
        outcome = outcomes[len(calls)]
        calls.append(Path(out).name)
        if outcome == "user":
            raise UserError(f"--out {out}: refused")
        if outcome == "bug":
            raise RuntimeError("broken")
        if outcome == "interrupt":
            raise KeyboardInterrupt
        return {"status": outcome}

    monkeypatch.setattr(train_module, "train", fake_train)
    path = job_file(tmp_path, [run(tmp_path / name) for name in "abc"])
    assert main(["cell", str(path)]) == code
    assert calls == list("abc")[:started]
    out, err = capsys.readouterr()
    assert [json.loads(line)["status"] for line in out.splitlines()] == [o for o in outcomes[:started]
                                                                          if o in ("ok", "oom", "diverged")]
    progress = [line for line in err.splitlines() if line.startswith("agg-bench cell: run ")]
    assert len(progress) == 2 * started and progress[0].endswith(f"{tmp_path / 'a'} started")
    assert all(f"{tmp_path / n}: refused" in err for n, o in zip("abc", outcomes) if o == "user")


def test_a_run_folder_with_a_line_break_keeps_each_progress_line_one_line(tmp_path, capsys, monkeypatch):
    """A run folder's name may hold a newline or a carriage return, which split the cell's line per run (and a
    failed run's line) on stderr: such a path is written quoted, a plain one as it is."""
    from agg_bench.errors import UserError

    def fake_train(cfg, out, resume=False, overwrite=False, resume_stopped=False, resume_flag=None):
        if Path(out).name == "c\rd":
            raise UserError("refused")
        return {"status": "ok"}

    monkeypatch.setattr(train_module, "train", fake_train)
    outs = [tmp_path / "a\nb", tmp_path / "c\rd", tmp_path / "plain"]
    assert main(["cell", str(job_file(tmp_path, [run(out) for out in outs]))]) == 2
    lines = re.split(r"\r\n|\r|\n", capsys.readouterr().err.strip())
    assert [line.split(" ")[4] for line in lines if line.startswith("agg-bench cell: run ")] == \
        [repr(str(outs[0]))] * 2 + [repr(str(outs[1]))] * 2 + [str(outs[2])] * 2, lines
    assert f"agg-bench cell: {str(outs[1])!r}: refused" in lines, lines
    assert len(lines) == 7, lines


def test_on_a_gpu_the_next_run_starts_without_the_blocks_an_oom_run_left_cached(tmp_path, capsys, monkeypatch):
    """A one-GPU cell runs its runs in one process: the caching allocator's blocks of a run that ended (an
    out-of-memory one above all) go back to the device before the next run starts, so it measures and
    allocates as a fresh process would."""
    import torch

    events = []

    def fake_train(cfg, out, resume=False, overwrite=False, resume_stopped=False, resume_flag=None):
        events.append(Path(out).name)
        return {"status": "oom" if Path(out).name == "a" else "ok"}

    monkeypatch.setattr(train_module, "train", fake_train)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: events.append("empty_cache"))
    assert main(["cell", str(job_file(tmp_path, [run(tmp_path / name) for name in "ab"]))]) == 0
    assert events[:2] == ["a", "empty_cache"] and events.index("b") > 1
    assert [json.loads(line)["status"] for line in capsys.readouterr().out.splitlines()] == ["oom", "ok"]


@pytest.mark.parametrize("keep_going", [True, False])
def test_keep_going_records_a_failed_run_and_keeps_the_others(tmp_path, capsys, monkeypatch, keep_going):
    """Issue 37: a failed run made the cell job fail, and Snakemake removed every output of the job, the
    finished runs' records with them. With --keep-going a run that fails is recorded in its own folder
    (summary.json, status: error: written by the run when it fails in an iteration, by the cell when it
    fails before writing anything) and the cell exits 0; a failure that cannot be recorded still counts."""
    session_class, update = train_module.Session, train_module.Session.update

    def failing_session(cfg, *args, **kwargs):
        if cfg.seed == 7:
            raise RuntimeError("broken while building")
        return session_class(cfg, *args, **kwargs)

    def failing_update(self, batch):
        if self.cfg.seed == 8 and self.policy.version == 1:
            raise RuntimeError("broken in iteration 1")
        return update(self, batch)

    monkeypatch.setattr(train_module, "Session", failing_session)
    monkeypatch.setattr(session_class, "update", failing_update)
    flag = ["--keep-going"] if keep_going else []
    runs = [run(tmp_path / "a"), run(tmp_path / "b", "seed=8"), run(tmp_path / "c", "seed=7")]
    assert main(["cell", *flag, str(job_file(tmp_path, runs))]) == (0 if keep_going else 1)
    summaries = {name: json.loads((tmp_path / name / "summary.json").read_text())
                 for name in "abc" if (tmp_path / name / "summary.json").exists()}
    assert summaries["a"]["status"] == "ok" and len(list(read_jsonl(tmp_path / "a" / "metrics.jsonl"))) == 2
    b = summaries["b"]  # failed in an iteration: the run wrote its records and its summary
    assert (b["status"], b["last_good_iteration"]) == ("error", 0) and "broken in iteration 1" in b["error"]
    if keep_going:  # failed while building: the cell recorded it as an attempt without records
        c = summaries["c"]
        assert (c["status"], c["error"], c["run_id"]) == ("error", "RuntimeError: broken while building", "c")
        assert list(read_jsonl(tmp_path / "c" / "metrics.jsonl")) == []
        assert json.loads((tmp_path / "c" / "config.json").read_text())["seed"] == 7
    else:
        assert not (tmp_path / "c").exists()
    out = capsys.readouterr().out
    assert [json.loads(line)["status"] for line in out.splitlines()] == (["ok", "error", "error"] if keep_going
                                                                         else ["ok"])
    # a failure that cannot be recorded (someone else's folder) counts with --keep-going too
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "notes.txt").write_text("mine")
    assert main(["cell", *flag, str(job_file(tmp_path, [run(tmp_path / "d")]))]) == 2
    assert sorted(p.name for p in (tmp_path / "d").iterdir()) == ["notes.txt"]


def test_the_cell_command_runs_in_one_process(tmp_path, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    assert main(["cell", str(job_file(tmp_path, [run(tmp_path / "a")]))]) == 2
    assert not (tmp_path / "a").exists()


def identity(path: Path) -> tuple[int, int]:
    stat = path.stat()
    return stat.st_ino, stat.st_mtime_ns


def test_a_resumed_cell_keeps_what_an_attempt_that_did_not_end_finished(tmp_path, capsys):
    """A workflow reruns a whole cell job after it was stopped (and removed its outputs: here the runs'
    markers, not their files). With --resume the next attempt keeps each run the stopped attempt finished,
    as long as its config, the code and its files are what the journal recorded, and runs the rest; an
    attempt that ended removes the journal, so a forced rerun runs everything again."""
    runs = [{**run(tmp_path / name, f"seed={seed}"), "done": str(tmp_path / "done" / f"{name}.json")}
            for name, seed in (("a", 0), ("b", 9), ("c", 2))]
    path = job_file(tmp_path, runs)
    journal = tmp_path / "jobs.progress.json"
    summary = {name: tmp_path / name / "summary.json" for name in "abc"}

    with interrupted_updates(lambda session: session.cfg.seed == 9):  # a signal in b's first update
        assert main(["cell", "--keep-going", "--resume", str(path)]) == 130
    assert json.loads(summary["a"].read_text())["status"] == "ok" and not (tmp_path / "c").exists()
    assert json.loads(summary["b"].read_text())["status"] == "interrupted"
    assert list(json.loads(journal.read_text())["runs"]) == [str(tmp_path / "a")]
    assert not (tmp_path / "done").exists()  # an attempt that did not end writes no marker
    first = identity(summary["a"])
    capsys.readouterr()

    # the next attempt: a kept, b and c run
    assert main(["cell", "--keep-going", "--resume", str(path)]) == 0
    err = capsys.readouterr().err
    assert f"run 1/3 {tmp_path / 'a'} kept: it ended ok" in err and f"run 2/3 {tmp_path / 'b'} started" in err
    assert identity(summary["a"]) == first
    assert {name: json.loads(summary[name].read_text())["status"] for name in "abc"} == dict.fromkeys("abc", "ok")
    assert all(len(list(read_jsonl(tmp_path / name / "metrics.jsonl"))) == 2 for name in "abc")
    assert [json.loads((tmp_path / "done" / f"{name}.json").read_text()) for name in "abc"] == \
        [{"out": str(tmp_path / name), "status": "ok"} for name in "abc"]
    assert not journal.exists()  # this attempt ended

    assert main(["cell", "--keep-going", "--resume", str(path)]) == 0  # a forced rerun: everything runs
    assert "kept: it ended" not in capsys.readouterr().err and identity(summary["a"]) != first


def test_a_cell_job_that_ended_unseen_keeps_its_runs_until_the_workflow_forgets_it(tmp_path, capsys, monkeypatch):
    """`kill -9` of snakemake leaves its cell job running; the job ends, writes its markers and removed its
    journal, and the next snakemake, which saw no end, reruns it as incomplete (its markers removed first): every
    run of the cell ran again. With --keep-journal the journal stays until the workflow's manifest job, which
    runs once Snakemake recorded every cell's end, removes it (Sweep.forget_attempts): the rerun keeps
    every run; a forced rerun after the manifest runs everything."""
    runs = [{**run(tmp_path / name, f"seed={seed}"), "done": str(tmp_path / "done" / f"{name}.json")}
            for name, seed in (("a", 0), ("b", 1))]
    path = job_file(tmp_path, runs)
    journal = tmp_path / "jobs.progress.json"
    summary = {name: tmp_path / name / "summary.json" for name in "ab"}
    args = ["cell", "--keep-going", "--resume", "--keep-journal", str(path)]
    assert main(args) == 0
    assert sorted(json.loads(journal.read_text())["runs"]) == [str(tmp_path / name) for name in "ab"]
    first = {name: identity(summary[name]) for name in "ab"}
    capsys.readouterr()
    shutil.rmtree(tmp_path / "done")  # Snakemake removes an incomplete job's outputs before it reruns it
    assert main(args) == 0
    err = capsys.readouterr().err
    assert err.count("kept: it ended ok in an earlier attempt of this job whose end was not recorded") == 2, err
    assert {name: identity(summary[name]) for name in "ab"} == first
    assert sorted(p.name for p in (tmp_path / "done").iterdir()) == ["a.json", "b.json"]
    # the manifest job: Snakemake recorded the cell's end
    sweep = small_cell()
    [cell] = sweep.cells
    monkeypatch.chdir(tmp_path)
    cells = tmp_path / "results" / "cells"
    cells.mkdir(parents=True)
    recorded = json.loads(journal.read_text())
    cell_runs = {f"results/runs/{run_id}": {"config": {}, "status": "ok"} for run_id in sweep.cells[cell]}
    failed = dict(list(cell_runs.items())[1:])  # the first run failed (a failed run is not recorded)
    (cells / f"{cell}.progress.json").write_text(json.dumps({"code": recorded["code"], "runs": failed}))
    (cells / "other.progress.json").write_text("{}")  # not one of this sweep's cells: left alone
    sweep.forget_attempts()  # a run of the cell did not end: its rerun reruns that one only
    assert sorted(p.name for p in cells.iterdir()) == ["other.progress.json", f"{cell}.progress.json"]
    (cells / f"{cell}.progress.json").write_text(json.dumps({"code": recorded["code"], "runs": cell_runs}))
    sweep.forget_attempts()
    assert sorted(p.name for p in cells.iterdir()) == ["other.progress.json"]
    journal.unlink()
    assert main(args) == 0  # a forced rerun after the manifest: every run again
    assert "kept:" not in capsys.readouterr().err
    assert all(identity(summary[name]) != first[name] for name in "ab")
    assert main(["cell", "--keep-journal", str(path)]) == 2
    assert "--keep-journal: a cell keeps a journal with --resume only" in capsys.readouterr().err


def test_a_run_job_that_ended_unseen_keeps_its_run_until_the_workflow_forgets_it(tmp_path, capsys, monkeypatch):
    """The run job's side of the test above: `kill -9` of snakemake leaves its run job running; the run ends and
    writes its marker, and the next snakemake, which saw no end, reruns the job as incomplete (the marker removed
    first): `agg-bench run --resume-stopped` started the run that ended over. With --journal (the workflow's run
    jobs; a cell job's journal of one run) the rerun keeps it, until the workflow forgets the journal once
    Snakemake recorded the job's end (Sweep.forget_attempts); a failed run, another config or other code runs."""
    from agg_bench.runtime import cell

    sweep = yaml.safe_load((ROOT / "config" / "test.yaml").read_text())
    sweep["base"] = str(ROOT / sweep["base"])
    sweep["devices"]["cpu"]["runs_per_job"] = 1  # one job per run: the `run` rule
    del sweep["gradcheck"]
    sweep = Sweep(sweep, SCHEMA, cache_dir=None)
    assert not sweep.cells and sweep.single_runs == ["full_sd3_32px_s0_cpu", "agg-w3_sd3_32px_s0_cpu"]
    run_id = sweep.single_runs[0]
    command = sweep.run_command(run_id)
    assert command.endswith(f"--done results/done/{run_id}.json --journal results/cells/{run_id}.progress.json")
    monkeypatch.chdir(tmp_path)
    out, done, journal = Path(f"results/runs/{run_id}"), Path(sweep.done_marker(run_id)), Path(sweep.journal(run_id))
    args = ["run", *[a for o in TINY for a in ("--set", o)], "--out", str(out), "--resume-stopped", "--overwrite",
            "--done", str(done), "--journal", str(journal)]
    update = train_module.Session.update

    def failing_update(self, batch):
        raise RuntimeError("broken")

    monkeypatch.setattr(train_module.Session, "update", failing_update)
    assert main(args) == 1  # a failed run: not in the journal, and the rerun runs it
    assert not journal.exists() and not done.exists()
    monkeypatch.setattr(train_module.Session, "update", update)
    capsys.readouterr()
    assert main(args) == 0
    assert "kept:" not in capsys.readouterr().err
    assert json.loads(journal.read_text())["runs"][str(out)]["status"] == "ok"
    assert json.loads(done.read_text()) == {"out": str(out), "status": "ok"}
    first = identity(out / "summary.json")
    done.unlink()  # Snakemake removes an incomplete job's outputs before it reruns it
    assert main(args) == 0
    captured = capsys.readouterr()
    assert f"agg-bench run: {out} kept: it ended ok in an earlier attempt whose end was not recorded" in captured.err
    assert json.loads(captured.out) == {"out": str(out), "status": "ok"}
    assert identity(out / "summary.json") == first and len(list(read_jsonl(out / "metrics.jsonl"))) == 2
    assert json.loads(done.read_text()) == {"out": str(out), "status": "ok"}
    # another config (a changed sweep) runs, and --overwrite replaces the earlier one
    assert main([*args, "--set", "train.lr=0.0002"]) == 0
    assert "kept:" not in capsys.readouterr().err and identity(out / "summary.json") != first
    first = identity(out / "summary.json")
    assert main([*args, "--set", "train.lr=0.0002"]) == 0 and identity(out / "summary.json") == first
    digest = cell.source_digest
    monkeypatch.setattr(cell, "source_digest", lambda: "other")  # other code runs
    assert main([*args, "--set", "train.lr=0.0002"]) == 0
    assert "ran other code" in capsys.readouterr().err and identity(out / "summary.json") != first
    monkeypatch.setattr(cell, "source_digest", digest)
    # the manifest job (or the end of the snakemake that ran the job): Snakemake recorded the job's end
    other = Path(sweep.journal(sweep.single_runs[1]))
    other.write_text(json.dumps({"code": "x", "runs": {}}))  # a run of it did not end: its rerun runs it
    assert main(args) == 0
    first = identity(out / "summary.json")
    sweep.forget_attempts()
    assert not journal.exists() and other.exists()
    assert main(args) == 0  # a forced rerun: the run runs again
    assert "kept:" not in capsys.readouterr().err and identity(out / "summary.json") != first


@pytest.mark.parametrize("verb", ["cell", "run"])
def test_the_temporaries_a_killed_job_left_of_its_markers_and_journal_go(tmp_path, capsys, verb):
    """A job killed (SIGKILL) while it wrote a run's marker or its journal left that file's temporary beside it,
    where nothing claims the folder (the workflow's results/done and results/cells): every later attempt added
    one. The next write of the file removes those of ended processes (one whose PID this process was given
    again, as a fresh container gives its few PIDs, included); a live process's stays."""
    out, done, journal = tmp_path / "a", tmp_path / "done" / "a.json", tmp_path / "jobs.progress.json"
    done.parent.mkdir()
    with running_process() as live:
        stale = [atomic_path(done, ENDED_PID), atomic_path(journal, ENDED_PID + 1), atomic_path(done, os.getpid()),
                 atomic_path(journal, os.getpid())]
        alive = [atomic_path(done, live), atomic_path(journal, live)]
        for path in stale + alive:
            path.write_text("{")
        if verb == "cell":
            argv = ["cell", "--resume", "--keep-journal", str(job_file(tmp_path, [{**run(out), "done": str(done)}]))]
        else:
            argv = ["run", *[a for o in TINY for a in ("--set", o)], "--out", str(out), "--done", str(done),
                    "--journal", str(journal)]
        assert main(argv) == 0
    assert json.loads(done.read_text()) == {"out": str(out), "status": "ok"}
    assert json.loads(journal.read_text())["runs"][str(out)]["status"] == "ok"
    assert not any(path.exists() for path in stale) and all(path.exists() for path in alive)


def test_a_cell_stops_at_a_run_another_process_writes(tmp_path, capsys):
    """`kill -9` of snakemake leaves its cell job running; a rerun's job for the same cell found the earlier
    attempt's current run locked, failed it and went on to the next runs, which the earlier attempt then also
    ran (each overwriting the other's journal). It stops there instead: the runs after it are left to the
    attempt that holds the lock, and the job fails in one line naming the folder."""
    from agg_bench.outdir import Claim

    runs = [{**run(tmp_path / name, f"seed={seed}"), "done": str(tmp_path / "done" / f"{name}.json")}
            for name, seed in (("a", 0), ("b", 1), ("c", 2))]
    path = job_file(tmp_path, runs)
    with Claim(tmp_path / "b", folder=True, lock_inside=True).acquire():  # the earlier attempt, writing b
        assert main(["cell", "--keep-going", "--resume", "--keep-journal", str(path)]) == 2
    err = capsys.readouterr().err
    assert f"run 3 not started: another process writes {tmp_path / 'b'} (an earlier attempt of this job still " \
        "running?); run the job again once it has ended" in err, err
    assert json.loads((tmp_path / "a" / "summary.json").read_text())["status"] == "ok"
    assert not (tmp_path / "b" / "summary.json").exists() and not (tmp_path / "c").exists()
    assert not (tmp_path / "done").exists()


@pytest.mark.parametrize("verb", ["cell", "run"])
def test_a_marker_another_job_holds_is_refused_before_any_run(tmp_path, capsys, verb):
    """Two jobs that name one marker (two cell job files, two `agg-bench run --done`) both ran, and the one that
    ended last replaced the other's marker with its own: the first run's end was lost. The marker is held for the
    job's life, so the second is refused in one line naming the holder, and writes nothing."""
    from agg_bench.outdir import Claim

    out, done = tmp_path / "a", tmp_path / "done" / "a.json"
    if verb == "cell":
        argv = ["cell", "--keep-going", "--resume", "--keep-journal",
                str(job_file(tmp_path, [{**run(out), "done": str(done)}]))]
    else:
        argv = ["run", *[a for o in TINY for a in ("--set", o)], "--out", str(out), "--done", str(done)]
    with Claim(done, folder=False, lock_inside=False).acquire():  # another job's, writing this marker
        assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"{done}: another agg-bench process (PID {os.getpid()}) is writing this file" in err, err
    assert len(err.strip().splitlines()) == 1, err
    assert not out.exists() and not done.exists()


def test_a_journal_that_another_job_made_its_marker_meanwhile_is_not_replaced(tmp_path, capsys, monkeypatch):
    """`agg-bench run --journal F` while another job has `--done F`: the journal was checked when the run started,
    and the marker the other job wrote there while this run trained was then replaced by this run's journal (the
    other run's end lost). The journal is checked again under its lock: one line, exit 2, the marker kept."""
    out, journal = tmp_path / "a", tmp_path / "shared.json"
    marker = {"out": str(tmp_path / "other"), "status": "ok"}

    def other_job_ends_meanwhile(cfg, folder, **kwargs):
        journal.write_text(json.dumps(marker))
        return {"status": "ok"}

    monkeypatch.setattr(train_module, "train", other_job_ends_meanwhile)
    argv = ["run", *[a for o in TINY for a in ("--set", o)], "--out", str(out), "--journal", str(journal)]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"agg-bench run: --journal {journal}: the file exists and is not a cell job's journal; give a new "
                   "path"), err
    assert json.loads(journal.read_text()) == marker


@pytest.mark.parametrize("change, words", [
    ("config", []),  # the job file now asks another config of a: it runs (--overwrite replaces the old one)
    ("code", ["ran other code"]),
    ("records", []),  # a's metrics.jsonl is gone
    ("summary", []),  # a's summary says another status than the journal
])
def test_a_run_is_kept_only_as_the_journal_recorded_it(tmp_path, capsys, monkeypatch, change, words):
    from agg_bench.runtime import cell

    runs = [run(tmp_path / "a"), run(tmp_path / "b", "seed=9")]
    path = job_file(tmp_path, runs)
    with interrupted_updates(lambda session: session.cfg.seed == 9):
        assert main(["cell", "--resume", str(path)]) == 130
    first = identity(tmp_path / "a" / "summary.json")
    if change == "config":
        path = job_file(tmp_path, [run(tmp_path / "a", "train.lr=0.0002"), runs[1]])
    elif change == "code":
        monkeypatch.setattr(cell, "source_digest", lambda: "other")
    elif change == "records":
        (tmp_path / "a" / "metrics.jsonl").unlink()
    elif change == "summary":
        summary = json.loads((tmp_path / "a" / "summary.json").read_text())
        (tmp_path / "a" / "summary.json").write_text(json.dumps({**summary, "status": "oom"}))
        first = identity(tmp_path / "a" / "summary.json")
    capsys.readouterr()
    assert main(["cell", "--resume", "--overwrite", str(path)]) == 0
    err = capsys.readouterr().err
    assert "kept: it ended" not in err and f"run 1/2 {tmp_path / 'a'} started" in err, err
    assert identity(tmp_path / "a" / "summary.json") != first
    assert json.loads((tmp_path / "a" / "summary.json").read_text())["status"] == "ok"
    for word in words:
        assert word in err, err
    if change == "config":
        assert json.loads((tmp_path / "a" / "config.json").read_text())["train"]["lr"] == 0.0002


@pytest.mark.parametrize("raised, status", [(KeyboardInterrupt, "interrupted"), (SystemExit, "error")])
def test_a_run_stopped_by_another_base_exception_is_not_ok(tmp_path, monkeypatch, raised, status):
    """A KeyboardInterrupt that the signal handlers did not raise (train() called from other code) or a
    SystemExit in an iteration: the run's summary said ``ok`` for a run with one record of two."""
    def stopped(self, batch):
        raise raised

    monkeypatch.setattr(train_module.Session, "update", stopped)
    with pytest.raises(raised):
        train_module.train(load_config(None, TINY), tmp_path / "a")
    summary = json.loads((tmp_path / "a" / "summary.json").read_text())
    assert summary["status"] == status and summary["error"].startswith(f"stopped by {raised.__name__}")


def test_a_resumed_cell_continues_the_run_the_stop_cut_short_from_its_checkpoint(tmp_path, capsys):
    """The run a stopped cell was running continues from its last checkpoint in the next attempt (the same
    config and code), instead of starting over; a run that ended is kept, as the journal says."""
    every = ["train.iterations=3", "train.checkpoint_every=1"]
    path = job_file(tmp_path, [run(tmp_path / "a", *every), run(tmp_path / "b", *every, "seed=9")])
    with interrupted_updates(lambda session: session.cfg.seed == 9 and session.policy.version == 2):
        assert main(["cell", "--resume", str(path)]) == 130
    assert json.loads((tmp_path / "b" / "summary.json").read_text())["status"] == "interrupted"
    capsys.readouterr()
    assert main(["cell", "--resume", str(path)]) == 0
    err = capsys.readouterr().err
    assert f"run 1/2 {tmp_path / 'a'} kept: it ended ok" in err and "continuing the stopped attempt" in err
    b = json.loads((tmp_path / "b" / "summary.json").read_text())
    assert (b["status"], b["resumed_from"]) == ("ok", 1)
    assert [r["iteration"] for r in read_jsonl(tmp_path / "b" / "metrics.jsonl")] == [0, 1, 2]
    # the same records, but for timings, as the run never stopped
    assert main(["cell", str(job_file(tmp_path, [run(tmp_path / "whole", *every, "seed=9")]))]) == 0
    expected = [{**pinned_fields(r), "run_id": "b"} for r in read_jsonl(tmp_path / "whole" / "metrics.jsonl")]
    actual = [pinned_fields(r) for r in read_jsonl(tmp_path / "b" / "metrics.jsonl")]
    assert not differences(expected, actual, "b"), differences(expected, actual, "b")


def test_a_cell_journal_error_names_the_cell_journal_not_an_option(tmp_path):
    """A cell's journal comes from its job file, not from an option: an error recording into it (its lock is a
    symbolic link) names the job file's journal; `agg-bench run --journal` names its option."""
    from agg_bench.errors import UserError
    from agg_bench.outdir import LOCK_SUFFIX
    from agg_bench.runtime.cell import CellRun, Journal

    jobs = tmp_path / "jobs.json"
    for progress, named in ((Journal.resume(jobs), f"{jobs}: its journal"),
                            (Journal.read(tmp_path / "mine.json", "agg-bench run", "--journal", "it runs"),
                             "--journal")):
        lock = progress.path.parent / f".{progress.path.name}{LOCK_SUFFIX}"
        lock.symlink_to(tmp_path / "elsewhere")
        job = CellRun(config=None, overrides=(), out=tmp_path / "run")
        with pytest.raises(UserError, match=f"^{re.escape(named)} {re.escape(str(progress.path))}: "):
            progress.add(job, load_config(None, ["model.resolution=32"]), "ok")


def test_an_attempt_that_records_nothing_removes_the_journal_temporaries_of_killed_writers(tmp_path):
    """An attempt that keeps every run, or whose runs all fail, adds nothing to its journal, which removed the
    temporaries killed writers of it left only when adding a run: reading the journal removes those of ended
    processes (a live writer's stays) and leaves no lock behind; a journal whose folder holds none claims nothing.
    An ended process's is also one whose PID this process has (PIDs are reused: a fresh container's are few);
    this process run's own temporary stays."""
    from agg_bench.outdir import LOCK_SUFFIX
    from agg_bench.runtime.cell import Journal

    jobs = tmp_path / "jobs.json"
    with running_process() as live:
        for journal in (Journal.path_of(jobs), tmp_path / "mine.json"):
            for pid in (ENDED_PID, os.getpid()):
                journal.write_text(json.dumps({"code": "other", "runs": {}}))
                stale, alive, mine = atomic_path(journal, pid), atomic_path(journal, live), atomic_path(journal)
                for path in (stale, alive, mine):
                    path.write_text("{")
                if journal == tmp_path / "mine.json":
                    Journal.read(journal, "agg-bench run", "--journal", "it runs")
                else:
                    Journal.resume(jobs)
                assert not stale.exists() and alive.exists() and mine.exists() and journal.exists()
                assert not (tmp_path / f".{journal.name}{LOCK_SUFFIX}").exists()
                alive.unlink()
                mine.unlink()
    Journal.read(tmp_path / "new" / "mine.json", "agg-bench run", "--journal", "it runs")
    assert not (tmp_path / "new").exists()


def test_the_runs_collect_their_garbage_past_a_frozen_import_heap_and_thaw_it_after(tmp_path, monkeypatch, capsys):
    """What exists once the engine is imported is frozen (gc.freeze) while the runs go, so a collection between
    runs walks only what they made; the heap is thawed when the cell ends, by an error too, and an object a run
    made and dropped in a reference cycle is still collected."""
    import gc
    import weakref

    seen = []

    class Cycle:
        pass

    def fake_train(cfg, out, **kwargs):
        seen.append(gc.get_freeze_count())
        made = Cycle()
        made.me = made  # freed by the collector only
        seen.append(weakref.ref(made))
        if len(seen) > 2:
            raise RuntimeError("a bug in a run")
        return {"status": "ok"}

    monkeypatch.setattr(train_module, "train", fake_train)
    path = job_file(tmp_path, [run(tmp_path / "a"), run(tmp_path / "b")])
    assert gc.get_freeze_count() == 0
    assert main(["cell", str(path)]) == 1  # the second run's bug
    assert seen[0] > 10_000 and seen[2] == seen[0]  # torch's and diffusers' objects, frozen during the runs
    assert seen[1]() is None  # the first run's cycle was collected before the second run
    assert gc.get_freeze_count() == 0
    capsys.readouterr()
