"""NVML sampling (nvidia-ml-py, imported only when a CUDA device is measured): GPU utilisation, power
and energy of the GPU a run uses, sampled on a background thread (``NVMLSampler``) and summarised per
phase (``NVMLSummary``). Part of the run's telemetry (:mod:`agg_bench.machine.telemetry`, which
re-exports these names); without NVML or a GPU every value is None, never 0.

On a MIG instance (``CUDA_VISIBLE_DEVICES=MIG-<uuid>``) only the instance's memory is its own: NVML gives its
utilisation no number, and power and energy only for the whole GPU, which other instances' jobs share. The
sampler reads the instance's memory and leaves the rest None; a whole GPU in MIG mode (what CUDA names where it
gives the GPU's UUID for an instance) is not read at all."""
from __future__ import annotations

import threading
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable

import torch

from .devices import cuda_index, is_cuda


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


def _nvml_index_for(nvml: Any, wanted: str) -> int | None:
    """NVML index of the whole GPU whose UUID is ``wanted`` (as :func:`_normalize_uuid` writes it), so that
    ``CUDA_VISIBLE_DEVICES`` renumbering is respected; None when no NVML device matches."""
    for nvml_index in range(nvml.nvmlDeviceGetCount()):
        handle = nvml.nvmlDeviceGetHandleByIndex(nvml_index)
        if _normalize_uuid(nvml.nvmlDeviceGetUUID(handle)) == wanted:
            return nvml_index
    return None


def _mig_handle_for(nvml: Any, wanted: str) -> Any:
    """NVML handle of the MIG instance whose UUID is ``wanted`` (as :func:`_normalize_uuid` writes it), which NVML's
    index list of whole GPUs does not hold; None where there is none."""
    if len(wanted) != 32:
        return None
    dashed = f"{wanted[:8]}-{wanted[8:12]}-{wanted[12:16]}-{wanted[16:20]}-{wanted[20:]}"
    try:
        return nvml.nvmlDeviceGetHandleByUUID(f"MIG-{dashed}")
    except Exception:  # not a MIG instance, or an NVML without MIG
        return None


def _in_mig_mode(nvml: Any, handle: Any) -> bool:
    """Whether the whole GPU ``handle`` is split into MIG instances: a process then runs on one of them, and the
    GPU's readings are every instance's."""
    try:
        current, _pending = nvml.nvmlDeviceGetMigMode(handle)
    except Exception:  # a GPU without MIG (NVML: not supported), or an NVML without the call
        return False
    return bool(current == getattr(nvml, "NVML_DEVICE_MIG_ENABLE", 1))


# what NVML measures for a whole GPU only: on a MIG instance these are other jobs' too (or not supported)
WHOLE_GPU_ONLY = frozenset({"utilization", "power", "energy"})


@dataclass
class NVMLSummary:
    """What an ``NVMLSampler`` saw between start and stop; every field None when NVML was unusable.

    nvml_peak_used_bytes: largest ``memory.used`` sampled; NVML counts every process on the GPU (on a MIG
        instance, on the instance).
    gpu_util_mean: mean of the sampled ``utilization.gpu`` percentages; None on a MIG instance.
    power_mean_w: mean of the sampled power draws, in watts; None on a MIG instance (the whole GPU's power).
    energy_j: energy between start and stop, from the difference of the GPU's total-energy counter,
        or from integrating the sampled power over time (trapezoids) where that counter is unsupported or
        went down between them; never negative, and None where neither covers the whole window (the power
        readings failed part-way: the handle went, or NVML did), and on a MIG instance.
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
    The GPU is the one torch calls ``device``, found by UUID: a whole GPU (``nvml_index``), or a MIG instance
    (``mig``; ``nvml_index`` None), of which only the memory is read. When ``pynvml`` is missing, NVML fails
    to initialize, no NVML device matches, the match is a whole GPU in MIG mode, or ``device`` is not CUDA, the
    sampler does nothing and its summary is all None; a quantity the GPU does not support is None on its own.

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
        self.mig = False
        self._unsupported: set[str] = set()
        self._summary = NVMLSummary()
        self._open()
        self._clear()

    @property
    def available(self) -> bool:
        """Whether NVML readings are being taken for this device."""
        return self._handle is not None

    def _open(self) -> None:
        if not is_cuda(self.device):
            return
        try:
            import pynvml
        except ImportError:
            return
        try:
            pynvml.nvmlInit()
        except Exception:
            return
        mig = False
        try:
            wanted = _normalize_uuid(torch.cuda.get_device_properties(cuda_index(self.device)).uuid)
            index = _nvml_index_for(pynvml, wanted)
            if index is None:
                handle = _mig_handle_for(pynvml, wanted)
                mig = handle is not None
            else:
                handle = pynvml.nvmlDeviceGetHandleByIndex(index)
                if _in_mig_mode(pynvml, handle):
                    index = handle = None
        except Exception:
            index = handle = None
        if handle is None:
            _shutdown_quietly(pynvml)
            return
        self._nvml, self._handle, self.nvml_index, self.mig = pynvml, handle, index, mig
        if mig:  # never asked, so that no driver's answer for the whole GPU is taken for the instance's
            self._unsupported.update(WHOLE_GPU_ONLY)

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
        # the counter counts from the driver's load: one that went down (a driver reload) measured nothing
        if (self._energy_start_mj is not None and energy_end_mj is not None
                and energy_end_mj >= self._energy_start_mj):
            energy_j: float | None = (energy_end_mj - self._energy_start_mj) / 1000.0
        elif self._power_n >= 2 and "power" not in self._unsupported:
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
