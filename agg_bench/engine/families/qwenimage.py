"""Qwen-Image (``model.family: qwenimage``): QwenImageTransformer2DModel with AutoencoderKLQwenImage.

The transformer takes 2x2-packed latents with ``img_shapes`` for its RoPE, the timestep as sigma, the
Qwen2.5-VL token embeddings and their attention mask (prompts are padded to the longest one); it has no
pooled embedding. Its VAE works on video-shaped latents (B, C, 1, H, W) normalized per channel with the
VAE config's ``latents_mean`` / ``latents_std``; the policy keeps (B, C, H, W) and adds the frame axis
for decoding. The VAE halves the image at every ``temperal_downsample`` entry.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .flux import guidance
from .spec import JOINT_ATTENTION_PROJECTIONS, Architecture, FamilySpec

# 8x spatial compression like the tiny AutoencoderKL, 4 latent channels (packed 2x2 -> 16).
TINY_QWEN_VAE: dict = dict(
    base_dim=8, z_dim=4, dim_mult=[1, 1, 1, 1], num_res_blocks=1, temperal_downsample=[False, True, True],
    latents_mean=[0.0] * 4, latents_std=[1.0] * 4,
)


def _vae_scale_factor(vae: Mapping[str, Any]) -> int:
    return 2 ** len(vae["temperal_downsample"])


def _transformer_inputs(transformer, hidden_states, timesteps, cond, height: int, width: int,
                        guidance_value: float) -> dict:
    return dict(hidden_states=hidden_states, timestep=timesteps,
                guidance=guidance(transformer, hidden_states, guidance_value),
                encoder_hidden_states=cond.encoder_hidden_states,
                encoder_hidden_states_mask=cond.encoder_attention_mask,
                img_shapes=[[(1, height // 2, width // 2)]] * hidden_states.shape[0])


def _vae_input(vae, latents):
    import torch

    cfg = vae.config
    shape = (1, cfg.z_dim, 1, 1, 1)
    mean = torch.tensor(cfg.latents_mean, dtype=vae.dtype, device=latents.device).view(shape)
    std = torch.tensor(cfg.latents_std, dtype=vae.dtype, device=latents.device).view(shape)
    return latents.to(vae.dtype).unsqueeze(2) * std + mean


def _vae_decode(vae, z):
    return vae.decode(z, return_dict=False)[0][:, :, 0]


def _encode_prompts(pipe, prompts: list[str], device, options: dict) -> tuple:
    import torch

    embeds, mask = pipe.encode_prompt(prompt=prompts, device=device, **options)
    if mask is None:  # the pipeline drops an all-ones mask; a cache spanning batches needs it explicit
        mask = torch.ones(embeds.shape[:2], dtype=torch.long, device=embeds.device)
    return embeds, None, mask.to(torch.long)


SPEC = FamilySpec(
    name="qwenimage", title="Qwen-Image",
    transformer_class="QwenImageTransformer2DModel", vae_class="AutoencoderKLQwenImage",
    tiny_transformer=dict(
        patch_size=2, in_channels=16, out_channels=4, num_layers=2, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=32, axes_dims_rope=(8, 4, 4),
    ),
    tiny_vae=TINY_QWEN_VAE, vae_latent_channels="z_dim",
    vae_scale_factor=_vae_scale_factor, latent_grid=lambda transformer: (2, None),
    timestep_scale=1.0, packed=True, transformer_inputs=_transformer_inputs,
    vae_input=_vae_input, vae_decode=_vae_decode,
    pipeline_class="QwenImagePipeline", text_components=("text_encoder", "tokenizer"),
    encode_prompts=_encode_prompts, text_attention_mask=True,
    lora_targets=JOINT_ATTENTION_PROJECTIONS,
    cache_block_lists=("transformer_blocks",),
    architectures=(
        Architecture(
            "qwen-image", "qwenimage",
            transformer=dict(
                patch_size=2, in_channels=64, out_channels=16, num_layers=60, attention_head_dim=128,
                num_attention_heads=24, joint_attention_dim=3584, guidance_embeds=False,
                axes_dims_rope=(16, 56, 56),
            ),
            vae=dict(
                # lists, as the class concatenates them
                base_dim=96, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=2, attn_scales=[],
                temperal_downsample=[False, True, True], dropout=0.0,
                latents_mean=[-0.7571, -0.7089, -0.9113, 0.1075, -0.1745, 0.9653, -0.1517, 1.5508,
                              0.4134, -0.0715, 0.5517, -0.3632, -0.1922, -0.9497, 0.2503, -0.2921],
                latents_std=[2.8184, 1.4541, 2.3275, 2.6558, 1.2196, 1.7708, 2.6052, 2.0743,
                             3.2687, 2.1526, 2.8652, 1.5579, 1.6382, 1.1253, 2.8251, 1.9160],
            ),
            scheduler=dict(shift=1.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=0.9,
                           base_image_seq_len=256, max_image_seq_len=8192, shift_terminal=0.02,
                           time_shift_type="exponential"),
            text_tokens=512,
        ),
    ),
    default_architecture="qwen-image",
)
