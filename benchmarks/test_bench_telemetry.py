"""What telemetry costs: full training iterations (collect + update) with telemetry on and off.

Each iteration is the training loop's own ``agg_bench.runtime.session.run_iteration`` (collect and update
inside ``Telemetry.iteration()``, the update a ``train`` phase counting the policy network's saved
activations, then the record). Off (``enabled=False``) still times the phases, as a run with
``telemetry.enabled: false`` does. "on" is a run's default (``telemetry.saved_activations: first``:
the exact saved-activation count in the first iteration only, here the warm-up); "on_every" counts
saved activations in every iteration, which tells the per-tensor count's own cost apart from the
rest (timers, RSS, NVML). One session runs all variants interleaved: each round runs every variant
once, in rotating order, so drift in the machine's load hits them alike. Every iteration has the
same shapes and pass counts (only the prompts and noise differ). The benchmark's own time is that of
a round; ``extra_info`` has the per-iteration times and each variant's overhead, the median over
rounds of variant/off - 1, in wall-clock and in process CPU time (the latter is steadier on a
shared machine).
"""
from __future__ import annotations

import itertools
import statistics
import time

import pytest

from agg_bench.config import TelemetryConfig
from agg_bench.machine.telemetry import Telemetry
from agg_bench.runtime.session import run_iteration
from cases import FULL

# the embedded default's resolutions: per-tensor bookkeeping weighs most at the smallest
OVERHEAD_RESOLUTIONS = [32, 64, 128]
ROUNDS = 10  # at least; --benchmark-min-rounds asks for more

# (name, telemetry)
VARIANTS = (("off", lambda device: Telemetry(device, enabled=False)),
            ("on", lambda device: Telemetry(device, enabled=True,
                                            saved_activations=TelemetryConfig().saved_activations)),
            ("on_every", lambda device: Telemetry(device, enabled=True, saved_activations="every")))


@pytest.mark.parametrize("resolution", OVERHEAD_RESOLUTIONS)
def test_telemetry_overhead(benchmark, prepare, request, resolution):
    rounds = max(ROUNDS, request.config.getoption("benchmark_min_rounds"))
    session = prepare(FULL, resolution).session
    iterations = itertools.count(1)
    trackers = {name: make(session.device) for name, make in VARIANTS}
    times: dict[str, list[tuple[float, float]]] = {name: [] for name, _ in VARIANTS}

    def iteration(name: str) -> tuple[float, float]:
        wall, cpu = time.perf_counter(), time.process_time()
        run_iteration(session, trackers[name], next(iterations))  # reads the timers: GPU work is waited for
        return time.perf_counter() - wall, time.process_time() - cpu

    # each round runs every variant once, starting one later each round
    orders = itertools.cycle([VARIANTS[k:] + VARIANTS[:k] for k in range(len(VARIANTS))])

    def one_round() -> None:
        for name, _ in next(orders):
            times[name].append(iteration(name))

    try:
        for name, _ in VARIANTS:  # warm-up: optimizer state, allocator, first calls
            iteration(name)
        benchmark.group = "telemetry"
        benchmark.pedantic(one_round, rounds=rounds, iterations=1)
    finally:
        for telemetry in trackers.values():
            telemetry.close()

    def overhead(name: str, index: int) -> float:
        """median over rounds of (variant / off) - 1, in wall (0) or CPU (1) time"""
        return statistics.median(t[index] / off[index] for off, t in zip(times["off"], times[name])) - 1

    benchmark.extra_info.update(phase="telemetry", method=FULL.method, resolution=resolution,
                                device=str(session.device), rounds=rounds)
    for name, _ in VARIANTS:
        benchmark.extra_info[f"{name}_wall_s"] = [t[0] for t in times[name]]
        benchmark.extra_info[f"{name}_cpu_s"] = [t[1] for t in times[name]]
        if name != "off":
            benchmark.extra_info[f"overhead_{name}_wall"] = overhead(name, 0)
            benchmark.extra_info[f"overhead_{name}_cpu"] = overhead(name, 1)
