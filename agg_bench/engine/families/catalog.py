"""The registered model families: ``model.family`` value -> its :class:`FamilySpec`; ``model.architecture``
value -> the public architecture of ``model.preset: random`` (:func:`architecture`, no torch: the runtime's
config check and the workflow's methods check name a bad one without importing the models).

Adding a family is a module next to this one that defines its ``SPEC`` (see ``sd3.py``), one entry
below, and its name in ``ModelConfig.family``'s allowed values (``agg_bench/config/sections.py``, which
sits below the engine and so cannot read this catalog; a test keeps the two equal).
"""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from ...errors import ConfigError
from .flux import SPEC as FLUX
from .qwenimage import SPEC as QWENIMAGE
from .sd3 import SPEC as SD3
from .spec import Architecture, FamilySpec

if TYPE_CHECKING:
    from ...config import ModelConfig

FAMILY_SPECS: dict[str, FamilySpec] = {spec.name: spec for spec in (SD3, FLUX, QWENIMAGE)}
# The public checkpoints of every registered family, by model.architecture name, and each family's default.
ARCHITECTURES: dict[str, Architecture] = {a.name: a for spec in FAMILY_SPECS.values() for a in spec.architectures}
DEFAULT_ARCHITECTURE: dict[str, str] = {name: spec.default_architecture for name, spec in FAMILY_SPECS.items()}


def family_spec(family: str, key: str = "model.family") -> FamilySpec:
    """The spec of ``family``, or a ConfigError naming ``key`` and the registered families."""
    spec = FAMILY_SPECS.get(family) if isinstance(family, str) else None
    if spec is None:
        raise ConfigError(key, family, f"one of {sorted(FAMILY_SPECS)}")
    return spec


def architecture(family: str, name: str | None = None) -> Architecture:
    """The architecture ``name`` of ``family`` (None: the family's default), or a ConfigError naming the
    allowed ones."""
    name = DEFAULT_ARCHITECTURE.get(family) if name is None else name
    arch = ARCHITECTURES.get(name) if isinstance(name, str) else None
    if arch is None or arch.family != family:
        allowed = sorted(a.name for a in ARCHITECTURES.values() if a.family == family)
        raise ConfigError("model.architecture", name,
                          f"one of {allowed} for model.family {family} (all: {sorted(ARCHITECTURES)})")
    return arch


def model_label(model: ModelConfig) -> str:
    """The model a run's records, a calibration and a gradcheck row name (so that the report matches them):
    the family and a local folder's name, an architecture's name and ``-random``, or the family and preset
    (``sd3-tiny``)."""
    if model.pretrained:
        return f"{model.family}:{Path(model.pretrained).name}"
    if model.preset == "random":
        return f"{architecture(model.family, model.architecture).name}-random"
    return f"{model.family}-{model.preset}"


__all__ = ["ARCHITECTURES", "DEFAULT_ARCHITECTURE", "FAMILY_SPECS", "architecture", "family_spec", "model_label"]
