"""`agg-bench run --out DIR` never destroys what the harness did not write: a folder holding anything but
an agg-bench run is refused, a finished run of another config is replaced only with --overwrite, stale
temporaries are recognised by the harness's own name pattern only; and resuming cannot go backwards."""
from __future__ import annotations

import contextlib
import json
import os
import re
from pathlib import Path

import pytest
import torch

from agg_bench.cli import main
from agg_bench.errors import UserError
from agg_bench.io import atomic_path, is_temp_name, read_jsonl
from agg_bench.outdir import FOLDER_LOCK, OUTPUT_MARKS, Busy, Claim, Contents, claim_files, remove_owned
from agg_bench.runtime.checkpoint import RESUMABLE_CHANGES, SAME_RUN_CHANGES
from helpers import ENDED_PID, Holder, running_process

SMALL = ["model.resolution=32", "sampling.steps=4", "grpo.group_size=2", "train.iterations=1", "progress=false",
         "telemetry.enabled=false"]


def run(out: Path, *extra: str) -> list[str]:
    return ["run", *[a for o in SMALL for a in ("--set", o)], *extra, "--out", str(out)]


def snapshot(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def one_error_line(capsys) -> str:
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    return lines[0]


def test_temporary_names_are_the_harness_s_own():
    tmp = atomic_path(Path("/x/summary.json"))
    assert is_temp_name(tmp.name) and tmp.name.startswith(".summary.") and tmp.suffix == ".json"
    assert is_temp_name(atomic_path(Path("checkpoint.pt")).name)
    assert is_temp_name(".summary.agg-bench-tmp42.json") and is_temp_name(".m.agg-bench-tmp42-0123abcd")
    for name in (".bashrc.tmpl", ".notes.tmp", ".summary.json.tmp99", "summary.agg-bench-tmp1.json", ".x.tmp1",
                 ".x.agg-bench-tmp42-zz", ".x.agg-bench-tmp42-0123abcd0", ".x.agg-bench-tmp-0123abcd"):
        assert not is_temp_name(name), name


def test_a_temporary_of_this_process_s_pid_is_its_own_only_when_this_process_run_named_it(tmp_path):
    """PIDs are reused (a fresh container's few from the start): a temporary that a killed process left can carry
    the PID of the process looking at it. The name says which run of the PID wrote it, so such a one is stale, and
    never the name this process writes under; this process's own, and a running other process's, are not. A
    forked child names its temporaries anew. The longest name an output may have still leaves room for its
    temporary's (outdir.SIBLING_BYTES)."""
    from agg_bench.io import is_stale_temp, temp_owner
    from agg_bench.outdir import NAME_MAX, SIBLING_BYTES

    path = tmp_path / "g.v1.csv"
    mine, earlier = atomic_path(path), atomic_path(path, os.getpid())
    assert mine != earlier and is_temp_name(earlier.name) and mine.suffix == earlier.suffix == ".csv"
    assert temp_owner(path, mine.name) == temp_owner(path, earlier.name) == os.getpid()
    assert is_stale_temp(earlier.name, path) and is_stale_temp(earlier.name)
    assert not is_stale_temp(mine.name, path) and not is_stale_temp(mine.name)
    assert not is_stale_temp(earlier.name, tmp_path / "other.csv") and not is_stale_temp("g.v1.csv", path)
    with running_process() as live:
        assert not is_stale_temp(atomic_path(path, live).name, path)
        assert not is_stale_temp(mine.name.replace(f"{os.getpid()}-", f"{live}-"), path)
    read, write = os.pipe()
    child = os.fork()
    if child == 0:  # the child: only its temporary's name, then out without pytest's clean-up
        os.write(write, atomic_path(path).name.encode())
        os._exit(0)
    os.close(write)
    os.waitpid(child, 0)
    with os.fdopen(read, "rb") as fh:
        theirs = fh.read().decode()
    assert temp_owner(path, theirs) == child and theirs.split("-")[-1] != mine.name.split("-")[-1]
    longest = Path("L" * (NAME_MAX - SIBLING_BYTES))
    assert len(atomic_path(longest).name.replace(str(os.getpid()), "9" * 7, 1)) <= NAME_MAX


def test_a_folder_of_many_writers_files_loses_the_temporaries_of_a_killed_process_of_this_pid(tmp_path):
    """A campaign window cleans its work folder's cells/, calibration/ and windows/ of every ended process's
    temporary (outdir.remove_stale_harness_files): one of a killed process whose PID this one has too went
    unremoved for good. This process run's own, and a running other process's, stay."""
    from agg_bench.outdir import remove_stale_harness_files

    with running_process() as live:
        stale = [atomic_path(tmp_path / "a.json", os.getpid()), atomic_path(tmp_path / "b.json", ENDED_PID)]
        kept = [atomic_path(tmp_path / "c.json"), atomic_path(tmp_path / "d.json", live), tmp_path / "e.json"]
        for path in stale + kept:
            path.write_text("{}")
        remove_stale_harness_files(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(p.name for p in kept)


def test_a_marker_s_folder_is_writable_beside_a_killed_probe_of_this_pid(tmp_path):
    """check_writable tries a --done marker's folder by making its temporary there at once (O_EXCL): a killed
    process whose PID this one has too (PIDs reused in a fresh container) left that name, and the marker was
    refused as not writable ("File exists")."""
    from agg_bench.outdir import check_writable

    done = tmp_path / "done.json"
    atomic_path(done, os.getpid()).write_text("")
    check_writable(done, "--done")
    assert sorted(p.name for p in tmp_path.iterdir()) == [atomic_path(done, os.getpid()).name]


@pytest.mark.parametrize("verb, suffix", [("embed", ".safetensors"), ("replay", ".safetensors"), ("gradcheck", ".csv")])
def test_a_file_output_of_another_suffix_is_refused_and_nothing_written(tmp_path, capsys, verb, suffix):
    """Each verb that writes one file takes the suffix its readers look for (outdir.check_suffix), in one line
    (calibrate's: test_calibrate.py), before anything else: a file of that name, someone's, is named as the wrong
    suffix (not as a foreign file, a lock held or a folder missing) and left as it was, with no lock beside it."""
    out = tmp_path / "out.txt"
    args = [str(tmp_path / "snap"), "--method", "full"] if verb == "replay" else \
        [a for o in SMALL for a in ("--set", o)]
    assert main([verb, *args, "--out", str(out)]) == 2
    assert one_error_line(capsys).endswith(f"--out {out}: expected a FILE{suffix} path")
    assert list(tmp_path.iterdir()) == []
    out.write_text("notes")
    assert main([verb, *args, "--out", str(out)]) == 2
    assert one_error_line(capsys).endswith(f"--out {out}: expected a FILE{suffix} path")
    assert list(tmp_path.iterdir()) == [out] and out.read_text() == "notes"


def test_a_folder_that_cannot_be_searched_with_a_control_character_is_quoted(tmp_path, monkeypatch):
    """reach_problem named the folder this user may not search as it is: a newline in its path was joined into the
    one-line refusal. A look inside it is refused here as it is for a user without search permission."""
    import os

    from agg_bench import outdir

    folder = tmp_path / "a\nb"
    folder.mkdir()
    real = os.stat

    def stat(path, *args, **kwargs):
        if os.fspath(path) == os.path.join(folder, "."):
            raise PermissionError(13, "Permission denied")
        return real(path, *args, **kwargs)

    monkeypatch.setattr(outdir.os, "stat", stat)
    assert outdir.reach_problem(str(folder)) == (f"cannot be reached: this user may not search the folder "
                                                 f"{str(folder)!r} (Permission denied)")


@pytest.mark.parametrize("name", ["a\nb", "a\rb", "a\x1b[31mb"])
def test_a_path_with_a_control_character_is_quoted_in_a_refusal(tmp_path, capsys, name):
    """A refusal is one line, so a path holding a newline or carriage return was joined into it unquoted (and an
    escape sequence written as it is), and where the path ended could not be told. Such a path, and such a name in
    the folder, are quoted as a progress line quotes them (errors.shown); an ordinary path stays as it is (the
    tests above)."""
    out = tmp_path / f"{name}.txt"
    assert main(["embed", *[a for o in SMALL for a in ("--set", o)], "--out", str(out)]) == 2
    assert one_error_line(capsys).endswith(f"--out {str(out)!r}: expected a FILE.safetensors path")
    folder = tmp_path / name
    folder.mkdir()
    (folder / name).write_text("mine")
    assert main(run(folder)) == 2
    line = one_error_line(capsys)
    assert line.startswith(f"agg-bench run: --out {str(folder)!r}: the folder holds files that are not ")
    assert f" ({name!r}); " in line
    (folder / name).unlink()
    assert main(run(folder, "--done", str(folder / name))) == 2
    assert one_error_line(capsys).endswith(f"--done {str(folder / name)!r}: inside --out {str(folder)!r}; expected a "
                                           "marker outside the run folder")
    assert list(folder.iterdir()) == []


def _reward_checkpoint_missing(folder: Path):
    from agg_bench.engine.reward_models.common import require_path

    path = str(folder / "hps.pt")
    return require_path, ("hpsv2", {"checkpoint": path}, "checkpoint", "the file"), \
        f"reward.options.checkpoint = {path!r} does not exist"


def _reward_checkpoint_a_folder(folder: Path):
    from agg_bench.engine.reward_models.common import load_state_dict

    return load_state_dict, ("hpsv2", folder, "the file"), f"reward 'hpsv2': {str(folder)!r} is a folder"


def _cell_path_refused(folder: Path):
    from agg_bench.runtime.cell import read_jobs

    jobs = folder / "jobs.json"
    jobs.write_text(json.dumps({"runs": [{"out": ""}]}))
    return read_jobs, (jobs,), f"{str(jobs)!r}: runs[0].out '': "


def _cell_marker_a_folder(folder: Path):
    from agg_bench.runtime.cell import read_jobs

    jobs, marker = folder / "jobs.json", folder / "marker.json"
    marker.mkdir()
    jobs.write_text(json.dumps({"runs": [{"out": str(folder / "run"), "done": str(marker)}]}))
    return read_jobs, (jobs,), f"{str(jobs)!r}: runs[0].done {str(marker)!r}: is a folder"


@pytest.mark.parametrize("refusal", [_reward_checkpoint_missing, _reward_checkpoint_a_folder, _cell_path_refused,
                                     _cell_marker_a_folder])
def test_a_path_with_a_newline_is_quoted_in_a_reward_model_or_cell_refusal(tmp_path, refusal):
    """The reward models wrote a path between hand-written quotes, and a cell job file's refusals began with its path
    as it is: a newline in it split the one-line refusal. Quoted as every refusal quotes a path (errors.quote,
    errors.shown)."""
    folder = tmp_path / "a\nb"
    folder.mkdir()
    function, args, words = refusal(folder)
    with pytest.raises(UserError) as err:
        function(*args)
    assert "\n" not in str(err.value) and words in str(err.value), str(err.value)


def test_a_user_folder_is_refused_and_left_as_it_was(tmp_path, capsys):
    out = tmp_path / "home"
    out.mkdir()
    (out / ".bashrc.tmpl").write_text("export A=1\n")
    (out / "summary.json").write_text('{"mine": true}\n')
    (out / "metrics.jsonl").write_text('{"mine": 1}\n')
    before = snapshot(out)
    capsys.readouterr()
    assert main(run(out)) == 2
    line = one_error_line(capsys)
    assert str(out) in line and "not an agg-bench run" in line
    assert snapshot(out) == before
    assert main(run(out, "--overwrite")) == 2  # --overwrite replaces runs, never other files
    assert snapshot(out) == before


def test_a_finished_run_of_another_config_needs_overwrite(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(run(out)) == 0
    assert main(run(out)) == 0  # the same config again: a rerun replaces it
    before = snapshot(out)
    capsys.readouterr()
    assert main(run(out, "--set", "train.lr=1e-3")) == 2
    line = one_error_line(capsys)
    assert "train.lr" in line and "--overwrite" in line
    assert snapshot(out) == before
    assert main(run(out, "--set", "train.lr=1e-3", "--overwrite")) == 0
    assert json.loads((out / "config.json").read_text())["train"]["lr"] == 1e-3
    assert [r["iteration"] for r in read_jsonl(out / "metrics.jsonl")] == [0]


def test_keys_that_change_nothing_a_run_records_do_not_make_another_config(tmp_path, capsys):
    """A finished run rerun with another checkpoint interval or progress display is the same run; keys that
    change its records (how far it goes, what it measures) make another one."""
    out = tmp_path / "run"
    assert main(run(out)) == 0
    assert main(run(out, "--checkpoint-every", "1", "--set", "progress=true")) == 0
    assert json.loads((out / "config.json").read_text())["train"]["checkpoint_every"] == 1
    assert (out / "checkpoint.pt").is_file()
    assert main(run(out)) == 0  # and back
    before = snapshot(out)
    for key, value in (("train.iterations", "2"), ("telemetry.enabled", "true")):
        capsys.readouterr()
        assert main(run(out, "--set", f"{key}={value}")) == 2
        line = one_error_line(capsys)
        assert "another config" in line and key in line
        assert snapshot(out) == before
    # one list: what may differ between a finished run and its rerun may differ on resuming too
    assert set(SAME_RUN_CHANGES) < set(RESUMABLE_CHANGES)


def test_an_unfinished_run_is_replaced_by_a_rerun(tmp_path):
    """What Snakemake leaves when it reruns a job: the run's files without summary.json (it deletes the
    job's outputs first), so a rerun with changed parameters goes ahead."""
    out = tmp_path / "run"
    assert main(run(out)) == 0
    (out / "summary.json").unlink()
    assert main(run(out, "--set", "train.lr=1e-3")) == 0


def test_resume_cannot_go_back_before_the_checkpoint(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(run(out, "--set", "train.iterations=3", "--checkpoint-every", "1")) == 0
    before = snapshot(out)
    capsys.readouterr()
    for iterations in (1, 2):
        assert main(run(out, "--set", f"train.iterations={iterations}", "--checkpoint-every", "1", "--resume")) == 2
        line = one_error_line(capsys)
        assert "train.iterations" in line and "2" in line
    assert snapshot(out) == before
    # as many iterations as the checkpoint holds: nothing left to do
    assert main(run(out, "--set", "train.iterations=3", "--checkpoint-every", "1", "--resume")) == 0
    assert [r["iteration"] for r in read_jsonl(out / "metrics.jsonl")] == [0, 1, 2]


def test_a_damaged_line_before_the_last_names_the_file_and_the_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"iteration": 0}\n{"iteration": 1, "lo\n{"iteration": 2}\n')
    with pytest.raises(UserError, match=r"metrics\.jsonl: line 2 "):
        list(read_jsonl(path))
    path.write_text('{"iteration": 0}\n{"iteration": 1, "lo')  # a torn last line: skipped
    assert list(read_jsonl(path)) == [{"iteration": 0}]


# the profile as short as it goes: what is tested is where it writes, not what it records (one denoising step
# of one prompt's group: the profiler's parse of its events, most of a profile's cost, is half SMALL's)
PROFILE_ONE_STEP = ["--method", "full", "--phase", "train", "--wait", "0", "--warmup", "0", "--active", "1",
                    "--set", "sampling.steps=1", "--set", "grpo.prompts_per_iteration=1"]


@pytest.mark.parametrize("verb, extra", [("snapshot", []), ("profile", PROFILE_ONE_STEP)])
def test_snapshot_and_profile_refuse_a_folder_of_other_files_and_rerun_into_their_own(tmp_path, capsys, monkeypatch,
                                                                                       verb, extra):
    sets = [a for o in SMALL for a in ("--set", o)]
    if verb == "profile":
        # where it writes is tested, not what it records: the profiler (traces, operators.csv) runs around an empty
        # step instead of the update, whose events' parse is most of a profile's cost
        from agg_bench.tools import profiling

        real = profiling.profile_steps
        monkeypatch.setattr(profiling, "profile_steps", lambda step, *args, **kwargs: real(lambda: None, *args, **kwargs))
    home = tmp_path / "home"
    home.mkdir()
    (home / "config.json").write_text('{"mine": true}\n')  # a name the verb writes too, beside one it doesn't
    (home / "notes.txt").write_text("mine\n")
    before = snapshot(home)
    capsys.readouterr()
    assert main([verb, *sets, *extra, "--out", str(home)]) == 2
    line = one_error_line(capsys)
    assert str(home) in line and "notes.txt" in line
    assert snapshot(home) == before
    out = tmp_path / verb
    assert main([verb, *sets, *extra, "--out", str(out)]) == 0
    assert main([verb, *sets, *extra, "--out", str(out)]) == 0  # its own earlier output: written again


def tree(folder: Path) -> dict[str, bytes | None]:
    """Every path under ``folder`` with its bytes (None for a folder)."""
    return {str(p.relative_to(folder)): None if p.is_dir() else p.read_bytes() for p in sorted(folder.rglob("*"))}


@pytest.mark.parametrize("earlier", [False, True])
def test_a_snapshot_that_fails_leaves_nothing_and_an_earlier_one_as_it_was(tmp_path, capsys, monkeypatch, earlier):
    """A full disk while rollout.safetensors is written (after the transformer's weights) is one line and exit 2,
    and leaves no transformer/ behind (an empty one was left): a new --out is gone, an earlier snapshot in it is
    byte for byte what it was, and `agg-bench snapshot` writes it again afterwards."""
    import errno
    import os

    from agg_bench.tools import snapshot as snapshots

    sets = [a for o in SMALL for a in ("--set", o)]
    out = tmp_path / "snap"
    if earlier:
        assert main(["snapshot", *sets, "--set", "seed=1", "--out", str(out)]) == 0
    before = tree(out) if earlier else None
    real_save_file = snapshots.save_file

    def full(tensors, path, *args, **kwargs):
        with open(path, "wb") as handle:
            handle.write(b"\0" * 100)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)

    monkeypatch.setattr(snapshots, "save_file", full)
    capsys.readouterr()
    assert main(["snapshot", *sets, "--out", str(out)]) == 2
    line = one_error_line(capsys)
    assert "no space left on device" in line and "rollout.safetensors" in line, line
    assert (tree(out) if earlier else out.exists()) == (before if earlier else False)
    assert sorted(p.name for p in tmp_path.iterdir()) == (["snap"] if earlier else [])
    monkeypatch.setattr(snapshots, "save_file", real_save_file)
    assert main(["snapshot", *sets, "--out", str(out)]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "rollout.json", "rollout.safetensors", "transformer"]


def test_a_snapshot_replaces_its_transformer_folder_whole_and_refuses_one_holding_other_files(tmp_path, capsys):
    """transformer/ is replaced whole by a new snapshot, so a file in it that a snapshot does not write is
    someone else's: refused before anything is written."""
    sets = [a for o in SMALL for a in ("--set", o)]
    out = tmp_path / "snap"
    assert main(["snapshot", *sets, "--out", str(out)]) == 0
    (out / "transformer" / "notes.txt").write_text("mine\n")
    before = tree(out)
    capsys.readouterr()
    assert main(["snapshot", *sets, "--out", str(out)]) == 2
    assert "transformer/notes.txt" in one_error_line(capsys)
    assert tree(out) == before


@pytest.mark.parametrize("inside", ["tensorboard/notes.txt", "tensorboard/otherrun/events.out.tfevents.1.h.2.0",
                                    "checkpoint_shards_000001/notes.txt", "checkpoint_shards_000002/mine/x"])
def test_a_rerun_refuses_a_user_s_files_inside_the_folders_a_run_removes(tmp_path, capsys, inside):
    """Issue 37: a rerun (no tensorboard, no checkpoint) removes the earlier attempt's tensorboard/ and shard
    folders; one that holds anything but what the harness writes there is someone's, and refused."""
    out = tmp_path / "run"
    assert main(run(out)) == 0
    (out / inside).parent.mkdir(parents=True, exist_ok=True)
    (out / inside).write_text("mine\n")
    before = tree(out)
    capsys.readouterr()
    assert main(run(out)) == 2
    line = one_error_line(capsys)
    assert str(out) in line and inside.split("/")[1] in line and "not an agg-bench run" in line
    assert tree(out) == before


def test_a_rerun_removes_the_harness_s_own_curves_and_shards(tmp_path):
    out = tmp_path / "run"
    assert main(run(out)) == 0
    (out / "tensorboard").mkdir()
    (out / "tensorboard" / "events.out.tfevents.1700000000.host.123.0").write_bytes(b"\0events")
    (out / "checkpoint_shards_000003").mkdir()
    for name in ("__0_0.distcp", "__1_0.distcp", ".metadata"):
        (out / "checkpoint_shards_000003" / name).write_bytes(b"\0shard")
    assert main(run(out)) == 0
    assert not (out / "tensorboard").exists() and not (out / "checkpoint_shards_000003").exists()


def test_removing_a_folder_s_own_files_keeps_a_lock_a_process_holds(tmp_path):
    """remove_owned removes a lock file only when no process holds it: a held one (another process's, or the
    caller's own claim) stays, so no second writer can claim the folder beside its holder; a dead holder's
    stale lock goes, and with it the folder."""
    folder, contents = tmp_path / "out", Contents("an output", ("a.json",))
    holder = Holder(folder, folder=True, lock_inside=True)
    lock = folder / FOLDER_LOCK
    try:
        remove_owned(folder, contents)
        assert lock.read_text().strip() == str(holder.proc.pid)
        with pytest.raises(Busy) as refused:
            Claim(folder, folder=True, lock_inside=True).acquire()
        assert refused.value.pid == holder.proc.pid and refused.value.target == folder
    finally:
        holder.kill()  # its lock file stays behind, held by no one
    (folder / "a.json").write_text("{}")
    with Claim(folder, folder=True, lock_inside=True):
        remove_owned(folder, contents)
        assert [p.name for p in folder.iterdir()] == [FOLDER_LOCK] and lock.read_text().strip() == str(os.getpid())
    assert not lock.exists()
    (folder / "a.json").write_text("{}")
    lock.write_text("12345\n")  # stale: no process holds it
    remove_owned(folder, contents)
    assert not folder.exists()


@pytest.mark.parametrize("name, folder", [("summary.json", True), ("metrics.jsonl", True), ("env.json", True),
                                          ("plan.json", True), ("tensorboard", False),
                                          ("checkpoint_shards_000001", False)])
@pytest.mark.parametrize("resume", [False, True])
def test_a_name_of_the_wrong_kind_is_refused_before_anything_is_written(tmp_path, capsys, name, folder, resume):
    """Issue 37: a summary.json or metrics.jsonl that is a folder failed only after config.json and env.json
    were rewritten; a file named tensorboard failed on --resume after the summary was gone. Each is one line
    and exit 2 now, and the folder is as it was."""
    out = tmp_path / "run"
    assert main(run(out, "--checkpoint-every", "1")) == 0
    target = out / name
    if target.exists():
        target.unlink()
    if folder:
        target.mkdir()
        (target / "x").write_text("mine\n")
    else:
        target.write_text("mine\n")
    before = tree(out)
    capsys.readouterr()
    assert main(run(out, "--checkpoint-every", "1", *(["--resume"] if resume else []))) == 2
    line = one_error_line(capsys)
    assert f"{name} is {'a folder' if folder else 'a file'}" in line and str(out) in line
    assert tree(out) == before


def test_pretrain_refuses_a_user_s_file_inside_its_model_folders(tmp_path, capsys):
    """Issue 37: pretrain --out over an earlier output replaces it whole, with whatever a user had put into
    its transformer/ or scheduler/; such an output is refused now and stays as it was."""
    from agg_bench.tools.pretrain import PRETRAIN_CONTENTS, check_out_dir

    out = tmp_path / "model"
    for sub, files in (("transformer", ("config.json", "diffusion_pytorch_model.safetensors")),
                       ("vae", ("config.json",)), ("scheduler", ("scheduler_config.json",))):
        (out / sub).mkdir(parents=True)
        for file in files:
            (out / sub / file).write_text("{}")
    for file in ("token_hash.json", "samples.png"):
        (out / file).write_text("{}")
    (out / "pretrain.json").write_text('{"format": "agg-bench-pretrain/1"}')  # the mark of pretrain's own output
    check_out_dir(out)  # an earlier output: replaced
    for inside in ("transformer/notes.txt", "scheduler/mine/x", "vae/weights.bin"):
        (out / inside).parent.mkdir(parents=True, exist_ok=True)
        (out / inside).write_text("mine\n")
        before = tree(out)
        assert main(["pretrain", "--set", "steps=1", "--out", str(out)]) == 2
        line = one_error_line(capsys)
        assert inside.split("/")[1] in line and PRETRAIN_CONTENTS.what in line
        assert tree(out) == before
        (out / inside).unlink()
        if (out / inside).parent.name == "mine":
            (out / inside).parent.rmdir()
    check_out_dir(out)


class _Written:
    """A run config as the journal takes it (``to_dict``)."""

    def __init__(self, seed: int):
        self.seed = seed

    def to_dict(self) -> dict:
        return {"seed": self.seed}


def _record_runs(path: Path, outs: list[str], ready) -> None:
    from agg_bench.runtime.cell import CellRun, Journal

    journal = Journal.read(path, "agg-bench run", "--journal", "its run runs again")  # as `run` does, at its start
    ready.wait()
    for i, out in enumerate(outs):
        journal.add(CellRun(None, (), Path(out)), _Written(i), "ok")


@pytest.mark.parametrize("reused", [False, True])
def test_pretrain_removes_what_a_killed_pretrain_left_beside_its_out_but_not_a_live_one_s(tmp_path, reused):
    """A pretrain killed (SIGKILL) while it saved left its temporary model folder beside --out, and one killed
    while it renamed the new folder in left the earlier output moved aside: both stayed forever. A rerun removes
    those of processes that have ended, a killed one's whose PID the rerun has too (PIDs reused in a fresh
    container) included; a live process's temporary, and a user's look-alike, stay."""
    import subprocess
    import sys

    out = tmp_path / "model"
    ended = os.getpid() if reused else int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                                                          capture_output=True, text=True).stdout)
    live = os.getppid()

    def of(pid: int, path: Path) -> Path:
        return atomic_path(path, pid)

    stale = [of(ended, out), of(ended, tmp_path / "model-old")]
    kept = [of(live, out), tmp_path / ".model.agg-bench-tmp", tmp_path / ".model.mine", of(ended, tmp_path / "other")]
    for folder in stale + kept:
        (folder / "transformer").mkdir(parents=True)
        (folder / "transformer" / "diffusion_pytorch_model.safetensors").write_text("weights")
    assert main(["pretrain", "--set", "steps=1", "--out", str(out)]) == 0
    assert (out / "pretrain.json").is_file()
    assert not any(path.exists() for path in stale)
    assert all((path / "transformer" / "diffusion_pytorch_model.safetensors").is_file() for path in kept)


def test_runs_recording_into_one_journal_at_once_keep_every_entry(tmp_path):
    """`agg-bench run --journal FILE` of the same FILE in several processes: each reads the journal when it starts
    and records its run when it ends; the record is a read-modify-write under the journal's lock, so no process
    writes back the journal it read at its start over another's entries (every entry but the last writer's was
    lost), and no two rewrite it at the same moment."""
    import multiprocessing

    context = multiprocessing.get_context("fork")
    path = tmp_path / "jobs" / "cell.progress.json"
    outs = [[str(tmp_path / f"run{p}-{i}") for i in range(3)] for p in range(4)]
    ready = context.Barrier(len(outs))
    workers = [context.Process(target=_record_runs, args=(path, mine, ready)) for mine in outs]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(60)
    assert [worker.exitcode for worker in workers] == [0] * len(outs)
    runs = json.loads(path.read_text())["runs"]
    assert runs == {out: {"config": {"seed": i}, "status": "ok"} for mine in outs for i, out in enumerate(mine)}
    assert sorted(p.name for p in path.parent.iterdir()) == [path.name]  # no lock file left


@pytest.mark.parametrize("verb, out", [
    (["calibrate", *[a for o in SMALL for a in ("--set", o)], "--out"], "afile/cal.json"),
    (["calibrate", *[a for o in SMALL for a in ("--set", o)], "--out"], "afile/deeper/cal.json"),
    (["report", "--runs", "RUNS", "--tables"], "afile/tables"),
])
def test_a_file_where_an_output_s_folder_goes_is_named_as_a_file(tmp_path, capsys, verb, out):
    """A file on the path an output's folders are made along is one line saying that it is a file, not a folder
    (mkdir said only "File exists" or "Not a directory"), exit 2; the file is left as it was."""
    afile = tmp_path / "afile"
    afile.write_text("mine")
    runs = tmp_path / "runs"
    if "RUNS" in verb:
        assert main(run(runs / "a")) == 0
        capsys.readouterr()
    args = [str(runs) if a == "RUNS" else a for a in verb]
    assert main([*args, str(tmp_path / out)]) == 2
    flag = verb[-1]
    assert one_error_line(capsys) == (f"agg-bench {args[0]}: {flag} {tmp_path / out}: {afile} is a file, not a folder "
                                      "(expected a folder there, or nothing: missing folders are made)")
    assert afile.read_text() == "mine"


def _ended_pid() -> int:
    import subprocess
    import sys

    return int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                              text=True).stdout)


