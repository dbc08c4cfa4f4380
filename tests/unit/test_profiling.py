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


def test_a_cycle_whose_events_cannot_be_parsed_keeps_its_trace(tmp_path, monkeypatch, capsys):
    """torch's parser of memory events can fail on a garbled event name: that cycle's trace is still
    written and only its operator rows are missing, with a line on stderr saying so."""
    from torch.profiler import profile

    def garbled(self, *args, **kwargs):
        raise UnicodeDecodeError("utf-8", b"\xe9", 0, 1, "invalid continuation byte")

    monkeypatch.setattr(profile, "key_averages", garbled)
    step, _ = tiny_step()
    written = profile_steps(step, tmp_path / "profile", "cpu", wait=0, warmup=0, active=1, with_stack=False)
    assert read_trace(Path(written["trace_0"]))["traceEvents"]
    assert read_operators(Path(written["operators"])) == []
    assert "cycle 0: no operator table" in capsys.readouterr().err


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
