"""Moments ``XᵀX`` of the factor pass on their upper block triangle (NOTE [upper block triangle
of a moment] in ``operators.factor_sums``): equal to the full product, against float64."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hessian_eigenthings.loss_fns import supervised_loss_of_output
from hessian_eigenthings.operators import EKFACOperator, KFACOperator, factor_sums
from hessian_eigenthings.operators.factor_sums import WeightedSum, gram_add_, mirror_upper_


@pytest.mark.parametrize(("d", "block"), [(7, 3), (9, 3), (10, 4), (5, 3), (5, 8), (12, 12)])
def test_gram_add_writes_the_upper_blocks_of_the_full_product(d: int, block: int) -> None:
    g = torch.Generator().manual_seed(d)
    X = torch.randn(11, d, generator=g, dtype=torch.float64)
    out = torch.full((d, d), 5.0, dtype=torch.float64)
    whole = gram_add_(out, X, 0.5, block)
    want = 5.0 + 0.5 * X.T @ X
    assert whole == (d < 2 * block)
    upper = torch.triu(torch.ones(d, d, dtype=torch.bool))
    torch.testing.assert_close(out[upper], want[upper], rtol=1e-14, atol=1e-14)
    if not whole:  # the lower blocks were not touched: the products the split saves
        starts = list(range(0, d, block))
        for bi, i in enumerate(starts):
            for j in starts[:bi]:
                assert bool((out[i : i + block, j : j + block] == 5.0).all())
    torch.testing.assert_close(mirror_upper_(out), want, rtol=1e-14, atol=1e-14)


def test_weighted_sum_of_moments_is_the_weighted_mean(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(factor_sums, "GRAM_BLOCK", 2)
    g = torch.Generator().manual_seed(0)
    Xs = [torch.randn(n, 6, generator=g, dtype=torch.float64) for n in (3, 5, 4)]
    weights = [2.0, 0.5, 3.0]
    s = WeightedSum()
    for X, w in zip(Xs, weights, strict=True):
        s.addgram(X, w)
    assert s.upper
    want = sum(w * X.T @ X for X, w in zip(Xs, weights, strict=True)) / 7.0
    got = s.mean(7.0)
    torch.testing.assert_close(got, want, rtol=1e-14, atol=1e-14)
    assert torch.equal(got, got.T)  # mirrored exactly


def test_one_batch_keeps_its_weight_late() -> None:
    """NOTE [factor weights applied late]: one batch's moment is divided by nothing."""
    X = torch.randn(4, 3, dtype=torch.float64)
    s = WeightedSum()
    s.addgram(X, 4.0)
    assert s.scale == 4.0
    torch.testing.assert_close(s.mean(4.0), X.T @ X, rtol=0, atol=0)


def _mlp() -> tuple[nn.Module, list[tuple[torch.Tensor, torch.Tensor]]]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(9, 11), nn.Tanh(), nn.Linear(11, 10)).double()
    g = torch.Generator().manual_seed(1)
    data = [
        (
            torch.randn(n, 9, generator=g, dtype=torch.float64),
            torch.randint(0, 10, (n,), generator=g),
        )
        for n in (5, 3)
    ]
    return model, data


@pytest.mark.parametrize("cls", [KFACOperator, EKFACOperator])
@pytest.mark.parametrize("separate_bias", [True, False])
def test_kronecker_factors_do_not_depend_on_the_blocks(
    monkeypatch: pytest.MonkeyPatch, cls: type, separate_bias: bool
) -> None:
    """Factors with blocks of 2 (every moment split) equal those of one product each, and the
    dense moments of the inputs (float64)."""
    model, data = _mlp()

    def build() -> KFACOperator:
        return cls(  # type: ignore[no-any-return]
            model,
            data,
            lambda m, b: m(b[0]),
            supervised_loss_of_output(nn.CrossEntropyLoss()),
            separate_bias=separate_bias,
        )

    monkeypatch.setattr(factor_sums, "GRAM_BLOCK", 10**6)
    whole = build()
    monkeypatch.setattr(factor_sums, "GRAM_BLOCK", 2)
    split = build()
    for a, b in zip(whole.factors, split.factors, strict=True):
        torch.testing.assert_close(a.G, b.G, rtol=1e-13, atol=1e-15)
        if a.A is not None:
            torch.testing.assert_close(a.A, b.A, rtol=1e-13, atol=1e-15)
            assert torch.equal(b.A, b.A.T)
    # the first layer's A: the inputs' mean moment over the batches, weighted by size
    X = torch.cat([x for x, _ in data])
    if not separate_bias:
        X = torch.cat([X, torch.ones(len(X), 1, dtype=X.dtype)], 1)
    torch.testing.assert_close(split.factors[0].A, X.T @ X / len(X), rtol=1e-13, atol=1e-15)
    if cls is EKFACOperator:
        for a, b in zip(whole.corrected_eigenvalues, split.corrected_eigenvalues, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-14)
