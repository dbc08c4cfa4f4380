"""Crafted inputs that a command reads: a model folder (``token_hash.json``, ``transformer/config.json``,
``vae/config.json``), the folder ``agg-bench pretrain`` would replace,
``agg-bench pretrain``'s sizes and seed, and the run folders ``agg-bench learning`` reads (config.json,
records, checkpoints, the manifest and its options). Each is refused with one line naming the file or key, exit
code 2, before anything is allocated or written; or works.

The model is the committed learning-testbed model (tests/data/sd3-scenes, 0.6 M parameters), copied; the
learning runs are one run of 2 iterations on it, copied and edited.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
from pathlib import Path

import pytest
import torch
import yaml

from agg_bench.cli import main
from agg_bench.config import load_config
from agg_bench.engine.scenes import all_scenes
from agg_bench.engine.text import file_sha256
from agg_bench.errors import ConfigError, UserError
from agg_bench.runtime import memplan
from agg_bench.runtime.train import Session, train
from agg_bench.tools.snapshot import DIGEST_KEY, TRANSFORMER_CONFIG, TRANSFORMER_CONFIG_KEY, WEIGHTS_KEY
from helpers import Holder, methods_checked_here

ROOT = Path(__file__).resolve().parents[2]
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
    """A run of the scene model ``folder``: the scene reward on the scene captions it was trained on."""
    return load_config(None, ["model.family=sd3", "model.preset=pretrained", f"model.pretrained={folder}",
                              "model.resolution=32", "sampling.steps=2", "grpo.group_size=2", "progress=false",
                              "reward.name=scene", f"prompts.file={ROOT / 'config' / 'prompts' / 'scenes.txt'}",
                              *overrides])


def one_line(capsys, code: int) -> str:
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and "Traceback" not in lines[0], lines
    return lines[0]


def folder_run(folder: Path, family: str, *overrides: str) -> list[str]:
    return [a for item in [f"model.family={family}", "model.preset=pretrained", f"model.pretrained={folder}",
                           "model.resolution=32", "sampling.steps=2", "grpo.group_size=2",
                           "grpo.prompts_per_iteration=1", "train.iterations=1", "progress=false",
                           "prompts.max_sequence_length=8", *overrides] for a in ("--set", item)]


def refused_before_the_run(capsys, run: list[str], out: Path, words: str, file: str = "",
                           key: str = "model.pretrained", readers=None) -> None:
    """The crafted model folder of ``run`` (its ``--set`` pairs) is refused as ``key``, in words holding ``words``
    and ``file``, by each of ``readers`` (default: the run's session and the memory planner), and by ``agg-bench
    run`` in one line before its folder ``out`` exists."""
    cfg = load_config(None, run[1::2])
    for build in readers or (Session, memplan.plan_memory):
        with pytest.raises(ConfigError) as err:
            build(cfg)
        assert err.value.key == key and words in str(err.value) and file in str(err.value)
    capsys.readouterr()
    assert words in one_line(capsys, main(["run", *run, "--out", str(out)])) and not out.exists()


# ----- a model folder -----------------------------------------------------------------------------------
@pytest.mark.parametrize("text, words", [
    ('{"max_tokens": -1, "seed": 0}', "max_tokens from 1 to 4096 (it has -1)"),
    ('{"max_tokens": Infinity, "seed": 0}', "is not JSON (Infinity is not a JSON number"),
    ('{"max_tokens": 6.9, "seed": 0}', "max_tokens from 1 to 4096 (it has 6.9)"),  # was truncated to 6
    ('{"max_tokens": 6, "seed": 100000000000000000000000}', "seed from 0 to 4294967295"),
    ('{"max_tokens": 6}', "seed from 0 to 4294967295 (it has None)"),
    ("[6, 0]", "holds a list, not a JSON object"),
    ('{"max_tokens": 6, "seed": 0, "pad": "' + "x" * 70_000 + '"}', "over the 64 KiB such a file may have"),
])
def test_a_crafted_token_hash_file_is_refused(model, tmp_path, capsys, text, words):
    """token_hash.json is read bounded (64 KiB: the 200 MB file was read whole) and its values are integers
    within bounds (-1 gave a traceback, Infinity an overflow, 6.9 was silently truncated; Infinity is no JSON)."""
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


@pytest.mark.parametrize("key, value, words", [
    ("num_layers", True, "num_layers = True: expected an integer from 1 to 256, not true or false"),
    ("num_attention_heads", False, "num_attention_heads = False: expected an integer from 1 to 16384"),
    ("dual_attention_layers", [True], "dual_attention_layers holds True: expected integers"),
])
def test_true_or_false_where_a_transformer_takes_an_integer_is_refused(model, tmp_path, capsys, key, value, words):
    """Python's bool is an int: num_layers: true built and trained a one-block model with exit 0. A flag where the
    transformer's class takes an integer is refused by the run, the memory planner and the command line."""
    folder = model_copy(model, tmp_path)
    path = folder / "transformer" / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), key: value}))
    refused_before_the_run(capsys, folder_run(folder, "sd3", "reward.name=scene"), tmp_path / "run", words)


def test_a_model_folder_missing_a_weight_is_refused_naming_it(model, tmp_path):
    """A weight the transformer's file lacks was left on the meta device by diffusers, and the model's first
    move to a device raised "Cannot copy out of meta tensor" (exit 1)."""
    from safetensors.torch import load_file, save_file

    from agg_bench.engine.models import load_pretrained

    folder = model_copy(model, tmp_path)
    weights = folder / "transformer" / "diffusion_pytorch_model.safetensors"
    tensors = load_file(str(weights))
    name = sorted(tensors)[0]
    save_file({k: v for k, v in tensors.items() if k != name}, str(weights))
    with pytest.raises(ConfigError, match=f"loadable transformer weights in .* \\(no weight {name}\\)"):
        load_pretrained("sd3", str(folder), torch.float32)


def test_a_patch_wider_than_the_sample_is_refused_in_one_line(model, tmp_path, capsys):
    """A patch_size over the sample's side (each size within its bound) made diffusers divide by zero while it
    built the positional embedding: a ZeroDivisionError traceback, exit 1, from the memory planner's check and
    from the loader."""
    from agg_bench.engine.models import load_pretrained

    folder = model_copy(model, tmp_path)
    path = folder / "transformer" / "config.json"
    config = json.loads(path.read_text())
    path.write_text(json.dumps({**config, "patch_size": config["sample_size"] + 1}))
    with pytest.raises(ConfigError, match="division by zero"):
        load_pretrained("sd3", str(folder), torch.float32)
    out = tmp_path / "run"
    line = one_line(capsys, main(["run", *[a for item in ["model.family=sd3", "model.preset=pretrained",
                                                          f"model.pretrained={folder}", "model.resolution=32",
                                                          "train.iterations=1", "progress=false"]
                                           for a in ("--set", item)], "--out", str(out)]))
    assert "model.pretrained" in line and "division by zero" in line and not out.exists()


@pytest.mark.parametrize("key, value, words", [
    ("scaling_factor", "x", "scaling_factor = 'x': expected a finite number > 0"),  # a TypeError mid-run
    ("scaling_factor", 0, "scaling_factor = 0: expected a finite number > 0"),  # infinite images, status ok
    ("scaling_factor", None, "scaling_factor = None"),
    ("shift_factor", [1], "shift_factor = [1]: expected a finite number"),
    ("factor", 3, "factor = 3: expected one of 1, 2, 4, 8, 16"),
    ("image_channels", 4, "image_channels = 4: expected 3"),
    ("colour", "red", "colour: a key it does not take"),
])
def test_a_pixel_decoder_config_it_cannot_take_is_refused_before_the_run(model, tmp_path, capsys, key, value,
                                                                           words):
    """vae/config.json of a pixel-space model: its normalisation divides and shifts every latent the run decodes;
    a value it cannot take is one line naming the folder, the key and the value, before the run folder is made."""
    folder = model_copy(model, tmp_path)
    path = folder / "vae" / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), key: value}))
    refused_before_the_run(capsys, folder_run(folder, "sd3", "reward.name=scene"), tmp_path / "run", words,
                           "vae/config.json")


def vae_folder(folders, family: str, tmp_path: Path, change: dict) -> Path:
    """A copy of the family's tiny diffusers folder (tests/tiny_pretrained.py) whose vae/config.json has ``change``."""
    folder = tmp_path / "model"
    shutil.copytree(folders(family), folder)
    path = folder / "vae" / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **change}))
    return folder




