"""Careless input to the verbs (other than ``run`` and ``campaign``, whose walls have tests of their own): every
refusal is one line naming the option, the value and what is allowed, exit code 2, and nothing that was
there before is touched."""
from __future__ import annotations

import argparse
import csv
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from agg_bench import cli, config, errors
from agg_bench.config.yamlio import NUMBER_WORDS
from agg_bench.errors import UserError
from agg_bench.io import read_jsonl
from agg_bench.machine import gpus
from agg_bench.tools.importlog import import_log
from helpers import ENDED_PID, exit_code, running_process

ROOT = Path(__file__).resolve().parents[2]


def _verbs() -> dict[str, argparse.ArgumentParser]:
    (sub,) = [a for a in cli.build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(sub.choices)


PATH_TYPES = (cli.path_arg, cli.file_arg)


def _path_options(types=PATH_TYPES) -> list[tuple[str, list[str]]]:
    """(verb, the arguments that give one of its file or folder options the empty string), from the parser."""
    cases = []
    for verb, parser in _verbs().items():
        for action in parser._actions:
            if action.type in types:
                cases.append((verb, [action.option_strings[0], ""] if action.option_strings else [""]))
    return cases


def test_every_file_or_folder_option_takes_the_shared_path_type():
    """A path option declared another way would take '' for the current folder unseen by the test below."""
    for verb, parser in _verbs().items():
        for action in parser._actions:
            assert (action.type is not Path and not isinstance(action.default, Path)) or action.type in PATH_TYPES, \
                (verb, action.dest)
            if "--config" in action.option_strings or "--out" in action.option_strings:
                assert action.type in PATH_TYPES, (verb, action.dest)
    assert len(_path_options()) >= 30


@pytest.mark.parametrize("verb, argv", _path_options((cli.file_arg,)), ids=lambda x: x if isinstance(x, str) else x[0])
def test_a_file_a_verb_writes_is_no_path_that_ends_with_a_slash(tmp_path, monkeypatch, capsys, verb, argv):
    """pathlib drops a trailing slash: ``calibrate --out DIR/`` wrote a file named DIR, as did run's --done and
    --journal."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as stop:
        cli.main([verb, *argv[:-1], "written/"])
    lines = capsys.readouterr().err.strip().splitlines()
    assert stop.value.code == 2 and len(lines) == 1, lines
    assert "'written/': ends with /, which names a folder; expected a file path" in lines[0], lines
    assert not any(tmp_path.iterdir())


def test_the_files_verbs_write_take_the_file_type():
    assert {(verb, argv[0]) for verb, argv in _path_options((cli.file_arg,))} >= {
        ("run", "--done"), ("run", "--journal"), ("calibrate", "--out"), ("replay", "--out"), ("gradcheck", "--out"),
        ("campaign", "--archive"), ("embed", "--out")}


@pytest.mark.parametrize("verb, argv", _path_options(), ids=lambda x: x if isinstance(x, str) else x[0] or "positional")
def test_an_empty_path_is_refused_for_every_path_option_of_every_verb(tmp_path, monkeypatch, capsys, verb, argv):
    """'' meant the current folder: ``report --runs ''`` read it, an empty --out wrote into it."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as stop:
        cli.main([verb, *argv])
    lines = capsys.readouterr().err.strip().splitlines()
    name = argv[0] if argv[0] else "argument "
    assert stop.value.code == 2 and len(lines) == 1, lines
    assert name in lines[0] and "''" in lines[0] and "file or folder name" in lines[0], lines
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("verb, argv", _path_options(), ids=lambda x: x if isinstance(x, str) else x[0] or "positional")
def test_a_name_too_long_for_a_file_is_refused_for_every_path_option_of_every_verb(tmp_path, monkeypatch, capsys,
                                                                                   verb, argv):
    """A name of more than 255 bytes was an OSError (File name too long) and a traceback, exit code 1."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as stop:
        cli.main([verb, *argv[:-1], "a" * 300])
    lines = capsys.readouterr().err.strip().splitlines()
    assert stop.value.code == 2 and len(lines) == 1, lines
    assert "holds a name of 300 bytes; expected names of at most 255 bytes" in lines[0], lines
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("verb, argv", _path_options(), ids=lambda x: x if isinstance(x, str) else x[0] or "positional")
def test_an_unexpanded_home_is_refused_for_every_path_option_of_every_verb(tmp_path, monkeypatch, capsys, verb, argv):
    """A quoted ``~/x`` (or one from a Makefile variable) reached the verb as it is: ``--out '~/x'`` wrote a folder
    named ``~`` in the current one."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as stop:
        cli.main([verb, *argv[:-1], "~/x"])
    lines = capsys.readouterr().err.strip().splitlines()
    assert stop.value.code == 2 and len(lines) == 1, lines
    assert "'~/x': starts with ~" in lines[0] and "./~" in lines[0], lines
    assert not any(tmp_path.iterdir())


# the config package's types, and the command line's, which import it when a flag is read
NUMBER_TYPES = {config.integer_arg: int, config.number_arg: float, cli.integer_arg: int, cli.number_arg: float}


def _number_flags() -> list[tuple[str, str, type]]:
    """(verb, flag, int or float) of every number flag of every verb, from the parser."""
    return [(verb, action.option_strings[0], NUMBER_TYPES[action.type]) for verb, parser in _verbs().items()
            for action in parser._actions if action.type in NUMBER_TYPES]


def test_every_number_flag_takes_the_shared_number_types():
    """A flag of type int read 017 as 17 where --set read it as 15 (octal), refused 1e3 as "invalid int value"
    without saying what an integer is, and one of type float took nan and inf."""
    for parser in [*_verbs().values(), gpus.build_parser()]:
        for action in parser._actions:
            assert action.type not in (int, float), (parser.prog, action.dest)
    assert {"integer_arg", "number_arg"} <= {a.type.__name__ for a in gpus.build_parser()._actions if a.type}
    assert len(_number_flags()) >= 20


# refused by every number flag, as by every number key of the run config (tests/unit/test_bad_input.py)
NOT_A_NUMBER = ["0x10", "017", "1:30", "1__0", "nan", ".nan", "inf", "-.inf", "1e400", "true", "yes", ""]


@pytest.mark.parametrize("verb, flag, kind", _number_flags(), ids=lambda x: x if isinstance(x, str) else x.__name__)
@pytest.mark.parametrize("text", NOT_A_NUMBER + ["1e3", "1000.0", "1.5"])
def test_a_number_flag_refuses_what_a_number_key_refuses(tmp_path, monkeypatch, capsys, verb, flag, kind, text):
    """One line naming the flag, the value as given and what is allowed, exit code 2, nothing written."""
    if kind is float and text in ("1e3", "1000.0", "1.5"):
        assert config.number_arg(text) == float(text)  # a number, as for a number key
        return
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as stop:
        cli.main([verb, f"{flag}={text}"])
    lines = capsys.readouterr().err.strip().splitlines()
    assert stop.value.code == 2 and len(lines) == 1, lines
    assert f"argument {flag}: {text!r}: expected {NUMBER_WORDS[kind]}" in lines[0], lines
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("text, value", [("1_000", 1000), (" 7", 7), ("+7", 7), ("-0", 0)])
def test_a_number_flag_takes_what_a_number_key_takes(text, value):
    args = cli.build_parser().parse_args(["report", f"--warmup={text}"])
    assert args.warmup == value and type(args.warmup) is int
    args = cli.build_parser().parse_args(["plan", f"--gpu-memory={text}"])
    assert args.gpu_memory == value and type(args.gpu_memory) is float


def test_a_number_flag_and_its_config_key_read_017_alike(tmp_path, capsys):
    """--checkpoint-every 017 was 17 while --set train.checkpoint_every=017 was 15 (YAML 1.1's octal)."""
    for argv in (["--checkpoint-every", "017"], ["--set", "train.checkpoint_every=017"]):
        code = exit_code(["run", *argv, "--out", str(tmp_path / "out")])  # a flag's value refused as argparse reads it
        line, = capsys.readouterr().err.strip().splitlines()
        assert code == 2
        assert "017" in line and "an integer" in line, line
    assert not any(tmp_path.iterdir())


def test_every_flag_of_one_value_is_refused_when_given_twice():
    """A flag of one value that argparse stores (not one that appends) takes the shared once-only action."""
    for parser in [*_verbs().values(), gpus.build_parser()]:
        for action in parser._actions:
            if action.option_strings and isinstance(action, argparse._StoreAction):
                assert isinstance(action, errors._StoreOnce), (parser.prog, action.dest)


@pytest.mark.parametrize("argv, flag, shown", [
    (["plan", "--gpus", "2", "--gpus", "3"], "--gpus", "'2', then '3'"),
    (["plan", "--gpu-memory=80", "--json", "--gpu-memory", "40"], "--gpu-memory", "'80.0', then '40.0'"),
    (["report", "--runs", "a", "b", "--runs", "c", "--tables", "t"], "--runs", "'a b', then 'c'"),
    (["run", "--out", "a", "--out", "b"], "--out", "'a', then 'b'"),
    (["replay", "snap", "--method", "agg", "--method", "full", "--out", "g.safetensors"], "--method", "'agg', then 'full'"),
    (["calibrate", "--repeats", "3", "--repeats", "4", "--out", "c.json"], "--repeats", "'3', then '4'"),
    (["learning", "--manifest", "m.json", "--manifest", "n.json", "--tables", "t"], "--manifest", "'m.json', then"),
])
def test_a_flag_of_one_value_given_twice_is_refused(tmp_path, monkeypatch, capsys, argv, flag, shown):
    """argparse kept the last and dropped the first unseen: report --runs A --runs B reported B alone."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as stop:
        cli.main(argv)
    lines = capsys.readouterr().err.strip().splitlines()
    assert stop.value.code == 2 and len(lines) == 1, lines
    assert f"argument {flag}: given twice ({shown}" in lines[0] and "expected it once" in lines[0], lines
    assert not any(tmp_path.iterdir())


def fails(capsys, argv: list[str]) -> str:
    """Run the command line in this process; assert exit code 2 and one line on stderr; return the line."""
    capsys.readouterr()
    code = cli.main(argv)
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(lines) == 1, lines
    return lines[0]


@pytest.mark.parametrize("flag, least", [("--wait", 0), ("--warmup", 0), ("--active", 1)])
@pytest.mark.parametrize("value", ["1001", str(10**12)])
def test_profile_refuses_a_step_count_past_any_profile_before_it_starts(tmp_path, capsys, monkeypatch, flag, least,
                                                                        value):
    """--wait 10**12 ran training iterations until the process was killed."""
    monkeypatch.setattr(cli, "_run_config", lambda *a: pytest.fail("the steps were not refused first"))
    line = fails(capsys, ["profile", "--method", "full", flag, value, "--out", str(tmp_path / "prof")])
    assert f"{flag} = {value}: expected an integer from {least} to 1000" in line
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("verb, flag, least", [("report", "--warmup", 0), ("learning", "--average", 1)])
@pytest.mark.parametrize("value", ["100001", str(10**30)])
def test_report_counts_past_any_run_are_refused_before_anything_is_read(tmp_path, capsys, verb, flag, least, value):
    """report --warmup 10**30 exited 0: a warm-up longer than a run times all of its iterations, the warm-up
    included. A run has at most train.iterations' maximum, 100,000."""
    line = fails(capsys, [verb, "--manifest", str(tmp_path / "none.json"), "--tables", str(tmp_path / "t"), flag, value])
    assert f"config error: {flag} = {value}: expected an integer from {least} to 100,000" in line, line
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("flag, value, allowed", [("--resolution", "-512", "an integer from 1 to"),
                                                  ("--n-gpus", "0", "an integer from 1 to"),
                                                  ("--method", "", "1 to 200 printable characters")])
def test_import_log_refuses_a_label_out_of_bounds_as_every_verb_refuses_a_flag(tmp_path, capsys, flag, value,
                                                                               allowed):
    """import-log wrote '--resolution -512: expected ...' where the other verbs write 'config error: --flag =
    value: expected ...'."""
    log = tmp_path / "log.jsonl"
    log.write_text(json.dumps({"step": 1, "avg_reward": 0.1, "step_time": 2.0, "grad_norm": 1.0}) + "\n")
    line = fails(capsys, ["import-log", str(log), "--out", str(tmp_path / "run"), flag, value])
    assert line.startswith(f"agg-bench import-log: config error: {flag} = {value if flag != '--method' else repr('')}"
                           f": expected {allowed}"), line
    assert not (tmp_path / "run").exists()


def test_the_report_counts_take_the_bound_of_train_iterations():
    from agg_bench.config import TrainConfig, bound
    from agg_bench.results.loading import MAX_ITERATIONS

    schema = yaml.safe_load((Path(__file__).resolve().parents[2] / "workflow/schemas/config.schema.yaml").read_text())
    assert MAX_ITERATIONS == bound(TrainConfig, "iterations") == 100_000
    assert schema["properties"]["report"]["properties"]["warmup_iterations"]["maximum"] == MAX_ITERATIONS
    assert schema["properties"]["learning"]["properties"]["average_iterations"]["maximum"] == MAX_ITERATIONS


@pytest.mark.parametrize("label", ["", "a\nb", "x" * 201])
def test_calibrate_refuses_a_method_label_no_table_can_show(tmp_path, capsys, monkeypatch, label):
    """An empty label was timed and written as a method named ''."""
    monkeypatch.setattr(cli, "_run_config", lambda *a: pytest.fail("the label was not refused first"))
    line = fails(capsys, ["calibrate", "--method", label, "{method: {name: full}}", "--out", str(tmp_path / "c.json")])
    assert line.startswith("agg-bench calibrate: config error: --method = ") and "1 to 200 printable" in line
    assert not any(tmp_path.iterdir())


def tree(root: Path) -> dict[str, bytes | None]:
    """Every file and folder under ``root`` with its bytes (None for a folder): what a refusal leaves as it was."""
    return {str(p.relative_to(root)): None if p.is_dir() else p.read_bytes() for p in sorted(root.rglob("*"))}


@pytest.fixture
def run(tmp_path) -> Path:
    """A finished run folder (summary.json, env.json, metrics.jsonl), as import-log writes one."""
    log = tmp_path / "log.jsonl"
    log.write_text("".join(json.dumps({"step": i, "avg_reward": 0.1 * i, "step_time": 2.0, "grad_norm": 1.0}) + "\n"
                           for i in range(1, 4)))
    import_log(log, tmp_path / "run")
    return tmp_path / "run"


@pytest.mark.parametrize("argv", [["import-log", "{log}", "--out", "{run}/nested"],
                                  ["report", "--runs", "{run}", "--tables", "{run}/tables"]])
def test_an_output_inside_an_imported_log_is_refused(run, tmp_path, capsys, argv):
    """An import (or a report) into a folder inside an earlier import was written; the earlier import's folder then
    held a stranger, and importing its log again was refused."""
    before = tree(tmp_path)
    argv = [a.replace("{log}", str(tmp_path / "log.jsonl")).replace("{run}", str(run)) for a in argv]
    line = fails(capsys, argv)
    assert f"'{argv[-1]}': inside an imported log '{run}'; expected a folder outside it" in line, line
    assert tree(tmp_path) == before
    assert cli.main(["import-log", str(tmp_path / "log.jsonl"), "--out", str(run)]) == 0  # its own folder again


@pytest.mark.parametrize("name", ["summary.json", "env.json"])
def test_report_refuses_another_verbs_json_as_a_calibration(run, tmp_path, capsys, name):
    """A run's summary.json or env.json passed every check of a calibration (each key may be null) and priced
    nothing."""
    before = tree(tmp_path)
    line = fails(capsys, ["report", "--runs", str(run), "--calibration", str(run / name),
                          "--tables", str(tmp_path / "tables")])
    assert f"calibration {run / name}: no unit_s_per_sample; expected an agg-bench calibrate JSON" in line
    assert tree(tmp_path) == before


@pytest.mark.parametrize("section, entry", [("runs", {"dir": ""}), ("calibration", {"file": ""}),
                                            ("gradcheck", {"file": ""})])
@pytest.mark.parametrize("verb", ["report", "learning"])
def test_a_manifest_entry_with_an_empty_path_is_refused(run, tmp_path, capsys, monkeypatch, section, entry, verb):
    """'' named the current folder: run from inside a run folder, the report read it as a run."""
    manifest = tmp_path / "manifest.json"
    runs = [entry] if section == "runs" else [{"dir": str(run), "method": "full", "seed": 0}]
    manifest.write_text(json.dumps({"runs": runs, **({} if section == "runs" else {section: [entry]})}))
    monkeypatch.chdir(run)
    before = tree(tmp_path)
    line = fails(capsys, [verb, "--manifest", str(manifest), "--tables", str(tmp_path / "tables")])
    key = "dir" if section == "runs" else "file"
    assert f"manifest {manifest}: {section}[0].{key} = '': an empty path, which names the current folder; expected " \
           "a file or folder name" in line, line
    assert tree(tmp_path) == before


def test_a_manifest_entry_with_an_unexpanded_home_is_refused(run, tmp_path, capsys):
    """JSON has no shell: ``"dir": "~/runs/a"`` named a folder ``~`` in the current one."""
    manifest = tmp_path / "manifest.json"
    manifest.write_text(json.dumps({"runs": [{"dir": "~/runs/a", "method": "full", "seed": 0}]}))
    line = fails(capsys, ["report", "--manifest", str(manifest), "--tables", str(tmp_path / "tables")])
    assert f"manifest {manifest}: runs[0].dir = '~/runs/a': starts with ~, which names the home folder only" in line, line
    assert line.endswith("; expected a file or folder name"), line
    assert not (tmp_path / "tables").exists()


@pytest.mark.parametrize("argv", [["plan"], ["pretrain", "--out", "{tmp}/model"], ["gradcheck", "--out", "{tmp}/g.csv"],
                                  ["calibrate", "--out", "{tmp}/c.json"]])
@pytest.mark.parametrize("text", ["", "# nothing here\n"])
def test_an_empty_config_file_is_refused_not_taken_for_the_defaults(tmp_path, capsys, monkeypatch, argv, text):
    """An empty --config (a file cut short, a wrong file) ran the built-in defaults: pretrain trained for minutes."""
    from agg_bench.tools import calibrate, gradcheck, pretrain

    for module, name in ((pretrain, "pretrain"), (gradcheck, "gradcheck"), (calibrate, "write_calibration")):
        monkeypatch.setattr(module, name, lambda *a, **k: pytest.fail("the config was not refused first"))
    config = tmp_path / "config.yaml"
    config.write_text(text)
    before = tree(tmp_path)
    line = fails(capsys, [*(a.replace("{tmp}", str(tmp_path)) for a in argv), "--config", str(config)])
    assert f"--config = '{config}': expected a YAML mapping of " in line and "the file holds none" in line
    assert tree(tmp_path) == before


@pytest.mark.parametrize("argv", [["plan"], ["run", "--out", "{tmp}/run"], ["snapshot", "--out", "{tmp}/snap"]])
@pytest.mark.parametrize("sweep", ["config.yaml", "h200.yaml"])
def test_a_sweep_config_given_for_a_run_config_is_named_as_one(tmp_path, capsys, argv, sweep):
    """config/config.yaml, the config a user meets first, given to plan or run: the line named its key 'base' as
    unknown, not the file as a sweep's."""
    before = tree(tmp_path)
    line = fails(capsys, [*(a.replace("{tmp}", str(tmp_path)) for a in argv), "--config", f"{ROOT}/config/{sweep}"])
    assert f"{ROOT}/config/{sweep}: a sweep config (its keys base, methods: " in line, line
    assert "expected a run config (keys device, " in line, line
    assert (", e.g. its base 'config/run.yaml'" in line) == (sweep == "config.yaml"), line
    assert tree(tmp_path) == before


@pytest.mark.parametrize("value", ["", ",", "fraction,", "fraction,,full"])
def test_gradcheck_refuses_an_empty_methods_item(tmp_path, capsys, monkeypatch, value):
    """--methods '' (or a stray comma) was read as no method and the gradcheck ran without it."""
    monkeypatch.setattr(cli, "_run_config", lambda *a: pytest.fail("the methods were not refused first"))
    from agg_bench.tools import gradcheck

    monkeypatch.setattr(gradcheck, "_gradcheck", lambda *a: pytest.fail("the methods were not refused first"))
    line = fails(capsys, ["gradcheck", "--snapshot", str(tmp_path / "snap"), "--methods", value,
                          "--out", str(tmp_path / "g.csv")])
    assert f"--methods = {value!r}: expected name or name:key=value items, comma-separated, none empty" in line
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("grid, methods, words", [
    (["--windows", ",".join(map(str, range(1, 1001)))], [], "6000 grid rows + 0 methods + the full reference = 6001"),
    (["--windows", ",".join(map(str, range(1, 65))), "--route-fracs", "0,1"], ["full,fraction"],
     "256 grid rows + 1 methods + the full reference = 258 replays"),
])
def test_gradcheck_refuses_a_grid_over_its_bound_before_the_rollout(tmp_path, capsys, monkeypatch, grid, methods, words):
    """A grid of thousands of replays (--windows 1,...,1000 x two alphas) started without a word: a rollout, then
    one backward pass over it per replay, for days. Refused before a config is read or the rollout computed, by
    the CLI and by gradcheck() itself; the bound is the one --help states."""
    from agg_bench.records import MAX_REPLAYS
    from agg_bench.tools import gradcheck

    monkeypatch.setattr(cli, "_run_config", lambda *a: pytest.fail("the grid was not refused first"))
    monkeypatch.setattr(gradcheck, "save_snapshot", lambda *a: pytest.fail("the grid was not refused first"))
    line = fails(capsys, ["gradcheck", *grid, *(a for m in methods for a in ("--methods", m)),
                          "--out", str(tmp_path / "g.csv")])
    assert f"--windows x --alphas x --route-fracs x --reuse, --methods: {words}" in line, line
    assert f"expected at most {MAX_REPLAYS}" in line, line
    with pytest.raises(UserError, match=f"expected at most {MAX_REPLAYS}"):
        gradcheck.gradcheck(tmp_path / "g.csv", None, tmp_path / "snap", windows=range(1, 1001))
    assert not any(tmp_path.iterdir())
    assert f"at most {MAX_REPLAYS} replays" in " ".join(cli.build_parser()._subparsers._group_actions[0]
                                                       .choices["gradcheck"].format_help().split())


@pytest.mark.parametrize("value, key", [("cached:cache=fora,cache=fbc", "cache"),
                                        ("fraction:seed=1,train.plan=steps,seed=2", "seed")])
def test_gradcheck_refuses_a_method_option_given_twice(tmp_path, capsys, monkeypatch, value, key):
    """An option given twice for one method ran the last value only (exit 0), the first silently dropped."""
    monkeypatch.setattr(cli, "_run_config", lambda *a: pytest.fail("the methods were not refused first"))
    line = fails(capsys, ["gradcheck", "--snapshot", str(tmp_path / "snap"), "--methods", value,
                          "--out", str(tmp_path / "g.csv")])
    assert f"--methods = {value!r}: expected each option of a method once ({key} is given twice" in line
    assert not any(tmp_path.iterdir())


def test_a_rerun_of_a_killed_gradcheck_removes_the_snapshot_it_left(tmp_path, capsys):
    """A gradcheck killed (SIGKILL) while it replayed left its temporary snapshot, the model's weights, beside --out
    for good: a rerun made another. Only a temporary of that exact name goes, and only when the process it names
    has ended (a gradcheck of another --out of the same stem, g.md, still writes its own); a user's folders stay.
    A killed gradcheck's of the PID the rerun has (PIDs reused in a fresh container) goes too: the rerun took it
    for its own temporary snapshot, and read it or wrote into it."""
    from agg_bench.io import TEMP_TAG, atomic_path

    stale = [tmp_path / f".g-snapshot{TEMP_TAG}{ENDED_PID}", atomic_path(tmp_path / "g-snapshot", os.getpid())]
    for folder in stale:
        (folder / "transformer").mkdir(parents=True)
        (folder / "rollout.json").write_text("{}")
    # a gradcheck of g.md (same stem, another claim) still running, which writes its snapshot there
    with running_process() as running:
        kept = [tmp_path / "g-snapshot", tmp_path / f".g-snapshot{TEMP_TAG}x1", tmp_path / f".h-snapshot{TEMP_TAG}7",
                tmp_path / f".g-snapshot{TEMP_TAG}{running}"]
        for folder in kept:
            folder.mkdir()
            (folder / "notes.txt").write_text("mine")
        before = tree(tmp_path)
        assert cli.main(["gradcheck", "--config", str(ROOT / "config/run.yaml"), "--set", "model.resolution=32",
                         "--set", "sampling.steps=4", "--set", "grpo.prompts_per_iteration=1", "--set",
                         "progress=false", "--windows", "2", "--alphas", "index", "--route-fracs", "1",
                         "--out", str(tmp_path / "g.csv")]) == 0, capsys.readouterr().err
    after = tree(tmp_path)
    assert not any(folder.exists() for folder in stale) and (tmp_path / "g.csv").is_file()
    assert {k: v for k, v in before.items() if not k.startswith(tuple(folder.name for folder in stale))} == \
        {k: v for k, v in after.items() if k != "g.csv"}


def test_a_killed_gradchecks_snapshot_is_found_by_atomic_paths_own_name(tmp_path):
    """The stale snapshots are found from atomic_path's naming, not a prefix written again: --out g.v1.csv
    makes .g.agg-bench-tmpPID.v1-snapshot (Path's stem ends at the last dot), which a hand-written
    '.g.v1-snapshot.agg-bench-tmp' prefix missed."""

    from agg_bench.io import atomic_path, remove_stale_temps, temp_owner
    from agg_bench.tools.gradcheck import snapshot_target

    for path in (tmp_path / "g-snapshot", tmp_path / "g.v1-snapshot", tmp_path / "a.csv"):
        assert temp_owner(path, atomic_path(path).name) == os.getpid()
        assert temp_owner(path, path.name) is None and temp_owner(path, atomic_path(path).name + "x") is None
    out = tmp_path / "g.v1.csv"
    ended = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = atomic_path(snapshot_target(out), int(ended.stdout))
    stale.mkdir()
    mine = tmp_path / ".g.v1-snapshot.mine"
    mine.mkdir()
    remove_stale_temps(snapshot_target(out))
    assert not stale.exists() and mine.is_dir()


def test_report_refuses_a_copy_of_a_run_folder(run, tmp_path, capsys):
    """A copied run folder (the same run id, method, cell and seed) was pooled into its row: every record counted
    twice in the times while the row said one seed; a repeat under its own run id is a second run."""
    shutil.copytree(run, tmp_path / "copy")
    before = tree(tmp_path)
    line = fails(capsys, ["report", "--runs", str(run), str(tmp_path / "copy"), "--tables", str(tmp_path / "tables")])
    assert line == (f"agg-bench report: run '{tmp_path / 'copy'}' has run_id 'run', as run '{run}' has, with the same "
                    "method, model, resolution, hardware and seed; expected each run once (a copied run folder counts "
                    "its records twice; a repeat takes its own run_id: --set run_id=NAME)")
    assert tree(tmp_path) == before
    import_log(tmp_path / "log.jsonl", tmp_path / "repeat", run_id="repeat")
    assert cli.main(["report", "--runs", str(run), str(tmp_path / "repeat"), "--tables", str(tmp_path / "tables")]) == 0
    rows = list(csv.DictReader((tmp_path / "tables" / "records.csv").open()))
    assert sorted(row["run_id"] for row in rows) == ["repeat"] * 3 + ["run"] * 3


@pytest.mark.parametrize("last", [False, True])
def test_a_metrics_line_longer_than_any_record_is_refused_before_it_is_read_whole(run, tmp_path, capsys, last):
    """A 300 MB line took the report 2 GB of memory and was read as a record (its unknown key ignored); a long
    last line is refused too, not skipped as a torn one."""
    lines = (run / "metrics.jsonl").read_text().splitlines()
    record = {**json.loads(lines[0]), "note": "x" * 2**20}
    lines[-1 if last else 0] = json.dumps(record)
    (run / "metrics.jsonl").write_text("\n".join(lines) + ("" if last else "\n"))
    before = tree(tmp_path)
    line = fails(capsys, ["report", "--runs", str(run), "--tables", str(tmp_path / "tables")])
    assert line == (f"agg-bench report: {run / 'metrics.jsonl'}: line {3 if last else 1} is longer than 1,048,576 "
                    "bytes; expected a record of agg-bench (a JSON object of a few KB per line)")
    assert tree(tmp_path) == before


def test_jsonl_lines_are_read_as_before(tmp_path):
    """One line at a time: records in order, blank lines passed over, a torn last line skipped, a damaged line
    before it and bytes that are not UTF-8 named with their line and byte."""
    path = tmp_path / "a.jsonl"
    path.write_bytes(b'{"a": 1}\n\n{"a": 2}\r\n{"a": 3}\n{"a": ')
    assert list(read_jsonl(path)) == [{"a": 1}, {"a": 2}, {"a": 3}]
    path.write_bytes(b'{"a": 1}\n{"a": \n{"a": 3}\n')
    with pytest.raises(UserError, match=r"line 2 is not valid JSON .*; the file is damaged"):
        list(read_jsonl(path))
    for last in (b'{"a": NaN}\n', b'{"a": \n', b'{"a": 3}}\r\n'):  # a last line whose newline was written is whole
        path.write_bytes(b'{"a": 1}\n' + last)
        with pytest.raises(UserError, match=r"line 2 is not valid JSON .*; the file is damaged"):
            list(read_jsonl(path))
    path.write_bytes(b'{"a": 1}\n{"a": "\xff"}\n')
    with pytest.raises(UserError, match=r"not UTF-8 text \(invalid start byte at byte 16\)"):
        list(read_jsonl(path))
    path.write_bytes(b'{"a": 1}\n[1]\n{"a": 3}\n')
    with pytest.raises(UserError, match="line 2 is not a JSON object"):
        list(read_jsonl(path))


def test_import_log_refusing_a_torn_log_says_one_line(tmp_path, capsys):
    """The note on a torn last line came before the refusal of --out: two lines for one refusal. The note now
    follows a written import."""
    log = tmp_path / "log.jsonl"
    log.write_text(json.dumps({"step": 1, "avg_reward": 0.1, "step_time": 2.0, "grad_norm": 1.0}) + '\n{"step": 2, "av')
    (tmp_path / "taken").write_text("mine")
    before = tree(tmp_path)
    assert fails(capsys, ["import-log", str(log), "--out", str(tmp_path / "taken")]) == (
        f"agg-bench import-log: --out {tmp_path / 'taken'}: exists and is not a folder")
    assert tree(tmp_path) == before
    assert cli.main(["import-log", str(log), "--out", str(tmp_path / "run")]) == 0
    assert capsys.readouterr().err.splitlines() == [
        f"agg-bench import-log: log {log} line 2: left out, not a whole JSON line (Unterminated string starting at line "
        "1 column 13; a log still being written?)"]


def test_import_log_s_note_on_a_torn_line_quotes_a_log_path_with_a_control_character(tmp_path, capsys):
    """The note on a torn last line named the log's raw path: a newline in it split the note in two lines."""
    log = tmp_path / "a\rlog\n.jsonl"
    log.write_text(json.dumps({"step": 1, "avg_reward": 0.1, "step_time": 2.0, "grad_norm": 1.0}) + '\n{"step": 2, "av')
    assert cli.main(["import-log", str(log), "--out", str(tmp_path / "run")]) == 0
    assert capsys.readouterr().err.splitlines() == [
        f"agg-bench import-log: log {str(log)!r} line 2: left out, not a whole JSON line (Unterminated string "
        "starting at line 1 column 13; a log still being written?)"]


@pytest.mark.parametrize("log, what", [("folder", "is a folder"), ("/dev/null", "is not a regular file"),
                                       ("missing.jsonl", "no such file")])
def test_import_log_names_what_its_log_is_instead_of_a_file(tmp_path, capsys, log, what):
    (tmp_path / "folder").mkdir()
    path = log if log.startswith("/") else str(tmp_path / log)
    assert fails(capsys, ["import-log", path, "--out", str(tmp_path / "run")]) == (
        f"agg-bench import-log: log {path}: {what}; expected a DanceGRPO JSONL log file")
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("verb", ["report", "learning"])
@pytest.mark.parametrize("given, found", [("folder", "is a folder"), ("/dev/null", "is not a regular file"),
                                         ("none.json", "no such file")])
def test_a_manifest_that_is_not_a_file_says_what_it_is(tmp_path, capsys, verb, given, found):
    """A folder given as --manifest (the runs folder, say) was 'no such file'."""
    (tmp_path / "folder").mkdir()
    path = given if given.startswith("/") else str(tmp_path / given)
    assert fails(capsys, [verb, "--manifest", path, "--tables", str(tmp_path / "tables")]) == (
        f"agg-bench {verb}: manifest {path}: {found}")
    assert not (tmp_path / "tables").exists()


@pytest.mark.parametrize("file", ["metrics.jsonl", "summary.json"])
def test_a_status_no_run_writes_is_refused_not_shown_as_an_error(run, tmp_path, capsys, file):
    """A record or summary of another agg-bench version (or an edited one) with status 'paused' was read, and its
    row shown as 'error' with the records' times."""
    path = run / file
    path.write_text(path.read_text().replace('"status": "ok"', '"status": "paused"', 1))
    before = tree(tmp_path)
    line = fails(capsys, ["report", "--runs", str(run), "--tables", str(tmp_path / "tables")])
    assert line.startswith(f"agg-bench report: {path}: ")
    assert line.endswith("'status' = 'paused': expected one of ok, oom, diverged, interrupted, error")
    assert tree(tmp_path) == before


@pytest.mark.parametrize("more", [[], ["--eval-noises", "2"]])
def test_learning_with_nothing_to_write_is_refused_before_anything_is_read(run, tmp_path, capsys, monkeypatch, more):
    """Without --tables and --plots, `learning` read every run (with --eval-noises it sampled every checkpoint)
    and wrote nothing, exit 0; `report` refuses the same."""
    from agg_bench.tools import learning

    monkeypatch.setattr(learning, "load_runs", lambda path: pytest.fail("the runs were read"))
    manifest = tmp_path / "manifest.json"
    manifest.write_text(json.dumps({"runs": [{"dir": str(run), "method": "full", "seed": 0}]}))
    before = tree(tmp_path)
    assert fails(capsys, ["learning", "--manifest", str(manifest), *more]) == (
        "agg-bench learning: give --tables DIR and/or --plots DIR")
    assert tree(tmp_path) == before


@pytest.fixture
def fifo():
    """Makes a named pipe at a path; a helper keeps opening each for writing and closing it, so that a reader
    that waits on one (the bug) gets an empty read instead of hanging the test."""
    import threading

    pipes: list[Path] = []
    stop = threading.Event()

    def unblock() -> None:
        while not stop.wait(0.1):
            for path in list(pipes):
                try:
                    os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
                except OSError:  # no reader waiting
                    pass

    def make(path: Path) -> Path:
        os.mkfifo(path)
        pipes.append(path)
        return path

    thread = threading.Thread(target=unblock, daemon=True)
    thread.start()
    yield make
    stop.set()
    thread.join()


@pytest.mark.parametrize("kind", ["device", "pipe"])
def test_a_cell_job_file_that_is_no_regular_file_is_refused_unread(tmp_path, capsys, fifo, kind):
    """`agg-bench cell /dev/zero` read the device until memory ran out; a named pipe hung the command."""
    path = "/dev/null" if kind == "device" else str(fifo(tmp_path / "jobs.json"))
    line = fails(capsys, ["cell", path])
    assert line.startswith(f"agg-bench cell: {path}: is not a regular file; expected an agg-bench cell job file")


@pytest.mark.parametrize("name, kind", [("config.json", "device"), ("metrics.jsonl", "pipe"),
                                        ("summary.json", "pipe")])
def test_a_run_folder_file_that_is_no_regular_file_is_refused_unread(run, tmp_path, capsys, fifo, name, kind):
    """A run folder's file replaced by a link to a device or by a named pipe (a shared results folder) made
    `report` read the device without end or wait on the pipe forever."""
    (run / name).unlink(missing_ok=True)
    if kind == "device":
        (run / name).symlink_to("/dev/null")
    else:
        fifo(run / name)
    line = fails(capsys, ["report", "--runs", str(run), "--tables", str(tmp_path / "tables")])
    assert line.startswith(f"agg-bench report: {run / name}: is not a regular file"), line
    assert not (tmp_path / "tables").exists()


@pytest.mark.parametrize("section, key, value, words", [
    ("runs", "dir", "run\0x", "runs[0].dir = 'run\\x00x': holds a NUL character"),
    ("runs", "dir", "r" * 300, "runs[0].dir = 'rrrr"),
    ("calibration", "file", "c" * 300, "calibration[0].file = 'cccc"),
    ("runs", "resolution", 10**30, f"runs[0].resolution = {10**30}: expected an integer from 1 to 4,096 or null"),
    ("runs", "resolution", -512, "runs[0].resolution = -512: expected an integer from 1 to 4,096 or null"),
    ("calibration", "resolution", 0, "calibration[0].resolution = 0: expected an integer from 1 to 4,096 or null")])
def test_a_manifest_entry_no_file_or_row_can_have_is_one_line(run, tmp_path, capsys, section, key, value, words):
    """A run folder's path with a NUL or a name over 255 bytes was a traceback (ValueError, "File name too long"),
    and so was a resolution past an int64, where the table's integer column is made; a resolution below 1 made a
    row."""
    entry = {"dir": str(run), "method": "full", "seed": 0}
    manifest = {"runs": [{**entry, key: value} if section == "runs" else entry]}
    if section == "calibration":
        manifest["calibration"] = [{"file": str(tmp_path / "c.json"), key: value}]
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    before = tree(tmp_path)
    line = fails(capsys, ["report", "--manifest", str(tmp_path / "manifest.json"), "--tables", str(tmp_path / "t")])
    assert f"manifest {tmp_path / 'manifest.json'}: {words}" in line
    assert tree(tmp_path) == before


def test_a_count_past_an_int64_is_a_float_in_the_tables(run, tmp_path, capsys):
    """A record's count of 10**30 (a finite number, as the record contract asks) made the integer column of the
    tables a traceback ("cannot safely cast non-equivalent float64 to int64")."""
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    (run / "metrics.jsonl").write_text("".join(json.dumps({**r, "forward_grad": 10**30}) + "\n" for r in lines))
    assert cli.main(["report", "--runs", str(run), "--tables", str(tmp_path / "tables")]) == 0
    assert str(10**30) in (tmp_path / "tables" / "records.csv").read_text()
    assert (tmp_path / "tables" / "efficiency.csv").is_file()


def test_a_metrics_file_that_is_a_folder_is_one_line(run, tmp_path, capsys):
    (run / "metrics.jsonl").unlink()
    (run / "metrics.jsonl").mkdir()
    line = fails(capsys, ["report", "--runs", str(run), "--tables", str(tmp_path / "tables")])
    assert line == f"agg-bench report: {run / 'metrics.jsonl'}: is a folder; expected a JSONL file of agg-bench records"
    assert not (tmp_path / "tables").exists()


@pytest.mark.parametrize("edit, words", [
    (lambda path: path.write_text('{"iteration": 0, "eval_reward": 0.5, "eval_reward_color": "x"}\n'),
     "line 1: eval_reward_color = 'x': expected a finite number or null"),
    (lambda path: path.write_text('{"iteration": 0, "eval_reward": 0.5, "t_eval_s": true}\n'),
     "line 1: t_eval_s = True: expected a finite number or null"),
    (lambda path: path.mkdir(), "is a folder; expected a JSONL file"),
    (lambda path: path.symlink_to("/dev/null"), "is not a regular file; expected a JSONL file")])
def test_evaluations_the_learning_tables_cannot_read_are_refused(run, edit, words):
    """A sub-score that is a string was a traceback in the learning tables (could not convert string to float); a
    folder or a device at evaluations.jsonl was taken for a run without evaluations."""
    from agg_bench.reading import RunFolder

    edit(run / "evaluations.jsonl")
    with pytest.raises(UserError, match="evaluations.jsonl: ") as err:
        RunFolder(run).evaluations()
    assert words in str(err.value)


def test_evaluations_with_null_sub_scores_are_read(run):
    from agg_bench.reading import RunFolder

    (run / "evaluations.jsonl").write_text('{"iteration": 0, "eval_reward": 0.5, "eval_reward_color": null, '
                                           '"t_eval_s": 1.0, "t_eval_cpu_s": null}\n')
    assert RunFolder(run).evaluations()[0]["eval_reward_color"] is None


def test_a_snapshot_removes_the_staging_folder_a_killed_snapshot_left_in_its_folder(tmp_path, monkeypatch):
    """A snapshot killed (SIGKILL) after staging its files left the staging folder, a whole transformer's weights,
    inside --out for good: the folder's checks take it for the harness's, and every attempt stages under its own
    PID. The next snapshot into the folder removes it once it holds the claim, before the model is built, one of
    a killed snapshot whose PID this process has too (PIDs reused in a fresh container) included; a live
    process's staging folder stays."""
    from agg_bench.io import atomic_path
    from agg_bench.tools import snapshot

    out = tmp_path / "snap"
    for pid in (ENDED_PID, os.getpid()):
        stale = atomic_path(out / "snapshot", pid)  # where _save_snapshot stages
        (stale / "transformer").mkdir(parents=True)
        (stale / "transformer" / "diffusion_pytorch_model.safetensors").write_bytes(b"weights")

    class Built(Exception):
        pass

    def session(cfg):
        raise Built()  # the model is built after the folder is claimed and cleaned

    monkeypatch.setattr(snapshot, "Session", session)
    with running_process() as live:
        alive = atomic_path(out / "snapshot", live)
        alive.mkdir()
        with pytest.raises(Built):
            snapshot.save_snapshot(config.load_config(None, ["model.resolution=32"]), out)
    assert sorted(p.name for p in out.iterdir()) == [alive.name]


@pytest.mark.parametrize("verb, out", [("replay", "x.safetensors"), ("replay", "transformer/x.safetensors"),
                                       ("gradcheck", "g.csv")])
def test_an_output_inside_the_snapshot_it_reads_is_refused_before_the_snapshot_is_read(tmp_path, capsys, verb, out):
    """The snapshot's folder holds its files only: a replay's gradient or a gradcheck's table written into it made
    a later `agg-bench snapshot --out` of the folder refuse it (files that are not a snapshot)."""
    snap = tmp_path / "snap"
    (snap / "transformer").mkdir(parents=True)
    (snap / "rollout.json").write_text("{}")  # refused before this is read, so no snapshot is needed
    before = tree(tmp_path)
    argv = ["replay", str(snap), "--method", "full"] if verb == "replay" else ["gradcheck", "--snapshot", str(snap)]
    line = fails(capsys, [*argv, "--out", str(snap / out)])
    assert f"--out {snap / out}: inside" in line and str(snap) in line
    assert tree(tmp_path) == before


def test_an_import_stopped_part_way_leaves_the_earlier_import_as_it_was(tmp_path, monkeypatch):
    """An import stopped after writing its metrics (a kill, a full disk) removed the earlier import's summary.json and
    replaced its metrics: the folder read as an interrupted run of the new log, and the earlier import was lost. The
    import is written beside the folder and renamed over it whole."""
    from agg_bench.tools import importlog

    def log(path: Path, steps: int) -> Path:
        path.write_text("".join(json.dumps({"step": s, "avg_reward": 0.1 * s, "step_time": 1.0, "grad_norm": 1.0})
                                + "\n" for s in range(steps)))
        return path

    out = tmp_path / "imported"
    import_log(log(tmp_path / "a.jsonl", 2), out)
    before = tree(out)
    written = importlog.write_json

    def full_disk(path, data):
        if Path(path).name == "summary.json":
            raise OSError(28, "No space left on device")
        written(path, data)

    monkeypatch.setattr(importlog, "write_json", full_disk)
    with pytest.raises(OSError):
        import_log(log(tmp_path / "b.jsonl", 5), out, method="other")
    assert tree(out) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.jsonl", "b.jsonl", "imported"]


@pytest.mark.parametrize("overrides, key", [(["train.cpu_offload=true"], "train.cpu_offload = True"),
                                            (["train.shard=fsdp", "train.eval_ema=0.9"], "train.eval_ema = 0.9")])
def test_plan_refuses_the_sharding_options_a_run_refuses(capsys, overrides, key):
    """`plan --set train.cpu_offload=true` (without train.shard: fsdp) said 'fits: yes' for a config that `run`
    refuses before it builds anything (docs/sharding.md: an error without fsdp)."""
    line = fails(capsys, ["plan", *(a for o in overrides for a in ("--set", o))])
    assert line.startswith(f"agg-bench plan: config error: {key}: expected "), line


def test_an_import_into_a_non_utf8_folder_is_a_run_the_report_can_write(tmp_path, capsys):
    """import-log took a folder's name undecoded for the run id: a name that is no UTF-8 held a lone surrogate,
    written into the records as an escape, and the report of that run ended in a UnicodeEncodeError traceback. The
    id is the name as a run's is (``\\xNN`` for such a byte); the report reads and writes it."""
    log = tmp_path / "log.jsonl"
    log.write_text("".join(json.dumps({"step": i, "avg_reward": 0.1 * i, "step_time": 1.5, "grad_norm": 0.3}) + "\n"
                           for i in range(3)))
    out = os.fsdecode(os.fsencode(str(tmp_path)) + b"/run\xff")
    assert cli.main(["import-log", str(log), "--out", out]) == 0
    assert json.loads(Path(out, "summary.json").read_text())["run_id"] == "run\\xff"
    assert cli.main(["report", "--runs", out, "--tables", str(tmp_path / "tables")]) == 0
    assert "run\\xff" in (tmp_path / "tables" / "records.csv").read_text()


@pytest.mark.parametrize("key", ["run_id", "method", "model"])
def test_report_refuses_a_record_text_that_no_table_can_write(tmp_path, capsys, key):
    """A record or summary text holding a lone surrogate (a JSON escape, "\\udcff") passed the record contract and
    ended the report in a UnicodeEncodeError traceback when it wrote the tables."""
    log = tmp_path / "log.jsonl"
    log.write_text("".join(json.dumps({"step": i, "avg_reward": 0.1 * i, "step_time": 1.5, "grad_norm": 0.3}) + "\n"
                           for i in range(3)))
    run = tmp_path / "run"
    assert cli.main(["import-log", str(log), "--out", str(run)]) == 0
    for name in ("metrics.jsonl", "summary.json"):
        lines = Path(run, name).read_text().splitlines()
        Path(run, name).write_text("\n".join(json.dumps({**json.loads(line), key: "x\udcff"}) for line in lines)
                                   + "\n" if name.endswith("l") else
                                   json.dumps({**json.loads("\n".join(lines)), key: "x\udcff"}))
    before = tree(tmp_path)
    line = fails(capsys, ["report", "--runs", str(run), "--tables", str(tmp_path / "tables")])
    assert f"{key!r} = 'x\\udcff': expected UTF-8 text (no lone surrogate) or null" in line
    assert tree(tmp_path) == before


@pytest.mark.parametrize("verb", ["import-log", "report"])
def test_an_output_name_without_room_for_its_temporary_is_refused_naming_the_flag(tmp_path, capsys, verb):
    """A name of 234 to 255 bytes passed the flag's check, but the lock and temporary written beside it are 22 bytes
    longer: the refusal was 'output folder DIR: cannot write there (File name too long)', naming neither the flag
    nor the name nor what is allowed."""
    log = tmp_path / "log.jsonl"
    log.write_text(json.dumps({"step": 0, "avg_reward": 0.1, "step_time": 1.5, "grad_norm": 0.3}) + "\n")
    out = tmp_path / ("L" * 240)
    argv = (["import-log", str(log), "--out", str(out)] if verb == "import-log"
            else ["report", "--runs", str(tmp_path / "run"), "--tables", str(out)])
    if verb == "report":
        assert cli.main(["import-log", str(log), "--out", str(tmp_path / "run")]) == 0
    before = tree(tmp_path)
    flag = "--out" if verb == "import-log" else "--tables"
    line = fails(capsys, argv)
    assert line.startswith(f"agg-bench {verb}: {flag} '{tmp_path}/LLL") and "a name of 240 bytes; expected a name of " \
        "at most 224 bytes" in line
    assert tree(tmp_path) == before
    assert cli.main([*argv[:-1], str(tmp_path / ("L" * 224))]) == 0


def test_an_output_where_nothing_can_be_written_is_refused_naming_the_flag(tmp_path, capsys):
    """An output under a folder of a file system that takes no new entry (/proc) was refused as 'output folder
    /proc: cannot write there', naming neither the flag nor the output."""
    log = tmp_path / "log.jsonl"
    log.write_text(json.dumps({"step": 0, "avg_reward": 0.1, "step_time": 1.5, "grad_norm": 0.3}) + "\n")
    line = fails(capsys, ["import-log", str(log), "--out", "/proc/agg-bench-run"])
    assert line.startswith("agg-bench import-log: --out /proc/agg-bench-run: cannot write in /proc ("), line


@pytest.mark.parametrize("action, flag, value", [("status", "--archive", "a.tar.gz"), ("unpack", "--work", "w")])
def test_campaign_refuses_an_option_its_action_would_ignore(tmp_path, capsys, monkeypatch, action, flag, value):
    """campaign status --archive A and campaign unpack --work W were taken and ignored (status reads no archive, an
    unpack writes the reference only), where --minutes and --started given to them are refused."""
    monkeypatch.chdir(tmp_path)
    argv = ["campaign", action, "--config", str(ROOT / "config" / "test.yaml"), "--cpu", flag, value]
    if action == "unpack":
        argv += ["--archive", "a.tar.gz", "--reference", "ref"]
    assert fails(capsys, argv) == f"agg-bench campaign: campaign {action}: {flag} is an option of campaign " + (
        "run and unpack; leave it out" if action == "status" else "run and status; leave it out")
    assert list(tmp_path.iterdir()) == []
