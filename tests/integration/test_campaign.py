"""The H200 campaign (config/h200.yaml, agg_bench/tools/campaign.py, scripts/gpu_campaign.sh) on the CPU, so that
it cannot rot: one short window of its --cpu form stops before its deadline and packs only finished runs, most
valuable first; its archive unpacks into a reference whose tables regenerate byte for byte; the next window
starts where it stopped; an archive that is not a window's, or a bad option, is one line and exit code 2 with
the reference untouched."""
from __future__ import annotations

import contextlib
import fcntl
import gzip
import io
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import time
import types
from pathlib import Path

import pandas as pd
import pytest
import torch
import yaml

from agg_bench.cli import main
from agg_bench.errors import UserError
from agg_bench.io import atomic_path
from agg_bench.tools import campaign as campaign_module
from agg_bench.tools import cell_calibration
from agg_bench.tools import archive as archive_module
from agg_bench.tools.archive import tiny_counterpart
from agg_bench.tools.campaign import Campaign, cpu_resolution
from agg_bench.tools.sweep import CACHE_DIR, SweepError
from helpers import ENDED_PID, Holder, bash_script, exit_code, not_hung, running_process, watched_model_reuse

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "config" / "h200.yaml"
SCRIPT = ROOT / "scripts" / "gpu_campaign.sh"
# A window stops its processes STOP_MARGIN_S (20 s) before its deadline; before that, the script's checks, the
# campaign's start and the cell process's (torch, the model) take 10 s on a quiet machine and 15 s or more under
# the suite's load: at 0.6 minutes (16 s to the stop) a loaded run finished no run and took a second window of
# 1.2 minutes, 108 s in all; 0.75 (25 s to the stop) finishes the first process's runs in one window.
MINUTES = 0.75
PRIORITY_FIRST = ["full", "agg-w5-sigma", "agg-w5-sigma-reuse"]  # config/h200.yaml's first selector


def script_env(tmp: Path, **extra: str) -> dict:
    return {**os.environ, "PYTHON": sys.executable, "OMP_NUM_THREADS": "1", "AGG_BENCH_CAMPAIGN_OUT": str(tmp / "work"),
            "AGG_BENCH_CAMPAIGN_REFERENCE": str(tmp / "reference"), **extra}


def tree(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()} \
        if folder.exists() else {}


@pytest.fixture(scope="module")
def window(tmp_path_factory, cpu_campaign):
    """One window of the --cpu campaign through the script, then its archive unpacked into a reference. A window
    that finished no run (a machine so busy that the first run outlasts MINUTES) is taken again, twice as long,
    in a fresh folder: the tests below need a run in the archive, and the deadline is the window's own.
    ``cpu_campaign`` first: its methods check is kept in the repository's .snakemake/, where the window's campaign
    process reads it, so that no child process of that check eats into the window's clock (on a fresh clone a
    busy machine then finished no run in the first window, and the next one ran twice as long)."""
    for minutes in (MINUTES, 2 * MINUTES, 4 * MINUTES):
        tmp = tmp_path_factory.mktemp("campaign")
        began = time.monotonic()
        proc = subprocess.run(["bash", str(SCRIPT), "--cpu", "--minutes", str(minutes)], cwd=tmp,
                              env=script_env(tmp), capture_output=True, text=True, timeout=600)
        seconds = time.monotonic() - began
        assert proc.returncode == 0, proc.stderr[-3000:]
        if json.loads(proc.stdout)["finished"]:
            break
    archive = tmp / "work" / "campaign.tar.gz"
    reference = tmp / "reference"
    printed, told = io.StringIO(), io.StringIO()  # in this process: a fresh interpreter would import torch again
    with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(told):
        code = main(["campaign", "unpack", "--config", str(CONFIG), "--cpu", "--archive", str(archive),
                     "--reference", str(reference)])
    assert code == 0, told.getvalue()[-3000:]
    return {"tmp": tmp, "minutes": minutes, "seconds": seconds, "out": json.loads(proc.stdout), "archive": archive,
            "reference": reference, "unpacked": json.loads(printed.getvalue())}


@pytest.fixture(scope="module")
def cpu_campaign():
    return Campaign(CONFIG, cpu=True)


@pytest.mark.slow
def test_a_window_stops_before_its_deadline_and_packs_only_finished_runs(window, cpu_campaign):
    # stopped cleanly before the deadline (start-up and packing included)
    assert window["seconds"] <= window["minutes"] * 60 + 10
    [log_file] = (window["tmp"] / "work" / "windows").glob("*.json")
    log = json.loads(log_file.read_text())
    finished = log["finished_in_window"]
    assert finished and len(finished) == window["out"]["finished"]
    # the most valuable runs first: the first selector's methods on the first cell, in one process
    first = log["processes"][0]
    runs = cpu_campaign.sweep.runs
    assert [runs[r]["method"] for r in first["runs"][:3]] == PRIORITY_FIRST
    assert len({cpu_campaign.cell_of(runs[r]) for r in first["runs"]}) == 1
    # the archive holds exactly the finished runs (whole, no checkpoint) and the window's own files
    with tarfile.open(window["archive"]) as tar:
        names = tar.getnames()
    archived = {name.split("/")[1] for name in names if name.startswith("runs/")}
    assert archived == set(finished)
    assert all(name.split("/")[-1] in archive_module.RUN_FILES for name in names if name.startswith("runs/"))
    for run_id in archived:
        assert {"config.json", "metrics.jsonl", "summary.json", "env.json"} <= \
            {n.split("/")[2] for n in names if n.startswith(f"runs/{run_id}/")}
    # a run the deadline cut off left nothing in the archive
    attempted = {r for p in log["processes"] for r in p.get("runs", [])}
    for run_id in attempted - set(finished):
        assert not any(name.startswith(f"runs/{run_id}/") for name in names)
    assert f"windows/{log_file.name}" in names
    assert log["left"] == len(runs) - len(finished)


@pytest.mark.slow
def test_the_reference_regenerates_its_tables_and_the_next_window_resumes(window, cpu_campaign, tmp_path):
    reference = window["reference"]
    [log_file] = (window["tmp"] / "work" / "windows").glob("*.json")
    finished = json.loads(log_file.read_text())["finished_in_window"]
    assert sorted(window["unpacked"]["runs_added"]) == sorted(finished)
    manifest = json.loads((reference / "manifest.json").read_text())
    assert {e["source"] for e in manifest["runs"] + manifest["calibration"]} == {"reference"}
    assert len(manifest["runs"]) == len(finished)
    # `agg-bench report` on the reference regenerates its committed tables byte for byte
    assert main(["report", "--manifest", str(reference / "manifest.json"), "--tables", str(tmp_path / "t")]) == 0
    assert tree(tmp_path / "t") == tree(reference / "tables")
    summary = pd.read_csv(reference / "tables" / "summary.csv")
    assert set(summary["hardware"]) == {"cpu (reference)"} and set(summary["source"]) == {"reference"}
    # a second unpack of the same archive changes nothing
    before = tree(reference)
    assert main(["campaign", "unpack", "--config", str(CONFIG), "--cpu", "--archive", str(window["archive"]),
                 "--reference", str(reference)]) == 0
    assert tree(reference) == before
    # the next window (any machine, a new work folder) starts with what the reference lacks
    done = cpu_campaign.done(reference)
    assert done == set(finished)
    processes = cpu_campaign.processes(done)
    order = [r for r in cpu_campaign.order() if r not in done]
    assert [r for p in processes for r in p.run_ids] == order and not done & set(order)


def test_processes_follow_the_priority_cell_by_cell(cpu_campaign):
    runs = cpu_campaign.sweep.runs
    processes = cpu_campaign.processes(set())
    assert sum(len(p.run_ids) for p in processes) == len(runs)
    first, second = processes[0], processes[1]
    assert (first.cell, [runs[r]["method"] for r in first.run_ids][:3]) == (f"sd35m_{cpu_resolution(1024)}px_cpu",
                                                                            PRIORITY_FIRST)
    assert second.cell == f"sd35m_{cpu_resolution(512)}px_cpu"
    # every run of a process shares its cell, and consecutive processes differ in cell
    for p in processes:
        assert {cpu_campaign.cell_of(runs[r]) for r in p.run_ids} == {p.cell}
    assert all(a.cell != b.cell for a, b in zip(processes, processes[1:]))


def test_the_cpu_form_keeps_every_run_of_the_h200_sweep():
    gpu, cpu = Campaign(CONFIG), Campaign(CONFIG, cpu=True)

    def key(run):
        return run["method"], run["model"], cpu_resolution(run["resolution"])

    assert sorted(key(r) for r in gpu.sweep.runs.values()) == sorted(
        (r["method"], r["model"], r["resolution"]) for r in cpu.sweep.runs.values())
    # the GPU form: one GPU, every model x resolution one process
    assert {r["device"] for r in gpu.sweep.runs.values()} == {"h200"} and not gpu.sweep.single_runs
    # a full-size run's tiny counterpart keeps its schedule, group and method
    run_id = next(r for r, run in gpu.sweep.runs.items() if run["model"] == "qwenimage-ref")
    full = gpu.config_of(run_id)
    tiny = tiny_counterpart(full)
    assert (tiny["model"]["preset"], tiny["device"], tiny["train"]["iterations"]) == ("tiny", "cpu", 1)
    for section in ("sampling", "grpo", "method"):
        assert tiny[section] == full[section]


# ----- archives that are not a window's ---------------------------------------------------------------------
def crafted(path: Path, base: Path, edit) -> Path:
    """A copy of archive ``base`` rewritten by ``edit(members) -> members`` ({name: bytes or TarInfo})."""
    with tarfile.open(base) as tar:
        members = {m.name: tar.extractfile(m).read() for m in tar if m.isreg()}
    members = edit(members)
    with tarfile.open(path, "w:gz") as tar:
        for name, data in members.items():
            if isinstance(data, tarfile.TarInfo):
                tar.addfile(data)
                continue
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def first_run(members: dict) -> str:
    return sorted(n.split("/")[1] for n in members if n.startswith("runs/"))[0]


def replace(members: dict, suffix: str, change) -> dict:
    name = f"runs/{first_run(members)}/{suffix}"
    return {**members, name: change(members[name])}


def link(name: str, kind=tarfile.SYMTYPE, target: str = "/etc/passwd") -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type, info.linkname = kind, target
    return info


def record_edit(key: str, value):
    def change(data: bytes) -> bytes:
        lines = data.decode().splitlines()
        first = json.loads(lines[0])
        first[key] = value
        return "\n".join([json.dumps(first), *lines[1:]]).encode() + b"\n"
    return change


def calibration_of_another_cell(members: dict) -> dict:
    """A calibration named after the first run's cell whose content names another resolution (whether or not
    the window had time to calibrate)."""
    run_id = first_run(members)
    summary = json.loads(members[f"runs/{run_id}/summary.json"])
    _, model, resolution, _, device = run_id.split("_")
    return {f"calibration/20260101T000000_09_{model}_{resolution}_{device}.json": json.dumps(
        {"model": summary["model"], "resolution": 1024, "device": summary["device"]}).encode()}


BAD = {
    "symlink": (lambda m: {**m, "runs/x/summary.json": link("runs/x/summary.json")}, "not a plain file"),
    "hardlink": (lambda m: {**m, "runs/x/env.json": link("runs/x/env.json", tarfile.LNKTYPE, "calibration")},
                 "not a plain file"),
    "parent path": (lambda m: {**m, "../escape.json": b"{}"}, "not a path of a campaign archive"),
    "absolute path": (lambda m: {**m, "/tmp/escape.json": b"{}"}, "not a path of a campaign archive"),
    "foreign file": (lambda m: {**m, f"runs/{first_run(m)}/notes.txt": b"mine"}, "not a path of a campaign archive"),
    "checkpoint": (lambda m: {**m, f"runs/{first_run(m)}/checkpoint.pt": b"x"}, "not a path of a campaign archive"),
    "not json": (lambda m: replace(m, "summary.json", lambda d: b"not json"), "not JSON"),
    "unfinished run": (lambda m: replace(m, "summary.json", lambda d: json.dumps(
        {**json.loads(d), "status": "interrupted"}).encode()), "is not finished"),
    "unknown run": (lambda m: {**{n.replace(first_run(m), "full_sd99_32px_s0_cpu"): d for n, d in m.items()}},
                    "is not a run of the sweep"),
    "another config": (lambda m: replace(m, "config.json", lambda d: json.dumps(
        {**json.loads(d), "seed": 7}).encode()), "is not the config"),
    "bad record": (lambda m: replace(m, "metrics.jsonl", record_edit("t_iter_s", "fast")), "'t_iter_s' = 'fast'"),
    "record twice": (lambda m: replace(m, "metrics.jsonl", lambda d: d + d), "expected each iteration once"),
    "wrong pass count": (lambda m: replace(m, "metrics.jsonl", record_edit("backward", 3)),
                         "on the tiny model on the CPU counts"),
    "bad calibration": (lambda m: {**m, "calibration/20260101T000000_01_sd35m_64px_cpu.json": b'{"methods": 3}'},
                        "calibration/"),
    "calibration of no cell": (lambda m: {**m, "calibration/20260101T000000_01_nope_64px_cpu.json": b"{}"},
                               "after a cell of the sweep"),
    # JSON a reader cannot take: refused in one line, not a traceback
    "deep json": (lambda m: {**m, "windows/20260101T000000.json": b"[" * 100_000 + b"]" * 100_000},
                  "nested too deeply"),
    "long integer": (lambda m: replace(m, "metrics.jsonl", lambda d: d.replace(b"{", b'{"note": ' + b"9" * 5000 + b", ",
                                                                             1)), "digits"),
    "nan": (lambda m: replace(m, "env.json", lambda d: b'{"gpu_name": NaN}'), "NaN is not a JSON number"),
    # files that are not what a window writes
    "not a window log": (lambda m: {**m, "windows/evil.json": b'{"not": "a window log"}'}, "is not a window log's"),
    "plan bytes": (lambda m: replace(m, "plan.json", lambda d: b'{"bytes": 5}'), "plan.json: bytes = 5"),
    "plan text": (lambda m: replace(m, "plan.json", lambda d: b'{"bytes": {"activations": "lots"}}'),
                  "bytes.activations = 'lots'"),
    # records that are not the sweep's run, or not of its device
    "another run": (lambda m: replace(m, "metrics.jsonl", record_edit("run_id", "someone_else")),
                    "where metrics.jsonl record 1 has 'someone_else'"),
    "another device": (lambda m: replace(m, "metrics.jsonl", lambda d: "".join(json.dumps(
        {**json.loads(line), "device": "cuda", "gpu_name": "NVIDIA A100"}) + "\n" for line in d.decode().splitlines()
        ).encode()), "device = 'cuda'"),
    "calibration of another cell": (lambda m: {**m, **calibration_of_another_cell(m)}, "resolution = 1024"),
    # a cache's keys in the records do not spare a run the comparison of its pass counts
    "cache keys": (lambda m: replace(m, "metrics.jsonl", lambda d: record_edit("cache_hits", 0)(
        record_edit("backward", 999)(d))), "on the tiny model on the CPU counts"),
}
NEW_REFERENCE = {"wrong pass count", "cache keys", "plan bytes"}  # refused late: after the reference is claimed


