"""The handle a cache is driven through: step clock, reset, detach, removal and counted work.

Work is counted per unit call: the unit is the transformer block for caches that hook blocks (FBC,
MagCache, FORA, Delta-DiT, TeaCache; every block counts, hooked or not) and the attention layer for
caches that hook only attention layers (PAB, FasterCache, TaylorSeer, which reuse attention outputs and
still run the rest of each block). Every unit gets two counting hooks around the cache's own hooks: the
innermost one sees the unit's real computation, the outermost one every call, and ``skipped = calls -
computed``. A unit answered from the cache counts one skip; a whole-stack reuse counts every block.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, TypedDict

import torch
from diffusers.hooks import HookRegistry, ModelHook
from diffusers.hooks.hooks import CacheContext, StateManager
from diffusers.models.attention import AttentionModuleMixin
from diffusers.models.attention_processor import Attention

from agg_bench.errors import UserError

from .blocks import timestep_to_1000, transformer_blocks
from .configs import STEP_CALLBACK, TIMESTEP_CALLBACK

class CacheStats(TypedDict):
    """A handle's unit computations done and skipped, and the fraction skipped."""

    computed: int
    skipped: int
    hit_rate: float


COMPUTED_HOOK = "cache_stats_computed"
CALLED_HOOK = "cache_stats_called"
CONTEXT_NAME = "denoise"
ATTENTION_CLASSES = (Attention, AttentionModuleMixin)


@dataclass
class UnitCounts:
    """Calls of one unit and how many of them ran its real forward."""

    calls: int = 0
    computed: int = 0

    @property
    def skipped(self) -> int:
        return self.calls - self.computed


class CountHook(ModelHook):
    """Adds one to ``counts.<field>`` whenever the forward it wraps runs."""

    def __init__(self, counts: UnitCounts, field: str) -> None:
        super().__init__()
        self.counts = counts
        self.field = field

    def pre_forward(self, module: torch.nn.Module, *args, **kwargs):
        setattr(self.counts, self.field, getattr(self.counts, self.field) + 1)
        return args, kwargs


class StepClock:
    """The denoising step of the next transformer call, as given to :meth:`CacheHandle.begin_step`."""

    def __init__(self) -> None:
        self.step_index: int | None = None
        self.timestep: float | None = None

    def current_step(self) -> int:
        self._require()
        assert self.step_index is not None  # _require raised otherwise
        return self.step_index

    def current_timestep(self) -> float:
        """The current timestep on the 0-1000 scale (1000 = pure noise), whatever the family."""
        self._require()
        assert self.timestep is not None  # begin_step sets it with the step
        return self.timestep

    def clear(self) -> None:
        self.step_index = self.timestep = None

    def _require(self) -> None:
        if self.step_index is None:
            raise UserError("an inference cache needs begin_step(step_index, timestep) before each transformer call")


@dataclass(frozen=True)
class _ModuleBefore:
    had_registry: bool
    hook_names: tuple[str, ...]
    forward_in_dict: bool


def _snapshot(module: torch.nn.Module) -> _ModuleBefore:
    registry = getattr(module, "_diffusers_hook", None)
    return _ModuleBefore(registry is not None, tuple(registry._hook_order) if registry else (),
                         "forward" in module.__dict__)


def _restore(module: torch.nn.Module, before: _ModuleBefore) -> None:
    """Unregister every hook added since ``before`` (outermost first) and drop what hooking added."""
    registry = getattr(module, "_diffusers_hook", None)
    if registry is not None:
        for name in reversed(list(registry._hook_order)):
            if name not in before.hook_names:
                registry.remove_hook(name, recurse=False)
        if not before.had_registry:
            del module._diffusers_hook
    if not before.forward_in_dict and "forward" in module.__dict__:
        del module.__dict__["forward"]


