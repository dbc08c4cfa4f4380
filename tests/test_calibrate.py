"""agg-bench calibrate: unit costs of each pass from interleaved repetitions; bad options refused."""
import json
import math
from pathlib import Path

import pytest

from agg_bench.calibrate import CalibrationConfig
from agg_bench.cli import main
from agg_bench.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]
SMALL = ["--config", str(ROOT / "config/run.yaml"), "--set", "model.resolution=32", "--set", "sampling.steps=4",
         "--set", "grpo.prompts_per_iteration=1"]


def test_calibrate_writes_a_unit_cost_per_pass_and_basis(tmp_path, capsys):
    out = tmp_path / "cal.json"
    assert main(["calibrate", *SMALL, "--repeats", "3", "--warmup", "0", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert (result["model"], result["resolution"], result["device"], result["batch"]) == ("sd3-tiny", 32, "cpu", 4)
    units = result["unit_s_per_sample"]
    assert set(units) == {"forward_nograd", "forward_grad", "backward", "optimizer_step"}
    for kind, by_basis in units.items():
        for basis in ("cpu", "wall"):
            p25, median, p75 = (by_basis[basis][k] for k in ("p25", "median", "p75"))
            assert math.isfinite(median) and median > 0 and p25 <= median <= p75, (kind, basis)
    assert json.loads(capsys.readouterr().out)["out"] == str(out)


@pytest.mark.parametrize("key, value", [("repeats", 0), ("repeats", -1), ("repeats", 10 ** 9), ("repeats", 2.5),
                                        ("repeats", True), ("warmup", -1), ("warmup", float("nan"))])
def test_bad_calibration_options_are_refused(key, value):
    with pytest.raises(ConfigError, match=f"calibrate.{key}"):
        CalibrationConfig(**{key: value})


def test_bad_repeats_on_the_command_line_is_exit_2_and_writes_nothing(tmp_path, capsys):
    out = tmp_path / "cal.json"
    assert main(["calibrate", *SMALL, "--repeats", "0", "--out", str(out)]) == 2
    assert "calibrate.repeats" in capsys.readouterr().err and not out.exists()
