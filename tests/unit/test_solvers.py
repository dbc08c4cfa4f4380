"""DPM-Solver++ on the flow schedule (agg_bench/engine/solvers.py) against diffusers' scheduler stepped in
float64, against the paper's update equations written here, and as DiffusionNFT's ``dpm2`` rollout sampler
against that sampler's equations (tests/helpers.py); SA-Solver's ODE as AWM samples with it against its
equations (tests/helpers.py), and with its noise (tau > 0) against them fed the same draws."""
import math

import numpy as np
import pytest
import torch
from diffusers import DPMSolverMultistepScheduler, SASolverScheduler

from agg_bench.engine.sampler import flow_sigmas, ode_step
from agg_bench.engine.solvers import (DataPrediction, MultistepDPMSolverPP, SASolver, dpm_solver_pp_step,
                                     flow_dpm_grid, ode_solver, sa_solver_grid, sa_solver_taus)
from helpers import nft_dpm2_reference, sa_solver_reference, seeded

SHAPE = (2, 3, 4, 4)


def diffusers_scheduler(order: int, steps: int, shift: float) -> DPMSolverMultistepScheduler:
    scheduler = DPMSolverMultistepScheduler(use_flow_sigmas=True, prediction_type="flow_prediction",
                                            flow_shift=shift, algorithm_type="dpmsolver++", solver_order=order,
                                            solver_type="midpoint", final_sigmas_type="zero",
                                            lower_order_final=True)
    scheduler.set_timesteps(steps)
    return scheduler


def diffusers_float64_rollout(scheduler, x, velocities):
    """diffusers' own update functions on float64 states and sigmas: ``step`` casts the sample to float32,
    so this drives what ``step`` does (convert the output, shift the history, pick the order, update)
    with the scheduler's sigmas made float64; :func:`test_the_float64_driver_is_what_step_does` checks
    it against ``step`` itself in float32."""
    scheduler.sigmas = scheduler.sigmas.to(torch.float64)
    n = len(scheduler.timesteps)
    states = [x]
    for i in range(n):
        scheduler._step_index = i
        m = scheduler.convert_model_output(velocities[i], sample=x)
        scheduler.model_outputs = [*scheduler.model_outputs[1:], m]
        final = i == n - 1  # final_sigmas_type "zero": the last step is first order
        if scheduler.config.solver_order == 1 or scheduler.lower_order_nums < 1 or final:
            x = scheduler.dpm_solver_first_order_update(m, sample=x)
        else:
            x = scheduler.multistep_dpm_solver_second_order_update(scheduler.model_outputs, sample=x)
        scheduler.lower_order_nums = min(scheduler.lower_order_nums + 1, scheduler.config.solver_order)
        states.append(x)
    return states


def our_rollout(sigmas, order, x, velocities):
    solver = MultistepDPMSolverPP(sigmas, order)
    states = [x]
    for j, v in enumerate(velocities):
        solver.observe(j, x, v)
        x = solver.step(j, x)
        states.append(x)
    return states


def paper_rollout(sigmas, order, x, velocities):
    """arXiv 2211.01095, Algorithm 2 (DPM-Solver++(2M)) with alpha = 1 - s, sigma = s, data prediction
    x - s v; the last step (into sigma 0) is first order, as diffusers' ``lower_order_final`` does."""
    s = [float(v) for v in sigmas]
    lam = [math.log((1 - v) / v) if 0 < v < 1 else math.inf for v in s]
    x0 = [None] * len(velocities)
    x0[0] = x - s[0] * velocities[0]
    # first step: x_1 = (sigma_1 / sigma_0) x_0 - alpha_1 (e^{-h_1} - 1) x0_0
    h = lam[1] - lam[0]
    states = [x, (s[1] / s[0]) * x - (1 - s[1]) * (math.exp(-h) - 1) * x0[0]]
    for i in range(1, len(velocities)):
        x = states[-1]
        x0[i] = x - s[i] * velocities[i]
        h = lam[i + 1] - lam[i]
        if order == 1 or s[i + 1] == 0:
            d = x0[i]
        else:
            r = (lam[i] - lam[i - 1]) / h
            d = (1 + 1 / (2 * r)) * x0[i] - 1 / (2 * r) * x0[i - 1]
        states.append((s[i + 1] / s[i]) * x - (1 - s[i + 1]) * (math.exp(-h) - 1) * d)
    return states


