"""The run config's JSON schema, generated from the typed sections, and the checker that turns a schema
violation into one ConfigError naming the key, the value and what is allowed.

The schema is built from :mod:`agg_bench.config.sections` when it is first needed (a few dozen fields:
well under a millisecond), not kept in a file: there is nothing to regenerate and nothing to drift.
``python -m agg_bench.config.docs --schema`` prints it. The same functions give the schema of a method's or a
cache's options (:mod:`agg_bench.config.options`), and :func:`check_schema` also checks the workflow's sweep
config against its own schema (``workflow/schemas/config.schema.yaml``).
"""
from __future__ import annotations

import dataclasses
import functools
import json
import math
import types
import typing
from typing import Any, Iterable, Literal

import jsonschema

from ..errors import ConfigError, clip, counted
from ..records import is_integer
from .sections import RunConfig, Section, section_class

JSON_TYPES = {int: "integer", float: "number", str: "string", bool: "boolean", dict: "object", list: "array",
              tuple: "array"}
# option() keywords -> JSON Schema keywords; ``items`` holds keywords of a list's items (``{"minimum": 1}``)
KEYWORDS = {"minimum": "minimum", "maximum": "maximum", "exclusive_minimum": "exclusiveMinimum",
            "exclusive_maximum": "exclusiveMaximum", "pattern": "pattern", "min_length": "minLength", "min_items": "minItems",
            "max_items": "maxItems", "unique_items": "uniqueItems", "expected": "x-expected"}


def type_schema(annotation: Any) -> dict:
    """The JSON Schema of a field's annotation: its type (or enum) and, for a list, its items' type. ``Any``
    allows anything; a union of more than one type besides null is an ``anyOf`` of them."""
    if annotation is Any:
        return {}
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        nullable = type(None) in typing.get_args(annotation)
        arms = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(arms) > 1:
            return {"anyOf": [type_schema(a) for a in arms] + ([{"type": "null"}] if nullable else [])}
        inner = type_schema(arms[0])
        if "enum" in inner:
            return {**inner, **({"type": [inner["type"], "null"]} if "type" in inner else {}),
                    "enum": [*inner["enum"], None]}
        return {**inner, "type": [inner["type"], "null"]}
    if typing.get_origin(annotation) is Literal:
        values = list(typing.get_args(annotation))
        # an enum compares 2.0 (and only 2.0, not true) equal to 2: a choice of integers is also an integer, which
        # refuses a whole-number float as every integer key does
        if values and all(is_integer(v) for v in values):
            return {"type": "integer", "enum": values}
        return {"enum": values}
    origin = typing.get_origin(annotation) or annotation
    schema: dict[str, Any] = {"type": JSON_TYPES[origin]}
    args = typing.get_args(annotation)
    if origin is list and args:
        schema["items"] = type_schema(args[0])
    elif origin is tuple and args:  # tuple[X, X]: a list of exactly that many X (a pair [low, high], ...)
        assert len(set(args)) == 1 and Ellipsis not in args, f"a tuple of one type, not {annotation}"
        schema.update(items=type_schema(args[0]), minItems=len(args), maxItems=len(args))
    return schema


# The largest value of a number key that names no maximum of its own: numbers become float32 tensors and
# factors of them (a learning rate, a clip range), and one past float32's largest (3.4e38) ended a run in an
# overflow instead of a refusal; every bound a key names is far below this.
MAX_NUMBER = 1e30


def field_schema(annotation: Any, constraints: dict, doc: str) -> dict:
    """A field's property schema: its type, its ``option()`` constraints and its meaning; a number without a
    maximum of its own takes :data:`MAX_NUMBER`."""
    schema = type_schema(annotation)
    for key, value in constraints.items():
        if key == "items":
            schema["items"] = {**schema.get("items", {}), **{KEYWORDS[k]: v for k, v in value.items()}}
        else:
            schema[KEYWORDS[key]] = value
    kinds = schema.get("type")
    if (kinds == "number" or (isinstance(kinds, list) and "number" in kinds)) \
            and "maximum" not in schema and "exclusiveMaximum" not in schema:
        schema["maximum"] = MAX_NUMBER
    schema["description"] = doc
    return schema


