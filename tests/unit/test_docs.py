"""The documentation's links resolve, and the README stays a front door (about 150 lines at most)."""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", ROOT / "config" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def relative_links(path: Path) -> list[str]:
    """Targets of the Markdown links and images in ``path`` that point into the repository."""
    targets = [m.group(1).split("#", 1)[0] for m in LINK.finditer(path.read_text())]
    return [t for t in targets if t and not re.match(r"^[a-z]+:", t)]


def test_every_link_resolves():
    broken = [f"{path.relative_to(ROOT)} -> {target}" for path in DOCS for target in relative_links(path)
              if not (path.parent / target).exists()]
    assert not broken, broken
    assert sum(len(relative_links(path)) for path in DOCS) > 20  # the check sees the links


def test_the_readme_is_a_front_door():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 150
    for doc in sorted((ROOT / "docs").glob("*.md")):  # every document is reachable from it
        assert f"(docs/{doc.name})" in readme, doc.name


def test_every_verb_is_in_the_command_line_reference():
    from agg_bench.cli import build_parser

    parser = build_parser()
    verbs = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction").choices
    reference = (ROOT / "docs" / "cli.md").read_text()
    missing = [verb for verb in verbs if f"agg-bench {verb}" not in reference]
    assert len(verbs) >= 10 and not missing, missing


def test_every_sweep_key_is_in_the_sweep_config_reference():
    """config/README.md's table names every top-level key of the sweep schema, and each key of `campaign`."""
    import yaml

    schema = yaml.safe_load((ROOT / "workflow" / "schemas" / "config.schema.yaml").read_text())
    table = (ROOT / "config" / "README.md").read_text()
    rows = set(re.findall(r"^\| `(\w+)` \|", table, re.M))
    keys = set(schema["properties"])
    assert len(keys) >= 12 and keys == rows, sorted(keys ^ rows)
    campaign = table.split("| `campaign` |", 1)[1].split("\n", 1)[0]
    missing = [k for k in schema["properties"]["campaign"]["properties"] if f"`{k}`" not in campaign]
    assert not missing, missing


# ---- what the documentation names exists in the code -----------------------------------------------------------

# Everything a user reads: the README, the documents, and the comments at the top of the configs.
READ = [*DOCS, *sorted((ROOT / "config").rglob("*.yaml"))]
# docs/methods.md's recipe cards and the presets' headers cite the public code's own files and config keys
# (`config/nft.py`, `train.beta`), which are not this repository's.
CITES_PUBLIC_CODE = {ROOT / "docs" / "methods.md", *(ROOT / "config" / "presets").glob("*.yaml")}
CODE = re.compile(r"```[^\n]*\n(.*?)```|`([^`\n]+)`", re.S)  # a fenced block, or an inline code span
COMMAND = re.compile(r"(?:agg-bench|python -m agg_bench)[ \t]+([^\s|;&#]+)((?:[^\n#|;&]|\\\n)*)")


def code_texts(path: Path) -> list[str]:
    """The fenced blocks and inline code spans of a Markdown file (a YAML file: its comment lines)."""
    text = path.read_text()
    if path.suffix == ".yaml":
        return [line.split("#", 1)[1] for line in text.splitlines() if "#" in line]
    return [block or span for block, span in CODE.findall(text)]


def verb_options() -> dict[str, set[str]]:
    from agg_bench.cli import build_parser

    parser = build_parser()
    verbs = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction").choices
    return {verb: {flag for action in sub._actions for flag in action.option_strings} for verb, sub in verbs.items()}


def test_every_command_line_in_the_docs_takes_the_flags_it_shows():
    """`agg-bench VERB ... --flag` in any document's code: VERB is a verb and `--flag` one of its options."""
    options = verb_options()
    seen, wrong = 0, []
    for path in READ:
        for code in code_texts(path):
            for verb, rest in COMMAND.findall(code):
                verb = verb.rstrip(":,.;)`")  # `agg-bench run`: ..., in a list of verbs
                if verb in ("--help", "--version", "VERB", ""):
                    continue
                seen += 1
                if verb not in options:
                    wrong.append(f"{path.relative_to(ROOT)}: agg-bench {verb}")
                    continue
                wrong += [f"{path.relative_to(ROOT)}: agg-bench {verb} {flag}"
                          for flag in re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", rest) if flag not in options[verb]]
    assert seen > 60 and not wrong, wrong


def test_the_command_line_reference_names_every_option_of_every_verb():
    reference = (ROOT / "docs" / "cli.md").read_text()
    missing = [f"{verb} {flag}" for verb, flags in verb_options().items() for flag in sorted(flags)
               if flag.startswith("--") and flag != "--help" and not re.search(re.escape(flag) + r"(?![\w-])", reference)]
    assert not missing, missing
    row = next(line for line in (ROOT / "README.md").read_text().splitlines() if line.startswith("| [docs/cli.md]"))
    assert [verb for verb in verb_options() if not re.search(rf"\b{verb}\b", row)] == []


PATH = re.compile(r"(?<![\w/.-])((?:agg_bench|baselines|workflow|scripts|tests|config|docs|benchmarks|requirements)"
                  r"/[\w./-]*[\w/])")


# what a documented command makes or removes: docs/learning.md's `pretrain` writes the sample grid, then `rm` drops it
MADE_BY_A_COMMAND = {"tests/data/sd3-scenes/samples.png"}


def test_every_repository_path_the_docs_name_exists():
    """A path named in code or a link is a file or folder of the repository (a wing's own path, `engine/grpo.py`,
    is not checked; `config/load.py` in docs/design.md is agg_bench/config/load.py; a pattern, `config/gpu*.yaml`,
    is not a path)."""
    named, missing = 0, []
    for path in READ:
        for code in [*code_texts(path), *relative_links(path)]:
            for match in PATH.finditer(code):
                name = match.group(1)
                if code[match.end():match.end() + 1] in ("*", "{", "<") or name in MADE_BY_A_COMMAND:
                    continue
                if path in CITES_PUBLIC_CODE and name.startswith(("config/", "scripts/")) and not name.endswith(".yaml"):
                    continue
                named += 1
                if not any((base / name).exists() for base in (ROOT, ROOT / "agg_bench", path.parent)):
                    missing.append(f"{path.relative_to(ROOT)}: {name}")
    assert named > 200 and not missing, missing


def test_every_test_the_docs_name_exists():
    sources = {path.name: path.read_text() for folder in ("tests", "benchmarks") for path in (ROOT / folder).rglob("*.py")}
    named, missing = 0, []
    for path in READ:
        for name, is_file in re.findall(r"\b(test_\w+?)(\.py)?\b", path.read_text()):
            named += 1
            if (f"{name}.py" not in sources) if is_file else not (
                    f"{name}.py" in sources or any(f"def {name}(" in text for text in sources.values())):
                missing.append(f"{path.relative_to(ROOT)}: {name}{is_file}")
    assert named > 30 and not missing, missing
