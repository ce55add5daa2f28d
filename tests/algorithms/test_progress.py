"""Progress reporting of the algorithms: bars on a terminal or in Jupyter, log lines elsewhere."""

from __future__ import annotations

import sys
from typing import ClassVar

import pytest
import torch

import hessian_eigenthings as he
from hessian_eigenthings.algorithms import _common


def _op(n: int = 40) -> he.LambdaOperator:
    gen = torch.Generator().manual_seed(0)
    A = torch.randn(n, n, generator=gen, dtype=torch.float64)
    A = A + A.T
    return he.LambdaOperator(lambda v: A @ v, n, dtype=torch.float64)


def test_log_lines_when_not_a_terminal(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(_common, "LOG_INTERVAL_S", 0.0)  # every update prints: a long run, compressed
    he.lanczos(_op(), k=3, seed=0)  # progress=None, stderr captured: not a terminal
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines and all(line.startswith("lanczos (k=3): ") for line in lines)
    assert "products" in lines[-1] and "converged" in lines[-1]
    assert "\r" not in "".join(lines)


def test_no_log_lines_for_short_runs_or_progress_false(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    he.lanczos(_op(), k=3, seed=0)  # a short run stays under the interval: silent
    assert capsys.readouterr().err == ""
    monkeypatch.setattr(_common, "LOG_INTERVAL_S", 0.0)
    he.lanczos(_op(), k=3, seed=0, progress=False)
    he.trace(_op(), num_matvecs=9, seed=0, progress=False)
    assert capsys.readouterr().err == ""


def test_lanczos_bar_total_is_not_the_iteration_cap(capsys: pytest.CaptureFixture[str]) -> None:
    res = he.lanczos(_op(), k=3, seed=0, max_iter=1000, progress=True)
    err = capsys.readouterr().err
    assert "lanczos (k=3)" in err
    assert "/1000" not in err and "%" not in err  # no percentage of a cap the run never reaches
    assert "converged=3/3" in err
    assert res.iterations < 1000


def test_bar_in_a_jupyter_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    class Shell:
        config: ClassVar[dict[str, dict[str, str]]] = {"IPKernelApp": {}}

    class FakeIPython:
        @staticmethod
        def get_ipython() -> Shell:
            return Shell()

    assert not _common.show_progress(None)  # pytest's captured stderr is not a terminal
    monkeypatch.setitem(sys.modules, "IPython", FakeIPython)
    monkeypatch.setitem(sys.modules, "ipykernel", object())
    assert _common.show_progress(None)
    assert not _common.show_progress(False)
