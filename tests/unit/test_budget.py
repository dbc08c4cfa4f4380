"""Equal compute inside a run: every record's cumulative `cost` (counted passes x `train.pass_costs`), the
`train.budget` that stops a run where its cost reaches it, and the held-out evaluation every `eval.every`
iterations, which leaves training exactly as it was and is neither counted nor timed with the iterations."""
from __future__ import annotations

import contextlib
import json
from pathlib import Path

import pytest
from test_bad_input import run_fails
from test_resume import learned, signal_at

from agg_bench.config import load_config
from agg_bench.io import read_jsonl
from agg_bench.records import passes_cost
from agg_bench.runtime import train as train_module
from agg_bench.runtime.evaluation import Evaluation
from agg_bench.runtime.train import Interrupted, running_cost, train

# 2 prompts x 2 images, 4 steps, full GRPO with a KL term: per iteration 16 rollout forwards and 16 reference
# forwards without grad, 16 forwards with grad and 16 backwards (per sample)
SMALL = ["model.resolution=32", "sampling.steps=4", "grpo.group_size=2", "grpo.beta=0.04", "progress=false",
         "run_id=budget"]
PRICES = ["train.pass_costs.forward_nograd=1", "train.pass_costs.forward_grad=2.5", "train.pass_costs.backward=4"]
PER_ITERATION = 32 * 1 + 16 * 2.5 + 16 * 4  # 136 cost units


def config(*overrides: str):
    return load_config(None, [*SMALL, *PRICES, *overrides])


def records(out: Path) -> list[dict]:
    return list(read_jsonl(out / "metrics.jsonl"))


def evaluations(out: Path) -> list[dict]:
    return list(read_jsonl(out / "evaluations.jsonl"))


def summary(out: Path) -> dict:
    return json.loads((out / "summary.json").read_text())


def test_the_cost_is_the_counted_passes_at_their_prices(tmp_path):
    train(config("train.iterations=3"), tmp_path / "run")
    recs = records(tmp_path / "run")
    assert [(r["forward_nograd"], r["train_forward_nograd"], r["forward_grad"], r["backward"]) for r in recs] == \
        [(32, 16, 16, 16)] * 3  # the reference's no-grad forwards are the train phase's, and counted
    assert [r["cost"] for r in recs] == [PER_ITERATION, 2 * PER_ITERATION, 3 * PER_ITERATION]
    prices = {"forward_nograd": 1, "forward_grad": 2.5, "backward": 4}
    assert [passes_cost(r, prices) for r in recs] == [PER_ITERATION] * 3


def test_the_budget_stops_after_the_first_iteration_that_reaches_it(tmp_path):
    train(config("train.iterations=6"), tmp_path / "full")
    # 136, 272, 408 ...: a budget of 300 is reached by the third iteration, one of 272 exactly by the second
    for budget, kept in ((300, 3), (272, 2), (1, 1)):
        out = tmp_path / f"budget{budget}"
        train(config("train.iterations=6", f"train.budget={budget}", "train.checkpoint_every=100"), out)
        assert [r["iteration"] for r in records(out)] == list(range(kept))
        assert learned(records(out)) == learned(records(tmp_path / "full"))[:kept]  # the same iterations
        assert (summary(out)["status"], summary(out)["budget_reached"]) == ("ok", True)
        assert summary(out)["checkpoint_iteration"] == kept - 1  # the end of the run is checkpointed
    # train.iterations is the cap when it comes first
    train(config("train.iterations=2", "train.budget=10000"), tmp_path / "cap")
    assert len(records(tmp_path / "cap")) == 2 and summary(tmp_path / "cap")["budget_reached"] is False


def test_resume_continues_the_cost_and_the_evaluations(tmp_path, monkeypatch):
    """Killed in an iteration, then killed in an evaluation: each resumed run writes the records and
    evaluations of the uninterrupted run (timings aside), the cost continued and no evaluation missing."""
    settings = ("train.iterations=6", "train.budget=300", "train.checkpoint_every=1", "eval.every=2",
                "eval.noises=1")
    train(config(*settings), tmp_path / "whole")
    expected, expected_evals = records(tmp_path / "whole"), evaluations(tmp_path / "whole")
    assert [e["iteration"] for e in expected_evals] == [0, 2, 3]  # the start, every 2nd, and the last (budget)
    untimed = lambda evals: [{k: v for k, v in e.items() if not k.startswith("t_")} for e in evals]

    out = tmp_path / "run"
    signal_at(monkeypatch, "collect", 3)  # during iteration 2
    with pytest.raises(Interrupted):
        train(config(*settings), out)
    monkeypatch.undo()
    assert [r["iteration"] for r in records(out)] == [0, 1]
    train(config(*settings), out, resume=True)
    assert learned(records(out)) == learned(expected) and records(out)[-1]["cost"] == 3 * PER_ITERATION
    assert untimed(evaluations(out)) == untimed(expected_evals)

    out = tmp_path / "run2"
    calls = []
    real = Evaluation.evaluate

    def interrupted_second_evaluation(self, keep=0):
        calls.append(1)
        if len(calls) == 2:  # the evaluation after iteration 1 (2 iterations trained)
            raise Interrupted(15)
        return real(self, keep)

    monkeypatch.setattr(Evaluation, "evaluate", interrupted_second_evaluation)
    with pytest.raises(Interrupted):
        train(config(*settings), out)
    monkeypatch.undo()
    assert [e["iteration"] for e in evaluations(out)] == [0] and summary(out)["checkpoint_iteration"] == 1
    train(config(*settings), out, resume=True)  # evaluates the state it starts from first
    assert learned(records(out)) == learned(expected) and untimed(evaluations(out)) == untimed(expected_evals)

    # a finished run whose budget is spent has nothing left to do; a larger budget continues it
    train(config(*settings), out, resume=True)
    assert len(records(out)) == 3 and len(evaluations(out)) == 3
    train(config(*settings[:1], "train.budget=500", *settings[2:]), out, resume=True)
    assert [r["cost"] for r in records(out)] == [k * PER_ITERATION for k in (1, 2, 3, 4)]
    assert [e["iteration"] for e in evaluations(out)] == [0, 2, 3, 4]


