"""Prompt embeddings from a model's own text encoders, computed once per prompt set and cached on disk.

Real models (``model.pretrained``) are conditioned with the embeddings their diffusers pipeline makes
(``encode_prompt`` of the pipeline the family's spec names, e.g. StableDiffusion3Pipeline, loaded from
the local folder without transformer and VAE). They are computed once per (model, prompt file) and stored as
safetensors under ``prompts.cache_dir``; a run looks there first and only encodes on a miss.
``agg-bench embed`` fills the cache ahead of the runs. The tiny preset keeps the download-free token-hash
embedding of :mod:`agg_bench.engine.prompts`.

An embeddings file holds ``encoder_hidden_states`` (N, L, D) float32, ``pooled_projections`` (N, P) where
the family has pooled embeddings (SD3, FLUX), ``encoder_attention_mask`` (N, L) int64 where its
embeddings carry a mask (Qwen-Image: prompts are padded to the longest one),
and string metadata: ``format``, ``key`` (the cache key), ``family``, ``pretrained``, ``prompts_file``,
``prompts_sha256``, ``n_prompts``, ``max_sequence_length``, ``encoder_dtype``.
"""
from __future__ import annotations

import gc
import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from ..config import RunConfig
from ..errors import ConfigError, UserError, first_message_line, quote, shown
from ..io import atomic_target, remove_stale_temps
from ..jsonfiles import open_regular
from ..outdir import check_file, check_suffix, check_writable
from .families import family_spec
from .hf_logging import quiet_loading
from .models import Conditioning, folder_json, text_dims, unreplaced_folder
from .prompts import TOKEN_HASH_FILE, hash_embed, load_prompts, token_hash_settings

FORMAT = "agg-bench-embeddings/1"
BUILTIN_PROMPTS = Path(__file__).parent.parent / "data" / "prompts.txt"
ENCODE_BATCH = 8  # prompts per text-encoder call
# Files whose content identifies a text encoder without reading its weights (weights count by size).
CONFIG_SUFFIXES = (".json", ".txt", ".model", ".tiktoken")


@dataclass
class EncodeCounter:
    """Text-encoder work done in this process: ``sets`` prompt sets and ``prompts`` prompts encoded."""

    sets: int = 0
    prompts: int = 0


ENCODINGS = EncodeCounter()


@dataclass
class PromptSet:
    """The prompts of a run, the file they came from and the SHA-256 of its bytes."""

    prompts: list[str]
    path: Path
    sha256: str


def file_sha256(path: str | Path) -> str:
    """The SHA-256 of the regular file ``path`` (lowercase hex); a pipe or a device put in a file's place is an
    OSError (:func:`~agg_bench.jsonfiles.open_regular`), never read forever."""
    digest = hashlib.sha256()
    with open_regular(path) as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def prompt_set(file: str | Path | None) -> PromptSet:
    """The prompt set of ``prompts.file`` (None: the built-in set)."""
    path = Path(file) if file else BUILTIN_PROMPTS
    prompts = load_prompts(file if file else path)  # as written: pathlib drops a trailing /
    return PromptSet(prompts, path, file_sha256(path))


def model_identity(family: str, pretrained: str | Path) -> str:
    """A hash of the resolved folder path, ``model_index.json`` and the text encoders' and tokenizers'
    config and vocabulary files (weight files enter by name and size only, so large folders hash fast)."""
    root = Path(pretrained).resolve()
    digest = hashlib.sha256(f"{family}\0{root}\0".encode())
    files = [root / "model_index.json"] if (root / "model_index.json").is_file() else []
    for component in family_spec(family).text_components:
        folder = root / component
        if folder.is_dir():
            files += sorted(p for p in folder.rglob("*") if p.is_file())
    for path in files:
        rel = path.relative_to(root).as_posix()
        if path.suffix in CONFIG_SUFFIXES:
            digest.update(f"{rel}\0{file_sha256(path)}\0".encode())
        else:
            digest.update(f"{rel}\0{path.stat().st_size}\0".encode())
    return digest.hexdigest()


def encoder_dtype(model_dtype: str) -> torch.dtype:
    """Text encoders run in bfloat16 for bfloat16 runs, float32 otherwise."""
    return torch.bfloat16 if model_dtype == "bfloat16" else torch.float32


