"""The record contract owns every record key, and the engine's names are its names. (That importing it and the
results readers loads no torch needs a fresh interpreter: tests/integration/test_fresh_interpreters.py.)"""


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
