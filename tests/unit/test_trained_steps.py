"""Step plans: DanceGRPO's random steps per sample and the AGG authors' random whole groups per sample."""

import pytest
import torch

from agg_bench.engine.trained_steps import draw_trained_steps, plan_steps
from agg_bench.errors import ConfigError
from agg_bench.runtime.train import Session
from helpers import tiny_config


def all_steps(t: int) -> torch.Tensor:
    return torch.ones(t, dtype=torch.bool)


@pytest.mark.parametrize("fraction, t", [(0.5, 10), (0.7, 6), (0.29, 100), (0.01, 6)])
def test_steps_plan_draws_its_own_sorted_subset_per_sample(rng, fraction, t):
    plan = draw_trained_steps("steps", 16, all_steps(t), fraction, 5, rng)
    n = max(1, round(fraction * t))
    assert plan.shape == (16, n) and plan.dtype == torch.int64
    for row in plan:
        assert torch.equal(row, row.unique(sorted=True))  # distinct and in denoising order
        assert 0 <= int(row.min()) and int(row.max()) < t
    if n < t:
        assert len({tuple(r.tolist()) for r in plan}) > 1


@pytest.mark.parametrize("plan, fraction, t", [("steps", 0.6, 10), ("steps", 1.0, 16), ("groups", 0.6, 21),
                                               ("groups", 1.0, 11)])
def test_ignore_last_never_draws_the_last_step(rng, plan, fraction, t):
    """``train.ignore_last`` (the public ``--ignore_last``): the plan draws from steps 0..T-2, as many as it
    would from T-1 available steps (DanceGRPO at 10 steps and 0.6: int(9 x 0.6) = 5)."""
    available = plan_steps(all_steps(t), True)
    assert available.tolist() == [True] * (t - 1) + [False] and all_steps(t).all()  # a copy: the mask is kept
    drawn = draw_trained_steps(plan, 64, available, fraction, 5, rng)
    same_count = draw_trained_steps(plan, 1, all_steps(t - 1), fraction, 5, rng)
    assert drawn.shape[1] == same_count.shape[1] and int(drawn.max()) <= t - 2
    if plan == "steps" and fraction < 1:
        assert drawn.shape[1] == int((t - 1) * fraction)
    assert plan_steps(all_steps(t), False) is not None and plan_steps(all_steps(t), False).all()


def test_counts_are_rounded(rng):
    assert draw_trained_steps("steps", 1, all_steps(100), 0.29, 5, rng).shape[1] == 29  # 0.29 * 100 in floats < 29
    assert draw_trained_steps("steps", 1, all_steps(10), 0.75, 5, rng).shape[1] == 8   # round(7.5), not int(7.5)
    assert draw_trained_steps("groups", 1, all_steps(25), 0.7, 5, rng).shape[1] == 4 * 5  # round(3.5) = 4 groups


def test_groups_plan_keeps_whole_groups_of_consecutive_steps(rng):
    """The authors' reference schedule: 21 steps, W = 5, 0.6 of the groups."""
    plan = draw_trained_steps("groups", 64, all_steps(21), 0.6, 5, rng)
    assert plan.shape == (64, 2 * 5)  # 4 whole groups (step 20 is left over), round(2.4) = 2 trained
    seen = set()
    for row in plan:
        chunks = row.view(-1, 5)
        for chunk in chunks:
            start = int(chunk[0])
            assert start % 5 == 0 and chunk.tolist() == list(range(start, start + 5))
            seen.add(start)
        assert torch.equal(row, row.sort().values)
        assert int(row.max()) < 20
    assert seen == {0, 5, 10, 15}  # every group gets drawn: the shuffle is over groups
    assert len({tuple(r.tolist()) for r in plan}) > 1  # and per sample


def test_groups_plan_uses_only_steps_with_a_log_probability(rng):
    available = torch.zeros(12, dtype=torch.bool)
    available[3:10] = True  # an SDE window of 7 steps: groups [3..5], [6..8]; step 9 left over
    plan = draw_trained_steps("groups", 8, available, 1.0, 3, rng)
    assert plan.tolist() == [[3, 4, 5, 6, 7, 8]] * 8


@pytest.mark.parametrize("kind, fraction, window, key", [
    ("groups", 0.5, 0, "train.plan_window"),
    ("groups", 0.5, 7, "train.plan_window"),
    ("steps", 0.0, 5, "train.timestep_fraction"),
    ("groups", 1.5, 2, "train.timestep_fraction"),
    ("blocks", 0.5, 2, "train.plan"),
])
def test_bad_plan_settings_name_their_key(rng, kind, fraction, window, key):
    with pytest.raises(ConfigError) as err:
        draw_trained_steps(kind, 2, all_steps(6), fraction, window, rng)
    assert err.value.key == key


def test_full_and_agg_train_the_same_steps_of_the_same_rollout():
    plan = ["train.plan=groups", "train.plan_window=3", "train.timestep_fraction=0.5", "model.dtype=float32"]
    a = Session(tiny_config(*plan)).collect(0).batch
    b = Session(tiny_config(*plan, "method.name=agg", "method.window=3")).collect(0).batch
    assert torch.equal(a.train_steps, b.train_steps) and torch.equal(a.latents, b.latents)
    assert a.train_steps.shape == (a.batch_size, 3)