def section_schema(cls: type[Section], doc: str | None = None) -> dict:
    """The JSON Schema of a section: its fields' types and constraints, each with its meaning."""
    hints = typing.get_type_hints(cls)
    properties = {}
    for f in dataclasses.fields(cls):
        if "internal" in f.metadata or "key" in f.metadata:  # kept by the section itself, not a key of its own
            continue
        nested = section_class(f)
        if nested is not None:
            properties[f.name] = section_schema(nested, f.metadata["doc"])
            continue
        properties[f.name] = field_schema(hints[f.name], f.metadata["constraints"], f.metadata["doc"])
    schema: dict[str, Any] = {"type": "object", "description": doc or (cls.__doc__ or "").split("\n")[0]}
    if cls.REQUIRED:
        schema["required"] = list(cls.REQUIRED)
    if not cls.OPEN:
        schema["additionalProperties"] = False
    schema["properties"] = properties
    return schema


@functools.lru_cache(maxsize=1)
def run_schema() -> dict:
    """The run config's JSON Schema (draft 2020-12), from :class:`~agg_bench.config.sections.RunConfig`."""
    return {"$schema": "https://json-schema.org/draft/2020-12/schema", "title": "agg-bench run config",
            **section_schema(RunConfig, "One training run. Every key has a default; docs/configuration.md "
                                        "lists them (generated from agg_bench/config/sections.py).")}


