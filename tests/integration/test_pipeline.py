"""The Snakemake workflow: sweep configs check out before any job starts (dry runs of the default, the
paper-scale config and the SLURM profile), errors name the key, and the smallest sweep runs end to end."""
import contextlib
import faulthandler
import fnmatch
import io
import itertools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import traceback
import warnings
from pathlib import Path

import pandas as pd
import pytest
import yaml

from agg_bench.records import plot_files, table_files
from agg_bench.tools.sweep import Sweep

ROOT = Path(__file__).resolve().parents[2]
TABLES = table_files()
PLOTS = plot_files()


def workdir(tmp_path: Path, shared_checks: bool = False) -> Path:
    """A clean working directory holding what a fresh clone has: the Snakefile, workflow/ and config/. With
    ``shared_checks``, its cache of the sweep's methods check (.snakemake/agg-bench, a child process of about
    3 CPU-seconds at each parse of a sweep it has not seen) is one folder for every such working directory of
    the test session: an answer is keyed by its request, the interpreter and the sources, and a check that
    fails is never cached (tests/integration/test_sweep.py tests the cache itself)."""
    work = tmp_path / "work"
    work.mkdir()
    shutil.copy(ROOT / "Snakefile", work)
    shutil.copytree(ROOT / "workflow", work / "workflow")
    shutil.copytree(ROOT / "config", work / "config")
    if shared_checks:
        shared = tmp_path.parent / "shared-methods-checks"  # tmp_path.parent: the session's base temporary folder
        shared.mkdir(exist_ok=True)
        (work / ".snakemake").mkdir()
        (work / ".snakemake" / "agg-bench").symlink_to(shared, target_is_directory=True)
    return work


def snakemake(work: Path, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "snakemake", *args], cwd=work, capture_output=True, text=True,
                          timeout=timeout)


def snakemake_here(work: Path, *args: str, timeout: float = 900) -> subprocess.CompletedProcess:
    """``snakemake ARGS`` run in ``work`` by Snakemake's command-line entry point in this process (for dry runs:
    the same parse of the Snakefile and the same plan, without an interpreter's start-up and Snakemake's
    imports each time), as :func:`snakemake` reports it: the exit code SystemExit carries, and an exception
    that escapes Snakemake as the interpreter shows it, its traceback on stderr and exit code 1. Whether the
    workflow refuses with a process's exit code is shown by the tests that start one. The sweep's checks that
    Snakemake's process hands to a child process run in this one too (:func:`helpers.sweep_checks_here`: the
    same answers, kept in the same cache); the jobs of a run that is not a dry run are still child processes of
    their own. What Snakemake changes in the process (its scheduler's SIGTERM handler, sys.path, warning
    filters, the working directory) is put back. A call that runs past ``timeout`` seconds ends the test process
    with every thread's stack (faulthandler), as :func:`snakemake`'s timeout ends its process: a hung job fails
    the suite instead of blocking it."""
    from snakemake.cli import main

    from helpers import sweep_checks_here

    out, err, code = io.StringIO(), io.StringIO(), 0
    cwd, path = os.getcwd(), list(sys.path)
    handlers = {signum: signal.getsignal(signum) for signum in signal.valid_signals()
                if signum not in (signal.SIGKILL, signal.SIGSTOP) and signal.getsignal(signum) is not None}
    os.chdir(work)
    faulthandler.dump_traceback_later(timeout, exit=True)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), warnings.catch_warnings(), \
                sweep_checks_here():
            main(list(args))
    except SystemExit as end:
        code = end.code if isinstance(end.code, int) else (0 if end.code is None else 1)
    except Exception:
        err.write(traceback.format_exc())
        code = 1
    finally:
        faulthandler.cancel_dump_traceback_later()
        os.chdir(cwd)
        sys.path[:] = path
        for signum, handler in handlers.items():
            if signal.getsignal(signum) is not handler:
                signal.signal(signum, handler)
    return subprocess.CompletedProcess(["snakemake", *args], code, out.getvalue(), err.getvalue())


def check_methods_here(work: Path, configfile: str) -> None:
    """The sweep's methods check of ``snakemake --configfile CONFIGFILE`` in ``work`` made in this process (where
    torch and the model code are imported already) and kept in ``work``'s cache of them (:func:`workdir`'s
    ``shared_checks``): the same request, so a Snakemake process started next finds the answer kept instead of
    paying for a child process's imports (:func:`helpers.sweep_checks_here`). What that process checks and runs is
    unchanged: the answer is the one its child would give, kept under the same key."""
    from helpers import sweep_checks_here

    cwd = os.getcwd()
    os.chdir(work)
    try:
        with sweep_checks_here():
            Sweep(yaml.safe_load(Path(configfile).read_text()), Path("workflow") / "schemas" / "config.schema.yaml",
                  files=[configfile])
    finally:
        os.chdir(cwd)


