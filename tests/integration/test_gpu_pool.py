"""The file-lock GPU pool: concurrent jobs never share a device; locks die with their process."""
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from agg_bench.errors import ConfigError, UserError
from agg_bench.machine.gpus import GpuPool, default_lock_dir, visible_devices


def test_visible_devices_precedence():
    assert visible_devices({"AGG_BENCH_GPUS": "3", "CUDA_VISIBLE_DEVICES": "7"}) == ["0", "1", "2"]
    assert visible_devices({"AGG_BENCH_GPUS": "0,2,5"}) == ["0", "2", "5"]
    assert visible_devices({"CUDA_VISIBLE_DEVICES": "4,6"}) == ["4", "6"]
    assert visible_devices({"CUDA_VISIBLE_DEVICES": ""}) == []
    assert visible_devices({"CUDA_VISIBLE_DEVICES": "-1"}) == []
    # device indices or the UUIDs nvidia-smi -L shows, as CUDA_VISIBLE_DEVICES takes them
    uuids = "GPU-8a7c4b1e-2f3d-4c5b-9e6f-0a1b2c3d4e5f,MIG-0c9d7e6f-1a2b-3c4d-5e6f-7a8b9c0d1e2f"
    assert visible_devices({"AGG_BENCH_GPUS": uuids}) == uuids.split(",")
    assert visible_devices({"AGG_BENCH_GPUS": " 0"}) == []
    # anything else would be passed on as CUDA_VISIBLE_DEVICES: refused, naming the variable
    for value in ("0,,1", "abc", "0,abc", "-1", "1,1", "2000", "99999999999", "0;1"):
        with pytest.raises(UserError, match=f"environment variable AGG_BENCH_GPUS={value!r}: expected a device count"):
            visible_devices({"AGG_BENCH_GPUS": value})


def test_cuda_visible_devices_ends_at_the_first_entry_that_names_no_device():
    """As CUDA reads it: a scheduler's NoDevFiles (a job given no GPU) or a -1 in the list hides what follows, so
    a job asking for a GPU is told this machine has none, rather than locking "NoDevFiles" and failing in CUDA."""
    assert visible_devices({"CUDA_VISIBLE_DEVICES": "NoDevFiles"}) == []
    assert visible_devices({"CUDA_VISIBLE_DEVICES": "0,1,-1,2"}) == ["0", "1"]
    assert visible_devices({"CUDA_VISIBLE_DEVICES": " 2, 3"}) == ["2", "3"]
    mig = "MIG-GPU-8a7c4b1e-2f3d-4c5b-9e6f-0a1b2c3d4e5f/1/0"  # the MIG id form of drivers before R470
    assert visible_devices({"CUDA_VISIBLE_DEVICES": mig}) == [mig]


def test_inside_a_slurm_job_agg_bench_gpus_only_narrows_the_jobs_devices():
    """SLURM gives a job its devices through CUDA_VISIBLE_DEVICES; an AGG_BENCH_GPUS exported for a workstation
    (8) took precedence, and the pool handed out ids the job was not given, which the lease's CUDA_VISIBLE_DEVICES
    then showed the job. A subset of the job's ids narrows them; anything else is refused naming both variables."""
    job = {"SLURM_JOB_ID": "42", "CUDA_VISIBLE_DEVICES": "2,3"}
    assert visible_devices(job) == ["2", "3"]
    assert visible_devices({**job, "AGG_BENCH_GPUS": "3,2"}) == ["3", "2"]
    assert visible_devices({**job, "AGG_BENCH_GPUS": " "}) == ["2", "3"]
    for value, outside in (("8", "0,1,4,5,6,7"), ("0,1,2,3", "0,1"), ("2", "0,1")):
        with pytest.raises(UserError) as err:
            visible_devices({**job, "AGG_BENCH_GPUS": value})
        assert str(err.value) == (
            f"environment variable AGG_BENCH_GPUS={value!r} names device(s) {outside!r} that this SLURM job "
            "(SLURM_JOB_ID='42') was not given: its CUDA_VISIBLE_DEVICES='2,3'; expected a subset of those ids, or "
            "AGG_BENCH_GPUS unset inside the job (the job's devices)")
    # a count names ids 0 to n-1, which is a subset where SLURM numbers the job's devices from 0
    assert visible_devices({**job, "CUDA_VISIBLE_DEVICES": "0,1,2,3", "AGG_BENCH_GPUS": "2"}) == ["0", "1"]
    uuid = "MIG-0c9d7e6f-1a2b-3c4d-5e6f-7a8b9c0d1e2f"
    assert visible_devices({**job, "CUDA_VISIBLE_DEVICES": uuid, "AGG_BENCH_GPUS": uuid}) == [uuid]
    # a job given no GPU (NoDevFiles) owns none
    with pytest.raises(UserError, match="names device\\(s\\) '0' that this SLURM job"):
        visible_devices({**job, "CUDA_VISIBLE_DEVICES": "NoDevFiles", "AGG_BENCH_GPUS": "1"})
    # outside a SLURM job, or in one SLURM gave no CUDA_VISIBLE_DEVICES, AGG_BENCH_GPUS is the machine's devices
    assert visible_devices({"CUDA_VISIBLE_DEVICES": "2,3", "AGG_BENCH_GPUS": "8"}) == [str(i) for i in range(8)]
    assert visible_devices({"SLURM_JOB_ID": "42", "AGG_BENCH_GPUS": "2"}) == ["0", "1"]


