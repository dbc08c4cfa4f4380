"""The run config, typed: one dataclass per section, composed into :class:`RunConfig`.

This module is the one place a run-config key is written down. Each field carries its default, its
meaning (``doc``, the reference table's text) and its constraints beyond its annotation (bounds, a
pattern, a list length) once, through :func:`option`. From these fields come the defaults
(:data:`DEFAULTS`), the JSON schema that validation and the workflow's sweep check with
(:func:`agg_bench.config.schema.run_schema`) and the table of ``docs/configuration.md``
(:mod:`agg_bench.config.docs`).

A field's annotation gives its JSON type: ``int`` an integer (never ``2.0`` or ``true``), ``float`` a
number, ``str`` text, ``bool`` true or false, ``Literal[...]`` one of the listed values, ``list[str]``
a list of text, ``dict`` a free mapping, ``X | None`` X or null.

Values are kept as written, never converted (an integer written for a ``float`` key stays an
integer), so that :meth:`RunConfig.to_dict` gives back exactly what a run's ``config.json`` has always
held: resuming and rerunning compare it key by key.
"""
from __future__ import annotations

import copy
import dataclasses
import os
import typing
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, ClassVar, Literal, Mapping, Self

from ..errors import ConfigError
from .yamlio import read_number


def option(default: Any, doc: str, **constraints: Any) -> Any:
    """A config field: its ``default``, its meaning ``doc`` and its ``constraints``, JSON Schema keywords
    written in snake case (``minimum``, ``maximum``, ``exclusive_minimum``, ``exclusive_maximum``,
    ``pattern``, ``min_items``, ``max_items``, ``unique_items``; ``items``: such keywords for a list's items),
    plus ``expected``: how an error and the table say what a ``pattern``, a union or a list size allows. The
    run config's keys, and a method's or a cache's options (:mod:`agg_bench.config.options`), are written
    with it."""
    metadata = {"doc": doc, "constraints": constraints}
    if isinstance(default, (dict, list)):
        return field(default_factory=lambda: copy.deepcopy(default), metadata=metadata)
    return field(default=default, metadata=metadata)


def section(cls: type, doc: str) -> Any:
    """A field that holds a whole section (``cls``, default: its defaults)."""
    return field(default_factory=cls, metadata={"doc": doc})


def bound(section_class: type, key: str, name: str = "maximum") -> Any:
    """The constraint ``name`` (``maximum``, ``minimum`` ...) of ``section_class``'s key ``key``: a command-line
    option that counts the same thing takes its bound from here."""
    return {f.name: f for f in dataclasses.fields(section_class)}[key].metadata["constraints"][name]


class Section:
    """What every section does: built from a mapping, written back as one (in field order)."""

    # keys a mapping of this section must have, and whether keys beyond the fields are allowed
    REQUIRED: tuple[str, ...] = ()
    OPEN = False
    __dataclass_fields__: ClassVar[dict[str, dataclasses.Field]]  # every section is a dataclass

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Self:
        """The section a checked mapping describes (:func:`agg_bench.config.load.validate` checks it, or a
        run's own ``config.json``); a key it lacks takes its default, as in a config written before the
        key existed."""
        values = {}
        for f in fields(cls):
            if f.name in data:
                nested = section_class(f)
                value = data[f.name]
                values[f.name] = nested.from_dict(value) if nested is not None else copy.deepcopy(value)
        return cls(**values)

    def to_dict(self) -> dict[str, Any]:
        """The section as plain data, keys in field order: what ``config.json`` holds."""
        return {f.name: (value.to_dict() if isinstance(value := getattr(self, f.name), Section)
                         else copy.deepcopy(value)) for f in fields(self)}


def section_class(f: dataclasses.Field) -> type[Section] | None:
    factory = f.default_factory
    return factory if isinstance(factory, type) and issubclass(factory, Section) else None


