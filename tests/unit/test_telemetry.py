"""Telemetry: NVML arithmetic against a scripted fake NVML, exact saved-activation bytes, CPU records."""
from __future__ import annotations

import itertools
import mmap
import re
import subprocess
import sys
import time
import types
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from agg_bench.machine import envinfo
from agg_bench.machine.telemetry import (
    TELEMETRY_KEYS,
    CudaMemory,
    NVMLSampler,
    NVMLSummary,
    PhaseTimer,
    SavedActivations,
    saved_activation_region,
    Telemetry,
    environment,
    is_oom_error,
    memory_at_failure,
    reset_rss_peak,
    rss_peak_bytes,
)
from agg_bench.records import PHASE_PEAK_KEY
from helpers import seeded

NEVER_S = 3600.0  # a polling interval no test reaches: only the start/stop/explicit samples happen

GPU_FIELDS = ("peak_alloc_bytes", "peak_reserved_bytes", "nvml_peak_used_bytes", "energy_j",
              "gpu_util_mean", "power_mean_w")


# --------------------------------------------------------------------------------------------------
# A scripted NVML and CUDA device table
# --------------------------------------------------------------------------------------------------


class FakeNVMLError(Exception):
    pass


class FakeNVML:
    """An NVML whose readings come from scripts; a script of None means "not supported"."""

    def __init__(self, uuids, memory_used=None, util=None, power_mw=None, energy_mj=None,
                 init_fails=False, driver=b"550.54.15"):
        self.uuids = uuids
        self.scripts = {
            "memory": memory_used, "util": util, "power": power_mw, "energy": energy_mj,
        }
        self.iterators = {k: iter(v) for k, v in self.scripts.items() if v is not None}
        self.init_fails = init_fails
        self.driver = driver
        self.init_calls = 0
        self.shutdown_calls = 0
        self.queried_handles: set[int] = set()

    def _next(self, quantity, handle):
        self.queried_handles.add(handle[1])
        if quantity not in self.iterators:
            raise FakeNVMLError(f"{quantity}: Not Supported")
        return next(self.iterators[quantity])

    def module(self) -> types.ModuleType:
        module = types.ModuleType("pynvml")
        module.NVMLError = FakeNVMLError

        def init():
            self.init_calls += 1
            if self.init_fails:
                raise FakeNVMLError("Driver Not Loaded")

        def shutdown():
            self.shutdown_calls += 1

        module.nvmlInit = init
        module.nvmlShutdown = shutdown
        module.nvmlDeviceGetCount = lambda: len(self.uuids)
        module.nvmlDeviceGetHandleByIndex = lambda index: ("handle", index)
        module.nvmlDeviceGetUUID = lambda handle: self.uuids[handle[1]]
        module.nvmlDeviceGetMemoryInfo = lambda h: SimpleNamespace(used=self._next("memory", h))
        module.nvmlDeviceGetUtilizationRates = lambda h: SimpleNamespace(gpu=self._next("util", h))
        module.nvmlDeviceGetPowerUsage = lambda h: self._next("power", h)
        module.nvmlDeviceGetTotalEnergyConsumption = lambda h: self._next("energy", h)
        module.nvmlSystemGetDriverVersion = lambda: self.driver
        return module


class FakeCudaUuid:
    """Like torch's ``_CUuuid``: prints as a dashed hex UUID without the ``GPU-`` prefix."""

    def __init__(self, text: str):
        self.text = text

    def __str__(self) -> str:
        return self.text


# NVML sees four GPUs; torch sees two of them, as with CUDA_VISIBLE_DEVICES=2,0.
NVML_UUIDS = [
    "GPU-00000000-aaaa-bbbb-cccc-000000000000",
    b"GPU-11111111-aaaa-bbbb-cccc-111111111111",
    "GPU-22222222-aaaa-bbbb-cccc-222222222222",
    "GPU-33333333-aaaa-bbbb-cccc-333333333333",
]
VISIBLE = [2, 0]  # torch cuda index -> NVML index


@pytest.fixture
def fake_cuda(monkeypatch):
    def properties(index):
        nvml_uuid = NVML_UUIDS[VISIBLE[index]]
        return SimpleNamespace(uuid=FakeCudaUuid(nvml_uuid.removeprefix("GPU-")))

    monkeypatch.setattr(torch.cuda, "get_device_properties", properties)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)


def install(monkeypatch, fake: FakeNVML) -> FakeNVML:
    monkeypatch.setitem(sys.modules, "pynvml", fake.module())
    return fake


# --------------------------------------------------------------------------------------------------
# NVMLSampler
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("device, nvml_index", [("cuda:0", 2), ("cuda:1", 0), ("cuda", 0)])
def test_nvml_device_is_matched_by_uuid(monkeypatch, fake_cuda, device, nvml_index):
    fake = install(monkeypatch, FakeNVML(NVML_UUIDS, memory_used=[1, 2], util=[0, 0],
                                         power_mw=[0, 0], energy_mj=[0, 0]))
    sampler = NVMLSampler(device, NEVER_S)
    assert sampler.available and sampler.nvml_index == nvml_index
    sampler.start()
    sampler.stop()
    sampler.close()
    assert fake.queried_handles == {nvml_index}
    assert fake.shutdown_calls == fake.init_calls == 1


