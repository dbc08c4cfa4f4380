"""What the benchmarks measure: method cases, resolutions, and a session prepared for timing."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import torch

from agg_bench.config import load_config
from agg_bench.methods.base import available_methods

if TYPE_CHECKING:  # the model code is imported by the cases that run, not by the options' checks before them
    from agg_bench.engine.grpo import TrainBatch
    from agg_bench.runtime.session import Session

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_CONFIG = ROOT / "config" / "run.yaml"  # the embedded default's base run config

# The embedded default's resolutions (config/config.yaml) on the tiny models; 256 and 512 px are
# opt-in (--bench-slow).
RESOLUTIONS = [32, 64, 128, pytest.param(256, marks=pytest.mark.slow, id="256"),
               pytest.param(512, marks=pytest.mark.slow, id="512")]

# Every method trains the same number of steps per sample: 10 sampling steps, plan "groups" of
# W = 5 consecutive steps, half the groups (one group of 5 steps per sample). full, agg and cached
# train the very same steps of the same rollout; a method whose own scheme differs gets the nearest
# setting with the same count.
COMMON = ("sampling.steps=10", "train.plan=groups", "train.plan_window=5", "train.timestep_fraction=0.5",
          "progress=false")


@dataclass(frozen=True)
class Case:
    """One benchmarked method setting: an id, the registered method, and its extra overrides."""

    id: str
    method: str
    overrides: tuple[str, ...] = ()


FULL = Case("full", "full")
CASES = (
    FULL,
    Case("agg", "agg", ("method.window=5",)),
    # AGG taking v at each group's endpoints from its forwards-with-grad: W - 2 no-grad forwards per group
    Case("agg-endpoints", "agg", ("method.window=5", "method.endpoint_velocity=reuse")),
    # AGG taking v_k from the rollout (only the first update after a rollout can)
    Case("agg-reuse", "agg", ("method.window=5", "method.reuse_rollout_velocity=true")),
    # DanceGRPO draws single steps, not groups: 5 random steps of 10
    Case("fraction", "fraction", ("train.plan=steps",)),
    # MixGRPO: a window of 5 SDE steps, the only steps with a log-probability
    Case("window", "window", ("method.window_size=5",)),
    # a training-free cache (FORA) in the training forwards: cached blocks are skipped by backward
    Case("cached-fora-train", "cached", ("method.cache=fora", "method.cache_in=train")),
)


def available_cases() -> list[Case]:
    """The cases whose method is registered now (methods appear here as they land)."""
    registered = set(available_methods())
    return [case for case in CASES if case.method in registered]


def case_config(config_file: str | Path, device: str, case: Case, resolution: int):
    """The run config of ``case`` at ``resolution``; the case's method replaces the file's method
    section, options and all."""
    method = json.dumps({"name": case.method})
    overrides = [f"device={device}", f"model.resolution={resolution}", *COMMON, f"method={method}",
                 *case.overrides]
    return load_config(config_file, overrides)


@dataclass
class Prepared:
    """A session with the rollout of iteration 0 collected, ready to time updates on it."""

    session: Session
    batch: TrainBatch

    def sync(self) -> None:
        """Wait for queued GPU work, so that a wall-clock timer covers it."""
        if self.session.device.type == "cuda":
            torch.cuda.synchronize(self.session.device)

    def update(self) -> None:
        """One update as the first one after a rollout. AGG's rollout-velocity reuse applies only while
        the policy version equals the rollout's, so the batch is marked fresh before every round
        (re-collecting would time the rollout too); the timed work is what an iteration's update does."""
        self.batch.policy_version = self.session.policy.version
        self.session.update(self.batch)
        self.sync()