@pytest.mark.parametrize("reused", [False, True])
@pytest.mark.parametrize("renamed_in", [False, True])
def test_a_folder_replacement_killed_between_its_renames_keeps_a_whole_folder(tmp_path, renamed_in, reused):
    """A process killed (SIGKILL) after it moved the earlier folder aside and before it renamed the new one in
    left no folder at the path: the next writer's clean-up puts the earlier one back, where it removed it with
    the temporaries and the folder was lost. Killed after the second rename, the new folder stays and the
    earlier one goes. So too where the killed process had the PID of the one cleaning up (PIDs reused in a fresh
    container), whose own they are not: they were left for good, the path empty."""
    from agg_bench.io import remove_stale_temps

    dead = os.getpid() if reused else _ended_pid()
    out = tmp_path / "tables"

    def of(path: Path) -> Path:
        return atomic_path(path, dead)

    aside, new = of(tmp_path / "tables-old"), of(out)
    aside.mkdir()
    (aside / "summary.csv").write_text("earlier")
    written = out if renamed_in else new
    written.mkdir()
    (written / "summary.csv").write_text("new")
    remove_stale_temps(out)
    assert (out / "summary.csv").read_text() == ("new" if renamed_in else "earlier")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tables"]


def test_a_folder_that_cannot_be_renamed_in_puts_the_earlier_one_back(tmp_path, monkeypatch):
    """The second rename of a folder replacement failing (an error, or a signal's exception) leaves the earlier
    folder at its path, not moved aside and then removed."""
    from agg_bench import io as agg_io

    out = tmp_path / "tables"
    out.mkdir()
    (out / "summary.csv").write_text("earlier")
    real = os.replace

    def failing(src, dst):
        if Path(src).name.startswith(".tables.") and Path(dst) == out:
            raise OSError(5, "Input/output error")
        real(src, dst)

    monkeypatch.setattr(agg_io.os, "replace", failing)
    with pytest.raises(OSError):
        with agg_io.atomic_target(out) as tmp:
            tmp.mkdir()
            (tmp / "summary.csv").write_text("new")
    assert (out / "summary.csv").read_text() == "earlier"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tables"]


