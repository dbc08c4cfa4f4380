"""Training-free DiT inference caches for SD3, FLUX and Qwen-Image, as diffusers hooks, for rollouts and training forwards.

``apply_cache(transformer, name, options)`` installs one cache and returns a :class:`CacheHandle`:

- ``begin_step(step_index, timestep)`` before every transformer call, in denoising order (``timestep`` is
  the value the transformer receives: SD3 sigma*1000, FLUX sigma);
- ``reset()`` before a new trajectory batch (clears cache state and counts);
- ``detach()`` after each training step, so a later backward never reaches into a freed graph; a reused
  tensor then carries no gradient, so backward skips the blocks it stands for;
- ``remove()`` to unregister every hook and leave the transformer as it was;
- ``stats`` (``computed``, ``skipped``, ``hit_rate``) and ``reset_stats()``: unit calls computed or
  answered from the cache since the last reset (see :mod:`.handle` for how they are counted).

FBC, PAB, FasterCache, MagCache and TaylorSeer are diffusers' own hooks behind small adapters; FORA,
Delta-DiT and TeaCache are written here as diffusers ``ModelHook``s. Caches and gradient checkpointing do
not mix. A lossy cache in the rollout changes the old log-probs GRPO divides by; measure that gap.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch

from agg_bench.errors import ConfigError, UserError
from agg_bench.registry import Registry

from .deltadit import DeltaDiTConfig, apply_deltadit
from .fastercache import FasterCacheConfig, apply_fastercache
from .fbc import FbcConfig, apply_fbc
from .fora import ForaConfig, apply_fora
from .handle import (CALLBACK_FIELDS, CacheHandle, checkpointable_modules, gradient_checkpointing_error,
                     has_cache, uses_gradient_checkpointing)
from .magcache import MagCacheConfig, apply_magcache
from .pab import PabConfig, apply_pab
from .taylorseer import TaylorSeerConfig, apply_taylorseer
from .teacache import TeaCacheConfig, apply_teacache

# name -> (config dataclass, installer), one file each (agg_bench.registry: the style of methods and rewards)
CACHES: dict[str, tuple[type, Callable[[torch.nn.Module, Any], None]]] = Registry("method.cache", {
    "fbc": (FbcConfig, apply_fbc),
    "pab": (PabConfig, apply_pab),
    "fastercache": (FasterCacheConfig, apply_fastercache),
    "magcache": (MagCacheConfig, apply_magcache),
    "taylorseer": (TaylorSeerConfig, apply_taylorseer),
    "fora": (ForaConfig, apply_fora),
    "deltadit": (DeltaDiTConfig, apply_deltadit),
    "teacache": (TeaCacheConfig, apply_teacache),
})


def cache_options(name: str) -> tuple[str, ...]:
    """The option keys cache ``name`` accepts."""
    config_cls, _ = CACHES.resolve(name)
    return tuple(f.name for f in dataclasses.fields(config_cls) if f.name not in CALLBACK_FIELDS)


def make_config(name: str, options: dict[str, Any] | None = None) -> Any:
    """The config of cache ``name`` with ``options`` applied, or a ConfigError naming the bad key."""
    allowed = cache_options(name)
    options = dict(options or {})
    for key in options:
        if key not in allowed:
            raise ConfigError(f"method.{key}", options[key], f"an option of the {name!r} cache: one of {list(allowed)}")
    config_cls, _ = CACHES.resolve(name)
    return config_cls(**options)


def apply_cache(transformer: torch.nn.Module, name: str, options: dict[str, Any] | None = None) -> CacheHandle:
    """Install cache ``name`` with ``options`` on an SD3, FLUX or Qwen-Image transformer."""
    config = make_config(name, options)
    if uses_gradient_checkpointing(checkpointable_modules(transformer)):
        raise gradient_checkpointing_error()
    if has_cache(transformer):
        raise UserError("this transformer already has an inference cache; remove() it before applying another")
    _, apply_fn = CACHES.resolve(name)
    return CacheHandle(transformer, name, config, apply_fn)


__all__ = ["CACHES", "CacheHandle", "apply_cache", "cache_options", "make_config",
           "DeltaDiTConfig", "FasterCacheConfig", "FbcConfig", "ForaConfig", "MagCacheConfig", "PabConfig",
           "TaylorSeerConfig", "TeaCacheConfig"]
