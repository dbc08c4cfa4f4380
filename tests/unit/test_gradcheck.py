"""`agg-bench gradcheck`: every estimator replayed on one snapshot against `full`, one CSV row each."""
import csv

import pytest

from agg_bench.cli import main
from agg_bench.errors import ConfigError
from agg_bench.tools.gradcheck import COLUMNS
from agg_bench.tools.replays import parse_values
from agg_bench.tools.replays import ReplayJob, build_estimators, parse_method_specs
from agg_bench.tools.snapshot import load_snapshot, method_from, replay_gradient
from helpers import TINY, seeded

SET = [arg for item in [*TINY, "grpo.prompts_per_iteration=1", "model.dtype=float64", "train.plan=groups",
                         "train.plan_window=3"]
       for arg in ("--set", item)]


def read_rows(path):
    with open(path, newline="") as fh:
        return list(csv.DictReader(fh))


def test_gradcheck_table_against_full(tmp_path):
    out = tmp_path / "gc" / "table.csv"
    assert main(["gradcheck", *SET, "--windows", "2,3", "--alphas", "sigma", "--route-fracs", "1",
                 "--reuse", "false,true", "--methods", "full,full:micro_batch=null", "--out", str(out)]) == 0
    rows = read_rows(out)
    assert list(rows[0]) == list(COLUMNS)
    # `full` in --methods is the reference, replayed and written once (it was replayed again, a second `full`
    # row); `full` with an option is a replay of its own
    assert [r["method"] for r in rows] == ["full"] + ["agg"] * 4 + ["full"]
    assert (rows[0]["options"], rows[-1]["options"]) == ("", "micro_batch=null")
    assert [(r["window"], r["reuse_rollout_velocity"]) for r in rows[1:-1]] == [
        ("2", "False"), ("2", "True"), ("3", "False"), ("3", "True")]
    assert sorted(p.name for p in out.parent.iterdir()) == ["table.csv"]  # no snapshot or temp file left
    ref = rows[0]
    assert ref["is_reference"] == "True" and float(ref["relative_error"]) == 0.0
    assert float(ref["cosine_to_full"]) == pytest.approx(1.0, abs=1e-12)
    b, n = int(ref["batch_size"]), int(ref["steps_per_sample"])
    assert (int(ref["forward_grad"]), int(ref["backward"])) == (b * n, b * n)
    # a second replay of `full` (its default micro_batch) is the same computation: exactly no error
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


def test_endpoint_velocity_reuse_has_its_own_row_the_same_gradient_and_fewer_no_grad_forwards(tmp_path):
    out = tmp_path / "gc.csv"
    assert main(["gradcheck", *SET, "--windows", "3", "--alphas", "sigma", "--route-fracs", "1",
                 "--methods", "agg:window=3,alpha=sigma,endpoint_velocity=reuse", "--out", str(out)]) == 0
    full, recompute, reuse = read_rows(out)
    assert (recompute["endpoint_velocity"], reuse["endpoint_velocity"]) == ("recompute", "reuse")
    b, n = int(full["batch_size"]), int(full["steps_per_sample"])
    groups = b * n // 3
    assert [int(recompute[k]) for k in ("forward_nograd", "forward_grad", "backward")] == [b * n, 2 * groups, 2 * groups]
    # v at both ends of each group comes from its forwards with grad: W - 2 no-grad forwards per group
    assert [int(reuse[k]) for k in ("forward_nograd", "forward_grad", "backward")] == [groups, 2 * groups, 2 * groups]
    # the same gradient up to float64 rounding (tests/unit/test_agg.py bounds it at 1e-12 relative)
    assert abs(float(reuse["relative_error"]) - float(recompute["relative_error"])) <= 1e-10
    assert float(reuse["cosine_to_full"]) == pytest.approx(float(recompute["cosine_to_full"]), abs=1e-10)


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
    # a config other than the existing snapshot's would be silently ignored: refuse it
    assert main(["gradcheck", "--snapshot", str(snap), *SET, "--set", "seed=3", "--out", str(out)]) == 2


