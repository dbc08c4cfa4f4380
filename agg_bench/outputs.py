"""What each command writes into its output folder (:class:`~agg_bench.outdir.Contents`), and nothing else.

The writers claim their folders with these lists (:mod:`agg_bench.outdir`): a run, the report's tables and
plots, the learning report, an imported log, a pretrain output. They live here, apart from the writers (which
import torch or pandas), so that the workflow checks every folder it writes into before any job starts
(:func:`agg_bench.tools.sweep.check_output_contents`): a file of someone's in a run folder or beside the tables
is refused there, not when the job that writes there runs (for the tables, after every run). Pure data, and
the one check of a run folder that needs no run config (:func:`check_run_folder`); the standard library and
the basics only.
"""
from __future__ import annotations

import os
from pathlib import Path

from .errors import UserError, shown
from .io import temp_owner
from .outdir import Contents, check_folder
from .reading import RunFolder
from .records import EVALUATIONS_FILE, PLOTS, TABLE_FORMATS, TABLES

# ----- a run folder (agg_bench.runtime.runfolder) -------------------------------------------------------
CHECKPOINT_NAME = "checkpoint.pt"
SHARDS_PREFIX = "checkpoint_shards_"  # train.shard: fsdp keeps a checkpoint's shards in such a folder beside it
EVENTS_FOLDER = "tensorboard"  # telemetry.tensorboard: the records as TensorBoard scalars (runtime.scalar_events)
# what the TensorBoard writer puts in its folder; a rerun removes the folder only if it holds nothing else
EVENTS_CONTENTS = Contents("TensorBoard events of a run", patterns=("events.out.tfevents.*",))
# what torch.distributed.checkpoint's FileSystemWriter puts in a shard folder: each process's data files,
# the metadata (renamed into place from a temporary)
SHARD_CONTENTS = Contents("a checkpoint's shards", patterns=("__*_*.distcp", ".metadata", ".metadata.tmp",
                                                             "__*.metadata", "__*.metadata.tmp"))
RUN_CONTENTS = Contents("an agg-bench run", ("config.json", "env.json", "metrics.jsonl", EVALUATIONS_FILE,
                                             "summary.json", "plan.json", CHECKPOINT_NAME),
                        folders=((EVENTS_FOLDER, EVENTS_CONTENTS), (f"{SHARDS_PREFIX}*", SHARD_CONTENTS)))

# ----- agg-bench report: --tables DIR and --plots DIR --------------------------------------------------
# in each folder a report writes, the same stamp: {"manifest": a digest of what the report read (its manifest's
# entries), "tables": a digest of the tables the plots are drawn from}. The two folders are renamed into place one
# after the other; a report killed between them leaves stamps that differ (agg-bench report --check)
STAMP_FILE = "stamp.json"
STAMP_KEYS = ("manifest", "tables")
TABLES_CONTENTS = Contents("agg-bench report tables",
                           ("records.csv", STAMP_FILE, *(f"{name}.{ext}" for name in TABLES for ext in TABLE_FORMATS)))
# what either folder may hold: `--tables DIR --plots DIR` writes both into one folder, and a later run of the
# verb with one of them into that folder finds the other's files there, which are its own, not someone's
REPORT_CONTENTS = Contents("agg-bench report tables or plots",
                           TABLES_CONTENTS.names + tuple(f"{name}.png" for name in PLOTS))

# ----- agg-bench campaign unpack --reference DIR ------------------------------------------------------
# inside the reference, the name whose atomic_path an unpack stages its files under: the folder is made before the
# unpack changes anything there and removed once its runs, manifest and tables are all in place, so while one is
# there the reference is being written or an unpack was cut off (killed) half-way
UNPACK_STAGING = "unpack"


def unpack_under_way(reference: Path) -> Path | None:
    """An unpack's staging folder in ``reference`` (a live unpack's or a killed one's), or None; None too for a
    folder this user may search but not list (the parent of a run folder a reader is given), where no unpack of
    this user's can be under way."""
    if not reference.is_dir():
        return None
    try:
        names = sorted(reference.iterdir())
    except OSError:
        return None
    return next((entry for entry in names if temp_owner(reference / UNPACK_STAGING, entry.name) is not None), None)


def check_no_unpack(reference: Path, what: str) -> None:
    """A UserError, one line naming ``what`` (the file read from ``reference``), while :func:`unpack_under_way`
    finds an unpack there: its manifest, tables and runs may be of two states."""
    staging = unpack_under_way(reference)
    if staging is not None:
        raise UserError(f"{what}: agg-bench campaign unpack into {shown(reference)} is under way or was cut off ({shown(staging.name)} "
                        "is there), so its manifest, tables and runs may disagree; run that unpack (again) first")


