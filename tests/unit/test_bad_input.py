"""Bad input to `agg-bench run`: one line naming what is wrong, exit code 2, and nothing written.

Unknown method / model family / reward names, an out-of-range resolution and a missing config file are
covered in test_cli.py, a window longer than the trajectory in test_subsample.py; these are the rest.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import re
from pathlib import Path

import pytest
import torch

from agg_bench.cli import main
from agg_bench.errors import ConfigError, UserError
from agg_bench.machine import distributed
from helpers import exit_code

SMALL = ["--set", "model.resolution=32", "--set", "sampling.steps=4", "--set", "train.iterations=1",
         "--set", "progress=false"]


def run_fails(out: Path, capsys, *args: str) -> str:
    """Run `agg-bench run` in this process; assert exit code 2, one stderr line, nothing written; return the line."""
    capsys.readouterr()
    code = main(["run", *SMALL, *args, "--out", str(out)])
    captured = capsys.readouterr()
    assert code == 2, captured.err
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("agg-bench run: "), captured.err
    assert not out.exists() or not any(out.iterdir())
    return lines[0]


@pytest.mark.parametrize("name, args, expected", [
    ("unknown cache", ["--set", 'method={"name": "cached", "cache": "nocache"}'], ["method.cache", "nocache", "fora"]),
    ("resolution above the model's", ["--set", "model.resolution=4096"], ["model.resolution", "at most"]),
    ("a list's item, named by its index", ["--set", "train.lora_rank=4", "--set", "train.lora_target_modules=[to_q, 3]"],
     ["train.lora_target_modules[1] = 3: expected a string"]),
    ("missing weight folder", ["--set", "model.preset=pretrained", "--set", "model.pretrained={tmp}/weights"],
     ["model.pretrained", "weights"]),
    ("missing prompts file", ["--set", "prompts.file={tmp}/prompts.txt"], ["prompts.file", "prompts.txt"]),
    ("plan window longer than the trajectory", ["--set", "train.plan=groups", "--set", "train.plan_window=5"],
     ["train.plan_window", "5"]),
    ("negative checkpoint interval", ["--checkpoint-every", "-1"], ["train.checkpoint_every", "-1"]),
    ("guidance of another type", ["--set", "model.guidance=high"], ["model.guidance = 'high': expected a number"]),
    ("guidance a flag", ["--set", "model.guidance=true"], ["model.guidance = True: expected a number"]),
    ("guidance not a number", ["--set", "model.guidance=.nan"], ["model.guidance = nan: expected a finite number"]),
    ("negative guidance", ["--set", "model.guidance=-3.5"], ["model.guidance = -3.5: expected a number >= 0 and <= 100"]),
    ("huge guidance", ["--set", "model.guidance=1e300"], ["model.guidance = 1e+300: expected a number >= 0 and <= 100"]),
    ("guidance for a model without its embedding", ["--set", "model.family=flux", "--set", "model.guidance=3.5"],
     ["model.guidance = 3.5: expected 1.0, the default: this flux model's transformer embeds no guidance value"]),
])
def test_bad_input_is_one_line_and_exit_code_2(tmp_path, capsys, name, args, expected):
    args = [a.replace("{tmp}", str(tmp_path)) for a in args]
    line = run_fails(tmp_path / "out", capsys, *args)
    for word in expected:
        assert word in line, (name, line)


def test_a_size_bound_of_one_reads_singular(tmp_path, capsys):
    line = run_fails(tmp_path / "out", capsys, "--set", "train.lora_rank=4", "--set", "train.lora_target_modules=[]")
    assert line.endswith("train.lora_target_modules = []: expected a list of at least 1 item"), line


@pytest.mark.parametrize("verb", ["run", "plan"])
def test_the_pretrained_preset_without_a_folder_is_refused_by_every_verb(tmp_path, capsys, verb):
    # `plan` used to size the tiny model for it and exit 0, while `run` refused the same config
    out = ["--out", str(tmp_path / "out")] if verb == "run" else []
    capsys.readouterr()
    assert main([verb, *SMALL, "--set", "model.preset=pretrained", *out]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "model.preset = 'pretrained'" in lines[0] and "model.pretrained" in lines[0], lines
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("sets, key", [
    (["method.name=agg", "method.window=5"], "method.window"),  # longer than the 4 trained steps
    (["train.plan=groups", "train.plan_window=5"], "train.plan_window"),
    (["method.name=window", "method.window_size=1", "method.window_mode=fixed", "method.window_start=3",
      "train.ignore_last=true"], "method.window_size"),
])
@pytest.mark.parametrize("verb", ["run", "plan"])
def test_what_the_run_refuses_before_building_its_model_plan_refuses_too(tmp_path, capsys, verb, sets, key):
    # `plan` used to answer "fits: yes" for these, which the run refuses
    out = ["--out", str(tmp_path / "out")] if verb == "run" else []
    capsys.readouterr()
    assert main([verb, *SMALL, *(a for s in sets for a in ("--set", s)), *out]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and f"config error: {key} = " in lines[0], lines
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("sets, code", [(["model.resolution=4096"], 2), (["train.lora_rank=2"], 0)])
def test_a_float64_model_logs_nothing_before_the_one_line(capsys, sets, code):
    """diffusers logs a warning on every dtype cast of one of its models ("There are modules in X that should be
    kept in float32: []"): a float64 run of the tiny model printed it for the transformer and the VAE (and the
    memory plan for each adapted model), two lines before a refusal's one line."""
    logged: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = logged.append  # type: ignore[method-assign]
    library = logging.getLogger("diffusers")
    library.addHandler(handler)
    try:
        capsys.readouterr()
        assert main(["plan", *SMALL, "--set", "model.dtype=float64", *(a for s in sets for a in ("--set", s))]) == code
    finally:
        library.removeHandler(handler)
    assert [record.getMessage() for record in logged] == []
    if code == 2:
        line, = capsys.readouterr().err.strip().splitlines()
        assert "model.resolution = 4096" in line, line


