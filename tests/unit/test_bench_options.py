"""The benchmark suite's own options: a bad one is one usage line before any case runs."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType, SimpleNamespace

import pytest

from agg_bench.config import integer_arg

ROOT = Path(__file__).resolve().parents[2]
BAD_OPTIONS = [
    ("--bench-config", "missing.yaml", "expected an existing YAML file"),
    ("--bench-config", "folder", "expected an existing YAML file"),
    ("--bench-config", "unknown.yaml", "expected a known key here"),
    ("--bench-threads", "0", "expected an integer >= 1"),
]


def bad_inputs(tmp_path: Path, option: str, value: str) -> str:
    """The files the bad options name; the option's value as given on the command line."""
    (tmp_path / "folder").mkdir()
    (tmp_path / "unknown.yaml").write_text("bogus: 1\n")
    return value if option != "--bench-config" else str(tmp_path / value)


def load(name: str, file: str, monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """benchmarks/FILE as the module ``name``, gone after the test."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / file)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, name, module)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("option, value, words", BAD_OPTIONS)
def test_a_bad_option_is_one_usage_line(tmp_path, monkeypatch, option, value, words):
    """The suite's checks themselves (benchmarks/conftest.py's pytest_configure), given the options as pytest
    parses them; the subprocess test below shows how pytest prints their refusal."""
    load("cases", "cases.py", monkeypatch)  # what the suite's conftest imports, as pytest finds it there
    conftest = load("benchmarks_conftest", "conftest.py", monkeypatch)
    given = {"--bench-config": str(conftest.DEFAULT_CONFIG), "--bench-device": "auto", "--bench-threads": None}
    arg = bad_inputs(tmp_path, option, value)
    given[option] = integer_arg(arg) if option == "--bench-threads" else arg
    config = SimpleNamespace(getoption=lambda name, default=None: given.get(name, default), option=SimpleNamespace())
    with pytest.raises(pytest.UsageError) as refused:
        conftest.pytest_configure(config)
    message = str(refused.value)
    assert "\n" not in message and message.startswith(option) and words in message, message


@pytest.mark.parametrize("option, value, words", [BAD_OPTIONS[2]])
def test_a_bad_option_is_one_usage_line_from_pytest(tmp_path, option, value, words):
    """Through pytest itself: its exit code 4 (a usage error) and one ERROR line, no traceback."""
    arg = bad_inputs(tmp_path, option, value)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-m", "pytest", "benchmarks", "--collect-only", "-q", "-p", "no:cacheprovider",
                           f"{option}={arg}"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    errors = [line for line in done.stderr.splitlines() if line.startswith("ERROR:")]
    assert done.returncode == 4 and len(errors) == 1, (done.stdout, done.stderr)
    assert option in errors[0] and words in errors[0] and "Traceback" not in done.stderr + done.stdout


def test_a_train_case_carries_the_contract_pass_counts(monkeypatch):
    """Each train-phase case's extra_info holds method, resolution and one update's pass counts by the names tools
    outside the repository read (docs/design.md, Benchmarks): benchmarks/test_bench_train.py's case run once on
    the smallest resolution, with a stand-in for pytest-benchmark's fixture."""
    cases = load("cases", "cases.py", monkeypatch)
    bench = load("bench_train", "test_bench_train.py", monkeypatch)
    from agg_bench.runtime.session import Session

    case = next(c for c in cases.CASES if c.id == "agg")

    sessions = []

    def prepare(case, resolution):
        sessions.append(Session(cases.case_config(cases.DEFAULT_CONFIG, "cpu", case, resolution)))
        return cases.Prepared(sessions[-1], sessions[-1].collect(0).batch)

    class Benchmark:  # what the case uses of pytest-benchmark's fixture; the timed function is only kept
        def __init__(self):
            self.extra_info: dict = {}
            self.group = None

        def __call__(self, function):
            calls.append(function)

    calls: list = []
    fixture = Benchmark()
    try:
        bench.test_train_phase(fixture, prepare, case, 32)
    finally:
        for session in sessions:
            session.estimator.close()
    info = fixture.extra_info
    assert (info["method"], info["resolution"], len(calls)) == ("agg", 32, 1)
    # one group of W = 5 steps per sample: W no-grad forwards and two endpoint passes (docs/design.md, AGG)
    b = info["batch_size"]
    assert (info["forward_nograd"], info["forward_grad"], info["backward"]) == (5 * b, 2 * b, 2 * b)
