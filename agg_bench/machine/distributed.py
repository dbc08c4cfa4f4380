"""Data-parallel training over the processes that torchrun starts.

Launch: ``torchrun --nproc_per_node K -m agg_bench run --config FILE --out DIR`` (gloo on CPU, nccl on
CUDA, one GPU per process: ``cuda:$LOCAL_RANK``). Without torchrun's environment everything here is a
no-op and a run is one process.

**The batch.** Every process draws the whole iteration's randomness exactly as a single process would
(prompts, initial noise, the SDE noise of every rollout step, the trained steps) from the shared
``iteration_generator``, and keeps one consecutive share of the prompts, each with its whole GRPO group
(``grpo.prompts_per_iteration`` must be a multiple of K). During the rollout the sampler runs on the
whole batch so that its random draws match, but the transformer only evaluates this process's rows
(:class:`ShareView`); the rows of other processes get a zero velocity and are dropped after sampling.
The price is the whole batch's latent buffers during the rollout, not its transformer work. So the
union of the K shares is the single-process batch, sample for sample. Every process calls the
transformer once per step, on equal shares, as a sharded model needs.

**The gradient.** Every backward pass of an update accumulates into the local ``.grad`` without any
communication; :func:`average_gradients` then averages every ``.grad`` over the processes in one
bucketed all-reduce per optimizer step. That is what DDP's ``no_sync()`` around every backward but the
last achieves, done by hand because the number of backward passes per update differs between
processes: AGG routes a data-dependent number of groups through its two endpoint backwards and the
rest through per-step backwards, and DDP's reducer expects the synchronizing backward to run the same
buckets on every process. Each process's loss is scaled by 1/(B_local N) and all hold B_local = B/K
samples, so the average of the local gradients is the single-process gradient of
L = 1/(B N) sum l_ij. AGG routes on the scores of all processes' groups at once (gathered), so the routed
set, and with it the gradient, is the single-process one for every ``route_frac``. With ``train.minibatches`` M,
each process splits its whole groups into M mini-batches (``groups``: local group l into mini-batch l mod M, M
dividing its groups; ``slices``: the k-th slice of each of its groups into mini-batch k), so the union of the
processes' k-th mini-batches is the single-process run's k-th, and each optimizer step averages their gradients
as above.

**FSDP** (``train.shard: fsdp``, :mod:`agg_bench.machine.fsdp`): parameters, gradients and optimizer state are
sharded with FSDP2 instead of replicated. Its reduce-scatter in every backward already averages the
gradients, so :func:`average_gradients` then averages only the loss. Its forwards and backwards are
collectives, so every method makes the same sequence of transformer calls on every process: loops whose
length depends on the data agree their length first and pad with passes that change no gradient
(:func:`agg_bench.machine.fsdp.lockstep`). Without torchrun, ``fsdp`` runs on a process group of one process.

**Records.** Each process measures its share; :func:`gather` brings all shares to every process,
:func:`combine` merges them into one record (rules at :data:`SUMMED_KEYS`), every process takes the same
decisions from it (divergence, stopping) and rank 0 writes it.

**Failures.** A process that fails joins the next collective of the others through
:func:`report_failure`; their :func:`gather` then raises :class:`PeerFailure` (a :class:`UserError` for a
user error), so all stop together instead of waiting for each other forever. Signals are shared the same
way: torchrun forwards SIGTERM/SIGINT to every process, each at its own moment, and the processes stop together
at the next point they all reach (a sampler step, a sharded transformer call, a phase: :func:`exchange_signal`,
:mod:`agg_bench.stopping`). A process that is stuck
but alive, or that fails inside a sharded forward the others are waiting in, ends the job when their
collective times out: after ``AGG_BENCH_DIST_TIMEOUT_S`` seconds (:func:`collective_timeout`, default
600) instead of the backend's 30 minutes. Only rank 0 writes files and prints the CLI's result line.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Iterator, Sequence

import torch
import torch.distributed as dist

from .. import stopping
from ..config import check_data_parallel, read_number
from ..errors import JobLost, UserError, alike_on_every_process, mark_alike, raised_by
from ..records import MAX_GPUS
from . import fsdp

# Per-record fields whose shares add up (work done, energy, power of all GPUs); the others are
# maxima (times, memory peaks, ratio_dev: see :func:`combine`), means (numbers) or rank 0's value.
SUMMED_KEYS = frozenset({
    "forward_nograd", "forward_grad", "backward", "energy_j", "power_mean_w",
    "train_forward_nograd", "train_forward_grad", "train_backward",
    "agg_groups", "agg_groups_routed", "cache_computed", "cache_skipped",
})
MAX_KEYS = frozenset({"ratio_dev"})
# means over a list whose shares may differ in length between processes (AGG's routed groups at route_frac < 1):
# the mean of the joined list, not of the processes' means
LIST_MEANS = {"agg_route_score_mean": "agg_route_scores"}
# elements per all-reduce call: the flat copy of one bucket is the extra memory of averaging
BUCKET_ELEMENTS = 1 << 25
_SHARED = "_agg_bench_shared"
TIMEOUT_ENV = "AGG_BENCH_DIST_TIMEOUT_S"
DEFAULT_TIMEOUT_S = 600
MAX_TIMEOUT_S = 7 * 24 * 3600
# below a second two processes' rendezvous fails before the second one joins, reported as a bug (0.001)
MIN_TIMEOUT_S = 1


@dataclass(frozen=True)
class Shard:
    """This process's place in the job: ``rank`` of ``world_size`` processes."""

    rank: int = 0
    world_size: int = 1

    @property
    def is_main(self) -> bool:
        """The process that writes files and shows progress."""
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    def rows(self, total: int) -> slice:
        """This process's consecutive share of ``total`` rows (``total`` a multiple of the world size)."""
        per = total // self.world_size
        return slice(self.rank * per, (self.rank + 1) * per)

    def check_run(self, cfg) -> None:
        """Raise a ConfigError for a run that cannot be split into whole GRPO groups per process."""
        check_data_parallel(cfg, self.world_size)