def refusal(proc: subprocess.CompletedProcess) -> str:
    """The one line a sweep refused while the workflow is parsed ends Snakemake's output with (exit code 2, as
    an agg-bench verb's refusal; no traceback, not Snakemake's WorkflowError with the Snakefile's place)."""
    message = proc.stderr + proc.stdout
    assert proc.returncode == 2 and "Traceback" not in message and "WorkflowError" not in message, message[-3000:]
    return proc.stderr.rstrip("\n").splitlines()[-1]


def job_counts(stdout: str) -> dict[str, int]:
    """The 'Job stats' table of a dry run as {rule: count}."""
    block = stdout.split("Job stats:", 1)[1]
    return {m.group(1): int(m.group(2)) for m in re.finditer(r"^(\w+)\s+(\d+)$", block, re.M)}


def gpu_claims(stdout: str) -> list[tuple[str, int, int]]:
    """(rule, the gpu resource it declares, the GPUs its command asks the pool for) of every job of a dry run
    with -p (a command that asks none: 0)."""
    claims = []
    for block in re.split(r"\n(?=rule \w+:)", stdout):
        head = re.match(r"rule (\w+):", block)
        command = re.search(r"Shell command: (.*)", block)
        if head is None or command is None:
            continue
        declared = re.search(r"resources:[^\n]*\bgpu=(\d+)", block)
        asked = re.search(r"agg_bench\.machine\.gpus --count (\d+)", command.group(1))
        claims.append((head.group(1), int(declared.group(1)) if declared else 0, int(asked.group(1)) if asked else 0))
    return claims


def expected_run_labels(sweep: dict) -> list[dict]:
    """The label combinations of a sweep's runs: every one that no `exclude` entry matches."""
    keys = ("method", "model", "resolution", "seed", "device")
    combos = [dict(zip(keys, combo)) for combo in itertools.product(
        sweep["methods"], sweep["models"], sweep["resolutions"], sweep["seeds"], sweep["devices"])]
    return [c for c in combos
            if not any(all(fnmatch.fnmatchcase(str(c[k]), str(p)) for k, p in entry.items())
                       for entry in sweep.get("exclude", []))]


def run_id(labels: dict) -> str:
    return f"{labels['method']}_{labels['model']}_{labels['resolution']}px_s{labels['seed']}_{labels['device']}"


def planned_runs(stdout: str) -> dict[str, str]:
    """{run id: the rule of the job that writes its summary} from a dry run's job list."""
    runs = {}
    for block in re.split(r"^(?=(?:local)?rule \w+:$)", stdout, flags=re.M)[1:]:
        rule = re.match(r"(?:local)?rule (\w+):", block).group(1)
        outputs = re.search(r"^\s*output: (.*)$", block, re.M)
        # each run's marker, the output of its job (a run job or a cell job)
        for found in re.findall(r"results/done/([^/,\s]+)\.json", outputs.group(1) if outputs else ""):
            assert found not in runs, found  # one job per run
            runs[found] = rule
    return runs


def expected_runs(sweep: dict) -> int:
    return len(expected_run_labels(sweep))


@pytest.mark.parametrize("name, extra", [
    ("config.yaml", ["--cores", "2"]),
    ("gpu.yaml", ["--cores", "64", "--resources", "gpu=8"]),
    ("gpu_random.yaml", ["--cores", "64", "--resources", "gpu=8"]),
])
def test_dry_run_expands_every_job(tmp_path, name, extra):
    work = workdir(tmp_path, shared_checks=True)
    sweep = yaml.safe_load((work / "config" / name).read_text())
    args = ["--configfile", f"config/{name}"] if name != "config.yaml" else []  # the default needs no flag
    proc = snakemake_here(work, "-n", "-p", *args, *extra)
    assert proc.returncode == 0, proc.stderr + proc.stdout
    counts = job_counts(proc.stdout)
    # every job declares the GPUs its command takes, so that Snakemake and SLURM give it as many
    claims = gpu_claims(proc.stdout)
    assert "calibrate" in {c[0] for c in claims} and [c for c in claims if c[1] != c[2]] == []
    assert any(c[2] > 1 for c in claims) == (name != "config.yaml")
    cells = {rule: n for rule, n in counts.items() if rule.startswith("cell_") and rule != "cell_jobs"}
    runs = planned_runs(proc.stdout)
    assert sorted(runs) == sorted(run_id(c) for c in expected_run_labels(sweep))
    if name == "config.yaml":  # on a CPU: one cell job per model x resolution, each running all its runs
        assert "run" not in counts
        assert counts["cell_jobs"] == len(cells) == len(sweep["models"]) * len(sweep["resolutions"])
        assert set(cells.values()) == {1} and set(runs.values()) == set(cells)
        assert len(runs) // len(cells) == len(sweep["methods"]) * len(sweep["seeds"])
    else:  # on GPUs: one job per run (its GPUs and their memory its own)
        assert not cells and "cell_jobs" not in counts and counts["run"] == expected_runs(sweep)
    gradcheck = sweep.get("gradcheck") or {}
    assert counts.get("gradcheck", 0) == len(gradcheck.get("models", sweep["models"])) * len(gradcheck.get("resolutions", []))
    assert counts.get("embed", 0) == (len(sweep["models"]) if "embed" in sweep else 0)
    assert counts["tables"] == counts["plots"] == counts["manifest"] == 1
    # one cost-model calibration per model x resolution x device that runs use
    assert counts["calibrate"] == len({(c["model"], c["resolution"], c["device"]) for c in expected_run_labels(sweep)})
    assert not (work / "results").exists()  # a dry run writes nothing


