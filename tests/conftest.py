import os
import sys
from pathlib import Path

# tests/unit and tests/integration import the shared helpers (helpers.py, pinned.py, tiny_pretrained.py,
# reward_assets.py) from here
sys.path.insert(0, str(Path(__file__).resolve().parent))

# Before torch loads its OpenMP runtime, which reads them once: short OpenMP spin-waits (importing agg_bench
# sets them unless the user chose a wait: agg_bench/threads.py), and two intra-op threads, or one where
# this process may use one core only, unless OMP_NUM_THREADS says otherwise (the suite must pass at any
# thread count). Both in the environment, so the tests' subprocesses run the same way.
from agg_bench.threads import usable_cores  # first: before torch

if not os.environ.get("OMP_NUM_THREADS"):
    os.environ["OMP_NUM_THREADS"] = str(max(1, min(2, usable_cores() or 1)))

import zlib

import pytest
import torch
from helpers import SEED_STRIDE, TEST_SEED_VAR, seeded, seed_shift
from tiny_pretrained import write_tiny_pretrained


def pytest_configure(config):
    try:
        seed_shift()
    except ValueError as e:
        raise pytest.UsageError(str(e)) from None


def pytest_report_header(config):
    return f"{TEST_SEED_VAR}={seed_shift()}" if seed_shift() else None


@pytest.fixture(autouse=True)
def _shifted_global_seed(request):
    """With AGG_BENCH_TEST_SEED set, torch's global generator starts each test from a seed of that value and
    the test's name (draws a test takes from it without a seed of its own move too); unset, it is untouched."""
    if seed_shift():
        torch.manual_seed(seeded(zlib.crc32(request.node.nodeid.encode()) % SEED_STRIDE))


@pytest.fixture
def rng():
    """A fresh CPU generator seeded by test (tests/helpers.py's ``seeded``)."""
    return torch.Generator().manual_seed(seeded(1234))


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread for a whole module (``pytestmark = pytest.mark.usefixtures("one_thread")``): tiny
    models gain nothing from threads, and one thread keeps such a file fast on a busy machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """``folders(family)``: a tiny diffusers model folder of that family (tests/tiny_pretrained.py),
    written on first use in the module."""
    root = tmp_path_factory.mktemp("models")
    made = {}

    def get(family: str) -> Path:
        if family not in made:
            made[family] = write_tiny_pretrained(family, root / f"tiny-{family}", seed=seeded(0))
        return made[family]

    return get
