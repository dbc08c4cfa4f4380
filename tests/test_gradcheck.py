"""`agg-bench gradcheck`: every estimator replayed on one snapshot against `full`, one CSV row each."""
import csv

import pytest

from agg_bench.cli import main
from agg_bench.errors import ConfigError
from agg_bench.gradcheck import COLUMNS, ReplayJob, parse_method_specs, parse_values
from agg_bench.snapshot import load_snapshot, method_from, replay_gradient
from helpers import TINY

SET = [arg for item in [*TINY, "grpo.prompts_per_iteration=1", "model.dtype=float64", "train.plan=groups",
                         "train.plan_window=3"]
       for arg in ("--set", item)]


def read_rows(path):
    with open(path, newline="") as fh:
        return list(csv.DictReader(fh))


def test_gradcheck_table_against_full(tmp_path):
    out = tmp_path / "gc" / "table.csv"
    assert main(["gradcheck", *SET, "--windows", "2,3", "--alphas", "sigma", "--route-fracs", "1",
                 "--reuse", "false,true", "--methods", "full", "--out", str(out)]) == 0
    rows = read_rows(out)
    assert list(rows[0]) == list(COLUMNS)
    assert [r["method"] for r in rows] == ["full"] + ["agg"] * 4 + ["full"]
    assert [(r["window"], r["reuse_rollout_velocity"]) for r in rows[1:-1]] == [
        ("2", "False"), ("2", "True"), ("3", "False"), ("3", "True")]
    assert sorted(p.name for p in out.parent.iterdir()) == ["table.csv"]  # no snapshot or temp file left
    ref = rows[0]
    assert ref["is_reference"] == "True" and float(ref["relative_error"]) == 0.0
    assert float(ref["cosine_to_full"]) == pytest.approx(1.0, abs=1e-12)
    b, n = int(ref["batch_size"]), int(ref["steps_per_sample"])
    assert (int(ref["forward_grad"]), int(ref["backward"])) == (b * n, b * n)
    # a second replay of `full` is the same computation: exactly no error
    assert float(rows[-1]["relative_error"]) == 0.0 and rows[-1]["window"] == ""
    for row in rows[1:-1]:
        window, frac, reuse = int(row["window"]), float(row["route_frac"]), row["reuse_rollout_velocity"] == "True"
        assert row["alpha"] == "sigma" and float(row["seconds"]) > 0
        counts = tuple(int(row[k]) for k in ("forward_nograd", "forward_grad", "backward"))
        if window <= 2 or frac == 0:
            assert float(row["relative_error"]) <= 1e-10
            assert counts == (0, b * n, b * n)
        else:
            groups = b * n // window
            assert counts == (0 if reuse else b * n, 2 * groups, 2 * groups)
            assert int(row["groups_routed"]) == groups
            assert 0 < float(row["relative_error"]) and float(row["cosine_to_full"]) < 1


def test_gradcheck_on_an_existing_snapshot_matches_replay(tmp_path):
    snap = tmp_path / "snap"
    assert main(["snapshot", *SET, "--out", str(snap)]) == 0
    out = tmp_path / "table.csv"
    assert main(["gradcheck", "--snapshot", str(snap), "--windows", "3", "--alphas", "index",
                 "--route-fracs", "1", "--out", str(out)]) == 0
    row = read_rows(out)[1]
    snapshot = load_snapshot(snap)
    grads, counts, stats = replay_gradient(snapshot, method_from(snapshot, "agg", ["method.window=3"]))
    assert {k: int(row[k]) for k in counts} == counts
    assert float(row["route_score_mean"]) == pytest.approx(stats["agg_route_score_mean"], rel=1e-9)
    assert row["cache"] == row["cache_hit_rate"] == ""  # AGG has neither

    # a cached method in the training forwards: its options and hit rate get their columns
    assert main(["gradcheck", "--snapshot", str(snap), "--windows", "3", "--alphas", "index", "--route-fracs", "1",
                 "--methods", "cached:cache=fora,cache_in=train", "--out", str(out)]) == 0
    row = read_rows(out)[-1]
    cached = method_from(snapshot, "cached", ["method.cache=fora", "method.cache_in=train"])
    grads, counts, stats = replay_gradient(snapshot, cached)
    assert (row["method"], row["cache"], row["cache_in"]) == ("cached", "fora", "train")
    assert 0 < stats["cache_hit_rate"] < 1
    assert float(row["cache_hit_rate"]) == pytest.approx(stats["cache_hit_rate"], rel=1e-12)
    assert {k: int(row[k]) for k in counts} == counts
    # a config for an existing snapshot would be silently ignored: refuse it
    assert main(["gradcheck", "--snapshot", str(snap), *SET, "--out", str(out)]) == 2


def test_parse_method_specs():
    assert parse_method_specs(["full,fraction", "cached:cache=fora,interval=2", "agg:window=4"]) == [
        ReplayJob("full"), ReplayJob("fraction"), ReplayJob("cached", (("cache", "fora"), ("interval", "2"))),
        ReplayJob("agg", (("window", "4"),))]
    assert ReplayJob("cached", (("cache", "fora"),)).overrides == ["method.cache=fora"]
    for bad in ("interval=2", ":x=1", "cached:fora"):
        with pytest.raises(ConfigError):
            parse_method_specs([bad])


def test_parse_values():
    assert parse_values("2, 3,5", "--windows", int) == [2, 3, 5]
    assert parse_values("0,0.5,1", "--route-fracs", float) == [0.0, 0.5, 1.0]
    assert parse_values("false,true", "--reuse", bool) == [False, True]
    for text, kind in (("2,x", int), ("2,,3", int), ("true", int), ("0,high", float), ("maybe", bool)):
        with pytest.raises(ConfigError):
            parse_values(text, "--flag", kind)


@pytest.mark.parametrize("args, key", [
    (["--windows", "2,x"], "--windows"),
    (["--windows", "0"], "method.window"),
    (["--route-fracs", "2"], "method.route_frac"),
    (["--methods", "agg:nope=1"], "method.nope"),
    (["--methods", "sgd"], "method.name"),
])
def test_bad_arguments_are_one_line_and_leave_nothing_behind(tmp_path, capsys, args, key):
    out = tmp_path / "o" / "t.csv"
    assert main(["gradcheck", *SET, *args, "--out", str(out)]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and key in lines[0], lines
    assert not out.parent.exists() or not any(out.parent.iterdir())  # refused before the rollout
