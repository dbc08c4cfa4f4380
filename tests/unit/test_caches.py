"""Inference caches on tiny SD3 and FLUX: exactness when disabled, counted reuse, reset/remove, training."""
from __future__ import annotations

import pytest
import torch

from agg_bench.engine.models import POLICIES, TINY_TRANSFORMERS, TRANSFORMER_CLASSES, Conditioning
from agg_bench.errors import ConfigError, UserError
from baselines.caches import CACHES, apply_cache, cache_options, make_config
from baselines.caches.configs import MAGCACHE_PRESETS
from baselines.caches.magcache import PRESET_RATIOS
from helpers import CACHE_NEUTRAL, seeded

FAMILIES = ("sd3", "flux", "qwenimage")
STEPS = 5
NAMES = sorted(CACHES)

# Default options, except FBC: diffusers' default threshold (0.05) is meant for 28-50-step samplers of
# trained models; on this 5-step trajectory of a random tiny model the first block's residual changes by
# 30-50% per step, so at its default FBC rightly computes everything. Its reuse is checked at 0.6.
REUSING = {name: {} for name in NAMES} | {"fbc": {"threshold": 0.6}}


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def make_policy(family: str, **overrides):
    """A tiny policy without a VAE; ``overrides`` change the tiny transformer's config."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seeded(0))
        transformer = TRANSFORMER_CLASSES[family](**{**TINY_TRANSFORMERS[family], **overrides})
    return POLICIES[family](transformer, None, 4)


@pytest.fixture(params=FAMILIES)
def policy(request):
    return make_policy(request.param)


@pytest.fixture
def inputs():
    g = torch.Generator().manual_seed(seeded(7))
    latents = torch.randn(2, 4, 16, 16, generator=g)
    return latents, Conditioning(torch.randn(2, 8, 32, generator=g), torch.randn(2, 32, generator=g))


def trajectory(policy, inputs, handle=None, train=False, detach=True, after_step=None):
    """Euler trajectory over a linear sigma schedule; velocities per step. With ``train``, every step's
    velocity is backpropagated (and the cache detached) before the next step."""
    latents, cond = inputs
    sigmas = torch.linspace(1.0, 0.0, STEPS + 1)
    timesteps = policy.timestep_values(sigmas)
    x, velocities = latents, []
    for j in range(STEPS):
        if handle is not None:
            handle.begin_step(j, float(timesteps[j]))
        with torch.set_grad_enabled(train):
            v = policy.velocity(x, timesteps[j].expand(x.shape[0]), cond)
        if train:
            v.square().mean().backward()
            if handle is not None and detach:
                handle.detach()
        if after_step is not None:
            after_step(j)
        velocities.append(v.detach())
        x = (x + (sigmas[j + 1] - sigmas[j]) * v).detach()
    return velocities


def assert_all_equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    assert len(a) == len(b)
    for step, (u, v) in enumerate(zip(a, b)):
        assert torch.equal(u, v), f"step {step} differs"


def assert_hook_free(transformer) -> None:
    for name, module in transformer.named_modules():
        assert not hasattr(module, "_diffusers_hook"), name
        assert "forward" not in module.__dict__, name


@pytest.mark.parametrize("name", NAMES)
def test_neutral_setting_is_exact(policy, inputs, name):
    reference = trajectory(policy, inputs)
    handle = apply_cache(policy.transformer, name, CACHE_NEUTRAL[name])
    assert_all_equal(trajectory(policy, inputs, handle), reference)
    assert handle.stats["skipped"] == 0 and handle.stats["computed"] > 0
    handle.remove()


@pytest.mark.parametrize("name", NAMES)
def test_reuse_is_counted_reset_repeats_and_remove_restores(policy, inputs, name):
    reference = trajectory(policy, inputs)
    handle = apply_cache(policy.transformer, name, REUSING[name])
    first = trajectory(policy, inputs, handle)
    stats = handle.stats
    assert stats["skipped"] > 0 and stats["computed"] > 0
    assert stats["hit_rate"] == stats["skipped"] / (stats["computed"] + stats["skipped"])
    units = len(handle.stats_by_module)
    assert stats["computed"] + stats["skipped"] == units * STEPS

    handle.reset()
    assert handle.stats == dict(computed=0, skipped=0, hit_rate=0.0)
    assert_all_equal(trajectory(policy, inputs, handle), first)
    assert handle.stats == stats

    handle.remove()
    assert_hook_free(policy.transformer)
    assert_all_equal(trajectory(policy, inputs), reference)


def test_diffusers_fbc_alone_fails_on_sd3_last_block(inputs):
    """Why ``fbc.py`` adds a hook on SD3's last block: diffusers' FBC subtracts from its ``None`` output."""
    from diffusers.hooks import FirstBlockCacheConfig, apply_first_block_cache
    from diffusers.hooks.hooks import CacheContext, _set_cache_context

    policy = make_policy("sd3")
    apply_first_block_cache(policy.transformer, FirstBlockCacheConfig(threshold=0.05))
    _set_cache_context(policy.transformer, CacheContext("cond"))
    latents, cond = inputs
    with pytest.raises(TypeError), torch.no_grad():
        policy.velocity(latents, torch.full((2,), 1000.0), cond)


def test_fbc_default_is_diffusers_and_works_on_sd3_last_block(inputs):
    policy = make_policy("sd3")
    assert policy.transformer.transformer_blocks[-1].context_pre_only
    handle = apply_cache(policy.transformer, "fbc", {})
    assert handle.config.threshold == 0.05
    trajectory(policy, inputs, handle)
    handle.remove()
    handle = apply_cache(policy.transformer, "fbc", {"threshold": 0.6})
    trajectory(policy, inputs, handle)
    # The head block always runs; on a reused step only the last (context_pre_only) block is skipped.
    by_block = handle.stats_by_module
    assert by_block["transformer_blocks.0"] == dict(computed=STEPS, skipped=0)
    assert by_block["transformer_blocks.1"]["skipped"] > 0
    handle.remove()


def test_fora_interval_two_recomputes_every_other_step(policy, inputs):
    handle = apply_cache(policy.transformer, "fora", {"interval": 2})
    blocks = len(handle.stats_by_module)
    per_step = []

    def record(step):
        per_step.append((handle.stats["computed"], handle.stats["skipped"]))
        handle.reset_stats()

    trajectory(policy, inputs, handle, after_step=record)
    assert per_step == [(blocks, 0), (0, blocks), (blocks, 0), (0, blocks), (blocks, 0)]
    handle.remove()


def computed_steps(policy, inputs, name, options) -> list[int]:
    """The steps of a trajectory on which every block computed (the others reused every block)."""
    handle = apply_cache(policy.transformer, name, options)
    blocks, steps = len(handle.stats_by_module), []

    def record(step):
        computed, skipped = handle.stats["computed"], handle.stats["skipped"]
        assert (computed, skipped) in ((blocks, 0), (0, blocks))
        if computed:
            steps.append(step)
        handle.reset_stats()

    trajectory(policy, inputs, handle, after_step=record)
    handle.remove()
    return steps


def test_fora_counts_its_interval_from_the_last_step_as_the_public_code_does(policy, inputs):
    """FORA's code counts steps down, i = T-1 .. 0, and computes where i = T-1 or i % N == 0: for T = 5, N = 3 the
    steps 0, 1 and 4 (i = 4, 3, 0). Without the step count the harness counts up: steps 0 and 3."""
    assert computed_steps(policy, inputs, "fora", {"interval": 3, "trajectory_steps": STEPS}) == [0, 1, 4]
    assert computed_steps(policy, inputs, "fora", {"interval": 3}) == [0, 3]
    # where T - 1 is a multiple of N the two schedules are one
    assert computed_steps(policy, inputs, "fora", {"interval": 2, "trajectory_steps": STEPS}) == [0, 2, 4]


def test_teacache_always_computes_the_first_and_the_last_step(policy, inputs):
    """TeaCache's code computes its first and last steps whatever the change; in between, no change reaches a
    threshold of 1e6."""
    assert computed_steps(policy, inputs, "teacache", {"threshold": 1e6, "trajectory_steps": STEPS}) == [0, STEPS - 1]
    assert computed_steps(policy, inputs, "teacache", {"threshold": 1e6}) == [0]


def count_block_runs(policy) -> dict[str, int]:
    """Independent evidence of which blocks ran: calls of each block's attention layer."""
    runs = {}
    for list_name in ("transformer_blocks", "single_transformer_blocks"):
        for index, block in enumerate(getattr(policy.transformer, list_name, [])):
            name = f"{list_name}.{index}"
            runs[name] = 0

            def bump(module, args, name=name):
                runs[name] += 1

            block.attn.register_forward_pre_hook(bump)
    return runs


