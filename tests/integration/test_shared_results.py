"""A results folder is meant to be shared: nothing in it runs code, no two writers share an output, no write
leaves the folder the user named, and a failure (a full disk included) leaves nothing half-written.

Every command that writes goes through agg_bench.outdir; these tests take each one through its refusals:
another process writing the same output, someone else's files, symbolic links, crafted pickles."""
from __future__ import annotations

import ast
import errno
import json
import os
import subprocess
import sys
from pathlib import Path, PosixPath

import pytest
import torch

from agg_bench import outdir
from agg_bench.cli import main
from agg_bench.errors import UserError
from helpers import Calls, Holder

ROOT = Path(__file__).resolve().parents[2]
SMALL = ["model.resolution=32", "sampling.steps=4", "grpo.group_size=2", "train.iterations=1", "progress=false",
         "telemetry.enabled=false"]
SETS = [arg for item in SMALL for arg in ("--set", item)]


def files(folder: Path) -> dict[str, bytes]:
    """Every file under ``folder`` (relative path -> bytes; a link as its target's name)."""
    out = {}
    for path in sorted(folder.rglob("*")):
        key = str(path.relative_to(folder))
        if path.is_symlink():
            out[key] = b"-> " + os.readlink(path).encode()
        elif path.is_file():
            out[key] = path.read_bytes()
    return out


def refused(capsys, argv: list[str], *words: str) -> str:
    """``agg-bench ARGV`` exits 2 with one stderr line holding ``words``; the line."""
    capsys.readouterr()
    code = main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    for word in words:
        assert word in err[0], err[0]
    return err[0]


def leftovers(folder: Path) -> list[str]:
    """The harness's temporaries and locks anywhere under ``folder``."""
    return [str(p) for p in folder.rglob("*") if outdir.is_harness_name(p.name)]


def dance_log(path: Path, steps: int = 4) -> Path:
    path.write_text("".join(json.dumps({"step": i, "avg_reward": 0.1 * i, "step_time": 2.0, "grad_norm": 1.0}) + "\n"
                            for i in range(steps)))
    return path


# ----- nothing in a results folder runs code -------------------------------------------------------------
SOURCES = [p for d in ("agg_bench", "baselines", "scripts", "benchmarks") for p in (ROOT / d).rglob("*.py")]
WORKFLOW = [ROOT / "Snakefile", *(ROOT / "workflow").rglob("*.smk")]  # Snakemake's syntax: read as text


def _calls(tree: ast.AST):
    """(call, owner, name) of every call: ``torch.load(...)`` -> ("torch", "load"), ``eval(...)`` -> ("", "eval"),
    a method of anything else (``model.eval()``) -> ("?", "eval")."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            func = node.func
            if isinstance(func, ast.Name):
                yield node, "", func.id
            elif isinstance(func, ast.Attribute):
                yield node, func.value.id if isinstance(func.value, ast.Name) else "?", func.attr


# The one unpickler of the package: a shard folder's .metadata, resolving only the globals of torch's checkpoint
# metadata (the tests of the sharded checkpoint's folder above take crafted files through it).
ALLOWED_UNPICKLERS = {("agg_bench/runtime/checkpoint.py", "ShardMetadataUnpickler")}
PICKLE_MODULES = ("pickle", "_pickle", "cPickle", "dill", "marshal", "shelve")


def _unpickling(tree: ast.AST):
    """(node, what) of every import of a pickle module and every class derived from an ``...Unpickler``."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] in PICKLE_MODULES:
                    yield node, f"import {alias.name}"
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in PICKLE_MODULES:
            yield node, f"from {node.module} import"
        elif isinstance(node, ast.ClassDef):
            bases = [b.attr if isinstance(b, ast.Attribute) else b.id if isinstance(b, ast.Name) else "" for b in node.bases]
            if any(base.endswith("Unpickler") for base in bases):
                yield node, f"class {node.name}"