def test_dry_run_of_the_slurm_profile(tmp_path):
    pytest.importorskip("snakemake_executor_plugin_slurm", reason="pip install 'agg-bench[slurm]'")
    work = workdir(tmp_path, shared_checks=True)
    # a dry run's plan in this process: what Snakemake would submit, no exit code at stake
    proc = snakemake_here(work, "-n", "--workflow-profile", "workflow/profiles/slurm", "--configfile",
                          "config/gpu.yaml")
    assert proc.returncode == 0, proc.stderr + proc.stdout
    # the profile's per-rule resources reach the run jobs
    assert re.search(r"rule run:.*?resources:[^\n]*gpu=1[^\n]*gpu_model=h100[^\n]*cpus_per_gpu=8", proc.stdout, re.S)
    # a job of an 8-GPU layout asks SLURM for 8 GPUs
    assert re.search(r"rule run:\n[^\n]*\n\s*output: results/done/full_flux1dev[^\n]*\n.*?resources:[^\n]*gpu=8",
                     proc.stdout, re.S)
    # and so does its calibration, with the profile's resources for it
    assert re.search(r"rule calibrate:\n(\s*input:[^\n]*\n)?\s*output: results/calibration/flux1dev[^\n]*\n"
                     r"(?:(?!\nrule )[\s\S])*?resources:[^\n]*gpu=8"  # in the same job's block
                     r"[^\n]*gpu_model=h100[^\n]*cpus_per_gpu=8", proc.stdout, re.S)


def job_resources(stdout: str) -> list[tuple[str, dict[str, str]]]:
    """(rule, {resource: value as shown}) of every job of a dry run."""
    jobs = []
    for block in re.split(r"\n(?=(?:local)?rule \w+:)", stdout):
        head = re.match(r"(?:local)?rule (\w+):", block)
        line = re.search(r"^\s*resources: (.*)$", block, re.M)
        if head and line:
            jobs.append((head.group(1), dict(item.split("=", 1) for item in line.group(1).split(", "))))
    return jobs


def test_the_slurm_profiles_run_resources_reach_the_cell_jobs(tmp_path):
    """The SLURM profile's set-resources name rule `run`, but a cell job (a one-GPU device's runs in one process,
    config/h200.yaml) has a rule of its own name, so Snakemake gave it the default resources: 60 minutes, 16 GB
    and any GPU model for a job of a dozen runs. A cell job gets the `run` entry, as a run job does. A CPU
    device's cell job takes no GPU, and asked for the entry's memory of a GPU node (128 GB) all the same: it
    asks for the profile's default mem_mb, and for the entry's cpu_runtime where it has one, not its runtime."""
    pytest.importorskip("snakemake_executor_plugin_slurm", reason="pip install 'agg-bench[slurm]'")
    work = workdir(tmp_path, shared_checks=True)
    profile_file = work / "workflow/profiles/slurm/config.yaml"
    profile = yaml.safe_load(profile_file.read_text())
    expected = {key: str(value) for key, value in profile["set-resources"]["run"].items()}
    profile["set-resources"]["run"]["cpu_runtime"] = 30
    profile_file.write_text(yaml.safe_dump(profile))
    # a dry run's plan in this process: what Snakemake would submit, no exit code at stake
    proc = snakemake_here(work, "-n", "--workflow-profile", "workflow/profiles/slurm", "--configfile",
                          "config/h200.yaml", "--config", "devices={cpu: {device: cpu, gpus: 0, threads: 4}}")
    assert proc.returncode == 0, proc.stderr + proc.stdout
    jobs = job_resources(proc.stdout)
    cells = [(rule, res) for rule, res in jobs if rule.startswith("cell_") and rule.endswith("_h200")]
    assert len(cells) == 8
    for rule, res in cells:
        assert {key: res.get(key) for key in expected} == expected, rule
        assert res["gpu"] == "1", rule  # the GPUs still from the sweep's device
    cpu_cells = [(rule, res) for rule, res in jobs if rule.startswith("cell_") and rule.endswith("_cpu")]
    assert len(cpu_cells) == 8
    for rule, res in cpu_cells:
        assert (res["gpu"], res["mem_mb"], res["runtime"]) == ("0", str(profile["default-resources"]["mem_mb"]),
                                                               "30"), rule
        assert not {"gpu_model", "cpus_per_gpu", "slurm_partition"} & set(res), rule
    # the jobs that do no run's work keep the defaults
    (_, cell_jobs), *_ = [job for job in jobs if job[0] == "cell_jobs"]
    assert (cell_jobs["runtime"], cell_jobs["mem_mb"], "gpu_model" in cell_jobs) == ("60", "16000", False)


