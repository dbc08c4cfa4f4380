"""Reward registry.

A reward is a callable ``reward(images, prompts) -> Tensor (B,)`` where ``images`` are decoded images
(B, 3, H, W) in [0, 1]. Rewards are built by name with :func:`build_reward`; entries may be given as
``"module:attr"`` strings so that optional extras are imported only when used
(:class:`agg_bench.registry.Registry`, the style of methods and caches too).
"""
from __future__ import annotations

import io
import math
from typing import Callable

import numpy as np
import torch
from PIL import Image

from ..config.reward_options import reward_options
from ..registry import Registry

RewardFn = Callable[[torch.Tensor, list[str]], torch.Tensor]
REWARDS = Registry("reward.name")


def register_reward(name: str, factory: object | None = None):
    """Register ``factory(options: dict, device) -> RewardFn`` under ``name`` (usable as a decorator)."""
    return REWARDS.register(name, factory)


def build_reward(name: str, options: dict | None = None, device: str | torch.device = "cpu") -> RewardFn:
    return REWARDS.resolve(name)(dict(options or {}), device)


def reward_details(reward: RewardFn) -> dict[str, float]:
    """Batch means of the sub-scores a reward keeps of its last call (its ``details``: name -> (B,)), as
    extra record keys; {} for rewards without sub-scores."""
    return {name: float(values.float().mean()) for name, values in getattr(reward, "details", {}).items()}


def unscored_if_not_finite(scores: torch.Tensor, images: torch.Tensor) -> torch.Tensor:
    """``scores`` (B,) of ``images`` (B, ...), NaN where an image holds a NaN or an infinity: the built-in rewards
    clamp pixels to [0, 1] and would score a NaN image as a black one, so a blown-up rollout would look like a
    finite reward. Those who read the scores see the NaN (a run ends as diverged there)."""
    bad = ~torch.isfinite(images).flatten(1).all(dim=1).to(scores.device)
    return scores.masked_fill(bad, math.nan) if bool(bad.any()) else scores


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


def _jpeg_quality(reward: str, options: dict) -> int:
    return reward_options(reward, options)["quality"]


@register_reward("jpeg_compressibility")
def _jpeg_compressibility(options: dict, device) -> RewardFn:
    quality = _jpeg_quality("jpeg_compressibility", options)
    return lambda images, prompts: -jpeg_size_kb(images, quality)


@register_reward("jpeg_incompressibility")
def _jpeg_incompressibility(options: dict, device) -> RewardFn:
    quality = _jpeg_quality("jpeg_incompressibility", options)
    return lambda images, prompts: jpeg_size_kb(images, quality)


def total_variation(images: torch.Tensor) -> torch.Tensor:
    """Mean absolute difference of neighbouring pixels (horizontal + vertical) per image, in the images' dtype."""
    x = images.detach().clamp(0, 1)
    dy = (x[..., 1:, :] - x[..., :-1, :]).abs().flatten(1).mean(dim=1)
    dx = (x[..., :, 1:] - x[..., :, :-1]).abs().flatten(1).mean(dim=1)
    return dy + dx


@register_reward("smoothness")
def _smoothness(options: dict, device) -> RewardFn:
    """Minus the total variation: a smooth image scores higher. Like JPEG compressibility it rewards the
    absence of fine detail, but it is a continuous function of the pixels (no 8-bit rounding, no byte
    counts), so two computations of the same images that differ in the last bits give rewards that differ
    in the last bits too."""
    reward_options("smoothness", options)
    return lambda images, prompts: -total_variation(images)


# --- Learned reward models (optional extras; see agg_bench/engine/reward_models/) ---------------------------
register_reward("hpsv2", "agg_bench.engine.reward_models.hpsv2:build")
register_reward("pickscore", "agg_bench.engine.reward_models.pickscore:build")
register_reward("imagereward", "agg_bench.engine.reward_models.imagereward:build")
register_reward("clipscore", "agg_bench.engine.reward_models.clipscore:build")
register_reward("aesthetic", "agg_bench.engine.reward_models.aesthetic:build")
register_reward("scene", "agg_bench.engine.scene_reward:build")  # verifiable: colour, shape, position, count
# --- end of learned reward models --------------------------------------------------------------------
