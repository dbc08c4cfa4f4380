"""The contract path of the SDE step: ``agg_bench.sde.sde_step``.

Tools outside this repository call ``agg_bench.sde.sde_step(kind, model_output, sample, sigmas, index,
eta, prev_sample=None, generator=None)`` (docs/design.md, Contracts), so that name stays here. The step
lives in the engine (:mod:`agg_bench.engine.sampler`); this module re-exports that one function object and
nothing else, and no module of the repository imports it (``tests/unit/test_import_graph.py``).
"""
from .engine.sampler import sde_step

__all__ = ["sde_step"]
