"""The report's plots (``PLOTS``, each ``<name>.png``), drawn from the tables as the report wrote them
(``PLOT_TABLES``): the records (reward curves), the efficiency table (memory, time, passes, the cosine /
cost frontier) and the ablation table (gradient cosine against W). Nothing here recomputes a table.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Mapping

import numpy as np
import pandas as pd

from ..io import save_figure
from .loading import as_bool, is_number
from .plotting import log_scale, pyplot
from ..records import PHASE_TIME_KEYS, PLOTS

PHASES = PHASE_TIME_KEYS
SHARED_YLABEL_IN = 0.45  # inches a figure's one y label takes left of its panels (two lines of 10 pt text)


def _panels(plt, keys: list, ncols: int, width: float = 4.2, height: float = 3.2):
    nrows = max(1, math.ceil(len(keys) / ncols))
    fig, axes = plt.subplots(nrows, ncols, figsize=(width * ncols, height * nrows), squeeze=False)
    for ax in axes.flat[len(keys):]:
        ax.set_visible(False)
    return fig, list(axes.flat)


def _colors(labels: list[str]) -> dict[str, Any]:
    import matplotlib

    cmap = matplotlib.colormaps["tab10" if len(set(labels)) <= 10 else "tab20"]
    return {label: cmap(i % cmap.N) for i, label in enumerate(dict.fromkeys(labels))}


def _empty_figure(plt, path: Path, message: str) -> None:
    fig, ax = plt.subplots(figsize=(5, 2))
    ax.axis("off")
    ax.text(0.5, 0.5, message, ha="center", va="center")
    save_figure(fig, path)
    plt.close(fig)


def _panel_keys(df: pd.DataFrame, columns: tuple[str, ...]) -> list[tuple]:
    """The distinct values of ``columns`` in ``df``, one panel each, in the order they first appear (missing
    values are one value: an imported log without a resolution gets one panel, not one per row)."""
    return list(df[list(columns)].drop_duplicates().itertuples(index=False, name=None))


def _rows(df: pd.DataFrame, columns: tuple[str, ...], key: tuple) -> pd.DataFrame:
    """The rows of one panel: ``columns`` equal to ``key``, a missing value matching a missing value (an
    imported log without a resolution still has its panel)."""
    match = pd.Series(True, index=df.index)
    for column, value in zip(columns, key):
        match &= df[column].isna() if pd.isna(value) else df[column] == value
    return df[match]


def _labels(df: pd.DataFrame) -> pd.Series:
    """Each row's method label in the plots: its method, marked ``(imported)`` for a run converted from another code
    base's log; read a column at a time (a run's 100,000 records are as many rows)."""
    sources = df["source"] if "source" in df else [None] * len(df)
    return pd.Series([f"{method} (imported)" if source == "imported" else str(method)
                      for method, source in zip(df["method"], sources)], index=df.index)


def reward_curves(panel: pd.DataFrame, x: str) -> dict[str, dict]:
    """Per method label of one panel: x (iteration, or the median over seeds of the cumulative wall
    seconds at each iteration), the mean reward over seeds and its band: +-1 standard deviation over
    seeds, or with one seed over the iteration's images (``reward_std``); ``band`` names which."""
    curves = {}
    for label, rows in panel.assign(label=_labels(panel)).groupby("label", sort=False):
        rows = rows.sort_values("iteration").assign(_t=lambda d: d.groupby("run_dir")["t_iter_s"].cumsum())
        by_iteration = rows.groupby("iteration", sort=True)
        seeds = rows["run_dir"].nunique()
        mean = by_iteration["reward_mean"].mean()
        spread = by_iteration["reward_mean"].std(ddof=0) if seeds > 1 else by_iteration["reward_std"].mean()
        xs = mean.index.to_numpy(float) if x == "iteration" else by_iteration["_t"].median().to_numpy(float)
        curves[label] = {"x": xs, "mean": mean.to_numpy(float), "spread": spread.fillna(0).to_numpy(float),
                         "band": f"+-1 std over {seeds} seeds" if seeds > 1 else "+-1 std over the images"}
    return curves


