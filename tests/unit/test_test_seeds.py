"""AGG_BENCH_TEST_SEED (tests/helpers.py): unset, the tests draw from the seeds they write; set, from others,
distinct where the written seeds are, and the same on every run."""
import pytest
import torch

from helpers import SEED_STRIDE, TEST_SEED_VAR, fresh_seed, seeded, seed_shift, tiny_config


def test_unset_or_zero_keeps_the_written_seeds(monkeypatch):
    for value in (None, "", "0"):
        if value is None:
            monkeypatch.delenv(TEST_SEED_VAR, raising=False)
        else:
            monkeypatch.setenv(TEST_SEED_VAR, value)
        assert [seeded(s) for s in (0, 7, 1234, 2**32 - 1)] == [0, 7, 1234, 2**32 - 1]
        assert tiny_config().seed == 0 and tiny_config("seed=5").seed == 5


def test_a_shift_moves_every_seed_and_keeps_them_apart(monkeypatch):
    written = range(2000)  # every seed the tests write is below 2000
    monkeypatch.setenv(TEST_SEED_VAR, "3")
    moved = [seeded(s) for s in written]
    assert moved == [s + 3 * SEED_STRIDE for s in written]
    assert tiny_config().seed == seeded(0) and tiny_config("seed=5").seed == 5  # an explicit seed stays
    monkeypatch.setenv(TEST_SEED_VAR, "4")
    assert not set(moved) & {seeded(s) for s in written}  # two shifts never share a seed


def test_fresh_seeds_repeat_under_a_shift_and_differ_between_draws(monkeypatch):
    monkeypatch.setenv(TEST_SEED_VAR, "2")
    monkeypatch.setenv("PYTEST_CURRENT_TEST", "tests/unit/test_x.py::test_y (call)")
    monkeypatch.setattr("helpers._fresh_draws", {})
    first, second = fresh_seed(), fresh_seed()
    drawn = torch.randn(3)
    assert first != second
    monkeypatch.setattr("helpers._fresh_draws", {})
    assert fresh_seed() == first  # the same test's first draw: the same seed on a rerun
    fresh_seed()
    assert torch.equal(torch.randn(3), drawn)  # torch's global generator reseeded with it


@pytest.mark.parametrize("value", ["-1", "x", "1.5", str(2**20 + 1), "017", "1e3"])
def test_a_bad_value_is_refused_by_name(monkeypatch, value):
    monkeypatch.setenv(TEST_SEED_VAR, value)
    with pytest.raises(ValueError, match=rf"^{TEST_SEED_VAR}='{value}': expected an integer from 0 to 1048576$"):
        seed_shift()
