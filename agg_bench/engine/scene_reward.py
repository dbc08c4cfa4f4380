"""The ``scene`` reward: how well an image shows what its scene caption says, from the pixels alone.

In the spirit of GenEval's object checks, but with no detector: the scenes of :mod:`agg_bench.engine.scenes`
are flat colours on black, so colour, count, position and shape can be read off the pixels.

1. Foreground: pixels whose brightest channel exceeds ``foreground``; each is given the nearest palette
   colour. The *target* pixels are the foreground pixels of the caption's colour.
2. ``reward_color``: target mass / foreground mass (0 for an empty image), where a pixel's foreground
   weight ramps from 0 to 1 as its brightness goes from ``foreground`` - 0.1 to + 0.1, and its target
   mass is that weight times its likeness to the caption's colour (softmax over the palette of minus the
   squared RGB distance / 0.05): pixel shares that change a little when the pixels do.
3. ``reward_position``: the share of the target mass in the caption's half of the image.
4. Components: 4-connected groups of target pixels with at least ``min_area`` x H x W pixels.
   ``reward_count``: exp(-|n - count|) for n components, 0 when there is none.
5. ``reward_shape``: each component is compared (IoU) with the circle, square and triangle drawn into its
   bounding box by the data set's own rasteriser; softmax(IoU / 0.05) gives the probability of the
   caption's shape; the mean over components (0 when there is none).

The reward is the mean of the four sub-scores, in [0, 1], or with ``weights`` (``reward.options.weights``,
e.g. ``{shape: 1}``: sub-score name without ``reward_`` -> a weight >= 0, those not named 0, not all 0) their
weighted mean, sum w_k s_k / sum w_k: a reward that weighs what a model still gets wrong (the learning
testbed's, docs/learning.md). All four are kept (``details``) and become record keys of the iteration
(their batch means), whatever the weights.
"""
from __future__ import annotations

import math
from typing import Mapping, Sequence

import torch
import torch.nn.functional as F

from ..config.reward_options import SCENE_PARTS, SceneOptions, reward_options
from ..errors import ConfigError, UserError
from .scenes import COLORS, POSITIONS, SHAPES, Scene, caption_problem, parse_caption, shape_mask

SUBSCORES = tuple(f"reward_{part}" for part in SCENE_PARTS)
SHAPE_TEMPERATURE = 0.05  # IoU gap of 0.05 between two templates = a factor e in probability
SOFT_BAND = 0.1  # brightness from foreground - 0.1 to + 0.1 ramps a pixel's foreground weight from 0 to 1
SOFT_COLOR = 0.05  # squared RGB distance scale of the palette likeness (palette colours are > 0.5 apart)
RADIUS_MARGINS = (0.0, 0.25, 0.5)  # pixels added to the bounding box's half-sides


def _weights(value: Mapping[str, float] | None) -> dict[str, float] | None:
    """``reward.options.weights`` (checked: :class:`~agg_bench.config.reward_options.SceneOptions`) by sub-score
    key: None (the plain mean) or ``reward_<part>`` -> weight, an unnamed part 0."""
    if value is None:
        return None
    return {f"reward_{k}": float(value.get(k, 0.0)) for k in SCENE_PARTS}


def components(mask: torch.Tensor) -> torch.Tensor:
    """4-connected component labels (B, H, W) of a boolean mask (B, H, W): 0 off the mask, and on it the
    largest flat index + 1 of its component (labels spread by repeated max over the 4 neighbours)."""
    b, h, w = mask.shape
    labels = torch.where(mask, torch.arange(1, h * w + 1, dtype=torch.float32).view(1, h, w), 0.0)
    for _ in range(h * w):
        padded = F.pad(labels, (1, 1, 1, 1))
        spread = torch.stack([labels, padded[:, :-2, 1:-1], padded[:, 2:, 1:-1], padded[:, 1:-1, :-2],
                              padded[:, 1:-1, 2:]]).amax(0)
        spread = torch.where(mask, spread, 0.0)
        if torch.equal(spread, labels):
            break
        labels = spread
    return labels.long()


def shape_probabilities(component: torch.Tensor) -> torch.Tensor:
    """Probabilities (len(SHAPES),) that a boolean component mask (S, S) is each shape, from its best IoU
    with that shape drawn into its bounding box (radii from half the box to half a pixel more, since a
    drawn shape covers the pixels whose centres it contains)."""
    size = component.shape[-1]
    rows, cols = component.any(1).nonzero(), component.any(0).nonzero()
    y0, y1, x0, x1 = int(rows[0]), int(rows[-1]) + 1, int(cols[0]), int(cols[-1]) + 1
    cx, cy = (x0 + x1) / 2, (y0 + y1) / 2
    ious = []
    for shape in SHAPES:
        best = 0.0
        for extra in RADIUS_MARGINS:
            template = shape_mask(shape, cx, cy, (x1 - x0) / 2 + extra, size, (y1 - y0) / 2 + extra)
            best = max(best, float((component & template).sum() / (component | template).sum().clamp(min=1)))
        ious.append(best)
    return torch.softmax(torch.tensor(ious) / SHAPE_TEMPERATURE, 0)


