"""YAML as the harness reads it: one loader for every YAML it takes (run, sweep and pretrain configs, ``--set``
values, ``calibrate --method``, gradcheck lists), within bounds, every problem a one-line ConfigError; and the
number flags of every command read their values through it (:func:`read_number`), so that a number means the
same and is refused the same way wherever it is given.
"""
from __future__ import annotations

import argparse
import re
from pathlib import Path
from typing import Any, overload

import yaml

from ..errors import ConfigError, clip, quote
from ..jsonfiles import TooLarge, read_bounded
from ..records import is_finite_number, is_integer

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
    """YAML as a person means it: numbers are decimal (:data:`_INTEGER`, :data:`_FLOAT`), and ``1e-5`` and
    ``3E+2`` are numbers (YAML 1.1 wants a dot, ``1.0e-5``, and would read them as strings); booleans are
    ``true`` and ``false`` (:data:`_BOOL`: ``yes``, ``no``, ``on``, ``off`` are text); every mapping key
    is a string given once (a repeated key is refused instead of the last one winning; ``<<: *base`` merges
    stay allowed and its keys may be overridden)."""

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


# Numbers are written in decimal, the one way every value of the harness reads them (config files, --set, and
# the number flags through read_number). YAML 1.1 also reads 017 as octal 15, 0x10 as 16, 0b11 as 3 and 1:30 as
# 90 (base 60), where a person (and Python's int()) reads 017 as 17: such a value is text here, which a number
# key refuses, rather than a number that means one thing in a file and another in a flag. An underscore may
# group digits, as in Python (1_000).
_DIGITS = r"[0-9](?:_?[0-9])*"
_INTEGER = re.compile(r"^[-+]?(?:0|[1-9](?:_?[0-9])*)$")
_FLOAT = re.compile(rf"""^(?:[-+]?(?:{_DIGITS}\.(?:{_DIGITS})?|\.{_DIGITS})(?:[eE][-+]?[0-9]+)?
                |[-+]?{_DIGITS}[eE][-+]?[0-9]+
                |[-+]?\.(?:inf|Inf|INF)
                |\.(?:nan|NaN|NAN))$""", re.X)
# Booleans are true and false (True, TRUE, False, FALSE), as in YAML 1.2: YAML 1.1 also reads yes, no, on and off
# as booleans, so `method.cache=off` was refused as "= False", a value no one wrote, and a bare `on:` key was
# true. They are text here, which a boolean key refuses and a key that takes words reads as written.
_BOOL = re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$")
_REPLACED_TAGS = ("tag:yaml.org,2002:int", "tag:yaml.org,2002:float", "tag:yaml.org,2002:bool")
_Loader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag not in _REPLACED_TAGS]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()}
_Loader.add_implicit_resolver("tag:yaml.org,2002:bool", _BOOL, list("tTfF"))
_Loader.add_implicit_resolver("tag:yaml.org,2002:int", _INTEGER, list("-+0123456789"))
_Loader.add_implicit_resolver("tag:yaml.org,2002:float", _FLOAT, list("-+0123456789."))


class YamlDumper(yaml.SafeDumper):
    """YAML written as :class:`_Loader` reads it back: a string that it would read as a number or a boolean is
    quoted. SafeDumper quotes by YAML 1.1's rules, and wrote the text ``1e-5`` plain, which the loader (a run's
    ``--set``) reads as the number 1e-05."""


YamlDumper.yaml_implicit_resolvers = {first: list(resolvers)
                                      for first, resolvers in _Loader.yaml_implicit_resolvers.items()}


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


# what a number of each kind may be, in the one-line refusal of a flag
NUMBER_WORDS = {int: "an integer in decimal digits (e.g. 1000, not 1e3 or 1000.0)",
                float: "a finite number (e.g. 0.5, 1e-5 or 3)"}


@overload
def read_number(text: str, kind: type[int]) -> int | None: ...


@overload
def read_number(text: str, kind: type[float]) -> float | None: ...


def read_number(text: str, kind: type[int] | type[float]) -> int | float | None:
    """The number of ``kind`` that the text of a flag says, read as a config key reads its value (:func:`yaml_load`),
    or None where it says none. An integer is decimal digits with an optional sign (``1_000`` groups them), never
    true or false nor a whole-number float (``1e3``, ``1000.0``), as an integer key of the run config refuses them;
    a number is an integer or a decimal float (``1e-5``), finite, and comes back a float."""
    try:
        value = yaml_load(text, "", text)
    except (ConfigError, yaml.YAMLError):
        return None
    if kind is int:
        return value if is_integer(value) else None
    return float(value) if is_finite_number(value) else None


def _number_arg(text: str, kind: type[int] | type[float]) -> Any:
    value = read_number(text, kind)
    if value is None:  # argparse prefixes the flag: one line naming the flag, the value and what is allowed
        raise argparse.ArgumentTypeError(f"{quote(text)}: expected {NUMBER_WORDS[kind]}")
    return value


def integer_arg(text: str) -> int:
    """The argparse type of every integer flag: ``text`` as :func:`read_number` reads an integer; anything else is
    argparse's one-line refusal naming the flag (exit code 2). Bounds are the flag's owner's to check."""
    return _number_arg(text, int)


def number_arg(text: str) -> float:
    """The argparse type of every number flag: ``text`` as :func:`read_number` reads a finite number (a float);
    anything else is argparse's one-line refusal naming the flag (exit code 2)."""
    return _number_arg(text, float)


def read_yaml_mapping(path: str | Path, what: str = "sections", key: str = "--config") -> dict:
    """The YAML mapping in the file ``path`` (given as option ``key``), or a ConfigError saying what is wrong
    with it. A file over :data:`MAX_YAML_BYTES` is refused before it is read."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(key, str(path), "an existing YAML file")
    try:
        user = yaml_load(read_bounded(path, MAX_YAML_BYTES).decode("utf-8"), key, str(path))
    except TooLarge as err:
        has = "more" if err.size is None else f"{err.size}"
        raise ConfigError(key, str(path), f"a YAML file of at most {MAX_YAML_BYTES // (1 << 20)} MiB "
                          f"(this one has {has} bytes)") from None
    except OSError as err:
        raise ConfigError(key, str(path), f"a readable file ({err.strerror or err})") from None
    except UnicodeDecodeError as err:
        raise ConfigError(key, str(path), f"UTF-8 text ({err.reason} at byte {err.start})") from None
    except yaml.YAMLError as err:
        raise ConfigError(key, str(path), f"valid YAML ({str(err).splitlines()[0]})") from None
    if user is None:  # an empty file (or one of comments): a config cut short, not the defaults asked for
        raise ConfigError(key, str(path), f"a YAML mapping of {what} (the file holds none: it is empty or "
                                          "comments only)")
    if not isinstance(user, dict):
        raise ConfigError(key, str(path), f"a YAML mapping of {what}")
    return user
