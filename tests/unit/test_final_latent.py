"""What the likelihood-free methods (nft, awm, dgpo; baselines/final_latent.py) share, checked for each: no
frozen-rollout replay (the command refuses it in one line; gradcheck lists the method without numbers), an
ODE rollout with one noise per image, bad options refused in one line with exit 2, and each paper's preset
running one iteration through the CLI on the tiny model with its counted passes. Each method's own loss,
options and counts: tests/unit/test_<method>.py."""
from __future__ import annotations

import csv
from pathlib import Path

import pytest
import torch
import yaml

from agg_bench.cli import main
from agg_bench.errors import ConfigError, UserError
from agg_bench.io import read_jsonl
from agg_bench.methods.base import build_estimator
from agg_bench.runtime.train import Session
from helpers import tiny_config

ROOT = Path(__file__).resolve().parents[2]
STEPS = 6  # sampling.steps in helpers.TINY
METHODS = ["nft", "awm", "dgpo"]
# preset file, the sets it runs with here, and its forward-with-grad (= backward) passes in one iteration:
# the preset's images (group size x prompts per iteration) x K times each
PRESETS = {
    "nft": ("diffusionnft.yaml", [], 12 * 9),  # 12 images, K = 9 of its 10 steps
    "awm": ("awm.yaml", ["model.resolution=32"], 8 * 6),  # one group of 8, K = 6 discrete times (run at 32 px)
    "dgpo": ("dgpo.yaml", [], 12 * 4),  # 12 images, K = 4 steps at or below sigma_4
}


@pytest.fixture(scope="module")
def snapshot(tmp_path_factory):
    """One frozen rollout of the tiny model (one noise per image, as these methods need)."""
    snap = tmp_path_factory.mktemp("final_latent") / "snap"
    settings = [a for item in ["model.resolution=32", f"sampling.steps={STEPS}", "grpo.group_size=2",
                               "grpo.prompts_per_iteration=1", "progress=false", "telemetry.enabled=false",
                               "sampling.same_noise_per_group=false"]
                for a in ("--set", item)]
    assert main(["snapshot", *settings, "--out", str(snap)]) == 0
    return snap


