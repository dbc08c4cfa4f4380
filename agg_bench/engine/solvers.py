"""Multistep ODE solvers for the deterministic steps of a flow-matching rollout.

DPM-Solver++ (Lu et al., arXiv 2211.01095, Algorithm 2: multistep, data prediction) written for the
flow's noise schedule: at sigma ``s`` the state is ``x = alpha x_data + sigma noise`` with ``alpha = 1 - s``
and ``sigma = s``, the data prediction of velocity ``v`` is ``x0 = x - s v``, and the half log-SNR is
``lambda = log(alpha / sigma)``. One step from ``s`` to ``s'`` with ``h = lambda' - lambda``:

- first order (DPM-Solver++1, which is DDIM and, on this schedule, exactly the Euler step):
  ``x' = (s'/s) x - alpha' (e^{-h} - 1) x0``;
- second order multistep "2M", midpoint form (diffusers' ``solver_type="midpoint"``), with the data
  prediction ``x0_prev`` of the step before, made at sigma ``s_prev``:
  ``x' = (s'/s) x - alpha' (e^{-h} - 1) D0 - 0.5 alpha' (e^{-h} - 1) D1``, ``D0 = x0``,
  ``D1 = (x0 - x0_prev) / r0``, ``r0 = h_0 / h``, ``h_0 = lambda - lambda_prev``.

A step into sigma 0 (lambda' = +inf) is first order and returns ``x0`` exactly (diffusers'
``final_sigmas_type="zero"``). A step from sigma 1 (lambda = -inf, the first step of the SD3 scheduler's grid)
takes the limit h -> +inf of the first-order step, ``x' = s' x + (1 - s') x0`` (Euler's step from pure noise); a
prediction made at sigma 1 gives the next step ``h_0 = +inf``, so its ``D1`` is 0 and the step is first order, as
DiffusionNFT's ``dpm2`` sampler computes it with ``log(0) = -inf`` (``flow_grpo/diffusers_patch/solver.py``). The previous prediction may come from a step on another grid (MixGRPO-Flash
feeds the predictions of its Euler and SDE steps to the first solver step after its window): ``h_0`` is
measured between the sigmas the predictions were made at, so the ratio ``r0`` absorbs the change of grid.
Coefficients are float64 numbers; the states keep their dtype.

:func:`flow_dpm_grid` is the grid of diffusers' ``DPMSolverMultistepScheduler`` with ``use_flow_sigmas`` (the
scheduler of Sana's diffusers checkpoints, which DGPO's public code samples SD3.5 with): T sigmas
``shift(u)``, ``shift(u) = a u / (1 + (a - 1) u)``, at ``u = 1 - linspace(1, 1/1000, T + 1)`` from the largest
down, the last (u = 0) dropped and ``final_sigmas_type="zero"``'s 0 appended, stored as float32; so the grid
starts below 1 (shift 3: 0.99967). Its timesteps, the transformer's input, are the integers trunc(1000 s),
truncated from the float64 sigmas before they are rounded to float32, and differ from 1000 s by up to 1.

SA-Solver (:class:`SASolver`: predictor and corrector of order 2 in PEC mode; its ODE, tau = 0, by default, or
with the noise level tau on the steps :func:`sa_solver_taus` selects) is the sampler of AWM's public code, on that
code's grid (:func:`sa_solver_grid`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

DPM_SOLVER_ORDERS = (1, 2)
# diffusers' schedulers count noise levels in num_train_timesteps = 1000 integer timesteps
SCHEDULER_TIMESTEPS = 1000


def half_log_snr(sigma: float) -> float:
    """lambda = log(alpha / sigma) = log((1 - s) / s) for 0 < s < 1."""
    return math.log(1.0 - sigma) - math.log(sigma)


@dataclass
class DataPrediction:
    """A step's predicted data ``x0`` = x - s v, made at sigma ``sigma``."""

    x0: torch.Tensor
    sigma: float


