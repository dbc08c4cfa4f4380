"""One reader for a run folder: every verb that reads what a run wrote goes through :class:`RunFolder`, so
each file is checked once and the same way, before anything is computed from it or written.

- ``config.json``: a JSON object of at most :data:`agg_bench.jsonfiles.MAX_JSON_BYTES`, then the typed run
  config with its bounds (:func:`run_config`: :func:`agg_bench.config.validate`, the schema's types and
  limits, ``sampling.steps <= 1000`` among them), its ``method.name`` one of the harness's methods or a dotted
  path ``package.module:Class`` (:func:`agg_bench.config.sections.check_method_name`; a label is no method). A
  key an older ``config.json`` lacks takes its default. The method's options stay as written: reading a folder
  never imports a method, so a results folder never names code to load (a caller that builds the method checks
  them with :func:`agg_bench.runtime.config_check.check_config`).
- ``metrics.jsonl``: records by the record contract (:func:`agg_bench.records.records_problem`):
  every known key of its kind, numbers finite, ``iteration`` an integer >= 0, recorded once and increasing in file order, and
  ``iteration`` and ``status`` (:data:`~agg_bench.records.REQUIRED_RECORD_KEYS`, which every record a run or an
  import writes holds) and the keys the caller needs (``required``) present.
- ``summary.json``: the identity keys it repeats, by the same contract.
- The files together (:meth:`RunFolder.check_identity`): one run's identity (:data:`IDENTITY_KEYS`) in every
  record, the summary and what the caller reads of ``config.json``, and a summary of an ``ok`` end over ok
  records, as many as the iterations it names (unless its budget ended it).
- ``evaluations.jsonl``: ``iteration`` an integer >= 0, once each, ``eval_reward`` a finite number (the
  sub-scores and times finite numbers or null), and the starting weights' evaluation (iteration 0) among them.
- ``plan.json``: ``bytes`` an object of byte counts (finite numbers >= 0, or null).
- A manifest's entry of the run (:func:`check_entry_names_run`): its seed and its method's name those the run's
  files say, in the report's and the learning tables' manifests alike.

Every problem is a :class:`~agg_bench.errors.UserError` that names the file (and the record or key), quotes
at most 200 characters of the value and says what was expected. ``checkpoint.pt`` holds tensors, so torch
reads it (:func:`agg_bench.runtime.checkpoint.read_checkpoint`), and its config and records are checked by
:func:`run_config` and the record contract as these files are. This module is part of the contract, a basic
beside the record contract (:mod:`agg_bench.records`): the runtime checks a folder it resumes or replaces
with it, and the results readers read run folders with it; it imports no torch.
"""
from __future__ import annotations

import os
import re
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Iterator, Literal, Mapping, overload

from .errors import UserError, counted, quote, shown
from .io import read_jsonl
from .jsonfiles import read_json_object
from .outdir import check_not_written, is_harness_name
from .records import (EVALUATIONS_FILE, MAX_MAGNITUDE, REQUIRED_RECORD_KEYS, STATUSES, is_finite_number,
                      is_recordable_number, record_problem, records_problem)

if TYPE_CHECKING:
    from .config import RunConfig

CONFIG_FILE = "config.json"
METRICS_FILE = "metrics.jsonl"
SUMMARY_FILE = "summary.json"
PLAN_FILE = "plan.json"
ENV_FILE = "env.json"
# The identity keys every record and the summary of one run repeat, each the same in all of them: agg-bench run
# takes them from its config (agg_bench.runtime.session.identity; none may change when a run is resumed, as the
# hardware may not: runfolder.check_resumed_records), import-log from its flags.
IDENTITY_KEYS = ("run_id", "method", "model", "resolution", "seed", "weights")