def _detached(value: Any) -> Any:
    if torch.is_tensor(value):
        return value.detach()
    if isinstance(value, tuple):
        return tuple(_detached(v) for v in value)
    if isinstance(value, list):
        return [_detached(v) for v in value]
    if isinstance(value, dict):
        return {k: _detached(v) for k, v in value.items()}
    return value


def _hook_states(hook: ModelHook) -> list[Any]:
    """The state objects a hook keeps: its own (anything with ``reset()``) and its StateManagers' states."""
    states: list[Any] = []
    for value in vars(hook).values():
        if isinstance(value, StateManager):
            states.extend(value._state_cache.values())
        elif callable(getattr(value, "reset", None)) and not isinstance(value, torch.nn.Module):
            states.append(value)
    return states


def has_cache(transformer: torch.nn.Module) -> bool:
    registries = (getattr(m, "_diffusers_hook", None) for m in transformer.modules())
    return any(r is not None and COMPUTED_HOOK in r.hooks for r in registries)


def checkpointable_modules(transformer: torch.nn.Module) -> list[Any]:
    """The modules with diffusers' ``gradient_checkpointing`` flag (an attribute torch's Module does not type)."""
    return [m for m in transformer.modules() if hasattr(m, "gradient_checkpointing")]


def uses_gradient_checkpointing(modules: list[torch.nn.Module]) -> bool:
    return any(m.gradient_checkpointing is True for m in modules)


def gradient_checkpointing_error() -> UserError:
    return UserError(
        "inference caches and gradient checkpointing do not mix: checkpointing re-runs blocks during backward, "
        "which would advance and overwrite the cache state; disable gradient checkpointing to use a cache"
    )


