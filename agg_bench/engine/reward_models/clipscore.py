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

from ...config.reward_options import reward_options
from .common import make_reward_fn
from .hf_clip import HFClip


def build(options: dict, device):
    options = reward_options("clipscore", options)
    clip = HFClip("clipscore", options, device, transform="openai")
    weight, prefix = options["w"], options["prefix"]

    def score_batch(images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        cosine = (clip.image_features(images) * clip.text_features([prefix + p for p in prompts])).sum(-1)
        return weight * cosine.clamp(min=0.0)

    return make_reward_fn(score_batch, options, device)
