"""The learning tables and plots (agg_bench.learning) on run folders with known rewards and times."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from agg_bench.errors import UserError
from agg_bench.learning import cpu_time_to_reach, learning_table, load_runs, main, plot_rewards


def write_run(folder, rewards, cpu_s, method, seed):
    folder.mkdir(parents=True)
    with open(folder / "metrics.jsonl", "w") as fh:
        for i, (r, t) in enumerate(zip(rewards, cpu_s)):
            fh.write(json.dumps({"iteration": i, "method": method, "seed": seed, "status": "ok", "reward_mean": r,
                                 "reward_shape": r / 2, "t_iter_s": 10 * t, "t_iter_cpu_s": t}) + "\n")
    return {"dir": str(folder), "method": method, "seed": seed}


@pytest.fixture
def manifest(tmp_path):
    runs = []
    for seed in range(3):
        # full: reward climbs 0.1 per iteration from 0.2 + 0.01 seed; 2 CPU s per iteration
        full = [0.2 + 0.01 * seed + 0.1 * i for i in range(8)]
        runs.append(write_run(tmp_path / f"full{seed}", full, [2.0] * 8, "full", seed))
        # agg: half the slope, 1 CPU s per iteration
        agg = [0.2 + 0.05 * i + 0.02 * seed * i for i in range(8)]
        runs.append(write_run(tmp_path / f"agg{seed}", agg, [1.0] * 8, "agg", seed))
    path = tmp_path / "manifest.json"
    path.write_text(json.dumps({"runs": runs}))
    return path


def test_gain_spread_and_time_to_target(manifest):
    table = learning_table(load_runs(manifest), average=2, fraction=0.5).set_index("method")
    # full: first two iterations average 0.25 + 0.01 seed, last two 0.85 + 0.01 seed -> gain 0.6 on every seed
    assert table.loc["full", "reward_initial"] == pytest.approx(0.26)
    assert table.loc["full", "reward_gain"] == pytest.approx(0.6)
    assert table.loc["full", "gain_std"] == pytest.approx(0.0, abs=1e-12)
    # agg: slope 0.05 + 0.02 seed; gain = 6 x slope -> 0.3, 0.42, 0.54
    gains = np.array([0.3, 0.42, 0.54])
    assert table.loc["agg", "reward_gain"] == pytest.approx(gains.mean())
    assert table.loc["agg", "gain_std"] == pytest.approx(gains.std(ddof=1))
    assert table.loc["agg", "gain_over_spread"] == pytest.approx(gains.mean() / gains.std(ddof=1))
    assert table.loc["agg", "reward_shape_gain"] == pytest.approx(gains.mean() / 2)
    # target: 0.5 x 0.6 = 0.3 over the initial reward (mean of the first 2 iterations)
    # full: running mean (window 2) of i-1, i gains 0.1 (i - 0.5) - 0.05 ... first >= 0.3 at i = 4 -> 5 iterations x 2 s
    assert table.loc["full", "cpu_s_to_target"] == pytest.approx(10.0)
    assert table.loc["full", "reached"] == "3/3"
    assert table.loc["full", "cpu_s_per_iteration"] == 2.0 and table.loc["full", "time_key"] == "t_iter_cpu_s"
    assert table.loc["agg", "reached"] == "3/3"


def test_time_to_target_by_hand():
    import pandas as pd

    records = pd.DataFrame({"reward_mean": [0.0, 0.0, 0.1, 0.5, 0.5], "t_iter_cpu_s": [1, 2, 3, 4, 5]})
    # running means (window 2): 0, .05, .3, .5 -> first >= .3 is the third window, ending at iteration 3
    assert cpu_time_to_reach(records, 0.3, 2) == 1 + 2 + 3 + 4
    assert cpu_time_to_reach(records, 0.6, 2) is None


def test_plots_and_cli(manifest, tmp_path):
    runs = load_runs(manifest)
    for x in ("iteration", "time"):
        path = plot_rewards(runs, tmp_path / f"{x}.png", x)
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert main(["--manifest", str(manifest), "--tables", str(tmp_path / "t"), "--average", "2"]) == 0
    assert (tmp_path / "t" / "learning.md").read_text().count("\n| ") == 3  # header + 2 methods
    assert main(["--manifest", str(tmp_path / "missing.json"), "--tables", str(tmp_path)]) == 2
    assert main(["--manifest", str(manifest), "--tables", str(tmp_path), "--fraction", "nan"]) == 2
    with pytest.raises(UserError, match="at least 10"):
        learning_table(runs, average=5)


# The slow test's configuration: config/pretrain.yaml shortened to 700 steps (sample reward 0.63, as the
# 1,500-step model), then AGG (W=5, sigma, rollout velocities reused) for 14 iterations on the learning
# sweep's settings. Measured on a 2-core Xeon (1 thread): rewards 0.611, 0.600, 0.633 ... 0.632, 0.644,
# 0.646, gain 0.026; about 100 s of CPU for the pre-training and 40 s for GRPO.
ROOT = Path(__file__).resolve().parents[1]
SLOW_PRETRAIN = ["steps=700"]
SLOW_RUN = ["train.iterations=14", "method={name: agg, window: 5, alpha: sigma, reuse_rollout_velocity: true}"]
MARGIN = 0.01


@pytest.mark.slow
def test_grpo_raises_the_scene_reward(tmp_path):
    """End to end at a fixed seed: pre-train a scene model (shortened), then GRPO on it raises the scene
    reward: the mean of the last 3 iterations exceeds that of the first 3 by MARGIN. The margin is a
    fraction of the gain measured on this configuration, so other CPUs' arithmetic (a different but equally
    valid trajectory) keeps it."""
    from agg_bench.config import load_config
    from agg_bench.io import read_jsonl
    from agg_bench.pretrain import load_pretrain_config, pretrain
    from agg_bench.train import train

    model = tmp_path / "model"
    pretrain(load_pretrain_config(ROOT / "config" / "pretrain.yaml", SLOW_PRETRAIN), model, progress=False)
    cfg = load_config(None, [
        "model.family=sd3", "model.preset=pretrained", f"model.pretrained={model}", "model.resolution=32",
        f"prompts.file={ROOT / 'config' / 'prompts' / 'scenes.txt'}", "reward.name=scene", "sampling.steps=10", "sampling.eta=0.7",
        "sampling.same_noise_per_group=false", "grpo.group_size=8", "grpo.prompts_per_iteration=4",
        "train.lr=3.0e-4", "progress=false", "telemetry.saved_activations=never", *SLOW_RUN])
    summary = train(cfg, tmp_path / "run")
    assert summary["status"] == "ok"
    rewards = [r["reward_mean"] for r in read_jsonl(tmp_path / "run" / "metrics.jsonl")]
    gain = np.mean(rewards[-3:]) - np.mean(rewards[:3])
    assert gain > MARGIN, rewards


def test_learning_sweep_dry_run(tmp_path):
    """`make learning`'s Snakemake target expands to one pre-training, every method x seed, the gradcheck
    and the learning report, and writes nothing."""
    from test_pipeline import job_counts, snakemake, workdir

    work = workdir(tmp_path)
    proc = snakemake(work, "learning", "-n", "--cores", "2", "--configfile", "config/learning.yaml")
    assert proc.returncode == 0, proc.stderr + proc.stdout
    counts = job_counts(proc.stdout)
    assert counts["pretrain"] == 1 and counts["gradcheck"] == 1 and counts["learning_report"] == 1
    assert counts["run"] == 6 * 3
    assert not (work / "results").exists()
