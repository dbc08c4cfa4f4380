import copy
import inspect
import math

import pytest
import torch

from agg_bench.config import DEFAULTS, validate
from agg_bench.engine.sampler import flow_sigmas, ode_step, sde_step, stochastic_steps
from agg_bench.errors import ConfigError
from helpers import fresh_seed, gaussian_log_prob, sde_reference, seeded


@pytest.mark.parametrize("kind", ["flow_grpo", "dance_grpo", "cps"])
def test_sde_step_matches_float64_reference(kind):
    gen = torch.Generator().manual_seed(fresh_seed())  # fresh inputs every run
    sigmas = flow_sigmas(12, 3.0)
    b = 5
    v = torch.randn(b, 3, 4, 4, generator=gen, dtype=torch.float64)
    x = torch.randn(b, 3, 4, 4, generator=gen, dtype=torch.float64)
    prev = torch.randn(b, 3, 4, 4, generator=gen, dtype=torch.float64)
    # cps: the step into sigma 0 has std 0 and no density (test_cps_last_step_is_the_euler_step)
    index = torch.tensor([0, 3, 7, 10, 11 if kind != "cps" else 9])
    eta = (0.3 + torch.rand((), generator=gen).item()) * (0.75 if kind == "cps" else 1)
    out = sde_step(kind, v, x, sigmas, index, eta, prev_sample=prev)
    for i in range(b):
        j = int(index[i])
        mean, sd = sde_reference(kind, v[i], x[i], float(sigmas[j]), float(sigmas[j + 1]), eta, float(sigmas[1]))
        logp = gaussian_log_prob(prev[i], mean, sd)
        torch.testing.assert_close(out.mean[i], mean, rtol=1e-12, atol=1e-12)
        assert out.std[i].item() == pytest.approx(sd, rel=1e-12)
        # std_t: the noise level before the step size, std = std_t * sqrt(s_j - s_{j+1})
        assert out.std_t[i].item() == pytest.approx(sd / math.sqrt(float(sigmas[j] - sigmas[j + 1])), rel=1e-12)
        assert out.log_prob[i].item() == pytest.approx(logp.item(), rel=1e-12, abs=1e-12)


@pytest.mark.parametrize("kind", ["flow_grpo", "dance_grpo", "cps"])
def test_sampled_step_log_prob_is_gaussian_density(kind):
    sigmas = flow_sigmas(8, 3.0)
    gen = torch.Generator().manual_seed(seeded(7))
    v = torch.randn(4, 2, 8, 8, dtype=torch.float64)
    x = torch.randn(4, 2, 8, 8, dtype=torch.float64)
    out = sde_step(kind, v, x, sigmas, 2, 0.5, generator=gen)
    dist = torch.distributions.Normal(out.mean, out.std.expand_as(out.mean))
    expected = dist.log_prob(out.prev_sample).mean(dim=(1, 2, 3))
    torch.testing.assert_close(out.log_prob, expected, rtol=1e-12, atol=1e-12)
    # the same draw reproduces from the same generator state
    again = sde_step(kind, v, x, sigmas, 2, 0.5, generator=torch.Generator().manual_seed(seeded(7)))
    assert torch.equal(again.prev_sample, out.prev_sample)


def test_cps_keeps_the_flows_coefficients():
    """Mean and noise together: x' = (1 - s') x0 + s' * (unit-variance mixture of x1 and fresh noise),
    i.e. the squared coefficients of x1 and of the noise add up to s'^2 at every eta."""
    sigmas = flow_sigmas(10, 3.0)
    x0, x1 = torch.randn(1, 2, 4, 4, dtype=torch.float64), torch.randn(1, 2, 4, 4, dtype=torch.float64)
    j = 4
    s, s_next = float(sigmas[j]), float(sigmas[j + 1])
    x = (1 - s) * x0 + s * x1
    v = x1 - x0  # the flow's velocity for this pair
    for eta in (0.1, 0.5, 1.0):
        out = sde_step("cps", v, x, sigmas, j, eta, prev_sample=x)
        c = (out.mean - (1 - s_next) * x0) / x1  # x1's coefficient in the mean
        torch.testing.assert_close(c, torch.full_like(c, c.flatten()[0].item()), rtol=1e-9, atol=1e-12)
        assert c.flatten()[0].item() ** 2 + out.std.flatten()[0].item() ** 2 == pytest.approx(s_next**2, rel=1e-12)


def test_cps_last_step_is_the_euler_step():
    """The step into sigma 0 has no density, so a rollout takes it as an ODE step whatever the mask."""
    sigmas = flow_sigmas(6, 3.0)
    assert stochastic_steps("cps", sigmas).tolist() == [True] * 5 + [False]
    assert stochastic_steps("flow_grpo", sigmas).tolist() == [True] * 6
    v, x = torch.randn(2, 3, 2, 2, dtype=torch.float64), torch.randn(2, 3, 2, 2, dtype=torch.float64)
    out = sde_step("cps", v, x, sigmas, 5, 0.7, prev_sample=x)
    torch.testing.assert_close(out.mean, ode_step(v, x, sigmas, 5), rtol=0, atol=1e-15)
    assert float(out.std.max()) == 0.0


@pytest.mark.parametrize("kind", ["cps", "cps_unscaled"])
@pytest.mark.parametrize("eta", [1.5, 2.0])
def test_cps_refuses_an_eta_above_one(eta, kind):
    sigmas = flow_sigmas(4, 3.0)
    with pytest.raises(ConfigError) as err:
        sde_step(kind, torch.randn(1, 1, 2, 2), torch.randn(1, 1, 2, 2), sigmas, 1, eta)
    assert err.value.key == "sampling.eta"
    with pytest.raises(ConfigError) as err:
        validate({**copy.deepcopy(DEFAULTS), "sampling": {**DEFAULTS["sampling"], "sde": kind, "eta": eta}})
    assert err.value.key == "sampling.eta" and kind in str(err.value)


