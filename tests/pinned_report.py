"""The tables that pin the report: every table file that `agg-bench report --tables` writes for a fixed set of
run folders, gradcheck CSVs and calibrations (built from tests/unit/test_report.py's fixtures), stored in
tests/data/report_tables/. `tests/unit/test_report.py` compares a fresh report with them byte for byte, so that a
change meant to move code (not what the tables hold) shows every cell it changed.

    python tests/pinned_report.py     # rewrite tests/data/report_tables/ (only for an intended change)
"""
from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PINNED_TABLES = ROOT / "tests" / "data" / "report_tables"
PLACEHOLDER = "<RUNS>"  # the temporary folder the run folders were built in, as written in records.csv
MIB = 1024 ** 2

# The record keys of the fixture's runs (an imported log's records hold `source` too), written out, not taken
# from the code, so that the inputs stay fixed.
FIXTURE_KEYS = (
    "run_id", "method", "model", "resolution", "device", "gpu_name", "n_gpus", "seed", "iteration",
    "reward_mean", "reward_std", "loss", "grad_norm", "clip_frac", "approx_kl",
    "t_rollout_s", "t_reward_s", "t_train_s", "t_iter_s", "images_per_s",
    "t_rollout_cpu_s", "t_reward_cpu_s", "t_train_cpu_s", "t_iter_cpu_s",
    "forward_nograd", "forward_grad", "backward", "train_forward_nograd", "train_forward_grad", "train_backward",
    "peak_alloc_bytes", "peak_reserved_bytes", "nvml_peak_used_bytes", "saved_activation_peak_bytes",
    "rss_peak_bytes", "energy_j", "status",
)


def cpu_it(t_iter: float, reward: float, t_train: float, passes: tuple[int, int, int], **extra) -> dict:
    """One iteration with CPU times (the wall clock 10 % above them) and the train phase's own passes."""
    from test_report import it

    nograd, grad, backward = passes
    fields = it(t_iter, reward, t_train, backward, **extra)
    cpu = {f"{k[:-2]}_cpu_s": v for k, v in fields.items() if k.startswith("t_") and k.endswith("_s")}
    wall = {k: 1.1 * v for k, v in fields.items() if k.startswith("t_") and k.endswith("_s")}
    return {**fields, **wall, **cpu, "forward_nograd": nograd + 8, "train_forward_nograd": nograd,
            "train_forward_grad": grad, "train_backward": backward, "reward_std": 0.25 * reward,
            "rss_peak_bytes": 40 * MIB + backward}


