"""Full-size public architectures with seeded random weights (``model.preset: random``).

The transformer and VAE of a public checkpoint are rebuilt from the values of its public diffusers
``config.json`` files, kept here, so that time, memory and pass counts can be measured at paper scale
with nothing downloaded (they do not depend on the weights' values; rewards do, and random-weight rows
are labelled ``weights: random`` and kept out of quality comparisons).

Modules are created on the ``meta`` device (no memory) and materialised directly on the target device
(``to_empty``), where :func:`init_random_weights` fills them from the seed: every module's own
``reset_parameters`` (the default initialisation of Linear, Conv, LayerNorm, ...), norm scales without
one set to 1, and SD3's sin-cos position table recomputed. A 20 B model is never initialised on the CPU.

Text conditioning is the download-free token-hash embedding at the text encoders' real width and a
realistic sequence length: the pipeline's default text-encoder length (``prompts.max_sequence_length``
overrides it), plus the 77 CLIP tokens that SD3's pipeline puts in front of the T5 tokens.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from diffusers.models.embeddings import PatchEmbed, get_2d_sincos_pos_embed
from diffusers.models.transformers.transformer_qwenimage import QwenEmbedRope

from ..errors import ConfigError

# The public diffusers configs (transformer/config.json and vae/config.json) of each checkpoint.
_SD3_VAE = dict(
    in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 4,
    up_block_types=("UpDecoderBlock2D",) * 4, block_out_channels=(128, 256, 512, 512), latent_channels=16,
    layers_per_block=2, norm_num_groups=32, act_fn="silu", sample_size=1024, force_upcast=True,
    use_quant_conv=False, use_post_quant_conv=False,
)
_SD3_SCHEDULER = dict(shift=3.0)


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


ARCHITECTURES: dict[str, Architecture] = {
    a.name: a for a in (
        Architecture(
            "sd3.5-medium", "sd3",
            transformer=dict(
                sample_size=128, patch_size=2, in_channels=16, out_channels=16, num_layers=24,
                attention_head_dim=64, num_attention_heads=24, joint_attention_dim=4096,
                caption_projection_dim=1536, pooled_projection_dim=2048, pos_embed_max_size=384,
                dual_attention_layers=tuple(range(13)), qk_norm="rms_norm",
            ),
            vae=dict(_SD3_VAE, scaling_factor=1.5305, shift_factor=0.0609),
            scheduler=_SD3_SCHEDULER, text_tokens=256, prefix_tokens=77,
        ),
        Architecture(
            "sd3.5-large", "sd3",
            transformer=dict(
                sample_size=128, patch_size=2, in_channels=16, out_channels=16, num_layers=38,
                attention_head_dim=64, num_attention_heads=38, joint_attention_dim=4096,
                caption_projection_dim=2432, pooled_projection_dim=2048, pos_embed_max_size=192,
                qk_norm="rms_norm",
            ),
            vae=dict(_SD3_VAE, scaling_factor=1.5305, shift_factor=0.0609),
            scheduler=_SD3_SCHEDULER, text_tokens=256, prefix_tokens=77,
        ),
        Architecture(
            "flux.1-dev", "flux",
            transformer=dict(
                patch_size=1, in_channels=64, num_layers=19, num_single_layers=38, attention_head_dim=128,
                num_attention_heads=24, joint_attention_dim=4096, pooled_projection_dim=768,
                guidance_embeds=True, axes_dims_rope=(16, 56, 56),
            ),
            vae=dict(_SD3_VAE, scaling_factor=0.3611, shift_factor=0.1159),
            scheduler=dict(shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
                           base_image_seq_len=256, max_image_seq_len=4096),
            text_tokens=512,
        ),
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
    )
}
DEFAULT_ARCHITECTURE = {"sd3": "sd3.5-medium", "flux": "flux.1-dev", "qwenimage": "qwen-image"}


def architecture(family: str, name: str | None = None) -> Architecture:
    """The architecture ``name`` of ``family`` (None: the family's default), or a ConfigError naming the
    allowed ones."""
    name = DEFAULT_ARCHITECTURE.get(family) if name is None else name
    arch = ARCHITECTURES.get(name) if isinstance(name, str) else None
    if arch is None or arch.family != family:
        allowed = sorted(a.name for a in ARCHITECTURES.values() if a.family == family)
        raise ConfigError("model.architecture", name,
                          f"one of {allowed} for model.family {family} (all: {sorted(ARCHITECTURES)})")
    return arch


def build_on_meta(cls, config: dict, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """``cls(**config)`` on the meta device: shapes only, no memory, no initialisation work."""
    with torch.device("meta"):
        module = cls(**config)
    return module if dtype == torch.float32 else module.to(dtype)


# Norm modules whose scale parameter has no reset_parameters of its own (diffusers' RMSNorm, the
# Qwen-Image VAE's RMS norm): the scale starts at 1, as their constructors set it.
_UNIT_SCALES = ("weight", "gamma")


def _reset_position_table(module: PatchEmbed) -> None:
    grid = module.pos_embed_max_size or module.height
    table = get_2d_sincos_pos_embed(module.proj.out_channels, grid, base_size=module.base_size,
                                    interpolation_scale=module.interpolation_scale,
                                    device=module.pos_embed.device, output_type="pt")
    module.pos_embed.copy_(table.to(module.pos_embed.dtype).unsqueeze(0))


def _reset_rope_tables(module: QwenEmbedRope) -> None:
    # plain tensor attributes (not buffers): to_empty leaves them on meta; rebuilt where the class builds
    # them (the CPU; a few MB) and moved to the input's device by the module itself
    with torch.device("cpu"):
        fresh = QwenEmbedRope(module.theta, module.axes_dim, module.scale_rope)
    module.pos_freqs, module.neg_freqs = fresh.pos_freqs, fresh.neg_freqs


# Buffers that hold computed values, by owning module class -> how to recompute them in place.
_BUFFER_RESETS = {PatchEmbed: _reset_position_table}
# Modules that keep computed tensors as plain attributes -> how to rebuild them.
_ATTRIBUTE_RESETS = {QwenEmbedRope: _reset_rope_tables}


@torch.no_grad()
def init_random_weights(module: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Fill a materialised (``to_empty``) module in place from ``seed``, on whatever device it is on.

    Raises RuntimeError for a parameter or buffer it does not know how to fill, so that nothing is
    left holding uninitialised memory.
    """
    devices = sorted({str(t.device) for t in module.parameters()} | {str(t.device) for t in module.buffers()})
    if "meta" in devices:
        raise RuntimeError("init_random_weights: materialise the module first (to_empty)")
    cuda = [torch.device(d) for d in devices if d.startswith("cuda")]
    with torch.random.fork_rng(devices=cuda):
        torch.manual_seed(seed)
        for name, sub in module.named_modules():
            own_params = list(sub.named_parameters(recurse=False))
            if own_params and callable(getattr(sub, "reset_parameters", None)):
                sub.reset_parameters()
            else:
                for pname, p in own_params:
                    if pname not in _UNIT_SCALES:
                        raise RuntimeError(f"init_random_weights: no initialisation for {name}.{pname} "
                                           f"({type(sub).__name__})")
                    p.fill_(1.0)
            if list(sub.buffers(recurse=False)):
                reset = _BUFFER_RESETS.get(type(sub))
                if reset is None:
                    raise RuntimeError(f"init_random_weights: no way to recompute the buffers of {name} "
                                       f"({type(sub).__name__})")
                reset(sub)
            if any(isinstance(v, torch.Tensor) and v.is_meta for v in vars(sub).values()):
                reset = _ATTRIBUTE_RESETS.get(type(sub))
                if reset is None:
                    raise RuntimeError(f"init_random_weights: no way to rebuild the tensors of {name} "
                                       f"({type(sub).__name__})")
                reset(sub)
    return module


def materialize(module: torch.nn.Module, device: str | torch.device, seed: int) -> torch.nn.Module:
    """A meta-device module allocated directly on ``device`` and filled from ``seed``."""
    return init_random_weights(module.to_empty(device=device), seed)


def build_random(cls, config: dict, device: str | torch.device, seed: int,
                 dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """``cls(**config)`` with seeded random weights, created on meta and materialised on ``device``."""
    return materialize(build_on_meta(cls, config, dtype), device, seed)


def parameter_count(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


__all__ = ["ARCHITECTURES", "Architecture", "DEFAULT_ARCHITECTURE", "architecture", "build_on_meta",
           "build_random", "init_random_weights", "materialize", "parameter_count"]
