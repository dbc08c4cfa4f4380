"""The learning tables and plots (agg_bench.results.learning_tables, written by `agg-bench learning`) on run folders
with known rewards and times."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
import yaml

from agg_bench.errors import UserError
from agg_bench.results.learning_tables import cpu_time_to_reach, learning_table, load_runs, plot_rewards
from agg_bench.cli import main
from agg_bench.config.reward_options import SCENE_PARTS
from agg_bench.tools.sweep import flatten, overrides_of
from helpers import exit_code


def write_run(folder, rewards, cpu_s, method, seed):
    folder.mkdir(parents=True)
    with open(folder / "metrics.jsonl", "w") as fh:
        for i, (r, t) in enumerate(zip(rewards, cpu_s)):
            fh.write(json.dumps({"iteration": i, "method": method, "seed": seed, "status": "ok", "reward_mean": r,
                                 "reward_shape": r / 2, "t_iter_s": 10 * t, "t_iter_cpu_s": t}) + "\n")
    (folder / "summary.json").write_text(json.dumps({"method": method, "seed": seed, "status": "ok",
                                                     "last_good_iteration": len(rewards) - 1}))
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
    assert main(["learning", "--manifest", str(manifest), "--tables", str(tmp_path / "t"), "--average", "2"]) == 0
    assert (tmp_path / "t" / "learning.md").read_text().count("\n| ") == 3  # header + 2 methods
    assert main(["learning", "--manifest", str(tmp_path / "missing.json"), "--tables", str(tmp_path)]) == 2
    assert exit_code(["learning", "--manifest", str(manifest), "--tables", str(tmp_path), "--fraction", "nan"]) == 2
    with pytest.raises(UserError, match="at least 10"):
        learning_table(runs, average=5)


def test_a_manifest_replaced_while_the_learning_report_reads_it_leaves_its_tables_as_they_were(manifest, tmp_path,
                                                                                               monkeypatch, capsys):
    """As the efficiency report (tests/unit/test_report.py): a manifest replaced while `agg-bench learning` read it
    (`campaign unpack` adding runs to the reference) is refused in one line, and the tables stay as they were,
    never tables of the earlier manifest beside the later one."""
    from agg_bench.io import write_json
    from agg_bench.results import learning_tables

    tables, listed = tmp_path / "t", json.loads(manifest.read_text())
    write_json(manifest, {"runs": listed["runs"][:4]})
    args = ["learning", "--manifest", str(manifest), "--tables", str(tables), "--average", "2"]
    assert main(args) == 0
    before = {p.name: p.read_bytes() for p in tables.iterdir()}
    original = learning_tables.load_runs

    def read_then_replaced(path):
        runs = original(path)
        write_json(manifest, listed)  # another process's manifest lands meanwhile
        return runs

    monkeypatch.setattr("agg_bench.tools.learning.load_runs", read_then_replaced)
    capsys.readouterr()
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"agg-bench learning: manifest {manifest}: replaced by another process while it was read; run "
                   "again once that process has ended"), err
    assert {p.name: p.read_bytes() for p in tables.iterdir()} == before
    monkeypatch.undo()
    assert main(args) == 0 and (tables / "learning.csv").read_bytes() != before["learning.csv"]


# The slow test's configuration: full GRPO on the learning sweep's settings (lr 3e-4, KL weight 0.04, the
# shape-weighted scene reward, its budget of 40 full iterations) from the sweep's own pre-trained model, scored
# by the held-out evaluation (the rollouts' SDE, fixed noise) before and after. The model is committed
# (tests/data/sd3-scenes: the output of `agg-bench pretrain --config config/pretrain.yaml`, 6,000 steps: 11-17
# CPU-minutes; docs/learning.md), since shorter pre-trainings learn too little to be a test (on the earlier
# four-way mean reward 40 iterations raised the evaluation by +0.027 from the 6,000-step model, +0.014 from
# 4,000 steps, +0.001 from 3,000 and -0.023 (20 iterations) from 1,500). On the shape reward the sweep's 5
# seeds of full GRPO gained +0.055 to +0.113 in these 40 iterations (2-core AMD EPYC, the sweep's own
# pre-trained model); the run is about 65 CPU-s at 1 thread.
# The run is `agg-bench run` in this process, on one thread as the workflow's job runs (OMP_NUM_THREADS=1), and
# without the sweep's in-run evaluations (eval.every 0): neither changes what is trained. Measured against the
# workflow's way (a fresh `python -m agg_bench run` process with eval.every 10): the same metrics.jsonl but for
# its timings, the same final weights and optimizer state, and the held-out scores below identical to that run's
# own evaluations of iteration 0 and 40; in a process of its own it cost the imports of the model code again
# (about 6 CPU-s) and the evaluations the checkpoint evaluation below repeats (about 5 CPU-s).
ROOT = Path(__file__).resolve().parents[2]
SCENE_MODEL = ROOT / "tests" / "data" / "sd3-scenes"
SLOW_RUN = ["train.iterations=40", "train.checkpoint_every=40"]
SLOW_NOISES = 16
MARGIN = 0.02  # of the seeds' +0.055 to +0.113: another CPU's equally valid trajectory keeps it
# Fewer iterations do not keep it: run seeds 0, 1, 2 of this configuration (the run's seed; in-run evaluations
# every 5 iterations) gained -0.021/-0.009/-0.029 at 5, +0.087/+0.018/+0.037 at 20, +0.102/-0.007/+0.037 at
# 25, seeds 1 and 2 +0.027/+0.048 at 30, +0.030/+0.089 at 35 and +0.060/+0.106 at 40.
SLOW_TIMEOUT_S = 1800  # a hang fails instead of blocking CI


@pytest.mark.slow
def test_grpo_raises_the_scene_reward(tmp_path):
    """End to end at a fixed seed: full GRPO on the sweep's pre-trained scene model raises the held-out
    evaluation's scene reward (every caption x SLOW_NOISES fixed noises, the rollouts' SDE) from the
    pre-trained weights to the final ones by more than MARGIN. The margin is a fraction of the gain
    measured on this configuration, so other CPUs' arithmetic (a different but equally valid trajectory)
    keeps it; a run that does not change the weights scores exactly the pre-trained score and fails it."""
    from agg_bench.tools.learning import CheckpointEvaluation, evaluate

    import faulthandler

    import torch

    # the sweep's own run settings (its base and set), on this model, for SLOW_RUN's iterations, through the
    # CLI on one thread as the workflow runs it (in this process, without in-run evaluations: see above)
    sweep = yaml.safe_load((ROOT / "config" / "learning.yaml").read_text())
    overrides = overrides_of([*flatten(sweep["base"]), *flatten(sweep["set"])]) + [
        "model.family=sd3", "model.preset=pretrained", f"model.pretrained={SCENE_MODEL}", "model.resolution=32",
        f"prompts.file={ROOT / sweep['set']['prompts.file']}", *SLOW_RUN, "eval.every=0"]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    faulthandler.dump_traceback_later(SLOW_TIMEOUT_S, exit=True)  # a hang ends the test process with its stack
    try:
        assert main(["run", *(arg for key in overrides for arg in ("--set", key)), "--out", str(tmp_path / "run")]) == 0
    finally:
        faulthandler.cancel_dump_traceback_later()
        torch.set_num_threads(threads)
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["status"] == "ok"
    manifest = tmp_path / "manifest.json"
    manifest.write_text(json.dumps({"runs": [{"dir": str(tmp_path / "run"), "method": "full", "seed": 0}]}))
    runs = load_runs(manifest)
    scores, _ = evaluate(runs, CheckpointEvaluation(runs, SLOW_NOISES, sampler="sde"))
    initial, final = scores["eval_reward"]
    assert final - initial > MARGIN, scores


def test_the_committed_scene_model_is_the_recipes():
    """tests/data/sd3-scenes is `agg-bench pretrain --config config/pretrain.yaml`'s output (its recorded
    config is what the file resolves to: the model cannot drift from the recipe unnoticed), holds what
    loading needs, and loads as the sweep loads it."""
    from agg_bench.engine.models import load_policy
    from agg_bench.tools.pretrain import MARKER, PretrainConfig, load_pretrain_config

    summary = json.loads((SCENE_MODEL / MARKER).read_text())
    recipe = dataclasses.asdict(load_pretrain_config(ROOT / "config" / "pretrain.yaml"))
    # a key added since the model was made (device) is one the recipe leaves at its default
    defaults = dataclasses.asdict(PretrainConfig())
    assert summary["config"] == {k: v for k, v in recipe.items() if k in summary["config"]}
    assert all(recipe[k] == defaults[k] for k in recipe if k not in summary["config"])
    assert sorted(p.name for p in SCENE_MODEL.iterdir()) == sorted(
        ["transformer", "vae", "scheduler", "token_hash.json", MARKER])
    policy = load_policy("sd3", "pretrained", str(SCENE_MODEL))
    assert sum(p.numel() for p in policy.transformer.parameters()) == summary["parameters"]


@pytest.fixture(scope="module")
def learning_dry_run(tmp_path_factory):
    """One dry run of `make learning`'s target on config/learning.yaml with -p, one core and one GPU in the pool:
    what the dry-run test and the GPU test below read (the GPU in the pool changes nothing of the CPU sweep's
    jobs)."""
    from test_pipeline import snakemake_here, workdir

    # a dry run's plan in this process (no exit code is at stake), with the session's kept methods checks
    work = workdir(tmp_path_factory.mktemp("learning-dry-run"), shared_checks=True)
    proc = snakemake_here(work, "learning", "-n", "-p", "--cores", "1", "--resources", "gpu=1", "--configfile",
                          "config/learning.yaml")
    return work, proc


def test_learning_sweep_dry_run(learning_dry_run):
    """`make learning`'s Snakemake target expands to one pre-training, every method x seed, the gradcheck
    and the learning report, and writes nothing. With one core the pre-training (2 threads in its config)
    runs on the one thread it gets."""
    from test_pipeline import job_counts

    work, proc = learning_dry_run
    assert proc.returncode == 0, proc.stderr + proc.stdout
    counts = job_counts(proc.stdout)
    assert counts["pretrain"] == 1 and counts["gradcheck"] == 1 and counts["learning_report"] == 1
    sweep = yaml.safe_load((ROOT / "config" / "learning.yaml").read_text())
    assert len(sweep["methods"]) == 13 and sweep["seeds"] == [0, 1, 2, 3, 4]
    assert counts["run"] == 2 * 5 + 11 * 3  # full and AGG on 5 seeds, the other 11 methods on 3
    [command] = [line.removeprefix("Shell command:").strip() for line in proc.stdout.splitlines()
                 if "-m agg_bench pretrain" in line]
    assert command.startswith("OMP_NUM_THREADS=1 ") and command.count("--set threads=") == 1
    assert "--set threads=1 " in command
    [report] = [line for line in proc.stdout.splitlines() if "-m agg_bench learning " in line]
    assert "--eval-noises 16 --eval-seed 0 --eval-sampler sde " in report and "--eval-source auto " in report
    assert not (work / "results").exists()


def test_the_gpu_learning_sweeps_pretraining_declares_and_takes_its_gpu(tmp_path, learning_dry_run):
    """config/learning_gpu.yaml pre-trains on CUDA: its pretrain job declares one GPU (which Snakemake and SLURM
    then give it) and takes it from the pool, as a run does; the CPU sweep's declares and takes none."""
    from test_pipeline import gpu_claims, job_resources, snakemake_here, workdir

    def check_claims(proc, gpus):
        assert proc.returncode == 0, proc.stderr + proc.stdout
        claims = gpu_claims(proc.stdout)
        assert [c for c in claims if c[0] == "pretrain"] == [("pretrain", gpus, gpus)], claims
        assert [c for c in claims if c[1] != c[2]] == []

    check_claims(learning_dry_run[1], 0)  # the CPU sweep's, with a GPU in the pool
    work = workdir(tmp_path, shared_checks=True)  # dry runs' plans, in this process: no exit code is at stake
    try:
        import snakemake_executor_plugin_slurm  # noqa: F401
    except ImportError:  # the GPU sweep's claims on the local executor; its SLURM resources need the plugin
        proc = snakemake_here(work, "learning", "-n", "-p", "--cores", "16", "--resources", "gpu=1",
                              "--configfile", "config/learning_gpu.yaml")
        check_claims(proc, 1)
        pytest.skip("pip install 'agg-bench[slurm]'")
    # through SLURM (whose profile prints the shell commands) the GPU pretrain job declares and takes its GPU, and
    # gets the profile's own entry, not the defaults (60 minutes, any GPU)
    proc = snakemake_here(work, "learning", "-n", "--workflow-profile", "workflow/profiles/slurm", "--configfile",
                          "config/learning_gpu.yaml")
    profile = yaml.safe_load((work / "workflow/profiles/slurm/config.yaml").read_text())
    assert profile["printshellcmds"] is True  # what the claims are read from
    check_claims(proc, 1)
    [pretrain] = [resources for rule, resources in job_resources(proc.stdout) if rule == "pretrain"]
    assert {key: pretrain.get(key) for key in profile["set-resources"]["pretrain"]} == \
        {key: str(value) for key, value in profile["set-resources"]["pretrain"].items()}
    assert pretrain["gpu"] == "1"
    assert not (work / "results").exists()