def dpm_solver_pp_step(x: torch.Tensor, current: DataPrediction, sigma_next: float,
                       previous: DataPrediction | None = None) -> torch.Tensor:
    """One DPM-Solver++ step of ``x`` from ``current.sigma`` to ``sigma_next``: 2M midpoint when
    ``previous`` is given, first order otherwise, and first order (``current.x0``) into sigma 0."""
    s, x0 = current.sigma, current.x0
    if sigma_next == 0:
        return x0.clone()
    if not 0 < sigma_next < s <= 1:
        raise ValueError(f"a DPM-Solver++ step needs 0 <= sigma' < sigma <= 1, got {s} -> {sigma_next}")
    if s == 1:  # lambda = -inf: e^{-h} = 0, and a prediction before it cannot be (module docstring)
        return sigma_next * x + (1.0 - sigma_next) * x0
    lam, lam_next = half_log_snr(s), half_log_snr(sigma_next)
    h = lam_next - lam
    alpha_next = 1.0 - sigma_next
    phi = alpha_next * math.expm1(-h)  # alpha' (e^{-h} - 1)
    x_next = (sigma_next / s) * x - phi * x0
    if previous is not None and previous.sigma < 1:  # at sigma 1, h_0 = +inf: D1 = 0
        r0 = (lam - half_log_snr(previous.sigma)) / h
        x_next = x_next - (0.5 * phi / r0) * (x0 - previous.x0)
    return x_next


