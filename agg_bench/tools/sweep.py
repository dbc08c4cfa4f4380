"""The workflow's sweep: a sweep config checked and expanded into jobs, and the jobs' command lines.

The Snakefile builds one :class:`Sweep` while Snakemake parses the workflow (``workflow/rules/common.smk``),
so every check below happens before any job starts, and a bad sweep fails with one line that names the
job and the key. Parsing stays fast because this module imports nothing heavy (no torch, diffusers or
peft). The checks come in two stages:

1. In this process, from configs alone: the sweep as its files read with agg-bench's YAML loader
   (:func:`read_sweep_config`: Snakemake's parse is YAML 1.1, where ``017`` is 15 and ``1e-5`` text, and takes
   repeated keys, last wins, and aliases that nest without a bound) and the parsed sweep's size with its aliases
   written out (:func:`agg_bench.config.check_expanded_size`), both before
   anything walks the whole sweep; the sweep against ``workflow/schemas/config.schema.yaml`` and
   its cross-references; each composed run config against the run schema; each run's resolution against
   its model family's latent multiple and maximum (:mod:`agg_bench.engine.families`); an ``exclude`` pattern
   that matches no label, and one that leaves no run. The Snakefile also checks, before any job, the files its
   jobs read that no job makes (:func:`check_input_files`), runs whose marker outlived their folder
   (:func:`check_markers`), files where its folders go (:func:`check_output_folders`) and someone's files in
   the folders its commands write into (:func:`check_output_contents`).
   Every run and calibration on several processes splits its batch into whole GRPO groups per process
   (:func:`agg_bench.config.check_data_parallel`, as the run checks it).
2. The methods' own options and run checks (``Estimator.check_run``), which live with the methods and
   need torch (not diffusers, peft or transformers: ``tests/integration/test_fresh_interpreters.py``): one child process
   (``python -m agg_bench.tools.sweep``) checks every job and answers each method's
   resolved options (the manifest records them). The answer is kept in ``.snakemake/agg-bench/``
   under a hash of all it depends on (the composed jobs, the base config file, the ``agg_bench`` and
   ``baselines`` sources, the interpreter), so parsing the same sweep again (another dry run, a cluster
   job) does not start the child again. With its answer, two labels of ``methods`` whose runs resolve to one
   run config (the method's options left out at their defaults) are refused (:func:`check_same_runs`).
"""
from __future__ import annotations

import dataclasses
import fnmatch
import hashlib
import json
import os
import shlex
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeGuard

import yaml

from ..config import (YamlDumper, YamlRefused, check_data_parallel, check_expanded_size, check_finite,
                      check_override_values, check_prompts_path, check_schema, dotted_value, load_config,
                      read_yaml_mapping, run_schema, yaml_load)
from ..engine.families import architecture, check_guidance, check_own_schedule, check_resolution
from ..errors import ConfigError, UserError, clip, quote, shown
from ..io import write_text
from ..jsonfiles import JsonFileError, read_json_object
from ..outdir import Contents, check_folder, named_path_problem
from ..outputs import (IMPORT_CONTENTS, LEARNING_CONTENTS, PRETRAIN_CONTENTS, REPORT_CONTENTS, RUN_CONTENTS,
                       check_no_unpack, check_run_folder)
from ..records import is_integer
from ..runtime.cell import Journal, job_entry, journal_ends
from ..sources import source_digest
from .importlog import label_problem

PYTHON = shlex.quote(sys.executable)  # the interpreter running the workflow has agg_bench installed
EMBED_DIR = "results/embeddings"
PRETRAINED_DIR = "results/pretrained"  # model folders the workflow's pretrain rule makes
CELL_DIR = "results/cells"  # the cell jobs' job files and their journals, and the run jobs' journals
# The sweep's ``learning`` section where it leaves a key out: agg-bench learning's defaults (its LearningOptions; a
# test keeps them equal), but for the checkpoint evaluation, which a sweep runs on 16 noises per caption (the
# command's default: none). Each key with the command's option that takes it.
LEARNING_DEFAULTS = {"average_iterations": 3, "fraction_of_full": 0.8, "eval_noises": 16, "eval_seed": 0,
                     "eval_sampler": "ode", "target_fraction": 0.9, "eval_source": "auto", "reference": None}
LEARNING_OPTIONS = {"average_iterations": "--average", "fraction_of_full": "--fraction", "eval_noises": "--eval-noises",
                    "eval_seed": "--eval-seed", "eval_sampler": "--eval-sampler", "target_fraction": "--target-fraction",
                    "eval_source": "--eval-source", "reference": "--reference"}

# What a learning table's numbers are measured with, so equal across its runs (`agg-bench learning` refuses a
# manifest whose runs differ, a sweep with a learning section before its runs): the reward (every reward_* and
# eval_* column) and the captions; between runs with in-run evaluations their noise and sampler (the eval_* curves).
MEASURE_KEYS = ("reward", "prompts.file")
MEASURE_EVAL_KEYS = ("eval.noises", "eval.seed", "eval.sampler")


def measure_difference(first: dict, other: dict, evaluated: bool) -> str | None:
    """The first key of :data:`MEASURE_KEYS` (and of :data:`MEASURE_EVAL_KEYS` where both runs evaluate
    themselves, ``evaluated``) whose value differs between two run configs (mappings), or None."""
    keys = MEASURE_KEYS + (MEASURE_EVAL_KEYS if evaluated else ())
    return next((k for k in keys if dotted_value(other, k) != dotted_value(first, k)), None)


class MeasuredAlike:
    """The runs of one learning table, each checked as it is added (:meth:`add`) against the first run added
    and, where it evaluates itself, against the first that does (:func:`measure_difference`): the learning
    report compares them all against one target. What names a run is the caller's."""

    def __init__(self) -> None:
        self._first: dict[bool, tuple[Any, dict]] = {}  # evaluated -> (the first such run, its config)

    def add(self, run: Any, config: dict, evaluates: bool) -> tuple[str, Any, dict] | None:
        """(key, the run checked against, its config) for the first key in which ``config`` (a run config as a
        mapping) differs; None when it differs in none, and the run is then added."""
        for evaluated, first in self._first.items():
            if evaluates or not evaluated:
                key = measure_difference(first[1], config, evaluated)
                if key is not None:
                    return key, first[0], first[1]
        self._first.setdefault(False, (run, config))
        if evaluates:
            self._first.setdefault(True, (run, config))
        return None


def learning_settings(section: dict | None) -> dict[str, Any]:
    """A sweep's ``learning`` section (None: absent) with :data:`LEARNING_DEFAULTS` where it leaves a key out."""
    return {**LEARNING_DEFAULTS, **(section or {})}


def learning_command_options(section: dict | None) -> list[str]:
    """The options of ``agg-bench learning`` that report a sweep with this ``learning`` section: every key of
    :data:`LEARNING_OPTIONS`, but ``--reference`` only where the section names one (the command's default is
    ``full``, whose targets it leaves empty in a manifest without it, instead of refusing the report after the
    runs)."""
    settings = learning_settings(section)
    out: list[str] = []
    for key, option in LEARNING_OPTIONS.items():
        if settings[key] is not None:
            out += [option, str(settings[key])]
    return out
LEARNING_DIR = "results/learning"  # the learning report's tables and plots, and its manifest (workflow/rules/learning.smk)
LEARNING_RULES = ("learning", "learning_report", "learning_manifest")  # the rules of the learning report
DONE_DIR = "results/done"  # each run's marker: the output of its job (a run job or a cell job)
# Runs in one sweep. Composing and checking them costs little (runs that differ only in their seed are checked
# once), but Snakemake's own DAG grows faster than the runs: `snakemake -n` on one method x model x resolution
# took 5.4 s for 2,000 seeds, 8.6 s for 4,096, 26 s for 8,192 and 4 min 45 s for 20,000 (2-core Xeon). It is
# also the most runs one cell job takes (agg_bench.runtime.cell.MAX_RUNS).
MAX_RUNS = 4096


def is_pretrained_here(path: object) -> TypeGuard[str]:
    """Whether a ``model.pretrained`` value names a folder that the workflow's pretrain rule makes."""
    return isinstance(path, str) and path.startswith(PRETRAINED_DIR + "/")


CACHE_DIR = Path(".snakemake") / "agg-bench"
# keys whose value is one whole section: a method's options must not mix with another method's
WHOLE_SECTIONS = ("method", "options")


class SweepError(UserError):
    """A sweep config that cannot run as written; the message starts with ``sweep config:``."""

    def __init__(self, message: str):
        super().__init__(f"sweep config: {message}")


def check_sweep_files(paths) -> list[dict]:
    """Each file the sweep config came from (Snakemake's ``workflow.configfiles``) read again with agg-bench's
    YAML loader, which refuses what Snakemake's takes: a repeated key, a key that is not text, aliases
    that nest into a huge document, a file over the size limit. Returns what each file holds."""
    read = []
    for path in paths:
        try:
            read.append(read_yaml_mapping(path, "sweep sections", "--configfile"))
        except UserError as err:
            raise SweepError(str(err)) from None
    return read


