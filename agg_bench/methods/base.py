"""The Estimator interface and the method registry.

A method decides how the gradient of the GRPO objective is accumulated into the policy's ``.grad``
for one rollout, and may own the rest of what one iteration does before it:
- the rollout (:meth:`Estimator.rollout`): which steps are stochastic, hooks before each step, the
  velocity used at a step (a guess in place of a forward), the solver of the deterministic steps
  (e.g. a multistep ODE solver), or a trajectory of another shape (a tree whose samples share prefixes);
- the advantages (:meth:`Estimator.advantages`): one per sample, or one per (sample, step);
- the trained steps (:meth:`Estimator.trained_steps`).
The defaults are GRPO's: B independent chains, group-standardised rewards, ``train.plan`` over the
stochastic steps. Adding a method means one module with its options (an
:class:`~agg_bench.config.options.Options` dataclass whose fields are ``option(default, doc, bounds)``) and
an Estimator subclass, and one ``@register_method`` line (:class:`agg_bench.registry.Registry`, the style of
rewards and caches too); the training loop never changes.

``method.name`` is a registered name, or a dotted path ``package.module:Class`` to an Estimator subclass of
the user's own (it needs no registration): the user's config names code to import, as a Python import would.
Only a config the user gives is checked and built this way (``check_config``); a config read from a run
folder is never, so a results folder never names code to load.
"""
from __future__ import annotations

import contextlib
import dataclasses
import importlib
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any, Callable, ClassVar

import torch

from ..config import RunConfig
from ..config.sections import METHOD_MODULES, METHOD_NAME_WORDS, is_method_path, is_method_path_shape
from ..config.options import Options, typed_options
from ..engine.grpo import TrainBatch, UpdateStats, grpo_advantages, minibatch_rows
from ..engine.trained_steps import draw_plan
from ..errors import ConfigError
from ..registry import Registry

if TYPE_CHECKING:  # annotations only: checking a method's options imports neither the models nor diffusers
    from ..config.sections import GRPOConfig, SamplingConfig, TrainConfig
    from ..engine.models import Conditioning, Policy
    from ..engine.rollout import Trajectory

METHODS = Registry("method.name", modules=METHOD_MODULES)


@dataclasses.dataclass
class NoOptions(Options):
    """This method has no options."""


REPLAY_SCOPES = ("as_trained", "replanned", "partial", "not_applicable")


@dataclasses.dataclass
class ReplayCase:
    """What replaying a method on a frozen rollout measures (``agg-bench replay`` and ``gradcheck``).

    ``scope`` is one of:
    - ``as_trained``: the gradient the method computes in a run on this very rollout;
    - ``replanned``: the method's rollout is distributed as the snapshot's, but it trains other steps,
      drawn anew from the snapshot's stochastic steps (the row is one random draw of its gradient);
    - ``partial``: the replay shows only part of what the method changes (``note`` says which part);
    - ``not_applicable``: the method differs from ``full`` only in its rollout, which a frozen rollout
      cannot show: ``replay`` refuses it and ``gradcheck`` writes its row without numbers.
    ``train_steps``: (B, N) the steps to train, in denoising order; None trains the snapshot's.
    ``note``: one sentence for the reader of the result.
    """

    scope: str = "as_trained"
    train_steps: torch.Tensor | None = None
    note: str = ""

    def __post_init__(self) -> None:
        if self.scope not in REPLAY_SCOPES:
            raise ValueError(f"replay scope {self.scope!r}: expected one of {list(REPLAY_SCOPES)}")