def test_a_cpu_setting_that_is_no_number_is_refused_before_any_job(tmp_path):
    """Snakemake takes any text as a resource: cpu_mem_mb: lots failed once a job without a GPU was submitted, after
    the jobs before it, in words about mem_mb (the values: tests/unit/test_jobresources.py)."""
    proc = snakemake(workdir(tmp_path, shared_checks=True), "-n", "--configfile", "config/test.yaml", "--set-resources",
                     "run:cpu_mem_mb=lots")
    assert refusal(proc) == ("set-resources: run:cpu_mem_mb = 'lots': expected a whole number of MB >= 0 (the memory "
                             "of a job without a GPU)")


@pytest.mark.parametrize("edit, words", [
    # this one through a snakemake process (its exit code), the others in this process (snakemake_here)
    (lambda s: s.update(resolutions=["large"]), ["resolutions[0]", "large"]),
    (lambda s: s["methods"]["agg-w3"]["method"].update(windw=3), ["methods.agg-w3", "method.windw"]),
    (lambda s: s["methods"].update({"bad_label": {"method": {"name": "full"}}}), ["methods", "bad_label"]),
    (lambda s: s["gradcheck"].update(models=["sdxl"]), ["gradcheck.models", "sdxl"]),
    # decided from the model's configs while planning, not job by job
    (lambda s: s.update(resolutions=[30]), ["run full_sd3_30px", "model.resolution", "30", "multiple of 16"]),
    # the files jobs read that no job makes: a MissingInputException of a job, or a KeyError traceback
    (lambda s: s.update(references=[{"label": "ref", "log": "logs/none.jsonl"}]),
     ["references[0].log", "logs/none.jsonl", "not a file"]),
    (lambda s: s.update(pretrain={"scenes": {"config": "config/none.yaml"}}),
     ["pretrain.scenes.config", "config/none.yaml", "not a file"]),
    (lambda s: s["models"]["sd3"].update({"model.preset": "pretrained", "model.pretrained": "results/pretrained/x"}),
     ["models.sd3", "model.pretrained", "results/pretrained/x", "pretrain has none"]),
])
def test_sweep_errors_name_the_key_before_any_job(tmp_path, edit, words):
    work = workdir(tmp_path, shared_checks=True)
    sweep = yaml.safe_load((work / "config" / "test.yaml").read_text())
    edit(sweep)
    (work / "bad.yaml").write_text(yaml.safe_dump(sweep, sort_keys=False))
    run = snakemake if words == ["resolutions[0]", "large"] else snakemake_here
    proc = run(work, "--cores", "1", "--configfile", "bad.yaml")
    line = refusal(proc)
    assert line.startswith("sweep config"), proc.stderr
    for word in words:
        assert word in line, proc.stderr
    assert not (work / "results").exists()


def test_config_overrides_read_as_in_a_sweep_file(tmp_path):
    """Snakemake reads a `--config` list or mapping with YAML's BaseLoader, every number and boolean in it
    text: `resolutions=[64]` was refused as `'64'`, and no nested key of the sweep could be changed from the
    command line. They read as they do in the sweep file, merged into it (a method section replaced whole), and a
    key that is not text is refused in one line."""
    work = workdir(tmp_path, shared_checks=True)
    proc = snakemake_here(work, "-n", "-p", "--cores", "1", "--configfile", "config/test.yaml", "--config",
                     "resolutions=[64]", "set={train.iterations: 3, progress: true}", "gradcheck={resolutions: [64]}")
    assert proc.returncode == 0, proc.stderr + proc.stdout
    assert sorted(planned_runs(proc.stdout)) == ["agg-w3_sd3_64px_s0_cpu", "full_sd3_64px_s0_cpu"]
    assert "gradcheck/sd3_64px_cpu.csv" in proc.stdout
    calibrate = re.search(r"agg_bench calibrate (.*)", proc.stdout).group(1)
    # the override merged into the file's `set`, each value of its type
    assert "--set train.iterations=3 " in calibrate and "--set progress=true " in calibrate
    assert "--set sampling.steps=6 " in calibrate, calibrate
    # a method section replaces the file's whole, as in a sweep file: fraction takes no window
    proc = snakemake_here(work, "-n", "-p", "--cores", "1", "--configfile", "config/test.yaml", "--config",
                     "methods={agg-w3: {method: {name: fraction}}}")
    assert proc.returncode == 0, proc.stderr + proc.stdout
    assert "--method agg-w3 '{method: {name: fraction}}'" in proc.stdout
    proc = snakemake_here(work, "-n", "--cores", "1", "--configfile", "config/test.yaml", "--config", "set={1: 3}")
    line = refusal(proc)
    assert "--config = 'set={1: 3}'" in line and "quote it" in line, proc.stderr
    # the sweep file reads as agg-bench's loader (and a campaign) reads it: Snakemake's YAML 1.1 ran seed 15
    (work / "octal.yaml").write_text((work / "config" / "test.yaml").read_text().replace("seeds: [0]", "seeds: [017]"))
    proc = snakemake_here(work, "-n", "--cores", "1", "--configfile", "octal.yaml")
    assert "seeds[0] = '017': expected an integer" in refusal(proc), proc.stderr
    assert not (work / "results").exists()