def random_velocities(n, generator):
    return [torch.randn(SHAPE, generator=generator, dtype=torch.float64) for _ in range(n)]


def max_relative(a, b):
    return max(float((p - q).abs().max() / q.abs().max()) for p, q in zip(a, b))


@pytest.mark.parametrize("order", [1, 2])
@pytest.mark.parametrize("steps, shift", [(7, 3.0), (12, 1.0), (3, 5.0)])
def test_steps_equal_diffusers_in_float64(order, steps, shift):
    scheduler = diffusers_scheduler(order, steps, shift)
    gen = torch.Generator().manual_seed(seeded(steps * 10 + order))
    x = torch.randn(SHAPE, generator=gen, dtype=torch.float64)
    velocities = random_velocities(steps, gen)
    sigmas = scheduler.sigmas.to(torch.float64)  # its grid, as our solver takes it
    expected = diffusers_float64_rollout(scheduler, x, velocities)
    assert expected[-1].dtype == torch.float64
    ours = our_rollout(sigmas, order, x, velocities)
    assert max_relative(ours, expected) <= 1e-12
    assert torch.equal(ours[-1], ours[-2] - sigmas[-2] * velocities[-1])  # the step into 0 returns x0


@pytest.mark.parametrize("order", [1, 2])
def test_steps_equal_the_papers_update_equations(order):
    gen = torch.Generator().manual_seed(seeded(5))
    u = torch.sort(torch.rand(6, generator=gen, dtype=torch.float64), descending=True).values
    sigmas = torch.cat([0.98 * u + 0.01, torch.zeros(1, dtype=torch.float64)])  # an irregular grid in (0, 1)
    x = torch.randn(SHAPE, generator=gen, dtype=torch.float64)
    velocities = random_velocities(6, gen)
    assert max_relative(our_rollout(sigmas, order, x, velocities), paper_rollout(sigmas, order, x, velocities)) <= 1e-12


def test_first_order_is_the_euler_step():
    gen = torch.Generator().manual_seed(seeded(1))
    x = torch.randn(SHAPE, generator=gen, dtype=torch.float64)
    v = torch.randn(SHAPE, generator=gen, dtype=torch.float64)
    sigmas = torch.tensor([0.83, 0.41], dtype=torch.float64)
    dpm = dpm_solver_pp_step(x, DataPrediction(x - 0.83 * v, 0.83), 0.41)
    assert float((dpm - ode_step(v, x, sigmas, 0)).abs().max()) <= 1e-14


def test_a_prediction_from_another_grid_makes_the_first_step_second_order():
    """A previous prediction made on another grid makes the first step second order: h_0 is measured
    between the sigmas the two predictions were made at."""
    gen = torch.Generator().manual_seed(seeded(2))
    x_prev = torch.randn(SHAPE, generator=gen, dtype=torch.float64)
    v_prev, v = (torch.randn(SHAPE, generator=gen, dtype=torch.float64) for _ in range(2))
    s_prev, s, s_next = 0.9, 0.7, 0.35
    previous = DataPrediction(x_prev - s_prev * v_prev, s_prev)
    paper = paper_rollout(torch.tensor([s_prev, s, s_next, 0.0], dtype=torch.float64), 2, x_prev, [v_prev, v, v])
    # paper_rollout's second state is its own first-order step from x_prev; start ours from it
    ours = dpm_solver_pp_step(paper[1], DataPrediction(paper[1] - s * v, s), s_next, previous)
    assert float((ours - paper[2]).abs().max() / paper[2].abs().max()) <= 1e-12
    first = dpm_solver_pp_step(paper[1], DataPrediction(paper[1] - s * v, s), s_next)
    assert not torch.allclose(first, ours)


