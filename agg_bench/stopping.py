"""How a command stops on SIGTERM and SIGINT: the signal is never lost, and a second one ends the process.

Every command runs under :func:`stop_signals` (:func:`agg_bench.errors.run_command` enters it), whose
handler, in the main thread, remembers the first signal and then:

- **outside safe points** (importing, loading a config, a command that writes nothing until its end)
  raises :class:`Interrupted` at once, so the command stops where it is and its claims clean up as for
  any exception;
- **inside** :func:`safe_points` (a training run from before its folder is claimed until its summary is
  written) only remembers it. The run raises :class:`Interrupted` itself, at points where stopping leaves
  consistent files: :func:`check` is called before every transformer call (rollout, train phase,
  evaluation), between the phases of an iteration, between the steps of building the model, and the
  block raises the signal when it ends. From an update's first optimizer step until its record is written
  the run :func:`hold` s: the weights match no record there, so the signal waits for the record and the
  run's checkpoint then keeps the iteration.

A signal is only ever *remembered* by the handler; raising is a consequence, never the only trace. Code
that runs in a finaliser (``__del__``, a weakref callback) cannot let an exception out: Python prints
"Exception ignored in ..." and goes on. A handler that raised there would lose the signal, and one that
had marked it as delivered would then ignore every later one. Here the signal stays pending until a
command reports it (:func:`handled`, which ``run_command`` calls when it turns :class:`Interrupted` into
exit code 128 + N): every :func:`check` until then raises again, and so does the end of the outermost
:func:`stop_signals` block.

A **second** signal ends the process at once, with exit code 128 + N: the user (or a scheduler whose
grace period ran out) wants it gone. The handler writes one line to stderr, runs the cleanups registered
with :func:`at_exit_at_once` (the output claims of :mod:`agg_bench.outdir` release their lock files, and
folders they made that are still empty: no lone lock is left behind; a campaign kills the process groups
of the processes it supervises, so none outlives it) and calls ``os._exit``. What the command had written
stays as a killed process leaves it: whole files, and no ``summary.json`` for a run (a rerun replaces the
attempt, ``--resume`` continues it).

**Processes that stop together.** The processes of a distributed run (torchrun) each get the signal, at
slightly different moments, and must stop at the same point: one that stopped while another went on into a
collective would leave that one waiting for it, then failing ("connection closed by peer") instead of
stopping. Under :func:`together` (the training loop, when it runs on several processes) :func:`check` is a
point every process reaches in the same order (before each iteration, between its phases, between the steps
of building the model): the processes exchange the signal each received (one collective, through the
run's failure exchange) and all raise :class:`Interrupted` for it at that same check, a process that received
none yet included. Those points come often enough for a deadline: every sampler step of the rollout (every
process samples the whole batch: :class:`agg_bench.machine.distributed.ShareView`) and, with ``train.shard:
fsdp``, every transformer call (a sharded forward is a collective, so every process makes the same calls), in
the update too until its first optimizer step. :func:`check_alone` (before an unsharded model's call in the
update, which the processes' shares may make a different number of times, with no collective until the
gradient's all-reduce) defers to the next :func:`check`: there an unsharded run's update goes on to its
record, as it would from its first optimizer step on anyway.

Outside the main thread no handler can be installed; there, and outside any :func:`stop_signals`
block, :func:`check` does nothing. Nothing is left installed after the outermost block ends: the
caller's handlers are back and the pending state is cleared, so one process may run many commands.
"""
from __future__ import annotations

import contextlib
import os
import signal
import threading
from types import FrameType
from typing import Any, Callable, Iterator

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class Interrupted(KeyboardInterrupt):
    """The command was stopped by signal ``signum`` (SIGTERM or SIGINT)."""

    def __init__(self, signum: int):
        self.signum = signum
        super().__init__(signal.Signals(signum).name)


class _StopState:
    """The process's one pending-signal state (signal handlers are per process, so this is too)."""

    def __init__(self) -> None:
        self.depth = 0  # nested stop_signals blocks
        self.installed = False  # handlers installed by the outermost block (main thread only)
        self.previous: dict[int, Callable[[int, FrameType | None], Any] | int | None] = {}
        self.name = "agg-bench"
        self.received: int | None = None  # the first signal, until the outermost block ends
        self.handled = False  # a command reported it (exit code 128 + N)
        self.safe_depth = 0  # inside safe_points(): the handler only remembers
        self.at_exit: dict[int, Callable[[], None]] = {}  # cleanups before a second signal's os._exit

        self.together: Callable[[int], int] | None = None  # the processes' exchange, under together()
        self.agreed: int | None = None  # the signal the processes stopped for, under together()
        self.held = False  # between hold() and release(): checks leave a signal pending

    def reset(self) -> None:
        self.received, self.handled, self.safe_depth, self.held = None, False, 0, False


_STATE = _StopState()


def _exit_at_once(signum: int) -> None:
    """The second signal: one line, the registered cleanups (claims' locks), then ``os._exit(128 + N)``."""
    name = signal.Signals(signum).name
    try:
        os.write(2, f"{_STATE.name}: {name} again: stopping at once\n".encode())
    except OSError:
        pass
    for cleanup in list(_STATE.at_exit.values()):
        try:
            cleanup()
        except Exception:  # the process ends whatever a cleanup does
            pass
    os._exit(128 + signum)


def _handle(signum: int, frame) -> None:
    if _STATE.received is not None:
        _exit_at_once(signum)
    _STATE.received = signum
    if _STATE.safe_depth == 0:
        raise Interrupted(signum)


