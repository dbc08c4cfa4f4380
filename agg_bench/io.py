"""Result files that survive a crash: every file is written to a temporary name and renamed, and
metric records are appended one flushed line at a time."""
from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path
from typing import Any, Iterator

from .errors import UserError


def _json_default(obj: Any):
    if hasattr(obj, "item"):
        return obj.item()
    if isinstance(obj, Path):
        return str(obj)
    raise TypeError(f"cannot write {type(obj).__name__} as JSON")


def _clean(value: Any) -> Any:
    """NaN/inf are not JSON: write them as null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    return value


# Temporary names of the harness: ".STEM.agg-bench-tmpPID[.EXT]". Stale ones (a killed process's) are
# removed by matching exactly this pattern, never a user's ".bashrc.tmpl" or ".notes.tmp".
TEMP_TAG = ".agg-bench-tmp"
_TEMP_NAME = re.compile(r"^\..+" + re.escape(TEMP_TAG) + r"[0-9]+(\.[A-Za-z0-9]+)?$")


def is_temp_name(name: str) -> bool:
    """Whether ``name`` is one of :func:`atomic_path`'s temporary names."""
    return _TEMP_NAME.match(name) is not None


def write_json(path: str | Path, data: Any) -> None:
    """Write ``data`` as JSON atomically (temp file in the same folder, then rename)."""
    path = Path(path)
    tmp = atomic_path(path)
    with open(tmp, "w") as fh:
        json.dump(_clean(data), fh, indent=2, default=_json_default, sort_keys=False)
        fh.write("\n")
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def atomic_path(path: str | Path) -> Path:
    """A temporary sibling of ``path``; rename it onto ``path`` with ``os.replace`` when complete."""
    path = Path(path)
    return path.with_name(f".{path.stem}{TEMP_TAG}{os.getpid()}{path.suffix}")


def write_text(path: str | Path, text: str) -> None:
    """Write ``text`` to ``path`` atomically (temporary sibling, then rename)."""
    path = Path(path)
    tmp = atomic_path(path)
    tmp.write_text(text)
    os.replace(tmp, path)


def save_figure(fig: Any, path: str | Path) -> Path:
    """Write a matplotlib figure as a PNG atomically (the folder is made if needed)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = atomic_path(path)
    fig.savefig(tmp, dpi=110, bbox_inches="tight", format="png")
    os.replace(tmp, path)
    return path


class JsonlWriter:
    """Appends one JSON record per line, flushed and fsynced, so a killed process leaves whole lines."""

    def __init__(self, path: str | Path, append: bool = False):
        self.path = Path(path)
        self._fh = open(self.path, "a" if append else "w")

    @staticmethod
    def line(record: dict) -> str:
        """``record`` as the JSON line ``write`` appends (without its newline)."""
        return json.dumps(_clean(record), default=_json_default)

    def write(self, record: dict) -> str:
        """Append ``record``; return the line written (without its newline)."""
        line = self.line(record)
        self._fh.write(line + "\n")
        self._fh.flush()
        os.fsync(self._fh.fileno())
        return line

    def close(self) -> None:
        self._fh.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def read_jsonl(path: str | Path) -> Iterator[dict]:
    """Records of a JSONL file; a torn last line (a run killed mid-write) is skipped. Any other line that
    is not a JSON object raises a UserError naming the file and the line."""
    try:
        with open(path, encoding="utf-8") as fh:
            lines = fh.readlines()
    except UnicodeDecodeError as err:
        raise UserError(f"{path}: not UTF-8 text ({err.reason} at byte {err.start})")
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            if i == len(lines) - 1:
                return
            raise UserError(f"{path}: line {i + 1} is not valid JSON ({err.msg}); the file is damaged")
        if not isinstance(record, dict):
            raise UserError(f"{path}: line {i + 1} is not a JSON object")
        yield record
