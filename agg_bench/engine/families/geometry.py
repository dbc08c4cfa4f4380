"""What a model family's configs say about image sizes and the end of its own schedule, read without building
(or importing) a model.

A family accepts square images whose side is a multiple of ``vae_scale_factor * latent_multiple``
pixels, up to ``max_latent_size * vae_scale_factor`` where the transformer has a limit. The family's
spec reads the three from its configs (``FamilySpec.vae_scale_factor`` and ``latent_grid``): e.g. an
AutoencoderKL's factor is ``2 ** (len(block_out_channels) - 1)``; SD3's latent multiple is its
``patch_size`` and its position embedding covers ``pos_embed_max_size * patch_size`` latents; FLUX and
Qwen-Image pack 2x2 latents (multiple 2) and have no limit (RoPE).

A model's own schedule (``sampling.shift: null``) may be stretched to end at its scheduler config's
``shift_terminal`` (Qwen-Image's 0.02) before 0, which one step cannot do (:func:`check_own_schedule`).

A guidance-distilled transformer (FLUX.1-dev: ``guidance_embeds`` in its config) embeds a guidance value at every
call; ``model.guidance`` other than its default is refused for a transformer without that embedding
(:func:`check_guidance`), which the run would not use.

This module imports nothing heavy, so that the workflow can check a sweep's resolutions and schedules while it
plans (``agg_bench.tools.sweep``); the policies (``agg_bench.engine.models``) use the same ``ImageGeometry``, the
sampler the same :func:`check_terminal_steps`.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ...errors import ConfigError, UserError
from ...jsonfiles import MAX_CONFIG_BYTES, read_json_object
from ...records import is_integer
from .catalog import FAMILY_SPECS, architecture, family_spec

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
        if not is_integer(resolution) or resolution <= 0 or resolution % step:
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
    spec = family_spec(family)
    factor = DEFAULT_VAE_SCALE_FACTOR if vae is None else spec.vae_scale_factor(vae)
    multiple, limit = spec.latent_grid(transformer)
    return ImageGeometry(family, factor, multiple, limit)


def _read_json(path: Path) -> dict | None:
    """The JSON object of a model folder's config file (at most MAX_CONFIG_BYTES); None when it is not one."""
    try:
        return read_json_object(path, "a diffusers config", MAX_CONFIG_BYTES)
    except UserError:
        return None


def model_geometry(model: dict) -> ImageGeometry | None:
    """The geometry of a run config's ``model`` section from configs alone: the tiny preset's, or a local
    diffusers folder's ``transformer/config.json`` and ``vae/config.json``. None when that cannot be known
    without the model (an unknown preset, a folder without readable configs): the run checks it then."""
    family = model.get("family")
    if not isinstance(family, str) or family not in FAMILY_SPECS:
        return None
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
    if model.get("preset") == "tiny":
        spec = FAMILY_SPECS[family]
        return geometry_from_configs(family, spec.tiny_transformer, spec.tiny_vae)
    return None


def check_resolution(model: dict) -> None:
    """Raise a ConfigError when ``model.resolution`` is one the model's configs rule out."""
    geometry = model_geometry(model)
    if geometry is not None:
        geometry.latent_size(model.get("resolution"))


def check_terminal_steps(steps: int, shift_terminal: float | None) -> None:
    """Raise a ConfigError naming ``sampling.steps`` when a schedule stretched to ``shift_terminal`` (a model's
    own, Qwen-Image's 0.02) has a single step: diffusers divides by 1 minus its last nonzero sigma, which for one
    step is the first, 1, and the schedule is nan (the refusal named ``sampling.shift = null``)."""
    if shift_terminal is not None and steps < 2:
        raise ConfigError("sampling.steps", steps, f"an integer >= 2 with this model's own schedule (its scheduler's "
                          f"shift_terminal {shift_terminal:g} stretches the schedule to end at that sigma before 0, "
                          "which one step cannot), or a sampling.shift of its own for one step")


def model_shift_terminal(model: dict) -> float | None:
    """The ``shift_terminal`` of the scheduler config of a run config's ``model`` section: a local diffusers
    folder's ``scheduler/scheduler_config.json`` (at most MAX_CONFIG_BYTES), a random preset's public
    architecture's; None when it has none, for the tiny preset, and when the folder's file cannot be read (the
    run reports what is wrong with it when it loads the folder)."""
    pretrained = model.get("pretrained")
    if pretrained:
        config = _read_json(Path(pretrained) / "scheduler" / "scheduler_config.json") or {}
    elif model.get("preset") == "random" and model.get("family") in FAMILY_SPECS:
        config = architecture(model["family"], model.get("architecture")).scheduler
    else:
        return None
    value = config.get("shift_terminal")
    # as the policy reads it (Policy.schedule_shift_terminal): 0 and null stretch nothing
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) and value else None


def model_guidance_embeds(model: dict) -> bool | None:
    """Whether the transformer of a run config's ``model`` section embeds a guidance value (``guidance_embeds`` in
    its config: the tiny preset's, a random preset's public architecture's, a local diffusers folder's
    ``transformer/config.json``); None when that cannot be known without the model (an unknown family or preset,
    a folder without a readable config: the run reports what is wrong with it when it loads the folder)."""
    family = model.get("family")
    if not isinstance(family, str) or family not in FAMILY_SPECS:
        return None
    pretrained = model.get("pretrained")
    if pretrained:
        config = _read_json(Path(pretrained) / "transformer" / "config.json")
    elif model.get("preset") == "random":
        config = architecture(family, model.get("architecture")).transformer
    elif model.get("preset") == "tiny":
        config = FAMILY_SPECS[family].tiny_transformer
    else:
        return None
    return None if config is None else config.get("guidance_embeds") is True


def check_guidance(model: dict, embeds: bool | None = None) -> None:
    """Raise a ConfigError naming ``model.guidance`` when a run config's ``model`` section gives a guidance value
    other than the default to a transformer that embeds none: SD3 and Qwen-Image have no such embedding, nor have
    the tiny FLUX and FLUX.1-schnell, so the value would change nothing. ``embeds``: whether the transformer embeds
    one, where the caller has it built (None: read from the configs, :func:`model_guidance_embeds`)."""
    from ...config import DEFAULTS

    default = DEFAULTS["model"]["guidance"]
    value = model.get("guidance", default)
    if value == default:
        return
    if embeds is None:
        embeds = model_guidance_embeds(model)
    if embeds is False:
        raise ConfigError("model.guidance", value, f"{default}, the default: this {model.get('family')} model's "
                          "transformer embeds no guidance value (no guidance_embeds in its config), so the run would "
                          "not use it; a guidance-distilled transformer such as FLUX.1-dev's (model.preset random) "
                          "takes one")


def check_own_schedule(model: dict, sampling: dict) -> None:
    """Raise :func:`check_terminal_steps`' ConfigError when the run samples with the model's own schedule
    (``sampling.schedule: diffusers`` with a null ``sampling.shift``) and that ends at a ``shift_terminal`` its
    ``sampling.steps`` cannot reach; ``model`` and ``sampling`` are a run config's sections."""
    if sampling.get("shift") is None and sampling.get("schedule", "diffusers") == "diffusers":
        check_terminal_steps(sampling["steps"], model_shift_terminal(model))