@dataclass
class ModelConfig(Section):
    """``model``: which diffusion transformer is trained, at what size and precision."""

    family: Literal["sd3", "flux", "qwenimage"] = option("sd3", "the model family")
    preset: Literal["tiny", "pretrained", "random"] = option(
        "tiny", "`tiny`: seeded random weights (a few hundred thousand parameters); `random`: a full-size public "
        "architecture (`model.architecture`) with seeded random weights; `pretrained`: the local folder "
        "`model.pretrained`")
    pretrained: str | None = option(None, "local diffusers folder (`transformer/`, `vae/`, `scheduler/`, "
                                          "text encoders): the model trained, with preset `pretrained` or the "
                                          "default `tiny`; refused with `random`", min_length=1,
                                    expected="a folder's path, or null")
    resolution: int = option(
        128, "image side in pixels; latent side = resolution / VAE factor; a size the model cannot take is an "
        "error (the family's own limit applies too, e.g. 1536 px for the tiny SD3, 3072 px for SD3.5-Large's "
        "position embedding)", minimum=1, maximum=4096)
    dtype: Literal["float32", "float64", "bfloat16"] = option(
        "float32", "`float64` for tests; `bfloat16`: float32 master weights, bf16 autocast forward")
    architecture: str | None = option(
        None, "with preset `random`: `sd3.5-medium` (sd3 default), `sd3.5-large`, `flux.1-dev` (flux default), "
        "`qwen-image` (qwenimage default); null: the family's default; null unless the preset is `random`",
        min_length=1, expected="an architecture's name, or null")
    guidance: float = option(
        1.0, "the guidance value a guidance-distilled transformer embeds (FLUX.1-dev: diffusers' `guidance` input, "
        "scaled by 1000 inside; FluxPipeline's `guidance_scale`, 3.5 in DanceGRPO, MixGRPO and BranchGRPO), given "
        "to every call: rollout, training, reference and old policies, evaluation; a value other than 1.0 is "
        "refused for a transformer without a guidance embedding (SD3, Qwen-Image, the tiny FLUX, a folder whose "
        "transformer/config.json has no `guidance_embeds`)", minimum=0, maximum=100)


def check_prompts_path(text: str, key: str = "prompts.file") -> Path:
    """The prompts file ``text`` names (a config's ``prompts.file``, as written), refused in one line naming
    ``key`` unless it is a path this user can read (:func:`~agg_bench.outdir.named_path_problem`) of an existing
    ``.txt`` or ``.jsonl`` file. Reads nothing but the file's kind: what the run reads then
    (:func:`~agg_bench.engine.prompts.load_prompts`) and the sweep checks before any job, without torch."""
    from ..outdir import named_path_problem

    problem = named_path_problem(os.fspath(text), file=True)
    if problem is not None:
        raise ConfigError(key, str(text), f"a prompts file's path ({problem})")
    path = Path(text)
    if not path.is_file():
        raise ConfigError(key, str(path), "an existing .txt or .jsonl prompts file")
    if path.suffix not in (".txt", ".jsonl"):  # a .json list or a .csv read as lines: each line a prompt
        raise ConfigError(key, str(path), "a .txt (one prompt per line) or .jsonl ({\"prompt\": ...} per line) "
                                          "prompts file")
    return path


@dataclass
class PromptsConfig(Section):
    """``prompts``: the prompt set and how it becomes the transformer's text conditioning."""

    file: str | None = option(None, '`.txt` (one per line) or `.jsonl` (`{"prompt": ...}`), UTF-8, no control '
                                    'character in a prompt but the tab and no bidi embedding, override or isolate '
                                    '(U+202A to U+202E, U+2066 to U+2069); null: the built-in set',
                              min_length=1, expected="a file's path, or null")
    max_tokens: int = option(16, "tokens of the tiny models' download-free hash embedding", minimum=1, maximum=4096)
    max_sequence_length: int | None = option(
        None, "text-encoder tokens of a local model (T5 / Qwen) or of a random architecture's hash embedding "
        "(null: the pipeline's default)", minimum=1, maximum=4096)
    cache_dir: str = option("results/embeddings", "folder of cached prompt embeddings of local models "
                                                  "(`agg-bench embed` writes there)", min_length=1,
                            expected="a folder's path")


# torch keeps a device index in 8 bits: it read cuda:128 as cuda:-128, which no check of the device count refused,
# and cuda:999999999 as cuda (the current device)
MAX_DEVICE_INDEX = 127


def gpu_index(text: str) -> int | None:
    """The GPU index ``text`` names: an integer >= 0 read as every integer of the harness is
    (:func:`~agg_bench.config.read_number`) and written as plain decimal digits (no sign, space or underscore in a
    device's name); None for anything else, such as ``017`` (which torch reads as device 17 or refuses, by
    version, where every number here refuses 017)."""
    index = read_number(text, int)
    return index if index is not None and index >= 0 and str(index) == text else None


