"""The memory estimate against analytic counts and measured CPU allocations."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile

import hessian_eigenthings as he
from hessian_eigenthings import memory
from hessian_eigenthings.memory import activation_bytes, estimate_memory


def _mlp(d_in: int = 10, hidden: int = 32, d_out: int = 3) -> nn.Module:
    return nn.Sequential(nn.Linear(d_in, hidden), nn.Tanh(), nn.Linear(hidden, d_out))


def test_activation_count_is_exact_on_a_tiny_mlp() -> None:
    model = _mlp()
    x = torch.randn(64, 10)
    # Linear saves its input (x), tanh its output (h, which the second Linear saves
    # again: same storage, counted once); weights are parameters and do not count
    assert activation_bytes(model, (x, None)) == (64 * 10 + 64 * 32) * 4
    # pow saves its input z as well
    loss = lambda m, b: m(b[0]).pow(2).mean()  # noqa: E731
    assert activation_bytes(model, (x, None), loss) == (64 * 10 + 64 * 32 + 64 * 3) * 4
    assert activation_bytes(model.double(), x.double()) == (64 * 10 + 64 * 32) * 8
    assert all(p.grad is None for p in model.parameters())


def test_factors_and_vectors() -> None:
    model = _mlp()
    batch = (torch.randn(64, 10), torch.randint(0, 3, (64,)))
    loss = he.supervised_loss(nn.CrossEntropyLoss())
    A = activation_bytes(model, batch, loss)
    P = sum(p.numel() for p in model.parameters()) * 4
    est = estimate_memory(model, batch, loss, block_size=1)
    assert (est.activation_bytes, est.parameter_bytes) == (A, P)
    assert est.product_bytes == int(2.5 * A + 3 * P)  # autograd: 2.5 A; input, output, gradient
    est4 = estimate_memory(model, batch, loss, block_size=4, krylov_size=20)
    assert est4.product_bytes == int(7.0 * A + 9 * P)
    assert est4.algorithm_bytes == 20 * P and est4.required_bytes == est4.product_bytes + 20 * P
    fd = estimate_memory(model, batch, loss, method="finite_difference", block_size=4)
    assert fd.product_bytes == int(A + 11 * P)  # blocks are looped: activations once
    ggn = estimate_memory(model, batch, loss, operator="ggn", block_size=2)
    assert ggn.product_bytes == int(3 * A + 5 * P)
    half = estimate_memory(model, batch, loss, microbatch_size=16)
    assert half.activation_bytes == A // 4 and half.batch_size == 16
    f64 = estimate_memory(model, batch, loss, krylov_size=10, work_dtype=torch.float64)
    assert f64.algorithm_bytes == 10 * 2 * P


def test_suggestions_when_it_does_not_fit(monkeypatch: pytest.MonkeyPatch) -> None:
    model = _mlp()
    batch = (torch.randn(64, 10), torch.randint(0, 3, (64,)))
    loss = he.supervised_loss(nn.CrossEntropyLoss())
    monkeypatch.setattr(memory, "available_memory", lambda device: 10_000)
    est = estimate_memory(model, batch, loss, block_size=4)
    assert not est.fits
    tips = " ".join(est.suggestions())
    assert "microbatch_size" in tips and "finite_difference" in tips and "smaller block" in tips
    assert "NOT fit" in est.summary()
    big_basis = estimate_memory(model, batch, loss, krylov_size=1000)
    assert "Krylov" in " ".join(big_basis.suggestions())
    monkeypatch.setattr(memory, "available_memory", lambda device: None)
    assert estimate_memory(model, batch, loss).fits  # unknown free memory: no alarm


def test_available_memory_on_cpu() -> None:
    free = memory.available_memory("cpu")
    assert free is None or free > 0


def test_bad_arguments() -> None:
    model = _mlp()
    batch = torch.randn(4, 10)
    with pytest.raises(ValueError, match="operator"):
        estimate_memory(model, batch, operator="laplacian")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="block_size"):
        estimate_memory(model, batch, block_size=0)
    with pytest.raises(ValueError, match="measure=True"):
        estimate_memory(model, batch, measure=True)


def _peak_cpu_bytes(fn) -> int:  # type: ignore[no-untyped-def]
    """Peak of the CPU allocations during ``fn()`` from torch.profiler's per-op allocation records."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted(
        (e.time_range.start, e.self_cpu_memory_usage)
        for e in prof.events()
        if e.self_cpu_memory_usage
    )
    current = peak = 0
    for _, delta in events:
        current += delta
        peak = max(peak, current)
    return peak


@pytest.mark.parametrize(
    ("operator", "method", "k"),
    [
        ("hessian", "autograd", 1),
        ("hessian", "autograd", 4),
        ("hessian", "finite_difference", 2),
        ("ggn", "autograd", 2),
    ],
)
def test_estimate_against_measured_cpu_peak(operator: str, method: str, k: int) -> None:
    """Within a factor of two of the measured peak of one product (see NOTE [memory factors])."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(32, 128), nn.Tanh(), nn.Linear(128, 128), nn.Tanh(), nn.Linear(128, 10)
    )
    batch = (torch.randn(1024, 32), torch.randint(0, 10, (1024,)))
    crit = nn.CrossEntropyLoss()
    if operator == "hessian":
        op: he.CurvatureOperator = he.HessianOperator(
            model,
            [batch],
            he.supervised_loss(crit),
            method=method,
            graph_reuse=False,  # type: ignore[arg-type]
        )
    else:
        op = he.GGNOperator(
            model,
            [batch],
            he.supervised_forward,
            he.supervised_loss_of_output(crit),
            graph_reuse=False,
        )
    V = torch.randn(op.size, k)
    op @ V  # warm-up: one-time allocations are not part of a product
    measured = _peak_cpu_bytes(lambda: op @ V)
    est = estimate_memory(
        model, batch, he.supervised_loss(crit), operator=operator, method=method, block_size=k
    )  # type: ignore[arg-type]
    assert 0.5 <= measured / est.product_bytes <= 2.0, (measured, est.product_bytes)


def test_a_model_with_blocks_is_told_about_the_layer_walk(monkeypatch: pytest.MonkeyPatch) -> None:
    """When activations dominate and the model has a list of blocks, the suggestions name
    engine='layers' with the blocks' path, and that path runs."""

    class Stack(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Linear(10, 16)
            self.blocks = nn.ModuleList([nn.Linear(16, 16) for _ in range(3)])
            self.head = nn.Linear(16, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.embed(x)
            for b in self.blocks:
                h = torch.tanh(b(h))
            return self.head(h)

    model = Stack()
    batch = (torch.randn(64, 10), torch.randint(0, 3, (64,)))
    loss = he.supervised_loss(nn.CrossEntropyLoss())
    monkeypatch.setattr(memory, "available_memory", lambda device: 10_000)
    est = estimate_memory(model, batch, loss)
    assert est.block_list == "blocks"
    assert "engine='layers', layers='blocks'" in " ".join(est.suggestions())
    he.HessianOperator(model, [batch], loss, engine="layers", layers=est.block_list)
    assert estimate_memory(_mlp(), batch, loss).block_list is None
