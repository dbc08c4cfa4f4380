"""The checks of a loaded run config that need more than the config package: the method and the model.

:func:`agg_bench.config.load_config` checks every key against the run schema and imports no torch, no
diffusers and no baseline, so that a report, the workflow's parse and a results reader can load any
``config.json``. What only the engine or a method knows is checked here, after loading, by whoever is about
to run something (the training loop, a cell's jobs, the session, the command line's verbs, the sweep's
methods check in its child process), before anything is written:

- ``model.architecture`` names a public architecture of ``model.family`` (``model.preset: random``), from
  the family specs (:func:`agg_bench.engine.families.architecture`, no torch);
- the method's options are checked, and typed once, by the method's own config class
  (:func:`agg_bench.methods.base.method_config`; ``cfg.method.options``), which imports the method's module
  and with it torch;
- a given ``sampling.shift`` makes a schedule that falls strictly from 1 to 0 in the sampler's precision
  (:func:`agg_bench.engine.sampler.check_sigmas`; a model's own shift is checked when the session has the model),
  and the model's own schedule with a ``shift_terminal`` (a random preset's architecture's, Qwen-Image; a model
  folder's ``scheduler/scheduler_config.json``) has 2 steps or more
  (:func:`agg_bench.engine.families.check_own_schedule`, no torch: the workflow's parse checks it too);
- ``model.guidance`` other than its default is given to a transformer that embeds a guidance value (FLUX.1-dev's),
  from the family specs or the model folder's ``transformer/config.json``
  (:func:`agg_bench.engine.families.check_guidance`, no torch: the workflow's parse checks it too);
- the paths of ``model.pretrained``, ``prompts.file`` and ``prompts.cache_dir`` name something this user can
  use (:func:`agg_bench.outdir.named_path_problem`: no unexpanded ``~``, no folder on the way this user may not
  search, no trailing ``/`` after a file), so that a quoted ``~`` is not a folder named ``~`` made in the current
  one, nor a closed folder a traceback once the run has begun;
- ``reward.name`` names a registered reward (:data:`agg_bench.engine.rewards.REWARDS`; after the method, whose
  module may register one), and a built-in reward's ``reward.options`` are its options, within their bounds, its
  files' paths given and usable (:func:`agg_bench.config.reward_options.reward_options`; the files themselves are
  read when the reward is built).

A method named by a dotted path (``method.name: mypkg.module:MyEstimator``) is imported here: code the user
chose in their own config. A config read from a run folder is never given to :func:`check_config`, so a results
folder never names code to load; its paths are checked (:func:`check_paths`, which loads nothing) before
``agg-bench learning`` evaluates its runs.
"""
from __future__ import annotations

from ..config import RunConfig
from ..config.reward_options import reward_options
from ..engine.families import architecture, check_guidance, check_own_schedule
from ..engine.rewards import REWARDS
from ..engine.sampler import check_sigmas, flow_sigmas_formula, linspace_sigmas, sampler_dtype
from ..errors import ConfigError
from ..methods.base import method_config
from ..outdir import named_path_problem

# the config keys that name a path on this machine, each with whether it names a file (else a folder)
PATH_KEYS = (("model.pretrained", False), ("prompts.file", True), ("prompts.cache_dir", False))


def check_paths(cfg: RunConfig) -> None:
    """A ConfigError naming the first key of :data:`PATH_KEYS` whose path names nothing this user can use
    (:func:`~agg_bench.outdir.named_path_problem`). Looks only; a path that does not exist is left to its reader."""
    for key, is_file in PATH_KEYS:
        text = cfg.get_path(key)
        problem = named_path_problem(text, is_file) if isinstance(text, str) else None
        if problem is not None:
            raise ConfigError(key, text, f"{'a file' if is_file else 'a folder'}'s path ({problem})")


def check_config(cfg: RunConfig) -> RunConfig:
    """``cfg`` with its method's options typed (``cfg.method.options``), after the checks above; a
    ConfigError naming the key otherwise. Options already typed are kept."""
    model, sampling = cfg.model, cfg.sampling
    check_paths(cfg)
    if model.preset == "random" and not model.pretrained:
        architecture(model.family, model.architecture)
    check_own_schedule(model.to_dict(), sampling.to_dict())
    check_guidance(model.to_dict())
    if sampling.shift is not None:  # before any job of a sweep, not when the run has built its model
        given = linspace_sigmas if sampling.schedule == "linspace" else flow_sigmas_formula  # no diffusers imported
        check_sigmas(given(sampling.steps, sampling.shift), sampling.shift,
                     sampler_dtype(model.dtype), sampling.sde, sampling.eta)
    if cfg.method.options is None:
        cfg.method.options = method_config(cfg.method.name, cfg.method.given)
    if cfg.reward.name not in REWARDS.names():
        REWARDS.resolve(cfg.reward.name)  # the registry's ConfigError, which lists the rewards
    reward_options(cfg.reward.name, cfg.reward.options)  # before any job of a sweep, not once a job builds it
    return cfg


__all__ = ["check_config", "check_paths"]