def four_blocks(family: str) -> dict:
    """Transformer options that give a family four blocks (FLUX's num_layers counts double and single)."""
    return {"num_layers": 2} if family == "flux" else {"num_layers": 4}


@pytest.mark.parametrize("extrapolate_from", ["calls", "computed"])
def test_fastercache_extrapolates_from_computed_outputs_as_the_public_code_does(policy, inputs, extrapolate_from):
    """A reused attention call returns last + (last - second to last) * w. The public FasterCache code
    (github.com/Vchitect/FasterCache, scripts/latte/fastercache_sample_latte.py) caches computed outputs
    only; diffusers caches every call's output, so from the third reuse on it extrapolates from an
    extrapolated one. Every second call computes here: calls 0, 2, 4 compute, 1, 3, 5 reuse."""
    weight = 0.3
    handle = apply_cache(policy.transformer, "fastercache", {
        "spatial_attention_timestep_skip_range": [-1000, 2000], "attention_weight": weight,
        "extrapolate_from": extrapolate_from})
    outputs: list[tuple[torch.Tensor, ...]] = []
    recorder = policy.transformer.transformer_blocks[0].attn.register_forward_hook(
        lambda module, args, output: outputs.append(output if isinstance(output, tuple) else (output,)))
    latents, cond = inputs
    timesteps = policy.timestep_values(torch.linspace(1.0, 0.0, 7))
    for step in range(6):
        handle.begin_step(step, float(timesteps[step]))
        with torch.no_grad():
            policy.velocity(latents, timesteps[step].expand(latents.shape[0]), cond)
    recorder.remove()
    assert handle.stats_by_module["transformer_blocks.0.attn"] == dict(computed=3, skipped=3)

    def extrapolated(last, before):
        return tuple(a + (a - b) * weight for a, b in zip(last, before))

    o = outputs
    assert_all_equal(list(o[1]), list(o[0]))  # nothing but the first output to extrapolate from
    assert_all_equal(list(o[3]), list(extrapolated(o[2], o[0])))
    public, diffusers = extrapolated(o[4], o[2]), extrapolated(o[4], o[3])
    assert_all_equal(list(o[5]), list(public if extrapolate_from == "computed" else diffusers))
    assert not all(torch.allclose(a, b) for a, b in zip(public, diffusers))
    handle.remove()
    assert_hook_free(policy.transformer)


