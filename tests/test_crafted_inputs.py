"""Crafted inputs that a command reads: a model folder (``token_hash.json``, ``transformer/config.json``),
``agg-bench pretrain``'s sizes and seed, and the run folders ``agg-bench learning`` reads (config.json,
records, checkpoints, the manifest and its options). Each is refused with one line naming the file or key, exit
code 2, before anything is allocated or written; or works.

The model is the committed learning-testbed model (tests/data/sd3-scenes, 0.6 M parameters), copied; the
learning runs are one run of 2 iterations on it, copied and edited.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from agg_bench.cli import main
from agg_bench.config import load_config
from agg_bench.engine.scenes import all_scenes
from agg_bench.errors import ConfigError
from agg_bench.runtime import memplan
from agg_bench.runtime.train import Session, train

ROOT = Path(__file__).resolve().parents[1]
SCENE_MODEL = ROOT / "tests" / "data" / "sd3-scenes"


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("model") / "sd3-scenes"
    shutil.copytree(SCENE_MODEL, folder)
    return folder


def model_copy(model: Path, tmp_path: Path) -> Path:
    folder = tmp_path / "model"
    shutil.copytree(model, folder)
    return folder


def model_config(folder: Path, *overrides: str):
    return load_config(None, ["model.family=sd3", "model.preset=pretrained", f"model.pretrained={folder}",
                              "model.resolution=32", "sampling.steps=2", "grpo.group_size=2", "progress=false",
                              "reward.name=scene", *overrides])


def one_line(capsys, code: int) -> str:
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and "Traceback" not in lines[0], lines
    return lines[0]


# ----- a model folder -----------------------------------------------------------------------------------
@pytest.mark.parametrize("text, words", [
    ('{"max_tokens": -1, "seed": 0}', "max_tokens from 1 to 4096 (it has -1)"),
    ('{"max_tokens": Infinity, "seed": 0}', "max_tokens from 1 to 4096 (it has inf)"),
    ('{"max_tokens": 6.9, "seed": 0}', "max_tokens from 1 to 4096 (it has 6.9)"),  # was truncated to 6
    ('{"max_tokens": 6, "seed": 100000000000000000000000}', "seed from 0 to 4294967295"),
    ('{"max_tokens": 6}', "seed from 0 to 4294967295 (it has None)"),
    ("[6, 0]", "holds a list, not a JSON object"),
    ('{"max_tokens": 6, "seed": 0, "pad": "' + "x" * 70_000 + '"}', "over the 64 KiB such a file may have"),
])
def test_a_crafted_token_hash_file_is_refused(model, tmp_path, capsys, text, words):
    """token_hash.json is read bounded (64 KiB: the 200 MB file was read whole) and its values are integers
    within bounds (-1 gave a traceback, Infinity an overflow, 6.9 was silently truncated)."""
    folder = model_copy(model, tmp_path)
    (folder / "token_hash.json").write_text(text)
    with pytest.raises(ConfigError) as err:
        Session(model_config(folder))
    assert err.value.key == "model.pretrained" and "token_hash.json" in str(err.value) and words in str(err.value)
    out = tmp_path / "run"
    args = [a for item in ["model.family=sd3", "model.preset=pretrained", f"model.pretrained={folder}",
                           "model.resolution=32", "train.iterations=1", "progress=false"] for a in ("--set", item)]
    capsys.readouterr()
    line = one_line(capsys, main(["run", *args, "--out", str(out)]))
    assert words in line and len(line) < 600 and not out.exists()


@pytest.mark.parametrize("key, value, words", [
    ("num_layers", 100_000, "num_layers = 100000: expected an integer from 1 to 256"),
    ("num_attention_heads", 0, "num_attention_heads = 0: expected an integer from 1 to 16384"),
    ("patch_size", -2, "patch_size = -2"),
    ("dual_attention_layers", [0, 10**9], "dual_attention_layers holds 1000000000"),
])
def test_a_transformer_config_out_of_bounds_is_refused_before_a_model_is_built(model, tmp_path, monkeypatch, key,
                                                                               value, words):
    """num_layers = 100,000 ran for minutes at 4.4 GB while diffusers built the model: the sizes are checked
    before anything is built from them, by the run and by the memory planner."""
    import diffusers

    folder = model_copy(model, tmp_path)
    path = folder / "transformer" / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), key: value}))

    def never(*args, **kwargs):
        raise AssertionError("a transformer was built from the crafted config")

    monkeypatch.setattr(diffusers.SD3Transformer2DModel, "__init__", never)
    for build in (Session, memplan.plan_memory):
        with pytest.raises(ConfigError) as err:
            build(model_config(folder))
        assert err.value.key == "model.pretrained" and words in str(err.value)


def test_a_model_whose_weights_do_not_fit_is_refused_before_it_is_loaded(model, monkeypatch):
    """The memory planner counts the folder's transformer on the meta device before a run loads it: weights
    larger than the device's memory are refused ("does not fit"), the committed model fits."""
    from agg_bench.engine import models

    weights = 4 * json.loads((SCENE_MODEL / "pretrain.json").read_text())["parameters"]
    loaded = []
    monkeypatch.setattr(models, "load_pretrained", lambda *a, **k: loaded.append(1) or (_ for _ in ()).throw(
        AssertionError("the model was loaded")))
    monkeypatch.setattr(memplan, "gpu_memory_bytes", lambda device: weights - 1)
    with pytest.raises(ConfigError) as err:
        memplan.check_weights_fit(model_config(model))
    assert err.value.key == "model.pretrained" and "does not fit" in str(err.value)
    assert f"{weights // 4:,} parameters" in str(err.value)
    with pytest.raises(ConfigError, match="does not fit"):
        Session(model_config(model))
    assert not loaded
    monkeypatch.setattr(memplan, "gpu_memory_bytes", lambda device: 2 * weights)
    memplan.check_weights_fit(model_config(model))


