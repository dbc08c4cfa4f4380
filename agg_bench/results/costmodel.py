"""The cost model: what counted work costs at the unit costs that ``agg-bench calibrate`` measures.

A transformer call of ``n`` latents of one kind (no-grad forward, forward with grad, backward) costs
``call + latent * n`` seconds, and an optimizer step a fixed cost. Both parts matter: at the tiny models'
sizes a call of 1 latent costs nearly what one of 4 costs, so work counted in latents alone (the records'
per-sample passes) prices a method that splits the batch into small calls, such as AGG's routing, far
below what it does (docs/timing.md, "Calls and latents"). The policy's counter counts calls beside
latents (:class:`agg_bench.engine.counters.PassCounter`), and the calibration records both for every
update and rollout it times.

The tables price a row (:mod:`agg_bench.results.tables`) from its calibration, matched on model,
resolution and device: the update and the rollout the calibration timed side by side, from their counted
calls and latents (:func:`counted_seconds`), or, where those are missing, the runs' mean passes at the
per-sample unit costs (:func:`per_sample_seconds`), which take every call for one of the size the costs
were measured at.
"""
from __future__ import annotations

from typing import Mapping, Sequence

import pandas as pd

from ..records import PASS_KEYS
from .stats import predicted_seconds


def fit_call_cost(latents: Sequence[int], seconds: Sequence[float]) -> tuple[float, float]:
    """(per call, per latent) seconds of a call of ``n`` latents that costs ``per_call + per_latent * n``,
    from the seconds of calls of one or two sizes (``latents[i]`` latents took ``seconds[i]``).

    The line through the two points, its slope clipped to [0, seconds / latents of the larger call]: it
    passes through the larger call's point (whose seconds per latent are the per-sample unit cost there),
    and neither part is negative (noise can make a 1-latent call look dearer than a 4-latent one). With
    one size nothing tells the two parts apart: all of it is per latent."""
    pairs = sorted(zip(latents, map(float, seconds)))
    (n_small, s_small), (n_big, s_big) = pairs[0], pairs[-1]
    if n_big == n_small:
        return 0.0, s_big / n_big
    slope = min(max((s_big - s_small) / (n_big - n_small), 0.0), s_big / n_big)
    return s_big - slope * n_big, slope


def priced_calls(passes: Mapping[str, float], calls: Mapping[str, float], optimizer_steps: float | None,
                 per_call: Mapping[str, float | None], per_latent: Mapping[str, float | None],
                 per_step: float | None) -> float:
    """Seconds that counted work costs when a call of ``n`` latents of a kind costs ``per_call[kind] +
    per_latent[kind] * n`` (:func:`fit_call_cost`): over the kinds, ``calls[kind]`` x its per-call cost plus
    ``passes[kind]`` (latents) x its per-latent cost, and ``optimizer_steps`` x ``per_step``. NaN when a
    count or a cost of a kind is missing or not finite (:func:`agg_bench.results.stats.predicted_seconds`)."""
    counts: dict[str, float | None] = {"optimizer_step": optimizer_steps}
    units: dict[str, float | None] = {"optimizer_step": per_step}
    for kind in dict.fromkeys([*passes, *calls]):
        counts[f"{kind}/calls"], units[f"{kind}/calls"] = calls.get(kind), per_call.get(kind)
        counts[f"{kind}/latents"], units[f"{kind}/latents"] = passes.get(kind), per_latent.get(kind)
    return predicted_seconds(counts, units)


def calibration_of(calibration: pd.DataFrame | None, model, resolution, device, method=None,
                   source="measured") -> pd.Series | None:
    """The calibration of a cell (same model, resolution, device and source), a row of
    :func:`agg_bench.results.loading.load_calibration`: the last one given that timed ``method`` side by
    side, else the last one given; None when there is none. A cell may have several: a campaign that
    fills a cell over several sessions times each session's methods beside ``full`` in a calibration of
    their own."""
    if calibration is None or calibration.empty:
        return None
    sources = calibration["source"] if "source" in calibration else pd.Series("measured", index=calibration.index)
    match = calibration[(calibration["model"].astype(str) == str(model))
                        & (pd.to_numeric(calibration["resolution"], errors="coerce") == resolution)
                        & (calibration["device"].astype(str) == str(device))
                        & (sources.fillna("measured").astype(str) == str(source))]
    if match.empty:
        return None
    timing = match[match["methods"].map(lambda m: isinstance(m, dict) and str(method) in m)]
    return (timing if len(timing) else match).iloc[-1]


def counted_seconds(timed: Mapping, units: pd.Series | None, basis: str, rollout: bool = False) -> float:
    """Seconds of the work that the calibration counted for one method (``timed``, its ``methods`` entry):
    its timed update (``passes``, ``calls``, ``optimizer_steps``) or, with ``rollout``, its timed rollout
    (``rollout_passes``, ``rollout_calls``), each call priced per call and per latent in ``basis`` seconds
    ("cpu" or "wall"); NaN when the calibration has no per-call costs or did not count that work."""
    prefix = "rollout_" if rollout else ""
    passes, calls = timed.get(f"{prefix}passes"), timed.get(f"{prefix}calls")
    if units is None or not isinstance(passes, dict) or not isinstance(calls, dict):
        return float("nan")
    return priced_calls(passes, calls, 0 if rollout else timed.get("optimizer_steps"),
                        {kind: units.get(f"call_{basis}_{kind}") for kind in PASS_KEYS},
                        {kind: units.get(f"latent_{basis}_{kind}") for kind in PASS_KEYS},
                        units.get(f"unit_{basis}_optimizer_step"))


def per_sample_seconds(passes: Mapping[str, float], optimizer_steps: float, units: pd.Series | None,
                       basis: str) -> float:
    """Seconds that ``passes`` (latents of each kind, e.g. a run's mean counted train passes) and
    ``optimizer_steps`` cost at the calibration's per-sample unit costs in ``basis`` seconds (NaN without a
    calibration). Latents without their calls: every call is priced as one of the size the unit costs were
    measured at."""
    if units is None:
        return float("nan")
    kinds = (*PASS_KEYS, "optimizer_step")
    counts = {**{kind: passes.get(kind) for kind in PASS_KEYS}, "optimizer_step": optimizer_steps}
    return predicted_seconds(counts, {kind: units.get(f"unit_{basis}_{kind}", float("nan")) for kind in kinds})
