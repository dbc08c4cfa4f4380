"""Run configuration: YAML merged over defaults, ``--set key=value`` overrides, schema validation.

Every problem is a :class:`ConfigError` naming the key, the value and what is allowed.
"""
from __future__ import annotations

import copy
import functools
import math
import re
from importlib import resources
from pathlib import Path
from typing import Any

import jsonschema
import yaml

from .errors import ConfigError

DEFAULTS: dict[str, Any] = {
    "run_id": None,
    "seed": 0,
    "device": "cpu",
    "progress": True,
    "model": {"family": "sd3", "preset": "tiny", "pretrained": None, "resolution": 128, "dtype": "float32",
              "architecture": None},
    "prompts": {"file": None, "max_tokens": 16, "max_sequence_length": None, "cache_dir": "results/embeddings"},
    "sampling": {"steps": 10, "sde": "flow_grpo", "eta": 0.7, "shift": 3.0, "same_noise_per_group": True},
    "grpo": {"group_size": 4, "prompts_per_iteration": 2, "clip_range": 1e-4, "adv_clip_max": 5.0, "beta": 0.0,
             "adv_std": "population", "kl_form": "transition"},
    "train": {"iterations": 2, "lr": 1e-4, "weight_decay": 0.0, "max_grad_norm": 1.0, "timestep_fraction": 1.0,
              "plan": "steps", "plan_window": 5, "inner_epochs": 1, "gradient_checkpointing": False,
              "lora_rank": 0, "lora_alpha": None, "lora_target_modules": None, "checkpoint_every": 0,
              "shard": "none", "cpu_offload": False},
    "method": {"name": "full"},
    "reward": {"name": "jpeg_compressibility", "options": {}},
    "telemetry": {"enabled": True, "nvml_interval_s": 0.05, "saved_activations": "first"},
}


