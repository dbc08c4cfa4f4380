"""The options of a method or of an inference cache, typed with the run config's :func:`option`.

A method's options (``method.<option>`` keys) and a cache's (flat keys of the ``cached`` method's section)
are a dataclass subclassing :class:`Options`, whose fields are written once with
:func:`~agg_bench.config.sections.option`: the default, the meaning and the bounds. From those fields come
the refusals (:func:`typed_options`: an unknown key, a wrong type, a value out of bounds, each one
ConfigError naming ``method.<option>``), the JSON schema (:func:`options_schema`) and the option tables of
``docs/methods.md`` (:mod:`agg_bench.methods.option_tables`), as the run config's keys give its schema and
``docs/configuration.md``. What depends on several options is checked by the class's :meth:`Options.check`;
what depends on the run (the schedule's length, the group size) by the method's ``check_run``.

An option is typed as written: an integer given for a ``float`` option becomes a float, a list for a
``tuple`` option a tuple, and a list's items take its items' type; nothing else changes a value.

This module imports no torch: the option classes of the caches are read while a sweep is checked.
"""
from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any, Literal, Mapping, TypeVar

from ..errors import ConfigError
from ..records import is_integer
from .schema import check_config_values, section_schema
from .sections import Section, option

S = TypeVar("S", bound=Section)

# The largest micro-batch or no-grad batch a method takes: the largest batch a run can have, 256 samples per
# prompt x 1,024 prompts (grpo.group_size and grpo.prompts_per_iteration's bounds).
MAX_BATCH = 256 * 1024


class Options(Section):
    """A method's or a cache's options: a dataclass of :func:`~agg_bench.config.sections.option` fields.

    Subclasses are ``@dataclass`` classes; a field with ``metadata={"internal": True}`` is set by code, not by
    the user, and is no option (a cache's step clock)."""

    def check(self) -> None:
        """Refuse settings that depend on several options (a ConfigError naming one of them); bounds of one
        option are its field's constraints."""

    def check_family(self, family: str) -> None:
        """Refuse settings that the model family ``family`` (``model.family``) cannot run (a ConfigError naming
        one of them), before any model is built: a sweep's dry run checks them as a run does."""


def batch_option(doc: str) -> Any:
    """A ``micro_batch`` or ``nograd_batch`` option: null (one call for everything) or a count >= 1."""
    return dataclasses.field(default=None, metadata={"doc": doc, "constraints": {
        "minimum": 1, "maximum": MAX_BATCH, "expected": f"null or an integer >= 1 (at most {MAX_BATCH:,})"}})


def option_names(cls: type[Options]) -> tuple[str, ...]:
    """The user-facing options of ``cls``, in field order."""
    return tuple(f.name for f in dataclasses.fields(cls) if "internal" not in f.metadata)


_SCHEMAS: dict[type, dict] = {}


def options_schema(cls: type[Options]) -> dict:
    """The JSON schema of ``cls``'s options: an object of those keys, each with its type, bounds and meaning
    (built once per class)."""
    if cls not in _SCHEMAS:
        _SCHEMAS[cls] = section_schema(cls, (cls.__doc__ or "").strip().split("\n")[0])
    return _SCHEMAS[cls]


def typed_options(cls: type[Options], given: Mapping[str, Any], prefix: str = "method",
                  owner: str = "") -> Options:
    """``cls`` built from the options ``given`` (keys without the ``prefix``), after every refusal above; a
    ConfigError names ``<prefix>.<key>``. ``owner`` names whose options they are in the error of an unknown
    key (``method 'agg'``, ``the 'fora' cache``)."""
    allowed = option_names(cls)
    for key, value in given.items():
        if key not in allowed:
            known = ", ".join(sorted(allowed)) or "none"
            raise ConfigError(f"{prefix}.{key}", value, f"a known option of {owner or cls.__name__} ({known})")
    # an integer, a flag or a name given NaN is refused for what it is, as a run key is, not as a number that is
    # not finite
    check_config_values({prefix: dict(given)}, {"type": "object", "properties": {prefix: options_schema(cls)}})
    options = typed_fields(cls, given)
    options.check()
    return options


def typed_fields(cls: type[S], given: Mapping[str, Any]) -> S:
    """``cls`` built from the keys ``given`` (already checked against its schema), each value typed as its field
    is (:func:`typed_value`); the other fields take their defaults."""
    hints = typing.get_type_hints(cls)
    return cls(**{key: typed_value(value, hints[key]) for key, value in given.items()})


def typed_value(value: Any, annotation: Any) -> Any:
    """``value`` (already checked against ``annotation``'s schema) as that type: ``float`` makes an integer a
    float, ``tuple[...]`` makes a list a tuple, a list's items take its items' type; the first arm of a union
    that accepts the value types it."""
    if value is None:
        return None
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        for arm in (a for a in args if a is not type(None)):
            if _accepts(arm, value):
                return typed_value(value, arm)
        return value
    if annotation is float and is_integer(value):
        return float(value)
    if origin is list and isinstance(value, (list, tuple)):
        return [typed_value(v, args[0]) for v in value] if args else list(value)
    if origin is tuple and isinstance(value, (list, tuple)):
        return tuple(typed_value(v, arm) for v, arm in zip(value, args)) if args else tuple(value)
    return value


def _accepts(annotation: Any, value: Any) -> bool:
    origin = typing.get_origin(annotation) or annotation
    if origin is Literal:
        return value in typing.get_args(annotation)
    if annotation is bool:
        return isinstance(value, bool)
    if annotation is int:
        return is_integer(value)
    if annotation is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if origin in (list, tuple):
        return isinstance(value, (list, tuple))
    return isinstance(value, origin) if isinstance(origin, type) else True


__all__ = ["MAX_BATCH", "Options", "batch_option", "option", "option_names", "options_schema", "typed_options",
           "typed_value"]
