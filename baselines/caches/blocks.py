"""What every cache needs to know about a family's transformer: its block lists and how blocks are called.

The block lists come from the family's spec (``cache_block_lists``; e.g. FLUX runs ``transformer_blocks``
and then ``single_transformer_blocks``). Every block of the registered families takes ``hidden_states``
and ``encoder_hidden_states`` first (by keyword or by position; FLUX and Qwen-Image blocks also take
``image_rotary_emb``) and returns ``(encoder_hidden_states, hidden_states)``. SD3's last block is
``context_pre_only`` and returns ``None`` for the encoder stream.
"""
from __future__ import annotations

import functools
import inspect
from typing import Any

import torch

from agg_bench.engine.families import FAMILY_SPECS, FamilySpec
from agg_bench.errors import UserError

# The transformer class of each family the caches support.
TRANSFORMER_FAMILIES: dict[type, str] = {spec.transformer_cls(): name for name, spec in FAMILY_SPECS.items()}

Streams = tuple[torch.Tensor, "torch.Tensor | None"]
# what a run of blocks added to each stream: None where a stream ends or is missing
Residual = tuple["torch.Tensor | None", "torch.Tensor | None"]


def family_of(transformer: torch.nn.Module) -> str:
    """The family (``model.family``) of a supported transformer; a :class:`UserError` otherwise."""
    for cls, family in TRANSFORMER_FAMILIES.items():
        if isinstance(transformer, cls):
            return family
    names = sorted(cls.__name__ for cls in TRANSFORMER_FAMILIES)
    raise UserError(f"inference caches support {names}, not {type(transformer).__name__}")


def spec_of(transformer: torch.nn.Module) -> FamilySpec:
    """The spec of a supported transformer's family (a :class:`UserError` otherwise)."""
    return FAMILY_SPECS[family_of(transformer)]


def transformer_blocks(transformer: torch.nn.Module) -> list[tuple[str, Any]]:
    """``(qualified name, block)`` for every block of the transformer, in the order they run (diffusers blocks,
    whose sub-modules and hook registry are attributes torch's Module does not type)."""
    blocks = []
    for list_name in spec_of(transformer).cache_block_lists:
        for index, block in enumerate(getattr(transformer, list_name)):
            blocks.append((f"{list_name}.{index}", block))
    return blocks


def timestep_to_1000(transformer: torch.nn.Module, timestep: float) -> float:
    """The value a family's transformer receives, put on the 0-1000 scale (1000 = pure noise)."""
    return timestep * 1000.0 / spec_of(transformer).timestep_scale


@functools.lru_cache(maxsize=None)
def _forward_parameters(block_cls: type[torch.nn.Module]) -> tuple[str, ...]:
    return tuple(inspect.signature(block_cls.forward).parameters)[1:]


def block_argument(block: torch.nn.Module, name: str, args: tuple, kwargs: dict[str, Any]) -> Any:
    """The value of ``block.forward``'s parameter ``name`` in a call made with ``args``/``kwargs``."""
    if name in kwargs:
        return kwargs[name]
    # a class is hashable; the checker reads Module's instance __hash__ as the class's
    index = _forward_parameters(type(block)).index(name)  # type: ignore[arg-type]
    return args[index] if index < len(args) else None


def block_streams(block: torch.nn.Module, args: tuple, kwargs: dict[str, Any]) -> Streams:
    """``(hidden_states, encoder_hidden_states)`` a block was called with."""
    return (block_argument(block, "hidden_states", args, kwargs),
            block_argument(block, "encoder_hidden_states", args, kwargs))


def block_output(hidden_states: torch.Tensor | None, encoder_hidden_states: torch.Tensor | None) -> tuple:
    """A block's return value for the two streams (both families return the encoder stream first)."""
    return encoder_hidden_states, hidden_states


def output_streams(output: tuple) -> Streams:
    """``(hidden_states, encoder_hidden_states)`` of a block's return value."""
    encoder_hidden_states, hidden_states = output
    return hidden_states, encoder_hidden_states


def stream_difference(after: Streams, before: Streams) -> Residual:
    """What a run of blocks added to each stream (``None`` where a stream ends or is missing)."""
    (a0, a1), (b0, b1) = after, before
    return (None if a0 is None or b0 is None else a0 - b0), (None if a1 is None or b1 is None else a1 - b1)


def add_streams(streams: Streams, residual: Residual) -> Residual:
    """``streams + residual`` stream by stream; a stream with no residual ends (``None``)."""
    (s0, s1), (r0, r1) = streams, residual
    return (None if s0 is None or r0 is None else s0 + r0), (None if s1 is None or r1 is None else s1 + r1)


def modulated_input(block: Any, args: tuple, kwargs: dict[str, Any]) -> torch.Tensor:
    """The timestep-modulated image tokens a block feeds its attention (the ``norm1``/``norm`` output; for
    Qwen-Image the image stream's ``img_norm1`` modulated by the first half of ``img_mod(temb)``)."""
    hidden_states = block_argument(block, "hidden_states", args, kwargs)
    temb = block_argument(block, "temb", args, kwargs)
    if hasattr(block, "img_mod"):
        return block._modulate(block.img_norm1(hidden_states), block.img_mod(temb).chunk(2, dim=-1)[0])[0]
    norm = block.norm1 if hasattr(block, "norm1") else block.norm
    return norm(hidden_states, emb=temb)[0]

