"""Shared test helpers: small configs, one-graph reference gradients, and another process holding an output's
claim."""
from __future__ import annotations

import math
import os
import subprocess
import sys
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import fields
from pathlib import Path

import torch

from agg_bench.config import load_config, read_number
from agg_bench.engine.counters import PassCounter
from agg_bench.engine.grpo import TrainBatch, UpdateStats, step_terms

ROOT = Path(__file__).resolve().parents[1]

TINY = [
    "model.resolution=32", "sampling.steps=6", "grpo.group_size=3", "grpo.prompts_per_iteration=2",
    "train.iterations=2", "progress=false", "telemetry.enabled=false",
]


# Settings under which each cache of baselines.caches never reuses anything.
CACHE_NEUTRAL = {
    "fbc": {"threshold": 0.0},
    "pab": {"spatial_attention_block_skip_range": 1},
    "fastercache": {"spatial_attention_block_skip_range": 1},
    "magcache": {"max_skip_steps": 0},
    "taylorseer": {"cache_interval": 1},
    "fora": {"interval": 1},
    "deltadit": {"interval": 1},
    "teacache": {"threshold": 0.0},
}


@contextmanager
def interrupted_updates(when) -> Iterator[None]:
    """Inside the block ``Session.update`` raises KeyboardInterrupt (a run stopped in its train phase) when
    ``when(session)`` holds and updates as always otherwise; the real update is back after the block."""
    from agg_bench.runtime.session import Session

    update = Session.update

    def stopping(self, batch):
        if when(self):
            raise KeyboardInterrupt
        return update(self, batch)

    Session.update = stopping  # type: ignore[method-assign]
    try:
        yield
    finally:
        Session.update = update  # type: ignore[method-assign]


# AGG_BENCH_TEST_SEED=s draws the numeric tests' random inputs from other seeds: unset (or 0), the seeds written
# in the tests; s > 0 moves each of them by s x SEED_STRIDE. Seeds that are part of what a test checks stay put.
TEST_SEED_VAR = "AGG_BENCH_TEST_SEED"
SEED_STRIDE = 1_000_003  # a prime above every seed written in the tests: two written seeds never meet


def seed_shift() -> int:
    """The value of AGG_BENCH_TEST_SEED, 0 where it is unset or empty."""
    text = os.environ.get(TEST_SEED_VAR, "").strip()
    if not text:
        return 0
    shift = read_number(text, int)  # as every number of the harness is read: 017 is no 17
    if shift is None or not 0 <= shift <= 2**20:
        raise ValueError(f"{TEST_SEED_VAR}={text!r}: expected an integer from 0 to {2**20}")
    return shift


def seeded(seed: int) -> int:
    """The seed a test draws its inputs from where it writes ``seed``: ``seed`` itself unless
    AGG_BENCH_TEST_SEED is set, and distinct written seeds stay distinct (within a run config's 0 ... 2^32 - 1)."""
    return (seed + seed_shift() * SEED_STRIDE) % 2**32


_fresh_draws: dict[str, int] = {}


def fresh_seed() -> int:
    """A seed for inputs drawn afresh on every run, torch's global generator reseeded with it; with
    AGG_BENCH_TEST_SEED set, one fixed by that value, the running test and how many seeds it took before, so
    that a failing draw runs again."""
    if seed_shift():
        test = os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" (", 1)[0]
        count = _fresh_draws[test] = _fresh_draws.get(test, -1) + 1
        seed = seeded(zlib.crc32(f"{test}#{count}".encode()) % SEED_STRIDE)
    else:
        seed = torch.seed() % 2**31
    torch.manual_seed(seed)
    return seed


def tiny_config(*overrides: str, family: str = "sd3", dtype: str = "float64"):
    """The tiny run config (``TINY``) of ``family`` with ``overrides``; its seed moves with AGG_BENCH_TEST_SEED
    (an override's ``seed=`` wins)."""
    shifted = [f"seed={seeded(0)}"] if seed_shift() else []
    return load_config(None, [*TINY, *shifted, f"model.family={family}", f"model.dtype={dtype}", *overrides])


