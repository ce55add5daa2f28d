"""Names a user reaches from the top-level package."""

from __future__ import annotations

import subprocess
import sys

import hessian_eigenthings as he


def test_warning_classes_and_testing_module_at_top_level() -> None:
    from hessian_eigenthings._warnings import EmptyBatchWarning
    from hessian_eigenthings.param_utils import ParamFilterWarning
    from hessian_eigenthings.testing import check_operator

    assert he.EmptyBatchWarning is EmptyBatchWarning and "EmptyBatchWarning" in he.__all__
    assert he.ParamFilterWarning is ParamFilterWarning and "ParamFilterWarning" in he.__all__
    assert he.testing.check_operator is check_operator


def test_testing_is_not_imported_with_the_package() -> None:
    code = "import sys, hessian_eigenthings as he; print('hessian_eigenthings.testing' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