def test_a_gradcheck_run_again_uses_the_snapshot_it_kept_and_refuses_another_configs(tmp_path, capsys):
    """The same command again (after one killed once its --snapshot was written) takes that snapshot; --set
    values it was not made with are refused, not ignored."""
    snap, out = tmp_path / "snap", tmp_path / "table.csv"
    argv = ["gradcheck", *SET, "--snapshot", str(snap), "--windows", "3", "--alphas", "index", "--route-fracs", "1"]
    assert main(["snapshot", *SET, "--out", str(snap)]) == 0
    before = (snap / "rollout.safetensors").read_bytes()
    assert main([*argv, "--out", str(out)]) == 0 and len(read_rows(out)) == 2
    assert (snap / "rollout.safetensors").read_bytes() == before
    capsys.readouterr()
    assert main([*argv, "--set", "seed=3", "--out", str(tmp_path / "other.csv")]) == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert "--snapshot" in line and "another run config" in line and not (tmp_path / "other.csv").exists()


def test_parse_method_specs():
    assert parse_method_specs(["full,fraction", "cached:cache=fora,interval=2", "agg:window=4"]) == [
        ReplayJob("full"), ReplayJob("fraction"), ReplayJob("cached", (("cache", "fora"), ("interval", "2"))),
        ReplayJob("agg", (("window", "4"),))]
    assert ReplayJob("cached", (("cache", "fora"),)).overrides == ["method.cache=fora"]
    for bad in ("interval=2", ":x=1", "cached:fora", "agg:"):
        with pytest.raises(ConfigError):
            parse_method_specs([bad])
    # the same replay twice (options in any order) would replay one gradient again and write its row twice
    for twice in (["full,full"], ["agg:window=4", "agg:window=4"],
                  ["cached:cache=fora,interval=2", "cached:interval=2,cache=fora"]):
        with pytest.raises(ConfigError, match="given twice"):
            parse_method_specs(twice)
    assert len(parse_method_specs(["agg:window=4", "agg:window=5"])) == 2


def test_parse_values():
    assert parse_values("2, 3,5", "--windows", int) == [2, 3, 5]
    assert parse_values("0,0.5,1", "--route-fracs", float) == [0.0, 0.5, 1.0]
    assert parse_values("false,true", "--reuse", bool) == [False, True]
    for text, kind in (("2,x", int), ("2,,3", int), ("true", int), ("0,high", float), ("maybe", bool),
                       ("2,2", int), ("0.5,0.50", float), ("1,1.0", float), ("true,true", bool), ("a,a", str),
                       # as every number flag and config key: decimal, an integer no float, a number finite
                       ("2,0x10", int), ("2,017", int), ("2,1e3", int), ("0,.nan", float), ("0,1e400", float)):
        with pytest.raises(ConfigError):
            parse_values(text, "--flag", kind)


