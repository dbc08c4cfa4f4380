"""Timing statistics: quartiles and the bootstrap interval against float64 loops written out here,
the prediction from counted passes and calls, and the efficiency table's cost-model columns."""
import json
import math
import statistics

import numpy as np
import pandas as pd
import pytest

from agg_bench.results.loading import CalibrationEntry, RunEntry, load_calibration, load_records
from agg_bench.results.costmodel import fit_call_cost, priced_calls
from agg_bench.results import stats
from agg_bench.results.stats import (paired_ratio_of_medians_ci, predicted_seconds, quartiles, ratio_of_medians_ci,
                                      ratios_of_medians_ci)
from agg_bench.results.tables import efficiency_table, summary_table
from helpers import seeded

EPS = np.finfo(np.float64).eps


def percentile_reference(values, q):
    """Linear interpolation between order statistics at rank q * (n - 1), in Python floats."""
    ordered = sorted(float(v) for v in values)
    rank = q * (len(ordered) - 1)
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (rank - low) * (ordered[high] - ordered[low])


@pytest.mark.parametrize("n", [1, 2, 5, 16, 101])
def test_quartiles_match_the_order_statistics(n):
    values = np.random.default_rng(seeded(n)).lognormal(size=n)
    got = quartiles(values)
    want = [percentile_reference(values, q) for q in (0.25, 0.5, 0.75)]
    # one interpolation step: a few ulps of the largest value
    assert got == pytest.approx(want, rel=0, abs=8 * EPS * float(np.max(values)))
    assert got[1] == pytest.approx(statistics.median(values.tolist()), rel=0, abs=8 * EPS * float(np.max(values)))


def test_quartiles_skip_missing_values_and_say_nan_when_none():
    assert quartiles([1.0, float("nan"), 3.0]) == (1.5, 2.0, 2.5)
    assert all(math.isnan(v) for v in quartiles([float("nan")]))


def bootstrap_reference(num, den, level, resamples, seed):
    """ratio_of_medians_ci's interval written out: the documented draw order, every numerator index as
    (resamples, n), then every denominator index, and the medians' ratios' percentiles in float64."""
    draws = np.random.default_rng(seed)
    num_idx = draws.integers(0, len(num), size=(resamples, len(num)))
    den_idx = draws.integers(0, len(den), size=(resamples, len(den)))
    ratios = [statistics.median(num[i].tolist()) / statistics.median(den[j].tolist())
              for i, j in zip(num_idx, den_idx)]
    tail = (1 - level) / 2
    return percentile_reference(ratios, tail), percentile_reference(ratios, 1 - tail)


def test_bootstrap_interval_matches_a_float64_loop_with_the_same_draws():
    rng = np.random.default_rng(seeded(7))
    num, den = rng.lognormal(1.0, 0.2, size=7), rng.lognormal(0.3, 0.3, size=5)
    resamples, seed = 500, seeded(11)
    lo, hi = ratio_of_medians_ci(num, den, level=0.9, resamples=resamples, seed=seed)
    # a median of floats and one division: within a few ulps of the ratio
    assert (lo, hi) == pytest.approx(bootstrap_reference(num, den, 0.9, resamples, seed), rel=16 * EPS, abs=0)
    assert lo <= np.median(num) / np.median(den) <= hi


def test_bootstrap_is_seeded_and_handles_degenerate_input():
    num, den = [3.0, 3.1, 2.9, 3.05], [1.0, 1.1, 0.95]
    assert ratio_of_medians_ci(num, den) == ratio_of_medians_ci(num, den)  # same seed, same interval
    # each seed its own draws: the interval of those draws (two seeds' intervals can coincide, as medians of 9
    # values take at most 81 ratios: comparing them with each other would test the draw)
    spread = np.random.default_rng(seeded(3)).lognormal(size=(2, 9))
    for seed in (1, 2):
        assert ratio_of_medians_ci(*spread, resamples=300, seed=seed) == pytest.approx(
            bootstrap_reference(*spread, 0.95, 300, seed), rel=16 * EPS, abs=0)
    assert ratio_of_medians_ci([2.0] * 4, [1.0] * 3) == (2.0, 2.0)  # no spread: a point
    assert all(math.isnan(v) for v in ratio_of_medians_ci([], den))
    for bad in ({"level": 1.0}, {"level": float("nan")}, {"resamples": 0}):
        with pytest.raises(ValueError):
            ratio_of_medians_ci(num, den, **bad)