def one_graph_gradient(policy, batch: TrainBatch, rows: list[int] | None = None) -> dict[str, torch.Tensor]:
    """d L / d theta with L built as a single autograd graph over every (sample, step) term; with ``rows``, L of
    those samples of ``batch`` alone, 1 / (len(rows) N) times the sum of their terms (a mini-batch's loss)."""
    return one_graph_loss_and_gradient(policy, batch, rows)[1]


def one_graph_loss_and_gradient(policy, batch: TrainBatch,
                                rows: list[int] | None = None) -> tuple[float, dict[str, torch.Tensor]]:
    """:func:`one_graph_gradient` and the value of the loss it differentiates."""
    params = [p for _, p in policy.named_parameters()]
    total = 0
    rows = list(range(batch.batch_size)) if rows is None else rows
    for i in rows:
        row = torch.tensor([i])
        for j in batch.train_steps[i].tolist():
            steps = torch.tensor([j])
            v = policy.velocity(batch.states(row, steps), batch.timestep_values(steps), batch.cond[row])
            total = total + step_terms(batch, row, steps, v).loss.sum()
    loss = total * (1.0 / (len(rows) * batch.steps_per_sample))  # the whole batch's: batch.loss_scale
    grads = torch.autograd.grad(loss, params)
    return float(loss.detach()), {n: g for (n, _), g in zip(policy.named_parameters(), grads)}


def agg_loss_and_gradient(policy, batch: TrainBatch, rows: list[int], window: int,
                          exact: frozenset[tuple[int, int]] = frozenset()) -> tuple[float, dict]:
    """The AGG rule of docs/design.md for the samples ``rows``, their loss scaled by 1 / (len(rows) N): for each
    group of ``window`` consecutive trained steps, no-grad v_k, u_k = d(scale l_k)/dv_k by autograd through the
    SDE step and loss, sigma weights a_k, then J(x_{j_0})^T sum (1 - a_k) u_k + J(x_{j_last})^T sum a_k u_k;
    groups of at most 2 steps, and those ``exact`` names as (row, entry of the group's first step), exactly."""
    params = [p for _, p in policy.named_parameters()]
    scale = 1.0 / (len(rows) * batch.steps_per_sample)
    total, value = 0, 0.0

    def velocity(row, j):
        steps = torch.tensor([j])
        return policy.velocity(batch.states(row, steps), batch.timestep_values(steps), batch.cond[row])

    for i in rows:
        row = torch.tensor([i])
        trained = batch.train_steps[i].tolist()
        for start in range(0, len(trained), window):
            group = trained[start:start + window]
            if len(group) <= 2 or (i, start) in exact:
                for j in group:
                    loss = step_terms(batch, row, torch.tensor([j]), velocity(row, j)).loss.sum() * scale
                    total, value = total + loss, value + float(loss.detach())
                continue
            sigmas = [float(batch.sigmas[j]) for j in group]
            weights = [(s - sigmas[0]) / (sigmas[-1] - sigmas[0]) for s in sigmas]
            u_base, u_corr = 0, 0
            for j, a in zip(group, weights):
                with torch.no_grad():
                    v = velocity(row, j)
                v.requires_grad_(True)
                loss = step_terms(batch, row, torch.tensor([j]), v).loss.sum() * scale
                (u,) = torch.autograd.grad(loss, v)
                u_base, u_corr, value = u_base + (1 - a) * u, u_corr + a * u, value + float(loss.detach())
            total = total + (velocity(row, group[0]) * u_base).sum() + (velocity(row, group[-1]) * u_corr).sum()
    grads = torch.autograd.grad(total, params)
    return value, {n: g for (n, _), g in zip(policy.named_parameters(), grads)}



def linearity_reference(v: torch.Tensor) -> float:
    """Mean cosine of consecutive increments of the rows of ``v`` (m, D), straight from the definition."""
    inc = [(v[k + 1] - v[k]).double() for k in range(v.shape[0] - 1)]
    cos = [float(a @ b / (a.norm() * b.norm())) for a, b in zip(inc[:-1], inc[1:])]
    return sum(cos) / len(cos)