def device_parts(name: Any) -> tuple[str, int | None] | None:
    """What the device name ``name`` says: (``cpu``, None), (``auto``, None), (``cuda``, None) or (``cuda``, N) for
    ``cuda:N``, N a GPU index (:func:`gpu_index`) up to :data:`MAX_DEVICE_INDEX`; None for anything else, such as
    ``cuda:017``."""
    if not isinstance(name, str):
        return None
    if name in ("cpu", "auto", "cuda"):
        return name, None
    kind, colon, text = name.partition(":")
    index = gpu_index(text) if kind == "cuda" and colon else None
    return ("cuda", index) if index is not None and index <= MAX_DEVICE_INDEX else None


def device_expected(auto: bool = True) -> str:
    """What a device key or flag takes, in its one-line refusal (``auto``: whether it takes ``auto``)."""
    names = "cpu, cuda, cuda:N or auto" if auto else "cpu, cuda or cuda:N"
    return f"{names} (N: a GPU index from 0 to {MAX_DEVICE_INDEX} in decimal digits, e.g. cuda:1)"


CPS_KINDS = ("cps", "cps_unscaled")  # coefficients-preserving sampling: the same step, two log-probabilities


def check_cps_eta(kind: str, eta: float) -> None:
    """A ``cps`` noise level is an angle's fraction: std = s' sin(eta pi / 2) needs eta in (0, 1]."""
    if kind in CPS_KINDS and not 0 < eta <= 1:
        raise ConfigError("sampling.eta", eta, f"a number in (0, 1] for sampling.sde {kind!r} (std = s' sin(eta pi/2))")


@dataclass
class SamplingConfig(Section):
    """``sampling``: the rollout's sigma schedule and SDE."""

    steps: int = option(10, "denoising steps T (at most the schedulers' 1000 training timesteps)",
                        minimum=1, maximum=1000)
    sde: Literal["flow_grpo", "dance_grpo", "cps", "cps_unscaled"] = option(
        "flow_grpo", "the SDE step and its log-probability: `flow_grpo`, `dance_grpo`, `cps` (coefficients-"
        "preserving sampling) or `cps_unscaled` (`cps`'s step with the public code's log-probability "
        "-(x' - mean)^2, without 1 / (2 std^2)); formulas in `docs/design.md`")
    eta: float = option(0.7, "SDE noise level (`cps`, `cps_unscaled`: in (0, 1], std = s' sin(eta pi/2))",
                        exclusive_minimum=0)
    shift: float | None = option(
        3.0, "sigma shift of FlowMatchEulerDiscreteScheduler (null: the model's scheduler config, with its "
        "dynamic shift and `shift_terminal`)", exclusive_minimum=0)
    same_noise_per_group: bool = option(True, "the G samples of a prompt start from the same noise")
    schedule: Literal["diffusers", "linspace"] = option(
        "diffusers", "the sigmas: `diffusers`, FlowMatchEulerDiscreteScheduler's (Flow-GRPO, DiffusionNFT, AWM; DGPO's "
        "`method.sampler: sana` samples on its scheduler's own grid, and refuses `linspace`); "
        "`linspace`, shift(linspace(1, 0, T + 1)) with `sampling.shift` (DanceGRPO, MixGRPO, BranchGRPO, the AGG "
        "authors' eff_grpo; needs a number for `sampling.shift`)")


@dataclass
class GRPOConfig(Section):
    """``grpo``: groups, advantages and the clipped objective."""

    group_size: int = option(4, "G samples per prompt", minimum=2, maximum=256)
    prompts_per_iteration: int = option(
        2, "P prompts per iteration (B = P x G); a multiple of the data-parallel processes", minimum=1, maximum=1024)
    clip_range: float = option(1e-4, "PPO ratio clip eps", exclusive_minimum=0)
    adv_clip_max: float = option(5.0, "advantage clamp", exclusive_minimum=0)
    beta: float = option(0.0, "KL weight to the reference policy (the initial weights, or LoRA adapters off)",
                         minimum=0)
    adv_std: Literal["group", "global"] = option(
        "group", "the spread A = (r - group mean) / (std + `adv_eps`) divides by: `group`, the std of the group's "
        "rewards; `global`, the std of the whole batch's rewards (Flow-GRPO's `sample.global_std`, DiffusionNFT, "
        "AWM; one data-parallel process)")
    adv_ddof: int = option(0, "delta degrees of freedom of that std: 0 divides by n (numpy's `np.std`: Flow-GRPO, "
                              "DiffusionNFT, AWM, DGPO), 1 by n - 1 (torch's `.std()`: DanceGRPO, MixGRPO, "
                              "BranchGRPO, eff_grpo)", minimum=0, maximum=1)
    adv_eps: float = option(1e-8, "added to the std before dividing (1e-8: the DanceGRPO family; 1e-4: Flow-GRPO's "
                                  "stat tracker, DiffusionNFT, AWM, DGPO)", exclusive_minimum=0, maximum=1)
    kl_form: Literal["transition", "no_dt"] = option(
        "transition", "the `beta` term: `transition`, the KL of the two Gaussian transitions, mean squared "
        "difference / (2 std^2) with std = std_t sqrt(dt) (Flow-GRPO paper); `no_dt`, divided by 2 std_t^2 "
        "without dt (Flow-GRPO's code: the transition KL times dt)")