def run_config(data: Any, where: str | Path) -> RunConfig:
    """The run config ``data`` (a ``config.json``'s or a checkpoint's) checked and typed as ``agg-bench
    run`` loads a config (:func:`agg_bench.config.validate`); a UserError naming ``where`` otherwise."""
    from .config import upgrade_written, validate
    from .config.sections import check_method_name

    if not isinstance(data, dict):
        raise UserError(f"{where}: holds {quote(data)}; expected a run config (a JSON object)")
    try:  # values an older run wrote read as the keys they stand for today (grpo.adv_std: population)
        cfg = validate(upgrade_written(data))
        # a run ran one of the harness's methods: a name of none (a sweep's label written there) is no run's
        check_method_name(cfg.method.name)
        return cfg
    except UserError as err:
        raise UserError(f"{where}: {err}") from None


# the keys of an evaluation's line besides ``iteration``: its scores (``eval_reward``, the reward's sub-scores
# ``eval_reward_<name>``) and its times
EVALUATION_KEY = re.compile(r"eval_[a-z][a-z0-9_]{0,63}")
EVALUATION_TIMES = ("t_eval_s", "t_eval_cpu_s")


def evaluations_problem(lines: list[dict]) -> str | None:
    """What is wrong with a run's held-out evaluations (``evaluations.jsonl``); None when nothing is. A line's keys
    are those a run writes (:data:`EVALUATION_KEY`, :data:`EVALUATION_TIMES`); its sub-scores (``eval_<name>``) and
    times (``t_eval_s``, ``t_eval_cpu_s``), which the learning tables average, are finite numbers of magnitude at
    most :data:`~agg_bench.records.MAX_MAGNITUDE` (what a run writes: a larger mean ends it,
    :func:`agg_bench.runtime.evaluation.non_finite_key`; the tables' means of larger ones overflow) or null."""
    seen = set()
    for k, line in enumerate(lines, 1):
        iteration, reward = line.get("iteration"), line.get("eval_reward")
        if type(iteration) is not int or iteration < 0 or not is_recordable_number(reward):
            return (f"line {k}: expected an iteration (an integer >= 0) and an eval_reward (a finite number, at "
                    f"most {MAX_MAGNITUDE:g} in magnitude), not {quote(line)}")
        for key, value in line.items():
            # a sub-score's key names columns of learning.csv and learning.md: text a run never writes there (a
            # newline, an escape sequence) is no key of a run's evaluation
            if key not in EVALUATION_TIMES and key != "iteration" and not EVALUATION_KEY.fullmatch(key):
                return (f"line {k}: key {quote(key)}: expected iteration, {', '.join(EVALUATION_TIMES)} or "
                        "eval_<score> (lower-case letters, digits and _, at most 64 characters)")
            if key.startswith(("eval_", "t_eval_")) and value is not None and not is_recordable_number(value):
                return (f"line {k}: {key} = {quote(value)}: expected a finite number or null (at most "
                        f"{MAX_MAGNITUDE:g} in magnitude)")
        if iteration in seen:
            return f"line {k}: iteration {iteration} is evaluated twice"
        seen.add(iteration)
    if lines and 0 not in seen:  # every gain and target is measured from it
        return "no evaluation of the starting weights (iteration 0)"
    return None


def identity_mismatch(expected: Mapping[str, Any], named: Iterable[tuple[str, Mapping]]) -> tuple[str, str, Any] | None:
    """The first ``(what, key, value)`` where a record or summary of ``named`` (``(what, record)`` pairs) holds
    another value of a key of ``expected`` than ``expected`` does (a key it lacks: null); None when none does.
    The one comparison of a run's files with the identity they should share: the report's
    (:meth:`RunFolder.check_identity`) and a campaign unpack's (against the run its sweep composes)."""
    for what, record in named:
        for key, value in expected.items():
            if record.get(key) != value:
                return what, key, record.get(key)
    return None


FolderState = list[tuple[str, int, int, int]]  # each file's name, inode, size and modification time


