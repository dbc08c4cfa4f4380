"""MagCache (diffusers' ``apply_mag_cache``) on SD3, FLUX and Qwen-Image, driven by the handle's step index.

MagCache skips every block and adds the previous step's whole-stack residual, while the accumulated
error ``sum |1 - prod(mag_ratios)|`` over the skipped steps stays within ``threshold``. ``mag_ratios[j]``
is the model's mean ratio of residual norms between step j and step j - 1, measured once per model and
sampler (diffusers' calibration mode prints them). Without them the ratios are all ones: the residual is
assumed not to change size, the accumulated error stays 0, and reuse is limited only by
``max_skip_steps`` and ``retention_steps``. Calibrate before drawing conclusions on a real model.

diffusers counts MagCache's steps itself and resets after ``num_inference_steps`` calls; here
:class:`MagCacheStepHook` sets diffusers' step index from ``begin_step`` before every call instead, and
the trajectory may have up to :data:`MAX_STEPS` steps.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from diffusers import hooks as diffusers_hooks
from diffusers.hooks import HookRegistry, ModelHook
from diffusers.hooks.hooks import StateManager
from diffusers.hooks.mag_cache import _MAG_CACHE_LEADER_BLOCK_HOOK, FLUX_MAG_RATIOS, nearest_interp

from agg_bench.errors import UserError

from .common import check_option, is_int, is_number, transformer_blocks

MAX_STEPS = 1000
STEP_HOOK = "mag_cache_step"
PRESET_RATIOS = {"flux": FLUX_MAG_RATIOS}


@dataclass
class MagCacheConfig:
    """Options of MagCache.

    Args:
        threshold (`float`, defaults to `0.06`):
            Largest accumulated magnitude error at which the blocks are still skipped. diffusers' default.
        max_skip_steps (`int`, defaults to `3`):
            Most consecutive steps skipped. 0 never skips. diffusers' default.
        retention_steps (`int`, defaults to `2`):
            The first this many steps of a trajectory are always computed. (diffusers sets this as a fraction
            of the step count; the step count is not known when the cache is applied.)
        mag_ratios (`list[float]` or `"flux"`, defaults to `None`):
            Per-step magnitude ratios, indexed by step; steps past the list use 1. `"flux"` is diffusers'
            FLUX.1 table (28 steps). `None` is all ones (see the module docstring).
        num_inference_steps (`int`, defaults to `None`):
            If set, `mag_ratios` is resampled (nearest) to this many steps, e.g. to use the 28-step FLUX
            table with a 10-step sampler. `None` uses the ratios as given.
        current_step_callback (`Callable[[], int]`, set by `apply_cache`):
            Returns the current step index.
    """

    threshold: float = 0.06
    max_skip_steps: int = 3
    retention_steps: int = 2
    mag_ratios: list[float] | str | None = None
    num_inference_steps: int | None = None
    current_step_callback: Callable[[], int] | None = None

    def __post_init__(self) -> None:
        check_option("threshold", self.threshold, is_number(self.threshold) and self.threshold >= 0,
                     "a number >= 0")
        for key in ("max_skip_steps", "retention_steps"):
            value = getattr(self, key)
            check_option(key, value, is_int(value) and value >= 0, "an integer >= 0")
        ratios = self.mag_ratios
        ok = ratios is None or (isinstance(ratios, str) and ratios in PRESET_RATIOS) or (
            isinstance(ratios, (list, tuple)) and 0 < len(ratios) <= MAX_STEPS and all(is_number(r) for r in ratios))
        check_option("mag_ratios", ratios, ok,
                     f"a list of at most {MAX_STEPS} numbers, one per step, or one of {sorted(PRESET_RATIOS)}")
        steps = self.num_inference_steps
        check_option("num_inference_steps", steps, steps is None or (is_int(steps) and 1 <= steps <= MAX_STEPS),
                     f"an integer from 1 to {MAX_STEPS}")

    def step_ratios(self) -> torch.Tensor:
        """The ratio of every step up to :data:`MAX_STEPS` (ones past the given ones)."""
        ratios = torch.ones(MAX_STEPS)
        given = self.mag_ratios
        if given is None:
            return ratios
        given = PRESET_RATIOS[given] if isinstance(given, str) else torch.tensor(given, dtype=torch.float32)
        if self.num_inference_steps is not None:
            given = nearest_interp(given, self.num_inference_steps)
        ratios[: len(given)] = given
        return ratios


class MagCacheStepHook(ModelHook):
    """On the transformer: sets diffusers' MagCache step index to the current step before every call."""

    def __init__(self, state_manager: StateManager, current_step_callback: Callable[[], int]) -> None:
        super().__init__()
        self.state_manager = state_manager
        self.current_step_callback = current_step_callback

    def pre_forward(self, module: torch.nn.Module, *args, **kwargs):
        step = self.current_step_callback()
        if step >= MAX_STEPS:
            raise UserError(f"MagCache here supports trajectories of at most {MAX_STEPS} steps, got step {step}")
        self.state_manager.get_state().step_index = step
        return args, kwargs


def apply_magcache(module: torch.nn.Module, config: MagCacheConfig) -> None:
    """Apply diffusers' MagCache to the transformer's blocks."""
    diffusers_config = diffusers_hooks.MagCacheConfig(
        threshold=config.threshold,
        max_skip_steps=config.max_skip_steps,
        retention_ratio=config.retention_steps / MAX_STEPS,
        num_inference_steps=MAX_STEPS,
        mag_ratios=config.step_ratios(),
    )
    diffusers_hooks.apply_mag_cache(module, diffusers_config)
    head = transformer_blocks(module)[0][1]
    state_manager = head._diffusers_hook.get_hook(_MAG_CACHE_LEADER_BLOCK_HOOK).state_manager
    step_hook = MagCacheStepHook(state_manager, config.current_step_callback)
    HookRegistry.check_if_exists_or_initialize(module).register_hook(step_hook, STEP_HOOK)
