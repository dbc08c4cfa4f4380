"""Trajectories: sample latents with the SDE (ODE where a method asks) and keep what GRPO needs."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from .models import Conditioning, Policy
from .sde import ode_step, sde_step


@dataclass
class Trajectory:
    """``latents`` (B, T+1, C, H, W), ``velocities`` (B, T, ...), ``log_probs`` (B, T) (0 on ODE steps),
    ``sde_mask`` (T,) True where the step was stochastic, ``sigmas`` (T+1), ``timesteps`` (T)."""

    latents: torch.Tensor
    velocities: torch.Tensor
    log_probs: torch.Tensor
    sigmas: torch.Tensor
    timesteps: torch.Tensor
    sde_mask: torch.Tensor
    policy_version: int


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
            before_step: Callable[[int, float], None] | None = None) -> Trajectory:
    """Sample from x_0 = ``noise`` through all T steps; SDE on ``sde_mask`` steps, ODE elsewhere.

    ``before_step(j, timestep)`` is called before the model call of step j (cache hooks use it).
    """
    steps = sigmas.numel() - 1
    device = policy.device
    mask = torch.ones(steps, dtype=torch.bool) if sde_mask is None else sde_mask.to(torch.bool).cpu()
    timesteps = policy.timestep_values(sigmas).to(device=device, dtype=policy.dtype)
    x = noise.to(device)
    cond = cond.to(device)
    b = x.shape[0]
    compute = torch.float64 if policy.dtype == torch.float64 else torch.float32
    latents = [x.to(compute)]
    velocities, log_probs = [], []
    for j in range(steps):
        if before_step is not None:
            before_step(j, float(timesteps[j]))
        v = policy.velocity(x, timesteps[j].expand(b), cond).to(compute)
        if mask[j]:
            out = sde_step(sde, v, x, sigmas, j, eta, generator=generator)
            x, logp = out.prev_sample, out.log_prob
        else:
            x, logp = ode_step(v, x, sigmas, j), torch.zeros(b, dtype=compute, device=device)
        latents.append(x)
        velocities.append(v)
        log_probs.append(logp)
    return Trajectory(
        latents=torch.stack(latents, 1), velocities=torch.stack(velocities, 1),
        log_probs=torch.stack(log_probs, 1), sigmas=sigmas, timesteps=timesteps, sde_mask=mask,
        policy_version=policy.version,
    )
