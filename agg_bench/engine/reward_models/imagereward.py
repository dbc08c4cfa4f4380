"""ImageReward (Xu et al., 2023): BLIP image-grounded text encoder + linear head, trained on human rankings.

The image goes through BLIP's ViT; the prompt goes through BLIP's BERT text encoder, which
cross-attends to the image tokens; the [CLS] output is scored by a stack of linear layers and
standardised with the fixed mean/std from the ImageReward release.

Why not the ``image-reward`` package: it pins ``timm==0.6.13`` (which needs torchvision, whose PyPI
wheels fail to import beside the CPU build of torch and then break ``from transformers import ...``),
imports OpenAI's ``clip`` package (not on PyPI), and its BLIP text encoder imports
``find_pruneable_heads_and_indices`` / ``apply_chunking_to_forward`` from ``transformers.modeling_utils``,
which transformers 5 no longer has. So the model is built here; tests/unit/test_reward_equality.py proves it
scores like transformers' BLIP (``BlipVisionModel`` + ``BlipTextModel``, the same architecture) with the
release's preprocessing, tokenizer call and head.

Images go through :class:`~agg_bench.engine.reward_models.common.ClipTransform` (the release's
``Resize(224, BICUBIC)``, ``CenterCrop(224)``, CLIP mean/std on PIL images); prompts are tokenized as the
release does: ``padding="max_length", truncation=True, max_length=35``.

The modules here use the parameter names of the public code, so ``ImageReward.pt`` loads without a
key mapping (``blip.visual_encoder.*``, ``blip.text_encoder.*``, ``mlp.layers.*``). Checkpoint entries
the score never uses are skipped: BLIP's pre-training projections ``blip.vision_proj`` /
``blip.text_proj`` and the ``position_ids`` index buffer.

Options:
- ``checkpoint``: ImageReward.pt (a state dict, read with ``weights_only=True``), or its tensors as
  ``.safetensors``.
- ``tokenizer``: folder with the bert-base-uncased tokenizer files (BLIP's tokenizer; the two extra
  tokens BLIP adds never occur in prompts).
- ``med_config``: BLIP's ``med_config.json`` (path or dict); defaults to the BERT-base values of the release.
- ``vision_config``: dict overriding the ViT size (``image_size``, ``patch_size``, ``width``, ``layers``,
  ``heads``); defaults to BLIP's ViT-L/16 at 224 px.
- ``batch_size`` (16), ``dtype`` ("float32").
Extra: ``pip install 'agg-bench[imagereward]'``.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from ...errors import UserError, quote
from ...jsonfiles import read_json_object
from ...config.reward_options import reward_options
from .common import (ClipTransform, feature_dtype, LinearStack, load_pretrained,
                     load_state_dict, load_weights, make_reward_fn, option_path, require_package, require_path,
                     reward_dtype)

REWARD = "imagereward"
CHECKPOINT = "the ImageReward state dict (ImageReward.pt, or .safetensors)"
TOKENIZER = "a folder with the bert-base-uncased tokenizer files (vocab.txt)"

# Standardisation of the raw head output, from the ImageReward release.
SCORE_MEAN = 0.16717362830052426
SCORE_STD = 1.0333394966054072
MAX_PROMPT_TOKENS = 35
IGNORED_KEYS = ("blip.vision_proj.", "blip.text_proj.", "blip.text_encoder.embeddings.position_ids")


@dataclass
class VisionConfig:
    """BLIP ViT size; the defaults are ImageReward's ViT-L/16 at 224 px."""

    image_size: int = 224
    patch_size: int = 16
    width: int = 1024
    layers: int = 24
    heads: int = 16


@dataclass
class TextConfig:
    """The ``med_config.json`` fields the text encoder uses; the defaults are those of the release."""

    vocab_size: int = 30524
    hidden_size: int = 768
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    intermediate_size: int = 3072
    max_position_embeddings: int = 512
    layer_norm_eps: float = 1e-12
    pad_token_id: int = 0