class Estimator(ABC):
    """Accumulates one method's gradient of L into ``policy`` parameters' ``.grad``."""

    name: ClassVar[str]
    config_cls: ClassVar[type[Options]] = NoOptions
    # Whether the steps it trains on a frozen rollout are its own draw (replay_case), so that replay
    # honours --set train.timestep_fraction / train.plan / train.plan_window / seed for it.
    replans: ClassVar[bool] = False
    # Whether a row of its ``train_steps`` lists the steps in the order the method draws them (each sample's K
    # times, paired with the noises drawn after them in that order) rather than in denoising order: a snapshot
    # of its rollout holds them so (agg_bench.tools.snapshot checks the order against the snapshot's method).
    draws_step_order: ClassVar[bool] = False

    def __init__(self, config: Any = None):
        self.config = config if config is not None else self.config_cls()
        # the empty prompt's conditioning (one row), set before the first rollout where needs_unconditional()
        self.unconditional: Conditioning | None = None

    def needs_unconditional(self) -> bool:
        """Whether the rollout needs the empty prompt's conditioning (classifier-free guidance); the run sets
        :attr:`unconditional` then (:func:`agg_bench.runtime.session.ready_estimator`)."""
        return False

    def check_run(self, cfg: RunConfig) -> None:  # noqa: B027 (an optional hook: by default nothing to refuse)
        """Raise a ConfigError for run settings outside the method's own options that it cannot honour
        (e.g. a window longer than sampling.steps); called when a run is set up, before anything is written."""

    def check_schedule(self, cfg: RunConfig, sigmas: torch.Tensor) -> None:  # noqa: B027 (optional hook)
        """Raise a ConfigError for the run's schedule ``sigmas`` (T+1) where the method cannot sample on it (its
        own grid made from it, e.g.); called when a run is set up, once the schedule is known (it may come from
        the model's scheduler config), before anything is written."""

    def rollout_timesteps(self, policy: Policy, sigmas: torch.Tensor) -> torch.Tensor:
        """(T,) the values the transformer is given at each step of this method's rollout on ``sigmas`` (T+1),
        before the rollout casts them to the policy's dtype: the sigmas in its scale
        (:meth:`~agg_bench.engine.models.Policy.timestep_values`) unless the method samples at timesteps of its
        own. A snapshot's ``timesteps`` are checked against them (:func:`agg_bench.tools.snapshot.load_snapshot`)."""
        return policy.timestep_values(sigmas)

    def replay_case(self, cfg: RunConfig, stochastic: torch.Tensor, batch_size: int,
                    generator: torch.Generator) -> ReplayCase:
        """How this method is replayed on a frozen rollout whose steps ``stochastic`` (T,) bool have a
        log-probability, under run config ``cfg``; random draws come from ``generator``. Default: it
        trains the snapshot's own steps, as it would in a run on that rollout."""
        return ReplayCase()

    def sde_mask(self, iteration: int, steps: int, generator: torch.Generator) -> torch.Tensor | None:
        """Which of the T steps are sampled with the SDE (None: all)."""
        return None

    def rollout_hooks(self, policy: Policy) -> contextlib.AbstractContextManager[Callable[[int, float], None] | None]:
        """Context active while sampling; yields ``before_step(j, timestep)`` or None."""
        return contextlib.nullcontext(None)

    def rollout(self, policy: Policy, cond: Conditioning, noise: torch.Tensor, sigmas: torch.Tensor,
                sampling: SamplingConfig, generator: torch.Generator, iteration: int, group_size: int) -> Trajectory:
        """The iteration's trajectories from x_0 = ``noise`` (P x G rows, G = ``group_size``, grouped
        consecutively); random draws come from ``generator``, after the noise. Default: :func:`agg_bench.engine.rollout.rollout`
        with :meth:`sde_mask`, :meth:`rollout_hooks` and :meth:`ode_rule` (Euler) where it is not stochastic."""
        from ..engine.rollout import rollout  # the rollout imports the models (diffusers); a method's options do not

        mask = self.sde_mask(iteration, sampling.steps, generator)
        with self.rollout_hooks(policy) as before_step:
            return rollout(policy, cond, noise, sigmas, sampling.sde, sampling.eta, generator, mask, before_step,
                           ode=self.ode_rule(sigmas, generator))

    def ode_rule(self, sigmas: torch.Tensor, generator: torch.Generator
                 ) -> Callable[[int, torch.Tensor, torch.Tensor], torch.Tensor] | None:
        """The step ``(j, x_j, v_j) -> x_{j+1}`` of the rollout's steps outside the SDE mask, made for one rollout
        on ``sigmas`` (a multistep solver keeps its history in it); a rule that adds noise without a
        log-probability (AWM's SA-Solver with tau > 0) draws it from the rollout's ``generator``. Default None:
        Euler."""
        return None

    def advantages(self, rewards: torch.Tensor, trajectory: Trajectory, grpo: GRPOConfig) -> torch.Tensor:
        """A (B,) per sample or (B, T) per (sample, step), in the trajectory's dtype, from the rewards (B,)
        float64 of the trajectory's final images. Default: GRPO's group-standardised rewards."""
        return grpo_advantages(rewards, grpo, trajectory.latents.dtype)

    def trained_steps(self, train: TrainConfig, trajectory: Trajectory, batch_size: int,
                      generator: torch.Generator) -> torch.Tensor:
        """``train_steps`` (B, N): the steps each sample trains, from the trajectory's stochastic steps; a row
        that trains fewer ends in ``NO_STEP`` entries (:mod:`agg_bench.engine.trained_steps`), which the method's
        own ``accumulate`` must skip. Default: ``train.plan`` (:func:`agg_bench.engine.trained_steps.draw_plan`)."""
        return draw_plan(train, batch_size, trajectory.sde_mask, generator)

    def update_parts(self, batch: TrainBatch, train: TrainConfig, group_size: int) -> list[TrainBatch]:
        """The parts of one epoch of an update on ``batch``, in order: one optimizer step each (its gradient
        :meth:`accumulate` of the part). Default: ``train.minibatches`` mini-batches of whole groups or of slices
        of every group (``train.minibatch_unit``, :func:`agg_bench.engine.grpo.minibatch_rows`); the batch
        itself for one."""
        if train.minibatches == 1:
            return [batch]
        return [batch.take_rows(rows) for rows in minibatch_rows(batch.batch_size, group_size, train.minibatches,
                                                                 train.minibatch_unit)]

    def epoch(self) -> contextlib.AbstractContextManager[None]:
        """Context around one epoch of an update: the training loop makes the :meth:`accumulate` calls of the
        epoch's :meth:`update_parts` inside it, in order, and opens a fresh one for each epoch; a method whose
        parts share a decision (AGG's routed count, :class:`agg_bench.methods.agg.AGGEstimator`) keeps it here,
        and an :meth:`accumulate` outside any epoch (``replay``, ``gradcheck``) is a whole epoch by itself.
        Default: nothing."""
        return contextlib.nullcontext()

    def records_optimizer_steps(self) -> bool:
        """Whether this run's optimizer steps per iteration are not the config's count (its :meth:`update_parts`
        are of its own kind), so that each record carries the steps its update took, ``optimizer_steps``, which
        the report prices in place of the config's. Default: no."""
        return False

    @abstractmethod
    def accumulate(self, policy: Policy, batch: TrainBatch, stats: UpdateStats,
                   reference: Policy | None = None) -> None:
        """Add d L / d theta to ``.grad`` (L as in docs/design.md, scaled by ``batch.loss_scale``)."""

    def check_train_steps(self, train_steps: torch.Tensor) -> str | None:
        """What keeps this method from training the rows of ``train_steps`` (B, N) of a frozen rollout made by
        another method (``replay``, ``gradcheck``), as one phrase; None when it can train them. Default: None
        (any distinct steps, in any order)."""
        return None

    def iteration_metrics(self) -> dict:
        """Method-specific fields for the iteration's metric record."""
        return {}

    def set_up(self, policy: Policy) -> None:  # noqa: B027 (optional hook)
        """Called once when a run is set up, with ``policy`` at its starting weights (before a resumed run's
        checkpoint is loaded): where the method keeps a frozen copy of the starting policy of its own
        (:meth:`keeps_reference`), it makes it here."""

    def keeps_reference(self, cfg: RunConfig) -> bool:
        """Whether this run keeps a frozen copy of the starting policy of its own (beside the session's KL reference,
        which ``grpo.beta > 0`` makes), which the memory plan charges as that reference. Default: no."""
        return False

    def moving_average(self) -> str | None:
        """The option that makes this run keep a moving average of the policy as a frozen copy of its transformer
        (``Policy.weights_copy``: every parameter and buffer, which the memory plan charges); None: it keeps none."""
        return None

    def state_dict(self) -> dict | None:
        """What the method keeps from one iteration to the next that a resumed run needs (tensors, numbers,
        strings: a checkpoint holds it); None: nothing."""
        return None

    def load_state_dict(self, state: dict, policy: Policy) -> None:  # noqa: B027 (optional: no state by default)
        """Take back :meth:`state_dict`'s ``state`` for ``policy`` (restored first); a UserError where it does
        not fit."""

    def close(self) -> None:  # noqa: B027 (an optional hook: by default nothing was installed)
        """Undo anything the method installed on the policy."""


