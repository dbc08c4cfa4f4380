"""What the report reads: the manifest, run folders (every record with the labels the tables group by),
gradcheck CSVs and calibrations; and, for the plots, the tables it wrote (:func:`load_tables`). Every input
is checked as it is read; anything that is not what the command that wrote it writes is a UserError naming
the file and the key.

The workflow passes a manifest (JSON) that names every run with its sweep labels; without one, labels
come from the records themselves (:func:`discover_runs`).
"""
from __future__ import annotations

import csv
import hashlib
import io
import json
import math
import re
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Callable, Iterable, Mapping, TypeGuard

import numpy as np
import pandas as pd

from ..config import ModelConfig, RunConfig, TrainConfig, bound, weights_label
from ..errors import ConfigError, UserError, counted, quote, shown
from ..io import file_identity, path_text
from ..jsonfiles import check_path, read_json_object
from ..outputs import STAMP_FILE, STAMP_KEYS, check_no_unpack_above
from ..outdir import (LOCK_SUFFIX, check_not_written, is_harness_name, is_lock_name, named_path_problem,
                      reach_problem)
from ..reading import CONFIG_FILE, RunFolder, check_entry_names_run, run_config
from ..records import (GRADCHECK_OPTION_DEFAULTS, MAX_LABEL, OPTIMIZER_STEPS_KEY, PASS_KEYS, PLOT_TABLES,
                       TEXT_KEYS, is_finite_number, is_integer, is_label, unprintable_words)


@dataclass
class RunEntry:
    """One run folder and the labels it is shown under (None: taken from its records)."""

    dir: Path
    method: str | None = None
    model: str | None = None
    resolution: int | None = None
    device: str | None = None
    seed: int | None = None
    method_options: dict | None = None
    source: str | None = None  # "reference": a committed reference run, shown beside the user's own


@dataclass
class GradcheckEntry:
    """One gradcheck CSV and the model label / resolution it was measured at."""

    file: Path
    model: str | None = None
    resolution: int | None = None


@dataclass
class CalibrationEntry:
    """One ``agg-bench calibrate`` JSON and the model label, resolution and device label it is matched
    to (None: taken from the file)."""

    file: Path
    model: str | None = None
    resolution: int | None = None
    device: str | None = None
    source: str | None = None  # "reference": it prices the reference runs' rows


# a manifest entry's `source`: a reference run (results/reference/<hardware>/, the runs of a committed campaign)
# is shown in rows of its own, its hardware named "<GPU> (reference)", priced by the reference's calibrations
ENTRY_SOURCES = ("reference",)

TIME_BASES = ("auto", "cpu", "wall")


@dataclass
class Manifest:
    """What a report reads. ``warmup``: iterations of each run left out of the timings; ``time``: which
    seconds the timings and speedups use (``TIME_BASES``, see the module docstring)."""

    runs: list[RunEntry] = field(default_factory=list)
    gradcheck: list[GradcheckEntry] = field(default_factory=list)
    warmup: int = 1
    time: str = "auto"
    calibration: list[CalibrationEntry] = field(default_factory=list)
    # the manifest file this was read from, and that file's identity then (load_manifest)
    file: Path | None = None
    file_identity: tuple[int, int, int] | None = None

    def check_unchanged(self) -> None:
        """A UserError when the manifest file this was read from was replaced since (another process wrote it:
        ``campaign unpack`` into its reference, a workflow): what was read from it may no longer be what it
        lists, and a report of it beside it would be of an earlier manifest."""
        if self.file is not None and file_identity(self.file) != self.file_identity:
            raise UserError(f"manifest {shown(self.file)}: replaced by another process while it was read; run again "
                            "once that process has ended")

    def digest(self) -> str:
        """A SHA-256 of what this lists (its entries as given, warmup, time; not where it was read from): the
        ``manifest`` of the report's :data:`~agg_bench.outputs.STAMP_FILE`."""
        def entries(items) -> list[dict]:
            return [{key: path_text(value) if isinstance(value, Path) else value
                     for key, value in vars(entry).items() if value is not None} for entry in items]

        listed = {"runs": entries(self.runs), "gradcheck": entries(self.gradcheck),
                  "calibration": entries(self.calibration), "warmup": self.warmup, "time": self.time}
        return hashlib.sha256(json.dumps(listed, sort_keys=True).encode()).hexdigest()


def check_time_basis(value, key: str = "report.time") -> str:
    """``value`` if it is one of ``TIME_BASES``; else a UserError naming ``key``."""
    if not isinstance(value, str) or value not in TIME_BASES:
        raise UserError(f"{key} = {value!r}: expected one of {', '.join(TIME_BASES)}")
    return value


# the most iterations a run has (train.iterations' maximum): a warm-up beyond it left every run's timings with all
# their iterations, the warm-up included, and the report said nothing
MAX_ITERATIONS = bound(TrainConfig, "iterations")


def check_warmup(value, key: str = "report.warmup") -> int:
    """``value`` if it is an integer from 0 to :data:`MAX_ITERATIONS` (iterations left out of the timings); else a
    ConfigError naming ``key``."""
    if not is_integer(value) or not 0 <= value <= MAX_ITERATIONS:
        raise ConfigError(key, value, f"an integer from 0 to {MAX_ITERATIONS:,} (iterations of each run left out of "
                          "the timings; train.iterations is at most that)")
    return value