# exclude keys whose pattern is checked against the values of a list (a `--config` may narrow it)
LISTED_LABELS = {"resolution": "resolutions", "seed": "seeds"}


def listed_values(sweep: dict, files: Sequence[dict] = ()) -> dict[str, list[str]]:
    """Each value a run's resolution and seed can take, as text (how an `exclude` pattern matches it): the
    sweep's lists and those of the files it came from (``files``: what :func:`check_sweep_files` read), so
    that an `exclude` written for the file still stands when a ``--config`` narrows its list."""
    out = {}
    for key, section in LISTED_LABELS.items():
        values: dict[str, None] = {}
        for source in [*files, sweep]:
            listed = source.get(section)
            if isinstance(listed, list):
                values.update((str(value), None) for value in listed if not isinstance(value, (dict, list)))
        out[key] = list(values)
    return out


def _named(values: list[str], most: int = 12) -> str:
    """``values`` for a message: the first ``most`` and how many more."""
    return ", ".join(values[:most]) + (f" and {len(values) - most} more" if len(values) > most else "")


def type_config_args(config: dict, entries: Any, parsed: Any) -> None:
    """Each ``--config key=value`` whose value is a list or mapping read again into ``config``, as it reads in a
    sweep file. Snakemake reads such a value with YAML's BaseLoader, which makes every number and boolean in it
    text (``--config 'seeds=[0, 1]'`` gives ``['0', '1']``, which the sweep's checks refuse), and merges it
    into the config: mappings key by key, anything else replaced. ``entries``: Snakemake's ``--config`` words
    (``workflow.config_settings.config_args``); ``parsed``: what Snakemake made of them
    (``workflow.config_settings.config``); a value it did not read with the BaseLoader (one that holds
    anything but text) is left as it is."""
    if not isinstance(entries, (list, tuple)) or not isinstance(parsed, Mapping):
        return
    for entry in entries:
        if not isinstance(entry, str) or "=" not in entry:
            continue
        key, text = entry.split("=", 1)
        try:
            value = yaml_load(text, "--config", entry)
        except yaml.YAMLError:
            continue  # not YAML: Snakemake kept it as text
        except UserError as err:
            raise SweepError(str(err)) from None
        if isinstance(value, (dict, list)) and _all_text(parsed.get(key)):
            _merge_config(config, {key: value})


def _all_text(value: Any) -> bool:
    """Whether ``value`` is a list or mapping whose every key and value inside is text: what YAML's BaseLoader
    makes of one."""
    if not isinstance(value, (dict, list)):
        return False
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            stack.extend(item.values())
            if not all(isinstance(key, str) for key in item):
                return False
        elif isinstance(item, list):
            stack.extend(item)
        elif not isinstance(item, str):
            return False
    return True


def _merge_config(config: dict, update: dict, whole: Sequence[str] = WHOLE_SECTIONS) -> None:
    """``update`` merged into ``config`` as Snakemake merges config (``snakemake.utils.update_config``: mappings key
    by key, copied, anything else replaced), but a section named in ``whole`` (by default a method section,
    ``method`` or ``options``) replaced whole, as in a sweep file: a method given on the command line does not
    keep the options of the one it replaces. ``whole=()``: as Snakemake merges."""
    for key, value in update.items():
        if isinstance(value, dict):
            if key in whole or not isinstance(config.get(key), dict):
                config[key] = {}
            _merge_config(config[key], value, whole)
        else:
            config[key] = value


def read_sweep_config(read: Sequence[dict], config_args: Any = (), parsed: Any = None) -> dict:
    """The sweep config the workflow runs: what Snakemake composes from its config files (``read``: what
    :func:`check_sweep_files` made of ``workflow.configfiles``, merged in order) and its ``--config``
    (``parsed``: what Snakemake made of it, ``workflow.config_settings.config``; ``config_args``: its words, read
    again by :func:`type_config_args`), but each file as agg-bench's YAML loader reads it, as ``agg-bench campaign
    --config`` reads it. Snakemake's own parse is YAML 1.1 and reads some values otherwise (``017`` as 15,
    ``0x10`` as 16, ``1:30`` as 90, ``1e-5`` as text), where the same file would give other runs, or none, to a
    campaign."""
    config: dict = {}
    for data in read:
        _merge_config(config, data, whole=())
    if isinstance(parsed, Mapping):
        _merge_config(config, dict(parsed), whole=())
    type_config_args(config, config_args, parsed)
    return config


def check_sweep(sweep: dict, schema: dict, files: Sequence[dict] = ()) -> None:
    """The sweep's size (aliases written out: before anything walks it), its structure against ``schema``,
    then the cross-references between its sections (``files``: what the files it came from hold, whose
    resolutions and seeds an `exclude` pattern may name)."""
    try:
        check_expanded_size(sweep)
    except YamlRefused as err:
        raise SweepError(f"expected {err.reason}") from None
    try:
        check_schema(sweep, schema)
        for prefix, overrides in run_overrides(sweep):  # NaN refused for what its run key takes, as in a run config
            check_override_values(flatten(overrides), run_schema(), prefix)
        check_finite(sweep)  # JSON Schema's numbers admit NaN and infinities (gradcheck.route_fracs, learning.*)
    except UserError as err:
        raise SweepError(str(err)) from None
    check_device_gpus(sweep["devices"])
    for section in ("gradcheck", "embed"):
        part = sweep.get(section) or {}
        for label in part.get("models", []):
            if label not in sweep["models"]:
                raise SweepError(f"{section}.models: {quote(label)} is not a label under models "
                                 f"({', '.join(sweep['models'])})")
        if "device" in part and part["device"] not in sweep["devices"]:
            raise SweepError(f"{section}.device: {quote(part['device'])} is not a label under devices "
                             f"({', '.join(sweep['devices'])})")
    for index, entry in enumerate(sweep.get("exclude", [])):  # a pattern that matches no label is a typo
        for key, section in (("method", "methods"), ("model", "models"), ("device", "devices")):
            if key in entry and not any(fnmatch.fnmatchcase(label, entry[key]) for label in sweep[section]):
                raise SweepError(f"exclude[{index}].{key}: {quote(entry[key])} matches no label under {section} "
                                 f"({', '.join(sweep[section])})")
    values = listed_values(sweep, files)
    for index, entry in enumerate(sweep.get("exclude", [])):  # a resolution or seed no list of the sweep names
        for key, section in LISTED_LABELS.items():
            if key in entry and not any(fnmatch.fnmatchcase(value, str(entry[key])) for value in values[key]):
                raise SweepError(f"exclude[{index}].{key}: {quote(entry[key])} matches no value under {section} "
                                 f"({_named(values[key])})")
    labels = [ref["label"] for ref in sweep.get("references", [])]
    if len(set(labels)) != len(labels):
        raise SweepError(f"references: labels must be unique ({', '.join(labels)})")
    for index, label in enumerate(labels):  # the label is the imported runs' method label in every manifest
        if label in sweep["methods"]:
            raise SweepError(f"references[{index}].label: {quote(label)} is also a label under methods; expected a "
                             "label of its own (the learning report would take the imported log as one of the "
                             "method's seeds)")
    check_label_case(sweep)
    for index, ref in enumerate(sweep.get("references", [])):
        check_reference(index, ref)
    reference = (sweep.get("learning") or {}).get("reference")
    if reference is not None and reference not in sweep["methods"]:  # agg-bench learning refuses it at the end
        raise SweepError(f"learning.reference: {quote(reference)} is not a label under methods "
                         f"({', '.join(sweep['methods'])})")
    learning = learning_settings(sweep.get("learning"))
    if learning["eval_source"] == "checkpoint" and learning["eval_noises"] == 0:
        raise SweepError("learning.eval_source: 'checkpoint' with learning.eval_noises = 0; expected eval_noises >= 1 "
                         "(the checkpoint evaluation's noises per caption: agg-bench learning refuses it after the runs)")


def check_device_gpus(devices: dict) -> None:
    """No ``gpus`` above 0 on a ``device: cpu`` entry of a (schema-checked) ``devices`` section: its jobs would
    take that many GPUs from the pool, which no other job could then use, for a torchrun of CPU processes. A
    job on the CPU is one process; its ``threads`` set how many cores it uses."""
    for label, spec in devices.items():
        if spec["device"] == "cpu" and spec.get("gpus", 0) > 0:
            raise SweepError(f"devices.{label}.gpus: {spec['gpus']}: a cpu device takes no GPUs from the pool (its "
                             f"job is one process; devices.{label}.threads sets its threads); expected 0, or "
                             "device: cuda")


def check_label_case(sweep: dict) -> None:
    """No two labels of one section of a (schema-checked) sweep differ only in case: the labels name the runs',
    cells', imported references' and pretrained models' files and folders, and a file system that ignores case
    (macOS's and Windows' by default) holds ``Full_sd3_32px_s0_cpu`` and ``full_sd3_32px_s0_cpu`` as one folder,
    where the second run would replace the first."""
    sections = {section: list(sweep.get(section) or {}) for section in ("methods", "models", "devices", "pretrain")}
    sections["references"] = [ref["label"] for ref in sweep.get("references", [])]
    for section, labels in sections.items():
        seen: dict[str, str] = {}
        for label in labels:
            first = seen.setdefault(label.lower(), label)
            if first != label:
                raise SweepError(f"{section}: {quote(label)} and {quote(first)} differ only in case; expected labels "
                                 "that differ in more than case (they name files and folders, and a file system that "
                                 "ignores case holds both as one)")


