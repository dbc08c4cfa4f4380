"""DiTs, VAEs and the policy that calls them the same way for every family.

A :class:`Policy` hides how one model family is called: latents are always (B, C, H, W) and the
timestep is always given as a denoising-step index into the run's schedule. A family's policy
(:func:`policy_class`) turns that into what its diffusers transformer expects, as the family's spec
says (:mod:`agg_bench.engine.families`: the timestep's scale, 2x2 latent packing, the transformer's
keyword arguments, the VAE's latent normalization); the tiny preset, a public architecture with random
weights and a local diffusers folder are built from the spec's classes and configs.

Precision: parameters are kept in ``model.dtype`` for float32/float64; ``bfloat16`` keeps float32
master weights and runs the transformer forward under ``torch.autocast`` in bfloat16.
"""
from __future__ import annotations

import contextlib
import copy
import inspect
import itertools
import logging
import math
import os
import typing
from dataclasses import dataclass, fields
from typing import Any

import torch
from diffusers.schedulers.scheduling_flow_match_euler_discrete import FlowMatchEulerDiscreteScheduler

from .. import stopping
from ..config import DEFAULTS, RunConfig, TrainConfig
from ..errors import ConfigError, UserError, first_message_line, quote, shown
from ..io import file_identity
from ..jsonfiles import MAX_CONFIG_BYTES, JsonFileError, read_json_object
from ..machine import fsdp
from ..machine.activations import saved_activation_region
from ..outdir import check_not_written
from ..records import is_finite_number, is_integer
from .counters import PassCounter, count_backward
from .families import (  # noqa: F401 (TINY_*: the tiny presets' configs, also imported from here)
    DEFAULT_VAE_SCALE_FACTOR, FAMILY_SPECS, TINY_QWEN_VAE, TINY_TRANSFORMERS, TINY_VAE, FamilySpec, ImageGeometry,
    check_guidance, family_spec,
)
from .hf_logging import cast_quietly, quiet_loading
from .lora import adapters_disabled, apply_lora, has_adapters
from .pixel_decoder import PixelDecoder, is_pixel_decoder_folder, normalisation_problem

FAMILIES = tuple(FAMILY_SPECS)
TRANSFORMER_CLASSES = {name: spec.transformer_cls() for name, spec in FAMILY_SPECS.items()}
VAE_CLASSES = {name: spec.vae_cls() for name, spec in FAMILY_SPECS.items()}
DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}
GUIDANCE_DEFAULT = DEFAULTS["model"]["guidance"]  # the guidance value of every run before model.guidance


@dataclass(frozen=True)
class Precision:
    """How ``model.dtype`` is realised: ``param_dtype`` of the (master) weights and the ``autocast_dtype``
    of the transformer forward (None: no autocast)."""

    param_dtype: torch.dtype
    autocast_dtype: torch.dtype | None = None


PRECISIONS = {
    "float32": Precision(torch.float32),
    "float64": Precision(torch.float64),
    "bfloat16": Precision(torch.float32, torch.bfloat16),
}


def vae_dtype(prec: Precision) -> torch.dtype:
    """The VAE's dtype: float64 in a float64 run, so that its rewards carry float64 precision rather than
    float32 rounding, which the advantages' division by a group's spread would magnify; float32 otherwise."""
    return torch.float64 if prec.param_dtype == torch.float64 else torch.float32


def precision(name: str) -> Precision:
    if name not in PRECISIONS:
        raise ConfigError("model.dtype", name, f"one of {sorted(PRECISIONS)}")
    return PRECISIONS[name]


