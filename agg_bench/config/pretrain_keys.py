"""The keys of ``agg-bench pretrain``'s config, typed with the run config's :func:`option`.

Each key of :class:`PretrainConfig` is written once: its default, its meaning and its bounds. From those fields
come the refusals of :func:`typed_pretrain_config` (an unknown key, a wrong type, NaN, a value out of bounds: one
ConfigError naming the key, as a run key's), :func:`read_pretrain_config` (the file and the overrides read and
typed so: ``agg-bench pretrain`` refuses them before it imports torch), the JSON schema (:func:`pretrain_schema`) and the key table of
``docs/configuration.md`` (:mod:`agg_bench.config.docs`). What depends on several keys, on the model family or on
the machine (the resolution's multiple, the sample schedule, the sizes together, the device's presence) is
checked by :func:`agg_bench.tools.pretrain.load_pretrain_config` and :func:`agg_bench.tools.pretrain.pretrain`.

This module imports no torch.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Literal, Mapping

from ..errors import ConfigError
from .load import apply_overrides
from .options import typed_fields
from .schema import check_config_values, section_schema
from .sections import Section, device_expected, device_parts, option
from .yamlio import read_yaml_mapping

MAX_SEED = 2**32 - 1  # as a run's seed; the data, noise and sample generators take seed + 1, + 2, + 3
# a warm-up past any run's steps: 10**400 overflowed the learning rate's float in the first step
MAX_STEPS = 1_000_000
# more threads than any machine's cores: the workflow reserves them (a sweep device's threads, at most 1024 in
# workflow/schemas/config.schema.yaml)
MAX_THREADS = 1024


@dataclass
class PretrainConfig(Section):
    """``agg-bench pretrain``'s config: the scene model it trains, and how."""

    # the families whose spec has a pixel_transformer (tests/unit/test_families.py keeps the two equal: this
    # module sits below the engine and cannot read the registry)
    family: Literal["sd3", "flux"] = option(
        "sd3", "a model family with a pixel-space scene model (its spec's `pixel_transformer`)")
    resolution: int = option(32, "image side in pixels; a multiple of 4 x `pixel_factor`", minimum=16, maximum=256)
    steps: int = option(1500, "optimizer steps", minimum=1, maximum=MAX_STEPS)
    batch_size: int = option(32, "images per step", minimum=1, maximum=4096)
    lr: float = option(1e-3, "AdamW's learning rate, reached by a linear warm-up over the first `warmup_steps`",
                       exclusive_minimum=0, maximum=1)
    warmup_steps: int = option(50, "steps of the learning rate's linear warm-up; one given above `steps` (which "
                                   "never reaches `lr`) is a warning line on stderr", minimum=0, maximum=MAX_STEPS)
    lr_schedule: Literal["constant", "cosine"] = option(
        "constant", "the learning rate after the warm-up: `constant`, or `cosine` down to 0 at the last step (late "
                    "steps refine instead of wander)")
    ema_decay: float = option(0.995, "decay of the saved weights' exponential moving average",
                              minimum=0, exclusive_maximum=1)
    seed: int = option(0, "seed of the data, the noise and the initial weights (a run's seed range)",
                       minimum=0, maximum=MAX_SEED)
    num_layers: int = option(4, "transformer blocks (FLUX: this many double-stream and this many single-stream "
                                "blocks)", minimum=1, maximum=64)
    num_attention_heads: int = option(4, "attention heads", minimum=1, maximum=64)
    attention_head_dim: int = option(16, "width of one attention head", minimum=1, maximum=512)
    text_dim: int = option(32, "width of the token and pooled embeddings", minimum=1, maximum=4096)
    max_tokens: int = option(6, "caption tokens embedded", minimum=1, maximum=64)
    pixel_factor: Literal[1, 2, 4] = option(
        2, "the pixel decoder's rearrangement factor: a latent of 3 x factor^2 channels and resolution / factor "
           "pixels a side")
    shift: float = option(
        3.0, "the scheduler's sigma shift, also used to draw the training sigmas; its `sample_steps` schedule "
             "must fall strictly from 1 to 0 in float32, as a run's `sampling.shift`", exclusive_minimum=0, maximum=100)
    sample_steps: int = option(20, "Euler steps of the sample grid", minimum=1, maximum=1000)
    threads: int = option(0, "torch CPU threads, capped at the cores this process may use (0: leave as is)",
                          minimum=0, maximum=MAX_THREADS)
    device: str = option(
        "cpu", "where the model trains and samples; the data, noise and initial weights are drawn on the CPU from "
               "the same seeds whatever the device, so another device's arithmetic gives another, equally valid model",
        pattern="^(cpu|cuda(:[0-9]+)?)$", expected=device_expected(auto=False))


