"""One GRPO training run into its folder: the loop that turns iterations into metric records.

The session and one iteration live in :mod:`agg_bench.runtime.session`; the names callers import from
here (``Session``, ``run_iteration``, ``identity``, ``resolve_device``, ...) are re-exported.
"""
from __future__ import annotations

import contextlib
import json
import math
import signal
import sys
import threading
from pathlib import Path
from typing import Iterator

from tqdm import tqdm

from ..config import DEFAULTS, RunConfig
from ..errors import ConfigError, UserError
from ..io import JsonlWriter, write_json, write_lines
from ..machine import distributed, fsdp
from ..machine import telemetry as tel
from ..machine.devices import resolve_device
from ..outdir import Claim, Contents, check_folder
from ..results.records import RECORD_KEYS, TIMING_KEYS, new_record
from .checkpoint import (CHECKPOINT_NAME, SAME_RUN_CHANGES, SHARDS_PREFIX, checkpoint_path, first_difference,
                         load_checkpoint, remove_stale_files, save_checkpoint)
from .memplan import run_memory_plan
from .session import Session, check_plan, identity, iteration_generator, model_label, run_iteration, weights_label

# the names callers import from here, wherever they are defined
__all__ = ["RECORD_KEYS", "TIMING_KEYS", "Interrupted", "Session", "StopSignals", "check_plan",
           "identity", "iteration_generator", "model_label", "progress_line", "resolve_device", "run_iteration",
           "train", "weights_label"]


def _finite(x) -> bool:
    return x is None or math.isfinite(x)


class Interrupted(KeyboardInterrupt):
    """The run was stopped by signal ``signum`` (SIGTERM or SIGINT)."""

    def __init__(self, signum: int):
        self.signum = signum
        super().__init__(signal.Signals(signum).name)