def test_the_float64_driver_is_what_step_does():
    """diffusers_float64_rollout follows ``step``: the same states as ``step`` itself in float32."""
    steps, order = 6, 2
    gen = torch.Generator().manual_seed(seeded(3))
    x = torch.randn(SHAPE, generator=gen, dtype=torch.float64)
    velocities = random_velocities(steps, gen)
    ours = diffusers_float64_rollout(diffusers_scheduler(order, steps, 3.0), x, velocities)
    scheduler = diffusers_scheduler(order, steps, 3.0)
    y = x.float()
    for t, v in zip(scheduler.timesteps, velocities):
        y = scheduler.step(v.float(), t, y).prev_sample
    assert float((y.double() - ours[-1]).abs().max() / ours[-1].abs().max()) <= 1e-5


def test_orders_other_than_one_and_two_are_refused():
    with pytest.raises(ValueError):
        MultistepDPMSolverPP(torch.tensor([1.0, 0.0]), order=3)


@pytest.mark.parametrize("steps, shift", [(10, 3.0), (7, 1.0), (2, 3.0)])
def test_dpm2_rollout_equals_diffusion_nfts_sampler_on_the_sd3_grid(steps, shift):
    """``ode_solver("dpm2")`` on the SD3 scheduler's grid, which starts at sigma 1 (lambda = -inf), against the
    public ``dpm2`` sampler's equations (tests/helpers.py): the first step from pure noise, the second
    first order too (its previous prediction was made at sigma 1), second order after, first order into 0."""
    sigmas = flow_sigmas(steps, shift)
    assert float(sigmas[0]) == 1.0 and float(sigmas[-1]) == 0.0
    gen = torch.Generator().manual_seed(seeded(100 + steps))
    x = torch.randn(SHAPE, generator=gen, dtype=torch.float64)
    velocities = random_velocities(steps, gen)
    rule = ode_solver("dpm2", sigmas)
    ours = [x]
    for j, v in enumerate(velocities):
        ours.append(rule(j, ours[-1], v))
    expected = nft_dpm2_reference(sigmas, x, velocities)
    assert all(torch.isfinite(e).all() for e in expected)
    assert max_relative(ours, expected) <= 1e-12
    assert rule.__self__.orders == ([1, 1] + [2] * (steps - 3) + [1])[:steps]
    euler = [x]
    for j, v in enumerate(velocities):
        euler.append(ode_step(v, euler[-1], sigmas, j))
    assert steps < 4 or not torch.allclose(ours[-1], euler[-1])  # from the third step on it is not Euler's


def test_euler_is_the_rollouts_own_step_and_other_names_are_refused():
    sigmas = flow_sigmas(4, 3.0)
    assert ode_solver("euler", sigmas) is None
    with pytest.raises(ValueError, match="dpm3"):
        ode_solver("dpm3", sigmas)


def test_a_step_from_sigma_one_is_the_euler_step():
    gen = torch.Generator().manual_seed(seeded(4))
    x, v = (torch.randn(SHAPE, generator=gen, dtype=torch.float64) for _ in range(2))
    sigmas = torch.tensor([1.0, 0.6], dtype=torch.float64)
    ours = dpm_solver_pp_step(x, DataPrediction(x - v, 1.0), 0.6)
    assert float((ours - ode_step(v, x, sigmas, 0)).abs().max()) <= 1e-15


