"""Method and cache options are typed once (agg_bench/config/options.py): every option of every method and cache
refuses a wrong type, a value below and above its bounds and NaN with one line naming it (exit 2, nothing
written); docs/methods.md's option tables are the generated ones; the method section's JSON schema agrees with
the refusals; and a method may live outside the repository, named by a dotted path in the user's own config."""
from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

import jsonschema
import pytest
import yaml

from agg_bench import cli
from agg_bench.config import load_config
from agg_bench.config.options import option_names, options_schema
from agg_bench.errors import ConfigError
from agg_bench.methods import option_tables as method_docs
from agg_bench.runtime.config_check import check_config

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "methods.md"


def test_the_option_tables_are_the_generated_ones():
    text = DOC.read_text(encoding="utf-8")
    assert method_docs.with_tables(text) == text, \
        "docs/methods.md is stale: python -m agg_bench.methods.option_tables --write docs/methods.md"
    assert method_docs.main(["--check", str(DOC)]) == 0
    for name in method_docs.method_options_classes():
        assert f"#### `method.name: {name}`" in text
    assert "| `method.window` | `5` | integer from 1 to 1000 |" in text  # agg's, as the field says


def test_an_allowed_cell_says_null_once():
    """An option whose own wording already allows null (`micro_batch`: "null or an integer >= 1") is not given
    a second "or null"; the run config's table likewise."""
    from agg_bench.config import docs as config_docs

    rows = [row for cls in method_docs.method_options_classes().values() for row in method_docs.option_rows(cls)]
    rows += config_docs.reference_rows()
    nullable = [row for row in rows if "null" in row[2]]
    assert len(nullable) >= 5 and [row[:3] for row in nullable if row[2].count("null") > 1] == []


def bad_values(schema: dict) -> list[tuple[str, object]]:
    """(what, value) a property ``schema`` refuses: a wrong type, below and above its bounds, NaN."""
    kinds = schema.get("type", [])
    kinds = set(kinds if isinstance(kinds, list) else [kinds])
    arms = schema.get("anyOf", [])
    kinds |= {k for arm in arms for k in ([arm["type"]] if isinstance(arm.get("type"), str) else arm.get("type", []))}
    numeric = bool(kinds & {"integer", "number"})
    out: list[tuple[str, object]] = []
    if "enum" in schema or "string" in kinds:
        out.append(("wrong type", 7 if "string" in kinds or all(isinstance(v, str) for v in schema.get("enum", [])
                                                                if v is not None) else "seven"))
    elif "boolean" in kinds:
        out.append(("wrong type", 3))
    else:
        out.append(("wrong type", "seven" if not any(isinstance(v, str) for arm in arms for v in arm.get("enum", []))
                    else [[1]]))
    if numeric:
        low = schema.get("minimum", schema.get("exclusiveMinimum"))
        if low is not None:
            out.append(("below", low - 1))
        out.append(("huge", 10**12 if "number" not in kinds else 1e300))
        out.append(("NaN", float("nan")))
    if "array" in kinds:
        items = schema.get("items", {})
        if "minimum" in items:
            out.append(("item below", [items["minimum"] - 1] * schema.get("minItems", 1)))
        if "maximum" in items:
            out.append(("item huge", [10**12] * schema.get("minItems", 1)))
        out.append(("item NaN", [float("nan")] * schema.get("minItems", 1)))
    return out


def every_option() -> list[tuple[dict, str, dict]]:
    """(the method section without the option, the option, its property schema) of every method's options and
    every cache's."""
    cases = []
    for name, cls in method_docs.method_options_classes().items():
        section = {"name": name}
        chosen = method_docs.chosen(cls)
        if chosen is not None:
            key, classes = chosen
            for value, cache_cls in classes.items():
                for option in option_names(cache_cls):
                    cases.append(({**section, key: value}, option, options_schema(cache_cls)["properties"][option]))
            section = {**section, key: next(iter(classes))}
        for option in option_names(cls):
            if "chosen" not in cls.__dataclass_fields__[option].metadata:
                cases.append((section, option, options_schema(cls)["properties"][option]))
    return cases


def test_every_numeric_option_is_bounded_and_documented():
    cases = every_option()
    assert len(cases) > 80
    for section, option, schema in cases:
        assert schema["description"], (section, option)
        kinds = json.dumps(schema)
        if '"integer"' in kinds or '"number"' in kinds:
            assert "maximum" in kinds, f"{section['name']}: method.{option} has no maximum (a huge value must be refused)"


@pytest.mark.parametrize("section, option, schema", every_option(),
                         ids=lambda v: v if isinstance(v, str) else (v.get("cache") or v["name"]) if "name" in v else "")
def test_every_bad_option_is_one_line_naming_it(section, option, schema, tmp_path, capsys):
    out = tmp_path / "run"
    for what, value in bad_values(schema):
        given = {**section, option: value}
        text = json.dumps(given).replace("NaN", ".nan")  # YAML's NaN
        code = cli.main(["run", "--set", f"method={text}", "--out", str(out)])
        err = capsys.readouterr().err.strip().splitlines()
        assert code == 2 and len(err) == 1, (what, given, err)
        assert f"method.{option}" in err[0] and "config error" in err[0], (what, given, err[0])
        assert not out.exists(), (what, given)


