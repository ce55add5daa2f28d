"""The Monte-Carlo Fisher: ``GGNOperator(..., mc_samples=k)`` replaces the loss Hessian by
the mean outer product of loss gradients at targets drawn from the model's predictive
distribution (NOTE [sampled targets] in ``operators.ggn``). Checked against dense float64
references: the sampled product's algebra exactly, its expectation statistically."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hessian_eigenthings.loss_fns import (
    BCEWithLogitsOutputLoss,
    CrossEntropyOutputLoss,
    MSEOutputLoss,
    supervised_forward,
    supervised_loss_of_output,
)
from hessian_eigenthings.operators import GGNOperator
from hessian_eigenthings.operators.engines import EngineUnsupportedError
from hessian_eigenthings.param_utils import select_parameters
from tests.conftest import classification_data, mlp
from tests.operators.curvature_oracles import dense_ggn


def _regression_data(kind: str, n: int = 10, batch: int = 4) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(7)
    X = torch.randn(n, 5, generator=g, dtype=torch.float64)
    Y = torch.randn(n, 3, generator=g, dtype=torch.float64)
    if kind == "bce":
        Y = (Y > 0).double()
    return [(X[i : i + batch], Y[i : i + batch]) for i in range(0, n, batch)]


CASES = {
    "ce": (nn.CrossEntropyLoss(), lambda: classification_data(n=10, batch=4)),
    "mse": (nn.MSELoss(), lambda: _regression_data("mse")),
    "bce": (nn.BCEWithLogitsLoss(), lambda: _regression_data("bce")),
}


def _outer_reference(loss: object, output: torch.Tensor, grads: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """``w · mean_s g_s g_sᵀ u`` with the outer products formed per sample, densely."""
    k = grads.shape[0]
    if isinstance(loss, CrossEntropyOutputLoss):
        n = output.numel() // output.shape[1] if output.dim() > 1 else 1
        g = grads.movedim(2, -1).reshape(k, -1, output.shape[1]) if output.dim() > 1 else grads.unsqueeze(1)
        U = u.movedim(2, -1).reshape(u.shape[0], -1, output.shape[1]) if output.dim() > 1 else u.unsqueeze(1)
        H = torch.einsum("src,srd->rcd", g, g) / k / n  # (rows, C, C)
        out = torch.einsum("rcd,mrd->mrc", H, U)
        if output.dim() > 2:
            shape = (u.shape[0], output.shape[0], *output.shape[2:], output.shape[1])
            return out.reshape(shape).movedim(-1, 2)
        return out.reshape(u.shape)
    w = 1.0 / output.numel()
    return u * (grads * grads).mean(0) * w


@pytest.mark.parametrize("shape", [(6, 4), (3, 4, 5)])
def test_cross_entropy_sampled_product_is_the_mean_outer_product(shape: tuple[int, ...]) -> None:
    loss = CrossEntropyOutputLoss()
    g = torch.Generator().manual_seed(0)
    output = torch.randn(*shape, generator=g, dtype=torch.float64)
    y = torch.randint(0, shape[1], (shape[0], *shape[2:]), generator=g)
    batch = (None, y)
    grads = loss.sample_grads(output, batch, 7, torch.Generator().manual_seed(1))
    assert grads.shape == (7, *shape)
    # each draw is softmax minus a one-hot: rows sum to zero, one entry per row below zero
    torch.testing.assert_close(grads.sum(2), torch.zeros_like(grads.sum(2)), atol=1e-12, rtol=0)
    u = torch.randn(3, *shape, generator=g, dtype=torch.float64)
    torch.testing.assert_close(loss.sampled_hvp(output, batch, grads, u), _outer_reference(loss, output, grads, u))


@pytest.mark.parametrize("loss", [MSEOutputLoss(), BCEWithLogitsOutputLoss()], ids=["mse", "bce"])
def test_elementwise_sampled_product_is_the_mean_outer_product(loss: object) -> None:
    g = torch.Generator().manual_seed(0)
    output = torch.randn(6, 3, generator=g, dtype=torch.float64)
    batch = (None, torch.rand(6, 3, generator=g, dtype=torch.float64))
    grads = loss.sample_grads(output, batch, 5, torch.Generator().manual_seed(1))  # type: ignore[attr-defined]
    u = torch.randn(2, 6, 3, generator=g, dtype=torch.float64)
    torch.testing.assert_close(loss.sampled_hvp(output, batch, grads, u), _outer_reference(loss, output, grads, u))  # type: ignore[attr-defined]


@pytest.mark.parametrize("name", list(CASES))
def test_sampled_gradients_average_to_the_output_hessian(name: str) -> None:
    """E[g gᵀ] over the model's own targets is the output Hessian of the negative log-likelihood."""
    criterion, _ = CASES[name]
    loss = supervised_loss_of_output(criterion)
    g = torch.Generator().manual_seed(3)
    output = torch.randn(3, 4, generator=g, dtype=torch.float64)
    y = torch.randint(0, 4, (3,), generator=g) if name == "ce" else torch.rand(3, 4, generator=g, dtype=torch.float64)
    batch = (None, y)
    exact = torch.func.jacrev(torch.func.jacrev(lambda o: loss(o, batch)))(output).reshape(12, 12)
    grads = loss.sample_grads(output, batch, 100_000, torch.Generator().manual_seed(4))  # type: ignore[attr-defined]
    eye = torch.eye(12, dtype=torch.float64).reshape(12, 3, 4)
    sampled = loss.sampled_hvp(output, batch, grads, eye).reshape(12, 12)  # type: ignore[attr-defined]
    assert float((sampled - exact).norm() / exact.norm()) < 0.03


