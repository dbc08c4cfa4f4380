"""One GRPO training run into its run folder: :func:`train`, and the :class:`Training` loop it drives.

The session and one iteration live in :mod:`agg_bench.runtime.session`, the run folder's files and rules
in :mod:`agg_bench.runtime.runfolder`, checkpoints in :mod:`agg_bench.runtime.checkpoint`; the names
callers import from here (``Session``, ``run_iteration``, ``identity``, ``resolve_device``, ...) are
re-exported.
"""
from __future__ import annotations

import contextlib
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from tqdm import tqdm

from .. import stopping
from ..config import RunConfig
from ..errors import ConfigError, UserError, alike_on_every_process, counted, shown
from ..io import JsonlWriter, path_text, read_jsonl
from ..machine import distributed, fsdp
from ..machine import telemetry as tel
from ..machine.devices import resolve_device
from ..reading import METRICS_FILE, RunFolder
from ..records import DIVERGING_KEYS, RECORD_KEYS, TIMING_KEYS, is_recordable_number, new_record, passes_cost
from ..stopping import Interrupted
from . import runfolder, scalar_events
from .checkpoint import checkpoint_path, load_checkpoint, save_checkpoint
from .config_check import check_config

if TYPE_CHECKING:
    from torch.utils.hooks import RemovableHandle

    from .evaluation import Evaluation, non_finite_key
    from .memplan import run_memory_plan
    from .session import Session, check_trained_steps, identity, iteration_generator, run_iteration, weights_label

# the model code (the session, the evaluation, the memory plan: the model libraries, seconds of imports) is imported
# when a run first needs it, once its config and folder are accepted: a run refused before (its config on this
# launch, its folder) ends without those imports. Its names are this module's all the same (:func:`__getattr__`),
# and one a caller put in their place (a test's monkeypatch) is the one used here.
_MODEL_CODE = {"evaluation": ("Evaluation", "non_finite_key"), "memplan": ("run_memory_plan",),
               "session": ("Session", "check_trained_steps", "identity", "iteration_generator", "run_iteration",
                           "weights_label")}


def _import_model_code() -> None:
    """Make :data:`_MODEL_CODE`'s names this module's, keeping any already set."""
    import importlib

    for module, names in _MODEL_CODE.items():
        loaded = importlib.import_module(f"{__package__}.{module}")
        for name in names:
            globals().setdefault(name, getattr(loaded, name))


def __getattr__(name: str) -> object:
    if any(name in names for names in _MODEL_CODE.values()):
        _import_model_code()
        return globals()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

# the names callers import from here, wherever they are defined
__all__ = ["RECORD_KEYS", "TIMING_KEYS", "Interrupted", "Session", "Training", "check_trained_steps",
           "identity", "iteration_generator", "progress_line", "record_failure", "resolve_device",
           "run_iteration", "train", "weights_label"]


def folder_run_id(out: Path) -> str:
    """The run id of a run without ``run_id``: its folder's name as UTF-8 text. The name's bytes decoded by the
    locale (ASCII under LANG=C) kept a non-ASCII or non-UTF-8 name as lone surrogates, which the records wrote
    as escapes and the report could not write into a table (UnicodeEncodeError); a byte that is no UTF-8 is
    written as ``\\xNN``, so that two such names stay two ids (:func:`agg_bench.io.path_text`)."""
    return path_text(out.name)


def written_run_id(cfg: RunConfig, out: Path, continued: dict | None = None) -> str:
    """The run id a run of ``cfg`` writes into ``out``: ``run_id``; without one, that of ``continued``, the first
    record the run continues (a resumed run's, from its checkpoint or the folder's records), so that a folder renamed
    or moved since its run started keeps one run id in all its records and its summary; else the folder's name
    (:func:`folder_run_id`)."""
    if cfg.run_id:
        return cfg.run_id
    kept = continued.get("run_id") if continued is not None else None
    return kept if isinstance(kept, str) and kept else folder_run_id(out)


def _first_record(out: Path) -> dict | None:
    """The first record of ``out``'s ``metrics.jsonl``, or None when there is none or it cannot be read (the
    reader that later takes the whole file says what is wrong with it)."""
    try:
        return next(read_jsonl(out / METRICS_FILE), None)
    except (OSError, UserError):
        return None


