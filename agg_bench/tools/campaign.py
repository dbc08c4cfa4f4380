"""``agg-bench campaign``: a sweep filled in run by run over short windows of GPU time, into committed reference
results.

A campaign is a sweep config (``config/h200.yaml``: the paper's comparison on one H200) whose runs are too many
for one window of GPU time. Each ``campaign run --minutes N`` is one window:

1. It reads the sweep (every check of the workflow's, :class:`~agg_bench.tools.sweep.Sweep`) and takes as done
   every run that is already finished, in the reference folder (``--reference``, e.g.
   ``results/reference/h200``) or in its own work folder (``--work``, from an earlier window on the same
   machine): a run folder whose summary says ``ok`` and whose ``config.json`` is the run's config as the sweep
   composes it today.
2. It orders the runs left by the sweep's ``campaign.priority`` (selectors of model, resolution and methods:
   each selector's runs before the next one's; the rest last, in the sweep's order) and cuts that order into
   processes: consecutive runs of one model x resolution x device are one ``agg-bench cell`` process (the
   model built once, :mod:`agg_bench.runtime.model_reuse`), followed, unless ``campaign.calibrate`` is false,
   by one ``agg-bench calibrate`` process that times the methods it finished beside ``full`` (paired rounds:
   the tables' train speedups and the cost model's prediction on that machine).
3. It stops cleanly before the deadline: a cell process is told the deadline (it starts no run that the
   longest run so far says would not end before it) and is sent SIGTERM ``STOP_MARGIN_S`` seconds before the
   deadline (the run it is in ends ``interrupted``; a process that does not end within ``KILL_AFTER_S`` is
   killed). A SIGTERM or SIGINT to the campaign itself does the same at once.
4. It packs every finished run it holds that the reference lacks, without checkpoints, with the window's
   calibrations and its log (``windows/<stamp>.json``: what ran, how long, what ended how), into one archive
   (``--archive``, default ``WORK/campaign.tar.gz``; a few MiB). A run cut off by the deadline is not in it.

``campaign unpack ARCHIVE`` adds an archive to the reference: it reads the archive as data (never
``extractall``) and refuses, with one line and exit code 2 and the reference untouched, anything that is not
what a window packs: a link or any member that is not a plain file, a path outside the archive's own layout,
a name of the wrong shape, a file that is not JSON / JSON lines, sizes over the bounds below, a run that is not
finished or whose config is not the sweep's for that run id, a calibration that ``agg-bench calibrate`` would
not have written, a run that the reference already holds with other contents. Then it moves the new files
into place, and writes the reference's ``manifest.json`` (every run and calibration there, with the sweep's
labels and ``source: reference``) and its tables (``agg-bench report --manifest REF/manifest.json --tables
REF/tables`` regenerates them byte for byte). ``campaign status`` prints what is done and what is missing,
in the order the next window takes it.
"""
from __future__ import annotations

import contextlib
import dataclasses
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
import tempfile
import time
import zlib
from pathlib import Path
from typing import Any

from .. import stopping
from ..config import load_config, read_yaml_mapping
from ..errors import ConfigError, UserError, quote
from ..io import atomic_path, atomic_target, write_json
from ..outdir import Contents, claim_files, claim_folder, remove_owned
from ..results.report import TABLES_CONTENTS
from ..records import record_problem
from ..runtime.cell import job_entry
from ..runtime.runfolder import RUN_CONTENTS
from .sweep import Sweep, SweepError, check_sweep_files, overrides_of

ROOT = Path(__file__).resolve().parents[2]
SCHEMA = ROOT / "workflow" / "schemas" / "config.schema.yaml"

# the files of a finished run that travel (no checkpoint, no TensorBoard events)
RUN_FILES = ("config.json", "env.json", "plan.json", "metrics.jsonl", "summary.json", "evaluations.jsonl")
REQUIRED_RUN_FILES = ("config.json", "env.json", "metrics.jsonl", "summary.json")
NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,199}$")  # a run id, a calibration's or a window's file name
MAX_ARCHIVE_BYTES = 64 * 2**20
MAX_MEMBER_BYTES = 16 * 2**20
MAX_TOTAL_BYTES = 256 * 2**20
MAX_MEMBERS = 20_000
MAX_MINUTES = 24 * 60
STOP_MARGIN_S = 20.0  # SIGTERM this long before the deadline: the run ends, the archive is packed
KILL_AFTER_S = 12.0  # a process that has not ended this long after SIGTERM is killed
POLL_S = 0.25

