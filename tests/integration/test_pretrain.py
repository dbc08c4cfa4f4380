"""`agg-bench pretrain`: the saved folder loads as `model.preset: pretrained`, its output is atomic and
guarded, its config is checked, and its recipe still learns. Models here train for a few steps only
(seconds), but for the recipe's test (200 steps, about 20 CPU-s)."""
from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from agg_bench.config import load_config
from agg_bench.engine.models import load_policy
from agg_bench.engine.pixel_decoder import PixelDecoder
from agg_bench.engine.scenes import all_scenes, draw_batch
from agg_bench.engine.text import prompt_conditioning, prompt_set
from agg_bench.errors import ConfigError, UserError
from agg_bench.tools.pretrain import (MARKER, PretrainConfig, SceneConditioning, load_pretrain_config, pretrain,
                                      sweep_entry_config)

ROOT = Path(__file__).resolve().parents[2]
QUICK = ["steps=2", "batch_size=4", "num_layers=1", "sample_steps=2", "warmup_steps=1"]


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
    """``pretrained(family)``: a model folder trained for 2 steps, made once per module."""
    root = tmp_path_factory.mktemp("pretrained")
    made = {}

    def get(family: str):
        if family not in made:
            made[family] = root / family
            pretrain(load_pretrain_config(None, [f"family={family}", *QUICK]), made[family], progress=False)
        return made[family]

    return get


def test_pixel_decoder_round_trip(rng):
    """decode(un-normalise(encode(x))) returns the image: a rearrangement and an affine map (float error only)."""
    decoder = PixelDecoder(2, scaling_factor=1.7, shift_factor=-0.6)
    images = torch.rand(3, 3, 16, 16, generator=rng)
    latents = decoder.encode_images(images)
    assert latents.shape == (3, 12, 8, 8)
    back = decoder.decode(latents / 1.7 + -0.6)[0] / 2 + 0.5
    torch.testing.assert_close(back, images, rtol=0, atol=1e-6)


@pytest.mark.parametrize("family", ["sd3", "flux"])
def test_folder_loads_as_a_pretrained_model(pretrained, family, tmp_path):
    folder = pretrained(family)
    assert sorted(p.name for p in folder.iterdir()) == sorted(
        ["transformer", "vae", "scheduler", "token_hash.json", "samples.png", MARKER])
    summary = json.loads((folder / MARKER).read_text())
    assert summary["config"]["family"] == family and summary["config"]["steps"] == 2
    policy = load_policy(family, "pretrained", str(folder))
    assert isinstance(policy.vae, PixelDecoder)
    assert policy.latent_shape(32) == (12, 16, 16)
    # the run's conditioning is the token-hash embedding the model was trained with, whatever the run seed
    prompts_file = tmp_path / "p.txt"
    captions = [s.caption for s in all_scenes()[:3]]
    prompts_file.write_text("\n".join(captions) + "\n")
    cfg = load_config(None, [f"model.family={family}", "model.preset=pretrained", f"model.pretrained={folder}",
                             f"prompts.file={prompts_file}", "seed=5"])
    cond = prompt_conditioning(cfg, policy.transformer, prompt_set(str(prompts_file)))
    trained = SceneConditioning(load_pretrain_config(None, [f"family={family}", *QUICK]))(captions)
    assert torch.equal(cond.encoder_hidden_states, trained.encoder_hidden_states)
    assert torch.equal(cond.pooled_projections, trained.pooled_projections)
    # decoding data latents gives the data back
    images = draw_batch(all_scenes()[:2], 32, torch.Generator())
    torch.testing.assert_close(policy.decode(policy.vae.encode_images(images)), images, rtol=0, atol=1e-6)


