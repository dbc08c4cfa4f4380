"""Model families: one spec per family, everything family-specific in one file.

``spec.py`` defines :class:`FamilySpec`; ``sd3.py``, ``flux.py`` and ``qwenimage.py`` each define one
(``SPEC``); ``catalog.py`` maps ``model.family`` to it and ``model.architecture`` to a public architecture;
``geometry.py`` reads the image sizes a family accepts, the end of its own schedule and whether its transformer
embeds a guidance value, from its configs. Nothing here imports torch or diffusers (the workflow's parse reads the
geometry); classes are resolved from diffusers when a model is built.
"""
from .catalog import ARCHITECTURES, DEFAULT_ARCHITECTURE, FAMILY_SPECS, architecture, family_spec, model_label
from .geometry import (DEFAULT_VAE_SCALE_FACTOR, ImageGeometry, check_guidance, check_own_schedule, check_resolution,
                       check_terminal_steps, geometry_from_configs, model_geometry, model_guidance_embeds,
                       model_shift_terminal)
from .qwenimage import TINY_QWEN_VAE
from .sd3 import TINY_VAE
from .spec import JOINT_ATTENTION_PROJECTIONS, Architecture, FamilySpec, diffusers_class

# The tiny preset's transformer configs, by family.
TINY_TRANSFORMERS: dict[str, dict] = {name: spec.tiny_transformer for name, spec in FAMILY_SPECS.items()}

__all__ = ["ARCHITECTURES", "Architecture", "DEFAULT_ARCHITECTURE", "DEFAULT_VAE_SCALE_FACTOR", "FAMILY_SPECS", "FamilySpec", "ImageGeometry",
           "JOINT_ATTENTION_PROJECTIONS", "TINY_QWEN_VAE", "TINY_TRANSFORMERS", "TINY_VAE", "check_guidance", "check_own_schedule", "check_resolution",
           "check_terminal_steps",
           "architecture", "diffusers_class", "family_spec", "geometry_from_configs", "model_geometry", "model_guidance_embeds",
           "model_label", "model_shift_terminal"]
