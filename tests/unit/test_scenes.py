"""The drawn-scenes data set and the ``scene`` reward, on drawings whose answers are known."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from agg_bench.engine.rewards import build_reward, reward_details
from agg_bench.engine.scene_reward import SUBSCORES, components
from agg_bench.engine.scenes import (COLORS, POSITIONS, SHAPES, all_scenes, draw, draw_batch, parse_caption,
                                     region_bounds)
from agg_bench.errors import ConfigError, UserError
from helpers import seeded

SIZE = 32


def test_captions_round_trip_and_are_unique():
    scenes = all_scenes()
    assert len(scenes) == 3 * len(COLORS) * len(SHAPES) * len(POSITIONS)
    assert len({s.caption for s in scenes}) == len(scenes)
    for scene in scenes:
        assert parse_caption(scene.caption) == scene
        assert parse_caption("  " + scene.caption.upper() + " ") == scene
    with pytest.raises(ValueError, match="not a scene caption"):
        parse_caption("four red circles on the left")


def test_drawing_is_seeded_and_shows_the_scene():
    scenes = all_scenes()[::5]
    a = draw_batch(scenes, SIZE, torch.Generator().manual_seed(seeded(3)))
    b = draw_batch(scenes, SIZE, torch.Generator().manual_seed(seeded(3)))
    c = draw_batch(scenes, SIZE, torch.Generator().manual_seed(seeded(4)))
    assert torch.equal(a, b) and not torch.equal(a, c)


@pytest.mark.parametrize("size", [16, 24, 32, 48])
def test_every_scene_is_drawn_as_its_caption_says(size):
    gen = torch.Generator().manual_seed(seeded(size))
    for scene in all_scenes():
        image = draw(scene, size, gen)
        mask = image.amax(0) > 0
        # only the scene's colour, exactly
        assert torch.equal(image[:, mask], torch.tensor(COLORS[scene.color]).view(3, 1).expand(3, int(mask.sum())))
        # every pixel in the scene's half
        x0, x1, y0, y1 = region_bounds(scene.position, size)
        ys, xs = mask.nonzero(as_tuple=True)
        assert xs.min() >= x0 and xs.max() < x1 and ys.min() >= y0 and ys.max() < y1, scene.caption
        # as many separate shapes as the caption says (shapes never touch)
        labels = components(mask[None])[0]
        assert labels.unique().numel() - 1 == scene.count, scene.caption
        # each shape lies inside one of the count slots along the half's long side
        axis = 1 if POSITIONS[scene.position][0] == 0 else 0  # top/bottom: slots side by side (x)
        lo, hi = (x0, x1) if axis == 1 else (y0, y1)
        slot = (hi - lo) / scene.count
        for label in labels.unique()[1:]:
            coords = (labels == label).nonzero()[:, 0 if axis == 0 else 1].float()
            k = int((coords.mean() - lo) // slot)
            assert lo + k * slot <= coords.min() and coords.max() < lo + (k + 1) * slot, scene.caption


def flood_fill_count(mask: torch.Tensor) -> int:
    """Reference: 4-connected components by a plain depth-first flood fill."""
    seen, h, w, count = set(), *mask.shape, 0
    for start in map(tuple, mask.nonzero().tolist()):
        if start in seen:
            continue
        count += 1
        stack = [start]
        seen.add(start)
        while stack:
            y, x = stack.pop()
            for ny, nx in ((y + 1, x), (y - 1, x), (y, x + 1), (y, x - 1)):
                if 0 <= ny < h and 0 <= nx < w and mask[ny, nx] and (ny, nx) not in seen:
                    seen.add((ny, nx))
                    stack.append((ny, nx))
    return count


def test_components_match_flood_fill(rng):
    masks = torch.rand(6, 20, 20, generator=rng) < 0.45
    labels = components(masks)
    for mask, label in zip(masks, labels):
        assert torch.equal(label > 0, mask)
        assert label.unique().numel() - 1 == flood_fill_count(mask)


def other(values, current):
    return next(v for v in values if v != current)


WRONG = {
    "color": (lambda s: dataclasses.replace(s, color=other(COLORS, s.color)), "reward_color"),
    "shape": (lambda s: dataclasses.replace(s, shape=other(SHAPES, s.shape)), "reward_shape"),
    "position": (lambda s: dataclasses.replace(s, position={"left": "right", "right": "left", "top": "bottom",
                                                            "bottom": "top"}[s.position]), "reward_position"),
    "count": (lambda s: dataclasses.replace(s, count=s.count % 3 + 1), "reward_count"),
}


@pytest.mark.parametrize("kind", sorted(WRONG))
def test_correct_drawing_scores_higher_than_a_wrong_one(kind):
    """Each scene's correct drawing beats the drawing with one attribute wrong, in the total and in the
    sub-score of that attribute; the other sub-scores of a wrong colour/shape/count drawing stay high."""
    reward = build_reward("scene", {}, "cpu")
    make_wrong, subscore = WRONG[kind]
    scenes = all_scenes()[::4]  # 36 scenes: every count, colour, shape and position
    captions = [s.caption for s in scenes]
    gen = torch.Generator().manual_seed(seeded(11))
    right = reward(draw_batch(scenes, SIZE, gen), captions)
    right_details = dict(reward.details)
    wrong = reward(torch.stack([draw(make_wrong(s), SIZE, gen) for s in scenes]), captions)
    assert (right > wrong).all(), kind
    assert (right_details[subscore] > reward.details[subscore]).all(), kind
    assert set(reward_details(reward)) == set(SUBSCORES)


def test_empty_image_scores_zero_and_reward_is_the_mean_of_its_subscores():
    reward = build_reward("scene", {}, "cpu")
    scenes = all_scenes()[:3]
    images = torch.cat([torch.zeros(1, 3, SIZE, SIZE), draw_batch(scenes[1:], SIZE, torch.Generator())])
    total = reward(images, [s.caption for s in scenes])
    assert total[0] == 0
    assert torch.equal(total, torch.stack([reward.details[k] for k in SUBSCORES]).mean(0))
    assert ((total >= 0) & (total <= 1)).all()


def test_bad_captions_and_options_are_clear_errors():
    reward = build_reward("scene", {}, "cpu")
    with pytest.raises(UserError, match="scene captions only"):
        reward(torch.zeros(1, 3, SIZE, SIZE), ["a photo of a cat"])
    for options in ({"foreground": -1}, {"foreground": float("nan")}, {"min_area": 2}, {"foreground": "a"},
                    {"foreground": True}, {"colour": 1}):
        with pytest.raises(ConfigError, match="reward.options"):
            build_reward("scene", options, "cpu")


def test_weighted_scene_reward_is_the_weighted_mean_of_its_subscores():
    """``reward.options.weights``: sum w_k s_k / sum w_k over the sub-scores (unnamed ones weigh 0), the
    sub-scores themselves unchanged; the default is the plain mean."""
    from agg_bench.engine.rewards import build_reward

    gen = torch.Generator().manual_seed(seeded(11))
    scenes = [all_scenes()[i] for i in torch.randperm(144, generator=gen)[:6].tolist()]
    images = torch.rand(6, 3, 32, 32, generator=gen)  # noise, then three true drawings
    images[:3] = torch.stack([draw(s, 32, torch.Generator().manual_seed(seeded(i))) for i, s in enumerate(scenes[:3])])
    captions = [s.caption for s in scenes]
    plain = build_reward("scene", {})
    mean = plain(images, captions)
    weights = {"shape": 3.0, "count": 1.0}
    weighted = build_reward("scene", {"weights": weights})
    got = weighted(images, captions)
    d = {k: v.double() for k, v in plain.details.items()}
    expected = (3 * d["reward_shape"] + d["reward_count"]) / 4
    assert torch.allclose(got.double(), expected, rtol=1e-6, atol=1e-7)
    assert all(torch.equal(weighted.details[k], plain.details[k]) for k in SUBSCORES)
    assert torch.equal(mean, torch.stack([plain.details[k] for k in SUBSCORES]).mean(0))


@pytest.mark.parametrize("value", [{"shape": -1}, {"shape": 0}, {"size": 1}, {"shape": float("nan")},
                                   {"shape": True}, {}, "shape", [1, 0, 0, 0]])
def test_bad_scene_weights_are_refused(value):
    from agg_bench.engine.rewards import build_reward
    from agg_bench.errors import ConfigError

    with pytest.raises(ConfigError) as err:
        build_reward("scene", {"weights": value})
    assert err.value.key.startswith("reward.options.weights")  # NaN: the key of the weight that is NaN