class RunFolder:
    """The files of one run folder ``dir``, each read and checked when asked for (module docstring)."""

    def __init__(self, path: str | Path):
        self.dir = Path(path)

    def path(self, name: str) -> Path:
        return self.dir / name

    def _state(self) -> FolderState:
        """Each file of the folder (the harness's temporaries and locks aside) by name, inode, size and
        modification time: what any write of a run changes (a rename, an append)."""
        try:
            entries = list(os.scandir(self.dir))
        except OSError:  # not a folder: each file's reader says what is wrong
            return []
        state = []
        for entry in entries:
            if is_harness_name(entry.name):
                continue
            try:
                st = entry.stat(follow_symlinks=False)
            except OSError:  # gone meanwhile: a change the second look sees
                continue
            state.append((entry.name, st.st_ino, st.st_size, st.st_mtime_ns))
        return sorted(state)

    def _check_not_written(self) -> None:
        """A :class:`~agg_bench.outdir.Busy` when another process holds the folder's claim: a run's lock lies
        inside it, an import's beside it (``import-log`` replaces the folder whole)."""
        check_not_written(self.dir, "run")
        check_not_written(self.dir, "run", lock_inside=False)

    @contextmanager
    def whole(self, since: FolderState | None = None) -> Iterator[FolderState]:
        """A block whose reads of the folder see one state of it, written by one attempt, which it yields:
        refused with a :class:`~agg_bench.outdir.Busy` when another process holds the folder's claim before or
        after it (a run writing, resuming or replacing it, or an import replacing it, whose files are meanwhile
        part old, part new), and with a UserError when its files changed while the block read them (a writer
        that came and went), or since an earlier block yielded ``since`` (a later read, such as a checkpoint's,
        of the attempt whose records that block read). A reader of a run it does not claim itself uses it; a
        run's own reads of its folder, under its claim, do not."""
        self._check_not_written()
        before = self._state()
        if since is not None and before != since:
            raise self._changed("since its records were read")
        yield before
        self._check_not_written()
        if self._state() != before:
            raise self._changed("while they were read")

    def _changed(self, when: str) -> UserError:
        return UserError(f"run {shown(self.dir)}: its files changed {when} (another agg-bench process wrote it); read it "
                         "again once that process has ended")

    def has(self, name: str) -> bool:
        return self.path(name).exists()

    def _object(self, name: str, expected: str) -> dict:
        """The JSON object of file ``name`` ({} when the run did not write it)."""
        path = self.path(name)
        return read_json_object(path, expected) if path.exists() else {}

    def config_object(self) -> dict:
        """``config.json`` as the JSON object it holds (bounded in size, not yet typed): what a rerun compares
        with its own config to tell whether the folder holds the same run. A UserError if it is not one."""
        return read_json_object(self.path(CONFIG_FILE), "the run config of an agg-bench run (a JSON object)")

    @overload
    def config(self, required: Literal[True] = True) -> RunConfig: ...

    @overload
    def config(self, required: bool) -> RunConfig | None: ...

    def config(self, required: bool = True) -> RunConfig | None:
        """``config.json`` as the typed run config (:func:`run_config`); None when there is none and it is
        not ``required`` (else a UserError naming the folder)."""
        path = self.path(CONFIG_FILE)
        if not path.exists():
            if required:
                raise UserError(f"run {shown(self.dir)}: no {CONFIG_FILE} (every run folder holds its run config)")
            return None
        return run_config(self.config_object(), path)

    def records(self, required: tuple[str, ...] = ()) -> list[dict]:
        """The metric records of ``metrics.jsonl`` in file order ([] when there is none), each by the record
        contract with :data:`~agg_bench.records.REQUIRED_RECORD_KEYS` and the keys of ``required`` present."""
        path = self.path(METRICS_FILE)
        if not path.exists():
            return []
        records = list(read_jsonl(path))
        problem = records_problem(records, tuple(dict.fromkeys((*REQUIRED_RECORD_KEYS, *required))))
        if problem is not None:
            raise UserError(f"{shown(path)}: {problem}")
        return records

    def check_records_ended(self, summary: dict, records: list[dict]) -> None:
        """A UserError when the run ended (``summary``, from :meth:`summary`) with a last good iteration that
        ``records`` lacks as an ok record: a ``metrics.jsonl`` cut, emptied or removed after the run wrote its
        summary, which its last record precedes (the torn line a killed writer leaves is no run's last), the missing
        file named as such."""
        last_good = summary.get("last_good_iteration")
        if last_good is None:
            return
        if type(last_good) is not int or last_good < 0:
            raise UserError(f"{shown(self.path(SUMMARY_FILE))}: 'last_good_iteration' = {quote(last_good)}: expected "
                            "an integer >= 0 or null")
        if not self.has(METRICS_FILE):
            raise UserError(f"{shown(self.path(METRICS_FILE))}: no such file, where {SUMMARY_FILE} names iteration "
                            f"{last_good} as the last good one; expected the records the run wrote (the file was "
                            "removed)")
        if not any(r.get("iteration") == last_good and r.get("status") == "ok" for r in records):
            raise UserError(f"{shown(self.path(METRICS_FILE))}: no ok record of iteration {last_good}, the last good "
                            f"one {SUMMARY_FILE} names ({counted(len(records), 'record')}); expected the records the "
                            "run wrote (the file is cut or was edited)")

    def check_identity(self, summary: dict, records: list[dict], config: Mapping[str, Any] | None = None) -> None:
        """A UserError naming the folder, the file, the key and both values where the run's files contradict each
        other: a record or ``summary`` (from :meth:`summary`) holding another value of an identity key
        (:data:`IDENTITY_KEYS`) than ``config`` (the identity ``config.json`` gives, as the caller reads it; None:
        none), else the first record, else the summary (a key a file lacks is not compared); a record not ok
        before the last (an iteration out of memory or diverged ends a run); a summary of an ``ok`` end over a record that is not ok, or over another
        number of records than its ``iterations`` where its budget did not end it (an import's summary counts its
        records). A summary of another end may follow ok records: a run stopped, failed, or out of memory in an
        evaluation or while resuming."""
        sources: list[tuple[str, Mapping]] = [*((f"{METRICS_FILE} record {k}", r) for k, r in enumerate(records, 1)),
                                              *([(SUMMARY_FILE, summary)] if summary else [])]
        expected: dict[str, Any] = {}
        owner: dict[str, str] = {}
        for what, values in [(CONFIG_FILE, config or {}), *sources[:1], *sources[-1:]]:
            for key in IDENTITY_KEYS:
                if key not in expected and key in values:
                    expected[key], owner[key] = values[key], what
        # a key a file does not write names no other run (a summary of an older run, a hand-made fixture)
        found = identity_mismatch(expected, [(what, {**expected, **values}) for what, values in sources])
        if found is not None:
            what, key, value = found
            raise UserError(f"run {shown(self.dir)}: {what}: {key} = {quote(value)}, where {owner[key]} has "
                            f"{quote(expected[key])}; expected one run's identity in all its files")
        statuses = [r.get("status") for r in records]
        ended = next((k for k, status in enumerate(statuses[:-1], 1) if status != "ok"), None)
        if ended is not None:
            raise UserError(f"run {shown(self.dir)}: {METRICS_FILE} record {ended}: status = "
                            f"{quote(statuses[ended - 1])}, followed by record {ended + 1}; expected an iteration "
                            "that ends the run as its last record")
        if summary.get("status") != "ok" or not records:
            return
        if statuses[-1] != "ok":
            raise UserError(f"run {shown(self.dir)}: {SUMMARY_FILE}: status = 'ok', where {METRICS_FILE} record "
                            f"{len(records)} has {quote(statuses[-1])}; expected the end its last record says")
        iterations = summary.get("iterations")
        if type(iterations) is int and not summary.get("budget_reached") and iterations != len(records):
            raise UserError(f"run {shown(self.dir)}: {SUMMARY_FILE}: iterations = {iterations}, where {METRICS_FILE} "
                            f"holds {counted(len(records), 'record')}; expected a run that ended ok to have recorded "
                            "each of its iterations")

    def summary(self) -> dict:
        """``summary.json`` ({} when the run has not ended), its identity keys by the record contract. A summary
        without a ``status`` is none an agg-bench run wrote (every attempt's ends with one): a folder of someone
        else's ``summary.json`` was read as an interrupted run."""
        summary = self._object(SUMMARY_FILE, f"the {SUMMARY_FILE} of an agg-bench run (a JSON object)")
        if self.path(SUMMARY_FILE).exists() and summary.get("status") is None:
            raise UserError(f"{shown(self.path(SUMMARY_FILE))}: no 'status'; expected the {SUMMARY_FILE} of an "
                            f"agg-bench run, whose status is one of {', '.join(STATUSES)}")
        problem = record_problem(summary)
        if problem is not None:
            raise UserError(f"{shown(self.path(SUMMARY_FILE))}: {problem}")
        return summary

    def env(self) -> dict:
        """``env.json`` ({} when there is none): the machine and the code the run ran on."""
        return self._object(ENV_FILE, f"the {ENV_FILE} of an agg-bench run (a JSON object)")

    def plan(self) -> dict:
        """The planned bytes of ``plan.json`` ({} when there is none)."""
        plan = self._object(PLAN_FILE, f"the {PLAN_FILE} of an agg-bench run (a JSON object)")
        value = plan.get("bytes")
        if value is not None and not isinstance(value, dict):
            raise UserError(f"{shown(self.path(PLAN_FILE))}: bytes = {quote(value)}: expected an object or null")
        for key, n in (value or {}).items():
            if n is not None and not (is_finite_number(n) and n >= 0):
                raise UserError(f"{shown(self.path(PLAN_FILE))}: bytes.{key} = {quote(n)}: expected a number of bytes "
                                "(a finite number >= 0) or null")
        return value or {}

    def evaluations(self) -> list[dict] | None:
        """The held-out evaluations of ``evaluations.jsonl`` in file order; None when the run has none (a folder
        or a device at that path is refused, as at every file of the folder)."""
        path = self.path(EVALUATIONS_FILE)
        if not path.exists():
            return None
        lines = list(read_jsonl(path))
        problem = evaluations_problem(lines)
        if problem is not None:
            raise UserError(f"{shown(path)}: {problem}")
        return lines or None