# The largest price of one pass (cost units). Prices are ratios near 1 (the defaults: 1, 1.1, 1.6), or a
# time per sample in the user's unit; the bound keeps every run's cumulative cost a finite number (passes
# of at most 100,000 iterations x 262,144 samples x 1,000 steps each, priced at 1e6, stay below 1e26),
# since a record's null cost means an out-of-memory record and nothing else.
MAX_PASS_COST = 1e6


@dataclass
class PassCosts(Section):
    """``train.pass_costs``: the price of one pass of each kind the policy counter counts, per sample, in
    cost units; the unit is one no-grad forward of one sample (``forward_nograd`` 1.0).

    A run's cost is the sum over its counted passes of count x price (``forward_nograd``, ``forward_grad``
    and ``backward`` of every record: rollout forwards, train passes and the KL reference's or an old
    policy's no-grad forwards alike; the ``train_`` counts are shares of these, not added again): exact and
    independent of the machine's load, so ``train.budget`` stops every method at the same spent work.

    The defaults are measured on the learning testbed's model (the committed ``tests/data/sd3-scenes``,
    32 px, the sweep's settings, 1 thread, CPU time of the process, a shared 2-core AMD EPYC), at the
    32-latent batch on which its runs make all three kinds of pass (the rollout's and the KL reference's
    forwards, the trained steps' forwards and backwards): per sample 0.99 / 1.11 / 1.55 ms and 1.20 /
    1.31 / 1.93 ms in two measurements (no-grad forward / forward with grad / backward; medians of 22
    interleaved repetitions), ratios 1.09-1.12 and 1.56-1.60. ``agg-bench calibrate`` on the same config
    reported 1.15 / 1.00 / 1.45 and 1.30 / 1.16 / 1.60 ms (ratios 0.87-0.89 and 1.24-1.27), but it times
    the no-grad forward on one 320-latent batch (AGG's velocity recomputation without reuse), which is
    slower per sample on this CPU: its ratios would price every rollout forward at a batch only that
    recomputation uses.
    """

    forward_nograd: float = option(1.0, "cost units of one no-grad forward of one sample (the unit)",
                                   exclusive_minimum=0, maximum=MAX_PASS_COST)
    forward_grad: float = option(1.1, "cost units of one forward with grad of one sample (measured on the learning "
                                      "testbed: 1.09-1.12 no-grad forwards)", exclusive_minimum=0,
                                 maximum=MAX_PASS_COST)
    backward: float = option(1.6, "cost units of one backward of one sample (measured on the learning testbed: "
                                  "1.56-1.60 no-grad forwards)", exclusive_minimum=0, maximum=MAX_PASS_COST)