@pytest.mark.parametrize("family, change, words", [
    ("sd3", {"scaling_factor": 0}, "scaling_factor = 0: expected a finite number > 0"),  # infinite latents, exit 0
    ("sd3", {"scaling_factor": -1}, "scaling_factor = -1: expected a finite number > 0"),  # trained, exit 0
    ("sd3", {"scaling_factor": "x"}, "scaling_factor = 'x': expected a finite number > 0"),  # TypeError mid-run
    ("flux", {"shift_factor": "x"}, "shift_factor = 'x': expected a finite number"),
    ("sd3", {"scaling_factor": math.nan}, "NaN is not a JSON number"),
    ("sd3", {"latent_channels": True}, "latent_channels = True: expected an integer from 1 to 16384, not true"),
    ("sd3", {"latent_channels": 0}, "latent_channels = 0: expected an integer from 1 to 16384"),
    # 160 GB asked for while the model was built: status oom, exit 0, after the run folder was made
    ("sd3", {"latent_channels": 100_000}, "latent_channels = 100000: expected an integer from 1 to 16384"),
    ("sd3", {"block_out_channels": [8, True, 8, 8]}, "block_out_channels holds True: expected integers from 1"),
    ("sd3", {"block_out_channels": [8, 0, 8, 8]}, "block_out_channels holds 0: expected integers from 1 to 16384"),
    ("qwenimage", {"dim_mult": [1, 0, 1, 1]}, "dim_mult holds 0: expected integers from 1"),
    ("qwenimage", {"latents_std": [1.5, 2.0, 0.5, -1.0]}, "latents_std holds -1.0: expected finite numbers > 0"),
    ("qwenimage", {"latents_mean": None}, "latents_mean = None: expected a list of 4 finite numbers"),
    ("qwenimage", {"latents_mean": [0.0] * 3}, "latents_mean = [0.0, 0.0, 0.0]: expected a list of 4 finite"),
])
def test_a_vae_config_it_cannot_take_is_refused_before_the_run(folders, tmp_path, capsys, family, change, words):
    """vae/config.json of a diffusers model folder: its sizes are bounded as the transformer's, and its latent
    normalisation as the pixel decoder's (scaling_factor 0 decoded infinite images, -1 inverted ones, and the runs
    ended ok). One line naming the folder, the key and the value, from the run and the memory planner, before the
    run folder is made."""
    folder = vae_folder(folders, family, tmp_path, change)
    refused_before_the_run(capsys, folder_run(folder, family), tmp_path / "run", words, "vae/config.json")


def test_a_vae_whose_weights_do_not_fit_is_refused_before_it_is_loaded(folders, tmp_path, monkeypatch):
    """Channels within their bound can still add up to more than the device holds (16,384 a block: 350 GiB):
    the VAE's weights count with the transformer's before the folder is loaded; the tiny VAE fits."""
    from agg_bench.engine import models

    huge = vae_folder(folders, "sd3", tmp_path / "huge", {"block_out_channels": [16384] * 4})
    monkeypatch.setattr(models, "load_pretrained", lambda *a, **k: (_ for _ in ()).throw(
        AssertionError("the model was loaded")))
    monkeypatch.setattr(memplan, "gpu_memory_bytes", lambda device: 2 ** 36)  # 64 GiB
    for build in (memplan.check_weights_fit, Session):
        with pytest.raises(ConfigError) as err:
            build(load_config(None, folder_run(huge, "sd3")[1::2]))
        assert err.value.key == "model.pretrained" and "vae/config.json" in str(err.value)
        assert "does not fit" in str(err.value)
    memplan.check_weights_fit(load_config(None, folder_run(vae_folder(folders, "sd3", tmp_path / "tiny", {}),
                                                           "sd3")[1::2]))


@pytest.mark.parametrize("change, words", [
    ({"use_dynamic_shifting": True, "max_image_seq_len": 256}, "max_image_seq_len = 256: expected an integer "
                                                               "above base_image_seq_len (256)"),  # ZeroDivisionError
    ({"use_dynamic_shifting": True, "base_shift": "x"}, "base_shift = 'x': expected a finite number"),  # TypeError
    ({"shift_terminal": "x"}, "shift_terminal = 'x': expected null or a number in [0, 1)"),  # ValueError
    # a flow-matching shift is > 0: -1 gave a 2-step schedule that falls from 1 to 0, and the run trained on it
    ({"shift": -1}, "shift = -1: expected a finite number > 0"),
    ({"shift": 0}, "shift = 0: expected a finite number > 0"),
])
def test_a_scheduler_config_the_schedule_cannot_take_is_refused_in_one_line(model, tmp_path, capsys, change, words):
    """The model's own schedule (sampling.shift: null) is computed from scheduler/scheduler_config.json, which
    diffusers loads without checking these values: equal sequence lengths divided by zero, a string where a
    number goes raised a TypeError or ValueError (tracebacks, exit 1)."""
    folder = model_copy(model, tmp_path)
    path = folder / "scheduler" / "scheduler_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **change}))
    refused_before_the_run(capsys, folder_run(folder, "sd3", "reward.name=scene", "sampling.shift=null"),
                           tmp_path / "run", words, "scheduler_config.json", readers=[Session])


@pytest.mark.parametrize("change, words", [
    # a linear shift of mu < 0 at the run's 64 image tokens: the run trained on it, exit 0
    ({"time_shift_type": "linear", "base_shift": 0.1, "max_shift": 5},
     "time_shift_type 'linear', base_shift 0.1, max_shift 5, base_image_seq_len 256, max_image_seq_len 4096 give "
     "mu = -0.145"),
    ({"time_shift_type": "linear", "base_shift": 0, "max_shift": 0}, "base_shift 0, max_shift 0"),
    # exp(mu) past a float's range: an OverflowError traceback, exit 1
    ({"base_shift": 1000, "max_shift": 1000}, "time_shift_type 'exponential', base_shift 1000, max_shift 1000"),
    # exp(mu) that is 0 in a float: refused as a schedule that gives nan, naming no key of the folder
    ({"base_shift": -800, "max_shift": -800}, "exp(mu) = 0"),
    ({"base_shift": -1e308, "max_shift": 1e308}, "base_shift -1e+308, max_shift 1e+308"),
])
def test_a_dynamic_shift_that_is_no_shift_at_the_run_s_resolution_is_refused_in_one_line(model, tmp_path, capsys,
                                                                                           change, words):
    """With use_dynamic_shifting the shift is computed from the scheduler config at the run's image tokens (each
    value finite); one that is not a finite number > 0 there is refused naming the keys and their values."""
    folder = model_copy(model, tmp_path)
    path = folder / "scheduler" / "scheduler_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "use_dynamic_shifting": True,
                                "base_image_seq_len": 256, "max_image_seq_len": 4096, **change}))
    refused_before_the_run(capsys, folder_run(folder, "sd3", "reward.name=scene", "sampling.shift=null"),
                           tmp_path / "run", words, "scheduler_config.json gives a finite shift > 0 at 64 image tokens",
                           key="sampling.shift", readers=[Session])


def test_a_folder_s_shift_whose_schedule_starts_above_1_names_its_shift_and_the_steps(model, tmp_path, capsys):
    """diffusers' 2-step schedule of shift 0.67 starts at 1.0000001 in float32 (the SDEs take the root of 1 - s):
    refused, but the line said `sampling.shift = None: expected a shift whose 2-step schedule ... (this one gives
    1, 0.000449148, 0)`: no shift was given, and the first sigma read as 1. It names the folder's shift, the
    steps' key and the sigma as it is; a folder's shift of 1.5 runs."""
    folder = model_copy(model, tmp_path)
    path = folder / "scheduler" / "scheduler_config.json"
    config = json.loads(path.read_text())
    path.write_text(json.dumps({**config, "shift": 0.67}))
    words = ("a shift of the model's scheduler config (here 0.67) whose sampling.steps' 2-step schedule falls "
             "strictly from 1 to 0 in float32 (this one gives 1.0000001, ")
    refused_before_the_run(capsys, folder_run(folder, "sd3", "reward.name=scene", "sampling.shift=null"),
                           tmp_path / "run", words, key="sampling.shift", readers=[Session])
    path.write_text(json.dumps({**config, "shift": 1.5}))
    assert Session(model_config(folder, "sampling.shift=null")).sigmas[0] == 1


def test_a_dynamic_shift_is_the_folder_s_at_the_run_s_resolution(model, tmp_path):
    """A dynamic shift > 0 at the run's 64 image tokens (mu = 1.5 - 0.5 * 192 / 3840, exp or linear) is used."""
    from agg_bench.engine.sampler import flow_sigmas

    folder = model_copy(model, tmp_path)
    path = folder / "scheduler" / "scheduler_config.json"
    config = {**json.loads(path.read_text()), "use_dynamic_shifting": True, "base_shift": 1.5, "max_shift": 2.0,
              "base_image_seq_len": 256, "max_image_seq_len": 4096}
    mu = 1.5 + 0.5 * (64 - 256) / (4096 - 256)
    for kind, shift in (("exponential", math.exp(mu)), ("linear", mu)):
        path.write_text(json.dumps({**config, "time_shift_type": kind}))
        session = Session(model_config(folder, "sampling.shift=null"))
        assert torch.equal(session.sigmas, flow_sigmas(2, shift))


