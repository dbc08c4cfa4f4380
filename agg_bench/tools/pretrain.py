"""``agg-bench pretrain``: a small DiT taught the drawn scenes by rectified-flow matching, saved as a model
folder that ``model.preset: pretrained`` loads.

The model denoises pixels (:class:`~agg_bench.engine.pixel_decoder.PixelDecoder`, no VAE to train) and is
conditioned on the captions' token-hash embedding (:func:`agg_bench.engine.prompts.hash_embed`, learned through
the transformer's own context and pooled projections). Training: x_s = (1 - s) x_data + s noise, target
velocity noise - x_data (the sampler's convention, :mod:`agg_bench.engine.sampler`), s drawn uniformly and shifted as
the sampling schedule is (``shift``); AdamW; the saved weights are an exponential moving average.

The output folder: ``transformer/`` (diffusers ``save_pretrained``), ``vae/`` (the pixel decoder's
config), ``scheduler/`` (FlowMatchEulerDiscreteScheduler with ``shift``), ``token_hash.json``,
``samples.png`` (a grid of samples with their captions and scene rewards) and ``pretrain.json`` (the
config, the loss curve, the duration and the samples' rewards). It is written to a temporary folder and
renamed into place; an existing folder is replaced only if it holds a ``pretrain.json`` of this command's format
(``agg-bench-pretrain/1``) and nothing but these files, its model folders included (a file of someone else's
inside ``transformer/`` refuses it).
"""
from __future__ import annotations

import copy
import functools
import json
import math
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch
from diffusers.schedulers.scheduling_flow_match_euler_discrete import FlowMatchEulerDiscreteScheduler

from ..config import bound
from ..config.pretrain_keys import PretrainConfig, read_pretrain_config
from ..engine.families import FAMILY_SPECS
from ..engine.models import Conditioning, Policy, policy_class
from ..engine.pixel_decoder import PixelDecoder
from ..engine.prompts import TOKEN_HASH_FILE, hash_embed
from ..engine.scenes import all_scenes, draw_batch, sample_scenes
from ..engine.sampler import check_sigmas, flow_sigmas, ode_step
from ..errors import ConfigError, UserError, counted, quote, shown
from ..io import atomic_target, remove_stale_temps, save_figure, write_json, write_text
from ..jsonfiles import JsonFileError, read_json_object
from ..outdir import Claim, check_folder, is_harness_name
from ..outputs import PRETRAIN_CONTENTS, PRETRAIN_MARKER
from ..results.plotting import pyplot
from ..machine.devices import resolve_device
from ..threads import usable_cores

MARKER = PRETRAIN_MARKER  # what the pretraining did (agg_bench.outputs)
FORMAT = "agg-bench-pretrain/1"  # its format: the mark of a folder this command may replace
# A pixel-space scene model taught on a CPU: the recipe's has 0.6 M parameters, and a step of 100 M (at the
# sweep's batch of 32) takes seconds on a CPU core; its weights, gradients, AdamW's moments and the average are
# STATE_COPIES x 4 bytes per parameter.
MAX_PARAMETERS = 100_000_000
STATE_COPIES = 5


def check_pretrain_config(cfg: PretrainConfig) -> PretrainConfig:
    """What depends on several keys or on the family (each key's type and bounds are its field's: a config of
    :func:`~agg_bench.config.pretrain_keys.read_pretrain_config` holds them), as ConfigErrors naming a key."""
    step, low, high = (4 * cfg.pixel_factor, bound(PretrainConfig, "resolution", "minimum"),
                       bound(PretrainConfig, "resolution"))
    if cfg.resolution % step:
        raise ConfigError("resolution", cfg.resolution, f"a multiple of {step} from {low} to {high}")
    # the samples' schedule, as a run's (a shift that rounds it to nan sampled nan images, reward 0)
    check_sigmas(flow_sigmas(cfg.sample_steps, cfg.shift), cfg.shift, torch.float32, key="shift",
                 allowed=f"a shift in (0, {bound(PretrainConfig, 'shift')}]", steps_key="sample_steps")
    transformer_config(cfg)  # the family's own limits on the sizes
    check_size(cfg)  # and the sizes together
    return cfg


