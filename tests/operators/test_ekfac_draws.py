"""EK-FAC's Monte-Carlo corrected eigenvalues come from labels drawn afresh, not from the KFAC
pass's (NOTE [fresh draws] in ``operators.factor_pass``): directions outside the span of the
first pass's sampled gradients keep the Fisher's curvature there instead of an exact zero."""

from __future__ import annotations

import torch
from torch import nn

from hessian_eigenthings import EKFACOperator, GGNOperator, KFACOperator
from hessian_eigenthings.loss_fns import cross_entropy_loss_of_output, supervised_forward

F64 = torch.float64


def _problem() -> tuple[nn.Module, list[tuple[torch.Tensor, torch.Tensor]]]:
    """Three samples, ten classes: one draw per sample spans at most three of G's ten
    directions."""
    torch.manual_seed(0)
    model = nn.Linear(4, 10).double()
    g = torch.Generator().manual_seed(2)
    x = torch.randn(3, 4, dtype=F64, generator=g)
    return model, [(x, torch.randint(0, 10, (3,), generator=g))]


def _ekfac(seed: int = 0) -> EKFACOperator:
    model, data = _problem()
    loss = cross_entropy_loss_of_output()
    return EKFACOperator(
        model, data, supervised_forward, loss, fisher_type="mc", mc_samples=1, seed=seed
    )


def test_directions_outside_the_first_draws_keep_their_curvature() -> None:
    op = _ekfac()
    model, data = _problem()
    loss = cross_entropy_loss_of_output()
    kfac = KFACOperator(model, data, supervised_forward, loss, fisher_type="mc", mc_samples=1)
    G = kfac.factors[0].G  # the weight's block (the bias has its own)
    lam_G = torch.linalg.eigvalsh(G)
    outside = lam_G <= 1e-12 * float(lam_G.max())
    assert int(outside.sum()) >= 6  # the first pass's draws span few of G's directions
    lam_A = torch.linalg.eigvalsh(kfac.factors[0].A)
    inputs = lam_A > 1e-12 * float(lam_A.max())  # three samples span three of A's four
    weight = op.eigh().blocks[0]
    # EK-FAC keeps KFAC's eigenbases (ascending): G's null directions, A's spanned ones
    rows, cols = int(outside.sum()), inputs.nonzero().flatten()
    corrected = weight.eigenvalues[:rows][:, cols]
    assert bool((corrected > 1e-8 * float(weight.eigenvalues.max())).all()), corrected
    # and what it estimates is there: the exact GGN is positive in those directions
    ggn = GGNOperator(model, data, supervised_forward, loss).to_dense()
    for i in range(rows):
        for j in cols.tolist():
            v = op.eigenvector(0, i, j)
            assert float(v @ ggn @ v) > 1e-8 * float(ggn.diagonal().max())


def test_fresh_draws_are_a_function_of_the_seed() -> None:
    same = [_ekfac(0).corrected_eigenvalues, _ekfac(0).corrected_eigenvalues]
    other = _ekfac(1).corrected_eigenvalues
    for a, b in zip(*same, strict=True):
        assert torch.equal(a, b)
    assert any(not torch.equal(a, c) for a, c in zip(same[0], other, strict=True))


def test_the_null_space_basis_depends_on_the_span_alone() -> None:
    """NOTE [a canonical basis of the null space]: any basis of a factor's zero eigenspace, as
    another rounding's eigh may return, becomes the same one."""
    from hessian_eigenthings.operators.kronecker_eigen import canonical_null_basis

    g = torch.Generator().manual_seed(4)
    X = torch.randn(3, 8, dtype=F64, generator=g)
    lam, U = torch.linalg.eigh(X.T @ X)  # rank 3: five zero eigenvalues
    lam = torch.where(lam.abs() <= 1e-10 * float(lam.max()), torch.zeros_like(lam), lam)
    assert int((lam == 0).sum()) == 5
    R, _ = torch.linalg.qr(torch.randn(5, 5, dtype=F64, generator=g))
    other = U.clone()
    other[:, :5] = U[:, :5] @ R  # the same span, another basis
    a, b = canonical_null_basis(lam, U), canonical_null_basis(lam, other)
    torch.testing.assert_close(a, b, rtol=0, atol=1e-12)
    torch.testing.assert_close(a[:, 5:], U[:, 5:], rtol=0, atol=0)  # the kept ones untouched
    torch.testing.assert_close(a.T @ a, torch.eye(8, dtype=F64), rtol=0, atol=1e-12)
    assert not torch.allclose(U[:, :5], other[:, :5])
