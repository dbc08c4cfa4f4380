"""scripts/gpu_check.sh --cpu: every step of the GPU check on the tiny models on the CPU, so the script
cannot rot. Runtime: about 1 CPU-minute (11 short processes)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]


@pytest.mark.slow
def test_gpu_check_script_on_the_cpu(tmp_path):
    out = tmp_path / "gpu_check"
    env = {**os.environ, "PYTHON": sys.executable, "AGG_BENCH_CHECK_OUT": str(out), "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--cpu"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=600)
    report = (out / "summary.md").read_text() if (out / "summary.md").exists() else ""
    assert proc.returncode == 0, proc.stderr[-3000:] + report
    summary = json.loads((out / "summary.json").read_text())
    assert summary["mode"] == "cpu" and (out / "summary.md").read_text().startswith("# GPU check (cpu)")
    steps = {s["step"]: s["ok"] for s in summary["steps"]}
    assert all(steps.values()) and {"env", "fsdp_32", "pool_32", "profile_32", "cached-fora_32"} <= set(steps)
    runs = {r["run"]: r for r in summary["runs"]}
    for res in (32, 64):
        full, agg, reuse = runs[f"full_{res}"], runs[f"agg-w5_{res}"], runs[f"agg-w5-reuse_{res}"]
        # 10 steps x 4 samples exact; AGG W=5: 2 groups x 2 endpoint backwards x 4 samples
        assert (full["backward"], agg["backward"], reuse["backward"]) == (40, 16, 16)
        for run in (full, agg, reuse):
            assert run["status"] == "ok" and run["t_train_s"] > 0, report
            # on the CPU the planner's count is exact
            assert run["saved_activation_peak_bytes"] == run["planned_activation_bytes"]
            assert run["planned_total_bytes"] > run["planned_activation_bytes"]
        assert agg["train_speedup"] is not None and full["train_speedup"] is None
    # anything but --cpu is refused
    bad = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--gpu"], capture_output=True, text=True)
    assert bad.returncode == 2 and "usage" in bad.stderr
