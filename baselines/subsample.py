"""Timestep-subsampling GRPO baselines: train fewer denoising steps per sample, each one exactly.

- ``fraction`` (DanceGRPO): every sample trains its own random subset of round(train.timestep_fraction * T)
  steps, the ``steps`` plan of :mod:`agg_bench.engine.trained_steps` (of T - 1 with ``train.ignore_last``, the
  public ``--ignore_last``: DanceGRPO's scripts drop the last step); a run asking for ``train.plan: groups`` is refused,
  because whole groups of consecutive steps are not DanceGRPO's scheme (use ``full`` with that plan).
- ``window`` (MixGRPO, Flow-GRPO-Fast): the rollout is stochastic only inside a window of
  ``window_size`` consecutive steps and follows the ODE elsewhere, so only window steps have a
  log-probability and only they can be trained. The window start is fixed, drawn per iteration, or
  slides along the trajectory as training progresses.

Both compute the gradient of their trained steps exactly, as ``full`` does: they inherit its
accumulation and differ from it only in which steps exist to be trained.

Replayed on a frozen rollout (``replay``, ``gradcheck``; :class:`agg_bench.methods.base.ReplayCase`), both
draw their own trained steps from the snapshot's stochastic steps, with a generator seeded by ``seed``:
``fraction`` is then ``replanned`` (its rollout is distributed as ``full``'s), ``window`` is ``partial``
(its own rollout follows the ODE outside the window, where the snapshot's states come from SDE steps)
unless the snapshot's stochastic steps are exactly its window.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from agg_bench.config.options import option
from agg_bench.engine.trained_steps import draw_plan, plan_steps
from agg_bench.errors import ConfigError
from agg_bench.methods.base import ReplayCase, register_method
from baselines.full import FullConfig, FullEstimator


@dataclass
class FractionConfig(FullConfig):
    """Options of DanceGRPO's random step subset: ``full``'s.

    The fraction of steps trained is ``train.timestep_fraction`` (one knob for every method); this
    method only insists that the steps are drawn one by one (``train.plan: steps``, the default).
    """


@register_method
class FractionEstimator(FullEstimator):
    """Exact per-step backward on each sample's own random subset of steps."""

    name = "fraction"
    config_cls = FractionConfig
    config: FractionConfig
    replans = True

    def check_run(self, cfg) -> None:
        if cfg.train.plan != "steps":
            raise ConfigError("train.plan", cfg.train.plan,
                              "'steps' for method 'fraction' (random steps per sample; "
                              "whole groups are method 'full' with train.plan=groups)")

    def replay_case(self, cfg, stochastic, batch_size, generator):
        train = cfg.train
        steps = draw_plan(train, batch_size, stochastic, generator)
        return ReplayCase("replanned", steps,
                          f"{steps.shape[1]} steps per sample drawn anew (train.timestep_fraction="
                          f"{train.timestep_fraction}, seed={cfg.seed}) from the snapshot's "
                          f"{int(stochastic.sum())} stochastic steps")