def train(cfg: RunConfig, out_dir: str | Path, resume: bool = False, overwrite: bool = False,
          resume_stopped: bool = False, kept: Callable[[], str | None] | None = None,
          resume_flag: str | None = None) -> dict:
    """Run ``train.iterations`` GRPO iterations into the run folder ``out_dir`` (with ``train.budget``, until
    the first iteration whose cumulative ``cost`` reaches it, if that comes first); return the summary.

    The folder's files, which ``out_dir`` may be, and the summary's statuses are
    :mod:`agg_bench.runtime.runfolder`'s: ``out_dir`` must be new, empty or a run folder; an earlier
    attempt's files are replaced, but a finished run of another config only with ``overwrite``. Every
    input error surfaces before anything is written. With ``resume`` the run continues after the
    checkpoint's iteration (later records are dropped and recomputed, so none is duplicated or missing),
    or starts over when there is no checkpoint; with ``resume_stopped`` it does so only when the folder holds
    an attempt of this run that was stopped before it ended (:func:`~agg_bench.runtime.runfolder.
    stopped_attempt`: killed or interrupted, same config, same code), and starts over otherwise (a checkpoint of
    such an attempt that cannot be continued is refused, as with ``resume``); a refusal to resume names
    ``resume_flag``, the option that asked for it (default ``--resume-stopped`` with ``resume_stopped``, else
    ``--resume``);
    ``train.checkpoint_every`` = K > 0 writes ``checkpoint.pt`` every K iterations, at the end and on interruption
    (K = 0 on a resumed run that ends ok removes the one it resumed from). ``eval.every`` = K > 0 evaluates
    the policy on held-out noise (:mod:`agg_bench.runtime.evaluation`) before the first iteration, every K
    iterations and after the last, into ``evaluations.jsonl``, outside what the records count and time.
    ``kept``, called on rank 0 before the folder is claimed, says whether ``out_dir`` already holds this run
    ended by an attempt whose end its caller did not record (``agg-bench run --journal``: the status, or
    None); with a status every process returns that run's summary and nothing is trained or written.

    An ``oom`` or ``diverged`` run returns its summary; an interrupted one raises :class:`Interrupted`
    and a failed one its exception, each after the summary is written. SIGTERM and SIGINT are taken at
    the run's safe points (:mod:`agg_bench.stopping`): from before the folder is claimed until the summary
    is written a signal is remembered, and the run stops at its next transformer call, phase or step of
    building the model. One that comes before anything is written leaves no folder the claim made (and
    an earlier attempt's files as they were); after that the summary says ``interrupted``. A signal
    that comes once the summary is written is raised when the call returns. Started by torchrun, every
    process trains its share of each batch and rank 0 writes (:mod:`agg_bench.machine.distributed`).
    Nothing outlives the call: signal handlers, the process group it joined, telemetry and the folder's
    lock are released however it ends, so one process may call it again.
    """
    out = Path(out_dir)
    flag = resume_flag or ("--resume-stopped" if resume_stopped and not resume else "--resume")
    with stopping.stop_signals("agg-bench run"), stopping.safe_points():
        stopping.check()  # a signal that came before (while the command loaded): nothing is made
        check_config(cfg)  # the method's options and a random preset's architecture, before the folder is claimed
        with distributed.process_group(resolve_device(cfg.device), single=fsdp.enabled(cfg)) as shard, \
                (stopping.together(distributed.exchange_signal) if shard.distributed else contextlib.nullcontext()):
            # on several processes every stopping.check below is a collective point where they stop together
            with alike_on_every_process():  # every process joined the group, and this depends on cfg alone
                shard.check_run(cfg)
            fsdp.check_run(cfg)
            scalar_events.check_run(cfg)
            if kept is not None:  # rank 0 reads the journal and the folder; every process follows its answer
                status = distributed.gather(distributed.on_main(kept))[0]
                if status is not None:
                    if shard.is_main:
                        print(f"agg-bench run: {shown(out)} kept: it ended {status} in an earlier attempt whose end was "
                              "not recorded", file=sys.stderr, flush=True)
                    return RunFolder(out).summary()
            if resume_stopped and not resume:  # rank 0 reads the folder; every process follows its answer
                stopped = distributed.on_main(runfolder.stopped_attempt, out, cfg.to_dict())
                resume = any(distributed.gather(bool(stopped)))
                if resume and shard.is_main:
                    print(f"agg-bench run: continuing the stopped attempt in {shown(out)} from its checkpoint",
                          file=sys.stderr, flush=True)
            # rank 0 checks, locks and (if new) makes the folder; a folder it made and left empty goes if the
            # run fails or is stopped before writing into it
            claim = distributed.on_main(runfolder.claim, out, cfg.to_dict(), resume, overwrite)
            with claim or contextlib.nullcontext():
                _import_model_code()
                try:
                    session = Session(cfg)  # every input error surfaces here, before anything is written
                except Exception as exc:
                    if not tel.is_oom_error(exc):
                        raise
                    return _out_of_memory_at_build(cfg, out, resume, shard, exc)
                return Training(cfg, out, resume, shard, session, flag).run()


