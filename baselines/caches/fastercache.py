"""FasterCache (diffusers' ``apply_faster_cache``) on SD3, FLUX and Qwen-Image rollouts without classifier-free guidance.

diffusers' FasterCache has two parts: reusing attention outputs across steps (extrapolated from the last
two computed outputs) and approximating the unconditional half of a CFG batch. GRPO rollouts here call
the transformer on conditional batches only, so the CFG part is switched off
(``is_guidance_distilled=True``) and only attention reuse remains.

A reused call returns ``last + (last - second to last) * weight``. diffusers keeps every call's output as
``last``, extrapolated ones included; the public FasterCache code keeps computed outputs only. With
``extrapolate_from: computed`` two more hooks on each hooked attention layer do the latter:
:class:`RanHook` (inside diffusers' hook) notes whether the layer's own forward ran, and
:class:`KeepComputedHook` (outside it) puts back the layer's cache after a call answered by extrapolation.
"""
from __future__ import annotations

import math
from typing import cast

import torch
from diffusers import hooks as diffusers_hooks
from diffusers.hooks import HookRegistry, ModelHook
from diffusers.hooks.faster_cache import _FASTER_CACHE_BLOCK_HOOK, FasterCacheBlockHook

from .configs import FasterCacheConfig
from .handle import ATTENTION_CLASSES

FIRST_CALL_HOOK = "faster_cache_first_call"
RAN_HOOK = "faster_cache_ran"
KEEP_COMPUTED_HOOK = "faster_cache_keep_computed"


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


class RanHook(ModelHook):
    """Inside diffusers' block hook on an attention layer: notes that the layer's own forward ran."""

    def __init__(self) -> None:
        super().__init__()
        self.ran = False

    def pre_forward(self, module: torch.nn.Module, *args, **kwargs):
        self.ran = True
        return args, kwargs


class KeepComputedHook(ModelHook):
    """Outside diffusers' block hook on an attention layer: after a call answered by extrapolation, puts back
    the cache it found, so the cache holds the layer's last two computed outputs."""

    def __init__(self, ran: RanHook, block_hook: FasterCacheBlockHook) -> None:
        super().__init__()
        self.ran = ran
        self.block_hook = block_hook

    def new_forward(self, module: torch.nn.Module, *args, **kwargs):
        self.ran.ran = False
        cache = self.block_hook.state.cache
        output = self.fn_ref.original_forward(*args, **kwargs)
        if not self.ran.ran:
            self.block_hook.state.cache = cache
        return output


def apply_fastercache(module: torch.nn.Module, config: FasterCacheConfig) -> None:
    """Apply diffusers' FasterCache attention reuse (no CFG branch) to the transformer's attention layers."""
    first_call: FirstCallHook | None = None

    clock = config.current_timestep_callback
    assert clock is not None  # the cache handle gives every cache its clock

    def current_timestep() -> float:
        assert first_call is not None  # registered below, before the transformer is called
        return math.inf if first_call.empty else clock()

    # registered before diffusers' hooks, so inside them; dropped below where diffusers hooks nothing
    ran_hooks: dict[torch.nn.Module, RanHook] = {}
    if config.extrapolate_from == "computed":
        for m in module.modules():
            if isinstance(m, ATTENTION_CLASSES):
                ran_hooks[m] = RanHook()
                HookRegistry.check_if_exists_or_initialize(m).register_hook(ran_hooks[m], RAN_HOOK)

    weight = config.attention_weight
    diffusers_hooks.apply_faster_cache(module, diffusers_hooks.FasterCacheConfig(
        spatial_attention_block_skip_range=config.spatial_attention_block_skip_range,
        spatial_attention_timestep_skip_range=config.spatial_attention_timestep_skip_range,
        attention_weight_callback=lambda _: weight,
        is_guidance_distilled=True,
        tensor_format="BCHW",
        current_timestep_callback=current_timestep,
    ))
    registries = [HookRegistry.check_if_exists_or_initialize(m) for m in module.modules()
                  if hasattr(m, "_diffusers_hook")]
    # the block hook each registry that holds one holds, under the name apply_faster_cache gives it
    block_hooks = [cast(FasterCacheBlockHook, r.get_hook(_FASTER_CACHE_BLOCK_HOOK)) for r in registries
                   if _FASTER_CACHE_BLOCK_HOOK in r.hooks]
    first_call = FirstCallHook(block_hooks)
    HookRegistry.check_if_exists_or_initialize(module).register_hook(first_call, FIRST_CALL_HOOK)
    for m, ran in ran_hooks.items():
        registry = HookRegistry.check_if_exists_or_initialize(m)
        block_hook = registry.get_hook(_FASTER_CACHE_BLOCK_HOOK)
        if block_hook is None:
            registry.remove_hook(RAN_HOOK, recurse=False)
        else:
            registry.register_hook(KeepComputedHook(ran, cast(FasterCacheBlockHook, block_hook)), KEEP_COMPUTED_HOOK)
