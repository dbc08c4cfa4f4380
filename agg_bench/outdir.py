"""Output folders and files: one writer each, nothing of anyone else's touched, no write through a link.

Every command that writes (``run``, ``import-log``, ``snapshot``, ``profile``, ``replay``, ``calibrate``,
``gradcheck``, ``report``, ``pretrain``, ``embed`` and the learning report) claims its output here first,
before anything is written, and holds the claim until it is done:

- **Its own files only.** A folder output may be new, empty, or hold only what that command writes
  (:class:`Contents`), each of its kind: a folder where the command writes a file (or a file where it
  owns a folder) is refused before anything is written, not found when writing. A folder the command
  owns inside its output (a run's ``tensorboard/`` and checkpoint shards, a pretrain output's
  ``transformer/``) is checked the same way, since the command removes or replaces it whole; a file
  output may be new or that command's earlier output. Anything else is someone's: the command refuses
  (one line, exit 2) and touches nothing.
  A folder output inside another command's output folder (a run's, a snapshot's, a profile's, a pretrain
  output's, a report's tables or plots, an imported log's: :data:`OUTPUT_MARKS`), and a file output whose folder is one or lies inside one, is refused too:
  it would be a stranger there.
- **No symbolic links.** An output that is a link, or a folder holding one anywhere inside, is refused,
  so no write can land outside the folder the user named. Files are opened with ``O_NOFOLLOW`` and
  replaced by rename, which replaces a link instead of writing through it.
- **One writer.** An exclusive ``fcntl.flock`` on a lock file (``DIR/.agg-bench.lock`` inside a folder
  output; ``.NAME.agg-bench.lock`` beside a file output, or beside a folder that is replaced whole) is
  held for the claim's life. A second writer is refused (:class:`Busy`) and told the holder's PID. The
  kernel releases the lock when its process dies, however it dies; the file is removed when the claim
  ends, and :func:`remove_owned` removes only a lock file that no process holds.
- **Nothing left by a failure.** A folder the claim created is removed again if the command fails, or
  is stopped by a signal, before writing anything into it; a second signal, which ends the process at
  once (:mod:`agg_bench.stopping`), still removes the lock file and such an empty folder first.
"""
from __future__ import annotations

import errno
import fcntl
import fnmatch
import itertools
import os
import shutil
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

from . import stopping
from .errors import UserError, quote, shown
from .jsonfiles import JsonFileError, read_json_object
from .io import (RUN_TOKEN_CHARS, TEMP_TAG, atomic_path, atomic_target, is_stale_temp, is_temp_name,
                 remove_stale_temps)

LOCK_SUFFIX = ".agg-bench.lock"
FOLDER_LOCK = LOCK_SUFFIX  # inside a folder output: DIR/.agg-bench.lock


def lock_path(target: Path, lock_inside: bool) -> Path:
    """The lock file of the claim of ``target``: ``TARGET/.agg-bench.lock`` inside a folder output,
    ``.NAME.agg-bench.lock`` beside a file output or a folder replaced whole."""
    return target / FOLDER_LOCK if lock_inside else target.parent / f".{target.name}{LOCK_SUFFIX}"


def is_lock_name(name: str) -> bool:
    """Whether ``name`` is one of the lock files of this module."""
    return name.startswith(".") and name.endswith(LOCK_SUFFIX)


def is_harness_name(name: str) -> bool:
    """A temporary or lock file of the harness: never a user's file, never a command's output."""
    return is_temp_name(name) or is_lock_name(name)


class Busy(UserError):
    """Another process holds the claim of ``target`` (a second writer, refused); ``pid``: the holder's PID
    where its lock file says it, else None."""

    def __init__(self, message: str, target: Path, pid: int | None):
        super().__init__(message)
        self.target, self.pid = target, pid


