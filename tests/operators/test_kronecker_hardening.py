"""Kronecker-factored operators on the catalogue's hard cases (/work/shared/ADVERSARIAL.md), against
dense float64 references (``torch.kron`` block-diagonals, ``numpy.linalg.eigh``, a factor's spectrum
known by construction) or asserting a clear refusal:

- a singular factor without damping: eigenvalues at the rounding level of zero are zero (NOTE
  [eigenvalues at the rounding level]): ``logdet`` ``-inf``, ``inverse()`` refused, a damping
  below the rounding level exact (``1/λ``, not the inverse of rounding noise);
- factors changed in place after the decompositions were cached (NOTE [factors changed in
  place]): every method equals a freshly built operator's;
- NaN / inf in the data or the parameters: the KFAC family names the layer (NOTE [factors not
  finite]);
- the exact type-2 factor of a wide output warns of its backward count (NOTE [type-2 on a large
  vocabulary]).
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from hessian_eigenthings import EKFACOperator, KFACOperator, KFOCOperator
from hessian_eigenthings._warnings import FactorPassCostWarning
from hessian_eigenthings.loss_fns import (
    cross_entropy_loss_of_output,
    mse_loss_of_output,
    supervised_forward,
)
from hessian_eigenthings.operators.factor_pass import BACKWARDS_WARNING
from hessian_eigenthings.operators.kronecker import (
    KroneckerBlock,
    KroneckerEigenBlock,
    KroneckerOperator,
)
from tests.conftest import classification_data

F64 = torch.float64
CE = cross_entropy_loss_of_output()


def _spd(n: int) -> torch.Tensor:
    B = torch.randn(n, n + 2, dtype=F64)
    return B @ B.T / B.shape[1]


def _orthogonal(n: int) -> torch.Tensor:
    Q: torch.Tensor = torch.linalg.qr(torch.randn(n, n, dtype=F64)).Q
    return Q


# -- a singular factor without damping ---------------------------------------------------------
def _rank_one_op() -> tuple[KroneckerOperator, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    u = torch.randn(4, 1, dtype=F64)
    G, A = u @ u.T, torch.eye(3, dtype=F64)  # G = u uᵀ: three zero eigenvalues
    return (
        KroneckerOperator({"fc.weight": (4, 3)}, [KroneckerBlock(("fc.weight",), "fc", G, A)]),
        G,
        A,
    )


def test_a_singular_factor_has_exactly_zero_eigenvalues_and_logdet_minus_inf() -> None:
    op, G, A = _rank_one_op()
    dense = np.linalg.eigh(torch.kron(G, A).numpy()).eigenvalues
    got = op.eigh().eigenvalues
    # the nonzero eigenvalues as dense linear algebra gives them; the zero ones exactly zero
    # (numpy's are rounding noise of either sign)
    top = np.abs(dense) > 1e-8
    np.testing.assert_allclose(got.numpy()[top], dense[top], rtol=1e-12)
    assert torch.all(got[torch.from_numpy(~top)] == 0)
    assert op.logdet() == -math.inf
    assert torch.isfinite(op.logdet(0.5))


def test_inverse_of_a_singular_operator_without_damping_is_refused() -> None:
    op, _, _ = _rank_one_op()
    with pytest.raises(ValueError, match=r"layer 'fc' \(fc.weight\) is singular.*damping > 0"):
        op.inverse()
    damped = KroneckerOperator(op.layout, op.factors, damping=0.25)  # damped: invertible
    torch.testing.assert_close(
        damped.inverse().to_dense(),
        torch.linalg.inv(op.to_dense() + 0.25 * torch.eye(op.size, dtype=F64)),
        rtol=1e-12,
        atol=1e-12,
    )


@pytest.mark.parametrize("delta", [1e-20, 1e-14])
def test_a_damping_below_the_rounding_level_is_exact(delta: float) -> None:
    """``(K + δI)⁻¹`` and ``log det`` of a singular ``G`` whose spectrum is known by construction:
    ``1/δ`` on the null space (the inverse of rounding noise before)."""
    torch.manual_seed(1)
    Q_G, Q_A = _orthogonal(5), _orthogonal(3)
    lam_G = torch.tensor([0.0, 0.0, 0.5, 1.0, 2.0], dtype=F64)
    lam_A = torch.tensor([0.3, 1.0, 4.0], dtype=F64)
    G, A = Q_G @ torch.diag(lam_G) @ Q_G.T, Q_A @ torch.diag(lam_A) @ Q_A.T
    op = KroneckerOperator({"w": (5, 3)}, [KroneckerBlock(("w",), "fc", G, A)])
    D = lam_G.unsqueeze(1) * lam_A.unsqueeze(0) + delta  # exact eigenvalues of K + δI
    U = torch.kron(Q_G, Q_A)
    reference = U @ torch.diag(1 / D.reshape(-1)) @ U.T
    v = torch.randn(15, dtype=F64)
    got = op.inverse(delta) @ v
    torch.testing.assert_close(got, reference @ v, rtol=1e-9, atol=0)
    torch.testing.assert_close(op.logdet(delta), D.log().sum(), rtol=1e-12, atol=0)


def test_a_block_in_its_eigenbasis_with_eigenvalues_at_the_rounding_level() -> None:
    torch.manual_seed(2)
    D = torch.tensor([[1e-40, 2.0], [3.0, 0.5]], dtype=F64)  # 1e-40: EKFAC's in a null direction
    U_G, U_A = _orthogonal(2), _orthogonal(2)
    op = KroneckerOperator({"w": (2, 2)}, [KroneckerEigenBlock(("w",), D, U_G, U_A)])
    assert op.logdet() == -math.inf
    assert op.eigh().eigenvalues[0] == 0
    with pytest.raises(ValueError, match="singular"):
        op.inverse()


@pytest.mark.parametrize("cls", [KFACOperator, EKFACOperator])
def test_cross_entropy_kfac_without_damping_is_singular(cls: type) -> None:
    """Cross-entropy's ``G`` has the null vector of ones: ``-inf``, and a refused inverse."""
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)).double()
    op = cls(model, classification_data(n=12, d_in=4), supervised_forward, CE)
    assert op.logdet() == -math.inf
    with pytest.raises(ValueError, match=r"inverse\(\) without damping.*singular"):
        op.inverse()
    K = op.to_dense()
    eye = torch.eye(op.size, dtype=F64)
    torch.testing.assert_close(
        op.logdet(1e-3), torch.linalg.slogdet(K + 1e-3 * eye).logabsdet, rtol=1e-10, atol=0
    )


