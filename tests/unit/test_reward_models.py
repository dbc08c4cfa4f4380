"""Learned reward models, built from tiny random checkpoints written to a temp folder in the released
formats (HPS_v2.1_compressed.pt, a transformers CLIP folder, ImageReward.pt + med_config.json, the LAION
aesthetic head .pth, and .safetensors copies), and the one-line errors for wrong or corrupt files.

Every reward is loaded through ``build_reward(name, options, "cpu")``, exactly as a run config does.
Equality with the reference implementations is in test_reward_equality.py.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from agg_bench.engine.rewards import build_reward
from agg_bench.errors import UserError

transformers = pytest.importorskip("transformers")

from helpers import seeded
from reward_assets import (TINY_MED, TINY_OPEN_CLIP, TINY_VIT, hf_blip_to_image_reward,
                           hf_clip_to_open_clip, image_reward_mlp, randomize, tiny_hf_blip, tiny_hf_clip,
                           write_bert_tokenizer, write_clip_tokenizer)

from agg_bench.cli import main
from agg_bench.engine.reward_models.common import LinearStack

REWARDS = ("hpsv2", "pickscore", "imagereward", "clipscore", "aesthetic")
PROMPTS = ["a red cat", "the cat", "a dog on grass", "red", "a tree at night"]


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> dict[str, dict]:
    """Options of every reward, pointing at tiny checkpoints in a temp folder, in the released formats."""
    root = tmp_path_factory.mktemp("reward_models")

    # transformers CLIP folder (PickScore's format; CLIPScore and aesthetic read it too).
    clip_dir = root / "clip"
    tokenizer = write_clip_tokenizer(clip_dir)
    clip = tiny_hf_clip(tokenizer, seed=0, dtype=torch.float32)
    clip.save_pretrained(str(clip_dir))
    transformers.CLIPImageProcessorPil(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}
                                       ).save_pretrained(str(clip_dir))

    # LAION aesthetic head in the public layout: Linear/Dropout stack under `layers`.
    head = image_reward_mlp(TINY_OPEN_CLIP["embed_dim"], seed=1, dtype=torch.float32)
    torch.save(head.state_dict(), root / "sac+logos+ava1-l14-linearMSE.pth")

    # HPSv2: OpenCLIP-layout state dict under "state_dict", beside training metadata, as the release has it.
    torch.save({"epoch": 1, "name": "hps", "state_dict": hf_clip_to_open_clip(clip)}, root / "HPS_v2.1_compressed.pt")

    # ImageReward: full state dict (including entries the score does not use) and BLIP's med_config.json.
    write_bert_tokenizer(root / "bert")
    (root / "med_config.json").write_text(json.dumps(TINY_MED))
    vision, text = tiny_hf_blip(seed=3, dtype=torch.float32)
    mlp = image_reward_mlp(TINY_MED["hidden_size"], seed=4, dtype=torch.float32)
    torch.save(hf_blip_to_image_reward(vision, text, mlp), root / "ImageReward.pt")

    return {
        "hpsv2": {"checkpoint": str(root / "HPS_v2.1_compressed.pt"), "tokenizer": str(clip_dir),
                  "model_config": TINY_OPEN_CLIP},
        "pickscore": {"model": str(clip_dir), "processor": str(clip_dir)},
        "imagereward": {"checkpoint": str(root / "ImageReward.pt"), "tokenizer": str(root / "bert"),
                        "med_config": str(root / "med_config.json"), "vision_config": TINY_VIT},
        "clipscore": {"model": str(clip_dir)},
        "aesthetic": {"model": str(clip_dir), "head": str(root / "sac+logos+ava1-l14-linearMSE.pth")},
    }


@pytest.fixture(scope="module")
def built(assets):
    """``built(name, batch_size)``: the reward built once per module and batch size."""
    cache = {}

    def get(name: str, batch_size: int):
        if (name, batch_size) not in cache:
            cache[name, batch_size] = build_reward(name, {**assets[name], "batch_size": batch_size}, "cpu")
        return cache[name, batch_size]

    return get


@pytest.fixture(scope="module")
def images() -> torch.Tensor:
    """Five non-square images in [0, 1], so resizing and center-cropping are exercised."""
    return torch.rand(len(PROMPTS), 3, 40, 52, generator=torch.Generator().manual_seed(seeded(5)))


# The checkpoint option of each reward, for the missing-file tests.
CHECKPOINT_OPTION = {"hpsv2": "checkpoint", "pickscore": "model", "imagereward": "checkpoint",
                     "clipscore": "model", "aesthetic": "head"}


@pytest.mark.parametrize("name", REWARDS)
def test_reward_shape_finite_deterministic(name, built, images):
    reward = built(name, 4)
    first, second = reward(images, PROMPTS), reward(images, PROMPTS)
    assert first.shape == (len(PROMPTS),) and first.dtype == torch.float32
    assert torch.isfinite(first).all()
    assert torch.equal(first, second)
    assert first.unique().numel() > 1, "scores should depend on the image / prompt"


# What a score is a multiple of: logit_scale x a cosine (PickScore; the tiny CLIP's logit_scale is 100), w x a
# cosine (CLIPScore, w = 2.5), a cosine (HPSv2), an MLP head's output over O(1) features (ImageReward, aesthetic).
SCORE_SCALE = {"hpsv2": 1.0, "pickscore": 100.0, "imagereward": 1.0, "clipscore": 2.5, "aesthetic": 1.0}


@pytest.mark.parametrize("name", REWARDS)
def test_reward_batch_invariant(name, built, images):
    """Batches of 1 and 4 block the float32 matrix products differently, so every O(1) feature rounds
    differently by a few float32 ulps; the score, a dot product of such features, inherits an absolute error of
    a few eps32 x its scale however small the score is (a cosine near 0 cancels): 8 eps32 x the scale (seen on
    twelve draws: at most 2.8 eps32 x the scale)."""
    one, four = built(name, 1)(images, PROMPTS), built(name, 4)(images, PROMPTS)
    eps32 = torch.finfo(torch.float32).eps
    torch.testing.assert_close(one, four, rtol=0, atol=8 * eps32 * SCORE_SCALE[name])


@pytest.mark.parametrize("name", REWARDS)
def test_missing_checkpoint_is_one_clear_error(name, assets, tmp_path):
    missing = tmp_path / "not_there" / "weights.pt"
    with pytest.raises(UserError) as err:
        build_reward(name, {**assets[name], CHECKPOINT_OPTION[name]: str(missing)}, "cpu")
    assert str(missing) in str(err.value) and CHECKPOINT_OPTION[name] in str(err.value)


# Every option that names a path, with whether it names a file (else a folder).
PATH_OPTIONS = [("hpsv2", "checkpoint", True), ("hpsv2", "tokenizer", False), ("hpsv2", "model_config", True),
                ("pickscore", "model", False), ("pickscore", "processor", False),
                ("imagereward", "checkpoint", True), ("imagereward", "tokenizer", False),
                ("imagereward", "med_config", True), ("clipscore", "model", False), ("aesthetic", "model", False),
                ("aesthetic", "head", True)]


@pytest.mark.parametrize("name, option, is_file", PATH_OPTIONS)
def test_option_paths_are_taken_as_written(name, option, is_file, assets, tmp_path):
    """A quoted ~ is refused as in every other config path (it was expanded here only); a file's path that ends
    with / is refused (pathlib dropped the slash and read the file)."""
    with pytest.raises(UserError) as err:
        build_reward(name, {**assets[name], option: "~/weights"}, "cpu")
    assert f"reward.options.{option} = '~/weights'" in str(err.value) and "starts with ~" in str(err.value), err.value
    if is_file:
        given = Path(assets[name][option]) if option != "model_config" else tmp_path / "open_clip.json"
        if not given.exists():  # the tiny model_config is given as a mapping
            given.write_text(json.dumps(TINY_OPEN_CLIP))
        with pytest.raises(UserError) as err:
            build_reward(name, {**assets[name], option: f"{given}/"}, "cpu")
        assert f"reward.options.{option} = '{given}/'" in str(err.value) and "ends with /" in str(err.value), \
            err.value


@pytest.mark.parametrize("name", REWARDS)
def test_missing_package_names_package_and_extra(name, assets, monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # makes `import transformers` fail
    with pytest.raises(UserError, match=rf"'transformers' package: pip install 'agg-bench\[{name}\]'"):
        build_reward(name, assets[name], "cpu")


def test_aesthetic_linear_head(assets, images, tmp_path):
    """A LAION v1 head (a single nn.Linear state dict) loads too."""
    linear = randomize(nn.Linear(16, 1), 4)
    torch.save(linear.state_dict(), tmp_path / "linear.pth")
    reward = build_reward("aesthetic", {**assets["aesthetic"], "head": str(tmp_path / "linear.pth")}, "cpu")
    scores = reward(images, PROMPTS)
    assert scores.shape == (len(PROMPTS),) and torch.isfinite(scores).all()


def test_aesthetic_from_vision_only_folder(assets, built, images, tmp_path):
    """A folder holding only CLIPVisionModelWithProjection scores like the full CLIP folder it came from."""
    clip = transformers.CLIPModel.from_pretrained(assets["aesthetic"]["model"])
    vision_config = clip.config.vision_config
    vision_config.projection_dim = clip.config.projection_dim
    vision = transformers.CLIPVisionModelWithProjection(vision_config)
    vision.vision_model.load_state_dict(clip.vision_model.state_dict())
    vision.visual_projection.load_state_dict(clip.visual_projection.state_dict())
    vision.save_pretrained(str(tmp_path / "vision"))
    options = {**assets["aesthetic"], "model": str(tmp_path / "vision"), "processor": assets["aesthetic"]["model"]}
    torch.testing.assert_close(build_reward("aesthetic", options, "cpu")(images, PROMPTS),
                               built("aesthetic", 4)(images, PROMPTS))


def test_folder_without_a_clip_model_is_a_clear_error(assets):
    not_clip = Path(assets["imagereward"]["tokenizer"])
    with pytest.raises(UserError, match=str(not_clip)):
        build_reward("pickscore", {**assets["pickscore"], "model": str(not_clip)}, "cpu")


@pytest.mark.parametrize("change, problem", [
    ({"vision_cfg": {**TINY_OPEN_CLIP["vision_cfg"], "layers": 3}}, "missing keys"),
    ({"embed_dim": 8}, "wrong shapes"),
])
def test_checkpoint_that_does_not_fit_the_architecture(assets, change, problem):
    with pytest.raises(UserError, match=f"does not fit the configured architecture: {problem}"):
        build_reward("hpsv2", {**assets["hpsv2"], "model_config": {**TINY_OPEN_CLIP, **change}}, "cpu")


def test_linear_stack_keeps_checkpoint_indices():
    stack = LinearStack([8, 4, 2, 1], [0, 2, 3])
    assert sorted(stack.state_dict()) == ["layers.0.bias", "layers.0.weight", "layers.2.bias", "layers.2.weight",
                                          "layers.3.bias", "layers.3.weight"]
    rebuilt = LinearStack.from_state_dict(stack.state_dict())
    rebuilt.load_state_dict(stack.state_dict())
    x = torch.randn(3, 8)
    torch.testing.assert_close(rebuilt(x), stack(x))




# What each reward's checkpoint option expects, as its error messages name it.
EXPECTED_FILE = {"hpsv2": "HPS_v2.1_compressed.pt", "pickscore": "config.json", "imagereward": "ImageReward.pt",
                 "clipscore": "config.json", "aesthetic": "linearMSE.pth"}
STATE_DICT_REWARDS = ("hpsv2", "imagereward", "aesthetic")


@pytest.mark.parametrize("name", STATE_DICT_REWARDS)
def test_safetensors_checkpoint_scores_like_the_released_file(name, assets, built, images, tmp_path):
    """The released tensors saved as .safetensors give the same scores (same weights, same kernels: bit-equal)."""
    from safetensors.torch import save_file

    option = CHECKPOINT_OPTION[name]
    state = torch.load(assets[name][option], weights_only=True)
    state = state.get("state_dict", state)
    save_file({k: v.contiguous() for k, v in state.items()}, str(tmp_path / "weights.safetensors"))
    options = {**assets[name], option: str(tmp_path / "weights.safetensors"), "batch_size": 4}
    assert torch.equal(build_reward(name, options, "cpu")(images, PROMPTS), built(name, 4)(images, PROMPTS))


def write_bad_checkpoint(kind: str, folder: Path, assets) -> Path:
    """A checkpoint file users get wrong: corrupt bytes, a pickled module, a folder, a list, another model's file."""
    path = folder / "weights.pt"
    if kind == "corrupt":
        path.write_bytes(bytes(range(256)) * 4)
    elif kind == "empty":
        path.write_bytes(b"")
    elif kind == "corrupt safetensors":
        path = folder / "weights.safetensors"
        path.write_bytes(b"not a safetensors header" * 8)
    elif kind == "pickled module":  # torch.save(model) instead of its state dict: refused by weights_only
        torch.save(nn.Linear(2, 2), path)
    elif kind == "list of tensors":
        torch.save([torch.zeros(2)], path)
    elif kind == "folder":
        path = folder / "a-folder"
        path.mkdir()
    elif kind == "another reward's checkpoint":
        return Path(assets["imagereward"]["checkpoint"])
    return path


