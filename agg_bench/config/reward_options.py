"""The options of the built-in rewards (``reward.options``), typed with the run config's :func:`option`.

Each reward's options are a dataclass of :func:`~agg_bench.config.sections.option` fields, as a method's and a
cache's are (:mod:`agg_bench.config.options`): the default, the meaning and the bounds written once. From them come
the refusals of :func:`reward_options` (an unknown key, a wrong type, NaN, a value out of bounds, a required file
not given, a path that names nothing this user can use: one ConfigError naming ``reward.options.<key>``), made
when a run config is checked (:func:`agg_bench.runtime.config_check.check_config`: ``agg-bench run``, ``plan``, a
cell's jobs and the sweep's check before any job starts) and again by each reward as it is built, and the option
tables of ``docs/configuration.md`` (:mod:`agg_bench.config.docs`). What only the files can tell (that a
checkpoint exists and holds the model) is the reward's to say when it loads them.

A reward registered by other code (a method's module) is not listed here: its options are its own to check.

This module imports no torch.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Literal, Mapping

from ..errors import ConfigError
from .options import MAX_BATCH, Options, option_names, typed_options
from .sections import option

SCENE_PARTS = ("color", "shape", "position", "count")  # the scene reward's sub-scores (reward_<part>)
SCENE_WEIGHTS = "null or a mapping of color, shape, position, count to numbers >= 0, not all 0"

# what the learned rewards' files are (their refusals when loading them name them too)
CLIP_MODEL = "a folder with a transformers CLIP model (config.json + model.safetensors or pytorch_model.bin)"
CLIP_PROCESSOR = "a folder with the CLIP processor files (preprocessor_config.json, tokenizer files)"
CLIP_TOKENIZER = "a folder with CLIP tokenizer files (vocab.json + merges.txt, or tokenizer.json)"


def path_option(doc: str, file: bool, required: bool = True) -> Any:
    """A ``file`` (else a folder) the reward loads: a string, never empty (which would name the current folder), as
    written (no ``~`` expanded), in the words of the run config's path keys (``prompts.file``); null where not
    given, which a ``required`` one refuses."""
    kind = "a file's path" if file else "a folder's path"
    expected = f"{kind} (required: null is refused)" if required else f"{kind}, or null"
    return dataclasses.field(default=None, metadata={"doc": doc, "constraints": {"min_length": 1, "expected": expected},
                                                     "path": {"file": file, "required": required}})


@dataclass
class RewardOptions(Options):
    """A reward's options; :meth:`check` refuses a required file or folder not given, and a path that names nothing
    this user can use (:func:`~agg_bench.outdir.named_path_problem`, as for every path of a config)."""

    def check(self) -> None:
        from ..outdir import named_path_problem

        for f in dataclasses.fields(self):
            path = f.metadata.get("path")
            value = None if path is None else getattr(self, f.name)
            if path is None or (value is None and not path["required"]):
                continue
            if value is None:
                raise ConfigError(f"reward.options.{f.name}", value, f"{f.metadata['doc']}, which this reward loads")
            problem = named_path_problem(value, path["file"])
            if problem is not None:
                raise ConfigError(f"reward.options.{f.name}", value, f"{f.metadata['doc']} ({problem})")


@dataclass
class NoOptions(RewardOptions):
    """Options of `smoothness` (minus the total variation)."""


@dataclass
class JpegOptions(RewardOptions):
    """Options of `jpeg_compressibility` and `jpeg_incompressibility` (DDPO's JPEG size)."""

    quality: int = option(95, "the JPEG quality the images are saved at", minimum=1, maximum=100)


@dataclass
class SceneOptions(RewardOptions):
    """Options of `scene`, the learning testbed's verifiable reward."""

    foreground: float = option(0.3, "the brightness (of a pixel's brightest channel) above which it is an object's",
                               exclusive_minimum=0, exclusive_maximum=1)
    min_area: float = option(0.005, "the smallest share of the image an object covers to be counted",
                             exclusive_minimum=0, exclusive_maximum=1)
    weights: dict | None = option(
        None, "each sub-score's weight in the reward: null, their plain mean; a mapping of some of `color`, "
              "`shape`, `position`, `count` to numbers >= 0, not all 0 (an unnamed one weighs 0: what the reward "
              "does not see)",
        expected=SCENE_WEIGHTS)

    def check(self) -> None:
        value = self.weights
        if value is not None and (
                not value or any(k not in SCENE_PARTS for k in value)
                or any(isinstance(w, bool) or not isinstance(w, (int, float)) or not math.isfinite(w) or w < 0
                       for w in value.values())
                or not sum(value.values()) > 0):
            raise ConfigError("reward.options.weights", value, SCENE_WEIGHTS)


@dataclass
class LearnedOptions(RewardOptions):
    """What every learned reward takes."""

    batch_size: int = option(16, "images per scoring call", minimum=1, maximum=MAX_BATCH)
    dtype: Literal["float32", "float64", "bfloat16", "float16"] = option(
        "float32", "the reward model's weights (the embeddings and heads run in float32, float64 for a float64 "
                   "model: equality tests against references)")


@dataclass
class HPSv2Options(LearnedOptions):
    """Options of `hpsv2` (HPSv2 / v2.1)."""

    checkpoint: str | None = path_option("the HPSv2 state dict file (HPS_v2.1_compressed.pt, or .safetensors)", file=True)
    tokenizer: str | None = path_option(CLIP_TOKENIZER, file=False)
    model_config: str | dict | None = option(
        None, "the OpenCLIP model config: null (ViT-H-14), a model name, a mapping or a JSON file with embed_dim, "
              "vision_cfg and text_cfg", expected="a model name, a mapping or a JSON file's path, or null")


@dataclass
class ImageRewardOptions(LearnedOptions):
    """Options of `imagereward` (ImageReward)."""

    checkpoint: str | None = path_option("the ImageReward state dict file (ImageReward.pt, or .safetensors)", file=True)
    tokenizer: str | None = path_option("a folder with the bert-base-uncased tokenizer files (vocab.txt)", file=False)
    vision_config: str | dict | None = option(
        None, "the BLIP vision config: null (the release's ViT-L/16 at 224 px), a mapping or a JSON file of its fields",
        expected="a mapping or a JSON file's path, or null")
    med_config: str | dict | None = option(
        None, "BLIP's text-encoder config: null (the release's), a mapping or a JSON file (med_config.json)",
        expected="a mapping or a JSON file's path, or null")


@dataclass
class ClipOptions(LearnedOptions):
    """Options of a reward built on a transformers CLIP model."""

    model: str | None = path_option(CLIP_MODEL, file=False)
    processor: str | None = path_option(f"{CLIP_PROCESSOR}; null: the model folder", file=False, required=False)


@dataclass
class PickScoreOptions(ClipOptions):
    """Options of `pickscore` (PickScore_v1)."""


@dataclass
class ClipScoreOptions(ClipOptions):
    """Options of `clipscore` (CLIPScore)."""

    w: float = option(2.5, "the score's weight: w x max(cos, 0)", exclusive_minimum=0)
    prefix: str = option("", "text put before each prompt")


@dataclass
class AestheticOptions(ClipOptions):
    """Options of `aesthetic` (the LAION aesthetic predictor)."""

    head: str | None = path_option("the LAION aesthetic head state dict file (e.g. sac+logos+ava1-l14-linearMSE.pth, "
                                   "or the v1 linear head)", file=True)


# each built-in reward's options (a reward registered elsewhere checks its own)
REWARD_OPTIONS: dict[str, type[RewardOptions]] = {
    "jpeg_compressibility": JpegOptions, "jpeg_incompressibility": JpegOptions, "smoothness": NoOptions,
    "scene": SceneOptions, "hpsv2": HPSv2Options, "pickscore": PickScoreOptions, "imagereward": ImageRewardOptions,
    "clipscore": ClipScoreOptions, "aesthetic": AestheticOptions,
}


def reward_options(name: str, given: Mapping[str, Any]) -> dict[str, Any]:
    """The options ``given`` of the built-in reward ``name``, checked (module docstring) and typed, every option
    present (a default where not given); a reward not listed keeps ``given`` as it is."""
    cls = REWARD_OPTIONS.get(name)
    if cls is None:
        return dict(given)
    typed = typed_options(cls, given, prefix="reward.options", owner=f"reward {name!r}")
    return {key: getattr(typed, key) for key in option_names(cls)}


__all__ = ["CLIP_MODEL", "CLIP_PROCESSOR", "CLIP_TOKENIZER", "REWARD_OPTIONS", "RewardOptions", "SCENE_PARTS",
           "reward_options"]