# the keys a model's sizes depend on: the parameters (through transformer_config) and a training step's bytes
SIZE_KEYS = ("family", "pixel_factor", "resolution", "num_layers", "num_attention_heads", "attention_head_dim",
             "text_dim", "batch_size", "max_tokens")


# the last counts on fake tensors this process made, by the keys they depend on: a campaign or a sweep reads its
# pretrain entries at each start, and a count takes about a CPU-second
@functools.lru_cache(maxsize=16)
def _counts(sizes: tuple) -> tuple[int, dict[str, int] | None]:
    """The parameters of the model of the :data:`SIZE_KEYS` values ``sizes`` (built on the meta device) and the
    memory planner's count of its training step, None where the parameters are over :data:`MAX_PARAMETERS`."""
    from ..runtime.memplan import training_bytes

    cfg = PretrainConfig(**dict(zip(SIZE_KEYS, sizes)))
    with torch.device("meta"):
        transformer = FAMILY_SPECS[cfg.family].transformer_cls()(**transformer_config(cfg))
    parameters = sum(p.numel() for p in transformer.parameters())
    if parameters > MAX_PARAMETERS:
        return parameters, None
    return parameters, training_bytes(transformer, cfg.family, PixelDecoder(cfg.pixel_factor), cfg.resolution,
                                      cfg.batch_size, cfg.max_tokens, STATE_COPIES)


def check_size(cfg: PretrainConfig, memory: int | None = None) -> dict[str, int]:
    """The model's sizes together, counted before anything is allocated (a shape-only model on the meta
    device and the memory planner's count of a training step on fake tensors,
    :func:`agg_bench.runtime.memplan.training_bytes`, made once per process for the same sizes): at most
    :data:`MAX_PARAMETERS` parameters, and the weights, gradients, AdamW's moments, the average and one batch's
    saved activations within ``memory`` (default: this machine's, :func:`agg_bench.runtime.memplan.gpu_memory_bytes`
    less the planner's reserve, compared at each call). A ConfigError names the sizes otherwise; the plan's
    numbers when they fit."""
    from ..runtime.memplan import RESERVE_FRACTION, bytes_text, gpu_memory_bytes

    sizes = (f"num_layers={cfg.num_layers}, num_attention_heads={cfg.num_attention_heads}, "
             f"attention_head_dim={cfg.attention_head_dim}, text_dim={cfg.text_dim}")
    parameters, counted_plan = _counts(tuple(getattr(cfg, key) for key in SIZE_KEYS))
    if counted_plan is None:
        raise ConfigError("num_layers", cfg.num_layers, f"sizes of at most {MAX_PARAMETERS:,} parameters together "
                          f"({sizes}: {parameters:,} parameters)")
    plan = dict(counted_plan)
    budget = memory if memory is not None else int((1 - RESERVE_FRACTION) * gpu_memory_bytes("cpu"))
    if plan["total"] > budget:
        raise ConfigError("batch_size", cfg.batch_size,
                          f"a model and batch that fit this machine's {bytes_text(budget)} ({sizes}, batch_size="
                          f"{cfg.batch_size}, resolution={cfg.resolution}: {bytes_text(plan['state'])} of weights, "
                          f"gradients, AdamW moments and average, {bytes_text(plan['activations'])} of activations; "
                          "the memory planner: does not fit)")
    return plan


def load_pretrain_config(path: str | Path | None, overrides: list[str] | None = None) -> PretrainConfig:
    """PretrainConfig defaults <- YAML file <- ``--set key=value`` overrides, typed and bounded by its fields
    (:func:`agg_bench.config.pretrain_keys.read_pretrain_config`), then checked together
    (:func:`check_pretrain_config`)."""
    return check_pretrain_config(read_pretrain_config(path, overrides))