@contextmanager
def counted(policy) -> Iterator[PassCounter]:
    """The passes ``policy`` makes inside the block: yields a :class:`PassCounter` that reads zero inside it and,
    once the block ends, ``policy.counter`` less its value on entry (what ``policy.counter - before`` gives)."""
    before = policy.counter.copy()
    passes = PassCounter()
    yield passes
    spent = policy.counter - before
    for f in fields(spent):
        setattr(passes, f.name, getattr(spent, f.name))


def move_off_policy(policy, scale: float = 1e-3) -> None:
    """Perturb every parameter by ``scale`` x N(0, 1), so that ratios to a rollout's log-probs differ
    from 1 and the clip matters for some terms."""
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(scale * torch.randn_like(p))


def estimator_gradient(session, batch: TrainBatch) -> dict[str, torch.Tensor]:
    """The session's estimator's gradient on ``batch`` (its passes counted from a reset counter)."""
    session.policy.counter.reset()
    session.estimator.accumulate(session.policy, batch, UpdateStats(batch.clip_range))
    return {n: p.grad for n, p in session.policy.named_parameters()}


def sde_reference(kind: str, v, x, s: float, s_next: float, eta: float, s1: float):
    """Float64 transcription of docs/design.md's SDE transition from sigma ``s`` to ``s_next``, written
    without agg_bench.engine.sampler: its mean and standard deviation (``s1``: the schedule's second sigma,
    which flow_grpo's std uses in place of ``s`` = 1 at step 0)."""
    dt = s_next - s
    if kind == "flow_grpo":
        sp = s1 if s == 1 else s
        std_t = eta * math.sqrt(s / (1 - sp))
        mean = x * (1 + std_t**2 / (2 * s) * dt) + v * (1 + std_t**2 * (1 - s) / (2 * s)) * dt
        sd = std_t * math.sqrt(-dt)
    elif kind == "cps":  # arXiv 2509.05952: x' = (1 - s') x0 + s' (cos(eta pi/2) x1 + sin(eta pi/2) noise)
        x0, x1 = x - s * v, x + (1 - s) * v
        mean = (1 - s_next) * x0 + s_next * math.cos(eta * math.pi / 2) * x1
        sd = s_next * math.sin(eta * math.pi / 2)
    else:
        x0 = x - s * v
        score = -(x - x0 * (1 - s)) / s**2
        mean = x + dt * v - 0.5 * eta**2 * score * dt
        sd = eta * math.sqrt(s - s_next)
    return mean, sd


def gaussian_log_prob(x_next, mean, sd: float):
    """The log-density of ``x_next`` under N(mean, sd^2), averaged over elements."""
    return (-((x_next - mean) ** 2) / (2 * sd**2) - math.log(sd) - math.log(math.sqrt(2 * math.pi))).mean()


def relative_error(a: dict, b: dict) -> float:
    num = sum(float((a[k].double() - b[k].double()).pow(2).sum()) for k in a)
    den = sum(float(b[k].double().pow(2).sum()) for k in b)
    return (num / den) ** 0.5


def nft_dpm2_reference(sigmas: torch.Tensor, x: torch.Tensor, velocities: list[torch.Tensor]) -> list[torch.Tensor]:
    """The states of DiffusionNFT's ``dpm2`` ODE sampler (``flow_grpo/diffusers_patch/solver.py``, ``dpm_step`` of
    order 2), written from its equations in float64 tensors, where log(0) = -inf as torch computes it. With the
    data prediction m_i = x_i - s_i v_i: step 0 and the last step are DDIM with eta 0, x' = (1 - s') m + s' e
    with e = (x - (1 - s) m) / s; the others are second-order multistep with lambda = log(1 - s) - log(s),
    h = lambda' - lambda, r0 = (lambda - lambda_prev) / h, D1 = (m - m_prev) / r0 and
    x' = (s'/s) x - (1 - s')(e^{-h} - 1)(m + D1 / 2); a previous prediction at s = 1 gives r0 = inf, D1 = 0."""
    s = sigmas.to(torch.float64)
    n = len(velocities)
    lam = torch.log(1 - s) - torch.log(s)
    states, m_prev = [x], None
    for i, v in enumerate(velocities):
        m = x - s[i] * v
        if i == 0 or i == n - 1:
            e = (x - (1 - s[i]) * m) / s[i]
            x = (1 - s[i + 1]) * m + s[i + 1] * e
        else:
            h = lam[i + 1] - lam[i]
            r0 = (lam[i] - lam[i - 1]) / h
            d1 = (1.0 / r0) * (m - m_prev)
            x = (s[i + 1] / s[i]) * x - (1 - s[i + 1]) * torch.expm1(-h) * (m + 0.5 * d1)
        states.append(x)
        m_prev = m
    return states