@pytest.mark.parametrize("family", FAMILIES)
def test_deltadit_skips_exactly_the_given_block_range(inputs, family):
    # Four blocks: SD3 and Qwen-Image with four joint blocks; FLUX with two double and two single blocks.
    policy = make_policy(family, **four_blocks(family))
    names = [f"transformer_blocks.{i}" for i in range(4)] if family != "flux" else \
        ["transformer_blocks.0", "transformer_blocks.1", "single_transformer_blocks.0", "single_transformer_blocks.1"]
    runs = count_block_runs(policy)
    handle = apply_cache(policy.transformer, "deltadit", {"block_range": [1, 3], "interval": 2})
    trajectory(policy, inputs, handle)
    skipped = {name: counts["skipped"] for name, counts in handle.stats_by_module.items()}
    assert skipped == {names[0]: 0, names[1]: 2, names[2]: 2, names[3]: 0}  # steps 1 and 3
    assert runs == {name: counts["computed"] for name, counts in handle.stats_by_module.items()}
    handle.remove()


@pytest.mark.parametrize("family", FAMILIES)
def test_deltadit_reuses_rear_blocks_early_and_front_blocks_late(inputs, family):
    policy = make_policy(family, **four_blocks(family))
    handle = apply_cache(policy.transformer, "deltadit", {"interval": 2, "boundary": 2})
    per_step = []

    def record(step):
        per_step.append([counts["skipped"] for counts in handle.stats_by_module.values()])
        handle.reset_stats()

    trajectory(policy, inputs, handle, after_step=record)
    # Front run: the first two blocks; rear run: the last two. Step 1 < boundary reuses the rear run,
    # step 3 >= boundary the front run; even steps compute everything.
    assert per_step == [[0, 0, 0, 0], [0, 0, 1, 1], [0, 0, 0, 0], [1, 1, 0, 0], [0, 0, 0, 0]]
    handle.remove()