def test_run_on_a_pretrained_folder_records_scene_subscores(pretrained, tmp_path):
    from agg_bench.runtime.train import train

    prompts_file = tmp_path / "p.txt"
    prompts_file.write_text("\n".join(s.caption for s in all_scenes()[:2]) + "\n")
    cfg = load_config(None, ["model.family=sd3", "model.preset=pretrained", f"model.pretrained={pretrained('sd3')}",
                             "model.resolution=32", f"prompts.file={prompts_file}", "reward.name=scene",
                             "train.iterations=1", "sampling.steps=2", "grpo.group_size=2", "progress=false"])
    summary = train(cfg, tmp_path / "run")
    assert summary["status"] == "ok"
    record = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    parts = [record[k] for k in ("reward_color", "reward_shape", "reward_position", "reward_count")]
    assert all(0 <= p <= 1 for p in parts)
    assert record["reward_mean"] == pytest.approx(sum(parts) / 4, abs=1e-6)
    # the planner reads the pixel decoder's folder too: its counted activations are what the run measured
    plan = json.loads((tmp_path / "run" / "plan.json").read_text())
    assert "error" not in plan and plan["bytes"]["activations"] == record["saved_activation_peak_bytes"]


def test_output_is_guarded_and_replaced_whole(pretrained, tmp_path):
    cfg = load_pretrain_config(None, ["family=sd3", *QUICK])
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep")
    with pytest.raises(UserError, match="not an agg-bench pretrain output"):
        pretrain(cfg, foreign, progress=False)
    assert [p.name for p in foreign.iterdir()] == ["notes.txt"]
    # an earlier output is replaced by a complete new one; no temporary folder is left beside it
    out = tmp_path / "model"
    pretrain(cfg, out, progress=False)
    # a file someone added to an earlier output would be lost with it: refused, and kept
    (out / "notes.txt").write_text("added later")
    before = (out / MARKER).read_bytes()
    with pytest.raises(UserError, match=r"not an agg-bench pretrain output \(notes.txt\)"):
        pretrain(cfg, out, progress=False)
    assert (out / "notes.txt").read_text() == "added later" and (out / MARKER).read_bytes() == before
    (out / "notes.txt").unlink()
    pretrain(cfg, out, progress=False)
    assert (out / MARKER).read_bytes() != before  # a new output (its timings differ)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["foreign", "model"]


def test_learning_rate_schedules():
    """Linear warm-up to lr, then constant, or cosine down to 0 at the last step (exact at its ends)."""
    from agg_bench.tools.pretrain import learning_rate

    cosine = load_pretrain_config(None, ["steps=110", "warmup_steps=10", "lr=0.5", "lr_schedule=cosine"])
    constant = load_pretrain_config(None, ["steps=110", "warmup_steps=10", "lr=0.5"])
    assert [learning_rate(cosine, s) for s in (0, 4, 9)] == [0.05, 0.25, 0.5]
    assert learning_rate(cosine, 10) == 0.5 and learning_rate(cosine, 60) == pytest.approx(0.25, abs=1e-15)
    assert learning_rate(cosine, 110) == pytest.approx(0.0, abs=1e-15)
    values = [learning_rate(cosine, s) for s in range(10, 110)]
    assert all(a > b for a, b in zip(values, values[1:]))
    assert {learning_rate(constant, s) for s in range(10, 110)} == {0.5}