def test_a_run_folder_removed_by_hand_is_named_with_its_marker(tmp_path):
    """A run's job output is its marker in results/done/, not its folder: a folder removed by hand (to run it
    again) left the marker, Snakemake took the run as done, and the tables job failed on the missing folder.
    The workflow names the run and the marker to remove before any job, and removes nothing itself."""
    work = workdir(tmp_path, shared_checks=True)
    marker = work / "results/done/full_sd3_32px_s0_cpu.json"
    marker.parent.mkdir(parents=True)
    marker.write_text(json.dumps({"out": "results/runs/full_sd3_32px_s0_cpu", "status": "ok"}))
    proc = snakemake_here(work, "-n", "--configfile", "config/test.yaml")
    message = refusal(proc)
    assert ("results/runs/full_sd3_32px_s0_cpu has no summary.json, but its marker says the run ended (its folder "
            "removed?); to run it again, remove the marker: rm results/done/full_sd3_32px_s0_cpu.json") in message, message
    assert sorted(p.relative_to(work).as_posix() for p in (work / "results").rglob("*")) == \
        ["results/done", "results/done/full_sd3_32px_s0_cpu.json"]
    run = work / "results/runs/full_sd3_32px_s0_cpu"
    run.mkdir(parents=True)
    (run / "config.json").write_text(json.dumps({"model": {}, "train": {}, "method": {"name": "full"}}))
    (run / "summary.json").write_text(json.dumps({"status": "ok"}))
    proc = snakemake_here(work, "-n", "--configfile", "config/test.yaml")
    assert proc.returncode == 0, proc.stderr + proc.stdout  # a run with its summary: its marker stands


def test_a_run_without_its_marker_behind_a_manifest_is_named_with_the_flag_that_runs_it(tmp_path, monkeypatch):
    """Snakemake does not remake a missing file that only feeds outputs it has: a marker removed by hand to run its
    run again (as the docs said), or by a stopped forced rerun of its cell, while the manifest and the tables
    stood, ran nothing and said "Nothing to be done". The workflow names the runs and the flag that runs them
    (a warning: whether a snakemake is forced is known only after the Snakefile is parsed); nothing is written or
    removed."""
    work = workdir(tmp_path, shared_checks=True)
    manifest = work / "results/manifest.json"
    manifest.parent.mkdir(parents=True)
    manifest.write_text("{}")  # another sweep's: its rule's parameters changed, so Snakemake writes it again
    proc = snakemake_here(work, "-n", "--configfile", "config/test.yaml")
    assert proc.returncode == 0 and "warning" not in proc.stderr, proc.stderr + proc.stdout
    monkeypatch.chdir(work)
    manifest.write_text(json.dumps(Sweep(yaml.safe_load((work / "config/test.yaml").read_text()),
                                         work / "workflow/schemas/config.schema.yaml", None).manifest()))
    proc = snakemake_here(work, "-n", "--configfile", "config/test.yaml")
    assert proc.returncode == 0, proc.stderr + proc.stdout
    assert ("warning: full_sd3_32px_s0_cpu, agg-w3_sd3_32px_s0_cpu have no marker in results/done/ but the manifest "
            "that waits for them is there: Snakemake takes the tables as up to date and runs them only with --forcerun "
            "manifest\n") in proc.stderr, proc.stderr
    (work / "results/done").mkdir()
    for run_id in ("full_sd3_32px_s0_cpu", "agg-w3_sd3_32px_s0_cpu"):
        (work / f"results/done/{run_id}.json").write_text("{}")
        run = work / f"results/runs/{run_id}"
        run.mkdir(parents=True)
        (run / "config.json").write_text(json.dumps({"model": {}, "train": {}, "method": {"name": "full"}}))
        (run / "summary.json").write_text(json.dumps({"status": "ok"}))
    proc = snakemake_here(work, "-n", "--configfile", "config/test.yaml")
    assert proc.returncode == 0 and "warning" not in proc.stderr, proc.stderr + proc.stdout
    shutil.rmtree(work / "results/done")
    shutil.rmtree(work / "results/runs")
    assert sorted(p.relative_to(work).as_posix() for p in (work / "results").rglob("*")) == ["results/manifest.json"]