def sa_solver_reference(sigmas: torch.Tensor, x: torch.Tensor, velocity, taus=None,
                        noises=None) -> dict[str, list[torch.Tensor]]:
    """AWM's SA-Solver sampler (arXiv 2309.05019, data prediction; the public ``SASolver.sample`` with predictor
    and corrector order 2, PEC, its first corrector off, the last step ``denoise_to_zero``) written from the
    paper's equations in float64, with the noise level ``taus[i]`` (default 0, the ODE) constant on step i: with
    lambda = log((1 - s) / s) and c = 1 + tau^2, a step from s_i to s_{i+1} is
    ``x' = e^{-tau^2 h} (s_{i+1} / s_i) x + s_{i+1} c e^{-tau^2 lambda_{i+1}} sum_k c_k D_k
    + s_{i+1} sqrt(1 - e^{-2 tau^2 h}) xi_i``, ``c_k = int_{lambda_i}^{lambda_{i+1}} e^{c l} L_k(l) dl`` over the
    Lagrange basis L_k of the nodes (lambda_i, lambda_{i-1}) for the predictor and (lambda_{i+1}, lambda_i) for
    the corrector, computed here by 40-point Gauss-Legendre quadrature, plus the code's order-2 few-step terms
    ``g = e^{c lambda_{i+1}} (h^2 / 2 - (c h - 1 + e^{-c h}) / c^2) / (lambda_i - lambda_{i-1})`` (predictor) and
    ``g = e^{c lambda_{i+1}} (h / 2 - (c h - 1 + e^{-c h}) / (c^2 h))`` (corrector), added to the newest node's
    coefficient and taken from the other's. The predictor and the corrector of step i take the same draw
    ``noises[i]`` (used where ``taus[i] > 0``). ``velocity(i, y)`` is the model at the state y of step i (called
    once per step). Returns the states the model was given (``evaluated``, T of them), the corrected states
    (``corrected``, the code's intermediates, T + 1 with the final) and ``states``: ``evaluated`` plus the final."""
    import numpy as np

    s = [float(v) for v in sigmas.to(torch.float64)]
    steps = len(s) - 1
    taus = [0.0] * steps if taus is None else [float(v) for v in taus]
    lam = [math.log((1 - v) / v) for v in s[:-1]]
    nodes, weights = np.polynomial.legendre.leggauss(40)

    def integral(a: float, b: float, basis, c: float) -> float:
        u = 0.5 * (b - a) * nodes + 0.5 * (b + a)
        return float(0.5 * (b - a) * np.sum(weights * np.exp(c * u) * basis(u)))

    def update(x, i, points, predictions, extra):
        """x at s_{i+1} from x at s_i, interpolating ``predictions`` at lambda ``points``."""
        a, b = lam[i], lam[i + 1]
        tau2 = taus[i] ** 2
        c = []
        for k, p in enumerate(points):
            others = [q for m, q in enumerate(points) if m != k]

            def basis(u, p=p, others=others):
                out = np.ones_like(u)
                for q in others:
                    out = out * (u - q) / (p - q)
                return out
            c.append(integral(a, b, basis, 1 + tau2))
        if len(points) == 2:
            c[0] += extra
            c[1] -= extra
        scale = s[i + 1] * (1 + tau2) * math.exp(-tau2 * b)
        out = math.exp(-tau2 * (b - a)) * (s[i + 1] / s[i]) * x + scale * sum(ck * d for ck, d in zip(c, predictions))
        if taus[i] > 0:
            out = out + s[i + 1] * math.sqrt(1 - math.exp(-2 * tau2 * (b - a))) * noises[i]
        return out

    def few_steps(i, h, predictor):
        """The code's order-2 term of the step into s_i (h its lambda step)."""
        c = 1 + taus[i - 1] ** 2
        integral_part = (c * h - 1 + math.exp(-c * h)) / c ** 2
        if predictor:
            return math.exp(c * lam[i]) * (h * h / 2 - integral_part) / (lam[i - 1] - lam[i - 2])
        return math.exp(c * lam[i]) * (h / 2 - integral_part / h)

    y = x
    d = [y - s[0] * velocity(0, y)]
    evaluated, corrected = [y], [x]
    for i in range(1, steps):
        h = lam[i] - lam[i - 1]
        if i == 1:
            y = update(x, 0, [lam[0]], [d[0]], 0.0)
        else:
            y = update(x, i - 1, [lam[i - 1], lam[i - 2]], [d[i - 1], d[i - 2]], few_steps(i, h, True))
        d.append(y - s[i] * velocity(i, y))
        if i == 1:
            x = y
        else:
            x = update(x, i - 1, [lam[i], lam[i - 1]], [d[i], d[i - 1]], few_steps(i, h, False))
        evaluated.append(y)
        corrected.append(x)
    corrected.append(d[-1])
    return {"evaluated": evaluated, "corrected": corrected, "states": [*evaluated, d[-1]]}


