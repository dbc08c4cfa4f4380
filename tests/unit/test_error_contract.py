"""One error contract for every command: a user error (and a full disk) is one line on stderr and exit code
2; anything else is a bug in agg-bench: one line that says so and names the command, then the traceback,
exit code 1. The same holds for `agg-bench VERB` (`agg-bench learning` included), `python -m agg_bench.machine.gpus`
and `python -m agg_bench.tools.gpucheck` (tests/integration/test_gpu_check.py)."""
from __future__ import annotations

import errno
import json
import os

import numpy as np
import pandas as pd
import pytest

from agg_bench import cli
from agg_bench.errors import MESSAGE_CHARS, UserError, run_command
from agg_bench.io import atomic_file
from agg_bench.machine import gpus
from agg_bench.tools import learning


def contract(capsys, body, out=None) -> tuple[int, list[str]]:
    """Exit code and stderr lines of ``body`` run under the contract as `agg-bench test`."""
    capsys.readouterr()
    code = run_command("agg-bench test", body, ["agg-bench", "test", "--out", "the dir"], out)
    return code, capsys.readouterr().err.splitlines()


def raises(exc: BaseException):
    def body() -> int:
        raise exc
    return body


def test_a_user_error_is_one_line_and_exit_code_2(capsys):
    code, lines = contract(capsys, raises(UserError("--x 5: expected\nan integer\n\n< 3")))
    assert code == 2 and lines == ["agg-bench test: --x 5: expected an integer < 3"]


def test_a_very_long_message_keeps_its_head_and_its_tail(capsys):
    code, lines = contract(capsys, raises(UserError("key = '" + "a" * 10 ** 6 + "': expected a short value")))
    assert code == 2 and len(lines) == 1 and len(lines[0]) < MESSAGE_CHARS + 100
    assert lines[0].startswith("agg-bench test: key = 'aaa") and lines[0].endswith("expected a short value")


def test_anything_else_is_a_bug_to_report_with_its_traceback(capsys):
    def body() -> int:
        return {}["missing"]

    code, lines = contract(capsys, body)
    assert code == 1
    assert lines[0].startswith("agg-bench test: internal error: this is a bug in agg-bench; please report it")
    assert "agg-bench test --out 'the dir'" in lines[0]  # the command, as the shell would take it
    assert lines[1] == "Traceback (most recent call last):" and lines[-1] == "KeyError: 'missing'"


@pytest.mark.parametrize("exc, shown", [
    (OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "/data/run/metrics.jsonl"), "/data/run/metrics.jsonl"),
    (OSError(errno.EDQUOT, os.strerror(errno.EDQUOT), "/data/run/ckpt.pt"), "/data/run/ckpt.pt"),
    # torch.save and safetensors wrap the OS error in their own, with its text
    (RuntimeError(f"PytorchStreamWriter failed writing file data/0: {os.strerror(errno.ENOSPC)}"), "writing the dir"),
])
def test_a_full_disk_is_one_line_naming_the_path(capsys, exc, shown):
    code, lines = contract(capsys, raises(exc), out="the dir")
    assert code == 2 and len(lines) == 1, lines
    assert lines[0].startswith(f"agg-bench test: {shown}: no space left on device"), lines


def test_a_full_disk_is_found_in_the_exception_chain(capsys):
    def body() -> int:
        try:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "/data/run/summary.json")
        except OSError as err:
            raise RuntimeError("could not write the summary") from err

    code, lines = contract(capsys, body)
    assert code == 2 and lines == ["agg-bench test: /data/run/summary.json: no space left on device"]


def test_another_os_error_is_a_bug(capsys):
    code, lines = contract(capsys, raises(OSError(errno.EIO, "Input/output error", "/x")))
    assert code == 1 and "bug in agg-bench" in lines[0]


def test_an_interruption_keeps_its_exit_code(capsys):
    interrupt = KeyboardInterrupt()
    interrupt.signum = 15
    assert contract(capsys, raises(interrupt)) == (143, ["agg-bench test: interrupted"])
    assert contract(capsys, raises(KeyboardInterrupt())) == (130, ["agg-bench test: interrupted"])