@pytest.mark.parametrize("where", ["results", "results/logs/cell", "results/runs"])
def test_a_file_where_a_folder_of_the_workflow_goes_is_one_line(tmp_path, where):
    """A file named `results` (or a log folder's name) ended Snakemake in a NotADirectoryError traceback, before
    any job or when a job's log was opened; one line names it, and it is left as it was. `results/runs`, which
    holds the run folders but is no rule's output, passed the dry run and failed every run job."""
    work = workdir(tmp_path, shared_checks=True)
    (work / where).parent.mkdir(parents=True, exist_ok=True)
    (work / where).write_text("mine")
    # the first case through a snakemake process (its exit code), the others in this process
    proc = (snakemake if where == "results" else snakemake_here)(work, "-n", "--configfile", "config/test.yaml")
    message = refusal(proc)
    assert f"{where} is not a folder, and the workflow keeps its files in a folder of that name; move it away" \
        in message and "Traceback" not in message, message
    assert (work / where).read_text() == "mine"


def dancegrpo_log(path: Path) -> Path:
    lines = [{"step": s, "avg_reward": 0.3 + 0.05 * s, "step_time": 40.0 + s, "grad_norm": 0.2} for s in range(1, 5)]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


@pytest.mark.slow
def test_smallest_sweep_end_to_end(tmp_path):
    work = workdir(tmp_path, shared_checks=True)
    sweep = yaml.safe_load((work / "config" / "test.yaml").read_text())
    sweep["references"] = [{"label": "dancegrpo-ref", "log": str(dancegrpo_log(tmp_path / "log.jsonl")),
                            "method": "full", "model": "flux", "resolution": 720, "gpu_name": "NVIDIA H800",
                            "n_gpus": 8}]
    # fewer paired rounds of the methods' train phases and rollouts than config/test.yaml's defaults (9 timed, 2
    # warm-up): what is checked of them (the paired basis, full's 1.0, a speedup inside its quartiles) holds for
    # any number of rounds; the per-pass measurements (repeats) the cost model prices stay the sweep's
    sweep["calibrate"].update(warmup=1, method_repeats=3)
    (work / "e2e.yaml").write_text(yaml.safe_dump(sweep, sort_keys=False))
    proc = snakemake_here(work, "--cores", "2", "--configfile", "e2e.yaml")  # the jobs: processes of their own
    assert proc.returncode == 0, proc.stderr[-4000:]
    proc = snakemake_here(work, "--configfile", "e2e.yaml", "--report", "results/report.html")
    assert proc.returncode == 0, proc.stderr[-4000:]
    for path in [*TABLES, "results/tables/records.csv", *PLOTS, "results/report.html"]:
        assert (work / path).stat().st_size > 0, path

    table = pd.read_csv(work / "results/tables/efficiency.csv")
    rows = {(r.method, r.source): r for r in table.itertuples()}
    assert set(rows) == {("full", "measured"), ("agg-w3", "measured"), ("dancegrpo-ref", "imported")}
    full, agg = rows[("full", "measured")], rows[("agg-w3", "measured")]
    assert full.status == agg.status == "ok" and full.speedup == 1.0
    # 2 samples x 6 trained steps; AGG W=3: two groups of 3 steps, 2 backward passes each, per sample
    assert (full.backward, agg.backward) == (12, 8)
    assert 0 < agg.grad_cosine < 1 and full.grad_cosine == 1.0
    assert rows[("dancegrpo-ref", "imported")].hardware == "8x NVIDIA H800"
    assert "dancegrpo-ref (imported)" in (work / "results/tables/efficiency.md").read_text()
    ablation = pd.read_csv(work / "results/tables/ablation.csv")
    assert list(ablation["method"]) == ["full", "agg"] and ablation["window"].iloc[1] == 3
    assert "efficiency.csv" in (work / "results/report.html").read_text(errors="replace")
    assert "summary.html" in (work / "results/report.html").read_text(errors="replace")
    # the cost model priced both rows from their counted passes and the calibration
    assert full.predicted_train_speedup == 1.0 and agg.predicted_train_speedup > 1
    # the calibration timed both methods' train phases side by side: the table's train speedup is paired
    assert full.train_speedup_basis == agg.train_speedup_basis == "paired" and full.train_speedup == 1.0
    assert agg.train_speedup_lo <= agg.train_speedup <= agg.train_speedup_hi and agg.run_train_speedup > 0
    assert full.time_basis == agg.time_basis == "cpu"