class _Loader(yaml.SafeLoader):
    """YAML as a person means it: ``1e-5`` and ``3E+2`` are numbers (YAML 1.1 wants a dot, ``1.0e-5``,
    and would read them as strings)."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"""^(?:[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?(?:[eE][-+]?[0-9]+)?
                |[-+]?\.[0-9_]+(?:[eE][-+]?[0-9]+)?
                |[-+]?\.(?:inf|Inf|INF)
                |\.(?:nan|NaN|NAN))$""", re.X),
    list("-+0123456789."))


def yaml_load(text: str):
    """Parse YAML text with :class:`_Loader` (numbers in exponent notation are floats)."""
    return yaml.load(text, Loader=_Loader)  # noqa: S506 (a SafeLoader subclass)


class RunConfig(dict):
    """A validated config: a nested dict whose sections also read as attributes (``cfg.train.lr``)."""

    def __getattr__(self, key: str) -> Any:
        try:
            value = self[key]
        except KeyError as err:
            raise AttributeError(key) from err
        return RunConfig(value) if isinstance(value, dict) and not isinstance(value, RunConfig) else value

    def get_path(self, dotted: str) -> Any:
        node: Any = self
        for part in dotted.split("."):
            node = node[part]
        return node

    def to_dict(self) -> dict:
        return copy.deepcopy(dict(self))


@functools.lru_cache(maxsize=1)  # parsing the YAML costs more than validating a config against it
def _schema() -> dict:
    return yaml.safe_load(resources.files("agg_bench").joinpath("run.schema.yaml").read_text())


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
    if not key:
        raise ConfigError("--set", item, "key=value with a non-empty key")
    try:
        value = yaml_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    return key, value


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
        node[parts[-1]] = value
    return config


def _describe(error: jsonschema.ValidationError) -> ConfigError:
    path = ".".join(str(p) for p in error.absolute_path)
    schema = error.schema if isinstance(error.schema, dict) else {}
    if error.validator == "additionalProperties":
        allowed = sorted(error.schema.get("properties", {}))
        extra = sorted(set(error.instance) - set(allowed))
        key = f"{path}.{extra[0]}" if path else extra[0]
        return ConfigError(key, error.instance[extra[0]], f"a known key here (one of {', '.join(allowed)})")
    if error.validator == "enum":
        return ConfigError(path, error.instance, f"one of {schema['enum']}")
    if error.validator == "required":
        return ConfigError(path or "(top level)", error.instance, error.message)
    if error.validator == "type":
        return ConfigError(path, error.instance, f"type {schema['type']}")
    if error.validator in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"):
        words = {"minimum": ">=", "maximum": "<=", "exclusiveMinimum": ">", "exclusiveMaximum": "<"}
        return ConfigError(path, error.instance, f"a value {words[error.validator]} {error.validator_value}")
    if error.validator == "pattern":
        return ConfigError(path, error.instance, schema.get("description", f"to match {error.validator_value}"))
    return ConfigError(path or "(top level)", error.instance, error.message)


def check_finite(value: Any, path: str = "") -> None:
    """Refuse NaN and infinities anywhere in a config (JSON Schema's ``number`` admits them)."""
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(path or "(top level)", value, "a finite number")
    if isinstance(value, dict):
        for key, item in value.items():
            check_finite(item, f"{path}.{key}" if path else str(key))
    elif isinstance(value, list):
        for i, item in enumerate(value):
            check_finite(item, f"{path}[{i}]")


def check_schema(instance: Any, schema: dict) -> None:
    """Raise a ConfigError for ``instance``'s first violation of ``schema`` (the shallowest key first)."""
    errors = sorted(jsonschema.Draft202012Validator(schema).iter_errors(instance),
                    key=lambda e: (len(list(e.absolute_path)), list(map(str, e.absolute_path))))
    if errors:
        raise _describe(errors[0])


def validate(config: dict, check_method: bool = True) -> RunConfig:
    """Check ``config`` against the schema and (``check_method``) the method's options, which imports the
    method's module and with it torch; return it as a RunConfig."""
    check_finite(config)
    if not isinstance(config.get("method"), dict):
        raise ConfigError("method", config.get("method"), "a mapping with a name, e.g. {name: agg, window: 5}")
    check_schema(config, _schema())
    model = config["model"]
    if model["preset"] == "random" and not model["pretrained"]:
        from .architectures import architecture

        architecture(model["family"], model["architecture"])
    elif model["architecture"] is not None:
        raise ConfigError("model.architecture", model["architecture"], "null unless model.preset is random")
    if not check_method:
        return RunConfig(config)
    from .methods import build_method  # a method's options are checked by its own config class

    method = dict(config["method"])
    build_method(method.pop("name"), method)
    return RunConfig(config)


def read_yaml_mapping(path: str | Path, what: str = "sections") -> dict:
    """The YAML mapping in the file ``path`` (``--config``), or a ConfigError saying what is wrong with it."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError("--config", str(path), "an existing YAML file")
    try:
        user = yaml_load(path.read_text(encoding="utf-8")) or {}
    except UnicodeDecodeError as err:
        raise ConfigError("--config", str(path), f"UTF-8 text ({err.reason} at byte {err.start})")
    except yaml.YAMLError as err:
        raise ConfigError("--config", str(path), f"valid YAML ({str(err).splitlines()[0]})")
    if not isinstance(user, dict):
        raise ConfigError("--config", str(path), f"a YAML mapping of {what}")
    return user


def load_config(path: str | Path | None = None, overrides: list[str] | None = None,
                check_method: bool = True) -> RunConfig:
    """DEFAULTS <- YAML file <- overrides, validated (the method's options only with ``check_method``)."""
    user: dict = {}
    if path is not None:
        user = read_yaml_mapping(path)
        if "method" in user and not isinstance(user["method"], dict):
            raise ConfigError("method", user["method"], "a mapping with a name, e.g. {name: agg, window: 5}")
    merged = deep_merge(DEFAULTS, user)
    if "method" in user and "name" in user["method"]:
        # a method section replaces the default one, so options of another method do not leak in
        merged["method"] = copy.deepcopy(user["method"])
    return validate(apply_overrides(merged, overrides or []), check_method)
