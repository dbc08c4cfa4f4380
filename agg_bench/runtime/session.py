"""A configured run and what one of its iterations computes.

:class:`Session` owns everything a run needs (policy, reference, optimizer, reward, method, sigma schedule)
and exists once: a training run (:mod:`agg_bench.runtime.train`), ``snapshot``, ``profile`` and
``calibrate`` all go through it. :func:`run_iteration` is one training iteration, rollout -> reward ->
advantages -> trained steps -> method -> clip -> AdamW, and returns the record fields of the whole batch;
:func:`identity` the fields that say which run a record belongs to.
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch

from .. import stopping
from ..config import RunConfig, weights_label
from ..engine import families
from ..engine.grpo import TrainBatch, UpdateStats
from ..engine.models import Conditioning, Policy, build_policy, unreplaced_folder
from ..engine.moving_average import MovingAverage, warmup_decay
from ..engine.trained_steps import draw_plan
from ..engine.rewards import build_reward, reward_details, unscored_if_not_finite
from ..engine.rollout import Trajectory, initial_noise
from ..engine.sampler import check_sigmas, flow_sigmas, linspace_sigmas, sampler_dtype, stochastic_steps
from ..engine.text import empty_prompt_conditioning, prompt_conditioning, prompt_set
from ..machine import distributed, fsdp
from ..machine import telemetry as tel
from ..machine.devices import resolve_device
from ..methods.base import Estimator, build_estimator
from .config_check import check_config
from .memplan import check_weights_fit
from .model_reuse import policy_for


def iteration_generator(seed: int, iteration: int) -> torch.Generator:
    """All randomness of one iteration (prompts, noise, SDE, trained steps) comes from this CPU generator."""
    return torch.Generator().manual_seed(seed * 1_000_003 + iteration)


def run_sigmas(cfg: RunConfig, policy: Policy, latent_shape: tuple[int, int, int]) -> torch.Tensor:
    """The run's sigma schedule (T+1): ``sampling.schedule`` with ``sampling.shift``, or for ``diffusers`` with a
    null shift the model's own."""
    if cfg.sampling.schedule == "linspace":
        assert cfg.sampling.shift is not None  # validate refuses linspace without a shift
        return linspace_sigmas(cfg.sampling.steps, cfg.sampling.shift)
    if cfg.sampling.shift is not None:
        return flow_sigmas(cfg.sampling.steps, cfg.sampling.shift)
    return flow_sigmas(cfg.sampling.steps, policy.schedule_shift(latent_shape), policy.schedule_shift_terminal())


def ready_estimator(estimator: Estimator, cfg: RunConfig, policy: Policy, device: torch.device) -> None:
    """The method's run checks (:meth:`Estimator.check_run`), then what it asks of the run: the empty prompt's
    conditioning where its rollout guides (:meth:`Estimator.needs_unconditional`)."""
    estimator.check_run(cfg)
    if estimator.needs_unconditional():
        estimator.unconditional = empty_prompt_conditioning(cfg, policy.transformer, device)


def rewarded_latents(traj: Trajectory, on: str) -> torch.Tensor:
    """The latents the reward scores (``reward.on``): the final ones, or the last step's data prediction
    x_{T-1} - s_{T-1} v_{T-1} (``x0``; the velocity the rollout used at that step)."""
    if on == "final":
        return traj.latents[:, -1]
    x, v = traj.latents[:, -2], traj.velocities[:, -1].to(traj.latents.dtype)
    return x - traj.sigmas[-2].to(device=x.device, dtype=x.dtype) * v


@dataclass
class Rollout:
    """What one iteration collects before training."""

    batch: TrainBatch
    prompts: list[str]
    rewards: torch.Tensor


