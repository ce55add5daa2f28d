"""Small problems shared by the facade tests, built the way 0.x users built them (float32)."""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager

import deprecation
import torch
from torch import nn

from hessian_eigenthings.algorithms import ConvergenceWarning
from hessian_eigenthings.compat import CPUFallbackWarning


def mlp_problem(batches: int = 3, batch: int = 16, last: int | None = None):
    """A float32 MLP classifier, its criterion and a list of (inputs, targets) batches."""
    g = torch.Generator().manual_seed(1)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3))
    sizes = [batch] * batches + ([last] if last else [])
    data = [(torch.randn(b, 4, generator=g), torch.randint(0, 3, (b,), generator=g)) for b in sizes]
    return model, nn.CrossEntropyLoss(), data


def symmetric_matrix(
    n: int, *, dtype: torch.dtype = torch.float32, spectrum: torch.Tensor | None = None
) -> torch.Tensor:
    """``Q diag(spectrum) Qᵀ`` with a random orthogonal ``Q``; default spectrum well separated at both ends."""
    g = torch.Generator().manual_seed(2)
    Q, _ = torch.linalg.qr(torch.randn(n, n, generator=g, dtype=torch.float64))
    if spectrum is None:
        spectrum = torch.cat(
            [torch.tensor([-4.0, -3.0]), torch.linspace(-1.0, 1.0, n - 4), torch.tensor([5.0, 7.0])]
        )
    return (Q @ torch.diag(spectrum.to(torch.float64)) @ Q.T).to(dtype)


@contextmanager
def expect_0x(filename: str) -> Iterator[list[warnings.WarningMessage]]:
    """Expect a 0.x call: at least one DeprecatedWarning, maybe a CPU fallback or a
    ConvergenceWarning, nothing else, all pointing at ``filename`` (the test's own file:
    the user's code)."""
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        yield rec
    categories = {r.category for r in rec}
    assert deprecation.DeprecatedWarning in categories, [str(r.message) for r in rec]
    allowed = {deprecation.DeprecatedWarning, CPUFallbackWarning, ConvergenceWarning}
    assert categories <= allowed, [str(r.message) for r in rec]
    assert {r.filename for r in rec} == {filename}
