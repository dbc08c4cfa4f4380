"""A file-lock pool of GPUs for jobs that share one machine.

Snakemake counts GPUs (``resources: gpu=k``) but does not say which device a local job gets. A job
therefore takes its devices itself: it holds an exclusive ``flock`` on one lock file per device for as
long as it runs, and sees only those devices through ``CUDA_VISIBLE_DEVICES``. The kernel drops a
``flock`` when the holding process exits, however it exits, so a killed job never leaves a device
locked.

Which devices exist, in order of precedence:

- ``AGG_BENCH_GPUS``: a count (``"4"``: devices 0-3) or a comma list of ids (``"0,2,5"``); also how
  tests fake a machine;
- ``CUDA_VISIBLE_DEVICES`` when set (the devices a scheduler gave this process), read as CUDA reads it: up
  to the first entry that names no device (``-1``, SLURM's ``NoDevFiles``);
- NVML's device count (``nvidia-ml-py``), else none.

Inside a SLURM job (``SLURM_JOB_ID`` set) that SLURM gave devices through ``CUDA_VISIBLE_DEVICES``, those are
the job's and win: ``AGG_BENCH_GPUS`` may only narrow them, naming a subset of their ids as
``CUDA_VISIBLE_DEVICES`` names them (a count ``n`` names ids 0 to n-1). Anything else, such as an
``AGG_BENCH_GPUS=8`` exported in a shell profile for a workstation, is refused in one line naming both
variables: the pool would hand out ids the job does not own, which the job's ``CUDA_VISIBLE_DEVICES``, replaced by
the lease's, no longer hides (another job's device, or one the job's cgroup forbids).

Lock files live in ``AGG_BENCH_GPU_LOCK_DIR`` (default ``$TMPDIR/agg-bench-gpus-$USER``). Inside a
SLURM job the folder gets the job id appended: SLURM already gives each job its own devices, and two
jobs on one node may both see their (different) device as ``0``.

Command line, as the workflow uses it::

    python -m agg_bench.machine.gpus --count 2 -- torchrun --nproc_per_node 2 -m agg_bench run ...

acquires two devices (waiting while fewer are free), sets ``CUDA_VISIBLE_DEVICES`` and
``CUDA_DEVICE_ORDER=PCI_BUS_ID`` (so ids mean what ``nvidia-smi`` shows), and replaces itself with the
command, which inherits the locks. ``--count 0`` runs the command unchanged.
"""
from __future__ import annotations

import argparse
import errno
import fcntl
import getpass
import math
import os
import re
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from ..config import gpu_index, integer_arg, number_arg, read_number
from ..errors import ConfigError, OneLineParser, UserError, quote, run_command, shown
from ..outdir import NAME_MAX, path_problem

ENV_DEVICES = "AGG_BENCH_GPUS"
ENV_LOCK_DIR = "AGG_BENCH_GPU_LOCK_DIR"


def _nvml_count() -> int:
    try:
        import pynvml
    except ImportError:
        return 0
    try:
        pynvml.nvmlInit()
    except Exception:  # no driver on this machine
        return 0
    try:
        return int(pynvml.nvmlDeviceGetCount())
    except Exception:  # a driver that answers init but not the count (a GPU fallen off the bus): none known
        return 0
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:
            pass


# what CUDA_VISIBLE_DEVICES takes besides device indices: the UUIDs nvidia-smi -L shows (GPU-..., MIG-...)
_DEVICE_UUID = re.compile(r"(GPU|MIG)-[0-9A-Za-z/-]+")
MAX_DEVICES = 1024


def _is_device_id(part: str) -> bool:
    """Whether ``part`` is a device id of a list as CUDA_VISIBLE_DEVICES takes it: an index as ``cuda:N`` takes it
    (:func:`~agg_bench.config.gpu_index`: plain decimal digits, so ``017`` is no device 17), or a UUID."""
    return gpu_index(part) is not None or _DEVICE_UUID.fullmatch(part) is not None


def _parse_ids(text: str, source: str) -> list[str]:
    """The device ids of ``source``'s value ``text``: a count, or a comma list of distinct device ids; a
    UserError naming the variable otherwise (its value is passed on as CUDA_VISIBLE_DEVICES)."""
    text = text.strip()
    parts = [part.strip() for part in text.split(",")]
    count = read_number(text, int) if len(parts) == 1 else None
    if count is not None and 0 <= count <= MAX_DEVICES:
        return [str(i) for i in range(count)]
    if count is not None or not all(map(_is_device_id, parts)) or len(set(parts)) != len(parts) \
            or len(parts) > MAX_DEVICES:
        raise UserError(f"environment variable {source}={text[:80]!r}: expected a device count from 0 to "
                        f"{MAX_DEVICES} (e.g. 4) or a comma list of distinct device ids: indices in decimal digits "
                        "(e.g. 0,2,5) or the GPU-/MIG- UUIDs that nvidia-smi -L shows")
    return parts


