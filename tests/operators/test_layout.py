"""The shape of ``operators/`` (DESIGN §6): a lean base, collaborators in their own modules,
curvature modules as siblings that share no private names."""

from __future__ import annotations

import ast
from pathlib import Path

import hessian_eigenthings.operators as ops

PACKAGE = Path(ops.__file__).parent


def _imports(path: Path) -> list[tuple[str, str]]:
    tree = ast.parse(path.read_text())
    return [
        (node.module, alias.name)
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and node.module
        for alias in node.names
    ]


def test_base_holds_the_data_loop_only() -> None:
    assert len((PACKAGE / "base.py").read_text().splitlines()) < 450


def test_no_operator_module_imports_a_private_name_of_another() -> None:
    offenders = [
        f"{path.name}: from {module} import {name}"
        for path in sorted(PACKAGE.glob("*.py"))
        for module, name in _imports(path)
        if module.startswith("hessian_eigenthings.operators.") and name.startswith("_")
    ]
    assert offenders == []


def test_curvature_modules_are_siblings() -> None:
    """No curvature module imports another curvature's module (the DDP/FSDP wrappers, which
    wrap the three curvatures, excepted); shared machinery lives in sandwich/autodiff."""
    for name in ("hessian", "ggn", "fisher", "sandwich", "lm_head"):
        imported = {module for module, _ in _imports(PACKAGE / f"{name}.py")}
        others = {f"hessian_eigenthings.operators.{c}" for c in ("hessian", "ggn", "fisher")} - {
            f"hessian_eigenthings.operators.{name}"
        }
        assert not (imported & others), (name, imported & others)