def cache_key(family: str, pretrained: str | Path, prompts: PromptSet, max_sequence_length: int | None,
              dtype: torch.dtype) -> str:
    """The cache key: model identity, prompt-file content, the prompts as parsed from it and encoding settings.

    The parsed prompts are keyed besides the file's bytes because the same bytes were once read as other
    prompts (a byte-order mark kept on the first, lines split at U+2028, U+2029 and U+0085): an entry keyed
    before that holds embeddings of those prompts and misses, as does any entry whose prompts a later reading
    of its file would not give."""
    parsed = hashlib.sha256(json.dumps(prompts.prompts, ensure_ascii=True).encode()).hexdigest()
    parts = [FORMAT, family, model_identity(family, pretrained), prompts.sha256, f"prompts {parsed}",
             str(max_sequence_length), str(dtype).removeprefix("torch.")]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()


# ----- encoding with the pipelines' own encode_prompt ----------------------------------------------
def load_text_pipeline(family: str, pretrained: str | Path, dtype: torch.dtype = torch.float32,
                       device: str | torch.device = "cpu"):
    """The family's diffusers pipeline from the local folder with text encoders and tokenizers only."""
    root = Path(pretrained)
    if not root.is_dir():
        raise ConfigError("model.pretrained", str(pretrained), "an existing local diffusers folder")
    spec = family_spec(family)
    missing = [c for c in ("model_index.json", *spec.text_components) if not (root / c).exists()]
    if missing:
        raise ConfigError("model.pretrained", str(pretrained),
                          f"a local diffusers folder with the {family} text encoders (missing: {', '.join(missing)})")
    index = folder_json(str(pretrained), "model_index.json", "the pipeline's diffusers index")
    if not isinstance(index.get("_class_name"), str):
        raise ConfigError("model.pretrained", str(pretrained), "a model_index.json that names the pipeline's "
                          f"_class_name (found {quote(index.get('_class_name'))})")
    for key in spec.text_components:
        entry = index.get(key)
        if not (isinstance(entry, list) and len(entry) == 2 and all(isinstance(e, str) for e in entry)):
            raise ConfigError("model.pretrained", str(pretrained),
                              f"a model_index.json that names the {key} as [library, class] (found {quote(entry)})")
    try:
        with quiet_loading():
            pipe = spec.pipeline_cls().from_pretrained(str(root), transformer=None, vae=None, dtype=dtype,
                                                           local_files_only=True)
    # Type/KeyError: a config of the wrong shape; SafetensorError: a weights file cut short (transformers passes it on)
    except (OSError, ValueError, TypeError, KeyError, SafetensorError) as err:
        raise ConfigError("model.pretrained", str(pretrained),
                          f"loadable text encoders and tokenizers ({first_message_line(err)})") from err
    pipe.set_progress_bar_config(disable=True)
    return pipe.to(device)


def concat_conditionings(parts: list[Conditioning]) -> Conditioning:
    """Stack batches along the batch axis; token axes are zero-padded (mask 0) to the longest batch."""
    length = max(p.encoder_hidden_states.shape[1] for p in parts)

    def pad(t: torch.Tensor) -> torch.Tensor:
        extra = length - t.shape[1]
        if extra == 0:
            return t
        return torch.cat([t, t.new_zeros((t.shape[0], extra, *t.shape[2:]))], dim=1)

    def every(tensors: list[torch.Tensor | None], name: str) -> list[torch.Tensor]:
        present = [t for t in tensors if t is not None]
        if len(present) != len(tensors):
            raise ValueError(f"concat_conditionings: {name} in some parts only (parts of one encoder hold the same)")
        return present

    pooled = [p.pooled_projections for p in parts]
    masks = [p.encoder_attention_mask for p in parts]
    return Conditioning(
        torch.cat([pad(p.encoder_hidden_states) for p in parts]),
        None if pooled[0] is None else torch.cat(every(pooled, "pooled_projections")),
        None if masks[0] is None else torch.cat([pad(m) for m in every(masks, "encoder_attention_mask")]),
    )


def encode_prompts(family: str, pretrained: str | Path, prompts: list[str], device: str | torch.device = "cpu",
                   max_sequence_length: int | None = None, dtype: torch.dtype = torch.float32,
                   batch_size: int = ENCODE_BATCH) -> Conditioning:
    """Embeddings of ``prompts`` by the model's own text encoders (float32, on CPU); counted in ENCODINGS."""
    pipe = load_text_pipeline(family, pretrained, dtype, device)
    encode = family_spec(family).encode_prompts
    options = {} if max_sequence_length is None else {"max_sequence_length": max_sequence_length}
    parts = []
    try:
        with torch.no_grad():
            for start in range(0, len(prompts), batch_size):
                part = Conditioning(*encode(pipe, prompts[start:start + batch_size], device, options))
                parts.append(part.to("cpu", torch.float32))
    finally:
        del pipe
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    ENCODINGS.sets += 1
    ENCODINGS.prompts += len(prompts)
    return concat_conditionings(parts)


