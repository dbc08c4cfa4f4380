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

from .errors import ConfigError, clip

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


# Bounds on any YAML read (run, sweep and pretrain configs, --set values, calibrate --method): a file
# larger than this is not read, and a document is refused when writing out its aliases would give more
# values, or deeper nesting, than this. Real configs are a few kB with a few hundred values.
MAX_YAML_BYTES = 1 << 20
MAX_YAML_VALUES = 100_000
MAX_YAML_DEPTH = 50


class YamlRefused(Exception):
    """A YAML document outside the bounds above (not a syntax error): ``reason`` says what is wrong."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


class _Loader(yaml.SafeLoader):
    """YAML as a person means it: ``1e-5`` and ``3E+2`` are numbers (YAML 1.1 wants a dot, ``1.0e-5``,
    and would read them as strings); every mapping key is a string given once (a repeated key is refused
    instead of the last one winning; ``<<: *base`` merges stay allowed and its keys may be overridden)."""

    def compose_mapping_node(self, anchor):
        node = super().compose_mapping_node(anchor)
        first_line: dict[str, int] = {}
        for key, _ in node.value:
            line = key.start_mark.line + 1
            if key.tag == "tag:yaml.org,2002:merge":
                continue
            if not isinstance(key, yaml.ScalarNode):
                raise YamlRefused(f"text keys (line {line}: a key that is a {key.id})")
            if key.tag != "tag:yaml.org,2002:str":
                kind = key.tag.rsplit(":", 1)[-1]
                raise YamlRefused(f"text keys (line {line}: the key {clip(key.value)!r} reads as {kind}; quote it)")
            if key.value in first_line:
                raise YamlRefused(f"each key once in a mapping ({clip(key.value)!r} at line {line} repeats line "
                                  f"{first_line[key.value]})")
            first_line[key.value] = line
        return node


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"""^(?:[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?(?:[eE][-+]?[0-9]+)?
                |[-+]?\.[0-9_]+(?:[eE][-+]?[0-9]+)?
                |[-+]?\.(?:inf|Inf|INF)
                |\.(?:nan|NaN|NAN))$""", re.X),
    list("-+0123456789."))


def _node_children(node: yaml.Node) -> list:
    if isinstance(node, yaml.SequenceNode):
        return node.value
    if isinstance(node, yaml.MappingNode):
        return [part for pair in node.value for part in pair]
    return []


def _object_children(value: Any) -> list:
    if isinstance(value, dict):
        return [part for pair in value.items() for part in pair]
    if isinstance(value, (list, tuple)):
        return list(value)
    return []


def check_expanded_size(root: Any, children=_object_children) -> None:
    """Raise :class:`YamlRefused` when ``root`` written out (every alias or shared object in full) would hold
    more than :data:`MAX_YAML_VALUES` values or nest deeper than :data:`MAX_YAML_DEPTH`, or never end (an
    alias inside itself). Counted without writing it out: each distinct object's size and depth are
    memoised by identity, so the work grows with the objects there are, not with their expansion.
    ``children``: an object's direct parts (default: of parsed YAML data; ``_node_children`` for nodes)."""
    done: dict[int, tuple[int, int]] = {}  # id -> (values, depth) of the expansion
    open_ids: set[int] = set()  # started, not done: met again below itself, it is a cycle
    stack: list[tuple[Any, bool]] = [(root, False)]
    while stack:
        item, finished = stack.pop()
        key = id(item)
        if finished:
            parts = [done[id(part)] for part in children(item)]
            size = 1 + sum(values for values, _ in parts)
            depth = 1 + max((d for _, d in parts), default=0)
            open_ids.discard(key)
            if size > MAX_YAML_VALUES:
                raise YamlRefused(f"at most {MAX_YAML_VALUES} values with its aliases written out (this one has more)")
            if depth > MAX_YAML_DEPTH:
                raise YamlRefused(f"at most {MAX_YAML_DEPTH} levels of nesting")
            done[key] = (size, depth)
            continue
        if key in done:
            continue
        if key in open_ids:
            raise YamlRefused("no alias inside itself (it would never end)")
        open_ids.add(key)
        stack.append((item, True))
        stack.extend((part, False) for part in children(item) if id(part) not in done)


def yaml_load(text: str, key: str, value: Any) -> Any:
    """Parse YAML ``text`` with :class:`_Loader`, within the bounds above: a ConfigError naming ``key`` and
    ``value`` (the option and the file or text it came from) for a document outside them, which is
    refused before any of it is constructed; ``yaml.YAMLError`` for text that is not YAML."""
    try:
        if len(text.encode("utf-8", "surrogatepass")) > MAX_YAML_BYTES:
            raise YamlRefused(f"at most {MAX_YAML_BYTES // (1 << 20)} MiB of YAML")
        loader = _Loader(text)
        try:
            node = loader.get_single_node()
            if node is None:
                return None
            check_expanded_size(node, _node_children)
            return loader.construct_document(node)
        finally:
            loader.dispose()
    except YamlRefused as err:
        raise ConfigError(key, value, err.reason) from None
    except RecursionError:
        raise ConfigError(key, value, f"at most {MAX_YAML_DEPTH} levels of nesting") from None
    except (ValueError, OverflowError) as err:  # e.g. an integer of 5000 digits, a date 2024-13-45
        raise ConfigError(key, value, f"values that YAML can read ({clip(str(err), 120)})") from None


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
        value = yaml_load(raw, "--set", item) if raw.strip() else ""
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


# how a schema type reads in an error: "expected an integer", "expected a string or null"
TYPE_WORDS = {"integer": "an integer", "number": "a number", "string": "a string", "boolean": "true or false",
              "object": "a mapping", "array": "a list", "null": "null"}


SIZE_WORDS = {"minLength": lambda n: f"at least {n} characters",
              "maxLength": lambda n: f"at most {n} characters",
              "minItems": lambda n: f"a list of at least {n} items",
              "maxItems": lambda n: f"a list of at most {n} items",
              "minProperties": lambda n: f"at least {n} entries",
              "maxProperties": lambda n: f"at most {n} entries",
              "uniqueItems": lambda _: "a list without repeated items"}


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
        types = schema["type"] if isinstance(schema["type"], list) else [schema["type"]]
        return ConfigError(path, error.instance, " or ".join(TYPE_WORDS.get(t, t) for t in types))
    if error.validator in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"):
        words = {"minimum": ">=", "maximum": "<=", "exclusiveMinimum": ">", "exclusiveMaximum": "<"}
        return ConfigError(path, error.instance, f"a value {words[error.validator]} {error.validator_value}")
    if error.validator == "pattern":
        return ConfigError(path, error.instance, schema.get("description", f"to match {error.validator_value}"))
    if error.validator in SIZE_WORDS:
        return ConfigError(path or "(top level)", error.instance, SIZE_WORDS[error.validator](error.validator_value))
    # jsonschema's own message quotes the whole value: kept short
    return ConfigError(path or "(top level)", error.instance, clip(error.message))


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


def _is_integer(checker, instance: Any) -> bool:
    # JSON Schema's integer admits 2.0 (and Python's int admits True): here an integer is an int, so a
    # whole-number float is refused where an integer goes, as the methods' and pretrain options refuse it
    return isinstance(instance, int) and not isinstance(instance, bool)


# Draft 2020-12 with integers that are ints, for the run schema and the sweep schema alike
_Validator = jsonschema.validators.extend(
    jsonschema.Draft202012Validator,
    type_checker=jsonschema.Draft202012Validator.TYPE_CHECKER.redefine("integer", _is_integer))


def check_schema(instance: Any, schema: dict) -> None:
    """Raise a ConfigError for ``instance``'s first violation of ``schema`` (the shallowest key first)."""
    errors = sorted(_Validator(schema).iter_errors(instance),
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
        from .engine.architectures import architecture

        architecture(model["family"], model["architecture"])
    elif model["architecture"] is not None:
        raise ConfigError("model.architecture", model["architecture"], "null unless model.preset is random")
    if not check_method:
        return RunConfig(config)
    from .methods.base import build_method  # a method's options are checked by its own config class

    method = dict(config["method"])
    build_method(method.pop("name"), method)
    return RunConfig(config)


def check_data_parallel(cfg: dict, processes: int) -> None:
    """Raise a ConfigError for a run config that ``processes`` data-parallel processes (torchrun, a sweep
    device's ``gpus``) cannot split: each process trains whole GRPO groups, so ``grpo.prompts_per_iteration``
    is a multiple of ``processes``, and each takes the GPU of its LOCAL_RANK, so ``device`` names no GPU."""
    if processes <= 1:
        return
    prompts = cfg["grpo"]["prompts_per_iteration"]
    if prompts % processes:
        raise ConfigError("grpo.prompts_per_iteration", prompts,
                          f"a multiple of the {processes} data-parallel processes (each process trains whole "
                          "GRPO groups)")
    if cfg["device"].startswith("cuda:"):
        raise ConfigError("device", cfg["device"],
                          "'cuda' or 'auto' under torchrun (each process takes the GPU of its LOCAL_RANK)")


def read_yaml_mapping(path: str | Path, what: str = "sections", key: str = "--config") -> dict:
    """The YAML mapping in the file ``path`` (given as option ``key``), or a ConfigError saying what is wrong
    with it. A file over :data:`MAX_YAML_BYTES` is refused before it is read."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(key, str(path), "an existing YAML file")
    try:
        size = path.stat().st_size
        if size > MAX_YAML_BYTES:
            raise ConfigError(key, str(path), f"a YAML file of at most {MAX_YAML_BYTES // (1 << 20)} MiB "
                              f"(this one has {size} bytes)")
        user = yaml_load(path.read_text(encoding="utf-8"), key, str(path)) or {}
    except OSError as err:
        raise ConfigError(key, str(path), f"a readable file ({err.strerror or err})") from None
    except UnicodeDecodeError as err:
        raise ConfigError(key, str(path), f"UTF-8 text ({err.reason} at byte {err.start})") from None
    except yaml.YAMLError as err:
        raise ConfigError(key, str(path), f"valid YAML ({str(err).splitlines()[0]})") from None
    if not isinstance(user, dict):
        raise ConfigError(key, str(path), f"a YAML mapping of {what}")
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
