"""The package layout: every module imports only its own wing and the wings below it, agg_bench never
imports the baselines (methods register themselves by module name), no module-level import cycle exists
among agg_bench and baselines modules, no two modules share a file name, and docs/design.md's Architecture tree
names every module. (That the methods' checks import no diffusers, peft or transformers needs a fresh
interpreter: tests/integration/test_fresh_interpreters.py.)"""
import ast
from pathlib import Path


ROOT = Path(__file__).resolve().parents[2]


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: Path, top_level_only: bool) -> set[str]:
    """Project modules ``path`` imports (absolute names; relative imports resolved)."""
    tree = ast.parse(path.read_text())
    package = module_name(path) if path.name == "__init__.py" else module_name(path).rpartition(".")[0]
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    out = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            out |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([node.module] if node.module else []))
            out.add(base)
            out |= {f"{base}.{alias.name}" for alias in node.names}
    return {name for name in out if name.split(".")[0] in ("agg_bench", "baselines")}


def project_files():
    return [p for folder in ("agg_bench", "baselines") for p in sorted((ROOT / folder).rglob("*.py"))]


# The wings of agg_bench, lowest first. A module imports (at module level or inside a function) only modules
# of its own wing and of the wings below it. The basics are agg_bench's top-level modules (the contracts among
# them: errors, the record contract, the one reader of a run folder) and the packages of BASIC_PACKAGES (the
# run config, one concern in a few modules, imported by every wing); the results readers stand above the
# runtime, as code that reads what runs wrote; the baselines are methods. The entry points sit above every
# wing: cli.py and __main__.py, and agg_bench/sde.py, the contract path other tools import the engine's SDE
# step from (nothing in the repository imports it).
WINGS = ("basics", "machine", "engine", "methods", "runtime", "results", "tools", "entry")
ENTRY_POINTS = ("agg_bench.cli", "agg_bench.__main__", "agg_bench.sde")
BASIC_PACKAGES = ("config",)


def wing(module: str) -> str:
    parts = module.split(".")
    if parts[0] == "baselines":
        return "methods"
    if module in ENTRY_POINTS:
        return "entry"
    if len(parts) > 1 and parts[1] in BASIC_PACKAGES:
        return "basics"
    if len(parts) > 1 and (ROOT / "agg_bench" / parts[1] / "__init__.py").is_file():
        assert parts[1] in WINGS, f"agg_bench/{parts[1]}/ is not a wing of tests/unit/test_import_graph.py's WINGS"
        return parts[1]
    return "basics"


def project_imports() -> dict[str, set[str]]:
    """Every project module -> the project modules it imports anywhere (names resolved to their module)."""
    files = {module_name(p): p for p in project_files()}

    def module_of(name: str) -> str:
        while name not in files and "." in name:
            name = name.rpartition(".")[0]
        return name

    return {name: {module_of(m) for m in imported_modules(path, top_level_only=False)} - {name}
            for name, path in files.items()}


def test_every_module_imports_only_its_own_wing_and_the_wings_below():
    upward = [f"{name} ({wing(name)}) imports {target} ({wing(target)})"
              for name, imported in project_imports().items() for target in sorted(imported)
              if WINGS.index(wing(target)) > WINGS.index(wing(name))]
    assert not upward, "\n".join(upward)


def test_the_wings_are_in_place():
    assert {wing(name) for name in project_imports()} == set(WINGS)
    assert wing("agg_bench.engine.reward_models.hpsv2") == "engine" and wing("baselines.caches.fora") == "methods"
    assert wing("agg_bench.config") == "basics" and wing("agg_bench.config.load") == "basics"
    assert wing("agg_bench.cli") == "entry" and wing("agg_bench.sde") == "entry"
    assert wing("agg_bench.records") == "basics" and wing("agg_bench.reading") == "basics"


def test_a_module_name_means_one_thing():
    """No two modules of agg_bench and baselines share a file name (a package's __init__.py aside), so that a
    name found by grep is one module."""
    names: dict[str, list[str]] = {}
    for path in project_files():
        if path.name != "__init__.py":
            names.setdefault(path.name, []).append(str(path.relative_to(ROOT)))
    assert {name: paths for name, paths in names.items() if len(paths) > 1} == {}


def test_the_contract_alias_is_imported_by_nothing_in_the_repository():
    # one way to import each thing: code imports agg_bench.engine.sampler; agg_bench.sde is for other tools
    sources = [*project_files(), *(ROOT / "benchmarks").rglob("*.py"),
               *(p for p in (ROOT / "tests").rglob("*.py") if p.name != "test_sde.py")]
    assert [p for p in sources if "agg_bench.sde" in imported_modules(p, top_level_only=False)] == []


def test_the_engine_never_imports_the_baselines():
    for path in (ROOT / "agg_bench").rglob("*.py"):
        assert not {m for m in imported_modules(path, top_level_only=False) if m.startswith("baselines")}, path


def test_no_module_level_import_cycle():
    files = {module_name(p): p for p in project_files()}
    graph = {name: {m for m in imported_modules(path, top_level_only=True) if m in files and m != name}
             for name, path in files.items()}
    # the LoRA helpers sit below the models: models import lora, never the other way
    assert "agg_bench.engine.lora" in graph["agg_bench.engine.models"]
    assert "agg_bench.engine.models" not in graph["agg_bench.engine.lora"]
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(name: str, path: list[str]) -> None:
        state[name] = 1
        for nxt in sorted(graph[name]):
            assert state.get(nxt) != 1, " -> ".join([*path, name, nxt])
            if nxt not in state:
                visit(nxt, [*path, name])
        state[name] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [])
    assert len(state) == len(files) > 20


def architecture_tree() -> set[str]:
    """The paths that docs/design.md's Architecture tree names under agg_bench/ and baselines/, from the
    indentation of each line's first word. A package's line stands for its __init__.py."""
    section = (ROOT / "docs" / "design.md").read_text().split("\n## Architecture\n", 1)[1].split("\n## ", 1)[0]
    named, folders = set(), []
    for line in section.split("```\n", 2)[1].splitlines():
        depth, name = (len(line) - len(line.lstrip(" "))) // 2, line.split()[0]
        del folders[depth:]
        if depth == 0 and name not in ("agg_bench/", "baselines/"):
            folders.append(None)  # Snakefile, config/, tests/ ...: outside the packages
        elif None not in folders:
            path = "".join(folders) + name
            named.add(path + "__init__.py" if (ROOT / path / "__init__.py").is_file() else path)
            if name.endswith("/"):
                folders.append(name)
    return named


def test_the_design_document_names_every_module():
    named = architecture_tree()
    assert {str(p.relative_to(ROOT)) for p in project_files()} - named == set(), "not in docs/design.md's tree"
    assert {name for name in named if not (ROOT / name).exists()} == set(), "named in docs/design.md, not here"