def sana_scheduler(steps: int, shift: float = 3.0) -> DPMSolverMultistepScheduler:
    """DGPO's sampler (github.com/Luo-Yihong/DGPO ``scripts/train_sd3_dgpo.py``): Sana_1600M's scheduler config,
    the values the diffusers checkpoint's conversion writes and the rest the scheduler's defaults, flow_shift set."""
    scheduler = DPMSolverMultistepScheduler(
        num_train_timesteps=1000, solver_order=2, prediction_type="flow_prediction", algorithm_type="dpmsolver++",
        solver_type="midpoint", lower_order_final=True, euler_at_final=False, use_flow_sigmas=True,
        flow_shift=shift, final_sigmas_type="zero", timestep_spacing="linspace", steps_offset=0)
    scheduler.set_timesteps(steps)
    return scheduler


@pytest.mark.parametrize("shift", [3.0, 1.0, 6.0])
@pytest.mark.parametrize("steps", [1, 2, 9, 10, 14, 40])
def test_flow_dpm_grid_is_the_sana_schedulers(steps, shift):
    """The grid, exactly (float32 sigmas, ending at 0), and the timesteps the transformer is given, exactly (the
    integers trunc(1000 sigma)), as diffusers' scheduler makes them for the public config."""
    scheduler = sana_scheduler(steps, shift)
    grid = flow_dpm_grid(steps, shift)
    assert grid.sigmas.dtype == torch.float64 and grid.timesteps.dtype == torch.int64
    assert torch.equal(grid.sigmas, scheduler.sigmas.to(torch.float64))
    assert torch.equal(grid.timesteps, scheduler.timesteps)
    assert float(grid.sigmas[-1]) == 0.0 and 0 < float(grid.sigmas[0]) < 1  # no step from pure noise
    # the integer timesteps are the truncated 1000 sigma, below it by less than 1 (up to the float32 rounding of
    # the stored sigmas; at shift 1 a sigma of 0.555 is 554.99999... before it is truncated: timestep 554)
    gap = grid.sigmas[:-1] * 1000 - grid.timesteps.to(torch.float64)
    assert float(gap.min()) > -1e-4 and float(gap.max()) < 1 + 1e-4
    torch.testing.assert_close(grid.model_timesteps(1000.0), scheduler.timesteps.to(torch.float64), rtol=0, atol=0)
    assert torch.equal(grid.noise_levels(torch.float32), scheduler.timesteps / 1000)  # the code's t / 1000


@pytest.mark.parametrize("steps", [2, 10, 14])
def test_dpm2_on_the_sana_grid_equals_the_scheduler_in_float64(steps):
    """``ode_solver("dpm2")`` on that grid, whose first sigma is below 1: first order at the first step and into
    0, second order between, against diffusers' own update functions in float64 and the paper's equations."""
    grid = flow_dpm_grid(steps, 3.0)
    gen = torch.Generator().manual_seed(seeded(200 + steps))
    x = torch.randn(SHAPE, generator=gen, dtype=torch.float64)
    velocities = random_velocities(steps, gen)
    rule = ode_solver("dpm2", grid.sigmas)
    ours = [x]
    for j, v in enumerate(velocities):
        ours.append(rule(j, ours[-1], v))
    assert max_relative(ours, diffusers_float64_rollout(sana_scheduler(steps), x, velocities)) <= 1e-12
    assert max_relative(ours, paper_rollout(grid.sigmas, 2, x, velocities)) <= 1e-12
    assert rule.__self__.orders == ([1] + [2] * (steps - 2) + [1])[:steps]


def test_flow_dpm_grid_refuses_no_steps_and_a_shift_of_zero():
    for steps, shift in [(0, 3.0), (4, 0.0), (4, float("nan"))]:
        with pytest.raises(ValueError):
            flow_dpm_grid(steps, shift)


def linear_model(generator, grid):
    """v(j, y) = y A + s_j b: a fixed linear velocity field on random weights."""
    a = 0.5 * torch.randn(SHAPE[-1], SHAPE[-1], generator=generator, dtype=torch.float64)
    b = torch.randn(SHAPE[-1], generator=generator, dtype=torch.float64)
    return lambda j, y: y @ a + float(grid[j]) * b