@pytest.mark.parametrize("name", list(CASES))
def test_mc_fisher_approaches_the_ggn(name: str) -> None:
    criterion, make_data = CASES[name]
    model, data = mlp(), make_data()
    loss = supervised_loss_of_output(criterion)
    exact = dense_ggn(model, data, supervised_forward, loss, select_parameters(model))
    errors = []
    for k in (4, 4000):
        op = GGNOperator(model, data, supervised_forward, loss, mc_samples=k, seed=1)
        dense = op.to_dense()
        torch.testing.assert_close(dense, dense.T, rtol=1e-10, atol=1e-12)  # symmetric by construction
        assert float(torch.linalg.eigvalsh(dense).min()) > -1e-10  # positive semi-definite
        errors.append(float((dense - exact).norm() / exact.norm()))
    assert errors[1] < 0.08 and errors[1] < errors[0] / 4


@pytest.mark.parametrize("reuse", [True, False])
def test_one_fixed_reproducible_matrix(reuse: bool) -> None:
    """The draws are seeded per chunk of a pass: every product of an operator uses the same
    ones (kept state or not, microbatched or not), a second operator with the same seed gives
    the same matrix, another seed another one, and the global random state is not touched."""
    model, data = mlp(), classification_data(n=10, batch=4)
    loss = supervised_loss_of_output(nn.CrossEntropyLoss())
    v = torch.randn(sum(p.numel() for p in model.parameters()), dtype=torch.float64)
    state = torch.get_rng_state()
    op = GGNOperator(model, data, supervised_forward, loss, mc_samples=3, seed=5, graph_reuse=reuse)
    first = op @ v
    torch.testing.assert_close(op @ v, first, rtol=0, atol=0)
    again = GGNOperator(model, data, supervised_forward, loss, mc_samples=3, seed=5, graph_reuse=not reuse)
    torch.testing.assert_close(again @ v, first, rtol=1e-12, atol=1e-14)
    other = GGNOperator(model, data, supervised_forward, loss, mc_samples=3, seed=6, graph_reuse=reuse)
    assert float((other @ v - first).norm()) > 1e-6 * float(first.norm())
    assert torch.equal(torch.get_rng_state(), state)


def test_mc_samples_is_refused_where_it_cannot_run() -> None:
    model, data = mlp(), classification_data(n=10, batch=4)
    loss = supervised_loss_of_output(nn.CrossEntropyLoss())
    with pytest.raises(ValueError, match="mc_samples"):
        GGNOperator(model, data, supervised_forward, lambda o, b: o.square().mean(), loss_hvp="autograd", mc_samples=2)
    for bad in (-1, True, 2.5):
        with pytest.raises(ValueError, match="mc_samples"):
            GGNOperator(model, data, supervised_forward, loss, mc_samples=bad)  # type: ignore[arg-type]
    # a loss that draws with a generator only (no keyed draws) cannot run on a traced engine
    class GeneratorOnly:
        def __init__(self) -> None:
            self.inner = CrossEntropyOutputLoss()

        def __call__(self, output: torch.Tensor, batch: object) -> torch.Tensor:
            return self.inner(output, batch)

        def sample_grads(self, output: torch.Tensor, batch: object, k: int, generator: torch.Generator) -> torch.Tensor:
            return self.inner.sample_grads(output, batch, k, generator)

        def sampled_hvp(self, output: torch.Tensor, batch: object, grads: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
            return self.inner.sampled_hvp(output, batch, grads, u)

    with pytest.raises(EngineUnsupportedError, match="mc_samples"):
        GGNOperator(model, data, supervised_forward, GeneratorOnly(), mc_samples=2, engine="functional")
    auto = GGNOperator(model, data, supervised_forward, GeneratorOnly(), mc_samples=2)
    auto.expect_products(10_000)
    for _ in range(2):  # auto decides at the second product (NOTE [auto engine])
        auto @ torch.randn(auto.size, dtype=torch.float64)
    assert auto.engine == "autograd" and auto.engine_report["auto"]["reason"] != "undecided"


@pytest.mark.parametrize(("name", "engine"), [*((n, "functional") for n in CASES), ("ce", "compiled")])
def test_traced_engines_compute_the_same_matrix(name: str, engine: str) -> None:
    """NOTE [sampled targets as data]: the draws are a function of a per-chunk key handed to
    the traced product as an input, so every engine computes the autograd engine's matrix
    (blocks, an uneven last batch, kept state or not)."""
    criterion, make_data = CASES[name]
    model, data = mlp(), make_data()
    loss = supervised_loss_of_output(criterion)
    ref = GGNOperator(model, data, supervised_forward, loss, mc_samples=3, seed=2, engine="autograd")
    V = torch.randn(ref.size, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    want = ref @ V
    for reuse in (True, False):
        op = GGNOperator(model, data, supervised_forward, loss, mc_samples=3, seed=2, engine=engine, graph_reuse=reuse)
        torch.testing.assert_close(op @ V, want, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(op @ V[:, 0], want[:, 0], rtol=1e-10, atol=1e-12)
        assert op.engine == engine
    # the dense matrix of the traced engine equals the autograd one's: one matrix, not one per engine
    torch.testing.assert_close(op.to_dense(), ref.to_dense(), rtol=1e-10, atol=1e-12)
