"""FORA (Fast-Forward Caching): every block recomputes on every N-th step and reuses in between.

With ``trajectory_steps`` set, the N-th steps are counted from the last step, as the public code counts its
steps down (the first step always computes); see :meth:`.configs.ForaConfig.computes`.

What a reused block adds to its input (``reuse``):

- ``residual`` (default): the block's residual (output minus input: the sum of its attention and MLP
  contributions to the residual stream) recorded at the last step it computed, gates of that step included.
  The residual stream itself is never frozen.
- ``branches`` (the public code, ``src/models.py``): the outputs of the block's attention and MLP layers recorded
  before their adaLN gates at the last computed step, each multiplied by its gate of the current step (computed
  from the current ``temb`` by the block's own adaLN layer): ``input + gate_msa(t) * attn + gate_mlp(t) * mlp``
  per stream (SD3.5's second attention with its own gate; the text stream with its own gates; SD3's last,
  ``context_pre_only`` block has no text stream after it). FLUX's single blocks run attention and MLP side by side
  through one output projection under one gate: their branch is that projection's output, before the gate, on
  the joined text and image tokens. Qwen-Image's blocks are refused (:data:`BRANCH_BLOCKS` lists the blocks
  whose branches are known). In a training forward the recorded branches are detached after each step (the
  handle's ``detach``), so a reused block's gradient reaches its adaLN layer through the current gates only.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from diffusers.hooks import HookRegistry, ModelHook
from diffusers.hooks.hooks import BaseState
from diffusers.models.attention import JointTransformerBlock
from diffusers.models.transformers.transformer_flux import FluxSingleTransformerBlock, FluxTransformerBlock

from agg_bench.errors import ConfigError, UserError

from .blocks import block_argument, block_output, block_streams, family_of, transformer_blocks
from .configs import BRANCHES, ForaConfig
from .runs import RunDecision, RunHeadHook, RunState, register_run

FORA_BLOCK_HOOK = "fora_block"
IMAGE, TEXT, JOINT = "image", "text", "joint"  # the stream a branch adds to; JOINT: text then image tokens


@dataclass(frozen=True)
class Branch:
    """One gated branch of a block: the output of sub-module ``module`` (item ``item`` of a tuple output), added
    to ``stream`` times item ``gate`` of what the block's adaLN layer ``norm`` returns."""

    module: str
    item: int | None
    stream: str
    norm: str
    gate: int

    @property
    def key(self) -> str:
        return self.module if self.item is None else f"{self.module}.{self.item}"


def _double_stream_branches(block: Any) -> tuple[Branch, ...]:
    """SD3's JointTransformerBlock and FLUX's double blocks, in the order their forwards add them (AdaLayerNormZero
    returns ``x, gate_msa, shift_mlp, scale_mlp, gate_mlp``; SD3.5's SD35AdaLayerNormZeroX adds ``x2, gate_msa2``)."""
    image = [Branch("attn", 0, IMAGE, "norm1", 1)]
    if getattr(block, "use_dual_attention", False):
        image.append(Branch("attn2", None, IMAGE, "norm1", 6))
    image.append(Branch("ff", None, IMAGE, "norm1", 4))
    if getattr(block, "context_pre_only", False):
        return tuple(image)
    return (*image, Branch("attn", 1, TEXT, "norm1_context", 1), Branch("ff_context", None, TEXT, "norm1_context", 4))


def _single_stream_branches(block: Any) -> tuple[Branch, ...]:
    """FLUX's single blocks: ``gate * proj_out(cat(attn, mlp))`` on the joined tokens (AdaLayerNormZeroSingle
    returns ``x, gate``)."""
    return (Branch("proj_out", None, JOINT, "norm", 1),)


# block class -> its branches, for the blocks whose attention and MLP outputs and gates are known
BRANCH_BLOCKS = {JointTransformerBlock: _double_stream_branches, FluxTransformerBlock: _double_stream_branches,
                 FluxSingleTransformerBlock: _single_stream_branches}


class BranchState(BaseState):
    """One block's branch outputs (before their gates) at the last step it computed."""

    def __init__(self) -> None:
        self.branches: dict[str, torch.Tensor] | None = None

    def reset(self) -> None:
        self.branches = None