# ----- another writer ------------------------------------------------------------------------------------------
# a PID no process has: above the largest Linux gives (pid_max is at most 2**22), so a temporary named with it is
# a killed writer's
ENDED_PID = 2 ** 22 + 1


@contextmanager
def running_process() -> Iterator[int]:
    """The PID of a process that runs while the block runs (a live writer's, whose temporaries stay)."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        yield proc.pid
    finally:
        proc.kill()
        proc.wait()


HOLD = """
import sys
from agg_bench.outdir import Claim
Claim(sys.argv[1], folder=sys.argv[2] == "folder", lock_inside=sys.argv[3] == "inside").acquire()
print("held", flush=True)
sys.stdin.read()
"""


class Holder:
    """Another process holding the claim of ``target`` until closed (or killed)."""

    def __init__(self, target: Path, folder: bool, lock_inside: bool):
        self.proc = subprocess.Popen([sys.executable, "-c", HOLD, str(target), "folder" if folder else "file",
                                      "inside" if lock_inside else "beside"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
        assert self.proc.stdout.readline().strip() == "held"

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=30)

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(timeout=30)


def crafted_checkpoint(source, out, change) -> dict:
    """A copy of the run folder ``source`` at ``out`` whose checkpoint.pt ``change(state)`` edited in place;
    returns the copy's files' bytes, which a refused resume must leave as they are."""
    import shutil

    from agg_bench.runtime.checkpoint import CHECKPOINT_NAME

    shutil.copytree(source, out)
    state = torch.load(out / CHECKPOINT_NAME, weights_only=True)
    change(state)
    torch.save(state, out / CHECKPOINT_NAME)
    return {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}


def signal_after_first_optimizer_step(monkeypatch, call: int) -> list[int]:
    """Send this process SIGTERM once (a second would end it at once), after the first optimizer step of the
    ``call``-th (1-based) ``Session.update``; the list returned gets an entry for each optimizer step of that update,
    for the caller to check (the update took at least two: the signal came between two of its steps)."""
    import signal

    from agg_bench.runtime.train import Session

    original, calls, steps = Session.update, [], []

    def update(self, batch):
        calls.append(1)
        if len(calls) != call:
            return original(self, batch)

        def after_step(*args):
            steps.append(1)
            if len(steps) == 1:
                os.kill(os.getpid(), signal.SIGTERM)

        hook = self.optimizer.register_step_post_hook(after_step)
        try:
            return original(self, batch)
        finally:
            hook.remove()
            assert len(steps) >= 2, steps  # the update took its steps

    monkeypatch.setattr(Session, "update", update)
    return steps


class Hung(Exception):
    """A block still waiting (:func:`not_hung`); no OSError, which a reader may take for an unreadable file."""


@contextmanager
def not_hung(seconds: float = 10) -> Iterator[None]:
    """Raise :class:`Hung` in the block once ``seconds`` have passed (a read that waits on a named pipe for ever,
    the bug, ends the test instead of hanging it); not a measure of speed."""
    import signal

    def stop(signum, frame):
        raise Hung(f"still waiting after {seconds} s")

    previous = signal.signal(signal.SIGALRM, stop)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def bash_script(path: Path, body: str) -> Path:
    """An executable ``path`` that runs the bash ``body`` (a stand-in for an interpreter or a tool the code under
    test starts); its folder is made where missing."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"#!/bin/bash\n{body}\n")
    path.chmod(0o755)
    return path


