"""Table builders on synthetic run folders with known numbers -> known cells; plots exist."""
import contextlib
import csv
import io
import json
import math
import os
import re
import warnings
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from agg_bench.cli import main
from agg_bench.errors import UserError
from agg_bench.io import JsonlWriter
from agg_bench.reading import RunFolder
from agg_bench.records import PLOT_TABLES, PLOTS, RECORD_KEYS, TABLES
from agg_bench.results.formatting import to_markdown
from agg_bench.results.loading import (GradcheckEntry, Manifest, RunEntry, discover_runs, load_gradcheck,
                                       load_records)
from agg_bench.results.report import build_report
from agg_bench.results.tables import ablation_table, efficiency_table, gpus_table, mean_reward_until
from agg_bench.tools.importlog import import_log

MIB = 1024 ** 2


def make_run(root: Path, name: str, method: str, iterations: list[dict], status: str = "ok",
             options: dict | None = None, keys: tuple[str, ...] = RECORD_KEYS, config: bool = True,
             **identity) -> Path:
    """A run folder as `agg-bench run` writes it, with the given per-iteration fields (every record holds
    ``keys``, null where not given); ``method`` is a method of the harness, which its ``config.json`` names. With
    ``config=False`` it has no ``config.json``, as an imported log's folder, whose ``method`` is a label."""
    run = root / name
    run.mkdir(parents=True)
    base = {"run_id": name, "method": method, "model": "sd3-tiny", "resolution": 64, "device": "cpu",
            "gpu_name": None, "n_gpus": 0, "seed": 0, **identity}
    with JsonlWriter(run / "metrics.jsonl") as writer:
        for i, fields in enumerate(iterations):
            record = dict.fromkeys(keys)
            record.update(base, iteration=i, status="ok")
            record.update(fields)
            writer.write(record)
    (run / "summary.json").write_text(json.dumps({"run_id": name, "status": status, **base}))
    if config:
        (run / "config.json").write_text(json.dumps({"method": options or {"name": method}}))
    return run


def it(t_iter, reward, t_train=None, backward=None, **extra):
    """One iteration's fields; rollout/reward phases split the rest of t_iter 3:1."""
    t_train = t_iter / 2 if t_train is None else t_train
    rest = t_iter - t_train
    return {"t_iter_s": t_iter, "t_train_s": t_train, "t_rollout_s": 0.75 * rest, "t_reward_s": 0.25 * rest,
            "reward_mean": reward, "backward": backward, "forward_grad": backward, **extra}


AGG_OPTIONS = {"name": "agg", "window": 5, "alpha": "sigma", "route_frac": 1.0, "reuse_rollout_velocity": False}


@pytest.fixture
def sweep(tmp_path):
    """full and agg at 64 px (two seeds of full), an OOM and a diverged agg cell, one imported log."""
    return sweep_entries(tmp_path)


def sweep_entries(tmp_path: Path, keys: tuple[str, ...] = RECORD_KEYS) -> list[RunEntry]:
    """The runs of the ``sweep`` fixture under ``tmp_path`` (their records holding ``keys``)."""
    runs = tmp_path / "runs"

    def run(name, method, iterations, **kwargs):
        return make_run(runs, name, method, iterations, keys=keys, **kwargs)

    entries = [
        RunEntry(run("full_s0", "full", [it(10.0, 0.0, 4.0, 80, saved_activation_peak_bytes=8 * MIB),
                                         it(2.0, 1.0, 1.5, 80), it(2.0, 2.0, 1.5, 80)]),
                 method="full", model="sd3", seed=0),
        RunEntry(run("full_s1", "full", [it(10.0, 0.0, 4.0, 80), it(4.0, 1.0, 1.5, 80), it(4.0, 3.0, 1.5, 80)],
                     seed=1),
                 method="full", model="sd3", seed=1),
        RunEntry(run("agg", "agg", [it(10.0, 0.0, 4.0, 32, agg_groups_routed=4),
                                    it(1.0, 2.0, 0.5, 32, agg_groups_routed=4),
                                    it(1.0, 4.0, 0.5, 32, agg_groups_routed=2)], options=AGG_OPTIONS),
                 method="agg-w5", model="sd3", method_options=AGG_OPTIONS),
        RunEntry(run("agg_big", "agg", [{"status": "oom", "peak_alloc_bytes": 3 * MIB}], status="oom", resolution=128),
                 method="agg-w5", model="sd3"),
        RunEntry(run("full_big", "full", [it(3.0, 1.0, 2.0, 80), it(3.0, 1.0, 2.0, 80)], resolution=128),
                 method="full", model="sd3"),
        RunEntry(run("window_big", "window", [it(6.0, 1.0, 1.0, 16), it(6.0, 2.0, 1.0, 16),
                                              {**it(6.0, float("nan"), 1.0, 16), "status": "diverged"}],
                     status="diverged", resolution=128), method="window", model="sd3"),
    ]
    log = tmp_path / "dancegrpo.jsonl"
    log.write_text("".join(json.dumps({"step": s, "avg_reward": r, "step_time": t, "grad_norm": 0.1}) + "\n"
                           for s, r, t in [(1, 0.5, 30.0), (2, 0.6, 20.0), (3, 0.8, 22.0)]) + '{"step": 4, "avg')
    import_log(log, tmp_path / "imported" / "ref", method="dancegrpo", model="flux", resolution=720,
               gpu_name="NVIDIA H800", n_gpus=8)
    entries.append(RunEntry(tmp_path / "imported" / "ref"))
    return entries


def cell(table, method, resolution, source="measured"):
    rows = table[(table["method"] == method) & (table["resolution"] == resolution) & (table["source"] == source)]
    assert len(rows) == 1, rows
    return rows.iloc[0]


def test_efficiency_cells_from_known_numbers(sweep):
    table = efficiency_table(load_records(sweep), warmup=1)
    full, agg = cell(table, "full", 64), cell(table, "agg-w5", 64)
    # seeds averaged after the warm-up iteration: full (2 + 4) / 2 = 3 s, agg 1 s
    assert full["seeds"] == 2 and full["t_iter_s"] == pytest.approx(3.0, abs=1e-12)
    assert agg["t_iter_s"] == pytest.approx(1.0, abs=1e-12)
    assert full["speedup"] == pytest.approx(1.0, abs=1e-12)
    assert agg["speedup"] == pytest.approx(3.0, abs=1e-12)
    assert agg["train_speedup"] == pytest.approx(3.0, abs=1e-12)  # 1.5 s / 0.5 s
    assert agg["t_rollout_s"] == pytest.approx(0.375, abs=1e-12) and agg["t_reward_s"] == pytest.approx(0.125, abs=1e-12)
    assert (full["backward"], agg["backward"]) == (80, 32)
    assert full["saved_act_mib"] == pytest.approx(8.0, abs=1e-12)
    assert agg["final_reward"] == 4.0 and full["final_reward"] == pytest.approx(2.5, abs=1e-12)
    assert agg["agg_groups_routed"] == pytest.approx(10 / 3, abs=1e-12)  # a method extra, averaged per run
    # images/s was not measured: empty, not 0
    assert math.isnan(agg["images_per_s"])


def test_a_cell_with_a_diverged_seed_counts_the_seeds_it_averages(tmp_path):
    """A seed that diverged beside an ok one: the row averaged the ok run alone but counted both seeds."""
    runs = tmp_path / "runs"
    entries = [RunEntry(make_run(runs, "full_s0", "full", [it(10.0, 0.0), it(2.0, 1.0), it(2.0, 3.0)]),
                        method="full", model="sd3", seed=0),
               RunEntry(make_run(runs, "full_s1", "full", [it(10.0, 0.0), {**it(8.0, math.nan), "status": "diverged"}],
                                 status="diverged", seed=1), method="full", model="sd3", seed=1)]
    row = cell(efficiency_table(load_records(entries), warmup=1), "full", 64)
    assert (row["status"], row["seeds"], row["iterations"]) == ("diverged", 1, 3)
    assert row["t_iter_s"] == pytest.approx(2.0, abs=1e-12) and row["final_reward"] == 3.0


def test_reward_area_uses_the_shortest_run_as_horizon():
    # curve through (0, r0), (end of iteration i, r_i); mean over [0, 1.5]
    assert mean_reward_until([1.0, 2.0, 3.0], [0.0, 1.0, 2.0], 1.5) == pytest.approx(0.125 / 1.5, abs=1e-12)
    assert mean_reward_until([0.5, 1.0, 1.5], [0.0, 2.0, 4.0], 1.5) == pytest.approx(2.0 / 1.5, abs=1e-12)
    assert math.isnan(mean_reward_until([0.5], [1.0], 1.5))  # a run shorter than the horizon has no value


def test_reward_area_cells(sweep):
    table = efficiency_table(load_records(sweep[:1] + sweep[2:3]))
    # full_s0 ends at 10, 12, 14 s; agg at 10, 11, 12 s -> horizon 12 s
    full_expected = (10 * 0.0 + 2 * (0.0 + 1.0) / 2) / 12
    agg_expected = (10 * 0.0 + 1 * (0.0 + 2.0) / 2 + 1 * (2.0 + 4.0) / 2) / 12
    assert cell(table, "full", 64)["reward_area"] == pytest.approx(full_expected, abs=1e-12)
    assert cell(table, "agg-w5", 64)["reward_area"] == pytest.approx(agg_expected, abs=1e-12)


def test_oom_and_diverged_cells(sweep):
    table = efficiency_table(load_records(sweep))
    oom, diverged = cell(table, "agg-w5", 128), cell(table, "window", 128)
    assert oom["status"] == "oom" and math.isnan(oom["speedup"]) and math.isnan(oom["t_iter_s"])
    assert oom["peak_alloc_mib"] == pytest.approx(3.0, abs=1e-12)  # memory at the failure is kept
    assert diverged["status"] == "diverged" and math.isnan(diverged["speedup"])
    assert diverged["t_iter_s"] == pytest.approx(6.0, abs=1e-12) and diverged["final_reward"] == 2.0
    md = to_markdown(table).splitlines()
    header = [c.strip() for c in md[0].strip("|").split("|")]
    rows = {tuple(c.strip() for c in line.strip("|").split("|")[:3]): line for line in md[2:]}
    oom_cells = [c.strip() for c in rows[("agg-w5", "sd3", "128")].strip("|").split("|")]
    assert oom_cells[header.index("speedup")] == "OOM" and oom_cells[header.index("t_iter_s")] == "OOM"
    assert oom_cells[header.index("status")] == "oom"
    div_cells = [c.strip() for c in rows[("window", "sd3", "128")].strip("|").split("|")]
    assert div_cells[header.index("speedup")] == "DIVERGED" and div_cells[header.index("t_iter_s")] == "6"
    ok_cells = [c.strip() for c in rows[("agg-w5", "sd3", "64")].strip("|").split("|")]
    assert ok_cells[header.index("speedup")] == "3.00x" and ok_cells[header.index("images_per_s")] == "—"


def test_imported_rows_are_labelled(sweep):
    table = efficiency_table(load_records(sweep))
    ref = cell(table, "dancegrpo", 720, source="imported")
    assert ref["hardware"] == "8x NVIDIA H800" and ref["status"] == "ok"
    assert ref["iterations"] == 3  # the torn last line of the log is skipped
    imported = [json.loads(line) for line in (sweep[-1].dir / "metrics.jsonl").read_text().splitlines()]
    assert [list(r) for r in imported] == [[*RECORD_KEYS, "source"]] * 3  # every record key, then its source
    assert ref["t_iter_s"] == pytest.approx(21.0, abs=1e-12) and ref["final_reward"] == 0.8
    assert math.isnan(ref["speedup"])  # no `full` run in its group
    assert table.iloc[-1]["source"] == "imported"  # after the measured rows
    assert "| dancegrpo (imported) | flux | 720 |" in to_markdown(table)


def test_import_log_names_a_missing_key(tmp_path):
    log = tmp_path / "bad.jsonl"
    log.write_text(json.dumps({"step": 1, "avg_reward": 0.5, "grad_norm": 1.0}) + "\n")
    with pytest.raises(UserError, match="'step_time'"):
        import_log(log, tmp_path / "out")
    assert main(["import-log", str(log), "--out", str(tmp_path / "out")]) == 2


GOOD_STEP = {"step": 0, "avg_reward": 0.5, "step_time": 2.0, "grad_norm": 1.0}


def import_refused(capsys, tmp_path, text: str) -> str:
    """``agg-bench import-log`` of a log holding ``text``: exit 2, one stderr line, no folder written."""
    log, out = tmp_path / "log.jsonl", tmp_path / "out"
    log.write_text(text)
    capsys.readouterr()
    code = main(["import-log", str(log), "--out", str(out)])
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and "Traceback" not in lines[0], lines
    assert not out.exists()
    return lines[0]


@pytest.mark.parametrize("fields, words", [
    ({"loss": "abc"}, "'loss' = 'abc': expected a finite number or null"),
    ({"reward_std": "x"}, "'reward_std' = 'x': expected a finite number >= 0 or null"),
    ({"t_rollout_s": -3}, "'t_rollout_s' = -3: expected a finite number >= 0 or null"),
    ({"step_time": -1.5}, "'step_time' = -1.5: expected a finite number >= 0 or null"),
    ({"forward_grad": 10**400}, "'forward_grad' = 1000000"),  # an OverflowError in math.isfinite
    ({"weights": 5}, "'weights' = 5: expected a string or null"),
    ({"step": 10**30}, "'step' = 1000000000000000000000000000000: expected an integer >= 0 (at most 1,000,000,000)"),
])
def test_import_log_checks_every_record_by_the_record_contract(tmp_path, capsys, fields, words):
    """Values the record contract refuses were copied into metrics.jsonl (exit 0), and `report` then refused
    the folder the import wrote; a negative time or a 30-digit step went through."""
    text = json.dumps(GOOD_STEP) + "\n" + json.dumps({**GOOD_STEP, "step": 1, **fields}) + "\n"
    line = import_refused(capsys, tmp_path, text)
    assert "log.jsonl line 2: " in line and words in line, line


@pytest.mark.parametrize("text, words", [
    ('{"step": 1, "avg_reward": 0.5, "step_time": NaN, "grad_norm": 1.0}\n', "line 2: 'step_time' = nan: expected"),
    ('{"step": 1, "avg_reward": 0.5, "step_time": -Infinity, "grad_norm": 1.0}\n', "line 2: 'step_time' = -inf"),
    ('{"step": 1, "avg_reward": 0.5, "step_time": 1e400, "grad_norm": 1.0}\n', "line 2: 'step_time' = inf"),
    ('{"step": 1, "avg_reward": 0.5, "step_time": 1.0, "grad_norm": 1.0, "t_rollout_s": NaN}',
     "line 2: 't_rollout_s' = nan: expected a finite number >= 0 or null"),
    ('\n\n{"step": 1, "avg_reward": 0.5, "step_time": "slow", "grad_norm": 1.0}\n', "line 4: 'step_time'"),
])
def test_import_log_refuses_numbers_that_are_not_finite(tmp_path, capsys, text, words):
    """A time or a count that is not finite is refused (it does not diverge: a broken log), also on a last line
    without a newline (whole JSON to Python: not taken for a torn line); blank lines counted out of the line
    numbers."""
    line = import_refused(capsys, tmp_path, json.dumps(GOOD_STEP) + "\n" + text)
    assert words in line, line


@pytest.mark.parametrize("value, key", [("NaN", "avg_reward"), ("Infinity", "grad_norm"), ("-Infinity", "loss"),
                                        ("1e400", "avg_reward")])
