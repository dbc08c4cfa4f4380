"""The caches' options: one options class per cache, typed and bounded with ``option()``.

Each cache's hooks live in its own module (:mod:`.fbc`, :mod:`.teacache`, ...) and import diffusers; the
options live here and import neither diffusers nor the models, so a sweep's methods are checked
(``agg_bench.tools.sweep``) without importing diffusers, peft or transformers. A cache's module docstring says
what the cache does; each option's field says what it sets, its default and its bounds, and
:func:`baselines.caches.make_config` checks a cache's options with them
(:func:`agg_bench.config.options.typed_options`).
"""
from __future__ import annotations

import typing
from dataclasses import dataclass, field
from typing import Any, Callable, Literal

import torch

from agg_bench.config.options import Options, option
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
MagCachePreset = Literal["flux"]
MAGCACHE_PRESETS = typing.get_args(MagCachePreset)
# TaylorSeer: storage dtypes of the Taylor factors
FactorDtype = Literal["bfloat16", "float16", "float32", "float64"]
TaylorSeerSchedule = Literal["diffusers", "public"]  # which steps after the warm-up compute
FACTOR_DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16,
                 "float16": torch.float16}
EARLY, LATE, ALWAYS = "early", "late", "always"  # when Delta-DiT reuses a run
# FORA: what a reused block adds to its input
ForaReuse = Literal["residual", "branches"]
RESIDUAL, BRANCHES = typing.get_args(ForaReuse)
# FasterCache: the outputs a reused attention call extrapolates from
ExtrapolateFrom = Literal["calls", "computed"]
# Bounds of the caches' numbers: a step index or a count of steps or blocks, a threshold on a relative change,
# a timestep on the 0-1000 scale, a coefficient.
MAX_STEPS = 1000
MAX_THRESHOLD = 1e6
TIMESTEP_RANGE = {"minimum": -1000, "maximum": 2000}
MAX_COEFFICIENT = 1e6


def clock(doc: str) -> Any:
    """A field :func:`baselines.caches.apply_cache` sets to the handle's step clock: not an option."""
    return field(default=None, metadata={"doc": doc, "internal": True})


def trajectory_steps_option(doc: str) -> Any:
    """The trajectory's step count, which a cache that treats the last step apart needs (null: not given);
    the ``cached`` method refuses one that is not the run's ``sampling.steps``."""
    return option(None, doc, minimum=1, maximum=MAX_STEPS)


def skip_range(default: tuple[float, float], doc: str) -> Any:
    """An open interval of timesteps (0-1000 scale): a pair [low, high] of numbers, low < high
    (:func:`check_skip_range`)."""
    return option(default, doc, items=TIMESTEP_RANGE, expected="a pair [low, high] of timesteps (0-1000 scale)")


def check_skip_range(pair: tuple[float, float]) -> None:
    """A ConfigError naming ``method.spatial_attention_timestep_skip_range`` unless low < high: an empty
    interval holds no timestep, so the cache would never reuse and its run would measure no cache."""
    low, high = pair
    if not low < high:
        raise ConfigError("method.spatial_attention_timestep_skip_range", list(pair),
                          "a pair [low, high] of timesteps (0-1000 scale) with low < high (an empty interval "
                          "reuses nothing)")


@dataclass
class FbcConfig(Options):
    """Options of First Block Cache."""

    threshold: float = option(
        0.05, "diffusers' default. The first block always runs; the remaining blocks are skipped (their cached "
        "residual added instead) while the relative mean absolute change of the first block's residual since the "
        "last computed step stays at or below this value. 0 never skips (unless the first block's residual "
        "repeats exactly)", minimum=0, maximum=MAX_THRESHOLD)


@dataclass
class PabConfig(Options):
    """Options of Pyramid Attention Broadcast."""

    spatial_attention_block_skip_range: int = option(
        2, "inside the timestep range, each attention layer computes on every N-th call and returns its previous "
        "output on the other N - 1; 1 never reuses. diffusers' fallback value", minimum=1, maximum=MAX_STEPS)
    spatial_attention_timestep_skip_range: tuple[float, float] = skip_range(
        (100, 800), "open interval (low < high) of timesteps, on the 0-1000 scale for every family (FLUX's sigma is multiplied "
        "by 1000), inside which attention may be reused. diffusers' default")
    current_timestep_callback: Callable[[], float] | None = clock("returns the current timestep (0-1000 scale)")

    def check(self) -> None:
        check_skip_range(self.spatial_attention_timestep_skip_range)


