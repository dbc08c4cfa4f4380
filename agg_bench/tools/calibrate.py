"""``agg-bench calibrate``: unit costs of the policy network's three kinds of pass, per call and per latent.

A method's counted work in its train phase (calls and latents of each kind of pass, and optimizer steps)
priced at these unit costs predicts its train phase's time, and the ratio of two predictions is the
speedup that the work alone explains (``report``'s ``predicted_train_speedup``). A measured speedup far
from its prediction then comes from something else: overheads the counts do not show, or noise.

The three passes are measured on one real rollout of the run config (its states, timesteps and
conditioning), each at two sizes: the size the train phase mostly calls it with (the training batch for
a forward with grad and its backward, what ``full`` and AGG's endpoint backwards use; every (sample,
step) pair for a no-grad forward, AGG's velocity recomputation) and one latent (what a method that
splits the batch calls, e.g. AGG's routing, which trains the groups it leaves exact on a few rows at a
time). Each is measured many times and interleaved: repetition ``r`` measures every kind and size once,
in an order rotated by ``r``, so that a slow stretch of a shared machine falls on all alike; a cost is
the median over repetitions, in CPU time of the process and in wall-clock (CUDA-event) time.
``unit_s_per_sample`` holds the per-sample cost at the large size, (seconds of one call) / (latents in it);
``unit_s_per_call`` the cost of a call of ``n`` latents as ``call + latent * n``
(:func:`agg_bench.results.costmodel.fit_call_cost`), which prices a call of a few latents at what it costs:
at the tiny models' sizes a call of 1 latent costs nearly what one of 4 costs.

With ``methods`` (label -> run-config overrides, as a sweep's ``methods:`` entries), the same process
also times each method's whole train phase on that rollout: ``Session.update`` with the method's
estimator, the steps it would train planned on the frozen rollout (:func:`agg_bench.tools.snapshot.replay_case_of`),
gradient, clipping and optimizer step included. Rounds are interleaved like the passes (round ``r``
times every method once, in an order rotated by ``r``). A timed update is a run's whole update, with
``train.eval_ema`` the evaluation average's update among it; the weights, the policy version and that average
are put back after each, the optimizer's state after the last, so every round of every method does the same
work on the same weights and the session is left as the rounds found it; the policy's counter around the
update gives its passes and calls of each kind (``passes``, ``calls``). A method's own state (a moving average of
the policy: nft's old policy, awm's EMA-KL, dgpo's EMA model) is put back before each round, moved from the
policy as a run's is after its first step (:func:`moved_average_state`), and each round trains a batch object of
its own, as each iteration of a run does: every round makes, and is charged, the same forwards. A method that owns
its rollout (a tree, guessed velocities) is timed on a rollout of its own, under the plan of trained steps it
sets (:data:`OWN_PLAN_KEYS`). The ratio of two methods'
medians is then a speedup measured under one machine state, paired round by round, which separate runs
(taken minutes apart while other jobs come and go) cannot give; the report takes its train speedups
from it (``train_speedup_basis: paired``).

The rollout is timed the same way, since a method may own it (:meth:`agg_bench.methods.base.Estimator.rollout`:
fewer forwards, guessed velocities, a tree, a cache in the sampler): after the train rounds (their warm-up
serves these too), ``method_repeats`` rounds each run every method's rollout of iteration 0 once, in an
order rotated by the round, from the same prompts' conditioning, the same x_0 and a generator in the same
state (iteration 0's after the noise), so each round samples exactly what the method's run samples first;
no weights change. The policy's counter around each rollout gives its no-grad forwards per sample
(``rollout_forwards``), and its passes and calls (``rollout_passes``, ``rollout_calls``), which the cost
model prices like a train phase's; the report takes its ``rollout_speedup`` from these rounds.
A method's rollout is timed whether or not its train phase can be replayed, unless its overrides change
what the rounds share (:data:`ROLLOUT_SHARED_KEYS`). ``method_repeats`` in the result is the rounds of these
timings, null where no method's train phase or rollout was timed (no ``methods``, or none that could be).
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import torch

from ..config import RunConfig, apply_overrides, dotted_value, validate
from ..engine import families
from ..errors import ConfigError, UserError, alike_on_every_process
from ..io import write_json
from ..machine.telemetry import PhaseTimer, environment
from ..outdir import check_suffix, claim_files, json_file_with
from ..records import PASS_KEYS, is_integer
from ..results.costmodel import fit_call_cost
from ..results.stats import quartiles


@dataclass
class CalibrationConfig:
    """What ``calibrate`` measures.

    repeats: measurements of each kind of pass (interleaved); the medians are over these.
    warmup: untimed repetitions first (one-off allocation and kernel selection costs); also the untimed
        rounds before the methods' timed ones.
    method_repeats: timed rounds of the methods' train phases, and as many of their rollouts (each round
        times every method once).
    """

    repeats: int = 21
    warmup: int = 2
    method_repeats: int = 9

    def __post_init__(self) -> None:
        for key, low in (("repeats", 1), ("warmup", 0), ("method_repeats", 1)):
            value = getattr(self, key)
            if not is_integer(value) or not low <= value <= 100_000:
                raise ConfigError(f"calibrate.{key}", value, f"an integer from {low} to 100000")

    @property
    def method_rounds(self) -> int:
        """The rounds of the methods' train phases, untimed and timed: each times every method once."""
        return self.warmup + self.method_repeats