def plot_rewards(records: pd.DataFrame, path: Path, x: str) -> None:
    """Reward per iteration (``x="iteration"``) or per wall-clock second (``x="wallclock"``), one line
    per method (the mean over seeds) with its band (:func:`reward_curves`), one panel per model x
    resolution x hardware."""
    plt = pyplot()
    ok = records[(records["status"] == "ok") & records["reward_mean"].notna()] if not records.empty else records
    if "weights" in ok:  # random-weight rewards compare nothing
        ok = ok[ok["weights"] != "random"]
    if ok.empty:
        return _empty_figure(plt, path, "no iteration finished")
    keys = _panel_keys(ok, ("model", "resolution", "hardware"))
    fig, axes = _panels(plt, keys, ncols=min(3, len(keys)))
    colors = _colors(list(_labels(ok)))
    for ax, key in zip(axes, keys):
        panel = _rows(ok, ("model", "resolution", "hardware"), key)
        bands = set()
        for label, curve in reward_curves(panel, x).items():
            style = "--" if "(imported)" in label else "-"
            ax.plot(curve["x"], curve["mean"], style, marker=".", color=colors[label], label=label)
            ax.fill_between(curve["x"], curve["mean"] - curve["spread"], curve["mean"] + curve["spread"],
                            color=colors[label], alpha=0.15, linewidth=0)
            bands.add(curve["band"])
        ax.set_title(f"{key[0]} {key[1]} px, {key[2]}\nbands: {'; '.join(sorted(bands))}", fontsize=8)
        ax.set_xlabel("iteration" if x == "iteration" else "cumulative wall-clock (s; with seeds, their median)")
        ax.set_ylabel("mean reward")
        ax.grid(alpha=0.3)
    _legend(fig, axes)
    save_figure(fig, path)
    plt.close(fig)


def _legend(fig, axes, ylabel: str | None = None) -> None:
    """One legend for the figure, below its panels (each label once), and the panels laid out around it.
    ``ylabel``: one y label for the whole figure, left of the panels, for figures whose panels share one
    (a label per panel runs into the neighbouring panels when it is long)."""
    handles, labels = {}, []
    for ax in axes:
        for h, label in zip(*ax.get_legend_handles_labels()):
            if label not in handles:
                handles[label] = h
                labels.append(label)
    if handles:
        fig.legend([handles[k] for k in labels], labels, loc="upper center", bbox_to_anchor=(0.5, 0.0),
                   ncol=min(5, len(labels)), fontsize=8, frameon=False)
    if ylabel is None:
        if handles:
            fig.tight_layout()
        return
    fig.tight_layout(rect=(SHARED_YLABEL_IN / fig.get_figwidth(), 0, 1, 1))
    # just left of the panels' tick labels, centred on the panels
    shown = [ax for ax in axes if ax.get_visible()]
    renderer = fig.canvas.get_renderer()
    x0 = min(ax.get_tightbbox(renderer).x0 for ax in shown) / fig.bbox.width
    y = (min(ax.get_position().y0 for ax in shown) + max(ax.get_position().y1 for ax in shown)) / 2
    fig.supylabel(ylabel, x=x0 - 0.005, y=y, ha="right", va="center", fontsize=10)


def _resolution_panels(plt, df: pd.DataFrame):
    """A figure of one panel per model x hardware, each with a line per method over resolution:
    ``(fig, axes, [(ax, panel rows, [(method, its rows by resolution, color), ...]), ...])``."""
    keys = _panel_keys(df, ("model", "hardware"))
    fig, axes = _panels(plt, keys, ncols=min(3, len(keys)))
    colors = _colors(df["method"])
    panels = []
    for ax, (model, hardware) in zip(axes, keys):
        panel = _rows(df, ("model", "hardware"), (model, hardware))
        lines = [(method, line.sort_values("resolution"), colors[method])
                 for method, line in panel.groupby("method", sort=False)]
        ax.set_title(f"{model}, {hardware}", fontsize=9)
        ax.set_xlabel("resolution (px)")
        ax.set_xticks(sorted(panel["resolution"].dropna().astype(int).unique()))
        ax.grid(alpha=0.3)
        panels.append((ax, panel, lines))
    return fig, axes, panels