# two visible GPUs of different models, as on a mixed node with CUDA_VISIBLE_DEVICES unset
FAKE_GPUS = (("NVIDIA A100-SXM4-40GB", 40 * 2**30), ("NVIDIA H200", 141 * 2**30))


def fake_two_gpus(monkeypatch, current: int) -> None:
    """torch.cuda as a process on such a node whose current device is ``current`` sees it (no GPU needed)."""
    from types import SimpleNamespace

    def index(device) -> int:
        return torch.device(device).index if isinstance(device, (str, torch.device)) else int(device)

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: len(FAKE_GPUS))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: current)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: FAKE_GPUS[index(device)][0])
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda device: SimpleNamespace(total_memory=FAKE_GPUS[index(device)][1]))


def exit_code(argv: list[str]) -> int:
    """``agg_bench.cli.main(argv)``'s exit code, argparse's refusal of a flag's value (SystemExit) included."""
    from agg_bench.cli import main

    try:
        return main(argv)
    except SystemExit as stop:
        return int(stop.code or 0)


class Calls:
    """Unpickling this calls ``function(*args)``."""

    def __init__(self, function, *args):
        self.function, self.args = function, args

    def __reduce__(self):
        return self.function, self.args


# ----- agg-bench processes that share their imports -------------------------------------------------------------
# Child scripts that run agg-bench's main in their own process, not as `python -m agg_bench` (FORKS here,
# test_permissions' SERVER), end a call as the interpreter ends a process: a SystemExit's code None is 0, an int
# itself, anything else printed on stderr and 1; an uncaught exception a traceback and 1; stdout and stderr
# flushed. The function, as script text (it needs sys and traceback imported).
EXIT_CODE = """
def exit_code(call):
    try:
        return call() or 0
    except SystemExit as stop:
        if stop.code is None or isinstance(stop.code, int):
            return stop.code or 0
        print(stop.code, file=sys.stderr)
        return 1
    except BaseException:
        traceback.print_exc()
        return 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
"""
FORKS = """
import atexit, json, os, sys, threading, traceback
import agg_bench.runtime.train  # torch, diffusers and the engine: what each command imports before its work
from agg_bench.cli import main

# and the model code a run imports once its config and folder are accepted (the session, the evaluation: the
# model libraries' classes, most of a run's start-up), as each command would import it first thing
agg_bench.runtime.train._import_model_code()
""" + EXIT_CODE + """

def as_main(cwd, argv):  # as `python -m agg_bench ARGV` in cwd: sys.exit(main()), then the exit handlers
    os.chdir(cwd)
    sys.argv = [os.path.join(os.path.dirname(agg_bench.__file__), "__main__.py"), *argv]
    code = exit_code(lambda: main(argv))
    threading._shutdown()  # as the interpreter's exit: its threads joined, then the exit handlers
    atexit._run_exitfuncs()
    return code


for cwd, argv in json.loads(sys.argv[1]):
    pid = os.fork()
    if pid == 0:  # the outer exit_code: a traceback of what failed around main (the folder, an exit handler)
        os._exit(exit_code(lambda: as_main(cwd, argv)))
    code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    if code:
        sys.exit(f"{argv[:1]} in {cwd}: exit code {code}")
"""


