"""FORA (Fast-Forward Caching): every block recomputes on every N-th step and reuses in between.

With ``trajectory_steps`` set, the N-th steps are counted from the last step, as the public code counts its
steps down (the first step always computes); see :meth:`.configs.ForaConfig.computes`.

FORA caches what the attention and MLP layers of each block produced and reuses it for the next N - 1
steps. At block granularity that is the block's residual (output minus input: the sum of its attention
and MLP contributions to the residual stream): a reused block returns its current input plus the residual
recorded at the last step it computed, so the residual stream itself is never frozen.
"""
from __future__ import annotations

import torch

from .blocks import transformer_blocks
from .configs import ForaConfig
from .runs import RunDecision, RunHeadHook, RunState, register_run

FORA_BLOCK_HOOK = "fora_block"


class ForaBlockHook(RunHeadHook):
    """One block (a run of one): computes on every ``interval``-th step, reuses its residual otherwise."""

    def __init__(self, config: ForaConfig) -> None:
        super().__init__(RunState())
        self.config = config

    def decide(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> RunDecision:
        clock = self.config.current_step_callback
        assert clock is not None  # apply_fora refuses a config without one
        return RunDecision(reuse=not self.config.computes(clock()))


def apply_fora(module: torch.nn.Module, config: ForaConfig) -> None:
    """Apply FORA to every block of an SD3, FLUX or Qwen-Image transformer."""
    if config.current_step_callback is None:
        raise ValueError("FORA needs `current_step_callback` in its config")
    for _, block in transformer_blocks(module):
        register_run([block], ForaBlockHook(config), FORA_BLOCK_HOOK)
