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