@pytest.mark.slow
def test_a_failed_run_in_a_cell_keeps_the_cell_s_finished_runs(tmp_path):
    """Issue 37: a cell job whose second run failed made Snakemake remove every output of the job, the finished
    run's metrics.jsonl, summary.json and env.json with them. The cell records the failed run and succeeds; the
    manifest fails naming it (the tables wait), and the next invocation reruns the cell. The failure injected:
    the scene reward on captions that are not scenes, which the sweep's checks accept and the run refuses as it
    starts (its own learning rate keeps it, mended, another run than full's: the sweep refuses two labels of one
    run)."""
    work = workdir(tmp_path, shared_checks=True)
    sweep = yaml.safe_load((work / "config" / "test.yaml").read_text())
    sweep["methods"] = {"full": {"method": {"name": "full"}},
                        "broken": {"method": {"name": "full"}, "train": {"lr": 2.0e-4}, "reward": {"name": "scene"}}}
    sweep["set"]["sampling.steps"] = 4
    del sweep["gradcheck"]
    sweep["calibrate"] = {"enabled": False}
    (work / "fail.yaml").write_text(yaml.safe_dump(sweep, sort_keys=False))
    check_methods_here(work, "fail.yaml")  # the Snakemake process below finds the answer kept
    proc = snakemake(work, "--cores", "2", "--configfile", "fail.yaml", "--keep-going")
    assert proc.returncode != 0
    broken, full = work / "results/runs/broken_sd3_32px_s0_cpu", work / "results/runs/full_sd3_32px_s0_cpu"
    assert "1 run of this sweep failed" in proc.stderr and "broken_sd3_32px_s0_cpu: ConfigError: config error: reward.name = 'scene'" \
        in proc.stderr and "results/logs/cell/sd3_32px_cpu.log" in proc.stderr, proc.stderr[-4000:]
    assert json.loads((full / "summary.json").read_text())["status"] == "ok"
    assert len((full / "metrics.jsonl").read_text().splitlines()) == 2 and (full / "env.json").is_file()
    assert not (broken / "summary.json").exists() and (broken / "config.json").is_file()  # its cell reruns
    assert not (work / "results/tables").exists()
    # the failed run's marker went with its summary; the journal keeps the finished run for the cell's rerun
    assert sorted(p.name for p in (work / "results/done").iterdir()) == ["full_sd3_32px_s0_cpu.json"]
    plan = snakemake_here(work, "-n", "--configfile", "fail.yaml")
    assert job_counts(plan.stdout).get("cell_sd3_32px_cpu") == 1, plan.stdout[-3000:]
    # the broken method mended: the cell reruns the failed run only, and the tables are made
    finished = (full / "summary.json").stat()
    del sweep["methods"]["broken"]["reward"]
    (work / "fail.yaml").write_text(yaml.safe_dump(sweep, sort_keys=False))
    proc = snakemake_here(work, "tables", "--cores", "2", "--configfile", "fail.yaml")  # no plots needed here
    assert proc.returncode == 0, proc.stderr[-4000:]
    log = (work / "results/logs/cell/sd3_32px_cpu.log").read_text()
    assert "run 1/2 results/runs/full_sd3_32px_s0_cpu kept: it ended ok" in log and "run 2/2" in log, log[-3000:]
    assert (full / "summary.json").stat().st_mtime_ns == finished.st_mtime_ns
    assert json.loads((broken / "summary.json").read_text())["status"] == "ok"
    assert (work / "results/tables/efficiency.csv").is_file() and not (work / "results/cells/sd3_32px_cpu.progress.json").exists()


@pytest.mark.slow
def test_a_cell_journal_goes_when_snakemake_ends_short_of_the_manifest(tmp_path):
    """A cell job leaves its journal (--keep-journal) and the manifest job removed it; an invocation that ended
    before the manifest (a target short of it, a failed job elsewhere) left it, and a forced rerun of the cell
    then kept every run instead of measuring them again. Snakemake removes the journal of each cell job it ran
    when it ends; the journal a cell job left that this invocation did not run (a job of a snakemake killed with
    kill -9) stays for the rerun of that job."""
    work = workdir(tmp_path, shared_checks=True)
    sweep = yaml.safe_load((work / "config" / "test.yaml").read_text())
    sweep.update(resolutions=[32, 64], calibrate={"enabled": False})
    del sweep["gradcheck"]
    (work / "short.yaml").write_text(yaml.safe_dump(sweep, sort_keys=False))
    cells = work / "results/cells"
    cells.mkdir(parents=True)
    other = cells / "sd3_64px_cpu.progress.json"
    other.write_text(json.dumps({"code": "x", "runs": {}}))
    target, summary = "results/done/full_sd3_32px_s0_cpu.json", work / "results/runs/full_sd3_32px_s0_cpu/summary.json"
    proc = snakemake_here(work, target, "--cores", "2", "--configfile", "short.yaml")
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert not (work / "results/manifest.json").exists() and (work / target).is_file()
    assert sorted(p.name for p in cells.iterdir()) == ["sd3_32px_cpu.json", other.name]
    first = summary.stat().st_mtime_ns
    proc = snakemake_here(work, target, "--cores", "2", "--forcerun", "cell_sd3_32px_cpu", "--configfile",
                          "short.yaml")
    assert proc.returncode == 0, proc.stderr[-4000:]
    log = (work / "results/logs/cell/sd3_32px_cpu.log").read_text()
    assert "kept:" not in log and summary.stat().st_mtime_ns != first, log[-3000:]


