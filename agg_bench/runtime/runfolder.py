"""The run folder: what ``agg-bench run --out DIR`` holds, and the rules for writing it.

A run folder holds these files and nothing else (:data:`agg_bench.outputs.RUN_CONTENTS`):

- ``config.json``: the run config, as validated;
- ``env.json``: the machine and software it ran on (:func:`agg_bench.machine.telemetry.environment`);
- ``plan.json``: the memory planner's bytes, beside the peaks the records measure (a run whose telemetry
  is off measures nothing and plans nothing);
- ``metrics.jsonl``: one record per iteration (:func:`agg_bench.records.new_record` builds each),
  every line flushed and fsynced as it is appended;
- ``evaluations.jsonl`` (with ``eval.every`` > 0): one line per held-out evaluation
  (:mod:`agg_bench.runtime.evaluation`), appended the same way;
- ``checkpoint.pt``, and with ``train.shard: fsdp`` its ``checkpoint_shards_<iteration>/`` folder
  (:mod:`agg_bench.runtime.checkpoint`): once a run ended ok, its last good iteration's or none (a run resumed
  with ``train.checkpoint_every`` 0 removes the one it resumed from);
- ``tensorboard/``, with ``telemetry.tensorboard: true``: the records' numbers as TensorBoard scalars
  (:mod:`agg_bench.runtime.scalar_events`);
- ``summary.json``: written last, so that it exists only once an attempt has ended. Its ``status`` is
  ``ok``; ``oom`` (out of memory while building the model or in an iteration, on any process: the run
  ends and returns, so a sweep goes on); ``diverged`` (a non-finite reward, loss or gradient: that update
  never reached the weights; or an optimizer step that left a trainable parameter not finite; either way
  ``last_good_iteration`` is the one before); ``interrupted`` (SIGTERM or
  SIGINT) or ``error`` (any other exception; both are raised again once the summary is written).

Every file but the metric lines is written to a temporary name and renamed (:mod:`agg_bench.io`), so a
killed run leaves whole files. The rules, in the order a run meets them:

1. **Which folder** (:func:`check_out_dir`, :func:`claim`). ``--out`` must be new, empty or a run folder:
   no one else's file, no symbolic link (:mod:`agg_bench.outdir`), each name of its kind (a ``summary.json``
   that is a folder, or a ``tensorboard`` that is a file, is refused before anything is written), and
   nothing but the harness's files inside ``tensorboard/`` and the shard folders, which a run removes. An earlier attempt of the same config,
   or one that never finished (no ``summary.json``, as when Snakemake reruns a job), is replaced; a
   finished run of another config only with ``--overwrite``; ``--resume`` with a checkpoint compares the
   config with the checkpoint's instead, and continues only on the code and the kind of machine ``env.json``
   names (:func:`machine_change`), so that one run's records never come from two. The claim locks the folder
   against a second writer for the whole run and removes the folder it made if the run fails before writing
   into it.
2. **Starting** (:func:`start_files`, :func:`write_plan`). An earlier attempt's summary, a killed
   process's temporaries and, unless resuming, its checkpoint go, and its ``tensorboard/`` folder unless
   this attempt continues it; then ``config.json``, ``env.json``, ``metrics.jsonl`` (holding the records a
   resumed run keeps), ``evaluations.jsonl`` (the evaluations it keeps; an earlier attempt's goes when this
   one evaluates nothing) and ``plan.json`` are written, in that order.
3. **Ending** (:func:`run_summary`, :func:`write_summary`). The summary repeats the run's identity
   fields and says how the attempt ended, how far it got and which checkpoint it left.
"""
from __future__ import annotations

import json
import zipfile
from pathlib import Path
from typing import TYPE_CHECKING

