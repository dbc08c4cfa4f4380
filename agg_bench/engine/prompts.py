"""Prompt sets and the download-free text conditioning of the embedded default.

The tiny models need no text encoder: each whitespace token is mapped to a fixed random vector drawn
from a generator seeded by a hash of the token, so the same prompt always gives the same embedding on
every machine. Real text encoders are used for real models.
"""
from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path

import torch

from ..errors import ConfigError, quote
from ..jsonfiles import JsonFileError, TooLarge, loads, read_bounded, read_json_object
from ..config import check_prompts_path
from ..outputs import TOKEN_HASH_FILE  # in a model folder: its conditioning is this embedding, not text encoders
from ..records import character_words, is_integer, is_utf8_text
from .models import Conditioning


MAX_PROMPT_FILE_BYTES = 64 * 2**20  # read whole: far above a public prompt set (HPDv2's 100k prompts: ~10 MB)
# a line ends at \n, \r\n or \r only: str.splitlines also ends one at U+2028, U+0085 and the form feed, which a
# prompt (and a JSON string, which may hold them raw) can contain
LINE_END = re.compile(r"\r\n|\r|\n")
# a control character (Unicode category Cc: C0, DEL, C1) but the tab: a NUL, an escape sequence ("\x1b[31m"), a
# carriage return or a newline held by a .jsonl string, a form feed; none is part of a caption a text encoder was
# trained on, and each garbles the logs, tables and sample grids that show the prompt
CONTROL = re.compile(r"[\x00-\x08\x0a-\x1f\x7f-\x9f]")
# the bidi embeddings, overrides and isolates (U+202A-U+202E, U+2066-U+2069): each reorders the characters after it
# where a prompt is shown (logs, tables, sample grids), so that the prompt reads differently from the text the encoder
# is given ("red \u202eebuc" shows as "red cube"); the other format characters (Unicode category Cf) are part of
# real captions (a zero-width joiner in an emoji, a zero-width non-joiner in Persian, a soft hyphen) and pass
BIDI_CONTROLS = re.compile("[\u202a-\u202e\u2066-\u2069]")
FORMAT_WORDS = ("prompts without bidi embeddings, overrides or isolates (U+202A to U+202E, U+2066 to U+2069), which "
                "make a shown prompt read differently from its bytes")


def load_prompts(path: str | Path, key: str = "prompts.file") -> list[str]:
    """Prompts from a .txt file (one per line) or a .jsonl file (``{"prompt": ...}`` per line), at most
    :data:`MAX_PROMPT_FILE_BYTES` (refused before it is read), in UTF-8 with or without a byte-order mark, lines
    ended by ``\\n``, ``\\r\\n`` or ``\\r``; blank lines are skipped; a prompt holding a control character other
    than the tab, a bidi embedding, override or isolate (:data:`BIDI_CONTROLS`), or a lone surrogate, is refused
    (:func:`_check_prompt`). An error names the file and the line, never more than 200 characters of what it holds. ``path`` as written, a ``str``: one that names nothing this user
    can read (:func:`~agg_bench.outdir.named_path_problem`; a folder on its way this user may not search raised
    PermissionError from the look below) is refused for what it is."""
    path = check_prompts_path(os.fspath(path), key)
    try:
        text = read_bounded(path, MAX_PROMPT_FILE_BYTES).decode("utf-8")
    except TooLarge as err:
        has = "more" if err.size is None else f"{err.size:,}"
        raise ConfigError(key, str(path), f"a prompts file of at most {MAX_PROMPT_FILE_BYTES:,} bytes "
                                          f"(it has {has})") from None
    except UnicodeDecodeError as err:
        raise ConfigError(key, str(path), f"a UTF-8 text file ({err.reason} at byte {err.start})") from err
    except OSError as err:
        raise ConfigError(key, str(path), f"a readable file ({err.strerror or err})") from None
    text = text.removeprefix("\ufeff")  # the mark some editors write first is no part of the first prompt
    prompts: list[str] = []
    for lineno, line in enumerate(LINE_END.split(text), 1):
        line = line.strip()
        if not line:
            continue
        if path.suffix == ".jsonl":
            try:
                item = loads(line)
                prompt = item["prompt"]
                if not isinstance(prompt, str):
                    raise TypeError
            except (ValueError, KeyError, TypeError) as err:
                raise ConfigError(key, f"{path}:{lineno}", 'one JSON object per line with a string "prompt"') from err
        else:
            prompt = line
        _check_prompt(prompt, path, lineno, key)
        prompts.append(prompt)
    if not prompts:
        raise ConfigError(key, str(path), "a file with at least one prompt")
    return prompts


