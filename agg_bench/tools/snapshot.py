"""Frozen rollouts for replay: every method's gradient can be computed on the very same rollout.

A snapshot folder holds ``transformer/`` (diffusers ``save_pretrained``), ``rollout.safetensors``,
``rollout.json`` and the run's ``config.json``. A LoRA run keeps its base weights in ``transformer/``, the
adapter in ``lora/`` and the adapter settings under ``lora`` in ``rollout.json``.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from ..config import RunConfig, apply_overrides, parse_override, validate
from ..engine.grpo import TrainBatch, UpdateStats
from ..engine.lora import load_adapter, lora_info, save_transformer
from ..engine.models import (DTYPES, POLICIES, TRANSFORMER_CLASSES, Conditioning, Policy, precision,
                             transformer_config_problem)
from ..errors import ConfigError, UserError, quote
from ..io import atomic_target, write_json
from ..jsonfiles import MAX_CONFIG_BYTES, read_json_object
from ..methods.base import Estimator, ReplayCase, build_estimator
from ..outdir import Contents, claim_files, claim_folder, json_file_with
from ..reading import run_config
from ..runtime.session import Session

ROLLOUT_KEYS = ("latents", "log_probs", "sigmas", "timesteps", "advantages", "encoder_hidden_states",
                "train_steps")


# what a snapshot folder holds; any other file in --out is someone else's
SNAPSHOT_CONTENTS = Contents("a snapshot", ("rollout.safetensors", "rollout.json", "config.json"),
                             folders=(("transformer", None), ("lora", None)))  # written into, never removed
# what a replay's FILE.json holds (its pass counts); an existing FILE.json without them is someone else's
REPLAY_KEYS = ("forward_nograd", "forward_grad", "backward", "method", "replay")
REPLAY_FORMAT = "agg-bench-replay/1"  # in a replay's gradient file's safetensors metadata


def save_snapshot(cfg: RunConfig, out_dir: str | Path) -> Path:
    """Collect iteration 0 of ``cfg`` and freeze it into ``out_dir`` (new, empty or an earlier snapshot)."""
    out = Path(out_dir)
    with claim_folder(out, SNAPSHOT_CONTENTS):
        _save_snapshot(Session(cfg), cfg, out)
    return out


def _save_snapshot(session: Session, cfg: RunConfig, out: Path) -> None:
    batch = session.collect(0).batch
    save_transformer(session.policy.transformer, out / "transformer")  # with LoRA: base weights + lora/
    tensors = {
        "latents": batch.latents, "log_probs": batch.log_probs, "sigmas": batch.sigmas,
        "timesteps": batch.timesteps, "advantages": batch.advantages, "train_steps": batch.train_steps,
        "velocities": batch.velocities,
        **batch.cond.tensors(),  # encoder_hidden_states, and pooled_projections / encoder_attention_mask if set
    }
    with atomic_target(out / "rollout.safetensors") as tmp:
        save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, str(tmp))
    write_json(out / "rollout.json", {
        "family": cfg.model.family, "sde": batch.sde, "eta": batch.eta, "clip_range": batch.clip_range,
        "beta": batch.beta, "kl_form": batch.kl_form, "adv_std": cfg.grpo.adv_std, "dtype": cfg.model.dtype,
        "resolution": cfg.model.resolution,
        "lora": lora_info(session.policy.transformer),
    })
    write_json(out / "config.json", cfg.to_dict())


@dataclass
class Snapshot:
    policy: Policy
    batch: TrainBatch
    meta: dict
    config: dict


def _rollout_meta(root: Path) -> dict:
    """``rollout.json`` of the snapshot folder ``root``, checked: a UserError naming the file and key for
    anything ``agg-bench snapshot`` does not write."""
    path = root / "rollout.json"
    meta = read_json_object(path, "the rollout settings of an agg-bench snapshot (a JSON object)")
    kinds = {"family": (lambda v: v in TRANSFORMER_CLASSES, f"one of {', '.join(TRANSFORMER_CLASSES)}"),
             "sde": (lambda v: isinstance(v, str), "a string"),
             "eta": (lambda v: _finite(v), "a finite number"),
             "clip_range": (lambda v: _finite(v), "a finite number"),
             "beta": (lambda v: v is None or _finite(v), "a finite number"),
             "dtype": (lambda v: v is None or v in DTYPES, f"one of {', '.join(DTYPES)}")}
    for key, (ok, expected) in kinds.items():
        if not ok(meta.get(key)):
            raise UserError(f"{path}: {key} = {quote(meta.get(key))}: expected {expected}")
    return meta


def _finite(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def load_snapshot(snapshot_dir: str | Path, device: str | torch.device = "cpu") -> Snapshot:
    """The snapshot folder ``snapshot_dir``, every file checked before a tensor is made: ``rollout.json``,
    ``config.json`` (the typed run config with its bounds, :func:`agg_bench.reading.run_config`) and
    the transformer's config (:func:`agg_bench.engine.models.transformer_config_problem`)."""
    root = Path(snapshot_dir)
    for name in ("transformer", "rollout.safetensors", "rollout.json"):
        if not (root / name).exists():
            raise UserError(f"snapshot {root}: missing {name} (make one with `agg-bench snapshot`)")
    meta = _rollout_meta(root)
    family = meta["family"]
    config_path = root / "config.json"
    config = run_config(read_json_object(config_path, "the run config of an agg-bench snapshot (a JSON object)"),
                        config_path).to_dict() if config_path.exists() else {}
    transformer_config = root / "transformer" / "config.json"
    problem = transformer_config_problem(read_json_object(transformer_config, "a diffusers transformer config",
                                                          MAX_CONFIG_BYTES))
    if problem is not None:
        raise UserError(f"{transformer_config}: {problem}")
    prec = precision(meta.get("dtype", "float32"))
    transformer = TRANSFORMER_CLASSES[family].from_pretrained(
        root / "transformer", torch_dtype=prec.param_dtype).to(device)
    if meta.get("lora"):
        load_adapter(transformer, family, meta["lora"], root / "lora")
    policy = POLICIES[family](transformer, None, autocast_dtype=prec.autocast_dtype)
    t = {k: v.to(device) for k, v in load_file(str(root / "rollout.safetensors")).items()}
    beta = meta.get("beta", 0.0)
    batch = TrainBatch(
        latents=t["latents"], log_probs=t["log_probs"], sigmas=t["sigmas"], timesteps=t["timesteps"],
        advantages=t["advantages"], train_steps=t["train_steps"],
        cond=Conditioning.from_tensors(t),
        sde=meta["sde"], eta=meta["eta"], clip_range=meta["clip_range"], beta=beta,
        velocities=t.get("velocities"), policy_version=0, kl_form=meta.get("kl_form", "transition"),
    )
    return Snapshot(policy, batch, meta, config)


