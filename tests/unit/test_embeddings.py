"""Prompt embeddings: the pipelines' own encode_prompt, cached per (model, prompt file), counted encodings."""
import json
from pathlib import Path

import pytest
import torch

from agg_bench.cli import main
from agg_bench.config import load_config
from agg_bench.engine import text
from agg_bench.engine.models import Conditioning
from agg_bench.engine.text import (
    ENCODINGS,
    cache_key,
    concat_conditionings,
    encode_prompts,
    find_cached,
    load_embeddings,
    load_text_pipeline,
    prompt_set,
)
from agg_bench.errors import ConfigError, UserError
from agg_bench.io import atomic_path
from agg_bench.runtime.train import Session
from helpers import ENDED_PID

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = ["a red cat on the moon", "two dogs", "an owl perched on a mossy branch at night in the snow"]


@pytest.mark.parametrize("family", ["sd3", "flux", "qwenimage"])
def test_cached_rows_equal_the_pipelines_own_encode_prompt_per_prompt(family, folders):
    """Encoding a set in batches (padded across batches for Qwen-Image) gives each prompt's embedding as the
    pipeline computes it for that prompt alone."""
    folder = folders(family)
    cond = encode_prompts(family, folder, PROMPTS, max_sequence_length=8 if family != "qwenimage" else None,
                          batch_size=2)
    pipe = load_text_pipeline(family, folder)
    for i, prompt in enumerate(PROMPTS):
        with torch.no_grad():
            if family == "sd3":
                embeds, _, pooled, _ = pipe.encode_prompt(prompt, None, None, do_classifier_free_guidance=False,
                                                          max_sequence_length=8)
            elif family == "flux":
                embeds, pooled, _ = pipe.encode_prompt(prompt, None, max_sequence_length=8)
            else:
                embeds, _ = pipe.encode_prompt(prompt)
                pooled = None
        n = embeds.shape[1]
        torch.testing.assert_close(cond.encoder_hidden_states[i, :n], embeds[0], rtol=1e-5, atol=1e-6)
        if pooled is not None:
            torch.testing.assert_close(cond.pooled_projections[i], pooled[0], rtol=1e-5, atol=1e-6)
        if family == "qwenimage":
            # valid tokens: the user turn after the 34 dropped template tokens; padding is zero and masked
            user = pipe.tokenizer(pipe.prompt_template_encode.format(prompt)).input_ids[34:]
            assert int(cond.encoder_attention_mask[i].sum()) == n == len(user)
            assert not cond.encoder_hidden_states[i, n:].any() and not cond.encoder_attention_mask[i, n:].any()
    if family == "qwenimage":
        assert cond.encoder_hidden_states.shape[1] == int(cond.encoder_attention_mask.sum(1).max())


def test_concat_pads_tokens_and_masks():
    a = Conditioning(torch.ones(2, 3, 4), None, torch.ones(2, 3, dtype=torch.long))
    b = Conditioning(torch.full((1, 5, 4), 2.0), None, torch.tensor([[1, 1, 1, 1, 0]]))
    out = concat_conditionings([a, b])
    assert out.encoder_hidden_states.shape == (3, 5, 4) and out.encoder_attention_mask.tolist() == [
        [1, 1, 1, 0, 0], [1, 1, 1, 0, 0], [1, 1, 1, 1, 0]]
    assert float(out.encoder_hidden_states[:2, 3:].abs().sum()) == 0.0


def test_conditioning_keeps_its_mask_through_indexing_casting_and_repeats():
    cond = Conditioning(torch.randn(2, 3, 4), None, torch.tensor([[1, 1, 0], [1, 0, 0]]))
    moved = cond[torch.tensor([1, 0])].repeat_interleave(2).to(dtype=torch.float64)
    assert moved.encoder_hidden_states.dtype == torch.float64 and moved.encoder_attention_mask.dtype == torch.long
    assert moved.encoder_attention_mask.tolist() == [[1, 0, 0], [1, 0, 0], [1, 1, 0], [1, 1, 0]]
    assert set(Conditioning.from_tensors(cond.tensors()).tensors()) == {"encoder_hidden_states",
                                                                         "encoder_attention_mask"}


