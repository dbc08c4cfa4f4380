"""LoRA fine-tuning through peft: adapters on the modules each family's spec names (``lora_targets``).

With ``train.lora_rank > 0`` only adapter weights are trained (the optimizer sees only parameters with
``requires_grad``); the KL reference policy is the same transformer with its adapters disabled
(:meth:`agg_bench.engine.models.Policy.frozen_copy`, through :func:`adapters_disabled`). This module imports
nothing of the models; the models import it. Snapshots of a LoRA run keep the base weights in
``transformer/`` (a plain diffusers folder) and the adapter in ``lora/``.
"""
from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from ..errors import ConfigError, UserError, shown
from .families import FAMILY_SPECS, family_spec

# The default train.lora_target_modules of each registered family.
LORA_TARGETS: dict[str, list[str]] = {name: list(spec.lora_targets) for name, spec in FAMILY_SPECS.items()}
ADAPTER_FILE = "adapter_model.safetensors"


def has_adapters(module: torch.nn.Module) -> bool:
    """Whether peft adapters (LoRA) are injected into ``module``."""
    return bool(getattr(module, "_hf_peft_config_loaded", False))


@contextlib.contextmanager
def adapters_disabled(module: torch.nn.Module):
    """Run ``module`` as its base model: every peft adapter is bypassed inside the block and restored after.

    peft's switch also flips ``requires_grad`` of the adapter weights; their flags are restored exactly.
    """
    from peft.tuners.tuners_utils import BaseTunerLayer

    layers = [m for m in module.modules() if isinstance(m, BaseTunerLayer)]
    flags = [(p, p.requires_grad) for m in layers for p in m.parameters()]
    for layer in layers:
        layer.enable_adapters(False)
    try:
        yield
    finally:
        for layer in layers:
            layer.enable_adapters(True)
        for p, flag in flags:
            p.requires_grad_(flag)


def lora_settings(family: str, rank: int, alpha: float | None = None,
                  target_modules: list[str] | None = None) -> dict:
    """The adapter settings a run uses (``alpha`` defaults to ``rank``: scale 1)."""
    return {"rank": int(rank), "alpha": float(rank if alpha is None else alpha),
            "target_modules": list(target_modules or family_spec(family).lora_targets)}


def apply_lora(transformer: Any, family: str, rank: int, alpha: float | None = None,
               target_modules: list[str] | None = None) -> dict:
    """Inject a trainable LoRA adapter and freeze every other weight; returns the settings used.

    The adapter starts as an exact no-op (B = 0), so the policy equals the base model before training.
    """
    from peft import LoraConfig

    settings = lora_settings(family, rank, alpha, target_modules)
    config = LoraConfig(r=settings["rank"], lora_alpha=settings["alpha"], init_lora_weights="gaussian",
                        target_modules=settings["target_modules"])
    _check_rank(transformer, family, settings["rank"], target_modules)
    transformer.requires_grad_(False)
    try:
        transformer.add_adapter(config)
    except ValueError as err:
        raise ConfigError("train.lora_target_modules", target_modules,
                          f"module names present in {type(transformer).__name__} ({err})") from err
    transformer._agg_lora_settings = settings
    return settings


def narrowest_adapted_layer(transformer: torch.nn.Module, family: str,
                            target_modules: list[str] | None = None) -> tuple[int, str, int, int] | None:
    """``(width, name, in_features, out_features)`` of the narrowest linear layer that adapters of ``family``
    (``target_modules``: the family's default targets where None) adapt in ``transformer``, its width the smaller
    of its features: the highest rank an adapter of that layer can have. None where no layer is adapted."""
    from peft import LoraConfig
    from peft.tuners.tuners_utils import check_target_module_exists

    config = LoraConfig(r=1, target_modules=lora_settings(family, 1, None, target_modules)["target_modules"])
    narrowest = None
    for name, module in transformer.named_modules():
        if isinstance(module, torch.nn.Linear) and name and check_target_module_exists(config, name):
            width = min(module.in_features, module.out_features)
            if narrowest is None or width < narrowest[0]:
                narrowest = (width, name, module.in_features, module.out_features)
    return narrowest


def _check_rank(transformer: torch.nn.Module, family: str, rank: int, target_modules: list[str] | None) -> None:
    """A ConfigError naming ``train.lora_rank`` when ``rank`` exceeds the width of the narrowest layer the
    adapters adapt (:func:`narrowest_adapted_layer`): B A of such a layer has at most that rank, so the rest of
    each adapter adds parameters, memory and time and no rank (at a full-size model's width, minutes of drawing
    its initial values). Checked before any adapter is allocated."""
    narrowest = narrowest_adapted_layer(transformer, family, target_modules)
    if narrowest is not None and rank > narrowest[0]:
        width, name, n_in, n_out = narrowest
        raise ConfigError("train.lora_rank", rank,
                          f"at most {width} (0: a full fine-tune), the width of the narrowest adapted layer ({name}: "
                          f"{n_in} -> {n_out} features in {type(transformer).__name__}); a higher rank adds "
                          "parameters but no rank")


def lora_info(transformer: torch.nn.Module) -> dict | None:
    """The settings of the adapter :func:`apply_lora` injected, or None for a fully trained model."""
    return getattr(transformer, "_agg_lora_settings", None) if has_adapters(transformer) else None


def base_state_dict(transformer: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The transformer's weights without adapters, under the names of the plain diffusers model."""
    out = {}
    for name, tensor in transformer.state_dict().items():
        if ".lora_" in name:
            continue
        out[name.replace(".base_layer.", ".")] = tensor
    return out


def save_transformer(transformer: Any, folder: str | Path) -> None:
    """Save a transformer as a plain diffusers folder (``config.json`` + safetensors weights); with LoRA,
    the base weights go there and the adapter to a ``lora/`` sibling of ``folder``."""
    folder = Path(folder)
    info = lora_info(transformer)
    if info is None:
        transformer.save_pretrained(folder)
        return
    from peft.utils import get_peft_model_state_dict

    folder.mkdir(parents=True, exist_ok=True)
    transformer.save_config(folder)
    save_file({k: v.contiguous() for k, v in base_state_dict(transformer).items()},
              str(folder / "diffusion_pytorch_model.safetensors"), metadata={"format": "pt"})
    adapter_dir = folder.parent / "lora"
    adapter_dir.mkdir(exist_ok=True)
    adapter = get_peft_model_state_dict(transformer)
    save_file({k: v.detach().contiguous() for k, v in adapter.items()}, str(adapter_dir / ADAPTER_FILE))


def load_adapter(transformer: torch.nn.Module, family: str, settings: dict, folder: str | Path) -> None:
    """Inject an adapter with ``settings`` and load its weights from ``folder`` (written by save_transformer)."""
    from peft.utils import set_peft_model_state_dict

    path = Path(folder) / ADAPTER_FILE
    if not path.is_file():
        raise UserError(f"{shown(folder)}: missing {ADAPTER_FILE} for the LoRA adapter")
    apply_lora(transformer, family, settings["rank"], settings["alpha"], settings["target_modules"])
    device = next(transformer.parameters()).device
    result = set_peft_model_state_dict(transformer, {k: v.to(device) for k, v in load_file(str(path)).items()})
    unexpected = getattr(result, "unexpected_keys", None)
    if unexpected:
        raise UserError(f"{shown(path)}: adapter weights that fit no module: {unexpected[:3]}")
