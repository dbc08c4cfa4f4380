"""Timestep-subsampling baselines: `fraction` (random steps per sample) and `window` (SDE window, ODE elsewhere)."""
import pytest
import torch

from agg_bench.cli import main
from agg_bench.engine.sampler import ode_step
from agg_bench.errors import ConfigError
from agg_bench.io import read_jsonl
from agg_bench.methods.base import build_method
from agg_bench.runtime.train import Session, iteration_generator
from helpers import counted, estimator_gradient, move_off_policy, one_graph_gradient, relative_error, tiny_config

STEPS = 6  # sampling.steps in helpers.TINY
SMALL = ["--set", "model.resolution=32", "--set", f"sampling.steps={STEPS}", "--set", "train.iterations=2",
         "--set", "progress=false"]


def window(**options):
    return build_method("window", options)


def starts(estimator, iterations, seed=0):
    return [estimator.window_start(m, STEPS, iteration_generator(seed, m)) for m in range(iterations)]


# ----- window -------------------------------------------------------------------------------

# the options only some window modes read, and those modes
MODE_OPTIONS = {"window_max_start": ("random",), "window_stride": ("progressive",),
                "window_interval": ("progressive",), "window_wrap": ("progressive",)}
OTHER_VALUES = {"window_max_start": 1, "window_stride": 2, "window_interval": 1, "window_wrap": True}


@pytest.mark.parametrize("name", sorted(MODE_OPTIONS))
def test_an_option_of_other_window_modes_is_ignored_and_documented_so(name):
    """Set in a mode that does not read it, it changes no window start (one section switches mode with one
    --set, as the MixGRPO-Flash preset's Flash* variant does), and the option's documentation says it is
    ignored in the other modes rather than leaving a user to find out from the starts."""
    from baselines.subsample import WindowConfig

    for mode in {"fixed", "random", "progressive"} - set(MODE_OPTIONS[name]):
        base = {"window_size": 2, "window_mode": mode, "window_start": 0}
        assert starts(window(**base, **{name: OTHER_VALUES[name]}), 12) == starts(window(**base), 12), mode
    doc = WindowConfig.__dataclass_fields__[name].metadata["doc"]
    modes = " or ".join(f"`{mode}`" for mode in MODE_OPTIONS[name])
    assert doc.startswith(f"{modes} only (ignored in other modes)"), doc


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_window_rollout_is_ode_outside_and_trains_only_the_window(dtype):
    size, start = 3, 2
    session = Session(tiny_config("method.name=window", f"method.window_size={size}", "method.window_mode=fixed",
                                  f"method.window_start={start}", dtype=dtype))
    batch = session.collect(0).batch
    inside = torch.zeros(STEPS, dtype=torch.bool)
    inside[start: start + size] = True

    assert torch.all(batch.log_probs[:, ~inside] == 0)
    assert torch.all(batch.log_probs[:, inside] != 0)
    # bit-identical by construction: the rollout's ODE step is the same two elementwise operations (a product,
    # then a sum, each rounded once; no fused multiply-add) on the same values, whatever the vector width
    for j in range(STEPS):
        x_next = ode_step(batch.velocities[:, j], batch.latents[:, j], batch.sigmas, j)
        if inside[j]:  # SDE noise moved the sample off the ODE path
            assert not torch.equal(x_next, batch.latents[:, j + 1])
        else:
            assert torch.equal(x_next, batch.latents[:, j + 1]), f"step {j} is not the ODE step"
    expected = torch.arange(start, start + size).expand(batch.batch_size, size)
    assert torch.equal(batch.train_steps.cpu(), expected)

    with counted(session.policy) as work:
        session.update(batch)
    b = batch.batch_size
    assert work.as_dict() == {"forward_nograd": 0, "forward_grad": b * size, "backward": b * size}


def test_window_gradient_equals_one_graph_gradient():
    session = Session(tiny_config("method.name=window", "method.window_size=2", "method.window_mode=fixed",
                                  "method.window_start=3"))
    batch = session.collect(0).batch
    move_off_policy(session.policy)
    reference = one_graph_gradient(session.policy, batch)
    grads = estimator_gradient(session, batch)
    assert relative_error(grads, reference) <= 1e-10


def test_progressive_window_moves_every_interval_and_stays_at_the_end():
    est = window(window_size=2, window_mode="progressive", window_start=1, window_stride=2, window_interval=2)
    assert starts(est, 8) == [1, 1, 3, 3, 4, 4, 4, 4]  # 5 would pass T - w = 4: clamped


