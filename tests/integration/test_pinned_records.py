"""Behaviour pinned: every method of the embedded default gives the stored records (tests/pinned.py) in every
non-timing field. Integers, text and flags are equal exactly; numbers to a relative 1e-6 or an absolute 1e-8,
AGG's routing scores to an absolute 1e-6. Other kernels move them less: with ATEN_CPU_CAPABILITY=default against
AVX-512 on one Xeon, float64 records differ by at most 4e-9 (the routing scores) and 2e-9 relative in grad_norm.
Another CPU vendor moves them more: on an AMD EPYC the routing scores (cosines of small velocity increments, so
a difference of nearly equal velocities; values about 1e-2) differ from the Xeon's by up to 5e-7, and every
other field by at most 3e-6 relative or 1e-8 absolute. A change of behaviour (another step, sample, weight or
pass) moves rewards and gradient norms at the first digits. The loss (about 1e-11 here: the first update's ratio
is 1 and the advantages sum to 0) and approx_kl (1e-16) are pinned only to that absolute bound. A method that
joins the embedded default joins the pin with its first records (the field's GRPO variants: cps, flow-grpo-fast,
mixgrpo-flash, branch, guess; then the likelihood-free nft, awm, dgpo), and the records pinned before it stay as
they were. A key every record gained after the pin was stored (ADDED_KEYS) is not in the stored file: it is
checked against the pinned fields it is computed from, then left out of the comparison, so the stored records
stay as they were and a key nobody accounted for still shows as "not pinned"."""
from __future__ import annotations

import json
import math

from helpers import methods_checked_here
from pinned import PINNED, compute, pinned_fields

from agg_bench.config import DEFAULTS
from agg_bench.records import passes_cost

ROUTING = {"agg_route_scores", "agg_route_score_mean"}
ROUTING_ABS = 1e-6


def differences(expected, actual, where: str = "") -> list[str]:
    if isinstance(expected, dict) and isinstance(actual, dict):
        out = [f"{where}.{k}: missing" for k in expected if k not in actual]
        out += [f"{where}.{k}: not pinned ({actual[k]!r})" for k in actual if k not in expected]
        for k in expected:
            if k in actual:
                out += differences(expected[k], actual[k], f"{where}.{k}")
        return out
    if isinstance(expected, list) and isinstance(actual, list):
        if len(expected) != len(actual):
            return [f"{where}: {len(actual)} items, pinned {len(expected)}"]
        return [d for i, (e, a) in enumerate(zip(expected, actual)) for d in differences(e, a, f"{where}[{i}]")]
    if isinstance(expected, float) and isinstance(actual, float) and not isinstance(expected, bool):
        abs_tol = ROUTING_ABS if where.rsplit(".", 1)[-1].split("[", 1)[0] in ROUTING else 1e-8
        return [] if math.isclose(expected, actual, rel_tol=1e-6, abs_tol=abs_tol) else \
            [f"{where}: {actual!r}, pinned {expected!r}"]
    return [] if expected == actual and type(expected) is type(actual) else [f"{where}: {actual!r}, pinned {expected!r}"]


def test_the_comparison_sees_a_change():
    pinned = {"run": [{"loss": 0.25, "backward": 8, "status": "ok"}]}
    assert differences(pinned, json.loads(json.dumps(pinned))) == []
    assert differences(pinned, {"run": [{"loss": 0.25 * (1 + 1e-5), "backward": 8, "status": "ok"}]})
    assert not differences(pinned, {"run": [{"loss": 0.25 * (1 + 1e-7), "backward": 8, "status": "ok"}]})
    assert differences(pinned, {"run": [{"loss": 0.25, "backward": 8.0, "status": "ok"}]})
    assert differences(pinned, {"run": [{"loss": 0.25, "backward": 8, "status": "ok", "new": 1}]})
    route = {"run": [{"agg_route_scores": [0.0125, -0.0024]}]}
    assert not differences(route, {"run": [{"agg_route_scores": [0.0125 + 5e-7, -0.0024]}]})
    assert differences(route, {"run": [{"agg_route_scores": [0.0125 + 5e-6, -0.0024]}]})
    assert differences(route, {"run": [{"agg_route_scores": [0.0125, -0.0024, 0.1]}]})
    assert pinned_fields({"t_iter_s": 1.0, "rss_peak_bytes": 5, "loss": 1.0}) == {"loss": 1.0}


def checked_cost(records: list[dict]) -> list[dict]:
    """``records`` without ``cost``, after checking that each one's is the running sum of its pass counts at
    the default ``train.pass_costs`` (exactly: the same float operations as the run)."""
    prices, cost, out = DEFAULTS["train"]["pass_costs"], 0.0, []
    for record in records:
        cost += passes_cost(record, prices)
        assert record["cost"] == cost, (record["iteration"], record["cost"], cost)
        out.append({k: v for k, v in record.items() if k != "cost"})
    return out


# keys added to every record after the pin was stored -> the check of each against the pinned fields
ADDED_KEYS = {"cost": checked_cost}


def test_every_method_gives_the_pinned_records(monkeypatch):
    expected = json.loads(PINNED.read_text())
    methods_checked_here(monkeypatch)  # the sweep's methods check: the same answer without a child process's imports
    actual = json.loads(json.dumps(compute()))  # as stored: NaN and tuples as JSON has them
    assert sorted(actual) == sorted(expected)
    assert not {key for records in expected.values() for r in records for key in r} & set(ADDED_KEYS)
    for check in ADDED_KEYS.values():
        actual = {run_id: check(records) for run_id, records in actual.items()}
    problems = differences(expected, actual)
    assert not problems, problems[:20]
