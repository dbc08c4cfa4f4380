"""agg_bench.tools.sweep and agg_bench.engine.families: a sweep config expanded into jobs and checked without importing
torch, resolutions checked from the model's configs, and the methods' check kept between parses."""
import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from agg_bench.engine.families import ImageGeometry, check_resolution, model_geometry
from agg_bench.engine.models import build_tiny_transformer, build_tiny_vae, load_policy
from agg_bench.errors import ConfigError, UserError
from agg_bench.tools import sweep as sweep_module
from agg_bench.tools.importlog import check_labels
from agg_bench.tools.sweep import Sweep, SweepError, flatten, set_arg
from helpers import methods_checked_here

ROOT = Path(__file__).resolve().parents[2]
SCHEMA = ROOT / "workflow" / "schemas" / "config.schema.yaml"
HEAVY = ("torch", "diffusers", "peft", "transformers")


def sweep_config(name: str = "test.yaml") -> dict:
    return yaml.safe_load((ROOT / "config" / name).read_text())


@pytest.fixture
def in_process(monkeypatch):
    """The methods' check run in this process (torch is already imported here), counting its calls."""
    calls = methods_checked_here(monkeypatch)
    monkeypatch.chdir(ROOT)  # base: config/run.yaml is relative to the working directory
    return calls


def test_sweep_jobs_commands_and_manifest(in_process):
    sweep = Sweep(sweep_config(), SCHEMA)
    assert sorted(sweep.runs) == ["agg-w3_sd3_32px_s0_cpu", "full_sd3_32px_s0_cpu"]
    assert list(sweep.gradchecks) == ["sd3_32px_cpu"]
    # one methods' check for every run and gradcheck of the sweep
    assert len(in_process) == 1 and len(in_process[0]) == 3
    command = sweep.run_command("agg-w3_sd3_32px_s0_cpu")
    assert command.startswith(f"{sweep_module.PYTHON} -m agg_bench run --config config/run.yaml ")
    assert "--set 'method={name: agg, window: 3, alpha: sigma}'" in command
    # a stopped attempt continues from its checkpoint; the job's output is the run's marker, not its files
    assert "--set model.resolution=32" in command and command.endswith(
        "--out results/runs/agg-w3_sd3_32px_s0_cpu --resume-stopped --overwrite --done results/done/agg-w3_sd3_32px_s0_cpu.json "
        "--journal results/cells/agg-w3_sd3_32px_s0_cpu.progress.json")  # a run ended unseen is kept (test_cell.py)
    runs = {Path(r["dir"]).name: r for r in sweep.manifest()["runs"]}
    options = runs["agg-w3_sd3_32px_s0_cpu"]["method_options"]
    # the method's resolved options: the sweep's plus the defaults of the rest
    assert options["name"] == "agg" and (options["window"], options["alpha"]) == (3, "sigma")
    assert (options["route_frac"], options["endpoint_velocity"]) == (1.0, "recompute")
    assert runs["full_sd3_32px_s0_cpu"]["method_options"] == {"name": "full", "micro_batch": None}
    # --method-repeats only beside the --method timings it sets the rounds of (calibrate refuses it alone)
    [calibration] = sweep.calibrations
    sweep.sweep["calibrate"] = {"repeats": 5, "method_repeats": 3}
    assert "--repeats 5 --method-repeats 3 --method full " in sweep.calibrate_command(calibration)
    sweep.sweep["calibrate"]["time_methods"] = False
    command = sweep.calibrate_command(calibration)
    assert "--repeats 5 " in command and "--method" not in command


def test_flatten_keeps_method_sections_whole():
    assert flatten({"train": {"lr": 1e-5, "plan": "groups"}, "method": {"name": "agg", "window": 3},
                    "reward": {"options": {"quality": 50}}}) == [
        ("train.lr", 1e-5), ("train.plan", "groups"), ("method", {"name": "agg", "window": 3}),
        ("reward.options", {"quality": 50})]
    assert set_arg("sampling.steps", 10) == "--set sampling.steps=10"


@pytest.mark.parametrize("value", ["1e-5", "3E+2", "1.5e3", "017", "yes", "off", "true", "null", "1:30", 1e-5, 300.0,
                                   17, True, None, {"run_id": "1e5", "on": "x0"}, ["2e3", 2e3]])
def test_a_jobs_values_read_back_as_the_sweep_gives_them(value):
    """A job's --set values and cell job files are read with agg-bench's loader: the text `1e-5` (quoted in the
    sweep file) was written plain by YAML 1.1's rules and read back by the run as the number 1e-05."""
    from agg_bench.config import parse_override
    from agg_bench.tools.sweep import overrides_of

    [pair] = overrides_of([("key", value)])
    assert parse_override(pair) == ("key", value)


@pytest.mark.parametrize("resolution, expected", [(30, "a positive multiple of 16 pixels for sd3"),
                                                  (1600, "at most 1536 pixels")])
def test_resolutions_fail_before_the_methods_check(in_process, resolution, expected):
    config = sweep_config()
    config["resolutions"] = [resolution]
    with pytest.raises(SweepError) as err:
        Sweep(config, SCHEMA)
    message = str(err.value)
    assert message.startswith("sweep config: run full_sd3_") and "model.resolution" in message
    assert str(resolution) in message and expected in message
    assert in_process == []  # decided from the configs, before any method is built


def test_method_errors_name_the_job_and_the_key(in_process):
    config = sweep_config()
    config["methods"]["agg-w3"]["method"]["window"] = 9  # more than the 6 trained steps
    with pytest.raises(SweepError) as err:
        Sweep(config, SCHEMA)
    assert "run agg-w3_sd3_32px_s0_cpu (methods.agg-w3, models.sd3)" in str(err.value)
    assert "method.window" in str(err.value)


def test_an_unknown_reward_is_refused_before_any_job(in_process):
    """reward.name was checked only when a run built its reward: the sweep's parse accepted it and the
    cell job recorded the run as failed."""
    config = sweep_config()
    config["methods"]["agg-w3"]["reward"] = {"name": "colour"}
    with pytest.raises(SweepError) as err:
        Sweep(config, SCHEMA)
    assert "run agg-w3_sd3_32px_s0_cpu (methods.agg-w3, models.sd3)" in str(err.value)
    assert "reward.name = 'colour'" in str(err.value) and "'scene'" in str(err.value)


@pytest.mark.parametrize("path, words", [
    ("config/prompts/nope.txt", "prompts.file = 'config/prompts/nope.txt': expected an existing .txt or .jsonl "
                                "prompts file"),
    ("config/prompts", "prompts.file = 'config/prompts': expected an existing .txt or .jsonl prompts file"),
    ("config/run.yaml", "prompts.file = 'config/run.yaml': expected a .txt (one prompt per line) or .jsonl"),
])
def test_a_prompts_file_that_its_run_would_refuse_is_refused_before_any_job(in_process, path, words):
    """A prompts.file that is no file, or no prompts file, passed the sweep's checks (`snakemake -n` too), and
    every run job then failed at its start, when the run read its prompts."""
    config = sweep_config()
    config["methods"]["agg-w3"]["prompts.file"] = path
    with pytest.raises(SweepError) as err:
        Sweep(config, SCHEMA)
    assert "run agg-w3_sd3_32px_s0_cpu (methods.agg-w3, models.sd3)" in str(err.value)
    assert words in str(err.value), err.value
    config["methods"]["agg-w3"]["prompts.file"] = "config/prompts/scenes.txt"
    assert len(Sweep(config, SCHEMA).runs) == 2


