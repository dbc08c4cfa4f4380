"""Paths this user may not read or search: one line naming the path, exit code 2, nothing written.

The commands run without the capabilities that let root pass any file mode (setpriv), so that a mode of 000
refuses as it does for everyone else; as another user they run as they are. They run one after the other in one
child process of the module (:func:`as_user`), which imports the harness once: each command's exit code, stdout
and stderr are its own, as a process of its own would give them.
"""
import json
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from agg_bench.cli import main
from helpers import EXIT_CODE

ROOT = Path(__file__).resolve().parents[2]
TINY = ["model.resolution=32", "sampling.steps=3", "grpo.group_size=2", "grpo.prompts_per_iteration=1",
        "train.iterations=1", "progress=false", "telemetry.enabled=false"]
BYPASS = "-dac_override,-dac_read_search"

# The child of as_user: reads one JSON line [program, argv, folder] at a time, runs ``agg-bench ARGV`` (program
# "agg-bench") or ``snakemake ARGV`` (program "snakemake") in that folder with its file descriptors 1 and 2 on
# files of their own, and writes one JSON line [exit code, stdout, stderr] to the stdout it started with. An
# uncaught exception is a traceback and exit code 1, as the interpreter ends a process with one.
SERVER = r"""
import json, os, sys, tempfile, traceback

replies = os.fdopen(os.dup(1), "w")


def call(program, argv):
    if program == "agg-bench":
        from agg_bench.cli import main
        return main(argv)
    from snakemake.cli import main
    return main(argv)
""" + EXIT_CODE + r"""

for line in sys.stdin:
    program, argv, folder = json.loads(line)
    os.chdir(folder)
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        saved = os.dup(1), os.dup(2)
        os.dup2(out.fileno(), 1)
        os.dup2(err.fileno(), 2)
        code = exit_code(lambda: call(program, argv))
        for fd, copy in zip((1, 2), saved):
            os.dup2(copy, fd)
            os.close(copy)
        out.seek(0)
        err.seek(0)
        replies.write(json.dumps([code, out.read().decode(errors="replace"), err.read().decode(errors="replace")])
                      + "\n")
        replies.flush()
"""


def unprivileged() -> list[str]:
    if os.geteuid() != 0:
        return []
    if shutil.which("setpriv") is None:
        pytest.skip("root without setpriv: no way to run a command that file modes refuse")
    return ["setpriv", "--bounding-set", BYPASS, "--inh-caps", BYPASS]


