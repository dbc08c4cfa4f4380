"""profile_steps on CPU: traces and an operator table from a tiny model."""
from __future__ import annotations

import csv
import gzip
import json
from pathlib import Path

import pytest
import torch
from torch import nn

from agg_bench.tools.profiling import profile_steps


def tiny_step():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    calls = []

    def step() -> None:
        calls.append(1)
        optimizer.zero_grad()
        model(torch.randn(8, 16)).pow(2).mean().backward()
        optimizer.step()

    return step, calls


def read_trace(path: Path) -> dict:
    opener = gzip.open if path.name.endswith(".gz") else open
    with opener(path, "rt") as handle:
        return json.load(handle)


def read_operators(path: Path) -> list[dict]:
    with open(path, newline="") as handle:
        return list(csv.DictReader(handle))


def test_profile_writes_trace_and_operator_table(tmp_path):
    step, calls = tiny_step()
    out_dir = tmp_path / "profile"
    written = profile_steps(step, out_dir, "cpu", wait=1, warmup=1, active=1, with_stack=False)

    assert len(calls) == 3
    assert set(written) == {"trace_0", "operators"}  # no memory snapshot on CPU
    trace = Path(written["trace_0"])
    assert trace.parent == out_dir
    assert trace.name.endswith(".pt.trace.json.gz")  # gzipped: a plain trace of even a tiny run is megabytes
    assert read_trace(trace)["traceEvents"]

    rows = read_operators(Path(written["operators"]))
    assert rows
    assert list(rows[0]) == ["cycle", "name", "calls", "self_cpu_time_us", "cpu_time_total_us",
                             "self_cpu_memory_bytes", "cpu_memory_bytes"]
    names = {row["name"] for row in rows}
    assert "aten::addmm" in names or "aten::linear" in names
    assert all(int(row["calls"]) >= 1 and row["cycle"] == "0" for row in rows)


def test_profile_repeats_write_one_trace_per_cycle(tmp_path):
    step, calls = tiny_step()
    written = profile_steps(step, tmp_path, torch.device("cpu"), wait=0, warmup=1, active=1, repeat=2)
    assert len(calls) == 4
    assert {"trace_0", "trace_1"} <= set(written)
    assert written["trace_0"] != written["trace_1"]
    assert all(Path(written[k]).is_file() for k in ("trace_0", "trace_1"))
    cycles = {row["cycle"] for row in read_operators(Path(written["operators"]))}
    assert cycles == {"0", "1"}


def test_profile_rejects_an_empty_schedule(tmp_path):
    step, calls = tiny_step()
    with pytest.raises(ValueError, match="active = 0"):
        profile_steps(step, tmp_path, "cpu", active=0)
    assert calls == []


def test_a_cycle_whose_events_cannot_be_parsed_keeps_its_trace_and_operator_table(tmp_path, monkeypatch, capsys):
    """torch's parser of memory events can fail on a garbled event name: that cycle's trace is still written,
    and its operator rows, summed from the trace, are the ones torch's own table gives, with a line on stderr
    saying so."""
    from torch.profiler import profile

    parsed = []
    key_averages = profile.key_averages

    def garbled(self, *args, **kwargs):
        parsed.append(key_averages(self, *args, **kwargs))  # what torch gives where it can read its events
        raise UnicodeDecodeError("utf-8", b"\xe9", 0, 1, "invalid continuation byte")

    monkeypatch.setattr(profile, "key_averages", garbled)
    step, _ = tiny_step()
    written = profile_steps(step, tmp_path / "profile", "cpu", wait=0, warmup=0, active=1, with_stack=False)
    assert read_trace(Path(written["trace_0"]))["traceEvents"]
    rows = read_operators(Path(written["operators"]))
    # the rows sorted by self time, as torch's table; rows of equal self time (to the summing order's rounding) may
    # come in either order
    self_times = [float(row["self_cpu_time_us"]) for row in rows]
    assert all(a >= b - 1e-6 for a, b in zip(self_times, self_times[1:])), self_times
    by_name = {event.key: event for event in parsed[0]}
    assert sorted(row["name"] for row in rows) == sorted(by_name) and len(rows) == len(by_name)
    for row in rows:
        event = by_name[row["name"]]
        assert row["cycle"] == "0" and int(row["calls"]) == event.count, row
        assert float(row["self_cpu_time_us"]) == pytest.approx(event.self_cpu_time_total, abs=1e-3)
        assert float(row["cpu_time_total_us"]) == pytest.approx(event.cpu_time_total, abs=1e-3)
        assert int(row["self_cpu_memory_bytes"]) == event.self_cpu_memory_usage
        assert int(row["cpu_memory_bytes"]) == event.cpu_memory_usage
    assert "cycle 0: torch could not read the profiler's events" in capsys.readouterr().err


