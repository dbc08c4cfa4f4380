"""Prompt sets and the download-free text conditioning of the embedded default.

The tiny models need no text encoder: each whitespace token is mapped to a fixed random vector drawn
from a generator seeded by a hash of the token, so the same prompt always gives the same embedding on
every machine. Real text encoders are used for real models.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch

from ..errors import ConfigError
from .models import Conditioning


def load_prompts(path: str | Path, key: str = "prompts.file") -> list[str]:
    """Prompts from a .txt file (one per line) or a .jsonl file (``{"prompt": ...}`` per line)."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(key, str(path), "an existing .txt or .jsonl prompts file")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise ConfigError(key, str(path), f"a UTF-8 text file ({err.reason} at byte {err.start})")
    prompts: list[str] = []
    for lineno, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line:
            continue
        if path.suffix == ".jsonl":
            try:
                item = json.loads(line)
                prompt = item["prompt"]
                if not isinstance(prompt, str):
                    raise TypeError
            except (ValueError, KeyError, TypeError):
                raise ConfigError(key, f"{path}:{lineno}", 'one JSON object per line with a string "prompt"')
            prompts.append(prompt)
        else:
            prompts.append(line)
    if not prompts:
        raise ConfigError(key, str(path), "a file with at least one prompt")
    return prompts


def _token_vector(token: str, dim: int, seed: int) -> torch.Tensor:
    digest = hashlib.blake2b(f"{seed}:{token}".encode(), digest_size=8).digest()
    gen = torch.Generator().manual_seed(int.from_bytes(digest, "little") & ((1 << 63) - 1))
    return torch.randn(dim, generator=gen)


def hash_embed(prompts: list[str], dim: int, pooled_dim: int | None, max_tokens: int = 16,
               seed: int = 0) -> Conditioning:
    """Token-hash embeddings (B, max_tokens, dim) and pooled embeddings (B, pooled_dim); float32."""
    states = torch.zeros(len(prompts), max_tokens, dim)
    pooled = None if pooled_dim is None else torch.zeros(len(prompts), pooled_dim)
    for i, prompt in enumerate(prompts):
        tokens = prompt.lower().split()[:max_tokens] or [""]
        for k, tok in enumerate(tokens):
            states[i, k] = _token_vector(tok, dim, seed)
        if pooled is not None:
            pooled[i] = torch.stack([_token_vector(tok, pooled_dim, seed + 1) for tok in tokens]).mean(0)
    return Conditioning(states, pooled)


TOKEN_HASH_FILE = "token_hash.json"  # in a model folder: its conditioning is this embedding, not text encoders


def token_hash_settings(folder: str | Path) -> dict | None:
    """``{"max_tokens": int, "seed": int}`` of a model folder conditioned by the token-hash embedding
    (written by ``agg-bench pretrain``), or None when the folder has text encoders instead."""
    path = Path(folder) / TOKEN_HASH_FILE
    if not path.is_file():
        return None
    try:
        settings = json.loads(path.read_text())
        return {"max_tokens": int(settings["max_tokens"]), "seed": int(settings["seed"])}
    except (ValueError, KeyError, TypeError):
        raise ConfigError("model.pretrained", str(folder),
                          f'a {TOKEN_HASH_FILE} with integer "max_tokens" and "seed"') from None