# ----- every entry point keeps it ----------------------------------------------------------------
def test_cli_bug_names_the_command(capsys, monkeypatch):
    monkeypatch.setattr(cli, "cmd_env", lambda args: 1 / 0)
    assert cli.main(["env"]) == 1
    lines = capsys.readouterr().err.splitlines()
    assert "bug in agg-bench" in lines[0] and "(agg-bench env)" in lines[0] and lines[-1].startswith("ZeroDivisionError")


def test_cli_full_disk_while_writing_tables(tmp_path, capsys, monkeypatch):
    import agg_bench.results.report as report

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(tmp_path / "t" / "summary.csv"))

    monkeypatch.setattr(report, "build_report", full)
    (tmp_path / "runs" / "a").mkdir(parents=True)
    (tmp_path / "runs" / "a" / "summary.json").write_text("{}")
    assert cli.main(["report", "--runs", str(tmp_path / "runs"), "--tables", str(tmp_path / "t")]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"agg-bench report: {tmp_path / 't' / 'summary.csv'}: no space left on device"]


def test_learning_keeps_the_contract(tmp_path, capsys, monkeypatch):
    tables = ["--tables", str(tmp_path / "t")]
    assert cli.main(["learning", "--manifest", str(tmp_path / "none.json"), *tables]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"agg-bench learning: manifest {tmp_path / 'none.json'}: no such file"]
    (tmp_path / "m.json").write_text('{"runs": [{"dir": 5}]}')
    assert cli.main(["learning", "--manifest", str(tmp_path / "m.json"), *tables]) == 2
    line, = capsys.readouterr().err.splitlines()
    assert "runs[0]" in line and "m.json" in line
    assert cli.main(["learning", "--manifest", str(tmp_path / "m.json"), *tables, "--eval-sampler", "euler"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "agg-bench learning: config error: --eval-sampler = 'euler': expected one of ode, sde"]
    # the evaluation's noise with neither --eval-noises nor --plots: no evaluation runs, the option changed nothing
    for option, value in (("--eval-sampler", "sde"), ("--eval-seed", "7")):
        for evaluation in ([], ["--eval-noises", "0"]):
            assert cli.main(["learning", "--manifest", str(tmp_path / "m.json"), *tables, option, value,
                             *evaluation]) == 2
            assert capsys.readouterr().err.splitlines() == [
                f"agg-bench learning: {option} {value}: sets the checkpoint evaluation's noise, which runs only with "
                f"--eval-noises >= 1 or --plots; give one of them, or leave {option} out"]
    assert not (tmp_path / "t").exists()
    (tmp_path / "m.json").write_text('{"runs": [{"dir": "run", "method": "full", "seed": 0}]}')
    monkeypatch.setattr(learning, "load_runs", lambda path: [][0])  # noqa: PLE0643 (a bug on purpose)
    assert cli.main(["learning", "--manifest", str(tmp_path / "m.json"), *tables]) == 1
    lines = capsys.readouterr().err.splitlines()
    assert "bug in agg-bench" in lines[0] and "agg-bench learning --manifest" in lines[0]
    assert lines[-1].startswith("IndexError")


def test_learning_records_with_a_string_for_a_number(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text(json.dumps({"iteration": 0, "status": "ok", "reward_mean": "high"}) + "\n")
    (tmp_path / "m.json").write_text(json.dumps({"runs": [{"dir": str(run), "method": "full", "seed": 0}]}))
    assert cli.main(["learning", "--manifest", str(tmp_path / "m.json"), "--tables", str(tmp_path / "t")]) == 2
    line, = capsys.readouterr().err.splitlines()
    assert "metrics.jsonl: record 1: 'reward_mean' = 'high': expected a finite number" in line
    assert not (tmp_path / "t").exists()


def test_learning_plot_labels_with_dollars_are_drawn_as_text(tmp_path):
    from agg_bench.results.learning_tables import Run, plot_rewards

    records = pd.DataFrame({"reward_mean": np.linspace(0, 1, 4), "t_iter_cpu_s": np.ones(4)})
    runs = [Run("a$b$^{", 0, tmp_path, records), Run("$x$", 1, tmp_path, records)]
    for x in ("iteration", "time"):
        path = plot_rewards(runs, tmp_path / f"{x}.png", x)
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("value", ["abc", "0,x", "1,1", "-1", " , ", "99999999999", "017", "0,017", "0x4", "1e3",
                                   "0,1.0", "0,+1", "0,1_0"])
def test_gpus_entry_point_refuses_a_bad_device_list(tmp_path, capsys, monkeypatch, value):
    monkeypatch.setattr(gpus.os, "execvpe", lambda *args: pytest.fail("the command ran"))
    monkeypatch.setenv("AGG_BENCH_GPUS", value)
    monkeypatch.setenv("AGG_BENCH_GPU_LOCK_DIR", str(tmp_path / "locks"))
    assert gpus.main(["--count", "1", "--", "true"]) == 2  # refused before the command would replace this process
    line, = capsys.readouterr().err.splitlines()
    assert line.startswith("agg-bench gpus: environment variable AGG_BENCH_GPUS=") and "device count" in line
    assert not (tmp_path / "locks").exists()


def test_gpus_entry_point_refuses_a_timeout_that_never_ends(capsys, monkeypatch):
    monkeypatch.setattr(gpus.os, "execvpe", lambda *args: pytest.fail("the command ran"))
    monkeypatch.setenv("AGG_BENCH_GPUS", "1")
    with pytest.raises(SystemExit) as stop:  # refused as the flag is read, as any number flag is
        gpus.main(["--count", "1", "--timeout", "nan", "--", "true"])
    assert stop.value.code == 2 and "--timeout" in capsys.readouterr().err


@pytest.mark.parametrize("argv, words", [
    (["run", "--out", "x", "--checkpoint-every", "abc"], "agg-bench run: argument --checkpoint-every: 'abc': expected an integer"),
    (["plan", "--gpus", "1e3"], "agg-bench plan: argument --gpus: '1e3': expected an integer"),
    (["profile", "--method", "agg", "--phase", "bogus", "--out", "x"], "argument --phase: invalid choice: 'bogus'"),
    (["bogus"], "agg-bench: argument command: invalid choice: 'bogus'"),
    (["run"], "the following arguments are required: --out"),
    # an argument no option takes is the verb's error, and the verb's --help lists its options
    (["env", "extra"], "agg-bench env: unrecognized arguments: extra (agg-bench env --help lists the options)"),
    (["campaign", "status", "--config", "c.yaml", "x", "y"],
     "agg-bench campaign: unrecognized arguments: x y (agg-bench campaign --help lists the options)"),
])
def test_a_flag_argparse_refuses_is_one_line_too(capsys, argv, words):
    """argparse printed its usage block before the error (3-4 lines): the parser's errors are one line."""
    with pytest.raises(SystemExit) as stop:
        cli.main(argv)
    lines = capsys.readouterr().err.strip().splitlines()
    assert stop.value.code == 2 and len(lines) == 1 and words in lines[0], lines


def test_the_gpus_entry_points_flags_are_one_line_too(capsys):
    with pytest.raises(SystemExit) as stop:
        gpus.main(["--count", "x", "--", "true"])
    lines = capsys.readouterr().err.strip().splitlines()
    assert stop.value.code == 2 and len(lines) == 1 and "argument --count: 'x': expected an integer" in lines[0]


def test_a_gpu_memory_past_any_gpu_names_the_value_given(capsys):
    """1e300 GiB overflowed to an infinite number of bytes, and the message said --gpu-memory = inf."""
    assert cli.main(["plan", "--gpu-memory", "1e300"]) == 2
    line = capsys.readouterr().err.strip()
    assert "--gpu-memory = 1e+300" in line and "at most 1,000,000" in line and "inf" not in line


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EDQUOT])
@pytest.mark.parametrize("named", [None, "temporary"])
def test_a_full_disk_while_a_file_is_written_names_that_file(tmp_path, capsys, code, named):
    """A write's OSError carries no file name (matplotlib's PNG writer, a text file's flush), or the temporary
    one that is gone: `report --plots` on a full disk said only 'no space left on device'."""
    target = tmp_path / "plots" / "time_breakdown.png"
    target.parent.mkdir()

    def body() -> int:
        with atomic_file(target, "wb") as fh:
            raise OSError(code, os.strerror(code), fh.name if named else None)

    what = "no space left on device" + (" (disk quota exceeded)" if code == errno.EDQUOT else "")
    assert contract(capsys, body) == (2, [f"agg-bench test: {target}: {what}"])
    assert list(target.parent.iterdir()) == []


