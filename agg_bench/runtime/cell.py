"""A cell job: several training runs one after the other in one process (``agg-bench cell JOBS.json``).

A run job's process spends most of its life importing torch and diffusers (3.5 s on a 2-core Xeon, 9 s on
a 2-core EPYC) when the run itself trains tiny models for 1-3 s. Runs that could share a process (the same
device, model and resolution on a CPU: the workflow's cells) therefore run in one, each into its own run
folder exactly as ``agg-bench run --config C --set ... --out DIR`` writes it: the same files and records,
its own folder claim and summary status. A run that ends in oom or diverged, or fails, does not stop the
others; a signal stops the cell. With ``--keep-going`` (the workflow's cell jobs) a failed run is recorded
in its folder (``summary.json``, ``status: error``) and the cell exits 0 once every run's end is recorded,
so that the workflow keeps the finished runs' files and reports the failure itself (:func:`run_cell`). The
runs share one built model where their model configurations agree (:mod:`agg_bench.runtime.model_reuse`:
each starts from it as built), and with a deadline a run is not started when the longest run so far would
end after it.

The job file is a JSON object ``{"runs": [{"config": FILE or null, "set": ["KEY=VALUE", ...], "out": DIR},
...]}``: each run's ``agg-bench run`` arguments (:func:`job_entry` writes one). Every run's config is
loaded and checked, and every run's folder compared with the others' (one folder each, none inside
another), before the first run starts, so a bad job file writes nothing.

This module imports no torch at module level: the workflow's parse (:mod:`agg_bench.tools.sweep`)
writes job files with :func:`job_entry`.
"""
from __future__ import annotations

import gc
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .. import stopping
from ..errors import UserError, run_command
from ..jsonfiles import json_type, read_json_object

EXPECTED = ('an agg-bench cell job file: {"runs": [{"config": FILE or null, "set": ["KEY=VALUE", ...], '
            '"out": DIR}, ...]}')
ENTRY_KEYS = ("config", "set", "out")
MAX_RUNS = 4096  # a cell is one model x resolution: its methods x seeds; every run's config is checked first
# the exit codes of failed runs, mildest first: a user error (2), then a bug in agg-bench (1)
SEVERITY = {0: 0, 2: 1, 1: 2}


@dataclass(frozen=True)
class CellRun:
    """One run of a cell: what ``agg-bench run --config CONFIG --set SET... --out OUT`` is given."""

    config: str | None
    overrides: tuple[str, ...]
    out: Path


def job_entry(config: str | None, overrides: list[str], out: str) -> dict[str, Any]:
    """One run's entry in a job file."""
    return {"config": config, "set": list(overrides), "out": out}


def _entry(path: Path, index: int, entry: Any) -> CellRun:
    where = f"runs[{index}]"
    if not isinstance(entry, dict):
        raise UserError(f"{path}: {where} is {json_type(entry)}; expected an object with keys {', '.join(ENTRY_KEYS)}")
    unknown = [key for key in entry if key not in ENTRY_KEYS]
    if unknown:
        raise UserError(f"{path}: {where}.{unknown[0]} is not a key of a run (allowed: {', '.join(ENTRY_KEYS)})")
    config, overrides, out = entry.get("config"), entry.get("set", []), entry.get("out")
    if config is not None and not (isinstance(config, str) and config):
        raise UserError(f"{path}: {where}.config is {json_type(config)}; expected a run config file or null")
    if not isinstance(overrides, list) or not all(isinstance(item, str) for item in overrides):
        raise UserError(f"{path}: {where}.set is {json_type(overrides)}; expected a list of KEY=VALUE strings")
    if not (isinstance(out, str) and out):
        raise UserError(f"{path}: {where}.out is {json_type(out)}; expected the run folder")
    return CellRun(config, tuple(overrides), Path(out))


def read_jobs(path: str | Path) -> list[CellRun]:
    """The runs a job file lists, checked in form (not yet their configs): a UserError naming the file and
    the entry for anything else, for two runs into one folder, or for a run folder inside another's."""
    path = Path(path)
    runs = read_json_object(path, EXPECTED).get("runs")
    if not isinstance(runs, list) or not runs:
        raise UserError(f"{path}: runs is {json_type(runs) if runs != [] else 'an empty list'}; "
                        "expected a list of one or more runs")
    if len(runs) > MAX_RUNS:
        raise UserError(f"{path}: runs lists {len(runs):,} runs; expected at most {MAX_RUNS:,} in one cell")
    jobs = [_entry(path, index, entry) for index, entry in enumerate(runs)]
    seen: dict[Path, int] = {}
    for index, job in enumerate(jobs):
        folder = Path(job.out).resolve()
        if folder in seen:
            raise UserError(f"{path}: runs[{index}].out {job.out} is also runs[{seen[folder]}].out; "
                            "expected a folder of its own for each run")
        seen[folder] = index
    # a run folder holds only a run's files: another run's folder inside it would be someone else's
    for index, job in enumerate(jobs):
        outer = next((seen[p] for p in Path(job.out).resolve().parents if p in seen), None)
        if outer is not None:
            raise UserError(f"{path}: runs[{index}].out {job.out} is inside runs[{outer}].out {jobs[outer].out}; "
                            "expected run folders that do not hold one another")
    return jobs