def current() -> Shard:
    """The shard of this process: from the initialized process group, else a single process."""
    if dist.is_available() and dist.is_initialized():
        return Shard(dist.get_rank(), dist.get_world_size())
    return Shard()


def _launch_variable(name: str, default: int, low: int, high: int) -> int:
    """The integer torchrun put in environment variable ``name`` (``default`` when unset), read as every number
    of the harness is (:func:`~agg_bench.config.read_number`: decimal digits, so ``017`` is no 17); a UserError
    naming the variable when it is not an integer from ``low`` to ``high``."""
    raw = os.environ.get(name)
    if raw is None:
        return default
    value = read_number(raw, int)
    if value is None or not low <= value <= high:
        raise UserError(f"environment variable {name}={raw[:40]!r}: expected an integer from {low} to {high} in "
                        "decimal digits (torchrun sets it; unset it to run one process)")
    return value


def launched_world_size() -> int:
    """Processes torchrun started for this job (1 without torchrun)."""
    return _launch_variable("WORLD_SIZE", 1, 1, MAX_GPUS)


def launched_rank() -> int:
    """This process's rank among those torchrun started (0 without torchrun); valid before and after
    the process group exists."""
    return _launch_variable("RANK", 0, 0, launched_world_size() - 1)


def result_line(result: dict) -> None:
    """Print a verb's JSON result line on stdout, from rank 0 only: one line per job, not one per torchrun
    process (the processes share one pipe, where two lines may run into each other)."""
    if launched_rank() == 0:
        print(json.dumps(result), flush=True)


def launched_local_rank(default: int) -> int:
    """This process's rank on its machine, which picks its GPU (``default`` without torchrun)."""
    return _launch_variable("LOCAL_RANK", default, 0, MAX_GPUS - 1)


RENDEZVOUS_VARIABLES = ("WORLD_SIZE", "RANK", "MASTER_ADDR", "MASTER_PORT")


def check_rendezvous_variables() -> None:
    """Raise a UserError naming the first of the variables torchrun sets together for a rendezvous
    (:data:`RENDEZVOUS_VARIABLES`) that is missing or empty, or a ``MASTER_PORT`` that is not a port;
    without them ``init_process_group`` fails with a traceback instead."""
    for name in RENDEZVOUS_VARIABLES:
        if not os.environ.get(name, "").strip():
            present = ", ".join(f"{k}={os.environ[k][:40]!r}" for k in RENDEZVOUS_VARIABLES if k in os.environ)
            missing = "is empty" if name in os.environ else "is not set"
            raise UserError(f"environment variable {name} {missing} ({present}): torchrun sets "
                            f"{', '.join(RENDEZVOUS_VARIABLES)} together (unset them all to run one process)")
    _launch_variable("MASTER_PORT", 0, 1, 65535)


