"""Pyramid Attention Broadcast (diffusers' ``apply_pyramid_attention_broadcast``) on SD3, FLUX and Qwen-Image.

SD3, FLUX and Qwen-Image have joint self-attention only (no separate cross- or temporal attention), so every block's
attention is broadcast with the spatial settings.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from diffusers import hooks as diffusers_hooks

from .common import check_spatial_attention_skip


@dataclass
class PabConfig:
    """Options of Pyramid Attention Broadcast.

    Args:
        spatial_attention_block_skip_range (`int`, defaults to `2`):
            Inside the timestep range, each attention layer computes on every N-th call and returns its
            previous output on the other N - 1. 1 never reuses. diffusers' fallback value.
        spatial_attention_timestep_skip_range (`tuple[float, float]`, defaults to `(100, 800)`):
            Open interval of timesteps, on the 0-1000 scale for every family (FLUX's sigma is multiplied by
            1000), inside which attention may be reused. diffusers' default.
        current_timestep_callback (`Callable[[], float]`, set by `apply_cache`):
            Returns the current timestep on the 0-1000 scale.
    """

    spatial_attention_block_skip_range: int = 2
    spatial_attention_timestep_skip_range: tuple[float, float] = (100, 800)
    current_timestep_callback: Callable[[], float] | None = None

    def __post_init__(self) -> None:
        check_spatial_attention_skip(self)


def apply_pab(module: torch.nn.Module, config: PabConfig) -> None:
    """Apply diffusers' Pyramid Attention Broadcast to every attention layer of the transformer blocks."""
    diffusers_hooks.apply_pyramid_attention_broadcast(module, diffusers_hooks.PyramidAttentionBroadcastConfig(
        spatial_attention_block_skip_range=config.spatial_attention_block_skip_range,
        spatial_attention_timestep_skip_range=config.spatial_attention_timestep_skip_range,
        current_timestep_callback=config.current_timestep_callback,
    ))