class Session:
    """A configured run: policy, reference, optimizer, reward, method and schedule."""

    def __init__(self, cfg: RunConfig, estimator: Estimator | None = None):
        self.cfg = check_config(cfg)  # the method's options typed (once), a random preset's architecture named
        self.device = resolve_device(cfg.device)
        if estimator is None:
            estimator = build_estimator(cfg)  # from the options the config was validated with
        estimator.check_run(cfg)  # the method's bounds (its sizes among them) before anything is allocated
        check_weights_fit(cfg)  # a model folder's sizes, and whether its weights fit, before it is loaded
        torch.manual_seed(cfg.seed)
        # the model and its conditioning read from one model folder: one replaced in between is refused
        with unreplaced_folder(cfg.model.pretrained):
            # model + precision + gradient checkpointing + LoRA (built, or a cell job's kept model as built); the
            # reference below is LoRA-aware
            self.policy: Policy = policy_for(cfg, self.device, build_policy)
            stopping.check()  # a signal while the model was built (a run takes it only at safe points)
            self.latent_shape = self.policy.latent_shape(cfg.model.resolution)
            prompts = prompt_set(cfg.prompts.file)
            self.prompts = prompts.prompts
            # text-encoder embeddings (cached per model and prompt file) for a local model, token hashes for tiny
            self.cond_all = prompt_conditioning(cfg, self.policy.transformer, prompts, self.device)
            stopping.check()
            self.reward_fn = build_reward(cfg.reward.name, cfg.reward.options, self.device)
            stopping.check()
            ready_estimator(estimator, cfg, self.policy, self.device)  # the empty prompt, where its rollout guides
        self.estimator = estimator
        self.reference = self.policy.frozen_copy() if cfg.grpo.beta > 0 else None
        fsdp.shard_run(cfg, self.policy, self.reference)  # train.shard: fsdp; before the optimizer sees the parameters
        estimator.set_up(self.policy)  # a reference of the method's own: the starting weights, resumed or not
        self.optimizer = torch.optim.AdamW(self.policy.parameters(), lr=cfg.train.lr,
                                           weight_decay=cfg.train.weight_decay)
        self.steps_taken = 0  # optimizer steps of the last update
        self.sigmas = run_sigmas(cfg, self.policy, self.latent_shape)
        if cfg.sampling.shift is None:  # the model's own shift; a given one was checked with the config
            own = self.policy.schedule_shift(self.latent_shape)
            check_sigmas(self.sigmas, None, sampler_dtype(self.policy.dtype), cfg.sampling.sde, cfg.sampling.eta,
                         allowed=f"a number, or a shift of the model's scheduler config (here {own:g})",
                         steps_key="sampling.steps")
        estimator.check_schedule(cfg, self.sigmas)
        # train.eval_ema: the moving average the evaluations use; the rollout and training never do
        self.eval_ema = MovingAverage(self.policy) if cfg.train.eval_ema is not None else None
        check_prompts = getattr(self.reward_fn, "check_prompts", None)  # a reward that scores some prompts only
        if check_prompts is not None:  # the built-in prompts are the reward's to refuse, a file's the file's
            check_prompts(self.prompts, *(("prompts.file", cfg.prompts.file) if cfg.prompts.file is not None else
                                          ("reward.name", cfg.reward.name)))

    def evaluated_weights(self):
        """A context in which the policy computes with the weights an evaluation takes: the moving average of
        ``train.eval_ema`` swapped in (the trained weights put back after, bit for bit), or the trained weights."""
        return self.eval_ema.weights_in(self.policy) if self.eval_ema is not None else contextlib.nullcontext()

    # ----- one iteration's data -------------------------------------------------------------
    def pick_prompts(self, generator: torch.Generator) -> torch.Tensor:
        n, p = len(self.prompts), self.cfg.grpo.prompts_per_iteration
        order = torch.cat([torch.randperm(n, generator=generator) for _ in range(math.ceil(p / n))])
        return order[:p]

    def rollout_prompts(self, iteration: int) -> tuple[torch.Generator, list[str], Conditioning]:
        """``iteration``'s generator (after its prompt draw), the whole batch's prompts (P x G, grouped
        consecutively) and their conditioning on the device: what the iteration's rollout is conditioned on."""
        gen = iteration_generator(self.cfg.seed, iteration)
        g = self.cfg.grpo.group_size
        idx = self.pick_prompts(gen)
        prompts = [self.prompts[i] for i in idx.tolist() for _ in range(g)]
        return gen, prompts, self.cond_all[idx].repeat_interleave(g).to(self.device, self.policy.dtype)

    def rollout_noise(self, total: int, generator: torch.Generator) -> torch.Tensor:
        """x_0 of a rollout of ``total`` rows (whole groups), drawn from ``generator`` after the prompts."""
        g = self.cfg.grpo.group_size
        return initial_noise(total // g, g, self.latent_shape, self.cfg.sampling.same_noise_per_group, generator,
                             torch.float64 if self.policy.dtype == torch.float64 else torch.float32)

    def collect(self, iteration: int, telemetry: tel.Telemetry | None = None) -> Rollout:
        """Rollout, reward, advantages and the trained steps for ``iteration``.

        Under data parallelism the randomness of the whole batch is drawn as one process would and this
        process keeps its share of the groups (:mod:`agg_bench.machine.distributed`); the result is that share.
        """
        cfg = self.cfg
        phase = telemetry.phase if telemetry is not None else (lambda name, **kw: contextlib.nullcontext())
        shard = distributed.current()
        gen, prompts, cond = self.rollout_prompts(iteration)
        total = len(prompts)
        prompts = prompts[shard.rows(total)]
        with phase("rollout"):
            noise = self.rollout_noise(total, gen)
            traj = self.estimator.rollout(distributed.rollout_policy(self.policy, shard, total), cond, noise,
                                          self.sigmas, cfg.sampling, gen, iteration, cfg.grpo.group_size)
            traj = distributed.take_trajectory(traj, shard)
        cond = distributed.take(cond, shard, total)
        with phase("reward"):
            images = self.policy.decode(rewarded_latents(traj, cfg.reward.on))
            # float64: advantages divide by the group's spread, which rounding rewards to float32 would blur
            # a NaN reward (of an image that is not finite) ends the run as diverged, and its NaN advantage keeps the
            # update's step from the weights
            rewards = unscored_if_not_finite(self.reward_fn(images, prompts).detach().to(torch.float64).cpu(), images)
        advantages = self.estimator.advantages(rewards, traj, cfg.grpo).to(self.device)
        train_steps = self.estimator.trained_steps(cfg.train, traj, total, gen)
        train_steps = distributed.take(train_steps, shard, total).to(self.device)
        batch = TrainBatch(
            latents=traj.latents, log_probs=traj.log_probs, sigmas=traj.sigmas.to(self.device),
            timesteps=traj.timesteps, advantages=advantages, train_steps=train_steps, cond=cond,
            sde=cfg.sampling.sde, eta=cfg.sampling.eta, clip_range=cfg.grpo.clip_range, beta=cfg.grpo.beta,
            velocities=traj.velocities, policy_version=traj.policy_version, kl_form=cfg.grpo.kl_form,
            transitions=traj.transitions, forwarded=traj.forwarded,
        )
        return Rollout(batch=batch, prompts=prompts, rewards=rewards)

    # ----- one update ---------------------------------------------------------------------
    def take_in_eval_average(self, times: int) -> None:
        """``times`` updates of the evaluation average (``train.eval_ema``) with the policy's weights, where the
        optimizer steps n taken so far (``policy.version``) qualify, (n + 1) divisible by ``train.eval_ema_every``
        (the public ``update_step_interval``), each with the decay
        :func:`~agg_bench.engine.moving_average.warmup_decay` of n: the public ``EMAModuleWrapper.step(params, n)``
        called ``times`` times."""
        train = self.cfg.train
        n = self.policy.version
        if self.eval_ema is None or train.eval_ema is None or (n + 1) % train.eval_ema_every:
            return
        for _ in range(times):
            self.eval_ema.update(self.policy, warmup_decay(n, train.eval_ema))

    def update(self, batch: TrainBatch) -> dict:
        """``train.inner_epochs`` epochs on one rollout, each an optimizer step per part of the method's
        :meth:`~agg_bench.methods.base.Estimator.update_parts` (by default ``train.minibatches`` mini-batches of
        whole groups or of slices of every group: ``train.minibatch_unit``,
        :func:`agg_bench.engine.grpo.minibatch_rows`), each epoch inside the method's
        :meth:`~agg_bench.methods.base.Estimator.epoch`; learning statistics of them all. ``steps_taken``: the
        optimizer steps it took.

        Each step: zero the gradient, the method's gradient of its mini-batch's loss (the mean over the mini-batch's
        terms), the average over the processes, the clip (unless the part says not: ``clip_gradient``), the
        divergence check, with ``train.eval_ema_updates`` u > 1 the evaluation average's u - 1 updates left of the
        previous step (:meth:`take_in_eval_average`; the weights are still that step's), the optimizer's step, the
        check that it left every trainable parameter finite (else the update ends: ``diverged``), and with
        ``train.eval_ema`` the evaluation average's update. ``loss``, ``clip_frac``, ``approx_kl`` and ``grad_norm`` are the means over
        the steps taken; the update's other statistics (``ratio_dev``) are its first step's. One mini-batch is the
        batch itself, not a copy.
        """
        cfg = self.cfg
        params = self.policy.parameters()
        out: dict = {}
        losses: list[float] = []
        clips: list[float] = []
        kls: list[float] = []
        norms: list[float] = []
        parts = self.estimator.update_parts(batch, cfg.train, cfg.grpo.group_size)
        self.steps_taken = 0
        for _ in range(cfg.train.inner_epochs):
            with self.estimator.epoch():  # the parts of one epoch, in order
                for minibatch in parts:
                    step = self._step(minibatch, params)
                    if isinstance(step, str):
                        out["diverged"] = step
                        break
                    summary, norm = step
                    if not losses:  # the first step's
                        out.update({k: v for k, v in summary.items() if k not in ("loss", "clip_frac", "approx_kl")})
                    losses.append(summary["loss"])
                    clips.append(summary["clip_frac"])
                    kls.append(summary["approx_kl"])
                    norms.append(norm)
            if "diverged" in out:
                break
        mean = lambda xs: sum(xs) / len(xs) if xs else None
        out.update(loss=mean(losses), clip_frac=mean(clips), approx_kl=mean(kls), grad_norm=mean(norms))
        return out

    def release_gradients(self) -> None:
        """Free the gradients of the update that ended, as the authors' trainers do with ``zero_grad`` after the
        optimizer step: the next rollout and its decode do not hold them (the memory planner's phases:
        :data:`agg_bench.runtime.memplan.GRADIENT_PHASES`). An update starts from none either way."""
        self.optimizer.zero_grad(set_to_none=True)

    def _step(self, minibatch: TrainBatch, params: list) -> tuple[dict, float] | str:
        """One optimizer step of :meth:`update` on ``minibatch``: its statistics and the gradient's norm before the
        clip; or, where the gradient or the loss is not finite, which of them (``gradient`` or ``loss``), and no
        step; or, where the step made a trainable parameter not finite, ``parameters after optimizer step k of the
        update`` (the step is taken and counted)."""
        cfg = self.cfg
        self.optimizer.zero_grad(set_to_none=True)
        stats = UpdateStats(cfg.grpo.clip_range)
        with distributed.failures_shared():  # no process enters the all-reduce while another failed
            self.estimator.accumulate(self.policy, minibatch, stats, self.reference)
        # every backward above accumulated locally; one averaging all-reduce per optimizer step
        # (FSDP already averaged each backward's gradients in its reduce-scatter: only the loss is left)
        sharded = fsdp.is_sharded(self.policy)
        (loss,) = distributed.average_gradients([] if sharded else params, stats.loss_sum)
        norm = fsdp.gradient_norm(params)
        if cfg.train.max_grad_norm is not None and minibatch.clip_gradient:
            torch.nn.utils.clip_grad_norm_(params, cfg.train.max_grad_norm)
        # checked before the step, so a non-finite gradient never reaches the weights
        if not torch.isfinite(norm) or not math.isfinite(loss):
            return "gradient" if not torch.isfinite(norm) else "loss"
        # the previous step's other updates, here and not before the gradient: a run stopped in the method's
        # gradient (or failed there) leaves the average as the checkpoint of the last record holds it
        self.take_in_eval_average(cfg.train.eval_ema_updates - 1)
        self.optimizer.step()
        self.steps_taken += 1
        self.policy.version += 1
        # a finite gradient can still blow the weights up (a huge learning rate, an optimizer state that did):
        # caught at this step, not at the next rollout or evaluation, and kept out of the evaluation average
        if not fsdp.parameters_finite(params):
            return f"parameters after optimizer step {self.steps_taken} of the update"
        self.take_in_eval_average(1)
        return stats.as_dict(), float(norm)


