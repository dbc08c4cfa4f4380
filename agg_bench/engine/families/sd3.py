"""Stable Diffusion 3 / 3.5 (``model.family: sd3``): SD3Transformer2DModel with an AutoencoderKL.

The transformer takes unpacked latents and the timestep on the 0-1000 scale, the T5 + CLIP token
embeddings and the two CLIP encoders' pooled embeddings. Its learned position embedding covers
``pos_embed_max_size * patch_size`` latents a side; latent sides are a multiple of ``patch_size``.
The pipeline puts 77 CLIP tokens in front of the T5 tokens.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .spec import JOINT_ATTENTION_PROJECTIONS, Architecture, FamilySpec

# The tiny AutoencoderKL (8x spatial compression, 4 latent channels), SD3's and FLUX's.
TINY_VAE: dict = dict(
    in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 4,
    up_block_types=("UpDecoderBlock2D",) * 4, block_out_channels=(8, 8, 8, 8), latent_channels=4,
    layers_per_block=1, norm_num_groups=4,
)
# The public AutoencoderKL config of SD3.5 (FLUX.1 uses the same one with its own scale and shift).
PUBLIC_VAE = dict(
    in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 4,
    up_block_types=("UpDecoderBlock2D",) * 4, block_out_channels=(128, 256, 512, 512), latent_channels=16,
    layers_per_block=2, norm_num_groups=32, act_fn="silu", sample_size=1024, force_upcast=True,
    use_quant_conv=False, use_post_quant_conv=False,
)
_SCHEDULER = dict(shift=3.0)


def autoencoder_kl_scale_factor(vae: Mapping[str, Any]) -> int:
    """An AutoencoderKL halves the image at every block but the last."""
    return 2 ** (len(vae["block_out_channels"]) - 1)


def _latent_grid(transformer: Mapping[str, Any]) -> tuple[int, int | None]:
    patch = int(transformer.get("patch_size", 2))
    limit = transformer.get("pos_embed_max_size")
    return patch, None if limit is None else int(limit) * patch


def _transformer_inputs(transformer, hidden_states, timesteps, cond, height: int, width: int,
                        guidance_value: float) -> dict:
    # SD3 embeds no guidance value: a model.guidance other than the default is refused before the run
    # (engine.families.check_guidance)
    return dict(hidden_states=hidden_states, timestep=timesteps, encoder_hidden_states=cond.encoder_hidden_states,
                pooled_projections=cond.pooled_projections)


def _encode_prompts(pipe, prompts: list[str], device, options: dict) -> tuple:
    embeds, _, pooled, _ = pipe.encode_prompt(prompt=prompts, prompt_2=None, prompt_3=None, device=device,
                                              do_classifier_free_guidance=False, **options)
    return embeds, pooled, None


def _pixel_transformer(channels: int, side: int, num_layers: int, num_attention_heads: int,
                       attention_head_dim: int, text_dim: int) -> dict:
    return dict(sample_size=side, patch_size=2, in_channels=channels, out_channels=channels,
                caption_projection_dim=num_attention_heads * attention_head_dim, pos_embed_max_size=side // 2,
                num_layers=num_layers, attention_head_dim=attention_head_dim,
                num_attention_heads=num_attention_heads, joint_attention_dim=text_dim, pooled_projection_dim=text_dim)


SPEC = FamilySpec(
    name="sd3", title="SD3",
    transformer_class="SD3Transformer2DModel", vae_class="AutoencoderKL",
    tiny_transformer=dict(
        sample_size=32, patch_size=2, in_channels=4, out_channels=4, num_layers=2,
        attention_head_dim=16, num_attention_heads=4, joint_attention_dim=32,
        caption_projection_dim=64, pooled_projection_dim=32, pos_embed_max_size=96,
    ),
    tiny_vae=TINY_VAE, vae_latent_channels="latent_channels",
    vae_scale_factor=autoencoder_kl_scale_factor, latent_grid=_latent_grid,
    timestep_scale=1000.0, packed=False, transformer_inputs=_transformer_inputs,
    pipeline_class="StableDiffusion3Pipeline",
    text_components=("text_encoder", "tokenizer", "text_encoder_2", "tokenizer_2", "text_encoder_3", "tokenizer_3"),
    encode_prompts=_encode_prompts, text_attention_mask=False,
    lora_targets=JOINT_ATTENTION_PROJECTIONS,
    cache_block_lists=("transformer_blocks",),  # JointTransformerBlock; the last is context_pre_only
    architectures=(
        Architecture(
            "sd3.5-medium", "sd3",
            transformer=dict(
                sample_size=128, patch_size=2, in_channels=16, out_channels=16, num_layers=24,
                attention_head_dim=64, num_attention_heads=24, joint_attention_dim=4096,
                caption_projection_dim=1536, pooled_projection_dim=2048, pos_embed_max_size=384,
                dual_attention_layers=tuple(range(13)), qk_norm="rms_norm",
            ),
            vae=dict(PUBLIC_VAE, scaling_factor=1.5305, shift_factor=0.0609),
            scheduler=_SCHEDULER, text_tokens=256, prefix_tokens=77,
        ),
        Architecture(
            "sd3.5-large", "sd3",
            transformer=dict(
                sample_size=128, patch_size=2, in_channels=16, out_channels=16, num_layers=38,
                attention_head_dim=64, num_attention_heads=38, joint_attention_dim=4096,
                caption_projection_dim=2432, pooled_projection_dim=2048, pos_embed_max_size=192,
                qk_norm="rms_norm",
            ),
            vae=dict(PUBLIC_VAE, scaling_factor=1.5305, shift_factor=0.0609),
            scheduler=_SCHEDULER, text_tokens=256, prefix_tokens=77,
        ),
    ),
    default_architecture="sd3.5-medium",
    pixel_transformer=_pixel_transformer,
    gated_branches=True,
)