# kind -> words the message must hold besides the path and the expected file
BAD_CHECKPOINTS = {"corrupt": "not a readable torch checkpoint", "empty": "not a readable torch checkpoint",
                   "corrupt safetensors": "not a readable safetensors file",
                   "pickled module": "pickled torch.nn.modules.linear.Linear, which weights_only=True refuses",
                   "list of tensors": "holds a list, not a state dict", "folder": "is a folder",
                   "another reward's checkpoint": "does not fit the configured architecture"}


@pytest.mark.parametrize("kind", BAD_CHECKPOINTS)
@pytest.mark.parametrize("name", STATE_DICT_REWARDS)
def test_wrong_or_corrupt_checkpoint_is_one_clear_error(name, kind, assets, tmp_path):
    if name == "imagereward" and kind == "another reward's checkpoint":
        kind = "list of tensors"  # ImageReward.pt is that reward's own file
    path = write_bad_checkpoint(kind, tmp_path, assets)
    with pytest.raises(UserError) as err:
        build_reward(name, {**assets[name], CHECKPOINT_OPTION[name]: str(path)}, "cpu")
    message = str(err.value)
    assert str(path) in message and EXPECTED_FILE[name] in message and "\n" not in message, message
    assert BAD_CHECKPOINTS[kind] in message or (name == "aesthetic" and kind == "another reward's checkpoint"
                                                 and "neither a linear layer" in message), message