# Keys outside the method section that a replay may set: the trained-step draw (train.plan) of a method that draws its own
# steps on the snapshot (Estimator.replans). Anything else is fixed by the frozen rollout.
REPLAN_KEYS = ("train.timestep_fraction", "train.plan", "train.plan_window", "train.ignore_last", "seed")


def replay_setup(config: dict, method: str, overrides: list[str]) -> tuple[RunConfig, Estimator]:
    """The replay's run config (the snapshot's ``config`` with ``method`` and the ``--set`` overrides)
    and the estimator, after the method's own run checks (``check_run``: W <= N, train.plan compatibility)."""
    config = dict(config)
    config["method"] = {"name": method}
    cfg = validate(apply_overrides(config, overrides))
    estimator = build_estimator(cfg)
    for item in overrides:
        key, value = parse_override(item)
        if key == "method" or key.startswith("method."):
            continue
        if not (estimator.replans and key in REPLAN_KEYS):
            allowed = f"method.* and {', '.join(REPLAN_KEYS)}" if estimator.replans else "method.* only"
            raise ConfigError(key, value,
                              f"a key a replay of method '{method}' can honour ({allowed}): "
                              "the rest is fixed by the snapshot")
    estimator.check_run(cfg)
    return cfg, estimator


def method_from(snapshot: Snapshot, method: str, overrides: list[str]) -> Estimator:
    """The estimator ``method`` with ``--set`` overrides applied to the snapshot's config (run checks done)."""
    return replay_setup(snapshot.config, method, overrides)[1]


def stochastic_steps(batch: TrainBatch) -> torch.Tensor:
    """(T,) bool: the rollout's steps with a log-probability. An ODE step's log-prob is stored as exactly 0
    for every sample (:func:`agg_bench.engine.rollout.rollout`), which a Gaussian log-density never is."""
    return (batch.log_probs != 0).any(dim=0).cpu()


