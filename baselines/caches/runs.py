"""Residual reuse over a run of consecutive transformer blocks, shared by FORA, Delta-DiT and TeaCache.

A run is one or more consecutive blocks. When the run is computed in full, its last block records what
the run added to each stream (output minus the run's input). When the run is reused, its first block
returns ``input + recorded residual`` and the remaining blocks of the run pass their input through without
computing. Only the first block decides, once per transformer call: a cache is a subclass of
:class:`RunHeadHook` that implements :meth:`RunHeadHook.decide`.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from diffusers.hooks import HookRegistry, ModelHook
from diffusers.hooks.hooks import BaseState

from .blocks import Residual, Streams, add_streams, block_output, block_streams, output_streams, stream_difference


@dataclass
class RunDecision:
    """What the head of a run does on this call: ``reuse`` the recorded residual, or compute the run and
    ``record`` its residual (a computed call that does not record leaves the old residual in place)."""

    reuse: bool
    record: bool = True


class RunState(BaseState):
    """What one run added to its streams when last computed and recorded, and what it does on this call."""

    def __init__(self) -> None:
        self.residual: Residual | None = None
        self.inputs: Streams | None = None
        self.reusing = False
        self.recording = False

    def reset(self) -> None:
        self.residual = None
        self.inputs = None
        self.reusing = False
        self.recording = False


class RunBlockHook(ModelHook):
    """A block inside a run: passes its input through while the run is reused; the run's last block
    records the run's residual when the call records."""

    _is_stateful = True

    def __init__(self, state: RunState, is_tail: bool = False) -> None:
        super().__init__()
        self.state = state
        self.is_tail = is_tail

    def new_forward(self, module: torch.nn.Module, *args, **kwargs):
        if self.state.reusing:
            return block_output(*block_streams(module, args, kwargs))
        output = self.fn_ref.original_forward(*args, **kwargs)
        self._record(output)
        return output

    def _record(self, output: tuple) -> None:
        if self.is_tail and self.state.recording:
            assert self.state.inputs is not None  # the head keeps them for a call that records
            self.state.residual = stream_difference(output_streams(output), self.state.inputs)
            self.state.inputs = None

    def reset_state(self, module: torch.nn.Module) -> torch.nn.Module:
        self.state.reset()
        return module


class RunHeadHook(RunBlockHook):
    """The first block of a run: decides for the whole run on every call."""

    def decide(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> RunDecision:
        """Whether this call reuses the run's recorded residual (computed anyway while none fits) and,
        if it computes, whether it records the run's new residual."""
        raise NotImplementedError

    def new_forward(self, module: torch.nn.Module, *args, **kwargs):
        streams = block_streams(module, args, kwargs)
        decision = self.decide(module, args, kwargs)
        state, residual = self.state, self.state.residual
        state.reusing = (decision.reuse and residual is not None and residual[0] is not None
                         and residual[0].shape == streams[0].shape)
        if state.reusing:
            assert residual is not None  # reusing requires it
            return block_output(*add_streams(streams, residual))
        state.recording = decision.record
        state.inputs = streams if decision.record else None
        output = self.fn_ref.original_forward(*args, **kwargs)
        self._record(output)
        return output


def register_run(blocks: list[torch.nn.Module], head: RunHeadHook, name: str) -> None:
    """Hook ``head`` on the first block of the run and followers sharing its state on the rest."""
    head.is_tail = len(blocks) == 1
    HookRegistry.check_if_exists_or_initialize(blocks[0]).register_hook(head, name)
    for position, block in enumerate(blocks[1:], start=1):
        follower = RunBlockHook(head.state, is_tail=position == len(blocks) - 1)
        HookRegistry.check_if_exists_or_initialize(block).register_hook(follower, name)
