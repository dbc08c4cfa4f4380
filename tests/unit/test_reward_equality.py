"""Each learned reward scores like its reference implementation, preprocessing and tokenization included.

The packages the models ship with cannot be installed with the pinned stack (hpsv2 pins pytest 7.2;
open-clip-torch, hpsv2 and image-reward need torchvision, whose PyPI wheels do not load beside the CPU
build of torch and then break transformers' imports; image-reward also needs OpenAI's ``clip`` and
transformers-4 internals). The references are therefore:

- the models: transformers' own classes (``CLIPModel``, ``BlipVisionModel``, ``BlipTextModel``), the
  same architectures the original checkpoints are converted to, with seeded random weights; the
  checkpoint the reward loads is written from them in the released layout (tests/reward_assets.py);
- the image transforms: transformers' PIL ``CLIPImageProcessorPil`` for PickScore, and torchvision's
  published eval transform (resize, center crop, ToTensor, Normalize; see
  :func:`reward_assets.torchvision_eval_transform`) with transformers' copy of OpenAI's statistics for
  the rest;
- the tokenizer calls and score formulas of each release's README / scoring code.

Tolerance: both paths run in float64 (the reward with ``dtype: float64`` returns float64 scores) from
identical float32 pixel values (the transforms are bit-identical by construction: the same PIL calls and
the same float32 arithmetic), so they differ only by float64 rounding in the networks: a few hundred
sums of products at eps 1.1e-16 each, ~1e-13 relative at most. ``rtol=1e-10`` (well inside the 1e-6
asked of the rewards) bounds that on any CPU and thread count, and still fails on any float32 step,
such as weights rounded to float32 on loading (~1e-7).

Images have odd sizes (wide, tall and smaller than the model's input, with odd crop margins where
torchvision's rounding differs from flooring); one prompt is longer than the text context.
"""
from __future__ import annotations

import copy
import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from reward_assets import (TINY_MED, TINY_OPEN_CLIP, TINY_VIT, hf_blip_to_image_reward,
                           hf_clip_to_open_clip, image_reward_mlp, randomize, tiny_hf_blip, tiny_hf_clip,
                           torchvision_eval_transform, write_bert_tokenizer, write_clip_tokenizer)
from transformers.image_utils import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD

from agg_bench.engine.rewards import build_reward, to_uint8
from helpers import seeded

RTOL = 1e-10
# (height, width): wide with a crop margin of 3 after resizing (torchvision starts the crop at 2, a floor
# at 1), tall with a margin of 19 (10 vs 9), and smaller than the 32-pixel input (upscaled).
SIZES = [(37, 41), (75, 47), (21, 29)]
LONG_PROMPT = " ".join(["a red cat on the grass"] * 12)  # well past 77 CLIP tokens and 35 BERT tokens
PROMPTS = ["a red cat", LONG_PROMPT, "the dog", "red"]


def image_batches():
    """(images, prompts) per size: a few images in [0, 1] with a prompt each."""
    gen = torch.Generator().manual_seed(seeded(11))
    for height, width in SIZES:
        yield torch.rand(len(PROMPTS), 3, height, width, generator=gen), PROMPTS


def pil_images(images: torch.Tensor):
    from PIL import Image

    return [Image.fromarray(arr) for arr in to_uint8(images)]


def openai_pixels(images: torch.Tensor, size: int) -> torch.Tensor:
    """The torchvision eval transform with OpenAI CLIP statistics, as float64 model input."""
    return torch.stack([torchvision_eval_transform(im, size, OPENAI_CLIP_MEAN, OPENAI_CLIP_STD)
                        for im in pil_images(images)]).to(torch.float64)


def assert_scores_equal(ours: torch.Tensor, expected: torch.Tensor):
    assert ours.shape == expected.shape
    # scores of random models are never exactly 0, so a match of zeros (a vacuous check) is excluded
    assert expected.numel() == 0 or expected.abs().min() > 0
    assert ours.dtype == torch.float64
    torch.testing.assert_close(ours, expected, rtol=RTOL, atol=0)