@functools.lru_cache(maxsize=1)
def pretrain_schema() -> dict:
    """The JSON Schema of a pretrain config (draft 2020-12), from :class:`PretrainConfig`."""
    return {"$schema": "https://json-schema.org/draft/2020-12/schema", "title": "agg-bench pretrain config",
            **section_schema(PretrainConfig, "What agg-bench pretrain trains. Every key has a default; "
                                             "docs/configuration.md lists them (generated from "
                                             "agg_bench/config/pretrain_keys.py).")}


def typed_pretrain_config(given: Mapping[str, Any]) -> PretrainConfig:
    """:class:`PretrainConfig` of the keys ``given`` (plain data; the others take their defaults), after the
    refusals of a run key: an unknown key or a value of another kind, then NaN and infinities, then a value
    outside its bounds, each a ConfigError naming the key. An integer given for a ``float`` key becomes a float
    (``pretrain.json`` records ``shift: 3.0`` for ``shift: 3``); nothing else changes a value."""
    check_config_values(dict(given), pretrain_schema())
    cfg = typed_fields(PretrainConfig, given)
    if device_parts(cfg.device) is None:  # the pattern takes any digits after cuda: (cuda:017, cuda:9999999999)
        raise ConfigError("device", cfg.device, device_expected(auto=False))
    return cfg


def read_pretrain_config(path: str | Path | None, overrides: list[str] | None = None,
                         warn: Callable[[str], None] | None = None) -> PretrainConfig:
    """PretrainConfig defaults <- YAML file <- ``--set key=value`` overrides, typed and bounded by its fields
    (:func:`typed_pretrain_config`); what needs the model code is checked after
    (:func:`agg_bench.tools.pretrain.load_pretrain_config`). ``warn`` is given :func:`warmup_warning`'s line where
    there is one."""
    given = apply_overrides(read_yaml_mapping(path, "pretrain keys") if path is not None else {}, overrides or [])
    cfg = typed_pretrain_config(given)
    line = warmup_warning(given, cfg)
    if warn is not None and line is not None:
        warn(line)
    return cfg


def warmup_warning(given: Mapping[str, Any], cfg: PretrainConfig) -> str | None:
    """One line where the keys ``given`` set ``warmup_steps`` above ``steps``: the warm-up never ends, and the last
    step's learning rate is ``steps / warmup_steps`` of ``lr``; None otherwise. Only a warm-up given so: the default
    (50) above a few test steps is not the user's, and refusing it would refuse those runs."""
    if "warmup_steps" not in given or cfg.warmup_steps <= cfg.steps:
        return None
    return (f"warning: warmup_steps = {cfg.warmup_steps} is above steps = {cfg.steps}: the learning rate never "
            f"reaches lr = {cfg.lr:g} (the last step's is {cfg.lr * cfg.steps / cfg.warmup_steps:.3g}); give "
            "warmup_steps <= steps to reach it")


__all__ = ["MAX_SEED", "MAX_STEPS", "MAX_THREADS", "PretrainConfig", "pretrain_schema", "read_pretrain_config",
           "typed_pretrain_config", "warmup_warning"]
