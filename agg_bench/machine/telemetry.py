"""Measurement around any block of code: time, memory, saved activations, NVML power and energy.

Every tracker here is a small context manager that knows nothing about what it measures, so a
benchmark, a test or the training loop can wrap any block with it. ``Telemetry`` combines them into
the per-iteration fields of a metric record.

A value that does not apply on a device is ``None``, never 0: on CPU there is no allocator peak, no
NVML and no energy reading, on a MIG instance no utilisation, power or energy of its own (:mod:`.nvml`), and a
table must be able to tell "not measured" from "zero".

This module holds the timers, the memory peaks, the failure helpers and the ``Telemetry`` facade; the
saved-activation trackers live in :mod:`.activations`, NVML sampling in :mod:`.nvml` and the run's
environment in :mod:`.envinfo` (their public names are importable from here as well).
"""
from __future__ import annotations

import re
import sys
import time
from contextlib import ExitStack, contextmanager, nullcontext
from pathlib import Path
from typing import Any, Iterator

import torch

from ..records import PHASE_PEAK_KEY, STANDARD_PHASES, TELEMETRY_KEYS  # noqa: F401 (also imported from here)
# re-exported: the activations' trackers and the environment are imported from here too
from .activations import SavedActivations, counting_regions, region_tracker, saved_activation_region  # noqa: F401 (re-exported)
from .envinfo import environment  # noqa: F401 (re-exported)
from .devices import is_cuda
from .nvml import NVMLSampler, NVMLSummary


# --------------------------------------------------------------------------------------------------
# Time
# --------------------------------------------------------------------------------------------------


class PhaseTimer:
    """Elapsed seconds of the block it wraps, readable as ``elapsed_s`` after the block ends.

    On a CUDA device (with ``use_cuda_events``) two CUDA events are recorded on the current stream, so
    the time covers the GPU work queued inside the block without stalling the GPU; ``elapsed_s``
    synchronizes on the end event before reading. Otherwise ``time.perf_counter`` is used; on a CUDA
    device without events the device is synchronized at both ends so the wall time still covers the
    queued GPU work.

    ``cpu_s`` is the CPU time the whole process used inside the block (``time.process_time``: user +
    system time of every thread). Process time, not the calling thread's, because torch runs a CPU
    operator's work on its intra-op threads, which thread time would miss; it therefore exceeds the
    wall time when several threads compute at once. Unlike wall time it does not grow while other
    processes hold the cores, which makes it the stable measure of work on a shared CPU. On a GPU it
    counts only the host's share (launching kernels, waiting), so there the event time is the
    measure.
    """

    def __init__(self, device: torch.device | str = "cpu", use_cuda_events: bool = True):
        self.device = torch.device(device)
        self._events = use_cuda_events and is_cuda(self.device)
        self._start: Any = None
        self._end: Any = None
        self._cpu_start: float | None = None
        self._cpu_end: float | None = None

    def _sync(self) -> None:
        if is_cuda(self.device):
            torch.cuda.synchronize(self.device)

    def __enter__(self) -> "PhaseTimer":
        self._end = self._cpu_end = None
        self._cpu_start = time.process_time()
        if self._events:
            stream = torch.cuda.current_stream(self.device)
            self._start = torch.cuda.Event(enable_timing=True)
            self._start.record(stream)
        else:
            self._sync()
            self._start = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._events:
            self._end = torch.cuda.Event(enable_timing=True)
            self._end.record(torch.cuda.current_stream(self.device))
        else:
            self._sync()
            self._end = time.perf_counter()
        self._cpu_end = time.process_time()

    @property
    def elapsed_s(self) -> float:
        """Seconds between entering and leaving the block; raises if the block has not ended."""
        if self._start is None or self._end is None:
            raise RuntimeError("PhaseTimer.elapsed_s read before the timed block ended")
        if self._events:
            self._end.synchronize()
            return self._start.elapsed_time(self._end) / 1000.0
        return self._end - self._start

    @property
    def cpu_s(self) -> float:
        """CPU seconds of this process (all its threads) between entering and leaving the block."""
        if self._cpu_start is None or self._cpu_end is None:
            raise RuntimeError("PhaseTimer.cpu_s read before the timed block ended")
        return self._cpu_end - self._cpu_start


