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

The job file is a JSON object ``{"runs": [{"config": FILE or null, "set": ["KEY=VALUE", ...], "out": DIR,
"done": FILE}, ...]}``: each run's ``agg-bench run`` arguments (:func:`job_entry` writes one) and, optionally,
a marker file the cell writes once the job has ended with every run's end recorded (``{"out", "status"}``:
what a workflow waits for instead of the run's own files), held by the cell from its start (a second job naming
it is refused: :func:`claimed_markers`). ``agg-bench cell`` also takes ``"calibrations"``:
calibrations of the runs' methods to take after them, on the same model (:mod:`agg_bench.tools.
cell_calibration`, what a campaign window gives its cell processes); a job may then list no run. Any other
key, of the file or of a run, is refused. Every run's config is loaded and checked, and every run's folder
compared with the others' (one folder each, none inside another, no marker inside a run folder), before the
first run starts, so a bad job file writes nothing.

**Resuming an attempt that did not end** (``--resume``, the workflow's cell jobs). A workflow removes the
outputs of a job that fails or is stopped, and reruns the whole job. So that a cell stopped after some of its
runs had finished loses none of them, a cell job with ``resume`` keeps a journal beside its job file
(``<job>.progress.json``): each run that ended ``ok``, ``oom`` or ``diverged`` is added as it ends, with its
config as written and the code it ran (:func:`agg_bench.sources.source_digest`: the source of agg_bench and
baselines). The next attempt of the same job file keeps such a run instead of running it again when all of these hold: the
journal's code is the code now, the run's config is the one this attempt would write, and its folder still
holds that config, a ``summary.json`` of the recorded status, ``metrics.jsonl`` and ``env.json``. The journal
is removed when an attempt ends with every run ended ``ok``, ``oom`` or ``diverged``, so a forced rerun of a
job that ended runs everything again; it stays while a run failed, so the next attempt reruns only the
failed runs. With ``--keep-journal`` (the workflow's cell jobs) an attempt that ended leaves its journal too,
for the caller to remove once it has recorded the job's end (the workflow, once Snakemake has recorded it): a cell job that
ended after Snakemake itself was killed (``kill -9`` of snakemake leaves its jobs running), which Snakemake
reruns as incomplete, then keeps every run instead of running them all again. The run the stop cut short continues from its last checkpoint (``train.checkpoint_every``),
as ``agg-bench run --resume-stopped`` continues it, when its config, code and kind of machine are unchanged
(:func:`~agg_bench.runtime.runfolder.stopped_attempt`); a kept run is whole, its env.json the machine it ran on.

This module imports no torch at module level: the workflow's parse (:mod:`agg_bench.tools.sweep`)
writes job files with :func:`job_entry`.
"""
from __future__ import annotations

import contextlib
import functools
import gc
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

from .. import stopping
from ..errors import UserError, numbered, quote, run_command, shown
from ..io import as_written, file_identity, is_stale_temp, remove_stale_temps, write_json
from ..outdir import Busy, Claim, check_file, check_path_names, json_file_where
from ..reading import ENV_FILE, METRICS_FILE, RunFolder
from ..jsonfiles import json_type, read_json_object
from ..sources import source_digest

EXPECTED = ('an agg-bench cell job file: {"runs": [{"config": FILE or null, "set": ["KEY=VALUE", ...], '
            '"out": DIR, "done": FILE (optional)}, ...]}')
ENTRY_KEYS = ("config", "set", "out", "done")
ENDED = ("ok", "oom", "diverged")  # the ends of a run that a resumed attempt keeps (an error runs again)
JOURNAL_EXPECTED = 'an agg-bench cell journal: {"code": HASH, "runs": {DIR: {"config": {...}, "status": STATUS}}}'

MAX_RUNS = 4096  # a cell is one model x resolution: its methods x seeds; every run's config is checked first
# the exit codes of failed runs, mildest first: a user error (2), then a bug in agg-bench (1)
SEVERITY = {0: 0, 2: 1, 1: 2}


@dataclass(frozen=True)
class CellRun:
    """One run of a cell: what ``agg-bench run --config CONFIG --set SET... --out OUT`` is given."""

    config: str | None
    overrides: tuple[str, ...]
    out: Path
    done: Path | None = None


def job_entry(config: str | None, overrides: list[str], out: str, done: str | None = None) -> dict[str, Any]:
    """One run's entry in a job file (``done``: its marker file, or None for none)."""
    entry: dict[str, Any] = {"config": config, "set": list(overrides), "out": out}
    if done is not None:
        entry["done"] = done
    return entry


def _keys(unknown: list[str]) -> str:
    """"unknown key 'x'" or "unknown keys 'x', 'y'" (each quoted, the first 12)."""
    shown = ", ".join(quote(key) for key in unknown[:12]) + (", ..." if len(unknown) > 12 else "")
    return f"unknown key{'s' if len(unknown) > 1 else ''} {shown}"


def _entry(path: Path, index: int, entry: Any) -> CellRun:
    where = f"runs[{index}]"
    if not isinstance(entry, dict):
        raise UserError(f"{shown(path)}: {where} is {json_type(entry)}; expected an object with keys "
                        f"{', '.join(ENTRY_KEYS)}")
    unknown = [key for key in entry if key not in ENTRY_KEYS]
    if unknown:
        raise UserError(f"{shown(path)}: {where}: {_keys(unknown)} (allowed in a run: {', '.join(ENTRY_KEYS)})")
    config, overrides, out = entry.get("config"), entry.get("set", []), entry.get("out")
    # an empty path is refused by check_path_names below, in the words of every path's refusal
    if config is not None and not isinstance(config, str):
        raise UserError(f"{shown(path)}: {where}.config is {json_type(config)}; expected a run config file or null")
    if not isinstance(overrides, list):
        raise UserError(f"{shown(path)}: {where}.set is {json_type(overrides)}; expected a list of KEY=VALUE strings")
    for number, item in enumerate(overrides):  # "set is a list; expected a list" named no item
        if not isinstance(item, str):
            raise UserError(f"{shown(path)}: {where}.set[{number}] is {json_type(item)}; expected a KEY=VALUE string")
    if not isinstance(out, str):  # a missing key is not given, not null
        raise UserError(f"{shown(path)}: {where}.out is {json_type(out) if 'out' in entry else 'not given'}; expected "
                        "the run folder")
    done = entry.get("done")
    if done is not None and not isinstance(done, str):
        raise UserError(f"{shown(path)}: {where}.done is {json_type(done)}; expected a marker file or null")
    if done is not None and done.endswith("/"):  # pathlib drops the slash: the marker was a file of that name
        raise UserError(f"{shown(path)}: {where}.done {quote(done)}: ends with /, which names a folder; expected a "
                        "marker file or null")
    check_path_names(f"{shown(path)}: {where}", (("config", config), ("out", out), ("done", done)))
    return CellRun(config, tuple(overrides), Path(out), Path(done) if done is not None else None)


def read_job_file(path: str | Path) -> dict:
    """The JSON object of job file ``path``, read once, so that its runs and calibrations come from the same
    text (a UserError names the file where it is not a JSON object)."""
    return read_json_object(Path(path), EXPECTED)


def read_jobs(path: str | Path, calibrations: bool = False, data: dict | None = None) -> list[CellRun]:
    """The runs a job file lists, checked in form (not yet their configs): a UserError naming the file and
    the entry for anything else, for two runs into one folder, or for a run folder inside another's. With
    ``calibrations`` the file may also list calibrations to take after the runs (``calibrations``, read by
    :mod:`agg_bench.tools.cell_calibration`), and then no run. ``data``: the file as :func:`read_job_file`
    read it (None: read it now)."""
    path = Path(path)
    data = read_job_file(path) if data is None else data
    allowed = {"runs": "the list of runs"}
    if calibrations:
        allowed["calibrations"] = "the calibrations to take after them"
    unknown = [key for key in data if key not in allowed]
    if unknown:
        raise UserError(f"{shown(path)}: {_keys(unknown)} (allowed: "
                        f"{'; '.join(f'{k}, {v}' for k, v in allowed.items())})")
    runs = data.get("runs")
    if isinstance(runs, list) and not runs and data.get("calibrations"):
        return []  # a job of calibrations only
    if not isinstance(runs, list) or not runs:
        found = "not given" if "runs" not in data else json_type(runs) if runs != [] else "an empty list"
        raise UserError(f"{shown(path)}: runs is {found}; expected a list of one or more runs")
    if len(runs) > MAX_RUNS:
        raise UserError(f"{shown(path)}: runs lists {len(runs):,} runs; expected at most {MAX_RUNS:,} in one cell")
    jobs = [_entry(path, index, entry) for index, entry in enumerate(runs)]
    seen: dict[Path, int] = {}
    for index, job in enumerate(jobs):
        folder = Path(job.out).resolve()
        if folder in seen:
            raise UserError(f"{shown(path)}: runs[{index}].out {shown(job.out)} is also runs[{seen[folder]}].out; "
                            "expected a folder of its own for each run")
        seen[folder] = index
    # a run folder holds only a run's files: another run's folder inside it would be someone else's
    for index, job in enumerate(jobs):
        outer = next((seen[p] for p in Path(job.out).resolve().parents if p in seen), None)
        if outer is not None:
            raise UserError(f"{shown(path)}: runs[{index}].out {shown(job.out)} is inside runs[{outer}].out "
                            f"{shown(jobs[outer].out)}; expected run folders that do not hold one another")
    # the job's journal beside the job file is the cell's own too: a marker written there replaced the journal
    # (and the next attempt refused it as no journal), a run folder there left the journal nowhere to go
    # (or a path inside it: the run wrote its folder, then the journal could not be written, exit 2)
    journal = Journal.path_of(path)
    for index, job in enumerate(jobs):
        for key, given in (("out", job.out), ("done", job.done)):
            resolved = Path(given).resolve() if given is not None else None
            if resolved is not None and journal.resolve() in (resolved, *resolved.parents):
                where = "" if resolved == journal.resolve() else "inside "
                raise UserError(f"{shown(path)}: runs[{index}].{key} {shown(str(given))} is {where}the job's journal "
                                f"{shown(journal)}; expected another path (agg-bench cell writes its journal there)")
    # a marker is the cell's own file: one per run, never inside a run folder (a run's folder holds its files only)
    markers: dict[Path, int] = {}
    for index, job in enumerate(jobs):
        if job.done is None:
            continue
        marker = job.done.resolve()
        owner = next((seen[p] for p in (marker, *marker.parents) if p in seen), None)
        if owner is not None:
            raise UserError(f"{shown(path)}: runs[{index}].done {shown(job.done)} is inside runs[{owner}].out "
                            f"{shown(jobs[owner].out)}; expected a marker outside every run folder")
        if marker in markers:
            raise UserError(f"{shown(path)}: runs[{index}].done {shown(job.done)} is also "
                            f"runs[{markers[marker]}].done; expected a marker of its own for each run")
        check_file(job.done, is_marker, "a run's marker", f"{shown(path)}: runs[{index}].done")
        markers[marker] = index
    # nor a marker a folder on another path of the job: a run folder or marker below it made a folder of it, and
    # the marker could not be written there (a traceback once every run had ended)
    for index, job in enumerate(jobs):
        for key, given in (("out", job.out), ("done", job.done)):
            holder = next((markers[p] for p in Path(given).resolve().parents if p in markers), None) \
                if given is not None else None
            if holder is not None:
                raise UserError(f"{shown(path)}: runs[{index}].{key} {shown(str(given))} is inside runs[{holder}].done "
                                f"{shown(str(jobs[holder].done))}; expected a path outside every marker (a marker is "
                                "a file)")
    return jobs


def load_jobs(path: str | Path, calibrations: bool = False,
              runs: list[CellRun] | None = None) -> list[tuple[CellRun, Any]]:
    """Each run of the job file (``runs``: as :func:`read_jobs` read them; None: read now) with its loaded and
    checked run config (:func:`agg_bench.config.load_config` and
    :func:`~agg_bench.runtime.config_check.check_config`, as ``agg-bench run`` loads and checks it); the first
    bad one raises a UserError naming the entry and its folder."""
    from ..config import load_config
    from .config_check import check_config

    loaded = []
    for index, job in enumerate(read_jobs(path, calibrations) if runs is None else runs):
        try:
            loaded.append((job, check_config(load_config(job.config, list(job.overrides)))))
        except UserError as err:
            raise UserError(f"{shown(path)}: runs[{index}] (--out {shown(job.out)}): {err}") from None
    return loaded


def run_cell(path: str | Path, keep_going: bool = False, deadline: float | None = None, resume: bool = False,
             overwrite: bool = False, keep_journal: bool = False,
             after_runs: Callable[[dict[Path, str]], int] | None = None, runs: list[CellRun] | None = None) -> int:
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
    counts.

    With ``resume`` the runs an earlier attempt of this job file finished are kept (:class:`Journal`, the
    module's docstring), and a run it stopped half-way continues from its checkpoint (``agg-bench run
    --resume-stopped``); with ``overwrite`` a run's folder that holds a finished run of another config is
    replaced (``agg-bench run --overwrite``); with ``keep_journal`` (and ``resume``) an attempt that ended
    leaves its journal for the caller to remove. When the exit code is 0 and every run has ended, each run's
    ``done`` marker is written.

    ``after_runs`` (``agg-bench cell``: the job file's calibrations, :mod:`agg_bench.tools.cell_calibration`)
    is called once the runs have ended, and their markers are written, unless a signal or a busy folder stopped
    the cell, with each run folder's end (a run not started has none), in the same process and the same
    shared model; its exit code counts like a run's. Without it a job file that lists calibrations is refused.
    ``runs``: the file's runs as :func:`read_jobs` read them, with the text the caller read its calibrations from
    (None: read now)."""
    from ..machine.distributed import launched_world_size

    if launched_world_size() > 1:
        raise UserError("agg-bench cell runs its runs in one process; start a run on several GPUs with "
                        "torchrun ... agg-bench run")
    if keep_journal and not resume:
        raise UserError("--keep-journal: a cell keeps a journal with --resume only; give both, or neither")
    jobs = load_jobs(path, after_runs is not None, runs)  # every config checked before the first run writes anything
    from .model_reuse import reusing_models
    from .runfolder import check_out_dir, stopped_attempt

    # and every run's folder as its run will check it (someone's files, a link, a file, a finished run of another
    # config without --overwrite): a later run's was refused only once the runs before it had written theirs. With
    # ``resume`` a run continues only a stopped attempt (train's resume_stopped), not any folder with a checkpoint
    for index, (job, cfg) in enumerate(jobs):
        try:
            check_out_dir(job.out, cfg.to_dict(), resume and stopped_attempt(job.out, cfg.to_dict()), overwrite)
        except UserError as err:
            raise UserError(f"{shown(path)}: runs[{index}] (--out {shown(job.out)}): {err}") from None

    journal = Journal.resume(Path(path)) if resume else None
    with claimed_markers([(job.done, f"{shown(path)}: runs[{index}].done") for index, (job, _) in enumerate(jobs)
                          if job.done is not None]), reusing_models(), _imports_frozen():
        return _run_jobs(Path(path), jobs, keep_going, deadline, journal, overwrite, keep_journal, after_runs)


def _free_finished_run() -> None:
    """Free the finished run's models and tensors before the next run measures its memory, and on a GPU hand
    the blocks they held back to the device: the CUDA caching allocator keeps them reserved otherwise, so the
    next run's ``peak_reserved_bytes`` counted them (a peak statistic resets to what is reserved now), and
    the blocks an out-of-memory run left cut up could make the next run fail where a fresh process would not."""
    gc.collect()
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


@contextlib.contextmanager
def _imports_frozen() -> Iterator[None]:
    """The training engine imported, and what exists then kept out of the garbage collector's way
    (:func:`gc.freeze`) until the block ends: a collection between two runs (which frees the finished run's
    models and tensors before the next run measures its memory) then walks what the runs made, not the
    hundreds of thousands of objects that importing torch and diffusers made (0.17 s a collection on a
    2-core EPYC, for every run of a cell). Garbage is collected first, so none is frozen."""
    from . import train  # noqa: F401 (torch, diffusers and the engine, which every run imports)

    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def _run_jobs(path: Path, jobs: list[tuple[CellRun, Any]], keep_going: bool, deadline: float | None,
              journal: "Journal | None", overwrite: bool, keep_journal: bool = False,
              after_runs: Callable[[dict[Path, str]], int] | None = None) -> int:
    from .train import record_failure, train

    worst, longest = 0, 0.0
    ended: dict[Path, str] = {}  # each run's end, by folder: what its marker says
    for number, (job, cfg) in enumerate(jobs, 1):
        stopping.check()  # a signal between two runs stops the cell before the next one starts
        kept = journal.kept(job, cfg) if journal is not None else None
        if kept is not None:
            ended[job.out] = kept
            print(f"agg-bench cell: run {number}/{len(jobs)} {shown(job.out)} kept: it ended {kept} in an earlier "
                  "attempt of this job whose end was not recorded", file=sys.stderr, flush=True)
            print(json.dumps({"out": str(job.out), "status": kept}), flush=True)
            continue
        if deadline is not None and longest > 0 and time.time() + longest > deadline:
            print(f"agg-bench cell: {numbered('run', number, len(jobs))} not started: the longest run so far "
                  f"({longest:.1f} s) would end after the deadline", file=sys.stderr, flush=True)
            break
        print(f"agg-bench cell: run {number}/{len(jobs)} {shown(job.out)} started", file=sys.stderr, flush=True)
        start = time.perf_counter()
        status: list[str] = []
        failure: list[Exception] = []
        summary_before = file_identity(job.out / "summary.json")

        # bound now: run_command calls it at once, in this iteration
        def one_run(job: CellRun = job, cfg: Any = cfg, status: list[str] = status,
                    failure: list[Exception] = failure) -> int:
            try:
                status.append(train(cfg, job.out, overwrite=overwrite, resume_stopped=journal is not None,
                                    resume_flag="--resume")["status"])
            except Exception as exc:
                failure.append(exc)
                raise
            print(json.dumps({"out": str(job.out), "status": status[0]}), flush=True)
            return 0

        code = run_command(f"agg-bench cell: {shown(job.out)}", one_run, ["agg-bench", "cell", str(path)], job.out)
        end = status[0] if status else f"failed (exit code {code})"
        if status:
            ended[job.out] = status[0]
            if journal is not None and status[0] in ENDED:
                journal.add(job, cfg, status[0])
        if keep_going and failure and code < 128 and not isinstance(failure[0], Busy):  # Busy: not this job's
            error = f"{type(failure[0]).__name__}: {failure[0]}".splitlines()[0]
            written = file_identity(job.out / "summary.json") != summary_before  # by this attempt, on failing
            if written or record_failure(cfg, job.out, error, overwrite=overwrite):
                print(json.dumps({"out": str(job.out), "status": "error"}), flush=True)
                end, code = f"{end}, recorded in its summary.json", 0
                ended[job.out] = "error"
        seconds = time.perf_counter() - start
        longest = max(longest, seconds)
        print(f"agg-bench cell: run {number}/{len(jobs)} {shown(job.out)} {end} in {seconds:.1f} s",
              file=sys.stderr, flush=True)
        if code >= 128:  # stopped by a signal: the cell stops with it (the journal keeps what ended)
            return code
        if failure and isinstance(failure[0], Busy):
            # another process writes this run: an earlier attempt of this job still running (snakemake killed
            # with kill -9 leaves its jobs running), which goes on to the next runs, and the calibrations, too
            if number < len(jobs):
                print(f"agg-bench cell: {numbered('run', number + 1, len(jobs))} not started: another process writes "
                      f"{shown(failure[0].target)} (an earlier attempt of this job still running?); run the job again once "
                      "it has ended", file=sys.stderr, flush=True)
            return max(worst, code, key=SEVERITY.__getitem__)
        worst = max(worst, code, key=SEVERITY.__getitem__)
        _free_finished_run()
    every_run_ended = len(ended) == len(jobs)
    if journal is not None and not keep_journal and every_run_ended and \
            all(status in ENDED for status in ended.values()):
        journal.remove()  # this attempt ended: a later one (a forced rerun) runs everything again
    if worst == 0 and every_run_ended:
        for job, _ in jobs:
            if job.done is not None:
                write_marker(job.done, job.out, ended[job.out])
    if after_runs is not None:
        code = after_runs(dict(ended))
        if code >= 128:
            return code
        worst = max(worst, code, key=SEVERITY.__getitem__)
    return worst


# whether a file is a run's marker ({"out", "status"}), which a cell or a run may replace
is_marker = json_file_where(lambda data: set(data) == {"out", "status"})


@contextlib.contextmanager
def claimed_markers(markers: list[tuple[Path, str]]) -> Iterator[None]:
    """Hold the claim of each run marker of ``markers`` (``(path, what names it in an error)``) until the block
    ends: a second job that names the same marker while this one runs (another cell's job file, another ``agg-bench
    run --done``) is refused in one line naming the holder (:class:`~agg_bench.outdir.Busy`), instead of replacing
    this job's record with its own. The folders made for the markers go again if the block leaves them empty."""
    with contextlib.ExitStack() as stack:
        for path, flag in markers:
            claim = Claim(path, folder=False, lock_inside=False, flag=flag,
                          check=functools.partial(check_file, path, is_marker, "a run's marker", flag))
            claim.acquire()
            stack.callback(claim.release, True)
        yield


def write_marker(path: Path, out: Path, status: str) -> None:
    """Write the marker ``path`` of the run folder ``out`` that ended with ``status`` (its folder made if
    missing). Its job holds its claim (:func:`claimed_markers`), whose check removes nothing, so the temporaries
    that killed writers of it left beside it (in a folder of every job's markers) go here, those of a live process
    kept."""
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temps(path)
    write_json(path, {"out": str(out), "status": status})


def _journal_shape(data: dict) -> bool:
    return set(data) == {"code", "runs"} and isinstance(data["runs"], dict) \
        and all(isinstance(r, dict) for r in data["runs"].values())


# whether a file is a cell's journal (:class:`Journal`), which the cell may replace
is_journal = json_file_where(_journal_shape)


def journal_ends(path: Path, outs: list[str]) -> bool:
    """Whether ``path`` is a cell's journal (:class:`Journal`) that records each run folder of ``outs`` as
    ended (:data:`ENDED`): the journal an attempt that ended would remove itself without ``--keep-journal``."""
    return json_file_where(lambda data: _journal_shape(data) and all(
        data["runs"].get(out, {}).get("status") in ENDED for out in outs))(path)


class Journal:
    """The journal of a cell job's attempts (``<job>.progress.json`` beside the job file): the runs that
    ended ``ok``, ``oom`` or ``diverged``, each with its config as written, and the code they ran. Written
    atomically as each run ends; read by the next attempt (:meth:`kept`)."""

    def __init__(self, path: Path, runs: dict[str, dict], code: str, flag: str = "--journal"):
        self.path, self.runs, self.code = path, runs, code
        self.flag = flag  # what names the journal in an error: the option that gave it, or the job file's journal

    @staticmethod
    def path_of(jobs_path: Path) -> Path:
        return jobs_path.with_name(f"{jobs_path.name.removesuffix('.json')}.progress.json")

    @classmethod
    def resume(cls, jobs_path: Path) -> "Journal":
        """The journal of ``jobs_path``'s earlier attempt (:meth:`read`)."""
        return cls.read(cls.path_of(jobs_path), "agg-bench cell", f"{shown(jobs_path)}: its journal",
                        f"every run of {shown(jobs_path)} runs")

    @classmethod
    def read(cls, path: Path, verb: str, flag: str, rerun: str, advice: str | None = None) -> "Journal":
        """The journal at ``path``, or an empty one when there is none or it was written by other code (stderr
        says so, ``verb``: that ``rerun``); a UserError naming ``flag``, before any run, when the file there is
        not a journal (a folder, a link, someone else's file: it is never replaced), ending with ``advice``
        (default: remove it, for a journal whose place the job file fixes). The temporaries that killed writers
        of the journal left beside it go first (:meth:`add` removes them too, but an attempt that keeps every run,
        or whose runs all fail, adds nothing)."""
        code = source_digest()
        check = functools.partial(check_file, path, is_journal, "a cell job's journal", flag,
                                  f"remove it ({verb} writes its journal there)" if advice is None else advice)
        check()
        _remove_stale_temps(path, flag, check)
        runs = _recorded_runs(path, code)
        if runs is None:
            print(f"{verb}: {shown(path)}: its runs ran other code (agg_bench or baselines changed since); {rerun}",
                  file=sys.stderr, flush=True)
        return cls(path, runs or {}, code, flag)

    def kept(self, job: CellRun, cfg: Any) -> str | None:
        """The status of ``job``'s run as the journal recorded it, when that run is kept: recorded for this
        config, and its folder still holds that config, a summary of that status, records and env.json."""
        entry = self.runs.get(str(job.out))
        if entry is None or entry.get("status") not in ENDED:
            return None
        config = as_written(cfg.to_dict())
        if entry.get("config") != config:
            return None
        folder = RunFolder(job.out)  # the one reader of a run folder: bounded, its summary by the record contract
        try:
            summary, written = folder.summary(), folder.config_object()
        except UserError:
            return None
        if summary.get("status") != entry["status"] or written != config:
            return None
        if not (folder.path(METRICS_FILE).is_file() and folder.path(ENV_FILE).is_file()):
            return None
        return entry["status"]

    def add(self, job: CellRun, cfg: Any, status: str) -> None:
        """Record ``job``'s run as ended with ``status``. The journal is read again and rewritten under its lock
        (a :class:`~agg_bench.outdir.Claim` that waits): two processes recording runs in one journal at once
        (``agg-bench run --journal`` of the same file) each keep the other's entry."""
        # checked again once held: what became another kind of file meanwhile (a run's marker that another job
        # wrote there) is refused, not replaced by this journal
        with Claim(self.path, folder=False, lock_inside=False, flag=self.flag, wait=True,
                   check=functools.partial(check_file, self.path, is_journal, "a cell job's journal", self.flag)):
            remove_stale_temps(self.path)  # a killed writer's of this journal: the claim's check removes none
            self.runs = {**(_recorded_runs(self.path, self.code) or {}),
                         str(job.out): {"config": as_written(cfg.to_dict()), "status": status}}
            write_json(self.path, {"code": self.code, "runs": self.runs})

    def remove(self) -> None:
        self.path.unlink(missing_ok=True)


def _remove_stale_temps(path: Path, flag: str, check: Callable[[], None]) -> None:
    """Remove the temporaries of the journal ``path`` that processes which have ended left beside it
    (:func:`~agg_bench.io.remove_stale_temps`), under its claim as :meth:`Journal.add` writes it; nothing is
    claimed where there is none (a folder not made yet, one this attempt only reads)."""
    if path.parent.is_dir() and any(is_stale_temp(entry.name, path) for entry in path.parent.iterdir()):
        with Claim(path, folder=False, lock_inside=False, flag=flag, wait=True, check=check):
            remove_stale_temps(path)


def _recorded_runs(path: Path, code: str) -> dict[str, dict] | None:
    """The runs the journal at ``path`` records: empty when there is none, None when they ran other code than
    ``code``."""
    if not path.exists():
        return {}
    journal = read_json_object(path, JOURNAL_EXPECTED)
    return journal["runs"] if journal.get("code") == code else None
