"""``agg-bench gradcheck``: what each estimator costs in gradient accuracy, on one frozen rollout.

One snapshot (made from a run config, or an existing one) is replayed with ``full`` as the reference,
then with every AGG setting of a grid (windows x alphas x route fractions x velocity reuse) and with
any extra methods. Each replay is one CSV row: its cosine and relative error to the reference, its
pass counts, its wall time, and a cached method's hit rate in the replayed forwards.

Column ``replay`` says what a row measures (:class:`agg_bench.methods.base.ReplayCase`): ``as_trained`` (the
method's own gradient on this rollout), ``replanned`` (its trained steps drawn anew from the rollout:
``fraction``), ``partial`` (part of what the method changes: ``window``, ``cached`` with ``cache_in=both``)
or ``not_applicable`` (a rollout-only cache: the row has no numbers); ``replay_note`` says why.
"""
from __future__ import annotations

import csv
import dataclasses
import json
import shutil
import time
from pathlib import Path
from typing import Any, Iterable

import torch
from tqdm import tqdm

from ..config import RunConfig
from ..engine.families import model_label
from ..errors import ConfigError, UserError
from ..io import atomic_file, atomic_path, remove_stale_temps
from ..outdir import check_suffix, claim_files
from ..records import GRADCHECK_OPTION_COLUMNS, is_integer
from ..results.formatting import csv_cell
from ..machine.devices import resolve_device
from .replays import GRID_OPTIONS, ReplayJob, agg_grid, build_estimators, check_replay_count, parse_method_specs
from .snapshot import (Snapshot, check_outside_snapshot, check_trainable, load_snapshot, replay_case_of,
                       replay_gradient, save_snapshot)

COLUMNS = (
    "method", "options", "window", "alpha", "route_frac", "reuse_rollout_velocity", "endpoint_velocity", "cache",
    "cache_in",
    "cosine_to_full", "relative_error", "grad_norm", "forward_nograd", "forward_grad", "backward",
    "seconds", "groups_routed", "route_score_mean", "ratio_dev", "cache_hit_rate", "is_reference",
    "model", "resolution", "device", "batch_size", "steps_per_sample", "replay", "replay_note",
)
# estimator options that get their own column (whichever method has them)
OPTION_COLUMNS = GRADCHECK_OPTION_COLUMNS
REFERENCE = ReplayJob("full")  # every gradcheck's first replay and row, whether --methods names it or not


