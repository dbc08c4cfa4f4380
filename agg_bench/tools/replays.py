"""The replays of a frozen rollout that ``agg-bench gradcheck`` (and ``calibrate``) make: the jobs a gradcheck's grid
and ``--methods`` ask for, and each replay's run config and estimator set up and checked. Nothing here imports
diffusers, peft or transformers, so the workflow's methods' check (:mod:`agg_bench.tools.sweep`) checks a sweep's
gradcheck jobs before they run, as the gradcheck itself checks them before its rollout. Torch and the methods are
imported by the estimators' set-up (:func:`replay_setup`) only: ``agg-bench gradcheck`` refuses a bad grid option
(:func:`parse_values`, :func:`parse_method_specs`, :func:`check_replay_count`) before it imports them."""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterable

import yaml

from ..config import RunConfig, apply_overrides, parse_override, read_number, validate, yaml_load
from ..errors import ConfigError, UserError
from ..records import MAX_REPLAYS

if TYPE_CHECKING:
    from ..methods.base import Estimator

GRID_OPTIONS = "--windows x --alphas x --route-fracs x --reuse, --methods"  # what sets a gradcheck's replays


def parse_values(text: str, flag: str, kind: type) -> list:
    """Comma-separated ``text`` of ``--flag`` as a list of ``kind`` (int, float, str or bool)."""
    expected = {int: "comma-separated integers, e.g. 2,3,5", float: "comma-separated numbers, e.g. 0,0.5,1",
                str: "comma-separated names, e.g. index,sigma", bool: "comma-separated booleans, e.g. false,true"}
    items = [item.strip() for item in str(text).split(",")]
    if not items or any(not item for item in items):
        raise ConfigError(flag, text, expected[kind])
    out = []
    for item in items:
        value: Any
        if kind in (int, float):  # as every number flag and config key reads it
            value = read_number(item, kind)
        else:
            try:
                value = item if kind is str else yaml_load(item, flag, text)
            except yaml.YAMLError:
                raise ConfigError(flag, text, expected[kind]) from None
        if not isinstance(value, kind):  # None: not a number of that kind
            raise ConfigError(flag, text, expected[kind])
        if value in out:  # the same replay again, and its row written twice
            raise ConfigError(flag, text, f"{expected[kind]}, each once")
        out.append(value)
    return out


@dataclass(frozen=True)
class ReplayJob:
    """One replay: a method and its options as ``(key, YAML text)`` pairs, i.e. ``--set method.key=text``;
    a dotted key, or a key of :data:`REPLAN_KEYS` (``seed``), is a run-config key as it stands
    (``train.timestep_fraction`` for ``fraction``), as ``replay --set`` takes it."""

    method: str
    options: tuple[tuple[str, str], ...] = ()

    @property
    def overrides(self) -> list[str]:
        return [f"{key if '.' in key or key in REPLAN_KEYS else 'method.' + key}={text}" for key, text in self.options]

    @property
    def label(self) -> str:
        return ",".join(f"{key}={text}" for key, text in self.options)


def parse_method_specs(specs: Iterable[str]) -> list[ReplayJob]:
    """Jobs from ``--methods`` values: ``name`` or ``name:key=value``, comma-separated.

    A comma-separated item with ``=`` and no ``:`` adds an option to the method before it, so
    ``fraction,cached:cache=fora,interval=2`` is ``fraction`` and ``cached`` with two options; a dotted
    key, or ``seed``, sets that run-config key for the job, e.g. ``fraction:train.timestep_fraction=0.5,seed=1``.
    """
    specs = list(specs)
    jobs: list[tuple[str, list[tuple[str, str]]]] = []
    for spec in specs:
        for item in (part.strip() for part in spec.split(",")):
            if not item:  # '' or a stray comma: a method left out by mistake, not none asked for
                raise ConfigError("--methods", spec, "name or name:key=value items, comma-separated, none empty, "
                                                     "e.g. fraction,cached:cache=fora")
            if "=" in item and ":" not in item.split("=", 1)[0]:
                if not jobs:
                    raise ConfigError("--methods", spec, "name or name:key=value items, a name first")
                key, text = item.split("=", 1)
                jobs[-1][1].append((key.strip(), text.strip()))
                continue
            name, colon, option = item.partition(":")
            if not name.strip():
                raise ConfigError("--methods", spec, "name or name:key=value items, e.g. fraction,cached:cache=fora")
            jobs.append((name.strip(), []))
            if colon:  # 'agg:' with nothing after it: an option left out by mistake
                if "=" not in option:
                    raise ConfigError("--methods", spec, f"key=value after '{name}:'")
                key, text = option.split("=", 1)
                jobs[-1][1].append((key.strip(), text.strip()))
    for name, options in jobs:
        keys = [key for key, _ in options]
        twice = next((key for key in keys if keys.count(key) > 1), None)
        if twice is not None:  # the last would win and the first be dropped unseen
            raise ConfigError("--methods", ",".join(specs),
                              f"each option of a method once ({twice} is given twice for '{name}')")
    seen: set[tuple] = set()
    for name, options in jobs:
        same = (name, tuple(sorted(options)))
        if same in seen:  # the same gradient replayed again, and its row written twice
            raise ConfigError("--methods", ",".join(specs), f"each method and options once ('{name}' with "
                                                            f"{dict(options) or 'no options'} is given twice)")
        seen.add(same)
    return [ReplayJob(name, tuple(options)) for name, options in jobs]


