"""Reward registry.

A reward is a callable ``reward(images, prompts) -> Tensor (B,)`` where ``images`` are decoded images
(B, 3, H, W) in [0, 1]. Rewards are built by name with :func:`build_reward`; entries may be given as
``"module:attr"`` strings so that optional extras are imported only when used.
"""
from __future__ import annotations

import importlib
import io
from typing import Callable

import numpy as np
import torch
from PIL import Image

from .errors import ConfigError

RewardFn = Callable[[torch.Tensor, list[str]], torch.Tensor]
REWARDS: dict[str, object] = {}


def register_reward(name: str, factory: object | None = None):
    """Register ``factory(options: dict, device) -> RewardFn`` under ``name`` (usable as a decorator)."""
    if factory is not None:
        REWARDS[name] = factory
        return factory

    def deco(f):
        REWARDS[name] = f
        return f

    return deco


def build_reward(name: str, options: dict | None = None, device: str | torch.device = "cpu") -> RewardFn:
    if name not in REWARDS:
        raise ConfigError("reward.name", name, f"one of {sorted(REWARDS)}")
    factory = REWARDS[name]
    if isinstance(factory, str):
        module, attr = factory.split(":")
        factory = getattr(importlib.import_module(module), attr)
    return factory(dict(options or {}), device)


def reward_details(reward: RewardFn) -> dict[str, float]:
    """Batch means of the sub-scores a reward keeps of its last call (its ``details``: name -> (B,)), as
    extra record keys; {} for rewards without sub-scores."""
    return {name: float(values.float().mean()) for name, values in getattr(reward, "details", {}).items()}


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
register_reward("scene", "agg_bench.scene_reward:build")  # verifiable: colour, shape, position, count
# --- end of learned reward models --------------------------------------------------------------------
