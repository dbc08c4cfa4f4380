"""The identity of the code a run executes: one hash of the harness's sources.

:func:`source_digest` hashes every Python and YAML file of the ``agg_bench`` and ``baselines`` packages, by
path and content, found without importing them. What depends on it: the sweep's cached methods check (a
changed method re-checks), ``env.json``'s ``source_digest`` (which code wrote a run), and whether an attempt
that was stopped may be continued (a cell job's journal, ``agg-bench run --resume-stopped``): records of one
run never mix two versions of the code.
"""
from __future__ import annotations

import functools
import hashlib
import importlib.util
from pathlib import Path

SOURCE_PACKAGES = ("agg_bench", "baselines")


@functools.cache
def source_digest() -> str:
    """The SHA-256 of the ``agg_bench`` and ``baselines`` sources (Python and YAML, by relative path and
    content), found without importing them; computed once per process (every run of a cell writes it into its
    env.json): the code a process executes is the code it loaded, whatever the files hold later."""
    digest = hashlib.sha256()
    for package in SOURCE_PACKAGES:
        spec = importlib.util.find_spec(package)
        for root in (spec.submodule_search_locations or []) if spec else []:
            for path in sorted(Path(root).rglob("*")):
                if path.suffix in (".py", ".yaml") and "__pycache__" not in path.parts:
                    digest.update(str(path.relative_to(root)).encode())
                    digest.update(path.read_bytes())
    return digest.hexdigest()