def run_overrides(sweep: dict) -> list[tuple[str, dict]]:
    """The parts of a (schema-checked) sweep that are run-config overrides, each with its place in the sweep:
    ``base`` (when a mapping), ``set``, each label's of ``models`` and ``methods``, and ``gradcheck.set``."""
    parts = [("base", sweep.get("base")), ("set", sweep.get("set")),
             *((f"{section}.{label}", overrides) for section in ("models", "methods")
               for label, overrides in (sweep.get(section) or {}).items()),
             ("gradcheck.set", (sweep.get("gradcheck") or {}).get("set"))]
    return [(prefix, overrides) for prefix, overrides in parts if isinstance(overrides, dict)]


def check_same_runs(runs: dict[str, dict], configs: dict[str, dict], options: dict[str, dict]) -> None:
    """No two method labels of a sweep compose the same run: for each model, resolution, seed and device, the
    runs' configs as loaded (``configs``: {job checked: its run config}, the job a run's ``check`` names, with
    the run's own seed), their method sections as the methods resolve them (``options``: {job checked: the
    method's options, name first}, the defaults of the options left out filled in), and without the run's
    ``run_id``, the label's, are compared whole. Two labels that compose one run would run it twice and show it
    as two rows; a SweepError naming both labels."""
    seen: dict[str, str] = {}
    for run_id, run in runs.items():
        config = {key: value for key, value in configs[run["check"]].items() if key != "run_id"}
        config["seed"] = [value for key, value in run["pairs"] if key == "seed"][-1]  # a method's own wins
        config["method"] = {**config["method"], **options[run["check"]]}  # its section with the defaults
        same = json.dumps([run["model"], run["resolution"], run["device"], config], sort_keys=True, default=repr)
        first = seen.setdefault(same, run_id)
        if first != run_id:
            raise SweepError(f"methods.{runs[first]['method']} and methods.{run['method']} compose the same run "
                             f"(runs {first} and {run_id} resolve to one run config, the method's options left out "
                             "at their defaults); give one")


def check_reference(index: int, ref: dict) -> None:
    """Reference ``index`` (``ref``, of the schema's types) as its ``agg-bench import-log`` job takes it
    (:func:`agg_bench.tools.importlog.label_problem`: ``method``, ``model`` and ``gpu_name`` labels,
    ``resolution`` and ``n_gpus`` in range); a SweepError naming the key otherwise, before any job runs."""
    problem = label_problem(**{key: ref[key] for key in ("resolution", "n_gpus", "method", "model", "gpu_name")
                               if key in ref})
    if problem is not None:
        key, value, allowed = problem
        raise SweepError(f"references[{index}].{key}: {quote(value)}: expected {allowed}")


def check_sweep_path(key: str, text: str, expected: str, file: bool = True) -> None:
    """A SweepError naming ``key`` when the sweep's path ``text`` names nothing this user can use
    (:func:`~agg_bench.outdir.named_path_problem`: a quoted ``~``, a folder on its way this user may not search,
    a ``file``'s path ending with ``/``), as a run config's paths are refused: a closed folder was a traceback of
    Snakemake's parse, a trailing ``/`` read the file, a quoted ``~`` said to be missing. Looks only."""
    problem = named_path_problem(text, file=file)
    if problem is not None:
        raise SweepError(f"{key}: {quote(text)}: {problem}; expected {expected}")


def check_input_files(jobs: Sweep) -> None:
    """The files the workflow's jobs read that no job makes, for the Snakefile (``agg-bench campaign`` reads no
    reference log and takes a model folder made by hand): each reference's log and each pretrain config are
    files, a model folder under results/pretrained/ is one that a ``pretrain`` entry makes (Snakemake
    ended in a KeyError traceback or a MissingInputException for a job instead), and each
    ``report.compare_with`` folder holds a reference manifest and is named once (the manifest job's parameters
    read it while the workflow is parsed: a folder without one ended Snakemake in a traceback; a folder named
    twice counted its runs twice in the tables). The model folders are those the jobs' composed configs name
    (:attr:`Sweep.pretrained`, each once, from ``set``, the base config, a ``models`` or ``methods`` entry or
    ``gradcheck.set``), and a refusal names the key that gives the folder."""
    sweep = jobs.sweep
    named: dict[str, int] = {}  # a folder's real path -> the index of the entry that named it first
    for index, folder in enumerate((sweep.get("report") or {}).get("compare_with", [])):
        first = named.setdefault(os.path.realpath(folder), index)
        if first != index:
            raise SweepError(f"report.compare_with[{index}]: {quote(folder)} is the folder of report.compare_with"
                             f"[{first}]; expected each reference folder once (its runs would count twice in the tables)")
        reference_manifest(folder, f"report.compare_with[{index}]")
    for index, ref in enumerate(sweep.get("references", [])):
        check_sweep_path(f"references[{index}].log", ref["log"], "a DanceGRPO JSONL log")
        if not Path(ref["log"]).is_file():
            raise SweepError(f"references[{index}].log: {quote(ref['log'])} is not a file (a DanceGRPO JSONL log, "
                             "relative to the working directory)")
    pretrain = sweep.get("pretrain") or {}
    for label, spec in pretrain.items():
        check_sweep_path(f"pretrain.{label}.config", spec["config"], "a pretrain config YAML")
        if not Path(spec["config"]).is_file():
            raise SweepError(f"pretrain.{label}.config: {quote(spec['config'])} is not a file (a pretrain config "
                             "YAML, relative to the working directory)")
    for folder, (place, _) in jobs.pretrained.items():
        # a folder of the pretrain rule's written otherwise (./, //, .., an absolute path) is no output of that
        # rule to Snakemake: the jobs that read it did not wait for its pretrain job, or ran without one
        normal = os.path.relpath(os.path.abspath(folder))
        if normal.startswith(PRETRAINED_DIR + "/") and normal != folder.rstrip("/"):
            raise SweepError(f"{place}: model.pretrained = {quote(folder)}: the folder {normal} under "
                             f"{PRETRAINED_DIR}/, written otherwise; expected {quote(normal)}, as the pretrain "
                             "entry of its name makes it (the jobs that read it wait for that entry's job)")
        if is_pretrained_here(folder) and folder[len(PRETRAINED_DIR) + 1:].rstrip("/") not in pretrain:
            raise SweepError(f"{place}: model.pretrained = {quote(folder)}: a folder under {PRETRAINED_DIR}/ "
                             f"is made by the pretrain entry of its name (pretrain has "
                             f"{', '.join(pretrain) if pretrain else 'none'}); add one, or keep a model made by "
                             "hand in another folder")
        # a model made by hand may be on the GPU node only (a dry run elsewhere), but a file there is no model:
        # every run job of the model failed at its start
        if not is_pretrained_here(folder) and os.path.exists(folder) and not os.path.isdir(folder):
            raise SweepError(f"{place}: model.pretrained = {quote(folder)} is a file; expected a model "
                             "folder (a diffusers pipeline's, or one agg-bench pretrain wrote)")
    # agg-bench pretrain's model is conditioned on token hashes, which each run computes: its embed job, which the
    # runs of the model wait for, failed ("nothing to embed") and none of them ran
    for model, job in jobs.embeddings.items():
        if is_pretrained_here(job["pretrained"]):
            given = "embed.models" if "models" in (jobs.embed or {}) else "embed (every model unless embed.models)"
            raise SweepError(f"{given}: {model} reads model.pretrained = {quote(job['pretrained'])}, a model "
                             "agg-bench pretrain makes, conditioned on token hashes that every run computes "
                             f"itself (no text encoders, nothing to embed); expected embed.models without {model}")


def pretrain_gpus(label: str, device: str) -> int:
    """The GPUs that the workflow's job of pretrain entry ``label``, on ``device`` (its config's, its ``set``
    applied), declares and takes from the GPU pool: 1 on ``cuda``, 0 on the CPU. A fixed index (``cuda:N``) is
    refused: the pool gives a job whichever device is free and shows it only that one (``CUDA_VISIBLE_DEVICES``),
    so device N would be another job's, or none."""
    if device == "cuda":
        return 1
    if device.startswith("cuda"):
        raise SweepError(f"pretrain.{label}: device = {quote(device)}: the pretrain job takes a free GPU from the "
                         "GPU pool, as a run job does, and sees only that one; expected cpu or cuda (AGG_BENCH_GPUS "
                         "or CUDA_VISIBLE_DEVICES choose the GPUs the pool gives out)")
    return 0