def plot_memory(efficiency: pd.DataFrame, path: Path) -> None:
    """Peak memory vs resolution per method, one panel per model x hardware: the CUDA allocator peak in a
    panel that measured one, else the peak of saved activations (on a CPU the allocator has no peak). A
    cell that ran out of memory is marked OOM at the bottom of its panel."""
    plt = pyplot()
    df = efficiency[efficiency["source"] == "measured"] if not efficiency.empty else efficiency
    if df.empty:
        return _empty_figure(plt, path, "no measured runs")
    fig, axes, panels = _resolution_panels(plt, df)
    for ax, panel, lines in panels:
        use_alloc = panel["peak_alloc_mib"].notna().any()
        column = "peak_alloc_mib" if use_alloc else "saved_act_mib"
        for method, line, color in lines:
            oom = line[line["status"] == "oom"]
            if line[column].isna().all() and oom.empty:  # nothing to draw: no legend entry either
                continue
            ax.plot(line["resolution"].astype(float), line[column], marker="o", color=color, label=method)
            for _, bad in oom.iterrows():
                ax.annotate("OOM", (float(bad["resolution"]), 0.02), xycoords=ax.get_xaxis_transform(),
                            color=color, fontsize=7, ha="center")
        ax.set_ylabel("peak allocated (MiB)" if use_alloc else "peak saved activations (MiB)")
    _legend(fig, axes)
    save_figure(fig, path)
    plt.close(fig)


def plot_time_breakdown(efficiency: pd.DataFrame, path: Path) -> None:
    """Stacked seconds per iteration (rollout / reward / train / the rest) per method, one panel per
    model x resolution x hardware; one y label for the figure (:func:`_seconds_label`)."""
    plt = pyplot()
    df = efficiency[efficiency["t_iter_s"].notna()] if not efficiency.empty else efficiency
    if df.empty:
        return _empty_figure(plt, path, "no timed iterations")
    keys = _panel_keys(df, ("model", "resolution", "hardware"))
    fig, axes = _panels(plt, keys, ncols=min(3, len(keys)), width=5.0)
    phase_colors = {"t_rollout_s": "#4c72b0", "t_reward_s": "#dd8452", "t_train_s": "#55a868"}
    names = {"t_rollout_s": "rollout", "t_reward_s": "reward", "t_train_s": "train"}
    ylabel, basis_in_titles = _seconds_label(df, "seconds per iteration, median", ("model", "resolution", "hardware"))
    for ax, key in zip(axes, keys):
        panel = _rows(df, ("model", "resolution", "hardware"), key)
        labels = list(_labels(panel))
        bottom = np.zeros(len(panel))
        for phase in PHASES:
            values = panel[phase].fillna(0).to_numpy(float)
            ax.bar(range(len(panel)), values, bottom=bottom, color=phase_colors[phase], label=names[phase])
            bottom += values
        # the rest of the iteration (advantages, optimizer step), or all of it for a log without phases
        rest = np.clip(panel["t_iter_s"].to_numpy(float) - bottom, 0, None)
        ax.bar(range(len(panel)), rest, bottom=bottom, color="#b0b0b0", label="other / not split")
        # the spread: the iteration's interquartile range around its median (the top of the stack)
        top = bottom + rest
        err = _iqr_err(panel, "iter", top)
        ax.errorbar(range(len(panel)), top, yerr=err, fmt="none", ecolor="black", capsize=3, lw=1,
                    label="iteration IQR")
        # room above the tallest bar or whisker: a stacked bar's top edge is sticky, so no margin by itself
        highest = np.nanmax(np.concatenate([top, top + err[1]])) if len(top) else np.nan
        if np.isfinite(highest) and highest > 0:
            ax.set_ylim(0, 1.05 * highest)
        ax.set_xticks(range(len(panel)), labels, rotation=60, ha="right", fontsize=7)
        ax.set_title(f"{key[0]} {key[1]} px, {key[2]}" + (f"\n{_basis_label(panel)}" if basis_in_titles else ""),
                     fontsize=9)
        ax.grid(alpha=0.3, axis="y")
    _legend(fig, axes, ylabel)
    save_figure(fig, path)
    plt.close(fig)


