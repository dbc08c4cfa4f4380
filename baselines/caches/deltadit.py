"""Delta-DiT: reuse the residual of a run of blocks, the rear blocks early and the front blocks late.

Delta-DiT's observation is that the rear blocks of a DiT mostly add detail and the front blocks mostly
lay out the image: while the outline is forming (early steps) the rear run's residual (its output minus
its input) is reused, and while details form (late steps) the front run's. Every ``interval``-th step
computes every block and records both runs' residuals; the other steps reuse the active run.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from agg_bench.errors import ConfigError, UserError

from .common import check_option, is_int, transformer_blocks
from .runs import RunDecision, RunHeadHook, RunState, register_run

DELTADIT_BLOCK_HOOK = "deltadit_block"
EARLY, LATE, ALWAYS = "early", "late", "always"


@dataclass
class DeltaDiTConfig:
    """Options of Delta-DiT.

    Args:
        interval (`int`, defaults to `2`):
            Steps with ``step % interval == 0`` compute every block and record the runs' residuals; the
            other steps reuse the active run. 1 never reuses.
        boundary (`int`, defaults to `10`):
            Steps ``< boundary`` reuse the rear run, steps ``>= boundary`` the front run.
        num_blocks (`int`, defaults to `None`):
            Length of the front run (the first blocks) and of the rear run (the last blocks). `None` is half
            the stack, rounded down. The runs may not overlap.
        block_range (`tuple[int, int]`, defaults to `None`):
            ``[start, end)`` block indices (in running order; FLUX's single blocks follow its double
            blocks) of one run that is reused on every non-computing step, whatever `boundary` says.
            Overrides `num_blocks`.
        current_step_callback (`Callable[[], int]`, set by `apply_cache`):
            Returns the index of the denoising step of the current call.
    """

    interval: int = 2
    boundary: int = 10
    num_blocks: int | None = None
    block_range: tuple[int, int] | None = None
    current_step_callback: Callable[[], int] | None = None

    def __post_init__(self) -> None:
        check_option("interval", self.interval, is_int(self.interval) and self.interval >= 1, "an integer >= 1")
        check_option("boundary", self.boundary, is_int(self.boundary) and self.boundary >= 0, "an integer >= 0")
        n = self.num_blocks
        check_option("num_blocks", n, n is None or (is_int(n) and n >= 1), "an integer >= 1, or null")
        r = self.block_range
        ok = r is None or (isinstance(r, (tuple, list)) and len(r) == 2 and all(is_int(v) for v in r)
                           and 0 <= r[0] < r[1])
        check_option("block_range", r, ok, "a pair [start, end) of block indices with 0 <= start < end")
        if r is not None:
            self.block_range = (r[0], r[1])

    def runs(self, num_stack_blocks: int) -> list[tuple[range, str]]:
        """The runs (block indices) and when each is reused, for a stack of ``num_stack_blocks`` blocks."""
        if self.block_range is not None:
            start, end = self.block_range
            if end > num_stack_blocks:
                raise ConfigError("method.block_range", list(self.block_range),
                                  f"indices within the transformer's {num_stack_blocks} blocks")
            return [(range(start, end), ALWAYS)]
        if num_stack_blocks < 2:
            raise UserError("Delta-DiT's front and rear runs need at least two blocks; set method.block_range")
        n = self.num_blocks if self.num_blocks is not None else num_stack_blocks // 2
        if 2 * n > num_stack_blocks:
            raise ConfigError("method.num_blocks", n,
                              f"at most {num_stack_blocks // 2}, so the front and rear runs of the "
                              f"{num_stack_blocks} blocks do not overlap")
        return [(range(0, n), LATE), (range(num_stack_blocks - n, num_stack_blocks), EARLY)]


class DeltaDiTRunHook(RunHeadHook):
    """First block of a run: reuses the run on non-computing steps of its phase."""

    def __init__(self, phase: str, interval: int, boundary: int, current_step_callback: Callable[[], int]) -> None:
        super().__init__(RunState())
        self.phase = phase
        self.interval = interval
        self.boundary = boundary
        self.current_step_callback = current_step_callback

    def decide(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> RunDecision:
        step = self.current_step_callback()
        full_step = step % self.interval == 0
        active = self.phase == ALWAYS or (self.phase == EARLY) == (step < self.boundary)
        return RunDecision(reuse=active and not full_step, record=full_step)


def apply_deltadit(module: torch.nn.Module, config: DeltaDiTConfig) -> None:
    """Apply Delta-DiT to an SD3, FLUX or Qwen-Image transformer."""
    if config.current_step_callback is None:
        raise ValueError("Delta-DiT needs `current_step_callback` in its config")
    blocks = [block for _, block in transformer_blocks(module)]
    for indices, phase in config.runs(len(blocks)):
        head = DeltaDiTRunHook(phase, config.interval, config.boundary, config.current_step_callback)
        register_run([blocks[i] for i in indices], head, DELTADIT_BLOCK_HOOK)
