"""A run whose numbers blow up ends as ``diverged`` with the first number that did, and leaves a folder its readers
take back: an image that is not finite has no reward (the built-in rewards would score it as black), and an
evaluation that is not finite ends the run rather than writing a line no reader accepts."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from agg_bench.cli import main
from agg_bench.config import load_config
from agg_bench.engine.models import Policy
from agg_bench.engine.rewards import build_reward, unscored_if_not_finite
from agg_bench.io import read_jsonl
from agg_bench.machine import fsdp
from agg_bench.reading import RunFolder
from agg_bench.runtime import evaluation as evaluation_module
from agg_bench.runtime.train import train

SMALL = ["model.resolution=32", "sampling.steps=4", "grpo.group_size=2", "grpo.prompts_per_iteration=1",
         "progress=false", "train.iterations=3", "telemetry.enabled=false"]


def summary(out: Path) -> dict:
    return json.loads((out / "summary.json").read_text())


@pytest.mark.parametrize("reward", ["jpeg_compressibility", "smoothness"])
def test_an_image_that_is_not_finite_scores_nan(reward):
    images = torch.rand(3, 3, 8, 8)
    images[1, 0, 2, 3] = math.nan
    images[2, 2, 0, 0] = math.inf
    scores = unscored_if_not_finite(build_reward(reward)(images, ["a"] * 3), images)
    assert torch.isfinite(scores[0]) and scores[1:].isnan().all()


def poison_decode(monkeypatch, call: int) -> None:
    """The ``call``-th decode (from 1) gives its first image a NaN pixel, as a rollout that blew up would."""
    decode, calls = Policy.decode, []

    def poisoned(self, latents):
        images = decode(self, latents)
        calls.append(1)
        if len(calls) == call:
            images = images.clone()
            images[0, 0, 0, 0] = math.nan
        return images

    monkeypatch.setattr(Policy, "decode", poisoned)


@pytest.mark.parametrize("reward", ["jpeg_compressibility", "smoothness"])
def test_a_non_finite_image_ends_the_run_at_its_reward(tmp_path, monkeypatch, reward):
    """JPEG scored the NaN image as a black one and the run went on ok; smoothness's NaN reward made a NaN loss,
    and the run named the loss, the consequence, not the reward."""
    poison_decode(monkeypatch, call=2)  # iteration 1's rollout
    out = tmp_path / "run"
    s = train(load_config(None, [*SMALL, f"reward.name={reward}"]), out)
    assert (s["status"], s["last_good_iteration"], s["error"]) == \
        ("diverged", 0, "non-finite reward_mean at iteration 1")
    recs = list(read_jsonl(out / "metrics.jsonl"))
    assert [(r["status"], r["reward_mean"], r["loss"]) for r in recs[1:]] == [("diverged", None, None)]


@pytest.mark.parametrize("call, last_good, after", [(1, None, "0 iterations"), (2, 0, "1 iteration")])  # the
# starting weights, those after iteration 0
def test_a_non_finite_evaluation_ends_the_run_and_leaves_a_readable_folder(tmp_path, monkeypatch, capsys, call,
                                                                             last_good, after):
    """The evaluation of weights that blew up was written with a null eval_reward, which the run folder's reader
    (and so ``agg-bench learning``) refused."""
    sample, calls = evaluation_module.Evaluation.sample, []

    def poisoned(self, chunk):
        images = sample(self, chunk)
        calls.append(1)
        return images.fill_(math.nan) if len(calls) == call else images

    monkeypatch.setattr(evaluation_module.Evaluation, "sample", poisoned)
    out = tmp_path / "run"
    s = train(load_config(None, [*SMALL, "reward.name=smoothness", "eval.every=1", "eval.noises=1",
                                 "train.checkpoint_every=1"]), out)
    assert (s["status"], s["last_good_iteration"], s["checkpoint_iteration"], s["error"]) == \
        ("diverged", last_good, last_good, f"non-finite eval_reward in the evaluation after {after}")
    folder = RunFolder(out)
    assert [e["iteration"] for e in folder.evaluations() or []] == list(range(call - 1))
    assert [r["status"] for r in folder.records()] == ["ok"] * (call - 1)
    assert main(["report", "--runs", str(out), "--tables", str(tmp_path / "tables")]) == 0


def test_an_optimizer_step_that_blows_up_the_weights_ends_the_run_there(tmp_path, monkeypatch):
    """A finite gradient whose step left a weight infinite ended the run ok: nothing looked at the weights after
    the step, so a last iteration's blow-up showed nowhere (and an earlier one only in the next rollout)."""
    steps = []

    class BlowingUp(torch.optim.AdamW):
        def step(self, closure=None):
            result = super().step(closure)
            steps.append(1)
            if len(steps) == 2:  # iteration 1's (one step per iteration here)
                with torch.no_grad():
                    self.param_groups[0]["params"][0].view(-1)[0] = math.inf
            return result

    monkeypatch.setattr(torch.optim, "AdamW", BlowingUp)
    out = tmp_path / "run"
    s = train(load_config(None, [*SMALL, "train.iterations=2"]), out)
    assert (s["status"], s["last_good_iteration"], s["error"]) == \
        ("diverged", 0, "non-finite parameters after optimizer step 1 of the update at iteration 1")
    assert [r["status"] for r in read_jsonl(out / "metrics.jsonl")] == ["ok", "diverged"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_parameters_finite_sees_one_bad_element_and_no_false_alarm(dtype):
    big = torch.finfo(dtype).max  # finite, though its square (a norm's) is not
    params = [torch.nn.Parameter(torch.full((3, 4), big, dtype=dtype)), torch.nn.Parameter(torch.zeros(5, dtype=dtype))]
    assert fsdp.parameters_finite(params) and fsdp.parameters_finite([])
    for bad in (math.nan, math.inf, -math.inf):
        with torch.no_grad():
            params[1][2] = bad
        assert not fsdp.parameters_finite(params)


def test_a_finite_reward_past_float32_says_why_its_mean_is_not_finite(tmp_path, monkeypatch):
    """A plug-in reward of 1e39 (a float64 number) ended the run with "non-finite reward_mean", as if a reward were
    NaN: the mean is kept in float32, which overflowed."""
    from agg_bench.runtime import session as session_module

    build, calls = session_module.build_reward, []

    def huge_on_second_call(*args, **kwargs):
        reward = build(*args, **kwargs)

        def wrapped(images, prompts):
            calls.append(1)
            out = reward(images, prompts).to(torch.float64)
            return out.fill_(1e39) if len(calls) == 2 else out

        return wrapped

    monkeypatch.setattr(session_module, "build_reward", huge_on_second_call)
    s = train(load_config(None, SMALL), tmp_path / "run")
    assert (s["status"], s["last_good_iteration"]) == ("diverged", 0)
    assert s["error"].startswith("non-finite reward_mean at iteration 1: the rewards are finite, but their mean "
                                 "overflows float32 (largest magnitude 1e+39"), s["error"]