def rule_rollout(rule, x, velocity, steps):
    """States of a rollout that hands ``rule`` each step's velocity at the state it returned; forwards counted."""
    states, forwards = [x], []
    for j in range(steps):
        v = velocity(j, states[-1])
        forwards.append(j)
        states.append(rule(j, states[-1], v))
    return states, forwards


@pytest.mark.parametrize("steps, shift", [(14, 3.0), (10, 1.0), (5, 3.0), (3, 5.0), (2, 3.0)])
def test_sa_solver_equals_awms_sampler_written_from_the_papers_equations(steps, shift):
    """``SASolver`` (tau = 0) on AWM's grid (the SD3 scheduler's, its first sigma 1 - 1e-3 and its last
    nonzero one half the one before) against the float64 reference of tests/helpers.py, whose coefficients are the
    paper's Lagrange integrals by quadrature: the states the model is given and the final latent, on a random
    linear velocity field, one model evaluation per step; from step 3 on it is not Euler's rollout."""
    sigmas = flow_sigmas(steps, shift)
    grid = sa_solver_grid(sigmas)
    assert float(grid[0]) == 1 - 1e-3 and float(grid[-2]) == float(sigmas[-3]) / 2 and float(grid[-1]) == 0
    assert torch.equal(grid[1:-2], sigmas[1:-2])
    gen = torch.Generator().manual_seed(seeded(200 + steps))
    velocity = linear_model(gen, grid)
    x = torch.randn(SHAPE, generator=gen, dtype=torch.float64)
    calls = []
    expected = sa_solver_reference(grid, x, lambda j, y: (calls.append(j), velocity(j, y))[1])
    ours, forwards = rule_rollout(SASolver(grid).step, x, velocity, steps)
    assert calls == forwards == list(range(steps))  # one evaluation per step, the corrector's included
    assert max_relative(ours, expected["states"]) <= 1e-10
    assert torch.equal(expected["states"][-1], expected["corrected"][-1])
    euler = [x]
    for j in range(steps):
        euler.append(ode_step(velocity(j, euler[-1]), euler[-1], grid, j))
    assert max_relative(ours[:2], euler[:2]) <= 1e-12  # the first step is first order: Euler's
    assert steps < 3 or not torch.allclose(ours[-1], euler[-1])


@pytest.mark.parametrize("seed", range(3))
def test_sa_solver_on_irregular_grids_and_a_point_mass(seed):
    """Irregular grids in (0, 1): the reference's states; a point mass D (v = (y - D) / s) is followed exactly,
    every state on the straight path (1 - s) D + s noise and the final one D."""
    gen = torch.Generator().manual_seed(seeded(300 + seed))
    steps = 4 + 3 * seed
    u = torch.sort(torch.rand(steps, generator=gen, dtype=torch.float64), descending=True).values
    grid = torch.cat([0.98 * u + 0.01, torch.zeros(1, dtype=torch.float64)])
    velocity = linear_model(gen, grid)
    x = torch.randn(SHAPE, generator=gen, dtype=torch.float64)
    ours, _ = rule_rollout(SASolver(grid).step, x, velocity, steps)
    assert max_relative(ours, sa_solver_reference(grid, x, velocity)["states"]) <= 1e-10
    data = torch.randn(SHAPE, generator=gen, dtype=torch.float64)
    noise = (x - (1 - grid[0]) * data) / grid[0]
    ours, _ = rule_rollout(SASolver(grid).step, x, lambda j, y: (y - data) / grid[j], steps)
    path = [(1 - s) * data + s * noise for s in grid]
    assert max_relative(ours, path) <= 1e-12


