"""scripts/gpu_check.sh --cpu: every step of the GPU check on the tiny models on the CPU, so the script
cannot rot (about 45 CPU-s: 4 agg-bench processes that import the model code, the seven plain runs in one cell,
and the pool's command a check of its lease). And what it does before any step: it sets up and uses
the project's .venv unless PYTHON names an interpreter, and a missing torch, agg-bench or CUDA device is
one line and exit code 2; a step that fails before writing its files is a failed step in the summary."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from agg_bench.tools.gpucheck import main as gpucheck_main

ROOT = Path(__file__).parents[2]


@pytest.mark.slow
def test_gpu_check_script_on_the_cpu(tmp_path):
    out = tmp_path / "gpu_check"
    env = {**os.environ, "PYTHON": sys.executable, "AGG_BENCH_CHECK_OUT": str(out), "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--cpu"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=600)
    report = (out / "summary.md").read_text() if (out / "summary.md").exists() else ""
    assert proc.returncode == 0, proc.stderr[-3000:] + report
    summary = json.loads((out / "summary.json").read_text())
    assert summary["mode"] == "cpu" and (out / "summary.md").read_text().startswith("# GPU check (cpu)")
    steps = {s["step"]: s["ok"] for s in summary["steps"]}
    assert all(steps.values()) and {"env", "fsdp_32", "pool_32", "profile_32", "cached-fora_32"} <= set(steps)
    runs = {r["run"]: r for r in summary["runs"]}
    for res in (32, 64):
        full, agg, reuse = runs[f"full_{res}"], runs[f"agg-w5_{res}"], runs[f"agg-w5-reuse_{res}"]
        # 10 steps x 4 samples exact; AGG W=5: 2 groups x 2 endpoint backwards x 4 samples
        assert (full["backward"], agg["backward"], reuse["backward"]) == (40, 16, 16)
        for run in (full, agg, reuse):
            assert run["status"] == "ok" and run["t_train_s"] > 0, report
            # on the CPU the planner's count is exact
            assert run["saved_activation_peak_bytes"] == run["planned_activation_bytes"]
            assert run["planned_total_bytes"] > run["planned_activation_bytes"]
        assert agg["train_speedup"] is not None and full["train_speedup"] is None
    # anything but --cpu is refused
    bad = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--gpu"], capture_output=True, text=True)
    assert bad.returncode == 2 and "usage" in bad.stderr


# ----- the environment it runs in: the project's .venv, set up first; what is missing, in one line ---------
def check(tmp_path: Path, *args: str, script: Path = ROOT / "scripts" / "gpu_check.sh", **env: str):
    """Run the script with ``env`` (PYTHON only when given); (exit code, stderr lines); nothing may be written."""
    out = tmp_path / "gpu_check"
    base = {k: v for k, v in os.environ.items() if k != "PYTHON"}
    base.update({"AGG_BENCH_CHECK_OUT": str(out), "PYTHONPATH": str(ROOT), **env})
    proc = subprocess.run(["bash", str(script), *args], cwd=tmp_path, env=base, capture_output=True, text=True,
                          timeout=300)
    assert not out.exists()
    return proc.returncode, proc.stderr.splitlines()


def python_without_torch(folder: Path) -> Path:
    """An interpreter that cannot import torch: this one without its site-packages."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "python"
    path.write_text(f'#!/bin/sh\nexec "{sys.executable}" -S "$@"\n')
    path.chmod(0o755)
    return path


def test_a_python_without_torch_is_one_line_and_exit_code_2(tmp_path):
    python = python_without_torch(tmp_path / "bin")
    code, lines = check(tmp_path, "--cpu", PYTHON=str(python))
    assert code == 2 and len(lines) == 1, lines
    assert lines[0].startswith(f"gpu_check: {python} cannot import torch and agg_bench (ModuleNotFoundError: "
                               "No module named 'torch'); set PYTHON to an interpreter with agg-bench's requirements")