def _json_files(what: str) -> Contents:
    return Contents(what, patterns=("*.json",))


WORK_CONTENTS = Contents("an agg-bench campaign work folder", ("campaign.tar.gz",), folders=(
    ("runs", Contents("a campaign's run folders", folders=(("*", RUN_CONTENTS),))),
    ("cells", _json_files("cell job files")), ("calibration", _json_files("calibrations")),
    ("logs", Contents("logs", patterns=("*.log",))), ("windows", _json_files("window logs"))))
REFERENCE_CONTENTS = Contents("agg-bench reference results", ("manifest.json",), folders=(
    ("runs", Contents("reference runs", folders=(("*", Contents("a reference run", RUN_FILES)),))),
    ("calibration", _json_files("calibrations")), ("windows", _json_files("window logs")),
    ("tables", TABLES_CONTENTS)))


def _is_archive(path: Path) -> bool:
    return tarfile.is_tarfile(path)


# ----- the sweep and what is done ---------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Process:
    """One process of a window: the runs of one cell (model x resolution x device), in order."""

    cell: str
    run_ids: tuple[str, ...]


def cpu_resolution(resolution: int) -> int:
    """The tiny models' stand-in for a full-size resolution: 1/16 of it, rounded up to 16 px (512 -> 32,
    720 -> 48, 1024 -> 64)."""
    return 16 * math.ceil(resolution / 256)


def cpu_sweep(data: dict) -> dict:
    """The same campaign on the tiny models on the CPU (``--cpu``): every method, model family, schedule and
    priority as written, with the tiny preset of each family (LoRA rank 4 where the model has adapters),
    float32, one CPU device of 2 threads, :func:`cpu_resolution`'s sizes, one iteration and short calibrations,
    so that a CPU runs all of it in minutes and the test suite can run a window of it."""
    data = json.loads(json.dumps(data))
    data["set"] = {**(data.get("set") or {}), "model.dtype": "float32", "train.iterations": 1}
    data["devices"] = {"cpu": {"device": "cpu", "gpus": 0, "threads": 2, "runs_per_job": 100}}
    for label, overrides in data["models"].items():
        model = {k: v for k, v in overrides.items()
                 if k not in ("model.preset", "model.architecture", "model.pretrained", "train.iterations")}
        model["model.preset"] = "tiny"
        if model.get("train.lora_rank"):
            model["train.lora_rank"] = 4
        data["models"][label] = model
    data["resolutions"] = sorted({cpu_resolution(r) for r in data["resolutions"]})
    for entry in [*data.get("exclude", []), *(data.get("campaign") or {}).get("priority", [])]:
        if isinstance(entry.get("resolution"), int):
            entry["resolution"] = cpu_resolution(entry["resolution"])
    if "calibrate" in data:
        data["calibrate"] = {**data["calibrate"], "repeats": 2, "warmup": 1, "method_repeats": 2}
    return data


