"""The `agg-bench` command line: runs, determinism, and one-line errors with exit code 2."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from agg_bench.cli import main
from agg_bench.io import read_jsonl
from agg_bench.runtime.train import RECORD_KEYS, TIMING_KEYS

ROOT = Path(__file__).resolve().parents[2]
SMALL = ["--set", "model.resolution=32", "--set", "sampling.steps=4", "--set", "train.iterations=2",
         "--set", "progress=false"]


def records(out):
    return list(read_jsonl(Path(out) / "metrics.jsonl"))


def test_run_writes_contract_files(tmp_path, capsys):
    assert main(["run", "--config", str(ROOT / "config/run.yaml"), *SMALL, "--out", str(tmp_path / "r")]) == 0
    recs = records(tmp_path / "r")
    assert [r["iteration"] for r in recs] == [0, 1]
    for r in recs:
        assert set(RECORD_KEYS) <= set(r)
        assert r["status"] == "ok" and r["gpu_name"] is None and r["peak_alloc_bytes"] is None
        assert r["t_iter_cpu_s"] > 0 and r["t_train_cpu_s"] > 0
    # captured stderr is not a terminal: one progress line per iteration, as a job log gets
    lines = [line for line in capsys.readouterr().err.splitlines() if " iteration " in line]
    assert [line.split(" iteration ")[1].split()[0] for line in lines] == ["1/2", "2/2"]
    assert all("train " in line and "(cpu " in line and "reward " in line for line in lines)
    summary = json.loads((tmp_path / "r/summary.json").read_text())
    assert summary["status"] == "ok"
    assert "torch" in json.loads((tmp_path / "r/env.json").read_text())
    # config.json: the resolved run config (the file's keys, the overrides and the defaults of the rest)
    from agg_bench.config import load_config
    resolved = load_config(ROOT / "config/run.yaml", [arg for arg in SMALL if arg != "--set"]).to_dict()
    assert json.loads((tmp_path / "r/config.json").read_text()) == resolved and resolved["train"]["iterations"] == 2


def test_same_seed_twice_gives_identical_non_timing_fields(tmp_path):
    for name in ("a", "b"):
        assert main(["run", *SMALL, "--set", "run_id=same", "--set", "telemetry.saved_activations=every",
                     "--out", str(tmp_path / name)]) == 0
    strip = lambda r: {k: v for k, v in r.items() if k not in TIMING_KEYS}
    a, b = records(tmp_path / "a"), records(tmp_path / "b")
    assert all(r["saved_activation_peak_bytes"] > 0 for r in a)  # counted, and equal below
    assert [strip(r) for r in a] == [strip(r) for r in b]


def test_flux_preset_runs(tmp_path):
    assert main(["run", *SMALL, "--set", "model.family=flux", "--out", str(tmp_path / "f")]) == 0
    assert records(tmp_path / "f")[-1]["model"] == "flux-tiny"


@pytest.mark.parametrize("override, key", [
    ("train.lrr=1", "train.lrr"),
    ("train.lr=-1", "train.lr"),
    ("model.family=sdxl", "model.family"),
    ("method.name=nope", "method.name"),
    ("model.resolution=100", "model.resolution"),
    ("sampling.sde=ddim", "sampling.sde"),
    ("reward.name=aesthetics", "reward.name"),
    ("grpo.group_size=1", "grpo.group_size"),
    ("method.window=3", "method.window"),
])
def test_bad_config_is_one_line_and_exit_code_2(tmp_path, capsys, monkeypatch, override, key):
    # in-process: `python -m agg_bench` exits with main's code (test_a_bad_config_ends_the_process_with_one_line_...)
    monkeypatch.chdir(tmp_path)
    assert main(["run", *SMALL, "--set", override, "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and key in lines[0], err
    assert "Traceback" not in err
    assert not (tmp_path / "x" / "metrics.jsonl").exists()


def test_a_bad_config_ends_the_process_with_one_line_and_exit_code_2(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "agg_bench", "run", *SMALL, "--set", "train.lr=-1",
                           "--out", str(tmp_path / "x")], capture_output=True, text=True, cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "train.lr" in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "x" / "metrics.jsonl").exists()


def test_missing_config_file_is_a_user_error(tmp_path, capsys):
    assert main(["run", "--config", str(tmp_path / "nope.yaml"), "--out", str(tmp_path / "o")]) == 2
    assert "--config" in capsys.readouterr().err


def test_saved_activations_are_counted_in_the_iterations_the_config_names(tmp_path, capsys):
    peaks = {}
    for mode in ("first", "every", "never"):
        assert main(["run", *SMALL, "--set", "train.iterations=3", "--set", f"telemetry.saved_activations={mode}",
                     "--out", str(tmp_path / mode)]) == 0
        peaks[mode] = [r["saved_activation_peak_bytes"] for r in records(tmp_path / mode)]
    counted = peaks["every"]
    assert len(counted) == 3 and all(isinstance(p, int) and p > 0 for p in counted)
    assert peaks["first"] == [counted[0], None, None]
    assert peaks["never"] == [None, None, None]
    capsys.readouterr()
    assert main(["run", *SMALL, "--set", "telemetry.saved_activations=off", "--out", str(tmp_path / "bad")]) == 2
    assert "telemetry.saved_activations" in capsys.readouterr().err


def one_line_exit_2(capsys, argv: list[str], tmp_path: Path) -> str:
    """Run ``argv``; assert exit code 2, one stderr line, nothing written under ``tmp_path``; return the line."""
    capsys.readouterr()
    code = main(argv)
    lines = capsys.readouterr().err.splitlines()
    assert code == 2 and len(lines) == 1, lines
    assert not any(tmp_path.iterdir())
    return lines[0]


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
@pytest.mark.parametrize("verb, argv, flag", [
    ("replay", ["replay", "{tmp}/snapshot", "--method", "full", "--device", "cuda", "--out", "{tmp}/out/g.safetensors"],
     "--device"),
    ("gradcheck", ["gradcheck", *SMALL, "--device", "cuda:0", "--out", "{tmp}/out/g.csv"], "--device"),
    ("gradcheck", ["gradcheck", *SMALL, "--set", "device=cuda", "--out", "{tmp}/out/g.csv"], "device"),
    ("run", ["run", *SMALL, "--set", "device=cuda", "--out", "{tmp}/out"], "device"),
    ("profile", ["profile", *SMALL, "--method", "full", "--set", "device=cuda", "--out", "{tmp}/out"], "device"),
])
def test_cuda_on_a_machine_without_it_is_one_line(tmp_path, capsys, verb, argv, flag):
    line = one_line_exit_2(capsys, [a.replace("{tmp}", str(tmp_path)) for a in argv], tmp_path)
    assert line.startswith(f"agg-bench {verb}: config error: {flag} = 'cuda") and "CUDA is not available" in line


@pytest.mark.parametrize("device", ["gpu", "cuda:x", "cuda:1234567890123", "cuda:-1", ""])
def test_a_device_name_torch_does_not_take_is_one_line(tmp_path, capsys, device):
    line = one_line_exit_2(capsys, ["replay", str(tmp_path / "snapshot"), "--method", "full", "--device", device,
                                    "--out", str(tmp_path / "out" / "g.safetensors")], tmp_path)
    assert f"--device = {device!r}: expected cpu, cuda, cuda:N or auto" in line


def test_a_folder_name_that_is_no_utf8_text_gives_a_run_id_the_report_can_write(tmp_path):
    """A name's bytes that are no UTF-8 (or any non-ASCII name under LANG=C) came to the run id as lone
    surrogates: the records held them as escapes and the report stopped with a UnicodeEncodeError."""
    out = Path(os.fsdecode(os.fsencode(str(tmp_path)) + b"/caf\xe9"))
    assert main(["run", *SMALL, "--out", str(out)]) == 0
    assert json.loads((out / "summary.json").read_text())["run_id"] == "caf\\xe9"
    assert main(["report", "--runs", str(out), "--tables", str(tmp_path / "tables")]) == 0
    assert "caf\\xe9" in (tmp_path / "tables" / "records.csv").read_text(encoding="utf-8")