# -- factors changed in place -------------------------------------------------------------------
def _factors() -> list[KroneckerBlock]:
    G_conv = _spd(3)  # shared by a weight and its bias, as KFAC's
    return [
        KroneckerBlock(("conv.weight",), "conv", G_conv, _spd(4)),
        KroneckerBlock(("conv.bias",), "conv", G_conv, torch.ones(1, 1, dtype=F64)),
        KroneckerBlock(("fc.weight", "fc.bias"), "fc", _spd(2), _spd(4)),
    ]


SHAPES = {"conv.weight": (3, 4), "conv.bias": (3,), "fc.weight": (2, 3), "fc.bias": (2,)}
# the flat positions of each block's X (m, q), row-major, written out by hand: conv.weight at
# 0..11, conv.bias at 12..14, fc.weight at 15..20 joined with fc.bias at 21..22 as a last column
POSITIONS = [
    torch.arange(12),
    torch.arange(12, 15),
    torch.tensor([15, 16, 17, 21, 18, 19, 20, 22]),
]


def _dense(blocks: list[KroneckerBlock], damping: float) -> torch.Tensor:
    """``blockdiag(G ⊗ A) + damping·I`` in the flat layout, with ``torch.kron``."""
    K = damping * torch.eye(23, dtype=F64)
    for b, P in zip(blocks, POSITIONS, strict=True):
        K[P.unsqueeze(1), P.unsqueeze(0)] += torch.kron(b.G, b.A)
    return K


def _fresh(blocks: list[KroneckerBlock], damping: float = 0.0) -> KroneckerOperator:
    copies = [KroneckerBlock(b.names, b.module, b.G.clone(), b.A.clone()) for b in blocks]
    return KroneckerOperator(SHAPES, copies, damping=damping)