class Campaign:
    """A campaign's sweep (``config``: a sweep config YAML) and its priority; with ``cpu``, :func:`cpu_sweep`'s."""

    def __init__(self, config: str | Path, cpu: bool = False, cache_dir: Path | None = None):
        self.config_path = Path(config)
        self.cpu = cpu
        data = read_yaml_mapping(self.config_path, "sweep sections", "--config")
        if not SCHEMA.is_file():
            raise UserError(f"agg-bench campaign: the sweep schema {SCHEMA} is missing; run it from the repository")
        kwargs = {} if cache_dir is None else {"cache_dir": cache_dir}
        if cpu:
            check_sweep_files([self.config_path])
            data = cpu_sweep(data)
            self.sweep = Sweep(data, SCHEMA, **kwargs)
        else:
            self.sweep = Sweep(data, SCHEMA, files=[self.config_path], **kwargs)
        part = data.get("campaign") or {}
        self.calibrate = part.get("calibrate", True)
        self.priority = part.get("priority", [])
        for i, selector in enumerate(self.priority):
            for label in selector.get("methods", []):
                if label not in self.sweep.sweep["methods"]:
                    raise SweepError(f"campaign.priority[{i}].methods: {quote(label)} is not a label under methods")
            if "model" in selector and selector["model"] not in self.sweep.sweep["models"]:
                raise SweepError(f"campaign.priority[{i}].model: {quote(selector['model'])} is not a label under models")

    def config_of(self, run_id: str) -> dict:
        """The resolved config of ``run_id`` as a run writes it to ``config.json``."""
        run = self.sweep.runs[run_id]
        return load_config(self.sweep.base_file, overrides_of(run["pairs"])).to_dict()

    @staticmethod
    def cell_of(run: dict) -> str:
        return f"{run['model']}_{run['resolution']}px_{run['device']}"

    def finished(self, folder: Path, run_id: str) -> bool:
        """Whether ``folder`` holds ``run_id`` finished: summary ``ok`` and the config the sweep composes."""
        try:
            summary = json.loads((folder / "summary.json").read_text())
            config = json.loads((folder / "config.json").read_text())
        except (OSError, ValueError):
            return False
        return isinstance(summary, dict) and summary.get("status") == "ok" and config == self.config_of(run_id)

    def done(self, *folders: Path | None) -> set[str]:
        """The run ids finished in any of ``folders`` (reference or work folders: their ``runs/<id>``)."""
        out = set()
        for run_id in self.sweep.runs:
            if any(f is not None and self.finished(f / "runs" / run_id, run_id) for f in folders):
                out.add(run_id)
        return out

    def order(self) -> list[str]:
        """Every run id, most valuable first: the runs each ``campaign.priority`` selector matches, cell by
        cell (so that a cell's runs share a process), in the selector's order of methods; then the rest, cell
        by cell, in the sweep's order."""
        runs = self.sweep.runs
        cells = list(dict.fromkeys(self.cell_of(run) for run in runs.values()))
        methods = list(self.sweep.sweep["methods"])
        ordered: dict[str, None] = {}
        for selector in [*self.priority, {}]:
            rank = selector.get("methods") or methods
            chosen = [run_id for run_id, run in runs.items() if run_id not in ordered and run["method"] in rank
                      and all(run[key] == selector[key] for key in ("model", "resolution") if key in selector)]
            chosen.sort(key=lambda r: (cells.index(self.cell_of(runs[r])), rank.index(runs[r]["method"])))
            ordered.update(dict.fromkeys(chosen))
        return list(ordered)

    def processes(self, done: set[str]) -> list[Process]:
        """The runs not done, in :meth:`order`, cut into processes: each stretch of consecutive runs of one
        cell is one process (a cell whose runs come under two selectors may take two)."""
        out: list[Process] = []
        for run_id in self.order():
            if run_id in done:
                continue
            cell = self.cell_of(self.sweep.runs[run_id])
            if out and out[-1].cell == cell:
                out[-1] = Process(cell, (*out[-1].run_ids, run_id))
            else:
                out.append(Process(cell, (run_id,)))
        return out

    def cell_pairs(self, cell: str) -> list[tuple[str, Any]]:
        """The overrides of ``cell``'s calibration (the sweep's, without a method)."""
        for name, job in self.sweep.calibrations.items():
            if name == cell:
                return job["pairs"]
        run = next(r for r in self.sweep.runs.values() if self.cell_of(r) == cell)
        return self.sweep._pairs(run["device"], run["model"], run["resolution"], None, {})


# ----- one window --------------------------------------------------------------------------------------------
def _stopped() -> bool:
    """Whether the campaign was sent SIGTERM or SIGINT (:mod:`agg_bench.stopping` remembers it)."""
    return stopping.pending() is not None


def _supervise(argv: list[str], log: Path, env: dict, stop_at: float, stopped=_stopped) -> tuple[int | None, str]:
    """Run ``argv`` until it ends, SIGTERM it at ``stop_at`` or once ``stopped()``, kill it ``KILL_AFTER_S``
    later; (its exit code, how it ended: finished, stopped at the deadline, interrupted)."""
    with open(log, "ab") as handle:
        proc = subprocess.Popen(argv, stdout=handle, stderr=subprocess.STDOUT, env=env, cwd=os.getcwd())
        how, termed = "finished", None
        while proc.poll() is None:
            now = time.time()
            if termed is None and (now >= stop_at or stopped()):
                how = "interrupted" if stopped() else "stopped at the deadline"
                proc.send_signal(signal.SIGTERM)
                termed = now
            elif termed is not None and now - termed > KILL_AFTER_S:
                proc.kill()
                how += " (killed)"
                proc.wait()
                break
            time.sleep(POLL_S)
    return proc.returncode, how


