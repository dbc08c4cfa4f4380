"""Full-size public architectures with seeded random weights (``model.preset: random``).

The transformer and VAE of a public checkpoint are rebuilt from the values of its public diffusers
``config.json`` files, kept in its family's spec (:mod:`agg_bench.engine.families`), so that time,
memory and pass counts can be measured at paper scale with nothing downloaded (they do not depend on the
weights' values; rewards do, and random-weight rows are labelled ``weights: random`` and kept out of
quality comparisons).

Modules are created on the ``meta`` device (no memory) and materialised directly on the target device
(``to_empty``), where :func:`init_random_weights` fills them from the seed: every module's own
``reset_parameters`` (the default initialisation of Linear, Conv, LayerNorm, ...), norm scales without
one set to 1, and SD3's sin-cos position table recomputed. A 20 B model is never initialised on the CPU.

Text conditioning is the download-free token-hash embedding at the text encoders' real width and a
realistic sequence length: the pipeline's default text-encoder length (``prompts.max_sequence_length``
overrides it), plus the 77 CLIP tokens that SD3's pipeline puts in front of the T5 tokens.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from diffusers.models.embeddings import PatchEmbed, get_2d_sincos_pos_embed
from diffusers.models.transformers.transformer_qwenimage import QwenEmbedRope

from .hf_logging import cast_quietly


def build_on_meta(cls, config: dict, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """``cls(**config)`` on the meta device: shapes only, no memory, no initialisation work."""
    with torch.device("meta"):
        module = cls(**config)
    return module if dtype == torch.float32 else cast_quietly(module, dtype)


# Norm modules whose scale parameter has no reset_parameters of its own (diffusers' RMSNorm, the
# Qwen-Image VAE's RMS norm): the scale starts at 1, as their constructors set it.
_UNIT_SCALES = ("weight", "gamma")


def _reset_position_table(module: PatchEmbed) -> None:
    pos_embed = module.pos_embed
    assert pos_embed is not None  # reset only where the module has buffers: the table is one
    grid = module.pos_embed_max_size or module.height
    table = get_2d_sincos_pos_embed(module.proj.out_channels, grid, base_size=module.base_size,
                                    interpolation_scale=module.interpolation_scale,
                                    device=pos_embed.device, output_type="pt")
    pos_embed.copy_(table.to(pos_embed.dtype).unsqueeze(0))


def _reset_rope_tables(module: QwenEmbedRope) -> None:
    # plain tensor attributes (not buffers): to_empty leaves them on meta; rebuilt where the class builds
    # them (the CPU; a few MB) and moved to the input's device by the module itself
    with torch.device("cpu"):
        fresh = QwenEmbedRope(module.theta, module.axes_dim, module.scale_rope)
    module.pos_freqs, module.neg_freqs = fresh.pos_freqs, fresh.neg_freqs


# Buffers that hold computed values, by owning module class -> how to recompute them in place.
_BUFFER_RESETS: dict[type, Callable[[Any], None]] = {PatchEmbed: _reset_position_table}
# Modules that keep computed tensors as plain attributes -> how to rebuild them.
_ATTRIBUTE_RESETS: dict[type, Callable[[Any], None]] = {QwenEmbedRope: _reset_rope_tables}


@torch.no_grad()
def init_random_weights(module: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Fill a materialised (``to_empty``) module in place from ``seed``, on whatever device it is on.

    Raises RuntimeError for a parameter or buffer it does not know how to fill, so that nothing is
    left holding uninitialised memory.
    """
    devices = sorted({str(t.device) for t in module.parameters()} | {str(t.device) for t in module.buffers()})
    if "meta" in devices:
        raise RuntimeError("init_random_weights: materialise the module first (to_empty)")
    cuda = [torch.device(d) for d in devices if d.startswith("cuda")]
    with torch.random.fork_rng(devices=cuda):
        torch.manual_seed(seed)
        for name, sub in module.named_modules():
            own_params = list(sub.named_parameters(recurse=False))
            if own_params and callable(getattr(sub, "reset_parameters", None)):
                sub.reset_parameters()
            else:
                for pname, p in own_params:
                    if pname not in _UNIT_SCALES:
                        raise RuntimeError(f"init_random_weights: no initialisation for {name}.{pname} "
                                           f"({type(sub).__name__})")
                    p.fill_(1.0)
            if list(sub.buffers(recurse=False)):
                reset = _BUFFER_RESETS.get(type(sub))
                if reset is None:
                    raise RuntimeError(f"init_random_weights: no way to recompute the buffers of {name} "
                                       f"({type(sub).__name__})")
                reset(sub)
            if any(isinstance(v, torch.Tensor) and v.is_meta for v in vars(sub).values()):
                reset = _ATTRIBUTE_RESETS.get(type(sub))
                if reset is None:
                    raise RuntimeError(f"init_random_weights: no way to rebuild the tensors of {name} "
                                       f"({type(sub).__name__})")
                reset(sub)
    return module


def materialize(module: torch.nn.Module, device: str | torch.device, seed: int) -> torch.nn.Module:
    """A meta-device module allocated directly on ``device`` and filled from ``seed``."""
    return init_random_weights(module.to_empty(device=device), seed)


def build_random(cls, config: dict, device: str | torch.device, seed: int,
                 dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """``cls(**config)`` with seeded random weights, created on meta and materialised on ``device``."""
    return materialize(build_on_meta(cls, config, dtype), device, seed)


def parameter_count(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


__all__ = ["build_on_meta", "build_random", "init_random_weights", "materialize", "parameter_count"]
