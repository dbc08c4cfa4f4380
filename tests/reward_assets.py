"""Tiny reward-model assets for the tests: tokenizers with small vocabularies, seeded random weights,
and the weight-layout conversions between transformers' CLIP / BLIP and the checkpoints users have.

Nothing is downloaded: every vocabulary and weight is made here.
"""
from __future__ import annotations

import json
import string
from pathlib import Path

import numpy as np
import torch
import transformers
from PIL import Image
from torch import nn

from helpers import seeded

# Tiny OpenCLIP config in the JSON layout of open_clip's model_configs/ (ViT-H-14 has the same fields).
TINY_OPEN_CLIP = {
    "embed_dim": 16,
    "vision_cfg": {"image_size": 32, "layers": 2, "width": 32, "head_width": 8, "patch_size": 8},
    "text_cfg": {"context_length": 77, "vocab_size": 64, "width": 32, "heads": 4, "layers": 2},
}
# The same model as a transformers CLIPConfig: OpenCLIP's ViT-H-14 uses exact GELU and LayerNorm eps 1e-5.
TINY_HF_VISION = dict(hidden_size=32, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      image_size=32, patch_size=8, hidden_act="gelu", layer_norm_eps=1e-5)
TINY_HF_TEXT = dict(vocab_size=64, hidden_size=32, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                    max_position_embeddings=77, hidden_act="gelu", layer_norm_eps=1e-5)
TINY_VIT = {"image_size": 32, "patch_size": 8, "width": 32, "layers": 2, "heads": 4}
# A med_config.json as BLIP ships it (BERT fields plus cross-attention), at a tiny size.
TINY_MED = {"architectures": ["BertModel"], "attention_probs_dropout_prob": 0.1, "hidden_act": "gelu",
            "hidden_dropout_prob": 0.1, "hidden_size": 32, "initializer_range": 0.02, "intermediate_size": 64,
            "layer_norm_eps": 1e-12, "max_position_embeddings": 40, "model_type": "bert",
            "num_attention_heads": 4, "num_hidden_layers": 2, "pad_token_id": 0, "type_vocab_size": 2,
            "vocab_size": 66, "encoder_width": 32, "add_cross_attention": True}


def randomize(module: nn.Module, seed: int, std: float = 0.2) -> nn.Module:
    """Fill every parameter with seeded N(0, std) noise (zero-initialised weights would give constant scores)."""
    gen = torch.Generator().manual_seed(seeded(seed))
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float64).to(p.dtype) * std)
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


def write_bert_tokenizer(folder: Path) -> transformers.BertTokenizer:
    """An uncased BERT WordPiece tokenizer with BLIP's two added tokens ([DEC] as bos, [ENC])."""
    folder.mkdir(parents=True, exist_ok=True)
    words = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *string.ascii_lowercase,
             *("##" + c for c in string.ascii_lowercase), "a", "red", "cat", "dog", "the"]
    (folder / "vocab.txt").write_text("\n".join(dict.fromkeys(words)) + "\n")
    tokenizer = transformers.BertTokenizer.from_pretrained(str(folder))
    tokenizer.add_special_tokens({"bos_token": "[DEC]", "additional_special_tokens": ["[ENC]"]})
    tokenizer.save_pretrained(str(folder))
    return tokenizer


def tiny_hf_clip(tokenizer: transformers.CLIPTokenizer, seed: int, dtype=torch.float64) -> transformers.CLIPModel:
    """A tiny transformers CLIPModel with seeded random weights (logit scale included)."""
    text = dict(TINY_HF_TEXT, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.pad_token_id)
    config = transformers.CLIPConfig(text_config=text, vision_config=TINY_HF_VISION,
                                     projection_dim=TINY_OPEN_CLIP["embed_dim"])
    model = transformers.CLIPModel(config).to(dtype).eval()
    randomize(model, seed)
    with torch.no_grad():
        model.logit_scale.fill_(np.log(100.0))  # CLIP's trained value, so scores are on the usual scale
    return model


