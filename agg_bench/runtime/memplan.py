"""Will it fit? The bytes per GPU of a run, before anything is allocated (``agg-bench plan``).

Per GPU (one of the run's ``gpus`` processes):

- ``params``: the transformer's parameters and buffers, the VAE's, the frozen reference copy that a
  KL penalty (``grpo.beta > 0``) or the method itself (:meth:`agg_bench.methods.base.Estimator.keeps_reference`:
  DGPO's DPO reference without ``grpo.beta``) keeps without LoRA, the frozen copy of the transformer that a method's moving
  average of the policy is (:meth:`agg_bench.methods.base.Estimator.moving_average`: DiffusionNFT's old policy,
  AWM's EMA-KL, DGPO's ``ema_ref``; LoRA or not), and the evaluation average's copy of the trainable parameters
  (``train.eval_ema``); ``model.dtype: bfloat16`` keeps float32 master weights
  (:data:`agg_bench.engine.models.PRECISIONS`).
- ``grads``: one gradient per trainable parameter, in the parameters' dtype (a parameter the forward
  never reaches, such as the text output of Qwen-Image's last block, gets none in a run).
- ``optimizer``: AdamW's two moments per trainable parameter (its per-tensor step counters, 4 bytes
  each and kept on the CPU, are left out).
- ``activations``: what one forward-with-grad of the policy saves for backward at the run's resolution
  and micro-batch, counted by running the run's own model code on fake tensors (shapes and dtypes,
  no memory) under the saved-tensor accounting a run records as ``saved_activation_peak_bytes``.
  With gradient checkpointing, the inputs each checkpointed block keeps for its recompute are added
  (``checkpoint_input_bytes``; the run's count does not see them). Under bfloat16 autocast the count
  includes the bf16 copies of the weights that autocast makes and the matmuls save (2 bytes per
  parameter a forward uses outside checkpointed blocks).
- ``optimizer_step``: the temporaries of one AdamW step (:func:`optimizer_step_bytes`): on a GPU, where
  torch's AdamW runs its multi-tensor (foreach) form, one tensor the size of each trainable parameter at
  once (the square roots of the second moments); on the CPU, one parameter at a time (two tensors the size
  of one and the previous one's quotient).
- ``decode``: the working memory of the VAE decode of the process's rollout batch at the run's resolution
  (every rewarded image at once, in the VAE's dtype), counted by running the run's own decode on fake
  tensors under :class:`~agg_bench.machine.activations.WorkingMemory` (the tensors its operators hold at
  once; a convolution's scratch workspace is not a tensor and is not seen).

The phases do not overlap. The weights and AdamW moments are held throughout; the gradients from the train
phase's first backward to the end of its last optimizer step (a run frees them there, as the authors'
trainers do with ``zero_grad`` after the step, so the next rollout and its decode do not hold them). So each
phase's total (:func:`phase_totals`) is the weights and moments, the gradients where the phase holds them
(:data:`GRADIENT_PHASES`), and the phase's own bytes: the saved activations (train), the step's temporaries
(optimizer step) or the decode's working memory (decode). ``total_per_gpu`` is the largest of the three
(``peak_phase`` names it). Measured on one H200 (SD3.5-Medium, full fine-tune, bf16, 4 images), with the
gradients then held until the next step's start: the first iteration peaks at the optimizer step, before which
the moments do not exist (43.1 GiB at 512 and at 1024 px, the step's planned total 42.9); later iterations at
1024 px peaked in the decode (50.8 GiB, 8.4 of them the gradients a run now frees before it:
docs/paper-scale.md, "How far the planner was off").

With ``train.shard: fsdp`` over K GPUs the transformer's parameters, gradients and optimizer state are
split K ways along their first dimension (FSDP2's padded shards); buffers and the VAE are replicated;
``train.cpu_offload`` keeps the shards in CPU memory. Every process trains its 1/K of the batch.

Device: for a CPU run the count is exact (fake CPU tensors save what real ones do). For a CUDA run it
is counted with the CPU kernels: attention keeps what the CPU flash kernel keeps (q, k, v, output and a
float32 logsumexp per head and token), which is what CUDA's flash and memory-efficient kernels keep up
to a few bytes of RNG state; bfloat16 autocast follows the CPU's op lists, which differ from CUDA's for
a few reductions. ``fits``: the total plus a reserve of 10 % of the GPU's memory (CUDA context,
allocator slack, FSDP's gathered blocks, the rollout's and reward's working memory) is within it.
"""
from __future__ import annotations

import contextlib
import copy
import itertools
import json
import math
import os
import sys
from dataclasses import asdict, dataclass, replace

import torch

from ..config import GRPOConfig, RunConfig, bound
from ..engine.families import family_spec
from ..engine.hf_logging import cast_quietly
from ..engine.lora import narrowest_adapted_layer
from ..engine.models import (Conditioning, Policy, build_tiny_transformer, build_tiny_vae, policy_class,
                             precision, prepare_training, pretrained_transformer_config, pretrained_vae_config,
                             text_dims, vae_dtype)
from ..engine.pixel_decoder import PixelDecoder, is_pixel_decoder_folder
from ..errors import ConfigError, first_message_line
from ..machine import distributed
from ..records import is_integer
from ..machine.devices import cuda_index
from ..machine.activations import SavedActivations, WorkingMemory, counting_regions
from ..methods.base import build_estimator, method_options