# --------------------------------------------------------------------------------------------------
# Memory
# --------------------------------------------------------------------------------------------------


class CudaMemory:
    """Peak bytes the CUDA caching allocator allocated and reserved inside the block.

    Resets the device's peak statistics on entry. On a non-CUDA device both fields stay ``None``.
    :meth:`split` cuts the block into stretches, each with its own peak (a phase's): the peak statistics are
    reset at each cut, and the block's peaks are the largest of its stretches', so they are what they would
    be without the cuts.
    """

    def __init__(self, device: torch.device | str):
        self.device = torch.device(device)
        self.peak_alloc_bytes: int | None = None
        self.peak_reserved_bytes: int | None = None
        self._alloc = self._reserved = 0  # the largest peaks of the stretches before the last cut

    @property
    def measures(self) -> bool:
        return is_cuda(self.device)

    def __enter__(self) -> "CudaMemory":
        self.peak_alloc_bytes = self.peak_reserved_bytes = None
        self._alloc = self._reserved = 0
        if self.measures:
            torch.cuda.reset_peak_memory_stats(self.device)
        return self

    def split(self) -> int | None:
        """End the stretch since the last cut (or the block's start): its peak allocated bytes (None off CUDA),
        taken into the block's peaks; the next stretch starts now."""
        if not self.measures:
            return None
        alloc = int(torch.cuda.max_memory_allocated(self.device))
        self._alloc = max(self._alloc, alloc)
        self._reserved = max(self._reserved, int(torch.cuda.max_memory_reserved(self.device)))
        torch.cuda.reset_peak_memory_stats(self.device)
        return alloc

    def __exit__(self, *exc: object) -> None:
        if self.measures:
            self.peak_alloc_bytes = max(self._alloc, int(torch.cuda.max_memory_allocated(self.device)))
            self.peak_reserved_bytes = max(self._reserved, int(torch.cuda.max_memory_reserved(self.device)))


def rss_peak_bytes() -> int | None:
    """Peak resident set size of this process in bytes, since start or the last ``reset_rss_peak``.

    Reads ``VmHWM`` from ``/proc/self/status`` where it exists (Linux), because unlike
    ``resource.getrusage`` it can be reset between iterations; elsewhere falls back to ``ru_maxrss``
    (KiB on Linux, bytes on macOS). ``None`` where neither is available.
    """
    try:
        status = Path("/proc/self/status").read_text()
        match = re.search(r"^VmHWM:\s+(\d+)\s+kB", status, re.MULTILINE)
        if match:
            return int(match.group(1)) * 1024
    except OSError:
        pass
    try:
        import resource
    except ImportError:
        return None
    max_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(max_rss) if sys.platform == "darwin" else int(max_rss) * 1024


def reset_rss_peak() -> bool:
    """Reset the peak RSS that ``rss_peak_bytes`` reports to the current RSS (Linux >= 4.0).

    Returns False, changing nothing, where the kernel does not allow it; the peak then stays the
    process-lifetime peak.
    """
    try:
        with open("/proc/self/clear_refs", "w") as clear_refs:
            clear_refs.write("5")
        return True
    except OSError:
        return False


# --------------------------------------------------------------------------------------------------
# Per-iteration record
# --------------------------------------------------------------------------------------------------


