"""Method `cached`: DiT inference caches in the GRPO rollout and/or training forward, on tiny SD3 and FLUX."""
import csv
import math
from pathlib import Path

import pytest
import torch

from agg_bench.cli import main
from agg_bench.engine.grpo import UpdateStats
from agg_bench.errors import ConfigError
from agg_bench.io import read_jsonl
from agg_bench.methods.base import build_method
from agg_bench.runtime.train import Session
from baselines.caches import CACHES, apply_cache
from helpers import CACHE_NEUTRAL, counted, move_off_policy, relative_error, tiny_config

ROOT = Path(__file__).resolve().parents[2]
RUN_CONFIG = ROOT / "config/run.yaml"
FAMILIES = ("sd3", "flux", "qwenimage")
NAMES = sorted(CACHES)
STEPS, GROUP = 5, 2
SMALL = (f"sampling.steps={STEPS}", f"grpo.group_size={GROUP}")

# Defaults, except the two caches that decide from how much their input changed: on a 5-step trajectory
# of a random tiny model it changes by 30-80% per step, so at their defaults (FBC 0.05, TeaCache 0.2) they
# rightly compute everything. The thresholds below reuse on tiny SD3 and FLUX in float32 and float64.
REUSING = {name: {} for name in NAMES} | {"fbc": {"threshold": 0.8}, "teacache": {"threshold": 1.0}}


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def cached(name: str, cache_in: str, **options):
    return build_method("cached", {"cache": name, "cache_in": cache_in, **options})


def gradient(session: Session, batch) -> tuple[dict, UpdateStats, dict]:
    """The session estimator's gradient on ``batch``, its update statistics and its pass counts."""
    for p in session.policy.parameters():
        p.grad = None
    stats = UpdateStats(batch.clip_range)
    with counted(session.policy) as passes:
        session.estimator.accumulate(session.policy, batch, stats)
    return grads_of(session.policy), stats, passes.as_dict()


def grads_of(policy) -> dict[str, torch.Tensor]:
    """Every parameter's ``.grad``; zero for one the forward never uses (Qwen-Image's last text-stream
    projections), which gets none."""
    return {n: p.grad.clone() if p.grad is not None else torch.zeros_like(p) for n, p in policy.named_parameters()}


def assert_hook_free(transformer) -> None:
    for name, module in transformer.named_modules():
        assert not hasattr(module, "_diffusers_hook"), name
        assert "forward" not in module.__dict__, name


def units_per_call(policy, name: str) -> int:
    """Blocks or attention layers the cache counts per transformer call (from the cache package)."""
    handle = apply_cache(policy.transformer, name, REUSING[name])
    units = len(handle.stats_by_module)
    handle.remove()
    return units


# ----- reuse disabled: exactly `full` -------------------------------------------------------------

@pytest.mark.parametrize("family", FAMILIES)
def test_reuse_disabled_equals_full_exactly(family):
    """cache_in=both with every cache neutral: the same rollout bit for bit, and the same gradient bit for
    bit (every sample trains every step, so the cached walk batches and orders exactly as `full`)."""
    session = Session(tiny_config(*SMALL, family=family))
    reference_batch = session.collect(0).batch
    reference, _, full_counts = gradient(session, reference_batch)
    b = reference_batch.batch_size
    for name in NAMES:
        session.estimator = cached(name, "both", **CACHE_NEUTRAL[name])
        batch = session.collect(0).batch
        assert torch.equal(batch.latents, reference_batch.latents), name
        assert torch.equal(batch.log_probs, reference_batch.log_probs), name
        grads, stats, counts = gradient(session, batch)
        assert all(torch.equal(grads[k], reference[k]) for k in reference), name
        assert stats.ratio_dev == 0.0
        metrics = session.estimator.iteration_metrics()
        assert metrics["offpolicy_gap"] == 0.0, name
        assert metrics["cache_skipped"] == 0 and metrics["cache_computed"] > 0 and metrics["cache_hit_rate"] == 0.0
        # the gap's exact log-probs are extra no-grad forwards, counted
        assert counts == {**full_counts, "forward_nograd": b * STEPS}
        assert_hook_free(session.policy.transformer)