GIB = 1024 ** 3
H200_GIB = 139.0  # an H200's memory as CUDA reports it: the default budget where no GPU is visible
RESERVE_FRACTION = 0.10
SUGGESTED_LORA_RANK = 64
FSDP_SIZES = (2, 4, 8)  # GPUs of one node that FSDP suggestions try
# the phases of an iteration that add to the held state (the module docstring), and their bytes' key
PHASES = {"train": "activations", "optimizer step": "optimizer_step", "decode": "decode"}
# the phases during which the gradients are held (a run frees them after its update's last step)
GRADIENT_PHASES = ("train", "optimizer step")
ACTIVATION_BASIS = {
    "cpu": "counted exactly (fake CPU tensors, the CPU kernels a run uses)",
    "cuda": "counted with CPU kernels on fake tensors: attention as flash kernels keep it (q, k, v, output, "
            "float32 logsumexp); bf16 autocast by the CPU op lists",
}


@dataclass(frozen=True)
class Layout:
    """How a run spreads over its GPUs.

    ``gpus``: processes (torchrun), one GPU each; ``shard``: ``none`` (each process holds the whole model)
    or ``fsdp``; ``cpu_offload``: FSDP shards kept in CPU memory; ``micro_batch``: rows per
    forward-with-grad; ``gradient_checkpointing``; ``lora_rank`` (0: full fine-tune);
    ``prompts_per_iteration``: prompts of one iteration over all processes (a multiple of ``gpus``).
    """

    gpus: int
    shard: str
    cpu_offload: bool
    micro_batch: int
    gradient_checkpointing: bool
    lora_rank: int
    prompts_per_iteration: int

    @property
    def shards(self) -> int:
        return self.gpus if self.shard == "fsdp" else 1


# the most processes a run can take: each trains at least one prompt's group of the batch
MAX_GPUS = bound(GRPOConfig, "prompts_per_iteration")


def run_layout(cfg: RunConfig, gpus: int = 1) -> Layout:
    """The layout ``cfg`` asks for on ``gpus`` processes (a ConfigError when its batch cannot be split)."""
    if not is_integer(gpus) or not 1 <= gpus <= MAX_GPUS:
        raise ConfigError("--gpus", gpus, f"an integer from 1 to {MAX_GPUS:,} (each process trains whole GRPO "
                          f"groups, and grpo.prompts_per_iteration is at most {MAX_GPUS:,})")
    distributed.Shard(0, gpus).check_run(cfg)
    # the rows of one process's mini-batch (train.minibatches), which a method without a micro-batch trains at once
    local = cfg.grpo.prompts_per_iteration * cfg.grpo.group_size // gpus // cfg.train.minibatches
    micro = getattr(method_options(cfg), "micro_batch", None) or local
    train = cfg.train
    return Layout(gpus=gpus, shard=train.shard, cpu_offload=train.cpu_offload, micro_batch=min(micro, local),
                  gradient_checkpointing=train.gradient_checkpointing, lora_rank=train.lora_rank,
                  prompts_per_iteration=cfg.grpo.prompts_per_iteration)


def text_tokens(cfg: RunConfig) -> int:
    """Text tokens of the run's conditioning: the hash embedding's for the tiny and random presets; for a
    local model folder, the text-encoder length of its family's public pipeline (an upper bound:
    prompts may be shorter), or its ``token_hash.json``'s length (``agg-bench pretrain``'s folders)."""
    from ..engine.families import architecture
    from ..engine.prompts import token_hash_settings
    from ..engine.text import hash_tokens

    if cfg.model.pretrained:
        settings = token_hash_settings(cfg.model.pretrained)  # a folder conditioned by the hash embedding
        if settings is not None:
            return settings["max_tokens"]
        return architecture(cfg.model.family).sequence_length(cfg.prompts.max_sequence_length)
    return hash_tokens(cfg)