from ..config import DEFAULTS
from ..errors import UserError, counted, quote, shown
from ..io import JsonlWriter, is_temp_name, write_json, write_lines
from ..machine.devices import resolve_device
from ..machine.envinfo import environment, measured_on
from ..outdir import Claim, remove_owned
from ..outputs import EVENTS_CONTENTS, EVENTS_FOLDER, SHARD_CONTENTS, check_run_folder
from ..reading import RunFolder
from ..records import EVALUATIONS_FILE
from .checkpoint import RESUMABLE_CHANGES, SAME_RUN_CHANGES, SHARDS_PREFIX, checkpoint_path, first_difference

if TYPE_CHECKING:
    import torch


def check_out_dir(out: Path, config: dict, resume: bool, overwrite: bool) -> None:
    """Refuse an output folder whose contents a run would destroy: a folder that holds anything a run does
    not write, or a symbolic link (:func:`~agg_bench.outdir.check_folder`), a run's file names without a
    run's config, and (unless ``overwrite``) a finished run of another config: another but in the keys a
    resumed run may change (:data:`RESUMABLE_CHANGES`) when resuming from a checkpoint, which is checked
    against the config itself where it is loaded; resuming from a checkpoint, a folder whose ``env.json`` names
    other code or another kind of machine than this run's (:func:`machine_change`). Reads only."""
    previous = check_run_folder(out)
    if previous is None:
        return
    if resume and checkpoint_path(out).is_file():
        change = machine_change(RunFolder(out).env(), resolve_device(config["device"]))
        if change is not None:
            raise UserError(f"--resume: {shown(out)}: {change}: start it over with --overwrite in place of --resume, "
                            "or give another folder")
    if overwrite or not (out / "summary.json").is_file():
        return
    # a checkpoint is compared with the config where it is loaded; here the run the folder holds is, so that a
    # checkpoint copied in from another run's folder does not replace this finished run's records
    same_run = RESUMABLE_CHANGES if resume and checkpoint_path(out).is_file() else SAME_RUN_CHANGES
    diff = first_difference(previous, config, same_run, DEFAULTS)
    if diff is not None:
        key, old, new = diff
        advice = ("--resume continues it with its own config (or pass --overwrite to replace it, or give another "
                  "folder)") if same_run is RESUMABLE_CHANGES else "pass --overwrite to replace it, or give another folder"
        raise UserError(f"--out {shown(out)}: holds a finished run of another config ({key} = {old!r} there, {new!r} "
                        f"here); {advice}")


def claim(out: Path, config: dict, resume: bool, overwrite: bool) -> Claim:
    """Hold ``out`` for a run of ``config``: checked (:func:`check_out_dir`, refused before anything is
    made), made if new, locked against a second writer and checked again under the lock (another writer
    may have finished in between). Release it with ``with`` or ``release(failed)``."""
    check_out_dir(out, config, resume, overwrite)
    return Claim(out, folder=True, lock_inside=True,
                 check=lambda: check_out_dir(out, config, resume, overwrite)).acquire()


def stopped_attempt(out: Path, config: dict) -> bool:
    """Whether ``out`` holds an attempt of a run of ``config`` that was stopped before it ended, with a
    checkpoint to continue from: a ``checkpoint.pt``; no ``summary.json`` (a killed process, or a workflow
    that removed it with the job's other outputs) or one that says ``interrupted``; a ``config.json`` that
    differs from ``config`` at most in the keys a resumed run may change (:data:`RESUMABLE_CHANGES`); and an
    ``env.json`` written by this code (its ``source_digest``) on this kind of machine (:func:`machine_change`),
    so that one run's records never come from two versions of it or two machines. What ``agg-bench run
    --resume-stopped`` continues; a run that ended (ok, oom, diverged, error) or any other folder starts over.
    Reads only; a folder it cannot read is not such an attempt, nor is a ``checkpoint.pt`` that is no whole zip
    archive (what ``torch.save`` writes): the empty or cut file a machine that lost power after its rename
    can leave, which ``--resume`` refuses. A whole archive that is no checkpoint of this run is a stopped
    attempt's: continuing it is refused in one line naming ``--resume-stopped``, the folder untouched."""
    if not checkpoint_path(out).is_file() or not zipfile.is_zipfile(checkpoint_path(out)):
        return False
    folder = RunFolder(out)
    try:
        status = folder.summary().get("status")
        previous, env = folder.config_object(), folder.env()
        change = machine_change(env, resolve_device(config["device"]))
    except UserError:
        return False
    if status not in (None, "interrupted") or change is not None:
        return False
    return first_difference(previous, config, RESUMABLE_CHANGES, DEFAULTS) is None


