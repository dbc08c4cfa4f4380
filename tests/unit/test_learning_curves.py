"""Quality at equal compute (agg_bench.results.curves, through `agg-bench learning`): curves.csv and the
target-cost columns of learning.csv on run folders with in-run evaluations of known rewards and costs, the
crossings worked out by hand."""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from agg_bench.cli import main
from agg_bench.errors import UserError
from agg_bench.results.curves import CURVE_COLUMNS, crossing, resampled_costs
from agg_bench.results.learning_tables import learning_table, load_runs, plot_held_out
from agg_bench.results.stats import BOOTSTRAP_RESAMPLES, BOOTSTRAP_SEED

COST, CPU_S = {"full": 10.0, "agg": 5.0, "window": 5.0, "plain": 5.0}, 2.0  # per iteration
# held-out reward after 0, 2 and 4 iterations, per method and seed
EVALS = {
    "full": [[0.5, 0.60, 0.7], [0.5, 0.62, 0.7], [0.5, 0.64, 0.7]],  # every seed gains 0.2
    "agg": [[0.5, 0.65, 0.69], [0.5, 0.65, 0.70], [0.5, 0.65, 0.71]],
    "window": [[0.5, 0.55, 0.69], [0.5, 0.55, 0.69], [0.5, 0.55, 0.60]],  # seed 2 never reaches the target
}
# target: 0.9 x full's mean gain 0.2 = 0.18, so a method's mean curve must reach 0.5 + 0.18 = 0.68. Between
# the evaluations after 2 and 4 iterations (costs 2 and 4 iterations' worth) it crosses at
# cost(2) + (0.68 - r(2)) / (r(4) - r(2)) x (cost(4) - cost(2)); each seed's own curve at:
FULL_COSTS = [20 + 0.08 / 0.10 * 20, 20 + 0.06 / 0.08 * 20, 20 + 0.04 / 0.06 * 20]  # 36, 35, 33.33
AGG_COSTS = [10 + 0.03 / 0.04 * 10, 10 + 0.03 / 0.05 * 10, 10 + 0.03 / 0.06 * 10]  # 17.5, 16, 15
# and the mean curves (full 0.5, 0.62, 0.70; agg 0.5, 0.65, 0.70) at:
FULL_TARGET, AGG_TARGET = 20 + 0.06 / 0.08 * 20, 10 + 0.03 / 0.05 * 10  # 35, 16


def write_run(folder, method, seed, evals):
    folder.mkdir(parents=True)
    with open(folder / "metrics.jsonl", "w") as fh:
        for i in range(4):
            fh.write(json.dumps({"iteration": i, "method": method, "seed": seed, "status": "ok", "reward_mean": 0.5,
                                 "t_iter_s": 3.0, "t_iter_cpu_s": CPU_S, "cost": COST.get(method, 5.0) * (i + 1)})
                     + "\n")
    (folder / "summary.json").write_text(json.dumps({"method": method, "seed": seed, "status": "ok",
                                                     "last_good_iteration": 3}))
    if evals is not None:
        with open(folder / "evaluations.jsonl", "w") as fh:
            for n, reward in zip((0, 2, 4), evals):
                fh.write(json.dumps({"iteration": n, "eval_reward": reward, "eval_reward_shape": reward / 2,
                                     "t_eval_s": 0.1, "t_eval_cpu_s": 0.1}) + "\n")
    return {"dir": str(folder), "method": method, "seed": seed}


@pytest.fixture
def manifest(tmp_path):
    runs = [write_run(tmp_path / f"{method}{seed}", method, seed, curves[seed])
            for method, curves in EVALS.items() for seed in range(3)]
    runs += [write_run(tmp_path / "plain0", "plain", 0, None)]  # a run without in-run evaluations
    path = tmp_path / "manifest.json"
    path.write_text(json.dumps({"runs": runs}))
    return path


def test_crossing_by_hand():
    xs, rewards = np.array([0.0, 10.0, 20.0]), np.array([0.1, 0.3, 0.5])
    assert crossing(xs, rewards, 0.4) == pytest.approx(15.0)
    assert crossing(xs, rewards, 0.3) == 10.0  # on an evaluation: that evaluation's cost
    assert crossing(xs, np.array([0.1, 0.5, 0.3]), 0.4) == pytest.approx(7.5)  # the first crossing counts
    assert math.isnan(crossing(xs, rewards, 0.6))