def _shapes(cfg: RunConfig, part: str, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """The run's transformer or VAE (``part``) on the meta device, built from its config alone."""
    model, family = cfg.model, cfg.model.family
    spec = family_spec(family)
    cls = spec.transformer_cls() if part == "transformer" else spec.vae_cls()
    with torch.device("meta"):
        if model.pretrained:
            from ..engine.models import _subfolder

            folder = _subfolder(model.pretrained, part, f"the {part}")
            if part == "vae" and is_pixel_decoder_folder(folder):  # a pixel-space model: no weights
                module = PixelDecoder.from_folder(folder)
            elif part == "transformer":  # its sizes checked before anything is built from them
                module = cls.from_config(pretrained_transformer_config(model.pretrained, family))
            else:
                module = cls.from_config(pretrained_vae_config(model.pretrained, family))
        elif model.preset == "random":
            from ..engine.families import architecture

            arch = architecture(family, model.architecture)
            module = cls(**(arch.transformer if part == "transformer" else arch.vae))
        elif part == "transformer":
            module = build_tiny_transformer(family, cfg.seed)
        else:
            module = build_tiny_vae(cfg.seed, family=family)
    return module if dtype == torch.float32 else cast_quietly(module, dtype)


def _to_fake(module: torch.nn.Module, mode) -> torch.nn.Module:
    """Replace the meta tensors of ``module`` in place by fake CPU tensors of ``mode`` (same shapes, dtypes
    and flags), so that a forward runs the CPU kernels' shape logic without memory."""
    convert = mode.fake_tensor_converter.from_meta_and_device
    for sub in module.modules():
        for name, p in list(sub._parameters.items()):
            if p is not None:
                sub._parameters[name] = torch.nn.Parameter(convert(mode, p, torch.device("cpu")),
                                                           requires_grad=p.requires_grad)
        for name, b in list(sub._buffers.items()):
            if b is not None:
                sub._buffers[name] = convert(mode, b, torch.device("cpu"))
        for name, value in list(vars(sub).items()):  # tensors kept as plain attributes (RoPE tables)
            if isinstance(value, torch.Tensor) and value.is_meta:
                setattr(sub, name, convert(mode, value, torch.device("cpu")))
    return module


class _HeldInputs:
    """Distinct storages of the tensors handed to checkpointed blocks."""

    def __init__(self):
        self.bytes = 0
        self._seen: set = set()

    def add(self, args) -> None:
        for t in args:
            if isinstance(t, torch.Tensor):
                key = t.untyped_storage()._cdata
                if key not in self._seen:
                    self._seen.add(key)
                    self.bytes += t.untyped_storage().nbytes()


@contextlib.contextmanager
def _checkpoint_inputs(transformer: torch.nn.Module):
    """Count what gradient checkpointing keeps outside autograd's saved tensors: each checkpointed
    block's inputs, held for its recompute (the saved-tensor accounting of a run does not see them)."""
    held = _HeldInputs()
    wrapped = [m for m in transformer.modules() if getattr(m, "_gradient_checkpointing_func", None) is not None]
    originals = [m._gradient_checkpointing_func for m in wrapped]

    def counting(original):
        def call(block, *args):
            held.add(args)
            return original(block, *args)
        return call

    for module, original in zip(wrapped, originals):
        module._gradient_checkpointing_func = counting(original)
    try:
        yield held
    finally:
        for module, original in zip(wrapped, originals):
            module._gradient_checkpointing_func = original


def saved_bytes(policy: Policy, mode, rows: int, latent_shape: tuple[int, ...], text_tokens: int,
                mask: bool = False) -> tuple[int, int]:
    """What one forward-with-grad of ``policy`` (on fake tensors of ``mode``) on ``rows`` latents of
    ``latent_shape`` and ``text_tokens`` text tokens (with an attention ``mask``) saves for backward, in bytes,
    and of that the inputs that checkpointed blocks keep for their recompute."""
    dim, pooled = text_dims(policy.transformer)
    with mode, torch.enable_grad():
        dtype = policy.dtype
        cond = Conditioning(torch.zeros(rows, text_tokens, dim, dtype=dtype),
                            None if pooled is None else torch.zeros(rows, pooled, dtype=dtype),
                            torch.ones(rows, text_tokens, dtype=torch.long) if mask else None)
        latents = torch.zeros(rows, *latent_shape, dtype=dtype)
        timesteps = torch.full((rows,), 500.0, dtype=dtype)
        with counting_regions(SavedActivations()) as tracker, _checkpoint_inputs(policy.transformer) as held:
            policy.velocity(latents, timesteps, cond)
    return tracker.peak_bytes + held.bytes, held.bytes


def training_bytes(transformer: torch.nn.Module, family: str, vae: torch.nn.Module, resolution: int, rows: int,
                   text_tokens: int, state_copies: int) -> dict[str, int]:
    """The memory of training ``transformer`` (built on the meta device; replaced by fake tensors here) that
    is not a run's (``agg-bench pretrain``'s model), counted as the planner counts a run's: ``parameters``,
    ``state`` (``state_copies`` tensors the size of the parameters: the weights, their gradients, AdamW's two
    moments, an average) and ``activations`` (what one forward-with-grad of ``rows`` latents at ``resolution``
    saves), and their ``total``."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode()
    _to_fake(transformer, mode)
    policy = policy_class(family)(transformer, vae)
    params = list(transformer.parameters())
    state = state_copies * _tensor_bytes(params) + _tensor_bytes(transformer.buffers())
    activations, _ = saved_bytes(policy, mode, rows, policy.latent_shape(resolution), text_tokens)
    return {"parameters": sum(p.numel() for p in params), "state": state, "activations": activations,
            "total": state + activations}


def _tensor_bytes(tensors, shards: int = 1) -> int:
    """Bytes of ``tensors``, each split ``shards`` ways along dim 0 with padding (an FSDP2 shard)."""
    total = 0
    for t in tensors:
        if shards > 1 and t.dim() > 0:
            total += math.ceil(t.shape[0] / shards) * (t.numel() // t.shape[0]) * t.element_size()
        else:
            total += t.numel() * t.element_size()
    return total


def optimizer_step_bytes(trainable, shards: int, device_type: str) -> int:
    """Bytes of the temporaries one step of torch's AdamW allocates for ``trainable`` (each split ``shards``
    ways): its multi-tensor (foreach) form, torch's default where every parameter is on a GPU, takes the
    square root of every second moment at once (one tensor the size of each parameter); its one-tensor form,
    the CPU's default, goes through the parameters in order with two tensors the size of one (the root and
    its quotient by the bias correction) while the previous parameter's quotient is still held."""
    sizes = [_tensor_bytes([t], shards) for t in trainable]
    if not sizes:
        return 0
    if device_type == "cuda":
        return sum(sizes)
    return max(2 * size + previous for size, previous in zip(sizes, [0, *sizes]))


