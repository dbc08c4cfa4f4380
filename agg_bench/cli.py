"""The agg-bench command line. A user error prints one line and exits with code 2."""
from __future__ import annotations

import argparse
import functools
import json
import math
import sys
from pathlib import Path

from .errors import ConfigError, OneLineParser, UserError, alike_on_every_process, quote, run_command, shown
from .outdir import check_file, check_writable, named_path_problem

DEFAULT_CAMPAIGN_WORK = Path("results/campaign")  # campaign run's and status's --work
# the campaign actions that read each option that not all of them read
CAMPAIGN_OPTION_ACTIONS = {"--minutes": ("run",), "--started": ("run",), "--archive": ("run", "unpack"),
                           "--work": ("run", "status"), "--work-name": ("run", "status"),
                           "--reference-name": ("run", "status")}
MAX_GPU_MEMORY_GIB = 10**6  # --gpu-memory: far above any GPU's, and a finite number of bytes
MIN_GPU_MEMORY_GIB = 1 / 2**30  # and one byte at least: 1e-300 GiB was taken and planned as 0 bytes
# profile's --wait, --warmup, --active: each step is a training iteration (a trace keeps every active one), so far
# above any profile worth reading; a huge count was a command that never ended
MAX_PROFILE_STEPS = 1000


def path_arg(text: str) -> Path:
    """The type of every file or folder argument of every verb (campaign's --reference and --work: their check
    once parsed, :func:`_named_path_arg`): a path that names something this user can use
    (:func:`~agg_bench.outdir.named_path_problem`): never the empty string (which the OS reads as the current
    folder, so that ``--runs ''`` would read it and ``--out ''`` write into it), nor one that can name no file (a
    name too long for the file system) nor one behind a folder this user may not search. A refusal is argparse's
    one line naming the option, exit code 2."""
    problem = named_path_problem(text)
    if problem is not None:
        raise argparse.ArgumentTypeError(f"{quote(text)}: {problem}; expected a file or folder name")
    return Path(text)


def file_arg(text: str) -> Path:
    """:func:`path_arg` for a file a verb writes: a path that ends with ``/`` names a folder (pathlib drops the
    slash, so such a path was written as a file named after the folder). Every other refusal is path_arg's, in
    its words; the second look finds only the slash."""
    path = path_arg(text)
    problem = named_path_problem(text, file=True)
    if problem is not None:
        raise argparse.ArgumentTypeError(f"{quote(text)}: {problem}; expected a file path")
    return path


def _named_path_arg(text: str | Path | None, name: str) -> Path | None:
    """:func:`path_arg` of an option's ``text`` (None: not given; a Path: its default), its refusal a UserError
    naming ``name``: what the option's user gave it as (``campaign run --work-name``), which argparse's refusal,
    made as the command line is parsed, could not name."""
    if text is None or isinstance(text, Path):
        return text
    try:
        return path_arg(text)
    except argparse.ArgumentTypeError as err:
        raise UserError(f"{name} {err}") from None


def name_arg(text: str) -> str:
    """The type of a name a verb shows in its messages: printable, without space at either end, never empty."""
    if not text or not text.isprintable() or text.strip() != text:
        raise argparse.ArgumentTypeError(f"{quote(text)}: expected a name of printable characters, without space "
                                         "at either end")
    return text


# The number flags' types, the config package's (one way to read a number), imported when a number flag is read:
# imported with this module, the config package (YAML, JSON Schema) doubled the start-up of every command, --help
# and the verbs that load no config among them.
def integer_arg(text: str) -> int:
    """:func:`agg_bench.config.integer_arg`."""
    from .config import integer_arg as read

    return read(text)


def number_arg(text: str) -> float:
    """:func:`agg_bench.config.number_arg`."""
    from .config import number_arg as read

    return read(text)


def _add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", type=path_arg, help="run config YAML (default: built-in defaults)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config key, e.g. --set train.lr=1e-5 (repeatable)")


def _run_config(path, overrides: list[str]):
    """The run config a verb runs: loaded (no torch), then checked whole, the method's own options among
    the checks (:func:`agg_bench.runtime.config_check.check_config`), before anything is written. Its errors
    come from the command line, the config's files and the code alone, so the processes torchrun starts on a
    machine raise them alike and its first process prints them (:func:`agg_bench.errors.alike_on_every_process`):
    a verb calls this before anything that depends on the process (its rank, its device)."""
    from .config import load_config
    from .runtime.config_check import check_config

    with alike_on_every_process():
        return check_config(load_config(path, overrides))


def cmd_run(args) -> int:
    from .machine.distributed import launched_rank

    overrides = list(args.overrides)
    if args.checkpoint_every is not None:
        overrides.append(f"train.checkpoint_every={args.checkpoint_every}")
    with alike_on_every_process():  # the command line alone
        if args.resume and args.resume_stopped:
            raise UserError("--resume and --resume-stopped: give one (--resume continues any checkpoint of this "
                            "run, --resume-stopped only a stopped attempt's)")
    cfg = _run_config(args.config, overrides)  # before the checks of this process's own launcher variables
    rank = launched_rank()  # a bad launcher environment (RANK, WORLD_SIZE) is refused before the run
    if args.done is not None:
        _check_marker(args.done, args.out)
    # imported once the command line and config are known to be good: the trainer's imports (the model
    # libraries) doubled the time a refused run took to print its one line
    from .runtime.cell import ENDED, CellRun, claimed_markers, write_marker
    from .runtime.train import train

    # --journal: the run an attempt whose end went unrecorded finished is kept (a cell job's journal of one run)
    journal = _run_journal(args.journal, args.out, args.done) if args.journal is not None else None
    entry = CellRun(args.config, tuple(overrides), args.out, args.done)
    # the marker is held from before the run to its writing (rank 0 writes it), so a second run naming it is refused
    with claimed_markers([(args.done, "--done")] if args.done is not None and rank == 0 else []):
        summary = train(cfg, args.out, resume=args.resume, overwrite=args.overwrite,
                        resume_stopped=args.resume_stopped,
                        kept=None if journal is None else functools.partial(journal.kept, entry, cfg))
        if rank == 0:  # one result line for the job, not one per torchrun process
            if journal is not None and summary["status"] in ENDED:
                journal.add(entry, cfg, summary["status"])
            print(json.dumps({"out": str(args.out), "status": summary["status"]}))
            if args.done is not None:
                write_marker(args.done, args.out, summary["status"])
    return 0


