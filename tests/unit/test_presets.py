"""The run configs in config/presets/: each loads as it is and at full size (``model.preset=random``), the
Flow-GRPO preset samples every step and trains the first nine with the KL reference, the Flow-GRPO-Fast preset
keeps the public schedule and trains only its window, and the TeaCache preset keeps the authors' FLUX settings."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from agg_bench.cli import main
from agg_bench.config import load_config
from agg_bench.runtime.config_check import check_config
from agg_bench.io import read_jsonl
from agg_bench.runtime.session import Session

ROOT = Path(__file__).resolve().parents[2]
PRESETS = sorted((ROOT / "config/presets").glob("*.yaml"))


@pytest.mark.parametrize("path", PRESETS, ids=lambda p: p.stem)
def test_every_preset_loads_as_it_is_and_at_full_size(path):
    cfg = check_config(load_config(path))
    assert cfg.method.options is not None
    # a preset of a local model folder runs the public architecture with random weights without the folder
    full = check_config(load_config(path, ["model.preset=random",
                                           *(["model.pretrained=null"] if cfg.model.pretrained else [])]))
    assert full.model.preset == "random" and full.method == cfg.method


# The presets other tools run by name (docs/design.md, "Files and names outside the command line") and the
# method each one runs.
CONTRACT_PRESETS = {"mixgrpo_flash": "mixgrpo_flash", "flow_grpo": "full", "flow_grpo_fast": "window",
                    "branchgrpo": "branch", "guess_ab2": "guess", "diffusionnft": "nft", "awm": "awm", "dgpo": "dgpo",
                    "teacache_flux": "cached"}


def test_the_contract_presets_are_there_and_run_their_method():
    methods = {path.stem: load_config(path).method.name for path in PRESETS}
    assert {name: methods.get(name) for name in CONTRACT_PRESETS} == CONTRACT_PRESETS


def test_flow_grpo_keeps_the_public_recipe():
    """Flow-GRPO's `pickscore_sd3`: 10 steps of its SDE at noise level 0.7, each image its own noise, the batch's
    np.std + 1e-4, ratio clip 1e-4, KL 0.01 in the code's form (no dt), two optimizer steps per epoch and the
    evaluation EMA (decay 0.9, every 8th step, each taken in twice)."""
    cfg = check_config(load_config(ROOT / "config/presets/flow_grpo.yaml"))
    assert (cfg.method.name, cfg.sampling.steps, cfg.sampling.sde, cfg.sampling.eta, cfg.sampling.shift) == (
        "full", 10, "flow_grpo", 0.7, 3.0)
    assert cfg.sampling.same_noise_per_group is False
    assert (cfg.grpo.adv_std, cfg.grpo.adv_ddof, cfg.grpo.adv_eps, cfg.grpo.adv_clip_max) == ("global", 0, 1e-4, 5.0)
    assert (cfg.grpo.clip_range, cfg.grpo.beta, cfg.grpo.kl_form) == (1e-4, 0.01, "no_dt")
    assert (cfg.train.inner_epochs, cfg.train.minibatches, cfg.train.optimizer_steps) == (1, 2, 2)
    assert (cfg.train.eval_ema, cfg.train.eval_ema_every, cfg.train.eval_ema_updates) == (0.9, 8, 2)
    assert (cfg.train.weight_decay, cfg.train.max_grad_norm) == (1e-4, 1.0)


def test_flow_grpo_samples_every_step_and_trains_the_first_nine():
    """Every step is an SDE step with a density (the last too, into sigma 0); the trained steps are
    range(int(10 x 0.99)) = 0..8 for every sample, as the code's loop over num_train_timesteps."""
    cfg = load_config(ROOT / "config/presets/flow_grpo.yaml",
                      ["model.resolution=32", "model.dtype=float64", "telemetry.enabled=false", "progress=false"])
    batch = Session(cfg).collect(0).batch
    assert (batch.log_probs != 0).all() and batch.log_probs.shape == (8, 10)
    assert batch.train_steps.tolist() == [list(range(int(10 * 0.99)))] * 8


