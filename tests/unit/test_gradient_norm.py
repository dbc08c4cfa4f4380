"""fsdp.gradient_norm over whole and sharded (DTensor) gradients, in one process of a gloo group."""

import pytest
import torch
import torch.distributed as dist

from agg_bench.machine import fsdp


@pytest.fixture
def one_process_group():
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("sharded_first", [True, False])
def test_gradient_norm_of_whole_and_sharded_gradients(one_process_group, sharded_first):
    """A whole gradient among sharded ones counts once, whichever comes first in the list."""
    from torch.distributed.tensor import Shard, distribute_tensor

    generator = torch.Generator().manual_seed(0)
    whole_grad, shard_grad = torch.randn(3, generator=generator), torch.randn(4, generator=generator)
    whole = torch.nn.Parameter(torch.zeros(3))
    whole.grad = whole_grad.clone()
    sharded = torch.nn.Parameter(distribute_tensor(torch.zeros(4), one_process_group, [Shard(0)]))
    sharded.grad = distribute_tensor(shard_grad.clone(), one_process_group, [Shard(0)])
    params = [sharded, whole] if sharded_first else [whole, sharded]

    expected = torch.cat([whole_grad, shard_grad]).double().norm()
    torch.testing.assert_close(fsdp.gradient_norm(params), expected, rtol=1e-12, atol=0)