DEFAULT_RNG = np.random.default_rng


class CountedDraws:
    """A numpy Generator that records the size of each draw of indices (``integers``) it makes."""

    def __init__(self, seed, sizes: list):
        self.rng, self.sizes = DEFAULT_RNG(seed), sizes

    def integers(self, *args, size, **kwargs):
        self.sizes.append(int(np.prod(size)))
        return self.rng.integers(*args, size=size, **kwargs)


def one_array_interval(num, den, resamples, paired=False):
    """The bootstrap as one (resamples, n) array of indices a side, medians by np.median (seed 0, level 0.95)."""
    draws = DEFAULT_RNG(0)
    num_idx = draws.integers(0, len(num), size=(resamples, len(num)))
    den_idx = num_idx if paired else draws.integers(0, len(den), size=(resamples, len(den)))
    tail = (1 - 0.95) / 2
    lo, hi = np.percentile(np.median(num[num_idx], axis=1) / np.median(den[den_idx], axis=1),
                           [100 * tail, 100 * (1 - tail)])
    return float(lo), float(hi)


@pytest.mark.parametrize("sizes", [(1, 2), (2, 3), (7, 6), (200, 200), (501, 499)])
def test_the_bootstrap_draws_in_blocks_and_gives_the_one_array_interval(monkeypatch, sizes):
    """A run of 100,000 iterations drew 2000 x 100,000 indices a side at once (3.2 GB with the values): the draws
    come in blocks of at most BOOTSTRAP_BLOCK, the medians from the ranks drawn (a window around the middle, the
    whole row where the middle lies outside it), and the interval is the one array's to the last bit (values with
    ties and without, an odd and an even count, every row outside the window)."""
    rng = DEFAULT_RNG(seeded(21))
    resamples = 200
    monkeypatch.setattr(stats, "BOOTSTRAP_BLOCK", 500)
    for values in (rng.lognormal(size=sum(sizes)), rng.integers(1, 4, size=sum(sizes)).astype(float)):
        num, den = values[:sizes[0]], values[sizes[0]:]
        for outside in (False, True):  # True: every row's middle outside the window
            with monkeypatch.context() as m:
                if outside:
                    m.setattr(stats.math, "isqrt", lambda n: -1)
                drawn: list[int] = []
                m.setattr(stats.np.random, "default_rng", lambda seed, drawn=drawn: CountedDraws(seed, drawn))
                assert ratio_of_medians_ci(num, den, resamples=resamples) == one_array_interval(num, den, resamples)
                assert max(drawn) <= max(500, *sizes) and sum(drawn) == resamples * sum(sizes)
                if sizes[0] == sizes[1]:
                    assert paired_ratio_of_medians_ci(num, den, resamples=resamples) == one_array_interval(
                        num, den, resamples, paired=True)


def test_pairs_of_the_same_sizes_share_their_draws(monkeypatch):
    """A table row's iteration and train-phase speedups resample as many values: one draw serves both, and each
    interval is the one ratio_of_medians_ci gives alone; a pair of other sizes, or without a value, is its own."""
    rng = DEFAULT_RNG(seeded(5))
    pairs = [(rng.lognormal(size=9), rng.lognormal(size=8)), (rng.lognormal(size=9), rng.lognormal(size=8)),
             (rng.lognormal(size=5), rng.lognormal(size=8)), ([], rng.lognormal(size=8))]
    alone = [ratio_of_medians_ci(num, den, resamples=200) for num, den in pairs]
    drawn: list[int] = []
    monkeypatch.setattr(stats.np.random, "default_rng", lambda seed: CountedDraws(seed, drawn))
    together = ratios_of_medians_ci(pairs, resamples=200)
    assert together[:3] == alone[:3] and all(math.isnan(v) for v in together[3]) and all(math.isnan(v) for v in alone[3])
    assert sum(drawn) == 200 * (9 + 8 + 5 + 8)


