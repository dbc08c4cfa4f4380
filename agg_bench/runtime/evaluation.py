"""The held-out evaluation: how good a policy's samples are, on noise no rollout drew.

:class:`Evaluation` samples every caption of a run's prompt file x ``noises`` fixed noises (seeded by
``seed``: identical for every method, seed and model state) with the run's step count, schedule and SDE,
and scores the images with the run's reward and its sub-scores. ``sampler``: ``sde`` (the rollouts' own
SDE and eta, :func:`~agg_bench.engine.rollout.rollout`, its step noise drawn from the same seeded generator
for every state) or ``ode`` (the deterministic Euler sampler: the same rollout with every step an ODE
step). Either way a model state's score depends on its weights alone, so the starting weights' score is
one number shared by every run and a run's gain differs from another's only by what training did.

Two callers: a run evaluates its own policy every ``eval.every`` iterations (:mod:`agg_bench.runtime.train`,
:meth:`Evaluation.of_session`), and ``agg-bench learning`` evaluates the starting weights and each run's
final checkpoint (:mod:`agg_bench.tools.learning`). Neither is charged to the run: the evaluation calls
the policy through its own pass counter (the run's counter, and with it the run's ``cost``, never sees
it) and draws from its own generator (the run's global and per-iteration random streams never see it).
The whole evaluation is one batch (captions x noises), as the learning testbed's 4 x 16 is small.
"""
from __future__ import annotations

import copy
from typing import TYPE_CHECKING

import numpy as np
import torch

from ..engine.counters import PassCounter
from ..engine.models import Conditioning, Policy
from ..engine.rewards import RewardFn
from ..engine.rollout import rollout
from ..errors import UserError

if TYPE_CHECKING:
    from .session import Session

SAMPLERS = ("ode", "sde")


class Evaluation:
    """The held-out evaluation of ``policy``'s current weights (module docstring): ``prompts`` and their
    conditioning ``cond_all`` (one row per prompt), the latents' ``latent_shape``, the run's ``sigmas``,
    SDE ``sde`` and ``eta``, the run's ``reward``, ``noises`` per caption, the noise ``seed`` and the
    ``sampler``. ``captions`` lists the evaluated images' captions, noise-major: the first
    ``len(prompts)`` images are every caption with the first noise."""

    def __init__(self, policy: Policy, prompts: list[str], cond_all: Conditioning, latent_shape: tuple[int, ...],
                 sigmas: torch.Tensor, sde: str, eta: float, reward: RewardFn, noises: int = 16, seed: int = 0,
                 sampler: str = "sde"):
        if sampler not in SAMPLERS:
            raise UserError(f"evaluation sampler {sampler!r}: expected one of {', '.join(SAMPLERS)}")
        # the same modules through a counter of its own: the run's counter (its cost) never sees the evaluation
        self.policy = copy.copy(policy)
        self.policy.counter = PassCounter()
        index = [i for _ in range(noises) for i in range(len(prompts))]
        self.captions = [prompts[i] for i in index]
        self.cond = cond_all[index]
        self.latent_shape, self.sigmas, self.sde, self.eta = latent_shape, sigmas, sde, eta
        self.reward, self.noises, self.seed, self.sampler = reward, noises, seed, sampler

    @classmethod
    def of_session(cls, session: "Session") -> "Evaluation":
        """The evaluation a run's ``eval`` section asks for, of the session's policy, prompts, schedule and
        reward."""
        cfg = session.cfg
        return cls(session.policy, session.prompts, session.cond_all, session.latent_shape, session.sigmas,
                   cfg.sampling.sde, cfg.sampling.eta, session.reward_fn, cfg.eval.noises, cfg.eval.seed,
                   cfg.eval.sampler)

    def images(self) -> torch.Tensor:
        """Images (B, 3, H, W) in [0, 1] of the policy's current weights, from the fixed noise (on the
        policy's device, where the run's reward takes them)."""
        policy = self.policy
        generator = torch.Generator().manual_seed(self.seed)
        dtype = torch.float64 if policy.dtype == torch.float64 else torch.float32
        noise = torch.randn((self.cond.batch_size, *self.latent_shape), generator=generator, dtype=dtype)
        steps = self.sigmas.numel() - 1
        mask = None if self.sampler == "sde" else torch.zeros(steps, dtype=torch.bool)
        cond = self.cond.to(policy.device, policy.dtype)
        latents = rollout(policy, cond, noise, self.sigmas, self.sde, self.eta, generator, sde_mask=mask).latents
        return policy.decode(latents[:, -1].float())

    def score(self, images: torch.Tensor) -> dict[str, np.ndarray]:
        """Per-image reward (``reward``) and the reward's sub-scores (``reward_color`` ...) of ``images``."""
        total = self.reward(images, self.captions)
        details = getattr(self.reward, "details", {})
        return {"reward": total.detach().float().cpu().numpy(),
                **{k: v.detach().float().cpu().numpy() for k, v in details.items()}}

    def means(self, images: torch.Tensor) -> dict[str, float]:
        """The evaluation's numbers of ``images``: ``eval_reward`` and ``eval_<sub-score>``, means over the
        images."""
        return {f"eval_{k}": float(v.mean()) for k, v in self.score(images).items()}