def test_no_source_unpickles_or_evaluates_what_it_reads():
    """Every torch.load passes weights_only=True; no eval, exec, pickle/marshal/shelve loads, unsafe YAML or
    numpy pickles anywhere in the package, the scripts or the workflow; pickle is imported, and an Unpickler
    derived, only for :data:`ALLOWED_UNPICKLERS`, whose class resolves globals itself (``find_class``)."""
    problems, found = [], set()
    for path in SOURCES:
        text = path.read_text()
        if "weights_only=False" in text:
            problems.append(f"{path}: weights_only=False")
        tree = ast.parse(text, str(path))
        relative = str(path.relative_to(ROOT))
        allowed = {name for file, name in ALLOWED_UNPICKLERS if file == relative}
        for node, what in _unpickling(tree):
            if isinstance(node, ast.ClassDef) and node.name in allowed:
                found.add((relative, node.name))
                if "find_class" not in {f.name for f in node.body if isinstance(f, ast.FunctionDef)}:
                    problems.append(f"{relative}:{node.lineno}: {what} resolves globals as pickle does")
            elif not (allowed and what == "import pickle"):
                problems.append(f"{relative}:{node.lineno}: {what}")
        for node, owner, name in _calls(tree):
            where = f"{path.relative_to(ROOT)}:{node.lineno}"
            keywords = {k.arg: k.value for k in node.keywords}
            if owner == "torch" and name == "load":
                value = keywords.get("weights_only")
                if not (isinstance(value, ast.Constant) and value.value is True):
                    problems.append(f"{where}: torch.load without weights_only=True")
            if (owner == "" and name in ("eval", "exec")) or (owner in ("pickle", "marshal", "shelve", "dill")
                                                             and name in ("load", "loads", "open", "Unpickler")):
                problems.append(f"{where}: {owner + '.' if owner else ''}{name}")
            if owner == "yaml" and name in ("load", "load_all", "unsafe_load", "full_load"):
                loader = keywords.get("Loader")
                if not (isinstance(loader, ast.Name) and loader.id in ("_Loader", "SafeLoader", "CSafeLoader")):
                    problems.append(f"{where}: yaml.{name} without a safe loader")
            if name == "load" and owner in ("np", "numpy"):
                value = keywords.get("allow_pickle")
                if value is not None and not (isinstance(value, ast.Constant) and value.value is False):
                    problems.append(f"{where}: np.load with allow_pickle")
            if name == "read_pickle":
                problems.append(f"{where}: read_pickle")
    for path in WORKFLOW:
        for word in ("torch.load", "pickle", "marshal", "eval(", "exec(", "yaml.load(", "weights_only"):
            if word in path.read_text():
                problems.append(f"{path.relative_to(ROOT)}: {word}")
    assert not problems, problems
    assert found == ALLOWED_UNPICKLERS  # the allowance names a class that is there
    # the check sees what it is meant to see
    bad = "import torch, yaml, pickle\ntorch.load(f)\ntorch.load(f, weights_only=False)\neval(s)\npickle.loads(b)\n" \
          "yaml.load(t)\n"
    assert len([c for c in _calls(ast.parse(bad)) if c[2] in ("load", "loads", "eval")]) == 5
    lax = "import pickle\nfrom pickle import loads\nimport _pickle as p\nclass U(pickle.Unpickler): pass\n" \
          "class V(ShardMetadataUnpickler): pass\n"
    assert [what for _, what in _unpickling(ast.parse(lax))] == \
        ["import pickle", "from pickle import", "import _pickle", "class U", "class V"]