def test_deltadit_rejects_ranges_that_do_not_fit(policy):
    with pytest.raises(ConfigError) as err:
        apply_cache(policy.transformer, "deltadit", {"block_range": [0, 9]})
    assert err.value.key == "method.block_range"
    with pytest.raises(ConfigError) as err:
        apply_cache(policy.transformer, "deltadit", {"num_blocks": 2})
    assert err.value.key == "method.num_blocks"
    assert_hook_free(policy.transformer)


def test_magcache_follows_given_ratios(policy, inputs):
    # Ratios far from 1 make the accumulated error exceed the threshold at once: nothing is reused.
    handle = apply_cache(policy.transformer, "magcache", {"mag_ratios": [1.0, 2.0, 2.0, 2.0, 2.0]})
    trajectory(policy, inputs, handle)
    assert handle.stats["skipped"] == 0
    handle.remove()
    handle = apply_cache(policy.transformer, "magcache", {"mag_ratios": "flux", "num_inference_steps": STEPS})
    trajectory(policy, inputs, handle)
    handle.remove()
    # the preset names the config accepts (configs.py, no diffusers) are the tables the hook has
    assert set(PRESET_RATIOS) == set(MAGCACHE_PRESETS)


@pytest.mark.parametrize("name", NAMES)
def test_training_forward_and_backward_every_step(policy, inputs, name):
    policy.transformer.train()
    handle = apply_cache(policy.transformer, name, REUSING[name])
    for _ in range(2):  # a second trajectory must backpropagate as well
        handle.reset()
        policy.transformer.zero_grad()
        trajectory(policy, inputs, handle, train=True)
        assert handle.stats["skipped"] > 0
        grads = [p.grad for p in policy.transformer.parameters() if p.grad is not None]
        assert grads and all(torch.isfinite(g).all() for g in grads)
    handle.remove()


@pytest.mark.parametrize("name", NAMES)
def test_training_without_detach_reaches_a_freed_graph(policy, inputs, name):
    handle = apply_cache(policy.transformer, name, REUSING[name])
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        trajectory(policy, inputs, handle, train=True, detach=False)
    handle.remove()


def test_gradient_checkpointing_is_refused(policy, inputs):
    policy.transformer.enable_gradient_checkpointing()
    with pytest.raises(UserError, match="gradient checkpointing"):
        apply_cache(policy.transformer, "fora", {})
    policy.transformer.disable_gradient_checkpointing()
    handle = apply_cache(policy.transformer, "fora", {})
    policy.transformer.enable_gradient_checkpointing()
    with pytest.raises(UserError, match="gradient checkpointing"):
        handle.begin_step(0, 1.0)
    handle.remove()


def test_config_errors_name_the_key(policy):
    with pytest.raises(ConfigError) as err:
        apply_cache(policy.transformer, "deepcache", {})
    assert err.value.key == "method.cache"
    with pytest.raises(ConfigError) as err:
        apply_cache(policy.transformer, "fora", {"intervall": 2})
    assert err.value.key == "method.intervall"
    with pytest.raises(ConfigError) as err:
        apply_cache(policy.transformer, "fora", {"interval": 0})
    assert err.value.key == "method.interval"
    with pytest.raises(ConfigError) as err:
        apply_cache(policy.transformer, "pab", {"current_timestep_callback": None})
    assert err.value.key == "method.current_timestep_callback"
    assert "current_step_callback" not in cache_options("teacache")
    for name in ("pab", "fastercache"):  # the spatial-attention options both share
        for options, key in (({"spatial_attention_block_skip_range": 0}, "spatial_attention_block_skip_range"),
                             ({"spatial_attention_timestep_skip_range": [1]}, "spatial_attention_timestep_skip_range")):
            with pytest.raises(ConfigError) as err:
                apply_cache(policy.transformer, name, options)
            assert err.value.key == f"method.{key}", name
    assert_hook_free(policy.transformer)


