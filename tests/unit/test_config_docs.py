"""The typed run config is the one source: docs/configuration.md's table is the generated one, the defaults
and the schema come from the same fields, config.json keeps its format, and the method's options are typed once,
when the loaded config is checked (check_config). (That loading imports no torch and no method needs a fresh
interpreter: tests/integration/test_fresh_interpreters.py.)"""
import json
from pathlib import Path
from typing import Literal

import pytest

from agg_bench.config import DEFAULTS, RunConfig, load_config, run_schema
from agg_bench.errors import ConfigError
from agg_bench.config import docs as config_docs
from agg_bench.config.sections import Section
from agg_bench.runtime.config_check import check_config

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "configuration.md"

# The defaults as config.json files hold them, keys in this order: a rerun and --resume compare old files
# against these (a key a file lacks counts as its default here, and a value an older file wrote for a key whose
# values changed reads as the keys it stands for: tests/unit/test_recipes.py).
WRITTEN_DEFAULTS = {
    "run_id": None, "seed": 0, "device": "cpu", "progress": True,
    "model": {"family": "sd3", "preset": "tiny", "pretrained": None, "resolution": 128, "dtype": "float32",
              "architecture": None, "guidance": 1.0},
    "prompts": {"file": None, "max_tokens": 16, "max_sequence_length": None, "cache_dir": "results/embeddings"},
    "sampling": {"steps": 10, "sde": "flow_grpo", "eta": 0.7, "shift": 3.0, "same_noise_per_group": True,
                 "schedule": "diffusers"},
    "grpo": {"group_size": 4, "prompts_per_iteration": 2, "clip_range": 1e-4, "adv_clip_max": 5.0, "beta": 0.0,
             "adv_std": "group", "adv_ddof": 0, "adv_eps": 1e-8, "kl_form": "transition"},
    "train": {"iterations": 2, "lr": 1e-4, "weight_decay": 0.0, "max_grad_norm": 1.0, "timestep_fraction": 1.0,
              "plan": "steps", "plan_window": 5, "inner_epochs": 1, "gradient_checkpointing": False,
              "lora_rank": 0, "lora_alpha": None, "lora_target_modules": None, "checkpoint_every": 0,
              "shard": "none", "cpu_offload": False, "budget": None,
              "pass_costs": {"forward_nograd": 1.0, "forward_grad": 1.1, "backward": 1.6}, "ignore_last": False,
              "minibatches": 1, "minibatch_unit": "groups", "eval_ema": None, "eval_ema_every": 1,
              "eval_ema_updates": 1},
    "method": {"name": "full"},
    "reward": {"name": "jpeg_compressibility", "options": {}, "on": "final"},
    "telemetry": {"enabled": True, "nvml_interval_s": 0.05, "saved_activations": "first", "tensorboard": False},
    "eval": {"every": 0, "noises": 16, "seed": 0, "sampler": "sde", "batch_size": 64},
}


def test_the_docs_table_is_the_generated_one():
    text = DOC.read_text(encoding="utf-8")
    assert config_docs.with_table(text) == text, \
        "docs/configuration.md is stale: python -m agg_bench.config.docs --write docs/configuration.md"
    assert config_docs.main(["--check", str(DOC)]) == 0


def test_the_table_lists_every_key_with_its_default_once():
    rows = config_docs.reference_rows()
    keys = [row[0].strip("`") for row in rows]
    assert len(keys) == len(set(keys))

    def leaves(data, prefix=""):
        for key, value in data.items():
            if isinstance(value, dict) and value and key != "options":
                yield from leaves(value, f"{prefix}{key}.")
            else:
                yield prefix + key

    assert set(leaves(DEFAULTS)) | {"method.<option>"} == set(keys)
    assert all(row[3] for row in rows), "every key has a meaning"
    row = dict((r[0].strip("`"), r) for r in rows)
    assert row["model.resolution"][1:3] == ["`128`", "integer from 1 to 4096"]
    assert row["grpo.clip_range"][1:3] == ["`1e-4`", "number > 0"]
    assert row["sampling.shift"][2] == "number > 0 or null"
    assert row["device"][2] == ("cpu, cuda, cuda:N or auto (N: a GPU index from 0 to 127 in "
                                "decimal digits, e.g. cuda:1)")
    # a key whose own wording says "or null" already reads so once
    assert row["model.pretrained"][2] == "a folder's path, or null"
    assert row["run_id"][2] == "a name of 1 to 200 printable characters, or null"
    assert not [r[0] for r in rows if "or null or null" in r[2]]
    # an exclusive upper bound is said as the inclusive one is
    assert row["train.eval_ema"][2] == "number > 0 and < 1 or null"


