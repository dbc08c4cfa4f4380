"""Errors that speak to the user: which key, what value, what was expected; the error contract every
command's ``main`` keeps (:func:`run_command`); and a long command's progress lines on stderr (:class:`Progress`).

A message stays one short line whatever the input: a ConfigError quotes at most :data:`QUOTE_CHARS`
characters of a key or value (and says how long it was), and any UserError keeps at most
:data:`MESSAGE_CHARS` characters on one line. Quoting costs bounded work even for a value that is huge
when written out, such as a YAML document whose aliases nest (only its first items are looked at).
"""
from __future__ import annotations

import argparse
import contextlib
import errno
import itertools
import os
import reprlib
import select
import shlex
import signal
import sys
import time
import traceback
from pathlib import Path
from typing import Callable, Iterator, NoReturn, Sequence

from .stopping import handled, stop_signals

QUOTE_CHARS = 200  # of one quoted key or value
MESSAGE_CHARS = 1000  # of a whole message (a safety net for messages that quote values themselves)
_ITEMS = 12  # items of a list or mapping written out before '...'


class _BoundedRepr(reprlib.Repr):
    """``repr`` that writes out at most :data:`_ITEMS` items per list or mapping, 4 levels deep; mappings in
    their own order (reprlib sorts them), subclasses of dict, list and tuple (OrderedDict, say) as those."""

    def __init__(self):
        super().__init__()
        self.maxlevel = 4
        self.maxlist = self.maxtuple = self.maxset = self.maxfrozenset = self.maxdeque = self.maxdict = _ITEMS
        self.maxstring = self.maxother = self.maxlong = QUOTE_CHARS

    def repr1(self, x, level):
        if isinstance(x, dict):
            return self.repr_dict(x, level)
        if isinstance(x, list):
            return self.repr_list(x, level)
        if isinstance(x, tuple):
            return self.repr_tuple(x, level)
        return super().repr1(x, level)

    def repr_dict(self, x, level):
        if not x:
            return "{}"
        if level <= 0:
            return "{...}"
        pieces = [f"{self.repr1(k, level - 1)}: {self.repr1(v, level - 1)}"
                  for k, v in itertools.islice(x.items(), self.maxdict)]
        return "{" + ", ".join(pieces + (["..."] if len(x) > self.maxdict else [])) + "}"


_REPR = _BoundedRepr()


def one_line(text: str) -> str:
    """``text`` as a single line of at most :data:`MESSAGE_CHARS` characters (the middle of a longer one is cut,
    so its head and what was expected stay)."""
    line = " ".join(part.strip() for part in str(text).splitlines() if part.strip())
    if len(line) > MESSAGE_CHARS:
        keep = MESSAGE_CHARS // 2
        line = f"{line[:keep]} [... {len(line) - MESSAGE_CHARS} characters ...] {line[-(MESSAGE_CHARS - keep):]}"
    return line


def first_message_line(err: BaseException) -> str:
    """The first line of ``err``'s message, or the name of its type where the message is empty: what a one-line
    refusal says of a library's exception."""
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def shown(path: str | Path) -> str:
    """``path`` as a progress or status line writes it: as it is, or quoted (:func:`quote`) where it holds a
    character that is not printable (a newline or carriage return, which split the line it is on; an escape
    sequence), so that each such line stays one line."""
    text = str(path)
    return text if text.isprintable() else quote(text)


def clip(text: str, limit: int = QUOTE_CHARS, unit: str = "characters") -> str:
    """``text`` itself, or its first ``limit`` characters, an ellipsis and how long it was."""
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} {unit})"


def counted(count: int, noun: str, plural: str | None = None) -> str:
    """``count`` and ``noun`` for a message, the noun plural unless the count is 1 (``1 iteration``,
    ``2 iterations``, ``0 iterations``); ``plural`` where it is not the noun and an s (``entries``)."""
    return f"{count} {noun if count == 1 else plural or noun + 's'}"


def numbered(noun: str, first: int, last: int) -> str:
    """``noun`` with the numbers ``first`` to ``last`` for a message: ``run 3`` for one, ``runs 2-4`` for more."""
    return f"{noun} {first}" if first == last else f"{noun}s {first}-{last}"


