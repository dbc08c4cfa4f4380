"""Calibrations in a cell job's process: the methods a cell just ran, timed on the model it built once.

A cell job (``agg-bench cell JOBS.json``, :mod:`agg_bench.runtime.cell`) may list, beside its runs, the
calibrations to take once they have ended: ``{"runs": [...], "calibrations": [ENTRY, ...]}`` (``runs`` may then
be empty). Each entry is what one ``agg-bench calibrate --config C --set ... --method L OVERRIDES ... --out OUT``
measures, and writes the same file (:func:`agg_bench.tools.calibrate.write_calibration`), in the cell's own
process: the model the runs built is the calibration's too (:mod:`agg_bench.runtime.model_reuse`), and no second
process imports torch and builds the model again (tens of seconds of a GPU window for a full-size model, most
of a tiny model's calibration on a CPU). A campaign window gives each cell process its calibrations this way
(:mod:`agg_bench.tools.campaign`).

An entry is an object with the keys

- ``config`` (a run config file or null) and ``set`` (``KEY=VALUE`` strings): the calibration's run config;
- ``methods``: label -> run-config overrides naming the method, in order (the first is the baseline, ``full``);
- ``options`` (optional): ``repeats``, ``warmup``, ``method_repeats`` (:class:`~agg_bench.tools.calibrate.
  CalibrationConfig`);
- ``out``: the calibration file; ``report``: a file the cell writes once it has taken or left the entry
  (:data:`REPORT_KEYS`: ``out``, the ``methods`` timed, ``exit_code``, how it ``ended``, its ``seconds``);
- ``runs`` (optional): label -> the folder of that method's run. A method whose run is one of this job's and
  did not end ``ok`` is not timed (it would fail, or time a run that is not in the results); an entry left
  without its baseline, or with its baseline alone where it had others, is not started. The runs' records
  also estimate the calibration's time (below);
- ``per_method_s`` (optional): seconds per method that earlier calibrations of the cell took.

With the cell's ``--deadline`` an entry is not started when its estimate would end after it: ``per_method_s``
(or the most seconds per method of this process's calibrations so far, whichever is more) times its methods;
else, when every method has a run folder with iteration times, :data:`CALIBRATION_OVERHEAD` x (warm-up + timed
rounds) x the sum of the methods' rollout and train phases (medians after the first iteration): the rounds
that the calibration runs; else it is started. Once one entry is not started for its estimate, or the deadline
has passed, the entries after it are not started either. A calibration that fails or is interrupted writes no
file (its report says how it ended); a signal stops the cell after that entry's report.

Every entry is read and checked (its config loaded and checked, every method checked as a run would check it,
the files apart from one another, from the runs' folders and markers and from the job's journal, each in a
folder where a file can be written) before the first run starts: a bad entry is one line naming it, exit code
2, nothing written.
"""
from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Sequence

from ..errors import UserError, quote, run_command, shown
from ..io import read_jsonl, write_json
from ..jsonfiles import JsonFileError, json_type, read_json_object
from ..outdir import check_file, check_path_names, check_suffix, check_writable, json_file_where, json_file_with
from ..records import MAX_LABEL, is_finite_number, is_label, unprintable_words
from ..runtime.cell import SEVERITY, Journal, read_job_file

if TYPE_CHECKING:  # the calibration itself imports torch: only when a cell reads its entries
    from .calibrate import CalibrationConfig

ENTRY_KEYS = ("config", "set", "methods", "options", "out", "report", "runs", "per_method_s")
OPTION_KEYS = ("repeats", "warmup", "method_repeats")
REPORT_KEYS = ("out", "methods", "exit_code", "ended", "seconds")
MAX_CALIBRATIONS = 256
# a calibration's seconds over its rounds' (the runs' rollout and train phase, warm-up included): the unit costs'
# passes and the model's build; one H200 window: 153 s for SD3.5-M at 1024 px, whose runs' rounds give 124 s
CALIBRATION_OVERHEAD = 1.25
FINISHED = "finished"
NOT_TIMED = "not started: its methods' runs did not end ok"  # a campaign's window log leaves such entries out