# ----- the cache --------------------------------------------------------------------------------
def save_embeddings(path: str | Path, cond: Conditioning, metadata: Mapping[str, object]) -> Path:
    """Write ``cond`` and ``metadata`` to ``path`` atomically."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().cpu().contiguous() for k, v in cond.tensors().items()}
    with atomic_target(path) as tmp:
        save_file(tensors, str(tmp), metadata={"format": FORMAT, **{k: str(v) for k, v in metadata.items()}})
    return path


def is_embeddings_file(path: str | Path) -> bool:
    """Whether ``path`` is an embedding file this module wrote (its metadata's format)."""
    return read_metadata(path).get("format") == FORMAT


def read_metadata(path: str | Path) -> dict[str, str]:
    try:
        with safe_open(str(path), framework="pt") as fh:
            return dict(fh.metadata() or {})
    except Exception:  # a foreign or torn file is not a cache entry
        return {}


def load_embeddings(path: str | Path) -> tuple[Conditioning, dict[str, str]]:
    meta = read_metadata(path)
    if meta.get("format") != FORMAT:
        raise UserError(f"{shown(path)}: not an agg-bench embeddings file (write one with `agg-bench embed`)")
    tensors = load_file(str(path))
    if "encoder_hidden_states" not in tensors:
        raise UserError(f"{shown(path)}: holds no encoder_hidden_states tensor (the prompts' token embeddings); "
                        "write the file again with `agg-bench embed`")
    problem = tensors_problem(tensors)
    if problem is not None:
        raise UserError(f"{shown(path)}: {problem}, not the embeddings `agg-bench embed` writes; write the file again "
                        "with it")
    return Conditioning.from_tensors(tensors), meta


# what an embeddings file holds: each tensor's dtype and its axes (N prompts, L tokens, D and P widths)
EMBEDDING_TENSORS = {"encoder_hidden_states": (torch.float32, "NLD"), "pooled_projections": (torch.float32, "NP"),
                     "encoder_attention_mask": (torch.int64, "NL")}


def tensors_problem(tensors: Mapping[str, torch.Tensor]) -> str | None:
    """What makes ``tensors`` other than the embeddings :func:`save_embeddings` writes: another tensor's name,
    another dtype or rank, a prompt or token count that differs from the token embeddings', or a non-finite
    value; None when nothing does."""
    other = next((name for name in tensors if name not in EMBEDDING_TENSORS), None)
    if other is not None:
        return f"holds a tensor {quote(other)} (an embeddings file holds {', '.join(EMBEDDING_TENSORS)})"
    sizes: dict[str, int] = {}
    for name, (dtype, axes) in EMBEDDING_TENSORS.items():  # the token embeddings first: they set N and L
        if name not in tensors:
            continue
        tensor, shape = tensors[name], tuple(tensors[name].shape)
        if tensor.dtype != dtype:
            return f"{name} of dtype {str(tensor.dtype).removeprefix('torch.')}, expected " \
                   f"{str(dtype).removeprefix('torch.')}"
        if len(shape) != len(axes):
            return f"{name} of shape {shape}, expected {len(axes)} axes ({', '.join(axes)})"
        if any(sizes.setdefault(a, n) != n for a, n in zip(axes, shape)):
            return f"{name} of shape {shape}, where encoder_hidden_states gives N={sizes['N']}, L={sizes['L']}"
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            return f"{name} holds non-finite values"
    return None


def find_cached(cache_dir: str | Path, key: str) -> Path | None:
    """A file in ``cache_dir`` whose metadata carries ``key`` (any name: `agg-bench embed --out` picks it)."""
    folder = Path(cache_dir)
    if not folder.is_dir():
        return None
    for path in sorted(folder.glob("*.safetensors")):
        if read_metadata(path).get("key") == key:
            return path
    return None


def check_cache_target(cache_dir: str | Path, path: Path) -> None:
    """Refuse writing the cache file ``path`` of ``prompts.cache_dir`` (before anything is encoded or written):
    the folder a folder, made if missing, never a symbolic link (a write lands in the folder named) nor a
    file; ``path`` new or an embedding file of this module (someone's file of that name is left alone). What
    killed writers of ``path`` left beside it goes (the whole file, each attempt's under its own PID; a live
    writer's stays): the cache folder has no claim that would remove it."""
    folder = Path(cache_dir)
    if folder.is_symlink() or (folder.exists() and not folder.is_dir()):
        raise ConfigError("prompts.cache_dir", str(cache_dir), "a folder (made if missing), not a file or a "
                                                               "symbolic link")
    check_writable(path, "prompts.cache_dir")  # a file where one of its folders goes, or a read-only place
    check_file(path, is_embeddings_file, "an agg-bench embedding file", "prompts.cache_dir",
               "move it aside or give another prompts.cache_dir")
    remove_stale_temps(path)


def default_cache_path(cache_dir: str | Path, family: str, pretrained: str | Path | None, prompts: PromptSet,
                       key: str) -> Path:
    model = Path(pretrained).name if pretrained else "tiny"
    return Path(cache_dir) / f"{family}-{model}-{prompts.path.stem}-{key[:12]}.safetensors"


@dataclass
class Embeddings:
    """A run's prompt embeddings, the file they live in, and whether this call ran the text encoders."""

    cond: Conditioning
    path: Path
    encoded: bool
    key: str


def run_embeddings(cfg: RunConfig, prompts: PromptSet, device: str | torch.device = "cpu",
                   write_to: str | Path | None = None) -> Embeddings:
    """Embeddings of ``prompts`` for the run ``cfg``: from ``prompts.cache_dir`` when cached, else encoded
    once with the model's text encoders and written there (to ``write_to`` when given)."""
    family, pretrained = cfg.model.family, cfg.model.pretrained
    max_len = cfg.prompts.max_sequence_length
    dtype = encoder_dtype(cfg.model.dtype)
    if pretrained is None or not Path(pretrained).is_dir():
        raise ConfigError("model.pretrained", pretrained, "an existing local diffusers folder")
    # the key's files and the encoders that make the embeddings kept under it read from one model folder
    with unreplaced_folder(pretrained):
        key = cache_key(family, pretrained, prompts, max_len, dtype)
        cache_dir = cfg.prompts.cache_dir or "results/embeddings"
        hit = find_cached(cache_dir, key)
        if hit is not None:
            cond, _ = load_embeddings(hit)
            return Embeddings(cond, hit, False, key)
        target = write_to if write_to is not None else default_cache_path(cache_dir, family, pretrained, prompts, key)
        if write_to is None:  # a file the caller names is its own claim (agg-bench embed --out)
            check_cache_target(cache_dir, Path(target))
        cond = encode_prompts(family, pretrained, prompts.prompts, device, max_len, dtype)
    meta = {"key": key, "family": family, "pretrained": str(Path(pretrained).resolve()),
            "prompts_file": str(prompts.path), "prompts_sha256": prompts.sha256, "n_prompts": len(prompts.prompts),
            "max_sequence_length": max_len, "encoder_dtype": str(dtype).removeprefix("torch.")}
    path = save_embeddings(target, cond, meta)
    return Embeddings(cond, path, True, key)


def check_dims(cond: Conditioning, transformer, n_prompts: int, source: str) -> None:
    """The embeddings must fit the transformer (token and pooled widths) and the prompt count."""
    dim, pooled = text_dims(transformer)
    if cond.batch_size != n_prompts:
        raise UserError(f"{source}: {cond.batch_size} prompt embeddings for {n_prompts} prompts")
    if cond.encoder_hidden_states.shape[-1] != dim:
        raise UserError(f"{source}: token embeddings of width {cond.encoder_hidden_states.shape[-1]}, "
                        f"the transformer expects {dim}")
    if pooled is not None and (cond.pooled_projections is None or cond.pooled_projections.shape[-1] != pooled):
        raise UserError(f"{source}: pooled embeddings do not have the width {pooled} the transformer expects")


def hash_tokens(cfg: RunConfig) -> int:
    """Tokens of the hash embedding: ``prompts.max_tokens`` for the tiny preset; for ``random`` the text
    length the architecture's pipeline gives (``prompts.max_sequence_length`` or its default)."""
    model = cfg.model
    if model.preset == "random":
        from .families import architecture

        return architecture(model.family, model.architecture).sequence_length(cfg.prompts.max_sequence_length)
    return cfg.prompts.max_tokens


def prompt_conditioning(cfg: RunConfig, transformer, prompts: PromptSet,
                        device: str | torch.device = "cpu") -> Conditioning:
    """Conditioning for every prompt of the run (float32, CPU): the text encoders' (cached) for a local
    model folder, the token-hash embedding for the tiny and random presets."""
    if not cfg.model.pretrained:
        dim, pooled = text_dims(transformer)
        return hash_embed(prompts.prompts, dim, pooled, hash_tokens(cfg), cfg.seed)
    hashed = token_hash_settings(cfg.model.pretrained)
    if hashed is not None:  # a model trained on token hashes (agg-bench pretrain): the same ones, whatever the seed
        dim, pooled = text_dims(transformer)
        return hash_embed(prompts.prompts, dim, pooled, hashed["max_tokens"], hashed["seed"])
    emb = run_embeddings(cfg, prompts, device)
    check_dims(emb.cond, transformer, len(prompts.prompts), str(emb.path))
    return emb.cond


def empty_prompt_conditioning(cfg: RunConfig, transformer, device: str | torch.device = "cpu") -> Conditioning:
    """The conditioning of the empty prompt ``""`` (one row, float32, CPU), made as the run's prompts are: the
    unconditional half of classifier-free guidance (the negative prompt the public pipelines encode). A model
    with text encoders encodes it each time it is asked (once per run), without the cache."""
    if not cfg.model.pretrained:
        dim, pooled = text_dims(transformer)
        return hash_embed([""], dim, pooled, hash_tokens(cfg), cfg.seed)
    hashed = token_hash_settings(cfg.model.pretrained)
    if hashed is not None:
        dim, pooled = text_dims(transformer)
        return hash_embed([""], dim, pooled, hashed["max_tokens"], hashed["seed"])
    cond = encode_prompts(cfg.model.family, cfg.model.pretrained, [""], device, cfg.prompts.max_sequence_length,
                          encoder_dtype(cfg.model.dtype))
    check_dims(cond, transformer, 1, "the empty prompt's embedding")
    return cond


def embed(cfg: RunConfig, out: str | Path | None = None, device: str | torch.device = "cpu") -> Embeddings:
    """``agg-bench embed``: make sure the run's embeddings are in ``prompts.cache_dir``; with ``out``, write
    them to that file as well (a file in the cache folder is found by its key, whatever its name).

    The tiny preset needs no cache (its token-hash embedding is computed in no time); the file is still
    written so that a workflow can treat every model alike.
    """
    if out is not None:
        check_suffix(out, ".safetensors")
    prompts = prompt_set(cfg.prompts.file)
    if not cfg.model.pretrained:
        family = cfg.model.family
        cond = prompt_conditioning(cfg, _unloaded_transformer(cfg), prompts)
        tokens = hash_tokens(cfg)
        key = hashlib.sha256("\0".join([FORMAT, "tiny", family, prompts.sha256, str(tokens),
                                        str(cfg.seed)] + _architecture_key(cfg)).encode()).hexdigest()
        path = out if out is not None else default_cache_path(cfg.prompts.cache_dir, family, None, prompts, key)
        if out is None:
            check_cache_target(cfg.prompts.cache_dir, Path(path))
        meta = {"key": key, "family": family, "pretrained": "", "prompts_file": str(prompts.path),
                "prompts_sha256": prompts.sha256, "n_prompts": len(prompts.prompts)}
        return Embeddings(cond, save_embeddings(path, cond, meta), False, key)
    if token_hash_settings(cfg.model.pretrained) is not None:
        raise UserError(f"model.pretrained {shown(cfg.model.pretrained)}: conditioned on token hashes "
                        f"({TOKEN_HASH_FILE}), which every run computes itself; no text encoders, nothing to embed")
    emb = run_embeddings(cfg, prompts, device, write_to=out)
    if out is not None and Path(out).resolve() != emb.path.resolve():
        written = read_metadata(emb.path)
        written.pop("format", None)
        emb.path = save_embeddings(out, emb.cond, written)
    return emb


def _unloaded_transformer(cfg: RunConfig):
    """The transformer whose text widths a download-free preset needs (random: on the meta device)."""
    from .models import build_tiny_transformer

    model = cfg.model
    if model.preset == "random":
        from .architectures import build_on_meta
        from .families import architecture

        arch = architecture(model.family, model.architecture)
        return build_on_meta(family_spec(model.family).transformer_cls(), arch.transformer)
    return build_tiny_transformer(model.family)


def _architecture_key(cfg: RunConfig) -> list[str]:
    # the tiny preset's key stays what it was; a random architecture adds its name
    return [cfg.model.architecture or "default"] if cfg.model.preset == "random" else []


def describe(emb: Embeddings) -> dict:
    """The one-line JSON the CLI prints."""
    return {"out": None if emb.path is None else str(emb.path), "encoded": emb.encoded, "key": emb.key,
            "prompts": emb.cond.batch_size}


__all__ = ["ENCODINGS", "Embeddings", "PromptSet", "cache_key", "describe", "embed", "encode_prompts",
           "find_cached", "load_embeddings", "model_identity", "prompt_conditioning", "prompt_set",
           "run_embeddings", "save_embeddings"]
