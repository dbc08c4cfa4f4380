"""Training logs of other code bases as reference runs.

``agg-bench import-log`` turns a log in DanceGRPO's JSONL format (one object per optimizer step with
``step``, ``avg_reward``, ``step_time`` and ``grad_norm``) into a run folder shaped like the ones
``agg-bench run`` writes (``metrics.jsonl``, ``summary.json``, ``env.json``). Its records carry
``source: "imported"``, so tables show them beside measured rows and labelled as imported. Fields the
log does not have are ``None`` (not measured), never 0.

Every converted record passes the record contract (:func:`agg_bench.records.record_problem`, what
``report`` and ``learning`` read a run folder by): a value of the wrong kind, a number that is not finite or a
negative time, count, size or norm is one line naming the log line and the key, exit code 2. The one
exception is a run that diverged: Python's ``json.dumps`` writes a NaN reward, loss or
gradient norm as ``NaN`` (an overflow as ``Infinity``), and DanceGRPO goes on logging after it. The first line
holding one ends the import as ``agg-bench run`` ends a run that diverges: its record has status ``diverged``
and the value as null, the summary says ``diverged`` and which value, and the lines after it are left out
(stderr says how many). A time or a count that is not finite is still refused: it does not diverge. Steps are integers from 0 to
:data:`MAX_STEP`, increasing. A last line that has no newline and is not whole JSON is a line still being
written (or cut by a crash): it is left out, and stderr says so.

The log is read, checked and written :data:`CHUNK_LINES` lines at a time into a temporary folder beside the
output, renamed over it once the whole log has passed (a log of a million lines held as records took 2.4 GB): a
refused or stopped import leaves nothing, and its refusal is the one it had when the whole log was read before
anything was written (the log's size, then its text, then its JSON, then its records, and only then the output
folder or the disk).
"""
from __future__ import annotations

import json
import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

from ..errors import ConfigError, Progress, UserError, quote, shown
from ..io import JsonlWriter, atomic_file, path_text, write_json
from ..jsonfiles import JsonProblem, TooLarge, check_path, json_type, loads, read_bounded_lines
from ..outdir import Claim, check_folder, replaced_folders
from ..outputs import IMPORT_CONTENTS
from ..records import (DIVERGING_KEYS, INTEGER_RANGES, MAX_LABEL, NUMBER_KEYS, RECORD_KEYS, REQUIRED_RECORD_KEYS,
                       SIGNED_KEYS, is_finite_number, is_integer, is_label, new_record, record_problem,
                       unprintable_words)

# DanceGRPO key -> metric record key
DANCEGRPO_KEYS = {"step": "iteration", "avg_reward": "reward_mean", "step_time": "t_iter_s",
                  "grad_norm": "grad_norm"}
SOURCE = "imported"
# an import folder holds these and nothing else; an earlier import is replaced, anything else is refused
MAX_LOG_BYTES = 64 * 2**20  # a DanceGRPO log of 100,000 steps is about 15 MB
MAX_STEP = 10**9  # far above any training run (agg-bench's own train.iterations stops at 100,000)
# lines read (checked and written) between two calls of an import's progress (a line on stderr at most every
# PROGRESS_EVERY_S seconds): a log of a million lines took a minute with nothing printed
PROGRESS_LINES = 10_000
# lines read, then checked, then written together (each step over many lines runs faster than the three a line at
# a time): the records an import holds at once, a few MB, where a log of a million lines held as records took 2.4 GB
CHUNK_LINES = 1_000
# the number keys a line holds are checked in this order: the first wrong one is the one a refusal names
_NUMBER_ORDER = {key: index for index, key in enumerate(NUMBER_KEYS)}
# a number within these bounds is finite: taken at a glance (_number_problem), any other tested in full
_PLAIN_NUMBER = 1e300


def _diverged(value: Any) -> bool:
    return isinstance(value, float) and not math.isfinite(value)


def _number_problem(key: str, value: Any, name: str | None = None) -> str | None:
    """What is wrong with ``value`` as the number ``key`` of a record (null: not measured), named ``name``
    in the log (default: ``key``); None when nothing is."""
    if value is None:
        return None
    signed = key in SIGNED_KEYS
    kind = type(value)
    if (kind is float or kind is int) and (-_PLAIN_NUMBER if signed else 0) <= value <= _PLAIN_NUMBER:
        return None
    if not is_finite_number(value) or (not signed and value < 0):
        return f"{name or key!r} = {quote(value)}: expected a finite number{'' if signed else ' >= 0'} or null"
    return None


