"""Pieces every reward-model adapter shares.

- :func:`require_package` / :func:`require_path`: one :class:`~agg_bench.errors.UserError` that names
  the missing package (and the extra that installs it) or the missing file/folder (and its option).
- :class:`ImagePreprocess`: resize / center-crop / normalize done in torch on (B, 3, H, W) images in
  [0, 1], so decoded images never round-trip through PIL.
- :func:`load_state_dict` / :func:`load_weights`: read a checkpoint file and load it with a clear error
  when its keys do not fit the architecture.
- :func:`make_reward_fn`: turns a per-batch scorer into the ``reward(images, prompts) -> (B,)`` callable
  of :mod:`agg_bench.rewards` (batched, ``torch.no_grad()``, float32 on the CPU).
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Callable, Mapping, Sequence

import torch
import torch.nn.functional as F

from ..errors import ConfigError, UserError
from ..rewards import RewardFn

# Image statistics of OpenAI CLIP, used by CLIP-family models and by BLIP / ImageReward.
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# PIL resampling codes, as stored in Hugging Face processor configs.
_RESAMPLE = {0: "nearest", 2: "bilinear", 3: "bicubic"}

ScoreBatch = Callable[[torch.Tensor, list[str]], torch.Tensor]


def require_package(reward: str, package: str) -> ModuleType:
    """Import ``package`` or raise a UserError naming it and the extra that installs it."""
    try:
        return importlib.import_module(package)
    except ImportError:
        raise UserError(
            f"reward {reward!r} needs the {package!r} package: pip install 'agg-bench[{reward}]'"
        ) from None


def require_path(reward: str, options: Mapping, key: str, what: str, default: str | None = None) -> Path:
    """The existing file or folder given by ``options[key]`` (or ``default``); else a UserError.

    ``what`` describes the expected content, e.g. "the HPSv2 checkpoint file (.pt)".
    """
    value = options.get(key) or default
    if not value:
        raise UserError(f"reward {reward!r} needs reward.options.{key}: {what}")
    path = Path(str(value)).expanduser()
    if not path.exists():
        raise UserError(f"reward {reward!r}: reward.options.{key} = '{path}' does not exist; expected {what}")
    return path


def reward_dtype(options: Mapping) -> torch.dtype:
    """The model dtype from ``options["dtype"]`` (default float32)."""
    name = options.get("dtype", "float32")
    if name not in DTYPES:
        raise ConfigError("reward.options.dtype", name, f"one of {sorted(DTYPES)}")
    return DTYPES[name]


def load_state_dict(reward: str, path: Path) -> dict[str, torch.Tensor]:
    """Tensors of a ``.safetensors`` file or of a torch checkpoint.

    A torch checkpoint may hold the tensors directly or under ``"state_dict"`` / ``"model"``; a
    ``"module."`` prefix left by DistributedDataParallel is removed.
    """
    if path.is_dir():
        raise UserError(f"reward {reward!r}: '{path}' is a folder; expected a checkpoint file")
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        state = load_file(str(path))
    else:
        try:
            state = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as err:  # pickle errors come in many types; all mean "not a plain checkpoint"
            raise UserError(f"reward {reward!r}: cannot read checkpoint '{path}': {err}") from None
    for wrapper in ("state_dict", "model"):
        if isinstance(state, dict) and isinstance(state.get(wrapper), dict):
            state = state[wrapper]
    if not isinstance(state, dict):
        raise UserError(f"reward {reward!r}: checkpoint '{path}' holds no state dict")
    return {k.removeprefix("module."): v for k, v in state.items() if isinstance(v, torch.Tensor)}


def load_weights(
    reward: str,
    model: torch.nn.Module,
    state: Mapping[str, torch.Tensor],
    path: Path,
    ignore: Sequence[str] = (),
) -> None:
    """Load ``state`` into ``model``; keys starting with a prefix in ``ignore`` are dropped first.

    Raises a UserError naming ``path`` and a few of the missing / unexpected keys when the checkpoint
    does not fit the architecture (usually a wrong architecture option).
    """
    state = {k: v for k, v in state.items() if not k.startswith(tuple(ignore))}
    expected = model.state_dict()
    problems = {
        "missing keys": [k for k in expected if k not in state],
        "unexpected keys": [k for k in state if k not in expected],
        "wrong shapes": [k for k, v in expected.items() if k in state and state[k].shape != v.shape],
    }
    if any(problems.values()):
        found = "; ".join(f"{label} {keys[:5]}{' ...' if len(keys) > 5 else ''}"
                          for label, keys in problems.items() if keys)
        raise UserError(f"reward {reward!r}: checkpoint '{path}' does not fit the configured architecture: "
                        f"{found}")
    model.load_state_dict(state)


@dataclass(frozen=True)
class ImagePreprocess:
    """Torch version of the usual CLIP-style image transform.

    ``resize``: target shortest edge (int) or exact (height, width), None to skip resizing.
    ``crop``: (height, width) of the center crop, None to skip. ``mean``/``std``: per-channel statistics
    applied to [0, 1] pixels. ``interpolation``: "bicubic" | "bilinear" | "nearest"; downscaling is
    antialiased like PIL. Resized pixels are clamped to [0, 1], as an 8-bit image would be.
    """

    resize: int | tuple[int, int] | None
    crop: tuple[int, int] | None
    mean: tuple[float, float, float] = CLIP_MEAN
    std: tuple[float, float, float] = CLIP_STD
    interpolation: str = "bicubic"

    @classmethod
    def square(cls, size: int, mean=CLIP_MEAN, std=CLIP_STD) -> "ImagePreprocess":
        """Resize the shortest edge to ``size`` and center-crop ``size`` x ``size``."""
        return cls(resize=size, crop=(size, size), mean=tuple(mean), std=tuple(std))

    @classmethod
    def from_hf(cls, processor) -> "ImagePreprocess":
        """The transform described by a Hugging Face image processor (e.g. ``CLIPImageProcessor``)."""

        def field(container, key):
            if container is None:
                return None
            return container.get(key) if isinstance(container, Mapping) else getattr(container, key, None)

        resize = None
        if getattr(processor, "do_resize", True):
            size = processor.size
            if field(size, "shortest_edge"):
                resize = int(field(size, "shortest_edge"))
            else:
                resize = (int(field(size, "height")), int(field(size, "width")))
        crop = None
        if getattr(processor, "do_center_crop", False):
            crop = (int(field(processor.crop_size, "height")), int(field(processor.crop_size, "width")))
        mean, std = (0.0, 0.0, 0.0), (1.0, 1.0, 1.0)
        if getattr(processor, "do_normalize", True):
            mean, std = tuple(processor.image_mean), tuple(processor.image_std)
        resample = getattr(processor, "resample", 3)
        resample = getattr(resample, "value", resample)  # PIL enum or int
        interpolation = _RESAMPLE.get(int(resample), "bicubic")
        return cls(resize=resize, crop=crop, mean=mean, std=std, interpolation=interpolation)

    def output_size(self, height: int, width: int) -> tuple[int, int]:
        """(height, width) after resizing an image of the given size."""
        if self.resize is None:
            return height, width
        if isinstance(self.resize, int):
            short, long = sorted((height, width))
            new_short, new_long = self.resize, int(self.resize * long / short)
            return (new_short, new_long) if height <= width else (new_long, new_short)
        return tuple(self.resize)

    def __call__(self, images: torch.Tensor) -> torch.Tensor:
        """(B, 3, H, W) in [0, 1] -> normalized float32 model input."""
        x = images.float()
        size = self.output_size(*x.shape[-2:])
        if size != tuple(x.shape[-2:]):
            smooth = self.interpolation != "nearest"
            x = F.interpolate(x, size=size, mode=self.interpolation, antialias=smooth)
            x = x.clamp(0.0, 1.0)
        if self.crop is not None:
            (h, w), (ch, cw) = x.shape[-2:], self.crop
            pad_h, pad_w = max(ch - h, 0), max(cw - w, 0)
            if pad_h or pad_w:  # zero borders, as Hugging Face processors pad too-small images
                x = F.pad(x, (pad_w // 2, pad_w - pad_w // 2, pad_h // 2, pad_h - pad_h // 2))
                h, w = x.shape[-2:]
            top, left = (h - ch) // 2, (w - cw) // 2
            x = x[..., top:top + ch, left:left + cw]
        mean = torch.tensor(self.mean, device=x.device).view(1, 3, 1, 1)
        std = torch.tensor(self.std, device=x.device).view(1, 3, 1, 1)
        return (x - mean) / std


class LinearStack(torch.nn.Module):
    """Linear layers applied one after another, with no activation in between.

    This is the head of the LAION aesthetic predictor and of ImageReward (their public code keeps
    only dropout between the layers). ``layers`` keeps the checkpoint's indices: dropout slots are
    identities, so the state-dict keys are ``layers.<i>.weight`` / ``layers.<i>.bias``.
    """

    def __init__(self, dims: Sequence[int], indices: Sequence[int]):
        super().__init__()
        if len(indices) != len(dims) - 1:
            raise ValueError("one index per linear layer")
        slots: list[torch.nn.Module] = [torch.nn.Identity() for _ in range(max(indices) + 1)]
        for i, (d_in, d_out) in zip(indices, zip(dims[:-1], dims[1:])):
            slots[i] = torch.nn.Linear(d_in, d_out)
        self.layers = torch.nn.Sequential(*slots)

    @classmethod
    def from_state_dict(cls, state: Mapping[str, torch.Tensor], prefix: str = "layers.") -> "LinearStack":
        """The stack whose layer indices and sizes are those of ``state`` (keys ``prefix<i>.weight``)."""
        weights = {int(k[len(prefix):].split(".")[0]): v for k, v in state.items()
                   if k.startswith(prefix) and k.endswith(".weight")}
        if not weights:
            raise ValueError(f"no '{prefix}<i>.weight' keys")
        indices = sorted(weights)
        dims = [weights[indices[0]].shape[1]] + [weights[i].shape[0] for i in indices]
        return cls(dims, indices)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


def make_reward_fn(score_batch: ScoreBatch, options: Mapping, device) -> RewardFn:
    """``reward(images, prompts) -> (B,)`` float32 on the CPU, scoring ``options["batch_size"]`` at a time.

    ``score_batch(images, prompts)`` receives float32 images already on ``device`` and returns (b,).
    """
    batch_size = options.get("batch_size", 16)
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ConfigError("reward.options.batch_size", batch_size, "a positive integer")
    device = torch.device(device)

    def reward(images: torch.Tensor, prompts: Sequence[str]) -> torch.Tensor:
        prompts = [prompts] if isinstance(prompts, str) else list(prompts)
        if images.ndim != 4 or images.shape[1] != 3:
            raise ValueError(f"images must be (B, 3, H, W), got {tuple(images.shape)}")
        if len(prompts) != images.shape[0]:
            raise ValueError(f"{images.shape[0]} images but {len(prompts)} prompts")
        scores = []
        with torch.no_grad():
            for start in range(0, len(prompts), batch_size):
                chunk = images[start:start + batch_size].to(device=device, dtype=torch.float32)
                scores.append(score_batch(chunk, prompts[start:start + batch_size]).float().reshape(-1).cpu())
        return torch.cat(scores) if scores else torch.zeros(0)

    return reward