def test_progressive_window_wraps_to_its_first_start():
    est = window(window_size=2, window_mode="progressive", window_start=1, window_stride=2, window_interval=2,
                 window_wrap=True)
    assert starts(est, 10) == [1, 1, 3, 3, 1, 1, 3, 3, 1, 1]
    est = window(window_size=1, window_mode="progressive", window_start=0, window_stride=1, window_interval=1,
                 window_wrap=True)
    assert starts(est, 8) == [0, 1, 2, 3, 4, 5, 0, 1]


def test_progressive_window_reaches_the_rollout():
    """The trained steps of iteration m are the progressive window of m."""
    session = Session(tiny_config("method.name=window", "method.window_size=2", "method.window_stride=1",
                                  "method.window_interval=1", "grpo.prompts_per_iteration=1",
                                  "model.resolution=16"))
    for m, start in enumerate([0, 1, 2]):
        batch = session.collect(m).batch
        assert torch.equal(torch.nonzero(batch.log_probs[0]).flatten(), torch.tensor([start, start + 1]))
        assert torch.equal(batch.train_steps[0], torch.tensor([start, start + 1]))
        assert session.estimator.iteration_metrics() == {"window_start": start}


def test_fixed_window_never_moves():
    assert starts(window(window_size=3, window_mode="fixed", window_start=2), 5) == [2] * 5


def test_random_window_is_drawn_per_iteration_within_bounds():
    est = window(window_size=2, window_mode="random", window_start=1, window_max_start=3)
    drawn = starts(est, 20)
    assert set(drawn) <= {1, 2, 3} and len(set(drawn)) > 1
    assert drawn == starts(est, 20)  # the iteration generator decides: same seed, same windows
    assert len(set(starts(window(window_size=4, window_mode="random"), 20))) > 1


@pytest.mark.parametrize("override, key", [
    (f"method.window_size={STEPS + 1}", "method.window_size"),
    ("method.window_size=0", "method.window_size"),
    ("method.window_start=5", "method.window_start"),  # window_size 4 leaves starts 0..2
    ("method.window_max_start=3", "method.window_max_start"),
    ("method.window_mode=sliding", "method.window_mode"),
    ("method.window_interval=0", "method.window_interval"),
])
def test_bad_window_is_a_config_error_naming_the_key(override, key):
    with pytest.raises(ConfigError) as err:
        Session(tiny_config("method.name=window", override))
    assert err.value.key == key
    assert "\n" not in str(err.value)


def test_window_longer_than_the_schedule_is_one_line_before_anything_is_written(tmp_path, capsys):
    code = main(["run", *SMALL, "--set", "method.name=window", "--set", f"method.window_size={STEPS + 2}",
                 "--out", str(tmp_path / "x")])
    err = capsys.readouterr().err
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "method.window_size" in lines[0] and "Traceback" not in err
    assert not (tmp_path / "x" / "metrics.jsonl").exists()


def test_window_with_groups_wider_than_the_window_is_refused():
    with pytest.raises(ConfigError) as err:
        Session(tiny_config("method.name=window", "method.window_size=3", "train.plan=groups",
                            "train.plan_window=4"))
    assert err.value.key == "train.plan_window"


# windows that the run would reach, whose steps the plan may not draw: the last step alone with
# train.ignore_last or a cps SDE (its step into sigma 0), or fewer steps than a group of the groups plan
UNTRAINABLE_WINDOWS = [
    ("method.window_size=1", "method.window_mode=fixed", f"method.window_start={STEPS - 1}", "train.ignore_last=true"),
    ("method.window_size=1", "method.window_mode=fixed", f"method.window_start={STEPS - 1}", "sampling.sde=cps"),
    ("method.window_size=1", "method.window_interval=1", f"train.iterations={STEPS}", "train.ignore_last=true"),
    ("method.window_size=2", "method.window_mode=random", "train.plan=groups", "train.plan_window=2",
     "train.ignore_last=true"),
    ("method.window_size=2", f"method.window_end={STEPS}", "method.window_interval=1", f"train.iterations={STEPS}",
     "train.plan=groups", "train.plan_window=2"),
]