class Training:
    """The iterations of one run in its claimed folder ``out``; rank 0 writes.

    Its life cycle: constructing it checks the trained-step draw (``train.plan``), restores the checkpoint (with ``resume``) and
    writes nothing; :meth:`begin` starts the folder's files, opens what the iterations use (telemetry,
    the record writer, with ``telemetry.tensorboard`` the TensorBoard events, the progress bar, a hook on the
    optimizer) and evaluates the starting state if that is due; :meth:`iterate` trains one iteration, appends its record, evaluates and writes the checkpoint
    it is due; :meth:`finish` closes what ``begin`` opened and writes the summary. :meth:`run` calls them
    in that order, with a SIGTERM or SIGINT raised as :class:`Interrupted` at the run's safe points (before
    each iteration, between its phases, at every transformer call: :func:`agg_bench.stopping.check`; never
    while a record, an evaluation line or a checkpoint is written), stops after
    ``train.iterations`` or the iteration whose cost reaches ``train.budget``, and maps how the loop ended
    to the summary's status.

    The cost (``cost`` of every record) is the running sum of :func:`~agg_bench.records.passes_cost`
    over the records at ``train.pass_costs``; a resumed run continues it from the checkpoint's records, so
    it equals an uninterrupted run's. Evaluations (``eval.every``) use their own pass counter and
    generator and run outside the telemetry's iteration, so the records are those of a run without them;
    the evaluation of the state after ``n`` iterations is ``evaluations.jsonl``'s line ``iteration: n``
    (0: the starting weights), written before the checkpoint of that state, which carries it; a resumed
    run first evaluates its starting state if that is due and the checkpoint does not hold it.
    """

    def __init__(self, cfg: RunConfig, out: Path, resume: bool, shard: distributed.Shard, session: Session,
                 flag: str = "--resume"):
        self.cfg, self.out, self.resume, self.shard, self.session = cfg, out, resume, shard, session
        _import_model_code()
        check_trained_steps(cfg)
        # planned next to measured memory; a run that measures nothing (telemetry off) plans nothing
        self.memory_plan = run_memory_plan(cfg, shard.world_size) if shard.is_main and cfg.telemetry.enabled else None
        self.config = cfg.to_dict()
        # a refusal names ``flag``, the option that asked to resume (``--resume-stopped``: the workflow's run jobs)
        self.restored = load_checkpoint(out, session, self.config, flag) if resume else None
        if self.restored is not None and cfg.train.iterations <= self.restored.iteration:
            raise ConfigError("train.iterations", cfg.train.iterations,
                              f"more than the checkpoint's last iteration {self.restored.iteration} (it holds "
                              f"{counted(self.restored.iteration + 1, 'iteration')}) to resume the run in {shown(out)}")
        self.lines = list(self.restored.records) if self.restored is not None else []  # records written, as JSON lines
        self.start = self.restored.iteration + 1 if self.restored is not None else 0
        self.prices = cfg.train.pass_costs.to_dict()
        self.cost = running_cost([json.loads(line) for line in self.lines], self.prices)
        self.budget_reached = cfg.train.budget is not None and self.cost >= cfg.train.budget
        # held-out evaluations written (JSON lines), and the iterations after which each was taken
        self.evaluation = Evaluation.of_session(session) if cfg.eval.every else None
        self.eval_lines = list(self.restored.evaluations) if self.restored is not None else []
        self.evaluated = {json.loads(line)["iteration"] for line in self.eval_lines}
        self.last_good = self.start - 1 if self.start else None  # the last iteration whose record is ok
        self.saved_at = self.restored.iteration if self.restored is not None else None  # the checkpoint's iteration
        # a resumed run keeps the run id of the records it continues, in a folder renamed since they were written too
        self.run_id = written_run_id(cfg, out, json.loads(self.lines[0]) if self.lines else None)
        self.identity = identity(cfg, self.run_id, session.device, shard.world_size)
        if self.restored is not None:  # rank 0's hardware is the one its records name; every process follows
            distributed.on_main(runfolder.check_resumed_records, out, self.restored.records, self.identity, flag)
        # a job log (not a terminal) gets one line per iteration instead of a bar it cannot redraw
        self.log_lines = shard.is_main and not sys.stderr.isatty()
        self.telemetry: tel.Telemetry | None = None
        self.writer: JsonlWriter | None = None
        self.scalar_events: scalar_events.TensorBoardEvents | None = None
        self.eval_writer: JsonlWriter | None = None
        self.bar: tqdm | None = None
        self._step_hook: RemovableHandle | None = None

    def run(self) -> dict:
        """Begin, iterate from the first iteration not done to ``train.iterations`` and finish; the summary.
        A signal that came while the session was built stops the run before anything is written."""
        try:
            stopping.check()
            self.begin()
        except BaseException:
            self._close()
            raise
        status, error = "ok", None
        try:
            stopping.check()  # a signal while the folder's files were started
            evaluated = self._evaluate_if_due(self.start)  # the starting weights (or a resumed run's missing one)
            if isinstance(evaluated, tuple):
                status, error = evaluated
            elif evaluated and self.log_lines:
                print(evaluated, file=sys.stderr, flush=True)
            assert self.bar is not None  # begin() opened it
            for iteration in self.bar if status == "ok" else ():
                if self.budget_reached:  # a resumed run whose checkpoint spent the budget already
                    break
                stopping.check()
                ended = self.iterate(iteration)
                if ended is not None:
                    status, error = ended
                    break
            if status == "ok":
                self._final_checkpoint()
        except Interrupted as exc:
            status, error = "interrupted", f"stopped by {exc}"
            # the state still matches the records unless an optimizer step ran since the last one (then the
            # run holds signals until the record is written: stopping.hold)
            if not stopping.held():
                self._checkpoint_last_good()
            raise
        except Exception as exc:
            status, error = "error", f"{type(exc).__name__}: {exc}"
            raise
        except BaseException as exc:  # a KeyboardInterrupt the signal handlers did not raise, a SystemExit: never ok
            status = "interrupted" if isinstance(exc, KeyboardInterrupt) else "error"
            error = f"stopped by {type(exc).__name__}" + (f": {exc}" if str(exc) else "")
            raise
        finally:
            stopping.release()
            summary = self.finish(status, error)
        return summary

    def begin(self) -> None:
        """Start the folder's files (rank 0) and open what the iterations use."""
        distributed.on_main(self._start_files)
        cfg = self.cfg
        self.telemetry = tel.Telemetry(self.session.device, enabled=cfg.telemetry.enabled,
                                       nvml_interval_s=cfg.telemetry.nvml_interval_s,
                                       saved_activations=cfg.telemetry.saved_activations,
                                       iterations_before=self.start)
        self._step_hook = self.session.optimizer.register_step_pre_hook(self._stepping)
        self.bar = tqdm(range(self.start, cfg.train.iterations), desc=f"{self.run_id}", initial=self.start,
                        total=cfg.train.iterations, unit="it",
                        disable=not cfg.progress or not self.shard.is_main or self.log_lines)
        self.writer = runfolder.metrics_writer(self.out) if self.shard.is_main else None
        if self.shard.is_main and cfg.telemetry.tensorboard:
            self.scalar_events = scalar_events.TensorBoardEvents(self.out, self.start, skip=self.identity)
        if self.evaluation is not None and self.shard.is_main:
            self.eval_writer = runfolder.evaluations_writer(self.out)

    def _start_files(self) -> None:
        if self.resume and self.restored is None:
            print(f"agg-bench run: no checkpoint in {shown(self.out)}; starting at iteration 0", file=sys.stderr)
        resumed = self.restored is not None
        runfolder.start_files(self.out, self.config, self.lines, keep_checkpoint=resumed,
                              keep_events=resumed and self.cfg.telemetry.tensorboard,
                              evaluations=self.eval_lines if self.evaluation is not None else None,
                              device=self.session.device)
        runfolder.write_plan(self.out, self.memory_plan)

    def _stepping(self, *args) -> None:
        """Before each optimizer step: the weights will match no record until this iteration's is written, so
        a signal waits for it (:func:`agg_bench.stopping.hold`)."""
        stopping.hold()

    def iterate(self, iteration: int) -> tuple[str, str | None] | None:
        """Train ``iteration``, append its record (with the cumulative ``cost``), take the evaluation and
        write the checkpoint due after it; None while the run goes on (``budget_reached`` says whether the
        cost reached ``train.budget``: the loop then ends), else the status and error that end it: ``oom``
        (out of memory on any process: its record holds the memory at the failure) or ``diverged``. Any
        other failure raises."""
        assert self.telemetry is not None and self.bar is not None  # begin() opened them
        try:
            fields = run_iteration(self.session, self.telemetry, iteration)
        except Exception as exc:  # an OOM ends the run but not the sweep
            memory = self._out_of_memory(exc)
            if memory is None:
                raise
            self._write(new_record(self.identity, {"iteration": iteration}, self.telemetry.record(), memory,
                                   status="oom"))
            return "oom", None
        # None: not measured; a float64 loss past MAX_MAGNITUDE is a divergence too (no reader would take it back)
        diverging = [k for k in DIVERGING_KEYS if fields.get(k) is not None and not is_recordable_number(fields[k])]
        update_failed = fields.pop("diverged", None)
        overflow = fields.pop("reward_overflow", None)
        # the reward comes first in an iteration: a non-finite one is the cause, and the update's non-finite loss or
        # gradient only its consequence
        reason = ("reward_mean" if "reward_mean" in diverging else None) or update_failed or next(iter(diverging), None)
        # null, as a NaN is written: a number past the record contract's magnitude would make the run unreadable
        fields.update(dict.fromkeys(diverging))
        self.cost += passes_cost(fields, self.prices)
        record = new_record(self.identity, {"iteration": iteration}, fields, {"cost": self.cost},
                            status="diverged" if reason else "ok")
        self._write(record)
        stopping.release()  # the weights match the records again: a signal now stops the run with them
        if reason:
            why = f": {overflow}" if reason == "reward_mean" and overflow else ""
            return "diverged", f"non-finite {reason} at iteration {iteration}{why}"
        self.last_good = iteration
        budget = self.cfg.train.budget
        self.budget_reached = budget is not None and self.cost >= budget
        evaluated = self._evaluate_if_due(iteration + 1)  # before the checkpoint of this state, which carries it
        every = self.cfg.train.checkpoint_every
        if every and (iteration + 1) % every == 0:
            self._checkpoint(iteration)
        self.bar.set_postfix(reward=f"{record['reward_mean']:.3g}", loss=f"{record['loss'] or 0:.3g}")
        if self.log_lines:
            print(progress_line(record, self.cfg.train.iterations), file=sys.stderr, flush=True)
            if isinstance(evaluated, str):
                print(evaluated, file=sys.stderr, flush=True)
        return evaluated if isinstance(evaluated, tuple) else None

    def _out_of_memory(self, exc: Exception) -> dict | None:
        """The allocator's state when ``exc`` (this process's failure, or another process's that reached this one)
        is out of memory, else None; ``exc`` told to the other processes either way
        (:func:`~agg_bench.machine.distributed.report_failure`), so that none waits for this one alone."""
        memory: dict | None
        if isinstance(exc, distributed.PeerFailure):
            oom, memory = exc.is_oom, exc.memory
        else:
            oom = tel.is_oom_error(exc)
            memory = tel.memory_at_failure(self.session.device) if oom else None
        distributed.report_failure(exc, memory)
        if oom:
            assert memory is not None  # taken for every out-of-memory error above, and sent with another's
        return memory if oom else None

    def _write(self, record: dict) -> None:
        """Append ``record`` to ``metrics.jsonl`` (rank 0), keep its line for the checkpoints and add its
        numbers to the TensorBoard events."""
        if self.writer is not None:
            self.lines.append(self.writer.write(record))
        if self.scalar_events is not None:
            self.scalar_events.write(record)

    def _evaluate_if_due(self, done: int) -> str | tuple[str, str] | None:
        """Evaluate the weights after ``done`` iterations (every process: a sharded forward needs them all)
        and append the line (rank 0), if ``eval.every`` asks for that state and it is not evaluated yet
        (with ``train.eval_ema``, the state's moving average: :meth:`Session.evaluated_weights`):
        every ``eval.every``-th state from 0 on, and the last one (``train.iterations`` or the budget).
        The job log's line about it, or None when nothing was evaluated; or, where a score is not finite (the
        weights blew up), ``("diverged", error)`` and no line: the evaluations file holds finite scores only; or,
        where the evaluation ran out of memory on any process, ``("oom", error)`` and no line."""
        every = self.cfg.eval.every
        last = done >= self.cfg.train.iterations or self.budget_reached
        if self.evaluation is None or done in self.evaluated or not (done % every == 0 or last):
            return None
        # with train.eval_ema the moving average's weights, the trained ones put back after
        try:
            with tel.PhaseTimer(self.session.device) as timer, self.session.evaluated_weights():
                scores, _ = self.evaluation.evaluate()
        except Exception as exc:  # out of memory in the evaluation ends the run as in an iteration: oom, not a bug
            if self._out_of_memory(exc) is None:
                raise
            return "oom", f"out of memory in the evaluation after {done} iterations: {type(exc).__name__}: {exc}" \
                .splitlines()[0]
        diverging = non_finite_key(scores)
        if diverging is not None:
            return "diverged", f"non-finite {diverging} in the evaluation after {counted(done, 'iteration')}"
        line = {"iteration": done, **scores, "t_eval_s": timer.elapsed_s, "t_eval_cpu_s": timer.cpu_s}
        if self.eval_writer is not None:
            self.eval_lines.append(self.eval_writer.write(line))
        self.evaluated.add(done)
        return (f"{self.run_id} evaluation after {counted(done, 'iteration')}: reward {scores['eval_reward']:.4g} "
                f"({timer.cpu_s:.3f} CPU-s)")

    def _checkpoint(self, iteration: int) -> None:
        if self.shard.is_main or fsdp.is_sharded(self.session.policy):  # every process writes its shards
            save_checkpoint(self.out, self.session, iteration, self.lines, self.config, self.eval_lines)
        self.saved_at = iteration

    def _checkpoint_last_good(self) -> None:
        """Checkpoint the last good iteration unless it is saved already or the run keeps no checkpoints."""
        if self.cfg.train.checkpoint_every and self.last_good is not None and self.saved_at != self.last_good:
            self._checkpoint(self.last_good)

    def _final_checkpoint(self) -> None:
        """At the end of a run that ended ok, ``checkpoint.pt`` holds its last good iteration, or there is none:
        a run that keeps checkpoints writes it; one that keeps none (``train.checkpoint_every`` 0, a resumed
        attempt that turned them off) removes the one it resumed from, which ``agg-bench learning`` would
        evaluate as the run's final state, so that the folder holds what a fresh run of its config leaves."""
        if self.cfg.train.checkpoint_every:
            self._checkpoint_last_good()
        elif self.saved_at is not None and self.saved_at != self.last_good:
            if self.shard.is_main:
                runfolder.remove_checkpoint(self.out)
            self.saved_at = None

    def finish(self, status: str, error: str | None) -> dict:
        """Close what :meth:`begin` opened and write ``summary.json`` (rank 0); the summary."""
        self._close()
        summary = runfolder.run_summary(self.identity, status, error, self.cfg.train.iterations,
                                        self.shard.world_size, last_good=self.last_good,
                                        resumed_from=self.restored.iteration if self.restored else None,
                                        checkpoint_iteration=self.saved_at, budget_reached=self.budget_reached)
        if self.shard.is_main:
            try:
                runfolder.write_summary(self.out, summary)
            except OSError:
                if status == "ok":
                    raise
                # e.g. a full disk: the error that ended the run is the one to report
        return summary

    def _close(self) -> None:
        """Close what :meth:`begin` opened (whatever it got to), and what the method installed."""
        if self._step_hook is not None:
            self._step_hook.remove()
            self._step_hook = None
        if self.bar is not None:
            self.bar.close()
        if self.telemetry is not None:
            self.telemetry.close()
        self.session.estimator.close()
        if self.writer is not None:
            self.writer.close()
        if self.scalar_events is not None:
            self.scalar_events.close()
        if self.eval_writer is not None:
            self.eval_writer.close()


