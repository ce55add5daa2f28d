"""The routed top-level names show users the 1.0 function: its signature and docstring
(``help``, ``inspect.signature``, IDEs), while 0.x calls are still routed (issue 25)."""

from __future__ import annotations

import inspect
import pydoc

import pytest

import hessian_eigenthings as he
from hessian_eigenthings import algorithms


@pytest.mark.parametrize(
    ("routed", "core", "expected"),
    [
        (he.lanczos, algorithms.lanczos, ("k", "which", "tol", "max_iter", "seed", "v0")),
        (
            he.deflated_power_iteration,
            algorithms.deflated_power_iteration,
            ("k", "tol", "max_iter"),
        ),
    ],
)
def test_signature_and_docstring_are_the_1_0_functions(
    routed: object, core: object, expected: tuple[str, ...]
) -> None:
    sig = inspect.signature(routed)  # type: ignore[arg-type]
    assert sig == inspect.signature(core)  # type: ignore[arg-type]
    for name in expected:
        assert name in sig.parameters
    first_line = (core.__doc__ or "").strip().splitlines()[0]  # type: ignore[attr-defined]
    text = pydoc.render_doc(routed, renderer=pydoc.plaintext)
    assert first_line in text
    assert "*args" not in text.splitlines()[2]  # the signature line shows the parameters
    assert "0.x" in text  # and a closing paragraph says that 0.x calls are routed too


def test_routing_still_goes_by_the_call() -> None:
    import torch

    op = he.LambdaOperator(
        lambda v: torch.arange(1.0, 7.0, dtype=torch.float64) * v, 6, dtype=torch.float64
    )
    res = he.lanczos(op, k=2, seed=0)  # 1.0 call: an EigenResult, no warning
    assert isinstance(res, he.EigenResult)
    with pytest.warns(DeprecationWarning):
        vals, vecs = he.lanczos(op, num_eigenthings=2)  # 0.x keyword: the 0.x path
    assert vals.shape == (2,) and vecs.shape == (2, 6)
