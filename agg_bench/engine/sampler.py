"""Stochastic flow-matching sampler steps with log-probabilities, and the schedule.

Sigmas run from ``s_0 = 1`` down to ``s_T = 0``; the model predicts the velocity ``v`` and a
deterministic Euler step is ``x + (s_{j+1} - s_j) v``. The SDE steps below add noise so that each
transition is Gaussian and has a log-probability, which GRPO's importance ratio needs.

Four SDEs (``sampling.sde``), each a Gaussian transition ``x_{j+1} ~ N(mean, std^2)``:
- ``flow_grpo`` (Flow-GRPO): std = eta sqrt(s / (1 - s)) sqrt(s - s');
- ``dance_grpo`` (DanceGRPO): std = eta sqrt(s - s');
- ``cps``: coefficients-preserving sampling (Wang and Yu, arXiv 2509.05952, eq. 9-10; FlowCPS): with the
  predicted data x0 = x - s v and noise x1 = x + (1 - s) v, ``std = s' sin(eta pi / 2)`` and
  ``mean = (1 - s') x0 + sqrt(s'^2 - std^2) x1``, so that mean and noise together keep the flow's
  coefficients (1 - s') and s' of x0 and of unit noise: no excess noise at low sigmas. ``eta`` is in
  (0, 1] (1: all of the next step's noise drawn afresh). The last step (s' = 0) has std 0: it is the
  Euler step and has no density, so it is an ODE step in every rollout (:func:`stochastic_steps`).
  The log-probability is the full Gaussian one, like the others.
- ``cps_unscaled``: the same step, with the log-probability of FlowCPS's code and of Flow-GRPO's
  ``sde_type = "cps"`` (github.com/yifan123/flow_grpo, ``flow_grpo/diffusers_patch/sd3_sde_with_logprob.py``):
  ``-(x' - mean)^2`` only, without the constants and without the 1 / (2 std^2) factor. The samples are
  ``cps``'s, draw for draw; each step's log-ratio, and with it the step's gradient, is ``cps``'s times
  2 std^2, which differs from step to step (within Flow-GRPO-Fast's 3-step window at eta 0.8, 10 steps,
  shift 3, up to 1.47x), and the ratio clip acts where that factor makes the log-ratio cross eps.

Everything is computed in float32 (float64 when the inputs are float64). ``log_prob`` is the mean
over all non-batch dimensions.
"""
from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import torch

from ..config.sections import CPS_KINDS, check_cps_eta
from ..errors import ConfigError
from .families.geometry import check_terminal_steps

SDE_KINDS = ("flow_grpo", "dance_grpo", "cps", "cps_unscaled")
LOG_SQRT_2PI = math.log(math.sqrt(2 * math.pi))


@dataclass
class SDEStepOutput:
    """``prev_sample`` x_{j+1}; ``log_prob`` (B,) of it; ``mean`` and ``std`` of the Gaussian transition;
    ``std_t`` its noise level before the step size: ``std = std_t * sqrt(s_j - s_{j+1})`` (flow_grpo:
    ``eta * sqrt(s / (1 - s'))``, dance_grpo: ``eta``). ``std`` and ``std_t`` are (B, 1, ..., 1)."""

    prev_sample: torch.Tensor
    log_prob: torch.Tensor
    mean: torch.Tensor
    std: torch.Tensor
    std_t: torch.Tensor


def flow_sigmas(steps: int, shift: float, shift_terminal: float | None = None) -> torch.Tensor:
    """The T+1 sigmas of diffusers' FlowMatchEulerDiscreteScheduler with ``shift`` (and, when given,
    ``shift_terminal``: the shifted schedule stretched so that its last nonzero sigma is that value,
    as Qwen-Image's scheduler does), ending at 0 (float64)."""
    if steps < 1:
        raise ConfigError("sampling.steps", steps, "an integer >= 1")
    check_terminal_steps(steps, shift_terminal)
    # imported here: the training step (agg_bench.engine.grpo) imports this module, and checking a method's
    # options must not import diffusers (agg_bench.tools.sweep)
    from diffusers.schedulers.scheduling_flow_match_euler_discrete import FlowMatchEulerDiscreteScheduler

    scheduler = FlowMatchEulerDiscreteScheduler(shift=shift, shift_terminal=shift_terminal)
    with warnings.catch_warnings():  # an extreme shift's nan is check_sigmas' one line, not numpy's warnings
        warnings.simplefilter("ignore", RuntimeWarning)
        scheduler.set_timesteps(steps)
    return scheduler.sigmas.to(torch.float64)


