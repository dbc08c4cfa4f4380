"""TaylorSeer (diffusers' ``apply_taylorseer_cache``) on SD3, FLUX and Qwen-Image.

Every attention layer of the transformer blocks keeps finite-difference Taylor factors of its output
over the steps it computed, and on the other steps returns the Taylor prediction instead of computing.
diffusers counts steps per layer, one per call since the last reset. With ``schedule: public`` the layers
compute on the steps TaylorSeer's own code computes (:meth:`.configs.TaylorSeerConfig.computes`) instead of
diffusers' ones.
"""
from __future__ import annotations

import types

import torch
from diffusers import hooks as diffusers_hooks
from diffusers.hooks.taylorseer_cache import _TAYLORSEER_CACHE_HOOK, TaylorSeerCacheHook, TaylorSeerState

from .configs import FACTOR_DTYPES, TaylorSeerConfig


def _measure_public_step(hook: TaylorSeerCacheHook, config: TaylorSeerConfig) -> tuple[bool, TaylorSeerState]:
    """diffusers' per-layer step count, with the steps that compute decided by ``config.computes``."""
    state = hook.state_manager.get_state()
    state.current_step += 1
    return config.computes(state.current_step), state


def apply_taylorseer(module: torch.nn.Module, config: TaylorSeerConfig) -> None:
    """Apply diffusers' TaylorSeer cache to every attention layer of the transformer blocks."""
    diffusers_hooks.apply_taylorseer_cache(module, diffusers_hooks.TaylorSeerCacheConfig(
        cache_interval=config.cache_interval,
        disable_cache_before_step=config.disable_cache_before_step,
        disable_cache_after_step=config.disable_cache_after_step,
        max_order=config.max_order,
        taylor_factors_dtype=FACTOR_DTYPES[config.taylor_factors_dtype],
    ))
    if config.schedule == "public":
        for submodule in module.modules():
            registry = getattr(submodule, "_diffusers_hook", None)
            hook = registry.get_hook(_TAYLORSEER_CACHE_HOOK) if registry is not None else None
            if hook is not None:
                hook._measure_should_compute = types.MethodType(
                    lambda self: _measure_public_step(self, config), hook)
