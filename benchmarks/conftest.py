"""pytest-benchmark suite: training phase per method and resolution, rollout, telemetry overhead.

Run from the repository root (``pytest`` alone runs only ``tests/``):

    pytest benchmarks --benchmark-autosave                     # measure, save a numbered JSON
    pytest benchmarks --benchmark-compare --benchmark-compare-fail=mean:10%   # against the last save

Results are stored per hardware model: unless ``--benchmark-storage`` is given, the storage is
``.benchmarks/<GPU name>`` (``.benchmarks/cpu-<CPU model>`` without a GPU), so a comparison never mixes
machines. Every saved run carries torch, diffusers, CUDA, driver and GPU in its ``machine_info``.

Options of this suite: ``--bench-config FILE`` (default: ``config/run.yaml``, the embedded default's base),
``--bench-device`` (default ``auto``: the first GPU, else CPU), ``--bench-slow`` (also run the 256 and 512 px
cases), ``--bench-threads N`` (torch CPU threads). The usual pytest-benchmark options apply
(``--benchmark-min-rounds``, ``--benchmark-only``, ``--benchmark-timer``, ...). On a CPU shared with
other jobs, ``--bench-threads 1 --benchmark-timer time.process_time`` keeps the numbers steady: several
threads per process fight the other jobs for cores, and CPU time leaves out the waiting.
"""
from __future__ import annotations

import re
from typing import Any

import pytest
import torch

from agg_bench.config import integer_arg
from agg_bench.errors import ConfigError
from agg_bench.machine import telemetry as tel
from agg_bench.machine.devices import resolve_device
from cases import DEFAULT_CONFIG, FULL, Case, Prepared, case_config

DEFAULT_STORAGE = "file://./.benchmarks"
FULL_RESOLUTION = 32  # any resolution of the suite: the base config is checked at it before the cases run


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("agg-bench benchmarks")
    group.addoption("--bench-config", default=str(DEFAULT_CONFIG),
                    help="run config the benchmarks start from (default: config/run.yaml)")
    group.addoption("--bench-device", default="auto", help="cpu, cuda, cuda:N or auto (default)")
    group.addoption("--bench-slow", action="store_true", help="also run the cases marked slow (256 and 512 px)")
    group.addoption("--bench-threads", type=integer_arg, default=None,
                    help="torch CPU threads (default: torch's choice); 1 on a shared CPU machine")


def hardware_id(device: torch.device) -> str:
    """A folder name for the hardware results are measured on: the GPU model, else ``cpu-<model>``."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
    else:
        name = f"cpu-{tel.environment()['cpu_model'] or 'unknown'}"
    return re.sub(r"[^A-Za-z0-9._]+", "-", name).strip("-")


def bench_device(config: pytest.Config) -> torch.device:
    try:
        return resolve_device(config.getoption("--bench-device"))
    except ConfigError as err:
        raise pytest.UsageError(f"--bench-device: {err}") from None


def pytest_configure(config: pytest.Config) -> None:
    threads = config.getoption("--bench-threads")
    if threads is not None:
        if threads < 1:
            raise pytest.UsageError(f"--bench-threads {threads}: expected an integer >= 1")
        torch.set_num_threads(threads)
    # one line now for a base config that no case could start from, not a failure per case
    bench_device(config)  # a bad device is named as itself, before the config that names it
    try:
        case_config(config.getoption("--bench-config"), config.getoption("--bench-device"), FULL, FULL_RESOLUTION)
    except ConfigError as err:
        raise pytest.UsageError(f"--bench-config: {err}") from None
    # Runs before pytest-benchmark's own configure (which is trylast) opens the storage.
    if config.getoption("benchmark_storage", None) == DEFAULT_STORAGE:
        config.option.benchmark_storage = f"{DEFAULT_STORAGE}/{hardware_id(bench_device(config))}"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("--bench-slow"):
        return
    skip = pytest.mark.skip(reason="slow case: run with --bench-slow")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


def pytest_benchmark_update_machine_info(config: pytest.Config, machine_info: dict[str, Any]) -> None:
    """Add the software and accelerator every number depends on to each saved benchmark run."""
    env = tel.environment()
    # run-specific fields (time, commit) are kept out: pytest-benchmark compares machine_info between
    # runs and records the commit itself
    for key in ("timestamp", "hostname", "git_commit", "git_dirty"):
        env.pop(key, None)
    device = bench_device(config)
    machine_info["agg_bench"] = {**env, "bench_device": str(device), "hardware_id": hardware_id(device),
                                 "torch_num_threads": torch.get_num_threads()}


# --------------------------------------------------------------------------------------------------
# Sessions
# --------------------------------------------------------------------------------------------------


@pytest.fixture
def prepare(request: pytest.FixtureRequest):
    """``prepare(case, resolution)``: a :class:`Prepared` session for ``case`` at ``resolution``, closed
    after the test; skips the case when its method rejects the benchmark's settings."""
    # imported here: a bad option of the suite is refused before the model code is imported (seconds)
    from agg_bench.runtime.session import Session

    config = request.config
    made: list[Session] = []

    def make(case: Case, resolution: int) -> Prepared:
        config_file, device = config.getoption("--bench-config"), config.getoption("--bench-device")
        case_config(config_file, device, FULL, resolution)  # a broken base config fails, never skips
        try:
            cfg = case_config(config_file, device, case, resolution)
        except ConfigError as err:
            pytest.skip(f"{case.id}: its settings do not apply here: {err}")
        session = Session(cfg)
        made.append(session)
        return Prepared(session, session.collect(0).batch)

    yield make
    for session in made:
        session.estimator.close()