def _child_env(threads: int) -> dict:
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS=str(threads), PYTHONUNBUFFERED="1")
    # the children import agg_bench from this checkout, whether or not it is installed
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    return env


def check_minutes(minutes: Any) -> float:
    if isinstance(minutes, bool) or not isinstance(minutes, (int, float)) or not math.isfinite(minutes) \
            or not 0 < minutes <= MAX_MINUTES:
        raise ConfigError("--minutes", minutes, f"a number of minutes in (0, {MAX_MINUTES}]")
    return float(minutes)


def run_window(campaign: Campaign, minutes: float, work: str | Path, reference: str | Path | None,
               archive: str | Path | None = None, python: str = sys.executable) -> dict:
    """One window of ``minutes`` (module docstring); returns its log (also in the archive)."""
    start = time.time()
    deadline = start + check_minutes(minutes) * 60
    stop_at = deadline - min(STOP_MARGIN_S, minutes * 60 / 4)
    work = Path(work)
    reference = Path(reference) if reference is not None else None
    archive = Path(archive) if archive is not None else work / "campaign.tar.gz"
    stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime(start))
    # a first SIGTERM / SIGINT is only remembered here: the process in flight is stopped, the finished runs
    # are packed, and the end of the block raises it (exit code 128 + N)
    with claim_folder(work, WORK_CONTENTS, "--work"), \
            claim_files({archive: (_is_archive, "a campaign archive")}, "--archive"), stopping.safe_points():
        for sub in ("runs", "cells", "calibration", "logs", "windows"):
            (work / sub).mkdir(exist_ok=True)
        done = campaign.done(reference, work)
        log: dict[str, Any] = {"started": stamp, "minutes": minutes, "config": str(campaign.config_path),
                               "done_before": len(done), "runs": len(campaign.sweep.runs), "processes": []}
        for number, process in enumerate(campaign.processes(done), 1):
            if time.time() >= stop_at or _stopped():
                break
            log["processes"].append(_run_process(campaign, process, number, stamp, work, stop_at, python))
        log["stopped_by_signal"] = signal.Signals(stopping.pending()).name if _stopped() else None
        log["seconds"] = round(time.time() - start, 1)
        log["finished_in_window"] = sorted(r for p in log["processes"] for r in p["finished"])
        log["left"] = len(campaign.sweep.runs) - len(campaign.done(reference, work))
        write_json(work / "windows" / f"{stamp}.json", log)
        _pack(campaign, work, reference, archive)
        log["archive"] = str(archive)
    return log


def _run_process(campaign: Campaign, process: Process, number: int, stamp: str, work: Path, stop_at: float,
                 python: str) -> dict:
    sweep = campaign.sweep
    device = sweep.runs[process.run_ids[0]]["device"]
    env = _child_env(sweep.threads(device))
    name = f"{stamp}_{number:02d}_{process.cell}"
    jobs = {"runs": [job_entry(sweep.base_file, overrides_of(sweep.runs[r]["pairs"]), str(work / "runs" / r))
                     for r in process.run_ids]}
    write_json(work / "cells" / f"{name}.json", jobs)
    for run_id in process.run_ids:  # an earlier attempt of the same run in this work folder is replaced
        folder = work / "runs" / run_id
        if folder.exists() and not campaign.finished(folder, run_id):
            remove_owned(folder, RUN_CONTENTS)
    began = time.time()
    code, how = _supervise([python, "-m", "agg_bench", "cell", str(work / "cells" / f"{name}.json"),
                            "--deadline", f"{stop_at:.3f}"], work / "logs" / f"{name}.log", env, stop_at)
    finished = [r for r in process.run_ids if campaign.finished(work / "runs" / r, r)]
    entry: dict[str, Any] = {"cell": process.cell, "runs": list(process.run_ids), "finished": finished,
                             "exit_code": code, "ended": how, "seconds": round(time.time() - began, 1)}
    labels = [sweep.runs[r]["method"] for r in finished]
    if campaign.calibrate and labels and time.time() < stop_at and not _stopped():
        entry["calibration"] = _calibrate(campaign, process.cell, labels, name, work, stop_at, python, env)
    print(f"agg-bench campaign: {process.cell}: {len(finished)}/{len(process.run_ids)} runs finished "
          f"({how}, {entry['seconds']} s)", file=sys.stderr, flush=True)
    return entry


