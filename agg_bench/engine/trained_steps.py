"""Which denoising steps each sample trains on: the draw that ``train.plan`` names.

The two kinds of draw return ``train_steps`` (B, N) int64 in denoising order, drawn from the steps that
have a log-probability (``available``):
- ``steps``: DanceGRPO's scheme, each sample its own random subset of round(fraction * T) steps;
- ``groups``: the available steps cut into consecutive groups of ``plan_window`` steps, each sample
  keeps its own random round(fraction * n_groups) groups (the AGG authors' scheme), so a method
  that groups W = plan_window steps sees whole groups. Steps past the last whole group are not trained.
Counts are rounded (Python's ``round``, halves to even) and never fall below one step or group; the
public Flow-GRPO and DanceGRPO code floors instead, which differs only when fraction * n ends in .5 or more.
With ``train.ignore_last`` the last step is not available (:func:`plan_steps`).

A method whose rows train different numbers of steps (``guess`` with ``zero_loss_on_guess``) pads each row's
steps with :data:`NO_STEP` up to the longest row's: ``train_steps`` stays (B, N), N the longest row.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..errors import ConfigError

if TYPE_CHECKING:
    from ..config.sections import TrainConfig

KINDS = ("steps", "groups")
NO_STEP = -1  # an entry of train_steps past the end of a row that trains fewer than N steps (module docstring)


def plan_steps(available: torch.Tensor, ignore_last: bool) -> torch.Tensor:
    """The steps a plan may draw from: ``available`` (T,) bool, without the last step where ``ignore_last``
    (``train.ignore_last``: the public ``--ignore_last``)."""
    if not ignore_last:
        return available
    kept = available.clone()
    kept[-1] = False
    return kept


def _count(fraction: float, n: int) -> int:
    return max(1, min(n, round(fraction * n)))


def steps_per_sample(kind: str, available: int, fraction: float, plan_window: int) -> int:
    """N, the number of trained steps each sample gets from a draw of ``kind`` over ``available`` steps."""
    if kind == "groups":
        n_groups = available // plan_window if plan_window >= 1 else 0
        return _count(fraction, n_groups) * plan_window if n_groups else 0
    return _count(fraction, available)


def draw_trained_steps(kind: str, batch_size: int, available: torch.Tensor, fraction: float, plan_window: int,
                       generator: torch.Generator) -> torch.Tensor:
    steps = torch.nonzero(available, as_tuple=False).flatten()
    if steps.numel() == 0:
        raise ConfigError("train.plan", kind, "at least one step with a log-probability")
    if not 0 < fraction <= 1:
        raise ConfigError("train.timestep_fraction", fraction, "a number in (0, 1]")
    rows = []
    if kind == "steps":
        n = _count(fraction, steps.numel())
        for _ in range(batch_size):
            pick = torch.randperm(steps.numel(), generator=generator)[:n].sort().values
            rows.append(steps[pick])
    elif kind == "groups":
        n_groups = steps.numel() // plan_window if plan_window >= 1 else 0
        if n_groups == 0:
            raise ConfigError("train.plan_window", plan_window,
                              f"an integer in [1, {steps.numel()}] (the number of steps with a log-probability)")
        groups = steps[: n_groups * plan_window].view(n_groups, plan_window)
        n = _count(fraction, n_groups)
        for _ in range(batch_size):
            pick = torch.randperm(n_groups, generator=generator)[:n].sort().values
            rows.append(groups[pick].flatten())
    else:
        raise ConfigError("train.plan", kind, f"one of {list(KINDS)}")
    return torch.stack(rows).to(torch.int64)


def draw_plan(train: TrainConfig, batch_size: int, available: torch.Tensor,
              generator: torch.Generator) -> torch.Tensor:
    """:func:`draw_trained_steps` as a run's ``train`` section sets it: its plan, fraction and group length, from
    ``available`` without the last step where ``train.ignore_last`` (:func:`plan_steps`)."""
    return draw_trained_steps(train.plan, batch_size, plan_steps(available, train.ignore_last),
                              train.timestep_fraction, train.plan_window, generator)
