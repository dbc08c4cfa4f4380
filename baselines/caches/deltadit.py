"""Delta-DiT: reuse the residual of a run of blocks, the rear blocks early and the front blocks late.

Delta-DiT's observation is that the rear blocks of a DiT mostly add detail and the front blocks mostly
lay out the image: while the outline is forming (early steps) the rear run's residual (its output minus
its input) is reused, and while details form (late steps) the front run's. Every ``interval``-th step
computes every block and records both runs' residuals; the other steps reuse the active run.
"""
from __future__ import annotations

from typing import Callable

import torch

from .blocks import transformer_blocks
from .configs import ALWAYS, EARLY, DeltaDiTConfig
from .runs import RunDecision, RunHeadHook, RunState, register_run

DELTADIT_BLOCK_HOOK = "deltadit_block"


class DeltaDiTRunHook(RunHeadHook):
    """First block of a run: reuses the run on non-computing steps of its phase."""

    def __init__(self, phase: str, interval: int, boundary: int, current_step_callback: Callable[[], int]) -> None:
        super().__init__(RunState())
        self.phase = phase
        self.interval = interval
        self.boundary = boundary
        self.current_step_callback = current_step_callback

    def decide(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> RunDecision:
        step = self.current_step_callback()
        full_step = step % self.interval == 0
        active = self.phase == ALWAYS or (self.phase == EARLY) == (step < self.boundary)
        return RunDecision(reuse=active and not full_step, record=full_step)


def apply_deltadit(module: torch.nn.Module, config: DeltaDiTConfig) -> None:
    """Apply Delta-DiT to an SD3, FLUX or Qwen-Image transformer."""
    if config.current_step_callback is None:
        raise ValueError("Delta-DiT needs `current_step_callback` in its config")
    blocks = [block for _, block in transformer_blocks(module)]
    for indices, phase in config.runs(len(blocks)):
        head = DeltaDiTRunHook(phase, config.interval, config.boundary, config.current_step_callback)
        register_run([blocks[i] for i in indices], head, DELTADIT_BLOCK_HOOK)
