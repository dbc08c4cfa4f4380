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
The images are sampled ``batch_size`` at a time (``eval.batch_size``, default 64), noise-major: chunk k
holds images k x batch_size onwards, conditioned on their captions' rows only, and draws its initial noise
and then its SDE step noise from a generator of its own, the first chunk's seeded with ``seed``, chunk k's
with a seed derived from (``seed``, k). Memory is one chunk's trajectory whatever the prompt file and
``noises``; an evaluation of at most ``batch_size`` images (the learning testbed's 4 captions x 16) is one
chunk, sampled exactly as one batch from ``seed``. Only the per-image scores and, on request, the first
images are kept.
"""
from __future__ import annotations

import copy
from typing import TYPE_CHECKING

import numpy as np
import torch

from ..engine.counters import PassCounter
from ..engine.models import Conditioning, Policy
from ..engine.rewards import RewardFn, unscored_if_not_finite
from ..engine.rollout import rollout
from ..config.sections import SAMPLERS
from ..errors import UserError
from ..records import is_recordable_number

if TYPE_CHECKING:
    from .session import Session



def non_finite_key(means: dict[str, float]) -> str | None:
    """The first of an evaluation's means (``eval_reward`` and every ``eval_<sub-score>``) that is no finite
    number within the record contract's :data:`~agg_bench.records.MAX_MAGNITUDE`, or None: a mean is NaN where
    any image's score is, and a line or table holding it is one no reader takes back."""
    return next((key for key, value in means.items() if not is_recordable_number(value)), None)


class Evaluation:
    """The held-out evaluation of ``policy``'s current weights (module docstring): ``prompts`` and their
    conditioning ``cond_all`` (one row per prompt), the latents' ``latent_shape``, the run's ``sigmas``,
    SDE ``sde`` and ``eta``, the run's ``reward``, ``noises`` per caption, the noise ``seed`` and the
    ``sampler``. ``captions`` lists the evaluated images' captions, noise-major: the first
    ``len(prompts)`` images are every caption with the first noise."""

    def __init__(self, policy: Policy, prompts: list[str], cond_all: Conditioning, latent_shape: tuple[int, ...],
                 sigmas: torch.Tensor, sde: str, eta: float, reward: RewardFn, noises: int = 16, seed: int = 0,
                 sampler: str = "sde", batch_size: int = 64):
        if sampler not in SAMPLERS:
            raise UserError(f"evaluation sampler {sampler!r}: expected one of {', '.join(SAMPLERS)}")
        if batch_size < 1:
            raise UserError(f"evaluation batch size {batch_size}: expected an integer >= 1")
        # the same modules through a counter of its own: the run's counter (its cost) never sees the evaluation
        self.policy = copy.copy(policy)
        self.policy.counter = PassCounter()
        self.index = [i for _ in range(noises) for i in range(len(prompts))]
        self.captions = [prompts[i] for i in self.index]
        self.cond_all = cond_all
        self.latent_shape, self.sigmas, self.sde, self.eta = latent_shape, sigmas, sde, eta
        self.reward, self.noises, self.seed, self.sampler = reward, noises, seed, sampler
        self.batch_size = batch_size

    @classmethod
    def of_session(cls, session: "Session") -> "Evaluation":
        """The evaluation a run's ``eval`` section asks for, of the session's policy, prompts, schedule and
        reward."""
        cfg = session.cfg
        return cls(session.policy, session.prompts, session.cond_all, session.latent_shape, session.sigmas,
                   cfg.sampling.sde, cfg.sampling.eta, session.reward_fn, cfg.eval.noises, cfg.eval.seed,
                   cfg.eval.sampler, cfg.eval.batch_size)

    def chunks(self) -> list[slice]:
        """The images of each sampling call, in order (module docstring)."""
        n = len(self.index)
        return [slice(start, min(start + self.batch_size, n)) for start in range(0, n, self.batch_size)]

    def chunk_generator(self, k: int) -> torch.Generator:
        """Chunk ``k``'s generator: seeded with ``seed`` for the first, else with a seed derived from
        (``seed``, k) (independent streams, none another evaluation seed's first)."""
        if k == 0:
            return torch.Generator().manual_seed(self.seed)
        return torch.Generator().manual_seed(int(np.random.SeedSequence([self.seed, k]).generate_state(1)[0]))

    def sample(self, k: int) -> torch.Tensor:
        """Images (b, 3, H, W) in [0, 1] of chunk ``k`` of the policy's current weights (on the policy's
        device, where the run's reward takes them)."""
        policy, rows = self.policy, self.chunks()[k]
        generator = self.chunk_generator(k)
        dtype = torch.float64 if policy.dtype == torch.float64 else torch.float32
        cond = self.cond_all[self.index[rows]]
        noise = torch.randn((cond.batch_size, *self.latent_shape), generator=generator, dtype=dtype)
        steps = self.sigmas.numel() - 1
        mask = None if self.sampler == "sde" else torch.zeros(steps, dtype=torch.bool)
        cond = cond.to(policy.device, policy.dtype)
        latents = rollout(policy, cond, noise, self.sigmas, self.sde, self.eta, generator, sde_mask=mask).latents
        return policy.decode(latents[:, -1].float())

    def score(self, images: torch.Tensor, captions: list[str]) -> dict[str, np.ndarray]:
        """Per-image reward (``reward``) and the reward's sub-scores (``reward_color`` ...) of ``images``."""
        total = self.reward(images, captions)
        details = getattr(self.reward, "details", {})
        return {k: unscored_if_not_finite(v.detach().float().cpu(), images).numpy()
                for k, v in {"reward": total, **details}.items()}

    def evaluate(self, keep: int = 0) -> tuple[dict[str, float], torch.Tensor]:
        """The evaluation of the policy's current weights: ``eval_reward`` and ``eval_<sub-score>``, means
        over every image, and the first ``keep`` images (on the CPU), chunk by chunk."""
        scores: dict[str, list[np.ndarray]] = {}
        kept = []
        for k, rows in enumerate(self.chunks()):
            images = self.sample(k)
            for key, values in self.score(images, self.captions[rows]).items():
                scores.setdefault(key, []).append(values)
            if rows.start < keep:
                kept.append(images[:keep - rows.start].cpu())
        means = {f"eval_{k}": float(np.concatenate(v).mean()) for k, v in scores.items()}
        return means, torch.cat(kept) if kept else torch.zeros(0)
