"""CPU threads of the harness's processes (agg_bench/threads.py): short OpenMP spin-waits unless the user
chose a wait, set before torch loads its OpenMP runtime; thread counts matched to the cores a process or
job was given."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from agg_bench.threads import usable_cores
from agg_bench.tools.pretrain import load_pretrain_config, pretrain

# a CLI command that imports torch (loading libgomp) and little else, writing nothing (one that loads a model's
# code imported diffusers, transformers and peft besides: seconds of CPU)
CLI = ["-m", "agg_bench", "env"]


def spin_count(args: list[str], cwd: Path | None = None, **user: str) -> str:
    """libgomp's spin count in a fresh Python process running ``args``, started with the environment
    variables ``user`` and without any other wait setting, as libgomp reports it when it loads
    (``OMP_DISPLAY_ENV=verbose``); ``cwd``: the folder it runs in."""
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    env.update(user, OMP_DISPLAY_ENV="verbose")
    proc = subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True, timeout=120, cwd=cwd)
    for line in proc.stderr.splitlines():
        if line.strip().startswith("GOMP_SPINCOUNT = "):
            return line.split("=", 1)[1].strip().strip("'")
    pytest.skip("torch's OpenMP runtime is not libgomp (no GOMP_SPINCOUNT in OMP_DISPLAY_ENV's report)")


def test_the_cli_spins_briefly_unless_the_user_chose_a_wait(tmp_path):
    # libgomp alone spins 300,000 times per wait (PASSIVE: 0, ACTIVE: 30,000,000,000)
    assert spin_count(CLI, cwd=tmp_path) == "10000"
    assert not any(tmp_path.iterdir())  # the command wrote nothing
    # the user's choice as torch's OpenMP runtime reads it when it loads: the runtime loaded on its own, where it
    # is torch's own copy (torch's import took seconds of CPU), else with torch
    importing = ["-c", "import agg_bench, ctypes, pathlib, importlib.util\n"
                       "gomp = pathlib.Path(importlib.util.find_spec('torch').origin).parent / 'lib' / 'libgomp.so.1'\n"
                       "ctypes.CDLL(str(gomp)) if gomp.is_file() else __import__('torch')"]
    assert spin_count(importing, OMP_WAIT_POLICY="PASSIVE") == "0"
    assert spin_count(importing, GOMP_SPINCOUNT="500") == "500"


def test_pretrain_threads_are_capped_at_the_usable_cores(tmp_path):
    """A config asking for more threads than the process may use runs on the usable cores (more would wait
    for each other), and the caller's thread count is restored after the call."""
    before = torch.get_num_threads()
    summary = pretrain(load_pretrain_config(None, ["steps=1", "batch_size=2", "num_layers=1", "sample_steps=1",
                                                   "warmup_steps=0", "threads=512"]), tmp_path / "m", progress=False)
    assert summary["threads"] == min(512, usable_cores()) and summary["config"]["threads"] == 512
    assert torch.get_num_threads() == before
