"""Algorithms use the operator's own backend (``op.backend``) when no ``backend=`` is passed."""

from __future__ import annotations

import torch

from hessian_eigenthings.algorithms import lanczos, spectral_density, trace
from hessian_eigenthings.linalg import SingleDeviceBackend
from hessian_eigenthings.operators import LambdaOperator


class CountingBackend:
    """A backend that is not the single-device class (so no fast path skips it) and counts its calls."""

    def __init__(self) -> None:
        self.inner = SingleDeviceBackend()
        self.calls = 0

    def __getattr__(self, name: str) -> object:
        attr = getattr(self.inner, name)
        if not callable(attr):
            return attr

        def counted(*args: object, **kwargs: object) -> object:
            self.calls += 1
            return attr(*args, **kwargs)

        return counted


def make_op() -> LambdaOperator:
    m = torch.diag(torch.linspace(1.0, 3.0, 30, dtype=torch.float64))
    op = LambdaOperator(lambda v: m @ v, 30, dtype=torch.float64, matmat_fn=lambda rows: rows @ m)
    op.backend = CountingBackend()  # type: ignore[attr-defined]
    return op


def test_lanczos_trace_and_density_default_to_the_operators_backend() -> None:
    for run in (
        lambda op: lanczos(op, k=2, seed=0),
        lambda op: trace(op, num_matvecs=12, seed=0),
        lambda op: spectral_density(op, num_runs=2, lanczos_steps=5, seed=0),
    ):
        op = make_op()
        run(op)
        assert op.backend.calls > 0  # type: ignore[attr-defined]


def test_an_explicit_backend_wins() -> None:
    op = make_op()
    lanczos(op, k=2, seed=0, backend=SingleDeviceBackend())
    assert op.backend.calls == 0  # type: ignore[attr-defined]
