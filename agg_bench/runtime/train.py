"""One GRPO training run: rollout -> reward -> advantages -> plan -> method -> clip -> AdamW.

:class:`Session` owns everything a run needs and exists once; ``run`` (training), ``snapshot``
(one frozen rollout) and the profiler all go through it.
"""
from __future__ import annotations

import contextlib
import json
import math
import re
import signal
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch
from tqdm import tqdm

from ..config import DEFAULTS, RunConfig
from ..engine.grpo import TrainBatch, UpdateStats, group_advantages
from ..engine.models import Policy, build_policy
from ..engine.plan import plan_steps
from ..engine.rewards import build_reward, reward_details
from ..engine.rollout import initial_noise, rollout
from ..engine.sde import flow_sigmas
from ..engine.text import prompt_conditioning, prompt_set
from ..errors import ConfigError, UserError
from ..io import JsonlWriter, write_json, write_lines
from ..machine import distributed, fsdp
from ..machine import telemetry as tel
from ..methods.base import Estimator, build_estimator
from ..outdir import Claim, Contents, check_folder
from ..results.records import RECORD_KEYS, TIMING_KEYS, new_record  # noqa: F401  (also imported from here)
from .checkpoint import (CHECKPOINT_NAME, SAME_RUN_CHANGES, SHARDS_PREFIX, checkpoint_path, first_difference,
                         load_checkpoint, remove_stale_files, save_checkpoint)
from .memplan import run_memory_plan


def resolve_device(name: str, key: str = "device") -> torch.device:
    """The torch device ``name`` (cpu, cuda, cuda:N or auto: cuda where available) names; a ConfigError
    naming ``key`` (the config key or flag it came from) for another name or a GPU this machine lacks."""
    if not isinstance(name, str) or not re.fullmatch(r"cpu|auto|cuda(:\d{1,9})?", name):
        raise ConfigError(key, name, "cpu, cuda, cuda:N or auto")
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        why = f"torch {torch.__version__} is built without CUDA" if torch.version.cuda is None else \
            "no CUDA device is visible"
        raise ConfigError(key, name, f"cpu or auto: CUDA is not available on this machine ({why})")
    if device.index is not None and device.index >= torch.cuda.device_count():
        raise ConfigError(key, name, f"a CUDA device this machine has ({torch.cuda.device_count()} visible: "
                                     f"cuda:0 to cuda:{torch.cuda.device_count() - 1})")
    return device


def iteration_generator(seed: int, iteration: int) -> torch.Generator:
    """All randomness of one iteration (prompts, noise, SDE, plan) comes from this CPU generator."""
    return torch.Generator().manual_seed(seed * 1_000_003 + iteration)


def model_label(cfg: RunConfig) -> str:
    if cfg.model.pretrained:
        return f"{cfg.model.family}:{Path(cfg.model.pretrained).name}"
    if cfg.model.preset == "random":
        from ..engine.architectures import architecture

        return f"{architecture(cfg.model.family, cfg.model.architecture).name}-random"
    return f"{cfg.model.family}-{cfg.model.preset}"