def decode_bytes(policy: Policy, mode, rows: int, latent_shape: tuple[int, ...]) -> int:
    """Peak bytes of the tensors that ``policy``'s decode (on fake tensors of ``mode``) of ``rows`` latents of
    ``latent_shape`` holds at once (:class:`~agg_bench.machine.activations.WorkingMemory`); 0 without a VAE."""
    if policy.vae is None:
        return 0
    with mode:
        latents = torch.zeros(rows, *latent_shape, dtype=torch.float32)
        with WorkingMemory() as memory:
            policy.decode(latents)
    return memory.peak_bytes


class ShapeModel:
    """The run's policy on fake tensors: each (gradient checkpointing, LoRA rank) variant built once,
    each activation count done once."""

    def __init__(self, cfg: RunConfig):
        from torch._subclasses.fake_tensor import FakeTensorMode

        self.cfg = cfg
        self.family = cfg.model.family
        self.spec = family_spec(self.family)
        self.precision = precision(cfg.model.dtype)
        self.mode = FakeTensorMode()
        self._policies: dict[tuple, Policy] = {}
        self._activations: dict[tuple, int] = {}
        self._checkpoint_inputs: dict[tuple, int] = {}
        self._decodes: dict[int, int] = {}
        self.device_type = _device_type(cfg)
        self.vae = _to_fake(_shapes(cfg, "vae", vae_dtype(self.precision)), self.mode)
        train = cfg.train
        self.latent_shape = self.policy(train.gradient_checkpointing, train.lora_rank).latent_shape(
            cfg.model.resolution)
        self.text_tokens = text_tokens(cfg)
        self.for_run(cfg)

    def for_run(self, cfg: RunConfig) -> "ShapeModel":
        """This model for run config ``cfg``, which differs from the one it was built for at most in what
        :func:`shape_key` leaves out (the method, the seed, the sampler, the reward): its method's copies of
        the policy are charged, the counts done already are kept."""
        self.cfg = cfg
        estimator = build_estimator(cfg)
        self.moving_average = estimator.moving_average() is not None
        # a frozen copy of the starting policy: the session's KL reference (grpo.beta > 0) or the method's own
        self.reference = cfg.grpo.beta > 0 or estimator.keeps_reference(cfg)
        return self

    def policy(self, checkpointing: bool, lora_rank: int) -> Policy:
        key = (checkpointing, lora_rank)
        if key not in self._policies:
            train = replace(self.cfg.train, gradient_checkpointing=checkpointing, lora_rank=lora_rank)
            if lora_rank != self.cfg.train.lora_rank:  # a suggested adapter: the family's defaults
                train = replace(train, lora_alpha=None, lora_target_modules=None)
            # the adapters on the meta device too: drawn for real, a full-size model's take minutes and GiBs;
            # there peft leaves them in the default dtype, where a run moves them to the base weights' dtype
            with torch.random.fork_rng(devices=[]):
                transformer = _shapes(self.cfg, "transformer", self.precision.param_dtype)
                with torch.device("meta"):
                    prepare_training(transformer, self.family, train)
                if any(p.dtype != self.precision.param_dtype for p in transformer.parameters()):
                    cast_quietly(transformer, self.precision.param_dtype)
            _to_fake(transformer, self.mode)
            self._policies[key] = policy_class(self.family)(transformer, self.vae,
                                                            autocast_dtype=self.precision.autocast_dtype,
                                                            guidance=self.cfg.model.guidance)
        return self._policies[key]

    def suggested_lora_rank(self, checkpointing: bool) -> int:
        """The rank of an adapter the planner suggests for a fully trained run (the family's default targets):
        :data:`SUGGESTED_LORA_RANK`, or the width of the narrowest layer it adapts where that is less, a rank
        :func:`~agg_bench.engine.lora.apply_lora` would refuse otherwise."""
        narrowest = narrowest_adapted_layer(self.policy(checkpointing, 0).transformer, self.family)
        return SUGGESTED_LORA_RANK if narrowest is None else min(SUGGESTED_LORA_RANK, narrowest[0])

    def activations(self, rows: int, checkpointing: bool, lora_rank: int) -> int:
        """Bytes one forward-with-grad of ``rows`` latents saves for backward."""
        key = (rows, checkpointing, lora_rank)
        if key not in self._activations:
            # a local model's text encoders give embeddings with a mask
            mask = bool(self.spec.text_attention_mask and self.cfg.model.pretrained)
            self._activations[key], self._checkpoint_inputs[key] = saved_bytes(
                self.policy(checkpointing, lora_rank), self.mode, rows, self.latent_shape, self.text_tokens, mask)
        return self._activations[key]

    def checkpoint_input_bytes(self, rows: int, checkpointing: bool, lora_rank: int) -> int:
        """Of :meth:`activations`, the inputs that checkpointed blocks keep for their recompute."""
        self.activations(rows, checkpointing, lora_rank)
        return self._checkpoint_inputs[(rows, checkpointing, lora_rank)]

    def decode_bytes(self, rows: int, checkpointing: bool, lora_rank: int) -> int:
        """Working memory of decoding ``rows`` rollout images (:func:`decode_bytes`)."""
        if rows not in self._decodes:
            self._decodes[rows] = decode_bytes(self.policy(checkpointing, lora_rank), self.mode, rows,
                                               self.latent_shape)
        return self._decodes[rows]

    def state_bytes(self, layout: Layout) -> dict[str, int]:
        """Parameter, gradient and optimizer bytes per GPU; parameter counts of the transformer."""
        transformer = self.policy(layout.gradient_checkpointing, layout.lora_rank).transformer
        params = list(transformer.parameters())
        trainable = [p for p in params if p.requires_grad]
        shards = layout.shards
        model = _tensor_bytes(params, shards) + _tensor_bytes(transformer.buffers())
        vae = _tensor_bytes(self.vae.parameters()) + _tensor_bytes(self.vae.buffers())
        reference = model if self.reference and layout.lora_rank == 0 else 0  # LoRA: the base model, no copy
        moving_policy = model if self.moving_average else 0  # a whole copy of the transformer, whatever it trains
        grads = _tensor_bytes(trainable, shards)
        average = grads if self.cfg.train.eval_ema is not None else 0  # a copy of each trainable parameter
        on_gpu = 0 if layout.cpu_offload and layout.shard == "fsdp" else 1
        return {"params": on_gpu * (model + reference + moving_policy + average) + vae, "grads": on_gpu * grads,
                "optimizer": on_gpu * 2 * grads,
                "optimizer_step": on_gpu * optimizer_step_bytes(trainable, shards, self.device_type),
                "parameters": sum(p.numel() for p in params),
                "trainable_parameters": sum(p.numel() for p in trainable)}

    def bytes_per_gpu(self, layout: Layout) -> dict[str, int]:
        """The plan's ``bytes``: the state, each phase's bytes on top of it, and ``total_per_gpu`` (the largest
        of :func:`phase_totals`: the module docstring)."""
        state = self.state_bytes(layout)
        out = {k: state[k] for k in ("params", "grads", "optimizer")}
        out["activations"] = self.activations(layout.micro_batch, layout.gradient_checkpointing, layout.lora_rank)
        out["optimizer_step"] = state["optimizer_step"]
        # each process decodes its share of the rollout (prompts_per_iteration x group_size / gpus images)
        rows = layout.prompts_per_iteration * self.cfg.grpo.group_size // layout.gpus
        out["decode"] = self.decode_bytes(rows, layout.gradient_checkpointing, layout.lora_rank)
        out["total_per_gpu"] = max(phase_totals(out).values())
        return out


