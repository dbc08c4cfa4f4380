"""FLUX.1 (``model.family: flux``): FluxTransformer2DModel with SD3's AutoencoderKL.

The transformer takes 2x2-packed latents with their RoPE position ids (``img_ids``; ``txt_ids`` zero),
the timestep as sigma (the model scales it), the T5 token embeddings and CLIP's pooled embedding, and the run's
``model.guidance`` (default 1; the FLUX GRPO recipes give 3.5, FluxPipeline's ``guidance_scale``) where the model
has a guidance embedding (FLUX.1-dev: ``guidance_embeds``; the model scales it by 1000). It runs double-stream
``transformer_blocks`` and then ``single_transformer_blocks``.
"""
from __future__ import annotations

from ...errors import ConfigError
from .sd3 import PUBLIC_VAE, TINY_VAE, autoencoder_kl_scale_factor
from .spec import JOINT_ATTENTION_PROJECTIONS, Architecture, FamilySpec


def image_ids(height: int, width: int, device, dtype):
    """Position ids (H/2 * W/2, 3) of packed latents of ``height`` x ``width``."""
    import torch

    ids = torch.zeros(height // 2, width // 2, 3)
    ids[..., 1] = torch.arange(height // 2)[:, None]
    ids[..., 2] = torch.arange(width // 2)[None, :]
    return ids.reshape(-1, 3).to(device=device, dtype=dtype)


def guidance(transformer, hidden_states, value: float):
    """The guidance value ``value`` (``model.guidance``) per row where the transformer embeds one (None where it
    does not): the one place a transformer call gets its guidance input."""
    import torch

    if not transformer.config.guidance_embeds:
        return None
    return torch.full((hidden_states.shape[0],), value, device=hidden_states.device, dtype=hidden_states.dtype)


def _transformer_inputs(transformer, hidden_states, timesteps, cond, height: int, width: int,
                        guidance_value: float) -> dict:
    import torch

    ehs = cond.encoder_hidden_states
    device, dtype = hidden_states.device, hidden_states.dtype
    return dict(hidden_states=hidden_states, timestep=timesteps, encoder_hidden_states=ehs,
                pooled_projections=cond.pooled_projections, img_ids=image_ids(height, width, device, dtype),
                txt_ids=torch.zeros(ehs.shape[1], 3, device=device, dtype=dtype),
                guidance=guidance(transformer, hidden_states, guidance_value))


def _encode_prompts(pipe, prompts: list[str], device, options: dict) -> tuple:
    embeds, pooled, _ = pipe.encode_prompt(prompt=prompts, prompt_2=None, device=device, **options)
    return embeds, pooled, None


def _pixel_transformer(channels: int, side: int, num_layers: int, num_attention_heads: int,
                       attention_head_dim: int, text_dim: int) -> dict:
    if attention_head_dim % 16:
        raise ConfigError("attention_head_dim", attention_head_dim, "a multiple of 16 for flux (its RoPE axes)")
    # RoPE axes (text, row, column) summing to the head width, each even (a quarter and 3/8 each)
    head = attention_head_dim
    return dict(patch_size=1, in_channels=4 * channels, num_single_layers=num_layers,
                axes_dims_rope=(head // 4, 3 * head // 8, 3 * head // 8), num_layers=num_layers,
                attention_head_dim=attention_head_dim, num_attention_heads=num_attention_heads,
                joint_attention_dim=text_dim, pooled_projection_dim=text_dim)


SPEC = FamilySpec(
    name="flux", title="FLUX",
    transformer_class="FluxTransformer2DModel", vae_class="AutoencoderKL",
    tiny_transformer=dict(
        patch_size=1, in_channels=16, num_layers=1, num_single_layers=2, attention_head_dim=16,
        num_attention_heads=4, joint_attention_dim=32, pooled_projection_dim=32,
        axes_dims_rope=(4, 6, 6),
    ),
    tiny_vae=TINY_VAE, vae_latent_channels="latent_channels",
    vae_scale_factor=autoencoder_kl_scale_factor, latent_grid=lambda transformer: (2, None),
    timestep_scale=1.0, packed=True, transformer_inputs=_transformer_inputs,
    pipeline_class="FluxPipeline", text_components=("text_encoder", "tokenizer", "text_encoder_2", "tokenizer_2"),
    encode_prompts=_encode_prompts, text_attention_mask=False,
    lora_targets=JOINT_ATTENTION_PROJECTIONS,
    cache_block_lists=("transformer_blocks", "single_transformer_blocks"),
    architectures=(
        Architecture(
            "flux.1-dev", "flux",
            transformer=dict(
                patch_size=1, in_channels=64, num_layers=19, num_single_layers=38, attention_head_dim=128,
                num_attention_heads=24, joint_attention_dim=4096, pooled_projection_dim=768,
                guidance_embeds=True, axes_dims_rope=(16, 56, 56),
            ),
            vae=dict(PUBLIC_VAE, scaling_factor=0.3611, shift_factor=0.1159),
            scheduler=dict(shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
                           base_image_seq_len=256, max_image_seq_len=4096),
            text_tokens=512,
        ),
    ),
    default_architecture="flux.1-dev",
    pixel_transformer=_pixel_transformer,
    gated_branches=True,
)