@pytest.fixture(scope="module")
def clip_assets(tmp_path_factory):
    """A tiny float64 CLIPModel with its tokenizer, saved as a transformers folder (PickScore's format)."""
    root = tmp_path_factory.mktemp("clip_equality")
    tokenizer = write_clip_tokenizer(root / "clip")
    model = tiny_hf_clip(tokenizer, seed=21)
    model.save_pretrained(str(root / "clip"))
    processor = transformers.CLIPImageProcessorPil(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    processor.save_pretrained(str(root / "clip"))
    return root, model, tokenizer, processor


def test_tokenizer_truncates_the_long_prompt(clip_assets, tmp_path):
    """The long prompt really is longer than both contexts, so truncation is exercised below."""
    _, _, clip_tokenizer, _ = clip_assets
    assert len(clip_tokenizer(LONG_PROMPT)["input_ids"]) > TINY_OPEN_CLIP["text_cfg"]["context_length"]
    bert = write_bert_tokenizer(tmp_path / "bert")
    assert len(bert(LONG_PROMPT)["input_ids"]) > 35


def test_pickscore_equals_transformers_clip(clip_assets):
    """PickScore as its README computes it: ``AutoProcessor`` (the PIL CLIP processor) on PIL images, text with
    ``padding=True, truncation=True, max_length=77``, score ``logit_scale.exp() * cos`` = CLIPModel's logits."""
    root, model, tokenizer, processor = clip_assets
    reward = build_reward("pickscore", {"model": str(root / "clip"), "dtype": "float64"}, "cpu")
    for images, prompts in image_batches():
        pixels = processor(images=pil_images(images), return_tensors="pt")["pixel_values"].to(torch.float64)
        text = tokenizer(prompts, padding=True, truncation=True, max_length=77, return_tensors="pt")
        with torch.no_grad():
            logits = model(pixel_values=pixels, **text).logits_per_image
        assert_scores_equal(reward(images, prompts), logits.diagonal())


def test_clipscore_equals_transformers_clip(clip_assets, tmp_path):
    """CLIPScore (Hessel et al.): ``2.5 * max(cos, 0)`` with OpenAI CLIP's image transform. The model is scored
    as saved and with its text projection negated (every cosine flips sign), so that each image-prompt pair is
    checked once on the linear side of the clamp and once at the clamp."""
    root, model, tokenizer, processor = clip_assets
    flipped = copy.deepcopy(model)
    with torch.no_grad():
        flipped.text_projection.weight.neg_()
    flipped.save_pretrained(str(tmp_path / "flipped"))
    tokenizer.save_pretrained(str(tmp_path / "flipped"))
    processor.save_pretrained(str(tmp_path / "flipped"))
    for clip, folder in ((model, root / "clip"), (flipped, tmp_path / "flipped")):
        reward = build_reward("clipscore", {"model": str(folder), "dtype": "float64"}, "cpu")
        for images, prompts in image_batches():
            text = tokenizer(prompts, padding=True, truncation=True, max_length=77, return_tensors="pt")
            with torch.no_grad():
                out = clip(pixel_values=openai_pixels(images, 32), **text)
            cosine = (out.image_embeds * out.text_embeds).sum(-1)
            positive = cosine > 0
            ours = reward(images, prompts)
            assert_scores_equal(ours[positive], 2.5 * cosine[positive])
            assert torch.equal(ours[~positive], torch.zeros_like(ours[~positive]))


def test_aesthetic_equals_laion_predictor(clip_assets, tmp_path):
    """LAION's improved aesthetic predictor: OpenAI CLIP transform, L2-normalised image embedding, MLP head."""
    root, model, _, _ = clip_assets
    head = image_reward_mlp(TINY_OPEN_CLIP["embed_dim"], seed=22)
    torch.save(head.state_dict(), tmp_path / "sac+logos+ava1-l14-linearMSE.pth")
    reward = build_reward("aesthetic", {"model": str(root / "clip"), "dtype": "float64",
                                        "head": str(tmp_path / "sac+logos+ava1-l14-linearMSE.pth")}, "cpu")
    for images, prompts in image_batches():
        with torch.no_grad():
            embedding = model.get_image_features(pixel_values=openai_pixels(images, 32))
            embedding = getattr(embedding, "pooler_output", embedding)
            expected = head(embedding / embedding.norm(dim=-1, keepdim=True)).squeeze(-1)
        assert_scores_equal(reward(images, prompts), expected)


def test_hpsv2_equals_clip_in_open_clip_layout(clip_assets, tmp_path):
    """HPSv2: the CLIP weights converted to OpenCLIP's layout (as HPS_v2.1_compressed.pt stores them, under
    ``state_dict``) score ``cos(image, text)`` like transformers' CLIP on OpenCLIP's eval transform, with
    text truncated at 77 tokens (start + 75 + end)."""
    root, model, tokenizer, _ = clip_assets
    torch.save({"epoch": 1, "state_dict": hf_clip_to_open_clip(model)}, tmp_path / "HPS_v2.1_compressed.pt")
    reward = build_reward("hpsv2", {"checkpoint": str(tmp_path / "HPS_v2.1_compressed.pt"),
                                    "tokenizer": str(root / "clip"), "model_config": TINY_OPEN_CLIP,
                                    "dtype": "float64"}, "cpu")
    for images, prompts in image_batches():
        text = tokenizer(prompts, padding="max_length", truncation=True, max_length=77, return_tensors="pt")
        with torch.no_grad():
            out = model(pixel_values=openai_pixels(images, 32), **text)
        assert_scores_equal(reward(images, prompts), (out.image_embeds * out.text_embeds).sum(-1))


def test_imagereward_equals_blip(tmp_path):
    """ImageReward as its ``score`` method computes it: BLIP ViT on the release's transform, BERT with
    cross-attention on ``padding="max_length", truncation=True, max_length=35``, the [CLS] state through the
    MLP head, standardised with the release's mean and std."""
    vision, text = tiny_hf_blip(seed=31)
    mlp = image_reward_mlp(TINY_MED["hidden_size"], seed=33)
    torch.save(hf_blip_to_image_reward(vision, text, mlp), tmp_path / "ImageReward.pt")
    (tmp_path / "med_config.json").write_text(json.dumps(TINY_MED))
    tokenizer = write_bert_tokenizer(tmp_path / "bert")
    reward = build_reward("imagereward", {"checkpoint": str(tmp_path / "ImageReward.pt"),
                                          "tokenizer": str(tmp_path / "bert"),
                                          "med_config": str(tmp_path / "med_config.json"),
                                          "vision_config": TINY_VIT, "dtype": "float64"}, "cpu")
    release_mean, release_std = 0.16717362830052426, 1.0333394966054072  # ImageReward.py of the release
    for images, prompts in image_batches():
        tokens = tokenizer(prompts, padding="max_length", truncation=True, max_length=35, return_tensors="pt")
        with torch.no_grad():
            image_embeds = vision(pixel_values=openai_pixels(images, TINY_VIT["image_size"])).last_hidden_state
            hidden = text(input_ids=tokens["input_ids"], attention_mask=tokens["attention_mask"],
                          encoder_hidden_states=image_embeds,
                          encoder_attention_mask=torch.ones(image_embeds.shape[:-1], dtype=torch.long)
                          ).last_hidden_state
            expected = (mlp(hidden[:, 0]).squeeze(-1) - release_mean) / release_std
        assert_scores_equal(reward(images, prompts), expected)


def test_hpsv2_equals_open_clip_package(tmp_path):
    """Where open-clip-torch imports (it needs a torchvision that loads beside torch, e.g. torch 2.14.1 with
    torchvision 0.29.1; not the pinned CPU stack, where this test is skipped): OpenCLIP's own ``CLIP`` class,
    its eval transform and its tokenizer with the real BPE vocabulary, against the hpsv2 reward given that
    vocabulary as transformers tokenizer files."""
    open_clip = pytest.importorskip("open_clip")
    import gzip

    cfg = {**TINY_OPEN_CLIP, "text_cfg": {**TINY_OPEN_CLIP["text_cfg"], "vocab_size": 49408}}
    model = randomize(open_clip.model.CLIP(**cfg).double().eval(), seed=41)
    torch.save({"state_dict": model.state_dict()}, tmp_path / "HPS_v2.1_compressed.pt")
    simple = open_clip.tokenizer.SimpleTokenizer()
    specials = {"<start_of_text>": "<|startoftext|>", "<end_of_text>": "<|endoftext|>"}  # same ids, HF spelling
    (tmp_path / "tok").mkdir()
    (tmp_path / "tok" / "vocab.json").write_text(json.dumps({specials.get(k, k): v for k, v in simple.encoder.items()}))
    merges = gzip.open(open_clip.tokenizer.default_bpe()).read().decode("utf-8").split("\n")[1:49152 - 256 - 2 + 1]
    (tmp_path / "tok" / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n")
    reward = build_reward("hpsv2", {"checkpoint": str(tmp_path / "HPS_v2.1_compressed.pt"),
                                    "tokenizer": str(tmp_path / "tok"), "model_config": cfg, "dtype": "float64"}, "cpu")
    transform, tokenize = open_clip.transform.image_transform(32, is_train=False), open_clip.get_tokenizer("ViT-H-14")
    prompts = ["A Red cat, on the grass!", " ".join(["A photo of a red cat; high-quality & detailed."] * 8), "dog"]
    gen = torch.Generator().manual_seed(seeded(42))
    for height, width in SIZES + [(333, 1001)]:
        images = torch.rand(len(prompts), 3, height, width, generator=gen)
        pixels = torch.stack([transform(im) for im in pil_images(images)]).to(torch.float64)
        with torch.no_grad():
            expected = (model.encode_image(pixels, normalize=True)
                        * model.encode_text(tokenize(prompts), normalize=True)).sum(-1)
        assert_scores_equal(reward(images, prompts), expected)