def plot_gradcheck(ablation: pd.DataFrame, path: Path) -> None:
    """Gradient cosine to ``full`` vs W, one line per alpha x route_frac x reuse, one panel per model x
    resolution."""
    plt = pyplot()
    df = ablation[(ablation["method"] == "agg") & ablation["window"].notna()] if not ablation.empty else ablation
    if df.empty:
        return _empty_figure(plt, path, "no AGG gradcheck results")
    keys = _panel_keys(df, ("model", "resolution"))
    fig, axes = _panels(plt, keys, ncols=min(3, len(keys)))
    series = ["alpha", "route_frac", "reuse_rollout_velocity"]
    # color: alpha x route_frac; dashed: rollout-velocity reuse (same gradient, fewer no-grad passes)
    colors = _colors([f"alpha={a}, route={r:g}" for a, r in zip(df["alpha"], df["route_frac"].astype(float))])
    for ax, (model, resolution) in zip(axes, keys):
        panel = _rows(df, ("model", "resolution"), (model, resolution))
        for key, line in panel.groupby(series, dropna=False, sort=False):
            line = line.sort_values("window")
            base = f"alpha={key[0]}, route={float(key[1]):g}"
            reuse = as_bool(key[2])
            ax.plot(line["window"].astype(float), line["cosine_to_full"].astype(float), "--" if reuse else "-",
                    marker="o", color=colors[base], label=base + (", reuse" if reuse else ""))
        ax.set_title(f"{model} {resolution} px", fontsize=9)
        ax.set_xlabel("W (steps per group)")
        _integer_axis(ax.xaxis)
        ax.set_ylabel("gradient cosine to full")
        ax.grid(alpha=0.3)
    _legend(fig, axes)
    save_figure(fig, path)
    plt.close(fig)


def _integer_axis(axis) -> None:
    """Ticks at whole numbers only: for axes that count things (passes, W, pixels)."""
    from matplotlib.ticker import MaxNLocator

    axis.set_major_locator(MaxNLocator(integer=True))


def _iqr_err(df: pd.DataFrame, phase: str, center) -> np.ndarray:
    """(2, n) error-bar lengths from ``center`` down to p25 and up to p75 of ``phase``'s seconds."""
    center = np.asarray(center, dtype=float)
    lo = df[f"t_{phase}_p25_s"].to_numpy(float)
    hi = df[f"t_{phase}_p75_s"].to_numpy(float)
    return np.vstack([np.clip(center - lo, 0, None), np.clip(hi - center, 0, None)])


def _basis_label(df: pd.DataFrame) -> str:
    """Which seconds the rows of ``df`` are timed in, in words."""
    bases = sorted(set(df["time_basis"].dropna())) if "time_basis" in df else []
    names = {"cpu": "process CPU time", "wall": "wall clock / CUDA events"}
    return ", ".join(names.get(b, b) for b in bases) or "wall clock"


def _seconds_label(df: pd.DataFrame, what: str, panels: tuple[str, ...]) -> tuple[str, bool]:
    """The figure's one y label: ``what`` and the seconds it is timed in when every panel (a value of the
    ``panels`` columns) has the same; and whether they differ, so that each panel title names its own."""
    shared = len({_basis_label(panel) for _, panel in df.groupby(list(panels), dropna=False)}) == 1
    return (f"{what}\n({_basis_label(df)})" if shared else what), not shared


def plot_time_resolution(efficiency: pd.DataFrame, path: Path) -> None:
    """Seconds per iteration (median, with the p25-p75 band and error bars) against resolution on a log
    axis, one line per method, one panel per model x hardware; one y label for the figure."""
    plt = pyplot()
    df = efficiency[(efficiency["source"] == "measured") & efficiency["t_iter_s"].notna()] \
        if not efficiency.empty else efficiency
    if df.empty:
        return _empty_figure(plt, path, "no timed iterations")
    fig, axes, panels = _resolution_panels(plt, df)
    ylabel, basis_in_titles = _seconds_label(df, "seconds per iteration, median and IQR", ("model", "hardware"))
    for ax, panel, lines in panels:
        for method, line, color in lines:
            xs, med = line["resolution"].astype(float).to_numpy(), line["t_iter_s"].to_numpy(float)
            ax.errorbar(xs, med, yerr=_iqr_err(line, "iter", med), marker="o", capsize=3, color=color, label=method)
            ax.fill_between(xs, line["t_iter_p25_s"].to_numpy(float), line["t_iter_p75_s"].to_numpy(float),
                            color=color, alpha=0.15, lw=0)
        if basis_in_titles:
            ax.set_title(f"{ax.get_title()}\n{_basis_label(panel)}", fontsize=9)
        log_scale(ax, "y")
    _legend(fig, axes, ylabel)
    save_figure(fig, path)
    plt.close(fig)


