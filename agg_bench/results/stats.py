"""Statistics of repeated timings: quartiles, bootstrap intervals for a ratio of medians (independent
or paired samples), for a mean and a ratio of means (one value per seed: the learning report's cost to a
target), a paired speedup, and the time a run's counted passes predict from unit costs.

Timings of one configuration repeat over iterations (and seeds); a table shows their median with the
interquartile range, and a speedup (a ratio of two medians) with a percentile bootstrap interval that
resamples each side's iterations independently. The bootstrap is seeded, so the same timings always
give the same interval. Only numpy is used: the report reads these without the engine.
"""
from __future__ import annotations

import math
from typing import Mapping, Sequence

import numpy as np

# iterations of the bootstrap; 2000 keeps the 2.5 / 97.5 percentiles stable to a few permille
BOOTSTRAP_RESAMPLES = 2000
BOOTSTRAP_SEED = 0
# drawn indices a bootstrap holds at once (a block of resamples, 4 MiB as int32): a run of 100,000 iterations
# resampled 2000 times drew one (2000, 100000) array of indices and gathered one of values, 3.2 GB, where the
# same draws in blocks stay in the cache
BOOTSTRAP_BLOCK = 2**20


def _finite(values: Sequence[float] | np.ndarray) -> np.ndarray:
    array = np.asarray(values, dtype=np.float64).ravel()
    return array[np.isfinite(array)]


def quartiles(values: Sequence[float] | np.ndarray) -> tuple[float, float, float]:
    """(p25, median, p75) of the finite ``values`` (linear interpolation between order statistics,
    numpy's default); NaNs when there is none."""
    array = _finite(values)
    if array.size == 0:
        return (float("nan"),) * 3
    p25, p50, p75 = np.percentile(array, [25, 50, 75])
    return float(p25), float(p50), float(p75)


def _check_bootstrap(level: float, resamples: int) -> None:
    if not 0 < level < 1:
        raise ValueError(f"level = {level!r}: expected a number between 0 and 1")
    if resamples < 1:
        raise ValueError(f"resamples = {resamples!r}: expected at least 1")


def _percentile_interval(numerators: np.ndarray, denominators: np.ndarray, level: float) -> tuple[float, float]:
    """The ``(1 - level) / 2`` and ``(1 + level) / 2`` percentiles of the resampled ratios ``numerators /
    denominators``. A median of 0 s (a record may hold it) gives infinite or undefined ratios, which the tables
    show as empty cells: numpy's warnings about them are not the user's to read."""
    tail = (1 - level) / 2
    with np.errstate(divide="ignore", invalid="ignore"):
        lo, hi = np.percentile(numerators / denominators, [100 * tail, 100 * (1 - tail)])
    return float(lo), float(hi)