def test_an_integer_option_given_nan_is_refused_as_not_an_integer():
    """NaN where an option takes an integer (or null and an integer) says so, as a run key's does (seed = nan:
    expected an integer); it said "a finite number", which an integer option given 2.5 is too."""
    def kinds(schema: dict) -> set:
        arms = [schema, *schema.get("anyOf", [])]
        return {k for arm in arms for k in ([arm["type"]] if isinstance(arm.get("type"), str) else arm.get("type", []))}

    integer_options = [(section, option) for section, option, schema in every_option()
                       if "integer" in kinds(schema) and kinds(schema) <= {"integer", "null"}]
    assert len(integer_options) > 20
    for section, option in integer_options:
        for value in (".nan", ".inf"):
            with pytest.raises(ConfigError) as err:
                check_config(load_config(None, [f"method={json.dumps(section)}", f"method.{option}={value}"]))
            assert err.value.key == f"method.{option}" and "an integer" in err.value.expected, str(err.value)
            assert "finite" not in err.value.expected, str(err.value)


def test_the_method_schema_agrees_with_the_refusals():
    schema = method_docs.method_schema()
    jsonschema.Draft202012Validator.check_schema(schema)
    validator = jsonschema.Draft202012Validator(schema)
    sections = [yaml.safe_load(p.read_text())["method"] for p in sorted((ROOT / "config" / "presets").glob("*.yaml"))]
    sections += [m["method"] for m in yaml.safe_load((ROOT / "config" / "config.yaml").read_text())["methods"].values()]
    assert len(sections) > 20
    for section in sections:
        assert not list(validator.iter_errors(section)), section
        check_config(load_config(None, [f"method={json.dumps(section)}"]))  # and the refusals accept it
    for bad in ({"name": "agg", "window": 0}, {"name": "agg", "windows": 5}, {"name": "full", "micro_batch": 0},
                {"name": "cached", "cache": "fora", "threshold": 0.5}, {"name": "cached", "cache": "fora",
                                                                        "interval": 0}, {"name": "guess", "blend": 2}):
        assert list(validator.iter_errors(bad)), bad
        with pytest.raises(ConfigError):
            check_config(load_config(None, [f"method={json.dumps(bad)}"]))
    assert method_docs.main(["--schema"]) == 0


EXTERNAL = '''
from dataclasses import dataclass

from agg_bench.config.options import option
from baselines.full import FullConfig, FullEstimator


@dataclass
class ScaledOptions(FullConfig):
    """Options of a method that lives outside the repository."""

    scale: float = option(1.0, "multiplies nothing; a bounded option of the user's own", minimum=0, maximum=10)


class ScaledEstimator(FullEstimator):
    name = "scaled_full"
    config_cls = ScaledOptions


NOT_AN_ESTIMATOR = 3
'''


@pytest.fixture
def external_package(tmp_path, monkeypatch):
    """A package outside the repository, ``extmethods.scaled``, on sys.path for this test only."""
    package = tmp_path / "outside" / "extmethods"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "scaled.py").write_text(textwrap.dedent(EXTERNAL))
    monkeypatch.syspath_prepend(str(tmp_path / "outside"))
    yield "extmethods.scaled"
    for name in [m for m in sys.modules if m == "extmethods" or m.startswith("extmethods.")]:
        del sys.modules[name]


def test_a_method_outside_the_repository_is_named_by_a_dotted_path(external_package, tmp_path, capsys):
    from agg_bench.io import read_jsonl
    from agg_bench.runtime.train import train

    path = f"{external_package}:ScaledEstimator"
    method = {"name": path, "scale": 2}
    cfg = check_config(load_config(None, [f"method={json.dumps(method)}", "model.resolution=32",
                                          "train.iterations=1", "progress=false", "telemetry.enabled=false"]))
    assert type(cfg.method.options).__name__ == "ScaledOptions" and cfg.method.options.scale == 2.0
    train(cfg, tmp_path / "run")
    [record] = list(read_jsonl(tmp_path / "run" / "metrics.jsonl"))
    assert record["status"] == "ok" and record["backward"] > 0
    assert json.loads((tmp_path / "run" / "config.json").read_text())["method"] == method
    capsys.readouterr()  # what the run printed
    # its options are refused as a registered method's are
    for bad, words in ((11, "method.scale = 11: expected a number >= 0 and <= 10"), ("x", "method.scale = 'x'")):
        assert cli.main(["run", "--set", f"method={json.dumps({'name': path, 'scale': bad})}",
                         "--out", str(tmp_path / "bad")]) == 2
        [line] = capsys.readouterr().err.strip().splitlines()
        assert words in line
    # a path that names no module, or no Estimator, is one line naming method.name
    for name, words in (("extmethods.nowhere:X", "no module 'extmethods.nowhere'"),
                        (f"{external_package}:NOT_AN_ESTIMATOR", "has no Estimator subclass 'NOT_AN_ESTIMATOR'"),
                        ("extmethods.scaled:", "a registered method"), ("not a path:X", "a registered method")):
        assert cli.main(["run", "--set", f"method={json.dumps({'name': name})}", "--out", str(tmp_path / "bad")]) == 2
        [line] = capsys.readouterr().err.strip().splitlines()
        assert line.startswith("agg-bench run: config error: method.name = ") and words in line, line
    assert not (tmp_path / "bad").exists()