def test_sa_solver_refuses_grids_and_steps_it_does_not_take():
    with pytest.raises(ValueError, match="at least 2 steps"):
        sa_solver_grid(flow_sigmas(1, 3.0))
    with pytest.raises(ValueError, match="1 > s_0"):
        SASolver(flow_sigmas(6, 3.0))  # sigma 1: the grid must be sa_solver_grid's
    with pytest.raises(ValueError, match="1 > s_0"):
        SASolver(torch.tensor([0.9, 0.95, 0.3, 0.0], dtype=torch.float64))
    rule = SASolver(sa_solver_grid(flow_sigmas(4, 3.0))).step
    x = torch.zeros(SHAPE, dtype=torch.float64)
    with pytest.raises(ValueError, match="in order"):
        rule(1, x, x)
    for j in range(4):
        x = rule(j, x, x)
    with pytest.raises(ValueError, match="in order"):
        rule(4, x, x)


def diffusers_sa_solver_rollout(grid, x, velocity, taus=None, noises=None):
    """AWM's sampler driven through diffusers' own SA-Solver updates (``SASolverScheduler`` with flow sigmas and
    data prediction, its ``stochastic_adams_bashforth_update`` and ``stochastic_adams_moulton_update`` with tau =
    ``taus[i]`` on step i, 0 by default, the draw ``noises[i]`` of step i given to its predictor and, as
    ``last_noise``, to its corrector, and float64 sigmas set to ``grid``), in AWM's order: the first step's
    predictor of order 1 and no corrector, then predictor and corrector of order 2, the last step the data
    prediction. The states the model is given, then the final one."""
    scheduler = SASolverScheduler(use_flow_sigmas=True, prediction_type="flow_prediction", predictor_order=2,
                                  corrector_order=2, algorithm_type="data_prediction", tau_func=lambda t: 0)
    scheduler.set_timesteps(len(grid) - 1)
    scheduler.sigmas = grid.to(torch.float64)
    steps, zero = len(grid) - 1, torch.zeros_like(x)
    taus = [0.0] * steps if taus is None else taus
    noises = [zero] * steps if noises is None else [zero if n is None else n for n in noises]
    states, predictions, corrected = [x], [], x
    for i in range(steps):
        y = states[-1]
        scheduler._step_index = i
        predictions.append(scheduler.convert_model_output(velocity(i, y), sample=y))
        if i == steps - 1:
            states.append(predictions[-1])
            break
        if i >= 2:
            scheduler.model_outputs = predictions[-3:-1]
            corrected = scheduler.stochastic_adams_moulton_update(
                this_model_output=predictions[-1], last_sample=corrected, last_noise=noises[i - 1], this_sample=y,
                order=2, tau=taus[i - 1])
        else:
            corrected = y
        scheduler.model_outputs = ([None] + predictions)[-2:]
        states.append(scheduler.stochastic_adams_bashforth_update(
            model_output=predictions[-1], sample=corrected, noise=noises[i], order=min(i + 1, 2), tau=taus[i]))
    return states


@pytest.mark.parametrize("steps, shift", [(14, 3.0), (6, 1.0), (2, 3.0)])
def test_sa_solver_equals_diffusers_sa_solver_updates_in_float64(steps, shift):
    grid = sa_solver_grid(flow_sigmas(steps, shift))
    gen = torch.Generator().manual_seed(seeded(400 + steps))
    velocity = linear_model(gen, grid)
    x = torch.randn(SHAPE, generator=gen, dtype=torch.float64)
    ours, _ = rule_rollout(SASolver(grid).step, x, velocity, steps)
    assert max_relative(ours, diffusers_sa_solver_rollout(grid, x, velocity)) <= 1e-10


def draws_of(taus, seed, shape=SHAPE):
    """The draws a stochastic SA-Solver rule takes from a generator seeded ``seed``: one of ``shape`` per step
    whose tau is above 0, in step order; None on the others."""
    gen = torch.Generator().manual_seed(seeded(seed))
    return [torch.randn(shape, generator=gen, dtype=torch.float64) if tau > 0 else None for tau in taus]


