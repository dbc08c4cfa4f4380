"""JSON files that a user hands to a command (a manifest, a calibration, a model folder's config.json):
read into a JSON object, or refused with one :class:`JsonFileError` that names the file, what is wrong with
it and what was expected there."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .errors import UserError

MAX_JSON_BYTES = 64 * 2**20  # far above any manifest, calibration or config; read whole, so bounded
MAX_CONFIG_BYTES = 2**20  # a model folder's config files: a diffusers config.json is a few KB

JSON_TYPES = {dict: "an object", list: "a list", str: "a string", bool: "true or false", int: "a number",
              float: "a number", type(None): "null"}


class JsonFileError(UserError):
    """A file that is not the JSON object expected there: its ``path``, the ``problem`` (e.g. "is not JSON
    (...)") and what was ``expected``."""

    def __init__(self, path: Path, problem: str, expected: str):
        self.path, self.problem, self.expected = path, problem, expected
        super().__init__(f"{path}: {problem}; expected {expected}")


def _size(n: int) -> str:
    """A size limit in words: "64 MiB", "64 KiB", "100 bytes"."""
    for unit, size in (("MiB", 2**20), ("KiB", 2**10)):
        if n % size == 0:
            return f"{n // size} {unit}"
    return f"{n:,} bytes"


def json_type(value: Any) -> str:
    """What ``value`` is in JSON's words: "an object", "a list", "a string", "a number", ..."""
    return JSON_TYPES.get(type(value), type(value).__name__)


def read_json_object(path: str | Path, expected: str, max_bytes: int = MAX_JSON_BYTES) -> dict:
    """The JSON object in file ``path``; a JsonFileError naming ``path`` and ``expected`` (what belongs
    there, e.g. "an agg-bench calibrate JSON") when the file is missing or unreadable, larger than
    ``max_bytes`` (refused before it is read), not UTF-8 text, not JSON, or holds another JSON value."""
    path = Path(path)
    try:
        if path.is_file() and (size := path.stat().st_size) > max_bytes:
            raise JsonFileError(path, f"is {size:,} bytes, over the {_size(max_bytes)} such a file may have",
                                expected)
        text = path.read_bytes().decode("utf-8")
    except FileNotFoundError:
        raise JsonFileError(path, "no such file", expected) from None
    except IsADirectoryError:
        raise JsonFileError(path, "is a folder", expected) from None
    except UnicodeDecodeError as err:
        raise JsonFileError(path, f"is not UTF-8 text ({err.reason} at byte {err.start})", expected) from None
    except OSError as err:
        raise JsonFileError(path, f"cannot be read ({err.strerror or err})", expected) from None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        raise JsonFileError(path, f"is not JSON ({err.msg} at line {err.lineno} column {err.colno})", expected) from None
    except RecursionError:
        raise JsonFileError(path, "is JSON nested too deeply", expected) from None
    if not isinstance(value, dict):
        raise JsonFileError(path, f"holds {json_type(value)}, not a JSON object", expected)
    return value