def cell_processes(work: Path) -> list[int]:
    """The `python -m agg_bench cell` processes working in ``work`` (not the shell that started them, nor a
    child it has forked and not yet replaced by another program: that one still shows the cell's command line,
    and a loaded machine widens the moment between the fork and the exec)."""
    found: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
            if argv[1:4] == [b"-m", b"agg_bench", b"cell"] and (entry / "cwd").resolve() == work.resolve():
                status = (entry / "status").read_text()
                found[int(entry.name)] = int(status.split("PPid:", 1)[1].split()[0])
        except (OSError, ValueError, IndexError):
            continue
    return [pid for pid, parent in found.items() if parent not in found]


# iterations of the run the signal stops: it runs them all again after it. The cell is frozen before the signal, so
# their number only has to keep the run going from the moment its config.json is written until this test's next look
# (every 0.05 s); 8 of them leave it well over a second on a loaded machine
LONG = 8


@pytest.mark.slow
def test_a_cell_job_stopped_by_a_signal_keeps_its_finished_runs(tmp_path):
    """A cell job stopped by SIGTERM (a scheduler's time limit, a kill) fails, and Snakemake removes its
    outputs: they are the runs' markers, so the finished run's files stay, and the next invocation keeps that
    run (its summary untouched) and runs the one the signal stopped. The cell is frozen (SIGSTOP) while the
    signal is sent, so the second run is still running when it arrives however short it is."""
    work = workdir(tmp_path, shared_checks=True)
    sweep = yaml.safe_load((work / "config" / "test.yaml").read_text())
    sweep["methods"] = {"first": {"method": {"name": "full"}},
                        "long": {"method": {"name": "full"}, "train": {"iterations": LONG}}}
    del sweep["gradcheck"]
    sweep["calibrate"] = {"enabled": False}
    (work / "stop.yaml").write_text(yaml.safe_dump(sweep, sort_keys=False))
    check_methods_here(work, "stop.yaml")  # the Snakemake process below finds the answer kept
    first, long = work / "results/runs/first_sd3_32px_s0_cpu", work / "results/runs/long_sd3_32px_s0_cpu"
    proc = subprocess.Popen([sys.executable, "-m", "snakemake", "--cores", "2", "--configfile", "stop.yaml"],
                            cwd=work, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 300
        while not (first / "summary.json").exists() or not (long / "config.json").exists():
            assert proc.poll() is None and time.monotonic() < deadline, "the cell's first run did not finish"
            time.sleep(0.05)
        [cell] = cell_processes(work)
        os.kill(cell, signal.SIGSTOP)
        try:
            assert not (long / "summary.json").exists(), "the second run ended before the signal could stop it"
            os.kill(cell, signal.SIGTERM)
        finally:
            os.kill(cell, signal.SIGCONT)
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode != 0 and "Error in rule cell_sd3_32px_cpu" in err, err[-3000:]
    assert json.loads((long / "summary.json").read_text())["status"] == "interrupted"
    finished = (first / "summary.json").stat()
    assert json.loads((first / "summary.json").read_text())["status"] == "ok"
    assert (first / "metrics.jsonl").is_file() and (first / "env.json").is_file()
    assert not (work / "results/done").exists() or not any((work / "results/done").iterdir())
    again = snakemake_here(work, "tables", "--cores", "2", "--configfile", "stop.yaml")  # no plots needed here
    assert again.returncode == 0, again.stderr[-4000:]
    log = (work / "results/logs/cell/sd3_32px_cpu.log").read_text()
    assert "run 1/2 results/runs/first_sd3_32px_s0_cpu kept: it ended ok" in log, log[-3000:]
    assert (first / "summary.json").stat().st_mtime_ns == finished.st_mtime_ns
    assert json.loads((long / "summary.json").read_text())["status"] == "ok"
    assert len((long / "metrics.jsonl").read_text().splitlines()) == LONG
    assert (work / "results/tables/efficiency.csv").is_file()
