"""EK-FAC's type-2 corrected eigenvalues on outputs with several rows per sample (a sequence's
positions): the diagonal of the exact GGN in KFAC's eigenbasis (NOTE [EKFAC per sample] in
``operators.kfac``, NOTE [columns row by row] in ``loss_fns.output_curvature``). float64, against
the dense GGN of ``GGNOperator``."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hessian_eigenthings import EKFACOperator, GGNOperator
from hessian_eigenthings.loss_fns import (
    CrossEntropyOutputLoss,
    cross_entropy_loss_of_output,
    mse_loss_of_output,
    supervised_forward,
)

F64 = torch.float64


class Sequence(nn.Module):
    """``(N, T, d)`` inputs; each position's hidden state is the running mean of the earlier
    positions' (so a layer's output at one position reaches every later row of the loss);
    ``classes_first``: outputs ``(N, C, T)`` as cross-entropy reads them, else ``(N, T, C)``."""

    def __init__(self, d: int, h: int, c: int, classes_first: bool) -> None:
        super().__init__()
        self.inp, self.out = nn.Linear(d, h), nn.Linear(h, c)
        self.classes_first = classes_first

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = torch.tanh(self.inp(x))
        steps = torch.arange(1, x.shape[1] + 1, dtype=x.dtype).view(1, -1, 1)
        y = self.out(z.cumsum(1) / steps)
        return y.transpose(1, 2) if self.classes_first else y


def _data(targets: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    out = []
    for n in (3, 4):
        x = torch.randn(n, 5, 3, dtype=F64, generator=g)
        y = (
            torch.randint(0, 3, (n, 5), generator=g)
            if targets == "classes"
            else torch.randn(n, 5, 3, dtype=F64, generator=g)
        )
        out.append((x, y))
    return out


def _diagonal_in_eigenbasis(op: EKFACOperator, G: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``vᵀ G v`` for every eigenvector ``v`` of ``op``, block by block, shaped as its
    eigenvalues."""
    out = []
    for b, block in enumerate(op.eigh().blocks):
        m, q = block.eigenvalues.shape
        values = torch.empty(m, q, dtype=F64)
        for i in range(m):
            for j in range(q):
                v = op.eigenvector(b, i, j)
                values[i, j] = v @ (G @ v)
        out.append(values)
    return tuple(out)


@pytest.mark.parametrize("loss", ["cross_entropy", "mse"])
@pytest.mark.parametrize("separate_bias", [True, False])
def test_type2_corrected_eigenvalues_are_the_ggn_diagonal(loss: str, separate_bias: bool) -> None:
    torch.manual_seed(0)
    ce = loss == "cross_entropy"
    model = Sequence(3, 4, 3, classes_first=ce).double()
    data = _data("classes" if ce else "values")
    loss_of_output = cross_entropy_loss_of_output() if ce else mse_loss_of_output()
    op = EKFACOperator(model, data, supervised_forward, loss_of_output, separate_bias=separate_bias)
    G = GGNOperator(model, data, supervised_forward, loss_of_output).to_dense()
    for got, want in zip(op.corrected_eigenvalues, _diagonal_in_eigenbasis(op, G), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12 * float(G.abs().max()))


def test_monte_carlo_corrected_eigenvalues_approach_the_ggn_diagonal() -> None:
    """Draws need no split (independent per row): many of them reach the same diagonal."""
    torch.manual_seed(0)
    model = Sequence(3, 4, 3, classes_first=True).double()
    data = _data("classes")
    loss = cross_entropy_loss_of_output()
    exact = EKFACOperator(model, data, supervised_forward, loss)
    drawn = EKFACOperator(
        model, data, supervised_forward, loss, fisher_type="mc", mc_samples=4000, column_chunk=4000
    )
    for got, want in zip(drawn.corrected_eigenvalues, exact.corrected_eigenvalues, strict=True):
        # the same eigenbasis only up to the draws' KFAC factors: compare the sums
        assert abs(float(got.sum() / want.sum()) - 1) < 0.05


def test_a_loss_without_its_column_dimension_is_refused_on_rows() -> None:
    class Unsaid(CrossEntropyOutputLoss):
        column_dim = None  # type: ignore[assignment]

    torch.manual_seed(0)
    model = Sequence(3, 4, 3, classes_first=True).double()
    with pytest.raises(ValueError, match=r"\.column_dim.*fisher_type='mc'"):
        EKFACOperator(model, _data("classes"), supervised_forward, Unsaid())
