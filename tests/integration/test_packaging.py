"""What a user meets before running anything: the version, help for every option, the package metadata and
the wheel's contents."""
from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

import agg_bench
from agg_bench.cli import build_parser, main

ROOT = Path(__file__).resolve().parents[2]


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


def test_the_wheel_holds_every_module_and_the_package_data(tmp_path):
    """pyproject's package discovery finds every wing (subpackage) and the run config's package, and the
    built-in prompts travel as package data (the run schema is generated from the typed config, no file)."""
    pytest.importorskip("setuptools", minversion="77")
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    for package in ("agg_bench", "baselines"):
        shutil.copytree(ROOT / package, src / package, ignore=shutil.ignore_patterns("__pycache__"))
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
                           "--quiet", "--wheel-dir", str(tmp_path / "dist"), str(src)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    wheel, = (tmp_path / "dist").glob("agg_bench-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    modules = {p.relative_to(ROOT).as_posix() for package in ("agg_bench", "baselines")
               for p in (ROOT / package).rglob("*.py")}
    assert modules | {"agg_bench/data/prompts.txt"} <= names
    assert "agg_bench/config/sections.py" in modules