def running_cost(records: list[dict], prices: dict) -> float:
    """The cumulative cost after ``records`` (in iteration order): the last one's ``cost``, continued by
    :func:`~agg_bench.records.passes_cost` over records without one (written before records had
    it); 0.0 for none."""
    cost = 0.0
    for record in records:
        cost = record["cost"] if record.get("cost") is not None else cost + passes_cost(record, prices)
    return cost


def _out_of_memory_at_build(cfg: RunConfig, out: Path, resume: bool, shard: distributed.Shard,
                            exc: BaseException) -> dict:
    """The model (or its optimizer, reference copy, reward model) did not fit: the run ends as ``oom``
    like an iteration that runs out of memory, with one record (iteration 0, nothing measured but
    the memory at failure and the RSS peak) so that the tables show the cell as OOM. With ``resume``
    and a checkpoint in ``out`` the earlier records and checkpoint stay; only the summary says how
    this attempt ended."""
    _import_model_code()
    device = resolve_device(cfg.device)
    memory = tel.memory_at_failure(device)
    distributed.report_failure(exc, memory)
    kept = resume and checkpoint_path(out).exists()  # the earlier records stay: this attempt's summary names their run
    base = identity(cfg, written_run_id(cfg, out, _first_record(out) if kept else None), device, shard.world_size)
    error = f"out of memory while building the model: {type(exc).__name__}: {exc}".splitlines()[0]
    summary = runfolder.run_summary(base, "oom", error, cfg.train.iterations, shard.world_size)
    if shard.is_main:
        if not kept:
            record = new_record(base, {"iteration": 0, "rss_peak_bytes": tel.rss_peak_bytes()}, memory, status="oom")
            runfolder.start_files(out, cfg.to_dict(), [JsonlWriter.line(record)], keep_checkpoint=False,
                                  keep_events=False, device=device)
            if cfg.telemetry.tensorboard:
                with scalar_events.TensorBoardEvents(out, 0, skip=base) as live:
                    live.write(record)
        runfolder.write_summary(out, summary)
    print(f"agg-bench run: {error}", file=sys.stderr)
    return summary