def _resampled_medians(columns: Sequence[np.ndarray], rng: np.random.Generator,
                       resamples: int) -> list[np.ndarray]:
    """The median of each of ``resamples`` bootstrap resamples of each of ``columns`` (finite values, all of one
    length n), every column resampled with the same draws: ``rng.integers(0, n, size=(resamples, n))``, the draws
    of that one call (drawn here in blocks of rows, in the same order: a bounded draw below 2**32 takes the
    generator's 32-bit values one at a time, whatever the block or the integer type), and each median what
    ``np.median(column[draws], axis=1)`` gives (the mean of the two middle values of an even count).

    A resample's median is a middle order statistic, so it is read from the ranks drawn: the values sorted once,
    each drawn index replaced by its value's rank, and each row's middle ranks selected among the draws within a
    window of ranks around the middle (all but a vanishing share of rows have them there; a row that has not is
    partitioned whole), instead of gathering and partitioning n floats per resample."""
    n = columns[0].size
    dtype = np.int32 if n <= 2**31 else np.int64
    lo_k, hi_k = (n - 1) // 2, n // 2  # the order statistics the median averages (one when n is odd)
    # a drawn rank is below n / 2 with probability 1/2 each, so the middle order statistics' ranks spread by
    # about sqrt(n) / 2 around n / 2: 16 of those either side
    half = 8 * math.isqrt(n) + 16
    window = (max(0, n // 2 - half), min(n, n // 2 + half + 1))
    sorted_columns = []
    for values in columns:
        order = np.argsort(values, kind="stable")
        ranks = np.empty(n, dtype=dtype)
        ranks[order] = np.arange(n, dtype=dtype)
        sorted_columns.append((ranks, values[order]))
    medians = [np.empty(resamples) for _ in columns]
    rows = max(1, BOOTSTRAP_BLOCK // n)
    for start in range(0, resamples, rows):
        stop = min(resamples, start + rows)
        draws = rng.integers(0, n, size=(stop - start, n), dtype=dtype)
        for (ranks, ordered), out in zip(sorted_columns, medians):
            lo_rank, hi_rank = _middle_ranks(ranks[draws], (lo_k, hi_k), window)
            out[start:stop] = ordered[lo_rank] if lo_k == hi_k else (ordered[lo_rank] + ordered[hi_rank]) / 2
    return medians


def _middle_ranks(drawn: np.ndarray, middle: tuple[int, int], window: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
    """Each row's ``middle[0]``-th and ``middle[1]``-th smallest of ``drawn`` (ranks from 0 to n - 1, one row per
    resample), 0-based: sorted among the row's ranks within ``window`` (from, to), after those below it."""
    count, n = drawn.shape
    low, high = window
    below = np.count_nonzero(drawn < low, axis=1)
    inside = (drawn >= low) & (drawn < high)
    within = np.count_nonzero(inside, axis=1)
    # the draws within the window, sorted by row and then by rank: row r's from starts[r]
    keyed = np.sort(np.repeat(np.arange(count, dtype=np.int64) * n, within) + drawn[inside])
    starts = np.cumsum(within) - within
    found = (below <= middle[0]) & (below + within > middle[1])
    picked = []
    for k in middle:
        ranks = np.empty(count, dtype=np.int64)
        rows = np.flatnonzero(found)
        ranks[rows] = keyed[starts[rows] + k - below[rows]] - rows * n
        picked.append(ranks)
    for row in np.flatnonzero(~found):  # a middle outside the window: the whole row
        part = np.partition(drawn[row], middle)
        picked[0][row], picked[1][row] = part[middle[0]], part[middle[1]]
    return picked[0], picked[1]


def ratio_of_medians_ci(numerator: Sequence[float], denominator: Sequence[float], level: float = 0.95,
                        resamples: int = BOOTSTRAP_RESAMPLES, seed: int = BOOTSTRAP_SEED) -> tuple[float, float]:
    """Percentile bootstrap interval of median(numerator) / median(denominator).

    Each resample draws ``len(numerator)`` values from ``numerator`` and ``len(denominator)`` from
    ``denominator`` with replacement (the two independently: they are different runs), and takes the
    ratio of their medians; the interval is the ``(1 - level) / 2`` and ``(1 + level) / 2`` percentiles
    of the ``resamples`` ratios. The draws come from ``numpy.random.default_rng(seed)``: first every
    numerator index, as a (resamples, n) array, then every denominator index. NaNs when either side has
    no finite value.
    """
    return ratios_of_medians_ci([(numerator, denominator)], level, resamples, seed)[0]


def ratios_of_medians_ci(pairs: Sequence[tuple[Sequence[float], Sequence[float]]], level: float = 0.95,
                         resamples: int = BOOTSTRAP_RESAMPLES,
                         seed: int = BOOTSTRAP_SEED) -> list[tuple[float, float]]:
    """:func:`ratio_of_medians_ci` of each (numerator, denominator) of ``pairs``, the same intervals; pairs with
    as many finite values on each side as one another take the same draws (the same seed), so they are drawn
    once for all of them (a table row's iteration and train-phase speedups)."""
    _check_bootstrap(level, resamples)
    finite = [(_finite(num), _finite(den)) for num, den in pairs]
    intervals: list[tuple[float, float]] = [(float("nan"), float("nan"))] * len(finite)
    sizes: dict[tuple[int, int], list[int]] = {}
    for i, (num, den) in enumerate(finite):
        if num.size and den.size:
            sizes.setdefault((num.size, den.size), []).append(i)
    for members in sizes.values():
        rng = np.random.default_rng(seed)
        nums = _resampled_medians([finite[i][0] for i in members], rng, resamples)
        dens = _resampled_medians([finite[i][1] for i in members], rng, resamples)
        for i, num, den in zip(members, nums, dens):
            intervals[i] = _percentile_interval(num, den, level)
    return intervals


def paired_ratio_of_medians_ci(numerator: Sequence[float] | np.ndarray, denominator: Sequence[float] | np.ndarray,
                               level: float = 0.95,
                               resamples: int = BOOTSTRAP_RESAMPLES,
                               seed: int = BOOTSTRAP_SEED) -> tuple[float, float]:
    """Percentile bootstrap interval of median(numerator) / median(denominator) for paired samples:
    ``numerator[i]`` and ``denominator[i]`` were measured in the same round (``agg-bench calibrate``'s
    interleaved method timings), so a resample draws round indices, the same ones for both sides. Rounds
    where either side is not finite are left out; NaNs when none is left or the lengths differ."""
    _check_bootstrap(level, resamples)
    num, den = np.asarray(numerator, dtype=np.float64).ravel(), np.asarray(denominator, dtype=np.float64).ravel()
    if num.size != den.size:
        return float("nan"), float("nan")
    both = np.isfinite(num) & np.isfinite(den)
    num, den = num[both], den[both]
    if num.size == 0:
        return float("nan"), float("nan")
    num_medians, den_medians = _resampled_medians([num, den], np.random.default_rng(seed), resamples)
    return _percentile_interval(num_medians, den_medians, level)


def paired_speedup(reference: Sequence[float], own: Sequence[float]) -> tuple[float, float, float]:
    """(median(reference) / median(own), and its :func:`paired_ratio_of_medians_ci` interval) of two methods'
    seconds in the same rounds; NaNs unless both have the same, non-zero number of rounds."""
    ref, mine = np.asarray(reference, dtype=np.float64).ravel(), np.asarray(own, dtype=np.float64).ravel()
    if not 0 < ref.size == mine.size:
        return (float("nan"),) * 3
    return (float(np.median(ref) / np.median(mine)), *paired_ratio_of_medians_ci(ref, mine))


def predicted_seconds(counts: Mapping[str, float | None], unit_seconds: Mapping[str, float | None]) -> float:
    """Seconds that ``counts`` (passes per sample, optimizer steps, ...) cost at ``unit_seconds`` each:
    the sum of count x unit cost over the keys of ``counts``. NaN when a count or its unit cost is
    missing or not finite (a prediction from part of the work would look too fast)."""
    total = 0.0
    for key, count in counts.items():
        unit = unit_seconds.get(key)
        if count is None or unit is None or not np.isfinite(count) or not np.isfinite(unit):
            return float("nan")
        total += float(count) * float(unit)
    return total