@pytest.mark.slow
@pytest.mark.parametrize("case", BAD)
def test_a_bad_archive_is_one_line_and_leaves_the_reference_untouched(window, tmp_path, capsys, case):
    edit, words = BAD[case]
    path = crafted(tmp_path / "bad.tar.gz", window["archive"], edit)
    # the pass counts are compared for runs the reference does not hold yet: into a new reference
    reference = tmp_path / "new" if case in NEW_REFERENCE else window["reference"]
    before = tree(reference)
    code = main(["campaign", "unpack", "--config", str(CONFIG), "--cpu", "--archive", str(path), "--reference",
                 str(reference)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and words in err[0], err
    assert tree(reference) == before and (reference.exists() or case in NEW_REFERENCE)
    assert not (tmp_path / "new").exists() and not (tmp_path / "escape.json").exists()


@pytest.mark.slow
def test_a_run_the_reference_holds_otherwise_and_sizes_are_refused(window, tmp_path, capsys, monkeypatch):
    reference = window["reference"]
    before = tree(reference)
    # the same run id with other bytes: refused (a run is replaced only by removing it first)
    changed = crafted(tmp_path / "other.tar.gz", window["archive"],
                      lambda m: replace(m, "env.json", lambda d: json.dumps({**json.loads(d), "note": 1}).encode()))
    assert main(["campaign", "unpack", "--config", str(CONFIG), "--cpu", "--archive", str(changed), "--reference",
                 str(reference)]) == 2
    assert "in the reference" in capsys.readouterr().err and tree(reference) == before
    # a member over the size bound, and a file that is not an archive
    monkeypatch.setattr(archive_module, "MAX_MEMBER_BYTES", 100)
    assert main(["campaign", "unpack", "--config", str(CONFIG), "--cpu", "--archive", str(window["archive"]),
                 "--reference", str(reference)]) == 2
    assert "expected at most 100" in capsys.readouterr().err
    (tmp_path / "plain.tar.gz").write_text("hello")
    assert main(["campaign", "unpack", "--config", str(CONFIG), "--cpu", "--archive", str(tmp_path / "plain.tar.gz"),
                 "--reference", str(reference)]) == 2
    assert "not a gzip-compressed tar" in capsys.readouterr().err and tree(reference) == before
    monkeypatch.undo()
    # only a whole gzip stream of a tar: not an uncompressed tar, not one cut before its checksum, nothing after
    raw = gzip.decompress(window["archive"].read_bytes())
    packed = window["archive"].read_bytes()
    for name, data, words in [("plain.tar", raw, "not a gzip-compressed tar"),
                              ("cut.tar.gz", packed[:-8], "truncated"),
                              ("tail.tar.gz", packed + b"more", "after its gzip stream")]:
        (tmp_path / name).write_bytes(data)
        assert main(["campaign", "unpack", "--config", str(CONFIG), "--cpu", "--archive", str(tmp_path / name),
                     "--reference", str(reference)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and words in err[0] and tree(reference) == before, (name, err)


@pytest.mark.slow
def test_an_unpack_that_fails_while_writing_the_tables_leaves_no_trace(window, tmp_path, capsys, monkeypatch):
    """The new files are moved back out, the folders made for them removed, and a reference the unpack made
    is gone: the reference is as it was (here: none)."""
    def broken(campaign, reference):
        assert (reference / "runs").is_dir()  # the runs were moved in
        raise UserError("the tables cannot be written")

    monkeypatch.setattr(archive_module, "write_reference_tables", broken)
    reference = tmp_path / "new"
    assert main(["campaign", "unpack", "--config", str(CONFIG), "--cpu", "--archive", str(window["archive"]),
                 "--reference", str(reference)]) == 2
    assert "the tables cannot be written" in capsys.readouterr().err
    assert not reference.exists() and list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("reused", [False, True])
def test_an_unpack_removes_the_staging_folder_a_killed_unpack_left_once_its_own_files_are_in_place(
        cpu_campaign, tmp_path, monkeypatch, reused):
    """An unpack killed (SIGKILL) while it moved the archive's files in left its staging folder inside the
    reference, which is committed: the reference's checks take it for the harness's, and each attempt stages
    under its own PID. It tells the readers that the manifest may lag behind the runs: the next unpack removed it
    as soon as it held the reference's claim, and when that unpack was then refused the readers took the manifest
    for whole. An unpack refused leaves it (the readers go on refusing); one that puts its own runs, manifest and
    tables in place removes it; a live process's stays. The killed unpack may have had the PID of the next one (a
    fresh container's PIDs are few and reused): its staging folder was taken for the live unpack's own, never
    removed, and the unpack failed making its own (FileExistsError, an internal error)."""
    from agg_bench.outputs import check_no_unpack

    reference = tmp_path / "reference"
    stale = atomic_path(reference / "unpack", os.getpid() if reused else ENDED_PID)  # where an unpack stages
    (stale / "new" / "runs" / "r0").mkdir(parents=True)
    (stale / "new" / "runs" / "r0" / "metrics.jsonl").write_text("{}\n")
    unpack_to_its_first_check(cpu_campaign, tmp_path, reference, monkeypatch)
    assert [p.name for p in reference.iterdir()] == [stale.name]
    with pytest.raises(UserError, match=re.escape(f"({stale.name} is there)")):
        check_no_unpack(reference, "--manifest manifest.json")
    monkeypatch.undo()
    with running_process() as live:
        alive = atomic_path(reference / "unpack", live)
        alive.mkdir()
        archive_module.unpack(cpu_campaign, logs_archive(tmp_path / "logs.tar.gz", "20260101T000000"), reference)
        assert sorted(p.name for p in reference.iterdir()) == sorted([alive.name, "manifest.json", "windows"])


def unpack_to_its_first_check(cpu_campaign, tmp_path: Path, reference: Path, monkeypatch) -> None:
    """An unpack into ``reference`` that stops at its first check under the reference's claim (the archive's runs
    against the reference's): what it removed before, it removed once it held the claim."""
    def checked(*args):
        raise UserError("checked")

    monkeypatch.setattr(archive_module, "read_archive", lambda path: {})
    monkeypatch.setattr(archive_module, "check_hardware", checked)
    with pytest.raises(UserError, match="checked"):
        archive_module.unpack(cpu_campaign, tmp_path / "campaign.tar.gz", reference)


@pytest.mark.parametrize("folder", ["tables", "learning"])
def test_an_unpack_while_a_report_writes_the_reference_s_tables_is_refused_before_it_changes_anything(
        cpu_campaign, tmp_path, monkeypatch, folder):
    """`agg-bench report --tables REF/tables` (or `agg-bench learning` into REF/learning) writing while an unpack
    went on: the unpack moved its runs in and wrote the manifest, was refused the tables only then, and its
    rollback removed and put back the tables folder the report held, under the report's rename. The unpack holds
    the reference's tables and learning report from its start instead: refused first, one line naming the
    holder, nothing of the reference touched."""
    from agg_bench.io import file_identity
    from agg_bench.outdir import Busy, Claim

    reference = tmp_path / "reference"
    (reference / "tables").mkdir(parents=True)
    (reference / "tables" / "summary.csv").write_text("method\n")
    reached = []
    monkeypatch.setattr(archive_module, "read_archive", lambda path: {})
    monkeypatch.setattr(archive_module, "check_hardware", lambda *args: reached.append(args))
    before = (tree(reference), file_identity(reference / "tables"))
    with Claim(reference / folder, folder=True, lock_inside=False).acquire():  # the report's, writing
        with pytest.raises(Busy) as refused:
            archive_module.unpack(cpu_campaign, tmp_path / "campaign.tar.gz", reference)
    assert str(refused.value) == (f"--reference {reference / folder}: another agg-bench process (PID {os.getpid()}) "
                                  "is writing this folder; wait until it ends or give another folder")
    assert not reached and (tree(reference), file_identity(reference / "tables")) == before


def test_an_unpack_removes_the_temporaries_a_killed_unpack_left_of_the_files_it_generates(cpu_campaign, tmp_path,
                                                                                          monkeypatch):
    """An unpack killed (SIGKILL) while it wrote the reference's manifest.json, or a report of it killed while
    its tables were staged, left a temporary in the reference, which is committed: the reference's checks take
    it for the harness's, and the manifest is written outside any claim of its own. The next unpack removes
    each once it holds the reference's claim; a live process's stays."""
    reference = tmp_path / "reference"
    reference.mkdir()
    stale = [atomic_path(reference / name, ENDED_PID) for name in archive_module.GENERATED]
    stale[0].write_text("{}")  # manifest.json's
    for folder in stale[1:]:  # the tables' and the learning report's, staged whole
        folder.mkdir()
        (folder / "summary.csv").write_text("method\n")
    with running_process() as live:
        alive = atomic_path(reference / "manifest.json", live)
        alive.write_text("{}")
        unpack_to_its_first_check(cpu_campaign, tmp_path, reference, monkeypatch)
    assert sorted(p.name for p in reference.iterdir()) == [alive.name]


# `agg-bench ARGS` (a campaign unpack, its pass counts not compared: the tests above do) killed (SIGKILL) at a
# point of the unpack: once a run is moved into the reference, or once its manifest is written
KILLED_UNPACK = """
import os, signal, sys
from agg_bench.cli import main
from agg_bench.tools import archive
archive.check_counts = lambda *args: None
kill = lambda: os.kill(os.getpid(), signal.SIGKILL)
rename, write_json = os.rename, archive.write_json
def moved(src, dst):
    rename(src, dst)
    if os.path.basename(os.path.dirname(dst)) == "runs":
        kill()
def written(path, data):
    write_json(path, data)
    kill()
if sys.argv[1] == "a run moved in":
    os.rename = moved
else:
    archive.write_json = written
main(sys.argv[2:])
"""


@pytest.mark.slow
def test_an_unpack_killed_half_way_is_refused_by_readers_and_finished_by_the_same_unpack(window, cpu_campaign,
                                                                                         tmp_path, monkeypatch, capsys):
    """An unpack killed (SIGKILL) half-way into a reference that held an earlier window's runs left some of the
    archive's runs in it beside the earlier manifest and tables, or its new manifest beside the earlier tables:
    `agg-bench report` on the reference's manifest reported it as if whole. While the unpack's staging folder is
    there, a report of the reference's manifest refuses in one line; campaign status counts what is there; the same
    unpack again finishes the job, and the reference is, byte for byte, what the unpack uninterrupted leaves."""
    monkeypatch.setattr(archive_module, "check_counts", lambda *args: None)  # its own tests time it
    members = archive_module.read_archive(window["archive"])
    last = max(name.split("/")[1] for name in members if name.startswith("runs/"))
    first = tmp_path / "first.tar.gz"  # an earlier window's archive: all but the last run (a window log at least)
    with tarfile.open(first, "w:gz") as tar:
        for name, data in members.items():
            if not name.startswith(f"runs/{last}/"):
                info = tarfile.TarInfo(name)
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    reference = Path("ref")  # the manifests' run folders are relative to the working folder: the same in each
    points = ["a run moved in", "the manifest written"]
    (tmp_path / "uninterrupted").mkdir()
    monkeypatch.chdir(tmp_path / "uninterrupted")
    archive_module.unpack(cpu_campaign, first, reference)
    for point in points:
        shutil.copytree(reference, tmp_path / point / reference)
        share_kept_checks(tmp_path / point)  # the killed unpack's Campaign: no child process of the methods check
    archive_module.unpack(cpu_campaign, window["archive"], reference)
    expected = tree(reference)
    for point in points:
        monkeypatch.chdir(tmp_path / point)
        killed = subprocess.run([sys.executable, "-c", KILLED_UNPACK, point, "campaign", "unpack", "--config",
                                 str(CONFIG), "--cpu", "--archive", str(window["archive"]), "--reference", "ref"],
                                capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})
        assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
        assert tree(reference) != expected
        capsys.readouterr()
        assert main(["report", "--manifest", "ref/manifest.json", "--tables", "t"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and (f"--manifest ref/manifest.json: agg-bench campaign unpack into "
                                  f"{os.path.abspath('ref')} is under way or was cut off") in err[0], err
        assert not Path("t").exists()
        assert campaign_module.status(cpu_campaign, reference)["done"] >= 1
        archive_module.unpack(cpu_campaign, window["archive"], reference)
        assert tree(reference) == expected, point
        assert main(["report", "--check", "--manifest", "ref/manifest.json", "--tables", "ref/tables"]) == 0


def test_a_small_archive_that_unpacks_to_more_than_the_bound_is_refused_as_it_inflates(tmp_path, capsys,
                                                                                       monkeypatch):
    """A tar's long-name header is read whole by the tar reader: the inflated stream is bounded first, so an
    archive of a few KiB cannot make the reader hold gigabytes."""
    monkeypatch.setattr(archive_module, "MAX_TAR_BYTES", 2**20)
    header = tarfile.TarInfo("././@LongLink")
    header.type, header.size = tarfile.GNUTYPE_LONGNAME, 4 * 2**20
    body = header.tobuf(format=tarfile.GNU_FORMAT) + b"a" * header.size
    path = tmp_path / "bomb.tar.gz"
    path.write_bytes(gzip.compress(body + b"\0" * 1024, 9))
    assert path.stat().st_size < 64 * 2**10
    assert main(["campaign", "unpack", "--config", str(CONFIG), "--cpu", "--archive", str(path), "--reference",
                 str(tmp_path / "reference")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"unpacks to more than {2**20:,} bytes" in err[0], err
    assert not (tmp_path / "reference").exists()


def window_logs(*stamps: str) -> dict[str, bytes]:
    """Window logs named after their start: an archive's smallest valid members, which unpack checks in-process."""
    return {f"windows/{stamp}.json": json.dumps({"started": stamp}).encode() for stamp in stamps}


def logs_archive(path: Path, *stamps: str) -> Path:
    """``path``, written as a campaign archive (gzip) of the window logs of ``stamps`` (:func:`window_logs`)."""
    path.write_bytes(gzip.compress(tar_bytes(window_logs(*stamps))))
    return path


def tar_bytes(members: dict) -> bytes:
    """The uncompressed tar of ``members`` ({name: bytes or (TarInfo, bytes)}) as the tar module writes it."""
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w") as tar:
        for name, data in members.items():
            info, data = data if isinstance(data, tuple) else (tarfile.TarInfo(name), data)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return out.getvalue()


def size_field_smaller() -> bytes:
    """A member whose header counts 2 of the 8 bytes that follow it (within its block's padding)."""
    info = tarfile.TarInfo("windows/20260101T000000.json")
    info.size = 2
    return info.tobuf() + b'{"a": 1}'.ljust(512, b"\0") + b"\0" * 1024


def sparse_member() -> bytes:
    """An old GNU sparse member: 8 bytes in the archive, 5,000 once its hole is filled with zeros."""
    info = tarfile.TarInfo("windows/20260101T000000.json")
    info.type, info.size = tarfile.GNUTYPE_SPARSE, 8
    header = bytearray(info.tobuf(format=tarfile.GNU_FORMAT))
    header[386:410] = b"%011o\0%011o\0" % (0, 8)  # one region: offset 0, 8 bytes
    header[483:495] = b"%011o\0" % 5000  # the real size
    header[148:156] = b" " * 8
    header[148:156] = b"%06o\0 " % sum(header)
    return bytes(header) + b"{}      ".ljust(512, b"\0") + b"\0" * 1024


@pytest.mark.parametrize("raw, words", [
    # the tar reader stops at the first block that is no header without a word: the rest went unread
    (lambda: tar_bytes(window_logs("20260101T000000")) + b"not a tar block" * 100, "bytes that are no member"),
    (lambda: tar_bytes(window_logs("20260101T000000")) + tar_bytes(window_logs("20260102T000000")),
     "bytes that are no member"),
    (lambda: tar_bytes(window_logs("20260101T000000"))[:512 * 2] + b"x" * 512 + tar_bytes(window_logs("20260102T000000")),
     "bytes that are no member"),
    (size_field_smaller, "6 bytes its header does not count"),
    (sparse_member, "is not a plain file"),
    # one file on a checkout where case is not told apart (macOS, Windows): one log would overwrite the other
    (lambda: tar_bytes(window_logs("20260101T000000", "20260101t000000")), "differ only in case"),
], ids=["trailing bytes", "a second tar", "a block that is no header", "size field smaller", "sparse member", "names differing in case"])
def test_a_tar_stream_the_harness_did_not_write_is_refused_and_the_reference_untouched(tmp_path, cpu_campaign, raw,
                                                                                       words):
    reference = tmp_path / "reference"
    archive_module.unpack(cpu_campaign, logs_archive(tmp_path / "good.tar.gz", "20251231T000000"), reference)
    before = tree(reference)
    bad = tmp_path / "bad.tar.gz"
    bad.write_bytes(gzip.compress(raw()))
    with pytest.raises(UserError) as refused:
        archive_module.unpack(cpu_campaign, bad, reference)
    assert words in str(refused.value) and "\n" not in str(refused.value), refused.value
    assert tree(reference) == before


def test_a_file_the_reference_holds_in_another_case_is_refused(tmp_path, cpu_campaign):
    """An archive's member that a file of the reference names in another case (a window log renamed by hand there:
    no archive's own log can be, its name is its start's stamp) is refused; one file on a checkout where case is
    not told apart."""
    reference = tmp_path / "reference"
    archive_module.unpack(cpu_campaign, logs_archive(tmp_path / "first.tar.gz", "20260101T000000"), reference)
    second = logs_archive(tmp_path / "second.tar.gz", "20260101T000000", "20260102T000000")
    archive_module.unpack(cpu_campaign, second, reference)  # the same file again, and another: no clash
    (reference / "windows" / "20260102T000000.json").rename(reference / "windows" / "20260102t000000.json")
    before = tree(reference)
    with pytest.raises(UserError, match="'windows/20260102T000000.json' and the reference's "
                                        "'windows/20260102t000000.json' differ only in case"):
        archive_module.unpack(cpu_campaign, second, reference)
    assert tree(reference) == before


@pytest.mark.parametrize("edit, words", [
    (lambda m, c, ref: m.update(warmup=2), "(warmup = 2; unpack writes 1 for this sweep)"),
    (lambda m, c, ref: m.update(notes="mine"),
     "its keys are ['calibration', 'gradcheck', 'notes', 'runs', 'time', 'warmup']"),
    (lambda m, c, ref: m["runs"].append({"dir": str(ref / "runs" / "mine"), "method": "full"}),
     "runs[0]: 'mine' is no run of the sweep"),
    (lambda m, c, ref: m["runs"].append({**next(iter(archive_module._run_entries(c, ref).values())),
                                         "method": "mine"}), "runs[0].method = 'mine'; unpack writes 'full'"),
    (lambda m, c, ref: m["runs"].append(next(iter(archive_module._run_entries(c, ref.parent / "other").values()))),
     "other', not in the reference"),
    (lambda m, c, ref: "my notes\n", "(not a JSON file unpack writes: "),  # written instead of the manifest
])
def test_a_manifest_edited_by_hand_is_refused_and_kept(tmp_path, capsys, cpu_campaign, edit, words):
    """An unpack wrote the reference's manifest.json anew over one its user had edited (a label changed, an entry
    added, a run of another folder listed): what they put there was lost. It is refused, one line naming the file
    and the first difference, exit code 2, nothing of the reference touched."""
    reference = tmp_path / "ref"
    archive_module.unpack(cpu_campaign, logs_archive(tmp_path / "first.tar.gz", "20260101T000000"), reference)
    manifest = json.loads((reference / "manifest.json").read_text())
    text = edit(manifest, cpu_campaign, reference)
    (reference / "manifest.json").write_text(text if isinstance(text, str) else json.dumps(manifest))
    before = tree(reference)
    second = logs_archive(tmp_path / "second.tar.gz", "20260102T000000")
    assert main(["campaign", "unpack", "--config", str(CONFIG), "--cpu", "--archive", str(second),
                 "--reference", str(reference)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"agg-bench campaign: --reference {reference}: manifest.json is not "
                                               "the manifest campaign unpack writes") and words in err[0], err
    assert tree(reference) == before


def test_a_manifest_an_earlier_unpack_wrote_is_replaced_from_any_working_folder(tmp_path, cpu_campaign,
                                                                                 monkeypatch):
    """The manifest unpack wrote is its own to replace: written from another working folder (its paths relative
    to that one), in another layout, or listing a run folder removed since (to be run again) or lacking one an
    unpack killed before its manifest moved in."""
    reference = tmp_path / "results" / "ref"
    done, gone = list(cpu_campaign.sweep.runs)[:2]
    for run_id in (done, gone):
        finished_run(cpu_campaign, reference / "runs" / run_id)
    monkeypatch.chdir(tmp_path)
    written = archive_module.reference_manifest(cpu_campaign, Path("results/ref"))
    assert [Path(entry["dir"]) for entry in written["runs"]] == [Path("results/ref/runs", r) for r in (done, gone)]
    shutil.rmtree(reference / "runs" / gone)
    monkeypatch.chdir(reference.parent)
    assert archive_module.manifest_problem(cpu_campaign, Path("ref"), written) is None
    assert archive_module.manifest_problem(cpu_campaign, Path("ref"), {**written, "runs": []}) is None
    (reference / "manifest.json").write_text(json.dumps(written, indent=None))
    archive_module.check_manifest(cpu_campaign, Path("ref"))
    # the same paths given to a reference of another place are someone's
    assert archive_module.manifest_problem(cpu_campaign, tmp_path / "other" / "ref", written) == \
        f"its paths lie in 'results/ref', not in the reference {tmp_path / 'other' / 'ref'}"


def stranger_run(reference: Path) -> str:
    (reference / "runs" / "mine").mkdir(parents=True)
    (reference / "runs" / "mine" / "config.json").write_text("{}")
    return "runs/mine is no run of the sweep {config}"


def stranger_calibration(reference: Path) -> str:
    (reference / "calibration").mkdir(parents=True)
    (reference / "calibration" / "20260101T000000_01_nocell.json").write_text("{}")
    return "calibration/20260101T000000_01_nocell.json is named after no cell of the sweep {config}"


def stranger_both(reference: Path) -> str:
    run, calibration = stranger_run(reference), stranger_calibration(reference)
    return f"{run} and {calibration.replace('the sweep {config}', 'it')}"


@pytest.mark.parametrize("put, them", [(stranger_run, "it"), (stranger_calibration, "it"), (stranger_both, "them")],
                         ids=["run folder", "calibration", "both"])
def test_a_run_or_calibration_of_no_run_or_cell_of_the_sweep_is_refused_and_kept(tmp_path, capsys, cpu_campaign, put,
                                                                                  them):
    """A reference's run folder named after no run of the sweep, or calibration named after no cell of it (put there
    by hand), was left out of the manifest and the tables without a word. It is refused as the reference's other
    strangers are, one line naming it, exit code 2, nothing touched."""
    reference = tmp_path / "ref"
    archive_module.unpack(cpu_campaign, logs_archive(tmp_path / "first.tar.gz", "20260101T000000"), reference)
    said = put(reference).format(config=CONFIG)
    before = tree(reference)
    second = logs_archive(tmp_path / "second.tar.gz", "20260102T000000")
    assert main(["campaign", "unpack", "--config", str(CONFIG), "--cpu", "--archive", str(second),
                 "--reference", str(reference)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"agg-bench campaign: --reference {reference}: {said}, which the manifest and tables would leave "
                   f"out; move {them} out of the reference, or give another reference"]
    assert tree(reference) == before


@pytest.mark.parametrize("key, value, words", [
    ("seconds", -1, "the window's seconds, a finite number >= 0"),
    ("minutes", 0, "the window's minutes, a number in (0, 1440]"),
    ("runs", -1, "a count of runs or calibrations, an integer >= 0"),
    ("left", -3, "a count of runs or calibrations"),
    ("config", "~/h200.yaml", "the window's campaign config file"),
    ("config", "", "the window's campaign config file"),
    ("stopped_by_signal", "x", "the name of the signal that stopped the window"),
    ("started", "evil", "the window's start, as YYYYMMDDTHHMMSS"),
    # strptime takes a field of one digit, which a window never writes (and which sorts out of time order)
    ("started", "2026011T000000", "the window's start, as YYYYMMDDTHHMMSS"),
])
def test_a_window_log_value_no_window_writes_is_refused_and_the_reference_untouched(tmp_path, cpu_campaign, key,
                                                                                    value, words):
    """The keys of a window's log were checked for their kind only: a negative count or seconds, a config that
    is no config file or a signal that is none went into the reference."""
    reference = tmp_path / "reference"
    archive_module.unpack(cpu_campaign, logs_archive(tmp_path / "good.tar.gz", "20251231T000000"), reference)
    before = tree(reference)
    stamp = value if key == "started" else "20260101T000000"
    log = {"started": stamp, "minutes": 60, "config": "config/h200.yaml", "runs": 3, "left": 1, "seconds": 12.5,
           "stopped_by_signal": "SIGTERM", key: value}
    bad = tmp_path / "bad.tar.gz"
    bad.write_bytes(gzip.compress(tar_bytes({f"windows/{stamp}.json": json.dumps(log).encode()})))
    with pytest.raises(UserError) as refused:
        archive_module.unpack(cpu_campaign, bad, reference)
    assert f"windows/{stamp}.json: {key!r} = {value!r}; expected {words}" in str(refused.value), refused.value
    assert "\n" not in str(refused.value) and tree(reference) == before


def test_a_window_started_ahead_of_the_clock_writes_a_log_unpack_takes(tmp_path, monkeypatch, cpu_campaign):
    """--started may be a few seconds ahead of the clock (STARTED_SLACK_S); a window with nothing to run ended
    before it, logged negative seconds, and unpack refused its archive."""
    monkeypatch.setattr(campaign_module, "_run_processes", lambda *args: [])
    started = time.time() + campaign_module.STARTED_SLACK_S - 1
    log = campaign_module.run_window(Campaign(CONFIG, cpu=True), 1, tmp_path / "w", None, started=started)
    assert log["seconds"] >= 0, log
    archive_module.unpack(cpu_campaign, Path(log["archive"]), tmp_path / "reference")
    assert (tmp_path / "reference" / "windows" / f"{log['started']}.json").is_file()


GOOD_PROCESS = {"cell": "sd3_32px_cpu", "runs": ["r1", "r2"], "finished": ["r1"], "busy": [], "exit_code": 0,
                "ended": "finished", "seconds": 2.0}
GOOD_CALIBRATION = {"cell": "sd3_32px_cpu", "calibration": {"file": "20260101T000000_01_sd3_32px_cpu.json",
                                                            "methods": ["full", "agg-w5"], "exit_code": 0,
                                                            "ended": "finished", "seconds": 1.5}}
GOOD_PRETRAINED = {"label": "scene", "ok": True, "exit_code": 0, "ended": "finished", "seconds": 3.5}


@pytest.mark.parametrize("key, value, at, item, words", [
    ("finished_in_window", ["r1", "../evil"], "[1]", "../evil", "a run folder name"),
    ("finished_in_window", [3], "[0]", 3, "a run folder name"),
    ("pretrained", [{"ok": True}], "[0]", {"ok": True}, "an object with keys among label, ok, exit_code"),
    ("pretrained", [{**GOOD_PRETRAINED, "path": "/etc"}], "[0]", {**GOOD_PRETRAINED, "path": "/etc"},
     "an object with keys among label, ok"),
    ("pretrained", [{**GOOD_PRETRAINED, "label": "a/b"}], "[0]['label']", "a/b", "a pre-trained model's label"),
    ("pretrained", [{**GOOD_PRETRAINED, "ok": 1}], "[0]['ok']", 1, "true or false"),
    ("processes", ["x"], "[0]", "x", "an object with keys among cell, runs, finished, busy"),
    ("processes", [{"cell": "c"}], "[0]", {"cell": "c"}, "a cell process's entry, with its runs, its calibration"),
    ("processes", [{**GOOD_PROCESS, "runs": ["a\nb"]}], "[0]['runs']", ["a\nb"], "a list of run folder names"),
    ("processes", [{**GOOD_PROCESS, "exit_code": "0"}], "[0]['exit_code']", "0", "an exit code (an integer) or null"),
    ("processes", [GOOD_PROCESS, {**GOOD_PROCESS, "cell": "a\x1b[31m"}], "[1]['cell']", "a\x1b[31m", "a cell's name"),
    ("processes", [{"cell": "c", "calibration": []}], "[0]['calibration']", [],
     "an object with keys among file, methods"),
    ("processes", [{"cell": "c", "calibration": {**GOOD_CALIBRATION["calibration"], "seconds": -1}}],
     "[0]['calibration']['seconds']", -1, "seconds, a finite number >= 0"),
    ("processes", [{"cell": "c", "calibration": {**GOOD_CALIBRATION["calibration"], "methods": [None]}}],
     "[0]['calibration']['methods']", [None], "a list of method labels"),
])
def test_a_window_log_entry_no_window_writes_is_refused_and_the_reference_untouched(tmp_path, cpu_campaign, key,
                                                                                    value, at, item, words):
    """The lists of a window's log (pretrained, processes, finished_in_window) were checked as lists only: their
    entries went into the reference whatever they held. Each entry is checked as the window writes it; a log of
    such entries is let in, and so is one of an earlier window's (a cell process's entry without busy, or with
    its calibration in it: the committed reference's)."""
    reference = tmp_path / "reference"
    good = {"started": "20251231T000000", "minutes": 60, "config": "config/h200.yaml", "runs": 3, "left": 1,
            "seconds": 12.5, "stopped_by_signal": None, "pretrained": [GOOD_PRETRAINED],
            "processes": [GOOD_PROCESS, GOOD_CALIBRATION, {**GOOD_PROCESS, **GOOD_CALIBRATION},
                          {key: v for key, v in GOOD_PROCESS.items() if key != "busy"}], "finished_in_window": ["r1"]}
    first = tmp_path / "good.tar.gz"
    first.write_bytes(gzip.compress(tar_bytes({"windows/20251231T000000.json": json.dumps(good).encode()})))
    archive_module.unpack(cpu_campaign, first, reference)
    before = tree(reference)
    stamp = "20260101T000000"
    bad = tmp_path / "bad.tar.gz"
    log = {**good, "started": stamp, key: value}
    bad.write_bytes(gzip.compress(tar_bytes({f"windows/{stamp}.json": json.dumps(log).encode()})))
    with pytest.raises(UserError) as refused:
        archive_module.unpack(cpu_campaign, bad, reference)
    assert f"windows/{stamp}.json: {key!r}{at} = {item!r}; expected {words}" in str(refused.value), refused.value
    assert "\n" not in str(refused.value) and tree(reference) == before


def test_a_reference_holds_one_gpus_runs_and_the_one_the_campaign_names(tmp_path):
    """Unpack refuses runs of another GPU than the reference's, and with campaign.gpu (config/h200.yaml: H200)
    runs and calibrations of any other GPU."""
    gpu = Campaign(CONFIG)
    assert gpu.gpu == "H200"
    archive_module.check_hardware(gpu, "archive A", {"runs/a": "NVIDIA H200", "calibration/c.json": "NVIDIA H200"},
                                  tmp_path)
    with pytest.raises(UserError, match="campaign.gpu of .* asks for 'H200'"):
        archive_module.check_hardware(gpu, "archive A", {"runs/a": "NVIDIA A100-SXM4-80GB"}, tmp_path)
    with pytest.raises(UserError, match="not of one GPU"):
        archive_module.check_hardware(gpu, "archive A", {"runs/a": "NVIDIA H200", "runs/b": "NVIDIA H200 NVL"},
                                      tmp_path)
    run = tmp_path / "runs" / "full_sd35m_512px_s0_h200"
    run.mkdir(parents=True)
    (run / "summary.json").write_text(json.dumps({"run_id": run.name, "status": "ok", "device": "cuda",
                                                  "gpu_name": "NVIDIA H200 NVL"}))
    with pytest.raises(UserError, match="not of one GPU"):  # the reference's own runs count
        archive_module.check_hardware(gpu, "archive A", {"runs/a": "NVIDIA H200"}, tmp_path)
    # each hardware is named, however many runs of one come first (a CPU archive's runs named only None)
    many = {f"runs/cpu{i}": None for i in range(8)}
    with pytest.raises(UserError) as err:
        archive_module.check_hardware(Campaign(CONFIG, cpu=True), "archive A", many, tmp_path)
    assert "runs/cpu0: a CPU" in str(err.value) and f"reference {run}: 'NVIDIA H200 NVL'" in str(err.value)


def test_a_temporary_file_a_killed_window_left_is_not_packed(tmp_path, cpu_campaign):
    """A window killed while it wrote its log (or a cell process while it wrote a calibration) left the writer's
    temporary file; each later window of that work folder packed it, and campaign unpack refused every such
    archive (not a path of a campaign archive)."""
    from agg_bench.io import atomic_path

    work = tmp_path / "work"
    for sub, name in (("windows", "20260101T000000.json"), ("calibration", "20260101T000000_01-1_x_64px_cpu.json")):
        (work / sub).mkdir(parents=True)
        (work / sub / name).write_text("{}")
        atomic_path(work / sub / name).write_text('{"half')
    archive = tmp_path / "campaign.tar.gz"
    campaign_module._pack(cpu_campaign, work, None, archive)
    with tarfile.open(archive) as tar:
        assert sorted(tar.getnames()) == ["calibration/20260101T000000_01-1_x_64px_cpu.json",
                                          "windows/20260101T000000.json"]


@pytest.mark.parametrize("member", ["runs", "calibration"])
def test_an_archive_of_the_cpu_form_given_to_the_gpu_reference_names_campaign_gpu(tmp_path, capsys, cpu_campaign,
                                                                                 member):
    """A --cpu window's archive unpacked without --cpu into the H200 reference was refused as 'not a run of the
    sweep', which named neither campaign.gpu nor the --cpu form it came from."""
    run_id = next(iter(cpu_campaign.sweep.runs))
    cell = cpu_campaign.cell_of(cpu_campaign.sweep.runs[run_id])
    source = tmp_path / "file.json"
    source.write_text(json.dumps({"device": "cpu", "methods": {}}))
    name = f"runs/{run_id}/config.json" if member == "runs" else f"calibration/20260101T000000_01-1_{cell}.json"
    archive = tmp_path / "campaign.tar.gz"
    archive_module.pack([(name, source)], archive)
    reference = tmp_path / "reference"
    reference.mkdir()
    code = main(["campaign", "unpack", "--config", str(CONFIG), "--archive", str(archive), "--reference",
                 str(reference)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert f"{name.rsplit('/', 1)[0] if member == 'runs' else name} ran on the CPU" in err[0], err
    assert "campaign.gpu of" in err[0] and "'H200'" in err[0] and "--cpu" in err[0], err
    assert list(reference.iterdir()) == []


@pytest.mark.parametrize("args, words", [
    (["--minutes", "-1"], "--minutes = -1.0"),
    (["--minutes", "nan"], "argument --minutes: 'nan': expected a finite number"),  # as argparse reads it
    (["--minutes", "1e9"], "expected a number of minutes in (0, 1440]"),
    ([], "--minutes = None"),
    # the window's clock: not ahead of this machine's, and with time left
    (["--minutes", "1", "--started", "nan"], "argument --started: 'nan': expected a finite number"),
    (["--minutes", "1", "--started", "1e12"], "--started = 1000000000000.0: expected seconds since the epoch, "
                                              "not after now"),
    (["--minutes", "1", "--started", "0"], "the window has no time left"),
    # what errors call the work folder: one printable name
    (["--minutes", "1", "--work-name", ""], "argument --work-name: '': expected a name of printable characters"),
    (["--minutes", "1", "--work-name", "A\nB"], "argument --work-name: 'A\\nB': expected a name of printable"),
])
def test_bad_options_are_one_line(tmp_path, capsys, args, words):
    code = exit_code(["campaign", "run", "--config", str(CONFIG), "--cpu", "--work", str(tmp_path / "w"), *args])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and words in err[0], err
    assert not (tmp_path / "w").exists()


@pytest.mark.parametrize("config", ["h200.yaml", "learning_gpu.yaml"])
def test_a_gpu_window_on_a_machine_without_cuda_is_one_line_and_writes_nothing(tmp_path, capsys, monkeypatch, config):
    """Without --cpu, a window whose device this machine lacks is refused before it writes anything: it was
    spent on processes that each failed (every run, or the model's pre-training), and exited 0."""
    import torch
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    work = tmp_path / "w"
    code = main(["campaign", "run", "--config", str(ROOT / "config" / config), "--minutes", "1", "--work", str(work),
                 "--reference", str(tmp_path / "ref")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert "devices." in err[0] and "CUDA is not available on this machine" in err[0] and "--cpu" in err[0], err
    assert not work.exists() and not (tmp_path / "ref").exists()


def fake_gpu(monkeypatch, name: str) -> list:
    """torch sees one CUDA device called ``name`` (in this process and in the child that the campaign asks for
    its name); returns the devices whose name was asked for."""
    asked: list = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: asked.append(device) or name)
    monkeypatch.setattr(campaign_module, "visible_gpu_name",
                        lambda device, python=sys.executable, until=None: torch.cuda.get_device_name(torch.device(device)))
    return asked


def test_the_gpu_name_is_asked_in_a_child_process(tmp_path, monkeypatch):
    """The campaign process itself never touches CUDA (a context it held would sit on the GPU all window, counted
    in every run's NVML peak): a child with torch.cuda.get_device_name faked answers, and one that fails is one
    line naming campaign.gpu."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text("import torch\n"
                                          "torch.cuda.get_device_name = lambda device=None: f'NVIDIA H200 ({device})'\n")
    monkeypatch.setenv("PYTHONPATH", f"{site}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: pytest.fail("asked in this process"))
    assert campaign_module.visible_gpu_name("cuda:0") == "NVIDIA H200 (cuda:0)"
    with pytest.raises(UserError, match=r"^campaign.gpu: the name of cuda could not be read \(.*nowhere"):
        campaign_module.visible_gpu_name("cuda", python=str(tmp_path / "nowhere" / "python"))


def fake_interpreter(folder: Path, body: str) -> Path:
    """An executable that runs the bash ``body`` whatever it is asked (a GPU-name child's stand-in)."""
    return bash_script(folder / "python", body)


MARK = campaign_module.GPU_NAME_MARK


@pytest.mark.parametrize("body, expected", [
    (f"echo 'UserWarning: before'; echo '{MARK}\"NVIDIA H200\"'; echo 'noise after'", "NVIDIA H200"),
    (f"printf '\\xff\\xfe\\n' >&2; echo '{MARK}\"NVIDIA \\u001b[0mH200\"'", "NVIDIA \x1b[0mH200"),
    ("printf 'no name \\xff\\n'", "could not be read (it printed no name)"),
    ("printf 'RuntimeError: CUDA \\xff\\n' >&2; exit 1", "could not be read (RuntimeError: CUDA \ufffd)"),
    (f"echo '{MARK}\"\"'", "could not be read (it printed no name)"),
])
def test_what_the_gpu_name_child_prints_besides_the_name_is_not_taken_for_it(tmp_path, body, expected):
    """A line a library printed after the name was taken for it, bytes that are no UTF-8 were a traceback
    (UnicodeDecodeError), and a child that printed nothing was reported as 'exit code 0'."""
    python = str(fake_interpreter(tmp_path, body))
    if "could not be read" in expected:
        with pytest.raises(UserError) as err:
            campaign_module.visible_gpu_name("cuda", python=python)
        assert str(err.value) == f"campaign.gpu: the name of cuda {expected}"
    else:
        assert campaign_module.visible_gpu_name("cuda", python=python) == expected


def test_a_gpu_name_child_that_hangs_is_given_the_window_s_time_only(tmp_path, capsys, monkeypatch):
    """The child that names the GPU was waited for GPU_NAME_TIMEOUT_S (120 s) whatever --minutes said: a window
    of one minute whose child hung ran past its end (and the GPU machine, killing it at its own limit, brought
    nothing back). It gets the time to the window's stop at most; the refusal is one line, nothing written."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    python = fake_interpreter(tmp_path / "bin", "exec sleep 600")
    work = tmp_path / "w"
    with not_hung(60), pytest.raises(UserError) as err:
        campaign_module.run_window(Campaign(CONFIG), 0.05, work, tmp_path / "ref", python=str(python))
    assert str(err.value).startswith("campaign.gpu: the name of cuda could not be read (no answer in ")
    assert "the time the window had left" in str(err.value)
    assert not work.exists() and not (tmp_path / "ref").exists()


@pytest.mark.parametrize("config", ["h200.yaml", "learning_gpu.yaml"])
def test_a_gpu_window_on_another_gpu_than_campaign_gpu_is_one_line_and_writes_nothing(tmp_path, capsys, monkeypatch,
                                                                                      config):
    """campaign.gpu: H200 and an H100 visible: every run of the window would be refused by campaign unpack, so
    the window is refused at its start, before it writes anything."""
    asked = fake_gpu(monkeypatch, "NVIDIA H100 80GB HBM3")
    work = tmp_path / "w"
    code = main(["campaign", "run", "--config", str(ROOT / "config" / config), "--minutes", "1", "--work", str(work),
                 "--reference", str(tmp_path / "ref")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert "campaign.gpu = 'H200'" in err[0] and "'NVIDIA H100 80GB HBM3'" in err[0] and "--cpu" in err[0], err
    assert asked and not work.exists() and not (tmp_path / "ref").exists()


@pytest.mark.parametrize("config", ["h200.yaml", "learning_gpu.yaml"])
def test_the_gpu_campaign_gpu_names_passes_the_device_check(monkeypatch, config):
    """The GPU's full name holds campaign.gpu's text (case aside), as campaign unpack matches it; the name of a
    device that the runs and a pretrain entry share (learning_gpu.yaml's cuda) is asked once: each child costs
    seconds of importing torch."""
    monkeypatch.chdir(ROOT)
    asked = fake_gpu(monkeypatch, "NVIDIA h200")
    Campaign(ROOT / "config" / config).check_devices()
    assert asked == [torch.device("cuda")]


def test_the_cpu_form_asks_no_gpu_name(tmp_path, monkeypatch):
    """--cpu runs on the CPU whatever GPU is visible: campaign.gpu is not checked against it."""
    asked = fake_gpu(monkeypatch, "NVIDIA H100 80GB HBM3")
    Campaign(CONFIG, cpu=True).check_devices()
    assert asked == []


def test_a_pretrain_device_set_in_the_entry_s_config_file_is_checked_too(tmp_path, monkeypatch):
    """A pretrain entry whose config file (not its set) names a device this machine lacks: the model's
    pre-training would fail in the window, and every run reading the model after it."""
    import torch
    import yaml

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.chdir(ROOT)  # the sweep's files are relative to the repository
    pretrain = yaml.safe_load((ROOT / "config" / "pretrain.yaml").read_text())
    (tmp_path / "pretrain.yaml").write_text(yaml.safe_dump({**pretrain, "device": "cuda"}))
    sweep = yaml.safe_load((ROOT / "config" / "learning.yaml").read_text())
    [label] = sweep["pretrain"]
    sweep["pretrain"][label]["config"] = str(tmp_path / "pretrain.yaml")
    (tmp_path / "sweep.yaml").write_text(yaml.safe_dump(sweep, sort_keys=False))
    with pytest.raises(UserError) as refused:  # the methods' check: the answer kept for config/learning.yaml's runs
        Campaign(tmp_path / "sweep.yaml").check_devices()
    assert f"pretrain.{label}.device = 'cuda': expected cpu: CUDA is not available" in str(refused.value)
    assert "--cpu" in str(refused.value)


@pytest.mark.parametrize("where", ["set", "methods", "base file"])
def test_a_pretrain_entrys_model_set_outside_models_is_pretrained_and_the_cpu_forms(tmp_path, monkeypatch, where):
    """The sweep's jobs read the model.pretrained of their composed config, wherever the sweep sets it; the window
    took the models to pre-train from the runs' overrides (a base config file's was none: nothing pre-trained, every
    run failed), and the --cpu form put its own model folder (<label>-cpu) in the models entries only: with `set`,
    a base file or a methods entry naming it, its runs read the sweep's own model and none was pre-trained."""
    from helpers import sweep_checks_here

    monkeypatch.chdir(ROOT)
    sweep = yaml.safe_load((ROOT / "config" / "learning_gpu.yaml").read_text())
    [label] = sweep["pretrain"]
    folder = sweep["models"][label].pop("model.pretrained")
    if where == "set":
        sweep["set"]["model.pretrained"] = folder
    elif where == "methods":
        for overrides in sweep["methods"].values():
            overrides["model"] = {"pretrained": folder}
    else:
        base: dict = {}
        for key, value in {**sweep["base"], "model.pretrained": folder}.items():
            *parents, last = key.split(".")
            node = base
            for part in parents:
                node = node.setdefault(part, {})
            node[last] = value
        (tmp_path / "base.yaml").write_text(yaml.safe_dump(base))
        sweep["base"] = str(tmp_path / "base.yaml")
    (tmp_path / "sweep.yaml").write_text(yaml.safe_dump(sweep, sort_keys=False))
    with sweep_checks_here():
        for cpu, suffix in ((False, ""), (True, campaign_module.CPU_MODEL_SUFFIX)):
            campaign = Campaign(tmp_path / "sweep.yaml", cpu=cpu)
            assert campaign.pretrained_models() == {label + suffix: Path(folder + suffix)}, cpu
            assert {run["pretrained"] for run in campaign.sweep.runs.values()} == {folder + suffix}, cpu


def finished_run(campaign: Campaign, folder: Path) -> None:
    """A finished run of ``campaign`` in ``folder`` (named after its run id) as a window takes it: the files campaign
    unpack requires of one (summary ok, the config the sweep composes, env.json, metrics.jsonl)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(campaign.config_of(folder.name)))
    (folder / "summary.json").write_text(json.dumps({"status": "ok"}))
    (folder / "env.json").write_text("{}")
    (folder / "metrics.jsonl").write_text(json.dumps({"iteration": 0, "status": "ok"}) + "\n")


def test_a_run_written_before_a_key_existed_is_finished_and_another_value_is_not(tmp_path, cpu_campaign):
    """A key added to the run config since a reference run was recorded (model.guidance) is absent from its
    config.json: it counts as its default, as a rerun compares a folder's config, so the run stays finished and is
    not run again; a value other than the sweep's is another run."""
    run_id = next(iter(cpu_campaign.sweep.runs))
    folder = tmp_path / "runs" / run_id
    finished_run(cpu_campaign, folder)
    written = json.loads((folder / "config.json").read_text())
    assert written["model"].pop("guidance") == 1.0
    (folder / "config.json").write_text(json.dumps(written))
    assert cpu_campaign.finished(folder, run_id) and cpu_campaign.done(tmp_path) == {run_id}
    written["model"]["guidance"] = 3.5
    (folder / "config.json").write_text(json.dumps(written))
    assert not cpu_campaign.finished(folder, run_id) and cpu_campaign.done(tmp_path) == set()


@pytest.mark.parametrize("name", archive_module.REQUIRED_RUN_FILES)
def test_a_run_folder_file_that_is_a_named_pipe_is_no_finished_run(tmp_path, cpu_campaign, name):
    """A window reads the reference's and work folder's runs to find those finished: a named pipe there (a shared
    results folder) made the window wait on it for ever."""
    run_id = next(iter(cpu_campaign.sweep.runs))
    folder = tmp_path / "runs" / run_id
    finished_run(cpu_campaign, folder)
    assert cpu_campaign.finished(folder, run_id)
    (folder / name).unlink()
    os.mkfifo(folder / name)
    with not_hung():
        assert not cpu_campaign.finished(folder, run_id) and cpu_campaign.done(tmp_path) == set()


@pytest.mark.parametrize("name", archive_module.RUN_FILES)
def test_a_run_folder_file_that_is_a_symbolic_link_is_no_finished_run(tmp_path, cpu_campaign, name):
    """A run folder (of the reference or the work folder) whose summary.json or another of its files was a link to
    a file counted as finished: is_file() follows the link, though unpack refuses an archive's link, which a
    window packed as one. Each of a run's files there is a regular file, not a link."""
    run_id = next(iter(cpu_campaign.sweep.runs))
    folder = tmp_path / "runs" / run_id
    finished_run(cpu_campaign, folder)
    if not (folder / name).exists():  # a file a finished run may have
        (folder / name).write_text("{}\n" if name.endswith(".json") else "")
    assert cpu_campaign.finished(folder, run_id)
    (tmp_path / "elsewhere").mkdir()
    (folder / name).rename(tmp_path / "elsewhere" / name)
    (folder / name).symlink_to(tmp_path / "elsewhere" / name)
    assert (folder / name).is_file() and not cpu_campaign.finished(folder, run_id)
    assert cpu_campaign.done(tmp_path) == set()


RECORD_0 = json.dumps({"iteration": 0, "status": "ok"}) + "\n"


@pytest.mark.parametrize("records, words", [
    ("", "metrics.jsonl holds no records"),
    ("\n", "metrics.jsonl holds no records"),
    (RECORD_0 + '{"iteration": 1, "sta', "metrics.jsonl: line 2 is not valid JSON"),  # torn: a run killed mid-write
    (RECORD_0.replace("0", "1"), "metrics.jsonl starts at iteration 1; expected 0"),
    (RECORD_0 * 2, "'iteration' = 0: expected each iteration once"),
    (json.dumps({"iteration": 0}) + "\n", "record 1: "),
    ("[]\n", "line 1 is not a JSON object"),
])
def test_a_run_whose_records_unpack_refuses_is_not_done(tmp_path, cpu_campaign, records, words):
    """campaign status and a window counted a run done from its files, summary and config: an empty (or torn)
    metrics.jsonl was done, though campaign unpack refuses it, and no window ran it again. A run is done only with
    records that unpack's own check of a run takes."""
    run_id = next(iter(cpu_campaign.sweep.runs))
    folder = tmp_path / "runs" / run_id
    finished_run(cpu_campaign, folder)
    assert cpu_campaign.done(tmp_path) == {run_id}
    (folder / "metrics.jsonl").write_text(records)
    assert not cpu_campaign.finished(folder, run_id) and cpu_campaign.done(tmp_path) == set()
    files = {path.name: path.read_bytes() for path in folder.iterdir()}
    with pytest.raises(UserError, match=f"^archive A: runs/{run_id}/.*{re.escape(words)}"):
        archive_module._check_run(cpu_campaign, "archive A", run_id, files)


@pytest.mark.parametrize("summary, records, words", [
    # a metrics.jsonl cut at a line's end after the summary was written: fewer records than the run's iterations
    ({"last_good_iteration": 3}, RECORD_0, "metrics.jsonl: no ok record of iteration 3, the last good one"),
    ({"iterations": 4}, RECORD_0, "summary.json: iterations = 4, where metrics.jsonl holds 1 record"),
    ({}, RECORD_0.replace('"ok"', '"oom"'), "summary.json: status = 'ok', where metrics.jsonl record 1 has 'oom'"),
    # lines a text reader would split or strip otherwise (a byte order mark, a line break inside a line)
    ({}, "\ufeff" + RECORD_0, "metrics.jsonl: line 1 is not valid JSON (Unexpected UTF-8 BOM"),
    ({}, RECORD_0.replace("\n", "\u2028"), "metrics.jsonl: line 1 is not valid JSON (Extra data"),
])
def test_a_run_whose_summary_and_records_disagree_is_not_done(tmp_path, cpu_campaign, summary, records, words):
    """A run whose summary says ok over records that do not end it (cut after the summary was written, the last
    good iteration missing, a record of another end) was done for campaign status and a window, packed, and
    refused only when unpack wrote the reference's tables, naming a path of the reference: no window ran it again.
    Unpack's check of a run, and so a window's, makes the report's checks of a run that ended."""
    run_id = next(iter(cpu_campaign.sweep.runs))
    folder = tmp_path / "runs" / run_id
    finished_run(cpu_campaign, folder)
    (folder / "summary.json").write_text(json.dumps({"status": "ok", **summary}))
    (folder / "metrics.jsonl").write_text(records, encoding="utf-8")
    assert not cpu_campaign.finished(folder, run_id) and cpu_campaign.done(tmp_path) == set()
    files = {path.name: path.read_bytes() for path in folder.iterdir()}
    with pytest.raises(UserError, match=f"^archive A: runs/{run_id}/{re.escape(words)}"):
        archive_module._check_run(cpu_campaign, "archive A", run_id, files)


@pytest.mark.parametrize("name, text, words", [
    ("env.json", "not json", "env.json: is not JSON"),
    ("env.json", "[]", "env.json: holds a list"),
    ("plan.json", '{"bytes": 3}', "bytes = 3: expected an object or null"),
    ("evaluations.jsonl", '{"iteration": 0', "evaluations.jsonl: line 1 is not valid JSON"),  # torn: killed mid-write
])
def test_a_run_whose_other_files_unpack_refuses_is_not_done(tmp_path, cpu_campaign, name, text, words):
    """Records aside, a run whose env.json, plan.json or evaluations.jsonl unpack refuses was done too, and no
    window ran it again: each is read as unpack reads it."""
    run_id = next(iter(cpu_campaign.sweep.runs))
    folder = tmp_path / "runs" / run_id
    finished_run(cpu_campaign, folder)
    (folder / name).write_text(text)
    assert not cpu_campaign.finished(folder, run_id) and cpu_campaign.done(tmp_path) == set()
    files = {path.name: path.read_bytes() for path in folder.iterdir()}
    with pytest.raises(UserError, match=f"^archive A: runs/{run_id}/.*{re.escape(words)}"):
        archive_module._check_run(cpu_campaign, "archive A", run_id, files)


@pytest.mark.parametrize("summary, words", [
    ({}, "summary.json: no 'status'"),  # a file's own reading: the file's path
    ({"status": "ok", "iterations": 2}, "summary.json: iterations = 2, where metrics.jsonl"),  # across files: run DIR
])
def test_a_run_read_from_a_folder_with_a_control_character_is_named_after_where(tmp_path, cpu_campaign, summary,
                                                                                  words):
    """read_run names a run's file after ``where`` instead of the folder's path; a folder whose path held a newline
    was shown quoted by the readers and kept, quoted, in the line."""
    run_id = next(iter(cpu_campaign.sweep.runs))
    folder = tmp_path / "a\nb" / run_id
    finished_run(cpu_campaign, folder)
    (folder / "summary.json").write_text(json.dumps(summary))
    with pytest.raises(UserError) as refused:
        archive_module.read_run(f"archive A: runs/{run_id}", folder)
    assert str(refused.value).startswith(f"archive A: runs/{run_id}/{words}"), refused.value
    assert "a\\nb" not in str(refused.value) and str(tmp_path) not in str(refused.value)


def test_the_reference_s_manifest_lists_only_the_runs_a_window_counts_done(tmp_path, cpu_campaign):
    """A run folder of the reference that is not the sweep's finished run (another config, a summary that did not
    end ok: put there by hand) went into the reference's manifest and tables as the sweep's run, while campaign
    status counted it missing. The manifest lists the runs a window counts done; the folder is left as it is."""
    reference = tmp_path / "reference"
    done, other, ended = list(cpu_campaign.sweep.runs)[:3]
    for run_id in (done, other, ended):
        finished_run(cpu_campaign, reference / "runs" / run_id)
    config = json.loads((reference / "runs" / other / "config.json").read_text())
    (reference / "runs" / other / "config.json").write_text(json.dumps({**config, "progress": not config["progress"]}))
    (reference / "runs" / ended / "summary.json").write_text(json.dumps({"status": "interrupted"}))
    before = tree(reference)
    manifest = archive_module.reference_manifest(cpu_campaign, reference)
    assert [Path(entry["dir"]).name for entry in manifest["runs"]] == [done] == sorted(cpu_campaign.done(reference))
    assert tree(reference) == before


@pytest.mark.parametrize("name", ["env.json", "metrics.jsonl"])
def test_a_reference_run_without_a_file_unpack_requires_is_missing_in_status(tmp_path, capsys, cpu_campaign, name):
    """campaign status (and a window) counted a run as done from its summary and config alone: a reference run
    folder without its records or its env.json, which campaign unpack refuses and the tables cannot read, was
    done, and no window ran it again. A run is done only with every file unpack requires of a finished one."""
    run_id = next(iter(cpu_campaign.sweep.runs))
    reference = tmp_path / "ref"
    finished_run(cpu_campaign, reference / "runs" / run_id)
    args = ["campaign", "status", "--config", str(CONFIG), "--cpu", "--reference", str(reference), "--work",
            str(tmp_path / "w")]
    assert main(args) == 0 and json.loads(capsys.readouterr().out)["done"] == 1
    (reference / "runs" / run_id / name).unlink()
    assert main(args) == 0
    shown = json.loads(capsys.readouterr().out)
    run = cpu_campaign.sweep.runs[run_id]
    assert shown["done"] == 0 and run["method"] in shown["cells"][Campaign.cell_of(run)]["missing"]


@pytest.mark.parametrize("args, words", [
    # a file where the work folder keeps its run folders: every later window refused the work folder
    (["--archive", "{w}/runs/x.tar.gz"], "--archive {w}/runs/x.tar.gz: inside --work {w}, whose folders hold"),
    (["--archive", "{w}/logs/a.tar.gz"], "--archive {w}/logs/a.tar.gz: inside --work {w}"),
    (["--reference", "{r}", "--archive", "{r}/a.tar.gz"], "--archive {r}/a.tar.gz: inside --reference {r}"),
    # the work folder as the reference: its runs counted as the reference's, and the archive packed none of them
    (["--reference", "{w}"], "--reference {w}: the work folder {w} or a folder in or around it"),
    (["--reference", "{w}/reference"], "--reference {w}/reference: the work folder {w} or a folder in or around it"),
])
def test_a_window_s_folders_that_overlap_are_one_line(tmp_path, capsys, args, words):
    w, r = tmp_path / "w", tmp_path / "r"
    args = [a.format(w=w, r=r) for a in args]
    code = main(["campaign", "run", "--config", str(CONFIG), "--cpu", "--minutes", "1", "--work", str(w), *args])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and words.format(w=w, r=r) in err[0], err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("reference, work", [("{t}/r", "{t}/r"), ("{t}/r/w", "{t}/r"), ("{t}/w/r", "{t}/w")])
def test_status_of_a_reference_and_work_folder_that_overlap_is_one_line(tmp_path, capsys, reference, work):
    """campaign run keeps the reference and the work folder apart; status counted the same runs as both."""
    reference, work = reference.format(t=tmp_path), work.format(t=tmp_path)
    code = main(["campaign", "status", "--config", str(CONFIG), "--cpu", "--reference", reference, "--work", work])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert f"--reference {reference}: the work folder {work} or a folder in or around it" in err[0], err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("action, args, words", [
    # a window wrote a gzip-compressed tar under any name, which unpack would then be given
    ("run", ["--minutes", "1", "--work", "{t}/w", "--archive", "{t}/a.zip"], "--archive {t}/a.zip: expected a FILE.tar.gz"),
    ("run", ["--minutes", "1", "--work", "{t}/w", "--archive", "{t}/.tar.gz"], "--archive {t}/.tar.gz: expected a FILE"),
    # someone's folder (a run's) as the reference or the work folder was read as holding nothing: all runs missing
    ("status", ["--reference", "{t}/theirs"], "--reference {t}/theirs: the folder holds files that are not agg-bench "
                                              "reference results (notes.txt)"),
    ("status", ["--work", "{t}/theirs"], "--work {t}/theirs: the folder holds files that are not an agg-bench "
                                         "campaign work folder (notes.txt)"),
    ("run", ["--minutes", "1", "--work", "{t}/w", "--reference", "{t}/theirs"], "--reference {t}/theirs: the folder "
                                                                                "holds files that are not"),
])
def test_an_archive_name_or_a_folder_a_window_or_status_cannot_take_is_one_line(tmp_path, capsys, action, args, words):
    (tmp_path / "theirs").mkdir()
    (tmp_path / "theirs" / "notes.txt").write_text("mine")
    code = main(["campaign", action, "--config", str(CONFIG), "--cpu", *(a.format(t=tmp_path) for a in args)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and words.format(t=tmp_path) in err[0], err
    assert tree(tmp_path) == {"theirs/notes.txt": b"mine"} and sorted(p.name for p in tmp_path.iterdir()) == ["theirs"]


@pytest.mark.parametrize("action, flag, args", [
    ("run", "--reference", ["--minutes", "1", "--work", "{t}/w"]), ("run", "--work", ["--minutes", "1"]),
    ("status", "--reference", ["--work", "{t}/w"]), ("status", "--work", ["--reference", "{t}/r"]),
    ("unpack", "--reference", ["--archive", "{t}/a.tar.gz"])])
def test_a_symlinked_reference_or_work_folder_is_one_line_naming_the_link(tmp_path, capsys, action, flag, args):
    """A link given as --reference or --work was refused as "is not a folder", where it points to one."""
    (tmp_path / "folder").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "folder")
    code = main(["campaign", action, "--config", str(CONFIG), "--cpu", *(a.format(t=tmp_path) for a in args),
                 flag, str(tmp_path / "link")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert f"{flag} {tmp_path / 'link'}: is a symbolic link; give the folder it points to" in err[0], err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["folder", "link"] and not any((tmp_path / "folder").iterdir())


def test_an_unpack_does_not_look_at_the_work_folder_it_never_reads(tmp_path, capsys, monkeypatch):
    """unpack reads no --work (it refuses one), yet the default results/campaign was checked: where it is a link
    (to scratch storage), every unpack was refused as '--work results/campaign: is a symbolic link'."""
    share_kept_checks(tmp_path)  # the campaign's methods check, not made again in a child process
    monkeypatch.chdir(tmp_path)
    (tmp_path / "scratch").mkdir()
    (tmp_path / "results").mkdir()
    (tmp_path / "results" / "campaign").symlink_to(tmp_path / "scratch")
    archive = logs_archive(tmp_path / "a.tar.gz", "20251231T000000")
    code = main(["campaign", "unpack", "--config", str(CONFIG), "--cpu", "--archive", str(archive),
                 "--reference", "reference"])
    assert code == 0, capsys.readouterr().err
    assert (tmp_path / "reference" / "windows" / "20251231T000000.json").is_file()


@pytest.mark.parametrize("action, args, words", [
    ("status", ["--minutes", "3"], "campaign status: --minutes is an option of campaign run"),
    ("status", ["--started", "1"], "campaign status: --started is an option of campaign run"),
    ("unpack", ["--archive", "a.tar.gz", "--reference", "r", "--minutes", "3"], "campaign unpack: --minutes is"),
    ("unpack", ["--archive", "a.tar.gz", "--reference", "r", "--work-name", "W"], "campaign unpack: --work-name is"),
    ("unpack", ["--reference", "r"], "campaign unpack needs the archive (--archive FILE)"),
    ("unpack", ["--archive", "a.tar.gz"], "campaign unpack needs the reference folder"),
])
def test_an_option_another_action_would_ignore_is_one_line(tmp_path, capsys, action, args, words):
    """A window's --minutes or --started given to status or unpack was ignored without a word."""
    code = main(["campaign", action, "--config", str(CONFIG), "--cpu", *args])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and words in err[0], err


@pytest.mark.parametrize("action", ["run", "status"])
@pytest.mark.parametrize("text, words", [
    ((ROOT / "config" / "run.yaml").read_text(), "device = 'cpu': expected a known key here"),
    ("devices: {}\n", "base = (not given): expected a string or a mapping"),
])
def test_a_config_that_is_not_a_sweep_is_one_line_with_cpu(tmp_path, capsys, action, text, words):
    """--cpu made the CPU form of the config before checking it: a run config, or a sweep without models, ended
    in a KeyError's traceback (exit 1) instead of the schema's line."""
    config = tmp_path / "not_a_sweep.yaml"
    config.write_text(text)
    code = main(["campaign", action, "--config", str(config), "--cpu", "--work", str(tmp_path / "w"),
                 *(["--minutes", "1"] if action == "run" else [])])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "sweep config" in err[0] and words in err[0], err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["not_a_sweep.yaml"]


@pytest.mark.parametrize("cpu", [True, False])
@pytest.mark.parametrize("action", ["run", "status"])
@pytest.mark.parametrize("setting, words", [
    ({"lr": -1}, "lr = -1: expected a number > 0 and <= 1"),
    ({"seed": "7"}, "seed = '7': expected an integer"),  # the text '7', as the pretrain process is given it
])
def test_a_pretrain_entry_its_process_refuses_is_one_line_before_a_window(tmp_path, capsys, monkeypatch, cpu, action,
                                                                         setting, words):
    """A learning sweep's pretrain entry that `agg-bench pretrain` refuses was found only by the window's pretrain
    process: the window pre-trained nothing, ran nothing and packed an empty archive, exit 0. Now one line names
    the entry as the file has it, exit 2, and nothing is written."""
    import yaml

    sweep = yaml.safe_load((ROOT / "config" / "learning_gpu.yaml").read_text())
    [label] = sweep["pretrain"]
    sweep["pretrain"][label]["set"].update(setting)
    config = tmp_path / "sweep.yaml"
    config.write_text(yaml.safe_dump(sweep, sort_keys=False))
    monkeypatch.chdir(ROOT)  # the sweep's files (config/pretrain.yaml, the prompts) are relative to the repository
    code = main(["campaign", action, "--config", str(config), *(["--cpu"] if cpu else []), "--work",
                 str(tmp_path / "w"), *(["--minutes", "1", "--archive", str(tmp_path / "a.tar.gz")]
                                        if action == "run" else [])])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and f"sweep config: pretrain.{label}: config error: {words}" in err[0], err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["sweep.yaml"]


def test_a_work_folder_of_other_files_is_refused(tmp_path, capsys):
    (tmp_path / "w").mkdir()
    (tmp_path / "w" / "notes.txt").write_text("mine")
    assert main(["campaign", "run", "--config", str(CONFIG), "--cpu", "--minutes", "1", "--work",
                 str(tmp_path / "w")]) == 2
    assert "notes.txt" in capsys.readouterr().err and tree(tmp_path / "w") == {"notes.txt": b"mine"}


def test_the_script_says_in_one_line_what_is_missing(tmp_path):
    def script(*args: str, **env: str):
        proc = subprocess.run(["bash", str(SCRIPT), *args], cwd=tmp_path, env=script_env(tmp_path, **env),
                              capture_output=True, text=True, timeout=300)
        return proc.returncode, proc.stderr.strip().splitlines()

    import torch

    if not torch.cuda.is_available():  # the module checks passed at once: the CUDA check asks this interpreter
        code, err = script("--minutes", "1", PYTHON=str(stub_python(tmp_path / "bin", has_modules=True)))
        assert code == 2 and len(err) == 1 and "sees no CUDA device" in err[0] and "--cpu" in err[0]
    code, err = script("--gpu")
    assert code == 2 and err[-1].startswith("gpu_campaign: unknown option '--gpu'; usage: ")
    code, err = script("--cpu")  # no --minutes
    assert code == 2 and err[-1].startswith("gpu_campaign: --minutes N is required") and "usage" in err[-1]
    # an option given twice: the second replaced the first without a word (a window of 2 minutes, not 1)
    for option, values in (("--minutes", ("1", "2")), ("--config", ("a.yaml", "b.yaml")), ("--reference", ("r", "s"))):
        code, err = script("--cpu", *(["--minutes", "1"] if option != "--minutes" else []), option, values[0], option,
                           values[1])
        assert code == 2 and err == [f"gpu_campaign: {option} given twice ('{values[0]}', then '{values[1]}'); expected "
                                     f"it once; usage: scripts/gpu_campaign.sh [--cpu] [--config FILE] [--reference "
                                     "DIR] --minutes N"], err
    code, err = script("--cpu", "--minutes")
    assert code == 2 and err[-1].startswith("gpu_campaign: --minutes needs a value; usage: ")
    code, err = script("--cpu", "--minutes", "1", PYTHON="/nonexistent/python")
    assert code == 2 and len(err) == 1 and "cannot import torch" in err[0]
    assert not (tmp_path / "work").exists()


def stub_python(folder: Path, lacks: str | None = None, has_modules: bool = False, imports: bool = False) -> Path:
    """An interpreter that imports as this one does (``lacks``: a module it has not: neither imported nor found)
    and, asked to run agg_bench, writes its folder and arguments to ``<folder>/argv`` instead. ``has_modules``:
    the script's module checks (pick_python's ``import A,B,C``, require_modules' look for each) pass at once,
    without a Python that imports torch; ``imports``: pick_python's passes at once, require_modules' looks for
    each module in this interpreter; every other ``-c`` runs in this interpreter."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "site").mkdir(exist_ok=True)
    if lacks:  # a module None in sys.modules is neither imported nor found by importlib.util.find_spec
        (folder / "site" / "sitecustomize.py").write_text(f"import sys\nsys.modules[{lacks!r}] = None\n")
    checks = "if [[ $1 == -c && ( $2 =~ ^import\\ [A-Za-z_.,]+$ || $2 == *find_spec* ) ]]; then exit 0; fi\n" \
        if has_modules else "if [[ $1 == -c && $2 =~ ^import\\ [A-Za-z_.,]+$ ]]; then exit 0; fi\n" if imports else ""
    return bash_script(folder / "python", f'{checks}if [[ $1 == -c ]]; then PYTHONPATH="{folder / "site"}:$PYTHONPATH" '
                                          f'exec "{sys.executable}" "$@"; fi\n{{ pwd; printf "%s\\n" "$@"; }} > '
                                          f'"{folder}/argv"')


def test_the_script_takes_relative_paths_from_the_folder_it_is_started_in(tmp_path, capsys):
    """Started outside the repository, --config, --reference, AGG_BENCH_CAMPAIGN_OUT and a relative PYTHON name
    paths from there: the script runs the campaign in the repository, where they named other files (or none)."""
    start = tmp_path / "start"
    stub_python(start / "bin", has_modules=True)  # the paths are the point, not the interpreter's modules
    shutil.copyfile(CONFIG, start / "mine.yaml")
    proc = subprocess.run(["bash", str(SCRIPT), "--cpu", "--minutes", "1", "--config", "mine.yaml", "--reference",
                           "ref"], cwd=start, env=script_env(tmp_path, PYTHON="bin/python", AGG_BENCH_CAMPAIGN_OUT="w"),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    cwd, *argv = (start / "bin" / "argv").read_text().splitlines()
    assert Path(cwd) == ROOT and argv[:3] == ["-m", "agg_bench", "campaign"]
    given = dict(zip(argv[4::2], argv[5::2]))
    assert given["--config"] == str(start / "mine.yaml") and given["--reference"] == str(start / "ref")
    assert given["--work"] == str(start / "w") and "--cpu" in argv
    assert given["--work-name"] == "AGG_BENCH_CAMPAIGN_OUT"  # what its errors call the work folder
    assert "--reference-name" not in argv  # the reference is the script's --reference, which its user typed
    # a ~ that no shell expanded (quoted) is passed on as it is, for agg-bench to refuse: under the start folder
    # it named a folder called ~
    proc = subprocess.run(["bash", str(SCRIPT), "--cpu", "--minutes", "1", "--reference", "~/ref"], cwd=start,
                          env=script_env(tmp_path, PYTHON="bin/python", AGG_BENCH_CAMPAIGN_OUT="~/w"),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    given = dict(zip(*[iter((start / "bin" / "argv").read_text().splitlines()[5:])] * 2))
    assert (given["--work"], given["--reference"]) == ("~/w", "~/ref")
    # the reference from AGG_BENCH_CAMPAIGN_REFERENCE: errors about it name that variable; without it, the default
    for env, named in (({"AGG_BENCH_CAMPAIGN_REFERENCE": "ref2"}, "AGG_BENCH_CAMPAIGN_REFERENCE"),
                       ({"AGG_BENCH_CAMPAIGN_REFERENCE": ""}, None)):
        proc = subprocess.run(["bash", str(SCRIPT), "--cpu", "--minutes", "1"], cwd=start,
                              env=script_env(tmp_path, PYTHON="bin/python", **env), capture_output=True, text=True,
                              timeout=300)
        assert proc.returncode == 0, proc.stderr
        given = dict(zip(*[iter((start / "bin" / "argv").read_text().splitlines()[5:])] * 2))
        assert given["--reference"] == (str(start / "ref2") if named else "results/reference/h200")
        assert given.get("--reference-name") == named, given
    # a ~ in either variable: the campaign's refusal of it (the command line the script built, run here) names
    # the variable, not --reference or --work, which the script's user never typed
    for env, named in (({"AGG_BENCH_CAMPAIGN_REFERENCE": "~/ref", "AGG_BENCH_CAMPAIGN_OUT": "~/w"},
                        "AGG_BENCH_CAMPAIGN_REFERENCE '~/ref'"),
                       ({"AGG_BENCH_CAMPAIGN_OUT": "~/w"}, "AGG_BENCH_CAMPAIGN_OUT '~/w'")):
        proc = subprocess.run(["bash", str(SCRIPT), "--cpu", "--minutes", "1"], cwd=start,
                              env=script_env(tmp_path, PYTHON="bin/python", **env), capture_output=True, text=True,
                              timeout=300)
        assert proc.returncode == 0, proc.stderr
        capsys.readouterr()
        assert main((start / "bin" / "argv").read_text().splitlines()[3:]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(f"agg-bench campaign: {named}: starts with ~,"), err


def test_the_script_checks_every_module_a_window_imports(tmp_path):
    """An interpreter without peft passed the script's check and ran the window: each LoRA run (FLUX.1-dev,
    Qwen-Image) then failed on it, minutes in. It is one line and exit code 2 before anything runs."""
    # pick_python's import of torch, diffusers and agg_bench passes as it did (it needs no peft) without a Python
    # that imports them (5 CPU-seconds); require_modules looks for peft in this interpreter, which lacks it
    stub = stub_python(tmp_path / "bin", lacks="peft", imports=True)
    proc = subprocess.run(["bash", str(SCRIPT), "--cpu", "--minutes", "1"], cwd=tmp_path,
                          env=script_env(tmp_path, PYTHON=str(stub)), capture_output=True, text=True, timeout=300)
    err = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(err) == 1 and "cannot import peft" in err[0], err
    assert not (tmp_path / "bin" / "argv").exists() and not (tmp_path / "work").exists()


def test_an_interpreter_that_cannot_look_for_the_modules_is_one_plain_line(tmp_path):
    """The module check's own failure was shown as a list of modules, its words comma-separated ("cannot import
    (the, check, failed:, ...)"); it is its last line of error, as it stands."""
    stub = stub_python(tmp_path / "bin", imports=True)  # pick_python's import passes without importing torch
    text = stub.read_text()
    stub.write_text(text.replace("#!/bin/bash\n", '#!/bin/bash\nif [[ $2 == *find_spec* ]]; then '
                                                   'echo "MemoryError: no room" >&2; exit 1; fi\n', 1))
    proc = subprocess.run(["bash", str(SCRIPT), "--cpu", "--minutes", "1"], cwd=tmp_path,
                          env=script_env(tmp_path, PYTHON=str(stub)), capture_output=True, text=True, timeout=300)
    err = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and err == [f"gpu_campaign: {stub} could not look for its modules (MemoryError: no "
                                            "room); set PYTHON to an interpreter with agg-bench's requirements"], err
    assert not (tmp_path / "bin" / "argv").exists() and not (tmp_path / "work").exists()


def test_a_window_shorter_than_the_grace_kills_at_its_deadline(tmp_path, monkeypatch):
    """--minutes 1e-9 (any window whose stop margin is shorter than KILL_AFTER_S) ran 12 s past its deadline: a
    process that ignores SIGTERM was killed KILL_AFTER_S after it, whatever the deadline. It is killed at the
    deadline now. The clock is counted (each poll adds POLL_S), so the kill's time is exact."""
    stubborn = [sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                "print('up', flush=True); time.sleep(60)"]
    log = tmp_path / "a.log"
    clock = {"now": 1000.0}

    def sleep(seconds):  # the counted clock moves on only once the process ignores SIGTERM
        while "up" not in (log.read_text() if log.exists() else ""):
            time.sleep(0.05)
        clock["now"] += seconds

    monkeypatch.setattr(campaign_module, "time", types.SimpleNamespace(time=lambda: clock["now"], sleep=sleep))
    killed = []
    kill = campaign_module._kill_group
    monkeypatch.setattr(campaign_module, "_kill_group", lambda pgid: (killed.append(clock["now"]), kill(pgid)))
    stop_at, deadline = 1001.0, 1002.0  # SIGTERM at the stop, one second of the 12 s grace left
    code, how = campaign_module._supervise(stubborn, log, dict(os.environ), stop_at, deadline=deadline)
    assert code == -signal.SIGKILL and how == "stopped at the deadline (killed)"
    assert killed == [deadline]


def test_a_process_is_stopped_at_the_deadline_and_killed_when_it_does_not_stop(tmp_path, monkeypatch):
    monkeypatch.setattr(campaign_module, "KILL_AFTER_S", 1.0)
    stubborn = [sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                "print('up', flush=True); time.sleep(60)"]
    polite = [sys.executable, "-c", "import time; print('up', flush=True); time.sleep(60)"]
    env = dict(os.environ)
    began = time.monotonic()
    code, how = campaign_module._supervise(polite, tmp_path / "a.log", env, time.time() + 1.0)
    assert code == -signal.SIGTERM and how == "stopped at the deadline" and time.monotonic() - began < 10
    code, how = campaign_module._supervise(stubborn, tmp_path / "b.log", env, time.time() + 1.0)
    assert code == -signal.SIGKILL and how == "stopped at the deadline (killed)"
    # the campaign itself was told to stop: its process is stopped at once
    code, how = campaign_module._supervise(polite, tmp_path / "c.log", env, time.time() + 60, lambda: True)
    assert code == -signal.SIGTERM and how == "interrupted"


# a supervised process that ignores SIGTERM and has started a process of its own (its group's other member)
STUBBORN = """
import os, signal, subprocess, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
grandchild = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
open(sys.argv[1] + ".tmp", "w").write(f"{os.getpid()} {grandchild.pid}")
os.rename(sys.argv[1] + ".tmp", sys.argv[1])
time.sleep(600)
"""
# a campaign's way of supervising a process: in a worker thread, the main thread free to take the signals
SUPERVISOR = """
import concurrent.futures, os, sys, time
from pathlib import Path
from agg_bench import stopping
from agg_bench.tools import campaign
argv = [sys.executable, "-c", sys.argv[1], sys.argv[2]]
with stopping.stop_signals("agg-bench campaign"), stopping.safe_points():
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        future = pool.submit(campaign._supervise, argv, Path(sys.argv[2] + ".log"), dict(os.environ), time.time() + 600)
        while not future.done():
            concurrent.futures.wait([future], timeout=0.25)
"""


def children(pid: int) -> list[int]:
    """The processes whose parent is ``pid``."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


def alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie that no one has reaped yet has ended)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc; the kernel's parent-death signal")
@pytest.mark.parametrize("how", ["second SIGTERM", "SIGKILL"])
def test_a_supervised_process_ends_with_the_campaign(tmp_path, how):
    """The campaign stopped at once (a second SIGTERM: its process group, what it started included) or killed
    (SIGKILL: the kernel's parent-death signal for the child, the guard for the child's group) takes the process
    it supervises and what that one started with it: no process of the campaign's tree remains. (The
    parent-death signal alone left the grandchild running after a SIGKILL.)"""
    pids = tmp_path / "pids"
    supervisor = subprocess.Popen([sys.executable, "-c", SUPERVISOR, STUBBORN, str(pids)], cwd=tmp_path,
                                  env={**os.environ, "PYTHONPATH": str(ROOT)}, stderr=subprocess.PIPE, text=True)
    child = grandchild = None
    try:
        waited = time.monotonic()
        while not pids.exists():
            assert supervisor.poll() is None and time.monotonic() - waited < 60, supervisor.stderr.read()
            time.sleep(0.05)
        child, grandchild = map(int, pids.read_text().split())
        started = children(supervisor.pid)  # the supervised child and its group's guard
        assert child in started and len(started) == 2
        if how == "SIGKILL":
            supervisor.kill()
        else:
            supervisor.send_signal(signal.SIGTERM)
            time.sleep(0.5)  # forwarded to the child, which ignores it
            assert alive(child)
            supervisor.send_signal(signal.SIGTERM)
        code = supervisor.wait(timeout=30)
        assert code == (-signal.SIGKILL if how == "SIGKILL" else 128 + signal.SIGTERM)
        ended = [*started, grandchild]
        waited = time.monotonic()
        while any(alive(pid) for pid in ended) and time.monotonic() - waited < 10:
            time.sleep(0.05)
        assert not any(alive(pid) for pid in ended), [pid for pid in ended if alive(pid)]
        if how == "second SIGTERM":
            assert "SIGTERM again: stopping at once" in supervisor.stderr.read()
    finally:
        supervisor.kill()
        for pid in (child, grandchild):  # what a failed assertion left
            if pid is not None and alive(pid):
                os.kill(pid, signal.SIGKILL)


# a process that starts a child through the campaign's launcher, says its pid, and waits to be killed
LAUNCHING_PARENT = """
import subprocess, sys, time
from agg_bench.tools import campaign
child = subprocess.Popen(campaign._dying_with_parent([sys.executable, "-c", "import time; time.sleep(600)"]),
                         start_new_session=True)
print(child.pid, flush=True)
time.sleep(600)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc; the kernel's parent-death signal")
def test_a_child_started_through_the_launcher_dies_with_its_parent(tmp_path):
    """The launcher sets the kernel's parent-death signal in the child before its exec (in a process of its own,
    not in a preexec_fn of the campaign, whose thread pool runs): its parent killed, the child is killed (no
    guard here), and a command that cannot be started is one line and exit code 127."""
    parent = subprocess.Popen([sys.executable, "-c", LAUNCHING_PARENT], env={**os.environ, "PYTHONPATH": str(ROOT)},
                              stdout=subprocess.PIPE, text=True)
    child = None
    try:
        assert parent.stdout is not None
        child = int(parent.stdout.readline())
        waited = time.monotonic()  # until the launcher has exec'd the child: it runs the child's command line
        while Path(f"/proc/{child}/cmdline").read_text().split("\0")[1:-1] != ["-c", "import time; time.sleep(600)"]:
            assert time.monotonic() - waited < 30
            time.sleep(0.05)
        parent.kill()
        parent.wait(timeout=30)
        waited = time.monotonic()
        while alive(child) and time.monotonic() - waited < 10:
            time.sleep(0.05)
        assert not alive(child)
    finally:
        parent.kill()
        if child is not None and alive(child):
            os.kill(child, signal.SIGKILL)
    missing = str(tmp_path / "nowhere")
    ran = subprocess.run(campaign_module._dying_with_parent([missing]), capture_output=True, text=True)
    assert (ran.returncode, ran.stderr) == (127, f"{missing}: No such file or directory\n")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the launcher of Linux's parent-death signal")
@pytest.mark.parametrize("name", ["no\nwhere", "\x1b[31mred", "\udcffbyte", "a" * 190 + "\n" + "b" * 50],
                         ids=["newline", "escape", "undecodable byte", "long"])
def test_a_command_the_launcher_cannot_start_is_one_line_as_shown_writes_it(tmp_path, name):
    """The launcher's line for a command it cannot start wrote the command as it is: a newline in its path split
    the line, an escape sequence reached the terminal. It writes the path as agg_bench.errors.shown does (quoted,
    clipped past its length), in an interpreter that imports nothing of agg_bench."""
    from agg_bench.errors import shown

    missing = str(tmp_path / name)
    ran = subprocess.run(campaign_module._dying_with_parent([missing]), capture_output=True, text=True,
                         errors="surrogateescape")
    assert (ran.returncode, ran.stderr) == (127, f"{shown(missing)}: No such file or directory\n")
    assert shown(missing) != missing and len(ran.stderr.splitlines()) == 1


def test_a_cell_starts_no_run_that_would_end_after_its_deadline(tmp_path, capsys):
    tiny = ["model.preset=tiny", "model.resolution=32", "train.iterations=1", "sampling.steps=4", "grpo.group_size=2",
            "grpo.prompts_per_iteration=1", "progress=false"]
    jobs = tmp_path / "jobs.json"
    jobs.write_text(json.dumps({"runs": [{"config": None, "set": tiny, "out": str(tmp_path / name)}
                                         for name in ("a", "b", "c")]}))
    # the first run always starts; none after it fits before a deadline that has passed by then
    assert main(["cell", str(jobs), "--deadline", f"{time.time() + 0.01:.3f}"]) == 0
    assert (tmp_path / "a" / "summary.json").is_file()
    assert not (tmp_path / "b").exists() and not (tmp_path / "c").exists()
    assert "runs 2-3 not started" in capsys.readouterr().err
    for bad in ("nan", "-5", "inf"):
        assert exit_code(["cell", str(jobs), "--deadline", bad]) == 2
        assert "--deadline" in capsys.readouterr().err


def test_a_cells_calibrations_each_price_the_rows_they_timed():
    """A cell filled over two windows has two calibrations; each row is priced and paired by the last one that
    timed its method, against the reference timed in those same rounds."""
    from agg_bench.results.costmodel import calibration_of

    first = {"full": {"wall_s": [2.0, 2.0]}, "agg": {"wall_s": [1.0, 1.0]}}
    second = {"full": {"wall_s": [4.0, 4.0]}, "fraction": {"wall_s": [2.0, 2.0]}}
    calibration = pd.DataFrame([{"model": "m", "resolution": 64, "device": "d", "source": "reference", "methods": m}
                                for m in (first, second)])
    assert calibration_of(calibration, "m", 64, "d", "agg", "reference")["methods"] is first
    assert calibration_of(calibration, "m", 64, "d", "fraction", "reference")["methods"] is second
    assert calibration_of(calibration, "m", 64, "d", "full", "reference")["methods"] is second  # the last
    assert calibration_of(calibration, "m", 64, "d", "agg", "measured") is None  # a user's rows: not these
    assert math.isclose(cpu_resolution(720), 48)


@pytest.mark.slow
def test_a_users_tables_show_the_reference_rows_beside_their_own(window, tmp_path):
    """`report.compare_with` in a sweep config: the reference's runs in the user's tables, in rows of their
    own whose hardware says "(reference)", priced by the reference's calibrations."""
    from agg_bench.results.loading import load_manifest
    from agg_bench.results.report import build_report
    from agg_bench.tools.sweep import SweepError, reference_manifest

    ref_run = json.loads((window["reference"] / "manifest.json").read_text())["runs"][0]
    own = tmp_path / "own"
    config = json.loads((Path(ref_run["dir"]) / "config.json").read_text())
    overrides = [f"{section}={json.dumps(config[section])}" for section in ("model", "sampling", "grpo", "method")]
    assert main(["run", "--set", "train.iterations=2", "--set", "progress=false", *(a for o in overrides
                 for a in ("--set", o)), "--out", str(own)]) == 0
    reference = reference_manifest(str(window["reference"]))
    manifest = {"runs": [{**{k: v for k, v in ref_run.items() if k not in ("dir", "source")}, "dir": str(own)},
                         *reference["runs"]], "calibration": reference["calibration"]}
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    tables = build_report(load_manifest(tmp_path / "manifest.json"), tmp_path / "tables")
    summary = tables["summary"]
    cell = summary[(summary["method"] == ref_run["method"]) & (summary["resolution"] == ref_run["resolution"])
                   & (summary["model"] == ref_run["model"])]
    mine, theirs = cell[cell["hardware"] == "cpu"], cell[cell["hardware"] == "cpu (reference)"]
    assert len(mine) == 1 and len(theirs) == 1 and list(theirs["source"]) == ["reference"]
    assert list(mine["source"]) == ["measured"]
    with pytest.raises(SweepError, match="report.compare_with: .* has no manifest.json"):
        reference_manifest(str(tmp_path / "nothing"))


@pytest.mark.slow
def test_full_fine_tunes_of_flux_and_qwen_do_not_fit_one_h200_and_the_lora_layouts_do():
    """What config/h200.yaml's layouts rest on, as `agg-bench plan` computes it (an H200's 139 GiB): the LoRA
    layouts fit at the largest resolution, and a full fine-tune of either model does not fit even at 512 px: its
    weights, gradients and optimizer moments alone (which a plan's total, its largest phase, holds: phase_totals)
    are more than the GPU's memory, so that the plan's count of activations on fake tensors, which takes most of
    a plan's time for a model of this size, cannot change the answer and is not made."""
    from agg_bench.config import validate
    from agg_bench.runtime.memplan import ShapeModel, gpu_memory_bytes, phase_totals, plan_memory, run_layout

    campaign = Campaign(CONFIG)
    for model in ("flux1dev", "qwenimage"):
        lora = campaign.config_of(f"full_{model}_1024px_s0_h200")
        assert lora["train"]["lora_rank"] == 64
        assert plan_memory(validate(lora), 1, suggest=False).fits, model
        full = campaign.config_of(f"full_{model}_512px_s0_h200")
        full["train"]["lora_rank"] = 0
        cfg = validate(full)
        state = ShapeModel(cfg).state_bytes(run_layout(cfg, 1))
        held = state["params"] + state["grads"] + state["optimizer"]
        assert cfg.device == "cuda" and held > gpu_memory_bytes("cuda"), model  # an H200's without a GPU here
        # the plan's total_per_gpu holds them (with no phase's own bytes: all the more with them)
        no_more = {key: 0 for key in ("activations", "optimizer_step", "decode")}
        assert max(phase_totals({**state, **no_more}).values()) >= held, model


def test_a_signal_to_the_campaign_stops_it_and_packs_what_finished(tmp_path, monkeypatch, capsys):
    """SIGTERM while a process runs: that process is stopped, no other starts, the archive and the window's log
    are written, and the command exits 143."""
    started = []

    def process(campaign, process, number, stamp, work, stop_at, deadline, python, work_name):
        started.append(process.cell)
        os.kill(os.getpid(), signal.SIGTERM)  # arrives while the window runs; only remembered there
        time.sleep(0.1)
        return [{"cell": process.cell, "runs": list(process.run_ids), "finished": [], "exit_code": -15,
                 "ended": "interrupted", "seconds": 0.1}]

    monkeypatch.setattr(campaign_module, "_run_process", process)
    work = tmp_path / "w"
    assert main(["campaign", "run", "--config", str(CONFIG), "--cpu", "--minutes", "5", "--work", str(work)]) == 143
    assert len(started) == 1 and "interrupted" in capsys.readouterr().err
    [log] = (work / "windows").glob("*.json")
    assert json.loads(log.read_text())["stopped_by_signal"] == "SIGTERM"
    with tarfile.open(work / "campaign.tar.gz") as tar:
        assert tar.getnames() == [f"windows/{log.name}"]


def test_a_run_folder_another_process_is_writing_is_left_alone(tmp_path, monkeypatch, capsys, cpu_campaign):
    """Another agg-bench process holds the claim of a run folder of the work folder (a run writing there): the
    window neither removes nor writes anything of it, says so in one line naming the folder and that process,
    and runs the other runs of its process; the folder's lock stays the holder's."""
    first = cpu_campaign.processes(set())[0]
    busy_id = first.run_ids[0]
    work = tmp_path / "w"
    folder = work / "runs" / busy_id
    folder.mkdir(parents=True)
    theirs = {"config.json": b'{"theirs": true}\n', "metrics.jsonl": b'{"iter": 0}\n'}
    for name, data in theirs.items():
        (folder / name).write_bytes(data)
    jobs = []

    def supervise(argv, log, env, stop_at, stopped=None, deadline=None):  # the cell's job file instead of its process
        if argv[3] == "cell":
            jobs.append(json.loads(Path(argv[4]).read_text()))
        return 0, "finished"

    monkeypatch.setattr(campaign_module, "_supervise", supervise)
    holder = Holder(folder, folder=True, lock_inside=True)
    try:
        assert main(["campaign", "run", "--config", str(CONFIG), "--cpu", "--minutes", "5", "--work", str(work)]) == 0
        assert {p.name: p.read_bytes() for p in folder.iterdir() if p.name != ".agg-bench.lock"} == theirs
        assert (folder / ".agg-bench.lock").read_text().strip() == str(holder.proc.pid)
    finally:
        holder.close()
    lines = [line for line in capsys.readouterr().err.splitlines() if str(folder) in line]
    assert len(lines) == 1 and f"PID {holder.proc.pid}" in lines[0] and "left alone" in lines[0], lines
    assert jobs[0]["runs"] and all(job["out"] != str(folder) for job in jobs[0]["runs"])
    assert [job["out"] for job in jobs[0]["runs"]] == [str(work / "runs" / r) for r in first.run_ids[1:]]
    [log] = (work / "windows").glob("*.json")
    entry = json.loads(log.read_text())["processes"][0]
    assert entry["busy"] == [busy_id] and busy_id not in entry["runs"]
    with tarfile.open(work / "campaign.tar.gz") as tar:
        assert not any(name.startswith(f"runs/{busy_id}/") for name in tar.getnames())


def test_a_busy_run_folder_with_a_control_character_is_one_quoted_line(tmp_path, capsys, cpu_campaign):
    """The line on a run folder another process writes named the folder's raw path: a newline in it split the
    line in two. The path is quoted as every progress line quotes one."""
    from agg_bench.outdir import Claim

    run_id = next(iter(cpu_campaign.sweep.runs))
    folder = tmp_path / "w\nx" / "runs" / run_id
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{}")
    with Claim(folder, folder=True, lock_inside=True).acquire():
        assert not campaign_module._clear_attempt(cpu_campaign, folder, run_id, "--work")
    assert capsys.readouterr().err.splitlines() == [
        f"agg-bench campaign: {str(folder)!r}: another agg-bench process (PID {os.getpid()}) is writing this run "
        f"folder; {run_id} is left alone, to a later window"]


@pytest.mark.parametrize("work_name", [None, "AGG_BENCH_CAMPAIGN_OUT"])
def test_a_work_folder_another_campaign_holds_is_one_line_naming_what_its_user_gave(tmp_path, capsys, cpu_campaign,
                                                                                    work_name):
    """A second window on a work folder that a window holds is refused in one line. Through
    scripts/gpu_campaign.sh it named --work, which the script's user never typed (they set
    AGG_BENCH_CAMPAIGN_OUT): the script passes --work-name, and every error about the work folder, its run folders
    and its default archive names that instead."""
    from agg_bench.outdir import Claim, lock_path

    work = tmp_path / "w"
    named = work_name or "--work"
    argv = ["campaign", "run", "--config", str(CONFIG), "--cpu", "--minutes", "1", "--work", str(work),
            *(["--work-name", work_name] if work_name else [])]
    with Claim(work, folder=True, lock_inside=True).acquire():  # the other window's
        capsys.readouterr()
        assert main(argv) == 2
        lines = capsys.readouterr().err.splitlines()
        assert lines == [f"agg-bench campaign: {named} {work}: another agg-bench process (PID {os.getpid()}) is "
                         "writing this folder; wait until it ends or give another folder"], lines
        assert sorted(p.name for p in work.iterdir()) == [".agg-bench.lock"]
    # an archive in the work folder other than its campaign.tar.gz, and a run folder's lock that is a link
    code = main([*argv, "--archive", str(work / "runs" / "a.tar.gz")])
    assert code == 2 and f"--archive {work / 'runs' / 'a.tar.gz'}: inside {named} {work}," in capsys.readouterr().err
    run_id = next(iter(cpu_campaign.sweep.runs))
    folder = work / "runs" / run_id
    folder.mkdir(parents=True)
    lock_path(folder, lock_inside=True).symlink_to(tmp_path / "elsewhere")
    with pytest.raises(UserError, match=f"^{named} {folder}: .* is a symbolic link"):
        campaign_module._clear_attempt(cpu_campaign, folder, run_id, named)


NAMED_REFERENCE = "AGG_BENCH_CAMPAIGN_REFERENCE"


@pytest.mark.parametrize("action, args, words", [
    ("run", ["--minutes", "1", "--reference", "{w}"], "{n} {w}: the work folder {w} or a folder in or around it"),
    ("run", ["--minutes", "1", "--reference", "{r}", "--archive", "{r}/a.tar.gz"], "--archive {r}/a.tar.gz: inside {n} {r}"),
    ("status", ["--reference", "{w}/r"], "{n} {w}/r: the work folder {w} or a folder in or around it"),
    ("status", ["--reference", "{t}/theirs"], "{n} {t}/theirs: the folder holds files that are not agg-bench"),
    ("run", ["--minutes", "1", "--reference", "{t}/link"], "{n} {t}/link: is a symbolic link"),
])
def test_errors_about_the_reference_name_what_its_user_gave(tmp_path, capsys, action, args, words):
    """Through scripts/gpu_campaign.sh, a reference that AGG_BENCH_CAMPAIGN_REFERENCE set was refused naming
    --reference, which the script's user never typed. --reference-name NAME (the script passes that variable's
    name) is what every error about the reference calls it; --reference unless given."""
    (tmp_path / "theirs").mkdir()
    (tmp_path / "theirs" / "notes.txt").write_text("mine")
    (tmp_path / "link").symlink_to(tmp_path / "theirs")
    before = tree(tmp_path)
    values = {"w": tmp_path / "w", "r": tmp_path / "r", "t": tmp_path}
    argv = ["campaign", action, "--config", str(CONFIG), "--cpu", "--work", str(tmp_path / "w"),
            *(a.format(**values) for a in args)]
    for name in (None, NAMED_REFERENCE):
        code = main([*argv, *(["--reference-name", name] if name else [])])
        err = capsys.readouterr().err.strip().splitlines()
        assert code == 2 and len(err) == 1 and words.format(n=name or "--reference", **values) in err[0], err
        assert tree(tmp_path) == before and not (tmp_path / "w").exists()


def test_a_campaign_folder_with_a_control_character_is_quoted_in_its_refusal_and_warning(tmp_path, capsys):
    """A reference, work folder or archive path with a newline was joined into the one-line refusal unquoted
    (``w/in side``: a path that is not there), and status's warning about an unpack under way split its line."""
    from agg_bench.outputs import UNPACK_STAGING
    from helpers import ENDED_PID

    work, inside = tmp_path / "w", tmp_path / "w" / "in\nside"
    with pytest.raises(UserError) as refused:
        campaign_module.check_places(work, inside, None, "AGG_BENCH_CAMPAIGN_OUT", NAMED_REFERENCE)
    assert str(refused.value).startswith(f"{NAMED_REFERENCE} {str(inside)!r}: the work folder {work} or ")
    for archive, reference in ((tmp_path / "r" / "a\x1b.tar.gz", tmp_path / "r"), (work / "x\n.tar.gz", None)):
        with pytest.raises(UserError, match=re.escape(f"--archive {str(archive)!r}: inside ")):
            campaign_module.check_places(work, reference, archive)
    reference = tmp_path / "ref\nerence"
    atomic_path(reference / UNPACK_STAGING, ENDED_PID).mkdir(parents=True)  # a killed unpack's
    assert main(["campaign", "status", "--config", str(CONFIG), "--cpu", "--reference", str(reference), "--work",
                 str(tmp_path / "elsewhere")]) == 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"agg-bench campaign: --reference {str(reference)!r}: an unpack "), err


@pytest.mark.parametrize("flag, name, path", [
    ("--reference", NAMED_REFERENCE, "~/ref"),
    ("--work", "AGG_BENCH_CAMPAIGN_OUT", "~/w"),
    ("--work", "AGG_BENCH_CAMPAIGN_OUT", ""),
])
@pytest.mark.parametrize("action", ["run", "status"])
def test_a_path_a_variable_gave_is_refused_naming_the_variable(tmp_path, capsys, monkeypatch, flag, name, path,
                                                              action):
    """A ~ path (or another that path_arg refuses) that AGG_BENCH_CAMPAIGN_REFERENCE or AGG_BENCH_CAMPAIGN_OUT
    gave scripts/gpu_campaign.sh was refused as the command line was parsed, naming --reference or --work, which
    the script's user never typed; it is refused in path_arg's words, naming what the -name option says."""
    monkeypatch.chdir(tmp_path)
    argv = ["campaign", action, "--config", str(CONFIG), "--cpu", *(["--minutes", "1"] if action == "run" else []),
            flag, path]
    for named in (None, name):
        code = main([*argv, *([f"{flag}-name", named] if named else [])])
        err = capsys.readouterr().err.strip().splitlines()
        assert code == 2 and len(err) == 1 and err[0].startswith(f"agg-bench campaign: {named or flag} '{path}': "), err
        assert "expected a file or folder name" in err[0], err
    assert list(tmp_path.iterdir()) == []


def test_a_reference_name_without_a_reference_or_to_unpack_is_one_line(tmp_path, capsys):
    """--reference-name names --reference: without it, or to unpack (whose --reference its user types), it was
    ignored."""
    code = main(["campaign", "status", "--config", str(CONFIG), "--cpu", "--reference-name", NAMED_REFERENCE])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err == [f"agg-bench campaign: --reference-name {NAMED_REFERENCE}: names --reference in "
                                 "errors, but no --reference was given; give --reference DIR too, or leave it out"], err
    code = main(["campaign", "unpack", "--config", str(CONFIG), "--cpu", "--archive", "a.tar.gz", "--reference", "r",
                 "--reference-name", NAMED_REFERENCE])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "campaign unpack: --reference-name is an option of campaign run and " \
        "status" in err[0], err
    assert list(tmp_path.iterdir()) == []


def test_a_reference_without_the_runs_model_names_what_its_user_gave(tmp_path, monkeypatch, cpu_campaign):
    """The reference's model checks (a window's first step) named --reference whatever the user gave."""
    reference, local = tmp_path / "reference", tmp_path / "pretrained" / "toy"
    local.mkdir(parents=True)
    (reference / "runs").mkdir(parents=True)
    monkeypatch.setattr(cpu_campaign, "pretrained_models", lambda: {"toy": local})
    monkeypatch.setattr(cpu_campaign, "done", lambda *folders: {"a run"})
    for name in ("--reference", NAMED_REFERENCE):
        with pytest.raises(UserError, match=f"^{name} {reference}: holds runs but not pretrained/toy, "):
            cpu_campaign.prepare_models(reference, *([name] if name != "--reference" else []))
    (reference / "pretrained" / "toy").mkdir(parents=True)
    monkeypatch.setattr(cpu_campaign, "model_problem", lambda label, folder: "is no model")
    for name in ("--reference", NAMED_REFERENCE):
        with pytest.raises(UserError, match=f"^{name} {reference}: pretrained/toy is no model; give another"):
            cpu_campaign.prepare_models(reference, *([name] if name != "--reference" else []))


class FakeProcesses:
    """``_supervise`` without processes: a cell process finishes those of its runs in ``runs`` (:func:`finished_run`)
    and no other, then takes its calibrations as the cell does
    (:func:`agg_bench.tools.cell_calibration.run_calibrations`), each of which writes its file when ``calibrate``
    is true, else fails and writes nothing. ``calls``: (verb, cell or methods), a calibration's when it starts."""

    def __init__(self, campaign: Campaign, runs: set[str], calibrate: bool):
        self.campaign, self.runs, self.calibrate, self.calls = campaign, runs, calibrate, []

    def __call__(self, argv, log, env, stop_at, stopped=None, deadline=None):
        assert argv[3] == "cell"
        job = Path(argv[4])
        outs = [Path(entry["out"]) for entry in json.loads(job.read_text())["runs"]]
        if outs:
            self.calls.append(("cell", self.campaign.cell_of(self.campaign.sweep.runs[outs[0].name])))
        ended = {}
        for out in outs:
            if out.name not in self.runs:
                continue
            finished_run(self.campaign, out)
            ended[out] = "ok"

        def measure(item, labels):
            self.calls.append(("calibrate", labels))
            if not self.calibrate:
                raise UserError("cut")
            item.out.write_text(json.dumps({"unit_s_per_sample": {}, "methods": {m: {} for m in labels}}))

        items = cell_calibration.read_calibrations(job, outs)
        code = cell_calibration.run_calibrations(items, outs, ended, float(argv[argv.index("--deadline") + 1]),
                                                 argv, measure)
        return code, "finished"


def test_a_calibration_cut_at_the_deadline_is_taken_again_in_chunks_by_the_next_window(tmp_path, monkeypatch,
                                                                                      capsys, cpu_campaign):
    """The runs of a cell finish but their calibrations are cut: no calibration file, the cell's methods stay
    pending (`campaign status` says so), and the next window calibrates them first, before any run, in
    ceil(8 / 3) calibrate processes of at most campaign.calibrate_methods (3) methods, each with full."""
    processes = cpu_campaign.processes(set())
    cell = processes[0].cell  # SD3.5-M at 1024 px: the first selector's 3 methods, then the third's 5
    finished = {r for p in [p for p in processes if p.cell == cell][:2] for r in p.run_ids}
    methods = [cpu_campaign.sweep.runs[r]["method"] for r in cpu_campaign.order() if r in finished]
    assert len(methods) == 8 and methods[0] == "full"
    work = tmp_path / "w"
    args = ["--config", str(CONFIG), "--cpu", "--work", str(work)]
    first = FakeProcesses(cpu_campaign, finished, calibrate=False)
    monkeypatch.setattr(campaign_module, "_supervise", first)
    assert main(["campaign", "run", *args, "--minutes", "5"]) == 0
    capsys.readouterr()
    assert cpu_campaign.done(work) == finished
    assert [c for c in first.calls if c[0] == "calibrate"]  # the cell's own calibrations ran, and were cut
    assert not list((work / "calibration").iterdir())
    [log] = (work / "windows").glob("*.json")
    entries = json.loads(log.read_text())["processes"]
    assert [e["calibration"]["file"] for e in entries if "calibration" in e] == [None] * 3
    assert json.loads(log.read_text())["calibrations_left"] == 8
    assert main(["campaign", "status", *args]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["cells"][cell]["uncalibrated"] == methods
    chunks = [["full", *methods[1:4]], ["full", *methods[4:7]], ["full", *methods[7:]]]
    assert shown["calibrations"] == chunks

    second = FakeProcesses(cpu_campaign, set(), calibrate=True)  # no run finishes: only the calibrations
    monkeypatch.setattr(campaign_module, "_supervise", second)
    assert main(["campaign", "run", *args, "--minutes", "5"]) == 0
    assert second.calls[:3] == [("calibrate", chunk) for chunk in chunks]  # first, before any run
    assert all(verb == "cell" for verb, _ in second.calls[3:])
    assert len(list((work / "calibration").glob(f"*_{cell}.json"))) == 3
    assert cpu_campaign.calibrated(work)[cell] == set(methods)
    assert not cpu_campaign.uncalibrated(cpu_campaign.done(work), cpu_campaign.calibrated(work))
    capsys.readouterr()
    assert main(["campaign", "status", *args]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["calibrations"] == [] and shown["cells"][cell]["uncalibrated"] == []


def test_calibrations_are_cut_into_processes_of_calibrate_methods_each_with_full(tmp_path):
    """campaign.calibrate_methods methods a calibrate process, full beside each and not counted; full alone is
    one process; a sweep with campaign.calibrate false leaves nothing pending."""
    sweep = yaml.safe_load(CONFIG.read_text())
    sweep["campaign"]["calibrate_methods"] = 2
    (tmp_path / "two.yaml").write_text(yaml.safe_dump(sweep, sort_keys=False))
    campaign = Campaign(tmp_path / "two.yaml", cpu=True)
    assert campaign.chunks(["full", "a", "b", "c", "d", "e"]) == [("a", "b"), ("c", "d"), ("e",)]
    assert campaign.chunks(["full"]) == [("full",)] and campaign.chunks([]) == []
    assert campaign.with_baseline(["a"]) == ["full", "a"] and campaign.with_baseline(["full"]) == ["full"]
    done = set(campaign.processes(set())[0].run_ids)
    [pending] = campaign.uncalibrated(done, {})
    assert [p.run_ids for p in campaign.work(done, {})[1:]] == [p.run_ids for p in campaign.processes(done)]
    assert campaign.work(done, {})[0] == pending and list(pending.methods) == PRIORITY_FIRST
    assert not campaign.uncalibrated(done, {pending.cell: set(PRIORITY_FIRST)})
    sweep["campaign"]["calibrate"] = False
    (tmp_path / "off.yaml").write_text(yaml.safe_dump(sweep, sort_keys=False))
    assert Campaign(tmp_path / "off.yaml", cpu=True).uncalibrated(done, {}) == []


@pytest.mark.parametrize("value, words", [
    (0, "campaign.calibrate_methods = 0: expected an integer from 1 to"),
    (campaign_module.MAX_CALIBRATE_METHODS + 1, f"= {campaign_module.MAX_CALIBRATE_METHODS + 1}: expected an "
                                               f"integer from 1 to {campaign_module.MAX_CALIBRATE_METHODS}"),
    ("3", "campaign.calibrate_methods = '3': expected an integer"),
    (True, "campaign.calibrate_methods = True: expected an integer"),
])
def test_a_bad_calibrate_methods_is_one_line(tmp_path, capsys, value, words):
    sweep = yaml.safe_load(CONFIG.read_text())
    sweep["campaign"]["calibrate_methods"] = value
    (tmp_path / "sweep.yaml").write_text(yaml.safe_dump(sweep, sort_keys=False))
    work = tmp_path / "w"
    code = main(["campaign", "run", "--config", str(tmp_path / "sweep.yaml"), "--cpu", "--minutes", "1", "--work",
                 str(work)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and words in err[0], err
    assert not work.exists()


@pytest.mark.parametrize("cpu", [True, False])
def test_a_priority_resolution_the_sweep_does_not_run_is_refused(tmp_path, cpu):
    """A selector's model and methods were checked against the sweep's labels, its resolution not: 1000 for 1024
    matched no run, and the runs it was to put first went in sweep order. The resolution is checked as written,
    before the --cpu form maps the sizes (1000 and 1024 may map to one)."""
    sweep = yaml.safe_load(CONFIG.read_text())
    sweep["campaign"]["priority"] = [{"model": "sd35m", "methods": ["full"]}, {"model": "sd35m", "resolution": 1000}]
    (tmp_path / "sweep.yaml").write_text(yaml.safe_dump(sweep, sort_keys=False))
    with pytest.raises(SweepError, match=r"^sweep config: campaign.priority\[1\].resolution: 1000 is not one of "
                                         r"resolutions \(512, 720, 1024\)$"):
        Campaign(tmp_path / "sweep.yaml", cpu=cpu)


@pytest.mark.parametrize("value", [" ", " H200", "H200 ", "H200\n"])
def test_a_campaign_gpu_with_space_at_an_end_is_one_line(tmp_path, capsys, monkeypatch, value):
    """campaign.gpu is matched as a text inside the GPU's name: ' ' let a window run on any GPU whose name has a
    space (an H100's), and ' H200' or 'H200 ' refused every window and every archive of an H200 ('NVIDIA H200')."""
    fake_gpu(monkeypatch, "NVIDIA H100 80GB HBM3")
    sweep = yaml.safe_load(CONFIG.read_text())
    sweep["campaign"]["gpu"] = value
    (tmp_path / "sweep.yaml").write_text(yaml.safe_dump(sweep, sort_keys=False))
    work = tmp_path / "w"
    code = main(["campaign", "run", "--config", str(tmp_path / "sweep.yaml"), "--minutes", "1", "--work", str(work)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert f"campaign.gpu = {value!r}: expected a text of the GPU's name without space at either end" in err[0], err
    assert not work.exists()


# ----- the learning sweep on one GPU (config/learning_gpu.yaml), as a campaign -----------------------------------
LEARNING_GPU = ROOT / "config" / "learning_gpu.yaml"


def share_kept_checks(folder: Path) -> None:
    """The methods' checks of the sweeps' runs as the repository keeps them (each Campaign reads them from
    .snakemake/ under the current folder, here ``folder``): not checked again in child processes, which import
    torch and the model libraries."""
    kept = ROOT / CACHE_DIR
    kept.mkdir(parents=True, exist_ok=True)
    (folder / CACHE_DIR).parent.mkdir(parents=True)
    (folder / CACHE_DIR).symlink_to(kept)


def test_the_gpu_learning_sweep_is_the_cpu_sweeps_methods_on_10_seeds():
    """config/learning_gpu.yaml runs every method of config/learning.yaml with the same base, recipes and
    settings, on 10 seeds, 128 noises per caption every 10 iterations and 3 times the budget, on CUDA."""
    import yaml

    cpu, gpu = (yaml.safe_load(path.read_text()) for path in (ROOT / "config" / "learning.yaml", LEARNING_GPU))
    assert gpu["methods"] == cpu["methods"] and gpu["base"] == cpu["base"] and not gpu.get("exclude")
    changed = {"train.budget", "train.iterations", "eval.noises", "train.checkpoint_every"}
    assert {k: v for k, v in gpu["set"].items() if k not in changed} == \
        {k: v for k, v in cpu["set"].items() if k not in changed}
    assert gpu["set"]["eval.noises"] == 128 and gpu["set"]["eval.every"] == 10
    assert gpu["set"]["train.budget"] >= 2.5 * cpu["set"]["train.budget"] and len(gpu["seeds"]) >= 10
    assert {d["device"] for d in gpu["devices"].values()} == {"cuda"}
    assert all(spec["set"]["device"] == "cuda" for spec in gpu["pretrain"].values())
    campaign = Campaign(LEARNING_GPU)
    assert len(campaign.sweep.runs) == len(gpu["methods"]) * len(gpu["seeds"])
    assert [campaign.sweep.runs[r]["method"] for r in campaign.order()[:20]] == ["full"] * 10 + \
        ["agg-w5-sigma-reuse"] * 10


@pytest.fixture
def checks_here():
    """The methods' checks this process asks for that the kept ones lack, in this process
    (:func:`helpers.sweep_checks_here`): the same answers, kept alike, without a child's imports of torch and the
    model libraries."""
    from helpers import sweep_checks_here

    with sweep_checks_here():
        yield


@pytest.mark.slow
def test_a_cpu_window_of_the_gpu_learning_sweep(tmp_path, monkeypatch, capsys, checks_here):
    """--cpu: the model pre-trained first, every method's run, the model and the runs packed; unpacked, the
    reference's learning tables regenerate byte for byte, and the next window takes the reference's model
    (and refuses another)."""

    for name in ("learning_gpu.yaml", "pretrain.yaml", "prompts/scenes.txt"):  # the sweep's relative paths
        (tmp_path / "config" / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(ROOT / "config" / name, tmp_path / "config" / name)
    share_kept_checks(tmp_path)
    monkeypatch.chdir(tmp_path)
    config, reference = "config/learning_gpu.yaml", tmp_path / "reference"
    assert main(["campaign", "run", "--config", config, "--cpu", "--minutes", "3", "--work", "w1"]) == 0
    out = json.loads(capsys.readouterr().out)
    campaign = Campaign(config, cpu=True)
    # the toy model lies in the --cpu form's own folder: the GPU sweep still has its own to pre-train
    gpu = Campaign(config)
    assert all(not path.exists() for path in gpu.pretrained_models().values())
    assert gpu.prepare_models(None) == list(gpu.pretrain)
    assert out["left"] == 0 and out["finished"] == len(campaign.sweep.runs)
    reuses = watched_model_reuse(monkeypatch)  # the count check's tiny counterparts share one built model
    assert main(["campaign", "unpack", "--config", config, "--cpu", "--archive", "w1/campaign.tar.gz",
                 "--reference", str(reference)]) == 0
    assert [reuse.builds for reuse in reuses] == [1]
    label = next(iter(campaign.pretrained_models()))
    assert (reference / "pretrained" / label / "transformer" / "diffusion_pytorch_model.safetensors").is_file()
    options = campaign.learning_options()
    assert main(["learning", "--manifest", str(reference / "manifest.json"), "--tables", "again", "--average",
                 str(options.average), "--fraction", str(options.fraction), "--target-fraction",
                 str(options.target_fraction), "--reference", "full"]) == 0
    for name in ("learning.csv", "learning.md", "curves.csv"):
        assert (tmp_path / "again" / name).read_bytes() == (reference / "learning" / name).read_bytes(), name
    table = pd.read_csv(reference / "learning" / "learning.csv")
    assert set(table["method"]) == set(campaign.sweep.sweep["methods"]) and "unseen_change" in table
    # the next window, on a machine without the model: the reference's is put in place, byte for byte
    local = campaign.pretrained_models()[label]
    shutil.rmtree(local)
    assert campaign.prepare_models(reference) == []
    assert tree(local / "transformer") == tree(reference / "pretrained" / label / "transformer")
    # another model there is refused: the reference's runs were trained from its own
    (local / "token_hash.json").write_text('{"max_tokens": 6, "seed": 1}\n')
    with pytest.raises(UserError, match="not the model of the reference"):
        campaign.prepare_models(reference)
    # an archive whose model is not what pretrain writes is refused whole
    weights = f"pretrained/{label}/transformer/diffusion_pytorch_model.safetensors"
    for edit, words in ((lambda d: d[:-4], "the tensors cover"), (lambda d: b"x" * 16, "not a safetensors file")):
        bad = crafted(tmp_path / "bad.tar.gz", tmp_path / "w1" / "campaign.tar.gz",
                      lambda m, edit=edit: {**m, weights: edit(m[weights])})
        assert main(["campaign", "unpack", "--config", config, "--cpu", "--archive", str(bad), "--reference",
                     str(tmp_path / "new")]) == 2
        assert words in capsys.readouterr().err and not (tmp_path / "new").exists()


def test_a_window_removes_the_model_copy_a_killed_window_left_beside_the_model_folder(tmp_path, monkeypatch):
    """A window killed (SIGKILL) while it copied the reference's pre-trained model into place left the temporary
    copy (a model's weights) beside the model folder, and each later window copies under its own PID: nothing
    else removes it, as the model is never pre-trained there. The next copy removes it; a live process's stays."""
    campaign = Campaign(ROOT / "config" / "learning_gpu.yaml", cpu=True)
    reference, local = tmp_path / "reference", tmp_path / "pretrained" / "toy"
    for name in archive_module.MODEL_FILES:
        (reference / "pretrained" / "toy" / name).parent.mkdir(parents=True, exist_ok=True)
        (reference / "pretrained" / "toy" / name).write_text(name)
    monkeypatch.setattr(campaign, "pretrained_models", lambda: {"toy": local})
    monkeypatch.setattr(campaign, "model_problem", lambda label, folder: None)
    local.parent.mkdir()
    stale = atomic_path(local, ENDED_PID)
    (stale / "transformer").mkdir(parents=True)
    (stale / "transformer" / "diffusion_pytorch_model.safetensors").write_text("weights")
    with running_process() as live:
        alive = atomic_path(local, live)
        alive.mkdir()
        assert campaign.prepare_models(reference) == []
    assert tree(local) == tree(reference / "pretrained" / "toy")
    assert sorted(p.name for p in local.parent.iterdir()) == sorted([alive.name, "toy"])


def test_a_window_removes_what_killed_windows_processes_left_in_the_work_folder(tmp_path, monkeypatch):
    """A window killed (SIGKILL) while a calibration ran left the calibration's lock file, and a killed write of
    a cell's report or a window log its temporary, under names no later window writes (each window has its own
    stamp): nothing removed them. The next window removes them under its claim of the work folder, a temporary of a
    killed process whose PID this one has too (PIDs reused in a fresh container) included; a live process's
    temporary, a held lock and the finished files stay."""
    monkeypatch.setattr(campaign_module, "_run_processes", lambda *args: [])
    work = tmp_path / "w"
    held: list[int] = []
    with running_process() as live:
        try:
            kept, stale = [], []
            for sub in ("cells", "calibration", "windows"):
                (work / sub).mkdir(parents=True)
                finished = work / sub / f"20261205T000000_{sub}.json"
                finished.write_text("{}")
                stale += [atomic_path(finished, ENDED_PID), work / sub / f".{finished.name}.agg-bench.lock",
                          atomic_path(work / sub / f"20261204T000000_{sub}.json", os.getpid())]
                kept += [finished, atomic_path(finished, live), work / sub / f".{sub}-held.json.agg-bench.lock"]
            for path in [*stale, *kept[1::3], *kept[2::3]]:
                path.write_text("")
            for lock in kept[2::3]:
                held.append(os.open(lock, os.O_RDONLY))
                fcntl.flock(held[-1], fcntl.LOCK_EX)
            campaign_module.run_window(Campaign(CONFIG, cpu=True), 1, work, tmp_path / "ref")
        finally:
            for fd in held:
                os.close(fd)
    assert not [path for path in stale if path.exists()]
    assert [path for path in kept if not path.exists()] == []


def copy_sweep(folder: Path, config: str) -> None:
    """``config`` and the files its sweep names by relative paths, under ``folder``."""
    for name in (config, "pretrain.yaml", "prompts/scenes.txt"):
        (folder / "config" / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(ROOT / "config" / name, folder / "config" / name)


@pytest.mark.parametrize("config", ["learning.yaml", "learning_gpu.yaml"])
def test_the_cpu_form_of_a_learning_sweep_has_a_model_folder_of_its_own(config, checks_here):
    gpu, cpu = Campaign(ROOT / "config" / config), Campaign(ROOT / "config" / config, cpu=True)
    assert set(gpu.pretrained_models().values()).isdisjoint(cpu.pretrained_models().values())
    assert set(gpu.pretrain).isdisjoint(cpu.pretrain)
    for label, path in cpu.pretrained_models().items():
        argv = cpu.pretrain_argv(label, "python")
        assert argv[-2:] == ["--out", str(path)] and path not in gpu.pretrained_models().values()


def test_a_model_folder_of_another_pretrain_config_is_not_used(tmp_path, monkeypatch, capsys):
    """A model folder is used only when its pretrain.json records the config the sweep's pretrain section
    composes: the --cpu form's toy model (20 steps on the CPU) where the sweep reads its own is refused in one
    line naming the folder and what differs, with nothing written; the --cpu form pre-trains its own folder
    anew, unless that folder holds a file pretrain does not write."""
    from dataclasses import asdict

    from agg_bench.tools.pretrain import load_pretrain_config

    copy_sweep(tmp_path, "learning.yaml")
    share_kept_checks(tmp_path)
    monkeypatch.chdir(tmp_path)
    config = "config/learning.yaml"
    campaign = Campaign(config)
    [(label, local)] = campaign.pretrained_models().items()
    spec = campaign.pretrain[label]
    toy = asdict(load_pretrain_config(spec["config"], campaign_module.Campaign(config, cpu=True).pretrain_overrides(
        label + campaign_module.CPU_MODEL_SUFFIX)))
    wanted = asdict(load_pretrain_config(spec["config"], campaign.pretrain_overrides(label)))
    assert toy["steps"] != wanted["steps"]
    local.mkdir(parents=True)
    (local / "token_hash.json").write_text('{"max_tokens": 6, "seed": 0}\n')
    (local / "pretrain.json").write_text(json.dumps({"format": "agg-bench-pretrain/1", "config": toy}))
    before = tree(local)
    code = main(["campaign", "run", "--config", config, "--minutes", "1", "--work", "w"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith(f"agg-bench campaign: {local}: ")
    assert f"steps {toy['steps']} (the sweep's {wanted['steps']})" in err[0]
    assert tree(local) == before and not (tmp_path / "w").exists()
    # no pretrain.json: not a model pretrain made
    (local / "pretrain.json").unlink()
    with pytest.raises(UserError, match=f"{local}: is not a model that agg-bench pretrain made"):
        campaign.prepare_models(None)
    # the sweep's own config, made on other cores: used as it is
    (local / "pretrain.json").write_text(json.dumps({"format": "agg-bench-pretrain/1",
                                                     "config": {**wanted, "threads": wanted["threads"] + 1}}))
    assert campaign.prepare_models(None) == [] and (local / "pretrain.json").is_file()
    # the --cpu form's own folder, made by another config: pre-trained anew, unless someone's file is in it
    cpu = Campaign(config, cpu=True)
    [(cpu_label, cpu_local)] = cpu.pretrained_models().items()
    shutil.copytree(local, cpu_local)
    assert cpu.prepare_models(None) == [cpu_label] and tree(cpu_local) == tree(local)
    (cpu_local / "notes.txt").write_text("mine")
    with pytest.raises(UserError, match="notes.txt"):
        cpu.prepare_models(None)


# ----- scripts/gpu_wheels.sh -------------------------------------------------------------------------------------
WHEELS_SCRIPT = ROOT / "scripts" / "gpu_wheels.sh"


def wheels_checkout(folder: Path) -> Path:
    """A folder with what scripts/gpu_wheels.sh reads: the script and the pinned requirements."""
    for name in ("scripts/gpu_wheels.sh", "requirements/constraints.txt"):
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(ROOT / name, folder / name)
    return folder


def run_wheels(checkout: Path, bin_dir: Path, fetched: str = "", code: int = 0) -> subprocess.CompletedProcess:
    """The script with a stub ``python3`` first on PATH that records its arguments instead of downloading, puts
    an empty wheel named ``fetched`` (where given) in the download folder and exits with ``code``."""
    fetch = f'while [ "$1" != -d ]; do shift; done; : > "$2/{fetched}"\n' if fetched else ""
    bash_script(bin_dir / "python3", f'printf "%s\\n" "$@" > "{bin_dir}/python3.args"\n{fetch}exit {code}')
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
    return subprocess.run(["bash", str(checkout / "scripts" / "gpu_wheels.sh")], cwd=checkout.parent, env=env,
                          capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("args, words", [
    (["3.12", "3.11"], "2 arguments (3.12 3.11), expected at most one"),  # the second was dropped without a word
    (["py3.12"], "PYTHON_VERSION 'py3.12': expected 3.N (e.g. 3.12)"),
    ([""], "PYTHON_VERSION '': expected 3.N (e.g. 3.12)"),  # an unset variable given, not the default
])
def test_gpu_wheels_refuses_bad_arguments_in_one_line(tmp_path, args, words):
    checkout = wheels_checkout(tmp_path / "checkout")
    proc = subprocess.run(["bash", str(checkout / "scripts" / "gpu_wheels.sh"), *args], cwd=tmp_path,
                          capture_output=True, text=True, timeout=60)
    lines = proc.stderr.splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith(f"gpu_wheels: {words}; usage: "), lines
    assert not (checkout / ".whl").exists()


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_gpu_wheels_ignores_whl_in_a_worktree_and_runs_outside_git(tmp_path):
    """.git is a file in a worktree (and a submodule): the script finds the exclude file through git; without
    any git checkout it has none to write and still fetches the wheels."""
    def git(*args: str, cwd: Path) -> str:
        return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=cwd, check=True,
                              capture_output=True, text=True).stdout

    main_checkout = wheels_checkout(tmp_path / "main")
    git("init", "-q", cwd=main_checkout)
    git("add", ".", cwd=main_checkout)
    git("commit", "-q", "-m", "x", cwd=main_checkout)
    worktree = tmp_path / "worktree"
    git("worktree", "add", "-q", str(worktree), cwd=main_checkout)
    assert (worktree / ".git").is_file()
    exclude = Path(git("rev-parse", "--path-format=absolute", "--git-path", "info/exclude", cwd=worktree).strip())
    for _ in range(2):  # a second run adds nothing
        proc = run_wheels(worktree, tmp_path / "bin")
        assert proc.returncode == 0, proc.stderr
    assert exclude.read_text().splitlines().count("/.whl/") == 1
    (worktree / ".whl" / "x.whl").write_bytes(b"wheel")
    assert git("status", "--porcelain", "--untracked-files=all", cwd=worktree) == ""
    pin = next(line for line in (ROOT / "requirements" / "constraints.txt").read_text().splitlines()
               if line.startswith("diffusers=="))
    args = (tmp_path / "bin" / "python3.args").read_text().splitlines()
    assert args[:3] == ["-m", "pip", "download"] and pin in args
    assert Path(args[args.index("-d") + 1]).parent == Path(".whl")
    # no git checkout at all: no exclude file to write, the wheels still fetched into .whl/
    plain = wheels_checkout(tmp_path / "plain")
    (tmp_path / "bin" / "python3.args").unlink()
    proc = run_wheels(plain, tmp_path / "bin")
    assert proc.returncode == 0, proc.stderr
    assert (plain / ".whl").is_dir() and not (plain / ".git").exists()
    assert (tmp_path / "bin" / "python3.args").is_file()


def test_gpu_wheels_replaces_the_wheels_of_an_earlier_pin(tmp_path):
    """.whl/ kept an earlier pin's diffusers wheel beside the new one, and the GPU machine's install of .whl/*.whl
    then failed on two versions of one package; a download that fails leaves .whl/ as it was."""
    checkout = wheels_checkout(tmp_path / "plain")
    (checkout / ".whl").mkdir()
    (checkout / ".whl" / "diffusers-0.1.0-py3-none-any.whl").write_bytes(b"old")
    failed = run_wheels(checkout, tmp_path / "bin", fetched="diffusers-9.9.9-py3-none-any.whl", code=1)
    assert failed.returncode != 0 and sorted(p.name for p in (checkout / ".whl").iterdir()) == \
        ["diffusers-0.1.0-py3-none-any.whl"]
    proc = run_wheels(checkout, tmp_path / "bin", fetched="diffusers-9.9.9-py3-none-any.whl")
    assert proc.returncode == 0, proc.stderr
    assert sorted(p.name for p in (checkout / ".whl").iterdir()) == ["diffusers-9.9.9-py3-none-any.whl"]


@pytest.mark.parametrize("name", ["gpu.yaml", "gpu_random.yaml"])
def test_the_cpu_form_of_a_sweep_with_device_excludes_checks_out(name):
    """--cpu puts every run on one CPU device, so an exclude entry for another device matches no run; it is
    dropped, as the sweep's check refuses a pattern that matches no label."""
    import yaml

    from agg_bench.tools.sweep import check_sweep

    sweep = yaml.safe_load((ROOT / "config" / name).read_text())
    form = campaign_module.cpu_sweep(sweep)
    check_sweep(form, yaml.safe_load((ROOT / "workflow/schemas/config.schema.yaml").read_text()))
    # the entries of other devices go, the others stay (their resolutions the CPU form's)
    kept = [e for e in sweep.get("exclude", []) if e.get("device", "cpu") == "cpu"]
    assert [{k: v for k, v in e.items() if k != "resolution"} for e in kept] == \
        [{k: v for k, v in e.items() if k != "resolution"} for e in form["exclude"]]


def test_a_calibration_that_would_be_cut_is_not_started(tmp_path, monkeypatch, capsys, cpu_campaign):
    """A window starts no calibrate process that the cell's earlier calibrations (the window logs' seconds per
    timed method) say would not end before it stops: cut at the deadline it would have used the GPU for nothing.
    A cell with no calibration timed yet is started; one that fits is started."""
    [first_cell, *_] = cpu_campaign.processes(set())
    cell, finished = first_cell.cell, set(first_cell.run_ids)
    work = tmp_path / "w"
    args = ["--config", str(CONFIG), "--cpu", "--work", str(work)]
    monkeypatch.setattr(campaign_module, "_supervise", FakeProcesses(cpu_campaign, finished, calibrate=False))
    assert main(["campaign", "run", *args, "--minutes", "5"]) == 0  # no history: its calibration started, and cut
    earlier = {"started": "20000101T000000", "minutes": 8, "config": str(CONFIG), "done_before": 0, "runs": 1,
               "pretrained": [], "stopped_by_signal": None, "seconds": 1.0, "finished_in_window": [], "left": 0,
               "calibrations_left": 0, "processes": [{"cell": cell, "calibration": {
                   "file": "x.json", "methods": ["full", "a"], "exit_code": 0, "ended": "finished", "seconds": 600.0}}]}
    log_file = work / "windows" / "20000101T000000.json"
    for seconds, started in ((600.0, False), (2.0, True)):  # 300 s a method: 900 s for 3 > the window's 280 s left
        log_file.write_text(json.dumps({**earlier, "processes": [{**earlier["processes"][0], "calibration": {
            **earlier["processes"][0]["calibration"], "seconds": seconds}}]}))
        for other in set((work / "windows").glob("*.json")) - {log_file}:
            other.unlink()  # the window logs before: only this one's is left beside the history
        fake = FakeProcesses(cpu_campaign, set(), calibrate=True)
        monkeypatch.setattr(campaign_module, "_supervise", fake)
        assert main(["campaign", "run", *args, "--minutes", "5"]) == 0
        capsys.readouterr()
        calibrations = [methods for verb, methods in fake.calls if verb == "calibrate"]
        assert bool(calibrations) == started
        [new_log] = set((work / "windows").glob("*.json")) - {log_file}
        [entry] = [e for e in json.loads(new_log.read_text())["processes"] if e.get("cell") == cell and "calibration" in e]
        assert entry["calibration"]["ended"].startswith("not started: about 900 s") != started
    assert cpu_campaign.calibrated(work)[cell] == {cpu_campaign.sweep.runs[r]["method"] for r in finished}


def test_a_cells_first_calibration_is_estimated_from_its_runs(tmp_path, monkeypatch, capsys, cpu_campaign):
    """A cell no calibration has timed yet: its runs' rollout and train phases (medians after the first
    iteration) times the calibration's rounds (warm-up and timed) and CALIBRATION_OVERHEAD are its estimate; a
    calibration that would not end before the window stops is not started, one that would is."""
    [first_cell, *_] = cpu_campaign.processes(set())
    cell, finished = first_cell.cell, set(first_cell.run_ids)
    work = tmp_path / "w"
    args = ["--config", str(CONFIG), "--cpu", "--work", str(work)]
    monkeypatch.setattr(campaign_module, "_supervise", FakeProcesses(cpu_campaign, finished, calibrate=False))
    assert main(["campaign", "run", *args, "--minutes", "5"]) == 0
    labels = cpu_campaign.with_baseline([cpu_campaign.sweep.runs[r]["method"] for r in cpu_campaign.order()
                                         if r in finished])
    assert cpu_campaign.rounds_seconds(cell, labels, work) is None  # runs without records: no estimate
    options = cpu_campaign.sweep.sweep["calibrate"]
    rounds = options["warmup"] + options["method_repeats"]
    for seconds, started in ((100.0, False), (0.01, True)):
        for run_id in finished:  # a warm-up iteration (left out), then two whose medians count
            times = [(1e6, 1e6), (seconds, 2 * seconds), (3 * seconds, 4 * seconds)]
            (work / "runs" / run_id / "metrics.jsonl").write_text("".join(
                json.dumps({"iteration": i, "status": "ok", "t_rollout_s": r, "t_train_s": t}) + "\n"
                for i, (r, t) in enumerate(times)))
        expected = cell_calibration.CALIBRATION_OVERHEAD * rounds * len(labels) * (3 * seconds + 4 * seconds)
        assert cpu_campaign.rounds_seconds(cell, labels, work) == pytest.approx(expected)
        for old in (work / "windows").glob("*.json"):
            old.unlink()
        fake = FakeProcesses(cpu_campaign, set(), calibrate=True)
        monkeypatch.setattr(campaign_module, "_supervise", fake)
        assert main(["campaign", "run", *args, "--minutes", "5"]) == 0
        capsys.readouterr()
        assert any(verb == "calibrate" for verb, _ in fake.calls) == started


def test_a_window_log_whose_seconds_are_past_a_float_gives_no_time(tmp_path):
    """A window log (the work folder's, or the reference's: unpack checks a log's keys, not its entries) whose
    calibration took 10**400 seconds, which JSON reads, was an OverflowError and a traceback in the next window."""
    campaign = Campaign(CONFIG, cpu=True)
    cell = campaign.processes(set())[0].cell
    entry = {"cell": cell, "calibration": {"file": "x.json", "methods": ["full"], "exit_code": 0, "seconds": None}}
    (tmp_path / "windows").mkdir()
    (tmp_path / "windows" / "20000101T000000.json").write_text(
        json.dumps({"processes": [entry, {**entry, "cell": "other"}]}).replace("null", "1" + "0" * 400, 1)
        .replace("null", "2.0"))
    campaign.read_calibration_times(tmp_path)
    assert campaign.calibration_times() == {"other": 2.0}


def test_a_temporary_left_by_a_killed_writer_counts_for_no_reader(tmp_path):
    """A window log or calibration that a process killed before its rename left under its temporary name: the
    archive leaves it out, and so do the readers of calibration times and calibrated methods (a window log's
    temporary was read, so the work folder priced a calibration that its archive and the reference lack)."""
    campaign = Campaign(CONFIG, cpu=True)  # its own: this test takes in calibration times
    cell = campaign.processes(set())[0].cell
    entry = {"cell": cell, "calibration": {"file": "x.json", "methods": ["full"], "exit_code": 0, "seconds": 5.0}}
    log = tmp_path / "windows" / "20000101T000000.json"
    calibration = tmp_path / "calibration" / f"20000101T000000_0_{cell}.json"
    for path, data in ((log, {"processes": [entry]}), (calibration, {"methods": {"full": {}}})):
        path.parent.mkdir()
        atomic_path(path).write_text(json.dumps(data))
    assert Campaign.finished_files(tmp_path, "windows") == Campaign.finished_files(tmp_path, "calibration") == []
    campaign.read_calibration_times(tmp_path)
    assert campaign.calibration_times() == {}
    assert campaign.calibrated(tmp_path) == {}
    for path in (log, calibration):  # the same files under their own names count
        atomic_path(path).rename(path)
    campaign.read_calibration_times(tmp_path)
    assert campaign.calibration_times() == {cell: 5.0}
    assert campaign.calibrated(tmp_path) == {cell: {"full"}}


def _safetensors(header: dict, body: bytes) -> bytes:
    text = json.dumps(header).encode()
    return len(text).to_bytes(8, "little") + text + body


F32 = {"dtype": "F32", "shape": [1]}


@pytest.mark.parametrize("header, body, words", [
    ({"a": {**F32, "data_offsets": [0, 4]}, "b": {**F32, "data_offsets": [8, 12]}}, b"\0" * 12,
     "tensor 'b': its bytes start at 8, where the tensors before it end at 4"),
    ({"a": {**F32, "data_offsets": [0, 4]}, "b": {**F32, "data_offsets": [0, 4]}}, b"\0" * 4,
     "its bytes start at 0, where the tensors before it end at 4"),
    ({"__metadata__": {"format": 1}, "a": {**F32, "data_offsets": [0, 4]}}, b"\0" * 4,
     "__metadata__ = {'format': 1}; expected an object of strings"),
    ({"a": {"dtype": "F32", "shape": [0, 2**64], "data_offsets": [0, 0]}}, b"", "not a safetensors entry"),
    ({"a": {"dtype": "F32", "shape": [2**32, 2**32, 0], "data_offsets": [0, 0]}}, b"",
     "its byte range does not hold its shape")])
def test_a_safetensors_header_the_reader_refuses_is_refused_in_an_archive(header, body, words):
    """Tensors with a gap or an overlap between their bytes, metadata that is not strings and dimensions past 64
    bits were let into a reference, whose model the safetensors reader then refused in the next window."""
    from safetensors import SafetensorError
    from safetensors.torch import load

    data = _safetensors(header, body)
    with pytest.raises(SafetensorError):
        load(data)
    with pytest.raises(UserError, match="^w: ") as err:
        archive_module._check_safetensors("w", data)
    assert words in str(err.value)


def test_a_safetensors_file_the_reader_takes_passes():
    from safetensors.torch import save

    data = save({"b": torch.zeros(2, 3), "a": torch.ones(4, dtype=torch.bfloat16), "c": torch.zeros(0, 5)},
                metadata={"format": "pt"})
    archive_module._check_safetensors("w", data)


@pytest.mark.parametrize("config", ["h200.yaml", "learning_gpu.yaml"])
def test_status_names_each_missing_run_once(config, capsys):
    """A learning sweep's status listed "full" once for each of its ten seeds, which did not say which were
    missing; a sweep of one seed lists its methods, each once in its cell."""
    assert main(["campaign", "status", "--config", str(ROOT / "config" / config)]) == 0
    shown = json.loads(capsys.readouterr().out)
    runs = Campaign(ROOT / "config" / config).sweep.runs.values()
    seeded = len({run["seed"] for run in runs}) > 1
    expected: dict[str, list[str]] = {}
    for run in runs:
        expected.setdefault(Campaign.cell_of(run), []).append(
            f"{run['method']} seed {run['seed']}" if seeded else run["method"])
    assert {cell: sorted(entry["missing"]) for cell, entry in shown["cells"].items()} == \
        {cell: sorted(names) for cell, names in expected.items()}
    assert all(len(set(names)) == len(names) for names in expected.values())

