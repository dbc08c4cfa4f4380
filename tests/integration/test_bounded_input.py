"""Bounded input: YAML that would expand without bound, repeated or non-text keys, oversized files, whole-number
floats where an integer goes, values above a key's maximum, and sweeps that would fail after `snakemake -n`.

Every refusal is one line naming the key, the value and what is allowed, exit code 2, nothing written. A
refusal is shown to be cheap by counting work (what the loader visits, what is never called), not by time.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from agg_bench.config import yamlio as config_module  # the bounded YAML loader
from agg_bench.cli import main
from agg_bench.config import (MAX_YAML_BYTES, MAX_YAML_DEPTH, MAX_YAML_VALUES, YamlRefused, check_expanded_size,
                              load_config, yaml_load)
from agg_bench.errors import QUOTE_CHARS, ConfigError, UserError, quote
from agg_bench.runtime.config_check import check_config
from agg_bench.tools import sweep as sweep_module
from agg_bench.tools.sweep import Sweep, SweepError
from test_pipeline import refusal, snakemake, snakemake_here, workdir

ROOT = Path(__file__).resolve().parents[2]
SCHEMA = ROOT / "workflow" / "schemas" / "config.schema.yaml"
SMALL = ["--set", "model.resolution=32", "--set", "sampling.steps=4", "--set", "train.iterations=1",
         "--set", "progress=false"]


def nested_aliases(levels: int = 8, width: int = 9, mapping: bool = False, key: str = "seed") -> str:
    """A "billion laughs": each level holds ``width`` aliases of the level below, so ``levels`` lines of a
    few dozen bytes expand to ``width ** levels`` values."""
    if mapping:
        lines = ["a0: &a0 {" + ", ".join(f"k{j}: x" for j in range(width)) + "}"]
        lines += [f"a{i}: &a{i} {{" + ", ".join(f"k{j}: *a{i - 1}" for j in range(width)) + "}"
                  for i in range(1, levels)]
    else:
        lines = [f"a0: &a0 [{', '.join(['x'] * width)}]"]
        lines += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * width)}]" for i in range(1, levels)]
    return "\n".join(lines) + f"\n{key}: *a{levels - 1}\n"


def one_error_line(capsys, code: int) -> str:
    captured = capsys.readouterr()
    assert code == 2, captured.err
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1, captured.err[:2000]
    assert len(lines[0]) < 1200
    return lines[0]


def refused(capsys, out: Path, *argv: str) -> str:
    """``agg-bench ARGV`` in this process: exit code 2, one stderr line, nothing at ``out``; the line."""
    capsys.readouterr()
    line = one_error_line(capsys, main(list(argv)))
    assert not out.exists() or not any(out.iterdir())
    return line


@pytest.fixture
def never_constructed(monkeypatch):
    """A YAML document refused by its size or keys is never turned into Python objects (a scalar, such as
    the value of ``--set sampling.steps=4``, still is)."""
    original = config_module._Loader.construct_document

    def construct(self, node):
        assert isinstance(node, yaml.ScalarNode), "the document was constructed"
        return original(self, node)

    monkeypatch.setattr(config_module._Loader, "construct_document", construct)


# ----- alias expansion -------------------------------------------------------------------------------------
def test_a_500_byte_alias_bomb_config_is_refused_before_it_is_built(tmp_path, capsys, never_constructed):
    # the issue's reproduction: a few hundred bytes that expand to 9^8 = 43 million values
    bomb = tmp_path / "bomb.yaml"
    bomb.write_text(nested_aliases())
    assert bomb.stat().st_size < 600
    line = refused(capsys, tmp_path / "out", "run", "--config", str(bomb), "--out", str(tmp_path / "out"))
    assert "--config" in line and "bomb.yaml" in line and str(MAX_YAML_VALUES) in line and "aliases" in line


@pytest.mark.parametrize("mapping", [False, True])
def test_the_expanded_size_is_counted_without_expanding(monkeypatch, mapping):
    """30 levels of 2 aliases expand to 2^30 values; the count visits each of the ~90 nodes a few times."""
    visits = []
    children = config_module._node_children
    monkeypatch.setattr(config_module, "_node_children", lambda node: visits.append(node) or children(node))
    with pytest.raises(ConfigError) as err:
        yaml_load(nested_aliases(levels=30, width=2, mapping=mapping), "--config", "bomb.yaml")
    assert str(MAX_YAML_VALUES) in str(err.value)
    assert 0 < len(visits) <= 4 * 30 * 5


def test_a_bomb_of_python_objects_is_counted_by_identity():
    """What Snakemake hands the workflow: parsed YAML whose aliases are shared objects (2^60 values)."""
    value: list = ["x", "x"]
    for _ in range(60):
        value = [value, value]
    with pytest.raises(YamlRefused):
        check_expanded_size({"set": {"reward.options": value}})
    looped: list = []
    looped.append(looped)
    with pytest.raises(YamlRefused, match="inside itself"):
        check_expanded_size(looped)


@pytest.mark.parametrize("text, words", [
    ("a: &a [*a]\n", ["alias inside itself"]),
    ("a: &a {b: *a}\n", ["alias inside itself"]),
    ("a: " + "[" * 200 + "]" * 200 + "\n", [f"{MAX_YAML_DEPTH} levels"]),
    ("a: " + "[" * 60 + "]" * 60 + "\n", [f"{MAX_YAML_DEPTH} levels"]),
    ("a: " + "9" * 5000 + "\n", ["values that YAML can read", "digits"]),
    ("a: 2024-13-45\n", ["values that YAML can read", "month"]),
])
def test_documents_that_never_end_or_nest_too_deep(text, words):
    with pytest.raises(ConfigError) as err:
        yaml_load(text, "--config", "x.yaml")
    for word in words:
        assert word in str(err.value)


def test_anchors_and_merge_keys_of_a_normal_config_still_work(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(
        "train: &train {iterations: 2, lr: 1.0e-4}\n"
        "method:\n  <<: {name: agg, window: 3}\n  window: 2\n"   # a merged key overridden: not a repeat
        "reward: {name: jpeg_compressibility, options: {quality: 50}}\n")
    cfg = load_config(path)
    assert cfg.method.to_dict() == {"name": "agg", "window": 2} and cfg.train.iterations == 2
    shared = yaml_load("base: &b {x: 1, y: [1, 2]}\nfirst: *b\nsecond:\n  <<: [*b, {z: 3}]\n  y: []\n", "k", "v")
    assert shared["second"] == {"x": 1, "y": [], "z": 3} and shared["first"] is shared["base"]


# ----- repeated and non-text keys ---------------------------------------------------------------------------
REPEATED, NOT_TEXT = "each key once", "text keys"  # what the refusal says is allowed


@pytest.mark.parametrize("rule, text, words", [
    (REPEATED, "train: {lr: 1.0e-4}\nsampling: {steps: 4}\ntrain: {iterations: 1}\n", ["'train'", "line 3", "line 1"]),
    (REPEATED, "train:\n  lr: 1.0e-4\n  lr: 2.0e-4\n", ["'lr'", "line 3", "line 2"]),
    (REPEATED, "method: {name: agg, name: full}\n", ["'name'", "line 1"]),
    (REPEATED, "train: {'lr': 1.0e-4, lr: 2.0e-4}\n", ["'lr'"]),
    (NOT_TEXT, "1: x\n", ["'1'", "int", "line 1"]),
    (NOT_TEXT, "train: {iterations: 1}\ntrue: 1\n", ["'true'", "bool", "line 2"]),
    (NOT_TEXT, "null: 1\n", ["null"]),
    (NOT_TEXT, "[train]: 1\n", ["sequence"]),
    (NOT_TEXT, "? {a: 1}\n: 2\n", ["mapping"]),
])
def test_a_repeated_or_non_text_key_is_refused_naming_it(tmp_path, capsys, never_constructed, rule, text, words):
    path = tmp_path / "run.yaml"
    path.write_text(text)
    line = refused(capsys, tmp_path / "out", "run", "--config", str(path), "--out", str(tmp_path / "out"))
    assert "--config" in line and rule in line
    for word in words:
        assert word in line, line


def test_a_file_over_the_size_limit_is_refused_naming_its_size(tmp_path, capsys):
    # that it is refused unread is checked on the bounded read itself (tests/unit/test_bounded_readers.py)
    path = tmp_path / "big.yaml"
    path.write_text("# padding\n" * (MAX_YAML_BYTES // 10 + 1))
    line = refused(capsys, tmp_path / "out", "run", "--config", str(path), "--out", str(tmp_path / "out"))
    assert "--config" in line and "1 MiB" in line and str(path.stat().st_size) in line


# ----- the neighbours: --set, pretrain, calibrate --method, gradcheck lists -----------------------------------
def flow(text: str) -> str:
    """A block document as one line of flow YAML for ``--set key=VALUE`` (its anchors kept)."""
    lines = [ln for ln in text.strip().splitlines()]
    return "{" + ", ".join(lines) + "}"


@pytest.mark.parametrize("value, words", [
    (flow(nested_aliases(levels=7)), [str(MAX_YAML_VALUES)]),
    ("{name: agg, window: 3, name: full}", ["each key once", "'name'"]),
    ("{1: agg}", ["text keys"]),
])
def test_set_values_are_bounded_too(tmp_path, capsys, never_constructed, value, words):
    line = refused(capsys, tmp_path / "out", "run", *SMALL, "--set", f"reward.options={value}",
                   "--out", str(tmp_path / "out"))
    assert "--set" in line
    for word in words:
        assert word in line, line


@pytest.mark.parametrize("text, words", [
    (nested_aliases(key="steps"), ["--config", str(MAX_YAML_VALUES)]),
    ("steps: 10\nsteps: 20\n", ["--config", "'steps'", "line 2"]),
    ("steps: 10.0\n", ["steps", "10.0", "an integer"]),
    ("steps: true\n", ["steps", "True", "an integer"]),
    ("seed: 0.0\n", ["seed", "an integer"]),
])
def test_a_pretrain_config_is_read_the_same_way(tmp_path, capsys, text, words):
    path = tmp_path / "pretrain.yaml"
    path.write_text(text)
    line = refused(capsys, tmp_path / "out", "pretrain", "--config", str(path), "--out", str(tmp_path / "out"))
    for word in words:
        assert word in line, line


def test_a_pretrain_set_value_that_is_a_float_is_refused(tmp_path, capsys):
    line = refused(capsys, tmp_path / "out", "pretrain", "--set", "batch_size=4.0", "--out", str(tmp_path / "out"))
    assert "batch_size" in line and "an integer" in line


@pytest.mark.parametrize("text, words", [
    ("{method: {name: agg, name: full}}", ["--method agg", "each key once"]),
    (flow(nested_aliases(levels=7)), ["--method agg", str(MAX_YAML_VALUES)]),
])
def test_calibrate_method_yaml_is_bounded(tmp_path, capsys, never_constructed, text, words):
    out = tmp_path / "calibration.json"
    line = refused(capsys, tmp_path / "none", "calibrate", *SMALL, "--method", "agg", text, "--out", str(out))
    assert not out.exists()
    for word in words:
        assert word in line, line


def test_gradcheck_lists_refuse_what_is_not_yaml(tmp_path, capsys):
    out = tmp_path / "g.csv"
    line = refused(capsys, tmp_path / "none", "gradcheck", *SMALL, "--windows", "2,[", "--out", str(out))
    assert "--windows" in line and "integers" in line and not out.exists()


# ----- short error lines --------------------------------------------------------------------------------------
def test_a_quoted_value_is_at_most_200_characters_and_says_its_length():
    line = str(ConfigError("model.family", "s" * 5000, "one of sd3, flux"))
    assert "(5000 characters)" in line and "s" * QUOTE_CHARS in line and "s" * (QUOTE_CHARS + 1) not in line
    many = str(ConfigError("train.lora_target_modules", [f"block{i}" for i in range(10_000)], "a short list"))
    assert "(list of 10000 items)" in many and len(many) < 2 * QUOTE_CHARS + 100
    # a value that is huge written out (2^60 values, shared) is quoted with bounded work
    bomb: list = ["x", "x"]
    for _ in range(60):
        bomb = [bomb, bomb]
    assert len(quote(bomb)) < QUOTE_CHARS + 50
    assert len(str(ConfigError("k" * 10_000, 1, "x"))) < 2 * QUOTE_CHARS + 100  # a long key too
    # a message that quotes values itself is kept to one bounded line
    message = str(UserError("manifest " + "m" * 100_000 + "\nsecond line"))
    assert "\n" not in message and len(message) < 1100


def test_a_long_value_in_a_run_config_gives_a_short_line(tmp_path, capsys):
    line = refused(capsys, tmp_path / "out", "run", *SMALL, "--set", "model.family=" + "f" * 100_000,
                   "--out", str(tmp_path / "out"))
    assert "model.family" in line and "(100000 characters)" in line and len(line) < 600


# ----- integers are integers ----------------------------------------------------------------------------------
@pytest.mark.parametrize("item", ["train.iterations=1.0", "seed=0.0", "model.resolution=32.0", "sampling.steps=4.0",
                                  "grpo.group_size=2.0", "grpo.prompts_per_iteration=true", "train.inner_epochs=1.0",
                                  "train.checkpoint_every=0.0", "train.lora_rank=false"])
def test_a_whole_number_float_or_a_boolean_is_not_an_integer(tmp_path, capsys, item):
    key, value = item.split("=")
    line = refused(capsys, tmp_path / "out", "run", *SMALL, "--set", item, "--out", str(tmp_path / "out"))
    assert key in line and "an integer" in line and str(yaml.safe_load(value)) in line


def test_an_integer_key_written_as_a_float_in_a_config_file(tmp_path, capsys):
    path = tmp_path / "run.yaml"
    path.write_text("train: {iterations: 2.0}\n")
    line = refused(capsys, tmp_path / "out", "run", "--config", str(path), "--out", str(tmp_path / "out"))
    assert "train.iterations = 2.0: expected an integer" in line


@pytest.mark.parametrize("method, words", [
    ({"name": "agg", "window": 3.0}, ["method.window", "an integer"]),
    ({"name": "agg", "window": True}, ["method.window", "an integer"]),
    ({"name": "full", "micro_batch": 2.0}, ["method.micro_batch", "integer"]),
    ({"name": "window", "window_size": 4.0}, ["method.window_size", "an integer"]),
    ({"name": "cached", "cache": "fora", "interval": 3.0}, ["method.interval"]),
])
def test_method_options_refuse_floats_for_integers(method, words):
    with pytest.raises(ConfigError) as err:
        check_config(load_config(None, [f"method={json.dumps(method)}"]))
    for word in words:
        assert word in str(err.value), str(err.value)


# ----- upper bounds where a value sets work --------------------------------------------------------------------
@pytest.mark.parametrize("key, low, limit", [
    ("model.resolution", 1, 4096), ("sampling.steps", 1, 1000), ("grpo.group_size", 2, 256),
    ("grpo.prompts_per_iteration", 1, 1024), ("train.iterations", 1, 100_000), ("train.inner_epochs", 1, 100),
    ("train.plan_window", 1, 1000), ("train.lora_rank", 0, 4096), ("prompts.max_tokens", 1, 4096)])
def test_values_that_set_work_have_a_maximum(key, low, limit):
    """Each is refused past its maximum naming its whole range, as the key table gives it."""
    assert load_config(None, [f"{key}={limit}"]).get_path(key) == limit
    with pytest.raises(ConfigError) as err:
        load_config(None, [f"{key}={limit + 1}"])
    shown = f"{limit:,}" if limit >= 10_000 else str(limit)
    assert str(err.value) == f"config error: {key} = {limit + 1}: expected an integer from {low} to {shown}"


def test_plan_refuses_a_huge_resolution_before_planning(tmp_path, capsys, monkeypatch):
    from agg_bench.runtime import memplan

    def never(*args, **kwargs):
        raise AssertionError("planned")

    monkeypatch.setattr(memplan, "plan_memory", never)
    line = refused(capsys, tmp_path / "none", "plan", "--set", "model.preset=random",
                   "--set", "model.resolution=100000", "--json")
    assert "model.resolution = 100000" in line and "4096" in line


@pytest.mark.parametrize("value", ["-1", "-100"])
def test_report_refuses_a_negative_warmup(tmp_path, capsys, value):
    line = refused(capsys, tmp_path / "tables", "report", "--runs", str(tmp_path), "--warmup", value,
                   "--tables", str(tmp_path / "tables"))
    assert "--warmup" in line and value in line and "an integer from 0 to 100,000" in line
    assert not (tmp_path / "tables").exists()


@pytest.mark.parametrize("warmup", [-1, 1.5, "1", True])
def test_a_manifest_warmup_is_a_non_negative_integer(tmp_path, capsys, warmup):
    manifest = tmp_path / "manifest.json"
    manifest.write_text(json.dumps({"runs": [], "warmup": warmup}))
    line = refused(capsys, tmp_path / "tables", "report", "--manifest", str(manifest),
                   "--tables", str(tmp_path / "tables"))
    assert "manifest.json: warmup" in line and "an integer from 0 to 100,000" in line
    assert not (tmp_path / "tables").exists()


# ----- sweeps: what passed `snakemake -n` and failed later -------------------------------------------------------
def sweep_config() -> dict:
    return yaml.safe_load((ROOT / "config" / "test.yaml").read_text())


@pytest.fixture
def no_methods_check(monkeypatch):
    """The sweep checks below decide from the configs alone: the methods' check is never reached."""
    calls = []
    monkeypatch.setattr(sweep_module, "checked_methods", lambda *args, **kwargs: calls.append(args) or {})
    monkeypatch.chdir(ROOT)
    yield
    assert calls == []