@dataclass
class MemoryPlan:
    """``agg-bench plan``'s answer; :meth:`as_dict` is its JSON."""

    parameters: int
    trainable_parameters: int
    bytes: dict
    fits: bool
    suggestions: list[str]
    gpus: int
    gpu_memory_bytes: int
    reserve_bytes: int
    layout: dict
    device: str
    activation_basis: str
    checkpoint_input_bytes: int = 0
    peak_phase: str = ""  # the phase that holds the most (phase_totals): train, optimizer step or decode

    def as_dict(self) -> dict:
        return asdict(self)


def gpu_memory_bytes(device: str) -> int:
    """The default budget: the memory of the GPU ``device`` names (``cuda:N``, or ``cuda``: the current device,
    which a launched rank has set to its own), the machine's memory for ``cpu``, else an H200's."""
    kind = device.split(":")[0]
    if kind == "cuda" and torch.cuda.is_available():
        # not device 0: a rank on a node whose GPUs all stay visible runs on its own, which may be another model
        return int(torch.cuda.get_device_properties(cuda_index(torch.device(device))).total_memory)
    if kind == "cpu":
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return int(H200_GIB * GIB)


def _device_name(cfg: RunConfig) -> str:
    """``cfg.device`` with ``auto`` resolved: ``cpu``, ``cuda`` or ``cuda:N``."""
    if cfg.device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return cfg.device


def _device_type(cfg: RunConfig) -> str:
    return "cuda" if _device_name(cfg).startswith("cuda") else "cpu"


def _describe(layout: Layout, base: Layout) -> str:
    """The settings in which ``layout`` differs from ``base``, as --set items and torchrun processes."""
    parts = []
    if layout.micro_batch != base.micro_batch:
        parts.append(f"method.micro_batch={layout.micro_batch}")
    if layout.gradient_checkpointing != base.gradient_checkpointing:
        parts.append("train.gradient_checkpointing=true")
    if layout.lora_rank != base.lora_rank:
        parts.append(f"train.lora_rank={layout.lora_rank}")
    if layout.shard != base.shard or layout.gpus != base.gpus:
        parts.append(f"train.shard=fsdp on {layout.gpus} GPUs (torchrun --nproc_per_node {layout.gpus})")
    if layout.prompts_per_iteration != base.prompts_per_iteration:
        parts.append(f"grpo.prompts_per_iteration={layout.prompts_per_iteration}")
    if layout.cpu_offload != base.cpu_offload:
        parts.append("train.cpu_offload=true")
    return ", ".join(parts)