def collective_timeout() -> timedelta:
    """How long a collective waits for the other processes before it fails: ``AGG_BENCH_DIST_TIMEOUT_S``
    seconds (default :data:`DEFAULT_TIMEOUT_S`, from :data:`MIN_TIMEOUT_S` to :data:`MAX_TIMEOUT_S`). A process that is stuck but alive then ends the job
    instead of blocking the others for the backend's default 30 minutes."""
    raw = os.environ.get(TIMEOUT_ENV, str(DEFAULT_TIMEOUT_S))
    seconds = read_number(raw, float)
    if seconds is None or not MIN_TIMEOUT_S <= seconds <= MAX_TIMEOUT_S:
        raise UserError(f"environment variable {TIMEOUT_ENV}={raw[:40]!r}: expected seconds from {MIN_TIMEOUT_S} to "
                        f"{MAX_TIMEOUT_S}, a decimal number (e.g. 600 or 1.5e3)")
    return timedelta(seconds=seconds)


@contextlib.contextmanager
def process_group(device: torch.device, single: bool = False) -> Iterator[Shard]:
    """This process's shard for the block: under torchrun (WORLD_SIZE > 1) it joins the process group,
    nccl for a CUDA device after selecting the GPU of ``LOCAL_RANK``, gloo otherwise, and leaves it
    after the block. Without torchrun it is one process, and with ``single`` (FSDP needs a group) it
    joins a group of this one process (an in-memory store: nothing listens on the network). A group
    that already exists is used and kept. Collectives time out after :func:`collective_timeout`. A collective
    that fails because another process of the job has gone (:func:`peer_lost`) leaves the block as
    :class:`~agg_bench.errors.JobLost`."""
    joined = False
    launched_rank(), launched_local_rank(0)  # the launcher's variables are checked, joined or not
    if not dist.is_initialized() and (launched_world_size() > 1 or single):
        with alike_on_every_process():  # the launcher gives every process of a machine the same environment
            timeout = collective_timeout()
        backend = "nccl" if device.type == "cuda" else "gloo"
        if device.type == "cuda":  # torchrun: the GPU of LOCAL_RANK; one process: the configured one
            torch.cuda.set_device(launched_local_rank(device.index or 0))
        if launched_world_size() > 1 or "MASTER_ADDR" in os.environ:
            check_rendezvous_variables()
            with stopping.ending_at_once():  # the rendezvous waits in C++ for every process, up to the timeout
                dist.init_process_group(backend, timeout=timeout)
        else:
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
        joined = True
    try:
        yield current()
    except RuntimeError as err:
        lost = peer_lost(err)
        if lost is None:
            raise
        raise JobLost(f"another process of this job ended ({lost}); this one stops too: the output of the process "
                      "that ended first says why") from err
    finally:
        if joined and dist.is_initialized():
            dist.destroy_process_group()


# what gloo's transport says when the process at the other end of a connection has gone
_PEER_GONE = re.compile(r"Connection (closed|reset) by peer|Broken pipe")


def peer_lost(err: BaseException) -> str | None:
    """The line of ``err`` (a collective's failure) that says another process of a job of several processes
    has gone, None for any other error or where this process is alone."""
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return None
    return next((line.strip() for line in str(err).splitlines() if _PEER_GONE.search(line)), None)


def _comm_device() -> torch.device:
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


# ----- the batch -------------------------------------------------------------------------------
class ShareView:
    """A policy as the sampler sees it on one process: called on the whole batch, it evaluates the
    transformer on ``rows`` only and returns zero velocity elsewhere; every other attribute is the
    policy's (device, dtype, version, counter, ...)."""

    def __init__(self, policy, rows: slice):
        self._policy = policy
        self._rows = rows

    def __getattr__(self, name: str) -> Any:
        return getattr(self._policy, name)

    def velocity(self, latents: torch.Tensor, timesteps: torch.Tensor, cond) -> torch.Tensor:
        """The velocity of the whole batch, this process's rows computed. Every process samples the whole
        batch, so each sampler step's call is a point they all reach in the same order: a run's processes stop
        here together (:func:`agg_bench.stopping.check`); a sharded model's own call is that point already."""
        if not fsdp.is_sharded(self._policy):
            stopping.check()
        rows = self._rows
        mine = self._policy.velocity(latents[rows], timesteps[rows], cond[rows])
        out = mine.new_zeros((latents.shape[0], *mine.shape[1:]))
        out[rows] = mine
        return out


