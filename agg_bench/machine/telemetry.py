"""Measurement around any block of code: time, memory, saved activations, NVML power and energy.

Every tracker here is a small context manager that knows nothing about what it measures, so a
benchmark, a test or the training loop can wrap any block with it. ``Telemetry`` combines them into
the per-iteration fields of a metric record.

A value that does not apply on a device is ``None``, never 0: on CPU there is no allocator peak, no
NVML and no energy reading, and a table must be able to tell "not measured" from "zero".
"""
from __future__ import annotations

import datetime
import itertools
import os
import platform
import re
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from contextlib import ExitStack, contextmanager, nullcontext
from contextvars import ContextVar
from dataclasses import asdict, dataclass
from importlib import metadata
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
from torch import nn

from ..results.records import STANDARD_PHASES, TELEMETRY_KEYS  # noqa: F401  (also imported from here)
from ..threads import usable_cores


def _is_cuda(device: torch.device) -> bool:
    return device.type == "cuda"


def _cuda_index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


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
        self._events = use_cuda_events and _is_cuda(self.device)
        self._start: Any = None
        self._end: Any = None
        self._cpu_start: float | None = None
        self._cpu_end: float | None = None

    def _sync(self) -> None:
        if _is_cuda(self.device):
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
    """

    def __init__(self, device: torch.device | str):
        self.device = torch.device(device)
        self.peak_alloc_bytes: int | None = None
        self.peak_reserved_bytes: int | None = None

    def __enter__(self) -> "CudaMemory":
        self.peak_alloc_bytes = self.peak_reserved_bytes = None
        if _is_cuda(self.device):
            torch.cuda.reset_peak_memory_stats(self.device)
        return self

    def __exit__(self, *exc: object) -> None:
        if _is_cuda(self.device):
            self.peak_alloc_bytes = int(torch.cuda.max_memory_allocated(self.device))
            self.peak_reserved_bytes = int(torch.cuda.max_memory_reserved(self.device))


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


class _SavedHandle:
    """What autograd stores in place of a saved tensor while ``SavedActivations`` is active.

    Releasing the handle (when autograd frees the graph) releases its bytes from the live count.
    """

    __slots__ = ("tensor", "version", "key", "owner")

    def __init__(self, tensor: torch.Tensor, key: Any, owner: "SavedActivations | None"):
        # A detached alias shares storage and version counter but not the graph, so the handle does
        # not keep the autograd graph alive through a reference cycle (a tensor that does not
        # require grad has no graph to keep).
        self.tensor = tensor.detach() if tensor.requires_grad else tensor
        self.version = tensor._version
        self.key = key
        self.owner = owner

    def __del__(self) -> None:
        if self.owner is not None:
            self.owner._release(self.key)


class SavedActivations:
    """Peak bytes of tensors that autograd holds for a backward pass, counted exactly.

    Accounting rule: every tensor saved for backward while the tracker is active is counted by the
    size of its underlying storage (``untyped_storage().nbytes()``), and each storage once however
    many saved tensors or views share it. A storage leaves the count when autograd frees the last
    saved tensor that uses it (after backward, or when the graph is dropped). Storages of
    ``nn.Parameter`` objects (saved directly or as a view such as ``weight.t()``) are not counted,
    trainable or frozen: they live as long as the model whether or not a backward runs. Everything
    else is counted, including inputs that do not require grad (latents, conditioning) and buffers,
    since the graph keeps them alive. The count depends only on which tensors autograd saves, never
    on an allocator, so it is the same on every device for the same kernels (attention backends on
    different devices may save different tensors) and works on the ``meta`` device.

    ``peak_bytes`` is the largest live count seen while active; ``live_bytes`` is the current count.
    The tracker can be entered several times; counts carry over, and ``reset()`` restarts the peak.
    Trackers do not nest: an inner one sees the tensors saved inside it, the outer one does not.

    While active, autograd skips its own in-place modification check for saved tensors (a property
    of ``saved_tensors_hooks``); the tracker restores it by comparing version counters on unpack.
    Tensors saved inside non-reentrant gradient checkpointing regions are handled by checkpointing's
    own hooks and are not seen.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._refs: dict[Any, int] = {}
        self._sizes: dict[Any, int] = {}
        # Handles are released from finalizers, which can run on any thread and at any allocation,
        # even inside ``_pack``; they only queue the key, and the count is settled under the lock.
        self._released: deque[Any] = deque()
        self._live_bytes = 0
        self._peak_bytes = 0
        self._hooks: Any = None

    @property
    def live_bytes(self) -> int:
        """Bytes of saved storages autograd still holds."""
        with self._lock:
            self._settle_releases()
            return self._live_bytes

    @property
    def peak_bytes(self) -> int:
        """Largest ``live_bytes`` since creation or ``reset()``."""
        with self._lock:
            return self._peak_bytes

    def reset(self) -> None:
        """Forget the peak: it restarts from the bytes that are live now."""
        with self._lock:
            self._settle_releases()
            self._peak_bytes = self._live_bytes

    @property
    def active(self) -> bool:
        """Whether the tracker's hooks are installed (inside its ``with`` block)."""
        return self._hooks is not None

    def _settle_releases(self) -> None:
        while self._released:
            key = self._released.popleft()
            count = self._refs[key] - 1
            if count == 0:
                del self._refs[key]
                self._live_bytes -= self._sizes.pop(key)
            else:
                self._refs[key] = count

    def _pack(self, tensor: torch.Tensor) -> Any:
        # Called for every saved tensor: kept to a few attribute reads and dict operations.
        base = tensor._base
        if isinstance(tensor if base is None else base, nn.Parameter):
            return tensor
        try:
            storage = tensor.untyped_storage()
            key, nbytes = storage._cdata, None
        except (RuntimeError, NotImplementedError, AttributeError):
            # Tensors without a plain storage (sparse, some subclasses) count by their own size,
            # each as its own entry.
            storage, key, nbytes = None, ("tensor", next(_unshared_keys)), tensor.numel() * tensor.element_size()
        with self._lock:
            if self._released:
                self._settle_releases()
            count = self._refs.get(key, 0)
            if count == 0:
                nbytes = int(storage.nbytes()) if nbytes is None else nbytes
                self._sizes[key] = nbytes
                self._live_bytes += nbytes
                if self._live_bytes > self._peak_bytes:
                    self._peak_bytes = self._live_bytes
            self._refs[key] = count + 1
        return _SavedHandle(tensor, key, self)

    @staticmethod
    def _unpack(packed: Any) -> torch.Tensor:
        if type(packed) is not _SavedHandle:
            return packed
        tensor = packed.tensor
        if tensor._version != packed.version:
            raise RuntimeError(
                "one of the variables needed for gradient computation has been modified by an "
                f"inplace operation: saved at version {packed.version}, now at version "
                f"{tensor._version}"
            )
        return tensor

    def _release(self, key: Any) -> None:
        self._released.append(key)

    def __enter__(self) -> "SavedActivations":
        if self.active:
            raise RuntimeError("SavedActivations is already active")
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        hooks, self._hooks = self._hooks, None
        hooks.__exit__(*exc)


