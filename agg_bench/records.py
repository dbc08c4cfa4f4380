"""Names shared by the code that writes results and the code that reads them: every metric record key
(and :func:`new_record`, the one builder of a record), timing keys, gradcheck option columns, and the
names of the tables and plots.

This module imports nothing but the standard library and :mod:`agg_bench.errors`, so that reading
results (``report``, ``import-log``, the workflow's table and plot jobs) never has to import torch or the
training engine just to know what a record holds.
"""
from __future__ import annotations

import math
import numbers
import unicodedata
from typing import Any, Mapping, TypeGuard

from .errors import quote

# Training phases timed in every iteration (``t_{phase}_s``, ``t_{phase}_cpu_s``).
STANDARD_PHASES = ("rollout", "reward", "train")

# Fields ``telemetry.Telemetry.record()`` returns for one iteration, in this order.
TELEMETRY_KEYS = (
    "t_rollout_s",
    "t_reward_s",
    "t_train_s",
    "t_iter_s",
    "t_rollout_cpu_s",
    "t_reward_cpu_s",
    "t_train_cpu_s",
    "t_iter_cpu_s",
    "peak_alloc_bytes",
    "peak_reserved_bytes",
    "nvml_peak_used_bytes",
    "saved_activation_peak_bytes",
    "rss_peak_bytes",
    "energy_j",
    "gpu_util_mean",
    "power_mean_w",
)

# Every key of a metric record (one line of ``metrics.jsonl``), in the order a run writes them: the run's
# identity, learning, time, work (the counted passes and ``cost``, the run's cumulative cost in units of
# ``train.pass_costs`` up to and including this iteration: :func:`passes_cost`), memory, energy, status, the
# weights label (tiny, random, pretrained) and NVML's means over the iteration. Every record holds every key (:func:`new_record`; null: not measured),
# TELEMETRY_KEYS included; a method adds its own fields after them.
RECORD_KEYS = (
    "run_id", "method", "model", "resolution", "device", "gpu_name", "n_gpus", "seed", "iteration",
    "reward_mean", "reward_std", "loss", "grad_norm", "clip_frac", "approx_kl",
    "t_rollout_s", "t_reward_s", "t_train_s", "t_iter_s", "images_per_s",
    "t_rollout_cpu_s", "t_reward_cpu_s", "t_train_cpu_s", "t_iter_cpu_s",
    "forward_nograd", "forward_grad", "backward", "train_forward_nograd", "train_forward_grad", "train_backward",
    "cost", "peak_alloc_bytes", "peak_reserved_bytes", "nvml_peak_used_bytes", "saved_activation_peak_bytes",
    "rss_peak_bytes", "energy_j", "status", "weights", "gpu_util_mean", "power_mean_w",
)
# The keys every record holds a value of: a run writes both in every record (:func:`new_record`'s callers), an
# import too (``agg-bench import-log``); a reader of a run folder requires them (a record without them was read as
# an iteration of no number, or of no status, by the report)
REQUIRED_RECORD_KEYS = ("iteration", "status")
MAX_LABEL = 200  # characters of a method, model, GPU or run label: a row of the report's tables


def is_label(value: Any) -> bool:
    """``value`` is a label a table row can show: a string of 1 to :data:`MAX_LABEL` printable characters (no
    control or format character: :func:`unprintable_words` names one in a refusal)."""
    return isinstance(value, str) and 0 < len(value) <= MAX_LABEL and value.isprintable()


def character_words(text: str, index: int) -> str:
    """Character ``index`` of ``text`` for a message: its code point, name and Unicode category, and where it is
    (``U+202E RIGHT-TO-LEFT OVERRIDE (category Cf) at character 2``), never the character itself, which may
    reorder or hide the line that shows it."""
    char = text[index]
    name = unicodedata.name(char, "")
    return f"U+{ord(char):04X}{' ' + name if name else ''} (category {unicodedata.category(char)}) at character {index + 1}"