@dataclass(frozen=True)
class Contents:
    """What one command writes into its output folder: files by exact ``names``, shell-style ``patterns``
    (``config.json``, ``*.pt.trace.json``) or a predicate ``match`` on a name, and the ``folders`` it owns
    inside, each a (name or pattern, what that folder holds) pair: a :class:`Contents` that is checked too
    (the command removes or replaces such a folder, so nothing else may be in it), or None for a folder
    the command writes into without removing anything (not looked into). ``what`` names the kind of
    folder in errors ("an agg-bench run")."""

    what: str
    names: tuple[str, ...] = ()
    patterns: tuple[str, ...] = ()
    match: Callable[[str], bool] | None = field(default=None, compare=False)
    folders: tuple[tuple[str, "Contents | None"], ...] = ()

    def file(self, name: str) -> bool:
        """Whether the command writes a file called ``name`` here."""
        return name in self.names or any(fnmatch.fnmatchcase(name, p) for p in self.patterns) or \
            (self.match is not None and self.match(name))

    def folder(self, name: str) -> tuple[bool, "Contents | None"]:
        """Whether the command owns a folder called ``name`` here, and what that folder holds."""
        for pattern, contents in self.folders:
            if name == pattern or fnmatch.fnmatchcase(name, pattern):
                return True, contents
        return False, None

    def ours(self, name: str) -> bool:
        """Whether ``name`` is one of the command's files or folders here, whatever its kind."""
        return self.file(name) or self.folder(name)[0]

    def __or__(self, other: "Contents") -> "Contents":
        """The files of both (two commands' outputs in one folder, e.g. ``--tables DIR --plots DIR``)."""
        return Contents(f"{self.what} or {other.what}", self.names + other.names, self.patterns + other.patterns,
                        lambda name: self.file(name) or other.file(name), self.folders + other.folders)


def shown_names(names: list[str]) -> str:
    """The first three of ``names`` for a message, each :func:`~agg_bench.errors.shown`, and ``...`` for more."""
    return ", ".join(shown(name) for name in names[:3]) + (", ..." if len(names) > 3 else "")


def find_links(folder: Path) -> list[str]:
    """Symbolic links anywhere under ``folder`` (paths relative to it), without following any."""
    links = []
    for root, dirs, files in os.walk(folder, followlinks=False):
        for name in dirs + files:
            if os.path.islink(os.path.join(root, name)):
                links.append(os.path.relpath(os.path.join(root, name), folder))
    return sorted(links)


def _strangers(folder: Path, contents: Contents, prefix: str = "") -> tuple[list[str], list[str]]:
    """Paths under ``folder`` (relative to the folder first checked, folders with a trailing ``/``) that
    ``contents`` does not name, and those of the wrong kind (a folder where the command writes a file, a
    file where it owns a folder); the owned folders are looked into. Harness temporaries and locks are
    never strangers; a symbolic link is judged by its name only (:func:`find_links` refuses it)."""
    foreign, wrong_kind = [], []
    for path in sorted(folder.iterdir()):
        name = path.name
        if is_harness_name(name):
            continue
        relative = prefix + name
        if path.is_symlink():
            if not contents.ours(name):
                foreign.append(relative)
            continue
        owned, inner = contents.folder(name)
        if path.is_dir():
            if owned:
                if inner is not None:
                    more, kinds = _strangers(path, inner, relative + "/")
                    foreign += more
                    wrong_kind += kinds
            elif contents.file(name):
                wrong_kind.append(relative + "/")
            else:
                foreign.append(relative + "/")
        elif contents.file(name):
            continue
        elif owned:
            wrong_kind.append(relative)
        else:
            foreign.append(relative)
    return foreign, wrong_kind


def check_folder_path(out: Path, flag: str = "--out") -> bool:
    """Refuse ``out`` where it is a symbolic link or exists as something other than a folder; whether it
    exists. Reads only."""
    if out.is_symlink():
        raise UserError(f"{flag} {shown(out)}: is a symbolic link; give the folder it points to, or another folder")
    if not out.exists():
        return False
    if not out.is_dir():
        raise UserError(f"{flag} {shown(out)}: exists and is not a folder")
    return True


