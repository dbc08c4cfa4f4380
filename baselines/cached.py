"""Training-free DiT inference caches applied to GRPO (method ``cached``).

One cache of :mod:`baselines.caches` (``method.cache``) is used where ``method.cache_in`` says:

- ``rollout``: sampling runs with the cache, so the stored old log-probs are those of the cached
  policy; training is exact (``full``'s per-step backward). The rollout is cheaper, GRPO's ratio is
  off-policy: the first update measures by how much.
- ``train``: the rollout is exact; the training forward runs with the cache. Caches need one
  trajectory's steps in denoising order, for the whole batch at once, so training walks the steps
  j = 0 .. (last trained step) with every sample at step j: a forward with grad where some sample trains
  j (the others add no loss), a no-grad forward that only feeds the cache where none does, a backward
  per step and ``detach()`` after it (a reused tensor then carries no gradient, so backward skips the
  blocks it stands for: a biased gradient, measured by ``gradcheck``). Each walk starts from a reset cache.
- ``both``: both of the above.

Each use installs the cache for the duration of the rollout or of one ``accumulate`` and removes it
after, so an exact forward never runs through cache hooks and the policy is uncached between uses.

Metric record fields (:meth:`CachedEstimator.iteration_metrics`):
``cache_hit_rate`` = skipped / (computed + skipped) unit computations over the iteration's cached
rollout and training walks (the unit is a transformer block, or an attention layer for caches that
only reuse attention: ``cache_unit``), also split into ``cache_hit_rate_rollout`` and
``cache_hit_rate_train`` (null where no cache ran), with the counts ``cache_computed``/``cache_skipped``;
``offpolicy_gap`` = mean |logp_rollout - logp_exact| over the trained (sample, step) terms at the first
update after a cached rollout (its first optimizer step: with ``train.minibatches`` > 1, the first mini-batch's
terms), logp_exact being the uncached log-prob under the same parameters (null when the rollout was not
cached). ``ratio_dev`` (max |ratio - 1| of the first optimizer step) comes with the update's statistics as for
every method.

Replayed on a frozen (uncached) rollout (``replay``, ``gradcheck``): ``cache_in=train`` is the method as
trained; ``both`` is ``partial`` (the training forward with the cache, but the exact rollout's old
log-probs); ``rollout`` is ``not_applicable`` (its training is ``full``'s; what it changes is the rollout).
"""
from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import torch

from agg_bench.config.options import Options, option
from agg_bench.engine.grpo import StepTerms, TrainBatch, UpdateStats, step_terms
from agg_bench.errors import ConfigError
from agg_bench.machine.fsdp import agreed_max, lockstep
from agg_bench.methods.base import Estimator, ReplayCase, register_method
from baselines.caches import CACHES, apply_cache, cache_options, make_config
from baselines.caches.configs import BLOCK_LISTS
from baselines.full import FullEstimator

if TYPE_CHECKING:  # annotations only: checking a method's options imports neither the models nor diffusers
    from agg_bench.engine.models import Policy
    from baselines.caches.handle import CacheHandle

# Caches that decide from the activations whether to skip: with a sharded model each process would
# decide on its own samples, and the processes' FSDP collectives would no longer match.
DATA_DEPENDENT_CACHES = ("fbc", "teacache")


@dataclass
class CachedMethodOptions(Options):
    """Options of the ``cached`` method; :data:`CachedConfig` adds the caches' options to them.

    The chosen cache's options are flat keys of the method section (``method.threshold``,
    ``method.interval``, ``method.block_range``, ...): every option of every cache's options in
    :mod:`baselines.caches.configs` is a field of :data:`CachedConfig`, typed and bounded by that cache's own
    class. An option left unset (null) takes the chosen cache's default; an option the chosen cache does not
    have is a ConfigError naming it.
    """

    # the key that picks the options class (a cache's) whose options are this section's other keys
    CHOSEN = ("cache", CACHES)

    cache: str | None = option(None, "the cache (required): one of " + ", ".join(f"`{name}`" for name in CACHES))
    cache_in: Literal["rollout", "train", "both"] = option(
        "rollout", "where the cache runs: the rollout, the training forward or both (module docstring)")
    measure_offpolicy_gap: bool = option(
        True, "with `cache_in: both`, recompute the exact log-probs of the trained steps at the first update by "
        "no-grad forwards (counted in `forward_nograd`) to measure `offpolicy_gap`; false skips them and records "
        "null. With `cache_in: rollout` the gap comes free from the exact training forward and is always measured")

    def cache_settings(self) -> dict[str, Any]:
        """The options given for the cache (flat keys that are set)."""
        own = {f.name for f in dataclasses.fields(CachedMethodOptions)}
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if f.name not in own and getattr(self, f.name) is not None}

    def check(self) -> None:
        if self.cache is None or self.cache not in CACHES:
            raise ConfigError("method.cache", self.cache, f"one of {sorted(CACHES)}")
        make_config(self.cache, self.cache_settings())  # names the first unknown or bad option


