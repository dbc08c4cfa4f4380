"""Live curves (``telemetry.tensorboard: true``): every record's numbers as TensorBoard scalars in
``DIR/tensorboard/`` at step = its iteration, equal to ``metrics.jsonl``; off by default; a resumed run
shows each iteration once; a run that cannot import a writer, or is given a non-bool, is refused before
anything is written.

The parts that read events skip where the tensorboard package is not installed (the ``profile`` extra);
the refusal and the scalar selection are tested everywhere. (That a run with the option off imports no
tensorboard needs a fresh interpreter: tests/integration/test_fresh_interpreters.py.)"""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from agg_bench.cli import main
from agg_bench.io import read_jsonl
from agg_bench.runtime import session as session_module
from agg_bench.runtime.scalar_events import FOLDER, scalars
from agg_bench.runtime.train import Session, train
from helpers import tiny_config

SMALL = ["model.resolution=32", "sampling.steps=4", "grpo.group_size=2", "grpo.prompts_per_iteration=1",
         "progress=false"]
ON = "telemetry.tensorboard=true"
ROOT = Path(__file__).resolve().parents[2]
IDENTITY = ("run_id", "method", "model", "resolution", "device", "gpu_name", "n_gpus", "seed", "weights")


def run_cli(out: Path, *overrides: str) -> int:
    return main(["run", *[a for o in (*SMALL, *overrides) for a in ("--set", o)], "--out", str(out)])


def records(out: Path) -> list[dict]:
    return list(read_jsonl(out / "metrics.jsonl"))


def curves(out: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar tag in ``out/tensorboard`` with its (step, value) events, as TensorBoard shows them."""
    accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    events = accumulator.EventAccumulator(str(out / FOLDER), size_guidance={accumulator.SCALARS: 0})
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def expected_curves(recs: list[dict]) -> dict[str, list[tuple[int, float]]]:
    """The records' finite numbers per key, as TensorBoard keeps them (32-bit floats)."""
    out: dict[str, list[tuple[int, float]]] = {}
    for record in recs:
        for key, value in record.items():
            if key in (*IDENTITY, "iteration") or isinstance(value, str) or value is None:
                continue
            if math.isfinite(value):
                out.setdefault(key, []).append((record["iteration"], float(np.float32(value))))
    return out


def test_every_records_numbers_are_scalars_at_its_iteration(tmp_path):
    pytest.importorskip("tensorboard")
    out = tmp_path / "run"
    prompts = tmp_path / "scenes.txt"
    prompts.write_text("one green circle on the right\n")
    # the scene reward adds its sub-scores (reward_color, ...) to the records
    assert run_cli(out, ON, "train.iterations=3", "reward.name=scene", f"prompts.file={prompts}",
                   "telemetry.enabled=true") == 0
    recs = records(out)
    got = curves(out)
    assert got == expected_curves(recs)
    for key in ("reward_mean", "reward_color", "loss", "grad_norm", "t_iter_s", "backward", "rss_peak_bytes"):
        assert [step for step, _ in got[key]] == [0, 1, 2], key
    assert got["reward_color"] == [(r["iteration"], float(np.float32(r["reward_color"]))) for r in recs]
    assert not set(got) & {*IDENTITY, "iteration", "status"}  # the run's identity and text are no curves


def test_a_rerun_replaces_the_curves_and_one_without_them_removes_them(tmp_path):
    pytest.importorskip("tensorboard")
    out = tmp_path / "run"
    assert run_cli(out, ON, "train.iterations=2") == 0
    assert run_cli(out, ON, "train.iterations=2") == 0  # the same run again: its curves start over
    assert curves(out) == expected_curves(records(out))
    # the option changes nothing a record holds: the same run, replaced without --overwrite
    assert run_cli(out, "train.iterations=2") == 0
    assert not (out / FOLDER).exists()


def test_a_resumed_run_shows_each_iteration_once(tmp_path, monkeypatch):
    pytest.importorskip("tensorboard")
    out = tmp_path / "run"
    cfg = tiny_config(ON, "train.iterations=4", "train.checkpoint_every=2", dtype="float32")
    original, calls = Session.collect, []

    def fail_in_iteration_3(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 4:
            raise RuntimeError("a failure in iteration 3")
        return original(self, *args, **kwargs)

    monkeypatch.setattr(Session, "collect", fail_in_iteration_3)
    with pytest.raises(RuntimeError):
        train(cfg, out)
    monkeypatch.undo()
    # closed on failure: the events of every record written are on disk
    assert [step for step, _ in curves(out)["loss"]] == [0, 1, 2]
    assert json.loads((out / "summary.json").read_text())["checkpoint_iteration"] == 1
    train(cfg, out, resume=True)  # iteration 2's record is dropped and recomputed, with new timings
    recs = records(out)
    assert [r["iteration"] for r in recs] == [0, 1, 2, 3]
    assert curves(out) == expected_curves(recs)


def test_an_oom_while_building_writes_its_record_too(tmp_path, monkeypatch):
    pytest.importorskip("tensorboard")
    monkeypatch.setattr(session_module, "build_policy",
                        lambda *a, **k: (_ for _ in ()).throw(torch.OutOfMemoryError("out of memory")))
    out = tmp_path / "run"
    assert run_cli(out, ON) == 0
    (record,) = records(out)
    assert record["status"] == "oom"
    assert curves(out) == expected_curves([record]) and "rss_peak_bytes" in curves(out)


def test_without_a_writer_the_run_is_refused_before_anything_is_written(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # as where tensorboard is not installed
    out = tmp_path / "run"
    assert run_cli(out, ON) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "telemetry.tensorboard = True" in err[0] and "agg-bench[profile]" in err[0]
    assert not out.exists()
    assert run_cli(out, "train.iterations=1") == 0  # off, no writer is needed


def test_a_value_that_is_not_a_bool_is_a_config_error(tmp_path, capsys):
    out = tmp_path / "run"
    assert run_cli(out, "telemetry.tensorboard=maybe") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "telemetry.tensorboard" in err[0] and "'maybe'" in err[0]
    assert not out.exists()


def test_scalars_are_the_finite_numbers_of_a_record():
    record = {"iteration": 3, "run_id": "r", "loss": 0.5, "backward": 16, "diverged": False, "ok": True,
              "grad_norm": float("nan"), "reward_mean": float("inf"), "energy_j": None, "sizes": [1, 2],
              "reward_color": np.float32(0.25), "status": "ok"}
    assert scalars(record, skip=("iteration",)) == {"loss": 0.5, "backward": 16.0, "diverged": 0.0, "ok": 1.0,
                                                    "reward_color": 0.25}