def test_a_cycle_whose_events_and_trace_cannot_be_read_keeps_its_trace(tmp_path, monkeypatch, capsys):
    """Where the trace cannot be summed either, the cycle has no operator rows and the profile is still written."""
    from torch.profiler import profile

    from agg_bench.tools import profiling

    def garbled(self, *args, **kwargs):
        raise UnicodeDecodeError("utf-8", b"\xe9", 0, 1, "invalid continuation byte")

    def unreadable(path, on_cuda):
        raise ValueError("Expecting value: line 1 column 1 (char 0)")

    monkeypatch.setattr(profile, "key_averages", garbled)
    monkeypatch.setattr(profiling, "trace_operators", unreadable)
    step, _ = tiny_step()
    written = profile_steps(step, tmp_path / "profile", "cpu", wait=0, warmup=0, active=1, with_stack=False)
    assert read_trace(Path(written["trace_0"]))["traceEvents"]
    assert read_operators(Path(written["operators"])) == []
    err = capsys.readouterr().err
    assert "cycle 0: torch could not read the profiler's events" in err and "nor its trace (ValueError" in err


def chrome_trace() -> list[dict]:
    """A CUDA cycle's trace as torch.profiler writes it (times in us): a profiler step holding a linear (an
    addmm inside it, launching a kernel) and a mean called through a mean of its own name; allocations in
    and outside the ops, on the CPU and the GPU; an event name that was not UTF-8."""
    def op(name, ts, dur, ext, cat="cpu_op", tid=7, pid=100):
        return {"ph": "X", "cat": cat, "name": name, "pid": pid, "tid": tid, "ts": ts, "dur": dur,
                "args": {"External id": ext}}

    def alloc(ts, size, device):
        return {"ph": "i", "cat": "cpu_instant_event", "s": "t", "name": "[memory]", "pid": 100, "tid": 7,
                "ts": ts, "args": {"Bytes": size, "Device Type": device, "Total Allocated": 0}}

    return [
        {"ph": "X", "cat": "Trace", "name": "PyTorch Profiler (0)", "pid": "Spans", "tid": "PyTorch Profiler",
         "ts": 999.0, "dur": 200.0},
        op("ProfilerStep#4", 1000.0, 100.0, 1, cat="user_annotation"),
        op("aten::linear", 1010.0, 40.0, 2),
        op("aten::addmm", 1015.5, 30.25, 3),
        op("cudaLaunchKernel", 1020.0, 5.0, 3, cat="cuda_runtime"),
        op("gemm_kernel", 1030.0, 12.5, 3, cat="kernel", pid=0, tid=7),
        op("aten::mean", 1060.0, 20.0, 4),
        op("aten::mean", 1061.0, 18.0, 5),
        op("aten::sum", 1062.0, 10.0, 6),
        op("reduce_kernel", 1070.0, 3.0, 6, cat="kernel", pid=0, tid=7),
        op("aten::empty", 1090.0, 2.0, 7),
        op("profiler::_record_function_exit", 1095.0, 1.0, 8),
        op("aten::\ufffd", 1120.0, 4.0, 9),  # a byte 0xff in the file, read as U+FFFD
        op("aten::empty", 1130.0, 1.0, 10, tid=8),  # another thread
        alloc(1016.0, 512, 0), alloc(1020.5, 4096, 1), alloc(1063.0, 256, 0), alloc(1091.0, 64, 0),
        alloc(1110.0, 32, 0), alloc(1111.0, -32, 0),  # in no op: a row [memory] each
        {"ph": "i", "cat": "cpu_instant_event", "s": "t", "name": "[\x07emory]", "pid": 100, "tid": 7,
         "ts": 1130.5, "args": {"Bytes": 128, "Device Type": 0}},  # a garbled name: still an allocation
    ]