def method_overrides(label: str, overrides: Any) -> tuple[str, list[str]]:
    """(method name, ``--set`` strings) of a ``methods`` entry: a mapping of run-config overrides that
    names the method (``method: {name: ...}`` or ``method.name``), as in a sweep's ``methods:``."""
    from .sweep import flatten, overrides_of  # torch-free composition of overrides, as the sweep's own

    pairs = flatten(dict(overrides)) if isinstance(overrides, Mapping) else []
    names = [v.get("name") if k == "method" and isinstance(v, Mapping) else v
             for k, v in pairs if k in ("method", "method.name")]
    if not names or not isinstance(names[-1], str):
        raise ConfigError(f"--method {label}", overrides,
                          "a mapping of run-config overrides that names the method, "
                          "e.g. '{method: {name: agg, window: 5}}'")
    return names[-1], overrides_of(pairs)


def check_method(cfg: RunConfig, label: str, sets: list[str]) -> None:
    """Refuse a ``methods`` entry that no run could use, before anything is timed: an unknown method name,
    a bad option, or settings the method cannot honour (its ``check_run``). A UserError names the label."""
    from ..methods.base import build_estimator

    try:
        method_cfg = validate(apply_overrides(cfg.to_dict(), sets))
        build_estimator(method_cfg).check_run(method_cfg)
    except UserError as err:
        raise UserError(f"--method {label}: {err}") from None


