"""torch.profiler around any step function: traces, an operator table and a CUDA memory snapshot."""
from __future__ import annotations

import bisect
import csv
import gzip
import json
import os
import socket
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from torch.profiler import ProfilerActivity, profile, schedule, tensorboard_trace_handler

from ..io import atomic_file, atomic_target
from ..outputs import MEMORY_SNAPSHOT, is_trace_file
from ..results.formatting import csv_cell

MEMORY_HISTORY_MAX_ENTRIES = 100_000


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
      on CUDA, self CPU time otherwise; an operator name a spreadsheet would run as a formula is written after a
      single quote (:func:`~agg_bench.results.formatting.csv_cell`). Where torch cannot parse a cycle's events (a garbled event name), that
      cycle's rows are summed from its trace by :func:`trace_operators`, and a line on stderr says so;
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
        cycle_traces = sorted(set(out_dir.iterdir()) - before)
        traces.extend(cycle_traces)
        try:
            cycles.append(prof.key_averages())
        except UnicodeDecodeError as err:
            # torch's parser of the profiler's memory events sometimes meets a garbled event name: the
            # cycle's rows are summed from the trace just written instead (trace_operators)
            said = f"agg-bench profile: cycle {len(cycles)}: torch could not read the profiler's events ({err})"
            try:
                rows = trace_operators(cycle_traces[0], on_cuda)
            except (IndexError, OSError, ValueError, KeyError, TypeError, AttributeError) as trace_err:
                print(f"{said}, nor its trace ({type(trace_err).__name__}: {trace_err}): no operator rows; "
                      "its trace is written", file=sys.stderr)
                rows = None
            else:
                print(f"{said}; its operator rows are summed from its trace", file=sys.stderr)
            cycles.append(rows)

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_cuda else [])
    with warnings.catch_warnings():
        # warmup=0 is the caller's choice (profile --warmup 0), not a fault of the run: torch's warning that the
        # first recorded step may skew the times is left out of a run's output
        warnings.filterwarnings("ignore", message="Profiler won't be using warmup", category=UserWarning)
        steps = schedule(wait=wait, warmup=warmup, active=active, repeat=repeat)
    profiler = profile(
        activities=activities,
        schedule=steps,
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
                    "name": csv_cell(event.key),  # a record_function label is any text
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


# torch.autograd.profiler's rules, applied to a Chrome trace by trace_operators: the names its parser leaves
# out (_filter_name), the event categories that run on a device, and the memory events' device types
# (c10::DeviceType: CPU, MKLDNN, IDEEP; CUDA, HIP, XPU, PrivateUse1)
_LEFT_OUT = {"profiler::_record_function_enter", "profiler::_record_function_enter_new",
             "profiler::_record_function_exit", "aten::is_leaf", "aten::output_nr", "aten::_version"}
_DEVICE_CATEGORIES = {"kernel", "gpu_memcpy", "gpu_memset", "gpu_user_annotation"}
_FRONTEND = {"cpu_op", "user_annotation", "python_function"}
_NOT_OPERATORS = {"Trace"}  # the profiler's own span of the whole trace
_CPU_MEMORY = {0, 2, 5}
_DEVICE_MEMORY = {1, 6, 12, 20}
_OUT_OF_MEMORY = "[OutOfMemory]"


@dataclass
class TraceOperator:
    """One operator's sums over a cycle, under the names of torch's ``FunctionEventAvg``."""
    key: str
    count: int = 0
    self_cpu_time_total: float = 0.0
    cpu_time_total: float = 0.0
    self_device_time_total: float = 0.0
    device_time_total: float = 0.0
    self_cpu_memory_usage: int = 0
    cpu_memory_usage: int = 0
    self_device_memory_usage: int = 0
    device_memory_usage: int = 0


@dataclass
class _Span:
    name: str
    group: tuple
    start: int  # ns
    end: int
    thread: Any
    on_device: bool
    frontend: bool  # an operator, annotation or Python call: what owns the kernels of its External id
    external_id: int
    duration_us: float
    cpu_memory: int = 0
    device_memory: int = 0
    own_kernels_us: float = 0.0
    children: list | None = None
    parent: _Span | None = None


def read_trace(path: str | Path) -> dict:
    """The Chrome trace at ``path`` (gzipped or not); a byte of an event name that is no UTF-8 reads as U+FFFD."""
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rb") as handle:
        return json.loads(handle.read().decode("utf-8", "replace"))


def trace_operators(trace: str | Path | dict, on_cuda: bool) -> list[TraceOperator]:
    """The rows torch's ``profile.key_averages()`` gives for one cycle, summed from its Chrome trace (a path or
    the loaded JSON) by torch's own rules: every complete ("X") event but the trace's own span is an
    operator call, profiler bookkeeping ops left out and ``ProfilerStep#N`` counted as ``ProfilerStep*``; an
    event's self CPU time is its duration less that of the events nested in it on its thread; its memory is
    that of the allocations (``[memory]`` instant events, whatever their name) that fall in its span on any
    thread, its self memory less its children's; an allocation in no span is a row ``[memory]``; a CPU
    operator's device time is that of the kernels, copies and sets with its ``External id`` (self), and of
    its children's (total). Rows are keyed as torch keys them (name, device or CPU, user annotation), in the
    order of their first call.

    What the trace cannot say: which spans torch marks asynchronous (one that starts and ends on different
    threads, which torch gives no self values and nests in no parent); here they count as synchronous, so
    their self values and their parents' can differ from torch's."""
    events = (read_trace(trace) if not isinstance(trace, dict) else trace).get("traceEvents", [])
    spans: list[_Span] = []
    memory: list[tuple[int, int, int, str]] = []  # (ns, device type, bytes, name)
    for event in events:
        if not isinstance(event, dict) or "ts" not in event:
            continue
        start = round(float(event["ts"]) * 1000)
        name = str(event.get("name", ""))
        args = event.get("args") or {}
        if event.get("ph") == "i" and "Bytes" in args and "Device Type" in args:
            memory.append((start, int(args["Device Type"]), int(args["Bytes"]), name))
            continue
        if event.get("ph") != "X" or event.get("cat") in _NOT_OPERATORS or name in _LEFT_OUT:
            continue
        if name.startswith("ProfilerStep#"):
            name = "ProfilerStep*"
        on_device = event.get("cat") in _DEVICE_CATEGORIES
        annotation = event.get("cat") in ("user_annotation", "gpu_user_annotation")
        duration = float(event.get("dur", 0))
        spans.append(_Span(name, (name, on_device, annotation), start, start + round(duration * 1000),
                           (event.get("pid"), event.get("tid")), on_device, event.get("cat") in _FRONTEND,
                           int(args.get("External id") or 0), duration))
    cpu = [span for span in spans if not span.on_device]
    # memory: every allocation within a CPU span counts for it, on any thread (torch's MemRecordsAcc)
    memory.sort()
    allocations = [i for i, record in enumerate(memory) if record[3] != _OUT_OF_MEMORY]
    times = [memory[i][0] for i in allocations]
    placed = [False] * len(memory)
    for span in cpu:
        for i in allocations[bisect.bisect_left(times, span.start):bisect.bisect_right(times, span.end)]:
            _, device, size, _ = memory[i]
            span.cpu_memory += size if device in _CPU_MEMORY else 0
            span.device_memory += size if device in _DEVICE_MEMORY else 0
            placed[i] = True
    # kernels: to the CPU operator of their External id (an operator or annotation; the runtime call that
    # launched them shares the id but is no owner)
    if on_cuda:
        owners = {span.external_id: span for span in cpu if span.external_id > 0 and span.frontend}
        for span in spans:
            if span.on_device and span.external_id in owners:
                owners[span.external_id].own_kernels_us += span.duration_us
    # nesting per thread: [start, end) inside the parent's (torch's EventList._populate_cpu_children)
    for span in cpu:
        span.children = []
    by_thread: dict[Any, list[_Span]] = {}
    for span in cpu:
        by_thread.setdefault(span.thread, []).append(span)
    for thread_spans in by_thread.values():
        stack: list[_Span] = []
        for span in sorted(thread_spans, key=lambda s: (s.start, -s.end)):
            while stack and (span.start >= stack[-1].end or span.end > stack[-1].end):
                stack.pop()
            if stack:
                stack[-1].children.append(span)  # type: ignore[union-attr]
                span.parent = stack[-1]
            stack.append(span)
    # a call nested alone in a call of its own name is one call: the outer one keeps the inner one's children
    # and kernels (torch's EventList._remove_dup_nodes)
    ordered = sorted(cpu, key=lambda s: (s.start, -s.end))
    while True:
        merged = set()
        for span in ordered:
            parent = span.parent
            if parent is not None and parent.name == span.name and len(parent.children or []) == 1:
                parent.children = span.children
                parent.own_kernels_us = span.own_kernels_us
                for child in span.children or []:
                    child.parent = parent
                merged.add(id(span))
        if not merged:
            break
        ordered = [span for span in ordered if id(span) not in merged]
    kept = {id(span) for span in ordered}
    spans = [span for span in spans if span.on_device or id(span) in kept]

    device_totals: dict[int, float] = {}

    def device_total(span: _Span) -> float:  # own kernels and every descendant's, as torch sums them
        if id(span) not in device_totals:
            pending = [span]
            while pending:  # children first, without recursion (deep Python stacks)
                top = pending[-1]
                todo = [c for c in top.children or [] if id(c) not in device_totals]
                if todo:
                    pending.extend(todo)
                    continue
                pending.pop()
                device_totals[id(top)] = top.own_kernels_us + sum(device_totals[id(c)] for c in top.children or [])
        return device_totals[id(span)]

    rows: dict[tuple, TraceOperator] = {}
    calls: list[tuple[int, int, tuple, dict]] = []
    for span in spans:
        if span.on_device:
            values = {"device_time_total": span.duration_us, "self_device_time_total": span.duration_us}
        else:
            children = span.children or []
            values = {
                "cpu_time_total": span.duration_us,
                "self_cpu_time_total": span.duration_us - sum(c.duration_us for c in children),
                "cpu_memory_usage": span.cpu_memory,
                "self_cpu_memory_usage": span.cpu_memory - sum(c.cpu_memory for c in children),
                "device_memory_usage": span.device_memory,
                "self_device_memory_usage": span.device_memory - sum(c.device_memory for c in children),
            }
            if on_cuda:
                total = device_total(span)
                values.update(device_time_total=total,
                              self_device_time_total=total - sum(device_total(c) for c in children))
        calls.append((span.start, -span.end, span.group, values))
    for i, (start, device, size, name) in enumerate(memory):
        if name == _OUT_OF_MEMORY or not placed[i]:  # a row of its own, as torch lists it
            row_name = _OUT_OF_MEMORY if name == _OUT_OF_MEMORY else "[memory]"
            cpu_bytes = size if device in _CPU_MEMORY else 0
            device_bytes = size if device in _DEVICE_MEMORY else 0
            calls.append((start, -start, (row_name, False, False),
                          {"cpu_memory_usage": cpu_bytes, "self_cpu_memory_usage": cpu_bytes,
                           "device_memory_usage": device_bytes, "self_device_memory_usage": device_bytes}))
    for _, _, group, values in sorted(calls, key=lambda call: call[:2]):
        row = rows.setdefault(group, TraceOperator(group[0]))
        row.count += 1
        for key, value in values.items():
            setattr(row, key, getattr(row, key) + value)
    return list(rows.values())