def test_predicted_seconds_is_the_priced_count_and_nan_when_part_is_missing():
    units = {"forward_nograd": 0.25, "forward_grad": 1.0, "backward": 2.0, "optimizer_step": 5.0}
    counts = {"forward_nograd": 40, "forward_grad": 16, "backward": 16, "optimizer_step": 1}
    assert predicted_seconds(counts, units) == 40 * 0.25 + 16 * 1.0 + 16 * 2.0 + 5.0
    assert math.isnan(predicted_seconds({**counts, "backward": None}, units))
    assert math.isnan(predicted_seconds(counts, {**units, "backward": float("nan")}))
    assert math.isnan(predicted_seconds({**counts, "other": 1}, units))


def test_a_call_cost_splits_into_a_per_call_and_a_per_latent_part():
    # calls of two sizes on the line 2 + 0.5 n: both parts back, whichever size comes first
    assert fit_call_cost([4, 1], [4.0, 2.5]) == (2.0, 0.5)
    assert fit_call_cost([1, 40], [2.5, 22.0]) == (2.0, 0.5)
    # noise that makes 1 latent look dearer than 4: no per-latent part, every call the larger one's cost
    assert fit_call_cost([4, 1], [3.0, 3.2]) == (3.0, 0.0)
    # 1 latent cheaper than its share of the larger call: no per-call part, the per-sample cost
    assert fit_call_cost([40, 1], [4.0, 0.01]) == pytest.approx((0.0, 0.1), abs=1e-15)
    # one size tells the parts not apart: all per latent
    assert fit_call_cost([4], [2.0]) == (0.0, 0.5)


# The embedded default's cell (4 samples, 10 trained steps): full, and AGG (W = 5) with route_frac 0.5, which
# scores its 8 groups from one no-grad call over the 40 (sample, step) pairs, routes 4 (2 calls of 4 endpoints)
# and trains the 4 it leaves exact, 3 rows of one group and 1 of the other, a call per step: 5 of 3 and 5 of 1.
PER_CALL = {"forward_nograd": 2.0, "forward_grad": 2.5, "backward": 2.25}
PER_LATENT = {"forward_nograd": 0.1, "forward_grad": 0.2, "backward": 0.25}
PER_STEP = 3.0
FULL_WORK = ({"forward_nograd": 0, "forward_grad": 40, "backward": 40},
             {"forward_nograd": 0, "forward_grad": 10, "backward": 10})
ROUTED_WORK = ({"forward_nograd": 40, "forward_grad": 28, "backward": 28},
               {"forward_nograd": 1, "forward_grad": 12, "backward": 12})
FULL_S = 10 * (2.5 + 4 * 0.2) + 10 * (2.25 + 4 * 0.25) + PER_STEP
ROUTED_S = (2.0 + 40 * 0.1) + sum(2.5 + 0.2 * n + 2.25 + 0.25 * n for n in [4] * 2 + [3] * 5 + [1] * 5) + PER_STEP
# per sample at the sizes measured (40 latents without grad, the batch of 4 with): what the records can price
PER_SAMPLE = {"forward_nograd": 2.0 / 40 + 0.1, "forward_grad": 2.5 / 4 + 0.2, "backward": 2.25 / 4 + 0.25,
              "optimizer_step": PER_STEP}