class MultistepDPMSolverPP:
    """DPM-Solver++ of ``order`` (1 or 2) as the deterministic steps of a rollout on ``sigmas``.

    :meth:`observe` is told every step's state and velocity (whatever sampler takes that step), so that
    the first solver step can be second order on the prediction of the step before it; :meth:`step`
    takes step j with the predictions observed at steps j and j - 1. ``orders`` lists the order each step
    it took was of (1 or 2; a step into sigma 0 is first order).
    """

    def __init__(self, sigmas: torch.Tensor, order: int = 2):
        if order not in DPM_SOLVER_ORDERS:
            raise ValueError(f"DPM-Solver++ order {order}: expected one of {list(DPM_SOLVER_ORDERS)}")
        self.sigmas = [float(s) for s in sigmas.to(torch.float64)]
        self.order = order
        self.observed: dict[int, DataPrediction] = {}
        self.orders: list[int] = []

    def observe(self, j: int, x: torch.Tensor, v: torch.Tensor) -> None:
        """Remember step j's data prediction x - s_j v (only the last two are kept)."""
        s = self.sigmas[j]
        self.observed[j] = DataPrediction(x - s * v, s)
        self.observed.pop(j - 2, None)

    def ode_step(self, j: int, x: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """x_{j+1} from x_j and its velocity v_j, where the solver takes every step (:meth:`observe`, then
        :meth:`step`)."""
        self.observe(j, x, v)
        return self.step(j, x)

    def step(self, j: int, x: torch.Tensor) -> torch.Tensor:
        """x_{j+1} from x_j by the solver, step j's prediction observed before."""
        previous = self.observed.get(j - 1) if self.order == 2 else None
        second = previous is not None and previous.sigma < 1 and self.sigmas[j + 1] > 0
        self.orders.append(2 if second else 1)
        return dpm_solver_pp_step(x, self.observed[j], self.sigmas[j + 1], previous)


# The deterministic samplers an ODE rollout may take (a method's ``solver`` option): ``euler`` is the rollout's
# own step (:func:`agg_bench.engine.sampler.ode_step`), ``dpm2`` DPM-Solver++(2M) (:func:`ode_solver`). AWM's
# SA-Solver, which needs its own grid, noise levels and generator, is :class:`SASolver`.
ODE_SOLVERS = ("euler", "dpm2")


def ode_solver(name: str, sigmas: torch.Tensor) -> Callable[[int, torch.Tensor, torch.Tensor], torch.Tensor] | None:
    """The deterministic step ``(j, x_j, v_j) -> x_{j+1}`` of an ODE rollout on ``sigmas``: None for ``euler``
    (the rollout takes its Euler step); for ``dpm2`` DPM-Solver++(2M), first order at the first step and into
    sigma 0, second order between, one velocity per step as Euler: DiffusionNFT's ``sample.solver = "dpm2"``
    (``flow_grpo/diffusers_patch/solver.py``: ``dpm_step`` of order 2 with ``lower_order_final``) and diffusers'
    ``DPMSolverMultistepScheduler`` with ``solver_order=2``, ``solver_type="midpoint"`` and
    ``final_sigmas_type="zero"`` (the Sana scheduler DGPO samples with). A new solver per call: its history
    and ``orders`` are one rollout's."""
    if name == "euler":
        return None
    if name != "dpm2":
        raise ValueError(f"ODE solver {name!r}: expected one of {list(ODE_SOLVERS)}")
    return MultistepDPMSolverPP(sigmas, 2).ode_step


@dataclass(frozen=True)
class FlowDPMGrid:
    """A rollout's grid with integer timesteps (:func:`flow_dpm_grid`): ``sigmas`` (T+1) float64, the steps'
    sigmas ending at 0, and ``timesteps`` (T) int64, the scheduler's trunc(1000 s) of each step."""

    sigmas: torch.Tensor
    timesteps: torch.Tensor

    def model_timesteps(self, timestep_scale: float) -> torch.Tensor:
        """(T,) float64: the values the transformer is given, the timesteps in the family's scale (``timestep_scale``
        multiplies a noise level, :attr:`agg_bench.engine.models.Policy.timestep_scale`): for SD3's 1000 the
        integers themselves."""
        return self.timesteps.to(torch.float64) * (timestep_scale / SCHEDULER_TIMESTEPS)

    def noise_levels(self, dtype: torch.dtype) -> torch.Tensor:
        """(T,) timestep / 1000 in ``dtype``: the noise level the transformer is told at each step (DGPO's public
        training noises at ``t / 1000`` of the rollout's timesteps, not at the grid's sigmas)."""
        return self.timesteps.to(dtype) / SCHEDULER_TIMESTEPS


def flow_dpm_grid(steps: int, shift: float) -> FlowDPMGrid:
    """The grid and timesteps of ``DPMSolverMultistepScheduler(use_flow_sigmas=True, flow_shift=shift)`` after
    ``set_timesteps(steps)`` (module docstring), computed in float64 numpy as the scheduler computes them, so that
    every truncation and float32 rounding is the scheduler's."""
    if steps < 1 or not shift > 0:
        raise ValueError(f"a flow DPM-Solver grid needs steps >= 1 and shift > 0, got {steps}, {shift}")
    u = 1.0 - np.linspace(1, 1 / SCHEDULER_TIMESTEPS, steps + 1)
    shifted = np.flip(shift * u / (1 + (shift - 1) * u))[:-1].copy()
    timesteps = torch.from_numpy((shifted * SCHEDULER_TIMESTEPS).astype(np.int64))  # truncated toward 0
    sigmas = np.concatenate([shifted, [0.0]]).astype(np.float32)
    return FlowDPMGrid(torch.from_numpy(sigmas).to(torch.float64), timesteps)


# SA-Solver's grid ends, as the AWM code sets it, at these sigmas (sa_solver_grid)
SA_SOLVER_FIRST_SIGMA = 1 - 1e-3
# AWM's code gives SA-Solver its noise level tau on the steps into sigmas in this closed interval, 0 elsewhere
SA_SOLVER_NOISE_WINDOW = (0.3, 0.9)


def sa_solver_grid(sigmas: torch.Tensor) -> torch.Tensor:
    """The grid AWM's pipeline hands SA-Solver (``flow_grpo/diffusers_patch/sd3_pipeline_with_logprob.py``,
    ``use_sa_solver``): the schedule's T+1 sigmas (T >= 2, ending at 0) with the last nonzero one set to half the
    one before it, then the first set to 1 - 1e-3 (lambda is finite there), in the schedule's dtype. The model is
    evaluated at these sigmas (its timestep 1000 sigma, as the code's ``input_t * 1000``)."""
    if sigmas.numel() < 3 or float(sigmas[-1]) != 0:
        raise ValueError(f"SA-Solver's grid needs at least 2 steps ending at sigma 0, got {sigmas.tolist()}")
    grid = sigmas.clone()
    grid[-2] = grid[-3] / 2
    grid[0] = SA_SOLVER_FIRST_SIGMA
    return grid


def sa_solver_taus(sigmas: torch.Tensor, tau: float) -> list[float]:
    """The T per-step noise levels AWM's pipeline gives SA-Solver on the grid ``sigmas`` (T+1): ``tau`` at step j
    where the sigma it steps into, s_{j+1}, lies in [0.3, 0.9], else 0 (the code's ``stochasticity_control_function
    = lambda t: noise_level if 0.3 <= t <= 0.9 else 0``, called with the target ``t`` of each predictor and
    corrector). The code compares its float32 sigmas with the bounds in float32; so does this."""
    low, high = (np.float32(b) for b in SA_SOLVER_NOISE_WINDOW)
    return [float(tau) if low <= np.float32(s) <= high else 0.0 for s in sigmas[1:].to(torch.float64).tolist()]


class SASolver:
    """SA-Solver (Xue et al., arXiv 2309.05019) as AWM's rollout runs it (github.com/scxue/advantage_weighted_matching
    ``flow_grpo/diffusers_patch/sa_solver.py``, ``SASolver.sample`` with ``predictor_order=2``,
    ``corrector_order=2``, ``pc_mode='PEC'``, data prediction, and its ``*_few_steps`` updates), on a grid
    ``s_0 > ... > s_{T-1} > s_T = 0`` with ``s_0 < 1`` (:func:`sa_solver_grid`), with the noise level ``taus[j]``
    on step j (:func:`sa_solver_taus`; all 0 by default: the ODE). With the data prediction ``D = y - s v`` of the
    state ``y`` the model was given, lambda = log((1 - s) / s), a step from ``s`` to ``s'`` (``h = lambda' -
    lambda``, ``alpha' = 1 - s'``) with the step's tau and ``c = 1 + tau^2`` is

    - predictor, order 1 (the first step): ``P1 = e^{-tau^2 h} (s'/s) x + alpha' (1 - e^{-c h}) D_j + n``, at
      tau = 0 Euler's step; ``n = s' sqrt(1 - e^{-2 tau^2 h}) xi``, xi ~ N(0, I);
    - predictor, order 2: ``P2 = P1 + alpha' c h^2 / (2 h_prev) (D_j - D_{j-1})``, ``h_prev = lambda_j -
      lambda_{j-1}``;
    - corrector, order 2: ``C2 = P1 + alpha' c (h / 2) (D_{j+1} - D_j)``, with ``D_{j+1}`` the prediction at the
      predicted state and the same draw xi as the predictor of that step (the code's ``noise``, drawn once per
      step).

    These are the code's Lagrange-interpolated exponential integrals (paper, eq. 15 and 18 with a constant tau per
    step: ``sigma' (1 + tau^2) e^{-tau^2 lambda'} int e^{(1 + tau^2) l} L(l) dl``) with its order-2 "few steps"
    terms added (the UniPC-like O(h^3) change the code makes for few-step sampling), summed into closed form. PEC:
    the model is evaluated once per step, at the predicted state; the corrector of step j reuses that evaluation
    (no forward of its own) and its corrected state is not evaluated again. Step 1 is the predictor of order 1;
    the code turns off the corrector of its first step (``disable_first_corrector``); the last step returns
    ``D_{T-1}`` (``skip_final_step``: ``denoise_to_zero``, tau 0).

    The draws: xi of step j, of the state's shape and dtype, from ``generator`` (on its device), only where
    ``taus[j] > 0``: a step with tau 0 draws nothing, so the ODE leaves the generator as it was. The code draws
    every step's xi from the global generator with ``torch.randn_like``, whether its tau is 0 or not.

    As a rule ``(j, y_j, v_j) -> y_{j+1}`` (:meth:`step`): ``y_j`` is the state the model was evaluated at (the
    predicted state; the start and step 1's are uncorrected), and the rule keeps the corrected state ``x_j`` it
    steps from. So a rollout records the states the velocities belong to (with tau > 0, the predicted states with
    their noise); the code's list of intermediates holds the corrected ones instead, and its final latent,
    ``D_{T-1}``, is the same. Coefficients are float64 numbers; the states keep their dtype. One rule per rollout:
    it keeps the step before's ``x``, ``D`` and xi."""

    def __init__(self, sigmas: torch.Tensor, taus: list[float] | None = None,
                 generator: torch.Generator | None = None):
        s = [float(v) for v in sigmas.to(torch.float64)]
        if len(s) < 3 or s[-1] != 0 or not all(1 > a > b > 0 for a, b in zip(s[:-2], s[1:-1])):
            raise ValueError(f"SA-Solver needs sigmas 1 > s_0 > ... > s_(T-1) > s_T = 0 with T >= 2 "
                             f"(sa_solver_grid), got {s}")
        taus = [0.0] * (len(s) - 1) if taus is None else [float(t) for t in taus]
        if len(taus) != len(s) - 1 or not all(math.isfinite(t) and t >= 0 for t in taus) or taus[-1] != 0:
            raise ValueError(f"SA-Solver's taus: one finite number >= 0 per step, 0 at the step into sigma 0 (the "
                             f"data prediction), got {taus} for {len(s) - 1} steps")
        if generator is None and any(taus):
            raise ValueError("SA-Solver with tau > 0 draws its noise from a generator: none was given")
        self.sigmas = s
        self.taus = taus
        self.generator = generator
        self.lambdas = [half_log_snr(v) for v in s[:-1]]
        # (j, corrected x_j, D_j, the draw of step j or None)
        self.previous: tuple[int, torch.Tensor, torch.Tensor, torch.Tensor | None] | None = None

    def h(self, j: int) -> float:
        """lambda_{j+1} - lambda_j."""
        return self.lambdas[j + 1] - self.lambdas[j]

    def _step(self, x: torch.Tensor, d: torch.Tensor, j: int, gain: float, difference: torch.Tensor | None,
              noise: torch.Tensor | None) -> torch.Tensor:
        """Step j from ``x``: ``e^{-tau^2 h} (s'/s) x + alpha' (1 - e^{-c h}) d``, plus ``alpha' c gain difference``
        and ``s' sqrt(1 - e^{-2 tau^2 h}) noise`` where given (class docstring)."""
        s, s_next, tau2, h = self.sigmas[j], self.sigmas[j + 1], self.taus[j] ** 2, self.h(j)
        alpha_next, c = 1.0 - s_next, 1.0 + tau2
        out = (math.exp(-tau2 * h) * s_next / s) * x - (alpha_next * math.expm1(-c * h)) * d
        if difference is not None:
            out = out + (alpha_next * c * gain) * difference
        if noise is not None:
            out = out + (s_next * math.sqrt(-math.expm1(-2 * tau2 * h))) * noise
        return out

    def draw(self, j: int, like: torch.Tensor) -> torch.Tensor | None:
        """xi of step j, where its tau is above 0 (class docstring)."""
        if self.taus[j] == 0:
            return None
        assert self.generator is not None  # __init__
        return torch.randn(like.shape, generator=self.generator, device=self.generator.device,
                           dtype=like.dtype).to(like.device)

    def step(self, j: int, y: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """y_{j+1} from the state y_j the model was given at step j and its velocity v_j (class docstring)."""
        last = len(self.sigmas) - 2
        if j != (0 if self.previous is None else self.previous[0] + 1) or j > last:
            raise ValueError(f"SA-Solver step {j}: its steps are taken once each, in order, 0 to {last}")
        d = y - self.sigmas[j] * v
        if j == last:  # into sigma 0: the data prediction (the code's denoise_to_zero)
            self.previous = (j, y, d, None)
            return d.clone()
        if j < 2:  # the start, and step 1 whose corrector the code turns off
            x = y
        else:
            _, x_prev, d_prev, noise_prev = self.previous  # type: ignore[misc]
            x = self._step(x_prev, d_prev, j - 1, self.h(j - 1) / 2, d - d_prev, noise_prev)
        noise = self.draw(j, y)
        if j == 0:
            y_next = self._step(x, d, 0, 0.0, None, noise)
        else:
            h = self.h(j)
            y_next = self._step(x, d, j, h * h / (2 * self.h(j - 1)), d - self.previous[2], noise)  # type: ignore[index]
        self.previous = (j, x, d, noise)
        return y_next