class Payload:
    """Unpickling this calls ``Path.touch`` on the marker: what a crafted file would do to its reader."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def crafted(path: Path, marker: Path, state: dict | None = None) -> Path:
    torch.save({**(state or {}), "format": 1, "parameters": Payload(marker), "payload": Payload(marker)}, path)
    return path


def test_the_payload_runs_when_unpickled(tmp_path):
    """The crafted file is live: read without weights_only it touches the marker (so the refusals below mean
    something)."""
    marker = tmp_path / "ran"
    path = crafted(tmp_path / "x.pt", marker)
    torch.load(path, weights_only=False)  # this test's own file, to show the payload works
    assert marker.exists()


def test_resume_refuses_a_crafted_checkpoint(tmp_path, capsys):
    out, marker = tmp_path / "run", tmp_path / "ran"
    assert main(["run", *SETS, "--set", "train.checkpoint_every=1", "--out", str(out)]) == 0
    crafted(out / "checkpoint.pt", marker)
    before = files(out)
    refused(capsys, ["run", *SETS, "--set", "train.checkpoint_every=1", "--set", "train.iterations=2", "--resume",
                     "--out", str(out)], "checkpoint.pt", "not a readable agg-bench checkpoint")
    assert not marker.exists() and files(out) == before


def test_the_learning_report_refuses_a_crafted_checkpoint(tmp_path):
    """The learning rule's evaluation reads each run's checkpoint.pt: a crafted one is refused, unexecuted."""
    from agg_bench.engine.scenes import all_scenes
    from agg_bench.results.learning_tables import load_runs
    from agg_bench.tools import learning
    from agg_bench.tools.pretrain import load_pretrain_config, pretrain

    model, marker = tmp_path / "model", tmp_path / "ran"
    pretrain(load_pretrain_config(None, ["steps=1", "batch_size=2", "num_layers=1", "sample_steps=1",
                                         "warmup_steps=1"]), model, progress=False)
    prompts = tmp_path / "p.txt"
    prompts.write_text(all_scenes()[0].caption + "\n")
    run = tmp_path / "run"
    assert main(["run", "--set", "model.preset=pretrained", "--set", f"model.pretrained={model}", "--set",
                 "model.resolution=32", "--set", f"prompts.file={prompts}", "--set", "reward.name=scene", "--set",
                 "sampling.steps=2", "--set", "grpo.group_size=2", "--set", "grpo.prompts_per_iteration=1", "--set",
                 "train.iterations=1", "--set", "train.checkpoint_every=1", "--set", "progress=false",
                 "--out", str(run)]) == 0
    crafted(run / "checkpoint.pt", marker)
    manifest = tmp_path / "manifest.json"
    manifest.write_text(json.dumps({"runs": [{"dir": str(run), "method": "full", "seed": 0}]}))
    runs = load_runs(manifest)
    with pytest.raises(UserError, match="not a readable agg-bench checkpoint"):
        learning.evaluate(runs, learning.CheckpointEvaluation(runs, noises=1))
    assert main(["learning", "--manifest", str(manifest), "--tables", str(tmp_path / "t"), "--average", "1",
                          "--eval-noises", "1"]) == 2
    assert not marker.exists()


def test_model_and_reward_loaders_refuse_crafted_pickles(tmp_path, folders):
    """A pretrained model folder whose weights are a crafted .bin, and a reward checkpoint: refused, unexecuted."""
    import shutil

    from agg_bench.engine.models import load_policy
    from agg_bench.engine.reward_models.common import load_state_dict

    marker = tmp_path / "ran"
    model = tmp_path / "model"
    shutil.copytree(folders("sd3"), model)
    for weights in (model / "transformer").glob("*.safetensors"):
        weights.unlink()
    crafted(model / "transformer" / "diffusion_pytorch_model.bin", marker)
    with pytest.raises(UserError):
        load_policy("sd3", "pretrained", str(model))
    with pytest.raises(UserError, match="pickled"):
        load_state_dict("hpsv2", crafted(tmp_path / "reward.pt", marker), "checkpoint")
    assert not marker.exists()


# ----- a sharded checkpoint's folder ----------------------------------------------------------------------
SHARDED = [*SETS, "--set", "grpo.prompts_per_iteration=2", "--set", "train.shard=fsdp", "--checkpoint-every", "1"]
RESUME_SHARDED = ["run", *SHARDED, "--set", "train.iterations=2", "--resume"]


@pytest.fixture(scope="module")
def sharded_run(tmp_path_factory):
    """A run folder whose checkpoint names a shard folder that a one-process FSDP run wrote."""
    out = tmp_path_factory.mktemp("sharded") / "run"
    assert main(["run", *SHARDED, "--out", str(out)]) == 0
    return out


def shard_copy(sharded_run: Path, tmp_path: Path) -> tuple[Path, Path]:
    """A copy of the sharded run folder and its shard folder."""
    import shutil

    out = tmp_path / "run"
    shutil.copytree(sharded_run, out)
    return out, out / "checkpoint_shards_000000"


def pickled(value) -> bytes:
    import pickle  # noqa: TID251 (crafts the files that the reader must refuse)

    return pickle.dumps(value)


def unpickled(data: bytes):
    import pickle  # noqa: TID251 (shows a crafted file is live)

    return pickle.loads(data)  # noqa: S301 (this test's own bytes, to show the payload works)


def crafted_metadata(kind: str, marker: Path, real: bytes) -> bytes:
    """A ``.metadata`` of ``kind``: a payload that touches ``marker`` when unpickled (through os.system, eval,
    subprocess, Path.touch, or inside torch's own Metadata), a harmless class outside torch's checkpoint
    metadata, a pickle of something else, the real file cut short, or no pickle at all."""
    import builtins
    import collections
    import subprocess

    from agg_bench.runtime.checkpoint import read_shard_metadata

    touch = f"touch {marker}"
    if kind == "os.system":
        return pickled(Calls(os.system, touch))
    if kind == "eval":
        return pickled(Calls(builtins.eval, f"__import__('pathlib').Path({str(marker)!r}).touch()"))
    if kind == "subprocess":
        return pickled(Calls(subprocess.call, ["touch", str(marker)]))
    if kind == "Path.touch":
        return pickled(Payload(marker))
    if kind == "inside Metadata":
        path = marker.parent / "real.metadata"
        path.write_bytes(real)
        metadata = read_shard_metadata(path)
        metadata.planner_data = {"payload": Payload(marker)}
        return pickled(metadata)
    if kind == "another class":
        return pickled(collections.OrderedDict(a=1))
    if kind == "a dict":
        return pickled({"state_dict_metadata": {}})
    if kind == "truncated":
        return real[: len(real) // 2]
    return b"not a pickle at all"


PAYLOADS = ["os.system", "eval", "subprocess", "Path.touch", "inside Metadata"]


@pytest.mark.parametrize("kind", PAYLOADS)
def test_the_crafted_metadata_runs_when_unpickled(tmp_path, sharded_run, kind):
    """Each crafted ``.metadata`` is live: plain pickle (what torch's own reader uses) runs its payload."""
    marker = tmp_path / "ran"
    unpickled(crafted_metadata(kind, marker, (sharded_run / "checkpoint_shards_000000/.metadata").read_bytes()))
    assert marker.exists()


def test_the_shard_metadata_reader_takes_what_torch_writes(sharded_run):
    """The restricted reader reads the ``.metadata`` a sharded save wrote as torch's own reader does, and the
    globals that file refers to are all on its list."""
    from torch.distributed.checkpoint import FileSystemReader

    from agg_bench.runtime import checkpoint

    folder = sharded_run / "checkpoint_shards_000000"
    seen = set()

    class Recording(checkpoint.ShardMetadataUnpickler):
        def find_class(self, module, name):
            seen.add((module, name))
            return super().find_class(module, name)

    allowed = checkpoint._metadata_globals()
    with open(folder / ".metadata", "rb") as fh:
        Recording(fh, allowed).load()
    ours = checkpoint.read_shard_metadata(folder / ".metadata")
    theirs = FileSystemReader(folder).read_metadata()  # plain pickle: this test's own file
    assert ours.state_dict_metadata == theirs.state_dict_metadata and ours.storage_data == theirs.storage_data
    assert {("torch.distributed.checkpoint.metadata", "Metadata"), ("torch", "Size")} <= seen <= set(allowed)
    assert not any(module in ("builtins", "os", "posix", "subprocess") for module, _ in allowed)


@pytest.mark.parametrize("kind", [*PAYLOADS, "another class", "a dict", "truncated", "garbage"])
def test_resume_refuses_a_crafted_shard_metadata_unexecuted(tmp_path, capsys, sharded_run, kind):
    """A shard folder's ``.metadata`` crafted to run code, of another class, cut or garbage: one line naming the
    file, exit 2, the payload not run and the folder as it was."""
    out, folder = shard_copy(sharded_run, tmp_path)
    marker = tmp_path / "ran"
    (folder / ".metadata").write_bytes(crafted_metadata(kind, marker, (folder / ".metadata").read_bytes()))
    before = files(out)
    refused(capsys, [*RESUME_SHARDED, "--out", str(out)], str(folder / ".metadata"), "--resume: ",
            "not a sharded checkpoint's metadata")
    assert not marker.exists() and files(out) == before


def built(cls, state: dict):
    """An object of ``cls`` that pickles as one whose fields are ``state``, that very dict (NEWOBJ, then BUILD)."""
    obj = cls.__new__(cls)
    obj.__dict__["__getstate__"] = lambda: state
    return obj


def amplifying(kind: str) -> object:
    """A small pickle that builds far more than its bytes when unpickled with plain pickle: each of many copies of a
    long sequence (or mapping) that the file holds once (pickle memoizes it), made by a call or a build torch's
    classes offer, or sets (one byte each, a 216-byte object)."""
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex

    long = tuple(range(20_000))
    if kind == "torch.Size copies":
        return [Calls(torch.Size, long) for _ in range(50)]
    if kind == "MetadataIndex copies":
        return [Calls(MetadataIndex, "fqn", long) for _ in range(50)]
    if kind == "fields copied":
        fields = {f"field{i}": i for i in range(20_000)}
        return [built(ChunkStorageMetadata, fields) for _ in range(50)]
    if kind == "path parts":
        return [Calls(PosixPath, *(["part"] * 20_000)) for _ in range(50)]
    return [set() for _ in range(20_000)]


@pytest.mark.parametrize("kind", ["torch.Size copies", "MetadataIndex copies", "fields copied", "path parts", "sets"])
def test_a_small_shard_metadata_that_would_build_much_more_is_refused(tmp_path, sharded_run, kind):
    """A ``.metadata`` inside torch's own Metadata whose few bytes would copy what it holds once many times over
    (plain pickle reads it: it is live) is refused in one line, so memory stays a small multiple of the file's
    bytes, which are bounded."""
    from agg_bench.runtime.checkpoint import read_shard_metadata

    metadata = read_shard_metadata(sharded_run / "checkpoint_shards_000000/.metadata")
    metadata.planner_data = {"copies": amplifying(kind)}
    path = tmp_path / ".metadata"
    path.write_bytes(pickled(metadata))
    assert type(unpickled(path.read_bytes())).__name__ == "Metadata"
    with pytest.raises(UserError, match="refused unread") as err:
        read_shard_metadata(path)
    assert str(path) in str(err.value) and len(str(err.value).splitlines()) == 1


def test_a_shard_metadata_over_the_bound_is_refused_before_it_is_read(tmp_path, capsys, sharded_run, monkeypatch):
    """A ``.metadata`` larger than :data:`MAX_SHARD_METADATA_BYTES` (sparse: nothing written) is refused in one line
    naming the file, its size and the bound, before a byte of it is read."""
    from agg_bench.runtime import checkpoint

    out, folder = shard_copy(sharded_run, tmp_path)
    metadata = folder / ".metadata"
    os.truncate(metadata, checkpoint.MAX_SHARD_METADATA_BYTES + 1)
    monkeypatch.setattr(checkpoint.ShardMetadataUnpickler, "load", lambda self: pytest.fail("the file was read"))
    line = refused(capsys, [*RESUME_SHARDED, "--out", str(out)], str(metadata), "--resume: ",
                   f"{checkpoint.MAX_SHARD_METADATA_BYTES + 1:,} bytes", "64 MiB", "refused unread")
    assert metadata.stat().st_size == checkpoint.MAX_SHARD_METADATA_BYTES + 1, line


def synthetic_metadata(shapes: dict[str, tuple[int, ...]], processes: int):
    """The ``torch.distributed.checkpoint`` metadata of a sharded save of a model whose trainable parameters have
    ``shapes`` and their AdamW state, over ``processes`` processes as FSDP2 shards them (dimension 0 split evenly,
    a scalar whole), built from torch's own classes as its planner fills them."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, Metadata, MetadataIndex, StorageMeta,
                                                       TensorProperties, TensorStorageMetadata)

    entries, storage, planner = {}, {}, {}
    for name, shape in shapes.items():
        for fqn, path, dims in [(f"model.{name}", ("model", name), shape),
                                (f"optimizer.state.{name}.step", ("optimizer", "state", name, "step"), ()),
                                *[(f"optimizer.state.{name}.{key}", ("optimizer", "state", name, key), shape)
                                  for key in ("exp_avg", "exp_avg_sq")]]:
            per = -(-dims[0] // processes) if dims else 0
            chunks = [ChunkStorageMetadata(torch.Size([start, *[0] * (len(dims) - 1)]),
                                           torch.Size([min(per, dims[0] - start), *dims[1:]]))
                      for start in range(0, dims[0], per)] if dims else [ChunkStorageMetadata(torch.Size(), torch.Size())]
            entries[fqn] = TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size(dims), chunks)
            planner[fqn] = path
            for rank, chunk in enumerate(chunks):
                storage[MetadataIndex(fqn, chunk.offsets, 0)] = _StorageInfo(f"__{rank}_0.distcp", 2**40, 2**33)
    return Metadata(entries, planner, storage, StorageMeta(Path("/results/runs/a-run/checkpoint_shards_000000"),
                                                           "0" * 36))


def test_the_largest_planned_sharded_checkpoint_s_metadata_is_far_below_the_bound(tmp_path, sharded_run):
    """A full fine-tune of Qwen-Image (the largest model planned, every parameter trained: the most entries) sharded
    over 8 processes writes a ``.metadata`` at most an eighth of the bound, and the reader takes it whole. Its
    metadata is built as torch's planner builds it; built so for the shard folder a real run wrote, it is as large as
    the real one give or take a quarter."""
    from diffusers import QwenImageTransformer2DModel

    from agg_bench.runtime.checkpoint import MAX_SHARD_METADATA_BYTES, read_shard_metadata

    real_path = sharded_run / "checkpoint_shards_000000/.metadata"
    real = read_shard_metadata(real_path)
    trained = {fqn.removeprefix("model."): tuple(entry.size) for fqn, entry in real.state_dict_metadata.items()
               if fqn.startswith("model.")}
    assert 0.75 <= len(pickled(synthetic_metadata(trained, 1))) / real_path.stat().st_size <= 1.25
    with torch.device("meta"):
        model = QwenImageTransformer2DModel()  # Qwen-Image's own configuration: 20.4 B parameters
    shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
    path = tmp_path / ".metadata"
    path.write_bytes(pickled(synthetic_metadata(shapes, 8)))
    assert path.stat().st_size <= MAX_SHARD_METADATA_BYTES / 8
    assert len(read_shard_metadata(path).state_dict_metadata) == 4 * len(shapes)


def test_resume_reads_a_shard_folder_s_other_entries_as_plain_data(tmp_path, capsys, sharded_run):
    """torch's default load planner unpickles a shard folder's entries that are not tensors (the optimizer's
    settings) whole: one crafted to run code is refused in one line naming the folder and the entry, unexecuted."""
    import dataclasses
    import io

    from agg_bench.runtime.checkpoint import read_shard_metadata

    out, folder = shard_copy(sharded_run, tmp_path)
    marker = tmp_path / "ran"
    metadata = read_shard_metadata(folder / ".metadata")
    index = next(i for i in metadata.storage_data if i.fqn == "optimizer.param_groups.0.lr")
    info = metadata.storage_data[index]
    payload = io.BytesIO()
    torch.save(Payload(marker), payload)
    shards = folder / info.relative_path
    offset = shards.stat().st_size
    with open(shards, "ab") as fh:
        fh.write(payload.getvalue())
    metadata.storage_data[index] = dataclasses.replace(info, offset=offset, length=len(payload.getvalue()))
    (folder / ".metadata").write_bytes(pickled(metadata))
    before = files(out)
    refused(capsys, [*RESUME_SHARDED, "--out", str(out)], str(folder), "'optimizer.param_groups.0.lr'",
            "not plain data")
    assert not marker.exists() and files(out) == before
    torch.load(io.BytesIO(payload.getvalue()), weights_only=False)  # the entry is live
    assert marker.exists()


def test_resume_reads_a_shard_metadata_once(tmp_path, monkeypatch, sharded_run):
    """The ``.metadata`` every process reads and checks before any loads is the one the load uses: the file is
    unpickled once per resume (a large model's is megabytes through Python's own unpickler)."""
    from agg_bench.runtime import checkpoint

    out, _ = shard_copy(sharded_run, tmp_path)
    reads = []

    def counted(path, *args, **kwargs):
        reads.append(Path(path).name)
        return read(path, *args, **kwargs)

    read = checkpoint.read_shard_metadata
    monkeypatch.setattr(checkpoint, "read_shard_metadata", counted)
    assert main([*RESUME_SHARDED, "--out", str(out)]) == 0
    assert reads == [".metadata"]


# ----- one writer per output -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def snapshot_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("snap") / "snapshot"
    assert main(["snapshot", *SETS, "--out", str(out)]) == 0
    return out


def verb_cases(tmp: Path, snapshot: Path) -> dict[str, tuple[list[str], Path, bool, bool]]:
    """{verb: (argv, its output, a folder?, lock inside it?)}, each argv valid up to its claim."""
    log = dance_log(tmp / "log.jsonl")
    imported = tmp / "imported"
    assert main(["import-log", str(log), "--out", str(imported)]) == 0
    out = tmp / "out"
    return {
        "run": (["run", *SETS, "--out", str(out)], out, True, True),
        "import-log": (["import-log", str(log), "--out", str(out)], out, True, False),  # replaced whole
        "snapshot": (["snapshot", *SETS, "--out", str(out)], out, True, True),
        "profile": (["profile", "--method", "full", *SETS, "--out", str(out)], out, True, False),  # replaced whole
        "report": (["report", "--runs", str(imported), "--tables", str(out)], out, True, False),  # replaced whole
        "pretrain": (["pretrain", "--set", "steps=1", "--out", str(out)], out, True, False),
        "calibrate": (["calibrate", *SETS, "--out", str(tmp / "c.json")], tmp / "c.json", False, False),
        "gradcheck": (["gradcheck", *SETS, "--out", str(tmp / "g.csv")], tmp / "g.csv", False, False),
        "replay": (["replay", str(snapshot), "--method", "full", "--out", str(tmp / "r.safetensors")],
                   tmp / "r.safetensors", False, False),
        "embed": (["embed", *SETS, "--out", str(tmp / "e.safetensors")], tmp / "e.safetensors", False, False),
    }


VERBS = ["run", "import-log", "snapshot", "profile", "report", "pretrain", "calibrate", "gradcheck", "replay", "embed"]


@pytest.mark.parametrize("verb", VERBS)
def test_a_second_writer_is_refused_and_named(tmp_path, capsys, snapshot_dir, verb):
    """While another process holds an output, every writing command is refused at once with exit 2 and the
    holder's PID, and writes nothing; once the holder is gone (even killed) the command runs."""
    argv, target, folder, inside = verb_cases(tmp_path, snapshot_dir)[verb]
    holder = Holder(target, folder, inside)
    try:
        before = files(tmp_path)
        refused(capsys, argv, str(target), f"another agg-bench process (PID {holder.proc.pid})")
        assert files(tmp_path) == before
    finally:
        holder.kill()  # the kernel drops a killed holder's lock; its stale lock file does not block
    if verb in ("run", "import-log", "report", "replay"):
        assert main(argv) == 0 and not leftovers(tmp_path / "out" if folder else tmp_path)


def test_two_runs_on_one_folder(tmp_path, capsys):
    """Two `agg-bench run`s on one --out, the first a process of its own: the second (this process) is refused
    while the first trains, and the first's records are all there."""
    out = tmp_path / "run"
    sets = [a for item in SMALL if not item.startswith("train.iterations") for a in ("--set", item)]
    first = subprocess.Popen([sys.executable, "-m", "agg_bench", "run", *sets, "--set", "train.iterations=400",
                              "--out", str(out)], stderr=subprocess.PIPE, text=True,
                             env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        for line in first.stderr:  # the first iteration is logged once the folder is claimed
            if "iteration 1/" in line:
                break
        refused(capsys, ["run", *sets, "--out", str(out)], f"PID {first.pid}")
    finally:
        first.terminate()
        first.wait(timeout=120)
    config = json.loads((out / "config.json").read_text())
    assert config["train"]["iterations"] == 400  # the first run's config, not the second's
    summary = json.loads((out / "summary.json").read_text())
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert summary["status"] == "interrupted" and len(records) == summary["last_good_iteration"] + 1


def test_the_lock_is_gone_after_a_run_and_a_failed_new_folder_is_removed(tmp_path, capsys):
    out = tmp_path / "new" / "run"
    assert main(["run", *SETS, "--out", str(out)]) == 0
    assert not leftovers(out)
    # a bad input found after the claim (a missing prompts file): the folders it made are gone again
    bad = tmp_path / "bad" / "deeper"
    refused(capsys, ["run", *SETS, "--set", f"prompts.file={tmp_path}/none.txt", "--out", str(bad)], "prompts.file")
    assert not (tmp_path / "bad").exists()


# ----- someone else's files ------------------------------------------------------------------------------------
def test_import_log_never_replaces_a_run_or_a_user_s_files(tmp_path, capsys):
    log = dance_log(tmp_path / "log.jsonl")
    run = tmp_path / "run"
    assert main(["run", *SETS, "--out", str(run)]) == 0
    before = files(run)
    refused(capsys, ["import-log", str(log), "--out", str(run)], str(run), "not an imported log", "config.json")
    assert files(run) == before
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "notes.txt").write_text("mine\n")
    refused(capsys, ["import-log", str(log), "--out", str(notes)], "notes.txt")
    assert files(notes) == {"notes.txt": b"mine\n"}
    # a summary.json that is not an import's, among an import's names only
    (run / "config.json").unlink()
    (run / "plan.json").unlink(missing_ok=True)
    (run / "checkpoint.pt").unlink(missing_ok=True)
    before = files(run)
    refused(capsys, ["import-log", str(log), "--out", str(run)], "not an imported log's")
    assert files(run) == before
    # an earlier import is replaced whole
    imported = tmp_path / "imported"
    assert main(["import-log", str(log), "--out", str(imported)]) == 0
    assert main(["import-log", str(dance_log(tmp_path / "short.jsonl", 2)), "--out", str(imported)]) == 0
    assert len((imported / "metrics.jsonl").read_text().splitlines()) == 2 and not leftovers(imported)


@pytest.mark.parametrize("args, words", [
    (["--resolution", "-512"], ["--resolution", "-512"]),
    (["--resolution", "100000"], ["--resolution"]),
    (["--n-gpus", "0"], ["--n-gpus", "0"]),
    (["--model", ""], ["--model"]),
    (["--method", "x" * 1000], ["--method", "200"]),
])
def test_import_log_labels_are_bounded(tmp_path, capsys, args, words):
    line = refused(capsys, ["import-log", str(dance_log(tmp_path / "l.jsonl")), *args, "--out", str(tmp_path / "o")],
                   *words)
    assert len(line) < 400 and not (tmp_path / "o").exists()


@pytest.mark.parametrize("steps, words", [([0, 1, -2], ["-2", ">= 0"]), ([0, 1, 1], ["'step' = 1", "increasing"]),
                                          ([3, 2], ["increasing"])])
def test_import_log_steps_increase(tmp_path, capsys, steps, words):
    log = tmp_path / "l.jsonl"
    log.write_text("".join(json.dumps({"step": s, "avg_reward": 0.5, "step_time": 1.0, "grad_norm": 1.0}) + "\n"
                           for s in steps))
    refused(capsys, ["import-log", str(log), "--out", str(tmp_path / "o")], *words)
    assert not (tmp_path / "o").exists()


def test_import_log_refuses_a_huge_file_unread(tmp_path, capsys, monkeypatch):
    from agg_bench.tools import importlog

    log = tmp_path / "huge.jsonl"
    with open(log, "wb") as fh:  # sparse: no disk used
        fh.truncate(importlog.MAX_LOG_BYTES + 1)
    monkeypatch.setattr(Path, "read_bytes", lambda path: pytest.fail("a refused log is not read"))
    refused(capsys, ["import-log", str(log), "--out", str(tmp_path / "o")], "MiB")


def test_replay_and_calibrate_keep_a_user_s_files(tmp_path, capsys, snapshot_dir):
    mine = tmp_path / "mine.json"
    mine.write_text('{"my": "notes"}\n')
    refused(capsys, ["replay", str(snapshot_dir), "--method", "full", "--out", str(tmp_path / "mine.safetensors")],
            "mine.json", "not a replay's pass counts")
    assert files(tmp_path) == {"mine.json": b'{"my": "notes"}\n'}
    # a replay writes both files, and may replace its own
    out = tmp_path / "r.safetensors"
    assert main(["replay", str(snapshot_dir), "--method", "full", "--out", str(out)]) == 0
    assert main(["replay", str(snapshot_dir), "--method", "full", "--out", str(out)]) == 0
    # calibrate: a folder given as its file, and someone's JSON
    folder = tmp_path / "folder.json"  # named as its file must be
    folder.mkdir()
    refused(capsys, ["calibrate", *SETS, "--out", str(folder)], str(folder), "is a folder")
    refused(capsys, ["calibrate", *SETS, "--out", str(mine)], "not a calibration")
    assert not leftovers(tmp_path) and mine.read_text() == '{"my": "notes"}\n' and not any(folder.iterdir())


def test_report_and_learning_tables_keep_a_user_s_files(tmp_path, capsys):
    imported = tmp_path / "imported"
    assert main(["import-log", str(dance_log(tmp_path / "log.jsonl", 12)), "--out", str(imported)]) == 0
    tables = tmp_path / "tables"
    tables.mkdir()
    (tables / "thesis.tex").write_text("mine")
    refused(capsys, ["report", "--runs", str(imported), "--tables", str(tables)], "--tables", "thesis.tex")
    refused(capsys, ["report", "--runs", str(imported), "--plots", str(tables)], "--plots", "thesis.tex")
    assert files(tables) == {"thesis.tex": b"mine"}
    manifest = tmp_path / "manifest.json"
    manifest.write_text(json.dumps({"runs": [{"dir": str(imported), "method": "full", "seed": 0}]}))
    capsys.readouterr()
    assert main(["learning", "--manifest", str(manifest), "--tables", str(tables), "--average", "1"]) == 2
    assert "thesis.tex" in capsys.readouterr().err and files(tables) == {"thesis.tex": b"mine"}
    # the report's own folder, tables and plots together: written, and written again
    both = tmp_path / "both"
    for _ in range(2):
        assert main(["report", "--runs", str(imported), "--tables", str(both), "--plots", str(both)]) == 0
    assert not leftovers(both)


# ----- symbolic links --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["metrics.jsonl", ".write_test", "summary.json"])
def test_no_write_follows_a_link_out_of_a_run_folder(tmp_path, capsys, name):
    out, target = tmp_path / "run", tmp_path / "precious.txt"
    assert main(["run", *SETS, "--out", str(out)]) == 0
    target.write_text("precious\n")
    (out / name).unlink(missing_ok=True)
    (out / name).symlink_to(target)
    for extra in ([], ["--overwrite"], ["--resume"]):
        refused(capsys, ["run", *SETS, *extra, "--out", str(out)], "symbolic link" if name != ".write_test" else name)
    assert target.read_text() == "precious\n"


def test_no_write_follows_a_link_in_any_output(tmp_path, capsys):
    target = tmp_path / "precious"
    target.mkdir()
    (target / "file").write_text("precious\n")
    log = dance_log(tmp_path / "log.jsonl")
    imported = tmp_path / "imported"
    imported.mkdir()
    (imported / "metrics.jsonl").symlink_to(target / "file")
    refused(capsys, ["import-log", str(log), "--out", str(imported)], "symbolic link")
    snap = tmp_path / "snap"
    snap.mkdir()
    (snap / "transformer").symlink_to(target)  # a link to a folder: save_pretrained would write into it
    refused(capsys, ["snapshot", *SETS, "--out", str(snap)], "symbolic link")
    plots = tmp_path / "plots"
    plots.mkdir()
    (plots / "reward_iteration.png").symlink_to(target / "file")
    reference = tmp_path / "reference"
    assert main(["import-log", str(log), "--out", str(reference)]) == 0
    refused(capsys, ["report", "--runs", str(reference), "--plots", str(plots)], "symbolic link")
    link = tmp_path / "c.json"
    link.symlink_to(target / "file")
    refused(capsys, ["calibrate", *SETS, "--out", str(link)], "symbolic link")
    linked_out = tmp_path / "linked"
    linked_out.symlink_to(target)
    refused(capsys, ["pretrain", "--set", "steps=1", "--out", str(linked_out)], "symbolic link")
    assert files(target) == {"file": b"precious\n"}


# ----- a full disk -----------------------------------------------------------------------------------------------
def _enospc(*args, **kwargs):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def test_a_full_disk_mid_checkpoint_ends_the_run_as_an_error(tmp_path, capsys, monkeypatch):
    """The disk fills while the checkpoint is written: the half-written temporary is removed, summary.json
    says error, and the command ends with one line and exit 2."""
    from agg_bench.runtime import checkpoint

    real_save = torch.save

    def save_then_fill(obj, fh, *args, **kwargs):
        real_save({"partial": torch.zeros(1000)}, fh)  # bytes on disk, then no more room
        _enospc()

    monkeypatch.setattr(checkpoint.torch, "save", save_then_fill)
    out = tmp_path / "run"
    refused(capsys, ["run", *SETS, "--set", "train.checkpoint_every=1", "--out", str(out)],
            "no space left on device")
    summary = json.loads((out / "summary.json").read_text())
    # the error names the file that was being written (agg_bench.io.atomic_target)
    assert summary["status"] == "error" and "no space left on device" in summary["error"]
    assert "checkpoint.pt" in summary["error"]
    assert not leftovers(out) and not (out / "checkpoint.pt").exists()


def test_a_full_disk_everywhere_leaves_no_temporaries(tmp_path, capsys, monkeypatch):
    """Once the first record is written every later write fails: no summary can be written, and nothing
    half-written is left; the records written before stay whole."""
    from agg_bench import io

    out = tmp_path / "run"
    real_fsync = os.fsync
    writes = {"n": 0}

    def fsync(fd):
        writes["n"] += 1
        if writes["n"] > 4:  # config.json, env.json, metrics.jsonl, plan.json: then the disk is full
            _enospc()
        real_fsync(fd)

    monkeypatch.setattr(io.os, "fsync", fsync)
    refused(capsys, ["run", *SETS, "--set", "train.iterations=2", "--set", "train.checkpoint_every=1",
                     "--out", str(out)], "no space left on device")
    assert not leftovers(out)
    assert {p.name for p in out.iterdir()} <= {"config.json", "env.json", "metrics.jsonl", "plan.json"}