@pytest.mark.parametrize("nullable", [False, True])
@pytest.mark.parametrize("value, expected", [(2.0, "an integer"), (True, "an integer"), (3, "one of [1, 2, 4]")])
def test_a_choice_of_integers_refuses_what_an_integer_key_refuses(nullable, value, expected):
    """An enum compares 2.0 equal to 2: a choice of integers took a whole-number float that every integer key
    refuses."""
    from agg_bench.config.schema import check_config_values, field_schema
    from agg_bench.errors import ConfigError

    annotation = Literal[1, 2, 4] | None if nullable else Literal[1, 2, 4]
    schema = {"type": "object", "properties": {"k": field_schema(annotation, {}, "a choice")}}
    check_config_values({"k": 2}, schema)
    if nullable:
        check_config_values({"k": None}, schema)
        expected = expected.replace("an integer", "an integer or null").replace("4]", "4, None]")
    with pytest.raises(ConfigError) as err:
        check_config_values({"k": value}, schema)
    assert (err.value.key, err.value.expected) == ("k", expected)


def test_the_pretrain_table_lists_every_pretrain_key_from_its_fields():
    """docs/configuration.md's pretrain table is generated from PretrainConfig's fields, as the run config's is from
    the sections: every key once, in field order, with its default, its bounds and a meaning."""
    from agg_bench.config.pretrain_keys import PretrainConfig, pretrain_schema

    rows = config_docs.reference_rows(PretrainConfig, "", pretrain_schema())
    assert [r[0].strip("`") for r in rows] == list(PretrainConfig().to_dict()) == list(pretrain_schema()["properties"])
    assert all(row[3] for row in rows), "every key has a meaning"
    row = {r[0].strip("`"): r for r in rows}
    assert row["resolution"][1:3] == ["`32`", "integer from 16 to 256"]
    assert row["steps"][1:3] == ["`1500`", "integer from 1 to 1,000,000"]
    assert row["lr"][1:3] == ["`0.001`", "number > 0 and <= 1"]
    assert row["ema_decay"][2] == "number >= 0 and < 1"
    assert row["pixel_factor"][2] == "`1`, `2` or `4`"
    assert row["family"][2] == "`sd3` or `flux`"
    assert row["device"][2] == "cpu, cuda or cuda:N (N: a GPU index from 0 to 127 in decimal digits, e.g. cuda:1)"
    assert config_docs.pretrain_table() in DOC.read_text(encoding="utf-8")


def test_a_stale_pretrain_table_fails_the_check(tmp_path, capsys):
    """--check covers both tables: a pretrain row edited by hand is stale, and --write puts the generated one back."""
    doc = tmp_path / "configuration.md"
    doc.write_text(DOC.read_text(encoding="utf-8").replace("| `steps` | `1500` |", "| `steps` | `1000` |"),
                   encoding="utf-8")
    assert config_docs.main(["--check", str(doc)]) == 1
    assert "the key tables are stale" in capsys.readouterr().err
    assert config_docs.main(["--write", str(doc)]) == 0
    assert doc.read_text(encoding="utf-8") == DOC.read_text(encoding="utf-8")
    doc.write_text(DOC.read_text(encoding="utf-8").replace(config_docs.PRETRAIN_END, ""), encoding="utf-8")
    with pytest.raises(SystemExit) as exit_info:
        config_docs.main(["--check", str(doc)])
    assert exit_info.value.code == 2 and "no generated pretrain table" in capsys.readouterr().err