def register_method(cls: type[Estimator]) -> type[Estimator]:
    """Class decorator: register ``cls`` under ``cls.name``."""
    return METHODS.register(cls.name, cls)


def available_methods() -> list[str]:
    return METHODS.names()


def resolve_method(name: str) -> type[Estimator]:
    """The Estimator class ``method.name`` names: a registered method, or the class a dotted path
    ``package.module:Class`` names, imported now (module docstring); a ConfigError otherwise."""
    if not is_method_path(name):
        return METHODS.resolve(name)
    module_name, _, attr = name.partition(":")
    expected = METHOD_NAME_WORDS
    if not is_method_path_shape(name):
        raise ConfigError("method.name", name, expected)
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        if err.name is None or not (module_name == err.name or module_name.startswith(err.name + ".")):
            raise  # a module the user's own module imports is missing: their code's error, not the name's
        raise ConfigError("method.name", name, f"{expected} (no module {err.name!r})") from err
    cls = getattr(module, attr, None)
    if not (isinstance(cls, type) and issubclass(cls, Estimator)):
        raise ConfigError("method.name", name, f"{expected} ({module_name} has no Estimator subclass {attr!r})")
    return cls


def method_config(name: str, options: dict[str, Any], prefix: str = "method") -> Options:
    """``name``'s options typed by its config class (:func:`agg_bench.config.options.typed_options`), naming
    any bad key (or an unknown method)."""
    return typed_options(resolve_method(name).config_cls, options, prefix, f"method {name!r}")


def build_method(name: str, options: dict[str, Any] | None = None) -> Estimator:
    """The estimator registered as ``name`` with ``options`` (the ``method`` config section minus name)."""
    return resolve_method(name)(method_config(name, dict(options or {})))


def method_options(cfg: RunConfig) -> Any:
    """The typed options of run config ``cfg``'s method: those
    :func:`~agg_bench.runtime.config_check.check_config` built (``cfg.method.options``), or built now for a
    config that was not checked."""
    method = cfg.method
    return method.options if method.options is not None else method_config(method.name, method.given)


def build_estimator(cfg: RunConfig) -> Estimator:
    """The run's estimator, from the options its checked config carries (not checked again). The one
    way a run, a replay, a calibration, the planner and the workflow's method check build one."""
    return resolve_method(cfg.method.name)(method_options(cfg))