def sweep_error(config: dict, files=()) -> str:
    with pytest.raises(SweepError) as err:
        Sweep(config, SCHEMA, None, files)
    message = str(err.value)
    assert message.startswith("sweep config: ") and "\n" not in message and len(message) < 1000
    return message


def test_a_sweep_on_more_processes_than_its_prompts_split_into(no_methods_check):
    config = sweep_config()
    config["devices"] = {"gpu2": {"device": "cuda", "gpus": 2}}
    message = sweep_error(config)
    assert "run full_sd3_32px_s0_gpu2" in message and "grpo.prompts_per_iteration = 1" in message
    assert "devices.gpu2.gpus: 2" in message


def test_a_calibration_on_more_processes_is_checked_as_its_runs(no_methods_check):
    config = sweep_config()
    config["devices"] = {"gpu2": {"device": "cuda", "gpus": 2}}
    for label in config["methods"]:  # every run splits; the calibration has the sweep's 1 prompt
        config["methods"][label]["grpo.prompts_per_iteration"] = 2
    message = sweep_error(config)
    assert "calibrate sd3_32px_gpu2" in message and "grpo.prompts_per_iteration = 1" in message


def test_an_exclude_that_removes_every_run(no_methods_check):
    config = sweep_config()
    config["exclude"] = [{"method": "*"}]
    assert "no runs left after exclude" in sweep_error(config)