# what a value of a report input holds: (test, words for the error)
# a row's method, model or device label: what a table row shows (a newline split the rows of the Markdown tables)
LABEL = (is_label, f"a label of 1 to {MAX_LABEL} printable characters")
INTEGER = (is_integer, "an integer")
OBJECT = (lambda v: isinstance(v, dict), "an object")
SOURCE = (lambda v: v in ENTRY_SOURCES, f"one of {', '.join(ENTRY_SOURCES)}")
# The most seconds a calibration's unit cost or timed round may hold, and the most passes, calls or steps it may
# count: far above any real one (a pass of one sample does not take 11 days), and small enough that counts x unit
# costs, summed, stay finite numbers (at most 1e15 x 1e6 per kind), so that a predicted time is never an infinity.
MAX_SECONDS = 1e6
MAX_COUNT = 1e15
# what a calibration's number holds: a unit cost per sample (a time > 0: what a timed pass took; null for one not
# timed), a part of a call's cost (>= 0: the fit clips either part at 0), a round's seconds, a count
UNIT_SECONDS = (lambda v: is_number(v) and 0 < v <= MAX_SECONDS, "a number of seconds > 0 and <= 1e6")
PART_SECONDS = (lambda v: is_number(v) and 0 <= v <= MAX_SECONDS, "a number of seconds >= 0 and <= 1e6")
COUNT = (lambda v: is_number(v) and 0 <= v <= MAX_COUNT, "a number >= 0 and <= 1e15")
# a calibration's batch: the samples of the batch it timed, each process's share under torchrun
BATCH = (lambda v: is_integer(v) and 1 <= v <= MAX_COUNT, "an integer >= 1 (the samples calibrate timed)")
# manifest section -> (its entry class, the key every entry needs, the keys an entry may have)
# a file or folder an entry names: text, which then names something this user can use (outdir.named_path_problem)
PATH = (lambda v: isinstance(v, str), "a file or folder name")
# a row's resolution: what a run config's model.resolution may be
RESOLUTION = (lambda v: is_integer(v) and 1 <= v <= bound(ModelConfig, "resolution"),
              f"an integer from 1 to {bound(ModelConfig, 'resolution'):,}")
MANIFEST_SECTIONS = {
    "runs": (RunEntry, "dir", {"dir": PATH, "method": LABEL, "model": LABEL, "resolution": RESOLUTION, "device": LABEL,
                               "seed": INTEGER, "method_options": OBJECT, "source": SOURCE}),
    "gradcheck": (GradcheckEntry, "file", {"file": PATH, "model": LABEL, "resolution": RESOLUTION}),
    "calibration": (CalibrationEntry, "file", {"file": PATH, "model": LABEL, "resolution": RESOLUTION, "device": LABEL,
                                               "source": SOURCE}),
}


def _check(where: str, value, kind: tuple, nullable: bool = True) -> None:
    """A UserError naming ``where`` unless ``value`` is of ``kind`` (or None, when ``nullable``)."""
    test, words = kind
    if not (test(value) or (nullable and value is None)):
        raise UserError(f"{where} = {quote(value)}: expected {words}{' or null' if nullable else ''}"
                        f"{unprintable_words(value) if kind is LABEL else ''}")


def load_manifest(path: str | Path) -> Manifest:
    """Read the workflow's manifest: ``{"runs": [...], "gradcheck": [...], "calibration": [...],
    "warmup": 1, "time": "auto"}`` (each entry an object; see ``MANIFEST_SECTIONS``; its file or folder one this
    user can reach). Anything else is a UserError naming the manifest and the key."""
    path = Path(path)
    check_path(path, "manifest")
    identity = file_identity(path)  # before the read: a manifest replaced meanwhile counts as changed
    data = read_json_object(path, "a report manifest (an object with runs, gradcheck, calibration, warmup, time)")
    unknown = sorted(set(data) - {*MANIFEST_SECTIONS, "warmup", "time"})
    if unknown:
        raise UserError(f"manifest {shown(path)}: unknown key {unknown[0]!r}; expected some of "
                        f"{', '.join([*MANIFEST_SECTIONS, 'warmup', 'time'])}")
    sections: dict[str, list] = {}
    for section, (entry_class, required, keys) in MANIFEST_SECTIONS.items():
        entries = data.get(section, [])
        _check(f"manifest {path}: {section}", entries, (lambda v: isinstance(v, list), "a list"))
        sections[section] = []
        for i, entry in enumerate(entries or []):
            where = f"manifest {shown(path)}: {section}[{i}]"
            _check(where, entry, OBJECT, nullable=False)
            if required not in entry:
                raise UserError(f"{where}: missing {required!r}")
            for key, value in entry.items():
                if key not in keys:
                    raise UserError(f"{where}: unknown key {key!r}; expected some of {', '.join(keys)}")
                _check(f"{where}.{key}", value, keys[key], nullable=key != required)
            problem = named_path_problem(entry[required])
            if problem is not None:
                raise UserError(f"{where}.{required} = {quote(entry[required])}: {problem}; expected a file or "
                                "folder name")
            sections[section].append(entry_class(**{**entry, required: Path(entry[required])}))
    warmup = check_warmup(data.get("warmup", 1), f"manifest {path}: warmup")
    return Manifest(sections["runs"], sections["gradcheck"], warmup,
                    check_time_basis(data.get("time", "auto"), f"manifest {path}: time"), sections["calibration"],
                    path, identity)


def calibration_identity(data: Mapping) -> str:
    """What identifies a calibration: its content, the JSON object ``agg-bench calibrate`` wrote (the cell it timed,
    its batch and machine, and every time it measured), as a SHA-256 of it with its keys sorted. Its file's name
    (``<stamp>_<n>_<cell>.json`` in a campaign) is not: two measurements never agree on every time, so the same
    content under two names is one calibration copied, which counts once."""
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()


def check_distinct_calibrations(named: Iterable[tuple[str, Mapping]]) -> None:
    """A UserError naming two of ``named`` (``(name, content)`` pairs) that hold one calibration
    (:func:`calibration_identity`): a calibration copied under another name (another stamp), which stood twice
    among a cell's calibrations, the copy's stamp placing it after the calibrations taken since."""
    seen: dict[str, str] = {}
    for name, data in named:
        identity = calibration_identity(data)
        if identity in seen:
            first = seen[identity]
            twice = "is given twice" if first == name else f"holds the same calibration as {quote(first)}"
            raise UserError(f"calibration {quote(name)} {twice} (the same content: one measurement); expected each "
                            "calibration once (a copy under another name counts it twice: remove the copy)")
        seen[identity] = name