def noisy_grids():
    """(name, grid): AWM's grid at several step counts and shifts, and irregular grids in (0, 1)."""
    out = [(f"{steps} steps, shift {shift}", sa_solver_grid(flow_sigmas(steps, shift)))
           for steps, shift in [(14, 3.0), (10, 1.0), (5, 3.0), (3, 5.0), (2, 3.0)]]
    for seed in range(2):
        gen = torch.Generator().manual_seed(seeded(500 + seed))
        u = torch.sort(torch.rand(5 + 4 * seed, generator=gen, dtype=torch.float64), descending=True).values
        out.append((f"irregular {seed}", torch.cat([0.98 * u + 0.01, torch.zeros(1, dtype=torch.float64)])))
    return out


@pytest.mark.parametrize("name, grid", noisy_grids(), ids=[name for name, _ in noisy_grids()])
@pytest.mark.parametrize("taus_of", ["window", "every step"])
def test_sa_solver_with_noise_equals_its_equations_fed_the_same_draws(name, grid, taus_of):
    """SA-Solver with tau > 0 against the float64 reference of tests/helpers.py (the paper's stochastic exponential
    integrator, coefficients by quadrature) and against diffusers' stochastic updates, both fed the draws the rule
    takes from its generator: one of the state's shape per step with tau > 0, in step order, shared by that step's
    predictor and corrector. ``window``: AWM's taus, 0.4 on the steps into sigmas in [0.3, 0.9]; ``every step``:
    a different tau on every step but the last (the first step's predictor and step 1's uncorrected state
    included). One model evaluation per step."""
    steps = len(grid) - 1
    gen = torch.Generator().manual_seed(seeded(600 + steps))
    velocity = linear_model(gen, grid)
    x = torch.randn(SHAPE, generator=gen, dtype=torch.float64)
    if taus_of == "window":
        taus = sa_solver_taus(grid, 0.4)
    else:
        taus = [*(0.2 + 0.8 * torch.rand(steps - 1, generator=gen, dtype=torch.float64)).tolist(), 0.0]
    assert any(taus)
    noises = draws_of(taus, 7)
    calls = []
    expected = sa_solver_reference(grid, x, lambda j, y: (calls.append(j), velocity(j, y))[1], taus, noises)
    rule = SASolver(grid, taus, torch.Generator().manual_seed(seeded(7))).step
    ours, forwards = rule_rollout(rule, x, velocity, steps)
    assert calls == forwards == list(range(steps))
    assert max_relative(ours, expected["states"]) <= 1e-10
    assert max_relative(ours, diffusers_sa_solver_rollout(grid, x, velocity, taus, noises)) <= 1e-10
    ode, _ = rule_rollout(SASolver(grid).step, x, velocity, steps)
    assert not torch.allclose(ours[-1], ode[-1])  # the noise is there


def test_sa_solver_taus_are_the_codes_window_in_float32():
    """AWM's taus: 0.4 on the steps into sigmas in [0.3, 0.9], compared in float32 as the code compares its float32
    sigmas: the float32 neighbours of the bounds outside are out, the bounds in, and a float64 sigma that rounds to
    a bound is in; the step into 0 is 0. On the preset's grid (14 steps, shift 3) the steps 3 to 10."""
    f32 = [float(np.float32(v)) for v in (0.9, 0.3)]
    above = float(np.nextafter(np.float32(0.9), np.float32(1)))  # the float32 neighbours outside
    below = float(np.nextafter(np.float32(0.3), np.float32(0)))
    assert above > 0.9 and below < 0.3
    grid = torch.tensor([0.999, above, f32[0], 0.9 + 1e-12, 0.5, f32[1], below, 0.1, 0.0], dtype=torch.float64)
    assert sa_solver_taus(grid, 0.4) == [0.0, 0.4, 0.4, 0.4, 0.4, 0.0, 0.0, 0.0]
    assert sa_solver_taus(grid, 0.0) == [0.0] * 8
    preset = sa_solver_taus(sa_solver_grid(flow_sigmas(14, 3.0)), 0.4)
    assert [j for j, tau in enumerate(preset) if tau] == list(range(3, 11)) and set(preset) == {0.0, 0.4}


