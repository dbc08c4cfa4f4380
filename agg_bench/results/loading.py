"""What the report reads: the manifest, run folders (every record with the labels the tables group by),
gradcheck CSVs and calibrations; and, for the plots, the tables it wrote (:func:`load_tables`). Every input
is checked as it is read; anything that is not what the command that wrote it writes is a UserError naming
the file and the key.

The workflow passes a manifest (JSON) that names every run with its sweep labels; without one, labels
come from the records themselves (:func:`discover_runs`).
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Iterable, TypeGuard

import numpy as np
import pandas as pd

from ..errors import ConfigError, UserError, quote
from ..jsonfiles import read_json_object
from ..reading import RunFolder
from ..records import PLOT_TABLES, TEXT_KEYS


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


def check_time_basis(value, key: str = "report.time") -> str:
    """``value`` if it is one of ``TIME_BASES``; else a UserError naming ``key``."""
    if not isinstance(value, str) or value not in TIME_BASES:
        raise UserError(f"{key} = {value!r}: expected one of {', '.join(TIME_BASES)}")
    return value


def check_warmup(value, key: str = "report.warmup") -> int:
    """``value`` if it is an integer >= 0 (iterations left out of the timings); else a ConfigError naming ``key``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(key, value, "an integer >= 0 (iterations of each run left out of the timings)")
    return value


