"""train.minibatches: several optimizer steps per epoch, one per mini-batch of whole prompt groups or of slices
of every group (train.minibatch_unit).

- the rows of each mini-batch (groups dealt in order, or every group's k-th slice) and a TrainBatch's rows (every
  field, by name);
- M > 1 mini-batches are M sequential optimizer steps, each on the gradient of its own mini-batch's loss:
  compared in float64 with plain-SGD steps written here on the one-graph gradient of the paper's GRPO loss
  (``full``) and of the AGG rule written out (``agg``), on fresh random weights and rollouts;
- the optimizer steps a record and a calibration count (inner_epochs x minibatches), and the passes, which
  mini-batches do not change;
- bad values: one line naming the key, exit 2, nothing written; the methods that cannot split their batch refuse.
"""
from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest
import torch

from agg_bench.cli import main
from agg_bench.config import check_data_parallel, load_config
from agg_bench.engine.grpo import ROW_FIELDS, TrainBatch, minibatch_rows
from agg_bench.engine.models import Conditioning
from agg_bench.errors import ConfigError
from agg_bench.io import read_jsonl
from agg_bench.results.loading import RunEntry, load_records
from agg_bench.runtime.checkpoint import read_checkpoint
from agg_bench.runtime.memplan import run_layout
from agg_bench.runtime.session import Session
from agg_bench.runtime.train import train
from helpers import (agg_loss_and_gradient, fresh_seed, linearity_reference, one_graph_loss_and_gradient, relative_error,
                     tiny_config)

ROOT = Path(__file__).resolve().parents[2]
RUN = ["run", "--config", str(ROOT / "config" / "run.yaml"), "--set", "model.resolution=32",
       "--set", "sampling.steps=4", "--set", "train.iterations=1", "--set", "progress=false"]
# fields a mini-batch shares with its rollout: the schedule and the settings
SHARED_FIELDS = ("sigmas", "timesteps", "sde", "eta", "clip_range", "beta", "policy_version", "kl_form",
                 "clip_gradient")


# ----- which rows ------------------------------------------------------------------------------------------
def test_groups_are_dealt_in_order_into_the_minibatches():
    """Group g goes to mini-batch g mod M; each mini-batch's rows in increasing order; M = 1 is every row."""
    rows = [r.tolist() for r in minibatch_rows(12, 3, 2)]  # 4 groups of 3
    assert rows == [[0, 1, 2, 6, 7, 8], [3, 4, 5, 9, 10, 11]]
    assert [r.tolist() for r in minibatch_rows(12, 3, 4)] == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9, 10, 11]]
    assert [r.tolist() for r in minibatch_rows(12, 3, 1)] == [list(range(12))]
    # a data-parallel process's k-th mini-batch is part of the single-process one: 8 groups of 2 over 2 processes
    single = [set(r.tolist()) for r in minibatch_rows(16, 2, 2)]
    for rank in range(2):
        for k, local in enumerate(minibatch_rows(8, 2, 2)):
            assert {rank * 8 + int(i) for i in local} <= single[k]
    for b, g, m in ((12, 3, 3), (12, 5, 1), (12, 3, 5)):
        with pytest.raises(ValueError):
            minibatch_rows(b, g, m)


def test_slices_cut_every_group_into_consecutive_slices():
    """unit slices: mini-batch k holds the k-th of M consecutive slices of every group (MixGRPO's step after every
    3 of a group's 12 samples: 4 mini-batches of 3 rows); a data-parallel process's k-th is part of the single
    process's k-th."""
    assert [r.tolist() for r in minibatch_rows(12, 12, 4, "slices")] == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9, 10, 11]]
    assert [r.tolist() for r in minibatch_rows(12, 6, 3, "slices")] == [[0, 1, 6, 7], [2, 3, 8, 9], [4, 5, 10, 11]]
    assert [r.tolist() for r in minibatch_rows(12, 6, 1, "slices")] == [list(range(12))]
    single = [set(r.tolist()) for r in minibatch_rows(24, 6, 3, "slices")]
    for rank in range(2):
        locals_ = minibatch_rows(12, 6, 3, "slices")
        for k, local in enumerate(locals_):
            assert {rank * 12 + int(i) for i in local} <= single[k]
    for b, g, m in ((12, 6, 4), (12, 5, 1)):
        with pytest.raises(ValueError):
            minibatch_rows(b, g, m, "slices")


