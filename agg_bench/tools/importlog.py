"""Training logs of other code bases as reference runs.

``agg-bench import-log`` turns a log in DanceGRPO's JSONL format (one object per optimizer step with
``step``, ``avg_reward``, ``step_time`` and ``grad_norm``) into a run folder shaped like the ones
``agg-bench run`` writes (``metrics.jsonl``, ``summary.json``, ``env.json``). Its records carry
``source: "imported"``, so tables show them beside measured rows and labelled as imported. Fields the
log does not have are ``None`` (not measured), never 0.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

from ..errors import UserError
from ..io import JsonlWriter, read_jsonl, write_json, write_lines
from ..jsonfiles import loads
from ..outdir import Claim, Contents, check_folder
from ..records import RECORD_KEYS, new_record

# DanceGRPO key -> metric record key
DANCEGRPO_KEYS = {"step": "iteration", "avg_reward": "reward_mean", "step_time": "t_iter_s",
                  "grad_norm": "grad_norm"}
SOURCE = "imported"
# an import folder holds these and nothing else; an earlier import is replaced, anything else is refused
IMPORT_CONTENTS = Contents("an imported log", ("metrics.jsonl", "summary.json", "env.json"))
MAX_LOG_BYTES = 64 * 2**20  # a DanceGRPO log of 100,000 steps is about 15 MB
MAX_RESOLUTION = 16384
MAX_GPUS = 65536
MAX_LABEL = 200  # characters of a method, model, GPU or run label


def _number(value, where: str, key: str) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise UserError(f"{where}: '{key}' = {value!r}: expected a number")
    return float(value)


def convert_records(lines: list[dict], identity: dict, where: str = "log") -> list[dict]:
    """Metric records for DanceGRPO log lines; ``identity`` fills run_id, method, model, ...

    Keys of a line that are already record keys (e.g. ``loss``, ``reward_std``) are kept; the status of a
    step whose reward or gradient norm is not finite is ``diverged``.
    """
    records = []
    for n, line in enumerate(lines, 1):
        at = f"{where} line {n}"
        if not isinstance(line, dict):
            raise UserError(f"{at}: expected a JSON object per line")
        missing = [key for key in DANCEGRPO_KEYS if key not in line]
        if missing:
            raise UserError(f"{at}: missing {', '.join(repr(k) for k in missing)} "
                            f"(DanceGRPO log lines have {', '.join(DANCEGRPO_KEYS)})")
        record = new_record({k: v for k, v in line.items() if k in RECORD_KEYS}, identity)
        step = line["step"]
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise UserError(f"{at}: 'step' = {step!r}: expected an integer >= 0")
        if records and step <= records[-1]["iteration"]:
            raise UserError(f"{at}: 'step' = {step} after step {records[-1]['iteration']}: expected steps in "
                            "increasing order, each once")
        record["iteration"] = step
        for key in ("avg_reward", "step_time", "grad_norm"):
            record[DANCEGRPO_KEYS[key]] = _number(line[key], at, key)
        finite = all(record[k] is None or math.isfinite(record[k]) for k in ("reward_mean", "grad_norm"))
        record["status"] = "ok" if finite else "diverged"
        record["source"] = SOURCE
        records.append(record)
    return records


def check_labels(resolution: int | None, n_gpus: int | None, **labels: str | None) -> None:
    """The labels and numbers a user gives an import: in range, short, printable."""
    if resolution is not None and not 1 <= resolution <= MAX_RESOLUTION:
        raise UserError(f"--resolution {resolution}: expected an image side from 1 to {MAX_RESOLUTION} pixels")
    if n_gpus is not None and not 1 <= n_gpus <= MAX_GPUS:
        raise UserError(f"--n-gpus {n_gpus}: expected an integer from 1 to {MAX_GPUS}")
    for flag, value in labels.items():
        if value is not None and (not value or len(value) > MAX_LABEL or not value.isprintable()):
            raise UserError(f"--{flag.replace('_', '-')} {value[:MAX_LABEL]!r}: expected 1 to {MAX_LABEL} "
                            "printable characters")


def read_log(log: Path) -> list[dict]:
    """The JSON lines of ``log``, refused beyond MAX_LOG_BYTES before it is read."""
    if not log.is_file():
        raise UserError(f"log {log}: no such file")
    size = log.stat().st_size
    if size > MAX_LOG_BYTES:
        raise UserError(f"log {log}: {size:,} bytes, over the {MAX_LOG_BYTES // 2**20} MiB an import reads")
    try:
        lines = list(read_jsonl(log))
    except json.JSONDecodeError as err:
        raise UserError(f"log {log}: a line before the last is not JSON ({err.msg})") from None
    if not lines:
        raise UserError(f"log {log}: no records")
    return lines


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
            raise UserError(f"--out {out}: holds a summary.json that is not an imported log's; give a new or "
                            "empty folder")


def import_log(log: str | Path, out_dir: str | Path, method: str = "full", model: str = "unknown",
               resolution: int | None = None, gpu_name: str | None = None, n_gpus: int | None = None,
               run_id: str | None = None) -> dict:
    """Write ``out_dir`` as a reference run from the DanceGRPO log ``log``; returns its summary."""
    check_labels(resolution, n_gpus, method=method, model=model, gpu_name=gpu_name, run_id=run_id)
    log, out = Path(log), Path(out_dir)
    lines = read_log(log)
    run_id = run_id or out.name
    identity = {"run_id": run_id, "method": method, "model": model, "resolution": resolution,
                "device": "cuda" if gpu_name else None, "gpu_name": gpu_name, "n_gpus": n_gpus, "seed": None}
    records = convert_records(lines, identity, str(log))
    check_import_folder(out)
    bad = [r for r in records if r["status"] != "ok"]
    good = [r["iteration"] for r in records if r["status"] == "ok"]
    summary = {"run_id": run_id, "status": "diverged" if bad else "ok", "iterations": len(records),
               "last_good_iteration": good[-1] if good else None, "error": None, **identity,
               "source": SOURCE, "imported_from": str(log)}
    with Claim(out, folder=True, lock_inside=True, check=lambda: check_import_folder(out)):
        (out / "summary.json").unlink(missing_ok=True)  # written last: present only once the import is whole
        write_lines(out / "metrics.jsonl", [JsonlWriter.line(record) for record in records])
        write_json(out / "env.json", {"source": SOURCE, "imported_from": str(log.resolve())})
        write_json(out / "summary.json", summary)
    return summary
