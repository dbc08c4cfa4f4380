"""DGPO: Direct Group Preference Optimization (Luo, Hu and Tang, "Reinforcing Diffusion Models by Direct Group
Preference Optimization", arXiv 2510.08425; public code github.com/Luo-Yihong/DGPO,
``scripts/train_sd3_dgpo.py``: ``compute_group_dgpo_loss_allreduce``, the training loop; ``config/base.py``,
``config/dgpo.py``: defaults).

DGPO has no per-step likelihood. The rollout is deterministic (``sample.noise_level = 0``), ``sampling.steps``
steps, and in the public configs with classifier-free guidance ``sample.guidance_scale = 4.5``:
v = v_u + g (v_c - v_u) from the prompt's (v_c) and the empty prompt's (v_u) velocities, ``rollout_guidance`` here
(1, the default: no guidance; two no-grad forwards per sample and step otherwise, counted and charged). Only each
sample's final latent x0 and its reward are kept.

The sampler (``sampler``). The code replaces the SD3 pipeline's scheduler by Sana's
(``DPMSolverMultistepScheduler.from_pretrained("Efficient-Large-Model/Sana_1600M_1024px_BF16_diffusers",
subfolder="scheduler")`` with ``config['flow_shift'] = 3``: ``use_flow_sigmas``, ``prediction_type =
"flow_prediction"``, ``algorithm_type = "dpmsolver++"``, ``solver_order = 2``, ``solver_type = "midpoint"``,
``lower_order_final``, ``final_sigmas_type = "zero"``) and steps it once per transformer call
(``flow_grpo/diffusers_patch/sd3_pipeline_with_logprob.py``: ``scheduler.step``, the SDE step commented out). ``sana``
is that: the grid of :func:`agg_bench.engine.solvers.flow_dpm_grid` at ``sampling.shift`` (its first sigma below 1,
0.99967 at shift 3, its last 0), the transformer given the scheduler's int64 timesteps trunc(1000 sigma) (the
pipeline's ``t.expand``; SD3's time embedding reads them as floats), and DPM-Solver++(2M) on the grid's sigmas
(``ode_solver("dpm2")``: first order at the first step, whose sigma is below 1, and into 0; one velocity per step).
The code keeps ``pipeline.scheduler.timesteps`` as the samples' ``timesteps`` and trains at
``sigmas_t = t / 1000`` of them, the transformer given ``t``: the noise level of a ``schedule`` time is the timestep
/ 1000 (:meth:`agg_bench.engine.solvers.FlowDPMGrid.noise_levels`), below the grid's sigma by up to 0.001. ``euler``
(the default) is the engine's Euler step on the run's ``sampling.schedule``, the transformer given 1000 sigma and
the training noise level the sigma.

The group preference (the paper's DGPO objective, §3: DPO's Bradley-Terry likelihood between a positive
group G+ and a negative group G- of one prompt's G samples, in place of a pair). A sample belongs to G+ when
its advantage A (GRPO's group-standardised reward, clipped to +-``grpo.adv_clip_max``) is positive and to
G- when negative, with weight |A| (the paper's advantage-based weights, which make the intractable
normalisers of the two groups cancel because sum_G A = 0). The implicit reward of a sample is the
difference of the denoising errors of the policy and the reference at a noised time t: with fresh noise eps,
``x_t = (1 - t) x0 + t eps`` and the flow-matching target ``eps - x0``,

    Delta_i = l_theta(i) - l_ref(i),   l_m(i) = mean (v_m(x_t, t) - (eps - x0))^2   (mean over elements).

The loss of a group g at one time is

    -log sigmoid(z_g),   z_g = -beta / G * (sum_{i in G+} |A_i| Delta_i - sum_{i in G-} |A_i| Delta_i)
                             = -beta / G * sum_{i in g} A_i Delta_i,

(the 1/G is the code's ``per_sample_term = A * beta_dpo * delta / group_size``). Its gradient is
``sigmoid(-z_g) * beta / G * sum_i A_i grad l_theta(i)``: the code's surrogate
``mean_i(w_g A_i l_theta(i))`` with the detached group weight ``w_g = sigmoid(-z_g)`` drops the factor
beta / G, so the loss here is the paper's divided by beta (the gradient's size is independent of beta, as
in the code):

    L = 1 / (K P beta) sum_k sum_g -log sigmoid(z_gk)   (P groups of G, B = P G rows, K times),

whose gradient is ``1/(B K) sum_k sum_i w_gk A_i grad l_theta(i, k)``, what ``accumulate`` adds (the code
averages over the batch, and its gradient accumulation over the K times averages over them). With
``grpo.beta > 0`` the code's KL term ``grpo.beta * mean (v_theta - v_ref)^2`` is added to every (row, time).

The reference. In the code it is the base model (the LoRA adapter disabled), the policy at the start of the
run. Here: the session's reference when ``grpo.beta > 0`` (the same frozen start), otherwise a frozen copy of
the policy (:meth:`agg_bench.engine.models.Policy.frozen_copy`) made when the run is set up
(:meth:`~agg_bench.methods.base.Estimator.set_up`, before a resumed run's checkpoint is loaded, so a resumed run
keeps the starting weights), or at the first rollout of an estimator used without a session. Its velocity at every (row, time) is one no-grad
forward (shared with the KL term); the training forwards are conditional only, as the code's
(``predict_v(..., cfg=False)``; ``kl_cfg = 1``).

The clip (``clip_dsm``, the code's ``config.clip_dsm = True`` with ``config.clip_range``, here ``grpo.clip_range``:
0.01 in its geneval and ocr configs). A PPO-style clip of each sample's matching error against an "old" model,
the code's ``ema_ref``: an :class:`~baselines.final_latent.EMAPolicy` that takes in the weights after every
optimizer step k with the decay ``min(ema_decay_max, ema_decay_rate (k - 1))`` (``min(0.3, 0.001 * global_step)``,
global_step counted before that step). With ``ratio = exp(l_old - l_theta)`` a sample's l_theta is detached
(its gradient dropped, its value kept) where A > 0 and ratio > 1 + eps, or A <= 0 and ratio < 1 - eps. One
no-grad forward of the moving average per (row, time), counted and charged; none while it equals the policy
(the first two iterations: the ratio is then exactly 1 and nothing is clipped). The record's ``clip_frac`` is
the clipped share. ``ema_rollout_after`` (the code's ``switch_ema_ref``, 500 for geneval): after that many
optimizer steps the rollout samples with the moving average's weights (swapped in, as the code swaps them).

The moving average as the DPO reference (``ema_reference``, the code's ``use_ema_ref``: off in ``config/base.py``,
on in ``config/dgpo_wocfg_emaref.py`` with ``clip_dsm``; ``scripts/train_sd3_dgpo.py`` l.1122-1124 hands
``old_v``, the ``ema_ref`` velocity, to ``compute_group_dgpo_loss_allreduce`` in place of the base model's
``ref_old_v``). The implicit reward is then Delta_i = l_theta(i) - l_old(i), the moving average's error at the same
(x_t, t); the KL term keeps the base model (the code's ``kl_loss`` takes ``ref_old_v``). While the average equals
the policy (its first two iterations) its errors are the policy's, every Delta is 0 and w = sigmoid(0) = 1/2, with
no forward. One forward of the average per (row, time) serves the clip and the reference; the starting weights are
then forwarded only for the KL term (``grpo.beta > 0``), and with ``grpo.beta = 0`` no frozen copy is kept. The
code computes ``old_v`` only with ``clip_dsm`` (or its ``clip_kl``, not built); here ``ema_reference`` works
without the clip too.

Passes per iteration: B T rollout forwards (2 B T with guidance); per inner epoch B K forward_grad, B K backward,
B K forward_nograd of the reference (without ``ema_reference``, or with ``grpo.beta > 0``), and B K forward_nograd
of the moving average with ``clip_dsm`` or ``ema_reference`` where it differs from the policy.

The K times per sample (``time_distribution``):
- ``schedule`` (the code): K distinct steps j of the rollout's own schedule among its first
  ``trunc_steps + 1`` (the noisiest; the code's timestep clip ``train_timesteps = range(trunc_steps + 1)``),
  drawn without replacement once for the whole batch (``generate_shared_sampled_timesteps``),
  t = sigma_j (``sampler: sana``: timestep_j / 1000), the model given timestep_j;
- ``uniform``: t ~ U(0, 1) per (sample, slot).
Noise: with ``shared_noise`` (the code's ``use_shared_noise = True``) the G samples of a group share eps at
each time (``generate_shared_noise_for_groups``); otherwise each row draws its own. The steps are drawn in
:meth:`DGPOEstimator.plan` from the iteration's generator, then the seed of a generator that draws the noise
(and uniform times): deterministic given the run's seed, and the same in every inner epoch of a rollout.

``micro_batch`` splits the forwards with grad; the graphs of one time stay alive until its group weights are
known (a weight needs every member's error; the code all-reduces the group sums), then one backward.

The advantages: the geneval config standardises within the group (``sample.global_std = False``), the ocr one
over the batch (True), both with np.std plus 1e-4 (``grpo.adv_eps``). The code steps the optimizer once per epoch,
as here once per iteration: its accelerator accumulates ``gradient_accumulation_steps`` x ``num_train_timesteps``
(batch, time) passes, and the geneval config sets ``gradient_accumulation_steps`` to the epoch's
``num_batches_per_epoch`` ("Update once per epoch"). The EMA of the trained weights that only evaluations use
(``train.ema``: decay 0.9, ``update_step_interval`` 8) is the run keys ``train.eval_ema``,
``train.eval_ema_every`` and ``train.eval_ema_updates`` (the preset's 0.9, 8 and 2). The code calls
``ema.step(params, global_step)`` after every batch of the epoch (``scripts/train_sd3_dgpo.py``, l.1214-1215,
inside ``for i, sample in samples_batched``), ``num_batches_per_epoch`` times (2 in ``geneval_sd3_4gpu``), and its
one optimizer step of the epoch (l.1168-1173, ``sync_gradients`` at the last batch's last time) increments
``global_step`` (l.1210) before the last call: the calls after the first batches see the weights after step n - 1
and the count n - 1, the last the weights after step n and the count n. So the weights of a qualifying step n are
taken in ``num_batches_per_epoch`` times at its decay (d^2 = 0.81 a qualifying step there): once right after the
step, the others after the next rollout and evaluation, before step n + 1; ``train.eval_ema_updates`` does that
(:meth:`agg_bench.runtime.session.Session.take_in_eval_average`). Not ported: LoRA. An ODE rollout from one noise
is one image, so ``sampling.same_noise_per_group`` must be false.

Replay: ``not_applicable``, there is no per-step GRPO gradient to compare.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Literal

import torch

from agg_bench.config.options import Options, batch_option, option
from agg_bench.engine.grpo import micro_batches
from agg_bench.engine.solvers import FlowDPMGrid, flow_dpm_grid, ode_solver
from agg_bench.errors import ConfigError
from agg_bench.methods.base import register_method
from baselines.final_latent import EMAPolicy, FinalLatentEstimator, ema_decay, noised_draws

EMA_AFTER = 1  # the code steps its ema_ref with global_step counted before the step: a first decay of 0



@dataclass
class DGPOConfig(Options):
    """Options of DGPO (defaults from github.com/Luo-Yihong/DGPO ``config/dgpo.py``, ``config/base.py``)."""

    beta: float = option(100.0, "the DPO temperature (`config.train.beta_dpo = 100`, 10 for pickscore)",
                         exclusive_minimum=0, maximum=1e6)
    times_per_sample: int = option(
        4, "K noised copies of each final latent (`config.num_train_timesteps = 4`); at most `trunc_steps + 1` "
        "with the `schedule` distribution and 4 x sampling.steps with `uniform` (each time is a forward and a "
        "backward per sample: `baselines.final_latent.TIMES_PER_STEP`)", minimum=1, maximum=10**9)
    time_distribution: Literal["schedule", "uniform"] = option(
        "schedule", "where t comes from: `schedule` (the code; module docstring) or `uniform`")
    trunc_steps: int = option(
        4, "the schedule's steps 0..trunc_steps are eligible (the timestep clip, t >= sigma_{trunc_steps}; "
        "`config.trunc_steps = 4` for geneval, 6 in `compressibility`); less than sampling.steps",
        minimum=0, maximum=999)
    shared_noise: bool = option(True, "the samples of a group share the noise at a time "
                                      "(`config.use_shared_noise = True`)")
    micro_batch: int | None = batch_option("samples per forward with grad; null: the whole batch")
    clip_dsm: bool = option(False, "the PPO-style clip of each sample's matching error against the moving average, "
                                   "with `grpo.clip_range` (module docstring; the code's `clip_dsm = True`)")
    ema_reference: bool = option(
        False, "the DPO reference is the moving average in place of the starting weights (the code's `use_ema_ref`: "
        "False in `config/base.py`, True in `config/dgpo_wocfg_emaref.py`); the KL term (`grpo.beta`) keeps the "
        "starting weights (module docstring)")
    ema_decay_rate: float = option(0.001, "that moving average's decay grows by this per optimizer step",
                                   minimum=0, maximum=1)
    ema_decay_max: float = option(0.3, "the largest decay of that moving average", minimum=0, maximum=1)
    ema_rollout_after: int | None = option(
        None, "optimizer steps after which the rollout samples with the moving average (null: never; the code's "
        "`switch_ema_ref = 500` for geneval)", minimum=0, maximum=10**9)
    rollout_guidance: float = option(
        1.0, "classifier-free guidance of the rollout (1.0: none; the code's `sample.guidance_scale = 4.5`)",
        minimum=1, maximum=100)
    sampler: Literal["euler", "sana"] = option(
        "euler", "the ODE rollout's sampler: `euler`, the Euler step on the run's schedule; or `sana`, the code's "
        "`DPMSolverMultistepScheduler` of Sana's config at flow_shift `sampling.shift` (a number): DPM-Solver++(2M) "
        "on its `use_flow_sigmas` grid in place of `sampling.schedule`'s, the transformer given the integer "
        "timesteps trunc(1000 sigma), and the `schedule` times' noise level timestep / 1000 (module docstring)")

    def check(self) -> None:
        if self.time_distribution == "schedule" and self.times_per_sample > self.trunc_steps + 1:
            raise ConfigError("method.times_per_sample", self.times_per_sample,
                              f"an integer in [1, {self.trunc_steps + 1}] (method.trunc_steps + 1; distinct steps "
                              "of the schedule with method.time_distribution=schedule)")


def group_weights(advantages: torch.Tensor, delta: torch.Tensor, group_size: int, beta: float) -> torch.Tensor:
    """w (B,): sigmoid(beta / G * sum_{j in g} A_j Delta_j) of each row's group g (rows grouped consecutively)."""
    sums = (advantages * delta).view(-1, group_size).sum(dim=1)
    return torch.sigmoid(beta / group_size * sums).repeat_interleave(group_size)