@pytest.fixture(scope="module")
def as_user():
    """``as_user(program, *argv, cwd=ROOT)``: ``agg-bench ARGV`` or ``snakemake ARGV`` run as a user without
    root's bypass (in the module's one child, :data:`SERVER`), as a CompletedProcess; a command that takes more
    than 300 s ends the child."""
    prefix = unprivileged()
    child = subprocess.Popen([*prefix, sys.executable, "-c", SERVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"})

    def run(program: str, *argv: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
        assert child.stdin is not None and child.stdout is not None
        child.stdin.write(json.dumps([program, list(argv), str(cwd)]) + "\n")
        child.stdin.flush()
        watchdog = threading.Timer(300, child.kill)
        watchdog.start()
        try:
            reply = child.stdout.readline()
        finally:
            watchdog.cancel()
        assert reply, f"the unprivileged child ended (exit code {child.poll()}) running {program} {argv}"
        code, out, err = json.loads(reply)
        return subprocess.CompletedProcess([program, *argv], code, out, err)

    try:
        yield run
    finally:
        child.kill()
        child.wait(timeout=60)


@pytest.fixture
def refused(as_user):
    """``refused(*ARGV)``: the one line ``agg-bench ARGV`` prints as a user without root's bypass, after checking
    exit code 2."""
    def line(*argv: str) -> str:
        done = as_user("agg-bench", *argv)
        lines = done.stderr.strip().splitlines()
        assert done.returncode == 2 and len(lines) == 1, done.stderr
        return lines[0]

    return line


@pytest.fixture
def closed(tmp_path):
    """A run folder of mode 000 beside an open one, in ``tmp_path / "runs"``; modes put back for the clean-up."""
    runs = tmp_path / "runs"
    for name in ("a", "b"):
        assert main(["run", *[a for s in TINY for a in ("--set", s)], "--out", str(runs / name)]) == 0
    (runs / "b").chmod(0)
    yield runs / "b"
    (runs / "b").chmod(0o755)


def test_paths_behind_a_closed_folder(closed, tmp_path, refused):
    """Every verb's path below a folder this user may not search (a look at it raised PermissionError)."""
    for argv in (["run", "--out", str(closed / "new")], ["run", "--config", str(closed / "c.yaml"), "--out",
                                                         str(tmp_path / "new")],
                 ["report", "--runs", str(closed), "--tables", str(tmp_path / "new")],
                 ["learning", "--manifest", str(closed / "m.json"), "--tables", str(tmp_path / "new")]):
        line = refused(*argv)
        assert f"cannot be reached: this user may not search the folder {closed} (Permission denied)" in line, line
    assert not (tmp_path / "new").exists()


def test_config_paths_behind_a_closed_folder(closed, tmp_path, refused):
    """A config key's path below a folder this user may not search: a traceback of PermissionError (the prompts
    file, the embedding cache), or a model folder said to miss vae/."""
    for key in ("model.pretrained", "prompts.file", "prompts.cache_dir"):
        line = refused("run", *[a for s in TINY for a in ("--set", s)], "--set", "model.preset=pretrained",
                       "--set", f"model.pretrained={tmp_path}", "--set", f"{key}={closed / 'x'}",
                       "--out", str(tmp_path / "new"))
        assert f"{key} = '{closed / 'x'}'" in line and f"may not search the folder {closed}" in line, line
    assert not (tmp_path / "new").exists()


def test_reward_option_paths_behind_a_closed_folder(closed, tmp_path, refused):
    """A reward model's file or folder below a folder this user may not search: a traceback of PermissionError."""
    pytest.importorskip("transformers")
    for reward, option in (("aesthetic", "head"), ("clipscore", "model")):
        options = json.dumps({"model": str(tmp_path / "clip"), option: str(closed / "x")})
        line = refused("run", *[a for s in TINY for a in ("--set", s)], "--set", f"reward.name={reward}",
                       "--set", f"reward.options={options}", "--out", str(tmp_path / "new"))
        assert f"reward.options.{option} = '{closed / 'x'}'" in line and f"may not search the folder {closed}" in line, line
    assert not (tmp_path / "new").exists()


def test_learning_config_paths_as_written(folders, tmp_path, monkeypatch, capsys, refused):
    """A run folder's config.json, which learning reads without the run's checks: its embedding cache behind a
    closed folder was a PermissionError traceback, a quoted ~ a folder named ~ made in the current one."""
    prompts = tmp_path / "p.txt"
    prompts.write_text("a red cat\na blue dog\n")
    run = tmp_path / "run"
    assert main(["run", *[a for s in TINY for a in ("--set", s)], "--set", "train.iterations=2", "--set",
                 "train.checkpoint_every=2", "--set", "model.family=sd3", "--set", "model.preset=pretrained", "--set",
                 f"model.pretrained={folders('sd3')}", "--set", f"prompts.file={prompts}", "--set",
                 f"prompts.cache_dir={tmp_path / 'cache'}", "--out", str(run)]) == 0
    manifest = tmp_path / "m.json"
    manifest.write_text(json.dumps({"runs": [{"dir": str(run), "method": "full", "seed": 0}]}))
    config = json.loads((run / "config.json").read_text())
    learning = ["learning", "--manifest", str(manifest), "--tables", str(tmp_path / "t"), "--average", "1",
                "--eval-noises", "1"]
    monkeypatch.chdir(tmp_path)
    config["prompts"]["cache_dir"] = "~/cache"
    (run / "config.json").write_text(json.dumps(config))
    assert main(learning) == 2
    line = capsys.readouterr().err.strip()
    assert f"{run / 'config.json'}: config error: prompts.cache_dir = '~/cache'" in line and "starts with ~" in line, line
    assert not (tmp_path / "~").exists()
    closed = tmp_path / "closed"
    closed.mkdir(mode=0)
    try:
        config["prompts"]["cache_dir"] = str(closed / "cache")
        (run / "config.json").write_text(json.dumps(config))
        line = refused(*learning)
        assert f"prompts.cache_dir = '{closed / 'cache'}'" in line and f"may not search the folder {closed}" in line, line
    finally:
        closed.chmod(0o755)
    assert not (tmp_path / "t").exists()


def test_sweep_paths_behind_a_closed_folder(tmp_path, as_user):
    """A sweep's own paths below a folder this user may not search: a PermissionError of Snakemake's parse (exit
    code 1, the Snakefile's place), not one line."""
    from test_pipeline import refusal, workdir

    work = workdir(tmp_path)
    closed = tmp_path / "closed"
    closed.mkdir(mode=0)
    test = (work / "config" / "test.yaml").read_text()
    cases = {"base": test.replace("base: config/run.yaml", f"base: {closed / 'run.yaml'}"),
             "references[0].log": test.replace("references: []", f"references: [{{label: ref, log: {closed / 'l'}}}]"),
             "report.compare_with[0]": f"{test}report: {{compare_with: [{closed / 'ref'}]}}\n",
             "pretrain.scene.config": f"{test}pretrain: {{scene: {{config: {closed / 'p.yaml'}}}}}\n"}
    try:
        for key, text in cases.items():
            (work / "bad.yaml").write_text(text)
            line = refusal(as_user("snakemake", "-n", "--configfile", "bad.yaml", cwd=work))
            assert line.startswith(f"sweep config: {key}: ") and f"may not search the folder {closed}" in line, line
    finally:
        closed.chmod(0o755)
    assert not (work / "results").exists()


def test_a_closed_run_among_runs(closed, tmp_path, refused):
    line = refused("report", "--runs", str(closed.parent), "--tables", str(tmp_path / "t"))
    assert line.startswith(f"agg-bench report: --runs '{closed.parent}': 'b' cannot be reached"), line
    manifest = tmp_path / "m.json"
    manifest.write_text(json.dumps({"runs": [{"dir": str(closed.parent / "a")}, {"dir": str(closed)}]}))
    line = refused("report", "--manifest", str(manifest), "--tables", str(tmp_path / "t"))
    assert f"manifest {manifest}: runs[1].dir = '{closed}': cannot be reached" in line, line
    assert not (tmp_path / "t").exists()


def test_unreadable_snapshot_files(tmp_path, refused):
    """A snapshot's weights or rollout this user may not read: the reason is the one the system gave (the
    safetensors reader said "No such file or directory")."""
    snap = tmp_path / "snap"
    assert main(["snapshot", *[a for s in TINY for a in ("--set", s)], "--out", str(snap)]) == 0
    for name in ("rollout.safetensors", "transformer/diffusion_pytorch_model.safetensors"):
        (snap / name).chmod(0)
        line = refused("replay", str(snap), "--method", "full", "--out", str(tmp_path / "g" / "g.safetensors"))
        assert "Permission denied" in line and "No such file" not in line, line
        (snap / name).chmod(0o644)
    assert not (tmp_path / "g").exists()
