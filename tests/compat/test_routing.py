"""The routing table of the two colliding top-level names (DESIGN.md §3).

Each row: the call, the path it must take, the type it must return. The 0.x
path warns (caught here); the 1.0 path must raise nothing (pytest runs with
``filterwarnings = ["error"]``).
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import deprecation
import pytest
import torch

import hessian_eigenthings as he
from hessian_eigenthings.algorithms.result import EigenResult
from hessian_eigenthings.compat import HVPOperator
from hessian_eigenthings.compat import LambdaOperator as LambdaOperator0x
from hessian_eigenthings.operators import LambdaOperator
from tests.compat.cases import expect_0x, mlp_problem, symmetric_matrix

A = symmetric_matrix(30)


class DuckOperator:
    """A 0.x operator that never subclassed anything: ``size`` and ``apply``."""

    size = 30

    def apply(self, vec: torch.Tensor) -> torch.Tensor:
        return A.to(vec.device) @ vec


def new_op() -> LambdaOperator:
    return LambdaOperator(lambda v: A @ v, 30)


def old_op() -> LambdaOperator0x:
    with pytest.warns(deprecation.DeprecatedWarning):
        # 0.x use_gpu=True puts vectors on CUDA when there is one
        return LambdaOperator0x(lambda v: A.to(v.device) @ v, 30)


def hvp_op() -> HVPOperator:
    model, criterion, data = mlp_problem(batches=1)
    with pytest.warns(deprecation.DeprecatedWarning):
        return HVPOperator(model, data, criterion, use_gpu=False)


OPS = {"new": new_op, "old": old_op, "duck": DuckOperator, "hvp": hvp_op}

# (operator, args after the operator, keywords, expected path)
LANCZOS_ROWS = [
    ("old", (), {}, "0.x"),  # binds both, 0.x operator
    ("hvp", (), {}, "0.x"),
    ("duck", (), {}, "0.x"),
    ("new", (), {}, "1.0"),  # binds both, 1.0 operator
    ("new", (3,), {}, "1.0"),  # a 1.0 operator: the second positional argument is k
    ("new", (3,), {"which": "SA"}, "1.0"),
    ("new", (3,), {"max_steps": 30}, "0.x"),  # a 0.x-only keyword: 0.x, positional too
    ("old", (3,), {}, "0.x"),  # positional after a 0.x operator: 0.x
    ("old", (3, "LA"), {}, "0.x"),
    ("duck", (3,), {}, "0.x"),
    ("new", (), {"num_eigenthings": 3}, "0.x"),  # 0.x-only keywords
    ("new", (), {"max_steps": 30, "num_lanczos_vectors": 25}, "0.x"),
    ("new", (), {"use_gpu": False}, "0.x"),
    ("new", (), {"k": 3}, "1.0"),  # 1.0-only keywords
    ("old", (), {"k": 3}, "1.0"),
    ("hvp", (), {"k": 3, "ncv": 12}, "1.0"),
    ("new", (), {"which": "SA", "tol": 1e-3}, "1.0"),  # shared keywords: operator decides
    ("old", (), {"which": "SA", "tol": 1e-3}, "0.x"),
]

DEFLATED_ROWS = [
    ("old", (), {}, "0.x"),
    ("hvp", (), {}, "0.x"),
    ("duck", (), {}, "0.x"),
    ("new", (), {}, "1.0"),
    ("new", (3,), {}, "1.0"),
    ("new", (3,), {"momentum": 0.0}, "1.0"),
    ("new", (3,), {"power_iter_steps": 30}, "0.x"),
    ("old", (3, 30, 1e-4), {}, "0.x"),
    ("hvp", (3,), {}, "0.x"),
    ("new", (), {"num_eigenthings": 3}, "0.x"),
    ("new", (), {"power_iter_steps": 30}, "0.x"),
    ("new", (), {"to_numpy": False}, "0.x"),
    ("new", (), {"k": 3}, "1.0"),
    ("old", (), {"k": 3, "max_iter": 30}, "1.0"),
    ("new", (), {"momentum": 0.0}, "1.0"),
    ("old", (), {"momentum": 0.0}, "0.x"),
]


def _call(fn: Any, op_name: str, args: tuple[Any, ...], kwargs: dict[str, Any], path: str) -> Any:
    op = OPS[op_name]()
    if path == "0.x":
        with expect_0x(__file__):
            return fn(op, *args, **kwargs)
    return fn(op, *args, **kwargs)  # must not warn


def _check_type(out: Any, path: str) -> None:
    if path == "0.x":
        assert isinstance(out, tuple) and len(out) == 2
    else:
        assert isinstance(out, EigenResult)


@pytest.mark.parametrize(("op_name", "args", "kwargs", "path"), LANCZOS_ROWS)
def test_lanczos_routing(
    op_name: str, args: tuple[Any, ...], kwargs: dict[str, Any], path: str
) -> None:
    _check_type(_call(he.lanczos, op_name, args, kwargs, path), path)


# the default 10 pairs of a clustered spectrum do not converge in the default steps: not what is tested here
@pytest.mark.filterwarnings("ignore::hessian_eigenthings.algorithms.result.ConvergenceWarning")
@pytest.mark.parametrize(("op_name", "args", "kwargs", "path"), DEFLATED_ROWS)
def test_deflated_power_iteration_routing(
    op_name: str, args: tuple[Any, ...], kwargs: dict[str, Any], path: str
) -> None:
    _check_type(_call(he.deflated_power_iteration, op_name, args, kwargs, path), path)


def test_keyword_operator_names_route() -> None:
    with pytest.warns(deprecation.DeprecatedWarning):
        assert isinstance(he.lanczos(operator=new_op(), num_eigenthings=2), tuple)
    assert isinstance(he.lanczos(op=old_op(), k=2), EigenResult)


@pytest.mark.parametrize(
    ("fn", "args", "kwargs", "words"),
    [
        (he.lanczos, (), {"k": 3, "max_steps": 5}, ["0.x-only", "max_steps", "1.0-only", "'k'"]),
        (
            he.deflated_power_iteration,
            (),
            {"k": 2, "power_iter_steps": 5},
            ["power_iter_steps", "'k'"],
        ),
        # a 1.0 operator takes k positionally, nothing more
        (he.lanczos, (3, "LA"), {}, ["operator and k positionally", "3 positional", "keyword"]),
        (he.deflated_power_iteration, (3, 30), {}, ["operator and k positionally"]),
    ],
)
def test_mixed_signatures_raise_type_error(
    fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any], words: list[str]
) -> None:
    with pytest.raises(TypeError) as info:
        fn(new_op(), *args, **kwargs)
    for word in words:
        assert word in str(info.value)
    assert "migration_guide.md" in str(info.value)
    assert "\n" not in str(info.value)


def test_positional_after_a_0x_operator_with_1x_keywords_raises() -> None:
    with pytest.raises(TypeError, match=r"positional argument.*0.x operator.*'k'"):
        he.lanczos(old_op(), 3, k=3)


@pytest.mark.parametrize("fn", [he.lanczos, he.deflated_power_iteration])
def test_positional_and_keyword_k_on_a_1x_operator(fn: Any) -> None:
    with pytest.raises(TypeError, match="multiple values for argument 'k'"):
        fn(new_op(), 3, k=3)


def test_positional_k_on_a_1x_operator_is_k() -> None:
    # third new-user pass: `lanczos(op, 5)` on a 1.0 operator returned 0.x's ascending numpy pair
    op = new_op()
    by_position = he.lanczos(op, 3, which="LA", seed=0)  # must not warn
    by_keyword = he.lanczos(op, k=3, which="LA", seed=0)
    assert isinstance(by_position, EigenResult)
    torch.testing.assert_close(by_position.eigenvalues, by_keyword.eigenvalues)
    assert by_position.eigenvalues[0] == by_position.eigenvalues.max()  # largest first
    res = he.deflated_power_iteration(op, 2, seed=0)
    assert isinstance(res, EigenResult) and res.eigenvalues.shape == (2,)


def test_positional_k_on_a_1x_operator_in_an_imported_module(tmp_path: Path) -> None:
    # the user's report: the call in a module of theirs, run under Python's default filters
    # (a DeprecationWarning from an imported module is hidden), then `.eigenvalues`
    (tmp_path / "mystuff.py").write_text(
        textwrap.dedent(
            """
            import torch
            import hessian_eigenthings as he

            def top(n):
                A = torch.diag(torch.linspace(1.0, 3.0, 12))
                op = he.LambdaOperator(lambda v: A @ v, 12)
                return he.lanczos(op, n).eigenvalues
            """
        )
    )
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            "import mystuff; print([round(x, 4) for x in mystuff.top(2).tolist()])",
        ],
        capture_output=True,
        text=True,
        env={
            "PYTHONPATH": f"{tmp_path}:{root}",
            "PATH": "/usr/bin:/bin",
            "HESSIAN_EIGENTHINGS_TRACE_TIMES": "0",
        },
        timeout=300,
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[3.0, 2.8182]", out.stdout  # largest first, an EigenResult


@pytest.mark.parametrize(
    ("fn", "kwargs", "message"),
    [
        (
            he.lanczos,
            {"whcih": "LA"},
            "lanczos() got an unknown argument 'whcih'; did you mean 'which'?",
        ),
        (
            he.lanczos,
            {"k": 2, "tolerance": 1e-3},
            "lanczos() got an unknown argument 'tolerance'; did you mean 'tol'?",
        ),
        (
            he.lanczos,
            {"num_eigenthing": 2},
            "lanczos() got an unknown argument 'num_eigenthing'; did you mean 'num_eigenthings'?",
        ),
        (
            he.deflated_power_iteration,
            {"max_iters": 5},
            "deflated_power_iteration() got an unknown argument 'max_iters'; did you mean 'max_iter'?",
        ),
        (
            he.deflated_power_iteration,
            {"power_iter_step": 5},
            "deflated_power_iteration() got an unknown argument 'power_iter_step'; did you mean 'power_iter_steps'?",
        ),
    ],
)
def test_keyword_typo_says_did_you_mean(fn: Any, kwargs: dict[str, Any], message: str) -> None:
    # third new-user pass: a typo gave one 1,400-character line listing both signatures
    for op in (new_op(), DuckOperator()):
        with pytest.raises(TypeError) as info:
            fn(op, **kwargs)
        assert str(info.value) == message


def test_unknown_keyword_without_a_close_name_lists_the_1x_names() -> None:
    with pytest.raises(TypeError) as info:
        he.lanczos(new_op(), bogus=1)
    text = str(info.value)
    assert text.startswith("lanczos() got an unknown argument 'bogus'; it takes op, k, ")
    assert "num_eigenthings" not in text and len(text) < 300
    with pytest.raises(
        TypeError, match=r"'kk' \(did you mean 'k'\?\), 'max_itr' \(did you mean 'max_iter'\?\)"
    ):
        he.deflated_power_iteration(new_op(), kk=2, max_itr=3)


def test_lanczos_module_path_is_always_0x_and_algorithms_always_1x() -> None:
    from hessian_eigenthings.algorithms import lanczos as core_lanczos
    from hessian_eigenthings.lanczos import lanczos as old_lanczos

    with pytest.warns(deprecation.DeprecatedWarning):
        assert isinstance(old_lanczos(new_op()), tuple)
    assert isinstance(core_lanczos(new_op()), EigenResult)
