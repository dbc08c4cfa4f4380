"""Checkpoints: a run stopped anywhere continues where it stopped (``agg-bench run --resume``).

``DIR/checkpoint.pt`` holds the state after iteration k: the trainable parameters, the optimizer
state, the policy version, the global RNG states (torch, CUDA, numpy, python), the metric records
0..k exactly as written to ``metrics.jsonl``, the held-out evaluations of the states up to it as written
to ``evaluations.jsonl`` (none in a checkpoint written before the evaluations existed), and the run config. Every random draw of an iteration
comes from ``iteration_generator(seed, iteration)``, so an iteration depends on nothing else: resuming
after iteration k gives records k+1, ... equal to those of an uninterrupted run (timing fields aside).
Frozen weights (a LoRA base, the KL reference) are rebuilt from the config, so they are not saved; what a method
keeps from one iteration to the next (``Estimator.state_dict``: a moving average of the policy) is saved as
``method_state`` and given back to the method on resume. With ``train.eval_ema`` the evaluation average of the
trained parameters (:meth:`agg_bench.runtime.session.Session.evaluated_weights`) is saved as ``eval_ema`` (its
weights by parameter name, ``steps``, ``version``): a resumed run continues it, and ``agg-bench learning``
evaluates a checkpoint with those weights (:func:`evaluated_parameters`), as the public DiffusionNFT code saves
its EMA as the checkpoint's model.

**Sharded** (``train.shard: fsdp``): the parameters and optimizer state are written by every process,
each its own shards, with ``torch.distributed.checkpoint`` into ``DIR/checkpoint_shards_<iteration>/``;
``checkpoint.pt`` then holds everything else and the name of that folder, and is written last, so it
only ever names a complete folder; older shard folders are removed after it. Resuming loads the shards
into the sharded model (the process count may differ: the checkpoint is resharded on load). The folder is read
as data only, as every file of a run folder: its ``.metadata`` (a pickle, as torch writes it) through an unpickler
that takes only the classes of torch's checkpoint metadata (:func:`read_shard_metadata`), its tensors and its
other entries (the optimizer's settings) with ``torch.load(..., weights_only=True)``.

The file is written under a temporary name and renamed, so ``checkpoint.pt`` is always complete. The
records and evaluations travel inside it, so a resumed ``metrics.jsonl`` (and ``evaluations.jsonl``) is rebuilt from them even when the file was
deleted or holds records of iterations after the checkpoint (the workflow removes a failed job's outputs).
"""
from __future__ import annotations

import io
import os
import pathlib
import pickle  # noqa: TID251 (one restricted Unpickler: a shard folder's .metadata, read_shard_metadata)
import random
import re
import shutil
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields, is_dataclass
from pathlib import Path
from typing import Any, Callable, ClassVar

import numpy as np
import torch
import torch.distributed as dist

from ..config.load import first_difference
from ..errors import ConfigError, UserError, clip, quote, shown
from ..io import atomic_file
from ..jsonfiles import JsonProblem, TooLarge, loads, read_bounded
from ..outputs import CHECKPOINT_NAME, SHARDS_PREFIX
from ..records import is_integer

SHARDS_NAME = re.compile(re.escape(SHARDS_PREFIX) + r"[0-9]+")  # a folder beside checkpoint.pt, never a path
FORMAT = 1
# Config keys that change neither what a run computes nor what it records in metrics.jsonl: a finished run
# rerun with other values of these is the same run (a rerun replaces it without --overwrite).
SAME_RUN_CHANGES = ("progress", "train.checkpoint_every", "telemetry.tensorboard")
# Config keys that may differ between a run and its resumption: those above, and keys that change what is
# measured or how far the run goes but not the iterations' numbers (the device may: a run can move to another
# device of the same kind, or be requeued onto another node; the code and the kind of machine are checked apart,
# runfolder.machine_change). A finished run rerun with other values of these is another run: its records would
# differ.
RESUMABLE_CHANGES = (*SAME_RUN_CHANGES, "device", "telemetry", "train.iterations", "train.budget")


@dataclass
class Checkpoint:
    """What a resumed run continues from: the last finished ``iteration``, its ``records`` and the
    ``evaluations`` of the states up to it (JSON lines)."""

    iteration: int
    records: list[str]
    evaluations: list[str]


def checkpoint_path(out_dir: str | Path) -> Path:
    return Path(out_dir) / CHECKPOINT_NAME