def test_a_record_without_cost_continues_from_its_counts():
    prices = {"forward_nograd": 1.0, "forward_grad": 2.0, "backward": 3.0}
    old = [{"forward_nograd": 2, "forward_grad": 1, "backward": 1}] * 2  # written before records had a cost
    assert running_cost(old, prices) == 14.0
    assert running_cost([{"cost": 5.5, "forward_nograd": 0, "forward_grad": 0, "backward": 0}, *old], prices) == 19.5
    assert running_cost([], prices) == 0.0


@pytest.mark.parametrize("method", [[], ['method={"name": "agg", "window": 2, "reuse_rollout_velocity": true}']])
def test_evaluations_leave_training_identical_and_are_not_counted_or_timed(tmp_path, monkeypatch, method):
    train(config("train.iterations=3", *method), tmp_path / "plain")
    inside = []  # whether a Telemetry iteration (what t_iter_s / t_iter_cpu_s time) is open

    real_iteration = train_module.tel.Telemetry.iteration

    @contextlib.contextmanager
    def iteration(self):
        with real_iteration(self) as telemetry:
            inside.append(True)
            try:
                yield telemetry
            finally:
                inside.pop()

    seen = []
    real_sample = Evaluation.sample
    monkeypatch.setattr(train_module.tel.Telemetry, "iteration", iteration)
    monkeypatch.setattr(Evaluation, "sample", lambda self, k: seen.append(bool(inside)) or real_sample(self, k))
    train(config("train.iterations=3", "eval.every=1", "eval.noises=2", *method), tmp_path / "evaluated")
    assert seen == [False] * 4  # the start and after each iteration, never inside a timed iteration
    # every field but timings is the run's without evaluations: its random streams, counts and cost
    assert learned(records(tmp_path / "evaluated")) == learned(records(tmp_path / "plain"))
    evals = evaluations(tmp_path / "evaluated")
    assert [e["iteration"] for e in evals] == [0, 1, 2, 3]
    assert all(e["t_eval_cpu_s"] > 0 and e["t_eval_s"] > 0 for e in evals)
    assert len({e["eval_reward"] for e in evals}) > 1  # the weights change, and so does their score


def test_the_evaluation_samples_the_same_noise_for_the_same_weights(tmp_path):
    """The evaluation's noise comes from eval.seed alone: the same starting weights score the same in
    another run, and another eval.seed gives another score."""
    train(config("train.iterations=1", "eval.every=1", "eval.noises=2", "seed=0"), tmp_path / "a")
    train(config("train.iterations=1", "eval.every=1", "eval.noises=2", "seed=0", "eval.seed=5"), tmp_path / "b")
    first, other = evaluations(tmp_path / "a")[0], evaluations(tmp_path / "b")[0]
    assert first["eval_reward"] != other["eval_reward"]
    train(config("train.iterations=1", "eval.every=1", "eval.noises=2", "seed=0"), tmp_path / "c")
    assert evaluations(tmp_path / "c")[0]["eval_reward"] == first["eval_reward"]


