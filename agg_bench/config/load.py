"""Loading a run config: the defaults <- a YAML file <- ``--set key=value`` overrides, checked, typed.

Every problem is a :class:`~agg_bench.errors.ConfigError` naming the key, the value and what is allowed,
raised before any job starts. Loading imports no torch, no diffusers and no method: what only the engine or
a method knows (the method's own options, a random preset's architecture name) is checked after loading by
whoever runs something (:func:`agg_bench.runtime.config_check.check_config`).
"""
from __future__ import annotations

import copy
import functools
import typing
from pathlib import Path
from typing import Any, Mapping

import yaml

from ..errors import ConfigError, UserError, counted, quote, shown
from ..records import unprintable_words
from .schema import check_config_values, run_schema
from .sections import (DEFAULTS, WRITTEN_BEFORE, RunConfig, check_cps_eta, device_expected, device_parts,
                       folder_under_random_preset, upgrade_written, written_before)
from .yamlio import read_yaml_mapping, yaml_load

NOT_A_METHOD_MAPPING = "a mapping with a name, e.g. {name: agg, window: 5}"
# the keys every sweep config has (config/config.yaml's, the workflow's and a campaign's), none of them a run config's
SWEEP_MARKS = ("base", "methods")


def deep_merge(base: dict, override: dict) -> dict:
    out = copy.deepcopy(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict) and key != "options":
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def parse_override(item: str) -> tuple[str, Any]:
    """``key.sub=value`` -> (``key.sub``, YAML-parsed value)."""
    if "=" not in item:
        raise ConfigError("--set", item, "key=value, e.g. train.lr=1e-5")
    key, raw = item.split("=", 1)
    key = key.strip()
    if not all(part.strip() for part in key.split(".")):  # '' or '.x' or 'train..lr': a key no config has
        raise ConfigError("--set", item, "key=value with a key of non-empty dotted parts, e.g. train.lr=1e-5")
    # a copy: the parsed value of a short override is kept (a sweep's runs give the same overrides each, parsed
    # 3,600 times for config/h200.yaml's 115 runs), and the caller may change what it gets
    value = _override_value(raw, item) if len(item) <= _KEPT_OVERRIDE_CHARS else _parse_value(raw, item)
    return key, copy.deepcopy(value)


_KEPT_OVERRIDE_CHARS = 1000  # longer overrides are parsed each time, not kept


def _parse_value(raw: str, item: str) -> Any:
    """The value of override ``item`` (``key=raw``), YAML-parsed; ``raw`` as it is where it is not YAML."""
    try:
        return yaml_load(raw, "--set", item) if raw.strip() else ""
    except yaml.YAMLError:
        return raw


_override_value = functools.lru_cache(maxsize=4096)(_parse_value)  # a refusal (ConfigError) is not kept


def dotted_value(config: Mapping, key: str) -> Any:
    """The value of the dotted ``key`` (``eval.noises``) in a nested config mapping, None where a level is
    missing: a config as ``config.json`` holds it, whose keys may be older than today's."""
    value: Any = config
    for part in key.split("."):
        value = value.get(part) if isinstance(value, Mapping) else None
    return value


def apply_overrides(config: dict, overrides: list[str]) -> dict:
    config = copy.deepcopy(config)
    for item in overrides:
        key, value = parse_override(item)
        parts = key.split(".")
        node = config
        for i, part in enumerate(parts[:-1]):
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            if not isinstance(child, dict):
                raise ConfigError(".".join(parts[: i + 1]), child, f"a section to hold '{key}'")
            node = child
        node[parts[-1]] = _section_over(node.get(parts[-1]), value, key)
    return config


def _section_over(current: Any, value: Any, key: str) -> Any:
    """What ``--set key=value`` leaves at ``key``: a mapping given for a section merges into the section there
    is, as the config file's sections merge into the defaults (:func:`deep_merge`), so that ``--set
    'train={lr: 1e-3}'`` keeps the file's other train keys; an ``options`` mapping, and a ``method`` mapping
    that names its method, replace the one there is whole, as in a file (options of another method never leak
    in). Any other value replaces what is there."""
    if not (isinstance(value, dict) and isinstance(current, dict)) or key.rsplit(".", 1)[-1] == "options":
        return value
    if key == "method" and "name" in value:
        return value
    return deep_merge(current, value)


MAX_RUN_ID = 200  # characters of run_id, as of import-log's labels


