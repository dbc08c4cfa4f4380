"""The readers of whole files a user hands to a command (a YAML config, a prompts file, a log to import, a campaign
archive) read through the one bounded read, ``jsonfiles.read_bounded`` (a log to import a line at a time, through
``jsonfiles.read_bounded_lines``): a file over a reader's bound is refused
unread by its size, one that grows past the bound while it is read is refused at the bound, each in the reader's
own words."""
from __future__ import annotations

import os
import types
from pathlib import Path

import pytest

from agg_bench import jsonfiles
from agg_bench.config import MAX_YAML_BYTES, read_yaml_mapping
from agg_bench.engine.prompts import MAX_PROMPT_FILE_BYTES, load_prompts
from agg_bench.errors import ConfigError, UserError
from agg_bench.tools.archive import MAX_ARCHIVE_BYTES, read_archive
from agg_bench.tools.importlog import MAX_LOG_BYTES, read_log
from helpers import watched_open

# (reader, file name, bound, its words for a file of `size` bytes, its words for one that grew past the bound)
READERS = {
    "yaml": (read_yaml_mapping, "big.yaml", MAX_YAML_BYTES,
             "--config = '{path}': expected a YAML file of at most 1 MiB (this one has {size} bytes)",
             "(this one has more bytes)"),
    "prompts": (load_prompts, "big.txt", MAX_PROMPT_FILE_BYTES,
                "prompts.file = '{path}': expected a prompts file of at most 67,108,864 bytes (it has {size:,})",
                "(it has more)"),
    "import log": (lambda path: list(read_log(path, [])), "big.jsonl", MAX_LOG_BYTES,
                   "log {path}: {size:,} bytes, over the 64 MiB an import reads",
                   "log {path}: more bytes, over the 64 MiB an import reads"),
    "archive": (read_archive, "big.tar.gz", MAX_ARCHIVE_BYTES,
                "archive {path}: {size:,} bytes; expected at most 67,108,864",
                "archive {path}: more bytes; expected at most 67,108,864"),
}


def sparse(path: Path, size: int) -> Path:
    with open(path, "wb") as fh:
        fh.truncate(size)
    return path


@pytest.mark.parametrize("name", READERS)
def test_a_file_over_the_bound_is_refused_by_its_size_unread(tmp_path, monkeypatch, name):
    reader, file, bound, words, _ = READERS[name]
    path = sparse(tmp_path / file, bound + 1)

    def no_read(*args, **kwargs):
        raise AssertionError("the oversized file was read")

    monkeypatch.setattr(jsonfiles, "open_regular", watched_open(no_read))
    monkeypatch.setattr(Path, "read_text", no_read)
    monkeypatch.setattr(Path, "read_bytes", no_read)
    with pytest.raises((ConfigError, UserError)) as err:
        reader(path)
    assert words.format(path=path, size=bound + 1) in str(err.value)


@pytest.mark.parametrize("name", READERS)
def test_a_file_that_grows_past_the_bound_while_read_is_refused_at_the_bound(tmp_path, monkeypatch, name):
    """The size looked at before the read says the file fits (it was appended to after); the read stops at
    the bound instead of reading whatever the file has grown to."""
    reader, file, bound, _, words = READERS[name]
    path = sparse(tmp_path / file, bound + 4096)
    real_fstat = os.fstat

    def fstat_before_it_grew(fd):
        found = real_fstat(fd)
        return types.SimpleNamespace(st_mode=found.st_mode, st_size=bound // 2)

    monkeypatch.setattr(jsonfiles.os, "fstat", fstat_before_it_grew)
    with pytest.raises((ConfigError, UserError)) as err:
        reader(path)
    assert words.format(path=path) in str(err.value)


def test_json_text_is_read_by_one_decoder_with_every_check_of_json_loads(monkeypatch):
    """A run's records are read line by line through jsonfiles.loads: one decoder serves every line (json.loads built
    one per call), and it refuses what json.loads with the hooks refused: a key given twice (the first named), NaN,
    a byte order mark; bytes are read as json.loads reads them."""
    import json

    built = []
    monkeypatch.setattr(json.JSONDecoder, "__init__", lambda self, *a, __init__=json.JSONDecoder.__init__, **k: (
        built.append(1), __init__(self, *a, **k))[1])
    assert [jsonfiles.loads(f'{{"iteration": {i}}}') for i in range(50)] == [{"iteration": i} for i in range(50)]
    assert not built
    monkeypatch.undo()
    for text, problem in (('{"a": 1, "b": {"c": 1, "c": 2}, "a": 3}', "the key 'c' is given twice in one object"),
                          ('{"a": NaN}', "NaN is not a JSON number"), ("\ufeff{}", "Unexpected UTF-8 BOM"),
                          ('{"a": 1', "Expecting ',' delimiter")):
        with pytest.raises(jsonfiles.JsonProblem, match=problem):
            jsonfiles.loads(text)
    assert jsonfiles.loads('{"a": NaN}', nonfinite=True)["a"] != jsonfiles.loads('{"a": NaN}', nonfinite=True)["a"]
    assert jsonfiles.loads(b'{"a": [1, 2.5, "x"]}') == {"a": [1, 2.5, "x"]}


def test_an_integer_too_long_to_read_is_refused_without_python_s_advice():
    """A 5,000-digit integer: the line said Python's advice to a programmer ('use sys.set_int_max_str_digits() to
    increase the limit'), which no user of a log or a manifest can follow."""
    with pytest.raises(jsonfiles.JsonProblem) as refused:
        jsonfiles.loads('{"iteration": ' + "9" * 5000 + "}")
    assert str(refused.value) == ("Exceeds the limit (4300 digits) for integer string conversion: value has 5000 "
                                  "digits"), str(refused.value)
