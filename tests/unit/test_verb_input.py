"""Careless input to the verbs (other than ``run`` and ``campaign``, whose walls have tests of their own): every
refusal is one line naming the option, the value and what is allowed, exit code 2, and nothing that was
there before is touched."""
from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from agg_bench import cli


def _verbs() -> dict[str, argparse.ArgumentParser]:
    (sub,) = [a for a in cli.build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(sub.choices)


def _path_options() -> list[tuple[str, list[str]]]:
    """(verb, the arguments that give one of its file or folder options the empty string), from the parser."""
    cases = []
    for verb, parser in _verbs().items():
        for action in parser._actions:
            if action.type is cli.path_arg:
                cases.append((verb, [action.option_strings[0], ""] if action.option_strings else [""]))
    return cases


def test_every_file_or_folder_option_takes_the_shared_path_type():
    """A path option declared another way would take '' for the current folder unseen by the test below."""
    for verb, parser in _verbs().items():
        for action in parser._actions:
            assert action.type is not Path and not isinstance(action.default, Path) or action.type is cli.path_arg, \
                (verb, action.dest)
            if "--config" in action.option_strings or "--out" in action.option_strings:
                assert action.type is cli.path_arg, (verb, action.dest)
    assert len(_path_options()) >= 30


@pytest.mark.parametrize("verb, argv", _path_options(), ids=lambda x: x if isinstance(x, str) else x[0] or "positional")
def test_an_empty_path_is_refused_for_every_path_option_of_every_verb(tmp_path, monkeypatch, capsys, verb, argv):
    """'' meant the current folder: ``report --runs ''`` read it, an empty --out wrote into it."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as stop:
        cli.main([verb, *argv])
    lines = capsys.readouterr().err.strip().splitlines()
    name = argv[0] if argv[0] else "argument "
    assert stop.value.code == 2 and len(lines) == 1, lines
    assert name in lines[0] and "''" in lines[0] and "file or folder name" in lines[0], lines
    assert not any(tmp_path.iterdir())


def fails(capsys, argv: list[str]) -> str:
    """Run the command line in this process; assert exit code 2 and one line on stderr; return the line."""
    capsys.readouterr()
    code = cli.main(argv)
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(lines) == 1, lines
    return lines[0]


@pytest.mark.parametrize("flag, least", [("--wait", 0), ("--warmup", 0), ("--active", 1)])
@pytest.mark.parametrize("value", ["1001", str(10**12)])
def test_profile_refuses_a_step_count_past_any_profile_before_it_starts(tmp_path, capsys, monkeypatch, flag, least,
                                                                        value):
    """--wait 10**12 ran training iterations until the process was killed."""
    monkeypatch.setattr(cli, "_run_config", lambda *a: pytest.fail("the steps were not refused first"))
    line = fails(capsys, ["profile", "--method", "full", flag, value, "--out", str(tmp_path / "prof")])
    assert f"{flag} = {value}: expected an integer from {least} to 1000" in line
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("label", ["", "a\nb", "x" * 201])
def test_calibrate_refuses_a_method_label_no_table_can_show(tmp_path, capsys, monkeypatch, label):
    """An empty label was timed and written as a method named ''."""
    monkeypatch.setattr(cli, "_run_config", lambda *a: pytest.fail("the label was not refused first"))
    line = fails(capsys, ["calibrate", "--method", label, "{method: {name: full}}", "--out", str(tmp_path / "c.json")])
    assert line.startswith("agg-bench calibrate: config error: --method = ") and "1 to 200 printable" in line
    assert not any(tmp_path.iterdir())