def _check_marker(done: Path, out: Path) -> None:
    """``--done FILE``: outside the run folder (which holds the run's files only), and a file or nothing."""
    folder = out.resolve()
    if done.resolve() == folder or folder in done.resolve().parents:
        raise UserError(f"--done {shown(done)}: inside --out {shown(out)}; expected a marker outside the run folder")
    if done.resolve() in folder.parents:  # the run made a folder of the marker's path: a traceback at its end
        raise UserError(f"--out {shown(out)}: inside --done {shown(done)}; expected a run folder outside the marker (a file)")
    from .runtime.cell import is_marker

    check_file(done, is_marker, "a run's marker", "--done")
    check_writable(done, "--done")  # written when the run has ended: a place it cannot be written, refused first


def _run_journal(path: Path, out: Path, done: Path | None):
    """``--journal FILE``: outside the run folder, not the marker, and a cell journal or nothing
    (:meth:`agg_bench.runtime.cell.Journal.read`)."""
    from .runtime.cell import Journal

    folder = path.resolve()
    if folder == out.resolve() or out.resolve() in folder.parents:
        raise UserError(f"--journal {shown(path)}: inside --out {shown(out)}; expected a journal outside the run folder")
    if done is not None and folder == done.resolve():
        raise UserError(f"--journal {shown(path)}: the same file as --done; expected a file of its own")
    # a path below the other made a folder of it, where the file was then written at the run's end
    if folder in out.resolve().parents:
        raise UserError(f"--out {shown(out)}: inside --journal {shown(path)}; expected a run folder outside the journal (a file)")
    if done is not None and folder in done.resolve().parents:
        raise UserError(f"--done {shown(done)}: inside --journal {shown(path)}; expected a marker outside the journal (a file)")
    if done is not None and done.resolve() in folder.parents:
        raise UserError(f"--journal {shown(path)}: inside --done {shown(done)}; expected a journal outside the marker (a file)")
    # a path the command line chose: another is given, as for --done (never "remove it": it may be the user's file)
    journal = Journal.read(path, "agg-bench run", "--journal", f"{out} runs again", "give a new path")
    check_writable(path, "--journal")  # written when the run has ended: a place it cannot be written, refused first
    return journal


def cmd_cell(args) -> int:
    from .runtime.cell import read_job_file, read_jobs, run_cell
    from .tools.cell_calibration import read_calibrations, run_calibrations

    if args.deadline is not None and not (math.isfinite(args.deadline) and args.deadline > 0):
        raise ConfigError("--deadline", args.deadline, "a time in seconds since the epoch (e.g. $(date +%s) + 600)")
    # the runs and the calibrations from one reading of the file, all checked before anything is written
    data = read_job_file(args.jobs)
    jobs = read_jobs(args.jobs, calibrations=True, data=data)
    folders = [job.out for job in jobs]
    items = read_calibrations(args.jobs, folders, [job.done for job in jobs], data)
    argv = ["agg-bench", "cell", str(args.jobs)]
    return run_cell(args.jobs, keep_going=args.keep_going, deadline=args.deadline, resume=args.resume,
                    overwrite=args.overwrite, keep_journal=args.keep_journal,
                    after_runs=lambda ended: run_calibrations(items, folders, ended, args.deadline, argv), runs=jobs)


def cmd_snapshot(args) -> int:
    from .tools.snapshot import save_snapshot

    out = save_snapshot(_run_config(args.config, args.overrides), args.out)
    print(json.dumps({"out": str(out)}))
    return 0


def cmd_embed(args) -> int:
    from .engine.text import describe, embed, is_embeddings_file
    from .outdir import check_suffix, claim_files
    from .machine.devices import resolve_device

    cfg = _run_config(args.config, args.overrides)
    if args.out is None:
        print(json.dumps(describe(embed(cfg, None, resolve_device(cfg.device)))))
        return 0
    check_suffix(args.out, ".safetensors")  # before the lock file beside it is made
    with claim_files({args.out: (is_embeddings_file, "an agg-bench embedding file")}):
        print(json.dumps(describe(embed(cfg, args.out, resolve_device(cfg.device)))))
    return 0


