"""The shape of a model family's spec: one frozen record of everything family-specific.

A :class:`FamilySpec` names the family's diffusers classes, its tiny preset, its image geometry, how its
transformer is called, how its text encoders make prompt embeddings, where LoRA adapters and inference
caches attach, and its public architectures. The models, text encoding, LoRA, the memory planner and the
caches read these fields; none of them branches on a family's name.

Specs import no torch and no diffusers: the workflow's parse reads the catalog (image geometry,
``agg_bench.tools.sweep``) in a process that never imports them. Classes are therefore named, and
resolved from diffusers when a model is built; the calling-convention hooks import torch when called.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass, field, fields
from typing import Any, Callable, Mapping

# The projections of the joint (image + text) attention, the same names in SD3, FLUX (whose single-stream
# blocks share to_q/to_k/to_v) and Qwen-Image. A block without one (SD3's last block has no to_add_out)
# simply has no adapter there.
JOINT_ATTENTION_PROJECTIONS = ("to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj",
                               "to_add_out")


@dataclass(frozen=True)
class Architecture:
    """One public checkpoint's architecture.

    ``name``: the ``model.architecture`` value; ``family``: the ``model.family`` it belongs to;
    ``transformer`` / ``vae``: constructor arguments of the family's diffusers classes (public config
    values); ``scheduler``: its FlowMatchEulerDiscreteScheduler config; ``text_tokens``: the text
    encoder's default sequence length in the family's pipeline (T5 or Qwen2.5-VL);
    ``prefix_tokens``: tokens the pipeline puts in front of those (SD3: 77 CLIP tokens).
    """

    name: str
    family: str
    transformer: dict
    vae: dict
    scheduler: dict = field(default_factory=dict)
    text_tokens: int = 256
    prefix_tokens: int = 0

    def sequence_length(self, max_sequence_length: int | None = None) -> int:
        """Text tokens the transformer sees for a text-encoder length (None: the pipeline's default)."""
        return self.prefix_tokens + (self.text_tokens if max_sequence_length is None else max_sequence_length)


def diffusers_class(name: str) -> type[Any]:
    """The class ``name`` of the diffusers package (imported on first use)."""
    return getattr(importlib.import_module("diffusers"), name)


@dataclass(frozen=True)
class FamilySpec:
    """Everything the harness knows about one model family (``model.family``).

    The model:

    - ``name``: the ``model.family`` value; ``title``: how the docs and messages write it.
    - ``transformer_class`` / ``vae_class``: names of the diffusers classes of its transformer and VAE.
    - ``tiny_transformer`` / ``tiny_vae``: their constructor arguments for the tiny preset (a few hundred
      thousand seeded random parameters).
    - ``vae_latent_channels``: the VAE config key that holds its latent channels.
    - ``vae_scale_factor(vae_config)``: pixels per latent, read from a VAE config (dict or diffusers config).
    - ``latent_grid(transformer_config)``: ``(latent multiple, max latents a side or None)``: latent sides
      must be a multiple of the first; the second is the position embedding's limit (RoPE has none).

    The calling convention (latents are (B, C, H, W) everywhere else):

    - ``timestep_scale``: what sigma is multiplied by to give the transformer's timestep.
    - ``packed``: the transformer sees 2x2-packed latents (4x the latent channels, a quarter the tokens).
    - ``transformer_inputs(transformer, hidden_states, timesteps, cond, height, width, guidance_value)``: the
      keyword arguments of one transformer call (``hidden_states`` already packed when ``packed``; ``height`` /
      ``width``: the unpacked latents' sides; ``cond``: a :class:`agg_bench.engine.models.Conditioning`;
      ``guidance_value``: the run's ``model.guidance``, for a transformer that embeds a guidance value).
    - ``vae_input(vae, latents)`` / ``vae_decode(vae, z)``: undo the latent normalization, decode to images
      in [-1, 1]; None: the AutoencoderKL way (``scaling_factor`` and ``shift_factor``; ``decode``).

    Text conditioning:

    - ``pipeline_class``: the diffusers pipeline whose ``encode_prompt`` makes the embeddings of a local
      model folder; ``text_components``: the folders of its text encoders and tokenizers.
    - ``encode_prompts(pipe, prompts, device, options)``: ``(token embeddings, pooled or None, mask or
      None)`` of a batch of prompts (``options``: keyword arguments such as ``max_sequence_length``).
    - ``text_attention_mask``: the text encoders' embeddings carry an attention mask over padded tokens
      (the token widths and the pooled width come from the transformer's config).

    Training, caches and scale:

    - ``lora_targets``: module names LoRA adapters attach to (``train.lora_target_modules`` default).
    - ``cache_block_lists``: the transformer's block lists, in the order it runs them: where the inference
      caches (``baselines/caches``) hook. ``gated_branches``: FORA's ``reuse: branches`` knows its blocks'
      attention and MLP outputs and their adaLN gates (``baselines/caches/fora.py``, ``BRANCH_BLOCKS``).
    - ``architectures``: the public checkpoints of ``model.preset: random``; ``default_architecture``: the
      one ``model.architecture: null`` means.
    - ``pixel_transformer(channels, side, num_layers, num_attention_heads, attention_head_dim, text_dim)``:
      the transformer's constructor arguments for ``agg-bench pretrain``'s pixel-space scene model (a
      ConfigError naming the pretrain key a value does not suit), or None where the family has none.
    """

    name: str
    title: str
    transformer_class: str
    vae_class: str
    tiny_transformer: dict
    tiny_vae: dict
    vae_latent_channels: str
    vae_scale_factor: Callable[[Mapping[str, Any]], int]
    latent_grid: Callable[[Mapping[str, Any]], tuple[int, int | None]]
    timestep_scale: float
    packed: bool
    transformer_inputs: Callable[..., dict]
    pipeline_class: str
    text_components: tuple[str, ...]
    encode_prompts: Callable[..., tuple]
    text_attention_mask: bool
    lora_targets: tuple[str, ...]
    cache_block_lists: tuple[str, ...]
    architectures: tuple[Architecture, ...]
    default_architecture: str
    vae_input: Callable | None = None
    vae_decode: Callable | None = None
    pixel_transformer: Callable[..., dict] | None = None
    gated_branches: bool = False

    def transformer_cls(self) -> type[Any]:
        return diffusers_class(self.transformer_class)

    def vae_cls(self) -> type[Any]:
        return diffusers_class(self.vae_class)

    def pipeline_cls(self) -> type[Any]:
        return diffusers_class(self.pipeline_class)

    def problems(self) -> list[str]:
        """What keeps this spec from being complete: empty fields, architectures of another family, a
        default architecture it does not list. Empty when the spec is usable."""
        optional = {"vae_input", "vae_decode", "pixel_transformer", "gated_branches"}
        out = [f"{f.name} is empty" for f in fields(self)
               if f.name not in optional and getattr(self, f.name) in (None, "", (), {})]
        out += [f"architecture {a.name} belongs to {a.family}" for a in self.architectures if a.family != self.name]
        if self.default_architecture not in {a.name for a in self.architectures}:
            out.append(f"default_architecture {self.default_architecture} is not one of its architectures")
        return out


__all__ = ["Architecture", "FamilySpec", "JOINT_ATTENTION_PROJECTIONS", "diffusers_class"]
