"""Counter-based random numbers: a pure function of (key, position), the same eagerly, traced
and compiled, and statistically uniform / normal."""

from __future__ import annotations

import math

import torch
from torch.fx.experimental.proxy_tensor import make_fx

from hessian_eigenthings.loss_fns.counter_rng import counter_normal, counter_uniform


def test_uniform_statistics_and_independence() -> None:
    key = torch.tensor(12345, dtype=torch.int64)
    u = counter_uniform(key, (200_000,))
    assert float(u.min()) > 0.0 and float(u.max()) < 1.0
    # mean 1/2 and variance 1/12 within ~5 standard errors
    assert abs(float(u.mean()) - 0.5) < 5 * math.sqrt(1 / 12 / 200_000)
    assert abs(float(u.var()) - 1 / 12) < 5 * 0.0745 / math.sqrt(200_000)
    counts = torch.histc(u, bins=20, min=0.0, max=1.0)
    chi2 = float(((counts - 10_000) ** 2 / 10_000).sum())
    assert chi2 < 50.0  # 19 degrees of freedom: p ~ 1e-4
    other = counter_uniform(key + 1, (200_000,))
    lagged = torch.corrcoef(torch.stack([u[:-1], u[1:]]))[0, 1]
    across = torch.corrcoef(torch.stack([u, other]))[0, 1]
    assert abs(float(lagged)) < 0.01 and abs(float(across)) < 0.01
    streams = counter_uniform(key, (1000,), stream=1)
    assert not torch.equal(streams, u[:1000])


def test_normal_statistics() -> None:
    z = counter_normal(torch.tensor(7, dtype=torch.int64), (200_000,))
    assert abs(float(z.mean())) < 0.015 and abs(float(z.var()) - 1.0) < 0.015
    assert abs(float((z**4).mean()) - 3.0) < 0.1  # kurtosis of a normal


def test_same_numbers_eager_traced_compiled_and_per_key() -> None:
    key = torch.tensor(99, dtype=torch.int64)
    eager = counter_uniform(key, (3, 50), dtype=torch.float32)
    traced = make_fx(lambda k: counter_uniform(k, (3, 50), dtype=torch.float32))(key)
    torch.testing.assert_close(traced(key), eager, rtol=0, atol=0)
    # the key is an input of the trace, not a constant: another key, other numbers
    torch.testing.assert_close(traced(key + 5), counter_uniform(key + 5, (3, 50), dtype=torch.float32), rtol=0, atol=0)
    compiled = torch.compile(lambda k: counter_uniform(k, (3, 50), dtype=torch.float32), backend="inductor")
    torch.testing.assert_close(compiled(key), eager, rtol=0, atol=0)
    # the global random state is not involved
    state = torch.get_rng_state()
    counter_normal(key, (10,))
    assert torch.equal(torch.get_rng_state(), state)