def _is_integer(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


# what a value of a report input holds: (test, words for the error)
TEXT = (lambda v: isinstance(v, str), "a string")
INTEGER = (_is_integer, "an integer")
NUMBER = (lambda v: is_number(v) or (isinstance(v, float) and math.isnan(v)), "a number")
OBJECT = (lambda v: isinstance(v, dict), "an object")
SOURCE = (lambda v: v in ENTRY_SOURCES, f"one of {', '.join(ENTRY_SOURCES)}")
# manifest section -> (its entry class, the key every entry needs, the keys an entry may have)
MANIFEST_SECTIONS = {
    "runs": (RunEntry, "dir", {"dir": TEXT, "method": TEXT, "model": TEXT, "resolution": INTEGER, "device": TEXT,
                               "seed": INTEGER, "method_options": OBJECT, "source": SOURCE}),
    "gradcheck": (GradcheckEntry, "file", {"file": TEXT, "model": TEXT, "resolution": INTEGER}),
    "calibration": (CalibrationEntry, "file", {"file": TEXT, "model": TEXT, "resolution": INTEGER, "device": TEXT,
                                               "source": SOURCE}),
}


def _check(where: str, value, kind: tuple, nullable: bool = True) -> None:
    """A UserError naming ``where`` unless ``value`` is of ``kind`` (or None, when ``nullable``)."""
    test, words = kind
    if not (test(value) or (nullable and value is None)):
        raise UserError(f"{where} = {quote(value)}: expected {words}{' or null' if nullable else ''}")


def load_manifest(path: str | Path) -> Manifest:
    """Read the workflow's manifest: ``{"runs": [...], "gradcheck": [...], "calibration": [...],
    "warmup": 1, "time": "auto"}`` (each entry an object; see ``MANIFEST_SECTIONS``). Anything else is a
    UserError naming the manifest and the key."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"manifest {path}: no such file")
    data = read_json_object(path, "a report manifest (an object with runs, gradcheck, calibration, warmup, time)")
    unknown = sorted(set(data) - {*MANIFEST_SECTIONS, "warmup", "time"})
    if unknown:
        raise UserError(f"manifest {path}: unknown key {unknown[0]!r}; expected some of "
                        f"{', '.join([*MANIFEST_SECTIONS, 'warmup', 'time'])}")
    sections: dict[str, list] = {}
    for section, (entry_class, required, keys) in MANIFEST_SECTIONS.items():
        entries = data.get(section, [])
        _check(f"manifest {path}: {section}", entries, (lambda v: isinstance(v, list), "a list"))
        sections[section] = []
        for i, entry in enumerate(entries or []):
            where = f"manifest {path}: {section}[{i}]"
            _check(where, entry, OBJECT, nullable=False)
            if required not in entry:
                raise UserError(f"{where}: missing {required!r}")
            for key, value in entry.items():
                if key not in keys:
                    raise UserError(f"{where}: unknown key {key!r}; expected some of {', '.join(keys)}")
                _check(f"{where}.{key}", value, keys[key], nullable=key != required)
            sections[section].append(entry_class(**{**entry, required: Path(entry[required])}))
    warmup = check_warmup(data.get("warmup", 1), f"manifest {path}: warmup")
    return Manifest(sections["runs"], sections["gradcheck"], warmup,
                    check_time_basis(data.get("time", "auto"), f"manifest {path}: time"), sections["calibration"])


def load_calibration(entries: Iterable[CalibrationEntry]) -> pd.DataFrame:
    """One row per calibration file: model, resolution, device labels and the unit costs as columns
    ``unit_<basis>_<kind>`` (seconds per sample, per optimizer step for ``optimizer_step``) and, where the
    file has them, ``call_<basis>_<kind>`` and ``latent_<basis>_<kind>`` (a call of n latents costs
    call + latent * n seconds); ``methods``, the side-by-side timings. A file that is not what
    ``agg-bench calibrate`` writes is a UserError naming it and the key."""
    rows = []
    for entry in entries:
        path = Path(entry.file)
        data = read_json_object(path, "an agg-bench calibrate JSON")
        where = f"calibration {path}"
        for key, kind in (("model", TEXT), ("resolution", INTEGER), ("device", TEXT),
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
                _check(f"{where}: unit_s_per_sample.{kind}.{basis}.median", values.get("median"), NUMBER)
                row[f"unit_{basis}_{kind}"] = values.get("median")
        for kind, by_basis in (data.get("unit_s_per_call") or {}).items():
            _check(f"{where}: unit_s_per_call.{kind}", by_basis, OBJECT, nullable=False)
            for basis in ("cpu", "wall"):
                values = by_basis.get(basis)
                _check(f"{where}: unit_s_per_call.{kind}.{basis}", values, OBJECT, nullable=False)
                for part in ("call", "latent"):
                    _check(f"{where}: unit_s_per_call.{kind}.{basis}.{part}", values.get(part), NUMBER)
                    row[f"{part}_{basis}_{kind}"] = values.get(part)
        # method label -> its train phase's and its rollout's seconds per round, timed side by side
        # ({basis}_s and rollout_{basis}_s lists), and its rollout's counted forwards per sample
        for label, timed in (data.get("methods") or {}).items():
            _check(f"{where}: methods.{label}", timed, OBJECT, nullable=False)
            for key in (f"{phase}{basis}_s" for phase in ("", "rollout_") for basis in TIME_BASES):
                _check(f"{where}: methods.{label}.{key}", timed.get(key),
                       (lambda v: isinstance(v, list) and all(NUMBER[0](x) for x in v), "a list of numbers"))
            _check(f"{where}: methods.{label}.rollout_forwards", timed.get("rollout_forwards"), NUMBER)
            # the passes (latents) and calls of each kind in one timed update and one rollout, and the
            # update's optimizer steps
            for key in ("passes", "calls", "rollout_passes", "rollout_calls"):
                _check(f"{where}: methods.{label}.{key}", timed.get(key),
                       (lambda v: isinstance(v, dict) and all(NUMBER[0](x) for x in v.values()),
                        "an object of numbers"))
            _check(f"{where}: methods.{label}.optimizer_steps", timed.get("optimizer_steps"), NUMBER)
        row["methods"] = data.get("methods") or {}
        rows.append(row)
    return pd.DataFrame(rows)


def discover_runs(paths: Iterable[str | Path]) -> list[RunEntry]:
    """Run folders in ``paths``: each path is a run folder or a folder of run folders."""
    out = []
    for path in map(Path, paths):
        if (path / "summary.json").exists() or (path / "metrics.jsonl").exists():
            out.append(RunEntry(path))
        elif path.is_dir():
            out.extend(RunEntry(p) for p in sorted(path.iterdir())
                       if (p / "summary.json").exists() or (p / "metrics.jsonl").exists())
        else:
            raise UserError(f"--runs {path}: not a run folder or a folder of run folders")
    return out


# Columns load_records adds to every record: its labels and what its run folder says beside the records
# (the summary's status, the plan's bytes, the config's optimizer steps).
ADDED_COLUMNS = ("method_name", "method_options", "source", "weights", "planned_activation_bytes",
                 "planned_total_bytes", "run_status", "run_dir", "optimizer_steps", "hardware")


def load_records(entries: Iterable[RunEntry]) -> pd.DataFrame:
    """One row per iteration record, with the labels the tables group by.

    Added columns: ``method_name`` (the estimator), ``method_options`` (JSON), ``hardware``, ``source``
    (measured | imported), ``run_status`` (the summary's status) and ``run_dir``. A run that wrote no
    record (it failed while starting) still gets one row, with its status and no measurements. Each run
    folder is read by :class:`agg_bench.reading.RunFolder` (its config typed and bounded, its
    records by the record contract).
    """
    rows = []
    for entry in entries:
        run_dir = Path(entry.dir)
        folder = RunFolder(run_dir)  # every file read and checked by the one reader of a run folder
        summary = folder.summary()
        config = folder.config(required=False)
        records = folder.records()
        if not summary and not records:
            raise UserError(f"run {run_dir}: no summary.json or metrics.jsonl")
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
        planned = folder.plan()
        # optimizer steps per iteration, which the cost model prices; unknown without a config
        optimizer_steps = config.train.optimizer_steps if config is not None else None
        for record in records:
            row = dict(record)
            row["method_name"] = options.get("name", record.get("method"))
            row["method_options"] = json.dumps(options, sort_keys=True)
            for key in ("method", "model", "resolution", "device", "seed"):
                value = getattr(entry, key)
                if value is not None:
                    row[key] = value
            row["source"] = source
            row["weights"] = record.get("weights") or summary.get("weights")
            row["planned_activation_bytes"] = planned.get("activations")
            row["planned_total_bytes"] = planned.get("total_per_gpu")
            row["run_status"] = status
            row["run_dir"] = str(run_dir)
            row["optimizer_steps"] = optimizer_steps
            rows.append(row)
    df = pd.DataFrame(rows)
    if df.empty:
        return df
    for key in ("gpu_name", "n_gpus", "device", "status"):
        if key not in df:
            df[key] = None
    df["hardware"] = [_hardware(g, n, d, s) for g, n, d, s in zip(df["gpu_name"], df["n_gpus"], df["device"],
                                                                    df["source"])]
    return df


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
    """A finite int or float (numpy's included), not a bool."""
    return isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool) \
        and math.isfinite(float(value))


def load_gradcheck(entries: Iterable[GradcheckEntry]) -> pd.DataFrame:
    """All gradcheck rows, the model column holding the manifest's label (the family is kept as
    ``family``) and ``resolution`` added."""
    frames = []
    for entry in entries:
        if not Path(entry.file).exists():
            raise UserError(f"gradcheck {entry.file}: no such file")
        df = pd.read_csv(entry.file)
        if "model" in df:
            df = df.rename(columns={"model": "family"})
        df["model"] = entry.model if entry.model is not None else df.get("family", pd.Series([None] * len(df)))
        df["resolution"] = entry.resolution
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


def parse_table(source: str | Path | IO[str], where: str | Path, columns: Iterable[str] = ()) -> pd.DataFrame:
    """A table CSV as :func:`agg_bench.results.formatting.table_csv` writes it: an empty cell is NaN (and
    nothing else is: a label "NA" stays text), ``TEXT_COLUMNS`` are text. A file that is not such a CSV,
    or lacks one of ``columns``, is a UserError naming ``where``."""
    try:
        table = pd.read_csv(source, keep_default_na=False, na_values=[""], low_memory=False,
                            dtype=dict.fromkeys(TEXT_COLUMNS, str))
    except ValueError as err:  # pandas' parser and empty-data errors, and UnicodeDecodeError, are ValueErrors
        raise UserError(f"{where}: not a table CSV ({str(err).splitlines()[0] if str(err) else type(err).__name__})") \
            from err
    missing = [column for column in columns if column not in table.columns]
    if missing:
        raise UserError(f"{where}: no column {missing[0]!r} (expected the table agg-bench report --tables writes)")
    return table


def load_tables(folder: str | Path) -> dict[str, pd.DataFrame]:
    """The tables the plots read (``PLOT_TABLES``) from ``folder``, as an earlier ``agg-bench report --tables
    folder`` wrote them."""
    tables = {}
    for name in PLOT_TABLES:
        path = Path(folder) / f"{name}.csv"
        if not path.is_file():
            raise UserError(f"--tables-in {folder}: no {name}.csv (agg-bench report --tables {folder} writes it)")
        tables[name] = parse_table(path, path, PLOT_COLUMNS[name])
    return tables
