"""The one way agg-bench quiets diffusers, transformers and huggingface_hub while it loads a model from a folder:
a folder that does not load is the one line of the refusal that names it, not that line after the libraries'
progress bars, warnings and logs."""
from __future__ import annotations

import contextlib
import importlib
import logging
from collections.abc import Iterator

# the libraries' logging modules; each has get_verbosity / set_verbosity, and diffusers' and transformers' also
# is_progress_bar_enabled / disable_progress_bar / enable_progress_bar (huggingface_hub's bars are switched in
# huggingface_hub.utils); transformers is an optional extra, so a library that is not installed is skipped
LIBRARIES = ("diffusers.utils.logging", "transformers.utils.logging", "huggingface_hub.utils.logging")


def _installed(name: str):
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


@contextlib.contextmanager
def quiet_loading(level: int | None = logging.ERROR) -> Iterator[None]:
    """While the block runs: the progress bars of diffusers, transformers and huggingface_hub off, and their logs
    below ``level`` (a :mod:`logging` level) off; ``level=None`` leaves their logs as they are. Afterwards every
    verbosity and progress bar is as it was before, also when the block raises."""
    import huggingface_hub.utils as hub_utils

    libs = [lib for lib in map(_installed, LIBRARIES) if lib is not None]
    verbosities = [(lib, lib.get_verbosity()) for lib in libs]
    bars = [lib for lib in libs if getattr(lib, "is_progress_bar_enabled", lambda: False)()]
    hub_bars = not hub_utils.are_progress_bars_disabled()
    try:
        if level is not None:
            for lib in libs:
                lib.set_verbosity(level)
        for lib in bars:
            lib.disable_progress_bar()
        if hub_bars:
            hub_utils.disable_progress_bars()
        yield
    finally:
        for lib, verbosity in verbosities:
            lib.set_verbosity(verbosity)
        for lib in bars:
            lib.enable_progress_bar()
        if hub_bars:
            hub_utils.enable_progress_bars()


def cast_quietly(module, dtype):
    """``module.to(dtype)`` without the warning diffusers logs on every dtype cast of one of its models ("There are
    modules in X that should be kept in float32: []. Casting directly with `to()` ..."): the harness keeps its own
    precision (:data:`agg_bench.engine.models.PRECISIONS`: float32 master weights under bfloat16, float64 whole),
    and a float64 run of the tiny model printed it for the transformer and the VAE, before a refusal's one line
    too."""
    with quiet_loading():
        return module.to(dtype)