@pytest.mark.parametrize("family", FAMILIES)
def test_reuse_disabled_with_per_sample_steps_and_kl_matches_full(family):
    """Samples train different steps: the cached walk runs every sample at each step up to the last
    trained one (a no-grad forward where no sample trains it), so the sum is taken in another order than
    `full`'s: equal to 1e-12 relative in float64. The KL reference runs outside the cache."""
    session = Session(tiny_config(*SMALL, "train.timestep_fraction=0.4", "grpo.beta=0.1", family=family))
    batch = session.collect(0).batch
    move_off_policy(session.policy)
    session.policy.version += 1
    for p in session.policy.parameters():
        p.grad = None
    stats = UpdateStats(batch.clip_range)
    session.estimator.accumulate(session.policy, batch, stats, session.reference)
    reference = grads_of(session.policy)

    session.estimator = cached("fora", "train", interval=1)
    for p in session.policy.parameters():
        p.grad = None
    cached_stats = UpdateStats(batch.clip_range)
    with counted(session.policy) as counts:
        session.estimator.accumulate(session.policy, batch, cached_stats, session.reference)
    assert relative_error(grads_of(session.policy), reference) <= 1e-12
    assert cached_stats.count == stats.count and cached_stats.ratio_dev == pytest.approx(stats.ratio_dev, rel=1e-12)

    b, n = batch.batch_size, batch.steps_per_sample
    trained = [bool((batch.train_steps == j).any()) for j in range(int(batch.train_steps.max()) + 1)]
    assert not all(trained)  # the walk feeds the cache on some untrained step
    assert counts.as_dict() == {"forward_grad": b * sum(trained), "backward": b * sum(trained),
                                "forward_nograd": b * (len(trained) - sum(trained)) + b * n}  # + reference forwards


# ----- reuse on: skipped work, off-policy gap -------------------------------------------------------

@pytest.mark.parametrize("family", FAMILIES)
def test_caches_skip_work_and_measure_the_offpolicy_gap(family):
    """At (near-)default settings every cache skips counted work; a cached rollout has a positive
    off-policy gap and ratio_dev at the first (exact) update."""
    session = Session(tiny_config(*SMALL, family=family, dtype="float32"))
    for name in NAMES:
        units = units_per_call(session.policy, name) * STEPS
        session.estimator = cached(name, "rollout", **REUSING[name])
        _, stats, _ = gradient(session, session.collect(0).batch)
        metrics = session.estimator.iteration_metrics()
        assert metrics["cache_skipped"] > 0 and metrics["cache_computed"] + metrics["cache_skipped"] == units, name
        assert metrics["cache_hit_rate"] == metrics["cache_hit_rate_rollout"] == metrics["cache_skipped"] / units
        assert metrics["cache_hit_rate_train"] is None
        assert metrics["offpolicy_gap"] > 0 and stats.ratio_dev > 0, name
        assert_hook_free(session.policy.transformer)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("name", ["fbc", "taylorseer"])  # a block cache that decides from data; an attention cache
def test_training_with_the_rollout_cache_reproduces_its_log_probs(family, name):
    """cache_in=both: the training walk feeds the cache the rollout's states in the rollout's order, so the
    first update's ratios are exactly 1 and the gap (from extra no-grad exact forwards, counted) is the
    one measured from the exact training forward of cache_in=rollout."""
    session = Session(tiny_config(*SMALL, family=family, dtype="float32"))
    session.estimator = cached(name, "rollout", **REUSING[name])
    gradient(session, session.collect(0).batch)
    rollout_only = session.estimator.iteration_metrics()

    session.estimator = cached(name, "both", **REUSING[name])
    with counted(session.policy) as counts:
        _, stats, _ = gradient(session, session.collect(0).batch)
    both = session.estimator.iteration_metrics()
    assert stats.ratio_dev == 0.0
    assert both["offpolicy_gap"] == pytest.approx(rollout_only["offpolicy_gap"], rel=1e-6)
    assert both["cache_hit_rate_rollout"] == rollout_only["cache_hit_rate"] and both["cache_hit_rate_train"] > 0
    assert both["cache_computed"] + both["cache_skipped"] == 2 * units_per_call(session.policy, name) * STEPS
    b = session.cfg.grpo.prompts_per_iteration * GROUP
    assert counts.as_dict() == {"forward_nograd": 2 * b * STEPS, "forward_grad": b * STEPS, "backward": b * STEPS}

    session.estimator = cached(name, "both", measure_offpolicy_gap=False, **REUSING[name])
    with counted(session.policy) as passes:
        gradient(session, session.collect(0).batch)
    assert session.estimator.iteration_metrics()["offpolicy_gap"] is None
    assert passes.forward_nograd == b * STEPS  # the rollout's only


