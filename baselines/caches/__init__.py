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

from typing import TYPE_CHECKING, Any

import torch

from agg_bench.config.options import option_names, typed_options
from agg_bench.errors import UserError
from agg_bench.registry import Registry

from .configs import (DeltaDiTConfig, FasterCacheConfig, FbcConfig, ForaConfig, MagCacheConfig,
                      PabConfig, TaylorSeerConfig, TeaCacheConfig)

if TYPE_CHECKING:
    from .handle import CacheHandle

# name -> config dataclass (agg_bench.registry: the style of methods and rewards). The configs import no
# diffusers, so a cache's options are checked without it (agg_bench.tools.sweep checks a sweep's methods so).
CACHES: Registry = Registry("method.cache", {
    "fbc": FbcConfig,
    "pab": PabConfig,
    "fastercache": FasterCacheConfig,
    "magcache": MagCacheConfig,
    "taylorseer": TaylorSeerConfig,
    "fora": ForaConfig,
    "deltadit": DeltaDiTConfig,
    "teacache": TeaCacheConfig,
})
# name -> installer: ``apply_<name>`` of module ``<name>`` (one file per cache), imported with the cache's
# hooks and diffusers when the cache is first applied
INSTALLERS = Registry("method.cache", {name: f"{__name__}.{name}:apply_{name}" for name in CACHES})


def cache_options(name: str) -> tuple[str, ...]:
    """The option keys cache ``name`` accepts."""
    return option_names(CACHES.resolve(name))


def make_config(name: str, options: dict[str, Any] | None = None) -> Any:
    """The options of cache ``name`` with ``options`` applied (keys of the ``method`` section), typed and bounded
    by its options class (:func:`agg_bench.config.options.typed_options`), or a ConfigError naming the bad key."""
    return typed_options(CACHES.resolve(name), dict(options or {}), "method", f"the {name!r} cache")


def apply_cache(transformer: torch.nn.Module, name: str, options: dict[str, Any] | None = None) -> CacheHandle:
    """Install cache ``name`` with ``options`` on an SD3, FLUX or Qwen-Image transformer."""
    from .handle import (CacheHandle, checkpointable_modules, gradient_checkpointing_error, has_cache,
                         uses_gradient_checkpointing)  # diffusers: only once a cache is applied

    config = make_config(name, options)
    if uses_gradient_checkpointing(checkpointable_modules(transformer)):
        raise gradient_checkpointing_error()
    if has_cache(transformer):
        raise UserError("this transformer already has an inference cache; remove() it before applying another")
    return CacheHandle(transformer, name, config, INSTALLERS.resolve(name))


__all__ = ["CACHES", "apply_cache", "cache_options", "make_config",
           "DeltaDiTConfig", "FasterCacheConfig", "FbcConfig", "ForaConfig", "MagCacheConfig", "PabConfig",
           "TaylorSeerConfig", "TeaCacheConfig"]