def record_failure(cfg: RunConfig, out_dir: str | Path, error: str, overwrite: bool = False) -> bool:
    """Record that a run of ``cfg`` into ``out_dir`` failed before it wrote a summary of its own (``error``:
    the failure's line), as an attempt that wrote no record: the folder's files started as a run starts
    them (an earlier attempt's replaced; no records) and ``summary.json`` with ``status: error``. What a cell
    job that keeps going writes for such a run (:func:`agg_bench.runtime.cell.run_cell`), so that its
    workflow sees the failure among finished runs instead of a job that failed. False, with nothing
    written, when the folder does not take a run of ``cfg`` (someone else's files, a finished run of another
    config unless ``overwrite``, another writer) or its device cannot be named."""
    out = Path(out_dir)
    config = cfg.to_dict()
    try:
        device = resolve_device(cfg.device)
        claim = runfolder.claim(out, config, resume=False, overwrite=overwrite)
    except UserError:
        return False
    with stopping.safe_points(), claim:
        _import_model_code()
        base = identity(cfg, cfg.run_id or folder_run_id(out), device)
        runfolder.start_files(out, config, [], keep_checkpoint=False, keep_events=False, device=device)
        runfolder.write_plan(out, None)
        runfolder.write_summary(out, runfolder.run_summary(base, "error", error, cfg.train.iterations, 1))
    return True


def progress_line(record: dict, iterations: int) -> str:
    """One log line for an iteration's record: its number, phase times (wall, and CPU in
    parentheses), reward and status."""
    def seconds(key: str) -> str:
        wall, cpu = record.get(f"t_{key}_s"), record.get(f"t_{key}_cpu_s")
        text = "-" if wall is None else f"{wall:.3f}s"
        return text if cpu is None else f"{text} (cpu {cpu:.3f}s)"

    reward = record.get("reward_mean")
    phases = "  ".join(f"{name} {seconds(name)}" for name in ("rollout", "reward", "train", "iter"))
    return (f"{record.get('run_id')} iteration {record['iteration'] + 1}/{iterations}  {phases}  "
            f"reward {'-' if reward is None else f'{reward:.4g}'}  {record.get('status')}")
