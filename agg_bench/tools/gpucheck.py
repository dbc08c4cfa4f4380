"""The summary of ``scripts/gpu_check.sh``: its steps' outcomes and, per measured run, the train-phase
time, the memory peaks and the planner's prediction, as ``summary.json`` and ``summary.md``.

``python -m agg_bench.tools.gpucheck DIR`` reads ``DIR/steps.tsv`` (one ``name<TAB>exit code<TAB>log`` line per
step the script ran) and the run folders under ``DIR/runs/``, and writes ``DIR/summary.json`` and
``DIR/summary.md``. It exits 1 when a step failed, so the script fails with it.

``python -m agg_bench.tools.gpucheck --check-out DIR``, run by the script before it removes DIR to write it
again, exits 2 with one line unless DIR is new or holds only what the script writes there
(:data:`~agg_bench.outputs.GPU_CHECK_CONTENTS`): an ``AGG_BENCH_CHECK_OUT`` that named a folder of someone's
files removed them.
"""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path

from ..errors import UserError, run_command
from ..io import read_jsonl, write_json
from ..jsonfiles import read_json_object
from ..outdir import check_folder
from ..outputs import GPU_CHECK_CONTENTS

MIB = 1024 ** 2
WARMUP = 1  # the first iteration (allocator and kernel warm-up) is left out of the time means


def _mean(values: list) -> float | None:
    values = [v for v in values if isinstance(v, (int, float)) and math.isfinite(v)]
    return sum(values) / len(values) if values else None


def _max(values: list) -> float | None:
    values = [v for v in values if isinstance(v, (int, float))]
    return max(values) if values else None


def _written(path: Path) -> dict:
    """The JSON object a step wrote to ``path``; {} when the step failed before writing it whole (its
    failure is in ``steps.tsv`` already, so the summary still gets written)."""
    try:
        return read_json_object(path, "what the step writes")
    except UserError:
        return {}


def summarize_run(run_dir: Path) -> dict:
    """One run folder -> its row: status, mean train-phase seconds after warm-up, peaks, plan."""
    try:
        records = list(read_jsonl(run_dir / "metrics.jsonl")) if (run_dir / "metrics.jsonl").exists() else []
    except UserError:  # damaged records: the row shows the run's status without its numbers
        records = []
    summary = _written(run_dir / "summary.json")
    plan = _written(run_dir / "plan.json")
    timed = records[WARMUP:] if len(records) > WARMUP else records
    first = records[0] if records else {}
    return {
        "run": run_dir.name, "status": summary.get("status", "missing"), "method": first.get("method"),
        "resolution": first.get("resolution"), "weights": first.get("weights"), "iterations": len(records),
        "t_train_s": _mean([r.get("t_train_s") for r in timed]),
        "t_iter_s": _mean([r.get("t_iter_s") for r in timed]),
        "forward_grad": first.get("forward_grad"), "backward": first.get("backward"),
        "peak_alloc_bytes": _max([r.get("peak_alloc_bytes") for r in records]),
        "nvml_peak_used_bytes": _max([r.get("nvml_peak_used_bytes") for r in records]),
        "energy_j": _mean([r.get("energy_j") for r in timed]),
        "saved_activation_peak_bytes": _max([r.get("saved_activation_peak_bytes") for r in records]),
        "planned_activation_bytes": (plan.get("bytes") or {}).get("activations"),
        "planned_total_bytes": (plan.get("bytes") or {}).get("total_per_gpu"),
        "plan_error": plan.get("error"),
    }


def read_steps(path: Path) -> list[dict]:
    steps = []
    if path.exists():
        for line in path.read_text().splitlines():
            name, code, log = (line.split("\t") + ["", ""])[:3]
            steps.append({"step": name, "ok": code == "0", "exit_code": int(code) if code.lstrip("-").isdigit() else None,
                          "log": log})
    return steps


def _mib(value) -> str:
    return "" if value is None else f"{value / MIB:,.1f}"


def _num(value, fmt: str = "{:.3f}") -> str:
    return "" if value is None else fmt.format(value)


def to_markdown(summary: dict) -> str:
    lines = [f"# GPU check ({summary['mode']})", "", f"device: {summary.get('gpu_name') or summary.get('device')}", "",
             "| step | ok | log |", "| --- | --- | --- |"]
    lines += [f"| {s['step']} | {'yes' if s['ok'] else 'NO'} | {s['log']} |" for s in summary["steps"]]
    lines += ["", "| run | status | t_train_s | train speedup | backward | peak alloc MiB | saved act MiB | "
                  "planned act MiB | planned total MiB | energy J |",
              "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in summary["runs"]:
        lines.append(f"| {r['run']} | {r['status']} | {_num(r['t_train_s'])} | {_num(r.get('train_speedup'), '{:.2f}x')} "
                     f"| {r['backward'] if r['backward'] is not None else ''} | {_mib(r['peak_alloc_bytes'])} "
                     f"| {_mib(r['saved_activation_peak_bytes'])} | {_mib(r['planned_activation_bytes'])} "
                     f"| {_mib(r['planned_total_bytes'])} | {_num(r['energy_j'], '{:.0f}')} |")
    return "\n".join(lines) + "\n"


def summarize(root: str | Path, mode: str) -> dict:
    """Write ``summary.json`` and ``summary.md`` under ``root``; return the summary."""
    root = Path(root)
    runs = [summarize_run(d) for d in sorted((root / "runs").iterdir()) if d.is_dir()] if (root / "runs").exists() else []
    # the train-phase speedup of each AGG run over `full` at its resolution
    full = {r["resolution"]: r["t_train_s"] for r in runs if r["run"].startswith("full_")}
    for r in runs:
        base = full.get(r["resolution"]) if r["run"].startswith("agg") else None
        r["train_speedup"] = base / r["t_train_s"] if base and r["t_train_s"] else None
    environment = _written(root / "env.json")
    summary = {"mode": mode, "device": "cuda" if mode == "gpu" else "cpu", "gpu_name": environment.get("gpu_name"),
               "torch": environment.get("torch"), "git_commit": environment.get("git_commit"),
               "steps": read_steps(root / "steps.tsv"), "runs": runs}
    write_json(root / "summary.json", summary)
    (root / "summary.md").write_text(to_markdown(summary))
    return summary


def check_out(folder: str) -> int:
    """0 when the script may remove ``folder`` and write its output there; a UserError naming
    AGG_BENCH_CHECK_OUT otherwise."""
    check_folder(Path(folder), GPU_CHECK_CONTENTS, flag="AGG_BENCH_CHECK_OUT",
                 remedy="the check removes the folder before it writes there; give a new folder or one an earlier "
                        "check wrote")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if len(argv) == 2 and argv[0] == "--check-out":
        return run_command("gpu_check", lambda: check_out(argv[1]), ["python", "-m", "agg_bench.tools.gpucheck", *argv])
    if len(argv) != 2 or argv[1] not in ("gpu", "cpu"):
        print("usage: python -m agg_bench.tools.gpucheck DIR gpu|cpu", file=sys.stderr)
        return 2

    def body() -> int:
        summary = summarize(argv[0], argv[1])
        failed = [s["step"] for s in summary["steps"] if not s["ok"]]
        print(json.dumps({"out": str(Path(argv[0]) / "summary.json"), "failed_steps": failed}))
        return 1 if failed else 0

    return run_command("agg_bench.tools.gpucheck", body, ["python", "-m", "agg_bench.tools.gpucheck", *argv], argv[0])


if __name__ == "__main__":
    sys.exit(main())