def plot_backward_passes(efficiency: pd.DataFrame, path: Path) -> None:
    """Backward passes per iteration (counted, per sample) per method, one panel per model x resolution
    (counts do not depend on the hardware)."""
    plt = pyplot()
    df = efficiency[(efficiency["source"] == "measured") & efficiency["backward"].notna()] \
        if not efficiency.empty else efficiency
    if df.empty:
        return _empty_figure(plt, path, "no counted passes")
    df = df.drop_duplicates(["method", "model", "resolution"])
    keys = _panel_keys(df, ("model", "resolution"))
    fig, axes = _panels(plt, keys, ncols=min(3, len(keys)))
    colors = _colors(df["method"])
    for ax, (model, resolution) in zip(axes, keys):
        panel = _rows(df, ("model", "resolution"), (model, resolution))
        labels = list(panel["method"])
        ax.bar(range(len(panel)), panel["backward"].to_numpy(float), color=[colors[m] for m in labels])
        ax.set_xticks(range(len(panel)), labels, rotation=60, ha="right", fontsize=7)
        _integer_axis(ax.yaxis)
        ax.set_title(f"{model} {resolution} px", fontsize=9)
        ax.set_ylabel("backward passes per iteration")
        ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    save_figure(fig, path)
    plt.close(fig)


def plot_cosine_cost(efficiency: pd.DataFrame, path: Path) -> None:
    """The accuracy / cost frontier: gradient cosine to ``full`` against the train phase's time relative
    to ``full`` (1 / train speedup, with its 95 % interval as error bars), one point per method, one
    panel per model x resolution x hardware with gradient checks."""
    plt = pyplot()
    df = efficiency[efficiency["grad_cosine"].notna() & efficiency["train_speedup"].notna()] \
        if not efficiency.empty else efficiency
    if df.empty:
        return _empty_figure(plt, path, "no run with both a gradient check and a train speedup")
    keys = _panel_keys(df, ("model", "resolution", "hardware"))
    fig, axes = _panels(plt, keys, ncols=min(3, len(keys)))
    colors = _colors(df["method"])
    for ax, key in zip(axes, keys):
        panel = _rows(df, ("model", "resolution", "hardware"), key)
        for _, row in panel.iterrows():
            cost = 1 / row["train_speedup"]
            lo = 1 / row["train_speedup_hi"] if is_number(row["train_speedup_hi"]) else cost
            hi = 1 / row["train_speedup_lo"] if is_number(row["train_speedup_lo"]) else cost
            ax.errorbar([cost], [row["grad_cosine"]], xerr=[[max(cost - lo, 0)], [max(hi - cost, 0)]], fmt="o",
                        capsize=3, color=colors[row["method"]], label=row["method"])
        ax.set_title(f"{key[0]} {key[1]} px, {key[2]}", fontsize=9)
        ax.set_xlabel(f"train time relative to full ({_basis_label(panel)})", fontsize=8)
        ax.set_ylabel("gradient cosine to full")
        ax.grid(alpha=0.3)
    _legend(fig, axes)
    save_figure(fig, path)
    plt.close(fig)


def write_plots(tables: Mapping[str, pd.DataFrame], out_dir: str | Path) -> list[Path]:
    """Every plot of PLOTS as ``out_dir/<name>.png``, from the tables of ``PLOT_TABLES`` as written
    (:func:`agg_bench.results.loading.load_tables`); a plot without data says so in its image."""
    out_dir = Path(out_dir)
    paths = {name: out_dir / f"{name}.png" for name in PLOTS}
    records, efficiency = tables["records"], tables["efficiency"]
    plot_rewards(records, paths["reward_iteration"], "iteration")
    plot_rewards(records, paths["reward_wallclock"], "wallclock")
    plot_memory(efficiency, paths["memory_resolution"])
    plot_time_breakdown(efficiency, paths["time_breakdown"])
    plot_time_resolution(efficiency, paths["time_resolution"])
    plot_backward_passes(efficiency, paths["backward_passes"])
    plot_cosine_cost(efficiency, paths["cosine_cost"])
    plot_gradcheck(tables["ablation"], paths["gradcheck_cosine"])
    return list(paths.values())