def test_nvml_no_matching_uuid_is_a_no_op(monkeypatch, fake_cuda):
    fake = install(monkeypatch, FakeNVML(NVML_UUIDS[:2], memory_used=[1]))  # GPU 2 not listed
    sampler = NVMLSampler("cuda:0", NEVER_S)
    assert not sampler.available and sampler.nvml_index is None
    assert sampler.start().stop() == NVMLSummary()
    assert fake.shutdown_calls == 1 and fake.queried_handles == set()


def test_nvml_summary_from_scripted_readings(monkeypatch, fake_cuda):
    install(monkeypatch, FakeNVML(
        NVML_UUIDS,
        memory_used=[1_000, 5_000, 3_000],
        util=[10, 40, 70],
        power_mw=[100_000, 200_000, 300_000],
        energy_mj=[1_000_000, 1_012_345],
    ))
    sampler = NVMLSampler("cuda:0", NEVER_S)
    sampler.start()  # energy counter, sample 1
    sampler.sample()  # sample 2
    summary = sampler.stop()  # sample 3, energy counter
    sampler.close()
    assert summary == NVMLSummary(
        nvml_peak_used_bytes=5_000, gpu_util_mean=40.0, power_mean_w=200.0, energy_j=12.345, n_samples=3
    )
    assert sampler.summary() == summary


def test_nvml_energy_falls_back_to_integrated_power(monkeypatch, fake_cuda):
    install(monkeypatch, FakeNVML(
        NVML_UUIDS, memory_used=[7, 7, 7], util=[0, 0, 0], power_mw=[100_000, 200_000, 300_000],
        energy_mj=None,
    ))
    clock = iter([0.0, 1.0, 3.0])
    sampler = NVMLSampler("cuda:0", NEVER_S, clock=lambda: next(clock))
    sampler.start()
    sampler.sample()
    summary = sampler.stop()
    sampler.close()
    # Trapezoids: (100 + 200) / 2 * 1 s + (200 + 300) / 2 * 2 s
    assert summary.energy_j == 650.0
    assert summary.power_mean_w == 200.0


@pytest.mark.parametrize("power_mw, expected", [([400_000, 400_000, 400_000], 400.0), (None, None)])
def test_nvml_energy_counter_that_went_down_is_not_a_negative_energy(monkeypatch, fake_cuda, power_mw, expected):
    """A counter lower at stop than at start (the driver reloaded) is no measurement: the integrated power
    where there is one, else None; a negative energy would make the run's records ones no report reads."""
    install(monkeypatch, FakeNVML(NVML_UUIDS, memory_used=[1, 2, 3], util=[10, 20, 30], power_mw=power_mw,
                                  energy_mj=[5_000_000, 1_000]))
    times = iter([0.0, 0.5, 1.0])
    sampler = NVMLSampler("cuda:0", NEVER_S, clock=lambda: next(times))
    sampler.start()
    sampler.sample()
    assert sampler.stop().energy_j == expected
    sampler.close()


def test_nvml_readings_that_fail_part_way_are_no_energy(monkeypatch, fake_cuda):
    """A device handle that errors mid-window (the GPU fell off the bus, NVML went away): the integrated power
    covers only the start of the window, so the energy is unknown (None), not a smaller number; the samples
    taken before still count, and the run goes on."""
    power = iter([300_000, 300_000])

    def power_then_lost():
        for reading in power:
            yield reading
        raise FakeNVMLError("GPU is lost")

    install(monkeypatch, FakeNVML(NVML_UUIDS, memory_used=itertools.repeat(8), util=itertools.repeat(50),
                                  power_mw=power_then_lost(), energy_mj=None))
    times = iter([0.0, 1.0, 2.0, 3.0])
    sampler = NVMLSampler("cuda:0", NEVER_S, clock=lambda: next(times))
    sampler.start()
    sampler.sample()
    sampler.sample()  # the power reading fails from here
    summary = sampler.stop()
    sampler.close()
    assert summary.energy_j is None
    assert summary.n_samples == 4 and summary.power_mean_w == 300.0 and summary.nvml_peak_used_bytes == 8


def test_nvml_unsupported_quantities_are_none(monkeypatch, fake_cuda):
    install(monkeypatch, FakeNVML(NVML_UUIDS, memory_used=[5, 9], util=None, power_mw=None,
                                  energy_mj=None))
    with NVMLSampler("cuda:0", NEVER_S) as sampler:
        pass
    assert sampler.summary() == NVMLSummary(nvml_peak_used_bytes=9, n_samples=2)
    sampler.close()


