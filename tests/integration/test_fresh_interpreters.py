"""What a fresh interpreter imports: reading results and loading a config import no torch (and no method); the
record contract imports only the standard library; the workflow's methods check imports no diffusers, peft or
transformers; a run without telemetry.tensorboard imports no tensorboard. Each starts a Python process of its
own, because this test process has all of those loaded already."""
from __future__ import annotations

import ast
import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from agg_bench.config import DEFAULTS
from agg_bench.runtime.scalar_events import FOLDER

ROOT = Path(__file__).resolve().parents[2]
SMALL = ["model.resolution=32", "sampling.steps=4", "grpo.group_size=2", "grpo.prompts_per_iteration=1",
         "progress=false"]


# ----- the results readers and the record contract (tests/unit/test_records.py) -----


@pytest.mark.parametrize("module", ["agg_bench.records", "agg_bench.results.loading",
                                    "agg_bench.results.tables", "agg_bench.results.formatting",
                                    "agg_bench.results.plots", "agg_bench.results.report",
                                    "agg_bench.results.learning_tables", "agg_bench.tools.importlog"])
def test_reading_results_imports_no_torch(module):
    # a fresh interpreter: this test process has torch loaded already
    code = f"import sys, {module}; print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", f"{module} imports torch: {out.stdout.strip()[:200]}"


