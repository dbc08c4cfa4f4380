"""Hugging Face CLIP models from local folders, shared by PickScore, CLIPScore and the aesthetic predictor.

Options read here:
- ``model``: folder of a ``transformers`` CLIP checkpoint (``config.json`` + weights).
- ``processor``: folder with the matching processor / tokenizer files; defaults to ``model``.
- ``dtype``: "float32" (default) | "bfloat16" | "float16".
"""
from __future__ import annotations

from pathlib import Path
from typing import Mapping

import torch
import torch.nn.functional as F

from ..errors import UserError
from .common import ImagePreprocess, require_package, require_path, reward_dtype


def _load(reward: str, transformers, model_class, model_dir: Path, quiet: bool, **kwargs):
    """``model_class.from_pretrained`` where missing or mis-shaped weights are a UserError.

    transformers only logs those (and initialises the weights at random). ``quiet`` silences the
    loading report, for loads where unused weights are expected (the text tower of a full CLIP folder
    when only the vision tower is wanted).
    """
    verbosity = transformers.logging.get_verbosity()
    if quiet:
        transformers.logging.set_verbosity_error()
    try:
        model, info = model_class.from_pretrained(str(model_dir), output_loading_info=True,
                                                  ignore_mismatched_sizes=True, **kwargs)
    except (OSError, ValueError) as err:
        raise UserError(f"reward {reward!r}: cannot load a {model_class.__name__} from '{model_dir}': "
                        f"{err}") from None
    finally:
        transformers.logging.set_verbosity(verbosity)
    absent = sorted(info["missing_keys"]) + sorted(str(k) for k in info["mismatched_keys"])
    if absent:
        raise UserError(f"reward {reward!r}: '{model_dir}' does not hold a complete {model_class.__name__}; "
                        f"missing or mis-shaped weights {absent[:5]}{' ...' if len(absent) > 5 else ''}")
    return model


class HFClip:
    """A CLIP model in eval mode on ``device``, its torch image transform and (unless vision-only) tokenizer."""

    def __init__(self, reward: str, options: Mapping, device, vision_only: bool = False):
        transformers = require_package(reward, "transformers")
        model_dir = require_path(reward, options, "model", "a folder with a transformers CLIP model")
        processor_dir = require_path(reward, options, "processor", "a folder with the CLIP processor files",
                                     default=str(model_dir))
        self.device, self.dtype = torch.device(device), reward_dtype(options)
        try:
            config = transformers.AutoConfig.from_pretrained(str(model_dir))
        except (OSError, ValueError) as err:
            raise UserError(f"reward {reward!r}: cannot read a model config in '{model_dir}': {err}") from None
        accepted = ("clip", "clip_vision_model") if vision_only else ("clip",)
        if config.model_type not in accepted:
            raise UserError(f"reward {reward!r}: '{model_dir}' holds a {config.model_type!r} model; "
                            f"expected one of {list(accepted)}")
        if vision_only:
            if config.model_type == "clip":  # a full CLIP folder: keep its vision tower and projection
                projection_dim, config = config.projection_dim, config.vision_config
                config.projection_dim = projection_dim
            self.model = _load(reward, transformers, transformers.CLIPVisionModelWithProjection, model_dir,
                               quiet=True, config=config, dtype=self.dtype)
        else:
            self.model = _load(reward, transformers, transformers.CLIPModel, model_dir, quiet=False, dtype=self.dtype)
        self.model.to(self.device).eval().requires_grad_(False)
        image_processor = transformers.AutoImageProcessor.from_pretrained(str(processor_dir))
        self.preprocess = ImagePreprocess.from_hf(image_processor)
        self.tokenizer = None if vision_only else transformers.CLIPTokenizer.from_pretrained(str(processor_dir))

    def image_features(self, images: torch.Tensor) -> torch.Tensor:
        """L2-normalised projected image embeddings (B, D), float32."""
        pixels = self.preprocess(images).to(self.dtype)
        pooled = self.model.vision_model(pixel_values=pixels).pooler_output
        return F.normalize(self.model.visual_projection(pooled).float(), dim=-1)

    def text_features(self, prompts: list[str]) -> torch.Tensor:
        """L2-normalised projected text embeddings (B, D), float32.

        Prompts are padded to the full context length so a prompt's tokens never depend on its batch.
        """
        context = self.model.config.text_config.max_position_embeddings
        max_length = min(context, self.tokenizer.model_max_length)
        tokens = self.tokenizer(prompts, padding="max_length", truncation=True, max_length=max_length,
                                return_tensors="pt").to(self.device)
        pooled = self.model.text_model(input_ids=tokens["input_ids"],
                                       attention_mask=tokens["attention_mask"]).pooler_output
        return F.normalize(self.model.text_projection(pooled).float(), dim=-1)