def test_priced_calls_charge_every_call_and_every_latent():
    assert priced_calls(*FULL_WORK, 1, PER_CALL, PER_LATENT, PER_STEP) == pytest.approx(FULL_S, rel=4 * EPS)
    assert priced_calls(*ROUTED_WORK, 1, PER_CALL, PER_LATENT, PER_STEP) == pytest.approx(ROUTED_S, rel=4 * EPS)
    # calls of 4 latents: the same price as per sample at the batch's size
    assert predicted_seconds({**FULL_WORK[0], "optimizer_step": 1}, PER_SAMPLE) == pytest.approx(FULL_S, rel=4 * EPS)
    # the routed update's small calls: per sample it looks 1.25x faster than full, per call it is 0.87x
    per_sample = predicted_seconds({**ROUTED_WORK[0], "optimizer_step": 1}, PER_SAMPLE)
    assert FULL_S / per_sample == pytest.approx(1.249, abs=1e-3) and FULL_S / ROUTED_S == pytest.approx(0.872, abs=1e-3)
    # part of the work uncounted or unpriced: no prediction
    uncounted = {"forward_grad": 12, "backward": 12}
    assert math.isnan(priced_calls(ROUTED_WORK[0], uncounted, 1, PER_CALL, PER_LATENT, PER_STEP))
    assert math.isnan(priced_calls(*ROUTED_WORK, 1, {**PER_CALL, "backward": None}, PER_LATENT, PER_STEP))
    assert math.isnan(priced_calls(*ROUTED_WORK, None, PER_CALL, PER_LATENT, PER_STEP))


