"""``agg-bench campaign``: a sweep filled in run by run over short windows of GPU time, into committed reference
results.

A campaign is a sweep config whose runs are too many for one window of GPU time: ``config/h200.yaml`` (the
paper's efficiency comparison on one H200) or ``config/learning_gpu.yaml`` (the learning sweep on one GPU).
Each ``campaign run --minutes N`` is one window:

1. It reads the sweep (every check of the workflow's, :class:`~agg_bench.tools.sweep.Sweep`) and takes as done
   every run that is already finished, in the reference folder (``--reference``, e.g.
   ``results/reference/h200``) or in its own work folder (``--work``, from an earlier window on the same
   machine): a run folder with every file ``campaign unpack`` requires of a finished run (each of its files
   there a regular file, not a symbolic link, as unpack takes them), whose summary says ``ok``, whose
   ``config.json`` is the run's config as the sweep composes it today and whose ``metrics.jsonl`` holds records
   unpack takes, with its other files read as unpack reads them (:func:`~agg_bench.tools.archive.read_run`).
2. A sweep whose runs read a model that its ``pretrain`` section makes (``results/pretrained/<label>``) gets
   it first: from the reference (``pretrained/<label>``, packed by the window that made it), else by an
   ``agg-bench pretrain`` process. A model there that is not the reference's is refused: the reference's runs
   were trained from the reference's model. So is a model folder whose ``pretrain.json`` does not record the
   config that the sweep's ``pretrain.<label>`` composes (``threads`` aside): one line naming the folder and
   the keys that differ, nothing written (:meth:`Campaign.prepare_models`). The ``--cpu`` form pre-trains its
   toy model into a folder of its own (``results/pretrained/<label>-cpu``), never the sweep's.
3. It orders the runs left by the sweep's ``campaign.priority`` (selectors of model, resolution and methods:
   each selector's runs before the next one's; the rest last, in the sweep's order) and cuts that order into
   processes: consecutive runs of one model x resolution x device, at most the device's ``runs_per_job`` of
   them, are one ``agg-bench cell`` process (the model built once, :mod:`agg_bench.runtime.model_reuse`),
   which, unless ``campaign.calibrate`` is false, then calibrates the methods it finished beside ``full``
   (paired rounds: the tables' train speedups and the cost model's prediction on that machine) on the model it
   built (:mod:`agg_bench.tools.cell_calibration`), in calibrations of at most ``campaign.calibrate_methods``
   methods each (default 3; ``full`` in every one as the baseline, not counted), each written as it ends, none
   started that its estimate says would end after the deadline. Before those, the calibrations left undone:
   for every cell, the methods whose runs are finished (in the reference or the work folder) but that no
   calibration there timed (its ``methods``), most valuable first (:meth:`Campaign.work` says why), each cell's
   in one cell process of calibrations only, not started when its first calibration would not end before the
   window stops. A calibration cut at the deadline, or one that fails, leaves no file, so its methods stay
   pending and a later window times them. ``campaign.parallel`` processes run at a time (default 1: a full-size model
   has the GPU to itself; the learning sweep's small runs share one). An unfinished attempt of a run in the
   work folder is removed first, under that run folder's claim (:mod:`agg_bench.outdir`); a run folder whose
   claim another process holds (a run writing there) is left alone, neither removed nor written: one line on
   stderr names it and that process's PID, the window log lists it under the process's ``busy``, and a later
   window takes the run.
4. It stops cleanly before the deadline: a cell process is told the deadline (it starts no run that the
   longest run so far says would not end before it), no process starts after ``STOP_MARGIN_S`` seconds before
   it, and a process still running then is sent SIGTERM (the run it is in ends ``interrupted``) and killed
   ``KILL_AFTER_S`` later if it has not ended, or at the deadline if that comes first (a window shorter than
   that grace ends at its deadline; no pretrain process starts after the stop either). A SIGTERM or SIGINT to
   the campaign itself does the same at once, and the command then exits with 128 + N. No process outlives the
   campaign: each leads a process group of its own, a second signal (which ends the campaign at once,
   :mod:`agg_bench.stopping`) kills that group first, and when the campaign dies any other way (``kill -9``) a
   guard process kills that group (the process and what it started; Linux's parent-death signal, which also
   ends the process, reaches no further).
5. It packs every finished run it holds that the reference lacks, without checkpoints, the pre-trained model
   the reference lacks, the window's calibrations and its log (``windows/<stamp>.json``: what ran, how long,
   what ended how), into one archive (``--archive``, default ``WORK/campaign.tar.gz``; a few MiB). A run cut
   off by the deadline is not in it. :mod:`agg_bench.tools.archive` says what ``campaign unpack`` lets into
   the reference.

``campaign status`` prints what is done and what is missing, in the order the next window takes it: the runs,
and the methods no calibration timed yet with the calibrations the next window takes for them.
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import fnmatch
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from .. import stopping
from ..config import DEFAULTS, dotted_value, load_config, read_yaml_mapping
from ..config.load import first_difference
from ..errors import QUOTE_CHARS, ConfigError, UserError, quote, shown
from ..io import atomic_target, is_temp_name, remove_stale_temps, write_json
from ..jsonfiles import JsonFileError, TooLarge, is_regular_file, read_json_object
from ..outdir import Busy, Claim, Contents, claim_files, claim_folder, remove_owned, remove_stale_harness_files
from ..records import is_finite_number
from ..runtime.cell import job_entry
from ..outputs import RUN_CONTENTS
from . import archive as archives
from . import cell_calibration
from .sweep import (PRETRAINED_DIR, Sweep, SweepError, check_sweep, flatten, is_pretrained_here,
                    learning_settings, overrides_of)

if TYPE_CHECKING:
    from .calibrate import CalibrationConfig

ROOT = Path(__file__).resolve().parents[2]
SCHEMA = ROOT / "workflow" / "schemas" / "config.schema.yaml"

MAX_MINUTES = 24 * 60
STAMP_FORMAT = "%Y%m%dT%H%M%S"  # a window's start (UTC), which names its log, cells and calibrations
MAX_PARALLEL = 64
MAX_CALIBRATE_METHODS = 32  # campaign.calibrate_methods: at most this many methods a calibration
DEFAULT_CALIBRATE_METHODS = 3
STARTED_SLACK_S = 5.0  # --started may be this far ahead of the clock (another process read it)
STOP_MARGIN_S = 20.0  # no process starts, and the running ones get SIGTERM, this long before the deadline
KILL_AFTER_S = 12.0  # a process that has not ended this long after SIGTERM is killed
PR_SET_PDEATHSIG = 1  # linux/prctl.h: the signal a child gets when the thread that started it ends
POLL_S = 0.25
# the --cpu form of a learning sweep: a few iterations of every method on the pre-trained model, on the CPU, each
# on one prompt's group (the group size and the sampling schedule, on which the methods lay out their windows,
# trees and guessed generations, stay as written)
CPU_LEARNING_SET = {"train.budget": None, "train.iterations": 2, "eval.every": 1, "eval.noises": 1,
                    "train.checkpoint_every": 0, "grpo.prompts_per_iteration": 1}
CPU_PRETRAIN_SET = {"device": "cpu", "steps": 20, "batch_size": 8, "sample_steps": 4, "threads": 1}
# the --cpu form's model of pretrain label L is pretrain label L + this, in results/pretrained/<L>-cpu: never the
# folder the sweep itself reads
CPU_MODEL_SUFFIX = "-cpu"
# pretrain keys that change how fast a model is made, not which model (the workflow's pretrain rule sets threads
# to the cores it was given)
PRETRAIN_SPEED_KEYS = ("threads",)


def _json_files(what: str) -> Contents:
    return Contents(what, patterns=("*.json",))


WORK_CONTENTS = Contents("an agg-bench campaign work folder", ("campaign.tar.gz",), folders=(
    ("runs", Contents("a campaign's run folders", folders=(("*", RUN_CONTENTS),))),
    ("cells", _json_files("cell job files")), ("calibration", _json_files("calibrations")),
    ("logs", Contents("logs", patterns=("*.log",))), ("windows", _json_files("window logs"))))


# ----- the sweep and what is done ---------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Process:
    """One process of a window: runs of one cell (model x resolution x device), in order."""

    cell: str
    run_ids: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class Calibration:
    """A cell's finished methods that no calibration has timed yet, most valuable first: timed beside ``full`` in
    calibrations of at most ``campaign.calibrate_methods`` of them each (:meth:`Campaign.chunks`)."""

    cell: str
    methods: tuple[str, ...]


def cpu_resolution(resolution: int) -> int:
    """The tiny models' stand-in for a full-size resolution: 1/16 of it, rounded up to 16 px (512 -> 32,
    720 -> 48, 1024 -> 64); a resolution of 64 px or less stays as it is."""
    return resolution if resolution <= 64 else 16 * math.ceil(resolution / 256)


def cpu_sweep(data: dict) -> dict:
    """The same campaign on the CPU (``--cpu``), so that a CPU runs all of it in minutes and the test suite a
    window of it: every method, model family, schedule and priority as written, on one CPU device, with
    float32, :func:`cpu_resolution`'s sizes, one iteration and short calibrations, one process at a time as on
    the GPU. A model of a public
    architecture becomes the tiny preset of its family (LoRA rank 4 where it has adapters); a sweep with a
    ``pretrain`` section (the learning sweep) keeps its model's recipe, pre-trained on the CPU in a few steps
    (:data:`CPU_PRETRAIN_SET`) under a label and into a folder of its own (``<label>-cpu``,
    :data:`CPU_MODEL_SUFFIX`: the sweep's own model folder is never written or read), and its runs train for 2
    iterations of one prompt's group each (the group size and schedule as written), evaluated on one noise per
    caption, on its first seed (:data:`CPU_LEARNING_SET`), their tables averaging one iteration at each end."""
    data = json.loads(json.dumps(data))
    learning = bool(data.get("pretrain"))
    runs_per_job = max([spec.get("runs_per_job", 0) for spec in data["devices"].values()] or [0]) or 100
    data["devices"] = {"cpu": {"device": "cpu", "gpus": 0, "threads": 1 if learning else 2,
                               "runs_per_job": runs_per_job}}
    if learning:
        data["set"] = {**(data.get("set") or {}), **CPU_LEARNING_SET}
        data["seeds"] = data["seeds"][:1]
        labels = data["pretrain"]
        for label in labels:
            if label + CPU_MODEL_SUFFIX in labels:
                raise SweepError(f"pretrain.{label}{CPU_MODEL_SUFFIX}: the --cpu form's model of pretrain.{label} "
                                 "has that label; rename one of them")
        data["pretrain"] = {label + CPU_MODEL_SUFFIX: {**spec, "set": {**(spec.get("set") or {}), **CPU_PRETRAIN_SET}}
                            for label, spec in labels.items()}
        # the model folder a pretrain entry makes, its --cpu form's instead wherever the sweep sets it: a `set`,
        # base or methods entry's was left as it was, and the runs read the sweep's own model (none pre-trained)
        def cpu_model(path: Any) -> Any:
            return f"{PRETRAINED_DIR}/{Path(path).name}{CPU_MODEL_SUFFIX}" \
                if is_pretrained_here(path) and Path(path).name in labels else path

        def cpu_models(overrides: dict) -> dict:
            pairs = dict(flatten(overrides))
            if cpu_model(pairs.get("model.pretrained")) == pairs.get("model.pretrained"):
                return overrides
            return {**pairs, "model.pretrained": cpu_model(pairs["model.pretrained"])}

        for name, overrides in data["models"].items():
            data["models"][name] = dict(flatten(cpu_models(overrides)))
        for name, overrides in data["methods"].items():
            data["methods"][name] = cpu_models(overrides)
        if isinstance(data.get("gradcheck"), dict) and isinstance(data["gradcheck"].get("set"), dict):
            data["gradcheck"]["set"] = cpu_models(data["gradcheck"]["set"])
        if isinstance(data.get("base"), dict):
            data["base"] = cpu_models(data["base"])
        elif isinstance(data.get("base"), str):  # a base config file's, overridden by `set` (the sweep reads it)
            try:
                held = dotted_value(read_yaml_mapping(data["base"], "run config sections", "base"), "model.pretrained")
            except (UserError, OSError):
                held = None
            if cpu_model(held) != held:
                data["set"] = {"model.pretrained": cpu_model(held), **data["set"]}
        data["set"] = cpu_models(data["set"])
        data["learning"] = {**(data.get("learning") or {}), "average_iterations": 1}  # 2 iterations a run
    else:
        data["set"] = {**(data.get("set") or {}), "model.dtype": "float32", "train.iterations": 1}
        for label, overrides in data["models"].items():
            model = {k: v for k, v in overrides.items()
                     if k not in ("model.preset", "model.architecture", "model.pretrained", "train.iterations")}
            model["model.preset"] = "tiny"
            if model.get("train.lora_rank"):
                model["train.lora_rank"] = 4
            data["models"][label] = model
        if isinstance(data.get("report"), dict):  # a warm-up the sweep gives is refused at runs of one iteration:
            # the default's, which times them whole (agg-bench report says so)
            data["report"] = {k: v for k, v in data["report"].items() if k != "warmup_iterations"}
    data["resolutions"] = sorted({cpu_resolution(r) for r in data["resolutions"]})
    # the devices are one CPU device now: an entry for another device matches no run, as it did not before
    if "exclude" in data:
        data["exclude"] = [entry for entry in data["exclude"]
                           if fnmatch.fnmatchcase("cpu", str(entry.get("device", "cpu")))]
    for entry in [*data.get("exclude", []), *(data.get("campaign") or {}).get("priority", [])]:
        if isinstance(entry.get("resolution"), int):
            entry["resolution"] = cpu_resolution(entry["resolution"])
    if "calibrate" in data:
        data["calibrate"] = {**data["calibrate"], "repeats": 2, "warmup": 1, "method_repeats": 2}
    if learning:  # its small runs share the GPU: two at a time on the CPU
        data["campaign"] = {**(data.get("campaign") or {})}
        data["campaign"]["parallel"] = min(data["campaign"].get("parallel", 1), 2)
    return data


def _pretrain_configs(data: dict) -> dict:
    """{label: its config} of the sweep ``data``'s pretrain entries, each read as its ``agg-bench pretrain``
    process is given it (:func:`agg_bench.tools.pretrain.sweep_entry_config`); none: no torch imported."""
    if not data.get("pretrain"):
        return {}
    from .pretrain import sweep_entry_config

    return {label: sweep_entry_config(label, spec) for label, spec in data["pretrain"].items()}


class Campaign:
    """A campaign's sweep (``config``: a sweep config YAML) and its ``campaign`` section; with ``cpu``,
    :func:`cpu_sweep`'s form of it."""

    def __init__(self, config: str | Path, cpu: bool = False, cache_dir: Path | None = None):
        self.config_path = Path(config)
        self.cpu = cpu
        data = written = read_yaml_mapping(self.config_path, "sweep sections", "--config")
        if not SCHEMA.is_file():
            raise UserError(f"agg-bench campaign: the sweep schema {SCHEMA} is missing; run it from the repository")
        kwargs = {} if cache_dir is None else {"cache_dir": cache_dir}
        schema = yaml.safe_load(SCHEMA.read_text())
        if cpu:
            check_sweep(data, schema)  # the sweep as written (a run config is no sweep), before its CPU form
            _pretrain_configs(data)  # its pretrain entries as written: a refusal names the file's label
            data = cpu_sweep(data)
        # the file's resolutions and seeds, which its exclude entries name, though a CPU form has fewer
        self.sweep = Sweep(data, schema, files=[self.config_path], read=[written], **kwargs)
        part = data.get("campaign") or {}
        self.calibrate = part.get("calibrate", True)
        self.calibrate_methods = part.get("calibrate_methods", DEFAULT_CALIBRATE_METHODS)
        if not (type(self.calibrate_methods) is int and 1 <= self.calibrate_methods <= MAX_CALIBRATE_METHODS):
            raise ConfigError("campaign.calibrate_methods", self.calibrate_methods,
                              f"an integer from 1 to {MAX_CALIBRATE_METHODS}")
        self.parallel = part.get("parallel", 1)
        self._calibration_times: dict[str, float] = {}  # cell -> the most seconds per method a calibration took
        self._history: tuple[Path | None, ...] = ()  # the folders whose window logs and runs those came from
        self.gpu: str | None = part.get("gpu")  # a text the runs' GPU name holds (e.g. H200); None: any
        self.priority = part.get("priority", [])
        self.learning = data.get("learning")
        self.pretrain = data.get("pretrain") or {}
        # every pretrain entry as its job is given it, before a window starts (a refused one was a window that
        # pre-trained nothing, ran nothing and packed an empty archive)
        self.pretrain_configs = _pretrain_configs(data)
        for i, selector in enumerate(self.priority):
            for label in selector.get("methods", []):
                if label not in self.sweep.sweep["methods"]:
                    raise SweepError(f"campaign.priority[{i}].methods: {quote(label)} is not a label under methods")
            if "model" in selector and selector["model"] not in self.sweep.sweep["models"]:
                raise SweepError(f"campaign.priority[{i}].model: {quote(selector['model'])} is not a label under models")
        # the resolutions as written (the --cpu form maps them, and two of them may map to one): a selector of a
        # resolution the sweep does not run matched no run, and the runs it put first went in sweep order
        for i, selector in enumerate((written.get("campaign") or {}).get("priority", [])):
            if "resolution" in selector and selector["resolution"] not in written["resolutions"]:
                raise SweepError(f"campaign.priority[{i}].resolution: {selector['resolution']} is not one of resolutions "
                                 f"({', '.join(map(str, written['resolutions']))})")
        self._configs: dict[str, dict] = {}

    def config_of(self, run_id: str) -> dict:
        """The resolved config of ``run_id`` as a run writes it to ``config.json``."""
        if run_id not in self._configs:
            run = self.sweep.runs[run_id]
            self._configs[run_id] = load_config(self.sweep.base_file, overrides_of(run["pairs"])).to_dict()
        return self._configs[run_id]

    def composes(self, run_id: str, written: dict) -> bool:
        """Whether ``written`` (a run folder's ``config.json``) is the config the sweep composes for ``run_id``,
        compared as a rerun compares a folder's config with its own: a key that an older run's file lacks counts
        as its default, and a value an older run wrote as the keys it stands for today."""
        return first_difference(written, self.config_of(run_id), (), DEFAULTS) is None

    @staticmethod
    def cell_of(run: dict) -> str:
        return f"{run['model']}_{run['resolution']}px_{run['device']}"

    @staticmethod
    def finished_files(folder: Path | None, sub: str) -> list[Path]:
        """The JSON files of ``folder/sub`` that their writer finished, sorted: none of :func:`atomic_path`'s
        temporaries (a glob takes hidden names), which a process killed while writing, or before renaming, left.
        Every reader of the calibrations and window logs takes these, so that the work folder, its archive and
        the reference count the same files. None when ``folder`` or its ``sub`` is missing."""
        if folder is None or not (folder / sub).is_dir():
            return []
        return [path for path in sorted((folder / sub).glob("*.json")) if not is_temp_name(path.name)]

    def calibration_cell(self, name: str) -> dict | None:
        """A run of the cell that the calibration file ``<stamp>_<n>_<cell>.json`` is named after, or None."""
        cell = name.removesuffix(".json").split("_", 2)[-1] if name.count("_") >= 2 else None
        return next((run for run in self.sweep.runs.values() if self.cell_of(run) == cell), None)

    def finished(self, folder: Path, run_id: str) -> bool:
        """Whether ``folder`` holds ``run_id`` finished: every file ``campaign unpack`` requires of a finished run
        (:data:`~agg_bench.tools.archive.REQUIRED_RUN_FILES`: a reference run without its records was done, and no
        window ran it again), summary ``ok``, the config the sweep composes, and files that read as unpack reads
        a finished run's (:func:`~agg_bench.tools.archive.read_run`: a run whose ``metrics.jsonl`` was empty or
        torn, or whose ``env.json``, ``plan.json`` or ``evaluations.jsonl`` unpack refused, was done, and no
        window ran it again). Each of the run's files
        (:data:`~agg_bench.tools.archive.RUN_FILES`) that is there is a regular file, not a symbolic link (to a
        file or not: ``is_file`` follows one): unpack refuses an archive's link, which a window packed as one."""
        for name in archives.RUN_FILES:
            path = folder / name
            if not is_regular_file(path) and (name in archives.REQUIRED_RUN_FILES or os.path.lexists(path)):
                return False
        try:  # regular files only (above): a named pipe there waited for ever, a device was read until memory ran out
            _, summary, _, config = archives.read_run(str(folder), folder)
        except (UserError, OSError, TooLarge):
            return False
        return summary.get("status") == "ok" and self.composes(run_id, config)

    def done(self, *folders: Path | None) -> set[str]:
        """The run ids finished in any of ``folders`` (reference or work folders: their ``runs/<id>``)."""
        out = set()
        for run_id in self.sweep.runs:
            if any(f is not None and self.finished(f / "runs" / run_id, run_id) for f in folders):
                out.add(run_id)
        return out

    def order(self) -> list[str]:
        """Every run id, most valuable first: the runs each ``campaign.priority`` selector matches, cell by
        cell (so that a cell's runs share a process), in the selector's order of methods; then the rest, cell
        by cell, in the sweep's order."""
        runs = self.sweep.runs
        cells = list(dict.fromkeys(self.cell_of(run) for run in runs.values()))
        methods = list(self.sweep.sweep["methods"])
        ordered: dict[str, None] = {}
        for selector in [*self.priority, {}]:
            rank = selector.get("methods") or methods
            chosen = [run_id for run_id, run in runs.items() if run_id not in ordered and run["method"] in rank
                      and all(run[key] == selector[key] for key in ("model", "resolution") if key in selector)]
            chosen.sort(key=lambda r: (cells.index(self.cell_of(runs[r])), rank.index(runs[r]["method"])))
            ordered.update(dict.fromkeys(chosen))
        return list(ordered)

    def processes(self, done: set[str]) -> list[Process]:
        """The runs not done, in :meth:`order`, cut into processes: each stretch of consecutive runs of one
        cell, in pieces of at most its device's ``runs_per_job`` runs (a cell whose runs come under two
        selectors may take two)."""
        out: list[Process] = []
        for run_id in self.order():
            if run_id in done:
                continue
            run = self.sweep.runs[run_id]
            cell, most = self.cell_of(run), self.sweep.runs_per_job(run["device"]) or len(self.sweep.runs)
            if out and out[-1].cell == cell and len(out[-1].run_ids) < most:
                out[-1] = Process(cell, (*out[-1].run_ids, run_id))
            else:
                out.append(Process(cell, (run_id,)))
        return out

    # ----- calibrations ----------------------------------------------------------------------------------
    def calibrated(self, *folders: Path | None) -> dict[str, set[str]]:
        """{cell: the method labels a calibration in any of ``folders`` timed} (their finished ``calibration/*.json``,
        :meth:`finished_files`, each of the cell it is named after, :meth:`calibration_cell`; the keys of its ``methods``). A file that
        is no readable JSON object, or is named after no cell of the sweep, times nothing."""
        out: dict[str, set[str]] = {}
        for folder in folders:
            for path in self.finished_files(folder, "calibration"):
                run = self.calibration_cell(path.name)
                if run is None:
                    continue
                try:
                    methods = read_json_object(path, "a calibration").get("methods")
                except JsonFileError:
                    continue
                if isinstance(methods, dict):
                    out.setdefault(self.cell_of(run), set()).update(methods)
        return out

    def uncalibrated(self, done: set[str], calibrated: dict[str, set[str]]) -> list[Calibration]:
        """Per cell, the methods of its ``done`` runs that no calibration timed (``calibrated``,
        :meth:`calibrated`), in :meth:`order`: the cells in the order of their most valuable such method, each
        cell's methods in that order. None when ``campaign.calibrate`` is false."""
        if not self.calibrate:
            return []
        pending: dict[str, dict[str, None]] = {}
        for run_id in self.order():
            run = self.sweep.runs[run_id]
            cell = self.cell_of(run)
            if run_id in done and run["method"] not in calibrated.get(cell, set()):
                pending.setdefault(cell, {})[run["method"]] = None
        return [Calibration(cell, tuple(methods)) for cell, methods in pending.items()]

    def chunks(self, methods) -> list[tuple[str, ...]]:
        """``methods`` cut into the method lists of calibrations, in their order: at most
        ``campaign.calibrate_methods`` each beside ``full``, which every one of them times as its baseline
        (:meth:`with_baseline` adds it) and which is not counted; ``full`` alone is one calibration of its own."""
        methods = list(dict.fromkeys(methods))
        others = [label for label in methods if label != "full"]
        size = self.calibrate_methods
        out = [tuple(others[i:i + size]) for i in range(0, len(others), size)]
        return out or ([("full",)] if methods else [])

    def read_calibration_times(self, *folders: Path | None) -> None:
        """Take in the seconds per timed method of every calibration that ended well in the window logs of
        ``folders`` (their finished ``windows/*.json``, :meth:`finished_files`: a process entry's ``calibration``), by cell (:meth:`calibration_seconds`).
        A log that cannot be read, or an entry of another shape, gives none."""
        self._history = folders
        for folder in folders:
            for path in self.finished_files(folder, "windows"):
                try:
                    entries = read_json_object(path, "a campaign window's log").get("processes")
                except JsonFileError:
                    continue
                for entry in entries if isinstance(entries, list) else []:
                    timed = entry.get("calibration") if isinstance(entry, dict) else None
                    if isinstance(timed, dict) and timed.get("file") and timed.get("exit_code") == 0 \
                            and isinstance(timed.get("methods"), list) and isinstance(entry.get("cell"), str):
                        seconds = timed.get("seconds")
                        if is_finite_number(seconds) and timed["methods"]:
                            self.timed_calibration(entry["cell"], len(timed["methods"]), float(seconds))

    def timed_calibration(self, cell: str, methods: int, seconds: float) -> None:
        """A calibration of ``cell`` that timed ``methods`` methods (``full`` included) took ``seconds``."""
        if methods > 0 and math.isfinite(seconds) and seconds >= 0:
            per = self._calibration_times.setdefault(cell, 0.0)
            self._calibration_times[cell] = max(per, seconds / methods)

    def calibration_times(self) -> dict[str, float]:
        """{cell: the most seconds per timed method of its calibrations that ended well} so far
        (:meth:`read_calibration_times`, and this window's)."""
        return dict(self._calibration_times)

    def history(self) -> tuple[Path | None, ...]:
        """The folders :meth:`read_calibration_times` read (the reference and the work folder)."""
        return self._history

    def calibration_seconds(self, cell: str, labels) -> float | None:
        """About how long a calibration of ``cell`` timing the methods ``labels`` (``full`` included) takes:
        the most seconds per timed method of the cell's calibrations that ended well (:meth:`read_calibration_times`,
        and this window's) times their number; for a cell none has timed yet, what its runs say (in the folders
        :meth:`read_calibration_times` read, :meth:`rounds_seconds`); None when neither can say (it is started)."""
        return self.rounds_seconds(cell, labels, *self._history, per_method_s=self._calibration_times.get(cell))

    def rounds_seconds(self, cell: str, labels, *folders: Path | None,
                       per_method_s: float | None = None) -> float | None:
        """A calibration of ``labels`` estimated (:func:`agg_bench.tools.cell_calibration.estimate`) from
        ``per_method_s`` where given, else from the cell's finished runs of them in ``folders`` (its warm-up and
        timed rounds each take a rollout and a train phase of every method, times
        :data:`~agg_bench.tools.cell_calibration.CALIBRATION_OVERHEAD` for the unit costs); None when a method has
        no finished run there with such times."""
        labels = list(labels)
        return cell_calibration.estimate(self.method_runs(cell, labels, [], *folders),
                                         self.calibration_options().method_rounds, labels, per_method_s)

    def calibration_options(self) -> CalibrationConfig:
        """The sweep's ``calibrate`` options that a calibration takes (``repeats``, ``warmup``,
        ``method_repeats``; the rest at their defaults)."""
        from .calibrate import CalibrationConfig

        options = self.sweep.sweep.get("calibrate") or {}
        return CalibrationConfig(**{key: int(options[key]) for key in cell_calibration.OPTION_KEYS if key in options})

    def method_runs(self, cell: str, labels, run_ids, *folders: Path | None) -> dict[str, Path]:
        """{label: the folder of a run of that method of ``cell``}: one of ``run_ids`` (a process's runs, in the
        first of ``folders``), else a finished one in ``folders``; labels with neither are left out."""
        out: dict[str, Path] = {}
        for label in labels:
            ids = [r for r, run in self.sweep.runs.items() if run["method"] == label and self.cell_of(run) == cell]
            mine = next((r for r in ids if r in run_ids), None)
            if mine is not None and folders and folders[0] is not None:
                out[label] = folders[0] / "runs" / mine
                continue
            found = next((f / "runs" / r for r in ids for f in folders
                          if f is not None and self.finished(f / "runs" / r, r)), None)
            if found is not None:
                out[label] = found
        return out

    def with_baseline(self, labels) -> list[str]:
        """``labels`` as a calibration times them: ``full`` first when the sweep has it."""
        labels = list(labels)
        return ["full", *labels] if "full" in self.sweep.sweep["methods"] and "full" not in labels else labels

    def work(self, done: set[str], calibrated: dict[str, set[str]]) -> list[Process | Calibration]:
        """What a window does, in order: first the calibrations that earlier windows left (methods whose runs
        are done, :meth:`uncalibrated`), most valuable first, then the runs not done (:meth:`processes`), each
        cell process followed by the calibration of the methods it finished.

        The calibrations left go first: their runs are the most valuable ones (earlier windows took the runs in
        :meth:`order`), they are in the reference already without the paired train speedups and the cost
        model's unit costs that only a calibration gives their rows, and nothing else calibrates them (a window
        starts processes for runs not done only); a calibration of a cell whose runs are not all done goes
        before that cell's next process, which calibrates its own methods after it."""
        return [*self.uncalibrated(done, calibrated), *self.processes(done)]

    def cell_pairs(self, cell: str) -> list[tuple[str, Any]]:
        """The overrides of ``cell``'s calibration (the sweep's, without a method)."""
        if cell in self.sweep.calibrations:
            return self.sweep.calibrations[cell]["pairs"]
        run = next(r for r in self.sweep.runs.values() if self.cell_of(r) == cell)
        return self.sweep._pairs(run["device"], run["model"], run["resolution"], None, {})

    # ----- pre-trained models -----------------------------------------------------------------------------
    def pretrained_models(self) -> dict[str, Path]:
        """{pretrain label: the model folder its runs read} for the ``pretrain`` labels the runs use."""
        out = {}
        for run in self.sweep.runs.values():
            path = run["pretrained"]  # the composed config's: a base config file's too
            if is_pretrained_here(path):
                label = Path(path).name
                if label in self.pretrain:
                    out[label] = Path(path)
        return out

    def prepare_models(self, reference: Path | None, reference_name: str = "--reference") -> list[str]:
        """Put each pre-trained model the runs read in place from the reference where the reference holds it
        and this machine does not; the labels still to pre-train. A model folder is used only when its
        ``pretrain.json`` records the config the sweep's ``pretrain.<label>`` composes (:meth:`model_problem`).
        The --cpu form pre-trains its own folder anew when it records another (the folder is that form's alone,
        and ``agg-bench pretrain`` replaces only its own output); anywhere else that is a UserError, as it is
        where this machine's model is not the reference's or the reference holds runs but not their model:
        one line naming ``reference_name`` (what the user gave the reference as), nothing changed."""
        from .pretrain import check_out_dir

        missing = []
        for label, local in self.pretrained_models().items():
            held = reference / "pretrained" / label if reference is not None else None
            if held is not None and held.is_dir():
                problem = self.model_problem(label, held)
                if problem:
                    raise UserError(f"{reference_name} {shown(str(reference))}: pretrained/{label} {problem}; "
                                    "give another reference")
                if local.exists():
                    if _files(local, archives.MODEL_FILES) != _files(held, archives.MODEL_FILES):
                        raise UserError(f"{shown(local)}: not the model of the reference {shown(str(reference))} (its "
                                        f"pretrained/{label}), which its runs were trained from; move it aside")
                continue
            if reference is not None and local.exists() and self.done(reference):
                raise UserError(f"{reference_name} {shown(reference)}: holds runs but not pretrained/{label}, the model they "
                                "were trained from; add it, or give another reference")
            if not local.exists():
                missing.append(label)
                continue
            problem = self.model_problem(label, local)
            if problem and self.cpu:
                check_out_dir(local)  # pretrain replaces its own output only
                missing.append(label)
            elif problem:
                raise UserError(f"{local}: {problem}; move it aside and the window pre-trains it anew")
        for label, local in self.pretrained_models().items():
            held = reference / "pretrained" / label if reference is not None else None
            if held is not None and held.is_dir() and not local.exists():
                # a window killed while it copied left its copy beside the folder, which no pretrain of it removes
                remove_stale_temps(local)
                with atomic_target(local) as tmp:
                    for name in archives.MODEL_FILES:
                        if (held / name).is_file():
                            (tmp / name).parent.mkdir(parents=True, exist_ok=True)
                            shutil.copyfile(held / name, tmp / name)
        return missing

    @property
    def names_gpu(self) -> bool:
        """Whether only runs on ``campaign.gpu``'s GPU are this campaign's: it names one, and this is not the
        --cpu form."""
        return self.gpu is not None and not self.cpu

    def wants_gpu(self, name: str | None) -> bool:
        """Whether runs on the device named ``name`` (None: a CPU) are this campaign's: any device unless
        :attr:`names_gpu`, else a GPU whose name holds ``campaign.gpu``, case aside (``h200`` for ``NVIDIA H200``).
        What a window checks before it starts and ``campaign unpack`` checks of its runs."""
        gpu = self.gpu if self.names_gpu else None
        if gpu is None:
            return True
        return name is not None and gpu.lower() in name.lower()

    def check_devices(self, until: float | None = None, python: str = sys.executable) -> None:
        """A ConfigError, before a window writes anything, for a device of the sweep this machine cannot serve
        (``devices.<d>.device``, the ``device`` a ``pretrain.<label>`` model the runs read is made on, from its
        ``set`` or its config file): each of its processes would fail, and the window spend its minutes on them.
        The --cpu form's devices are the CPU.

        Every CUDA device of the sweep must be one :meth:`wants_gpu`, as ``campaign unpack`` checks: a window on
        another GPU ran runs that unpack then refused. The name is asked of ``python`` (the interpreter of the
        window's processes), waited for until ``until`` (seconds since the epoch: when the window stops) at the
        latest."""
        from ..machine.devices import resolve_device

        named = [(f"devices.{label}.device", spec["device"]) for label, spec in self.sweep.sweep["devices"].items()]
        named += [(f"pretrain.{label}.set.device" if "device" in (self.pretrain[label].get("set") or {})
                   else f"pretrain.{label}.device", self.pretrain_configs[label].device)
                  for label in self.pretrained_models()]
        visible: dict[str, str] = {}  # device -> its GPU's name
        for key, device in named:
            try:
                resolved = resolve_device(device, key, auto=key.startswith("devices."))  # pretrain's takes no auto
            except ConfigError as err:
                raise ConfigError(key, device, f"{err.expected}; or the same campaign on the CPU: --cpu") from None
            if self.names_gpu and resolved.type == "cuda":
                if device not in visible:  # a child process each: seconds of importing torch
                    visible[device] = visible_gpu_name(device, python, until=until)
                if not self.wants_gpu(visible[device]):
                    raise ConfigError("campaign.gpu", self.gpu,
                                      f"the GPU this campaign's reference was run on, but {key} = {quote(device)} is "
                                      f"{quote(visible[device])} here; run the window on a {self.gpu}, or the same "
                                      "campaign on the CPU: --cpu")

    def pretrain_overrides(self, label: str) -> list[str]:
        """The ``--set`` items of the sweep's ``pretrain.<label>``."""
        return overrides_of(list((self.pretrain[label].get("set") or {}).items()))

    def pretrain_argv(self, label: str, python: str) -> list[str]:
        """``agg-bench pretrain`` of the sweep's ``pretrain.<label>`` into ``results/pretrained/<label>``."""
        argv = [python, "-m", "agg_bench", "pretrain", "--config", self.pretrain[label]["config"]]
        for item in self.pretrain_overrides(label):
            argv += ["--set", item]
        return [*argv, "--out", f"{PRETRAINED_DIR}/{label}"]

    def model_problem(self, label: str, folder: Path) -> str | None:
        """Why the model folder ``folder`` is not the sweep's ``pretrain.<label>``, or None: its ``pretrain.json``
        must record the config that ``pretrain.<label>`` composes (its ``config`` file with its ``set``, as
        :meth:`pretrain_argv` passes them), key by key, except :data:`PRETRAIN_SPEED_KEYS`."""
        from .pretrain import MARKER

        wanted = dataclasses.asdict(self.pretrain_configs[label])
        try:
            recorded = read_json_object(folder / MARKER, "an agg-bench pretrain output's pretrain.json").get("config")
        except JsonFileError as err:
            return f"is not a model that agg-bench pretrain made ({err.problem} in {MARKER})"
        if not isinstance(recorded, dict):
            return f"is not a model that agg-bench pretrain made (no config in {MARKER})"
        differ = [key for key in wanted if key not in PRETRAIN_SPEED_KEYS and recorded.get(key) != wanted[key]]
        if not differ:
            return None
        shown = ", ".join(f"{key} {quote(recorded.get(key))} (the sweep's {quote(wanted[key])})" for key in differ[:4])
        more = f" and {len(differ) - 4} more keys" if len(differ) > 4 else ""
        return f"was pre-trained with another config than the sweep's pretrain.{label} composes: {shown}{more}"

    def learning_options(self):
        """The learning report's options from the sweep's ``learning`` section, without a checkpoint evaluation
        (a reference holds no checkpoints: every held-out gain comes from the runs' in-run evaluations)."""
        from .learning import LearningOptions

        part = learning_settings(self.learning)
        return LearningOptions(average=int(part["average_iterations"]), fraction=float(part["fraction_of_full"]),
                               eval_noises=0, target_fraction=float(part["target_fraction"]),
                               reference=part["reference"], eval_source="auto")


def _files(folder: Path, names) -> dict[str, bytes]:
    return {name: (folder / name).read_bytes() for name in names if (folder / name).is_file()}


# ----- one window --------------------------------------------------------------------------------------------
def _stopped() -> bool:
    """Whether the campaign was sent SIGTERM or SIGINT (:mod:`agg_bench.stopping` remembers it)."""
    return stopping.pending() is not None


# A supervised child's launcher (:func:`_dying_with_parent`): it has the kernel SIGKILL it when the campaign's thread
# that started it ends, however the campaign ends (``kill -9`` included): Linux's ``prctl(PR_SET_PDEATHSIG)``, which
# the exec keeps. Then it execs the child. In a process of its own, not in a ``preexec_fn``: a fork of the campaign,
# whose thread pool runs, could find a lock held by another thread before its exec. A command it cannot start is one
# line, the command as :func:`agg_bench.errors.shown` writes a path (the standard library's repr where it is not
# printable, clipped at QUOTE_CHARS: the interpreter imports nothing of agg_bench), and exit code 127.
DIE_WITH_PARENT = """
import os, signal, sys
parent, argv = int(sys.argv[1]), sys.argv[2:]
try:  # an interpreter without ctypes still runs the child, without the signal
    import ctypes
    prctl = ctypes.CDLL(None, use_errno=True).prctl
    prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    prctl(%d, signal.SIGKILL, 0, 0, 0)
except (ImportError, OSError, AttributeError):
    pass
if os.getppid() != parent:  # the campaign died before the call took hold
    os.kill(os.getpid(), signal.SIGKILL)
try:
    os.execvp(argv[0], argv)
except OSError as err:  # the command as agg_bench.errors.shown shows a path: quoted where it is not printable
    name = argv[0]
    if not name.isprintable():
        name = repr(name) if len(name) <= %d else f"{name[:%d]!r}... ({len(name)} characters)"
    sys.stderr.write(f"{name}: {err.strerror}\\n")
    sys.exit(127)
""" % (PR_SET_PDEATHSIG, QUOTE_CHARS, QUOTE_CHARS)


def _dying_with_parent(argv: list[str]) -> list[str]:
    """``argv`` started through :data:`DIE_WITH_PARENT` where Linux has the parent-death signal (elsewhere as it
    is: the second signal's cleanup in :func:`_supervise` still ends the child there). Its interpreter is
    isolated: it imports nothing of the campaign's, and the child it execs gets the environment unchanged."""
    if not sys.platform.startswith("linux"):
        return argv
    return [sys.executable, "-I", "-S", "-c", DIE_WITH_PARENT, str(os.getpid()), *argv]


# A supervised process's guard (:func:`_guard_group`): it reads the process group to guard, then waits for the
# campaign to close its end of the pipe, and kills the group unless the campaign wrote "done" first (it saw the
# process end). The kernel closes that pipe however the campaign ends, ``kill -9`` included. System calls only.
GROUP_GUARD = """
import os, signal, sys
group = sys.stdin.readline().strip()
if group and sys.stdin.read() != "done":
    try:
        os.killpg(int(group), signal.SIGKILL)
    except OSError:
        pass
"""


def _guard_group() -> subprocess.Popen:
    """Start the guard of a process group that a supervised process will lead (:data:`GROUP_GUARD`); give it the
    group with :func:`_guarded`. In a session of its own (a terminal's Ctrl-C is the campaign's to handle), and
    its interpreter isolated: it imports nothing of the campaign's."""
    return subprocess.Popen([sys.executable, "-I", "-S", "-c", GROUP_GUARD], stdin=subprocess.PIPE,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True, text=True)


def _guarded(guard: subprocess.Popen, pgid: int) -> None:
    """Tell ``guard`` the group it guards (a guard whose group never comes exits at the pipe's end)."""
    pipe = guard.stdin
    assert pipe is not None  # started with stdin=PIPE
    with contextlib.suppress(OSError):
        pipe.write(f"{pgid}\n")
        pipe.flush()


def _end_guard(guard: subprocess.Popen, done: bool) -> None:
    """Close the pipe to ``guard``: with ``done`` (the supervised process ended) it exits, else it kills the
    group now; wait for it."""
    pipe = guard.stdin
    assert pipe is not None
    with contextlib.suppress(OSError):
        if done:
            pipe.write("done")
        pipe.close()
    guard.wait()


def _kill_group(pgid: int) -> None:
    """SIGKILL the process group ``pgid`` (a supervised child and what it started), if it is still there."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except OSError:
        pass


def _supervise(argv: list[str], log: Path, env: dict, stop_at: float, stopped=_stopped,
               deadline: float = math.inf) -> tuple[int | None, str]:
    """Run ``argv`` until it ends, SIGTERM it at ``stop_at`` or once ``stopped()``, kill it (its process group)
    ``KILL_AFTER_S`` later, or at ``deadline`` if that comes first (a window too short for the grace: the
    campaign ends at its deadline); (its exit code, how it ended: finished, stopped at the deadline, interrupted).

    The child and what it started end with the campaign: the child leads a process group of its own (so that a
    terminal's Ctrl-C reaches the campaign alone, which passes it on as one SIGTERM), a second signal's exit at
    once kills that group (:func:`agg_bench.stopping.at_exit_at_once`), and when the campaign dies any other
    way (``kill -9``) a guard process kills it (:data:`GROUP_GUARD`: the parent-death signal of Linux, which
    the child also gets at once (:data:`DIE_WITH_PARENT`), reaches a child but not its children)."""
    guard = _guard_group()
    proc = None
    try:
        with open(log, "ab") as handle:
            proc = subprocess.Popen(_dying_with_parent(argv), stdout=handle, stderr=subprocess.STDOUT, env=env,
                                    cwd=os.getcwd(), start_new_session=True)
            _guarded(guard, proc.pid)
            return _watch(proc, stop_at, stopped, deadline)
    finally:
        _end_guard(guard, done=proc is None or proc.poll() is not None)


def _watch(proc: subprocess.Popen, stop_at: float, stopped, deadline: float) -> tuple[int | None, str]:
    """:func:`_supervise`'s loop over the running ``proc``."""
    stopping.at_exit_at_once(id(proc), lambda: _kill_group(proc.pid))
    try:
        how, termed = "finished", None
        while proc.poll() is None:
            now = time.time()
            if termed is None and (now >= stop_at or stopped()):
                how = "interrupted" if stopped() else "stopped at the deadline"
                proc.send_signal(signal.SIGTERM)
                termed = now
            elif termed is not None and (now - termed > KILL_AFTER_S or now >= deadline):
                _kill_group(proc.pid)
                how += " (killed)"
                proc.wait()
                break
            time.sleep(POLL_S)
    finally:
        stopping.at_exit_at_once(id(proc), None)
    return proc.returncode, how


def _child_env(threads: int) -> dict:
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS=str(threads), PYTHONUNBUFFERED="1")
    # the children import agg_bench from this checkout, whether or not it is installed
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    return env


def check_minutes(minutes: Any) -> float:
    if isinstance(minutes, bool) or not isinstance(minutes, (int, float)) or not math.isfinite(minutes) \
            or not 0 < minutes <= MAX_MINUTES:
        raise ConfigError("--minutes", minutes, f"a number of minutes in (0, {MAX_MINUTES}]")
    return float(minutes)


def check_started(started: Any, minutes: float) -> float:
    """When a window of ``minutes`` started (``--started``, seconds since the epoch; None: now): at most a few
    seconds ahead of this machine's clock, and early enough that the window has time left."""
    now = time.time()
    if started is None:
        return now
    if isinstance(started, bool) or not isinstance(started, (int, float)) or not math.isfinite(started) \
            or started > now + STARTED_SLACK_S:
        raise ConfigError("--started", started, f"seconds since the epoch, not after now ({now:.0f})")
    if started + minutes * 60 <= now:
        raise ConfigError("--started", started, f"a start less than --minutes {minutes:g} ago (now: {now:.0f}): "
                                                "the window has no time left")
    return float(started)


GPU_NAME_TIMEOUT_S = 120.0
# the line the GPU-name child prints the name on (as JSON, ASCII): what else a library prints on stdout, before
# or after it, is not taken for the name
GPU_NAME_MARK = "agg-bench gpu name: "


def visible_gpu_name(device: str, python: str = sys.executable, until: float | None = None) -> str:
    """The name torch gives the CUDA device ``device`` (``cuda`` or ``cuda:N``), asked in a child process: a
    campaign process that touched CUDA itself could hold a context on the GPU all window, memory that NVML
    counts in every run's peak. The child is given at most :data:`GPU_NAME_TIMEOUT_S` seconds, and none past
    ``until`` (seconds since the epoch: when the window stops). A UserError where the child cannot tell."""
    code = ("import json, sys, torch; name = torch.cuda.get_device_name(torch.device(sys.argv[1])); "
            f"print({GPU_NAME_MARK!r} + json.dumps(name), flush=True)")
    timeout = GPU_NAME_TIMEOUT_S if until is None else max(0.0, min(GPU_NAME_TIMEOUT_S, until - time.time()))
    try:  # undecodable bytes a driver or library prints are replaced, not a traceback
        proc = subprocess.run(_dying_with_parent([python, "-c", code, device]), capture_output=True, text=True,
                              errors="replace", stdin=subprocess.DEVNULL, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise UserError(f"campaign.gpu: the name of {device} could not be read (no answer in {timeout:.0f} s"
                        f"{', the time the window had left' if timeout < GPU_NAME_TIMEOUT_S else ''})") from None
    except OSError as err:
        raise UserError(f"campaign.gpu: the name of {device} could not be read ({err})") from None
    names = [line[len(GPU_NAME_MARK):] for line in proc.stdout.splitlines() if line.startswith(GPU_NAME_MARK)]
    name = None
    with contextlib.suppress(ValueError):
        name = json.loads(names[-1]) if names else None
    if proc.returncode != 0 or not isinstance(name, str) or not name.strip():
        why = (proc.stderr.strip().splitlines() or
               [f"exit code {proc.returncode}" if proc.returncode != 0 else "it printed no name"])[-1]
        raise UserError(f"campaign.gpu: the name of {device} could not be read ({why.strip()})")
    return name.strip()


def run_window(campaign: Campaign, minutes: float, work: str | Path, reference: str | Path | None,
               archive: str | Path | None = None, python: str = sys.executable,
               started: float | None = None, work_name: str = "--work", reference_name: str = "--reference") -> dict:
    """One window of ``minutes`` from ``started`` (default now; module docstring); returns its log (also in the
    archive). ``work_name``: what errors call ``work``, as its user gave it (scripts/gpu_campaign.sh's user sets
    AGG_BENCH_CAMPAIGN_OUT, not --work); ``reference_name`` what they call ``reference`` (AGG_BENCH_CAMPAIGN_REFERENCE
    where that variable set it)."""
    start = check_started(started, check_minutes(minutes))
    deadline = start + minutes * 60
    stop_at = deadline - min(STOP_MARGIN_S, minutes * 60 / 4)
    work = Path(work)
    reference = Path(reference) if reference is not None else None
    # the default archive is the work folder's: errors about it name what named that folder
    archive_name = "--archive" if archive is not None else work_name
    archive = Path(archive) if archive is not None else work / "campaign.tar.gz"
    check_places(work, reference, archive, work_name, reference_name)
    stamp = time.strftime(STAMP_FORMAT, time.gmtime(start))
    if not (type(campaign.parallel) is int and 1 <= campaign.parallel <= MAX_PARALLEL):
        raise ConfigError("campaign.parallel", campaign.parallel, f"an integer from 1 to {MAX_PARALLEL}")
    campaign.check_devices(until=stop_at, python=python)
    # a first SIGTERM / SIGINT is only remembered here: the processes in flight are stopped, the finished runs
    # are packed, and the end of the block raises it (exit code 128 + N)
    with claim_folder(work, WORK_CONTENTS, work_name), \
            claim_files({archive: (archives.is_archive, "a campaign archive")}, archive_name), stopping.safe_points():
        to_pretrain = campaign.prepare_models(reference, reference_name)  # before anything is written: it may refuse
        for sub in ("runs", "cells", "calibration", "logs", "windows"):
            (work / sub).mkdir(exist_ok=True)
        for sub in ("cells", "calibration", "windows"):  # what killed windows' processes left under new names
            remove_stale_harness_files(work / sub)
        done = campaign.done(reference, work)
        log: dict[str, Any] = {"started": stamp, "minutes": minutes, "config": str(campaign.config_path),
                               "done_before": len(done), "runs": len(campaign.sweep.runs), "pretrained": [],
                               "processes": []}
        for label in to_pretrain:
            if time.time() >= stop_at or _stopped():  # no process starts after stop_at; nor a run without its model
                log["pretrained"].append({"label": label, "ok": False, "exit_code": None, "seconds": 0.0,
                                          "ended": "not started: the window had ended"})
                continue
            log["pretrained"].append(_pretrain(campaign, label, stamp, work, stop_at, deadline, python))
        calibrated = campaign.calibrated(reference, work)
        campaign.read_calibration_times(reference, work)
        if all(entry["ok"] for entry in log["pretrained"]):
            log["processes"] = _run_processes(campaign, campaign.work(done, calibrated), stamp, work, stop_at,
                                              deadline, python, work_name)
        received = stopping.pending()
        log["stopped_by_signal"] = signal.Signals(received).name if received is not None else None
        # from a --started up to STARTED_SLACK_S ahead of the clock, a short window ended before it: 0, never a
        # negative time (which unpack refuses)
        log["seconds"] = round(max(0.0, time.time() - start), 1)
        log["finished_in_window"] = sorted(r for p in log["processes"] for r in p.get("finished", []))
        done = campaign.done(reference, work)
        log["left"] = len(campaign.sweep.runs) - len(done)
        log["calibrations_left"] = sum(len(c.methods) for c in
                                       campaign.uncalibrated(done, campaign.calibrated(reference, work)))
        write_json(work / "windows" / f"{stamp}.json", log)
        _pack(campaign, work, reference, archive)
        log["archive"] = str(archive)
    return log


def check_places(work: Path, reference: Path | None, archive: Path | None = None, work_name: str = "--work",
                 reference_name: str = "--reference") -> None:
    """A window's folders apart: ``--reference`` neither ``--work`` nor inside it or around it (a run there
    counted as the reference's, and the archive packed none of the window's runs), and ``--archive`` outside
    the reference and, in the work folder, only its own ``campaign.tar.gz`` (elsewhere there it was a file
    where the work folder keeps its runs, logs or cells: every later window was refused). ``archive`` None:
    the folders only (``campaign status``, which writes no archive). ``work_name``, ``reference_name``: what a
    refusal calls the work folder and the reference. Writes nothing."""
    def within(path: Path, folder: Path) -> bool:
        path, folder = path.resolve(), folder.resolve()
        return path == folder or folder in path.parents

    if reference is not None and (within(reference, work) or within(work, reference)):
        raise UserError(f"{reference_name} {shown(reference)}: the work folder {shown(work)} or a folder in or around it; expected the "
                        f"reference apart from {work_name} (the archive holds the runs the reference lacks)")
    if archive is None:
        return
    if reference is not None and within(archive, reference):
        raise UserError(f"--archive {shown(archive)}: inside {reference_name} {shown(reference)}, which holds reference results only; "
                        "expected a path outside it (campaign unpack adds the archive to it)")
    if within(archive, work) and archive.resolve() != (work / "campaign.tar.gz").resolve():
        raise UserError(f"--archive {shown(archive)}: inside {work_name} {shown(work)}, whose folders hold the window's runs, cells, "
                        f"calibrations, logs and window logs; expected {shown(work / 'campaign.tar.gz')} or a path outside it")


def _pretrain(campaign: Campaign, label: str, stamp: str, work: Path, stop_at: float, deadline: float,
              python: str) -> dict:
    """The sweep's ``pretrain.<label>`` model, made by ``agg-bench pretrain`` before any run reads it."""
    began = time.time()
    env = _child_env(max(1, int((campaign.pretrain[label].get("set") or {}).get("threads", 1))))
    code, how = _supervise(campaign.pretrain_argv(label, python), work / "logs" / f"{stamp}_pretrain_{label}.log",
                           env, stop_at, deadline=deadline)
    ok = code == 0 and (campaign.pretrained_models()[label] / "pretrain.json").is_file()
    print(f"agg-bench campaign: pretrain {label}: {'made' if ok else 'not made'} ({how}, "
          f"{time.time() - began:.1f} s)", file=sys.stderr, flush=True)
    return {"label": label, "ok": ok, "exit_code": code, "ended": how, "seconds": round(time.time() - began, 1)}


def _run_processes(campaign: Campaign, items: list[Process | Calibration], stamp: str, work: Path,
                   stop_at: float, deadline: float, python: str, work_name: str) -> list[dict]:
    """Every work item (:meth:`Campaign.work`) whose process starts before ``stop_at``, ``campaign.parallel`` at
    a time in their order; the log entries of their processes, in that order: a cell process's (none for
    a process of calibrations only), then one per calibration it was given (``{"cell", "calibration"}``)."""
    def one(number: int, item: Process | Calibration) -> list[dict]:
        if time.time() >= stop_at or _stopped():
            return []
        return _run_process(campaign, item, number, stamp, work, stop_at, deadline, python, work_name)

    with concurrent.futures.ThreadPoolExecutor(max_workers=campaign.parallel) as pool:
        futures = [pool.submit(one, number, item) for number, item in enumerate(items, 1)]
        while not all(f.done() for f in futures):  # the main thread stays free to take a signal
            concurrent.futures.wait(futures, timeout=POLL_S)
        return [entry for f in futures for entry in f.result()]


def _run_process(campaign: Campaign, item: Process | Calibration, number: int, stamp: str, work: Path,
                 stop_at: float, deadline: float, python: str, work_name: str) -> list[dict]:
    """One ``agg-bench cell`` process of ``item``: a process's runs, then (unless ``campaign.calibrate`` is
    false) the calibrations of their methods, in chunks (:meth:`Campaign.chunks`); or the calibrations left of
    a cell only (a :class:`Calibration`), not started when the first one would not end before ``stop_at``.
    Its log entries."""
    sweep = campaign.sweep
    cell = item.cell
    device = next(r for r in sweep.runs.values() if campaign.cell_of(r) == cell)["device"]
    env = _child_env(sweep.threads(device))
    name = f"{stamp}_{number:02d}_{cell}"
    run_ids, busy = [], []
    for run_id in item.run_ids if isinstance(item, Process) else ():
        if _clear_attempt(campaign, work / "runs" / run_id, run_id, work_name):
            run_ids.append(run_id)
        else:
            busy.append(run_id)
    methods = [sweep.runs[r]["method"] for r in run_ids] if isinstance(item, Process) else list(item.methods)
    calibrations = _calibrations(campaign, cell, methods if campaign.calibrate else [], run_ids, number, stamp,
                                 work)
    for entry in calibrations:  # a report of an earlier window of the same second: not this process's
        if cell_calibration.is_report(Path(entry["report"])):
            Path(entry["report"]).unlink()
    began = time.time()
    code: int | None = None
    how: str | None = "not started: another process is writing its runs"
    if not run_ids and calibrations:  # calibrations only: not started when the first would be cut
        expected = campaign.calibration_seconds(cell, list(calibrations[0]["methods"]))
        how = f"not started: about {expected:.0f} s, more than the window had left" \
            if expected is not None and time.time() + expected > stop_at else None
    if run_ids or (calibrations and how is None):
        jobs = {"runs": [job_entry(sweep.base_file, overrides_of(sweep.runs[r]["pairs"]), str(work / "runs" / r))
                         for r in run_ids]}
        if calibrations:
            jobs["calibrations"] = calibrations
        write_json(work / "cells" / f"{name}.json", jobs)
        code, how = _supervise([python, "-m", "agg_bench", "cell", str(work / "cells" / f"{name}.json"),
                                "--deadline", f"{stop_at:.3f}"], work / "logs" / f"{name}.log", env, stop_at,
                               deadline=deadline)
    entries: list[dict[str, Any]] = []
    if isinstance(item, Process):
        finished = [r for r in run_ids if campaign.finished(work / "runs" / r, r)]
        entries.append({"cell": cell, "runs": run_ids, "finished": finished, "busy": busy, "exit_code": code,
                        "ended": how, "seconds": round(time.time() - began, 1)})
        print(f"agg-bench campaign: {cell}: {len(finished)}/{len(run_ids)} runs finished "
              f"({how}, {entries[0]['seconds']} s)", file=sys.stderr, flush=True)
    for entry in calibrations:
        report = cell_calibration.read_report(Path(entry["report"]))
        out = Path(entry["out"])
        timed: dict[str, Any]
        if report is None:  # the process never reached it
            timed = {"methods": list(entry["methods"]), "exit_code": code, "seconds": 0.0,
                     "ended": how if code is None else f"not reached: the process {how}, exit code {code}"}
        elif report["ended"] == cell_calibration.NOT_TIMED:
            continue  # the process's runs of its methods did not finish: nothing was due
        else:
            timed = {key: report[key] for key in ("methods", "exit_code", "ended", "seconds")}
        ok = timed["ended"] == cell_calibration.FINISHED and timed["exit_code"] == 0 and out.is_file()
        if not ok and out.exists():
            out.unlink()
        timed = {"file": out.name if ok else None, **timed}
        if ok and is_finite_number(timed["seconds"]):
            campaign.timed_calibration(cell, len(timed["methods"]), float(timed["seconds"]))
        print(f"agg-bench campaign: {cell}: calibration of {', '.join(timed['methods'])}: "
              f"{'written' if ok else 'not written'} ({timed['ended']}, {timed['seconds']} s)",
              file=sys.stderr, flush=True)
        entries.append({"cell": cell, "calibration": timed})
    return entries



def _clear_attempt(campaign: Campaign, folder: Path, run_id: str, work_name: str) -> bool:
    """Make ``folder`` ready for ``run_id``'s process: an earlier attempt there that is not finished is removed
    (its files only, :func:`~agg_bench.outdir.remove_owned`) under the folder's claim. False, with one line on
    stderr, when another process holds that claim (a run writing there): its folder is neither removed nor
    written, and the run is left to a later window."""
    if not folder.exists() or campaign.finished(folder, run_id):
        return True
    try:
        with Claim(folder, folder=True, lock_inside=True, flag=work_name):
            remove_owned(folder, RUN_CONTENTS)
    except Busy as err:
        holder = f" (PID {err.pid})" if err.pid is not None else ""
        print(f"agg-bench campaign: {shown(folder)}: another agg-bench process{holder} is writing this run folder; "
              f"{run_id} is left alone, to a later window", file=sys.stderr, flush=True)
        return False
    return True


def _calibrations(campaign: Campaign, cell: str, methods, run_ids: list[str], number: int, stamp: str,
                  work: Path) -> list[dict]:
    """The calibrations of ``methods`` of ``cell`` as a cell job lists them (:mod:`agg_bench.tools.
    cell_calibration`): at most ``campaign.calibrate_methods`` methods each beside ``full`` (:meth:`Campaign.chunks`),
    the ``i``-th into ``calibration/<stamp>_<number>-<i>_<cell>.json``, each with its methods' runs (this job's
    ``run_ids`` first, else a finished one of the reference or the work folder) and the seconds per method that
    the cell's calibrations so far took. A calibration cut at the deadline, or one that fails, leaves no file,
    so its methods stay for a later window."""
    sweep = campaign.sweep
    options = dataclasses.asdict(campaign.calibration_options())
    out = []
    for i, labels in enumerate(campaign.chunks(methods), 1):
        timed = campaign.with_baseline(labels)
        name = f"{stamp}_{number:02d}-{i}_{cell}"
        out.append({"config": sweep.base_file, "set": overrides_of(campaign.cell_pairs(cell)),
                    "methods": {label: sweep.sweep["methods"][label] for label in timed},
                    "options": {key: options[key] for key in cell_calibration.OPTION_KEYS},
                    "out": str(work / "calibration" / f"{name}.json"),
                    "report": str(work / "cells" / f"{name}.report.json"),
                    "runs": {label: str(folder) for label, folder in
                             campaign.method_runs(cell, timed, run_ids, work, *campaign.history()).items()},
                    "per_method_s": campaign.calibration_times().get(cell)})
    return out


def _pack(campaign: Campaign, work: Path, reference: Path | None, archive: Path) -> None:
    """The archive of every finished run in ``work`` that ``reference`` lacks, each pre-trained model the
    reference lacks, the calibrations and the window logs (:mod:`agg_bench.tools.archive`'s layout)."""
    in_reference = campaign.done(reference) if reference is not None else set()
    members: list[tuple[str, Path]] = []
    for run_id in sorted(campaign.done(work) - in_reference):
        for name in archives.RUN_FILES:
            path = work / "runs" / run_id / name
            if is_regular_file(path):  # a link went into the archive as one, which unpack refuses
                members.append((f"runs/{run_id}/{name}", path))
    for label, local in campaign.pretrained_models().items():
        if local.is_dir() and not (reference is not None and (reference / "pretrained" / label).is_dir()):
            members += archives.model_members(label, local)
    for sub in ("calibration", "windows"):
        # with a temporary file, campaign unpack refused this archive and every later one of the work folder
        members += [(f"{sub}/{path.name}", path) for path in campaign.finished_files(work, sub)]
    archives.pack(members, archive)


def status(campaign: Campaign, reference: Path | None, work: Path | None = None) -> dict:
    """Per cell: the runs done and the runs missing (each its method, or ``<method> seed <seed>`` in a sweep of
    several seeds), in the order the next window takes them, and the methods
    of its done runs that no calibration timed yet (``uncalibrated``, which the next window calibrates first);
    ``calibrations``: the calibrations that takes, each the methods it times (``full`` first)."""
    done = campaign.done(reference, work)
    cells: dict[str, dict[str, list[str]]] = {}
    # a sweep of several seeds (a learning sweep's) names each run by its method and seed: "full" ten times
    # did not say which seeds were missing
    seeded = len({run["seed"] for run in campaign.sweep.runs.values()}) > 1
    for run_id in campaign.order():
        run = campaign.sweep.runs[run_id]
        entry = cells.setdefault(Campaign.cell_of(run), {"done": [], "missing": [], "uncalibrated": []})
        entry["done" if run_id in done else "missing"].append(
            f"{run['method']} seed {run['seed']}" if seeded else run["method"])
    pending = campaign.uncalibrated(done, campaign.calibrated(reference, work))
    for item in pending:
        cells[item.cell]["uncalibrated"] = list(item.methods)
    return {"runs": len(campaign.sweep.runs), "done": len(done),
            "calibrations": [campaign.with_baseline(c) for item in pending for c in campaign.chunks(item.methods)],
            "cells": cells}
