"""Download-free rewards: values against float64 references, and their options checked like config keys."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from agg_bench.cli import main
from agg_bench.engine.rewards import build_reward
from agg_bench.errors import ConfigError
from helpers import fresh_seed, seeded


def smoothness_reference(image: np.ndarray) -> float:
    """Minus the mean absolute neighbour difference, down and across, one pixel pair at a time."""
    x = np.clip(image, 0.0, 1.0)
    c, h, w = x.shape
    down = sum(abs(x[k, i + 1, j] - x[k, i, j]) for k in range(c) for i in range(h - 1) for j in range(w))
    across = sum(abs(x[k, i, j + 1] - x[k, i, j]) for k in range(c) for i in range(h) for j in range(w - 1))
    return -(down / (c * (h - 1) * w) + across / (c * h * (w - 1)))


def test_smoothness_matches_a_float64_reference_and_prefers_flat_images():
    gen = torch.Generator().manual_seed(fresh_seed())
    images = torch.rand(3, 3, 7, 5, generator=gen, dtype=torch.float64) * 1.4 - 0.2  # some pixels outside [0, 1]
    reward = build_reward("smoothness", {})
    got = reward(images, ["a"] * 3)
    assert got.dtype == torch.float64
    for i in range(3):
        assert float(got[i]) == pytest.approx(smoothness_reference(images[i].numpy()), rel=1e-12)
    flat = torch.full((1, 3, 8, 8), 0.5, dtype=torch.float64)
    assert float(reward(flat, ["a"])[0]) == 0.0 and float(reward(flat + 0.01 * torch.randn_like(flat), ["a"])[0]) < 0


def test_smoothness_is_continuous_in_the_pixels():
    """A last-bit change of the pixels moves smoothness by about as much (a JPEG byte count of 8-bit pixels
    can jump instead, which is why cross-path equality tests use this reward)."""
    gen = torch.Generator().manual_seed(seeded(3))
    images = torch.rand(16, 3, 16, 16, generator=gen, dtype=torch.float64)
    nudged = images * (1 + 1e-15)
    reward = build_reward("smoothness", {})
    assert torch.allclose(reward(images, [""] * 16), reward(nudged, [""] * 16), rtol=1e-13, atol=0)


@pytest.mark.parametrize("name, options, key", [
    ("jpeg_compressibility", {"quality": 0}, "reward.options.quality"),
    ("jpeg_compressibility", {"quality": 101}, "reward.options.quality"),
    ("jpeg_incompressibility", {"quality": 50.5}, "reward.options.quality"),
    ("jpeg_compressibility", {"quality": "high"}, "reward.options.quality"),
    ("jpeg_compressibility", {"quality": True}, "reward.options.quality"),
    ("jpeg_compressibility", {"qualty": 90}, "reward.options.qualty"),
    ("smoothness", {"scale": 2}, "reward.options.scale"),
])
def test_reward_options_are_checked(name, options, key):
    with pytest.raises(ConfigError) as err:
        build_reward(name, options)
    assert err.value.key == key


@pytest.mark.parametrize("name, options, words", [
    ("clipscore", {"model": "m", "w": float("nan")}, "reward.options.w = nan: expected a finite number"),
    ("clipscore", {"model": "m", "w": "2"}, "reward.options.w = '2': expected a number"),
    ("clipscore", {"model": "m", "w": 0}, "reward.options.w = 0: expected a number > 0"),
    ("clipscore", {"model": "m", "prefix": 5}, "reward.options.prefix = 5: expected a string"),
    ("pickscore", {"model": ""}, "reward.options.model = '': expected a folder"),
    ("pickscore", {"model": "m", "batch_size": 0}, "reward.options.batch_size = 0: expected an integer from 1"),
    ("imagereward", {"checkpoint": "c.pt"}, "reward.options.tokenizer = None: expected a folder"),
    ("hpsv2", {"checkpoint": "c.pt/", "tokenizer": "t"}, "ends with /"),
    ("aesthetic", {"model": "m", "head": "h", "dtype": "half"}, "reward.options.dtype = 'half': expected one of"),
])
def test_a_reward_models_options_are_refused_before_any_file_is_read(name, options, words):
    """Each learned reward's options are typed fields (agg_bench/config/reward_options.py): a value its build would
    have taken (a weight of NaN or '2', a prefix 5) or refused only once it read files is refused by the config
    check, which the sweep's parse and agg-bench plan run too, before any file is looked at."""
    from agg_bench.config.reward_options import reward_options

    with pytest.raises(ConfigError) as err:
        reward_options(name, options)
    assert words in str(err.value), err.value


def test_plan_refuses_a_reward_option_that_the_run_refuses(capsys):
    """agg-bench plan answered "fits: yes" for a reward option the run refuses."""
    code = main(["plan", "--set", "reward.options.qualty=90"])
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["agg-bench plan: config error: reward.options.qualty = 90: expected a known option of reward "
                   "'jpeg_compressibility' (quality)"]


def test_a_bad_reward_option_exits_2_before_the_run_writes_anything(tmp_path, capsys):
    out = tmp_path / "run"
    code = main(["run", "--set", "reward.options.quality=0", "--set", "model.resolution=32",
                 "--set", "progress=false", "--out", str(out)])
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "reward.options.quality" in err[0] and "from 1 to 100" in err[0]
    assert not out.exists() or not any(out.iterdir())


@pytest.mark.parametrize("name", ["hpsv2", "pickscore", "imagereward", "clipscore", "aesthetic"])
def test_learned_rewards_refuse_unknown_options_before_loading_anything(name):
    with pytest.raises(ConfigError) as err:
        build_reward(name, {"checkpont": "x.pt", "batch_size": 4})
    assert err.value.key == "reward.options.checkpont" and "batch_size" in err.value.expected