@pytest.mark.parametrize("verb", [
    ["report", "--runs", str(Path(__file__).parents[2] / "results" / "reference" / "h200" / "runs"), "--tables"],
    ["run", "--out"]])
def test_the_current_folder_as_an_output_is_refused_as_what_it_is(tmp_path, monkeypatch, capsys, verb):
    """The current folder as an output folder (it has no name to claim or replace it by): one line saying so,
    where it said "a file-system root", and nothing made there."""
    monkeypatch.chdir(tmp_path)
    capsys.readouterr()
    assert main([*verb, "."]) == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and ".: give a named folder or file, not the current folder or a file-system root" \
        in lines[0], lines
    assert list(tmp_path.iterdir()) == []


@contextlib.contextmanager
def umask(mask: int):
    old = os.umask(mask)
    try:
        yield
    finally:
        os.umask(old)


def modes(folder: Path) -> dict[str, int]:
    return {str(p.relative_to(folder)): p.stat().st_mode & 0o777 for p in sorted(folder.rglob("*"))}


@pytest.mark.parametrize("mask", [0o022, 0o002, 0o077])
def test_what_the_harness_writes_has_the_modes_of_the_umask(tmp_path, capsys, mask):
    """Every file written through the atomic writes, whoever writes its bytes, has the mode a plain open() gives
    under the umask (0644 under 022), every folder mkdir's: safetensors writes 0600, so a pretrained model's
    weights and a snapshot's could not be read by the group a results folder is shared with, and the JSON writers'
    fixed 0644 ignored a group-writable umask (002)."""
    from safetensors.torch import save_file

    from agg_bench.io import JsonlWriter, atomic_target, write_json

    weights = {"x": torch.zeros(2)}
    with umask(mask):
        write_json(tmp_path / "a.json", {})
        with JsonlWriter(tmp_path / "m.jsonl") as writer:
            writer.write({})
        with atomic_target(tmp_path / "w.safetensors") as tmp:
            save_file(weights, str(tmp))
        with atomic_target(tmp_path / "model") as tmp:
            (tmp / "transformer").mkdir(parents=True)
            save_file(weights, str(tmp / "transformer" / "w.safetensors"))
        assert main(["snapshot", *[a for o in SMALL for a in ("--set", o)], "--out", str(tmp_path / "snap")]) == 0
    capsys.readouterr()
    folders = {name for name, _ in modes(tmp_path).items() if (tmp_path / name).is_dir()}
    assert {"model", "model/transformer", "snap", "snap/transformer"} <= folders
    assert "snap/rollout.safetensors" in modes(tmp_path)
    assert modes(tmp_path) == {name: (0o777 if name in folders else 0o666) & ~mask for name in modes(tmp_path)}