def validate(config: dict) -> RunConfig:
    """``config`` (plain data) checked against the run schema and typed. The method's options stay as written
    (``cfg.method.given``; ``cfg.method.options`` is None until
    :func:`~agg_bench.runtime.config_check.check_config` types them)."""
    if not isinstance(config.get("method"), dict):
        raise ConfigError("method", config.get("method"), NOT_A_METHOD_MAPPING)
    refuse_written_before(config)
    # an unknown key, or a flag or a name given NaN, is refused for what it is, not as a number that is not finite
    check_config_values(config, run_schema())
    cfg = RunConfig.from_dict(config)
    if device_parts(cfg.device) is None:  # the schema's pattern takes any digits after cuda: (cuda:017)
        raise ConfigError("device", cfg.device, device_expected())
    # a label of the records, the summary, the tables and the progress lines, never a path (the folder is --out):
    # a newline or a control character split or garbled those lines, and the tables' rows
    if cfg.run_id is not None and not (len(cfg.run_id) <= MAX_RUN_ID and cfg.run_id.isprintable()):
        raise ConfigError("run_id", cfg.run_id, f"a name of 1 to {MAX_RUN_ID} printable characters, or null"
                                                f"{unprintable_words(cfg.run_id)}")
    model = cfg.model
    if model.preset == "pretrained" and not model.pretrained:  # else the planner sized the tiny model for it
        raise ConfigError("model.preset", model.preset, "'tiny' or 'random', or 'pretrained' with model.pretrained "
                                                        "set to a local model folder")
    if model.architecture is not None and not (model.preset == "random" and not model.pretrained):
        raise ConfigError("model.architecture", model.architecture, "null unless model.preset is random")
    if cfg.sampling.schedule == "linspace" and cfg.sampling.shift is None:
        raise ConfigError("sampling.shift", None, "a number with sampling.schedule 'linspace' (the sigmas are "
                                                  "shift(linspace(1, 0, T + 1)) with this shift)")
    if cfg.train.eval_ema is None and cfg.train.eval_ema_every != 1:
        raise ConfigError("train.eval_ema_every", cfg.train.eval_ema_every,
                          "1 unless train.eval_ema is set (it is the interval of that average's updates)")
    if cfg.train.eval_ema is None and cfg.train.eval_ema_updates != 1:
        raise ConfigError("train.eval_ema_updates", cfg.train.eval_ema_updates,
                          "1 unless train.eval_ema is set (it is that average's updates per optimizer step)")
    for key in ("lora_alpha", "lora_target_modules"):  # set alone, it trained the whole model without a word
        if cfg.train.lora_rank == 0 and getattr(cfg.train, key) is not None:
            raise ConfigError(f"train.{key}", getattr(cfg.train, key),
                              "null unless train.lora_rank > 0 (train.lora_rank = 0 fine-tunes the whole model)")
    check_cps_eta(cfg.sampling.sde, cfg.sampling.eta)
    check_minibatches(cfg, 1)
    if cfg.reward.on == "x0" and cfg.sampling.steps == 1 and cfg.sampling.same_noise_per_group:
        raise ConfigError("reward.on", "x0", "'final' with sampling.steps = 1 and sampling.same_noise_per_group (the "
                                             "data prediction of the only step comes from the group's shared noise "
                                             "before any SDE noise, so a group has one reward and every advantage "
                                             "is 0)")
    return cfg


def check_minibatches(cfg: RunConfig, processes: int) -> None:
    """Raise a ConfigError naming ``train.minibatches`` unless it divides the prompt groups of each of ``processes``
    processes' batches (``train.minibatch_unit: groups``: every mini-batch holds the same number of whole GRPO
    groups, at least one) or the group (``slices``: every mini-batch holds an equal slice of each group)."""
    minibatches, groups = cfg.train.minibatches, cfg.grpo.prompts_per_iteration // processes
    if cfg.train.minibatch_unit == "slices":
        if cfg.grpo.group_size % minibatches:
            raise ConfigError("train.minibatches", minibatches,
                              f"a divisor of grpo.group_size = {cfg.grpo.group_size} with train.minibatch_unit "
                              "'slices' (every mini-batch holds an equal slice of each group)")
        return
    if groups % minibatches == 0:
        return
    per = "" if processes == 1 else f" / {processes} data-parallel processes"
    raise ConfigError("train.minibatches", minibatches,
                      f"a divisor of the {counted(groups, 'prompt group')} of one process's batch, at most "
                      f"{groups} (grpo.prompts_per_iteration = {cfg.grpo.prompts_per_iteration}{per}): every "
                      "mini-batch holds the same number of whole groups")