def cmd_calibrate(args) -> int:
    import yaml

    from .config import yaml_load
    from .machine.distributed import result_line
    from .tools.calibrate import CalibrationConfig, write_calibration
    from .records import MAX_LABEL, is_label, unprintable_words

    if not args.methods and _first_given(args, "--method-repeats"):  # it would time nothing, and be recorded
        raise UserError(f"--method-repeats {args.method_repeats}: rounds of the --method timings, and no --method "
                        "is given (it needs --method LABEL OVERRIDES; or leave --method-repeats out)")
    repeats = {} if args.method_repeats is None else {"method_repeats": args.method_repeats}
    try:
        options = CalibrationConfig(repeats=args.repeats, warmup=args.warmup, **repeats)
    except ConfigError as err:  # named as the flag it was given as, not as the sweep's calibrate.<key>
        raise ConfigError(f"--{err.key.rpartition('.')[2].replace('_', '-')}", err.value, err.expected) from None
    methods = {}
    for label, text in args.methods:
        if not is_label(label):  # a row of the report's tables
            raise ConfigError("--method", label, f"a label of 1 to {MAX_LABEL} printable characters, then the "
                                                 f"overrides{unprintable_words(label)}")
        if label in methods:
            raise UserError(f"--method {label}: given twice (each label once)")
        try:
            methods[label] = yaml_load(text, f"--method {label}", text)
        except yaml.YAMLError as err:
            raise UserError(f"--method {label}: not YAML ({str(err).splitlines()[0]})") from None
    result = write_calibration(_run_config(args.config, args.overrides), args.out, options, methods)
    result_line({"out": str(args.out), "unit_s_per_sample": result["unit_s_per_sample"],
                 "methods_timed": [label for label, m in result["methods"].items() if m.get("cpu_s")],
                 "rollouts_timed": [label for label, m in result["methods"].items() if m.get("rollout_cpu_s")]})
    return 0


def cmd_replay(args) -> int:
    from .machine.devices import resolve_device
    from .tools.snapshot import replay

    counts = replay(args.snapshot, args.method, args.overrides, args.out, resolve_device(args.device, "--device"))
    print(json.dumps({"out": str(args.out), **counts}))
    return 0


def cmd_gradcheck(args) -> int:
    from .tools.replays import GRID_OPTIONS, agg_grid, check_replay_count, parse_method_specs, parse_values

    # the grid and the methods first: a bad item is refused before a config is read or a model built, and before
    # torch and the model code are imported (they made the one line take seconds)
    grid = (parse_values(args.windows, "--windows", int), parse_values(args.alphas, "--alphas", str),
            parse_values(args.route_fracs, "--route-fracs", float), parse_values(args.reuse, "--reuse", bool))
    check_replay_count(agg_grid(*grid), parse_method_specs(args.methods), GRID_OPTIONS)
    from .tools.gradcheck import gradcheck
    existing = args.snapshot is not None and (args.snapshot / "rollout.json").exists()
    cfg = None if existing and not (args.config or args.overrides) else _run_config(args.config, args.overrides)
    if existing and cfg is not None:
        # the snapshot an earlier gradcheck of this config made and kept (one killed before its table, say)
        # is this one's; a snapshot of another config is not
        from .jsonfiles import read_json_object

        held = read_json_object(args.snapshot / "config.json", "a snapshot's run config")
        if {**json.loads(json.dumps(cfg.to_dict())), "progress": None} != {**held, "progress": None}:
            raise UserError(f"--snapshot {shown(args.snapshot)} already holds a snapshot of another run config; "
                            "--config/--set would not apply to it (give them as it was made, or neither)")
        cfg = None
    rows = gradcheck(args.out, cfg, args.snapshot, *grid, args.methods, args.device)
    print(json.dumps({"out": str(args.out), "rows": len(rows)}))
    return 0


def _first_given(args, *flags: str) -> str | None:
    """The first of ``flags`` (``--name``) that the command line gave ``args`` a value for, or None."""
    return next((flag for flag in flags if getattr(args, flag[2:].replace("-", "_")) not in (None, [])), None)


def cmd_report(args) -> int:
    from .results.loading import (CalibrationEntry, GradcheckEntry, Manifest, check_time_basis, check_warmup,
                                  discover_runs, load_manifest)
    from .outputs import check_no_unpack_above
    from .results.loading import check_report
    from .results.report import build_report, plot_tables

    if args.manifest is not None:  # a reference's manifest while an unpack into it is under way or was cut off
        check_no_unpack_above(args.manifest, 1, f"--manifest {shown(args.manifest)}", set())
    if args.check:
        given = _first_given(args, "--runs", "--gradcheck", "--calibration", "--warmup", "--time", "--tables-in")
        if given:
            raise UserError(f"--check reads a report already written (--tables, --plots, --manifest); {given} is "
                            "for writing one (leave it out)")
        if args.tables is None:
            raise UserError("--check needs the report's --tables DIR (and its --plots DIR, --manifest FILE to compare)")
        check_report(args.tables, args.plots, load_manifest(args.manifest) if args.manifest else None)
        print(json.dumps({"tables": str(args.tables), "plots": str(args.plots) if args.plots else None,
                          "manifest": str(args.manifest) if args.manifest else None, "consistent": True}))
        return 0
    if args.tables_in is not None:
        given = _first_given(args, "--manifest", "--runs", "--gradcheck", "--calibration", "--warmup", "--time",
                             "--tables")
        if given:
            raise UserError(f"--tables-in plots tables already written; {given} is for writing them "
                            "(give one or the other)")
        if args.plots is None:
            raise UserError("--tables-in DIR needs --plots DIR")
        tables = plot_tables(args.tables_in, args.plots)
    else:
        if args.tables is None and args.plots is None:
            raise UserError("give --tables DIR and/or --plots DIR")
        if args.warmup is not None:
            check_warmup(args.warmup, "--warmup")
        manifest = load_manifest(args.manifest) if args.manifest else Manifest()
        manifest.runs += discover_runs(args.runs)
        manifest.gradcheck += [GradcheckEntry(path) for path in args.gradcheck]
        manifest.calibration += [CalibrationEntry(path) for path in args.calibration]
        _check_no_unpack_of_files(("--gradcheck", args.gradcheck), ("--calibration", args.calibration))
        if args.time is not None:
            manifest.time = check_time_basis(args.time, "--time")
        if args.warmup is not None:
            manifest.warmup = args.warmup
        tables = build_report(manifest, args.tables, args.plots)
    print(json.dumps({"tables": str(args.tables) if args.tables else None,
                      "plots": str(args.plots) if args.plots else None,
                      "efficiency_rows": len(tables["efficiency"])}))
    return 0