def _check_prompt(prompt: str, path: Path, lineno: int, key: str) -> None:
    """Refuse a prompt of ``path``'s line ``lineno`` holding a control character (:data:`CONTROL`; a tab is
    allowed), a bidi embedding, override or isolate (:data:`BIDI_CONTROLS`) or a lone surrogate (a JSON escape
    ``\\udcff``, which no UTF-8 writer of captions takes), naming the character and where it is."""
    bad = CONTROL.search(prompt)
    if bad is not None:
        char = bad.group()
        raise ConfigError(key, f"{path}:{lineno}", f"prompts without control characters (tab is allowed): it holds "
                                                   f"{quote(char)} (U+{ord(char):04X}) at character {bad.start() + 1}")
    bidi = BIDI_CONTROLS.search(prompt)
    if bidi is not None:
        raise ConfigError(key, f"{path}:{lineno}", f"{FORMAT_WORDS}: it holds {character_words(prompt, bidi.start())}")
    if not is_utf8_text(prompt):
        raise ConfigError(key, f"{path}:{lineno}", "prompts of UTF-8 text: it holds a lone surrogate, which UTF-8 "
                                                   "cannot encode")


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
        if pooled is not None and pooled_dim is not None:
            pooled[i] = torch.stack([_token_vector(tok, pooled_dim, seed + 1) for tok in tokens]).mean(0)
    return Conditioning(states, pooled)




MAX_TOKEN_HASH_BYTES = 64 * 2**10  # the file pretrain writes is one short line
# the embedding's length: prompts.max_tokens's maximum; its seed: a run seed's
TOKEN_HASH_BOUNDS = {"max_tokens": (1, 4096), "seed": (0, 2**32 - 1)}


def token_hash_settings(folder: str | Path) -> dict | None:
    """``{"max_tokens": int, "seed": int}`` of a model folder conditioned by the token-hash embedding
    (written by ``agg-bench pretrain``), or None when the folder has text encoders instead. The file is at
    most :data:`MAX_TOKEN_HASH_BYTES` and its values integers within :data:`TOKEN_HASH_BOUNDS` (never a float,
    which would be truncated); anything else is a ConfigError naming the folder, the file and the key."""
    path = Path(folder) / TOKEN_HASH_FILE
    if not path.is_file():
        return None
    try:
        settings = read_json_object(path, 'the token-hash settings ({"max_tokens": ..., "seed": ...})',
                                    MAX_TOKEN_HASH_BYTES)
    except JsonFileError as err:
        raise ConfigError("model.pretrained", str(folder),
                          f"a folder whose {TOKEN_HASH_FILE} holds the token-hash settings ({TOKEN_HASH_FILE} "
                          f"{err.problem})") from None
    out = {}
    for key, (low, high) in TOKEN_HASH_BOUNDS.items():
        value = settings.get(key)
        if not is_integer(value) or not low <= value <= high:
            raise ConfigError("model.pretrained", str(folder),
                              f"a folder whose {TOKEN_HASH_FILE} has an integer {key} from {low} to {high} (it has "
                              f"{quote(value)})")
        out[key] = value
    return out
