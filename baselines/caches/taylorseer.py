"""TaylorSeer (diffusers' ``apply_taylorseer_cache``) on SD3, FLUX and Qwen-Image.

Every attention layer of the transformer blocks keeps finite-difference Taylor factors of its output
over the steps it computed, and on the other steps returns the Taylor prediction instead of computing.
diffusers counts steps per layer, one per call since the last reset.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from diffusers import hooks as diffusers_hooks

from .common import check_option, is_int

FACTOR_DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16,
                 "float16": torch.float16}


@dataclass
class TaylorSeerConfig:
    """Options of TaylorSeer.

    Args:
        cache_interval (`int`, defaults to `5`):
            After the warm-up, each layer computes once every this many steps and predicts in between.
            1 never predicts. diffusers' default.
        disable_cache_before_step (`int`, defaults to `3`):
            Steps before this index always compute (they gather the Taylor factors). diffusers' default.
        disable_cache_after_step (`int`, defaults to `None`):
            Steps from this index on always compute; `None` never stops predicting. diffusers' default.
        max_order (`int`, defaults to `1`):
            Order of the Taylor expansion. diffusers' default.
        taylor_factors_dtype (`str`, defaults to `"float32"`):
            Storage dtype of the factors. diffusers defaults to bfloat16 to save memory; float32 keeps the
            rounding of the stored factors out of the measured cache error.
    """

    cache_interval: int = 5
    disable_cache_before_step: int = 3
    disable_cache_after_step: int | None = None
    max_order: int = 1
    taylor_factors_dtype: str = "float32"

    def __post_init__(self) -> None:
        for key, least in (("cache_interval", 1), ("disable_cache_before_step", 0), ("max_order", 1)):
            value = getattr(self, key)
            check_option(key, value, is_int(value) and value >= least, f"an integer >= {least}")
        after = self.disable_cache_after_step
        check_option("disable_cache_after_step", after, after is None or (is_int(after) and after >= 0),
                     "an integer >= 0, or null")
        check_option("taylor_factors_dtype", self.taylor_factors_dtype, self.taylor_factors_dtype in FACTOR_DTYPES,
                     f"one of {sorted(FACTOR_DTYPES)}")


def apply_taylorseer(module: torch.nn.Module, config: TaylorSeerConfig) -> None:
    """Apply diffusers' TaylorSeer cache to every attention layer of the transformer blocks."""
    diffusers_hooks.apply_taylorseer_cache(module, diffusers_hooks.TaylorSeerCacheConfig(
        cache_interval=config.cache_interval,
        disable_cache_before_step=config.disable_cache_before_step,
        disable_cache_after_step=config.disable_cache_after_step,
        max_order=config.max_order,
        taylor_factors_dtype=FACTOR_DTYPES[config.taylor_factors_dtype],
    ))