def check_markers(sweep: Sweep) -> None:
    """Each run whose marker says it ended still has its folder's ``summary.json``: a run folder removed by hand
    left its marker, so Snakemake took the run as done and the tables job failed on the missing folder. For
    the Snakefile; it removes nothing, and names the markers to remove."""
    stale = [run_id for run_id in sweep.runs if Path(sweep.done_marker(run_id)).is_file()
             and not (Path("results/runs") / run_id / "summary.json").is_file()]
    if len(stale) == 1:
        raise UserError(f"results/runs/{stale[0]} has no summary.json, but its marker says the run ended "
                        f"(its folder removed?); to run it again, remove the marker: rm {sweep.done_marker(stale[0])}")
    if stale:
        named = _named(stale, 3)
        raise UserError(f"{len(stale)} runs have no summary.json in results/runs/, but their markers say they "
                        f"ended (their folders removed?): {named}; to run them again, remove their markers, "
                        f"{DONE_DIR}/<run id>.json")


# the manifests the workflow writes once every run's marker is there, each with its rule
MANIFESTS = {"results/manifest.json": "manifest", f"{LEARNING_DIR}/manifest.json": "learning_manifest"}


def runs_behind_manifest(sweep: Sweep) -> str | None:
    """A warning when a run of ``sweep`` has no marker (removed by hand to run it again, or by Snakemake with a
    job that was stopped) while a manifest of this same sweep waits for it: Snakemake takes a missing file that
    only feeds outputs it has as nothing to make, so unless the manifest's rule is forced it runs nothing and the
    tables stay as they were ("Nothing to be done"). A manifest of another sweep is rewritten anyway (its rule's
    parameters changed). None when there is nothing to say. For the Snakefile, which learns of --forcerun only
    after it is parsed; reads only."""
    missing = [run_id for run_id in sweep.runs if not Path(sweep.done_marker(run_id)).is_file()]
    if not missing:
        return None
    expected = json.loads(json.dumps(sweep.manifest(), default=str))
    rules = []
    for path, rule in MANIFESTS.items():
        try:
            if read_json_object(Path(path), "a manifest") == expected:
                rules.append(rule)
        except UserError:
            continue  # none there, or not one the workflow wrote
    if not rules:
        return None
    them = "it" if len(missing) == 1 else "them"
    return (f"warning: {_named(missing, 3)} {'has' if len(missing) == 1 else 'have'} no marker in {DONE_DIR}/ but the "
            f"manifest that waits for {them} is there: Snakemake takes the tables as up to date and runs {them} only "
            f"with --forcerun {' '.join(rules)}")


def check_output_folders(paths) -> None:
    """Each folder that holds one of ``paths`` (the workflow's outputs, logs and benchmarks; a pattern's folders
    up to its first wildcard) is a folder where it exists: a file in its place (``results`` itself, say) ended
    Snakemake in a NotADirectoryError traceback, before any job or halfway through a run."""
    seen: set[str] = set()
    for path in paths:
        parts = Path(os.path.dirname(str(path).split("{", 1)[0] + "x")).parts  # the folders before any wildcard
        for depth in range(1, len(parts) + 1):
            folder = str(Path(*parts[:depth]))
            if folder in seen:
                continue
            seen.add(folder)
            if os.path.lexists(folder) and not os.path.isdir(folder):
                raise UserError(f"{shown(folder)} is not a folder, and the workflow keeps its files in a folder of "
                                "that name; move it away")


# ends the refusal of a folder the workflow writes into that holds someone's files
MOVE_AWAY = "move what is not the workflow's out of it first (a job that writes there would refuse it)"


def output_folders(sweep: Sweep) -> list[tuple[str, Contents]]:
    """Each folder the workflow's commands write into with what each may hold (:mod:`agg_bench.outputs`): every
    run's folder, the report's tables and plots, each imported reference's and each pretrain entry's folder,
    and the learning report's folder: the workflow's `learning` target runs under every sweep (its rules take
    the ``learning`` section's defaults where it has none), so that folder is checked whatever the sweep holds."""
    folders = [(f"results/runs/{run_id}", RUN_CONTENTS) for run_id in sweep.runs]
    folders += [("results/tables", REPORT_CONTENTS), ("results/plots", REPORT_CONTENTS)]
    folders += [(f"results/imported/{label}", IMPORT_CONTENTS) for label in sweep.references]
    folders += [(f"{PRETRAINED_DIR}/{label}", PRETRAIN_CONTENTS) for label in sweep.sweep.get("pretrain") or {}]
    folders.append((LEARNING_DIR, LEARNING_CONTENTS))
    return folders


def check_output_contents(sweep: Sweep) -> None:
    """Each folder the workflow writes into (:func:`output_folders`) is new or holds only what its command
    writes there, each name of its kind, and a run's file names only beside a run's config: a file of someone's
    (``notes.txt`` in a run folder, ``mine.csv`` beside the tables) was refused only when the job that writes
    there ran, for the tables after every run. For the Snakefile, before any job; reads only."""
    for folder, contents in output_folders(sweep):
        if contents is RUN_CONTENTS:
            check_run_folder(Path(folder), "output folder", MOVE_AWAY)
        else:
            check_folder(Path(folder), contents, "output folder", MOVE_AWAY)


def flatten(overrides: dict, prefix: str = "") -> list[tuple[str, Any]]:
    """Dotted (key, value) leaves of ``overrides``; `method` and `*.options` stay whole."""
    out = []
    for key, value in overrides.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, dict) and value and dotted.split(".")[-1] not in WHOLE_SECTIONS:
            out.extend(flatten(value, dotted + "."))
        else:
            out.append((dotted, value))
    return out


def joined(parts: list[tuple[str, list[tuple[str, Any]]]]) -> list[tuple[str, Any]]:
    """The (key, value) pairs of a job's override parts (:meth:`Sweep._parts`), in order."""
    return [pair for _, part in parts for pair in part]


def yaml_text(value: Any) -> str:
    """``value`` as one line of YAML, which is how `agg-bench --set key=value` parses it: written as agg-bench's
    loader reads it back (:class:`~agg_bench.config.YamlDumper`: the text ``1e-5`` quoted)."""
    text = yaml.dump(value, Dumper=YamlDumper, default_flow_style=True, width=1 << 30, sort_keys=False).strip()
    return text[:-3].strip() if text.endswith("\n...") else text


def set_arg(key: str, value: Any) -> str:
    """``--set key=value`` quoted for the shell."""
    return "--set " + shlex.quote(f"{key}={yaml_text(value)}")


_YAML_TEXTS: dict[str, str] = {}  # a value's JSON (its type and order kept) -> its YAML line: runs share values


def overrides_of(pairs: list[tuple[str, Any]]) -> list[str]:
    """``pairs`` as the ``key=value`` strings `agg-bench --set` takes."""
    out = []
    for key, value in pairs:
        memo = json.dumps(value, default=repr)
        if memo not in _YAML_TEXTS:
            _YAML_TEXTS[memo] = yaml_text(value)
        out.append(f"{key}={_YAML_TEXTS[memo]}")
    return out


# ----- stage 2: the methods' own checks (imports torch; run in a child process) ------------------------
def check_methods(base_file: str | None, jobs: dict[str, list],
                  replays: dict[str, dict] | None = None) -> dict[str, dict]:
    """Each job's method built from its composed config, as `agg-bench run` builds it, and run through
    ``check_run``: {job: the method's resolved options (name first)}. ``replays``: {job: its gradcheck grid
    (:meth:`Sweep.gradcheck_grid`)} for the gradcheck jobs among ``jobs``, each replay of the grid and of its
    ``methods`` set up on the job's config as `agg-bench gradcheck` sets it up before its rollout. Raises a
    SweepError naming the first job that fails."""
    from ..methods.base import build_estimator  # torch: only in the child process that runs this
    from ..runtime.config_check import check_config

    options = {}
    replays = replays or {}
    for what, pairs in jobs.items():
        try:
            cfg = check_config(load_config(base_file, overrides_of(pairs)))  # the method's options typed here, once
            build_estimator(cfg).check_run(cfg)
        except UserError as err:
            raise SweepError(f"{what}: {err}") from None
        if what in replays:
            _check_replays(what, cfg.to_dict(), replays[what])
        options[what] = {"name": cfg.method.name, **dataclasses.asdict(cfg.method.options)}
    return options


def _check_replays(what: str, config: dict, grid: dict) -> None:
    """Each replay of gradcheck job ``what``'s ``grid`` (the AGG grid, then its ``methods``) set up on the job's
    ``config`` as `agg-bench gradcheck` sets it up before its rollout; a SweepError naming the job and the
    sweep's keys otherwise. Runs in the child process (torch)."""
    from .replays import agg_grid, build_estimators, check_replay_count, parse_method_specs

    try:
        check_replay_count(agg_grid(grid["windows"], grid["alphas"], grid["route_fracs"], grid["reuse"]),
                           parse_method_specs(grid["methods"]), "gradcheck.windows x alphas x route_fracs x reuse, "
                                                                "methods")
    except UserError as err:
        raise SweepError(f"{what}: {err}") from None
    try:
        build_estimators(config, agg_grid(grid["windows"], grid["alphas"], grid["route_fracs"], grid["reuse"]))
    except UserError as err:
        raise SweepError(f"{what}: gradcheck.windows x alphas x route_fracs x reuse: {err}") from None
    try:
        build_estimators(config, parse_method_specs(grid["methods"]))
    except UserError as err:
        raise SweepError(f"{what}: gradcheck.methods: {err}") from None


