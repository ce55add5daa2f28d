"""Checks of Hardening 4 that belong to no one operator: bad counts refused in one line, and the
suite's own rule that auto's choices in tests follow product counts, not the machine's load."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from hessian_eigenthings import GGNOperator
from hessian_eigenthings.loss_fns import MonteCarlo, supervised_forward, supervised_loss_of_output
from tests.conftest import classification_data, mlp

CE_OUT = supervised_loss_of_output(nn.CrossEntropyLoss())


@pytest.mark.parametrize("k", [0, -1, 2.5, True])
def test_monte_carlo_with_no_draws_is_refused(k: object) -> None:
    with pytest.raises(ValueError, match=r"^MonteCarlo\(samples=\.\.\.\) must be an int >= 1"):
        MonteCarlo(CE_OUT, k)  # type: ignore[arg-type]


def test_monte_carlo_with_draws_gives_finite_products() -> None:
    model, data = mlp(), classification_data(n=6, batch=3)
    op = GGNOperator(model, data, supervised_forward, CE_OUT, curvature=MonteCarlo(CE_OUT, 2))
    assert torch.isfinite(op @ torch.ones(op.size, dtype=torch.float64)).all()


def test_auto_sees_a_steady_clock_in_tests() -> None:
    """NOTE [a steady clock for auto]: however slow the machine, a loop of products makes the
    same choices and counts (the graph-reuse count that failed under load, now pinned)."""
    import time

    from hessian_eigenthings.operators.engines import auto

    slow = auto.timed(torch.device("cpu"), lambda: time.sleep(0.05))[1]
    assert slow == 1.0
    model, data = mlp(), classification_data(n=6, batch=6)
    op = GGNOperator(model, data, supervised_forward, CE_OUT, graph_reuse=True)
    V = torch.randn(op.size, 3, dtype=torch.float64)
    for _ in range(4):
        op @ V
    assert op.engine == "autograd" and op.num_forwards == 1


@pytest.mark.real_clock
def test_the_real_clock_where_asked() -> None:
    import time

    from hessian_eigenthings.operators.engines import auto

    assert auto.timed(torch.device("cpu"), lambda: time.sleep(0.02))[1] >= 20.0


def test_loading_forward_mode_decompositions_keeps_once_per_call_site(tmp_path: Path) -> None:
    """A trace loads torch's forward-mode decompositions (whose import warns); that must not make
    Python forget which call sites have warned: a user's warning shows once per call site."""
    script = tmp_path / "user.py"
    script.write_text(
        "import warnings\n"
        "from hessian_eigenthings import _torch_compat\n"
        "def old():\n"
        "    warnings.warn('old is deprecated', UserWarning, stacklevel=2)\n"
        "for i in range(3):\n"
        "    old()\n"
        "    if i == 0:\n"
        "        _torch_compat.load_forward_ad_decompositions()\n"
    )
    run = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=300, check=True
    )
    assert run.stderr.count("old is deprecated") == 1, run.stderr
    assert "jit.script" not in run.stderr


@pytest.mark.parametrize("name", ["KFACOperator", "EKFACOperator", "KFOCOperator"])
def test_a_misspelt_kronecker_keyword_names_the_class_and_the_close_match(name: str) -> None:
    import hessian_eigenthings as he

    model, data = mlp(), classification_data(n=6, batch=3)
    cls = getattr(he, name)
    with pytest.raises(
        TypeError,
        match=rf"^{name}\(\) got an unexpected keyword argument 'fisher_typ'; did you mean "
        r"'fisher_type'\?$",
    ):
        cls(model, data, supervised_forward, CE_OUT, fisher_typ="mc")