def refuse_written_before(config: dict) -> None:
    """A ConfigError for a value only older run folders hold (``grpo.adv_std: population``), naming the keys
    that say it today: a config is written one way, and an old ``config.json`` given as ``--config`` says what
    to write instead. So is ``model.pretrained`` beside ``model.preset: random``, which older runs trained as the
    folder's model, not the architecture the preset names."""
    if folder_under_random_preset(config.get("model")):
        raise ConfigError("model.pretrained", config["model"]["pretrained"], "null with model.preset 'random' (a "
                          "public architecture with random weights); set model.preset: pretrained to train this folder")
    for (section, key) in WRITTEN_BEFORE:
        part = config.get(section)
        if isinstance(part, dict) and (now := written_before(section, key, part.get(key))) is not None:
            hints = typing.get_type_hints(type(getattr(RunConfig(), section)))
            allowed = " or ".join(repr(v) for v in typing.get_args(hints[key]))  # today's values of the key
            today = ", ".join(f"{section}.{k}: {v}" for k, v in now.items())
            raise ConfigError(f"{section}.{key}", part[key], f"{allowed} (older run folders wrote {part[key]!r} for "
                                                              f"what is now {today})")


def check_data_parallel(cfg: RunConfig, processes: int) -> None:
    """Raise a ConfigError for a run config that ``processes`` data-parallel processes (torchrun, a sweep
    device's ``gpus``) cannot split: each process trains whole GRPO groups, so ``grpo.prompts_per_iteration``
    is a multiple of ``processes`` whose share ``train.minibatches`` divides (:func:`check_minibatches`), and each
    takes the GPU of its LOCAL_RANK, so ``device`` names no GPU."""
    if processes <= 1:
        return
    if cfg.grpo.adv_std == "global":
        raise ConfigError("grpo.adv_std", "global", f"'group' with {processes} data-parallel processes (each "
                                                    "process standardises its own share of the groups)")
    prompts = cfg.grpo.prompts_per_iteration
    if prompts % processes:
        raise ConfigError("grpo.prompts_per_iteration", prompts,
                          f"a multiple of the {processes} data-parallel processes (each process trains whole "
                          "GRPO groups)")
    check_minibatches(cfg, processes)
    if cfg.device.startswith("cuda:"):
        raise ConfigError("device", cfg.device,
                          "'cuda' or 'auto' under torchrun (each process takes the GPU of its LOCAL_RANK)")


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> RunConfig:
    """DEFAULTS <- YAML file <- overrides, validated and typed (:func:`validate`)."""
    user: dict = {}
    if path is not None:
        user = read_yaml_mapping(path)
        if all(key in user for key in SWEEP_MARKS):  # config/config.yaml given where config/run.yaml is meant
            raise UserError(f"{shown(path)}: a sweep config (its keys {', '.join(SWEEP_MARKS)}: snakemake "
                            "--configfile and agg-bench campaign --config take it); expected a run config (keys "
                            f"{', '.join(sorted(DEFAULTS))})"
                            + (f", e.g. its base {quote(user['base'])}" if isinstance(user["base"], str) else ""))
        if "method" in user and not isinstance(user["method"], dict):
            raise ConfigError("method", user["method"], NOT_A_METHOD_MAPPING)
    merged = deep_merge(DEFAULTS, user)
    if "method" in user and "name" in user["method"]:
        # a method section replaces the default one, so options of another method do not leak in
        merged["method"] = copy.deepcopy(user["method"])
    return validate(apply_overrides(merged, overrides or []))


def _flat(config: dict, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out.update(_flat(value, f"{name}."))
        else:
            out[name] = value
    return out


def first_difference(old: dict, new: dict, ignore: tuple[str, ...] = (),
                     defaults: dict | None = None) -> tuple[str, Any, Any] | None:
    """(dotted key, old value, new value) of the first key where two configs differ, outside ``ignore``.
    A key of ``defaults`` that ``old`` lacks (a config written before the key existed) counts as its
    default there, and a value an older run wrote reads as the keys it stands for today
    (:func:`agg_bench.config.upgrade_written`). ``old`` is merged into ``defaults`` as a config file into the
    defaults: a mapping ``old`` gives in place of an empty default one (``reward.options``) stands for it, where
    flattening both on their own kept the empty default beside the keys under it, a difference in every config
    that set one."""
    keep = lambda k: not any(k == c or k.startswith(c + ".") for c in ignore)
    a = _flat(deep_merge(defaults or {}, upgrade_written(old)))
    a = {k: v for k, v in a.items() if keep(k)}
    b = {k: v for k, v in _flat(new).items() if keep(k)}
    for key in sorted(set(a) | set(b)):
        if a.get(key) != b.get(key):
            return key, a.get(key), b.get(key)
    return None