def test_malformed_prompts_file(tmp_path, capsys):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "a red cube"}\n{"prompt": "a blue\n')
    line = run_fails(tmp_path / "out", capsys, "--set", f"prompts.file={prompts}")
    assert "prompts.file" in line and "prompts.jsonl:2" in line  # which file, which line


def test_unwritable_output_folder(tmp_path, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    line = run_fails(blocker / "out", capsys)  # a folder cannot be made inside a file, even by root
    assert f"--out {blocker / 'out'}: {blocker} is a file, not a folder" in line


def test_agg_window_longer_than_the_trained_steps(tmp_path, capsys):
    line = run_fails(tmp_path / "out", capsys, "--set", 'method={"name": "agg", "window": 8}')
    assert "method.window" in line


def test_prompts_that_do_not_split_over_the_processes(tmp_path, capsys, monkeypatch):
    # as torchrun with 3 processes would see it: 2 prompts per iteration cannot be split into whole groups
    monkeypatch.setattr(distributed, "process_group", lambda device, single=False: contextlib.nullcontext(distributed.Shard(0, 3)))
    line = run_fails(tmp_path / "out", capsys)
    assert "grpo.prompts_per_iteration" in line and "3" in line


@pytest.mark.parametrize("method", ["full", "fraction", "window", "agg", "cached"])
@pytest.mark.parametrize("key, value", [("micro_batch", -1), ("micro_batch", 0), ("nograd_batch", -3)])
def test_batch_options_are_null_or_positive_for_every_method(tmp_path, capsys, method, key, value):
    from agg_bench.methods.base import METHODS, available_methods

    available_methods()
    options = {"name": method, key: value, **({"cache": "fora"} if method == "cached" else {})}
    if key in {f.name for f in dataclasses.fields(METHODS[method].config_cls)}:
        expected = [f"method.{key}", str(value), "null or an integer >= 1"]
    else:  # a method without this option (no no-grad forwards, say) refuses the key itself
        expected = [f"method.{key}", "known option"]
    line = run_fails(tmp_path / "out", capsys, "--set", f"method={json.dumps(options)}")
    for word in expected:
        assert word in line, line


@pytest.mark.parametrize("value", [".nan", ".inf", "-.inf", "nan", "inf"])
@pytest.mark.parametrize("key", ["train.lr", "grpo.clip_range", "method.route_frac", "sampling.eta"])
def test_nan_and_infinity_are_refused_everywhere(tmp_path, capsys, key, value):
    method = ["--set", 'method={"name": "agg", "window": 2}'] if key.startswith("method.") else []
    line = run_fails(tmp_path / "out", capsys, *method, "--set", f"{key}={value}")
    assert key in line and ("finite" in line or "number" in line), line


@pytest.mark.parametrize("key", ["train.lr", "grpo.clip_range", "grpo.adv_clip_max", "sampling.shift", "train.max_grad_norm"])
@pytest.mark.parametrize("value", ["1e39", "1.0e31"])
def test_a_number_past_any_use_is_refused_before_it_overflows(tmp_path, capsys, key, value):
    """1e39 is past float32's range: as a learning rate or a clip range it ended the run with an overflow
    in its first update (exit 1). A number key without a bound of its own is at most 1e30."""
    line = run_fails(tmp_path / "out", capsys, "--set", f"{key}={value}")
    assert key in line and "<= 1e30" in line, line


@pytest.mark.parametrize("value", ["3600.5", "1e10", "1e30"])
def test_the_nvml_period_is_at_most_an_hour(tmp_path, capsys, value):
    """telemetry.nvml_interval_s took any number up to 1e30: the NVML sampler's thread waits that long between
    samples, and a wait past the platform's time_t (about 9.2e9 s) ended that thread in an OverflowError
    traceback on the first measured block of a GPU run, which went on without its samples."""
    line = run_fails(tmp_path / "out", capsys, "--set", f"telemetry.nvml_interval_s={value}")
    assert line == (f"agg-bench run: config error: telemetry.nvml_interval_s = {float(value)!r}: expected a number > 0 "
                    "and <= 3600"), line


@pytest.mark.parametrize("value, expected", [
    ("100001", "100001: expected an integer from 0 to 100,000"),
    (str(10**30), f"{10**30}: expected an integer from 0 to 100,000"),
    ("-1", "-1: expected an integer from 0 to 100,000"),
    ("1e300", "1e+300: expected an integer"), ("nan", "'nan': expected an integer"),
    (".nan", "nan: expected an integer"), ("x", "'x': expected an integer"), ("true", "True: expected an integer")])
def test_checkpoint_every_is_bounded_as_train_iterations_is(tmp_path, capsys, value, expected):
    """train.checkpoint_every had no maximum: 10**30 ran (a checkpoint never due), where train.iterations and
    eval.every stop at 100,000."""
    line = run_fails(tmp_path / "out", capsys, "--set", f"train.checkpoint_every={value}")
    assert line == f"agg-bench run: config error: train.checkpoint_every = {expected}", line


@pytest.mark.parametrize("key", ["run_id", "model.pretrained", "model.architecture", "prompts.file",
                                 "prompts.cache_dir"])
def test_an_empty_name_or_path_is_refused(tmp_path, capsys, key):
    """`--set model.pretrained=$MODEL` with MODEL unset: an empty path used to count as none, and the run
    trained the tiny model (or the built-in prompts, the folder's name as run_id) with exit code 0."""
    line = run_fails(tmp_path / "out", capsys, "--set", f"{key}=")
    assert f"{key} = ''" in line, line


@pytest.mark.parametrize("key, value, gives", [
    ("model.pretrained", "~/models/sd3", "starts with ~"),
    ("prompts.file", "~/prompts.txt", "starts with ~"),
    ("prompts.cache_dir", "~/embeddings", "starts with ~"),
    ("prompts.file", "{prompts}/", "ends with /"),
])
def test_a_config_path_as_written_that_names_nothing_is_refused(tmp_path, capsys, monkeypatch, key, value, gives):
    """A quoted ~ in a config path made a folder named ~ in the current one (prompts.cache_dir) or was reported as a
    model folder without vae/; a prompts file written with a trailing / was read as the file (pathlib drops it)."""
    monkeypatch.chdir(tmp_path)
    prompts = Path(__file__).resolve().parents[2] / "config" / "prompts" / "objects.txt"
    value = value.replace("{prompts}", str(prompts))
    line = run_fails(tmp_path / "out", capsys, "--set", "model.preset=pretrained", "--set",
                     f"model.pretrained={tmp_path}", "--set", f"{key}={value}")
    assert f"{key} = {value!r}: expected a" in line and gives in line, line
    assert sorted(p.name for p in tmp_path.iterdir()) == [], "nothing made in the current folder"


@pytest.mark.parametrize("escaped", [r"a\nb", r"a\0b", r"\e[2Jmine", r"a\tb", r"a\u2028b", "x" * 201])
def test_a_run_id_that_would_break_a_line_or_a_table_row_is_refused(tmp_path, capsys, escaped):
    """run_id is a label of the records, the summary, the tables and the progress lines (never a path: the
    folder is --out). A newline, NUL or terminal escape passed and split or garbled those lines and rows."""
    config = tmp_path / "run.yaml"
    config.write_text(f'run_id: "{escaped}"\n')
    line = run_fails(tmp_path / "out", capsys, "--config", str(config))
    assert "run_id = " in line and "expected a name of 1 to 200 printable characters, or null" in line, line


@pytest.mark.parametrize("sets, gives", [
    (["sampling.shift=1e-30"], "gives nan"),  # diffusers' schedule: nan, then 0, 0
    (["sampling.shift=0.01"], "gives 1.0000954"),  # above 1: flow_grpo's std takes the root of 1 - s
    (["sampling.shift=1e30"], "gives 1, 1, 1, 1, ..."),  # steps of size 0
    (["sampling.shift=1e8", "sampling.steps=10"], "gives 1, 1, 1"),
])
def test_a_shift_whose_schedule_does_not_fall_from_1_to_0_is_refused(tmp_path, capsys, sets, gives):
    """These shifts passed the schema (a number > 0) and the run ended `diverged` (with numpy's warnings) or
    trained on steps of size 0, with exit code 0."""
    line = run_fails(tmp_path / "out", capsys, *[a for s in sets for a in ("--set", s)])
    assert "sampling.shift" in line and "falls strictly from 1 to 0 in float32" in line and gives in line, line


@pytest.mark.parametrize("schedule, shift", [("diffusers", "0.01"), ("linspace", "1e+30")])
def test_a_sweep_refuses_such_a_shift_before_any_job(schedule, shift):
    """The sweep's check of each job's config (in its child process, before Snakemake runs a job) refuses the shift
    as the run would: it used to pass it, and the job failed once started, after the model was built."""
    from agg_bench.tools.sweep import SweepError, check_methods

    job = [("sampling.schedule", schedule), ("sampling.shift", float(shift))]
    with pytest.raises(SweepError, match=rf"sd3_full: config error: sampling\.shift = {re.escape(shift)}: .*falls "
                                         r"strictly from 1 to 0 in float32"):
        check_methods(None, {"sd3_full": job})
    assert check_methods(None, {"sd3_full": [("sampling.schedule", schedule), ("sampling.shift", 3.0)]})


def test_the_shift_check_names_the_key_and_the_bounds_its_caller_gives():
    """The schedule check says what the shift of its caller takes: a run's sampling.shift, and agg-bench pretrain's
    shift with its own bounds and its sample_steps (the words were once patched by replacing text of this check's
    message, which any rewording here broke without a failure)."""
    from agg_bench.engine.sampler import check_sigmas, flow_sigmas
    from agg_bench.tools.pretrain import load_pretrain_config

    with pytest.raises(ConfigError) as err:
        check_sigmas(flow_sigmas(6, 0.01), 0.01, torch.float32)
    assert err.value.key == "sampling.shift" and err.value.expected.startswith(
        "a shift whose 6-step schedule falls strictly from 1 to 0 in float32 (this one gives 1.0000954, "), str(err.value)
    with pytest.raises(ConfigError) as err:
        check_sigmas(flow_sigmas(6, 0.01), 0.01, torch.float32, key="shift", allowed="a shift in (0, 100]",
                     steps_key="sample_steps")
    assert err.value.key == "shift" and err.value.expected.startswith(
        "a shift in (0, 100] whose sample_steps' 6-step schedule falls strictly"), str(err.value)
    with pytest.raises(ConfigError) as err:
        load_pretrain_config(None, ["shift=0.01", "sample_steps=6"])
    assert (err.value.key, err.value.value) == ("shift", 0.01) and err.value.expected.startswith(
        "a shift in (0, 100] whose sample_steps' 6-step schedule falls strictly from 1 to 0 in float32"), str(err.value)


@pytest.mark.parametrize("sets, key, gives", [
    (["sampling.schedule=linspace", "sampling.shift=1e-30"], "sampling.shift", "step 1 of sampling.sde flow_grpo gives std"),
    (["sampling.schedule=linspace", "sampling.shift=1e-30", "sampling.sde=dance_grpo"], "sampling.shift",
     "step 1 of sampling.sde dance_grpo gives std"),
    (["sampling.eta=1e-30"], "sampling.eta", "step 0 of sampling.sde flow_grpo gives std 1e-30"),
])
def test_a_schedule_whose_noise_underflows_is_refused(tmp_path, capsys, sets, key, gives):
    """linspace with shift 1e-30 falls strictly from 1 to 0 in float32, but its sigmas of ~1e-30 give stds
    whose square, the log-probability's divisor, underflows to 0: the run ended `diverged` with exit code 0."""
    line = run_fails(tmp_path / "out", capsys, *[a for s in sets for a in ("--set", s)])
    assert f"{key} = 1e-30" in line and "normal float32 number" in line and gives in line, line


def test_the_noise_check_passes_every_sde_on_usual_schedules():
    from agg_bench.engine.sampler import SDE_KINDS, check_sigmas, flow_sigmas, linspace_sigmas

    for sigmas in (flow_sigmas(10, 3.0), linspace_sigmas(21, 3.0), linspace_sigmas(6, 1e-10)):
        for kind in SDE_KINDS:
            for dtype in (torch.float32, torch.float64):
                check_sigmas(sigmas, 3.0, dtype, kind, 0.3)


def test_the_linspace_schedule_starts_at_exactly_1():
    """shift(1) = 1; rounding gave 1 + 2e-16 for shift 0.1, refused in float64 as above 1."""
    from agg_bench.engine.sampler import linspace_sigmas

    for shift in (0.1, 0.3, 3.0, 7.0):
        sigmas = linspace_sigmas(10, shift)
        assert sigmas[0].item() == 1.0 and sigmas[-1].item() == 0.0
        u = torch.linspace(1, 0, 11, dtype=torch.float64)[1:]
        assert torch.equal(sigmas[1:], shift * u / (1 + (shift - 1) * u))


@pytest.mark.parametrize("verb", ["run", "plan"])
def test_a_model_folder_with_the_random_preset_is_refused(tmp_path, capsys, verb):
    """model.preset random with model.pretrained trained the folder's model without a word (exit 0, the records
    labelled with the folder); the two name different models. With the default preset the folder is the model, and
    a run folder an older version wrote with both reads as the folder's run it was."""
    from agg_bench.config import upgrade_written, validate
    from agg_bench.config.load import load_config

    folder = str(Path(__file__).resolve().parents[1] / "data" / "sd3-scenes")
    out = ["--out", str(tmp_path / "out")] if verb == "run" else []
    capsys.readouterr()
    assert main([verb, *SMALL, "--set", "model.preset=random", "--set", f"model.pretrained={folder}", *out]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and f"model.pretrained = {folder!r}: expected null with model.preset 'random'" in lines[0] \
        and "model.preset: pretrained" in lines[0], lines
    assert not (tmp_path / "out").exists()
    assert load_config(None, [f"model.pretrained={folder}"]).model.pretrained == folder  # with the default preset
    written = load_config(None, ["model.preset=pretrained", f"model.pretrained={folder}"]).to_dict()
    written["model"]["preset"] = "random"
    assert validate(upgrade_written(written)).model.preset == "pretrained"


@pytest.mark.parametrize("setting", ["train.lora_alpha=8", "train.lora_target_modules=[to_q]"])
def test_a_lora_setting_without_a_lora_rank_is_refused(tmp_path, capsys, setting):
    """train.lora_alpha or train.lora_target_modules without train.lora_rank used to fine-tune the whole model,
    exit code 0."""
    line = run_fails(tmp_path / "out", capsys, "--set", setting)
    assert setting.split("=")[0] in line and "null unless train.lora_rank > 0" in line, line


@pytest.mark.parametrize("verb", [["run", "--config", "{root}/config/run.yaml", *SMALL, "--out", ""],
                                  ["campaign", "run", "--config", "{root}/config/h200.yaml", "--cpu", "--minutes", "1",
                                   "--work", ""]])
def test_an_empty_path_option_is_refused(tmp_path, capsys, monkeypatch, verb):
    """`--out $DIR` with DIR unset was the current folder: the run trained into it when it was empty."""
    root = Path(__file__).resolve().parents[2]
    monkeypatch.chdir(tmp_path)
    code = exit_code([a.replace("{root}", str(root)) for a in verb])
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and "an empty path" in lines[0], lines
    assert list(tmp_path.iterdir()) == []


def test_nan_inside_reward_options_is_refused(tmp_path, capsys):
    line = run_fails(tmp_path / "out", capsys, "--set", 'reward.options={"quality": .nan}')
    assert "reward.options.quality" in line and "finite" in line


@pytest.mark.parametrize("value", ["-1", "4294967296", "1e30", "1.5", "true"])
def test_the_seed_is_a_bounded_integer(tmp_path, capsys, value):
    line = run_fails(tmp_path / "out", capsys, "--set", f"seed={value}")
    assert "seed" in line


def test_numbers_in_exponent_notation_are_numbers(tmp_path):
    from agg_bench.config import load_config
    from agg_bench.runtime.config_check import check_config

    cfg = load_config(None, ["train.lr=1e-5", "grpo.clip_range=2E-4", "train.weight_decay=+1.5e+0"])
    assert (cfg.train.lr, cfg.grpo.clip_range, cfg.train.weight_decay) == (1e-5, 2e-4, 1.5)
    path = tmp_path / "run.yaml"
    path.write_text("train: {lr: 3e-6, iterations: 2}\nmethod: {name: agg, route_frac: 5e-1}\n")
    cfg = check_config(load_config(path))
    assert cfg.train.lr == 3e-6 and cfg.method.options.route_frac == 0.5 and cfg.train.iterations == 2
    assert load_config(None, ["run_id=1e5x"]).run_id == "1e5x"  # not a number: stays a string


# The one rule of a number, wherever it is written (--set, a config file, a flag): (text, what an integer reads,
# what a number reads), None where it is refused. Numbers are decimal: YAML 1.1 read 017 as 15 (octal), 0x10 as
# 16, 0b11 as 3 and 1:30 as 90 (base 60) where the integer flags read 017 as 17 and refused the rest.
NUMBER_FORMS = [("7", 7, 7.0), ("1e3", None, 1000.0), ("1000.0", None, 1000.0), ("1_000", 1000, 1000.0),
                (" 7", 7, 7.0), ("+7", 7, 7.0), ("-0", 0, 0.0), ("1.5", None, 1.5), ("2E-1", None, 0.2),
                ("0x10", None, None), ("017", None, None), ("0o17", None, None), ("0b11", None, None),
                ("1:30", None, None), ("1:30.5", None, None), ("1__0", None, None), ("nan", None, None),
                (".nan", None, None), ("inf", None, None), ("-.inf", None, None), ("1e400", None, None),
                ("true", None, None), ("yes", None, None), ("", None, None)]


@pytest.mark.parametrize("text, integer, number", NUMBER_FORMS, ids=[repr(f[0]) for f in NUMBER_FORMS])
def test_a_number_means_the_same_in_a_set_a_config_file_and_a_flag(tmp_path, text, integer, number):
    from agg_bench.config import dotted_value, load_config, read_number
    from agg_bench.errors import ConfigError

    for key, expected, kind in (("seed", integer, int), ("grpo.beta", number, float)):
        section, _, name = key.rpartition(".")
        file = tmp_path / f"{name}.yaml"
        file.write_text(f"{section}:\n  {name}: {text}\n" if section else f"{name}: {text}\n")
        for path, overrides in ((None, [f"{key}={text}"]), (file, [])):
            if expected is None:
                with pytest.raises(ConfigError) as refusal:
                    load_config(path, overrides)
                assert refusal.value.key == key
            else:
                assert dotted_value(load_config(path, overrides).to_dict(), key) == expected
        flag = read_number(text, kind)  # what every number flag reads (tests/unit/test_verb_input.py)
        assert flag == expected and (flag is None or type(flag) is kind)


# A boolean is true or false (True, TRUE, False, FALSE) in a --set and a config file alike, as in YAML 1.2: YAML
# 1.1's yes, no, on and off are text, so `method.cache=off` is refused as 'off', not as False, a value no one wrote.
BOOLEAN_FORMS = [("true", True), ("True", True), ("TRUE", True), ("false", False), ("False", False),
                 ("FALSE", False), ("yes", None), ("no", None), ("on", None), ("off", None), ("Yes", None),
                 ("OFF", None), ("y", None)]


@pytest.mark.parametrize("text, expected", BOOLEAN_FORMS, ids=[repr(f[0]) for f in BOOLEAN_FORMS])
def test_a_boolean_is_true_or_false_in_a_set_and_a_config_file(tmp_path, text, expected):
    from agg_bench.config import load_config
    from agg_bench.runtime.config_check import check_config
    from agg_bench.errors import ConfigError

    file = tmp_path / "run.yaml"
    file.write_text(f"progress: {text}\n")
    for path, overrides in ((None, [f"progress={text}"]), (file, [])):
        if expected is None:
            with pytest.raises(ConfigError, match=re.escape(f"progress = '{text}': expected true or false")):
                load_config(path, overrides)
        else:
            assert load_config(path, overrides).progress is expected
    if expected is None:  # the word as written, where a key takes words
        with pytest.raises(ConfigError, match=re.escape(f"method.cache = '{text}': expected one of")):
            check_config(load_config(None, ["method.name=cached", f"method.cache={text}"]))


def test_a_bare_on_key_is_text():
    """YAML 1.1 read `reward: {on: x0}` as the key true; it is the key `on`."""
    from agg_bench.config import load_config

    assert load_config(None, ["reward={name: jpeg_compressibility, on: x0}"]).reward.on == "x0"


def _outcome(function):
    try:
        return function()
    except UserError as err:
        return err


@pytest.mark.parametrize("text, integer, number", NUMBER_FORMS, ids=[repr(f[0]) for f in NUMBER_FORMS])
def test_a_number_in_an_environment_variable_follows_the_one_rule(monkeypatch, text, integer, number):
    """The launcher's variables and AGG_BENCH_GPUS were read with regexes of their own (017 was 17, where --set
    refuses it) and AGG_BENCH_DIST_TIMEOUT_S with float() (017 was 17 seconds, 1_000 1000)."""
    from agg_bench.errors import launch_place
    from agg_bench.machine import gpus

    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", distributed.TIMEOUT_ENV):
        monkeypatch.delenv(name, raising=False)
    cases = [("WORLD_SIZE", {}, distributed.launched_world_size, 1, 65536),
             ("RANK", {"WORLD_SIZE": "65536"}, distributed.launched_rank, 0, 65535),
             ("LOCAL_RANK", {}, lambda: distributed.launched_local_rank(0), 0, 65535),
             ("MASTER_PORT", {"WORLD_SIZE": "2", "RANK": "0", "MASTER_ADDR": "127.0.0.1"},
              distributed.check_rendezvous_variables, 1, 65535)]  # checked, not returned: None where taken
    for name, others, read, low, high in cases:
        with monkeypatch.context() as env:
            for key, value in {**others, name: text}.items():
                env.setenv(key, value)
            got = _outcome(read)
            if integer is not None and low <= integer <= high:
                assert got == (None if name == "MASTER_PORT" else integer), (name, got)
            else:
                assert isinstance(got, UserError) and f"environment variable {name}" in str(got), (name, got)
    with monkeypatch.context() as env:
        env.setenv(distributed.TIMEOUT_ENV, text)
        got = _outcome(distributed.collective_timeout)
        if number is not None and 1 <= number:
            assert got.total_seconds() == number
        else:
            assert isinstance(got, UserError) and distributed.TIMEOUT_ENV in str(got)
    if text.strip():  # empty: the variable is left to CUDA_VISIBLE_DEVICES
        got = _outcome(lambda: gpus.visible_devices({gpus.ENV_DEVICES: text}))
        if integer is not None and 0 <= integer:
            assert got == [str(i) for i in range(integer)]
        else:
            assert isinstance(got, UserError) and gpus.ENV_DEVICES in str(got)
    with monkeypatch.context() as env:
        for key, value in {"WORLD_SIZE": text, "RANK": "0", "LOCAL_RANK": "0"}.items():
            env.setenv(key, value)
        assert launch_place() == ((0, 0) if integer is not None and integer > 1 else None)


@pytest.mark.parametrize("name, value", [("WORLD_SIZE", "02"), ("LOCAL_RANK", "00"),
                                         (distributed.TIMEOUT_ENV, "0600")])
def test_a_launcher_variable_with_a_leading_zero_is_refused_before_anything_runs(tmp_path, capsys, monkeypatch,
                                                                                 name, value):
    for key in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", distributed.TIMEOUT_ENV):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv(name, value)
    line = run_fails(tmp_path / "out", capsys, "--set", "train.shard=fsdp")
    assert line.startswith(f"agg-bench run: environment variable {name}={value!r}: expected "), line
    assert "decimal" in line, line


DEVICE_NAMES = [("cpu", ("cpu", None)), ("auto", ("auto", None)), ("cuda", ("cuda", None)), ("cuda:0", ("cuda", 0)),
                ("cuda:127", ("cuda", 127)), ("cuda:128", None), ("cuda:999999999", None), ("cuda:017", None), ("cuda:00", None), ("cuda:+1", None), ("cuda:1_0", None),
                ("cuda: 1", None), ("cuda:-1", None), ("cuda:", None), ("cuda:1e1", None), ("cuda:0x1", None),
                ("cpu:0", None), ("CUDA", None), (1, None), (None, None)]


@pytest.mark.parametrize("name, parts", DEVICE_NAMES, ids=[repr(n) for n, _ in DEVICE_NAMES])
def test_a_device_index_is_an_integer_as_every_number_is(name, parts):
    from agg_bench.config import device_parts

    assert device_parts(name) == parts


@pytest.mark.parametrize("name", ["cuda:017", "cuda:00"])
def test_a_device_index_with_a_leading_zero_is_refused_by_every_reader(tmp_path, capsys, name):
    """cuda:017 passed the device key's check, and torch then read it as device 17 or refused it in a traceback
    (torch 2.13: RuntimeError 'Invalid device string'), where every number of the harness refuses 017."""
    from agg_bench.errors import ConfigError
    from agg_bench.machine.devices import resolve_device
    from agg_bench.tools.pretrain import load_pretrain_config

    expected = "(N: a GPU index from 0 to 127 in decimal digits, e.g. cuda:1)"
    line = run_fails(tmp_path / "out", capsys, "--set", f"device={name}")
    assert f"config error: device = {name!r}: expected cpu, cuda, cuda:N or auto {expected}" in line, line
    with pytest.raises(ConfigError) as refusal:
        resolve_device(name, "--device")
    assert refusal.value.key == "--device" and refusal.value.expected.endswith(expected)
    with pytest.raises(ConfigError) as refusal:
        load_pretrain_config(None, [f"device={name}"])
    assert refusal.value.key == "device" and refusal.value.expected == f"cpu, cuda or cuda:N {expected}"


@pytest.mark.parametrize("item", ["=1", " =1", ".x=1", "train..lr=1e-5", "train.=1", "train.lr.=1"])
def test_a_set_key_with_an_empty_part_is_refused_naming_the_set(tmp_path, capsys, item):
    """'.x=1' and 'train..lr=1' were refused as a key '' or 'train.' that no one wrote ("config error:  = ...")."""
    line = run_fails(tmp_path / "out", capsys, "--set", item)
    assert f"--set = {item!r}: expected key=value with a key of non-empty dotted parts" in line, line


def test_a_config_or_prompts_file_that_is_not_utf8(tmp_path, capsys):
    bad = b"train: {lr: 1.0e-4}\n# caf\xe9\n"
    config = tmp_path / "run.yaml"
    config.write_bytes(bad)
    capsys.readouterr()
    assert main(["run", "--config", str(config), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--config" in err[0] and "UTF-8" in err[0]
    prompts = tmp_path / "prompts.txt"
    prompts.write_bytes(b"a red cube\na caf\xe9 at night\n")
    line = run_fails(tmp_path / "out", capsys, "--set", f"prompts.file={prompts}")
    assert "prompts.file" in line and "UTF-8" in line


@pytest.mark.parametrize("section", ["method:\n", "method: agg\n", "method: [agg]\n"])
def test_a_method_section_that_is_not_a_mapping(tmp_path, capsys, section):
    config = tmp_path / "run.yaml"
    config.write_text(section)
    capsys.readouterr()
    assert main(["run", "--config", str(config), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "method" in err[0] and "mapping" in err[0]
    line = run_fails(tmp_path / "out", capsys, "--set", "method=null")
    assert "method" in line and "mapping" in line


def test_a_sweep_refuses_a_shift_whose_noise_underflows_before_any_job():
    """The sweep's check of each job's config takes the SDE and its eta too, so the shift that falls from 1 to 0
    but whose noise underflows is refused before any job, as the run refuses it."""
    from agg_bench.tools.sweep import SweepError, check_methods

    job = [("sampling.schedule", "linspace"), ("sampling.shift", 1e-30)]
    with pytest.raises(SweepError, match=r"sd3_full: config error: sampling\.shift = 1e-30: .*normal float32 number"):
        check_methods(None, {"sd3_full": job})


def test_the_sweeps_schedule_without_diffusers_is_diffusers_schedule_bit_for_bit():
    """The sweep's check computes diffusers' schedule without importing diffusers; it must refuse exactly the
    shifts the run refuses, so it is the run's schedule bit for bit (nan where that is nan)."""
    from agg_bench.engine.sampler import flow_sigmas, flow_sigmas_formula

    for steps in (1, 2, 3, 7, 10, 28, 40, 50):
        for shift in (1e-30, 1e-4, 0.01, 0.5, 1.0, 1.5, 3.0, 3.1, 6.0, 12.5, 1e8, 1e30):
            assert torch.equal(flow_sigmas_formula(steps, shift).nan_to_num(-1.0),
                               flow_sigmas(steps, shift).nan_to_num(-1.0)), (steps, shift)


def test_qwen_image_s_own_schedule_with_one_step_names_sampling_steps(tmp_path, capsys, monkeypatch):
    """Qwen-Image's scheduler stretches its schedule so that it ends at shift_terminal 0.02 before 0; with one
    step (and `sampling.shift: null`, the model's own schedule) diffusers' schedule is nan, and the refusal, once
    the model was built, named `sampling.shift = null`. The step count is the cause: one line names it, before
    anything is built for the random preset (the sweep's check too), and from the session's schedule for a model
    folder whose scheduler has a shift_terminal. No full-size weights: building them fails the test."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    from agg_bench.config import load_config
    from agg_bench.engine import architectures
    from agg_bench.engine.families import architecture
    from agg_bench.engine.models import load_policy
    from agg_bench.errors import ConfigError
    from agg_bench.runtime.session import run_sigmas
    from agg_bench.tools.sweep import SweepError, check_methods

    def no_full_size_weights(*args, **kwargs):
        raise AssertionError("a full-size model was built")

    monkeypatch.setattr(architectures, "build_random", no_full_size_weights)
    expected = "config error: sampling.steps = 1: expected an integer >= 2 with this model's own schedule"
    qwen = ["model.family=qwenimage", "model.preset=random", "sampling.shift=null", "sampling.steps=1"]
    line = run_fails(tmp_path / "out", capsys, *[a for s in qwen for a in ("--set", s)])
    assert expected in line and "shift_terminal 0.02" in line, line
    job = [("model.family", "qwenimage"), ("model.preset", "random"), ("sampling.shift", None)]
    with pytest.raises(SweepError, match=re.escape(f"qwen_full: {expected}")):
        check_methods(None, {"qwen_full": [*job, ("sampling.steps", 1)]})
    assert check_methods(None, {"qwen_full": [*job, ("sampling.steps", 2)]})
    # a model folder with Qwen-Image's scheduler: the tiny Qwen-Image given the architecture's scheduler config
    policy = load_policy("qwenimage", "tiny", None)
    policy.scheduler_config = dict(FlowMatchEulerDiscreteScheduler(**architecture("qwenimage").scheduler).config)
    shape = policy.latent_shape(64)
    own = ["model.family=qwenimage", "sampling.shift=null"]
    with pytest.raises(ConfigError, match=re.escape(expected)):
        run_sigmas(load_config(None, [*own, "sampling.steps=1"]), policy, shape)
    # two steps end at the terminal sigma; one step with a shift of its own is whole
    sigmas = run_sigmas(load_config(None, [*own, "sampling.steps=2"]), policy, shape)
    assert sigmas[0] == 1 and abs(float(sigmas[1]) - 0.02) < 1e-6 and sigmas[2] == 0
    assert run_sigmas(load_config(None, ["model.family=qwenimage", "sampling.steps=1"]), policy, shape).tolist() == \
        [1.0, 0.0]


def test_a_model_folder_s_terminal_schedule_with_one_step_is_refused_before_any_job(tmp_path, capsys, monkeypatch):
    """A model folder whose scheduler config has a shift_terminal (Qwen-Image's own schedule) with one step was
    refused only when a run read the folder: `snakemake -n` on a sweep naming it passed. The workflow's parse
    (Sweep, before the methods' check) and `agg-bench run` (before anything is built) read the folder's
    scheduler config and refuse it in one line; a file over the bound of a model folder's configs is left unread
    (to the run, which names it)."""
    import yaml

    from agg_bench.engine.families import model_shift_terminal
    from agg_bench.jsonfiles import MAX_CONFIG_BYTES
    from agg_bench.tools import sweep as sweep_module
    from agg_bench.tools.sweep import Sweep, SweepError

    root = Path(__file__).resolve().parents[2]
    folder = tmp_path / "qwen-folder"
    (folder / "scheduler").mkdir(parents=True)
    config = folder / "scheduler" / "scheduler_config.json"
    config.write_text(json.dumps({"_class_name": "FlowMatchEulerDiscreteScheduler", "shift_terminal": 0.02}))
    expected = "config error: sampling.steps = 1: expected an integer >= 2 with this model's own schedule"
    sweep = yaml.safe_load((root / "config" / "test.yaml").read_text())
    sweep["models"] = {"qwen": {"model.family": "qwenimage", "model.preset": "pretrained",
                                "model.pretrained": str(folder)}}
    sweep["set"].update({"sampling.steps": 1, "sampling.shift": None})
    sweep.pop("gradcheck")
    checked = []
    monkeypatch.setattr(sweep_module, "checked_methods", lambda *args, **kwargs: checked.append(args) or {})
    monkeypatch.chdir(root)
    schema = root / "workflow" / "schemas" / "config.schema.yaml"
    with pytest.raises(SweepError, match=re.escape(f"run full_qwen_32px_s0_cpu (methods.full, models.qwen): {expected}")):
        Sweep(sweep, schema, cache_dir=None)
    assert checked == []  # refused while the workflow is parsed, from the folder's file alone
    own = ["model.family=qwenimage", "model.preset=pretrained", f"model.pretrained={folder}", "sampling.shift=null"]
    line = run_fails(tmp_path / "out", capsys, *[a for s in [*own, "sampling.steps=1"] for a in ("--set", s)])
    assert expected in line and "shift_terminal 0.02" in line, line
    # two steps, a shift of the run's own, or a linspace schedule: the folder's terminal sigma is no problem
    for steps, shift, schedule in ((2, None, "diffusers"), (1, 3.0, "diffusers"), (1, 3.0, "linspace")):
        sweep["set"].update({"sampling.steps": steps, "sampling.shift": shift, "sampling.schedule": schedule})
        with pytest.raises(KeyError):  # past every check of the parse, at the stubbed methods' answer
            Sweep(sweep, schema, cache_dir=None)
    # null and 0 stretch nothing (as the policy reads them); an oversize file is not read here
    for value in (None, 0, False, "0.02"):
        config.write_text(json.dumps({"shift_terminal": value}))
        assert model_shift_terminal({"family": "qwenimage", "pretrained": str(folder)}) is None, value
    config.write_text(json.dumps({"shift_terminal": 0.02, "pad": " " * MAX_CONFIG_BYTES}))
    assert model_shift_terminal({"family": "qwenimage", "pretrained": str(folder)}) is None


@pytest.mark.parametrize("setting, expected", [
    ("train.transitions_per_step=.nan", "train.transitions_per_step = nan: expected a known key here"),
    ("sampling.sa_solver_tau=.inf", "sampling.sa_solver_tau = inf: expected a known key here"),
    ("train.minibatch_unit=.nan", "train.minibatch_unit = nan: expected one of ['groups', 'slices']"),
    ("train.ignore_last=-.inf", "train.ignore_last = -inf: expected true or false"),
    ("train.eval_ema_every=.nan", "train.eval_ema_every = nan: expected an integer"),
    # a number's NaN and infinities are still refused as not finite, not by its bounds
    ("train.eval_ema=.nan", "train.eval_ema = nan: expected a finite number"),
    ("train.eval_ema=.inf", "train.eval_ema = inf: expected a finite number"),
])
def test_nan_given_to_a_key_that_takes_no_number_is_refused_for_what_the_key_takes(tmp_path, capsys, setting, expected):
    """NaN and infinities were refused before the schema: a mistyped key given `.nan` was told to be a finite
    number, not that no such key exists, and a flag or a name given one the same."""
    line = run_fails(tmp_path / "out", capsys, "--set", setting)
    assert expected in line, line


@pytest.mark.parametrize("where", ["set", "methods", "models", "gradcheck"])
@pytest.mark.parametrize("key, expected", [
    ("train.transitions_per_step", "train.transitions_per_step = nan: expected a known key here"),
    ("train.ignore_last", "train.ignore_last = nan: expected true or false"),
    ("train.minibatch_unit", "train.minibatch_unit = nan: expected one of ['groups', 'slices']"),
    ("train.eval_ema", "train.eval_ema = nan: expected a finite number"),
])
def test_nan_under_a_sweep_s_run_keys_is_refused_for_what_the_key_takes(monkeypatch, where, key, expected):
    """A sweep's `set:`, a label's overrides under `methods:` / `models:` and `gradcheck.set:` are run-config keys:
    NaN given to one that is unknown, a flag or a name was told to be a finite number (the sweep schema does not know
    the run keys); it is refused as a run config refuses it, naming where in the sweep it is."""
    import yaml

    from agg_bench.tools import sweep as sweep_module
    from agg_bench.tools.sweep import Sweep, SweepError

    root = Path(__file__).resolve().parents[2]
    sweep = yaml.safe_load((root / "config" / "test.yaml").read_text())
    label = {"set": "set", "methods": "methods.full", "models": "models.sd3", "gradcheck": "gradcheck.set"}[where]
    part = sweep
    for name in label.split("."):
        part = part.setdefault(name, {})
    part[key] = float("nan")
    monkeypatch.setattr(sweep_module, "checked_methods", lambda *args, **kwargs: {})
    monkeypatch.chdir(root)
    with pytest.raises(SweepError) as refused:
        Sweep(sweep, root / "workflow" / "schemas" / "config.schema.yaml", cache_dir=None)
    assert f"config error: {label}.{expected}" in str(refused.value), str(refused.value)


@pytest.mark.parametrize("args, named", [(["--trials", "3"], "--trials 3: expected at least"),
                                         (["--startup", "-1"], "--startup -1: expected an integer >= 0"),
                                         (["--limit", "nan"], "--limit nan: expected a positive")])
def test_signal_trials_refuses_a_plan_it_cannot_keep(args, named, tmp_path):
    """scripts/signal_trials.py with fewer trials than its start-up and claimed ones (it ran 4 where 3 were
    asked), a negative count or a limit that is not a time: one line, exit 2, before anything is written."""
    import subprocess
    import sys

    script = Path(__file__).parents[2] / "scripts" / "signal_trials.py"
    work = tmp_path / "work"
    proc = subprocess.run([sys.executable, str(script), *args, "--work", str(work)], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.splitlines() == [proc.stderr.strip()] and proc.stderr.startswith(named)
    assert not work.exists()


def test_signal_trials_work_folder_that_cannot_be_made(tmp_path):
    """--work naming a file was a FileExistsError traceback from mkdir."""
    import subprocess
    import sys

    script = Path(__file__).parents[2] / "scripts" / "signal_trials.py"
    (tmp_path / "file").write_text("kept")
    for work in (tmp_path / "file", tmp_path / "file" / "sub"):
        proc = subprocess.run([sys.executable, str(script), "--work", str(work)], capture_output=True, text=True,
                              timeout=60)
        assert proc.returncode == 2 and proc.stdout == "", proc.stderr
        assert proc.stderr.splitlines() == [proc.stderr.strip()], proc.stderr
        assert proc.stderr.startswith(f"--work {work}: cannot make the folder (") and "expected a folder path" in proc.stderr
    assert (tmp_path / "file").read_text() == "kept"


@pytest.mark.parametrize("prompts, key", [(None, "reward.name"), ("one green circle on the right\nthree apples\n",
                                                                    "prompts.file")])
def test_prompts_the_scene_reward_cannot_score(tmp_path, capsys, prompts, key):
    """The scene reward refused the first prompt it could not parse in the run's first iteration, after the run
    folder was written (a summary with status error)."""
    args = ["--set", "reward.name=scene"]
    if prompts is not None:
        (tmp_path / "prompts.txt").write_text(prompts)
        args += ["--set", f"prompts.file={tmp_path / 'prompts.txt'}"]
    line = run_fails(tmp_path / "out", capsys, *args)
    assert f"config error: {key} = " in line and "is not a scene caption" in line, line
    assert prompts is None or "'three apples'" in line


@pytest.mark.parametrize("rank, printed", [(0, True), (1, False)])
def test_a_bad_collective_timeout_is_printed_once_per_machine(monkeypatch, rank, printed):
    """torchrun gives every process of a machine the same AGG_BENCH_DIST_TIMEOUT_S, so every one refuses it alike:
    each printed it (`agg-bench run: rank 1: environment variable ...` beside rank 0's line), where an error raised
    alike is the machine's first process's to print (docs/sharding.md)."""
    from agg_bench.errors import user_error_line

    for key, value in {"WORLD_SIZE": "2", "RANK": str(rank), "LOCAL_RANK": str(rank), "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": "29500", distributed.TIMEOUT_ENV: "0"}.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(UserError) as raised:
        with distributed.process_group(torch.device("cpu")):
            pytest.fail("a process group was joined with a timeout of 0 s")
    line = user_error_line("agg-bench run", raised.value)
    if printed:
        assert line is not None and line.startswith(f"agg-bench run: environment variable {distributed.TIMEOUT_ENV}="), line
    else:
        assert line is None, line
