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
        gpu=lambda wc: SWEEP.gpus(SWEEP.embeddings[wc.model]["device"]),
    params:
        command=lambda wc: SWEEP.embed_command(wc.model),
    shell:
        "OMP_NUM_THREADS={threads} {params.command} > {log} 2>&1"


rule run:
    input:
        lambda wc: SWEEP.inputs(SWEEP.runs[wc.run_id]["model"]),
    output:
        summary="results/runs/{run_id}/summary.json",
        metrics="results/runs/{run_id}/metrics.jsonl",
        env="results/runs/{run_id}/env.json",
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


rule gradcheck:
    input:
        lambda wc: SWEEP.inputs(SWEEP.gradchecks[wc.name]["model"]),
    output:
        "results/gradcheck/{name}.csv",
    log:
        "results/logs/gradcheck/{name}.log",
    benchmark:
        "results/benchmarks/gradcheck/{name}.tsv"
    threads: lambda wc: SWEEP.threads(SWEEP.gradchecks[wc.name]["device"])
    resources:
        gpu=lambda wc: SWEEP.gpus(SWEEP.gradchecks[wc.name]["device"]),
    params:
        command=lambda wc: SWEEP.gradcheck_command(wc.name),
    shell:
        "OMP_NUM_THREADS={threads} {params.command} > {log} 2>&1"


rule calibrate:
    input:
        lambda wc: SWEEP.inputs(SWEEP.calibrations[wc.name]["model"]),
    output:
        "results/calibration/{name}.json",
    log:
        "results/logs/calibrate/{name}.log",
    benchmark:
        "results/benchmarks/calibrate/{name}.tsv"
    threads: lambda wc: SWEEP.threads(SWEEP.calibrations[wc.name]["device"])
    resources:
        gpu=lambda wc: min(1, SWEEP.gpus(SWEEP.calibrations[wc.name]["device"])),
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