def _run(root, name, method, t_train_cpu, passes, iterations=6, label=None, **fields):
    """A run folder of ``method`` (a method of the harness, which its config.json names) and its manifest entry,
    labelled ``label`` (the method's name unless given)."""
    run = root / name
    run.mkdir(parents=True)
    lines = []
    for i in range(iterations):
        lines.append({"run_id": name, "method": method, "model": "m", "resolution": 64, "device": "cpu", "seed": 0,
                      "iteration": i, "status": "ok", "reward_mean": 0.0, "reward_std": 0.5,
                      "t_iter_s": 9.0, "t_train_s": 9.0, "t_iter_cpu_s": 2 * t_train_cpu[i],
                      "t_train_cpu_s": t_train_cpu[i], "t_rollout_cpu_s": 0.1, "t_reward_cpu_s": 0.1,
                      **{f"train_{k}": v for k, v in passes.items()}, **fields})
    (run / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    (run / "summary.json").write_text(json.dumps({"status": "ok"}))
    (run / "config.json").write_text(json.dumps({"method": {"name": method}, "train": {"inner_epochs": 1}}))
    return RunEntry(run, method=label or method)


def test_efficiency_table_times_in_cpu_seconds_and_predicts_from_counts(tmp_path):
    full = _run(tmp_path, "full", "full", [50, 4, 4.2, 3.8, 4.1, 3.9],
                {"forward_nograd": 0, "forward_grad": 40, "backward": 40})
    agg = _run(tmp_path, "agg", "agg", [50, 2, 2.1, 1.9, 2.05, 1.95],
               {"forward_nograd": 40, "forward_grad": 16, "backward": 16})
    units = {"forward_nograd": 0.02, "forward_grad": 0.04, "backward": 0.05, "optimizer_step": 0.1}
    cal = tmp_path / "cal.json"
    cal.write_text(json.dumps({"model": "m", "resolution": 64, "device": "cpu", "unit_s_per_sample": {
        k: {"cpu": {"median": v}, "wall": {"median": 10 * v}} for k, v in units.items()}}))
    calibration = load_calibration([CalibrationEntry(cal)])
    table = efficiency_table(load_records([full, agg]), warmup=1, calibration=calibration)
    row = table.set_index("method").loc["agg"]
    assert row["time_basis"] == "cpu"  # CPU times present on a CPU: auto takes them, not the 9 s wall
    assert row["t_train_s"] == 2.0 and (row["t_train_p25_s"], row["t_train_p75_s"]) == (1.95, 2.05)
    assert row["train_speedup"] == 4.0 / 2.0
    assert row["train_speedup_lo"] <= 2.0 <= row["train_speedup_hi"]
    predicted_full = 40 * 0.04 + 40 * 0.05 + 0.1
    predicted_agg = 40 * 0.02 + 16 * 0.04 + 16 * 0.05 + 0.1
    assert row["predicted_train_speedup"] == pytest.approx(predicted_full / predicted_agg, rel=4 * EPS)
    # 3.7 / 2.34 = 1.58 lies below every resampled ratio (at least 3.8 / 2.1 = 1.81): flagged
    assert row["prediction_check"] == "faster than predicted"
    wall = efficiency_table(load_records([full, agg]), warmup=1, time="wall", calibration=calibration)
    row = wall.set_index("method").loc["agg"]
    assert row["time_basis"] == "wall" and row["t_train_s"] == 9.0 and row["train_speedup"] == 1.0
    assert row["predicted_train_speedup"] == pytest.approx(predicted_full / predicted_agg, rel=4 * EPS)


def test_paired_interval_resamples_rounds_together():
    rng = np.random.default_rng(seeded(5))
    machine = rng.lognormal(sigma=0.5, size=15)  # each round's machine state slows both methods alike
    full, agg = 4.0 * machine, 2.0 * machine
    assert paired_ratio_of_medians_ci(full, agg) == pytest.approx((2.0, 2.0), rel=1e-12)
    lo, hi = ratio_of_medians_ci(full, agg)  # taken as independent samples the shared noise stays in
    assert lo < 1.9 and hi > 2.1
    own = rng.lognormal(sigma=0.1, size=15)  # noise of one side alone: the rounds no longer cancel it
    noisy = paired_ratio_of_medians_ci(full * own, agg)
    # every resample's ratio median(2 own m) / median(m) lies in [2 min(own), 2 max(own)] (the median is
    # monotone), so the interval does, whatever the draw (whether it holds 2.0 is a 95 % event, not a fact);
    # up to the rounding of one product and one division (4 m and 2 m are exact): 2 ulps
    assert 2 * own.min() * (1 - 2 * EPS) <= noisy[0] < noisy[1] <= 2 * own.max() * (1 + 2 * EPS)
    assert all(math.isnan(v) for v in paired_ratio_of_medians_ci([1.0, 2.0], [1.0]))  # rounds must pair up
    assert all(math.isnan(v) for v in paired_ratio_of_medians_ci([float("nan")], [1.0]))
    for bad in ({"level": 0.0}, {"resamples": 0}):
        with pytest.raises(ValueError):
            paired_ratio_of_medians_ci(full, agg, **bad)


def test_train_speedup_comes_from_the_calibrations_paired_rounds_when_both_rows_have_them(tmp_path):
    full = _run(tmp_path, "full", "full", [50, 4, 4.2, 3.8, 4.1, 3.9],
                {"forward_nograd": 0, "forward_grad": 40, "backward": 40})
    agg = _run(tmp_path, "agg", "agg", [50, 2, 2.1, 1.9, 2.05, 1.95],
               {"forward_nograd": 40, "forward_grad": 16, "backward": 16})
    other = _run(tmp_path, "other", "fraction", [50, 1, 1, 1, 1, 1], {"forward_nograd": 0, "forward_grad": 8, "backward": 8},
                 label="other")
    units = {"forward_nograd": 0.02, "forward_grad": 0.04, "backward": 0.05, "optimizer_step": 0.1}
    rounds = {"full": [6.0, 6.6, 5.4], "agg": [2.0, 2.2, 1.8]}  # 3x, where the runs say 2x
    cal = tmp_path / "cal.json"
    cal.write_text(json.dumps({"model": "m", "resolution": 64, "device": "cpu", "unit_s_per_sample": {
        k: {"cpu": {"median": v}, "wall": {"median": v}} for k, v in units.items()},
        "methods": {label: {"replay": "as_trained", "cpu_s": t, "wall_s": [10 * x for x in t]}
                    for label, t in rounds.items()}}))
    table = efficiency_table(load_records([full, agg, other]), warmup=1,
                             calibration=load_calibration([CalibrationEntry(cal)])).set_index("method")
    row = table.loc["agg"]
    assert row["train_speedup_basis"] == "paired" and row["train_speedup"] == 6.0 / 2.0
    assert row["train_speedup_lo"] == pytest.approx(3.0, rel=1e-12) == row["train_speedup_hi"]  # rounds in step
    assert row["t_train_paired_s"] == 2.0 and row["run_train_speedup"] == 4.0 / 2.0
    assert row["run_train_speedup_lo"] <= 2.0 <= row["run_train_speedup_hi"]
    # a method the calibration did not time keeps the runs' speedup
    assert table.loc["other", "train_speedup_basis"] == "runs" and table.loc["other", "train_speedup"] == 4.0
    assert math.isnan(table.loc["other", "t_train_paired_s"])


def test_prediction_prices_the_calls_of_the_timed_updates_where_both_rows_have_them(tmp_path):
    full = _run(tmp_path, "full", "full", [50, 4, 4.2, 3.8, 4.1, 3.9], FULL_WORK[0])
    routed = _run(tmp_path, "agg", "agg", [50, 5, 5.2, 4.8, 5.1, 4.9], ROUTED_WORK[0])
    other = _run(tmp_path, "other", "fraction", [50, 1, 1, 1, 1, 1],
                 {"forward_nograd": 0, "forward_grad": 8, "backward": 8}, label="other")
    rounds = {"full": [FULL_S, 1.1 * FULL_S, 0.9 * FULL_S], "agg": [ROUTED_S, 0.9 * ROUTED_S, 1.1 * ROUTED_S]}
    sizes = {"forward_nograd": [40, 1], "forward_grad": [4, 1], "backward": [4, 1]}
    calibration = {"model": "m", "resolution": 64, "device": "cpu",
                   "unit_s_per_sample": {k: {"cpu": {"median": v}, "wall": {"median": v}}
                                         for k, v in PER_SAMPLE.items()},
                   "methods": {label: {"replay": "as_trained", "cpu_s": t, "wall_s": t, "passes": work[0],
                                       "calls": work[1], "optimizer_steps": 1}
                               for (label, t), work in zip(rounds.items(), (FULL_WORK, ROUTED_WORK))}}
    cal = tmp_path / "cal.json"
    cal.write_text(json.dumps({**calibration, "unit_s_per_call": {
        k: {"latents": sizes[k], **{basis: {"call": PER_CALL[k], "latent": PER_LATENT[k]} for basis in ("cpu", "wall")}}
        for k in PER_CALL}}))
    table = efficiency_table(load_records([full, routed, other]), warmup=1,
                             calibration=load_calibration([CalibrationEntry(cal)])).set_index("method")
    row = table.loc["agg"]
    assert row["predicted_t_train_s"] == pytest.approx(ROUTED_S, rel=4 * EPS)
    assert table.loc["full", "predicted_t_train_s"] == pytest.approx(FULL_S, rel=4 * EPS)
    assert row["predicted_train_speedup"] == pytest.approx(FULL_S / ROUTED_S, rel=8 * EPS)
    assert row["train_speedup"] == pytest.approx(FULL_S / ROUTED_S, rel=4 * EPS) and row["prediction_check"] == "agrees"
    # a method the calibration did not time: its runs' passes, per sample, against full's
    assert table.loc["other", "predicted_train_speedup"] == pytest.approx(
        FULL_S / predicted_seconds({**{f: 8 for f in ("forward_grad", "backward")}, "forward_nograd": 0,
                                    "optimizer_step": 1}, PER_SAMPLE), rel=8 * EPS)
    # a calibration without per-call costs prices every row per sample: the routed update looks faster than it is
    cal.write_text(json.dumps(calibration))
    table = efficiency_table(load_records([full, routed, other]), warmup=1,
                             calibration=load_calibration([CalibrationEntry(cal)])).set_index("method")
    assert table.loc["agg", "predicted_train_speedup"] == pytest.approx(1.249, abs=1e-3)
    assert table.loc["agg", "prediction_check"] == "slower than predicted"


def test_rollout_prediction_prices_the_calls_of_the_timed_rollouts(tmp_path):
    """A tree's rollout (branch: 4 leaves from 1 root, splitting at steps 0 and 3 of 10) makes as many calls
    as full's but on fewer latents at first: 1 call of 1, 3 of 2, 6 of 4. Per forward it looks 40 / 31 =
    1.29x faster; a call of 1 or 2 latents costs nearly what one of 4 does, and per call it is 1.04x."""
    train = {"forward_nograd": 0, "forward_grad": 40, "backward": 40}
    full = _run(tmp_path, "full", "full", [50, 4, 4.2, 3.8, 4.1, 3.9], train)
    tree = _run(tmp_path, "branch", "branch", [50, 4, 4.2, 3.8, 4.1, 3.9], train)
    rollouts = {"full": ({"forward_nograd": 40, "forward_grad": 0, "backward": 0}, 10, 10.0),
                "branch": ({"forward_nograd": 31, "forward_grad": 0, "backward": 0}, 10, 31 / 4)}
    full_s, tree_s = 10 * 2.0 + 40 * 0.1, 10 * 2.0 + 31 * 0.1
    cal = tmp_path / "cal.json"
    cal.write_text(json.dumps({
        "model": "m", "resolution": 64, "device": "cpu",
        "unit_s_per_sample": {k: {"cpu": {"median": v}, "wall": {"median": v}} for k, v in PER_SAMPLE.items()},
        "unit_s_per_call": {k: {"latents": [4, 1], **{basis: {"call": PER_CALL[k], "latent": PER_LATENT[k]}
                                                      for basis in ("cpu", "wall")}} for k in PER_CALL},
        "methods": {label: {"replay": "as_trained", "cpu_s": [1.0] * 3, "wall_s": [1.0] * 3, "rollout_passes": passes,
                            "rollout_calls": {"forward_nograd": calls, "forward_grad": 0, "backward": 0},
                            "rollout_forwards": forwards, "rollout_cpu_s": [seconds, 1.1 * seconds, 0.9 * seconds],
                            "rollout_wall_s": [seconds] * 3}
                    for (label, (passes, calls, forwards)), seconds in zip(rollouts.items(), (full_s, tree_s))}}))
    table = efficiency_table(load_records([full, tree]), warmup=1,
                             calibration=load_calibration([CalibrationEntry(cal)])).set_index("method")
    row = table.loc["branch"]
    assert row["rollout_forwards"] == 31 / 4 and row["predicted_rollout_speedup"] == pytest.approx(full_s / tree_s)
    assert row["rollout_speedup"] == pytest.approx(full_s / tree_s) and row["rollout_prediction_check"] == "agrees"


def paired_bootstrap_reference(numerator, denominator, resamples=2000, seed=0):
    """The paired percentile-bootstrap 95 % interval of median(numerator) / median(denominator), written out:
    each resample draws round indices (numpy's generator, as the report), the same for both sides."""
    n = len(numerator)
    draws = np.random.default_rng(seed).integers(0, n, size=(resamples, n)).tolist()
    ratios = [statistics.median(numerator[i] for i in rounds) / statistics.median(denominator[i] for i in rounds)
              for rounds in draws]
    return percentile_reference(ratios, 0.025), percentile_reference(ratios, 0.975)


def test_rollout_speedup_comes_from_the_calibrations_paired_rollout_rounds_and_its_prediction_from_forwards(tmp_path):
    train = {"forward_nograd": 0, "forward_grad": 40, "backward": 40}
    full = _run(tmp_path, "full", "full", [50, 4, 4.2, 3.8, 4.1, 3.9], train)
    # the guessing method's records say how many forwards its rollout ran: 8 images (8/9 per s over 9 s),
    # 16 rollout forwards besides the train phase's 40
    guess = _run(tmp_path, "guess", "guess", [50, 4, 4.2, 3.8, 4.1, 3.9], {**train, "forward_nograd": 40},
                 forward_nograd=56, images_per_s=8 / 9)
    other = _run(tmp_path, "other", "fraction", [50, 1, 1, 1, 1, 1], train, label="other")
    # every round's full rollout is above twice the guessing one's: so is every resampled ratio of medians
    rollouts = {"full": [3.0, 3.3, 2.7, 3.6, 2.4], "guess": [1.2, 1.3, 1.1, 1.5, 1.0]}
    units = {"forward_nograd": 0.02, "forward_grad": 0.04, "backward": 0.05, "optimizer_step": 0.1}
    cal = tmp_path / "cal.json"
    cal.write_text(json.dumps({"model": "m", "resolution": 64, "device": "cpu", "unit_s_per_sample": {
        k: {"cpu": {"median": v}, "wall": {"median": v}} for k, v in units.items()},
        "methods": {label: {"replay": "as_trained", "cpu_s": [1.0] * 5, "wall_s": [1.0] * 5, "rollout_cpu_s": t,
                            "rollout_wall_s": [x + 1 for x in t], "rollout_forwards": {"full": 4, "guess": 3}[label]}
                    for label, t in rollouts.items()}}))
    calibration = load_calibration([CalibrationEntry(cal)])
    table = efficiency_table(load_records([full, guess, other]), warmup=1, calibration=calibration).set_index("method")
    row = table.loc["guess"]
    assert row["rollout_speedup"] == 3.0 / 1.2  # the medians of the rounds
    lo, hi = paired_bootstrap_reference(rollouts["full"], rollouts["guess"])
    assert (row["rollout_speedup_lo"], row["rollout_speedup_hi"]) == pytest.approx((lo, hi), rel=4 * EPS)
    # forwards per sample: full's from the calibration (its records have no images), the guess's from its records
    assert table.loc["full", "rollout_forwards"] == 4 and row["rollout_forwards"] == (56 - 40) / 8
    # predicted from the forwards of the rollouts the rounds timed (the calibration's), not the runs' mean:
    # a rollout that changes over a run (a moving window) was timed on iteration 0's
    assert row["predicted_rollout_speedup"] == 4 / 3
    want = "agrees" if lo <= 4 / 3 <= hi else ("faster than predicted" if 3.0 / 1.2 > 4 / 3 else "slower than predicted")
    assert row["rollout_prediction_check"] == want == "faster than predicted"
    assert table.loc["full", "rollout_speedup"] == 1.0 and table.loc["full", "rollout_prediction_check"] == "agrees"
    # in wall-clock seconds the wall rounds
    wall = efficiency_table(load_records([full, guess, other]), warmup=1, time="wall",
                            calibration=calibration).set_index("method")
    assert wall.loc["guess", "rollout_speedup"] == 4.0 / 2.2
    # a method without rollout rounds or counted rollout forwards: not measured, not 0
    assert all(math.isnan(table.loc["other", key]) for key in
               ("rollout_speedup", "rollout_speedup_lo", "rollout_speedup_hi", "rollout_forwards",
                "predicted_rollout_speedup"))
    assert pd.isna(table.loc["other", "rollout_prediction_check"])
    summary = summary_table(table.reset_index())
    assert summary.set_index("method").loc["guess", "rollout_speedup"] == f"{3.0 / 1.2:.2f}x [{lo:.2f}, {hi:.2f}]"


def test_full_under_another_label_has_no_gradient_comparison():
    """``cps`` runs ``full`` with another sampler; the replay compared ``full`` on the sweep's own sampler,
    so its cosine of 1 belongs to the row labelled ``full`` only."""
    import pandas as pd

    from agg_bench.results.tables import _match_gradcheck

    table = pd.DataFrame([
        {"method": "full", "method_name": "full", "method_options": '{"name": "full"}', "model": "sd3",
         "resolution": 64, "source": "measured"},
        {"method": "cps", "method_name": "full", "method_options": '{"name": "full"}', "model": "sd3",
         "resolution": 64, "source": "measured"},
    ])
    gradcheck = pd.DataFrame([{"method": "full", "model": "sd3", "resolution": 64, "cosine_to_full": 1.0,
                               "relative_error": 0.0}])
    cosines, errors = _match_gradcheck(table, gradcheck)
    assert cosines[0] == 1.0 and errors[0] == 0.0
    assert math.isnan(cosines[1]) and math.isnan(errors[1])
