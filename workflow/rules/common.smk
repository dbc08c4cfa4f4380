# The sweep config checked and expanded into jobs, and their command lines: agg_bench/tools/sweep.py. Nothing
# here runs a job; every check happens while the workflow is parsed, before any job starts.
import re
import shlex
from pathlib import Path

import sys

from snakemake.exceptions import WorkflowError

from agg_bench.errors import UserError
from agg_bench.tools.jobresources import check_cpu_settings, drop_gpu_settings_without_gpus
from agg_bench.tools.sweep import (CELL_DIR, DONE_DIR, EMBED_DIR, LEARNING_DIR, LEARNING_RULES, PRETRAINED_DIR, PYTHON,
                                   Sweep, SweepError, check_input_files, check_markers, check_output_contents,
                                   check_output_folders, check_sweep_files, failed_runs, report_failed_runs,
                                   read_sweep_config, runs_behind_manifest, set_arg)
from agg_bench.tools.sweep import pretrain_gpus as sweep_pretrain_gpus

def refuse(message: str):
    """A sweep the workflow refuses while it is parsed, before any job: one line and exit code 2, as an
    agg-bench verb refuses bad input (a WorkflowError here is three lines with the Snakefile's place, exit 1)."""
    print(message, file=sys.stderr, flush=True)
    sys.exit(2)


try:
    # what a job without a GPU asks a cluster for (the Snakefile), read before any job: Snakemake takes any text as a
    # resource, and one that is no number failed only once such a job was submitted
    check_cpu_settings(workflow.resource_settings._parsed_default_resources,
                       workflow.resource_settings._parsed_overwrite_resources)
    # the sweep as agg-bench's YAML loader reads its files, as `agg-bench campaign --config` reads them (Snakemake's
    # parse is YAML 1.1: 017 is 15, 0x10 is 16, 1e-5 is text; it takes repeated keys and nesting aliases without a
    # bound), with the --config overrides merged as Snakemake merges them, and a list or mapping given with --config
    # read as in a sweep file (Snakemake's parse makes its numbers text)
    FILES = check_sweep_files(workflow.configfiles)  # each read once, here
    SWEEP_CONFIG = read_sweep_config(FILES, workflow.config_settings.config_args, workflow.config_settings.config)
    config.clear()
    config.update(SWEEP_CONFIG)
    SWEEP = Sweep(config, Path(workflow.basedir) / "workflow" / "schemas" / "config.schema.yaml",
                  files=workflow.configfiles, read=FILES)
    # the files its jobs read that no job makes, and the runs whose marker outlived their folder
    check_input_files(SWEEP)
    check_markers(SWEEP)
except UserError as err:
    refuse(str(err))
# a run whose marker went while its manifest stayed: Snakemake runs nothing for it unless forced, and says only
# "Nothing to be done" (whether this snakemake is forced is known only after the Snakefile is parsed)
BEHIND = runs_behind_manifest(SWEEP)
if BEHIND:
    print(BEHIND, file=sys.stderr, flush=True)


def check_finished_runs():
    """Before a manifest is written: a run that failed in a cell job is recorded in its folder (the job
    succeeds, so Snakemake keeps the cell's other runs); report those runs as this job's failure, so the
    tables wait, and remove their summaries and markers, so the next invocation reruns their cells (which keep
    the runs that ended)."""
    failed = failed_runs([f"results/runs/{run_id}" for run_id in SWEEP.runs])
    if failed:
        logs = {f"results/runs/{run_id}": f"results/logs/cell/{cell}.log"
                for cell, run_ids in SWEEP.cells.items() for run_id in run_ids}
        markers = {f"results/runs/{run_id}": SWEEP.done_marker(run_id) for run_id in SWEEP.runs}
        raise WorkflowError(report_failed_runs(failed, logs, markers))


def use_run_settings(workflow, target) -> None:
    """The per-rule settings given for rule `run` (a profile's or the command line's set-resources and
    set-threads) applied to ``target``, a rule whose jobs do runs' work under another name (a cell's), then the
    settings given for ``target`` itself, so that its own entry wins. Snakemake applies them by rule name only."""
    from snakemake.resources import Resources

    settings = workflow.resource_settings
    for name in ("run", target.name):
        if name in settings.overwrite_resources:
            target.resources.update(Resources.from_mapping(settings.overwrite_resources[name]))
        if name in settings._parsed_overwrite_threads:
            target.resources["_cores"] = settings._parsed_overwrite_threads[name]


def forget_recorded_jobs(workflow) -> None:
    """Remove the journal of each cell job and run job this snakemake ran to its end (it has recorded that end),
    when the snakemake ends (onsuccess, onerror): an invocation that ended short of the manifest job (a target
    before it, a job that failed elsewhere) left them, and a forced rerun then kept every run instead of
    measuring it again. A journal that a job of a killed snakemake left stays: the rerun of that job keeps its
    runs."""
    dag = workflow.dag
    ended = [job for job in dag.jobs if dag.finished(job)]
    rules = {job.rule.name for job in ended}
    runs = [job.wildcards_dict["run_id"] for job in ended if job.rule.name == "run"]
    SWEEP.forget_attempts([cell for cell in SWEEP.cells if SWEEP.cell_rule(cell) in rules] + runs)
