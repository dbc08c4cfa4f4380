"""scripts/setup.sh on a clone whose .venv is not what it made: one line saying what to do, exit code 2, and the
.venv as it was (it never removes one), instead of the error of `python -m venv` or of pip halfway through.
Each case runs a copy of the script in its own folder, never on the repository's .venv."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def clone(tmp_path: Path) -> Path:
    """What setup.sh reads: itself, pyproject.toml and the constraints."""
    repo = tmp_path / "repo"
    (repo / "scripts").mkdir(parents=True)
    (repo / "requirements").mkdir()
    shutil.copy(ROOT / "scripts" / "setup.sh", repo / "scripts")
    shutil.copy(ROOT / "pyproject.toml", repo)
    shutil.copy(ROOT / "requirements" / "constraints.txt", repo / "requirements")
    return repo


def setup(repo: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHON": sys.executable, "TORCH_INDEX_URL": ""}
    return subprocess.run(["bash", str(repo / "scripts" / "setup.sh")], capture_output=True, text=True, env=env,
                          timeout=60)


def files(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): os.readlink(p) if p.is_symlink() else p.read_text()
            for p in sorted(folder.rglob("*")) if p.is_symlink() or p.is_file()}


def venv_state(venv: Path) -> dict[str, str] | str:
    """What is at .venv: a folder's files, a link's target or a file's text."""
    if venv.is_symlink() and not venv.exists():
        return f"link {os.readlink(venv)}"
    return files(venv) if venv.is_dir() else venv.read_text()


@pytest.mark.parametrize("venv, words", [
    # its interpreter gone (Python upgraded, a venv copied from another machine): `python -m venv` failed with
    # "[Errno 2] No such file or directory", and with the stamp of an earlier install nothing said to reinstall
    ({"bin/python": "link /nonexistent/python3.11", ".agg-bench-installed": "text stamp"},
     [".venv/bin/python does not run", "rm -rf .venv"]),
    # a venv of an older Python: pip then failed on the first package that needs 3.11
    ({"bin/python": "script [ \"$1\" = -V ] && { echo 'Python 3.10.12'; exit 0; }; exit 1"},
     [".venv has Python 3.10.12", "3.11 or newer", "rm -rf .venv"]),
    # a file where the folder goes
    ({"": "text not a venv"}, [".venv is not a folder"]),
    # a link to a folder that is gone: `python -m venv` failed with "[Errno 17] File exists", exit 1
    ({"": "link /nonexistent/venv"}, [".venv is not a folder"]),
])
def test_a_venv_that_cannot_be_used_is_one_line_and_kept(tmp_path, venv, words):
    repo = clone(tmp_path)
    for name, spec in venv.items():
        kind, _, content = spec.partition(" ")
        path = repo / ".venv" / name if name else repo / ".venv"
        path.parent.mkdir(parents=True, exist_ok=True)
        if kind == "link":
            path.symlink_to(content)
        else:
            path.write_text(f"#!/bin/sh\n{content}\n" if kind == "script" else content)
            path.chmod(0o755)
    before = venv_state(repo / ".venv")
    proc = setup(repo)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("setup: "), proc.stderr
    for word in words:
        assert word in lines[0], lines[0]
    assert venv_state(repo / ".venv") == before


def test_the_test_streams_run_with_a_tmpdir_that_names_no_folder(tmp_path):
    """scripts/test.sh kept the second stream's report in `mktemp`'s file: with TMPDIR naming no folder the second
    stream (tests/integration) never ran and the suite failed on `cat ''`."""
    repo = tmp_path / "repo"
    (repo / "scripts").mkdir(parents=True)
    shutil.copy(ROOT / "scripts" / "test.sh", repo / "scripts")
    python = tmp_path / "python"  # answers the core count, and stands in for pytest: says what it was asked
    python.write_text('#!/bin/bash\nif [ "$1" = -c ]; then echo 2; else echo "ran $4"; fi\n')
    python.chmod(0o755)
    env = {**os.environ, "PYTHON": str(python), "TMPDIR": str(tmp_path / "none")}
    proc = subprocess.run(["bash", str(repo / "scripts" / "test.sh")], capture_output=True, text=True, env=env,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == "" and "ran tests/unit" in proc.stdout and "ran tests/integration" in proc.stdout