@pytest.mark.parametrize("buffering", [-1, 1])
def test_a_reader_of_stdout_that_has_gone_is_no_bug(capsys, monkeypatch, buffering):
    """`agg-bench env | head -c 20`: the reader closed the pipe, the write failed with BrokenPipeError, and the
    command printed 'internal error: this is a bug in agg-bench' with the traceback. Now it ends quietly with
    128 + SIGPIPE, as a process that signal ended; stdout block-buffered (the error comes at the flush) or
    line-buffered (in the print)."""
    import signal
    import sys

    read_end, write_end = os.pipe()
    os.close(read_end)
    capsys.readouterr()
    with os.fdopen(write_end, "w", buffering=buffering) as pipe:
        monkeypatch.setattr(sys, "stdout", pipe)
        assert cli.main(["env"]) == 128 + signal.SIGPIPE
        monkeypatch.undo()
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("argv", [["env"], ["plan", "--gpus", "1"]])
def test_a_closed_stdout_is_one_line_before_the_command_runs(capsys, monkeypatch, argv):
    """`agg-bench env >&-` (Python's sys.stdout None): the command ran, its result went nowhere, and the flush after
    it printed 'internal error: this is a bug in agg-bench' with an AttributeError's traceback."""
    import sys

    from agg_bench.machine import envinfo
    from agg_bench.runtime import memplan

    for module, name in ((envinfo, "environment"), (memplan, "plan_memory")):
        monkeypatch.setattr(module, name, lambda *a, **k: pytest.fail("the command ran"))
    capsys.readouterr()
    monkeypatch.setattr(sys, "stdout", None)
    code = cli.main(argv)
    monkeypatch.undo()
    assert (code, capsys.readouterr().err.splitlines()) == (2, [
        f"agg-bench {argv[0]}: stdout is closed; give it a file, a pipe or /dev/null (the command prints its result "
        "there)"])