def load_jobs(path: str | Path) -> list[tuple[CellRun, Any]]:
    """Each run of the job file with its loaded and checked run config (:func:`agg_bench.config.load_config`
    and :func:`~agg_bench.runtime.config_check.check_config`, as ``agg-bench run`` loads and checks it); the
    first bad one raises a UserError naming the entry and its folder."""
    from ..config import load_config
    from .config_check import check_config

    loaded = []
    for index, job in enumerate(read_jobs(path)):
        try:
            loaded.append((job, check_config(load_config(job.config, list(job.overrides)))))
        except UserError as err:
            raise UserError(f"{path}: runs[{index}] (--out {job.out}): {err}") from None
    return loaded


def run_cell(path: str | Path, keep_going: bool = False, deadline: float | None = None) -> int:
    """Every run of job file ``path``, in its order, through :func:`agg_bench.runtime.train.train`; the
    exit code ``agg-bench run`` gives for the worst of them (a bug: 1, before a user error: 2, before 0), or
    128 + N at once when signal N stops a run. Each run's failure prints as ``agg-bench run`` prints it,
    named by its folder; stderr gets one line as each run starts and one as it ends, stdout each run's
    result line ``{"out", "status"}``. The runs share a built model (:func:`reusing_models`). With
    ``deadline`` (seconds since the epoch) the runs left are not started once the longest run so far would
    not end before it; stderr says so and they leave no folder.

    With ``keep_going`` a run that fails is recorded in its own folder, ``summary.json`` with ``status:
    error`` (the run writes it when it fails after starting its files; :func:`~agg_bench.runtime.train.
    record_failure` when it failed before), and such a failure no longer counts in the exit code: it is 0
    once every run's end is recorded. A workflow removes every declared output of a job that fails, so
    a cell job that failed for one run would take the finished runs' records with it; the workflow's
    manifest reports the recorded failures instead (:func:`agg_bench.tools.sweep.failed_runs`). A failure
    that cannot be recorded (the folder holds someone else's files, another process writes it) still
    counts."""
    from ..machine.distributed import launched_world_size

    if launched_world_size() > 1:
        raise UserError("agg-bench cell runs its runs in one process; start a run on several GPUs with "
                        "torchrun ... agg-bench run")
    jobs = load_jobs(path)  # every config checked before the first run writes anything
    from .model_reuse import reusing_models

    with reusing_models():
        return _run_jobs(path, jobs, keep_going, deadline)


def _run_jobs(path: Path, jobs: list[tuple[CellRun, Any]], keep_going: bool, deadline: float | None) -> int:
    from .train import record_failure, train

    worst, longest = 0, 0.0
    for number, (job, cfg) in enumerate(jobs, 1):
        stopping.check()  # a signal between two runs stops the cell before the next one starts
        if deadline is not None and number > 1 and time.time() + longest > deadline:
            print(f"agg-bench cell: runs {number}-{len(jobs)} not started: the longest run so far "
                  f"({longest:.1f} s) would end after the deadline", file=sys.stderr, flush=True)
            break
        print(f"agg-bench cell: run {number}/{len(jobs)} {job.out} started", file=sys.stderr, flush=True)
        start = time.perf_counter()
        status: list[str] = []
        failure: list[Exception] = []
        summary_before = _file_identity(job.out / "summary.json")

        # bound now: run_command calls it at once, in this iteration
        def one_run(job: CellRun = job, cfg: Any = cfg, status: list[str] = status,
                    failure: list[Exception] = failure) -> int:
            try:
                status.append(train(cfg, job.out)["status"])
            except Exception as exc:
                failure.append(exc)
                raise
            print(json.dumps({"out": str(job.out), "status": status[0]}), flush=True)
            return 0

        code = run_command(f"agg-bench cell: {job.out}", one_run, ["agg-bench", "cell", str(path)], job.out)
        ended = status[0] if status else f"failed (exit code {code})"
        if keep_going and failure and code < 128:
            error = f"{type(failure[0]).__name__}: {failure[0]}".splitlines()[0]
            written = _file_identity(job.out / "summary.json") != summary_before  # by this attempt, on failing
            if written or record_failure(cfg, job.out, error):
                print(json.dumps({"out": str(job.out), "status": "error"}), flush=True)
                ended, code = f"{ended}, recorded in its summary.json", 0
        seconds = time.perf_counter() - start
        longest = max(longest, seconds)
        print(f"agg-bench cell: run {number}/{len(jobs)} {job.out} {ended} in {seconds:.1f} s",
              file=sys.stderr, flush=True)
        if code >= 128:  # stopped by a signal: the cell stops with it
            return code
        worst = max(worst, code, key=SEVERITY.__getitem__)
        gc.collect()  # the finished run's models and tensors, before the next run measures its memory
    return worst


def _file_identity(path: Path) -> tuple[int, int] | None:
    """(inode, modification time) of ``path``, or None: a file replaced by rename has another."""
    try:
        stat = path.stat()
    except OSError:
        return None
    return stat.st_ino, stat.st_mtime_ns
