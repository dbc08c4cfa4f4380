"""Frozen rollouts for replay: every method's gradient can be computed on the very same rollout.

A snapshot folder holds ``transformer/`` (diffusers ``save_pretrained``), ``rollout.safetensors``,
``rollout.json`` (with ``rollout_sha256``, the SHA-256 of the ``rollout.safetensors`` written with it, and
``weights_sha256``, that of each weight file written with it: ``transformer/diffusion_pytorch_model*.safetensors``,
shards and index included, and ``lora/adapter_model.safetensors``, and ``transformer_config_sha256``, that of the
``transformer/config.json`` written with it) and the run's ``config.json``. A LoRA run keeps
its base weights in ``transformer/``, the adapter in ``lora/`` and the adapter settings under ``lora`` in
``rollout.json``.

``agg-bench snapshot`` writes the whole snapshot into a temporary folder inside ``--out`` and moves it into
place once every file is written: a failure (a full disk among them) leaves an earlier snapshot as it was and
nothing of its own; a rollout holding a NaN or an infinity is refused before anything is written. Reading one
(:func:`load_snapshot`) checks every file against what the writer writes before a gradient is computed: ``rollout.json``'s settings through the typed run config and equal to the
snapshot's ``config.json`` (a ``guidance`` other than the default only for a transformer whose config embeds one),
the transformer's config, loadable and finite weights, and every tensor of
``rollout.safetensors`` of the shape those settings imply, of the dtype the writer writes and finite, and its
timesteps those the snapshot's method gives the model at its sigmas. A ``rollout.safetensors``, a weight file or the
transformer's ``config.json`` whose SHA-256 is not the one ``rollout.json`` records (another snapshot's rollout or
weights, of the same shapes: another seed, another training state; a config of the same shapes that builds another
model around them: another position-embedding grid, norm or attention setting) is refused, and so are a recorded weight file gone and a
weight file not recorded, before any weight is loaded (the config before it is read); a snapshot written before a
digest was recorded is read without its check. Hashing reads every weight file once more (about 5 s for SD3.5-M's
5 GB at 1 GB/s).
"""
from __future__ import annotations

import copy
import dataclasses
import fnmatch
import math
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from ..config import RunConfig, validate
from ..config.sections import DEFAULTS, upgrade_written, written_before
from ..engine.families.geometry import ImageGeometry, check_guidance
from ..engine.grpo import TrainBatch, UpdateStats
from ..engine.lora import ADAPTER_FILE, load_adapter, lora_settings, save_transformer
from ..engine.models import (MAX_MODEL_SIZE, POLICIES, TRANSFORMER_CLASSES, Conditioning, Policy, _load_component,
                             precision, text_dims)
from ..engine.sampler import sampler_dtype
from ..engine.text import file_sha256
from ..engine.trained_steps import NO_STEP
from .. import stopping
from ..errors import ConfigError, UserError, quote, shown
from ..io import atomic_path, atomic_target, follow_umask, remove_stale_temps, write_json
from ..jsonfiles import NotRegularFile, open_regular, read_json_object
from ..config.sections import METHOD_MODULES, is_method_path
from ..methods.base import Estimator, ReplayCase, build_estimator
from ..outdir import Contents, check_not_written, check_suffix, claim_files, claim_folder, json_file_with, remove_owned
from ..reading import run_config
from ..runtime.memplan import check_transformer_fits
from ..runtime.session import Session
from .replays import replay_setup

ROLLOUT_KEYS = ("latents", "log_probs", "sigmas", "timesteps", "advantages", "encoder_hidden_states",
                "train_steps")
# every tensor of rollout.safetensors and its shape, by dimension: B samples, T steps (T+1 states), C, H, W the
# latents of rollout.json's resolution, N trained steps per sample, L text tokens of D (P pooled) features.
# advantages are (B,) or, where a method gives each step its own, (B, T).
ROLLOUT_SHAPES: dict[str, tuple[str, ...]] = {
    "latents": ("B", "T+1", "C", "H", "W"), "log_probs": ("B", "T"), "sigmas": ("T+1",), "timesteps": ("T",),
    "advantages": ("B",), "train_steps": ("B", "N"), "velocities": ("B", "T", "C", "H", "W"),
    "encoder_hidden_states": ("B", "L", "D"), "pooled_projections": ("B", "P"), "encoder_attention_mask": ("B", "L"),
}
INTEGER_TENSORS = ("train_steps", "encoder_attention_mask")  # the rest hold floating-point numbers
OPTIONAL_TENSORS = ("velocities", "pooled_projections", "encoder_attention_mask")  # pooled: as the model has it

# rollout.json's settings and the run-config keys they are (rollout_settings); lora: train.lora_*
SETTINGS = {"family": "model.family", "sde": "sampling.sde", "eta": "sampling.eta",
            "clip_range": "grpo.clip_range", "beta": "grpo.beta", "kl_form": "grpo.kl_form",
            "adv_std": "grpo.adv_std", "dtype": "model.dtype", "resolution": "model.resolution",
            "guidance": "model.guidance"}
LORA_SETTINGS = {"rank": "train.lora_rank", "alpha": "train.lora_alpha", "target_modules": "train.lora_target_modules"}
REQUIRED_SETTINGS = ("family", "sde", "eta", "clip_range")  # every snapshot has them; the rest may be older than it
# rollout.json's record of the rollout.safetensors written with it (hex SHA-256 of its bytes); older snapshots lack it
DIGEST_KEY = "rollout_sha256"
# rollout.json's record of the weight files written with it: {path relative to the snapshot folder: hex SHA-256}
WEIGHTS_KEY = "weights_sha256"
# rollout.json's record of the transformer/config.json written with it (hex SHA-256); it decides the architecture
# the weights load into. Snapshots older than the record lack it.
TRANSFORMER_CONFIG_KEY = "transformer_config_sha256"
TRANSFORMER_CONFIG = "transformer/config.json"

