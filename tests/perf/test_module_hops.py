"""Parity guard, the reading side: one steady product is readable in a few files (issue 26).

``benchmarks.module_hops.measure`` profiles the fourth ``HessianOperator @ v`` on a 3-layer MLP:
every Python call into ``hessian_eigenthings`` whose module differs from the previous such call
is one module change. Pinned: at most 20 changes, and at most 4 modules of ``operators/``
entered (the protocol's entry, the base's data loop, the model guard, and the curvature or its
runner), on the default engine (``"auto"``), on ``"autograd"`` and ``"functional"``, and on
``engine="compiled"``.
"""

from __future__ import annotations

import pytest

from benchmarks.module_hops import measure

MAX_CHANGES = 20
MAX_OPERATORS_MODULES = 4


def _check(engine: str, runner: str | None) -> None:
    row = measure(engine)  # warnings ignored: a compile fallback would show in the modules
    changes, operators = row["module_changes"], row["operators_modules"]
    assert changes <= MAX_CHANGES, (engine, changes)
    assert len(operators) <= MAX_OPERATORS_MODULES, (engine, operators)
    if runner is not None:  # the product ran where the engine says (no fallback in between)
        assert f"hessian_eigenthings.operators.{runner}" in operators, (engine, operators)


# "auto" measures and chooses; whichever runner it chose, the product stays as short
@pytest.mark.parametrize(
    ("engine", "runner"),
    [("auto", None), ("autograd", "hessian"), ("functional", "engines.functional")],
)
def test_steady_product_reads_in_four_operators_modules(engine: str, runner: str | None) -> None:
    _check(engine, runner)


@pytest.mark.slow  # compiles with inductor's C++ backend on CPU
def test_steady_compiled_product_reads_in_four_operators_modules() -> None:
    _check("compiled", "engines.compiled")
