"""The names module and the result readers stay light: importing them loads no torch."""
import ast
import subprocess
import sys

import pytest


@pytest.mark.parametrize("module", ["agg_bench.records", "agg_bench.results.loading",
                                    "agg_bench.results.tables", "agg_bench.results.formatting",
                                    "agg_bench.results.plots", "agg_bench.results.report",
                                    "agg_bench.results.learning_tables", "agg_bench.tools.importlog"])
def test_reading_results_imports_no_torch(module):
    # a fresh interpreter: this test process has torch loaded already
    code = f"import sys, {module}; print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", f"{module} imports torch: {out.stdout.strip()[:200]}"


def test_records_imports_only_the_standard_library():
    code = ("import sys; before = set(sys.modules); import agg_bench.records; "
            "print(sorted(m for m in set(sys.modules) - before if not m.startswith('agg_bench')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    new = ast.literal_eval(out.stdout)  # a list literal of module names
    assert not [m for m in new if m.split(".")[0] in ("torch", "numpy", "pandas", "yaml", "diffusers")], new


def test_engine_names_are_the_records_names():
    from agg_bench.machine import telemetry
    from agg_bench import records
    from agg_bench.results import plots
    from agg_bench.runtime import train

    assert train.RECORD_KEYS is records.RECORD_KEYS and train.TIMING_KEYS is records.TIMING_KEYS
    assert telemetry.TELEMETRY_KEYS is records.TELEMETRY_KEYS
    assert plots.PLOTS is records.PLOTS


def test_records_own_every_key_and_the_builder_gives_each():
    """Every key a record can hold is in records.py: what telemetry measures, the weights label; the builder
    gives a record with each of them (null where not given), in order, and keeps a method's own after."""
    from agg_bench.records import IMPORTED_KEYS, NUMBER_KEYS, RECORD_KEYS, TELEMETRY_KEYS, TEXT_KEYS, new_record

    assert set(TELEMETRY_KEYS) <= set(RECORD_KEYS) and {"weights", "gpu_util_mean", "power_mean_w"} <= set(RECORD_KEYS)
    assert len(set(RECORD_KEYS)) == len(RECORD_KEYS)
    assert set(TEXT_KEYS) | set(NUMBER_KEYS) == set(RECORD_KEYS) | set(IMPORTED_KEYS)
    record = new_record({"run_id": "a", "agg_groups": 2}, {"seed": 3}, iteration=1, source="imported")
    assert list(record)[:len(RECORD_KEYS)] == list(RECORD_KEYS) and list(record)[len(RECORD_KEYS):] == ["agg_groups",
                                                                                                       "source"]
    assert (record["run_id"], record["seed"], record["iteration"], record["weights"]) == ("a", 3, 1, None)