def _cache_option_names() -> list[str]:
    return sorted({option for name in CACHES for option in cache_options(name)})


# Generated from the caches' options so that a new cache option is a method option without an edit here; each
# is typed and bounded by the chosen cache's class when the section is checked (CachedMethodOptions.check).
CachedConfig = dataclasses.make_dataclass(
    "CachedConfig", [(name, Any, dataclasses.field(default=None, metadata={
        "doc": "an option of the chosen cache (its table)", "constraints": {}, "chosen": True}))
        for name in _cache_option_names()],
    bases=(CachedMethodOptions,), namespace={"__doc__": CachedMethodOptions.__doc__, "__module__": __name__},
)


@dataclass
class CacheWork:
    """Unit computations a cache ran and skipped, summed over the handles it was used through; ``unit``
    is what one computation is ("block", or "attention" for caches that reuse attention only)."""

    computed: int = 0
    skipped: int = 0
    unit: str | None = None  # None: the cache was not used

    def add(self, handle: CacheHandle) -> None:
        self.computed += handle.stats["computed"]
        self.skipped += handle.stats["skipped"]
        self.unit = handle.unit

    def __add__(self, other: "CacheWork") -> "CacheWork":
        return CacheWork(self.computed + other.computed, self.skipped + other.skipped, self.unit or other.unit)

    @property
    def hit_rate(self) -> float | None:
        """skipped / (computed + skipped); None when the cache was not used."""
        if self.unit is None:
            return None
        total = self.computed + self.skipped
        return self.skipped / total if total else 0.0


class GapMeter:
    """Mean |logp - logp_old| over the terms it observes; as ``stats`` it also passes them on to an
    update's :class:`UpdateStats` (the only method of it the exact backward calls)."""

    def __init__(self, stats: UpdateStats | None = None) -> None:
        self.stats = stats
        self.abs_sum = 0.0
        self.count = 0

    def observe(self, log_prob: torch.Tensor, log_prob_old: torch.Tensor) -> None:
        diff = (log_prob.detach().double() - log_prob_old.detach().double()).abs()
        self.abs_sum += float(diff.sum())
        self.count += diff.numel()

    def add(self, terms: StepTerms, log_prob_old: torch.Tensor, scale: float) -> None:
        assert self.stats is not None  # passed on only by a meter made with an update's stats
        self.stats.add(terms, log_prob_old, scale)
        self.observe(terms.log_prob, log_prob_old)

    @property
    def value(self) -> float | None:
        return self.abs_sum / self.count if self.count else None


@contextlib.contextmanager
def checkpointing_paused(transformer: torch.nn.Module):
    """Gradient checkpointing off inside the block, restored after. diffusers only checkpoints under grad,
    so a no-grad rollout computes the same with it off; the cache refuses to start while it is on."""
    from baselines.caches.handle import checkpointable_modules  # diffusers: only when a cache is used

    flags = [(m, m.gradient_checkpointing) for m in checkpointable_modules(transformer)]
    for module, _ in flags:
        module.gradient_checkpointing = False
    try:
        yield
    finally:
        for module, flag in flags:
            module.gradient_checkpointing = flag