def rollout_policy(policy, shard: Shard, total: int):
    """The policy to sample the whole batch of ``total`` rows with on this shard."""
    return policy if not shard.distributed else ShareView(policy, shard.rows(total))


def take(value, shard: Shard, total: int):
    """This shard's rows of a batch-first tensor or Conditioning of ``total`` rows; a copy, so the
    whole batch's storage can be freed (the value itself for one process)."""
    if not shard.distributed:
        return value
    rows = shard.rows(total)
    index = torch.arange(rows.start, rows.stop)
    if isinstance(value, torch.Tensor):
        return value[index.to(value.device)]
    return value[index]


def take_trajectory(traj, shard: Shard):
    """This shard's samples of a whole-batch trajectory."""
    if not shard.distributed:
        return traj
    total = traj.latents.shape[0]
    rows = lambda t: None if t is None else take(t, shard, total)
    return dataclasses.replace(traj, latents=take(traj.latents, shard, total),
                               velocities=take(traj.velocities, shard, total),
                               log_probs=take(traj.log_probs, shard, total),
                               transitions=rows(traj.transitions), forwarded=rows(traj.forwarded))


# ----- the gradient ----------------------------------------------------------------------------
def _buckets(tensors: Sequence[torch.Tensor]) -> Iterator[list[torch.Tensor]]:
    """Consecutive runs of tensors of one device and dtype, at most BUCKET_ELEMENTS each (a larger
    tensor is a bucket of its own)."""
    bucket: list[torch.Tensor] = []
    size = 0
    for t in tensors:
        if bucket and (t.device != bucket[0].device or t.dtype != bucket[0].dtype
                       or size + t.numel() > BUCKET_ELEMENTS):
            yield bucket
            bucket, size = [], 0
        bucket.append(t)
        size += t.numel()
    if bucket:
        yield bucket


def average_gradients(params: Sequence[torch.nn.Parameter], *scalars: float) -> tuple[float, ...]:
    """Average every parameter's ``.grad`` over the processes (a parameter without ``.grad`` on some
    processes counts as zero there and stays without on all if none has one), and average ``scalars``.

    One process: nothing is communicated and ``scalars`` come back unchanged.
    """
    shard = current()
    if not shard.distributed:
        return tuple(scalars)
    device = _comm_device()
    present = torch.tensor([p.grad is not None for p in params], dtype=torch.int32, device=device)
    dist.all_reduce(present, op=dist.ReduceOp.MAX)
    grads = []
    for p, has in zip(params, present.tolist()):
        if has:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            grads.append(p.grad)
    for bucket in _buckets(grads):
        flat = torch.cat([g.reshape(-1) for g in bucket])
        dist.all_reduce(flat)
        flat.div_(shard.world_size)
        offset = 0
        for g in bucket:
            g.copy_(flat[offset: offset + g.numel()].view_as(g))
            offset += g.numel()
    values = torch.tensor(scalars, dtype=torch.float64, device=device)
    dist.all_reduce(values)
    return tuple(float(v) for v in values.div_(shard.world_size).cpu())


# ----- records ---------------------------------------------------------------------------------
def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _combine_key(key: str, values: list) -> Any:
    present = [v for v in values if v is not None]
    if not present:
        return None
    if all(isinstance(v, list) for v in present):
        return [item for v in present for item in v]
    if not all(_is_number(v) for v in present):
        return values[0]
    if key in SUMMED_KEYS:
        return sum(present)
    if key in MAX_KEYS or key.endswith("_bytes") or (key.startswith("t_") and key.endswith("_s")):
        return max(present)
    return sum(present) / len(present)


def combine(parts: Sequence[dict]) -> dict:
    """One record from the processes' shares: :data:`SUMMED_KEYS` add up; times (``t_*_s``), memory
    peaks (``*_bytes``) and :data:`MAX_KEYS` take the maximum (the slowest process, the fullest
    device); lists concatenate; :data:`LIST_MEANS` are the mean of their joined list (None where it is empty);
    other numbers average (per-process means over equal shares, or values equal on every process); anything
    else is rank 0's. None where no process has a value. A single share is returned as it is."""
    if len(parts) == 1:
        return dict(parts[0])
    keys = list(dict.fromkeys(k for part in parts for k in part))
    out = {k: _combine_key(k, [part.get(k) for part in parts]) for k in keys}
    for mean, items in LIST_MEANS.items():
        if mean in out and isinstance(out.get(items), list):
            out[mean] = sum(out[items]) / len(out[items]) if out[items] else None
    return out


