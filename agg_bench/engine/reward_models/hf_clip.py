"""Hugging Face CLIP models from local folders, shared by PickScore, CLIPScore and the aesthetic predictor.

Images reach the model as their reference code prepares them, from 8-bit PIL images:
- ``transform="hf"`` (PickScore): transformers' PIL image processor (``CLIPImageProcessorPil``) with the
  folder's ``preprocessor_config.json``, as PickScore's README calls ``AutoProcessor``. The torchvision
  processor that transformers 5 picks by default when torchvision is installed resizes in torch and
  differs slightly, so it is not used.
- ``transform="openai"`` (CLIPScore, aesthetic): OpenAI CLIP's own transform
  (:class:`~agg_bench.engine.reward_models.common.ClipTransform`) with the size and statistics of that config.

Options read here:
- ``model``: folder of a ``transformers`` CLIP checkpoint (``config.json`` + weights).
- ``processor``: folder with the matching processor / tokenizer files; defaults to ``model``.
- ``dtype``: "float32" (default) | "bfloat16" | "float16".
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Mapping

import torch
import torch.nn.functional as F
from PIL import Image

from ...errors import UserError, quote
from ..hf_logging import quiet_loading
from ...config.reward_options import CLIP_MODEL, CLIP_PROCESSOR
from ..rewards import to_uint8
from .common import (ClipTransform, feature_dtype, first_line, load_pretrained, require_package, require_path,
                     reward_dtype)


def _load(reward: str, model_class, model_dir: Path, quiet: bool, **kwargs):
    """``model_class.from_pretrained`` where missing or mis-shaped weights are a UserError.

    transformers only logs those (and initialises the weights at random). ``quiet`` silences the
    loading report, for loads where unused weights are expected (the text tower of a full CLIP folder
    when only the vision tower is wanted).
    """
    try:
        with quiet_loading(logging.ERROR if quiet else None):
            model, info = model_class.from_pretrained(str(model_dir), output_loading_info=True,
                                                      ignore_mismatched_sizes=True, **kwargs)
    except Exception as err:  # OSError, ValueError, safetensors errors for a missing or corrupt weights file
        raise UserError(f"reward {reward!r}: cannot load a {model_class.__name__} from {quote(str(model_dir))} "
                        f"({first_line(err)}); expected {CLIP_MODEL}") from None
    absent = sorted(info["missing_keys"]) + sorted(str(k) for k in info["mismatched_keys"])
    if absent:
        raise UserError(f"reward {reward!r}: {quote(str(model_dir))} does not hold a complete {model_class.__name__}; "
                        f"missing or mis-shaped weights {absent[:5]}{' ...' if len(absent) > 5 else ''}; "
                        f"expected {CLIP_MODEL}")
    return model


class HFClip:
    """A CLIP model in eval mode on ``device``, its image transform and (unless vision-only) tokenizer.

    ``transform``: "hf" or "openai", see the module docstring.
    """

    def __init__(self, reward: str, options: Mapping, device, transform: str, vision_only: bool = False):
        transformers = require_package(reward, "transformers")
        model_dir = require_path(reward, options, "model", CLIP_MODEL)
        processor_dir = require_path(reward, options, "processor", CLIP_PROCESSOR, default=str(model_dir))
        self.device, self.dtype = torch.device(device), reward_dtype(options)
        try:
            config = transformers.AutoConfig.from_pretrained(str(model_dir))
        except Exception as err:  # OSError / ValueError / JSON errors for a missing or broken config.json
            raise UserError(f"reward {reward!r}: cannot read a model config in {quote(str(model_dir))} "
                            f"({first_line(err)}); "
                            f"expected {CLIP_MODEL}") from None
        accepted = ("clip", "clip_vision_model") if vision_only else ("clip",)
        if config.model_type not in accepted:
            raise UserError(f"reward {reward!r}: {quote(str(model_dir))} holds a {config.model_type!r} model; "
                            f"expected one of {list(accepted)}")
        if vision_only:
            if config.model_type == "clip":  # a full CLIP folder: keep its vision tower and projection
                projection_dim, config = config.projection_dim, config.vision_config
                config.projection_dim = projection_dim
            self.model = _load(reward, transformers.CLIPVisionModelWithProjection, model_dir,
                               quiet=True, config=config, dtype=self.dtype)
        else:
            self.model = _load(reward, transformers.CLIPModel, model_dir, quiet=False, dtype=self.dtype)
        self.model.to(self.device).eval().requires_grad_(False)
        processor = load_pretrained(reward, transformers.CLIPImageProcessorPil, processor_dir, CLIP_PROCESSOR)
        self.preprocess = hf_transform(processor) if transform == "hf" else openai_transform(reward, processor)
        self.tokenizer = None if vision_only else load_pretrained(reward, transformers.CLIPTokenizer, processor_dir,
                                                                 CLIP_PROCESSOR)

    def image_features(self, images: torch.Tensor) -> torch.Tensor:
        """L2-normalised projected image embeddings (B, D), float32 (float64 for a float64 model)."""
        pixels = self.preprocess(images).to(self.device, self.dtype)
        pooled = self.model.vision_model(pixel_values=pixels).pooler_output
        return F.normalize(self.model.visual_projection(pooled).to(feature_dtype(self.dtype)), dim=-1)

    def text_features(self, prompts: list[str]) -> torch.Tensor:
        """L2-normalised projected text embeddings (B, D), float32 (float64 for a float64 model).

        Prompts are padded to the full context length so a prompt's tokens never depend on its batch.
        """
        assert self.tokenizer is not None, "a vision-only model has no text tower"
        context = self.model.config.text_config.max_position_embeddings
        max_length = min(context, self.tokenizer.model_max_length)
        tokens = self.tokenizer(prompts, padding="max_length", truncation=True, max_length=max_length,
                                return_tensors="pt").to(self.device)
        pooled = self.model.text_model(input_ids=tokens["input_ids"],
                                       attention_mask=tokens["attention_mask"]).pooler_output
        return F.normalize(self.model.text_projection(pooled).to(feature_dtype(self.dtype)), dim=-1)


def hf_transform(processor):
    """(B, 3, H, W) in [0, 1] -> ``processor``'s float32 pixel values, computed from 8-bit PIL images."""
    def transform(images: torch.Tensor) -> torch.Tensor:
        pil_images = [Image.fromarray(arr) for arr in to_uint8(images)]
        return processor(images=pil_images, return_tensors="pt")["pixel_values"]

    return transform


def openai_transform(reward: str, processor) -> ClipTransform:
    """OpenAI CLIP's transform at the size and statistics of ``processor`` (shortest-edge resize, square crop)."""
    resize, crop = processor.size.get("shortest_edge"), processor.crop_size
    if not resize or not processor.do_center_crop or crop.get("height") != crop.get("width"):
        raise UserError(f"reward {reward!r}: the CLIP processor config must resize the shortest edge and crop a "
                        f"square; got size {processor.size}, crop_size {crop}")
    return ClipTransform(int(resize), int(crop["height"]), tuple(processor.image_mean), tuple(processor.image_std))