def time_methods(session, batch, methods: Mapping[str, tuple[str, list[str]]],
                 options: CalibrationConfig) -> dict[str, dict]:
    """Each method's train phase on ``batch``, interleaved over rounds (see the module docstring):
    ``methods``: label -> (method name, ``--set`` strings), from :func:`method_overrides`. Returns
    {label: {"replay", "replay_note", "passes", "calls", "optimizer_steps", "cpu_s": [...], "wall_s": [...]}}. A
    method whose train phase cannot run on a frozen rollout because it owns its rollout (a tree, guessed
    velocities) is timed on a rollout of its own from the run's prompts, noise and generator
    (``"train_rollout": "own"``); one that differs from ``full`` only in its rollout (a rollout-only
    cache) or sets keys a frozen rollout fixes gets its replay scope and note and no times."""
    from ..methods.base import Estimator
    from .replays import replay_setup
    from .snapshot import Snapshot, replay_case_of

    policy = session.policy
    snapshot = Snapshot(policy, batch, {}, session.cfg.to_dict())
    setups: dict[str, tuple] = {}
    out: dict[str, dict[str, Any]] = {}
    for label, (name, sets) in methods.items():
        train = None  # the run's train section, or the method's own where it sets its trained steps' plan
        try:
            cfg, estimator = replay_setup(snapshot.config, name, sets)
        except ConfigError as err:  # a key the frozen rollout fixes: this method needs its own rollout
            own = own_plan_setup(snapshot.config, name, sets)
            if own is None:
                out[label] = {"replay": "not_applicable", "replay_note": str(err)}
                continue
            cfg, estimator = own
            train = cfg.train
        case = replay_case_of(snapshot, estimator, cfg)
        out[label] = {"replay": case.scope, "replay_note": case.note}
        if case.scope == "not_applicable":
            if type(estimator).rollout is Estimator.rollout:  # it differs from full only in what a rollout shows
                continue
            # it owns its rollout (a tree, guessed velocities): its train phase is timed on a rollout of its own,
            # from the same prompts, noise and generator as the run's first
            with _train_section(session, train):
                planned = own_rollout(session, estimator)
            out[label]["train_rollout"] = "own"
        else:
            planned = batch if case.train_steps is None else \
                dataclasses.replace(batch, train_steps=case.train_steps.to(batch.train_steps.device))
        setups[label] = (estimator, planned, moved_average_state(estimator, policy), train)
        out[label].update(cpu_s=[], wall_s=[])
    kept = _SessionState(session)
    labels = list(setups)
    try:
        for r in range(options.warmup + options.method_repeats):
            shift = r % max(len(labels), 1)
            for label in labels[shift:] + labels[:shift]:
                estimator, planned, state, train = setups[label]
                session.estimator = estimator
                if state is not None:  # the method's moving average as every round finds it
                    estimator.load_state_dict(state, policy)
                # a batch of its own, as each iteration of a run brings: what a method keeps per rollout (nft's
                # old velocities) is computed in every round
                planned = dataclasses.replace(planned)
                before = policy.counter.copy()
                # the whole update a run's iteration pays: with train.eval_ema, the average's update among it
                with _train_section(session, train), PhaseTimer(session.device) as timer:
                    session.update(planned)
                    session.release_gradients()  # as a run's train phase ends
                work = policy.counter - before
                if r >= options.warmup:
                    out[label]["cpu_s"].append(timer.cpu_s)
                    out[label]["wall_s"].append(timer.elapsed_s)
                    out[label].update(passes=work.as_dict(), calls=work.calls(),
                                      optimizer_steps=session.steps_taken)
                kept.put_back_round()
    finally:
        kept.put_back()
    return out


class _SessionState:
    """What a timed update moves in a session, kept to be put back: the trained weights, the policy version (AGG's
    velocity reuse asks it), the evaluation average (``train.eval_ema``), the estimator, the optimizer's state and
    its last step count. :meth:`put_back_round` after every timed update (the same work on the same weights every
    round; the optimizer's moments only change the numbers its step computes, not its work), :meth:`put_back` at
    the end: the session then computes, evaluates and steps as it did before the rounds."""

    def __init__(self, session):
        self.session = session
        self.weights = [p.detach().clone() for p in session.policy.parameters()]
        self.version, self.estimator, self.steps_taken = session.policy.version, session.estimator, session.steps_taken
        average = session.eval_ema
        self.average = None if average is None else (
            {name: w.detach().clone() for name, w in average.weights.items()}, average.steps, average.version)
        self.optimizer = copy.deepcopy(session.optimizer.state_dict())

    @torch.no_grad()
    def put_back_round(self) -> None:
        session = self.session
        for p, w in zip(session.policy.parameters(), self.weights):
            p.copy_(w)
        session.policy.version = self.version
        if self.average is not None:
            weights, session.eval_ema.steps, session.eval_ema.version = self.average
            for name, w in weights.items():
                session.eval_ema.weights[name].copy_(w)

    def put_back(self) -> None:
        self.put_back_round()
        self.session.estimator, self.session.steps_taken = self.estimator, self.steps_taken
        self.session.optimizer.load_state_dict(self.optimizer)


def moved_average_state(estimator, policy) -> dict | None:
    """The state every timed round of ``estimator`` starts from (None: it keeps none,
    :meth:`~agg_bench.methods.base.Estimator.state_dict`). A moving average of the policy (nft's old policy, awm's
    EMA-KL, dgpo's EMA model) that its rollout made equal to the policy is marked as moved from it, as a run's is
    after its first optimizer step with a decay above 0: its forwards, which a method skips while the average is
    the policy, are made and charged in every round (they compute the policy's own velocities here: the same
    work, not a later iteration's numbers), and the average's updates during an update start from the same state
    each round."""
    from ..engine.moving_average import MovingAverage

    average = getattr(estimator, "ema", None)
    if isinstance(average, MovingAverage) and average.equals(policy):
        average.version = None
    return estimator.state_dict()  # copies (on the CPU), which the rounds only read