def test_a_model_folder_being_written_or_replaced_meanwhile_is_not_loaded(model, tmp_path, capsys, monkeypatch):
    """agg-bench pretrain replaces its --out whole, the earlier folder renamed aside and the new one in: a run that
    loaded the folder meanwhile read it from two models, or found none. A folder whose claim another process holds
    is one line naming it and the PID, before anything is loaded; one replaced while it was loaded, whole or a part
    renamed into it, is refused after; once the writer is done it loads."""
    from agg_bench.engine import models
    from agg_bench.outdir import Busy

    folder = model_copy(model, tmp_path)
    run = folder_run(folder, "sd3", "reward.name=scene")
    holder = Holder(folder, folder=True, lock_inside=False)  # pretrain's claim of its --out
    try:
        monkeypatch.setattr(models, "load_pretrained", lambda *a: pytest.fail("loaded while it was written"))
        with pytest.raises(Busy, match=f"^model.pretrained {folder}: another agg-bench process \\(PID "
                                       f"{holder.proc.pid}\\) is writing it"):
            Session(model_config(folder))
        assert "is writing it" in one_line(capsys, main(["run", *run, "--out", str(tmp_path / "run")]))
        assert not (tmp_path / "run").exists()
    finally:
        holder.close()
    monkeypatch.undo()
    real = models.load_pretrained

    def replaced_meanwhile(family, pretrained, dtype):
        parts = real(family, pretrained, dtype)
        os.replace(folder, tmp_path / "aside")
        shutil.copytree(tmp_path / "aside", folder)
        return parts

    def part_replaced_meanwhile(family, pretrained, dtype):
        # a new transformer/ renamed into the folder: the folder keeps its inode, and the model loaded was the old one
        parts = real(family, pretrained, dtype)
        shutil.copytree(folder / "transformer", tmp_path / "transformer")
        os.replace(folder / "transformer", tmp_path / "old")
        os.replace(tmp_path / "transformer", folder / "transformer")
        return parts

    for replace in (replaced_meanwhile, part_replaced_meanwhile):
        monkeypatch.setattr(models, "load_pretrained", replace)
        with pytest.raises(UserError, match="replaced by another process while it was loaded"):
            Session(model_config(folder))
        monkeypatch.undo()
    assert Session(model_config(folder)).policy is not None


def test_a_model_folder_replaced_after_its_weights_before_its_conditioning_is_refused(model, tmp_path, monkeypatch):
    """The folder's identity was checked around the transformer's loading only: its token-hash settings (or text
    encoders) were read after, so a folder replaced in between conditioned one model's transformer with another's
    settings, silently; and a cell job kept its model for a later run of a folder replaced since."""
    from agg_bench.runtime import session as session_module
    from agg_bench.runtime.model_reuse import build_key

    folder = model_copy(model, tmp_path)
    cfg = model_config(folder)
    key = build_key(cfg, torch.device("cpu"))
    real = session_module.prompt_set

    def replaced_meanwhile(file):  # read between the weights and the conditioning
        os.replace(folder, tmp_path / "aside")
        shutil.copytree(tmp_path / "aside", folder)
        settings = folder / "token_hash.json"
        settings.write_text(json.dumps({**json.loads(settings.read_text()), "seed": 1}))
        return real(file)

    monkeypatch.setattr(session_module, "prompt_set", replaced_meanwhile)
    with pytest.raises(UserError, match=f"^model.pretrained {folder}: replaced by another process while it was "
                                        "loaded"):
        Session(cfg)
    assert build_key(cfg, torch.device("cpu")) != key


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
    (["seed=100000000000000000000000"], "seed", "seed = 100000000000000000000000: expected an integer from 0 to 4,294,967,295"),
    (["seed=4294967296"], "seed", "seed = 4294967296: expected an integer from 0 to 4,294,967,295"),
    (["seed=-1"], "seed", "seed = -1: expected an integer from 0 to 4,294,967,295"),
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


@pytest.mark.parametrize("text", ["{}", '{"format": "someone-else/2", "lr": 0.1}', "[]", "lr: 0.1\n", ""])
def test_pretrain_leaves_a_folder_whose_pretrain_json_is_someone_else_s(tmp_path, capsys, text):
    """pretrain.json is a common name: a folder holding one of another tool's (alone, or beside a samples.png)
    was replaced whole, the file lost; only a pretrain.json of this command's format marks a folder it made."""
    out = tmp_path / "mine"
    out.mkdir()
    (out / "pretrain.json").write_text(text)
    (out / "samples.png").write_bytes(b"mine")
    capsys.readouterr()
    line = one_line(capsys, main(["pretrain", "--set", "steps=1", "--out", str(out)]))
    assert "not an agg-bench pretrain output" in line and "agg-bench-pretrain/1" in line
    assert sorted(p.name for p in out.iterdir()) == ["pretrain.json", "samples.png"]
    assert (out / "pretrain.json").read_text() == text and (out / "samples.png").read_bytes() == b"mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine"]


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


def test_pretrain_memory_is_counted_once_per_sizes_and_compared_with_each_budget(monkeypatch):
    """A campaign or sweep reads its pretrain entries at each start: the count on fake tensors (about a
    CPU-second) is made once per process for the same sizes, in a bounded cache (functools.lru_cache), while
    each check compares it with the memory it is given."""
    from agg_bench.runtime import memplan
    from agg_bench.tools import pretrain

    counts = []
    real = memplan.training_bytes
    monkeypatch.setattr(memplan, "training_bytes", lambda *args: counts.append(args[3:6]) or real(*args))
    pretrain._counts.cache_clear()
    cfg = pretrain.PretrainConfig(num_layers=1, batch_size=4)
    plan = pretrain.check_size(cfg)
    assert pretrain.check_size(pretrain.PretrainConfig(num_layers=1, batch_size=4, seed=7)) == plan  # seed: no size
    with pytest.raises(ConfigError, match="does not fit"):
        pretrain.check_size(cfg, memory=plan["total"] - 1)
    pretrain.check_size(pretrain.PretrainConfig(num_layers=1, batch_size=8))
    assert counts == [(32, 4, 6), (32, 8, 6)], counts
    assert pretrain._counts.cache_info().maxsize == 16
    pretrain._counts.cache_clear()


# ----- agg-bench learning: the run folders it reads --------------------------------------------------------
@pytest.fixture(scope="module")
def trained(model, tmp_path_factory) -> tuple[Path, Path]:
    """A run of 2 iterations from the scene model with its final checkpoint, and its prompts file."""
    root = tmp_path_factory.mktemp("learning")
    prompts = root / "p.txt"
    prompts.write_text("\n".join(s.caption for s in all_scenes()[:2]) + "\n")
    cfg = model_config(model, f"prompts.file={prompts}", "grpo.prompts_per_iteration=1", "train.iterations=2",
                       "train.checkpoint_every=2", "train.lr=1e-2")
    assert train(cfg, root / "run")["status"] == "ok"
    return root / "run", prompts


def learning_runs(trained, tmp_path: Path, n: int = 2) -> tuple[Path, list[Path]]:
    """``n`` copies of the trained run as seeds of ``full`` in a manifest; (the manifest, the run folders)."""
    runs = []
    for seed in range(n):
        runs.append(tmp_path / f"full{seed}")
        shutil.copytree(trained[0], runs[-1])
        if seed:  # each copy the seed its entry names, in every file that names it (the reader compares them)
            metrics, summary, config = (runs[-1] / name for name in ("metrics.jsonl", "summary.json", "config.json"))
            metrics.write_text("".join(json.dumps({**json.loads(line), "seed": seed}) + "\n"
                                       for line in metrics.read_text().splitlines()))
            for path in (summary, config):
                path.write_text(json.dumps({**json.loads(path.read_text()), "seed": seed}))
    manifest = tmp_path / "manifest.json"
    entries = [{"dir": str(r), "method": "full", "seed": i} for i, r in enumerate(runs)]
    manifest.write_text(json.dumps({"runs": entries}))
    return manifest, runs


def learning_fails(capsys, tmp_path: Path, manifest: Path, *options: str) -> str:
    """``agg-bench learning`` with tables and plots: one line, exit 2, neither folder written."""
    tables, plots = tmp_path / "tables", tmp_path / "plots"
    capsys.readouterr()
    defaults = [a for flag, value in (("--average", "1"), ("--eval-noises", "1")) if flag not in options
                for a in (flag, value)]  # a flag given twice is refused
    line = one_line(capsys, main(["learning", "--manifest", str(manifest), "--tables", str(tables), "--plots",
                                  str(plots), *defaults, *options]))
    assert not tables.exists() and not plots.exists()
    return line


