"""The one way agg-bench quiets diffusers, transformers and huggingface_hub while it loads a model
(agg_bench/engine/hf_logging.py): every loading site prints nothing from the libraries, on a tiny saved model
that loads and on one that does not, and leaves their verbosity and progress bars as they were."""
from __future__ import annotations

import logging
import shutil

import huggingface_hub.utils as hub_utils
import pytest
import torch
from diffusers.utils import logging as diffusers_logging

from agg_bench.engine import text
from agg_bench.engine.hf_logging import quiet_loading
from agg_bench.engine.models import TRANSFORMER_CLASSES, _load_component
from agg_bench.errors import ConfigError, UserError

transformers = pytest.importorskip("transformers")
from transformers.utils import logging as transformers_logging

from reward_assets import tiny_hf_clip, write_clip_tokenizer

LIBS = (diffusers_logging, transformers_logging, hub_utils.logging)


def state() -> tuple:
    """Every verbosity and progress-bar switch quiet_loading touches."""
    return (tuple(lib.get_verbosity() for lib in LIBS), diffusers_logging.is_progress_bar_enabled(),
            transformers_logging.is_progress_bar_enabled(), hub_utils.are_progress_bars_disabled())


@pytest.fixture
def loud():
    """The libraries at their loudest (INFO logs, every progress bar on), as a user may have set them; the
    state as it was afterwards."""
    before = state()
    for lib in LIBS:
        lib.set_verbosity(logging.INFO)
    diffusers_logging.enable_progress_bar()
    transformers_logging.enable_progress_bar()
    hub_utils.enable_progress_bars()
    yield state()
    for lib, verbosity in zip(LIBS, before[0]):
        lib.set_verbosity(verbosity)
    for lib, on in zip((diffusers_logging, transformers_logging), before[1:3]):
        (lib.enable_progress_bar if on else lib.disable_progress_bar)()
    (hub_utils.disable_progress_bars if before[3] else hub_utils.enable_progress_bars)()


@pytest.mark.parametrize("level", [logging.ERROR, logging.CRITICAL, None])
def test_quiet_loading_sets_the_level_and_restores_everything_when_the_block_raises(loud, level):
    with pytest.raises(RuntimeError, match="inside"):
        with quiet_loading(level):
            verbosities, diffusers_bars, transformers_bars, hub_bars_off = state()
            assert verbosities == (level or logging.INFO,) * len(LIBS)
            assert not diffusers_bars and not transformers_bars and hub_bars_off
            raise RuntimeError("inside")
    assert state() == loud


def truncate_weights(folder):
    """A component's config and weights cut short, as an interrupted copy leaves them."""
    for path in folder.iterdir():
        if path.suffix in (".safetensors", ".json"):
            path.write_bytes(path.read_bytes()[:7])


def load_transformer(folder):
    return _load_component(TRANSFORMER_CLASSES["sd3"], str(folder / "transformer"), str(folder),
                           "transformer weights")


def load_text(folder):
    return text.load_text_pipeline("sd3", folder)


@pytest.mark.parametrize("load, component", [(load_transformer, "transformer"), (load_text, "text_encoder")])
def test_a_model_folder_loads_silently_and_restores_the_libraries(folders, tmp_path, capfd, loud, load, component):
    """engine/models.py (diffusers components) and engine/text.py (a pipeline's text encoders) on the tiny SD3
    folder: nothing on stdout or stderr from a load at INFO verbosity with every bar on, neither when the
    folder loads nor when a component's files are cut short (the ConfigError is the one line); the libraries as they
    were afterwards."""
    folder = folders("sd3")
    capfd.readouterr()
    assert load(folder) is not None
    assert capfd.readouterr() == ("", "") and state() == loud
    broken = tmp_path / "cut"
    shutil.copytree(folder, broken)
    truncate_weights(broken / component)
    capfd.readouterr()
    with pytest.raises(ConfigError) as err:
        load(broken)
    assert err.value.key == "model.pretrained"
    assert capfd.readouterr() == ("", "") and state() == loud


@pytest.fixture(scope="module")
def clip_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("clip")
    tiny_hf_clip(write_clip_tokenizer(folder), seed=0, dtype=torch.float32).save_pretrained(str(folder))
    transformers.CLIPImageProcessorPil(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}
                                       ).save_pretrained(str(folder))
    return folder


def test_a_vision_tower_from_a_full_clip_folder_loads_silently_and_restores_the_libraries(clip_folder, tmp_path,
                                                                                          capfd, loud):
    """engine/reward_models/hf_clip.py: the aesthetic reward's vision tower from a full CLIP folder (whose text
    tower transformers reports as unused weights) prints nothing, loaded or refused, and restores the libraries."""
    from agg_bench.config.reward_options import reward_options
    from agg_bench.engine.reward_models.hf_clip import HFClip

    capfd.readouterr()
    HFClip("aesthetic", reward_options("pickscore", {"model": str(clip_folder)}), "cpu", transform="openai",
           vision_only=True)
    assert capfd.readouterr() == ("", "") and state() == loud
    broken = tmp_path / "cut"
    shutil.copytree(clip_folder, broken)
    (broken / "model.safetensors").write_bytes((clip_folder / "model.safetensors").read_bytes()[:7])
    capfd.readouterr()
    with pytest.raises(UserError, match="cannot load a CLIPVisionModelWithProjection"):
        HFClip("aesthetic", reward_options("pickscore", {"model": str(broken)}), "cpu", transform="openai",
               vision_only=True)
    assert capfd.readouterr() == ("", "") and state() == loud