# ----- cache_in=train: biased gradient, measured by gradcheck ---------------------------------------

def test_cache_in_train_backpropagates_every_iteration():
    session = Session(tiny_config(*SMALL, "method.name=cached", "method.cache=taylorseer", "method.cache_in=train",
                                  dtype="float32"))
    for iteration in range(2):  # a second update must not reach into the first one's freed graph
        out = session.update(session.collect(iteration).batch)
        metrics = session.estimator.iteration_metrics()
        assert math.isfinite(out["grad_norm"]) and out["grad_norm"] > 0
        assert metrics["cache_hit_rate_train"] > 0 and metrics["cache_hit_rate_rollout"] is None
        # the rollout is exact; the cached training forward is not: its ratio is off 1 from the first update
        assert metrics["offpolicy_gap"] is None and out["ratio_dev"] > 0
    assert session.policy.version == 2


def test_cache_in_train_with_lora_skips_backward_of_fully_reused_steps():
    """With LoRA only adapters train; a step on which FORA reuses every block has no path to them, so its
    forward builds no graph and runs no backward: it counts as a no-grad forward, and no backward; the KL
    reference (the same transformer, adapters off) runs first."""
    session = Session(tiny_config(*SMALL, "train.lora_rank=2", "grpo.beta=0.1", "method.name=cached",
                                  "method.cache=fora", "method.cache_in=train", dtype="float32"))
    with counted(session.policy) as counts:
        batch = session.collect(0).batch
        out = session.update(batch)
    b = batch.batch_size
    reused = sum(1 for j in range(STEPS) if j % 3)  # FORA's default interval 3 reuses steps 1, 2, 4
    assert counts.as_dict() == {"forward_nograd": 2 * b * STEPS + b * reused, "forward_grad": b * (STEPS - reused),
                                "backward": b * (STEPS - reused)}
    assert math.isfinite(out["grad_norm"]) and out["grad_norm"] > 0
    assert_hook_free(session.policy.transformer)


def test_gradcheck_reports_each_training_cache_error(tmp_path):
    out = tmp_path / "gradcheck.csv"
    specs = [",".join([f"cached:cache={name}", "cache_in=train", *(f"{k}={v}" for k, v in REUSING[name].items())])
             for name in NAMES]
    overrides = [*SMALL, "model.resolution=32", "grpo.prompts_per_iteration=2", "model.dtype=float64",
                 "progress=false", "telemetry.enabled=false"]
    args = ["gradcheck", *(a for item in overrides for a in ("--set", item)), "--windows", "2", "--alphas", "index",
            "--route-fracs", "1", *(a for spec in [*specs, "cached:cache=fora,cache_in=rollout"]
                                    for a in ("--methods", spec)), "--out", str(out)]
    assert main(args) == 0
    with open(out, newline="") as fh:
        rows = [row for row in csv.DictReader(fh) if row["method"] == "cached"]
    assert [row["options"].split(",")[0] for row in rows] == [f"cache={name}" for name in NAMES] + ["cache=fora"]
    b = 2 * GROUP
    for row in rows[:-1]:
        error = float(row["relative_error"])
        assert math.isfinite(error) and error > 0, row["options"]  # measured, not claimed small
        assert (int(row["forward_grad"]), int(row["backward"])) == (b * STEPS, b * STEPS)
    assert {row["replay"] for row in rows[:-1]} == {"as_trained"}
    # a rollout cache changes only the rollout, which a frozen rollout cannot show: no numbers, a reason
    assert rows[-1]["replay"] == "not_applicable" and rows[-1]["replay_note"]
    assert rows[-1]["relative_error"] == rows[-1]["cosine_to_full"] == rows[-1]["backward"] == ""


# ----- configuration --------------------------------------------------------------------------------

def test_options_are_checked_with_the_key_named():
    for options, key in [({}, "method.cache"), ({"cache": "deepcache"}, "method.cache"),
                         ({"cache": "fbc", "interval": 2}, "method.interval"),
                         ({"cache": "fora", "interval": 0}, "method.interval"),
                         ({"cache": "fora", "cache_in": "sampling"}, "method.cache_in"),
                         ({"cache": "fora", "intervall": 2}, "method.intervall")]:
        with pytest.raises(ConfigError) as err:
            build_method("cached", options)
        assert err.value.key == key
    assert cached("deltadit", "both", interval=3, block_range=[0, 1]).config.cache_settings() == \
        {"interval": 3, "block_range": [0, 1]}


