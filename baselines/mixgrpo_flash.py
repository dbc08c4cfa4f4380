"""MixGRPO-Flash: MixGRPO's sliding SDE window, then a higher-order ODE solver on a shorter grid after it.

Li et al., "MixGRPO: Unlocking Flow-based GRPO Efficiency with Mixed ODE-SDE" (arXiv 2507.21802); public
code github.com/Tencent-Hunyuan/MixGRPO (``fastvideo/utils/sampling_utils.py``: ``run_sample_step``,
``dpm_step``; ``fastvideo/train_grpo_flux.py``: options and defaults; ``scripts/finetune/
finetune_flux_grpo_MixGRPO_Flash*.sh``: the Flash and Flash* settings).

The rollout of iteration m, on a schedule of T steps with sigmas s_0 = 1 > ... > s_T = 0 and the window
[k, L] (L = k + window_size - 1) of method ``window`` (:mod:`baselines.subsample`):
- steps 0..k-1: deterministic Euler, x + (s_{j+1} - s_j) v;
- steps k..L: the run's SDE (``sampling.sde``, ``sampling.eta``); only these have a log-probability, and
  only these are trained (exactly, as ``full`` trains a step);
- after the window: DPM-Solver++ (:mod:`agg_bench.engine.solvers`; order ``solver_order``, 2M in the
  midpoint form) on a compressed grid from s_{L+1} down to 0 of ``num_post = max(int((T - L) * r), 1)``
  points, r = ``post_compress_ratio``: with the shift a = ``sampling.shift`` and the unshifted time
  t = s / (a - (a - 1) s) of s_{L+1}, the points are shift(linspace(t, 0, num_post)), shift(u) =
  a u / (1 + (a - 1) u), the first one set to s_{L+1} itself. Where the public code's num_post would be 1
  (its grid would stop at s_{L+1} and never reach 0) it is 2: one first-order step into 0.
The solver's history holds the data prediction x - s v of every step before it, so that its first step
is second order on the prediction of step L (on the run's grid); its step into 0 is first order and returns
the prediction (the code's ``lower_order_final``: its last step is first order at any order), so a grid of one
step after the window is first order at ``solver_order: 2`` too. ``solver_orders`` lists the order of each solver step of the
last rollout. A window cut at ``window_end`` (MixGRPO's truncation at T - 2) ends at its cut. The trajectory has its own sigmas and its own number of steps, L + num_post; the window
steps keep their sigmas, so training them is training the same transitions as on the run's grid.

Flash takes r = 0.4 and a window that moves by 1 every 20 iterations; Flash* a frozen window
(``window_mode: fixed``) and r = 0.2. MixGRPO itself (Euler after the window on the run's grid) is
method ``window``.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from agg_bench.config.options import option
from agg_bench.engine.solvers import DPM_SOLVER_ORDERS
from agg_bench.errors import ConfigError
from agg_bench.methods.base import ReplayCase, register_method
from baselines.subsample import WindowConfig, WindowEstimator


@dataclass
class MixGRPOFlashConfig(WindowConfig):
    """Options of MixGRPO-Flash: the window's (:class:`baselines.subsample.WindowConfig`) and the solver after
    the window."""

    solver_order: int = option(
        2, "DPM-Solver++'s order after the window: 1 (DDIM, which is Euler on the compressed grid) or 2 (2M, "
        "midpoint form); the step into 0 is first order at either, so a grid of one step is first order (the "
        "code's `lower_order_final`). Public code: `--dpm_solver_order 2`, `--dpm_solver_type midpoint` in the "
        "Flash scripts (its order 3 is not ported)", minimum=min(DPM_SOLVER_ORDERS), maximum=max(DPM_SOLVER_ORDERS))
    post_compress_ratio: float = option(
        0.4, "r: the compressed grid after the window has max(int((T - L) r), 1) points (at least 2). Public code: "
        "`--dpm_post_compress_ratio`, 0.4 in `finetune_flux_grpo_MixGRPO_Flash.sh`, 0.2 in "
        "`finetune_flux_grpo_MixGRPO_Flash*.sh`", exclusive_minimum=0, maximum=1)


def shifted(u: torch.Tensor, shift: float) -> torch.Tensor:
    """The SD3 sigma shift a u / (1 + (a - 1) u)."""
    return shift * u / (1 + (shift - 1) * u)


def post_window_grid(sigmas: torch.Tensor, last: int, ratio: float, shift: float) -> torch.Tensor:
    """The rollout's sigmas: the run's ``sigmas`` (T + 1) up to s_{last+1}, then the compressed grid after the
    window whose last step is ``last`` (module docstring); the run's own when the window ends the schedule."""
    steps = sigmas.numel() - 1
    if last + 1 >= steps:
        return sigmas
    num_post = max(int((steps - last) * ratio), 2)  # public: max(..., 1), a grid that would not reach 0
    start = sigmas[last + 1].to(torch.float64)
    t_start = start / (shift - (shift - 1) * start)
    post = shifted(torch.linspace(float(t_start), 0.0, num_post, dtype=torch.float64), shift)
    post[0] = start
    return torch.cat([sigmas[: last + 1].to(torch.float64), post]).to(sigmas.dtype)


