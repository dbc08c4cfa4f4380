"""Calibrations in a cell job's process (agg_bench/tools/cell_calibration.py): they time the methods on the model
the runs built, count the same work as `agg-bench calibrate`, leave out methods whose runs did not end ok, start
none that would end after the deadline, stop at a signal after their report, and a bad entry is one line, exit
code 2, nothing written."""
from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from agg_bench.cli import main
from agg_bench.errors import UserError
from agg_bench.runtime import cell as cell_module
from agg_bench.runtime.cell import run_cell
from agg_bench.tools import cell_calibration
from agg_bench.tools.cell_calibration import CALIBRATION_OVERHEAD, NOT_TIMED, read_calibrations, run_calibrations
from helpers import watched_model_reuse

TINY = ["model.preset=tiny", "model.resolution=32", "train.iterations=2", "sampling.steps=6", "grpo.group_size=2",
        "grpo.prompts_per_iteration=1", "progress=false", "model.dtype=float64"]
METHODS = {"full": {"method": {"name": "full"}}, "agg": {"method": {"name": "agg", "window": 3}},
           "fraction": {"method": {"name": "full"}, "train": {"timestep_fraction": 0.5}}}
OPTIONS = {"repeats": 2, "warmup": 1, "method_repeats": 2}


def run(out: Path, label: str) -> dict:
    method = METHODS[label]["method"]
    sets = [f"method={json.dumps(method)}"]
    if label == "fraction":
        sets.append("train.timestep_fraction=0.5")
    return {"config": None, "set": [*TINY, *sets], "out": str(out)}


def calibration(tmp: Path, name: str, labels, runs=None, **extra) -> dict:
    entry = {"config": None, "set": TINY, "methods": {label: METHODS[label] for label in labels}, "options": OPTIONS,
             "out": str(tmp / f"{name}.json"), "report": str(tmp / f"{name}.report.json"), **extra}
    if runs is not None:
        entry["runs"] = {label: str(folder) for label, folder in runs.items()}
    return entry


def job(tmp: Path, runs: list, calibrations: list) -> Path:
    path = tmp / "jobs.json"
    path.write_text(json.dumps({"runs": runs, "calibrations": calibrations}))
    return path


def report(entry: dict) -> dict:
    return json.loads(Path(entry["report"]).read_text())


def test_a_cells_calibration_times_its_methods_on_the_model_its_runs_built(tmp_path, monkeypatch, capsys):
    """Two runs, then a calibration of their methods in the same process: one model built for all three, and the
    calibration counts, method by method, the passes that `agg-bench calibrate` counts in a process of its own."""
    reuses = watched_model_reuse(monkeypatch)
    reads = []  # the job file's runs and calibrations come from one reading of it
    read = cell_module.read_json_object
    monkeypatch.setattr(cell_module, "read_json_object", lambda file, *a: reads.append(Path(file)) or read(file, *a))
    folders = {label: tmp_path / "runs" / label for label in ("full", "agg")}
    entry = calibration(tmp_path, "cal", ["full", "agg"], folders)
    path = job(tmp_path, [run(folder, label) for label, folder in folders.items()], [entry])
    assert main(["cell", str(path)]) == 0
    assert [reuse.builds for reuse in reuses] == [1]
    assert reads.count(path) == 1
    together = json.loads(Path(entry["out"]).read_text())
    assert report(entry) == {"out": entry["out"], "methods": ["full", "agg"], "exit_code": 0, "ended": "finished",
                             "seconds": report(entry)["seconds"]}
    assert list(together["methods"]) == ["full", "agg"]
    assert all(len(timed["cpu_s"]) == OPTIONS["method_repeats"] for timed in together["methods"].values())

    alone = tmp_path / "alone.json"
    argv = ["calibrate", *[a for s in TINY for a in ("--set", s)], "--repeats", "2", "--warmup", "1",
            "--method-repeats", "2", *[a for label in ("full", "agg") for a in ("--method", label,
                                                                               json.dumps(METHODS[label]))],
            "--out", str(alone)]
    assert main(argv) == 0
    apart = json.loads(alone.read_text())
    for label in ("full", "agg"):
        for key in ("passes", "calls", "optimizer_steps", "rollout_passes", "rollout_calls", "rollout_forwards"):
            assert together["methods"][label][key] == apart["methods"][label][key], (label, key)
    assert {k for k in together if k != "env"} == {k for k in apart if k != "env"}
    capsys.readouterr()

    # a job of calibrations only: the cell builds the model for them
    only = calibration(tmp_path, "only", ["full"])
    assert main(["cell", str(job(tmp_path, [], [only]))]) == 0
    assert list(json.loads(Path(only["out"]).read_text())["methods"]) == ["full"]