def default_text(value: Any) -> str:
    """A default as YAML would write it, short: ``null``, ``true``, ``1e-4``, ``3.0``, ``{}``, ``""``."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float) and value and abs(value) < 1e-3:
        mantissa, exponent = f"{value:e}".split("e")
        return f"{float(mantissa):g}e{int(exponent)}"
    if isinstance(value, (dict, list)) or value == "":  # the empty string as YAML writes it, ""
        return json.dumps(value)
    return str(value)


def number_text(value: Any) -> str:
    """A bound, short: ``4096``, ``262,144``, ``1,000,000`` (a whole float too), ``0.5``."""
    if isinstance(value, float) and abs(value) >= 1e15:
        mantissa, exponent = f"{value:e}".split("e")
        return f"{float(mantissa):g}e{int(exponent)}"
    if isinstance(value, float) and value.is_integer() and abs(value) >= 10_000:
        value = int(value)
    return f"{value:,}" if isinstance(value, int) and abs(value) >= 10_000 else default_text(value)


def range_words(kind: str, schema: dict, every_bound: bool = False) -> str:
    """What a number or integer ``schema`` allows, in words: ``integer from 1 to 4096``, ``number > 0 and <= 1``,
    ``number >= 0``. The bound every number has (:data:`MAX_NUMBER`) is said only with ``every_bound``."""
    low = [f">= {number_text(schema['minimum'])}"] if "minimum" in schema else []
    low += [f"> {number_text(schema['exclusiveMinimum'])}"] if "exclusiveMinimum" in schema else []
    high = [f"<= {number_text(schema['maximum'])}"] \
        if "maximum" in schema and (every_bound or schema["maximum"] != MAX_NUMBER) else []
    high += [f"< {number_text(schema['exclusiveMaximum'])}"] if "exclusiveMaximum" in schema else []
    if kind == "integer" and "minimum" in schema and "maximum" in schema and high:
        return f"integer from {number_text(schema['minimum'])} to {number_text(schema['maximum'])}"
    return " and ".join([" ".join([kind, *low]), *high]) if low else " ".join([kind, *high])


# how a schema type reads in an error: "expected an integer", "expected a string or null"
TYPE_WORDS = {"integer": "an integer", "number": "a number", "string": "a string", "boolean": "true or false",
              "object": "a mapping", "array": "a list", "null": "null"}


class _NotGiven:
    """The value of a required key left out, as an error shows it."""

    def __repr__(self) -> str:
        return "(not given)"


NOT_GIVEN = _NotGiven()

SIZE_WORDS = {"minLength": lambda n: f"at least {counted(n, 'character')}",
              "maxLength": lambda n: f"at most {counted(n, 'character')}",
              "minItems": lambda n: f"a list of at least {counted(n, 'item')}",
              "maxItems": lambda n: f"a list of at most {counted(n, 'item')}",
              "minProperties": lambda n: f"at least {counted(n, 'entry', 'entries')}",
              "maxProperties": lambda n: f"at most {counted(n, 'entry', 'entries')}",
              "uniqueItems": lambda _: "a list without repeated items"}


def _key_path(parts: Iterable[str | int]) -> str:
    """A place in a config as errors name it: mapping keys joined by '.', a list's items by their index in
    brackets (``references[0].label``, ``resolutions[1]``): a label may itself be digits or hold a '.'."""
    text = ""
    for part in parts:
        text += f"[{part}]" if isinstance(part, int) else f".{part}" if text else str(part)
    return text


def _resolved(schema: dict, root: dict) -> dict:
    """``schema`` with a local ``$ref`` (``#/$defs/label``) of ``root`` taken in, its own keys over the target's."""
    ref = schema.get("$ref")
    if not (isinstance(ref, str) and ref.startswith("#/")):
        return schema
    target: Any = root
    for name in ref[2:].split("/"):
        target = target.get(name) if isinstance(target, dict) else None
    if not isinstance(target, dict):
        return schema
    return {**_resolved(target, root), **{k: v for k, v in schema.items() if k != "$ref"}}


def _describe(error: jsonschema.ValidationError, root: dict) -> ConfigError:
    path = _key_path(error.absolute_path)
    schema = error.schema if isinstance(error.schema, dict) else {}
    instance: Any = error.instance
    if error.validator == "additionalProperties":
        allowed = sorted(schema.get("properties", {}))
        extra = sorted(set(instance) - set(allowed))
        key = f"{path}.{extra[0]}" if path else extra[0]
        return ConfigError(key, instance[extra[0]], f"a known key here (one of {', '.join(allowed)})")
    if error.validator == "enum":
        return ConfigError(path, error.instance, f"one of {schema['enum']}")
    if error.validator == "required":  # the key left out named, with what it takes, not the mapping that lacks it
        required = list(error.validator_value) if isinstance(error.validator_value, list) else []
        missing = next((name for name in required if name not in instance), required[0] if required else "?")
        given = schema.get("properties", {}).get(missing)
        given = _resolved(given, root) if isinstance(given, dict) else {}
        what = given.get("x-expected") or _words(given) or "a value"
        if "description" in given and "x-expected" not in given:
            what += f" ({given['description']})"
        return ConfigError(f"{path}.{missing}" if path else str(missing), NOT_GIVEN, f"{what}: a required key")
    if error.validator == "type":
        types_ = schema["type"] if isinstance(schema["type"], list) else [schema["type"]]
        return ConfigError(path, error.instance, " or ".join(TYPE_WORDS.get(t, str(t)) for t in types_))
    if error.validator in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"):
        # the whole range, as the key tables give it: "an integer from 1 to 256", "a number > 0 and <= 1"
        kinds = schema.get("type")
        kinds = kinds if isinstance(kinds, list) else [kinds]
        kind = "integer" if "integer" in kinds else "number"
        # every number's bound (MAX_NUMBER) is said where it is the one passed
        words = f"{TYPE_WORDS[kind].split()[0]} {range_words(kind, schema, error.validator == 'maximum')}"
        expected = schema.get("x-expected") or words + (" or null" if "null" in kinds else "")
        return ConfigError(path, error.instance, expected)
    if error.validator == "pattern":
        expected = schema.get("x-expected") or schema.get("description") or f"to match {error.validator_value}"
        return ConfigError(path, error.instance, expected)
    if error.validator == "anyOf":
        expected = schema.get("x-expected") or " or ".join(_words(arm) for arm in schema["anyOf"])
        return ConfigError(path, error.instance, expected)
    if error.validator in SIZE_WORDS:
        expected = schema.get("x-expected") or SIZE_WORDS[error.validator](error.validator_value)
        return ConfigError(path or "(top level)", error.instance, expected)
    # jsonschema's own message quotes the whole value: kept short
    return ConfigError(path or "(top level)", error.instance, clip(error.message))


def _words(schema: dict) -> str:
    """One arm of a union in words: ``one of ['flux']``, ``a list``, ``null``."""
    if "enum" in schema:
        return f"one of {schema['enum']}"
    kinds = schema.get("type", [])
    return " or ".join(TYPE_WORDS.get(t, str(t)) for t in (kinds if isinstance(kinds, list) else [kinds]))


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
    # whole-number float is refused where an integer goes, as the methods' and pretrain options and the integer
    # flags refuse it
    return is_integer(instance)


# Draft 2020-12 with integers that are ints, for the run schema and the sweep schema alike
_Validator = jsonschema.validators.extend(
    jsonschema.Draft202012Validator,
    type_checker=jsonschema.Draft202012Validator.TYPE_CHECKER.redefine("integer", _is_integer))


def _errors(instance: Any, schema: dict) -> list:
    """``instance``'s violations of ``schema``, the shallowest key first."""
    return sorted(_Validator(schema).iter_errors(instance),
                  key=lambda e: (len(list(e.absolute_path)), list(map(str, e.absolute_path))))


def check_schema(instance: Any, schema: dict) -> None:
    """Raise a ConfigError for ``instance``'s first violation of ``schema`` (the shallowest key first)."""
    errors = _errors(instance, schema)
    if errors:
        raise _describe(errors[0], schema)


# the validators that compare a number with a bound: every comparison with NaN is false, and an infinity is
# "above the maximum" where the number's fault is that it is not finite
BOUND_VALIDATORS = frozenset({"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"})


def check_override_values(pairs: list[tuple[str, Any]], schema: dict, prefix: str = "") -> None:
    """Refuse each (dotted key, value) pair of part of a run config (a sweep's ``set:``, a label's overrides)
    whose value holds NaN or an infinity for what its key takes, as :func:`check_config_values` refuses it in a
    whole config: an unknown key, a flag or a name given NaN is told so, not that it takes a finite number.
    ``schema``: the run schema; ``prefix`` leads the key in the error (``methods.full``)."""
    for key, value in pairs:
        try:
            check_finite(value)
        except ConfigError:
            instance: Any = value
            for part in reversed(key.split(".")):
                instance = {part: instance}
            try:
                check_config_values(instance, _nothing_required(schema))
            except ConfigError as err:
                raise ConfigError(f"{prefix}.{err.key}" if prefix else err.key, err.value, err.expected) from None


def _nothing_required(schema: Any) -> Any:
    """``schema`` with no key required: the schema of any part of what it describes."""
    if isinstance(schema, dict):
        return {k: _nothing_required(v) for k, v in schema.items() if k != "required"}
    if isinstance(schema, list):
        return [_nothing_required(v) for v in schema]
    return schema


def check_config_values(instance: Any, schema: dict) -> None:
    """:func:`check_schema` with :func:`check_finite` between what a key is and the bounds of its number: first a
    key the schema does not know, or a value of another kind (a flag, a name, an integer given NaN), is refused for
    what it is; then NaN and infinities anywhere, as not finite; then a number outside its bounds."""
    errors = _errors(instance, schema)
    kind = next((e for e in errors if e.validator not in BOUND_VALIDATORS), None)
    if kind is not None:
        raise _describe(kind, schema)
    check_finite(_described_part(instance, schema))
    if errors:
        raise _describe(errors[0], schema)


def _described_part(instance: Any, schema: Any) -> Any:
    """``instance`` without the keys that ``schema`` leaves to another schema: an open section's own keys (the
    ``method`` section's options, checked by the method's options class) and a key whose schema says nothing of
    its value (the ``cached`` method's cache options, checked by the chosen cache's class). Those checks are this
    function's own (:func:`agg_bench.config.options.typed_options`), which refuse an option given NaN for what it
    is (an integer, where it is one), not here as a number that is not finite."""
    if not (isinstance(instance, dict) and isinstance(schema, dict)):
        return instance
    properties = schema.get("properties")
    if not isinstance(properties, dict):
        return instance
    open_section = schema.get("additionalProperties", True) is True
    return {key: _described_part(value, properties.get(key)) for key, value in instance.items()
            if (key in properties or not open_section) and not _says_nothing(properties.get(key))}


def _says_nothing(schema: Any) -> bool:
    return isinstance(schema, dict) and not set(schema) - {"description", "title"}
