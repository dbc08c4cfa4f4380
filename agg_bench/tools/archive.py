"""A campaign's archives and its reference folder: what a window packs, and what ``campaign unpack`` lets in.

An archive is a ``tar.gz`` of plain files at these paths, and nothing else:

- ``runs/<run id>/<file>``: a finished run of the campaign's sweep, ``file`` one of :data:`RUN_FILES` (no
  checkpoint, no TensorBoard events);
- ``calibration/<stamp>_<n>_<cell>.json``: an ``agg-bench calibrate`` output for a cell of the sweep;
- ``windows/<stamp>.json``: a window's log;
- ``pretrained/<label>/<file>``: a model folder ``agg-bench pretrain`` wrote for the sweep's ``pretrain``
  label (the learning sweep's scene model, which every later window and every reading of the runs needs),
  ``file`` one of :data:`MODEL_FILES`: JSON files, the transformer's weights in the safetensors format (a
  header of tensor shapes and offsets, then raw numbers: data only) and the sample grid's PNG.

:func:`unpack` reads the archive as data (never ``extractall``) and refuses it whole, with one line and exit
code 2 and the reference untouched, unless it is one whole gzip stream (inflated within the bounds before the
tar is read: :func:`gunzip_bounded`) of a tar as the tar module writes one (each member's data padded with zeros,
nothing but zero blocks after the last: the tar reader stops at a block that is no header without a word, and
would leave what follows unread), every member is a plain file at one of these paths within the size
bounds, every JSON file parses as agg-bench writes JSON (:func:`agg_bench.jsonfiles.loads`: a JSON object, or
JSON lines of objects), every run is finished, of this sweep (the config it composes for that run id), with
files :class:`~agg_bench.reading.RunFolder` accepts and records and a summary naming that run on one device
(:func:`agg_bench.results.loading.run_identity`), every calibration is what ``agg-bench calibrate`` writes for the cell it is named
after, every window log is one (its keys, and its values and the entries of its lists as a window writes them),
every run and calibration of the archive and the reference names one GPU, the
one ``campaign.gpu`` names (:func:`check_hardware`), every safetensors file's header describes exactly the
bytes after it and every PNG starts as a PNG does, and every new run's passes per sample in its first
iteration equal what the same schedule counts on the tiny model on the CPU (:func:`check_counts`, which runs
that counterpart: counts depend on neither the device, the size, the precision nor the weights; the counterparts
of one model configuration start from one built model, as a cell job's runs do). A file or
run the reference holds already is skipped when its bytes are the same and refused when they differ, and two paths,
of the archive or one of it and one of the reference, that differ only in case are refused (the reference is
committed, and checked out where case is not told apart too: :func:`case_clash`). The new
files are written beside the reference under a harness temporary name and renamed into place; if the tables
cannot be written, they are moved back out and the folders made for them removed. The staging folder stays
in the reference until the runs, the manifest and the tables are all in place: an unpack killed half-way leaves
it, readers of the reference's manifest refuse it meanwhile (:func:`agg_bench.outputs.check_no_unpack`), and the
same unpack again finishes the job (what the reference holds with the same bytes is skipped). A later unpack
removes a killed one's staging folder only once its own runs, manifest and tables are in place: one refused or
failed before that leaves it, and with it the readers' refusal.

A ``manifest.json`` of the reference that is not one unpack writes (:func:`check_manifest`: edited by hand), and a
run folder there of no run of the sweep or a calibration there named after no cell of it
(:func:`check_files_of_the_sweep`), are refused under the reference's claim before anything changes: unpack would
replace the one and leave the others out of the manifest unseen.

Then the reference's ``manifest.json`` (every run there that a window counts done, and every calibration, with
the sweep's labels and ``source: reference``) and its tables: the efficiency report (``tables/``: ``agg-bench report --manifest
REF/manifest.json --tables REF/tables`` regenerates it byte for byte) or, for a sweep with a ``learning``
section once every run is in, the learning report (``learning/``: ``agg-bench learning`` on the manifest,
from the runs' in-run evaluations: a reference holds no checkpoints to evaluate).
"""
from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shutil
import signal
import struct
import sys
import tarfile
import tempfile
import time
import zlib
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterable, Iterator

from tqdm import tqdm

from ..errors import UserError, first_message_line, quote, shown
from ..io import atomic_path, atomic_target, jsonl_records, remove_stale_temps, write_json
from ..jsonfiles import JsonProblem, TooLarge, loads, read_bounded
from ..outdir import Contents, claim_folder, claimed_folders, is_harness_name, path_problem, shown_names
from ..outputs import LEARNING_CONTENTS
from ..outputs import REPORT_CONTENTS, TABLES_CONTENTS, UNPACK_STAGING
from ..reading import RunFolder, identity_mismatch
from ..records import REQUIRED_RECORD_KEYS, is_finite_number, is_integer, is_label, records_problem

if TYPE_CHECKING:
    from .campaign import Campaign

# the files of a finished run that travel (no checkpoint, no TensorBoard events)
RUN_FILES = ("config.json", "env.json", "plan.json", "metrics.jsonl", "summary.json", "evaluations.jsonl")
REQUIRED_RUN_FILES = ("config.json", "env.json", "metrics.jsonl", "summary.json")
# the files of a pretrain output folder that travel, by their path inside it
MODEL_FILES = ("transformer/config.json", "transformer/diffusion_pytorch_model.safetensors", "vae/config.json",
               "scheduler/scheduler_config.json", "token_hash.json", "pretrain.json", "samples.png")
NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,199}$")  # a run id, a label, a calibration's or window's file
MAX_ARCHIVE_BYTES = 64 * 2**20
MAX_MEMBER_BYTES = 16 * 2**20
MAX_TOTAL_BYTES = 256 * 2**20
MAX_MEMBERS = 20_000
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
SAFETENSORS_DTYPES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
                      "BOOL": 1}
LAYOUT = (f"runs/<run id>/{{{','.join(RUN_FILES)}}}, calibration/<stamp>_<n>_<cell>.json, windows/<stamp>.json, "
          "pretrained/<label>/<a pretrain output's file>")


def _json_files(what: str) -> Contents:
    return Contents(what, patterns=("*.json",))


_MODEL_CONTENTS = Contents("a pretrain output", ("token_hash.json", "pretrain.json", "samples.png"), folders=(
    ("transformer", Contents("a saved model", ("config.json", "diffusion_pytorch_model.safetensors"))),
    ("vae", Contents("a pixel decoder", ("config.json",))),
    ("scheduler", Contents("a scheduler", ("scheduler_config.json",)))))
REFERENCE_CONTENTS = Contents("agg-bench reference results", ("manifest.json",), folders=(
    ("runs", Contents("reference runs", folders=(("*", Contents("a reference run", RUN_FILES)),))),
    ("calibration", _json_files("calibrations")), ("windows", _json_files("window logs")),
    ("pretrained", Contents("pretrained models", folders=(("*", _MODEL_CONTENTS),))),
    ("tables", TABLES_CONTENTS), ("learning", LEARNING_CONTENTS)))


def is_archive(path: Path) -> bool:
    return tarfile.is_tarfile(path)


