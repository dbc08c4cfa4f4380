"""Pyramid Attention Broadcast (diffusers' ``apply_pyramid_attention_broadcast``) on SD3, FLUX and Qwen-Image.

SD3, FLUX and Qwen-Image have joint self-attention only (no separate cross- or temporal attention), so every block's
attention is broadcast with the spatial settings.
"""
from __future__ import annotations

import torch
from diffusers import hooks as diffusers_hooks

from .configs import PabConfig


def apply_pab(module: torch.nn.Module, config: PabConfig) -> None:
    """Apply diffusers' Pyramid Attention Broadcast to every attention layer of the transformer blocks."""
    diffusers_hooks.apply_pyramid_attention_broadcast(module, diffusers_hooks.PyramidAttentionBroadcastConfig(
        spatial_attention_block_skip_range=config.spatial_attention_block_skip_range,
        spatial_attention_timestep_skip_range=config.spatial_attention_timestep_skip_range,
        current_timestep_callback=config.current_timestep_callback,
    ))