def check_same_run(saved: dict, cfg: dict, out_dir: Path, flag: str = "--resume") -> None:
    """Raise a ConfigError naming the first key whose value differs from the checkpoint's config (``flag``: the
    option that asked to resume)."""
    from ..config import DEFAULTS

    diff = first_difference(saved, cfg, RESUMABLE_CHANGES, DEFAULTS)
    if diff is not None:
        key, old, new = diff
        raise ConfigError(key, new, f"{old!r} as in the checkpoint in {shown(out_dir)} (or run without {flag})")


def _rng_state(device: torch.device) -> dict:
    state = np.random.get_state()
    assert isinstance(state, tuple)  # legacy=True, the default, gives the tuple form
    name, keys, pos, has_gauss, cached = state
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state() if device.type == "cuda" else None,
        "numpy": {"name": name, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                  "has_gauss": int(has_gauss), "cached": float(cached)},
        "python": random.getstate(),
    }


def _set_rng_state(state: dict, device: torch.device) -> None:
    torch.set_rng_state(state["torch"])
    if device.type == "cuda" and state["cuda"] is not None:
        torch.cuda.set_rng_state(state["cuda"])
    n = state["numpy"]
    np.random.set_state((n["name"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["cached"]))
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _sharded_state(session) -> dict:
    """The trainable parameters and optimizer state of a sharded session, as DCP state dicts."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    model, optimizer = get_state_dict(session.policy.transformer, session.optimizer,
                                      options=StateDictOptions(ignore_frozen_params=True))
    return {"model": model, "optimizer": optimizer}


def remove_shard_folders(out_dir: Path, keep: str | None = None) -> None:
    """Remove the shard folders in ``out_dir`` but ``keep`` (the one ``checkpoint.pt`` names)."""
    for folder in Path(out_dir).glob(SHARDS_PREFIX + "*"):
        if folder.is_dir() and folder.name != keep:
            shutil.rmtree(folder, ignore_errors=True)


def first_failure(err: BaseException) -> BaseException:
    """The error of the first process that failed in a ``torch.distributed.checkpoint`` save or load (which
    reports every process's failure as one ``CheckpointException``); any other error itself."""
    from torch.distributed.checkpoint.api import CheckpointException

    if isinstance(err, CheckpointException) and err.failures:
        failure = next(iter(err.failures.values()))
        return failure[0] if isinstance(failure, tuple) else failure
    return err


def _save_shards(out_dir: Path, session, iteration: int) -> str:
    """Every process writes its shards into a fresh DIR/checkpoint_shards_<iteration>/; its name."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    name = f"{SHARDS_PREFIX}{iteration:06d}"
    if dist.get_rank() == 0:  # a folder a failed attempt left under this name: not the one checkpoint.pt names
        shutil.rmtree(out_dir / name, ignore_errors=True)
    dist.barrier()
    try:
        dcp.save(_sharded_state(session), checkpoint_id=out_dir / name)
    except CheckpointException as err:
        # a BaseException: it would pass every handler of the run (the summary's, a full disk's); the error of
        # the process that failed (a full disk among them) goes on instead
        raise first_failure(err) from None
    dist.barrier()
    return name


def save_checkpoint(out_dir: str | Path, session, iteration: int, records: list[str], config: dict,
                    evaluations: Sequence[str] = ()) -> Path:
    """Write the state after ``iteration`` (records 0..iteration and the evaluations up to it, as JSON lines)
    to DIR/checkpoint.pt atomically.

    A sharded session is saved by every process (its shards); only rank 0 writes ``checkpoint.pt``."""
    from ..machine.fsdp import is_sharded

    path = checkpoint_path(out_dir)
    state = {
        "format": FORMAT,
        "iteration": iteration,
        "policy_version": session.policy.version,
        "rng": _rng_state(session.device),
        "records": list(records),
        "evaluations": list(evaluations),
        "config": config,
    }
    if is_sharded(session.policy):
        state["shards"] = _save_shards(Path(out_dir), session, iteration)
        if dist.get_rank() != 0:
            return path
    else:
        state["parameters"] = {name: p.detach().cpu() for name, p in session.policy.named_parameters()}
        state["optimizer"] = session.optimizer.state_dict()
    method_state = session.estimator.state_dict()  # e.g. a moving average of the policy
    if method_state is not None:
        state["method_state"] = method_state
    if session.eval_ema is not None:
        state["eval_ema"] = session.eval_ema.state_dict()
    with atomic_file(path, "wb") as fh:
        torch.save(state, fh)
    _fsync_dir(path.parent)
    remove_shard_folders(path.parent, keep=state.get("shards"))
    return path


def _json_lines(lines: Any, what: str) -> tuple[list[dict] | None, str | None]:
    """``lines`` (a list of JSON texts, each an object) parsed; or the problem."""
    if not isinstance(lines, list) or not all(isinstance(line, str) for line in lines):
        return None, f"{what} = {quote(lines)}: expected a list of JSON lines"
    parsed = []
    for k, line in enumerate(lines, 1):
        try:
            value = loads(line)
        except JsonProblem:
            return None, f"{what} line {k} = {quote(line)}: expected a JSON object"
        if not isinstance(value, dict):
            return None, f"{what} line {k} = {quote(line)}: expected a JSON object"
        parsed.append(value)
    return parsed, None


def _rng_problem(rng: Any) -> str | None:
    """What keeps ``rng`` from being the random states :func:`_rng_state` writes; None when nothing does."""
    if not isinstance(rng, dict):
        return f"rng = {quote(rng)}: expected the random states (an object)"
    if not (isinstance(rng.get("torch"), torch.Tensor) and rng["torch"].dtype == torch.uint8):
        return "rng.torch: expected torch's random state (a uint8 tensor)"
    if rng.get("cuda") is not None and not (isinstance(rng["cuda"], torch.Tensor) and rng["cuda"].dtype == torch.uint8):
        return "rng.cuda: expected CUDA's random state (a uint8 tensor) or null"
    n = rng.get("numpy")
    if not (isinstance(n, dict) and isinstance(n.get("name"), str) and isinstance(n.get("keys"), torch.Tensor)
            and tuple(n["keys"].shape) == (624,) and is_integer(n.get("pos")) and is_integer(n.get("has_gauss"))
            and isinstance(n.get("cached"), float)):
        return "rng.numpy: expected numpy's random state (name, 624 keys, pos, has_gauss, cached)"
    p = rng.get("python")
    if not (isinstance(p, (tuple, list)) and len(p) == 3 and is_integer(p[0]) and isinstance(p[1], (tuple, list))
            and all(is_integer(v) for v in p[1]) and (p[2] is None or isinstance(p[2], float))):
        return "rng.python: expected Python's random state (version, internal state, gauss)"
    return None


def checkpoint_problem(state: Any) -> str | None:
    """What keeps ``state`` from being a checkpoint :func:`save_checkpoint` writes; None when nothing does.

    Checked: the format; ``iteration`` and ``policy_version`` integers >= 0; ``records`` the JSON lines of
    iterations 0..``iteration`` in order, each by the record contract; ``evaluations`` JSON lines of the
    states up to it; ``config`` the typed run config with its bounds; the random states; and either the
    whole ``parameters`` (names to floating-point tensors) with the ``optimizer`` state, or the name of its
    shard folder. Whether the parameters are this model's is :func:`parameters_problem`'s question."""
    from ..reading import evaluations_problem, run_config
    from ..records import records_problem

    if not isinstance(state, dict) or state.get("format") != FORMAT:
        return f"not an agg-bench checkpoint of format {FORMAT}"
    iteration = state.get("iteration")
    if not is_integer(iteration) or iteration < 0:
        return f"iteration = {quote(iteration)}: expected an integer >= 0"
    version = state.get("policy_version")
    if not is_integer(version) or version < 0:
        return f"policy_version = {quote(version)}: expected an integer >= 0"
    records, problem = _json_lines(state.get("records"), "records")
    if records is None:
        return problem
    problem = records_problem(records, ("iteration",))
    if problem is not None:
        return f"records: {problem}"
    if [r["iteration"] for r in records] != list(range(iteration + 1)):
        return f"records: iterations {quote([r['iteration'] for r in records])}: expected 0 to {iteration} in order"
    evaluations, problem = _json_lines(state.get("evaluations", []), "evaluations")
    if evaluations is None:
        return problem
    problem = evaluations_problem(evaluations)
    if problem is not None:
        return f"evaluations: {problem}"
    if any(e["iteration"] > iteration + 1 for e in evaluations):
        return f"evaluations: a state after iteration {iteration}, the checkpoint's"
    try:
        run_config(state.get("config"), "config")
    except UserError as err:
        return str(err)
    problem = _rng_problem(state.get("rng"))
    if problem is not None:
        return problem
    problem = _eval_ema_problem(state.get("eval_ema"))
    if problem is not None:
        return problem
    if "shards" in state:
        name = state["shards"]
        if not (isinstance(name, str) and SHARDS_NAME.fullmatch(name)):
            return f"shards = {quote(name)}: expected the name of a shard folder beside it ({SHARDS_PREFIX}NNNNNN)"
        return None
    params = state.get("parameters")
    if not isinstance(params, dict) or not params or not all(
            isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in params.items()):
        return "parameters: expected the trainable parameters (names to tensors)"
    name = next((k for k, v in params.items() if not v.is_floating_point()), None)
    if name is not None:
        return f"parameters: {quote(name)} is a {params[name].dtype} tensor; expected floating-point parameters"
    optimizer = state.get("optimizer")
    if not (isinstance(optimizer, dict) and isinstance(optimizer.get("state"), dict)
            and isinstance(optimizer.get("param_groups"), list)):
        return "optimizer: expected the optimizer's state (state, param_groups)"
    return None


def _eval_ema_problem(average: Any) -> str | None:
    """What keeps ``average`` from being the evaluation average :func:`save_checkpoint` writes (or its absence,
    None); None when nothing does. Whether its weights are this model's is checked where they are loaded."""
    if average is None:
        return None
    weights = average.get("weights") if isinstance(average, dict) else None
    if not isinstance(weights, dict) or not weights or not all(
            isinstance(k, str) and isinstance(v, torch.Tensor) and v.is_floating_point() for k, v in weights.items()):
        return "eval_ema: expected the evaluation average's weights (names to floating-point tensors)"
    steps, version = average.get("steps"), average.get("version")
    if not (is_integer(steps) and steps >= 0 and (version is None or (is_integer(version) and version >= 0))):
        return (f"eval_ema: steps = {quote(steps)}, version = {quote(version)}: expected integers >= 0 (version "
                "may be null)")
    return None


def evaluated_parameters(state: dict) -> dict[str, torch.Tensor]:
    """The trainable parameters an evaluation of a checked checkpoint ``state`` takes: the evaluation average's
    weights where the run kept one (``train.eval_ema``), else the trained parameters."""
    return state["eval_ema"]["weights"] if "eval_ema" in state else state["parameters"]


def read_checkpoint(path: str | Path, prefix: str = "", advice: str = "") -> dict:
    """The state dict of the checkpoint file ``path``, read with ``weights_only=True`` (tensors, numbers,
    strings and containers only, so a crafted file cannot run code) and checked whole
    (:func:`checkpoint_problem`). A foreign, damaged, pickled-object or malformed file is a UserError
    (``prefix`` + the file + the reason + ``advice``), never an unpickling traceback."""
    path = Path(path)
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # pickle / zip errors come in many types; all mean "not our checkpoint"
        raise UserError(f"{prefix}{shown(path)} is not a readable agg-bench checkpoint "
                        f"({type(err).__name__}){advice}") \
            from None
    problem = checkpoint_problem(state)
    if problem is not None:
        raise UserError(f"{prefix}{shown(path)}: {problem}{advice}")
    return state


def parameters_problem(saved: dict, params: Mapping[str, torch.Tensor]) -> str | None:
    """What keeps a checkpoint's ``saved`` parameters from being exactly the model's trainable ``params``
    (every one present, no other, each of its shape); None when nothing does."""
    missing = [name for name in params if name not in saved]
    if missing:
        return (f"holds no {quote(missing[0])} ({len(missing)} of the model's {len(params)} trainable parameters "
                "missing)")
    unexpected = [name for name in saved if name not in params]
    if unexpected:
        return f"holds {quote(unexpected[0])}, which the model does not train ({len(unexpected)} such parameters)"
    for name, p in params.items():
        if tuple(saved[name].shape) != tuple(p.shape):
            return f"parameter {quote(name)} has shape {tuple(saved[name].shape)}; the model's is {tuple(p.shape)}"
    return None


def load_parameters(module_params: Mapping[str, torch.Tensor], saved: dict, path: Path, prefix: str = "",
                    advice: str = "") -> None:
    """Copy ``saved`` (a checked checkpoint's parameters) into the model's trainable parameters, strictly:
    a UserError naming ``path`` unless they are exactly those parameters, each of its shape."""
    problem = parameters_problem(saved, module_params)
    if problem is not None:
        raise UserError(f"{prefix}{shown(path)} does not match the model: it {problem}{advice}")
    with torch.no_grad():
        for name, p in module_params.items():
            p.copy_(saved[name])


def load_checkpoint(out_dir: str | Path, session, config: dict, flag: str = "--resume") -> Checkpoint | None:
    """Restore ``session`` from DIR/checkpoint.pt; None (and nothing changed) when there is none. ``flag``: the
    option that asked to resume (``--resume``, ``--resume-stopped``), which every refusal starts with and advises
    running without.

    Raises a ConfigError when ``config`` differs from the checkpoint's in a key that changes what is
    computed, and a UserError when the file is not a checkpoint of this model (:func:`read_checkpoint`,
    then its parameters, optimizer state and random states as this session takes them).
    """
    path = checkpoint_path(out_dir)
    if not path.is_file():
        return None
    advice = f"; delete it or run without {flag}"
    state = read_checkpoint(path, f"{flag}: ", advice)
    check_same_run(state["config"], config, Path(out_dir), flag)
    if "shards" in state:
        _load_shards(Path(out_dir), session, state["shards"], path, flag)
    else:
        _load_parameters(session, state, path, advice, flag)
    session.policy.version = state["policy_version"]
    if isinstance(state.get("method_state"), dict):
        session.estimator.load_state_dict(state["method_state"], session.policy)
    if session.eval_ema is not None:  # the config matched the checkpoint's, whose run kept one
        if "eval_ema" not in state:
            raise UserError(f"{flag}: {shown(path)} holds no evaluation average (train.eval_ema){advice}")
        session.eval_ema = type(session.eval_ema).from_state(session.policy, state["eval_ema"],
                                                             f"evaluation average (train.eval_ema) in {path}")
    try:
        _set_rng_state(state["rng"], session.device)
    except (TypeError, ValueError, RuntimeError) as err:
        raise UserError(f"{flag}: {shown(path)}: rng: not random states this machine takes "
                        f"({type(err).__name__}){advice}") \
            from None
    return Checkpoint(iteration=state["iteration"], records=list(state["records"]),
                      evaluations=list(state.get("evaluations", [])))


# A shard folder's .metadata is read whole before it is unpickled: far above what a sharded save of the largest model
# planned here writes (a full fine-tune of Qwen-Image, 1,933 parameter tensors, over 8 processes: about 8 MiB; the
# file grows by about 1 MiB per process), and what bounds the memory a crafted one can make a reader allocate.
MAX_SHARD_METADATA_BYTES = 64 * 2**20
# dimensions of one torch.Size in a .metadata (a tensor's shape or a chunk's offsets); the models here have at most 5
MAX_SHAPE_DIMS = 64
# a path longer than Linux's PATH_MAX is no checkpoint's path
MAX_PATH_CHARS = 4096


def _bounded_size(dims: Any = ()) -> torch.Size:
    """``torch.Size(dims)`` for a sequence of at most :data:`MAX_SHAPE_DIMS` integers: unbounded, each of a crafted
    file's few bytes that build a size could copy a sequence it built once, however long."""
    if not isinstance(dims, (tuple, list)) or len(dims) > MAX_SHAPE_DIMS:
        raise _Refused(f"holds a tensor size of {len(dims) if isinstance(dims, (tuple, list)) else type(dims).__name__}"
                       f" dimensions, where torch's checkpoint metadata holds at most {MAX_SHAPE_DIMS}")
    return torch.Size(dims)


def _metadata_globals() -> dict[tuple[str, str], Callable]:
    """Every global a ``.metadata`` that ``torch.distributed.checkpoint`` writes refers to, by its exact (module,
    name), to the object it stands for: the metadata dataclasses and the storage info of the file-system writer,
    ``torch.Size`` (built bounded, :func:`_bounded_size`), the dtypes, the layout lookup and the checkpoint's path
    (built once, :class:`ShardMetadataUnpickler`). Names a torch version lacks are left out."""
    from torch.distributed.checkpoint import filesystem, metadata

    found: dict[tuple[str, str], Any] = {
        **{(metadata.__name__, name): getattr(metadata, name, None)
           for name in ("Metadata", "MetadataIndex", "StorageMeta", "TensorStorageMetadata", "BytesStorageMetadata",
                        "ChunkStorageMetadata", "TensorProperties", "_MEM_FORMAT_ENCODING")},
        (filesystem.__name__, "_StorageInfo"): getattr(filesystem, "_StorageInfo", None),
        ("torch", "Size"): _bounded_size,
        # a layout is pickled as this lookup of its name ("torch.strided"), a dtype as the torch attribute
        ("torch.serialization", "_get_layout"): getattr(torch.serialization, "_get_layout", None),
        **{("torch", name): value for name, value in vars(torch).items() if isinstance(value, torch.dtype)},
        # the checkpoint's path (StorageMeta.checkpoint_id); Python 3.13 moved the class to pathlib._local
        ("pathlib", "PosixPath"): pathlib.PosixPath,
        ("pathlib._local", "PosixPath"): pathlib.PosixPath,
    }
    return {key: value for key, value in found.items() if value is not None}


class _Refused(pickle.UnpicklingError):
    """What :class:`ShardMetadataUnpickler` refuses to resolve or build (told apart from a file that is not a
    pickle)."""


# opcodes torch's checkpoint metadata never holds: sets (one byte that builds a 216-byte object), persistent and
# extension references, and the old instance opcodes and out-of-band buffers, which build objects outside REDUCE
_FOREIGN_OPCODES = {pickle.EMPTY_SET: "a set", pickle.ADDITEMS: "a set", pickle.FROZENSET: "a frozenset",
                    pickle.PERSID: "a persistent reference", pickle.BINPERSID: "a persistent reference",
                    pickle.EXT1: "an extension reference", pickle.EXT2: "an extension reference",
                    pickle.EXT4: "an extension reference", pickle.INST: "an INST opcode", pickle.OBJ: "an OBJ opcode",
                    pickle.NEXT_BUFFER: "an out-of-band buffer", pickle.READONLY_BUFFER: "an out-of-band buffer"}


def _foreign(what: str) -> Callable[[Any], None]:
    def refuse(self: Any) -> None:
        raise _Refused(f"holds {what}, which torch's checkpoint metadata never holds")
    return refuse


# Python's own unpickler, whose opcodes a subclass can replace (C's cannot be told which to take); typeshed leaves
# its internals out
_PythonUnpickler: Any = pickle._Unpickler


class ShardMetadataUnpickler(_PythonUnpickler):
    """Unpickles a shard folder's ``.metadata`` resolving only the globals of :func:`_metadata_globals`: any other
    (``os.system``, ``builtins.eval``, a class of any other module) is refused before it is looked up, so nothing
    the file names is imported or called. What the allowed classes do when built (dataclass fields, an enum
    value, a path, a size) runs no code the file chooses.

    Python's own unpickler (``pickle._Unpickler``) with the opcodes of
    :data:`_FOREIGN_OPCODES` refused, and a call (REDUCE) only of what torch pickles as one: a size (at most
    :data:`MAX_SHAPE_DIMS` dimensions), a layout, a memory format's code and one path of at most
    :data:`MAX_PATH_CHARS` characters; the dataclasses are built as pickle builds them (NEWOBJ, then their own
    fields, BUILD), never called, since ``MetadataIndex`` copies what it is given into a size. So no opcode copies
    anything the file built before, and a file builds objects of at most about a hundred bytes per byte of it."""

    dispatch: ClassVar[dict] = {**_PythonUnpickler.dispatch,
                                **{code[0]: _foreign(what) for code, what in _FOREIGN_OPCODES.items()}}

    def __init__(self, file, allowed: dict[tuple[str, str], Callable]):
        super().__init__(file)
        self.allowed = allowed
        self.built = {id(value) for value in allowed.values() if isinstance(value, type) and is_dataclass(value)}
        self.called = {id(value) for value in allowed.values() if callable(value) and id(value) not in self.built}
        self.paths = 0

    def find_class(self, module: str, name: str) -> Any:
        found = self.allowed.get((module, name))
        if found is None:
            raise _Refused(f"refers to {clip(f'{module}.{name}')}, which torch's checkpoint "
                                         "metadata never holds")
        return found

    def persistent_load(self, pid: Any) -> Any:
        raise _Refused("holds a persistent reference, which torch's checkpoint metadata never holds")

    def load_reduce(self) -> None:
        args = self.stack.pop()
        func = self.stack[-1]
        name = getattr(func, "__qualname__", type(func).__name__)
        if id(func) not in self.called or not isinstance(args, tuple):
            raise _Refused(f"calls {clip(name)}, which torch's checkpoint metadata builds without a call")
        if isinstance(func, type) and issubclass(func, pathlib.PurePath):
            self.paths += 1
            if self.paths > 1 or not all(isinstance(part, str) for part in args) \
                    or sum(map(len, args)) > MAX_PATH_CHARS:
                raise _Refused(f"holds a second path or one longer than {MAX_PATH_CHARS} characters, where torch's "
                               "checkpoint metadata holds one (the checkpoint's)")
        self.stack[-1] = func(*args)

    def load_newobj(self) -> None:
        self._check_built(self.stack[-2])
        super().load_newobj()

    def load_newobj_ex(self) -> None:
        self._check_built(self.stack[-3])
        super().load_newobj_ex()

    def load_build(self) -> None:
        state, inst = self.stack[-1], self.stack[-2]
        if id(type(inst)) not in self.built:
            raise _Refused(f"sets fields of {clip(type(inst).__qualname__)}, which torch's checkpoint metadata never does")
        # a dataclass's fields are set from a dict the file may have built once, copied whole: only its own names
        names = {field.name for field in fields(inst)}
        if not hasattr(inst, "__setstate__") and not (isinstance(state, dict) and len(state) <= len(names)
                                                      and all(key in names for key in state)):
            raise _Refused(f"sets {type(inst).__qualname__} from {type(state).__name__}, not from its own fields")
        super().load_build()

    def _check_built(self, cls: Any) -> None:
        if id(cls) not in self.built:
            name = getattr(cls, "__qualname__", type(cls).__name__)
            raise _Refused(f"builds {clip(name)} as an object of its own, which torch's checkpoint metadata never does")

    dispatch[pickle.REDUCE[0]] = load_reduce
    dispatch[pickle.NEWOBJ[0]] = load_newobj
    dispatch[pickle.NEWOBJ_EX[0]] = load_newobj_ex
    dispatch[pickle.BUILD[0]] = load_build


def read_shard_metadata(path: str | Path, flag: str = "--resume") -> Any:
    """The ``torch.distributed.checkpoint`` metadata in ``path`` (a shard folder's ``.metadata``), read with
    :class:`ShardMetadataUnpickler`: a file that refers to anything else, or that is not a whole pickle of a
    ``Metadata``, is a UserError naming the file (and what it referred to), refused before anything it names runs;
    so is a file over :data:`MAX_SHARD_METADATA_BYTES`, before it is read (``flag``: the option that asked to
    resume, as :func:`load_checkpoint` names it)."""
    from torch.distributed.checkpoint.metadata import Metadata

    advice = f"; delete the checkpoint or run without {flag}"
    path = Path(path)
    try:
        data = read_bounded(path, MAX_SHARD_METADATA_BYTES)
        # from memory: a length the file claims for a string reads what is there, never allocates the claim
        metadata = ShardMetadataUnpickler(io.BytesIO(data), _metadata_globals()).load()
    except TooLarge as err:
        size = "" if err.size is None else f"{err.size:,} bytes, "
        raise UserError(f"{flag}: {shown(path)} is {size}over the {MAX_SHARD_METADATA_BYTES // 2**20} MiB a sharded "
                        f"checkpoint's metadata may have; refused unread{advice}") from None
    except _Refused as err:
        raise UserError(f"{flag}: {shown(path)} is not a sharded checkpoint's metadata: it {err}; refused "
                        f"unread{advice}") \
            from None
    except OSError as err:
        raise UserError(f"{flag}: {shown(path)} cannot be read "
                        f"({err.strerror or type(err).__name__}){advice}") from None
    except Exception as err:  # a cut or foreign file fails in many ways inside pickle
        reason = ": ".join([type(err).__name__, *[clip(line) for line in str(err).splitlines()[:1]]])
        raise UserError(f"{flag}: {shown(path)} is not a sharded checkpoint's metadata ({reason}){advice}") from None
    if not (isinstance(metadata, Metadata) and isinstance(getattr(metadata, "state_dict_metadata", None), dict)
            and isinstance(getattr(metadata, "storage_data", None), dict)):
        raise UserError(f"{flag}: {shown(path)} is not a sharded checkpoint's metadata (it holds "
                        f"{type(metadata).__name__}){advice}")
    return metadata


def data_only_io(folder: Path, metadata: Any, flag: str = "--resume") -> tuple[Any, Any]:
    """The storage reader and load planner with which ``torch.distributed.checkpoint.load`` reads the shard folder
    ``folder`` as data only: its metadata ``metadata``, which :func:`read_shard_metadata` read from the folder's
    ``.metadata`` (so the file is read once, and what loads is what was checked), its entries that are not tensors
    (the optimizer's settings, which torch's default planner unpickles whole) with ``weights_only=True`` (one that
    is anything else is a UserError naming ``flag``, the folder and the entry), its tensors as torch reads them
    (``weights_only=True``)."""
    from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class DataOnlyReader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any):
            rank = kwargs.get("rank")  # torch's fallback to a process's own metadata, which our saves never write
            found = metadata if rank is None else read_shard_metadata(folder / f"__{rank}.metadata", flag)
            if getattr(found, "storage_meta", None) is None:
                found.storage_meta = StorageMeta()
            found.storage_meta.load_id = getattr(self, "load_id", None)
            return found

    class DataOnlyPlanner(DefaultLoadPlanner):
        def load_bytes(self, read_item, value) -> None:
            try:
                data = torch.load(value, map_location="cpu", weights_only=True)
            except Exception as err:
                raise UserError(f"{flag}: {shown(folder)}: entry {quote(read_item.dest_index.fqn)} is not plain data "
                                f"({type(err).__name__}); delete the checkpoint or run without {flag}") from None
            plain = io.BytesIO()  # the default planner unpickles what it is given: give it what was just checked
            torch.save(data, plain)
            plain.seek(0)
            super().load_bytes(read_item, plain)

    return DataOnlyReader(folder), DataOnlyPlanner()


def _load_shards(out_dir: Path, session, name: str, path: Path, flag: str) -> None:
    """Load the shard folder ``name`` that ``path`` names into the sharded session, as data only
    (:func:`data_only_io`). Its metadata is read and checked by every process before any loads: a problem on
    one process is a UserError on all."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    from ..machine import distributed
    from ..machine.fsdp import is_sharded

    folder = out_dir / name
    with distributed.failures_shared():
        if not is_sharded(session.policy) or not (folder / ".metadata").is_file():
            raise UserError(f"{flag}: {shown(path)} names the shard folder {shown(folder)}, which is missing or "
                            f"incomplete; delete the checkpoint or run without {flag}")
        metadata = read_shard_metadata(folder / ".metadata", flag)
    reader, planner = data_only_io(folder, metadata, flag)
    state = _sharded_state(session)
    try:
        dcp.load(state, storage_reader=reader, planner=planner)
    except (Exception, CheckpointException) as err:  # e.g. another model's parameter names, a shard file removed
        cause = first_failure(err)
        if isinstance(cause, UserError):
            raise cause from None
        raise UserError(f"{flag}: {shown(folder)} is damaged or does not match the model's trainable parameters "
                        f"({': '.join([type(cause).__name__, *str(cause).splitlines()[:1]])}); delete "
                        f"the checkpoint or run without {flag}") from err
    set_state_dict(session.policy.transformer, session.optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optimizer"], options=StateDictOptions(ignore_frozen_params=True))


def _load_parameters(session, state: dict, path: Path, advice: str, flag: str) -> None:
    """Copy a whole (unsharded) checkpoint's parameters and optimizer state into the session, both checked
    against the session's trainable parameters first (nothing is changed when either does not match)."""
    params = dict(session.policy.named_parameters())
    problem = parameters_problem(state["parameters"], params)
    if problem is None:
        problem = _optimizer_problem(state["optimizer"], list(params.values()))
    if problem is not None:
        raise UserError(f"{flag}: {shown(path)} does not match the model: it {problem}{advice}")
    load_parameters(params, state["parameters"], path, f"{flag}: ", advice)
    try:
        session.optimizer.load_state_dict(state["optimizer"])
    except (KeyError, TypeError, ValueError, RuntimeError) as err:
        raise UserError(f"{flag}: {shown(path)}: optimizer: not this run's optimizer state ({type(err).__name__})"
                        f"{advice}") from None


def _optimizer_problem(optimizer: dict, params: list[torch.Tensor]) -> str | None:
    """What keeps ``optimizer`` from being the state of an optimizer over ``params`` (in order): every
    per-parameter tensor that is not a scalar has its parameter's shape; None when nothing does."""
    groups = optimizer["param_groups"]
    ids = [i for g in groups if isinstance(g, dict) for i in (g.get("params") or [])]
    if not all(isinstance(g, dict) for g in groups) or sorted(ids) != list(range(len(params))):
        return f"holds the optimizer state of {len(ids)} parameters; the model trains {len(params)}"
    for index, values in optimizer["state"].items():
        if not (is_integer(index) and 0 <= index < len(params) and isinstance(values, dict)):
            return f"holds optimizer state for parameter {quote(index)}, which it does not train"
        for key, value in values.items():
            if isinstance(value, torch.Tensor) and value.dim() > 0 and tuple(value.shape) != tuple(params[index].shape):
                return (f"holds optimizer state {key!r} of shape {tuple(value.shape)} for a parameter of shape "
                        f"{tuple(params[index].shape)}")
    return None