@register_method
class DGPOEstimator(FinalLatentEstimator):
    """Group DPO on flow-matching errors of each final latent at K noised times, against a frozen reference."""

    name = "dgpo"
    config_cls = DGPOConfig
    config: DGPOConfig
    paper, trains = "DGPO", "a group preference loss on flow-matching errors of final latents"
    draws_step_order = True  # the batch's K shared steps in torch.randperm's order, its noises drawn in that order

    def __init__(self, config: DGPOConfig | None = None):
        super().__init__(config)
        self.group_size = 1
        self.frozen = None  # the reference when the session has none (grpo.beta = 0)
        self.own_reference = True
        self.clip_range = 0.0
        self.ema: EMAPolicy | None = None  # the code's ema_ref: clip_dsm's old model, the late rollouts' sampler
        self.grid: FlowDPMGrid | None = None  # sampler sana's grid and timesteps (check_run)

    def set_up(self, policy) -> None:
        """The own reference from the starting weights: a resumed run's first rollout holds the checkpoint's."""
        if self.own_reference:
            self.frozen = policy.frozen_copy()

    def keeps_reference(self, cfg) -> bool:
        # its DPO reference: the session's with grpo.beta, else its own frozen copy; none with ema_reference
        return not cfg.grpo.beta > 0 and not self.config.ema_reference

    def moving_average(self) -> str | None:
        c = self.config
        for name in ("clip_dsm", "ema_reference"):
            if getattr(c, name):
                return name
        return "ema_rollout_after" if c.ema_rollout_after is not None else None

    def needs_unconditional(self) -> bool:
        return self.config.rollout_guidance != 1

    def take_in(self, policy) -> None:
        """The moving average made, or updated with the optimizer steps taken since it last was (one per
        inner epoch: this runs before each)."""
        c = self.config
        if self.moving_average() is None:
            return
        if self.ema is None:
            self.ema = EMAPolicy(policy)
        elif policy.version != self.ema.steps:
            self.ema.update(policy, ema_decay(policy.version, c.ema_decay_rate, c.ema_decay_max, EMA_AFTER))

    def check_run(self, cfg) -> None:
        super().check_run(cfg)
        c = self.config
        self.group_size = cfg.grpo.group_size
        self.own_reference = self.keeps_reference(cfg)
        self.clip_range = cfg.grpo.clip_range
        if c.time_distribution == "schedule" and c.trunc_steps >= cfg.sampling.steps:
            raise ConfigError("method.trunc_steps", c.trunc_steps,
                              f"an integer in [0, {cfg.sampling.steps - 1}] (below sampling.steps)")
        if c.sampler == "sana":
            if cfg.sampling.shift is None:
                raise ConfigError("sampling.shift", None, "a number with method.sampler=sana (the scheduler's "
                                                          "flow_shift; the code sets 3)")
            if cfg.sampling.schedule != "diffusers":
                raise ConfigError("sampling.schedule", cfg.sampling.schedule,
                                  "'diffusers' with method.sampler=sana (its rollout and its times are on the "
                                  "scheduler's own grid, so another schedule would change nothing)")
            self.grid = flow_dpm_grid(cfg.sampling.steps, cfg.sampling.shift)

    def rollout(self, policy, cond, noise, sigmas, sampling, generator, iteration, group_size):
        """The ODE rollout, with classifier-free guidance where asked, by the moving average's weights after
        ``ema_rollout_after`` optimizer steps."""
        c = self.config
        self.group_size = group_size
        if self.own_reference and self.frozen is None:
            self.frozen = policy.frozen_copy()
        self.take_in(policy)
        late = c.ema_rollout_after is not None and policy.version > c.ema_rollout_after
        weights = self.average().weights_in(policy) if late and not self.average().equals(policy) else \
            contextlib.nullcontext(policy)
        with weights as sampler:
            return self.ode_rollout(sampler, cond, noise, sigmas, sampling, generator, iteration)

    def rollout_timesteps(self, policy, sigmas):
        """With ``sampler: sana``, the scheduler's integer timesteps of its grid in the model's scale."""
        if self.config.sampler == "sana" and self.grid is not None:
            return self.grid.model_timesteps(policy.timestep_scale)
        return super().rollout_timesteps(policy, sigmas)

    def ode_rollout(self, policy, cond, noise, sigmas, sampling, generator, iteration):
        """The ODE rollout: Euler on the run's ``sigmas``, or with ``sampler: sana`` DPM-Solver++(2M) on the
        scheduler's grid at its integer timesteps; guided where ``rollout_guidance`` > 1."""
        from agg_bench.engine.rollout import rollout  # the rollout imports the models; a method's options do not

        velocity = None if self.config.rollout_guidance == 1 else self.guided_velocity(policy)
        ode, timesteps = None, None
        if self.config.sampler == "sana":
            if self.grid is None:
                raise RuntimeError("method 'dgpo' with sampler 'sana' samples on the grid its check_run makes")
            sigmas = self.grid.sigmas
            timesteps = self.rollout_timesteps(policy, sigmas)
            ode = ode_solver("dpm2", sigmas)
        mask = self.sde_mask(iteration, sigmas.numel() - 1, generator)
        return rollout(policy, cond, noise, sigmas, sampling.sde, sampling.eta, generator, mask, velocity=velocity,
                       ode=ode, timesteps=timesteps)

    def guided_velocity(self, policy):
        """v = v_u + g (v_c - v_u): per step a forward on the prompts and one on the empty prompt (two calls,
        each of the whole batch)."""
        if self.unconditional is None:
            raise RuntimeError("method 'dgpo' with rollout_guidance needs the empty prompt's conditioning")
        g = self.config.rollout_guidance
        unconditional = self.unconditional

        def guided(j, x, timesteps, cond_):
            empty = unconditional.to(x.device).repeat_interleave(x.shape[0])
            v_c = policy.velocity(x, timesteps, cond_)
            v_u = policy.velocity(x, timesteps, empty)
            return v_u + g * (v_c - v_u)

        return guided

    def trained_steps(self, train, trajectory, batch_size, generator):
        """(B, K): the K schedule steps shared by the batch (``schedule``) or the slots 0..K-1 (``uniform``);
        the seed of the noise generator is drawn after them."""
        k = self.config.times_per_sample
        if self.config.time_distribution == "schedule":
            planned = torch.randperm(self.config.trunc_steps + 1, generator=generator)[:k].expand(batch_size, k)
        else:
            planned = torch.arange(k).expand(batch_size, k)
        self.draw_noise_seed(generator)
        return planned.clone()

    def draws(self, policy, batch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """eps (B, K, ...), t (B, K) and the model's timesteps (B, K) of every (sample, slot); with ``sampler:
        sana`` a schedule step's t is its timestep / 1000, as the code's ``sigmas_t = t / 1000``."""
        c = self.config
        eps, t, timesteps = noised_draws(policy, batch, self.noise_seed, c.time_distribution,
                                         self.group_size if c.shared_noise else None)
        if c.sampler == "sana" and c.time_distribution == "schedule":
            assert self.grid is not None  # check_run made sampler sana's grid
            t = self.grid.noise_levels(t.dtype).to(t.device)[batch.train_steps.to(t.device)]
        return eps, t, timesteps

    def accumulate(self, policy, batch, stats, reference=None):
        c = self.config
        kl_beta = batch.beta if reference is not None else 0.0
        ref = reference if reference is not None else self.frozen
        if ref is None and not c.ema_reference:
            raise RuntimeError("method 'dgpo' needs a reference policy: none was passed and no rollout made one")
        x0 = batch.latents[:, -1]
        b, k = batch.train_steps.shape
        dims = tuple(range(1, x0.dim()))
        eps, t, timesteps = self.draws(policy, batch)
        a = batch.advantages.to(x0.dtype)
        self.take_in(policy)
        # while the moving average is the policy its errors are the policy's: the ratio is exactly 1, nothing to
        # clip, the implicit rewards against it 0, nothing to forward
        old = self.average().policy if (c.clip_dsm or c.ema_reference) and not self.average().equals(policy) \
            else None
        for slot in range(k):
            errors, ref_errors, kls, old_errors = [], [], [], []
            for rows in micro_batches(b, c.micro_batch):
                te = t[rows, slot].view(-1, *([1] * (x0.dim() - 1)))
                x_t = (1 - te) * x0[rows] + te * eps[rows, slot]
                target = eps[rows, slot] - x0[rows]
                cond = batch.cond[rows]
                v_ref = None
                if ref is not None and (not c.ema_reference or kl_beta > 0):  # one forward for both terms
                    with torch.no_grad():
                        v_ref = ref.velocity(x_t, timesteps[rows, slot], cond).to(x0.dtype)
                    ref_errors.append(((v_ref - target) ** 2).mean(dim=dims))
                v = policy.velocity(x_t, timesteps[rows, slot], cond).to(x0.dtype)
                errors.append(((v - target) ** 2).mean(dim=dims))
                if kl_beta > 0 and v_ref is not None:
                    kls.append(kl_beta * ((v - v_ref) ** 2).mean(dim=dims))
                if old is not None:
                    with torch.no_grad():
                        v_old = old.velocity(x_t, timesteps[rows, slot], cond).to(x0.dtype)
                    old_errors.append(((v_old - target) ** 2).mean(dim=dims))
            error = torch.cat(errors)
            if c.ema_reference:  # the code's use_ema_ref: the moving average's errors (the policy's while it is it)
                ref_error = torch.cat(old_errors) if old_errors else error.detach()
            else:
                ref_error = torch.cat(ref_errors)
            w = group_weights(a, error.detach() - ref_error, self.group_size, c.beta)
            trained = error
            if old_errors and c.clip_dsm:
                ratio = torch.exp(torch.cat(old_errors) - error.detach())
                clipped = torch.where(a > 0, ratio > 1 + self.clip_range, ratio < 1 - self.clip_range)
                trained = torch.where(clipped, error.detach(), error)
                stats.clipped += int(clipped.sum())
            terms = w * a * trained
            if kls:
                terms = terms + torch.cat(kls)
            (terms.sum() * batch.loss_scale).backward()
            # the loss value: the paper's per-group -log sigmoid(z) / beta, spread over its G rows
            z = -c.beta / self.group_size * (a * (error.detach() - ref_error)).view(-1, self.group_size).sum(1)
            value = -torch.nn.functional.logsigmoid(z) / c.beta
            stats.loss_sum += float(value.double().sum()) * self.group_size * batch.loss_scale
            if kls:
                stats.loss_sum += float(torch.cat(kls).detach().double().sum()) * batch.loss_scale
            stats.count += b