@pytest.mark.parametrize("reward, words", [
    ({"name": "jpeg_compressibility", "options": {"qualty": 90}}, "reward.options.qualty = 90: expected a known option"),
    ({"name": "scene", "options": {"weights": {"colour": 1}}}, "reward.options.weights"),
    ({"name": "hpsv2", "options": {"tokenizer": "tok"}}, "reward.options.checkpoint = None"),
    ({"name": "aesthetic", "options": {"model": "clip", "head": "~/head.pth"}}, "starts with ~"),
])
def test_a_reward_option_that_its_reward_would_refuse_is_refused_before_any_job(in_process, reward, words):
    """A built-in reward's options were checked only when a run built it: the sweep's parse accepted a misspelt
    option or a reward model's file not given, and every run job failed at its start."""
    config = sweep_config()
    config["methods"]["agg-w3"]["reward"] = reward
    with pytest.raises(SweepError) as err:
        Sweep(config, SCHEMA)
    assert "run agg-w3_sd3_32px_s0_cpu (methods.agg-w3, models.sd3)" in str(err.value)
    assert words in str(err.value), err.value


@pytest.mark.parametrize("family", ["sd3", "flux", "qwenimage"])
def test_geometry_from_configs_matches_the_built_model(tmp_path, family):
    """The geometry read from a model folder's config.json files (and the tiny preset's configs) is the
    one the built policy checks resolutions with."""
    policy = load_policy(family, "tiny", None)
    expected = ImageGeometry(family, policy.vae_scale_factor, policy.latent_multiple, policy.max_latent_size())
    build_tiny_transformer(family).save_config(tmp_path / "transformer")
    build_tiny_vae(family=family).save_config(tmp_path / "vae")
    assert model_geometry({"family": family, "preset": "pretrained", "pretrained": str(tmp_path)}) == expected
    assert model_geometry({"family": family, "preset": "tiny", "pretrained": None}) == expected
    step = expected.vae_scale_factor * expected.latent_multiple
    for resolution in (step, 4 * step):
        assert policy.latent_shape(resolution)[1] == expected.latent_size(resolution) == resolution // expected.vae_scale_factor
    for bad in (step + 8, 0, -step, 2.5 * step, True, None):
        with pytest.raises(ConfigError) as err:
            check_resolution({"family": family, "preset": "tiny", "resolution": bad})
        assert err.value.key == "model.resolution"
        with pytest.raises(ConfigError):
            policy.latent_shape(bad)


def test_unknown_geometry_is_left_to_the_run(tmp_path):
    # a folder without configs: nothing to read, the run itself reports what is missing
    assert model_geometry({"family": "sd3", "preset": "pretrained", "pretrained": str(tmp_path)}) is None
    check_resolution({"family": "sd3", "preset": "pretrained", "pretrained": str(tmp_path), "resolution": 30})


# A fresh interpreter: what the workflow's parse and the command line import. The sweep is the embedded
# default; its methods' check runs in a child process the first time and is read from the cache the
# second time (the script fails if a second child starts).
NO_TORCH_SCRIPT = """
import json, subprocess, sys
from pathlib import Path
import agg_bench.cli, agg_bench.tools.sweep, agg_bench.engine.families, agg_bench.config
from agg_bench.tools.sweep import Sweep
cache = Path(sys.argv[1])
first = Sweep(__import__("yaml").safe_load(open("config/config.yaml")), "workflow/schemas/config.schema.yaml", cache)
def refuse(*args, **kwargs):
    raise AssertionError("the methods' check ran again")
subprocess.run = refuse
second = Sweep(__import__("yaml").safe_load(open("config/config.yaml")), "workflow/schemas/config.schema.yaml", cache)
assert second.manifest() == first.manifest()
print(json.dumps({"heavy": [m for m in %r if m in sys.modules], "runs": len(first.runs)}))
""" % (HEAVY,)


