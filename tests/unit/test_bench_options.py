"""The benchmark suite's own options: a bad one is one usage line before any case runs."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("option, value, words", [
    ("--bench-config", "missing.yaml", "expected an existing YAML file"),
    ("--bench-config", "folder", "expected an existing YAML file"),
    ("--bench-config", "unknown.yaml", "expected a known key here"),
    ("--bench-threads", "0", "expected an integer >= 1"),
])
def test_a_bad_option_is_one_usage_line(tmp_path, option, value, words):
    (tmp_path / "folder").mkdir()
    (tmp_path / "unknown.yaml").write_text("bogus: 1\n")
    arg = value if option != "--bench-config" else str(tmp_path / value)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-m", "pytest", "benchmarks", "--collect-only", "-q", "-p", "no:cacheprovider",
                           f"{option}={arg}"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    errors = [line for line in done.stderr.splitlines() if line.startswith("ERROR:")]
    assert done.returncode == 4 and len(errors) == 1, (done.stdout, done.stderr)
    assert option in errors[0] and words in errors[0] and "Traceback" not in done.stderr + done.stdout
