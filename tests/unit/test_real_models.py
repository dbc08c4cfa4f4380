"""Real models from local folders: tiny SD3 / FLUX / Qwen-Image pipelines saved with ``save_pretrained`` and
loaded by the code path users run; precision and gradient checkpointing."""
import json
import shutil
from pathlib import Path

import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler
from helpers import fresh_seed, one_graph_gradient, relative_error, seeded, tiny_config

from agg_bench.cli import main
from agg_bench.config import load_config
from agg_bench.engine.grpo import UpdateStats
from agg_bench.engine.models import build_policy, load_policy, unpack_latents
from agg_bench.engine.rollout import rollout
from agg_bench.engine.sampler import flow_sigmas
from agg_bench.engine.text import encode_prompts, prompt_set
from agg_bench.errors import ConfigError
from agg_bench.io import read_jsonl
from agg_bench.runtime.train import Session

FAMILIES = ["sd3", "flux", "qwenimage"]
RUN = ["--set", "model.resolution=32", "--set", "sampling.steps=3", "--set", "grpo.group_size=2",
       "--set", "grpo.prompts_per_iteration=1", "--set", "train.iterations=2", "--set", "progress=false",
       "--set", "telemetry.enabled=false", "--set", "prompts.max_sequence_length=8"]


def run_records(out: Path) -> list[dict]:
    return list(read_jsonl(out / "metrics.jsonl"))


@pytest.mark.parametrize("family", FAMILIES)
def test_agg_and_full_run_two_iterations_from_a_local_folder(family, folders, tmp_path):
    folder = folders(family)
    common = [*RUN, "--set", f"model.family={family}", "--set", f"model.pretrained={folder}",
              "--set", f"prompts.cache_dir={tmp_path / 'emb'}"]
    counts = {}
    for method, extra in (("full", []), ("agg", ["--set", "method.window=3"])):
        out = tmp_path / method
        assert main(["run", *common, "--set", f"method.name={method}", *extra, "--out", str(out)]) == 0
        recs = run_records(out)
        assert [r["iteration"] for r in recs] == [0, 1]
        assert all(r["status"] == "ok" and r["model"] == f"{family}:tiny-{family}" for r in recs)
        counts[method] = recs[0]
    # B = 2 samples x 3 trained steps; AGG with W = 3 pays 2 backward passes for the group of 3 steps
    assert counts["full"]["backward"] == 6
    assert counts["agg"]["backward"] == 4