def test_without_python_it_sets_up_and_uses_the_project_venv(tmp_path):
    """As `make` does: scripts/setup.sh first, then .venv/bin/python (here a fake setup makes a venv without
    torch, so the check stops at once, naming that interpreter)."""
    repo = tmp_path / "repo"
    (repo / "scripts").mkdir(parents=True)
    for name in ("gpu_check.sh", "python_env.sh"):
        shutil.copy(ROOT / "scripts" / name, repo / "scripts" / name)
    (repo / "scripts" / "setup.sh").write_text(
        f'cd "$(dirname "$0")/.."\ntouch setup-ran\nmkdir -p .venv/bin\n'
        f'printf \'#!/bin/sh\\nexec "{sys.executable}" -S "$@"\\n\' > .venv/bin/python\nchmod +x .venv/bin/python\n')
    code, lines = check(tmp_path, "--cpu", script=repo / "scripts" / "gpu_check.sh")
    assert code == 2 and len(lines) == 1 and (repo / "setup-ran").exists(), lines
    assert lines[0].startswith(f"gpu_check: {repo}/.venv/bin/python cannot import torch and agg_bench")
    assert lines[0].endswith("run bash scripts/setup.sh (or set PYTHON to an interpreter with agg-bench's requirements)")
    # a setup that fails (no network, no Python 3.11) stops the check too
    (repo / "scripts" / "setup.sh").write_text('echo "setup: no Python 3.11" >&2; exit 3\n')
    code, lines = check(tmp_path, "--cpu", script=repo / "scripts" / "gpu_check.sh")
    assert code == 2 and lines == ["setup: no Python 3.11",
                                   f"gpu_check: setting up {repo}/.venv failed (bash scripts/setup.sh, exit 3; "
                                   "see its message above)"], lines


@pytest.mark.parametrize("args, words", [
    (["--gpu"], "unknown argument '--gpu'"),
    (["--cpu", "--cpu"], "2 arguments (--cpu --cpu), expected at most one"),  # the second was dropped
    (["--cpu", "--gpu"], "2 arguments (--cpu --gpu), expected at most one"),  # a CPU check, --gpu unread
])
def test_bad_arguments_are_one_line_before_anything(tmp_path, args, words):
    code, lines = check(tmp_path, *args, PYTHON="/nonexistent/python")  # refused before the interpreter is asked
    assert code == 2 and lines == [f"gpu_check: {words}; usage: scripts/gpu_check.sh [--cpu]"], lines


def test_python_is_given_the_repository_from_any_folder(tmp_path):
    """A GPU machine gets the tree copied, not installed, and agg-bench's requirements as wheels on PYTHONPATH
    (docs/paper-scale.md): PYTHON=python3 scripts/gpu_check.sh started outside the repository could not import
    agg_bench (scripts/gpu_campaign.sh could). With PYTHON, the repository goes first on PYTHONPATH, before the
    wheels' folder, for every process the check starts (here an interpreter that imports agg_bench only from the
    repository, and records the PYTHONPATH its first step was given)."""
    site, seen = tmp_path / "site", tmp_path / "seen"
    python = tmp_path / "bin" / "python"
    python.parent.mkdir()
    python.write_text(f'#!/bin/bash\nif [[ $1 == -c ]]; then case ":$PYTHONPATH:" in *":{ROOT}:"*) exit 0 ;; esac\n'
                      '  echo "ModuleNotFoundError: No module named \'agg_bench\'" >&2; exit 1; fi\n'
                      f'printf %s "$PYTHONPATH" > "{seen}"; exit 3\n')
    python.chmod(0o755)
    code, lines = check(tmp_path, "--cpu", PYTHON=str(python), PYTHONPATH=str(site))
    assert code == 2 and lines == [] and seen.read_text() == f"{ROOT}{os.pathsep}{site}", lines


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_the_gpu_check_without_a_gpu_says_so_in_one_line(tmp_path):
    code, lines = check(tmp_path, PYTHON=sys.executable)
    assert code == 2 and len(lines) == 1 and "sees no CUDA device" in lines[0] and "--cpu" in lines[0], lines


def test_gpucheck_summary_of_steps_that_failed_before_writing(tmp_path, capsys):
    """A step that died before writing whole files (an env.json left empty, a damaged summary) is a failed
    step in the summary, not a traceback in the summary step."""
    (tmp_path / "env.json").write_text("")
    run = tmp_path / "runs" / "full_32"
    run.mkdir(parents=True)
    (run / "summary.json").write_text('{"status": ')
    (run / "metrics.jsonl").write_text("[1]\n{}\n")
    (tmp_path / "steps.tsv").write_text(f"env\t1\t{tmp_path}/logs/env.log\nfull_32\t1\tx\n")
    assert gpucheck_main([str(tmp_path), "cpu"]) == 1
    captured = capsys.readouterr()
    assert captured.err == "" and json.loads(captured.out)["failed_steps"] == ["env", "full_32"]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["runs"][0]["status"] == "missing" and summary["gpu_name"] is None


