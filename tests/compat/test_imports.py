"""Every 0.x import path, and the module/function name collision of ``lanczos``."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import hessian_eigenthings
import hessian_eigenthings.compat as compat

ROOT = Path(__file__).resolve().parents[2]


def test_top_level_0x_names() -> None:
    from hessian_eigenthings import (
        HVPOperator,
        compute_hessian_eigenthings,
        deflated_power_iteration,
        lanczos,
        power_iteration,
    )

    assert HVPOperator is compat.HVPOperator
    assert compute_hessian_eigenthings is compat.compute_hessian_eigenthings
    assert power_iteration is compat.power_iteration
    assert callable(lanczos) and callable(deflated_power_iteration)


def test_old_module_paths_reexport_the_facade() -> None:
    from hessian_eigenthings.hvp_operator import HVPOperator
    from hessian_eigenthings.lanczos import lanczos
    from hessian_eigenthings.operator import LambdaOperator, Operator
    from hessian_eigenthings.power_iter import deflated_power_iteration, power_iteration
    from hessian_eigenthings.utils import format_time, log, maybe_fp16, progress_bar

    assert HVPOperator is compat.HVPOperator
    assert lanczos is compat.lanczos
    assert (Operator, LambdaOperator) == (compat.Operator, compat.LambdaOperator)
    assert (power_iteration, deflated_power_iteration) == (
        compat.power_iteration,
        compat.deflated_power_iteration,
    )
    assert (log, maybe_fp16, progress_bar, format_time) == (
        compat.log,
        compat.maybe_fp16,
        compat.progress_bar,
        compat.format_time,
    )


def test_0x_operators_are_1x_operators() -> None:
    assert issubclass(compat.Operator, hessian_eigenthings.CurvatureOperator)
    assert issubclass(compat.HVPOperator, hessian_eigenthings.HessianOperator)
    assert issubclass(compat.HVPOperator, compat.Operator)  # as in 0.x


def test_1x_lambda_operator_is_not_replaced() -> None:
    from hessian_eigenthings.operators import LambdaOperator

    assert hessian_eigenthings.LambdaOperator is LambdaOperator


_CALL = """
import torch
from hessian_eigenthings.operators import LambdaOperator
A = torch.diag(torch.arange(1.0, 31.0))
op = LambdaOperator(lambda v: A @ v, 30)
res = hessian_eigenthings.lanczos(op, k=3)
assert type(res).__name__ == "EigenResult", type(res)
assert torch.allclose(res.eigenvalues.double().sort().values, torch.tensor([28.0, 29.0, 30.0], dtype=torch.float64)), res
"""

ORDERS = {
    "submodule first": "import hessian_eigenthings.lanczos\n",
    "package first": "import hessian_eigenthings\nimport hessian_eigenthings.lanczos\n",
    "from-import of the function first": "from hessian_eigenthings.lanczos import lanczos\nimport hessian_eigenthings\n",
    "module dropped and re-imported": (
        "import sys, hessian_eigenthings.lanczos\n"
        "del sys.modules['hessian_eigenthings.lanczos']\n"
        "import hessian_eigenthings.lanczos\n"
    ),
    "import as": (
        "import hessian_eigenthings.lanczos as lz\n"
        "from hessian_eigenthings.compat import lanczos as old\n"
        "assert lz.lanczos is old\n"
        "import hessian_eigenthings\n"
    ),
}


@pytest.mark.parametrize("order", list(ORDERS))
def test_lanczos_submodule_does_not_shadow_the_function(order: str) -> None:
    code = ORDERS[order] + textwrap.dedent(_CALL)
    proc = subprocess.run(
        [sys.executable, "-W", "error", "-c", code],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