def synthetic_batch(b: int = 6, steps: int = 4, n: int = 2) -> TrainBatch:
    """A TrainBatch whose every optional field is set (per-step advantages, transitions, guessed velocities)."""
    gen = torch.Generator().manual_seed(fresh_seed())
    rand = lambda *shape: torch.randn(*shape, generator=gen, dtype=torch.float64)
    cond = Conditioning(rand(b, 5, 7), rand(b, 3), torch.randint(0, 2, (b, 5), generator=gen))
    return TrainBatch(
        latents=rand(b, steps + 1, 2, 4, 4), log_probs=rand(b, steps), sigmas=torch.linspace(1, 0, steps + 1,
        dtype=torch.float64), timesteps=torch.linspace(1000, 250, steps, dtype=torch.float64),
        advantages=rand(b, steps), train_steps=torch.stack([torch.randperm(steps, generator=gen)[:n].sort().values
                                                            for _ in range(b)]),
        cond=cond, sde="flow_grpo", eta=0.7, clip_range=0.2, beta=0.04, velocities=rand(b, steps, 2, 4, 4),
        policy_version=5, kl_form="no_dt", transitions=torch.randint(0, 9, (b, steps), generator=gen),
        forwarded=torch.rand(b, steps, generator=gen) > 0.5)


def test_take_rows_takes_every_per_sample_field_and_keeps_the_rest():
    batch = synthetic_batch()
    names = {f.name for f in dataclasses.fields(TrainBatch)}
    # every field is either the samples' or the rollout's: a new field must be put in one of the two
    assert set(ROW_FIELDS) | set(SHARED_FIELDS) == names and not set(ROW_FIELDS) & set(SHARED_FIELDS)
    rows = torch.tensor([4, 1, 5])
    part = batch.take_rows(rows)
    for name in ROW_FIELDS:
        value, taken = getattr(batch, name), getattr(part, name)
        if isinstance(value, Conditioning):
            for key, tensor in value.tensors().items():
                assert torch.equal(taken.tensors()[key], tensor[rows]), key
        else:
            assert torch.equal(taken, value[rows]), name
    for name in SHARED_FIELDS:
        assert getattr(part, name) is getattr(batch, name), name
    assert part.batch_size == 3 and part.loss_scale == 1.0 / (3 * 2)
    assert part.advantage(torch.tensor([0, 2]), torch.tensor([1, 3])).tolist() == \
        [float(batch.advantages[4, 1]), float(batch.advantages[5, 3])]
    without = dataclasses.replace(batch, velocities=None, transitions=None, forwarded=None)
    taken = without.take_rows(rows)
    assert taken.velocities is None and taken.transitions is None and taken.forwarded is None


def test_a_subclass_keeps_its_own_fields():
    from baselines.branch import TreeBatch

    batch = synthetic_batch()
    tree = TreeBatch(**{f.name: getattr(batch, f.name) for f in dataclasses.fields(TrainBatch)}, trained=7)
    part = tree.take_rows(torch.tensor([0, 1]))
    assert type(part) is TreeBatch and part.trained == 7 and part.loss_scale == 1 / 7


# ----- several mini-batches: sequential steps on each one's loss -----------------------------------------------
def minibatch_of(k: int, cfg) -> list[int]:
    """Mini-batch k's rows, written out: the rows of groups k, k + M, k + 2M, ... in order (groups), or the k-th
    of M slices of every group (slices)."""
    g, m = cfg.grpo.group_size, cfg.train.minibatches
    if cfg.train.minibatch_unit == "slices":
        width = g // m
        return [group * g + k * width + i for group in range(cfg.grpo.prompts_per_iteration) for i in range(width)]
    return [group * g + i for group in range(k, cfg.grpo.prompts_per_iteration, m) for i in range(g)]


def sgd_reference(session, batch: TrainBatch, lr: float, max_norm: float | None, gradient,
                  first: tuple[float, dict] | None = None) -> tuple[list, list]:
    """M sequential plain-SGD steps on ``session``'s weights, step k on ``gradient(policy, batch, rows of
    mini-batch k)``, clipped as torch.nn.utils.clip_grad_norm_ defines it (coefficient max_norm / (norm + 1e-6),
    at most 1); the losses and pre-clip gradient norms of the steps. ``first``: step 0's ``gradient`` at these
    weights, where the caller has it already."""
    losses, norms = [], []
    for k in range(session.cfg.train.minibatches):
        if k == 0 and first is not None:
            loss, grads = first
        else:
            loss, grads = gradient(session.policy, batch, minibatch_of(k, session.cfg))
        norm = math.sqrt(sum(float((g ** 2).sum()) for g in grads.values()))
        coef = 1.0 if max_norm is None else min(1.0, max_norm / (norm + 1e-6))
        with torch.no_grad():
            for name, p in session.policy.named_parameters():
                p -= lr * coef * grads[name]
        losses.append(loss)
        norms.append(norm)
    return losses, norms