@contextlib.contextmanager
def stop_signals(name: str = "agg-bench") -> Iterator[None]:
    """While active, SIGTERM and SIGINT stop the command as the module docstring says; ``name`` (the
    command, ``agg-bench run``) heads the line a second signal prints. Blocks nest; the outermost one
    installs the handlers (in the main thread), and when it ends without an exception a signal that no
    code has raised yet is raised (:class:`Interrupted`), then the caller's handlers are restored and
    the pending state cleared."""
    state = _STATE
    outermost = state.depth == 0
    if outermost:
        state.reset()
        state.name = name
        if threading.current_thread() is threading.main_thread():
            for signum in SIGNALS:
                state.previous[signum] = signal.signal(signum, _handle)
            state.installed = True
    state.depth += 1
    try:
        yield
        if outermost:
            check()
    finally:
        state.depth -= 1
        if outermost:
            if state.installed:
                for number, handler in state.previous.items():
                    signal.signal(number, handler)
            state.previous.clear()
            state.installed = False
            state.reset()


@contextlib.contextmanager
def safe_points() -> Iterator[None]:
    """A block in which a first signal only is remembered: the block's code stops at its own
    :func:`check` calls, and a signal still pending when the block ends is raised then. Outside
    :func:`stop_signals` (no handler of ours) it changes nothing."""
    _STATE.safe_depth += 1
    try:
        yield
    finally:
        _STATE.safe_depth -= 1
    check()


@contextlib.contextmanager
def ending_at_once() -> Iterator[None]:
    """While active, SIGTERM and SIGINT end the process at once, by their default action: for a call that
    blocks inside C++ code, where no handler of Python runs until it returns, and before which the command
    has written nothing (joining a distributed run's process group: its rendezvous waits up to the collective
    timeout for processes that may never come). A signal that came before is raised first, as :func:`check`
    raises it; outside the main thread's :func:`stop_signals` it changes nothing."""
    if not _STATE.installed:
        yield
        return
    check()
    previous = {signum: signal.signal(signum, signal.SIG_DFL) for signum in SIGNALS}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def check() -> None:
    """Raise :class:`Interrupted` if a signal arrived and no command has reported it yet; cheap (a
    safe point of a loop calls it every transformer call). Under :func:`together`: if any process received
    one, every process raises it here (a collective: every process calls this in the same order)."""
    state = _STATE
    if state.held:  # the state is between two the records describe: the signal waits for release()
        return
    if state.together is not None:
        if state.agreed is None:
            mine = state.received if state.received is not None and not state.handled else 0
            agreed = state.together(mine)
            if not agreed:
                return
            state.agreed = agreed
        if not state.handled:
            raise Interrupted(state.agreed)
        return
    if state.received is not None and not state.handled:
        raise Interrupted(state.received)


def check_alone() -> None:
    """:func:`check` at a point the processes of a distributed run do not reach in step (a transformer call:
    their shares may make different numbers of them): under :func:`together` it leaves a signal to the next
    :func:`check`, where every process stops; otherwise it is :func:`check`."""
    if _STATE.together is None:
        check()


def hold() -> None:
    """From now until :func:`release`, :func:`check` and :func:`check_alone` leave a first signal pending
    instead of raising it (a second one still ends the process at once). A run holds from an update's first
    optimizer step until that iteration's record is written: the weights then match no record, and a stop
    there would lose the iteration and every one since the last checkpoint; at the next check after the record
    the run stops and its checkpoint keeps them. Every process of a distributed run holds and releases at the
    same points (their optimizer steps are collective), so the checks they skip are the same ones."""
    _STATE.held = True


def release() -> None:
    """End :func:`hold`: the next check raises a pending signal."""
    _STATE.held = False


def held() -> bool:
    """Whether the process holds signals (:func:`hold`): a run's weights then match none of its records."""
    return _STATE.held


@contextlib.contextmanager
def together(exchange: Callable[[int], int]) -> Iterator[None]:
    """While active, the processes of a distributed run stop together (the module docstring): ``exchange``
    takes this process's pending signal (0: none) and returns one that some process received (0: none), a
    collective of all the processes. After they stopped for one, :func:`check` raises it again until a
    command reports it, without exchanging again."""
    state = _STATE
    previous = state.together, state.agreed
    state.together, state.agreed = exchange, None
    try:
        yield
    finally:
        state.together, state.agreed = previous


def pending() -> int | None:
    """The signal that arrived and was not reported yet, or None."""
    return None if _STATE.handled else _STATE.received


def handled(err: BaseException) -> None:
    """``err`` (an :class:`Interrupted`) was reported as the command's exit code: its signal is done with,
    and later checks of this command no longer raise. A second signal still ends the process at once. A
    process that stopped with the others of a distributed run before its own signal came (:func:`together`)
    counts that stop as its first signal, so its own, arriving late, ends it as a second would."""
    if isinstance(err, Interrupted) and _STATE.received in (None, err.signum):
        _STATE.received = err.signum
        _STATE.handled = True


def at_exit_at_once(key: int, cleanup: Callable[[], None] | None) -> None:
    """Register (or, with None, remove) ``cleanup`` under ``key``: run before a second signal ends the
    process. Kept to a few system calls (an output claim unlinks its lock file, a campaign kills the process
    group it supervises)."""
    if cleanup is None:
        _STATE.at_exit.pop(key, None)
    else:
        _STATE.at_exit[key] = cleanup
