"""TeaCache: reuse the whole block stack while the first block's modulated input has barely changed.

Before each call, the first block's timestep-modulated input (its ``norm1``/``norm`` output, the input to
its attention) is compared with the previous call's. The relative L1 change, rescaled by a polynomial,
is accumulated; while the sum stays below ``threshold`` every block is skipped and the transformer uses
its current input plus the stack residual (output of the last block minus input of the first) recorded at
the last computed step. Computing resets the sum. The first ``warmup_steps`` steps and, with ``trajectory_steps``
set, the trajectory's last step always compute.
"""
from __future__ import annotations

import torch
from diffusers.hooks.hooks import BaseState

from .blocks import modulated_input, transformer_blocks
from .configs import TeaCacheConfig
from .runs import RunDecision, RunHeadHook, RunState, register_run

TEACACHE_BLOCK_HOOK = "teacache_block"


class TeaCacheState(BaseState):
    """The previous call's modulated input and the rescaled change accumulated since the last compute."""

    def __init__(self) -> None:
        self.previous_modulated_input: torch.Tensor | None = None
        self.accumulated_change = 0.0

    def reset(self) -> None:
        self.previous_modulated_input = None
        self.accumulated_change = 0.0


class TeaCacheHeadHook(RunHeadHook):
    """On the first block: decides, from the modulated input, whether the whole stack is reused."""

    def __init__(self, config: TeaCacheConfig) -> None:
        super().__init__(RunState())
        self.config = config
        self.tea = TeaCacheState()

    def decide(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> RunDecision:
        clock = self.config.current_step_callback
        assert clock is not None  # the cache handle gives every cache its clock
        step = clock()
        with torch.no_grad():
            current = modulated_input(module, args, kwargs)
        previous, self.tea.previous_modulated_input = self.tea.previous_modulated_input, current
        if (self.config.always_computes(step) or previous is None or previous.shape != current.shape
                or self.state.residual is None):
            self.tea.accumulated_change = 0.0
            return RunDecision(reuse=False)
        scale = previous.abs().mean().clamp_min(torch.finfo(previous.dtype).tiny)
        change = float((current - previous).abs().mean() / scale)
        self.tea.accumulated_change += self.config.rescale(change)
        if self.tea.accumulated_change < self.config.threshold:
            return RunDecision(reuse=True)
        self.tea.accumulated_change = 0.0
        return RunDecision(reuse=False)

    def reset_state(self, module: torch.nn.Module) -> torch.nn.Module:
        self.tea.reset()
        return super().reset_state(module)


def apply_teacache(module: torch.nn.Module, config: TeaCacheConfig) -> None:
    """Apply TeaCache to the whole block stack of an SD3 or FLUX transformer."""
    if config.current_step_callback is None:
        raise ValueError("TeaCache needs `current_step_callback` in its config")
    blocks = [block for _, block in transformer_blocks(module)]
    register_run(blocks, TeaCacheHeadHook(config), TEACACHE_BLOCK_HOOK)