def machine_change(env: dict, device: torch.device) -> str | None:
    """How the code and the kind of machine a run folder's ``env`` (its env.json) names differ from what this
    process measures with on ``device`` (:func:`~agg_bench.machine.envinfo.measured_on`), in words; None where
    they do not, so that the folder's records and a resumed attempt's would come from one version of the code
    and one kind of machine. The machine is the GPU a run measured on, or for a run on the CPU the CPU model:
    timings depend on either. Host names and library versions are not compared: a run requeued onto another node
    of the same kind continues."""
    now = measured_on(device)
    before = env.get("source_digest")
    if before != now["source_digest"]:
        said = f"source_digest {_short(before)}" if before is not None else "no source_digest"
        return (f"env.json names {said}, this code {_short(now['source_digest'])}; a resumed run's records would "
                "come from two versions of the code")
    before, after = _machine(env), _machine(now)
    if before != after:
        return f"env.json says {before}, this machine {after}; a resumed run's records would come from two machines"
    return None


# the identity fields of a record that name the hardware it was measured on
HARDWARE_KEYS = ("device", "gpu_name", "n_gpus")


def check_resumed_records(out: Path, lines: list[str], identity: dict, flag: str = "--resume") -> None:
    """Refuse to continue a checkpoint's records (``lines``, JSON lines of iterations 0 to k) that were measured on
    other hardware than a run of ``identity`` measures on: another kind of device, GPU or number of GPUs (a run's
    records say it; its env.json names rank 0's GPU, not how many processes ran, and a checkpoint may be continued
    in a folder without one). ``flag``: the option that asked to resume, which the refusal names."""
    before = {key: json.loads(lines[0]).get(key) for key in HARDWARE_KEYS}
    after = {key: identity[key] for key in HARDWARE_KEYS}
    if before != after:
        raise UserError(f"{flag}: {shown(checkpoint_path(out))}: its records were measured on {_hardware(before)}, "
                        f"this run on {_hardware(after)}; a resumed run's records would come from two machines: start "
                        f"it over with --overwrite in place of {flag}, or give another folder")


def _hardware(fields: dict) -> str:
    """The hardware a record's :data:`HARDWARE_KEYS` name, in words."""
    if fields["device"] != "cuda":
        return "the CPU" if fields["device"] == "cpu" else f"device {quote(fields['device'])}"
    count = fields["n_gpus"]
    gpus = counted(count, "GPU") if type(count) is int else f"GPUs {quote(count)}"
    gpu = fields["gpu_name"]
    return f"{gpus} ({gpu if isinstance(gpu, str) else quote(gpu)})"


def _machine(env: dict) -> str:
    """The GPU an env.json names, or where it names none (a run on the CPU), its CPU model, in words."""
    gpu, cpu = env.get("gpu_name"), env.get("cpu_model")
    if gpu is not None:
        return gpu if isinstance(gpu, str) else quote(gpu)
    if cpu is None:
        return "the CPU (no model named)"
    return f"the CPU {cpu if isinstance(cpu, str) else quote(cpu)}"


def _short(digest: object) -> str:
    """A source digest for a message: its first 12 characters (a hash's, enough to tell two apart)."""
    return f"{digest[:12]}..." if isinstance(digest, str) and len(digest) > 12 else quote(digest)