def _config(cls, value, option: str, strict: bool):
    """``cls`` from a dict or JSON file; unknown fields are an error if ``strict``, else ignored."""
    if value is None:
        return cls()
    if isinstance(value, (str, Path)):
        path = option_path(REWARD, option, value, "a JSON file", file=True)
        if not path.is_file():
            raise UserError(f"reward {REWARD!r}: reward.options.{option} = {quote(str(path))} does not exist; "
                            f"expected a JSON file")
        try:
            value = read_json_object(path, "a JSON object of BLIP's text-encoder fields (med_config.json)")
        except UserError as err:
            raise UserError(f"reward {REWARD!r}: reward.options.{option}: {err}") from None
    if not isinstance(value, dict):
        raise UserError(f"reward {REWARD!r}: reward.options.{option} must be a dict or a JSON file path")
    if value.get("hidden_act", "gelu") != "gelu":
        raise UserError(f"reward {REWARD!r}: reward.options.{option}.hidden_act must be 'gelu', "
                        f"got {value['hidden_act']!r}")
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(value) - known)
    if strict and unknown:
        raise UserError(f"reward {REWARD!r}: reward.options.{option} has unsupported fields {unknown}; "
                        f"expected some of {sorted(known)}")
    return cls(**{k: v for k, v in value.items() if k in known})


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int,
               mask: torch.Tensor | None = None) -> torch.Tensor:
    """Multi-head attention on (B, L, D) projections; ``mask`` (B, Lk) is True for keys to attend to."""
    b, lq, d = q.shape
    split = lambda t: t.view(b, t.shape[1], heads, d // heads).transpose(1, 2)
    mask = None if mask is None else mask[:, None, None, :]
    out = F.scaled_dot_product_attention(split(q), split(k), split(v), attn_mask=mask)
    return out.transpose(1, 2).reshape(b, lq, d)


# --- BLIP vision transformer (timm-style names: patch_embed, cls_token, pos_embed, blocks, norm) ---

class PatchEmbed(nn.Module):
    def __init__(self, patch_size: int, width: int):
        super().__init__()
        self.proj = nn.Conv2d(3, width, kernel_size=patch_size, stride=patch_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x).flatten(2).transpose(1, 2)


class VitAttention(nn.Module):
    def __init__(self, width: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        return self.proj(_attention(q, k, v, self.heads))


class VitMlp(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.fc1 = nn.Linear(width, 4 * width)
        self.fc2 = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class VitBlock(nn.Module):
    def __init__(self, width: int, heads: int):
        super().__init__()
        self.norm1 = nn.LayerNorm(width, eps=1e-6)
        self.attn = VitAttention(width, heads)
        self.norm2 = nn.LayerNorm(width, eps=1e-6)
        self.mlp = VitMlp(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class VisionEncoder(nn.Module):
    """BLIP's ViT: all output tokens (B, 1 + patches, width), layer-normed."""

    def __init__(self, cfg: VisionConfig):
        super().__init__()
        patches = (cfg.image_size // cfg.patch_size) ** 2
        self.patch_embed = PatchEmbed(cfg.patch_size, cfg.width)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, cfg.width))
        self.pos_embed = nn.Parameter(torch.zeros(1, patches + 1, cfg.width))
        self.blocks = nn.ModuleList(VitBlock(cfg.width, cfg.heads) for _ in range(cfg.layers))
        self.norm = nn.LayerNorm(cfg.width, eps=1e-6)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        x = self.patch_embed(pixels)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1)
        x = x + self.pos_embed[:, :x.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.norm(x)


# --- BLIP text encoder (BERT with cross-attention to the image; names as in BLIP's med.py) ---

class BertEmbeddings(nn.Module):
    def __init__(self, cfg: TextConfig):
        super().__init__()
        self.word_embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size, padding_idx=cfg.pad_token_id)
        self.position_embeddings = nn.Embedding(cfg.max_position_embeddings, cfg.hidden_size)
        self.LayerNorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(ids.shape[1], device=ids.device)
        return self.LayerNorm(self.word_embeddings(ids) + self.position_embeddings(positions))


class BertSelfAttention(nn.Module):
    def __init__(self, cfg: TextConfig, context_width: int):
        super().__init__()
        self.heads = cfg.num_attention_heads
        self.query = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.key = nn.Linear(context_width, cfg.hidden_size)
        self.value = nn.Linear(context_width, cfg.hidden_size)

    def forward(self, x: torch.Tensor, context: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        return _attention(self.query(x), self.key(context), self.value(context), self.heads, mask)


class BertResidualOutput(nn.Module):
    """``LayerNorm(dense(h) + residual)``: BERT's SelfOutput and Output."""

    def __init__(self, d_in: int, cfg: TextConfig):
        super().__init__()
        self.dense = nn.Linear(d_in, cfg.hidden_size)
        self.LayerNorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)

    def forward(self, h: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.dense(h) + residual)


class BertAttention(nn.Module):
    def __init__(self, cfg: TextConfig, context_width: int):
        super().__init__()
        self.self = BertSelfAttention(cfg, context_width)
        self.output = BertResidualOutput(cfg.hidden_size, cfg)

    def forward(self, x: torch.Tensor, context: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        return self.output(self.self(x, context, mask), x)


class BertIntermediate(nn.Module):
    def __init__(self, cfg: TextConfig):
        super().__init__()
        self.dense = nn.Linear(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(self.dense(x))


class BertLayer(nn.Module):
    def __init__(self, cfg: TextConfig, image_width: int):
        super().__init__()
        self.attention = BertAttention(cfg, cfg.hidden_size)
        self.crossattention = BertAttention(cfg, image_width)
        self.intermediate = BertIntermediate(cfg)
        self.output = BertResidualOutput(cfg.intermediate_size, cfg)

    def forward(self, x: torch.Tensor, mask: torch.Tensor, image_tokens: torch.Tensor) -> torch.Tensor:
        x = self.attention(x, x, mask)
        x = self.crossattention(x, image_tokens, None)
        return self.output(self.intermediate(x), x)


class BertEncoder(nn.Module):
    def __init__(self, cfg: TextConfig, image_width: int):
        super().__init__()
        self.layer = nn.ModuleList(BertLayer(cfg, image_width) for _ in range(cfg.num_hidden_layers))


class TextEncoder(nn.Module):
    """Bidirectional BERT whose every layer cross-attends to the image tokens; returns all hidden states."""

    def __init__(self, cfg: TextConfig, image_width: int):
        super().__init__()
        self.embeddings = BertEmbeddings(cfg)
        self.encoder = BertEncoder(cfg, image_width)

    def forward(self, ids: torch.Tensor, mask: torch.Tensor, image_tokens: torch.Tensor) -> torch.Tensor:
        x = self.embeddings(ids)
        for layer in self.encoder.layer:
            x = layer(x, mask, image_tokens)
        return x


class Blip(nn.Module):
    def __init__(self, vision: VisionConfig, text: TextConfig):
        super().__init__()
        self.visual_encoder = VisionEncoder(vision)
        self.text_encoder = TextEncoder(text, vision.width)


class ImageRewardModel(nn.Module):
    """``blip`` + ``mlp`` as in ImageReward.pt; :meth:`forward` returns standardised scores (B,)."""

    def __init__(self, vision: VisionConfig, text: TextConfig):
        super().__init__()
        self.blip = Blip(vision, text)
        self.mlp = LinearStack([text.hidden_size, 1024, 128, 64, 16, 1], [0, 2, 4, 6, 7])

    def forward(self, pixels: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        image_tokens = self.blip.visual_encoder(pixels)
        cls = self.blip.text_encoder(ids, mask, image_tokens)[:, 0]
        head = self.mlp.layers[0].weight.dtype
        return (self.mlp(cls.to(head)).squeeze(-1) - SCORE_MEAN) / SCORE_STD


def build(options: dict, device):
    options = reward_options(REWARD, options)
    transformers = require_package(REWARD, "transformers")
    checkpoint = require_path(REWARD, options, "checkpoint", CHECKPOINT)
    tokenizer_dir = require_path(REWARD, options, "tokenizer", TOKENIZER)
    vision = _config(VisionConfig, options.get("vision_config"), "vision_config", strict=True)
    text = _config(TextConfig, options.get("med_config"), "med_config", strict=False)
    device, dtype = torch.device(device), reward_dtype(options)

    model = ImageRewardModel(vision, text).to(dtype)  # cast before loading, so weights are rounded only once
    model.mlp.to(feature_dtype(dtype))  # the head runs in float32 as in the release (float64 for a float64 model)
    load_weights(REWARD, model, load_state_dict(REWARD, checkpoint, CHECKPOINT), checkpoint, ignore=IGNORED_KEYS,
                 what=CHECKPOINT)
    model.to(device=device).eval().requires_grad_(False)
    tokenizer = load_pretrained(REWARD, transformers.BertTokenizer, tokenizer_dir, TOKENIZER)
    preprocess = ClipTransform(vision.image_size, vision.image_size)

    def score_batch(images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        tokens = tokenizer(prompts, padding="max_length", truncation=True, max_length=MAX_PROMPT_TOKENS,
                           return_tensors="pt").to(device)
        return model(preprocess(images).to(dtype), tokens["input_ids"], tokens["attention_mask"].bool())

    return make_reward_fn(score_batch, options, device)
