"""Resume identity for every method of the sweep (config/config.yaml) and every preset (config/presets/): a run
stopped and resumed (``--resume``) writes exactly the records of an uninterrupted run, every field but timings.

What each case carries from one iteration to the next, which a resume must restore exactly: the optimizer state
and policy version (all); random draws of the run's CPU generator (``fraction``'s steps, ``window``'s random start,
``guess``'s per-row draws with ``zero_loss_on_guess``, AGG's routing, ``branch``'s shuffle of its transitions); a
window that moves with the iteration (``window``/``mixgrpo_flash`` progressive, with roll-back); moving averages
of the policy (``nft``'s old policy, ``awm``'s EMA-KL, ``dgpo``'s ``ema_ref`` as sampler, clip and reference, the
presets' ``train.eval_ema``); a cache's state (every ``method.cache``, in the rollout and in training); LoRA
adapters; several optimizer steps per iteration (``train.minibatches`` of groups or slices, ``inner_epochs``,
``branch``'s ``transitions_per_step``).

Stop points: SIGTERM between iterations (before the rollout of iteration 3; the interruption's checkpoint holds
iteration 2), in the middle of a rollout (a transformer call of iteration 2, with ``train.checkpoint_every`` 3
not dividing it), in the method's gradient before the update's first optimizer step, between two optimizer steps
(the cases with several per iteration: the signal waits for the record), and a failure that writes no checkpoint
(as ``kill -9``: the run goes on from the periodic checkpoint of iteration 1 and recomputes iteration 2). Every
case takes the first; the cases with the most state take all that apply. The uninterrupted runs are made once
and shared (``_REFERENCE``). A real ``kill -9`` of the process is tests/integration/test_signals.py's.
"""
from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
import yaml

from agg_bench import stopping
from agg_bench.config import load_config
from agg_bench.io import read_jsonl
from agg_bench.runtime import memplan
from agg_bench.runtime.train import TIMING_KEYS, Interrupted, Session, train
from helpers import signal_after_first_optimizer_step

ROOT = Path(__file__).resolve().parents[2]
SWEEP = yaml.safe_load((ROOT / "config/config.yaml").read_text())
PRESETS = sorted(p.stem for p in (ROOT / "config/presets").glob("*.yaml"))
ITERATIONS = 4
SMALL = ["model.resolution=32", "sampling.steps=4", "grpo.group_size=2", "progress=false", "run_id=resume",
         f"train.iterations={ITERATIONS}"]
# what shrinks a sweep method or a preset to SMALL (its windows, tree and times fit in 4 steps, its group in 2-4)
SWEEP_SHRUNK = {
    "agg-w5-sigma": ["method.window=4"],
    "agg-w5-sigma-reuse": ["method.window=4", "train.inner_epochs=2"],
    "agg-w5-sigma-endpoints": ["method.window=4"],
    "agg-w5-route0.5": ["method.window=2", "grpo.prompts_per_iteration=2"],
    "flow-grpo-fast": ["method.window_size=2"],
    "mixgrpo-flash": ["method.window_size=2", "method.window_wrap=true", "method.window_end=3"],
    "branch": ["method.branch_points=[0, 2]", "grpo.group_size=4", "method.transitions_per_step=3"],
    "guess": ["grpo.group_size=3", "method.zero_loss_on_guess=true", "train.timestep_fraction=0.6"],
    "dgpo": ["method.trunc_steps=2", "method.times_per_sample=2", "method.ema_reference=true",
             "method.clip_dsm=true", "method.ema_rollout_after=1"],
}
PRESET_SHRUNK = {
    "awm": [],
    "branchgrpo": ["method.branch_points=[0, 2]", "grpo.group_size=4", "method.transitions_per_step=3"],
    "dgpo": ["method.trunc_steps=2", "method.times_per_sample=2", "train.eval_ema_every=2",
             "method.ema_rollout_after=1"],
    "diffusionnft": ["method.times_per_sample=3"],
    "flow_grpo": ["train.eval_ema_every=2"],
    "flow_grpo_fast": ["method.window_size=2", "train.eval_ema_every=2"],
    "guess_ab2": ["method.guessed=1", "grpo.group_size=3"],
    "mixgrpo_flash": ["method.window_size=2", "method.window_interval=1", "method.window_end=3",
                      "grpo.group_size=4"],
    "qwenimage_720_reference": ["train.plan_window=2", "method.window=2", "grpo.prompts_per_iteration=1",
                                "reward.options={}", "reward.name=jpeg_compressibility", "model.pretrained=null"],
    "teacache_flux": ["method.trajectory_steps=4"],
    "tiny_sd3_reference_cpu": ["train.plan_window=2", "method.window=2"],
}
# caches the sweep does not run, in the rollout and in training
CACHES = ["pab", "fastercache", "magcache", "taylorseer", "deltadit"]


def _sweep_case(name: str) -> tuple[Path, list[str]]:
    sets = [f"{k}={json.dumps(v)}" for k, v in {**SWEEP["set"], **SWEEP["methods"][name]}.items()]
    return ROOT / SWEEP["base"], [*sets, *SMALL, *SWEEP_SHRUNK.get(name, [])]


