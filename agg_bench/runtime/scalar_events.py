"""TensorBoard events: a run's records as TensorBoard scalars in ``DIR/tensorboard/`` (``telemetry.tensorboard``).

Every record a run appends to ``metrics.jsonl`` is also written there, its numbers only: each finite int,
float or bool value (a bool as 0 or 1) becomes the scalar of its key at step = the record's iteration;
text, lists, null and non-finite values are left out, and so are the run's identity fields (the
resolution, the seed: the same in every record). The events are flushed after every record, so
``tensorboard --logdir results/runs`` shows the runs of a sweep side by side while they train. TensorBoard
keeps 32-bit floats; ``metrics.jsonl`` stays the exact record.

A resumed run appends to the same folder, starting at its first iteration with ``purge_step``: TensorBoard
drops the earlier attempt's events from that step on (the records after the checkpoint, which are
recomputed), so no step is shown twice. A run that starts over, or resumes with the option off, removes
the folder (:func:`agg_bench.runtime.runfolder.start_files`), which may hold only the writer's event files
(:data:`agg_bench.outputs.EVENTS_CONTENTS`): a folder with anything else in it refuses the run before anything is written.

The writer is torch's ``torch.utils.tensorboard.SummaryWriter``, which needs the ``tensorboard`` package
(the ``profile`` extra). It is imported only when the option is on; without it the run is refused before
anything is written (:func:`check_run`).
"""
from __future__ import annotations

import math
import numbers
from pathlib import Path
from typing import Iterable

from ..config import RunConfig
from ..errors import ConfigError
from ..outputs import EVENTS_FOLDER

FOLDER = EVENTS_FOLDER  # inside the run folder; what the writer puts there: agg_bench.outputs.EVENTS_CONTENTS


def _summary_writer_class() -> type:
    """torch's SummaryWriter, or the ConfigError that says what ``telemetry.tensorboard: true`` needs."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as exc:
        raise ConfigError("telemetry.tensorboard", True,
                          f"false, or the tensorboard package installed: pip install 'agg-bench[profile]' "
                          f"(importing torch.utils.tensorboard failed: {exc})") from None
    return SummaryWriter


def check_run(cfg: RunConfig) -> None:
    """Raise a ConfigError when ``telemetry.tensorboard`` is on and no writer can be imported, before
    anything is written."""
    if cfg.telemetry.tensorboard:
        _summary_writer_class()


def scalars(record: dict, skip: Iterable[str] = ()) -> dict[str, float]:
    """The record's finite int, float and bool values as floats, keys of ``skip`` left out."""
    left_out = set(skip)
    return {key: float(value) for key, value in record.items()
            if key not in left_out and isinstance(value, numbers.Real) and math.isfinite(value)}


class TensorBoardEvents:
    """The scalar events of one run attempt in ``run_folder/tensorboard/``; its first record is that of
    ``first_iteration`` (events of that step and later from an earlier attempt are purged). ``skip``: the
    record keys that are no curve (the run's identity; the iteration is the step)."""

    def __init__(self, run_folder: Path, first_iteration: int, skip: Iterable[str] = ()):
        self.skip = {"iteration", *skip}
        self._writer = _summary_writer_class()(log_dir=str(Path(run_folder) / FOLDER), purge_step=first_iteration)

    def write(self, record: dict) -> None:
        """Add the record's scalars at its iteration and flush them to disk."""
        for key, value in scalars(record, self.skip).items():
            self._writer.add_scalar(key, value, record["iteration"])
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()

    def __enter__(self) -> "TensorBoardEvents":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