def load_calibration(entries: Iterable[CalibrationEntry]) -> pd.DataFrame:
    """One row per calibration file: model, resolution, device labels and the unit costs as columns
    ``unit_<basis>_<kind>`` (seconds per sample, per optimizer step for ``optimizer_step``) and, where the
    file has them, ``call_<basis>_<kind>`` and ``latent_<basis>_<kind>`` (a call of n latents costs
    call + latent * n seconds); ``methods``, the side-by-side timings. A file that is not what
    ``agg-bench calibrate`` writes is a UserError naming it and the key; so is one calibration given twice,
    the same file or its content under another name (:func:`check_distinct_calibrations`)."""
    rows = []
    contents: list[tuple[str, dict]] = []
    for entry in entries:
        path = Path(entry.file)
        data = read_json_object(path, "an agg-bench calibrate JSON")
        contents.append((path_text(path), data))
        where = f"calibration {shown(path)}"
        for key, kind in (("model", LABEL), ("resolution", RESOLUTION), ("device", LABEL), ("batch", BATCH),
                          ("unit_s_per_sample", OBJECT), ("unit_s_per_call", OBJECT), ("methods", OBJECT)):
            _check(f"{where}: {key}", data.get(key), kind)
        row = {"model": entry.model if entry.model is not None else data.get("model"),
               "resolution": entry.resolution if entry.resolution is not None else data.get("resolution"),
               "device": entry.device if entry.device is not None else data.get("device"),
               "source": entry.source or "measured"}
        for kind, by_basis in (data.get("unit_s_per_sample") or {}).items():
            _check(f"{where}: unit_s_per_sample.{kind}", by_basis, OBJECT, nullable=False)
            for basis, values in by_basis.items():
                _check(f"{where}: unit_s_per_sample.{kind}.{basis}", values, OBJECT, nullable=False)
                _check(f"{where}: unit_s_per_sample.{kind}.{basis}.median", values.get("median"), UNIT_SECONDS)
                row[f"unit_{basis}_{kind}"] = values.get("median")
        for kind, by_basis in (data.get("unit_s_per_call") or {}).items():
            _check(f"{where}: unit_s_per_call.{kind}", by_basis, OBJECT, nullable=False)
            _check_call_sizes(f"{where}: unit_s_per_call.{kind}", kind, by_basis, data.get("batch"))
            for basis in ("cpu", "wall"):
                values = by_basis.get(basis)
                _check(f"{where}: unit_s_per_call.{kind}.{basis}", values, OBJECT, nullable=False)
                for part in ("call", "latent"):
                    _check(f"{where}: unit_s_per_call.{kind}.{basis}.{part}", values.get(part), PART_SECONDS)
                    row[f"{part}_{basis}_{kind}"] = values.get(part)
        # method label -> its train phase's and its rollout's seconds per round, timed side by side
        # ({basis}_s and rollout_{basis}_s lists), and its rollout's counted forwards per sample
        for label, timed in (data.get("methods") or {}).items():
            _check(f"{where}: methods.{label}", timed, OBJECT, nullable=False)
            for key in (f"{phase}{basis}_s" for phase in ("", "rollout_") for basis in TIME_BASES):
                _check(f"{where}: methods.{label}.{key}", timed.get(key),
                       (lambda v: isinstance(v, list) and all(UNIT_SECONDS[0](x) for x in v),
                        "a list of numbers of seconds > 0 and <= 1e6"))
            _check(f"{where}: methods.{label}.rollout_forwards", timed.get("rollout_forwards"), COUNT)
            # the passes (latents) and calls of each kind in one timed update and one rollout, and the
            # update's optimizer steps
            for key in ("passes", "calls", "rollout_passes", "rollout_calls"):
                _check(f"{where}: methods.{label}.{key}", timed.get(key),
                       (lambda v: isinstance(v, dict) and all(COUNT[0](x) for x in v.values()),
                        "an object of numbers >= 0 and <= 1e15"))
            _check(f"{where}: methods.{label}.optimizer_steps", timed.get("optimizer_steps"), COUNT)
        if not data.get("unit_s_per_sample"):  # every calibration has its unit costs; another verb's JSON has none
            raise UserError(f"{where}: no unit_s_per_sample; expected an agg-bench calibrate JSON (its unit costs)")
        row["methods"] = data.get("methods") or {}
        rows.append(row)
    check_distinct_calibrations(contents)
    return pd.DataFrame(rows)


def _check_call_sizes(where: str, kind: str, by_basis: dict, batch) -> None:
    """A UserError naming ``where.latents`` unless it is what ``calibrate`` writes: the latents of the calls it
    timed, the usual size and then 1 (one entry when the usual size is 1), the usual size of a forward with grad
    and of a backward the calibration's ``batch``; or ``where.<basis>.<stat>`` unless it lists one time per entry
    of ``latents``. Older files without ``latents`` are read as they were."""
    latents = by_basis.get("latents")
    if latents is None:
        return
    usual = batch if kind in ("forward_grad", "backward") and is_integer(batch) else None
    expected = [usual, 1] if usual != 1 else [1]
    if not (isinstance(latents, list) and all(is_integer(n) and 1 <= n <= MAX_COUNT for n in latents)
            and len(latents) == len(set(latents)) and latents and latents[-1] == 1 and len(latents) <= 2
            and (usual is None or latents == expected)):
        words = (f"{expected}: the batch ({usual}) and then 1" if usual is not None and usual != 1 else
                 "[1]" if usual == 1 else "a list of the latents of the calls timed: an integer > 1 and then 1, or [1]")
        raise UserError(f"{where}.latents = {quote(latents)}: expected {words}")
    for basis, values in by_basis.items():
        if basis == "latents" or not isinstance(values, dict):
            continue
        for stat in ("median", "p25", "p75"):
            times = values.get(stat)
            if times is not None and not (isinstance(times, list) and len(times) == len(latents)
                                          and all(UNIT_SECONDS[0](t) for t in times)):
                raise UserError(f"{where}.{basis}.{stat} = {quote(times)}: expected one number of seconds > 0 and "
                                f"<= 1e6 per entry of latents {latents}")


def _is_run_folder(path: Path) -> bool:
    return (path / "summary.json").exists() or (path / "metrics.jsonl").exists()