_unshared_keys = itertools.count()


# The tracker that ``saved_activation_region()`` blocks count into, set by a phase that counts
# saved activations in regions only; None outside such a phase.
_region_tracker: ContextVar[SavedActivations | None] = ContextVar("agg_bench_saved_region", default=None)


@contextmanager
def saved_activation_region() -> Iterator[None]:
    """Mark a block whose saved tensors belong to the count of a ``Telemetry.phase(...,
    saved_activations="regions")`` around it (the training loop marks the policy network's
    forward). Outside such a phase, or inside a tracker that is already counting, it does nothing.
    """
    tracker = _region_tracker.get()
    if tracker is None or tracker.active:
        yield
        return
    with tracker:
        yield


@contextmanager
def counting_regions(tracker: SavedActivations) -> Iterator[SavedActivations]:
    """Count what ``saved_activation_region()`` blocks save into ``tracker``, as a phase with
    ``saved_activations="regions"`` does (the memory planner counts a forward this way)."""
    token = _region_tracker.set(tracker)
    try:
        yield tracker
    finally:
        _region_tracker.reset(token)


# --------------------------------------------------------------------------------------------------
# NVML
# --------------------------------------------------------------------------------------------------


def _normalize_uuid(uuid: Any) -> str:
    if isinstance(uuid, (bytes, bytearray)):
        text = uuid.decode("ascii", errors="replace") if len(uuid) != 16 else uuid.hex()
    else:
        text = str(uuid)
    text = text.strip().strip("\0").lower()
    for prefix in ("gpu-", "mig-"):
        if text.startswith(prefix):
            text = text[len(prefix):]
    return text.replace("-", "")


