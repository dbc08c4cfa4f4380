# Jobs that measure: prompt embeddings, training runs, gradient replays, cost-model calibrations,
# imported reference logs.
# Each is one `agg-bench` command (see common.smk for how the command lines are composed).


rule embed:
    output:
        f"{EMBED_DIR}/{{model}}.safetensors",
    log:
        "results/logs/embed/{model}.log",
    benchmark:
        "results/benchmarks/embed/{model}.tsv"
    threads: lambda wc: SWEEP.threads(SWEEP.embeddings[wc.model]["device"])
    resources:
        gpu=lambda wc: SWEEP.tool_gpus(SWEEP.embeddings[wc.model]["device"]),
    params:
        command=lambda wc: SWEEP.embed_command(wc.model),
    shell:
        "OMP_NUM_THREADS={threads} {params.command} > {log} 2>&1"


# a run on its own: GPU runs (each holds its GPUs and their memory alone), and CPU runs a cell job does not take
rule run:
    wildcard_constraints:
        run_id="|".join(re.escape(run_id) for run_id in SWEEP.single_runs) or "(?!)",
    input:
        lambda wc: SWEEP.inputs(SWEEP.runs[wc.run_id]),
    output:
        # the run's marker, not its files: Snakemake removes the outputs of a job that fails or is stopped,
        # and a stopped run continues from its checkpoint (agg-bench run --resume-stopped)
        f"{DONE_DIR}/{{run_id}}.json",
    log:
        "results/logs/run/{run_id}.log",
    benchmark:
        "results/benchmarks/run/{run_id}.tsv"
    threads: lambda wc: SWEEP.threads(SWEEP.runs[wc.run_id]["device"])
    resources:
        gpu=lambda wc: SWEEP.gpus(SWEEP.runs[wc.run_id]["device"]),
    params:
        command=lambda wc: SWEEP.run_command(wc.run_id),
    shell:
        "OMP_NUM_THREADS={threads} {params.command} > {log} 2>&1"


# Cell jobs: the runs of one model x resolution on a CPU device, or on a one-GPU device whose runs_per_job asks
# for it, in one process (`agg-bench cell`), which pays torch's and diffusers' imports and the model's build once
# instead of once per run (docs/workflow.md, "Cell jobs"). Each run still writes its own folder; the cell's job
# file lists the runs' `agg-bench run` arguments.
rule cell_jobs:
    output:
        f"{CELL_DIR}/{{cell}}.json",
    wildcard_constraints:
        cell="|".join(re.escape(cell) for cell in SWEEP.cells) or "(?!)",
    log:
        "results/logs/cell_jobs/{cell}.log",
    params:
        jobs=lambda wc: SWEEP.cell_jobs(wc.cell),
    run:
        from agg_bench.io import write_json

        write_json(output[0], params.jobs)
        with open(log[0], "w") as handle:
            handle.write(f"{output[0]}: {len(params.jobs['runs'])} runs\n")


# one rule per cell job: a rule's outputs are named by its wildcards, and a cell's are its runs' markers
for CELL, RUN_IDS in SWEEP.cells.items():

    rule:
        name:
            SWEEP.cell_rule(CELL)
        input:
            f"{CELL_DIR}/{CELL}.json",
            SWEEP.inputs(*(SWEEP.runs[run_id] for run_id in RUN_IDS)),
        output:
            SWEEP.cell_outputs(CELL),
        log:
            f"results/logs/cell/{CELL}.log",
        benchmark:
            f"results/benchmarks/cell/{CELL}.tsv"
        threads: SWEEP.threads(SWEEP.runs[RUN_IDS[0]]["device"])
        resources:
            gpu=SWEEP.gpus(SWEEP.cell_device(CELL)),
        params:
            command=SWEEP.cell_command(CELL),
        shell:
            "OMP_NUM_THREADS={threads} {params.command} > {log} 2>&1"


rule gradcheck:
    input:
        lambda wc: SWEEP.inputs(SWEEP.gradchecks[wc.name]),
    output:
        "results/gradcheck/{name}.csv",
    log:
        "results/logs/gradcheck/{name}.log",
    benchmark:
        "results/benchmarks/gradcheck/{name}.tsv"
    threads: lambda wc: SWEEP.threads(SWEEP.gradchecks[wc.name]["device"])
    resources:
        gpu=lambda wc: SWEEP.tool_gpus(SWEEP.gradchecks[wc.name]["device"]),
    params:
        command=lambda wc: SWEEP.gradcheck_command(wc.name),
    shell:
        "OMP_NUM_THREADS={threads} {params.command} > {log} 2>&1"


rule calibrate:
    input:
        lambda wc: SWEEP.inputs(SWEEP.calibrations[wc.name]),
    output:
        "results/calibration/{name}.json",
    log:
        "results/logs/calibrate/{name}.log",
    benchmark:
        "results/benchmarks/calibrate/{name}.tsv"
    threads: lambda wc: SWEEP.threads(SWEEP.calibrations[wc.name]["device"])
    resources:
        gpu=lambda wc: SWEEP.gpus(SWEEP.calibrations[wc.name]["device"]),
    params:
        command=lambda wc: SWEEP.calibrate_command(wc.name),
    shell:
        "OMP_NUM_THREADS={threads} {params.command} > {log} 2>&1"


rule import_log:
    input:
        lambda wc: SWEEP.references[wc.label]["log"],
    output:
        summary="results/imported/{label}/summary.json",
        metrics="results/imported/{label}/metrics.jsonl",
    log:
        "results/logs/import/{label}.log",
    params:
        command=lambda wc: SWEEP.import_command(wc.label),
    shell:
        "OMP_NUM_THREADS={threads} {params.command} > {log} 2>&1"