# what a snapshot folder holds; any other file in --out is someone else's. transformer/ and lora/ are replaced
# whole by a new snapshot, so what they hold is checked too.
TRANSFORMER_CONTENTS = Contents("a snapshot's transformer", ("config.json",),
                                ("diffusion_pytorch_model*.safetensors", "diffusion_pytorch_model*.safetensors.index.json"))
LORA_CONTENTS = Contents("a snapshot's LoRA adapter", (ADAPTER_FILE,))
SNAPSHOT_CONTENTS = Contents("a snapshot", ("rollout.safetensors", "rollout.json", "config.json"),
                             folders=(("transformer", TRANSFORMER_CONTENTS), ("lora", LORA_CONTENTS)))
# the names of the weight files in each folder of a snapshot (WEIGHTS_KEY): the transformer's single file, or its
# shards and their index, and the LoRA adapter
WEIGHT_PATTERNS = {"transformer": TRANSFORMER_CONTENTS.patterns, "lora": LORA_CONTENTS.names}
# what a replay's FILE.json holds (its pass counts); an existing FILE.json without them is someone else's
REPLAY_KEYS = ("forward_nograd", "forward_grad", "backward", "method", "replay")
REPLAY_FORMAT = "agg-bench-replay/1"  # in a replay's gradient file's safetensors metadata
# why a snapshot's run config names a registered method only: reading a snapshot builds the method that made its
# rollout, and a dotted path package.module:Class would be a module imported, its code run, by reading a folder
NAMES_NO_CODE = "a snapshot's run config names no code to load (not a dotted path package.module:Class)"


def rollout_settings(cfg: RunConfig) -> dict:
    """``rollout.json`` of a snapshot of ``cfg``: the rollout's SDE, the loss's settings, the model's family,
    precision and resolution, and the LoRA adapter's settings (None for a fully trained model)."""
    def value(dotted: str) -> Any:
        section, key = dotted.split(".")
        return getattr(getattr(cfg, section), key)

    train = cfg.train
    lora = None if train.lora_rank == 0 else \
        lora_settings(cfg.model.family, train.lora_rank, train.lora_alpha, train.lora_target_modules)
    return {**{key: value(dotted) for key, dotted in SETTINGS.items()}, "lora": lora}


def save_snapshot(cfg: RunConfig, out_dir: str | Path, flag: str = "--out") -> Path:
    """Collect iteration 0 of ``cfg`` and freeze it into ``out_dir`` (new, empty or an earlier snapshot); a
    refusal names ``flag``, the option that named the folder."""
    out = Path(out_dir)
    if is_method_path(cfg.method.name):  # a snapshot no replay or gradcheck would read
        raise ConfigError("method.name", cfg.method.name, f"a registered method ({', '.join(sorted(METHOD_MODULES))}) "
                                                          f"for a snapshot: {NAMES_NO_CODE}")
    with claim_folder(out, SNAPSHOT_CONTENTS, flag):
        # a killed earlier snapshot's staging folder (a whole transformer's weights) would stay in the folder for
        # good: the folder's checks take it for the harness's, and each attempt's has its own PID in its name
        remove_stale_temps(staging_target(out))
        _save_snapshot(Session(cfg), cfg, out)
    return out


def staging_target(out: Path) -> Path:
    """The name a snapshot into ``out`` stages its files under (an :func:`~agg_bench.io.atomic_path` of it, inside
    ``out``) before renaming them into place."""
    return out / "snapshot"


