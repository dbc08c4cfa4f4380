"""What a model family's configs say about image sizes, read without building (or importing) a model.

A family accepts square images whose side is a multiple of ``vae_scale_factor * latent_multiple``
pixels, up to ``max_latent_size * vae_scale_factor`` where the transformer has a limit:

- the VAE's spatial factor: ``2 ** (len(block_out_channels) - 1)`` for ``AutoencoderKL`` (SD3, FLUX),
  ``2 ** len(temperal_downsample)`` for Qwen-Image's VAE;
- the latent multiple: SD3's ``patch_size``; 2 for FLUX and Qwen-Image, which pack 2x2 latents;
- the limit: SD3's learned position embedding covers ``pos_embed_max_size * patch_size`` latents;
  FLUX and Qwen-Image (RoPE) have none.

This module imports nothing heavy, so that the workflow can check a sweep's resolutions while it plans
(``agg_bench.tools.sweep``); ``agg_bench.engine.models`` builds the tiny presets from the configs below and checks a
run's resolution with :func:`check_resolution`.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import ConfigError

# Tiny presets: real diffusers classes with a few hundred thousand seeded random parameters.
TINY_TRANSFORMERS: dict[str, dict] = {
    "sd3": dict(
        sample_size=32, patch_size=2, in_channels=4, out_channels=4, num_layers=2,
        attention_head_dim=16, num_attention_heads=4, joint_attention_dim=32,
        caption_projection_dim=64, pooled_projection_dim=32, pos_embed_max_size=96,
    ),
    "flux": dict(
        patch_size=1, in_channels=16, num_layers=1, num_single_layers=2, attention_head_dim=16,
        num_attention_heads=4, joint_attention_dim=32, pooled_projection_dim=32,
        axes_dims_rope=(4, 6, 6),
    ),
    "qwenimage": dict(
        patch_size=2, in_channels=16, out_channels=4, num_layers=2, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=32, axes_dims_rope=(8, 4, 4),
    ),
}
TINY_VAE: dict = dict(
    in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 4,
    up_block_types=("UpDecoderBlock2D",) * 4, block_out_channels=(8, 8, 8, 8), latent_channels=4,
    layers_per_block=1, norm_num_groups=4,
)
# Qwen-Image's VAE: 8x spatial compression like TINY_VAE, 4 latent channels (packed 2x2 -> 16).
TINY_QWEN_VAE: dict = dict(
    base_dim=8, z_dim=4, dim_mult=[1, 1, 1, 1], num_res_blocks=1, temperal_downsample=[False, True, True],
    latents_mean=[0.0] * 4, latents_std=[1.0] * 4,
)

# VAE factor when a policy has no VAE
DEFAULT_VAE_SCALE_FACTOR = 8


@dataclass(frozen=True)
class ImageGeometry:
    """The image sizes a model accepts: ``vae_scale_factor`` pixels per latent, latent sides a multiple
    of ``latent_multiple``, at most ``max_latent_size`` latents a side (None: no limit)."""

    family: str
    vae_scale_factor: int
    latent_multiple: int
    max_latent_size: int | None = None

    def latent_size(self, resolution: Any) -> int:
        """Latents per side for square images of ``resolution`` pixels, or a ConfigError naming
        ``model.resolution`` and what this model allows."""
        step = self.vae_scale_factor * self.latent_multiple
        if isinstance(resolution, bool) or not isinstance(resolution, int) or resolution <= 0 or resolution % step:
            raise ConfigError("model.resolution", resolution,
                              f"a positive multiple of {step} pixels for {self.family} "
                              f"(VAE factor {self.vae_scale_factor})")
        size = resolution // self.vae_scale_factor
        if self.max_latent_size is not None and size > self.max_latent_size:
            raise ConfigError("model.resolution", resolution,
                              f"at most {self.max_latent_size * self.vae_scale_factor} pixels for this {self.family} model")
        return size


def geometry_from_configs(family: str, transformer: dict, vae: dict | None) -> ImageGeometry:
    """The geometry of ``family`` given its transformer's and VAE's config dicts (diffusers config.json)."""
    if vae is None:
        factor = DEFAULT_VAE_SCALE_FACTOR
    elif family == "qwenimage":
        factor = 2 ** len(vae["temperal_downsample"])
    else:
        factor = 2 ** (len(vae["block_out_channels"]) - 1)
    if family == "sd3":
        patch = int(transformer.get("patch_size", 2))
        limit = transformer.get("pos_embed_max_size")
        return ImageGeometry(family, factor, patch, None if limit is None else int(limit) * patch)
    return ImageGeometry(family, factor, 2)


def _read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError, UnicodeDecodeError):
        return None


def model_geometry(model: dict) -> ImageGeometry | None:
    """The geometry of a run config's ``model`` section from configs alone: the tiny preset's, or a local
    diffusers folder's ``transformer/config.json`` and ``vae/config.json``. None when that cannot be known
    without the model (an unknown preset, a folder without readable configs): the run checks it then."""
    family = model.get("family")
    pretrained = model.get("pretrained")
    if pretrained:
        transformer = _read_json(Path(pretrained) / "transformer" / "config.json")
        vae = _read_json(Path(pretrained) / "vae" / "config.json")
        if transformer is None or vae is None:
            return None
        try:
            return geometry_from_configs(family, transformer, vae)
        except (KeyError, TypeError, ValueError):
            return None
    if model.get("preset") == "tiny" and family in TINY_TRANSFORMERS:
        vae = TINY_QWEN_VAE if family == "qwenimage" else TINY_VAE
        return geometry_from_configs(family, TINY_TRANSFORMERS[family], vae)
    return None


def check_resolution(model: dict) -> None:
    """Raise a ConfigError when ``model.resolution`` is one the model's configs rule out."""
    geometry = model_geometry(model)
    if geometry is not None:
        geometry.latent_size(model.get("resolution"))
