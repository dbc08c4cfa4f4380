"""What a prompts file's bytes become: the prompts an editor shows, one per line, whatever the editor's line ends and
byte-order mark."""
from __future__ import annotations

import pytest

from agg_bench.engine.prompts import load_prompts
from agg_bench.errors import ConfigError


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


@pytest.mark.parametrize("separator", ["\u2028", "\u2029"])  # U+0085, a control character: refused below
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


@pytest.mark.parametrize("name, data, lineno, shown", [
    ("prompts.txt", b"a red cube\nblue\x00 sphere\n", 2, "'\\x00' (U+0000) at character 5"),
    ("prompts.txt", b"\x1b[31ma red cube\n", 1, "'\\x1b' (U+001B) at character 1"),
    ("prompts.txt", b"a red\x0ccube\n", 1, "'\\x0c' (U+000C) at character 6"),
    ("prompts.txt", "a red\x85cube\n".encode(), 1, "'\\x85' (U+0085) at character 6"),  # NEL: a C1 control
    ("prompts.jsonl", b'{"prompt": "a red cube"}\n{"prompt": "two\\nlines"}\n', 2, "'\\n' (U+000A) at character 4"),
    ("prompts.jsonl", b'{"prompt": "a red\\rcube"}\n', 1, "'\\r' (U+000D) at character 6"),
    ("prompts.jsonl", b'{"prompt": "a red \\u007f"}\n', 1, "'\\x7f' (U+007F) at character 7"),
])
def test_a_prompt_with_a_control_character_is_refused(tmp_path, capsys, name, data, lineno, shown):
    """A NUL, an escape sequence, a form feed or a newline inside a .jsonl string became part of a prompt: given to
    the text encoder and printed raw into logs, tables and sample grids. One line naming the file, the line and the
    character (escaped), exit 2, before anything is written."""
    from agg_bench.cli import main

    path = tmp_path / name
    path.write_bytes(data)
    out = tmp_path / "e" / "x.safetensors"
    assert main(["embed", "--set", f"prompts.file={path}", "--out", str(out)]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].isprintable(), lines
    assert (f"prompts.file = '{path}:{lineno}': expected prompts without control characters (tab is allowed): "
            f"it holds {shown}") in lines[0], lines
    assert not out.parent.exists()


def test_a_tab_is_allowed_and_a_lone_surrogate_refused(tmp_path):
    (tmp_path / "prompts.txt").write_text("a red\tcube\n", encoding="utf-8")
    (tmp_path / "prompts.jsonl").write_text('{"prompt": "a\\tb"}\n', encoding="utf-8")
    assert load_prompts(tmp_path / "prompts.txt") == ["a red\tcube"]
    assert load_prompts(tmp_path / "prompts.jsonl") == ["a\tb"]
    (tmp_path / "prompts.jsonl").write_text('{"prompt": "x"}\n{"prompt": "a \\udcff"}\n', encoding="utf-8")
    with pytest.raises(ConfigError, match=r"prompts.jsonl:2': expected prompts of UTF-8 text: it holds a lone surrogate"):
        load_prompts(tmp_path / "prompts.jsonl")


@pytest.mark.parametrize("name, data, lineno, shown", [
    ("prompts.txt", "a red cube\nred \u202eebuc\n".encode(), 2, "U+202E RIGHT-TO-LEFT OVERRIDE (category Cf) at character 5"),
    ("prompts.txt", "a \u202ared cube\n".encode(), 1, "U+202A LEFT-TO-RIGHT EMBEDDING (category Cf) at character 3"),
    ("prompts.jsonl", b'{"prompt": "a red \\u2066cube"}\n', 1, "U+2066 LEFT-TO-RIGHT ISOLATE (category Cf) at "
                                                             "character 7"),
    ("prompts.jsonl", b'{"prompt": "a red cube\\u2069"}\n', 1, "U+2069 POP DIRECTIONAL ISOLATE (category Cf) at "
                                                             "character 11"),
])
def test_a_prompt_with_a_bidi_control_is_refused(tmp_path, name, data, lineno, shown):
    """A bidi embedding, override or isolate made a prompt shown in the logs, tables and sample grids read
    differently from the text the encoder was given ('red \\u202eebuc' shows as 'red cube'). One line naming the
    file, the line and the character's code point, never the character itself."""
    path = tmp_path / name
    path.write_bytes(data)
    with pytest.raises(ConfigError) as refused:
        load_prompts(path)
    line = str(refused.value)
    assert line.isprintable(), line
    assert (f"prompts.file = '{path}:{lineno}': expected prompts without bidi embeddings, overrides or isolates "
            f"(U+202A to U+202E, U+2066 to U+2069), which make a shown prompt read differently from its bytes: it "
            f"holds {shown}") == line.removeprefix("config error: "), line


def test_the_shipped_prompt_sets_and_other_unprintable_text_pass(tmp_path):
    """What a caption may hold stays: a no-break space (printable to no str.isprintable), accents, other scripts, and
    the format characters of real text (an emoji's zero-width joiner, Persian's zero-width non-joiner, a soft hyphen,
    a zero-width space); every prompt set the repository ships loads."""
    from pathlib import Path

    kept = ["a red\u00a0cube", "caf\u00e9 \u732b \u05e9\u05dc\u05d5\u05dd", "a family \U0001f468\u200d\U0001f469",
            "\u0645\u06cc\u200c\u062e\u0648\u0627\u0647\u0645", "cu\u00adbe", "a red\u200bcube"]
    (tmp_path / "prompts.txt").write_text("\n".join(kept) + "\n", encoding="utf-8")
    assert load_prompts(tmp_path / "prompts.txt") == kept
    root = Path(__file__).resolve().parents[2]
    for path in (root / "agg_bench" / "data" / "prompts.txt", *sorted((root / "config" / "prompts").glob("*.*"))):
        if path.suffix in (".txt", ".jsonl"):
            assert load_prompts(str(path)), path
