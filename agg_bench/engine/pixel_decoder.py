"""A pixel-space "VAE": latents are the image's pixels, rearranged, with no learned weights.

The pre-trained scene models (:mod:`agg_bench.tools.pretrain`) denoise pixels directly; their ``vae/`` folder
holds this decoder's ``config.json`` (``_class_name: PixelDecoder``) instead of a VAE. Latents of an image
of side S are ``pixel_unshuffle((2 * image - 1 - shift_factor) * scaling_factor, factor)``: shape
(3 factor^2, S / factor, S / factor). A 2x2 rearrangement halves the side the transformer patches, so a
32 px image is 8 x 8 tokens for SD3 (patch 2) and for FLUX (2x2 packing) alike.

It offers what :class:`agg_bench.engine.models.Policy` uses of a VAE: ``config.latent_channels``,
``config.scaling_factor``, ``config.shift_factor``, ``decode(z, return_dict=False)`` (images in [-1, 1])
and ``dtype``; :attr:`spatial_factor` is its VAE scale factor.
"""
from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.nn.functional as F

from ..errors import ConfigError, UserError, quote
from ..jsonfiles import MAX_CONFIG_BYTES, read_json_object
from ..records import is_finite_number, is_integer

CLASS_NAME = "PixelDecoder"
CONFIG_KEYS = ("factor", "scaling_factor", "shift_factor", "image_channels")
MAX_FACTOR = 16  # a rearrangement of 16 x 16 pixels: 768 latent channels
POWERS = tuple(2 ** k for k in range(MAX_FACTOR.bit_length()))


class PixelDecoder(torch.nn.Module):
    """``factor``: side reduction of the rearrangement (a power of 2); ``scaling_factor`` and
    ``shift_factor``: the latent normalisation (diffusers' convention: ``latent / scaling_factor +
    shift_factor`` is the decoder's input); ``image_channels``: 3 (RGB)."""

    anchor: torch.Tensor

    def __init__(self, factor: int = 2, scaling_factor: float = 1.0, shift_factor: float = 0.0,
                 image_channels: int = 3):
        super().__init__()
        self.config = SimpleNamespace(factor=factor, scaling_factor=scaling_factor, shift_factor=shift_factor,
                                      image_channels=image_channels,
                                      latent_channels=image_channels * factor * factor)
        # a buffer gives the module a dtype and device, as a VAE's weights do
        self.register_buffer("anchor", torch.zeros(()), persistent=False)

    @property
    def spatial_factor(self) -> int:
        return self.config.factor

    @property
    def dtype(self) -> torch.dtype:
        return self.anchor.dtype

    def encode_images(self, images: torch.Tensor) -> torch.Tensor:
        """Normalised latents of images (B, 3, S, S) in [0, 1]."""
        cfg = self.config
        return F.pixel_unshuffle((images * 2 - 1 - cfg.shift_factor) * cfg.scaling_factor, cfg.factor)

    def decode(self, z: torch.Tensor, return_dict: bool = False):
        """Images in [-1, 1] (unclamped) from decoder inputs (latents already un-normalised)."""
        return (F.pixel_shuffle(z, self.config.factor),)

    def save_pretrained(self, folder: str | Path) -> None:
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        cfg = {k: v for k, v in vars(self.config).items() if k != "latent_channels"}
        (folder / "config.json").write_text(json.dumps({"_class_name": CLASS_NAME, **cfg}, indent=2) + "\n")

    @classmethod
    def from_folder(cls, folder: str | Path) -> "PixelDecoder":
        """The decoder ``folder/config.json`` describes (read bounded: a JsonFileError, a UserError, otherwise).
        A key it does not take or a value outside :func:`config_problem`'s bounds is a ConfigError naming
        ``model.pretrained`` (the model folder that holds ``folder``), the key and the value."""
        cfg = read_json_object(Path(folder) / "config.json", "the pixel decoder's config", MAX_CONFIG_BYTES)
        cfg.pop("_class_name", None)
        problem = config_problem(cfg)
        if problem is not None:
            raise ConfigError("model.pretrained", str(Path(folder).parent),
                              f"a pixel decoder config in {Path(folder).name}/config.json it can take ({problem})")
        return cls(**cfg)


def config_problem(cfg: dict) -> str | None:
    """What keeps a pixel decoder from being built from ``cfg`` (its config.json less ``_class_name``): a key
    it does not take, a ``factor`` that is not a power of 2 up to :data:`MAX_FACTOR`, ``image_channels`` other
    than 3, a ``scaling_factor`` that is not a finite number > 0 or a ``shift_factor`` that is not a finite
    number (latents are divided by the one and shifted by the other: a string failed mid-run, 0 gave infinite
    images); None when nothing does."""
    for key, value in cfg.items():
        if key not in CONFIG_KEYS:
            return f"{key}: a key it does not take (it takes {', '.join(CONFIG_KEYS)})"
        if key == "factor" and not (is_integer(value) and value in POWERS):
            return f"factor = {quote(value)}: expected one of {', '.join(map(str, POWERS))}"
        if key == "image_channels" and not (is_integer(value) and value == 3):
            return f"image_channels = {quote(value)}: expected 3 (RGB)"
        if key in ("scaling_factor", "shift_factor"):
            problem = normalisation_problem(key, value)
            if problem is not None:
                return problem
    return None


def normalisation_problem(key: str, value: object) -> str | None:
    """What keeps ``value`` from being a latent normalisation's ``key``: a ``scaling_factor`` (latents are
    divided by it) that is not a finite number > 0, a ``shift_factor`` that is not a finite number; None when
    nothing does. The pixel decoder's and a diffusers VAE's config are checked by it."""
    if not is_finite_number(value) or (key == "scaling_factor" and value <= 0):
        return f"{key} = {quote(value)}: expected a finite number{' > 0' if key == 'scaling_factor' else ''}"
    return None


def is_pixel_decoder_folder(folder: str | Path) -> bool:
    """Whether ``folder/config.json`` names this decoder (a file that is not a JSON object of at most
    :data:`~agg_bench.jsonfiles.MAX_CONFIG_BYTES` does not)."""
    try:
        return read_json_object(Path(folder) / "config.json", "a config", MAX_CONFIG_BYTES).get("_class_name") \
            == CLASS_NAME
    except UserError:
        return False