@register_method
class CachedEstimator(Estimator):
    """GRPO with a DiT inference cache in the rollout, the training forward, or both."""

    name = "cached"
    config_cls = CachedConfig
    config: Any  # CachedConfig, a class made at import (make_dataclass), which the checker cannot name

    def __init__(self, config: Any = None):
        super().__init__(config)
        self.exact = FullEstimator()
        self.handle: CacheHandle | None = None  # the installed cache while a rollout or walk runs
        self.cached_rollout_version: int | None = None
        self._new_iteration()

    def _new_iteration(self) -> None:
        self.rollout_work = CacheWork()
        self.train_work = CacheWork()
        self.offpolicy_gap: float | None = None

    @property
    def caches_rollout(self) -> bool:
        return self.config.cache_in in ("rollout", "both")

    @property
    def caches_training(self) -> bool:
        return self.config.cache_in in ("train", "both")

    # ----- run checks -------------------------------------------------------------------------
    def check_run(self, cfg) -> None:
        if cfg.model.family not in BLOCK_LISTS:
            raise ConfigError("model.family", cfg.model.family,
                              f"one of {sorted(BLOCK_LISTS)} for method 'cached' (the families the caches support)")
        steps = self.config.trajectory_steps
        if steps is not None and steps != cfg.sampling.steps:
            raise ConfigError("method.trajectory_steps", steps,
                              f"null or sampling.steps = {cfg.sampling.steps} (the step the cache treats as the "
                              "trajectory's last must be its last)")
        # what the cache refuses of the family (FORA's branches on Qwen-Image) before any model is built
        make_config(self.config.cache, self.config.cache_settings()).check_family(cfg.model.family)
        if cfg.train.shard == "fsdp" and self.config.cache in DATA_DEPENDENT_CACHES:
            raise ConfigError("method.cache", self.config.cache,
                              f"a cache that skips by step, not by data, with train.shard=fsdp (not one of "
                              f"{list(DATA_DEPENDENT_CACHES)}: each process would skip different blocks)")
        if self.caches_training and cfg.train.gradient_checkpointing:
            raise ConfigError("train.gradient_checkpointing", True,
                              f"false with method 'cached' and method.cache_in={self.config.cache_in!r}: "
                              "checkpointing re-runs blocks during backward, which would corrupt the cache state")

    def replay_case(self, cfg, stochastic, batch_size, generator):
        if not self.caches_training:
            return ReplayCase("not_applicable", None,
                              "the cache runs only in the rollout, which the snapshot froze uncached; "
                              "on it this method trains exactly as full")
        if self.caches_rollout:
            return ReplayCase("partial", None, "the training forward with the cache; the rollout cache's "
                                               "off-policy old log-probs are not replayed")
        return ReplayCase()

    # ----- installing the cache ---------------------------------------------------------------
    def set_up(self, policy):
        """The cache installed on the built transformer once and removed again, so that what it refuses of this
        model (Delta-DiT's runs past the transformer's blocks) is refused when the run is set up, before it writes
        anything, not in its first rollout."""
        with checkpointing_paused(policy.transformer):
            apply_cache(policy.transformer, self.config.cache, self.config.cache_settings()).remove()

    @contextlib.contextmanager
    def _cache_on(self, policy: Policy, work: CacheWork):
        """The cache installed on the policy's transformer, from a reset state; removed (and its work
        added to ``work``) on the way out."""
        handle = apply_cache(policy.transformer, self.config.cache, self.config.cache_settings())
        self.handle = handle
        try:
            handle.reset()
            yield handle
        finally:
            work.add(handle)
            handle.remove()
            self.handle = None

    @contextlib.contextmanager
    def rollout_hooks(self, policy: Policy):
        """Starts a new iteration's cache record; with a rollout cache, yields its ``begin_step``."""
        self._new_iteration()
        if not self.caches_rollout:
            self.cached_rollout_version = None
            yield None
            return
        with checkpointing_paused(policy.transformer), self._cache_on(policy, self.rollout_work) as handle:
            yield handle.begin_step
        self.cached_rollout_version = policy.version

    # ----- the update -------------------------------------------------------------------------
    def accumulate(self, policy, batch, stats, reference=None):
        first_update = (self.cached_rollout_version is not None
                        and batch.policy_version == self.cached_rollout_version == policy.version)
        gap = GapMeter(stats) if first_update else None
        if not self.caches_training:
            self.exact.accumulate(policy, batch, gap if gap is not None else stats, reference)
        else:
            if gap is not None and self.config.measure_offpolicy_gap:
                self._observe_exact_log_probs(policy, batch, gap)
            self._cached_walk(policy, batch, stats, reference)
        if gap is not None and gap.value is not None:
            self.offpolicy_gap = gap.value

    def _observe_exact_log_probs(self, policy: Policy, batch: TrainBatch, gap: GapMeter) -> None:
        """No-grad, uncached log-probs of every trained (sample, step) term, compared with the rollout's."""
        rows = torch.arange(batch.batch_size, device=batch.latents.device)
        plain = dataclasses.replace(batch, beta=0.0)  # the log-prob needs no reference velocity
        with torch.no_grad():
            for n in range(batch.steps_per_sample):
                steps = batch.train_steps[:, n]
                v = policy.velocity(batch.states(rows, steps), batch.timestep_values(steps), batch.cond)
                gap.observe(step_terms(plain, rows, steps, v).log_prob, batch.log_probs[rows, steps])

    def _cached_walk(self, policy: Policy, batch: TrainBatch, stats: UpdateStats,
                     reference: Policy | None) -> None:
        """Walk the denoising steps in order with the cache on; backward and detach after every step."""
        device = batch.latents.device
        b = batch.batch_size
        trains = torch.zeros(b, batch.timesteps.numel(), dtype=torch.bool, device=device)
        trains[torch.arange(b, device=device)[:, None], batch.train_steps] = True
        # steps some sample trains, on any process when the model is sharded (they walk in lockstep)
        trained = agreed_max(policy, trains.any(dim=0).cpu()).bool()
        last = int(torch.nonzero(trained).max())
        every = torch.arange(b, device=device)
        trainers = {j: trains[:, j].nonzero().flatten() for j in range(last + 1)}
        # The reference may be this very transformer with adapters off (LoRA): run it before the cache is on.
        ref_velocity = {}
        if batch.beta > 0 and reference is not None:
            with torch.no_grad():
                for j in lockstep(reference, batch, [j for j, rows in trainers.items() if rows.numel()], "nograd"):
                    rows = trainers[j]
                    steps = torch.full_like(rows, j)
                    ref_velocity[j] = reference.velocity(batch.states(rows, steps), batch.timestep_values(steps),
                                                         batch.cond[rows])
        with self._cache_on(policy, self.train_work) as handle:
            for j, rows in trainers.items():
                steps = torch.full((b,), j, device=device)
                handle.begin_step(j, batch.timesteps[j])
                with torch.set_grad_enabled(bool(trained[j])):
                    v = policy.velocity(batch.states(every, steps), batch.timestep_values(steps), batch.cond)
                if not rows.numel() and v.requires_grad:
                    v.backward(torch.zeros_like(v))  # another process trains step j: join its backward
                if rows.numel():
                    terms = step_terms(batch, rows, steps[rows], v[rows], ref_velocity.get(j))
                    loss = terms.loss.sum() * batch.loss_scale
                    # With LoRA, a step on which every adapted block was reused has no path to a trained
                    # parameter: its gradient is zero, and there is no backward to run (none is counted).
                    if loss.requires_grad:
                        loss.backward()
                    stats.add(terms, batch.log_probs[rows, j], batch.loss_scale)
                handle.detach()

    # ----- record -----------------------------------------------------------------------------
    def iteration_metrics(self) -> dict:
        total = self.rollout_work + self.train_work
        used = total.unit is not None
        return {
            "cache": self.config.cache, "cache_in": self.config.cache_in, "cache_unit": total.unit,
            "cache_hit_rate": total.hit_rate, "cache_hit_rate_rollout": self.rollout_work.hit_rate,
            "cache_hit_rate_train": self.train_work.hit_rate,
            "cache_computed": total.computed if used else None, "cache_skipped": total.skipped if used else None,
            "offpolicy_gap": self.offpolicy_gap,
        }

    def close(self) -> None:
        if self.handle is not None:
            self.handle.remove()
            self.handle = None
