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

from typing import Callable

import torch
from diffusers import hooks as diffusers_hooks
from diffusers.hooks import HookRegistry, ModelHook
from diffusers.hooks.hooks import StateManager
from diffusers.hooks.mag_cache import _MAG_CACHE_LEADER_BLOCK_HOOK, FLUX_MAG_RATIOS, nearest_interp

from agg_bench.errors import UserError

from .blocks import transformer_blocks
from .configs import MAGCACHE_MAX_STEPS as MAX_STEPS
from .configs import MagCacheConfig

STEP_HOOK = "mag_cache_step"
PRESET_RATIOS = {"flux": FLUX_MAG_RATIOS}  # keys: MAGCACHE_PRESETS, the names the config accepts


def step_ratios(config: MagCacheConfig) -> torch.Tensor:
    """The ratio of every step up to :data:`MAX_STEPS` (ones past the given ones)."""
    ratios = torch.ones(MAX_STEPS)
    given = config.mag_ratios
    if given is None:
        return ratios
    table = PRESET_RATIOS[given] if isinstance(given, str) else torch.tensor(given, dtype=torch.float32)
    if config.num_inference_steps is not None:
        table = nearest_interp(table, config.num_inference_steps)
    ratios[: len(table)] = table
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
        mag_ratios=step_ratios(config),
    )
    diffusers_hooks.apply_mag_cache(module, diffusers_config)
    head = transformer_blocks(module)[0][1]
    state_manager = head._diffusers_hook.get_hook(_MAG_CACHE_LEADER_BLOCK_HOOK).state_manager
    assert config.current_step_callback is not None  # the cache handle gives every cache its clock
    step_hook = MagCacheStepHook(state_manager, config.current_step_callback)
    HookRegistry.check_if_exists_or_initialize(module).register_hook(step_hook, STEP_HOOK)
