"""torch.profiler around any step function: traces, an operator table and a CUDA memory snapshot."""
from __future__ import annotations

import csv
import os
import socket
import sys
import warnings
from pathlib import Path
from typing import Any, Callable

import torch
from torch.profiler import ProfilerActivity, profile, schedule, tensorboard_trace_handler

from ..io import atomic_file, atomic_target
from ..outdir import Contents

MEMORY_HISTORY_MAX_ENTRIES = 100_000
MEMORY_SNAPSHOT = "memory_snapshot.pickle"


def is_trace_file(name: str) -> bool:
    """Whether ``name`` is a trace :func:`profile_steps` writes (one per profiled cycle)."""
    return name.endswith((".pt.trace.json", ".pt.trace.json.gz"))


def is_profile_file(name: str) -> bool:
    """Whether ``name`` is one that ``agg-bench profile`` writes into its folder."""
    return name in ("config.json", "env.json", "profile.json", "operators.csv", MEMORY_SNAPSHOT) or is_trace_file(name)


PROFILE_CONTENTS = Contents("a profile", match=is_profile_file)


def profile_steps(
    step: Callable[[], None],
    out_dir: str | Path,
    device: torch.device | str,
    wait: int = 1,
    warmup: int = 1,
    active: int = 2,
    repeat: int = 1,
    record_shapes: bool = True,
    profile_memory: bool = True,
    with_stack: bool = True,
) -> dict[str, str]:
    """Run ``step`` ``(wait + warmup + active) * repeat`` times under ``torch.profiler`` and write:

    - one gzipped trace per profiled cycle (``*.pt.trace.json.gz``, TensorBoard / Perfetto readable), returned as
      ``trace_0``, ``trace_1``, ...;
    - ``operators.csv`` (``operators``): per cycle and operator, calls, self and total CPU time (us),
      CPU memory (bytes) and, on a CUDA device, CUDA time and memory; rows sorted by self device time
      on CUDA, self CPU time otherwise;
    - on a CUDA device, ``memory_snapshot.pickle`` (``memory_snapshot``) from the allocator's memory
      history, for https://pytorch.org/memory_viz.

    Returns the paths it wrote, by those names. The traces and memory snapshot an earlier call left in
    ``out_dir`` are removed once this call's are written, so the folder holds one profile, the one returned;
    if the profiled steps fail, this call's traces are removed and the earlier ones stay.
    """
    for name, value, least in (("wait", wait, 0), ("warmup", warmup, 0), ("active", active, 1),
                               ("repeat", repeat, 1)):
        if not isinstance(value, int) or value < least:
            raise ValueError(f"profile_steps: {name} = {value!r}: expected an integer >= {least}")
    device = torch.device(device)
    on_cuda = device.type == "cuda"
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)

    earlier = [path for path in out_dir.iterdir()
               if (is_trace_file(path.name) or path.name == MEMORY_SNAPSHOT) and path.is_file() and not path.is_symlink()]
    worker = f"{socket.gethostname()}_{os.getpid()}"
    traces: list[Path] = []
    cycles: list[Any] = []

    def on_trace_ready(prof: profile) -> None:
        # One worker name per cycle: trace names carry a millisecond timestamp, which two short
        # cycles can share.
        write_trace = tensorboard_trace_handler(str(out_dir), worker_name=f"{worker}_cycle{len(cycles)}", use_gzip=True)
        before = set(out_dir.iterdir())
        write_trace(prof)
        traces.extend(sorted(set(out_dir.iterdir()) - before))
        try:
            cycles.append(prof.key_averages())
        except UnicodeDecodeError as err:
            # torch's parser of the profiler's memory events sometimes meets a garbled event name; the
            # trace is written, only this cycle's rows of the operator table are lost
            print(f"agg-bench profile: cycle {len(cycles)}: no operator table ({err}); its trace is written",
                  file=sys.stderr)
            cycles.append(None)

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_cuda else [])
    profiler = profile(
        activities=activities,
        schedule=schedule(wait=wait, warmup=warmup, active=active, repeat=repeat),
        on_trace_ready=on_trace_ready,
        record_shapes=record_shapes,
        profile_memory=profile_memory,
        with_stack=with_stack,
    )
    written: dict[str, str] = {}
    if on_cuda:
        torch.cuda.memory._record_memory_history(max_entries=MEMORY_HISTORY_MAX_ENTRIES, device=device)
    try:
        with warnings.catch_warnings(), profiler:
            # on_trace_ready keeps every cycle's operators, so the profiler's warning that events
            # are dropped between cycles does not apply.
            warnings.filterwarnings("ignore", message=".*Profiler clears events", category=UserWarning)
            for _ in range((wait + warmup + active) * repeat):
                step()
                profiler.step()
        if on_cuda:
            torch.cuda.synchronize(device)
            snapshot = out_dir / MEMORY_SNAPSHOT
            with atomic_target(snapshot) as tmp:  # replaced by rename: an earlier snapshot is never torn
                torch.cuda.memory._dump_snapshot(str(tmp))
            written["memory_snapshot"] = str(snapshot)
    except BaseException:
        for trace in traces:
            trace.unlink(missing_ok=True)
        raise
    finally:
        if on_cuda:
            torch.cuda.memory._record_memory_history(enabled=None, device=device)

    for index, trace in enumerate(traces):
        written[f"trace_{index}"] = str(trace)
    operators = out_dir / "operators.csv"
    _write_operator_table(operators, cycles, on_cuda)
    written["operators"] = str(operators)
    for path in earlier:  # the previous profile's, now that this one is complete
        if str(path) not in written.values():
            path.unlink(missing_ok=True)
    return written


def _write_operator_table(path: Path, cycles: list[Any], on_cuda: bool) -> None:
    columns = ["cycle", "name", "calls", "self_cpu_time_us", "cpu_time_total_us"]
    if on_cuda:
        columns += ["self_cuda_time_us", "cuda_time_total_us"]
    columns += ["self_cpu_memory_bytes", "cpu_memory_bytes"]
    if on_cuda:
        columns += ["self_cuda_memory_bytes", "cuda_memory_bytes"]

    def sort_key(event: Any) -> float:
        return event.self_device_time_total if on_cuda else event.self_cpu_time_total

    # replaced by rename: a profile killed while writing it leaves the earlier table whole, never a torn one
    with atomic_file(path) as handle:
        writer = csv.DictWriter(handle, fieldnames=columns)
        writer.writeheader()
        for cycle, events in enumerate(cycles):
            for event in sorted(events or [], key=sort_key, reverse=True):
                row = {
                    "cycle": cycle,
                    "name": event.key,
                    "calls": event.count,
                    "self_cpu_time_us": event.self_cpu_time_total,
                    "cpu_time_total_us": event.cpu_time_total,
                    "self_cpu_memory_bytes": event.self_cpu_memory_usage,
                    "cpu_memory_bytes": event.cpu_memory_usage,
                }
                if on_cuda:
                    row.update(
                        self_cuda_time_us=event.self_device_time_total,
                        cuda_time_total_us=event.device_time_total,
                        self_cuda_memory_bytes=event.self_device_memory_usage,
                        cuda_memory_bytes=event.device_memory_usage,
                    )
                writer.writerow(row)