def discover_runs(paths: Iterable[str | Path]) -> list[RunEntry]:
    """Run folders in ``paths``: each path is a run folder or a folder of run folders. A path that does not
    exist, is a file, is a folder holding no run folder, or holds a folder this user may not search is a UserError
    naming it; so is one of a reference folder that a ``campaign unpack`` is writing or left cut off (the folder
    that holds the run folders looked into: its parent, the reference, holds the unpack's staging folder), as
    its manifest is (:func:`agg_bench.outputs.check_no_unpack`)."""
    out = []
    looked: set[Path] = set()  # the references looked into: --runs REF/runs/* looks into REF once
    for path in map(Path, paths):
        if not path.exists():
            raise UserError(f"--runs {quote(str(path))}: no such folder; expected a run folder or a folder of "
                            "run folders")
        run = _is_run_folder(path)
        check_no_unpack_above(path, 2 if run else 1, f"--runs {path}", looked)
        if run:
            out.append(RunEntry(path))
        elif path.is_dir():
            found = []
            for p in sorted(path.iterdir()):
                if is_harness_name(p.name):
                    # a writer's staging folder (an import's, renamed over its run once whole) is no run; its
                    # lock, held, is a run being replaced, which may be missing between the writer's renames
                    name = p.name[1:-len(LOCK_SUFFIX)] if is_lock_name(p.name) else ""
                    if name:
                        check_not_written(path / name, "run", lock_inside=False)
                    continue
                problem = reach_problem(str(p))
                if problem is not None:
                    raise UserError(f"--runs {quote(str(path))}: {quote(p.name)} {problem}; expected run folders "
                                    "this user can read")
                if _is_run_folder(p):
                    found.append(RunEntry(p))
            if not found:
                raise UserError(f"--runs {quote(str(path))}: holds no run folder (a folder with summary.json or "
                                "metrics.jsonl); expected a run folder or a folder of run folders")
            out.extend(found)
        else:
            raise UserError(f"--runs {quote(str(path))}: not a run folder or a folder of run folders")
    return out


def check_distinct_runs(entries: Iterable[RunEntry]) -> None:
    """A UserError naming a run folder given twice (the same folder once resolved: ``R`` and ``./R``, or a run
    given itself and within its parent folder), whose records would count twice."""
    seen: dict[Path, Path] = {}
    for entry in entries:
        resolved = Path(entry.dir).resolve()
        if resolved in seen:
            raise UserError(f"run {quote(str(entry.dir))} is also given as {quote(str(seen[resolved]))} (the same "
                            "folder); expected each run once")
        seen[resolved] = Path(entry.dir)


# Columns load_records adds to every record: its labels and what its run folder says beside the records
# (the summary's status, the plan's bytes, the config's optimizer steps).
ADDED_COLUMNS = ("method_name", "method_options", "source", "weights", "planned_activation_bytes",
                 "planned_total_bytes", "run_status", "run_dir", "optimizer_steps", "hardware")


def load_records(entries: Iterable[RunEntry], progress: Callable[[str], None] | None = None,
                 manifest: Path | None = None) -> pd.DataFrame:
    """One row per iteration record, with the labels the tables group by.

    Added columns: ``method_name`` (the estimator), ``method_options`` (JSON), ``hardware``, ``source``
    (measured | imported), ``run_status`` (the summary's status) and ``run_dir``. A run that wrote no
    record (it failed while starting) still gets one row, with its status and no measurements. Each run
    folder is read by :class:`agg_bench.reading.RunFolder` (its config typed and bounded, its
    records by the record contract); a folder given twice is refused (:func:`check_distinct_runs`), and so is
    a run id given twice for one row and seed (:func:`check_distinct_run_ids`), and an entry whose ``seed`` or
    ``method_options.name`` is not what its run's files say (:func:`agg_bench.reading.check_entry_names_run`, named
    as ``runs[k]`` of the ``manifest`` file where given): a copied run folder listed under another seed counted as
    one more seed of its row. ``progress`` is told of each run folder read (a line such as ``read run 2/40 DIR:
    100000 records``).
    """
    entries = list(entries)
    check_distinct_runs(entries)
    rows = []
    rewards: dict[str, str] = {}  # run folder -> its reward section (JSON), for runs with a config
    for number, entry in enumerate(entries, 1):
        run_dir = Path(entry.dir)
        folder = RunFolder(run_dir)  # every file read and checked by the one reader of a run folder
        with folder.whole():  # one attempt's files, never a run's that another process is replacing
            summary = folder.summary()
            written = folder.config_object() if folder.has(CONFIG_FILE) else None
            config = run_config(written, folder.path(CONFIG_FILE)) if written is not None else None
            records = folder.records()
            planned = folder.plan()
        folder.check_records_ended(summary, records)
        where = f"manifest {shown(manifest)}: runs[{number - 1}]" if manifest is not None else f"run {shown(run_dir)}"
        check_entry_names_run(where, {"seed": entry.seed, "method_options": entry.method_options}, folder, records,
                              summary, written)
        # the files name one run (config.json's identity where there is one): RunFolder.check_identity
        folder.check_identity(summary, records, None if written is None or config is None else config_identity(written, config))
        if not summary and not records:
            raise UserError(f"run {shown(run_dir)}: no summary.json or metrics.jsonl")
        # a run killed before writing its summary has records but no final status
        status = summary.get("status") or "interrupted"
        if not records:
            records = [{k: summary.get(k) for k in ("run_id", "method", "model", "resolution", "device",
                                                    "gpu_name", "n_gpus", "seed")}]
            records[0]["status"] = status
        options = entry.method_options
        if options is None:
            options = config.method.to_dict() if config is not None else {"name": records[0].get("method")}
        source = entry.source or summary.get("source") or records[0].get("source") or "measured"
        # optimizer steps per iteration, which the cost model prices: a record's own count where the method's
        # steps are not the config's (branch's method.transitions_per_step); unknown without a config
        optimizer_steps = config.train.optimizer_steps if config is not None else None
        if config is not None:
            rewards[path_text(run_dir)] = json.dumps(config.reward.to_dict(), sort_keys=True)
        options_text = json.dumps(options, sort_keys=True)
        dir_text = path_text(run_dir)  # a lone surrogate was a UnicodeEncodeError in the table
        for record in records:
            row = dict(record)
            steps = record.get(OPTIMIZER_STEPS_KEY)  # checked by the record contract
            row["method_name"] = options.get("name", record.get("method"))
            row["method_options"] = options_text
            for key in ("method", "model", "resolution", "device", "seed"):
                value = getattr(entry, key)
                if value is not None:
                    row[key] = value
            row["source"] = source
            row["weights"] = record.get("weights") or summary.get("weights")
            if "weights" not in record and "weights" not in summary and config is not None:
                # a run older than the key: its config's label (read as unknown, a random-weight run's rewards
                # were shown as any other's)
                row["weights"] = weights_label(config)
            row["planned_activation_bytes"] = planned.get("activations")
            row["planned_total_bytes"] = planned.get("total_per_gpu")
            row["run_status"] = status
            row["run_dir"] = dir_text
            row["optimizer_steps"] = steps if steps is not None else optimizer_steps
            rows.append(row)
        if progress is not None:
            progress(f"read run {number}/{len(entries)} {dir_text}: {counted(len(records), 'record')}")
    df = pd.DataFrame(rows)
    if df.empty:
        return df
    for key in ("gpu_name", "n_gpus", "device", "status"):
        if key not in df:
            df[key] = None
    df["hardware"] = [_hardware(g, n, d, s) for g, n, d, s in zip(df["gpu_name"], df["n_gpus"], df["device"],
                                                                    df["source"])]
    check_distinct_run_ids(df)
    check_one_setting_per_row(df, rewards)
    return df


