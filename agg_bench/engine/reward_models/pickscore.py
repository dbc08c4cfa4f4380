"""PickScore (Kirstain et al., 2023): a CLIP-H model fine-tuned on Pick-a-Pic preferences.

Score = ``logit_scale.exp() * cos(image_embedding, text_embedding)``, as in the PickScore README
(about 20-23 for typical images). Images are prepared by transformers' PIL CLIP image processor from
``processor``'s config, prompts tokenized with truncation at 77 tokens, as in that README.

Options: ``model`` (folder of the PickScore ``CLIPModel``, e.g. a local copy of
yuvalkirstain/PickScore_v1), ``processor`` (folder of the processor it was trained with, e.g.
laion/CLIP-ViT-H-14-laion2B-s32B-b79K; defaults to ``model``), ``batch_size`` (16), ``dtype`` ("float32").
Extra: ``pip install 'agg-bench[pickscore]'``.
"""
from __future__ import annotations

import torch

from ...config.reward_options import reward_options
from .common import feature_dtype, make_reward_fn
from .hf_clip import HFClip


def build(options: dict, device):
    options = reward_options("pickscore", options)
    clip = HFClip("pickscore", options, device, transform="hf")
    logit_scale = clip.model.logit_scale.detach().to(feature_dtype(clip.dtype)).exp()

    def score_batch(images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        cosine = (clip.image_features(images) * clip.text_features(prompts)).sum(-1)
        return logit_scale * cosine

    return make_reward_fn(score_batch, options, device)