@dataclass
class TrainConfig(Section):
    """``train``: the optimizer, which steps are trained, memory options and checkpoints."""

    iterations: int = option(2, "GRPO iterations", minimum=1, maximum=100_000)
    lr: float = option(1e-4, "AdamW learning rate", exclusive_minimum=0)
    weight_decay: float = option(0.0, "AdamW weight decay", minimum=0)
    max_grad_norm: float | None = option(1.0, "gradient-norm clip (null: none)", exclusive_minimum=0)
    timestep_fraction: float = option(1.0, "fraction of steps (plan `steps`) or of groups (plan `groups`) trained; 1.0 for "
                                      "`nft`, `awm` and `dgpo`, which train times of their own",
                                      exclusive_minimum=0, maximum=1)
    plan: Literal["steps", "groups"] = option(
        "steps", "`steps`: a random subset of steps per sample (DanceGRPO); `groups`: random whole groups of "
        "`plan_window` consecutive steps (the AGG authors' scheme, shared by `full` and `agg`)")
    plan_window: int = option(5, "group length of the `groups` plan", minimum=1, maximum=1000)
    inner_epochs: int = option(1, "passes over each rollout; each takes `train.minibatches` optimizer steps",
                               minimum=1, maximum=100)
    gradient_checkpointing: bool = option(False, "recompute transformer blocks in backward (refused with "
                                                 "training-time caches)")
    lora_rank: int = option(0, "0: full fine-tune; >0: LoRA adapters (peft) of this rank, at most the width of the "
                                 "narrowest adapted layer", minimum=0, maximum=4096)
    lora_alpha: float | None = option(None, "LoRA alpha; the adapters' scale is alpha / rank (null: the rank); null when "
                                            "`lora_rank` is 0",
                                      exclusive_minimum=0)
    lora_target_modules: list[str] | None = option(
        None, "module names to adapt (null: the family's attention projections); null when `lora_rank` is 0",
        min_items=1)
    checkpoint_every: int = option(
        0, "save a resumable `DIR/checkpoint.pt` every K iterations, at the end and on SIGTERM/SIGINT "
        "(`agg-bench run --resume` continues from it); 0: never (a run resumed with 0 that ends ok removes the "
        "checkpoint it resumed from, as a fresh run leaves none)", minimum=0, maximum=100_000)
    shard: Literal["none", "fsdp"] = option(
        "none", "`none`: each process holds the whole model; `fsdp`: FSDP2 `fully_shard` of each transformer "
        "block and the root, under torchrun (docs/sharding.md)")
    cpu_offload: bool = option(False, "with `train.shard: fsdp`: keep sharded parameters, gradients and "
                                      "optimizer state in host memory (FSDP2 `CPUOffloadPolicy`; refused "
                                      "without `fsdp` and on the CPU)")
    budget: float | None = option(
        None, "cost units (`train.pass_costs`) to spend: the run stops after the first iteration whose cumulative "
        "`cost` reaches it, or after `train.iterations` if those come first (set iterations as a cap); null: run "
        "`train.iterations`", exclusive_minimum=0)
    pass_costs: PassCosts = section(PassCosts, "the price of each counted pass in cost units (a record's `cost`)")
    ignore_last: bool = option(
        False, "never train the last denoising step (DanceGRPO's, GUESS's, BranchGRPO's and eff_grpo's "
               "`--ignore_last`): `plan` draws from the other steps, `branch` trains no transition of it; refused "
               "by the likelihood-free methods (`nft`, `awm`, `dgpo`), whose times are their own")
    minibatches: int = option(
        1, "optimizer steps per epoch: the rollout is split into this many mini-batches (`train.minibatch_unit`) "
           "and the optimizer steps after each; with `groups`, group g goes to mini-batch g mod this value (so that a "
           "data-parallel run steps on the single-process run's mini-batches) and it divides the groups of one "
           "process's batch (`grpo.prompts_per_iteration` / processes); refused by `branch`, `nft`, `awm` and `dgpo`",
        minimum=1, maximum=1024)
    minibatch_unit: Literal["groups", "slices"] = option(
        "groups", "what a mini-batch is made of: `groups`: whole prompt groups, dealt in order (`train.minibatches` "
        "divides the groups); `slices`: every group cut into `train.minibatches` consecutive slices, mini-batch k "
        "holding the k-th slice of each group (it divides `grpo.group_size`: MixGRPO's step every 3 of a group's 12 "
        "samples)")
    eval_ema: float | None = option(
        None, "keep an exponential moving average of the trained parameters, taking them in after every optimizer "
              "step n with the decay min((1 + n) / (10 + n), this value), and evaluate with it: the in-run "
              "evaluations (`eval.every`) and `agg-bench learning`'s evaluation of the final checkpoint, which holds "
              "it; the rollout and training use the trained weights (DiffusionNFT's `train.ema`, 0.9); refused with "
              "`train.shard: fsdp`; null: none, evaluations use the trained weights",
        exclusive_minimum=0, exclusive_maximum=1)
    eval_ema_every: int = option(
        1, "`train.eval_ema`'s average takes in the weights only after the optimizer steps n with (n + 1) divisible "
           "by this (the public `EMAModuleWrapper`'s `update_step_interval`: 1 in DiffusionNFT and AWM, 8 in DGPO); "
           "refused above 1 without `train.eval_ema`",
        minimum=1, maximum=10**6)
    eval_ema_updates: int = option(
        1, "`train.eval_ema`'s average takes in the weights of each optimizer step n that qualifies "
           "(`train.eval_ema_every`) this many times, each with n's decay: once right after the step and the "
           "others just before the next optimizer step (after the next rollout and any evaluation or checkpoint "
           "between), as DGPO's code calls `ema.step` after each of an epoch's `num_batches_per_epoch` batches "
           "and its step count moves at the last (2 in `geneval_sd3_4gpu`); refused above 1 without "
           "`train.eval_ema`",
        minimum=1, maximum=1000)

    @property
    def optimizer_steps(self) -> int:
        """Optimizer steps per iteration: ``inner_epochs`` epochs of ``minibatches`` steps each (what the records'
        readers and the calibration price per iteration)."""
        return self.inner_epochs * self.minibatches


