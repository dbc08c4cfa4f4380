"""First Block Cache (diffusers' ``apply_first_block_cache``) on SD3, FLUX and Qwen-Image.

diffusers' FBC computes the tail block's residual for both streams, and SD3's last block is
``context_pre_only``: it returns ``None`` for the encoder stream, so the tail's subtraction fails. SD3
discards the encoder stream after that block, so :class:`EncoderPassThroughHook` (registered under FBC's
hook on that block) returns the block's encoder input in place of ``None``. The image stream, and so the
transformer's output, is unchanged, and FBC's encoder residual becomes that of the blocks before it.
"""
from __future__ import annotations

import torch
from diffusers import hooks as diffusers_hooks
from diffusers.hooks import HookRegistry, ModelHook

from agg_bench.errors import UserError

from .blocks import block_argument, transformer_blocks
from .configs import FbcConfig

ENCODER_PASS_THROUGH_HOOK = "encoder_pass_through"


class EncoderPassThroughHook(ModelHook):
    """Makes a ``context_pre_only`` block return its encoder input instead of ``None``."""

    def new_forward(self, module: torch.nn.Module, *args, **kwargs):
        encoder_hidden_states, hidden_states = self.fn_ref.original_forward(*args, **kwargs)
        if encoder_hidden_states is None:
            encoder_hidden_states = block_argument(module, "encoder_hidden_states", args, kwargs)
        return encoder_hidden_states, hidden_states


def apply_fbc(module: torch.nn.Module, config: FbcConfig) -> None:
    """Apply diffusers' First Block Cache to an SD3, FLUX or Qwen-Image transformer."""
    blocks = transformer_blocks(module)
    if len(blocks) < 2:
        raise UserError("First Block Cache needs a transformer with at least two blocks")
    for _, block in blocks:
        if getattr(block, "context_pre_only", False):
            registry = HookRegistry.check_if_exists_or_initialize(block)
            registry.register_hook(EncoderPassThroughHook(), ENCODER_PASS_THROUGH_HOOK)
    diffusers_hooks.apply_first_block_cache(module, diffusers_hooks.FirstBlockCacheConfig(threshold=config.threshold))