class StopSignals:
    """While active (in the main thread), SIGTERM and SIGINT raise :class:`Interrupted` at once, except
    inside :meth:`deferred` blocks (a record or a checkpoint being written), which finish first. Signals
    after the first are ignored: the run is already stopping and must get to write its summary."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self):
        self.received: int | None = None
        self._raised = False
        self._depth = 0
        self._previous: dict = {}

    def __enter__(self) -> "StopSignals":
        if threading.current_thread() is threading.main_thread():
            for signum in self.SIGNALS:
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc) -> bool:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()
        return False

    def _raise(self) -> None:
        self._raised = True
        raise Interrupted(self.received)

    def _handle(self, signum, frame) -> None:
        if self.received is not None:
            return
        self.received = signum
        if self._depth == 0:
            self._raise()

    @contextlib.contextmanager
    def deferred(self) -> Iterator[None]:
        """A block that a signal does not cut short; the signal takes effect when it ends."""
        self._depth += 1
        try:
            yield
        finally:
            self._depth -= 1
        if self._depth == 0 and self.received is not None and not self._raised:
            self._raise()


def train(cfg: RunConfig, out_dir: str | Path, resume: bool = False, overwrite: bool = False) -> dict:
    """Run ``train.iterations`` GRPO iterations into ``out_dir``; return the summary.

    Writes ``metrics.jsonl`` (one record per iteration, each line flushed and fsynced as written),
    ``config.json``, ``env.json``, with ``train.checkpoint_every`` = K > 0 ``checkpoint.pt`` every K
    iterations, at the end and on interruption, and ``summary.json`` last (every file but the metric
    lines is written to a temporary name and renamed). Every input error surfaces before anything is
    written. ``out_dir`` must be new, empty or an agg-bench run folder (:func:`check_out_dir`): an
    earlier attempt's files are replaced, but a finished run of another config only with ``overwrite``.
    With ``resume`` the run continues after the checkpoint's iteration (later records are dropped and
    recomputed, so none is duplicated or missing), or starts over when there is no checkpoint.

    Summary ``status``: ok; oom (the run ends, the call returns); diverged (a non-finite reward, loss
    or gradient: that update never reaches the weights; ``last_good_iteration`` is the one before);
    interrupted (SIGTERM/SIGINT: :class:`Interrupted` is raised after the summary is written); error
    (the exception is raised after the summary is written). Started by torchrun, every process trains
    its share of each batch and rank 0 writes (:mod:`agg_bench.machine.distributed`).
    """
    with distributed.process_group(resolve_device(cfg.device), single=fsdp.enabled(cfg)) as shard:
        return _train(cfg, Path(out_dir), resume, shard, overwrite)


# what a run folder holds; anything else in --out is someone else's
RUN_CONTENTS = Contents("an agg-bench run", ("config.json", "env.json", "metrics.jsonl", "summary.json", "plan.json",
                                             CHECKPOINT_NAME), (f"{SHARDS_PREFIX}*",))


def _run_config(folder: Path) -> dict | None:
    """The run config a run folder holds (its ``config.json``), or None when it is not a run folder."""
    try:
        config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return config if isinstance(config, dict) and {"model", "train", "method"} <= set(config) else None


def check_out_dir(out: Path, config: dict, resume: bool, overwrite: bool) -> None:
    """Refuse an output folder whose contents a run would destroy: a folder that holds anything a run does
    not write, or a symbolic link (:func:`~agg_bench.outdir.check_folder`), a run's file names without a
    run's config, and (unless ``overwrite``, or resuming from a checkpoint, which checks the config
    itself) a finished run of another config. Reads only."""
    check_folder(out, RUN_CONTENTS)
    previous = _run_config(out) if out.is_dir() else None
    if previous is None:  # its files, if any, are not an agg-bench run's
        check_folder(out, Contents(RUN_CONTENTS.what))
        return
    if overwrite or (resume and checkpoint_path(out).is_file()) or not (out / "summary.json").is_file():
        return
    diff = first_difference(previous, config, SAME_RUN_CHANGES, DEFAULTS)
    if diff is not None:
        key, old, new = diff
        raise UserError(f"--out {out}: holds a finished run of another config ({key} = {old!r} there, {new!r} "
                        "here); pass --overwrite to replace it, or give another folder")


def _train(cfg: RunConfig, out: Path, resume: bool, shard: distributed.Shard, overwrite: bool = False) -> dict:
    """Claim ``out`` (rank 0: checked, locked against a second writer, made if new) and run there."""
    shard.check_run(cfg)
    fsdp.check_run(cfg)
    config = cfg.to_dict()
    distributed.on_main(check_out_dir, out, config, resume, overwrite)  # refused before anything is made
    claim = distributed.on_main(lambda: Claim(out, folder=True, lock_inside=True,
                                              check=lambda: check_out_dir(out, config, resume, overwrite)).acquire())
    with claim or contextlib.nullcontext():  # a folder this run made and left empty goes if it fails
        return _train_claimed(cfg, out, resume, shard)


def _train_claimed(cfg: RunConfig, out: Path, resume: bool, shard: distributed.Shard) -> dict:
    try:
        session = Session(cfg)  # every input error surfaces here, before anything is written
    except Exception as exc:
        if not tel.is_oom_error(exc):
            raise
        return _out_of_memory_at_build(cfg, out, resume, shard, exc)
    check_plan(cfg)
    # planned next to measured memory; a run that measures nothing (telemetry off) plans nothing
    memory_plan = run_memory_plan(cfg, shard.world_size) if shard.is_main and cfg.telemetry.enabled else None
    run_id = cfg.run_id or out.name
    config = cfg.to_dict()
    restored = load_checkpoint(out, session, config) if resume else None
    if restored is not None and cfg.train.iterations <= restored.iteration:
        raise ConfigError("train.iterations", cfg.train.iterations,
                          f"more than the checkpoint's last iteration {restored.iteration} (it holds "
                          f"{restored.iteration + 1} iterations) to resume the run in {out}")
    lines = list(restored.records) if restored is not None else []  # records written, as JSON lines
    start = restored.iteration + 1 if restored is not None else 0

    def begin() -> None:
        if resume and restored is None:
            print(f"agg-bench run: no checkpoint in {out}; starting at iteration 0", file=sys.stderr)
        _start_files(out, config, lines, keep_checkpoint=restored is not None)
        if memory_plan is not None:
            write_json(out / "plan.json", memory_plan)  # planned bytes, next to the peaks the records measure
        else:
            (out / "plan.json").unlink(missing_ok=True)  # an earlier attempt's plan is not this run's

    distributed.on_main(begin)
    telemetry = tel.Telemetry(session.device, enabled=cfg.telemetry.enabled,
                              nvml_interval_s=cfg.telemetry.nvml_interval_s,
                              saved_activations=cfg.telemetry.saved_activations, iterations_before=start)
    base = identity(cfg, run_id, session.device, shard.world_size)
    every = cfg.train.checkpoint_every
    status, error = "ok", None
    last_good = start - 1 if start else None
    saved_at = restored.iteration if restored is not None else None
    # True from an optimizer step until its record is written: a checkpoint then would not match the records
    stepped = [False]
    hook = session.optimizer.register_step_pre_hook(lambda *args: stepped.__setitem__(0, True))

    def checkpoint(iteration: int) -> None:
        nonlocal saved_at
        if shard.is_main or fsdp.is_sharded(session.policy):  # every process writes its shards
            save_checkpoint(out, session, iteration, lines, config)
        saved_at = iteration

    # a job log (not a terminal) gets one line per iteration instead of a bar it cannot redraw
    log_lines = shard.is_main and not sys.stderr.isatty()
    bar = tqdm(range(start, cfg.train.iterations), desc=f"{run_id}", initial=start, total=cfg.train.iterations,
               disable=not cfg.progress or not shard.is_main or log_lines, unit="it")
    writer = JsonlWriter(out / "metrics.jsonl", append=True) if shard.is_main else None
    stop = StopSignals()
    with stop:
        try:
            for iteration in bar:
                record = new_record(base, iteration=iteration)
                try:
                    fields = run_iteration(session, telemetry, iteration)
                except Exception as exc:  # an OOM ends the run but not the sweep
                    if isinstance(exc, distributed.PeerFailure):
                        oom, memory = exc.is_oom, exc.memory
                    else:
                        oom = tel.is_oom_error(exc)
                        memory = tel.memory_at_failure(session.device) if oom else None
                    distributed.report_failure(exc, memory)
                    if not oom:
                        raise
                    record.update(telemetry.record())
                    record.update(memory, status="oom")
                    with stop.deferred():
                        if writer is not None:
                            lines.append(writer.write(record))
                    status = "oom"
                    break
                record.update({k: v for k, v in fields.items() if k != "diverged"})
                reason = fields.get("diverged") or next(
                    (k for k in ("reward_mean", "loss", "grad_norm") if not _finite(record[k])), None)
                record["status"] = "diverged" if reason else "ok"
                with stop.deferred():
                    if writer is not None:
                        lines.append(writer.write(record))
                    stepped[0] = False
                    if reason:
                        status, error = "diverged", f"non-finite {reason} at iteration {iteration}"
                        break
                    last_good = iteration
                    if every and (iteration + 1) % every == 0:
                        checkpoint(iteration)
                bar.set_postfix(reward=f"{record['reward_mean']:.3g}", loss=f"{record['loss'] or 0:.3g}")
                if log_lines:
                    print(progress_line(record, cfg.train.iterations), file=sys.stderr, flush=True)
            if status == "ok" and every and last_good is not None and saved_at != last_good:
                with stop.deferred():
                    checkpoint(last_good)
        except Interrupted as exc:
            status, error = "interrupted", f"stopped by {exc}"
            # the state still matches the records unless an optimizer step ran since the last one
            if every and last_good is not None and saved_at != last_good and not stepped[0]:
                checkpoint(last_good)
            raise
        except Exception as exc:
            status, error = "error", f"{type(exc).__name__}: {exc}"
            raise
        finally:
            hook.remove()
            bar.close()
            telemetry.close()
            session.estimator.close()
            if writer is not None:
                writer.close()
            summary = _summary(cfg, run_id, status, error, base, shard, last_good=last_good,
                               resumed_from=restored.iteration if restored else None, checkpoint_iteration=saved_at)
            if shard.is_main:
                try:
                    write_json(out / "summary.json", summary)
                except OSError:
                    if status == "ok":
                        raise
                    # e.g. a full disk: the error that ended the run is the one to report
    return summary


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


def _start_files(out: Path, config: dict, lines: list[str], keep_checkpoint: bool) -> None:
    """What a run writes before its first iteration: an earlier attempt's stale files removed, then
    ``config.json``, ``env.json`` and ``metrics.jsonl`` holding ``lines``."""
    remove_stale_files(out, keep_checkpoint=keep_checkpoint)
    write_json(out / "config.json", config)
    write_json(out / "env.json", tel.environment())
    write_lines(out / "metrics.jsonl", lines)


def _summary(cfg: RunConfig, run_id: str, status: str, error: str | None, base: dict, shard: distributed.Shard,
             last_good: int | None, resumed_from: int | None, checkpoint_iteration: int | None) -> dict:
    """The contents of ``summary.json``."""
    return {"run_id": run_id, "status": status, "iterations": cfg.train.iterations, "last_good_iteration": last_good,
            "error": error, **base, "world_size": shard.world_size, "resumed_from": resumed_from,
            "checkpoint_iteration": checkpoint_iteration}


def _out_of_memory_at_build(cfg: RunConfig, out: Path, resume: bool, shard: distributed.Shard,
                            exc: BaseException) -> dict:
    """The model (or its optimizer, reference copy, reward model) did not fit: the run ends as ``oom``
    like an iteration that runs out of memory, with one record (iteration 0, nothing measured but
    the memory at failure and the RSS peak) so that the tables show the cell as OOM. With ``resume``
    and a checkpoint in ``out`` the earlier records and checkpoint stay; only the summary says how
    this attempt ended."""
    device = resolve_device(cfg.device)
    memory = tel.memory_at_failure(device)
    distributed.report_failure(exc, memory)
    run_id = cfg.run_id or out.name
    base = identity(cfg, run_id, device, shard.world_size)
    error = f"out of memory while building the model: {type(exc).__name__}: {exc}".splitlines()[0]
    summary = _summary(cfg, run_id, "oom", error, base, shard, last_good=None, resumed_from=None,
                       checkpoint_iteration=None)
    if shard.is_main:
        if not (resume and checkpoint_path(out).exists()):
            record = new_record(base, iteration=0, rss_peak_bytes=tel.rss_peak_bytes())
            record.update(memory, status="oom")
            _start_files(out, cfg.to_dict(), [JsonlWriter.line(record)], keep_checkpoint=False)
        write_json(out / "summary.json", summary)
    print(f"agg-bench run: {error}", file=sys.stderr)
    return summary