# ----- failures --------------------------------------------------------------------------------
class PeerFailure(RuntimeError):
    """Another process failed: ``rank``, ``kind`` ("oom" or "error"), its ``message`` and, for an
    out-of-memory error, what its allocator held (``memory``)."""

    def __init__(self, rank: int, kind: str, message: str, memory: dict | None = None):
        self.rank, self.kind, self.memory = rank, kind, memory or {}
        super().__init__(f"process {rank} failed: {message}")

    @property
    def is_oom(self) -> bool:
        return self.kind == "oom"


def is_shared(exc: BaseException) -> bool:
    """True when every process already knows about ``exc``."""
    return getattr(exc, _SHARED, False)


def _mark(exc: BaseException) -> BaseException:
    with contextlib.suppress(AttributeError):
        setattr(exc, _SHARED, True)
    return exc


def _describe(exc: BaseException, memory: dict | None) -> dict:
    from .telemetry import is_oom_error

    kind = "user" if isinstance(exc, UserError) else "oom" if is_oom_error(exc) else "error"
    message = str(exc) if kind == "user" else f"{type(exc).__name__}: {exc}"
    return {"rank": current().rank, "kind": kind, "message": message, "memory": memory}


def _exchange(failure: dict | None, payload: Any) -> list:
    items: list = [None] * current().world_size
    dist.all_gather_object(items, (failure, payload))
    return items


def gather(payload: Any = None) -> list:
    """Every process's ``payload``, in rank order (``[payload]`` for one process). If another process
    reported a failure instead (:func:`report_failure`), raise it here: a UserError as the same
    UserError, anything else as :class:`PeerFailure`."""
    shard = current()
    if not shard.distributed:
        return [payload]
    items = _exchange(None, payload)
    failures = [f for f, _ in items if f is not None]
    if failures:
        first = failures[0]
        if first["kind"] == "user":
            raise _mark(raised_by(UserError(first["message"]), first["rank"]))
        raise _mark(PeerFailure(first["rank"], first["kind"], first["message"], first["memory"]))
    return [p for _, p in items]


def report_failure(exc: BaseException, memory: dict | None = None) -> None:
    """Tell the other processes that ``exc`` stopped this one, at their next :func:`gather` (once per
    exception; nothing to do for one process). ``memory``: the allocator's state for an OOM (taken
    here when not given). A user error that every process reported at this same point with the same message
    is marked alike (:func:`agg_bench.errors.mark_alike`): the first process of each machine prints it."""
    from .telemetry import is_oom_error, memory_at_failure

    if is_shared(exc):
        return
    _mark(exc)
    if not current().distributed:
        return
    if memory is None and is_oom_error(exc) and torch.cuda.is_available() and torch.cuda.is_initialized():
        memory = memory_at_failure(torch.device("cuda", torch.cuda.current_device()))
    mine = _describe(exc, memory)
    failures = [failure for failure, _ in _exchange(mine, None)]
    if mine["kind"] == "user" and all(f is not None and (f["kind"], f["message"]) == ("user", mine["message"])
                                      for f in failures):
        mark_alike(exc)


def exchange_signal(signum: int) -> int:
    """The signal some process received (the largest number; 0: none), given this process's (0: none): a
    collective through :func:`gather`, so a failure another process reported is raised here as there. What
    :func:`agg_bench.stopping.together` exchanges, so that a run's processes stop at the same point."""
    return max(gather(int(signum)))


@contextlib.contextmanager
def failures_shared() -> Iterator[None]:
    """A block that ends at a point every process reaches: if it raises on any process, it raises on
    all (the others get :func:`gather`'s error), so no process enters the next collective alone."""
    try:
        yield
    except Exception as exc:
        report_failure(exc)
        raise
    gather()


def on_main(fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` on rank 0 only (None elsewhere); if it raises, every process raises."""
    with failures_shared():
        return fn(*args, **kwargs) if current().is_main else None
