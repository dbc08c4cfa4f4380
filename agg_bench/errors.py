"""Errors that speak to the user: which key, what value, what was expected; and the error contract every
command's ``main`` keeps (:func:`run_command`)."""
from __future__ import annotations

import errno
import os
import shlex
import sys
import traceback
from pathlib import Path
from typing import Callable, Sequence


class UserError(Exception):
    """A problem with the user's input. The CLI prints ``str(err)`` on one line and exits with code 2."""


class ConfigError(UserError):
    """A config key has a value the run cannot use."""

    def __init__(self, key: str, value: object, expected: str):
        self.key, self.value, self.expected = key, value, expected
        super().__init__(f"config error: {key} = {value!r}: expected {expected}")


# errno values that mean the disk (or the user's share of it) is full
DISK_FULL = {errno.ENOSPC: "no space left on device",
             getattr(errno, "EDQUOT", errno.ENOSPC): "no space left on device (disk quota exceeded)"}
# how long a one-line error may grow: a longer one keeps its head and its tail (what was expected)
MAX_LINE = 1000


def disk_full(exc: BaseException) -> tuple[str, str | None] | None:
    """(what is full, the path being written or None) when ``exc`` or an exception it was raised from or
    while handling is a full disk: an ``OSError`` with errno ENOSPC or EDQUOT, or an error of a library
    that wraps one in its message (torch and safetensors report the OS's text); else None."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError) and exc.errno in DISK_FULL:
            path = exc.filename if exc.filename is not None else exc.filename2
            return DISK_FULL[exc.errno], None if path is None else os.fsdecode(path)
        text = str(exc)
        for code, what in DISK_FULL.items():
            if os.strerror(code) in text:
                return what, None
        exc = exc.__cause__ or exc.__context__
    return None


def quoted(value: object, limit: int = 80) -> str:
    """``repr(value)`` as an error message quotes it: at most ``limit`` characters."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def one_line(text: str) -> str:
    """``text`` as a single line of at most ``MAX_LINE`` characters (the middle of a longer one is cut)."""
    line = " ".join(part.strip() for part in str(text).splitlines() if part.strip())
    if len(line) > MAX_LINE:
        keep = MAX_LINE // 2
        line = f"{line[:keep]} [... {len(line) - MAX_LINE} characters ...] {line[-(MAX_LINE - keep):]}"
    return line


def run_command(name: str, body: Callable[[], int], argv: Sequence[str], out: str | Path | None = None) -> int:
    """``body()`` under the error contract of every agg-bench command; its exit code.

    A :class:`UserError` prints ``name: message`` on one line and exits with 2, as does a full disk (an
    ``ENOSPC`` / ``EDQUOT`` anywhere in the exception's chain: the line names the file being written, else
    ``out``). An interruption prints ``name: interrupted`` and exits with 128 + the signal's number, as a
    shell reports a process ended by it (130 SIGINT, 143 SIGTERM). Anything else is a bug in agg-bench:
    one line that says so and names the command to report (``argv``), then the traceback, exit code 1.
    """
    try:
        return body()
    except UserError as err:
        print(f"{name}: {one_line(str(err))}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as err:
        signum = getattr(err, "signum", 2)
        print(f"{name}: interrupted", file=sys.stderr)
        return 128 + signum
    except Exception as err:
        full = disk_full(err)
        if full is not None:
            what, path = full
            where = path if path is not None else (f"writing {out}" if out is not None else None)
            print(f"{name}: {one_line(where + ': ' + what if where else what)}", file=sys.stderr)
            return 2
        print(f"{name}: internal error: this is a bug in agg-bench; please report it with the command "
              f"({one_line(shlex.join(argv))}) and the traceback below", file=sys.stderr)
        traceback.print_exc()
        return 1