def test_an_imported_log_that_diverged_is_a_diverged_run(tmp_path, capsys, value, key):
    """A DanceGRPO log written by json.dumps holds NaN where the run diverged, and goes on: the import ends at
    that line as agg-bench run ends a run that diverges (its record diverged with the value as null, the
    summary diverged and why), the lines after it left out and counted on stderr; report reads it (the log was
    refused before)."""
    from agg_bench.reading import RunFolder

    name = {"avg_reward": "reward_mean"}.get(key, key)
    steps = [json.dumps({**GOOD_STEP, "step": s, "loss": 0.1}) for s in range(2)]
    line = {**GOOD_STEP, "step": 2, "loss": 0.1, key: "VALUE"}
    broken = json.dumps(line).replace('"VALUE"', value)  # as json.dumps writes a float that is not finite
    assert value in broken
    after = [broken.replace('"step": 2', f'"step": {s}') for s in (3, 4)]
    log = tmp_path / "log.jsonl"
    log.write_text("\n".join([*steps, broken, *after]) + "\n")
    capsys.readouterr()
    assert main(["import-log", str(log), "--out", str(tmp_path / "out")]) == 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"non-finite {name} at iteration 2" in err[0] and "2 lines after it left out" in err[0]
    run = RunFolder(tmp_path / "out")
    records = run.records(required=("iteration", "status"))
    assert [(r["iteration"], r["status"]) for r in records] == [(0, "ok"), (1, "ok"), (2, "diverged")]
    assert records[2][name] is None and records[1][name] is not None
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert (summary["status"], summary["last_good_iteration"], summary["iterations"], summary["error"]) == \
        ("diverged", 1, 3, f"non-finite {name} at iteration 2")
    assert main(["report", "--runs", str(tmp_path / "out"), "--tables", str(tmp_path / "tables")]) == 0
    assert pd.read_csv(tmp_path / "tables" / "efficiency.csv")["status"].tolist() == ["diverged"]


def test_an_imported_log_that_diverged_at_its_last_line_or_one_before(tmp_path, capsys):
    """The stderr line counts the lines left out in words that fit (one line, none: no note)."""
    good = json.dumps(GOOD_STEP)
    nan = json.dumps({**GOOD_STEP, "step": 1, "avg_reward": "NAN"}).replace('"NAN"', "NaN")
    for name, lines, note in (("one", [good, nan, nan.replace('"step": 1', '"step": 2')], "(the 1 line after it"),
                              ("none", [good, nan], None)):
        log = tmp_path / f"{name}.jsonl"
        log.write_text("\n".join(lines) + "\n")
        capsys.readouterr()
        assert main(["import-log", str(log), "--out", str(tmp_path / name)]) == 0
        err = capsys.readouterr().err.strip().splitlines()
        assert (err == []) if note is None else (len(err) == 1 and note in err[0]), err


def test_a_long_import_prints_its_progress_on_stderr(tmp_path, capsys, monkeypatch):
    """An import of a log of a million lines took a minute with nothing printed: stderr gets a line as lines are
    read (checked and written as they are), at most one every PROGRESS_EVERY_S seconds (a quick import prints none,
    as the tests above check); stdout keeps its one JSON line and the folder is the same."""
    from agg_bench import errors
    from agg_bench.tools import importlog

    log = tmp_path / "log.jsonl"
    log.write_text("".join(json.dumps({**GOOD_STEP, "step": s}) + "\n" for s in range(5)))
    assert main(["import-log", str(log), "--out", str(tmp_path / "quiet")]) == 0
    assert capsys.readouterr().err == ""
    monkeypatch.setattr(errors, "PROGRESS_EVERY_S", 0.0)
    monkeypatch.setattr(importlog, "PROGRESS_LINES", 2)
    assert main(["import-log", str(log), "--out", str(tmp_path / "out")]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out) == {"out": str(tmp_path / "out"), "iterations": 5, "status": "ok"}
    size = len(json.dumps(GOOD_STEP)) + 1  # each line's bytes
    expected = [f"read 2 lines, {2 * size} of {5 * size} bytes", f"read 4 lines, {4 * size} of {5 * size} bytes"]
    lines = err.splitlines()
    assert len(lines) == len(expected) and all(re.fullmatch(rf"agg-bench import-log: {what} \(\d+\.\d s\)", line)
                                               for what, line in zip(expected, lines)), lines
    assert (tmp_path / "out" / "metrics.jsonl").read_text() == \
        (tmp_path / "quiet" / "metrics.jsonl").read_text().replace('"quiet"', '"out"')


def test_an_import_writes_each_chunk_of_the_log_before_it_reads_the_next(tmp_path, monkeypatch):
    """An import held every record of the log before it wrote one: a log of a million lines took 2.4 GB. It reads,
    checks and writes CHUNK_LINES lines at a time, so the records of a chunk are written before the next line of
    the log is read; the folder is the one an import of the log in one chunk writes."""
    from agg_bench import jsonfiles
    from agg_bench.tools import importlog

    log = tmp_path / "log.jsonl"
    log.write_text("".join(json.dumps({**GOOD_STEP, "step": s}) + "\n" for s in range(10)))
    import_log(log, tmp_path / "whole")
    written: list[int] = []  # the steps formatted for metrics.jsonl, in order
    at_read: list[int] = []  # how many were, at each read of the log
    from helpers import watched_open

    real_line = JsonlWriter.line
    Watched = watched_open(lambda: at_read.append(len(written)))  # each read of the log

    class Writer(JsonlWriter):
        @staticmethod
        def line(record):
            written.append(record["iteration"])
            return real_line(record)

    monkeypatch.setattr(importlog, "CHUNK_LINES", 2, raising=False)  # an import holding the whole log has none
    monkeypatch.setattr(jsonfiles, "open_regular", Watched)
    monkeypatch.setattr(importlog, "JsonlWriter", Writer)
    import_log(log, tmp_path / "chunks", run_id="whole")
    assert at_read[:10] == [0, 0, 2, 2, 4, 4, 6, 6, 8, 8] and written == list(range(10)), at_read
    assert (tmp_path / "chunks" / "metrics.jsonl").read_bytes() == (tmp_path / "whole" / "metrics.jsonl").read_bytes()


def test_an_imported_log_is_what_report_reads(tmp_path, capsys):
    """Record keys of the log that may be negative (loss, approx_kl) are kept; the folder reads back through
    the one reader of run folders. A torn last line is left out and stderr says so."""
    from agg_bench.reading import RunFolder

    log = tmp_path / "log.jsonl"
    log.write_text(json.dumps({**GOOD_STEP, "loss": -0.25, "approx_kl": -1e-3, "t_rollout_s": 1.5}) + "\n"
                   + json.dumps({**GOOD_STEP, "step": 3, "grad_norm": None}) + "\n" + '{"step": 4, "avg_rew')
    capsys.readouterr()
    assert main(["import-log", str(log), "--out", str(tmp_path / "out")]) == 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "log.jsonl line 3: left out, not a whole JSON line" in err[0], err
    records = RunFolder(tmp_path / "out").records(required=("iteration", "status"))
    assert [(r["iteration"], r["loss"], r["approx_kl"], r["grad_norm"]) for r in records] == \
        [(0, -0.25, -1e-3, 1.0), (3, None, None, None)]
    assert main(["report", "--runs", str(tmp_path / "out"), "--tables", str(tmp_path / "tables")]) == 0


@pytest.fixture
def gradcheck_csv(tmp_path):
    return write_gradcheck_csv(tmp_path / "gc.csv")


def write_gradcheck_csv(path: Path, more: list[dict] = ()) -> Path:
    """A gradcheck CSV of sd3: full and three AGG rows (and ``more``)."""
    rows = [
        {"method": "full", "cosine_to_full": 1.0, "relative_error": 0.0, "backward": 80, "seconds": 4.0},
        {**AGG_OPTIONS, "method": "agg", "cosine_to_full": 0.9, "relative_error": 0.4, "backward": 32, "seconds": 2.0},
        {**AGG_OPTIONS, "method": "agg", "alpha": "index", "cosine_to_full": 0.8, "relative_error": 0.6,
         "backward": 32, "seconds": 2.5},
        {**AGG_OPTIONS, "method": "agg", "window": 3, "cosine_to_full": 0.95, "relative_error": 0.3,
         "backward": 48, "seconds": 3.2},
        *more,
    ]
    pd.DataFrame([{k: v for k, v in r.items() if k != "name"} | {"model": "sd3"} for r in rows]).to_csv(path, index=False)
    return path


def test_gradient_cosine_matches_options(sweep, gradcheck_csv):
    gradcheck = load_gradcheck([GradcheckEntry(gradcheck_csv, model="sd3", resolution=64)])
    table = efficiency_table(load_records(sweep), gradcheck)
    assert cell(table, "agg-w5", 64)["grad_cosine"] == 0.9
    assert cell(table, "agg-w5", 64)["grad_rel_error"] == 0.4
    assert cell(table, "full", 64)["grad_cosine"] == 1.0
    assert math.isnan(cell(table, "full", 128)["grad_cosine"])  # no gradcheck at 128 px
    # options that fit two rows (alpha left out) match neither
    ambiguous = load_records([RunEntry(sweep[2].dir, method="agg-w5", model="sd3",
                                       method_options={"name": "agg", "window": 5})])
    assert math.isnan(efficiency_table(ambiguous, gradcheck).iloc[0]["grad_cosine"])


def test_ablation_relative_to_full(gradcheck_csv):
    table = ablation_table(load_gradcheck([GradcheckEntry(gradcheck_csv, model="sd3", resolution=64)]))
    assert list(table["method"]) == ["full", "agg", "agg", "agg"]
    w5 = table[(table["window"] == 5) & (table["alpha"] == "sigma")].iloc[0]
    assert w5["backward_vs_full"] == pytest.approx(0.4, abs=1e-12)
    assert w5["speedup_vs_full"] == pytest.approx(2.0, abs=1e-12)
    assert list(table["window"].iloc[1:]) == [3, 5, 5]


def test_gpus_table_pivots_by_gpu_name(tmp_path):
    entries = [
        RunEntry(make_run(tmp_path, f"{m}_{g}", m, [it(t, 0.0), it(t, 1.0)], device="cuda", gpu_name=g, n_gpus=1),
                 method=m, model="sd3")
        for m, g, t in [("full", "GPU-A", 2.0), ("agg", "GPU-A", 1.0), ("full", "GPU-B", 4.0), ("agg", "GPU-B", 1.0)]
    ]
    table = gpus_table(efficiency_table(load_records(entries)))
    assert len(table) == 2
    agg = table[table["method"] == "agg"].iloc[0]
    assert agg["speedup [GPU-A]"] == pytest.approx(2.0, abs=1e-12)
    assert agg["speedup [GPU-B]"] == pytest.approx(4.0, abs=1e-12)
    assert agg["t_iter_s [GPU-B]"] == pytest.approx(1.0, abs=1e-12)


def test_markdown_escapes_and_marks_empty_cells():
    df = pd.DataFrame([{"method": "a|b", "status": "ok", "x": float("nan"), "source": "measured"}])
    assert to_markdown(df).splitlines()[2] == "| a\\|b | ok | — | measured |"
    # a label from a shared run folder is text in every cell, the gpus table's column names included: a pipe in a
    # column name split the header, a backslash before a pipe escaped the escape, and HTML was rendered as markup
    df = pd.DataFrame([{"method": "x\\|y", "t_iter_s [<img src=x onerror=alert(1)>|a]": "<b>&amp;",
                        "status": "ok"}])
    header, _, row = to_markdown(df).splitlines()
    assert header == "| method | t_iter_s [&lt;img src=x onerror=alert(1)&gt;\\|a] | status |"
    assert row == "| x\\\\\\|y | &lt;b&gt;&amp;amp; | ok |"


@pytest.fixture(scope="module")
def sweep_report(tmp_path_factory) -> tuple[Path, list[RunEntry], Path]:
    """The ``sweep`` runs and the ``gradcheck_csv`` in a folder of their own, and build_report's tables/ and plots/ of
    them there: made once (a set of plots takes seconds); a test that writes beside them takes a copy. Returns the
    folder, the runs and the CSV."""
    root = tmp_path_factory.mktemp("sweep_report")
    entries, gradcheck = sweep_entries(root), write_gradcheck_csv(root / "gc.csv")
    build_report(Manifest(entries, [GradcheckEntry(gradcheck, model="sd3", resolution=64)]), root / "tables",
                 root / "plots")
    return root, entries, gradcheck


def test_an_output_inside_a_report_s_tables_or_plots_is_refused(sweep_report, capsys):
    """A folder or file another command made inside a report's folder was a stranger there: the same report run
    again refused its own folder."""
    root = sweep_report[0]
    before = sorted((p, p.read_bytes()) for p in root.rglob("*") if p.is_file())
    run_yaml = str(Path(__file__).resolve().parents[2] / "config" / "run.yaml")
    for folder, what in (("tables", "the tables of an agg-bench report"), ("plots", "the plots of an agg-bench report")):
        inside = root / folder / "a"
        for argv, kind in ((["report", "--runs", str(root / "runs"), "--tables", str(inside)], "a folder"),
                           (["pretrain", "--out", str(inside)], "a folder"),
                           (["calibrate", "--config", run_yaml, "--out", str(inside / "c.json")], "a file")):
            capsys.readouterr()
            assert main(argv) == 2, argv
            lines = capsys.readouterr().err.splitlines()
            path = inside / "c.json" if kind == "a file" else inside
            assert len(lines) == 1 and f"'{path}': inside {what} '{root / folder}'; expected {kind} outside it" \
                in lines[0], lines
    assert sorted((p, p.read_bytes()) for p in root.rglob("*") if p.is_file()) == before