@pytest.mark.parametrize("edit, words", [
    (lambda s: s["set"].update({"train.iterations": 2.0}),
     ["run full_sd3_32px", "train.iterations = 2.0", "an integer"]),
    (lambda s: s.update(resolutions=[32.0]), ["resolutions[0] = 32.0", "an integer"]),
    (lambda s: s.update(seeds=[True]), ["seeds[0] = True", "an integer"]),
    (lambda s: s["devices"]["cpu"].update(gpus=1.0), ["devices.cpu.gpus = 1.0", "an integer"]),
    (lambda s: s.update(resolutions=[8192]), ["resolutions[0] = 8192", "an integer from 1 to 4096"]),
    (lambda s: s["methods"].update({"m" * 41: {"method": {"name": "full"}}}), ["methods", "at most 40 characters"]),
])
def test_sweep_integers_and_bounds(no_methods_check, edit, words):
    config = sweep_config()
    edit(config)
    message = sweep_error(config)
    for word in words:
        assert word in message, message


@pytest.mark.parametrize("learning, words", [
    # agg-bench learning refuses both after every run has trained: the sweep refuses them before any job
    ({"eval_source": "checkpoint", "eval_noises": 0}, "learning.eval_source: 'checkpoint' with learning.eval_noises = 0"),
    ({"average_iterations": 2}, "config error: learning.average_iterations = 2: expected at most 1: the learning table"),
])
def test_learning_settings_the_report_would_refuse_after_the_runs(no_methods_check, learning, words):
    config = sweep_config()
    config["set"]["train.iterations"] = 3  # at most 1 iteration at each of a run's two ends
    config["learning"] = learning
    assert words in sweep_error(config)


