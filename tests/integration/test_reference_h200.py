"""The committed H200 reference (results/reference/h200/, `agg-bench campaign unpack` of config/h200.yaml's
windows) holds what the paper-scale measurement promises:

- `agg-bench report --manifest results/reference/h200/manifest.json --tables DIR` regenerates its tables/
  byte for byte (the same files, the same bytes);
- every run in it is finished, ran on the H200 that `campaign.gpu` names, and has the config that the sweep
  composes for its run id today, and its manifest lists exactly the run folders and calibrations it holds;
- every run's pass counts, in every iteration, are what the same schedule counts on the tiny model on the CPU
  (counts depend on neither the device, the size, the precision nor the weights): the unpack's own check
  (its first 4 iterations) and the counterpart run for as many iterations as the run (a schedule such as
  mixgrpo_flash's sliding window counts differently from one iteration to the next). Every committed run's
  counterpart runs: all of them take a few seconds on two cores.

A checkout without the reference's runs skips these tests."""
from __future__ import annotations

import contextlib
import copy
import io
import json
import shutil
from pathlib import Path

import pytest

from agg_bench.cli import main
from agg_bench.errors import UserError
from agg_bench.io import read_jsonl
from agg_bench.reading import RunFolder
from agg_bench.tools import archive as archive_module
from agg_bench.tools.archive import COUNT_KEYS, check_counts, json_lines, reference_manifest, tiny_counterpart
from agg_bench.tools.campaign import Campaign

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "config" / "h200.yaml"
REFERENCE = ROOT / "results" / "reference" / "h200"
RUNS = REFERENCE / "runs"

if not RUNS.is_dir():
    pytest.skip(f"{RUNS} is absent: no committed H200 reference to check", allow_module_level=True)

RUN_IDS = sorted(p.name for p in RUNS.iterdir() if p.is_dir())