def test_a_broken_pipe_to_a_child_is_still_a_bug(capsys):
    """Only stdout's reader going is quiet: a broken pipe elsewhere (a child's stdin) keeps the bug's line."""
    code, err = contract(capsys, raises(BrokenPipeError(32, "Broken pipe")))
    assert code == 1 and "internal error: this is a bug" in err[0]


GLOO_PEER_GONE = ("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Read error [127.0.0.1]:29500: "
                  "Connection reset by peer")


@pytest.mark.parametrize("processes", [1, 2])
def test_a_process_of_the_job_that_has_gone_is_one_line_not_a_bug(capsys, monkeypatch, processes):
    """The process left when another of its torchrun job was killed reported gloo's lost connection as a bug
    in agg-bench, with a traceback; alone in its group, the same error is still one."""
    import torch

    from agg_bench.machine import distributed

    def body() -> int:
        with distributed.process_group(torch.device("cpu"), single=True):
            monkeypatch.setattr(distributed.dist, "get_world_size", lambda *args, **kwargs: processes)
            raise RuntimeError(f"{GLOO_PEER_GONE}\nException raised from recvHeader at pair.cc:534")

    code, lines = contract(capsys, body)
    if processes == 1:
        assert code == 1 and "internal error: this is a bug" in lines[0] and "Traceback" in lines[1]
    else:
        assert code == 1 and lines == [f"agg-bench test: another process of this job ended ({GLOO_PEER_GONE}); "
                                       "this one stops too: the output of the process that ended first says why"]


# ----- several processes ---------------------------------------------------------------------------------
def launched(monkeypatch, rank: int, local: int, world: int = 2, by_torchrun: bool = True) -> None:
    """The environment torchrun gives process ``rank`` (``local`` on its machine) of ``world``; without
    ``by_torchrun``, its launcher variables set by hand, without torchrun's agent."""
    from agg_bench.errors import TORCHRUN_AGENT_VARIABLE

    for name, value in (("WORLD_SIZE", world), ("RANK", rank), ("LOCAL_RANK", local)):
        monkeypatch.setenv(name, str(value))
    if by_torchrun:
        monkeypatch.setenv(TORCHRUN_AGENT_VARIABLE, "a-run-id")
    else:
        monkeypatch.delenv(TORCHRUN_AGENT_VARIABLE, raising=False)