def _tower_to_open_clip(hf: dict, hf_prefix: str, ours: str, layers: int) -> dict[str, torch.Tensor]:
    """One transformer tower: q/k/v projections fused into nn.MultiheadAttention's in_proj, names mapped."""
    out = {}
    for i in range(layers):
        src, dst = f"{hf_prefix}.encoder.layers.{i}", f"{ours}.resblocks.{i}"
        for part in ("weight", "bias"):
            out[f"{dst}.attn.in_proj_{part}"] = torch.cat(
                [hf[f"{src}.self_attn.{p}_proj.{part}"] for p in ("q", "k", "v")])
            for hf_name, our_name in (("self_attn.out_proj", "attn.out_proj"), ("layer_norm1", "ln_1"),
                                      ("layer_norm2", "ln_2"), ("mlp.fc1", "mlp.c_fc"), ("mlp.fc2", "mlp.c_proj")):
                out[f"{dst}.{our_name}.{part}"] = hf[f"{src}.{hf_name}.{part}"]
    return out


def hf_clip_to_open_clip(model: transformers.CLIPModel) -> dict[str, torch.Tensor]:
    """The state dict of ``model`` in OpenCLIP's layout (the layout of HPS_v2.1_compressed.pt).

    This is the correspondence used to convert OpenCLIP checkpoints to transformers (e.g.
    laion/CLIP-ViT-H-14-laion2B-s32B-b79K): projections are stored transposed, and the class token
    and positional embeddings are plain parameters.
    """
    hf = {k: v.detach().clone() for k, v in model.state_dict().items()}
    cfg = model.config
    out = {
        "visual.class_embedding": hf["vision_model.embeddings.class_embedding"],
        "visual.conv1.weight": hf["vision_model.embeddings.patch_embedding.weight"],
        "visual.positional_embedding": hf["vision_model.embeddings.position_embedding.weight"],
        "visual.proj": hf["visual_projection.weight"].T.contiguous(),
        "token_embedding.weight": hf["text_model.embeddings.token_embedding.weight"],
        "positional_embedding": hf["text_model.embeddings.position_embedding.weight"],
        "text_projection": hf["text_projection.weight"].T.contiguous(),
        "logit_scale": hf["logit_scale"],
    }
    for hf_name, our_name in (("vision_model.pre_layrnorm", "visual.ln_pre"),
                              ("vision_model.post_layernorm", "visual.ln_post"),
                              ("text_model.final_layer_norm", "ln_final")):
        for part in ("weight", "bias"):
            out[f"{our_name}.{part}"] = hf[f"{hf_name}.{part}"]
    out.update(_tower_to_open_clip(hf, "vision_model", "visual.transformer", cfg.vision_config.num_hidden_layers))
    out.update(_tower_to_open_clip(hf, "text_model", "transformer", cfg.text_config.num_hidden_layers))
    return out


def tiny_hf_blip(seed: int, dtype=torch.float64):
    """Tiny transformers BLIP towers (ViT with BLIP's LayerNorm eps 1e-6; BERT with cross-attention)."""
    from transformers.models.blip.modeling_blip_text import BlipTextModel

    vision = transformers.BlipVisionModel(transformers.BlipVisionConfig(
        hidden_size=TINY_VIT["width"], intermediate_size=4 * TINY_VIT["width"], num_hidden_layers=TINY_VIT["layers"],
        num_attention_heads=TINY_VIT["heads"], image_size=TINY_VIT["image_size"], patch_size=TINY_VIT["patch_size"],
        layer_norm_eps=1e-6, hidden_act="gelu"))
    text = BlipTextModel(transformers.BlipTextConfig(
        vocab_size=TINY_MED["vocab_size"], hidden_size=TINY_MED["hidden_size"], encoder_hidden_size=TINY_VIT["width"],
        intermediate_size=TINY_MED["intermediate_size"], num_hidden_layers=TINY_MED["num_hidden_layers"],
        num_attention_heads=TINY_MED["num_attention_heads"],
        max_position_embeddings=TINY_MED["max_position_embeddings"],
        layer_norm_eps=TINY_MED["layer_norm_eps"], hidden_act="gelu", pad_token_id=0, bos_token_id=None,
        sep_token_id=None, eos_token_id=None), add_pooling_layer=False)
    return randomize(vision.to(dtype).eval(), seed), randomize(text.to(dtype).eval(), seed + 1)