def run_identity(cfg: RunConfig, run_id: str) -> dict:
    """The identity fields every record and the summary of ``run_id`` carry, from its typed config (the device
    where the config names one, not ``auto``): what agg-bench run records (agg_bench.runtime.session.identity)."""
    from ..engine.families import model_label

    out = {"run_id": run_id, "method": cfg.method.name, "model": model_label(cfg.model), "resolution": cfg.model.resolution,
           "seed": cfg.seed, "weights": weights_label(cfg)}
    if cfg.device in ("cpu", "cuda"):
        out["device"] = cfg.device
    return out


def config_identity(written: Mapping, cfg: RunConfig) -> dict:
    """The identity keys (:data:`agg_bench.reading.IDENTITY_KEYS`) a run folder's ``config.json`` (``written``,
    typed as ``cfg``) gives its records and summary (:func:`run_identity`), of those it writes: the method; the
    run id where it names one (else the run's folder name when it ran, which a copied folder no longer has); the
    seed where it holds one; the resolution where its model section does (a key an older file lacks takes today's
    default, which its run may not have had). Not the model's and weights' labels, whose words an older version
    chose otherwise (records before ``weights`` have none); the records and the summary agree on them among
    themselves. Nor the device: a run may be resumed on another device of the same kind."""
    identity = run_identity(cfg, cfg.run_id or "")
    model = written.get("model")
    keys = ["method", *(["run_id"] if written.get("run_id") is not None else []), *(["seed"] if "seed" in written else []),
            *(["resolution"] if isinstance(model, dict) and "resolution" in model else [])]
    return {key: identity[key] for key in keys}


# what puts two runs' records in one table row as the same seed
SAME_RUN_KEYS = ("run_id", "method", "model", "resolution", "hardware", "source", "seed")


def check_distinct_run_ids(records: pd.DataFrame) -> None:
    """A UserError naming two run folders whose records carry the same run id in the same table row and seed
    (:data:`SAME_RUN_KEYS`): a copy of a run folder, whose records would count twice in that row's times while
    its ``seeds`` and ``iterations`` counted them once. A repeat of a run is told apart by its own run id."""
    if "run_id" not in records:
        return
    keys = [records[key] if key in records else pd.Series(None, index=records.index) for key in SAME_RUN_KEYS]
    first: dict[tuple, str] = {}
    for key, run_dir in zip(zip(*keys), records["run_dir"]):
        if key[0] is None or (isinstance(key[0], float) and math.isnan(key[0])):  # no run id: nothing to compare
            continue
        key = tuple(None if isinstance(v, float) and math.isnan(v) else v for v in key)
        seen = first.setdefault(key, run_dir)
        if seen != run_dir:
            raise UserError(f"run {quote(run_dir)} has run_id {quote(key[0])}, as run {quote(seen)} has, with the same "
                            f"method, model, resolution, hardware and seed; expected each run once (a copied run "
                            "folder counts its records twice; a repeat takes its own run_id: --set run_id=NAME)")


# columns that identify a row of the efficiency table; its runs are averaged as seeds (without a manifest, a run's
# method label is its method's name)
ROW_KEYS = ["method", "model", "resolution", "hardware", "source"]


def check_one_setting_per_row(records: pd.DataFrame, rewards: Mapping[str, str]) -> None:
    """A UserError naming two run folders of one table row (:data:`ROW_KEYS`) with other method options or another
    reward (``rewards``: run folder -> its config's reward section, JSON; a run without a config is not compared):
    the row's means would mix two settings' times, or two rewards' scales, under a ``seeds`` count of neither."""
    first: dict[tuple, tuple[str, str, str | None]] = {}
    columns = [records[key] for key in ROW_KEYS]
    for *values, run_dir, options in zip(*columns, records["run_dir"], records["method_options"]):
        key = tuple(None if isinstance(v, float) and math.isnan(v) else v for v in values)
        reward = rewards.get(run_dir)
        seen_dir, seen_options, seen_reward = first.setdefault(key, (run_dir, options, reward))
        what = ("method options", seen_options, options) if options != seen_options else \
            ("reward", seen_reward, reward) if None not in (reward, seen_reward) and reward != seen_reward else None
        if what is not None:
            raise UserError(f"runs {quote(seen_dir)} and {quote(run_dir)} share the table row of method {quote(key[0])} "
                            f"with {what[0]} {what[1]} and {what[2]}; expected the runs of one row to differ only in "
                            "their seed (a manifest gives each setting its own method label)")


def _hardware(gpu_name, n_gpus, device, source=None) -> str:
    """"NVIDIA H200", "8x NVIDIA H200", or the device label when no GPU is named; a reference run's with
    " (reference)" after it."""
    if isinstance(gpu_name, str) and gpu_name:
        n = int(n_gpus) if is_number(n_gpus) else 1
        name = gpu_name if n <= 1 else f"{n}x {gpu_name}"
    else:
        name = str(device) if isinstance(device, str) and device else "unknown"
    return f"{name} (reference)" if source == "reference" else name


def is_number(value) -> TypeGuard[float]:
    """A finite int or float (numpy's included), not a bool: :func:`agg_bench.records.is_finite_number`."""
    return is_finite_number(value)


