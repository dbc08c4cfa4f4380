"""Full-trajectory GRPO (Flow-GRPO / DanceGRPO): one forward-with-grad and one backward through the
DiT for every trained step of every sample."""
from __future__ import annotations

from dataclasses import dataclass

from agg_bench.config.options import Options, batch_option
from agg_bench.engine.grpo import exact_backward, micro_batches
from agg_bench.methods.base import Estimator, register_method

__all__ = ["FullConfig", "FullEstimator", "exact_backward"]  # exact_backward lives in agg_bench.engine.grpo


@dataclass
class FullConfig(Options):
    """Options of full-trajectory GRPO."""

    micro_batch: int | None = batch_option("samples per forward-with-grad; null: the whole batch")


@register_method
class FullEstimator(Estimator):
    name = "full"
    config_cls = FullConfig
    config: FullConfig

    def accumulate(self, policy, batch, stats, reference=None):
        for n in range(batch.steps_per_sample):
            for rows in micro_batches(batch.batch_size, self.config.micro_batch):
                exact_backward(policy, batch, rows, batch.train_steps[rows, n], stats, reference)