def unprintable_words(value: Any) -> str:
    """For a message refusing ``value`` as a label (:func:`is_label`): where a string ``value`` holds a character
    that is not printable (a control character; a format character, Unicode category Cf, such as a bidi override
    U+202E or a zero-width space U+200B, which make a shown label read differently from its bytes; a separator
    but the space), ``"; it holds "`` and :func:`character_words` of the first; ``""`` otherwise."""
    if not isinstance(value, str) or value.isprintable():
        return ""
    return "; it holds " + character_words(value, next(i for i, char in enumerate(value) if not char.isprintable()))


def is_utf8_text(value: str) -> bool:
    """``value`` can be written as UTF-8: no lone surrogate, which a JSON string can hold as an escape
    (``"\\udcff"``) and a UTF-8 writer refuses (UnicodeEncodeError)."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


# On a CUDA device a record also holds, for each phase that ran (``rollout``, ``reward``: the VAE decode and the
# reward model, ``train``: the backward passes and the optimizer step, and any other), the peak bytes the CUDA
# allocator allocated within it: this key with the phase's name. ``peak_alloc_bytes`` is the largest of them and
# of the stretches between them; the memory planner's phases (``agg-bench plan``: the activations and the
# optimizer step in the train phase, the decode in the reward phase) are measured against these. Off CUDA a
# record has none of them.
PHASE_PEAK_KEY = "peak_alloc_{phase}_bytes"
# Those of the standard phases, which the efficiency table shows (``peak_<phase>_mib``); a number or null where
# a record has one.
PHASE_PEAK_KEYS = tuple(PHASE_PEAK_KEY.format(phase=phase) for phase in STANDARD_PHASES)
# The key only an imported record holds (``agg-bench import-log``: "imported"); a run's records, without
# it, are "measured".
IMPORTED_KEYS = ("source",)

# Record keys that hold text; every other key of RECORD_KEYS holds a number. Any of them may be null (not
# measured).
TEXT_KEYS = ("run_id", "method", "model", "device", "gpu_name", "status", "weights", *IMPORTED_KEYS)
NUMBER_KEYS = tuple(key for key in RECORD_KEYS if key not in TEXT_KEYS)
# what a record's or a summary's ``status`` says: the iteration (or the run) ended ok, out of memory, diverged,
# stopped by a signal before its end, or failed
STATUSES = ("ok", "oom", "diverged", "interrupted", "error")
# The record numbers whose non-finite value means the run diverged (agg-bench run ends there; import-log ends an
# imported log there), in the order the reason names the first
DIVERGING_KEYS = ("reward_mean", "loss", "grad_norm")
# A method's own record key that the report reads: the optimizer steps an update took, where the method's steps
# are not the config's count (``Estimator.records_optimizer_steps``); absent from the other methods' records.
OPTIMIZER_STEPS_KEY = "optimizer_steps"
MAX_OPTIMIZER_STEPS = 10**9
# Record numbers that may be negative: rewards, losses and the KL estimate; every other number of a record (a
# time, pass count, cost, size, energy, rate, norm, spread, fraction, seed or count of GPUs) is >= 0.
SIGNED_KEYS = ("reward_mean", "loss", "approx_kl")
# A record's image side and GPUs, as an imported log may name them too (agg-bench run's own are narrower).
MAX_RESOLUTION = 16384
MAX_GPUS = 65536
INTEGER_RANGES = {"resolution": (1, MAX_RESOLUTION), "n_gpus": (0, MAX_GPUS)}
# A record's numbers are at most this in magnitude: far past any measurement (a time, size, cost or reward), and
# what readers compute from a run's numbers stays finite (a cumulative time, a plot's axis span): 1e308, finite
# as JSON reads it, gave an infinite wall-clock sum and ended the report's plots in a matplotlib traceback.
MAX_MAGNITUDE = 1e300


def new_record(*fields: Mapping, **more) -> dict:
    """A metric record: every key of RECORD_KEYS, in order, null unless ``fields`` (mappings, applied in
    order) or ``more`` give it a value; their other keys (a method's own, an imported record's ``source``)
    follow."""
    record = dict.fromkeys(RECORD_KEYS)
    for values in fields:
        record.update(values)
    record.update(more)
    return record


def is_integer(value: object) -> TypeGuard[int]:
    """``value`` is an int and not true or false: the one test of an integer, in a config or a file (a
    whole-number float such as ``2.0`` is not one; JSON Schema's ``integer`` would take it)."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_finite_number(value: object) -> TypeGuard[int | float]:
    """``value`` is a number (not true or false; numpy's numbers included) that is finite as a float: NaN, an
    infinity and an integer past a float's range (10**400, which JSON reads) are not. The one test of a
    number read from a file: records, plans, evaluations, calibrations, tables, imported logs."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def is_recordable_number(value: object) -> bool:
    """``value`` is a number a record can hold: :func:`is_finite_number` and at most :data:`MAX_MAGNITUDE` in
    magnitude. The one test of a run's own numbers before they are written (an iteration's loss, an
    evaluation's mean): one that fails it is a divergence, written as null. Compared as a Python float: numpy's
    float32 compared with the bound cast the bound to float32 (an overflow warning, and infinity)."""
    return is_finite_number(value) and abs(float(value)) <= MAX_MAGNITUDE


def record_problem(record: dict, required: tuple[str, ...] = ()) -> str | None:
    """What is wrong with a metric record (or a run summary, which repeats its identity keys): a key of
    ``required`` missing or null, or the first known key holding the wrong kind of value, e.g. ``'t_iter_s' =
    'fast': expected a finite number or null``; None when nothing is. A number is finite (a run writes a
    non-finite value as null), at most :data:`MAX_MAGNITUDE` in magnitude and >= 0 but for :data:`SIGNED_KEYS`,
    ``resolution`` and ``n_gpus`` integers in :data:`INTEGER_RANGES`, text printable (a label a table row shows),
    ``status`` one of :data:`STATUSES`, ``iteration`` an integer >= 0 and ``optimizer_steps``, where a method records it, a count the report prices. The other keys a method adds are
    its own business, but for the standard phases' CUDA peaks (:data:`PHASE_PEAK_KEYS`), which the tables read as
    numbers."""
    for key in required:
        if record.get(key) is None:
            return f"no {key!r} (expected in every record)"
    get = record.get
    for key in CHECKED_KEYS:
        value = get(key)
        if value is None:
            continue
        kind = type(value)
        # what almost every value is, taken at a glance: a plain float or int within its key's bounds, ASCII text
        if kind is float or kind is int:
            bounds = _PLAIN_BOUNDS.get(key)
            if bounds is not None and bounds[0] <= value <= bounds[1] and (kind is int or key not in _INTEGER_KEYS):
                continue
        elif kind is str and key in TEXT_KEYS and value.isascii() and value.isprintable() and \
                (key != "status" or value in STATUSES):
            continue
        problem = _value_problem(key, value)
        if problem is not None:
            return problem
    steps = record.get(OPTIMIZER_STEPS_KEY)
    if steps is not None and (not is_integer(steps) or not 0 <= steps <= MAX_OPTIMIZER_STEPS):
        return (f"{OPTIMIZER_STEPS_KEY!r} = {quote(steps)}: expected an integer from 0 to "
                f"{MAX_OPTIMIZER_STEPS:,} or null")
    return None


# the keys :func:`record_problem` checks the values of, in the order it checks them
CHECKED_KEYS = (*TEXT_KEYS, *NUMBER_KEYS, *PHASE_PEAK_KEYS)
# the number keys that hold integers: ``iteration`` (>= 0) and those of :data:`INTEGER_RANGES`
_INTEGER_KEYS = ("iteration", *INTEGER_RANGES)
# the bounds within which a plain float or int of a number key passes every check of :func:`_value_problem` (a
# NaN compares false with both; a float of an integer key never does)
_PLAIN_BOUNDS = {key: INTEGER_RANGES.get(key, (-MAX_MAGNITUDE if key in SIGNED_KEYS else 0, MAX_MAGNITUDE))
                 for key in (*NUMBER_KEYS, *PHASE_PEAK_KEYS)}


def _expected(key: str, value: Any, allowed: str) -> str:
    """The refusal of ``value`` of ``key``: what the key allows (``allowed``), and null too but for the keys every
    record holds (:data:`REQUIRED_RECORD_KEYS`: ``iteration``, ``status``), the one place a refusal says so."""
    return f"{key!r} = {quote(value)}: expected {allowed}{'' if key in REQUIRED_RECORD_KEYS else ' or null'}"


def _value_problem(key: str, value: Any) -> str | None:
    """What is wrong with ``value`` (not null) of ``key`` by :func:`record_problem`'s rules; None when nothing is.
    Each refusal says what its key allows (:func:`_expected`)."""
    if key == "status":  # a run of another agg-bench, or an edited file
        return None if isinstance(value, str) and value in STATUSES else \
            _expected(key, value, f"one of {', '.join(STATUSES)}")
    if key == "iteration":
        if type(value) is not int or value < 0:
            return _expected(key, value, "an integer >= 0")
        return None if value <= MAX_MAGNITUDE else _expected(key, value, f"an integer >= 0, at most {MAX_MAGNITUDE:g}")
    if key in TEXT_KEYS and not isinstance(value, str):
        return _expected(key, value, "a string")
    if key in TEXT_KEYS and not is_utf8_text(value):  # a JSON escape of a lone surrogate: no table can write it
        return _expected(key, value, "UTF-8 text (no lone surrogate)")
    if key in TEXT_KEYS and not value.isprintable():  # a newline or a tab split a row of the Markdown tables
        return _expected(key, value, "printable text (no newline, tab or other control character)")
    if key in INTEGER_RANGES:
        low, high = INTEGER_RANGES[key]
        if type(value) is not int or not low <= value <= high:
            return _expected(key, value, f"an integer from {low} to {high:,}")
        return None
    if key not in TEXT_KEYS and not is_finite_number(value):
        return _expected(key, value, "a finite number")
    if key not in TEXT_KEYS and abs(float(value)) > MAX_MAGNITUDE:  # a float32's bound: no cast warning
        return _expected(key, value, f"a number of magnitude at most {MAX_MAGNITUDE:g}")
    if key not in (*TEXT_KEYS, *SIGNED_KEYS) and value < 0:
        return _expected(key, value, "a finite number >= 0")
    return None


def records_problem(records: list[dict], required: tuple[str, ...] = ()) -> str | None:
    """What is wrong with a run's records: the first record's :func:`record_problem` (``record k: ...``,
    counted from 1), or an iteration recorded twice or after a later one; None when nothing is. A run writes its
    records in iteration order (a resumed run rewrites the checkpoint's records, then appends the iterations after
    them) and an import in the order of its log's increasing steps, so the iterations of a run's records
    increase."""
    seen: dict[int, int] = {}
    last: tuple[int, int] | None = None  # the record number and iteration of the last record with one
    for k, record in enumerate(records, 1):
        problem = record_problem(record, required)
        if problem is not None:
            return f"record {k}: {problem}"
        iteration = record.get("iteration")
        if iteration is not None:
            if iteration in seen:
                return (f"record {k}: 'iteration' = {iteration}: expected each iteration once (record "
                        f"{seen[iteration]} has it)")
            if last is not None and iteration < last[1]:
                return (f"record {k}: 'iteration' = {iteration} after iteration {last[1]} (record {last[0]}): "
                        "expected the iterations in increasing order, as a run writes them")
            seen[iteration] = k
            last = (k, iteration)
    return None


# A run folder's held-out evaluations (``eval.every``): one JSON line per evaluated state, ``iteration`` (the
# iterations trained before it; 0: the starting weights), ``eval_reward``, ``eval_<sub-score>``, ``t_eval_s``
# and ``t_eval_cpu_s`` (agg_bench.runtime.train writes it, agg_bench.results.learning_tables reads it).
EVALUATIONS_FILE = "evaluations.jsonl"

# Record keys that depend on the machine's speed or load, not on the computation: two runs that
# compute the same thing may differ in these and nothing else.
TIMING_KEYS = ("t_rollout_s", "t_reward_s", "t_train_s", "t_iter_s", "images_per_s",
               "t_rollout_cpu_s", "t_reward_cpu_s", "t_train_cpu_s", "t_iter_cpu_s", "rss_peak_bytes",
               "peak_alloc_bytes", "peak_reserved_bytes", "nvml_peak_used_bytes", "energy_j",
               "gpu_util_mean", "power_mean_w", *PHASE_PEAK_KEYS)

# Seconds per phase in a record: wall clock (CUDA events on a GPU), and the process's CPU time.
PHASE_TIME_KEYS = tuple(f"t_{phase}_s" for phase in STANDARD_PHASES)
PHASE_CPU_KEYS = tuple(f"t_{phase}_cpu_s" for phase in STANDARD_PHASES)

# Counted passes of the policy network per iteration (``counters.PassCounter``, per sample), and
# those of the train phase alone (what the cost model of ``agg-bench calibrate`` prices).
PASS_KEYS = ("forward_nograd", "forward_grad", "backward")
TRAIN_PASS_KEYS = tuple(f"train_{key}" for key in PASS_KEYS)


def passes_cost(counts: Mapping[str, float], prices: Mapping[str, float]) -> float:
    """Cost units of the passes ``counts`` holds (a record's ``forward_nograd``, ``forward_grad`` and
    ``backward``, per sample) at ``prices`` (``train.pass_costs``): the sum of count x price over
    PASS_KEYS, in that order, so that the same counts always give the same float. The ``train_`` counts
    are shares of these and are not added again."""
    return sum(float(counts[key]) * float(prices[key]) for key in PASS_KEYS)


# The most replays one gradcheck makes (the full reference, every row of the AGG grid, every --methods item:
# tools.replays.check_replay_count). Each is a backward pass over the whole frozen rollout, about one training
# iteration's update, so a gradcheck of this many costs what a run of as many iterations spends on its updates:
# 4x the largest grid config/ holds (60 rows and its methods).
MAX_REPLAYS = 256
# Estimator options that get their own gradcheck column (whichever method has them).
GRADCHECK_OPTION_COLUMNS = ("window", "alpha", "route_frac", "reuse_rollout_velocity", "endpoint_velocity", "cache",
                            "cache_in")
# (method, option column) -> what that method's rows computed with in a gradcheck CSV written before the column
# existed: the option's default (AGG's endpoint_velocity, agg_bench.methods.agg.AGGConfig), which the report fills
# in, so that an older CSV's rows are the same setting as a newer CSV's, not a row of their own.
GRADCHECK_OPTION_DEFAULTS = {("agg", "endpoint_velocity"): "recompute"}

# Tables ``agg-bench report --tables DIR`` writes, each as ``DIR/<name>.<format>`` for every format of
# TABLE_FORMATS (HTML is what the Snakemake report shows in the page), besides ``DIR/records.csv``
# (every record with its labels).
TABLES = ("summary", "efficiency", "ablation", "gpus")
TABLE_FORMATS = ("csv", "md", "html")

# Plots ``agg-bench report --plots DIR`` writes, each as ``DIR/<name>.png``.
PLOTS = ("reward_iteration", "reward_wallclock", "memory_resolution", "time_breakdown", "time_resolution",
         "backward_passes", "cosine_cost", "gradcheck_cosine")
# The tables the plots are drawn from, read from the tables folder as ``DIR/<name>.csv``.
PLOT_TABLES = ("records", "efficiency", "ablation")


def table_files(directory: str = "results/tables", formats: tuple[str, ...] = TABLE_FORMATS) -> list[str]:
    """Every file of ``TABLES`` under ``directory`` in ``formats``."""
    return [f"{directory}/{name}.{ext}" for name in TABLES for ext in formats]


def plot_files(directory: str = "results/plots") -> list[str]:
    """Every file of ``PLOTS`` under ``directory``."""
    return [f"{directory}/{name}.png" for name in PLOTS]


def plot_table_files(directory: str = "results/tables") -> list[str]:
    """The files of ``PLOT_TABLES`` under ``directory``: what the plots read."""
    return [f"{directory}/{name}.csv" for name in PLOT_TABLES]
