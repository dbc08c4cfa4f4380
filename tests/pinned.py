"""The records that pin the engine's behaviour: every method of the embedded default (config/config.yaml) on
both tiny models at 32 px, two iterations from seed 0, in float64, and every non-timing field of their
records. `tests/integration/test_pinned_records.py` compares a fresh computation with the stored file, so that a change
meant to move code (not behaviour) shows every field it changed.

    python tests/pinned.py     # rewrite tests/data/pinned_records.json (only for an intended change)
"""
from __future__ import annotations

import json
import re
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PINNED = ROOT / "tests" / "data" / "pinned_records.json"
RESOLUTION = 32
EXTRA = [("train.iterations", 2), ("model.dtype", "float64"), ("progress", False)]
# measured, not computed: seconds, bytes, energy, power, utilisation
MEASURED = re.compile(r"^t_.*|.*_s$|.*_bytes$|^energy_j$|^power_mean_w$|^gpu_util_mean$")


def pinned_fields(record: dict) -> dict:
    """A record without what depends on the machine's speed or allocator."""
    return {k: v for k, v in record.items() if not MEASURED.match(k)}


def compute() -> dict[str, list[dict]]:
    """{run id: pinned fields of each record} for the embedded default's runs at RESOLUTION px."""
    import yaml

    from agg_bench.config import load_config
    from agg_bench.io import read_jsonl
    from agg_bench.runtime.train import train
    from agg_bench.tools.sweep import Sweep, overrides_of

    sweep = yaml.safe_load((ROOT / "config" / "config.yaml").read_text())
    sweep["base"] = str(ROOT / sweep["base"])
    sweep["resolutions"] = [RESOLUTION]
    jobs = Sweep(sweep, ROOT / "workflow" / "schemas" / "config.schema.yaml", cache_dir=None)
    out: dict[str, list[dict]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for run_id, run in jobs.runs.items():
            cfg = load_config(jobs.base_file, overrides_of([*run["pairs"], *EXTRA]))
            folder = Path(tmp) / run_id
            train(cfg, folder)
            out[run_id] = [pinned_fields(r) for r in read_jsonl(folder / "metrics.jsonl")]
    return out


if __name__ == "__main__":
    PINNED.parent.mkdir(parents=True, exist_ok=True)
    PINNED.write_text(json.dumps(compute(), indent=1, sort_keys=True) + "\n")
    print(f"wrote {PINNED}", file=sys.stderr)