def identity(cfg: RunConfig, run_id: str, device: torch.device, world_size: int = 1) -> dict:
    """The identity fields of every record; ``n_gpus`` counts the GPUs of all processes (0 on CPU)."""
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    return {
        "run_id": run_id, "method": cfg.method.name, "model": families.model_label(cfg.model),
        "resolution": cfg.model.resolution, "device": device.type, "gpu_name": gpu,
        "n_gpus": world_size if device.type == "cuda" else 0, "seed": cfg.seed, "weights": weights_label(cfg),
    }


def check_trained_steps(cfg: RunConfig) -> None:
    """Raise the step plan's ConfigError (e.g. ``train.plan_window`` longer than the trajectory) before a
    run writes anything rather than in its first iteration."""
    available = stochastic_steps(cfg.sampling.sde, torch.linspace(1, 0, cfg.sampling.steps + 1))
    draw_plan(cfg.train, 1, available, torch.Generator())


def run_iteration(session: Session, telemetry: tel.Telemetry, iteration: int) -> dict:
    """Train one iteration on every process; the record fields of the whole batch: telemetry, pass
    counts, learning statistics, the method's fields and the reward statistics, the processes'
    shares combined (:func:`agg_bench.machine.distributed.combine`). ``diverged`` is set when the update
    stopped before its optimizer step or after one that left a parameter not finite; ``reward_overflow`` (no
    record key) says why ``reward_mean`` is not finite where every reward is: they are past float32's range."""
    counter = session.policy.counter
    before = counter.copy()
    with telemetry.iteration():
        collected = session.collect(iteration, telemetry)
        stopping.check()  # a signal in the reward phase: before the train phase starts
        before_train = counter.copy()
        # the policy network's saved tensors: what one backward through it holds, whatever the method
        with telemetry.phase("train", saved_activations="regions"):
            learn = session.update(collected.batch)
            session.release_gradients()
    stopping.check()  # the update's record is not written: a checkpoint taken now would not match the records
    # the train phase's own passes, which the cost model prices (the rollout's are the same for most methods)
    train_passes = {f"train_{k}": v for k, v in (counter - before_train).as_dict().items()}
    method = session.estimator.iteration_metrics()
    if session.estimator.records_optimizer_steps():  # the steps taken (fewer than planned where it diverged)
        method["optimizer_steps"] = session.steps_taken
    share = {**telemetry.record(), **(counter - before).as_dict(), **train_passes, **learn, **method,
             **reward_details(session.reward_fn)}
    parts = distributed.gather((share, collected.rewards.tolist(), len(collected.prompts)))
    fields = distributed.combine([p for p, _, _ in parts])
    scored = torch.tensor([r for _, rs, _ in parts for r in rs], dtype=torch.float64)
    rewards = scored.to(torch.float32)
    fields["reward_mean"] = float(rewards.mean())
    fields["reward_std"] = float(rewards.std(unbiased=False))
    if bool(scored.isfinite().all()) and not math.isfinite(fields["reward_mean"]):
        # every reward is a number, but the float32 the statistics are kept in cannot hold their mean
        fields["reward_overflow"] = (f"the rewards are finite, but their mean overflows float32 (largest magnitude "
                                     f"{float(scored.abs().max()):.3g}, float32's limit "
                                     f"{torch.finfo(torch.float32).max:.3g})")
    fields["images_per_s"] = sum(n for _, _, n in parts) / fields["t_iter_s"] if fields.get("t_iter_s") else None
    return fields