def test_second_run_uses_the_cache_and_a_changed_prompt_file_re_encodes(folders, tmp_path, capsys):
    folder = folders("flux")
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red cat\ntwo dogs on a beach\n")
    cache = tmp_path / "emb"
    args = ["--set", "model.family=flux", "--set", f"model.pretrained={folder}", "--set", f"prompts.file={prompts}",
            "--set", f"prompts.cache_dir={cache}", "--set", "prompts.max_sequence_length=8",
            "--set", "model.resolution=32", "--set", "sampling.steps=2", "--set", "grpo.group_size=2",
            "--set", "grpo.prompts_per_iteration=1", "--set", "train.iterations=1", "--set", "progress=false",
            "--set", "telemetry.enabled=false"]
    start = ENCODINGS.sets
    # the Snakemake rule's command: fill the cache before the runs
    assert main(["embed", *args[:10]]) == 0
    printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert printed["encoded"] is True and printed["prompts"] == 2 and ENCODINGS.sets == start + 1
    assert Path(printed["out"]).parent == cache
    for name in ("first", "second"):
        assert main(["run", *args, "--out", str(tmp_path / name)]) == 0
    assert ENCODINGS.sets == start + 1  # both runs read the cache
    session = Session(load_config(None, [a for a in args if a != "--set"]))
    cached, meta = load_embeddings(printed["out"])
    assert torch.equal(session.cond_all.encoder_hidden_states, cached.encoder_hidden_states)
    assert meta["prompts_sha256"] == text.file_sha256(prompts) and meta["n_prompts"] == "2"

    prompts.write_text("a red cat\ntwo dogs on a beach\na third prompt\n")
    assert main(["run", *args, "--out", str(tmp_path / "third")]) == 0
    assert ENCODINGS.sets == start + 2
    assert len(list(cache.glob("*.safetensors"))) == 2
    # an explicit --out for a cached set copies instead of encoding; runs find it by key under any name
    out = cache / "named-by-the-workflow.safetensors"
    assert main(["embed", *args[:10], "--out", str(out)]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["encoded"] is False
    assert ENCODINGS.sets == start + 2 and out.is_file()


def test_cache_key_follows_model_prompts_and_settings(folders, tmp_path):
    folder = folders("flux")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "a red cat"}\n')
    base = cache_key("flux", folder, prompt_set(prompts), None, torch.float32)
    assert base == cache_key("flux", folder, prompt_set(prompts), None, torch.float32)
    assert base != cache_key("flux", folder, prompt_set(prompts), 8, torch.float32)
    assert base != cache_key("flux", folder, prompt_set(prompts), None, torch.bfloat16)
    prompts.write_text('{"prompt": "a red cat", "tags": []}\n')  # same prompts, other bytes: a new set
    assert base != cache_key("flux", folder, prompt_set(prompts), None, torch.float32)
    config = folder / "text_encoder_2" / "config.json"
    original = config.read_text()
    try:
        config.write_text(original + "\n")
        changed = cache_key("flux", folder, prompt_set(prompts), None, torch.float32)
    finally:
        config.write_text(original)
    assert changed != cache_key("flux", folder, prompt_set(prompts), None, torch.float32)
    assert find_cached(tmp_path / "absent", base) is None


def test_embed_of_the_tiny_preset_writes_its_hash_embedding(tmp_path, capsys):
    start = ENCODINGS.sets
    assert main(["embed", "--set", "model.family=flux", "--out", str(tmp_path / "tiny.safetensors")]) == 0
    printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    cond, meta = load_embeddings(printed["out"])
    session_cond = Session(load_config(None, ["model.family=flux", "model.resolution=32"])).cond_all
    assert torch.equal(cond.encoder_hidden_states, session_cond.encoder_hidden_states)
    assert printed["encoded"] is False and ENCODINGS.sets == start and meta["family"] == "flux"


def test_embed_errors_name_the_key(folders, tmp_path, capsys):
    assert main(["embed", "--set", "model.family=flux", "--out", str(tmp_path / "x.npz")]) == 2
    assert "--out" in capsys.readouterr().err
    broken = tmp_path / "no-t5"
    import shutil

    shutil.copytree(folders("flux"), broken)
    shutil.rmtree(broken / "text_encoder_2")
    with pytest.raises(ConfigError) as err:
        text.embed(load_config(None, ["model.family=flux", f"model.pretrained={broken}",
                                      f"prompts.cache_dir={tmp_path}"]))
    assert err.value.key == "model.pretrained" and "text_encoder_2" in err.value.expected