def test_a_replaced_folder_keeps_the_modes_of_the_files_it_carries(tmp_path):
    """Files a folder replacement carries over are the folder's own (hard links): their modes stay as their owner
    set them; what the block writes has the umask's."""
    from agg_bench.io import write_json
    from agg_bench.outdir import replaced_folders

    folder = tmp_path / "tables"
    folder.mkdir()
    (folder / "kept.csv").write_text("a\n")
    (folder / "kept.csv").chmod(0o640)
    with umask(0o022), replaced_folders(folder) as staged:
        write_json(staged(folder) / "new.json", {})
    assert modes(folder) == {"kept.csv": 0o640, "new.json": 0o644}


def test_a_file_claim_removes_what_killed_writers_of_its_files_left_beside_them(tmp_path):
    """A replay killed while it saved its gradient left the temporary (a whole model's gradient) beside --out for
    good, each attempt's under its own PID. Once the claim is held the ended processes' temporaries of the claimed
    files go; a live process's, and a user's file of a like name, stay."""

    from agg_bench.outdir import json_file_with

    out, counts = tmp_path / "r.safetensors", tmp_path / "r.json"

    with running_process() as live:
        stale = [atomic_path(out, ENDED_PID), atomic_path(counts, ENDED_PID + 1)]
        kept = [atomic_path(out, live), tmp_path / ".r.agg-bench-tmpx.safetensors", tmp_path / "notes.txt"]
        for path in stale + kept:
            path.write_bytes(b"data")
        with claim_files({out: (lambda path: False, "a replay's gradients"),
                          counts: (json_file_with("method"), "a replay's pass counts")}):
            assert sorted(p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock")) == \
                sorted(p.name for p in kept)


def test_a_sigterm_while_a_snapshot_is_renamed_into_place_waits_for_the_last_rename(tmp_path, monkeypatch):
    """A SIGTERM between the renames that replace an earlier snapshot stopped the command there: the folder held
    the new transformer without rollout.json, neither snapshot. The renames finish first, then the command stops."""
    import signal

    from agg_bench import stopping
    from agg_bench.stopping import Interrupted
    from agg_bench.tools import snapshot as snapshots

    out, staging = tmp_path / "snap", tmp_path / "snap" / ".staging"
    names = ("transformer/config.json", "rollout.safetensors", "config.json", "rollout.json")
    for folder, text in ((out, "earlier"), (staging, "new")):
        (folder / "transformer").mkdir(parents=True)
        for name in names:
            (folder / name).write_text(text)
    rename = os.replace

    def signalled(source, target):
        os.kill(os.getpid(), signal.SIGTERM)  # during the first rename
        monkeypatch.setattr(snapshots.os, "replace", rename)
        rename(source, target)

    monkeypatch.setattr(snapshots.os, "replace", signalled)
    with stopping.stop_signals("test"):
        with pytest.raises(Interrupted) as stopped:
            snapshots._move_into_place(staging, out)
        stopping.handled(stopped.value)
    assert {name: (out / name).read_text() if (out / name).exists() else None for name in names} == \
        dict.fromkeys(names, "new")


def test_an_output_inside_another_output_is_refused(tmp_path, capsys):
    # a folder or a file made inside a run folder is a stranger there: the run's rerun would refuse its own folder
    first, other = tmp_path / "run", tmp_path / "other"
    assert main(run(first)) == 0
    before = snapshot(first)
    capsys.readouterr()
    small = [a for o in SMALL for a in ("--set", o)]
    for argv, flag, path, kind in (
            (run(first / "inner"), "--out", first / "inner", "a folder"),
            (["snapshot", "--set", "model.resolution=32", "--out", str(first / "a" / "b")], "--out", first / "a" / "b",
             "a folder"),
            (run(other, "--done", str(first / "done.json")), "--done", first / "done.json", "a file"),
            (run(other, "--done", str(first / "a" / "done.json")), "--done", first / "a" / "done.json", "a file"),
            (run(other, "--journal", str(first / "j.json")), "--journal", first / "j.json", "a file"),
            (["embed", "--out", str(first / "e.safetensors")], "--out", first / "e.safetensors", "a file"),
            (["calibrate", *small, "--out", str(first / "c.json")], "--out", first / "c.json", "a file"),
            (["gradcheck", *small, "--out", str(first / "g.csv")], "--out", first / "g.csv", "a file")):
        assert main(argv) == 2
        line = one_error_line(capsys)
        assert f"{flag} '{path}': inside an agg-bench run '{first}'; expected {kind} outside it" in line, line
        assert snapshot(first) == before and not other.exists()


@pytest.mark.parametrize("mark", OUTPUT_MARKS, ids=[what for what, _ in OUTPUT_MARKS])
def test_a_file_claim_inside_another_output_is_refused_and_makes_nothing(tmp_path, mark):
    """A file output's claim (claim_files, a marker's or a journal's Claim) whose folder is, or is inside, another
    command's output folder is refused before its lock or a missing folder is made."""
    what, names = mark
    folder = tmp_path / "out"
    folder.mkdir()
    for name in names:
        (folder / name).write_text("{}")
    before = sorted(tmp_path.rglob("*"))
    for target in (folder / "f.json", folder / "a" / "b" / "f.json"):
        expected = f"--x '{target}': inside {what} '{folder}'; expected a file outside it"
        with pytest.raises(UserError, match=re.escape(expected)):
            claim_files({target: (lambda path: True, "a file of ours")}, "--x")
        with pytest.raises(UserError, match=re.escape(expected)):
            Claim(target, folder=False, lock_inside=False, flag="--x").acquire()
        assert sorted(tmp_path.rglob("*")) == before
    # beside the output folder, or in a folder that holds only part of a mark, a file output is its own
    (folder / names[0]).unlink()
    for target in (tmp_path / "f.json", folder / "f.json"):
        with claim_files({target: (lambda path: True, "a file of ours")}, "--x"):
            pass