@pytest.mark.parametrize("name", ["pickscore", "clipscore", "aesthetic"])
@pytest.mark.parametrize("kind", ["corrupt weights", "a file"])
def test_wrong_or_corrupt_model_folder_is_one_clear_error(name, kind, assets, tmp_path):
    """PickScore's format is a transformers folder: a corrupt model.safetensors, or a file given for the folder."""
    import shutil

    if kind == "a file":
        path = Path(assets["imagereward"]["checkpoint"])
    else:
        path = tmp_path / "clip"
        shutil.copytree(assets[name]["model"], path)
        assert (path / "model.safetensors").is_file()  # save_pretrained's format, the one released folders use
        (path / "model.safetensors").write_bytes(b"not a safetensors file" * 10)
    with pytest.raises(UserError) as err:
        build_reward(name, {**assets[name], "model": str(path), "processor": assets[name]["model"]}, "cpu")
    message = str(err.value)
    assert str(path) in message and "config.json + model.safetensors" in message and "\n" not in message, message


def run_cli(tmp_path, capsys, name: str, options: dict) -> tuple[int, str]:
    """``agg-bench run`` of one tiny iteration with the given reward; (exit code, stderr)."""
    capsys.readouterr()
    code = main(["run", "--set", "model.resolution=32", "--set", "sampling.steps=4", "--set", "train.iterations=1",
                 "--set", "progress=false", "--set", f"reward.name={name}",
                 "--set", f"reward.options={json.dumps(options)}", "--out", str(tmp_path / "out")])
    return code, capsys.readouterr().err