def test_nvml_background_thread_samples(monkeypatch, fake_cuda):
    install(monkeypatch, FakeNVML(
        NVML_UUIDS, memory_used=itertools.repeat(4_096), util=itertools.repeat(50),
        power_mw=itertools.repeat(250_000), energy_mj=itertools.count(0, 1_000),
    ))
    sampler = NVMLSampler("cuda:0", interval_s=1e-4)
    for _ in range(2):  # restartable; each window starts from scratch
        sampler.start()
        torch.randn(256, 256) @ torch.randn(256, 256)
        summary = sampler.stop()
        assert summary.n_samples >= 2
        assert summary.nvml_peak_used_bytes == 4_096
        assert summary.gpu_util_mean == 50.0 and summary.power_mean_w == 250.0
        assert summary.energy_j == 1.0  # one counter read at start, one at stop
    sampler.close()
    sampler.close()


@pytest.mark.parametrize("how", ["missing", "init_fails", "cpu"])
def test_nvml_degrades_to_none(monkeypatch, fake_cuda, how):
    device = "cpu" if how == "cpu" else "cuda:0"
    if how == "missing":
        monkeypatch.setitem(sys.modules, "pynvml", None)  # makes `import pynvml` raise ImportError
    else:
        install(monkeypatch, FakeNVML(NVML_UUIDS, init_fails=how == "init_fails"))
    with NVMLSampler(device, NEVER_S) as sampler:
        pass
    assert not sampler.available
    assert sampler.summary() == NVMLSummary()
    sampler.close()


class FakeMigNVML(FakeNVML):
    """One A100 split into MIG instances, as NVML shows it to a process that CUDA_VISIBLE_DEVICES=MIG-<uuid> gives
    one of them: nvmlDeviceGetCount and nvmlDeviceGetHandleByIndex list the whole GPU (whose readings are every
    instance's: memory used by all of them, the board's power and energy); nvmlDeviceGetHandleByUUID finds an
    instance by its MIG UUID, whose memory is its own and whose utilization, power and energy NVML does not
    support."""

    PARENT = "GPU-aaaaaaaa-1111-2222-3333-444444444444"
    INSTANCE = "MIG-bbbbbbbb-5555-6666-7777-888888888888"

    def __init__(self, instance_used, power_on_instance=None):
        super().__init__([self.PARENT], memory_used=itertools.repeat(70_000_000_000), util=itertools.repeat(90),
                         power_mw=itertools.repeat(400_000), energy_mj=itertools.count(0, 1_000_000))
        self.instance_used = iter(instance_used)
        self.power_on_instance = power_on_instance  # a driver that answers the board's power for an instance
        self.instance_queries: list[str] = []

    def module(self) -> types.ModuleType:
        module = super().module()
        whole = {name: getattr(module, name) for name in (
            "nvmlDeviceGetMemoryInfo", "nvmlDeviceGetUtilizationRates", "nvmlDeviceGetPowerUsage",
            "nvmlDeviceGetTotalEnergyConsumption")}
        instance = ("mig", 0)

        def not_supported(name):
            def read(handle):
                if handle != instance:
                    return whole[name](handle)
                self.instance_queries.append(name)
                if name == "nvmlDeviceGetPowerUsage" and self.power_on_instance is not None:
                    return self.power_on_instance
                raise module.NVMLError_NotSupported("Not Supported")
            return read

        def memory(handle):
            if handle != instance:
                return whole["nvmlDeviceGetMemoryInfo"](handle)
            self.instance_queries.append("nvmlDeviceGetMemoryInfo")
            return SimpleNamespace(used=next(self.instance_used))

        def by_uuid(uuid):
            if uuid.lower() == self.INSTANCE.lower():
                return instance
            raise module.NVMLError_NotFound("Not Found")

        module.NVMLError_NotSupported = type("NVMLError_NotSupported", (FakeNVMLError,), {})
        module.NVMLError_NotFound = type("NVMLError_NotFound", (FakeNVMLError,), {})
        module.NVML_DEVICE_MIG_ENABLE = 1
        module.nvmlDeviceGetMigMode = lambda handle: [1, 1]
        module.nvmlDeviceGetHandleByUUID = by_uuid
        module.nvmlDeviceGetUUID = lambda handle: self.INSTANCE if handle == instance else self.PARENT
        module.nvmlDeviceGetMemoryInfo = memory
        for name in ("nvmlDeviceGetUtilizationRates", "nvmlDeviceGetPowerUsage",
                     "nvmlDeviceGetTotalEnergyConsumption"):
            setattr(module, name, not_supported(name))
        return module


def cuda_device_uuid(monkeypatch, uuid: str) -> None:
    """torch's one visible device has ``uuid`` (as CUDA reports it: no GPU-/MIG- prefix)."""
    properties = SimpleNamespace(uuid=FakeCudaUuid(uuid.split("-", 1)[1]))
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: properties)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)