def weights_label(cfg: RunConfig) -> str:
    """Where the weights come from: ``pretrained`` (a local folder), ``random`` (a full-size architecture
    with random weights: its rewards say nothing about quality) or ``tiny``."""
    return "pretrained" if cfg.model.pretrained else cfg.model.preset


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
        # model + precision + gradient checkpointing + LoRA; the reference below is LoRA-aware
        self.policy: Policy = build_policy(cfg, self.device)
        self.latent_shape = self.policy.latent_shape(cfg.model.resolution)
        prompts = prompt_set(cfg.prompts.file)
        self.prompts = prompts.prompts
        # text-encoder embeddings (cached per model and prompt file) for a local model, token hashes for tiny
        self.cond_all = prompt_conditioning(cfg, self.policy.transformer, prompts, self.device)
        self.reward_fn = build_reward(cfg.reward.name, cfg.reward.options, self.device)
        if estimator is None:
            estimator = build_estimator(cfg)  # from the options the config was validated with
        estimator.check_run(cfg)
        self.estimator = estimator
        self.reference = self.policy.frozen_copy() if cfg.grpo.beta > 0 else None
        fsdp.shard_run(cfg, self.policy, self.reference)  # train.shard: fsdp; before the optimizer sees the parameters
        self.optimizer = torch.optim.AdamW(self.policy.parameters(), lr=cfg.train.lr,
                                           weight_decay=cfg.train.weight_decay)
        if cfg.sampling.shift is not None:
            self.sigmas = flow_sigmas(cfg.sampling.steps, cfg.sampling.shift)
        else:  # the model's own schedule
            self.sigmas = flow_sigmas(cfg.sampling.steps, self.policy.schedule_shift(self.latent_shape),
                                      self.policy.schedule_shift_terminal())

    # ----- one iteration's data -------------------------------------------------------------
    def pick_prompts(self, generator: torch.Generator) -> torch.Tensor:
        n, p = len(self.prompts), self.cfg.grpo.prompts_per_iteration
        order = torch.cat([torch.randperm(n, generator=generator) for _ in range(math.ceil(p / n))])
        return order[:p]

    def collect(self, iteration: int, telemetry: tel.Telemetry | None = None) -> Rollout:
        """Rollout, reward, advantages and the trained-step plan for ``iteration``.

        Under data parallelism the randomness of the whole batch is drawn as one process would and this
        process keeps its share of the groups (:mod:`agg_bench.machine.distributed`); the result is that share.
        """
        cfg = self.cfg
        phase = telemetry.phase if telemetry is not None else (lambda name, **kw: _null())
        shard = distributed.current()
        gen = iteration_generator(cfg.seed, iteration)
        g = cfg.grpo.group_size
        idx = self.pick_prompts(gen)
        total = len(idx) * g
        prompts = [self.prompts[i] for i in idx.tolist() for _ in range(g)][shard.rows(total)]
        cond = self.cond_all[idx].repeat_interleave(g).to(self.device, self.policy.dtype)
        with phase("rollout"):
            noise = initial_noise(len(idx), g, self.latent_shape, cfg.sampling.same_noise_per_group, gen,
                                  torch.float64 if self.policy.dtype == torch.float64 else torch.float32)
            mask = self.estimator.sde_mask(iteration, cfg.sampling.steps, gen)
            with self.estimator.rollout_hooks(self.policy) as before_step:
                traj = rollout(distributed.rollout_policy(self.policy, shard, total), cond, noise, self.sigmas,
                               cfg.sampling.sde, cfg.sampling.eta, gen, mask, before_step)
            traj = distributed.take_trajectory(traj, shard)
        cond = distributed.take(cond, shard, total)
        with phase("reward"):
            images = self.policy.decode(traj.latents[:, -1])
            # float64: advantages divide by the group's spread, which rounding rewards to float32 would blur
            rewards = self.reward_fn(images, prompts).detach().to(torch.float64).cpu()
        advantages = group_advantages(rewards, g, cfg.grpo.adv_clip_max, cfg.grpo.adv_std,
                                      traj.latents.dtype).to(self.device)
        train_steps = plan_steps(cfg.train.plan, total, traj.sde_mask, cfg.train.timestep_fraction,
                                 cfg.train.plan_window, gen)
        train_steps = distributed.take(train_steps, shard, total).to(self.device)
        batch = TrainBatch(
            latents=traj.latents, log_probs=traj.log_probs, sigmas=self.sigmas.to(self.device),
            timesteps=traj.timesteps, advantages=advantages, train_steps=train_steps, cond=cond,
            sde=cfg.sampling.sde, eta=cfg.sampling.eta, clip_range=cfg.grpo.clip_range, beta=cfg.grpo.beta,
            velocities=traj.velocities, policy_version=traj.policy_version, kl_form=cfg.grpo.kl_form,
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
            with distributed.failures_shared():  # no process enters the all-reduce while another failed
                self.estimator.accumulate(self.policy, batch, stats, self.reference)
            # every backward above accumulated locally; one averaging all-reduce per optimizer step
            # (FSDP already averaged each backward's gradients in its reduce-scatter: only the loss is left)
            sharded = fsdp.is_sharded(self.policy)
            (loss,) = distributed.average_gradients([] if sharded else params, stats.loss_sum)
            norm = fsdp.gradient_norm(params)
            if cfg.train.max_grad_norm is not None:
                torch.nn.utils.clip_grad_norm_(params, cfg.train.max_grad_norm)
            # checked before the step, so a non-finite gradient never reaches the weights
            if not torch.isfinite(norm) or not math.isfinite(loss):
                out["diverged"] = "gradient" if not torch.isfinite(norm) else "loss"
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


def identity(cfg: RunConfig, run_id: str, device: torch.device, world_size: int = 1) -> dict:
    """The identity fields of every record; ``n_gpus`` counts the GPUs of all processes (0 on CPU)."""
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    return {
        "run_id": run_id, "method": cfg.method.name, "model": model_label(cfg),
        "resolution": cfg.model.resolution, "device": device.type, "gpu_name": gpu,
        "n_gpus": world_size if device.type == "cuda" else 0, "seed": cfg.seed, "weights": weights_label(cfg),
    }


def _finite(x) -> bool:
    return x is None or math.isfinite(x)


class Interrupted(KeyboardInterrupt):
    """The run was stopped by signal ``signum`` (SIGTERM or SIGINT)."""

    def __init__(self, signum: int):
        self.signum = signum
        super().__init__(signal.Signals(signum).name)


class StopSignals:
    """While active (in the main thread), SIGTERM and SIGINT raise :class:`Interrupted` at once, except
    inside :meth:`deferred` blocks (a record or a checkpoint being written), which finish first. Signals
    after the first are ignored: the run is already stopping and must get to write its summary."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self):
        self.received: int | None = None
        self._raised = False
        self._depth = 0
        self._previous: dict = {}

    def __enter__(self) -> "StopSignals":
        if threading.current_thread() is threading.main_thread():
            for signum in self.SIGNALS:
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc) -> bool:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()
        return False

    def _raise(self) -> None:
        self._raised = True
        raise Interrupted(self.received)

    def _handle(self, signum, frame) -> None:
        if self.received is not None:
            return
        self.received = signum
        if self._depth == 0:
            self._raise()

    @contextlib.contextmanager
    def deferred(self) -> Iterator[None]:
        """A block that a signal does not cut short; the signal takes effect when it ends."""
        self._depth += 1
        try:
            yield
        finally:
            self._depth -= 1
        if self._depth == 0 and self.received is not None and not self._raised:
            self._raise()


def check_plan(cfg: RunConfig) -> None:
    """Raise the step plan's ConfigError (e.g. ``train.plan_window`` longer than the trajectory) before a
    run writes anything rather than in its first iteration."""
    plan_steps(cfg.train.plan, 1, torch.ones(cfg.sampling.steps, dtype=torch.bool), cfg.train.timestep_fraction,
               cfg.train.plan_window, torch.Generator())


def run_iteration(session: Session, telemetry: tel.Telemetry, iteration: int) -> dict:
    """Train one iteration on every process; the record fields of the whole batch: telemetry, pass
    counts, learning statistics, the method's fields and the reward statistics, the processes'
    shares combined (:func:`agg_bench.machine.distributed.combine`). ``diverged`` is set when the update
    stopped before its optimizer step."""
    counter = session.policy.counter
    before = counter.copy()
    with telemetry.iteration():
        collected = session.collect(iteration, telemetry)
        before_train = counter.copy()
        # the policy network's saved tensors: what one backward through it holds, whatever the method
        with telemetry.phase("train", saved_activations="regions"):
            learn = session.update(collected.batch)
    # the train phase's own passes, which the cost model prices (the rollout's are the same for most methods)
    train_passes = {f"train_{k}": v for k, v in (counter - before_train).as_dict().items()}
    share = {**telemetry.record(), **(counter - before).as_dict(), **train_passes, **learn,
             **session.estimator.iteration_metrics(), **reward_details(session.reward_fn)}
    parts = distributed.gather((share, collected.rewards.tolist(), len(collected.prompts)))
    fields = distributed.combine([p for p, _, _ in parts])
    rewards = torch.tensor([r for _, rs, _ in parts for r in rs], dtype=torch.float32)
    fields["reward_mean"] = float(rewards.mean())
    fields["reward_std"] = float(rewards.std(unbiased=False))
    fields["images_per_s"] = sum(n for _, _, n in parts) / fields["t_iter_s"] if fields.get("t_iter_s") else None
    return fields


def train(cfg: RunConfig, out_dir: str | Path, resume: bool = False, overwrite: bool = False) -> dict:
    """Run ``train.iterations`` GRPO iterations into ``out_dir``; return the summary.

    Writes ``metrics.jsonl`` (one record per iteration, each line flushed and fsynced as written),
    ``config.json``, ``env.json``, with ``train.checkpoint_every`` = K > 0 ``checkpoint.pt`` every K
    iterations, at the end and on interruption, and ``summary.json`` last (every file but the metric
    lines is written to a temporary name and renamed). Every input error surfaces before anything is
    written. ``out_dir`` must be new, empty or an agg-bench run folder (:func:`check_out_dir`): an
    earlier attempt's files are replaced, but a finished run of another config only with ``overwrite``.
    With ``resume`` the run continues after the checkpoint's iteration (later records are dropped and
    recomputed, so none is duplicated or missing), or starts over when there is no checkpoint.

    Summary ``status``: ok; oom (the run ends, the call returns); diverged (a non-finite reward, loss
    or gradient: that update never reaches the weights; ``last_good_iteration`` is the one before);
    interrupted (SIGTERM/SIGINT: :class:`Interrupted` is raised after the summary is written); error
    (the exception is raised after the summary is written). Started by torchrun, every process trains
    its share of each batch and rank 0 writes (:mod:`agg_bench.machine.distributed`).
    """
    with distributed.process_group(resolve_device(cfg.device), single=fsdp.enabled(cfg)) as shard:
        return _train(cfg, Path(out_dir), resume, shard, overwrite)


# what a run folder holds; anything else in --out is someone else's
RUN_CONTENTS = Contents("an agg-bench run", ("config.json", "env.json", "metrics.jsonl", "summary.json", "plan.json",
                                             CHECKPOINT_NAME), (f"{SHARDS_PREFIX}*",))


def _run_config(folder: Path) -> dict | None:
    """The run config a run folder holds (its ``config.json``), or None when it is not a run folder."""
    try:
        config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return config if isinstance(config, dict) and {"model", "train", "method"} <= set(config) else None


def check_out_dir(out: Path, config: dict, resume: bool, overwrite: bool) -> None:
    """Refuse an output folder whose contents a run would destroy: a folder that holds anything a run does
    not write, or a symbolic link (:func:`~agg_bench.outdir.check_folder`), a run's file names without a
    run's config, and (unless ``overwrite``, or resuming from a checkpoint, which checks the config
    itself) a finished run of another config. Reads only."""
    check_folder(out, RUN_CONTENTS)
    previous = _run_config(out) if out.is_dir() else None
    if previous is None:  # its files, if any, are not an agg-bench run's
        check_folder(out, Contents(RUN_CONTENTS.what))
        return
    if overwrite or (resume and checkpoint_path(out).is_file()) or not (out / "summary.json").is_file():
        return
    diff = first_difference(previous, config, SAME_RUN_CHANGES, DEFAULTS)
    if diff is not None:
        key, old, new = diff
        raise UserError(f"--out {out}: holds a finished run of another config ({key} = {old!r} there, {new!r} "
                        "here); pass --overwrite to replace it, or give another folder")


def _train(cfg: RunConfig, out: Path, resume: bool, shard: distributed.Shard, overwrite: bool = False) -> dict:
    """Claim ``out`` (rank 0: checked, locked against a second writer, made if new) and run there."""
    shard.check_run(cfg)
    fsdp.check_run(cfg)
    config = cfg.to_dict()
    distributed.on_main(check_out_dir, out, config, resume, overwrite)  # refused before anything is made
    claim = distributed.on_main(lambda: Claim(out, folder=True, lock_inside=True,
                                              check=lambda: check_out_dir(out, config, resume, overwrite)).acquire())
    with claim or contextlib.nullcontext():  # a folder this run made and left empty goes if it fails
        return _train_claimed(cfg, out, resume, shard)


def _train_claimed(cfg: RunConfig, out: Path, resume: bool, shard: distributed.Shard) -> dict:
    try:
        session = Session(cfg)  # every input error surfaces here, before anything is written
    except Exception as exc:
        if not tel.is_oom_error(exc):
            raise
        return _out_of_memory_at_build(cfg, out, resume, shard, exc)
    check_plan(cfg)
    # planned next to measured memory; a run that measures nothing (telemetry off) plans nothing
    memory_plan = run_memory_plan(cfg, shard.world_size) if shard.is_main and cfg.telemetry.enabled else None
    run_id = cfg.run_id or out.name
    config = cfg.to_dict()
    restored = load_checkpoint(out, session, config) if resume else None
    if restored is not None and cfg.train.iterations <= restored.iteration:
        raise ConfigError("train.iterations", cfg.train.iterations,
                          f"more than the checkpoint's last iteration {restored.iteration} (it holds "
                          f"{restored.iteration + 1} iterations) to resume the run in {out}")
    lines = list(restored.records) if restored is not None else []  # records written, as JSON lines
    start = restored.iteration + 1 if restored is not None else 0

    def begin() -> None:
        if resume and restored is None:
            print(f"agg-bench run: no checkpoint in {out}; starting at iteration 0", file=sys.stderr)
        _start_files(out, config, lines, keep_checkpoint=restored is not None)
        if memory_plan is not None:
            write_json(out / "plan.json", memory_plan)  # planned bytes, next to the peaks the records measure
        else:
            (out / "plan.json").unlink(missing_ok=True)  # an earlier attempt's plan is not this run's

    distributed.on_main(begin)
    telemetry = tel.Telemetry(session.device, enabled=cfg.telemetry.enabled,
                              nvml_interval_s=cfg.telemetry.nvml_interval_s,
                              saved_activations=cfg.telemetry.saved_activations, iterations_before=start)
    base = identity(cfg, run_id, session.device, shard.world_size)
    every = cfg.train.checkpoint_every
    status, error = "ok", None
    last_good = start - 1 if start else None
    saved_at = restored.iteration if restored is not None else None
    # True from an optimizer step until its record is written: a checkpoint then would not match the records
    stepped = [False]
    hook = session.optimizer.register_step_pre_hook(lambda *args: stepped.__setitem__(0, True))

    def checkpoint(iteration: int) -> None:
        nonlocal saved_at
        if shard.is_main or fsdp.is_sharded(session.policy):  # every process writes its shards
            save_checkpoint(out, session, iteration, lines, config)
        saved_at = iteration

    # a job log (not a terminal) gets one line per iteration instead of a bar it cannot redraw
    log_lines = shard.is_main and not sys.stderr.isatty()
    bar = tqdm(range(start, cfg.train.iterations), desc=f"{run_id}", initial=start, total=cfg.train.iterations,
               disable=not cfg.progress or not shard.is_main or log_lines, unit="it")
    writer = JsonlWriter(out / "metrics.jsonl", append=True) if shard.is_main else None
    stop = StopSignals()
    with stop:
        try:
            for iteration in bar:
                record = new_record(base, iteration=iteration)
                try:
                    fields = run_iteration(session, telemetry, iteration)
                except Exception as exc:  # an OOM ends the run but not the sweep
                    if isinstance(exc, distributed.PeerFailure):
                        oom, memory = exc.is_oom, exc.memory
                    else:
                        oom = tel.is_oom_error(exc)
                        memory = tel.memory_at_failure(session.device) if oom else None
                    distributed.report_failure(exc, memory)
                    if not oom:
                        raise
                    record.update(telemetry.record())
                    record.update(memory, status="oom")
                    with stop.deferred():
                        if writer is not None:
                            lines.append(writer.write(record))
                    status = "oom"
                    break
                record.update({k: v for k, v in fields.items() if k != "diverged"})
                reason = fields.get("diverged") or next(
                    (k for k in ("reward_mean", "loss", "grad_norm") if not _finite(record[k])), None)
                record["status"] = "diverged" if reason else "ok"
                with stop.deferred():
                    if writer is not None:
                        lines.append(writer.write(record))
                    stepped[0] = False
                    if reason:
                        status, error = "diverged", f"non-finite {reason} at iteration {iteration}"
                        break
                    last_good = iteration
                    if every and (iteration + 1) % every == 0:
                        checkpoint(iteration)
                bar.set_postfix(reward=f"{record['reward_mean']:.3g}", loss=f"{record['loss'] or 0:.3g}")
                if log_lines:
                    print(progress_line(record, cfg.train.iterations), file=sys.stderr, flush=True)
            if status == "ok" and every and last_good is not None and saved_at != last_good:
                with stop.deferred():
                    checkpoint(last_good)
        except Interrupted as exc:
            status, error = "interrupted", f"stopped by {exc}"
            # the state still matches the records unless an optimizer step ran since the last one
            if every and last_good is not None and saved_at != last_good and not stepped[0]:
                checkpoint(last_good)
            raise
        except Exception as exc:
            status, error = "error", f"{type(exc).__name__}: {exc}"
            raise
        finally:
            hook.remove()
            bar.close()
            telemetry.close()
            session.estimator.close()
            if writer is not None:
                writer.close()
            summary = _summary(cfg, run_id, status, error, base, shard, last_good=last_good,
                               resumed_from=restored.iteration if restored else None, checkpoint_iteration=saved_at)
            if shard.is_main:
                try:
                    write_json(out / "summary.json", summary)
                except OSError:
                    if status == "ok":
                        raise
                    # e.g. a full disk: the error that ended the run is the one to report
    return summary


def progress_line(record: dict, iterations: int) -> str:
    """One log line for an iteration's record: its number, phase times (wall, and CPU in
    parentheses), reward and status."""
    def seconds(key: str) -> str:
        wall, cpu = record.get(f"t_{key}_s"), record.get(f"t_{key}_cpu_s")
        text = "-" if wall is None else f"{wall:.3f}s"
        return text if cpu is None else f"{text} (cpu {cpu:.3f}s)"

    reward = record.get("reward_mean")
    phases = "  ".join(f"{name} {seconds(name)}" for name in ("rollout", "reward", "train", "iter"))
    return (f"{record.get('run_id')} iteration {record['iteration'] + 1}/{iterations}  {phases}  "
            f"reward {'-' if reward is None else f'{reward:.4g}'}  {record.get('status')}")


def _start_files(out: Path, config: dict, lines: list[str], keep_checkpoint: bool) -> None:
    """What a run writes before its first iteration: an earlier attempt's stale files removed, then
    ``config.json``, ``env.json`` and ``metrics.jsonl`` holding ``lines``."""
    remove_stale_files(out, keep_checkpoint=keep_checkpoint)
    write_json(out / "config.json", config)
    write_json(out / "env.json", tel.environment())
    write_lines(out / "metrics.jsonl", lines)


def _summary(cfg: RunConfig, run_id: str, status: str, error: str | None, base: dict, shard: distributed.Shard,
             last_good: int | None, resumed_from: int | None, checkpoint_iteration: int | None) -> dict:
    """The contents of ``summary.json``."""
    return {"run_id": run_id, "status": status, "iterations": cfg.train.iterations, "last_good_iteration": last_good,
            "error": error, **base, "world_size": shard.world_size, "resumed_from": resumed_from,
            "checkpoint_iteration": checkpoint_iteration}


def _out_of_memory_at_build(cfg: RunConfig, out: Path, resume: bool, shard: distributed.Shard,
                            exc: BaseException) -> dict:
    """The model (or its optimizer, reference copy, reward model) did not fit: the run ends as ``oom``
    like an iteration that runs out of memory, with one record (iteration 0, nothing measured but
    the memory at failure and the RSS peak) so that the tables show the cell as OOM. With ``resume``
    and a checkpoint in ``out`` the earlier records and checkpoint stay; only the summary says how
    this attempt ended."""
    device = resolve_device(cfg.device)
    memory = tel.memory_at_failure(device)
    distributed.report_failure(exc, memory)
    run_id = cfg.run_id or out.name
    base = identity(cfg, run_id, device, shard.world_size)
    error = f"out of memory while building the model: {type(exc).__name__}: {exc}".splitlines()[0]
    summary = _summary(cfg, run_id, "oom", error, base, shard, last_good=None, resumed_from=None,
                       checkpoint_iteration=None)
    if shard.is_main:
        if not (resume and checkpoint_path(out).exists()):
            record = new_record(base, iteration=0, rss_peak_bytes=tel.rss_peak_bytes())
            record.update(memory, status="oom")
            _start_files(out, cfg.to_dict(), [JsonlWriter.line(record)], keep_checkpoint=False)
        write_json(out / "summary.json", summary)
    print(f"agg-bench run: {error}", file=sys.stderr)
    return summary
