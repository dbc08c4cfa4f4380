"""The combination matrix of methods, samplers and train options, kept from rotting: each combination either
runs with the passes its method computes for that schedule (counted by hand below, from the method's
description), or is refused up front in one line naming the key, by `agg-bench run` and by the sweep's check
that `snakemake -n` runs while it parses (:func:`agg_bench.tools.sweep.check_methods`).

Every run: tiny SD3, 32 px, T = 4 steps, one prompt of G = 2 samples (B = 2), one iteration."""
from __future__ import annotations

import math

import pytest
import yaml

from agg_bench.cli import main
from agg_bench.config import load_config
from agg_bench.errors import ConfigError
from agg_bench.io import read_jsonl
from agg_bench.methods.base import build_estimator
from agg_bench.runtime.config_check import check_config
from agg_bench.tools.sweep import SweepError, check_methods

SMALL = ("progress=false", "telemetry.enabled=false", "train.iterations=1", "sampling.steps=4", "grpo.group_size=2",
         "grpo.prompts_per_iteration=1", "model.resolution=32")
T, B = 4, 2
ROLLOUT = B * T  # one no-grad forward per sample and step
AGG3 = ("method.name=agg", "method.window=3", "method.alpha=sigma")
BRANCH = ("method.name=branch", "method.branch_factor=2", "method.branch_points=[0,3]", "grpo.group_size=4")
FINAL = ("sampling.same_noise_per_group=false",)
CPS = ("sampling.sde=cps", "sampling.eta=0.5")

# (overrides, forward_nograd, forward_grad, backward) of the one iteration
ACCEPTED = {
    "full": ((), ROLLOUT, B * T, B * T),
    "full, cps": (CPS, ROLLOUT, B * (T - 1), B * (T - 1)),  # the step into sigma 0 has no density
    "full, ignore_last": (("train.ignore_last=true",), ROLLOUT, B * (T - 1), B * (T - 1)),
    "full, 2 epochs": (("train.inner_epochs=2",), ROLLOUT, 2 * B * T, 2 * B * T),
    "full, 2 slices, micro 1": (("train.minibatches=2", "train.minibatch_unit=slices", "method.micro_batch=1",
                                 "train.ignore_last=true"), ROLLOUT, B * (T - 1), B * (T - 1)),
    "full, beta": (("grpo.beta=0.1",), ROLLOUT + B * T, B * T, B * T),  # the reference's forward per term
    "fraction 0.5": (("method.name=fraction", "train.timestep_fraction=0.5"), ROLLOUT, B * 2, B * 2),
    # W = 3 over steps 0..3: a group [0, 1, 2] (3 no-grad forwards, 2 endpoint passes) and [3] exact
    "agg W3": (AGG3, ROLLOUT + B * 3, B * 3, B * 3),
    "agg W3, linspace": ((*AGG3, "sampling.schedule=linspace"), ROLLOUT + B * 3, B * 3, B * 3),
    "agg W3, ignore_last": ((*AGG3, "train.ignore_last=true"), ROLLOUT + B * 3, B * 2, B * 2),  # [0, 1, 2] only
    "agg W3, cps": ((*AGG3, *CPS), ROLLOUT + B * 3, B * 2, B * 2),
    "agg W3, reuse": ((*AGG3, "method.reuse_rollout_velocity=true"), ROLLOUT, B * 3, B * 3),
    # a root forward at step 0, 2 nodes at steps 1 and 2, 2 forwards at 3 for 4 leaves; 2 + 2 + 2 + 4 transitions
    "branch": (BRANCH, 1 + 2 + 2 + 2, 10, 10),
    "guess": (("method.name=guess", "method.guessed=1"), ROLLOUT - 1, B * T, B * T),  # step 2 of one sample guessed
    "window 4": (("method.name=window", "method.window_size=4"), ROLLOUT, B * T, B * T),
    "cached fora": (("method.name=cached", "method.cache=fora", "method.cache_in=rollout"), ROLLOUT, B * T, B * T),
    # K = int(0.99 T) = 3 times per sample; the old policy is the rollout's (no forward)
    "nft": (("method.name=nft", *FINAL), ROLLOUT, B * 3, B * 3),
    "awm": (("method.name=awm", *FINAL), ROLLOUT, B * 6, B * 6),  # K = 6
}