def test_training_cache_and_gradient_checkpointing_are_refused():
    cfg = tiny_config(*SMALL, "train.gradient_checkpointing=true", dtype="float32")
    for cache_in in ("train", "both"):
        with pytest.raises(ConfigError) as err:
            cached("fora", cache_in).check_run(cfg)
        assert err.value.key == "train.gradient_checkpointing"
    for family in ("sd3", "flux", "qwenimage"):  # every family has the caches
        cached("fora", "both").check_run(tiny_config(*SMALL, family=family, dtype="float32"))


def test_a_trajectory_length_other_than_the_runs_is_refused():
    """A cache told a different step count would force (or anchor its schedule on) a step that is not the last."""
    cfg = tiny_config(*SMALL, dtype="float32")
    for name in ("fora", "teacache"):
        cached(name, "rollout", trajectory_steps=STEPS).check_run(cfg)
        with pytest.raises(ConfigError) as err:
            cached(name, "rollout", trajectory_steps=STEPS + 1).check_run(cfg)
        assert (err.value.key, err.value.value) == ("method.trajectory_steps", STEPS + 1)


def test_fora_branches_on_qwenimage_are_refused_before_a_model_is_built():
    """The run's check (a sweep's dry run, gradcheck before its snapshot) refuses what applying the cache would."""
    for family in ("sd3", "flux"):
        cached("fora", "rollout", reuse="branches").check_run(tiny_config(*SMALL, family=family, dtype="float32"))
    cfg = tiny_config(*SMALL, family="qwenimage", dtype="float32")
    cached("fora", "rollout", reuse="residual").check_run(cfg)
    with pytest.raises(ConfigError) as err:
        cached("fora", "rollout", reuse="branches").check_run(cfg)
    assert (err.value.key, err.value.value) == ("method.reuse", "branches") and "'residual'" in str(err.value)


def test_rollout_cache_runs_with_gradient_checkpointing_on():
    """Checkpointing acts only under grad, so a no-grad cached rollout pauses it; training is exact."""
    session = Session(tiny_config(*SMALL, "train.gradient_checkpointing=true", "method.name=cached",
                                  "method.cache=fora", dtype="float32"))
    out = session.update(session.collect(0).batch)
    assert session.estimator.iteration_metrics()["cache_hit_rate"] > 0 and out["ratio_dev"] > 0
    assert session.policy.transformer.gradient_checkpointing


def test_close_removes_a_cache_left_installed():
    session = Session(tiny_config(*SMALL, dtype="float32"))
    estimator = cached("fora", "rollout")
    with estimator.rollout_hooks(session.policy) as before_step:
        before_step(0, 1000.0)
        assert estimator.handle is not None
        estimator.close()
        assert_hook_free(session.policy.transformer)
    assert_hook_free(session.policy.transformer)


@pytest.mark.parametrize("option, value", [("num_blocks", 1000), ("block_range", "[0,1000]")])
def test_deltadit_runs_past_the_models_blocks_are_refused_before_the_run_writes(tmp_path, capsys, option, value):
    # the tiny SD3 has 2 blocks: known once the model is built, which the run's set-up does before writing
    out = tmp_path / "run"
    sets = ["model.resolution=32", *SMALL, "train.iterations=1", "progress=false", "method.name=cached",
            "method.cache=deltadit", f"method.{option}={value}"]
    capsys.readouterr()
    assert main(["run", "--config", str(RUN_CONFIG), *(a for s in sets for a in ("--set", s)), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"method.{option}" in err and "2 blocks" in err
    assert not out.exists()


# ----- the CLI ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", NAMES)
def test_every_cache_runs_through_agg_bench_run(tmp_path, name):
    sets = ["model.resolution=32", *SMALL, "train.iterations=2", "progress=false", "method.name=cached",
            f"method.cache={name}", "method.cache_in=both",
            *(f"method.{k}={v}" for k, v in REUSING[name].items())]
    out = tmp_path / name
    assert main(["run", "--config", str(RUN_CONFIG), *(a for s in sets for a in ("--set", s)), "--out", str(out)]) == 0
    records = list(read_jsonl(out / "metrics.jsonl"))
    assert [r["status"] for r in records] == ["ok", "ok"]
    assert all(r["cache_hit_rate"] > 0 and r["cache"] == name for r in records)
    assert records[0]["offpolicy_gap"] > 0 and records[0]["ratio_dev"] == 0.0