def check_folder(out: Path, contents: Contents, flag: str = "--out", remedy: str | None = None) -> None:
    """Refuse ``out`` unless it is new, or a folder holding only ``contents`` (harness temporaries and
    locks aside), each of its kind (a file where the command writes a file, a folder where it owns one),
    with nothing but their own contents in the folders it owns, and no symbolic link. Reads only.
    ``remedy`` ends a refusal of what the folder holds instead of the advice to give another folder (for a
    folder the user did not name: the workflow's)."""
    if not check_folder_path(out, flag):
        return
    foreign, wrong_kind = _strangers(out, contents)
    if wrong_kind:
        kind = "a folder" if wrong_kind[0].endswith("/") else "a file"
        raise UserError(f"{flag} {shown(out)}: {shown(wrong_kind[0].rstrip('/'))} is {kind}, where {contents.what} has "
                        f"{'a file' if kind == 'a folder' else 'a folder'}; "
                        f"{remedy or 'remove or rename it, or give another folder'}")
    if foreign:
        raise UserError(f"{flag} {shown(out)}: the folder holds files that are not {contents.what} ({shown_names(foreign)}); "
                        f"{remedy or 'give a new or empty folder'}")
    links = find_links(out)
    if links:
        raise UserError(f"{flag} {shown(out)}: holds symbolic links ({shown_names(links)}), which a write could follow out "
                        f"of the folder; {remedy or 'remove them or give another folder'}")


def remove_owned(folder: Path, contents: Contents) -> None:
    """Remove what ``contents`` names inside ``folder`` (its files, and the folders it owns with what they
    hold), harness temporaries and the lock files no process holds, then ``folder`` itself if nothing is
    left. Anything else stays where it is, and with it the folder: the harness removes only what it wrote
    (:func:`check_folder` refuses such a folder before anything is written, so this only matters if someone
    adds a file while the command runs). A lock file that a process holds (the caller's own claim of
    ``folder`` included) stays: removing it would let a second writer claim the folder beside its holder.
    The caller holds the claim of ``folder`` (:class:`Claim`), so no other process writes what it removes."""
    if folder.is_symlink() or not folder.is_dir():
        return
    for path in folder.iterdir():
        if path.is_symlink():
            continue
        owned, inner = contents.folder(path.name)
        if path.is_dir():
            if owned and inner is not None:
                remove_owned(path, inner)
        elif is_lock_name(path.name):
            _remove_unheld_lock(path)
        elif contents.file(path.name) or is_temp_name(path.name):
            path.unlink(missing_ok=True)
    try:
        folder.rmdir()
    except OSError:  # something that is not the harness's stays, and so does its folder
        pass


def remove_stale_harness_files(folder: Path) -> None:
    """Remove the files of the harness that processes which have ended left in ``folder`` (not in its
    folders): :func:`atomic_path` temporaries of process runs that have ended (:func:`~agg_bench.io.is_stale_temp`),
    and lock files no process holds. For a
    folder of files that many processes write under names of their own (a campaign's calibrations, each under
    a new name), where no later write of the same name would remove them (:func:`remove_stale_temps`). The
    caller holds a claim that covers ``folder``."""
    if folder.is_symlink() or not folder.is_dir():
        return
    for path in folder.iterdir():
        if path.is_symlink() or not path.is_file():
            continue
        if is_lock_name(path.name):
            _remove_unheld_lock(path)
        elif is_stale_temp(path.name):
            path.unlink(missing_ok=True)