def image_reward_mlp(width: int, seed: int, dtype=torch.float64) -> nn.Module:
    """The ImageReward / LAION aesthetic head as released: linear layers with only dropout between them."""
    head = nn.Module()
    head.layers = nn.Sequential(nn.Linear(width, 1024), nn.Dropout(0.2), nn.Linear(1024, 128), nn.Dropout(0.2),
                                nn.Linear(128, 64), nn.Dropout(0.1), nn.Linear(64, 16), nn.Linear(16, 1))
    head.forward = head.layers.forward
    return randomize(head.to(dtype).eval(), seed, std=0.1)  # large enough that scores vary with the input


def hf_blip_to_image_reward(vision, text, mlp: nn.Module) -> dict[str, torch.Tensor]:
    """The state dict of ImageReward.pt from transformers' BLIP towers and the head.

    BLIP's text encoder and transformers' BlipTextModel share parameter names; the ViT maps
    timm-style (patch_embed, cls_token, pos_embed, blocks.<i>.norm1/attn/norm2/mlp, norm). Entries the
    score never uses are added as the release has them.
    """
    v = {k: t.detach().clone() for k, t in vision.state_dict().items()}
    out = {
        "blip.visual_encoder.cls_token": v["embeddings.class_embedding"],
        "blip.visual_encoder.pos_embed": v["embeddings.position_embedding"],
        "blip.visual_encoder.patch_embed.proj.weight": v["embeddings.patch_embedding.weight"],
        "blip.visual_encoder.patch_embed.proj.bias": v["embeddings.patch_embedding.bias"],
        "blip.visual_encoder.norm.weight": v["post_layernorm.weight"],
        "blip.visual_encoder.norm.bias": v["post_layernorm.bias"],
    }
    for i in range(vision.config.num_hidden_layers):
        for hf_name, our_name in (("self_attn.qkv", "attn.qkv"), ("self_attn.projection", "attn.proj"),
                                  ("layer_norm1", "norm1"), ("layer_norm2", "norm2"), ("mlp.fc1", "mlp.fc1"),
                                  ("mlp.fc2", "mlp.fc2")):
            for part in ("weight", "bias"):
                out[f"blip.visual_encoder.blocks.{i}.{our_name}.{part}"] = v[f"encoder.layers.{i}.{hf_name}.{part}"]
    out.update({f"blip.text_encoder.{k}": t.detach().clone() for k, t in text.state_dict().items()
                if k != "embeddings.position_ids"})
    out.update({f"mlp.{k}": t.detach().clone() for k, t in mlp.state_dict().items()})
    width = vision.config.hidden_size
    out.update({"blip.vision_proj.weight": torch.zeros(8, width), "blip.vision_proj.bias": torch.zeros(8),
                "blip.text_proj.weight": torch.zeros(8, width), "blip.text_proj.bias": torch.zeros(8),
                "blip.text_encoder.embeddings.position_ids": torch.arange(TINY_MED["max_position_embeddings"])[None]})
    return out


def torchvision_eval_transform(image: Image.Image, size: int, mean, std) -> torch.Tensor:
    """``Compose([Resize(size, BICUBIC), CenterCrop(size), ToTensor(), Normalize(mean, std)])`` on a PIL image.

    torchvision cannot be imported beside the CPU build of torch, so this follows its documented
    semantics: ``Resize(int)`` sets the shorter edge to ``size`` and the longer to
    ``int(size * long / short)`` and calls ``PIL.Image.resize`` (no call when the size is unchanged);
    ``CenterCrop`` cuts at ``int(round((h - size) / 2.0))``; ``ToTensor`` is uint8 -> float32 / 255;
    ``Normalize`` is ``(x - mean) / std`` in float32.
    """
    width, height = image.size
    if width <= height:
        new_width, new_height = size, int(size * height / width)
    else:
        new_width, new_height = int(size * width / height), size
    if (new_width, new_height) != image.size:
        image = image.resize((new_width, new_height), Image.BICUBIC)
    crop_top, crop_left = int(round((new_height - size) / 2.0)), int(round((new_width - size) / 2.0))
    image = image.crop((crop_left, crop_top, crop_left + size, crop_top + size))
    tensor = torch.from_numpy(np.array(image, dtype=np.uint8)).permute(2, 0, 1).contiguous().to(torch.float32) / 255
    mean = torch.as_tensor(mean, dtype=torch.float32).view(-1, 1, 1)
    std = torch.as_tensor(std, dtype=torch.float32).view(-1, 1, 1)
    return (tensor - mean) / std