def test_cps_unscaled_is_the_public_codes_log_probability():
    """``cps_unscaled``: cps's step with Flow-GRPO's ``sde_type = "cps"`` log-probability, -(x' - mean)^2
    averaged over elements (written here from the public code's formula, in float64): the same draws as
    cps, the same mean and std, and a log-probability whose gradient is cps's times 2 std^2."""
    gen = torch.Generator().manual_seed(fresh_seed())  # fresh inputs every run
    sigmas = flow_sigmas(10, 3.0)
    b = 4
    x = torch.randn(b, 3, 4, 4, generator=gen, dtype=torch.float64)
    index = torch.tensor([0, 2, 5, 8])
    eta = 0.2 + 0.8 * torch.rand((), generator=gen).item()
    v = torch.randn(b, 3, 4, 4, generator=gen, dtype=torch.float64)
    seed = int(torch.randint(0, 2**31, (), generator=gen))
    drawn = sde_step("cps_unscaled", v, x, sigmas, index, eta, generator=torch.Generator().manual_seed(seed))
    same = sde_step("cps", v, x, sigmas, index, eta, generator=torch.Generator().manual_seed(seed))
    assert torch.equal(drawn.prev_sample, same.prev_sample) and torch.equal(drawn.mean, same.mean)
    assert torch.equal(drawn.std, same.std)
    prev = drawn.prev_sample
    grads = {}
    for kind in ("cps_unscaled", "cps"):
        w = v.clone().requires_grad_(True)
        out = sde_step(kind, w, x, sigmas, index, eta, prev_sample=prev)
        (grads[kind],) = torch.autograd.grad(out.log_prob.sum(), w)
        if kind == "cps_unscaled":
            for i in range(b):
                j = int(index[i])
                mean, sd = sde_reference("cps", v[i], x[i], float(sigmas[j]), float(sigmas[j + 1]), eta, float(sigmas[1]))
                expected = (-((prev[i] - mean) ** 2)).mean()
                assert out.log_prob[i].item() == pytest.approx(expected.item(), rel=1e-12, abs=1e-15)
                assert out.std[i].item() == pytest.approx(sd, rel=1e-12)
    scale = 2 * same.std**2  # (B, 1, 1, 1)
    torch.testing.assert_close(grads["cps_unscaled"], grads["cps"] * scale, rtol=1e-12, atol=1e-15)
    assert stochastic_steps("cps_unscaled", sigmas).tolist() == stochastic_steps("cps", sigmas).tolist()


def test_float32_inputs_compute_in_float32():
    sigmas = flow_sigmas(4, 3.0)
    out = sde_step("flow_grpo", torch.randn(2, 1, 2, 2), torch.randn(2, 1, 2, 2), sigmas, 1, 0.7)
    assert out.log_prob.dtype == torch.float32


def test_ode_step_is_euler():
    sigmas = flow_sigmas(5, 1.0)
    v, x = torch.randn(2, 3, 2, 2, dtype=torch.float64), torch.randn(2, 3, 2, 2, dtype=torch.float64)
    assert torch.equal(ode_step(v, x, sigmas, 2), x + (sigmas[3] - sigmas[2]) * v)


def test_sigmas_follow_diffusers_schedule():
    s = flow_sigmas(10, 3.0)
    assert s.shape == (11,) and s[0] == 1 and s[-1] == 0
    assert torch.all(s[1:] < s[:-1])


def test_unknown_sde_kind_is_a_config_error():
    from agg_bench.errors import ConfigError

    with pytest.raises(ConfigError, match="sampling.sde"):
        sde_step("ddim", torch.zeros(1, 1, 2, 2), torch.zeros(1, 1, 2, 2), flow_sigmas(3, 1.0), 0, 0.5)


@pytest.mark.parametrize("eta", [0.0, -0.3, float("nan"), float("inf"), True, "0.5"])
def test_sde_step_refuses_an_eta_that_is_not_a_positive_number(eta):
    from agg_bench.errors import ConfigError

    with pytest.raises(ConfigError) as err:
        sde_step("flow_grpo", torch.zeros(1, 1, 2, 2), torch.zeros(1, 1, 2, 2), flow_sigmas(3, 1.0), 1, eta)
    assert err.value.key == "sampling.eta"


def test_the_contract_path_is_the_engine_step():
    # docs/design.md's Python contract: agg_bench.sde.sde_step, the engine's own function object
    import agg_bench.engine.sampler
    import agg_bench.sde

    assert agg_bench.sde.sde_step is agg_bench.engine.sampler.sde_step
    assert agg_bench.sde.__all__ == ["sde_step"]
    # the signature and the result's fields other tools call by name
    params = inspect.signature(agg_bench.sde.sde_step).parameters
    assert list(params) == ["kind", "model_output", "sample", "sigmas", "index", "eta", "prev_sample", "generator"]
    assert params["prev_sample"].default is None and params["generator"].default is None
    x = torch.zeros(1, 1, 2, 2)
    out = agg_bench.sde.sde_step(kind="flow_grpo", model_output=x, sample=x, sigmas=flow_sigmas(3, 1.0), index=1,
                                 eta=0.5, prev_sample=None, generator=torch.Generator().manual_seed(0))
    assert all(isinstance(getattr(out, name), torch.Tensor) for name in ("prev_sample", "log_prob", "mean", "std"))
