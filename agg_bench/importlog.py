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

from .errors import UserError
from .io import JsonlWriter, read_jsonl, write_json
from .records import RECORD_KEYS

# DanceGRPO key -> metric record key
DANCEGRPO_KEYS = {"step": "iteration", "avg_reward": "reward_mean", "step_time": "t_iter_s",
                  "grad_norm": "grad_norm"}
SOURCE = "imported"


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
        record = dict.fromkeys(RECORD_KEYS)
        record.update({k: v for k, v in line.items() if k in RECORD_KEYS})
        record.update(identity)
        step = line["step"]
        if isinstance(step, bool) or not isinstance(step, int):
            raise UserError(f"{at}: 'step' = {step!r}: expected an integer")
        record["iteration"] = step
        for key in ("avg_reward", "step_time", "grad_norm"):
            record[DANCEGRPO_KEYS[key]] = _number(line[key], at, key)
        finite = all(record[k] is None or math.isfinite(record[k]) for k in ("reward_mean", "grad_norm"))
        record["status"] = "ok" if finite else "diverged"
        record["source"] = SOURCE
        records.append(record)
    return records


def import_log(log: str | Path, out_dir: str | Path, method: str = "full", model: str = "unknown",
               resolution: int | None = None, gpu_name: str | None = None, n_gpus: int | None = None,
               run_id: str | None = None) -> dict:
    """Write ``out_dir`` as a reference run from the DanceGRPO log ``log``; returns its summary."""
    log = Path(log)
    if not log.is_file():
        raise UserError(f"log {log}: no such file")
    try:
        lines = list(read_jsonl(log))
    except json.JSONDecodeError as err:
        raise UserError(f"log {log}: a line before the last is not JSON ({err.msg})") from None
    if not lines:
        raise UserError(f"log {log}: no records")
    from .train import prepare_out_dir  # the engine (and torch) only once there is a log to write

    out = prepare_out_dir(out_dir)
    run_id = run_id or out.name
    identity = {"run_id": run_id, "method": method, "model": model, "resolution": resolution,
                "device": "cuda" if gpu_name else None, "gpu_name": gpu_name, "n_gpus": n_gpus, "seed": None}
    records = convert_records(lines, identity, str(log))
    with JsonlWriter(out / "metrics.jsonl") as writer:
        for record in records:
            writer.write(record)
    bad = [r for r in records if r["status"] != "ok"]
    good = [r["iteration"] for r in records if r["status"] == "ok"]
    summary = {"run_id": run_id, "status": "diverged" if bad else "ok", "iterations": len(records),
               "last_good_iteration": good[-1] if good else None, "error": None, **identity,
               "source": SOURCE, "imported_from": str(log)}
    write_json(out / "summary.json", summary)
    write_json(out / "env.json", {"source": SOURCE, "imported_from": str(log.resolve())})
    return summary