def failing_python(folder: Path) -> Path:
    """An interpreter that passes the script's module checks at once, runs agg_bench.tools.gpucheck (its folder's
    check and the summary) as this one does, and fails every step: nothing but the script's own handling of its
    folder runs."""
    python = folder / "python"
    python.parent.mkdir(parents=True)
    python.write_text(f'#!/bin/bash\nif [[ $1 == -c && $2 == import\\ * ]]; then exit 0; fi\n'
                      f'if [[ $1 == -m && $2 == agg_bench.tools.gpucheck ]]; then exec "{sys.executable}" "$@"; fi\n'
                      'exit 1\n')
    python.chmod(0o755)
    return python


@pytest.mark.parametrize("holds", ["notes", "file"])
def test_an_out_folder_of_someone_s_files_is_refused_not_removed(tmp_path, holds):
    """AGG_BENCH_CHECK_OUT naming a folder of other files (a home, a project) removed it whole (rm -rf) before the
    first step. Now one line names it, exit code 2, and the folder or file is left as it was; the folder of an
    earlier check's output is still taken (:func:`failing_python`)."""
    python = failing_python(tmp_path / "bin")
    out = tmp_path / "mine"
    if holds == "notes":
        (out / "runs").mkdir(parents=True)
        (out / "notes.txt").write_text("mine")
    else:
        out.write_text("mine")
    env = {**os.environ, "PYTHON": str(python), "AGG_BENCH_CHECK_OUT": str(out), "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--cpu"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    lines = proc.stderr.splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith(f"gpu_check: AGG_BENCH_CHECK_OUT {out}"), lines
    assert ("notes.txt" in lines[0]) if holds == "notes" else lines[0].endswith("exists and is not a folder")
    assert (out / "notes.txt").read_text() == "mine" if holds == "notes" else out.read_text() == "mine"
    # an earlier check's output is removed and written again
    if holds == "notes":
        (out / "notes.txt").unlink()
        (out / "steps.tsv").write_text("")
        proc = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--cpu"], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=300)
        assert "AGG_BENCH_CHECK_OUT" not in proc.stderr and (out / "logs" / "env.log").exists(), proc.stderr


def test_the_default_folder_is_the_repository_s_wherever_the_check_is_started(tmp_path):
    """Without AGG_BENCH_CHECK_OUT the folder was results/gpu_check under the current folder: started elsewhere, the
    check removed (rm -rf) and wrote a results/gpu_check there, an earlier check's output of that folder's or
    not. It is the repository's (the script's folder's parent), and the folder it is started in is left alone."""
    repo = tmp_path / "repo"
    (repo / "scripts").mkdir(parents=True)
    for name in ("gpu_check.sh", "python_env.sh"):
        shutil.copy(ROOT / "scripts" / name, repo / "scripts" / name)
    elsewhere = tmp_path / "elsewhere"
    (elsewhere / "results" / "gpu_check").mkdir(parents=True)
    (elsewhere / "results" / "gpu_check" / "steps.tsv").write_text("theirs\t0\tx\n")  # another check's
    env = {k: v for k, v in os.environ.items() if k != "AGG_BENCH_CHECK_OUT"}
    env.update(PYTHON=str(failing_python(tmp_path / "bin")), PYTHONPATH=str(ROOT))
    proc = subprocess.run(["bash", str(repo / "scripts" / "gpu_check.sh"), "--cpu"], cwd=elsewhere, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1 and "AGG_BENCH_CHECK_OUT" not in proc.stderr, proc.stderr  # every step failed
    out = repo / "results" / "gpu_check"
    assert json.loads(proc.stdout)["out"] == str(out / "summary.json") and (out / "logs" / "env.log").exists()
    assert {str(p.relative_to(elsewhere)): p.read_bytes() for p in elsewhere.rglob("*") if p.is_file()} == \
        {"results/gpu_check/steps.tsv": b"theirs\t0\tx\n"}