def test_target_costs_and_speedups(manifest):
    table = learning_table(load_runs(manifest), average=1).set_index("method")
    full, agg = np.array(FULL_COSTS), np.array(AGG_COSTS)
    assert table.loc["full", "eval_gain"] == pytest.approx(0.2) and table.loc["full", "eval_source"] == "in-run"
    assert table.loc["agg", "eval_gain_std"] == pytest.approx(0.01)
    assert table.loc["agg", "eval_reward_shape_gain"] == pytest.approx(0.1)
    assert table.loc["full", "target_cost"] == pytest.approx(FULL_TARGET)
    assert table.loc["full", "target_cpu_s"] == pytest.approx(FULL_TARGET / COST["full"] * CPU_S)
    assert table.loc["agg", "target_cost"] == pytest.approx(AGG_TARGET)
    assert table.loc["agg", "target_cpu_s"] == pytest.approx(AGG_TARGET / COST["agg"] * CPU_S)
    for method, costs in (("full", full), ("agg", agg)):
        row = table.loc[method]
        assert row["target_reached"] == 3
        # a resample's mean curve crosses between the seeds' extreme crossings (up to rounding: 1e-9)
        assert costs.min() - 1e-9 <= row["target_cost_lo"] <= row["target_cost"] <= row["target_cost_hi"] \
            <= costs.max() + 1e-9
        assert row["speedup_to_target_lo"] <= row["speedup_to_target"] <= row["speedup_to_target_hi"]
    assert table.loc["full", "speedup_to_target"] == pytest.approx(1.0)
    assert table.loc["agg", "speedup_to_target"] == pytest.approx(FULL_TARGET / AGG_TARGET)
    assert table.loc["agg", "speedup_to_target_lo"] > 1  # every resample of agg's seeds is cheaper than full's
    # window's mean curve (0.5, 0.55, 0.66) never reaches 0.68, though two of its seeds do: not reached, and
    # its resamples that reach it (those without seed 2) cannot make the upper bound finite
    assert table.loc["window", "target_reached"] == 2 and table.loc["window", "target_cost_hi"] == math.inf
    assert table.loc[["window", "plain"], ["target_cost", "target_cpu_s", "speedup_to_target"]].isna().all().all()
    assert pd.isna(table.loc["plain", "target_reached"]) and pd.isna(table.loc["plain", "eval_gain"])
    # another target and reference
    other = learning_table(load_runs(manifest), average=1, baseline="agg", target_fraction=0.5).set_index("method")
    # 0.5 x agg's mean gain 0.2 = 0.1: full's mean curve (0.5, 0.62, 0.7) crosses 0.6 at 20 x 0.1 / 0.12
    assert other.loc["full", "target_cost"] == pytest.approx(20 * 0.1 / 0.12)