def fake_measure(calls: list, write: bool = True):
    def measure(item, labels):
        calls.append(list(labels))
        if write:
            item.out.write_text(json.dumps({"unit_s_per_sample": {"x": 1}, "methods": {m: {} for m in labels}}))
    return measure


def test_a_method_whose_run_did_not_end_ok_is_not_timed(tmp_path):
    """Methods whose runs in this job ended otherwise than ok, or never started, are left out; a method whose run
    is not in this job is timed; an entry left without its baseline, or with the baseline alone, is not started."""
    runs = {label: tmp_path / "runs" / label for label in ("full", "agg", "fraction")}
    elsewhere = tmp_path / "earlier" / "agg"
    entries = [calibration(tmp_path, "a", ["full", "agg", "fraction"], runs),
               calibration(tmp_path, "b", ["full", "agg"], {"full": runs["full"], "agg": elsewhere}),
               calibration(tmp_path, "c", ["full"], {"full": runs["full"]})]
    path = job(tmp_path, [run(folder, label) for label, folder in runs.items()], entries)
    items = read_calibrations(path, list(runs.values()))
    calls: list = []
    ended = {runs["full"]: "ok", runs["agg"]: "oom"}  # fraction: not started
    assert run_calibrations(items, list(runs.values()), ended, None, ["agg-bench"], fake_measure(calls)) == 0
    assert calls == [["full", "agg"], ["full"]]
    assert report(entries[0])["ended"] == NOT_TIMED and report(entries[0])["methods"] == ["full"]
    assert report(entries[1])["ended"] == "finished" and report(entries[2])["ended"] == "finished"

    calls.clear()
    for entry in entries:
        Path(entry["report"]).unlink()
    ended = {runs["full"]: "diverged", runs["agg"]: "ok", runs["fraction"]: "ok"}  # the baseline's run did not
    assert run_calibrations(items, list(runs.values()), ended, None, ["agg-bench"], fake_measure(calls)) == 0
    assert calls == [] and {report(e)["ended"] for e in entries} == {NOT_TIMED}


def test_a_calibration_that_would_end_after_the_deadline_is_not_started(tmp_path):
    """Seconds per method times the methods, else the runs' rounds (warm-up and timed, each a rollout and a train
    phase: the medians after the first iteration) times CALIBRATION_OVERHEAD: an entry that would end after the
    deadline is not started, nor any after it; one that fits is."""
    runs = {label: tmp_path / "runs" / label for label in ("full", "agg")}
    for folder in runs.values():
        folder.mkdir(parents=True)
        rows = [(1e6, 1e6), (1.0, 2.0), (3.0, 4.0), (5.0, 6.0)]  # a warm-up, then medians 3 + 4
        (folder / "metrics.jsonl").write_text("".join(json.dumps({"iteration": i, "t_rollout_s": r, "t_train_s": t})
                                                      + "\n" for i, (r, t) in enumerate(rows)))
    rounds = OPTIONS["warmup"] + OPTIONS["method_repeats"]
    expected = CALIBRATION_OVERHEAD * rounds * 2 * (3.0 + 4.0)
    assert cell_calibration.estimate(runs, rounds, ["full", "agg"], None) == pytest.approx(expected)
    assert cell_calibration.estimate(runs, rounds, ["full", "agg"], 10.0) == 20.0
    assert cell_calibration.estimate({"full": runs["full"]}, rounds, ["full", "agg"], None) is None

    for per, deadline_in, started in ((None, expected - 5, False), (None, expected + 60, True),
                                      (100.0, 150.0, False), (100.0, 260.0, True)):
        entries = [calibration(tmp_path, f"e{i}", ["full", "agg"], runs, per_method_s=per) for i in range(2)]
        path = job(tmp_path, [], entries)
        items = read_calibrations(path, [])
        calls: list = []
        for entry in entries:
            Path(entry["report"]).unlink(missing_ok=True)
            Path(entry["out"]).unlink(missing_ok=True)
        assert run_calibrations(items, [], {}, time.time() + deadline_in, ["agg-bench"], fake_measure(calls)) == 0
        assert bool(calls) == started
        if not started:
            about = per * 2 if per is not None else expected
            assert [report(e)["ended"] for e in entries] == \
                [f"not started: about {about:.0f} s, more than the time left before the deadline"] * 2
    past = [calibration(tmp_path, "past", ["full"])]
    items = read_calibrations(job(tmp_path, [], past), [])
    assert run_calibrations(items, [], {}, time.time() - 1, ["agg-bench"], fake_measure([])) == 0
    assert report(past[0])["ended"] == "not started: the deadline had passed"