def test_the_defaults_are_what_config_json_files_hold():
    assert json.dumps(DEFAULTS) == json.dumps(WRITTEN_DEFAULTS)  # values and key order
    assert RunConfig().to_dict() == DEFAULTS


def test_the_schema_has_every_key_and_nothing_else():
    def keys(schema, prefix=""):
        for key, prop in schema["properties"].items():
            if prop.get("type") == "object" and "properties" in prop:
                yield from keys(prop, f"{prefix}{key}.")
            else:
                yield prefix + key

    schema = run_schema()
    assert set(keys(schema)) == {k.strip("`") for k, *_ in config_docs.reference_rows()} - {"method.<option>"}
    assert schema["additionalProperties"] is False and schema["properties"]["model"]["additionalProperties"] is False
    assert schema["properties"]["method"]["required"] == ["name"]
    assert "additionalProperties" not in schema["properties"]["method"]  # the method's class checks the rest
    assert schema["properties"]["seed"] == {"type": "integer", "minimum": 0, "maximum": 4294967295,
                                            "description": schema["properties"]["seed"]["description"]}


def test_config_json_keeps_the_values_and_order_as_written(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("train: {lr: 1}\nmethod: {window: 3, name: agg}\nreward: {options: {quality: 50}}\n")
    cfg = load_config(path, ["train.max_grad_norm=2"])
    written = cfg.to_dict()
    assert written["train"]["lr"] == 1 and isinstance(written["train"]["lr"], int)  # not converted to 1.0
    assert list(written["method"].items()) == [("window", 3), ("name", "agg")]
    assert list(written) == list(DEFAULTS) and list(written["train"]) == list(DEFAULTS["train"])
    assert written["reward"] == {"name": "jpeg_compressibility", "options": {"quality": 50}, "on": "final"}
    assert RunConfig.from_dict(written).to_dict() == written
    assert cfg.get_path("method.window") == 3 and cfg.get_path("train.max_grad_norm") == 2


def test_an_older_config_json_reads_with_the_defaults_of_keys_it_lacks():
    older = json.loads(json.dumps(WRITTEN_DEFAULTS))
    del older["grpo"]["kl_form"], older["train"]["shard"], older["telemetry"], older["train"]["pass_costs"]
    del older["eval"], older["train"]["minibatches"], older["train"]["minibatch_unit"], older["train"]["eval_ema"]
    del older["train"]["eval_ema_every"], older["train"]["eval_ema_updates"], older["model"]["guidance"]
    cfg = RunConfig.from_dict(older)
    assert (cfg.grpo.kl_form, cfg.train.shard, cfg.telemetry.saved_activations) == ("transition", "none", "first")
    assert (cfg.train.pass_costs.backward, cfg.train.budget, cfg.eval.every) == (1.6, None, 0)
    assert (cfg.train.minibatches, cfg.train.optimizer_steps, cfg.train.minibatch_unit) == (1, 1, "groups")
    assert cfg.train.eval_ema is None and cfg.train.eval_ema_every == 1 and cfg.train.eval_ema_updates == 1
    assert cfg.model.guidance == 1.0


def test_sections_are_typed():
    cfg = check_config(load_config(None, ['method={"name": "agg", "window": 2}']))
    assert isinstance(cfg.train, Section) and cfg.train.lr == 1e-4 and cfg.model.family == "sd3"
    assert cfg.method.name == "agg" and cfg.method.options.window == 2 and cfg.method.options.route_frac == 1.0
    assert load_config(None).method.options is None


def test_a_section_given_by_set_merges_as_a_file_s_section_does(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("train: {iterations: 6, lr: 0.5}\nmethod: {name: agg, window: 3}\n"
                    "reward: {name: scene, options: {weights: {color: 1}}}\n")
    cfg = load_config(path, ["train.max_grad_norm=2.0", "train={lr: 1.0e-3}", "method={route_frac: 0.5}",
                             "reward={options: {weights: {shape: 1}}}"])
    # the file's and the earlier --set's train keys stay; only lr changes
    assert (cfg.train.iterations, cfg.train.lr, cfg.train.max_grad_norm) == (6, 1e-3, 2.0)
    # a method mapping without a name adds to the method there is; one with a name replaces it whole
    assert cfg.method.name == "agg" and cfg.method.given == {"window": 3, "route_frac": 0.5}
    replaced = load_config(path, ['method={"name": "guess"}']).method
    assert replaced.name == "guess" and replaced.given == {}
    # options replace the options there are whole, as a file's do
    assert cfg.reward.name == "scene" and cfg.reward.options == {"weights": {"shape": 1}}
    with pytest.raises(ConfigError, match="train = 3: expected a mapping"):
        load_config(path, ["train=3"])


def test_the_method_is_checked_and_typed_once(monkeypatch):
    from agg_bench.methods import base
    from agg_bench.methods.base import build_estimator
    from agg_bench.runtime import config_check

    calls = []
    real = base.method_config

    def counted(*a, **k):
        calls.append(a)
        return real(*a, **k)

    monkeypatch.setattr(base, "method_config", counted)
    monkeypatch.setattr(config_check, "method_config", counted)
    cfg = load_config(None, ['method={"name": "agg", "window": 2}'])
    assert calls == []  # loading does not check the method
    cfg = check_config(cfg)
    assert len(calls) == 1
    estimator = build_estimator(cfg)
    assert len(calls) == 1 and estimator.config is cfg.method.options
    assert check_config(cfg).method.options is estimator.config and len(calls) == 1
    unchecked = load_config(None, ['method={"name": "agg", "window": 2}'])
    assert build_estimator(unchecked).config == cfg.method.options and len(calls) == 2


@pytest.mark.parametrize("flag", ["--schema", None])
def test_the_docs_command_prints_the_schema_and_the_table(capsys, flag):
    assert config_docs.main([flag] if flag else []) == 0
    out = capsys.readouterr().out
    if flag:
        assert json.loads(out) == run_schema()
    else:
        assert out.strip() == config_docs.reference_tables()
        assert config_docs.reference_table() in out and config_docs.pretrain_table() in out




@pytest.mark.parametrize("flag", ["--write", "--check"])
@pytest.mark.parametrize("make, words", [
    (lambda p: None, "No such file or directory"),
    (lambda p: p.mkdir(), "Is a directory"),
    (lambda p: p.write_bytes(b"\xff\xfe"), "can't decode byte"),
    (lambda p: p.write_text("# notes\n"), "no generated table"),
])
def test_a_document_that_holds_no_generated_table_is_one_line(tmp_path, capsys, flag, make, words):
    """`--write FILE` / `--check FILE` on a missing file, a folder, non-UTF-8 bytes or a document without the
    markers was a traceback; one line names the flag, the file and what it should be, exit 2, nothing written."""
    doc = tmp_path / "doc.md"
    make(doc)
    before = doc.read_bytes() if doc.is_file() else None
    with pytest.raises(SystemExit) as exit_info:
        config_docs.main([flag, str(doc)])
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 2 and len(err) == 1, err
    assert f"{flag} {doc}: " in err[0] and words in err[0] and "expected a Markdown document" in err[0], err
    assert (doc.read_bytes() if doc.is_file() else None) == before


@pytest.mark.parametrize("module", ["agg_bench.config.docs", "agg_bench.methods.option_tables"])
def test_a_reader_of_the_schema_that_has_gone_is_no_bug(capsys, monkeypatch, module):
    """`python -m agg_bench.methods.option_tables --schema | head`: the reader closed the pipe and the generator
    ended with a BrokenPipeError traceback and exit code 1; it ends quietly with 128 + SIGPIPE, as every
    agg-bench verb does."""
    import importlib
    import os
    import signal
    import sys

    main = importlib.import_module(module).main
    read_end, write_end = os.pipe()
    os.close(read_end)
    capsys.readouterr()
    with os.fdopen(write_end, "w") as pipe:
        monkeypatch.setattr(sys, "stdout", pipe)
        assert main(["--schema"]) == 128 + signal.SIGPIPE
        monkeypatch.undo()
    assert capsys.readouterr().err == ""
