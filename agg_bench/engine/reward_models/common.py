"""Pieces every reward-model adapter shares.

- :func:`require_package` / :func:`require_path`: one :class:`~agg_bench.errors.UserError` that names
  the missing package (and the extra that installs it) or the missing file/folder (and its option).
- :class:`ClipTransform`: the resize / center-crop / normalize of OpenAI CLIP, OpenCLIP and BLIP,
  on 8-bit PIL images exactly as their reference code does it.
- :func:`load_state_dict` / :func:`load_weights` / :func:`load_pretrained`: read a checkpoint file
  (weights-only or safetensors), a tokenizer or processor folder, with one-line errors naming the file
  and what was expected there.
- :func:`make_reward_fn`: turns a per-batch scorer into the ``reward(images, prompts) -> (B,)`` callable
  of :mod:`agg_bench.engine.rewards` (batched, ``torch.no_grad()``, float32 on the CPU; float64 for a float64 model).
"""
from __future__ import annotations

import importlib
import re
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import torch
from PIL import Image

from ...errors import UserError, quote
from ...outdir import named_path_problem
from ..rewards import RewardFn, to_uint8

# Image statistics of OpenAI CLIP, used by CLIP-family models and by BLIP / ImageReward.
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)

# float64 is for checking a scorer against a reference implementation.
DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16, "float16": torch.float16}

ScoreBatch = Callable[[torch.Tensor, list[str]], torch.Tensor]


def require_package(reward: str, package: str) -> ModuleType:
    """Import ``package`` or raise a UserError naming it and the extra that installs it."""
    try:
        return importlib.import_module(package)
    except ImportError:
        raise UserError(
            f"reward {reward!r} needs the {package!r} package: pip install 'agg-bench[{reward}]'"
        ) from None


def option_path(reward: str, key: str, value: object, what: str, file: bool = False) -> Path:
    """``value``, the path that ``reward.options.<key>`` names, as written (no ``~`` is expanded, as for every path
    of a config: :func:`~agg_bench.outdir.named_path_problem`), or a UserError naming the option when it names
    nothing this user can use (``file``: a file, not a path that ends with ``/``). Looks only; whether it exists is
    the caller's to say."""
    text = str(value)
    problem = named_path_problem(text, file=file)
    if problem is not None:
        raise UserError(f"reward {reward!r}: reward.options.{key} = {quote(text)}: {problem}; expected {what}")
    return Path(text)


def require_path(reward: str, options: Mapping, key: str, what: str, default: str | None = None) -> Path:
    """The existing file or folder that ``options[key]`` names (or ``default`` where it is null): options checked by
    :func:`~agg_bench.config.reward_options.reward_options`, which refuses a required path not given and one that
    names nothing this user can use; a UserError when nothing is there.

    ``what`` describes the expected content, e.g. "the HPSv2 checkpoint file (.pt)".
    """
    value = options.get(key)
    value = default if value is None else value
    if value is None:  # Path("") would be the current folder, which exists
        raise UserError(f"reward {reward!r}: reward.options.{key} is not given; expected {what}")
    path = option_path(reward, key, value, what)  # '' too refused as every path is
    if not path.exists():
        raise UserError(f"reward {reward!r}: reward.options.{key} = {quote(str(path))} does not exist; expected {what}")
    return path


def first_line(err: BaseException) -> str:
    """The first line of an exception's message (at most 200 characters), for one-line errors."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(err)).strip()  # without terminal colour codes
    return text.splitlines()[0][:200] if text else type(err).__name__


def load_pretrained(reward: str, cls, folder: Path, what: str):
    """``cls.from_pretrained(folder)`` (a tokenizer or image processor), or a UserError naming the folder and
    ``what`` it should hold."""
    try:
        return cls.from_pretrained(str(folder))
    except Exception as err:  # OSError, ValueError, TypeError depending on which file is missing or broken
        raise UserError(f"reward {reward!r}: cannot load a {cls.__name__} from {quote(str(folder))} "
                        f"({first_line(err)}); "
                        f"expected {what}") from None


def reward_dtype(options: Mapping) -> torch.dtype:
    """The model dtype that the checked ``options["dtype"]`` names."""
    return DTYPES[options["dtype"]]


def feature_dtype(model_dtype: torch.dtype) -> torch.dtype:
    """Embeddings and heads run in float32 (as the released scorers do), or in float64 for a float64 model."""
    return torch.float64 if model_dtype == torch.float64 else torch.float32


def load_state_dict(reward: str, path: Path, what: str) -> dict[str, torch.Tensor]:
    """Tensors of a ``.safetensors`` file or of a torch checkpoint read with ``weights_only=True``.

    A torch checkpoint may hold the tensors directly or under ``"state_dict"`` / ``"model"``; a
    ``"module."`` prefix left by DistributedDataParallel is removed. ``what`` names the expected file
    (e.g. "the HPSv2 checkpoint (HPS_v2.1_compressed.pt)") in the one-line error raised for a folder,
    an unreadable or corrupt file, a pickled object that is not a state dict, or one holding no tensors.
    """
    def fail(problem: str) -> UserError:
        return UserError(f"reward {reward!r}: {quote(str(path))} {problem}; expected {what}")

    if path.is_dir():
        raise fail("is a folder")
    state: Any
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        try:
            state = load_file(str(path))
        except Exception as err:  # SafetensorError, OSError
            raise fail(f"is not a readable safetensors file ({first_line(err)})") from None
    else:
        try:
            state = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as err:  # pickle / zip errors come in many types; all mean "not a plain checkpoint"
            refused = re.search(r"Unsupported global: GLOBAL (\S+)", str(err))
            if refused:  # a pickled object (e.g. a whole model) rather than tensors
                raise fail(f"holds a pickled {refused.group(1)}, which weights_only=True refuses (a trusted "
                           f"file can be re-saved as .safetensors)") from None
            raise fail(f"is not a readable torch checkpoint ({type(err).__name__}, file corrupt or of another "
                       f"kind)") from None
    for wrapper in ("state_dict", "model"):
        if isinstance(state, dict) and isinstance(state.get(wrapper), dict):
            state = state[wrapper]
    if not isinstance(state, dict):
        raise fail(f"holds a {type(state).__name__}, not a state dict")
    tensors = {k.removeprefix("module."): v for k, v in state.items() if isinstance(v, torch.Tensor)}
    if not tensors:
        raise fail("holds no tensors")
    return tensors


def load_weights(
    reward: str,
    model: torch.nn.Module,
    state: Mapping[str, torch.Tensor],
    path: Path,
    ignore: Sequence[str] = (),
    what: str = "",
) -> None:
    """Load ``state`` into ``model``; keys starting with a prefix in ``ignore`` are dropped first.

    Raises a UserError naming ``path``, ``what`` was expected there and a few of the missing /
    unexpected keys when the checkpoint does not fit the architecture (a wrong file or architecture option).
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
        expected_file = f" (expected {what})" if what else ""
        raise UserError(f"reward {reward!r}: checkpoint {quote(str(path))}{expected_file} does not fit the configured "
                        f"architecture: {found}")
    model.load_state_dict(state)


