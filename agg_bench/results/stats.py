"""Statistics of repeated timings: quartiles, bootstrap intervals for a ratio of medians (independent
or paired samples), for a mean and a ratio of means (one value per seed: the learning report's cost to a
target), a paired speedup, and the time a run's counted passes predict from unit costs.

Timings of one configuration repeat over iterations (and seeds); a table shows their median with the
interquartile range, and a speedup (a ratio of two medians) with a percentile bootstrap interval that
resamples each side's iterations independently. The bootstrap is seeded, so the same timings always
give the same interval. Only numpy is used: the report reads these without the engine.
"""
from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np

# iterations of the bootstrap; 2000 keeps the 2.5 / 97.5 percentiles stable to a few permille
BOOTSTRAP_RESAMPLES = 2000
BOOTSTRAP_SEED = 0


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


def _percentile_interval(ratios: np.ndarray, level: float) -> tuple[float, float]:
    """The ``(1 - level) / 2`` and ``(1 + level) / 2`` percentiles of the resampled ``ratios``."""
    tail = (1 - level) / 2
    lo, hi = np.percentile(ratios, [100 * tail, 100 * (1 - tail)])
    return float(lo), float(hi)


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
    _check_bootstrap(level, resamples)
    num, den = _finite(numerator), _finite(denominator)
    if num.size == 0 or den.size == 0:
        return float("nan"), float("nan")
    rng = np.random.default_rng(seed)
    num_idx = rng.integers(0, num.size, size=(resamples, num.size))
    den_idx = rng.integers(0, den.size, size=(resamples, den.size))
    return _percentile_interval(np.median(num[num_idx], axis=1) / np.median(den[den_idx], axis=1), level)


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
    idx = np.random.default_rng(seed).integers(0, num.size, size=(resamples, num.size))
    return _percentile_interval(np.median(num[idx], axis=1) / np.median(den[idx], axis=1), level)


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