@pytest.mark.parametrize("power_on_instance", [None, 400_000])
def test_a_mig_instance_records_its_own_memory_and_none_of_the_whole_gpus_readings(monkeypatch, power_on_instance):
    """CUDA_VISIBLE_DEVICES=MIG-<uuid>: CUDA names the device by its MIG UUID, which no whole GPU of NVML's index
    list has, so the sampler measured nothing; the instance's memory is its own (found by nvmlDeviceGetHandleByUUID),
    while utilization, power and energy are the whole GPU's, which other instances share: null, never asked for,
    even where a driver would answer them."""
    fake = install(monkeypatch, FakeMigNVML(instance_used=[1_000, 3_000, 2_000], power_on_instance=power_on_instance))
    cuda_device_uuid(monkeypatch, FakeMigNVML.INSTANCE)
    sampler = NVMLSampler("cuda:0", NEVER_S)
    assert sampler.available and sampler.nvml_index is None
    sampler.start()
    sampler.sample()
    summary = sampler.stop()
    sampler.close()
    assert summary == NVMLSummary(nvml_peak_used_bytes=3_000, n_samples=3)
    assert fake.queried_handles == set()  # the whole GPU: never read
    assert set(fake.instance_queries) == {"nvmlDeviceGetMemoryInfo"}
    assert fake.shutdown_calls == fake.init_calls == 1


def test_a_whole_gpu_in_mig_mode_is_not_read_as_the_runs_device(monkeypatch):
    """Where CUDA names the device by its GPU's UUID (drivers or CUDA versions before MIG UUIDs), the matching NVML
    device is the whole GPU, whose memory, utilization, power and energy are every instance's: the summary is all
    null rather than another job's numbers as this run's."""
    fake = install(monkeypatch, FakeMigNVML(instance_used=[]))
    cuda_device_uuid(monkeypatch, FakeMigNVML.PARENT)
    with NVMLSampler("cuda:0", NEVER_S) as sampler:
        pass
    assert not sampler.available and sampler.summary() == NVMLSummary()
    assert fake.queried_handles == set() and fake.instance_queries == []
    assert fake.shutdown_calls == fake.init_calls == 1


def test_a_run_record_on_a_mig_instance_has_nulls_not_the_whole_gpus_numbers(monkeypatch):
    """What a run's record holds on a MIG instance: its memory, and null where NVML has only the whole GPU's."""
    gpu = FakeCudaClock(monkeypatch)
    FakeAllocator().install(monkeypatch)
    install(monkeypatch, FakeMigNVML(instance_used=itertools.repeat(5_000)))
    cuda_device_uuid(monkeypatch, FakeMigNVML.INSTANCE)
    with Telemetry("cuda", nvml_interval_s=NEVER_S) as tel:
        with tel.iteration():
            with tel.phase("train"):
                gpu.advance(100.0)
        record = tel.record()
    assert record["nvml_peak_used_bytes"] == 5_000 and record["t_train_s"] == 0.1
    assert (record["gpu_util_mean"], record["power_mean_w"], record["energy_j"]) == (None, None, None)


# --------------------------------------------------------------------------------------------------
# SavedActivations
# --------------------------------------------------------------------------------------------------

F32 = 4  # bytes


def small_mlp_loss(device: str) -> torch.Tensor:
    x = torch.randn(4, 8, device=device)  # input, no grad
    w1 = nn.Parameter(torch.randn(8, 16, device=device))
    w2 = nn.Parameter(torch.randn(16, 3, device=device))
    a = torch.tanh(x @ w1)  # mm saves x (w1 only if x required grad); tanh saves its output a
    y = torch.sigmoid(a @ w2)  # mm saves a (again) and w2 (a parameter); sigmoid saves y
    return (y * y).sum()  # mul saves y twice; sum saves no tensor


# x + a + y, each storage once; parameters not counted.
SMALL_MLP_BYTES = (4 * 8 + 4 * 16 + 4 * 3) * F32


def test_saved_activation_bytes_of_known_graph():
    with SavedActivations() as saved:
        loss = small_mlp_loss("cpu")
    assert saved.peak_bytes == saved.live_bytes == SMALL_MLP_BYTES == 432
    loss.backward()
    assert saved.live_bytes == 0
    assert saved.peak_bytes == SMALL_MLP_BYTES


def test_saved_activation_bytes_are_device_independent():
    with SavedActivations() as saved:
        loss = small_mlp_loss("meta")  # no memory at all, same count
    assert saved.peak_bytes == SMALL_MLP_BYTES
    del loss
    assert saved.live_bytes == 0  # dropping the graph releases its saved tensors


def test_saved_views_count_their_whole_storage_once():
    big = torch.randn(4, 32)  # 512 bytes, no grad
    w = torch.randn(4, 8, requires_grad=True)  # a leaf that is not a parameter: counted
    with SavedActivations() as saved:
        z1 = big[:, :8] * w  # saves a view of big: its whole storage (w not: big needs no grad)
        z2 = big[:, 8:16] * w  # the same storage again: not recounted
        z3 = w * w  # saves w (twice, one storage)
    assert saved.peak_bytes == (4 * 32 + 4 * 8) * F32
    (z1 + z2 + z3).sum().backward()
    assert saved.live_bytes == 0