# --------------------------------------------------------------------------------------------------
# Summary
# --------------------------------------------------------------------------------------------------


def cost_model(info: dict[str, Any]) -> int:
    """An update's cost in forward-pass units from its pass counts: a forward 1, a backward 2."""
    return info["forward_nograd"] + info["forward_grad"] + 2 * info["backward"]


def ratio_to_full(bench: Any, full: Any) -> tuple[float, float, float]:
    """(median / full's median, and a conservative spread: q1 / full's q3, q3 / full's q1)."""
    return (bench.stats.median / full.stats.median, bench.stats.q1 / full.stats.q3, bench.stats.q3 / full.stats.q1)


def summary_lines(benchmarks: list[Any]) -> list[str]:
    """Telemetry overhead (on vs off), each method's train phase relative to full (ratio of medians, with
    the spread of the quartiles, beside the cost model's ratio from the pass counts), per resolution, and
    the start-up timings, from this run's benchmarks."""
    lines = []
    train: dict[int, dict[str, Any]] = {}
    for bench in benchmarks:
        info = bench.extra_info
        if info.get("phase") == "telemetry":
            lines.append(f"telemetry overhead at {info['resolution']} px, median of {info['rounds']} interleaved "
                         f"rounds: on (default) {100 * info['overhead_on_wall']:+.1f}% wall, "
                         f"{100 * info['overhead_on_cpu']:+.1f}% CPU; on, counting saved activations every "
                         f"iteration {100 * info['overhead_on_every_wall']:+.1f}% wall, "
                         f"{100 * info['overhead_on_every_cpu']:+.1f}% CPU")
        elif info.get("phase") == "train":
            train.setdefault(info["resolution"], {})[info["case"]] = bench
        elif info.get("phase") == "startup":
            target = f" (target <= {info['target_s']} s)" if info.get("target_s") is not None else ""
            lines.append(f"start-up {info['case']}: wall median {info['wall_median_s']:.2f} s "
                         f"[{info['wall_min_s']:.2f}-{info['wall_max_s']:.2f}], CPU (user+sys, with children) "
                         f"median {info['cpu_median_s']:.2f} s [{info['cpu_min_s']:.2f}-{info['cpu_max_s']:.2f}] "
                         f"over {info['rounds']} runs{target}")
    for resolution, cases in sorted(train.items()):
        full = cases.get("full")
        for case_id, bench in cases.items():
            info = bench.extra_info
            versus = ""
            if full is not None and case_id != "full":
                ratio, lo, hi = ratio_to_full(bench, full)
                limit = cost_model(info) / cost_model(full.extra_info)
                versus = (f", {ratio:.3f} of full's time [quartiles {lo:.3f}-{hi:.3f}], cost-model limit "
                          f"{limit:.3f} (forward 1, backward 2)")
            lines.append(f"train {resolution} px {case_id}: median {bench.stats.median:.3f} s per update{versus}; "
                         f"backward {info['backward']}, forward_grad {info['forward_grad']}, "
                         f"forward_nograd {info['forward_nograd']}, saved-activation peak "
                         f"{info['saved_activation_peak_bytes']} B")
    return lines


@pytest.hookimpl(trylast=True)
def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    bench_session = getattr(config, "_benchmarksession", None)
    lines = summary_lines([b for b in getattr(bench_session, "benchmarks", []) if b])
    if lines:
        terminalreporter.write_sep("-", "agg-bench: relative figures of this run")
        for line in lines:
            terminalreporter.write_line(line)