@dataclass
class WindowConfig(FullConfig):
    """Options of a window of consecutive SDE (and trained) steps; ODE sampling elsewhere.

    Where the window starts in iteration m, step 0 being the noisiest (``window_mode``):
    - ``fixed``: at ``window_start`` every iteration;
    - ``random``: uniformly in [window_start, window_max_start], drawn from the iteration's generator
      (Flow-GRPO-Fast draws its window among the early steps);
    - ``progressive`` (MixGRPO): at ``window_start + window_stride * (m // window_interval)``; once that passes
      its last start the window stays there, or with ``window_wrap`` starts over at ``window_start``
      (MixGRPO's ``--roll_back``). The last start is sampling.steps - window_size (the window whole), or with
      ``window_end`` window_end - 1: the window goes on past window_end - window_size, cut at window_end.
    The bounds that depend on ``sampling.steps`` are checked when a run is set up (``check_run``).
    An option that only other modes read (``window_max_start``: random; ``window_stride``, ``window_interval``,
    ``window_wrap``: progressive) is ignored, not refused, so that a section switches mode with one
    ``--set method.window_mode=...`` (the MixGRPO-Flash preset's Flash* variant); its bounds are still checked.
    """

    window_size: int = option(4, "steps in the window, at most `sampling.steps` (MixGRPO: 4 of 25)",
                              minimum=1, maximum=1000)
    window_mode: Literal["fixed", "random", "progressive"] = option(
        "progressive", "where the window starts each iteration: `fixed`, `random` or `progressive` (class docstring)")
    window_start: int = option(0, "the first start (`fixed`, `progressive`) or the smallest start (`random`)",
                               minimum=0, maximum=1000)
    window_max_start: int | None = option(
        None, "`random` only (ignored in other modes): the largest start drawn (null: `window_end`, or "
        "`sampling.steps`, minus `window_size`)", minimum=0, maximum=1000)
    window_stride: int = option(1, "`progressive` only (ignored in other modes): steps the window moves each time "
                                   "it moves", minimum=1, maximum=1000)
    window_interval: int = option(25, "`progressive` only (ignored in other modes): iterations between moves of the "
                                      "window (MixGRPO's shift interval)", minimum=1, maximum=100_000)
    window_wrap: bool = option(False, "`progressive` only (ignored in other modes): restart at "
                                     "`window_start` instead of staying at the end")
    window_end: int | None = option(
        None, "no window reaches this step (null: `sampling.steps`); windows are cut at it, steps start .. "
        "min(start + window_size, window_end) - 1; in [window_size, sampling.steps]. MixGRPO truncates at T - 2 "
        "(`max_timesteps = sampling_steps - 2`, its windows `range(cur, min(cur + group_size, max_timesteps))`; its "
        "iterations at the start T - 2 itself, whose window is empty, are not taken here)", minimum=1, maximum=1000)