def load_gradcheck(entries: Iterable[GradcheckEntry]) -> pd.DataFrame:
    """All gradcheck rows, ``model`` and ``resolution`` the entry's (the CSV's own where the entry names none:
    gradcheck writes the model label a run of the snapshot's config records, so the rows match that run's). Each file is read
    by :func:`parse_table`: a table with a ``method`` and a ``cosine_to_full`` column (and a ``model`` column, no cell
    empty, where the entry names no model), every column the report
    reads holding what ``agg-bench gradcheck`` writes there (``GRADCHECK_CELLS``); anything else, or a file
    given twice, is a UserError naming the file. A text cell's leading single quote, which gradcheck writes before
    a text a spreadsheet would run as a formula, is dropped (``quoted``). A CSV written before an option column of
    :data:`~agg_bench.records.GRADCHECK_OPTION_DEFAULTS` existed gets it, holding the default for its method's
    rows and nothing for the others."""
    frames = []
    seen: dict[Path, Path] = {}
    for entry in entries:
        path = Path(entry.file)
        check_path(path, "gradcheck", "a gradcheck CSV")
        first = seen.setdefault(path.resolve(), path)
        if first is not path:  # its rows would stand twice in the ablation table and match no run row
            raise UserError(f"gradcheck {quote(str(path))} is also given as {quote(str(first))} (the same file); "
                            "expected each gradcheck CSV once")
        # without a manifest's label, the one gradcheck wrote in every row: the model label the snapshot's run
        # records (a CSV without it matched no run, and the report's note named its model "nan")
        own_model = entry.model is None
        df = parse_table(path, f"gradcheck {path}", GRADCHECK_REQUIRED,
                         {**GRADCHECK_CELLS, **({"model": GRADCHECK_MODEL} if own_model else {})},
                         "the table agg-bench gradcheck writes", quoted=True)
        if own_model and "model" not in df:
            raise UserError(f"gradcheck {path}: no column 'model' (expected the table agg-bench gradcheck writes, whose "
                            "model column names the model of its rows, or a manifest's gradcheck entry naming it)")
        if not own_model:
            df["model"] = entry.model
        if entry.resolution is not None or "resolution" not in df:
            # a CSV given without a manifest's labels keeps the resolution gradcheck wrote into it
            df["resolution"] = entry.resolution
        for (method, column), default in GRADCHECK_OPTION_DEFAULTS.items():
            if column not in df:  # written before the option existed: its method's rows ran with the default
                df[column] = [default if name == method else None for name in df["method"]]
        frames.append(df)
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()

def as_bool(value) -> bool | None:
    """A flag as a CSV or JSON may hold it (True, "true", 1) as a bool; None when it is none."""
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    if isinstance(value, str):
        return {"true": True, "false": False}.get(value.strip().lower())
    if is_number(value):
        return bool(value)
    return None



# The columns the plots read from each written table, and the columns of each that hold text (labels; read
# as text even where a label looks like a number).
PLOT_COLUMNS = {
    "records": ("run_dir", "iteration", "status", "reward_mean", "reward_std", "t_iter_s", "method", "model",
                "resolution", "hardware", "source"),
    "efficiency": ("method", "model", "resolution", "hardware", "source", "status", "time_basis", "t_rollout_s",
                   "t_reward_s", "t_train_s", "t_iter_s", "t_iter_p25_s", "t_iter_p75_s", "peak_alloc_mib",
                   "saved_act_mib", "backward", "grad_cosine", "train_speedup", "train_speedup_lo",
                   "train_speedup_hi"),
    "ablation": ("model", "resolution", "method", "window", "alpha", "route_frac", "reuse_rollout_velocity",
                 "cosine_to_full"),
}
TEXT_COLUMNS = (*TEXT_KEYS, "method_name", "method_options", "hardware", "run_status", "run_dir", "time_basis",
                "train_speedup_basis", "prediction_check", "family", "alpha", "endpoint_velocity", "cache")


# the text of a number in a CSV cell (decimal, optionally with an exponent), and of an integer
NUMBER_TEXT = re.compile(r"[+-]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?", re.ASCII)
INTEGER_TEXT = re.compile(r"[+-]?[0-9]+", re.ASCII)


@dataclass(frozen=True)
class Cell:
    """What a column of a CSV the report reads holds in each non-empty cell: ``number``, a finite number
    (at least ``least``, more than it with ``above``, at most ``most``; a whole one with ``integer``);
    ``flag``, true or false; ``text``, any text. ``required``: no cell is empty. ``undefined``: texts the
    writer puts for a value that is not defined (read as empty cells)."""

    kind: str = "number"
    least: float | None = None
    above: bool = False
    most: float | None = None
    integer: bool = False
    required: bool = False
    undefined: tuple[str, ...] = ()

    @property
    def words(self) -> str:
        if self.kind == "flag":
            words = "True or False"
        elif self.kind == "text":
            words = "a text that is not empty" if self.required else "a text"
        else:
            words = "an integer" if self.integer else "a finite number"
            bounds = ([f"{'>' if self.above else '>='} {self.least:g}"] if self.least is not None else []) + \
                ([f"<= {self.most:g}"] if self.most is not None else [])
            words = " ".join([words, " and ".join(bounds)]) if bounds else words
        return words if self.required else f"{words}, or an empty cell"

    def value(self, text):
        """The value of a cell whose text is ``text`` (NaN for an empty cell): a float, a bool, the text, or
        None for an empty cell; a ValueError when it is not what this column holds."""
        if not isinstance(text, str) or text in self.undefined:
            if self.required:
                raise ValueError(text)
            return None
        if self.kind == "text":
            return text
        if self.kind == "flag":
            flag = as_bool(text)
            if flag is None:
                raise ValueError(text)
            return flag
        if not NUMBER_TEXT.fullmatch(text):  # "abc", "inf", "nan", "1_000", " 1"
            raise ValueError(text)
        number = float(text)
        if not math.isfinite(number) or (self.integer and not number.is_integer()) or \
                (self.least is not None and (number <= self.least if self.above else number < self.least)) or \
                (self.most is not None and number > self.most):
            raise ValueError(text)
        return number


