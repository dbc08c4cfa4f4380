"""Result files that survive a crash: every file is written to a temporary name and renamed, and
metric records are appended one flushed line at a time."""
from __future__ import annotations

import json
import math
import os
import re
import secrets
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any, Iterator

from .errors import DISK_FULL, UserError, disk_full, shown
from .jsonfiles import JsonProblem, NotRegularFile, loads, open_regular


def _json_default(obj: Any):
    if hasattr(obj, "item"):
        return obj.item()
    if isinstance(obj, Path):
        return str(obj)
    raise TypeError(f"cannot write {type(obj).__name__} as JSON")


# values _clean leaves as they are, by their exact type (a subclass, numpy's float64 among them, takes the full test)
_AS_IS = frozenset({str, int, bool, type(None)})


def _clean(value: Any) -> Any:
    """NaN/inf are not JSON: write them as null. A dict whose values are all plain text, integers, null or finite
    floats (a metric record, 100,000 of them in an imported log) is returned as it is, without a copy; any other
    container is copied with its values cleaned."""
    kind = type(value)
    if kind is float:
        return value if math.isfinite(value) else None
    if kind is dict:
        for v in value.values():
            if type(v) not in _AS_IS and not (type(v) is float and math.isfinite(v)):
                return {k: _clean(v) for k, v in value.items()}
        return value
    if kind in _AS_IS:
        return value
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    return value


def as_written(data: Any) -> Any:
    """``data`` as :func:`write_json` writes it and ``json.load`` reads it back (NaN as null, tuples as lists,
    paths as text): what a file written from ``data`` compares equal to."""
    return json.loads(json.dumps(_clean(data), default=_json_default))


# Temporary names of the harness: ".STEM.agg-bench-tmpPID-RUN[.EXT]", PID the writing process's and RUN a token
# drawn once per process start (:data:`RUN_TOKEN_CHARS` hex digits). Stale ones (a killed process's) are removed by
# matching exactly this pattern, never a user's ".bashrc.tmpl" or ".notes.tmp". The PID says whether the writer
# may still run; the token tells this process's own temporaries from those of an earlier process that had its PID
# (PIDs are reused, in a fresh container's few from the start), which a process that is running cannot be. A name
# without a token (".STEM.agg-bench-tmpPID[.EXT]", an earlier harness's) is a temporary too, never this run's.
TEMP_TAG = ".agg-bench-tmp"
RUN_TOKEN_CHARS = 8
_OWNER = re.compile(r"([0-9]+)(?:-([0-9a-f]{%d}))?" % RUN_TOKEN_CHARS)
_TEMP_NAME = re.compile(r"^\..+" + re.escape(TEMP_TAG) + "(" + _OWNER.pattern + r")(\.[A-Za-z0-9]+)?$")