def test_cli_corrupt_checkpoint_exits_2_naming_file_and_expectation(assets, tmp_path, capsys):
    path = write_bad_checkpoint("corrupt", tmp_path, assets)
    code, err = run_cli(tmp_path, capsys, "hpsv2", {**assets["hpsv2"], "checkpoint": str(path)})
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert str(path) in err and "HPS_v2.1_compressed.pt" in err


def test_cli_missing_extra_exits_2_naming_the_extra(assets, tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # makes `import transformers` fail
    code, err = run_cli(tmp_path, capsys, "imagereward", assets["imagereward"])
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "agg-bench[imagereward]" in err


@pytest.mark.parametrize("name, option", [("imagereward", "med_config"), ("hpsv2", "model_config")])
@pytest.mark.parametrize("content, problem", [
    (b"\xff\xfe{}", "is not UTF-8 text"),
    (b"{", "is not JSON"),
    (b"[1, 2]", "holds a list, not a JSON object"),
])
def test_a_json_config_file_that_is_not_a_json_object_is_one_clear_error(name, option, content, problem, assets,
                                                                         tmp_path, capsys):
    path = tmp_path / "config.json"
    path.write_bytes(content)
    with pytest.raises(UserError) as err:
        build_reward(name, {**assets[name], option: str(path)}, "cpu")
    message = str(err.value)
    assert f"reward.options.{option}: {path}: {problem}" in message and "\n" not in message, message
    code, stderr = run_cli(tmp_path, capsys, name, {**assets[name], option: str(path)})
    assert code == 2 and len(stderr.strip().splitlines()) == 1 and problem in stderr, stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("value, words", [(None, "reward.options.checkpoint is not given; expected the file"),
                                          ("", "reward.options.checkpoint = '': an empty path, which names the "
                                               "current folder; expected the file")])
def test_a_reward_path_not_given_or_empty_is_not_the_current_folder(value, words):
    """require_path read null (no default) and '' as Path(''), the current folder, which exists: a builder given
    options without their check took it for its file."""
    from agg_bench.engine.reward_models.common import require_path

    with pytest.raises(UserError) as err:
        require_path("hpsv2", {"checkpoint": value}, "checkpoint", "the file")
    assert words in str(err.value), err.value