class _Search:
    """Layouts near the run's, tried in order of cost; keeps those that fit."""

    def __init__(self, shapes: ShapeModel, base: Layout, budget: float, has_micro_batch: bool, group_size: int):
        self.shapes, self.base, self.budget = shapes, base, budget
        self.has_micro_batch, self.group_size = has_micro_batch, group_size

    def fits(self, layout: Layout) -> bool:
        # the weights, moments and gradients alone are a lower bound of every phase's total (phase_totals adds
        # only bytes to them): a layout they exceed does not fit, and its forward on fake tensors is not counted
        state = self.shapes.state_bytes(layout)
        if state["params"] + state["optimizer"] + state["grads"] > self.budget:
            return False
        return self.shapes.bytes_per_gpu(layout)["total_per_gpu"] <= self.budget

    def sharded(self, layout: Layout, gpus: int, **changes) -> Layout:
        """``layout`` under FSDP over ``gpus``: whole GRPO groups per process, the micro-batch within one."""
        prompts = math.ceil(layout.prompts_per_iteration / gpus) * gpus
        local = prompts * self.group_size // gpus
        return replace(layout, gpus=gpus, shard="fsdp", prompts_per_iteration=prompts,
                       micro_batch=min(layout.micro_batch, local), **changes)

    def smaller_batches(self, layout: Layout) -> list[Layout]:
        if not self.has_micro_batch:
            return []
        sizes = sorted({max(1, layout.micro_batch >> i) for i in range(1, layout.micro_batch.bit_length() + 1)},
                       reverse=True)
        return [replace(layout, micro_batch=m) for m in sizes if m < layout.micro_batch]

    def first_fit(self, layouts: list[Layout]) -> Layout | None:
        return next((layout for layout in layouts if self.fits(layout)), None)

    def suggestions(self) -> list[Layout]:
        """One change each, cheapest first (a smaller micro-batch, gradient checkpointing, FSDP over K,
        LoRA); if none fits alone, the first combination of them that does."""
        base, out = self.base, []
        candidates = [self.smaller_batches(base)]
        if not base.gradient_checkpointing:
            candidates.append([replace(base, gradient_checkpointing=True)])
        candidates.append([self.sharded(base, k) for k in FSDP_SIZES if k > base.shards])
        lora = base.lora_rank or self.shapes.suggested_lora_rank(base.gradient_checkpointing)
        if base.lora_rank == 0:
            candidates.append([replace(base, lora_rank=lora)])
        for group in candidates:
            found = self.first_fit(group)
            if found is not None:
                out.append(found)
        if out:
            return out
        one = lambda layout: replace(layout, micro_batch=1) if self.has_micro_batch else layout
        ckpt = replace(base, gradient_checkpointing=True)
        widest = max(FSDP_SIZES + (base.shards,))
        combos = [one(ckpt), self.sharded(ckpt, widest), one(self.sharded(ckpt, widest)),
                  one(replace(ckpt, lora_rank=lora)), one(self.sharded(replace(ckpt, lora_rank=lora), widest)),
                  one(self.sharded(replace(ckpt, lora_rank=lora), widest, cpu_offload=True))]
        found = self.first_fit(combos)
        return [] if found is None else [found]


def plan_memory(cfg: RunConfig, gpus: int = 1, gpu_memory: float | None = None, suggest: bool = True,
                shapes: ShapeModel | None = None) -> MemoryPlan:
    """The memory plan of run config ``cfg`` on ``gpus`` processes with ``gpu_memory`` bytes each (None:
    :func:`gpu_memory_bytes`); ``suggest`` searches for changes when it does not fit. ``shapes``: a
    :class:`ShapeModel` built for a config of the same :func:`shape_key` (its counts are reused), else one is
    built."""
    device = _device_type(cfg)
    budget_total = gpu_memory_bytes(_device_name(cfg)) if gpu_memory is None else gpu_memory
    if isinstance(budget_total, bool) or not isinstance(budget_total, (int, float)) \
            or not math.isfinite(budget_total) or budget_total <= 0:
        raise ConfigError("--gpu-memory", budget_total, "a positive, finite amount of memory")
    base = run_layout(cfg, gpus)
    with torch.random.fork_rng(devices=[]):  # building shapes must not move the run's random streams
        shapes = ShapeModel(cfg) if shapes is None else shapes.for_run(cfg)
        counted = shapes.bytes_per_gpu(base)
        state = shapes.state_bytes(base)
        reserve = int(RESERVE_FRACTION * budget_total)
        budget = budget_total - reserve
        fits = counted["total_per_gpu"] <= budget
        suggestions = []
        if suggest and not fits:
            search = _Search(shapes, base, budget, hasattr(method_options(cfg), "micro_batch"), cfg.grpo.group_size)
            for layout in search.suggestions():
                total = shapes.bytes_per_gpu(layout)["total_per_gpu"]
                suggestions.append(f"{_describe(layout, base)}: {total / GIB:.1f} GiB per GPU")
    return MemoryPlan(parameters=state["parameters"], trainable_parameters=state["trainable_parameters"],
                      bytes=counted, fits=fits, suggestions=suggestions, gpus=gpus,
                      gpu_memory_bytes=int(budget_total), reserve_bytes=reserve, layout=asdict(base),
                      device=device, activation_basis=ACTIVATION_BASIS[device],
                      checkpoint_input_bytes=shapes.checkpoint_input_bytes(
                          base.micro_batch, base.gradient_checkpointing, base.lora_rank),
                      peak_phase=peak_phase(counted))


