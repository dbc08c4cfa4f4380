"""The caches' options: one config dataclass per cache, checked when it is made.

Each cache's hooks live in its own module (:mod:`.fbc`, :mod:`.teacache`, ...) and import diffusers; the
configs live here and import neither diffusers nor the models, so a sweep's methods are checked
(``agg_bench.tools.sweep``) without importing diffusers, peft or transformers. A cache's module docstring says
what the cache does; its config's docstring documents each option.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from agg_bench.engine.families import FAMILY_SPECS
from agg_bench.errors import ConfigError, UserError

# Block lists of each family (its spec's cache_block_lists), in the order the transformer runs them; its
# keys are the families the caches support.
BLOCK_LISTS: dict[str, tuple[str, ...]] = {name: spec.cache_block_lists for name, spec in FAMILY_SPECS.items()}
# Config fields that apply_cache fills with the handle's step clock; they are not user options.
STEP_CALLBACK = "current_step_callback"
TIMESTEP_CALLBACK = "current_timestep_callback"
CALLBACK_FIELDS = (STEP_CALLBACK, TIMESTEP_CALLBACK)
# MagCache: the longest trajectory, and the names of diffusers' mag_ratios tables (magcache.PRESET_RATIOS)
MAGCACHE_MAX_STEPS = 1000
MAGCACHE_PRESETS = ("flux",)
# TaylorSeer: storage dtypes of the Taylor factors
FACTOR_DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16,
                 "float16": torch.float16}
EARLY, LATE, ALWAYS = "early", "late", "always"  # when Delta-DiT reuses a run


def check_option(key: str, value: Any, ok: bool, expected: str) -> None:
    """Raise ``ConfigError("method.<key>", ...)`` unless ``ok``."""
    if not ok:
        raise ConfigError(f"method.{key}", value, expected)


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def as_range(key: str, value: Any) -> tuple[float, float]:
    """A ``(low, high)`` pair from a tuple or a YAML list, or a config error."""
    ok = isinstance(value, (tuple, list)) and len(value) == 2 and all(is_number(v) for v in value)
    check_option(key, value, ok, "a pair [low, high] of numbers")
    return (value[0], value[1])


def check_spatial_attention_skip(config: Any) -> None:
    """Check the spatial-attention options PAB and FasterCache share (``spatial_attention_block_skip_range``
    an integer >= 1, ``spatial_attention_timestep_skip_range`` a pair of numbers, made a tuple)."""
    skip = config.spatial_attention_block_skip_range
    check_option("spatial_attention_block_skip_range", skip, is_int(skip) and skip >= 1, "an integer >= 1")
    config.spatial_attention_timestep_skip_range = as_range(
        "spatial_attention_timestep_skip_range", config.spatial_attention_timestep_skip_range)


@dataclass
class FbcConfig:
    """Options of First Block Cache.

    Args:
        threshold (`float`, defaults to `0.05`):
            diffusers' default. The first block always runs; the remaining blocks are skipped (their cached
            residual added instead) while the relative mean absolute change of the first block's residual
            since the last computed step stays at or below this value. 0 never skips (unless the first
            block's residual repeats exactly).
    """

    threshold: float = 0.05

    def __post_init__(self) -> None:
        check_option("threshold", self.threshold, is_number(self.threshold) and self.threshold >= 0,
                     "a number >= 0")


@dataclass
class PabConfig:
    """Options of Pyramid Attention Broadcast.

    Args:
        spatial_attention_block_skip_range (`int`, defaults to `2`):
            Inside the timestep range, each attention layer computes on every N-th call and returns its
            previous output on the other N - 1. 1 never reuses. diffusers' fallback value.
        spatial_attention_timestep_skip_range (`tuple[float, float]`, defaults to `(100, 800)`):
            Open interval of timesteps, on the 0-1000 scale for every family (FLUX's sigma is multiplied by
            1000), inside which attention may be reused. diffusers' default.
        current_timestep_callback (`Callable[[], float]`, set by `apply_cache`):
            Returns the current timestep on the 0-1000 scale.
    """

    spatial_attention_block_skip_range: int = 2
    spatial_attention_timestep_skip_range: tuple[float, float] = (100, 800)
    current_timestep_callback: Callable[[], float] | None = None

    def __post_init__(self) -> None:
        check_spatial_attention_skip(self)


@dataclass
class FasterCacheConfig:
    """Options of FasterCache's attention reuse.

    Args:
        spatial_attention_block_skip_range (`int`, defaults to `2`):
            Inside the timestep range, each attention layer computes on every N-th call and extrapolates
            from its last two computed outputs on the others. 1 never reuses. diffusers' default.
        spatial_attention_timestep_skip_range (`tuple[float, float]`, defaults to `(-1, 681)`):
            Open interval of timesteps (0-1000 scale for every family) inside which attention may be reused.
            diffusers' default.
        attention_weight (`float`, defaults to `0.5`):
            Reused output = last + (last - second to last) * weight. diffusers' default.
        current_timestep_callback (`Callable[[], float]`, set by `apply_cache`):
            Returns the current timestep on the 0-1000 scale.

    The first call after a reset always computes, whatever the timestep: there is nothing to reuse yet.
    """

    spatial_attention_block_skip_range: int = 2
    spatial_attention_timestep_skip_range: tuple[float, float] = (-1, 681)
    attention_weight: float = 0.5
    current_timestep_callback: Callable[[], float] | None = None

    def __post_init__(self) -> None:
        check_spatial_attention_skip(self)
        check_option("attention_weight", self.attention_weight, is_number(self.attention_weight), "a number")


@dataclass
class MagCacheConfig:
    """Options of MagCache.

    Args:
        threshold (`float`, defaults to `0.06`):
            Largest accumulated magnitude error at which the blocks are still skipped. diffusers' default.
        max_skip_steps (`int`, defaults to `3`):
            Most consecutive steps skipped. 0 never skips. diffusers' default.
        retention_steps (`int`, defaults to `2`):
            The first this many steps of a trajectory are always computed. (diffusers sets this as a fraction
            of the step count; the step count is not known when the cache is applied.)
        mag_ratios (`list[float]` or `"flux"`, defaults to `None`):
            Per-step magnitude ratios, indexed by step; steps past the list use 1. `"flux"` is diffusers'
            FLUX.1 table (28 steps). `None` is all ones (see :mod:`.magcache`).
        num_inference_steps (`int`, defaults to `None`):
            If set, `mag_ratios` is resampled (nearest) to this many steps, e.g. to use the 28-step FLUX
            table with a 10-step sampler. `None` uses the ratios as given.
        current_step_callback (`Callable[[], int]`, set by `apply_cache`):
            Returns the current step index.
    """

    threshold: float = 0.06
    max_skip_steps: int = 3
    retention_steps: int = 2
    mag_ratios: list[float] | str | None = None
    num_inference_steps: int | None = None
    current_step_callback: Callable[[], int] | None = None

    def __post_init__(self) -> None:
        check_option("threshold", self.threshold, is_number(self.threshold) and self.threshold >= 0,
                     "a number >= 0")
        for key in ("max_skip_steps", "retention_steps"):
            value = getattr(self, key)
            check_option(key, value, is_int(value) and value >= 0, "an integer >= 0")
        ratios = self.mag_ratios
        most = MAGCACHE_MAX_STEPS
        ok = ratios is None or (isinstance(ratios, str) and ratios in MAGCACHE_PRESETS) or (
            isinstance(ratios, (list, tuple)) and 0 < len(ratios) <= most and all(is_number(r) for r in ratios))
        check_option("mag_ratios", ratios, ok,
                     f"a list of at most {most} numbers, one per step, or one of {sorted(MAGCACHE_PRESETS)}")
        steps = self.num_inference_steps
        check_option("num_inference_steps", steps, steps is None or (is_int(steps) and 1 <= steps <= most),
                     f"an integer from 1 to {most}")


@dataclass
class TaylorSeerConfig:
    """Options of TaylorSeer.

    Args:
        cache_interval (`int`, defaults to `5`):
            After the warm-up, each layer computes once every this many steps and predicts in between.
            1 never predicts. diffusers' default.
        disable_cache_before_step (`int`, defaults to `3`):
            Steps before this index always compute (they gather the Taylor factors). diffusers' default.
        disable_cache_after_step (`int`, defaults to `None`):
            Steps from this index on always compute; `None` never stops predicting. diffusers' default.
        max_order (`int`, defaults to `1`):
            Order of the Taylor expansion. diffusers' default.
        taylor_factors_dtype (`str`, defaults to `"float32"`):
            Storage dtype of the factors. diffusers defaults to bfloat16 to save memory; float32 keeps the
            rounding of the stored factors out of the measured cache error.
    """

    cache_interval: int = 5
    disable_cache_before_step: int = 3
    disable_cache_after_step: int | None = None
    max_order: int = 1
    taylor_factors_dtype: str = "float32"

    def __post_init__(self) -> None:
        for key, least in (("cache_interval", 1), ("disable_cache_before_step", 0), ("max_order", 1)):
            value = getattr(self, key)
            check_option(key, value, is_int(value) and value >= least, f"an integer >= {least}")
        after = self.disable_cache_after_step
        check_option("disable_cache_after_step", after, after is None or (is_int(after) and after >= 0),
                     "an integer >= 0, or null")
        check_option("taylor_factors_dtype", self.taylor_factors_dtype, self.taylor_factors_dtype in FACTOR_DTYPES,
                     f"one of {sorted(FACTOR_DTYPES)}")


@dataclass
class ForaConfig:
    """Options of FORA.

    Args:
        interval (`int`, defaults to `3`):
            N: every block computes on steps with ``step % N == 0`` and reuses its residual on the other
            N - 1 steps. 1 never reuses. A block with nothing recorded yet (e.g. a trajectory that does not
            start at step 0) computes.
        current_step_callback (`Callable[[], int]`, set by `apply_cache`):
            Returns the index of the denoising step of the current call.
    """

    interval: int = 3
    current_step_callback: Callable[[], int] | None = None

    def __post_init__(self) -> None:
        check_option("interval", self.interval, is_int(self.interval) and self.interval >= 1, "an integer >= 1")


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


@dataclass
class TeaCacheConfig:
    """Options of TeaCache.

    Args:
        threshold (`float`, defaults to `0.2`):
            The blocks are skipped while the accumulated rescaled change is below this. 0 never skips. With
            the identity rescaling the sum is the raw relative L1 change, and 0.2 is a starting point to
            tune per model, not a calibrated speed/quality trade-off.
        coefficients (`list[float]`, defaults to `[1.0, 0.0]`):
            Rescaling polynomial applied to each relative L1 change, highest degree first (as
            ``numpy.polyval``). The default is the identity; TeaCache fits one per model so that the
            rescaled input change tracks the change of the model's output.
        warmup_steps (`int`, defaults to `1`):
            Steps with an index below this always compute.
        current_step_callback (`Callable[[], int]`, set by `apply_cache`):
            Returns the index of the denoising step of the current call.
    """

    threshold: float = 0.2
    coefficients: list[float] = field(default_factory=lambda: [1.0, 0.0])
    warmup_steps: int = 1
    current_step_callback: Callable[[], int] | None = None

    def __post_init__(self) -> None:
        check_option("threshold", self.threshold, is_number(self.threshold) and self.threshold >= 0,
                     "a number >= 0")
        c = self.coefficients
        check_option("coefficients", c, isinstance(c, (list, tuple)) and len(c) > 0 and all(is_number(v) for v in c),
                     "a non-empty list of numbers, highest degree first")
        self.coefficients = [float(v) for v in c]
        check_option("warmup_steps", self.warmup_steps, is_int(self.warmup_steps) and self.warmup_steps >= 1,
                     "an integer >= 1")

    def rescale(self, change: float) -> float:
        value = 0.0
        for coefficient in self.coefficients:
            value = value * change + coefficient
        return value
