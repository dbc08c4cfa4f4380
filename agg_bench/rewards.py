"""Reward registry.

A reward is a callable ``reward(images, prompts) -> Tensor (B,)`` where ``images`` are decoded images
(B, 3, H, W) in [0, 1]. Rewards are built by name with :func:`build_reward`; entries may be given as
``"module:attr"`` strings so that optional extras are imported only when used
(:class:`agg_bench.registry.Registry`, the style of methods and caches too).
"""
from __future__ import annotations

import io
from typing import Callable

import numpy as np
import torch
from PIL import Image

from .errors import ConfigError  # noqa: F401  (reward factories raise it)
from .registry import Registry

RewardFn = Callable[[torch.Tensor, list[str]], torch.Tensor]
REWARDS = Registry("reward.name")


def register_reward(name: str, factory: object | None = None):
    """Register ``factory(options: dict, device) -> RewardFn`` under ``name`` (usable as a decorator)."""
    return REWARDS.register(name, factory)


def build_reward(name: str, options: dict | None = None, device: str | torch.device = "cpu") -> RewardFn:
    return REWARDS.resolve(name)(dict(options or {}), device)


def to_uint8(images: torch.Tensor) -> np.ndarray:
    """(B, 3, H, W) in [0, 1] -> (B, H, W, 3) uint8."""
    return (images.detach().float().clamp(0, 1) * 255).round().to(torch.uint8).permute(0, 2, 3, 1).cpu().numpy()


def jpeg_size_kb(images: torch.Tensor, quality: int = 95) -> torch.Tensor:
    """Size in kB of each image saved as JPEG at ``quality`` (DDPO's compressibility measure)."""
    sizes = []
    for arr in to_uint8(images):
        buf = io.BytesIO()
        Image.fromarray(arr).save(buf, format="JPEG", quality=quality)
        sizes.append(buf.tell() / 1000.0)
    return torch.tensor(sizes, dtype=torch.float32)


@register_reward("jpeg_compressibility")
def _jpeg_compressibility(options: dict, device) -> RewardFn:
    quality = int(options.get("quality", 95))
    return lambda images, prompts: -jpeg_size_kb(images, quality)


@register_reward("jpeg_incompressibility")
def _jpeg_incompressibility(options: dict, device) -> RewardFn:
    quality = int(options.get("quality", 95))
    return lambda images, prompts: jpeg_size_kb(images, quality)


# --- Learned reward models (optional extras; see agg_bench/reward_models/) ---------------------------
register_reward("hpsv2", "agg_bench.reward_models.hpsv2:build")
register_reward("pickscore", "agg_bench.reward_models.pickscore:build")
register_reward("imagereward", "agg_bench.reward_models.imagereward:build")
register_reward("clipscore", "agg_bench.reward_models.clipscore:build")
register_reward("aesthetic", "agg_bench.reward_models.aesthetic:build")
# --- end of learned reward models --------------------------------------------------------------------
