"""The policy's pass counter against the work actually done: every method's iterations on the tiny model with the
transformer's real calls observed by a forward hook on the module itself (no-grad forwards, forwards with grad,
and the backwards that reach their outputs), beside the VAE decodes and the reward calls. A pass made outside
``Policy.velocity`` (a reference, old or moving-average policy's forward, a guidance branch, a cache's extra
call, a recomputation) or counted without being made shows here as a difference."""
from __future__ import annotations

import collections
import contextlib

import pytest
import torch

from agg_bench.runtime.session import Session
from helpers import counted, tiny_config

ODE = "sampling.same_noise_per_group=false"
CASES = {
    "full": ["method.name=full", "grpo.beta=0.04"],
    "full-cps": ["method.name=full", "sampling.sde=cps_unscaled"],
    "fraction": ["method.name=fraction", "train.timestep_fraction=0.5"],
    "window": ["method.name=window"],
    "mixgrpo_flash": ["method.name=mixgrpo_flash"],
    "agg": ["method.name=agg", "grpo.beta=0.04"],
    "agg-endpoints": ["method.name=agg", "method.endpoint_velocity=reuse"],
    "agg-route": ["method.name=agg", "method.route_frac=0.5"],
    "agg-reuse-minibatches": ["method.name=agg", "method.reuse_rollout_velocity=true", "train.minibatches=2"],
    "guess": ["method.name=guess"],
    "branch": ["method.name=branch", "grpo.group_size=8", "grpo.prompts_per_iteration=1"],
    "nft": ["method.name=nft", ODE, "grpo.beta=0.01", "method.old_decay_rate=0.001"],
    "awm": ["method.name=awm", ODE, "method.ema_kl_beta=1"],
    "dgpo": ["method.name=dgpo", ODE, "method.rollout_guidance=4.5", "method.clip_dsm=true"],
    "cached-rollout": ["method.name=cached", "method.cache=fora", "method.cache_in=rollout"],
    "cached-both": ["method.name=cached", "method.cache=teacache", "method.cache_in=both", "grpo.beta=0.04"],
}


@contextlib.contextmanager
def observed_work(session):
    """Counts of what the transformer (any copy of it: a reference, an old or averaged policy), the VAE decode and
    the reward really did inside the block, per sample (``fn``, ``fg``, ``bw``) and per call (``*_calls``)."""
    work: collections.Counter = collections.Counter()
    kind = type(session.policy.transformer)

    def hook(module, args, output):
        if type(module) is not kind:
            return
        out = output[0] if isinstance(output, (tuple, list)) else output
        b = out.shape[0]
        if torch.is_grad_enabled() and out.requires_grad:
            work["fg"] += b
            work["fg_calls"] += 1

            def backward(grad):
                work["bw"] += grad.shape[0]
                work["bw_calls"] += 1
            out.register_hook(backward)
        else:
            work["fn"] += b
            work["fn_calls"] += 1

    policy, reward_fn = session.policy, session.reward_fn
    decode = policy.decode

    def counted_decode(latents):
        work["decoded"] += latents.shape[0]
        return decode(latents)

    def counted_reward(images, prompts):
        work["rewarded"] += images.shape[0]
        return reward_fn(images, prompts)

    handle = torch.nn.modules.module.register_module_forward_hook(hook)
    policy.decode, session.reward_fn = counted_decode, counted_reward
    try:
        yield work
    finally:
        handle.remove()
        del policy.decode
        session.reward_fn = reward_fn


@pytest.mark.parametrize("case", sorted(CASES))
def test_counted_passes_are_the_transformers_real_calls(case):
    session = Session(tiny_config(*CASES[case], "model.dtype=float32"))
    # the moving averages differ from the policy from the 2nd iteration on (DGPO's clip average from the 3rd)
    for iteration in range(3 if case == "dgpo" else 2):
        with observed_work(session) as work, counted(session.policy) as passes:
            batch = session.collect(iteration).batch
            session.update(batch)
        real = {"forward_nograd": work["fn"], "forward_grad": work["fg"], "backward": work["bw"]}
        real_calls = {"forward_nograd": work["fn_calls"], "forward_grad": work["fg_calls"],
                      "backward": work["bw_calls"]}
        assert passes.as_dict() == real, (case, iteration)
        assert passes.calls() == real_calls, (case, iteration)
        # one decode and one reward of the rollout's final images, whatever the method: none of an intermediate state
        leaves = session.cfg.grpo.group_size * session.cfg.grpo.prompts_per_iteration
        assert (work["decoded"], work["rewarded"]) == (leaves, leaves), (case, iteration)