# whether a file is a calibration's report (REPORT_KEYS), which the cell may replace; or a calibration, which
# write_calibration replaces
def _report_shape(data: dict) -> bool:
    return set(data) == set(REPORT_KEYS)


is_report = json_file_where(_report_shape)
is_calibration = json_file_with("unit_s_per_sample")


@dataclass(frozen=True)
class CellCalibration:
    """One calibration of a cell job, read and checked."""

    cfg: Any  # the run config
    methods: dict[str, Any]  # label -> overrides, the baseline first
    options: CalibrationConfig
    out: Path
    report: Path
    runs: dict[str, Path]
    per_method_s: float | None


def _where(path: Path, index: int) -> str:
    return f"{path}: calibrations[{index}]"


def _number(value: Any) -> bool:
    return is_finite_number(value) and value >= 0


def _entry(path: Path, index: int, entry: Any) -> CellCalibration:
    from ..config import load_config
    from ..runtime.config_check import check_config
    from .calibrate import CalibrationConfig, check_method, method_overrides

    where = _where(path, index)
    if not isinstance(entry, dict):
        raise UserError(f"{where} is {json_type(entry)}; expected an object with keys {', '.join(ENTRY_KEYS)}")
    unknown = [key for key in entry if key not in ENTRY_KEYS]
    if unknown:
        raise UserError(f"{where}: unknown key {unknown[0]!r} (allowed in a calibration: {', '.join(ENTRY_KEYS)})")
    config, overrides = entry.get("config"), entry.get("set", [])
    # an empty path is refused by check_path_names below, in the words of every path's refusal (a test of its
    # truth here said that '' "is a string")
    if config is not None and not isinstance(config, str):
        raise UserError(f"{where}.config is {json_type(config)}; expected a run config file or null")
    if not isinstance(overrides, list):
        raise UserError(f"{where}.set is {json_type(overrides)}; expected a list of KEY=VALUE strings")
    for number, item in enumerate(overrides):  # "set is a list; expected a list" named no item
        if not isinstance(item, str):
            raise UserError(f"{where}.set[{number}] is {json_type(item)}; expected a KEY=VALUE string")
    for key in ("out", "report"):
        if not isinstance(entry.get(key), str):
            raise UserError(f"{where}.{key} is {json_type(entry.get(key))}; expected a file")
    methods = entry.get("methods")
    if not (isinstance(methods, dict) and methods):
        raise UserError(f"{where}.methods is {json_type(methods) if methods != {} else 'an empty object'}; expected "
                        "an object of one or more labels -> run-config overrides naming the method, the baseline first")
    options = entry.get("options", {})
    if not isinstance(options, dict):
        raise UserError(f"{where}.options is {json_type(options)}; expected an object of {', '.join(OPTION_KEYS)}")
    unknown = [key for key in options if key not in OPTION_KEYS]
    if unknown:
        raise UserError(f"{where}.options: unknown key {unknown[0]!r} (allowed: {', '.join(OPTION_KEYS)})")
    runs = entry.get("runs", {})
    if not isinstance(runs, dict):
        raise UserError(f"{where}.runs is {json_type(runs)}; expected an object of the methods' labels -> their run "
                        "folders")
    for label, folder in runs.items():
        if label not in methods:
            raise UserError(f"{where}.runs: {label!r} is not one of the methods ({', '.join(map(repr, methods))})")
        if not isinstance(folder, str):
            raise UserError(f"{where}.runs.{label} is {json_type(folder)}; expected the method's run folder")
    check_path_names(where, [("config", config), ("out", entry["out"]), ("report", entry["report"]),
                             *((f"runs.{label}", folder) for label, folder in runs.items())])
    check_suffix(entry["out"], ".json", f"{where}.out")  # as agg-bench calibrate --out
    per = entry.get("per_method_s")
    if per is not None and not _number(per):
        raise UserError(f"{where}.per_method_s is {quote(per)}; expected seconds (a finite number from 0) or null")
    try:
        cfg = check_config(load_config(config, list(overrides)))
        calibration = CalibrationConfig(**options)
        for label, value in methods.items():
            if not is_label(label):
                raise UserError(f"methods: label {label!r}: expected 1 to {MAX_LABEL} printable characters"
                                f"{unprintable_words(label)}")
            check_method(cfg, label, method_overrides(label, value)[1])
    except UserError as err:
        raise UserError(f"{where}: {err}") from None
    return CellCalibration(cfg, dict(methods), calibration, Path(entry["out"]), Path(entry["report"]),
                           {label: Path(folder) for label, folder in runs.items()},
                           float(per) if per is not None else None)