def test_a_given_warm_up_longer_than_the_steps_is_one_warning_line(tmp_path, capsys):
    """steps=10 warmup_steps=1000000 trained at a learning rate that never neared lr, with nothing said. A warm-up
    given above the steps is one stderr line (before the model code); the default warm-up (50) above a few test
    steps, and a warm-up that ends at the last step, say nothing."""
    from agg_bench.cli import main
    from agg_bench.config.pretrain_keys import read_pretrain_config

    lines: list[str] = []
    for overrides in (["steps=1"], ["steps=10", "warmup_steps=10"], ["steps=10", "warmup_steps=1000000", "lr=0.5"]):
        read_pretrain_config(None, overrides, warn=lines.append)
    assert lines == ["warning: warmup_steps = 1000000 is above steps = 10: the learning rate never reaches lr = 0.5 "
                     "(the last step's is 5e-06); give warmup_steps <= steps to reach it"]
    out = tmp_path / "out"
    capsys.readouterr()  # a refusal after it (the resolution's multiple) still prints it, and nothing is written
    assert main(["pretrain", "--set", "steps=10", "--set", "warmup_steps=11", "--set", "resolution=20", "--out",
                 str(out)]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 2 and err[0].startswith("agg-bench pretrain: warning: warmup_steps = 11 is above steps = 10")
    assert "resolution" in err[1] and not out.exists(), err


@pytest.mark.parametrize("override, key", [
    ("family=qwenimage", "family"), ("steps=-1", "steps"), ("steps=10000000", "steps"), ("lr=.nan", "lr"),
    ("lr=abc", "lr"), ("batch_size=2.5", "batch_size"), ("resolution=30", "resolution"),
    ("pixel_factor=3", "pixel_factor"), ("ema_decay=1", "ema_decay"), ("colour=red", "colour"),
    ("steps=true", "steps"), ("lr_schedule=linear", "lr_schedule"), ("lr_schedule=5", "lr_schedule"),
    ("device=gpu", "device"), ("device=5", "device"), ("device=cuda:9999999999", "device"),
    # a warm-up past the steps' bound (10**400 overflowed the first step's learning rate: a traceback after the
    # output folder was claimed) and more threads than a sweep's devices may take
    ("warmup_steps=1" + "0" * 400, "warmup_steps"), ("warmup_steps=1000001", "warmup_steps"),
    ("threads=1025", "threads"), ("threads=99999999999", "threads"),
    # a shift within (0, 100] whose sample schedule rounds to nan (1e-8) or starts above 1 (0.01): the samples
    # were nan, recorded as a mean scene reward of 0 with the command's success, and the saved scheduler's shift
    # refused by a run that takes the model's own (sampling.shift: null)
    ("shift=1e-8", "shift"), ("shift=0.01", "shift"),
])
def test_bad_config_names_the_key(override, key):
    with pytest.raises(ConfigError, match=f"config error: {key} = "):
        load_pretrain_config(None, [override])


def test_cli_errors_exit_2_and_leave_nothing(tmp_path):
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "agg_bench", "pretrain", "--set", "steps=0", "--out", str(out)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "steps = 0" in proc.stderr
    assert not out.exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine without a CUDA device")
def test_a_device_this_machine_lacks_is_one_line_before_any_work(tmp_path, capsys):
    """A config naming cuda loads (a sweep is planned anywhere); pretraining with it here is refused."""
    from agg_bench.cli import main

    assert load_pretrain_config(None, ["device=cuda"]).device == "cuda"
    out = tmp_path / "out"
    assert main(["pretrain", "--set", "device=cuda", "--set", "steps=2", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "device = 'cuda'" in err[0] and "CUDA is not available" in err[0]
    # pretrain's device takes no auto: the refusal offered it, and device=auto was then refused
    assert "expected cpu:" in err[0] and "auto" not in err[0], err
    assert not out.exists()


def test_embed_refuses_a_token_hash_folder(pretrained, tmp_path, capsys):
    """`agg-bench embed` on a pre-trained scene model: one line naming the folder and why, exit 2, no file."""
    from agg_bench.cli import main

    out = tmp_path / "e.safetensors"
    code = main(["embed", "--set", "model.family=sd3", "--set", "model.preset=pretrained",
                 "--set", f"model.pretrained={pretrained('sd3')}", "--out", str(out)])
    err = capsys.readouterr().err
    assert code == 2, err
    assert len(err.strip().splitlines()) == 1 and "token_hash.json" in err
    assert not out.exists()


# A few hundred steps of config/pretrain.yaml's recipe (its warm-up and cosine decay fitted to them), on one
# thread. Measured on a 2-core Xeon: 200 steps took 20 CPU-s (one step 1 CPU-s); the loss fell from 2.26
# (first 20 steps) to 0.74 (last 20), 0.33 x; the samples' scene reward rose from 0.261 (one step) to 0.639
# (+0.378: colour 0.25 -> 0.82, position 0.51 -> 0.98, count 0.18 -> 0.40, shape 0.11 -> 0.35).
RECIPE_STEPS = 200
LOSS_FALL = 0.5       # of the measured 0.33
REWARD_MARGIN = 0.15  # of the measured +0.378
# Fewer steps do not keep it: seeds 0, 1, 2 (pretrain's seed) gained +0.378, +0.267, +0.317 in 200 steps
# (loss 0.33-0.34 x), seed 1 only +0.179 in 150.


def test_the_recipe_still_learns(tmp_path):
    """config/pretrain.yaml's recipe, cut to RECIPE_STEPS steps, learns: its loss falls below LOSS_FALL x its
    start, and its samples' scene reward beats the untrained model's (one step at a fiftieth of the
    learning rate: the initial weights, nearly) by more than REWARD_MARGIN, a fraction of the measured
    gain. The full recipe's output is tests/data/sd3-scenes (tests/integration/test_learning.py)."""
    recipe = ROOT / "config" / "pretrain.yaml"
    untrained = pretrain(load_pretrain_config(recipe, ["steps=1", "threads=1"]), tmp_path / "untrained",
                         progress=False)
    trained = pretrain(load_pretrain_config(recipe, [f"steps={RECIPE_STEPS}", "threads=1"]), tmp_path / "trained",
                       progress=False)
    assert trained["loss_last"] < LOSS_FALL * trained["loss_first"], trained["loss_curve"]
    assert trained["sample_reward"] > untrained["sample_reward"] + REWARD_MARGIN, (trained, untrained)


def bad_pretrain_values(schema: dict) -> list[tuple[str, object]]:
    """(what, value) a pretrain key's property ``schema`` refuses: a wrong type, NaN, a boolean, and a value just
    past each of its bounds (a choice: a value not among them; a name: one not of its pattern)."""
    kind = schema.get("type")
    out: list[tuple[str, object]] = [("wrong type", 7 if kind == "string" or ("enum" in schema and kind is None)
                                      else "seven"), ("NaN", float("nan")), ("true", True)]
    if "enum" in schema:
        out.append(("not a choice", 3 if kind == "integer" else "other"))
    if "pattern" in schema:  # the device: a name no device has, and an index the pattern takes and torch misreads
        out += [("not the pattern", "gpu"), ("a leading zero", "cuda:017")]
    if kind in ("integer", "number"):
        step = 1 if kind == "integer" else 1e-6
        if "minimum" in schema:
            out.append(("below", schema["minimum"] - step))
        if "exclusiveMinimum" in schema:
            out.append(("at the exclusive minimum", schema["exclusiveMinimum"]))
        if "maximum" in schema:
            out.append(("above", schema["maximum"] + step))
        if "exclusiveMaximum" in schema:
            out.append(("at the exclusive maximum", schema["exclusiveMaximum"]))
        out.append(("1e400", float("inf")))
    return out


@pytest.mark.parametrize("key", list(PretrainConfig().to_dict()))
def test_every_bad_pretrain_value_is_one_line_naming_the_key(key, tmp_path, capsys):
    """Every pretrain key refuses a wrong type, NaN, a boolean and a value past each of its bounds through the
    command line: one line naming the key and the value, exit 2, nothing written; a sweep's pretrain entry with
    the same value is refused with the same words, naming the entry."""
    from agg_bench.cli import main
    from agg_bench.config.pretrain_keys import pretrain_schema
    from agg_bench.tools.sweep import SweepError

    out = tmp_path / "out"
    cases = bad_pretrain_values(pretrain_schema()["properties"][key])
    assert len(cases) >= 4
    for what, value in cases:
        text = json.dumps(value).replace("NaN", ".nan").replace("Infinity", ".inf")  # YAML's NaN and infinity
        assert main(["pretrain", "--set", f"{key}={text}", "--out", str(out)]) == 2, (what, value)
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and f"config error: {key} = " in err[0], (what, value, err)
        assert not out.exists(), (what, value)
        with pytest.raises(SweepError) as refused:
            sweep_entry_config("toy", {"config": None, "set": {key: value}})
        assert str(refused.value).endswith(f"pretrain.toy: {err[0].split('agg-bench pretrain: ', 1)[1]}"), (what, value)


def test_a_float_key_given_an_integer_holds_a_float():
    """pretrain.json records the config as loaded: an integer given for a number key is that number as a float
    (shift: 3 as 3.0, as it always was), an integer key stays an int."""
    cfg = load_pretrain_config(None, ["shift=3", "lr=1", "ema_decay=0", "steps=7"])
    assert [(type(v), v) for v in (cfg.shift, cfg.lr, cfg.ema_decay, cfg.steps)] == [
        (float, 3.0), (float, 1.0), (float, 0.0), (int, 7)]
    assert json.dumps(dataclasses.asdict(cfg)) == json.dumps({**dataclasses.asdict(PretrainConfig()), "shift": 3.0,
                                                              "lr": 1.0, "ema_decay": 0.0, "steps": 7})
