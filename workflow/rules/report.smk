# Jobs that summarize: the manifest of this sweep's runs, the tables, the plots.
from agg_bench.records import PLOTS as PLOT_NAMES
from agg_bench.records import table_files

TABLE_FILES = table_files()


rule manifest:
    output:
        "results/manifest.json",
    params:
        manifest=SWEEP.manifest(),
    run:
        from agg_bench.io import write_json

        write_json(output[0], params.manifest)


rule tables:
    input:
        manifest="results/manifest.json",
        runs=SWEEP.summaries(),
        gradcheck=SWEEP.gradcheck_files(),
    output:
        efficiency=report("results/tables/efficiency.csv", caption="../report/efficiency.rst", category="Tables"),
        ablation=report("results/tables/ablation.csv", caption="../report/ablation.rst", category="Tables"),
        gpus=report("results/tables/gpus.csv", caption="../report/gpus.rst", category="Tables"),
        markdown=[f for f in TABLE_FILES if f.endswith(".md")],
        records="results/tables/records.csv",
    log:
        "results/logs/tables.log",
    shell:
        "{PYTHON} -m agg_bench report --manifest {input.manifest} --tables results/tables > {log} 2>&1"


rule plots:
    input:
        manifest="results/manifest.json",
        runs=SWEEP.summaries(),
        gradcheck=SWEEP.gradcheck_files(),
    output:
        [report(f"results/plots/{name}.png", caption=f"../report/{name}.rst", category="Plots")
         for name in PLOT_NAMES],
    log:
        "results/logs/plots.log",
    shell:
        "{PYTHON} -m agg_bench report --manifest {input.manifest} --plots results/plots > {log} 2>&1"
