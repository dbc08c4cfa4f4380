"""matplotlib as every plot here uses it: drawn to files only, and every label drawn as the text it is."""
from __future__ import annotations

from typing import Any


def pyplot() -> Any:
    """``matplotlib.pyplot`` on the file-only Agg backend, with mathtext off: labels come from run folders,
    manifests and configs, where a ``$`` is a character, and mathtext would parse ``$...$`` (and fail on
    an unbalanced one)."""
    import matplotlib

    matplotlib.use("Agg")
    matplotlib.rcParams["text.parse_math"] = False
    import matplotlib.pyplot as plt

    return plt
