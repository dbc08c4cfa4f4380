"""CPU threads of the harness's processes: short OpenMP spin-waits, and thread counts matched to the cores
a process may use.

OpenMP threads that wait for each other spin on their core before they sleep: libgomp (torch's OpenMP
runtime on Linux) spins 300,000 times per wait unless told otherwise. Beside other busy processes a
spinning thread holds a core that the thread it waits for needs, and a multi-threaded job slows down
several times over. Sleeping at once (``OMP_WAIT_POLICY=PASSIVE``) fixes that but slows an idle machine,
because every small operator then wakes its threads from sleep. Spinning 10,000 times, then sleeping
(``OMP_WAIT_POLICY=PASSIVE`` with ``GOMP_SPINCOUNT=10000``) keeps both. Measured on a 2-core Xeon, 150
steps of ``config/pretrain.yaml`` on 2 threads, process wall time: idle 15.6 s (libgomp's default), 23.2 s
(PASSIVE), 15.6 s (PASSIVE, 10,000 spins); beside two busy processes 58-129 s, 30-93 s and 38-48 s
(docs/design.md, "Threads").

libgomp reads both variables once, when torch is imported, so ``agg_bench/__init__.py`` calls
:func:`short_openmp_waits` before any module of the package imports torch, and this module imports
nothing heavy.
"""
from __future__ import annotations

import os

WAIT_POLICY = "OMP_WAIT_POLICY"
SPIN_COUNT = "GOMP_SPINCOUNT"  # libgomp's spins before a waiting thread sleeps; other runtimes ignore it
SPINS = 10_000


def short_openmp_waits() -> None:
    """``OMP_WAIT_POLICY=PASSIVE`` and ``GOMP_SPINCOUNT=10000`` in this process's environment (children
    inherit them), unless the user set either. It takes effect only where torch is not imported yet."""
    if os.environ.get(WAIT_POLICY) or os.environ.get(SPIN_COUNT):
        return
    os.environ[WAIT_POLICY] = "PASSIVE"
    os.environ[SPIN_COUNT] = str(SPINS)


def usable_cores() -> int | None:
    """The CPUs this process may run on (its affinity mask, e.g. ``taskset`` or a cgroup's cpuset), else
    the machine's count; None where neither is known."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count()
