"""Exact counts of DiT evaluations.

Counts are per sample: one call of the transformer on a batch of ``b`` latents adds ``b``. That makes
the counts independent of how a method batches its work, so two methods compare by the work they do,
not by how they chunk it. The calls are counted beside them (one call adds 1, whatever its ``b``), since
a call costs more than its latents alone: at small sizes a call of 1 latent costs nearly what one of 4
costs (``docs/timing.md``, "Calls and latents"), and the cost model prices both.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, fields

import torch

from ..records import PASS_KEYS


@dataclass
class PassCounter:
    """Per-sample counts of transformer forward passes (with and without grad) and backward passes, and
    the calls that made them (``<kind>_calls``)."""

    forward_nograd: int = 0
    forward_grad: int = 0
    backward: int = 0
    forward_nograd_calls: int = 0
    forward_grad_calls: int = 0
    backward_calls: int = 0

    def reset(self) -> None:
        for f in fields(self):
            setattr(self, f.name, 0)

    def as_dict(self) -> dict[str, int]:
        """Per-sample passes of each kind (the records' pass keys)."""
        return {kind: getattr(self, kind) for kind in PASS_KEYS}

    def calls(self) -> dict[str, int]:
        """Transformer calls of each kind."""
        return {kind: getattr(self, f"{kind}_calls") for kind in PASS_KEYS}

    def __sub__(self, other: "PassCounter") -> "PassCounter":
        return PassCounter(**{f.name: getattr(self, f.name) - getattr(other, f.name) for f in fields(self)})

    def copy(self) -> "PassCounter":
        return PassCounter(**asdict(self))


class _CountBackward(torch.autograd.Function):
    """Identity whose backward adds the batch size to ``counter.backward`` and one call."""

    @staticmethod
    def forward(ctx, output: torch.Tensor, counter: PassCounter) -> torch.Tensor:
        ctx.counter = counter
        ctx.batch = output.shape[0]
        return output.view_as(output)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        ctx.counter.backward += ctx.batch
        ctx.counter.backward_calls += 1
        return grad_output, None


def count_backward(output: torch.Tensor, counter: PassCounter) -> torch.Tensor:
    """Return ``output`` unchanged; every backward pass that flows through it is counted."""
    return _CountBackward.apply(output, counter)