def test_frozen_parameters_are_not_counted():
    linear = nn.Linear(8, 4).requires_grad_(False)
    x = torch.randn(4, 8, requires_grad=True)
    with SavedActivations() as saved:
        out = torch.relu(linear(x))  # linear saves only weight.t() (frozen): x's grad needs no x
    assert saved.peak_bytes == 4 * 4 * F32
    out.sum().backward()
    torch.testing.assert_close(x.grad, ((out > 0).float() @ linear.weight))


def test_saved_peak_is_max_of_live_not_sum():
    saved = SavedActivations()
    x = torch.randn(4, 8, requires_grad=True)
    for _ in range(2):  # one graph at a time: the peak is one graph's bytes
        with saved:
            loss = torch.exp(x).sum()  # saves exp's output: 128 bytes
        loss.backward()
    assert saved.peak_bytes == 4 * 8 * F32 and saved.live_bytes == 0
    with saved:
        loss_b = torch.exp(x).sum()
    with saved:  # re-entered while loss_b's graph is alive: counts carry over
        loss_c = torch.exp(x).sum()
    assert saved.peak_bytes == saved.live_bytes == 2 * 4 * 8 * F32
    del loss_b
    saved.reset()
    assert saved.peak_bytes == saved.live_bytes == 4 * 8 * F32
    del loss_c
    assert saved.live_bytes == 0


def test_inplace_modification_of_saved_tensor_still_raises():
    x = torch.randn(5, requires_grad=True)
    with SavedActivations():
        y = x * 2
        z = y.exp()  # saves its output
    z.add_(1)
    with pytest.raises(RuntimeError, match="inplace"):
        z.sum().backward()


def test_gradients_unchanged_by_tracking():
    torch.manual_seed(seeded(0))
    w = nn.Parameter(torch.randn(6, 6, dtype=torch.float64))
    x = torch.randn(3, 6, dtype=torch.float64)
    expected = torch.autograd.grad(torch.tanh(x @ w).pow(3).sum(), w)[0]
    with SavedActivations():
        loss = torch.tanh(x @ w).pow(3).sum()
    assert torch.equal(torch.autograd.grad(loss, w)[0], expected)


# --------------------------------------------------------------------------------------------------
# Telemetry on CPU
# --------------------------------------------------------------------------------------------------


def run_iteration(tel: Telemetry) -> None:
    with tel.iteration():
        with tel.phase("rollout"):
            torch.randn(64, 64) @ torch.randn(64, 64)
        with tel.phase("train", saved_activations=True):
            small_mlp_loss("cpu").backward()


def test_cpu_record_has_every_key_and_none_for_gpu_fields():
    with Telemetry("cpu") as tel:
        run_iteration(tel)
        record = tel.record()
    assert tuple(record) == TELEMETRY_KEYS
    for key in GPU_FIELDS:
        assert record[key] is None, key
    for key in ("t_rollout_s", "t_train_s", "t_iter_s"):
        assert isinstance(record[key], float) and record[key] > 0, key
    assert record["t_reward_s"] is None  # the phase did not run
    assert isinstance(record["rss_peak_bytes"], int) and record["rss_peak_bytes"] > 0
    assert record["saved_activation_peak_bytes"] == SMALL_MLP_BYTES


def test_disabled_telemetry_only_times():
    tel = Telemetry("cpu", enabled=False)
    run_iteration(tel)
    record = tel.record()
    tel.close()
    assert tuple(record) == TELEMETRY_KEYS
    times = {"t_rollout_s", "t_train_s", "t_iter_s", "t_rollout_cpu_s", "t_train_cpu_s", "t_iter_cpu_s"}
    for key, value in record.items():
        if key in times:
            assert isinstance(value, float) and value > 0, key
        else:
            assert value is None, key


def test_each_iteration_starts_fresh_and_other_phase_names_are_timed():
    with Telemetry("cpu") as tel:
        assert all(v is None for v in tel.record().values())
        run_iteration(tel)
        with tel.iteration():
            for _ in range(2):  # a phase may run several times; its times add up
                with tel.phase("eval"):
                    torch.randn(8).sum()
        record = tel.record()
    assert record["t_rollout_s"] is None and record["t_train_s"] is None
    assert record["saved_activation_peak_bytes"] is None  # no phase tracked saved tensors
    assert isinstance(record["t_eval_s"], float) and record["t_eval_s"] > 0
    assert isinstance(record["t_eval_cpu_s"], float) and record["t_eval_cpu_s"] >= 0
    assert set(record) == set(TELEMETRY_KEYS) | {"t_eval_s", "t_eval_cpu_s"}


def test_nested_tracked_phases_count_once():
    with Telemetry("cpu") as tel:
        with tel.iteration():
            with tel.phase("train", saved_activations=True):
                with tel.phase("forward", saved_activations=True):
                    loss = small_mlp_loss("cpu")
                loss.backward()
        record = tel.record()
    assert record["saved_activation_peak_bytes"] == SMALL_MLP_BYTES
    assert record["t_forward_s"] > 0 and record["t_train_s"] > 0


