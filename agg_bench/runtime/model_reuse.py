"""One model for the runs of a process: a cell job builds its model once and every run starts from it.

The runs of a cell job share the model configuration (one model x resolution x device), so they would
build the same transformer and VAE again and again: seconds for a full-size architecture on a GPU, the
seeded random initialisation and the host-to-device copies included. Inside :func:`reusing_models`,
:meth:`agg_bench.runtime.session.Session` asks :func:`policy_for` for its policy: the first run builds it
(:func:`agg_bench.engine.models.build_policy`) and a copy of its trainable parameters is kept in host
memory; a later run with the same build key (:func:`build_key`: the model section, the seed, the device,
gradient checkpointing and the LoRA adapters) gets the same modules back in the state the build left
them in: every trainable parameter copied back from that copy, no gradients, every module's train/eval
flag and ``requires_grad`` as built, and the global random generators (CPU and CUDA) in the state the
build left them, so that nothing a run draws afterwards differs. Its records then equal those of a run
that built its own model, in every non-timing field (``tests/integration/test_cell.py`` compares them, LoRA, a KL
reference and an inference cache's hooks included).

A policy is built anew, and the kept one dropped first (one model in memory at a time), when the key
differs, when the run shards the model (``train.shard: fsdp`` rewrites the modules in place), or when
the modules do not look as they were built: a forward hook or pre-hook added and not removed, or
diffusers' hook registry left behind by a method that did not close (:func:`_module_state`).
Outside :func:`reusing_models` nothing is kept and :func:`policy_for` is ``build_policy``.
"""
from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass
from typing import Iterator

import torch

from ..config import RunConfig
from ..engine.models import Policy, build_policy, folder_identity
from ..machine import fsdp


def build_key(cfg: RunConfig, device: torch.device) -> str:
    """What a built policy depends on: runs with equal keys build equal modules. A model folder replaced since
    (``agg-bench pretrain`` again) is another key: its path alone would keep the earlier model for its runs."""
    train = cfg.train
    return json.dumps({"model": cfg.model.to_dict(), "folder": folder_identity(cfg.model.pretrained),
                       "seed": cfg.seed, "device": str(device),
                       "gradient_checkpointing": train.gradient_checkpointing, "lora_rank": train.lora_rank,
                       "lora_alpha": train.lora_alpha, "lora_target_modules": train.lora_target_modules},
                      sort_keys=True)


def _module_state(module: torch.nn.Module) -> tuple:
    """Per submodule: its train flag, its counts of hooks, and whether diffusers' hook registry or a
    replaced ``forward`` is attached (a method's inference cache installs both and removes them on close)."""
    return tuple((m.training, len(m._forward_hooks), len(m._forward_pre_hooks), len(m._backward_hooks),
                  getattr(m, "_diffusers_hook", None) is not None, "forward" in m.__dict__)
                 for m in module.modules())


def _rng_state() -> tuple:
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    return torch.random.get_rng_state(), cuda


def _set_rng_state(state: tuple) -> None:
    cpu, cuda = state
    torch.random.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state_all(cuda)


@dataclass
class _Built:
    """A built policy's modules and what a run needs to start from them as built."""

    key: str
    policy: Policy
    trainable: dict[str, torch.Tensor]  # parameter name -> its values as built, in host memory
    requires_grad: dict[str, bool]
    modules: tuple
    rng: tuple

    @classmethod
    def keep(cls, key: str, policy: Policy) -> "_Built":
        named = list(policy.transformer.named_parameters())
        trainable = {name: p.detach().to("cpu", copy=True) for name, p in named if p.requires_grad}
        return cls(key, policy, trainable, {name: p.requires_grad for name, p in named},
                   _module_state(policy.transformer), _rng_state())

    def unchanged(self) -> bool:
        """Whether the modules still look as built (hooks, flags), so that restoring the weights suffices."""
        return _module_state(self.policy.transformer) == self.modules

    @torch.no_grad()
    def restored(self) -> Policy:
        """A fresh policy around the kept modules, every trainable parameter as built."""
        transformer = self.policy.transformer
        for name, p in transformer.named_parameters():
            p.grad = None
            p.requires_grad_(self.requires_grad[name])
            if name in self.trainable:
                p.copy_(self.trainable[name])
        _set_rng_state(self.rng)
        old = self.policy
        return type(old)(transformer, old.vae, old.latent_channels, autocast_dtype=old.autocast_dtype,
                         scheduler_config=old.scheduler_config, guidance=old.guidance)


class _Reuse:
    def __init__(self):
        self.built: _Built | None = None
        self.builds = 0  # policies built while reusing (a test reads it)


_active: _Reuse | None = None


@contextlib.contextmanager
def reusing_models() -> Iterator[_Reuse]:
    """Within the block, runs with equal build keys share one built model (module docstring)."""
    # the reuse in force is module state that policy_for reads; a nested block restores the outer one on its way out
    global _active  # noqa: PLW0603
    outer, _active = _active, _Reuse()
    try:
        yield _active
    finally:
        _active = outer


def policy_for(cfg: RunConfig, device: torch.device, build=build_policy) -> Policy:
    """The run's policy: ``build(cfg, device)`` (:func:`~agg_bench.engine.models.build_policy`), or inside
    :func:`reusing_models` the kept one restored to its built state when the build key matches and its
    modules are as built."""
    reuse = _active
    if reuse is None or fsdp.enabled(cfg):
        return build(cfg, device)
    key = build_key(cfg, device)
    built = reuse.built
    if built is not None and built.key == key and built.unchanged():
        return built.restored()
    reuse.built = None  # one model in memory at a time: drop the kept one before building another
    del built
    policy = build(cfg, device)
    reuse.builds += 1
    reuse.built = _Built.keep(key, policy)
    return policy