def test_usage_errors(policy, inputs):
    handle = apply_cache(policy.transformer, "fora", {})
    with pytest.raises(UserError, match="already has an inference cache"):
        apply_cache(policy.transformer, "teacache", {})
    latents, cond = inputs
    with pytest.raises(UserError, match="begin_step"):
        policy.velocity(latents, torch.ones(2), cond)
    with pytest.raises(UserError, match="one timestep"):
        handle.begin_step(0, torch.tensor([1.0, 0.5]))
    handle.remove()
    handle.remove()
    with pytest.raises(UserError, match="removed"):
        handle.begin_step(0, 1.0)
    assert_hook_free(policy.transformer)


@pytest.mark.parametrize("name, key, empty, nonempty", [
    ("pab", "spatial_attention_timestep_skip_range", [800, 100], [100, 800]),
    ("pab", "spatial_attention_timestep_skip_range", [400, 400], [400, 401]),
    ("fastercache", "spatial_attention_timestep_skip_range", [681, -1], [-1, 681]),
    ("taylorseer", "disable_cache_after_step", 2, 6),
    ("taylorseer", "disable_cache_after_step", 5, 6),
])
def test_options_that_leave_nothing_to_reuse_are_refused(name, key, empty, nonempty):
    # an empty interval of timesteps, or of steps after TaylorSeer's warm-up (5 here): the cache would never
    # reuse, and its run would time no cache
    fixed = {"disable_cache_before_step": 5} if name == "taylorseer" else {}
    with pytest.raises(ConfigError) as err:
        make_config(name, {**fixed, key: empty})
    assert (err.value.key, err.value.value) == (f"method.{key}", empty)
    assert getattr(make_config(name, {**fixed, key: nonempty}), key) == (
        tuple(nonempty) if isinstance(nonempty, list) else nonempty)


def test_taylorseer_without_warm_up_predicts_only_after_a_computed_step(inputs):
    # with no warm-up step and an interval above 1, the first call of each layer would predict from Taylor
    # factors that nothing has gathered (diffusers raises mid-rollout): refused when the options are typed
    with pytest.raises(ConfigError) as err:
        make_config("taylorseer", {"disable_cache_before_step": 0, "cache_interval": 2})
    assert (err.value.key, err.value.value) == ("method.disable_cache_before_step", 0)
    # the edges that are allowed run a whole trajectory: no warm-up with interval 1 (never predicts), and one
    # warm-up step with the longest interval (the first step computes, the others predict)
    policy = make_policy("sd3")
    for options, skips in (({"disable_cache_before_step": 0, "cache_interval": 1}, False),
                           ({"disable_cache_before_step": 1, "cache_interval": 1000}, True)):
        handle = apply_cache(policy.transformer, "taylorseer", options)
        trajectory(policy, inputs, handle)
        assert (handle.stats["skipped"] > 0) == skips and handle.stats["computed"] > 0, options
        handle.remove()


# FORA's `reuse: branches`, checked against the public rule (prathebaselva/FORA, src/models.py) written here in
# float64: a reused block returns its input plus, per stream, each branch output recorded (before its adaLN gate)
# at the last computed step times that branch's gate of the current step. The gates are read from each adaLN
# layer's own projection of temb, in diffusers' chunk order: (shift, scale, gate) for the attention, then for the
# MLP, then (SD3.5's SD35AdaLayerNormZeroX) for the second attention.
ADALN_GATES = {"msa": 2, "mlp": 5, "msa2": 8}