def test_records_imports_only_the_standard_library():
    code = ("import sys; before = set(sys.modules); import agg_bench.records; "
            "print(sorted(m for m in set(sys.modules) - before if not m.startswith('agg_bench')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    new = ast.literal_eval(out.stdout)  # a list literal of module names
    assert not [m for m in new if m.split(".")[0] in ("torch", "numpy", "pandas", "yaml", "diffusers")], new


def test_the_command_line_imports_the_config_package_only_to_read_a_flag():
    """The parser of every verb (what ``agg-bench --help`` builds) imports no config package, YAML or JSON Schema:
    importing them with the command line doubled the start-up of every command; reading a number flag does."""
    code = ("import json, sys; from agg_bench.cli import build_parser; parser = build_parser(); "
            "heavy = lambda: sorted(m for m in ('agg_bench.config', 'yaml', 'jsonschema') if m in sys.modules); "
            "before = heavy(); parser.parse_args(['plan', '--gpus', '2']); print(json.dumps([before, heavy()]))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert json.loads(out.stdout) == [[], ["agg_bench.config", "jsonschema", "yaml"]], out.stdout


def test_a_usage_error_of_one_process_imports_no_config_package():
    """Printing the one line of a usage error (an unknown verb) imports no config package: only a process that
    torchrun started (``WORLD_SIZE`` set) reads the launcher's numbers to decide which process prints it."""
    code = ("import json, sys; from agg_bench.cli import main\n"
            "try:\n    main(['no-such-verb'])\nexcept SystemExit as stop:\n    code = stop.code\n"
            "print(json.dumps([code, 'agg_bench.config' in sys.modules]))")
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT, env=env)
    assert json.loads(out.stdout) == [2, False], out.stdout + out.stderr


# ----- loading a config (tests/unit/test_config_docs.py) -----


LOADING_SCRIPT = """
import json, sys
from agg_bench.config import load_config
from agg_bench.reading import RunFolder
run = load_config("config/run.yaml")
agg = load_config(None, ['method={"name": "agg", "window": 2}', "model.preset=random", "model.family=flux"])
folder = RunFolder(sys.argv[1]).config()
print(json.dumps({"names": [run.method.name, agg.method.name, folder.model.preset, folder.method.name],
                  "modules": sorted({name.partition(".")[0] for name in sys.modules})}))
"""


def test_loading_a_config_imports_no_torch_and_no_method(tmp_path):
    """Loading a run config (a random preset's, a method with options) and reading a run folder's config.json
    (a random preset, a method named by a dotted path) import no torch, no diffusers and no baseline: a
    results folder never names code to load."""
    folder = tmp_path / "run"
    folder.mkdir()
    written = {**copy.deepcopy(DEFAULTS), "model": {**DEFAULTS["model"], "preset": "random"},
               "method": {"name": "not_a_package.anywhere:Estimator", "window": 3}}
    (folder / "config.json").write_text(json.dumps(written))
    proc = subprocess.run([sys.executable, "-c", LOADING_SCRIPT, str(folder)], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    answer = json.loads(proc.stdout)
    assert answer["names"] == [yaml_method_name(), "agg", "random", "not_a_package.anywhere:Estimator"]
    assert {"torch", "diffusers", "baselines", "not_a_package"} & set(answer["modules"]) == set()


def yaml_method_name() -> str:
    return yaml.safe_load((ROOT / "config" / "run.yaml").read_text())["method"]["name"]


# ----- the workflow's methods check (tests/unit/test_import_graph.py) -----


# A fresh interpreter runs the methods' check of the embedded default's every job, then of every cache with
# each cache_in, as `python -m agg_bench.tools.sweep` does for a sweep, and reports what it imported.
METHOD_CHECKS_SCRIPT = """
import json, sys, yaml
from agg_bench.tools import sweep
from baselines.caches import CACHES
jobs = {}
def check_here(base_file, checks, cache_dir=None, replays=None):  # the child process's check, run in this one
    jobs.update(checks)
    assert replays  # the gradcheck jobs' replays, checked too
    return sweep.check_methods(base_file, checks, replays)
sweep.checked_methods = check_here
embedded = sweep.Sweep(yaml.safe_load(open("config/config.yaml")), "workflow/schemas/config.schema.yaml", None)
pairs = next(iter(jobs.values()))
caches = sweep.check_methods(embedded.base_file, {
    f"{name} in {where}": [*pairs, ["method", {"name": "cached", "cache": name, "cache_in": where}]]
    for name in CACHES for where in ("rollout", "train", "both")})
print(json.dumps({"runs": {run_id: run["method_options"]["name"] for run_id, run in embedded.runs.items()},
                  "caches": sorted({options["cache"] for options in caches.values()}), "known_caches": sorted(CACHES),
                  "modules": sorted({name.partition(".")[0] for name in sys.modules})}))
"""


def test_the_methods_checks_import_no_diffusers():
    proc = subprocess.run([sys.executable, "-c", METHOD_CHECKS_SCRIPT], cwd=ROOT, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    answer = json.loads(proc.stdout.strip().splitlines()[-1])
    embedded = yaml.safe_load((ROOT / "config" / "config.yaml").read_text())
    checked = {answer["runs"][run_id] for run_id in answer["runs"]}
    assert checked == {section["method"]["name"] for section in embedded["methods"].values()}
    assert len(answer["runs"]) == len(embedded["methods"]) * len(embedded["models"]) * len(embedded["resolutions"])
    assert answer["caches"] == answer["known_caches"] and len(answer["caches"]) >= 8
    assert "torch" in answer["modules"]  # the checks did build the methods
    assert {"diffusers", "peft", "transformers"} & set(answer["modules"]) == set()


@pytest.mark.parametrize("config", ["test.yaml", "learning.yaml"])
def test_the_workflows_start_imports_no_model_library(tmp_path, config):
    """Snakemake parses the Snakefile at every start (a dry run, `make pipeline`'s two commands, each job with a
    run: block, each test of the workflow): it imports no diffusers, torch or matplotlib (the pretrain module's
    imports made every start about five CPU-seconds longer). A sweep's pretrain entries are read in a child
    process, whose answer is kept for the next start."""
    from test_pipeline import workdir

    work = workdir(tmp_path)
    script = ("import runpy, sys; sys.argv = ['snakemake', '-n', '--configfile', 'config/%s']\n"
              "try:\n    runpy.run_module('snakemake', run_name='__main__')\n"
              "except SystemExit as end:\n    assert not end.code, end.code\n"
              "print(sorted(m for m in ('diffusers', 'torch', 'matplotlib') if m in sys.modules), file=sys.stderr)"
              % config)
    proc = subprocess.run([sys.executable, "-c", script], cwd=work, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stderr.rstrip().splitlines()[-1] == "[]", proc.stderr[-3000:]
    kept = list(work.glob(".snakemake/agg-bench/pretrain-*.json"))
    assert len(kept) == (config == "learning.yaml")
    if kept:
        sweep = yaml.safe_load((work / "config" / config).read_text())
        assert set(json.loads(kept[0].read_text())["answer"]) == set(sweep["pretrain"])


def test_a_refused_run_or_pretrain_imports_no_trainer_or_model_library(tmp_path):
    """`agg-bench run` with a config it refuses prints its one line before the trainer and the model libraries are
    imported (they made a refused run about three times as long, paid by each process under torchrun); one whose
    config passes and whose folder the trainer refuses (someone's files), before the model code (the session, the
    model libraries). `agg-bench pretrain` refuses a key's value before torch: its module's imports made the
    one line take about six CPU-seconds, and `agg-bench learning` refuses an option's value, its manifest or a run
    folder before torch and diffusers (about eight CPU-seconds), without an output to write too.
    `agg-bench gradcheck` refuses a bad grid option (--windows, --methods) before torch and the model code: they
    made its one line take about eight CPU-seconds. One process runs them, the run last (the run's check of its
    config imports torch)."""
    script = ("import json, sys; from agg_bench.cli import main\n"
              "for args, modules in json.loads(sys.argv[1]):\n"
              "    code = main(args)\n"
              "    print(code, sorted(m for m in modules if m in sys.modules), file=sys.stderr)")
    out, theirs, model, table = tmp_path / "run", tmp_path / "theirs", tmp_path / "model", tmp_path / "grad.csv"
    theirs.mkdir()
    (theirs / "notes.txt").write_text("mine")
    tables, lean = str(tmp_path / "tables"), ["torch", "diffusers", "agg_bench.runtime.evaluation"]
    (tmp_path / "runs.json").write_text(json.dumps({"runs": [{"dir": str(tmp_path / "nowhere"), "method": "full",
                                                              "seed": 0}]}))
    cases = [(["learning", "--manifest", str(tmp_path / "manifest.json")], lean),
             (["learning", "--manifest", str(tmp_path / "manifest.json"), "--tables", tables, "--eval-sampler", "euler",
               "--eval-noises", "1"], lean),
             (["learning", "--manifest", str(tmp_path / "manifest.json"), "--tables", tables, "--eval-seed", "1"], lean),
             (["learning", "--manifest", str(tmp_path / "manifest.json"), "--plots", tables], lean),
             (["learning", "--manifest", str(tmp_path / "runs.json"), "--plots", tables], lean),
             (["pretrain", "--set", "steps=0", "--out", str(model)], ["torch", "diffusers", "agg_bench.tools.pretrain"]),
             *((["gradcheck", *grid, "--out", str(table)], ["torch", "diffusers", "agg_bench.tools.gradcheck",
                                                            "agg_bench.methods.base"])
               for grid in (["--windows", "2,x"], ["--methods", "fraction,,agg"])),
             (["run", "--set", "train.iterations=abc", "--out", str(out)],
              ["agg_bench.runtime.train", "diffusers", "matplotlib"]),
             (["run", "--set", "progress=false", "--out", str(theirs)], ["agg_bench.runtime.session", "diffusers"])]
    proc = subprocess.run([sys.executable, "-c", script, json.dumps(cases)],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 0 and len(lines) == 20, proc.stderr[-3000:]
    assert "give --tables DIR and/or --plots DIR" in lines[0] and lines[1] == "2 []", proc.stderr[-3000:]
    assert "--eval-sampler = 'euler'" in lines[2] and lines[3] == "2 []", proc.stderr[-3000:]
    assert "--eval-seed 1: sets the checkpoint evaluation's noise" in lines[4] and lines[5] == "2 []", proc.stderr[-3000:]
    assert "manifest.json: no such file" in lines[6] and lines[7] == "2 []", proc.stderr[-3000:]
    assert "nowhere" in lines[8] and lines[9] == "2 []", proc.stderr[-3000:]
    lines = lines[8:]
    assert "steps = 0" in lines[2] and lines[3] == "2 []", proc.stderr[-3000:]
    assert "--windows = '2,x'" in lines[4] and lines[5] == "2 []", proc.stderr[-3000:]
    assert "--methods = 'fraction,,agg'" in lines[6] and lines[7] == "2 []", proc.stderr[-3000:]
    assert "train.iterations" in lines[8] and lines[9] == "2 []", proc.stderr[-3000:]
    assert f"--out {theirs}" in lines[10] and "notes.txt" in lines[10] and lines[11] == "2 []", proc.stderr[-3000:]
    assert not out.exists() and not model.exists() and not table.exists()
    assert [p.name for p in theirs.iterdir()] == ["notes.txt"]
    assert not (tmp_path / "tables").exists()


# ----- a run with telemetry.tensorboard off (tests/unit/test_tensorboard.py) -----


def test_off_by_default_no_folder_and_no_tensorboard_imported(tmp_path):
    assert DEFAULTS["telemetry"]["tensorboard"] is False
    out = tmp_path / "run"
    args = ["run", *[a for o in (*SMALL, "train.iterations=1") for a in ("--set", o)], "--out", str(out)]
    # a fresh process: what the run imports, printed last
    script = ("import json, sys; from agg_bench.cli import main; code = main(sys.argv[1:]); "
              "print(json.dumps(sorted(m for m in sys.modules if 'tensorboard' in m)), file=sys.stderr); "
              "sys.exit(code)")
    proc = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True,
                          cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(proc.stderr.strip().splitlines()[-1]) == []
    assert not (out / FOLDER).exists()