CASES: dict[str, tuple[Path | None, list[str]]] = {
    **{f"sweep:{name}": _sweep_case(name) for name in SWEEP["methods"]},
    **{f"preset:{name}": (ROOT / f"config/presets/{name}.yaml",
                          [*SMALL, "device=cpu", "model.preset=tiny", "model.dtype=float32", *PRESET_SHRUNK[name]])
       for name in PRESETS},
    **{f"cache:{name}": (None, [*SMALL, f'method={{"name": "cached", "cache": "{name}", "cache_in": "both"}}'])
       for name in CACHES},
    "lora": (None, [*SMALL, "train.lora_rank=2", "train.inner_epochs=2"]),
    "slices": (None, [*SMALL, "grpo.group_size=4", "train.minibatches=2", "train.minibatch_unit=slices"]),
}
# the cases with several optimizer steps per iteration
SEVERAL_STEPS = ["sweep:agg-w5-sigma-reuse", "sweep:branch", "preset:flow_grpo", "preset:flow_grpo_fast",
                 "preset:mixgrpo_flash", "preset:branchgrpo", "lora", "slices"]
# the cases with the most state: moving averages, random windows and draws, caches, several steps
MOST_STATE = ["sweep:dgpo", "sweep:guess", "sweep:agg-w5-route0.5", "preset:awm", "preset:dgpo",
              "preset:diffusionnft", "preset:flow_grpo", "preset:flow_grpo_fast", "preset:mixgrpo_flash",
              "preset:branchgrpo", "cache:fastercache", "lora", "slices"]


def config(case: str, *overrides: str):
    base, sets = CASES[case]
    return load_config(base, [*sets, *overrides])


def learned(out: Path) -> list[dict]:
    return [{k: v for k, v in r.items() if k not in TIMING_KEYS} for r in read_jsonl(out / "metrics.jsonl")]


_REFERENCE: dict[str, list[dict]] = {}


@pytest.fixture(scope="module", autouse=True)
def _every_plan_kept():
    """Every memory plan of the module's runs, and every model on fake tensors they were counted on, kept in the
    process (run_memory_plan keeps a few only, enough for a cell job's runs of one model): each case's plan is
    counted once, not again when its later stop points come after other cases' runs. A kept plan is the plan a
    fresh count makes (plan.json, which no case compares). The module's own caches: the process's come back
    after it."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(memplan, "_RUN_PLANS", {})
        mp.setattr(memplan, "_SHAPES", {})
        mp.setattr(memplan, "_RUN_PLANS_KEPT", len(CASES) * 2)
        mp.setattr(memplan, "_SHAPES_KEPT", len(CASES))
        yield


def reference(case: str, tmp_path_factory) -> list[dict]:
    """Records of the uninterrupted run (made once per case)."""
    if case not in _REFERENCE:
        out = tmp_path_factory.mktemp("reference") / "run"
        train(config(case), out)
        _REFERENCE[case] = learned(out)
    return _REFERENCE[case]


def _signal() -> None:
    os.kill(os.getpid(), signal.SIGTERM)


def _at_call(monkeypatch, name: str, call: int, action) -> None:
    """``action()`` before the ``call``-th (1-based) call of ``Session.<name>``."""
    original, calls = getattr(Session, name), []

    def wrapped(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == call:
            action(self)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(Session, name, wrapped)


def _fail(session) -> None:
    raise RuntimeError("the process died")


def _in_rollout(monkeypatch) -> None:
    """SIGTERM at the second safe point of iteration 2's rollout: a transformer call in its middle."""
    original, checks = stopping.check, []

    def arm(session):
        checks.append(0)

    def counting():
        if checks:
            checks[0] += 1
            if checks[0] == 2:
                _signal()
        return original()

    _at_call(monkeypatch, "collect", 3, arm)
    monkeypatch.setattr(stopping, "check", counting)


def _between_steps(monkeypatch) -> None:
    """SIGTERM after the first optimizer step of iteration 2's update (the signal waits for its record)."""
    signal_after_first_optimizer_step(monkeypatch, 3)


# stop point: (how, train.checkpoint_every, the summary's last_good_iteration and checkpoint_iteration)
STOPS = {
    "between iterations": (lambda mp: _at_call(mp, "collect", 4, lambda s: _signal()), 2, (2, 2)),
    "in the rollout": (_in_rollout, 3, (1, 1)),
    "in the gradient": (lambda mp: _at_call(mp, "update", 3, lambda s: _signal()), 3, (1, 1)),
    "between optimizer steps": (_between_steps, 3, (2, 2)),
    "killed": (lambda mp: _at_call(mp, "collect", 4, _fail), 2, (2, 1)),
}
PAIRS = [(case, "between iterations") for case in CASES]
PAIRS += [(case, stop) for case in MOST_STATE for stop in ("in the rollout", "in the gradient", "killed")]
PAIRS += [(case, "between optimizer steps") for case in SEVERAL_STEPS]


def test_every_sweep_method_and_preset_is_checked():
    assert {c for c, _ in PAIRS} >= {f"sweep:{m}" for m in SWEEP["methods"]} | {f"preset:{p}" for p in PRESETS}
    assert set(SEVERAL_STEPS) <= set(CASES) and set(MOST_STATE) <= set(CASES)


@pytest.mark.parametrize("case, stop", PAIRS)
def test_stopped_then_resumed_equals_uninterrupted(case, stop, tmp_path, monkeypatch, tmp_path_factory):
    expected = reference(case, tmp_path_factory)
    how, every, (last_good, saved) = STOPS[stop]
    out = tmp_path / "run"
    how(monkeypatch)
    with pytest.raises((Interrupted, RuntimeError)):
        train(config(case, f"train.checkpoint_every={every}"), out)
    monkeypatch.undo()
    summary = json.loads((out / "summary.json").read_text())
    assert (summary["last_good_iteration"], summary["checkpoint_iteration"]) == (last_good, saved)
    train(config(case, f"train.checkpoint_every={every}"), out, resume=True)
    assert json.loads((out / "summary.json").read_text())["resumed_from"] == saved
    assert learned(out) == expected