def test_saved_activation_modes_choose_the_counted_iterations():
    for mode, counted in (("every", [True, True, True]), ("first", [True, False, False]),
                          ("never", [False, False, False])):
        with Telemetry("cpu", saved_activations=mode) as tel:
            peaks = []
            for _ in counted:
                run_iteration(tel)
                peaks.append(tel.record()["saved_activation_peak_bytes"])
        assert peaks == [SMALL_MLP_BYTES if c else None for c in counted], mode
    with pytest.raises(ValueError, match="every, first, never"):
        Telemetry("cpu", saved_activations="off")


def test_regions_phase_counts_only_inside_regions():
    w = nn.Parameter(torch.randn(8, 5))
    with Telemetry("cpu") as tel:
        with tel.iteration():
            with tel.phase("train", saved_activations="regions"):
                with saved_activation_region():
                    h = torch.tanh(torch.randn(3, 8) @ w)  # saves the input (3x8) and h (3x5)
                # outside a region: exp saves its output, a 3x5 tensor that is not counted
                loss = torch.exp(h).sum()
                loss.backward()
        record = tel.record()
    assert record["saved_activation_peak_bytes"] == (3 * 8 + 3 * 5) * F32
    # a region outside any regions phase counts nothing and changes nothing
    with saved_activation_region():
        y = torch.tanh(torch.randn(3, requires_grad=True))
    y.sum().backward()
    with pytest.raises(ValueError, match="saved_activations"):
        with Telemetry("cpu", enabled=False).phase("train", saved_activations="some"):
            pass


def test_regions_are_counted_in_a_phase_counting_everything_only_once():
    with Telemetry("cpu") as tel:
        with tel.iteration():
            with tel.phase("train", saved_activations=True):
                with saved_activation_region():  # the phase's tracker is already active
                    loss = small_mlp_loss("cpu")
                loss.backward()
        assert tel.record()["saved_activation_peak_bytes"] == SMALL_MLP_BYTES


def test_failed_iteration_still_records():
    with Telemetry("cpu") as tel:
        with pytest.raises(torch.OutOfMemoryError):
            with tel.iteration():
                with tel.phase("train", saved_activations=True):
                    torch.exp(torch.randn(4, requires_grad=True))
                    raise torch.OutOfMemoryError("out of memory")
        record = tel.record()
    assert record["t_iter_s"] > 0 and record["t_train_s"] > 0
    assert record["saved_activation_peak_bytes"] == 4 * F32
    assert record["rss_peak_bytes"] > 0


def test_building_blocks_on_cpu():
    with PhaseTimer("cpu") as timer:
        torch.randn(32, 32).sum()
    assert timer.elapsed_s > 0
    with pytest.raises(RuntimeError, match="before the timed block ended"):
        _ = PhaseTimer("cpu").elapsed_s
    with pytest.raises(RuntimeError, match="before the timed block ended"):
        _ = PhaseTimer("cpu").cpu_s


def test_cpu_time_counts_work_not_waiting():
    # sleeping takes wall time but (almost) no CPU time: what other processes do to the cores while
    # a phase waits for them does not enter t_*_cpu_s
    with PhaseTimer("cpu") as sleeping:
        time.sleep(0.2)
    assert sleeping.elapsed_s >= 0.2
    assert sleeping.cpu_s < 0.1
    # computing until the process has used 0.05 CPU seconds: the timer sees at least that much
    with PhaseTimer("cpu") as working:
        start = time.process_time()
        while time.process_time() - start < 0.05:
            torch.randn(16, 16).sum()
    assert working.cpu_s >= 0.05
    with CudaMemory("cpu") as memory:
        torch.randn(32)
    assert memory.peak_alloc_bytes is None and memory.peak_reserved_bytes is None


def test_rss_peak_resets_and_sees_a_new_allocation():
    assert isinstance(rss_peak_bytes(), int) and rss_peak_bytes() > 0
    if not reset_rss_peak():
        pytest.skip("this kernel does not allow resetting the peak RSS")
    before = rss_peak_bytes()
    # a fresh anonymous mapping, one byte written per page: 64 MiB that cannot come from memory the
    # allocator already holds (a tensor of that size may reuse pages freed by earlier tests)
    size = 64 * 2**20
    block = mmap.mmap(-1, size)
    for offset in range(0, size, mmap.PAGESIZE):
        block[offset] = 1
    after = rss_peak_bytes()
    block.close()
    assert after - before >= 32 * 2**20


# --------------------------------------------------------------------------------------------------
# Failures and environment
# --------------------------------------------------------------------------------------------------


def test_is_oom_error():
    assert is_oom_error(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert is_oom_error(torch.cuda.OutOfMemoryError("boom"))
    assert is_oom_error(RuntimeError("CUDA out of memory. Tried to allocate 20.00 MiB"))
    assert is_oom_error(RuntimeError("HIP error: Out Of Memory"))
    assert is_oom_error(MemoryError())
    assert not is_oom_error(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))
    assert not is_oom_error(ValueError("out of memory"))


def test_memory_at_failure_on_cpu():
    assert memory_at_failure("cpu") == {"allocated_bytes": None, "reserved_bytes": None}