METHOD_SETS = {
    "full": (["method.name=full"], one_graph_loss_and_gradient),
    "agg": (["method={name: agg, window: 3, alpha: sigma}", "train.plan=groups", "train.plan_window=3"],
            lambda policy, batch, rows: agg_loss_and_gradient(policy, batch, rows, 3)),
}


@pytest.mark.parametrize("method", sorted(METHOD_SETS))
@pytest.mark.parametrize("minibatches, max_norm, unit", [(1, None, "groups"), (2, None, "groups"), (4, 1e-3, "groups"),
                                                         (2, None, "slices")])
def test_minibatches_are_sequential_steps_on_each_minibatchs_loss(method, minibatches, max_norm, unit):
    """Float64, fresh weights and rollout: the update's M steps (SGD swapped in for AdamW, so that the result is
    linear in each step's gradient and a wrong loss scale shows) against the reference's (M = 1: the whole batch
    in one step, the update as it was before mini-batches); and for M > 1 against the same steps all taken at
    the starting weights, which they must not be."""
    sets, gradient = METHOD_SETS[method]
    seed, lr = fresh_seed(), 0.05
    overrides = [*sets, f"seed={seed}", "grpo.prompts_per_iteration=4", f"train.minibatches={minibatches}",
                 f"train.minibatch_unit={unit}", f"grpo.group_size={4 if unit == 'slices' else 3}",
                 f"train.max_grad_norm={'null' if max_norm is None else max_norm}", "reward.name=smoothness",
                 "grpo.clip_range=10"]  # no clipped ratio: the terms stay smooth in the weights
    session, reference = Session(tiny_config(*overrides)), Session(tiny_config(*overrides))
    batch = session.collect(0).batch
    start = {n: p.detach().clone() for n, p in session.policy.named_parameters()}
    session.optimizer = torch.optim.SGD(session.policy.parameters(), lr=lr)
    stats = session.update(batch)
    assert session.policy.version == minibatches

    # the gradients of the loss written out are most of this test's cost: the first mini-batch's at the start is
    # also the reference's first step, and the others at the start are taken only where they are compared (unclipped
    # steps: clipped ones have the length max_norm whatever their direction)
    first = gradient(reference.policy, batch, minibatch_of(0, reference.cfg))
    compare_stale = max_norm is None and minibatches > 1
    if compare_stale:
        stale = {n: -lr * g for n, g in first[1].items()}  # every mini-batch's gradient at the start
        for k in range(1, minibatches):
            _, grads = gradient(reference.policy, batch, minibatch_of(k, reference.cfg))
            for n in stale:
                stale[n] -= lr * grads[n]
    losses, norms = sgd_reference(reference, batch, lr, max_norm, gradient, first)
    moved = {n: p.detach() - start[n] for n, p in session.policy.named_parameters()}
    expected = {n: p.detach() - start[n] for n, p in reference.policy.named_parameters()}
    error = relative_error(moved, expected)
    assert error <= 1e-12, (seed, error)
    if compare_stale:
        assert relative_error(moved, stale) > 1e-6, seed  # the second step saw the first's weights
    elif max_norm is not None:
        assert min(norms) > max_norm  # every step clipped
    # the loss is a mean of terms -A ratio of size |A| ~ 1 whose advantages cancel within each group (the mean is
    # ~1e-6): its rounding is that of O(1) terms, so the bound is absolute (1e-15, ~10 ulp of 1)
    assert stats["loss"] == pytest.approx(sum(losses) / minibatches, rel=0, abs=1e-15), seed
    assert stats["grad_norm"] == pytest.approx(sum(norms) / minibatches, rel=1e-12), seed


def routed_agg_epoch(window: int, route_frac: float):
    """``gradient(policy, batch, rows)`` for :func:`sgd_reference`'s parts of one epoch in order, AGG with
    ``route_frac`` (``route_score: state_cosine``) and its routing written out: a part scores each (sample, group of
    3 or more steps) by the linearity of the group's states, and AGG takes the highest-scored (ties: the earlier
    group, then the earlier sample) round_half_up(route_frac x the candidates of this and the earlier parts) less
    those the earlier parts took; the others are exact."""
    seen = routed = 0

    def gradient(policy, batch: TrainBatch, rows: list[int]) -> tuple[float, dict]:
        nonlocal seen, routed
        trained = batch.train_steps
        n = trained.shape[1]
        starts = [start for start in range(0, n, window) if min(start + window, n) - start >= 3]
        scored = [(-linearity_reference(batch.latents[i, trained[i, start:start + window]].flatten(1)), start, i)
                  for start in starts for i in rows]
        seen += len(scored)
        take = math.floor(route_frac * seen + 0.5) - routed
        routed += take
        exact = frozenset((i, start) for _, start, i in sorted(scored)[take:])
        return agg_loss_and_gradient(policy, batch, rows, window, exact)

    return gradient