def _nvml_index_for(nvml: Any, cuda_index: int) -> int | None:
    """NVML index of the GPU torch calls ``cuda:cuda_index``, matched by UUID (so that
    ``CUDA_VISIBLE_DEVICES`` renumbering is respected); None when no NVML device matches."""
    wanted = _normalize_uuid(torch.cuda.get_device_properties(cuda_index).uuid)
    for nvml_index in range(nvml.nvmlDeviceGetCount()):
        handle = nvml.nvmlDeviceGetHandleByIndex(nvml_index)
        if _normalize_uuid(nvml.nvmlDeviceGetUUID(handle)) == wanted:
            return nvml_index
    return None


@dataclass
class NVMLSummary:
    """What an ``NVMLSampler`` saw between start and stop; every field None when NVML was unusable.

    nvml_peak_used_bytes: largest ``memory.used`` sampled; NVML counts every process on the GPU.
    gpu_util_mean: mean of the sampled ``utilization.gpu`` percentages.
    power_mean_w: mean of the sampled power draws, in watts.
    energy_j: energy between start and stop, from the difference of the GPU's total-energy counter,
        or from integrating the sampled power over time (trapezoids) where that counter is unsupported.
    n_samples: number of samples taken.
    """

    nvml_peak_used_bytes: int | None = None
    gpu_util_mean: float | None = None
    power_mean_w: float | None = None
    energy_j: float | None = None
    n_samples: int = 0

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class NVMLSampler:
    """Background thread that polls NVML for one GPU every ``interval_s`` between start and stop.

    Takes one sample on start and one on stop, so even a block shorter than the interval has data.
    The GPU is the one torch calls ``device``, found by UUID. When ``pynvml`` is missing, NVML fails
    to initialize, no NVML device matches, or ``device`` is not CUDA, the sampler does nothing and its
    summary is all None; a quantity the GPU does not support is None on its own.

    ``clock`` (seconds, monotonic) times the power samples for the energy fallback.
    """

    def __init__(
        self,
        device: torch.device | str,
        interval_s: float = 0.05,
        clock: Callable[[], float] = time.perf_counter,
    ):
        if interval_s <= 0:
            raise ValueError(f"NVMLSampler: interval_s = {interval_s!r}: expected a positive number")
        self.device = torch.device(device)
        self.interval_s = interval_s
        self._clock = clock
        self._lock = threading.Lock()
        self._stop_event = threading.Event()
        self._thread: threading.Thread | None = None
        self._nvml: Any = None
        self._handle: Any = None
        self.nvml_index: int | None = None
        self._unsupported: set[str] = set()
        self._summary = NVMLSummary()
        self._open()
        self._clear()

    @property
    def available(self) -> bool:
        """Whether NVML readings are being taken for this device."""
        return self._handle is not None

    def _open(self) -> None:
        if not _is_cuda(self.device):
            return
        try:
            import pynvml
        except ImportError:
            return
        try:
            pynvml.nvmlInit()
        except Exception:
            return
        try:
            index = _nvml_index_for(pynvml, _cuda_index(self.device))
            handle = None if index is None else pynvml.nvmlDeviceGetHandleByIndex(index)
        except Exception:
            index = handle = None
        if handle is None:
            _shutdown_quietly(pynvml)
            return
        self._nvml, self._handle, self.nvml_index = pynvml, handle, index

    def _clear(self) -> None:
        self._n_samples = 0
        self._used_peak: int | None = None
        self._util_sum, self._util_n = 0.0, 0
        self._power_sum_w, self._power_n = 0.0, 0
        self._power_integral_j = 0.0
        self._last_power: tuple[float, float] | None = None
        self._energy_start_mj: int | None = None

    def _query(self, quantity: str, read: Callable[[Any], Any]) -> Any:
        if quantity in self._unsupported:
            return None
        try:
            return read(self._handle)
        except Exception:
            # Unsupported on this GPU (or NVML went away): stop asking, report None for it.
            self._unsupported.add(quantity)
            return None

    def sample(self) -> None:
        """Take one reading now (the background thread calls this every interval)."""
        if not self.available:
            return
        nvml = self._nvml
        with self._lock:
            now = self._clock()
            memory = self._query("memory", nvml.nvmlDeviceGetMemoryInfo)
            utilization = self._query("utilization", nvml.nvmlDeviceGetUtilizationRates)
            power_mw = self._query("power", nvml.nvmlDeviceGetPowerUsage)
            self._n_samples += 1
            if memory is not None:
                used = int(memory.used)
                self._used_peak = used if self._used_peak is None else max(self._used_peak, used)
            if utilization is not None:
                self._util_sum += float(utilization.gpu)
                self._util_n += 1
            if power_mw is not None:
                power_w = power_mw / 1000.0
                self._power_sum_w += power_w
                self._power_n += 1
                if self._last_power is not None:
                    last_t, last_w = self._last_power
                    self._power_integral_j += 0.5 * (last_w + power_w) * (now - last_t)
                self._last_power = (now, power_w)

    def _run(self) -> None:
        while not self._stop_event.wait(self.interval_s):
            self.sample()

    def start(self) -> "NVMLSampler":
        """Forget previous readings, read the energy counter, sample, and start polling."""
        if self._thread is not None:
            raise RuntimeError("NVMLSampler.start called while already sampling")
        self._clear()
        self._summary = NVMLSummary()
        if not self.available:
            return self
        self._energy_start_mj = self._query("energy", self._nvml.nvmlDeviceGetTotalEnergyConsumption)
        self.sample()
        self._stop_event.clear()
        self._thread = threading.Thread(target=self._run, name="nvml-sampler", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> NVMLSummary:
        """Stop polling, take a last sample and return the summary (also kept as ``summary()``)."""
        if self._thread is None:
            return self._summary
        self._stop_event.set()
        self._thread.join()
        self._thread = None
        self.sample()
        energy_end_mj = self._query("energy", self._nvml.nvmlDeviceGetTotalEnergyConsumption)
        if self._energy_start_mj is not None and energy_end_mj is not None:
            energy_j: float | None = (energy_end_mj - self._energy_start_mj) / 1000.0
        elif self._power_n >= 2:
            energy_j = self._power_integral_j
        else:
            energy_j = None
        self._summary = NVMLSummary(
            nvml_peak_used_bytes=self._used_peak,
            gpu_util_mean=self._util_sum / self._util_n if self._util_n else None,
            power_mean_w=self._power_sum_w / self._power_n if self._power_n else None,
            energy_j=energy_j,
            n_samples=self._n_samples,
        )
        return self._summary

    def summary(self) -> NVMLSummary:
        """Summary of the last start/stop window (all None before the first stop)."""
        return self._summary

    def close(self) -> None:
        """Stop sampling and release NVML. Safe to call more than once."""
        self.stop()
        if self._nvml is not None:
            _shutdown_quietly(self._nvml)
        self._nvml = self._handle = None

    def __enter__(self) -> "NVMLSampler":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _shutdown_quietly(nvml: Any) -> None:
    try:
        nvml.nvmlShutdown()
    except Exception:
        pass


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
        if track and self._saved is None:
            self._saved = SavedActivations()
        # A tracked phase inside another tracked phase is already being counted.
        enter_tracker = track and saved_activations != "regions" and not self._saved.active
        arm = track and saved_activations == "regions" and _region_tracker.get() is None
        token = _region_tracker.set(self._saved) if arm else None
        try:
            with timer, (self._saved if enter_tracker else nullcontext()):
                yield self
        finally:
            if token is not None:
                _region_tracker.reset(token)
            self._phase_timers.setdefault(name, []).append(timer)
            self._saved_used = self._saved_used or track

    def record(self) -> dict[str, Any]:
        """Fields of the last iteration: ``TELEMETRY_KEYS`` plus ``t_{name}_s`` and ``t_{name}_cpu_s``
        for any other phase name. ``t_*_s`` are wall-clock (CUDA-event) seconds, ``t_*_cpu_s`` the
        process's CPU seconds (see ``PhaseTimer``).

        None marks a value that was not measured: a phase that did not run, a field the device does
        not have, or anything but times when telemetry is disabled.
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
    if not _is_cuda(device):
        return {"allocated_bytes": None, "reserved_bytes": None}
    return {
        "allocated_bytes": int(torch.cuda.memory_allocated(device)),
        "reserved_bytes": int(torch.cuda.memory_reserved(device)),
    }


# --------------------------------------------------------------------------------------------------
# Environment
# --------------------------------------------------------------------------------------------------


def _package_version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def _cpu_model() -> str | None:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def _git(*args: str) -> str | None:
    repo_dir = Path(__file__).resolve().parent
    try:
        result = subprocess.run(
            ["git", "--no-optional-locks", "-C", str(repo_dir), *args],
            capture_output=True, text=True, timeout=10, check=True,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return result.stdout.strip()


def _driver_version() -> str | None:
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except Exception:
        return None
    try:
        version = pynvml.nvmlSystemGetDriverVersion()
        return version.decode() if isinstance(version, bytes) else str(version)
    except Exception:
        return None
    finally:
        _shutdown_quietly(pynvml)


def environment() -> dict[str, Any]:
    """The machine and software a result was measured on, for ``env.json`` and every benchmark row.

    GPU fields describe the GPUs this process can see (``CUDA_VISIBLE_DEVICES`` applies);
    ``git_commit`` is the commit of the repository holding this package (None outside git) and
    ``git_dirty`` whether tracked files differ from it.
    """
    cuda_available = torch.cuda.is_available()
    gpu_count = torch.cuda.device_count() if cuda_available else 0
    gpu_names = [torch.cuda.get_device_name(i) for i in range(gpu_count)]
    gpu_memory = [int(torch.cuda.get_device_properties(i).total_memory) for i in range(gpu_count)]
    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    commit = _git("rev-parse", "HEAD")
    status = _git("status", "--porcelain", "--untracked-files=no") if commit else None
    return {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu_model": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "cpu_count_usable": usable_cores(),
        "torch": torch.__version__,
        "diffusers": _package_version("diffusers"),
        "numpy": _package_version("numpy"),
        "cuda_available": cuda_available,
        "cuda_version": torch.version.cuda,
        "cudnn": cudnn,
        "driver_version": _driver_version(),
        "gpu_count": gpu_count,
        "gpu_names": gpu_names,
        "gpu_name": gpu_names[0] if gpu_names else None,
        "gpu_total_memory_bytes": gpu_memory,
        "git_commit": commit or None,
        "git_dirty": bool(status) if status is not None else None,
        "hostname": socket.gethostname(),
        "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
