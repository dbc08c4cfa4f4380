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


# Every method of a plot its own colour and marker: tab10's ten colours, then six more that none of them is
# close to, and sixteen markers: sixteen methods before a colour or a marker comes round again.
METHOD_COLORS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22",
                 "#17becf", "#000000", "#b8860b", "#4b0082", "#00ff7f", "#800000", "#4682b4")
METHOD_MARKERS = ("o", "s", "^", "v", "D", "P", "X", "*", "<", ">", "h", "p", "d", "H", "8", "1")


def method_style(k: int) -> dict[str, str]:
    """The colour and marker of the ``k``-th method of a plot (the order the methods first appear in), distinct
    from every other method's for up to 16 methods in colour and marker alike."""
    return {"color": METHOD_COLORS[k % len(METHOD_COLORS)], "marker": METHOD_MARKERS[k % len(METHOD_MARKERS)]}


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
