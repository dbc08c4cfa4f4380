"""`train.eval_ema`: the moving average of the trained parameters that evaluations use (DiffusionNFT's `train.ema`),
against a float64 reference of its update rule; the evaluations (in-run and `agg-bench learning`'s of a checkpoint)
take its weights while the rollout and training take the trained ones; a resumed run continues it; the planner
charges its copy; bad values are one line. Runtime: about 25 s on 2 cores."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pandas as pd
import pytest
import torch
from helpers import TINY, crafted_checkpoint, tiny_config

from agg_bench.cli import main
from agg_bench.io import read_jsonl
from agg_bench.runtime.checkpoint import CHECKPOINT_NAME
from agg_bench.runtime.evaluation import Evaluation
from agg_bench.runtime.memplan import plan_memory
from agg_bench.runtime.train import TIMING_KEYS, Session, train

RUN = ["reward.name=smoothness", "eval.every=1", "eval.noises=2", "train.checkpoint_every=1", "train.lr=3e-2"]


def reference_average(start: dict, trained: list[dict], maximum: float, every: int = 1, updates: int = 1) -> dict:
    """The average after ``len(trained)`` optimizer steps, in float64 from the public update rule: the calls
    ``EMAModuleWrapper.step(params, c)`` of DGPO's loop with ``updates`` batches an epoch (one step per epoch; one
    call per batch, the step count c moving at the last): before optimizer step n (1-based) ``updates - 1`` calls
    with c = n - 1 and the weights after step n - 1 (the starting ones for n = 1), after it one with c = n and the
    weights after step n. From the starting weights, a call with (c + 1) divisible by ``every`` (the public
    update_step_interval) takes in its weights w: ``ema <- d ema + (1 - d) w``, ``d = min((1 + c) / (10 + c),
    maximum)``."""
    calls, previous = [], start
    for n, weights in enumerate(trained, 1):
        calls += [(n - 1, previous)] * (updates - 1) + [(n, weights)]
        previous = weights
    ema = {k: v.double().clone() for k, v in start.items()}
    for c, weights in calls:
        if (c + 1) % every:
            continue
        d = min((1 + c) / (10 + c), maximum)
        ema = {k: d * ema[k] + (1 - d) * weights[k].double() for k in ema}
    return ema


def weights(policy) -> dict:
    return {n: p.detach().clone() for n, p in policy.named_parameters()}


def records(out: Path) -> list[dict]:
    return [{k: v for k, v in r.items() if k not in (*TIMING_KEYS, "run_id")} for r in read_jsonl(out / "metrics.jsonl")]


def evaluations(out: Path) -> list[dict]:
    return [{k: v for k, v in e.items() if not k.startswith("t_")} for e in read_jsonl(out / "evaluations.jsonl")]


def test_the_average_follows_its_update_rule_after_every_optimizer_step():
    """Two iterations of two optimizer steps: after them the average equals the float64 reference, its decay
    warming up as (1 + n) / (10 + n) until the cap (drawn so that it binds from the third step); swapping it in
    and out leaves the trained weights as they were, bit for bit."""
    maximum = 0.26 + 0.04 * float(torch.rand(1, dtype=torch.float64))
    session = Session(tiny_config(f"train.eval_ema={maximum!r}", "train.inner_epochs=2", "train.lr=3e-2",
                                  "reward.name=smoothness"))
    start, trained = weights(session.policy), []
    session.optimizer.register_step_post_hook(lambda *args: trained.append(weights(session.policy)))
    for iteration in range(2):
        session.update(session.collect(iteration).batch)
    assert len(trained) == 4 and session.eval_ema.steps == 4 and session.eval_ema.version is None
    expected = reference_average(start, trained, maximum)
    for name, w in session.eval_ema.weights.items():
        torch.testing.assert_close(w, expected[name], rtol=0, atol=1e-14)
    # neither the trained weights, nor the average without the cap, nor one of a constant decay
    live = weights(session.policy)
    uncapped = reference_average(start, trained, 0.999)
    constant = {k: v.double().clone() for k, v in start.items()}
    for w in trained:
        constant = {k: maximum * constant[k] + (1 - maximum) * w[k].double() for k in constant}
    for other in (live, uncapped, constant):
        assert max(float((other[n].double() - expected[n]).abs().max()) for n in expected) > 1e-9
    with session.evaluated_weights():
        assert all(torch.equal(p, session.eval_ema.weights[n]) for n, p in session.policy.named_parameters())
    assert all(torch.equal(p, live[n]) for n, p in session.policy.named_parameters())


def test_the_average_takes_in_every_nth_step_only():
    """``train.eval_ema_every: 3`` (DGPO's ``update_step_interval`` is 8): over six optimizer steps the average
    takes in the weights after steps 2 and 5 only, each with the warm-up decay of its own step count, and equals
    the float64 reference; the every-step average differs."""
    session = Session(tiny_config("train.eval_ema=0.8", "train.eval_ema_every=3", "train.inner_epochs=2",
                                  "train.lr=3e-2", "reward.name=smoothness"))
    start, trained, taken = weights(session.policy), [], []
    session.optimizer.register_step_post_hook(lambda *args: trained.append(weights(session.policy)))
    for iteration in range(3):
        before = session.eval_ema.steps
        session.update(session.collect(iteration).batch)
        taken.append(session.eval_ema.steps != before)
    assert len(trained) == 6 and session.eval_ema.steps == 5 and taken == [True, False, True]
    expected = reference_average(start, trained, 0.8, every=3)
    for name, w in session.eval_ema.weights.items():
        torch.testing.assert_close(w, expected[name], rtol=0, atol=1e-14)
    every_step = reference_average(start, trained, 0.8)
    assert max(float((every_step[n] - expected[n]).abs().max()) for n in expected) > 1e-9


def test_a_qualifying_step_is_taken_in_as_often_as_the_public_loop_calls_ema_step():
    """``train.eval_ema_updates: 3`` (DGPO's ``num_batches_per_epoch`` calls of ``ema.step`` an epoch) with
    ``train.eval_ema_every: 3``, two optimizer steps an iteration, three iterations: after each update the average
    equals the float64 reference of the public calls. Steps 2 and 5 qualify; step 2 is the first update's last, so
    after that update its weights are taken in once (the one-update average's) and twice more before step 3, in the
    next update; at the end the average is not the one-update one."""
    maximum = 0.3 + 0.05 * float(torch.rand(1, dtype=torch.float64))  # binds at step 5 ((1 + 5) / 15 = 0.4)
    session = Session(tiny_config(f"train.eval_ema={maximum!r}", "train.eval_ema_every=3", "train.eval_ema_updates=3",
                                  "train.inner_epochs=2", "train.lr=3e-2", "reward.name=smoothness"))
    start, trained = weights(session.policy), []
    session.optimizer.register_step_post_hook(lambda *args: trained.append(weights(session.policy)))
    close = lambda expected: all(torch.allclose(w, expected[n], rtol=0, atol=1e-14)
                                 for n, w in session.eval_ema.weights.items())
    for iteration in range(3):
        session.update(session.collect(iteration).batch)
        assert close(reference_average(start, trained, maximum, every=3, updates=3)), iteration
        if iteration == 0:  # step 2 taken in once so far
            assert close(reference_average(start, trained, maximum, every=3))
    assert len(trained) == 6 and session.eval_ema.steps == 5
    once = reference_average(start, trained, maximum, every=3)
    assert max(float((once[n] - session.eval_ema.weights[n]).abs().max()) for n in once) > 1e-9


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The same run with and without the average (3 iterations, evaluated and checkpointed after each), the
    trained weights after each iteration (one optimizer step each), and the average's cap."""
    maximum = 0.5 + 0.4 * float(torch.rand(1, dtype=torch.float64))
    folder = tmp_path_factory.mktemp("eval-ema")
    trained: list[dict] = []
    update = Session.update

    def recording(self, batch):
        out = update(self, batch)
        trained.append(weights(self.policy))
        return out

    mp = pytest.MonkeyPatch()
    mp.setattr(Session, "update", recording)
    try:
        train(tiny_config(*RUN, "train.iterations=3", f"train.eval_ema={maximum!r}"), folder / "ema")
        averaged = list(trained)
        trained.clear()
        train(tiny_config(*RUN, "train.iterations=3"), folder / "plain")
    finally:
        mp.undo()
    assert len(averaged) == 3 and all(torch.equal(a[n], b[n]) for a, b in zip(averaged, trained) for n in a)
    return folder, averaged, maximum


def test_evaluations_use_the_average_and_the_rollout_and_training_the_trained_weights(runs):
    folder, trained, maximum = runs
    # every record (rollout rewards, losses, gradients, counts, cost) is the run's without the average
    assert records(folder / "ema") == records(folder / "plain")
    lines, plain = evaluations(folder / "ema"), evaluations(folder / "plain")
    assert [e["iteration"] for e in lines] == [0, 1, 2, 3]
    assert lines[0] == plain[0]  # the average of no step is the starting weights
    # each evaluation line is that of a model holding the reference average of its state
    session = Session(tiny_config(*RUN, "train.iterations=3"))
    start = weights(session.policy)
    for k, line in enumerate(lines):
        reference = reference_average(start, trained[:k], maximum)
        with torch.no_grad():
            for n, p in session.policy.named_parameters():
                p.copy_(reference[n])
        expected = Evaluation.of_session(session).evaluate()[0]["eval_reward"]
        assert math.isclose(line["eval_reward"], expected, rel_tol=1e-9, abs_tol=0)
        if k:  # the trained weights score otherwise, well beyond that tolerance
            assert not math.isclose(plain[k]["eval_reward"], expected, rel_tol=1e-6)
    # the checkpoint holds the trained weights (the plain run's) and the average beside them
    state = torch.load(folder / "ema" / CHECKPOINT_NAME, weights_only=True)
    other = torch.load(folder / "plain" / CHECKPOINT_NAME, weights_only=True)
    assert "eval_ema" not in other
    assert state["parameters"].keys() == other["parameters"].keys()
    assert all(torch.equal(state["parameters"][n], other["parameters"][n]) for n in other["parameters"])
    expected = reference_average(start, trained, maximum)
    assert (state["eval_ema"]["steps"], state["eval_ema"]["version"]) == (3, None)
    for n, w in state["eval_ema"]["weights"].items():
        torch.testing.assert_close(w, expected[n], rtol=0, atol=1e-14)


def test_the_checkpoint_evaluation_takes_the_average(runs):
    """`agg-bench learning` evaluates a run's final checkpoint with the average it holds: the run's own last
    evaluation, exactly (the same weights, noises and sampler); the trained weights' score is another."""
    from agg_bench.results.learning_tables import Run
    from agg_bench.tools.learning import CheckpointEvaluation

    folder, _, _ = runs
    run = lambda name: Run("full", 0, folder / name, pd.DataFrame(read_jsonl(folder / name / "metrics.jsonl")))
    evaluation = CheckpointEvaluation([run("ema")], noises=2, seed=0, sampler="sde")
    for name in ("ema", "plain"):
        means, _ = evaluation.evaluate_weights(run(name))
        last = json.loads((folder / name / "evaluations.jsonl").read_text().splitlines()[-1])
        assert math.isclose(means["eval_reward"], last["eval_reward"], rel_tol=1e-12, abs_tol=0)
    assert evaluations(folder / "ema")[-1]["eval_reward"] != evaluations(folder / "plain")[-1]["eval_reward"]


def test_a_checkpoint_written_again_after_the_records_were_read_is_refused(runs, tmp_path):
    """`agg-bench learning` evaluates the checkpoint of the attempt whose records its tables read: one written
    again since (another process resuming or replacing the run, even with the same bytes) is refused in one line,
    and so is a checkpoint that appeared or went since."""
    import shutil

    from agg_bench.errors import UserError
    from agg_bench.results.learning_tables import load_runs
    from agg_bench.tools.learning import CheckpointEvaluation

    run = tmp_path / "ema"
    shutil.copytree(runs[0] / "ema", run)
    manifest = tmp_path / "manifest.json"
    manifest.write_text(json.dumps({"runs": [{"dir": str(run), "method": "full", "seed": 0}]}))
    loaded = load_runs(manifest)
    evaluation = CheckpointEvaluation(loaded, noises=1, seed=0, sampler="sde")
    assert evaluation.evaluate_weights(loaded[0]) is not None  # the folder as read
    checkpoint = run / CHECKPOINT_NAME
    shutil.copyfile(checkpoint, tmp_path / "copy.pt")
    shutil.move(tmp_path / "copy.pt", checkpoint)  # the same bytes, written again
    with pytest.raises(UserError, match="changed since its records were read"):
        evaluation.evaluate_weights(loaded[0])
    loaded = load_runs(manifest)
    checkpoint.unlink()
    with pytest.raises(UserError, match="changed since its records were read"):
        evaluation.evaluate_weights(loaded[0])


def test_a_resumed_run_continues_the_average(tmp_path):
    """Stopped after 2 of 4 iterations and resumed: records, evaluations and the final checkpoint's average
    (with DiffusionNFT's moving-average old policy beside it) equal the uninterrupted run's; with
    ``train.eval_ema_updates: 2`` the second update of step 2's weights comes after the resume."""
    settings = [*RUN, "train.eval_ema=0.9", "train.eval_ema_updates=2", "sampling.same_noise_per_group=false",
                'method={"name": "nft", "times_per_sample": 2, "old_decay_rate": 0.3, "old_decay_max": 0.6}']
    train(tiny_config(*settings, "train.iterations=4"), tmp_path / "whole")
    train(tiny_config(*settings, "train.iterations=2"), tmp_path / "part")
    train(tiny_config(*settings, "train.iterations=4"), tmp_path / "part", resume=True)
    assert json.loads((tmp_path / "part" / "summary.json").read_text())["resumed_from"] == 1
    assert records(tmp_path / "part") == records(tmp_path / "whole")
    assert evaluations(tmp_path / "part") == evaluations(tmp_path / "whole")
    a, b = (torch.load(tmp_path / name / CHECKPOINT_NAME, weights_only=True)["eval_ema"] for name in ("part", "whole"))
    assert (a["steps"], a["version"]) == (b["steps"], b["version"]) == (4, None)
    assert all(torch.equal(a["weights"][n], b["weights"][n]) for n in b["weights"])


def test_a_run_stopped_in_an_update_before_its_step_resumes_to_the_uninterrupted_average(tmp_path, monkeypatch):
    """With ``train.eval_ema_updates: 2`` a SIGTERM that comes as iteration 2's update starts stops the run at its
    first transformer call, before any optimizer step; the checkpoint then taken (after iteration 1) and the resumed
    run's evaluations and final average equal the uninterrupted run's: the update's deferred take-in of step 2's
    weights, which the resumed run makes again, must not be in that checkpoint."""
    import os
    import signal

    from agg_bench.stopping import Interrupted

    settings = [*RUN, "train.eval_ema=0.9", "train.eval_ema_updates=2", "train.checkpoint_every=3",
                "train.iterations=4"]
    train(tiny_config(*settings), tmp_path / "whole")
    update, calls = Session.update, []

    def signalling(self, batch):
        calls.append(1)
        if len(calls) == 3:
            os.kill(os.getpid(), signal.SIGTERM)
        return update(self, batch)

    monkeypatch.setattr(Session, "update", signalling)
    with pytest.raises(Interrupted):
        train(tiny_config(*settings), tmp_path / "part")
    monkeypatch.undo()
    summary = json.loads((tmp_path / "part" / "summary.json").read_text())
    assert (summary["status"], summary["checkpoint_iteration"]) == ("interrupted", 1)
    train(tiny_config(*settings), tmp_path / "part", resume=True)
    assert records(tmp_path / "part") == records(tmp_path / "whole")
    assert evaluations(tmp_path / "part") == evaluations(tmp_path / "whole")
    a, b = (torch.load(tmp_path / name / CHECKPOINT_NAME, weights_only=True)["eval_ema"] for name in ("part", "whole"))
    assert all(torch.equal(a["weights"][n], b["weights"][n]) for n in b["weights"])


@pytest.mark.parametrize("case", [("sd3", "float32", []), ("flux", "bfloat16", ["train.lora_rank=4"])])
def test_the_planner_charges_one_copy_of_the_trained_parameters(case):
    family, dtype, extra = case
    cfg = tiny_config("sampling.steps=3", *extra, family=family, dtype=dtype)
    averaged = tiny_config("sampling.steps=3", "train.eval_ema=0.9", *extra, family=family, dtype=dtype)
    without, with_average = plan_memory(cfg, suggest=False), plan_memory(averaged, suggest=False)
    session = Session(averaged)
    copy = sum(w.untyped_storage().nbytes() for w in session.eval_ema.weights.values())
    assert copy == sum(p.numel() * p.element_size() for p in session.policy.parameters()) > 0
    assert with_average.bytes["params"] - without.bytes["params"] == copy
    assert with_average.bytes["total_per_gpu"] - without.bytes["total_per_gpu"] == copy
    assert {k: v for k, v in with_average.bytes.items() if k not in ("params", "total_per_gpu")} == \
        {k: v for k, v in without.bytes.items() if k not in ("params", "total_per_gpu")}


BAD = {"0": "> 0", "1": "< 1", "-0.1": "> 0", ".nan": "finite", ".inf": "finite", "1e400": "finite",
       "abc": "a number or null", "true": "a number or null", "[0.9]": "a number or null"}


@pytest.mark.parametrize("key", ["eval_ema_every", "eval_ema_updates"])
@pytest.mark.parametrize("value", ["0", "-8", "2.5", ".nan", "eight", "1e9", "[8]", "null", '""'])
def test_a_bad_interval_or_count_is_one_line_and_nothing_is_written(tmp_path, capsys, key, value):
    out = tmp_path / "out"
    assert main(["run", "--set", "model.resolution=32", "--set", "train.eval_ema=0.9", "--set",
                 f"train.{key}={value}", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"train.{key} = " in err[0] and "Traceback" not in err[0], err
    assert not out.exists()


@pytest.mark.parametrize("key", ["eval_ema_every", "eval_ema_updates"])
def test_an_interval_or_count_without_the_average_is_one_line_and_nothing_is_written(tmp_path, capsys, key):
    """train.eval_ema_every and train.eval_ema_updates do nothing without train.eval_ema: refused, as settings that
    would be ignored."""
    out = tmp_path / "out"
    assert main(["run", "--set", "model.resolution=32", "--set", f"train.{key}=8", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"train.{key} = 8" in err[0] and "train.eval_ema" in err[0], err
    assert not out.exists()


@pytest.mark.parametrize("value", list(BAD))
@pytest.mark.parametrize("verb", ["run", "plan"])
def test_a_bad_value_is_one_line_and_nothing_is_written(tmp_path, capsys, value, verb):
    out = tmp_path / "out"
    args = ["--set", "model.resolution=32", "--set", f"train.eval_ema={value}"]
    assert main([verb, *args, *(["--out", str(out)] if verb == "run" else [])]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "train.eval_ema = " in err[0] and BAD[value] in err[0] and "Traceback" not in err[0], err
    assert not out.exists()
    assert main(["plan", "--set", "model.resolution=32", "--set", "train.eval_ema=0.9"]) == 0  # what is allowed


def test_sharding_with_the_average_is_one_line(tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["run", "--set", "model.resolution=32", "--set", "train.shard=fsdp", "--set", "train.eval_ema=0.9",
                 "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "train.eval_ema = 0.9" in err[0] and "fsdp" in err[0], err
    assert not out.exists()


CRAFTED = {
    "no average": (lambda s: s.pop("eval_ema"), "holds no evaluation average"),
    "weights of another shape": (lambda s: s["eval_ema"]["weights"].__setitem__(
        next(iter(s["eval_ema"]["weights"])), torch.zeros(3)), "does not match the model's trainable parameters"),
    "integer weights": (lambda s: s["eval_ema"]["weights"].__setitem__(
        next(iter(s["eval_ema"]["weights"])), torch.zeros(3, dtype=torch.long)), "eval_ema: expected"),
    "text steps": (lambda s: s["eval_ema"].update(steps="2"), "eval_ema: steps = '2'"),
    "negative version": (lambda s: s["eval_ema"].update(version=-1), "eval_ema: steps"),
}


@pytest.mark.parametrize("case", list(CRAFTED))
def test_a_crafted_average_in_a_checkpoint_is_one_line_and_nothing_is_touched(case, runs, tmp_path, capsys):
    folder, _, maximum = runs
    out = tmp_path / "run"
    change, expected = CRAFTED[case]
    before = crafted_checkpoint(folder / "ema", out, change)
    capsys.readouterr()
    args = [a for o in [*TINY, "model.dtype=float64", *RUN, f"train.eval_ema={maximum!r}", "train.iterations=4"]
            for a in ("--set", o)]
    assert main(["run", *args, "--resume", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and CHECKPOINT_NAME in err[0] and expected in err[0] and "Traceback" not in err[0], err
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()} == before
