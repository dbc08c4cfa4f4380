"""DiTs, VAEs and the per-family calling conventions.

A :class:`Policy` hides how one model family is called: latents are always (B, C, H, W) and the
timestep is always given as a denoising-step index into the run's schedule. Each family adapter turns
that into what its diffusers transformer expects (SD3: timestep on the 0-1000 scale; FLUX: packed
2x2 latents with ``img_ids``/``txt_ids`` and timestep/1000).
"""
from __future__ import annotations

import copy
import os
from dataclasses import dataclass

import torch
from diffusers import AutoencoderKL, FluxTransformer2DModel, SD3Transformer2DModel

from .counters import PassCounter, count_backward
from .errors import ConfigError

FAMILIES = ("sd3", "flux")

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
}
TINY_VAE: dict = dict(
    in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 4,
    up_block_types=("UpDecoderBlock2D",) * 4, block_out_channels=(8, 8, 8, 8), latent_channels=4,
    layers_per_block=1, norm_num_groups=4,
)
TRANSFORMER_CLASSES = {"sd3": SD3Transformer2DModel, "flux": FluxTransformer2DModel}
DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}


@dataclass
class Conditioning:
    """Text conditioning for a batch: token embeddings (B, L, D) and pooled embeddings (B, P)."""

    encoder_hidden_states: torch.Tensor
    pooled_projections: torch.Tensor | None = None

    def __getitem__(self, rows) -> "Conditioning":
        return Conditioning(
            self.encoder_hidden_states[rows],
            None if self.pooled_projections is None else self.pooled_projections[rows],
        )

    def to(self, device=None, dtype=None) -> "Conditioning":
        move = lambda t: None if t is None else t.to(device=device, dtype=dtype)  # noqa: E731
        return Conditioning(move(self.encoder_hidden_states), move(self.pooled_projections))

    def repeat_interleave(self, n: int) -> "Conditioning":
        rep = lambda t: None if t is None else t.repeat_interleave(n, dim=0)  # noqa: E731
        return Conditioning(rep(self.encoder_hidden_states), rep(self.pooled_projections))

    @property
    def batch_size(self) -> int:
        return self.encoder_hidden_states.shape[0]


def _seeded(seed: int):
    torch.manual_seed(seed)


def build_tiny_transformer(family: str, seed: int = 0, dtype: torch.dtype = torch.float32):
    """A tiny transformer of ``family`` with weights drawn from ``seed``."""
    if family not in TINY_TRANSFORMERS:
        raise ConfigError("model.family", family, f"one of {sorted(TINY_TRANSFORMERS)} for the tiny preset")
    with torch.random.fork_rng(devices=[]):
        _seeded(seed)
        model = TRANSFORMER_CLASSES[family](**TINY_TRANSFORMERS[family])
    return model if dtype == torch.float32 else model.to(dtype)


def build_tiny_vae(seed: int = 0, dtype: torch.dtype = torch.float32) -> AutoencoderKL:
    with torch.random.fork_rng(devices=[]):
        _seeded(seed + 1)
        vae = AutoencoderKL(**TINY_VAE)
    vae = vae if dtype == torch.float32 else vae.to(dtype)
    return vae.eval().requires_grad_(False)


