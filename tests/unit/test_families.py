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
from helpers import seeded, tiny_config

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


# ----- the guidance value a guidance-distilled transformer embeds (model.guidance) ---------------------------

GUIDED = {  # every kind of call: rollout, training, the KL reference (full); an old policy's forwards (nft)
    "full": ["grpo.beta=0.04"],
    "nft": ["method.name=nft", "sampling.same_noise_per_group=false", "method.old_decay_rate=0.001"],
}


@pytest.mark.parametrize("case", sorted(GUIDED))
def test_the_guidance_value_reaches_every_call_of_a_guided_flux(monkeypatch, case):
    """The tiny FLUX given a guidance embedding (FLUX.1-dev's guidance_embeds): every transformer call of a run's
    iterations (its rollout, the training forwards, a reference or old policy's forwards) and of its evaluation
    gets model.guidance, exactly, one value per row; the embedding takes it (another value, other velocities)."""
    from diffusers import FluxTransformer2DModel

    from agg_bench.runtime.evaluation import Evaluation
    from agg_bench.runtime.session import Session

    monkeypatch.setitem(FAMILY_SPECS["flux"].tiny_transformer, "guidance_embeds", True)
    seen: list[tuple[torch.Tensor | None, int]] = []
    forward = FluxTransformer2DModel.forward

    def recording(self, *args, **kwargs):
        seen.append((kwargs["guidance"], kwargs["hidden_states"].shape[0]))
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(FluxTransformer2DModel, "forward", recording)
    session = Session(tiny_config(*GUIDED[case], "model.guidance=3.5", "eval.noises=1", family="flux"))
    policy = session.policy
    for iteration in range(2):  # nft's old policy differs from the policy from the 2nd iteration on
        session.update(session.collect(iteration).batch)
    counter = policy.counter
    assert counter.forward_grad_calls > 0 and len(seen) == counter.forward_nograd_calls + counter.forward_grad_calls
    evaluation = Evaluation.of_session(session)
    evaluation.evaluate()
    assert evaluation.policy.counter.forward_nograd_calls > 0
    assert len(seen) == (counter.forward_nograd_calls + counter.forward_grad_calls
                         + evaluation.policy.counter.forward_nograd_calls)
    for value, rows in seen:
        assert value is not None and torch.equal(value, torch.full((rows,), 3.5, dtype=torch.float64))
    latents = torch.randn(2, *session.latent_shape, generator=torch.Generator().manual_seed(seeded(0)),
                          dtype=torch.float64)
    timesteps, cond = torch.full((2,), 0.5, dtype=torch.float64), session.cond_all[[0, 1]]
    with torch.no_grad():
        guided = policy.velocity(latents, timesteps, cond)
        policy.guidance = 1.0
        assert not torch.equal(policy.velocity(latents, timesteps, cond), guided)


def test_a_reused_model_and_a_snapshot_keep_the_guidance_value(monkeypatch, tmp_path):
    """The policy a cell's later run gets back from the kept model, and the one a snapshot's replay loads, embed the
    run's model.guidance, not the default."""
    from agg_bench.runtime.model_reuse import policy_for, reusing_models
    from agg_bench.tools.snapshot import load_snapshot, save_snapshot

    monkeypatch.setitem(FAMILY_SPECS["flux"].tiny_transformer, "guidance_embeds", True)
    cfg = tiny_config("model.guidance=3.5", "train.iterations=1", family="flux")
    with reusing_models() as reuse:
        assert policy_for(cfg, torch.device("cpu")).guidance == 3.5
        assert policy_for(cfg, torch.device("cpu")).guidance == 3.5 and reuse.builds == 1
    save_snapshot(cfg, tmp_path / "snapshot")
    assert load_snapshot(tmp_path / "snapshot").policy.guidance == 3.5


def test_a_guidance_value_is_refused_for_a_transformer_without_its_embedding(tmp_path):
    """model.guidance other than its default names the key before anything is built where the configs say that
    the transformer embeds none (SD3, Qwen-Image, the tiny FLUX, a folder's config without guidance_embeds), and
    where a built transformer says so; FLUX.1-dev's architecture takes it. The default passes everywhere."""
    from agg_bench.config import load_config
    from agg_bench.runtime.config_check import check_config

    def checked(*sets: str):
        return check_config(load_config(None, ["model.resolution=32", *sets]))

    for family in FAMILY_SPECS:
        checked(f"model.family={family}")
        with pytest.raises(ConfigError, match=rf"^config error: model.guidance = 3.5: expected 1.0, the default: this "
                                              rf"{family} model's transformer embeds no guidance value"):
            checked(f"model.family={family}", "model.guidance=3.5")
    assert checked("model.family=flux", "model.preset=random", "model.guidance=3.5").model.guidance == 3.5
    folder = tmp_path / "model"
    (folder / "transformer").mkdir(parents=True)
    (folder / "transformer" / "config.json").write_text('{"_class_name": "FluxTransformer2DModel"}')
    with pytest.raises(ConfigError, match="model.guidance = 2"):
        checked("model.family=flux", "model.preset=pretrained", f"model.pretrained={folder}", "model.guidance=2")
    with pytest.raises(ConfigError, match="model.guidance = 2"):
        load_policy("flux", "tiny", None, guidance=2)
    assert load_policy("flux", "tiny", None).guidance == 1.0