# seconds between two of a long command's progress lines, and before the first: a command done sooner prints none
PROGRESS_EVERY_S = 5.0


class Progress:
    """Progress lines of a long command on stderr, ``agg-bench <verb>: <what> (<seconds> s)``, as ``cell`` and
    ``campaign`` print theirs: called as each step ends, it prints the step at most once every ``every`` seconds
    (default :data:`PROGRESS_EVERY_S`), so that a command on big inputs (a report of runs of 100,000 records, an
    import of a log of a million lines) shows where it is and a quick one prints nothing. stdout keeps the
    command's one JSON line."""

    def __init__(self, verb: str, every: float | None = None):
        self.verb = verb
        self.every = PROGRESS_EVERY_S if every is None else every
        self.start = self.last = time.perf_counter()

    def __call__(self, what: str) -> None:
        now = time.perf_counter()
        if now - self.last >= self.every:
            print(f"agg-bench {self.verb}: {what} ({now - self.start:.1f} s)", file=sys.stderr, flush=True)
            self.last = now


def quote(value: object) -> str:
    """``repr(value)`` for a message: at most :data:`QUOTE_CHARS` characters of it, then an ellipsis and
    how long the value is (characters of a string, items of a list or mapping)."""
    if isinstance(value, str):
        return repr(value) if len(value) <= QUOTE_CHARS else f"{value[:QUOTE_CHARS]!r}... ({len(value)} characters)"
    try:
        text = _REPR.repr(value)
    except Exception:  # a value whose repr fails still gets a message
        text = f"<{type(value).__name__}>"
    if not isinstance(value, (list, tuple, dict, set, frozenset)):
        return clip(text)
    shown = text if len(text) <= QUOTE_CHARS else text[:QUOTE_CHARS] + "..."
    # reprlib writes '...' for what it leaves out
    return shown if "..." not in shown else f"{shown} ({type(value).__name__} of {len(value)} items)"


class UserError(Exception):
    """A problem with the user's input. The CLI prints ``str(err)`` on one line and exits with code 2."""

    def __init__(self, message: object = ""):
        super().__init__(one_line(str(message)))


class ConfigError(UserError):
    """A config key has a value the run cannot use."""

    def __init__(self, key: str, value: object, expected: str):
        self.key, self.value, self.expected = key, value, expected
        super().__init__(f"config error: {clip(str(key))} = {quote(value)}: expected {expected}")


_ALIKE = "_agg_bench_alike"
_RAISED_BY = "_agg_bench_raised_by"
# how long a process that leaves an error to another process waits to be ended (:func:`_print_user_error`)
ALIKE_WAIT_S = 60.0
# set by torchrun's agent (torch.distributed.elastic) in every process it starts; that agent ends a job's processes
# once one has failed
TORCHRUN_AGENT_VARIABLE = "TORCHELASTIC_RUN_ID"


def raised_by(err: BaseException, rank: int) -> BaseException:
    """``err``, marked as another process's error (process ``rank``'s), passed on to this one: that process prints
    it (:func:`user_error_line`)."""
    with contextlib.suppress(AttributeError):
        setattr(err, _RAISED_BY, rank)
    return err


def mark_alike(err: BaseException) -> BaseException:
    """``err``, marked as raised alike by every process of its machine (:func:`user_error_line`)."""
    with contextlib.suppress(AttributeError):
        setattr(err, _ALIKE, True)
    return err


@contextlib.contextmanager
def alike_on_every_process() -> Iterator[None]:
    """A block whose outcome depends on nothing but the command line, the machine's files and the code (no
    rank, device or other process), which every process a launcher starts on one machine reaches alike (nothing
    before it depends on the process), so that they all raise the same UserError in it or none does:
    :func:`user_error_line` prints it on the first process of the machine only."""
    try:
        yield
    except UserError as err:
        mark_alike(err)
        raise