@dataclass
class FasterCacheConfig(Options):
    """Options of FasterCache's attention reuse. The first call after a reset always computes, whatever the
    timestep: there is nothing to reuse yet."""

    spatial_attention_block_skip_range: int = option(
        2, "inside the timestep range, each attention layer computes on every N-th call and extrapolates from its "
        "last two outputs (`extrapolate_from`) on the others; 1 never reuses. diffusers' default", minimum=1, maximum=MAX_STEPS)
    spatial_attention_timestep_skip_range: tuple[float, float] = skip_range(
        (-1, 681), "open interval (low < high) of timesteps (0-1000 scale for every family) inside which attention may be "
        "reused. diffusers' default")
    attention_weight: float = option(
        0.5, "reused output = last + (last - second to last) * weight. diffusers' default",
        minimum=-MAX_COEFFICIENT, maximum=MAX_COEFFICIENT)
    extrapolate_from: ExtrapolateFrom = option(
        "calls", "what `last` and `second to last` are: `calls`, the layer's outputs on its last two calls, so a "
        "reuse that follows a reuse extrapolates from an extrapolated output (diffusers); `computed`, its last two "
        "computed outputs (the public FasterCache code)")
    current_timestep_callback: Callable[[], float] | None = clock("returns the current timestep (0-1000 scale)")

    def check(self) -> None:
        check_skip_range(self.spatial_attention_timestep_skip_range)


@dataclass
class MagCacheConfig(Options):
    """Options of MagCache."""

    threshold: float = option(0.06, "largest accumulated magnitude error at which the blocks are still skipped. "
                                    "diffusers' default", minimum=0, maximum=MAX_THRESHOLD)
    max_skip_steps: int = option(3, "most consecutive steps skipped; 0 never skips. diffusers' default",
                                 minimum=0, maximum=MAX_STEPS)
    retention_steps: int = option(
        2, "the first this many steps of a trajectory are always computed (diffusers sets this as a fraction of "
        "the step count; the step count is not known when the cache is applied)", minimum=0, maximum=MAX_STEPS)
    mag_ratios: list[float] | MagCachePreset | None = option(
        None, "per-step magnitude ratios, indexed by step; steps past the list use 1. `flux` is diffusers' FLUX.1 "
        "table (28 steps); null is all ones (see `baselines/caches/magcache.py`)", min_items=1,
        max_items=MAGCACHE_MAX_STEPS, items={"minimum": -MAX_COEFFICIENT, "maximum": MAX_COEFFICIENT},
        expected=f"a list of at most {MAGCACHE_MAX_STEPS} numbers, one per step, or one of {list(MAGCACHE_PRESETS)}")
    num_inference_steps: int | None = option(
        None, "if set, `mag_ratios` is resampled (nearest) to this many steps, e.g. to use the 28-step FLUX table "
        "with a 10-step sampler; null uses the ratios as given", minimum=1, maximum=MAGCACHE_MAX_STEPS)
    current_step_callback: Callable[[], int] | None = clock("returns the current step index")


@dataclass
class TaylorSeerConfig(Options):
    """Options of TaylorSeer."""

    cache_interval: int = option(5, "after the warm-up, each layer computes once every this many steps and predicts "
                                    "in between; 1 never predicts. diffusers' default", minimum=1, maximum=MAX_STEPS)
    disable_cache_before_step: int = option(3, "steps before this index always compute (they gather the Taylor "
                                               "factors); 0 only with `cache_interval` 1. diffusers' default", minimum=0, maximum=MAX_STEPS)
    disable_cache_after_step: int | None = option(
        None, "steps from this index on always compute, an index after `disable_cache_before_step`; null never "
        "stops predicting. diffusers' default",
        minimum=0, maximum=MAX_STEPS)
    max_order: int = option(1, "order of the Taylor expansion. diffusers' default", minimum=1, maximum=10)
    schedule: TaylorSeerSchedule = option(
        "diffusers", "which steps after the warm-up compute, with B = `disable_cache_before_step` and N = "
        "`cache_interval`: `diffusers` (its rule) B + 1, B + 1 + N, ..., so step B predicts; `public` (TaylorSeer's "
        "code, its warm-up `first_enhance` = B) B - 1 + N, B - 1 + 2N, ...: N - 1 predicted steps after the last "
        "warm-up step and after every computed one. The two agree where N is 2")
    taylor_factors_dtype: FactorDtype = option(
        "float32", "storage dtype of the factors. diffusers defaults to bfloat16 to save memory; float32 keeps the "
        "rounding of the stored factors out of the measured cache error")

    def computes(self, step: int) -> bool:
        """Whether the attention layers compute on step ``step`` under :attr:`schedule` (the cooldown included)."""
        before, interval, after = self.disable_cache_before_step, self.cache_interval, self.disable_cache_after_step
        offset = before + 1 if self.schedule == "diffusers" else before - 1
        return step < before or (step - offset) % interval == 0 or (after is not None and step >= after)

    def check(self) -> None:
        if self.disable_cache_before_step == 0 and self.cache_interval > 1:
            # diffusers counts a layer's first call as step 0: it would predict before any call has computed
            raise ConfigError("method.disable_cache_before_step", 0,
                              f"at least 1 with method.cache_interval = {self.cache_interval} (the first step "
                              "would predict from Taylor factors that no computed step has gathered)")
        after = self.disable_cache_after_step
        if after is not None and after <= self.disable_cache_before_step:
            raise ConfigError("method.disable_cache_after_step", after,
                              f"null or a step after method.disable_cache_before_step = "
                              f"{self.disable_cache_before_step} (the steps in between are the ones predicted: "
                              "none would be)")


