"""Start-up: the commands that only plan or read results, each timed as a fresh process.

``agg-bench --help``; ``snakemake -n`` on the embedded default (config/config.yaml), both the first
parse of a sweep (the methods' check runs in a child process, see ``agg_bench.tools.sweep``) and a later one
(its answer read back); a table job (``agg-bench report`` on the manifest of two small runs) and a plot
job (``agg-bench report --tables-in`` on its tables). Each command runs ROUNDS times (or
``--benchmark-min-rounds``, if more); ``extra_info`` carries every round's wall-clock time and CPU time
(user + sys of the process and the children it waited for), and the summary prints median, min and max
beside the target of each. Wall time depends on the machine's load; CPU time much less so.
"""
from __future__ import annotations

import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
       "OMP_NUM_THREADS": "1"}
CLI = [sys.executable, "-m", "agg_bench"]
ROUNDS = 5
# two small runs for the report jobs to read
RUNS = {"full": {"name": "full"}, "agg-w5": {"name": "agg", "window": 5}}
RUN_SETTINGS = ["model.resolution=32", "sampling.steps=5", "train.iterations=2", "train.plan=groups",
                "train.plan_window=5", "grpo.prompts_per_iteration=1", "progress=false"]


def run(command: list[str], cwd: Path) -> tuple[float, float]:
    """(wall seconds, CPU seconds of the process and its children) of one run of ``command``."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    proc = subprocess.run(command, cwd=cwd, env=ENV, capture_output=True, text=True, timeout=600)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    assert proc.returncode == 0, f"{' '.join(command)}: {proc.stderr[-3000:]}"
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def measure(benchmark, request, case: str, command: list[str], cwd: Path, target_s: float,
            before_each=None) -> None:
    rounds = max(ROUNDS, request.config.getoption("benchmark_min_rounds"))
    walls, cpus = [], []

    def once() -> None:
        if before_each is not None:
            before_each()
        wall, cpu = run(command, cwd)
        walls.append(wall)
        cpus.append(cpu)

    benchmark.group = "start-up"
    benchmark.pedantic(once, rounds=rounds, iterations=1)
    benchmark.extra_info.update(
        phase="startup", case=case, command=" ".join(command), target_s=target_s, rounds=rounds,
        wall_s=walls, cpu_s=cpus, wall_median_s=statistics.median(walls), wall_min_s=min(walls),
        wall_max_s=max(walls), cpu_median_s=statistics.median(cpus), cpu_min_s=min(cpus), cpu_max_s=max(cpus))


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    """What a fresh clone has: the Snakefile, workflow/ and config/."""
    work = tmp_path_factory.mktemp("startup")
    shutil.copy(ROOT / "Snakefile", work)
    shutil.copytree(ROOT / "workflow", work / "workflow")
    shutil.copytree(ROOT / "config", work / "config")
    return work


@pytest.fixture(scope="module")
def manifest(workdir) -> Path:
    """A manifest of two small real runs, as the workflow writes it."""
    runs = []
    for label, method in RUNS.items():
        out = workdir / "results" / "runs" / label
        overrides = [arg for item in [*RUN_SETTINGS, f"method={json.dumps(method)}"] for arg in ("--set", item)]
        run([*CLI, "run", "--config", "config/run.yaml", *overrides, "--out", str(out)], workdir)
        runs.append({"dir": str(out), "method": label, "model": "sd3", "resolution": 32, "seed": 0,
                     "device": "cpu", "method_options": method})
    path = workdir / "results" / "manifest.json"
    path.write_text(json.dumps({"runs": runs, "gradcheck": [], "warmup": 1}))
    return path


def test_help(benchmark, request, workdir):
    measure(benchmark, request, "agg-bench --help", [*CLI, "--help"], workdir, 1.0)


@pytest.mark.parametrize("cache", ["first parse", "later parse"])
def test_dry_run_of_the_embedded_default(benchmark, request, workdir, cache):
    cache_dir = workdir / ".snakemake" / "agg-bench"
    command = [sys.executable, "-m", "snakemake", "-n", "--cores", "2"]

    def clear() -> None:
        shutil.rmtree(cache_dir, ignore_errors=True)

    if cache == "later parse":
        run(command, workdir)  # fills the cache
    measure(benchmark, request, f"snakemake -n, embedded default, {cache}", command, workdir, 5.0,
            clear if cache == "first parse" else None)


@pytest.mark.parametrize("job", ["tables", "plots"])
def test_report_job(benchmark, request, workdir, manifest, job):
    """The workflow's two report jobs: the tables from the runs, the plots from those tables."""
    tables = [*CLI, "report", "--manifest", str(manifest), "--tables", str(workdir / "results" / "tables")]
    if job == "tables":
        command = tables
    else:
        run(tables, workdir)  # what the plots read
        command = [*CLI, "report", "--tables-in", str(workdir / "results" / "tables"),
                   "--plots", str(workdir / "results" / "plots")]
    measure(benchmark, request, f"{job} job (agg-bench report --{job})", command, workdir, 3.0)