@register_method
class MixGRPOFlashEstimator(WindowEstimator):
    """``window``'s SDE window and exact training; Euler before it, DPM-Solver++ on a compressed grid after."""

    name = "mixgrpo_flash"
    config_cls = MixGRPOFlashConfig
    config: MixGRPOFlashConfig

    def __init__(self, config: MixGRPOFlashConfig | None = None):
        super().__init__(config)
        self.solver_orders: list[int] = []  # the order of each solver step of the last rollout, in order

    def check_run(self, cfg) -> None:
        super().check_run(cfg)
        if cfg.sampling.shift is None:
            raise ConfigError("sampling.shift", None,
                              "a number for method 'mixgrpo_flash' (its grid after the window is the shifted "
                              "linspace of MixGRPO-Flash, built with this shift)")

    def rollout(self, policy, cond, noise, sigmas, sampling, generator, iteration, group_size):
        from agg_bench.engine.rollout import rollout  # the rollout imports the models; a method's options do not
        from agg_bench.engine.sampler import ode_step
        from agg_bench.engine.solvers import MultistepDPMSolverPP

        steps = sigmas.numel() - 1
        self.sde_mask(iteration, steps, generator)  # sets last_start; a random window is drawn here, as in window
        start = self.last_start
        assert start is not None  # sde_mask just drew it
        last = self.window_last(start, steps)
        grid = post_window_grid(sigmas, last, self.config.post_compress_ratio, sampling.shift)
        solver = MultistepDPMSolverPP(grid, self.config.solver_order)
        self.solver_orders = solver.orders  # filled as the rollout takes the steps after the window

        def velocity(j, x, timesteps, cond_):
            v = policy.velocity(x, timesteps, cond_).to(x.dtype)
            solver.observe(j, x, v)
            return v

        def deterministic(j, x, v):
            return ode_step(v, x, grid, j) if j < start else solver.step(j, x)

        return rollout(policy, cond, noise, grid, sampling.sde, sampling.eta, generator,
                       self.window_mask(start, grid.numel() - 1), velocity=velocity, ode=deterministic)

    def replay_case(self, cfg, stochastic, batch_size, generator):
        """The window's steps, planned as ``window`` plans them; ``partial``, because the run's rollout after
        the window (a compressed grid, DPM-Solver++) and so its final images are not the snapshot's."""
        case = super().replay_case(cfg, stochastic, batch_size, generator)
        return ReplayCase("partial", case.train_steps,
                          f"{case.note}; the method's rollout after the window is DPM-Solver++ on a compressed grid, "
                          "not the snapshot's steps, so the images its advantages come from differ")