def read_calibrations(path: str | Path, run_folders: list[Path], markers: Sequence[Path | None] = (),
                      data: dict | None = None) -> list[CellCalibration]:
    """The calibrations a job file lists (none without ``calibrations``), each read and checked; their files
    apart from one another, from ``markers`` (each run's ``done`` file or None) and the job's journal, outside
    ``run_folders`` (the job's runs') and holding none of them, each an existing calibration, report or nothing,
    in a folder where a file can be written. A UserError names the entry. ``data``: the file as
    :func:`agg_bench.runtime.cell.read_job_file` read it (None: read it now)."""
    path = Path(path)
    data = read_job_file(path) if data is None else data
    entries = data.get("calibrations", [])
    if not isinstance(entries, list):
        raise UserError(f"{shown(path)}: calibrations is {json_type(entries)}; expected a list of calibrations")
    if len(entries) > MAX_CALIBRATIONS:
        raise UserError(f"{shown(path)}: calibrations lists {len(entries):,}; expected at most {MAX_CALIBRATIONS}")
    out = [_entry(path, index, entry) for index, entry in enumerate(entries)]
    folders = {folder.resolve() for folder in run_folders}
    seen: dict[Path, str] = {Journal.path_of(path).resolve(): f"the job's journal {Journal.path_of(path)}"}
    seen.update((marker.resolve(), f"{path}: runs[{index}].done") for index, marker in enumerate(markers)
                if marker is not None)
    for index, item in enumerate(out):
        for key, file in (("out", item.out), ("report", item.report)):
            where = f"{_where(path, index)}.{key} {file}"
            resolved = file.resolve()
            if resolved in seen:
                raise UserError(f"{where} is also {seen[resolved]}; expected a file of its own")
            if folders & {resolved, *resolved.parents}:
                raise UserError(f"{where} is inside a run folder of the job; expected a file outside every run folder")
            if any(resolved in folder.parents for folder in folders):
                raise UserError(f"{where}: a run folder of the job is inside it; expected a file outside every run "
                                "folder")
            seen[resolved] = f"{_where(path, index)}.{key}"
        check_file(item.out, is_calibration, "a calibration", f"{_where(path, index)}.out")
        check_file(item.report, is_report, "a calibration's report", f"{_where(path, index)}.report")
        # written once the runs have ended: a place where no file can be made, refused before them
        check_writable(item.out, f"{_where(path, index)}.out")
        check_writable(item.report, f"{_where(path, index)}.report")
    return out


