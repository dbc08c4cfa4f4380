"""TaylorSeer (diffusers' ``apply_taylorseer_cache``) on SD3, FLUX and Qwen-Image.

Every attention layer of the transformer blocks keeps finite-difference Taylor factors of its output
over the steps it computed, and on the other steps returns the Taylor prediction instead of computing.
diffusers counts steps per layer, one per call since the last reset.
"""
from __future__ import annotations

import torch
from diffusers import hooks as diffusers_hooks

from .configs import FACTOR_DTYPES, TaylorSeerConfig


def apply_taylorseer(module: torch.nn.Module, config: TaylorSeerConfig) -> None:
    """Apply diffusers' TaylorSeer cache to every attention layer of the transformer blocks."""
    diffusers_hooks.apply_taylorseer_cache(module, diffusers_hooks.TaylorSeerCacheConfig(
        cache_interval=config.cache_interval,
        disable_cache_before_step=config.disable_cache_before_step,
        disable_cache_after_step=config.disable_cache_after_step,
        max_order=config.max_order,
        taylor_factors_dtype=FACTOR_DTYPES[config.taylor_factors_dtype],
    ))