def test_a_failed_or_interrupted_calibration_writes_no_file_and_a_signal_stops_the_cell(tmp_path, capsys):
    entries = [calibration(tmp_path, f"e{i}", ["full"]) for i in range(3)]
    items = read_calibrations(job(tmp_path, [], entries), [])

    def measure(item, labels):
        if item.out.name == "e0.json":
            raise UserError("no such thing")
        raise KeyboardInterrupt

    assert run_calibrations(items, [], {}, None, ["agg-bench"], measure) == 130
    assert [report(entries[0])["ended"], report(entries[1])["ended"]] == ["failed", "interrupted"]
    assert [report(entries[0])["exit_code"], report(entries[1])["exit_code"]] == [2, 130]
    assert not Path(entries[2]["report"]).exists()  # never reached
    assert not any(Path(e["out"]).exists() for e in entries)
    assert "no such thing" in capsys.readouterr().err


def test_a_job_with_calibrations_is_refused_where_nothing_takes_them(tmp_path):
    path = job(tmp_path, [run(tmp_path / "r", "full")], [calibration(tmp_path, "c", ["full"])])
    with pytest.raises(UserError, match="unknown key 'calibrations'"):
        run_cell(path)
    assert not (tmp_path / "r").exists()


BAD = [
    ({"bogus": 1}, "unknown key 'bogus'"),
    ({"methods": []}, "calibrations[0].methods is a list"),
    ({"methods": {}}, "calibrations[0].methods is an empty object; expected an object of one or more"),
    ({"methods": {"x": {"method": {"name": "no-such-method"}}}}, "calibrations[0]: --method x:"),
    ({"methods": {"x\n": {"method": {"name": "full"}}}}, "label 'x\\n'"),
    ({"methods": {"x": {"train": {"lr": 1}}}}, "names the method"),
    ({"per_method_s": -1}, "per_method_s is -1; expected seconds"),
    ({"per_method_s": "nan"}, "per_method_s is 'nan'"),
    ({"per_method_s": float("nan")}, "jobs.json: is not JSON (NaN"),  # the reader refuses it
    ({"per_method_s": 1e400}, "jobs.json: is not JSON (Infinity"),
    ({"per_method_s": 10**400}, "per_method_s is 1000"),
    ({"per_method_s": True}, "per_method_s is True"),
    ({"options": {"repeats": 0}}, "calibrate.repeats = 0: expected an integer from 1"),
    ({"options": {"rounds": 3}}, "options: unknown key 'rounds' (allowed: repeats, warmup, method_repeats)"),
    ({"options": [2]}, "options is a list; expected an object of repeats"),
    ({"runs": {"other": "x"}}, "runs: 'other' is not one of the methods ('full')"),
    ({"runs": {"full": 3}}, "runs.full is a number; expected the method's run folder"),
    ({"runs": "x"}, "runs is a string; expected an object of the methods' labels"),
    ({"set": "model.preset=tiny"}, "set is a string; expected a list of KEY=VALUE"),
    ({"set": ["model.preset=tiny", None]}, "calibrations[0].set[1] is null; expected a KEY=VALUE string"),
    ({"set": [*TINY, "train.lr=-1"]}, "train.lr"),
    ({"out": ""}, "calibrations[0].out '': an empty path, which names the current folder"),
    ({"report": None}, "report is null; expected a file"),
]