@pytest.mark.parametrize("case", list(ACCEPTED))
def test_accepted_combination_runs_and_counts_what_it_computes(case, tmp_path):
    overrides, nograd, grad, backward = ACCEPTED[case]
    args = [a for s in (*SMALL, *overrides) for a in ("--set", s)]
    assert main(["run", *args, "--out", str(tmp_path / "run")]) == 0
    (record,) = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert record["status"] == "ok" and math.isfinite(record["loss"]) and math.isfinite(record["grad_norm"])
    assert (record["forward_nograd"], record["forward_grad"], record["backward"]) == (nograd, grad, backward)


REFUSED = [
    (("method.cache=fbc",), "method.cache"),  # a cache's option on a method without one
    (("method.transitions_per_step=2",), "method.transitions_per_step"),
    (("method.name=fraction", "train.plan=groups"), "train.plan"),
    (("method.name=agg", "method.window=5"), "method.window"),  # more than the 4 trained steps
    ((*AGG3, "train.timestep_fraction=0.5"), "method.window"),
    (("method.name=agg", "method.window=4", *CPS), "method.window"),  # cps trains 3 steps
    ((*AGG3, "sampling.steps=6", "method.endpoint_velocity=reuse", "method.route_frac=0.5"),
     "method.endpoint_velocity"),
    (("method.name=branch", "method.branch_points=[0,3]"), "grpo.group_size"),
    ((*BRANCH, *CPS), "method.branch_points"),
    ((*BRANCH, "train.timestep_fraction=0.5"), "train.timestep_fraction"),
    ((*BRANCH, "train.minibatches=2", "train.minibatch_unit=slices"), "train.minibatches"),
    ((*BRANCH, "method.width_pruning=best_per_branch"), "method.width_pruning"),  # no step after the split at 3
    (("method.name=nft", *FINAL, "train.ignore_last=true"), "train.ignore_last"),
    (("method.name=nft", "sampling.same_noise_per_group=true"), "sampling.same_noise_per_group"),
    # the likelihood-free methods train their own times: a fraction of the plan's steps would change nothing
    (("method.name=nft", *FINAL, "train.timestep_fraction=0.6"), "train.timestep_fraction"),
    (("method.name=awm", *FINAL, "train.timestep_fraction=0.6"), "train.timestep_fraction"),
    (("method.name=dgpo", *FINAL, "method.trunc_steps=3", "train.timestep_fraction=0.6"), "train.timestep_fraction"),
    (("method.name=awm", *FINAL, "train.inner_epochs=2"), "train.inner_epochs"),
    (("method.name=awm", *FINAL, "method.sa_solver_tau=0.4"), "method.sa_solver_tau"),
    (("method.name=dgpo", *FINAL), "method.trunc_steps"),  # 4 is not below T = 4
    (("method.name=dgpo", *FINAL, "method.trunc_steps=3", "method.sampler=sana", "sampling.shift=null"),
     "sampling.shift"),
    (("method.name=dgpo", *FINAL, "method.trunc_steps=3", "method.sampler=sana", "sampling.schedule=linspace"),
     "sampling.schedule"),
    (("method.name=mixgrpo_flash", "sampling.shift=null"), "sampling.shift"),
    (("method.name=cached", "method.cache=fora", "method.cache_in=both", "train.gradient_checkpointing=true"),
     "train.gradient_checkpointing"),
    (("method.name=cached", "method.cache=fora", "method.micro_batch=1"), "method.micro_batch"),
    (("method.name=guess", "method.zero_loss_on_guess=true", "train.plan=groups"), "train.plan"),
]


@pytest.mark.parametrize("overrides, key", REFUSED, ids=[" ".join(o) for o, _ in REFUSED])
def test_refused_combination_is_one_line_naming_the_key_in_the_run_and_the_sweep(overrides, key):
    with pytest.raises(ConfigError) as err:
        cfg = check_config(load_config(None, [*SMALL, *overrides]))
        build_estimator(cfg).check_run(cfg)
    assert err.value.key == key and "\n" not in str(err.value)
    job = [(k, yaml.safe_load(v)) for k, v in (s.split("=", 1) for s in (*SMALL, *overrides))]
    with pytest.raises(SweepError, match=f"job: config error: {key} = "):
        check_methods(None, {"job": job})


def test_a_refused_combination_leaves_nothing(tmp_path, capsys):
    """Through the command line: exit 2, one line, no folder."""
    overrides = (*BRANCH, "method.width_pruning=best_per_branch")
    args = [a for s in (*SMALL, *overrides) for a in ("--set", s)]
    assert main(["run", *args, "--out", str(tmp_path / "run")]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "method.width_pruning" in lines[0] and not (tmp_path / "run").exists()