@pytest.mark.parametrize("args, key", [
    (["--windows", "2,x"], "--windows"),
    (["--windows", "0"], "method.window"),
    (["--route-fracs", "2"], "method.route_frac"),
    (["--methods", "agg:nope=1"], "method.nope"),
    (["--methods", "sgd"], "method.name"),
    (["--methods", "agg:name=full"], "method.name"),  # full's gradient would be written as agg's row
    # named the option full lacks (method.window) rather than the override that made the method full
    (["--methods", "agg:window=3,name=full"], "method.name = 'full'"),
    # a row of the grid again (route_frac 1 is 1.0, reuse_rollout_velocity its default): its row written twice
    (["--methods", "agg:window=3,alpha=sigma,route_frac=1"], "--methods = 'agg:window=3,alpha=sigma,route_frac=1'"),
    (["--windows", "2,7"], "method.window"),  # longer than the snapshot's 6 trained steps
    (["--methods", "fraction"], "train.plan"),  # the snapshot's groups plan is not DanceGRPO's
    (["--methods", "full:train.plan=steps"], "train.plan"),  # full trains the snapshot's own steps
])
def test_bad_arguments_are_one_line_and_leave_nothing_behind(tmp_path, capsys, args, key):
    out = tmp_path / "o" / "t.csv"
    # --windows 3 unless the case gives its own (a flag is given once): the default grid's W = 8 is itself refused
    # on this 6-step rollout
    windows = [] if "--windows" in args else ["--windows", "3"]
    assert main(["gradcheck", *SET, *windows, *args, "--out", str(out)]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and key in lines[0], lines
    assert not out.parent.exists() or not any(out.parent.iterdir())  # refused before the rollout


# ----- what replay can and cannot measure ----------------------------------------------------------
def _read_json(path):
    import json

    return json.loads(path.read_text())


def test_replay_cases_of_methods_that_train_other_steps_or_differ_in_their_rollout():
    """No model: each method's replay case on given stochastic steps."""
    import torch

    from agg_bench.methods.base import build_method
    from helpers import tiny_config

    cfg = tiny_config("sampling.steps=8", "train.timestep_fraction=0.5", f"seed={seeded(3)}")
    every = torch.ones(8, dtype=torch.bool)
    gen = lambda: torch.Generator().manual_seed(cfg.seed)
    case = build_method("fraction").replay_case(cfg, every, 5, gen())
    assert case.scope == "replanned" and case.train_steps.shape == (5, 4)
    for row in case.train_steps:  # 4 distinct steps per sample, in denoising order
        assert row.tolist() == sorted(set(row.tolist()))
    assert len({tuple(r) for r in case.train_steps.tolist()}) > 1  # drawn per sample
    # the window of iteration 0, on a trajectory stochastic everywhere: its steps, marked partial
    window = build_method("window", {"window_size": 3, "window_mode": "fixed", "window_start": 2})
    case = window.replay_case(tiny_config("sampling.steps=8"), every, 5, gen())
    assert case.scope == "partial" and case.train_steps.tolist() == [[2, 3, 4]] * 5
    # the snapshot is the window's own rollout: as trained, on the snapshot's steps
    own = torch.zeros(8, dtype=torch.bool)
    own[2:5] = True
    case = window.replay_case(tiny_config("sampling.steps=8"), own, 5, gen())
    assert (case.scope, case.train_steps) == ("as_trained", None)
    elsewhere = torch.zeros(8, dtype=torch.bool)
    elsewhere[6:] = True
    with pytest.raises(ConfigError, match="method.window_start"):
        window.replay_case(tiny_config("sampling.steps=8"), elsewhere, 5, gen())
    scopes = {cache_in: build_method("cached", {"cache": "fora", "cache_in": cache_in}).replay_case(
        cfg, every, 5, gen()).scope for cache_in in ("rollout", "train", "both")}
    assert scopes == {"rollout": "not_applicable", "train": "as_trained", "both": "partial"}
    for name in ("full", "agg"):
        assert build_method(name).replay_case(cfg, every, 5, gen()).scope == "as_trained"


@pytest.mark.slow  # one snapshot, four replays and a gradcheck through the CLI: ~30 s on 2 cores
def test_replay_measures_fraction_and_window_on_their_own_steps_and_refuses_what_it_cannot(tmp_path, capsys):
    import torch
    from safetensors.torch import load_file

    from baselines.full import FullEstimator

    snap = tmp_path / "snap"
    steps_set = [arg for item in [*TINY, "grpo.prompts_per_iteration=1", "model.dtype=float64"]
                 for arg in ("--set", item)]
    assert main(["snapshot", *steps_set, "--out", str(snap)]) == 0
    snapshot = load_snapshot(snap)
    b, t = snapshot.batch.batch_size, snapshot.batch.timesteps.numel()
    assert snapshot.batch.steps_per_sample == t  # every step trained: full is the whole trajectory

    full = tmp_path / "full.safetensors"
    assert main(["replay", str(snap), "--method", "full", "--out", str(full)]) == 0
    assert _read_json(full.with_suffix(".json"))["replay"] == "as_trained"

    # fraction draws its own half of the steps: half the passes, a gradient that is not full's
    frac = tmp_path / "fraction.safetensors"
    assert main(["replay", str(snap), "--method", "fraction", "--set", "train.timestep_fraction=0.5",
                 "--out", str(frac)]) == 0
    record = _read_json(frac.with_suffix(".json"))
    assert record["replay"] == "replanned" and record["backward"] == b * (t // 2) < b * t
    from agg_bench.tools.gradcheck import compare
    cosine, rel, _ = compare(load_file(str(frac)), load_file(str(full)))
    assert rel > 1e-3 and cosine < 1 - 1e-6

    # window: only the window's steps (fixed at 1..2), the same numbers as full on exactly those steps
    win = tmp_path / "window.safetensors"
    assert main(["replay", str(snap), "--method", "window", "--set", "method.window_size=2",
                 "--set", "method.window_mode=fixed", "--set", "method.window_start=1", "--out", str(win)]) == 0
    record = _read_json(win.with_suffix(".json"))
    assert record["replay"] == "partial" and record["backward"] == 2 * b
    import dataclasses
    only_window = dataclasses.replace(snapshot.batch, train_steps=torch.tensor([[1, 2]] * b))
    expected = dataclasses.replace(snapshot, batch=only_window)
    from agg_bench.methods.base import ReplayCase
    grads, counts, _ = replay_gradient(expected, FullEstimator(), case=ReplayCase())
    got = load_file(str(win))
    # the same function on the same steps and rows in the same order: bit-identical
    assert all(torch.equal(got[k], grads[k]) for k in grads) and counts["backward"] == 2 * b
    capsys.readouterr()

    # refused, one line each, nothing written: a rollout-only cache, a window longer than N, a key the
    # method's replay cannot honour
    for args, key in ((["--method", "cached", "--set", "method.cache=fora"], "rollout"),
                      (["--method", "agg", "--set", f"method.window={t + 1}"], "method.window"),
                      (["--method", "full", "--set", "train.timestep_fraction=0.5"], "train.timestep_fraction"),
                      (["--method", "agg", "--set", "sampling.eta=0.3"], "sampling.eta")):
        out = tmp_path / "refused" / "g.safetensors"
        assert main(["replay", str(snap), *args, "--out", str(out)]) == 2, args
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and key in lines[0], lines
        assert not out.parent.exists()

    # gradcheck marks each row; the rollout-only cache gets a row without numbers
    table = tmp_path / "table.csv"
    assert main(["gradcheck", "--snapshot", str(snap), "--windows", "3", "--alphas", "index", "--route-fracs", "1",
                 "--methods", "fraction:train.timestep_fraction=0.5,cached:cache=fora",
                 "--methods", "window:window_size=2,window_mode=fixed,window_start=1", "--out", str(table)]) == 0
    rows = {r["method"]: r for r in read_rows(table)}
    assert {m: r["replay"] for m, r in rows.items()} == {
        "full": "as_trained", "agg": "as_trained", "fraction": "replanned", "cached": "not_applicable",
        "window": "partial"}
    assert rows["cached"]["cosine_to_full"] == rows["cached"]["backward"] == "" and rows["cached"]["replay_note"]
    assert int(rows["fraction"]["backward"]) == b * (t // 2) and float(rows["fraction"]["cosine_to_full"]) < 1 - 1e-6
    assert int(rows["fraction"]["steps_per_sample"]) == t // 2 and int(rows["full"]["steps_per_sample"]) == t
    assert int(rows["window"]["backward"]) == 2 * b


def test_a_snapshot_folder_of_someone_elses_files_is_named_by_its_own_flag(tmp_path, capsys):
    """gradcheck --snapshot DIR makes the snapshot there when DIR holds none: a folder of other files is
    refused naming --snapshot (the message said --out, a flag that names the CSV)."""
    folder = tmp_path / "snap"
    folder.mkdir()
    (folder / "mine.txt").write_text("x")
    capsys.readouterr()
    assert main(["gradcheck", *SET, "--snapshot", str(folder), "--windows", "3", "--alphas", "index",
                 "--route-fracs", "1", "--out", str(tmp_path / "g.csv")]) == 2
    line = capsys.readouterr().err.strip()
    assert line.startswith(f"agg-bench gradcheck: --snapshot {folder}:") and "mine.txt" in line
    assert (folder / "mine.txt").read_text() == "x" and not (tmp_path / "g.csv").exists()


def test_report_of_runs_and_a_gradcheck_without_a_manifest_gives_each_run_its_cosine(tmp_path):
    """`report --runs R --gradcheck CSV`, as docs/cli.md shows it: gradcheck's rows name the model as a run of
    the same config records it (`sd3-tiny`, not the family `sd3`), so the run's row gets its cosine. `full` in
    --methods is the reference's one row (a second `full` row left the run's cosine empty: two rows matched)."""
    one = [*SET, "--set", "train.iterations=1"]
    assert main(["run", *one, "--out", str(tmp_path / "runs" / "full")]) == 0
    out = tmp_path / "gc.csv"
    assert main(["gradcheck", *one, "--windows", "3", "--alphas", "sigma", "--route-fracs", "1",
                 "--methods", "full", "--out", str(out)]) == 0
    assert {row["model"] for row in read_rows(out)} == {"sd3-tiny"}
    tables = tmp_path / "tables"
    assert main(["report", "--runs", str(tmp_path / "runs"), "--gradcheck", str(out), "--tables", str(tables)]) == 0
    [row] = read_rows(tables / "efficiency.csv")
    assert (row["method"], row["model"]) == ("full", "sd3-tiny")
    assert float(row["grad_cosine"]) == pytest.approx(1.0, abs=1e-12)


def test_gradcheck_methods_take_the_seed_that_replay_set_takes(tmp_path):
    """`--methods fraction:seed=1` seeds fraction's draw of its steps as `replay --set seed=1` does (seed is a
    run-config key a replanning method honours, not an option of the method); a method that does not
    replan refuses it, naming the key."""
    from safetensors.torch import load_file

    from agg_bench.tools.gradcheck import compare

    snap = tmp_path / "snap"
    steps_set = [arg for item in [*TINY, "grpo.prompts_per_iteration=1", "model.dtype=float64"]
                 for arg in ("--set", item)]
    assert main(["snapshot", *steps_set, "--out", str(snap)]) == 0
    grads = {}
    for method, sets in (("full", []), ("fraction", ["--set", "train.timestep_fraction=0.5", "--set", "seed=1"])):
        grads[method] = tmp_path / f"{method}.safetensors"
        assert main(["replay", str(snap), "--method", method, *sets, "--out", str(grads[method])]) == 0
    out = tmp_path / "table.csv"
    assert main(["gradcheck", "--snapshot", str(snap), "--windows", "2", "--alphas", "index", "--route-fracs", "1",
                 "--methods", "fraction:train.timestep_fraction=0.5,seed=1", "--out", str(out)]) == 0
    row = read_rows(out)[-1]
    assert (row["method"], row["options"], row["replay"]) == ("fraction", "train.timestep_fraction=0.5,seed=1",
                                                              "replanned")
    _, rel, norm = compare(load_file(str(grads["fraction"])), load_file(str(grads["full"])))
    assert float(row["relative_error"]) == pytest.approx(rel, rel=1e-9)
    assert float(row["grad_norm"]) == pytest.approx(norm, rel=1e-9)
    assert parse_method_specs(["agg:seed=1"])[0].overrides == ["seed=1"]
    with pytest.raises(ConfigError, match="seed = 1: .*method 'agg'"):
        build_estimators(load_snapshot(snap).config, parse_method_specs(["agg:seed=1"]))


def test_a_snapshot_another_process_is_writing_is_refused(tmp_path, capsys):
    """replay and gradcheck --snapshot refuse a snapshot folder whose claim another process holds (a snapshot
    replacing its files one by one), in one line with the writer's PID, before anything is read or written."""
    from agg_bench.outdir import Busy
    from helpers import Holder

    snap = tmp_path / "snap"
    holder = Holder(snap, folder=True, lock_inside=True)
    try:
        with pytest.raises(Busy, match=f"snapshot {snap}: another agg-bench process \\(PID {holder.proc.pid}\\)"):
            load_snapshot(snap)
        out = tmp_path / "g.safetensors"
        assert main(["replay", str(snap), "--method", "full", "--out", str(out)]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and f"PID {holder.proc.pid}" in err and not out.exists()
    finally:
        holder.close()


def test_a_snapshot_of_a_rollout_that_blew_up_is_refused_and_leaves_the_earlier_one(tmp_path, monkeypatch, capsys):
    """A rollout with a NaN (here a NaN image, so a NaN reward and advantage) was written as a snapshot, exit 0,
    in place of the earlier one: a snapshot replay and gradcheck then refused. It is one line now, nothing
    written."""
    import math

    from agg_bench.engine.models import Policy

    snap = tmp_path / "snap"
    assert main(["snapshot", *SET, "--out", str(snap)]) == 0
    before = {p.relative_to(snap): p.read_bytes() for p in snap.rglob("*") if p.is_file()}
    capsys.readouterr()
    decode = Policy.decode

    def blown_up(self, latents):
        images = decode(self, latents).clone()
        images[0, 0, 0, 0] = math.nan
        return images

    monkeypatch.setattr(Policy, "decode", blown_up)
    assert main(["snapshot", *SET, "--out", str(snap)]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "the rollout of iteration 0 holds nan in advantages: expected finite" in lines[0]
    assert {p.relative_to(snap): p.read_bytes() for p in snap.rglob("*") if p.is_file()} == before