def test_a_sweep_of_shared_objects_is_refused_by_its_size(no_methods_check):
    config = sweep_config()
    value: list = ["x"] * 9
    for _ in range(8):
        value = [value] * 9
    config["set"]["reward.options"] = value
    assert str(MAX_YAML_VALUES) in sweep_error(config)


@pytest.mark.parametrize("text, words", [
    ("methods: {}\nmethods: {}\n", ["--configfile", "'methods'", "line 2"]),
    (nested_aliases(key="labels"), ["--configfile", str(MAX_YAML_VALUES)]),
])
def test_the_sweep_files_are_read_again_first(no_methods_check, tmp_path, text, words):
    path = tmp_path / "sweep.yaml"
    path.write_text(text)
    message = sweep_error(sweep_config(), files=[str(path)])
    for word in words:
        assert word in message, message


def bomb_sweep(text: str) -> str:
    """The test sweep with a nested-alias value under ``set``, the anchors inside the value itself."""
    return text.replace("set:\n", "set:\n  reward.options: " + flow(nested_aliases(levels=8)) + "\n", 1)


@pytest.mark.parametrize("name, make, words", [
    # the issue's reproductions, through Snakemake's own parse of --configfile (the bomb in a snakemake process, for
    # its exit code; the others by Snakemake's entry point in this process, the same parse)
    ("bomb", bomb_sweep, ["--configfile", "bad.yaml", str(MAX_YAML_VALUES)]),
    ("repeated label", lambda t: t.replace("  agg-w3:\n", "  full:\n    method: {name: full}\n  agg-w3:\n"),
     ["'full'", "line"]),
    ("float iterations", lambda t: t.replace("train.iterations: 2", "train.iterations: 2.0"),
     ["train.iterations = 2.0", "an integer"]),
    ("2 GPUs, 1 prompt", lambda t: t.replace("cpu: {device: cpu, gpus: 0, threads: 1}",
                                             "gpu2: {device: cuda, gpus: 2, threads: 1}"),
     ["run full_sd3_32px_s0_gpu2", "grpo.prompts_per_iteration", "devices.gpu2.gpus: 2"]),
    ("exclude all", lambda t: t + "exclude:\n  - {model: sd3}\n", ["no runs left after exclude"]),
    # read by the manifest rule's parameters while Snakemake parses the rules: a traceback before
    ("no reference manifest", lambda t: t + "report:\n  compare_with: [results/nothing]\n",
     ["report.compare_with", "'results/nothing' has no manifest.json"]),
    # the sweep's own paths taken as written: a quoted ~ was said to be missing, a file's trailing / read the file
    ("quoted ~ base", lambda t: t.replace("base: config/run.yaml", "base: '~/run.yaml'"),
     ["base: '~/run.yaml': starts with ~"]),
    ("base ending with /", lambda t: t.replace("base: config/run.yaml", "base: config/run.yaml/"),
     ["base: 'config/run.yaml/': ends with /"]),
    ("pretrain config ending with /", lambda t: t + "pretrain:\n  scene: {config: config/pretrain.yaml/}\n",
     ["pretrain.scene.config: 'config/pretrain.yaml/': ends with /"]),
])
def test_snakemake_dry_run_refuses_with_one_line(tmp_path, name, make, words):
    work = workdir(tmp_path, shared_checks=True)
    (work / "bad.yaml").write_text(make((work / "config" / "test.yaml").read_text()))
    if name == "bomb":
        proc = snakemake(work, "-n", "--configfile", "bad.yaml", timeout=120)
    else:
        proc = snakemake_here(work, "-n", "--configfile", "bad.yaml")
    message = proc.stderr + proc.stdout
    assert len(message) < 5000, message[:2000]
    line = refusal(proc)
    assert line.startswith("sweep config"), message
    for word in words:
        assert word in line, message
    assert not (work / "results").exists()