def _check_no_unpack_of_files(*given: tuple[str, list]) -> None:
    """A file given to ``report`` (``--calibration REF/calibration/X.json``) from a reference that a ``campaign
    unpack`` is writing or left cut off is refused, as its runs and manifest are: the folder two above the file,
    looked into once (:func:`agg_bench.outputs.check_no_unpack`)."""
    from .outputs import check_no_unpack_above

    looked: set[Path] = set()
    for flag, paths in given:
        for path in paths:
            check_no_unpack_above(path, 2, f"{flag} {shown(path)}", looked)


def cmd_learning(args) -> int:
    from .outputs import check_no_unpack_above
    # no torch: the model code is imported by the checkpoint evaluation alone, after every check of the options,
    # the manifest and the run folders (learning_report), so a refusal of any of them takes no model import
    from .tools.learning import LearningOptions, learning_report

    if args.tables is None and args.plots is None:  # else every checkpoint was evaluated and nothing written
        raise UserError("give --tables DIR and/or --plots DIR")
    # a reference's manifest while an unpack into it is under way or was cut off
    check_no_unpack_above(args.manifest, 1, f"--manifest {shown(args.manifest)}", set())
    given = {"--eval-seed": args.eval_seed, "--eval-sampler": args.eval_sampler}
    defaults = LearningOptions()
    options = LearningOptions(args.average, args.fraction, args.eval_noises,
                              defaults.eval_seed if args.eval_seed is None else args.eval_seed,
                              defaults.eval_sampler if args.eval_sampler is None else args.eval_sampler,
                              args.target_fraction, args.reference, args.eval_source)
    options.check()  # a value out of range is named first
    flag = _first_given(args, *given)
    if flag is not None and not args.eval_noises and args.plots is None:
        # the checkpoint evaluation samples only for the evaluation columns or the sample grid: the option would
        # change nothing written
        raise UserError(f"{flag} {given[flag]}: sets the checkpoint evaluation's noise, which runs only with "
                        f"--eval-noises >= 1 or --plots; give one of them, or leave {flag} out")
    runs = learning_report(args.manifest, args.tables, args.plots, options)
    print(json.dumps({"tables": str(args.tables) if args.tables else None,
                      "plots": str(args.plots) if args.plots else None, "runs": len(runs)}))
    return 0


def cmd_campaign(args) -> int:
    from .outdir import check_folder, check_folder_path, check_suffix
    from .tools.archive import REFERENCE_CONTENTS, unpack
    from .tools.campaign import (WORK_CONTENTS, Campaign, check_minutes, check_places, check_started, run_window,
                                 status)

    # an option given to an action that does not read it would be ignored: refused (an unpack reads its archive and
    # writes the reference only; status reads no archive)
    for flag, actions in CAMPAIGN_OPTION_ACTIONS.items():
        if args.action not in actions and _first_given(args, flag):
            raise UserError(f"campaign {args.action}: {flag} is an option of campaign {' and '.join(actions)}"
                            f"{' (one window)' if actions == ('run',) else ''}; leave it out")
    if args.action == "run":
        check_started(args.started, check_minutes(args.minutes))
    if args.work is None:
        args.work = DEFAULT_CAMPAIGN_WORK
    work_name = args.work_name or "--work"  # what errors call the work folder: what its user gave
    if args.reference_name is not None and args.reference is None:  # it names nothing: ignored, as it was
        raise UserError(f"--reference-name {args.reference_name}: names --reference in errors, but no --reference "
                        "was given; give --reference DIR too, or leave it out")
    reference_name = args.reference_name or "--reference"  # what errors call the reference: what its user gave
    # path_arg's check, here rather than as the command line is parsed, where the refusal could name only the flag
    args.reference = _named_path_arg(args.reference, reference_name)
    args.work = _named_path_arg(args.work, work_name)
    if args.action == "unpack" and args.archive is None:
        raise UserError("campaign unpack needs the archive (--archive FILE)")
    if args.action == "unpack" and args.reference is None:
        raise UserError("campaign unpack needs the reference folder to add the archive to (--reference DIR, "
                        "e.g. results/reference/h200)")
    # the work folder of the actions that read it: unpack reads none, and its default was refused as a link
    for flag, folder in ((reference_name, args.reference),
                         (work_name, args.work if args.action != "unpack" else None)):
        if folder is not None:
            check_folder_path(folder, flag)
    if args.action == "run" and args.archive is not None:
        check_suffix(args.archive, ".tar.gz", "--archive")  # what unpack reads: a gzip-compressed tar
    if args.action == "status":  # the folders a window keeps apart (run checks them in run_window)
        check_places(args.work, args.reference, work_name=work_name, reference_name=reference_name)
    if args.action != "unpack":  # what status and a window read: someone's folder was read as holding no run
        if args.reference is not None:
            check_folder(args.reference, REFERENCE_CONTENTS, reference_name)
        check_folder(args.work, WORK_CONTENTS, work_name)
    campaign = Campaign(args.config, cpu=args.cpu)
    if args.action == "run":
        log = run_window(campaign, args.minutes, args.work, args.reference, args.archive, started=args.started,
                         work_name=work_name, reference_name=reference_name)
        print(json.dumps({"archive": log["archive"], "finished": len(log["finished_in_window"]), "left": log["left"],
                          "seconds": log["seconds"]}))
    elif args.action == "unpack":
        print(json.dumps(unpack(campaign, args.archive, args.reference)))
    else:
        from .outputs import unpack_under_way

        cut_off = unpack_under_way(args.reference) if args.reference is not None else None
        if cut_off is not None:  # its runs count as done; its manifest and tables may lag behind them
            print(f"agg-bench campaign: {reference_name} {shown(args.reference)}: an unpack into it is under way or was cut "
                  f"off ({shown(cut_off.name)}); run that unpack again to finish its manifest and tables", file=sys.stderr)
        print(json.dumps(status(campaign, args.reference, args.work), indent=1))
    return 0