@pytest.mark.parametrize("method", METHODS)
def test_replay_is_refused_and_gradcheck_lists_it_without_numbers(method, snapshot, tmp_path, capsys):
    cfg = tiny_config(f"method.name={method}", "sampling.same_noise_per_group=false")
    estimator = build_estimator(cfg)
    case = estimator.replay_case(cfg, torch.zeros(STEPS, dtype=torch.bool), 6, torch.Generator())
    assert case.scope == "not_applicable" and case.train_steps is None
    assert case.note.startswith(estimator.paper) and "no per-step GRPO gradient" in case.note
    capsys.readouterr()
    out = tmp_path / "g.safetensors"
    assert main(["replay", str(snapshot), "--method", method, "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "frozen rollout" in err[0] and not out.exists()
    table = tmp_path / "table.csv"
    assert main(["gradcheck", "--snapshot", str(snapshot), "--windows", "2", "--alphas", "index", "--route-fracs",
                 "1", "--methods", method, "--out", str(table)]) == 0
    with open(table, newline="") as fh:
        row = list(csv.DictReader(fh))[-1]
    assert (row["method"], row["replay"], row["relative_error"]) == (method, "not_applicable", "")


@pytest.mark.parametrize("method", METHODS)
def test_ode_rollout_with_one_noise_per_image(method):
    cfg = tiny_config(f"method.name={method}", "sampling.same_noise_per_group=false")
    estimator = build_estimator(cfg)
    assert torch.equal(estimator.sde_mask(0, STEPS, torch.Generator()), torch.zeros(STEPS, dtype=torch.bool))
    with pytest.raises(ConfigError) as err:
        estimator.check_run(tiny_config(f"method.name={method}", "sampling.same_noise_per_group=true"))
    assert err.value.key == "sampling.same_noise_per_group" and f"method '{method}'" in str(err.value)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("method, override, key", [
    *[("nft", override, key) for override, key in [
        ("method.beta=0", "method.beta"),
        ("method.beta=1.5", "method.beta"),
        ("method.times_per_sample=0", "method.times_per_sample"),
        (f"method.times_per_sample={STEPS + 1}", "method.times_per_sample"),  # distinct steps of the schedule
        ("method.time_distribution=logit_normal", "method.time_distribution"),
        ("method.adv_mode=soft", "method.adv_mode"),
        ("method.weighting=none", "method.weighting")]],
    *[("awm", override, key) for override, key in [
        ("method.times_per_sample=0", "method.times_per_sample"),
        ("method.time_distribution=lognorm", "method.time_distribution"),
        ("method.weighting=huber", "method.weighting"),
        ("method.ghuber_power=0", "method.ghuber_power"),
        ("method.advantage_max=0", "method.advantage_max"),
        ("train.inner_epochs=2", "train.inner_epochs")]],  # only the on-policy ratio-1 gradient
    *[("dgpo", override, key) for override, key in [
        ("method.beta=0", "method.beta"),
        ("method.beta=-1", "method.beta"),
        ("method.times_per_sample=0", "method.times_per_sample"),
        ("method.times_per_sample=6", "method.times_per_sample"),  # more than the trunc_steps + 1 = 5 steps
        ("method.trunc_steps=6", "method.trunc_steps"),
        ("method.time_distribution=logit_normal", "method.time_distribution")]],
    *[(method, "sampling.same_noise_per_group=true", "sampling.same_noise_per_group") for method in METHODS],
])
def test_bad_options_are_one_line_exit_2(method, override, key, tmp_path, capsys):
    """Refused when the run is set up (the session) and through the CLI: one line naming the key, exit 2,
    nothing written."""
    with pytest.raises(ConfigError) as err:
        Session(tiny_config(f"method.name={method}", "sampling.same_noise_per_group=false", override))
    assert err.value.key == key and "\n" not in str(err.value)
    out = tmp_path / "x"
    args = [arg for item in ["model.resolution=32", f"sampling.steps={STEPS}", "train.iterations=2", "progress=false",
                             "sampling.same_noise_per_group=false", f"method.name={method}", override]
            for arg in ("--set", item)]
    capsys.readouterr()
    assert main(["run", *args, "--out", str(out)]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and key in lines[0] and "Traceback" not in lines[0]
    assert not out.exists()


@pytest.mark.parametrize("method", METHODS)
def test_preset_runs_one_iteration_through_the_cli(method, tmp_path):
    """The paper's preset as it is, on the tiny model (with model.preset=random it only loads:
    tests/unit/test_presets.py; a run would build the full-size architecture)."""
    name, sets, passes = PRESETS[method]
    out = tmp_path / "preset"
    args = [arg for item in ["train.iterations=1", "progress=false", *sets] for arg in ("--set", item)]
    assert main(["run", "--config", str(ROOT / "config" / "presets" / name), *args, "--out", str(out)]) == 0
    (rec,) = list(read_jsonl(out / "metrics.jsonl"))
    assert rec["status"] == "ok" and rec["method"] == method
    assert rec["train_forward_grad"] == rec["train_backward"] == passes


@pytest.mark.parametrize("method, sets", [
    ("nft", ["method.time_distribution=uniform"]),
    ("awm", []),  # discrete times of the schedule
    ("awm", ["method.time_distribution=uniform"]),
    ("dgpo", ["method.time_distribution=uniform"]),
])
def test_times_per_sample_is_bounded_before_anything_is_allocated(method, sets, monkeypatch):
    """K is at most TIMES_PER_STEP x sampling.steps (24 here): a larger K (or 1e8, which grew a run to 13.7 GB)
    is refused by the method's run check, which a session runs before it builds the model and the workflow's
    method check (snakemake -n) runs for every job."""
    from agg_bench.runtime import session as session_module
    from agg_bench.tools.sweep import check_methods
    from baselines.final_latent import TIMES_PER_STEP

    base = [f"method.name={method}", "sampling.same_noise_per_group=false", *sets]
    bound = TIMES_PER_STEP * STEPS
    cfg = tiny_config(*base, f"method.times_per_sample={bound}")
    build_estimator(cfg).check_run(cfg)  # the bound itself is a run

    def no_model(*args, **kwargs):
        raise AssertionError("the model was built before the method's run check")

    monkeypatch.setattr(session_module, "build_policy", no_model)
    for k in (bound + 1, 10**8):
        with pytest.raises(ConfigError) as err:
            Session(tiny_config(*base, f"method.times_per_sample={k}"))
        assert err.value.key == "method.times_per_sample" and f"[1, {bound}]" in str(err.value)
        pairs = [tuple(item.split("=", 1)) for item in ["model.resolution=32", f"sampling.steps={STEPS}", *base,
                                                        f"method.times_per_sample={k}"]]
        with pytest.raises(UserError, match=f"method.times_per_sample = {k}"):
            check_methods(None, {"the job": [(key, yaml.safe_load(value)) for key, value in pairs]})