class Telemetry:
    """The measured fields of one training iteration, for the metric record.

    Usage::

        telemetry = Telemetry(device)
        with telemetry.iteration():
            with telemetry.phase("rollout"):
                ...
            with telemetry.phase("train", saved_activations=True):
                ...
        record.update(telemetry.record())

    ``iteration()`` resets every peak (allocator, RSS, saved activations, NVML) and times
    ``t_iter_s`` and ``t_iter_cpu_s``; ``phase(name)`` adds the block's wall time to ``t_{name}_s`` and
    its CPU time to ``t_{name}_cpu_s`` (a phase may run several times per iteration). With
    ``enabled=False`` only times are taken (``perf_counter``, synchronizing a CUDA device at block
    ends, and process CPU time) and every other field is None: the baseline for measuring what
    telemetry itself costs.

    Saved activations are counted exactly, one Python call per saved tensor, which is not free when
    the network is small (a tiny DiT's forward and backward take a few milliseconds for over a
    hundred saved tensors). ``saved_activations`` says in which iterations phases that ask for the
    count get it: ``"every"``, ``"first"`` (the run's first iteration; the shapes of an update, hence
    its count, repeat from one iteration to the next) or ``"never"``. An iteration without the count
    records None. ``iterations_before``: iterations of the run measured before this object, by the
    process that a resumed run continues; with any, this object measures no first iteration, so a resumed
    run records what an uninterrupted one does.
    """

    SAVED_ACTIVATION_MODES = ("every", "first", "never")

    def __init__(self, device: torch.device | str, enabled: bool = True, nvml_interval_s: float = 0.05,
                 saved_activations: str = "every", iterations_before: int = 0):
        if saved_activations not in self.SAVED_ACTIVATION_MODES:
            raise ValueError(f"saved_activations must be one of {', '.join(self.SAVED_ACTIVATION_MODES)}, "
                             f"not {saved_activations!r}")
        self.device = torch.device(device)
        self.enabled = enabled
        self.saved_activations = saved_activations
        self._iterations = iterations_before  # iterations of the run measured so far
        self._sampler = NVMLSampler(self.device, nvml_interval_s) if enabled else None
        self._clear()

    def _clear(self) -> None:
        self._iteration_timer: PhaseTimer | None = None
        self._phase_timers: dict[str, list[PhaseTimer]] = {}
        self._memory: CudaMemory | None = None
        self._phase_peaks: dict[str, int] = {}  # per phase name, its largest CUDA peak this iteration
        self._depth = 0  # phases open
        self._saved: SavedActivations | None = None
        self._saved_used = False
        self._rss_peak: int | None = None
        self._nvml = NVMLSummary()

    def _timer(self) -> PhaseTimer:
        return PhaseTimer(self.device, use_cuda_events=self.enabled)

    @contextmanager
    def iteration(self) -> Iterator["Telemetry"]:
        """Measure one iteration; fields of the previous one are forgotten on entry."""
        self._clear()
        self._iterations += 1
        timer = self._timer()
        try:
            with ExitStack() as stack:
                if self.enabled:
                    assert self._sampler is not None  # made for an enabled Telemetry
                    self._memory = CudaMemory(self.device)
                    self._saved = SavedActivations()
                    reset_rss_peak()
                    self._sampler.start()
                    stack.callback(self._finish_iteration)
                    stack.enter_context(self._memory)
                stack.enter_context(timer)
                yield self
        finally:
            # Kept on failure too: an out-of-memory iteration still reports its time and peaks.
            self._iteration_timer = timer

    def _finish_iteration(self) -> None:
        assert self._sampler is not None  # called only for an enabled Telemetry, which made one
        self._nvml = self._sampler.stop()
        self._rss_peak = rss_peak_bytes()

    def _counts_saved(self) -> bool:
        mode = self.saved_activations
        return self.enabled and (mode == "every" or (mode == "first" and self._iterations <= 1))

    @contextmanager
    def phase(self, name: str, saved_activations: bool | str = False) -> Iterator["Telemetry"]:
        """Time the block as phase ``name``.

        ``saved_activations`` also counts the bytes autograd saves for backward (see
        ``SavedActivations``): ``True`` or ``"all"`` every tensor saved inside the block,
        ``"regions"`` only those saved inside ``saved_activation_region()`` blocks within it.
        Whether this iteration counts at all is the object's ``saved_activations`` mode.
        """
        if saved_activations not in (False, True, "all", "regions"):
            raise ValueError(f"saved_activations must be False, True, 'all' or 'regions', not {saved_activations!r}")
        timer = self._timer()
        track = bool(saved_activations) and self._counts_saved()
        saved = self._saved
        if track and saved is None:
            saved = self._saved = SavedActivations()
        # A tracked phase inside another tracked phase is already being counted.
        tracker = saved if track and saved is not None and saved_activations != "regions" and not saved.active \
            else None
        arm = track and saved_activations == "regions" and region_tracker.get() is None
        token = region_tracker.set(saved) if arm else None
        # a phase not inside another gets its own CUDA peak (the stretch before it is cut off first)
        memory = self._memory if self._depth == 0 and self._memory is not None and self._memory.measures else None
        if memory is not None:
            memory.split()
        self._depth += 1
        try:
            with timer, (tracker if tracker is not None else nullcontext()):
                yield self
        finally:
            self._depth -= 1
            if memory is not None:
                peak = memory.split()
                if peak is not None:
                    self._phase_peaks[name] = max(self._phase_peaks.get(name, 0), peak)
            if token is not None:
                region_tracker.reset(token)
            self._phase_timers.setdefault(name, []).append(timer)
            self._saved_used = self._saved_used or track

    def record(self) -> dict[str, Any]:
        """Fields of the last iteration: ``TELEMETRY_KEYS`` plus ``t_{name}_s`` and ``t_{name}_cpu_s``
        for any other phase name. ``t_*_s`` are wall-clock (CUDA-event) seconds, ``t_*_cpu_s`` the
        process's CPU seconds (see ``PhaseTimer``).

        None marks a value that was not measured: a phase that did not run, a field the device does
        not have, or anything but times when telemetry is disabled. On a CUDA device, each phase that ran
        and was not inside another also gets its own peak allocated bytes (``PHASE_PEAK_KEY``, e.g.
        ``peak_alloc_train_bytes``), after these.
        """
        record: dict[str, Any] = {}
        names = list(STANDARD_PHASES) + [n for n in self._phase_timers if n not in STANDARD_PHASES]
        for name in names:
            timers = self._phase_timers.get(name)
            record[f"t_{name}_s"] = sum(t.elapsed_s for t in timers) if timers else None
        record["t_iter_s"] = self._iteration_timer.elapsed_s if self._iteration_timer else None
        for name in names:
            timers = self._phase_timers.get(name)
            record[f"t_{name}_cpu_s"] = sum(t.cpu_s for t in timers) if timers else None
        record["t_iter_cpu_s"] = self._iteration_timer.cpu_s if self._iteration_timer else None
        memory = self._memory
        record["peak_alloc_bytes"] = memory.peak_alloc_bytes if memory else None
        record["peak_reserved_bytes"] = memory.peak_reserved_bytes if memory else None
        record["nvml_peak_used_bytes"] = self._nvml.nvml_peak_used_bytes
        record["saved_activation_peak_bytes"] = (
            self._saved.peak_bytes if self._saved_used and self._saved is not None else None
        )
        record["rss_peak_bytes"] = self._rss_peak
        record["energy_j"] = self._nvml.energy_j
        record["gpu_util_mean"] = self._nvml.gpu_util_mean
        record["power_mean_w"] = self._nvml.power_mean_w
        for name, peak in self._phase_peaks.items():  # on a GPU: each phase's own peak (PHASE_PEAK_KEY)
            record[PHASE_PEAK_KEY.format(phase=name)] = peak
        return record

    def close(self) -> None:
        """Stop the NVML sampler and release NVML."""
        if self._sampler is not None:
            self._sampler.close()

    def __enter__(self) -> "Telemetry":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# --------------------------------------------------------------------------------------------------
# Failures
# --------------------------------------------------------------------------------------------------


def is_oom_error(exc: BaseException) -> bool:
    """True when ``exc`` means a device or the host ran out of memory.

    Covers ``torch.OutOfMemoryError`` (``torch.cuda.OutOfMemoryError`` is the same class), Python's
    ``MemoryError``, and RuntimeErrors whose message says "out of memory" (backends that do not raise
    the dedicated type) or "can't allocate memory" (torch's CPU allocator).
    """
    if isinstance(exc, (torch.OutOfMemoryError, MemoryError)):
        return True
    message = str(exc).lower()
    return isinstance(exc, RuntimeError) and ("out of memory" in message or "can't allocate memory" in message)


def memory_at_failure(device: torch.device | str) -> dict[str, int | None]:
    """Bytes the CUDA caching allocator holds now (``allocated_bytes``, ``reserved_bytes``); None on
    a non-CUDA device. Call it in the handler of an out-of-memory error, before freeing anything."""
    device = torch.device(device)
    if not is_cuda(device):
        return {"allocated_bytes": None, "reserved_bytes": None}
    return {
        "allocated_bytes": int(torch.cuda.memory_allocated(device)),
        "reserved_bytes": int(torch.cuda.memory_reserved(device)),
    }