@dataclass
class Converted:
    """What :func:`convert_records` made of a log, once it has gone through all of it: ``iterations`` records,
    the step of the last with status ``ok``, what ended the run if it diverged, and the lines ``left`` out after
    that."""
    iterations: int = 0
    last_good_iteration: int | None = None
    diverged: str | None = None
    left: int = 0


def convert_records(chunks: Iterable[list[tuple[int, Any]]], identity: dict, where: str = "log",
                    converted: Converted | None = None) -> Iterator[list[dict]]:
    """Metric records for DanceGRPO log lines, made a chunk at a time as :func:`read_log` gives the lines (lists of
    ``(line number, value)`` pairs): a list of records for each; ``identity`` fills run_id, method, model, ... and
    ``converted`` is told what the log held (:class:`Converted`).

    Keys of a line that are already record keys (e.g. ``loss``, ``reward_std``) are kept. Each record is
    checked by the record contract as it is made (module docstring): a UserError names the log line and
    the key (the log's own name for ``step``, ``avg_reward``, ``step_time`` and ``grad_norm``). A line whose
    reward, loss or gradient norm is not finite is the last record, with status ``diverged`` (module
    docstring); the lines after it are not converted. Either way the rest of ``chunks`` is gone through before
    the generator ends or raises: a refusal of the lines themselves (:func:`read_log`) comes first, as it did
    when the whole log was read before its records were made."""
    converted = Converted() if converted is None else converted
    chunks = iter(chunks)
    # the line's other record keys are kept; the identity, step, status and the DanceGRPO numbers are set below
    kept_keys = frozenset(RECORD_KEYS) - {*identity, *DANCEGRPO_KEYS.values(), "status"}
    last_step = None
    try:
        for chunk in chunks:
            records = []
            for index, (n, line) in enumerate(chunk):
                record, diverged = _record(line, f"{where} line {n}", last_step, identity, kept_keys)
                records.append(record)
                if diverged is not None:  # as agg-bench run's summary says it
                    converted.iterations += len(records)
                    converted.last_good_iteration = last_step  # the step before, if any
                    converted.diverged = f"non-finite {diverged} at iteration {record['iteration']}"
                    yield records
                    converted.left = len(chunk) - index - 1 + sum(len(rest) for rest in chunks)
                    return
                last_step = record["iteration"]
            converted.iterations += len(records)
            converted.last_good_iteration = last_step
            yield records
    except UserError:
        for _ in chunks:  # a refusal of the log's text or JSON further on comes first
            pass
        raise


def _record(line: Any, at: str, last_step: int | None, identity: dict,
            kept_keys: frozenset) -> tuple[dict, str | None]:
    """The metric record of the log line ``line`` (named ``at``) after step ``last_step``, and the key whose
    value diverged (None if none did)."""
    if not isinstance(line, dict):
        raise UserError(f"{at}: holds {json_type(line)}; expected a JSON object per line")
    missing = [key for key in DANCEGRPO_KEYS if key not in line]
    if missing:
        raise UserError(f"{at}: missing {', '.join(repr(k) for k in missing)} "
                        f"(DanceGRPO log lines have {', '.join(DANCEGRPO_KEYS)})")
    step = line["step"]
    if not is_integer(step) or not 0 <= step <= MAX_STEP:
        raise UserError(f"{at}: 'step' = {quote(step)}: expected an integer >= 0 (at most {MAX_STEP:,})")
    if last_step is not None and step <= last_step:
        raise UserError(f"{at}: 'step' = {step} after step {last_step}: expected steps in increasing order, "
                        "each once")
    kept = {k: v for k, v in line.items() if k in kept_keys}
    numbers = {"reward_mean": line["avg_reward"], "t_iter_s": line["step_time"], "grad_norm": line["grad_norm"]}
    diverged = [key for key in DIVERGING_KEYS if _diverged(numbers[key] if key in numbers else kept.get(key))]
    for key in diverged:  # null in the record, as agg-bench run writes a value that is not finite
        (numbers if key in numbers else kept)[key] = None
    for name in ("avg_reward", "step_time", "grad_norm"):
        problem = _number_problem(DANCEGRPO_KEYS[name], numbers[DANCEGRPO_KEYS[name]], name)
        if problem is not None:
            raise UserError(f"{at}: {problem}")
    for key in sorted(_NUMBER_ORDER.keys() & kept.keys(), key=_NUMBER_ORDER.__getitem__):  # in NUMBER_KEYS' order
        problem = _number_problem(key, kept[key])
        if problem is not None:
            raise UserError(f"{at}: {problem}")
    numbers = {key: None if value is None else float(value) for key, value in numbers.items()}
    record = new_record(kept, identity, numbers, iteration=step, status="diverged" if diverged else "ok",
                        source=SOURCE)
    problem = record_problem(record, required=REQUIRED_RECORD_KEYS)
    if problem is not None:  # a text key of the log holding something else
        raise UserError(f"{at}: {problem}")
    return record, diverged[0] if diverged else None


