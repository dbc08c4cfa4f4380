"""The registered model families: ``model.family`` value -> its :class:`FamilySpec`.

Adding a family is a module next to this one that defines its ``SPEC`` (see ``sd3.py``), one entry
below, and its name in ``ModelConfig.family``'s allowed values (``agg_bench/config/sections.py``, which
sits below the engine and so cannot read this registry; a test keeps the two equal).
"""
from __future__ import annotations

from ...errors import ConfigError
from .flux import SPEC as FLUX
from .qwenimage import SPEC as QWENIMAGE
from .sd3 import SPEC as SD3
from .spec import FamilySpec

FAMILY_SPECS: dict[str, FamilySpec] = {spec.name: spec for spec in (SD3, FLUX, QWENIMAGE)}


def family_spec(family: str, key: str = "model.family") -> FamilySpec:
    """The spec of ``family``, or a ConfigError naming ``key`` and the registered families."""
    spec = FAMILY_SPECS.get(family) if isinstance(family, str) else None
    if spec is None:
        raise ConfigError(key, family, f"one of {sorted(FAMILY_SPECS)}")
    return spec


__all__ = ["FAMILY_SPECS", "family_spec"]