def _assert_same(op: KroneckerOperator, fresh: KroneckerOperator, v: torch.Tensor) -> None:
    torch.testing.assert_close(op @ v, fresh @ v, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(op.trace(), fresh.trace(), rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(op.frobenius_norm(), fresh.frobenius_norm(), rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(op.logdet(), fresh.logdet(), rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(op.logdet(0.1), fresh.logdet(0.1), rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(
        op.eigh().eigenvalues, fresh.eigh().eigenvalues, rtol=1e-10, atol=1e-12
    )
    torch.testing.assert_close(op.inverse() @ v, fresh.inverse() @ v, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(op.inverse(0.1) @ v, fresh.inverse(0.1) @ v, rtol=1e-10, atol=1e-12)
    # eigenvectors up to sign
    b, i, j = fresh.eigh().locate(-1)
    torch.testing.assert_close(
        op.eigenvector(b, i, j).abs(),
        fresh.eigenvector(b, i, j).abs(),
        rtol=1e-10,
        atol=1e-12,
    )


@pytest.mark.parametrize("damping", [0.0, 0.2])
def test_factors_changed_in_place_are_followed_by_every_method(damping: float) -> None:
    torch.manual_seed(4)
    blocks = _factors()
    op = KroneckerOperator(SHAPES, blocks, damping=damping)
    v = torch.randn(op.size, dtype=F64)
    inverse = op.inverse()  # made before the change: follows it too
    _assert_same(op, _fresh(blocks, damping), v)  # caches filled
    blocks[0].G.mul_(2)  # shared by two blocks
    blocks[2].A.add_(torch.eye(4, dtype=F64))
    fresh = _fresh(blocks, damping)
    _assert_same(op, fresh, v)
    torch.testing.assert_close(inverse @ (op @ v), v, rtol=1e-10, atol=1e-12)
    dense = _dense(blocks, damping)
    torch.testing.assert_close(op.to_dense(), dense, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(
        op.logdet(), torch.linalg.slogdet(dense).logabsdet, rtol=1e-10, atol=0
    )
    torch.testing.assert_close(
        op.inverse() @ v, torch.linalg.solve(dense, v), rtol=1e-10, atol=1e-12
    )


def test_an_eigenbasis_block_changed_in_place_is_followed() -> None:
    torch.manual_seed(5)
    D = torch.rand(3, 2, dtype=F64) + 0.5
    U_G, U_A = _orthogonal(3), _orthogonal(2)
    op = KroneckerOperator({"w": (3, 2)}, [KroneckerEigenBlock(("w",), D, U_G, U_A)])
    before = op.logdet()
    D.mul_(3)
    assert torch.isclose(op.logdet(), before + 6 * math.log(3), rtol=1e-12, atol=0)
    dense = torch.kron(U_G, U_A) @ torch.diag(D.reshape(-1)) @ torch.kron(U_G, U_A).T
    v = torch.randn(6, dtype=F64)
    torch.testing.assert_close(op.inverse() @ v, torch.linalg.solve(dense, v), rtol=1e-10, atol=0)


def test_an_inverse_refuses_once_its_factor_became_singular() -> None:
    torch.manual_seed(6)
    blocks = _factors()
    op = KroneckerOperator(SHAPES, blocks)
    inverse = op.inverse()
    v = torch.randn(op.size, dtype=F64)
    inverse @ v
    u = torch.randn(2, 1, dtype=F64)
    blocks[2].G.copy_(u @ u.T)
    with pytest.raises(ValueError, match=r"layer 'fc' \(fc.weight, fc.bias\) is singular"):
        inverse @ v


def test_inference_mode_factors_are_copied() -> None:
    """Inference tensors keep no version counter: the operator holds a copy, so a change to the
    caller's tensor is seen by no method (the same answers as before it, consistently)."""
    torch.manual_seed(7)
    with torch.inference_mode():
        G, A = _spd(3), _spd(4)
    op = KroneckerOperator({"w": (3, 4)}, [KroneckerBlock(("w",), "fc", G, A)])
    reference = KroneckerOperator(
        {"w": (3, 4)}, [KroneckerBlock(("w",), "fc", G.clone(), A.clone())]
    )
    v = torch.randn(12, dtype=F64)
    torch.testing.assert_close(op.logdet(), reference.logdet())
    with torch.inference_mode():
        G.mul_(5)
    torch.testing.assert_close(op @ v, reference @ v, rtol=0, atol=0)
    torch.testing.assert_close(op.logdet(), reference.logdet(), rtol=0, atol=0)
    torch.testing.assert_close(op.inverse() @ v, reference.inverse() @ v, rtol=0, atol=0)


def test_kfac_factors_changed_in_place_are_followed() -> None:
    """KFAC's factors live in the operator (``op.factors`` hands them out, not copies): a change
    to them is followed as a user's factors are."""
    torch.manual_seed(8)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()
    X = torch.randn(10, 3, dtype=F64)
    data = [(X, torch.randn(10, 2, dtype=F64))]
    op = KFACOperator(model, data, supervised_forward, mse_loss_of_output())
    v = torch.randn(op.size, dtype=F64)
    op.logdet(), op.inverse(0.1) @ v  # caches filled
    op.factors[0].G.mul_(3)
    op.factors[2].A.add_(torch.eye(op.factors[2].A.shape[0], dtype=F64))
    fresh = KroneckerOperator(
        op.layout,
        [KroneckerBlock(b.names, b.module, b.G.clone(), b.A.clone()) for b in op.factors],
    )
    torch.testing.assert_close(op.logdet(0.1), fresh.logdet(0.1), rtol=1e-10, atol=0)
    torch.testing.assert_close(op.inverse(0.1) @ v, fresh.inverse(0.1) @ v, rtol=1e-10, atol=0)
    torch.testing.assert_close(op.eigh().eigenvalues, fresh.eigh().eigenvalues, rtol=1e-10, atol=0)


# -- NaN / inf in the data or the parameters ---------------------------------------------------
class _MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(4, 5), nn.Linear(5, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.fc2(torch.tanh(self.fc1(x)))
        return out


@pytest.mark.parametrize("cls", [KFACOperator, EKFACOperator, KFOCOperator])
def test_nan_in_the_data_names_the_layer(cls: type) -> None:
    torch.manual_seed(10)
    model = _MLP().double()
    data = classification_data(n=8, d_in=4)
    data[1][0][1, 2] = float("nan")
    with pytest.raises(
        ValueError, match=r"factor [AG] of layer 'fc1' is not finite.*check the data"
    ):
        cls(model, data, supervised_forward, CE)


@pytest.mark.parametrize("cls", [KFACOperator, EKFACOperator, KFOCOperator])
@pytest.mark.parametrize("value", [math.inf, math.nan])
def test_inf_in_a_parameter_names_the_layer_and_the_parameter(cls: type, value: float) -> None:
    torch.manual_seed(11)
    model = _MLP().double()
    with torch.no_grad():
        model.fc2.weight[1, 0] = value
    with pytest.raises(
        ValueError,
        match=r"factor G of (the bias of )?layer 'fc1' is not finite.*'fc2.weight' holds NaN/inf",
    ):
        cls(model, classification_data(n=8, d_in=4), supervised_forward, CE)


def test_a_user_factor_with_nan_is_refused_at_its_decomposition() -> None:
    G = _spd(3)
    G[0, 1] = G[1, 0] = math.nan
    op = KroneckerOperator({"w": (3, 2)}, [KroneckerBlock(("w",), "head", G, _spd(2))])
    v = torch.ones(op.size, dtype=F64)
    for method in (op.eigh, op.logdet, lambda: op.inverse(0.1) @ v, lambda: op.inverse()):
        with pytest.raises(
            ValueError, match=r"factor G of layer 'head' is not finite \(NaN or inf\)"
        ):
            method()


# -- the backward count of the exact type-2 factor -----------------------------------------------
def _wide(classes: int) -> tuple[nn.Module, list[tuple[torch.Tensor, torch.Tensor]]]:
    torch.manual_seed(12)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, classes)).double()
    return model, classification_data(n=6, d_in=3, classes=classes, batch=3)


@pytest.mark.parametrize("cls", [KFACOperator, EKFACOperator])
def test_type2_on_a_wide_output_warns_once_with_the_fix(cls: type) -> None:
    model, data = _wide(200)
    assert BACKWARDS_WARNING < 200 // 2
    with pytest.warns(FactorPassCostWarning) as caught:
        cls(model, data, supervised_forward, CE, column_chunk=2)
    assert len(caught) == 1  # once per operator, though EKFAC makes two passes of two batches
    message = str(caught[0].message)
    assert "100 backward passes per batch" in message
    assert "fisher_type='mc'" in message and "'empirical'" in message
    assert caught[0].filename == __file__  # points at the user's line


@pytest.mark.parametrize(
    "classes, kwargs",
    [
        (200, {"column_chunk": 16}),  # 13 backwards a batch
        (200, {"column_chunk": 2, "fisher_type": "mc"}),  # one
        (200, {"column_chunk": 2, "fisher_type": "empirical"}),
        (3, {}),
    ],
)
def test_few_backwards_do_not_warn(classes: int, kwargs: dict[str, Any]) -> None:
    model, data = _wide(classes)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        KFACOperator(model, data, supervised_forward, CE, **kwargs)


def test_a_block_in_its_eigenbasis_with_nan_eigenvalues_is_refused() -> None:
    """No decomposition fails on given eigenvalues: the check of :meth:`_eigen` names the block."""
    D = torch.tensor([[1.0, math.nan]], dtype=F64)
    op = KroneckerOperator(
        {"b": (1, 2)}, [KroneckerEigenBlock(("b",), D, _orthogonal(1), _orthogonal(2))]
    )
    with pytest.raises(ValueError, match=r"eigenvalues of the block over \('b',\) is not finite"):
        op.logdet(0.1)