# Keys beyond its method.* that a method owning its rollout may set and still be timed beside the run's methods: the
# plan of the steps it trains, which its own rollout draws (branch's train.plan: steps), as replay honours them
# for a method that replans (agg_bench.tools.replays.REPLAN_KEYS, but the seed every round shares).
OWN_PLAN_KEYS = ("train.timestep_fraction", "train.plan", "train.plan_window", "train.ignore_last")


def own_plan_setup(config: dict, name: str, sets: list[str]):
    """(run config, estimator) of method ``name`` with its overrides ``sets`` on the run's ``config``, when it owns
    its rollout and sets nothing beyond its ``method.*`` but :data:`OWN_PLAN_KEYS` (its run checks made); None
    otherwise (its replay's refusal stands)."""
    from ..methods.base import Estimator
    from .replays import replay_setup

    try:
        cfg, estimator = replay_setup(config, name, sets, also=OWN_PLAN_KEYS)
    except ConfigError:
        return None
    if type(estimator).rollout is Estimator.rollout:  # a frozen rollout would do: its replay decides
        return None
    return cfg, estimator


@contextlib.contextmanager
def _train_section(session, train):
    """The session with ``train`` (a method's own plan of its trained steps) as its run's train section while
    the block runs (its rollout's steps drawn, its update made); nothing changes for None."""
    if train is None:
        yield
        return
    kept = session.cfg
    session.cfg = dataclasses.replace(kept, train=train)
    try:
        yield
    finally:
        session.cfg = kept


def own_rollout(session, estimator):
    """Iteration 0's training batch as ``estimator``'s own rollout, advantages and trained steps make it (the run's
    prompts, noise and generator), with the policy's weights untouched."""
    estimator_of_run = session.estimator
    session.estimator = estimator
    try:
        return session.collect(0).batch
    finally:
        session.estimator = estimator_of_run


# Run-config keys every method's rollout round shares with the run's (the policy, the prompts, their
# conditioning, x_0 and the schedule it starts from): a method whose overrides change one needs its own run.
ROLLOUT_SHARED_KEYS = ("seed", "device", "model", "prompts", "grpo.group_size", "grpo.prompts_per_iteration",
                       "sampling.steps", "sampling.shift", "sampling.same_noise_per_group",
                       "train.gradient_checkpointing", "train.lora_rank", "train.lora_alpha",
                       "train.lora_target_modules", "train.shard", "train.cpu_offload")


def time_rollouts(session, methods: Mapping[str, tuple[str, list[str]]],
                  options: CalibrationConfig) -> dict[str, dict]:
    """Each method's rollout of iteration 0, interleaved over ``options.method_repeats`` rounds (see the
    module docstring): every round gives every method the same prompts' conditioning, the same x_0 and a
    generator in the same state (iteration 0's, after the noise). ``methods`` as in :func:`time_methods`.
    Returns {label: {"rollout_forwards": no-grad forwards per sample, "rollout_passes", "rollout_calls" (of
    each kind, in one rollout), "rollout_cpu_s": [...], "rollout_wall_s": [...]}}, or {label: {"rollout_note":
    why not}} for a method whose overrides change what the rollouts share (:data:`ROLLOUT_SHARED_KEYS`)."""
    from ..machine import distributed
    from ..methods.base import build_estimator
    from ..runtime.session import ready_estimator

    policy, run_config = session.policy, session.cfg.to_dict()
    shard = distributed.current()
    generator, prompts, cond = session.rollout_prompts(0)
    total = len(prompts)
    noise = session.rollout_noise(total, generator)
    start = generator.get_state()
    rows = shard.rows(total)
    sampler = distributed.rollout_policy(policy, shard, total)
    setups: dict[str, tuple] = {}
    out: dict[str, dict[str, Any]] = {}
    for label, (_, sets) in methods.items():
        cfg = validate(apply_overrides(run_config, sets))
        changed = [key for key in ROLLOUT_SHARED_KEYS if dotted_value(cfg.to_dict(), key) != dotted_value(run_config, key)]
        if changed:
            out[label] = {"rollout_note": f"sets {', '.join(changed)}, which every rollout round shares with "
                                          "the run's: its rollout needs a run of its own"}
            continue
        estimator = build_estimator(cfg)
        # what a run checks first, and what a method that owns its rollout learns from it or asks of it
        ready_estimator(estimator, cfg, policy, session.device)
        setups[label] = (estimator, cfg.sampling)
        out[label] = {"rollout_cpu_s": [], "rollout_wall_s": []}
    labels = list(setups)
    try:
        for r in range(options.method_repeats):
            shift = r % max(len(labels), 1)
            for label in labels[shift:] + labels[:shift]:
                estimator, sampling = setups[label]
                round_generator = torch.Generator().set_state(start)
                before = policy.counter.copy()
                with PhaseTimer(session.device) as timer:
                    estimator.rollout(sampler, cond, noise, session.sigmas, sampling, round_generator, 0,
                                      session.cfg.grpo.group_size)
                work = policy.counter - before
                out[label]["rollout_cpu_s"].append(timer.cpu_s)
                out[label]["rollout_wall_s"].append(timer.elapsed_s)
                out[label].update(rollout_forwards=work.forward_nograd / (rows.stop - rows.start),
                                  rollout_passes=work.as_dict(), rollout_calls=work.calls())
    finally:
        for estimator, _ in setups.values():
            estimator.close()
    return out