# Method name -> the module whose import registers it (agg_bench.methods.base.METHODS); a run imports only its own
# method's module (``cached`` brings in every cache and diffusers' hooks). Written here, among the basics, so that
# a reader of a run folder knows the harness's methods without importing one.
METHOD_MODULES = {"full": "baselines.full", "fraction": "baselines.subsample", "window": "baselines.subsample",
                  "agg": "agg_bench.methods.agg", "cached": "baselines.cached", "guess": "baselines.guess",
                  "branch": "baselines.branch", "mixgrpo_flash": "baselines.mixgrpo_flash",
                  "nft": "baselines.nft", "dgpo": "baselines.dgpo", "awm": "baselines.awm"}
METHOD_NAME_WORDS = (f"a registered method (one of {sorted(METHOD_MODULES)}) or a path package.module:Class to an "
                     "Estimator subclass")


def is_method_path(name: Any) -> bool:
    """Whether ``method.name`` is a dotted path ``package.module:Class`` rather than a registered name."""
    return isinstance(name, str) and ":" in name


def is_method_path_shape(name: str) -> bool:
    """Whether dotted path ``name`` is ``package.module:Class`` with identifiers for parts (nothing imported)."""
    module_name, _, attr = name.partition(":")
    return bool(module_name and attr) and all(part.isidentifier() for part in (*module_name.split("."), attr))


def check_method_name(name: Any) -> None:
    """A ConfigError naming ``method.name`` unless ``name`` is one of :data:`METHOD_MODULES` or has the shape of a
    dotted path ``package.module:Class``, which is not imported: what a run folder's ``config.json`` may name (a
    run ran one of them), checked by its reader without importing any method."""
    if not (name in METHOD_MODULES if isinstance(name, str) and not is_method_path(name)
            else is_method_path(name) and is_method_path_shape(name)):
        raise ConfigError("method.name", name, METHOD_NAME_WORDS)


@dataclass
class MethodSection(Section):
    """``method``: the gradient estimator, by its registered name, with its own options.

    ``options`` is the method's own options (``Estimator.config_cls``, an
    :class:`~agg_bench.config.options.Options` dataclass whose fields document every option), built once when a loaded run config is checked
    (:func:`agg_bench.runtime.config_check.check_config`, which imports the method); None until then, and
    for a config read from a run folder. ``written`` is the section as written, which ``config.json`` keeps.
    """

    REQUIRED = ("name",)
    OPEN = True  # the options are checked by the method's config class, not by the run schema

    name: str = option("full", "a registered method: `full`, `fraction`, `window`, `agg`, `cached`, ... "
                               "(`METHOD_MODULES` in `agg_bench/config/sections.py` names each one's module), or "
                               "a dotted path `package.module:Class` to an Estimator of your own")
    options: Any = field(default=None, metadata={
        "key": "<option>", "default": "per method", "allowed": "the method's options (docs/methods.md)",
        "doc": "the method's own options, typed and bounded by its options class when a command runs (unknown "
               "keys refused; docs/methods.md's tables); a `method` section in a config file replaces the "
               "default one whole, so options of another method never leak in"})
    written: dict | None = field(default=None, repr=False, compare=False, metadata={"internal": True})

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Self:
        return cls(name=data["name"], written=copy.deepcopy(dict(data)))

    def to_dict(self) -> dict[str, Any]:
        return copy.deepcopy(self.written) if self.written is not None else {"name": self.name}

    @property
    def given(self) -> dict[str, Any]:
        """The options as written (the section without its name)."""
        return {k: v for k, v in self.to_dict().items() if k != "name"}