def check_weights_fit(cfg: RunConfig) -> None:
    """Before a model folder (``model.pretrained``) is loaded: its transformer's and VAE's weights, counted on
    the meta device from its ``transformer/config.json`` and ``vae/config.json`` (whose values are checked
    first), must fit the memory of the run's device (:func:`gpu_memory_bytes`: the GPU's, or this machine's for
    a CPU run); a ConfigError naming ``model.pretrained`` says "does not fit" otherwise. Every process loads
    the whole model before any sharding, so this holds for any layout; whether training fits too is
    :func:`plan_memory`'s answer. The tiny and random presets are built from configs of the harness's own and
    are not checked here."""
    if cfg.model.pretrained:
        check_transformer_fits(cfg.model.pretrained, cfg.model.family, cfg.model.dtype, _device_name(cfg),
                               _vae_bytes(cfg))


def _vae_bytes(cfg: RunConfig) -> int:
    """Bytes of the weights and buffers of the VAE (or pixel decoder) of the run's model folder, counted on the
    meta device from its checked config (a ConfigError naming ``model.pretrained`` for one diffusers cannot
    build)."""
    try:
        with torch.random.fork_rng(devices=[]):
            vae = _shapes(cfg, "vae", vae_dtype(precision(cfg.model.dtype)))
    # as check_transformer_fits: a value of the wrong type, sizes that do not agree
    except (TypeError, ValueError, RuntimeError, ArithmeticError) as err:
        raise ConfigError("model.pretrained", cfg.model.pretrained, "a model folder whose vae/config.json builds "
                          f"a {family_spec(cfg.model.family).vae_class} ({first_message_line(err)})") from None
    return _tensor_bytes(itertools.chain(vae.parameters(), vae.buffers()))


def check_transformer_fits(folder: str, family: str, dtype: str, device: str, vae_bytes: int = 0) -> int:
    """The ``transformer/`` of ``folder`` (a model folder or a snapshot) of ``family`` in ``model.dtype``
    ``dtype``, as ``device`` (:func:`gpu_memory_bytes`) would load it (:func:`check_weights_fit`): its config's sizes within bounds,
    its config buildable, and its weights and buffers, with ``vae_bytes`` (the model's VAE, from
    check_weights_fit), within the device's memory, before anything is
    allocated; a ConfigError naming ``model.pretrained`` otherwise. Returns the number of numbers its buffers
    hold (what building it computes, before its weights are read)."""
    cls = family_spec(family).transformer_cls()
    config = pretrained_transformer_config(folder, family)
    try:
        with torch.random.fork_rng(devices=[]), torch.device("meta"):
            transformer = cls.from_config(config)
    # a value of the wrong type, sizes that do not agree, sizes diffusers divides by zero with (a patch wider
    # than the sample)
    except (TypeError, ValueError, RuntimeError, ArithmeticError) as err:
        raise ConfigError("model.pretrained", folder, f"a model folder whose transformer/config.json builds "
                          f"a {cls.__name__} ({first_message_line(err)})") from None
    size = torch.finfo(precision(dtype).param_dtype).bits // 8  # what loading in that precision makes of it
    weights = sum(t.numel() * (size if t.is_floating_point() else t.element_size())
                  for t in itertools.chain(transformer.parameters(), transformer.buffers()))
    budget = gpu_memory_bytes(device)
    if weights + vae_bytes > budget:
        count = sum(p.numel() for p in transformer.parameters())
        vae = f" and its vae/config.json {bytes_text(vae_bytes)}" if vae_bytes else ""
        raise ConfigError("model.pretrained", folder,
                          f"a model whose weights fit: its transformer/config.json describes {count:,} parameters, "
                          f"{bytes_text(weights)} in {dtype}{vae}, more than the {bytes_text(budget)} of this "
                          f"{device} (the memory planner: does not fit)")
    return sum(t.numel() for t in transformer.buffers())


def phase_totals(counted: dict) -> dict[str, int]:
    """{phase of :data:`PHASES`: the bytes held in it} from a plan's ``bytes``: the weights and the moments, the
    gradients in :data:`GRADIENT_PHASES`, and the phase's own bytes."""
    return {phase: counted["params"] + counted["optimizer"] + counted[key]
            + (counted["grads"] if phase in GRADIENT_PHASES else 0) for phase, key in PHASES.items()}


def peak_phase(counted: dict) -> str:
    """The phase of :data:`PHASES` that holds the most in a plan's ``bytes`` (:func:`phase_totals`; the first on
    a tie)."""
    totals = phase_totals(counted)
    return max(PHASES, key=lambda phase: totals[phase])


