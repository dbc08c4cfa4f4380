"""What a prompts file's bytes become: the prompts an editor shows, one per line, whatever the editor's line ends and
byte-order mark."""
from __future__ import annotations

import pytest

from agg_bench.engine.prompts import load_prompts


@pytest.mark.parametrize("data", [
    b"\xef\xbb\xbfa red cube\r\nblue sphere\r\n",  # Windows: a byte-order mark and CRLF
    b"a red cube\rblue sphere\r",  # classic Mac line ends
    b"a red cube\n\n  \nblue sphere",  # blank lines and no end at the last line
])
def test_a_txt_file_is_its_lines(tmp_path, data):
    path = tmp_path / "prompts.txt"
    path.write_bytes(data)
    assert load_prompts(path) == ["a red cube", "blue sphere"]


def test_a_jsonl_file_with_a_byte_order_mark(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_bytes(b'\xef\xbb\xbf{"prompt": "a red cube"}\r\n{"prompt": "blue sphere"}\r\n')
    assert load_prompts(path) == ["a red cube", "blue sphere"]


@pytest.mark.parametrize("separator", ["\u2028", "\u2029", "\x85"])
def test_a_unicode_line_separator_inside_a_prompt_does_not_split_it(tmp_path, separator):
    """str.splitlines ended a line there, so one prompt became two, and a JSON string holding one raw (which JSON
    allows) was refused as malformed."""
    text = f"a red{separator}cube"
    (tmp_path / "prompts.txt").write_text(f"{text}\nblue sphere\n", encoding="utf-8")
    (tmp_path / "prompts.jsonl").write_text(f'{{"prompt": "{text}"}}\n', encoding="utf-8")
    assert load_prompts(tmp_path / "prompts.txt") == [text, "blue sphere"]
    assert load_prompts(tmp_path / "prompts.jsonl") == [text]


@pytest.mark.parametrize("name, data", [
    ("prompts.json", b'["a red cube",\n "blue sphere"]\n'),  # each line was a prompt: '["a red cube",'
    ("prompts.csv", b"prompt,seed\na red cube,1\n"),
    ("prompts", b"a red cube\n"),
])
def test_a_prompts_file_of_another_kind_is_refused_by_its_suffix(tmp_path, capsys, name, data):
    from agg_bench.cli import main

    path = tmp_path / name
    path.write_bytes(data)
    out = tmp_path / "e" / "x.safetensors"
    assert main(["embed", "--set", f"prompts.file={path}", "--out", str(out)]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and f"prompts.file = '{path}': expected a .txt" in lines[0], lines
    assert not out.parent.exists()