def build_inputs(root: Path):
    """The report's inputs under ``root``: tests/unit/test_report.py's sweep and gradcheck CSV, a calibrated pair
    timed in CPU seconds (train phases and rollouts in paired rounds), a pair on two GPUs and a
    random-weights run with its plan; returns the Manifest."""
    from agg_bench.results.loading import CalibrationEntry, GradcheckEntry, Manifest, RunEntry
    from test_report import AGG_OPTIONS, it, make_run, sweep_entries, write_gradcheck_csv

    entries = sweep_entries(root, keys=FIXTURE_KEYS)
    for entry in entries:  # the imported log's records too: FIXTURE_KEYS and its source, whatever import-log adds
        metrics = entry.dir / "metrics.jsonl"
        records = [json.loads(line) for line in metrics.read_text().splitlines()]
        if records and "source" in records[0]:
            metrics.write_text("".join(json.dumps({k: r[k] for k in (*FIXTURE_KEYS, "source")}) + "\n"
                                       for r in records))

    def run(name, method, iterations, **kwargs):
        return make_run(root / "more", name, method, iterations, keys=FIXTURE_KEYS, **kwargs)

    # a pair timed in CPU seconds at 32 px, with the calibration's unit costs and side-by-side timings (train
    # phases and rollouts; AGG samples as full does)
    entries += [
        RunEntry(run("full_cpu", "full", [cpu_it(t, r, 0.6 * t, (0, 20, 20)) for t, r in
                                          [(9.0, 0.1), (3.0, 0.2), (3.5, 0.4), (2.5, 0.5)]], resolution=32),
                 method="full", model="sd3"),
        RunEntry(run("agg_cpu", "agg", [cpu_it(t, r, 0.4 * t, (12, 8, 8), agg_groups_routed=2) for t, r in
                                        [(8.0, 0.1), (2.0, 0.3), (2.2, 0.35), (1.9, 0.6)]],
                     resolution=32, options=AGG_OPTIONS),
                 method="agg-w5", model="sd3", method_options=AGG_OPTIONS),
    ]
    calibration = root / "calibration.json"
    units = {kind: {"cpu": {"median": cost, "p25": 0.9 * cost, "p75": 1.1 * cost},
                    "wall": {"median": 1.1 * cost, "p25": cost, "p75": 1.2 * cost}}
             for kind, cost in (("forward_nograd", 0.01), ("forward_grad", 0.03), ("backward", 0.05),
                                ("optimizer_step", 0.02))}
    calibration.write_text(json.dumps({
        "model": "sd3-tiny", "resolution": 32, "device": "cpu", "unit_s_per_sample": units,
        "methods": {"full": {"cpu_s": [1.6, 1.8, 1.5, 1.7], "wall_s": [1.8, 2.0, 1.6, 1.9],
                             "rollout_cpu_s": [0.5, 0.55, 0.45, 0.6], "rollout_wall_s": [0.55, 0.6, 0.5, 0.65],
                             "rollout_forwards": 4},
                    "agg-w5": {"cpu_s": [0.9, 0.8, 1.0, 0.85], "wall_s": [1.0, 0.9, 1.1, 0.95],
                               "rollout_cpu_s": [0.52, 0.5, 0.47, 0.58], "rollout_wall_s": [0.57, 0.55, 0.52, 0.64],
                               "rollout_forwards": 4}}}))
    # the same methods on two GPUs
    for gpu, (full_s, agg_s) in {"GPU-A": (2.0, 1.0), "GPU-B": (4.0, 1.5)}.items():
        # each run's config.json and records name its method; the manifest's label is the table's row
        entries += [RunEntry(run(f"{label}_{gpu}", method,
                                 [it(seconds * k, r, backward=b, peak_alloc_bytes=int(b * MIB), energy_j=7.5,
                                     # each phase's own CUDA peak; the train phase's is the iteration's
                                     peak_alloc_rollout_bytes=int(b * MIB) // 2 + n,
                                     peak_alloc_reward_bytes=int(b * MIB) * 3 // 4, peak_alloc_train_bytes=int(b * MIB))
                                  for n, (k, r) in enumerate(((3.0, 0.0), (1.0, 0.5), (1.1, 0.7)))],
                                 device="cuda", gpu_name=gpu, n_gpus=1, resolution=256),
                             method=label, model="sd3")
                    for label, method, seconds, b in (("full", "full", full_s, 80), ("agg-w5", "agg", agg_s, 32))]
    # random weights, with the run's memory plan
    random_run = run("full_random", "full", [it(2.0, 5.0, 2.0, 80, saved_activation_peak_bytes=3 * MIB),
                                             it(2.0, 6.0, 2.0, 80)], weights="random", model="sd3.5-medium-random")
    (random_run / "plan.json").write_text(json.dumps({"bytes": {"activations": 3 * MIB, "total_per_gpu": 10 * MIB}}))
    entries.append(RunEntry(random_run))
    gradcheck = write_gradcheck_csv(root / "gc.csv", more=[
        {**AGG_OPTIONS, "method": "agg", "reuse_rollout_velocity": True, "cosine_to_full": 0.9,
         "relative_error": 0.4, "backward": 32, "seconds": 1.7},
        {"method": "cached", "cache": "fora", "cosine_to_full": 0.7, "relative_error": 0.9, "backward": 60,
         "seconds": 3.0, "cache_hit_rate": 0.25}])
    return Manifest(entries, [GradcheckEntry(gradcheck, model="sd3", resolution=64)], warmup=1, time="auto",
                    calibration=[CalibrationEntry(calibration, model="sd3")])


def compute(plots: Path | None = None) -> dict[str, str]:
    """{file name: text} of every table file the report writes for :func:`build_inputs` (and the plots
    written to ``plots``, when given)."""
    from agg_bench.cli import main
    from agg_bench.outputs import STAMP_FILE

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "inputs"
        manifest = build_inputs(root)
        manifest_file = Path(tmp) / "manifest.json"
        manifest_file.write_text(json.dumps({
            "runs": [{k: (str(v) if k == "dir" else v) for k, v in vars(e).items() if v is not None}
                     for e in manifest.runs],
            "gradcheck": [{k: (str(v) if k == "file" else v) for k, v in vars(e).items() if v is not None}
                          for e in manifest.gradcheck],
            "calibration": [{k: (str(v) if k == "file" else v) for k, v in vars(e).items() if v is not None}
                            for e in manifest.calibration],
            "warmup": manifest.warmup, "time": manifest.time}))
        tables = Path(tmp) / "tables"
        args = ["report", "--manifest", str(manifest_file), "--tables", str(tables)]
        if main(args + (["--plots", str(plots)] if plots is not None else [])) != 0:
            raise RuntimeError("agg-bench report failed on the pinned inputs")
        # the stamp's digest of the manifest covers the temporary folder's paths: not a table
        return {path.name: path.read_text().replace(str(root), PLACEHOLDER) for path in sorted(tables.iterdir())
                if not path.name.startswith(".") and path.name != STAMP_FILE}


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT / "tests" / "unit"))  # the fixtures of tests/unit/test_report.py
    PINNED_TABLES.mkdir(parents=True, exist_ok=True)
    for name, text in compute(Path(sys.argv[1]) if len(sys.argv) > 1 else None).items():
        (PINNED_TABLES / name).write_text(text)
    print(f"wrote {PINNED_TABLES}", file=sys.stderr)