def bytes_text(n: float) -> str:
    """``n`` bytes in words: "512 B", "3.2 MiB", "1.5 GiB"."""
    for unit, size in (("GiB", GIB), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{int(n)} B"


# plans made in this process, by what they depend on (:func:`plan_key`), and the models on fake tensors they
# were counted on (:func:`shape_key`): the runs of a cell job share a model, and a full-size model's count on
# fake tensors takes seconds
_RUN_PLANS: dict[str, dict] = {}
_RUN_PLANS_KEPT = 16
_SHAPES: dict[str, ShapeModel] = {}
_SHAPES_KEPT = 2


# train keys that schedule the loop or the update and build nothing a count depends on: runs that differ only in
# them (a resumed run's checkpoint_every, a longer run, methods that train other steps or at another rate) share
# a count. The train keys a ShapeModel reads are the adapter's and gradient checkpointing (the policy it builds);
# the rest reach a plan through the run's layout (run_layout) or its config (ShapeModel.for_run).
SCHEDULE_ONLY = ("iterations", "checkpoint_every", "lr", "weight_decay", "max_grad_norm", "timestep_fraction", "plan",
                 "plan_window", "inner_epochs", "budget", "pass_costs", "ignore_last")


def shape_key(cfg: RunConfig) -> str:
    """What a :class:`ShapeModel`'s counts depend on: the model, prompts, train and GRPO sections and the
    device (not the method, whose micro-batch is counted per layout and whose copies of the policy are
    charged by :meth:`ShapeModel.for_run`, nor the train keys of :data:`SCHEDULE_ONLY`)."""
    config = cfg.to_dict()
    config["train"] = {k: v for k, v in config["train"].items() if k not in SCHEDULE_ONLY}
    return json.dumps({"device": config["device"], **{k: config[k] for k in ("model", "prompts", "train", "grpo")}},
                      sort_keys=True)


def plan_key(cfg: RunConfig, gpus: int, shaped: str | None = None) -> str:
    """What a run's plan depends on: the model, prompts, train, GRPO and method sections (a method's own
    reference or moving average is a copy of the model: DGPO's, NFT's), the device and the processes (not the
    seed, the sampler or the reward). ``shaped``: ``cfg``'s :func:`shape_key`, where the caller has it."""
    return json.dumps({"shapes": shape_key(cfg) if shaped is None else shaped, "method": cfg.to_dict()["method"],
                       "gpus": gpus, "memory": gpu_memory_bytes(_device_name(cfg))}, sort_keys=True)


def run_memory_plan(cfg: RunConfig, gpus: int) -> dict:
    """What a run records in ``plan.json``: its plan on ``gpus`` processes (no suggestions), or the error
    that kept it from being made (a run does not fail for want of a plan). A plan this process made already
    for the same :func:`plan_key` is the same plan; one for another method on the same model (the same
    :func:`shape_key`) reuses its counts on fake tensors and charges this method's copies of the policy."""
    shaped = shape_key(cfg)
    key = plan_key(cfg, gpus, shaped)
    if key in _RUN_PLANS:
        return copy.deepcopy(_RUN_PLANS[key])
    try:
        with torch.random.fork_rng(devices=[]):
            shapes = _SHAPES.get(shaped) or ShapeModel(cfg)
        plan = plan_memory(cfg, gpus, suggest=False, shapes=shapes).as_dict()
        if shaped not in _SHAPES:
            if len(_SHAPES) >= _SHAPES_KEPT:
                _SHAPES.pop(next(iter(_SHAPES)))
            _SHAPES[shaped] = shapes
    except Exception as exc:  # recorded, and the run goes on
        print(f"agg-bench run: no memory plan: {type(exc).__name__}: {exc}".splitlines()[0], file=sys.stderr)
        return {"error": f"{type(exc).__name__}: {exc}"}
    if len(_RUN_PLANS) >= _RUN_PLANS_KEPT:
        _RUN_PLANS.pop(next(iter(_RUN_PLANS)))
    _RUN_PLANS[key] = copy.deepcopy(plan)
    return plan


def format_plan(plan: MemoryPlan) -> str:
    """The plan as a few lines of text."""
    b = plan.bytes
    lines = [f"transformer parameters: {plan.parameters:,} ({plan.trainable_parameters:,} trainable)",
             f"per GPU ({plan.gpus} GPU{'s' if plan.gpus > 1 else ''}, {plan.layout['shard']}, micro-batch "
             f"{plan.layout['micro_batch']}):"]
    for key in ("params", "grads", "optimizer"):
        lines.append(f"  {key:<14} {b[key] / GIB:10.2f} GiB")
    lines.append("  and on top of the weights and moments (the gradients only in the train phase and the step):")
    totals = phase_totals(b)
    for phase, key in PHASES.items():
        mark = "  <- peak" if phase == plan.peak_phase else ""
        lines.append(f"  {key:<14} {b[key] / GIB:10.2f} GiB  ({phase}: {totals[phase] / GIB:.2f} GiB in all){mark}")
    lines.append(f"  {'total_per_gpu':<14} {b['total_per_gpu'] / GIB:10.2f} GiB")
    lines.append(f"  budget         {(plan.gpu_memory_bytes - plan.reserve_bytes) / GIB:10.2f} GiB "
                 f"({plan.gpu_memory_bytes / GIB:.1f} GiB less a {RESERVE_FRACTION:.0%} reserve)")
    lines.append(f"fits: {'yes' if plan.fits else 'no'}")
    if not plan.fits:
        lines += [f"  try: {s}" for s in plan.suggestions] or ["  nothing tried fits (see docs/paper-scale.md: Will it fit?)"]
    lines.append(f"activations: {plan.activation_basis}")
    return "\n".join(lines)


__all__ = ["GRADIENT_PHASES", "Layout", "MemoryPlan", "PHASES", "ShapeModel", "check_weights_fit", "decode_bytes",
           "format_plan", "gpu_memory_bytes", "optimizer_step_bytes", "peak_phase", "phase_totals", "plan_memory",
           "run_layout", "saved_bytes", "training_bytes", "bytes_text"]
