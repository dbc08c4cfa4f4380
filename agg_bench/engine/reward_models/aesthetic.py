"""LAION aesthetic predictor: a small head on L2-normalised CLIP ViT-L/14 image embeddings.

The head is read from ``options["head"]`` and its shape is taken from the file: a single linear
layer (keys ``weight``/``bias``, the LAION-Aesthetics v1 predictor) or the v2 "improved aesthetic
predictor" stack (keys ``layers.<i>.weight``/``.bias``: 768-1024-128-64-16-1 linear layers with only
dropout between them). Prompts are ignored. As in LAION's predictor code, images go through OpenAI
CLIP's transform and the head sees the L2-normalised image embedding.

Options: ``model`` (folder of a transformers CLIP ViT-L/14, e.g. a local copy of
openai/clip-vit-large-patch14; a full ``CLIPModel`` folder works), ``processor`` (defaults to ``model``),
``head`` (the head's state dict, ``.pth`` or ``.safetensors``), ``batch_size`` (16), ``dtype`` ("float32").
Extra: ``pip install 'agg-bench[aesthetic]'``.
"""
from __future__ import annotations

import torch

from ...errors import UserError, quote
from ...config.reward_options import reward_options
from .common import (feature_dtype, LinearStack, load_state_dict, load_weights, make_reward_fn,
                     require_package, require_path, reward_dtype)
from .hf_clip import HFClip


HEAD = ("the LAION aesthetic head state dict (e.g. sac+logos+ava1-l14-linearMSE.pth or "
        "ava+logos-l14-linearMSE.pth, or .safetensors)")


def load_head(path, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """The aesthetic head stored at ``path`` (linear or stacked-linear, see the module docstring), in ``dtype``."""
    state = load_state_dict("aesthetic", path, HEAD)
    head: torch.nn.Module
    if set(state) == {"weight", "bias"}:
        head = torch.nn.Linear(state["weight"].shape[1], state["weight"].shape[0])
    else:
        try:
            head = LinearStack.from_state_dict(state)
        except ValueError:
            raise UserError(
                f"reward 'aesthetic': head {quote(str(path))} is neither a linear layer (weight, bias) nor an "
                f"aesthetic MLP (layers.<i>.weight), found keys {sorted(state)[:4]} ...; expected {HEAD}"
            ) from None
    head.to(dtype)  # before loading, so float64 weights stay float64
    load_weights("aesthetic", head, state, path, what=HEAD)
    return head


def build(options: dict, device):
    options = reward_options("aesthetic", options)
    require_package("aesthetic", "transformers")
    head_path = require_path("aesthetic", options, "head", HEAD)
    # the head first: a wrong head file fails before the CLIP model is loaded
    head = load_head(head_path, feature_dtype(reward_dtype(options)))
    clip = HFClip("aesthetic", options, device, transform="openai", vision_only=True)
    head = head.to(clip.device).eval().requires_grad_(False)

    def score_batch(images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        return head(clip.image_features(images)).squeeze(-1)

    return make_reward_fn(score_batch, options, device)