def check_pretrain_entries(entries: dict[str, dict]) -> dict[str, dict]:
    """Each pretrain entry of a sweep read as its job is given it (:func:`agg_bench.tools.pretrain.sweep_entry_config`:
    its config file, its ``set``, the model's sizes against this machine's memory) and its device as the GPU pool
    takes it (:func:`pretrain_gpus`): {label: {"threads", "device"}}, what the workflow's pretrain jobs reserve.
    Raises a SweepError naming the first entry that fails. Runs in the child process (torch, diffusers)."""
    from .pretrain import sweep_entry_config

    out = {}
    for label, spec in entries.items():
        cfg = sweep_entry_config(label, spec)
        pretrain_gpus(label, cfg.device)  # a fixed cuda:N, which the GPU pool cannot honour
        out[label] = {"threads": cfg.threads, "device": cfg.device}
    return out


def _main() -> int:
    """``python -m agg_bench.tools.sweep``: {"base", "jobs", "replays"} (the methods' check) or {"pretrain"}
    (the pretrain entries' check) on stdin -> {"answer"} or {"error"} on stdout."""
    request = json.load(sys.stdin)
    answer: dict[str, object]
    try:
        if "pretrain" in request:
            answer = {"answer": check_pretrain_entries(request["pretrain"])}
        else:
            answer = {"answer": check_methods(request["base"], request["jobs"], request.get("replays"))}
    except UserError as err:
        answer = {"error": str(err)}
    json.dump(answer, sys.stdout)
    return 0


def _checked_in_child(kind: str, request: dict, files: Sequence[str | None], cache_dir: Path | None,
                      machine: object = None, whole: Callable[[Any], bool] = lambda answer: isinstance(answer, dict)
                      ) -> dict:
    """The answer of :func:`_main` to ``request`` from a child process (torch and the model libraries stay out of
    Snakemake's process: seconds of every start), cached in ``cache_dir`` (None: not cached) under a key of the
    request, the interpreter, the sources, the texts of ``files`` (the config files the answer reads) and
    ``machine`` (what else of this machine it depends on). A refusal is raised, and never cached; a kept answer
    that is not ``whole`` (torn, or edited) is checked again, and a cache that cannot be written (a file where its
    folder goes, no room) keeps nothing: the answer stands."""
    texts: dict[str, str | None] = {}
    for name in filter(None, files):
        try:
            texts[name] = Path(name).read_text()
        except (OSError, ValueError):
            texts[name] = None  # the child names what is wrong with it
    key = hashlib.sha256(json.dumps({
        "request": request, "python": sys.executable, "sources": source_digest(), "texts": texts, "machine": machine,
    }, sort_keys=True, default=str).encode()).hexdigest()
    cached = None if cache_dir is None else cache_dir / f"{kind}-{key[:32]}.json"
    if cached is not None and cached.is_file():
        try:
            kept = json.loads(cached.read_text())["answer"]
        except (OSError, ValueError, KeyError, TypeError):
            kept = None  # a torn or foreign file: check again
        if whole(kept):
            return kept
    # the child imports agg_bench from where this process did; it builds configs, no tensors: one thread
    # (with the short OpenMP waits this process's `import agg_bench` put in the environment)
    root = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])),
           "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "agg_bench.tools.sweep"], input=json.dumps(request, default=str),
                          capture_output=True, text=True, env=env)
    try:
        answer = json.loads(proc.stdout)
    except ValueError:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or [f"exit code {proc.returncode}"]
        raise SweepError(f"checking the {'pretrain entries' if kind == 'pretrain' else 'methods'}' options failed: "
                         f"{tail[0]}") from None
    if "error" in answer:
        raise UserError(answer["error"])
    if cached is not None:
        try:
            cached.parent.mkdir(parents=True, exist_ok=True)
            write_text(cached, json.dumps(answer))
        except OSError:
            pass  # the next start checks again
    return answer["answer"]


def checked_pretrain(entries: dict[str, dict], cache_dir: Path | None = CACHE_DIR) -> dict[str, dict]:
    """:func:`check_pretrain_entries` in a child process, its answer cached in ``cache_dir`` (None: not cached).
    The model's sizes are checked against this machine's memory, which is part of the key."""
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")

    def whole(answer: Any) -> bool:  # each entry's threads and device, as check_pretrain_entries gives them
        return isinstance(answer, dict) and set(answer) == set(entries) and all(
            isinstance(one, dict) and is_integer(one.get("threads")) and isinstance(one.get("device"), str)
            for one in answer.values())

    return _checked_in_child("pretrain", {"pretrain": entries}, [spec.get("config") for spec in entries.values()],
                             cache_dir, memory, whole)


def checked_methods(base_file: str | None, jobs: dict[str, list], cache_dir: Path | None = CACHE_DIR,
                    replays: dict[str, dict] | None = None) -> dict[str, dict]:
    """:func:`check_methods` in a child process, its answer cached in ``cache_dir`` (None: not cached)."""
    request = {"base": base_file, "jobs": jobs, "replays": replays or {}}
    return _checked_in_child("methods", request, [base_file], cache_dir)