def parse_table(source: str | Path | IO[str] | IO[bytes], where: str | Path, columns: Iterable[str] = (),
                cells: Mapping[str, Cell] | None = None,
                expected: str = "the table agg-bench report --tables writes", quoted: bool = False) -> pd.DataFrame:
    """A table CSV as :func:`agg_bench.results.formatting.table_csv` writes it: an empty cell is NaN (and
    nothing else is: a label "NA" stays text), ``TEXT_COLUMNS`` are text; with ``quoted`` (a table the report
    wrote) a text cell's leading single quote, which the writer puts before a text a spreadsheet would run as a
    formula (:func:`~agg_bench.results.formatting.csv_cell`), is dropped. A file that is not such a CSV,
    lacks one of ``columns``, or holds in a column of ``cells`` a cell that is not what its :class:`Cell`
    allows (text in a number column, NaN or an infinity, a value out of bounds), is a UserError naming
    ``where``, the row, the column and the value (``expected``: what the file should be); so is a file whose
    last line has no newline (cut), a header naming a column twice, or a row of more or fewer cells than the header
    names columns (:func:`_uneven_row`: pandas reads one of fewer as if its last cells were empty)."""
    cells = cells or {}
    try:
        data = Path(source).read_bytes() if isinstance(source, (str, Path)) else source.read()
    except OSError as err:  # a folder, say
        raise UserError(f"{where}: not a table CSV ({err.strerror or type(err).__name__})") from err
    try:  # the columns of ``cells`` as text, each cell checked and converted here
        with warnings.catch_warnings():
            # index_col=False: a row of more cells than the header is refused, where pandas would read every row
            # of one more as an index column and each cell under the column to its left; it warns of that
            warnings.simplefilter("error", pd.errors.ParserWarning)
            table = pd.read_csv(_stream(data), keep_default_na=False, na_values=[""], low_memory=False,
                                index_col=False,
                                dtype={**dict.fromkeys(TEXT_COLUMNS, str), **dict.fromkeys(cells, str)})
            header = pd.read_csv(_stream(data), header=None, nrows=1, dtype=str, keep_default_na=False)
    except UnicodeDecodeError as err:  # said as every other reader of agg-bench says it
        raise UserError(f"{where}: not a table CSV: not UTF-8 text ({err.reason} at byte {err.start})") from None
    except pd.errors.ParserWarning:
        raise UserError(_uneven_row(data, where, expected) or f"{where}: its rows hold more cells than the header "
                        f"names columns; expected {expected}") from None
    except ValueError as err:  # pandas' parser and empty-data errors
        text = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise UserError(_uneven_row(data, where, expected) or f"{where}: not a table CSV ({text})") from err
    if data and data[-1:] not in (b"\n", "\n"):
        # the writer ends every line: a last line without its end is one cut short (a copy or a write stopped),
        # whose last cell would be read as a shorter number
        raise UserError(f"{where}: the last line ends without a newline (the file is cut); expected {expected}")
    names = [str(name) for name in header.iloc[0]] if len(header) else []
    twice = next((name for i, name in enumerate(names) if name in names[:i]), None)
    if twice is not None:  # pandas would read the second as "NAME.1", a column no reader looks at
        raise UserError(f"{where}: the header names column {twice!r} twice; expected {expected}, each column once")
    uneven = _uneven_row(data, where, expected)  # pandas fills a row of fewer cells with empty ones, unsaid
    if uneven is not None:
        raise UserError(uneven)
    missing = [column for column in columns if column not in table.columns]
    if missing:
        raise UserError(f"{where}: no column {missing[0]!r} (expected {expected})")
    if quoted:  # the text columns (a number or flag cell holds no quote: its check says so)
        for column in table.columns:
            if (column not in cells or cells[column].kind == "text") and \
                    (pd.api.types.is_object_dtype(table[column]) or pd.api.types.is_string_dtype(table[column])):
                table[column] = table[column].map(lambda v: v[1:] if isinstance(v, str) and v.startswith("'") else v)
    for column, cell in cells.items():
        if column in table.columns:
            table[column] = _checked_column(table[column], cell, where, column)
    return table


def _uneven_row(data: bytes | str, where: str | Path, expected: str) -> str | None:
    """The line saying which row of the CSV ``data`` (text pandas read) holds another count of cells than its
    header names columns, by the line it starts on (the header is line 1) and both counts, or None when every row
    holds as many (an empty last cell, written ``a,,``, is a cell; an empty line is no row, as pandas skips it)."""
    text = data.decode("utf-8-sig") if isinstance(data, bytes) else data.removeprefix("\ufeff")
    reader = csv.reader(io.StringIO(text, newline=""))
    # the csv module refuses a cell longer than its field limit (128 KiB), which pandas reads: no cell of the
    # file is longer than the file
    limit = csv.field_size_limit()
    csv.field_size_limit(max(limit, len(text)))
    try:
        width: int | None = None
        line = 1
        for row in reader:
            if row and width is None:
                width = len(row)
            elif row and width is not None and len(row) != width:
                return (f"{where}: line {line} holds {counted(len(row), 'cell')}, "
                        f"{'more' if len(row) > width else 'fewer'} than the {width} columns its header names; "
                        f"expected {expected}")
            line = reader.line_num + 1
    except csv.Error:  # what pandas read, the csv module reads too; left to pandas' own checks where not
        return None
    finally:
        csv.field_size_limit(limit)
    return None


def _stream(data: bytes | str) -> IO[bytes] | IO[str]:
    """A file object reading ``data`` from its start."""
    return io.BytesIO(data) if isinstance(data, bytes) else io.StringIO(data)


def _checked_column(texts: pd.Series, cell: Cell, where: str | Path, column: str) -> pd.Series:
    """The values of a column read as ``texts`` if every cell is what ``cell`` allows, typed as pandas types a
    column of such cells (integers without an empty cell as integers, numbers as floats, flags as bools); else a
    UserError naming the row (1 is the first after the header), the column and the cell's text."""
    values = []
    for row, text in enumerate(texts, 1):
        try:
            values.append(cell.value(text))
        except ValueError:
            what = f"= {quote(text)}:" if isinstance(text, str) else "is empty;"
            raise UserError(f"{where}: row {row}: {column} {what} expected {cell.words}") from None
    if cell.kind == "text":
        return texts
    if None in values:
        values = [float("nan") if v is None else v for v in values]
        return pd.Series(values, index=texts.index, dtype=float if cell.kind == "number" else object)
    if cell.kind == "flag":
        return pd.Series(values, index=texts.index, dtype=bool)
    if all(INTEGER_TEXT.fullmatch(text) for text in texts) and all(abs(v) < 2 ** 53 for v in values):
        return pd.Series(values, index=texts.index, dtype=float).astype("int64")  # as pandas reads integers
    return pd.Series(values, index=texts.index, dtype=float)



