"""The worker of the suite's one two-process torchrun launch of the model code (the ``two_processes`` fixture of
tests/integration/conftest.py): ``python -m torch.distributed.run --nproc_per_node 2 THIS_FILE OUT PART...`` (the parts to run: fsdp, ddp, stop).

Each process of a launch imports torch and the model libraries before any work (about 6.5 CPU-seconds), so the
parts that need two processes of one launch run one after the other in this one, each in a folder of its own
under OUT: the sharded updates, resume and calibration (tests/integration/test_fsdp.py), the data-parallel runs,
gradients and out-of-memory stop (tests/integration/test_distributed.py), and the signals that stop both processes
(tests/integration/test_signals.py). They share the launch's process group (every part's ``process_group`` uses the
one that exists: a gloo group joined again after one was left may read the address the last one left), and what a
part patches (the transformer call, the rollout) is put back before the next part. A part that fails ends the
launch with its traceback, as its own launch did.
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

from agg_bench.engine.models import Policy
from agg_bench.machine import distributed
from agg_bench.runtime.session import Session


def main(out: Path, parts: list[str]) -> None:
    import test_distributed
    import test_fsdp
    import test_signals

    torch.set_num_threads(1)
    velocity, collect = Policy.velocity, Session.collect
    with distributed.process_group(torch.device("cpu")) as shard:
        assert shard.world_size == 2
        for name, part in (("fsdp", test_fsdp.two_process_part), ("ddp", test_distributed.two_process_part),
                           ("stop", test_signals.two_process_part)):
            if name not in parts:
                continue
            (out / name).mkdir(exist_ok=True)
            try:
                part(out / name)
            finally:
                Policy.velocity, Session.collect = velocity, collect


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2:])
