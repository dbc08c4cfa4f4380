"""The record contract owns every record key, and the engine's names are its names. (That importing it and the
results readers loads no torch needs a fresh interpreter: tests/integration/test_fresh_interpreters.py.)"""
import pytest


def test_engine_names_are_the_records_names():
    from agg_bench.machine import telemetry
    from agg_bench import records
    from agg_bench.results import plots
    from agg_bench.runtime import train

    assert train.RECORD_KEYS is records.RECORD_KEYS and train.TIMING_KEYS is records.TIMING_KEYS
    assert telemetry.TELEMETRY_KEYS is records.TELEMETRY_KEYS
    assert plots.PLOTS is records.PLOTS


# The metric record's keys and statuses that tools outside the repository read (docs/design.md, Metric record),
# written out here: a key renamed in records.py (and everywhere it is used) is still caught.
DESIGN_RECORD_KEYS = (
    "run_id", "method", "model", "resolution", "device", "gpu_name", "n_gpus", "seed", "iteration",
    "reward_mean", "reward_std", "loss", "grad_norm", "clip_frac", "approx_kl",
    "t_rollout_s", "t_reward_s", "t_train_s", "t_iter_s", "images_per_s",
    "t_rollout_cpu_s", "t_reward_cpu_s", "t_train_cpu_s", "t_iter_cpu_s",
    "forward_nograd", "forward_grad", "backward", "train_forward_nograd", "train_forward_grad", "train_backward",
    "cost", "peak_alloc_bytes", "peak_reserved_bytes", "nvml_peak_used_bytes", "saved_activation_peak_bytes",
    "rss_peak_bytes", "energy_j", "status",
)


def test_the_record_holds_the_design_keys_and_statuses():
    from agg_bench.records import RECORD_KEYS, STATUSES

    assert [key for key in DESIGN_RECORD_KEYS if key not in RECORD_KEYS] == []
    assert {"ok", "oom", "diverged", "error", "interrupted"} <= set(STATUSES)

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


def test_only_rewards_losses_and_the_kl_estimate_may_be_negative():
    """The record contract's signs: a reward, a loss and the KL estimate may be below 0; every other number of a
    record (times, counts, sizes, norms, spreads) is not, and the image side and GPU count are integers in range."""
    from agg_bench.records import NUMBER_KEYS, SIGNED_KEYS, new_record, record_problem

    for key in SIGNED_KEYS:
        assert record_problem(new_record({key: -0.25})) is None
    for key in set(NUMBER_KEYS) - set(SIGNED_KEYS) - {"iteration", "resolution", "n_gpus"}:
        assert record_problem(new_record({key: 0})) is None, key
        assert record_problem(new_record({key: -1})) == f"{key!r} = -1: expected a finite number >= 0 or null", key
    assert record_problem(new_record(resolution=16384, n_gpus=0)) is None
    assert "expected an integer from 1 to 16,384" in record_problem(new_record(resolution=0))
    assert "expected an integer from 0 to 65,536" in record_problem(new_record(n_gpus=2.5))


@pytest.mark.filterwarnings("error::RuntimeWarning")
def test_a_run_writes_as_a_number_exactly_what_the_record_reader_takes_back():
    """The run's divergence test (an iteration's loss, an evaluation's mean) and the record reader share one
    bound: a number the run keeps is one :func:`record_problem` accepts, and one it writes as null (a divergence)
    is one the reader would refuse. A float32 is compared without numpy's overflow warning (the bound cast to
    float32)."""
    import numpy as np

    from agg_bench.records import MAX_MAGNITUDE, is_recordable_number, new_record, record_problem
    from agg_bench.runtime.evaluation import non_finite_key

    values = [0.0, -2.5, 7, np.float32(0.5), MAX_MAGNITUDE, -MAX_MAGNITUDE, 1e301, -1e301, float("nan"),
              float("inf"), -float("inf"), 10 ** 400, True, "0.5"]
    for value in values:
        kept = is_recordable_number(value)
        assert kept == (record_problem(new_record({"loss": value})) is None), value
        assert non_finite_key({"eval_reward": 0.5, "eval_reward_shape": value}) == (None if kept else
                                                                                     "eval_reward_shape"), value
    assert [is_recordable_number(v) for v in values] == [True] * 6 + [False] * 8


