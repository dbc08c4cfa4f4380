import os
from pathlib import Path

import pytest
import torch
from tiny_pretrained import write_tiny_pretrained

# two intra-op threads unless OMP_NUM_THREADS says otherwise (the suite must pass at any thread count)
if "OMP_NUM_THREADS" not in os.environ:
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


@pytest.fixture
def rng():
    """A fresh, seeded-by-test CPU generator."""
    return torch.Generator().manual_seed(1234)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """``folders(family)``: a tiny diffusers model folder of that family (tests/tiny_pretrained.py),
    written on first use in the module."""
    root = tmp_path_factory.mktemp("models")
    made = {}

    def get(family: str) -> Path:
        if family not in made:
            made[family] = write_tiny_pretrained(family, root / f"tiny-{family}")
        return made[family]

    return get