@pytest.mark.parametrize("value, words", [
    # a value the pretrain job is given as the text '7' (its --set quoted): read as the number 7 here, it passed the
    # dry run and failed the job (this one through a snakemake process, its exit code; the other in this process)
    ("{seed: '7'}", "pretrain.sd3-scenes: config error: seed = '7': expected an integer"),
    # the GPU pool gives a job a free device and shows it only that one: a fixed index would be another job's
    ("{device: 'cuda:1'}", "sweep config: pretrain.sd3-scenes: device = 'cuda:1': the pretrain job takes a free "
     "GPU from the GPU pool, as a run job does, and sees only that one; expected cpu or cuda"),
])
def test_a_pretrain_entry_that_its_config_refuses_is_one_line(tmp_path, value, words):
    """A pretrain entry whose config or set the pretrain command refuses ended Snakemake's dry run in an
    InputFunctionException traceback of the job's threads; one line names the entry and the key, nothing is
    written. (Its other refusals, read by the same function, in-process below.)"""
    from test_pipeline import refusal, snakemake, snakemake_here, workdir

    work = workdir(tmp_path, shared_checks=True)
    run = snakemake if value == "{seed: '7'}" else snakemake_here
    kept = set(work.glob(".snakemake/agg-bench/pretrain-*.json"))  # the session's: other sweeps' answers
    proc = run(work, "learning", "-n", "--configfile", "config/learning.yaml", "--config",
               f"pretrain={{sd3-scenes: {{config: config/pretrain.yaml, set: {value}}}}}")
    assert words in refusal(proc), proc.stderr
    assert not (work / "results").exists()
    assert set(work.glob(".snakemake/agg-bench/pretrain-*.json")) == kept  # a refusal is never kept


