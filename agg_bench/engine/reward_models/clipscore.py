"""CLIPScore (Hessel et al., 2021): ``w * max(cos(image_embedding, text_embedding), 0)`` with w = 2.5.

The paper uses CLIP ViT-B/32 and prefixes each caption with "A photo depicts"; the prefix is the
``prefix`` option (empty by default, since prompts here are generation prompts, not captions).
Images are prepared with OpenAI CLIP's own transform (the paper's code uses the ``clip`` package), at the
size and statistics of the processor config.

Options: ``model`` (folder of a transformers ``CLIPModel``, e.g. a local copy of
openai/clip-vit-base-patch32), ``processor`` (defaults to ``model``), ``w`` (2.5), ``prefix`` (""),
``batch_size`` (16), ``dtype`` ("float32"). Extra: ``pip install 'agg-bench[clipscore]'``.
"""
from __future__ import annotations

import torch

from .common import check_reward_options, make_reward_fn
from .hf_clip import CLIP_OPTIONS, HFClip


def build(options: dict, device):
    check_reward_options("clipscore", options, {**CLIP_OPTIONS, "w": "the score's weight (2.5)",
                                                "prefix": "text put before each prompt"})
    clip = HFClip("clipscore", options, device, transform="openai")
    weight = float(options.get("w", 2.5))
    prefix = str(options.get("prefix", ""))

    def score_batch(images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        cosine = (clip.image_features(images) * clip.text_features([prefix + p for p in prompts])).sum(-1)
        return weight * cosine.clamp(min=0.0)

    return make_reward_fn(score_batch, options, device)
