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


def heading_anchors(path: Path) -> set[str]:
    """The anchors GitHub gives the headings of a Markdown file: lower case, punctuation but `-` and `_` dropped,
    spaces as `-`, a repeated one numbered (`#dgpo`, `#dgpo-1`); headings inside fenced blocks are none."""
    text = re.sub(r"^```.*?^```", "", path.read_text(), flags=re.S | re.M)
    anchors: set[str] = set()
    for heading in re.findall(r"^#{1,6}[ \t]+(.+?)[ \t#]*$", text, re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        anchor, n = slug, 0
        while anchor in anchors:
            n += 1
            anchor = f"{slug}-{n}"
        anchors.add(anchor)
    return anchors


def test_heading_anchors_are_githubs():
    path = ROOT / "docs" / "methods.md"
    assert {"options", "dgpo", "dgpo-1", "methodname-agg", "caches-fora-and-teacache",
            "branch-branchgrpo"} <= heading_anchors(path)


def test_every_link_to_a_section_finds_it():
    """`[text](file.md#anchor)` and `[text](#anchor)` name a heading of that file (a section renamed or merged
    left links that open the file at its top)."""
    seen, broken = 0, []
    for path in DOCS:
        for target in (m.group(1) for m in LINK.finditer(path.read_text())):
            name, _, anchor = target.partition("#")
            if not anchor or re.match(r"^[a-z]+:", target) or not (name.endswith(".md") or not name):
                continue
            seen += 1
            if anchor not in heading_anchors(path.parent / name if name else path):
                broken.append(f"{path.relative_to(ROOT)} -> {target}")
    assert seen >= 15 and not broken, broken


def test_every_preset_is_in_the_readme_and_the_method_reference():
    """Each run config of config/presets/ is named in the README's list of presets and in docs/methods.md (a new
    preset missed the README's list), and the presets docs/design.md names as a contract are files there."""
    presets = sorted(path.stem for path in (ROOT / "config" / "presets").glob("*.yaml"))
    readme = (ROOT / "README.md").read_text().split("\n## Methods\n", 1)[1].split("\n## ", 1)[0]
    methods = (ROOT / "docs" / "methods.md").read_text()
    assert len(presets) >= 10
    assert [name for name in presets if f"`{name}`" not in readme] == []
    assert [name for name in presets if f"{name}.yaml" not in methods] == []
    design = " ".join((ROOT / "docs" / "design.md").read_text().split())
    (named,) = re.findall(r"`config/presets/\{([^}]*)\}\.yaml`", design)
    names = [name.strip() for name in named.split(",")]
    assert len(names) >= 8 and [name for name in names if name not in presets] == []


NUMBERS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten"]


def test_the_cache_lists_name_every_cache():
    """docs/methods.md's `cached` row names every registered cache, and the README's count of them is theirs (its
    introduction's "FBC, FORA, TeaCache and five more" and its methods table's `cached` row)."""
    from baselines.caches import CACHES

    caches = CACHES.names()
    methods = (ROOT / "docs" / "methods.md").read_text()
    row = next(line for line in methods.splitlines() if line.startswith("| `cached` |"))
    assert len(caches) >= 8 and [name for name in caches if not re.search(rf"\b{name}\b", row)] == []
    readme = (ROOT / "README.md").read_text()
    named, more = re.search(r"inference caches \(([^)]*?) and (\w+) more\)", " ".join(readme.split())).groups()
    assert len(named.split(", ")) + NUMBERS.index(more) == len(caches)
    row = next(line for line in readme.splitlines() if line.startswith("| `cached` |"))
    assert len(row.split("|")[2].split(",")) == len(caches)


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
    missing = []
    for key, prop in schema["properties"].items():  # each section's own keys in its row (a device's, an entry's)
        row = table.split(f"| `{key}` |", 1)[1].split("\n", 1)[0]
        inner = prop.get("properties") or (prop.get("additionalProperties") or {}).get("properties") \
            or (prop.get("items") or {}).get("properties") or {}
        spans = re.findall(r"`([^`]*)`", row)  # `gpus`, or a key of a mapping shown whole: `{config, set}`
        missing += [f"{key}.{k}" for k in inner if not any(re.search(rf"(?<![\w.]){k}\b", s) for s in spans)]
    assert not missing, missing


def test_the_config_folder_reference_names_every_file_in_it():
    text = (ROOT / "config" / "README.md").read_text()
    names = [p.name for p in sorted((ROOT / "config").iterdir()) if p.name != "README.md"]
    assert len(names) >= 10 and [name for name in names if f"`{name}" not in text] == []


# ---- what the documentation names exists in the code -----------------------------------------------------------

# Everything a user reads: the README, the documents, and the comments at the top of the configs.
READ = [*DOCS, *sorted((ROOT / "config").rglob("*.yaml"))]
# docs/methods.md's recipe cards and the presets' headers cite the public code's own files and config keys
# (`config/nft.py`, `train.beta`), which are not this repository's.
CITES_PUBLIC_CODE = {ROOT / "docs" / "methods.md", *(ROOT / "config" / "presets").glob("*.yaml")}
CODE = re.compile(r"```[^\n]*\n(.*?)```|`([^`\n]+)`", re.S)  # a fenced block, or an inline code span
# the rest of the command: its continuation lines (`\` at a line's end) and bracketed choices (`[--time auto|cpu]`)
COMMAND = re.compile(r"(?:agg-bench|python -m agg_bench)[ \t]+([^\s|;&#]+)((?:\\\n|\[[^\]\n#]*\]|[^\n#|;&])*)")


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


def test_the_command_line_summary_shows_every_option_of_every_verb():
    """docs/cli.md's first block, the usage of every verb, shows each option on a line of its own verb (an option
    named only in the prose below, `report --manifest` once, was missing from where a reader looks for it)."""
    reference = (ROOT / "docs" / "cli.md").read_text()
    summary = next(block for block, _ in CODE.findall(reference) if block)
    shown: dict[str, set[str]] = {}
    for verb, rest in COMMAND.findall(summary):
        shown.setdefault(verb, set()).update(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", rest))
    missing = [f"{verb} {flag}" for verb, flags in verb_options().items() for flag in sorted(flags)
               if flag.startswith("--") and flag != "--help" and flag not in shown.get(verb, set())]
    assert len(shown) >= 10 and not missing, missing


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


# the public code's keys that docs/design.md names beside ours ("`train.eval_ema`, DiffusionNFT's `train.ema`")
PUBLIC_CODE_KEYS = {"train.ema"}


def test_every_run_config_key_the_docs_name_exists():
    """`section.key` (`train.plan`, `method.window`) in any document or config comment is a key of the run
    config, or an option of some method or cache."""
    from agg_bench.config import docs as config_docs
    from agg_bench.config.options import option_names
    from agg_bench.methods.option_tables import chosen, method_options_classes

    keys = {row[0].strip("`") for row in config_docs.reference_rows()}
    sections = {key.split(".", 1)[0] for key in keys if "." in key} - {"method"}
    options = {"name"}
    for cls in method_options_classes().values():
        options |= set(option_names(cls))
        options |= {name for picked in (chosen(cls) or ("", {}))[1].values() for name in option_names(picked)}
    dotted = re.compile(rf"(?<![\w./-])({'|'.join(sorted(sections))}|method)\.([a-z_]+)(?![\w(/-])")
    named, unknown = 0, []
    for path in READ:
        if path.name == "configuration.md":
            continue  # generated from the keys themselves
        for section, key in dotted.findall(path.read_text()):
            if key in ("py", "md", "yaml", "json", "jsonl", "csv", "txt"):
                continue  # a file name: `grpo.py`, `learning.md`
            named += 1
            if section == "method":
                known = key in options
            elif path in CITES_PUBLIC_CODE and section == "train":
                continue  # the public code's own `train.*` keys (`train.beta`, `train.ema`)
            elif f"{section}.{key}" in PUBLIC_CODE_KEYS:
                continue
            else:
                known = f"{section}.{key}" in keys or any(k.startswith(f"{section}.{key}.") for k in keys)
            if not known:
                unknown.append(f"{path.relative_to(ROOT)}: {section}.{key}")
    assert named > 300 and not unknown, sorted(set(unknown))


def test_the_metric_record_section_names_every_record_key():
    from agg_bench.records import RECORD_KEYS

    design = (ROOT / "docs" / "design.md").read_text()
    section = design.split("\n### Metric record\n", 1)[1].split("\n### ", 1)[0]
    named = {name for span in re.findall(r"`([^`]+)`", section) for name in re.split(r",\s*", span)}
    assert [key for key in RECORD_KEYS if key not in named] == []


def test_every_make_target_and_environment_variable_the_docs_name_exists():
    makefile = (ROOT / "Makefile").read_text()
    targets = set(re.findall(r"^([a-z-]+):", makefile, re.M))
    code = "\n".join(text for path in READ for text in code_texts(path))
    named = set(re.findall(r"(?<![\w-])make ([a-z][a-z-]*)", code))
    assert {"pipeline", "test", "learning"} <= named and named - targets == set(), named - targets
    sources = "\n".join(path.read_text() for folder in ("agg_bench", "scripts", "tests")
                        for path in (ROOT / folder).rglob("*") if path.suffix in (".py", ".sh"))
    variables = set(re.findall(r"\bAGG_BENCH_[A-Z_]+\b", "\n".join(path.read_text() for path in READ)))
    assert len(variables) >= 3 and [v for v in sorted(variables) if v not in sources] == []


def test_every_method_and_reward_is_in_its_reference():
    """README.md's methods table has a row per registered method, docs/rewards.md names every registered reward."""
    from agg_bench.engine.rewards import REWARDS
    from agg_bench.methods.base import METHOD_MODULES

    readme = (ROOT / "README.md").read_text().split("\n## Methods\n", 1)[1].split("\n## ", 1)[0]
    rows = set(re.findall(r"^\| `(\w+)` \|", readme, re.M))
    assert len(METHOD_MODULES) >= 11 and set(METHOD_MODULES) - rows == set(), set(METHOD_MODULES) - rows
    rewards = (ROOT / "docs" / "rewards.md").read_text()
    assert len(REWARDS.names()) >= 9 and [name for name in REWARDS.names() if f"`{name}`" not in rewards] == []


def test_every_optional_flag_value_the_docs_show_is_its_default():
    """`[--flag VALUE]` in a documented command shows the flag left out: VALUE is the default the verb takes
    (a placeholder, `[--gpus N]`, a list or a choice, `[--time auto|cpu|wall]`, and a flag without a default are
    not checked)."""
    from agg_bench.cli import build_parser

    parser = build_parser()
    verbs = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction").choices
    defaults = {verb: {flag: action.default for action in sub._actions for flag in action.option_strings}
                for verb, sub in verbs.items()}
    seen, wrong = 0, []
    for path in READ:
        for code in code_texts(path):
            for verb, rest in COMMAND.findall(code):
                for flag, value in re.findall(r"\[(--[a-z][a-z0-9-]*) ([a-z0-9][a-z0-9.]*)\]", rest):
                    default = defaults.get(verb, {}).get(flag)
                    if default is None or isinstance(default, (list, bool)):
                        continue
                    seen += 1
                    if value != str(default):
                        wrong.append(f"{path.relative_to(ROOT)}: agg-bench {verb} [{flag} {value}], default {default}")
    assert seen >= 10 and not wrong, wrong


def test_the_architecture_tree_lists_every_module():
    """docs/design.md's tree under "Architecture" names every module of agg_bench and baselines, and only
    files that exist (a folder's line stands for its `__init__.py`)."""
    tree = (ROOT / "docs" / "design.md").read_text().split("\n## Architecture\n\n```\n", 1)[1].split("```", 1)[0]
    listed, stack = set(), []
    for line in tree.splitlines():
        indent = len(line) - len(line.lstrip())
        if not line.strip() or indent >= 20:  # a description's second line
            continue
        stack = stack[:indent // 2] + [line.split()[0].rstrip(",")]
        listed.add("".join(stack).rstrip("/"))
    modules = {path.relative_to(ROOT).as_posix() for folder in ("agg_bench", "baselines")
               for path in (ROOT / folder).rglob("*.py")}
    modules = {m[:-len("/__init__.py")] if m.endswith("/__init__.py") else m for m in modules}
    assert len(modules) > 80 and sorted(modules - listed) == []
    assert [name for name in sorted(listed) if not (ROOT / name).exists()] == []


# The command lines that tools outside the repository run (docs/design.md, Contracts), written out here as they
# give them: a verb or an option renamed in the code and the documents alike is still caught.
CONTRACT_COMMANDS = [
    ["run", "--config", "c.yaml", "--set", "train.lr=1e-5", "--set", "seed=1", "--out", "runs/r"],
    ["snapshot", "--config", "c.yaml", "--set", "seed=1", "--out", "snap"],
    ["replay", "snap", "--method", "agg", "--set", "method.window=5", "--out", "g.safetensors"],
    ["plan", "--config", "c.yaml", "--set", "seed=1", "--gpu-memory", "80", "--gpus", "2", "--json"],
    ["pretrain", "--config", "p.yaml", "--out", "model"],
    ["gradcheck", "--out", "g.csv"], ["report", "--runs", "runs/r", "--tables", "t"],
    ["profile", "--method", "full", "--out", "p"], ["env"],
]


def test_the_contract_command_lines_parse():
    from agg_bench.cli import build_parser

    parser = build_parser()
    for argv in CONTRACT_COMMANDS:
        args = parser.parse_args(argv)
        assert args.command == argv[0], argv
    replay = parser.parse_args(CONTRACT_COMMANDS[2])
    assert (str(replay.snapshot), replay.method, replay.overrides, str(replay.out)) == (
        "snap", "agg", ["method.window=5"], "g.safetensors")
    plan = parser.parse_args(CONTRACT_COMMANDS[3])
    assert (plan.gpu_memory, plan.gpus, plan.json, plan.overrides) == (80, 2, True, ["seed=1"])


def test_the_design_names_every_tensor_and_setting_a_snapshot_holds():
    """docs/design.md's `agg-bench snapshot` contract lists every tensor rollout.safetensors may hold (the optional
    ones too: a Qwen-Image snapshot's text mask was missing) and every rollout.json setting."""
    from agg_bench.tools.snapshot import LORA_SETTINGS, ROLLOUT_SHAPES, SETTINGS

    design = (ROOT / "docs" / "design.md").read_text()
    bullet = design.split("- `agg-bench snapshot --config", 1)[1].split("\n- `agg-bench ", 1)[0]
    names = [*ROLLOUT_SHAPES, *SETTINGS, "lora", "vae_scale_factor"]
    assert len(LORA_SETTINGS) and [name for name in names if f"`{name}`" not in bullet] == []


def test_every_reference_folder_the_design_names_is_committed_or_said_not_to_be():
    """A reference folder docs/design.md names (`results/reference/NAME/`) is in the repository, or the design says
    it is not committed yet (the GPU learning sweep's was described as there while it was not)."""
    design = (ROOT / "docs" / "design.md").read_text()
    named = sorted(set(re.findall(r"`results/reference/([\w.-]+)/`", design)))
    absent = [name for name in named if not (ROOT / "results" / "reference" / name).is_dir()]
    flat = " ".join(design.split())
    unsaid = [name for name in absent if not any("not committed yet" in flat[at.start():at.start() + 400]
                                                 for at in re.finditer(re.escape(f"`results/reference/{name}/`"), flat))]
    assert "h200" in named and "h200" not in absent and unsaid == []


def test_the_gpu_window_install_command_is_one_in_the_docs_and_the_wheel_script():
    """docs/paper-scale.md's window command installs the wheels as scripts/gpu_wheels.sh's header says to (the two
    were changed together once; one left behind would install into another folder or keep stale wheels)."""
    def install(text: str) -> list[str]:
        text = " ".join(text.replace("\\\n", " ").replace("#", " ").split())
        (command,) = re.findall(r"python3 -m pip install (.*?\.whl/\*\.whl && export PYTHONPATH=\S+(?: \w+=\S+)*)", text)
        return command.split()

    docs = install((ROOT / "docs" / "paper-scale.md").read_text())
    script = install((ROOT / "scripts" / "gpu_wheels.sh").read_text())
    assert "--target" in docs and docs == script
