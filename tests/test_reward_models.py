"""Learned reward models, built from tiny random checkpoints written to a temp folder.

Every reward is loaded through ``build_reward(name, options, "cpu")``, exactly as a run config does.
"""
from __future__ import annotations

import json
import string
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from agg_bench.errors import UserError
from agg_bench.rewards import build_reward

transformers = pytest.importorskip("transformers")

from agg_bench.reward_models.common import ImagePreprocess, LinearStack  # noqa: E402
from agg_bench.reward_models.hpsv2 import OpenClipModel, resolve_model_config  # noqa: E402
from agg_bench.reward_models.imagereward import ImageRewardModel, TextConfig, VisionConfig  # noqa: E402

REWARDS = ("hpsv2", "pickscore", "imagereward", "clipscore", "aesthetic")
PROMPTS = ["a red cat", "the cat", "a dog on grass", "red", "a tree at night"]
# Tiny OpenCLIP config in the JSON layout of open_clip's model_configs/.
TINY_OPEN_CLIP = {
    "embed_dim": 16,
    "vision_cfg": {"image_size": 32, "layers": 2, "width": 32, "head_width": 8, "patch_size": 8},
    "text_cfg": {"context_length": 77, "vocab_size": 64, "width": 32, "heads": 4, "layers": 2},
}
TINY_VIT = {"image_size": 32, "patch_size": 8, "width": 32, "layers": 2, "heads": 4}
TINY_MED = {"vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
            "intermediate_size": 64, "max_position_embeddings": 40, "layer_norm_eps": 1e-12,
            "hidden_act": "gelu", "add_cross_attention": True, "encoder_width": 32}


