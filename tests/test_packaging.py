"""What a user meets before running anything: the version, help for every option, the package metadata."""
from __future__ import annotations

import argparse
import tomllib
from pathlib import Path

import pytest

import agg_bench
from agg_bench.cli import build_parser, main

ROOT = Path(__file__).resolve().parents[1]


def test_version(capsys):
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0 and capsys.readouterr().out.strip() == f"agg-bench {agg_bench.__version__}"


def test_every_option_of_every_verb_has_plain_help():
    verbs = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)).choices
    assert {"run", "snapshot", "replay", "gradcheck", "report", "plan", "calibrate", "pretrain", "env"} <= set(verbs)
    for name, parser in verbs.items():
        for action in parser._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            assert action.help, (name, action.option_strings or action.dest)
            assert "``" not in action.help and ":class:" not in action.help, (name, action.help)  # no raw RST


def test_package_metadata():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["requires-python"] == ">=3.11"
    assert project["license"] == "Apache-2.0"  # an SPDX expression, not a table
    assert project["version"] == agg_bench.__version__