def sweep_entry_config(label: str, spec: dict) -> PretrainConfig:
    """The config of a sweep's ``pretrain.<label>`` entry, read as its pretrain job is given it: the entry's
    ``config`` file with each ``set`` item as the ``--set KEY=VALUE`` the job passes
    (:func:`agg_bench.tools.sweep.overrides_of`: a quoted ``'7'`` stays text). The workflow and the campaign
    read every entry so before any job starts; a refusal names the entry."""
    from .sweep import SweepError, overrides_of

    try:
        return load_pretrain_config(spec["config"], overrides_of(list((spec.get("set") or {}).items())))
    except UserError as err:
        raise SweepError(f"pretrain.{label}: {err}") from None


def transformer_config(cfg: PretrainConfig) -> dict:
    """The family's transformer config for pixel latents of ``cfg`` (its spec's ``pixel_transformer``; a
    ConfigError naming the key a value the family cannot take)."""
    build = FAMILY_SPECS[cfg.family].pixel_transformer
    assert build is not None  # cfg.family is one of PretrainConfig.family's, the families that have one
    return build(
        3 * cfg.pixel_factor ** 2, cfg.resolution // cfg.pixel_factor, cfg.num_layers, cfg.num_attention_heads,
        cfg.attention_head_dim, cfg.text_dim)


def build_transformer(cfg: PretrainConfig):
    """The family's diffusers transformer for pixel latents of ``cfg`` (seeded random weights)."""
    kwargs = transformer_config(cfg)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed)
        return FAMILY_SPECS[cfg.family].transformer_cls()(**kwargs)


class SceneConditioning:
    """The token-hash conditioning of every caption of the grammar, looked up by caption."""

    def __init__(self, cfg: PretrainConfig, device: torch.device | str = "cpu"):
        self.captions = [s.caption for s in all_scenes()]
        self.index = {c: i for i, c in enumerate(self.captions)}
        self.table = hash_embed(self.captions, cfg.text_dim, cfg.text_dim, cfg.max_tokens, cfg.seed).to(device)

    def __call__(self, captions: list[str]) -> Conditioning:
        return self.table[torch.tensor([self.index[c] for c in captions])]


def data_statistics(cfg: PretrainConfig, n: int = 512) -> tuple[float, float]:
    """(mean, std) of the images' pixels in [-1, 1]: the decoder's shift and 1 / scale."""
    gen = torch.Generator().manual_seed(cfg.seed + 1)
    pixels = draw_batch(sample_scenes(n, gen), cfg.resolution, gen) * 2 - 1
    return float(pixels.mean()), float(pixels.std())


@torch.no_grad()
def sample(policy: Policy, cond: Conditioning, latent_shape: tuple[int, ...], steps: int, shift: float,
           generator: torch.Generator) -> torch.Tensor:
    """Images (B, 3, S, S) in [0, 1] by the deterministic Euler sampler from seeded noise."""
    sigmas = flow_sigmas(steps, shift)
    device = next(policy.transformer.parameters()).device
    x = torch.randn((cond.batch_size, *latent_shape), generator=generator).to(device)  # the CPU's noise
    sigmas = sigmas.to(device)
    timesteps = policy.timestep_values(sigmas).float()
    for j in range(steps):
        x = ode_step(policy.velocity(x, timesteps[j].expand(x.shape[0]), cond), x, sigmas, j)
    return policy.decode(x)


def grid_captions(n: int = 16) -> list[str]:
    """``n`` captions spread over the grammar (every colour, shape, position and count appears)."""
    scenes = all_scenes()
    return [scenes[(i * 37) % len(scenes)].caption for i in range(n)]