def _cuda_devices(text: str) -> list[str]:
    """The devices CUDA sees of ``CUDA_VISIBLE_DEVICES=text``: those listed before the first entry that names none
    (set but empty, -1, or SLURM's NoDevFiles, a job given no GPU, means no GPU; 0,1,-1,2 means 0 and 1)."""
    ids = []
    for part in text.split(","):
        if not _is_device_id(part.strip()):
            break
        ids.append(part.strip())
    return ids


def visible_devices(environ: dict[str, str] | None = None) -> list[str]:
    """The device ids jobs on this machine may take (see the module docstring for the precedence, and for
    ``AGG_BENCH_GPUS`` inside a SLURM job)."""
    env = os.environ if environ is None else environ
    cuda = env.get("CUDA_VISIBLE_DEVICES")
    if env.get(ENV_DEVICES, "").strip():
        ids = _parse_ids(env[ENV_DEVICES], ENV_DEVICES)
        if env.get("SLURM_JOB_ID") and cuda is not None:
            _check_within_job(ids, env[ENV_DEVICES], cuda, env["SLURM_JOB_ID"])
        return ids
    if cuda is not None:
        return _cuda_devices(cuda)
    return [str(i) for i in range(_nvml_count())]


def _check_within_job(ids: list[str], text: str, cuda: str, job: str) -> None:
    """A UserError naming both variables unless ``ids`` (``AGG_BENCH_GPUS=text``'s) are devices of SLURM job ``job``,
    whose ``CUDA_VISIBLE_DEVICES`` is ``cuda``."""
    owned = _cuda_devices(cuda)
    outside = [device for device in ids if device not in owned]
    if outside:
        raise UserError(f"environment variable {ENV_DEVICES}={quote(text.strip())} names device(s) "
                        f"{quote(','.join(outside))} that this SLURM job (SLURM_JOB_ID={quote(job)}) was not given: "
                        f"its CUDA_VISIBLE_DEVICES={quote(cuda)}; expected a subset of those ids, or {ENV_DEVICES} "
                        "unset inside the job (the job's devices)")


def default_lock_dir(environ: dict[str, str] | None = None) -> Path:
    """The folder of the lock files (see the module docstring); a UserError naming the variable when
    ``AGG_BENCH_GPU_LOCK_DIR`` can name no folder. SLURM's job id becomes one name whatever its text: a ``/``
    in it would put the locks elsewhere, and a name too long for the file system would fail every open."""
    env = os.environ if environ is None else environ
    if env.get(ENV_LOCK_DIR):
        text = env[ENV_LOCK_DIR]
        problem = path_problem(text)
        if problem is not None:
            raise UserError(f"environment variable {ENV_LOCK_DIR}={quote(text)}: {problem}; expected a folder path")
        root = Path(text)
    else:
        try:
            user = getpass.getuser()
        except Exception:  # no passwd entry (some containers)
            user = str(os.getuid())
        root = Path(tempfile.gettempdir()) / _safe_name(f"agg-bench-gpus-{user}")
    job = env.get("SLURM_JOB_ID")
    return root / _safe_name(f"slurm-{job}") if job else root


def _safe_name(text: str) -> str:
    """``text`` as one file name: characters other than letters, digits, ``_.-`` as ``_``, at most
    :data:`~agg_bench.outdir.NAME_MAX` characters (all of them ASCII, so as many bytes)."""
    return re.sub(r"[^A-Za-z0-9_.-]", "_", text)[:NAME_MAX]


def _lock_name(device: str) -> str:
    return _safe_name(f"gpu-{device}")[:NAME_MAX - len(".lock")] + ".lock"


