"""The training phase of each method at each resolution, and the rollout that feeds it.

Training: ``Session.update`` on one fixed collected batch, the policy version reset before every
round so each round is an iteration's first update (see ``Prepared.update``). One untimed warm-up
update (optimizer state, allocator) also yields the pass counts and the saved-activation peak (the
policy network's tensors, as in a run's records) that ``extra_info`` carries.
"""
from __future__ import annotations

import itertools

import pytest

from agg_bench.machine.telemetry import Telemetry
from cases import FULL, RESOLUTIONS, available_cases


@pytest.mark.parametrize("resolution", RESOLUTIONS)
@pytest.mark.parametrize("case", available_cases(), ids=lambda case: case.id)
def test_train_phase(benchmark, prepare, case, resolution):
    prepared = prepare(case, resolution)
    counter = prepared.session.policy.counter
    before = counter.copy()
    telemetry = Telemetry(prepared.session.device)  # counts as a run's records do: the network's tensors
    with telemetry.iteration():
        with telemetry.phase("train", saved_activations="regions"):
            prepared.update()
    telemetry.close()
    batch = prepared.batch
    benchmark.group = f"train {resolution}px"
    benchmark.extra_info.update(
        phase="train", case=case.id, method=case.method, resolution=resolution,
        device=str(prepared.session.device), batch_size=batch.batch_size,
        trained_steps_per_sample=batch.steps_per_sample,
        saved_activation_peak_bytes=telemetry.record()["saved_activation_peak_bytes"],
        **(counter - before).as_dict(),  # passes per update, per sample as PassCounter counts them
    )
    benchmark(prepared.update)


@pytest.mark.parametrize("resolution", RESOLUTIONS)
def test_rollout(benchmark, prepare, resolution):
    """``Session.collect``: the SDE rollout plus decoding and reward, everything an iteration does
    before training; ``extra_info`` splits one warm-up call into its rollout and reward time."""
    prepared = prepare(FULL, resolution)
    session = prepared.session
    iterations = itertools.count(1)

    def collect() -> None:
        session.collect(next(iterations))
        prepared.sync()

    timer = Telemetry(session.device, enabled=False)  # times only
    before = session.policy.counter.copy()
    with timer.iteration():
        session.collect(next(iterations), timer)
    times = timer.record()
    benchmark.group = "rollout"
    benchmark.extra_info.update(
        phase="rollout", method=FULL.method, resolution=resolution, device=str(session.device),
        batch_size=prepared.batch.batch_size, sampling_steps=session.cfg.sampling.steps,
        warmup_t_rollout_s=times["t_rollout_s"], warmup_t_reward_s=times["t_reward_s"],
        **(session.policy.counter - before).as_dict(),
    )
    benchmark(collect)