@pytest.mark.parametrize("family", FAMILIES)
def test_ode_rollout_and_decode_match_the_diffusers_pipeline(family, folders):
    """The policy's calling convention (timestep scale, packing, img_shapes, text mask) and its VAE decoding
    (scaling/shift, Qwen-Image's per-channel normalization) against the family's own pipeline."""
    folder = folders(family)
    policy = load_policy(family, "tiny", str(folder))
    prompts = ["a red cat on the moon", "two dogs"]
    cond = encode_prompts(family, folder, prompts, max_sequence_length=8 if family != "qwenimage" else None)
    steps = 3
    sigmas = flow_sigmas(steps, 3.0)
    c, h, w = policy.latent_shape(32)
    noise = torch.randn(2, c, h, w, generator=torch.Generator().manual_seed(seeded(5)))
    ode = torch.zeros(steps, dtype=torch.bool)  # deterministic Euler steps, as the pipeline takes
    traj = rollout(policy, cond, noise, sigmas, "flow_grpo", 0.7, torch.Generator(), ode)

    from diffusers import DiffusionPipeline

    pipe = DiffusionPipeline.from_pretrained(str(folder), local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    # shift 1: the pipeline then uses the given (already shifted) sigmas as they are
    pipe.scheduler = FlowMatchEulerDiscreteScheduler.from_config(pipe.scheduler.config, shift=1.0)
    kwargs = dict(num_inference_steps=steps, sigmas=sigmas[:-1].float().tolist(), height=32, width=32,
                  prompt_embeds=cond.encoder_hidden_states)
    if family == "sd3":
        kwargs.update(latents=noise, pooled_prompt_embeds=cond.pooled_projections, guidance_scale=1.0)
    elif family == "flux":
        kwargs.update(latents=noise.view(2, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5).reshape(2, -1, 4 * c),
                      pooled_prompt_embeds=cond.pooled_projections)
    else:
        kwargs.update(latents=noise.view(2, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5).reshape(2, -1, 4 * c),
                      prompt_embeds_mask=cond.encoder_attention_mask, true_cfg_scale=1.0)
    with torch.no_grad():
        final = pipe(**kwargs, output_type="latent").images
        images = pipe(**kwargs, output_type="pt").images
    if family != "sd3":
        final = unpack_latents(final, c, h, w)
    torch.testing.assert_close(traj.latents[:, -1], final.float(), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(policy.decode(traj.latents[:, -1]), images.float(), rtol=1e-4, atol=1e-5)


def test_scheduler_config_gives_the_shift_when_sampling_shift_is_null(folders, tmp_path):
    folder = folders("flux")
    config = json.loads((folder / "scheduler/scheduler_config.json").read_text())
    assert config["shift"] == 3.0 and not config["use_dynamic_shifting"]
    session = Session(load_config(None, ["sampling.shift=null", "model.family=flux", f"model.pretrained={folder}",
                                         "model.resolution=32", "sampling.steps=4",
                                         f"prompts.cache_dir={tmp_path}", "prompts.max_sequence_length=8"]))
    assert torch.equal(session.sigmas, flow_sigmas(4, 3.0))
    # dynamic shifting (FLUX-dev / Qwen-Image): exp(mu), mu linear in the image token count
    session.policy.scheduler_config.update(use_dynamic_shifting=True, base_image_seq_len=4, max_image_seq_len=36,
                                           base_shift=0.5, max_shift=1.3)
    assert session.policy.schedule_shift((4, 4, 4)) == pytest.approx(2.718281828459045 ** 0.5)
    assert session.policy.schedule_shift((4, 12, 12)) == pytest.approx(2.718281828459045 ** 1.3)


def test_scheduler_shift_terminal_stretches_the_model_schedule(folders, tmp_path):
    folder = tmp_path / "flux"
    shutil.copytree(folders("flux"), folder)
    path = folder / "scheduler/scheduler_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "shift_terminal": 0.1}))
    args = ["model.family=flux", f"model.pretrained={folder}", "model.resolution=32", "sampling.steps=4",
            f"prompts.cache_dir={tmp_path / 'emb'}", "prompts.max_sequence_length=8"]
    sigmas = Session(load_config(None, ["sampling.shift=null", *args])).sigmas
    # float64 reference: the shift-3 schedule with 1 - sigma scaled so that the last nonzero sigma is 0.1
    shifted = flow_sigmas(4, 3.0)[:-1]
    stretched = 1 - (1 - shifted) * (1 - 0.1) / (1 - shifted[-1])
    torch.testing.assert_close(sigmas[:-1], stretched, rtol=1e-6, atol=1e-7)
    assert sigmas[-1] == 0 and sigmas[-2].item() == pytest.approx(0.1, abs=1e-7)
    # an explicit shift replaces the model's schedule, terminal stretch included
    assert torch.equal(Session(load_config(None, ["sampling.shift=3", *args])).sigmas, flow_sigmas(4, 3.0))


def test_missing_folder_or_subfolder_is_a_config_error_naming_it(folders, tmp_path):
    base = ["model.resolution=32", "model.family=sd3", f"prompts.cache_dir={tmp_path / 'emb'}"]
    with pytest.raises(ConfigError) as err:
        Session(load_config(None, [*base, f"model.pretrained={tmp_path / 'nowhere'}"]))
    assert err.value.key == "model.pretrained" and "nowhere" in str(err.value)
    for missing in ("vae", "transformer", "text_encoder_3"):
        broken = tmp_path / f"no-{missing}"
        shutil.copytree(folders("sd3"), broken)
        shutil.rmtree(broken / missing)
        with pytest.raises(ConfigError) as err:
            Session(load_config(None, [*base, f"model.pretrained={broken}"]))
        assert err.value.key == "model.pretrained" and missing in err.value.expected, str(err.value)
    with pytest.raises(ConfigError) as err:  # an SD3 folder used as FLUX
        Session(load_config(None, [*base, "model.family=flux", f"model.pretrained={folders('sd3')}"]))
    assert err.value.key == "model.family" and "SD3Transformer2DModel" in err.value.expected


@pytest.mark.parametrize("name, content, problem", [
    ("transformer/config.json", b"[1, 2]", "holds a list, not a JSON object"),
    ("transformer/config.json", b"not json", "is not JSON (Expecting value at line 1 column 1)"),
    ("transformer/config.json", b"\xff\xfe{}", "is not UTF-8 text"),
    ("vae/config.json", b'"AutoencoderKL"', "holds a string, not a JSON object"),
    ("vae/config.json", b"{", "is not JSON"),
    ("scheduler/scheduler_config.json", b"[1]", "holds a list, not a JSON object"),
    ("model_index.json", b"[1]", "holds a list, not a JSON object"),
    ("model_index.json", b"{}", "names the pipeline's _class_name"),
    ("model_index.json", b'{"_class_name": "StableDiffusion3Pipeline", "text_encoder": 7}',
     "names the text_encoder as [library, class] (found 7)"),
])
def test_a_model_folder_json_that_is_not_a_json_object_is_a_config_error_naming_it(folders, tmp_path, capsys, name,
                                                                                    content, problem):
    broken = tmp_path / "broken"
    shutil.copytree(folders("sd3"), broken)
    (broken / name).write_bytes(content)
    base = ["model.resolution=32", "model.family=sd3", f"prompts.cache_dir={tmp_path / 'emb'}",
            f"model.pretrained={broken}"]
    with pytest.raises(ConfigError) as err:
        Session(load_config(None, base))
    assert err.value.key == "model.pretrained" and name in str(err.value) and problem in str(err.value), str(err.value)
    # the command line: one line, exit code 2, nothing written
    out = tmp_path / "out"
    capsys.readouterr()
    assert main(["run", *[a for o in base for a in ("--set", o)], "--set", "train.iterations=1", "--set", "progress=false",
                 "--out", str(out)]) == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and problem in lines[0] and not out.exists(), lines


def test_bfloat16_keeps_float32_master_weights_and_autocasts_the_forward():
    cfg32, cfg16 = tiny_config(dtype="float32"), tiny_config(dtype="bfloat16")
    p32, p16 = build_policy(cfg32), build_policy(cfg16)
    assert {p.dtype for p in p16.parameters()} == {torch.float32}
    seen = []
    p16.transformer.proj_out.register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    gen = torch.Generator().manual_seed(fresh_seed())
    x = torch.randn(2, 4, 4, 4, generator=gen)
    t = torch.full((2,), 700.0)
    session = Session(cfg32)
    cond = session.cond_all[torch.tensor([0, 1])]
    v16 = p16.velocity(x, t, cond)
    assert seen == [torch.bfloat16] and v16.dtype == torch.float32
    v32 = p32.velocity(x, t, cond)
    # bf16 keeps 8 mantissa bits: a relative error of a few 1e-3 per op, a few 1e-2 through the tiny DiT
    assert float((v16 - v32).detach().norm() / v32.detach().norm()) < 5e-2
    v16.square().mean().backward()
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in p16.parameters())


def test_gradient_checkpointing_gives_the_same_gradient_and_counts():
    grads, counts = [], []
    for checkpointing in (False, True):
        flag = f"train.gradient_checkpointing={str(checkpointing).lower()}"
        session = Session(tiny_config("train.timestep_fraction=0.5", flag))
        assert session.policy.transformer.is_gradient_checkpointing is checkpointing
        batch = session.collect(0).batch
        session.policy.counter.reset()
        session.estimator.accumulate(session.policy, batch, UpdateStats(batch.clip_range))
        grads.append({n: p.grad for n, p in session.policy.named_parameters()})
        counts.append(session.policy.counter.as_dict())
        if checkpointing:
            reference = one_graph_gradient(session.policy, batch)
            assert relative_error(grads[-1], reference) <= 1e-10
    # checkpointing recomputes the same forward on the same shapes; float64, so 1e-12 bounds any reordering
    assert relative_error(grads[1], grads[0]) <= 1e-12
    assert counts[0] == counts[1]


@pytest.mark.parametrize("cache_in, refused", [("train", True), ("both", True), ("rollout", False)])
def test_gradient_checkpointing_with_a_training_cache_is_refused(cache_in, refused):
    cfg = tiny_config("train.gradient_checkpointing=true", "method.name=cached", "method.cache=fora",
                      f"method.cache_in={cache_in}")
    if refused:
        with pytest.raises(ConfigError) as err:
            Session(cfg)
        assert err.value.key == "train.gradient_checkpointing" and "cache_in" in err.value.expected
    else:
        assert Session(cfg).policy.transformer.is_gradient_checkpointing


def test_shipped_prompt_sets_load():
    root = Path(__file__).resolve().parents[2] / "config" / "prompts"
    txt, jsonl = prompt_set(root / "objects.txt"), prompt_set(root / "compositional.jsonl")
    assert len(txt.prompts) == 16 and len(jsonl.prompts) == 8
    assert all(isinstance(p, str) and p for p in txt.prompts + jsonl.prompts)
    assert jsonl.prompts[5] == 'a sign that reads "OPEN" above a bakery door'