def pack(members: list[tuple[str, Path]], archive: Path) -> None:
    """``members`` (archive path, file) into the tar.gz ``archive``, written whole or not at all."""
    with atomic_target(archive) as tmp, tarfile.open(tmp, "w:gz") as tar:
        for arcname, path in members:
            tar.add(path, arcname=arcname, recursive=False)


def model_members(label: str, folder: Path) -> list[tuple[str, Path]]:
    """The archive members of the pretrain output ``folder`` of sweep label ``label``."""
    return [(f"pretrained/{label}/{name}", folder / name) for name in MODEL_FILES if (folder / name).is_file()]


# ----- reading an archive --------------------------------------------------------------------------------------
GZIP_MAGIC = b"\x1f\x8b"
# the tar stream an archive may unpack to: its files' bytes, and a header and padding of at most 1 KiB per member
MAX_TAR_BYTES = MAX_TOTAL_BYTES + 1024 * (MAX_MEMBERS + 2)


def gunzip_bounded(where: str, data: bytes) -> bytes:
    """The one gzip stream of ``data``, decompressed to at most :data:`MAX_TAR_BYTES` (a larger one is refused
    before more is inflated: a small archive cannot take the memory of a big one), whole (its trailer's CRC and
    length checked) and with nothing after it."""
    if not data.startswith(GZIP_MAGIC):
        raise UserError(f"{where}: not a gzip-compressed tar (a campaign archive is a .tar.gz)")
    inflate = zlib.decompressobj(16 + zlib.MAX_WBITS)
    chunks, size, view = [], 0, memoryview(data)
    try:
        for offset in range(0, len(data), 2**20):
            piece = inflate.decompress(view[offset:offset + 2**20], MAX_TAR_BYTES + 1 - size)
            size += len(piece)
            chunks.append(piece)
            if size > MAX_TAR_BYTES or inflate.unconsumed_tail:
                raise UserError(f"{where}: unpacks to more than {MAX_TAR_BYTES:,} bytes")
            if inflate.eof:
                break
    except zlib.error as err:
        raise UserError(f"{where}: not a readable gzip stream ({err})") from None
    if not inflate.eof:
        raise UserError(f"{where}: its gzip stream is truncated (no end, or no checksum)")
    if inflate.unused_data or offset + 2**20 < len(data):
        raise UserError(f"{where}: holds bytes after its gzip stream")
    return b"".join(chunks)


