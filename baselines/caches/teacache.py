"""TeaCache: reuse the whole block stack while the first block's modulated input has barely changed.

Before each call, the first block's timestep-modulated input (its ``norm1``/``norm`` output, the input to
its attention) is compared with the previous call's. The relative L1 change, rescaled by a polynomial,
is accumulated; while the sum stays below ``threshold`` every block is skipped and the transformer uses
its current input plus the stack residual (output of the last block minus input of the first) recorded at
the last computed step. Computing resets the sum.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
from diffusers.hooks.hooks import BaseState

from .common import check_option, is_int, is_number, modulated_input, transformer_blocks
from .runs import RunDecision, RunHeadHook, RunState, register_run

TEACACHE_BLOCK_HOOK = "teacache_block"


@dataclass
class TeaCacheConfig:
    """Options of TeaCache.

    Args:
        threshold (`float`, defaults to `0.2`):
            The blocks are skipped while the accumulated rescaled change is below this. 0 never skips. With
            the identity rescaling the sum is the raw relative L1 change, and 0.2 is a starting point to
            tune per model, not a calibrated speed/quality trade-off.
        coefficients (`list[float]`, defaults to `[1.0, 0.0]`):
            Rescaling polynomial applied to each relative L1 change, highest degree first (as
            ``numpy.polyval``). The default is the identity; TeaCache fits one per model so that the
            rescaled input change tracks the change of the model's output.
        warmup_steps (`int`, defaults to `1`):
            Steps with an index below this always compute.
        current_step_callback (`Callable[[], int]`, set by `apply_cache`):
            Returns the index of the denoising step of the current call.
    """

    threshold: float = 0.2
    coefficients: list[float] = field(default_factory=lambda: [1.0, 0.0])
    warmup_steps: int = 1
    current_step_callback: Callable[[], int] | None = None

    def __post_init__(self) -> None:
        check_option("threshold", self.threshold, is_number(self.threshold) and self.threshold >= 0,
                     "a number >= 0")
        c = self.coefficients
        check_option("coefficients", c, isinstance(c, (list, tuple)) and len(c) > 0 and all(is_number(v) for v in c),
                     "a non-empty list of numbers, highest degree first")
        self.coefficients = [float(v) for v in c]
        check_option("warmup_steps", self.warmup_steps, is_int(self.warmup_steps) and self.warmup_steps >= 1,
                     "an integer >= 1")

    def rescale(self, change: float) -> float:
        value = 0.0
        for coefficient in self.coefficients:
            value = value * change + coefficient
        return value


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
        step = self.config.current_step_callback()
        with torch.no_grad():
            current = modulated_input(module, args, kwargs)
        previous, self.tea.previous_modulated_input = self.tea.previous_modulated_input, current
        if (step < self.config.warmup_steps or previous is None or previous.shape != current.shape
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