def agg_bench_processes(commands: list[tuple[str, Path]], env: dict[str, str]) -> None:
    """Run each (``python -m agg_bench ...`` command line, folder) one after the other, each a process of its own
    forked from one interpreter that has imported the model code and run nothing else: each starts as a fresh
    ``python -m agg_bench`` process is once its imports are done (no state of another command, in memory or in
    torch), without each paying the imports (about 6 CPU-s). Fails on the first command that exits non-zero."""
    import json
    import shlex

    jobs, python = [], None
    for command, cwd in commands:
        words = shlex.split(command)
        assert words[1:3] == ["-m", "agg_bench"] and python in (None, words[0]), command
        python = words[0]
        jobs.append((str(cwd), words[3:]))
    assert python is not None
    proc = subprocess.run([python, "-c", FORKS, json.dumps(jobs)], env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]


@contextmanager
def sweep_checks_here() -> Iterator[None]:
    """The child process of a sweep's checks (agg_bench.tools.sweep._checked_in_child starts ``python -m
    agg_bench.tools.sweep``: about three CPU-seconds of imports for each request its cache has not seen) run in
    this process, where torch is imported already: the same request on stdin, the same answer on stdout, kept
    in the same cache under the same key; an exception that escapes it is the child's exit code 1 and its
    traceback. Other uses of subprocess go on as they are."""
    import io
    import traceback
    import types
    from contextlib import redirect_stdout

    from agg_bench.tools import sweep

    def run(args, *, input, capture_output, text, env):
        assert args[1:] == ["-m", "agg_bench.tools.sweep"] and capture_output and text, args
        stdin, out = sys.stdin, io.StringIO()
        sys.stdin = io.StringIO(input)
        try:
            with redirect_stdout(out):
                code, err = sweep._main(), ""
        except Exception:
            code, err = 1, traceback.format_exc()
        finally:
            sys.stdin = stdin
        return subprocess.CompletedProcess(args, code, out.getvalue(), err)

    here = types.SimpleNamespace(run=run)
    sweep.subprocess = here
    try:
        yield
    finally:
        if sweep.subprocess is here:
            sweep.subprocess = subprocess


def methods_checked_here(monkeypatch) -> list[list[str]]:
    """A sweep's methods' check (agg_bench.tools.sweep.checked_methods, a child process that imports the model code:
    seconds) run in this process, where torch is imported already; the jobs of each call, in order."""
    from agg_bench.tools import sweep

    calls: list[list[str]] = []

    def check(base_file, jobs, cache_dir=None, replays=None):
        calls.append(list(jobs))
        return sweep.check_methods(base_file, jobs, replays)

    monkeypatch.setattr(sweep, "checked_methods", check)
    return calls


def watched_model_reuse(monkeypatch) -> list:
    """``model_reuse.reusing_models`` watched (monkeypatch it in): each reuse scope entered, in order, whose
    ``builds`` say how many models were built in it."""
    from agg_bench.runtime import model_reuse

    reuses: list = []
    original = model_reuse.reusing_models

    @contextmanager
    def watched():
        with original() as reuse:
            reuses.append(reuse)
            yield reuse

    monkeypatch.setattr(model_reuse, "reusing_models", watched)
    return reuses


def watched_open(on_read):
    """A stand-in for ``jsonfiles.open_regular`` (monkeypatch it in): the file opened by the real one, calling
    ``on_read()`` before each ``read`` and ``readline``, which may record the call or raise."""
    from agg_bench import jsonfiles

    real_open = jsonfiles.open_regular

    class Watched:
        def __init__(self, path):
            self.handle = real_open(path)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.handle.close()

        def fileno(self):
            return self.handle.fileno()

        def read(self, *args):
            on_read()
            return self.handle.read(*args)

        def readline(self, *args):
            on_read()
            return self.handle.readline(*args)

    return Watched


def torchrun(*args: str, env: dict | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    """``python -m torch.distributed.run --standalone --nproc_per_node 2 ARGS`` in the repository, one OpenMP thread
    per process; its processes import the shared helpers and the test files from tests/ (a test file or
    tests/integration/two_processes.py is their script)."""
    shared = os.pathsep.join(filter(None, [str(ROOT / "tests"), str(ROOT), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": shared, **(env or {})}
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           *args], capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)
