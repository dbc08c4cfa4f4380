"""`agg-bench profile`: traces, an operator table and the run's config and machine for one method."""
from __future__ import annotations

import contextlib
import csv
import gzip
import io
import json
import shutil
import warnings
from pathlib import Path

import pytest

from agg_bench.cli import main
from agg_bench.methods.base import available_methods

SMALL = ["--set", "model.resolution=32", "--set", "sampling.steps=4", "--set", "grpo.group_size=2",
         "--set", "grpo.prompts_per_iteration=1", "--set", "progress=false"]
# SMALL's profile of one denoising step (of one prompt's group), for the tests of what is written where and what a
# rerun leaves, and of the operators that do not depend on the steps: torch's parse of the profiler's events, most of
# a profile's cost, is about half SMALL's
ONE_STEP = [*SMALL, "--set", "sampling.steps=1"]


# the profile the tests that rerun into a folder start from: a train-phase profile of one active update after one
# waited one; the config file names another method with its own option, which --method replaces
FIRST = ["profile", "--method", "full", *ONE_STEP, "--phase", "train", "--wait", "1", "--warmup", "0", "--active", "1"]


@pytest.fixture(scope="module")
def profiled(tmp_path_factory) -> tuple[Path, dict]:
    """A folder FIRST wrote and the paths it printed (made once: profiling is costly; tests take a copy).
    FIRST's run (--warmup 0) prints nothing on stderr and warns of nothing: torch's warning about a schedule
    without warmup is not the run's."""
    folder = tmp_path_factory.mktemp("first")
    config = folder / "run.yaml"
    config.write_text("method:\n  name: window\n  window_size: 2\n")
    out = folder / "prof"
    printed, said = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(said), \
            warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")  # every warning recorded, as a run's stderr would show it
        assert main([*FIRST, "--config", str(config), "--out", str(out)]) == 0
    assert [f"{w.category.__name__}: {w.message}" for w in caught] == []
    assert "warn" not in said.getvalue().lower(), said.getvalue()
    return out, json.loads(printed.getvalue())


def earlier_profile(profiled: tuple[Path, dict], tmp_path: Path, capsys) -> Path:
    """A copy of ``profiled``'s folder at tmp_path/prof: the folder a profile left (its profile.json names the
    original's paths, which nothing reads back)."""
    capsys.readouterr()
    out = tmp_path / "prof"
    shutil.copytree(profiled[0], out)
    return out


def profile_an_empty_step(monkeypatch) -> None:
    """The profiler (its traces, operators.csv) runs around an empty step instead of the command's: for the tests of
    what is written where and what a rerun or a failed write leaves, not of what is recorded (the parse of a
    step's events is most of a profile's cost)."""
    from agg_bench.tools import profiling

    real = profiling.profile_steps
    monkeypatch.setattr(profiling, "profile_steps", lambda step, *args, **kwargs: real(lambda: None, *args, **kwargs))


def read_trace(path: Path) -> dict:
    opener = gzip.open if path.name.endswith(".gz") else open
    with opener(path, "rt") as handle:
        return json.load(handle)


def operator_calls(path: Path) -> dict[str, int]:
    """calls per operator name, summed over cycles"""
    calls: dict[str, int] = {}
    with open(path, newline="") as handle:
        for row in csv.DictReader(handle):
            calls[row["name"]] = calls.get(row["name"], 0) + int(row["calls"])
    return calls


def test_profile_train_phase_writes_trace_and_operator_table(profiled):
    out, written = profiled  # FIRST: a config file of another method, --method full, one waited and one active step

    traces = sorted(out.glob("*.pt.trace.json*"))
    assert [str(t) for t in traces] == [written["trace_0"]]  # one cycle, one trace
    events = read_trace(traces[0])["traceEvents"]
    assert any(e.get("name") == "train" for e in events)  # the annotated update

    calls = operator_calls(Path(written["operators"]))
    assert calls["train"] == 1  # the active step only: the waited one is not recorded
    assert "collect" not in calls  # the fixed rollout was collected before profiling
    assert any(name in calls for name in ("aten::mm", "aten::addmm", "aten::linear"))
    assert "memory_snapshot" not in written  # CUDA only

    assert json.loads((out / "config.json").read_text())["method"] == {"name": "full"}
    assert "torch" in json.loads((out / "env.json").read_text())
    manifest = json.loads((out / "profile.json").read_text())
    assert manifest["phase"] == "train" and manifest["wait"] == 1 and manifest["active"] == 1
    assert manifest["files"] == {k: v for k, v in written.items() if k != "out"}


@pytest.mark.skipif("agg" not in available_methods(), reason="the agg method is not registered")
def test_profile_iterations_of_a_method_with_options(tmp_path, capsys):
    out = tmp_path / "prof"
    # two denoising steps, the fewest AGG's window of 2 takes: what is checked is that both phases of one iteration
    # are profiled and the method's option recorded (the profiler's parse of its events is most of the cost)
    assert main(["profile", "--method", "agg", *SMALL, "--set", "sampling.steps=2", "--set", "train.plan=groups",
                 "--set", "train.plan_window=2", "--set", "method.window=2", "--wait", "0", "--warmup", "0",
                 "--active", "1", "--out", str(out)]) == 0
    written = json.loads(capsys.readouterr().out)
    assert Path(written["trace_0"]).is_file()
    calls = operator_calls(Path(written["operators"]))
    assert calls["collect"] == 1 and calls["train"] == 1
    assert json.loads((out / "config.json").read_text())["method"] == {"name": "agg", "window": 2}


