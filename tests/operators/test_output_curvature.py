"""The output-curvature axis: a new Fisher variant is one strategy class, and one seed gives
one set of Monte-Carlo draws in the GGN and in KFAC's factor pass."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from hessian_eigenthings.batching import Batch
from hessian_eigenthings.loss_fns import (
    cross_entropy_loss_of_output,
    supervised_forward,
    supervised_per_sample_loss,
)
from hessian_eigenthings.loss_fns.output_curvature import (
    Columns,
    DrawKey,
    Empirical,
    ExactLossHessian,
    MonteCarlo,
    OutputCurvature,
    draw_key,
)
from hessian_eigenthings.operators import (
    EmpiricalFisherOperator,
    GGNOperator,
    KFACOperator,
    KFOCOperator,
)

CE = cross_entropy_loss_of_output()


class DiagonalLossHessian(OutputCurvature):
    """A toy Fisher variant: only the diagonal of the cross-entropy loss Hessian,
    ``diag(p (1 - p)) / N`` per row."""

    def prepare(self, output: torch.Tensor, batch: Batch, key: DrawKey | None) -> torch.Tensor:
        p = torch.softmax(output.detach(), dim=1)
        return p * (1 - p) / output.shape[0]

    def apply(self, state: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        return u * state

    def columns(self, state: torch.Tensor, dtype: torch.dtype) -> tuple[int, Columns]:
        C = state.shape[1]
        eye = torch.eye(C, dtype=state.dtype).unsqueeze(1)  # (C, 1, C): column c at class c
        root = state.sqrt()
        return C, lambda a, b: root * eye[a:b]


def _problem(n_batches: int = 1, same_input: bool = False) -> tuple[nn.Module, list[Any]]:
    torch.manual_seed(0)
    model = nn.Linear(4, 3, bias=False).double()
    x = torch.randn(1, 4, dtype=torch.float64)
    data = [
        (x if same_input else torch.randn(1, 4, dtype=torch.float64), torch.tensor([i % 3]))
        for i in range(n_batches)
    ]
    return model, data


def _oracle(model: nn.Module, data: list[Any], state_of: Any) -> torch.Tensor:
    """``mean_b J_bᵀ H_b J_b`` in float64 from ``torch.func.jacrev`` (one batch = one sample)."""
    params = dict(model.named_parameters())
    total = None
    for x, y in data:
        J = torch.func.jacrev(lambda p, x=x: torch.func.functional_call(model, p, (x,)))(params)
        J = torch.cat([j.reshape(x.shape[0] * 3, -1) for j in J.values()], dim=1)
        H = torch.diag(state_of(model(x).detach(), (x, y)).reshape(-1))
        term = J.T @ H @ J
        total = term if total is None else total + term
    assert total is not None
    return total / len(data)


def test_toy_variant_in_ggn_and_kfac_matches_dense_oracle() -> None:
    model, data = _problem()
    toy = DiagonalLossHessian()
    expected = _oracle(model, data, lambda out, batch: toy.prepare(out, batch, None))
    ggn = GGNOperator(model, data, supervised_forward, CE, curvature=toy).to_dense()
    torch.testing.assert_close(ggn, expected, rtol=1e-12, atol=1e-14)
    # one Linear layer, one sample: KFAC's Kronecker product is exact
    kfac = KFACOperator(model, data, supervised_forward, CE, curvature=toy).to_dense()
    torch.testing.assert_close(kfac, expected, rtol=1e-12, atol=1e-14)
    kfoc = KFOCOperator(model, data, supervised_forward, CE, curvature=toy).to_dense()
    torch.testing.assert_close(kfoc, expected, rtol=1e-10, atol=1e-12)
    # and it is not the GGN: the variant changed the matrix
    exact = GGNOperator(model, data, supervised_forward, CE).to_dense()
    assert not torch.allclose(exact, expected)


def test_one_seed_one_draw_in_ggn_and_kfac() -> None:
    # two batches at positions 0 and 1 with the same input: KFAC's averaged factors are then
    # exactly the mean of the batches' Kronecker products, i.e. the MC GGN with KFAC's draws
    model, data = _problem(n_batches=2, same_input=True)
    kfac = KFACOperator(model, data, supervised_forward, CE, fisher_type="mc", mc_samples=3, seed=7)
    ggn = GGNOperator(model, data, supervised_forward, CE, mc_samples=3, seed=7)
    torch.testing.assert_close(kfac.to_dense(), ggn.to_dense(), rtol=1e-12, atol=1e-14)
    other = GGNOperator(model, data, supervised_forward, CE, mc_samples=3, seed=8).to_dense()
    assert not torch.allclose(kfac.to_dense(), other)


def test_draw_key_is_the_one_derivation() -> None:
    assert draw_key(7, 1) == (7 * 1_000_003 * 1_000_033 + 1) % 2**62
    assert draw_key(7, 1, rank=2) != draw_key(7, 1)
    assert 0 <= draw_key(2**40, 3) < 2**62


def test_empirical_on_the_output_is_the_empirical_fisher() -> None:
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)).double()
    data = [(torch.randn(6, 4, dtype=torch.float64), torch.randint(0, 3, (6,))) for _ in range(2)]
    on_output = GGNOperator(model, data, supervised_forward, CE, curvature=Empirical(CE)).to_dense()
    per_sample = supervised_per_sample_loss(nn.CrossEntropyLoss(reduction="none"))
    ef = EmpiricalFisherOperator(model, data, per_sample).to_dense()
    torch.testing.assert_close(on_output, ef, rtol=1e-10, atol=1e-12)


def test_old_spellings_are_strategies() -> None:
    model, data = _problem()
    assert isinstance(GGNOperator(model, data, supervised_forward, CE).curvature, ExactLossHessian)
    mc = GGNOperator(model, data, supervised_forward, CE, mc_samples=2).curvature
    assert isinstance(mc, MonteCarlo) and mc.samples == 2
    with pytest.raises(ValueError, match="curvature= replaces"):
        GGNOperator(
            model, data, supervised_forward, CE, mc_samples=2, curvature=ExactLossHessian(CE)
        )
    with pytest.raises(TypeError, match="output-curvature strategy"):
        GGNOperator(model, data, supervised_forward, CE, curvature="mc")  # type: ignore[arg-type]


def test_strategy_lets_kfac_take_any_loss() -> None:
    # a loss the factor pass cannot factor on its own: with a curvature= strategy that gives
    # columns, KFAC takes it; without, it is refused with the way out in the message
    model, data = _problem()

    def my_loss(output: torch.Tensor, batch: Batch) -> torch.Tensor:
        return nn.functional.cross_entropy(output, batch[1])

    toy = DiagonalLossHessian()
    expected = _oracle(model, data, lambda out, batch: toy.prepare(out, batch, None))
    kfac = KFACOperator(model, data, supervised_forward, my_loss, curvature=toy).to_dense()
    torch.testing.assert_close(kfac, expected, rtol=1e-12, atol=1e-14)
    with pytest.raises(ValueError, match="curvature= strategy"):
        KFACOperator(model, data, supervised_forward, my_loss)
