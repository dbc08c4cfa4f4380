"""The run config: one typed source of truth, with everything else generated from it.

- ``sections.py``: the typed sections (one dataclass each) composed into :class:`RunConfig`; every key's
  default, meaning and constraints, written once.
- ``schema.py``: the JSON schema generated from them, and the checker behind every one-line ConfigError.
- ``load.py``: defaults <- YAML file <- ``--set`` overrides, validated and typed (:func:`load_config`); the
  method's own options are checked after loading (:mod:`agg_bench.runtime.config_check`).
- ``yamlio.py``: the one bounded YAML loader of the harness.
- ``docs.py``: the reference table of ``docs/configuration.md`` (``python -m agg_bench.config.docs``).

The package imports no torch, no diffusers and no method: the workflow checks every composed run config while
Snakemake parses, and a report reads any run folder's ``config.json``.
"""
from .load import (apply_overrides, check_data_parallel, deep_merge, dotted_value, load_config, parse_override,
                   validate)
from .schema import check_finite, check_override_values, check_schema, run_schema
from .sections import (DEFAULTS, EvalConfig, GRPOConfig, MethodSection, ModelConfig, PassCosts, PromptsConfig,
                       RewardConfig, RunConfig, SamplingConfig, TelemetryConfig, TrainConfig, bound,
                       check_prompts_path, device_expected, device_parts, gpu_index, upgrade_written, weights_label)
from .yamlio import (MAX_YAML_BYTES, MAX_YAML_DEPTH, MAX_YAML_VALUES, YamlDumper, YamlRefused, check_expanded_size,
                     integer_arg, number_arg, read_number, read_yaml_mapping, yaml_load)

__all__ = ["DEFAULTS", "EvalConfig", "GRPOConfig", "MAX_YAML_BYTES", "MAX_YAML_DEPTH", "MAX_YAML_VALUES",
           "MethodSection", "ModelConfig", "PassCosts", "PromptsConfig", "RewardConfig", "RunConfig",
           "SamplingConfig", "TelemetryConfig", "TrainConfig", "YamlDumper", "YamlRefused", "apply_overrides", "bound",
           "check_data_parallel", "check_prompts_path", "check_expanded_size", "check_finite",
           "check_override_values", "check_schema", "deep_merge", "device_expected", "device_parts", "dotted_value",
           "gpu_index", "integer_arg", "load_config", "number_arg", "parse_override", "read_number",
           "read_yaml_mapping", "run_schema", "upgrade_written", "validate", "weights_label", "yaml_load"]