def test_the_command_line_refuses_devices_outside_the_slurm_job_before_locking(tmp_path, monkeypatch, capsys):
    from agg_bench.machine import gpus

    monkeypatch.setattr(gpus.os, "execvpe", lambda *args: pytest.fail("the command ran"))
    for name, value in {"SLURM_JOB_ID": "42", "CUDA_VISIBLE_DEVICES": "0", "AGG_BENCH_GPUS": "0,1,2,3",
                        "AGG_BENCH_GPU_LOCK_DIR": str(tmp_path / "locks")}.items():
        monkeypatch.setenv(name, value)
    assert gpus.main(["--count", "1", "--", "true"]) == 2
    line, = capsys.readouterr().err.splitlines()
    assert line.startswith("agg-bench gpus: environment variable AGG_BENCH_GPUS='0,1,2,3' names device(s) '1,2,3'")
    assert "CUDA_VISIBLE_DEVICES='0'" in line
    assert not (tmp_path / "locks").exists()


def test_an_nvml_that_cannot_count_its_devices_means_none(monkeypatch):
    """A driver that initialises but fails the count (a GPU fallen off the bus) is no device, not a traceback."""
    import types

    def count():
        raise RuntimeError("NVML: Unknown Error")

    fake = types.SimpleNamespace(nvmlInit=lambda: None, nvmlShutdown=lambda: None, nvmlDeviceGetCount=count)
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    assert visible_devices({}) == []


def test_slurm_jobs_get_their_own_lock_folder(tmp_path):
    env = {"AGG_BENCH_GPU_LOCK_DIR": str(tmp_path)}
    assert default_lock_dir(env) == tmp_path
    assert default_lock_dir({**env, "SLURM_JOB_ID": "42"}) == tmp_path / "slurm-42"


def test_odd_lock_places_are_one_line(tmp_path):
    """A job id is one name inside the lock folder, whatever its text; a lock folder that cannot be made, or
    a name too long for the file system, is a UserError naming the folder, not an OSError."""
    env = {"AGG_BENCH_GPU_LOCK_DIR": str(tmp_path)}
    for job in ("../../elsewhere", "9" * 300):
        folder = default_lock_dir({**env, "SLURM_JOB_ID": job})
        assert folder.parent == tmp_path
        lease = GpuPool(["0"], folder).try_acquire(1)
        assert lease is not None
        lease.release()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["slurm-.._.._elsewhere", "slurm-" + "9" * 249]
    with pytest.raises(UserError, match="environment variable AGG_BENCH_GPU_LOCK_DIR=.*a name of 300 bytes"):
        default_lock_dir({"AGG_BENCH_GPU_LOCK_DIR": str(tmp_path / ("y" * 300))})
    (tmp_path / "file").write_text("")
    for folder in (tmp_path / "file", tmp_path / "file" / "sub"):
        with pytest.raises(UserError, match=f"GPU lock folder {folder}: cannot make or lock files there"):
            GpuPool(["0"], folder).try_acquire(1)
    lease = GpuPool(["GPU-" + "y" * 300], tmp_path / "long").try_acquire(1)  # a device id longer than a name
    assert lease is not None
    lease.release()


