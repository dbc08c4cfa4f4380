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

from helpers import bash_script, not_hung

ROOT = Path(__file__).resolve().parents[2]


def clone(tmp_path: Path) -> Path:
    """What setup.sh reads: itself, pyproject.toml and the constraints."""
    repo = tmp_path / "repo"
    (repo / "scripts").mkdir(parents=True)
    (repo / "requirements").mkdir()
    for script in ("setup.sh", "turns.sh"):
        shutil.copy(ROOT / "scripts" / script, repo / "scripts")
    shutil.copy(ROOT / "pyproject.toml", repo)
    shutil.copy(ROOT / "requirements" / "constraints.txt", repo / "requirements")
    return repo


def setup(repo: Path, **env_vars: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHON": sys.executable, "TORCH_INDEX_URL": "", **env_vars}
    return subprocess.run(["bash", str(repo / "scripts" / "setup.sh")], capture_output=True, text=True, env=env,
                          timeout=60)


@pytest.mark.parametrize("args", [["--cpu"], ["--help"], ["cu128", "x"]])
def test_arguments_are_refused_before_anything(tmp_path, args):
    """setup.sh reads no arguments: `setup.sh --cpu` set up the default (a CUDA torch where a GPU is found)
    without a word. The interpreter here does not run, so nothing could be installed either way."""
    repo = clone(tmp_path)
    env = {**os.environ, "PYTHON": "/nonexistent/python", "TORCH_INDEX_URL": ""}
    proc = subprocess.run(["bash", str(repo / "scripts" / "setup.sh"), *args], capture_output=True, text=True, env=env,
                          timeout=60)
    assert proc.returncode == 2 and proc.stderr.splitlines() == [
        f"setup: takes no arguments ('{' '.join(args)}' given); set TORCH_INDEX_URL, PYTHON or EXTRAS instead "
        "(scripts/setup.sh's first lines)"], proc.stderr
    assert sorted(p.name for p in repo.iterdir()) == ["pyproject.toml", "requirements", "scripts"]


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


# A venv's interpreter that answers setup.sh's questions without Python: it logs each call in .venv/calls, has pip
# only once `-m ensurepip` ran (or .venv/has-pip is there), and its `pip install` fails while .venv/pip-fails is there
# (or .venv/pip-offline, writing what that file holds).
STUB_PYTHON = """venv=$(dirname "$0")/..
echo "$*" >> "$venv/calls"
case "$1 $2" in
  "-V "*) echo "Python 3.11.9";;
  "-m ensurepip") touch "$venv/has-pip";;
  "-m pip") [ -e "$venv/has-pip" ] || { echo "No module named pip" >&2; exit 1; }
            [ "$3" != install ] || [ ! -e "$venv/pip-fails" ] || { echo "ERROR: pip failed" >&2; exit 1; }
            [ "$3" != install ] || [ ! -e "$venv/pip-offline" ] || { cat "$venv/pip-offline" >&2; exit 1; };;
esac
"""
# what pip writes when its index cannot be reached: a warning per retry, then no version found
OFFLINE = "".join(f"WARNING: Retrying (Retry(total={n}, connect=None, read=None, redirect=None, status=None)) after "
                  "connection broken by 'NewConnectionError(\"HTTPSConnection(host='pypi.org', port=443): Failed to "
                  "establish a new connection: [Errno -3] Temporary failure in name resolution\")': /simple/pip/\n"
                  for n in (4, 3)) + ("ERROR: Could not find a version that satisfies the requirement pip (from "
                                      "versions: none)\nERROR: No matching distribution found for pip\n")


def stub_venv(repo: Path, *flags: str) -> Path:
    venv = repo / ".venv"
    bash_script(venv / "bin" / "python", STUB_PYTHON)
    for flag in flags:
        (venv / flag).touch()
    return venv


def test_a_venv_left_without_pip_gets_pip_and_the_install(tmp_path):
    """A set-up stopped while `python -m venv` ran ensurepip leaves an interpreter without pip: every later run
    failed on "No module named pip", exit 1, and never got further."""
    repo = clone(tmp_path)
    venv = stub_venv(repo)
    proc = setup(repo)
    assert proc.returncode == 0, proc.stderr
    calls = (venv / "calls").read_text().splitlines()
    assert "-m ensurepip" in calls
    assert calls.index("-m ensurepip") < min(i for i, c in enumerate(calls) if c.startswith("-m pip install"))
    assert (venv / ".agg-bench-installed").is_file()


def test_an_install_stopped_halfway_is_never_taken_as_done(tmp_path):
    """The stamp of an earlier install stayed while a later one (other extras, or a changed pyproject.toml) ran:
    stopped halfway and run again as before, the set-up said done on a venv the stopped install had changed."""
    repo = clone(tmp_path)
    venv = stub_venv(repo, "has-pip")
    assert setup(repo, EXTRAS="test").returncode == 0
    (venv / "pip-fails").touch()  # stands in for the Ctrl-C, the kill or the full disk
    assert setup(repo, EXTRAS="test,workflow").returncode != 0
    assert not (venv / ".agg-bench-installed").exists()
    proc = setup(repo, EXTRAS="test")
    assert proc.returncode != 0 and "pip failed" in proc.stderr
    assert (venv / "calls").read_text().splitlines()[-1].startswith("-m pip install")


def test_an_index_that_cannot_be_reached_is_one_line(tmp_path):
    """No network (or a proxy, or DNS): pip's retries wrote a warning each and ended in "No matching distribution
    found for pip", which reads like a version that does not exist; a pip error of another kind stays pip's."""
    repo = clone(tmp_path)
    stub_venv(repo, "has-pip")
    (repo / ".venv" / "pip-offline").write_text(OFFLINE)
    proc = setup(repo)
    assert proc.returncode == 1
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("setup: pip could not reach the package index ("), proc.stderr
    assert "ERROR: Could not find a version" in lines[0] and lines[0].endswith("run this again")
    assert not (repo / ".venv" / ".agg-bench-installed").exists()


def test_a_second_set_up_of_a_clone_waits_for_the_first(tmp_path):
    """Two set-ups of one clone at once (two `make pipeline`) ran pip into the same .venv together; the second
    now says it waits, waits while the first holds the clone's lock, then finds its install done."""
    import fcntl

    repo = clone(tmp_path)
    venv = stub_venv(repo, "has-pip")
    assert setup(repo).returncode == 0
    calls = (venv / "calls").read_text()
    env = {**os.environ, "PYTHON": sys.executable, "TORCH_INDEX_URL": ""}
    with open(repo / ".venv.lock", "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # the first set-up, still running
        second = subprocess.Popen(["bash", str(repo / "scripts" / "setup.sh")], stderr=subprocess.PIPE, text=True,
                                  env=env)
        try:
            with not_hung(30):
                line = second.stderr.readline()
            assert line.startswith("setup: another set-up of this clone is running"), line
            assert "waiting" in line and second.poll() is None
        finally:
            fcntl.flock(held, fcntl.LOCK_UN)
        assert second.wait(timeout=60) == 0 and second.stderr.read() == ""
    later = (venv / "calls").read_text().removeprefix(calls)
    assert "-m pip" not in later  # the stamp said done: nothing installed twice


def test_a_venv_moved_with_its_clone_is_one_line_and_kept(tmp_path):
    """A venv names the folder it was made in (its scripts' #! lines, bin/activate, the editable install): moved
    with its clone, set-up said it was ready and `make pipeline` failed on .venv/bin/snakemake, "required file
    not found"."""
    repo = clone(tmp_path)
    stub_venv(repo, "has-pip")
    assert setup(repo).returncode == 0
    moved = repo.rename(tmp_path / "moved")
    before = files(moved / ".venv")
    proc = setup(moved)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("setup: .venv was made in "), proc.stderr
    assert str(repo) in lines[0] and str(moved) in lines[0] and "rm -rf .venv" in lines[0]
    after = files(moved / ".venv")
    assert after.pop("calls").startswith(before.pop("calls")) and after == before  # the stub logs its calls


@pytest.mark.parametrize("python, words", [
    ("/nonexistent/python", "No such file or directory"),
    ("no-such-python-here", "command not found"),
    ("/", "Is a directory"),
])
def test_a_python_that_does_not_run_is_one_line(tmp_path, python, words):
    """PYTHON naming nothing that runs printed the shell's error and then this script's line around it."""
    repo = clone(tmp_path)
    proc = setup(repo, PYTHON=python)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"setup: PYTHON={python} does not run ("), proc.stderr
    assert words in lines[0] and lines[0].endswith("set PYTHON to a Python 3.11 or newer")
    assert not (repo / ".venv").exists()


def make_clone(folder: Path) -> Path:
    """The Makefile with stand-ins: a set-up that leaves a mark, linters that pass and a venv interpreter that says
    what it was asked; the real scripts/test.sh."""
    (folder / "scripts").mkdir(parents=True)
    shutil.copy(ROOT / "Makefile", folder)
    shutil.copy(ROOT / "scripts" / "test.sh", folder / "scripts")
    for script in ("one-workflow.sh", "caches.sh", "turns.sh"):
        shutil.copy(ROOT / "scripts" / script, folder / "scripts")
    (folder / "scripts" / "setup.sh").write_text("touch set-up-ran\n")
    seen = 'echo "$0 ${XDG_CACHE_HOME-unset} ${MPLCONFIGDIR-unset}" >> caches-seen'  # the caches each was given
    for name, body in {"ruff": "", "shellcheck": "", "mypy": "",
                       "snakemake": f'{seen}; echo "snakemake $*" >> snakemake-calls',
                       "python": f'if [ "$1" = -c ]; then echo 1; else {seen}; echo "venv python $*"; fi'}.items():
        bash_script(folder / ".venv" / "bin" / name, body)
    return folder


def test_make_test_runs_the_venv_whatever_python_names(tmp_path):
    """PYTHON chooses the interpreter that makes .venv (the README's PYTHON=python3.12); scripts/test.sh also
    read it, and `PYTHON=python3.12 make test` ran the suite with that interpreter, which has no pytest."""
    repo = make_clone(tmp_path / "repo")
    env = {**os.environ, "PYTHON": "/nonexistent/python"}
    proc = subprocess.run(["make", "-s", "-C", str(repo), "test"], capture_output=True, text=True, env=env,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "venv python -m pytest -q tests/unit" in proc.stdout and "/nonexistent" not in proc.stdout + proc.stderr


@pytest.mark.parametrize("failing", [None, "ruff", "shellcheck", "mypy"])
def test_make_test_runs_the_linters_beside_the_tests_and_fails_with_them(tmp_path, failing):
    """The lint steps run beside the test streams: the tests run whatever the linters find, the linters' report
    follows the tests', and the suite fails when a linter fails."""
    repo = make_clone(tmp_path / "repo")
    for name in ("ruff", "shellcheck", "mypy"):
        bash_script(repo / ".venv" / "bin" / name, f'echo "{name} ran"; exit {int(name == failing)}')
    # the streams do not get the lint command: a test that runs test.sh in a stand-in clone ran the linters there
    bash_script(repo / ".venv" / "bin" / "python",
                'if [ "$1" = -c ]; then echo 1; else echo "venv python $* lint=${AGG_BENCH_TEST_LINT-unset}"; fi')
    proc = subprocess.run(["make", "-s", "-C", str(repo), "test"], capture_output=True, text=True, timeout=60)
    out = proc.stdout
    assert (proc.returncode == 0) == (failing is None), proc.stderr + out
    tests, report = out.find("venv python -m pytest -q tests/integration"), out.find("----- lint: .venv/bin/ruff")
    assert -1 < tests < report and "venv python -m pytest -q tests/unit" in out, out
    assert out.count("lint=unset") == 2, out
    ran = ["ruff", "shellcheck", "mypy"][:["ruff", "shellcheck", "mypy", None].index(failing) + 1]
    assert [name for name in ("ruff", "shellcheck", "mypy") if f"{name} ran" in out[report:]] == ran, out
    assert ("test.sh: the lint steps failed (exit 1)" in out) == (failing is not None), out


@pytest.mark.parametrize("target", ["pipeline", "learning", "test"])
def test_make_pipeline_in_a_path_with_a_space_is_refused_before_the_set_up(tmp_path, target):
    """The Snakefile refuses an interpreter's path with a space, but only once the set-up (minutes) had run; make
    test's end-to-end tests failed on it after minutes of tests."""
    repo = make_clone(tmp_path / "my clones" / "agg-bench")
    proc = subprocess.run(["make", "-C", str(repo), target], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if "***" in line]
    assert len(errors) == 1 and "holds a space" in errors[0] and "no space" in errors[0], proc.stderr
    assert ("make test-fast runs the unit tests alone" in errors[0]) == (target == "test")
    assert not (repo / "set-up-ran").exists()


def test_make_from_another_folder_is_refused_before_the_set_up(tmp_path):
    """`make -f CLONE/Makefile` ran the recipes' clone paths (scripts/setup.sh, .venv) in the current folder and
    failed there; it is one line naming make -C, and `make -C CLONE` runs."""
    repo = make_clone(tmp_path / "repo")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    proc = subprocess.run(["make", "-f", str(repo / "Makefile"), "test-fast"], cwd=elsewhere, capture_output=True,
                          text=True, timeout=60)
    errors = [line for line in proc.stderr.splitlines() if "***" in line]
    assert proc.returncode == 2 and len(errors) == 1 and f"make -C {repo} test-fast" in errors[0], proc.stderr
    assert not (repo / "set-up-ran").exists() and list(elsewhere.iterdir()) == []
    proc = subprocess.run(["make", "-s", "-C", str(repo), "test-fast"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr


def test_make_test_fast_in_a_path_with_a_space_runs(tmp_path):
    """The unit tests run no workflow: make test-fast is not refused there."""
    repo = make_clone(tmp_path / "my clones" / "agg-bench")
    proc = subprocess.run(["make", "-s", "-C", str(repo), "test-fast"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "venv python -m pytest -q tests/unit" in proc.stdout


@pytest.mark.parametrize("args, words", [
    ([], "no COMMAND given"),  # it ran nothing and exited 0
    (["snakemake", "-n"], "COMMAND 'snakemake': no such command from"),  # the shell's `exec: not found`, 127
])
def test_one_workflow_without_a_command_to_run_is_one_line(tmp_path, args, words):
    repo = make_clone(tmp_path / "repo")
    env = {**os.environ, "PATH": "/usr/bin:/bin"}  # no snakemake on it: the clone's is .venv/bin/snakemake
    proc = subprocess.run(["bash", str(repo / "scripts" / "one-workflow.sh"), *args], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=60)
    lines = proc.stderr.splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith(f"one-workflow: {words}"), lines
    assert "usage: scripts/one-workflow.sh COMMAND [ARGS...]" in lines[0] and proc.stdout == ""
    assert not (repo / ".workflow.lock").exists() and not (repo / ".snakemake").exists()
    proc = subprocess.run(["bash", str(repo / "scripts" / "one-workflow.sh"), ".venv/bin/snakemake", "-n"], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and (repo / "snakemake-calls").read_text() == "snakemake -n\n", proc.stderr


def make(repo: Path, *args: str, **kwargs) -> subprocess.Popen:
    """`make ARGS` in ``repo`` as a user's shell starts it (not as a sub-make of `make test`)."""
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MAKELEVEL", "MFLAGS", "CORES")}
    return subprocess.Popen(["make", "-s", *args], cwd=repo, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, **kwargs)


@pytest.mark.skipif(shutil.which("flock") is None, reason="needs flock")
@pytest.mark.parametrize("target", ["pipeline", "learning"])
def test_a_second_make_pipeline_of_a_clone_waits_for_the_first(tmp_path, target):
    """Two `make pipeline` of one clone at once: the second's snakemake stopped on Snakemake's lock with a screen
    ending in "It can be removed with the --unlock argument", which, done while the first ran, let two snakemakes
    write the same run folders. The second now says it waits in one line, and starts its snakemake once the first
    has ended."""
    import fcntl

    repo = make_clone(tmp_path / "repo")
    with open(repo / ".workflow.lock", "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # the first make pipeline (or make learning), still running
        second = make(repo, target)
        try:
            with not_hung(30):
                line = second.stderr.readline()
            assert line.startswith("make: another make pipeline or make learning of this clone is running"), line
            assert "waiting" in line and second.poll() is None
            assert not (repo / "snakemake-calls").exists()
        finally:
            fcntl.flock(held, fcntl.LOCK_UN)
        out, err = second.communicate(timeout=60)
    assert second.returncode == 0 and err == "", err
    calls = (repo / "snakemake-calls").read_text().splitlines()
    assert calls and all(call.startswith("snakemake ") for call in calls)
    assert [line.removeprefix(".venv/bin/") for line in out.splitlines()] == calls  # each said as make says it


@pytest.mark.skipif(shutil.which("flock") is None, reason="needs flock")
def test_a_lock_that_a_killed_snakemake_left_is_one_line(tmp_path):
    """A snakemake ended by SIGHUP (its terminal closed) or kill -9 leaves .snakemake/locks/; the next
    `make pipeline` printed Snakemake's LockException screen. One line naming the way out, the lock kept."""
    repo = make_clone(tmp_path / "repo")
    (repo / ".snakemake" / "locks").mkdir(parents=True)
    (repo / ".snakemake" / "locks" / "0.output.lock").write_text("results/done/a.json\n")
    proc = make(repo, "pipeline")
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 2 and out == "", err
    line, made = err.splitlines()
    assert line.startswith(f"make: {repo.resolve()}/.snakemake/locks/ holds the lock of a snakemake"), line
    assert ".venv/bin/snakemake --unlock" in line and "*** [Makefile" in made
    assert not (repo / "snakemake-calls").exists()
    assert (repo / ".snakemake" / "locks" / "0.output.lock").read_text() == "results/done/a.json\n"


@pytest.mark.parametrize("target", ["pipeline", "learning", "test"])
def test_caches_that_cannot_go_to_the_home_go_to_the_clone(tmp_path, target):
    """Snakemake makes its source cache under ~/.cache before it reads the Snakefile: with a home that cannot be
    written every `make pipeline` stopped with a PermissionError traceback (and the tests that start snakemake
    failed); matplotlib warned in each plot job's log. Those caches go to .snakemake/ in the clone then; a home
    that can be written keeps them."""
    repo = make_clone(tmp_path / "repo")
    env = {k: v for k, v in os.environ.items()
           if k not in ("MAKEFLAGS", "MAKELEVEL", "MFLAGS", "CORES", "XDG_CACHE_HOME", "XDG_CONFIG_HOME",
                        "MPLCONFIGDIR")}
    (tmp_path / "not-a-folder").write_text("")
    for home, expected in [(tmp_path / "not-a-folder", f"{repo}/.snakemake/home-cache {repo}/.snakemake/matplotlib"),
                           (tmp_path / "home", "unset unset")]:
        (repo / "caches-seen").unlink(missing_ok=True)
        proc = subprocess.run(["make", "-s", target], cwd=repo, env={**env, "HOME": str(home)}, capture_output=True,
                              text=True, timeout=60)
        assert proc.returncode == 0, proc.stderr
        seen = (repo / "caches-seen").read_text().splitlines()
        assert seen and all(line.split(" ", 1)[1] == expected for line in seen), seen
    assert (tmp_path / "home" / ".cache" / "snakemake").is_dir()


def test_the_test_streams_run_with_a_tmpdir_that_names_no_folder(tmp_path):
    """scripts/test.sh kept the second stream's report in `mktemp`'s file: with TMPDIR naming no folder the second
    stream (tests/integration) never ran and the suite failed on `cat ''`."""
    repo = tmp_path / "repo"
    (repo / "scripts").mkdir(parents=True)
    for script in ("test.sh", "caches.sh"):
        shutil.copy(ROOT / "scripts" / script, repo / "scripts")
    python = tmp_path / "python"  # answers the core count, and stands in for pytest: says what it was asked
    python.write_text('#!/bin/bash\nif [ "$1" = -c ]; then echo 2; else echo "ran $4"; fi\n')
    python.chmod(0o755)
    env = {**os.environ, "PYTHON": str(python), "TMPDIR": str(tmp_path / "none")}
    proc = subprocess.run(["bash", str(repo / "scripts" / "test.sh")], capture_output=True, text=True, env=env,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == "" and "ran tests/unit" in proc.stdout and "ran tests/integration" in proc.stdout