# ----- the jobs -----------------------------------------------------------------------------------------
class Sweep:
    """The jobs of a sweep config: runs (on a CPU, grouped into cell jobs that run them in one process),
    gradchecks, embeddings and imported references.

    ``schema``: the sweep schema (``workflow/schemas/config.schema.yaml``) as a path or a dict.
    ``cache_dir``: where the methods' check keeps its answers (None: not kept).
    ``files``: the files ``sweep`` was read from (Snakemake's ``workflow.configfiles``), read again first;
    ``read``: what :func:`check_sweep_files` made of them already (a caller that read them first), not read again.
    """

    def __init__(self, sweep: dict, schema: str | Path | dict, cache_dir: Path | None = CACHE_DIR,
                 files=(), read: Sequence[dict] | None = None):
        read = check_sweep_files(files) if read is None else read
        schema = schema if isinstance(schema, dict) else yaml.safe_load(Path(schema).read_text())
        check_sweep(sweep, schema, read)
        self.sweep = sweep
        # the learning section the runs are checked against (None: none, until check_learning)
        self.learning = sweep.get("learning")
        self._run_checks: list[tuple[str, list, str]] = []  # (job, its pairs, its device) of each run checked
        base = sweep["base"]
        self.base_file = base if isinstance(base, str) else None
        self.base_pairs = [] if isinstance(base, str) else flatten(base)
        self._base_pretrained = None  # the base config file's model.pretrained (None: none, or no file)
        if self.base_file is not None:
            check_sweep_path("base", self.base_file, "a run config YAML, relative to the working directory")
            if not Path(self.base_file).is_file():
                raise SweepError(f"base: {quote(self.base_file)} is not a file "
                                 "(a run config YAML, relative to the working directory)")
            try:  # a file that is no YAML mapping named as the sweep's key, not as each run's --config
                sections = read_yaml_mapping(self.base_file, "run config sections", "base")
            except UserError as err:
                raise SweepError(str(err)) from None
            known = run_schema()["properties"]
            other = next((key for key in sections if key not in known), None)
            if other is not None:  # a sweep file given as its own base was refused for its `base` key, run by run
                raise SweepError(f"base: {quote(self.base_file)} holds {quote(other)}, which is no run config section "
                                 f"(one of {', '.join(sorted(known))}); expected a run config YAML, relative to the "
                                 "working directory")
            self._base_pretrained = dotted_value(sections, "model.pretrained")
        self.devices = sweep["devices"]
        # each model.pretrained folder a job reads, once -> the sweep's key that gives it and the first such job
        self.pretrained: dict[str, tuple[str, str]] = {}
        self.embed = sweep.get("embed")
        # models whose runs read prompt embeddings made by the embed rule
        self.embed_models = [] if self.embed is None else self.embed.get("models", list(sweep["models"]))
        self.runs: dict[str, dict] = {}
        self._measured = MeasuredAlike()  # a learning sweep's runs, measured alike
        checks: dict[str, list] = {}  # job description -> composed pairs, for the methods' check
        # Runs that differ only in their seed are checked once: no check but the seed's own range (the sweep
        # schema's, the run schema's) reads the seed, so the first seed's job stands for the others.
        checked: dict[str, str] = {}  # the composed pairs but the seed (JSON) -> the job checked for them
        resolved: dict[str, dict] = {}  # the job checked -> its run config as loaded (the first seed's)
        for method in sweep["methods"]:
            for model in sweep["models"]:
                for resolution in sweep["resolutions"]:
                    for seed in sweep["seeds"]:
                        for device in self.devices:
                            labels = {"method": method, "model": model, "resolution": resolution, "seed": seed,
                                      "device": device}
                            if not self.excluded(labels):
                                run_id = f"{method}_{model}_{resolution}px_s{seed}_{device}"
                                extra = sweep["methods"][method]
                                parts = self._parts(device, model, resolution, seed, extra, f"methods.{method}")
                                pairs = joined(parts)
                                key = json.dumps([device, self._pairs(device, model, resolution, None, extra)],
                                                 default=repr)
                                if key not in checked:
                                    checked[key] = f"run {run_id} (methods.{method}, models.{model})"
                                    self._note_pretrained(checked[key], parts)
                                    resolved[checked[key]] = self._check(checked[key], pairs, device,
                                                                         learning_ends=True)
                                    self._run_checks.append((checked[key], pairs, device))
                                    checks[checked[key]] = pairs
                                self.runs[run_id] = {**labels, "pairs": pairs, "check": checked[key],
                                                     "pretrained": self._pretrained(parts)[0]}
                                if len(self.runs) > MAX_RUNS:
                                    raise SweepError(
                                        f"methods x models x resolutions x seeds x devices: more than {MAX_RUNS:,} "
                                        f"runs after exclude ({len(sweep['seeds']):,} seeds); expected at most "
                                        f"{MAX_RUNS:,} in one sweep (split it into several sweeps)")
        if not self.runs:
            raise SweepError("exclude: no runs left after exclude (every method x model x resolution x seed x "
                             "device combination matches an entry)")
        self.gradchecks: dict[str, dict] = {}
        part = sweep.get("gradcheck")
        if part is not None:  # `gradcheck: {}` replays the defaults, as `embed: {}` embeds for every model
            device = part.get("device", next(iter(self.devices)))
            for model in part.get("models", list(sweep["models"])):
                for resolution in part.get("resolutions", sweep["resolutions"][:1]):
                    name = f"{model}_{resolution}px_{device}"
                    parts = self._parts(device, model, resolution, None, part.get("set") or {}, "gradcheck.set")
                    pairs = joined(parts)
                    self._check(f"gradcheck {name}", pairs)
                    checks[f"gradcheck {name}"] = pairs
                    self.gradchecks[name] = {"model": model, "resolution": resolution, "device": device,
                                             "pairs": pairs, "pretrained": self._note_pretrained(f"gradcheck {name}",
                                                                                                 parts)}
        self.embeddings = {}
        if self.embed is not None:
            device = self.embed.get("device", next(iter(self.devices)))
            for model in self.embed_models:
                parts = self._parts(device, model, None, None, {})
                self.embeddings[model] = {"device": device, "pairs": joined(parts),
                                          "pretrained": self._note_pretrained(f"embed {model}", parts)}
        self.references = {ref["label"]: ref for ref in sweep.get("references", [])}
        # one calibration of the cost model per (model, resolution, device) that runs measure
        self.calibrations: dict[str, dict] = {}
        if (sweep.get("calibrate") or {}).get("enabled", True):
            for run in self.runs.values():
                name = f"{run['model']}_{run['resolution']}px_{run['device']}"
                if name not in self.calibrations:
                    self.calibrations[name] = {key: run[key] for key in ("model", "resolution", "device")}
                    parts = self._parts(run["device"], run["model"], run["resolution"], None, {})
                    self.calibrations[name]["pairs"] = joined(parts)
                    self.calibrations[name]["pretrained"] = self._note_pretrained(f"calibrate {name}", parts)
                    self.calibrations[name]["methods"] = []
                    if self.gpus(run["device"]) > 1:  # timed on the cell's processes, each with its share
                        self._check(f"calibrate {name}", self.calibrations[name]["pairs"], run["device"])
                # the cell's methods, whose train phases the calibration times side by side
                if run["method"] not in self.calibrations[name]["methods"]:
                    self.calibrations[name]["methods"].append(run["method"])
        replays = {f"gradcheck {name}": self.gradcheck_grid() for name in self.gradchecks}
        options = checked_methods(self.base_file, checks, cache_dir, replays) if checks else {}
        check_same_runs(self.runs, resolved, options)
        self._check_warmup(resolved)
        for run in self.runs.values():
            run["method_options"] = options[run.pop("check")]
        self.cells = self._cells()
        in_cells = {run_id for run_ids in self.cells.values() for run_id in run_ids}
        self.single_runs = [run_id for run_id in self.runs if run_id not in in_cells]  # one `run` job each

    def _check_warmup(self, resolved: dict[str, dict]) -> None:
        """A ``report.warmup_iterations`` the sweep gives below each run's ``train.iterations`` (``resolved``: each
        run checked -> its run config): the tables time a run's iterations after the warm-up, and a run of no more
        iterations is timed whole, warm-up included. Left out, the default (1) times a one-iteration run whole, which
        ``agg-bench report`` notes (:func:`agg_bench.results.tables.timed_whole`)."""
        warmup = (self.sweep.get("report") or {}).get("warmup_iterations")
        if warmup is None:
            return
        for what, config in resolved.items():
            iterations = config["train"]["iterations"]
            if warmup >= iterations:
                raise SweepError(f"{what}: " + str(ConfigError(
                    "report.warmup_iterations", warmup,
                    f"at most {iterations - 1}: the tables time each run's iterations after the warm-up, and this run "
                    f"trains train.iterations = {iterations} (left out, the default 1 times a run of one iteration "
                    "whole, and agg-bench report says so)")))

    def check_learning(self) -> None:
        """The runs checked as the learning report checks them (their iterations against its two ends, measured
        alike), on the ``learning`` section's defaults where the sweep has none: the workflow's learning target
        runs under any sweep, and a sweep without the section was checked for it only after its runs."""
        if self.learning is not None:
            return  # checked with the runs
        self.learning = {}
        for what, pairs, device in self._run_checks:
            self._check(what, pairs, device, learning_ends=True)

    # ----- cells: runs that share one process --------------------------------------------------
    def runs_per_job(self, device: str) -> int:
        """The most runs one job of ``device`` runs one after the other in one process
        (``devices.<d>.runs_per_job``); 0: all runs of a cell. Default 0 on a device without GPUs, 1 with
        GPUs (a run holds its GPUs and their memory alone); a one-GPU device may set it (the cell's runs
        then share one process, one model build and one GPU, one run at a time)."""
        spec = self.devices[device]
        return int(spec.get("runs_per_job", 1 if self.gpus(device) else 0))

    def _cells(self) -> dict[str, list[str]]:
        """{cell job: its run ids}: the runs of one model x resolution x device, in sweep order, split into
        jobs of at most ``runs_per_job`` runs of as even a size as may be. A job of one run is a `run`
        job and not listed."""
        groups: dict[str, list[str]] = {}
        for run_id, run in self.runs.items():
            groups.setdefault(f"{run['model']}_{run['resolution']}px_{run['device']}", []).append(run_id)
        cells = {}
        for name, run_ids in groups.items():
            device = self.runs[run_ids[0]]["device"]
            size = self.runs_per_job(device) or len(run_ids)
            if size > 1 and self.gpus(device) > 1:
                raise SweepError(f"devices.{device}.runs_per_job: {size}: a job on several GPUs runs one run "
                                 "(torchrun starts a process per GPU for each run); expected 1 or no key")
            count = -(-len(run_ids) // size)
            for part in range(count):
                ids = run_ids[len(run_ids) * part // count:len(run_ids) * (part + 1) // count]
                if len(ids) > 1:
                    cells[name if count == 1 else f"{name}_{part + 1}of{count}"] = ids
        return cells

    def cell_rule(self, cell: str) -> str:
        """The Snakemake rule of cell job ``cell`` (one rule per cell: a rule's outputs are its runs' files)."""
        def rule(name: str) -> str:
            return "cell_" + "".join(c if c.isalnum() else "_" for c in name)

        same = [name for name in self.cells if rule(name) == rule(cell)]  # labels that differ in '.' and '-'
        return rule(cell) if len(same) == 1 else f"{rule(cell)}_{same.index(cell) + 1}"

    def cell_jobs(self, cell: str) -> dict:
        """The job file of ``cell`` (:mod:`agg_bench.runtime.cell`): each run's `agg-bench run` arguments."""
        return {"runs": [job_entry(self.base_file, overrides_of(self.runs[run_id]["pairs"]), f"results/runs/{run_id}",
                                   self.done_marker(run_id))
                         for run_id in self.cells[cell]]}

    def cell_command(self, cell: str) -> str:
        """The cell job's command: on the CPU, or on one GPU taken from the pool. Its outputs are its runs'
        markers, not their files, so a job that fails or is stopped leaves its finished runs' files where
        they are (Snakemake removes a failed job's outputs). --keep-going: a failed run is recorded in its
        folder and the job succeeds; the manifest reports the failure. --resume: the next attempt keeps the
        runs an attempt that did not end had finished. --overwrite: a run's folder holding a finished run of
        an earlier config is replaced, as when Snakemake removed a run job's outputs. --keep-journal: an attempt
        that ended leaves its journal, which the workflow removes once Snakemake has recorded the job's end
        (:meth:`forget_attempts`), so a job
        that ended after Snakemake itself was killed, which Snakemake reruns as incomplete, keeps its runs."""
        return (f"{self.launch(self.cell_device(cell), 'cell')} --keep-going --resume --keep-journal --overwrite "
                f"{CELL_DIR}/{cell}.json")

    def journal(self, job: str) -> str:
        """The journal of a cell job (``job``: a cell) or of a run job (``job``: one of :attr:`single_runs`),
        beside the cells' job files: a cell's its ``agg-bench cell --resume`` keeps, a run's its ``agg-bench run
        --journal`` keeps. Labels hold no ``_``, so a run's id never names a cell."""
        return str(Journal.path_of(Path(CELL_DIR, f"{job}.json")))

    def forget_attempts(self, jobs=None) -> None:
        """Remove the journal (:meth:`journal`) of each job of ``jobs`` (cells and run ids of
        :attr:`single_runs`; default: every one), which ``agg-bench cell --keep-journal`` and ``agg-bench run
        --journal`` leave, once Snakemake has recorded the job's end: for the manifest job, and for each job
        that a snakemake ran when it ends (the Snakefile's onsuccess and onerror): a forced rerun then runs every
        run again. Only a journal that records every run of its job as ended (``ok``, ``oom``, ``diverged``)
        goes, as the cell itself removes one without ``--keep-journal``: while a run failed, the next attempt
        reruns that run only. A file there that is not a journal is left (the job refuses it)."""
        for job in [*self.cells, *self.single_runs] if jobs is None else jobs:
            path = Path(self.journal(job))
            run_ids = self.cells[job] if job in self.cells else [job]
            if path.is_file() and not path.is_symlink() and \
                    journal_ends(path, [f"results/runs/{run_id}" for run_id in run_ids]):
                path.unlink()

    def cell_device(self, cell: str) -> str:
        """The device label of ``cell``'s runs."""
        return self.runs[self.cells[cell][0]]["device"]

    def cell_outputs(self, cell: str) -> list[str]:
        """The cell job's outputs: its runs' markers (:meth:`done_marker`)."""
        return [self.done_marker(run_id) for run_id in self.cells[cell]]

    def done_marker(self, run_id: str) -> str:
        """The file that says a run has ended (``{"out", "status"}``, written by `agg-bench run --done` or
        `agg-bench cell`): its job's output. Not the run's own files, which Snakemake would remove when the
        job fails or is stopped, and before it reruns the job."""
        return f"{DONE_DIR}/{run_id}.json"

    def excluded(self, labels: dict) -> bool:
        """Whether an `exclude` entry matches every label it names (shell-style patterns: cache-*)."""
        return any(all(fnmatch.fnmatchcase(str(labels[key]), str(pattern)) for key, pattern in entry.items())
                   for entry in self.sweep.get("exclude", []))

    # ----- composing run configs ----------------------------------------------------------------
    def _parts(self, device: str, model: str, resolution, seed, extra: dict,
               place: str = "") -> list[tuple[str, list[tuple[str, Any]]]]:
        """A job's overrides in the order they apply, each part with the sweep's key that gives it (``place``:
        that of ``extra``, the job's own, ``methods.<label>`` or ``gradcheck.set``)."""
        parts = [("base", self.base_pairs), ("set", flatten(self.sweep.get("set") or {})),
                 (f"devices.{device}.device", [("device", self.devices[device]["device"])]),
                 (f"models.{model}", flatten(self.sweep["models"][model]))]
        if resolution is not None:
            parts.append(("resolutions", [("model.resolution", resolution)]))
        if seed is not None:
            parts.append(("seeds", [("seed", seed)]))
        parts.append((place, flatten(extra)))
        if model in self.embed_models:
            parts.append(("embed", [("prompts.cache_dir", EMBED_DIR)]))
        return parts

    def _pairs(self, device: str, model: str, resolution, seed, extra: dict) -> list[tuple[str, Any]]:
        return joined(self._parts(device, model, resolution, seed, extra))

    def _pretrained(self, parts: list[tuple[str, list[tuple[str, Any]]]]) -> tuple[Any, str]:
        """The ``model.pretrained`` of a job composed of ``parts`` (:meth:`_parts`) and the sweep's key that
        gives it: the last part that sets it, else the base config file (None: the default, no folder)."""
        for place, part in reversed(parts):
            for key, value in reversed(part):
                if key == "model.pretrained":
                    return value, place
        return self._base_pretrained, "base" if self.base_file is None else f"base {quote(self.base_file)}"

    def _note_pretrained(self, what: str, parts: list[tuple[str, list[tuple[str, Any]]]]) -> Any:
        """The ``model.pretrained`` of job ``what`` composed of ``parts``, kept in :attr:`pretrained` with its key
        where it is the first job to read that folder (:func:`check_input_files` checks each folder once)."""
        folder, place = self._pretrained(parts)
        if isinstance(folder, str) and folder not in self.pretrained:
            self.pretrained[folder] = (place, what)
        return folder

    def _check(self, what: str, pairs: list[tuple[str, Any]], device: str | None = None,
               learning_ends: bool = False) -> dict:
        """The composed run config against the run schema, its resolution against its model's configs,
        and (on ``device``) its batch against the device's processes, as `agg-bench run` would check
        them; with ``learning_ends`` (a run of a sweep with a ``learning`` section) its iterations against the
        learning table's two ends; an error names the job and the key. Returns the run config as loaded."""
        try:
            cfg = load_config(self.base_file, overrides_of(pairs))
            learning = self.learning
            average = learning_settings(learning)["average_iterations"]
            if learning_ends and learning is not None:
                self._check_measure(what, cfg.to_dict())
            if learning_ends and learning is not None and 2 * average > cfg.train.iterations:
                raise ConfigError("learning.average_iterations", average,
                                  f"at most {cfg.train.iterations // 2}: the learning table averages that many "
                                  f"iterations at each end of a run, and this run trains at most train.iterations = "
                                  f"{cfg.train.iterations} (agg-bench learning refuses it after the runs)")
            if cfg.model.preset == "random" and not cfg.model.pretrained:  # the name, from the specs (no torch)
                architecture(cfg.model.family, cfg.model.architecture)
            check_resolution(cfg.model.to_dict())
            # the prompts file, which no job makes: a missing one (or a folder, a .yaml) failed every run job at its
            # start, when engine.prompts.load_prompts (which imports torch) read it
            if isinstance(cfg.prompts.file, str):
                check_prompts_path(cfg.prompts.file)
            # a model folder's own schedule, read here rather than in the methods' check, whose answer is kept
            # by the folder's name and not by what its files hold
            check_own_schedule(cfg.model.to_dict(), cfg.sampling.to_dict())
            check_guidance(cfg.model.to_dict())  # a guidance value the model's transformer would not embed
        except UserError as err:
            raise SweepError(f"{what}: {err}") from None
        processes = 1 if device is None else max(1, self.gpus(device))
        try:
            check_data_parallel(cfg, processes)
        except UserError as err:
            raise SweepError(f"{what}: {err} (devices.{device}.gpus: {processes})") from None
        return cfg.to_dict()

    def _check_measure(self, what: str, config: dict) -> None:
        """A run of a learning sweep measured as its first run (:class:`MeasuredAlike`; the in-run evaluation's
        keys against the first run that evaluates itself): the learning report compares them all."""
        found = self._measured.add(what, config, bool(dotted_value(config, "eval.every")))
        if found is not None:
            key, first, first_config = found
            raise ConfigError(key, dotted_value(config, key),
                              f"{quote(dotted_value(first_config, key))} as in {first}: the learning report "
                              "compares every run of the sweep against one target, so they are measured alike "
                              "(agg-bench learning refuses it after the runs)")

    # ----- command lines ------------------------------------------------------------------------
    def _config_args(self, pairs) -> str:
        args = [f"--config {shlex.quote(self.base_file)}"] if self.base_file else []
        args += [set_arg(k, v) for k, v in pairs]
        return " ".join(args)

    def gpus(self, device: str) -> int:
        spec = self.devices[device]
        return int(spec.get("gpus", 1 if spec["device"] == "cuda" else 0))

    def tool_gpus(self, device: str) -> int:
        """The GPUs an ``embed`` or ``gradcheck`` job of ``device`` takes: one of a several-GPU device's (each is
        one process; under torchrun every process did the whole job, and wrote the same file)."""
        return min(self.gpus(device), 1)

    def threads(self, device: str) -> int:
        return int(self.devices[device].get("threads", 1))

    def launch(self, device: str, verb: str, gpus: int | None = None) -> str:
        """How a job of ``device`` starts `agg-bench VERB`: on pooled GPUs (``gpus``, default the
        device's), with torchrun for several."""
        k = self.gpus(device) if gpus is None else gpus
        cli = f"{PYTHON} -m agg_bench {verb}"
        if k == 0:
            return cli
        if k > 1:
            cli = f"{PYTHON} -m torch.distributed.run --standalone --nproc_per_node {k} -m agg_bench {verb}"
        return f"{PYTHON} -m agg_bench.machine.gpus --count {k} -- {cli}"

    def run_command(self, run_id: str) -> str:
        """A run job's command. --resume-stopped: a run whose earlier attempt was stopped (killed, a scheduler's
        time limit) continues from its checkpoint; any other starts over. --overwrite: a folder holding a
        finished run of an earlier config is replaced. --done: the marker that is the job's output. --journal:
        the run's journal (:meth:`journal`), as a cell job keeps one with --keep-journal, so a job that ended
        after Snakemake itself was killed, which Snakemake reruns as incomplete, keeps its run."""
        run = self.runs[run_id]
        return (f"{self.launch(run['device'], 'run')} {self._config_args(run['pairs'])} --out results/runs/{run_id} "
                f"--resume-stopped --overwrite --done {self.done_marker(run_id)} --journal {self.journal(run_id)}")

    def gradcheck_grid(self) -> dict[str, list]:
        """What every gradcheck job of the sweep replays: the AGG grid's ``windows``, ``alphas``, ``route_fracs``
        and ``reuse`` (the sweep's ``gradcheck`` lists, these defaults where it has none) and its ``methods``."""
        part = self.sweep.get("gradcheck") or {}
        return {"windows": part.get("windows", [2, 3, 5]), "alphas": part.get("alphas", ["index", "sigma"]),
                "route_fracs": part.get("route_fracs", [0, 0.5, 1]), "reuse": part.get("reuse", [False]),
                "methods": part.get("methods", [])}

    def gradcheck_command(self, name: str) -> str:
        job, grid = self.gradchecks[name], self.gradcheck_grid()
        lists = {"--windows": grid["windows"], "--alphas": grid["alphas"], "--route-fracs": grid["route_fracs"],
                 "--reuse": grid["reuse"]}
        args = " ".join(f"{flag} {shlex.quote(','.join(json.dumps(v) if not isinstance(v, str) else v for v in values))}"
                        for flag, values in lists.items())
        methods = " ".join(f"--methods {shlex.quote(m)}" for m in grid["methods"])
        return (f"{self.launch(job['device'], 'gradcheck', self.tool_gpus(job['device']))} "
                f"{self._config_args(job['pairs'])} {args} {methods} "
                f"--out results/gradcheck/{name}.csv")

    def calibrate_command(self, name: str) -> str:
        job, part = self.calibrations[name], self.sweep.get("calibrate") or {}
        timed = bool(part.get("time_methods", True) and job["methods"])  # method_repeats: the rounds of these only
        options = " ".join(f"--{key.replace('_', '-')} {int(part[key])}"
                           for key in ("repeats", "warmup", "method_repeats")
                           if key in part and (timed or key != "method_repeats"))
        if timed:
            options += "".join(f" --method {shlex.quote(label)} {shlex.quote(yaml_text(self.sweep['methods'][label]))}"
                               for label in job["methods"])
        # on the GPUs of the cell's runs: a sharded model needs them all, and the times include the
        # collectives its runs pay; unit costs are per sample on each process
        return (f"{self.launch(job['device'], 'calibrate')} "
                f"{self._config_args(job['pairs'])} {options} --out results/calibration/{name}.json")

    def embed_command(self, model: str) -> str:
        job = self.embeddings[model]
        return (f"{self.launch(job['device'], 'embed', self.tool_gpus(job['device']))} "
                f"{self._config_args(job['pairs'])} --out {EMBED_DIR}/{model}.safetensors")

    def import_command(self, label: str) -> str:
        ref = self.references[label]
        args = [f"--method {shlex.quote(ref.get('method', 'full'))}"]
        for key, flag in (("model", "--model"), ("resolution", "--resolution"), ("gpu_name", "--gpu-name"),
                          ("n_gpus", "--n-gpus")):
            if key in ref:
                args.append(f"{flag} {shlex.quote(str(ref[key]))}")
        return (f"{PYTHON} -m agg_bench import-log {shlex.quote(ref['log'])} {' '.join(args)} "
                f"--out results/imported/{label}")

    # ----- files --------------------------------------------------------------------------------
    def inputs(self, *jobs: dict) -> list[str]:
        """Files that ``jobs`` (runs, a cell's runs, a gradcheck or a calibration, of one model) read: the base
        config, the model's embeddings, and each model folder under results/pretrained/ that their composed
        configs name (made by rule pretrain)."""
        files = [self.base_file] if self.base_file else []
        model = jobs[0]["model"]
        if model in self.embed_models:
            files.append(f"{EMBED_DIR}/{model}.safetensors")
        for job in jobs:
            if is_pretrained_here(job["pretrained"]) and job["pretrained"] not in files:
                files.append(job["pretrained"])
        return files

    def summaries(self) -> list[str]:
        """What the manifest waits for: every run's marker (:meth:`done_marker`) and every imported summary."""
        return [self.done_marker(r) for r in self.runs] + \
            [f"results/imported/{label}/summary.json" for label in self.references]

    def gradcheck_files(self) -> list[str]:
        return [f"results/gradcheck/{name}.csv" for name in self.gradchecks]

    def calibration_files(self) -> list[str]:
        return [f"results/calibration/{name}.json" for name in self.calibrations]

    def manifest(self) -> dict:
        """What `agg-bench report --manifest` reads: every run folder with its labels."""
        runs = [{"dir": f"results/runs/{run_id}", "method": r["method"], "model": r["model"],
                 "resolution": r["resolution"], "seed": r["seed"], "device": r["device"],
                 "method_options": r["method_options"]} for run_id, r in self.runs.items()]
        runs += [{"dir": f"results/imported/{label}", "method": label,
                  "model": ref.get("model"), "resolution": ref.get("resolution")}
                 for label, ref in self.references.items()]
        checks = [{"file": f"results/gradcheck/{name}.csv", "model": g["model"], "resolution": g["resolution"]}
                  for name, g in self.gradchecks.items()]
        calibration = [{"file": f"results/calibration/{name}.json", "model": c["model"], "resolution": c["resolution"],
                        "device": c["device"]} for name, c in self.calibrations.items()]
        options = self.sweep.get("report") or {}
        for folder in options.get("compare_with", []):  # committed reference runs, shown beside these
            reference = reference_manifest(folder)
            runs += reference["runs"]
            calibration += reference["calibration"]
        return {"runs": runs, "gradcheck": checks, "calibration": calibration,
                "warmup": options.get("warmup_iterations", 1), "time": options.get("time", "auto")}


def reference_manifest(folder: str, key: str = "report.compare_with") -> dict[str, list]:
    """The runs and calibrations of the reference folder ``folder`` (its ``manifest.json``, which ``agg-bench
    campaign unpack`` writes), each marked ``source: reference``; a SweepError naming ``key`` (the sweep's entry
    that names ``folder``) when it has none or one that is not a reference manifest, or when ``folder`` names
    nothing this user can use (:func:`check_sweep_path`)."""
    check_sweep_path(key, folder, "a reference folder", file=False)
    path = Path(folder) / "manifest.json"
    try:  # an unpack into it under way or cut off: its manifest may not be its tables' or list all its runs
        check_no_unpack(Path(folder), f"{key}: {path}")
    except UserError as err:
        raise SweepError(str(err)) from None
    if not path.is_file():
        raise SweepError(f"{key}: {quote(folder)} has no manifest.json (a reference folder that "
                         "agg-bench campaign unpack wrote, e.g. results/reference/h200)")
    try:
        data = read_json_object(path, "a reference manifest")
    except UserError as err:
        raise SweepError(f"{key}: {err}") from None
    out = {}
    for section in ("runs", "calibration"):
        entries = data.get(section, [])
        if not isinstance(entries, list) or not all(isinstance(e, dict) for e in entries):
            raise SweepError(f"{key}: {shown(path)}: {section} is not a list of objects")
        out[section] = [{**entry, "source": "reference"} for entry in entries]
    return out


def failed_runs(folders: list[str]) -> list[tuple[str, str]]:
    """The run folders among ``folders`` whose ``summary.json`` says ``status: error``, each with its error:
    runs a cell job recorded as failed (``agg-bench cell --keep-going``) instead of failing the job."""
    failed = []
    for folder in folders:
        try:  # a regular file's only: a named pipe there waited for ever, a device was read until memory ran out
            summary = read_json_object(Path(folder) / "summary.json", "a run's summary")
        except JsonFileError:
            continue
        if summary.get("status") == "error":
            failed.append((folder, str(summary.get("error"))))
    return failed


def report_failed_runs(failed: list[tuple[str, str]], logs: dict[str, str],
                       markers: dict[str, str] | None = None) -> str:
    """Remove the ``summary.json`` of each failed run and its cell job's marker (``markers``: run folder ->
    marker; the job's output is then missing, so the next invocation reruns the cell, which keeps the runs
    that ended and reruns this one; the run's other files stay) and say so in one line that names each run,
    its error (at most 200 characters) and its log (``logs``: run folder -> log file)."""
    for folder, _ in failed:
        (Path(folder) / "summary.json").unlink(missing_ok=True)
        if markers and markers.get(folder):
            Path(markers[folder]).unlink(missing_ok=True)
    runs = "; ".join(f"{folder}: {clip(error)} (log: {logs.get(folder, 'its job log')})" for folder, error in failed)
    return (f"{len(failed)} run{'s' if len(failed) > 1 else ''} of this sweep failed, and the tables wait for "
            f"{'them' if len(failed) > 1 else 'it'}: {runs}. The other runs' files are kept; the next snakemake "
            "reruns the failed runs' cells.")


if __name__ == "__main__":
    sys.exit(_main())
