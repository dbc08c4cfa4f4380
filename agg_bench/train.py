"""One GRPO training run: rollout -> reward -> advantages -> plan -> method -> clip -> AdamW.

:class:`Session` owns everything a run needs and exists once; ``run`` (training), ``snapshot``
(one frozen rollout) and the profiler all go through it.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from . import telemetry as tel
from .config import RunConfig
from .errors import ConfigError, UserError
from .grpo import TrainBatch, UpdateStats, group_advantages
from .io import JsonlWriter, write_json
from .methods import Estimator, build_method
from .models import Conditioning, Policy, load_policy, text_dims
from .plan import plan_steps
from .prompts import hash_embed, load_prompts
from .rewards import build_reward
from .rollout import initial_noise, rollout
from .sde import flow_sigmas

RECORD_KEYS = (
    "run_id", "method", "model", "resolution", "device", "gpu_name", "n_gpus", "seed", "iteration",
    "reward_mean", "reward_std", "loss", "grad_norm", "clip_frac", "approx_kl",
    "t_rollout_s", "t_reward_s", "t_train_s", "t_iter_s", "images_per_s",
    "forward_nograd", "forward_grad", "backward",
    "peak_alloc_bytes", "peak_reserved_bytes", "nvml_peak_used_bytes", "saved_activation_peak_bytes",
    "rss_peak_bytes", "energy_j", "status",
)
TIMING_KEYS = ("t_rollout_s", "t_reward_s", "t_train_s", "t_iter_s", "images_per_s", "rss_peak_bytes",
               "peak_alloc_bytes", "peak_reserved_bytes", "nvml_peak_used_bytes", "energy_j",
               "gpu_util_mean", "power_mean_w")


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device", name, "'cpu' or 'auto' on a machine without CUDA")
    return device


def iteration_generator(seed: int, iteration: int) -> torch.Generator:
    """All randomness of one iteration (prompts, noise, SDE, plan) comes from this CPU generator."""
    return torch.Generator().manual_seed(seed * 1_000_003 + iteration)


def model_label(cfg: RunConfig) -> str:
    if cfg.model.pretrained:
        return f"{cfg.model.family}:{Path(cfg.model.pretrained).name}"
    return f"{cfg.model.family}-{cfg.model.preset}"


@dataclass
class Rollout:
    """What one iteration collects before training."""

    batch: TrainBatch
    prompts: list[str]
    rewards: torch.Tensor


class Session:
    """A configured run: policy, reference, optimizer, reward, method and schedule."""

    def __init__(self, cfg: RunConfig, estimator: Estimator | None = None):
        self.cfg = cfg
        self.device = resolve_device(cfg.device)
        torch.manual_seed(cfg.seed)
        self.policy: Policy = load_policy(cfg.model.family, cfg.model.preset, cfg.model.pretrained,
                                          cfg.model.dtype, self.device, cfg.seed)
        self.latent_shape = self.policy.latent_shape(cfg.model.resolution)
        self.prompts = load_prompts(cfg.prompts.file) if cfg.prompts.file else \
            load_prompts(Path(__file__).parent / "data" / "prompts.txt")
        dim, pooled = text_dims(self.policy.transformer)
        self.cond_all = hash_embed(self.prompts, dim, pooled, cfg.prompts.max_tokens, cfg.seed)
        self.reward_fn = build_reward(cfg.reward.name, cfg.reward.options, self.device)
        if estimator is None:
            options = dict(cfg.method)
            estimator = build_method(options.pop("name"), options)
        estimator.check_run(cfg)
        self.estimator = estimator
        self.reference = self.policy.frozen_copy() if cfg.grpo.beta > 0 else None
        self.optimizer = torch.optim.AdamW(self.policy.parameters(), lr=cfg.train.lr,
                                           weight_decay=cfg.train.weight_decay)
        self.sigmas = flow_sigmas(cfg.sampling.steps, cfg.sampling.shift)

    # ----- one iteration's data -------------------------------------------------------------
    def pick_prompts(self, generator: torch.Generator) -> torch.Tensor:
        n, p = len(self.prompts), self.cfg.grpo.prompts_per_iteration
        order = torch.cat([torch.randperm(n, generator=generator) for _ in range(math.ceil(p / n))])
        return order[:p]

    def collect(self, iteration: int, telemetry: tel.Telemetry | None = None) -> Rollout:
        """Rollout, reward, advantages and the trained-step plan for ``iteration``."""
        cfg = self.cfg
        phase = telemetry.phase if telemetry is not None else (lambda name, **kw: _null())
        gen = iteration_generator(cfg.seed, iteration)
        g = cfg.grpo.group_size
        idx = self.pick_prompts(gen)
        prompts = [self.prompts[i] for i in idx.tolist() for _ in range(g)]
        cond = self.cond_all[idx].repeat_interleave(g).to(self.device, self.policy.dtype)
        with phase("rollout"):
            noise = initial_noise(len(idx), g, self.latent_shape, cfg.sampling.same_noise_per_group, gen,
                                  torch.float64 if self.policy.dtype == torch.float64 else torch.float32)
            mask = self.estimator.sde_mask(iteration, cfg.sampling.steps, gen)
            with self.estimator.rollout_hooks(self.policy) as before_step:
                traj = rollout(self.policy, cond, noise, self.sigmas, cfg.sampling.sde, cfg.sampling.eta, gen,
                               mask, before_step)
        with phase("reward"):
            images = self.policy.decode(traj.latents[:, -1])
            rewards = self.reward_fn(images, prompts).detach().float().cpu()
        advantages = group_advantages(rewards, g, cfg.grpo.adv_clip_max).to(self.device)
        train_steps = plan_steps(cfg.train.plan, len(prompts), traj.sde_mask, cfg.train.timestep_fraction,
                                 cfg.train.plan_window, gen).to(self.device)
        batch = TrainBatch(
            latents=traj.latents, log_probs=traj.log_probs, sigmas=self.sigmas.to(self.device),
            timesteps=traj.timesteps, advantages=advantages, train_steps=train_steps, cond=cond,
            sde=cfg.sampling.sde, eta=cfg.sampling.eta, clip_range=cfg.grpo.clip_range, beta=cfg.grpo.beta,
            velocities=traj.velocities, policy_version=traj.policy_version,
        )
        return Rollout(batch=batch, prompts=prompts, rewards=rewards)

    # ----- one update ---------------------------------------------------------------------
    def update(self, batch: TrainBatch) -> dict:
        """``train.inner_epochs`` optimizer steps on one rollout; learning statistics of them all."""
        cfg = self.cfg
        params = self.policy.parameters()
        out: dict = {}
        losses, clips, kls, norms = [], [], [], []
        for epoch in range(cfg.train.inner_epochs):
            self.optimizer.zero_grad(set_to_none=True)
            stats = UpdateStats(cfg.grpo.clip_range)
            self.estimator.accumulate(self.policy, batch, stats, self.reference)
            grads = [p.grad for p in params if p.grad is not None]
            norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.double()) for g in grads])) \
                if grads else torch.zeros((), dtype=torch.float64)
            if cfg.train.max_grad_norm is not None:
                torch.nn.utils.clip_grad_norm_(params, cfg.train.max_grad_norm)
            if not torch.isfinite(norm):
                out["diverged"] = "gradient"
                break
            self.optimizer.step()
            self.policy.version += 1
            summary = stats.as_dict()
            if epoch == 0:
                out.update({k: v for k, v in summary.items() if k not in ("loss", "clip_frac", "approx_kl")})
            losses.append(summary["loss"])
            clips.append(summary["clip_frac"])
            kls.append(summary["approx_kl"])
            norms.append(float(norm))
        mean = lambda xs: sum(xs) / len(xs) if xs else None  # noqa: E731
        out.update(loss=mean(losses), clip_frac=mean(clips), approx_kl=mean(kls), grad_norm=mean(norms))
        return out


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def identity(cfg: RunConfig, run_id: str, device: torch.device) -> dict:
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    return {
        "run_id": run_id, "method": cfg.method.name, "model": model_label(cfg),
        "resolution": cfg.model.resolution, "device": device.type, "gpu_name": gpu,
        "n_gpus": 1 if device.type == "cuda" else 0, "seed": cfg.seed,
    }


def _finite(x) -> bool:
    return x is None or math.isfinite(x)


def train(cfg: RunConfig, out_dir: str | Path) -> dict:
    """Run ``train.iterations`` GRPO iterations; write metrics.jsonl, summary.json and env.json."""
    session = Session(cfg)  # every input error surfaces here, before anything is written
    out = prepare_out_dir(out_dir)
    run_id = cfg.run_id or out.name
    write_json(out / "config.json", cfg.to_dict())
    write_json(out / "env.json", tel.environment())
    telemetry = tel.Telemetry(session.device, enabled=cfg.telemetry.enabled,
                              nvml_interval_s=cfg.telemetry.nvml_interval_s)
    base = identity(cfg, run_id, session.device)
    status, last_good, error = "ok", None, None
    bar = tqdm(range(cfg.train.iterations), desc=f"{run_id}", disable=not cfg.progress, unit="it")
    try:
        with JsonlWriter(out / "metrics.jsonl") as writer:
            for iteration in bar:
                record = dict.fromkeys(RECORD_KEYS)
                record.update(base, iteration=iteration)
                before = session.policy.counter.copy()
                try:
                    with telemetry.iteration():
                        collected = session.collect(iteration, telemetry)
                        with telemetry.phase("train", saved_activations=True):
                            learn = session.update(collected.batch)
                except Exception as exc:  # an OOM ends the run but not the sweep
                    if not tel.is_oom_error(exc):
                        raise
                    record.update(telemetry.record())
                    record.update(tel.memory_at_failure(session.device), status="oom")
                    writer.write(record)
                    status = "oom"
                    break
                rewards = collected.rewards
                record.update(telemetry.record())
                record.update((session.policy.counter - before).as_dict())
                record.update({k: v for k, v in learn.items() if k != "diverged"})
                record.update(session.estimator.iteration_metrics())
                record["reward_mean"] = float(rewards.mean())
                record["reward_std"] = float(rewards.std(unbiased=False))
                if record.get("t_iter_s"):
                    record["images_per_s"] = len(collected.prompts) / record["t_iter_s"]
                diverged = "diverged" in learn or not all(
                    _finite(record[k]) for k in ("reward_mean", "loss", "grad_norm"))
                record["status"] = "diverged" if diverged else "ok"
                writer.write(record)
                bar.set_postfix(reward=f"{record['reward_mean']:.3g}", loss=f"{record['loss'] or 0:.3g}")
                if diverged:
                    status = "diverged"
                    break
                last_good = iteration
    except Exception as exc:
        status, error = "error", f"{type(exc).__name__}: {exc}"
        raise
    finally:
        telemetry.close()
        session.estimator.close()
        summary = {"run_id": run_id, "status": status, "iterations": cfg.train.iterations,
                   "last_good_iteration": last_good, "error": error, **base}
        write_json(out / "summary.json", summary)
    return summary


def prepare_out_dir(out_dir: str | Path) -> Path:
    out = Path(out_dir)
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / ".write_test"
        probe.write_text("")
        probe.unlink()
    except OSError as err:
        raise UserError(f"output folder {out}: cannot write there ({err.strerror or err})")
    return out
