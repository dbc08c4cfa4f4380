"""Exact counts of DiT evaluations.

Counts are per sample: one call of the transformer on a batch of ``b`` latents adds ``b``. That makes
the counts independent of how a method batches its work, so two methods compare by the work they do,
not by how they chunk it.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import torch


@dataclass
class PassCounter:
    """Per-sample counts of transformer forward passes (with and without grad) and backward passes."""

    forward_nograd: int = 0
    forward_grad: int = 0
    backward: int = 0

    def reset(self) -> None:
        self.forward_nograd = self.forward_grad = self.backward = 0

    def as_dict(self) -> dict[str, int]:
        return asdict(self)

    def __sub__(self, other: "PassCounter") -> "PassCounter":
        return PassCounter(
            self.forward_nograd - other.forward_nograd,
            self.forward_grad - other.forward_grad,
            self.backward - other.backward,
        )

    def copy(self) -> "PassCounter":
        return PassCounter(**asdict(self))


class _CountBackward(torch.autograd.Function):
    """Identity whose backward adds the batch size to ``counter.backward``."""

    @staticmethod
    def forward(ctx, output: torch.Tensor, counter: PassCounter) -> torch.Tensor:
        ctx.counter = counter
        ctx.batch = output.shape[0]
        return output.view_as(output)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        ctx.counter.backward += ctx.batch
        return grad_output, None


def count_backward(output: torch.Tensor, counter: PassCounter) -> torch.Tensor:
    """Return ``output`` unchanged; every backward pass that flows through it is counted."""
    return _CountBackward.apply(output, counter)
