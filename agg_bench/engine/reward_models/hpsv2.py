"""HPSv2 / HPSv2.1 (Wu et al., 2023): human preference score from a fine-tuned OpenCLIP ViT-H-14.

Score = cosine of the L2-normalised image and text embeddings, the quantity the HPSv2 README reports
(about 0.2-0.35; no logit scale is applied).

Why not the packages the model ships with: ``hpsv2`` pins ``pytest==7.2.0`` (this project pins pytest 9)
and, like ``open-clip-torch``, needs torchvision. PyPI's torchvision wheels are linked against the CUDA
build of torch: beside the CPU build they fail to import ("operator torchvision::nms does not exist"),
and once installed they also break ``from transformers import CLIPModel``, which the other rewards need.
So the model is built here in OpenCLIP's layout (same module names, so the HPS ``.pt`` state dict loads
as is). tests/unit/test_reward_equality.py proves it scores like transformers' CLIP (the same architecture,
used by the HF conversions of OpenCLIP checkpoints) fed OpenCLIP's published preprocessing.

Images go through :class:`~agg_bench.engine.reward_models.common.ClipTransform` (OpenCLIP's eval transform:
PIL bicubic resize, torchvision center crop, CLIP mean/std). Text is tokenized with a transformers
``CLIPTokenizer`` (OpenCLIP's ViT-H-14 uses the same BPE vocabulary) and laid out like OpenCLIP: start
token, up to ``context_length - 2`` tokens, end token, zero padding; the text embedding is read at the
end token.

Options:
- ``checkpoint``: the HPS state dict, HPS_v2.1_compressed.pt or HPS_v2_compressed.pt (tensors, possibly
  under ``"state_dict"``, read with ``weights_only=True``), or the same tensors as ``.safetensors``.
- ``tokenizer``: folder with CLIP tokenizer files (e.g. a local copy of laion/CLIP-ViT-H-14-laion2B-s32B-b79K
  or openai/clip-vit-large-patch14).
- ``model_config``: "ViT-H-14" (default), or an OpenCLIP model config as a dict or a JSON file
  (``embed_dim``, ``vision_cfg``, ``text_cfg``, optional ``quick_gelu``).
- ``batch_size`` (16), ``dtype`` ("float32").
Extra: ``pip install 'agg-bench[hpsv2]'``.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, fields

import torch
import torch.nn.functional as F
from torch import nn

from ...errors import UserError
from ...jsonfiles import read_json_object
from ...config.reward_options import CLIP_TOKENIZER, reward_options
from .common import (CLIP_MEAN, CLIP_STD, ClipTransform, feature_dtype, load_pretrained,
                     load_state_dict, load_weights, make_reward_fn, option_path, require_package, require_path,
                     reward_dtype)

REWARD = "hpsv2"
CHECKPOINT = "the HPSv2 state dict (HPS_v2.1_compressed.pt, or .safetensors)"
TOKENIZER = CLIP_TOKENIZER

MODEL_CONFIGS = {
    "ViT-H-14": {
        "embed_dim": 1024,
        "vision_cfg": {"image_size": 224, "layers": 32, "width": 1280, "head_width": 80, "patch_size": 14},
        "text_cfg": {"context_length": 77, "vocab_size": 49408, "width": 1024, "heads": 16, "layers": 24},
    },
}


@dataclass
class VisionConfig:
    """OpenCLIP ``vision_cfg`` fields this module supports (others are rejected)."""

    image_size: int = 224
    patch_size: int = 16
    width: int = 768
    layers: int = 12
    head_width: int = 64
    mlp_ratio: float = 4.0


@dataclass
class TextConfig:
    """OpenCLIP ``text_cfg`` fields this module supports (others are rejected)."""

    context_length: int = 77
    vocab_size: int = 49408
    width: int = 512
    heads: int = 8
    layers: int = 12
    mlp_ratio: float = 4.0


@dataclass
class OpenClipConfig:
    """A whole OpenCLIP model config: tower sizes, activation and the image statistics."""

    embed_dim: int
    vision: VisionConfig
    text: TextConfig
    quick_gelu: bool = False
    image_mean: tuple[float, float, float] = CLIP_MEAN
    image_std: tuple[float, float, float] = CLIP_STD


# OpenCLIP config fields with no effect at inference.
_INFERENCE_NOOPS = {"patch_dropout"}


def _parse(cls, section: str, values: dict):
    known = {f.name for f in fields(cls)}
    values = {k: v for k, v in values.items() if k not in _INFERENCE_NOOPS}
    unknown = sorted(set(values) - known)
    if unknown:
        raise UserError(f"reward {REWARD!r}: reward.options.model_config.{section} has unsupported fields "
                        f"{unknown}")
    return cls(**values)


def resolve_model_config(value) -> OpenClipConfig:
    """The config named by ``value``: a model name, an OpenCLIP config dict or a JSON file (None: ViT-H-14)."""
    if value is None:
        value = "ViT-H-14"
    if isinstance(value, str) and value in MODEL_CONFIGS:
        value = MODEL_CONFIGS[value]
    elif isinstance(value, str):
        path = option_path(REWARD, "model_config", value, f"one of {sorted(MODEL_CONFIGS)} or a JSON file",
                           file=True)
        if not path.is_file():
            raise UserError(f"reward {REWARD!r}: reward.options.model_config = {value!r} is neither one of "
                            f"{sorted(MODEL_CONFIGS)} nor an existing JSON file")
        try:
            value = read_json_object(path, "an OpenCLIP model config (a JSON object with embed_dim, vision_cfg "
                                           "and text_cfg)")
        except UserError as err:
            raise UserError(f"reward {REWARD!r}: reward.options.model_config: {err}") from None
    if not isinstance(value, dict) or "embed_dim" not in value:
        raise UserError(f"reward {REWARD!r}: reward.options.model_config must be a model name, or a dict or "
                        f"JSON file with embed_dim, vision_cfg and text_cfg")
    unknown = sorted(set(value) - {"embed_dim", "vision_cfg", "text_cfg", "quick_gelu", "preprocess_cfg"})
    if unknown:
        raise UserError(f"reward {REWARD!r}: reward.options.model_config has unsupported fields {unknown}")
    preprocess = value.get("preprocess_cfg", {})
    return OpenClipConfig(
        embed_dim=int(value["embed_dim"]),
        vision=_parse(VisionConfig, "vision_cfg", dict(value.get("vision_cfg", {}))),
        text=_parse(TextConfig, "text_cfg", dict(value.get("text_cfg", {}))),
        quick_gelu=bool(value.get("quick_gelu", False)),
        image_mean=tuple(preprocess.get("mean", CLIP_MEAN)),
        image_std=tuple(preprocess.get("std", CLIP_STD)),
    )


class QuickGELU(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.sigmoid(1.702 * x)


class ResidualAttentionBlock(nn.Module):
    """Pre-norm transformer block with OpenCLIP's parameter names (ln_1, attn, ln_2, mlp.c_fc, mlp.c_proj)."""

    def __init__(self, width: int, heads: int, mlp_ratio: float, act: type[nn.Module]):
        super().__init__()
        hidden = int(width * mlp_ratio)
        self.ln_1 = nn.LayerNorm(width)
        self.attn = nn.MultiheadAttention(width, heads, batch_first=True)
        self.ln_2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(
            OrderedDict(c_fc=nn.Linear(width, hidden), gelu=act(), c_proj=nn.Linear(hidden, width)))

    def forward(self, x: torch.Tensor, attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        h = self.ln_1(x)
        x = x + self.attn(h, h, h, attn_mask=attn_mask, need_weights=False)[0]
        return x + self.mlp(self.ln_2(x))


class Transformer(nn.Module):
    def __init__(self, width: int, layers: int, heads: int, mlp_ratio: float, act: type[nn.Module]):
        super().__init__()
        self.resblocks = nn.ModuleList(
            ResidualAttentionBlock(width, heads, mlp_ratio, act) for _ in range(layers))

    def forward(self, x: torch.Tensor, attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        for block in self.resblocks:
            x = block(x, attn_mask)
        return x


class VisionTower(nn.Module):
    """ViT with a class token; the embedding is the projected, layer-normed class token."""

    def __init__(self, cfg: VisionConfig, embed_dim: int, act: type[nn.Module]):
        super().__init__()
        grid = cfg.image_size // cfg.patch_size
        self.conv1 = nn.Conv2d(3, cfg.width, kernel_size=cfg.patch_size, stride=cfg.patch_size, bias=False)
        self.class_embedding = nn.Parameter(torch.zeros(cfg.width))
        self.positional_embedding = nn.Parameter(torch.zeros(grid * grid + 1, cfg.width))
        self.ln_pre = nn.LayerNorm(cfg.width)
        self.transformer = Transformer(cfg.width, cfg.layers, cfg.width // cfg.head_width, cfg.mlp_ratio, act)
        self.ln_post = nn.LayerNorm(cfg.width)
        self.proj = nn.Parameter(torch.zeros(cfg.width, embed_dim))

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        x = self.conv1(pixels).flatten(2).transpose(1, 2)
        cls = self.class_embedding.to(x.dtype).expand(x.shape[0], 1, -1)
        x = torch.cat([cls, x], dim=1) + self.positional_embedding.to(x.dtype)
        x = self.transformer(self.ln_pre(x))
        return self.ln_post(x[:, 0]) @ self.proj


class OpenClipModel(nn.Module):
    """CLIP in OpenCLIP's state-dict layout: ``visual.*`` plus the text tower at the top level."""

    def __init__(self, cfg: OpenClipConfig):
        super().__init__()
        act = QuickGELU if cfg.quick_gelu else nn.GELU
        embed_dim, text = cfg.embed_dim, cfg.text
        self.visual = VisionTower(cfg.vision, embed_dim, act)
        self.token_embedding = nn.Embedding(text.vocab_size, text.width)
        self.positional_embedding = nn.Parameter(torch.zeros(text.context_length, text.width))
        self.transformer = Transformer(text.width, text.layers, text.heads, text.mlp_ratio, act)
        self.ln_final = nn.LayerNorm(text.width)
        self.text_projection = nn.Parameter(torch.zeros(text.width, embed_dim))
        self.logit_scale = nn.Parameter(torch.zeros(()))
        causal = torch.full((text.context_length, text.context_length), float("-inf")).triu(1)
        self.register_buffer("attn_mask", causal, persistent=False)

    def encode_image(self, pixels: torch.Tensor) -> torch.Tensor:
        return self.visual(pixels)

    def encode_text(self, tokens: torch.Tensor, end_positions: torch.Tensor) -> torch.Tensor:
        """Text embeddings read at ``end_positions`` (the end token of each row)."""
        x = self.token_embedding(tokens) + self.positional_embedding.to(self.token_embedding.weight.dtype)
        x = self.ln_final(self.transformer(x, self.attn_mask.to(x.dtype)))
        return x[torch.arange(x.shape[0], device=x.device), end_positions] @ self.text_projection


def tokenize(tokenizer, prompts: list[str], context_length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """OpenCLIP-style token ids (B, context_length), zero padded, and the end-token position of each row."""
    rows = tokenizer(prompts, truncation=True, max_length=context_length)["input_ids"]
    tokens = torch.zeros(len(rows), context_length, dtype=torch.long)
    for i, row in enumerate(rows):
        tokens[i, :len(row)] = torch.tensor(row)
    return tokens, torch.tensor([len(row) - 1 for row in rows])


def build(options: dict, device):
    options = reward_options(REWARD, options)
    transformers = require_package(REWARD, "transformers")
    checkpoint = require_path(REWARD, options, "checkpoint", CHECKPOINT)
    tokenizer_dir = require_path(REWARD, options, "tokenizer", TOKENIZER)
    cfg = resolve_model_config(options.get("model_config"))
    device, dtype = torch.device(device), reward_dtype(options)

    model = OpenClipModel(cfg).to(dtype)  # cast before loading, so float64 weights stay float64
    load_weights(REWARD, model, load_state_dict(REWARD, checkpoint, CHECKPOINT), checkpoint, what=CHECKPOINT)
    model.to(device=device).eval().requires_grad_(False)
    tokenizer = load_pretrained(REWARD, transformers.CLIPTokenizer, tokenizer_dir, TOKENIZER)
    image_size = cfg.vision.image_size
    preprocess = ClipTransform(image_size, image_size, cfg.image_mean, cfg.image_std)

    features = feature_dtype(dtype)

    def score_batch(images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        tokens, ends = tokenize(tokenizer, prompts, cfg.text.context_length)
        image_features = F.normalize(model.encode_image(preprocess(images).to(dtype)).to(features), dim=-1)
        text_features = F.normalize(model.encode_text(tokens.to(device), ends.to(device)).to(features), dim=-1)
        return (image_features * text_features).sum(-1)

    return make_reward_fn(score_batch, options, device)