def _calibrate(campaign: Campaign, cell: str, labels: list[str], name: str, work: Path, stop_at: float,
               python: str, env: dict) -> dict:
    """Time ``labels`` beside ``full`` (when the sweep has it) on one rollout of ``cell``."""
    sweep = campaign.sweep
    methods = sweep.sweep["methods"]
    if "full" in methods and "full" not in labels:
        labels = ["full", *labels]
    options = sweep.sweep.get("calibrate") or {}
    argv = [python, "-m", "agg_bench", "calibrate"]
    if sweep.base_file:
        argv += ["--config", sweep.base_file]
    for item in overrides_of(campaign.cell_pairs(cell)):
        argv += ["--set", item]
    for key in ("repeats", "warmup", "method_repeats"):
        if key in options:
            argv += [f"--{key.replace('_', '-')}", str(int(options[key]))]
    for label in labels:
        argv += ["--method", label, json.dumps(methods[label])]
    out = work / "calibration" / f"{name}.json"
    argv += ["--out", str(out)]
    began = time.time()
    code, how = _supervise(argv, work / "logs" / f"{name}.calibrate.log", env, stop_at)
    ok = code == 0 and out.is_file()
    if not ok and out.exists():
        out.unlink()
    return {"file": out.name if ok else None, "methods": labels, "exit_code": code, "ended": how,
            "seconds": round(time.time() - began, 1)}


def _pack(campaign: Campaign, work: Path, reference: Path | None, archive: Path) -> None:
    """The archive of every finished run in ``work`` that ``reference`` lacks, the calibrations and window
    logs, as ``runs/<id>/<file>``, ``calibration/<name>.json`` and ``windows/<stamp>.json``."""
    in_reference = campaign.done(reference) if reference is not None else set()
    members: list[tuple[str, Path]] = []
    for run_id in sorted(campaign.done(work) - in_reference):
        for name in RUN_FILES:
            path = work / "runs" / run_id / name
            if path.is_file():
                members.append((f"runs/{run_id}/{name}", path))
    for sub in ("calibration", "windows"):
        for path in sorted((work / sub).glob("*.json")):
            members.append((f"{sub}/{path.name}", path))
    with atomic_target(archive) as tmp, tarfile.open(tmp, "w:gz") as tar:
        for arcname, path in members:
            tar.add(path, arcname=arcname, recursive=False)


# ----- unpacking into the reference ---------------------------------------------------------------------------
def _read_archive(path: Path) -> dict[str, bytes]:
    """{member path: bytes} of a campaign archive, every member checked before any is read: plain files of
    the campaign layout, bounded sizes."""
    where = f"archive {path}"
    if not path.is_file() or path.is_symlink():
        raise UserError(f"{where}: not a file")
    size = path.stat().st_size
    if size > MAX_ARCHIVE_BYTES:
        raise UserError(f"{where}: {size:,} bytes; expected at most {MAX_ARCHIVE_BYTES:,}")
    try:
        tar = tarfile.open(path, "r:*")
    except (tarfile.TarError, OSError, EOFError) as err:
        raise UserError(f"{where}: not a readable tar archive ({err})") from None
    files: dict[str, bytes] = {}
    total = 0
    with tar:
        try:
            for count, member in enumerate(tar, 1):
                if count > MAX_MEMBERS:
                    raise UserError(f"{where}: more than {MAX_MEMBERS:,} members")
                name = member.name
                shown = quote(name)
                if member.isdir():
                    _check_path(where, name, directory=True)
                    continue
                if not member.isreg():
                    raise UserError(f"{where}: {shown} is not a plain file (links, devices and the like are refused)")
                _check_path(where, name)
                if name in files:
                    raise UserError(f"{where}: {shown} is in the archive twice")
                if member.size > MAX_MEMBER_BYTES:
                    raise UserError(f"{where}: {shown} holds {member.size:,} bytes; expected at most "
                                    f"{MAX_MEMBER_BYTES:,}")
                total += member.size
                if total > MAX_TOTAL_BYTES:
                    raise UserError(f"{where}: its files hold more than {MAX_TOTAL_BYTES:,} bytes")
                handle = tar.extractfile(member)
                data = handle.read(MAX_MEMBER_BYTES + 1) if handle is not None else b""
                if len(data) != member.size:
                    raise UserError(f"{where}: {shown} is truncated")
                files[name] = data
        except (tarfile.TarError, OSError, EOFError, zlib.error) as err:
            raise UserError(f"{where}: not a readable tar archive ({err})") from None
    if not files:
        raise UserError(f"{where}: holds no files")
    return files


