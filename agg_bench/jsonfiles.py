"""JSON files that a user hands to a command (a manifest, a calibration, a model folder's config.json):
read into a JSON object, or refused with one :class:`JsonFileError` that names the file, what is wrong with
it and what was expected there."""
from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any, BinaryIO, Iterator

from .errors import UserError, quote, shown

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


class JsonProblem(ValueError):
    """Why a text is not JSON agg-bench reads: one line, e.g. "Expecting value at line 1 column 1"."""


def _no_constant(name: str) -> Any:
    raise JsonProblem(f"{name} is not a JSON number (agg-bench writes a number that is not finite as null)")


def _object(pairs: list[tuple[str, Any]]) -> dict:
    """A JSON object; a key given twice is refused (JSON readers differ on which one wins)."""
    out = dict(pairs)
    if len(out) < len(pairs):  # the first key given again, named
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise JsonProblem(f"the key {quote(key)} is given twice in one object")
            seen.add(key)
    return out


def loads(text: str | bytes, nonfinite: bool = False) -> Any:
    """The JSON value of ``text``, or a :class:`JsonProblem` saying in one line why there is none: not JSON,
    a key given twice in one object (which value counts would be up to the reader), NaN or an infinity (which
    JSON does not have and agg-bench never writes), nested too deeply for the parser, an integer longer than
    Python reads (4,300 digits), bytes that are not UTF-8. Every JSON file or line agg-bench reads from a user,
    an archive or a results folder goes through here, so a crafted file is refused with a line instead of
    crashing the reader. ``nonfinite``: NaN, Infinity and -Infinity are read as floats, for a log another code
    base wrote with Python's ``json.dumps`` (which writes them), where the caller decides what they mean."""
    try:
        if isinstance(text, str) and not text.startswith("\ufeff"):  # json.loads's own check of a BOM, and of bytes
            return _DECODERS[nonfinite].decode(text)  # one decoder: json.loads built one per call (a run's records)
        return json.loads(text, parse_constant=float if nonfinite else _no_constant, object_pairs_hook=_object)
    except JsonProblem:
        raise
    except json.JSONDecodeError as err:
        # "Expecting value at line 1 column 1"; "Unterminated string starting at line 1 column 5"
        where = "line" if err.msg.endswith(" at") else "at line"
        raise JsonProblem(f"{err.msg} {where} {err.lineno} column {err.colno}") from None
    except UnicodeDecodeError as err:
        raise JsonProblem(f"not UTF-8 text ({err.reason} at byte {err.start})") from None
    except RecursionError:
        raise JsonProblem("nested too deeply") from None
    except ValueError as err:  # e.g. "Exceeds the limit (4300 digits) for integer string conversion: ..."
        message = str(err).splitlines()[0] if str(err) else "not JSON"
        if "integer string conversion" in message:  # Python's advice (sys.set_int_max_str_digits) is for a programmer
            message = message.split("; use sys.set_int_max_str_digits")[0]
        raise JsonProblem(message[:200]) from None


# loads' decoders of text, by ``nonfinite``
_DECODERS = {nonfinite: json.JSONDecoder(parse_constant=float if nonfinite else _no_constant, object_pairs_hook=_object)
             for nonfinite in (False, True)}


def _size(n: int) -> str:
    """A size limit in words: "64 MiB", "64 KiB", "100 bytes"."""
    for unit, size in (("MiB", 2**20), ("KiB", 2**10)):
        if n % size == 0:
            return f"{n // size} {unit}"
    return f"{n:,} bytes"


def json_type(value: Any) -> str:
    """What ``value`` is in JSON's words: "an object", "a list", "a string", "a number", ..."""
    return JSON_TYPES.get(type(value), type(value).__name__)


def check_path(path: str | Path, what: str, expected: str | None = None, folder: bool = False) -> None:
    """A UserError ``{what} {path}: {found}[; expected {expected}]`` unless ``path`` is a regular file (``folder``:
    a folder) that a verb is given to read, in the one wording every such refusal has: ``no such file``, ``is a
    folder``, ``is not a regular file`` (a device, a pipe); ``no such folder``, ``is not a folder``."""
    path = Path(path)
    if folder:
        found = None if path.is_dir() else "is not a folder" if path.exists() else "no such folder"
    else:
        found = None if path.is_file() else \
            ("is a folder" if path.is_dir() else "is not a regular file") if path.exists() else "no such file"
    if found is not None:
        raise UserError(f"{what} {shown(path)}: {found}" + (f"; expected {expected}" if expected else ""))