def flow_sigmas_formula(steps: int, shift: float) -> torch.Tensor:
    """:func:`flow_sigmas` without ``shift_terminal``, computed as diffusers' FlowMatchEulerDiscreteScheduler
    computes it (its training sigmas shifted in float32, the inference times spaced in float64 between the
    first and last of them, shifted again, rounded to float32, 0 appended) without importing diffusers: the
    sweep's check of a job's config (:func:`agg_bench.runtime.config_check.check_config`) imports no diffusers.
    Equal to :func:`flow_sigmas` bit for bit (tests/unit/test_bad_input.py)."""
    if steps < 1:
        raise ConfigError("sampling.steps", steps, "an integer >= 1")
    import numpy as np

    train = 1000  # num_train_timesteps
    with warnings.catch_warnings():  # an extreme shift's nan is check_sigmas' one line, not numpy's warnings
        warnings.simplefilter("ignore", RuntimeWarning)
        times = torch.from_numpy(np.linspace(1, train, train, dtype=np.float32)[::-1].copy())
        trained = times / train
        trained = shift * trained / (1 + (shift - 1) * trained)
        spaced = np.linspace(trained[0].item() * train, trained[-1].item() * train, steps) / train
        spaced = shift * spaced / (1 + (shift - 1) * spaced)
    sigmas = torch.from_numpy(spaced).to(torch.float32)
    return torch.cat([sigmas, torch.zeros(1)]).to(torch.float64)


def linspace_sigmas(steps: int, shift: float) -> torch.Tensor:
    """The T+1 sigmas shift(linspace(1, 0, T + 1)), shift(u) = a u / (1 + (a - 1) u) with a = ``shift``: the
    schedule of DanceGRPO, MixGRPO, BranchGRPO and the AGG authors' eff_grpo (``sampling.schedule: linspace``),
    float64. diffusers' schedule (:func:`flow_sigmas`) spaces the unshifted times from 1 to 1/T instead and
    appends 0, so its last steps are shorter (10 steps, shift 3: tail 0.465, 0.278, 0.0089, 0 against 0.5625,
    0.4286, 0.25, 0 here)."""
    if steps < 1:
        raise ConfigError("sampling.steps", steps, "an integer >= 1")
    u = torch.linspace(1, 0, steps + 1, dtype=torch.float64)
    sigmas = shift * u / (1 + (shift - 1) * u)
    sigmas[0] = 1.0  # shift(1) = 1, which rounding misses for some shifts (0.1: 1 + 2e-16, whose 1 - s is negative)
    return sigmas


def sampler_dtype(model_dtype: str | torch.dtype) -> torch.dtype:
    """The dtype the sampler computes in for a model of ``model_dtype`` (``model.dtype``): float64 for float64,
    else float32 (a bfloat16 model's too)."""
    return torch.float64 if model_dtype in ("float64", torch.float64) else torch.float32