@pytest.mark.parametrize("value, words", [
    ({"device": "gpu"}, "sweep config: pretrain.sd3-scenes: config error: device = 'gpu': expected cpu, cuda or "
     "cuda:N (N: a GPU index from 0 to 127 in decimal digits, e.g. cuda:1)"),
    ({"threads": -1}, "sweep config: pretrain.sd3-scenes: config error: threads = -1: expected an integer from 0 "
     "to 1024"),
])
def test_a_pretrain_entrys_refusals_name_the_entry_and_the_key(value, words):
    """What the workflow's dry run reads each pretrain entry with, in its child process (the test above shows
    the wiring)."""
    from agg_bench.tools.sweep import check_pretrain_entries

    with pytest.raises(UserError) as err:
        check_pretrain_entries({"sd3-scenes": {"config": str(ROOT / "config" / "pretrain.yaml"), "set": value}})
    assert str(err.value) == words


def test_evaluation_columns_by_hand():
    """The evaluation's gain is each seed's final score minus the pre-trained one (shared by all)."""
    import pandas as pd

    from agg_bench.results.learning_tables import evaluation_columns

    scores = pd.DataFrame([
        {"state": "pre-trained", "method": None, "seed": None, "eval_reward": 0.5, "eval_reward_count": 0.2},
        {"state": "full/0", "method": "full", "seed": 0, "eval_reward": 0.6, "eval_reward_count": 0.4},
        {"state": "full/1", "method": "full", "seed": 1, "eval_reward": 0.7, "eval_reward_count": 0.3},
        {"state": "full/2", "method": "full", "seed": 2, "eval_reward": 0.8, "eval_reward_count": 0.5}])
    row = evaluation_columns(scores, "full")
    gains = np.array([0.6, 0.7, 0.8]) - 0.5
    assert row["eval_initial"] == 0.5 and row["eval_final"] == pytest.approx(0.7)
    assert row["eval_gain"] == pytest.approx(gains.mean()) and row["eval_gain_std"] == pytest.approx(gains.std(ddof=1))
    assert row["eval_gain_over_spread"] == pytest.approx(gains.mean() / gains.std(ddof=1))
    assert row["eval_reward_count_gain"] == pytest.approx(0.2)
    assert evaluation_columns(scores, "agg") == {}