def test_build_report_writes_every_table_and_plot(sweep_report):
    tmp_path = sweep_report[0]  # build_report(the sweep and the gradcheck CSV, tmp_path / "tables", tmp_path / "plots")
    for name in TABLES:
        assert (tmp_path / "tables" / f"{name}.csv").stat().st_size > 0
        assert (tmp_path / "tables" / f"{name}.md").read_text().startswith("| ")
        html = (tmp_path / "tables" / f"{name}.html").read_text()
        assert html.startswith("<!DOCTYPE html>") and "<table>" in html
    # counts are written as integers, not 80.0
    efficiency_csv = (tmp_path / "tables" / "efficiency.csv").read_text().splitlines()
    header = efficiency_csv[0].split(",")
    full_row = next(line.split(",") for line in efficiency_csv[1:] if line.startswith("full,sd3,64,"))
    assert full_row[header.index("backward")] == "80" and full_row[header.index("seeds")] == "2"
    summary = pd.read_csv(tmp_path / "tables" / "summary.csv").set_index(["method", "resolution"])
    # full at 64 px: iterations 2, 2, 4, 4 s after the warm-up -> median 3 [2, 4]
    assert summary.loc[("full", 64), "s_per_iter"] == "3.000 [2.000, 4.000]"
    assert summary.loc[("agg-w5", 64), "speedup"].startswith("3.00x [")
    assert summary.loc[("agg-w5", 64), "train_speedup_basis"] == "runs"  # no calibration timed these methods
    assert str(summary.loc[("window", 128), "final_reward_pm"]) in ("2", "2.0")  # no reward_std recorded: no spread
    assert len(pd.read_csv(tmp_path / "tables" / "records.csv")) == 18
    with open(tmp_path / "tables" / "records.csv", newline="") as f:
        records_csv = list(csv.DictReader(f))
    assert {row["backward"] for row in records_csv} == {"", "80", "32", "16"}  # not 80.0
    for name in PLOTS:
        assert (tmp_path / "plots" / f"{name}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_report_cli(sweep, tmp_path, capsys):
    runs = tmp_path / "runs"
    assert main(["report", "--runs", str(runs), "--tables", str(tmp_path / "t")]) == 0
    table = pd.read_csv(tmp_path / "t" / "efficiency.csv")
    assert set(table["method"]) == {"full", "agg", "window"}  # labels from the records without a manifest
    assert json.loads(capsys.readouterr().out.strip())["efficiency_rows"] == len(table)
    assert main(["report", "--runs", str(runs)]) == 2
    assert "--tables" in capsys.readouterr().err


def test_a_run_timed_with_its_warm_up_is_named_on_stderr(tmp_path, capsys):
    """A run of no more ok iterations than the warm-up is timed whole, warm-up included: the tables held it with
    nothing said. stderr names it (one line); a warm-up the runs are longer than says nothing."""
    runs = tmp_path / "runs"
    make_run(runs, "one", "full", [it(10.0, 0.0)])
    make_run(runs, "two", "full", [it(10.0, 0.0), it(2.0, 1.0)], seed=1)
    capsys.readouterr()
    for warmup, named in (("1", ["one"]), ("2", ["one", "two"]), ("0", [])):
        assert main(["report", "--runs", str(runs), "--warmup", warmup, "--tables", str(tmp_path / "t")]) == 0
        lines = capsys.readouterr().err.splitlines()
        if not named:
            assert lines == []
            continue
        assert len(lines) == 1 and f"{len(named)} run" in lines[0] and "their timings include it" in lines[0], lines
        assert str(runs / named[0]) in lines[0] and f"--warmup: {warmup})" in lines[0], lines



class DrawnOnce:
    """A stand-in for the report's write_plots in a test whose reports draw the plots of the same tables more than
    once (a set of plots takes seconds): the first call draws them (plots.write_plots); each later call checks that
    it was given the same tables, cell for cell and dtype for dtype, and writes the images the first call drew. The
    plots are a function of their tables: test_plots_are_drawn_from_the_written_tables draws them twice, from the
    tables as written and from the same tables' CSV text, and compares the bytes."""

    def __init__(self):
        self.tables: dict[str, pd.DataFrame] | None = None
        self.images: dict[str, bytes] = {}
        self.calls = 0

    def __call__(self, tables, folder) -> list[Path]:
        from agg_bench.results import plots

        self.calls += 1
        folder = Path(folder)
        if self.tables is None:
            paths = plots.write_plots(tables, folder)
            self.tables = {name: tables[name].copy() for name in PLOT_TABLES}
            self.images = {path.name: path.read_bytes() for path in paths}
            return paths
        for name in PLOT_TABLES:
            pd.testing.assert_frame_equal(tables[name], self.tables[name], check_exact=True, obj=name)
        for name, image in self.images.items():
            (folder / name).write_bytes(image)
        return [folder / name for name in self.images]


def test_plots_are_drawn_from_the_written_tables(sweep_report, tmp_path, capsys, monkeypatch):
    """The plots job reads the tables job's files (--tables-in); a report that writes both, or the plots
    alone, draws the same images from the same tables."""
    import shutil

    from agg_bench.results import report

    root, sweep, gradcheck_csv = sweep_report
    manifest = tmp_path / "manifest.json"
    manifest.write_text(json.dumps({"runs": [{"dir": str(e.dir), **{k: v for k, v in vars(e).items()
                                                                    if k != "dir" and v is not None}}
                                             for e in sweep],
                                    "gradcheck": [{"file": str(gradcheck_csv), "model": "sd3", "resolution": 64}]}))
    # the report that writes both: the fixture's build_report of these runs (tables/ copied: plots are drawn there)
    tables = tmp_path / "tables"
    shutil.copytree(root / "tables", tables)
    shutil.copytree(root / "plots", tmp_path / "both")
    # the plots alone are drawn (and compared with the fixture's below); the report from --tables-in is checked to
    # hand the plots the same tables, exactly, and writes those images (each set of plots drawn takes seconds)
    drawn = DrawnOnce()
    monkeypatch.setattr(report, "write_plots", drawn)
    assert main(["report", "--manifest", str(manifest), "--plots", str(tmp_path / "alone")]) == 0
    capsys.readouterr()
    # drawn from the tables into the tables' own folder, which the plots may share (one report less to draw: each
    # set of plots takes seconds)
    tables_before = {p.name: p.read_bytes() for p in tables.iterdir() if p.name != "stamp.json"}
    assert main(["report", "--tables-in", str(tables), "--plots", str(tables)]) == 0
    assert drawn.calls == 2
    assert json.loads(capsys.readouterr().out)["efficiency_rows"] == len(pd.read_csv(tables / "efficiency.csv"))
    assert {p.name: p.read_bytes() for p in tables.iterdir() if p.name in tables_before} == tables_before
    for name in PLOTS:
        image = (tables / f"{name}.png").read_bytes()
        assert image == (tmp_path / "both" / f"{name}.png").read_bytes() == \
            (tmp_path / "alone" / f"{name}.png").read_bytes(), name
    assert (tables / "time_breakdown.png").is_file() and (tables / "efficiency.csv").is_file()


def test_a_long_report_prints_its_progress_on_stderr(sweep, tmp_path, capsys, monkeypatch):
    """A report of big runs (100,000 records each) took most of a minute with nothing printed: stderr gets a line
    per step done, each run folder read among them, at most one every PROGRESS_EVERY_S seconds (a quick report
    prints none); stdout keeps its one JSON line."""
    from agg_bench.results import report

    runs = tmp_path / "runs"
    capsys.readouterr()
    monkeypatch.setattr(report, "PROGRESS_EVERY_S", 0.0)
    assert main(["report", "--runs", str(runs), "--tables", str(tmp_path / "t")]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out) == {"tables": str(tmp_path / "t"), "plots": None,
                               "efficiency_rows": len(pd.read_csv(tmp_path / "t" / "efficiency.csv"))}
    folders = sorted(runs.iterdir())
    expected = [*(rf"read run {i}/{len(folders)} {re.escape(str(folder))}: \d+ records?"
                  for i, folder in enumerate(folders, 1)),
                rf"tables of {len(pd.read_csv(tmp_path / 't' / 'records.csv'))} records computed", "tables written"]
    lines = err.splitlines()
    assert len(lines) == len(expected) and all(re.fullmatch(rf"agg-bench report: {what} \(\d+\.\d s\)", line)
                                               for what, line in zip(expected, lines)), lines
    monkeypatch.undo()
    quiet = report.Progress("report")
    quiet("read run 1/1")
    assert capsys.readouterr().err == ""


def test_tables_and_plots_share_a_folder_across_runs_of_the_report(earlier_reports, tmp_path, capsys, monkeypatch):
    """A folder that `--tables D --plots D` wrote holds the report's own files only: a later `--tables D`, or
    `--plots D` alone, rewrites it (it was refused: the other's files counted as someone's); a file of someone's
    there is still refused, one line, exit 2, nothing touched."""
    import shutil

    from agg_bench.results import report

    runs, both = earlier_reports / "runs", tmp_path / "both"
    # what `report --runs RUNS --tables D --plots D` wrote: the fixture's out/ (its set of plots drawn once)
    shutil.copytree(earlier_reports / "out", both)
    # the later reports rewrite that folder with every plot's file drawn by a stand-in: what is checked is which
    # files the folder may hold, and each set of plots drawn takes seconds
    monkeypatch.setattr(report, "write_plots", every_plot)
    assert main(["report", "--runs", str(runs), "--tables", str(both)]) == 0
    assert main(["report", "--runs", str(runs), "--plots", str(both)]) == 0
    assert main(["report", "--tables-in", str(both), "--plots", str(both)]) == 0
    assert {f"{name}.png" for name in PLOTS} <= {p.name for p in both.iterdir()} and (both / "records.csv").is_file()
    (both / "mine.txt").write_text("mine")
    before = {p.name: p.read_bytes() for p in both.iterdir()}
    capsys.readouterr()
    assert main(["report", "--runs", str(runs), "--tables", str(both)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"agg-bench report: --tables {both}: the folder holds files that are not agg-bench report "
                   "tables or plots (mine.txt); give a new or empty folder")
    assert {p.name: p.read_bytes() for p in both.iterdir()} == before


@pytest.fixture(scope="module")
def earlier_reports(tmp_path_factory) -> Path:
    """The ``sweep`` runs in a folder of their own (runs/), the report of them all in out/ (tables and plots) and the
    tables of two of them in tables_in/: made once (a set of plots takes seconds), each test takes a copy of the
    reports and reads the runs where they are."""
    root = tmp_path_factory.mktemp("earlier")
    sweep_entries(root)
    runs = root / "runs"
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        assert main(["report", "--runs", str(runs), "--tables", str(root / "out"), "--plots", str(root / "out")]) == 0
        assert main(["report", "--runs", str(runs / "full_s0"), str(runs / "agg"), "--tables",
                     str(root / "tables_in")]) == 0
    return root


@pytest.mark.parametrize("stop", ["a full disk at the third table file", "SIGTERM at the third plot",
                                  "SIGTERM at the third plot drawn from --tables-in"])
def test_a_report_stopped_part_way_leaves_the_earlier_set_whole(earlier_reports, tmp_path, monkeypatch, capsys, stop):
    """A report stopped part-way (a full disk, a signal) left its first files new beside the earlier report's
    others, a set that no report wrote. The earlier set stays whole, byte for byte, with no temporary beside it;
    the next report that ends replaces it whole."""
    import errno
    import os
    import shutil
    import signal

    from agg_bench.results import formatting, plots, report

    runs, out, tables_in = earlier_reports / "runs", tmp_path / "out", tmp_path / "tables_in"
    shutil.copytree(earlier_reports / "out", out)  # `report --runs RUNS --tables out --plots out`
    shutil.copytree(earlier_reports / "tables_in", tables_in)  # `report --runs full_s0 agg --tables tables_in`
    (tmp_path / "mine.txt").write_text("mine")

    def beside() -> dict:
        return {p.name: p.read_bytes() if p.is_file() else None for p in tmp_path.iterdir()}

    before = beside()
    written = {p.name: p.read_bytes() for p in out.iterdir()}
    module, name = (formatting, "write_text") if "full disk" in stop else (plots, "save_figure")
    original, calls = getattr(module, name), []

    def third_fails(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            if "SIGTERM" in stop:
                os.kill(os.getpid(), signal.SIGTERM)
            else:
                raise OSError(errno.ENOSPC, "No space left on device")
        return original(*args, **kwargs)

    monkeypatch.setattr(module, name, third_fails)
    other = ["--tables-in", str(tables_in), "--plots", str(out)] if "tables-in" in stop else \
        ["--runs", str(runs / "full_s0"), str(runs / "agg"), "--tables", str(out), "--plots", str(out)]
    capsys.readouterr()
    assert main(["report", *other]) == (143 if "SIGTERM" in stop else 2)
    assert len(calls) == 3
    assert {p.name: p.read_bytes() for p in out.iterdir()} == written  # the earlier set, and nothing else
    assert beside() == before  # no temporary beside it
    monkeypatch.undo()
    # the next report writes every plot's file by a stand-in: what is checked is that it replaces the set whole, and
    # each set of plots drawn takes seconds (the stopped one above drew its first ones)
    monkeypatch.setattr(report, "write_plots", every_plot)
    assert main(["report", *other]) == 0
    now = {p.name: p.read_bytes() for p in out.iterdir()}
    assert set(now) == set(written)
    changed = {name for name in now if now[name] != written[name]}
    assert "reward_iteration.png" in changed and ("records.csv" in changed) == ("tables-in" not in stop)


def one_plot(tables, folder) -> None:
    """A stand-in for the plots (what they are drawn from, in one file): drawing them takes seconds."""
    (Path(folder) / "reward_iteration.png").write_text(f"{len(tables['records'])} records")


def every_plot(tables, folder) -> None:
    """A stand-in for the plots that writes each of their files (what they are drawn from): drawing them takes
    seconds."""
    for name in PLOTS:
        (Path(folder) / f"{name}.png").write_text(f"{name}: {len(tables['records'])} records")


# `agg-bench report ARGS` killed (SIGKILL) once the first of its two folders is renamed into place
KILLED_AFTER_ONE_FOLDER = """
import os, signal, sys
from pathlib import Path
from agg_bench.cli import main
from agg_bench.results import report
report.write_plots = lambda tables, folder: (Path(folder) / "reward_iteration.png").write_text(
    f"{len(tables['records'])} records")
folders, replace = {os.path.abspath(p) for p in sys.argv[1:3]}, os.replace
def renamed(src, dst):
    replace(src, dst)
    if os.path.abspath(dst) in folders and ".agg-bench-tmp" in os.path.basename(src):
        os.kill(os.getpid(), signal.SIGKILL)
os.replace = renamed
main(["report", *sys.argv[3:]])
"""


def test_a_report_killed_between_its_tables_and_its_plots_is_told_by_their_stamps_and_repaired(sweep, tmp_path,
                                                                                                  monkeypatch, capsys):
    """`agg-bench report --tables T --plots P` renames its two folders into place one after the other: killed
    (SIGKILL) between the two renames, it left one folder of the new report beside one of the earlier, and nothing
    could tell. Both folders hold the same stamp.json (the digest of the manifest read and of the tables the plots
    are drawn from): `report --check` refuses such a pair in one line, and the same report again repairs it."""
    import signal
    import subprocess
    import sys

    from agg_bench.results import report

    monkeypatch.setattr(report, "write_plots", one_plot)
    runs, tables, plots = tmp_path / "runs", tmp_path / "T", tmp_path / "P"
    earlier = ["--runs", str(runs / "full_s0"), str(runs / "agg"), "--tables", str(tables), "--plots", str(plots)]
    assert main(["report", *earlier]) == 0
    check = ["report", "--check", "--tables", str(tables), "--plots", str(plots)]
    assert main(check) == 0
    later = ["--runs", str(runs), "--tables", str(tables), "--plots", str(plots)]
    killed = subprocess.run([sys.executable, "-c", KILLED_AFTER_ONE_FOLDER, str(tables), str(plots), *later],
                            capture_output=True, text=True, timeout=120,
                            env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])})
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    assert json.loads((tables / "stamp.json").read_text()) != json.loads((plots / "stamp.json").read_text())
    capsys.readouterr()
    assert main(check) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"agg-bench report: --plots {plots}: not drawn from the tables in {tables} (its stamp.json differs: "
                   "a report stopped between the two folders, or another report's); run agg-bench report again"]
    assert main(["report", *later]) == 0 and main(check) == 0


def test_a_reports_stamp_names_its_manifest_and_its_tables(sweep, tmp_path, monkeypatch, capsys):
    """The plots drawn from written tables (--tables-in) carry their stamp; tables made from another manifest
    than the one given, or tables a file of which was replaced, are refused by --check in one line."""
    from agg_bench.results import report

    monkeypatch.setattr(report, "write_plots", one_plot)
    manifest = tmp_path / "manifest.json"
    manifest.write_text(json.dumps({"runs": [{"dir": str(e.dir)} for e in sweep]}))
    tables, plots = tmp_path / "T", tmp_path / "P"
    assert main(["report", "--manifest", str(manifest), "--tables", str(tables)]) == 0
    assert main(["report", "--tables-in", str(tables), "--plots", str(plots)]) == 0
    assert (plots / "stamp.json").read_bytes() == (tables / "stamp.json").read_bytes()
    assert main(["report", "--check", "--manifest", str(manifest), "--tables", str(tables), "--plots", str(plots)]) == 0
    manifest.write_text(json.dumps({"runs": [{"dir": str(e.dir)} for e in sweep[:2]]}))
    capsys.readouterr()
    assert main(["report", "--check", "--manifest", str(manifest), "--tables", str(tables)]) == 2
    assert "names another manifest" in capsys.readouterr().err
    (tables / "records.csv").write_text((tables / "records.csv").read_text() + "\n")
    assert main(["report", "--check", "--tables", str(tables)]) == 2
    err = capsys.readouterr().err
    assert f"--tables {tables}: its tables are not the ones its stamp.json names (one of " in err
    assert "records.csv" in err and "edited, replaced or missing since the report wrote them" in err
    (tables / "stamp.json").unlink()
    assert main(["report", "--check", "--tables", str(tables)]) == 2
    assert "no stamp.json that names its tables" in capsys.readouterr().err