def calibrate(cfg: RunConfig, options: CalibrationConfig | None = None,
              methods: Mapping[str, Any] | None = None) -> dict:
    """Unit costs of a no-grad forward, a forward with grad and a backward (seconds per latent at the usual
    size, and per call and per latent) and of the optimizer step for ``cfg``'s model, resolution and
    device, and with ``methods`` each one's train phase and rollout timed in the same process; see the
    module docstring."""
    from ..runtime.session import Session  # the engine only when measuring

    options = options or CalibrationConfig()
    # a malformed entry fails before the model is built
    parsed = {label: method_overrides(label, overrides) for label, overrides in (methods or {}).items()}
    for label, (_, sets) in parsed.items():
        check_method(cfg, label, sets)
    session = Session(cfg)
    policy, device = session.policy, session.device
    batch = session.collect(0).batch
    timed_methods = time_methods(session, batch, parsed, options) if parsed else {}
    # after the train rounds, which warmed the forwards up: no untimed rollouts
    for label, timed in (time_rollouts(session, parsed, options) if parsed else {}).items():
        timed_methods[label].update(timed)
    # the rounds of the methods' timings, or null where no method was timed (none given, or none that could be)
    rounds = options.method_repeats if any(m.get("cpu_s") or m.get("rollout_cpu_s")
                                           for m in timed_methods.values()) else None
    b, steps = batch.latents.shape[0], batch.timesteps.shape[0]
    rows = torch.arange(b, device=batch.latents.device)
    every_row = rows.repeat_interleave(steps)
    every_step = torch.arange(steps, device=rows.device).repeat(b)
    # latents per call of each kind: the train phase's usual size, then one latent (a backward has its
    # forward's sizes: the forward-with-grad measurement times both)
    sizes = {"forward_nograd": tuple(dict.fromkeys((len(every_row), 1))), "forward_grad": tuple(dict.fromkeys((b, 1)))}
    sizes["backward"] = sizes["forward_grad"]
    params = [p for p in policy.parameters() if p.requires_grad]
    optimizer = session.optimizer
    max_norm = cfg.train.max_grad_norm

    def inputs(n: int, step: int):
        """States, timesteps and conditioning of ``n`` latents: every (sample, step) pair (how AGG recomputes
        velocities: one call over its groups), or the first ``n`` samples at ``step`` (a forward with grad
        runs one step of the training batch at a time)."""
        r, s = (every_row, every_step) if n == len(every_row) else \
            (rows[:n], torch.full((n,), step, dtype=torch.long, device=rows.device))
        return batch.states(r, s), batch.timestep_values(s), batch.cond[r]

    def measure(kind: str, n: int, step: int) -> dict[str, tuple[float, float]]:
        """(cpu s, wall s) of one call of ``kind`` on ``n`` latents; the grad kind is measured as a forward,
        a backward and the optimizer step that follows an update's backwards."""
        x, t, c = inputs(n, step)
        if kind == "forward_nograd":
            with torch.no_grad(), PhaseTimer(device) as timer:
                policy.velocity(x, t, c)
            return {kind: (timer.cpu_s, timer.elapsed_s)}
        with PhaseTimer(device) as forward:
            out = policy.velocity(x, t, c)
        upstream = torch.ones_like(out)
        with PhaseTimer(device) as backward:
            out.backward(upstream)
        # what Session.update does once per optimizer step, whatever the method: gradient norm, clip, step
        with PhaseTimer(device) as update:
            grads = [p.grad for p in params if p.grad is not None]
            torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.double()) for g in grads]))
            if max_norm is not None:
                torch.nn.utils.clip_grad_norm_(params, max_norm)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        return {"forward_grad": (forward.cpu_s, forward.elapsed_s), "backward": (backward.cpu_s, backward.elapsed_s),
                "optimizer_step": (update.cpu_s, update.elapsed_s)}

    # seconds per call of each (kind, latents), and of each optimizer step
    seconds: dict[tuple[str, int], dict[str, list[float]]] = {
        (kind, n): {"cpu": [], "wall": []} for kind, pair in sizes.items() for n in pair}
    seconds.update({("optimizer_step", 1): {"cpu": [], "wall": []}})
    cases = [(kind, n) for kind in ("forward_nograd", "forward_grad") for n in sizes[kind]]
    for r in range(options.warmup + options.repeats):
        shift = r % len(cases)
        for kind, n in cases[shift:] + cases[:shift]:
            for name, (cpu, wall) in measure(kind, n, r % steps).items():
                if r >= options.warmup:
                    key = (name, n if name in sizes else 1)
                    seconds[key]["cpu"].append(cpu)
                    seconds[key]["wall"].append(wall)
    env = environment(device)
    units: dict[str, dict[str, dict[str, float]]] = {}
    per_call: dict[str, dict[str, Any]] = {}
    for kind in (*PASS_KEYS, "optimizer_step"):
        n = sizes[kind][0] if kind in sizes else 1
        units[kind] = {basis: _quartiles([x / n for x in values]) for basis, values in seconds[(kind, n)].items()}
    for kind, pair in sizes.items():
        per_call[kind] = {"latents": list(pair)}
        for basis in ("cpu", "wall"):
            quarts = [_quartiles(seconds[(kind, n)][basis]) for n in pair]
            call, latent = fit_call_cost(pair, [q["median"] for q in quarts])
            per_call[kind][basis] = {"call": call, "latent": latent,
                                     **{stat: [q[stat] for q in quarts] for stat in ("median", "p25", "p75")}}
    return {
        "model": families.model_label(cfg.model), "resolution": cfg.model.resolution, "device": device.type,
        "gpu_name": env["gpu_name"] if device.type == "cuda" else None, "batch": b,
        "repeats": options.repeats, "warmup": options.warmup, "threads": torch.get_num_threads(),
        "unit_s_per_sample": units, "unit_s_per_call": per_call, "method_repeats": rounds,
        "methods": timed_methods, "env": env,
    }


