"""FORA (Fast-Forward Caching): every block recomputes on every N-th step and reuses in between.

FORA caches what the attention and MLP layers of each block produced and reuses it for the next N - 1
steps. At block granularity that is the block's residual (output minus input: the sum of its attention
and MLP contributions to the residual stream): a reused block returns its current input plus the residual
recorded at the last step it computed, so the residual stream itself is never frozen.
"""
from __future__ import annotations

from typing import Callable

import torch

from .blocks import transformer_blocks
from .configs import ForaConfig
from .runs import RunDecision, RunHeadHook, RunState, register_run

FORA_BLOCK_HOOK = "fora_block"


class ForaBlockHook(RunHeadHook):
    """One block (a run of one): computes on every ``interval``-th step, reuses its residual otherwise."""

    def __init__(self, interval: int, current_step_callback: Callable[[], int]) -> None:
        super().__init__(RunState())
        self.interval = interval
        self.current_step_callback = current_step_callback

    def decide(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> RunDecision:
        return RunDecision(reuse=self.current_step_callback() % self.interval != 0)


def apply_fora(module: torch.nn.Module, config: ForaConfig) -> None:
    """Apply FORA to every block of an SD3, FLUX or Qwen-Image transformer."""
    if config.current_step_callback is None:
        raise ValueError("FORA needs `current_step_callback` in its config")
    for _, block in transformer_blocks(module):
        register_run([block], ForaBlockHook(config.interval, config.current_step_callback), FORA_BLOCK_HOOK)