@pytest.mark.parametrize("args, key", [
    (["--method", "full", "--active", "0"], "--active"),
    (["--method", "full", "--wait", "-1"], "--wait"),
    (["--method", "nope"], "method.name"),
    (["--method", "full", "--set", "method.window=3"], "method.window"),
    (["--method", "agg", "--set", "method.name=full"], "method.name"),  # full's profile, labelled agg's
    (["--method", "agg", "--set", "method={name: full}"], "method = "),
    # the override that made the method full, not the option of agg's full lacks (method.window)
    (["--method", "agg", "--set", "method.window=3", "--set", "method.name=full"], "method.name = 'full'"),
])
def test_profile_user_errors_are_one_line_and_exit_code_2(tmp_path, capsys, args, key):
    out = tmp_path / "prof"
    assert main(["profile", *SMALL, *args, "--out", str(out)]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("agg-bench profile:") and key in lines[0]
    assert not out.exists()  # nothing is written before the config is known to be good


def test_a_profile_run_again_replaces_the_earlier_one(tmp_path, capsys, monkeypatch, profiled):
    """A second profile into the same folder leaves its own traces only, those profile.json lists (the first
    run's trace was kept beside them), and a CUDA run's memory snapshot does not outlive a CPU rerun."""
    out = earlier_profile(profiled, tmp_path, capsys)
    profile_an_empty_step(monkeypatch)
    args = ["profile", "--method", "full", *ONE_STEP, "--phase", "train", "--wait", "0", "--warmup", "0",
            "--out", str(out)]
    first = str(out / Path(json.loads((out / "profile.json").read_text())["files"]["trace_0"]).name)
    assert Path(first).is_file()
    (out / "memory_snapshot.pickle").write_bytes(b"an earlier CUDA profile's")
    (out / "notes.txt").write_text("mine\n")
    assert main([*args, "--active", "1"]) == 2  # someone else's file: refused, nothing removed
    assert Path(first).is_file() and (out / "memory_snapshot.pickle").is_file()
    (out / "notes.txt").unlink()
    capsys.readouterr()
    assert main([*args, "--active", "1"]) == 0
    written = json.loads(capsys.readouterr().out)
    manifest = json.loads((out / "profile.json").read_text())
    assert sorted(str(p) for p in out.glob("*.pt.trace.json*")) == [written["trace_0"]] == [manifest["files"]["trace_0"]]
    assert written["trace_0"] != first and not (out / "memory_snapshot.pickle").exists()
    assert sorted(p.name for p in out.iterdir()) == sorted(["config.json", "env.json", "profile.json", "operators.csv",
                                                           Path(written["trace_0"]).name])


def test_a_profile_that_fails_leaves_the_earlier_profile_as_it_was(tmp_path, capsys, monkeypatch, profiled):
    """A rerun stopped (or failing) in its profiled steps leaves the folder describing the earlier profile:
    its config and machine beside its traces, and nothing of the rerun's."""
    import agg_bench.tools.profiling as profiling

    out = earlier_profile(profiled, tmp_path, capsys)
    args = ["profile", *SMALL, "--phase", "train", "--wait", "0", "--warmup", "0", "--active", "1", "--out", str(out)]
    before = {path.name: path.read_bytes() for path in out.iterdir()}

    def stopped(*_args, **_kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(profiling, "profile_steps", stopped)
    assert main([*args, "--method", "fraction"]) == 130
    assert {path.name: path.read_bytes() for path in out.iterdir()} == before


def test_a_profile_stopped_while_it_writes_leaves_the_earlier_profile_whole(tmp_path, monkeypatch, capsys,
                                                                            profiled):
    """A profile that stops while it writes (a kill, a full disk) tore the earlier profile's operators.csv and left
    its own traces beside the earlier profile.json, which a reader took for a whole profile of the earlier method.
    The profile is written beside --out and renamed over it when whole: the earlier folder stays as it was."""
    from agg_bench.tools import profiling

    out = earlier_profile(profiled, tmp_path, capsys)
    profile_an_empty_step(monkeypatch)
    # two denoising steps, the fewest AGG's window of 2 takes: what is checked is what a failed write leaves
    argv = ["profile", "--method", "full", *SMALL, "--set", "sampling.steps=2", "--phase", "train", "--wait", "0",
            "--warmup", "0", "--active", "1", "--out", str(out)]
    before = {p.name: p.read_bytes() for p in out.iterdir()}

    class FullDisk(csv.DictWriter):
        def writerow(self, row):
            raise OSError(28, "No space left on device")  # the header written, the first row not

    monkeypatch.setattr(profiling.csv, "DictWriter", FullDisk)
    assert main([*argv[:2], "agg", "--set", "method.window=2", *argv[3:]]) == 2  # a full disk: one line
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["prof"]  # nothing beside it either