@pytest.mark.parametrize("setting, expected", [
    ("train.budget=0", ["train.budget", "0", "> 0"]),
    ("train.budget=-5", ["train.budget", "-5", "> 0"]),
    ("train.budget=.nan", ["train.budget", "nan", "finite"]),
    ("train.budget=.inf", ["train.budget", "inf", "finite"]),
    ("train.budget=lots", ["train.budget", "lots", "a number or null"]),
    ("train.pass_costs.backward=0", ["train.pass_costs.backward", "0", "> 0"]),
    ("train.pass_costs.forward_grad=-1", ["train.pass_costs.forward_grad", "-1", "> 0"]),
    ("train.pass_costs.forward_nograd=.nan", ["train.pass_costs.forward_nograd", "nan", "finite"]),
    # issue 37: a price of 1e308 made the cost overflow to null, which only an out-of-memory record has
    ("train.pass_costs.backward=1e308", ["train.pass_costs.backward", "1e+308", "<= 1,000,000"]),
    ("train.pass_costs.forward_nograd=1000001", ["train.pass_costs.forward_nograd", "1000001", "<= 1,000,000"]),
    ("train.pass_costs.optimizer_step=1", ["train.pass_costs.optimizer_step", "backward, forward_grad, forward_nograd"]),
    ("eval.every=-1", ["eval.every", "-1", "an integer from 0 to 100,000"]),
    ("eval.sampler=euler", ["eval.sampler", "euler", "ode"]),
    ("eval.batch_size=0", ["eval.batch_size", "0", "an integer from 1 to 4096"]),
    ("eval.batch_size=-3", ["eval.batch_size", "-3", "an integer from 1 to 4096"]),
    ("eval.batch_size=5000", ["eval.batch_size", "5000", "4096"]),
    ("eval.batch_size=2.5", ["eval.batch_size", "2.5", "integer"]),
    ("eval.batch_size=all", ["eval.batch_size", "all", "integer"]),
])
def test_bad_budget_prices_and_evaluation_settings(tmp_path, capsys, setting, expected):
    line = run_fails(tmp_path / "out", capsys, "--set", setting)
    for word in expected:
        assert word in line, (setting, line)


def evaluation_of(session, batch_size: int, noises: int = 4, sampler: str = "sde") -> Evaluation:
    return Evaluation(session.policy, session.prompts, session.cond_all, session.latent_shape, session.sigmas,
                      session.cfg.sampling.sde, session.cfg.sampling.eta, session.reward_fn, noises, 3, sampler,
                      batch_size)


@pytest.mark.parametrize("sampler", ["sde", "ode"])
def test_an_evaluation_in_one_chunk_is_the_single_batch(sampler):
    """At most eval.batch_size images: one call, sampled as one batch of every caption x noise from
    eval.seed (noise, then the SDE's step noise, from one generator), written out here."""
    import torch

    from agg_bench.engine.rollout import rollout
    from agg_bench.runtime.session import Session

    session = Session(config())
    evaluation = evaluation_of(session, batch_size=64, sampler=sampler)
    means, kept = evaluation.evaluate(keep=3)
    prompts = session.prompts
    index = [i for _ in range(4) for i in range(len(prompts))]
    generator = torch.Generator().manual_seed(3)
    noise = torch.randn((len(index), *session.latent_shape), generator=generator, dtype=torch.float32)
    mask = None if sampler == "sde" else torch.zeros(session.sigmas.numel() - 1, dtype=torch.bool)
    latents = rollout(session.policy, session.cond_all[index], noise, session.sigmas, session.cfg.sampling.sde,
                      session.cfg.sampling.eta, generator, sde_mask=mask).latents
    images = session.policy.decode(latents[:, -1].float())
    rewards = session.reward_fn(images, [prompts[i] for i in index])
    assert means["eval_reward"] == float(rewards.detach().float().numpy().mean())
    assert torch.equal(kept, images[:3])


def test_chunks_bound_every_call_and_score_every_image(monkeypatch):
    """More images than eval.batch_size: every model call sees at most batch_size rows (its trajectory is
    all the memory the evaluation holds), the chunks cover every caption x noise once, each chunk is
    reproducible on its own, the means are over every image and the first images are kept."""
    import numpy as np
    import torch

    from agg_bench.runtime.session import Session

    session = Session(config())
    evaluation = evaluation_of(session, batch_size=3)
    n = len(session.prompts) * 4  # every caption x 4 noises, in calls of 3 and the rest
    assert n % 3 and [(c.start, c.stop) for c in evaluation.chunks()] == [(s, min(s + 3, n)) for s in range(0, n, 3)]
    rows = []
    real = type(evaluation.policy).velocity
    monkeypatch.setattr(type(evaluation.policy), "velocity",
                        lambda self, x, t, cond: rows.append(x.shape[0]) or real(self, x, t, cond))
    means, kept = evaluation.evaluate(keep=4)
    assert max(rows) == 3 and sum(rows) == n * (session.sigmas.numel() - 1)
    monkeypatch.undo()
    chunks = [evaluation.sample(k) for k in range(len(evaluation.chunks()))]
    scores = np.concatenate([evaluation.score(images, evaluation.captions[c])["reward"]
                             for images, c in zip(chunks, evaluation.chunks())])
    assert means["eval_reward"] == float(scores.mean())
    assert torch.equal(kept, torch.cat([chunks[0], chunks[1][:1]]))
    assert not torch.equal(chunks[0][:2], chunks[1][:2])  # each chunk its own noise
    assert evaluation.evaluate()[0] == means  # the same weights, the same numbers