def remove_stale_files(out_dir: str | Path, keep_checkpoint: bool, keep_events: bool) -> None:
    """Before a run writes into DIR: remove the summary of an earlier attempt (it is written last, so
    its presence must mean this attempt finished), temporaries a killed process left, unless resuming,
    the earlier checkpoint (and its shard folders), and unless this attempt appends to them, the earlier
    TensorBoard events. Folders go with what the harness wrote in them and nothing else
    (:func:`~agg_bench.outdir.remove_owned`; :func:`check_out_dir` refused anything else already)."""
    out = Path(out_dir)
    doomed = [out / "summary.json"]
    if not keep_checkpoint:
        remove_checkpoint(out)
    if not keep_events:
        remove_owned(out / EVENTS_FOLDER, EVENTS_CONTENTS)
    # only the harness's own temporary names (io.atomic_path), never a user's look-alike
    doomed += [p for p in out.iterdir() if p.is_file() and is_temp_name(p.name)]
    for p in doomed:
        p.unlink(missing_ok=True)


def remove_checkpoint(out: Path) -> None:
    """Remove ``checkpoint.pt``, then its shard folders with what the harness wrote in them and nothing else
    (:func:`~agg_bench.outdir.remove_owned`), so that no ``checkpoint.pt`` ever names a folder that is gone."""
    checkpoint_path(out).unlink(missing_ok=True)
    for shards in out.glob(f"{SHARDS_PREFIX}*"):
        remove_owned(shards, SHARD_CONTENTS)


def start_files(out: Path, config: dict, lines: list[str], keep_checkpoint: bool, keep_events: bool,
                evaluations: list[str] | None = None, device: torch.device | None = None) -> None:
    """What a run writes before its first iteration: an earlier attempt's stale files removed, then
    ``config.json``, ``env.json`` (of the run's ``device``: :func:`environment`), ``metrics.jsonl`` holding ``lines`` (records as JSON lines) and
    ``evaluations.jsonl`` holding ``evaluations`` (None: a run that evaluates nothing, which has none)."""
    remove_stale_files(out, keep_checkpoint=keep_checkpoint, keep_events=keep_events)
    write_json(out / "config.json", config)
    write_json(out / "env.json", environment(device))
    write_lines(out / "metrics.jsonl", lines)
    if evaluations is None:
        (out / EVALUATIONS_FILE).unlink(missing_ok=True)
    else:
        write_lines(out / EVALUATIONS_FILE, evaluations)


def write_plan(out: Path, plan: dict | None) -> None:
    """``plan.json`` holds ``plan``; without one, an earlier attempt's plan (not this run's) goes."""
    if plan is not None:
        write_json(out / "plan.json", plan)
    else:
        (out / "plan.json").unlink(missing_ok=True)


def metrics_writer(out: Path) -> JsonlWriter:
    """The writer that appends a run's records to ``metrics.jsonl`` after the lines it starts with."""
    return JsonlWriter(out / "metrics.jsonl", append=True)


def evaluations_writer(out: Path) -> JsonlWriter:
    """The writer that appends a run's evaluations to ``evaluations.jsonl`` after the lines it starts with."""
    return JsonlWriter(out / EVALUATIONS_FILE, append=True)


def run_summary(identity: dict, status: str, error: str | None, iterations: int, world_size: int,
                last_good: int | None = None, resumed_from: int | None = None,
                checkpoint_iteration: int | None = None, budget_reached: bool = False) -> dict:
    """The contents of ``summary.json``: how an attempt ended (``status``, ``error``), ``iterations``
    asked for, the last iteration whose update was good, the run's ``identity`` (a record's identity
    fields), the process count, the checkpoint's iteration it resumed from and the one it leaves, and
    whether the run's cost reached ``train.budget`` (what stopped it, unless that was ``iterations``)."""
    return {"run_id": identity["run_id"], "status": status, "iterations": iterations,
            "last_good_iteration": last_good, "error": error, **identity, "world_size": world_size,
            "resumed_from": resumed_from, "checkpoint_iteration": checkpoint_iteration,
            "budget_reached": budget_reached}


def write_summary(out: Path, summary: dict) -> None:
    """Write ``summary.json``, the file that says the attempt ended; the run's last write."""
    write_json(out / "summary.json", summary)