@pytest.mark.parametrize("rank, local, alike, line", [
    (0, 0, True, "agg-bench run: bad"), (0, 0, False, "agg-bench run: bad"),
    (1, 1, True, None), (1, 1, False, "agg-bench run: rank 1: bad"),
    (2, 0, True, "agg-bench run: rank 2: bad"),  # the first process of a second machine
])
def test_an_error_raised_alike_is_printed_by_each_machine_s_first_process(monkeypatch, rank, local, alike, line):
    """Of several processes, an error every process of a machine raised alike is its first process's to print;
    any other error is printed by the process that raised it, saying which it is (but rank 0)."""
    from agg_bench.errors import mark_alike, user_error_line

    launched(monkeypatch, rank, local)
    err = mark_alike(UserError("bad")) if alike else UserError("bad")
    assert user_error_line("agg-bench run", err) == line


def test_another_process_s_error_passed_on_is_left_to_it_and_names_it_if_this_one_is_not_ended(capsys, monkeypatch):
    """A user error another process reported, raised here too (``distributed.gather``), is that process's to print
    (it raised it itself): this one waits to be ended by torchrun, and not ended in time prints it, saying whose
    it is."""
    from agg_bench import errors

    launched(monkeypatch, 1, 1)
    assert errors.user_error_line("agg-bench run", errors.raised_by(UserError("bad"), 0)) is None
    launched(monkeypatch, 0, 0)
    assert errors.user_error_line("agg-bench run", errors.raised_by(UserError("bad"), 1)) is None
    waited = []
    monkeypatch.setattr(errors.time, "sleep", waited.append)

    def passed_on():
        raise errors.raised_by(UserError("bad"), 1)

    assert run_command("agg-bench run", passed_on, ["agg-bench", "run"]) == 2
    assert waited == [errors.ALIKE_WAIT_S]
    assert capsys.readouterr().err.splitlines() == ["agg-bench run: rank 1: bad"]