@dataclass(frozen=True)
class ClipTransform:
    """The evaluation transform of OpenAI CLIP, OpenCLIP and BLIP, done on 8-bit PIL images as they do.

    Their reference code scores PIL images through torchvision's ``Resize(resize, BICUBIC)``,
    ``CenterCrop(crop)``, ``ToTensor()`` and ``Normalize(mean, std)``. Those steps are reproduced here
    without torchvision (whose PyPI wheels do not load beside the CPU build of torch):

    - images are first made 8-bit with :func:`agg_bench.engine.rewards.to_uint8`, as saving a sample would;
    - the shortest edge becomes ``resize`` and the other ``int(resize * long / short)`` (PIL bicubic,
      antialiased when shrinking; an image already at that size is left as is);
    - the ``crop`` x ``crop`` center crop starts at ``int(round((h - crop) / 2))``, Python's round
      (half to even), which is torchvision's rule (Hugging Face processors floor instead);
    - pixels become float32 ``/ 255`` and are normalised with float32 ``mean`` / ``std``.
    """

    resize: int
    crop: int
    mean: tuple[float, float, float] = CLIP_MEAN
    std: tuple[float, float, float] = CLIP_STD

    def __post_init__(self):
        if self.crop > self.resize:
            raise ValueError(f"crop {self.crop} larger than the resized shortest edge {self.resize}")

    def pil_image(self, pixels: np.ndarray) -> Image.Image:
        """One (H, W, 3) uint8 array resized and center-cropped."""
        image = Image.fromarray(pixels)
        width, height = image.size
        short, long = sorted((height, width))
        new_long = int(self.resize * long / short)
        size = (self.resize, new_long) if width <= height else (new_long, self.resize)  # PIL: (w, h)
        if size != image.size:
            image = image.resize(size, Image.Resampling.BICUBIC)
        width, height = image.size
        top, left = int(round((height - self.crop) / 2.0)), int(round((width - self.crop) / 2.0))
        return image.crop((left, top, left + self.crop, top + self.crop))

    def __call__(self, images: torch.Tensor) -> torch.Tensor:
        """(B, 3, H, W) in [0, 1] -> normalised float32 (B, 3, crop, crop) on the images' device."""
        crops = [np.asarray(self.pil_image(arr)) for arr in to_uint8(images)]
        x = torch.from_numpy(np.stack(crops)).permute(0, 3, 1, 2).to(torch.float32).div(255)
        mean = torch.tensor(self.mean, dtype=torch.float32).view(1, 3, 1, 1)
        std = torch.tensor(self.std, dtype=torch.float32).view(1, 3, 1, 1)
        return ((x - mean) / std).to(images.device)


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
    """``reward(images, prompts) -> (B,)`` on the CPU, scoring ``options["batch_size"]`` at a time.

    ``score_batch(images, prompts)`` receives float32 images already on ``device`` and returns (b,).
    Scores are float32, or float64 when the model runs in float64 (``options["dtype"]``), so that a
    float64 model can be compared with a reference to float64 precision.
    """
    batch_size = options["batch_size"]
    device, score_dtype = torch.device(device), feature_dtype(reward_dtype(options))

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
                batch_scores = score_batch(chunk, prompts[start:start + batch_size])
                scores.append(batch_scores.to(score_dtype).reshape(-1).cpu())
        return torch.cat(scores) if scores else torch.zeros(0, dtype=score_dtype)

    return reward
