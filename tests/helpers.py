"""Shared test helpers: small configs and one-graph reference gradients."""
from __future__ import annotations

import torch

from agg_bench.config import load_config
from agg_bench.grpo import TrainBatch, step_terms

TINY = [
    "model.resolution=32", "sampling.steps=6", "grpo.group_size=3", "grpo.prompts_per_iteration=2",
    "train.iterations=2", "progress=false", "telemetry.enabled=false",
]


def tiny_config(*overrides: str, family: str = "sd3", dtype: str = "float64"):
    return load_config(None, [*TINY, f"model.family={family}", f"model.dtype={dtype}", *overrides])


def one_graph_gradient(policy, batch: TrainBatch) -> dict[str, torch.Tensor]:
    """d L / d theta with L built as a single autograd graph over every (sample, step) term."""
    params = [p for _, p in policy.named_parameters()]
    total = 0
    b = batch.batch_size
    for i in range(b):
        rows = torch.tensor([i])
        for j in batch.train_steps[i].tolist():
            steps = torch.tensor([j])
            v = policy.velocity(batch.states(rows, steps), batch.timestep_values(steps), batch.cond[rows])
            total = total + step_terms(batch, rows, steps, v).loss.sum()
    grads = torch.autograd.grad(total * batch.loss_scale, params)
    return {n: g for (n, _), g in zip(policy.named_parameters(), grads)}


def relative_error(a: dict, b: dict) -> float:
    num = sum(float((a[k].double() - b[k].double()).pow(2).sum()) for k in a)
    den = sum(float(b[k].double().pow(2).sum()) for k in b)
    return (num / den) ** 0.5