def adaln_gate(norm, temb, name: str) -> torch.Tensor:
    emb = norm.linear(torch.nn.functional.silu(temb))
    return emb.chunk(emb.shape[1] // temb.shape[1], dim=1)[ADALN_GATES[name]].unsqueeze(1)


def public_fora_reuse(block, inputs: dict, stored: dict) -> tuple:
    """``(image stream, text stream)`` a reused block returns under the public rule."""
    h, e, temb = inputs["hidden_states"], inputs["encoder_hidden_states"], inputs["temb"]
    if hasattr(block, "proj_out"):  # FLUX single block: gate * proj_out(cat(attn, mlp)) on the joined tokens
        joint = torch.cat([e, h], dim=1) + adaln_gate(block.norm, temb, "msa") * stored["proj_out"]
        return joint[:, e.shape[1]:], joint[:, :e.shape[1]]
    h = h + adaln_gate(block.norm1, temb, "msa") * stored["attn"][0]
    if getattr(block, "attn2", None) is not None:
        h = h + adaln_gate(block.norm1, temb, "msa2") * stored["attn2"]
    h = h + adaln_gate(block.norm1, temb, "mlp") * stored["ff"]
    if getattr(block, "context_pre_only", False):
        return h, None
    e = e + adaln_gate(block.norm1_context, temb, "msa") * stored["attn"][1]
    return h, e + adaln_gate(block.norm1_context, temb, "mlp") * stored["ff_context"]


BRANCH_FAMILIES = {"sd3": {"dual_attention_layers": (0,)}, "flux": {}}  # SD3.5's second attention in block 0


@pytest.mark.parametrize("family", BRANCH_FAMILIES)
def test_fora_branches_reuse_is_the_public_rule_in_float64(inputs, family):
    from baselines.caches.blocks import block_argument

    policy = make_policy(family, **BRANCH_FAMILIES[family])
    policy.transformer.double()
    latents, cond = inputs
    inputs64 = latents.double(), cond.to(dtype=torch.float64)
    blocks = [b for name in ("transformer_blocks", "single_transformer_blocks")
              for b in getattr(policy.transformer, name, [])]
    seen = {"inputs": [], "outputs": [], "stored": {}, "computed": []}  # per block call, in order
    steps: list[int] = []

    def keep_inputs(block, args, kwargs):
        seen["inputs"].append({name: block_argument(block, name, args, kwargs)
                               for name in ("hidden_states", "encoder_hidden_states", "temb")})

    def keep_output(block, args, kwargs, output):
        seen["outputs"].append((block, output[1], output[0]))

    def keep_branch(index, name):
        def hook(module, args, output):
            seen["stored"].setdefault(index, {})[name] = output
            seen["computed"].append((index, len(steps)))
        return hook

    for index, block in enumerate(blocks):
        block.register_forward_pre_hook(keep_inputs, with_kwargs=True)
        block.register_forward_hook(keep_output, with_kwargs=True)
        for name in ("attn", "attn2", "ff", "ff_context", "proj_out"):
            if getattr(block, name, None) is not None:
                getattr(block, name).register_forward_hook(keep_branch(index, name))
    if family == "sd3":
        assert blocks[0].attn2 is not None and blocks[-1].context_pre_only
    handle = apply_cache(policy.transformer, "fora", {"interval": 2, "reuse": "branches"})
    reused_calls = 0
    last_computed: dict[int, dict] = {}  # block index -> its branch outputs at the last step it computed

    def check(step):
        nonlocal reused_calls
        computes = step % 2 == 0
        calls = list(zip(seen["inputs"], seen["outputs"]))
        assert len(calls) == len(blocks)
        for index, (block_inputs, (block, h_out, e_out)) in enumerate(calls):
            assert ((index, step) in seen["computed"]) == computes
            if computes:
                last_computed[index] = seen["stored"].pop(index)
                continue
            assert index not in seen["stored"]
            h_ref, e_ref = public_fora_reuse(block, block_inputs, last_computed[index])
            torch.testing.assert_close(h_out, h_ref, rtol=1e-13, atol=1e-13)
            if e_ref is None:
                assert e_out is None
            else:
                torch.testing.assert_close(e_out, e_ref, rtol=1e-13, atol=1e-13)
            reused_calls += 1
        seen["inputs"].clear()
        seen["outputs"].clear()
        steps.append(step)

    trajectory(policy, inputs64, handle, after_step=check)
    assert steps == list(range(STEPS)) and reused_calls == 2 * len(blocks)  # steps 1 and 3
    assert handle.stats == dict(computed=3 * len(blocks), skipped=2 * len(blocks), hit_rate=0.4)
    handle.remove()


@pytest.mark.parametrize("family", BRANCH_FAMILIES)
def test_fora_branches_differ_from_the_residual_by_the_change_of_the_gates(inputs, family):
    """The two rules compute on the same steps and agree where they compute; on a reused step the velocity differs
    (the gates of a random model change with the timestep)."""
    policy = make_policy(family, **BRANCH_FAMILIES[family])
    assert computed_steps(policy, inputs, "fora", {"interval": 3, "reuse": "branches", "trajectory_steps": STEPS}) \
        == [0, 1, 4]
    assert computed_steps(policy, inputs, "fora", {"interval": 3, "reuse": "branches"}) == [0, 3]
    runs = {}
    for reuse in ("residual", "branches"):
        handle = apply_cache(policy.transformer, "fora", {"interval": 2, "reuse": reuse})
        runs[reuse] = trajectory(policy, inputs, handle)
        handle.remove()
    residual, branches = runs["residual"], runs["branches"]
    assert torch.equal(residual[0], branches[0])
    assert (residual[1] - branches[1]).abs().max() > 1e-4


@pytest.mark.parametrize("family", BRANCH_FAMILIES)
def test_fora_branches_train_and_detach(inputs, family):
    policy = make_policy(family, **BRANCH_FAMILIES[family])
    handle = apply_cache(policy.transformer, "fora", {"interval": 2, "reuse": "branches"})
    trajectory(policy, inputs, handle, train=True)
    grads = [p.grad for p in policy.transformer.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(g).all() for g in grads)
    handle.reset()
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        trajectory(policy, inputs, handle, train=True, detach=False)
    handle.remove()


def test_fora_branches_refuse_qwenimage():
    policy = make_policy("qwenimage")
    with pytest.raises(ConfigError) as err:
        apply_cache(policy.transformer, "fora", {"reuse": "branches"})
    assert (err.value.key, err.value.value) == ("method.reuse", "branches")
    assert "\n" not in str(err.value)
    assert_hook_free(policy.transformer)


def test_fora_branches_refuse_a_feed_forward_run_in_chunks(inputs):
    """A chunked feed-forward is called once per chunk: its branch output is no single call's."""
    policy = make_policy("sd3")
    policy.transformer.transformer_blocks[0].set_chunk_feed_forward(8, dim=1)
    handle = apply_cache(policy.transformer, "fora", {"reuse": "branches"})
    with pytest.raises(UserError, match="one call of 'ff'"):
        trajectory(policy, inputs, handle)
    handle.remove()


def taylorseer_public_steps(first_enhance: int, fresh_threshold: int, steps: int) -> list[int]:
    """The steps TaylorSeer's code computes in full (its ``cal_type``): every step below ``first_enhance``,
    then a step whenever ``fresh_threshold - 1`` steps have predicted since the last computed one."""
    computed, counter = [], 0
    for step in range(steps):
        if step < first_enhance or counter == fresh_threshold - 1:
            computed.append(step)
            counter = 0
        else:
            counter += 1
    return computed


@pytest.mark.parametrize("before, interval", [(3, 6), (1, 3), (2, 2), (3, 3)])
def test_taylorseer_public_schedule_computes_the_steps_of_its_code(before, interval):
    options = {"disable_cache_before_step": before, "cache_interval": interval, "schedule": "public"}
    config = make_config("taylorseer", options)
    # TaylorSeer-FLUX's setting (first_enhance 3, fresh_threshold 6, 50 steps) and smaller ones
    assert [s for s in range(50) if config.computes(s)] == taylorseer_public_steps(before, interval, 50)


def test_taylorseer_public_schedule_decides_every_attention_layer(policy, inputs):
    # one warm-up step, interval 3: the public code computes steps 0 and 3, diffusers' rule steps 0 and 2
    options = {"disable_cache_before_step": 1, "cache_interval": 3}
    assert computed_steps(policy, inputs, "taylorseer", {**options, "schedule": "public"}) == [0, 3]
    assert computed_steps(policy, inputs, "taylorseer", options) == [0, 2]
