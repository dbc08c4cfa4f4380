"""Sharding the policy with FSDP2 (``train.shard: fsdp``), and the lockstep it asks of every method.

:func:`shard_policy` wraps each transformer block and then the whole transformer with
``torch.distributed.fsdp.fully_shard``: parameters, gradients and AdamW state are split over the
processes, and every forward all-gathers a block's parameters just before it runs (and every backward
again, then reduce-scatters its gradient, averaged over the processes). ``model.dtype: bfloat16`` adds a
``MixedPrecisionPolicy`` (bfloat16 parameters in the forward, float32 gradient reduction) and
``train.cpu_offload`` a ``CPUOffloadPolicy`` (shards and optimizer state live in host memory).
Gradient checkpointing and LoRA compose with it: checkpointing recomputes a block inside backward,
which all-gathers it again; with LoRA only the adapters have gradients and optimizer state.

**Lockstep.** Those all-gathers and reduce-scatters are collectives: every process must make the same
sequence of transformer calls (no-grad forward, forward with grad, backward), or one waits forever for
the others. The batch split makes most loops equal by construction (every process holds B/K samples
with the same number of trained steps), but some depend on the data: AGG's routed and exact groups per
process, the reference and endpoint passes that follow from them, the steps a cached walk trains. Each
such loop goes through :func:`lockstep`: the processes agree the largest count of calls first (one
all-reduce), and a process with fewer real calls makes *padding passes* (:func:`padding_pass`): the same
kind of call on one of its own samples, whose output is not used and whose backward carries a zero
gradient, so it adds exactly nothing to any gradient. Padding passes are real DiT passes: they are
counted in ``forward_nograd`` / ``forward_grad`` / ``backward`` like any other (and in
``Policy.padding_passes``), so the records show what the sharded run really computed.

Without sharding nothing here communicates: :func:`lockstep` yields its items and pads nothing.
"""
from __future__ import annotations

import math
from typing import Iterable, Iterator, Literal, Sequence, TypeVar

import torch
import torch.distributed as dist

from ..config import RunConfig
from ..errors import ConfigError

# Module lists that hold a family's transformer blocks (SD3 and Qwen-Image: transformer_blocks; FLUX
# also single_transformer_blocks): each block is one FSDP unit, the rest of the transformer the root's.
BLOCK_LISTS = ("transformer_blocks", "single_transformer_blocks")
T = TypeVar("T")
Kind = Literal["nograd", "grad", "exact"]


def enabled(cfg: RunConfig) -> bool:
    """True when the run asks for FSDP sharding."""
    return cfg.train.shard == "fsdp"


def check_options(cfg: RunConfig) -> None:
    """Raise a ConfigError for sharding options that no device can honour (what ``agg-bench plan`` refuses too)."""
    train = cfg.train
    if train.cpu_offload and not enabled(cfg):
        raise ConfigError("train.cpu_offload", True, "false unless train.shard is 'fsdp' (it offloads FSDP shards)")
    if train.eval_ema is not None and enabled(cfg):
        raise ConfigError("train.eval_ema", train.eval_ema, "null with train.shard 'fsdp' (the evaluation average is "
                          "a whole copy of the trained parameters, saved whole in checkpoint.pt)")


def check_run(cfg: RunConfig) -> None:
    """Raise a ConfigError for sharding options that cannot be honoured on this machine, before anything is
    written."""
    check_options(cfg)
    train = cfg.train
    on_cpu = cfg.device == "cpu" or (cfg.device == "auto" and not torch.cuda.is_available())
    if train.cpu_offload and on_cpu:
        raise ConfigError("train.cpu_offload", True, f"false with device {cfg.device!r} (it moves GPU shards to "
                          "host memory; on the CPU they are there already)")


def is_sharded(policy) -> bool:
    """Whether ``policy``'s transformer is wrapped by :func:`shard_policy`."""
    from torch.distributed.fsdp import FSDPModule

    return isinstance(getattr(policy, "transformer", None), FSDPModule)


def _blocks(transformer: torch.nn.Module) -> list[torch.nn.Module]:
    blocks = [b for name in BLOCK_LISTS for b in getattr(transformer, name, None) or []]
    if not blocks:
        raise ConfigError("train.shard", "fsdp", f"'none' for {type(transformer).__name__} (no transformer blocks found "
                          f"in {list(BLOCK_LISTS)})")
    return blocks


def shard_policy(policy, dtype: str, cpu_offload: bool) -> None:
    """Wrap every transformer block of ``policy``, then its transformer, with ``fully_shard`` over all
    processes of the initialized process group. ``dtype`` (``model.dtype``) "bfloat16" computes in
    bfloat16 and reduces gradients in float32; ``cpu_offload`` keeps shards in host memory."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    if not dist.is_initialized():
        raise ConfigError("train.shard", "fsdp", "'none' here: FSDP needs the process group of `agg-bench run` "
                          "(one process, or one per GPU under torchrun)")
    compute = policy.device
    if cpu_offload and compute.type != "cuda":
        raise ConfigError("train.cpu_offload", True, f"false on device {compute.type!r} (it moves GPU shards to host memory)")
    options: dict = {}
    if dtype == "bfloat16":
        options["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if cpu_offload:
        options["offload_policy"] = CPUOffloadPolicy()
    for block in _blocks(policy.transformer):
        fully_shard(block, **options)
    # The root too reshards after every forward (FSDP's default keeps it gathered until the backward):
    # a no-grad forward then leaves nothing gathered, and the parameters the optimizer and the gradient
    # norm see are the sharded ones between any two calls.
    fully_shard(policy.transformer, reshard_after_forward=True, **options)
    policy.compute_device = compute  # with offloading the parameters live on the CPU, the work does not
    policy.padding_passes = 0


def shard_run(cfg: RunConfig, policy, reference=None) -> None:
    """Shard the run's policy and, when it is a separate copy, its KL reference (a no-op without
    ``train.shard: fsdp``). A LoRA reference is the policy's own transformer and is sharded with it."""
    if not enabled(cfg):
        return
    shard_policy(policy, cfg.model.dtype, cfg.train.cpu_offload)
    if reference is not None and reference.transformer is not policy.transformer:
        shard_policy(reference, cfg.model.dtype, cfg.train.cpu_offload)
    elif reference is not None:
        reference.compute_device, reference.padding_passes = policy.compute_device, 0