def randomize(module: nn.Module, seed: int, std: float = 0.2) -> nn.Module:
    """Fill every parameter with seeded N(0, std) noise (zero-initialised weights would give constant scores)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * std)
    return module


def write_clip_tokenizer(folder: Path) -> transformers.CLIPTokenizer:
    """A CLIP BPE tokenizer over lowercase letters (byte-level ASCII letters map to themselves)."""
    folder.mkdir(parents=True, exist_ok=True)
    letters = string.ascii_lowercase
    # Special tokens last, as in CLIP's vocabulary: the end token has the largest id.
    tokens = [*letters, *(c + "</w>" for c in letters), "ca", "cat</w>", "re", "red</w>",
              "<|startoftext|>", "<|endoftext|>"]
    (folder / "vocab.json").write_text(json.dumps({t: i for i, t in enumerate(tokens)}))
    (folder / "merges.txt").write_text("#version: 0.2\nc a\nca t</w>\nr e\nre d</w>\n")
    return transformers.CLIPTokenizer.from_pretrained(str(folder), model_max_length=77)


def write_bert_tokenizer(folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    words = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *string.ascii_lowercase,
             *("##" + c for c in string.ascii_lowercase), "a", "red", "cat", "dog", "the"]
    (folder / "vocab.txt").write_text("\n".join(dict.fromkeys(words)) + "\n")
    transformers.BertTokenizer.from_pretrained(str(folder)).save_pretrained(str(folder))


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> dict[str, dict]:
    """Options of every reward, pointing at tiny checkpoints in a temp folder."""
    root = tmp_path_factory.mktemp("reward_models")

    # transformers CLIP (PickScore, CLIPScore, aesthetic): model and processor in one folder.
    clip_dir = root / "clip"
    tokenizer = write_clip_tokenizer(root / "clip_tokenizer")
    torch.manual_seed(0)
    text = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                max_position_embeddings=77, bos_token_id=tokenizer.bos_token_id,
                eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  image_size=32, patch_size=8)
    transformers.CLIPModel(transformers.CLIPConfig(text_config=text, vision_config=vision, projection_dim=16)
                           ).save_pretrained(str(clip_dir))
    image_processor = transformers.CLIPImageProcessor(size={"shortest_edge": 32},
                                                      crop_size={"height": 32, "width": 32})
    transformers.CLIPProcessor(image_processor=image_processor, tokenizer=tokenizer).save_pretrained(str(clip_dir))

    # LAION aesthetic head in the public layout: Linear/Dropout stack under `layers`.
    head = nn.Module()
    head.layers = nn.Sequential(nn.Linear(16, 1024), nn.Dropout(0.2), nn.Linear(1024, 128), nn.Dropout(0.2),
                                nn.Linear(128, 64), nn.Dropout(0.1), nn.Linear(64, 16), nn.Linear(16, 1))
    torch.save(randomize(head, 1, std=0.05).state_dict(), root / "aesthetic_head.pth")

    # HPSv2: OpenCLIP-layout state dict wrapped like the HPS release.
    hps = randomize(OpenClipModel(resolve_model_config(TINY_OPEN_CLIP)), 2)
    torch.save({"state_dict": hps.state_dict()}, root / "hps.pt")

    # ImageReward: full state dict, including the entries the score does not use.
    write_bert_tokenizer(root / "bert")
    (root / "med_config.json").write_text(json.dumps(TINY_MED))
    text_cfg = TextConfig(**{k: v for k, v in TINY_MED.items() if k in TextConfig.__dataclass_fields__})
    ir = randomize(ImageRewardModel(VisionConfig(**TINY_VIT), text_cfg), 3)
    state = ir.state_dict()
    state.update({"blip.vision_proj.weight": torch.zeros(8, 32), "blip.vision_proj.bias": torch.zeros(8),
                  "blip.text_proj.weight": torch.zeros(8, 32), "blip.text_proj.bias": torch.zeros(8),
                  "blip.text_encoder.embeddings.position_ids": torch.arange(40)[None]})
    torch.save(state, root / "ImageReward.pt")

    return {
        "hpsv2": {"checkpoint": str(root / "hps.pt"), "tokenizer": str(root / "clip_tokenizer"),
                  "model_config": TINY_OPEN_CLIP},
        "pickscore": {"model": str(clip_dir), "processor": str(clip_dir)},
        "imagereward": {"checkpoint": str(root / "ImageReward.pt"), "tokenizer": str(root / "bert"),
                        "med_config": str(root / "med_config.json"), "vision_config": TINY_VIT},
        "clipscore": {"model": str(clip_dir)},
        "aesthetic": {"model": str(clip_dir), "head": str(root / "aesthetic_head.pth")},
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
    return torch.rand(len(PROMPTS), 3, 40, 52, generator=torch.Generator().manual_seed(5))


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


@pytest.mark.parametrize("name", REWARDS)
def test_reward_batch_invariant(name, built, images):
    one, four = built(name, 1)(images, PROMPTS), built(name, 4)(images, PROMPTS)
    torch.testing.assert_close(one, four, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("name", REWARDS)
def test_missing_checkpoint_is_one_clear_error(name, assets, tmp_path):
    missing = tmp_path / "not_there" / "weights.pt"
    with pytest.raises(UserError) as err:
        build_reward(name, {**assets[name], CHECKPOINT_OPTION[name]: str(missing)}, "cpu")
    assert str(missing) in str(err.value) and CHECKPOINT_OPTION[name] in str(err.value)


@pytest.mark.parametrize("name", REWARDS)
def test_missing_package_names_package_and_extra(name, assets, monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # makes `import transformers` fail
    with pytest.raises(UserError, match=rf"'transformers' package: pip install 'agg-bench\[{name}\]'"):
        build_reward(name, assets[name], "cpu")


def test_pickscore_matches_transformers_forward(assets):
    """At the model's resolution preprocessing only normalises, so CLIPModel's own logits are the reference."""
    clip_dir = assets["pickscore"]["model"]
    model = transformers.CLIPModel.from_pretrained(clip_dir).eval()
    tokenizer = transformers.CLIPTokenizer.from_pretrained(clip_dir)
    images = torch.rand(3, 3, 32, 32, generator=torch.Generator().manual_seed(7))
    prompts = PROMPTS[:3]
    tokens = tokenizer(prompts, padding=True, return_tensors="pt")
    with torch.no_grad():
        logits = model(input_ids=tokens["input_ids"], attention_mask=tokens["attention_mask"],
                       pixel_values=ImagePreprocess.square(32)(images)).logits_per_image
    expected = logits.diagonal()
    torch.testing.assert_close(build_reward("pickscore", assets["pickscore"], "cpu")(images, prompts), expected,
                               rtol=1e-5, atol=1e-5)
    # CLIPScore on the same model: w * max(cos, 0) with cos = PickScore / logit_scale.
    cosine = expected / model.logit_scale.exp()
    clipscore = build_reward("clipscore", {**assets["clipscore"], "w": 2.5}, "cpu")(images, prompts)
    torch.testing.assert_close(clipscore, 2.5 * cosine.clamp(min=0), rtol=1e-5, atol=1e-6)


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


def test_preprocess_matches_clip_image_processor():
    """The torch transform agrees with transformers' PIL-based processor up to 8-bit rounding."""
    np = pytest.importorskip("numpy")
    PIL = pytest.importorskip("PIL.Image")
    processor = transformers.CLIPImageProcessor(size={"shortest_edge": 24}, crop_size={"height": 24, "width": 24})
    smooth = torch.rand(1, 3, 6, 8, generator=torch.Generator().manual_seed(8))
    image = (torch.nn.functional.interpolate(smooth, size=(60, 80), mode="bilinear") * 255).round() / 255
    pil = PIL.fromarray((image[0].permute(1, 2, 0) * 255).round().to(torch.uint8).numpy())
    expected = torch.as_tensor(np.asarray(processor(images=pil, return_tensors="np")["pixel_values"]))
    ours = ImagePreprocess.from_hf(processor)(image)
    assert ours.shape == expected.shape == (1, 3, 24, 24)
    assert (ours - expected).abs().max() < 0.05  # a few 8-bit steps after dividing by std ~0.27


def test_preprocess_at_native_size_only_normalizes():
    image = torch.rand(2, 3, 32, 32, generator=torch.Generator().manual_seed(9))
    pre = ImagePreprocess.square(32)
    mean, std = torch.tensor(pre.mean).view(1, 3, 1, 1), torch.tensor(pre.std).view(1, 3, 1, 1)
    torch.testing.assert_close(pre(image), (image - mean) / std, rtol=0, atol=0)


def test_hpsv2_matches_open_clip(assets):
    """Same weights in open_clip's own CLIP give the same embeddings (runs where open_clip is installed)."""
    open_clip = pytest.importorskip("open_clip")
    from agg_bench.reward_models.hpsv2 import tokenize

    state = torch.load(assets["hpsv2"]["checkpoint"], weights_only=True)["state_dict"]
    reference = open_clip.model.CLIP(**TINY_OPEN_CLIP).eval()
    reference.load_state_dict(state)
    ours = OpenClipModel(resolve_model_config(TINY_OPEN_CLIP)).eval()
    ours.load_state_dict(state)
    tokens, ends = tokenize(transformers.CLIPTokenizer.from_pretrained(assets["hpsv2"]["tokenizer"]), PROMPTS, 77)
    pixels = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(ours.encode_image(pixels), reference.encode_image(pixels))
        torch.testing.assert_close(ours.encode_text(tokens, ends), reference.encode_text(tokens))