# What a gradcheck CSV holds in the columns the report reads (``agg-bench gradcheck`` writes every one; a
# table of some of them is read too): the estimator, its options, the gradient's cosine and relative error
# to ``full`` (``nan``: the writer's word for one not defined, a gradient of norm 0), the passes and seconds
# of the replay. The report's ablation table copies these.
GRADCHECK_REQUIRED = ("method", "cosine_to_full")
# The model label of each row, which a CSV given without a manifest's label for it needs (gradcheck writes it)
GRADCHECK_MODEL = Cell("text", required=True)
GRADCHECK_CELLS = {
    "method": Cell("text", required=True),
    "window": Cell(integer=True, least=1),
    "route_frac": Cell(least=0, most=1),
    "reuse_rollout_velocity": Cell("flag"),
    "cosine_to_full": Cell(least=-1.000001, most=1.000001, undefined=("nan",)),
    "relative_error": Cell(least=0, undefined=("nan",)),
    **{key: Cell(integer=True, least=0) for key in PASS_KEYS},
    "seconds": Cell(least=0, above=True),
    "cache_hit_rate": Cell(least=0, most=1),
}

# What the numbers and flags among PLOT_COLUMNS hold (each table's others are text): finite numbers, the
# counts whole ones; a cell the report did not fill is empty.
PLOT_CELLS = {
    name: {column: Cell("flag") if column == "reuse_rollout_velocity" else
           Cell(integer=True) if column in ("resolution", "window") else
           Cell(integer=True, least=0) if column == "iteration" else Cell()
           for column in columns if column not in TEXT_COLUMNS and column not in ("status", "source")}
    for name, columns in PLOT_COLUMNS.items()
}


def load_tables(folder: str | Path) -> dict[str, pd.DataFrame]:
    """The tables the plots read (``PLOT_TABLES``) from ``folder``, as an earlier ``agg-bench report --tables
    folder`` wrote them: each with the columns of ``PLOT_COLUMNS``, their numbers and flags as ``PLOT_CELLS``
    says (:func:`parse_table`)."""
    return load_tables_and_digest(folder)[0]


def load_tables_and_digest(folder: str | Path) -> tuple[dict[str, pd.DataFrame], str]:
    """:func:`load_tables`, and the :func:`tables_digest` of the very bytes read (a report replacing the folder
    meanwhile cannot give the plots a stamp of tables they were not drawn from)."""
    check_path(folder, "--tables-in", "the folder of tables that agg-bench report --tables DIR writes", folder=True)
    tables, texts = {}, {}
    for name in PLOT_TABLES:
        path = Path(folder) / f"{name}.csv"
        if not path.is_file():
            raise UserError(f"--tables-in {shown(folder)}: no {name}.csv (agg-bench report --tables {shown(folder)} "
                            "writes it)")
        texts[name] = path.read_bytes()
        tables[name] = parse_table(io.BytesIO(texts[name]), path, PLOT_COLUMNS[name], PLOT_CELLS[name], quoted=True)
    return tables, tables_digest(texts)


# ----- the stamp of a report's folders ---------------------------------------------------------------------------
def tables_digest(texts: Mapping[str, bytes]) -> str:
    """A SHA-256 of the bytes of the tables the plots are drawn from (``PLOT_TABLES``, ``{name: CSV bytes}``)."""
    digest = hashlib.sha256()
    for name in PLOT_TABLES:
        digest.update(f"{name}.csv {len(texts[name])}\n".encode())
        digest.update(texts[name])
    return digest.hexdigest()


def folder_tables_digest(folder: Path) -> str | None:
    """:func:`tables_digest` of the table CSVs in ``folder``; None when one is missing."""
    paths = {name: folder / f"{name}.csv" for name in PLOT_TABLES}
    if not all(path.is_file() for path in paths.values()):
        return None
    return tables_digest({name: path.read_bytes() for name, path in paths.items()})


def read_stamp(folder: Path) -> dict | None:
    """The :data:`~agg_bench.outputs.STAMP_FILE` of a report's folder, or None where it has none that reads."""
    try:
        stamp = read_json_object(folder / STAMP_FILE, "a report's stamp")
    except UserError:
        return None
    return stamp if set(stamp) == set(STAMP_KEYS) else None


def check_report(tables_dir: str | Path, plots_dir: str | Path | None = None,
                 manifest: Manifest | None = None) -> None:
    """A UserError, one line, unless the report in ``tables_dir`` (and ``plots_dir``) is one whole report: the
    tables' stamp names the tables beside it, the plots' stamp is the tables' (drawn from those tables), and,
    given ``manifest``, the tables were made from what it lists. Reads only."""
    tables_dir = Path(tables_dir)
    check_path(tables_dir, "--tables", "the folder of tables that agg-bench report --tables DIR writes", folder=True)
    stamp = read_stamp(tables_dir)
    if stamp is None:
        raise UserError(f"--tables {shown(tables_dir)}: no {STAMP_FILE} that names its tables (not a whole report, or "
                        "of an earlier version); run agg-bench report again")
    if stamp["tables"] != folder_tables_digest(tables_dir):
        raise UserError(f"--tables {shown(tables_dir)}: its tables are not the ones its {STAMP_FILE} names (one of "
                        f"{', '.join(f'{name}.csv' for name in PLOT_TABLES)} edited, replaced or missing since the "
                        "report wrote them); run agg-bench report again")
    if plots_dir is not None:
        plots_dir = Path(plots_dir)
        check_path(plots_dir, "--plots", "the folder of plots that agg-bench report --plots DIR writes", folder=True)
        if read_stamp(plots_dir) != stamp:
            raise UserError(f"--plots {shown(plots_dir)}: not drawn from the tables in {shown(tables_dir)} (its "
                            f"{STAMP_FILE} differs: a report stopped between the two folders, or another report's); "
                            "run agg-bench report again")
    if manifest is not None and stamp["manifest"] != manifest.digest():
        raise UserError(f"--tables {shown(tables_dir)}: not made from what manifest {shown(str(manifest.file))} lists "
                        f"(its {STAMP_FILE} names another manifest); run agg-bench report again")