# ----- lockstep ------------------------------------------------------------------------------
def agreed_max(policy, counts: Sequence[int] | torch.Tensor) -> torch.Tensor:
    """Elementwise maximum of ``counts`` over the processes when ``policy`` is sharded (one
    all-reduce), else ``counts``; an int64 CPU tensor."""
    values = torch.as_tensor(counts, dtype=torch.int64).reshape(-1)
    if not is_sharded(policy) or dist.get_world_size() == 1:
        return values
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else values.device
    shared = values.to(device)
    dist.all_reduce(shared, op=dist.ReduceOp.MAX)
    return shared.cpu()


def lockstep(policy, batch, items: Iterable[T], kind: Kind, reference=None) -> Iterator[T]:
    """Yield ``items``, one per transformer call of the given ``kind`` the caller makes for it; when
    ``policy`` is sharded and another process has more items, then make padding passes
    (:func:`padding_pass`) until this process made as many calls as the one with the most. ``kind``: ``nograd`` (a no-grad forward), ``grad`` (a forward with grad and
    its backward), ``exact`` (``full``'s per-step backward: ``reference``'s no-grad forward when
    ``batch.beta`` > 0, then forward with grad and backward).

    Every process must reach the same :func:`lockstep` loops in the same order (the agreement is a
    collective): call it even with no items."""
    items = list(items)
    total = int(agreed_max(policy, [len(items)])[0])
    yield from items
    for _ in range(total - len(items)):
        padding_pass(policy, batch, kind, reference)


def padding_pass(policy, batch, kind: Kind, reference=None) -> None:
    """One transformer call of ``kind`` (see :func:`lockstep`) on this process's first sample at its
    first trained step: its output is dropped and its backward carries a zero gradient, so it joins the
    other processes' collectives and changes no gradient. Counted like any pass."""
    device = batch.latents.device
    rows = torch.zeros(1, dtype=torch.long, device=device)
    steps = batch.train_steps[:1, 0].to(device)
    x, t, cond = batch.states(rows, steps), batch.timestep_values(steps), batch.cond[rows]
    if kind == "exact" and batch.beta > 0 and reference is not None:
        with torch.no_grad():
            reference.velocity(x, t, cond)
        reference.padding_passes = getattr(reference, "padding_passes", 0) + 1
    with torch.set_grad_enabled(kind != "nograd"):
        out = policy.velocity(x, t, cond)
    if out.requires_grad:
        out.backward(torch.zeros_like(out))
    policy.padding_passes = getattr(policy, "padding_passes", 0) + 1


# ----- gradients -----------------------------------------------------------------------------
def parameters_finite(params: Sequence[torch.nn.Parameter]) -> bool:
    """Whether every element of ``params`` is finite: over whole tensors, or for sharded (DTensor) parameters
    over every process's shard, the same answer on every process. One reduction per tensor (its largest
    magnitude, which allocates nothing of a parameter's size and cannot overflow as a sum of squares could)
    and one synchronisation."""
    from torch.distributed.tensor import DTensor

    tensors = [(p.to_local() if isinstance(p, DTensor) else p).detach() for p in params]
    tensors = [t for t in tensors if t.numel()]  # a process's empty shard has no largest element
    device = tensors[0].device if tensors else torch.device("cpu")
    finite = [torch.isfinite(torch.linalg.vector_norm(t, ord=math.inf)).to(device) for t in tensors]
    bad = ~torch.stack(finite).all() if finite else torch.zeros((), dtype=torch.bool)
    if any(isinstance(p, DTensor) for p in params):
        flag = bad.to(torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl"
                      else torch.device("cpu"), torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        bad = flag
    return not bool(bad)


def gradient_norm(params: Sequence[torch.nn.Parameter]) -> torch.Tensor:
    """The global L2 norm (float64) of the ``.grad`` of ``params``: over whole tensors, or for sharded
    (DTensor) gradients over every process's shard (each element is held by exactly one process)."""
    from torch.distributed.tensor import DTensor

    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return torch.zeros((), dtype=torch.float64)
    if not any(isinstance(g, DTensor) for g in grads):
        return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.double()) for g in grads]))
    # a whole gradient may come first: only a sharded one has a local part to take the device from
    sharded = next(g for g in grads if isinstance(g, DTensor))
    squares = torch.zeros((), dtype=torch.float64, device=sharded.to_local().device)
    main = dist.get_rank() == 0
    for g in grads:
        if isinstance(g, DTensor) or main:  # a whole (replicated) gradient counts once
            local = g.to_local() if isinstance(g, DTensor) else g
            squares += local.double().pow(2).sum().to(squares.device)
    if dist.get_backend() == "nccl":
        squares = squares.to(torch.device("cuda", torch.cuda.current_device()))
    dist.all_reduce(squares)
    return squares.sqrt().cpu()