@register_method
class WindowEstimator(FullEstimator):
    """SDE sampling and exact per-step training inside one moving window of steps; ODE outside."""

    name = "window"
    config_cls = WindowConfig
    config: WindowConfig
    replans = True

    def __init__(self, config: WindowConfig | None = None):
        super().__init__(config)
        self.last_start: int | None = None

    def end(self, steps: int) -> int:
        """The step no window reaches (``window_end``, or the schedule's end)."""
        return steps if self.config.window_end is None else self.config.window_end

    def start_range(self, steps: int) -> tuple[int, int]:
        """(smallest, largest) start of a whole window for a ``steps``-step schedule, or a ConfigError."""
        c = self.config
        if not 1 <= c.window_size <= steps:
            raise ConfigError("method.window_size", c.window_size, f"an integer in [1, {steps}] (sampling.steps)")
        if c.window_end is not None and not c.window_size <= c.window_end <= steps:
            raise ConfigError("method.window_end", c.window_end,
                              f"null or an integer in [{c.window_size}, {steps}] "
                              "(method.window_size .. sampling.steps)")
        bound = "sampling.steps" if c.window_end is None else "method.window_end"
        last = self.end(steps) - c.window_size
        if c.window_start > last:
            raise ConfigError("method.window_start", c.window_start,
                              f"an integer in [0, {last}] ({bound} - method.window_size)")
        high = last
        if c.window_max_start is not None:
            if not c.window_start <= c.window_max_start <= last:
                raise ConfigError("method.window_max_start", c.window_max_start,
                                  f"null or an integer in [{c.window_start}, {last}] "
                                  f"(method.window_start .. {bound} - method.window_size)")
            high = c.window_max_start
        return c.window_start, high

    def window_start(self, iteration: int, steps: int, generator: torch.Generator | None = None) -> int:
        """The first step of iteration ``iteration``'s window; random mode draws it from ``generator``."""
        c = self.config
        low, high = self.start_range(steps)
        if c.window_mode == "fixed":
            return low
        if c.window_mode == "random":
            return int(torch.randint(low, high + 1, (1,), generator=generator))
        moves = iteration // c.window_interval
        last = steps - c.window_size if c.window_end is None else c.window_end - 1  # cut windows go on to it
        if c.window_wrap:
            positions = (last - low) // c.window_stride + 1  # starts low, low+s, ... that fit
            return low + c.window_stride * (moves % positions)
        return min(low + c.window_stride * moves, last)

    def check_run(self, cfg) -> None:
        self.start_range(cfg.sampling.steps)
        if cfg.train.plan == "groups" and cfg.train.plan_window > self.config.window_size:
            raise ConfigError("train.plan_window", cfg.train.plan_window,
                              f"at most method.window_size = {self.config.window_size} for method 'window' "
                              "(only window steps can be trained)")
        self.check_windows_trainable(cfg)

    def run_starts(self, cfg) -> list[int]:
        """Every start a window of this run may take: the fixed one, each one random mode may draw, or those
        progressive mode reaches within ``train.iterations``."""
        c, steps = self.config, cfg.sampling.steps
        low, high = self.start_range(steps)
        if c.window_mode == "fixed":
            return [low]
        if c.window_mode == "random":
            return list(range(low, high + 1))
        # past `steps` moves the starts repeat (window_wrap) or stay at the last one
        moves = min((cfg.train.iterations - 1) // c.window_interval, steps)
        return sorted({self.window_start(m * c.window_interval, steps) for m in range(moves + 1)})

    def check_windows_trainable(self, cfg) -> None:
        """Every window the run may take keeps what ``train.plan`` draws (a step, or a group of
        ``train.plan_window``) once the steps it may not draw are left out (the last one with
        ``train.ignore_last``, the step into sigma 0 of a ``cps`` SDE, the steps past ``window_end``): a
        ConfigError before the run starts, not in the iteration whose window has none."""
        from agg_bench.engine.sampler import stochastic_steps  # torch-only; the options import no engine

        train, steps = cfg.train, cfg.sampling.steps
        drawable = plan_steps(stochastic_steps(cfg.sampling.sde, torch.linspace(1, 0, steps + 1)), train.ignore_last)
        need = train.plan_window if train.plan == "groups" else 1
        for start in self.run_starts(cfg):
            window = self.window_mask(start, steps)
            if cfg.reward.on == "x0" and cfg.sampling.same_noise_per_group and not window[:-1].any():
                raise ConfigError("reward.on", "x0", f"'final' with sampling.same_noise_per_group and the window of "
                                                     f"steps {start}..{self.window_last(start, steps)}: no SDE step "
                                                     "comes before the last step's data prediction, so a group has "
                                                     "one reward and every advantage is 0")
            kept = int((window & drawable).sum())
            if kept < need:
                wanted = f"train.plan_window = {need} steps" if train.plan == "groups" else "a step"
                raise ConfigError(
                    "method.window_size", self.config.window_size,
                    f"a window that keeps {wanted} to train wherever the run puts it: the window of steps {start}.."
                    f"{self.window_last(start, steps)} (method.window_mode={self.config.window_mode}) has {kept} "
                    f"that the plan may draw (train.ignore_last={str(train.ignore_last).lower()}, "
                    f"sampling.sde={cfg.sampling.sde}, sampling.steps={steps})")

    def window_last(self, start: int, steps: int) -> int:
        """The last step of the window that starts at ``start`` (cut at ``window_end``)."""
        return min(start + self.config.window_size, self.end(steps)) - 1

    def window_mask(self, start: int, steps: int) -> torch.Tensor:
        """(steps,) True on the window that starts at step ``start`` (cut at ``window_end``)."""
        mask = torch.zeros(steps, dtype=torch.bool)
        mask[start: self.window_last(start, steps) + 1] = True
        return mask

    def sde_mask(self, iteration, steps, generator):
        start = self.window_start(iteration, steps, generator)
        self.last_start = start
        return self.window_mask(start, steps)

    def replay_case(self, cfg, stochastic, batch_size, generator):
        """The window of iteration 0 on the snapshot's trajectory; its steps planned as in a run."""
        steps = stochastic.numel()
        start = self.window_start(0, steps, generator)
        window = self.window_mask(start, steps)
        last = self.window_last(start, steps)
        if torch.equal(window, stochastic.cpu()):  # the snapshot is this window's own rollout
            return ReplayCase("as_trained", None, f"the snapshot's stochastic steps are the window {start}..{last}")
        available = window & stochastic.cpu()
        if not available.any():
            raise ConfigError("method.window_start", self.config.window_start,
                              f"a window that overlaps the snapshot's stochastic steps "
                              f"{torch.nonzero(stochastic).flatten().tolist()}")
        planned = draw_plan(cfg.train, batch_size, available, generator)
        return ReplayCase("partial", planned,
                          f"window steps {start}..{last} of the snapshot's trajectory, stochastic outside the window "
                          "where the method's own rollout follows the ODE (so the states before the window and "
                          "the images the advantages come from differ from the method's)")

    def iteration_metrics(self) -> dict:
        return {"window_start": self.last_start}