def test_cli_and_sweep_import_no_torch(tmp_path):
    proc = subprocess.run([sys.executable, "-c", NO_TORCH_SCRIPT, str(tmp_path / "cache")], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    answer = json.loads(proc.stdout.strip().splitlines()[-1])
    assert answer["heavy"] == []
    config = sweep_config("config.yaml")
    assert answer["runs"] == len(config["methods"]) * len(config["models"]) * len(config["resolutions"])
    assert len(list((tmp_path / "cache").glob("methods-*.json"))) == 1


def test_a_failing_methods_check_is_one_line_and_not_cached(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    jobs = {"run x (methods.bad)": [["method", {"name": "agg", "window": 0}]]}
    with pytest.raises(UserError) as err:
        sweep_module.checked_methods("config/run.yaml", jobs, tmp_path)
    assert str(err.value).startswith("sweep config: run x (methods.bad): ") and "method.window" in str(err.value)
    assert list(tmp_path.iterdir()) == []


def test_a_kept_pretrain_answer_is_taken_whole_or_checked_again(tmp_path, monkeypatch):
    """The pretrain entries' answer kept in the cache folder is taken at the next start; one that is torn or
    edited (a workflow read threads "x" and failed in a job's threads) is checked again, and a cache folder that
    cannot be written (a file in its place) keeps nothing, the answer standing."""
    monkeypatch.chdir(ROOT)
    entries = {"scenes": {"config": "config/pretrain.yaml"}}
    answer = {"scenes": {"threads": 2, "device": "cpu"}}
    children = []

    def child(argv, **kwargs):  # the child process's answer, without its imports
        children.append(json.loads(kwargs["input"]))
        return subprocess.CompletedProcess(argv, 0, json.dumps({"answer": answer}), "")

    monkeypatch.setattr(sweep_module.subprocess, "run", child)
    cache = tmp_path / "cache"
    assert sweep_module.checked_pretrain(entries, cache) == answer and children == [{"pretrain": entries}]
    assert sweep_module.checked_pretrain(entries, cache) == answer and len(children) == 1
    (kept,) = cache.glob("pretrain-*.json")
    for edited in ('{"answer": {"scenes": {"threads": "x", "device": "cpu"}}}', '{"answer": {}}', "{", "[]"):
        kept.write_text(edited)
        assert sweep_module.checked_pretrain(entries, cache) == answer, edited
        assert json.loads(kept.read_text()) == {"answer": answer}
    assert len(children) == 5
    blocked = tmp_path / "file"
    blocked.write_text("mine")
    assert sweep_module.checked_pretrain(entries, blocked / "cache") == answer and blocked.read_text() == "mine"


def test_a_run_imports_only_its_own_method():
    script = ("import sys; from agg_bench.methods.base import build_method; build_method('agg', {}); "
              "print([m for m in ('baselines.cached', 'baselines.caches', 'baselines.subsample') if m in sys.modules])")
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == "[]"


def test_cells_group_a_cpu_devices_runs(in_process):
    """A CPU device's runs of one model x resolution go to one cell job (or `runs_per_job` at a time); a
    cell's job file holds each run's `agg-bench run` arguments; GPU runs stay one job each."""
    config = sweep_config()
    config["seeds"] = [0, 1, 2]
    sweep = Sweep(config, SCHEMA)
    assert sweep.cells == {"sd3_32px_cpu": list(sweep.runs)} and sweep.single_runs == []
    assert sweep.cell_rule("sd3_32px_cpu") == "cell_sd3_32px_cpu"
    jobs = sweep.cell_jobs("sd3_32px_cpu")["runs"]
    assert [job["out"] for job in jobs] == [f"results/runs/{r}" for r in sweep.runs]
    # each run's marker, the cell job's output: outside the run folders, so a failed job's removal spares them
    assert [job["done"] for job in jobs] == [f"results/done/{r}.json" for r in sweep.runs]
    for job, run_id in zip(jobs, sweep.runs):  # the arguments the run's own job would give `agg-bench run`
        sets = " ".join(f"--set {shlex.quote(item)}" for item in job["set"])
        assert sweep.run_command(run_id) == (f"{sweep_module.PYTHON} -m agg_bench run --config {job['config']} {sets} "
                                             f"--out {job['out']} --resume-stopped --overwrite --done {job['done']} "
                                             f"--journal results/cells/{run_id}.progress.json")
    assert sweep.cell_command("sd3_32px_cpu") == (f"{sweep_module.PYTHON} -m agg_bench cell --keep-going --resume "
                                                  "--keep-journal --overwrite results/cells/sd3_32px_cpu.json")
    assert sweep.cell_outputs("sd3_32px_cpu") == [job["done"] for job in jobs]
    assert sweep.summaries() == [job["done"] for job in jobs]  # what the manifest waits for
    config["devices"]["cpu"]["runs_per_job"] = 4  # 6 runs: two jobs of 3
    split = Sweep(config, SCHEMA)
    assert {name: len(ids) for name, ids in split.cells.items()} == {"sd3_32px_cpu_1of2": 3, "sd3_32px_cpu_2of2": 3}
    config["devices"]["cpu"]["runs_per_job"] = 1
    single = Sweep(config, SCHEMA)
    assert single.cells == {} and single.single_runs == list(sweep.runs)
    assert single.summaries() == [f"results/done/{r}.json" for r in sweep.runs]  # a run job's output too
    config["devices"] = {"gpu2": {"device": "cuda", "gpus": 2, "runs_per_job": 2}}
    config["set"]["grpo.prompts_per_iteration"] = 2
    with pytest.raises(SweepError, match=r"devices\.gpu2\.runs_per_job: 2: a job on several GPUs runs one run"):
        Sweep(config, SCHEMA)
    del config["devices"]["gpu2"]["runs_per_job"]
    two = Sweep({**config, "embed": {}}, SCHEMA)
    # embed and gradcheck are one process each: one GPU of the device's two, no torchrun (every process did the
    # whole job and wrote the same file); calibrate times the runs' shares on both
    pool = f"{sweep_module.PYTHON} -m agg_bench.machine.gpus --count"
    assert two.embed_command("sd3").startswith(f"{pool} 1 -- {sweep_module.PYTHON} -m agg_bench embed ")
    assert two.gradcheck_command("sd3_32px_gpu2").startswith(f"{pool} 1 -- {sweep_module.PYTHON} -m agg_bench gradcheck ")
    assert two.tool_gpus("gpu2") == 1 and two.gpus("gpu2") == 2
    assert f"{pool} 2 -- {sweep_module.PYTHON} -m torch.distributed.run" in two.calibrate_command("sd3_32px_gpu2")
    config["devices"] = {"gpu1": {"device": "cuda", "gpus": 1}}
    del config["set"]["grpo.prompts_per_iteration"]
    assert Sweep(config, SCHEMA).cells == {}  # by default a GPU run is a job of its own
    config["devices"]["gpu1"]["runs_per_job"] = 100  # one GPU: the cell's runs in one process on a pooled GPU
    gpu = Sweep(config, SCHEMA)
    assert gpu.cells == {"sd3_32px_gpu1": list(gpu.runs)} and gpu.single_runs == []
    assert gpu.cell_command("sd3_32px_gpu1") == (f"{sweep_module.PYTHON} -m agg_bench.machine.gpus --count 1 -- "
                                                 f"{sweep_module.PYTHON} -m agg_bench cell --keep-going --resume "
                                                 "--keep-journal --overwrite results/cells/sd3_32px_gpu1.json")


@pytest.mark.parametrize("gpus", [1, 2])
def test_a_cpu_device_takes_no_gpus(in_process, gpus):
    """A device: cpu entry with gpus: 2 was accepted: each of its jobs took 2 GPUs from the pool, which no other
    job could then use, for a torchrun of 2 CPU processes. Refused in one line naming the key, before any check
    of the runs."""
    config = sweep_config()
    config["devices"] = {"cpu": {"device": "cpu", "gpus": gpus}}
    with pytest.raises(SweepError) as err:
        Sweep(config, SCHEMA)
    assert (f"devices.cpu.gpus: {gpus}: a cpu device takes no GPUs from the pool (its job is one process; "
            "devices.cpu.threads sets its threads); expected 0, or device: cuda") in str(err.value)
    assert "\n" not in str(err.value) and in_process == []
    config["devices"]["cpu"]["gpus"] = 0
    assert Sweep(config, SCHEMA).gpus("cpu") == 0


def test_a_summary_that_is_a_named_pipe_is_no_failed_run(tmp_path):
    """The workflow reads every run's summary.json when it ends: a named pipe there made Snakemake wait for ever."""
    import os

    from agg_bench.tools.sweep import failed_runs
    from helpers import not_hung

    (tmp_path / "run").mkdir()
    os.mkfifo(tmp_path / "run" / "summary.json")
    with not_hung():
        assert failed_runs([str(tmp_path / "run")]) == []


def test_failed_runs_are_reported_and_their_summaries_removed(tmp_path):
    """What the workflow's manifest does after a cell job recorded a failed run (agg-bench cell --keep-going):
    names each failed run, its error and its log, and removes only those runs' summaries and markers, so that
    the next invocation reruns their cells while every other file stays."""
    from agg_bench.tools.sweep import failed_runs, report_failed_runs

    statuses = {"ok": "ok", "oom": "oom", "failed": "error", "failed2": "error"}
    for name, status in statuses.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "summary.json").write_text(json.dumps({"status": status, "error": f"E in {name}"}))
        (tmp_path / name / "metrics.jsonl").write_text("{}\n")
    (tmp_path / "unfinished").mkdir()
    (tmp_path / "damaged").mkdir()
    (tmp_path / "damaged" / "summary.json").write_text("{not json")
    folders = [str(tmp_path / name) for name in [*statuses, "unfinished", "damaged"]]
    failed = failed_runs(folders)
    assert failed == [(str(tmp_path / "failed"), "E in failed"), (str(tmp_path / "failed2"), "E in failed2")]
    markers = {str(tmp_path / name): str(tmp_path / f"{name}.done") for name in statuses}
    for marker in markers.values():
        Path(marker).write_text("{}")
    message = report_failed_runs(failed, {str(tmp_path / "failed"): "results/logs/cell/x.log"}, markers)
    assert message.startswith("2 runs of this sweep failed") and "E in failed2" in message
    assert f"{tmp_path / 'failed'}: E in failed (log: results/logs/cell/x.log)" in message
    assert [p.name for p in sorted(tmp_path.rglob("summary.json"))] == ["summary.json"] * 3  # ok, oom, damaged
    assert not (tmp_path / "failed" / "summary.json").exists() and (tmp_path / "failed" / "metrics.jsonl").exists()
    # the failed runs' markers go (their cell job reruns), the others' stay
    assert sorted(p.name for p in tmp_path.glob("*.done")) == ["ok.done", "oom.done"]
    assert failed_runs(folders) == []


def test_runs_that_differ_only_in_their_seed_are_checked_once(in_process, monkeypatch):
    """snakemake -n with 20,000 seeds took over 5 minutes: every run's config was loaded, checked and its
    method built again (21 ms a run). No check but the seed's own range reads the seed, so one job per seedless
    config is checked, in this process and in the methods' check, and every run gets its method's options."""
    loads = []
    original = sweep_module.load_config

    def counting(*args, **kwargs):
        loads.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(sweep_module, "load_config", counting)
    config = sweep_config()
    config["seeds"] = list(range(50))
    sweep = Sweep(config, SCHEMA)
    assert len(sweep.runs) == 2 * 50
    # the two methods and the gradcheck, each loaded by the sweep's check and by the methods' check
    assert len(in_process) == 1 and len(in_process[0]) == 3 and len(loads) == 2 * 3
    assert {r["method_options"]["name"] for r in sweep.runs.values() if r["method"] == "agg-w3"} == {"agg"}
    assert all(r["method_options"] == {"name": "full", "micro_batch": None}
               for r in sweep.runs.values() if r["method"] == "full")
    assert len({run["seed"] for run in sweep.runs.values()}) == 50
    assert "--set seed=49" in sweep.run_command("full_sd3_32px_s49_cpu")


def test_a_sweep_of_more_runs_than_the_bound_is_refused(in_process):
    """Snakemake's own parse grows faster than the runs (8,192 of them: 26 s; 20,000: 4 min 45 s), so a sweep
    holds at most MAX_RUNS runs, counted after exclude, refused in one line before its jobs are composed."""
    config = sweep_config()
    config["seeds"] = list(range(sweep_module.MAX_RUNS // 2 + 1))
    with pytest.raises(SweepError, match=f"more than {sweep_module.MAX_RUNS:,} runs after exclude"):
        Sweep(config, SCHEMA)
    config["exclude"] = [{"method": "agg-w3", "seed": "1*"}]  # leaves 4,096 - 1,111 runs
    assert len(Sweep(config, SCHEMA).runs) <= sweep_module.MAX_RUNS


def test_the_learning_reference_is_a_method_of_the_sweep(in_process):
    """agg-bench learning refuses a --reference that is not a method of its manifest; the workflow passes
    learning.reference, so the sweep refuses it before any job runs rather than after every run."""
    config = sweep_config()
    config["learning"] = {"reference": "nosuch"}
    with pytest.raises(SweepError, match="learning.reference: 'nosuch' is not a label under methods"):
        Sweep(config, SCHEMA)
    # (the runs train 2 iterations: the table averages 1 at each end, as agg-bench learning asks of them)
    config["learning"] = {"reference": "agg-w3", "average_iterations": 1}
    assert len(Sweep(config, SCHEMA).runs) == 2




def test_a_sweep_asked_for_the_learning_report_is_checked_as_a_learning_sweep(in_process):
    """The workflow's learning target runs under any sweep, on the learning section's defaults where it has none:
    `snakemake learning` on config/test.yaml (runs of 2 iterations) ran every run, then agg-bench learning refused
    them for averaging 3 iterations at each end. Refused before any job now (the Snakefile's onstart)."""
    config = sweep_config()
    sweep = Sweep(config, SCHEMA)
    assert "learning" not in config and len(sweep.runs) == 2
    with pytest.raises(SweepError, match=r"config error: learning\.average_iterations = 3: expected at most 1: "):
        sweep.check_learning()
    config["learning"] = {"average_iterations": 1}  # a learning sweep's runs were checked with the sweep
    Sweep(config, SCHEMA).check_learning()


def test_a_warm_up_a_run_is_not_longer_than_is_refused(in_process):
    """report.warmup_iterations at or above a run's train.iterations timed that run's every iteration, warm-up
    included, with nothing said. Given, it is refused before any job; left out, the default (1) is kept for runs of
    one iteration (the campaign's --cpu form), which agg-bench report names."""
    config = sweep_config()  # runs of 2 iterations
    for warmup in (2, 1000):
        config["report"] = {"warmup_iterations": warmup}
        with pytest.raises(SweepError) as err:
            Sweep(config, SCHEMA)
        assert f"config error: report.warmup_iterations = {warmup}: expected at most 1: " in str(err.value)
        assert "train.iterations = 2" in str(err.value) and "\n" not in str(err.value), err.value
    config["report"] = {"warmup_iterations": 1}
    assert Sweep(config, SCHEMA).manifest()["warmup"] == 1
    config["report"], config["set"] = {}, {**config["set"], "train.iterations": 1}
    assert Sweep(config, SCHEMA).manifest()["warmup"] == 1


@pytest.mark.parametrize("override, key", [
    ({"reward.options.quality": 50}, "reward"),
    ({"prompts.file": "config/prompts/scenes.txt"}, "prompts.file"),
    ({"eval.every": 1, "eval.seed": 3}, "eval.seed"),
])
def test_a_learning_sweeps_runs_are_measured_alike(in_process, override, key):
    """A method of a learning sweep on another reward, captions or evaluation noise ran every run, and then
    agg-bench learning refused the manifest; refused with the sweep now, before any job."""
    config = sweep_config()
    config["learning"] = {"average_iterations": 1}
    config["set"] = {**config.get("set", {}), "eval.every": 1}
    method = list(config["methods"])[-1]
    config["methods"][method] = {**config["methods"][method], **override}
    with pytest.raises(SweepError) as err:
        Sweep(config, SCHEMA)
    assert f"config error: {key} = " in str(err.value) and "measured alike" in str(err.value), err.value
    del config["learning"]  # a sweep without a learning report compares nothing
    assert len(Sweep(config, SCHEMA).runs) == 2

@pytest.mark.parametrize("key, value, words", [
    ("resolution", 100_000, "references[0].resolution: 100000: expected an integer from 1 to 16384"),
    ("n_gpus", 10**9, "references[0].n_gpus: 1000000000: expected an integer from 1 to 65536"),
    ("method", "a\nb", "references[0].method: 'a\\nb': expected 1 to 200 printable characters"),
    ("gpu_name", "", "references[0].gpu_name: '': expected 1 to 200"),
    ("model", "x" * 201, "references[0].model: 'xxx"),
])
def test_a_reference_is_refused_as_its_import_would_refuse_it(in_process, tmp_path, key, value, words):
    """A reference's labels and numbers as `agg-bench import-log` takes them: refused with the sweep, not by
    its import job after the sweep started."""
    log = tmp_path / "log.jsonl"
    log.write_text('{"step": 0, "avg_reward": 0.1, "step_time": 1.0, "grad_norm": 0.5}\n')
    config = sweep_config()
    config["references"] = [{"label": "ref", "log": str(log), key: value}]
    with pytest.raises(SweepError) as err:
        Sweep(config, SCHEMA)
    assert words in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(UserError) as flag:  # one check: the import job's flag is refused in the same words
        check_labels(**{"resolution": None, "n_gpus": None, key: value})
    assert str(flag.value).startswith(f"config error: --{key.replace('_', '-')} = ")
    assert str(flag.value).split(": expected ")[1] == str(err.value).split(": expected ")[1]
    config["references"] = [{"label": "ref", "log": str(log), "method": "dancegrpo", "model": "flux",
                             "resolution": 720, "n_gpus": 8, "gpu_name": "NVIDIA H800"}]
    assert "ref" in Sweep(config, SCHEMA).references


def test_a_reference_labelled_as_a_method_is_refused(in_process, tmp_path):
    """A reference's label is its imported runs' method label in the manifests: one that is also a method's label
    put the imported log among that method's runs in the learning report (a seed of it, or a seed it refused at the
    end of the workflow). The report's tables keep the two apart (their source), the learning report does not."""
    log = tmp_path / "log.jsonl"
    log.write_text('{"step": 0, "avg_reward": 0.1, "step_time": 1.0, "grad_norm": 0.5}\n')
    config = sweep_config()
    config["references"] = [{"label": "dance", "log": str(log)}, {"label": "full", "log": str(log)}]
    with pytest.raises(SweepError) as err:
        Sweep(config, SCHEMA)
    message = str(err.value)
    assert message.startswith("sweep config: references[1].label: 'full' is also a label under methods; expected a "
                              "label of its own") and "\n" not in message, message
    config["references"] = [{"label": "dance", "log": str(log), "method": "full"}]  # its method may be any
    assert list(Sweep(config, SCHEMA).references) == ["dance"]


def test_the_sweeps_learning_defaults_are_the_commands():
    """A sweep's ``learning`` section defaults every key as ``agg-bench learning`` does (its LearningOptions and
    its options' defaults), but the checkpoint evaluation's noises (16 in a sweep, none in the command), and the
    workflow passes every key to the command's own option, each value as the sweep gives it."""
    import dataclasses

    from agg_bench.cli import build_parser
    from agg_bench.tools.learning import LearningOptions

    fields = {"average_iterations": "average", "fraction_of_full": "fraction", "eval_noises": "eval_noises",
              "eval_seed": "eval_seed", "eval_sampler": "eval_sampler", "target_fraction": "target_fraction",
              "eval_source": "eval_source", "reference": "reference"}
    assert set(fields) == set(sweep_module.LEARNING_DEFAULTS) == set(sweep_module.LEARNING_OPTIONS)
    command = {f.name: f.default for f in dataclasses.fields(LearningOptions)}
    parsed = vars(build_parser().parse_args(["learning", "--manifest", "m.json"]))
    for key, field in fields.items():
        # the evaluation's seed and sampler parse as None, given or not being told apart (refused without an
        # evaluation); the command then takes LearningOptions' default
        assert parsed[field] == (None if field in ("eval_seed", "eval_sampler") else command[field]), field
        if key != "eval_noises":
            assert sweep_module.LEARNING_DEFAULTS[key] == command[field], key
    assert (sweep_module.LEARNING_DEFAULTS["eval_noises"], command["eval_noises"]) == (16, 0)
    # every key to its option: parsed back by the command, the section's values
    section = {"average_iterations": 2, "fraction_of_full": 0.5, "eval_noises": 4, "eval_seed": 7,
               "eval_sampler": "sde", "target_fraction": 0.75, "eval_source": "checkpoint", "reference": "agg w3"}
    options = sweep_module.learning_command_options(section)
    parsed = vars(build_parser().parse_args(["learning", "--manifest", "m.json", *shlex.split(shlex.join(options))]))
    assert {key: parsed[field] for key, field in fields.items()} == section
    # an absent section: the defaults, and no --reference (the command's own, full, then applies)
    options = sweep_module.learning_command_options(None)
    assert "--reference" not in options
    parsed = vars(build_parser().parse_args(["learning", "--manifest", "m.json", *options]))
    assert {key: parsed[field] for key, field in fields.items()} == sweep_module.LEARNING_DEFAULTS

@pytest.mark.parametrize("entry, words", [
    ({"model": "sdxl"}, "exclude[0].model: 'sdxl' matches no label under models (sd3)"),
    ({"method": "cach-*", "model": "sd3"}, "exclude[0].method: 'cach-*' matches no label under methods (full, agg-w3)"),
    ({"device": "gpu"}, "exclude[0].device: 'gpu' matches no label under devices (cpu)"),
])
def test_an_exclude_pattern_that_matches_no_label_is_refused(in_process, entry, words):
    """An exclude entry whose method, model or device pattern matches no label (a typo) excluded nothing, and
    the runs it was written to leave out ran."""
    config = sweep_config()
    config["exclude"] = [entry]
    with pytest.raises(SweepError, match=re.escape(words)):
        Sweep(config, SCHEMA)
    assert in_process == []
    config["seeds"] = list(range(20))
    config["exclude"] = [{"method": "agg-*", "resolution": 32, "seed": "1?"}]
    assert len(Sweep(config, SCHEMA).runs) == 2 * 20 - 10


@pytest.mark.parametrize("entry, words", [
    ({"method": "full", "seed": "1O"}, "exclude[0].seed: '1O' matches no value under seeds (0, 1, 2, 3, 4, 5, 6, 7, "
                                       "8, 9, 10, 11 and 8 more)"),
    ({"resolution": "5l2"}, "exclude[0].resolution: '5l2' matches no value under resolutions (32)"),
    ({"resolution": 64}, "exclude[0].resolution: 64 matches no value under resolutions (32)"),
])
def test_an_exclude_resolution_or_seed_that_the_sweep_file_never_lists_is_refused(in_process, tmp_path, entry, words):
    """A typo in an exclude entry's seed or resolution pattern matched no run and passed: the runs it was written
    to leave out ran. The values are those of the sweep file's lists, so a --config that narrows them (the
    learning sweep's `seed: "[34]"` entries with `--config 'seeds=[0]'`) leaves the file's entries standing."""
    config = {**sweep_config(), "seeds": list(range(20)), "exclude": [entry]}
    with pytest.raises(SweepError, match=re.escape(words)):
        Sweep(config, SCHEMA)
    assert in_process == []
    # the file lists the value, the config (its --config) does not: the entry stands and excludes nothing
    file = tmp_path / "sweep.yaml"
    file.write_text(yaml.safe_dump({**config, "seeds": ["1O", 0], "resolutions": [32, 64, "5l2"]}))
    assert len(Sweep(config, SCHEMA, files=[file]).runs) == 2 * 20


def test_the_learning_sweeps_seed_excludes_stand_when_the_seeds_are_narrowed(in_process):
    """config/learning.yaml leaves seeds 3 and 4 to full and AGG (`seed: "[34]"`); narrowed to seed 0 by a
    --config, its entries match no run but still name values of the file's list."""
    config = sweep_config("learning.yaml")
    config["seeds"] = [0]
    with pytest.raises(SweepError, match=re.escape("""exclude[0].seed: '[34]' matches no value under seeds (0)""")):
        Sweep(config, SCHEMA)
    sweep = Sweep(config, SCHEMA, files=[ROOT / "config" / "learning.yaml"])
    assert len(sweep.runs) == len(config["methods"])


@pytest.mark.parametrize("text, yaml11, words", [
    ("seeds: [017]", {"seeds": [15]}, "seeds[0] = '017': expected an integer"),
    ("resolutions: [0x20]", {"resolutions": [32]}, "resolutions[0] = '0x20': expected an integer"),
    ("seeds: [1:30]", {"seeds": [90]}, "seeds[0] = '1:30': expected an integer"),
    ("set: {train.iterations: 0b11}", {"set": {"train.iterations": 3}}, "train.iterations = '0b11': expected an integer"),
    ("set: {progress: off}", {"set": {"progress": False}}, "progress = 'off': expected true or false"),
    ("gradcheck: {resolutions: [32], route_fracs: [5e-1]}", {"gradcheck": {"resolutions": [32], "route_fracs": ["5e-1"]}},
     None),
])
def test_the_workflow_reads_the_sweep_files_as_a_campaign_does(parse_only, tmp_path, text, yaml11, words):
    """Snakemake's parse of a sweep file is YAML 1.1: `seeds: [017]` ran seed 15, `0x20` 32 px and `1:30` seed 90,
    where `agg-bench campaign --config` (agg-bench's loader) refuses them; `route_fracs: [5e-1]` was text to the
    workflow, refused, and a number to a campaign. The workflow's sweep is the files as agg-bench's loader reads
    them, with the --config overrides merged as Snakemake merges them."""
    from snakemake.common.configfile import load_configfile

    from agg_bench.config import read_yaml_mapping
    from agg_bench.tools.sweep import check_sweep_files, read_sweep_config

    file = tmp_path / "sweep.yaml"
    rest = {key: value for key, value in sweep_config().items() if key != text.split(":")[0]}
    file.write_text(yaml.safe_dump(rest, sort_keys=False) + text + "\n")
    snakemakes = load_configfile(file)
    assert {key: snakemakes[key] for key in yaml11} == yaml11  # what the workflow ran before
    config = read_sweep_config(check_sweep_files([file]))
    assert config == read_yaml_mapping(file, "sweep sections", "--config")  # what a campaign reads
    if words is None:
        assert Sweep(config, SCHEMA, cache_dir=None, files=[file]).sweep["gradcheck"]["route_fracs"] == [0.5]
    else:
        with pytest.raises(SweepError, match=re.escape(words)):
            Sweep(config, SCHEMA, cache_dir=None, files=[file])


def test_the_workflows_sweep_merges_its_files_and_config_overrides_as_snakemake_does(tmp_path):
    """Files merged in order and the --config overrides over them, mappings key by key, as Snakemake merges config;
    a list or mapping of --config read as in a sweep file, and a method section it gives replaced whole."""
    from agg_bench.tools.sweep import check_sweep_files, read_sweep_config

    first, second = tmp_path / "first.yaml", tmp_path / "second.yaml"
    first.write_text("base: config/run.yaml\nset: {progress: false, train.iterations: 2}\nseeds: [0]\n"
                     "methods: {agg: {method: {name: agg, window: 3}}}\n")
    second.write_text("set: {train.iterations: 3}\nmethods: {agg: {method: {alpha: sigma}}}\n")
    config = read_sweep_config(check_sweep_files([first, second]))
    assert config["set"] == {"progress": False, "train.iterations": 3}
    assert config["methods"] == {"agg": {"method": {"name": "agg", "window": 3, "alpha": "sigma"}}}
    # what Snakemake makes of `--config 'seeds=[0, 1]' base=other.yaml 'methods={agg: {method: {name: full}}}'`
    args = ["seeds=[0, 1]", "base=other.yaml", "methods={agg: {method: {name: full}}}"]
    parsed = {"seeds": ["0", "1"], "base": "other.yaml", "methods": {"agg": {"method": {"name": "full"}}}}
    config = read_sweep_config(check_sweep_files([first, second]), args, parsed)
    assert (config["seeds"], config["base"]) == ([0, 1], "other.yaml")
    assert config["methods"] == {"agg": {"method": {"name": "full"}}}
    assert config["set"] == {"progress": False, "train.iterations": 3}


@pytest.mark.parametrize("section, value, words", [
    ("gradcheck", {"resolutions": [32], "route_fracs": [float("nan")]}, "gradcheck.route_fracs[0] = nan"),
    ("learning", {"fraction_of_full": float("nan")}, "learning.fraction_of_full = nan"),
    ("learning", {"target_fraction": float("nan")}, "learning.target_fraction = nan"),
])
def test_a_nan_in_the_sweep_is_refused_before_any_job(in_process, section, value, words):
    """JSON Schema's numbers admit NaN (every comparison with it is false, so minimum 0 and maximum 1 pass it):
    `--config 'learning={fraction_of_full: .nan}'` passed the dry run and reached the learning report, a NaN
    route fraction the gradcheck job."""
    config = {**sweep_config(), section: value}
    with pytest.raises(SweepError, match=re.escape(f"{words}: expected a finite number")):
        Sweep(config, SCHEMA)
    assert in_process == []


@pytest.mark.parametrize("mine, named", [
    ("results/runs/full_sd3_32px_s0_cpu/notes.txt", "results/runs/full_sd3_32px_s0_cpu: the folder holds files that "
                                                     "are not an agg-bench run (notes.txt)"),
    ("results/runs/agg-w3_sd3_32px_s0_cpu/metrics.jsonl", "results/runs/agg-w3_sd3_32px_s0_cpu: the folder holds "
                                                           "files that are not an agg-bench run (metrics.jsonl)"),
    ("results/tables/mine.csv", "results/tables: the folder holds files that are not agg-bench report tables or plots (mine.csv)"),
    ("results/plots/mine.png", "results/plots: the folder holds files that are not agg-bench report tables or plots (mine.png)"),
    ("results/runs/full_sd3_32px_s0_cpu/tensorboard/mine.txt", "results/runs/full_sd3_32px_s0_cpu: the folder holds "
                                                                "files that are not an agg-bench run (tensorboard/mine.txt)"),
])
def test_someones_file_in_a_folder_the_workflow_writes_is_refused_before_any_job(in_process, tmp_path, monkeypatch,
                                                                                 mine, named):
    """A file of someone's in a run folder or beside the tables was refused only by the job that writes there: for
    the tables after every run had finished. The Snakefile checks every such folder before any job, and touches
    nothing. (A run's metrics.jsonl without a run's config.json is not a run folder either.)"""
    sweep = Sweep(sweep_config(), SCHEMA)
    monkeypatch.chdir(tmp_path)
    sweep_module.check_output_contents(sweep)  # nothing there yet
    run = tmp_path / "results/runs/full_sd3_32px_s0_cpu"  # a finished run and earlier tables are the workflow's own
    run.mkdir(parents=True)
    (run / "config.json").write_text(json.dumps({"model": {}, "train": {}, "method": {"name": "full"}}))
    (run / "summary.json").write_text("{}")
    (tmp_path / "results/tables").mkdir()
    (tmp_path / "results/tables/records.csv").write_text("run_id\n")
    sweep_module.check_output_contents(sweep)
    path = tmp_path / mine
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("mine")
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    with pytest.raises(UserError) as refused:
        sweep_module.check_output_contents(sweep)
    assert str(refused.value) == f"output folder {named}; {sweep_module.MOVE_AWAY}"
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before and path.read_text() == "mine"


def test_the_learning_folder_is_checked_under_every_sweep(in_process, tmp_path, monkeypatch):
    """The learning folder was checked only when the sweep had a learning section, but the workflow's `learning`
    target runs under any sweep (`snakemake learning` on the embedded default): someone's file there was refused
    by the learning report's job, after every run. It is refused before any job, with or without the section."""
    sweep = Sweep(sweep_config(), SCHEMA)
    assert "learning" not in sweep.sweep
    monkeypatch.chdir(tmp_path)
    (tmp_path / "results/learning").mkdir(parents=True)
    (tmp_path / "results/learning/learning.csv").write_text("method\n")  # the learning report's own
    sweep_module.check_output_contents(sweep)
    (tmp_path / "results/learning/notes.txt").write_text("mine")
    for learning in (None, {"average_iterations": 1}):
        if learning is not None:
            sweep.sweep["learning"] = learning
        with pytest.raises(UserError, match=re.escape("output folder results/learning: the folder holds files that "
                                                      "are not learning tables or learning plots (notes.txt)")):
            sweep_module.check_output_contents(sweep)
    assert (tmp_path / "results/learning/notes.txt").read_text() == "mine"


def test_a_compare_with_folder_is_checked_before_any_job(in_process, tmp_path, monkeypatch):
    """The manifest job's parameters read each ``report.compare_with`` folder while Snakemake parses the workflow,
    outside the Snakefile's checks: a folder without a reference manifest ended the parse in a traceback. A folder
    named twice (once with a trailing slash, say) put its runs in the manifest twice. Both are one line from the
    Snakefile's check of the jobs' input files."""
    reference = tmp_path / "ref"
    reference.mkdir()
    (reference / "manifest.json").write_text(json.dumps({"runs": [], "calibration": []}))
    sweep = Sweep(sweep_config(), SCHEMA)
    monkeypatch.chdir(tmp_path)
    sweep.sweep["report"] = {"compare_with": ["ref"]}
    sweep_module.check_input_files(sweep)
    sweep.sweep["report"] = {"compare_with": ["ref", "nothing"]}
    with pytest.raises(SweepError, match=r"^sweep config: report\.compare_with\[1\]: 'nothing' has no manifest.json"):
        sweep_module.check_input_files(sweep)
    sweep.sweep["report"] = {"compare_with": ["ref", "./ref/"]}
    with pytest.raises(SweepError, match=re.escape("report.compare_with[1]: './ref/' is the folder of "
                                                   "report.compare_with[0]; expected each reference folder once")):
        sweep_module.check_input_files(sweep)


def test_a_model_folder_that_is_a_file_is_refused_before_any_job(in_process, tmp_path):
    """A sweep model's ``model.pretrained`` naming a file passed the parse, and every run job of the model failed at
    its start. A folder made by hand elsewhere that is not here (a dry run away from the GPU node) still passes."""
    (tmp_path / "notes.txt").write_text("mine")
    config = sweep_config()
    for folder in ("models/on-the-gpu-node", str(tmp_path)):
        config["models"]["sd3"]["model.pretrained"] = folder
        sweep_module.check_input_files(Sweep(config, SCHEMA))
    config["models"]["sd3"]["model.pretrained"] = str(tmp_path / "notes.txt")
    with pytest.raises(SweepError, match=re.escape(f"models.sd3: model.pretrained = '{tmp_path}/notes.txt' is a file; "
                                                   "expected a model folder")):
        sweep_module.check_input_files(Sweep(config, SCHEMA))


def base_with(config: dict, overrides: dict) -> dict:
    """The sweep's base config file as a mapping, with ``overrides`` (dotted keys) set in it."""
    base = yaml.safe_load((ROOT / config["base"]).read_text())
    for key, value in overrides.items():
        *parents, last = key.split(".")
        node = base
        for part in parents:
            node = node.setdefault(part, {})
        node[last] = value
    return base


def base_file_with(config: dict, value, tmp_path) -> None:
    """The sweep's base a config file in ``tmp_path`` that sets ``model.pretrained`` to ``value``."""
    (tmp_path / "base.yaml").write_text(yaml.safe_dump(base_with(config, {"model.pretrained": value})))
    config["base"] = str(tmp_path / "base.yaml")


@pytest.mark.parametrize("place, edit, methods, gradcheck", [
    ("models.sd3", lambda c, value, tmp: c["models"]["sd3"].update({"model.pretrained": value}), ["agg-w3", "full"], True),
    ("set", lambda c, value, tmp: c["set"].update({"model.pretrained": value}), ["agg-w3", "full"], True),
    ("methods.full", lambda c, value, tmp: c["methods"]["full"].update(model={"pretrained": value}), ["full"], False),
    ("gradcheck.set", lambda c, value, tmp: c["gradcheck"].update(set={"model.pretrained": value}), [], True),
    ("base", lambda c, value, tmp: c.update(base=base_with(c, {"model.pretrained": value})), ["agg-w3", "full"], True),
    ("base 'TMP/base.yaml'", base_file_with, ["agg-w3", "full"], True),  # a base config file that names it
])
def test_a_model_folder_is_checked_wherever_the_sweep_sets_it(in_process, tmp_path, place, edit, methods, gradcheck):
    """``model.pretrained`` was checked only where a ``models`` entry set it: a folder under results/pretrained/ that
    no pretrain entry makes, or a file, given in ``set``, in the base config (a file or a mapping), in a ``methods``
    entry or in ``gradcheck.set``, passed the parse, and the jobs that read it failed at their start (a folder that a
    pretrain entry makes was no input of theirs, so they did not wait for it). Each job's composed value is checked,
    each folder once, and the refusal names the key that gives it."""
    place = place.replace("TMP", str(tmp_path))
    config = sweep_config()
    edit(config, "results/pretrained/scenes", tmp_path)
    sweep = Sweep(config, SCHEMA)
    with pytest.raises(SweepError, match="^" + re.escape(
            f"sweep config: {place}: model.pretrained = 'results/pretrained/scenes': a folder under results/pretrained/ "
            "is made by the pretrain entry of its name (pretrain has none); add one")):
        sweep_module.check_input_files(sweep)
    sweep.sweep["pretrain"] = {"scenes": {"config": "config/pretrain.yaml"}}
    sweep_module.check_input_files(sweep)
    # the jobs that read the folder wait for the pretrain job that makes it (a cell's, for any of its runs)
    assert sorted(run["method"] for run in sweep.runs.values()
                  if "results/pretrained/scenes" in sweep.inputs(run)) == methods
    assert ("results/pretrained/scenes" in sweep.inputs(*sweep.runs.values())) == bool(methods)
    assert ("results/pretrained/scenes" in sweep.inputs(*sweep.gradchecks.values())) == gradcheck
    folder = tmp_path / "notes.txt"
    folder.write_text("mine")
    config = sweep_config()
    edit(config, str(folder), tmp_path)
    with pytest.raises(SweepError, match=re.escape(f"sweep config: {place}: model.pretrained = '{folder}' is a file")):
        sweep_module.check_input_files(Sweep(config, SCHEMA))


@pytest.mark.parametrize("embed", [{}, {"models": ["sd3"]}])
def test_an_embed_of_a_model_that_pretrain_makes_is_refused(in_process, embed):
    """A model that agg-bench pretrain makes is conditioned on token hashes: its embed job failed ("nothing to
    embed"), and every run of the model, which waits for its embeddings, never ran. Refused at the parse, naming
    embed.models where it was given and the default (every model) where not; leaving the model out passes."""
    config = sweep_config()
    config["models"]["sd3"]["model.pretrained"] = "results/pretrained/scenes"
    config["pretrain"] = {"scenes": {"config": "config/pretrain.yaml"}}
    config["embed"] = embed
    given = "embed.models" if embed else "embed (every model unless embed.models)"
    with pytest.raises(SweepError, match="^" + re.escape(
            f"sweep config: {given}: sd3 reads model.pretrained = 'results/pretrained/scenes', a model agg-bench "
            "pretrain makes, conditioned on token hashes")):
        sweep_module.check_input_files(Sweep(config, SCHEMA))
    config["models"]["flux"] = {"model.family": "flux", "model.preset": "tiny"}
    config["embed"] = {"models": ["flux"]}
    sweep_module.check_input_files(Sweep(config, SCHEMA))


@pytest.mark.parametrize("section, make", [
    ("methods", lambda c: c["methods"].update({"Full": {"method": {"name": "full"}}})),
    ("models", lambda c: c["models"].update({"SD3": dict(c["models"]["sd3"])})),
    ("devices", lambda c: c["devices"].update({"CPU": dict(c["devices"]["cpu"])})),
    ("references", lambda c: c.update(references=[{"label": "dance", "log": "a.jsonl"},
                                                  {"label": "Dance", "log": "a.jsonl"}])),
    ("pretrain", lambda c: c.update(pretrain={"scene": {"config": "config/pretrain.yaml"},
                                              "Scene": {"config": "config/pretrain.yaml"}})),
])
def test_labels_that_differ_only_in_case_are_refused(in_process, section, make):
    """Two labels of a section that differ only in case name two runs' (references', pretrained models') folders
    that a file system ignoring case holds as one, where the second run replaced the first (its job passes
    --overwrite). Refused before any job."""
    config = sweep_config()
    make(config)
    with pytest.raises(SweepError, match=rf"^sweep config: {section}: '\w+' and '\w+' differ only in case"):
        Sweep(config, SCHEMA)


@pytest.mark.parametrize("label, overrides, first", [
    ("agg-copy", {"method": {"name": "agg", "window": 3, "alpha": "sigma"}}, "agg-w3"),
    # the same once the method's defaults are filled in, and the sweep's seed given again
    ("agg-default", {"method": {"name": "agg", "window": 3, "alpha": "sigma", "route_frac": 1.0}, "seed": 0},
     "agg-w3"),
    ("full-plain", {"method": {"name": "full", "micro_batch": None}}, "full"),
])
def test_two_method_labels_that_compose_the_same_run_are_refused(in_process, label, overrides, first):
    """Two labels of methods whose runs resolve to one run config ran it twice and showed it as two rows of the
    tables. Refused before any job, naming both labels (a label that differs in anything the run reads stays:
    the test below)."""
    config = sweep_config()
    config["methods"][label] = overrides
    with pytest.raises(SweepError, match=re.escape(f"sweep config: methods.{first} and methods.{label} compose the "
                                                   "same run (")) as refused:
        Sweep(config, SCHEMA)
    assert str(refused.value).endswith("; give one") and "\n" not in str(refused.value)


def test_method_labels_that_differ_in_what_the_run_reads_are_kept(in_process):
    config = sweep_config()
    agg = {"name": "agg", "window": 3, "alpha": "sigma"}
    config["methods"].update({"agg-w2": {"method": {**agg, "window": 2}},  # another option
                              "agg-lr": {"method": agg, "train.lr": 2e-4},  # another run key
                              "agg-s1": {"method": agg, "seed": 1}})  # another seed
    assert len(Sweep(config, SCHEMA).runs) == 5


@pytest.mark.parametrize("part, words", [
    ({"methods": ["nosuch"]}, "gradcheck.methods: config error: method.name = 'nosuch': expected one of"),
    ({"methods": ["cached:cache=nosuch"]}, "gradcheck.methods: config error: method.cache = 'nosuch'"),
    ({"methods": ["agg:window=x"]}, "gradcheck.methods: config error: method.window = 'x': expected an integer"),
    ({"methods": ["agg:train.lr=0.1"]}, "gradcheck.methods: config error: train.lr = 0.1: expected a key a replay"),
    # the test sweep samples 6 steps: a window of 7 groups more steps than a sample trains
    ({"windows": [3, 7]}, "gradcheck.windows x alphas x route_fracs x reuse: config error: method.window = 7: "
                          "expected at most the 6 trained steps"),
    # more replays than one gradcheck makes: refused before each is set up
    ({"windows": list(range(1, 101)), "alphas": ["index", "sigma"], "route_fracs": [0, 1]},
     "gradcheck.windows x alphas x route_fracs x reuse, methods: 400 grid rows + 0 methods + the full reference = "
     "401 replays: expected at most 256"),
])
def test_a_gradcheck_replay_that_its_job_would_refuse_is_refused_before_any_job(in_process, part, words):
    """The gradcheck job sets up each replay of its grid and its --methods before its rollout, and refused a bad
    one then: after the workflow had started, its tables waiting on the gradcheck for ever. The methods' check
    sets them up as the job does, before any job."""
    config = sweep_config()
    config["gradcheck"].update(part)
    with pytest.raises(SweepError) as refused:
        Sweep(config, SCHEMA)
    assert str(refused.value).startswith("sweep config: gradcheck sd3_32px_cpu: ") and words in str(refused.value)


@pytest.mark.parametrize("section, key, value", [
    ("gradcheck", "windows", [3, 3]), ("gradcheck", "alphas", ["sigma", "sigma"]), ("gradcheck", "route_fracs", [1, 1.0]),
    ("gradcheck", "reuse", [False, False]), ("gradcheck", "methods", ["fraction", "fraction"]),
    ("gradcheck", "resolutions", [32, 32]), ("gradcheck", "models", ["sd3", "sd3"]), ("embed", "models", ["sd3", "sd3"]),
])
def test_a_repeated_item_of_a_gradcheck_or_embed_list_is_refused(in_process, section, key, value):
    """A repeated window, alpha, route fraction, reuse or method replayed the same gradient again and wrote its row
    twice into the gradcheck table; a repeated model or resolution asked for a job twice. Refused as a repeated seed
    is, before any job."""
    config = sweep_config()
    config.setdefault(section, {})[key] = value
    with pytest.raises(SweepError, match=re.escape(f"{section}.{key} = ") + r".*expected a list without repeated items"):
        Sweep(config, SCHEMA)


@pytest.fixture
def parse_only(monkeypatch):
    """The sweep's parse with the methods' check answered without building any method (no torch)."""
    monkeypatch.setattr(sweep_module, "checked_methods", lambda base, jobs, *args, **kwargs: {job: {} for job in jobs})
    monkeypatch.chdir(ROOT)


@pytest.mark.parametrize("text, words", [
    (b"\xff\xfe: 1\n", "expected UTF-8 text"),
    (b"# nothing here\n", "expected a YAML mapping of run config sections (the file holds none"),
    (b"- train\n", "expected a YAML mapping of run config sections"),
    ((ROOT / "config" / "test.yaml").read_bytes(), "holds 'base', which is no run config section"),
])
def test_a_base_file_that_is_no_run_config_is_named_as_the_sweeps_base(parse_only, tmp_path, text, words):
    """A base file that is no YAML mapping was refused run by run as the run's `--config`, and a sweep file given as
    its own base for its `base` key: the sweep's key is named, with the file."""
    base = tmp_path / "base.yaml"
    base.write_bytes(text)
    config = sweep_config()
    config["base"] = str(base)
    with pytest.raises(SweepError) as refused:
        Sweep(config, SCHEMA, cache_dir=None)
    message = str(refused.value)
    assert message.startswith(("sweep config: config error: base = ", "sweep config: base: ")), message
    assert str(base) in message and words in message and "--config" not in message, message


def test_an_empty_gradcheck_section_replays_the_defaults(parse_only):
    """`gradcheck: {}` ran no replay, where `embed: {}` embeds for every model and a gradcheck section of one key
    takes the defaults of the others; an empty list of its or embed's models ran none without a word."""
    config = sweep_config()
    config["gradcheck"] = {}
    sweep = Sweep(config, SCHEMA, cache_dir=None)
    assert list(sweep.gradchecks) == ["sd3_32px_cpu"]
    assert "--windows 2,3,5 --alphas index,sigma --route-fracs 0,0.5,1" in sweep.gradcheck_command("sd3_32px_cpu")
    for section in ("gradcheck", "embed"):
        config = sweep_config()
        config[section] = {"models": []}
        with pytest.raises(SweepError, match=re.escape(f"{section}.models = []: expected a list of at least 1 item")):
            Sweep(config, SCHEMA, cache_dir=None)


@pytest.mark.parametrize("where, key, words", [
    (("methods", "full"), "train lr", "methods.full = 'train lr': expected a dotted key: names of letters"),
    (("set",), "train..lr", "set = 'train..lr': expected a dotted key"),
    (("pretrain", "p", "set"), "threads=3 --out", "pretrain.p.set = 'threads=3 --out': expected a dotted key"),
])
def test_a_key_that_is_no_dotted_name_is_refused_in_words(parse_only, where, key, words):
    """An override's key that is no dotted name was refused with the schema's regular expression; a pretrain entry's
    `set` key was not checked at all, and one holding `=` was read as another key's value (`threads = '3 --out=1'`)."""
    config = sweep_config()
    if where[0] == "pretrain":
        config["pretrain"] = {"p": {"config": "config/pretrain.yaml"}}
    part = config
    for name in where:
        part = part.setdefault(name, {})
    part[key] = 1
    with pytest.raises(SweepError) as refused:
        Sweep(config, SCHEMA, cache_dir=None)
    # one line, in the words of the one definition both kinds of key share
    message = str(refused.value)
    assert words in message and "^[" not in message and "\n" not in message.strip(), message
    assert message.endswith("(lr, train.lr)"), message


@pytest.mark.parametrize("path, words", [
    (("base",), "config error: base = (not given): expected a string or a mapping (the base run config"),
    (("devices", "cpu", "device"), "config error: devices.cpu.device = (not given): expected a string"),
    (("methods", "full", "method"), "config error: methods.full.method = (not given): expected a mapping"),
    # a key whose schema is a shared definition ($defs/label) says what that definition takes
    (("references", 0, "label"), "config error: references[0].label = (not given): expected a string (a label: "
                                  "letters, digits, '.' and '-', at most 40 characters"),
])
def test_a_required_key_left_out_is_named(parse_only, path, words):
    """A required key left out was told as the whole mapping that lacked it (the sweep's top level, clipped) and
    jsonschema's sentence, without what the key takes."""
    config = sweep_config()
    config["references"] = [{"label": "dance", "log": "a.jsonl"}]
    part = config
    for name in path[:-1]:
        part = part[name]
    del part[path[-1]]
    with pytest.raises(SweepError) as refused:
        Sweep(config, SCHEMA, cache_dir=None)
    assert words in str(refused.value) and str(refused.value).endswith(": a required key"), str(refused.value)


def test_a_model_folder_of_a_pretrain_entry_written_otherwise_is_refused(in_process):
    """``./results/pretrained/scenes`` (or with ``//``, ``..`` or as an absolute path) names the folder that the
    pretrain entry ``scenes`` makes, but is no output of the pretrain rule to Snakemake: the sweep passed, no job
    waited for (or ran) the pretrain job, and every job of the model failed at its start. A trailing / is the same
    file to Snakemake and passes."""
    config = sweep_config()
    config["pretrain"] = {"scenes": {"config": "config/pretrain.yaml"}}
    config["models"]["sd3"]["model.pretrained"] = "results/pretrained/scenes/"
    sweep_module.check_input_files(Sweep(config, SCHEMA))
    for folder in ("./results/pretrained/scenes", "results//pretrained/scenes", "results/pretrained/x/../scenes",
                   str(ROOT / "results" / "pretrained" / "scenes")):
        config["models"]["sd3"]["model.pretrained"] = folder
        with pytest.raises(SweepError, match="^" + re.escape(
                f"sweep config: models.sd3: model.pretrained = '{folder}': the folder results/pretrained/scenes under "
                "results/pretrained/, written otherwise; expected 'results/pretrained/scenes'")):
            sweep_module.check_input_files(Sweep(config, SCHEMA))