@dataclass
class ForaConfig(Options):
    """Options of FORA."""

    interval: int = option(
        3, "N: every block computes on steps with step % N == 0 and reuses (`reuse` says what) on the other N - 1 steps; "
        "1 never reuses. A block with nothing recorded yet (e.g. a trajectory that does not start at step 0) "
        "computes", minimum=1, maximum=MAX_STEPS)
    trajectory_steps: int | None = trajectory_steps_option(
        "the trajectory's step count T (`sampling.steps`): as in the public FORA code, which counts its steps down "
        "from T - 1, the blocks compute on the first step and on every step whose index from the end, "
        "T - 1 - step, is a multiple of N (so the last step computes); null counts from the first step "
        "(step % N == 0). The two agree where T - 1 is a multiple of N")
    reuse: ForaReuse = option(
        RESIDUAL, "what a reused block adds to its input. `residual`: its output minus its input at the last step it "
        "computed, that step's adaLN gates included. `branches`, as the public FORA code: its attention and MLP "
        "outputs recorded before their gates, each times its gate of the current step; FLUX's single blocks, whose "
        "attention and MLP share one output projection and one gate, reuse that projection's output before the "
        "gate; Qwen-Image is refused (see `baselines/caches/fora.py`)")
    current_step_callback: Callable[[], int] | None = clock("returns the index of the current call's step")

    def check_family(self, family: str) -> None:
        if self.reuse == BRANCHES and not FAMILY_SPECS[family].gated_branches:
            known = [name for name, spec in FAMILY_SPECS.items() if spec.gated_branches]
            raise ConfigError("method.reuse", BRANCHES,
                              f"{RESIDUAL!r} for model.family {family!r} ('branches' knows the gated attention and "
                              f"MLP branches of the blocks of {known} only)")

    def computes(self, step: int) -> bool:
        """Whether the blocks compute on step ``step`` (they reuse their residuals otherwise)."""
        if self.trajectory_steps is None:
            return step % self.interval == 0
        return step == 0 or (self.trajectory_steps - 1 - step) % self.interval == 0


@dataclass
class DeltaDiTConfig(Options):
    """Options of Delta-DiT."""

    interval: int = option(2, "steps with step % interval == 0 compute every block and record the runs' residuals; "
                              "the other steps reuse the active run. 1 never reuses", minimum=1, maximum=MAX_STEPS)
    boundary: int = option(10, "steps < boundary reuse the rear run, steps >= boundary the front run",
                           minimum=0, maximum=MAX_STEPS)
    num_blocks: int | None = option(
        None, "length of the front run (the first blocks) and of the rear run (the last blocks); null is half the "
        "stack, rounded down. The runs may not overlap", minimum=1, maximum=MAX_STEPS)
    block_range: tuple[int, int] | None = option(
        None, "[start, end) block indices (in running order; FLUX's single blocks follow its double blocks) of one "
        "run that is reused on every non-computing step, whatever `boundary` says; overrides `num_blocks`",
        items={"minimum": 0, "maximum": MAX_STEPS},
        expected="a pair [start, end) of block indices with 0 <= start < end")
    current_step_callback: Callable[[], int] | None = clock("returns the index of the current call's step")

    def check(self) -> None:
        r = self.block_range
        if r is not None and not r[0] < r[1]:
            raise ConfigError("method.block_range", list(r), "a pair [start, end) of block indices with "
                                                             "0 <= start < end")

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
class TeaCacheConfig(Options):
    """Options of TeaCache."""

    threshold: float = option(
        0.2, "the blocks are skipped while the accumulated rescaled change is below this; 0 never skips. With the "
        "identity rescaling the sum is the raw relative L1 change, and 0.2 is a starting point to tune per model, "
        "not a calibrated speed/quality trade-off", minimum=0, maximum=MAX_THRESHOLD)
    coefficients: list[float] = option(
        [1.0, 0.0], "rescaling polynomial applied to each relative L1 change, highest degree first (as "
        "`numpy.polyval`). The default is the identity; TeaCache fits one per model so that the rescaled input "
        "change tracks the change of the model's output (its authors publish FLUX.1-dev's, which "
        "`config/presets/teacache_flux.yaml` sets; none for SD3 or Qwen-Image)", min_items=1, max_items=100,
        items={"minimum": -MAX_COEFFICIENT, "maximum": MAX_COEFFICIENT},
        expected="a non-empty list of numbers, highest degree first")
    warmup_steps: int = option(1, "steps with an index below this always compute", minimum=1, maximum=MAX_STEPS)
    trajectory_steps: int | None = trajectory_steps_option(
        "the trajectory's step count T (`sampling.steps`): its last step, T - 1, always computes, as in the "
        "public TeaCache code; null: the cache does not know which step is the last and decides it like the others")
    current_step_callback: Callable[[], int] | None = clock("returns the index of the current call's step")

    def always_computes(self, step: int) -> bool:
        """Whether step ``step`` computes whatever the change: a warm-up step or the trajectory's last."""
        return step < self.warmup_steps or step == (self.trajectory_steps or 0) - 1

    def rescale(self, change: float) -> float:
        value = 0.0
        for coefficient in self.coefficients:
            value = value * change + coefficient
        return value