def _check_path(where: str, name: str, directory: bool = False) -> None:
    """``name`` is a path of the layout: ``runs[/<id>[/<run file>]]``, ``calibration[/<name>.json]``,
    ``windows[/<stamp>.json]``."""
    parts = name.split("/")
    ok = bool(parts) and not name.startswith("/") and all(NAME.match(p) for p in parts)
    if ok and directory:
        ok = (parts[0] in ("runs", "calibration", "windows") and len(parts) == 1) or \
            (parts[0] == "runs" and len(parts) == 2)
    elif ok:
        ok = (parts[0] == "runs" and len(parts) == 3 and parts[2] in RUN_FILES) or \
            (parts[0] in ("calibration", "windows") and len(parts) == 2 and parts[1].endswith(".json"))
    if not ok:
        raise UserError(f"{where}: {quote(name)} is not a path of a campaign archive (runs/<run id>/"
                        f"{{{','.join(RUN_FILES)}}}, calibration/<name>.json, windows/<stamp>.json)")


def _json_object(where: str, data: bytes) -> dict:
    try:
        value = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as err:
        raise UserError(f"{where}: not JSON ({str(err).splitlines()[0][:200]})") from None
    if not isinstance(value, dict):
        raise UserError(f"{where}: expected a JSON object")
    return value


def _json_lines(where: str, data: bytes) -> list[dict]:
    out = []
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise UserError(f"{where}: not UTF-8 text ({err.reason})") from None
    for number, line in enumerate(text.splitlines(), 1):
        if line.strip():
            out.append(_json_object(f"{where}: line {number}", line.encode()))
    return out


def _check_run(campaign: Campaign, where: str, run_id: str, files: dict[str, bytes]) -> None:
    """A finished run of the campaign's sweep: its files, a summary that says ``ok``, records the record
    contract accepts, and the config the sweep composes for ``run_id``."""
    if run_id not in campaign.sweep.runs:
        raise UserError(f"{where}: runs/{run_id} is not a run of the sweep {campaign.config_path}")
    missing = [name for name in REQUIRED_RUN_FILES if name not in files]
    if missing:
        raise UserError(f"{where}: runs/{run_id} lacks {missing[0]} (a finished run has "
                        f"{', '.join(REQUIRED_RUN_FILES)})")
    summary = _json_object(f"{where}: runs/{run_id}/summary.json", files["summary.json"])
    if summary.get("status") != "ok":
        raise UserError(f"{where}: runs/{run_id} is not finished (status {quote(summary.get('status'))}, "
                        "expected ok)")
    for name in ("env.json", "plan.json"):
        if name in files:
            _json_object(f"{where}: runs/{run_id}/{name}", files[name])
    records = _json_lines(f"{where}: runs/{run_id}/metrics.jsonl", files["metrics.jsonl"])
    if not records:
        raise UserError(f"{where}: runs/{run_id}/metrics.jsonl holds no records")
    for number, record in enumerate([summary, *records]):
        problem = record_problem(record)
        if problem is not None:
            name = "summary.json" if number == 0 else f"metrics.jsonl: record {number}"
            raise UserError(f"{where}: runs/{run_id}/{name}: {problem}")
    if "evaluations.jsonl" in files:
        _json_lines(f"{where}: runs/{run_id}/evaluations.jsonl", files["evaluations.jsonl"])
    config = _json_object(f"{where}: runs/{run_id}/config.json", files["config.json"])
    if config != campaign.config_of(run_id):
        raise UserError(f"{where}: runs/{run_id}/config.json is not the config {campaign.config_path} composes "
                        "for that run (another version of the sweep?)")
    if records[0].get("iteration") != 0:
        raise UserError(f"{where}: runs/{run_id}/metrics.jsonl starts at iteration "
                        f"{quote(records[0].get('iteration'))}; expected 0")


