"""Full-trajectory GRPO (Flow-GRPO / DanceGRPO): one forward-with-grad and one backward through the
DiT for every trained step of every sample."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from agg_bench.grpo import TrainBatch, UpdateStats, micro_batches, step_terms
from agg_bench.methods import Estimator, register_method
from agg_bench.models import Policy


@dataclass
class FullConfig:
    """``micro_batch``: samples per forward-with-grad (None: the whole batch)."""

    micro_batch: int | None = None


def exact_backward(policy: Policy, batch: TrainBatch, rows: torch.Tensor, steps: torch.Tensor,
                   stats: UpdateStats, reference: Policy | None = None) -> None:
    """Exact gradient of the (row, step) terms: forward with grad at x_j, loss, backward."""
    ref_v = None
    if batch.beta > 0 and reference is not None:
        with torch.no_grad():
            ref_v = reference.velocity(batch.states(rows, steps), batch.timestep_values(steps), batch.cond[rows])
    v = policy.velocity(batch.states(rows, steps), batch.timestep_values(steps), batch.cond[rows])
    terms = step_terms(batch, rows, steps, v, ref_v)
    (terms.loss.sum() * batch.loss_scale).backward()
    stats.add(terms, batch.log_probs[rows, steps], batch.loss_scale)


@register_method
class FullEstimator(Estimator):
    name = "full"
    config_cls = FullConfig

    def accumulate(self, policy, batch, stats, reference=None):
        for n in range(batch.steps_per_sample):
            for rows in micro_batches(batch.batch_size, self.config.micro_batch):
                exact_backward(policy, batch, rows, batch.train_steps[rows, n], stats, reference)