def test_evaluation_on_trained_runs(tmp_path):
    """The held-out evaluation on a 2-step pre-trained model and two 1-iteration runs: every state is
    sampled from the same noise, so a run whose checkpoint holds the pre-trained weights scores exactly
    the pre-trained score (same weights, same noise, same operations: bit-identical), and a trained run's
    images differ; the table and the CLI carry the evaluation columns."""
    import shutil

    import pandas as pd
    import torch

    from agg_bench.config import load_config
    from agg_bench.engine.scenes import all_scenes
    from agg_bench.tools.learning import CheckpointEvaluation, evaluate
    from agg_bench.runtime.train import train
    from agg_bench.tools.pretrain import load_pretrain_config, pretrain

    model = tmp_path / "model"
    pretrain(load_pretrain_config(None, ["steps=2", "batch_size=4", "num_layers=1", "sample_steps=2",
                                         "warmup_steps=1"]), model, progress=False)
    prompts = tmp_path / "p.txt"
    prompts.write_text("\n".join(s.caption for s in all_scenes()[:2]) + "\n")
    entries = []
    for seed in (0, 1):
        cfg = load_config(None, ["model.family=sd3", "model.preset=pretrained", f"model.pretrained={model}",
                                 "model.resolution=32", f"prompts.file={prompts}", "reward.name=scene",
                                 "train.iterations=2", "train.checkpoint_every=2", "train.lr=1e-2",
                                 "sampling.steps=2", "grpo.group_size=2", "progress=false", f"seed={seed}",
                                 # the in-run evaluation with the checkpoint evaluation's settings below
                                 "eval.every=2", "eval.noises=3", "eval.seed=4", "eval.sampler=ode"])
        assert train(cfg, tmp_path / f"run{seed}")["status"] == "ok"
        entries.append({"dir": str(tmp_path / f"run{seed}"), "method": "full", "seed": seed})
    # a run folder whose "final" weights are the pre-trained ones
    shutil.copytree(tmp_path / "run0", tmp_path / "same")
    state = torch.load(tmp_path / "same" / "checkpoint.pt", weights_only=True)
    base = load_pretrained_parameters(model)
    state["parameters"] = {k: base[k] for k in state["parameters"]}
    torch.save(state, tmp_path / "same" / "checkpoint.pt")
    (tmp_path / "same" / "evaluations.jsonl").unlink()  # run0's, not these weights': its table row uses the checkpoint
    entries.append({"dir": str(tmp_path / "same"), "method": "unchanged", "seed": 0})
    manifest = tmp_path / "manifest.json"
    manifest.write_text(json.dumps({"runs": entries}))
    runs = load_runs(manifest)
    evaluation = CheckpointEvaluation(runs, noises=3, seed=4)
    assert len(evaluation.captions) == 6
    scores, images = evaluate(runs, evaluation)
    assert list(scores["state"]) == ["pre-trained", "full/0", "full/1", "unchanged/0"]
    assert torch.equal(images["unchanged/0"], images["pre-trained"])
    assert not torch.equal(images["full/0"], images["pre-trained"])
    # the SDE sampler (the rollouts'), its step noise seeded too: as reproducible per state
    sde_scores, sde_images = evaluate(runs, CheckpointEvaluation(runs, noises=3, seed=4, sampler="sde"))
    assert torch.equal(sde_images["unchanged/0"], sde_images["pre-trained"])
    assert not torch.equal(sde_images["pre-trained"], images["pre-trained"])
    with pytest.raises(UserError, match="sampler"):
        CheckpointEvaluation(runs, sampler="euler")
    # a run's own evaluations are this evaluation of its starting and final weights: the same numbers
    for k, run in enumerate(runs[:2]):
        in_run = run.evaluations.set_index("iteration")["eval_reward"]
        assert list(in_run.index) == [0, 2]
        assert in_run[0] == scores["eval_reward"][0] and in_run[2] == scores["eval_reward"][k + 1]
    table = learning_table(runs, average=1, evaluation=scores).set_index("method")
    assert table.loc["unchanged", "eval_gain"] == 0.0 and table.loc["unchanged", "eval_source"] == "checkpoint"
    assert table.loc["full", "eval_initial"] == scores["eval_reward"][0] and table.loc["full", "eval_source"] == "in-run"
    assert table.loc["full", "eval_gain"] == pytest.approx(scores["eval_reward"][1:3].mean() - scores["eval_reward"][0])
    out = tmp_path / "out"
    assert main(["learning", "--manifest", str(manifest), "--tables", str(out), "--plots", str(out), "--average", "1",
                 "--eval-noises", "3", "--eval-sampler", "sde"]) == 0
    assert "eval_gain_over_spread" in (out / "learning.md").read_text()
    assert (out / "samples.png").is_file() and len((out / "evaluation.csv").read_text().splitlines()) == 5
    assert len((out / "curves.csv").read_text().splitlines()) == 1 + 2 * 2  # the two full runs' evaluations
    assert all((out / f"{name}.png").is_file() for name in ("eval_reward_cost", "eval_reward_cpu", "eval_pareto"))
    assert main(["learning", "--manifest", str(manifest), "--tables", str(out), "--eval-noises", "-1"]) == 2
    # written again without this command's evaluation: the earlier command's evaluation.csv, which the new
    # learning.csv was not made from, goes
    assert main(["learning", "--manifest", str(manifest), "--tables", str(out), "--average", "1"]) == 0
    assert not (out / "evaluation.csv").exists()
    assert set(pd.read_csv(out / "learning.csv")["eval_source"].dropna()) == {"in-run"}
    assert (out / "samples.png").is_file()  # what this command does not write of the other folder's stays
    # the gain from this command's evaluation for every method: with the runs' own settings, the same gain
    assert main(["learning", "--manifest", str(manifest), "--tables", str(tmp_path / "ckpt"), "--average", "1",
                 "--eval-noises", "3", "--eval-seed", "4", "--eval-source", "checkpoint"]) == 0
    ckpt = pd.read_csv(tmp_path / "ckpt" / "learning.csv").set_index("method")
    assert set(ckpt["eval_source"]) == {"checkpoint"}
    assert ckpt.loc["full", "eval_gain"] == pytest.approx(table.loc["full", "eval_gain"], abs=1e-6)