@dataclass
class Conditioning:
    """Text conditioning for a batch: token embeddings (B, L, D), pooled embeddings (B, P) and, for models
    that mask padded text tokens (Qwen-Image), ``encoder_attention_mask`` (B, L) with 1 on valid tokens."""

    encoder_hidden_states: torch.Tensor
    pooled_projections: torch.Tensor | None = None
    encoder_attention_mask: torch.Tensor | None = None

    def _map(self, fn, mask_fn=None) -> "Conditioning":
        """Apply ``fn`` to every tensor (``mask_fn`` to the mask; default ``fn``); None stays None."""
        mask_fn = fn if mask_fn is None else mask_fn
        keep = lambda f, t: None if t is None else f(t)
        return Conditioning(fn(self.encoder_hidden_states), keep(fn, self.pooled_projections),
                            keep(mask_fn, self.encoder_attention_mask))

    def __getitem__(self, rows) -> "Conditioning":
        return self._map(lambda t: t[rows])

    def to(self, device=None, dtype=None) -> "Conditioning":
        # the mask keeps its integer/bool dtype: it selects tokens, it is not a value to compute with
        return self._map(lambda t: t.to(device=device, dtype=dtype), lambda t: t.to(device=device))

    def repeat_interleave(self, n: int) -> "Conditioning":
        return self._map(lambda t: t.repeat_interleave(n, dim=0))

    def tensors(self) -> dict[str, torch.Tensor]:
        """The tensors that are set, by field name (the names used in snapshot and embedding files)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor]) -> "Conditioning":
        """The conditioning of ``tensors`` (by field name); the token embeddings must be there."""
        return cls(tensors["encoder_hidden_states"], tensors.get("pooled_projections"),
                   tensors.get("encoder_attention_mask"))

    @property
    def batch_size(self) -> int:
        return self.encoder_hidden_states.shape[0]


def _seeded(seed: int):
    torch.manual_seed(seed)


def build_tiny_transformer(family: str, seed: int = 0, dtype: torch.dtype = torch.float32):
    """A tiny transformer of ``family`` with weights drawn from ``seed``."""
    if not isinstance(family, str) or family not in FAMILY_SPECS:
        raise ConfigError("model.family", family, f"one of {sorted(FAMILY_SPECS)} for the tiny preset")
    spec = FAMILY_SPECS[family]
    with torch.random.fork_rng(devices=[]):
        _seeded(seed)
        model = spec.transformer_cls()(**spec.tiny_transformer)
    return model if dtype == torch.float32 else cast_quietly(model, dtype)


def build_tiny_vae(seed: int = 0, dtype: torch.dtype = torch.float32, family: str = "sd3"):
    """The tiny VAE of ``family`` with weights drawn from ``seed``."""
    spec = family_spec(family)
    with torch.random.fork_rng(devices=[]):
        _seeded(seed + 1)
        vae = spec.vae_cls()(**spec.tiny_vae)
    vae = vae if dtype == torch.float32 else cast_quietly(vae, dtype)
    return vae.eval().requires_grad_(False)


class Policy:
    """A transformer and VAE of one family, called with latents (B, C, H, W) and step indices.

    ``timesteps`` given to :meth:`velocity` are the exact values the transformer receives; the family
    decides their scale (:attr:`timestep_scale` multiplies sigma). ``counter`` counts every call.
    ``version`` is incremented by the training loop after each optimizer step, so a method can tell
    whether the parameters still equal those that produced a rollout. ``autocast_dtype`` (bfloat16 runs)
    is the dtype of the transformer forward; the returned velocity always has the parameters' dtype.
    ``base_model`` is True for the KL reference of a LoRA policy: the same modules with adapters off.
    ``scheduler_config`` is the model's FlowMatchEulerDiscreteScheduler config (None: the folder has none).
    ``guidance`` is the guidance value a guidance-distilled transformer embeds at every call (``model.guidance``;
    FLUX.1-dev), refused other than its default for a transformer without that embedding.
    """

    family: str = ""
    timestep_scale: float = 1000.0
    packed: bool = False  # 2x2 latent packing: the transformer sees 4x the latent channels
    spec: FamilySpec | None = None  # a family's policy (policy_class); None: a bare velocity model
    compute_device: torch.device | None = None  # set when sharded (agg_bench.machine.fsdp)
    padding_passes: int = 0  # lockstep padding calls of a sharded policy (agg_bench.machine.fsdp)

    def __init__(self, transformer: torch.nn.Module, vae: torch.nn.Module | None, latent_channels: int | None = None,
                 *, autocast_dtype: torch.dtype | None = None, scheduler_config: dict | None = None,
                 guidance: float = GUIDANCE_DEFAULT):
        # diffusers models, whose classes are looked up by family name: their config and call keywords are
        # known at run time only
        self.transformer: Any = transformer
        self.vae: Any = vae
        self.latent_channels = latent_channels if latent_channels is not None else \
            self.latent_channels_of(transformer)
        self.autocast_dtype = autocast_dtype
        self.scheduler_config = None if scheduler_config is None else dict(scheduler_config)
        if guidance != GUIDANCE_DEFAULT:  # the configs said so before the run (check_config); the model says it here
            check_guidance({"family": self.family, "guidance": guidance},
                           embeds=typing.cast(Any, transformer).config.get("guidance_embeds") is True)
        self.guidance = guidance
        self.base_model = False
        self.counter = PassCounter()
        self.version = 0

    @classmethod
    def latent_channels_of(cls, transformer) -> int:
        return transformer.config.in_channels // (4 if cls.packed else 1)

    # ----- shapes -------------------------------------------------------------------------
    @property
    def vae_scale_factor(self) -> int:
        if self.vae is None:
            return DEFAULT_VAE_SCALE_FACTOR
        if isinstance(self.vae, PixelDecoder):
            return self.vae.spatial_factor
        assert self.spec is not None  # a diffusers VAE comes with a family's policy
        return self.spec.vae_scale_factor(self.vae.config)

    @property
    def latent_multiple(self) -> int:
        """Latent height/width must be a multiple of this."""
        return 2 if self.spec is None else self.spec.latent_grid(self.transformer.config)[0]

    def max_latent_size(self) -> int | None:
        return None if self.spec is None else self.spec.latent_grid(self.transformer.config)[1]

    def latent_shape(self, resolution: int) -> tuple[int, int, int]:
        """(C, H, W) of the latents for square images of ``resolution`` pixels, or a clear error."""
        geometry = ImageGeometry(self.family, self.vae_scale_factor, self.latent_multiple, self.max_latent_size())
        size = geometry.latent_size(resolution)
        return (self.latent_channels, size, size)

    def image_seq_len(self, latent_shape: tuple[int, int, int]) -> int:
        """Image tokens the transformer sees for latents of ``latent_shape`` (C, H, W)."""
        patch = 2 if self.packed else self.transformer.config.patch_size
        return (latent_shape[1] // patch) * (latent_shape[2] // patch)

    def schedule_shift(self, latent_shape: tuple[int, int, int]) -> float:
        """The sigma shift of the model's own scheduler config at this latent size (resolution-dependent
        ``exp(mu)``, or ``mu`` for ``time_shift_type: linear``, for schedulers with dynamic shifting, as the
        diffusers FLUX / Qwen-Image pipelines do): a finite number > 0, or a ConfigError naming
        ``sampling.shift`` and the scheduler config's values that give another."""
        cfg = self.scheduler_config
        if cfg is None:
            raise ConfigError("sampling.shift", None, "a number, or a model folder with a scheduler/ config")
        if not cfg.get("use_dynamic_shifting"):
            return float(cfg.get("shift", 1.0))
        base_len, max_len = cfg.get("base_image_seq_len", 256), cfg.get("max_image_seq_len", 4096)
        base_shift, max_shift = cfg.get("base_shift", 0.5), cfg.get("max_shift", 1.15)
        kind = cfg.get("time_shift_type", "exponential")
        tokens = self.image_seq_len(latent_shape)
        slope = (max_shift - base_shift) / (max_len - base_len)
        mu = base_shift + slope * (tokens - base_len)
        # exp overflows past mu ~ 709; a shift of inf or nan, or one <= 0 (linear), is no flow-matching shift
        shift = (math.exp(mu) if mu < 709 else math.inf) if kind == "exponential" else mu
        if not (math.isfinite(shift) and shift > 0):
            raise ConfigError("sampling.shift", None, (
                f"a number, or a model folder whose scheduler/scheduler_config.json gives a finite shift > 0 at "
                f"{tokens} image tokens (use_dynamic_shifting true, time_shift_type {quote(kind)}, base_shift "
                f"{quote(base_shift)}, max_shift {quote(max_shift)}, base_image_seq_len {quote(base_len)}, "
                f"max_image_seq_len {quote(max_len)} give mu = {mu:g}"
                f"{f', exp(mu) = {shift:g}' if kind == 'exponential' else ''})"))
        return shift

    def schedule_shift_terminal(self) -> float | None:
        """The last nonzero sigma the model's scheduler stretches its schedule to (Qwen-Image's
        ``shift_terminal``); None when its scheduler config has none."""
        value = (self.scheduler_config or {}).get("shift_terminal")
        return float(value) if value else None

    @property
    def device(self) -> torch.device:
        # FSDP with CPU offload keeps the parameters in host memory and computes on compute_device
        return self.compute_device or next(self.transformer.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.transformer.parameters()).dtype

    # ----- calls --------------------------------------------------------------------------
    def timestep_values(self, sigmas: torch.Tensor) -> torch.Tensor:
        """The values given to the transformer for each step, from the schedule's sigmas (T+1)."""
        return sigmas[:-1] * self.timestep_scale

    def _call_context(self, device: torch.device) -> contextlib.ExitStack:
        stack = contextlib.ExitStack()
        if self.base_model:
            stack.enter_context(adapters_disabled(self.transformer))
        if self.autocast_dtype is not None:
            stack.enter_context(torch.autocast(device_type=device.type, dtype=self.autocast_dtype))
        return stack

    def velocity(self, latents: torch.Tensor, timesteps: torch.Tensor, cond: Conditioning) -> torch.Tensor:
        """Predicted velocity for ``latents`` (b, C, H, W) at ``timesteps`` (b,); counted. A safe point of a
        run: a pending SIGTERM or SIGINT is raised here, before the call. In a run on several processes the call
        of a sharded model is a point they all reach in the same order (its forward is a collective), where they
        stop together (:func:`agg_bench.stopping.check`); an unsharded model's calls leave the signal to their
        next common point (:func:`agg_bench.stopping.check_alone`)."""
        if fsdp.is_sharded(self):
            stopping.check()
        else:
            stopping.check_alone()
        b = latents.shape[0]
        dtype = self.dtype
        with self._call_context(latents.device):
            grad = torch.is_grad_enabled() and any(p.requires_grad for p in self.transformer.parameters())
            # what the network saves for backward is what a training phase's saved-activation count covers
            with saved_activation_region() if grad else contextlib.nullcontext():
                out = self._forward(latents.to(dtype), timesteps.to(dtype), cond.to(dtype=dtype))
        out = out.to(dtype)
        # observed, not assumed: a forward whose every trained block was answered from a cache (LoRA with a
        # training cache) builds no graph, so it is a no-grad forward and no backward can pass through it
        if grad and out.requires_grad:
            self.counter.forward_grad += b
            self.counter.forward_grad_calls += 1
            out = count_backward(out, self.counter)
        else:
            self.counter.forward_nograd += b
            self.counter.forward_nograd_calls += 1
        return out

    def _forward(self, latents, timesteps, cond: Conditioning) -> torch.Tensor:
        """One transformer call as the family's spec says: latents packed 2x2 and unpacked where it packs."""
        _, c, h, w = latents.shape
        hidden = pack_latents(latents) if self.packed else latents
        assert self.spec is not None  # a bare velocity model overrides _forward
        inputs = self.spec.transformer_inputs(self.transformer, hidden, timesteps, cond, h, w, self.guidance)
        out = self.transformer(**inputs, return_dict=False)[0]
        return unpack_latents(out, c, h, w) if self.packed else out

    def _vae_input(self, latents: torch.Tensor) -> torch.Tensor:
        """Undo the latent normalization the transformer was trained with (the family's, or AutoencoderKL's
        scale and shift)."""
        if self.spec is not None and self.spec.vae_input is not None:
            return self.spec.vae_input(self.vae, latents)
        cfg = self.vae.config
        return latents.to(self.vae.dtype) / cfg.scaling_factor + (cfg.shift_factor or 0.0)

    def _vae_decode(self, z: torch.Tensor) -> torch.Tensor:
        if self.spec is not None and self.spec.vae_decode is not None:
            return self.spec.vae_decode(self.vae, z)
        return self.vae.decode(z, return_dict=False)[0]

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Images (B, 3, H, W) in [0, 1] from latents."""
        if self.vae is None:
            raise RuntimeError("this policy has no VAE to decode with")
        images = self._vae_decode(self._vae_input(latents))
        return (images.float() / 2 + 0.5).clamp(0, 1)

    def parameters(self):
        if self.base_model:
            return []
        return [p for p in self.transformer.parameters() if p.requires_grad]

    def named_parameters(self):
        if self.base_model:
            return []
        return [(n, p) for n, p in self.transformer.named_parameters() if p.requires_grad]

    def frozen_copy(self) -> "Policy":
        """The KL reference policy; it shares the counter. With LoRA adapters it is the same transformer
        run with the adapters disabled (the base model, no copy); otherwise a frozen deep copy."""
        ref = copy.copy(self)
        if has_adapters(self.transformer):
            ref.base_model = True
        else:
            ref.transformer = copy.deepcopy(self.transformer).requires_grad_(False).eval()
        return ref

    def weights_copy(self) -> "Policy":
        """A frozen copy of the policy's current weights (LoRA adapters included and enabled) that shares the
        counter: where a method keeps a moving average of the policy (an EMA old or reference policy)."""
        ref = copy.copy(self)
        ref.base_model = False
        ref.transformer = copy.deepcopy(self.transformer).requires_grad_(False).eval()
        return ref


def pack_latents(latents: torch.Tensor) -> torch.Tensor:
    """(B, C, H, W) -> (B, H/2 * W/2, 4C), the 2x2 patch packing of FLUX and Qwen-Image."""
    b, c, h, w = latents.shape
    x = latents.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5)
    return x.reshape(b, (h // 2) * (w // 2), c * 4)


def unpack_latents(packed: torch.Tensor, channels: int, height: int, width: int) -> torch.Tensor:
    b = packed.shape[0]
    x = packed.view(b, height // 2, width // 2, channels, 2, 2).permute(0, 3, 1, 4, 2, 5)
    return x.reshape(b, channels, height, width)


def _family_policy(spec: FamilySpec) -> type[Policy]:
    name = "".join(ch for ch in spec.title if ch.isalnum()) + "Policy"  # e.g. SD3Policy, QwenImagePolicy
    return type(name, (Policy,), {
        "__module__": __name__, "__doc__": f"The {spec.title} policy (model.family {spec.name}).",
        "spec": spec, "family": spec.name, "timestep_scale": spec.timestep_scale, "packed": spec.packed})


# The policy class of each registered family (the spec decides its calling convention).
POLICIES: dict[str, type[Policy]] = {name: _family_policy(spec) for name, spec in FAMILY_SPECS.items()}


def policy_class(family: str) -> type[Policy]:
    """The policy class of ``family`` (a ConfigError naming ``model.family`` when it is not registered)."""
    spec = family_spec(family)
    cls = POLICIES.get(family)
    return cls if cls is not None and cls.spec is spec else _family_policy(spec)  # registered after import


def text_dims(transformer) -> tuple[int, int | None]:
    """(token embedding dim, pooled embedding dim) the transformer expects."""
    cfg = transformer.config
    return cfg.joint_attention_dim, getattr(cfg, "pooled_projection_dim", None)


def _subfolder(pretrained: str, name: str, what: str) -> str:
    path = os.path.join(pretrained, name)
    if not os.path.isdir(path):
        raise ConfigError("model.pretrained", pretrained,
                          f"a local diffusers folder with {what} in {name}/ (missing: {shown(path)})")
    return path


def folder_json(pretrained: str, name: str, what: str) -> dict:
    """The JSON object in the model folder's file ``name`` (e.g. ``transformer/config.json``, at most
    :data:`~agg_bench.jsonfiles.MAX_CONFIG_BYTES`); a ConfigError naming ``model.pretrained``, the file and its
    problem when it is not one (``what``: what it should hold)."""
    try:
        return read_json_object(os.path.join(pretrained, name), what, MAX_CONFIG_BYTES)
    except JsonFileError as err:
        raise ConfigError("model.pretrained", pretrained,
                          f"a folder whose {name} is {what}, a JSON object ({name} {err.problem})") from None


# Bounds on a model folder's transformer and VAE configs, checked before anything is built from them. The public
# models have at most 60 blocks of one kind (Qwen-Image; FLUX.1 19 + 38, SD3.5-Large 38) and no size above 4,096
# (joint_attention_dim; their VAEs 512 channels); how much memory the sizes add up to is the memory planner's
# question (agg_bench.runtime.memplan.check_weights_fit), asked before a model is loaded.
MAX_MODEL_LAYERS = 256  # a key ending in "layers" (num_layers, num_single_layers)
MAX_MODEL_SIZE = 16384  # any other integer: widths, heads, channels, patch and sample sizes, RoPE axes


def _keys_typed(cls: Any, kind: type) -> frozenset[str]:
    """The arguments of ``cls.__init__`` typed as ``kind`` (``kind``, ``kind | None``, a tuple or list of them)."""
    try:
        hints = typing.get_type_hints(cls.__init__)
    except (NameError, TypeError):  # an annotation that does not resolve: only the bounds below apply
        return frozenset()
    return frozenset(key for key, hint in hints.items()
                     if hint is kind or kind in typing.get_args(hint))


def config_sizes_problem(config: dict, cls: type, list_low: int = 0) -> str | None:
    """What keeps a model folder's diffusers config (a transformer's, a VAE's) from being built as ``cls``:
    true or false where ``cls`` takes an integer (Python's bool is an int, so ``num_layers: true`` built one
    block), an integer outside its bound (a layer count in [1, MAX_MODEL_LAYERS], any other size in [1,
    MAX_MODEL_SIZE]; an integer in a list, such as a block index or RoPE axis, in [0, MAX_MODEL_SIZE], or from
    ``list_low`` in a list ``cls`` types as integers); None when nothing does. A key ``cls`` types as a
    float takes any integer. (A number of another type where an integer goes is refused by diffusers, as a
    ConfigError of :func:`load_pretrained`.)"""
    integer_keys, float_keys = _keys_typed(cls, int), _keys_typed(cls, float) - _keys_typed(cls, int)
    for key, value in config.items():
        if key in float_keys:
            continue
        top = MAX_MODEL_LAYERS if key.endswith("layers") else MAX_MODEL_SIZE
        if key in integer_keys and isinstance(value, bool):
            return f"{key} = {quote(value)}: expected an integer from 1 to {top}, not true or false"
        if is_integer(value) and not 1 <= value <= top:
            return f"{key} = {quote(value)}: expected an integer from 1 to {top}"
        if isinstance(value, list):
            low = list_low if key in integer_keys else 0
            bad = next((v for v in value if (key in integer_keys and not is_integer(v))
                        or (is_integer(v) and not low <= v <= MAX_MODEL_SIZE)), None)
            if bad is not None:
                return f"{key} holds {quote(bad)}: expected integers from {low} to {MAX_MODEL_SIZE}"
    return None


def pretrained_transformer_config(pretrained: str, family: str) -> dict:
    """The model folder's ``transformer/config.json``, checked: a diffusers config of ``family``'s transformer
    (a ConfigError naming ``model.family`` for another family's) whose sizes are within
    :func:`config_sizes_problem`'s bounds (a ConfigError naming ``model.pretrained``)."""
    expected = family_spec(family).transformer_cls()
    config = folder_json(pretrained, "transformer/config.json", "the transformer's diffusers config")
    name = config.get("_class_name")
    if name and name != expected.__name__:
        raise ConfigError("model.family", family, f"the family of {pretrained} ({quote(name)} in transformer/)")
    problem = config_sizes_problem(config, expected)
    if problem is not None:
        raise ConfigError("model.pretrained", pretrained, f"a model folder whose transformer/config.json has sizes "
                          f"a model can have ({problem})")
    return config


def vae_config_problem(config: dict, cls: type, channels_key: str) -> str | None:
    """What keeps a model folder's VAE config from being built as ``cls`` and decoding the run's latents:
    :func:`config_sizes_problem`'s bounds (an integer in a list ``cls`` types as integers, such as a block's
    channels, from 1), a ``scaling_factor`` that is not a finite number > 0 or a ``shift_factor`` that is
    neither null nor a finite number (:func:`~agg_bench.engine.pixel_decoder.normalisation_problem`: latents
    are divided by the one and shifted by the other), or a ``latents_mean`` / ``latents_std`` that is not a
    list of finite numbers (standard deviations > 0), one for each of its ``channels_key`` latent channels
    (null where ``cls``'s default is; a key the config leaves out is ``cls``'s default); None when nothing
    does."""
    problem = config_sizes_problem(config, cls, list_low=1)
    for key in ("scaling_factor", "shift_factor"):
        if problem is None and key in config and not (key == "shift_factor" and config[key] is None):
            problem = normalisation_problem(key, config[key])
    if problem is not None:
        return problem
    defaults = {name: param.default for name, param in inspect.signature(cls).parameters.items()}
    channels = config.get(channels_key, defaults.get(channels_key))
    for key in ("latents_mean", "latents_std"):
        # a key the file leaves out is the class's default (Qwen-Image's: 16 channels' values)
        values, nullable = config.get(key, defaults.get(key)), defaults.get(key) is None
        if values is None and nullable:
            continue
        low = " > 0" if key == "latents_std" else ""
        if not isinstance(values, list) or (is_integer(channels) and len(values) != channels):
            count = f"{channels} " if is_integer(channels) else ""
            return f"{key} = {quote(values)}: expected {'null or ' if nullable else ''}a list of {count}finite " \
                   f"numbers{low} (one for each of its {channels_key} latent channels)"
        bad = next((v for v in values if not is_finite_number(v) or (key == "latents_std" and v <= 0)), None)
        if bad is not None:
            return f"{key} holds {quote(bad)}: expected finite numbers{low}"
    return None


def pretrained_vae_config(pretrained: str, family: str) -> dict:
    """The model folder's ``vae/config.json`` of a diffusers VAE (not a pixel decoder's), checked: a config of
    ``family``'s VAE class whose values are within :func:`vae_config_problem`'s bounds (a ConfigError naming
    ``model.pretrained`` otherwise)."""
    spec = family_spec(family)
    expected = spec.vae_cls()
    config = folder_json(pretrained, "vae/config.json", "the vae's diffusers config")
    name = config.get("_class_name")
    if name and name != expected.__name__:
        raise ConfigError("model.pretrained", pretrained, f"the family of {pretrained} ({name} in vae/)")
    problem = vae_config_problem(config, expected, spec.vae_latent_channels)
    if problem is not None:
        raise ConfigError("model.pretrained", pretrained, f"a model folder whose vae/config.json has values "
                          f"a VAE can take ({problem})")
    return config


def _load_component(cls, path: str, pretrained: str, what: str, **kwargs):
    """``cls.from_pretrained`` on a local folder only; a missing or broken file is a ConfigError."""
    try:
        # CRITICAL, not ERROR: diffusers logs a file it cannot read at ERROR before it raises, and the one line
        # below says it
        with quiet_loading(logging.CRITICAL):
            component = cls.from_pretrained(path, local_files_only=True, **kwargs)
    # TypeError: a config value of the wrong type; ArithmeticError: sizes diffusers divides by zero with
    # (a patch wider than the sample)
    except (OSError, ValueError, TypeError, ArithmeticError) as err:
        raise ConfigError("model.pretrained", pretrained,
                          f"loadable {what} in {shown(path)} ({first_message_line(err)})") from err
    if isinstance(component, torch.nn.Module):  # a weight the file lacks is left on the meta device, unloaded
        missing = next((name for name, t in itertools.chain(component.named_parameters(), component.named_buffers())
                        if t.is_meta), None)
        if missing is not None:
            raise ConfigError("model.pretrained", pretrained, f"loadable {what} in {shown(path)} (no weight {missing})")
    return component


def scheduler_config_problem(config: dict) -> str | None:
    """What keeps :meth:`Policy.schedule_shift` and :meth:`Policy.schedule_shift_terminal` from computing a
    schedule from a model folder's scheduler config (diffusers loads these values unchecked): a ``shift`` that
    is not a finite number > 0, a ``base_shift`` or ``max_shift`` that is not a finite number, sequence lengths that are not integers with
    ``max_image_seq_len`` above ``base_image_seq_len`` (the shift's slope divides by their difference), or a
    ``shift_terminal`` that is neither null nor a number in [0, 1); None when nothing does. (Whether the
    schedule falls from 1 to 0 is the sampler's check, :func:`agg_bench.engine.sampler.check_sigmas`.)"""
    for key in ("shift", "base_shift", "max_shift"):
        if key in config and not is_finite_number(config[key]):
            return f"{key} = {quote(config[key])}: expected a finite number"
    # shift(s) = a s / (1 + (a - 1) s) is a flow-matching shift only for a > 0 (a = -1 maps 0.001 to -0.001, a
    # schedule that can still fall from 1 to 0 in a few steps)
    if "shift" in config and not config["shift"] > 0:
        return f"shift = {quote(config['shift'])}: expected a finite number > 0"
    base, top = config.get("base_image_seq_len", 256), config.get("max_image_seq_len", 4096)
    if not (is_integer(base) and base >= 1):
        return f"base_image_seq_len = {quote(base)}: expected an integer >= 1"
    if not (is_integer(top) and top > base):
        return f"max_image_seq_len = {quote(top)}: expected an integer above base_image_seq_len ({base})"
    terminal = config.get("shift_terminal")
    if terminal is not None and not (is_finite_number(terminal) and 0 <= terminal < 1):
        return f"shift_terminal = {quote(terminal)}: expected null or a number in [0, 1)"
    return None


def load_pretrained(family: str, pretrained: str, param_dtype: torch.dtype):
    """(transformer, VAE, scheduler config) from the local diffusers folder ``pretrained``."""
    if not os.path.isdir(pretrained):
        raise ConfigError("model.pretrained", pretrained, "an existing local diffusers folder")
    t_dir = _subfolder(pretrained, "transformer", "the transformer")
    spec = family_spec(family)
    pretrained_transformer_config(pretrained, family)  # its class and its sizes, before anything is built
    transformer = _load_component(spec.transformer_cls(), t_dir, pretrained, "transformer weights",
                                  torch_dtype=param_dtype)
    vae_dir = _subfolder(pretrained, "vae", "the VAE")
    if is_pixel_decoder_folder(vae_dir):  # a pixel-space model (agg-bench pretrain)
        vae = PixelDecoder.from_folder(vae_dir)  # its config's keys and values checked (a ConfigError)
    else:
        pretrained_vae_config(pretrained, family)  # its class and its values, before anything is built
        vae = _load_component(spec.vae_cls(), vae_dir, pretrained, "VAE weights").eval().requires_grad_(False)
    scheduler_config = None
    sched_dir = os.path.join(pretrained, "scheduler")
    if os.path.isdir(sched_dir):
        folder_json(pretrained, "scheduler/scheduler_config.json", "the scheduler's diffusers config")
        scheduler_config = dict(_load_component(FlowMatchEulerDiscreteScheduler, sched_dir, pretrained,
                                                "a scheduler config").config)
        problem = scheduler_config_problem(scheduler_config)
        if problem is not None:
            raise ConfigError("model.pretrained", pretrained, f"a folder whose scheduler/scheduler_config.json the "
                              f"sigma schedule can take ({problem})")
    return transformer, vae, scheduler_config


def folder_identity(pretrained: str | None) -> tuple[int, int, int] | None:
    """The identity of the model folder ``pretrained`` (:func:`~agg_bench.io.file_identity`; None for no folder or
    none there): another once ``agg-bench pretrain`` replaced it whole. A kept model (a cell job's) is one of this
    folder."""
    return file_identity(pretrained) if pretrained else None


@contextlib.contextmanager
def unreplaced_folder(pretrained: str | None):
    """A block that reads the model folder ``pretrained`` (nothing for None): a folder being written is refused
    before it (:func:`~agg_bench.outdir.check_not_written`), one replaced while the block read it after it. Every
    read from one model's folder (the transformer, VAE and scheduler, the token-hash settings, the text encoders
    and tokenizers, the cache key of their embeddings) belongs in one such block, or a run is one model's
    transformer conditioned by another's encoders."""
    if not pretrained:
        yield
        return
    # agg-bench pretrain replaces its folder whole (the earlier one renamed aside, the new one in): a folder being
    # written, or replaced while read, is refused rather than loaded from two models or from none. Its modification
    # time counts as well as its inode: a part renamed into it (a new transformer/) changes only that, and a folder
    # removed and made again may get the freed inode back.
    check_not_written(pretrained, "model.pretrained", lock_inside=False)
    before = file_identity(pretrained)
    yield
    check_not_written(pretrained, "model.pretrained", lock_inside=False)
    if file_identity(pretrained) != before:
        raise UserError(f"model.pretrained {pretrained}: replaced by another process while it was loaded; run "
                        "again once it is written")


def load_policy(family: str, preset: str, pretrained: str | None, dtype: str = "float32",
                device: str | torch.device = "cpu", seed: int = 0, architecture: str | None = None,
                guidance: float = GUIDANCE_DEFAULT) -> Policy:
    """Build the tiny preset, a public ``architecture`` with random weights (preset ``random``, created on
    the meta device and materialised on ``device``), or load a local diffusers folder (``transformer/``,
    ``vae/``, ``scheduler/``); its calls embed the guidance value ``guidance`` (``model.guidance``)."""
    spec = family_spec(family)
    prec = precision(dtype)
    scheduler_config = None
    if pretrained:
        with unreplaced_folder(pretrained):  # a caller that reads more of the folder holds a block of its own around
            transformer, vae, scheduler_config = load_pretrained(family, pretrained, prec.param_dtype)
    elif preset == "tiny":
        transformer = build_tiny_transformer(family, seed, prec.param_dtype)
        vae = build_tiny_vae(seed, family=family)
        scheduler_config = FlowMatchEulerDiscreteScheduler(shift=3.0).config  # shift 3, as docs/design.md's sampler
    elif preset == "random":
        from .architectures import build_random
        from .families import architecture as find_architecture

        arch = find_architecture(family, architecture)
        transformer = build_random(spec.transformer_cls(), arch.transformer, device, seed, prec.param_dtype)
        vae = build_random(spec.vae_cls(), arch.vae, device, seed + 1).eval().requires_grad_(False)
        scheduler_config = FlowMatchEulerDiscreteScheduler(**arch.scheduler).config
    else:
        raise ConfigError("model.preset", preset, "'tiny', 'random', or model.pretrained set to a local folder")
    policy_cls = policy_class(family)
    latent_channels = policy_cls.latent_channels_of(transformer)
    vae_channels = getattr(vae.config, spec.vae_latent_channels)
    if vae_channels != latent_channels:
        raise ConfigError("model.pretrained", pretrained,
                          f"a VAE with {latent_channels} latent channels to match the transformer")
    transformer.to(device)
    # .to(dtype) only when it changes something: diffusers warns about any dtype cast of a model
    vae.to(device)
    if vae.dtype != vae_dtype(prec):
        cast_quietly(vae, vae_dtype(prec))
    return policy_cls(transformer, vae, latent_channels, autocast_dtype=prec.autocast_dtype,
                      scheduler_config=scheduler_config, guidance=guidance)


def build_policy(cfg: RunConfig, device: str | torch.device = "cpu") -> Policy:
    """The run's policy: loaded (``model``), then gradient checkpointing and LoRA from ``train``.

    Checkpointing with a method that caches block outputs in the training forward is refused by that
    method's ``check_run`` (``cached`` with ``method.cache_in`` train/both).
    """
    model = cfg.model
    policy = load_policy(model.family, model.preset, model.pretrained, model.dtype, device, cfg.seed,
                         model.architecture, model.guidance)
    prepare_training(policy.transformer, policy.family, cfg.train)
    return policy


def prepare_training(transformer: Any, family: str, train: TrainConfig) -> None:
    """Gradient checkpointing and LoRA adapters as the ``train`` section asks (the memory planner
    applies the same to its shape-only model)."""
    if train.gradient_checkpointing:
        transformer.enable_gradient_checkpointing()
    if train.lora_rank > 0:
        apply_lora(transformer, family, train.lora_rank, train.lora_alpha, train.lora_target_modules)