@pytest.mark.parametrize("env", [{}, {"WORLD_SIZE": "1", "RANK": "0", "LOCAL_RANK": "0"},
                                 {"WORLD_SIZE": "2", "RANK": "1"}, {"WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "x"}])
def test_one_process_or_unclear_launcher_variables_print_every_error_as_it_is(monkeypatch, env):
    from agg_bench.errors import mark_alike, user_error_line

    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert user_error_line("agg-bench run", mark_alike(UserError("bad"))) == "agg-bench run: bad"


def test_a_process_that_leaves_an_alike_error_to_another_prints_it_if_not_ended(capsys, monkeypatch):
    """The process that leaves the line to its machine's first process waits to be ended by torchrun; not
    ended in time (no torchrun, say), it prints the line itself: no error goes unprinted."""
    from agg_bench import errors

    launched(monkeypatch, 1, 1)
    waited = []
    monkeypatch.setattr(errors.time, "sleep", waited.append)

    def alike():
        with errors.alike_on_every_process():
            raise UserError("bad --set")

    assert run_command("agg-bench run", alike, ["agg-bench", "run"]) == 2
    assert waited == [errors.ALIKE_WAIT_S]
    assert capsys.readouterr().err.splitlines() == ["agg-bench run: rank 1: bad --set"]
    with pytest.raises(SystemExit) as exit_:  # a usage error depends on the command line alone
        cli.main(["run", "--resume"])
    assert exit_.value.code == 2 and len(waited) == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("agg-bench run: rank 1: the following arguments are required")


@pytest.mark.parametrize("rank, local, alike, line", [
    (0, 0, True, "agg-bench run: bad"), (1, 1, True, "agg-bench run: rank 1: bad"),
    (1, 1, False, "agg-bench run: rank 1: bad"),
])
def test_the_launch_place_is_read_once_per_error(capsys, monkeypatch, rank, local, alike, line):
    """A user error's line, printed at once or after waiting to be ended, reads the launcher's variables once."""
    from agg_bench import errors

    launched(monkeypatch, rank, local)
    monkeypatch.setattr(errors.time, "sleep", lambda seconds: None)
    places = []
    real = errors.launch_place

    def counted():
        places.append(real())
        return places[-1]

    monkeypatch.setattr(errors, "launch_place", counted)
    errors._print_user_error("agg-bench run", errors.mark_alike(UserError("bad")) if alike else UserError("bad"))
    assert capsys.readouterr().err.splitlines() == [line] and places == [(rank, local)]


def test_launcher_variables_set_by_hand_print_an_error_left_to_another_process_at_once(capsys, monkeypatch):
    """``WORLD_SIZE``, ``RANK`` and ``LOCAL_RANK`` set by hand, outside torchrun: no launcher would end this process,
    so it does not wait for that before it prints a line it would leave to another process."""
    from agg_bench import errors

    launched(monkeypatch, 1, 1, by_torchrun=False)
    waited = []
    monkeypatch.setattr(errors.time, "sleep", waited.append)
    assert cli.main(["run", "--set", "train.iterations=abc", "--out", "unused"]) == 2
    assert waited == []
    lines = capsys.readouterr().err.splitlines()
    assert lines == ["agg-bench run: rank 1: config error: train.iterations = 'abc': expected an integer"], lines


def test_the_run_config_is_refused_alike_before_any_check_of_the_process(tmp_path, capsys, monkeypatch):
    """A bad --set is the first error of every process of a launch (before the launcher's variables of its own):
    the first process prints it and the others leave it to it; a bad variable of one process is its own line."""
    from agg_bench import errors

    monkeypatch.setattr(errors.time, "sleep", lambda seconds: None)
    launched(monkeypatch, 1, 1)
    out = str(tmp_path / "out")
    assert cli.main(["run", "--set", "train.iterations=abc", "--out", out]) == 2
    assert capsys.readouterr().err.splitlines() == \
        ["agg-bench run: rank 1: config error: train.iterations = 'abc': expected an integer"]
    launched(monkeypatch, 0, 0)
    assert cli.main(["run", "--set", "train.iterations=abc", "--out", out]) == 2
    assert capsys.readouterr().err.splitlines() == ["agg-bench run: config error: train.iterations = 'abc': expected an integer"]
    launched(monkeypatch, 1, 1)
    monkeypatch.setenv("RANK", "7")  # out of range for 2 processes: this process's own problem
    assert cli.main(["run", "--set", "train.iterations=1", "--out", out]) == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("agg-bench run: rank 7: environment variable RANK='7'"), lines


def _sweep_config(path):
    path.write_text("base: run.yaml\nmethods: {}\n")
    from agg_bench.config import load_config
    load_config(path)


def _manifest(path):
    path.write_text(json.dumps({"runs": [], "extra": 1}))
    from agg_bench.results.loading import load_manifest
    load_manifest(path)


def _tables_in(path):
    path.mkdir()
    from agg_bench.results.loading import load_tables_and_digest
    load_tables_and_digest(path)


def _records_folder(path):
    path.mkdir()
    from agg_bench.io import read_jsonl
    list(read_jsonl(path))


@pytest.mark.parametrize("name", ["a\nb", "c\rd", "e\x1b[2Jf"])
@pytest.mark.parametrize("refused, words", [
    (_sweep_config, ": a sweep config"),  # agg-bench run --config
    (_manifest, ": unknown key 'extra'"),  # agg-bench report --manifest
    (_tables_in, ": no "),  # agg-bench report --tables-in
    (_records_folder, ": is a folder; expected a JSONL file"),  # a run's metrics.jsonl, read by report
])
def test_a_path_with_a_control_character_is_quoted_in_its_refusal(tmp_path, refused, words, name):
    """A refusal that named a path as it is split its line at a newline or carriage return (the one line printed
    joined the parts: a path that is not there) or sent an escape sequence to the terminal; the path is quoted
    (errors.shown), as outdir's and campaign's refusals quote theirs."""
    path = tmp_path / name
    with pytest.raises(UserError) as refused_error:
        refused(path)
    message = str(refused_error.value)
    assert message.isprintable() and repr(str(path)) in message and words in message, message