def _new_run() -> None:
    _RUN[:] = [(os.getpid(), secrets.token_hex(RUN_TOKEN_CHARS // 2))]


# (PID, token) of this process run, drawn as the module is imported, before any thread could race to draw it, and
# again in a forked child
_RUN: list[tuple[int, str]] = []
_new_run()
os.register_at_fork(after_in_child=_new_run)


def _this_run() -> tuple[int, str]:
    if _RUN[0][0] != os.getpid():  # a child forked by a way that ran no fork handler
        _new_run()
    return _RUN[0]


def is_temp_name(name: str) -> bool:
    """Whether ``name`` is one of :func:`atomic_path`'s temporary names (a name without a run token included)."""
    return _TEMP_NAME.match(name) is not None


def _temp_name_run(name: str) -> tuple[int, str] | None:
    match = _TEMP_NAME.match(name)
    return _run_of(match.group(1)) if match else None


def _run_of(text: str) -> tuple[int, str] | None:
    """(PID, run token, "" for none) of the part of a temporary name after :data:`TEMP_TAG`; None for other text."""
    match = _OWNER.fullmatch(text)
    return (int(match.group(1)), match.group(2) or "") if match else None


def path_text(path: str | Path) -> str:
    """``path`` as UTF-8 text any file or table can hold: a byte of it that is no UTF-8 as ``\\xNN``. Decoded by
    the locale (ASCII under LANG=C), a non-ASCII name held lone surrogates, which a UTF-8 writer refuses
    (UnicodeEncodeError); two such names stay two texts."""
    return os.fsencode(path).decode("utf-8", "backslashreplace")


def atomic_path(path: str | Path, pid: int | None = None) -> Path:
    """A temporary sibling of ``path``; rename it onto ``path`` with ``os.replace`` when complete. Its name is this
    process run's: its PID and run token, which no earlier process of the same PID had. With ``pid``, the name
    without a run token that process ``pid`` is taken to have given it: another process's, or with this process's
    PID an earlier process's that had it (:func:`temp_owner` reads the PID back)."""
    path = Path(path)
    owner = "-".join(map(str, _this_run())) if pid is None else str(pid)
    return path.with_name(f".{path.stem}{TEMP_TAG}{owner}{path.suffix}")


def _temp_run(path: str | Path, name: str) -> tuple[int, str] | None:
    path = Path(path)
    head, tail = f".{path.stem}{TEMP_TAG}", path.suffix
    if not (name.startswith(head) and name.endswith(tail)) or len(name) < len(head) + len(tail):
        return None
    return _run_of(name[len(head):len(name) - len(tail)])


def temp_owner(path: str | Path, name: str) -> int | None:
    """The PID of the process whose :func:`atomic_path` of ``path`` is named ``name`` (any process's, a killed
    one's included); None for any other name."""
    owner = _temp_run(path, name)
    return owner[0] if owner else None


def _ended(owner: tuple[int, str]) -> bool:
    """Whether the process run that named a temporary ``owner`` (PID, run token) has ended: no process has the
    PID, or this process has it and the name is not this run's (a killed process's whose PID this one was given).
    A running process of another PID keeps its temporaries, whichever process it is."""
    pid = owner[0]
    return owner != _this_run() if pid == os.getpid() else not process_running(pid)


def is_stale_temp(name: str, path: str | Path | None = None) -> bool:
    """Whether ``name`` is a temporary (of ``path`` where given: an :func:`atomic_path` of it) that a process run
    which has ended left: :func:`remove_stale_temps`' test, and the one for a folder of many writers' files."""
    owner = _temp_name_run(name) if path is None else _temp_run(path, name)
    return owner is not None and _ended(owner)


def file_identity(path: str | Path) -> tuple[int, int, int] | None:
    """(device, inode, modification time) of the file at ``path``, or None where there is none: a file replaced
    by rename (every write of :func:`atomic_file`) or written in place since has another."""
    try:
        stat = os.stat(path)
    except OSError:
        return None
    return stat.st_dev, stat.st_ino, stat.st_mtime_ns


def process_running(pid: int) -> bool:
    """Whether a process ``pid`` exists (one of another user's included)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        return True  # another user's; or no PID at all, which is left alone too
    return True


def _aside(path: Path) -> Path:
    """The name :func:`atomic_target` moves an earlier folder at ``path`` aside under (an :func:`atomic_path` of
    it) while the new one is renamed in."""
    return path.with_name(f"{path.name}-old")


def remove_stale_temps(path: str | Path) -> None:
    """Remove what :func:`atomic_target` (or a bare :func:`atomic_path`) of ``path`` left beside it in processes
    that have ended without cleaning up (SIGKILL runs no cleanup): its temporary, and an earlier folder it had
    moved aside, which goes back to ``path`` where a process killed between its two renames left nothing there
    (the earlier contents, never a loss). Only entries of exactly those names are touched, never a symbolic
    link, and only when the process run in the name has ended (:func:`is_stale_temp`: a live writer of the same
    name keeps its temporary, this process run its own). The caller holds ``path``'s claim, so no live process of
    this harness writes a new one meanwhile."""
    path = Path(path)
    if not path.parent.is_dir():
        return
    aside = _aside(path)
    for entry in sorted(path.parent.iterdir()):
        stale = [target for target in (path, aside) if not entry.is_symlink() and is_stale_temp(entry.name, target)]
        if stale == [aside] and entry.is_dir() and not os.path.lexists(path):
            os.replace(entry, path)
        elif stale:
            _remove(entry)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def current_umask() -> int:
    """This process's umask. Read from /proc where the system has it: setting the umask to learn it would, for
    that moment, give the files another thread creates a mode of that setting."""
    try:
        with open("/proc/self/status", encoding="ascii", errors="replace") as fh:
            for line in fh:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)  # 022 for the moment it is set: the usual mask, never a wider mode
    os.umask(mask)
    return mask


def follow_umask(path: str | Path) -> None:
    """Give the file ``path``, or every file and folder in the folder ``path`` (itself included), the mode a plain
    ``open(..., "w")`` or ``mkdir`` gives under this process's umask (0644 and 0755 under umask 022): a writer of
    its own (safetensors' ``save_file`` writes 0600) left a result that others sharing the folder cannot read.
    Symbolic links are left alone."""
    mask = current_umask()
    path = Path(path)
    if path.is_symlink():
        return
    if not path.is_dir():
        os.chmod(path, 0o666 & ~mask)
        return
    os.chmod(path, 0o777 & ~mask)
    for folder, dirs, files in os.walk(path):
        for name in (*dirs, *files):
            entry = os.path.join(folder, name)
            if not os.path.islink(entry):
                os.chmod(entry, (0o777 if name in dirs else 0o666) & ~mask)


@contextmanager
def atomic_target(path: str | Path, umask_modes: bool = True) -> Iterator[Path]:
    """A temporary sibling of ``path`` (a file or a folder) for the caller to write; renamed onto ``path``
    when the block ends (a folder replaces an earlier folder at ``path``), removed if it raises (a full disk
    leaves nothing half-written behind, and its error names ``path``). Renaming replaces a symbolic link at ``path``; it never writes
    through one. What is renamed in has the modes of the umask (:func:`follow_umask`), whoever wrote it; with
    ``umask_modes`` false its modes are left as they are (a folder that starts with links to the files already
    there, whose modes are their owner's)."""
    path = Path(path)
    tmp = atomic_path(path)
    _remove(tmp)  # what this process run left of an earlier write of the same path that failed to clean up
    try:
        yield tmp
        if umask_modes and os.path.lexists(tmp):
            follow_umask(tmp)
        if tmp.is_dir() and path.is_dir() and not path.is_symlink():  # a folder replaces a folder
            aside = atomic_path(_aside(path))
            _remove(aside)
            os.replace(path, aside)
            try:
                os.replace(tmp, path)
            except BaseException:
                os.replace(aside, path)  # the earlier folder back where the new one could not go
                raise
            _remove(aside)
        else:
            os.replace(tmp, path)
    except BaseException as exc:
        _remove(tmp)
        full = disk_full(exc) if isinstance(exc, Exception) else None
        if full is not None and full[1] in (None, str(tmp)):  # a write's error names no file, or the removed one
            code = next(code for code, what in DISK_FULL.items() if what == full[0])
            raise OSError(code, full[0], str(path)) from exc
        raise


def _open_nofollow(path, flags):
    return os.open(path, flags | os.O_NOFOLLOW, 0o666)  # plain open()'s mode: the umask decides


@contextmanager
def atomic_file(path: str | Path, mode: str = "w") -> Iterator[IO]:
    """An open temporary sibling of ``path`` (text ``w`` or binary ``wb``), flushed, fsynced and renamed
    onto ``path`` when the block ends; removed if it raises."""
    with atomic_target(path) as tmp:
        with open(tmp, mode, opener=_open_nofollow, encoding=None if "b" in mode else "utf-8") as fh:
            yield fh
            fh.flush()
            os.fsync(fh.fileno())


def write_json(path: str | Path, data: Any) -> None:
    """Write ``data`` as JSON atomically (temp file in the same folder, then rename)."""
    with atomic_file(path) as fh:
        json.dump(_clean(data), fh, indent=2, default=_json_default, sort_keys=False)
        fh.write("\n")


def write_text(path: str | Path, text: str) -> None:
    """Write ``text`` to ``path`` atomically (temporary sibling, then rename)."""
    with atomic_file(path) as fh:
        fh.write(text)


def write_lines(path: str | Path, lines: list[str]) -> None:
    """Replace ``path`` with ``lines`` (JSON lines without their newlines) atomically."""
    with atomic_file(path) as fh:
        fh.writelines(line + "\n" for line in lines)


def save_figure(fig: Any, path: str | Path) -> Path:
    """Write a matplotlib figure as a PNG atomically (the folder is made if needed)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_target(path) as tmp:
        fig.savefig(tmp, dpi=110, bbox_inches="tight", format="png")
    return path


# json.dumps(value, default=_json_default), without a new encoder per call (an import writes 100,000s of lines)
_LINE_ENCODER = json.JSONEncoder(default=_json_default)


class JsonlWriter:
    """Appends one JSON record per line, flushed and fsynced, so a killed process leaves whole lines."""

    def __init__(self, path: str | Path, append: bool = False):
        self.path = Path(path)
        flags = os.O_WRONLY | os.O_CREAT | (os.O_APPEND if append else os.O_TRUNC)
        self._fh = open(self.path, "a" if append else "w", encoding="utf-8", opener=lambda p, _: _open_nofollow(p, flags))

    @staticmethod
    def line(record: dict) -> str:
        """``record`` as the JSON line ``write`` appends (without its newline)."""
        return _LINE_ENCODER.encode(_clean(record))

    def write(self, record: dict) -> str:
        """Append ``record``; return the line written (without its newline)."""
        line = self.line(record)
        self._fh.write(line + "\n")
        self._fh.flush()
        os.fsync(self._fh.fileno())
        return line

    def close(self) -> None:
        self._fh.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


# a line of a JSONL file agg-bench writes: a record of a few KB (metrics.jsonl, evaluations.jsonl); a longer one is
# refused before it is read whole, as a run folder's JSON files are refused above their size
MAX_JSONL_LINE_BYTES = 2**20


def read_jsonl(path: str | Path) -> Iterator[dict]:
    """Records of a JSONL file, read a line at a time by :func:`jsonl_records` (a torn last line, a run killed
    mid-write, skipped); a path that is a folder, a device or a pipe raises a UserError naming it."""
    try:
        fh = open_regular(path)
    except NotRegularFile:
        raise UserError(f"{shown(path)}: is not a regular file; expected a JSONL file of agg-bench records") from None
    except IsADirectoryError:
        raise UserError(f"{shown(path)}: is a folder; expected a JSONL file of agg-bench records") from None
    with fh:
        yield from jsonl_records(fh, path)


def jsonl_records(fh: IO[bytes], where: str | Path, torn: bool = True) -> Iterator[dict]:
    """The records (JSON objects) of the JSONL text ``fh`` holds, read a line at a time: the one reading of
    ``metrics.jsonl`` and ``evaluations.jsonl``, for a run folder's readers (:func:`read_jsonl`) and an archive's
    (:func:`agg_bench.tools.archive.json_lines`). A line that is not a JSON object agg-bench reads
    (:func:`~agg_bench.jsonfiles.loads`: NaN refused too), or is longer than :data:`MAX_JSONL_LINE_BYTES`,
    raises a UserError naming ``where`` and the line. Only a last line WITHOUT its newline that is not JSON is
    torn, a writer killed mid-line: skipped with ``torn``, refused as damaged without it (a finished run's file,
    which no killed writer left); a whole last line, its newline written, is checked as every other line."""
    number, offset = 0, 0
    line = fh.readline(MAX_JSONL_LINE_BYTES + 1)
    while line:  # b"" at the end of the file
        number, following = number + 1, fh.readline(MAX_JSONL_LINE_BYTES + 1)
        if len(line.rstrip(b"\r\n")) > MAX_JSONL_LINE_BYTES:
            raise UserError(f"{shown(where)}: line {number} is longer than {MAX_JSONL_LINE_BYTES:,} bytes; "
                            "expected a record of agg-bench (a JSON object of a few KB per line)")
        try:
            text = line.decode("utf-8")
        except UnicodeDecodeError as err:
            raise UserError(f"{shown(where)}: not UTF-8 text ({err.reason} at byte {offset + err.start})") from err
        offset += len(line)
        if text.strip():
            try:
                record = loads(text)
            except JsonProblem as err:
                if torn and not following and not line.endswith(b"\n"):  # torn: a writer killed mid-line
                    return
                raise UserError(f"{shown(where)}: line {number} is not valid JSON ({err}); the file is damaged") from None
            if not isinstance(record, dict):
                raise UserError(f"{shown(where)}: line {number} is not a JSON object")
            yield record
        line = following
