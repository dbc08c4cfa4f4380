"""Full-size public architectures with random weights (``model.preset: random``): parameter counts on the
meta device, seeded materialisation, the random preset end to end on shrunk copies, bad input.
Runtime: about 10 s on 2 cores (nothing full-size is materialised)."""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
from diffusers.models.embeddings import PatchEmbed
from diffusers.models.transformers.transformer_qwenimage import QwenEmbedRope

from agg_bench.cli import main
from agg_bench.config import load_config
from agg_bench.engine import architectures as A
from agg_bench.engine import families as F
from agg_bench.engine.models import POLICIES, TRANSFORMER_CLASSES, VAE_CLASSES, Conditioning, load_policy
from agg_bench.engine.text import hash_tokens
from agg_bench.errors import ConfigError
from agg_bench.engine.families import model_label
from agg_bench.runtime.train import weights_label
from helpers import methods_checked_here, seeded

ROOT = Path(__file__).resolve().parents[2]

# The public sizes of the transformers, in billions (SD3.5-Medium's 2.5 B includes its stored
# position table, a buffer in diffusers; the others are the parameters alone).
PUBLIC_BILLIONS = {"sd3.5-medium": 2.5, "sd3.5-large": 8.1, "flux.1-dev": 11.9, "qwen-image": 20.4}


@pytest.mark.parametrize("name", list(PUBLIC_BILLIONS))
def test_parameter_counts_on_the_meta_device(name):
    arch = F.ARCHITECTURES[name]
    transformer = A.build_on_meta(TRANSFORMER_CLASSES[arch.family], arch.transformer)
    assert all(p.is_meta for p in transformer.parameters())
    params = A.parameter_count(transformer)
    stored = params + sum(b.numel() for b in transformer.buffers())
    assert round(stored / 1e8) / 10 == PUBLIC_BILLIONS[name]
    if name != "sd3.5-medium":
        assert round(params / 1e8) / 10 == PUBLIC_BILLIONS[name]
    vae = A.build_on_meta(VAE_CLASSES[arch.family], arch.vae)
    latent = vae.config.z_dim if arch.family == "qwenimage" else vae.config.latent_channels
    assert latent == POLICIES[arch.family].latent_channels_of(transformer) == 16


def test_defaults_and_unknown_architectures():
    assert [F.architecture(f).name for f in ("sd3", "flux", "qwenimage")] == ["sd3.5-medium", "flux.1-dev",
                                                                            "qwen-image"]
    with pytest.raises(ConfigError, match="sd3.5-large"):
        F.architecture("sd3", "sd4")
    with pytest.raises(ConfigError, match="flux.1-dev"):  # another family's architecture
        F.architecture("flux", "qwen-image")


def shrunk(name: str) -> A.Architecture:
    """The architecture with a handful of small layers: same classes and code paths, CPU-sized."""
    arch = F.ARCHITECTURES[name]
    small = dict(num_layers=1, num_attention_heads=2, attention_head_dim=16, joint_attention_dim=16)
    if arch.family == "sd3":
        small.update(caption_projection_dim=32, pooled_projection_dim=16, pos_embed_max_size=16,
                     dual_attention_layers=(0,))
        vae = dict(arch.vae, block_out_channels=(8, 8, 8, 8), norm_num_groups=4, layers_per_block=1)
    else:
        small.update(axes_dims_rope=(4, 6, 6))
        if arch.family == "flux":
            small.update(num_single_layers=1, pooled_projection_dim=16)
            vae = dict(arch.vae, block_out_channels=(8, 8, 8, 8), norm_num_groups=4, layers_per_block=1)
        else:
            vae = dict(arch.vae, base_dim=8, num_res_blocks=1)
    return replace(arch, transformer={**arch.transformer, **small}, vae=vae, text_tokens=5,
                   prefix_tokens=min(arch.prefix_tokens, 2))


@pytest.mark.parametrize("name", ["sd3.5-medium", "qwen-image"])
def test_materialised_weights_are_seeded_and_computed_tables_exact(name):
    arch = shrunk(name)
    cls = TRANSFORMER_CLASSES[arch.family]
    meta = A.build_on_meta(cls, arch.transformer)
    emptied = meta.to_empty(device="cpu")
    with torch.no_grad():
        for t in (*emptied.parameters(), *emptied.buffers()):
            t.fill_(float("nan"))  # whatever was left unfilled would stay NaN
    first = A.init_random_weights(emptied, seed=3)
    second = A.build_random(cls, arch.transformer, "cpu", seed=3)
    other = A.build_random(cls, arch.transformer, "cpu", seed=4)
    for (n, a), (_, b), (_, _c) in zip(first.state_dict().items(), second.state_dict().items(),
                                      other.state_dict().items()):
        assert torch.isfinite(a).all(), n
        assert torch.equal(a, b), n
    assert any(not torch.equal(a, c) for a, c in zip(first.parameters(), other.parameters()))
    # the tables a normal constructor computes are recomputed exactly (same function, same inputs)
    reference = cls(**arch.transformer)
    for mod, ref in zip(first.modules(), reference.modules()):
        if isinstance(mod, PatchEmbed):
            assert torch.equal(mod.pos_embed, ref.pos_embed)
        if isinstance(mod, QwenEmbedRope):
            assert torch.equal(mod.pos_freqs, ref.pos_freqs) and torch.equal(mod.neg_freqs, ref.neg_freqs)