def test_flow_grpo_runs_through_the_cli(tmp_path):
    out = tmp_path / "flow_grpo"
    assert main(["run", "--config", str(ROOT / "config/presets/flow_grpo.yaml"), "--set", "train.iterations=1",
                 "--set", "model.resolution=32", "--set", "progress=false", "--out", str(out)]) == 0
    (record,) = read_jsonl(out / "metrics.jsonl")
    b, trained = 4 * 2, 9
    assert record["status"] == "ok" and record["method"] == "full"
    # the rollout's forward per step, and the KL reference's no-grad forward per trained step
    assert record["forward_nograd"] == b * 10 + b * trained
    assert record["forward_grad"] == record["backward"] == b * trained  # one forward with grad + backward each


def test_flow_grpo_fast_keeps_the_public_schedule():
    cfg = check_config(load_config(ROOT / "config/presets/flow_grpo_fast.yaml"))
    assert (cfg.sampling.steps, cfg.sampling.sde, cfg.sampling.eta, cfg.sampling.shift) == (10, "cps_unscaled", 0.8, 3.0)
    assert (cfg.grpo.clip_range, cfg.grpo.beta) == (1e-5, 0.0)
    # two optimizer steps per epoch (the code's gradient_accumulation_steps = num_batches_per_epoch // 2)
    assert (cfg.train.inner_epochs, cfg.train.minibatches, cfg.train.optimizer_steps) == (1, 2, 2)
    # the evaluation EMA of the `*_fast_nocfg` configs (train.ema = True), as Flow-GRPO's
    assert (cfg.train.eval_ema, cfg.train.eval_ema_every, cfg.train.eval_ema_updates) == (0.9, 8, 2)
    options = cfg.method.options
    assert (cfg.method.name, options.window_size, options.window_mode) == ("window", 3, "random")
    assert (options.window_start, options.window_max_start) == (0, 10 // 2 - 3)


def test_teacache_flux_keeps_the_public_flux_settings():
    cfg = check_config(load_config(ROOT / "config/presets/teacache_flux.yaml"))
    options = cfg.method.options
    assert (cfg.model.family, cfg.sampling.steps, cfg.sampling.schedule) == ("flux", 28, "diffusers")
    assert (options.cache, options.cache_in, options.threshold, options.warmup_steps) == ("teacache", "rollout", 0.6, 1)
    assert options.coefficients == [498.651651, -283.781631, 55.8554382, -3.82021401, 0.264230861]
    assert options.trajectory_steps == cfg.sampling.steps  # the last step computes


def test_flow_grpo_fast_samples_cps_in_its_window_only(tmp_path):
    cfg = load_config(ROOT / "config/presets/flow_grpo_fast.yaml",
                      ["model.resolution=32", "model.dtype=float64", "telemetry.enabled=false", "progress=false"])
    session = Session(cfg)
    starts = set()
    for iteration in range(6):
        batch = session.collect(iteration).batch
        stochastic = torch.nonzero(batch.log_probs[0] != 0).flatten().tolist()
        start = session.estimator.last_start
        starts.add(start)
        assert stochastic == list(range(start, start + 3))
        assert batch.train_steps.tolist() == [list(range(start, start + 3))] * batch.batch_size
    assert starts <= {0, 1, 2}


def test_flow_grpo_fast_runs_through_the_cli(tmp_path):
    out = tmp_path / "fast"
    assert main(["run", "--config", str(ROOT / "config/presets/flow_grpo_fast.yaml"), "--set", "train.iterations=1",
                 "--set", "model.resolution=32", "--set", "progress=false", "--out", str(out)]) == 0
    (record,) = read_jsonl(out / "metrics.jsonl")
    b = 4 * 2
    assert record["status"] == "ok" and record["method"] == "window"
    assert record["forward_nograd"] == b * 10  # the rollout: every step forwards
    assert record["train_forward_grad"] == record["train_backward"] == b * 3  # the window's three steps


def test_cps_rollout_never_samples_the_step_into_sigma_zero():
    cfg = load_config(None, ["model.resolution=32", "model.dtype=float64", "sampling.steps=4", "sampling.sde=cps",
                             "grpo.group_size=2", "grpo.prompts_per_iteration=1", "telemetry.enabled=false"])
    session = Session(cfg)
    batch = session.collect(0).batch
    assert (batch.log_probs[:, :3] != 0).all() and (batch.log_probs[:, 3] == 0).all()
    assert batch.train_steps.tolist() == [[0, 1, 2]] * 2
    x, v = batch.latents[:, 3], batch.velocities[:, 3]
    assert torch.equal(batch.latents[:, 4], x + (batch.sigmas[4] - batch.sigmas[3]) * v)
