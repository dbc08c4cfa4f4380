# Jobs that summarize: the manifest of this sweep's runs, the tables, the plots.
from agg_bench.records import PLOTS as PLOT_NAMES
from agg_bench.records import TABLES, plot_table_files, table_files

TABLE_FILES = table_files()


# written once every run has ended; a run that failed in a cell job fails this job instead (common.smk)
rule manifest:
    input:
        SWEEP.summaries(),
    output:
        "results/manifest.json",
    log:
        "results/logs/manifest.log",
    params:
        manifest=SWEEP.manifest(),
    run:
        from agg_bench.io import write_json

        check_finished_runs()
        SWEEP.forget_attempts()  # every run job's and cell job's end is recorded: a forced rerun runs every run again
        write_json(output[0], params.manifest)
        with open(log[0], "w") as handle:
            handle.write(f"{output[0]}: {len(params.manifest['runs'])} runs, "
                         f"{len(params.manifest['gradcheck'])} gradcheck tables\n")


# each table in the report: its HTML page, shown in place, and its CSV, grouped by table
TABLE_SECTIONS = {"summary": "Summary", "efficiency": "Efficiency", "ablation": "Gradient ablation", "gpus": "Hardware"}


rule tables:
    input:
        manifest="results/manifest.json",
        runs=SWEEP.summaries(),
        gradcheck=SWEEP.gradcheck_files(),
        calibration=SWEEP.calibration_files(),
    output:
        html=[report(f"results/tables/{name}.html", caption=f"../report/{name}.rst", category="Tables",
                     subcategory=TABLE_SECTIONS[name]) for name in TABLES],
        csv=[report(f"results/tables/{name}.csv", caption=f"../report/{name}.rst", category="Tables",
                    subcategory=TABLE_SECTIONS[name]) for name in TABLES],
        markdown=table_files(formats=("md",)),
        records="results/tables/records.csv",
    log:
        "results/logs/tables.log",
    shell:
        "OMP_NUM_THREADS={threads} {PYTHON} -m agg_bench report --manifest {input.manifest} --tables results/tables > {log} 2>&1"


# the plots are drawn from the tables job's files, not from the runs again
rule plots:
    input:
        plot_table_files("results/tables"),
    output:
        [report(f"results/plots/{name}.png", caption=f"../report/{name}.rst", category="Plots")
         for name in PLOT_NAMES],
    log:
        "results/logs/plots.log",
    shell:
        "OMP_NUM_THREADS={threads} {PYTHON} -m agg_bench report --tables-in results/tables --plots results/plots > {log} 2>&1"