def agg_grid(windows: list[int], alphas: list[str], route_fracs: list[float],
             reuse: list[bool]) -> list[ReplayJob]:
    """One ``agg`` job per combination, in the order given."""
    return [
        ReplayJob("agg", (("window", str(w)), ("alpha", a), ("route_frac", repr(f)),
                          ("reuse_rollout_velocity", "true" if r else "false")))
        for w, a, f, r in itertools.product(windows, alphas, route_fracs, reuse)
    ]




def check_replay_count(grid: list[ReplayJob], methods: list[ReplayJob], named: str) -> None:
    """Refuse a gradcheck of more than :data:`MAX_REPLAYS` replays: the ``full`` reference, the AGG ``grid`` and
    ``methods`` (a ``full`` without options among them is the reference). ``named``: the options or keys that set
    the grid, as the line names them."""
    extra = sum(1 for job in methods if job != ReplayJob("full"))
    count = 1 + len(grid) + extra
    if count > MAX_REPLAYS:
        raise UserError(f"{named}: {len(grid)} grid rows + {extra} methods + the full reference = {count} replays: "
                        f"expected at most {MAX_REPLAYS} (each one backward pass over the whole rollout); split the "
                        "grid over several gradchecks")


# Keys outside the method section that a replay may set: the trained-step draw (train.plan) of a method that draws its own
# steps on the snapshot (Estimator.replans). Anything else is fixed by the frozen rollout.
REPLAN_KEYS = ("train.timestep_fraction", "train.plan", "train.plan_window", "train.ignore_last", "seed")


def check_method_kept(method: str, overrides: Iterable[str]) -> None:
    """Refuse an override that names a method other than ``method``, the one the verb was given: its result
    would be the other method's, written and labelled as ``method``'s. Called before the config is validated,
    so that the line names the override that changed the method, not an option of ``method`` the other one
    lacks (``--set method.window=3 --set method.name=full``)."""
    for item in reversed(list(overrides)):
        key, value = parse_override(item)
        if key not in ("method", "method.name"):
            continue
        named = value.get("name") if key == "method" and isinstance(value, dict) else value
        if named != method:  # a method section without a name is the default method's
            raise ConfigError(key, value, f"the options of method '{method}' (its name is given once, as the "
                                          "method itself, not by an option)")
        return


def replay_setup(config: dict, method: str, overrides: list[str],
                 also: tuple[str, ...] = ()) -> tuple[RunConfig, Estimator]:
    """The replay's run config (the snapshot's ``config`` with ``method`` and the ``--set`` overrides)
    and the estimator, after the method's own run checks (``check_run``: W <= N, train.plan compatibility).
    ``also``: keys beyond ``method.*`` (and :data:`REPLAN_KEYS` for a method that replans) the caller honours
    (calibrate's plan keys of a method timed on its own rollout)."""
    from ..methods.base import build_estimator  # torch: imported once a replay is set up

    check_method_kept(method, overrides)
    config = dict(config)
    config["method"] = {"name": method}
    cfg = validate(apply_overrides(config, overrides))
    estimator = build_estimator(cfg)
    for item in overrides:
        key, value = parse_override(item)
        if key == "method" or key.startswith("method.") or key in also:
            continue
        if not (estimator.replans and key in REPLAN_KEYS):
            allowed = f"method.* and {', '.join(REPLAN_KEYS)}" if estimator.replans else "method.* only"
            raise ConfigError(key, value,
                              f"a key a replay of method '{method}' can honour ({allowed}): "
                              "the rest is fixed by the snapshot")
    estimator.check_run(cfg)
    return cfg, estimator


def build_estimators(config: dict, jobs: Iterable[ReplayJob]) -> list[tuple[RunConfig, Estimator]]:
    """Each job's :func:`replay_setup` on the run config ``config`` (whose method section it replaces), in
    order; the first job's ConfigError that fails."""
    return [replay_setup(config, job.method, job.overrides) for job in jobs]