@dataclass
class Lease:
    """Devices held by this process; ``release`` (or leaving the ``with`` block) frees them."""

    devices: list[str]
    _fds: list[int] = field(default_factory=list, repr=False)

    @property
    def cuda_visible_devices(self) -> str:
        return ",".join(self.devices)

    def environment(self) -> dict[str, str]:
        """Variables a job needs to see exactly the leased devices, numbered as ``nvidia-smi`` does."""
        return {"CUDA_VISIBLE_DEVICES": self.cuda_visible_devices, "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}

    def keep_across_exec(self) -> None:
        """Let a program started with ``os.exec*`` inherit the locks (they end when it exits)."""
        for fd in self._fds:
            os.set_inheritable(fd, True)

    def release(self) -> None:
        for fd in self._fds:
            os.close(fd)  # closing the only descriptor drops the flock
        self._fds.clear()

    def __enter__(self) -> "Lease":
        return self

    def __exit__(self, *exc) -> None:
        self.release()


@dataclass
class GpuPool:
    """``devices`` shared by every process that uses the same ``lock_dir``."""

    devices: list[str]
    lock_dir: Path
    poll_s: float = 0.5

    @classmethod
    def from_environment(cls, environ: dict[str, str] | None = None) -> "GpuPool":
        return cls(visible_devices(environ), default_lock_dir(environ))

    def _try_lock(self, device: str) -> int | None:
        fd = os.open(self.lock_dir / _lock_name(device), os.O_RDWR | os.O_CREAT, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as err:
            os.close(fd)
            if err.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                return None
            raise
        return fd

    def try_acquire(self, count: int) -> Lease | None:
        """``count`` free devices (lowest ids first), or None without waiting when fewer are free."""
        self._check(count)
        lease = Lease([])
        try:
            self.lock_dir.mkdir(parents=True, exist_ok=True)
            for device in self.devices:
                if len(lease.devices) == count:
                    break
                fd = self._try_lock(device)
                if fd is not None:
                    lease.devices.append(device)
                    lease._fds.append(fd)
        except OSError as err:
            lease.release()
            raise UserError(f"GPU lock folder {shown(self.lock_dir)}: cannot make or lock files there "
                            f"({err.strerror or err}); set {ENV_LOCK_DIR} to a folder this user can write") from None
        if len(lease.devices) < count:
            # hold nothing while waiting, so two jobs asking for 2 of 3 devices cannot deadlock
            lease.release()
            return None
        return lease

    def acquire(self, count: int, timeout_s: float | None = None) -> Lease:
        """``count`` devices, waiting while fewer are free; a UserError after ``timeout_s`` seconds."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            lease = self.try_acquire(count)
            if lease is not None:
                return lease
            if deadline is not None and time.monotonic() >= deadline:
                raise UserError(f"no {count} free GPU(s) among {','.join(self.devices)} after {timeout_s:g} s "
                                f"(locks in {shown(self.lock_dir)})")
            time.sleep(self.poll_s)

    def _check(self, count: int) -> None:
        if count < 1:
            raise ConfigError("--count", count, "an integer >= 1")
        if count > len(self.devices):
            found = ",".join(self.devices) or "none"
            raise UserError(f"a job asks for {count} GPU(s) but this machine has {len(self.devices)} "
                            f"(devices: {found}; set {ENV_DEVICES} or CUDA_VISIBLE_DEVICES to change)")


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="python -m agg_bench.machine.gpus",
                                description="Run a command on free GPUs taken from the file-lock pool.")
    p.add_argument("--count", type=integer_arg, required=True, help="GPUs the command needs (0: run it as is)")
    p.add_argument("--timeout", type=number_arg, default=None, help="give up after this many seconds of waiting")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND [ARGS...]")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        print("agg-bench gpus: no command given (usage: --count K -- COMMAND ...)", file=sys.stderr)
        return 2
    env = dict(os.environ)

    def take_devices() -> int:
        if args.count < 0:  # the pool's own check says >= 1: it is never asked for none
            raise ConfigError("--count", args.count, "a number of GPUs >= 0 (0: run the command as is)")
        if args.timeout is not None and not (math.isfinite(args.timeout) and args.timeout >= 0):
            raise ConfigError("--timeout", args.timeout, "seconds >= 0")
        if args.count != 0:
            lease = GpuPool.from_environment().acquire(args.count, args.timeout)
            lease.keep_across_exec()
            env.update(lease.environment())
            print(f"agg-bench gpus: CUDA_VISIBLE_DEVICES={lease.cuda_visible_devices}", file=sys.stderr)
        return 0

    code = run_command("agg-bench gpus", take_devices, ["python", "-m", "agg_bench.machine.gpus", *argv])
    if code:
        return code
    sys.stderr.flush()
    try:
        os.execvpe(command[0], command, env)
    except OSError as err:
        print(f"agg-bench gpus: cannot run {command[0]!r}: {err.strerror or err}", file=sys.stderr)
        return 127


if __name__ == "__main__":
    sys.exit(main())