COUNT_KEYS = ("forward_nograd", "forward_grad", "backward", "train_forward_nograd", "train_forward_grad",
              "train_backward")


def tiny_counterpart(config: dict) -> dict:
    """A run's config on the tiny model of its family on the CPU, one iteration, no telemetry: the same
    schedule, group, plan and method, so the same passes per sample (they depend on neither the device, the
    size, the precision nor the weights)."""
    cfg = json.loads(json.dumps(config))
    model = cfg["model"]
    model.update(preset="tiny", architecture=None, pretrained=None, dtype="float32",
                 resolution=cpu_resolution(model["resolution"]) if model["resolution"] > 64 else model["resolution"])
    cfg["device"] = "cpu"
    cfg["progress"] = False
    cfg["train"].update(iterations=1, budget=None, checkpoint_every=0, shard="none",
                        lora_rank=min(cfg["train"]["lora_rank"], 4))
    cfg["telemetry"] = {**cfg["telemetry"], "enabled": False, "tensorboard": False}
    cfg["eval"] = {**cfg["eval"], "every": 0}
    return cfg


def _check_counts(where: str, run_id: str, records: list[dict], config: dict) -> None:
    """The first record's passes per sample equal what the run's schedule counts on the tiny model on the CPU
    (module docstring). A run whose records carry a cache's fields is not compared: a cache that skips by a
    threshold skips by the values, which random weights at another size do not share."""
    if any(key.startswith("cache_") for key in records[0]):
        return
    from ..config import validate
    from ..io import read_jsonl
    from ..runtime.train import train

    with tempfile.TemporaryDirectory() as tmp, contextlib.redirect_stderr(io.StringIO()):  # no progress lines
        train(validate(tiny_counterpart(config)), Path(tmp) / run_id)
        [tiny] = list(read_jsonl(Path(tmp) / run_id / "metrics.jsonl"))
    first = records[0]
    for key in COUNT_KEYS:
        if first.get(key) != tiny.get(key):
            raise UserError(f"{where}: runs/{run_id}: {key} = {quote(first.get(key))} in its first iteration, where "
                            f"the same schedule on the tiny model on the CPU counts {quote(tiny.get(key))}")


def _check_calibration(campaign: Campaign, where: str, name: str, data: bytes) -> None:
    from ..results.loading import CalibrationEntry, load_calibration

    cell = name.rsplit(".", 1)[0].split("_", 2)[-1] if name.count("_") >= 2 else ""
    if not any(cell == Campaign.cell_of(run) for run in campaign.sweep.runs.values()):
        raise UserError(f"{where}: calibration/{name} is not named <stamp>_<number>_<cell>.json after a cell of "
                        f"the sweep {campaign.config_path}")
    _json_object(f"{where}: calibration/{name}", data)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / name
        path.write_bytes(data)
        try:
            load_calibration([CalibrationEntry(path)])
        except UserError as err:
            raise UserError(f"{where}: calibration/{name}: {str(err).split(': ', 2)[-1]}") from None