@pytest.mark.parametrize("overrides", UNTRAINABLE_WINDOWS)
@pytest.mark.parametrize("name", ["window", "mixgrpo_flash"])
def test_a_window_the_run_reaches_without_a_step_to_train_is_refused(name, overrides):
    cfg = tiny_config(f"method.name={name}", *overrides)
    with pytest.raises(ConfigError) as err:
        build_method(name, cfg.method.given).check_run(cfg)
    assert err.value.key == "method.window_size" and "\n" not in str(err.value)


@pytest.mark.parametrize("overrides", [
    # the progressive window stops one step short of the last, which ignore_last leaves out
    ("method.window_size=1", "method.window_interval=1", f"train.iterations={STEPS - 1}", "train.ignore_last=true"),
    ("method.window_size=2", "method.window_interval=1", f"train.iterations={STEPS}", "train.ignore_last=true"),
    ("method.window_size=2", "method.window_mode=random", "train.plan=groups", "train.plan_window=2"),
])
def test_windows_that_keep_a_step_to_train_are_accepted(overrides):
    cfg = tiny_config("method.name=window", *overrides)
    build_method("window", cfg.method.given).check_run(cfg)


def test_a_progressive_window_reaching_an_untrainable_step_is_refused_before_the_run(tmp_path, capsys):
    # it used to train until the window reached the last step, then end with a config error
    out = tmp_path / "x"
    code = main(["run", *SMALL, "--set", "method.name=window", "--set", "method.window_size=1",
                 "--set", "method.window_interval=1", "--set", f"train.iterations={STEPS}",
                 "--set", "train.ignore_last=true", "--set", "grpo.group_size=2", "--out", str(out)])
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and "method.window_size" in lines[0]
    assert not out.exists()


# ----- fraction -----------------------------------------------------------------------------

@pytest.mark.parametrize("fraction", [0.4, 0.7])
def test_fraction_trains_its_own_random_subset_per_sample(fraction):
    session = Session(tiny_config("method.name=fraction", f"train.timestep_fraction={fraction}",
                                  "grpo.prompts_per_iteration=3"))
    batch = session.collect(0).batch
    n = round(fraction * STEPS)
    assert batch.train_steps.shape == (batch.batch_size, n)
    for row in batch.train_steps.tolist():
        assert row == sorted(set(row)) and 0 <= row[0] and row[-1] < STEPS
    assert len({tuple(r) for r in batch.train_steps.tolist()}) > 1  # not one subset shared by all
    assert torch.all(batch.log_probs != 0)  # every step is stochastic; only training is subsampled


def test_fraction_gradient_equals_one_graph_gradient():
    session = Session(tiny_config("method.name=fraction", "train.timestep_fraction=0.4"))
    batch = session.collect(0).batch
    move_off_policy(session.policy)
    reference = one_graph_gradient(session.policy, batch)
    grads = estimator_gradient(session, batch)
    assert relative_error(grads, reference) <= 1e-10
    b, n = batch.train_steps.shape
    assert n == round(0.4 * STEPS)
    assert session.policy.counter.as_dict() == {"forward_nograd": 0, "forward_grad": b * n, "backward": b * n}


def test_fraction_refuses_the_groups_plan():
    with pytest.raises(ConfigError) as err:
        Session(tiny_config("method.name=fraction", "train.plan=groups", "train.plan_window=2"))
    assert err.value.key == "train.plan" and err.value.value == "groups"


# ----- both through `agg-bench run` ---------------------------------------------------------

@pytest.mark.parametrize("method, options, trained", [
    ("fraction", ["train.timestep_fraction=0.5"], round(0.5 * STEPS)),
    ("window", ["method.window_size=2", "method.window_interval=1"], 2),
])
def test_method_runs_through_the_cli(tmp_path, method, options, trained):
    extra = [a for o in options for a in ("--set", o)]
    out = tmp_path / method
    assert main(["run", *SMALL, "--set", f"method.name={method}", *extra, "--out", str(out)]) == 0
    recs = list(read_jsonl(out / "metrics.jsonl"))
    assert [r["iteration"] for r in recs] == [0, 1]
    b = 4 * 2  # default grpo.group_size * grpo.prompts_per_iteration
    for r in recs:
        assert r["status"] == "ok" and r["method"] == method
        assert r["forward_nograd"] == b * STEPS  # the rollout
        assert r["backward"] == r["forward_grad"] == b * trained
    if method == "window":
        assert [r["window_start"] for r in recs] == [0, 1]