class ForaBlockHook(RunHeadHook):
    """One block (a run of one): computes on every ``interval``-th step, reuses its residual otherwise."""

    def __init__(self, config: ForaConfig) -> None:
        super().__init__(RunState())
        self.config = config

    def decide(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> RunDecision:
        return RunDecision(reuse=not self.config.computes(current_step(self.config)))


class ForaBranchHook(ModelHook):
    """One block: computes on every ``interval``-th step, recording its branches before their gates; otherwise
    returns its input plus each recorded branch times its gate of this step."""

    _is_stateful = True

    def __init__(self, config: ForaConfig, branches: tuple[Branch, ...]) -> None:
        super().__init__()
        self.config = config
        self.branches = branches
        self.state = BranchState()

    def new_forward(self, module: torch.nn.Module, *args, **kwargs):
        recorded, first = self.state.branches, self.branches[0]
        if recorded is not None and not self.config.computes(current_step(self.config)):
            streams = self._streams(module, args, kwargs)
            if recorded[first.key].shape == streams[first.stream].shape:  # else: another batch or size computes
                return self._reuse(module, args, kwargs, streams, recorded)
        outputs: dict[str, Any] = {}
        handles = [getattr(module, name).register_forward_hook(self._recorder(name, outputs))
                   for name in dict.fromkeys(branch.module for branch in self.branches)]
        try:
            output = self.fn_ref.original_forward(*args, **kwargs)
        finally:
            for handle in handles:
                handle.remove()
        self.state.branches = {b.key: outputs[b.module] if b.item is None else outputs[b.module][b.item]
                               for b in self.branches}
        return output

    def _streams(self, module: Any, args: tuple, kwargs: dict) -> dict[str, Any]:
        """The block's input streams (every block these hooks take is called with both) and, for a block that joins
        them, the text tokens followed by the image tokens."""
        hidden_states, encoder_hidden_states = block_streams(module, args, kwargs)
        streams: dict[str, Any] = {IMAGE: hidden_states, TEXT: encoder_hidden_states}
        if self.branches[0].stream == JOINT:
            streams[JOINT] = torch.cat([streams[TEXT], hidden_states], dim=1)
        return streams

    @staticmethod
    def _recorder(name: str, outputs: dict[str, Any]):
        def record(module: torch.nn.Module, args: tuple, output: Any) -> None:
            if name in outputs:  # e.g. a feed-forward run in chunks (set_chunk_feed_forward)
                raise UserError(f"FORA's method.reuse=branches needs one call of {name!r} per block call")
            outputs[name] = output
        return record

    def _reuse(self, module: Any, args: tuple, kwargs: dict, streams: dict[str, Any],
               recorded: dict[str, torch.Tensor]) -> tuple:
        """Each stream plus its recorded branches times their gates from this call's ``temb``; a branch's
        adaLN layer modulates the stream the branch adds to, so the layer is called on that stream."""
        temb = block_argument(module, "temb", args, kwargs)
        norms: dict[str, tuple] = {}
        out = dict(streams)
        for b in self.branches:
            if b.norm not in norms:
                norms[b.norm] = getattr(module, b.norm)(streams[b.stream], emb=temb)
            out[b.stream] = out[b.stream] + norms[b.norm][b.gate].unsqueeze(1) * recorded[b.key]
        if JOINT in out:
            text_tokens = streams[TEXT].shape[1]
            return block_output(out[JOINT][:, text_tokens:], out[JOINT][:, :text_tokens])
        return block_output(out[IMAGE], out[TEXT] if any(b.stream == TEXT for b in self.branches) else None)

    def reset_state(self, module: torch.nn.Module) -> torch.nn.Module:
        self.state.reset()
        return module


def current_step(config: ForaConfig) -> int:
    clock = config.current_step_callback
    assert clock is not None  # apply_fora refuses a config without one
    return clock()


def branch_hook(block: Any, config: ForaConfig, family: str) -> ForaBranchHook:
    """The branch-reusing hook of ``block``; a ConfigError where its branches are not known."""
    for cls, branches in BRANCH_BLOCKS.items():
        if isinstance(block, cls):
            return ForaBranchHook(config, branches(block))
    names = sorted(cls.__name__ for cls in BRANCH_BLOCKS)
    raise ConfigError("method.reuse", BRANCHES,
                      f"'residual' for model.family {family!r} (its {type(block).__name__} has no known gated "
                      f"attention and MLP branches; 'branches' hooks {names})")


def apply_fora(module: torch.nn.Module, config: ForaConfig) -> None:
    """Apply FORA to every block of an SD3, FLUX or Qwen-Image transformer (``reuse: branches``: SD3 and FLUX)."""
    if config.current_step_callback is None:
        raise ValueError("FORA needs `current_step_callback` in its config")
    family = family_of(module)
    config.check_family(family)
    for _, block in transformer_blocks(module):
        if config.reuse == BRANCHES:
            hook = branch_hook(block, config, family)
            HookRegistry.check_if_exists_or_initialize(block).register_hook(hook, FORA_BLOCK_HOOK)
        else:
            register_run([block], ForaBlockHook(config), FORA_BLOCK_HOOK)