# What an import may say of its run. Its n_gpus starts at 1 where a record's (INTEGER_RANGES) starts at 0: a log to
# import is a GPU run's, and 0 is what agg-bench's own CPU runs record.
IMPORT_RANGES = {"resolution": INTEGER_RANGES["resolution"], "n_gpus": (1, INTEGER_RANGES["n_gpus"][1])}
_ALLOWED_NUMBER = {"resolution": " (an image side in pixels)", "n_gpus": ""}


def label_problem(**values: Any) -> tuple[str, Any, str] | None:
    """The first of ``values`` that an import refuses, as (key, value, what is allowed), None when it takes them
    all: ``resolution`` and ``n_gpus`` within :data:`IMPORT_RANGES`, any other key a label of 1 to MAX_LABEL
    printable characters; a None value is one not given. The one check of ``agg-bench import-log``'s flags
    (:func:`check_labels`) and of a sweep's references (:func:`agg_bench.tools.sweep.check_reference`)."""
    for key, value in values.items():
        if value is None:
            continue
        if key in IMPORT_RANGES:
            low, high = IMPORT_RANGES[key]
            if not low <= value <= high:
                return key, value, f"an integer from {low} to {high}{_ALLOWED_NUMBER[key]}"
        elif not is_label(value):
            return key, value, f"1 to {MAX_LABEL} printable characters (a row of the report's tables)" \
                               f"{unprintable_words(value)}"
    return None


def check_labels(resolution: int | None, n_gpus: int | None, **labels: str | None) -> None:
    """The labels and numbers a user gives an import (:func:`label_problem`); a ConfigError naming the flag."""
    problem = label_problem(resolution=resolution, n_gpus=n_gpus, **labels)
    if problem is not None:
        key, value, allowed = problem
        raise ConfigError(f"--{key.replace('_', '-')}", value, allowed)


def _whole_json(text: str) -> bool:
    """``text`` is one whole JSON value to Python's own parser (which takes NaN and infinities): a line
    refused for what it holds, not cut short."""
    try:
        json.loads(text)
    except (ValueError, RecursionError):
        return False
    return True


def read_log(log: Path, notes: list[str],
             progress: Callable[[str], None] = lambda what: None) -> Iterator[list[tuple[int, Any]]]:
    """The JSON lines of ``log`` with their line numbers (blank lines left out), read a line at a time and given
    in chunks of :data:`CHUNK_LINES` (the last may be shorter, none is empty). A log over
    MAX_LOG_BYTES is refused before it is read. A line that is not JSON is a UserError naming it, except a last line
    without a newline that is not whole JSON: a log still being written, or cut by a crash. That one is left out,
    and a line in ``notes`` says so. ``progress`` is told of every :data:`PROGRESS_LINES` lines read.

    A refusal is the one of the whole log read first, its lines then (as it was read before): the lines are read
    to the end after the first that is not JSON (a byte that is no UTF-8 further on is the refusal), and after
    one that is no UTF-8 (the log may be growing past the bound); no lines are given after either, nor the chunk
    that held them."""
    check_path(log, "log", "a DanceGRPO JSONL log file")
    not_text = not_json = None  # the refusals found, given once the log is read to its end
    n = offset = given = 0
    chunk: list[tuple[int, Any]] = []
    try:
        size = os.stat(log).st_size
        for raw in read_bounded_lines(log, MAX_LOG_BYTES):
            n, offset = n + 1, offset + len(raw)
            if n % PROGRESS_LINES == 0:
                progress(f"read {n:,} lines, {offset:,} of {size:,} bytes")
            if not_text is not None:
                continue
            try:
                text = raw.decode("utf-8")  # no UTF-8 sequence holds a newline: as the whole text decodes
            except UnicodeDecodeError as err:
                not_text = f"log {shown(log)}: not UTF-8 text ({err.reason} at byte {offset - len(raw) + err.start})"
                continue
            line = text[:-1] if raw.endswith(b"\n") else text
            if not_json is not None or not line.strip():
                continue
            try:
                value = loads(line, nonfinite=True)  # NaN: a diverged step (module docstring)
            except JsonProblem as err:
                if not raw.endswith(b"\n") and not _whole_json(line):  # the last line, no newline after it: torn
                    notes.append(f"log {shown(log)} line {n}: left out, not a whole JSON line ({err}; a log still being "
                                 "written?)")
                    continue
                not_json = f"log {shown(log)} line {n}: not JSON ({err}); expected one JSON object per line"
                continue
            given += 1
            chunk.append((n, value))
            if len(chunk) == CHUNK_LINES:
                yield chunk
                chunk = []
    except TooLarge as err:
        size_words = "more bytes" if err.size is None else f"{err.size:,} bytes"
        raise UserError(f"log {shown(log)}: {size_words}, over the {MAX_LOG_BYTES // 2**20} MiB an import "
                        "reads") from None
    except OSError as err:
        raise UserError(f"log {shown(log)}: cannot be read ({err.strerror or err})") from None
    if not_text is not None or not_json is not None:
        raise UserError(not_text or not_json)
    if not given:
        raise UserError(f"log {shown(log)}: no records")
    if chunk:
        yield chunk