def check_entry_names_run(where: str, entry: dict, folder: RunFolder, lines: list[dict], summary: dict,
                          config: dict | None) -> None:
    """A UserError naming the file and the key where the run ``folder`` says another seed than the manifest entry's
    ``seed``, or another method than the entry's ``method_options.name`` (the sweep's manifest gives both; the
    ``method`` label is the sweep's own name of a setting): its records (``lines``), ``summary`` and ``config.json``
    (``config``, the JSON object; None: none), where they say. A copied run folder listed under another seed
    counted as one more seed of its method. The check of a manifest's entry of both readers of manifests, the
    learning tables' and the report's."""
    places = [(f"{folder.path(METRICS_FILE)}: record {k}", record) for k, record in enumerate(lines, 1)]
    places.append((str(folder.path(SUMMARY_FILE)), summary))
    if config is not None:
        method = config.get("method")
        places.append((str(folder.path(CONFIG_FILE)), {"seed": config.get("seed"),
                                                        "method": method.get("name") if isinstance(method, dict) else None}))
    options = entry.get("method_options")
    wanted = {"seed": entry.get("seed"), "method": options.get("name") if isinstance(options, dict) else None}
    for key, entry_key in (("seed", "seed"), ("method", "method_options.name")):
        for place, values in places if wanted[key] is not None else ():
            if values.get(key) is not None and values.get(key) != wanted[key]:
                raise UserError(f"{where}: {entry_key} = {quote(wanted[key])}, but {place} has {key} = "
                                f"{quote(values.get(key))}; expected the manifest entry of the run in its folder (a "
                                "copied run folder counts as another seed)")
