"""Procedurally drawn scenes: the learning testbed's data set, with nothing stored on disk.

A scene is ``count`` (1-3) copies of one coloured shape in one half of a black square image, captioned
in a fixed grammar: ``"<count> <colour> <shape>[s] <position>"``, e.g. "two red circles on the left".
Images are drawn from a seeded generator, so the same seed gives the same images on every machine.
The same rasteriser draws the data and the shape templates the ``scene`` reward compares against.

Pixels are in [0, 1] (3, S, S); shapes are hard-edged (a pixel is in a shape when its centre is).
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import torch

from ..errors import ConfigError, quote

COLORS: dict[str, tuple[float, float, float]] = {
    "red": (0.9, 0.1, 0.1),
    "green": (0.1, 0.8, 0.2),
    "blue": (0.15, 0.3, 1.0),
    "yellow": (0.95, 0.85, 0.1),
}
SHAPES = ("circle", "square", "triangle")
# position word -> (axis, half): axis 1 is x (columns), 0 is y (rows); half 0 is left/top
POSITIONS: dict[str, tuple[int, int]] = {"left": (1, 0), "right": (1, 1), "top": (0, 0), "bottom": (0, 1)}
POSITION_PHRASES = {"left": "on the left", "right": "on the right", "top": "at the top", "bottom": "at the bottom"}
COUNT_WORDS = ("one", "two", "three")
# Shape half-size as a fraction of its slot's shorter side (a slot: the half's short side x its long side
# / count), drawn once per scene: as large as the slot allows with room for the gap and some jitter.
RADIUS_RANGE = (0.34, 0.42)
GAP = 0.04  # least free space between two shapes, as a fraction of the image side
JITTER = 0.06  # most a shape moves from its slot's centre, as a fraction of the image side


@dataclass(frozen=True)
class Scene:
    """What a caption says: ``count`` shapes of kind ``shape`` in colour ``color`` at ``position``."""

    count: int
    color: str
    shape: str
    position: str

    @property
    def caption(self) -> str:
        plural = "s" if self.count > 1 else ""
        return f"{COUNT_WORDS[self.count - 1]} {self.color} {self.shape}{plural} {POSITION_PHRASES[self.position]}"


def all_scenes() -> list[Scene]:
    """Every scene the grammar can say (3 counts x 4 colours x 3 shapes x 4 positions = 144), in a fixed order."""
    return [Scene(n, c, s, p) for n, c, s, p in itertools.product((1, 2, 3), COLORS, SHAPES, POSITIONS)]


_BY_CAPTION = {scene.caption: scene for scene in all_scenes()}


def parse_caption(caption: str) -> Scene:
    """The scene a caption describes; ValueError for text outside the grammar (case and spacing are free)."""
    scene = _BY_CAPTION.get(" ".join(caption.lower().split()))
    if scene is None:
        raise ValueError(f"{quote(caption)} is not a scene caption (e.g. {all_scenes()[13].caption!r})")
    return scene


def caption_problem(captions: list[str]) -> str | None:
    """The first caption the scene reward cannot score, with its number from 1 (quoted, at most 200 characters),
    or None."""
    for k, caption in enumerate(captions, 1):
        try:
            parse_caption(caption)
        except ValueError as err:
            return f"caption {k} {err}"
    return None


def shape_mask(shape: str, cx: float, cy: float, r: float, size: int, ry: float | None = None) -> torch.Tensor:
    """Boolean (size, size) mask of ``shape`` centred at pixel coordinates (cx, cy), half-width ``r`` and
    half-height ``ry`` (default ``r``).

    Circle: an ellipse with these radii. Square: a 2r x 2ry rectangle. Triangle: apex up at cy - ry, base
    2r wide at cy + ry. A pixel is inside when its centre is.
    """
    ry = r if ry is None else ry
    coords = torch.arange(size, dtype=torch.float32) + 0.5
    y, x = coords[:, None], coords[None, :]
    if shape == "circle":
        return ((x - cx) / r) ** 2 + ((y - cy) / ry) ** 2 <= 1
    if shape == "square":
        return ((x - cx).abs() <= r) & ((y - cy).abs() <= ry)
    if shape == "triangle":
        # the half-width grows linearly from 0 at the apex to r at the base
        return (y >= cy - ry) & (y <= cy + ry) & ((x - cx).abs() <= r * (y - (cy - ry)) / (2 * ry))
    raise ValueError(f"unknown shape {shape!r}; one of {SHAPES}")


def region_bounds(position: str, size: int) -> tuple[float, float, float, float]:
    """(x0, x1, y0, y1) of the half of the image that ``position`` names, in pixels."""
    axis, half = POSITIONS[position]
    lo, hi = (0.0, size / 2) if half == 0 else (size / 2, float(size))
    return (0.0, float(size), lo, hi) if axis == 0 else (lo, hi, 0.0, float(size))


def place(scene: Scene, size: int, generator: torch.Generator) -> list[tuple[float, float, float]]:
    """(cx, cy, r) of each shape: the shapes in ``count`` equal slots along the long side of the scene's
    half, one radius per scene (RADIUS_RANGE of the slot's shorter side), each centred in its slot and
    moved by up to JITTER x ``size`` along either axis, as far as keeps it inside its slot with GAP to
    spare (so shapes never touch)."""
    x0, x1, y0, y1 = region_bounds(scene.position, size)
    along_x = POSITIONS[scene.position][0] == 0  # top/bottom halves are wide: slots side by side
    long_lo, long_hi, short_lo, short_hi = (x0, x1, y0, y1) if along_x else (y0, y1, x0, x1)
    slot = (long_hi - long_lo) / scene.count
    fraction = RADIUS_RANGE[0] + (RADIUS_RANGE[1] - RADIUS_RANGE[0]) * float(torch.rand((), generator=generator))
    r = fraction * min(slot, short_hi - short_lo)
    # one pixel less: rounding the centres to pixel corners moves two neighbours up to 1 px closer
    reach_long = min(JITTER * size, max(0.0, (slot - 2 * r - GAP * size - 1) / 2))
    reach_short = min(JITTER * size, max(0.0, (short_hi - short_lo - 2 * r - 1) / 2))
    placed = []
    for k in range(scene.count):
        u, v = (2 * torch.rand(2, generator=generator) - 1).tolist()
        along = long_lo + (k + 0.5) * slot + u * reach_long
        across = (short_lo + short_hi) / 2 + v * reach_short
        cx, cy = (along, across) if along_x else (across, along)
        # centres on pixel corners: every shape is drawn symmetric about its centre
        placed.append((float(math.floor(cx + 0.5)), float(math.floor(cy + 0.5)), r))
    return placed


def draw(scene: Scene, size: int, generator: torch.Generator) -> torch.Tensor:
    """One image (3, size, size) in [0, 1] of ``scene`` on a black background."""
    if size < 16:
        raise ConfigError("resolution", size, "at least 16 pixels for a scene")
    mask = torch.zeros(size, size, dtype=torch.bool)
    for cx, cy, r in place(scene, size, generator):
        mask |= shape_mask(scene.shape, cx, cy, r, size)
    color = torch.tensor(COLORS[scene.color]).view(3, 1, 1)
    return mask.float().unsqueeze(0) * color


def sample_scenes(n: int, generator: torch.Generator) -> list[Scene]:
    """``n`` scenes drawn uniformly from :func:`all_scenes`."""
    scenes = all_scenes()
    return [scenes[i] for i in torch.randint(len(scenes), (n,), generator=generator).tolist()]


def draw_batch(scenes: list[Scene], size: int, generator: torch.Generator) -> torch.Tensor:
    """Images (B, 3, size, size) in [0, 1] of ``scenes``."""
    return torch.stack([draw(scene, size, generator) for scene in scenes])