def replay_case_of(snapshot: Snapshot, estimator: Estimator, cfg: RunConfig | None = None) -> ReplayCase:
    """What replaying ``estimator`` on ``snapshot`` trains and measures; random draws from ``cfg.seed``
    (default: the snapshot's own run config, validated when it was made)."""
    cfg = cfg if cfg is not None else RunConfig.from_dict(snapshot.config)
    generator = torch.Generator().manual_seed(cfg.seed)
    return estimator.replay_case(cfg, stochastic_steps(snapshot.batch), snapshot.batch.batch_size, generator)


def replay_gradient(snapshot: Snapshot, estimator: Estimator, cfg: RunConfig | None = None,
                    case: ReplayCase | None = None) -> tuple[dict[str, torch.Tensor], dict, dict]:
    """``estimator``'s gradient of L on the snapshot: ({name: grad}, pass counts, update stats).

    The steps trained are those of ``case`` (default :func:`replay_case_of`); the stats carry its
    ``replay`` scope and ``replay_note``. A method whose replay is not applicable is a UserError.
    """
    case = case if case is not None else replay_case_of(snapshot, estimator, cfg)
    if case.scope == "not_applicable":
        raise UserError(f"method '{estimator.name}' cannot be measured on a frozen rollout: {case.note}")
    batch = snapshot.batch
    if case.train_steps is not None:
        batch = dataclasses.replace(batch, train_steps=case.train_steps.to(batch.train_steps.device))
    policy = snapshot.policy
    reference = policy.frozen_copy() if batch.beta > 0 else None
    for p in policy.parameters():
        p.grad = None
    before = policy.counter.copy()
    stats = UpdateStats(batch.clip_range)
    estimator.accumulate(policy, batch, stats, reference)
    counts = (policy.counter - before).as_dict()
    grads = {n: (p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p))
             for n, p in policy.named_parameters()}
    for p in policy.parameters():
        p.grad = None
    return grads, counts, {**stats.as_dict(), **estimator.iteration_metrics(), "replay": case.scope,
                           "replay_note": case.note, "steps_per_sample": batch.steps_per_sample}


def replay(snapshot_dir: str | Path, method: str, overrides: list[str], out_file: str | Path,
           device: str = "cpu") -> dict:
    """Write ``method``'s gradient on the snapshot to ``out_file`` and its pass counts (and the replay's
    scope, :class:`~agg_bench.methods.base.ReplayCase`) to ``out_file`` .json; returns the pass counts.
    Every check runs before anything is written."""
    out_file = Path(out_file)
    if out_file.suffix != ".safetensors":
        raise UserError(f"--out {out_file}: expected a FILE.safetensors path")
    snapshot = load_snapshot(snapshot_dir, device)
    cfg, estimator = replay_setup(snapshot.config, method, overrides)
    case = replay_case_of(snapshot, estimator, cfg)
    if case.scope == "not_applicable":
        raise UserError(f"method '{method}' cannot be measured on a frozen rollout: {case.note}")
    counts_file = out_file.with_suffix(".json")
    with claim_files({out_file: (lambda path: _is_replay_gradient(path, counts_file), "a replay's gradients"),
                      counts_file: (json_file_with(*REPLAY_KEYS), "a replay's pass counts")}):
        grads, counts, stats = replay_gradient(snapshot, estimator, cfg, case)
        with atomic_target(out_file) as tmp:
            save_file({k: v.contiguous().cpu() for k, v in grads.items()}, str(tmp),
                      metadata={"format": REPLAY_FORMAT, "method": method})
        write_json(counts_file, {**counts, "method": method, "overrides": overrides, "replay": case.scope,
                                 "stats": stats})
    return counts


def _is_replay_gradient(path: Path, counts_file: Path) -> bool:
    """Whether ``path`` is an earlier replay's gradient file: marked so in its metadata, or (written before
    the mark) beside that replay's pass counts."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), "pt") as handle:
            marked = (handle.metadata() or {}).get("format") == REPLAY_FORMAT
    except Exception:  # not a safetensors file at all
        return False
    return marked or json_file_with(*REPLAY_KEYS)(counts_file)
