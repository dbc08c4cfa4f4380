"""matplotlib as every plot here uses it: drawn to files only, and every label drawn as the text it is
(tick labels of log axes included)."""
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


def log_scale(ax: Any, which: str = "y") -> None:
    """Put the ``which`` axis ("x" or "y") of ``ax`` on a log scale whose tick labels are plain numbers
    (``0.06``, ``0.1``, ``2``): matplotlib's log tick labels are mathtext (``$\\mathdefault{10^{-1}}$``),
    which :func:`pyplot` turns off, so they would be drawn as that source text."""
    from matplotlib.ticker import LogFormatter

    class PlainLogFormatter(LogFormatter):
        """LogFormatter's choice of the ticks to label, each labelled ``%g``."""

        def _num_to_string(self, x, vmin, vmax):  # the hook matplotlib's own log formatters override
            return f"{x:g}"

    getattr(ax, f"set_{which}scale")("log")
    axis = getattr(ax, f"{which}axis")
    axis.set_major_formatter(PlainLogFormatter())
    axis.set_minor_formatter(PlainLogFormatter(labelOnlyBase=False, minor_thresholds=(2, 0.5)))
