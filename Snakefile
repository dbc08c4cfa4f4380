# agg-bench workflow: a sweep config -> training runs, gradient replays -> tables, plots, HTML report.
#   snakemake --cores 2                                   the embedded CPU default (config/config.yaml)
#   snakemake --cores 64 --resources gpu=8 --configfile config/gpu.yaml    one 8-GPU node
#   snakemake --workflow-profile workflow/profiles/slurm --configfile config/gpu.yaml     through SLURM
#   snakemake --report results/report.html                the HTML report of what ran
import sys

from snakemake.utils import min_version

min_version("9.0")

# A --configfile replaces the default instead of being merged into it: sweeps are lists of labels, and
# a paper-scale sweep must not inherit the CPU default's methods or models.
if not workflow.overwrite_configfiles:

    configfile: "config/config.yaml"


report: "workflow/report/workflow.rst"


include: "workflow/rules/common.smk"
include: "workflow/rules/runs.smk"
include: "workflow/rules/report.smk"
include: "workflow/rules/learning.smk"


localrules: all, manifest, tables, plots, import_log, cell_jobs


# Snakemake starts each `run:` job (the manifests, a cell's job file) as a shell command with its interpreter's
# path unquoted: with a space in that path (a clone under "/tmp/my dir/" holds its .venv there) every such job
# fails with "/bin/sh: 1: /tmp/my: not found". Refused before any job instead (once the execution settings
# are known: not while the Snakefile is parsed).
onstart:
    # the learning report's rules run under any sweep, on the learning section's defaults where it has none: the
    # runs are checked as it will check them before any job (which jobs the targets ask for is known only here)
    if any(job.rule.name in LEARNING_RULES for job in workflow.dag.jobs):
        try:
            SWEEP.check_learning()
        except UserError as err:
            refuse(str(err))
    if not workflow.execution_settings.use_threads and any(c.isspace() for c in sys.executable):
        raise WorkflowError(f"the interpreter's path {sys.executable!r} holds a space, and Snakemake starts the "
                            "workflow's run: jobs through a shell with that path unquoted: clone the repository (or "
                            "make its .venv) where the path has no space, or pass --force-use-threads")


wildcard_constraints:
    run_id=r"[A-Za-z0-9][A-Za-z0-9._-]*",
    name=r"[A-Za-z0-9][A-Za-z0-9._-]*",
    model=r"[A-Za-z0-9][A-Za-z0-9.-]*",
    label=r"[A-Za-z0-9][A-Za-z0-9.-]*",


rule all:
    default_target: True
    input:
        TABLE_FILES,
        "results/tables/records.csv",
        [f"results/plots/{name}.png" for name in PLOT_NAMES],


# A cell job does the work of its runs, so the per-rule settings of a profile or the command line for `run`
# (set-resources, set-threads: the SLURM profile's gpu_model, cpus_per_gpu, runtime, mem_mb) are its own;
# Snakemake applies them by rule name only, and a cell's rule (workflow/rules/runs.smk) is named after the
# cell. An entry for the cell's own rule still comes last.
for CELL in SWEEP.cells:
    use_run_settings(workflow, workflow.get_rule(SWEEP.cell_rule(CELL)))


# a job that takes no GPU (a CPU device's) asks a cluster for none: no gpu_model, cpus_per_gpu, GPU partition or
# GPU node's memory from the SLURM profile, whose per-rule settings cannot tell a rule's CPU jobs from its GPU jobs,
# and cpu_runtime where set (both read before the sweep: common.smk)
for RULE in workflow.rules:
    drop_gpu_settings_without_gpus(RULE.resources, workflow.resource_settings._parsed_default_resources)


# a cell job and a run job leave their journal (agg-bench cell --keep-journal, agg-bench run --journal) for a rerun
# of a job whose end went unrecorded; once this snakemake has recorded the ends of the jobs it ran, their journals
# go (docs/workflow.md)
onsuccess:
    forget_recorded_jobs(workflow)


onerror:
    forget_recorded_jobs(workflow)


# a file where one of the workflow's folders goes: one line, not Snakemake's NotADirectoryError (the runs' own
# folders are no rule's output: a run job's output is its marker)
try:
    check_output_folders([*(path for rule in workflow.rules
                            for path in [*rule.output, *rule.log, *([rule.benchmark] if rule.benchmark else [])]),
                          "results/runs/{run_id}/summary.json"])
    # someone's files in a folder that a job writes into: refused here, not when that job runs (the tables' after
    # every run)
    check_output_contents(SWEEP)
except UserError as err:
    refuse(str(err))