@pytest.mark.parametrize("unit, group_size, route_frac, epochs, routed", [
    ("groups", 3, 0.25, 1, 3),    # 2 mini-batches of 6 candidates: 2 + 1 of 12, not 2 + 2
    ("slices", 4, 0.3, 2, 2 * 5),  # 2 slices of 8: 2 + 3 of 16 in each epoch, not 2 + 2
])
def test_a_split_agg_update_routes_each_epochs_fraction(unit, group_size, route_frac, epochs, routed):
    """Float64, fresh weights and rollout, plain SGD: an AGG update split into 2 mini-batches, ``route_frac`` < 1,
    against the steps of the AGG rule written out with the epoch's routing (:func:`routed_agg_epoch`)."""
    seed, lr = fresh_seed(), 0.05
    overrides = [f"method={{name: agg, window: 3, alpha: sigma, route_frac: {route_frac}, route_score: state_cosine}}",
                 "train.plan=groups", "train.plan_window=3", f"seed={seed}", "grpo.prompts_per_iteration=2",
                 "train.minibatches=2", f"train.minibatch_unit={unit}", f"grpo.group_size={group_size}",
                 f"train.inner_epochs={epochs}", "train.max_grad_norm=null", "reward.name=smoothness",
                 "grpo.clip_range=10"]
    session, reference = Session(tiny_config(*overrides)), Session(tiny_config(*overrides))
    batch = session.collect(0).batch
    start = {n: p.detach().clone() for n, p in session.policy.named_parameters()}
    session.optimizer = torch.optim.SGD(session.policy.parameters(), lr=lr)
    session.update(batch)
    for _ in range(epochs):
        sgd_reference(reference, batch, lr, None, routed_agg_epoch(3, route_frac))
    moved = {n: p.detach() - start[n] for n, p in session.policy.named_parameters()}
    expected = {n: p.detach() - start[n] for n, p in reference.policy.named_parameters()}
    error = relative_error(moved, expected)
    assert error <= 1e-12, (seed, error)
    assert session.estimator.iteration_metrics()["agg_groups_routed"] == routed


# ----- what is charged ----------------------------------------------------------------------------------------
def test_records_and_the_calibration_count_inner_epochs_times_minibatches_optimizer_steps(tmp_path):
    """A run of 2 iterations, 2 epochs of 2 mini-batches: 8 optimizer steps taken (the checkpoint's policy
    version), 4 per iteration in the loaded records; the same passes as one mini-batch, exactly."""
    # 2 prompt groups, one per mini-batch: what is counted does not depend on how many groups a mini-batch holds
    sets = ["method.name=full", "grpo.prompts_per_iteration=2", "train.inner_epochs=2", "train.checkpoint_every=1"]
    runs = {}
    for m in (1, 2):
        cfg = tiny_config(*sets, f"train.minibatches={m}")
        assert cfg.train.optimizer_steps == 2 * m
        train(cfg, tmp_path / f"m{m}")
        runs[m] = list(read_jsonl(tmp_path / f"m{m}" / "metrics.jsonl"))
        assert read_checkpoint(tmp_path / f"m{m}" / "checkpoint.pt")["policy_version"] == 2 * 2 * m
        rows = load_records([RunEntry(tmp_path / f"m{m}")])
        assert rows["optimizer_steps"].tolist() == [2 * m, 2 * m]
    passes = ("forward_nograd", "forward_grad", "backward", "train_forward_nograd", "train_forward_grad",
              "train_backward", "cost")
    for one, two in zip(runs[1], runs[2]):
        assert {k: one[k] for k in passes} == {k: two[k] for k in passes}
    b, n = 2 * 3, 6  # 2 prompts x groups of 3; flow_grpo trains all 6 steps
    assert runs[2][0]["train_forward_grad"] == runs[2][0]["train_backward"] == 2 * b * n
    assert runs[2][0]["reward_mean"] == runs[1][0]["reward_mean"]  # the same first rollout