def test_a_value_taken_at_a_glance_is_one_the_full_check_takes():
    """record_problem takes a plain float or int within its key's bounds, and ASCII text, at a glance (a run's
    100,000 records were 30 s of checks); any other value gets the full check: for every key it checks and every
    edge value, its answer is the full check's."""
    import numpy as np

    from agg_bench.records import CHECKED_KEYS, MAX_MAGNITUDE, _value_problem, record_problem

    values = [0, 1, -1, 0.0, -0.0, 1.5, -1.5, MAX_MAGNITUDE, -MAX_MAGNITUDE, 1e301, 10**300, 10**301, 10**400,
              float("nan"), float("inf"), -float("inf"), True, False, 64, 64.0, 16384, 16385, 65536, 65537, "ok",
              "diverged", "bogus", "x", "é", "a\nb", "\t", "é\x85", "\udcff", "", [1], {"a": 1}, np.float64(1.0), np.float32(-2.0)]
    for key in CHECKED_KEYS:
        for value in values:
            assert record_problem({key: value}) == _value_problem(key, value), (key, value)
    # the first key in CHECKED_KEYS order is the one named, whichever order the record has them in
    assert record_problem({"t_iter_s": -1.0, "status": "bogus", "loss": float("nan")}).startswith("'status'")


def test_each_refusal_of_a_record_value_says_what_its_key_allows():
    """'iteration' = '1' was refused as "expected a finite number or null": iteration is an integer and, as
    status, never null in a record. Every key's refusal names its own values, and null only where it may be."""
    from agg_bench.records import MAX_MAGNITUDE, REQUIRED_RECORD_KEYS, record_problem

    assert REQUIRED_RECORD_KEYS == ("iteration", "status")
    for value in ("1", 1.5, -1, True, float("nan")):
        assert record_problem({"iteration": value}) == f"'iteration' = {value!r}: expected an integer >= 0", value
    assert record_problem({"iteration": 10**301}).endswith(f"expected an integer >= 0, at most {MAX_MAGNITUDE:g}")
    for value in (1, "paused", "a\nb", ["ok"]):
        assert record_problem({"status": value}) == \
            f"'status' = {value!r}: expected one of ok, oom, diverged, interrupted, error", value
    assert record_problem({"resolution": "64"}) == "'resolution' = '64': expected an integer from 1 to 16,384 or null"
    assert record_problem({"loss": "0.5"}) == "'loss' = '0.5': expected a finite number or null"
    assert record_problem({"t_iter_s": -1}) == "'t_iter_s' = -1: expected a finite number >= 0 or null"
    assert record_problem({"gpu_name": 3}) == "'gpu_name' = 3: expected a string or null"


def test_a_label_with_a_format_character_is_refused_naming_its_code_point():
    """A bidi override or a zero-width character made a label read differently from its bytes in every table row
    and plot legend; is_label refuses every character str.isprintable refuses, and the refusals name it."""
    from agg_bench.errors import ConfigError
    from agg_bench.records import is_label, unprintable_words
    from agg_bench.tools.importlog import check_labels

    for label in ("agg-\u202e3w", "fu\u200dll", "a\u2066b", "x\u00ad", "\ufeffrtx"):
        assert not is_label(label)
    assert unprintable_words("agg-w3") == unprintable_words(None) == ""
    assert unprintable_words("agg-\u202e3w") == "; it holds U+202E RIGHT-TO-LEFT OVERRIDE (category Cf) at character 5"
    with pytest.raises(ConfigError, match=r"^config error: --gpu-name = .*: expected 1 to 200 printable characters "
                                          r"\(a row of the report's tables\); it holds U\+200B ZERO WIDTH SPACE "
                                          r"\(category Cf\) at character 2$"):
        check_labels(None, None, gpu_name="H\u200b100")