def _save_snapshot(session: Session, cfg: RunConfig, out: Path) -> None:
    batch = session.collect(0).batch
    if bool((batch.train_steps == NO_STEP).any()):  # rows of different lengths: train_steps (B, N) cannot say so
        raise ConfigError("method.name", cfg.method.name, "a method whose rows train equally many steps: a "
                          "snapshot's train_steps (B, N) holds no shorter row (guess: method.zero_loss_on_guess "
                          "false)")
    tensors = {
        "latents": batch.latents, "log_probs": batch.log_probs, "sigmas": batch.sigmas,
        "timesteps": batch.timesteps, "advantages": batch.advantages, "train_steps": batch.train_steps,
        "velocities": batch.velocities,
        **batch.cond.tensors(),  # encoder_hidden_states, and pooled_projections / encoder_attention_mask if set
    }
    # a rollout that blew up (a NaN reward, latents past float range) is one load_snapshot refuses: written, it
    # would replace an earlier snapshot with one no replay or gradcheck reads
    bad = _nonfinite({k: v for k, v in tensors.items() if v is not None})
    if bad is not None:
        raise UserError(f"the rollout of iteration 0 holds {quote(bad[1])} in {bad[0]}: expected finite numbers "
                        "(the rollout or its reward blew up); no snapshot written")
    staging = atomic_path(staging_target(out))  # a harness temporary: never taken for a snapshot or anyone's file
    shutil.rmtree(staging, ignore_errors=True)  # this process run's, where an earlier snapshot in it failed to clean up
    try:
        staging.mkdir()
        save_transformer(session.policy.transformer, staging / "transformer")  # with LoRA: base weights + lora/
        save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items() if v is not None},
                  str(staging / "rollout.safetensors"))
        write_json(staging / "rollout.json", {**rollout_settings(cfg),
                                              "vae_scale_factor": session.policy.vae_scale_factor,
                                              DIGEST_KEY: file_sha256(staging / "rollout.safetensors"),
                                              WEIGHTS_KEY: weight_digests(staging),
                                              TRANSFORMER_CONFIG_KEY: file_sha256(staging / TRANSFORMER_CONFIG)})
        write_json(staging / "config.json", cfg.to_dict())
        follow_umask(staging)  # safetensors writes its files 0600
        _move_into_place(staging, out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def is_weight_file(rel: str) -> bool:
    """Whether ``rel``, a path relative to a snapshot folder, names one of its weight files
    (:data:`WEIGHT_PATTERNS`): ``transformer/diffusion_pytorch_model*.safetensors`` (and ``.index.json``) or
    ``lora/adapter_model.safetensors``."""
    folder, _, name = rel.partition("/")
    return bool(name) and "/" not in name and any(fnmatch.fnmatchcase(name, pattern)
                                                  for pattern in WEIGHT_PATTERNS.get(folder, ()))


def weight_files(root: Path) -> dict[str, Path]:
    """Every weight file (:func:`is_weight_file`) in the snapshot folder ``root``: {its path relative to ``root``,
    with ``/``: its path}, in name order."""
    found = {}
    for folder in WEIGHT_PATTERNS:
        if (root / folder).is_dir():
            for path in sorted((root / folder).iterdir()):
                if is_weight_file(f"{folder}/{path.name}"):
                    found[f"{folder}/{path.name}"] = path
    return found


def weight_digests(root: Path) -> dict[str, str]:
    """What ``rollout.json`` records of the weight files of the snapshot folder ``root`` (:data:`WEIGHTS_KEY`): the
    SHA-256 of each (:func:`weight_files`), by its path relative to ``root``."""
    return {rel: file_sha256(path) for rel, path in weight_files(root).items()}


def _move_into_place(staging: Path, out: Path) -> None:
    """Replace the snapshot in ``out`` (if any) with the one written in ``staging``: renames only. rollout.json
    goes first and comes back last, so a folder left halfway is no snapshot (load_snapshot, gradcheck). A SIGTERM or
    SIGINT meanwhile waits for the last rename (:func:`agg_bench.stopping.safe_points`): stopped between two, the
    folder held neither the earlier snapshot nor this one."""
    with stopping.safe_points():
        _rename_into_place(staging, out)


def _rename_into_place(staging: Path, out: Path) -> None:
    (out / "rollout.json").unlink(missing_ok=True)
    for name, contents in SNAPSHOT_CONTENTS.folders:
        if contents is not None:
            remove_owned(out / name, contents)  # its own files only (claim_folder refused anything else)
        if (staging / name).exists():
            os.replace(staging / name, out / name)
    for name in ("rollout.safetensors", "config.json", "rollout.json"):
        os.replace(staging / name, out / name)


@dataclass
class Snapshot:
    policy: Policy
    batch: TrainBatch
    meta: dict
    config: dict
    root: Path | None = None  # the folder it was read from


def _rollout_meta(root: Path, run: RunConfig | None) -> dict:
    """``rollout.json`` of the snapshot folder ``root``, checked against what ``agg-bench snapshot`` writes
    (:func:`rollout_settings`): its settings within the typed run config's bounds and equal to those of the
    snapshot's run config ``run`` (checked already; None for a snapshot without one). A UserError naming
    the file and key otherwise. Returns every setting (a key an older snapshot lacks: its run config's),
    ``vae_scale_factor``, ``rollout_sha256``, ``weights_sha256`` and ``transformer_config_sha256`` (each None where
    the snapshot predates it)."""
    path = root / "rollout.json"
    meta = read_json_object(path, "the rollout settings of an agg-bench snapshot (a JSON object)")
    for key in REQUIRED_SETTINGS:
        if meta.get(key) is None:
            raise UserError(f"{shown(path)}: {key} = None: expected the {SETTINGS[key]} of the snapshot's run "
                            "(agg-bench snapshot writes it)")
    names = {dotted: key for key, dotted in SETTINGS.items()}
    overlay = run.to_dict() if run is not None else copy.deepcopy(DEFAULTS)
    given = {dotted: meta[key] for key, dotted in SETTINGS.items() if meta.get(key) is not None}
    lora = meta.get("lora")
    if lora is not None:
        if not isinstance(lora, dict) or set(lora) != set(LORA_SETTINGS):
            raise UserError(f"{shown(path)}: lora = {quote(lora)}: expected null or the LoRA adapter's settings "
                            f"({', '.join(LORA_SETTINGS)})")
        names.update({dotted: f"lora.{key}" for key, dotted in LORA_SETTINGS.items()})
        given.update({dotted: lora[key] for key, dotted in LORA_SETTINGS.items()})
    for dotted, value in given.items():
        section, key = dotted.split(".")
        overlay.setdefault(section, {})[key] = value
    try:
        cfg = validate(upgrade_written(overlay))
    except ConfigError as err:
        if err.key in names:
            raise UserError(f"{shown(path)}: {names[err.key]} = {quote(err.value)}: expected {err.expected}") from None
        raise UserError(f"{shown(path)}: {err}") from None
    settled = run if run is not None else cfg
    made = rollout_settings(settled)
    for key, expected in made.items():
        value = meta.get(key)
        if key in SETTINGS and _written_as(settled, SETTINGS[key], value):
            continue
        if (value is not None or key == "lora") and value != expected:
            source = "the snapshot's config.json" if run is not None else "the settings it names"
            if key in SETTINGS and (differs := _older_value_differs(settled, SETTINGS[key], value)) is not None:
                # an older value stands for several of today's keys: the line names the one that differs
                dotted, said, wanted = differs
                raise UserError(f"{shown(path)}: {key} = {quote(value)} stands for {dotted} = {quote(said)}: expected "
                                f"{dotted} = {quote(wanted)}, as {source}")
            if run is not None:
                source += f" {SETTINGS.get(key, 'train.lora_*')}"
            raise UserError(f"{shown(path)}: {key} = {quote(value)}: expected {quote(expected)}, as {source}")
    factor = meta.get("vae_scale_factor")
    if factor is not None and not (type(factor) is int and 1 <= factor <= MAX_MODEL_SIZE):
        raise UserError(f"{shown(path)}: vae_scale_factor = {quote(factor)}: expected an integer from 1 to "
                        f"{MAX_MODEL_SIZE}")
    digests = {DIGEST_KEY: "rollout.safetensors", TRANSFORMER_CONFIG_KEY: TRANSFORMER_CONFIG}
    for key, name in digests.items():
        if meta.get(key) is not None and not _is_sha256(meta[key]):
            raise UserError(f"{shown(path)}: {key} = {quote(meta[key])}: expected the SHA-256 of {name} (64 lowercase "
                            "hex digits), as agg-bench snapshot writes it")
    weights = meta.get(WEIGHTS_KEY)
    if weights is not None and not isinstance(weights, dict):
        raise UserError(f"{shown(path)}: {WEIGHTS_KEY} = {quote(weights)}: expected an object of the snapshot's weight "
                        "files and their SHA-256, as agg-bench snapshot writes it")
    for rel, value in (weights or {}).items():  # a name outside the snapshot's weight files is no file it wrote
        if not is_weight_file(rel) or not _is_sha256(value):
            raise UserError(f"{shown(path)}: {WEIGHTS_KEY} {quote(rel)} = {quote(value)}: expected a weight file of "
                            "the snapshot (transformer/diffusion_pytorch_model*.safetensors[.index.json], "
                            f"lora/{ADAPTER_FILE}) and its SHA-256 (64 lowercase hex digits), as agg-bench snapshot "
                            "writes them")
    # the guidance value given to the snapshot's transformer: rollout.json's, or (older than the key) config.json's
    given_by = (path, "guidance") if meta.get("guidance") is not None else (root / "config.json", "model.guidance")
    _check_guidance(root, made["family"], made["guidance"], meta.get(TRANSFORMER_CONFIG_KEY), *given_by)
    return {**made, "vae_scale_factor": factor, **{key: meta.get(key) for key in digests}, WEIGHTS_KEY: weights}


def _check_guidance(root: Path, family: str, guidance: float, recorded: str | None, given_in: Path, key: str) -> None:
    """A UserError naming ``key`` of ``given_in`` (the file that gives it) when ``guidance`` is a guidance value
    other than the default and the snapshot's transformer embeds none (:func:`~agg_bench.engine.families.check_guidance`,
    from its ``transformer/config.json``, of the SHA-256 ``rollout.json`` records, ``recorded``: before a weight is
    loaded); the policy refuses it too, in the words of the run config (``model.guidance``)."""
    if guidance == DEFAULTS["model"]["guidance"]:
        return
    _check_digest(root, root / TRANSFORMER_CONFIG, recorded, TRANSFORMER_CONFIG_KEY, "transformer config")
    try:
        check_guidance({"family": family, "guidance": guidance, "pretrained": str(root)})
    except ConfigError as err:
        raise UserError(f"{shown(given_in)}: {key} = {quote(err.value)}: expected {err.expected}") from None


def _is_sha256(value: Any) -> bool:
    """Whether ``value`` is a SHA-256 as :func:`~agg_bench.engine.text.file_sha256` writes it (lowercase hex)."""
    return isinstance(value, str) and len(value) == 64 and all(c in "0123456789abcdef" for c in value)


def _written_as(cfg: RunConfig, dotted: str, value: Any) -> bool:
    """Whether ``value``, an older snapshot's setting ``dotted`` (``config.sections.WRITTEN_BEFORE``: ``adv_std:
    population``), stands for what ``cfg`` says today: every key it stands for equal to ``cfg``'s. Such a
    snapshot's config.json reads upgraded, and its rollout.json must read the same way."""
    section, key = dotted.split(".")
    return written_before(section, key, value) is not None and _older_value_differs(cfg, dotted, value) is None


def _older_value_differs(cfg: RunConfig, dotted: str, value: Any) -> tuple[str, Any, Any] | None:
    """For ``value``, an older snapshot's setting ``dotted`` that stands for keys ``cfg`` says otherwise
    (``adv_std: sample`` is ``grpo.adv_std: group, grpo.adv_ddof: 1``): the first such key, dotted, with the value
    ``value`` stands for and ``cfg``'s. None where ``value`` is no older value or ``cfg`` agrees with it."""
    section, key = dotted.split(".")
    for name, said in (written_before(section, key, value) or {}).items():
        wanted = getattr(getattr(cfg, section), name)
        if wanted != said:
            return f"{section}.{name}", said, wanted
    return None


def _first_line(err: BaseException) -> str:
    if isinstance(err, OSError) and err.strerror:  # not "[Errno 13] ... '<the path the line names already>'"
        return err.strerror
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def _nonfinite(tensors: dict[str, torch.Tensor]) -> tuple[str, float] | None:
    """The first floating-point tensor of ``tensors`` holding a NaN or an infinity, and that value."""
    for name, tensor in tensors.items():
        if tensor.is_floating_point():
            bad = ~torch.isfinite(tensor)
            if bad.any():
                return name, float(tensor[bad].flatten()[0])
    return None


def _load_transformer(root: Path, meta: dict, device: str | torch.device) -> torch.nn.Module:
    """The snapshot's transformer, as a model folder's is loaded: its config of ``meta``'s family, within
    bounds and its weights within ``device``'s memory (:func:`~agg_bench.runtime.memplan.check_transformer_fits`,
    before anything is allocated; the config of the SHA-256 ``rollout.json`` records, before it is read), readable
    weight files of the SHA-256 ``rollout.json`` records (:func:`_check_weight_digests`, before any is loaded),
    loadable weights
    (:func:`~agg_bench.engine.models._load_component`), then the LoRA adapter; every weight finite."""
    family = meta["family"]
    # the config decides the architecture the weights load into: another of the same shapes loads them silently
    _check_digest(root, root / TRANSFORMER_CONFIG, meta[TRANSFORMER_CONFIG_KEY], TRANSFORMER_CONFIG_KEY,
                  "transformer config")
    try:
        buffers = check_transformer_fits(str(root), family, meta["dtype"], str(torch.device(device)))
        _check_weight_files(root, root / "transformer", buffers)
        _check_weight_digests(root, meta[WEIGHTS_KEY])  # before any weight is loaded, the adapter's too
        transformer = _load_component(TRANSFORMER_CLASSES[family], str(root / "transformer"), str(root),
                                      "transformer weights", torch_dtype=precision(meta["dtype"]).param_dtype,
                                      use_safetensors=True)  # as snapshot writes them: never a pickle
    except ConfigError as err:
        if err.key == "model.family":
            raise UserError(f"{shown(root / 'rollout.json')}: family = {quote(family)}: expected "
                            f"{err.expected}") from None
        raise UserError(f"snapshot {shown(root)}: expected {err.expected}") from None
    transformer.to(device)
    if meta["lora"]:
        try:
            load_adapter(transformer, family, meta["lora"], root / "lora")
        except (SafetensorError, OSError, RuntimeError, ValueError) as err:  # a torn file, weights of other shapes
            raise UserError(f"{shown(root / 'lora' / ADAPTER_FILE)}: expected the LoRA adapter agg-bench snapshot "
                            f"wrote for {quote(meta['lora'])} ({_first_line(err)})") from None
    bad = _nonfinite(transformer.state_dict())
    if bad is not None:
        name, value = bad
        folder = root / ("lora" if ".lora_" in name else "transformer")
        raise UserError(f"{shown(folder)}: weight {name} holds {quote(value)}: expected finite weights")
    return transformer


def _check_weight_files(root: Path, folder: Path, buffers: int) -> None:
    """The safetensors weight files of ``folder`` must be readable and hold at least the ``buffers`` numbers
    of the buffers its config describes (``agg-bench snapshot`` writes every weight and buffer): building
    the model computes its buffers in full before a file is read, so a config.json describing larger ones
    than its files is refused first."""
    held = 0
    for path in sorted(folder.glob("diffusion_pytorch_model*.safetensors")):
        try:
            open_regular(path).close()  # as in _rollout_tensors
            with safe_open(str(path), "pt") as handle:
                held += sum(math.prod(handle.get_slice(name).get_shape()) for name in handle.keys())
        except (SafetensorError, OSError, ValueError) as err:
            raise UserError(f"snapshot {shown(root)}: expected loadable transformer weights in {shown(folder)} "
                            f"({path.name}: {_first_line(err)})") from None
    if held and buffers > held:  # no file at all: the loader names it
        raise UserError(f"{shown(folder / 'config.json')}: describes a transformer whose buffers hold {buffers:,} "
                        f"numbers: expected at most the {held:,} its weight files hold")


def _latent_shape(root: Path, policy: Policy, meta: dict) -> tuple[int, int, int] | None:
    """(C, H, W) of the latents of rollout.json's resolution, with the VAE factor the snapshot was made with
    (the family's grid and limit from the transformer); None where an older snapshot does not say its factor."""
    factor = meta["vae_scale_factor"]
    if factor is None:
        return None
    geometry = ImageGeometry(policy.family, factor, policy.latent_multiple, policy.max_latent_size())
    try:
        size = geometry.latent_size(meta["resolution"])
    except ConfigError as err:
        raise UserError(f"{shown(root / 'rollout.json')}: resolution = {quote(err.value)}: expected "
                        f"{err.expected}") from None
    return policy.latent_channels, size, size


def written_dtype(name: str, model_dtype: str) -> torch.dtype | None:
    """The dtype ``agg-bench snapshot`` writes the floating-point rollout tensor ``name`` in for a run of
    ``model_dtype`` (``model.dtype``): the schedule's sigmas in float64, the rest in the sampler's dtype
    (float64 for float64, else float32); None for an integer tensor (checked on its own)."""
    if name in INTEGER_TENSORS:
        return None
    return torch.float64 if name == "sigmas" else sampler_dtype(model_dtype)


def _rollout_tensors(root: Path, policy: Policy, meta: dict, estimator: Estimator) -> dict[str, torch.Tensor]:
    """The tensors of ``rollout.safetensors``, each one :data:`ROLLOUT_SHAPES` names, of its shape (the
    latents of rollout.json's resolution, the text features the transformer takes, B and T alike in all),
    integer step indices in [0, T) and a 0/1 mask, every other value a finite floating-point number of the
    dtype the writer writes (:func:`written_dtype`), and the timesteps those the rollout of the snapshot's
    method (``estimator``) gives the transformer on its sigmas."""
    path = root / "rollout.safetensors"
    try:
        open_regular(path).close()  # safetensors says "No such file or directory" of a file this user may not read
        with safe_open(str(path), "pt") as handle:
            tensors = {name: handle.get_tensor(name) for name in handle.keys()}
    except (SafetensorError, OSError, ValueError) as err:
        raise UserError(f"{shown(path)}: not a readable safetensors file ({_first_line(err)}); expected the rollout "
                        "agg-bench snapshot wrote") from None
    _check_digest(root, path, meta[DIGEST_KEY], DIGEST_KEY, "rollout")
    text_dim, pooled_dim = text_dims(policy.transformer)
    dims: dict[str, int] = {"D": text_dim}
    if pooled_dim is not None:
        dims["P"] = pooled_dim
    shape = _latent_shape(root, policy, meta)
    if shape is not None:
        dims.update(C=shape[0], H=shape[1], W=shape[2])
    else:
        dims["C"] = policy.latent_channels
    required = [name for name in ROLLOUT_SHAPES if name not in OPTIONAL_TENSORS]
    if pooled_dim is not None:
        required.append("pooled_projections")
    for name in required:
        if name not in tensors:
            raise UserError(f"{shown(path)}: no tensor {quote(name)}: expected the rollout agg-bench snapshot wrote "
                            f"({', '.join(required)})")
    allowed = [name for name in ROLLOUT_SHAPES if name in required or name in OPTIONAL_TENSORS]
    unknown = next((name for name in tensors if name not in allowed), None)
    if unknown is not None:
        raise UserError(f"{shown(path)}: holds a tensor {quote(unknown)}: expected only {', '.join(allowed)}")
    for name in (name for name in ROLLOUT_SHAPES if name in tensors):  # latents first: B, T (and H, W) from them
        problem = _tensor_problem(name, tensors[name], dims)
        if problem is not None:
            raise UserError(f"{shown(path)}: {name} {problem}")
    for name, tensor in tensors.items():  # one tensor in another precision replays a gradient no run computes
        expected_dtype = written_dtype(name, meta["dtype"])
        if expected_dtype is not None and tensor.dtype != expected_dtype:
            raise UserError(f"{shown(path)}: {name} holds {_dtype_name(tensor.dtype)}: expected "
                            f"{_dtype_name(expected_dtype)}, as agg-bench snapshot writes it for model.dtype "
                            f"{meta['dtype']}")
    if shape is None:  # an older snapshot: its latents' side, within what the transformer takes
        geometry = ImageGeometry(policy.family, 1, policy.latent_multiple, policy.max_latent_size())
        try:
            geometry.latent_size(dims["H"])
        except ConfigError as err:
            raise UserError(f"{shown(path)}: latents have {dims['H']} a side: expected {err.expected}") from None
    steps = tensors["train_steps"]
    if steps.dtype != torch.int64:  # a narrower integer indexes as something else (uint8: a mask)
        raise UserError(f"{shown(path)}: train_steps holds {_dtype_name(steps.dtype)}: expected int64 step "
                        "indices")
    if steps.numel() and not (0 <= int(steps.min()) and int(steps.max()) < dims["T"]):
        value = int(steps.min()) if int(steps.min()) < 0 else int(steps.max())
        raise UserError(f"{shown(path)}: train_steps holds {quote(value)}: expected step indices from 0 to "
                        f"{dims['T'] - 1}")
    ordered = steps.sort(dim=1).values
    repeated = (ordered[:, 1:] == ordered[:, :-1]).nonzero()
    if len(repeated):  # a step twice would be trained twice, which no method does
        row, col = (int(i) for i in repeated[0])
        raise UserError(f"{shown(path)}: train_steps row {row} holds step {int(ordered[row, col])} twice: expected "
                        "each row's steps once")
    unordered = (steps[:, 1:] < steps[:, :-1]).nonzero()
    if len(unordered) and not estimator.draws_step_order:  # the order the snapshot's method writes them in
        row, col = (int(i) for i in unordered[0])
        raise UserError(f"{shown(path)}: train_steps row {row} holds {quote(steps[row, col:col + 2].tolist())}: "
                        f"expected each row's steps in denoising order (increasing), as method '{estimator.name}' "
                        "trains them")
    mask = tensors.get("encoder_attention_mask")
    if mask is not None and not ((mask == 0) | (mask == 1)).all():
        raise UserError(f"{shown(path)}: encoder_attention_mask holds "
                        f"{quote(int(mask[(mask != 0) & (mask != 1)][0]))}: expected 0 or 1")
    bad = _nonfinite(tensors)
    if bad is not None:
        raise UserError(f"{shown(path)}: {bad[0]} holds {quote(bad[1])}: expected finite numbers")
    sigmas = tensors["sigmas"]
    outside = ((sigmas < 0) | (sigmas > 1)).nonzero()
    if len(outside) or not bool((sigmas[1:] < sigmas[:-1]).all()):  # the SDE steps divide by s and by s_j - s_j+1
        held = float(sigmas[int(outside[0])]) if len(outside) else sigmas.tolist()
        raise UserError(f"{shown(path)}: sigmas holds {quote(held)}: expected a noise schedule, decreasing from at "
                        "most 1 to at least 0")
    timesteps = tensors["timesteps"]
    expected = estimator.rollout_timesteps(policy, sigmas).to(timesteps.dtype)
    differ = (timesteps != expected).nonzero()
    if len(differ):  # the model would be told one noise level while the SDE steps at another
        j = int(differ[0])
        raise UserError(f"{shown(path)}: timesteps holds {quote(float(timesteps[j]))} at step {j}: expected "
                        f"{quote(float(expected[j]))}, the value the rollout gives the model at its sigma "
                        f"{quote(float(sigmas[j]))}")
    return tensors


def _check_digest(root: Path, path: Path, recorded: str | None, key: str, what: str) -> None:
    """Refuse the file ``path`` of the snapshot folder ``root`` (its ``what``: "rollout", "weight file", "transformer
    config") whose SHA-256 is not ``recorded``, the one ``rollout.json`` records under ``key`` (None: a snapshot
    older than the record, not checked): another snapshot's file of the same shapes passes every other check, and
    the gradients replayed with it are not those of the rollout the snapshot's model sampled (a config of the same
    shapes builds another architecture around the same weights)."""
    if recorded is None:
        return
    try:
        found = file_sha256(path)
    except OSError as err:  # a pipe in the file's place too: refused, never read forever
        why = "not a regular file" if isinstance(err, NotRegularFile) else _first_line(err)
        raise UserError(f"{shown(path)}: {why}; expected the {what} agg-bench snapshot wrote") from None
    if found != recorded:
        raise UserError(f"{shown(path)}: not the {what} this snapshot recorded: its SHA-256 is {found[:16]}..., "
                        f"{shown(root / 'rollout.json')} records {key} {recorded[:16]}... (a {what} of another "
                        f"snapshot?); expected the {path.name} agg-bench snapshot wrote with it")


def _check_weight_digests(root: Path, recorded: dict[str, str] | None) -> None:
    """The weight files of the snapshot folder ``root`` (:func:`weight_files`) against ``recorded``, what
    ``rollout.json`` records of them (None: a snapshot older than the record, not checked): each recorded file
    there, of its SHA-256 (:func:`_check_digest`), and no other. A recorded file gone is a folder that is not the
    snapshot written (a shard removed, a copy cut short); a weight file not recorded may be the one loaded
    (diffusers picks files by name: an index beside a single file loads the shards it names), so it is refused
    too rather than left unchecked."""
    if recorded is None:
        return
    present = weight_files(root)
    missing = next((rel for rel in recorded if rel not in present), None)
    if missing is not None:
        raise UserError(f"{shown(root / missing)}: missing: {shown(root / 'rollout.json')} records {WEIGHTS_KEY} of "
                        "it; expected the weight files agg-bench snapshot wrote")
    extra = next((rel for rel in present if rel not in recorded), None)
    if extra is not None:
        raise UserError(f"{shown(root / extra)}: a weight file {shown(root / 'rollout.json')} does not record in "
                        f"{WEIGHTS_KEY}: expected only the weight files agg-bench snapshot wrote "
                        f"({', '.join(sorted(recorded))})")
    for rel, digest in recorded.items():
        _check_digest(root, root / rel, digest, f"{WEIGHTS_KEY} {quote(rel)}", "weight file")


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _tensor_problem(name: str, tensor: torch.Tensor, dims: dict[str, int]) -> str | None:
    """What is wrong with the rollout tensor ``name``'s kind or shape (``dims``: the sizes known so far, each
    size of a dimension met first taken into it); None when nothing is."""
    if tensor.is_floating_point() == (name in INTEGER_TENSORS) or tensor.is_complex() or tensor.dtype == torch.bool:
        kind = "integers" if name in INTEGER_TENSORS else "floating-point numbers"
        return f"holds {_dtype_name(tensor.dtype)}: expected {kind}"
    spec = ROLLOUT_SHAPES[name]
    if name == "advantages" and tensor.dim() == 2:
        spec = ("B", "T")
    if tensor.dim() == len(spec):
        for size, dim in zip(tensor.shape, spec):
            letter, extra = (dim[0], 1) if dim.endswith("+1") else (dim, 0)
            if letter not in dims and size - extra >= 1:  # every size at least 1
                dims[letter] = size - extra
                if letter == "H" and "W" not in dims:  # square latents
                    dims["W"] = dims["H"]
        if all(size == dims.get(dim[0], -1) + (1 if dim.endswith("+1") else 0) for size, dim in zip(tensor.shape, spec)):
            return None
    expected = ", ".join(f"{dim}={dims[dim[0]] + (1 if dim.endswith('+1') else 0)}" if dim[0] in dims else dim
                         for dim in spec)
    return f"has shape {quote(list(tensor.shape))}: expected ({expected})"


def load_snapshot(snapshot_dir: str | Path, device: str | torch.device = "cpu") -> Snapshot:
    """The snapshot folder ``snapshot_dir``, every file checked before a gradient is computed: ``config.json``
    (the typed run config with its bounds, :func:`agg_bench.reading.run_config`), ``rollout.json``
    (:func:`_rollout_meta`), the transformer (:func:`_load_transformer`) and ``rollout.safetensors``
    (:func:`_rollout_tensors`). Anything else than what ``agg-bench snapshot`` writes is a UserError naming
    the file (and key or tensor), the value and what was expected."""
    root = Path(snapshot_dir)
    # a snapshot being written replaces its files one by one: meanwhile they are part of two snapshots
    check_not_written(root, "snapshot")
    if not root.is_dir():  # a mistyped path, or a file of the snapshot given for its folder
        raise UserError(f"snapshot {shown(root)}: {'no such folder' if not root.exists() else 'not a folder'}; "
                        "expected the folder `agg-bench snapshot --out` wrote")
    for name in ("transformer", "rollout.safetensors", "rollout.json"):
        if not (root / name).exists():
            raise UserError(f"snapshot {shown(root)}: missing {name} (make one with `agg-bench snapshot`)")
    config_path = root / "config.json"
    run = run_config(read_json_object(config_path, "the run config of an agg-bench snapshot (a JSON object)"),
                     config_path) if config_path.exists() else None
    meta = _rollout_meta(root, run)
    family = meta["family"]
    prec = precision(meta["dtype"])
    transformer = _load_transformer(root, meta, device)
    policy = POLICIES[family](transformer, None, autocast_dtype=prec.autocast_dtype, guidance=meta["guidance"])
    method = _snapshot_method(config_path, run)
    tensors = _rollout_tensors(root, policy, meta, method)
    if run is not None:
        _check_rollout_size(config_path, run, method, tensors)
    t = {k: v.to(device) for k, v in tensors.items()}
    batch = TrainBatch(
        latents=t["latents"], log_probs=t["log_probs"], sigmas=t["sigmas"], timesteps=t["timesteps"],
        advantages=t["advantages"], train_steps=t["train_steps"],
        cond=Conditioning.from_tensors(t),
        sde=meta["sde"], eta=meta["eta"], clip_range=meta["clip_range"], beta=meta["beta"],
        velocities=t.get("velocities"), policy_version=0, kl_form=meta["kl_form"],
    )
    check_not_written(root, "snapshot")  # a snapshot that began while its files were read
    return Snapshot(policy, batch, meta, run.to_dict() if run is not None else {}, root)


def _check_rollout_size(config_path: Path, run: RunConfig, method: Estimator, tensors: dict[str, torch.Tensor]) -> None:
    """The snapshot's run config ``run`` (``config_path``) against the size of its rollout ``tensors``: B samples
    of ``grpo.prompts_per_iteration`` x ``grpo.group_size``, and, where the snapshot's ``method`` samples on the
    run's own grid (the default rollout), T = ``sampling.steps``. A replay's run checks (AGG's W <= N, a plan's
    steps) read the config, so a config.json edited after the snapshot would check a window against steps the
    rollout does not have."""
    samples, steps = tensors["latents"].shape[0], tensors["latents"].shape[1] - 1
    rollout = f"{config_path.parent / 'rollout.safetensors'}"
    grpo = run.grpo
    if grpo.prompts_per_iteration * grpo.group_size != samples:
        raise UserError(f"{shown(config_path)}: grpo.prompts_per_iteration x grpo.group_size = "
                        f"{grpo.prompts_per_iteration} x {grpo.group_size}: expected {samples} samples in all, as "
                        f"{rollout} holds")
    run_grid = type(method).rollout is Estimator.rollout  # awm, dgpo, mixgrpo_flash sample on grids of their own
    if run_grid and run.sampling.steps != steps:
        raise UserError(f"{shown(config_path)}: sampling.steps = {run.sampling.steps}: expected {steps}, the steps of "
                        f"the rollout {rollout} holds")


def _snapshot_method(config_path: Path, run: RunConfig | None) -> Estimator:
    """The estimator of the run the snapshot was made by, set up as that run set it up (``check_run``): the
    default method for a snapshot without a run config."""
    if run is not None and is_method_path(run.method.name):  # imported, its module would run
        raise UserError(f"{shown(config_path)}: method.name = {quote(run.method.name)}: expected a registered method "
                        f"({', '.join(sorted(METHOD_MODULES))}): {NAMES_NO_CODE}")
    cfg = run if run is not None else validate(copy.deepcopy(DEFAULTS))
    estimator = build_estimator(cfg)
    try:
        estimator.check_run(cfg)
    except ConfigError as err:
        raise UserError(f"{shown(config_path)}: {err}") from None
    return estimator


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


def check_trainable(snapshot: Snapshot, estimator: Estimator, train_steps: torch.Tensor) -> None:
    """Refuse ``estimator`` on ``train_steps`` (a replay case's, or the snapshot's) where it cannot train them
    (:meth:`~agg_bench.methods.base.Estimator.check_train_steps`: AGG's groups on another method's steps)."""
    problem = estimator.check_train_steps(train_steps)
    if problem is not None:
        raise UserError(f"snapshot {shown(str(snapshot.root))}: method '{estimator.name}' cannot replay the steps of "
                        f"its train_steps: {problem}")


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
    check_trainable(snapshot, estimator, batch.train_steps)
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
    bad = _nonfinite(grads)
    if bad is not None:  # finite rollout numbers far outside any rollout's (advantages of 1e38, say)
        raise UserError(f"snapshot {shown(str(snapshot.root))}: method '{estimator.name}': gradient {bad[0]} holds "
                        f"{quote(bad[1])}: expected a finite gradient (the snapshot's latents, log_probs or "
                        "advantages are far outside what a rollout gives)")
    for p in policy.parameters():
        p.grad = None
    return grads, counts, {**stats.as_dict(), **estimator.iteration_metrics(), "replay": case.scope,
                           "replay_note": case.note, "steps_per_sample": batch.steps_per_sample}


def replay(snapshot_dir: str | Path, method: str, overrides: list[str], out_file: str | Path,
           device: str | torch.device = "cpu") -> dict:
    """Write ``method``'s gradient on the snapshot to ``out_file`` and its pass counts (and the replay's
    scope, :class:`~agg_bench.methods.base.ReplayCase`) to ``out_file`` .json; returns the pass counts.
    Every check runs before anything is written. An earlier replay's ``.json`` is removed once the new gradient
    is written and before it is renamed over the earlier one, and the new ``.json`` is written last: the two
    files on disk are always of one replay (or the gradient is there alone)."""
    out_file = Path(out_file)
    check_suffix(out_file, ".safetensors")
    check_outside_snapshot(out_file, snapshot_dir, "the snapshot")
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
            # an earlier replay's counts go before its gradient is replaced: a process killed between the two
            # renames leaves the new gradient without counts, never beside counts of another replay
            counts_file.unlink(missing_ok=True)
        write_json(counts_file, {**counts, "method": method, "overrides": overrides, "replay": case.scope,
                                 "stats": stats})
    return counts


def check_outside_snapshot(out: Path, snapshot_dir: str | Path, named: str) -> None:
    """Refuse an output file ``out`` inside the snapshot folder ``snapshot_dir`` (``named`` as its option or
    argument in the line): the folder holds the snapshot's files only, so a later snapshot into it would refuse
    the folder, and the snapshot's own files share its names (``rollout.json`` beside ``rollout.safetensors``)."""
    folder = Path(snapshot_dir).resolve()
    if folder == out.resolve() or folder in out.resolve().parents:
        raise UserError(f"--out {shown(out)}: inside {named} {shown(snapshot_dir)}; expected a file outside the "
                        "snapshot's folder, which holds the snapshot's files only")


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