def is_regular_file(path: str | Path) -> bool:
    """Whether ``path`` itself is a regular file: not a symbolic link (to a regular file or not), a folder, a
    device or a pipe. Looks without following a link and reads nothing; False where nothing is there."""
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except OSError:
        return False


class NotRegularFile(OSError):
    """A path that is neither a regular file nor a folder: a device or a pipe (:func:`open_regular`)."""


def open_regular(path: str | Path) -> BinaryIO:
    """``path`` opened for reading in binary, as a regular file: opened without waiting (a pipe without a writer
    blocks an open) and looked at before anything is read, since a device or a pipe given for a file (/dev/zero,
    a FIFO in a shared results folder) was read until memory ran out, or forever. A folder raises
    IsADirectoryError, anything else that is no regular file :class:`NotRegularFile` (both OSErrors)."""
    handle = os.fdopen(os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)), "rb")
    mode = os.fstat(handle.fileno()).st_mode
    if stat.S_ISREG(mode):
        return handle
    handle.close()
    raise (IsADirectoryError if stat.S_ISDIR(mode) else NotRegularFile)(f"{path}: not a regular file")


class TooLarge(Exception):
    """A file over the bytes its reader takes (:func:`read_bounded`): ``size`` its size, None where it grew past
    the bound while it was read."""

    def __init__(self, size: int | None):
        super().__init__(size)
        self.size = size


def read_bounded(path: str | Path, max_bytes: int) -> bytes:
    """The bytes of the regular file ``path`` (:func:`open_regular`), at most ``max_bytes``: a larger file is
    :class:`TooLarge`, refused before it is read, and one that grows while it is read stops at the bound too."""
    with open_regular(path) as handle:
        size = os.fstat(handle.fileno()).st_size
        if size > max_bytes:
            raise TooLarge(size)
        data = handle.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise TooLarge(None)
    return data


def read_bounded_lines(path: str | Path, max_bytes: int) -> Iterator[bytes]:
    """The bytes :func:`read_bounded` reads, a line at a time: each line with its ``\n`` (the last without one
    where the file does not end in a newline), joined back where a writer appending meanwhile had not written its
    newline yet. A file over ``max_bytes`` is :class:`TooLarge` before anything is read; one that grows past the
    bound while it is read raises it when the read reaches the bound, after the lines before it."""
    with open_regular(path) as handle:
        size = os.fstat(handle.fileno()).st_size
        if size > max_bytes:
            raise TooLarge(size)
        left = max_bytes + 1  # the bytes read until the bound is passed
        while line := handle.readline(left):
            while not line.endswith(b"\n") and len(line) < left and (more := handle.readline(left - len(line))):
                line += more
            left -= len(line)
            if not left:
                raise TooLarge(None)
            yield line


def read_json_object(path: str | Path, expected: str, max_bytes: int = MAX_JSON_BYTES) -> dict:
    """The JSON object in file ``path``; a JsonFileError naming ``path`` and ``expected`` (what belongs
    there, e.g. "an agg-bench calibrate JSON") when the file is missing or unreadable, larger than
    ``max_bytes`` (refused before it is read), not UTF-8 text, not JSON, or holds another JSON value."""
    path = Path(path)
    try:
        text = read_bounded(path, max_bytes).decode("utf-8")
    except TooLarge as err:
        size = "" if err.size is None else f"{err.size:,} bytes, "
        raise JsonFileError(path, f"is {size}over the {_size(max_bytes)} such a file may have", expected) from None
    except FileNotFoundError:
        raise JsonFileError(path, "no such file", expected) from None
    except IsADirectoryError:
        raise JsonFileError(path, "is a folder", expected) from None
    except NotRegularFile:
        raise JsonFileError(path, "is not a regular file", expected) from None
    except UnicodeDecodeError as err:
        raise JsonFileError(path, f"is not UTF-8 text ({err.reason} at byte {err.start})", expected) from None
    except OSError as err:
        raise JsonFileError(path, f"cannot be read ({err.strerror or err})", expected) from None
    try:
        value = loads(text)
    except JsonProblem as err:
        raise JsonFileError(path, f"is not JSON ({err})", expected) from None
    if not isinstance(value, dict):
        raise JsonFileError(path, f"holds {json_type(value)}, not a JSON object", expected)
    return value