@dataclass
class RewardConfig(Section):
    """``reward``: what scores the images."""

    name: str = option(
        "jpeg_compressibility", "`jpeg_compressibility`, `jpeg_incompressibility` (option `quality`, 1-100), "
        "`smoothness` (minus the total variation: continuous in the pixels), `scene` (the learning testbed's "
        "colour, shape, position and count), and the learned `hpsv2`, `pickscore`, `imagereward`, `clipscore`, "
        "`aesthetic` (local checkpoints; `agg_bench/engine/reward_models/`)")
    options: dict = option({}, "the reward's options (checkpoint paths, batch_size, ...); a built-in reward's are "
                               "typed keys, in the tables at the end of this page")
    on: Literal["final", "x0"] = option(
        "final", "what the reward scores: `final`, the decoded last latent; `x0`, the last step's data prediction "
        "x_{T-1} - s_{T-1} v_{T-1} (DanceGRPO, BranchGRPO, eff_grpo; refused with one step and "
        "`sampling.same_noise_per_group`, where a group has one reward). The held-out evaluation scores the final latent.")


MAX_NVML_INTERVAL_S = 3600  # seconds


@dataclass
class TelemetryConfig(Section):
    """``telemetry``: what a run measures besides wall-clock time."""

    enabled: bool = option(True, "off: wall-clock timings only")
    # at most an hour: the sampler's thread waits this long between samples, and a wait past the platform's time_t
    # (about 9.2e9 s) ended that thread in an OverflowError mid-run, leaving the start and stop samples alone
    nvml_interval_s: float = option(0.05, "NVML sampling period in seconds (the start and stop of each measured "
                                          "block are sampled whatever the period)",
                                    exclusive_minimum=0, maximum=MAX_NVML_INTERVAL_S)
    saved_activations: Literal["every", "first", "never"] = option(
        "first", "iterations whose saved-activation peak is counted: `every`, `first` (the run's first "
        "iteration; a resumed run records what an uninterrupted one does), `never`; the others record null")
    tensorboard: bool = option(
        False, "also write each record's numbers as TensorBoard scalars in `DIR/tensorboard/` (step: the "
        "iteration), flushed per record, so that `tensorboard --logdir results/runs` shows runs as they train; "
        "needs the `profile` extra (`pip install 'agg-bench[profile]'`), else the run is refused")


@dataclass
class EvalConfig(Section):
    """``eval``: the held-out evaluation inside a run (:class:`agg_bench.runtime.evaluation.Evaluation`).

    Every caption of the run's prompt file x ``noises`` fixed noises (seeded by ``seed``: the same for
    every method, seed and iteration), sampled with the run's steps and schedule and scored by the run's
    reward, of the starting weights and then every ``every`` iterations and after the last. It is not
    charged: it draws from its own generator, its passes are not counted (no `cost`, no pass counts) and
    its time is not the iterations' (``t_iter_cpu_s``); ``evaluations.jsonl`` in the run folder holds one
    line per evaluation with its own seconds. Training is the same with it or without it. The images are
    sampled ``batch_size`` at a time, each call from a generator of its own (one call: ``seed``'s).
    """

    every: int = option(0, "evaluate the policy before the first iteration, every K iterations and after the last "
                           "(`DIR/evaluations.jsonl`); 0: never", minimum=0, maximum=100_000)
    noises: int = option(16, "fixed noises per caption", minimum=1, maximum=1024)
    seed: int = option(0, "seed of the evaluation's noise (and of the SDE's step noise)", minimum=0,
                       maximum=2**32 - 1)
    sampler: Literal["ode", "sde"] = option(
        "sde", "`sde`: the rollouts' own SDE (`sampling.sde`, `sampling.eta`: the policy GRPO trains), its step "
        "noise seeded; `ode`: the deterministic Euler sampler")
    batch_size: int = option(64, "images sampled per call (memory: one call's trajectory, whatever the prompt file "
                                 "and noises; an evaluation of at most this many images is one call)",
                             minimum=1, maximum=4096)



# the held-out evaluation's samplers, ``eval.sampler``'s values (and ``agg-bench learning --eval-sampler``'s): read
# from its annotation, here where no torch is imported
SAMPLERS: tuple[str, ...] = typing.get_args(typing.get_type_hints(EvalConfig)["sampler"])