def _remove_unheld_lock(path: Path) -> None:
    """Remove the lock file ``path`` if no process holds its lock: locked first and removed while locked, as
    :meth:`Claim.release` does, so a writer that opened it meanwhile finds it gone and locks a new one."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:  # held by a live process
        os.close(fd)
        return
    try:
        path.unlink(missing_ok=True)
    finally:
        os.close(fd)


NAME_MAX = 255  # bytes of one name of a path (Linux's file systems; macOS's too)
PATH_MAX = 4096  # bytes of a path a system call takes (Linux)
# bytes a name of an output gains in the names written beside it while it is written: its temporary
# (".NAME.agg-bench-tmpPID-RUN", a PID of up to 7 digits and a run token) and its lock (".NAME.agg-bench.lock"),
# the longer
SIBLING_BYTES = max(1 + len(TEMP_TAG) + 7 + 1 + RUN_TOKEN_CHARS, 1 + len(LOCK_SUFFIX))


# why an empty path names nothing of the user's: the system reads it as the current folder (`--out $DIR` with DIR
# unset trained into it), never as "none"
EMPTY_PATH = "an empty path, which names the current folder"


def path_problem(text: str) -> str | None:
    """Why the text ``text`` can name no file or folder, or None: the empty text (:data:`EMPTY_PATH`), a NUL
    character (which ends a path for the system), a character without bytes in the file system's encoding (a
    lone surrogate of a JSON string), a name of more than :data:`NAME_MAX` bytes or a path of more than
    :data:`PATH_MAX` (every system call on it fails with "File name too long"), or a first name ``~`` (a home
    folder no shell expanded: quoted, or written in a file; the path would be a folder named ``~`` in the
    current one)."""
    if text == "":
        return EMPTY_PATH
    if "\0" in text:
        return "holds a NUL character, which no file name can"
    if text == "~" or text.startswith("~/"):
        return ("starts with ~, which names the home folder only where a shell expands it (not quoted, not in a "
                "file); write the home folder's path, or ./~ for a folder named ~")
    try:
        data = os.fsencode(text)
    except UnicodeEncodeError:
        return "holds a character that has no bytes in a file name (a lone surrogate)"
    if len(data) >= PATH_MAX:
        return f"a path of {len(data):,} bytes; expected fewer than {PATH_MAX:,}"
    longest = max(data.split(b"/"), key=len)
    if len(longest) > NAME_MAX:
        return f"holds a name of {len(longest):,} bytes; expected names of at most {NAME_MAX} bytes"
    return None


def reach_problem(text: str) -> str | None:
    """Why this user cannot reach the path ``text``, or None: a folder on its way, or the folder it names, that
    this user may not search (every look at a path below it, ``Path.exists()`` among them, raises
    PermissionError). Looks only; a path that does not exist, or any other trouble, is left to its command."""
    path = Path(text)
    try:
        if path.is_dir():
            os.stat(os.path.join(path, "."))  # a look inside (pathlib drops a "." part)
    except PermissionError as err:
        # the deepest folder that can be looked at is the one that cannot be searched
        folder = next((p for p in (path, *path.parents) if _can_stat(p)), path)
        return f"cannot be reached: this user may not search the folder {shown(folder)} ({err.strerror})"
    except (OSError, ValueError):
        pass
    return None


def named_path_problem(text: str, file: bool = False) -> str | None:
    """Why the path ``text``, as the user wrote it (a flag, a config key), names nothing this user can use, or
    None: :func:`path_problem`, then :func:`reach_problem`, and for a ``file`` a path that ends with ``/`` (it
    names a folder; pathlib drops the slash, so such a path was read or written as the file it names)."""
    problem = path_problem(text) or reach_problem(text)
    if problem is None and file and text.endswith("/"):
        problem = "ends with /, which names a folder"
    return problem


def _can_stat(path: Path) -> bool:
    try:
        os.stat(path)
    except (OSError, ValueError):
        return False
    return True


def check_path_names(where: str, named) -> None:
    """Each ``(key, text)`` of ``named`` (text None: not given) a path that can name a file
    and that this user can reach (:func:`named_path_problem`); a UserError
    ``<where>.<key> '<text>': <problem>; expected a file or folder name`` for the first that cannot."""
    for key, text in named:
        problem = named_path_problem(text) if text is not None else None
        if problem is not None:
            raise UserError(f"{where}.{key} {quote(text)}: {problem}; expected a file or folder name")


def check_suffix(path: str | Path, suffix: str, flag: str = "--out") -> None:
    """Refuse a file output ``path`` whose name does not end in ``suffix`` (``.json``, ``.csv``, ``.safetensors``:
    what the verbs that read it back, and the workflow, look for; ``.tar.gz`` too); one line naming ``flag``. Reads
    nothing."""
    name = Path(path).name
    if not (name.endswith(suffix) and len(name) > len(suffix)):
        raise UserError(f"{flag} {shown(path)}: expected a FILE{suffix} path")


def check_file(path: Path, ours: Callable[[Path], bool], what: str, flag: str = "--out",
               remedy: str = "give a new path") -> None:
    """Refuse the file output ``path`` unless it is new or ``what`` (``ours(path)``): not a folder, not a link, not
    inside another command's output folder (:func:`check_not_inside_output`). ``remedy`` ends the line about
    someone else's file (for a path the user did not name, such as a cell's journal, what to do instead of
    giving another). Reads only."""
    check_not_inside_output(path, flag, file=True)
    if path.is_symlink():
        raise UserError(f"{flag} {shown(path)}: is a symbolic link; give a plain file path")
    if path.is_dir():
        raise UserError(f"{flag} {shown(path)}: is a folder; expected a file path")
    if path.exists() and not ours(path):
        raise UserError(f"{flag} {shown(path)}: the file exists and is not {what}; {remedy}")


def check_writable(path: Path, flag: str) -> None:
    """Refuse a file ``path`` that a command writes only at its end (a run's ``--done`` marker, its ``--journal``)
    when it could not be written there: a file where one of its folders goes, or a place where no file can be made
    (read-only, not ours, a pseudo file system such as /proc). Tried by making and removing at once a temporary
    file (:func:`~agg_bench.io.atomic_path`'s name, which the folders' checks ignore) in its folder, or in the
    nearest folder of it that exists; nothing else is made or touched."""
    folder = path.parent
    while not folder.exists() and not folder.is_symlink() and folder != folder.parent:
        folder = folder.parent
    if not folder.is_dir():
        raise UserError(f"{flag} {shown(path)}: {shown(folder)} is not a folder; expected a file path in a folder")
    probe = atomic_path(folder / path.name)
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    except OSError as err:
        raise UserError(f"{flag} {shown(path)}: cannot write in {shown(folder)} ({err.strerror or err}); give a path where "
                        "files can be written") from None
    os.close(fd)
    probe.unlink(missing_ok=True)


def _holder(fd: int) -> int | None:
    """The PID a lock file's holder wrote into it, or None."""
    try:
        text = os.pread(fd, 64, 0).decode("ascii", "replace").strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def writer(target: str | Path, lock_inside: bool = True) -> tuple[bool, int | None]:
    """Whether another process holds the claim of ``target`` (:class:`Claim`), and the holder's PID where its lock
    file says it. Reads only: it takes a shared lock for an instant, which
    no writer's exclusive one allows, and makes no lock file where there is none (a reader may not write
    there). Never call it on an output this process claims itself (the locks of one process conflict too)."""
    try:
        fd = os.open(lock_path(Path(target), lock_inside), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError:  # no lock file: no writer (one that starts now makes it first)
        return False, None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True, _holder(fd)
    except OSError:
        return False, None
    finally:
        os.close(fd)
    return False, None


def check_not_written(target: str | Path, what: str, lock_inside: bool = True) -> None:
    """A :class:`Busy` naming ``target`` (``what``: "run", a reader's name for it) when another process holds its
    claim (:func:`writer`): what it holds meanwhile may be part of two states, so a reader refuses it."""
    held, pid = writer(target, lock_inside)
    if held:
        holder = f" (PID {pid})" if pid is not None else ""
        raise Busy(f"{what} {shown(target)}: another agg-bench process{holder} is writing it; wait until it ends, or leave "
                   "it out", Path(target), pid)


class Claim:
    """An exclusive hold on an output (a folder or a file); use as a context manager, or ``acquire()`` and
    ``release(failed)``. ``target`` is created as a folder when ``folder`` is true and it does not exist.
    ``check`` runs again once the lock is held: another writer may have finished in between. With ``wait``,
    a second writer waits for the first to release instead of being refused (a short update of a shared file,
    such as a journal's read-modify-write)."""

    def __init__(self, target: str | Path, folder: bool, lock_inside: bool, flag: str = "--out",
                 check: Callable[[], object] | None = None, wait: bool = False):
        self.target = Path(target)
        self.folder, self.lock_inside, self.flag, self.check = folder, lock_inside, flag, check
        self.wait = wait
        if not self.target.name:
            raise UserError(f"{flag} {shown(target)}: give a named folder or file, not the current folder or a "
                            "file-system root")
        size = len(os.fsencode(self.target.name))
        if not lock_inside and size > NAME_MAX - SIBLING_BYTES:  # its lock and temporary are written beside it
            raise UserError(f"{flag} {quote(str(target))}: a name of {size} bytes; expected a name of at most "
                            f"{NAME_MAX - SIBLING_BYTES} bytes (the names written beside it while it is written, "
                            f".NAME{TEMP_TAG}PID-RUN and .NAME{LOCK_SUFFIX}, are {SIBLING_BYTES} bytes longer)")
        self.lock_path = lock_path(self.target, lock_inside)
        self._fd: int | None = None
        self._created: list[Path] = []

    def _make_folders(self) -> None:
        check_not_inside_output(self.target, self.flag, file=not self.folder)
        folder = self.target if self.lock_inside else self.target.parent
        missing = []
        for p in (folder, *folder.parents):
            if p.exists() or p.is_symlink():
                break
            missing.append(p)
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            # a file where a folder of the path goes: mkdir says only "File exists" or "Not a directory"
            blocker = next((p for p in (folder, *folder.parents) if p.exists() or p.is_symlink()), None)
            if blocker is not None and not blocker.is_dir():
                raise UserError(f"{self.flag} {shown(self.target)}: {shown(blocker)} is a file, not a folder (expected a folder "
                                "there, or nothing: missing folders are made)") from None
            raise UserError(f"{self.flag} {shown(self.target)}: cannot write in {shown(folder)} ({err.strerror or err})") from None
        self._created = missing  # deepest first

    def acquire(self) -> "Claim":
        self._make_folders()
        try:
            self._fd = self._lock()
            if self.check is not None:
                self.check()
        except BaseException:
            self.release(failed=True)
            raise
        return self

    def _lock(self) -> int:
        what = "folder" if self.folder else "file"
        # each retry follows another holder's release; a waiting writer retries until it holds the lock
        for _ in itertools.count() if self.wait else range(5):
            try:
                fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666)
            except OSError as err:
                if err.errno == errno.ELOOP:
                    raise UserError(f"{self.flag} {shown(self.target)}: {shown(self.lock_path.name)} is a symbolic link; "
                                    "remove it") from None
                raise UserError(f"{self.flag} {shown(self.target)}: cannot write in {shown(self.lock_path.parent)} "
                                f"({err.strerror or err})") from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX if self.wait else fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                pid = _holder(fd)
                os.close(fd)
                holder = f" (PID {pid})" if pid is not None else ""
                raise Busy(f"{self.flag} {shown(self.target)}: another agg-bench process{holder} is writing this "
                           f"{what}; wait until it ends or give another {what}", self.target, pid) from None
            # a holder that was releasing may have removed the file between our open and our lock
            try:
                current = os.stat(self.lock_path, follow_symlinks=False).st_ino
            except FileNotFoundError:
                current = None
            if current == os.fstat(fd).st_ino:
                os.ftruncate(fd, 0)
                os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
                stopping.at_exit_at_once(id(self), self._release_at_once)
                return fd
            os.close(fd)
        raise UserError(f"{self.flag} {shown(self.target)}: the lock {shown(self.lock_path)} keeps changing; another process "
                        "is claiming it, try again")

    def release(self, failed: bool = False) -> None:
        """Give up the hold (the lock file removed while still held, so no one locks a stale file); with
        ``failed``, remove the folders the claim made if they are still empty."""
        if self._fd is not None:
            try:
                os.unlink(self.lock_path)
            except FileNotFoundError:
                pass
            os.close(self._fd)
            self._fd = None
            stopping.at_exit_at_once(id(self), None)
        if failed:
            self._remove_created()

    def _release_at_once(self) -> None:
        """What a second signal's ``os._exit`` must not leave behind (:mod:`agg_bench.stopping`): the lock
        file, and the folders the claim made while they are still empty."""
        try:
            os.unlink(self.lock_path)
        except OSError:
            pass
        for folder in self._created:
            try:
                folder.rmdir()
            except OSError:
                break

    def _remove_created(self) -> None:
        for folder in self._created:
            try:
                folder.rmdir()  # only if empty
            except OSError:
                break
        self._created = []

    @property
    def held(self) -> bool:
        return self._fd is not None

    def __enter__(self) -> "Claim":
        return self if self.held else self.acquire()  # acquired already: under torchrun, by rank 0 alone

    def __exit__(self, exc_type, exc, tb) -> None:
        self.release(failed=exc_type is not None)


# the files that mark a folder as one command's output (each holds that command's files only): a folder output
# made inside one would be a stranger there, and the command that wrote it would refuse its own folder next time
OUTPUT_MARKS = (("an agg-bench run", ("config.json", "env.json", "metrics.jsonl")),
                ("a snapshot", ("rollout.json", "rollout.safetensors")),
                ("a profile", ("profile.json", "config.json", "env.json")),
                ("an agg-bench pretrain output", ("pretrain.json",)),
                # a report's --tables DIR and --plots DIR (outputs.STAMP_FILE and what each always holds)
                ("the tables of an agg-bench report", ("stamp.json", "records.csv", "summary.csv")),
                ("the plots of an agg-bench report", ("stamp.json", "reward_iteration.png")),
                # after a run's, whose folder holds these too: an import-log output (outputs.IMPORT_CONTENTS)
                ("an imported log", ("env.json", "metrics.jsonl", "summary.json")))


def check_not_inside_output(target: str | Path, flag: str = "--out", file: bool = False) -> None:
    """Refuse an output ``target``, a folder (or with ``file`` a file), that lies inside another command's output
    folder (one that holds every file of a mark of :data:`OUTPUT_MARKS`): for a file, its own folder is such a
    folder or lies inside one. Reads only."""
    for folder in Path(os.path.abspath(target)).parents:
        for what, names in OUTPUT_MARKS:
            if all(os.path.isfile(folder / name) for name in names):
                raise UserError(f"{flag} {quote(str(target))}: inside {what} {quote(str(folder))}; expected "
                                f"{'a file' if file else 'a folder'} outside it (its folder holds that command's "
                                "files only)")


def claim_folder(out: str | Path, contents: Contents, flag: str = "--out", replaced_whole: bool = False) -> Claim:
    """Check ``out`` (:func:`check_folder`) and return its claim, not yet acquired (``with`` acquires it).
    ``replaced_whole``: the command writes a new folder beside ``out`` and renames it over ``out``, so the
    lock lies beside it instead of inside."""
    out = Path(out)
    check = lambda: check_folder(out, contents, flag)
    check()
    return Claim(out, folder=True, lock_inside=not replaced_whole, flag=flag, check=check)


@contextmanager
def claimed_folders(folders: list[tuple[str | Path | None, Contents]], flags: tuple[str, ...] = (),
                    replaced_whole: bool = False) -> Iterator[None]:
    """Hold the claims of several folder outputs (``(folder, contents)``; a None folder is skipped, a folder
    named twice holds both contents, one inside another is a UserError), each checked before any is made.
    ``flags`` name them in errors. ``replaced_whole``: the command writes them through :func:`replaced_folders`,
    so their locks lie beside them and nothing is made but their parents."""
    merged: dict[str, tuple[Path, Contents, str]] = {}
    for i, (folder, contents) in enumerate(folders):
        if folder is None:
            continue
        key = os.path.abspath(folder)
        flag = flags[i] if i < len(flags) else "--out"
        merged[key] = (Path(folder), merged[key][1] | contents, merged[key][2]) if key in merged else \
            (Path(folder), contents, flag)
    # a folder inside another would be a folder the outer one's contents do not allow: the next command
    # writing the same outputs would refuse its own earlier output
    for outer, (outer_path, _, outer_flag) in merged.items():
        for inner, (inner_path, _, inner_flag) in merged.items():
            if inner != outer and Path(inner).is_relative_to(outer):
                raise UserError(f"{inner_flag} {quote(str(inner_path))}: is inside {outer_flag} "
                                f"{quote(str(outer_path))}; expected the same folder or folders apart")
    claims = [claim_folder(folder, contents, flag, replaced_whole) for folder, contents, flag in merged.values()]
    with ExitStack() as stack:
        for claim in claims:
            stack.enter_context(claim)
        yield


@contextmanager
def replaced_folders(*folders: str | Path | None) -> Iterator[Callable[[str | Path], Path]]:
    """New contents of ``folders`` (None skipped, a folder named twice is one) that readers see whole or not at
    all. The block writes into a temporary sibling of each (:func:`agg_bench.io.atomic_target`), given by the
    function it gets (a folder's path -> its temporary), which starts with hard links to (or copies of) the files the
    folder holds, harness temporaries and locks aside: what the block does not write again stays. When the block
    ends, each is renamed over its folder, a signal meanwhile remembered until all are
    (:func:`agg_bench.stopping.safe_points`); if it raises, or a signal stops it, they are removed and every folder
    stays as it was, so a stopped command leaves the earlier set, never a mix of the two. What killed processes left
    beside the folders goes first (:func:`agg_bench.io.remove_stale_temps`). Hold the folders' claims with their
    locks beside them (``replaced_whole``), since a lock inside would be replaced with its folder."""
    distinct = {os.path.abspath(folder): Path(folder) for folder in folders if folder is not None}
    with ExitStack() as stack:
        staged = {}
        for key, folder in distinct.items():
            remove_stale_temps(folder)
            # the files carried are hard links to the folder's own: their modes stay; what the block writes takes
            # the umask's through its own atomic writes
            tmp = stack.enter_context(atomic_target(folder, umask_modes=False))
            tmp.mkdir()
            if folder.is_dir():
                for entry in folder.iterdir():
                    if entry.is_file() and not entry.is_symlink() and not is_harness_name(entry.name):
                        _carry(entry, tmp / entry.name)
            staged[key] = tmp
        yield lambda folder: staged[os.path.abspath(folder)]
        swaps = stack.pop_all()  # the renames, taken out of the stack that removes the temporaries on a failure
    with stopping.safe_points():
        swaps.close()


def _carry(source: Path, target: Path) -> None:
    """``target`` holding what ``source`` holds: a hard link (a later write replaces the name, never the shared
    file), or a copy where the file system has none."""
    try:
        os.link(source, target, follow_symlinks=False)
    except OSError:
        shutil.copy2(source, target, follow_symlinks=False)


def claim_files(paths: dict[str | Path, tuple[Callable[[Path], bool], str]], flag: str = "--out") -> Claim:
    """Check each file of ``paths`` ({path: (ours, what)}, :func:`check_file`) and return the claim of the
    first (its companions, e.g. ``FILE.json`` beside ``FILE.safetensors``, are written under the same hold).
    Once the claim is held, the temporaries that killed writers of these files left beside them go
    (:func:`agg_bench.io.remove_stale_temps`): a killed replay's was a whole model's gradient, left for good."""
    items = [(Path(p), ours, what) for p, (ours, what) in paths.items()]

    def check() -> None:
        for path, ours, what in items:
            check_file(path, ours, what, flag)

    def check_held() -> None:
        check()
        for path, _, _ in items:
            remove_stale_temps(path)

    check()
    return Claim(items[0][0], folder=False, lock_inside=False, flag=flag, check=check_held)


def json_file_where(accept: Callable[[dict], bool]) -> Callable[[Path], bool]:
    """``ours`` for a JSON output: an existing file is ours if it is a JSON object (read bounded,
    :func:`agg_bench.jsonfiles.read_json_object`) that ``accept`` takes."""
    def ours(path: Path) -> bool:
        try:
            return accept(read_json_object(path, "a JSON object"))
        except JsonFileError:
            return False

    return ours


def json_file_with(*keys: str) -> Callable[[Path], bool]:
    """``ours`` for a JSON output: an existing file is ours if it is a JSON object holding ``keys``."""
    return json_file_where(lambda data: all(k in data for k in keys))