class Policy:
    """A transformer and VAE of one family, called with latents (B, C, H, W) and step indices.

    ``timesteps`` given to :meth:`velocity` are the exact values the transformer receives; the family
    decides their scale (:attr:`timestep_scale` multiplies sigma). ``counter`` counts every call.
    ``version`` is incremented by the training loop after each optimizer step, so a method can tell
    whether the parameters still equal those that produced a rollout.
    """

    family: str = ""
    timestep_scale: float = 1000.0

    def __init__(self, transformer: torch.nn.Module, vae: AutoencoderKL | None, latent_channels: int):
        self.transformer = transformer
        self.vae = vae
        self.latent_channels = latent_channels
        self.counter = PassCounter()
        self.version = 0

    # ----- shapes -------------------------------------------------------------------------
    @property
    def vae_scale_factor(self) -> int:
        if self.vae is None:
            return 8
        return 2 ** (len(self.vae.config.block_out_channels) - 1)

    @property
    def latent_multiple(self) -> int:
        """Latent height/width must be a multiple of this."""
        return 2

    def max_latent_size(self) -> int | None:
        return None

    def latent_shape(self, resolution: int) -> tuple[int, int, int]:
        """(C, H, W) of the latents for square images of ``resolution`` pixels, or a clear error."""
        step = self.vae_scale_factor * self.latent_multiple
        if not isinstance(resolution, int) or resolution <= 0 or resolution % step:
            raise ConfigError(
                "model.resolution", resolution,
                f"a positive multiple of {step} pixels for {self.family} (VAE factor {self.vae_scale_factor})",
            )
        size = resolution // self.vae_scale_factor
        limit = self.max_latent_size()
        if limit is not None and size > limit:
            raise ConfigError(
                "model.resolution", resolution,
                f"at most {limit * self.vae_scale_factor} pixels for this {self.family} model",
            )
        return (self.latent_channels, size, size)

    @property
    def device(self) -> torch.device:
        return next(self.transformer.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.transformer.parameters()).dtype

    # ----- calls --------------------------------------------------------------------------
    def timestep_values(self, sigmas: torch.Tensor) -> torch.Tensor:
        """The values given to the transformer for each step, from the schedule's sigmas (T+1)."""
        return sigmas[:-1] * self.timestep_scale

    def velocity(self, latents: torch.Tensor, timesteps: torch.Tensor, cond: Conditioning) -> torch.Tensor:
        """Predicted velocity for ``latents`` (b, C, H, W) at ``timesteps`` (b,); counted."""
        grad = torch.is_grad_enabled() and any(p.requires_grad for p in self.transformer.parameters())
        b = latents.shape[0]
        dtype = self.dtype
        out = self._forward(latents.to(dtype), timesteps.to(dtype), cond.to(dtype=dtype))
        if grad:
            self.counter.forward_grad += b
            out = count_backward(out, self.counter)
        else:
            self.counter.forward_nograd += b
        return out

    def _forward(self, latents, timesteps, cond: Conditioning) -> torch.Tensor:
        raise NotImplementedError

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Images (B, 3, H, W) in [0, 1] from latents."""
        if self.vae is None:
            raise RuntimeError("this policy has no VAE to decode with")
        cfg = self.vae.config
        z = latents.to(self.vae.dtype) / cfg.scaling_factor + (cfg.shift_factor or 0.0)
        images = self.vae.decode(z, return_dict=False)[0]
        return (images.float() / 2 + 0.5).clamp(0, 1)

    def parameters(self):
        return [p for p in self.transformer.parameters() if p.requires_grad]

    def named_parameters(self):
        return [(n, p) for n, p in self.transformer.named_parameters() if p.requires_grad]

    def frozen_copy(self) -> "Policy":
        """A copy with frozen parameters (the KL reference policy); it shares the counter."""
        ref = copy.copy(self)
        ref.transformer = copy.deepcopy(self.transformer).requires_grad_(False).eval()
        return ref


class SD3Policy(Policy):
    family = "sd3"
    timestep_scale = 1000.0

    @property
    def latent_multiple(self) -> int:
        return self.transformer.config.patch_size

    def max_latent_size(self) -> int | None:
        return self.transformer.config.pos_embed_max_size * self.transformer.config.patch_size

    def _forward(self, latents, timesteps, cond):
        return self.transformer(
            hidden_states=latents, timestep=timesteps,
            encoder_hidden_states=cond.encoder_hidden_states,
            pooled_projections=cond.pooled_projections, return_dict=False,
        )[0]


def pack_latents(latents: torch.Tensor) -> torch.Tensor:
    """(B, C, H, W) -> (B, H/2 * W/2, 4C), FLUX's 2x2 patch packing."""
    b, c, h, w = latents.shape
    x = latents.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5)
    return x.reshape(b, (h // 2) * (w // 2), c * 4)


def unpack_latents(packed: torch.Tensor, channels: int, height: int, width: int) -> torch.Tensor:
    b = packed.shape[0]
    x = packed.view(b, height // 2, width // 2, channels, 2, 2).permute(0, 3, 1, 4, 2, 5)
    return x.reshape(b, channels, height, width)


def flux_image_ids(height: int, width: int, device, dtype) -> torch.Tensor:
    """Position ids (H/2 * W/2, 3) of packed FLUX latents."""
    ids = torch.zeros(height // 2, width // 2, 3)
    ids[..., 1] = torch.arange(height // 2)[:, None]
    ids[..., 2] = torch.arange(width // 2)[None, :]
    return ids.reshape(-1, 3).to(device=device, dtype=dtype)


class FluxPolicy(Policy):
    family = "flux"
    timestep_scale = 1.0

    def _forward(self, latents, timesteps, cond):
        b, c, h, w = latents.shape
        ehs = cond.encoder_hidden_states
        guidance = None
        if self.transformer.config.guidance_embeds:
            guidance = torch.full((b,), 1.0, device=latents.device, dtype=latents.dtype)
        out = self.transformer(
            hidden_states=pack_latents(latents), timestep=timesteps,
            encoder_hidden_states=ehs, pooled_projections=cond.pooled_projections,
            img_ids=flux_image_ids(h, w, latents.device, latents.dtype),
            txt_ids=torch.zeros(ehs.shape[1], 3, device=latents.device, dtype=latents.dtype),
            guidance=guidance, return_dict=False,
        )[0]
        return unpack_latents(out, c, h, w)


POLICIES: dict[str, type[Policy]] = {"sd3": SD3Policy, "flux": FluxPolicy}


def text_dims(transformer) -> tuple[int, int | None]:
    """(token embedding dim, pooled embedding dim) the transformer expects."""
    cfg = transformer.config
    return cfg.joint_attention_dim, getattr(cfg, "pooled_projection_dim", None)


def load_policy(family: str, preset: str, pretrained: str | None, dtype: str = "float32",
                device: str | torch.device = "cpu", seed: int = 0) -> Policy:
    """Build the tiny preset or load a local diffusers folder (``transformer/`` and ``vae/``)."""
    if family not in POLICIES:
        raise ConfigError("model.family", family, f"one of {sorted(POLICIES)}")
    if dtype not in DTYPES:
        raise ConfigError("model.dtype", dtype, f"one of {sorted(DTYPES)}")
    torch_dtype = DTYPES[dtype]
    if pretrained:
        if not os.path.isdir(pretrained):
            raise ConfigError("model.pretrained", pretrained, "an existing local diffusers folder")
        sub = os.path.join(pretrained, "transformer")
        root = sub if os.path.isdir(sub) else pretrained
        transformer = TRANSFORMER_CLASSES[family].from_pretrained(root, torch_dtype=torch_dtype)
        vae_dir = os.path.join(pretrained, "vae")
        vae = AutoencoderKL.from_pretrained(vae_dir).eval().requires_grad_(False) if os.path.isdir(vae_dir) \
            else build_tiny_vae(seed)
    elif preset == "tiny":
        transformer = build_tiny_transformer(family, seed, torch_dtype)
        vae = build_tiny_vae(seed)
    else:
        raise ConfigError("model.preset", preset, "'tiny', or model.pretrained set to a local folder")
    latent_channels = transformer.config.in_channels // (4 if family == "flux" else 1)
    if vae is not None and vae.config.latent_channels != latent_channels:
        raise ConfigError("model.pretrained", pretrained,
                          f"a VAE with {latent_channels} latent channels to match the transformer")
    transformer.to(device)
    if vae is not None:
        vae.to(device)
    return POLICIES[family](transformer, vae, latent_channels)
