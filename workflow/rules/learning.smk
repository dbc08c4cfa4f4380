# The learning testbed (config/learning.yaml; docs/learning.md): scene models pre-trained once into
# results/pretrained/<label>/ (later runs reuse them), then the learning tables and plots of the sweep's runs
# (with the runs' in-run evaluations, eval.every > 0: the held-out curves against cost and the cost to a target).
#   snakemake --cores 2 --configfile config/learning.yaml learning      (make learning)
from agg_bench.tools.sweep import checked_pretrain, learning_command_options

PRETRAIN = config.get("pretrain") or {}
LEARNING = config.get("learning") or {}
LEARNING_FILES = [f"{LEARNING_DIR}/learning.{ext}" for ext in ("csv", "md")] + \
    [f"{LEARNING_DIR}/{name}.csv" for name in ("evaluation", "curves")] + \
    [f"{LEARNING_DIR}/{name}.png" for name in ("reward_iteration", "reward_time", "samples", "eval_reward_cost",
                                              "eval_reward_cpu", "eval_pareto")]


def pretrain_command(name: str, threads: int) -> str:
    """The pretrain job's command line, on the `threads` cores Snakemake gave it (fewer than the config's
    where --cores is smaller): never more threads than the job reserves. On `device: cuda` it takes its GPU
    from the pool, as a run does (a fixed `cuda:N` is refused before any job: load_pretrain_configs)."""
    spec = PRETRAIN[name]
    sets = " ".join(set_arg(k, v) for k, v in {**(spec.get("set") or {}), "threads": threads}.items())
    pool = f"{PYTHON} -m agg_bench.machine.gpus --count 1 -- " if pretrain_gpus(name) else ""
    return (f"{pool}{PYTHON} -m agg_bench pretrain --config {shlex.quote(spec['config'])} {sets} "
            f"--out {PRETRAINED_DIR}/{name}")


def load_pretrain_configs() -> dict:
    """Each pretrain entry's threads and device, its config read with its --set applied: once, before any job,
    so that one the pretrain command refuses is one line naming the entry (in a job's threads it was an
    InputFunctionException). Read in a child process whose answer is kept in .snakemake/agg-bench (the pretrain
    module imports torch, diffusers and matplotlib: seconds of every snakemake's start)."""
    if not PRETRAIN:
        return {}
    try:
        return checked_pretrain(PRETRAIN)
    except UserError as err:
        refuse(str(err))


PRETRAIN_CONFIGS = load_pretrain_configs()


def pretrain_config(name: str):
    """The pretrain entry's {"threads", "device"}, its --set applied."""
    return PRETRAIN_CONFIGS[name]


def pretrain_threads(name: str) -> int:
    """The pretrain config's `threads` (its --set first; 0 or absent: 1), so Snakemake reserves those cores."""
    return max(1, pretrain_config(name)["threads"])


def pretrain_gpus(name: str) -> int:
    """The GPUs a pretrain job takes from the pool (its gpu resource, which Snakemake and SLURM give it): 1 on
    CUDA."""
    return sweep_pretrain_gpus(name, pretrain_config(name)["device"])


localrules: learning, learning_manifest


rule pretrain:
    input:
        lambda wc: PRETRAIN[wc.name]["config"],
    output:
        directory(f"{PRETRAINED_DIR}/{{name}}"),
    log:
        "results/logs/pretrain/{name}.log",
    benchmark:
        "results/benchmarks/pretrain/{name}.tsv"
    threads: lambda wc: pretrain_threads(wc.name)
    resources:
        gpu=lambda wc: pretrain_gpus(wc.name),
    params:
        command=lambda wc, threads: pretrain_command(wc.name, threads),
    shell:
        "OMP_NUM_THREADS={threads} {params.command} > {log} 2>&1"


rule learning_manifest:
    input:
        SWEEP.summaries(),
    output:
        f"{LEARNING_DIR}/manifest.json",
    log:
        "results/logs/learning_manifest.log",
    params:
        manifest=SWEEP.manifest(),
    run:
        from agg_bench.io import write_json

        check_finished_runs()
        SWEEP.forget_attempts()  # every run job's and cell job's end is recorded: a forced rerun runs every run again
        write_json(output[0], params.manifest)
        with open(log[0], "w") as handle:
            handle.write(f"{output[0]}: {len(params.manifest['runs'])} runs\n")


rule learning_report:
    input:
        manifest=f"{LEARNING_DIR}/manifest.json",
        runs=SWEEP.summaries(),
    output:
        LEARNING_FILES,
    log:
        "results/logs/learning.log",
    params:
        options=shlex.join(learning_command_options(LEARNING)),
    shell:
        "OMP_NUM_THREADS={threads} {PYTHON} -m agg_bench learning --manifest {input.manifest} {params.options} "
        "--tables {LEARNING_DIR} --plots {LEARNING_DIR} > {log} 2>&1"


rule learning:
    input:
        LEARNING_FILES,
        SWEEP.gradcheck_files(),
        [f"{PRETRAINED_DIR}/{name}" for name in PRETRAIN],