def edit_config(run: Path, change) -> None:
    config = json.loads((run / "config.json").read_text())
    change(config)
    (run / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("case, words", [
    ("steps", "config.json: config error: sampling.steps = 10000000: expected an integer from 1 to 1000"),  # hung
    ("not json", "config.json: is not JSON"),  # a JSONDecodeError traceback
    ("a list", "config.json: holds a list, not a JSON object"),  # the defaults, then a size mismatch
    ("no model", "trains model.preset = 'tiny'"),  # the defaults: another model than the first run's
    ("another model", "trains model.pretrained"),  # two pre-trained models in one manifest
    ("no file", "no config.json"),
])
def test_learning_reads_config_json_through_the_typed_config(trained, tmp_path, capsys, case, words):
    manifest, runs = learning_runs(trained, tmp_path)
    run = runs[1]
    if case == "steps":
        edit_config(runs[0], lambda c: c["sampling"].update(steps=10_000_000))
        run = runs[0]
    elif case == "not json":
        (run / "config.json").write_text("{not json")
    elif case == "a list":
        (run / "config.json").write_text("[1, 2]")
    elif case == "no model":
        edit_config(run, lambda c: c.pop("model"))
    elif case == "another model":
        edit_config(run, lambda c: c["model"].update(pretrained=str(tmp_path / "elsewhere")))
    else:
        (run / "config.json").unlink()
    line = learning_fails(capsys, tmp_path, manifest)
    assert words in line and str(run) in line, line


@pytest.mark.parametrize("change, words", [
    (lambda r: r.pop("status"), "record 1: no 'status'"),
    (lambda r: r.pop("iteration"), "record 1: no 'iteration'"),
    (lambda r: r.pop("reward_mean"), "record 1: no 'reward_mean' (an ok record has one)"),
    (lambda r: r.update(reward_mean=float("nan")), "line 1 is not valid JSON (NaN is not a JSON number"),
    (lambda r: r.update(iteration=1), "record 2: 'iteration' = 1: expected each iteration once"),
])
def test_learning_reads_records_through_the_record_contract(trained, tmp_path, capsys, change, words):
    """Records missing a key learning needs, or with a NaN reward (a run writes null), gave KeyError tracebacks."""
    manifest, runs = learning_runs(trained, tmp_path, 1)
    path = runs[0] / "metrics.jsonl"
    records = [json.loads(line) for line in path.read_text().splitlines()]
    change(records[0])
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    assert words in learning_fails(capsys, tmp_path, manifest)


@pytest.mark.parametrize("where, text, words", [
    ("metrics.jsonl", "[" * 100_000 + "]" * 100_000, "line 1 is not valid JSON (nested too deeply)"),
    ("metrics.jsonl", '{"iteration": ' + "9" * 5000 + "}", "line 1 is not valid JSON (Exceeds the limit (4300 digits)"),
    ("metrics.jsonl", '{"iteration": 0, "loss": Infinity}', "line 1 is not valid JSON (Infinity is not a JSON number"),
    ("manifest", '{"runs": [], "note": ' + "9" * 5000 + "}", "is not JSON (Exceeds the limit (4300 digits)"),
    ("manifest", "[" * 100_000 + "]" * 100_000, "is not JSON (nested too deeply)"),
    # an integer JSON reads but a float cannot hold: math.isfinite overflowed (exit 1)
    ("metrics.jsonl", '{"iteration": 0, "status": "ok", "reward_mean": 1' + "0" * 400 + "}",
     "'reward_mean' = 1000"),
    # which of two values counts was up to the reader (the last one did): refused
    ("manifest", '{"runs": [], "runs": []}', "is not JSON (the key 'runs' is given twice in one object"),
    ("metrics.jsonl", '{"iteration": 0, "status": "ok", "reward_mean": 0.1, "reward_mean": 99.0}',
     "line 1 is not valid JSON (the key 'reward_mean' is given twice"),
])
def test_learning_refuses_json_no_reader_can_take_in_one_line(trained, tmp_path, capsys, where, text, words):
    """A deeply nested line, a 5,000-digit integer or an infinity ended in a RecursionError or ValueError
    traceback (exit 1): every JSON file and line agg-bench reads goes through one parser that says why."""
    manifest, runs = learning_runs(trained, tmp_path, 1)
    if where == "manifest":
        manifest.write_text(text)
    else:
        lines = (runs[0] / where).read_text().splitlines()
        (runs[0] / where).write_text("\n".join([text, *lines[1:]]) + "\n")
    assert words in learning_fails(capsys, tmp_path, manifest)


@pytest.mark.parametrize("case, words", [
    ("wrong shape", "has shape (3,)"),
    ("integer", "torch.int64 tensor; expected floating-point parameters"),
    ("empty", "parameters: expected the trainable parameters"),  # was scored as the starting weights
    ("half", "parameters missing"),  # was scored with half the starting weights, silently
    ("negative iteration", "iteration = -5"),
    # what a run resumed with train.checkpoint_every 0 left: the checkpoint it resumed from, scored as its end
    ("earlier iteration", "holds iteration 0, not the run's last good iteration 1"),
])
def test_learning_reads_checkpoints_through_the_one_validator(trained, tmp_path, capsys, case, words):
    """The checkpoint evaluation loads every trainable parameter strictly (strict=False scored an empty or
    half-filled checkpoint as the starting weights: eval_gain exactly 0.0), and its error names the run."""
    manifest, runs = learning_runs(trained, tmp_path)
    path = runs[1] / "checkpoint.pt"
    state = torch.load(path, weights_only=True)
    params = state["parameters"]
    first = next(iter(params))
    if case == "wrong shape":
        params[first] = torch.zeros(3)
    elif case == "integer":
        params[first] = params[first].long()
    elif case == "empty":
        state["parameters"] = {}
    elif case == "half":
        state["parameters"] = dict(list(params.items())[::2])
    elif case == "earlier iteration":
        state["iteration"], state["records"] = 0, state["records"][:1]
    else:
        state["iteration"] = -5
    torch.save(state, path)
    line = learning_fails(capsys, tmp_path, manifest, "--eval-source", "checkpoint")
    assert words in line and "run full/1" in line and str(path) in line, line


@pytest.mark.parametrize("options, words", [
    (["--eval-seed", "100000000000000000000000"], "config error: --eval-seed = 100000000000000000000000: expected an "
                                                  "integer from 0 to 4294967295"),
    (["--eval-seed", "4294967296"], "expected an integer from 0 to 4294967295"),
    (["--eval-seed", "-1"], "expected an integer from 0 to 4294967295"),
    (["--reference", "nosuch"], "config error: --reference = 'nosuch': expected a method label of the manifest "
                                "('full')"),
    (["--reference", "x" * 300], "expected a method label of the manifest"),
])
def test_learning_options_are_bounded(trained, tmp_path, capsys, options, words):
    manifest, _ = learning_runs(trained, tmp_path, 1)
    assert words in learning_fails(capsys, tmp_path, manifest, *options)


def test_learning_refuses_a_run_listed_twice(trained, tmp_path, capsys):
    """Duplicate entries counted as two seeds: the same folder twice, or one method and seed twice."""
    manifest, runs = learning_runs(trained, tmp_path)
    entries = json.loads(manifest.read_text())["runs"]
    manifest.write_text(json.dumps({"runs": [entries[0], {**entries[0], "seed": 5}]}))
    line = learning_fails(capsys, tmp_path, manifest)
    assert "runs[1]: dir" in line and "is also runs[0]'s" in line
    manifest.write_text(json.dumps({"runs": [entries[0], {**entries[1], "seed": 0}]}))
    assert "method 'full' seed 0 is also runs[0]'s" in learning_fails(capsys, tmp_path, manifest)


@pytest.mark.parametrize("change, words", [
    (lambda m: m["runs"][1].update(method=""), "runs[1].method = '': expected a label of 1 to 200 printable"),
    (lambda m: m["runs"][1].update(method="full\nx"), "runs[1].method = 'full\\nx': expected a label of 1 to 200"),
    (lambda m: m["runs"][0].update(method="x" * 201), "(201 characters): expected a label of 1 to 200"),
    (lambda m: m["runs"][1].update(bogus=1), "runs[1]: unknown key 'bogus'; expected some of dir, method, model"),
    (lambda m: m.update(bogus=1), "unknown key 'bogus'; expected some of runs, gradcheck, calibration, warmup"),
])
def test_learning_reads_the_manifest_by_the_report_s_schema(trained, tmp_path, capsys, change, words):
    """An empty or multi-line method label made a blank row or one split in two in learning.md, and keys
    the manifest does not have were ignored: the manifest is the report's (the workflow writes one for both)."""
    manifest, _ = learning_runs(trained, tmp_path)
    data = json.loads(manifest.read_text())
    change(data)
    manifest.write_text(json.dumps(data))
    line = learning_fails(capsys, tmp_path, manifest)
    assert f"manifest {manifest}: " in line and words in line, line


@pytest.mark.parametrize("name", ["learning.yaml", "learning_gpu.yaml", "config.yaml"])
def test_the_workflow_s_manifest_passes_the_learning_manifest_check(tmp_path, monkeypatch, name):
    """The manifest the workflow writes (Sweep.manifest: results/learning/manifest.json) holds only keys the
    check allows and method labels it takes."""
    from agg_bench.tools.learning import check_manifest
    from agg_bench.tools.sweep import Sweep

    monkeypatch.chdir(ROOT)
    methods_checked_here(monkeypatch)  # what is checked here is the manifest, not the child process of the check
    sweep = Sweep(yaml.safe_load((ROOT / "config" / name).read_text()), ROOT / "workflow" / "schemas" /
                  "config.schema.yaml", cache_dir=None)
    manifest = tmp_path / "manifest.json"
    manifest.write_text(json.dumps(sweep.manifest()))
    check_manifest(manifest)
    assert len(json.loads(manifest.read_text())["runs"]) >= len(sweep.runs) > 0


def test_learning_names_a_run_too_short_for_the_table(trained, tmp_path, capsys):
    """"a run of 2 iterations: the learning table needs at least 4" did not say which run; it is now found
    before the evaluation samples a model."""
    manifest, runs = learning_runs(trained, tmp_path)
    line = learning_fails(capsys, tmp_path, manifest, "--average", "2")
    assert f"run full/0 ({runs[0]}): 2 iterations with status ok; the learning table needs at least 4 " \
           "(--average 2 at each end)" in line, line


def test_learning_checks_the_captions_before_writing_anything(trained, tmp_path, capsys):
    """With --plots the sample grid scores the images with the scene reward: a sweep whose captions are not
    scene captions exited 2 only after learning.csv, learning.md, curves.csv and 5 PNGs were written. The
    caption is quoted in at most 200 characters (a prompts file such as /etc/passwd had its first line
    printed)."""
    manifest, runs = learning_runs(trained, tmp_path, 1)
    prompts = tmp_path / "not-scenes.txt"
    prompts.write_text("root:" + "x" * 5000 + "\nsecond line\n")
    edit_config(runs[0], lambda c: (c["prompts"].update(file=str(prompts)),
                                    c["reward"].update(name="jpeg_compressibility")))
    line = learning_fails(capsys, tmp_path, manifest)
    assert "caption 1 'root:xxx" in line and "(5005 characters) is not a scene caption" in line
    assert "samples.png" in line and "x" * 201 not in line
    # the run's own reward is the scene reward: every caption is checked, before the model is loaded
    edit_config(runs[0], lambda c: c["reward"].update(name="scene"))
    prompts.write_text("two red circles on the left\nsecond line\n")
    line = learning_fails(capsys, tmp_path, manifest)
    assert "caption 2 'second line' is not a scene caption" in line and "reward 'scene'" in line


# ----- agg-bench replay: a snapshot folder --------------------------------------------------------------
WEIGHTS = "transformer/diffusion_pytorch_model.safetensors"


@pytest.fixture(scope="module")
def snapshot(tmp_path_factory) -> Path:
    snap = tmp_path_factory.mktemp("snapshot") / "snap"
    settings = ["model.resolution=32", "sampling.steps=3", "grpo.group_size=2", "grpo.prompts_per_iteration=1",
                "progress=false", "telemetry.enabled=false"]
    assert main(["snapshot", *[a for s in settings for a in ("--set", s)], "--out", str(snap)]) == 0
    return snap


def refused_by_replay_and_gradcheck(snap: Path, tmp_path: Path, capsys) -> list[str]:
    """The one line each of `replay` and `gradcheck` prints for the snapshot ``snap`` (exit code 2), after
    checking that neither wrote anything."""
    lines = []
    for verb, out in (("replay", tmp_path / "replayed" / "g.safetensors"), ("gradcheck", tmp_path / "checked" / "g.csv")):
        args = ["replay", str(snap), "--method", "full"] if verb == "replay" else \
            ["gradcheck", "--snapshot", str(snap), "--windows", "3", "--alphas", "sigma", "--route-fracs", "1"]
        capsys.readouterr()
        lines.append(one_line(capsys, main([*args, "--out", str(out)])))
        assert not out.parent.exists(), lines[-1]
    return lines


def without_key(key: str):
    """rollout.json as a snapshot older than its ``key`` wrote it."""
    return lambda c: {k: v for k, v in c.items() if k != key}


def edit_json(snap: Path, name: str, change) -> None:
    """Rewrite the snapshot file ``name`` with ``change`` of its JSON; the transformer's config with the digest
    rollout.json records of it rewritten too (a crafted pair: the checks behind the digest are what is tested)."""
    data = json.loads((snap / name).read_text())
    changed = change(data)
    (snap / name).write_text(json.dumps(changed if changed is not None else data))
    if name == TRANSFORMER_CONFIG:
        edit_json(snap, "rollout.json", lambda c: c.update({TRANSFORMER_CONFIG_KEY: file_sha256(snap / name)}))


@pytest.mark.parametrize("given, words", [("nope", "no such folder"), ("snap.json", "not a folder")])
def test_replay_of_a_path_that_is_no_folder_says_so(tmp_path, capsys, given, words):
    """`replay nope` and `replay SNAP/config.json` said `missing transformer`, as if the folder were a snapshot
    short of a file."""
    (tmp_path / "snap.json").write_text("{}")
    out = tmp_path / "g.safetensors"
    assert main(["replay", str(tmp_path / given), "--method", "agg", "--out", str(out)]) == 2
    line, = capsys.readouterr().err.strip().splitlines()
    assert f"snapshot {tmp_path / given}: {words}; expected the folder `agg-bench snapshot --out` wrote" in line, line
    assert not out.exists()


@pytest.mark.parametrize("name, change, words", [
    ("config.json", lambda c: c["sampling"].update(steps=10_000_000), "config.json: config error: sampling.steps"),
    ("config.json", lambda c: [1], "config.json: holds a list"),
    # edited after the snapshot: AGG's W <= N was checked against steps the rollout does not have (W = 4 on 3)
    ("config.json", lambda c: c["sampling"].update(steps=4), "config.json: sampling.steps = 4: expected 3, the steps "
                                                             "of the rollout"),
    ("config.json", lambda c: c["grpo"].update(group_size=4), "config.json: grpo.prompts_per_iteration x "
                                                              "grpo.group_size = 1 x 4: expected 2 samples"),
    ("rollout.json", lambda c: c.update(family="nosuch"), "rollout.json: family = 'nosuch': expected one of"),
    ("rollout.json", lambda c: c.update(eta="x"), "rollout.json: eta = 'x': expected a number"),
    ("rollout.json", lambda c: c.update(clip_range=-1), "rollout.json: clip_range = -1: expected a number > 0"),
    ("rollout.json", lambda c: c.update(resolution=10**30), "rollout.json: resolution = 1000000000000000000000000000000: "
                                                            "expected an integer from 1 to 4096"),
    ("rollout.json", lambda c: c.update(resolution=64), "rollout.json: resolution = 64: expected 32, as the snapshot's "
                                                        "config.json model.resolution"),
    ("rollout.json", lambda c: c.update(family="flux"), "rollout.json: family = 'flux': expected 'sd3'"),
    ("rollout.json", lambda c: c.update(lora={"rank": 2}), "rollout.json: lora = {'rank': 2}: expected null or"),
    ("rollout.json", lambda c: c.update(vae_scale_factor=0), "rollout.json: vae_scale_factor = 0: expected an integer"),
    ("rollout.json", lambda c: c.update(rollout_sha256="abc"), "rollout.json: rollout_sha256 = 'abc': expected the "
                                                               "SHA-256 of rollout.safetensors"),
    ("rollout.json", lambda c: c.update(transformer_config_sha256=1), "rollout.json: transformer_config_sha256 = 1: "
                                                                      "expected the SHA-256 of transformer/config.json"),
    ("rollout.json", lambda c: c.update(weights_sha256=["abc"]), "rollout.json: weights_sha256 = ['abc']: expected an "
                                                                 "object of the snapshot's weight files"),
    # a name outside the snapshot's weight files would have any file hashed and taken for one of them
    ("rollout.json", lambda c: c["weights_sha256"].update({"../config.json": "0" * 64}),
     "rollout.json: weights_sha256 '../config.json' = '0000000000000000000000000000000000000000000000000000000000000000': "
     "expected a weight file of the snapshot"),
    ("rollout.json", lambda c: c["weights_sha256"].update({"transformer/diffusion_pytorch_model.safetensors": "ABC"}),
     "rollout.json: weights_sha256 'transformer/diffusion_pytorch_model.safetensors' = 'ABC': expected a weight file"),
    ("transformer/config.json", lambda c: c.update(num_layers=100_000), "num_layers = 100000: expected an integer"),
    # each size within its bound, together 10^20 parameters: a RuntimeError of the allocator, exit 1
    ("transformer/config.json", lambda c: c.update(num_layers=256, num_attention_heads=16384, attention_head_dim=16384,
                                                   joint_attention_dim=16384, caption_projection_dim=16384),
     "expected a model whose weights fit: its transformer/config.json describes"),
    # a position table larger than the weight files: computed in full before the files were read
    ("transformer/config.json", lambda c: c.update(pos_embed_max_size=1024),
     "transformer/config.json: describes a transformer whose buffers hold"),
])
def test_replay_reads_a_snapshot_through_the_same_checks(snapshot, tmp_path, capsys, name, change, words):
    """The snapshot's config.json through the typed config with its bounds, its rollout.json's settings through
    the same (and equal to config.json's: a clip_range of -1 or a resolution of 64 at 32 replayed with rc 0) and
    its transformer's sizes: one line, exit 2, nothing written, by replay and by gradcheck (a crafted file gave
    a KeyError or TypeError, and "family": "flux" a diffusers ValueError)."""
    snap = tmp_path / "snap"
    shutil.copytree(snapshot, snap)
    edit_json(snap, name, change)
    for line in refused_by_replay_and_gradcheck(snap, tmp_path, capsys):
        assert words in line, line


GUIDANCE_NOT_EMBEDDED = ("guidance = 3.5: expected 1.0, the default: this sd3 model's transformer embeds no "
                         "guidance value")


@pytest.mark.parametrize("config, rollout, words", [
    (lambda c: c["model"].update(guidance=3.5), lambda c: c.update(guidance=3.5), f"rollout.json: {GUIDANCE_NOT_EMBEDDED}"),
    (None, lambda c: c.update(guidance=3.5), f"rollout.json: {GUIDANCE_NOT_EMBEDDED}"),  # a snapshot without config.json
    # a rollout.json older than the key: the value is config.json's
    (lambda c: c["model"].update(guidance=3.5), without_key("guidance"), f"config.json: model.{GUIDANCE_NOT_EMBEDDED}"),
], ids=["both", "rollout.json alone", "config.json"])
def test_a_guidance_value_the_snapshots_transformer_does_not_embed_is_refused_naming_its_file(
        snapshot, tmp_path, capsys, config, rollout, words):
    """A rollout.json edited by hand to give a guidance value to a transformer without the guidance embedding (the
    tiny SD3's) was refused in the run config's words, `config error: model.guidance = 3.5`, naming no file: the
    line names the file that gives it and its key, as the other rollout.json refusals do, before a weight is
    loaded."""
    snap = tmp_path / "snap"
    shutil.copytree(snapshot, snap)
    if config is None:
        (snap / "config.json").unlink()
    else:
        edit_json(snap, "config.json", config)
    edit_json(snap, "rollout.json", rollout)
    for line in refused_by_replay_and_gradcheck(snap, tmp_path, capsys):
        assert f"{snap / words.split(': ', 1)[0]}: {words.split(': ', 1)[1]}" in line, line


def test_a_snapshot_names_no_code_to_load(snapshot, tmp_path, capsys, monkeypatch):
    """A snapshot's config.json naming its method by a dotted path package.module:Class: reading the snapshot built
    that method, so replay and gradcheck imported the module (its code ran) before refusing it; and `snapshot` of a
    config with such a method wrote a snapshot they would not read."""
    imported = tmp_path / "imported"
    (tmp_path / "own_method.py").write_text(f"import pathlib\npathlib.Path({str(imported)!r}).write_text('ran')\n"
                                            "from agg_bench.methods.base import METHODS\nEst = METHODS.resolve('full')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    snap = tmp_path / "snap"
    shutil.copytree(snapshot, snap)
    edit_json(snap, "config.json", lambda c: c.update(method={"name": "own_method:Est"}))
    for line in refused_by_replay_and_gradcheck(snap, tmp_path, capsys):
        assert "config.json: method.name = 'own_method:Est': expected a registered method" in line, line
        assert "names no code to load" in line, line
    assert not imported.exists()
    # the user's own config may name it (imported as the user asked), but no snapshot of it is written
    out = tmp_path / "made"
    line = one_line(capsys, main(["snapshot", "--set", "method.name=own_method:Est", "--set", "progress=false",
                                  "--out", str(out)]))
    assert "config error: method.name = 'own_method:Est': expected a registered method" in line, line
    assert imported.exists() and not out.exists()


def test_replay_refuses_the_rollout_or_weights_of_another_snapshot(snapshot, tmp_path, capsys):
    """The rollout.safetensors or the transformer weights of another snapshot (another seed, the same shapes) in
    place of the snapshot's own pass every check of their tensors: replay and gradcheck computed the gradients of a
    rollout the snapshot's config.json does not describe, or of a model the rollout was not sampled from, with
    exit 0. A snapshot written before the digests were recorded reads as before."""
    from agg_bench.tools.snapshot import load_snapshot

    other = tmp_path / "other"
    settings = ["model.resolution=32", "sampling.steps=3", "grpo.group_size=2", "grpo.prompts_per_iteration=1",
                "progress=false", "telemetry.enabled=false", "seed=1"]
    assert main(["snapshot", *[a for s in settings for a in ("--set", s)], "--out", str(other)]) == 0
    assert (other / "rollout.safetensors").read_bytes() != (snapshot / "rollout.safetensors").read_bytes()
    snap = tmp_path / "snap"
    shutil.copytree(snapshot, snap)
    shutil.copyfile(other / "rollout.safetensors", snap / "rollout.safetensors")
    for line in refused_by_replay_and_gradcheck(snap, tmp_path, capsys):
        assert f"{snap / 'rollout.safetensors'}: not the rollout this snapshot recorded" in line, line
    edit_json(snap, "rollout.json", without_key(DIGEST_KEY))  # an older snapshot
    assert load_snapshot(snap).meta[DIGEST_KEY] is None

    swapped = tmp_path / "swapped"
    shutil.copytree(snapshot, swapped)
    assert (other / WEIGHTS).read_bytes() != (snapshot / WEIGHTS).read_bytes()
    shutil.copyfile(other / WEIGHTS, swapped / WEIGHTS)
    for line in refused_by_replay_and_gradcheck(swapped, tmp_path, capsys):
        assert (f"{swapped / WEIGHTS}: not the weight file this snapshot recorded: its SHA-256 is "
                f"{file_sha256(other / WEIGHTS)[:16]}..., {swapped / 'rollout.json'} records {WEIGHTS_KEY} "
                f"'{WEIGHTS}' {file_sha256(snapshot / WEIGHTS)[:16]}...") in line, line
    edit_json(swapped, "rollout.json", without_key(WEIGHTS_KEY))  # an older snapshot
    assert load_snapshot(swapped).meta[WEIGHTS_KEY] is None


def test_replay_refuses_a_transformer_config_the_snapshot_did_not_record(snapshot, tmp_path, capsys):
    """The transformer's config.json decides the model the weights load into: one of the same shapes with another
    sample_size (SD3's position-embedding grid, other values in a buffer of the same shape) loaded the snapshot's
    weights into another model, and replay and gradcheck computed its gradients with exit 0. It is refused before
    it is read; a snapshot written before its digest was recorded reads as before."""
    from agg_bench.tools.snapshot import load_snapshot

    snap = tmp_path / "snap"
    shutil.copytree(snapshot, snap)
    recorded = file_sha256(snap / TRANSFORMER_CONFIG)
    assert json.loads((snap / "rollout.json").read_text())[TRANSFORMER_CONFIG_KEY] == recorded
    config = json.loads((snap / TRANSFORMER_CONFIG).read_text())
    (snap / TRANSFORMER_CONFIG).write_text(json.dumps({**config, "sample_size": 2 * config["sample_size"]}))  # no digest rewritten
    for line in refused_by_replay_and_gradcheck(snap, tmp_path, capsys):
        assert (f"{snap / TRANSFORMER_CONFIG}: not the transformer config this snapshot recorded: its SHA-256 is "
                f"{file_sha256(snap / TRANSFORMER_CONFIG)[:16]}..., {snap / 'rollout.json'} records "
                f"{TRANSFORMER_CONFIG_KEY} {recorded[:16]}...") in line, line
    edit_json(snap, "rollout.json", without_key(TRANSFORMER_CONFIG_KEY))  # an older snapshot
    assert load_snapshot(snap).meta[TRANSFORMER_CONFIG_KEY] is None


def test_a_sharded_snapshot_s_every_shard_and_its_index_are_recorded_and_checked(snapshot, tmp_path):
    """A large transformer is saved in shards with an index naming them: each shard and the index are recorded as
    the single file is, and a shard of other weights or a missing index is refused before anything is loaded."""
    from agg_bench.engine.models import TRANSFORMER_CLASSES
    from agg_bench.tools.snapshot import load_snapshot, weight_digests

    snap = tmp_path / "snap"
    shutil.copytree(snapshot, snap)
    transformer = TRANSFORMER_CLASSES["sd3"].from_pretrained(snap / "transformer")
    os.remove(snap / WEIGHTS)
    transformer.save_pretrained(snap / "transformer", max_shard_size="1MB")
    recorded = weight_digests(snap)
    index = f"{WEIGHTS}.index.json"
    shards = sorted(rel for rel in recorded if rel != index)
    assert index in recorded and len(shards) > 1 and all(rel.endswith(f"-of-{len(shards):05d}.safetensors")
                                                         for rel in shards)
    # save_pretrained writes its config.json anew (its loading path among its keys): recorded as the snapshot would
    edit_json(snap, "rollout.json", lambda c: c.update({WEIGHTS_KEY: recorded,
                                                        TRANSFORMER_CONFIG_KEY: file_sha256(snap / TRANSFORMER_CONFIG)}))
    assert load_snapshot(snap).meta[WEIGHTS_KEY] == recorded

    shard = snap / shards[-1]
    data = bytearray(shard.read_bytes())
    data[-1] ^= 1  # one weight's last byte: another number, of the same shape
    shard.write_bytes(bytes(data))
    with pytest.raises(UserError) as err:
        load_snapshot(snap)
    assert str(err.value).startswith(f"{shard}: not the weight file this snapshot recorded: "), err.value
    os.remove(snap / index)
    with pytest.raises(UserError) as err:
        load_snapshot(snap)
    assert str(err.value).startswith(f"{snap / index}: missing: "), err.value


def written_before_adv_ddof(config: dict) -> None:
    """``config`` as a snapshot wrote it before grpo.adv_std took group | global."""
    config["grpo"]["adv_std"] = "population"
    del config["grpo"]["adv_ddof"], config["grpo"]["adv_eps"]


def test_replay_reads_an_older_snapshot_s_adv_std_as_its_config_does(snapshot, tmp_path, capsys):
    """A snapshot written before grpo.adv_std took group | global says `population` in config.json and rollout.json
    alike. config.json reads upgraded (group, ddof 0), so rollout.json must too: it was refused as 'population':
    expected 'group', a mismatch with a config.json that says the same. A rollout.json that stands for another
    ddof than config.json's is still refused."""
    snap = tmp_path / "snap"
    shutil.copytree(snapshot, snap)
    edit_json(snap, "config.json", written_before_adv_ddof)
    edit_json(snap, "rollout.json", lambda c: c.update(adv_std="population"))
    capsys.readouterr()
    assert main(["replay", str(snap), "--method", "full", "--out", str(tmp_path / "old.safetensors")]) == 0
    assert main(["replay", str(snapshot), "--method", "full", "--out", str(tmp_path / "now.safetensors")]) == 0
    from safetensors.torch import load_file
    old, now = load_file(str(tmp_path / "old.safetensors")), load_file(str(tmp_path / "now.safetensors"))
    assert old.keys() == now.keys() and all(torch.equal(old[k], now[k]) for k in now)  # the same computation
    edit_json(snap, "rollout.json", lambda c: c.update(adv_std="sample"))  # ddof 1 against config.json's 0
    for line in refused_by_replay_and_gradcheck(snap, tmp_path, capsys):
        # the key that differs, not adv_std's today's value, which both say
        assert ("rollout.json: adv_std = 'sample' stands for grpo.adv_ddof = 1: expected grpo.adv_ddof = 0, as the "
                "snapshot's config.json") in line, line


def edit_tensors(path: Path, change) -> None:
    """Rewrite the safetensors file ``path`` with ``change`` of its tensors; a snapshot's rollout with the digest
    rollout.json records of it rewritten too (a crafted pair: the checks behind the digest are what is tested), and
    so a snapshot's weight file."""
    from safetensors.torch import load_file, save_file

    save_file(change(load_file(str(path))), str(path))
    if path.name == "rollout.safetensors":
        edit_json(path.parent, "rollout.json", lambda c: c.update({DIGEST_KEY: file_sha256(path)}))
    else:  # a weight file
        edit_json(path.parent.parent, "rollout.json",
                  lambda c: c[WEIGHTS_KEY].update({f"{path.parent.name}/{path.name}": file_sha256(path)}))


def every_float(value: float):
    return lambda tensors: {k: torch.full_like(v, value) if v.is_floating_point() else v for k, v in tensors.items()}


def header_length(path: Path, length: int) -> None:
    data = path.read_bytes()
    path.write_bytes(length.to_bytes(8, "little") + data[8:])


@pytest.mark.parametrize("edit, words", [
    (lambda s: os.truncate(s / "rollout.safetensors", 5000),
     "rollout.safetensors: not a readable safetensors file (Error while deserializing header: incomplete metadata"),
    (lambda s: header_length(s / "rollout.safetensors", 2**40), "rollout.safetensors: not a readable safetensors file "
                                                                "(Error while deserializing header: header too large)"),
    (lambda s: edit_tensors(s / "rollout.safetensors", lambda t: {**t, "train_steps": torch.zeros(3, dtype=torch.int64)}),
     "rollout.safetensors: train_steps has shape [3]: expected (B=2, N)"),
    (lambda s: edit_tensors(s / "rollout.safetensors", lambda t: {**t, "train_steps": t["train_steps"] + 3}),
     "rollout.safetensors: train_steps holds"),
    (lambda s: edit_tensors(s / "rollout.safetensors", lambda t: {**t, "train_steps": t["train_steps"].float()}),
     "rollout.safetensors: train_steps holds float32: expected integers"),
    # a narrower integer indexed as something else (uint8 as a mask): IndexError tracebacks, exit 1
    (lambda s: edit_tensors(s / "rollout.safetensors", lambda t: {**t, "train_steps": t["train_steps"].to(torch.uint8)}),
     "rollout.safetensors: train_steps holds uint8: expected int64 step indices"),
    (lambda s: edit_tensors(s / "rollout.safetensors", lambda t: {**t, "train_steps": t["train_steps"].to(torch.int8)}),
     "rollout.safetensors: train_steps holds int8: expected int64 step indices"),
    # a step twice, or out of denoising order: replayed with exit 0 as a gradient no run computes
    (lambda s: edit_tensors(s / "rollout.safetensors", lambda t: {**t, "train_steps": torch.zeros_like(t["train_steps"])}),
     "rollout.safetensors: train_steps row 0 holds step 0 twice: expected each row's steps once"),
    (lambda s: edit_tensors(s / "rollout.safetensors", lambda t: {**t, "train_steps": t["train_steps"].flip(1).contiguous()}),
     "rollout.safetensors: train_steps row 0 holds [2, 1]: expected each row's steps in denoising order "
     "(increasing), as method 'full' trains them"),
    # finite but no schedule, or numbers no rollout holds: NaN gradients and cosines with exit 0
    (lambda s: edit_tensors(s / "rollout.safetensors", lambda t: {**t, "sigmas": -t["sigmas"]}),
     "rollout.safetensors: sigmas holds -1.0: expected a noise schedule, decreasing from at most 1 to at least 0"),
    (lambda s: edit_tensors(s / "rollout.safetensors", lambda t: {**t, "sigmas": t["sigmas"].flip(0).contiguous()}),
     "rollout.safetensors: sigmas holds [0.0,"),
    # a tensor in another precision than the writer's, or timesteps that are not the sigmas' (the model told one
    # noise level, the SDE stepping at another): replayed with exit 0 as a gradient no run computes
    (lambda s: edit_tensors(s / "rollout.safetensors", lambda t: {**t, "latents": t["latents"].half()}),
     "rollout.safetensors: latents holds float16: expected float32, as agg-bench snapshot writes it for model.dtype "
     "float32"),
    (lambda s: edit_tensors(s / "rollout.safetensors", lambda t: {**t, "log_probs": t["log_probs"].double()}),
     "rollout.safetensors: log_probs holds float64: expected float32"),
    (lambda s: edit_tensors(s / "rollout.safetensors", lambda t: {**t, "sigmas": t["sigmas"].float()}),
     "rollout.safetensors: sigmas holds float32: expected float64"),
    (lambda s: edit_tensors(s / "rollout.safetensors", lambda t: {**t, "timesteps": t["timesteps"].double()}),
     "rollout.safetensors: timesteps holds float64: expected float32"),
    (lambda s: edit_tensors(s / "rollout.safetensors", lambda t: {**t, "timesteps": t["timesteps"] - 1}),
     "rollout.safetensors: timesteps holds 999.0 at step 0: expected 1000.0, the value the rollout gives the model "
     "at its sigma 1.0"),
    (lambda s: edit_tensors(s / "rollout.safetensors", lambda t: {**t, "sigmas": t["sigmas"] * 0.5}),
     "rollout.safetensors: timesteps holds 1000.0 at step 0: expected 500.0, the value the rollout gives the model "
     "at its sigma 0.5"),
    (lambda s: edit_tensors(s / "rollout.safetensors", lambda t: {**t, "advantages": torch.full_like(t["advantages"], 1e38)}),
     "method 'full': gradient pos_embed.proj.weight holds nan: expected a finite gradient"),
    (lambda s: edit_tensors(s / "rollout.safetensors", lambda t: {**t, "extra": torch.zeros(1)}),
     "rollout.safetensors: holds a tensor 'extra': expected only latents,"),
    (lambda s: edit_tensors(s / "rollout.safetensors", lambda t: {k: v for k, v in t.items() if k != "timesteps"}),
     "rollout.safetensors: no tensor 'timesteps'"),
    (lambda s: edit_tensors(s / "rollout.safetensors", lambda t: {**t, "sigmas": t["sigmas"][:-1]}),
     "rollout.safetensors: sigmas has shape [3]: expected (T+1=4)"),
    (lambda s: edit_tensors(s / "rollout.safetensors", every_float(float("nan"))),
     "holds nan: expected finite numbers"),
    (lambda s: edit_tensors(s / "rollout.safetensors", lambda t: {**t, "log_probs": t["log_probs"] / 0}),
     "rollout.safetensors: log_probs holds"),
    # the resolution both files say, not the one the latents have
    (lambda s: [edit_json(s, "rollout.json", lambda c: c.update(resolution=64)),
                edit_json(s, "config.json", lambda c: c["model"].update(resolution=64))],
     "rollout.safetensors: latents has shape [2, 4, 4, 4, 4]: expected (B=2, T+1=4, C=4, H=8, W=8)"),
    (lambda s: [edit_json(s, "rollout.json", lambda c: c.update(family="flux")),
                edit_json(s, "config.json", lambda c: c["model"].update(family="flux"))],
     "rollout.json: family = 'flux': expected the family of"),
    (lambda s: os.truncate(s / WEIGHTS, 100_000), "expected loadable transformer weights in"),
    # a weight the file lacks stayed on the meta device: "Cannot copy out of meta tensor", exit 1
    (lambda s: edit_tensors(s / WEIGHTS, lambda t: {k: v for k, v in t.items() if k != "context_embedder.bias"}),
     "transformer (no weight context_embedder.bias)"),
    # a pickle instead: diffusers fell back to it (and, without the weights, to the meta device); a snapshot older
    # than the weights' digests, which refuse the missing file first
    (lambda s: [os.remove(s / WEIGHTS), torch.save({}, s / "transformer" / "diffusion_pytorch_model.bin"),
                edit_json(s, "rollout.json", without_key(WEIGHTS_KEY))],
     "(Error no file named diffusion_pytorch_model.safetensors found"),
    (lambda s: os.remove(s / WEIGHTS), f"{WEIGHTS}: missing: "),
    # an unrecorded weight file may be the one loaded: an index beside the single file loads the shards it names
    (lambda s: (s / "transformer" / "diffusion_pytorch_model.safetensors.index.json").write_text("{}"),
     "transformer/diffusion_pytorch_model.safetensors.index.json: a weight file "),
    (lambda s: edit_tensors(s / WEIGHTS, every_float(float("inf"))), "holds inf: expected finite weights"),
    # hashed before it is read: a pipe in its place was opened for hashing and waited for a writer
    (lambda s: [os.remove(s / TRANSFORMER_CONFIG), os.mkfifo(s / TRANSFORMER_CONFIG)],
     "transformer/config.json: not a regular file; expected the transformer config agg-bench snapshot wrote"),
])
def test_replay_reads_a_snapshot_s_tensors_and_weights_through_the_writer_s_shapes(snapshot, tmp_path, capsys, edit,
                                                                                 words):
    """rollout.safetensors and the transformer's weights as `agg-bench snapshot` writes them: a torn file, a
    tensor of another shape or kind (an IndexError) and a transformer of another family (a diffusers ValueError)
    were tracebacks (exit 1); NaN or infinite values gave NaN gradients and cosines with exit 0."""
    snap = tmp_path / "snap"
    shutil.copytree(snapshot, snap)
    edit(snap)
    for line in refused_by_replay_and_gradcheck(snap, tmp_path, capsys):
        assert words in line and str(snap) in line, line


@pytest.mark.parametrize("sets", [
    [], ["train.lora_rank=2"], ["model.family=flux"], ["model.family=qwenimage"],
    ["method.name=branch", "grpo.group_size=4"],  # (B, T) advantages
    ["model.dtype=float64"], ["model.dtype=bfloat16"],  # every tensor float64; float32 as for float32
    # the scheduler's integer timesteps, not the sigmas in the model's scale
    ["method.name=dgpo", "method.sampler=sana", "sampling.same_noise_per_group=false", "method.trunc_steps=1",
     "method.times_per_sample=1"],
])
def test_every_snapshot_the_writer_makes_reads_back(tmp_path, sets):
    """What the checks take is what `agg-bench snapshot` writes: its settings (rollout_settings of the run
    config) and every tensor, for each family, a LoRA run, a method with per-step advantages, each precision
    and a method sampling at timesteps of its own."""
    from safetensors.torch import load_file

    from agg_bench.tools.snapshot import load_snapshot, rollout_settings, save_snapshot

    cfg = load_config(None, ["model.resolution=32", "sampling.steps=3", "grpo.group_size=2",
                             "grpo.prompts_per_iteration=1", "progress=false", "telemetry.enabled=false", *sets])
    snap = save_snapshot(cfg, tmp_path / "snap")
    loaded = load_snapshot(snap)
    weights = {WEIGHTS: hashlib.sha256((snap / WEIGHTS).read_bytes()).hexdigest()}
    if "train.lora_rank=2" in sets:
        adapter = "lora/adapter_model.safetensors"
        weights[adapter] = hashlib.sha256((snap / adapter).read_bytes()).hexdigest()
    assert loaded.meta == {**rollout_settings(cfg), "vae_scale_factor": 8,
                           "rollout_sha256": hashlib.sha256((snap / "rollout.safetensors").read_bytes()).hexdigest(),
                           "weights_sha256": weights,
                           "transformer_config_sha256": hashlib.sha256((snap / TRANSFORMER_CONFIG).read_bytes())
                           .hexdigest()}
    assert (loaded.meta["lora"] is not None) == ("train.lora_rank=2" in sets)
    written = load_file(str(snap / "rollout.safetensors"))
    kept = {"advantages": loaded.batch.advantages, "train_steps": loaded.batch.train_steps,
            "latents": loaded.batch.latents, **loaded.batch.cond.tensors()}
    assert all(torch.equal(tensor, written[name]) for name, tensor in kept.items())


def test_a_snapshot_of_a_model_folder_reads_back_with_its_own_vae_factor(model, tmp_path, capsys):
    """The committed model's pixel decoder has factor 2 (16 latents a side at 32 px, where a default factor of
    8 says 4): rollout.json keeps the factor, and a snapshot without it (older) reads its latents' side."""
    from agg_bench.tools.snapshot import load_snapshot, save_snapshot

    prompts = tmp_path / "p.txt"
    prompts.write_text(all_scenes()[0].caption + "\n")
    snap = save_snapshot(model_config(model, f"prompts.file={prompts}", "grpo.prompts_per_iteration=1"),
                         tmp_path / "snap")
    assert json.loads((snap / "rollout.json").read_text())["vae_scale_factor"] == 2
    assert load_snapshot(snap).batch.latents.shape[-2:] == (16, 16)
    edit_json(snap, "rollout.json", lambda c: {k: v for k, v in c.items() if k != "vae_scale_factor"})
    assert load_snapshot(snap).batch.latents.shape[-2:] == (16, 16)
    edit_json(snap, "rollout.json", lambda c: c.update(vae_scale_factor=8))  # the latents of 32 px are then 4 a side
    line = refused_by_replay_and_gradcheck(snap, tmp_path, capsys)[0]
    assert "latents has shape [2, 3, 12, 16, 16]: expected (B=2, T+1=3, C=12, H=4, W=4)" in line, line


@pytest.mark.parametrize("sets", [
    ["method.name=nft", "method.times_per_sample=3", "sampling.same_noise_per_group=false"],  # each sample's steps in its own drawn order
    ["method.name=dgpo", "method.times_per_sample=3", "method.trunc_steps=3", "sampling.same_noise_per_group=false"],
])
def test_a_snapshot_of_a_method_that_draws_its_step_order_replays_it(tmp_path, capsys, sets):
    """nft and dgpo list each row's K steps in the order they draw them (their noises follow that order):
    their snapshots were refused by replay and gradcheck ("expected ... in denoising order")."""
    from agg_bench.tools.snapshot import load_snapshot, save_snapshot

    cfg = load_config(None, ["model.resolution=32", "sampling.steps=5", "grpo.group_size=4",
                             "grpo.prompts_per_iteration=1", "progress=false", "telemetry.enabled=false", *sets])
    snap = save_snapshot(cfg, tmp_path / "snap")
    assert load_snapshot(snap).batch.train_steps.shape == (4, 3)
    # a draw in falling order (the writer's draw of this seed may happen to be increasing)
    edit_tensors(snap / "rollout.safetensors",
                 lambda t: {**t, "train_steps": t["train_steps"].sort(dim=1, descending=True).values.contiguous()})
    steps = load_snapshot(snap).batch.train_steps
    assert (steps[:, 1:] < steps[:, :-1]).all()
    out = tmp_path / "g.safetensors"
    assert main(["replay", str(snap), "--method", "full", "--out", str(out)]) == 0  # nft, dgpo: not_applicable
    counts = json.loads(out.with_suffix(".json").read_text())
    assert counts["forward_grad"] == counts["backward"] == 4 * 3  # each sample at its K = 3 steps
    capsys.readouterr()


def test_agg_refuses_a_snapshot_s_steps_its_groups_would_join_across_a_gap(tmp_path, capsys):
    """AGG interpolates within a group of consecutive denoising steps; another method's snapshot may train steps
    with gaps (GUESS's, a subset): a replay or gradcheck of AGG on them made a gradient no run computes."""
    snap = tmp_path / "snap"
    settings = ["model.resolution=32", "sampling.steps=5", "grpo.group_size=2", "grpo.prompts_per_iteration=1",
                "progress=false", "telemetry.enabled=false"]
    assert main(["snapshot", *[a for s in settings for a in ("--set", s)], "--out", str(snap)]) == 0
    edit_tensors(snap / "rollout.safetensors", lambda t: {**t, "train_steps": torch.tensor([[0, 1, 2], [0, 2, 4]])})
    for verb, args, out in (
            ("replay", ["replay", str(snap), "--method", "agg", "--set", "method.window=3"], tmp_path / "r" / "g.safetensors"),
            ("gradcheck", ["gradcheck", "--snapshot", str(snap), "--windows", "3", "--alphas", "index",
                           "--route-fracs", "1"], tmp_path / "c" / "g.csv")):
        capsys.readouterr()
        line = one_line(capsys, main([*args, "--out", str(out)]))
        assert (f"snapshot {snap}: method 'agg' cannot replay the steps of its train_steps: its group of entries 0 to "
                "2 holds steps [0, 2, 4] in row 1: AGG aggregates consecutive denoising steps only") in line, (verb, line)
        assert not out.parent.exists()
    # groups of at most two entries are trained exactly, and consecutive steps are what AGG takes
    for window in (2, 3):
        if window == 3:
            edit_tensors(snap / "rollout.safetensors", lambda t: {**t, "train_steps": torch.tensor([[0, 1, 2], [2, 3, 4]])})
        out = tmp_path / f"w{window}.safetensors"
        assert main(["replay", str(snap), "--method", "agg", "--set", f"method.window={window}", "--out", str(out)]) == 0
