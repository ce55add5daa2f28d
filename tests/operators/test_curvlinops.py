"""Cross-library check against curvlinops (3.x) on the same model, data and loss.

Scale conventions (curvlinops normalizes by ``c = 1/N`` over the whole data
set for ``reduction="mean"``, ``c = 1`` for ``"sum"``):

- Hessian and GGN with mean reductions: identical (we weight each batch's
  mean-loss curvature by its size, which is the same ``1/N`` average).
- Empirical Fisher: curvlinops builds ``c Σₙ gₙgₙᵀ`` with ``gₙ`` the gradient
  of sample ``n``'s loss *without* the loss's reduction factor. For
  cross-entropy with mean reduction that is our ``(1/N) Σ gᵢgᵢᵀ`` exactly.
  For ``MSELoss(reduction="mean")`` on ``C`` outputs torch divides by
  ``N·C``; our per-sample loss is the mean over the sample's ``C`` elements
  (so the batch loss is the mean of per-sample losses), theirs is the sum,
  hence ``EF_curvlinops = C · EF_ours``. With ``reduction="sum"`` and
  per-sample sums, ``EF_curvlinops = N · EF_ours`` (we always average over
  samples).
- Sum reductions for the Hessian/GGN are not compared: our operators
  average per-batch losses weighted by batch size, so a per-batch *sum* is
  not the data-set sum.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hessian_eigenthings.loss_fns import (
    supervised_forward,
    supervised_loss,
    supervised_loss_of_output,
    supervised_per_sample_loss,
)
from hessian_eigenthings.operators import EmpiricalFisherOperator, GGNOperator, HessianOperator

curvlinops = pytest.importorskip("curvlinops")

# curvlinops' forward-mode products make torch load its decompositions through the
# deprecated torch.jit.script (a DeprecationWarning in torch 2.13): not ours to fix
pytestmark = pytest.mark.filterwarnings("ignore:.*torch.jit.script.*deprecated")

N, C = 10, 3


def setup(criterion: nn.Module):  # type: ignore[no-untyped-def]
    model = nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, C)).double()
    X = torch.randn(N, 5, dtype=torch.float64)
    if isinstance(criterion, nn.CrossEntropyLoss):
        Y = torch.randint(0, C, (N,))
    else:
        Y = torch.randn(N, C, dtype=torch.float64)
    data = [(X[:4], Y[:4]), (X[4:8], Y[4:8]), (X[8:], Y[8:])]  # uneven: weighting matters
    params = list(model.parameters())
    V = torch.randn(sum(p.numel() for p in params), 4, dtype=torch.float64)
    return model, data, params, V


@pytest.mark.parametrize("criterion", [nn.CrossEntropyLoss(), nn.MSELoss()], ids=["ce", "mse"])
def test_hessian_and_ggn_match(criterion: nn.Module) -> None:
    model, data, params, V = setup(criterion)
    ours_h = HessianOperator(model, data, supervised_loss(criterion))
    ours_g = GGNOperator(model, data, supervised_forward, supervised_loss_of_output(criterion))
    theirs_h = curvlinops.HessianLinearOperator(model, criterion, params, data)
    theirs_g = curvlinops.GGNLinearOperator(model, criterion, params, data)
    torch.testing.assert_close(ours_h @ V, theirs_h @ V, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(ours_g @ V, theirs_g @ V, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize(
    "criterion, scale",
    [
        (nn.CrossEntropyLoss(), 1.0),
        (nn.MSELoss(), float(C)),
        (nn.CrossEntropyLoss(reduction="sum"), float(N)),
    ],
    ids=["ce-mean", "mse-mean", "ce-sum"],
)
def test_empirical_fisher_matches_up_to_the_documented_scale(
    criterion: nn.Module, scale: float
) -> None:
    model, data, params, V = setup(criterion)
    ours = EmpiricalFisherOperator(model, data, supervised_per_sample_loss(criterion))
    theirs = curvlinops.EFLinearOperator(model, criterion, params, data)
    torch.testing.assert_close(scale * (ours @ V), theirs @ V, rtol=1e-10, atol=1e-12)