def test_the_operator_table_summed_from_a_trace(tmp_path):
    """Rows of a cycle summed from its Chrome trace (the table where torch cannot parse the events): per
    operator name, calls and CPU time (self: less the ops nested in it), the kernels of its External id as
    CUDA time, and the allocations within its span as memory, sorted by self CUDA time."""
    from agg_bench.tools.profiling import _write_operator_table, trace_operators

    events = chrome_trace()
    text = json.dumps({"traceEvents": events}).replace("aten::\\ufffd", "aten::@@")
    trace = tmp_path / "host_1.pt.trace.json.gz"
    with gzip.open(trace, "wb") as handle:
        handle.write(text.encode().replace(b"@@", b"\xff"))
    table = tmp_path / "operators.csv"
    _write_operator_table(table, [trace_operators(trace, on_cuda=True)], on_cuda=True)
    rows = {row["name"]: row for row in read_operators(table)}

    def dur(name, ext=None):
        return sum(e["dur"] for e in events if e["name"] == name and ext in (None, e["args"].get("External id")))

    gemm, reduce = dur("gemm_kernel"), dur("reduce_kernel")
    expected = {  # name: calls, self CPU, total CPU, self CUDA, total CUDA, self CPU bytes, CPU bytes, CUDA bytes
        "ProfilerStep*": (1, dur("ProfilerStep#4") - dur("aten::linear") - dur("aten::mean", 4) - dur("aten::empty", 7),
                          dur("ProfilerStep#4"), 0, gemm + reduce, 0, 512 + 256 + 64, 4096),
        "aten::linear": (1, dur("aten::linear") - dur("aten::addmm"), dur("aten::linear"), 0, gemm, 0, 512, 4096),
        "aten::addmm": (1, dur("aten::addmm") - dur("cudaLaunchKernel"), dur("aten::addmm"), gemm, gemm, 512, 512,
                        4096),
        "cudaLaunchKernel": (1, dur("cudaLaunchKernel"), dur("cudaLaunchKernel"), 0, 0, 0, 0, 4096),
        # the inner mean is one call with the outer one (torch's table): its sum is the outer one's child
        "aten::mean": (1, dur("aten::mean", 4) - dur("aten::sum"), dur("aten::mean", 4), 0, reduce, 0, 256, 0),
        "aten::sum": (1, dur("aten::sum"), dur("aten::sum"), reduce, reduce, 256, 256, 0),
        "aten::empty": (2, dur("aten::empty"), dur("aten::empty"), 0, 0, 64 + 128, 64 + 128, 0),
        "aten::\ufffd": (1, 4.0, 4.0, 0, 0, 0, 0, 0),
        "[memory]": (2, 0, 0, 0, 0, 0, 0, 0),
        "gemm_kernel": (1, 0, 0, gemm, gemm, 0, 0, 0),
        "reduce_kernel": (1, 0, 0, reduce, reduce, 0, 0, 0),
    }
    assert set(rows) == set(expected)  # no trace span, no profiler bookkeeping op
    for name, (calls, self_cpu, cpu, self_cuda, cuda, self_bytes, cpu_bytes, cuda_bytes) in expected.items():
        row = rows[name]
        assert int(row["calls"]) == calls, name
        assert float(row["self_cpu_time_us"]) == pytest.approx(self_cpu), name
        assert float(row["cpu_time_total_us"]) == pytest.approx(cpu), name
        assert float(row["self_cuda_time_us"]) == pytest.approx(self_cuda), name
        assert float(row["cuda_time_total_us"]) == pytest.approx(cuda), name
        assert int(row["self_cpu_memory_bytes"]) == self_bytes, name
        assert int(row["cpu_memory_bytes"]) == cpu_bytes, name
        assert int(row["cuda_memory_bytes"]) == cuda_bytes, name
    self_cuda = [float(row["self_cuda_time_us"]) for row in read_operators(table)]
    assert self_cuda == sorted(self_cuda, reverse=True)
    assert sum(self_cuda) == pytest.approx(gemm + reduce + gemm + reduce)  # each kernel: its op's and its own row


def test_a_failing_profile_removes_its_own_traces_and_keeps_the_earlier_ones(tmp_path):
    """A step that fails after a cycle's trace was written: that trace goes, the earlier call's stay."""
    step, calls = tiny_step()
    earlier = profile_steps(step, tmp_path, "cpu", wait=0, warmup=0, active=1, with_stack=False)

    def failing() -> None:
        if len(calls) == 2:  # the second cycle of the call below (the first call ran one step)
            raise RuntimeError("the step failed")
        step()

    with pytest.raises(RuntimeError, match="the step failed"):
        profile_steps(failing, tmp_path, "cpu", wait=0, warmup=0, active=1, repeat=2, with_stack=False)
    assert len(calls) == 2  # its first cycle ran and wrote a trace
    assert sorted(str(p) for p in tmp_path.glob("*.pt.trace.json*")) == [earlier["trace_0"]]


def test_an_operator_name_a_spreadsheet_would_run_is_written_after_a_quote(tmp_path):
    """operators.csv goes through the CSV cell writer of every agg-bench CSV (formatting.csv_cell): a
    record_function label such as ``=cmd|...`` or ``-x`` is written after a single quote, a number (a negative
    memory delta too) as it is."""
    from agg_bench.tools.profiling import TraceOperator, _write_operator_table

    table = tmp_path / "operators.csv"
    cycle = [TraceOperator("=cmd|' /C calc'!A0", count=1, self_cpu_time_total=3.0, self_cpu_memory_usage=-512),
             TraceOperator("-x", count=2, self_cpu_time_total=2.0), TraceOperator("aten::mm", count=1)]
    _write_operator_table(table, [cycle], on_cuda=False)
    rows = read_operators(table)
    assert [row["name"] for row in rows] == ["'=cmd|' /C calc'!A0", "'-x", "aten::mm"]
    assert rows[0]["self_cpu_memory_bytes"] == "-512" and rows[1]["calls"] == "2"
