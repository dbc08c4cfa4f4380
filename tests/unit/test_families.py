"""Model families: every registered family's spec is complete and builds a working tiny policy, the config's
allowed families are the registered ones, and no module outside ``agg_bench/engine/families/`` branches
on a family's name (a fourth family is one spec file and its registry line)."""
import ast
import typing
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from agg_bench.config.pretrain_keys import PretrainConfig
from agg_bench.config.sections import ModelConfig
from agg_bench.engine.families import architecture
from agg_bench.engine.families import FAMILY_SPECS, family_spec
from agg_bench.engine.families.catalog import SD3
from agg_bench.engine.models import Conditioning, build_tiny_transformer, load_policy, text_dims
from agg_bench.engine.prompts import hash_embed
from agg_bench.engine.rollout import rollout
from agg_bench.engine.sampler import flow_sigmas
from agg_bench.errors import ConfigError
from helpers import seeded

ROOT = Path(__file__).resolve().parents[2]
FAMILIES_DIR = ROOT / "agg_bench" / "engine" / "families"
# The run config's and the pretrain config's allowed values: the config sits below the engine and cannot read the
# registry.
CONFIG_VALIDATION = {ROOT / "agg_bench" / "config" / "sections.py", ROOT / "agg_bench" / "config" / "pretrain_keys.py"}


@pytest.mark.parametrize("name", sorted(FAMILY_SPECS))
def test_every_registered_spec_is_complete(name):
    spec = FAMILY_SPECS[name]
    assert spec.name == name and spec.problems() == []
    transformer_cls, vae_cls = spec.transformer_cls(), spec.vae_cls()
    assert spec.pipeline_cls().__name__ == spec.pipeline_class
    assert transformer_cls.__name__ == spec.transformer_class and vae_cls.__name__ == spec.vae_class
    transformer = build_tiny_transformer(name)
    assert all(isinstance(getattr(transformer, blocks), torch.nn.ModuleList) for blocks in spec.cache_block_lists)
    modules = [n for n, _ in transformer.named_modules()]
    assert [t for t in spec.lora_targets if not any(n.endswith("." + t) for n in modules)] == []
    assert architecture(name).name == spec.default_architecture


def test_the_config_allows_exactly_the_registered_families():
    allowed = typing.get_args(typing.get_type_hints(ModelConfig)["family"])
    assert list(allowed) == list(FAMILY_SPECS)
    with pytest.raises(ConfigError, match="model.family"):
        family_spec("sd4")


def test_the_pretrain_config_allows_exactly_the_families_with_a_pixel_model():
    allowed = typing.get_args(typing.get_type_hints(PretrainConfig)["family"])
    assert list(allowed) == [name for name, spec in FAMILY_SPECS.items() if spec.pixel_transformer is not None]


def family_names_used(tree: ast.AST, names: set[str]) -> list[str]:
    """Where ``tree`` compares a value with a family's name (``== "flux"``, ``in ("sd3", ...)``) or keeps a
    table with more than one family's name as keys or items (per-family knowledge outside the specs)."""
    def literals(node):
        if isinstance(node, ast.Constant) and node.value in names:
            return [node.value]
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            return [e.value for e in node.elts if isinstance(e, ast.Constant) and e.value in names]
        return []

    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            hits = [h for side in [node.left, *node.comparators] for h in literals(side)]
            if hits:
                found.append(f"line {node.lineno}: compares with {hits}")
        elif isinstance(node, ast.Dict):
            keys = [k.value for k in node.keys if isinstance(k, ast.Constant) and k.value in names]
            if len(keys) > 1:
                found.append(f"line {node.lineno}: a table keyed by {keys}")
        elif isinstance(node, (ast.Tuple, ast.List, ast.Set)) and len(literals(node)) > 1:
            found.append(f"line {node.lineno}: a list of {literals(node)}")
    return found


def test_no_module_outside_the_families_branches_on_a_family_name():
    names = set(FAMILY_SPECS)
    sources = [p for folder in ("agg_bench", "baselines") for p in sorted((ROOT / folder).rglob("*.py"))
               if FAMILIES_DIR not in p.parents and p not in CONFIG_VALIDATION]
    assert len(sources) > 50
    found = {str(p.relative_to(ROOT)): hits for p in sources
             if (hits := family_names_used(ast.parse(p.read_text()), names))}
    assert found == {}


def test_the_check_sees_a_branch_on_a_family_name():
    names = set(FAMILY_SPECS)
    for source in ('if family == "qwenimage": pass', 'x = 1 if cfg.family in ("sd3", "flux") else 2',
                   'TABLE = {"sd3": 1, "flux": 2}', 'FAMILIES = ("sd3", "flux", "qwenimage")'):
        assert family_names_used(ast.parse(source), names), source
    assert family_names_used(ast.parse('family = "sd3"\nRATIOS = {"flux": [1.0]}'), names) == []


def test_a_fourth_family_registered_as_one_spec_builds_and_rolls_out(monkeypatch):
    """A family the code has never heard of, given only as a spec (here SD3's model under another name
    and a latent grid of its own), builds its tiny policy and takes a rollout step."""
    fourth = replace(SD3, name="sd3-clone", title="SD3 clone", latent_grid=lambda transformer: (4, None),
                     architectures=(replace(SD3.architectures[0], name="sd3-clone-medium", family="sd3-clone"),),
                     default_architecture="sd3-clone-medium")
    assert fourth.problems() == []
    monkeypatch.setitem(FAMILY_SPECS, fourth.name, fourth)
    policy = load_policy(fourth.name, "tiny", None, "float64")
    assert type(policy).__name__ == "SD3clonePolicy" and policy.family == "sd3-clone"
    assert policy.latent_shape(64) == (4, 8, 8)
    with pytest.raises(ConfigError, match="multiple of 32 pixels for sd3-clone"):
        policy.latent_shape(48)
    dim, pooled = text_dims(policy.transformer)
    cond = hash_embed(["a red circle", "two blue squares"], dim, pooled, 4, 0).to(dtype=torch.float64)
    assert isinstance(cond, Conditioning)
    sigmas = flow_sigmas(2, 3.0).double()
    noise = torch.randn(2, 4, 8, 8, generator=torch.Generator().manual_seed(seeded(1)), dtype=torch.float64)
    traj = rollout(policy, cond, noise, sigmas, "flow_grpo", 0.7, torch.Generator().manual_seed(seeded(0)))
    assert traj.latents.shape == (2, 3, 4, 8, 8) and torch.isfinite(traj.latents).all()
    assert policy.counter.forward_nograd == 2 * 2
    # the same model as SD3's tiny preset, called the same way: the same velocities
    sd3 = load_policy("sd3", "tiny", None, "float64")
    with torch.no_grad():
        assert torch.equal(policy.velocity(noise, traj.timesteps[:1].expand(2), cond),
                           sd3.velocity(noise, traj.timesteps[:1].expand(2), cond))