def test_a_manifest_replaced_while_the_report_reads_it_leaves_the_tables_beside_it_as_they_were(sweep, tmp_path,
                                                                                                   monkeypatch, capsys):
    """`campaign unpack` into a reference while `agg-bench report --manifest REF/manifest.json --tables REF/tables`
    read it: the report had read the manifest before the unpack wrote its manifest and tables, and then wrote
    tables of the earlier manifest over them, beside the later manifest. The report refuses in one line instead,
    naming the manifest, and leaves the tables as they were."""
    from agg_bench.io import write_json
    from agg_bench.results import loading

    def entries(runs):
        return {"runs": [{"dir": str(e.dir), "method": e.method} for e in runs]}

    manifest, tables = tmp_path / "manifest.json", tmp_path / "tables"
    write_json(manifest, entries(sweep[:2]))
    assert main(["report", "--manifest", str(manifest), "--tables", str(tables)]) == 0
    before = {p.name: p.read_bytes() for p in tables.iterdir()}
    original = loading.load_manifest

    def read_then_replaced(path):
        read = original(path)
        write_json(manifest, entries(sweep[:3]))  # another process's manifest (and tables) land meanwhile
        return read

    monkeypatch.setattr(loading, "load_manifest", read_then_replaced)
    capsys.readouterr()
    assert main(["report", "--manifest", str(manifest), "--tables", str(tables)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"agg-bench report: manifest {manifest}: replaced by another process while it was read; run "
                   "again once that process has ended"), err
    assert {p.name: p.read_bytes() for p in tables.iterdir()} == before
    monkeypatch.undo()
    assert main(["report", "--manifest", str(manifest), "--tables", str(tables)]) == 0
    assert len(pd.read_csv(tables / "records.csv")["run_id"].unique()) == 3


@pytest.mark.parametrize("args, expected", [
    (["--tables-in", "TABLES"], "--tables-in DIR needs --plots DIR"),
    (["--tables-in", "TABLES", "--plots", "OUT", "--runs", "TABLES"], "--runs is for writing them"),
    (["--tables-in", "TABLES", "--plots", "OUT", "--tables", "OUT"], "--tables is for writing them"),
    (["--tables-in", "TABLES", "--plots", "OUT", "--warmup", "0"], "--warmup is for writing them"),
    (["--tables-in", "NOWHERE", "--plots", "OUT"], "--tables-in NOWHERE: no such folder"),
    (["--tables-in", "A_FILE", "--plots", "OUT"], "--tables-in A_FILE: is not a folder"),
    (["--tables-in", "EMPTY", "--plots", "OUT"], "--tables-in EMPTY: no records.csv"),
])
def test_tables_in_takes_only_plots(sweep, tmp_path, capsys, args, expected):
    tables = tmp_path / "tables"
    assert main(["report", "--runs", str(tmp_path / "runs"), "--tables", str(tables)]) == 0
    capsys.readouterr()
    (tmp_path / "a_file").write_text("tables\n")
    (tmp_path / "empty").mkdir()
    paths = {"TABLES": str(tables), "OUT": str(tmp_path / "out"), "NOWHERE": str(tmp_path / "nowhere"),
             "A_FILE": str(tmp_path / "a_file"), "EMPTY": str(tmp_path / "empty")}
    assert main(["report", *(paths.get(a, a) for a in args)]) == 2
    lines = capsys.readouterr().err.splitlines()
    for name in ("NOWHERE", "A_FILE", "EMPTY"):
        expected = expected.replace(name, paths[name])
    assert len(lines) == 1 and lines[0].startswith("agg-bench report: ") and expected in lines[0], lines
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("name, edit, expected", [
    ("efficiency.csv", lambda text: text.replace("t_iter_p25_s", "t_iter_q1_s"), "no column 't_iter_p25_s'"),
    ("records.csv", lambda text: "", "records.csv: not a table CSV"),
    ("ablation.csv", lambda text: '"unclosed\n' + text, "ablation.csv: not a table CSV"),
    # cut mid-line (a copy stopped): its last cell would read as a shorter number
    ("records.csv", lambda text: text[:-3], "records.csv: the last line ends without a newline (the file is cut)"),
    # a cell more in every row: pandas read the first as an index and each cell under the column to its left
    ("efficiency.csv", lambda text: text.replace("\n", ",x\n").replace(",x\n", "\n", 1),
     "efficiency.csv: line 2 holds "),
    # a cell fewer in a row: pandas filled it with an empty one, and a number column's last cell read as missing
    ("records.csv", lambda text: text.replace("\n", "\n" + text.splitlines()[1].rsplit(",", 1)[0] + "\n", 1),
     "records.csv: line 2 holds "),
    # pandas read the second as "window.1", a column no reader looks at
    ("ablation.csv", lambda text: text.replace(",alpha,", ",window,", 1),
     "ablation.csv: the header names column 'window' twice"),
])
def test_tables_in_names_a_table_that_is_not_what_the_report_wrote(sweep, tmp_path, capsys, name, edit, expected):
    tables = tmp_path / "tables"
    assert main(["report", "--runs", str(tmp_path / "runs"), "--tables", str(tables)]) == 0
    (tables / name).write_text(edit((tables / name).read_text()))
    capsys.readouterr()
    assert main(["report", "--tables-in", str(tables), "--plots", str(tmp_path / "out")]) == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and str(tables / name) in lines[0] and expected in lines[0], lines
    assert not (tmp_path / "out").exists()


def test_a_gradcheck_csv_of_shifted_or_twice_named_columns_is_refused(tmp_path):
    """A row of one cell more than the header made pandas read its first cell as an index and the others one
    column to the left (here the model under ``method``); a header naming a column twice kept the first alone."""
    for text, expected in [
        ("method,cosine_to_full,model,resolution\nx,agg,0.5,sd3-tiny,64\n",
         "line 2 holds 5 cells, more than the 4 columns its header names"),
        ("method,cosine_to_full,model,resolution\nagg,0.5,sd3-tiny,64\nfull,1,sd3-tiny\n",
         "line 3 holds 3 cells, fewer than the 4 columns its header names"),
        ("method,cosine_to_full,cosine_to_full\nagg,0.5,-1\n", "the header names column 'cosine_to_full' twice"),
        ("method,cosine_to_full\nagg,0.5", "the last line ends without a newline (the file is cut)"),
    ]:
        (tmp_path / "g.csv").write_text(text)
        with pytest.raises(UserError, match=re.escape(expected)):
            load_gradcheck([GradcheckEntry(tmp_path / "g.csv")])


def test_a_table_row_of_fewer_cells_is_refused_and_empty_cells_are_cells():
    """pandas reads a row of fewer cells than the header as if its last ones were empty: a row cut or a cell lost
    was a run without those numbers. It is refused naming the line it starts on (a quoted cell may hold a newline)
    and both counts; empty cells written as such (``a,,``) are cells, and an empty line is no row."""
    from agg_bench.results.loading import parse_table

    table = parse_table(io.StringIO('method,model,seed\n"a\nb",m,1\nc,,\n\nd,m,\n'), "T")
    assert table.shape == (3, 3) and table["model"].isna().tolist() == [False, True, False]
    with pytest.raises(UserError) as refused:
        parse_table(io.StringIO('method,model,seed\n"a\nb",m,1\nc,m\n'), "T")
    assert str(refused.value) == ("T: line 4 holds 2 cells, fewer than the 3 columns its header names; expected the "
                                  "table agg-bench report --tables writes")


def test_a_row_of_fewer_cells_after_a_cell_past_the_csv_modules_limit_is_refused():
    """pandas reads a cell longer than the csv module's field limit (128 KiB); the count of the rows' cells does not
    stop there, and the limit is the module's own again after."""
    import csv

    from agg_bench.results.loading import parse_table

    limit = csv.field_size_limit()
    with pytest.raises(UserError, match="^T: line 3 holds 2 cells, fewer than the 3 columns"):
        parse_table(io.StringIO("method,model,seed\n" + "a" * (limit + 1) + ",m,1\nc,m\n"), "T")
    assert csv.field_size_limit() == limit


def test_labels_that_look_like_numbers_or_missing_values_stay_labels(tmp_path):
    """A written table gives its labels back as text: a method called "NA" or "1" (an imported log's label) is
    not a missing value or a number."""
    runs = tmp_path / "runs"
    make_run(runs, "a", "NA", [it(2.0, 1.0, backward=8), it(2.0, 2.0, backward=8)], model="1", config=False)
    make_run(runs, "b", "full", [it(1.0, 1.0, backward=4), it(1.0, 3.0, backward=4)], model="1")
    assert main(["report", "--runs", str(runs), "--tables", str(tmp_path / "t")]) == 0
    from agg_bench.results.loading import load_tables

    efficiency = load_tables(tmp_path / "t")["efficiency"]
    assert sorted(efficiency["method"]) == ["NA", "full"] and list(efficiency["model"]) == ["1", "1"]

FORMULA = '=HYPERLINK("http://example.com","x")'


def test_a_label_a_spreadsheet_would_run_is_written_as_text_and_read_back(tmp_path):
    """A text cell beginning with =, +, -, @, a tab or a carriage return is a formula to a spreadsheet program (a
    label from shared results: a method, a model, a run named after its folder). Every CSV of the report writes it
    after a single quote, numbers (negative ones too) as numbers, and the plots read the labels back as they were.
    A run folder's path holding a carriage return is a quoted cell, read back whole."""
    from agg_bench.results.loading import NUMBER_TEXT, load_tables

    runs = tmp_path / "shared\rruns"  # pandas quotes a field holding a newline, not one holding a lone CR
    # no config.json: the method of a folder without one (an imported log's) is a label, which a config names never
    make_run(runs, "-run", FORMULA, [it(2.0, -1.5, backward=8), it(2.0, -2.5, backward=8)], model="@sd3",
             config=False)
    make_run(runs, "b", "full", [it(1.0, -1.0, backward=4), it(1.0, 3.0, backward=4)], model="@sd3")
    assert main(["report", "--runs", str(runs), "--tables", str(tmp_path / "t")]) == 0
    with open(tmp_path / "t" / "records.csv", newline="") as fh:
        records = list(csv.DictReader(fh))
    assert [(r["run_id"], r["method"], r["model"], r["reward_mean"]) for r in records[:2]] == [
        ("'-run", f"'{FORMULA}", "'@sd3", "-1.5"), ("'-run", f"'{FORMULA}", "'@sd3", "-2.5")]
    for path in (tmp_path / "t").glob("*.csv"):
        with open(path, newline="") as fh:
            cells = [cell for row in csv.reader(fh) for cell in row]
        assert [c for c in cells if c.startswith(("=", "+", "-", "@", "\t", "\r")) and not NUMBER_TEXT.fullmatch(c)] == [], path
    tables = load_tables(tmp_path / "t")
    efficiency = tables["efficiency"]
    assert sorted(efficiency["method"]) == sorted([FORMULA, "full"]) and set(efficiency["model"]) == {"@sd3"}
    assert sorted(set(tables["records"]["run_dir"])) == [str(runs / "-run"), str(runs / "b")]


def test_learning_csv_quotes_a_formula_label_too(tmp_path):
    """learning.csv (and curves.csv, evaluation.csv: the same writer) holds the manifest's method labels."""
    from agg_bench.results.learning_tables import write_table

    table = pd.DataFrame({"method": [FORMULA, "full"], "seeds": [2, 2], "gain": [-0.5, 1.0],
                          "target_reached": [math.nan] * 2, "target_cost": [math.nan] * 2})
    path = write_table(table, tmp_path, 2, 0.5)[0]
    with open(path, newline="") as fh:
        assert [(r["method"], r["gain"]) for r in csv.DictReader(fh)] == [(f"'{FORMULA}", "-0.5"), ("full", "1.0")]


def test_csv_text_quotes_formula_cells_and_parse_table_gives_them_back():
    """The one writer of the report's, learning's and campaign's CSVs quotes a text that begins with a formula's
    first character (OWASP) or with the quote itself, and nothing else; a reader of the report's tables drops it."""
    from agg_bench.results.formatting import csv_cell, csv_text
    from agg_bench.results.loading import parse_table

    assert csv_cell("\rx") == "'\rx" and csv_cell(-2.5) == -2.5 and csv_cell(None) is None
    texts = ["=1+1", "+1", "-1+2", "@SUM(A1)", "\tx", "'q", "plain", "1", "a=b"]
    table = pd.DataFrame({"label": texts, "number": [-1.5] * len(texts),
                          "count": pd.array([-3] * len(texts), dtype="Int64")})
    written = csv_text(table)
    rows = list(csv.reader(io.StringIO(written)))[1:]
    assert [row[0] for row in rows] == [f"'{text}" for text in texts[:6]] + texts[6:]
    assert all(row[1:] == ["-1.5", "-3"] for row in rows)
    back = parse_table(io.StringIO(written), "the table", quoted=True)
    assert list(back["label"]) == texts and list(back["number"]) == [-1.5] * len(texts)

    # a cell holding a carriage return or a newline (a run folder's path may) is quoted, and every row ends in "\n"
    paths = ["/runs/a\rb", "/runs/c\nd", "/runs/e\r\nf", "\r/runs/g", "/runs/h"]
    written = csv_text(pd.DataFrame({"run_dir": paths, "seed": [1, 2, 3, 4, 5]}))
    assert written == 'run_dir,seed\n"/runs/a\rb",1\n"/runs/c\nd",2\n"/runs/e\r\nf",3\n"\'\r/runs/g",4\n/runs/h,5\n'
    back = parse_table(io.StringIO(written), "the table", quoted=True)
    assert list(back["run_dir"]) == paths and list(back["seed"]) == [1, 2, 3, 4, 5]


def test_random_weight_rows_keep_rewards_out_and_show_the_plan(tmp_path):
    """A random-weights run: labelled, its rewards out of the table; planned bytes beside the measured peak."""
    run = make_run(tmp_path, "full_random", "full", [it(2.0, 5.0, saved_activation_peak_bytes=3 * MIB),
                                                     it(2.0, 6.0)], weights="random", model="sd3.5-medium-random")
    (run / "plan.json").write_text(json.dumps({"bytes": {"activations": 3 * MIB, "total_per_gpu": 10 * MIB}}))
    tiny = make_run(tmp_path, "full_tiny", "full", [it(2.0, 5.0), it(2.0, 6.0)], weights="tiny")
    table = efficiency_table(load_records([RunEntry(run), RunEntry(tiny)]), warmup=0)
    random_row = table[table["weights"] == "random"].iloc[0]
    tiny_row = table[table["weights"] == "tiny"].iloc[0]
    assert math.isnan(random_row["final_reward"]) and math.isnan(random_row["reward_area"])
    assert tiny_row["final_reward"] == 6.0
    assert random_row["saved_act_mib"] == random_row["planned_act_mib"] == 3.0
    assert random_row["planned_total_mib"] == 10.0
    assert math.isnan(tiny_row["planned_act_mib"])


@pytest.mark.parametrize("model, weights", [({"preset": "random"}, "random"), ({"preset": "tiny"}, "tiny"),
                                            ({"preset": "random", "pretrained": "/models/sd3"}, "pretrained")])
def test_records_older_than_the_weights_key_take_it_from_their_config(tmp_path, model, weights):
    """Records written before `weights` was a record key (and their summary) say nothing of it: the label is their
    config's, so a random-weight run's rewards stay out of the table as today's do (read as unknown, they were
    shown as the run's final reward)."""
    old_keys = tuple(k for k in RECORD_KEYS if k != "weights")
    run = make_run(tmp_path, "old", "full", [it(2.0, 5.0), it(2.0, 6.0)], keys=old_keys)
    config = json.loads((run / "config.json").read_text())
    (run / "config.json").write_text(json.dumps({**config, "model": model}))
    table = efficiency_table(load_records([RunEntry(run)]), warmup=0)
    assert list(table["weights"]) == [weights]
    assert math.isnan(table["final_reward"].iloc[0]) == (weights == "random")


def test_reward_curves_average_seeds_with_their_spread_and_fall_back_to_the_images_spread():
    from agg_bench.results.plots import reward_curves

    rows = []
    for run, rewards, seconds in (("a0", [1.0, 3.0], [2.0, 2.0]), ("a1", [3.0, 7.0], [4.0, 4.0]),
                                  ("a2", [2.0, 5.0], [3.0, 1.0])):
        rows += [{"method": "agg", "source": "measured", "run_dir": run, "iteration": i, "reward_mean": r,
                  "reward_std": 9.0, "t_iter_s": t} for i, (r, t) in enumerate(zip(rewards, seconds))]
    rows += [{"method": "full", "source": "measured", "run_dir": "f0", "iteration": i, "reward_mean": r,
              "reward_std": s, "t_iter_s": 1.5} for i, (r, s) in enumerate([(0.5, 0.25), (0.75, 0.125)])]
    curves = reward_curves(pd.DataFrame(rows), "wallclock")
    agg = curves["agg"]
    assert list(agg["mean"]) == [2.0, 5.0] and agg["band"] == "+-1 std over 3 seeds"
    assert list(agg["spread"]) == pytest.approx([np.std([1.0, 3.0, 2.0]), np.std([3.0, 7.0, 5.0])], rel=1e-15)
    assert list(agg["x"]) == [3.0, 4.0]  # medians of the cumulative seconds (2, 4, 3) and (4, 8, 4)
    full = curves["full"]
    assert list(full["spread"]) == [0.25, 0.125] and full["band"] == "+-1 std over the images"
    assert list(reward_curves(pd.DataFrame(rows), "iteration")["full"]["x"]) == [0.0, 1.0]


def test_reward_curve_labels_are_read_a_column_at_a_time(monkeypatch):
    """The reward plots' label of each record (its method, "(imported)" after an imported log's) is read from the
    method and source columns, not row by row (a pandas row per record was 13 s of a 100,000-record report): the
    same labels, with or without a source column and with a method missing."""
    from agg_bench.results import plots

    frame = pd.DataFrame({"method": ["agg", "full", None, "agg"], "source": ["measured", "imported", "imported", None],
                          "iteration": [0, 1, 2, 3]})
    monkeypatch.setattr(pd.DataFrame, "apply", lambda *a, **k: pytest.fail("a row at a time"))
    def row_label(row) -> str:  # the rule, a row at a time
        return f"{row['method']} (imported)" if row.get("source") == "imported" else str(row["method"])

    for df in (frame, frame.drop(columns="source")):
        assert list(plots._labels(df)) == [row_label(row) for _, row in df.iterrows()]
    assert list(plots._labels(frame)) == ["agg", "full (imported)", "nan (imported)", "agg"]
    curves = plots.reward_curves(frame.assign(run_dir="r", reward_mean=1.0, reward_std=0.0, t_iter_s=1.0), "iteration")
    assert list(curves) == ["agg", "full (imported)", "nan (imported)"]


# ----- bad input: one line naming the file, the key and what was expected; exit code 2; nothing written ----
def report_fails(capsys, tmp_path, *args: str) -> str:
    capsys.readouterr()
    out = tmp_path / "out"
    code = main(["report", *args, "--tables", str(out / "tables"), "--plots", str(out / "plots")])
    lines = capsys.readouterr().err.splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("agg-bench report: "), lines
    assert not out.exists()
    return lines[0]


@pytest.mark.parametrize("key, value, expected", [
    ("t_iter_s", "fast", "expected a finite number or null"),
    ("backward", [80], "expected a finite number or null"),
    ("reward_mean", True, "expected a finite number or null"),
    ("iteration", -1, "expected an integer >= 0"),
    ("iteration", 1.5, "expected an integer >= 0"),
    ("iteration", 0, "expected each iteration once (record 1 has it)"),
    ("model", {"name": "sd3"}, "expected a string or null"),
    ("status", 1, "expected one of ok, oom, diverged, interrupted, error"),
    ("iteration", "1", "expected an integer >= 0"),
    # a label no run writes: a newline split the row of every Markdown table in two
    ("method", "agg\nx", "expected printable text (no newline, tab or other control character) or null"),
    ("gpu_name", "NVIDIA\tH200", "expected printable text (no newline, tab or other control character) or null"),
    # a phase's own CUDA peak, which the efficiency table shows
    ("peak_alloc_train_bytes", "big", "expected a finite number or null"),
    ("peak_alloc_reward_bytes", [1], "expected a finite number or null"),
    # numbers a run cannot record: a negative size, time or count; an image side or GPU count out of range
    ("peak_alloc_bytes", -5, "expected a finite number >= 0 or null"),
    ("t_train_s", -0.5, "expected a finite number >= 0 or null"),
    ("backward", -1, "expected a finite number >= 0 or null"),
    ("resolution", 10**30, "expected an integer from 1 to 16,384 or null"),
    ("resolution", 64.5, "expected an integer from 1 to 16,384 or null"),
    ("n_gpus", -1, "expected an integer from 0 to 65,536 or null"),
    # finite as JSON reads them, but their sums and spans are not: the plots ended in a matplotlib traceback (exit 1)
    ("t_iter_s", 1e308, "expected a number of magnitude at most 1e+300 or null"),
    ("reward_mean", -1e308, "expected a number of magnitude at most 1e+300 or null"),
    ("backward", 2e300, "expected a number of magnitude at most 1e+300 or null"),
])
def test_a_record_with_the_wrong_kind_of_value(tmp_path, capsys, key, value, expected):
    make_run(tmp_path / "runs", "a", "full", [it(2.0, 1.0), {**it(2.0, 1.0), key: value}])
    line = report_fails(capsys, tmp_path, "--runs", str(tmp_path / "runs"))
    assert line.endswith(f"{tmp_path / 'runs' / 'a' / 'metrics.jsonl'}: record 2: {key!r} = {value!r}: {expected}")


@pytest.mark.parametrize("order, expected", [
    ([1, 0, 2, 3], "record 2: 'iteration' = 0 after iteration 1 (record 1): expected the iterations in increasing "
                   "order, as a run writes them"),
    ([0, 2, 1, 3], "record 3: 'iteration' = 1 after iteration 2 (record 2)"),
    ([0, 1, 1, 2], "record 3: 'iteration' = 1: expected each iteration once (record 2 has it)"),
])
def test_records_out_of_iteration_order(tmp_path, capsys, order, expected):
    """A run writes its records in iteration order, a resumed one too (tests/integration/test_signals.py), and an
    import in its log's increasing steps: records out of order are no run's."""
    run = make_run(tmp_path / "runs", "a", "full", [{**it(2.0, 1.0), "iteration": n} for n in order])
    assert f"{run / 'metrics.jsonl'}: {expected}" in report_fails(capsys, tmp_path, "--runs", str(tmp_path / "runs"))


def _branch_run(tmp_path: Path) -> Path:
    """Four ok records of method branch, its summary (ended ok after its 4 iterations) and config."""
    run = make_run(tmp_path / "runs", "b", "branch", [it(1.0, 0.1), it(1.0, 0.2), it(1.0, 0.3), it(1.0, 0.4)])
    summary = json.loads((run / "summary.json").read_text())
    (run / "summary.json").write_text(json.dumps({**summary, "iterations": 4}))
    return run


def _edit(run: Path, name: str, change) -> None:
    """Rewrite the JSON file (or the JSON lines) ``name`` of ``run`` by ``change`` (each line: ``change(k, line)``)."""
    path = run / name
    if name.endswith(".jsonl"):
        lines = [json.loads(line) for line in path.read_text().splitlines()]
        path.write_text("".join(json.dumps(change(k, line)) + "\n" for k, line in enumerate(lines, 1)))
    else:
        path.write_text(json.dumps(change(0, json.loads(path.read_text()))))


@pytest.mark.parametrize("name, change, expected", [
    # a summary of another run over these records (the one an edit or a copy put beside them)
    ("summary.json", lambda k, s: {**s, "status": "oom", "method": "full", "iterations": 99},
     "summary.json: method = 'full', where config.json has 'branch'"),
    ("summary.json", lambda k, s: {**s, "run_id": "other"}, "summary.json: run_id = 'other', where metrics.jsonl record 1 has 'b'"),
    ("summary.json", lambda k, s: {**s, "resolution": 128}, "summary.json: resolution = 128, where metrics.jsonl record 1 has 64"),
    ("metrics.jsonl", lambda k, r: {**r, "method": "full"} if k == 3 else r,
     "metrics.jsonl record 3: method = 'full', where config.json has 'branch'"),
    ("metrics.jsonl", lambda k, r: {**r, "seed": 1} if k == 2 else r, "metrics.jsonl record 2: seed = 1, where metrics.jsonl record 1 has 0"),
    ("metrics.jsonl", lambda k, r: {**r, "model": "flux-tiny"} if k == 4 else r,
     "metrics.jsonl record 4: model = 'flux-tiny', where metrics.jsonl record 1 has 'sd3-tiny'"),
    ("config.json", lambda k, c: {"method": {"name": "full"}}, "metrics.jsonl record 1: method = 'branch', where config.json has 'full'"),
    ("config.json", lambda k, c: {**c, "seed": 3}, "metrics.jsonl record 1: seed = 0, where config.json has 3"),
    ("config.json", lambda k, c: {**c, "run_id": "x"}, "metrics.jsonl record 1: run_id = 'b', where config.json has 'x'"),
    # statuses: an iteration out of memory or diverged ends a run; an ok end is its records' and counts them
    ("metrics.jsonl", lambda k, r: {**r, "status": "oom"} if k == 2 else r,
     "metrics.jsonl record 2: status = 'oom', followed by record 3; expected an iteration that ends the run as its "
     "last record"),
    ("metrics.jsonl", lambda k, r: {**r, "status": "diverged"} if k == 4 else r,
     "summary.json: status = 'ok', where metrics.jsonl record 4 has 'diverged'"),
    ("summary.json", lambda k, s: {**s, "iterations": 99},
     "summary.json: iterations = 99, where metrics.jsonl holds 4 records; expected a run that ended ok to have "
     "recorded each of its iterations"),
])
def test_a_run_folder_that_contradicts_itself(tmp_path, capsys, name, change, expected):
    """Its files name one run: the identity keys the same in every record, the summary and the config; the summary's
    end the one its records say."""
    run = _branch_run(tmp_path)
    assert main(["report", "--runs", str(run), "--tables", str(tmp_path / "whole")]) == 0
    _edit(run, name, change)
    line = report_fails(capsys, tmp_path, "--runs", str(run))
    assert f"run {run}: {expected}" in line, line


@pytest.mark.parametrize("name, change", [
    # a run that ran out of memory in an evaluation, or while building the model it resumes: ok records, oom end
    ("summary.json", lambda k, s: {**s, "status": "oom"}),
    ("summary.json", lambda k, s: {**s, "status": "interrupted", "iterations": 10}),
    # the budget ended it before its iterations
    ("summary.json", lambda k, s: {**s, "iterations": 10, "budget_reached": True}),
    ("metrics.jsonl", lambda k, r: {**r, "status": "oom"} if k == 4 else r),  # its last iteration ran out of memory
    ("config.json", lambda k, c: {**c, "run_id": "b", "seed": 0, "model": {"resolution": 64}}),
])
def test_a_run_folder_whose_files_agree_reads(tmp_path, name, change):
    run = _branch_run(tmp_path)
    _edit(run, name, change)
    if name == "metrics.jsonl":
        _edit(run, "summary.json", lambda k, s: {**s, "status": "oom"})
    assert main(["report", "--runs", str(run), "--tables", str(tmp_path / "t")]) == 0


@pytest.mark.parametrize("key", ["iteration", "status"])
@pytest.mark.parametrize("value", ["absent", None])
def test_a_record_without_its_iteration_or_status(tmp_path, capsys, key, value):
    """Every record a run or an import writes holds both: one without was shown as an iteration of no number or
    no status."""
    record = {**it(2.0, 1.0), key: value}
    run = make_run(tmp_path / "runs", "a", "full", [it(2.0, 1.0), record])
    if value == "absent":
        lines = (run / "metrics.jsonl").read_text().splitlines()
        lines[1] = json.dumps({k: v for k, v in json.loads(lines[1]).items() if k != key})
        (run / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    line = report_fails(capsys, tmp_path, "--runs", str(tmp_path / "runs"))
    assert f"{run / 'metrics.jsonl'}: record 2: no {key!r} (expected in every record)" in line


@pytest.mark.parametrize("name, content, expected", [
    ("summary.json", "[1, 2]", "summary.json: holds a list, not a JSON object"),
    ("summary.json", '{"status": ', "summary.json: is not JSON"),
    ("summary.json", '{"status": ["ok"]}', "summary.json: 'status' = ['ok']: expected one of ok, oom, diverged, "
     "interrupted, error"),
    ("config.json", '{"method": "agg"}', "config.json: config error: method = 'agg': expected a mapping"),
    ("config.json", '{"method": {"name": "agg"}, "train": {"inner_epochs": "2"}}', "train.inner_epochs = '2'"),
    ("config.json", '{"method": {"name": "agg"}, "sampling": {"steps": 10000000}}',
     "config.json: config error: sampling.steps = 10000000: expected an integer from 1 to 1000"),
    ("config.json", '[1]', "config.json: holds a list, not a JSON object"),
    ("plan.json", '{"bytes": 5}', "plan.json: bytes = 5: expected an object or null"),
    # an integer JSON reads but a float cannot hold: math.isfinite raised OverflowError (exit 1)
    ("plan.json", '{"bytes": {"params": 1' + "0" * 400 + "}}", "plan.json: bytes.params = 1000"),
    ("metrics.jsonl", '{"iteration": 0, "status": "ok", "reward_mean": 1' + "0" * 400 + "}\n",
     "'reward_mean' = 1000"),
])
def test_a_run_file_that_is_not_what_a_run_writes(tmp_path, capsys, name, content, expected):
    run = make_run(tmp_path / "runs", "a", "full", [it(2.0, 1.0)])
    (run / name).write_text(content)
    assert expected in report_fails(capsys, tmp_path, "--runs", str(tmp_path / "runs"))


def test_a_run_config_naming_no_method_of_the_harness_is_refused(tmp_path, capsys):
    """A config.json whose method.name is a label (a sweep's ``agg-w5``), its records agreeing, names no method a
    run ran: refused naming the folder, the key, the value and the methods, not shown as a row of that label. A
    dotted path to a method of the user's own is a run's method (not imported by the reader)."""
    runs = tmp_path / "runs"
    make_run(runs, "own", "mine.methods:Estimator", [it(2.0, 1.0)])
    assert main(["report", "--runs", str(runs), "--tables", str(tmp_path / "whole")]) == 0
    run = make_run(runs, "a", "agg-w5", [it(2.0, 1.0)])
    line = report_fails(capsys, tmp_path, "--runs", str(runs))
    assert (f"{run / 'config.json'}: config error: method.name = 'agg-w5': expected a registered method (one of "
            "['agg', ") in line and "or a path package.module:Class" in line, line


@pytest.mark.parametrize("key, value, expected", [
    ("seed", 1, "runs[1]: seed = 1, but {run}/metrics.jsonl: record 1 has seed = 0"),
    ("method_options", {"name": "agg"}, "runs[1]: method_options.name = 'agg', but {run}/metrics.jsonl: record 1 has "
                                        "method = 'full'"),
])
def test_a_manifest_entry_that_is_not_its_runs_seed_or_method_is_refused(tmp_path, capsys, key, value, expected):
    """A manifest's seed is its run's (records, summary, config.json), as the learning manifest's is
    (reading.check_entry_names_run): a copied run folder listed under another seed counted as one more seed of its
    row, its records relabelled with the manifest's seed."""
    runs = tmp_path / "runs"
    first = make_run(runs, "a", "full", [it(2.0, 1.0)])
    run = make_run(runs, "b", "full", [it(2.0, 1.0)])
    manifest = tmp_path / "manifest.json"
    entries = [{"dir": str(first), "method": "full", "seed": 0}, {"dir": str(run), "method": "full", "seed": 0}]
    manifest.write_text(json.dumps({"runs": entries}))
    assert main(["report", "--manifest", str(manifest), "--tables", str(tmp_path / "whole")]) == 0
    entries[1][key] = value
    manifest.write_text(json.dumps({"runs": entries}))
    line = report_fails(capsys, tmp_path, "--manifest", str(manifest))
    assert f"agg-bench report: manifest {manifest}: {expected.format(run=run)}" in line, line


@pytest.mark.parametrize("damage", ["cut", "emptied", "removed"])
def test_an_ended_run_whose_records_were_cut_afterwards(tmp_path, capsys, damage):
    """A run writes its summary after its last record, so a finished run's records end at the last good
    iteration its summary names; fewer (a copy cut short, a hand-edited file) are not the run's records."""
    run = make_run(tmp_path / "runs", "a", "full", [it(2.0, 1.0), it(2.0, 1.0), it(2.0, 1.0)])
    summary = json.loads((run / "summary.json").read_text())
    (run / "summary.json").write_text(json.dumps({**summary, "iterations": 3, "last_good_iteration": 2}))
    assert main(["report", "--runs", str(run), "--tables", str(tmp_path / "whole")]) == 0
    metrics = run / "metrics.jsonl"
    if damage == "cut":
        metrics.write_bytes(metrics.read_bytes()[:-40])  # the last line torn
    elif damage == "emptied":
        metrics.write_text("")
    else:
        metrics.unlink()
    line = report_fails(capsys, tmp_path, "--runs", str(tmp_path / "runs"))
    if damage == "removed":  # said "(0 records)" as if the file were there and empty
        assert line == (f"agg-bench report: {metrics}: no such file, where summary.json names iteration 2 as the last "
                        "good one; expected the records the run wrote (the file was removed)")
    else:
        assert f"{metrics}: no ok record of iteration 2" in line


def test_a_nan_in_a_whole_last_line_is_named(tmp_path, capsys):
    """Only a last line without its newline is torn (a writer killed mid-line); a last line whose newline was
    written, holding NaN, was skipped as torn, and the refusal then said the records lacked the last good one.
    The evaluations (which the learning tables read) are read so too."""
    run = make_run(tmp_path / "runs", "a", "full", [it(2.0, 1.0), it(2.0, 1.0)])
    summary = json.loads((run / "summary.json").read_text())
    (run / "summary.json").write_text(json.dumps({**summary, "iterations": 2, "last_good_iteration": 1}))
    metrics = run / "metrics.jsonl"
    first, last = metrics.read_text().splitlines()
    metrics.write_text(first + "\n" + last.replace('"reward_mean": 1.0', '"reward_mean": NaN') + "\n")
    line = report_fails(capsys, tmp_path, "--runs", str(tmp_path / "runs"))
    nan = "NaN is not a JSON number (agg-bench writes a number that is not finite as null)"
    assert line == f"agg-bench report: {metrics}: line 2 is not valid JSON ({nan}); the file is damaged"
    (run / "evaluations.jsonl").write_text('{"iteration": 0, "eval_reward": 1.0}\n{"iteration": 1, "eval_reward": NaN}\n')
    with pytest.raises(UserError) as err:
        RunFolder(run).evaluations()
    assert str(err.value) == f"{run / 'evaluations.jsonl'}: line 2 is not valid JSON ({nan}); the file is damaged"


@pytest.mark.parametrize("value", ["2", -1, 1.5, True])
def test_a_summary_whose_last_good_iteration_is_no_iteration(tmp_path, capsys, value):
    run = make_run(tmp_path / "runs", "a", "full", [it(2.0, 1.0)])
    summary = json.loads((run / "summary.json").read_text())
    (run / "summary.json").write_text(json.dumps({**summary, "last_good_iteration": value}))
    line = report_fails(capsys, tmp_path, "--runs", str(tmp_path / "runs"))
    assert f"summary.json: 'last_good_iteration' = {value!r}: expected an integer >= 0 or null" in line


@pytest.mark.parametrize("summary", ["{}", '{"x": 1}', '{"run_id": "a", "status": null}'])
def test_a_summary_without_a_status_is_no_run_s(tmp_path, capsys, summary):
    """Every attempt's summary.json says how it ended: someone's summary.json without one was reported as an
    interrupted run of no method."""
    (tmp_path / "theirs").mkdir()
    (tmp_path / "theirs" / "summary.json").write_text(summary)
    line = report_fails(capsys, tmp_path, "--runs", str(tmp_path / "theirs"))
    assert f"{tmp_path / 'theirs' / 'summary.json'}: no 'status'; expected the summary.json of an agg-bench run, " \
           "whose status is one of ok, oom, diverged, interrupted, error" in line, line


@pytest.mark.parametrize("tables, plots", [("out", "out/plots"), ("out/tables", "out")])
def test_tables_and_plots_one_inside_the_other_are_refused(sweep, tmp_path, capsys, tables, plots):
    """The inner folder would be a folder the outer one's report files do not include, so the same command
    run again would refuse its own output: refused at once, nothing written."""
    capsys.readouterr()
    args = ["report", "--runs", str(tmp_path / "runs"), "--tables", str(tmp_path / tables),
            "--plots", str(tmp_path / plots)]
    assert main(args) == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and "is inside" in lines[0] and "--tables" in lines[0] and "--plots" in lines[0], lines
    assert not (tmp_path / "out").exists()


def test_a_gradcheck_csv_given_twice_is_refused(sweep, gradcheck_csv, tmp_path, capsys):
    """Its rows would stand twice in the ablation table, and a run row would match two of them (no cosine)."""
    line = report_fails(capsys, tmp_path, "--runs", str(tmp_path / "runs"), "--gradcheck", str(gradcheck_csv),
                        str(tmp_path / "." / gradcheck_csv.name))
    assert "is also given as" in line and "expected each gradcheck CSV once" in line


def test_a_record_written_with_a_non_finite_number(tmp_path, capsys):
    """A run writes NaN and infinities as null; a file holding one was not written by a run."""
    run = make_run(tmp_path / "runs", "a", "full", [it(2.0, 1.0)])
    with open(run / "metrics.jsonl", "a") as fh:
        fh.write('{"iteration": 1, "status": "ok", "reward_mean": NaN}\n{"iteration": 2}\n')
    line = report_fails(capsys, tmp_path, "--runs", str(tmp_path / "runs"))
    assert "metrics.jsonl: line 2 is not valid JSON (NaN is not a JSON number" in line


def test_labels_with_dollars_are_drawn_as_text(tmp_path, capsys):
    """Matplotlib's mathtext would parse $...$ in a model or method label (and fail on an unbalanced one)."""
    runs = tmp_path / "runs"
    make_run(runs, "a", "full", [it(2.0, 1.0, backward=8), it(2.0, 2.0, backward=8)], model="$x^$")
    make_run(runs, "b", "agg$W=5$", [it(1.0, 1.0, backward=4), it(1.0, 3.0, backward=4)], model="$x^$",
             config=False)  # an imported log's label
    assert main(["report", "--runs", str(runs), "--plots", str(tmp_path / "plots")]) == 0
    for name in PLOTS:
        assert (tmp_path / "plots" / f"{name}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"



def test_time_plots_have_one_y_label_and_plain_tick_labels(sweep, tmp_path, monkeypatch):
    """The time plots' panels share one y label for the figure (a label per panel ran into the neighbouring
    panels), and the log axis of time vs resolution labels its ticks as numbers, not as mathtext source."""
    import agg_bench.results.plots as plots

    figures = {}

    def keep(fig, path):
        fig.canvas.draw()
        figures[Path(path).stem] = fig

    monkeypatch.setattr(plots, "save_figure", keep)
    assert main(["report", "--runs", str(tmp_path / "runs"), "--plots", str(tmp_path / "plots")]) == 0
    for name in ("time_breakdown", "time_resolution"):
        fig = figures[name]
        assert fig.get_supylabel().startswith("seconds per iteration, median"), name
        assert [ax.get_ylabel() for ax in fig.axes if ax.get_visible() and ax.get_ylabel()] == [], name
    ticks = [t.get_text() for ax in figures["time_resolution"].axes for t in ax.get_yticklabels(which="both")]
    assert any(ticks) and not [t for t in ticks if "$" in t or "mathdefault" in t], ticks


def test_a_log_without_a_resolution_is_one_panel(tmp_path, monkeypatch):
    """Missing labels are one value: an imported log without --resolution is one panel with its data (not
    one empty panel per iteration)."""
    import agg_bench.results.plots as plots

    log = tmp_path / "log.jsonl"
    log.write_text("".join(json.dumps({"step": s, "avg_reward": 0.1 * s, "step_time": 10.0 + s, "grad_norm": 0.1})
                           + "\n" for s in range(1, 6)))
    import_log(log, tmp_path / "ref")
    figures = {}
    monkeypatch.setattr(plots, "save_figure", lambda fig, path: figures.setdefault(Path(path).stem, fig))
    assert main(["report", "--runs", str(tmp_path / "ref"), "--plots", str(tmp_path / "plots")]) == 0
    for name in ("reward_iteration", "reward_wallclock", "time_breakdown"):
        [panel] = [ax for ax in figures[name].axes if ax.get_visible()]
        assert panel.lines or panel.patches, name

MANIFEST_RUN = {"dir": "RUN", "method": "full", "model": "sd3", "resolution": 64, "seed": 0}


@pytest.mark.parametrize("manifest, expected", [
    ("not json", "is not JSON (Expecting value at line 1 column 1)"),
    ('["runs"]', "holds a list, not a JSON object; expected a report manifest"),
    ({"runs": {"dir": "RUN"}}, "manifest MANIFEST: runs = {'dir': 'RUN'}: expected a list"),
    ({"runs": ["RUN"]}, "runs[0] = 'RUN': expected an object"),
    ({"runs": [{"method": "full"}]}, "runs[0]: missing 'dir'"),
    ({"runs": [{**MANIFEST_RUN, "resolution": "64"}]}, "runs[0].resolution = '64': expected an integer from 1 to 4,096 or null"),
    ({"runs": [{**MANIFEST_RUN, "seed": 1.5}]}, "runs[0].seed = 1.5: expected an integer"),
    ({"runs": [{**MANIFEST_RUN, "method_options": "agg"}]}, "runs[0].method_options = 'agg': expected an object"),
    ({"runs": [{**MANIFEST_RUN, "colour": "red"}]}, "runs[0]: unknown key 'colour'"),
    # a label no table row can show: a newline split the row in the Markdown tables
    ({"runs": [{**MANIFEST_RUN, "method": "a\nb"}]},
     "runs[0].method = 'a\\nb': expected a label of 1 to 200 printable characters or null"),
    ({"runs": [{**MANIFEST_RUN, "device": ""}]}, "runs[0].device = '': expected a label of 1 to 200 printable"),
    ({"runs": [MANIFEST_RUN], "gradcheck": [{"file": "G", "model": "x" * 201}]}, "gradcheck[0].model = 'xxx"),
    ({"runs": [MANIFEST_RUN], "gradcheck": [{"file": 3}]}, "gradcheck[0].file = 3: expected a file or folder name"),
    ({"runs": [MANIFEST_RUN], "calibration": [{"model": "sd3"}]}, "calibration[0]: missing 'file'"),
    ({"runs": [MANIFEST_RUN], "warmup": -1}, "warmup = -1: expected an integer from 0 to 100,000"),
    ({"runs": [MANIFEST_RUN], "warmup": "1"}, "warmup = '1': expected an integer from 0 to 100,000"),
    ({"runs": [MANIFEST_RUN], "warmup": 10**30}, f"warmup = {10**30}: expected an integer from 0 to 100,000"),
    ({"runs": [MANIFEST_RUN], "time": "gpu"}, "time = 'gpu': expected one of auto, cpu, wall"),
    ({"runs": [MANIFEST_RUN], "run": []}, "unknown key 'run'"),
])
def test_a_bad_manifest_names_the_file_and_the_key(tmp_path, capsys, manifest, expected):
    run = make_run(tmp_path / "runs", "a", "full", [it(2.0, 1.0)])
    path = tmp_path / "manifest.json"
    text = manifest if isinstance(manifest, str) else json.dumps(manifest)
    path.write_text(text.replace("RUN", str(run)))
    line = report_fails(capsys, tmp_path, "--manifest", str(path))
    assert str(path) in line and expected.replace("RUN", str(run)).replace("MANIFEST", str(path)) in line


@pytest.mark.parametrize("calibration, expected", [
    (b"\xff\xfe", "is not UTF-8 text"),
    (b"", "is not JSON"),
    (b"[1]", "holds a list, not a JSON object; expected an agg-bench calibrate JSON"),
    ({"resolution": "64"}, "resolution = '64': expected an integer from 1 to"),
    # the labels and sizes calibrate writes: a resolution a run may have, its batch, the latents of its timed calls
    ({"resolution": -64}, "resolution = -64: expected an integer from 1 to 4,096 or null"),
    ({"batch": -4}, "batch = -4: expected an integer >= 1 (the samples calibrate timed) or null"),
    ({"batch": 4, "unit_s_per_call": {"backward": {"latents": [5, 1]}}},
     "unit_s_per_call.backward.latents = [5, 1]: expected [4, 1]: the batch (4) and then 1"),
    ({"unit_s_per_call": {"forward_nograd": {"latents": [40, 1, 7]}}},
     "unit_s_per_call.forward_nograd.latents = [40, 1, 7]: expected a list of the latents of the calls timed"),
    ({"unit_s_per_call": {"forward_nograd": {"latents": [-40, 1]}}}, "forward_nograd.latents = [-40, 1]: expected"),
    ({"unit_s_per_call": {"forward_nograd": {"latents": [40, 1], "cpu": {"call": 0, "latent": 0.1, "median": [1.0]}}}},
     "unit_s_per_call.forward_nograd.cpu.median = [1.0]: expected one number of seconds > 0 and <= 1e6 per entry of "
     "latents [40, 1]"),
    ({"unit_s_per_sample": [1]}, "unit_s_per_sample = [1]: expected an object"),
    ({"unit_s_per_sample": {"backward": {"cpu": 0.1}}}, "unit_s_per_sample.backward.cpu = 0.1: expected an object"),
    ({"unit_s_per_sample": {"backward": {"cpu": {"median": "x"}}}}, "backward.cpu.median = 'x': expected a number"),
    ({"methods": {"agg": {"cpu_s": [1, "x"]}}}, "methods.agg.cpu_s = [1, 'x']: expected a list of numbers"),
    ({"methods": {"agg": {"rollout_wall_s": 1.0}}}, "methods.agg.rollout_wall_s = 1.0: expected a list of numbers"),
    ({"methods": {"agg": {"rollout_forwards": "4"}}}, "methods.agg.rollout_forwards = '4': expected a number"),
    # unit costs are times: > 0, finite, and small enough that the predictions priced with them stay finite
    ({"unit_s_per_sample": {"backward": {"cpu": {"median": -0.05}}}},
     "unit_s_per_sample.backward.cpu.median = -0.05: expected a number of seconds > 0 and <= 1e6 or null"),
    ({"unit_s_per_sample": {"backward": {"cpu": {"median": 0}}}}, "backward.cpu.median = 0: expected a number of"),
    ({"unit_s_per_sample": {"backward": {"cpu": {"median": 1e308}}}}, "backward.cpu.median = 1e+308: expected"),
    (b'{"unit_s_per_sample": {"backward": {"cpu": {"median": NaN}}}}', "NaN is not a JSON number"),
    ({"unit_s_per_call": {"backward": {"cpu": {"call": -1.0, "latent": 0.1}, "wall": {"call": 0, "latent": 0}}}},
     "unit_s_per_call.backward.cpu.call = -1.0: expected a number of seconds >= 0 and <= 1e6 or null"),
    ({"methods": {"agg": {"cpu_s": [1.0, 0.0]}}}, "methods.agg.cpu_s = [1.0, 0.0]: expected a list of numbers of seconds > 0"),
    ({"methods": {"agg": {"passes": {"backward": -8}}}}, "methods.agg.passes = {'backward': -8}: expected an object of numbers >= 0"),
    ({"methods": {"agg": {"optimizer_steps": 1e300}}}, "methods.agg.optimizer_steps = 1e+300: expected a number >= 0 and <= 1e15"),
])
def test_a_bad_calibration_file_names_the_file_and_the_key(tmp_path, capsys, calibration, expected):
    make_run(tmp_path / "runs", "a", "full", [it(2.0, 1.0)])
    path = tmp_path / "calibration.json"
    path.write_bytes(calibration if isinstance(calibration, bytes) else json.dumps(calibration).encode())
    line = report_fails(capsys, tmp_path, "--runs", str(tmp_path / "runs"), "--calibration", str(path))
    assert str(path) in line and expected in line
    # the same file named by a manifest
    manifest = tmp_path / "manifest.json"
    manifest.write_text(json.dumps({"runs": [{"dir": str(tmp_path / "runs" / "a")}], "calibration": [{"file": str(path)}]}))
    assert expected in report_fails(capsys, tmp_path, "--manifest", str(manifest))


def test_a_calibration_as_calibrate_writes_it_is_read(tmp_path, capsys):
    """What ``agg-bench calibrate`` writes is read: null for a median it has no time for (NaN, written as null),
    0 for a part of a call's cost (the fit clips either part at 0), counts of 0."""
    make_run(tmp_path / "runs", "a", "full", [it(2.0, 1.0), it(2.0, 1.0)])
    path = tmp_path / "calibration.json"
    path.write_text(json.dumps({
        "model": "sd3-tiny", "resolution": 64, "device": "cpu",
        "unit_s_per_sample": {"backward": {"cpu": {"median": 0.05}, "wall": {"median": None}}},
        "unit_s_per_call": {"backward": {"cpu": {"call": 0.0, "latent": 0.05}, "wall": {"call": None, "latent": 0}}},
        "methods": {"full": {"cpu_s": [1.5, 1.6], "passes": {"forward_nograd": 0, "backward": 8},
                             "optimizer_steps": 1}}}))
    assert main(["report", "--runs", str(tmp_path / "runs"), "--calibration", str(path),
                 "--tables", str(tmp_path / "tables")]) == 0, capsys.readouterr().err


CALIBRATION = {"model": "sd3-tiny", "resolution": 64, "device": "cpu",
               "unit_s_per_sample": {"backward": {"cpu": {"median": 0.05}, "wall": {"median": 0.06}}},
               "methods": {"full": {"cpu_s": [1.5, 1.6]}}}


def test_one_calibration_under_two_names_is_refused(tmp_path, capsys):
    """A calibration is its content (loading.calibration_identity), not its file's name: one copied under another
    stamp stood twice among its cell's calibrations, the copy's stamp placing it after those taken since (the
    cost model prices a row from the last one); so does one file given twice. Another measurement is read."""
    make_run(tmp_path / "runs", "a", "full", [it(2.0, 1.0), it(2.0, 1.0)])
    (tmp_path / "cal").mkdir()
    first, copy, other = (tmp_path / "cal" / f"2026010{k}T000000_01_sd3_64px_cpu.json" for k in (1, 2, 3))
    first.write_text(json.dumps(CALIBRATION))
    copy.write_text(json.dumps(CALIBRATION, indent=1))  # the same content, written otherwise
    other.write_text(json.dumps({**CALIBRATION, "methods": {"full": {"cpu_s": [1.5, 1.7]}}}))
    runs = ["--runs", str(tmp_path / "runs")]
    assert main(["report", *runs, "--calibration", str(first), str(other), "--tables", str(tmp_path / "t")]) == 0
    line = report_fails(capsys, tmp_path, *runs, "--calibration", str(first), str(other), str(copy))
    assert f"calibration '{copy}' holds the same calibration as '{first}' (the same content" in line, line
    line = report_fails(capsys, tmp_path, *runs, "--calibration", str(first), str(first))
    assert f"calibration '{first}' is given twice" in line, line


def test_an_archive_calibration_the_reference_holds_under_another_name_is_refused(tmp_path):
    """campaign unpack: a calibration of the archive that the reference holds under another stamp (or that the
    archive holds twice) is refused naming both, before anything moves; the reference's own file again (the same
    name and bytes) is no copy."""
    from types import SimpleNamespace

    from agg_bench.tools.archive import check_one_name_per_calibration
    from agg_bench.tools.campaign import Campaign

    campaign = SimpleNamespace(finished_files=Campaign.finished_files)
    reference = tmp_path / "ref"
    (reference / "calibration").mkdir(parents=True)
    held = json.dumps(CALIBRATION).encode()
    (reference / "calibration" / "20260101T000000_01_sd3_64px_cpu.json").write_bytes(held)
    other = json.dumps({**CALIBRATION, "methods": {"full": {"cpu_s": [1.5, 1.7]}}}).encode()
    check_one_name_per_calibration(campaign, "archive A", {"calibration/20260101T000000_01_sd3_64px_cpu.json": held,
                                                           "calibration/20260102T000000_01_sd3_64px_cpu.json": other,
                                                           "windows/20260102T000000.json": b"{}"}, reference)
    for files in ({"calibration/20260105T000000_01_sd3_64px_cpu.json": held},
                  {"calibration/20260102T000000_01_sd3_64px_cpu.json": other,
                   "calibration/20260103T000000_02_sd3_64px_cpu.json": other}):
        with pytest.raises(UserError, match="holds the same calibration as") as err:
            check_one_name_per_calibration(campaign, "archive A", files, reference)
        assert str(err.value).count("calibration/2026010") == 2 and "\n" not in str(err.value), err.value


# ----- gradcheck CSVs: what agg-bench gradcheck writes, or one line -----------------------------------------
GRADCHECK_HEADER = "method,window,alpha,route_frac,reuse_rollout_velocity,cosine_to_full,relative_error," \
    "forward_nograd,forward_grad,backward,seconds,cache_hit_rate,model\n"
GRADCHECK_ROWS = ["full,,,,,1.0,0.0,0,8,8,0.03,,sd3\n", "agg,3,sigma,1.0,False,0.99,0.08,6,6,6,0.02,,sd3\n"]


@pytest.mark.parametrize("content, expected", [
    (b"", "not a table CSV (No columns to parse from file)"),
    (b"a,b\n1,2\n", "no column 'method' (expected the table agg-bench gradcheck writes)"),
    (b"method,window\nagg,3\n", "no column 'cosine_to_full'"),
    (b"method,cosine_to_full\n\xff\xfe,1\n", "not a table CSV: not UTF-8 text (invalid start byte at byte "),
    ('"unclosed\n' + GRADCHECK_HEADER, "not a table CSV"),
    ("FOLDER", "is a folder; expected a gradcheck CSV"),
    ("NOWHERE", "no such file; expected a gradcheck CSV"),
    (GRADCHECK_ROWS[1].replace("0.99", "abc"), "row 2: cosine_to_full = 'abc': expected a finite number >= -1 and <= 1"),
    (GRADCHECK_ROWS[1].replace("0.99", "inf"), "row 2: cosine_to_full = 'inf': expected a finite number"),
    (GRADCHECK_ROWS[1].replace("0.99", "-inf"), "row 2: cosine_to_full = '-inf': expected a finite number"),
    (GRADCHECK_ROWS[1].replace("0.99", "1.5"), "row 2: cosine_to_full = '1.5': expected a finite number >= -1"),
    (GRADCHECK_ROWS[1].replace("0.99", "NaN"), "row 2: cosine_to_full = 'NaN': expected a finite number"),
    (GRADCHECK_ROWS[1].replace(",0.08,", ",1e999,"), "row 2: relative_error = '1e999': expected a finite number >= 0"),
    (GRADCHECK_ROWS[1].replace(",0.08,", ",nan,").replace(",6,6,6,", ",6,-5,6,"),
     "row 2: forward_grad = '-5': expected an integer >= 0, or an empty cell"),
    (GRADCHECK_ROWS[1].replace(",6,6,6,", ",6,6,2.5,"), "row 2: backward = '2.5': expected an integer >= 0"),
    (GRADCHECK_ROWS[1].replace("0.02", "0"), "row 2: seconds = '0': expected a finite number > 0"),
    (GRADCHECK_ROWS[1].replace("agg,3,", "agg,0,"), "row 2: window = '0': expected an integer >= 1"),
    (GRADCHECK_ROWS[1].replace("1.0,False", "2.0,False"), "row 2: route_frac = '2.0': expected a finite number >= 0 and <= 1"),
    (GRADCHECK_ROWS[1].replace("False", "maybe"), "row 2: reuse_rollout_velocity = 'maybe': expected True or False"),
    (GRADCHECK_ROWS[1].replace(",0.02,,", ",0.02,1.5,"), "row 2: cache_hit_rate = '1.5': expected a finite number >= 0 and <= 1"),
    (GRADCHECK_ROWS[1].replace("agg,", ",", 1), "row 2: method is empty; expected a text that is not empty"),
    # the model its rows were measured at, which --gradcheck without a manifest's label reads from the CSV: the
    # note on rows no run matches called it "nan"
    ("method,cosine_to_full\nfull,1.0\n", "no column 'model' (expected the table agg-bench gradcheck writes, whose "
     "model column names the model of its rows, or a manifest's gradcheck entry naming it)"),
    (GRADCHECK_ROWS[1].replace(",sd3\n", ",\n"), "row 2: model is empty; expected a text that is not empty"),
])
def test_a_bad_gradcheck_csv_names_the_file(tmp_path, capsys, content, expected):
    """A gradcheck CSV that is not what agg-bench gradcheck writes is one line naming it, the row, the column and
    the value; exit 2, and neither tables nor plots are written."""
    make_run(tmp_path / "runs", "a", "full", [it(2.0, 1.0), it(2.0, 1.0)])
    path = tmp_path / ("folder" if content == "FOLDER" else "gc.csv")
    if content == "FOLDER":
        path.mkdir()
    elif isinstance(content, bytes):
        path.write_bytes(content)
    elif content != "NOWHERE":
        path.write_text(content if content.startswith(("method", '"')) else
                        GRADCHECK_HEADER + GRADCHECK_ROWS[0] + content)
    line = report_fails(capsys, tmp_path, "--runs", str(tmp_path / "runs"), "--gradcheck", str(path))
    assert f"gradcheck {path}: {expected}" in line, line


def test_a_gradcheck_csv_as_gradcheck_writes_it_is_read(tmp_path):
    """The table agg-bench gradcheck writes is read, with its own cells: ``nan`` for a cosine and a relative
    error that are not defined (a gradient of norm 0) is an empty cell, and a replay that is not applicable has
    no numbers."""
    from agg_bench.tools.gradcheck import COLUMNS, write_csv

    rows = [{"method": "full", "cosine_to_full": 1.0, "relative_error": 0.0, "forward_nograd": 0, "forward_grad": 8,
             "backward": 8, "seconds": 0.03, "is_reference": True, "model": "sd3"},
            {"method": "agg", "window": 3, "alpha": "sigma", "route_frac": 1.0, "reuse_rollout_velocity": False,
             "cosine_to_full": float("nan"), "relative_error": float("nan"), "forward_nograd": 6, "forward_grad": 6,
             "backward": 6, "seconds": 0.02, "is_reference": False, "model": "sd3"},
            {"method": "cached", "cache": "fora", "cache_in": "rollout", "replay": "not_applicable", "model": "sd3"}]
    path = write_csv([dict.fromkeys(COLUMNS) | row for row in rows], tmp_path / "gc.csv")
    assert "agg,,3,sigma,1.0,False,recompute" not in path.read_text() and ",nan,nan," in path.read_text()
    table = ablation_table(load_gradcheck([GradcheckEntry(path, model="sd3", resolution=64)]))
    assert list(table["method"]) == ["full", "agg", "cached"]
    assert table["cosine_to_full"].iloc[0] == 1.0 and table["cosine_to_full"].iloc[1:].isna().all()
    assert table["relative_error"].iloc[1:].isna().all() and table["backward_vs_full"].iloc[1] == 0.75
    assert list(table["window"].iloc[:2].isna()) == [True, False] and table["window"].iloc[1] == 3


def test_an_older_gradcheck_csv_s_agg_rows_hold_the_endpoint_velocity_default(tmp_path):
    """A gradcheck CSV written before the endpoint_velocity column existed (write_gradcheck_csv's) ran AGG with
    the option's default: beside a newer CSV that writes the default, the ablation table holds one setting, not
    an empty cell and the default as two; a method without the option keeps the cell empty."""
    from agg_bench.methods.agg import AGGConfig
    old = write_gradcheck_csv(tmp_path / "old.csv")
    assert "endpoint_velocity" not in pd.read_csv(old)
    new = tmp_path / "new.csv"
    pd.read_csv(old).assign(endpoint_velocity=lambda df: df["method"].map({"agg": AGGConfig().endpoint_velocity})) \
        .to_csv(new, index=False)
    table = ablation_table(load_gradcheck([GradcheckEntry(old, model="sd3", resolution=64),
                                           GradcheckEntry(new, model="sd3", resolution=128)]))
    agg = table[table["method"] == "agg"]
    assert len(agg) == 6 and set(agg["endpoint_velocity"]) == {AGGConfig().endpoint_velocity}
    assert table.loc[table["method"] == "full", "endpoint_velocity"].isna().all()
    old_rows = table[table["resolution"] == 64].drop(columns="resolution").reset_index(drop=True)
    new_rows = table[table["resolution"] == 128].drop(columns="resolution").reset_index(drop=True)
    pd.testing.assert_frame_equal(old_rows, new_rows)  # the same settings, whichever CSV holds them


def test_a_gradcheck_csv_given_without_labels_keeps_its_resolution(tmp_path):
    """`report --gradcheck FILE` names no resolution: the one gradcheck wrote is the row's, and the replays
    of one snapshot are compared with its full replay."""
    path = write_gradcheck_csv(tmp_path / "gc.csv")
    pd.read_csv(path).assign(resolution=32).to_csv(path, index=False)
    table = ablation_table(load_gradcheck([GradcheckEntry(path)]))
    assert list(table["resolution"]) == [32] * 4
    w5 = table[(table["window"] == 5) & (table["alpha"] == "sigma")].iloc[0]
    assert w5["backward_vs_full"] == pytest.approx(0.4, abs=1e-12)
    assert w5["speedup_vs_full"] == pytest.approx(2.0, abs=1e-12)
    labelled = ablation_table(load_gradcheck([GradcheckEntry(path, model="sd3", resolution=64)]))
    assert list(labelled["resolution"]) == [64] * 4  # a manifest's label is the row's


@pytest.mark.parametrize("name, column, value, expected", [
    ("records.csv", "t_iter_s", "abc", "row 1: t_iter_s = 'abc': expected a finite number, or an empty cell"),
    ("records.csv", "reward_mean", "inf", "row 1: reward_mean = 'inf': expected a finite number"),
    ("records.csv", "iteration", "-1", "row 1: iteration = '-1': expected an integer >= 0"),
    ("efficiency.csv", "train_speedup", "-inf", "row 1: train_speedup = '-inf': expected a finite number"),
    ("efficiency.csv", "peak_alloc_mib", "many", "row 1: peak_alloc_mib = 'many': expected a finite number"),
    ("ablation.csv", "cosine_to_full", "nan", "row 1: cosine_to_full = 'nan': expected a finite number"),
    ("ablation.csv", "window", "2.5", "row 1: window = '2.5': expected an integer"),
    ("ablation.csv", "reuse_rollout_velocity", "perhaps", "row 1: reuse_rollout_velocity = 'perhaps': expected True or False"),
])
def test_tables_in_names_a_cell_that_is_not_what_the_report_wrote(sweep, gradcheck_csv, tmp_path, capsys, name,
                                                                   column, value, expected):
    """A number of a written table that is text, NaN or an infinity is one line naming the table, the row, the
    column and the value (the plots ended in a TypeError on text, and drew an infinity); nothing is drawn."""
    tables = tmp_path / "tables"
    assert main(["report", "--runs", str(tmp_path / "runs"), "--gradcheck", str(gradcheck_csv),
                 "--tables", str(tables)]) == 0
    with open(tables / name, newline="") as fh:
        rows = list(csv.DictReader(fh))
    rows[0][column] = value
    with open(tables / name, "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    capsys.readouterr()
    assert main(["report", "--tables-in", str(tables), "--plots", str(tmp_path / "out")]) == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and f"{tables / name}: {expected}" in lines[0], lines
    assert not (tmp_path / "out").exists()


def test_a_ratio_over_zero_seconds_is_an_empty_cell(tmp_path, capsys, monkeypatch):
    """A record may hold 0 s (the record contract takes any finite number): the speedups over it are not defined,
    empty cells rather than infinities, so the tables as written are read back (--tables-in) and drawn; numpy's
    warnings about the ratios are not printed."""
    from agg_bench.results import report

    # the first report draws the plots; the one from --tables-in is checked to hand them the same tables, exactly
    # (each set of plots drawn takes seconds)
    drawn = DrawnOnce()
    monkeypatch.setattr(report, "write_plots", drawn)
    runs = tmp_path / "runs"
    make_run(runs, "a", "full", [it(2.0, 1.0, backward=8), it(2.0, 2.0, backward=8)])
    make_run(runs, "b", "agg", [it(0.0, 1.0, 0.0, backward=4), it(0.0, 3.0, 0.0, backward=4)])
    tables = tmp_path / "tables"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert main(["report", "--runs", str(runs), "--tables", str(tables), "--plots", str(tmp_path / "plots")]) \
            == 0, capsys.readouterr().err
    assert not [w for w in caught if issubclass(w.category, RuntimeWarning)], [str(w.message) for w in caught]
    for name in TABLES:
        text = (tables / f"{name}.csv").read_text()
        assert "inf" not in text, (name, text)
    agg = cell(pd.read_csv(tables / "efficiency.csv"), "agg", 64)
    assert agg["t_iter_s"] == 0 and math.isnan(agg["speedup"]) and math.isnan(agg["train_speedup"])
    assert main(["report", "--tables-in", str(tables), "--plots", str(tmp_path / "again")]) == 0
    assert drawn.calls == 2 and sorted(p.name for p in (tmp_path / "again").glob("*.png")) == \
        sorted(f"{name}.png" for name in PLOTS)


# ----- run folders: each once, each there --------------------------------------------------------------------
@pytest.mark.parametrize("given, expected", [
    (["RUNS/a", "RUNS/a"], "run 'RUNS/a' is also given as 'RUNS/a' (the same folder); expected each run once"),
    (["RUNS/a", "RUNS/b/../a"], "run 'RUNS/b/../a' is also given as 'RUNS/a' (the same folder)"),
    (["RUNS", "RUNS/b"], "run 'RUNS/b' is also given as 'RUNS/b' (the same folder)"),
    (["RUNS/a", "NOWHERE"], "--runs 'NOWHERE': no such folder; expected a run folder or a folder of run folders"),
    (["NOWHERE"], "--runs 'NOWHERE': no such folder"),
    (["RUNS/a/summary.json"], "--runs 'RUNS/a/summary.json': not a run folder or a folder of run folders"),
    (["RUNS/a", "EMPTY"], "--runs 'EMPTY': holds no run folder (a folder with summary.json or metrics.jsonl)"),
])
def test_runs_given_twice_or_not_there(tmp_path, capsys, given, expected):
    """A run folder given twice (its records would count twice) and a path that does not exist, is a file or
    holds no run folder (a typo's folder would add nothing, silently) are one line naming it."""
    runs = tmp_path / "runs"
    make_run(runs, "a", "full", [it(2.0, 1.0), it(2.0, 1.0)])
    make_run(runs, "b", "agg", [it(1.0, 1.0), it(1.0, 2.0)])
    (tmp_path / "empty" / "notes").mkdir(parents=True)
    names = {"RUNS": str(runs), "NOWHERE": str(tmp_path / "nowhere"), "EMPTY": str(tmp_path / "empty")}

    def named(text):
        for key, value in names.items():
            text = text.replace(key, value)
        return text

    line = report_fails(capsys, tmp_path, "--runs", *map(named, given))
    assert named(expected) in line, line


def test_a_run_in_the_manifest_and_in_runs_counts_once(tmp_path, capsys):
    run = make_run(tmp_path / "runs", "a", "full", [it(2.0, 1.0), it(2.0, 1.0)])
    manifest = tmp_path / "manifest.json"
    manifest.write_text(json.dumps({"runs": [{"dir": str(run)}]}))
    line = report_fails(capsys, tmp_path, "--manifest", str(manifest), "--runs", str(run))
    assert f"run {str(run)!r} is also given as {str(run)!r}" in line
    assert main(["report", "--manifest", str(manifest), "--tables", str(tmp_path / "t")]) == 0
    assert pd.read_csv(tmp_path / "t" / "efficiency.csv")["iterations"].tolist() == [2]


def test_the_tables_are_the_pinned_ones():
    """Every table file of a fixed set of inputs (tests/pinned_report.py) is the stored one, byte for byte:
    the same columns, cells and formatting."""
    from pinned_report import PINNED_TABLES, compute

    expected = {path.name: path.read_text() for path in sorted(PINNED_TABLES.iterdir())}
    actual = compute()
    assert sorted(actual) == sorted(expected)
    assert [name for name in expected if actual[name] != expected[name]] == []
    # the efficiency table's columns other tools read (docs/design.md, Tables), by name, and its sources
    import csv
    import io

    rows = list(csv.DictReader(io.StringIO(actual["efficiency.csv"])))
    contract = ("method", "method_name", "method_options", "model", "resolution", "source", "train_speedup",
                "predicted_train_speedup", "speedup_lo", "speedup_hi")
    assert [column for column in contract if column not in rows[0]] == []
    assert {row["source"] for row in rows} == {"measured", "imported"}


def test_each_phases_cuda_peak_is_a_column_in_mib_and_not_a_methods_own_number():
    """A CUDA record's per-phase peaks (records.PHASE_PEAK_KEYS) are the efficiency table's peak_<phase>_mib,
    the largest over the run's iterations, and are not averaged again as a method's own fields."""
    import csv
    import io

    from pinned_report import compute

    rows = list(csv.DictReader(io.StringIO(compute()["efficiency.csv"])))
    assert not [c for c in rows[0] if c.startswith("peak_alloc_") and c != "peak_alloc_mib"]
    gpu = [r for r in rows if r["hardware"] == "GPU-A" and r["method"] == "full"][0]
    # the fixture: 80 MiB at the train phase, 3/4 of it in the reward phase, half (+ the iteration's index in
    # bytes, largest in the last of 3) in the rollout
    assert float(gpu["peak_train_mib"]) == float(gpu["peak_alloc_mib"]) == 80.0
    assert float(gpu["peak_reward_mib"]) == 60.0
    assert float(gpu["peak_rollout_mib"]) == (40 * MIB + 2) / MIB
    assert all(r["peak_train_mib"] == "" for r in rows if r["hardware"] == "cpu")


def test_gradcheck_rows_no_run_matches_are_named(sweep, gradcheck_csv, tmp_path, capsys):
    """A gradcheck CSV whose model column names another label than the runs record (one written before
    gradcheck took the run's label: ``sd3`` where runs say ``sd3-tiny``) fills no grad_cosine cell: the report
    says so in one line, and says nothing when the rows match."""
    old = tmp_path / "old.csv"
    pd.read_csv(gradcheck_csv).assign(resolution=64).to_csv(old, index=False)
    capsys.readouterr()
    assert main(["report", "--runs", str(tmp_path / "runs"), "--gradcheck", str(old),
                 "--tables", str(tmp_path / "old")]) == 0
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and "no run matches the gradcheck rows of sd3 at 64 px (the runs: sd3-tiny at 64 px, " \
        "sd3-tiny at 128 px)" in lines[0], lines
    assert pd.read_csv(tmp_path / "old" / "efficiency.csv")["grad_cosine"].isna().all()

    matching = tmp_path / "matching.csv"
    pd.read_csv(old).assign(model="sd3-tiny").to_csv(matching, index=False)
    assert main(["report", "--runs", str(tmp_path / "runs"), "--gradcheck", str(matching),
                 "--tables", str(tmp_path / "new")]) == 0
    assert capsys.readouterr().err == ""
    assert pd.read_csv(tmp_path / "new" / "efficiency.csv")["grad_cosine"].notna().any()


def test_report_refuses_a_run_that_another_process_is_replacing(tmp_path, capsys):
    """A run folder whose claim another process holds is part old attempt, part new (here: the earlier run's
    records and the new config of another method, its summary already gone): report refuses it in one line
    naming the writer's PID, writes no table, and reads the run once the writer has ended."""
    from agg_bench.outdir import Claim
    from helpers import Holder

    run = make_run(tmp_path / "runs", "x", "full", [it(1.0, 0.1), it(1.0, 0.2)])
    holder = Holder(run, folder=True, lock_inside=True)
    try:
        (run / "summary.json").unlink()
        (run / "config.json").write_text(json.dumps({"method": AGG_OPTIONS}))
        assert main(["report", "--runs", str(tmp_path / "runs"), "--tables", str(tmp_path / "t")]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and f"PID {holder.proc.pid}" in err and "is writing" in err
        assert str(run) in err and not (tmp_path / "t").exists()
    finally:
        holder.close()
    with Claim(run, folder=True, lock_inside=True):  # the writer's last files, under its claim
        make_run(tmp_path / "new", "x", "agg", [it(1.0, 0.3)], options=AGG_OPTIONS)
        for name in ("metrics.jsonl", "summary.json"):
            (run / name).write_bytes((tmp_path / "new" / "x" / name).read_bytes())
    records = load_records([RunEntry(run)])
    assert set(records["method_name"]) == {"agg"} and set(records["run_status"]) == {"ok"}


def test_report_refuses_a_run_whose_files_change_while_it_reads_them(tmp_path, monkeypatch):
    """A writer that came and went between two of the reader's reads (the folder's lock free before and after)
    still changed the files: the run is refused, not read as part of each attempt."""
    from agg_bench.reading import RunFolder

    run = make_run(tmp_path / "runs", "x", "full", [it(1.0, 0.1), it(1.0, 0.2)])
    read = RunFolder.records

    def records_then_replaced(self, *args, **kwargs):
        records = read(self, *args, **kwargs)
        tmp = run / ".summary.agg-bench-tmp1.json"
        tmp.write_text(json.dumps({"run_id": "x", "status": "error", "method": "full"}))
        os.replace(tmp, run / "summary.json")
        return records

    monkeypatch.setattr(RunFolder, "records", records_then_replaced)
    with pytest.raises(UserError, match="changed while they were read"):
        load_records([RunEntry(run)])


def test_report_of_a_folder_of_runs_skips_staging_folders_and_refuses_a_run_being_imported(tmp_path, capsys):
    """import-log writes its run into a staging folder beside it (a harness temporary name) and renames it over
    the run, its lock beside the run: while it holds that lock, report of the folder of runs refuses the run in one
    line with the writer's PID; a staging folder, a live writer's or a killed one's, is never read as a run."""
    from helpers import ENDED_PID, Holder

    runs = tmp_path / "runs"
    run = make_run(runs, "imp", "full", [it(1.0, 0.1), it(1.0, 0.2)])
    staging = runs / f".imp.agg-bench-tmp{ENDED_PID}"
    make_run(tmp_path / "new", "other", "full", [it(2.0, 0.3)])
    (tmp_path / "new" / "other").rename(staging)
    holder = Holder(run, folder=True, lock_inside=False)
    try:
        assert main(["report", "--runs", str(runs), "--tables", str(tmp_path / "t")]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and f"PID {holder.proc.pid}" in err and str(run) in err
        with pytest.raises(UserError, match=f"PID {holder.proc.pid}"):
            load_records([RunEntry(run)])
    finally:
        holder.close()
    assert main(["report", "--runs", str(runs), "--tables", str(tmp_path / "t")]) == 0
    summary = pd.read_csv(tmp_path / "t" / "summary.csv")
    assert len(summary) == 1 and set(load_records(discover_runs([runs]))["run_dir"]) == {str(run)}


@pytest.mark.parametrize("given", ["runs", "a run", "each run"])
def test_the_runs_of_a_reference_an_unpack_was_cut_off_in_are_refused(tmp_path, capsys, monkeypatch, given):
    """report --manifest REF/manifest.json refused a reference whose `campaign unpack` is under way or was cut off,
    but report --runs REF/runs read its runs, of two states, as if whole: refused in the manifest's words, found
    in the reference that holds the folder of runs (looked into once for all of them), nothing written; and so
    were --calibration and --gradcheck files of that reference."""
    from agg_bench.io import atomic_path
    from agg_bench.outputs import UNPACK_STAGING
    from helpers import ENDED_PID

    runs = tmp_path / "ref" / "runs"
    for name in ("a", "b"):
        make_run(runs, name, "full", [it(1.0, 0.1), it(1.0, 0.2)])
    paths = {"runs": [runs], "a run": [runs / "a"], "each run": [runs / "a", runs / "b"]}[given]
    tables = tmp_path / "t"
    assert main(["report", "--runs", *map(str, paths), "--tables", str(tables)]) == 0  # a whole reference
    capsys.readouterr()
    staging = atomic_path(tmp_path / "ref" / UNPACK_STAGING, ENDED_PID)  # a killed unpack's
    staging.mkdir()
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    assert main(["report", "--runs", *map(str, paths), "--tables", str(tmp_path / "t2")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and (f"--runs {paths[0]}: agg-bench campaign unpack into {tmp_path / 'ref'} is under way "
                              f"or was cut off ({staging.name} is there)") in err[0], err
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before
    # its manifest, named as written, the reference named as the runs' checks name it (its absolute path)
    (tmp_path / "ref" / "manifest.json").write_text("{}")
    monkeypatch.chdir(tmp_path)
    for verb in (["report", "--tables", "t4"], ["learning", "--tables", "t4"]):
        assert main([*verb, "--manifest", "ref/manifest.json"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and (f"--manifest ref/manifest.json: agg-bench campaign unpack into {tmp_path / 'ref'} "
                                  f"is under way or was cut off ({staging.name} is there)") in err[0], err
        assert not (tmp_path / "t4").exists()
    # so are the reference's calibrations and gradcheck CSVs given beside a user's runs
    mine = tmp_path / "mine" / "runs"
    make_run(mine, "c", "full", [it(1.0, 0.1), it(1.0, 0.2)])
    for flag, name in (("--calibration", "calibration/cal.json"), ("--gradcheck", "gradcheck/g.csv")):
        (tmp_path / "ref" / name).parent.mkdir(exist_ok=True)
        (tmp_path / "ref" / name).write_text("{}")
        before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
        assert main(["report", "--runs", str(mine), flag, str(tmp_path / "ref" / name), "--tables",
                     str(tmp_path / "t3")]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and (f"{flag} {tmp_path / 'ref' / name}: agg-bench campaign unpack into "
                                  f"{tmp_path / 'ref'} is under way") in err[0], err
        assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before


@pytest.mark.parametrize("first, other, words", [
    (["reward.name=smoothness"], ["reward.name=jpeg_compressibility"], "with reward"),
    (['method={"name": "agg", "window": 3}'], ['method={"name": "agg", "window": 4}'], "with method options"),
])
def test_runs_of_one_row_with_another_setting_are_refused(tmp_path, capsys, first, other, words):
    """``report --runs`` labels a run by its method's name: two rewards' scores, or two windows' times, were
    averaged into one row as if the runs were its seeds."""
    from agg_bench.config import load_config
    from agg_bench.runtime.train import train

    small = ["model.resolution=32", "sampling.steps=4", "grpo.group_size=2", "grpo.prompts_per_iteration=1",
             "train.iterations=1", "progress=false", "telemetry.enabled=false"]
    runs = {name: tmp_path / name for name in ("a", "b", "c")}
    train(load_config(None, [*small, *first, "run_id=a"]), runs["a"])
    train(load_config(None, [*small, *first, "seed=1", "run_id=b"]), runs["b"])  # a seed of the same setting
    train(load_config(None, [*small, *other, "run_id=c"]), runs["c"])
    assert main(["report", "--runs", str(runs["a"]), str(runs["b"]), "--tables", str(tmp_path / "ok")]) == 0
    capsys.readouterr()
    tables = tmp_path / "tables"
    assert main(["report", "--runs", *map(str, runs.values()), "--tables", str(tables)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and words in err[0] and str(runs["a"]) in err[0] and str(runs["c"]) in err[0], err
    assert not tables.exists()


def test_a_gradcheck_csv_s_formula_cells_are_quoted_and_read_back(tmp_path):
    """gradcheck writes its CSV through the cell writer of every agg-bench CSV (formatting.csv_cell): a text
    cell a spreadsheet would run as a formula (a model label, a device, a note) is written after a single quote,
    and so is one that begins with a quote; a negative number is a number. The report reads each back as it was."""
    from agg_bench.tools.gradcheck import COLUMNS, write_csv

    rows = [{"method": "full", "cosine_to_full": 1.0, "relative_error": 0.0, "backward": 8, "seconds": 0.03,
             "model": "=sd3", "device": "@cpu", "replay_note": "-note"},
            {"method": "agg", "window": 3, "alpha": "sigma", "route_frac": 1.0, "reuse_rollout_velocity": False,
             "cosine_to_full": -0.5, "relative_error": 1.5, "backward": 6, "seconds": 0.02, "model": "=sd3",
             "device": "@cpu", "replay_note": "'quoted"}]
    path = write_csv([dict.fromkeys(COLUMNS) | row for row in rows], tmp_path / "gc.csv")
    with open(path, newline="") as handle:
        cells = list(csv.DictReader(handle))
    assert [(c["model"], c["device"], c["replay_note"]) for c in cells] == \
        [("'=sd3", "'@cpu", "'-note"), ("'=sd3", "'@cpu", "''quoted")]
    assert cells[1]["cosine_to_full"] == "-0.5"
    table = load_gradcheck([GradcheckEntry(path)])
    assert list(table["model"]) == ["=sd3", "=sd3"] and list(table["device"]) == ["@cpu", "@cpu"]
    assert list(table["replay_note"]) == ["-note", "'quoted"] and list(table["cosine_to_full"]) == [1.0, -0.5]