def check_sigmas(sigmas: torch.Tensor, shift: float | None, dtype: torch.dtype, kind: str | None = None,
                 eta: float | None = None, key: str = "sampling.shift", allowed: str = "a shift",
                 steps_key: str | None = None) -> None:
    """Raise a ConfigError naming ``key`` (the shift's key) unless the schedule ``sigmas`` (T+1), in the sampler's
    ``dtype``, is finite and falls strictly from 1 to 0: an extreme shift rounds it to nan (1e-30), above 1
    (diffusers' 0.01: 1.0001, where the SDEs take the root of 1 - s) or to equal neighbours (1e8: 1, 1, ...;
    a step of size 0), and the run ended ``diverged`` or trained on steps that do nothing. With the SDE
    ``kind`` and its ``eta``, also unless every stochastic step's noise std and the variance 2 std^2 that its
    log-probability divides by are normal numbers (positive, finite, not below ``dtype``'s smallest normal), and
    its mean is finite for a unit latent and velocity:
    linspace with shift 1e-30 falls from 1 to 0 in float32, but its sigmas of ~1e-30 give stds whose square
    underflows to 0, and the run ended ``diverged`` on an infinite log-probability (a tiny ``eta`` likewise,
    named ``sampling.eta`` where eta 1 would give the schedule normal noise).
    The error says what the key takes: ``allowed`` whose N-step schedule (the steps of ``steps_key``, where given)
    falls so; a run's ``sampling.shift`` takes ``a shift`` (its bounds are the config's), ``agg-bench pretrain``'s
    ``shift`` ``a shift in (0, 100]`` with ``sample_steps``."""
    s = sigmas.to(dtype)
    dtype_name = str(dtype).removeprefix("torch.")
    steps = f"{steps_key}' " if steps_key else ""
    if not (bool(torch.isfinite(s).all()) and s[0] <= 1 and s[-1] == 0 and bool((s[1:] < s[:-1]).all())):
        # 8 digits: a float32 sigma just above 1 (1.0000001) is not shown as 1
        head = ", ".join(f"{v:.8g}" for v in s[:4].tolist()) + (", ..." if len(s) > 4 else "")
        raise ConfigError(key, shift, f"{allowed} whose {steps}{len(s) - 1}-step schedule falls strictly from 1 "
                          f"to 0 in {dtype_name} (this one gives {head})")
    if kind is None or eta is None:
        return
    bad = _abnormal_noise_step(kind, s, eta)
    if bad is None:
        return
    step, std = bad
    if _abnormal_noise_step(kind, s, 1.0) is None:
        raise ConfigError("sampling.eta", eta, f"an eta whose noise std is a normal {dtype_name} number at every "
                          f"stochastic step, with its square (step {step} of sampling.sde {kind} gives std {std:.3g})")
    raise ConfigError(key, shift, f"{allowed} whose {steps}{len(s) - 1}-step schedule gives every stochastic step "
                      f"a finite mean and a noise std that is a normal {dtype_name} number, with its square (step {step} of "
                      f"sampling.sde {kind} gives std {std:.3g} at sampling.eta {eta})")


def _abnormal_noise_step(kind: str, sigmas: torch.Tensor, eta: float) -> tuple[int, float] | None:
    """The first stochastic step of ``kind`` on ``sigmas`` (in their dtype) whose std, or 2 std^2, is not a
    positive finite normal number, or whose mean for a unit latent and velocity is not finite (dance_grpo's
    score divides by s^2), with that std; None when there is none. Both are :func:`sde_step`'s own."""
    tiny = torch.finfo(sigmas.dtype).tiny
    steps = torch.arange(sigmas.numel() - 1)
    ones = torch.ones(len(steps), 1, dtype=sigmas.dtype)  # a unit-scale latent and velocity
    out = sde_step(kind, ones, ones, sigmas, steps, eta, prev_sample=ones)
    std, mean = out.std.flatten(), out.mean.flatten()
    variance = 2 * std**2
    normal = torch.isfinite(std) & torch.isfinite(variance) & (std >= tiny) & (variance >= tiny) & torch.isfinite(mean)
    bad = stochastic_steps(kind, sigmas) & ~normal
    if not bool(bad.any()):
        return None
    step = int(bad.nonzero()[0])
    return step, float(std[step])


def _per_sample(values: torch.Tensor, index, like: torch.Tensor) -> torch.Tensor:
    """``values[index]`` shaped to broadcast against ``like`` (B, ...); ``index`` is an int or (B,)."""
    picked = values[index] if isinstance(index, int) else values[torch.as_tensor(index, device=values.device)]
    picked = picked.to(device=like.device, dtype=like.dtype)
    if picked.dim() == 0:
        return picked
    return picked.view(-1, *([1] * (like.dim() - 1)))


def _compute_dtype(*tensors: torch.Tensor | None) -> torch.dtype:
    return torch.float64 if any(t is not None and t.dtype == torch.float64 for t in tensors) else torch.float32