def round_seconds(folder: Path) -> float | None:
    """A run's rollout and train phase per iteration: the median over its iterations after the first (a
    warm-up), from its ``metrics.jsonl``; None when the folder has no such times."""
    try:
        records = list(read_jsonl(folder / "metrics.jsonl"))[1:]
    except (UserError, OSError):
        return None
    times = sorted(r["t_rollout_s"] + r["t_train_s"] for r in records
                   if _number(r.get("t_rollout_s")) and _number(r.get("t_train_s")))
    return times[len(times) // 2] if times else None


def estimate(runs: dict[str, Path], rounds: int, labels: list[str], per_method_s: float | None) -> float | None:
    """About how long a calibration of ``rounds`` warm-up and timed rounds takes to time ``labels`` (the module
    docstring): ``per_method_s`` times their number, else what their runs (``runs``: label -> run folder) say,
    else None."""
    if per_method_s is not None:
        return per_method_s * len(labels)
    total = 0.0
    for label in labels:
        folder = runs.get(label)
        seconds = round_seconds(folder) if folder is not None else None
        if seconds is None:
            return None
        total += seconds
    return CALIBRATION_OVERHEAD * rounds * total


def _write(item: CellCalibration, labels: list[str]) -> None:
    from .calibrate import write_calibration

    write_calibration(item.cfg, item.out, item.options, {label: item.methods[label] for label in labels})


def run_calibrations(items: list[CellCalibration], run_folders: list[Path], ended: dict[Path, str],
                     deadline: float | None, argv: list[str],
                     measure: Callable[[CellCalibration, list[str]], None] = _write) -> int:
    """Take ``items`` in order after the job's runs (``run_folders``; ``ended``: each one's end in this attempt,
    none for a run not started), each through ``measure`` (:func:`agg_bench.tools.calibrate.write_calibration`)
    unless the module docstring says it is not started, and write each one's report; the worst exit code (a
    signal's 128 + N at once, after the report of the entry it stopped)."""
    ends = {folder.resolve(): status for folder, status in ended.items()}
    ours = {folder.resolve() for folder in run_folders}

    def timed(label: str, item: CellCalibration) -> bool:  # not a run of this job that did not end ok
        folder = item.runs[label].resolve() if label in item.runs else None
        return folder not in ours or ends.get(folder) == "ok"

    worst, per, stop = 0, None, None
    for number, item in enumerate(items, 1):
        labels = [label for label in item.methods if timed(label, item)]
        first = next(iter(item.methods))
        known = max([s for s in (item.per_method_s, per) if s is not None], default=None)
        expected = estimate(item.runs, item.options.method_rounds, labels, known)
        code, seconds = None, 0.0
        if first not in labels or (len(labels) == 1 < len(item.methods)):
            how = NOT_TIMED
        elif stop is not None:
            how = stop
        elif deadline is not None and time.time() >= deadline:
            how = stop = "not started: the deadline had passed"
        elif deadline is not None and expected is not None and time.time() + expected > deadline:
            how = stop = f"not started: about {expected:.0f} s, more than the time left before the deadline"
        else:
            print(f"agg-bench cell: calibration {number}/{len(items)} of {', '.join(labels)} started",
                  file=sys.stderr, flush=True)

            def body(item: CellCalibration = item, labels: list[str] = labels) -> int:
                measure(item, labels)
                return 0

            began = time.perf_counter()
            code = run_command(f"agg-bench cell: calibration {shown(item.out)}", body, argv, item.out)
            seconds = round(time.perf_counter() - began, 1)
            how = FINISHED if code == 0 and item.out.is_file() else ("interrupted" if code >= 128 else "failed")
            if how == FINISHED and labels:
                per = max(per or 0.0, seconds / len(labels))
            worst = code if code >= 128 else max(worst, code, key=SEVERITY.__getitem__)
        write_json(item.report, {"out": str(item.out), "methods": labels, "exit_code": code, "ended": how,
                                 "seconds": seconds})
        print(f"agg-bench cell: calibration {number}/{len(items)} {shown(item.out)}: {how} ({seconds} s)",
              file=sys.stderr, flush=True)
        if code is not None and code >= 128:
            return code
    return worst


def read_report(path: Path) -> dict | None:
    """A calibration's report as the cell wrote it, or None when there is none (the entry was never reached)."""
    if not path.is_file():
        return None
    try:
        data = read_json_object(path, "a calibration's report")
    except JsonFileError:
        return None
    return data if _report_shape(data) else None