@pytest.mark.parametrize("change, words", BAD, ids=[str(i) for i in range(len(BAD))])
def test_a_bad_calibration_entry_is_one_line_and_nothing_is_written(tmp_path, capsys, change, words):
    entry = {**calibration(tmp_path, "c", ["full"]), **change}
    path = job(tmp_path, [run(tmp_path / "r", "full")], [entry])
    assert main(["cell", str(path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and words in err[0], err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["jobs.json"]


@pytest.mark.parametrize("where", ["inside a run", "the same file", "someone's file"])
def test_calibration_files_apart_from_the_runs_and_someone_elses_files(tmp_path, capsys, where):
    entry = calibration(tmp_path, "c", ["full"])
    if where == "inside a run":
        entry["out"] = str(tmp_path / "r" / "c.json")
        words = "is inside a run folder of the job"
    elif where == "the same file":
        entry["report"] = entry["out"]
        words = "calibrations[0].report"
    else:
        Path(entry["report"]).write_text("{\"mine\": 1}")
        words = "the file exists and is not a calibration's report"
    path = job(tmp_path, [run(tmp_path / "r", "full")], [entry])
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    assert main(["cell", str(path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and words in err[0], err
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before


def _in_a_file(tmp: Path, entry: dict) -> None:
    (tmp / "file").write_text("mine")
    entry["report"] = str(tmp / "file" / "c.report.json")


# (what, edit(tmp, the job's run, the entry), words): places a calibration's files cannot take, or no path at all.
# Each was refused only once the runs had run, or never (the report replaced the run's marker, or the cell's
# journal), or was a traceback (exit code 1).
PLACES = [
    ("a folder around a run", lambda tmp, r, e: e.update(report=str(Path(r["out"]).parent)),
     "a run folder of the job is inside it"),
    ("a run's marker", lambda tmp, r, e: r.update(done=e["report"]), "is also " + "{path}: runs[0].done"),
    ("the job's journal", lambda tmp, r, e: e.update(out=str(tmp / "jobs.progress.json")),
     "is also the job's journal"),
    ("in a file", lambda tmp, r, e: _in_a_file(tmp, e), "file is not a folder"),
    ("where no file can be made", lambda tmp, r, e: e.update(out="/proc/agg-bench/c.json"), "cannot write in /proc"),
    ("a NUL character", lambda tmp, r, e: e.update(report=str(tmp / "c\0.json")),
     "calibrations[0].report '{tmp}/c\\x00.json': holds a NUL character"),
    ("a lone surrogate", lambda tmp, r, e: e.update(runs={"full": str(tmp / "\ud800")}),
     "calibrations[0].runs.full '{tmp}/\\ud800': holds a character that has no bytes in a file name"),
    ("a long name", lambda tmp, r, e: e.update(config="c" * 300), "calibrations[0].config 'ccc"),
    ("a run's long name", lambda tmp, r, e: r.update(out=str(tmp / ("r" * 300))), "runs[0].out '"),
    ("a run's marker's NUL", lambda tmp, r, e: r.update(done="d\0"), "runs[0].done 'd\\x00': holds a NUL"),
    # an empty path (the current folder) was said to be "a string"
    ("an empty report", lambda tmp, r, e: e.update(report=""),
     "calibrations[0].report '': an empty path, which names the current folder; expected a file or folder name"),
    ("an empty config", lambda tmp, r, e: e.update(config=""), "calibrations[0].config '': an empty path"),
    ("an empty run folder", lambda tmp, r, e: e.update(runs={"full": ""}), "calibrations[0].runs.full '': an empty"),
    # written after the runs as a calibration no report or workflow reads: agg-bench calibrate --out's rule
    ("another suffix", lambda tmp, r, e: e.update(out=str(tmp / "c.txt")),
     "calibrations[0].out {tmp}/c.txt: expected a FILE.json path"),
]


@pytest.mark.parametrize("edit, words", [place[1:] for place in PLACES], ids=[place[0] for place in PLACES])
def test_a_calibration_file_where_none_can_be_written_is_refused_before_the_runs(tmp_path, capsys, edit, words):
    entry = calibration(tmp_path, "c", ["full"])
    first = run(tmp_path / "runs" / "r", "full")
    edit(tmp_path, first, entry)
    path = job(tmp_path, [first], [entry])
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.is_file()}
    assert main(["cell", str(path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and words.format(path=path, tmp=tmp_path) in err[0], err
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before


def test_a_cell_whose_last_run_another_process_writes_takes_no_calibration(tmp_path, capsys):
    """A busy last run stopped the runs but not the calibrations: an earlier attempt of the job, still running,
    found its calibration taken or its report replaced. The cell stops there, as at a busy run before the last."""
    from agg_bench.outdir import Claim

    entry = calibration(tmp_path, "c", ["full"])  # of no run of the job: it would be timed
    path = job(tmp_path, [run(tmp_path / "r", "full")], [entry])
    with Claim(tmp_path / "r", folder=True, lock_inside=True).acquire():  # the earlier attempt, writing r
        assert main(["cell", str(path)]) == 2
    assert "calibration" not in capsys.readouterr().err
    assert not Path(entry["report"]).exists() and not Path(entry["out"]).exists()