def read_archive(path: Path) -> dict[str, bytes]:
    """{member path: bytes} of a campaign archive, every member checked before any is read: plain files of
    the layout, bounded sizes. The tar stream is inflated first, bounded (:func:`gunzip_bounded`), so what
    the tar reader holds in memory (a long name's header included) is bounded by it."""
    where = f"archive {shown(path)}"
    if not path.is_file() or path.is_symlink():
        raise UserError(f"{where}: not a file")
    try:
        raw = gunzip_bounded(where, read_bounded(path, MAX_ARCHIVE_BYTES))
        tar = tarfile.open(fileobj=io.BytesIO(raw), mode="r:")
    except TooLarge as err:
        size = "more bytes" if err.size is None else f"{err.size:,} bytes"
        raise UserError(f"{where}: {size}; expected at most {MAX_ARCHIVE_BYTES:,}") from None
    except (tarfile.TarError, OSError, EOFError) as err:
        raise UserError(f"{where}: not a readable tar archive ({err})") from None
    files: dict[str, bytes] = {}
    total = 0
    with tar:
        try:
            for count, member in enumerate(tar, 1):
                if count > MAX_MEMBERS:
                    raise UserError(f"{where}: more than {MAX_MEMBERS:,} members")
                name, named = member.name, quote(member.name)
                if member.isdir():
                    _check_path(where, name, directory=True)
                    continue
                if not member.isreg() or member.issparse():  # a sparse member's holes are no bytes of the archive
                    raise UserError(f"{where}: {named} is not a plain file (links, devices, sparse files and the "
                                    "like are refused)")
                _check_path(where, name)
                if name in files:
                    raise UserError(f"{where}: {named} is in the archive twice")
                if member.size > MAX_MEMBER_BYTES:
                    raise UserError(f"{where}: {named} holds {member.size:,} bytes; expected at most "
                                    f"{MAX_MEMBER_BYTES:,}")
                total += member.size
                if total > MAX_TOTAL_BYTES:
                    raise UserError(f"{where}: its files hold more than {MAX_TOTAL_BYTES:,} bytes")
                handle = tar.extractfile(member)
                data = handle.read(MAX_MEMBER_BYTES + 1) if handle is not None else b""
                if len(data) != member.size:
                    raise UserError(f"{where}: {named} is truncated")
                # a header whose size is smaller than the bytes that follow it leaves them in the padding
                padding = raw[member.offset_data + member.size:member.offset_data - (-member.size // 512) * 512]
                if padding.count(0) != len(padding):
                    raise UserError(f"{where}: {named} is followed by {len(padding) - padding.count(0):,} bytes "
                                    "its header does not count (its size field is smaller than its data)")
                files[name] = data
        except (tarfile.TarError, OSError, EOFError) as err:
            raise UserError(f"{where}: not a readable tar archive ({err})") from None
        # the tar reader stops at the first block that is no header and says nothing: what follows would be left
        # out unread (a second tar appended, members after a damaged header); a tar ends in zero blocks only
        rest = raw[tar.offset:]
        if rest.count(0) != len(rest):
            raise UserError(f"{where}: holds {len(rest) - rest.count(0):,} bytes that are no member after byte "
                            f"{tar.offset:,} of its tar stream (a tar ends with zero blocks only)")
    if not files:
        raise UserError(f"{where}: holds no files")
    clash = case_clash(files, ())
    if clash is not None:
        raise UserError(f"{where}: {quote(clash[0])} and {quote(clash[1])} differ only in case; {CASE_WHY}")
    return files


CASE_WHY = ("a reference is committed and checked out on file systems that do not tell case apart, where the two "
            "are one file")


def case_clash(names: Iterable[str], held: Iterable[str]) -> tuple[str, str] | None:
    """Two paths of ``names`` (member paths), or one of them and one of ``held`` (paths a reference holds), that
    differ only in case, themselves or a folder on the way to them (``runs/A/x`` and ``runs/a/y``); None when none
    do. A new path and a held one of the same spelling are the same file, not a clash."""
    kept = set(held)
    seen: dict[str, str] = {path.lower(): path for path in sorted(kept)}
    for name in names:
        parts = name.split("/")
        for depth in range(1, len(parts) + 1):
            path = "/".join(parts[:depth])
            if path in kept:
                continue
            other = seen.setdefault(path.lower(), path)
            if other != path:
                return path, other
    return None


def _check_path(where: str, name: str, directory: bool = False) -> None:
    """``name`` is a path of the layout (module docstring), or with ``directory`` a folder on the way to one."""
    parts = name.split("/")
    ok = bool(parts) and not name.startswith("/") and all(NAME.match(p) for p in parts)
    if ok and directory:  # a folder on the way to a file of the layout
        ok = (parts[0] in ("calibration", "windows") and len(parts) == 1) or \
            (parts[0] == "runs" and len(parts) <= 2) or \
            (parts[0] == "pretrained" and (len(parts) <= 2 or (len(parts) == 3 and any(
                f.startswith(parts[2] + "/") for f in MODEL_FILES))))
    elif ok:
        ok = (parts[0] == "runs" and len(parts) == 3 and parts[2] in RUN_FILES) or \
            (parts[0] in ("calibration", "windows") and len(parts) == 2 and parts[1].endswith(".json")) or \
            (parts[0] == "pretrained" and len(parts) >= 3 and "/".join(parts[2:]) in MODEL_FILES)
    if not ok:
        raise UserError(f"{where}: {quote(name)} is not a path of a campaign archive ({LAYOUT})")


def json_object(where: str, data: bytes) -> dict:
    try:
        value = loads(data)
    except JsonProblem as err:
        raise UserError(f"{where}: not JSON ({err})") from None
    if not isinstance(value, dict):
        raise UserError(f"{where}: expected a JSON object")
    return value


def json_lines(where: str, data: bytes) -> list[dict]:
    """The records of the JSON lines file ``data`` (``where`` names it) as every reader of a run folder reads
    them (:func:`~agg_bench.io.jsonl_records`), but a torn last line refused: a finished run's file holds none."""
    return list(jsonl_records(io.BytesIO(data), where, torn=False))


def check_records(where: str, data: bytes) -> list[dict]:
    """The records of a finished run's ``metrics.jsonl`` (``data``; ``where`` names the file) as unpack takes
    them: every line whole (:func:`json_lines`: a torn last line, which readers of a run folder skip, is no
    finished run's), by the record contract (:func:`~agg_bench.records.records_problem`: iteration and status in
    each, each iteration once, in increasing order), at least one, the first of iteration 0. A window and
    ``campaign status`` count a run finished only with such records (:meth:`~agg_bench.tools.campaign.Campaign.
    finished`): a run they counted done that unpack then refused was never run again."""
    records = json_lines(where, data)
    problem = records_problem(records, REQUIRED_RECORD_KEYS)
    if problem is not None:
        raise UserError(f"{where}: {problem}")
    if not records:
        raise UserError(f"{where} holds no records")
    if records[0].get("iteration") != 0:
        raise UserError(f"{where} starts at iteration {quote(records[0].get('iteration'))}; expected 0")
    return records


def read_run(where: str, folder: Path) -> tuple[list[dict], dict, dict, dict]:
    """The records, summary, env and config (as JSON) of the run files in ``folder``, read as unpack takes a
    finished run's: ``metrics.jsonl`` by :func:`check_records`, every other JSON lines file's lines whole
    (:class:`~agg_bench.reading.RunFolder`, which reads every file below, skips a torn last line: a run killed
    mid-write, which no finished run has and a reference would keep), then each other file as every reader of a
    run folder reads it (``metrics.jsonl``: :func:`check_records` reads its lines as they do, by
    :func:`~agg_bench.io.jsonl_records` and the record contract, and is not read again), and the records ending as
    the summary says, as the report checks a run that ended (:meth:`~agg_bench.reading.RunFolder.check_records_ended`: the ok record of the last
    good iteration; :meth:`~agg_bench.reading.RunFolder.check_identity`: an ok summary over one record per
    iteration, each ok; a metrics.jsonl cut at a line's end after the summary was written was counted done,
    packed, and refused only once unpack wrote the tables). Each file within :data:`MAX_MEMBER_BYTES`
    (:class:`~agg_bench.jsonfiles.TooLarge`). A
    UserError names the file after ``where``. Unpack reads an archive's run so (on a copy), and a window and
    ``campaign status`` count a run finished only when its folder reads so
    (:meth:`~agg_bench.tools.campaign.Campaign.finished`): a run they counted done that unpack then refused was
    never run again."""
    records = check_records(f"{where}/metrics.jsonl", read_bounded(folder / "metrics.jsonl", MAX_MEMBER_BYTES))
    for name in RUN_FILES:
        if name.endswith(".jsonl") and name != "metrics.jsonl" and (folder / name).is_file():
            json_lines(f"{where}/{name}", read_bounded(folder / name, MAX_MEMBER_BYTES))
    run = RunFolder(folder)
    with _named_as(where, folder):
        summary = run.summary()
        env = run.env()
        run.plan()
        run.evaluations()
        config = run.config_object()
        # the checks the report makes of a run that ended: the ok record of the last good iteration its summary
        # names, and a summary and records of one run and one end (an ok summary over every iteration)
        run.check_records_ended(summary, records)
        run.check_identity(summary, records)
    return records, summary, env, config


@contextlib.contextmanager
def _named_as(where: str, folder: Path) -> Iterator[None]:
    """A UserError raised inside names its file of ``folder`` after ``where`` instead of the folder's path (``run
    FOLDER: FILE`` too, as the checks of a run's files across them name it), the path as the readers show it: a
    folder whose path holds a newline or an escape is named quoted, and renamed all the same."""
    try:
        yield
    except UserError as err:
        text = str(err).replace(f"run {shown(folder)}: ", "")
        # each file as the readers name it (:func:`~agg_bench.errors.shown`: quoted where the path holds a
        # character that is not printable), the folder's path itself too where it is written as it is
        names = {*RUN_FILES, *(path.name for path in folder.iterdir())} if folder.is_dir() else set(RUN_FILES)
        for name in sorted(names, key=len, reverse=True):
            text = text.replace(shown(folder / name), name)
        raise UserError(f"{where}/{text.replace(f'{folder}/', '')}") from None


def _check_safetensors(where: str, data: bytes) -> None:
    """The safetensors layout as the safetensors reader accepts it: an 8-byte little-endian header length, a JSON
    header naming each tensor's dtype, shape (dimensions and their products, left to right, within 64 bits) and
    byte range, an optional ``__metadata__`` of strings, and the ranges in order of their offsets one after
    another from 0 (no gap, no overlap) up to exactly the end of the file."""
    if len(data) < 8:
        raise UserError(f"{where}: not a safetensors file (shorter than its header length)")
    (length,) = struct.unpack("<Q", data[:8])
    if length > len(data) - 8:
        raise UserError(f"{where}: not a safetensors file (a header of {length:,} bytes in a file of {len(data):,})")
    header = json_object(where, data[8:8 + length])
    metadata = header.pop("__metadata__", {})
    if not (isinstance(metadata, dict) and all(isinstance(v, str) for v in metadata.values())):
        raise UserError(f"{where}: __metadata__ = {quote(metadata)}; expected an object of strings")
    ranges = []
    for tensor, info in header.items():
        if not (isinstance(info, dict) and info.get("dtype") in SAFETENSORS_DTYPES
                and isinstance(info.get("shape"), list)
                and all(type(n) is int and 0 <= n < 2**64 for n in info["shape"])
                and isinstance(info.get("data_offsets"), list) and len(info["data_offsets"]) == 2
                and all(type(n) is int for n in info["data_offsets"])):
            raise UserError(f"{where}: tensor {quote(tensor)}: not a safetensors entry (dtype, shape, data_offsets)")
        start, stop = info["data_offsets"]
        count, products = 1, []  # the running product, as the reader multiplies the dimensions in order
        for n in info["shape"]:
            count *= n
            products.append(count)
        size = count * SAFETENSORS_DTYPES[info["dtype"]]
        if max(products, default=0) >= 2**64 or size >= 2**64 or not 0 <= start <= stop or stop - start != size:
            raise UserError(f"{where}: tensor {quote(tensor)}: its byte range does not hold its shape")
        ranges.append((start, stop, tensor))
    end = 0
    for start, stop, tensor in sorted(ranges):
        if start != end:
            raise UserError(f"{where}: tensor {quote(tensor)}: its bytes start at {start:,}, where the tensors before "
                            f"it end at {end:,} (the tensors' bytes follow one another, no gap, no overlap)")
        end = stop
    if 8 + length + end != len(data):
        raise UserError(f"{where}: the tensors cover {end:,} bytes after the header; the file has "
                        f"{len(data) - 8 - length:,}")


def _check_model(campaign: Campaign, where: str, label: str, files: dict[str, bytes]) -> None:
    """A pretrain output for a ``pretrain`` label of the sweep: its files, each of its kind."""
    if label not in campaign.pretrained_models():
        raise UserError(f"{where}: pretrained/{label} is not a pretrain label that {campaign.config_path}'s runs use")
    missing = [name for name in MODEL_FILES if name != "samples.png" and name not in files]
    if missing:
        raise UserError(f"{where}: pretrained/{label} lacks {missing[0]}")
    for name, data in files.items():
        shown = f"{where}: pretrained/{label}/{name}"
        if name.endswith(".json"):
            json_object(shown, data)
        elif name.endswith(".safetensors"):
            _check_safetensors(shown, data)
        elif not data.startswith(PNG_SIGNATURE):
            raise UserError(f"{shown}: not a PNG image")


def _refuse_cpu_form(campaign: Campaign, where: str, what: str, data: bytes | None) -> None:
    """A UserError naming ``campaign.gpu`` when ``what`` (a run's ``config.json`` or a calibration, ``data``), of
    no run or cell of a sweep that names a GPU, ran on the CPU: an archive of the ``--cpu`` form given to the
    GPU reference, which only ``campaign.gpu``'s hardware fills."""
    if not campaign.names_gpu or data is None:
        return
    try:
        device = loads(data).get("device")
    except (JsonProblem, AttributeError):
        return
    if device == "cpu":
        raise UserError(f"{where}: {what} ran on the CPU (a window of the --cpu form); campaign.gpu of "
                        f"{campaign.config_path} asks for {quote(campaign.gpu)}: expected an archive of a window on "
                        f"a {campaign.gpu}, or unpack this one with --cpu into a reference of its own")


def _check_run(campaign: Campaign, where: str, run_id: str, files: dict[str, bytes]) -> str | None:
    """A finished run of the campaign's sweep: its files, each read as every reader of a run folder reads it
    (:class:`~agg_bench.reading.RunFolder`, on a copy), a summary that says ``ok``, the config the sweep
    composes for ``run_id``, and records and a summary whose identity (run id, method, model, resolution,
    seed, weights, device) is that config's and that name one device. Returns the GPU's name (None on a CPU)."""
    if run_id not in campaign.sweep.runs:
        _refuse_cpu_form(campaign, where, f"runs/{run_id}", files.get("config.json"))
        raise UserError(f"{where}: runs/{run_id} is not a run of the sweep {campaign.config_path}")
    missing = [name for name in REQUIRED_RUN_FILES if name not in files]
    if missing:
        raise UserError(f"{where}: runs/{run_id} lacks {missing[0]} (a finished run has "
                        f"{', '.join(REQUIRED_RUN_FILES)})")
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / run_id
        folder.mkdir()
        for name, data in files.items():
            (folder / name).write_bytes(data)
        records, summary, env, config = read_run(f"{where}: runs/{run_id}", folder)
        with _named_as(f"{where}: runs/{run_id}", folder):
            typed = RunFolder(folder).config()
    if summary.get("status") != "ok":
        raise UserError(f"{where}: runs/{run_id} is not finished (status {quote(summary.get('status'))}, "
                        "expected ok)")
    if not campaign.composes(run_id, config):
        raise UserError(f"{where}: runs/{run_id}/config.json is not the config {campaign.config_path} composes "
                        "for that run (another version of the sweep?)")
    from ..results.loading import run_identity

    expected = run_identity(typed, run_id)
    found = identity_mismatch(expected, [("summary.json", summary),
                                         *((f"metrics.jsonl iteration {r['iteration']}", r) for r in records)])
    if found is not None:
        what, key, value = found
        raise UserError(f"{where}: runs/{run_id}/{what}: {key} = {quote(value)}; the sweep's run {run_id} has "
                        f"{quote(expected[key])}")
    devices = {(r.get("device"), r.get("gpu_name"), r.get("n_gpus")) for r in (summary, *records)}
    if len(devices) > 1:
        raise UserError(f"{where}: runs/{run_id}: its records name more than one device ({quote(sorted(map(str, devices)))})")
    [(device, gpu, _)] = devices
    if device == "cuda" and (not isinstance(gpu, str) or env.get("gpu_name") != gpu):
        raise UserError(f"{where}: runs/{run_id}: its records name the GPU {quote(gpu)} and its env.json "
                        f"{quote(env.get('gpu_name'))}; expected the same GPU")
    return gpu if device == "cuda" else None


def check_hardware(campaign: Campaign, where: str, gpus: dict[str, str | None], reference: Path) -> None:
    """The runs and calibrations of an archive (``gpus``: what -> its GPU's name, None on a CPU) and those the
    reference holds name one GPU, and where the sweep's ``campaign.gpu`` names one, that GPU: a reference's
    rows are compared with a user's as that hardware's (module docstring)."""
    held: dict[str, str | None] = {}
    for folder in sorted((reference / "runs").glob("*")) if (reference / "runs").is_dir() else []:
        if (folder / "summary.json").is_file():
            summary = RunFolder(folder).summary()
            held[f"reference {folder}"] = summary.get("gpu_name") if summary.get("device") == "cuda" else None
    names = set(gpus.values()) | set(held.values())
    if len(names) > 1:  # one example of each hardware: the first few of the archive's alone named one of them
        examples: dict[str | None, str] = {}
        for what, gpu in [*gpus.items(), *held.items()]:
            examples.setdefault(gpu, what)
        shown = ", ".join(f"{what}: {quote(gpu) if gpu is not None else 'a CPU'}"
                          for gpu, what in list(examples.items())[:6])
        raise UserError(f"{where}: its runs and the reference's are not of one GPU ({shown}); a reference holds "
                        "one hardware's results")
    for what, gpu in gpus.items():
        if not campaign.wants_gpu(gpu):
            raise UserError(f"{where}: {what} ran on {quote(gpu or 'a CPU')}; campaign.gpu of "
                            f"{campaign.config_path} asks for {quote(campaign.gpu)}")


WINDOW_LOG_KEYS: dict[str, type | tuple[type, ...]] = {
    "started": str, "minutes": (int, float), "config": str, "done_before": int, "runs": int, "pretrained": list,
    "processes": list, "stopped_by_signal": (str, type(None)), "seconds": (int, float), "finished_in_window": list,
    "left": int, "calibrations_left": int}


def _check_window_log(where: str, name: str, data: bytes) -> None:
    """A window's log as ``campaign run`` writes it: its keys, each of its kind and value, named after its start."""
    log = json_object(f"{where}: windows/{name}", data)
    for key, value in log.items():
        kinds = WINDOW_LOG_KEYS.get(key)
        if kinds is None or isinstance(value, bool) or not isinstance(value, kinds):
            raise UserError(f"{where}: windows/{name}: {quote(key)} = {quote(value)} is not a window log's "
                            f"(keys: {', '.join(WINDOW_LOG_KEYS)})")
    if log.get("started") is None or f"{log['started']}.json" != name:
        raise UserError(f"{where}: windows/{name}: started = {quote(log.get('started'))}; a window's log is "
                        "named after its start (<started>.json)")
    for key, value in log.items():  # each value as a window writes it, not only of its kind
        allowed = _window_log_value_problem(key, value)
        if allowed is not None:
            raise UserError(f"{where}: windows/{name}: {quote(key)} = {quote(value)}; expected {allowed}")
        item = _window_log_item_problem(key, value) if key in WINDOW_LOG_ITEMS else None
        if item is not None:  # an entry of a list, as a window writes it too
            at, found, allowed = item
            raise UserError(f"{where}: windows/{name}: {quote(key)}{at} = {quote(found)}; expected {allowed}")


def _window_log_value_problem(key: str, value: object) -> str | None:
    """What a window's log holds under ``key`` (of its kind already), in words, where ``value`` is not that."""
    from .campaign import MAX_MINUTES, STAMP_FORMAT

    if key == "started":
        try:  # and written back the same: strptime also takes a field of one digit, which strftime never writes
            if time.strftime(STAMP_FORMAT, time.strptime(str(value), STAMP_FORMAT)) != value:
                raise ValueError(value)
        except ValueError:
            return "the window's start, as YYYYMMDDTHHMMSS"
    if key == "minutes" and not (is_finite_number(value) and 0 < value <= MAX_MINUTES):
        return f"the window's minutes, a number in (0, {MAX_MINUTES}]"
    if key == "seconds" and not (is_finite_number(value) and value >= 0):
        return "the window's seconds, a finite number >= 0"
    if key in ("done_before", "runs", "left", "calibrations_left") and not (is_integer(value) and value >= 0):
        return "a count of runs or calibrations, an integer >= 0"
    if key == "stopped_by_signal" and value is not None and value not in signal.Signals.__members__:
        return "the name of the signal that stopped the window (e.g. 'SIGTERM') or null"
    if key == "config" and path_problem(str(value)) is not None:  # any name: campaign run --config takes any
        return "the window's campaign config file (a path)"
    return None


def _run_names(value: object) -> bool:
    return isinstance(value, list) and all(isinstance(v, str) and NAME.match(v) for v in value)


# a window log's entries (campaign.run_window): each field's test and what it holds, in words
_RUN_NAMES_FIELD = (_run_names, "a list of run folder names (letters, digits, '.', '_' and '-')")
_ENTRY_FIELDS: dict[str, tuple[Callable[[object], bool], str]] = {
    "label": (lambda v: isinstance(v, str) and bool(NAME.match(v)), "a pre-trained model's label (a name of "
              "letters, digits, '.', '_' and '-')"),
    "ok": (lambda v: isinstance(v, bool), "true or false"),
    "cell": (is_label, "a cell's name, printable text of 1 to 200 characters"),
    "runs": _RUN_NAMES_FIELD,
    "finished": _RUN_NAMES_FIELD,
    "busy": _RUN_NAMES_FIELD,
    "file": (lambda v: v is None or (isinstance(v, str) and bool(NAME.match(v))), "a calibration's file name or null"),
    "methods": (lambda v: isinstance(v, list) and all(is_label(m) for m in v), "a list of method labels"),
    "exit_code": (lambda v: v is None or is_integer(v), "an exit code (an integer) or null"),
    "ended": (is_label, "how it ended, printable text of 1 to 200 characters"),
    "seconds": (lambda v: is_finite_number(v) and v >= 0, "seconds, a finite number >= 0"),
}
# the keys of the entries a window writes (of any version: a cell process's busy came later, and its calibration
# was once a key of its entry, now an entry of its own), each with the keys it holds at least
PRETRAINED_ENTRY = ("label", "ok", "exit_code", "ended", "seconds")
PROCESS_ENTRY = ("cell", "runs", "finished", "busy", "exit_code", "ended", "seconds", "calibration")
CALIBRATION_ENTRY = ("file", "methods", "exit_code", "ended", "seconds")
WINDOW_LOG_ITEMS = {"pretrained": (PRETRAINED_ENTRY, ("label", "ok")), "processes": (PROCESS_ENTRY, ("cell",)),
                    "finished_in_window": None}


def _window_log_item_problem(key: str, value: list) -> tuple[str, object, str] | None:
    """The first item of a window log's list ``value`` under ``key`` (:data:`WINDOW_LOG_ITEMS`) that is not as
    a window writes it: (where in the list, ``[2]`` or ``[2]['runs']``; the item; what is expected there, in
    words); None when every item is. A cell process's entry holds its runs, its calibration, or both."""
    shape = WINDOW_LOG_ITEMS[key]
    for index, item in enumerate(value):
        if shape is None:
            if not _run_names([item]):
                return f"[{index}]", item, "a run folder name (letters, digits, '.', '_' and '-')"
            continue
        keys, required = shape
        problem = _entry_problem(item, keys, required, f"[{index}]")
        if problem is None and key == "processes" and not {"runs", "calibration"} & set(item):
            problem = f"[{index}]", item, "a cell process's entry, with its runs, its calibration or both"
        if problem is not None:
            return problem
    return None


def _entry_problem(entry: object, keys: tuple[str, ...], required: tuple[str, ...],
                   at: str) -> tuple[str, object, str] | None:
    """What of a window log's ``entry`` (at ``at`` in its list) is not as a window writes it: an object of
    ``keys``, ``required`` among them, each value of its field's shape (:data:`_ENTRY_FIELDS`)."""
    if not (isinstance(entry, dict) and set(required) <= set(entry) <= set(keys)):
        return at, entry, f"an object with keys among {', '.join(keys)} ({', '.join(required)} at least)"
    for field, item in entry.items():
        if field == "calibration":
            problem = _entry_problem(item, CALIBRATION_ENTRY, ("methods",), f"{at}['calibration']")
            if problem is not None:
                return problem
            continue
        test, words = _ENTRY_FIELDS[field]
        if not test(item):
            return f"{at}[{quote(field)}]", item, words
    return None


COUNT_KEYS = ("forward_nograd", "forward_grad", "backward", "train_forward_nograd", "train_forward_grad",
              "train_backward")


def tiny_counterpart(config: dict) -> dict:
    """A run's config on the tiny model of its family on the CPU, one iteration, no telemetry, no evaluation:
    the same schedule, group, plan and method, so the same passes per sample (they depend on neither the
    device, the size, the precision nor the weights)."""
    from .campaign import cpu_resolution

    cfg = json.loads(json.dumps(config))
    model = cfg["model"]
    model.update(preset="tiny", architecture=None, pretrained=None, dtype="float32",
                 resolution=cpu_resolution(model["resolution"]))
    cfg["device"] = "cpu"
    cfg["progress"] = False
    cfg["train"].update(iterations=1, budget=None, checkpoint_every=0, shard="none",
                        lora_rank=min(cfg["train"]["lora_rank"], 4))
    cfg["telemetry"] = {**cfg["telemetry"], "enabled": False, "tensorboard": False}
    cfg["eval"] = {**cfg["eval"], "every": 0}
    return cfg


# the iterations of a run whose passes unpack compares with the tiny model's: a schedule that moves with the
# iteration (MixGRPO's progressive window) counts differently in each; a learning run's hundreds are not all run
COUNTED_ITERATIONS = 4


def check_counts(where: str, run_id: str, records: list[dict], config: dict) -> None:
    """The passes per sample of the run's first :data:`COUNTED_ITERATIONS` records equal what the run's schedule
    counts in those iterations on the tiny model on the CPU (module docstring). A run of the ``cached`` method is
    not compared: a cache that skips by a threshold skips by the values, which random weights at another size do
    not share."""
    if (config.get("method") or {}).get("name") == "cached":  # from the config the sweep composed, not the records
        return
    from ..config import validate
    from ..io import read_jsonl
    from ..runtime.train import train

    compared = records[:COUNTED_ITERATIONS]
    cfg = tiny_counterpart(config)
    cfg["train"]["iterations"] = max(1, len(compared))
    with tempfile.TemporaryDirectory() as tmp, contextlib.redirect_stderr(io.StringIO()):  # no progress lines
        train(validate(cfg), Path(tmp) / run_id)
        tiny = list(read_jsonl(Path(tmp) / run_id / "metrics.jsonl"))
    for record, expected in zip(compared, tiny):
        for key in COUNT_KEYS:
            if record.get(key) != expected.get(key):
                raise UserError(f"{where}: runs/{run_id}: {key} = {quote(record.get(key))} in iteration "
                                f"{quote(record.get('iteration'))}, where the same schedule on the tiny model on the "
                                f"CPU counts {quote(expected.get(key))}")


def _check_calibration(campaign: Campaign, where: str, name: str, data: bytes) -> str | None:
    """What ``agg-bench calibrate`` writes for the cell the file is named after (its model, resolution and
    device that cell's); returns its GPU's name (None on a CPU)."""
    from ..config import validate
    from ..results.loading import CalibrationEntry, load_calibration, run_identity

    run = campaign.calibration_cell(name)
    if run is None:
        _refuse_cpu_form(campaign, where, f"calibration/{name}", data)
        raise UserError(f"{where}: calibration/{name} is not named <stamp>_<number>_<cell>.json after a cell of "
                        f"the sweep {campaign.config_path}")
    content = json_object(f"{where}: calibration/{name}", data)
    run_id = next(r for r, entry in campaign.sweep.runs.items() if entry is run)
    expected = run_identity(validate(campaign.config_of(run_id)), run_id)
    for key in ("model", "resolution", "device"):
        if key in expected and content.get(key) != expected[key]:
            raise UserError(f"{where}: calibration/{name}: {key} = {quote(content.get(key))}; its cell "
                            f"{campaign.cell_of(run)} has {quote(expected[key])}")
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / name
        path.write_bytes(data)
        try:
            load_calibration([CalibrationEntry(path)])
        except UserError as err:
            raise UserError(f"{where}: calibration/{name}: {str(err).split(': ', 2)[-1]}") from None
    gpu = content.get("gpu_name")
    return gpu if content.get("device") == "cuda" and isinstance(gpu, str) else None


def check_one_name_per_calibration(campaign: Campaign, where: str, files: dict[str, bytes], reference: Path) -> None:
    """A UserError naming two calibrations, of the archive (``files``: path in it -> bytes) or one of it and one the
    reference holds under another name, that are one calibration (the same content,
    :func:`agg_bench.results.loading.calibration_identity`): a calibration copied under another stamp stood twice in
    the reference's manifest, the copy's stamp placing it after the calibrations of that cell taken since. The same
    name with the same bytes is the reference's file already (skipped)."""
    from ..results.loading import check_distinct_calibrations

    named = {f"reference {reference}: calibration/{path.name}": (f"calibration/{path.name}", path.read_bytes())
             for path in campaign.finished_files(reference, "calibration")}
    held = {name for name, _ in named.values()}
    for name, data in files.items():
        if name.startswith("calibration/") and not (name in held and (reference / name).read_bytes() == data):
            named[f"{where}: {name}"] = (name, data)
    check_distinct_calibrations((label, json_object(label, data)) for label, (_, data) in named.items())


def _reusing_models(wanted: bool) -> contextlib.AbstractContextManager:
    """The tiny counterparts of :func:`check_counts` sharing one built model where their model configurations
    agree (:func:`agg_bench.runtime.model_reuse.reusing_models`, as a cell job's runs share one: each starts from
    it as built, so its records are those of a counterpart that builds its own); ``wanted`` false: nothing
    (no torch imported for an archive without new runs)."""
    if not wanted:
        return contextlib.nullcontext()
    from ..runtime.model_reuse import reusing_models

    return reusing_models()


# ----- unpacking into the reference -----------------------------------------------------------------------------
def _held(folder: Path) -> dict[str, bytes]:
    """Every file under ``folder`` by its path inside it."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}




def unpack(campaign: Campaign, archive: str | Path, reference: str | Path) -> dict:
    """Add ``archive`` to ``reference`` (module docstring); what was added."""
    archive, reference = Path(archive), Path(reference)
    where = f"archive {archive}"
    files = read_archive(archive)
    groups: dict[str, dict[str, bytes]] = {}  # "runs/<id>", "pretrained/<label>" -> {path inside: bytes}
    others: dict[str, bytes] = {}
    for name, data in files.items():
        parts = name.split("/")
        if parts[0] in ("runs", "pretrained"):
            groups.setdefault("/".join(parts[:2]), {})["/".join(parts[2:])] = data
        else:
            others[name] = data
    gpus: dict[str, str | None] = {}  # what -> the GPU it ran on
    for group, members in groups.items():
        kind, label = group.split("/")
        if kind == "runs":
            gpus[group] = _check_run(campaign, where, label, members)
        else:
            _check_model(campaign, where, label, members)
    for name, data in others.items():
        kind, file_name = name.split("/")
        if kind == "calibration":
            gpus[name] = _check_calibration(campaign, where, file_name, data)
        else:
            _check_window_log(where, file_name, data)
    # the reference's tables and learning report too, held from before anything changes (their locks beside them, as
    # `agg-bench report` and `agg-bench learning` hold them): a report writing them meanwhile refuses this unpack
    # before it moves anything, and a failed unpack puts back only what no other process holds
    with claim_folder(reference, REFERENCE_CONTENTS, "--reference"), \
            claimed_folders([(reference / "tables", REPORT_CONTENTS), (reference / "learning", LEARNING_CONTENTS)],
                            ("--reference", "--reference"), replaced_whole=True):
        # a killed earlier unpack's temporary of a file it generates (the manifest, written under no claim of its
        # own) would stay in the reference for good, and be committed with it: the folder's checks take it for the
        # harness's. Its staging folder stays until this unpack has put its own runs, manifest and tables in
        # place (below): it tells the readers that the manifest may lag behind the runs, and a refusal meanwhile
        # leaves the reference as the killed unpack did
        for name in GENERATED:
            remove_stale_temps(reference / name)
        # what is there of someone's that the manifest would lose or leave out: refused before anything changes
        check_manifest(campaign, reference)
        check_files_of_the_sweep(campaign, reference)
        check_hardware(campaign, where, gpus, reference)
        check_one_name_per_calibration(campaign, where, others, reference)
        held = [str(p.relative_to(reference)) for p in reference.rglob("*")] if reference.is_dir() else []
        clash = case_clash(files, held)
        if clash is not None:
            raise UserError(f"{where}: {quote(clash[0])} and the reference's {quote(clash[1])} differ only in case; "
                            f"{CASE_WHY}")
        # what the reference already holds: the same bytes are skipped, other bytes refused
        new_groups, new_others = {}, {}
        for group, members in groups.items():
            folder = reference / group
            if folder.exists():
                if _held(folder) != members:
                    raise UserError(f"{where}: {group} is in the reference {shown(reference)} already, with other "
                                    "contents; remove it there first to replace it")
                continue
            new_groups[group] = members
        for name, data in others.items():
            path = reference / name
            if path.exists():
                if path.read_bytes() != data:
                    raise UserError(f"{where}: {name} is in the reference {shown(reference)} already, with other "
                                    "contents")
                continue
            new_others[name] = data
        new_runs = {group.split("/")[1]: members for group, members in new_groups.items() if group.startswith("runs/")}
        # progress on a terminal only, cleared when done: a refusal stays the one line on stderr
        with tqdm(total=len(new_runs), desc="pass counts against the tiny models", unit="run", leave=False,
                  file=sys.stderr, disable=not new_runs or not sys.stderr.isatty()) as bar, \
                _reusing_models(bool(new_runs)):
            for run_id, members in new_runs.items():
                check_counts(where, run_id, json_lines(where, members["metrics.jsonl"]),
                             json.loads(members["config.json"]))
                bar.update()
        staging = atomic_path(reference / UNPACK_STAGING)  # a harness temporary: never someone's file
        staging.mkdir()
        moved: list[str] = []
        try:
            for name, data in [*((f"new/{g}/{n}", d) for g, m in new_groups.items() for n, d in m.items()),
                               *((f"new/{n}", d) for n, d in new_others.items())]:
                (staging / name).parent.mkdir(parents=True, exist_ok=True)
                (staging / name).write_bytes(data)
            for name in GENERATED:  # the tables as they are, put back if the new ones cannot be written
                if (reference / name).exists():
                    _copy(reference / name, staging / "old" / name)
            made: list[Path] = []  # folders made for the new files, deepest last
            try:
                for name in [*new_groups, *new_others]:
                    parent = (reference / name).parent
                    made.extend(reversed([p for p in (parent, *parent.parents) if p.is_relative_to(reference)
                                          and p != reference and not p.exists()]))
                    parent.mkdir(parents=True, exist_ok=True)
                    os.rename(staging / "new" / name, reference / name)
                    moved.append(name)
                manifest = write_reference_tables(campaign, reference)
            except BaseException:
                for name in moved:  # the reference as it was: the new files out, the old tables back
                    os.rename(reference / name, staging / "new" / name)
                for folder in reversed(made):
                    with contextlib.suppress(OSError):
                        folder.rmdir()
                for name in GENERATED:
                    if (staging / "old" / name).exists():
                        _remove(reference / name)
                        os.rename(staging / "old" / name, reference / name)
                    elif (reference / name).exists():
                        _remove(reference / name)
                raise
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        # the runs, the manifest and the tables in place: what a killed earlier unpack's staging folder said is
        # true no more (a kill before this line leaves it, and the same unpack again removes it)
        remove_stale_temps(reference / UNPACK_STAGING)
    return {"reference": str(reference), "runs_added": sorted(new_runs),
            "files_added": sorted([*(g for g in new_groups if not g.startswith("runs/")), *new_others]),
            "runs": len(manifest["runs"])}


# what unpack writes from the reference's runs (and puts back as it was when it cannot)
GENERATED = ("manifest.json", "tables", "learning")


def _copy(source: Path, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    if source.is_dir():
        shutil.copytree(source, target)
    else:
        shutil.copyfile(source, target)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


def reference_manifest(campaign: Campaign, reference: Path) -> dict:
    """The manifest of every finished run (:meth:`~agg_bench.tools.campaign.Campaign.finished`) and every calibration
    in ``reference``, with the sweep's labels and
    ``source: reference``; paths relative to the working directory where ``reference`` lies inside it (a
    committed reference is read from the repository's root)."""
    reference = _relative(reference)
    full = campaign.sweep.manifest()
    entries = _run_entries(campaign, reference, full)
    # the runs a window and campaign status count done: a run folder there of another config, or one that did not
    # end as a finished run (put there by hand), stood in the tables as the sweep's run while status called it missing
    runs = [entry for run_id, entry in entries.items() if campaign.finished(reference / "runs" / run_id, run_id)]
    calibration = [entry for path in campaign.finished_files(reference, "calibration")
                   if (entry := _calibration_entry(campaign, path)) is not None]
    return {"runs": runs, "gradcheck": [], "calibration": calibration, "warmup": full["warmup"], "time": full["time"]}


def _run_entries(campaign: Campaign, reference: Path, full: dict | None = None) -> dict[str, dict]:
    """The manifest entry of each run of the sweep in ``reference`` (as the path is written), by run id, in the
    sweep's order, finished or not; ``full``: the sweep's manifest where the caller holds it."""
    entries: dict[str, dict] = {}
    for entry in (full or campaign.sweep.manifest())["runs"]:
        run_id = Path(entry["dir"]).name
        if run_id in campaign.sweep.runs and run_id not in entries:
            entries[run_id] = {**entry, "dir": str(reference / "runs" / run_id), "source": "reference"}
    return entries


def _calibration_entry(campaign: Campaign, path: Path) -> dict | None:
    """The manifest entry of the calibration file ``path`` (named after a cell of the sweep), or None."""
    run = campaign.calibration_cell(path.name)
    if run is None:
        return None
    return {"file": str(path), "model": run["model"], "resolution": run["resolution"], "device": run["device"],
            "source": "reference"}


def manifest_problem(campaign: Campaign, reference: Path, held: object) -> str | None:
    """Why ``held`` (a reference's ``manifest.json``, read) is no manifest that unpack writes for ``reference``, or
    None: one whose warmup and time are the sweep's, with no gradcheck, each run entry the one
    :func:`reference_manifest` writes for a run of the sweep and each calibration entry the one it writes for a
    calibration named after a cell, runs in the sweep's order and calibrations in the order of their names, every
    path in one folder that is ``reference`` (written from any working folder: the folder as a path relative to
    it, which ``reference`` ends with, or as ``reference``'s absolute path). Runs and calibrations it lacks or that
    are gone are no problem: the manifest of an earlier unpack (one killed before it wrote the manifest, a run folder
    removed since to be run again) lists other runs than the reference holds."""
    full = campaign.sweep.manifest()
    if not isinstance(held, dict):
        return "not a JSON object"
    expected_keys = ["runs", "gradcheck", "calibration", "warmup", "time"]
    if sorted(held) != sorted(expected_keys):
        return f"its keys are {quote(sorted(held))}; unpack writes {quote(expected_keys)}"
    for key, value in (("gradcheck", []), ("warmup", full["warmup"]), ("time", full["time"])):
        if held[key] != value:
            return f"{key} = {quote(held[key])}; unpack writes {quote(value)} for this sweep"
    runs = _run_entries(campaign, Path("."), full)  # the paths are compared apart, below
    order = list(runs)
    folders: set[Path] = set()
    last = -1
    for section, key in (("runs", "dir"), ("calibration", "file")):
        if not isinstance(held[section], list):
            return f"{section} = {quote(held[section])}; unpack writes a list"
        previous = ""
        for i, entry in enumerate(held[section]):
            path = entry.get(key) if isinstance(entry, dict) else None
            if not isinstance(path, str) or Path(path).parent.name != ("runs" if section == "runs" else "calibration"):
                return f"{section}[{i}] = {quote(entry)} is no entry unpack writes"
            name = Path(path).name
            folders.add(Path(path).parent.parent)
            if section == "runs":
                wanted = runs.get(name)
                if wanted is None:
                    return f"{section}[{i}]: {quote(name)} is no run of the sweep"
                if order.index(name) <= last:
                    return f"{section}[{i}]: {quote(name)} is out of the sweep's order of runs"
                last = order.index(name)
            else:
                wanted = _calibration_entry(campaign, Path(path))
                if wanted is None:
                    return f"{section}[{i}]: {quote(name)} is named after no cell of the sweep"
                if name <= previous:
                    return f"{section}[{i}]: {quote(name)} is out of the order of names"
                previous = name
            for field in sorted({*entry, *wanted} - {key}):
                if entry.get(field, "<none>") != wanted.get(field, "<none>"):
                    return (f"{section}[{i}].{field} = {quote(entry.get(field, '<none>'))}; unpack writes "
                            f"{quote(wanted.get(field, '<none>'))}")
    if len(folders) > 1:
        return f"its paths lie in {len(folders)} folders ({quote(sorted(map(str, folders)))}); unpack writes one"
    if folders:
        [folder] = folders
        place = reference.resolve()
        if not (place == folder if folder.is_absolute() else
                ".." not in folder.parts and place.parts[len(place.parts) - len(folder.parts):] == folder.parts):
            return f"its paths lie in {quote(str(folder))}, not in the reference {shown(reference)}"
    return None


def check_manifest(campaign: Campaign, reference: Path) -> None:
    """A UserError, one line naming the file, when ``reference`` holds a ``manifest.json`` that is not one unpack
    writes (:func:`manifest_problem`: edited by hand, or someone's file): unpack would replace it, and what its
    user put there would be lost."""
    path = reference / "manifest.json"
    if not path.exists():
        return
    problem: str | None
    try:
        held = loads(read_bounded(path, MAX_MEMBER_BYTES))
    except OSError as err:  # a named pipe, say: someone's, not read
        problem = f"not a JSON file unpack writes: {err.strerror or 'not a regular file'}"
    except TooLarge:
        problem = f"not a JSON file unpack writes: more than {MAX_MEMBER_BYTES:,} bytes"
    except JsonProblem as err:
        problem = f"not a JSON file unpack writes: {first_message_line(err)}"
    else:
        problem = manifest_problem(campaign, reference, held)
    if problem is not None:
        raise UserError(f"--reference {shown(reference)}: manifest.json is not the manifest campaign unpack writes "
                        f"for {campaign.config_path}'s runs and calibrations there ({problem}); unpack would replace it: "
                        "move it out of the reference (unpack writes it anew from the runs there), or give another "
                        "reference")


def check_files_of_the_sweep(campaign: Campaign, reference: Path) -> None:
    """A UserError, one line naming them, when ``reference/runs`` holds folders named after no run of the sweep, or
    ``reference/calibration`` calibrations (:meth:`~agg_bench.tools.campaign.Campaign.finished_files`) named after
    no cell of it (:meth:`~agg_bench.tools.campaign.Campaign.calibration_cell`): the manifest and tables would leave
    them out without a word (a file of no kind the reference holds is refused as someone's:
    :func:`~agg_bench.outdir.check_folder`)."""
    folder = reference / "runs"
    runs = sorted(f"runs/{path.name}" for path in folder.iterdir() if path.is_dir() and not is_harness_name(path.name)
                  and path.name not in campaign.sweep.runs) if folder.is_dir() else []
    calibrations = [f"calibration/{path.name}" for path in campaign.finished_files(reference, "calibration")
                    if campaign.calibration_cell(path.name) is None]
    if not runs and not calibrations:
        return
    sweep = f"the sweep {campaign.config_path}"
    said = [f"{shown_names(names)} {'is' if len(names) == 1 else 'are'} {what}" for names, what in (
        (runs, f"no run of {sweep}"),
        (calibrations, f"named after no cell of {'it' if runs else sweep}")) if names]
    one = len(runs) + len(calibrations) == 1
    raise UserError(f"--reference {shown(reference)}: {' and '.join(said)}, which the manifest and tables would leave "
                    f"out; move {'it' if one else 'them'} out of the reference, or give another reference")


def _relative(path: Path) -> Path:
    relative = os.path.relpath(path.resolve())
    return Path(relative) if not relative.startswith("..") else path.resolve()


def write_reference_tables(campaign: Campaign, reference: Path) -> dict:
    """``reference``'s manifest.json and its tables (module docstring); the manifest. The caller holds the claims
    of ``reference``, its ``tables`` and its ``learning`` (:func:`unpack`)."""
    from ..results.loading import load_manifest
    from ..results.report import write_report

    manifest = reference_manifest(campaign, reference)
    write_json(reference / "manifest.json", manifest)
    if campaign.learning is not None:
        if len(manifest["runs"]) == len(campaign.sweep.runs):
            write_learning_tables(campaign, reference)
    elif manifest["runs"]:
        write_report(load_manifest(reference / "manifest.json"), reference / "tables")
    return manifest


def write_learning_tables(campaign: Campaign, reference: Path) -> None:
    """The learning report of a complete reference from its runs' in-run evaluations (no checkpoint to
    evaluate): ``learning/`` with ``learning.csv``, ``learning.md``, ``curves.csv`` (what ``agg-bench learning
    --manifest REF/manifest.json --tables DIR`` with the sweep's ``learning`` options writes, byte for byte)
    and the plots drawn from the runs alone (reward against iteration and time, the held-out reward against
    cost and CPU time, the Pareto plot); the pre-trained model's own sample grid is its ``samples.png`` in
    ``pretrained/``."""
    from ..outdir import replaced_folders
    from ..results.learning_tables import load_runs
    from .learning import DEFAULT_REFERENCE, learning_plots_into, learning_tables_into

    options = campaign.learning_options()
    options.check()
    runs = load_runs(reference / "manifest.json")
    label = options.reference or DEFAULT_REFERENCE
    folder = reference / "learning"
    # replaced whole as `agg-bench learning` writes a folder, under the claim the unpack holds (:func:`unpack`)
    with replaced_folders(folder) as staged:
        learning_tables_into(staged(folder), runs, options, label)
        learning_plots_into(staged(folder), runs)
