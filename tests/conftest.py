import os

import pytest
import torch

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


@pytest.fixture
def rng():
    """A fresh, seeded-by-test CPU generator."""
    return torch.Generator().manual_seed(1234)