def test_unknown_parameters_are_refused():
    module = torch.nn.Module()
    module.scale = torch.nn.Parameter(torch.empty(3))
    with pytest.raises(RuntimeError, match="no initialisation for .scale"):
        A.init_random_weights(module, 0)


@pytest.mark.parametrize("name", ["sd3.5-medium", "flux.1-dev", "qwen-image"])
def test_random_preset_runs_a_shrunk_architecture(name, monkeypatch):
    arch = shrunk(name)
    monkeypatch.setitem(F.ARCHITECTURES, name, arch)
    cfg = load_config(None, [f"model.family={arch.family}", "model.preset=random", f"model.architecture={name}",
                             "model.resolution=32"])
    assert hash_tokens(cfg) == arch.prefix_tokens + 5
    assert weights_label(cfg) == "random" and model_label(cfg.model) == f"{name}-random"
    policy = load_policy(arch.family, "random", None, architecture=name)
    c, h, w = policy.latent_shape(32)
    dim, pooled = policy.transformer.config.joint_attention_dim, getattr(policy.transformer.config,
                                                                         "pooled_projection_dim", None)
    gen = torch.Generator().manual_seed(seeded(0))
    cond = Conditioning(torch.randn(2, hash_tokens(cfg), dim, generator=gen),
                        None if pooled is None else torch.randn(2, pooled, generator=gen))
    x = torch.randn(2, c, h, w, generator=gen)
    v = policy.velocity(x, torch.full((2,), 0.5 * policy.timestep_scale), cond)
    assert v.shape == x.shape and torch.isfinite(v).all()
    images = policy.decode(x)
    assert images.shape == (2, 3, 32, 32) and torch.isfinite(images).all()
    assert policy.scheduler_config["shift"] == arch.scheduler["shift"]


def test_bad_architecture_settings(tmp_path, capsys):
    out = tmp_path / "run"
    code = main(["run", "--set", "model.preset=random", "--set", "model.architecture=sd4", "--out", str(out)])
    err = capsys.readouterr().err
    assert code == 2 and "model.architecture" in err and "sd3.5-medium" in err and not out.exists()
    with pytest.raises(ConfigError, match="model.architecture"):
        load_config(None, ["model.architecture=flux.1-dev"])  # only with the random preset
    with pytest.raises(ConfigError, match="model.architecture"):
        load_config(None, ["model.preset=random", "model.architecture=7"])
    with pytest.raises(ConfigError, match="model.preset"):
        load_config(None, ["model.preset=huge"])


@pytest.mark.parametrize("name", ["flux.1-dev", "qwen-image"])
def test_full_size_lora_models_are_built_as_a_gpu_run_builds_them_without_memory(name, monkeypatch):
    """config/h200.yaml's FLUX.1-dev and Qwen-Image cells (LoRA rank 64, gradient checkpointing, bf16 autocast
    over float32 weights), whose runs build them only on the GPU: every module of the full-size transformer and
    VAE is initialised from the seed (on fake tensors: shapes, no memory), and the adapters and checkpointing
    go onto the meta-device build, no weight materialised, as the memory planner counts them."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from agg_bench.config import validate
    from agg_bench.engine.models import precision, prepare_training
    from agg_bench.tools.campaign import Campaign

    methods_checked_here(monkeypatch)  # the run's config is what is used here, not the methods' check's child process
    campaign = Campaign(ROOT / "config" / "h200.yaml")
    run_id = next(r for r, run in campaign.sweep.runs.items() if run["method"] == "full"
                  and F.ARCHITECTURES[name].family == campaign.config_of(r)["model"]["family"]
                  and campaign.config_of(r)["model"]["architecture"] == name)
    cfg = validate(campaign.config_of(run_id))
    prec = precision(cfg.model.dtype)
    assert cfg.train.lora_rank == 64 and cfg.train.gradient_checkpointing and prec.autocast_dtype == torch.bfloat16
    arch = F.ARCHITECTURES[name]
    transformer = A.build_on_meta(TRANSFORMER_CLASSES[arch.family], arch.transformer, prec.param_dtype)
    vae = A.build_on_meta(VAE_CLASSES[arch.family], arch.vae)
    with FakeTensorMode(allow_non_fake_inputs=True):
        for module, seed in ((transformer, cfg.seed), (vae, cfg.seed + 1)):
            built = A.materialize(module, "cpu", seed)
            assert not any(t.is_meta for t in (*built.parameters(), *built.buffers()))
    transformer = A.build_on_meta(TRANSFORMER_CLASSES[arch.family], arch.transformer, prec.param_dtype)
    base = A.parameter_count(transformer)
    prepare_training(transformer, arch.family, cfg.train)
    assert transformer.is_gradient_checkpointing and all(p.is_meta for p in transformer.parameters())
    trainable = [p for p in transformer.parameters() if p.requires_grad]
    assert trainable and {p.dtype for p in transformer.parameters()} == {prec.param_dtype}
    # the adapters are all that trains: rank 64 on the family's targets, a small share of the model
    assert sum(p.numel() for p in trainable) == A.parameter_count(transformer) - base < base / 50