def tree(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def campaign():
    return Campaign(CONFIG)


@pytest.fixture
def at_root(monkeypatch):
    """The manifest's run folders are relative to the repository's root, where the reference is read from."""
    monkeypatch.chdir(ROOT)


# The tiny counterparts that the unpack's count check trained in this module (its test below), by run id: the
# config it trained and the records. The check trains a run's counterpart for as many iterations as it compares (4,
# every committed run's length), so a counterpart of the same config is not trained a second time.
TRAINED: dict[str, tuple[object, list[dict]]] = {}


@pytest.fixture
def keep_trained(monkeypatch):
    """What :func:`check_counts` trains (it imports ``train`` where it calls it) is kept in :data:`TRAINED`: the
    config, copied before the run, and the records the run wrote."""
    from agg_bench.runtime import train as train_module

    real = train_module.train

    def train_and_keep(cfg, out_dir, *args, **kwargs):
        given = copy.deepcopy(cfg)
        summary = real(cfg, out_dir, *args, **kwargs)
        TRAINED[Path(out_dir).name] = (given, list(read_jsonl(Path(out_dir) / "metrics.jsonl")))
        return summary

    monkeypatch.setattr(train_module, "train", train_and_keep)


def tiny_records(config: dict, run_id: str, tmp: Path) -> list[dict]:
    """The records of the run's schedule on the tiny model on the CPU, for as many iterations as the run: those of
    the unpack's check where it trained this very config (:data:`TRAINED`), else of a run trained here."""
    from agg_bench.config import validate
    from agg_bench.runtime.train import train

    cfg = tiny_counterpart(config)
    cfg["train"]["iterations"] = config["train"]["iterations"]
    checked = validate(cfg)
    if run_id in TRAINED and TRAINED[run_id][0] == checked:
        return TRAINED[run_id][1]
    with contextlib.redirect_stderr(io.StringIO()):  # no progress lines
        train(checked, tmp / run_id)
    return list(read_jsonl(tmp / run_id / "metrics.jsonl"))


def count_mismatches(records: list[dict], tiny: list[dict]) -> list[str]:
    """Each (iteration, count key) whose count differs from the tiny counterpart's, and a differing length."""
    out = [] if len(records) == len(tiny) else [f"{len(records)} records, the counterpart {len(tiny)}"]
    for record, expected in zip(records, tiny):
        out += [f"iteration {record.get('iteration')}: {key} = {record.get(key)}, the counterpart {expected.get(key)}"
                for key in COUNT_KEYS if record.get(key) != expected.get(key)]
    return out


@pytest.fixture(scope="module")
def counterparts(tmp_path_factory):
    """Every committed run's tiny counterpart's records, by run id."""
    tmp = tmp_path_factory.mktemp("counterparts")
    return {run_id: tiny_records(json.loads((RUNS / run_id / "config.json").read_text()), run_id, tmp)
            for run_id in RUN_IDS}


# ----- the tables ------------------------------------------------------------------------------------------------
def test_report_regenerates_the_tables_byte_for_byte(at_root, tmp_path):
    out = tmp_path / "tables"
    assert main(["report", "--manifest", "results/reference/h200/manifest.json", "--tables", str(out)]) == 0
    regenerated, committed = tree(out), tree(REFERENCE / "tables")
    assert sorted(regenerated) == sorted(committed)
    assert [name for name in committed if regenerated[name] != committed[name]] == []


# ----- the runs: finished, on the H200, of today's sweep; the manifest ------------------------------------------
def test_the_reference_holds_runs():
    assert RUN_IDS, f"{RUNS} holds no run folder"


@pytest.mark.parametrize("run_id", RUN_IDS)
def test_every_run_is_finished_on_an_h200_with_the_sweeps_config(campaign, run_id):
    folder = RUNS / run_id
    assert run_id in campaign.sweep.runs, f"{run_id} is no run of {CONFIG}"
    assert campaign.finished(folder, run_id)
    run = RunFolder(folder)
    assert campaign.composes(run_id, run.config_object())  # a key added since counts as its default
    summary, records, env = run.summary(), run.records(("iteration", "status")), run.env()
    assert summary["status"] == "ok"
    assert [r["iteration"] for r in records] == list(range(campaign.config_of(run_id)["train"]["iterations"]))
    assert {r["status"] for r in records} == {"ok"}
    assert campaign.gpu == "H200"
    assert env["gpu_name"] == "NVIDIA H200" and env["gpu_names"] == ["NVIDIA H200"]
    for what in (summary, *records):
        assert (what["device"], what["gpu_name"], what["n_gpus"]) == ("cuda", env["gpu_name"], 1)
    # and everything else the unpack lets into a reference: each file read as every reader reads it, the
    # records' and summary's identity that of the sweep's run
    files = {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()}
    assert archive_module._check_run(campaign, "reference", run_id, files) == "NVIDIA H200"


def test_every_calibration_is_of_an_h200(campaign):
    calibrations = sorted((REFERENCE / "calibration").glob("*.json"))
    assert calibrations
    for path in calibrations:
        assert archive_module._check_calibration(campaign, "reference", path.name, path.read_bytes()) == "NVIDIA H200"


def test_the_manifest_lists_exactly_the_run_folders_present(campaign, at_root):
    manifest = json.loads((REFERENCE / "manifest.json").read_text())
    assert sorted(Path(entry["dir"]).name for entry in manifest["runs"]) == RUN_IDS
    assert all(entry["dir"] == f"results/reference/h200/runs/{Path(entry['dir']).name}" for entry in manifest["runs"])
    assert sorted(Path(entry["file"]).name for entry in manifest["calibration"]) == \
        sorted(p.name for p in (REFERENCE / "calibration").glob("*.json"))
    # what unpack writes for the reference as it stands
    assert manifest == reference_manifest(campaign, Path("results/reference/h200"))


def test_the_next_unpack_takes_the_manifest_for_its_own_from_any_working_folder(campaign, tmp_path, monkeypatch):
    """An unpack refuses a manifest.json that is not one it writes (edited by hand); the committed one is, read from
    a working folder other than the repository's root, where its paths were written from."""
    manifest = json.loads((REFERENCE / "manifest.json").read_text())
    monkeypatch.chdir(tmp_path)
    assert archive_module.manifest_problem(campaign, REFERENCE, manifest) is None
    monkeypatch.chdir(REFERENCE.parent)
    assert archive_module.manifest_problem(campaign, Path("h200"), manifest) is None
    archive_module.check_files_of_the_sweep(campaign, REFERENCE)


# ----- the pass counts ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("run_id", RUN_IDS)
def test_every_run_passes_the_unpacks_count_check(keep_trained, run_id):
    folder = RUNS / run_id
    records = json_lines(str(folder), (folder / "metrics.jsonl").read_bytes())
    check_counts("reference", run_id, records, json.loads((folder / "config.json").read_text()))


@pytest.mark.parametrize("run_id", RUN_IDS)
def test_every_runs_counts_equal_the_tiny_counterparts_in_every_iteration(counterparts, run_id):
    records = list(read_jsonl(RUNS / run_id / "metrics.jsonl"))
    assert count_mismatches(records, counterparts[run_id]) == []


def test_a_changed_count_in_a_copy_of_a_run_is_caught(counterparts, tmp_path):
    """The count checks above are not vacuous: a copy of a committed run with one count changed fails them, in
    the first iteration and in a later one (the unpack's check and the per-iteration comparison)."""
    run_id = next(r for r in RUN_IDS if r.startswith("mixgrpo-flash"))  # counts that change with the iteration
    copy = tmp_path / run_id
    shutil.copytree(RUNS / run_id, copy)
    config = json.loads((copy / "config.json").read_text())
    lines = (copy / "metrics.jsonl").read_text().splitlines()
    for iteration, key in ((0, "train_backward"), (2, "forward_nograd")):
        record = json.loads(lines[iteration])
        changed = [json.dumps({**record, key: record[key] + 1}) if i == iteration else line
                   for i, line in enumerate(lines)]
        (copy / "metrics.jsonl").write_text("\n".join(changed) + "\n")
        records = json_lines(str(copy), (copy / "metrics.jsonl").read_bytes())
        assert count_mismatches(records, counterparts[run_id]) == \
            [f"iteration {iteration}: {key} = {record[key] + 1}, the counterpart {record[key]}"]
        with pytest.raises(UserError, match=f"{key} = {record[key] + 1} in iteration {iteration}, "):
            check_counts("reference", run_id, records, config)