def test_the_gain_from_the_checkpoint_evaluation(manifest, capsys, tmp_path):
    """``eval_source`` checkpoint: every method's held-out gain columns from agg-bench learning's own
    evaluation (e.g. on more noises than the runs'), even where the runs have in-run evaluations; the
    curves' target columns do not change. Bad values and a checkpoint source without an evaluation are
    refused with one line, exit 2, nothing written."""
    runs = load_runs(manifest)
    finals = {"full": [0.7, 0.8, 0.9], "agg": [0.6, 0.6, 0.9], "window": [0.5, 0.4, 0.6], "plain": [0.45]}
    scores = pd.DataFrame([{"state": "pre-trained", "method": None, "seed": None, "eval_reward": 0.4}] + [
        {"state": f"{m}/{k}", "method": m, "seed": k, "eval_reward": r} for m, rs in finals.items()
        for k, r in enumerate(rs)])
    auto = learning_table(runs, average=1, evaluation=scores).set_index("method")
    table = learning_table(runs, average=1, evaluation=scores, eval_source="checkpoint").set_index("method")
    assert auto.loc["full", "eval_gain"] == pytest.approx(0.2) and auto.loc["full", "eval_source"] == "in-run"
    assert auto.loc["plain", "eval_source"] == "checkpoint"
    for method, rs in finals.items():
        gains = np.array(rs) - 0.4
        assert table.loc[method, "eval_source"] == "checkpoint"
        assert table.loc[method, "eval_initial"] == 0.4
        assert table.loc[method, "eval_gain"] == pytest.approx(gains.mean())
        if len(rs) > 1:
            assert table.loc[method, "eval_gain_std"] == pytest.approx(gains.std(ddof=1))
    target = ["target_cost", "target_cost_lo", "target_cost_hi", "speedup_to_target", "target_reached"]
    pd.testing.assert_frame_equal(table[target], auto[target])
    with pytest.raises(ValueError, match="eval_source"):
        learning_table(runs, eval_source="in-run")
    out = tmp_path / "out"
    for bad, says in ((["--eval-source", "checkpoint"], "--eval-noises >= 1"),
                      (["--eval-source", "in_run"], "expected one of auto, checkpoint")):
        capsys.readouterr()
        assert main(["learning", "--manifest", str(manifest), "--tables", str(out), *bad]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and says in err and "--eval-source" in err, err
        assert not out.exists()


def test_the_command_writes_curves_and_the_table(manifest, tmp_path):
    out = tmp_path / "out"
    assert main(["learning", "--manifest", str(manifest), "--tables", str(out), "--average", "1"]) == 0
    curves = pd.read_csv(out / "curves.csv")
    assert tuple(curves.columns) == CURVE_COLUMNS and len(curves) == 9 * 3
    seed1 = curves[(curves["method"] == "agg") & (curves["seed"] == 1)]
    assert seed1["iteration"].tolist() == [0, 2, 4] and seed1["cost"].tolist() == [0.0, 10.0, 20.0]
    assert seed1["cpu_s"].tolist() == [0.0, 4.0, 8.0] and seed1["eval_reward"].tolist() == EVALS["agg"][1]
    table = pd.read_csv(out / "learning.csv")
    for column in ("method", "seeds", "eval_gain", "eval_gain_std", "target_cost", "target_cost_lo",
                   "target_cost_hi", "target_cpu_s", "speedup_to_target", "speedup_to_target_lo",
                   "speedup_to_target_hi", "target_reached", "reward_gain", "cpu_s_to_target"):
        assert column in table.columns, column
    assert table.set_index("method").loc["agg", "target_reached"] == 3
    markdown = (out / "learning.md").read_text()
    window = next(line for line in markdown.splitlines() if line.startswith("| window |"))
    assert "not reached" in window and "2/3" in window
    assert main(["learning", "--manifest", str(manifest), "--tables", str(out), "--target-fraction", "0"]) == 2
    assert main(["learning", "--manifest", str(manifest), "--tables", str(out), "--target-fraction", "1.5"]) == 2


def test_the_tables_rerun_into_a_folder_that_also_holds_the_plots(manifest, tmp_path, capsys):
    """`learning --tables D` on a folder that an earlier `--tables D --plots D` wrote was refused: the plots
    counted as someone's files. They are the verb's own; a file of someone's there is still refused."""
    out = tmp_path / "out"
    assert main(["learning", "--manifest", str(manifest), "--tables", str(out), "--average", "1"]) == 0
    plots = ("reward_iteration.png", "reward_time.png", "samples.png", "eval_reward_cost.png",
             "eval_reward_cpu.png", "eval_pareto.png")
    for name in plots:  # what the plots of that earlier run left beside the tables
        (out / name).write_bytes(b"\x89PNG\r\n\x1a\n")
    assert main(["learning", "--manifest", str(manifest), "--tables", str(out), "--average", "1"]) == 0
    assert {p.name for p in out.iterdir()} == {"learning.csv", "learning.md", "curves.csv", *plots}
    (out / "notes.txt").write_text("mine")
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    capsys.readouterr()
    assert main(["learning", "--manifest", str(manifest), "--tables", str(out), "--average", "1"]) == 2
    assert capsys.readouterr().err.strip() == (f"agg-bench learning: --tables {out}: the folder holds files that "
                                               "are not learning tables or learning plots (notes.txt); give a new "
                                               "or empty folder")
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


def test_plots_with_and_without_in_run_evaluations(manifest, tmp_path):
    paths = plot_held_out(load_runs(manifest), tmp_path / "with")
    assert [p.name for p in paths] == ["eval_reward_cost.png", "eval_reward_cpu.png", "eval_pareto.png"]
    assert all(p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in paths)
    bare = tmp_path / "bare.json"
    bare.write_text(json.dumps({"runs": [write_run(tmp_path / "p1", "plain", 1, None)]}))
    assert all(p.is_file() for p in plot_held_out(load_runs(bare), tmp_path / "without"))
    assert main(["learning", "--manifest", str(bare), "--tables", str(tmp_path / "t"), "--average", "1"]) == 0
    assert (tmp_path / "t" / "curves.csv").read_text().strip() == ",".join(CURVE_COLUMNS)


def test_a_malformed_evaluation_line_is_named(tmp_path):
    entry = write_run(tmp_path / "run", "full", 0, [0.5, 0.6, 0.7])
    with open(tmp_path / "run" / "evaluations.jsonl", "a") as fh:
        fh.write(json.dumps({"iteration": "late", "eval_reward": 0.1}) + "\n")
    manifest = tmp_path / "manifest.json"
    manifest.write_text(json.dumps({"runs": [entry]}))
    assert main(["learning", "--manifest", str(manifest), "--tables", str(tmp_path / "t")]) == 2
    lines = (tmp_path / "run" / "evaluations.jsonl").read_text().splitlines()
    (tmp_path / "run" / "evaluations.jsonl").write_text("\n".join(lines[1:3]) + "\n")  # no starting evaluation
    with pytest.raises(UserError, match="iteration 0"):
        load_runs(manifest)


# ----- what the reward does not see ----------------------------------------------------------------

PARTS = ("color", "shape", "position", "count")
# per seed: the held-out sub-scores at the start and at the end (the reward weighs the shape only)
SUBSCORES = {
    "full": [({"color": 0.9, "shape": 0.5, "position": 1.0, "count": 0.9},
              {"color": 0.9, "shape": 0.7, "position": 1.0, "count": 0.8}),
             ({"color": 0.9, "shape": 0.5, "position": 1.0, "count": 0.9},
              {"color": 0.8, "shape": 0.6, "position": 1.0, "count": 0.9})],
    "nft": [({"color": 0.9, "shape": 0.5, "position": 1.0, "count": 0.9},
             {"color": 0.9, "shape": 0.9, "position": 0.9, "count": 0.6}),
            ({"color": 0.9, "shape": 0.5, "position": 1.0, "count": 0.9},
             {"color": 0.8, "shape": 0.8, "position": 1.0, "count": 0.5})],
}


def write_scene_run(folder, method, seed, start, end, weights):
    entry = write_run(folder, method, seed, None)
    with open(folder / "evaluations.jsonl", "w") as fh:
        for n, parts in ((0, start), (4, end)):
            fh.write(json.dumps({"iteration": n, "eval_reward": parts["shape"],
                                 **{f"eval_reward_{k}": v for k, v in parts.items()}}) + "\n")
    options = {} if weights is None else {"weights": weights}
    (folder / "config.json").write_text(json.dumps({"reward": {"name": "scene", "options": options}}))
    return entry


@pytest.fixture
def scene_manifest(tmp_path):
    runs = [write_scene_run(tmp_path / f"{method}{seed}", method, seed, *ends, {"shape": 1})
            for method, seeds in SUBSCORES.items() for seed, ends in enumerate(seeds)]
    path = tmp_path / "manifest.json"
    path.write_text(json.dumps({"runs": runs}))
    return path


def test_unseen_change_is_the_mean_change_of_the_unweighted_sub_scores(scene_manifest, tmp_path):
    """The reward weighs the shape alone: colour, position and count are unseen. Per seed their mean change,
    then the mean (and ddof-1 std) over seeds; each sub-score's change with its own spread; the same from the
    runs' curves and from the checkpoint evaluation of the same scores."""
    table = learning_table(load_runs(scene_manifest), average=1).set_index("method")
    for method, seeds in SUBSCORES.items():
        changes = {k: np.array([end[k] - start[k] for start, end in seeds]) for k in PARTS}
        per_seed = (changes["color"] + changes["position"] + changes["count"]) / 3
        assert table.loc[method, "unseen_change"] == pytest.approx(per_seed.mean(), abs=1e-12)
        assert table.loc[method, "unseen_change_std"] == pytest.approx(per_seed.std(ddof=1), abs=1e-12)
        for k in PARTS:
            assert table.loc[method, f"eval_reward_{k}_gain"] == pytest.approx(changes[k].mean(), abs=1e-12)
            assert table.loc[method, f"eval_reward_{k}_std"] == pytest.approx(changes[k].std(ddof=1), abs=1e-12)
    assert table.loc["nft", "unseen_change"] < table.loc["full", "unseen_change"] < 0
    scores = pd.DataFrame([{"state": "pre-trained", "method": None, "seed": None, "eval_reward": 0.5,
                            **{f"eval_reward_{k}": v for k, v in SUBSCORES["full"][0][0].items()}}] + [
        {"state": f"{m}/{s}", "method": m, "seed": s, "eval_reward": end["shape"],
         **{f"eval_reward_{k}": v for k, v in end.items()}} for m, seeds in SUBSCORES.items()
        for s, (_, end) in enumerate(seeds)])
    checkpoint = learning_table(load_runs(scene_manifest), average=1, evaluation=scores,
                                eval_source="checkpoint").set_index("method")
    columns = ["unseen_change", "unseen_change_std", *(f"eval_reward_{k}_{s}" for k in PARTS for s in ("gain", "std"))]
    pd.testing.assert_frame_equal(checkpoint[columns], table[columns])
    out = tmp_path / "tables"
    assert main(["learning", "--manifest", str(scene_manifest), "--tables", str(out), "--average", "1"]) == 0
    written = pd.read_csv(out / "learning.csv")
    for column in ("unseen_change", "eval_reward_count_gain", "eval_reward_count_std", "eval_reward_color_std"):
        assert column in written.columns


def test_a_reward_that_weighs_every_sub_score_leaves_nothing_unseen(tmp_path):
    runs = [write_scene_run(tmp_path / f"r{seed}", "full", seed, *SUBSCORES["full"][seed], weights)
            for seed, weights in enumerate([None, None])]
    path = tmp_path / "manifest.json"
    path.write_text(json.dumps({"runs": runs}))
    table = learning_table(load_runs(path), average=1)
    assert table["unseen_change"].isna().all() and "eval_reward_count_std" in table
    (tmp_path / "r0" / "config.json").write_text(json.dumps({"reward": {"name": "scene", "options": {"weights": 3}}}))
    with pytest.raises(UserError, match="reward.options.weights"):
        load_runs(path)


def test_every_method_has_its_own_colour_and_marker_and_the_pareto_plots_gain_against_unseen(
        scene_manifest, monkeypatch, tmp_path):
    from agg_bench.results import curves as curves_module
    from agg_bench.results.plotting import method_style

    styles = [method_style(k) for k in range(16)]
    assert len({s["color"] for s in styles}) == len({s["marker"] for s in styles}) == 16
    figures = {}
    monkeypatch.setattr(curves_module, "save_figure", lambda fig, path: figures.setdefault(Path(path).name, fig))
    manifest = json.loads(scene_manifest.read_text())
    for k in range(13):  # thirteen methods, as the learning sweep has
        manifest["runs"].append(write_run(tmp_path / f"m{k}", f"m{k}", 0, [0.5, 0.55, 0.6]))
    scene_manifest.write_text(json.dumps(manifest))
    plot_held_out(load_runs(scene_manifest), tmp_path / "plots")
    lines = figures["eval_reward_cost.png"].axes[0].get_lines()
    assert len(lines) == 15
    assert len({line.get_color() for line in lines}) == len({line.get_marker() for line in lines}) == 15
    table = learning_table(load_runs(scene_manifest), average=1).set_index("method")
    points = {}
    for container in figures["eval_pareto.png"].axes[0].containers:  # errorbar containers: (line, caps, bars)
        x, y = container.lines[0].get_data()
        points[container.get_label().split(" (")[0]] = (float(x[0]), float(y[0]))
    assert set(points) == {"full", "nft"}  # the other methods' runs do not say what their reward weighs
    for method, (x, y) in points.items():
        assert (x, y) == pytest.approx((table.loc[method, "unseen_change"], table.loc[method, "eval_gain"]))


def mean_curve(curves: list[dict[str, list[float]]]) -> dict[str, list[float]]:
    """The module docstring's mean curve of one resample, one evaluation at a time in float64: the seeds'
    columns (each as float lists: :func:`float_columns`) added in their order up to the shortest, over their
    number."""
    n = min(len(c["iteration"]) for c in curves)
    mean = {}
    for key in ("iteration", "cost", "eval_reward"):
        total = [0.0] * n
        for c in curves:
            total = [t + v for t, v in zip(total, c[key][:n])]
        mean[key] = [t / len(curves) for t in total]
    return mean


def crossing_cost(mean: dict[str, list[float]], target: float) -> float:
    """Where ``mean`` (:func:`mean_curve`) first reaches its starting reward + target: the first evaluation
    at or above it, interpolated from the one before; inf where none is."""
    threshold = mean["eval_reward"][mean["iteration"].index(0.0)] + target
    for k, reward in enumerate(mean["eval_reward"]):
        if reward >= threshold:
            if k == 0:
                return mean["cost"][0]
            r0, c0, c1 = mean["eval_reward"][k - 1], mean["cost"][k - 1], mean["cost"][k]
            return c0 + (threshold - r0) / (reward - r0) * (c1 - c0)
    return math.inf


def float_columns(curve: pd.DataFrame) -> dict[str, list[float]]:
    return {key: [float(v) for v in curve[key].to_numpy(float)] for key in ("iteration", "cost", "eval_reward")}


@pytest.mark.parametrize("seeds", [1, 3, 10])
def test_the_resamples_crossed_at_once_are_each_crossed_as_one_mean_curve(seeds):
    """Every resample's target cost equals its own mean curve crossed alone: seeds of unequal lengths (a
    resample's curve ends at its shortest pick's), targets reached early, late, between evaluations and
    never, on fresh random curves."""
    rng = np.random.default_rng()
    curves = []
    for _ in range(seeds):
        n = int(rng.integers(2, 12))
        curves.append(pd.DataFrame({"iteration": np.arange(n) * 5, "cost": np.cumsum(rng.random(n)) - 0.1,
                                    "eval_reward": np.r_[0.5, 0.5 + np.cumsum(rng.normal(0.01, 0.03, n - 1))]}))
    picks = np.random.default_rng(BOOTSTRAP_SEED).integers(0, seeds, size=(BOOTSTRAP_RESAMPLES, seeds))
    # each resample's mean curve does not depend on the target: made once (from columns read once), crossed per target
    columns = [float_columns(c) for c in curves]
    means = [mean_curve([columns[i] for i in pick]) for pick in picks]
    for target in (-0.01, 0.0, 0.02, 0.05, 10.0):
        expected = [crossing_cost(mean, target) for mean in means]
        assert resampled_costs(curves, target).tolist() == expected


@pytest.mark.parametrize("key, first, other", [
    ("reward", {"name": "scene", "options": {"weights": {"shape": 1}}}, {"name": "scene", "options": {"weights": {"color": 1}}}),
    ("eval", {"noises": 16, "seed": 0}, {"noises": 16, "seed": 1}),
    ("prompts", {"file": "config/prompts/scenes.txt"}, {"file": "config/prompts/other.txt"}),
])
def test_runs_measured_differently_are_refused(manifest, tmp_path, capsys, key, first, other):
    """A manifest whose runs were trained on another reward, or evaluated on other noise or captions, made one
    table that compared their gains against one target without a word."""
    runs = json.loads(manifest.read_text())["runs"]
    for k, run in enumerate(runs):
        config = {"method": {"name": "full"}, key: first if k == 0 else other if k == 4 else first}
        (Path(run["dir"]) / "config.json").write_text(json.dumps(config))
    out = tmp_path / "t"
    assert main(["learning", "--manifest", str(manifest), "--tables", str(out), "--average", "1"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and f"{runs[4]['method']}/{runs[4]['seed']}" in lines[0] and f" {key}" in lines[0], lines
    assert not out.exists()
    (Path(runs[4]["dir"]) / "config.json").write_text(json.dumps({"method": {"name": "full"}, key: first}))
    assert main(["learning", "--manifest", str(manifest), "--tables", str(out), "--average", "1"]) == 0


@pytest.mark.parametrize("every, iterations", [(None, (0, 1, 2, 3, 4)), (4, (0, 4))])
def test_seeds_of_a_method_evaluated_on_other_schedules_are_refused(manifest, tmp_path, capsys, every, iterations):
    """A method's mean curve pairs its seeds' k-th evaluations: a seed evaluated every iteration beside seeds
    evaluated every 2 had its evaluation after 1 iteration averaged with theirs after 2. Refused, one line naming
    both runs and their eval.every (from config.json where it is written; the evaluations' iterations tell a
    schedule too), before anything is written."""
    runs = json.loads(manifest.read_text())["runs"]
    agg = [run for run in runs if run["method"] == "agg"]
    if every is not None:  # eval.every 4 evaluates after 0 and 4 iterations of 4: the iterations alone agree
        for run in agg:
            config = {"method": {"name": "agg"}, "eval": {"every": every if run is agg[1] else 2}}
            (Path(run["dir"]) / "config.json").write_text(json.dumps(config))
    (Path(agg[1]["dir"]) / "evaluations.jsonl").write_text("".join(
        json.dumps({"iteration": n, "eval_reward": 0.5 + n / 20}) + "\n" for n in iterations))
    out = tmp_path / "t"
    assert main(["learning", "--manifest", str(manifest), "--tables", str(out), "--average", "1"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    shown = {None: "None", 4: "4"}[every]
    assert len(lines) == 1 and f"run agg/1 ({agg[1]['dir']}) eval.every = {shown}, evaluated after iterations " \
        f"{', '.join(map(str, iterations))}, where run agg/0 ({agg[0]['dir']}) eval.every = " \
        f"{'None' if every is None else '2'}, evaluated after iterations 0, 2, 4; expected the seeds of a method " \
        "evaluated on one schedule" in lines[0], lines
    assert not out.exists()


def test_a_seed_its_budget_ended_elsewhere_keeps_its_last_evaluation_there(manifest, tmp_path):
    """A run that its budget ended takes its last evaluation where it ended (after 3 iterations, not 4): one
    schedule, the seeds' last evaluations paired as their final ones."""
    runs = json.loads(manifest.read_text())["runs"]
    (Path(runs[1]["dir"]) / "evaluations.jsonl").write_text("".join(
        json.dumps({"iteration": n, "eval_reward": r}) + "\n" for n, r in ((0, 0.5), (2, 0.62), (3, 0.7))))
    assert main(["learning", "--manifest", str(manifest), "--tables", str(tmp_path / "t"), "--average", "1"]) == 0


def test_a_count_of_one_reads_singular_in_the_learning_refusals(tmp_path):
    """`learning` said "1 iterations with status ok" of a run with one ok record."""
    from agg_bench.results.curves import run_curve
    from agg_bench.results.learning_tables import Run, run_gain
    from agg_bench.tools.learning import check_lengths

    one = pd.DataFrame({"iteration": [0], "reward_mean": [0.5]})
    with pytest.raises(UserError, match=r"\): 1 iteration with status ok; the learning table needs at least 2 "):
        check_lengths([Run("full", 0, tmp_path, one)], 1)
    with pytest.raises(UserError, match=r"^a run of 1 iteration: the learning table needs at least 2$"):
        run_gain(one, 1)
    with pytest.raises(UserError, match=r"^an evaluation after 2 iterations without an ok record of iteration 1$"):
        run_curve(pd.DataFrame({"iteration": [2], "eval_reward": [0.5]}), one, np.ones(1))
    with pytest.raises(UserError, match=r"^an evaluation after 1 iteration without an ok record of iteration 0$"):
        run_curve(pd.DataFrame({"iteration": [1], "eval_reward": [0.5]}), one.iloc[:0], np.ones(0))


def test_evaluation_csv_keeps_seeds_integers():
    """evaluation.csv wrote each run's seed as 0.0, 1.0: the pre-trained row's empty seed made the column float."""
    from agg_bench.results.learning_tables import Run
    from agg_bench.tools.learning import evaluate

    class Scored:
        def evaluate_weights(self, run):
            return {"eval_reward": 0.5 if run is None else 0.6}, []

    runs = [Run("full", seed, Path(f"full{seed}"), pd.DataFrame()) for seed in (0, 7)]
    scores, _ = evaluate(runs, Scored())
    lines = scores.to_csv(index=False).splitlines()
    assert lines[1].startswith("pre-trained,,,") and lines[2].startswith("full/0,full,0,"), lines
    assert lines[3].startswith("full/7,full,7,"), lines


@pytest.mark.parametrize("bad_state, key, value", [(7, "eval_reward_shape", math.nan), (7, "eval_reward_count", math.inf),
                                                    (None, "eval_reward_colour", -math.inf)])
def test_a_checkpoint_evaluation_with_a_non_finite_sub_score_is_refused(bad_state, key, value):
    """A NaN or infinite sub-score beside a finite eval_reward went into evaluation.csv and the learning table's
    held-out gains: only the run's own evaluations were checked, and those for every key."""
    from agg_bench.results.learning_tables import Run
    from agg_bench.tools.learning import evaluate

    class Scored:
        def evaluate_weights(self, run):
            means = {"eval_reward": 0.5, "eval_reward_shape": 0.4, "eval_reward_count": 0.3}
            return {**means, key: value} if (None if run is None else run.seed) == bad_state else means, []

    runs = [Run("full", seed, Path(f"full{seed}"), pd.DataFrame()) for seed in (0, 7)]
    where = r"the pre-trained weights" if bad_state is None else r"run full/7 \(full7\)"
    with pytest.raises(UserError, match=rf"^{where}: non-finite {key} in the checkpoint evaluation; "):
        evaluate(runs, Scored())


@pytest.mark.parametrize("source, without", [("checkpoint", "agg1"), ("auto", "plain0")])
def test_a_run_without_the_checkpoint_its_columns_need_is_refused(manifest, tmp_path, capsys, source, without):
    """A run without checkpoint.pt was left out of the checkpoint evaluation, so its method's held-out gain
    averaged fewer seeds than its seeds column said (a method with in-run evaluations needs none with auto)."""
    runs = json.loads(manifest.read_text())["runs"]
    if source == "auto":  # plain: no in-run evaluations, two seeds, one of them with a checkpoint
        runs.append(write_run(tmp_path / "plain1", "plain", 1, None))
        (tmp_path / "plain1" / "checkpoint.pt").write_bytes(b"")
        manifest.write_text(json.dumps({"runs": runs}))
    else:
        for run in runs:
            if Path(run["dir"]).name != without:
                (Path(run["dir"]) / "checkpoint.pt").write_bytes(b"")
    out = tmp_path / "t"
    assert main(["learning", "--manifest", str(manifest), "--tables", str(out), "--average", "1", "--eval-noises", "1",
                 "--eval-source", source]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and f"({tmp_path / without}): no checkpoint.pt" in lines[0], lines
    assert not out.exists()


def test_an_evaluation_its_records_cannot_place_names_the_run_before_any_sampling(manifest, tmp_path, capsys,
                                                                                  monkeypatch):
    """An evaluation after an iteration whose record is not ok was refused without naming the run, and with
    --plots or --eval-noises only after the model had been sampled."""
    import agg_bench.tools.learning as learning

    def never(*args, **kwargs):
        raise AssertionError("the model was built before the runs were checked")

    monkeypatch.setattr(learning, "CheckpointEvaluation", never)
    runs = json.loads(manifest.read_text())["runs"]
    metrics = Path(runs[4]["dir"]) / "metrics.jsonl"
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    records[1]["status"] = "diverged"  # the evaluation after 2 iterations has no ok record of iteration 1
    metrics.write_text("".join(json.dumps(r) + "\n" for r in records))
    out = tmp_path / "p"
    assert main(["learning", "--manifest", str(manifest), "--plots", str(out)]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and f"run {runs[4]['method']}/{runs[4]['seed']} ({runs[4]['dir']}): an evaluation" in lines[0]
    assert not out.exists()


@pytest.mark.parametrize("edit, words", [
    (lambda run: (run / "summary.json").unlink(), "has not ended (it has no summary.json)"),
    (lambda run: (run / "summary.json").write_text(json.dumps({"status": "interrupted", "last_good_iteration": 3})),
     "has not ended (summary.json says it was interrupted)"),
    (lambda run: (run / "summary.json").write_text(json.dumps({"status": "ok", "last_good_iteration": 7})),
     "no ok record of iteration 7"),
    # a diverged run counted as a seed with the gain of its iterations before the blow-up
    (lambda run: (run / "summary.json").write_text(json.dumps({
        "status": "diverged", "last_good_iteration": 3, "error": "non-finite loss at iteration 4"})),
     "ended 'diverged' (non-finite loss at iteration 4); expected runs that ended ok"),
])
def test_a_run_that_has_not_ended_is_refused(manifest, tmp_path, capsys, edit, words):
    """A run killed or stopped before its end counted as a seed, its last evaluation standing as its final one."""
    runs = json.loads(manifest.read_text())["runs"]
    edit(Path(runs[1]["dir"]))
    out = tmp_path / "t"
    assert main(["learning", "--manifest", str(manifest), "--tables", str(out), "--average", "1"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and words in lines[0], lines
    assert not out.exists()


def test_a_run_another_process_is_writing_is_refused(manifest, tmp_path):
    """A run of the manifest being resumed or replaced (another process holds its folder's claim) is refused with
    the writer's PID, not read as a mix of two attempts."""
    from agg_bench.outdir import Busy
    from helpers import Holder

    holder = Holder(tmp_path / "agg1", folder=True, lock_inside=True)
    try:
        with pytest.raises(Busy, match=f"PID {holder.proc.pid}.*is writing") as refused:
            load_runs(manifest)
        assert refused.value.target == tmp_path / "agg1"
    finally:
        holder.close()
    assert len(load_runs(manifest)) == 10


def test_a_seed_whose_held_out_score_is_nan_leaves_the_method_s_scores_empty():
    """The checkpoint evaluation of a run whose final weights gave images that are not finite scores NaN: eval_final
    was the other seeds' mean under a row counting every seed, while eval_gain was empty."""
    from agg_bench.results.curves import gain_columns

    first = pd.DataFrame({"eval_reward": [-0.2, -0.2]})
    last = pd.DataFrame({"eval_reward": [-0.1, math.nan]})
    row = gain_columns(first, last, None)
    assert row["eval_initial"] == -0.2
    assert all(math.isnan(row[key]) for key in ("eval_final", "eval_gain", "eval_gain_std"))


def test_the_learning_markdown_shows_a_label_as_text():
    """A method label of a shared manifest is text in learning.md: a pipe split its row, HTML was markup."""
    from agg_bench.results.learning_tables import to_markdown

    table = pd.DataFrame([{"method": "a|b <img src=x onerror=alert(1)>", "reward_gain": 0.5}])
    lines = to_markdown(table, "caption").splitlines()
    assert lines[2:] == ["| method | reward_gain |", "|---|---|",
                         "| a\\|b &lt;img src=x onerror=alert(1)&gt; | 0.500 |"]