@dataclass
class RunConfig(Section):
    """One training run: ``agg-bench run --config FILE [--set key=value ...]``, resolved and checked.

    Built by :func:`agg_bench.config.load.load_config` (defaults <- YAML file <- ``--set`` overrides); code
    reads typed sections (``cfg.train.lr``, ``cfg.method.options.window``), and ``to_dict()`` is what a run
    folder's ``config.json`` holds.
    """

    run_id: str | None = option(None, "name of the run in its records, summary and tables, never a path: 1 to 200 "
                                "printable characters (null: the output folder's name when the run starts; a "
                                "resumed run keeps its records' one)", min_length=1,
                                expected="a name of 1 to 200 printable characters, or null")
    seed: int = option(0, "all randomness of iteration i comes from a generator seeded by (seed, i)",
                          minimum=0, maximum=2**32 - 1)
    device: str = option("cpu", "where the run computes (`auto`: cuda where available)",
                         pattern="^(cpu|auto|cuda(:[0-9]+)?)$", expected=device_expected())
    progress: bool = option(True, "progress bar (a job log that is not a terminal gets one line per iteration)")
    model: ModelConfig = section(ModelConfig, "the model")
    prompts: PromptsConfig = section(PromptsConfig, "the prompts")
    sampling: SamplingConfig = section(SamplingConfig, "the rollout's sampler")
    grpo: GRPOConfig = section(GRPOConfig, "the GRPO objective")
    train: TrainConfig = section(TrainConfig, "the training loop")
    method: MethodSection = section(MethodSection, "the gradient estimator")
    reward: RewardConfig = section(RewardConfig, "the reward")
    telemetry: TelemetryConfig = section(TelemetryConfig, "the measurements")
    eval: EvalConfig = section(EvalConfig, "the held-out evaluation inside the run")

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Self:
        """The run config a checked mapping or a run folder's ``config.json`` describes; values an older run
        wrote for a key that has changed meaning read as today's (:func:`upgrade_written`)."""
        return super().from_dict(upgrade_written(data))

    def get_path(self, dotted: str) -> Any:
        """The value of a dotted key (``train.lr``, ``method.window``) as ``config.json`` holds it."""
        node: Any = self.to_dict()
        for part in dotted.split("."):
            node = node[part]
        return node


# Values that older run folders wrote (config.json, a checkpoint's config) for a key whose values have changed
# meaning, and the keys each stands for today: `grpo.adv_std` once named the ddof of the group's std. Only what a
# run wrote is read this way (upgrade_written); a config a user writes takes today's values alone.
WRITTEN_BEFORE: dict[tuple[str, str], dict[Any, dict[str, Any]]] = {
    ("grpo", "adv_std"): {"population": {"adv_std": "group", "adv_ddof": 0},
                          "sample": {"adv_std": "group", "adv_ddof": 1}},
}


def written_before(section: str, key: str, value: Any) -> dict[str, Any] | None:
    """The keys of ``section`` an older run's ``value`` of ``section.key`` stands for today; None when the
    value is no older one."""
    try:
        return WRITTEN_BEFORE.get((section, key), {}).get(value)
    except TypeError:  # an unhashable value is no older one
        return None


def weights_label(cfg: RunConfig) -> str:
    """Where a run's weights come from, the ``weights`` of its records: ``pretrained`` (a local folder), ``random``
    (a full-size architecture with random weights: its rewards say nothing about quality) or ``tiny``. A run
    folder's config read with :func:`upgrade_written` gives the label its run had, whichever version wrote it."""
    return "pretrained" if cfg.model.pretrained else cfg.model.preset


def folder_under_random_preset(model: Any) -> bool:
    """Whether the model section ``model`` names a ``model.pretrained`` folder beside ``model.preset: random``: a
    run folder that says so was trained on the folder's model (older versions let the folder take precedence),
    which today's config says with ``preset: pretrained``; a config a user writes that says so is refused."""
    return isinstance(model, dict) and model.get("preset") == "random" and bool(model.get("pretrained"))


def upgrade_written(config: Mapping[str, Any]) -> dict[str, Any]:
    """``config`` with every value an older run wrote (:data:`WRITTEN_BEFORE`) replaced by the keys it stands
    for, so that an old run folder reads and compares as the run it was (a key the file lacks still takes its
    default); and ``model.preset: random`` beside a ``model.pretrained`` folder, which older runs took as the
    folder, as ``pretrained``. A copy; a config without such values comes back equal."""
    out = copy.deepcopy(dict(config))
    for (section, key) in WRITTEN_BEFORE:
        part = out.get(section)
        if isinstance(part, dict) and (now := written_before(section, key, part.get(key))) is not None:
            part.update(now)
    if folder_under_random_preset(out.get("model")):
        out["model"]["preset"] = "pretrained"
    return out


# The defaults as plain data: what a config file is merged over, and what a key missing from an older run's
# config.json counts as.
DEFAULTS: dict[str, Any] = RunConfig().to_dict()