def gaussian_log_prob(x: torch.Tensor, mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """Mean over non-batch dims of the elementwise Gaussian log-density."""
    logp = -((x - mean) ** 2) / (2 * std**2) - torch.log(std) - LOG_SQRT_2PI
    return logp.mean(dim=tuple(range(1, logp.dim())))


def transition_log_prob(kind: str, x: torch.Tensor, mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """The log-probability ``kind`` gives ``x`` under its transition N(mean, std^2), averaged over the non-batch
    dims: :func:`gaussian_log_prob`, or for ``cps_unscaled`` the public code's ``-(x - mean)^2``."""
    if kind == "cps_unscaled":
        return (-((x - mean) ** 2)).mean(dim=tuple(range(1, x.dim())))
    return gaussian_log_prob(x, mean, std)


def sde_step(kind: str, model_output: torch.Tensor, sample: torch.Tensor, sigmas: torch.Tensor, index,
             eta: float, prev_sample: torch.Tensor | None = None,
             generator: torch.Generator | None = None) -> SDEStepOutput:
    """One SDE step from ``sample`` = x_j with velocity ``model_output`` to x_{j+1}.

    ``index`` is the step j, an int or a (B,) tensor of per-sample steps. If ``prev_sample`` is given
    its log-probability is returned; otherwise x_{j+1} is drawn with ``generator``. ``eta`` must be a
    number > 0: at 0 the transition is deterministic and has no density (use :func:`ode_step`).
    """
    if isinstance(eta, bool) or not isinstance(eta, (int, float)) or not math.isfinite(eta) or eta <= 0:
        raise ConfigError("sampling.eta", eta, "a finite number > 0 (eta 0 is the ODE step, which has no log-probability)")
    dtype = _compute_dtype(model_output, sample, prev_sample)
    v = model_output.to(dtype)
    x = sample.to(dtype)
    sig = sigmas.to(dtype)
    s = _per_sample(sig, index, x)
    nxt = index + 1 if isinstance(index, int) else torch.as_tensor(index) + 1
    s_next = _per_sample(sig, nxt, x)
    dt = s_next - s
    if kind in CPS_KINDS:
        check_cps_eta(kind, eta)
        std = s_next * math.sin(eta * math.pi / 2)
        x0 = x - s * v
        x1 = x + (1 - s) * v
        mean = (1 - s_next) * x0 + torch.sqrt((s_next**2 - std**2).clamp_min(0)) * x1
        std_t = std / torch.sqrt(-dt)
    elif kind == "flow_grpo":
        s_safe = torch.where(s == 1, sig[1].to(x.device), s)
        std_t = eta * torch.sqrt(s / (1 - s_safe))
        mean = x * (1 + std_t**2 / (2 * s) * dt) + v * (1 + std_t**2 * (1 - s) / (2 * s)) * dt
        std = std_t * torch.sqrt(-dt)
    elif kind == "dance_grpo":
        x0 = x - s * v
        score = -(x - x0 * (1 - s)) / s**2
        mean = x + dt * v - 0.5 * eta**2 * score * dt
        std_t = torch.full_like(dt, eta)
        std = eta * torch.sqrt(-dt)
    else:
        raise ConfigError("sampling.sde", kind, f"one of {list(SDE_KINDS)}")
    ones = [1] * (x.dim() - 1)
    std = std.reshape(-1, *ones).expand(x.shape[0], *ones)  # (B, 1, ..., 1)
    std_t = std_t.reshape(-1, *ones).expand(x.shape[0], *ones)
    if prev_sample is None:
        if generator is None:
            noise = torch.randn_like(x)
        else:  # drawn on the generator's device, so a CPU generator gives the same noise everywhere
            noise = torch.randn(x.shape, generator=generator, device=generator.device, dtype=dtype).to(x.device)
        prev = mean + std * noise
    else:
        prev = prev_sample.to(dtype)
    return SDEStepOutput(prev_sample=prev, log_prob=transition_log_prob(kind, prev, mean, std), mean=mean,
                         std=std, std_t=std_t)


def stochastic_steps(kind: str, sigmas: torch.Tensor) -> torch.Tensor:
    """(T,) True where ``kind``'s transition has a density: every step, except for ``cps`` (and
    ``cps_unscaled``) the steps into sigma 0, whose std is 0 (they are Euler steps)."""
    steps = sigmas.numel() - 1
    if kind in CPS_KINDS:
        return sigmas[1:].cpu() > 0
    return torch.ones(steps, dtype=torch.bool)


def ode_step(model_output: torch.Tensor, sample: torch.Tensor, sigmas: torch.Tensor, index) -> torch.Tensor:
    """Deterministic Euler step x + (s_{j+1} - s_j) v."""
    dtype = _compute_dtype(model_output, sample)
    x = sample.to(dtype)
    s = _per_sample(sigmas.to(dtype), index, x)
    nxt = index + 1 if isinstance(index, int) else torch.as_tensor(index) + 1
    s_next = _per_sample(sigmas.to(dtype), nxt, x)
    return x + (s_next - s) * model_output.to(dtype)