def check_no_unpack_above(path: str | Path, up: int, what: str, looked: set[Path]) -> None:
    """:func:`check_no_unpack` of the folder ``up`` levels above ``path`` as named (``runs/..`` and ``.``
    resolved, links not followed: ``REF/runs/X`` two levels, ``REF/calibration/X.json`` two), unless ``looked``
    already holds it (several paths of one reference look into it once); adds it to ``looked``."""
    folder = Path(os.path.abspath(path))
    for _ in range(up):
        folder = folder.parent
    if folder not in looked:
        looked.add(folder)
        check_no_unpack(folder, what)


# ----- agg-bench profile --out DIR (agg_bench.tools.profiling) -----------------------------------------
MEMORY_SNAPSHOT = "memory_snapshot.pickle"


def is_trace_file(name: str) -> bool:
    """Whether ``name`` is a trace the profiler writes (one per profiled cycle)."""
    return name.endswith((".pt.trace.json", ".pt.trace.json.gz"))


def is_profile_file(name: str) -> bool:
    """Whether ``name`` is one that ``agg-bench profile`` writes into its folder."""
    return name in ("config.json", "env.json", "profile.json", "operators.csv", MEMORY_SNAPSHOT) or is_trace_file(name)


PROFILE_CONTENTS = Contents("a profile", match=is_profile_file)

# ----- scripts/gpu_check.sh: its AGG_BENCH_CHECK_OUT folder (removed whole before the check writes it again) ----
GPU_CHECK_CONTENTS = Contents("a scripts/gpu_check.sh output", (
    "env.json", "steps.tsv", "cell.json", "cell.jsonl", "summary.json", "summary.md"), folders=(
    ("runs", Contents("gpu_check runs", folders=(("*", RUN_CONTENTS),))),
    ("logs", Contents("gpu_check logs", patterns=("*.log",))),
    ("profile", PROFILE_CONTENTS), ("locks", Contents("GPU locks", patterns=("gpu-*.lock",)))))


# ----- agg-bench learning: its --tables DIR and --plots DIR (the workflow writes its manifest.json there) -----
CURVE_PLOTS = ("eval_reward_cost", "eval_reward_cpu", "eval_pareto")  # held-out reward against cost (curves.py)
# what either folder may hold: `--tables DIR --plots DIR` writes both into one folder (as for the report's)
LEARNING_CONTENTS = Contents("learning tables or learning plots", (
    "learning.csv", "learning.md", "evaluation.csv", "curves.csv", "manifest.json",  # --tables
    "reward_iteration.png", "reward_time.png", "samples.png", *(f"{name}.png" for name in CURVE_PLOTS)))  # --plots

# ----- agg-bench import-log --out DIR ----------------------------------------------------------------
IMPORT_CONTENTS = Contents("an imported log", ("metrics.jsonl", "summary.json", "env.json"))

# ----- agg-bench pretrain --out DIR (replaced whole, so anything else in it would be lost) -----------------
TOKEN_HASH_FILE = "token_hash.json"  # in a model folder: its conditioning is this embedding, not text encoders
PRETRAIN_MARKER = "pretrain.json"  # what the pretraining did: written last, so a folder with it is whole
# its model folders: diffusers' save_pretrained, a config and the weights, whole or in shards with their index
_MODEL_FOLDER = Contents("a saved model", ("config.json", "diffusion_pytorch_model.safetensors",
                                           "diffusion_pytorch_model.safetensors.index.json"),
                         ("diffusion_pytorch_model-*-of-*.safetensors",))
PRETRAIN_CONTENTS = Contents("an agg-bench pretrain output", (TOKEN_HASH_FILE, "samples.png", PRETRAIN_MARKER),
                             folders=(("transformer", _MODEL_FOLDER),
                                      ("vae", Contents("a pixel decoder", ("config.json",))),
                                      ("scheduler", Contents("a scheduler", ("scheduler_config.json",)))))


def run_config_in(folder: Path) -> dict | None:
    """The run config a run folder holds (its ``config.json``), or None when it is not a run folder."""
    try:
        config = RunFolder(folder).config_object()  # the one reader of a run folder: bounded, one line if bad
    except UserError:
        return None
    return config if isinstance(config, dict) and {"model", "train", "method"} <= set(config) else None


def check_run_folder(out: Path, flag: str = "--out", remedy: str | None = None) -> dict | None:
    """Refuse ``out`` unless it is new, empty or a run folder: nothing a run does not write, no symbolic link
    (:func:`~agg_bench.outdir.check_folder`), and a run's file names only beside a run's config. Returns that
    config (None: no run folder yet). Reads only; ``remedy`` replaces the advice at the end of a refusal."""
    check_folder(out, RUN_CONTENTS, flag, remedy)
    previous = run_config_in(out) if out.is_dir() else None
    if previous is None:  # its files, if any, are not an agg-bench run's
        check_folder(out, Contents(RUN_CONTENTS.what), flag, remedy)
    return previous