@pytest.mark.parametrize("steps, shift", [(14, 3.0), (10, 1.0), (5, 3.0)])
def test_sa_solver_noise_enters_only_on_the_windows_steps(steps, shift):
    """The rule draws once per step with tau > 0 and nowhere else, and its states are the ODE's, bit for bit, up
    to the first step into the window, where they part. With tau 0 on every step, or with tau 0.4 on a grid that
    never steps into the window, the rule is the ODE's bit for bit and leaves its generator as it was."""
    grid = sa_solver_grid(flow_sigmas(steps, shift))
    taus = sa_solver_taus(grid, 0.4)
    window = [j for j, tau in enumerate(taus) if tau]
    gen = torch.Generator().manual_seed(seeded(800 + steps))
    velocity = linear_model(gen, grid)
    x = torch.randn(SHAPE, generator=gen, dtype=torch.float64)
    ode, _ = rule_rollout(SASolver(grid).step, x, velocity, steps)
    drawn, same = torch.Generator().manual_seed(seeded(9)), torch.Generator().manual_seed(seeded(9))
    noisy, _ = rule_rollout(SASolver(grid, taus, drawn).step, x, velocity, steps)
    for _ in window:
        torch.randn(SHAPE, generator=same, dtype=torch.float64)
    assert torch.equal(drawn.get_state(), same.get_state())  # one draw per window step
    first = window[0]
    assert all(torch.equal(a, b) for a, b in zip(noisy[:first + 1], ode[:first + 1]))
    assert not torch.allclose(noisy[first + 1], ode[first + 1])
    outside = torch.tensor([0.95, 0.92, 0.25, 0.1, 0.0], dtype=torch.float64)  # jumps over the window
    assert sa_solver_taus(outside, 0.4) == [0.0] * 4
    for grid_, taus_ in ((grid, [0.0] * steps), (outside, sa_solver_taus(outside, 0.4))):
        n = len(grid_) - 1
        velocity = linear_model(torch.Generator().manual_seed(seeded(10)), grid_)
        gen = torch.Generator().manual_seed(seeded(10))
        state = gen.get_state()
        ode, _ = rule_rollout(SASolver(grid_).step, x, velocity, n)
        quiet, _ = rule_rollout(SASolver(grid_, taus_, gen).step, x, velocity, n)
        assert all(torch.equal(a, b) for a, b in zip(quiet, ode)) and torch.equal(gen.get_state(), state)


def test_sa_solver_reference_at_tau_0_is_the_odes():
    """The stochastic reference with every tau 0 (and draws given) is the ODE reference bit for bit."""
    grid = sa_solver_grid(flow_sigmas(8, 3.0))
    gen = torch.Generator().manual_seed(seeded(11))
    velocity = linear_model(gen, grid)
    x = torch.randn(SHAPE, generator=gen, dtype=torch.float64)
    ode = sa_solver_reference(grid, x, velocity)["states"]
    zero = sa_solver_reference(grid, x, velocity, [0.0] * 8, [torch.ones(SHAPE, dtype=torch.float64)] * 8)["states"]
    assert all(torch.equal(a, b) for a, b in zip(ode, zero))


def test_sa_solver_refuses_taus_it_does_not_take():
    grid = sa_solver_grid(flow_sigmas(4, 3.0))
    gen = torch.Generator()
    for taus in ([0.4] * 3, [0.4] * 5, [0.4, -0.1, 0.0, 0.0], [0.4, float("nan"), 0.0, 0.0], [0.4] * 4):
        with pytest.raises(ValueError, match="taus"):
            SASolver(grid, taus, gen)
    with pytest.raises(ValueError, match="generator"):
        SASolver(grid, [0.0, 0.4, 0.0, 0.0])
    SASolver(grid, [0.0] * 4)  # the ODE needs none