def _canonical(value: Any) -> Any:
    """``value`` (a config's dict) with every number a float, so that ``route_frac=1`` and ``1.0`` compare equal."""
    if isinstance(value, dict):
        return {key: _canonical(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_canonical(item) for item in value]
    return float(value) if is_integer(value) else value


def reference_first(jobs: list[ReplayJob]) -> list[ReplayJob]:
    """``jobs`` with the reference (``full`` without options) first and once: the replays a gradcheck makes."""
    return [REFERENCE, *(job for job in jobs if job != REFERENCE)]


def check_distinct(jobs: list[ReplayJob], setups: list[tuple[RunConfig, Any]]) -> None:
    """Refuse a job whose replay (method, every option with its default, the run config it replays under)
    another job before it already makes: ``--methods agg:window=3,alpha=sigma,route_frac=1`` beside a grid row
    of those settings would replay one gradient again and write its row twice. The reference is left out:
    ``full`` with options equal to its own (``full:micro_batch=null``) is a replay of its own, a check that the
    replay is deterministic."""
    seen: dict[str, ReplayJob] = {}
    for job, (cfg, estimator) in zip(jobs, setups):
        if job == REFERENCE:
            continue
        rest = {key: value for key, value in cfg.to_dict().items() if key != "method"}
        config = estimator.config
        options = dataclasses.asdict(config) if dataclasses.is_dataclass(config) and not isinstance(config, type) else {}
        key = json.dumps(_canonical({"name": estimator.name, "options": options, "run": rest}), sort_keys=True,
                         default=str)
        first = seen.setdefault(key, job)
        if first is not job:
            given = f"{job.method}:{job.label}" if job.label else job.method
            made = first.method + (f" with {first.label}" if first.label else "")
            raise ConfigError("--methods", given, f"a replay the grid and the other --methods do not make already "
                                                  f"(this is {made} again, its row written twice)")


def compare(grads: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> tuple[float, float, float]:
    """(cosine, relative error ||g - g_ref|| / ||g_ref||, ||g||) over all parameters, in float64."""
    dot = num = ref_sq = sq = 0.0
    for name, ref in reference.items():
        g, r = grads[name].double(), ref.double()
        dot += float((g * r).sum())
        num += float((g - r).pow(2).sum())
        ref_sq += float(r.pow(2).sum())
        sq += float(g.pow(2).sum())
    cosine = dot / (sq * ref_sq) ** 0.5 if sq > 0 and ref_sq > 0 else float("nan")
    rel = (num / ref_sq) ** 0.5 if ref_sq > 0 else float("nan")
    return cosine, rel, sq ** 0.5


def _timed_replay(snapshot: Snapshot, estimator, cfg: RunConfig, case) -> tuple[dict, dict, dict, float]:
    device = snapshot.policy.device
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    grads, counts, stats = replay_gradient(snapshot, estimator, cfg, case)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return grads, counts, stats, time.perf_counter() - start


def run_gradcheck(snapshot: Snapshot, jobs: list[ReplayJob], progress: bool = True) -> list[dict]:
    """Replay ``full`` and then every job on ``snapshot``; one row (COLUMNS) per replay, reference first.
    A job whose replay is not applicable gets a row with its options and ``replay_note`` and no numbers.
    A job of ``full`` without options is the reference itself: its row is the reference's, replayed once."""
    jobs = reference_first(jobs)
    setups = build_estimators(snapshot.config, jobs)  # a bad option fails before any replay runs
    check_distinct(jobs, setups)
    cases = [replay_case_of(snapshot, estimator, cfg) for cfg, estimator in setups]
    for (_, estimator), case in zip(setups, cases):  # and steps a method cannot train, too
        if case.scope != "not_applicable":
            check_trainable(snapshot, estimator, case.train_steps if case.train_steps is not None
                            else snapshot.batch.train_steps)
    batch = snapshot.batch
    # the label a run of the snapshot's config records, so that `report --runs R --gradcheck CSV` finds the
    # run's row; a snapshot without its run config names only the family
    model = model_label(RunConfig.from_dict(snapshot.config).model) if snapshot.config else snapshot.meta.get("family")
    common = {"model": model, "resolution": snapshot.meta.get("resolution"),
              "device": str(snapshot.policy.device), "batch_size": batch.batch_size,
              "steps_per_sample": batch.steps_per_sample}
    rows: list[dict] = []
    reference = None
    bar = tqdm(list(zip(jobs, setups, cases)), desc="gradcheck", unit="replay",
               disable=not progress)
    for job, (cfg, estimator), case in bar:
        bar.set_postfix_str(f"{job.method} {job.label}".strip())
        row: dict[str, Any] = dict.fromkeys(COLUMNS)
        row.update(common, method=job.method, options=job.label, is_reference=not rows, replay=case.scope,
                   replay_note=case.note)
        row.update({key: getattr(estimator.config, key) for key in OPTION_COLUMNS
                    if hasattr(estimator.config, key)})
        rows.append(row)
        if case.scope == "not_applicable":
            continue
        grads, counts, stats, seconds = _timed_replay(snapshot, estimator, cfg, case)
        if reference is None:
            reference = grads
        cosine, rel, norm = compare(grads, reference)
        row.update(cosine_to_full=cosine, relative_error=rel, grad_norm=norm, seconds=seconds,
                   ratio_dev=stats.get("ratio_dev"), groups_routed=stats.get("agg_groups_routed"),
                   route_score_mean=stats.get("agg_route_score_mean"), cache_hit_rate=stats.get("cache_hit_rate"),
                   steps_per_sample=stats["steps_per_sample"], **counts)
    return rows


def write_csv(rows: list[dict], out: str | Path) -> Path:
    """Write ``rows`` (COLUMNS) to ``out`` atomically; missing values are empty cells, and a text cell a
    spreadsheet would run as a formula is written after a single quote, as in every CSV of agg-bench
    (:func:`~agg_bench.results.formatting.csv_cell`)."""
    out = Path(out)
    with atomic_file(out) as fh:
        writer = csv.DictWriter(fh, fieldnames=list(COLUMNS))
        writer.writeheader()
        for row in rows:
            writer.writerow({k: ("" if row.get(k) is None else csv_cell(row[k])) for k in COLUMNS})
    return out


def is_gradcheck_csv(path: Path) -> bool:
    """Whether ``path`` is a table :func:`write_csv` wrote (its header starts with the first COLUMNS)."""
    try:
        with open(path, encoding="utf-8") as fh:
            header = fh.readline(4096)
    except (OSError, UnicodeDecodeError):
        return False
    return header.split(",")[:3] == list(COLUMNS[:3])


def _has_snapshot(folder: Path) -> bool:
    return (folder / "rollout.json").exists()


def gradcheck(out: str | Path, cfg: RunConfig | None = None, snapshot_dir: str | Path | None = None,
              windows: Iterable[int] = (2, 3, 4, 5, 8), alphas: Iterable[str] = ("index", "sigma"),
              route_fracs: Iterable[float] = (0.0, 0.5, 1.0), reuse: Iterable[bool] = (False,),
              methods: Iterable[str] = (), device: str | None = None) -> list[dict]:
    """Replay the grid and ``methods`` on one snapshot and write ``out`` (CSV); returns the rows.

    With ``snapshot_dir`` holding a snapshot, that one is used; with ``snapshot_dir`` empty or new,
    one is made there from ``cfg`` and kept; without it, one is made next to ``out`` and removed.
    ``device`` defaults to ``cfg.device``, or cpu for an existing snapshot (as ``replay``).
    """
    out = Path(out)
    check_suffix(out, ".csv")
    if snapshot_dir is not None:
        check_outside_snapshot(out, snapshot_dir, "--snapshot")
    # the device first: a GPU this machine lacks is refused before anything is written or computed
    target = resolve_device(device, "--device") if device is not None else \
        resolve_device(cfg.device if cfg is not None else "cpu")
    with claim_files({out: (is_gradcheck_csv, "a gradcheck table")}):
        return _gradcheck(out, cfg, snapshot_dir, windows, alphas, route_fracs, reuse, methods, target)


def snapshot_target(out: Path) -> Path:
    """The name a gradcheck of ``out`` without ``--snapshot`` gives its temporary snapshot (an :func:`atomic_path`
    of it)."""
    return out.parent / f"{out.stem}-snapshot"


def _gradcheck(out: Path, cfg: RunConfig | None, snapshot_dir, windows, alphas, route_fracs, reuse, methods,
               device: torch.device) -> list[dict]:
    grid, extra = agg_grid(list(windows), list(alphas), list(route_fracs), list(reuse)), parse_method_specs(methods)
    check_replay_count(grid, extra, GRID_OPTIONS)  # before the rollout: a grid no one can wait for
    jobs = grid + extra
    temporary = None
    if snapshot_dir is not None and _has_snapshot(Path(snapshot_dir)):
        folder = Path(snapshot_dir)
    else:
        if cfg is None:
            raise UserError("gradcheck needs a run config to make a snapshot from (or --snapshot DIR of one)")
        # fail on a bad option, or a replay asked for twice, before the rollout, not after
        every = reference_first(jobs)
        check_distinct(every, build_estimators(cfg.to_dict(), every))
        if snapshot_dir is None:  # a killed earlier gradcheck's snapshot: a model's weights
            remove_stale_temps(snapshot_target(out))
        folder = Path(snapshot_dir) if snapshot_dir is not None else \
            atomic_path(snapshot_target(out))
        temporary = None if snapshot_dir is not None else folder
    try:
        if not _has_snapshot(folder):
            assert cfg is not None  # a folder without a snapshot came from the branch that requires cfg
            save_snapshot(cfg, folder, "--snapshot" if snapshot_dir is not None else "--out")
        snapshot = load_snapshot(folder, device)
        progress = cfg.progress if cfg is not None else bool(snapshot.config.get("progress", True))
        rows = run_gradcheck(snapshot, jobs, progress)
    finally:
        if temporary is not None:
            shutil.rmtree(temporary, ignore_errors=True)
    write_csv(rows, out)
    return rows