def load_pretrained_parameters(model):
    from agg_bench.engine.models import load_policy

    return load_policy("sd3", "pretrained", str(model)).transformer.state_dict()


def test_a_run_without_records_is_refused_not_dropped(manifest, tmp_path, capsys):
    """A run of the manifest whose metrics.jsonl is empty (killed before its first iteration) was left out of
    the table without a word: its method lost a seed."""
    runs = json.loads(manifest.read_text())["runs"]
    (Path(runs[1]["dir"]) / "metrics.jsonl").write_text("")
    out = tmp_path / "t"
    assert main(["learning", "--manifest", str(manifest), "--tables", str(out), "--average", "2"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "runs[1]" in lines[0] and "holds no record" in lines[0], lines
    assert not out.exists()


@pytest.mark.parametrize("gone", ["folder", "metrics.jsonl"])
def test_a_manifest_run_that_is_not_there_is_named_by_its_entry(manifest, tmp_path, capsys, gone):
    """A manifest entry whose folder is missing (a typo, a moved results folder) said only
    'DIR/metrics.jsonl: no such file', not which entry, nor that the folder itself was not there."""
    import shutil

    runs = json.loads(manifest.read_text())["runs"]
    folder = Path(runs[4]["dir"])
    shutil.rmtree(folder) if gone == "folder" else (folder / "metrics.jsonl").unlink()
    out = tmp_path / "t"
    assert main(["learning", "--manifest", str(manifest), "--tables", str(out), "--average", "2"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and f"manifest {manifest}: runs[4]: " in lines[0], lines
    assert (f"dir {folder}: no such folder; expected a run folder" in lines[0]) == (gone == "folder"), lines
    assert not out.exists()


def with_evaluations(manifest: Path, lines_of) -> list[dict]:
    """The manifest's runs, each given the ``evaluations.jsonl`` of ``lines_of(entry)`` (a list of lines)."""
    runs = json.loads(manifest.read_text())["runs"]
    for entry in runs:
        (Path(entry["dir"]) / "evaluations.jsonl").write_text("".join(json.dumps(line) + "\n"
                                                                      for line in lines_of(entry)))
    return runs


def refused_learning(manifest: Path, out: Path, capsys) -> str:
    assert main(["learning", "--manifest", str(manifest), "--tables", str(out), "--average", "2"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and not out.exists(), lines
    return lines[0]


@pytest.mark.parametrize("key, value", [("eval_reward", 1e308), ("eval_reward", -1e301), ("eval_reward_shape", 1e308),
                                        ("t_eval_cpu_s", 1e305)])
def test_an_evaluation_number_no_run_writes_is_refused(manifest, tmp_path, capsys, key, value):
    """A run ends when an evaluation's mean passes the records' bound (1e300): a line beyond it, which only an edited
    file holds, made the seeds' mean of the gain overflow to inf, with numpy's warnings on stderr and exit 0."""
    with_evaluations(manifest, lambda entry: [{"iteration": 0, "eval_reward": 0.1},
                                              {"iteration": 8, "eval_reward": 0.5, key: value}])
    line = refused_learning(manifest, tmp_path / "t", capsys)
    assert "evaluations.jsonl: line 2" in line and "at most 1e+300 in magnitude" in line, line


@pytest.mark.parametrize("key", ["eval_reward_\x1b[31mred\nline", "eval_reward_Shape", "notes", "t_eval_wall_s",
                                 "eval_" + "x" * 80])
def test_an_evaluation_key_no_run_writes_is_refused(manifest, tmp_path, capsys, key):
    """A sub-score's key names columns of learning.csv and learning.md: an escape sequence and a newline in one went
    into the CSV's header as they were."""
    with_evaluations(manifest, lambda entry: [{"iteration": 0, "eval_reward": 0.1, key: 0.2},
                                              {"iteration": 8, "eval_reward": 0.5, key: 0.3}])
    line = refused_learning(manifest, tmp_path / "t", capsys)
    assert "evaluations.jsonl: line 1: key " in line and "expected iteration, t_eval_s, t_eval_cpu_s or eval_<score>" \
        in line and "\x1b" not in line, line


def test_the_keys_a_run_writes_in_its_evaluations_pass(manifest, tmp_path):
    with_evaluations(manifest, lambda entry: [
        {"iteration": n, "eval_reward": 0.1 + n / 100, **{f"eval_reward_{part}": 0.2 for part in SCENE_PARTS},
         "t_eval_s": 1.0, "t_eval_cpu_s": 1.5} for n in (0, 4, 8)])
    assert main(["learning", "--manifest", str(manifest), "--tables", str(tmp_path / "t"), "--average", "2"]) == 0
    assert "eval_reward_count_gain" in (tmp_path / "t" / "learning.csv").read_text()


def test_a_copied_run_under_another_seed_or_a_run_of_another_method_is_refused(manifest, tmp_path, capsys):
    """A run folder copied and listed under another seed counted as one more seed of its method (its gain twice,
    the spread shrunk); an entry whose method_options name another method than the run's was read as that method's."""
    import shutil

    runs = json.loads(manifest.read_text())["runs"]
    shutil.copytree(runs[0]["dir"], tmp_path / "copy")
    manifest.write_text(json.dumps({"runs": [*runs, {"dir": str(tmp_path / "copy"), "method": "full", "seed": 5}]}))
    line = refused_learning(manifest, tmp_path / "t", capsys)
    assert "runs[6]: seed = 5, but " in line and "copy/metrics.jsonl: record 1 has seed = 0" in line, line
    manifest.write_text(json.dumps({"runs": [{**runs[0], "method_options": {"name": "full"}},
                                             {**runs[1], "method_options": {"name": "branch"}}, *runs[2:]]}))
    line = refused_learning(manifest, tmp_path / "t", capsys)
    assert "runs[1]: method_options.name = 'branch', but " in line and "record 1 has method = 'agg'" in line, line
    # the config.json too, where the records and summary leave the key out
    folder = Path(runs[1]["dir"])
    (folder / "config.json").write_text(json.dumps({"seed": 3}))
    manifest.write_text(json.dumps({"runs": runs}))
    line = refused_learning(manifest, tmp_path / "t", capsys)
    assert "runs[1]: seed = 0, but " in line and "config.json has seed = 3" in line, line