def save_grid(path: str | Path, images: torch.Tensor, captions: list[str], scores: list[float] | None = None,
              columns: int = 4, title: str | None = None) -> None:
    """A PNG grid of images with their captions (and scene rewards) written atomically."""
    plt = pyplot()
    rows = math.ceil(len(captions) / columns)
    fig, axes = plt.subplots(rows, columns, figsize=(2.2 * columns, 2.4 * rows), squeeze=False)
    for k, ax in enumerate(axes.flat):
        ax.axis("off")
        if k < len(captions):
            ax.imshow(images[k].permute(1, 2, 0).clamp(0, 1).numpy(), interpolation="nearest")
            label = captions[k].replace(" on the", "\non the").replace(" at the", "\nat the")
            if scores is not None:
                label += f"\nreward {scores[k]:.2f}"
            ax.set_title(label, fontsize=7)
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    save_figure(fig, path)
    plt.close(fig)


def learning_rate(cfg: PretrainConfig, step: int) -> float:
    """The learning rate of optimizer step ``step`` (0-based): linear warm-up, then ``lr_schedule``."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    if cfg.lr_schedule == "constant":
        return cfg.lr
    progress = (step - cfg.warmup_steps) / max(cfg.steps - cfg.warmup_steps, 1)
    return cfg.lr * 0.5 * (1 + math.cos(math.pi * progress))


def check_out_dir(out: Path) -> None:
    """An output folder may be new, empty, or an earlier ``agg-bench pretrain`` output (replaced): only its
    files, with its ``pretrain.json`` of this command's format (someone's own file of that common name, with
    nothing else or beside files of these names, is not replaced). Reads only."""
    check_folder(out, PRETRAIN_CONTENTS)
    if not out.is_dir() or all(is_harness_name(p.name) for p in out.iterdir()):
        return
    try:
        written = read_json_object(out / MARKER, f"an agg-bench pretrain output's {MARKER}").get("format")
    except JsonFileError as err:
        found = err.problem
    else:
        if written == FORMAT:
            return
        found = f"format {quote(written)}"
    raise UserError(f"--out {shown(out)}: a non-empty folder that is not an agg-bench pretrain output ({MARKER}: "
                    f"{found}, expected format {FORMAT}); give a new or empty folder")


def pretrain(cfg: PretrainConfig, out_dir: str | Path, progress: bool = True) -> dict:
    """Train, sample and save the model folder ``out_dir``; return what ``pretrain.json`` holds. The
    torch thread count ``threads`` (capped at the usable cores: more would wait for each other) holds
    during the call only (a caller's later work keeps its own)."""
    resolve_device(cfg.device, "device", auto=False)  # a device this machine lacks is refused before any work
    threads = torch.get_num_threads()
    if cfg.threads:
        torch.set_num_threads(min(cfg.threads, usable_cores() or cfg.threads))
    try:
        return _pretrain(cfg, out_dir, progress)
    finally:
        torch.set_num_threads(threads)


def _pretrain(cfg: PretrainConfig, out_dir: str | Path, progress: bool) -> dict:
    out = Path(out_dir)
    check_out_dir(out)
    # the new folder is written beside --out and renamed over it: the lock lies beside it too
    with Claim(out, folder=True, lock_inside=False, check=lambda: check_out_dir(out)):
        remove_stale_temps(out)  # what a pretrain of this --out killed while it saved left beside it: a model each
        return _train_and_save(cfg, out, progress)


def _train_and_save(cfg: PretrainConfig, out: Path, progress: bool) -> dict:
    start_wall, start_cpu = time.perf_counter(), time.process_time()
    shift_factor, std = data_statistics(cfg)
    decoder = PixelDecoder(cfg.pixel_factor, scaling_factor=1.0 / std, shift_factor=shift_factor)
    device = resolve_device(cfg.device, "device", auto=False)
    transformer = build_transformer(cfg).to(device)  # initialised on the CPU from the seed, then moved
    policy = policy_class(cfg.family)(transformer, decoder)
    latent_shape = policy.latent_shape(cfg.resolution)
    conditioning = SceneConditioning(cfg, device)
    ema = copy.deepcopy(transformer).requires_grad_(False)
    optimizer = torch.optim.AdamW(transformer.parameters(), lr=cfg.lr, weight_decay=0.0)
    gen = torch.Generator().manual_seed(cfg.seed + 2)
    losses = []
    for step in range(cfg.steps):
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(cfg, step)
        scenes = sample_scenes(cfg.batch_size, gen)
        data = decoder.encode_images(draw_batch(scenes, cfg.resolution, gen))
        noise = torch.randn(data.shape, generator=gen)
        u = torch.rand(cfg.batch_size, generator=gen)
        data, noise, u = data.to(device), noise.to(device), u.to(device)  # drawn on the CPU: the same on any device
        sigma = (cfg.shift * u / (1 + (cfg.shift - 1) * u)).view(-1, 1, 1, 1)
        noisy = (1 - sigma) * data + sigma * noise
        velocity = policy.velocity(noisy, sigma.flatten() * policy.timestep_scale,
                                   conditioning([s.caption for s in scenes]))
        loss = torch.nn.functional.mse_loss(velocity, noise - data)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(transformer.parameters(), 1.0)
        optimizer.step()
        decay = min(cfg.ema_decay, (1 + step) / (10 + step))  # short runs: the average starts from recent weights
        with torch.no_grad():
            for e, p in zip(ema.parameters(), transformer.parameters()):
                e.lerp_(p, 1 - decay)
        losses.append(loss.item())
        if progress and (step % 100 == 0 or step == cfg.steps - 1):
            recent = losses[-100:]
            print(f"pretrain {cfg.family} step {step + 1}/{cfg.steps} loss {sum(recent) / len(recent):.4f} "
                  f"({time.perf_counter() - start_wall:.0f} s)", file=sys.stderr, flush=True)
    train_wall, train_cpu = time.perf_counter() - start_wall, time.process_time() - start_cpu
    from ..engine.scene_reward import SceneReward

    policy.transformer = ema.eval()
    captions = grid_captions()
    images = sample(policy, conditioning(captions), latent_shape, cfg.sample_steps, cfg.shift,
                    torch.Generator().manual_seed(cfg.seed + 3)).cpu()
    reward = SceneReward()
    scores = reward(images, captions)
    window = max(1, min(100, cfg.steps // 10))
    summary = {
        "format": FORMAT, "config": asdict(cfg), "parameters": sum(p.numel() for p in ema.parameters()),
        "train_wall_s": train_wall, "train_cpu_s": train_cpu, "threads": torch.get_num_threads(),
        "loss_first": sum(losses[:window]) / window, "loss_last": sum(losses[-window:]) / window,
        "loss_curve": [sum(losses[i:i + window]) / len(losses[i:i + window]) for i in range(0, len(losses), window)],
        "sample_captions": captions, "sample_reward": float(scores.mean()),
        **{f"sample_{k}": float(v.mean()) for k, v in reward.details.items()},
    }
    with atomic_target(out) as tmp:  # an earlier output is replaced only once the new one is complete
        tmp.mkdir(parents=True)
        ema.save_pretrained(tmp / "transformer")
        decoder.save_pretrained(tmp / "vae")
        FlowMatchEulerDiscreteScheduler(shift=cfg.shift).save_pretrained(tmp / "scheduler")
        write_text(tmp / TOKEN_HASH_FILE, json.dumps({"max_tokens": cfg.max_tokens, "seed": cfg.seed}) + "\n")
        save_grid(tmp / "samples.png", images, captions, scores.tolist(),
                  title=f"{cfg.family}, {counted(cfg.steps, 'step')}, {counted(cfg.sample_steps, 'Euler step')}: "
                        f"mean scene reward {float(scores.mean()):.2f}")
        summary["wall_s"] = time.perf_counter() - start_wall
        write_json(tmp / MARKER, summary)
    return summary