def test_environment_describes_the_machine(monkeypatch):
    install(monkeypatch, FakeNVML(NVML_UUIDS, driver=b"550.54.15"))
    env = environment()
    for key in ("python", "platform", "cpu_model", "cpu_count", "torch", "diffusers", "numpy",
                "cuda_available", "cuda_version", "cudnn", "driver_version", "gpu_count", "gpu_names",
                "gpu_name", "git_commit", "hostname", "timestamp"):
        assert key in env, key
    assert env["torch"] == torch.__version__
    assert env["driver_version"] == "550.54.15"
    assert env["cpu_count"] >= 1
    if not torch.cuda.is_available():
        assert env["gpu_count"] == 0 and env["gpu_names"] == [] and env["gpu_name"] is None
    assert env["git_commit"] is None or re.fullmatch(r"[0-9a-f]{40}", env["git_commit"])


def test_environment_names_the_gpu_of_the_current_device_not_device_0(monkeypatch):
    """A rank on device 1 of a node whose GPUs all stay visible measures on device 1: its env.json's gpu_name
    (and a calibration's, which reads it) is that GPU's, or the named device's where the run names one. A run on
    the CPU measured on no GPU: its env.json named the current GPU where its records say null."""
    from helpers import FAKE_GPUS, fake_two_gpus

    monkeypatch.setitem(sys.modules, "pynvml", None)
    fake_two_gpus(monkeypatch, current=1)
    env = environment()
    assert env["gpu_names"] == [name for name, _ in FAKE_GPUS]
    assert env["gpu_name"] == FAKE_GPUS[1][0]
    assert environment(torch.device("cuda", 0))["gpu_name"] == FAKE_GPUS[0][0]
    assert environment(torch.device("cuda"))["gpu_name"] == FAKE_GPUS[1][0]
    cpu = environment(torch.device("cpu"))
    assert cpu["gpu_name"] is None and cpu["gpu_names"] == [name for name, _ in FAKE_GPUS]


def test_a_cpu_run_on_a_machine_with_gpus_names_no_gpu_and_plans_for_the_host(monkeypatch, tmp_path):
    """``device: cpu`` where GPUs are visible: the run folder's env.json named the current GPU (its records say
    null), which a reader takes for the hardware it measured on; the plan's budget is this machine's memory."""
    import json
    import os

    from agg_bench.config import load_config
    from agg_bench.io import read_jsonl
    from agg_bench.runtime.train import train
    from helpers import fake_two_gpus

    monkeypatch.setitem(sys.modules, "pynvml", None)
    fake_two_gpus(monkeypatch, current=1)
    out = tmp_path / "run"
    train(load_config(None, ["device=cpu", "model.resolution=32", "sampling.steps=4", "grpo.group_size=2",
                             "progress=false", "train.iterations=1"]), out)
    env = json.loads((out / "env.json").read_text())
    assert env["gpu_name"] is None and env["gpu_count"] == 2
    assert [r["gpu_name"] for r in read_jsonl(out / "metrics.jsonl")] == [None]
    plan = json.loads((out / "plan.json").read_text())
    assert plan["device"] == "cpu" and plan["gpu_memory_bytes"] == os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


@pytest.fixture
def fresh_git_state():
    """envinfo's git state read anew in the test (it is read once per process) and again after it."""
    envinfo._git_state.cache_clear()
    yield
    envinfo._git_state.cache_clear()


def test_environment_without_nvml_or_git(monkeypatch, fresh_git_state):
    monkeypatch.setitem(sys.modules, "pynvml", None)
    monkeypatch.setattr(envinfo, "_git", lambda *args: None)
    env = environment()
    assert env["driver_version"] is None
    assert env["git_commit"] is None and env["git_dirty"] is None


def test_git_runs_once_per_process_for_many_runs(monkeypatch, fresh_git_state):
    """Each run's env.json ran git twice (the commit, then the status): a cell or campaign window that runs many
    runs in one process ran it for each. It runs once per process for the repository's folder; every run's
    environment says the same commit and state."""
    calls = []

    def fake_run(argv, **kwargs):
        if argv[0] != "git":
            return real_run(argv, **kwargs)
        calls.append(argv[4])
        return subprocess.CompletedProcess(argv, 0, stdout="0" * 40 if "rev-parse" in argv else " M x.py", stderr="")

    real_run = subprocess.run

    monkeypatch.setitem(sys.modules, "pynvml", None)
    monkeypatch.setattr(envinfo.subprocess, "run", fake_run)
    envs = [environment(torch.device("cpu")) for _ in range(3)]
    assert calls == ["rev-parse", "status"], calls
    assert {(env["git_commit"], env["git_dirty"]) for env in envs} == {("0" * 40, True)}


class FakeAllocator:
    """The CUDA caching allocator's counters as torch.cuda reads them: bytes allocated now, the peak since the
    last reset (a reset sets it to what is allocated now), and the reserved peak, always 64 bytes above."""

    def __init__(self):
        self.now = self.peak = 0

    def take(self, n: int) -> None:
        self.now += n
        self.peak = max(self.peak, self.now)

    def give(self, n: int) -> None:
        self.now -= n

    def install(self, monkeypatch) -> None:
        monkeypatch.setattr(CudaMemory, "measures", property(lambda self: True))
        monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: self.peak)
        monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda device=None: self.peak + 64)
        monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: setattr(self, "peak", self.now))

    def burst(self, n: int) -> None:
        self.take(n)
        self.give(n)


