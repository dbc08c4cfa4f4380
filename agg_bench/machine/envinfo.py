"""The machine and software a run measured on: ``environment()``, what a run folder's env.json holds
(versions of Python, torch and the packages, CPU model, GPUs, driver, git commit, host). Re-exported by
:mod:`agg_bench.machine.telemetry`."""
from __future__ import annotations

import datetime
import functools
import os
import platform
import socket
import subprocess
from importlib import metadata
from pathlib import Path
from typing import Any

import torch

from ..sources import source_digest
from ..threads import usable_cores
from .devices import cuda_index
from .nvml import _shutdown_quietly


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


def _git(repo_dir: Path, *args: str) -> str | None:
    try:
        result = subprocess.run(
            ["git", "--no-optional-locks", "-C", str(repo_dir), *args],
            capture_output=True, text=True, timeout=10, check=True,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return result.stdout.strip()


@functools.cache
def _git_state(repo_dir: Path) -> tuple[str | None, str | None]:
    """The commit of the repository holding ``repo_dir`` (None outside git) and ``git status --porcelain`` of its
    tracked files (None without a commit): read once per process and folder, as :func:`source_digest` is (a cell
    or campaign window runs many runs in one process, each writing its env.json). Like the digest, it describes
    the code the process loaded, whatever the repository holds later."""
    commit = _git(repo_dir, "rev-parse", "HEAD")
    status = _git(repo_dir, "status", "--porcelain", "--untracked-files=no") if commit else None
    return commit, status


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


def measured_on(device: torch.device) -> dict[str, Any]:
    """What a run on ``device`` measures with, in :func:`environment`'s keys: the code (``source_digest``), the
    GPU (``gpu_name``, None on the CPU) and the CPU model (``cpu_model``). A resumed run continues only where the
    run folder's env.json names the same (:func:`agg_bench.runtime.runfolder.machine_change`)."""
    return {"source_digest": source_digest(),
            "gpu_name": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
            "cpu_model": _cpu_model()}


def environment(device: torch.device | None = None) -> dict[str, Any]:
    """The machine and software a result was measured on, for ``env.json`` and every benchmark row.

    GPU fields describe the GPUs this process can see (``CUDA_VISIBLE_DEVICES`` applies); ``gpu_name`` is the
    one the result was measured on: ``device``'s where it is a CUDA device, None where ``device`` is another (a
    run on the CPU measured on no GPU, as its records say), and the current CUDA device without a ``device``;
    ``git_commit`` is the commit of the repository holding this package (None outside git) and
    ``git_dirty`` whether tracked files differ from it; ``source_digest`` is the hash of the code itself
    (:func:`agg_bench.sources.source_digest`), in or out of git.
    """
    cuda_available = torch.cuda.is_available()
    gpu_count = torch.cuda.device_count() if cuda_available else 0
    gpu_names = [torch.cuda.get_device_name(i) for i in range(gpu_count)]
    gpu_memory = [int(torch.cuda.get_device_properties(i).total_memory) for i in range(gpu_count)]
    # not device 0: a rank on a node whose GPUs all stay visible (or a run on cuda:N) measures on another one
    if not gpu_count or (device is not None and device.type != "cuda"):
        index = None
    else:
        index = cuda_index(device) if device is not None else torch.cuda.current_device()
    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    commit, status = _git_state(Path(__file__).resolve().parent)
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
        "gpu_name": gpu_names[index] if index is not None else None,
        "gpu_total_memory_bytes": gpu_memory,
        "git_commit": commit or None,
        "git_dirty": bool(status) if status is not None else None,
        "source_digest": source_digest(),
        "hostname": socket.gethostname(),
        "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
