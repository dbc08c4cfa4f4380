"""Trajectories: sample latents with the SDE (ODE where a method asks) and keep what GRPO needs.

:func:`rollout` is the sampler every method starts from; a method that owns its rollout
(:meth:`agg_bench.methods.base.Estimator.rollout`) passes its own pieces: which steps are stochastic,
hooks before each step, a ``velocity`` rule (e.g. a guessed velocity in place of a forward) and an ``ode``
rule (e.g. a multistep solver on the deterministic steps), or builds its own trajectory (a tree).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from .models import Conditioning, Policy
from .sampler import ode_step, sde_step, stochastic_steps

# velocity(j, x, timesteps (B,), cond) -> v: the velocity used at step j (default: the policy's forward)
VelocityRule = Callable[[int, torch.Tensor, torch.Tensor, Conditioning], torch.Tensor]
# ode(j, x, v) -> x_{j+1}: a step outside the SDE mask (default: Euler, :func:`agg_bench.engine.sampler.ode_step`);
# one may add noise of its own without a log-probability (AWM's SA-Solver with tau > 0)
ODERule = Callable[[int, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass
class Trajectory:
    """``latents`` (B, T+1, C, H, W), ``velocities`` (B, T, ...), ``log_probs`` (B, T) (0 on ODE steps),
    ``sde_mask`` (T,) True where the step was sampled with the SDE (it has a log-probability), ``sigmas`` (T+1),
    ``timesteps`` (T); T is the rollout's own number of steps (a method may sample on another grid than the run's schedule, e.g. a
    shorter one after MixGRPO-Flash's window), and the training batch takes these sigmas.

    Two optional facts for rollouts other than B independent chains:
    ``transitions`` (B, T) int64: rows with the same id at a step share that transition (a tree's common
    prefix; its forward ran once); None: every (row, step) is its own.
    ``forwarded`` (B, T) bool: False where the velocity was not the policy's forward (a guess); None: all were.
    """

    latents: torch.Tensor
    velocities: torch.Tensor
    log_probs: torch.Tensor
    sigmas: torch.Tensor
    timesteps: torch.Tensor
    sde_mask: torch.Tensor
    policy_version: int
    transitions: torch.Tensor | None = None
    forwarded: torch.Tensor | None = None


def initial_noise(n_prompts: int, group_size: int, shape: tuple[int, ...], same_per_group: bool,
                  generator: torch.Generator, dtype=torch.float32) -> torch.Tensor:
    """x_0 for P prompts x G samples, grouped consecutively; one draw per group when ``same_per_group``."""
    if same_per_group:
        noise = torch.randn((n_prompts, *shape), generator=generator, dtype=dtype)
        return noise.repeat_interleave(group_size, dim=0)
    return torch.randn((n_prompts * group_size, *shape), generator=generator, dtype=dtype)


@torch.no_grad()
def rollout(policy: Policy, cond: Conditioning, noise: torch.Tensor, sigmas: torch.Tensor, sde: str,
            eta: float, generator: torch.Generator, sde_mask: torch.Tensor | None = None,
            before_step: Callable[[int, float], None] | None = None, velocity: VelocityRule | None = None,
            ode: ODERule | None = None, timesteps: torch.Tensor | None = None) -> Trajectory:
    """Sample from x_0 = ``noise`` through all T steps; SDE on ``sde_mask`` steps, ODE elsewhere.

    ``before_step(j, timestep)`` is called before the model call of step j (cache hooks use it).
    Steps whose SDE transition has no density (``cps`` into sigma 0) are ODE steps whatever the mask says.
    ``velocity`` replaces the policy's forward and ``ode`` the Euler step (module docstring). ``timesteps`` (T)
    are the values the transformer is given at each step where they are not the sigmas in its scale
    (:meth:`Policy.timestep_values`), e.g. a scheduler's integer timesteps (:class:`agg_bench.engine.solvers.FlowDPMGrid`).
    """
    steps = sigmas.numel() - 1
    device = policy.device
    mask = torch.ones(steps, dtype=torch.bool) if sde_mask is None else sde_mask.to(torch.bool).cpu()
    mask = mask & stochastic_steps(sde, sigmas)
    if timesteps is None:
        timesteps = policy.timestep_values(sigmas)
    elif timesteps.shape != (steps,):
        raise ValueError(f"rollout timesteps of shape {tuple(timesteps.shape)} for {steps} steps")
    timesteps = timesteps.to(device=device, dtype=policy.dtype)
    x = noise.to(device)
    cond = cond.to(device)
    b = x.shape[0]
    compute = torch.float64 if policy.dtype == torch.float64 else torch.float32
    latents = [x.to(compute)]
    velocities, log_probs = [], []
    for j in range(steps):
        if before_step is not None:
            before_step(j, float(timesteps[j]))
        if velocity is None:
            v = policy.velocity(x, timesteps[j].expand(b), cond).to(compute)
        else:
            v = velocity(j, x, timesteps[j].expand(b), cond).to(compute)
        if mask[j]:
            out = sde_step(sde, v, x, sigmas, j, eta, generator=generator)
            x, logp = out.prev_sample, out.log_prob
        else:
            x = ode_step(v, x, sigmas, j) if ode is None else ode(j, x, v)
            logp = torch.zeros(b, dtype=compute, device=device)
        latents.append(x)
        velocities.append(v)
        log_probs.append(logp)
    return Trajectory(
        latents=torch.stack(latents, 1), velocities=torch.stack(velocities, 1),
        log_probs=torch.stack(log_probs, 1), sigmas=sigmas, timesteps=timesteps, sde_mask=mask,
        policy_version=policy.version,
    )
