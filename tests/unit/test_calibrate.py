"""agg-bench calibrate: unit costs of each pass from interleaved repetitions; bad options refused."""
import json
import math
from pathlib import Path

import pytest
import torch

from agg_bench.cli import main
from agg_bench.engine.rollout import rollout
from agg_bench.errors import ConfigError
from agg_bench.methods.base import METHODS as METHOD_REGISTRY
from agg_bench.records import MAX_LABEL
from agg_bench.tools.calibrate import CalibrationConfig
from baselines.full import FullEstimator

ROOT = Path(__file__).resolve().parents[2]
SMALL = ["--config", str(ROOT / "config/run.yaml"), "--set", "model.resolution=32", "--set", "sampling.steps=4",
         "--set", "grpo.prompts_per_iteration=1"]


def test_calibrate_writes_a_unit_cost_per_pass_and_basis(tmp_path, capsys):
    out = tmp_path / "cal.json"
    assert main(["calibrate", *SMALL, "--repeats", "3", "--warmup", "0", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert (result["model"], result["resolution"], result["device"], result["batch"]) == ("sd3-tiny", 32, "cpu", 4)
    # no --method: no method rounds ran, and none are recorded (the default's 9 were)
    assert result["methods"] == {} and result["method_repeats"] is None
    units = result["unit_s_per_sample"]
    assert set(units) == {"forward_nograd", "forward_grad", "backward", "optimizer_step"}
    for kind, by_basis in units.items():
        for basis in ("cpu", "wall"):
            p25, median, p75 = (by_basis[basis][k] for k in ("p25", "median", "p75"))
            assert math.isfinite(median) and median > 0 and p25 <= median <= p75, (kind, basis)
    # each pass also at one latent: a call of n latents costs call + latent * n, exactly the per-sample
    # unit cost times n at the large size (every (sample, step) pair without grad, the batch with)
    per_call = result["unit_s_per_call"]
    assert {kind: per_call[kind]["latents"] for kind in per_call} == {
        "forward_nograd": [4 * 4, 1], "forward_grad": [4, 1], "backward": [4, 1]}
    for kind, entry in per_call.items():
        big = entry["latents"][0]
        for basis in ("cpu", "wall"):
            fit = entry[basis]
            assert fit["call"] >= 0 and fit["latent"] >= 0 and len(fit["median"]) == 2, (kind, basis)
            assert fit["call"] + fit["latent"] * big == pytest.approx(fit["median"][0], rel=1e-12)
            assert fit["median"][0] == pytest.approx(big * units[kind][basis]["median"], rel=1e-9)
    assert json.loads(capsys.readouterr().out)["out"] == str(out)


@pytest.mark.parametrize("key, value", [("repeats", 0), ("repeats", -1), ("repeats", 10 ** 9), ("repeats", 2.5),
                                        ("repeats", True), ("warmup", -1), ("warmup", float("nan"))])
def test_bad_calibration_options_are_refused(key, value):
    with pytest.raises(ConfigError, match=f"calibrate.{key}"):
        CalibrationConfig(**{key: value})


def test_bad_repeats_on_the_command_line_is_exit_2_and_writes_nothing(tmp_path, capsys):
    out = tmp_path / "cal.json"
    assert main(["calibrate", *SMALL, "--repeats", "0", "--out", str(out)]) == 2
    assert "config error: --repeats = 0: expected an integer from 1" in capsys.readouterr().err and not out.exists()


@pytest.mark.parametrize("name", ["cal.txt", "cal", "cal.json.tmp"])
def test_an_out_that_is_no_json_file_is_exit_2_and_writes_nothing(tmp_path, capsys, name):
    """--out cal.txt was written as a calibration that agg-bench report --calibration and the workflow, which
    look for FILE.json, never read; refused in one line, as embed, replay and gradcheck refuse their suffixes."""
    out = tmp_path / name
    assert main(["calibrate", *SMALL, "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].endswith(f"--out {out}: expected a FILE.json path"), err
    assert list(tmp_path.iterdir()) == []


METHODS = ["--method", "full", "{method: {name: full}}",
           "--method", "agg-w4", "{method: {name: agg, window: 4, alpha: sigma}}",
           "--method", "fora", "{method: {name: cached, cache: fora, cache_in: rollout}}",
           "--method", "eta", "{method: {name: full}, sampling.eta: 0.5}"]


def test_calibrate_times_each_methods_train_phase_in_rounds_with_its_counted_passes(tmp_path, capsys):
    out = tmp_path / "cal.json"
    assert main(["calibrate", *SMALL, "--repeats", "2", "--warmup", "1", "--method-repeats", "3", *METHODS,
                 "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    methods = result["methods"]
    assert result["method_repeats"] == 3
    b, steps = 4, 4  # one prompt x a group of 4 images, 4 steps, every step trained
    assert methods["full"]["passes"] == {"forward_nograd": 0, "forward_grad": b * steps, "backward": b * steps}
    # AGG with one group of W=4: a forward with grad and a backward at both ends, W no-grad velocities
    assert methods["agg-w4"]["passes"] == {"forward_nograd": b * steps, "forward_grad": 2 * b, "backward": 2 * b}
    # and the calls that made them: full one per step; AGG one no-grad call over every pair, its 2b endpoints
    # in calls of the batch's size
    assert methods["full"]["calls"] == {"forward_nograd": 0, "forward_grad": steps, "backward": steps}
    assert methods["agg-w4"]["calls"] == {"forward_nograd": 1, "forward_grad": 2, "backward": 2}
    for label in ("full", "agg-w4"):
        timed = methods[label]
        assert timed["replay"] == "as_trained" and timed["optimizer_steps"] == 1
        assert len(timed["cpu_s"]) == len(timed["wall_s"]) == 3 and min(timed["cpu_s"]) > 0
    # a rollout-only cache trains as full on a frozen rollout; a rollout setting needs its own rollout
    assert methods["fora"]["replay"] == "not_applicable" and "cpu_s" not in methods["fora"]
    assert methods["eta"]["replay"] == "not_applicable" and "sampling.eta" in methods["eta"]["replay_note"]
    assert json.loads(capsys.readouterr().out)["methods_timed"] == ["full", "agg-w4"]


@pytest.mark.parametrize("label, held", [
    ("", None), ("a\tb", "U+0009 (category Cc) at character 2"), ("two\nlines", "U+000A (category Cc) at character 4"),
    ("\x1b[31mred", "U+001B (category Cc) at character 1"), ("x" * 201, None),
    # a format character: the row would show 'agg-w3' for the bytes 'agg-\u202e3w'
    ("agg-\u202e3w", "U+202E RIGHT-TO-LEFT OVERRIDE (category Cf) at character 5"),
    ("fu\u200bll", "U+200B ZERO WIDTH SPACE (category Cf) at character 3"),
])
def test_a_method_label_a_table_row_cannot_show_is_exit_2_before_anything_runs(tmp_path, capsys, label, held):
    """A label is a row of the report's tables (records.is_label): 1 to MAX_LABEL printable characters. The line
    names an unprintable character by its code point."""
    out = tmp_path / "cal.json"
    assert main(["calibrate", *SMALL, "--method", label, "{method: {name: full}}", "--out", str(out)]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("agg-bench calibrate: config error: --method = "), lines
    assert f"expected a label of 1 to {MAX_LABEL} printable characters" in lines[0] and not out.exists()
    assert lines[0].endswith("then the overrides" if held is None else f"; it holds {held}"), lines


@pytest.mark.parametrize("label, text, expected", [
    ("a", "{method: {name: full}", "not YAML"),
    ("a", "[1, 2]", "names the method"),
    ("a", "{method: {window: 5}}", "names the method"),
    ("a", "{sampling.eta: 0.5}", "names the method"),
])
def test_bad_method_entries_are_exit_2_before_anything_runs(tmp_path, capsys, label, text, expected):
    out = tmp_path / "cal.json"
    assert main(["calibrate", *SMALL, "--method", label, text, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert expected in err and f"--method {label}" in err and not out.exists()


def test_a_label_given_twice_and_bad_method_repeats_are_refused(tmp_path, capsys):
    out = tmp_path / "cal.json"
    twice = ["--method", "a", "{method: {name: full}}", "--method", "a", "{method: {name: agg}}"]
    assert main(["calibrate", *SMALL, *twice, "--out", str(out)]) == 2
    assert "given twice" in capsys.readouterr().err
    assert main(["calibrate", *SMALL, "--method-repeats", "0", *METHODS[:3], "--out", str(out)]) == 2
    assert "config error: --method-repeats = 0: expected an integer from 1" in capsys.readouterr().err
    assert not out.exists()


def test_method_repeats_without_a_method_is_refused(tmp_path, capsys):
    """--method-repeats without --method timed nothing, and the calibration recorded its rounds all the same."""
    out = tmp_path / "cal.json"
    assert main(["calibrate", *SMALL, "--method-repeats", "3", "--out", str(out)]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("agg-bench calibrate: --method-repeats 3: ") and \
        "it needs --method LABEL OVERRIDES" in lines[0], lines
    assert not out.exists()


@pytest.mark.parametrize("text, expected", [
    ("{method: {name: nosuch}}", "method.name = 'nosuch'"),
    ("{method: {name: agg-w5}}", "method.name = 'agg-w5'"),  # a sweep label given for the method's name
    ("{method: {name: agg, window: 0}}", "method.window"),
    ("{method: {name: agg, window: 8}}", "method.window"),  # longer than the 4 steps: the method's own run check
    ("{method: {name: full}, train.lr: -1}", "train.lr"),
])
def test_a_method_no_run_could_use_is_exit_2_before_anything_is_timed(tmp_path, capsys, monkeypatch, text, expected):
    import agg_bench.runtime.session

    monkeypatch.setattr(agg_bench.runtime.session, "Session", lambda cfg: pytest.fail("timing started"))
    out = tmp_path / "cal.json"
    assert main(["calibrate", *SMALL, "--method", "mine", text, "--out", str(out)]) == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("agg-bench calibrate: --method mine: ") and expected in lines[0]
    assert not any(tmp_path.iterdir())


class GuessEveryOtherVelocity(FullEstimator):
    """``full`` whose rollout forwards the policy on even steps only and reuses the last velocity on odd ones:
    a rollout with half the forwards, as the methods that guess velocities have."""

    name = "test-guess"

    def rollout(self, policy, cond, noise, sigmas, sampling, generator, iteration, group_size):
        last = {}

        def velocity(j, x, t, c):
            if j % 2 == 0:
                last["v"] = policy.velocity(x, t, c)
            return last["v"]

        return rollout(policy, cond, noise, sigmas, sampling.sde, sampling.eta, generator, velocity=velocity)


def test_calibrate_times_each_methods_rollout_in_rounds_with_its_counted_forwards(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(METHOD_REGISTRY, GuessEveryOtherVelocity.name, GuessEveryOtherVelocity)
    out = tmp_path / "cal.json"
    rollout_methods = ["--method", "full", "{method: {name: full}}",
                       "--method", "guess", "{method: {name: test-guess}}",
                       "--method", "fora", "{method: {name: cached, cache: fora, cache_in: rollout}}",
                       "--method", "eta", "{method: {name: full}, sampling.eta: 0.5}",
                       "--method", "steps", "{method: {name: full}, sampling.steps: 2}"]
    assert main(["calibrate", *SMALL, "--repeats", "1", "--warmup", "0", "--method-repeats", "3", *rollout_methods,
                 "--out", str(out)]) == 0
    methods = json.loads(out.read_text())["methods"]
    steps = 4
    # forwards per sample: one per step, but the guessing rollout's every other; FORA's cache skips blocks
    # inside each forward, not forwards
    assert {label: methods[label]["rollout_forwards"] for label in ("full", "guess", "fora", "eta")} == {
        "full": steps, "guess": steps // 2, "fora": steps, "eta": steps}
    for label in ("full", "guess", "fora", "eta"):
        timed = methods[label]
        assert len(timed["rollout_cpu_s"]) == len(timed["rollout_wall_s"]) == 3 and min(timed["rollout_cpu_s"]) > 0
    # the train rounds' keys are all still there, beside the rollout's
    assert methods["full"]["passes"]["backward"] == 4 * steps and len(methods["full"]["cpu_s"]) == 3
    assert methods["fora"]["replay"] == "not_applicable" and "cpu_s" not in methods["fora"]
    # a method that samples on another schedule cannot share the rounds' start
    assert "rollout_cpu_s" not in methods["steps"] and "sampling.steps" in methods["steps"]["rollout_note"]
    assert json.loads(capsys.readouterr().out)["rollouts_timed"] == ["full", "guess", "fora", "eta"]


def test_every_rollout_round_samples_what_the_runs_first_rollout_samples(monkeypatch):
    """Each round gives each method iteration 0's conditioning, x_0 and generator state: ``full``'s rollout in
    every round is the run's own first rollout, bit for bit, and the weights are untouched."""
    from agg_bench.config import load_config
    from agg_bench.runtime.session import Session
    from agg_bench.tools.calibrate import method_overrides, time_rollouts

    cfg = load_config(ROOT / "config/run.yaml", SMALL[3::2])
    session = Session(cfg)
    first = session.collect(0).batch.latents
    weights = [p.detach().clone() for p in session.policy.parameters()]
    sampled, original = [], FullEstimator.rollout

    def kept(self, *args):
        sampled.append(original(self, *args))
        return sampled[-1]

    monkeypatch.setattr(FullEstimator, "rollout", kept)
    parsed = {"full": method_overrides("full", {"method": {"name": "full"}})}
    timed = time_rollouts(session, parsed, CalibrationConfig(method_repeats=2))
    assert len(sampled) == len(timed["full"]["rollout_cpu_s"]) == 2
    for trajectory in sampled:
        assert torch.equal(trajectory.latents, first)
    assert all(torch.equal(p, w) for p, w in zip(session.policy.parameters(), weights))


def test_a_method_that_owns_its_rollout_is_timed_on_a_rollout_of_its_own(tmp_path):
    """branch and guess cannot train a frozen rollout of independent chains (their replay is not
    applicable), so calibrate times their train phase on their own rollout of the run's first iteration:
    the tree's distinct edges, the guessed generations' terms; their rollout rounds count the forwards
    they skip."""
    out = tmp_path / "cal.json"
    assert main(["calibrate", *SMALL, "--repeats", "1", "--warmup", "0", "--method-repeats", "2",
                 "--method", "full", "{method: {name: full}}",
                 "--method", "branch", "{method: {name: branch, branch_factor: 2, branch_points: [0, 2]}}",
                 "--method", "guess", "{method: {name: guess, guessed: 1, guess_from: 2}}",
                 "--out", str(out)]) == 0
    methods = json.loads(out.read_text())["methods"]
    b, steps = 4, 4
    # the tree of one prompt: 2 edges at steps 0 and 1, 4 at steps 2 and 3, each trained once
    assert methods["branch"]["passes"] == {"forward_nograd": 0, "forward_grad": 12, "backward": 12}
    # its rollout: one node at step 0, 2 at step 1, 2 at step 2, 4 at step 3, per sample of the group
    assert methods["branch"]["rollout_forwards"] == (1 + 2 + 2 + 4) / b
    # guess trains every planned term (a guessed one down-weighted); it skips one forward at step 2 (the last
    # step, 3, is never guessed)
    assert methods["guess"]["passes"] == {"forward_nograd": 0, "forward_grad": b * steps, "backward": b * steps}
    assert methods["guess"]["rollout_forwards"] == (b * steps - 1) / b
    # one call per step, whatever its latents: the tree's and the guessing rollout's as many as full's
    for label, latents in (("full", b * steps), ("branch", 1 + 2 + 2 + 4), ("guess", b * steps - 1)):
        assert methods[label]["rollout_passes"] == {"forward_nograd": latents, "forward_grad": 0, "backward": 0}
        assert methods[label]["rollout_calls"] == {"forward_nograd": steps, "forward_grad": 0, "backward": 0}
    assert methods["branch"]["calls"] == {"forward_nograd": 0, "forward_grad": steps, "backward": steps}
    for label in ("branch", "guess"):
        timed = methods[label]
        assert timed["replay"] == "not_applicable" and timed["train_rollout"] == "own"
        assert len(timed["cpu_s"]) == 2 and len(timed["rollout_cpu_s"]) == 2
    assert "train_rollout" not in methods["full"]


def test_the_timed_updates_pay_the_evaluation_average_and_leave_the_session_as_they_found_it(monkeypatch):
    """Each timed update is a run's whole update, train.eval_ema's update of the average among it (counted
    exactly); after the rounds the average, the weights, the optimizer's state and the policy version are the
    session's own again, bit for bit (the rounds moved the average and left it moved)."""
    from helpers import tiny_config

    from agg_bench.engine.moving_average import MovingAverage
    from agg_bench.runtime.session import Session
    from agg_bench.tools.calibrate import method_overrides, time_methods

    session = Session(tiny_config("train.eval_ema=0.5", "train.lr=1e-1"))
    batch = session.collect(0).batch
    session.update(batch)  # an average, moments and a version that are not the starting ones
    average = session.eval_ema
    before = ({n: w.clone() for n, w in average.weights.items()}, average.steps, average.version)
    weights = [p.detach().clone() for p in session.policy.parameters()]
    moments = {k: {n: v.clone() if torch.is_tensor(v) else v for n, v in state.items()}
               for k, state in session.optimizer.state.items()}
    version, estimator, steps_taken = session.policy.version, session.estimator, session.steps_taken
    updates = []
    real_update = MovingAverage.update
    monkeypatch.setattr(MovingAverage, "update", lambda self, *a: (updates.append(self), real_update(self, *a))[1])
    methods = {"full": method_overrides("full", {"method": {"name": "full"}}),
               "agg": method_overrides("agg", {"method": {"name": "agg", "window": 3}})}
    timed = time_methods(session, batch, methods, CalibrationConfig(method_repeats=2, warmup=1))
    assert [timed[label]["optimizer_steps"] for label in methods] == [1, 1]
    assert len(updates) == (1 + 2) * 2 and all(u is average for u in updates)  # rounds x methods x steps
    assert session.eval_ema is average and (average.steps, average.version) == before[1:]
    assert all(torch.equal(average.weights[n], w) for n, w in before[0].items())
    assert all(torch.equal(p, w) for p, w in zip(session.policy.parameters(), weights))
    assert session.optimizer.state.keys() == moments.keys()
    for k, state in moments.items():
        for name, value in state.items():
            assert torch.equal(torch.as_tensor(session.optimizer.state[k][name]), torch.as_tensor(value)), name
    assert (session.policy.version, session.estimator, session.steps_taken) == (version, estimator, steps_taken)


@pytest.mark.parametrize("stepped, inner_epochs", [(0, 1), (2, 2)])
def test_every_timed_round_of_a_moving_average_method_does_the_same_work(monkeypatch, stepped, inner_epochs):
    """nft's old policy, awm's EMA-KL and dgpo's EMA model move with the optimizer steps: the rounds timed the
    average as the previous round left it (dgpo's first round made its old-policy forwards in the second inner
    epoch only, later rounds in both) and as the rollout made it, equal to the policy, so that none of its
    forwards was charged although every iteration of a run after its first makes them. Every round now starts
    from one state, in which the average has moved from the policy: each round's counted passes are equal, and
    hold one forward of the average per trained (sample, time) in each inner epoch (dgpo's reference's too)."""
    from helpers import tiny_config

    from agg_bench.runtime.session import Session
    from agg_bench.tools.calibrate import method_overrides, time_methods

    session = Session(tiny_config("sampling.same_noise_per_group=false", f"train.inner_epochs={inner_epochs}"))
    batch = session.collect(0).batch
    for iteration in range(stepped):  # a policy past the steps whose average's decay is 0
        session.update(batch)
        batch = session.collect(iteration + 1).batch
    rounds = []
    real_update = Session.update

    def update(self, planned):
        before = self.policy.counter.copy()
        result = real_update(self, planned)
        rounds.append((self.estimator.name, (self.policy.counter - before).as_dict()))
        return result

    monkeypatch.setattr(Session, "update", update)
    entries = {"nft": {"old_decay_rate": 0.3}, "awm": {"ema_kl_beta": 1.0, "ema_decay_rate": 0.3},
               "dgpo": {"clip_dsm": True, "ema_decay_rate": 0.3}}
    if inner_epochs > 1:
        del entries["awm"]  # one inner epoch only (its on-policy ratio)
    methods = {name: method_overrides(name, {"method": {"name": name, "times_per_sample": 2, **options}})
               for name, options in entries.items()}
    timed = time_methods(session, batch, methods, CalibrationConfig(method_repeats=3, warmup=1))
    terms = batch.batch_size * 2 * inner_epochs  # trained (sample, time) pairs of one update
    averages = {"nft": 1 if inner_epochs == 1 else 0.5, "awm": 1, "dgpo": 1}  # nft's old velocities: first epoch
    for name in entries:
        counts = [work for label, work in rounds if label == name]
        assert len(counts) == 1 + 3
        reference = terms if name == "dgpo" else 0  # dgpo's frozen starting weights, in every epoch
        expected = {"forward_nograd": reference + int(averages[name] * terms), "forward_grad": terms,
                    "backward": terms}
        assert counts == [expected] * 4, name
        assert timed[name]["passes"] == expected


def test_a_method_that_owns_its_rollout_is_timed_with_the_plan_of_steps_it_sets(tmp_path):
    """A method that owns its rollout and sets the plan of its trained steps beside its method options (branch
    needs `train.plan: steps`, as config/h200.yaml's sets it on a sweep planning groups) had no times: its replay
    refuses a key outside method.*. Its own rollout draws its steps under that plan, and its update is made
    under it: guess at `train.timestep_fraction` 0.5 trains half the steps of each sample."""
    out = tmp_path / "cal.json"
    groups = ["--set", "train.plan=groups", "--set", "train.plan_window=2"]
    assert main(["calibrate", *SMALL, *groups, "--repeats", "1", "--warmup", "0", "--method-repeats", "2",
                 "--method", "full", "{method: {name: full}}",
                 "--method", "branch", "{method: {name: branch, branch_factor: 2, branch_points: [0, 2]}, "
                                       "train.plan: steps}",
                 "--method", "guess", "{method: {name: guess, guessed: 1, guess_from: 2}, train.plan: steps, "
                                      "train.timestep_fraction: 0.5}",
                 "--method", "eta", "{sampling.eta: 0.5, train.plan: steps, "
                                    "method: {name: branch, branch_factor: 2, branch_points: [0, 2]}}",
                 "--out", str(out)]) == 0
    methods = json.loads(out.read_text())["methods"]
    b, steps = 4, 4
    assert methods["branch"]["passes"] == {"forward_nograd": 0, "forward_grad": 12, "backward": 12}
    assert methods["guess"]["passes"] == {"forward_nograd": 0, "forward_grad": b * steps // 2,
                                          "backward": b * steps // 2}
    for label in ("branch", "guess"):
        assert methods[label]["train_rollout"] == "own" and len(methods[label]["cpu_s"]) == 2, methods[label]
    # a rollout key is still its run's own: no times, the replay's refusal as its note
    assert "cpu_s" not in methods["eta"] and "sampling.eta" in methods["eta"]["replay_note"], methods["eta"]
    assert methods["full"]["passes"]["forward_grad"] == b * steps  # the run's plan: 2 groups of 2 steps