def launch_place() -> tuple[int, int] | None:
    """(``RANK``, ``LOCAL_RANK``) of this process when torchrun started several (``WORLD_SIZE`` > 1); None for
    one process, or where those variables are not all integers (then every line is printed as it is)."""
    if "WORLD_SIZE" not in os.environ:  # one process: no need to import the config package to print a line
        return None
    from .config.yamlio import read_number  # the config package imports this module

    world, rank, local = (read_number(os.environ.get(name, ""), int) for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK"))
    if world is None or rank is None or local is None:
        return None
    return (rank, local) if world > 1 else None


def user_error_line(name: str, err: BaseException) -> str | None:
    """The line this process prints for the user error ``err`` of command ``name``: ``name: message`` for one
    process. Of several processes a launcher started, each line is printed by one process: an error raised alike on
    every process of a machine (marked by :func:`mark_alike`) by the machine's first process, another
    process's error passed on to this one (:func:`raised_by`) by that process, which raised it itself, and any
    other by the process that raised it; None on the processes that leave it to another. The line says whose the
    error is, ``rank N: `` before the message for all but rank 0's, so that a problem only one process has is
    printed once, by it."""
    return _line_at(name, err, launch_place())


def _line_at(name: str, err: BaseException, place: tuple[int, int] | None) -> str | None:
    """:func:`user_error_line` of a process at ``place`` (:func:`launch_place`)."""
    if place is None:
        return f"{name}: {one_line(str(err))}"
    rank, local = place
    if (getattr(err, _ALIKE, False) and local != 0) or getattr(err, _RAISED_BY, rank) != rank:
        return None
    return _ranked_line(name, err, rank)


def _ranked_line(name: str, err: BaseException, rank: int) -> str:
    return f"{name}: {'' if rank == 0 else f'rank {rank}: '}{one_line(str(err))}"


def _print_user_error(name: str, err: BaseException) -> None:
    """Print :func:`user_error_line`. A process that leaves the line to another (its machine's first process, or
    the process the error came from) waits up to :data:`ALIKE_WAIT_S` seconds before it goes on to exit: torchrun
    ends a job's processes once one has failed, so this one ending first could get that one ended before it
    printed. Ended by then, it printed nothing (the other one did); still running, it prints the line itself, naming
    the process whose error it is. Without torchrun's agent (:data:`TORCHRUN_AGENT_VARIABLE` unset: the launcher's
    variables set by hand, or another launcher), nothing would end it, so it prints the line at once."""
    place = launch_place()  # once: it reads the environment and imports the config package under a launcher
    line = _line_at(name, err, place)
    if line is None:
        if TORCHRUN_AGENT_VARIABLE in os.environ:
            try:
                time.sleep(ALIKE_WAIT_S)
            except KeyboardInterrupt:
                return
        line = _ranked_line(name, err, getattr(err, _RAISED_BY, place[0] if place else 0))
    print(line, file=sys.stderr)


class JobLost(Exception):
    """Another process of this distributed job ended, so this one cannot go on: no bug of this process (the
    other one's output says why). The CLI prints ``str(err)`` on one line, without a traceback, and exits with
    code 1."""

    def __init__(self, message: object = ""):
        super().__init__(one_line(str(message)))


# errno values that mean the disk (or the user's share of it) is full
DISK_FULL = {errno.ENOSPC: "no space left on device",
             getattr(errno, "EDQUOT", errno.ENOSPC): "no space left on device (disk quota exceeded)"}


def disk_full(exc: BaseException | None) -> tuple[str, str | None] | None:
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


def stdout_reader_gone(err: BaseException) -> bool:
    """Whether ``err`` is a write to a pipe on stdout whose reader has closed it (``agg-bench env | head``),
    which is no bug: a broken pipe, and stdout's pipe without a reader (``poll`` says so, so that a broken pipe
    to a child process still counts as a bug)."""
    if not isinstance(err, BrokenPipeError):
        return False
    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        return any(events & select.POLLERR for _, events in poller.poll(0))
    except (AttributeError, OSError, ValueError):  # no poll here, or a stdout without a file descriptor
        return False


def run_command(name: str, body: Callable[[], int], argv: Sequence[str], out: str | Path | None = None) -> int:
    """``body()`` under the error contract of every agg-bench command; its exit code.

    A :class:`UserError` prints ``name: message`` on one line and exits with 2, as does a full disk (an
    ``ENOSPC`` / ``EDQUOT`` anywhere in the exception's chain: the line names the file being written, else
    ``out``); of several processes a launcher started, which prints a user error is :func:`user_error_line`'s
    rule. SIGTERM and SIGINT are taken as :mod:`agg_bench.stopping` says (``body`` runs under its
    :func:`~agg_bench.stopping.stop_signals`): an interruption prints ``name: interrupted`` and exits with
    128 + the signal's number, as a shell reports a process ended by it (130 SIGINT, 143 SIGTERM), and a
    second signal ends the process at once with that code. Another process of a distributed job that ended
    (:class:`JobLost`) is one line and exit code 1. A reader of stdout that has gone (a pipe into
    ``head``) ends it quietly with 128 + SIGPIPE, as a shell reports a process that signal ended; a stdout closed
    before it started (``>&-``) is a user error, before ``body`` runs. Anything else
    is a bug in agg-bench: one line that says so and names the command to report (``argv``), then the
    traceback, exit code 1.
    """
    try:
        if sys.stdout is None:  # `agg-bench env >&-`: its result would be lost, after the work, in a traceback
            raise UserError("stdout is closed; give it a file, a pipe or /dev/null (the command prints its result "
                            "there)")
        with stop_signals(name):
            code = body()
        sys.stdout.flush()  # what it printed reaches its reader here, where a reader that has gone is caught
        return code
    except UserError as err:
        _print_user_error(name, err)
        return 2
    except JobLost as err:
        print(f"{name}: {one_line(str(err))}", file=sys.stderr)
        return 1
    except KeyboardInterrupt as err:
        handled(err)
        signum = getattr(err, "signum", 2)
        print(f"{name}: interrupted", file=sys.stderr)
        return 128 + signum
    except Exception as err:
        if stdout_reader_gone(err):  # `agg-bench env | head`: the reader took what it wanted
            null = os.open(os.devnull, os.O_WRONLY)
            os.dup2(null, sys.stdout.fileno())  # nothing left to flush at exit
            os.close(null)
            return 128 + signal.SIGPIPE
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


class _StoreOnce(argparse._StoreAction):
    """A flag that holds one value (or one list, ``--runs A B``), refused when given twice: argparse kept the last
    and dropped the first unseen (``report --runs A --runs B`` reported B alone; ``plan --gpus 2 --gpus 3`` planned
    3). A repeatable flag says so with ``action="append"``."""

    def __call__(self, parser, namespace, values, option_string=None):
        given = parser.__dict__.setdefault("flags_given", {})
        shown = " ".join(map(str, values)) if isinstance(values, list) else str(values)
        if self.dest in given:
            together = f", all its values after one {option_string}" if self.nargs in ("*", "+") else ""
            parser.error(f"argument {'/'.join(self.option_strings)}: given twice ({quote(given[self.dest])}, then "
                         f"{quote(shown)}); expected it once{together}")
        given[self.dest] = shown
        super().__call__(parser, namespace, values, option_string)


class OneLineParser(argparse.ArgumentParser):
    """argparse's parser whose usage errors keep the error contract: one line naming the flag and the value,
    exit code 2 (argparse prints its usage block first); ``--help`` prints the usage as ever. A flag that holds
    one value is refused when given twice (:class:`_StoreOnce`). Subparsers are of the same class. A usage
    error depends on the command line alone: of several processes a launcher started on a machine, the first
    prints it (:func:`user_error_line`)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.register("action", None, _StoreOnce)
        self.register("action", "store", _StoreOnce)

    def parse_known_args(self, args=None, namespace=None):  # type: ignore[override]
        self.flags_given: dict[str, str] = {}  # the flags of this parse, for _StoreOnce
        return super().parse_known_args(args, namespace)

    def parse_args(self, args=None, namespace=None):  # type: ignore[override]
        """argparse's, with arguments no option takes named by the verb they were given to (``agg-bench env
        extra`` is ``agg-bench env``'s error, and its --help lists the options), not by the top parser."""
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:
            verb = next((a.choices.get(getattr(parsed, a.dest, None) or "") for a in self._actions
                         if isinstance(a, argparse._SubParsersAction)), None)
            (verb or self).error(f"unrecognized arguments: {' '.join(extras)}")
        return parsed

    def error(self, message: str) -> NoReturn:
        _print_user_error(self.prog, mark_alike(UserError(f"{message} ({self.prog} --help lists the options)")))
        self.exit(2)