def test_the_calibration_prices_the_runs_optimizer_steps():
    from agg_bench.tools.calibrate import CalibrationConfig, method_overrides, time_methods

    session = Session(tiny_config("grpo.prompts_per_iteration=4", "train.minibatches=2", "train.inner_epochs=2"))
    batch = session.collect(0).batch
    methods = {"full": method_overrides("full", {"method": {"name": "full"}})}
    timed = time_methods(session, batch, methods, CalibrationConfig(method_repeats=1, warmup=0))["full"]
    b, n = batch.train_steps.shape
    assert timed["optimizer_steps"] == 4
    assert timed["passes"] == {"forward_nograd": 0, "forward_grad": 2 * b * n, "backward": 2 * b * n}
    # each step's forwards take its mini-batch's rows at once: twice the calls of one mini-batch
    assert timed["calls"] == {"forward_nograd": 0, "forward_grad": 2 * 2 * n, "backward": 2 * 2 * n}


def test_the_memory_plan_trains_a_minibatch_at_once():
    cfg = tiny_config("grpo.prompts_per_iteration=4", "train.minibatches=2")
    assert run_layout(cfg).micro_batch == 4 * 3 // 2
    assert run_layout(tiny_config("grpo.prompts_per_iteration=4")).micro_batch == 4 * 3


# ----- refusals ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("value, words", [
    ("two", ["an integer"]), ("-1", ["an integer from 1 to 1024"]), ("0", ["an integer from 1 to 1024"]),
    (".nan", ["nan"]), ("nan", ["an integer"]), ("2.0", ["an integer"]), ("true", ["an integer"]),
    (str(10**9), ["an integer from 1 to 1024"]), ("1025", ["an integer from 1 to 1024"]),
    ("3", ["a divisor of the 2 prompt groups", "grpo.prompts_per_iteration = 2"]),  # more than the groups
])
def test_bad_values_are_one_line_exit_2_and_nothing_written(tmp_path, capsys, value, words):
    out = tmp_path / "run"
    capsys.readouterr()
    assert main([*RUN, "--set", f"train.minibatches={value}", "--out", str(out)]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "train.minibatches" in line and not out.exists(), line
    for word in words:
        assert word in line, line


def test_a_value_that_does_not_divide_the_groups_is_refused(tmp_path, capsys):
    out = tmp_path / "run"
    capsys.readouterr()
    assert main([*RUN, "--set", "grpo.prompts_per_iteration=4", "--set", "train.minibatches=3",
                 "--out", str(out)]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "train.minibatches = 3" in line and "a divisor of the 4 prompt groups" in line and not out.exists()
    assert load_config(None, ["grpo.prompts_per_iteration=4", "train.minibatches=4"]).train.minibatches == 4


@pytest.mark.parametrize("sets, words", [
    (["train.minibatch_unit=pieces"], ["train.minibatch_unit", "'pieces'", "groups", "slices"]),
    (["train.minibatch_unit=slices", "grpo.group_size=4", "train.minibatches=3"],
     ["train.minibatches = 3", "a divisor of grpo.group_size = 4", "'slices'"]),
])
def test_a_bad_minibatch_unit_or_slice_count_is_refused(tmp_path, capsys, sets, words):
    out = tmp_path / "run"
    capsys.readouterr()
    assert main([*RUN, *(a for item in sets for a in ("--set", item)), "--out", str(out)]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert all(word in line for word in words) and not out.exists(), line
    # slices need not divide the groups: one group of 4 in 2 slices
    assert load_config(None, ["grpo.prompts_per_iteration=1", "grpo.group_size=4", "train.minibatches=2",
                              "train.minibatch_unit=slices"]).train.minibatches == 2


def test_each_data_parallel_process_needs_whole_minibatches():
    """Under K processes the bound is each process's groups: P / K."""
    cfg = load_config(None, ["grpo.prompts_per_iteration=4", "train.minibatches=4"])
    check_data_parallel(cfg, 1)
    with pytest.raises(ConfigError) as err:
        check_data_parallel(cfg, 2)
    assert err.value.key == "train.minibatches" and "2 prompt groups" in str(err.value)
    assert "2 data-parallel processes" in str(err.value) and "\n" not in str(err.value)
    check_data_parallel(load_config(None, ["grpo.prompts_per_iteration=4", "train.minibatches=2"]), 2)


@pytest.mark.parametrize("method, sets", [
    ("branch", ["--set", "method={name: branch, branch_points: [0, 1]}"]),
    *[(m, ["--set", f"method.name={m}", "--set", "sampling.same_noise_per_group=false"])
      for m in ("nft", "awm", "dgpo")],
])
def test_methods_that_cannot_split_their_batch_refuse_more_than_one(tmp_path, capsys, method, sets):
    out = tmp_path / "run"
    capsys.readouterr()
    assert main([*RUN, *sets, "--set", "sampling.steps=10", "--set", "train.minibatches=2", "--out", str(out)]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "train.minibatches = 2" in line and f"1 for method '{method}'" in line and not out.exists(), line