def _quartiles(values: list[float]) -> dict[str, float]:
    p25, p50, p75 = quartiles(values)
    return {"median": p50, "p25": p25, "p75": p75}


def write_calibration(cfg: RunConfig, out: str | Path, options: CalibrationConfig | None = None,
                      methods: Mapping[str, Any] | None = None) -> dict:
    """Measure (``calibrate``) and write the result to ``out`` as JSON; return it. Under torchrun every
    process measures its share of the batch, as the runs of a cell on that many GPUs do (sharded with
    ``train.shard: fsdp``: all-gathers and reduce-scatters included), and rank 0 writes its numbers."""
    from ..machine import distributed, fsdp
    from ..machine.devices import resolve_device

    out = Path(out)
    with alike_on_every_process():  # what `agg-bench report --calibration` and the workflow read: FILE.json
        check_suffix(out, ".json")
    with distributed.process_group(resolve_device(cfg.device), single=fsdp.enabled(cfg)) as shard:
        with alike_on_every_process():  # every process joined the group, and this depends on cfg alone
            shard.check_run(cfg)  # whole groups per process, as a run checks it
        # claimed before minutes of timing: a file that is not a calibration, or a second writer, is refused first
        claim = distributed.on_main(
            lambda: claim_files({out: (json_file_with("unit_s_per_sample"), "a calibration")}).acquire())
        with claim or contextlib.nullcontext():
            result = {**calibrate(cfg, options, methods), "processes": shard.world_size}
            if shard.is_main:
                write_json(out, result)
    return result
