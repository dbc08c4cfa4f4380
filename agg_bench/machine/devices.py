"""The torch device a config or a flag names.

``device: cpu | cuda | cuda:N | auto`` (or ``--device``) is checked here once, for a run and for every
command that runs a model (``snapshot``, ``replay``, ``gradcheck``, ``calibrate``, ``embed``, ``profile``):
a name torch would take but this machine cannot serve is a :class:`~agg_bench.errors.ConfigError` before
anything is built.
"""
from __future__ import annotations

import torch

from ..config import device_expected, device_parts
from ..errors import ConfigError


def resolve_device(name: str, key: str = "device", auto: bool = True) -> torch.device:
    """The torch device ``name`` (cpu, cuda, cuda:N or auto: cuda where available) names; a ConfigError
    naming ``key`` (the config key or flag it came from) for another name or a GPU this machine lacks.
    ``auto`` False: the key takes no ``auto`` (``pretrain``'s ``device``), so a refusal does not offer it."""
    parts = device_parts(name)
    if parts is None:
        raise ConfigError(key, name, device_expected(auto))
    kind, index = parts
    if kind == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(kind, index) if index is not None else torch.device(kind)
    if device.type == "cuda" and not torch.cuda.is_available():
        why = f"torch {torch.__version__} is built without CUDA" if torch.version.cuda is None else \
            "no CUDA device is visible"
        raise ConfigError(key, name, f"{'cpu or auto' if auto else 'cpu'}: CUDA is not available on this machine "
                                     f"({why})")
    if device.index is not None and device.index >= torch.cuda.device_count():
        raise ConfigError(key, name, f"a CUDA device this machine has ({torch.cuda.device_count()} visible: "
                                     f"cuda:0 to cuda:{torch.cuda.device_count() - 1})")
    return device


def is_cuda(device: torch.device) -> bool:
    return device.type == "cuda"


def cuda_index(device: torch.device) -> int:
    """The CUDA ordinal of ``device`` (the current device where it names none)."""
    return device.index if device.index is not None else torch.cuda.current_device()