def unpack(campaign: Campaign, archive: str | Path, reference: str | Path) -> dict:
    """Add ``archive`` to ``reference`` (module docstring); returns what was added."""
    archive, reference = Path(archive), Path(reference)
    where = f"archive {archive}"
    files = _read_archive(archive)
    runs: dict[str, dict[str, bytes]] = {}
    others: dict[str, bytes] = {}
    for name, data in files.items():
        parts = name.split("/")
        if parts[0] == "runs":
            runs.setdefault(parts[1], {})[parts[2]] = data
        else:
            others[name] = data
    for run_id, run_files in runs.items():
        _check_run(campaign, where, run_id, run_files)
    for name, data in others.items():
        kind, file_name = name.split("/")
        if kind == "calibration":
            _check_calibration(campaign, where, file_name, data)
        else:
            _json_object(f"{where}: {name}", data)
    with claim_folder(reference, REFERENCE_CONTENTS, "--reference"):
        # what the reference already holds: the same bytes are skipped, other bytes refused
        new_runs, new_others = {}, {}
        for run_id, run_files in runs.items():
            folder = reference / "runs" / run_id
            if folder.exists():
                held = {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()}
                if held != run_files:
                    raise UserError(f"{where}: runs/{run_id} is in the reference {reference} already, with other "
                                    "contents; remove it there first to replace it")
                continue
            new_runs[run_id] = run_files
        for name, data in others.items():
            path = reference / name
            if path.exists():
                if path.read_bytes() != data:
                    raise UserError(f"{where}: {name} is in the reference {reference} already, with other "
                                    "contents")
                continue
            new_others[name] = data
        if new_runs:
            print(f"agg-bench campaign: {len(new_runs)} new runs; comparing their pass counts with the tiny models'",
                  file=sys.stderr, flush=True)
        for run_id, run_files in new_runs.items():
            _check_counts(where, run_id, _json_lines(where, run_files["metrics.jsonl"]),
                          json.loads(run_files["config.json"]))
        staging = atomic_path(reference / "unpack")  # a harness temporary: never someone's file
        staging.mkdir()
        try:
            for run_id, run_files in new_runs.items():
                (staging / "runs" / run_id).mkdir(parents=True)
                for name, data in run_files.items():
                    (staging / "runs" / run_id / name).write_bytes(data)
            for name, data in new_others.items():
                (staging / name).parent.mkdir(parents=True, exist_ok=True)
                (staging / name).write_bytes(data)
            for sub in ("runs", "calibration", "windows"):
                (reference / sub).mkdir(exist_ok=True)
            for run_id in new_runs:
                os.rename(staging / "runs" / run_id, reference / "runs" / run_id)
            for name in new_others:
                os.rename(staging / name, reference / name)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        manifest = write_reference_tables(campaign, reference)
    return {"reference": str(reference), "runs_added": sorted(new_runs), "files_added": sorted(new_others),
            "runs": len(manifest["runs"])}


def reference_manifest(campaign: Campaign, reference: Path) -> dict:
    """The manifest of every run and calibration in ``reference``, with the sweep's labels and
    ``source: reference``; paths relative to the working directory where ``reference`` lies inside it (a
    committed reference is read from the repository's root)."""
    reference = _relative(reference)
    full = campaign.sweep.manifest()
    runs = []
    for entry in full["runs"]:
        run_id = Path(entry["dir"]).name
        if run_id in campaign.sweep.runs and (reference / "runs" / run_id / "summary.json").is_file():
            runs.append({**entry, "dir": str(reference / "runs" / run_id), "source": "reference"})
    cells = {Campaign.cell_of(run): run for run in campaign.sweep.runs.values()}
    calibration = []
    for path in sorted((reference / "calibration").glob("*.json")):
        cell = path.stem.split("_", 2)[-1]
        if cell in cells:
            run = cells[cell]
            calibration.append({"file": str(path), "model": run["model"], "resolution": run["resolution"],
                                "device": run["device"], "source": "reference"})
    return {"runs": runs, "gradcheck": [], "calibration": calibration, "warmup": full["warmup"], "time": full["time"]}


def _relative(path: Path) -> Path:
    relative = os.path.relpath(path.resolve())
    return Path(relative) if not relative.startswith("..") else path.resolve()


def write_reference_tables(campaign: Campaign, reference: Path) -> dict:
    """``reference``'s manifest.json and tables/ (the report of its runs)."""
    from ..results.loading import load_manifest
    from ..results.report import build_report

    manifest = reference_manifest(campaign, reference)
    write_json(reference / "manifest.json", manifest)
    if manifest["runs"]:
        build_report(load_manifest(reference / "manifest.json"), reference / "tables")
    return manifest


def status(campaign: Campaign, reference: Path | None, work: Path | None = None) -> dict:
    """Per cell: the runs done and the runs missing, in the order the next window takes them."""
    done = campaign.done(reference, work)
    cells: dict[str, dict[str, list[str]]] = {}
    for run_id in campaign.order():
        run = campaign.sweep.runs[run_id]
        entry = cells.setdefault(Campaign.cell_of(run), {"done": [], "missing": []})
        entry["done" if run_id in done else "missing"].append(run["method"])
    return {"runs": len(campaign.sweep.runs), "done": len(done), "cells": cells}