@pytest.mark.parametrize("between", [0, 5000])
def test_each_phase_records_its_own_cuda_peak_and_the_iteration_the_largest(monkeypatch, between):
    """On CUDA every phase not inside another gets its own peak (the largest over its runs in the iteration), the
    stretches between phases count toward the iteration's peak only, and the iteration's peaks are what they
    would be without the cuts; off CUDA a record has no phase peak."""
    memory = FakeAllocator()
    memory.install(monkeypatch)
    with Telemetry("cpu") as tel:
        with tel.iteration():
            memory.take(100)  # held through the iteration (weights)
            with tel.phase("rollout"):
                memory.burst(50)
            memory.burst(between)
            with tel.phase("reward"):
                memory.take(20)
                with tel.phase("decode"):  # inside another phase: the reward phase's
                    memory.burst(80)
                memory.give(20)
            for size in (1000, 500):  # a phase that runs twice: its larger peak
                with tel.phase("train"):
                    memory.burst(size)
            with pytest.raises(RuntimeError), tel.phase("eval"):  # a phase that fails still has its peak
                memory.take(7)
                raise RuntimeError
        record = tel.record()
    assert {key: record[key] for key in record if key.startswith("peak_alloc_") and key != "peak_alloc_bytes"} == {
        "peak_alloc_rollout_bytes": 150, "peak_alloc_reward_bytes": 200, "peak_alloc_train_bytes": 1100,
        "peak_alloc_eval_bytes": 107}
    assert record["peak_alloc_bytes"] == max(1100, 100 + between)
    assert record["peak_reserved_bytes"] == record["peak_alloc_bytes"] + 64
    assert set(TELEMETRY_KEYS) < set(record) and list(record)[-4:] == [  # the phase peaks come after the rest
        "peak_alloc_rollout_bytes", "peak_alloc_reward_bytes", "peak_alloc_train_bytes", "peak_alloc_eval_bytes"]
    assert PHASE_PEAK_KEY.format(phase="train") == "peak_alloc_train_bytes"


class FakeCudaClock:
    """torch.cuda's events, streams and synchronize on a GPU clock that a test moves (``advance``): an event
    holds the time it was recorded at once its stream reaches it, which a synchronize of the device or of
    the event waits for; reading ``elapsed_time`` of an event not waited for is refused, as CUDA does for an
    event that has not completed."""

    def __init__(self, monkeypatch):
        self.now_ms = 0.0
        self.device_syncs = 0
        clock = self

        class Event:
            def __init__(self, enable_timing=False):
                assert enable_timing
                self.at = self.done = None

            def record(self, stream=None):
                assert stream is clock.stream
                self.at = clock.now_ms

            def synchronize(self):
                self.done = self.at

            def elapsed_time(self, end):
                assert self.at is not None and end.done is not None, "elapsed_time of an event not completed"
                return end.done - self.at

        self.stream = object()
        monkeypatch.setattr(torch.cuda, "Event", Event)
        monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: self.stream)
        monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: setattr(self, "device_syncs",
                                                                                   self.device_syncs + 1))
        monkeypatch.setitem(sys.modules, "pynvml", None)  # no NVML: its values None

    def advance(self, ms: float) -> None:
        self.now_ms += ms


def test_on_cuda_phases_are_timed_by_events_without_stalling_the_gpu(monkeypatch):
    """A CUDA run's times come from CUDA events (the GPU's time, read after the end event completed); the
    device is not synchronized around each phase, which would stall the queued work being timed."""
    gpu = FakeCudaClock(monkeypatch)
    FakeAllocator().install(monkeypatch)
    with Telemetry("cuda") as tel:
        with tel.iteration():
            with tel.phase("rollout"):
                gpu.advance(250.0)
            gpu.advance(10.0)
            for ms in (400.0, 100.0):
                with tel.phase("train"):
                    gpu.advance(ms)
        record = tel.record()
    assert gpu.device_syncs == 0
    assert record["t_rollout_s"] == 0.25 and record["t_train_s"] == 0.5 and record["t_iter_s"] == 0.76
    assert record["t_reward_s"] is None and record["energy_j"] is None and record["peak_alloc_bytes"] == 0


def test_on_cuda_without_events_the_device_is_synchronized_at_both_ends(monkeypatch):
    """Telemetry off (the baseline for what it costs): wall-clock times, the device synchronized at each end
    of each block so that they cover the queued GPU work."""
    gpu = FakeCudaClock(monkeypatch)
    with Telemetry("cuda", enabled=False) as tel:
        with tel.iteration():
            with tel.phase("train"):
                pass
        record = tel.record()
    assert gpu.device_syncs == 4 and record["t_train_s"] >= 0 and record["peak_alloc_bytes"] is None