class CacheHandle:
    """One cache applied to one transformer. See the package docstring for the calling protocol."""

    def __init__(self, transformer: torch.nn.Module, name: str, config: Any,
                 apply_fn: Callable[[torch.nn.Module, Any], None]) -> None:
        self.transformer = transformer
        self.name = name
        self._clock = StepClock()
        self._removed = False
        self._checkpointable = checkpointable_modules(transformer)
        self._before = {module: _snapshot(module) for module in transformer.modules()}

        blocks = dict(transformer_blocks(transformer))
        attention: dict[str, Any] = {unit_name: module for block_name, block in blocks.items()
                     for unit_name, module in block.named_modules(prefix=block_name)
                     if isinstance(module, ATTENTION_CLASSES)}
        counts = {unit_name: UnitCounts() for unit_name in {**blocks, **attention}}
        # Innermost: registered before the cache's hooks, so it only sees real computation.
        for unit_name, module in {**blocks, **attention}.items():
            HookRegistry.check_if_exists_or_initialize(module).register_hook(
                CountHook(counts[unit_name], "computed"), COMPUTED_HOOK)
        counted = {module: _snapshot(module) for module in transformer.modules()}

        callbacks = {STEP_CALLBACK: self._clock.current_step, TIMESTEP_CALLBACK: self._clock.current_timestep}
        fields = {f.name for f in dataclasses.fields(config)}
        self.config = dataclasses.replace(config, **{k: v for k, v in callbacks.items() if k in fields})
        try:
            apply_fn(transformer, self.config)
        except Exception:
            self._restore_all()
            raise
        self._hooks = self._hooks_added_since(counted)
        hooked = {id(module) for module, _ in self._hooks}

        # A cache that hooks any block is counted on every block (one it leaves alone always computes);
        # one that hooks attention layers only is counted on every attention layer.
        if any(id(m) in hooked for m in blocks.values()):
            self.unit, units, others = "block", blocks, attention
        elif any(id(m) in hooked for m in attention.values()):
            self.unit, units, others = "attention", attention, blocks
        else:
            self._restore_all()
            raise UserError(f"cache {name!r} found nothing to cache in {type(transformer).__name__}")
        for module in others.values():
            if id(module) not in hooked:
                _restore(module, self._before[module])
        # Outermost: registered after the cache's hooks, so it sees every call.
        self._units: dict[str, UnitCounts] = {}
        for unit_name, module in units.items():
            HookRegistry.check_if_exists_or_initialize(module).register_hook(
                CountHook(counts[unit_name], "calls"), CALLED_HOOK)
            self._units[unit_name] = counts[unit_name]
        self._invalidate_registry_caches()
        self._set_context()

    # ----- protocol -------------------------------------------------------------------------
    def begin_step(self, step_index: int, timestep: float | torch.Tensor) -> None:
        """Announce the next transformer call: denoising step ``step_index`` at ``timestep``, the value the
        transformer receives (SD3: sigma*1000, FLUX: sigma; a tensor must hold one value for all rows)."""
        self._require_active()
        if uses_gradient_checkpointing(self._checkpointable):
            raise gradient_checkpointing_error()
        if torch.is_tensor(timestep):
            values = timestep.detach().flatten()
            if values.numel() == 0 or not bool((values == values[0]).all()):
                raise UserError("a cached transformer call needs one timestep for every row of the batch")
            timestep = float(values[0])
        self._clock.step_index = int(step_index)
        self._clock.timestep = timestep_to_1000(self.transformer, float(timestep))
        self._set_context(step_index, timestep)

    def reset(self) -> None:
        """Forget all cache state and counts: the next call starts a new trajectory batch."""
        self._require_active()
        for module, hook in self._hooks:
            hook.reset_state(module)
        self._clock.clear()
        self._set_context()
        self.reset_stats()

    def detach(self) -> None:
        """Detach every cached tensor from autograd, so a later backward stops at the cache."""
        for _, hook in self._hooks:
            for state in _hook_states(hook):
                for key, value in list(vars(state).items()):
                    setattr(state, key, _detached(value))

    def remove(self) -> None:
        """Unregister every hook this handle installed; the transformer is left as it was before."""
        if self._removed:
            return
        self._restore_all()
        self._hooks = []
        self._removed = True

    # ----- counted work ---------------------------------------------------------------------
    @property
    def stats(self) -> CacheStats:
        """Unit computations done and skipped since the last reset, and the fraction skipped."""
        computed = sum(c.computed for c in self._units.values())
        skipped = sum(c.skipped for c in self._units.values())
        total = computed + skipped
        return CacheStats(computed=computed, skipped=skipped, hit_rate=skipped / total if total else 0.0)

    @property
    def stats_by_module(self) -> dict[str, dict[str, int]]:
        """``{unit name: {"computed", "skipped"}}``, e.g. ``"transformer_blocks.3"``."""
        return {name: dict(computed=c.computed, skipped=c.skipped) for name, c in self._units.items()}

    def reset_stats(self) -> None:
        for counts in self._units.values():
            counts.calls = counts.computed = 0

    # ----- internals ------------------------------------------------------------------------
    def _hooks_added_since(self, before: dict) -> list[tuple[torch.nn.Module, ModelHook]]:
        added: list[tuple[torch.nn.Module, ModelHook]] = []
        for module in self.transformer.modules():
            registry = getattr(module, "_diffusers_hook", None)
            if registry is not None:
                added.extend((module, registry.hooks[n]) for n in registry._hook_order
                             if n not in before[module].hook_names)
        return added

    def _require_active(self) -> None:
        if self._removed:
            raise UserError(f"the {self.name!r} cache was removed from this transformer")

    def _restore_all(self) -> None:
        for module in self.transformer.modules():
            if module in self._before:
                _restore(module, self._before[module])
        self._invalidate_registry_caches()

    def _invalidate_registry_caches(self) -> None:
        registry = getattr(self.transformer, "_diffusers_hook", None)
        if registry is not None:
            registry.invalidate_child_registries_cache()

    def _set_context(self, step_index: int | None = None, timestep: float | None = None) -> None:
        context = CacheContext(CONTEXT_NAME, step_index=step_index, timestep=timestep)
        for _, hook in self._hooks:
            for value in vars(hook).values():
                if isinstance(value, StateManager):
                    value.set_context(context)