def cmd_import_log(args) -> int:
    from .tools.importlog import import_log

    summary = import_log(args.log, args.out, args.method, args.model, args.resolution, args.gpu_name,
                         args.n_gpus, args.run_id)
    print(json.dumps({"out": str(args.out), "iterations": summary["iterations"], "status": summary["status"]}))
    return 0


def cmd_profile(args) -> int:
    import itertools

    from torch.profiler import record_function

    from .errors import ConfigError
    from .io import write_json
    from .machine.envinfo import environment
    from .outdir import claimed_folders, replaced_folders
    from .runtime.session import Session
    from .outputs import PROFILE_CONTENTS
    from .tools.profiling import profile_steps
    from .tools.replays import check_method_kept

    for flag, value, least in (("--wait", args.wait, 0), ("--warmup", args.warmup, 0), ("--active", args.active, 1)):
        if not least <= value <= MAX_PROFILE_STEPS:
            raise ConfigError(flag, value, f"an integer from {least} to {MAX_PROFILE_STEPS}")
    # as in replay: --method replaces the config's method section; --set method.KEY=VALUE adds options
    check_method_kept(args.method, args.overrides)
    cfg = _run_config(args.config, [f"method={json.dumps({'name': args.method})}", *args.overrides])
    out = args.out
    # the profile is written into a new folder renamed over --out when whole: a profile killed while it wrote
    # left a torn operators.csv, or this profile's traces under the earlier one's profile.json, in the folder
    with claimed_folders([(out, PROFILE_CONTENTS)], replaced_whole=True), replaced_folders(out) as staged:
        folder = staged(out)
        session = Session(cfg)
        if args.phase == "train":
            batch = session.collect(0).batch

            def step() -> None:
                # every profiled update is the first one on its rollout, as in a training iteration
                # (a method reusing rollout velocities does so only while the policy version matches)
                batch.policy_version = session.policy.version
                with record_function("train"):
                    session.update(batch)
                    session.release_gradients()
        else:
            iterations = itertools.count()

            def step() -> None:
                with record_function("collect"):
                    collected = session.collect(next(iterations))
                with record_function("train"):
                    session.update(collected.batch)
                    session.release_gradients()
        try:
            staged_files = profile_steps(step, folder, session.device, args.wait, args.warmup, args.active)
        finally:
            session.estimator.close()
        written = {key: str(out / Path(path).name) for key, path in staged_files.items()}  # where they end up
        write_json(folder / "config.json", cfg.to_dict())
        write_json(folder / "env.json", environment(session.device))
        schedule = {"method": args.method, "phase": args.phase, "wait": args.wait, "warmup": args.warmup,
                    "active": args.active}
        write_json(folder / "profile.json", {**schedule, "files": written})
    print(json.dumps({"out": str(out), **written}))
    return 0


def cmd_plan(args) -> int:
    from .machine import fsdp
    from .methods.base import build_estimator
    from .runtime.memplan import GIB, format_plan, plan_memory
    from .runtime.session import check_trained_steps

    memory = None
    if args.gpu_memory is not None:
        if not (math.isfinite(args.gpu_memory) and MIN_GPU_MEMORY_GIB <= args.gpu_memory <= MAX_GPU_MEMORY_GIB):
            raise ConfigError("--gpu-memory", args.gpu_memory,
                              f"a number of GiB of at least {MIN_GPU_MEMORY_GIB:.3g} (one byte) and at most {MAX_GPU_MEMORY_GIB:,}")
        memory = args.gpu_memory * GIB
    cfg = _run_config(args.config, args.overrides)
    # what a run refuses before it builds the model (the method's bounds against the schedule, the step plan) is
    # refused here too, not planned as a run that fits
    build_estimator(cfg).check_run(cfg)
    check_trained_steps(cfg)
    fsdp.check_options(cfg)  # not the device's part: a plan may be made on another machine than the run's
    plan = plan_memory(cfg, args.gpus, memory)
    print(json.dumps(plan.as_dict()) if args.json else format_plan(plan))
    return 0


def cmd_pretrain(args) -> int:
    from .config.pretrain_keys import read_pretrain_config

    # each key's refusal (a file, a type, a bound) before the model code's imports (about five CPU-seconds);
    # the checks of the keys together need it
    cfg = read_pretrain_config(args.config, args.overrides,
                               warn=lambda line: print(f"agg-bench pretrain: {line}", file=sys.stderr, flush=True))
    from .tools.pretrain import check_pretrain_config, pretrain

    summary = pretrain(check_pretrain_config(cfg), args.out)
    print(json.dumps({"out": str(args.out), "train_cpu_s": round(summary["train_cpu_s"], 1),
                      "sample_reward": round(summary["sample_reward"], 4)}))
    return 0


