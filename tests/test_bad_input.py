"""Bad input to `agg-bench run`: one line naming what is wrong, exit code 2, and nothing written.

Unknown method / model family / reward names, an out-of-range resolution and a missing config file are
covered in test_cli.py, a window longer than the trajectory in test_subsample.py; these are the rest.
"""
from __future__ import annotations

import contextlib
from pathlib import Path

import pytest

from agg_bench import distributed
from agg_bench.cli import main

SMALL = ["--set", "model.resolution=32", "--set", "sampling.steps=4", "--set", "train.iterations=1",
         "--set", "progress=false"]


def run_fails(out: Path, capsys, *args: str) -> str:
    """Run `agg-bench run` in this process; assert exit code 2, one stderr line, nothing written; return the line."""
    capsys.readouterr()
    code = main(["run", *SMALL, *args, "--out", str(out)])
    captured = capsys.readouterr()
    assert code == 2, captured.err
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("agg-bench run: "), captured.err
    assert not out.exists() or not any(out.iterdir())
    return lines[0]


@pytest.mark.parametrize("name, args, expected", [
    ("unknown cache", ["--set", 'method={"name": "cached", "cache": "nocache"}'], ["method.cache", "nocache", "fora"]),
    ("resolution above the model's", ["--set", "model.resolution=4096"], ["model.resolution", "at most"]),
    ("missing weight folder", ["--set", "model.preset=pretrained", "--set", "model.pretrained={tmp}/weights"],
     ["model.pretrained", "weights"]),
    ("missing prompts file", ["--set", "prompts.file={tmp}/prompts.txt"], ["prompts.file", "prompts.txt"]),
    ("plan window longer than the trajectory", ["--set", "train.plan=groups", "--set", "train.plan_window=5"],
     ["train.plan_window", "5"]),
    ("negative checkpoint interval", ["--checkpoint-every", "-1"], ["train.checkpoint_every", "-1"]),
])
def test_bad_input_is_one_line_and_exit_code_2(tmp_path, capsys, name, args, expected):
    args = [a.replace("{tmp}", str(tmp_path)) for a in args]
    line = run_fails(tmp_path / "out", capsys, *args)
    for word in expected:
        assert word in line, (name, line)


def test_malformed_prompts_file(tmp_path, capsys):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "a red cube"}\n{"prompt": "a blue\n')
    line = run_fails(tmp_path / "out", capsys, "--set", f"prompts.file={prompts}")
    assert "prompts.file" in line and "prompts.jsonl:2" in line  # which file, which line


def test_unwritable_output_folder(tmp_path, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    line = run_fails(blocker / "out", capsys)  # a folder cannot be made inside a file, even by root
    assert "output folder" in line and str(blocker / "out") in line


def test_agg_window_longer_than_the_trained_steps(tmp_path, capsys):
    line = run_fails(tmp_path / "out", capsys, "--set", 'method={"name": "agg", "window": 8}')
    assert "method.window" in line


def test_prompts_that_do_not_split_over_the_processes(tmp_path, capsys, monkeypatch):
    # as torchrun with 3 processes would see it: 2 prompts per iteration cannot be split into whole groups
    monkeypatch.setattr(distributed, "process_group", lambda device, single=False: contextlib.nullcontext(distributed.Shard(0, 3)))
    line = run_fails(tmp_path / "out", capsys)
    assert "grpo.prompts_per_iteration" in line and "3" in line