def test_leases_are_disjoint_until_released(tmp_path):
    pool = GpuPool(["0", "1", "2"], tmp_path)
    a = pool.try_acquire(2)
    assert a is not None and a.devices == ["0", "1"]
    assert pool.try_acquire(2) is None  # only one device left: nothing is held while refusing
    b = pool.try_acquire(1)
    assert b is not None and b.devices == ["2"]
    assert pool.try_acquire(1) is None
    a.release()
    with pool.acquire(2, timeout_s=0) as c:
        assert c.devices == ["0", "1"]
        assert c.environment() == {"CUDA_VISIBLE_DEVICES": "0,1", "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
    b.release()


def test_impossible_requests_fail_at_once(tmp_path):
    pool = GpuPool(["0", "1"], tmp_path)
    with pytest.raises(UserError, match="asks for 3 GPU"):
        pool.acquire(3)
    with pytest.raises(ConfigError, match="--count"):
        pool.acquire(0)
    held = pool.acquire(2)
    with pytest.raises(UserError, match="no 1 free GPU"):
        pool.acquire(1, timeout_s=0)
    held.release()


# Each job marks its devices in a shared folder with O_EXCL while it runs: a second holder of the same
# device at the same time finds the mark and fails, whatever the timing.
JOB = textwrap.dedent("""
    import os, sys, time
    marks, log = sys.argv[1], sys.argv[2]
    devices = os.environ["CUDA_VISIBLE_DEVICES"].split(",")
    assert os.environ["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    paths = [os.path.join(marks, d) for d in devices]
    for p in paths:
        os.close(os.open(p, os.O_CREAT | os.O_EXCL | os.O_WRONLY))  # FileExistsError: shared device
    time.sleep(0.3)
    for p in paths:
        os.unlink(p)
    with open(log, "a") as fh:
        fh.write(",".join(devices) + "\\n")
""")


def _launch(tmp_path: Path, count: int, n_devices: int, marks: Path, log: Path) -> subprocess.Popen:
    env = {**os.environ, "AGG_BENCH_GPUS": str(n_devices), "AGG_BENCH_GPU_LOCK_DIR": str(tmp_path / "locks")}
    env.pop("SLURM_JOB_ID", None)
    return subprocess.Popen(
        [sys.executable, "-m", "agg_bench.machine.gpus", "--count", str(count), "--timeout", "120", "--",
         sys.executable, "-c", JOB, str(marks), str(log)],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.mark.parametrize("count, jobs, n_devices", [(1, 6, 2), (2, 4, 3)])
def test_concurrent_jobs_never_share_a_device(tmp_path, count, jobs, n_devices):
    marks, log = tmp_path / "marks", tmp_path / "log.txt"
    marks.mkdir()
    procs = [_launch(tmp_path, count, n_devices, marks, log) for _ in range(jobs)]
    for proc in procs:
        _, err = proc.communicate(timeout=180)
        assert proc.returncode == 0, err
    leases = [line.split(",") for line in log.read_text().splitlines()]
    assert len(leases) == jobs
    for devices in leases:
        assert len(devices) == count and len(set(devices)) == count
        assert set(devices) <= {str(i) for i in range(n_devices)}
    assert list(marks.iterdir()) == []


def test_lock_is_dropped_when_the_holder_is_killed(tmp_path):
    env = {**os.environ, "AGG_BENCH_GPUS": "1", "AGG_BENCH_GPU_LOCK_DIR": str(tmp_path)}
    env.pop("SLURM_JOB_ID", None)
    holder = subprocess.Popen(
        [sys.executable, "-m", "agg_bench.machine.gpus", "--count", "1", "--",
         sys.executable, "-c", "import sys, time; print('held', flush=True); time.sleep(60)"],
        env=env, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        pool = GpuPool(["0"], tmp_path)
        assert pool.try_acquire(1) is None
    finally:
        holder.kill()
        holder.wait()
    lease = pool.try_acquire(1)
    assert lease is not None and lease.devices == ["0"]
    lease.release()


def test_command_line_reports_impossible_request(tmp_path):
    env = {**os.environ, "AGG_BENCH_GPUS": "1", "AGG_BENCH_GPU_LOCK_DIR": str(tmp_path)}
    proc = subprocess.run([sys.executable, "-m", "agg_bench.machine.gpus", "--count", "2", "--", "true"],
                          env=env, capture_output=True, text=True)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()] and "asks for 2 GPU" in proc.stderr


def test_a_negative_count_names_what_the_command_line_takes(tmp_path, monkeypatch, capsys):
    """--count 0 runs the command as is, so a negative count is refused naming >= 0, not the pool's >= 1."""
    from agg_bench.machine.gpus import main

    monkeypatch.setenv("AGG_BENCH_GPUS", "1")
    monkeypatch.setenv("AGG_BENCH_GPU_LOCK_DIR", str(tmp_path))
    assert main(["--count", "-1", "--", "true"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.splitlines() == [err] and "--count = -1: expected a number of GPUs >= 0" in err


def test_count_zero_runs_the_command_untouched(tmp_path):
    env = {**os.environ, "AGG_BENCH_GPUS": "0", "AGG_BENCH_GPU_LOCK_DIR": str(tmp_path)}
    env.pop("CUDA_VISIBLE_DEVICES", None)
    proc = subprocess.run([sys.executable, "-m", "agg_bench.machine.gpus", "--count", "0", "--", sys.executable, "-c",
                           "import os; print(os.environ.get('CUDA_VISIBLE_DEVICES', 'unset'))"],
                          env=env, capture_output=True, text=True)
    assert proc.returncode == 0 and proc.stdout.strip() == "unset"