def cmd_env(args) -> int:
    from .machine.envinfo import environment

    print(json.dumps(environment(), indent=2, default=str))
    return 0


def build_parser() -> argparse.ArgumentParser:
    from . import __version__
    from .records import MAX_REPLAYS

    parser = OneLineParser(
        prog="agg-bench", description="AGG and the GRPO baselines on diffusion transformers: training runs, "
        "gradient replays, memory plans, tables and plots. A user error prints one line and exits with code 2.")
    parser.add_argument("--version", action="version", version=f"agg-bench {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("run", help="one training run -> DIR/metrics.jsonl, summary.json, env.json")
    _add_config_args(p)
    p.add_argument("--out", required=True, type=path_arg, help="output folder")
    p.add_argument("--resume", action="store_true",
                   help="continue from DIR/checkpoint.pt (same config; starts over when there is none)")
    p.add_argument("--resume-stopped", action="store_true",
                   help="continue from DIR/checkpoint.pt only when DIR holds an attempt of this run that was stopped "
                        "before it ended (killed, or summary.json says interrupted; same config, same code); "
                        "otherwise start over (what the workflow's run jobs pass)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace a finished run of another config in DIR (refused without this flag)")
    p.add_argument("--done", type=file_arg, metavar="FILE",
                   help='when the run has ended (ok, oom or diverged), write {"out", "status"} to FILE: a marker '
                        "outside DIR (the workflow's output of a run job, so that removing it spares the run's files)")
    p.add_argument("--journal", type=file_arg, metavar="FILE",
                   help="keep the run when FILE (a cell job's journal, outside DIR) records it as ended with this "
                        "config and code and DIR still holds it; record it there when it ends (the workflow's run "
                        "jobs: a job that ended after snakemake was killed is kept, not run again)")
    p.add_argument("--checkpoint-every", type=integer_arg, metavar="K",
                   help="save DIR/checkpoint.pt every K iterations (= --set train.checkpoint_every=K)")
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("cell", help="several training runs one after the other in one process (a workflow cell): "
                                    "each into its own folder, as agg-bench run writes it")
    p.add_argument("jobs", type=path_arg, metavar="JOBS.json",
                   help='{"runs": [{"config": FILE or null, "set": ["KEY=VALUE", ...], "out": DIR, '
                        '"done": FILE}, ...]} (done, optional: a marker written once every run has ended)')
    p.add_argument("--keep-going", action="store_true",
                   help="record a run that fails in its folder (summary.json, status: error) and exit 0 once every "
                        "run's end is recorded (the workflow's cell jobs: a failed job's files would be removed)")
    p.add_argument("--deadline", type=number_arg, metavar="EPOCH_S",
                   help="seconds since the epoch: a run is not started when the longest run so far would end "
                        "after this time")
    p.add_argument("--resume", action="store_true",
                   help="keep the runs an earlier attempt of this job file finished before it was stopped "
                        "(journal JOBS.progress.json: same config, same code, files intact); run the rest")
    p.add_argument("--keep-journal", action="store_true",
                   help="with --resume: an attempt that ended leaves its journal too, for the caller to remove once "
                        "it has recorded the job's end (the workflow's manifest job)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace a finished run of another config in a run's folder (as agg-bench run --overwrite)")
    p.set_defaults(func=cmd_cell)

    p = sub.add_parser("snapshot", help="freeze one rollout for replay")
    _add_config_args(p)
    p.add_argument("--out", required=True, type=path_arg,
                   help="folder to write: transformer/, rollout.safetensors, rollout.json")
    p.set_defaults(func=cmd_snapshot)

    p = sub.add_parser("embed", help="prompt embeddings of a local model's text encoders -> the embedding cache")
    _add_config_args(p)
    p.add_argument("--out", type=file_arg, default=None,
                   help="FILE.safetensors (default: a file in prompts.cache_dir named after model and prompts)")
    p.set_defaults(func=cmd_embed)

    p = sub.add_parser("calibrate", help="per-sample unit costs of a no-grad forward, a forward with grad and a "
                                         "backward (the report's cost model) -> FILE.json")
    _add_config_args(p)
    p.add_argument("--repeats", type=integer_arg, default=21, help="measurements of each pass, interleaved (default 21)")
    p.add_argument("--warmup", type=integer_arg, default=2, help="untimed repetitions first (default 2)")
    p.add_argument("--method", dest="methods", nargs=2, action="append", default=[], metavar=("LABEL", "OVERRIDES"),
                   help="also time this method's train phase on the same rollout, interleaved with the others "
                        "given: LABEL and a YAML mapping of run-config overrides, e.g. agg-w5 "
                        "'{method: {name: agg, window: 5}}' (repeatable)")
    p.add_argument("--method-repeats", type=integer_arg, default=None,  # None: not given (9), refused without --method
                   help="timed rounds of the methods' train phases (default 9; needs --method)")
    p.add_argument("--out", required=True, type=file_arg, help="FILE.json")
    p.set_defaults(func=cmd_calibrate)

    p = sub.add_parser("replay", help="one method's gradient on a snapshot")
    p.add_argument("snapshot", type=path_arg, help="a folder written by agg-bench snapshot")
    p.add_argument("--method", required=True, help="the method to replay (a registered method name)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="a method option, e.g. --set method.window=5 (repeatable)")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default: cpu)")
    p.add_argument("--out", required=True, type=file_arg, help="FILE.safetensors (+ FILE.json pass counts)")
    p.set_defaults(func=cmd_replay)

    p = sub.add_parser("gradcheck", help="every estimator's gradient error against full on one snapshot -> CSV",
                       description="Replays full, then every row of the AGG grid (--windows x --alphas x "
                                   "--route-fracs x --reuse), then every --methods item, on one snapshot: at most "
                                   f"{MAX_REPLAYS} replays in all, each one backward pass over the whole rollout.")
    _add_config_args(p)
    p.add_argument("--snapshot", type=path_arg, help="use this snapshot (or make one here and keep it)")
    p.add_argument("--windows", default="2,3,4,5,8", help="AGG windows W (default: 2,3,4,5,8)")
    p.add_argument("--alphas", default="index,sigma", help="AGG weights (default: index,sigma)")
    p.add_argument("--route-fracs", default="0,0.5,1", help="AGG route fractions (default: 0,0.5,1)")
    p.add_argument("--reuse", default="false", help="AGG rollout-velocity reuse values (default: false)")
    p.add_argument("--methods", action="append", default=[], metavar="NAME[:KEY=VALUE,...]",
                   help="more methods to compare, e.g. fraction,cached:cache=fora (repeatable)")
    p.add_argument("--device", help="default: the run config's device (cpu for an existing snapshot)")
    p.add_argument("--out", required=True, type=file_arg, help="FILE.csv")
    p.set_defaults(func=cmd_gradcheck)

    p = sub.add_parser("report", help="comparison tables (CSV, Markdown, HTML) from run folders, and plots (PNG) "
                                      "drawn from the tables")
    p.add_argument("--manifest", type=path_arg, help="the workflow's list of runs and gradcheck CSVs with their labels")
    p.add_argument("--runs", nargs="*", default=[], type=path_arg,
                   help="run folders, or folders of run folders (labels taken from their records)")
    p.add_argument("--gradcheck", nargs="*", default=[], type=path_arg, help="gradcheck CSVs")
    p.add_argument("--warmup", type=integer_arg, help="iterations left out of the time averages (default 1)")
    p.add_argument("--calibration", nargs="*", default=[], type=path_arg,
                   help="agg-bench calibrate JSONs: the cost model behind predicted_train_speedup")
    p.add_argument("--time", help="seconds the timings use: auto (CPU time on a CPU, CUDA events on a GPU; "
                                  "default), cpu or wall")
    p.add_argument("--tables", type=path_arg, help="write summary/efficiency/ablation/gpus .csv + .md + .html and "
                                               "records.csv here")
    p.add_argument("--plots", type=path_arg, help="write the PNG plots here (drawn from the tables)")
    p.add_argument("--tables-in", type=path_arg, metavar="DIR",
                   help="draw the plots from the tables an earlier --tables DIR wrote (records.csv, efficiency.csv, "
                        "ablation.csv) instead of reading runs")
    p.add_argument("--check", action="store_true",
                   help="write nothing: check that --tables DIR is one report's, that --plots DIR was drawn from those "
                        "tables and that --manifest FILE is what they were made from (their stamp.json); exit 2 if not")
    p.set_defaults(func=cmd_report)

    p = sub.add_parser("learning", help="the learning sweep's tables and plots: each method's reward gain, its "
                                        "spread over seeds, the CPU time to a target; a held-out evaluation, "
                                        "and the cost to reach a held-out target")
    p.add_argument("--manifest", required=True, type=path_arg, help="the learning sweep's runs (the workflow's manifest)")
    p.add_argument("--tables", type=path_arg,
                   help="write learning.csv, learning.md, curves.csv (and evaluation.csv) here")
    p.add_argument("--plots", type=path_arg, help="write reward_iteration.png, reward_time.png, samples.png, "
                                              "eval_reward_cost.png, eval_reward_cpu.png, eval_pareto.png here")
    p.add_argument("--average", type=integer_arg, default=3, help="iterations averaged at each end (default 3)")
    p.add_argument("--fraction", type=number_arg, default=0.8, help="fraction of full's gain to reach (default 0.8)")
    p.add_argument("--eval-noises", type=integer_arg, default=0,
                   help="held-out evaluation: noises per caption (default 0: no evaluation columns)")
    p.add_argument("--eval-seed", type=integer_arg,
                   help="seed of the evaluation's noise (default 0; needs --eval-noises >= 1 or --plots)")
    p.add_argument("--eval-sampler",
                   help="ode: deterministic Euler; sde: the rollouts' SDE with seeded step noise (default ode; needs "
                        "--eval-noises >= 1 or --plots)")
    p.add_argument("--target-fraction", type=number_arg, default=0.9,
                   help="the held-out target: this fraction of the reference's mean held-out gain (default 0.9)")
    p.add_argument("--reference", default=None,
                   help="the method label both targets and speedup_to_target refer to, a method of the manifest "
                        "(default full, whose targets stay empty in a manifest without it)")
    p.add_argument("--eval-source", default="auto",
                   help="the held-out gain columns: auto (a method's in-run evaluations where all its runs have them, "
                        "else this command's evaluation) or checkpoint (this command's evaluation of every run's "
                        "final checkpoint, e.g. with more noises than the runs'; needs --eval-noises) (default auto)")
    p.set_defaults(func=cmd_learning)

    p = sub.add_parser("campaign", help="a sweep filled in over short windows of GPU time into committed reference "
                                        "results: run one window, unpack its archive, or say what is missing")
    p.add_argument("action", choices=("run", "unpack", "status"),
                   help="run: one window of --minutes, its finished runs packed into --archive; unpack: add "
                        "--archive to --reference (refused whole unless it is a campaign archive of this sweep); "
                        "status: the runs done and missing, in the order the next window takes them")
    p.add_argument("--config", required=True, type=path_arg, help="the campaign's sweep config (e.g. config/h200.yaml)")
    p.add_argument("--cpu", action="store_true", help="the same campaign on the tiny models on the CPU (minutes; "
                                                      "what the test suite runs)")
    # --reference and --work: path_arg's check once --reference-name and --work-name are known (cmd_campaign)
    p.add_argument("--reference", help="the reference folder (e.g. results/reference/h200): its runs "
                                       "count as done; unpack writes into it")
    p.add_argument("--work", default=None,
                   help="run: the window's runs, logs and calibrations (default results/campaign; earlier windows' "
                        "finished runs there count as done, for status too)")
    p.add_argument("--work-name", type=name_arg, metavar="NAME",
                   help="run, status: what a one-line error calls the work folder (default --work); "
                        "scripts/gpu_campaign.sh passes AGG_BENCH_CAMPAIGN_OUT, the variable its user sets")
    p.add_argument("--reference-name", type=name_arg, metavar="NAME",
                   help="run, status: what a one-line error calls the reference folder (default --reference); "
                        "scripts/gpu_campaign.sh passes AGG_BENCH_CAMPAIGN_REFERENCE when that variable set it")
    p.add_argument("--minutes", type=number_arg, help="run: the window's length; it stops cleanly before its end")
    p.add_argument("--started", type=number_arg, help="run: when the window's clock started, in seconds since the epoch "
                                                 "(default: now); scripts/gpu_campaign.sh passes its own start, so "
                                                 "that its start-up counts against --minutes")
    p.add_argument("--archive", type=file_arg, help="run: where to write the archive (default WORK/campaign.tar.gz); "
                                                "unpack: the archive to add")
    p.set_defaults(func=cmd_campaign)

    p = sub.add_parser("import-log", help="a DanceGRPO JSONL training log as a reference run folder")
    p.add_argument("log", type=path_arg, help="JSONL with step, avg_reward, step_time, grad_norm per line")
    p.add_argument("--out", required=True, type=path_arg, help="run folder to write")
    p.add_argument("--method", default="full", help="method label in tables (default: full)")
    p.add_argument("--model", default="unknown", help="model label in tables")
    p.add_argument("--resolution", type=integer_arg, help="image side in pixels")
    p.add_argument("--gpu-name", help="GPU the log was measured on, e.g. 'NVIDIA H800'")
    p.add_argument("--n-gpus", type=integer_arg, help="GPUs of that run")
    p.add_argument("--run-id", help="default: the output folder's name")
    p.set_defaults(func=cmd_import_log)

    p = sub.add_parser("profile", help="torch.profiler traces, operators.csv (and a CUDA memory snapshot) "
                                       "of one method's training iterations")
    _add_config_args(p)
    p.add_argument("--method", required=True, help="the method to profile (replaces the config's method section)")
    p.add_argument("--phase", choices=("iteration", "train"), default="iteration",
                   help="iteration: rollout + reward + update per step (default); "
                        "train: only the update, on one fixed rollout")
    p.add_argument("--wait", type=integer_arg, default=1, help="steps run before the profiler starts (default 1)")
    p.add_argument("--warmup", type=integer_arg, default=1, help="profiled steps that are discarded (default 1)")
    p.add_argument("--active", type=integer_arg, default=2, help="steps recorded in the trace (default 2)")
    p.add_argument("--out", required=True, type=path_arg, help="output folder (open with tensorboard --logdir or Perfetto)")
    p.set_defaults(func=cmd_profile)

    p = sub.add_parser("plan", help="will it fit? bytes per GPU of params, grads, optimizer state and "
                                    "activations, before anything is allocated")
    _add_config_args(p)
    p.add_argument("--gpu-memory", type=number_arg, metavar="GIB",
                   help="memory of one GPU in GiB (default: the visible GPU's; an H200's 139 GiB without one; "
                        "the machine's memory for device cpu)")
    p.add_argument("--gpus", type=integer_arg, default=1, help="processes (GPUs) the run is started on (default 1)")
    p.add_argument("--json", action="store_true", help="print the plan as one JSON object")
    p.set_defaults(func=cmd_plan)

    p = sub.add_parser("pretrain", help="train a small DiT on drawn scenes -> a model folder for model.preset: pretrained")
    p.add_argument("--config", type=path_arg, help="pretrain config YAML (keys: docs/configuration.md, agg-bench pretrain keys)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a pretrain key, e.g. --set family=flux (repeatable)")
    p.add_argument("--out", required=True, type=path_arg, help="model folder to write (replaced only if it is one)")
    p.set_defaults(func=cmd_pretrain)

    p = sub.add_parser("env", help="print the environment record (versions, GPUs, commit)")
    p.set_defaults(func=cmd_env)
    return parser


def main(argv: list[str] | None = None) -> int:
    """The command line; the exit code: 0, 2 for a user error (one line on stderr), 1 for a bug in agg-bench
    (a line saying so, then the traceback), 128 + N for a run stopped by signal N
    (:func:`agg_bench.errors.run_command`)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    return run_command(f"agg-bench {args.command}", lambda: args.func(args), ["agg-bench", *argv],
                       getattr(args, "out", None))


if __name__ == "__main__":
    sys.exit(main())