class SceneReward:
    """``reward(images, prompts) -> (B,)``; ``details`` holds the sub-scores (B,) of the last call."""

    def __init__(self, foreground: float = SceneOptions.foreground, min_area: float = SceneOptions.min_area,
                 weights: Mapping[str, float] | None = None):
        self.foreground = foreground
        self.min_area = min_area
        self.weights = dict(weights) if weights is not None else None
        self.palette = torch.tensor(list(COLORS.values()))  # (K, 3)
        self.color_index = {name: i for i, name in enumerate(COLORS)}
        self.details: dict[str, torch.Tensor] = {}

    def score(self, images: torch.Tensor, scenes: Sequence[Scene]) -> dict[str, torch.Tensor]:
        """The four sub-scores (B,) of ``images`` (B, 3, H, W) in [0, 1] against ``scenes``."""
        x = images.detach().float().cpu().clamp(0, 1)
        b, _, h, w = x.shape
        brightness = x.amax(1)  # (B, H, W)
        foreground = brightness > self.foreground
        distances = torch.cdist(x.permute(0, 2, 3, 1).reshape(b, h * w, 3), self.palette.expand(b, -1, -1))
        wanted = torch.tensor([self.color_index[s.color] for s in scenes])
        target = foreground & (distances.argmin(-1).view(b, h, w) == wanted.view(b, 1, 1))
        # graded versions of "foreground" and "has the target colour" for the pixel shares: a small change
        # of the pixels changes these sub-scores a little instead of flipping a threshold
        weight = ((brightness - self.foreground) / (2 * SOFT_BAND) + 0.5).clamp(0, 1)
        likeness = torch.softmax(-distances.square() / SOFT_COLOR, -1)[torch.arange(b), :, wanted].view(b, h, w)
        soft_target = weight * likeness
        mass_fg, mass_target = weight.sum((1, 2)), soft_target.sum((1, 2))
        color = torch.where(mass_fg > 0, mass_target / mass_fg.clamp(min=1e-12), 0.0)
        position = torch.zeros(b)
        rows = (torch.arange(h, dtype=torch.float32) + 0.5).view(h, 1).expand(h, w)
        cols = (torch.arange(w, dtype=torch.float32) + 0.5).view(1, w).expand(h, w)
        labels = components(target)
        count, shape = torch.zeros(b), torch.zeros(b)
        min_pixels = self.min_area * h * w
        for i, scene in enumerate(scenes):
            axis, half = POSITIONS[scene.position]
            along, extent = (rows, h) if axis == 0 else (cols, w)
            inside = (along < extent / 2) if half == 0 else (along >= extent / 2)
            position[i] = (soft_target[i] * inside).sum() / mass_target[i] if mass_target[i] > 0 else 0.0
            ids, areas = labels[i][labels[i] > 0].unique(return_counts=True)
            kept = ids[areas >= min_pixels].tolist()
            if kept:
                count[i] = math.exp(-abs(len(kept) - scene.count))
                target_shape = SHAPES.index(scene.shape)
                shape[i] = torch.stack([shape_probabilities(labels[i] == k)[target_shape] for k in kept]).mean()
        return {"reward_color": color, "reward_shape": shape, "reward_position": position, "reward_count": count}

    def check_prompts(self, prompts: Sequence[str], key: str, value: object) -> None:
        """A ConfigError naming ``key`` (the setting that gave ``prompts``) and ``value`` unless every prompt is a
        scene caption: one that is not would stop a run in its first iteration, after its folder was written."""
        problem = caption_problem(list(prompts))
        if problem is not None:
            raise ConfigError(key, value, f"prompts that are scene captions, the only ones reward 'scene' scores "
                                          f"({problem})")

    def __call__(self, images: torch.Tensor, prompts: Sequence[str]) -> torch.Tensor:
        prompts = [prompts] if isinstance(prompts, str) else list(prompts)
        if images.ndim != 4 or images.shape[1] != 3:
            raise ValueError(f"images must be (B, 3, H, W), got {tuple(images.shape)}")
        if len(prompts) != images.shape[0]:
            raise ValueError(f"{images.shape[0]} images but {len(prompts)} prompts")
        try:
            scenes = [parse_caption(p) for p in prompts]
        except ValueError as err:
            raise UserError(f"reward 'scene' scores scene captions only: {err}") from None
        self.details = self.score(images, scenes)
        if self.weights is None:
            return torch.stack([self.details[k] for k in SUBSCORES]).mean(0)
        total = sum(self.weights.values())
        weighted = sum(self.details[k] * (w / total) for k, w in self.weights.items())
        assert isinstance(weighted, torch.Tensor)  # weights name every sub-score (_weights): never the 0 start
        return weighted


def build(options: Mapping, device) -> SceneReward:
    given = reward_options("scene", options)
    return SceneReward(given["foreground"], given["min_area"], _weights(given["weights"]))