@pytest.mark.parametrize("component, suffixes", [("text_encoder", (".safetensors", ".json")),
                                                  ("tokenizer_2", (".safetensors", ".json")),
                                                  ("text_encoder", (".safetensors",))])
def test_embed_of_a_model_whose_text_encoder_does_not_load_is_one_line(folders, tmp_path, capsys, component, suffixes):
    """A text encoder or tokenizer cut short: the refusal came after diffusers' "Loading pipeline components"
    progress bar (and transformers' own messages) on stderr; now it is the only line, with nothing written. Its
    weights alone cut short were safetensors' traceback."""
    import shutil

    broken = tmp_path / "cut"
    shutil.copytree(folders("sd3"), broken)
    for path in (broken / component).iterdir():
        if path.suffix in suffixes:
            path.write_bytes(path.read_bytes()[:7])
    out = tmp_path / "e.safetensors"
    capsys.readouterr()
    code = main(["embed", "--set", "model.family=sd3", f"--set=model.pretrained={broken}",
                 f"--set=prompts.cache_dir={tmp_path / 'cache'}", "--out", str(out)])
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and "model.pretrained" in lines[0], lines
    assert "loadable text encoders and tokenizers" in lines[0] and not out.exists()
    assert not (tmp_path / "cache").exists()


@pytest.mark.parametrize("kind, words", [
    ("file", "config error: prompts.cache_dir = '{cache}': expected a folder (made if missing), not a file or a "
             "symbolic link"),
    ("link", "config error: prompts.cache_dir = '{cache}': expected a folder (made if missing), not a file or a "
             "symbolic link"),
    ("under a file", "{cache}/sd3-tiny-prompts-"),
    ("someone's file", "the file exists and is not an agg-bench embedding file; move it aside or give another "
                       "prompts.cache_dir"),
    ("folder", "is a folder; expected a file path"),
])
def test_embed_into_a_cache_folder_that_is_not_one_is_refused(tmp_path, capsys, kind, words):
    """`agg-bench embed` without --out writes into prompts.cache_dir: a file there was a FileExistsError's
    traceback, a symbolic link was written through (into the folder it points to), a file of someone's with the
    cache file's name was replaced. One line naming the key, exit 2, nothing touched."""
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    cache = tmp_path / "cache"
    name = "sd3-tiny-prompts-2de0bfc8101d.safetensors"  # config/run.yaml's prompts on the tiny SD3 preset
    if kind == "file":
        cache.write_text("mine")
    elif kind == "link":
        cache.symlink_to(other)
    elif kind == "under a file":
        cache = other / "notes.txt" / "sub"
    else:
        cache.mkdir()
        (cache / name).mkdir() if kind == "folder" else (cache / name).write_text("mine")
    before = {str(p): None if p.is_dir() else p.read_bytes() for p in sorted(tmp_path.rglob("*"))}
    argv = ["embed", "--config", str(ROOT / "config" / "run.yaml"), "--set", f"prompts.cache_dir={cache}"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "prompts.cache_dir" in err[0] and words.format(cache=cache) in err[0], err
    assert {str(p): None if p.is_dir() else p.read_bytes() for p in sorted(tmp_path.rglob("*"))} == before


def test_embed_fills_a_new_cache_folder_and_replaces_its_own_file(tmp_path, capsys):
    argv = ["embed", "--config", str(ROOT / "config" / "run.yaml"), "--set", f"prompts.cache_dir={tmp_path / 'a' / 'b'}"]
    for _ in range(2):
        assert main(argv) == 0
        out = Path(json.loads(capsys.readouterr().out.strip().splitlines()[-1])["out"])
        assert out.parent == tmp_path / "a" / "b" and load_embeddings(out)[1]["family"] == "sd3"
    assert [p.name for p in (tmp_path / "a" / "b").iterdir()] == [out.name]
    # a writer killed while it wrote the file left its temporary (the whole file) in the cache for good
    out.rename(atomic_path(out, ENDED_PID))
    assert main(argv) == 0
    assert [p.name for p in (tmp_path / "a" / "b").iterdir()] == [out.name]


def test_a_runs_cache_folder_is_checked_before_the_prompts_are_encoded(folders, tmp_path, monkeypatch):
    """A run of a local model writes its embeddings into prompts.cache_dir: checked as embed checks it, before
    the text encoders run."""
    (tmp_path / "cache").write_text("mine")
    monkeypatch.setattr(text, "encode_prompts", lambda *a, **k: pytest.fail("encoded before the check"))
    cfg = load_config(None, ["model.family=flux", f"model.pretrained={folders('flux')}",
                             f"prompts.cache_dir={tmp_path / 'cache'}"])
    with pytest.raises(ConfigError) as err:
        text.run_embeddings(cfg, prompt_set(cfg.prompts.file))
    assert err.value.key == "prompts.cache_dir" and (tmp_path / "cache").read_text() == "mine"


def test_an_embeddings_file_without_token_embeddings_is_refused(tmp_path):
    """A file marked as embeddings but without its token embeddings is one line naming the file, not a
    conditioning that fails later on its missing tensor."""
    from safetensors.torch import save_file

    from agg_bench.engine.text import FORMAT

    path = tmp_path / "pooled-only.safetensors"
    save_file({"pooled_projections": torch.zeros(2, 4)}, str(path), metadata={"format": FORMAT})
    with pytest.raises(UserError, match="encoder_hidden_states"):
        load_embeddings(path)


@pytest.mark.parametrize("tensors, words", [
    ({"encoder_hidden_states": torch.zeros(2, 3, 4, dtype=torch.int32)}, "encoder_hidden_states of dtype int32"),
    ({"encoder_hidden_states": torch.zeros(2, 4)}, "encoder_hidden_states of shape (2, 4)"),
    ({"encoder_hidden_states": torch.zeros(2, 3, 4), "pooled_projections": torch.zeros(3, 4)},
     "pooled_projections of shape (3, 4)"),
    ({"encoder_hidden_states": torch.zeros(2, 3, 4), "encoder_attention_mask": torch.ones(2, 5, dtype=torch.int64)},
     "encoder_attention_mask of shape (2, 5)"),
    ({"encoder_hidden_states": torch.full((2, 3, 4), float("nan"))}, "encoder_hidden_states holds non-finite"),
    ({"encoder_hidden_states": torch.zeros(2, 3, 4), "script": torch.zeros(1)}, "script"),
])
def test_an_embeddings_file_of_other_tensors_is_refused_naming_it(tmp_path, tensors, words):
    """A cache file is used by any run whose key it carries: int32 embeddings of the same byte size ran to status
    ok on other numbers. The tensors' names, dtypes, shapes and values are the writer's, or one line naming the
    file."""
    from safetensors.torch import save_file

    from agg_bench.engine.text import FORMAT

    path = tmp_path / "crafted.safetensors"
    save_file(tensors, str(path), metadata={"format": FORMAT})
    with pytest.raises(UserError) as err:
        load_embeddings(path)
    assert str(path) in str(err.value) and words in str(err.value), str(err.value)
    assert len(str(err.value).splitlines()) == 1


def test_an_entry_keyed_on_the_file_bytes_alone_misses(folders, tmp_path, monkeypatch):
    """The key hashed the prompt file's bytes only, and the reading of those bytes changed (a byte-order mark
    dropped, lines no longer split at U+2028): an entry made before held embeddings of other prompts, and hit."""
    import hashlib

    folder = folders("flux")
    prompts = tmp_path / "p.txt"
    prompts.write_bytes("\ufeffa red cat\u2028on the moon\ntwo dogs\n".encode())
    current = prompt_set(prompts)
    assert current.prompts == ["a red cat\u2028on the moon", "two dogs"]
    # the key as it was computed before the prompts were part of it
    old = hashlib.sha256("\0".join([text.FORMAT, "flux", text.model_identity("flux", folder), current.sha256,
                                    "None", "float32"]).encode()).hexdigest()
    assert cache_key("flux", folder, current, None, torch.float32) != old
    # the same bytes read as other prompts are another key
    monkeypatch.setattr(text, "load_prompts", lambda file: ["\ufeffa red cat", "on the moon", "two dogs"])
    other = prompt_set(prompts)
    assert other.sha256 == current.sha256
    assert cache_key("flux", folder, other, None, torch.float32) != cache_key("flux", folder, current, None,
                                                                             torch.float32)