def check_import_folder(out: Path) -> None:
    """``out`` may be new, empty or an earlier import (replaced); a run's folder or anyone else's files are
    refused (:func:`~agg_bench.outdir.check_folder`). Reads only."""
    check_folder(out, IMPORT_CONTENTS)
    summary = out / "summary.json"
    if summary.is_file():
        try:
            source = loads(summary.read_bytes()).get("source")
        except (OSError, ValueError, AttributeError):
            source = None
        if source != SOURCE:
            raise UserError(f"--out {shown(out)}: holds a summary.json that is not an imported log's; give a new or "
                            "empty folder")


def import_log(log: str | Path, out_dir: str | Path, method: str = "full", model: str = "unknown",
               resolution: int | None = None, gpu_name: str | None = None, n_gpus: int | None = None,
               run_id: str | None = None) -> dict:
    """Write ``out_dir`` as a reference run from the DanceGRPO log ``log``; returns its summary. The log is read,
    checked and written a chunk of lines at a time into a temporary folder, renamed over ``out_dir`` once all of
    it has passed (module docstring)."""
    check_labels(resolution, n_gpus, method=method, model=model, gpu_name=gpu_name, run_id=run_id)
    log, out = Path(log), Path(out_dir)
    notes: list[str] = []  # said once the import is written: a refusal is its one line
    progress = Progress("import-log")  # a line on stderr at most every few seconds: a long log shows where it is
    # the folder's name as UTF-8 text, as a run's (a non-UTF-8 name held lone surrogates that no table can write)
    run_id = run_id or path_text(out.name)
    identity = {"run_id": run_id, "method": method, "model": model, "resolution": resolution,
                "device": "cuda" if gpu_name else None, "gpu_name": gpu_name, "n_gpus": n_gpus, "seed": None}
    converted = Converted()
    records = convert_records(read_log(log, notes, progress), identity, f"log {shown(log)}", converted)
    try:
        check_import_folder(out)
        # written beside the folder and renamed over it whole: a refused or stopped import leaves the earlier import
        # as it was, where it left the new metrics without a summary (an interrupted run to the report), the earlier
        # lost
        with Claim(out, folder=True, lock_inside=False, check=lambda: check_import_folder(out)), \
                replaced_folders(out) as staged:
            folder = staged(out)
            with atomic_file(folder / "metrics.jsonl") as fh:
                for chunk in records:
                    fh.write("".join([JsonlWriter.line(record) + "\n" for record in chunk]))
            summary = {"run_id": run_id, "status": "diverged" if converted.diverged else "ok",
                       "iterations": converted.iterations, "last_good_iteration": converted.last_good_iteration,
                       "error": converted.diverged, **identity, "source": SOURCE, "imported_from": path_text(log)}
            write_json(folder / "env.json", {"source": SOURCE, "imported_from": path_text(log.resolve())})
            write_json(folder / "summary.json", summary)
    except Exception:
        # the output folder or the disk refused: the log is checked to its end all the same, since a refusal of
        # the log comes first (as when the log was read before anything was written)
        for _ in records:
            pass
        raise
    if converted.diverged and converted.left:
        left = converted.left
        notes.append(f"log {shown(log)}: {converted.diverged}; the run ends there, as a run that diverges does (the {left} "
                     f"line{'s' if left > 1 else ''} after it left out)")
    for note in notes:
        print(f"agg-bench import-log: {note}", file=sys.stderr, flush=True)
    return summary
