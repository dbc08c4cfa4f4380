"""FasterCache (diffusers' ``apply_faster_cache``) on SD3, FLUX and Qwen-Image rollouts without classifier-free guidance.

diffusers' FasterCache has two parts: reusing attention outputs across steps (extrapolated from the last
two computed outputs) and approximating the unconditional half of a CFG batch. GRPO rollouts here call
the transformer on conditional batches only, so the CFG part is switched off
(``is_guidance_distilled=True``) and only attention reuse remains.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
from diffusers import hooks as diffusers_hooks
from diffusers.hooks import HookRegistry, ModelHook
from diffusers.hooks.faster_cache import _FASTER_CACHE_BLOCK_HOOK, FasterCacheBlockHook

from .common import check_option, check_spatial_attention_skip, is_number

FIRST_CALL_HOOK = "faster_cache_first_call"


@dataclass
class FasterCacheConfig:
    """Options of FasterCache's attention reuse.

    Args:
        spatial_attention_block_skip_range (`int`, defaults to `2`):
            Inside the timestep range, each attention layer computes on every N-th call and extrapolates
            from its last two computed outputs on the others. 1 never reuses. diffusers' default.
        spatial_attention_timestep_skip_range (`tuple[float, float]`, defaults to `(-1, 681)`):
            Open interval of timesteps (0-1000 scale for every family) inside which attention may be reused.
            diffusers' default.
        attention_weight (`float`, defaults to `0.5`):
            Reused output = last + (last - second to last) * weight. diffusers' default.
        current_timestep_callback (`Callable[[], float]`, set by `apply_cache`):
            Returns the current timestep on the 0-1000 scale.

    The first call after a reset always computes, whatever the timestep: there is nothing to reuse yet.
    """

    spatial_attention_block_skip_range: int = 2
    spatial_attention_timestep_skip_range: tuple[float, float] = (-1, 681)
    attention_weight: float = 0.5
    current_timestep_callback: Callable[[], float] | None = None

    def __post_init__(self) -> None:
        check_spatial_attention_skip(self)
        check_option("attention_weight", self.attention_weight, is_number(self.attention_weight), "a number")


class FirstCallHook(ModelHook):
    """On the transformer: notes, before each call, whether any attention layer has nothing cached yet.

    diffusers' block hook may decide to reuse on its first call (when the first timestep is inside the
    range) and then fails on its empty cache; the timestep callback reports an out-of-range timestep
    while this hook says so.
    """

    def __init__(self, block_hooks: list[FasterCacheBlockHook]) -> None:
        super().__init__()
        self.block_hooks = block_hooks
        self.empty = True

    def pre_forward(self, module: torch.nn.Module, *args, **kwargs):
        self.empty = any(hook.state.cache is None for hook in self.block_hooks)
        return args, kwargs


def apply_fastercache(module: torch.nn.Module, config: FasterCacheConfig) -> None:
    """Apply diffusers' FasterCache attention reuse (no CFG branch) to the transformer's attention layers."""
    first_call: FirstCallHook | None = None

    def current_timestep() -> float:
        return math.inf if first_call.empty else config.current_timestep_callback()

    weight = config.attention_weight
    diffusers_hooks.apply_faster_cache(module, diffusers_hooks.FasterCacheConfig(
        spatial_attention_block_skip_range=config.spatial_attention_block_skip_range,
        spatial_attention_timestep_skip_range=config.spatial_attention_timestep_skip_range,
        attention_weight_callback=lambda _: weight,
        is_guidance_distilled=True,
        tensor_format="BCHW",
        current_timestep_callback=current_timestep,
    ))
    registries = [m._diffusers_hook for m in module.modules() if hasattr(m, "_diffusers_hook")]
    block_hooks = [r.get_hook(_FASTER_CACHE_BLOCK_HOOK) for r in registries if _FASTER_CACHE_BLOCK_HOOK in r.hooks]
    first_call = FirstCallHook(block_hooks)
    HookRegistry.check_if_exists_or_initialize(module).register_hook(first_call, FIRST_CALL_HOOK)