# ----- agg-bench pretrain ---------------------------------------------------------------------------------
@pytest.mark.parametrize("sets, key, words", [
    (["num_layers=64", "num_attention_heads=16", "attention_head_dim=128"], "num_layers",
     "at most 100,000,000 parameters together"),
    (["seed=100000000000000000000000"], "seed", "an integer from 0 to 4294967295"),
    (["seed=4294967296"], "seed", "an integer from 0 to 4294967295"),
])
def test_pretrain_sizes_are_bounded_together_and_its_seed(tmp_path, capsys, monkeypatch, sets, key, words):
    """Each size within its own limit, together 9.6 billion parameters: they allocated until a RuntimeError at
    9.5 GB. Counted on the meta device before anything is allocated; the seed bounded as a run's."""
    from agg_bench.tools import pretrain as pretrain_module

    monkeypatch.setattr(pretrain_module, "build_transformer", lambda cfg: (_ for _ in ()).throw(
        AssertionError("a model was built")))
    with pytest.raises(ConfigError) as err:
        pretrain_module.load_pretrain_config(None, sets)
    assert err.value.key == key and words in str(err.value)
    out = tmp_path / "out"
    capsys.readouterr()
    line = one_line(capsys, main(["pretrain", *[a for s in sets for a in ("--set", s)], "--out", str(out)]))
    assert words in line and not out.exists()


def test_pretrain_memory_is_planned_before_anything_is_allocated():
    """Weights, gradients, AdamW's moments and the average (5 x 4 bytes per parameter) and one batch's saved
    activations, counted on fake tensors; more than the memory given is "does not fit", naming the sizes."""
    from agg_bench.tools.pretrain import PretrainConfig, check_size

    cfg = PretrainConfig(num_layers=1, batch_size=4)
    plan = check_size(cfg)
    with torch.device("meta"):
        from agg_bench.tools.pretrain import transformer_config
        from agg_bench.engine.families import FAMILY_SPECS

        count = sum(p.numel() for p in FAMILY_SPECS["sd3"].transformer_cls()(**transformer_config(cfg)).parameters())
    assert plan["parameters"] == count and plan["state"] >= 5 * 4 * count and plan["activations"] > 0
    assert check_size(cfg, memory=plan["total"]) == plan
    with pytest.raises(ConfigError, match="does not fit") as err:
        check_size(cfg, memory=plan["total"] - 1)
    assert err.value.key == "batch_size" and "num_layers=1" in str(err.value)
    assert check_size(PretrainConfig(num_layers=1, batch_size=8))["activations"] > plan["activations"]


