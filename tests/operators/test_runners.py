"""Runners (``operators.engines``) compute products from arguments; the operator's collaborators
hold no reference back to it; every module of ``operators/`` has a place in the layers contract."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

import hessian_eigenthings.operators as ops
from hessian_eigenthings.loss_fns import supervised_loss
from hessian_eigenthings.operators import HessianOperator
from hessian_eigenthings.operators.engines import AutogradRunner, FunctionalRunner, ProductRunner
from hessian_eigenthings.param_utils import select_parameters
from hessian_eigenthings.testing import dense_hessian
from tests.conftest import classification_data, mlp

SUP = supervised_loss(nn.CrossEntropyLoss())
PACKAGE = Path(ops.__file__).parent


def _products(runner: ProductRunner, batch: object, vecs: list[torch.Tensor]) -> torch.Tensor:
    out = runner.apply(runner.prepare(batch), vecs, False)
    return torch.cat([o.reshape(o.shape[0], -1) for o in out if o is not None], dim=1)


def test_runners_take_inputs_not_the_operator() -> None:
    """A runner built from the curvature's hooks or its pure product alone gives the Hessian."""
    model, data = mlp(), classification_data(n=8, batch=8)
    op = HessianOperator(model, data, SUP)
    H = dense_hessian(model, data, SUP, select_parameters(model))
    V = torch.randn(3, op.size, dtype=torch.float64)
    vecs = op.layout.split_rows(V)
    autograd = AutogradRunner(op._prepare, op._apply, takes_params=True)
    functional = FunctionalRunner(model, op.params, op.functional_product)
    for runner in (autograd, functional):
        torch.testing.assert_close(_products(runner, data[0], vecs), V @ H, rtol=1e-10, atol=1e-10)


def test_stand_in_leaves_are_an_argument_of_prepare() -> None:
    """The autograd runner passes ``params`` on: the graph is built over the stand-ins given (how a
    state to record is built, NOTE [CUDA graphs]), and the product is the same Hessian, with tied
    layers too."""
    torch.manual_seed(3)
    shared = nn.Linear(5, 5)
    model = nn.Sequential(shared, nn.Tanh(), shared, nn.Tanh(), nn.Linear(5, 2)).double()
    data = [(torch.randn(7, 5, dtype=torch.float64), torch.randint(0, 2, (7,)))]
    op = HessianOperator(model, data, SUP)
    V = torch.randn(3, op.size, dtype=torch.float64)
    runner = op._engines.runner
    leaves = [p.detach().requires_grad_(True) for p in op.params]
    state = runner.prepare(data[0], leaves)
    assert state.inputs is leaves
    got = runner.apply(state, op.layout.split_rows(V), False)
    expected = (op @ V.T).T
    torch.testing.assert_close(torch.cat([g.reshape(3, -1) for g in got], dim=1), expected)
    assert all(p.grad is None for p in op.params)


def _holds(obj: object, target: object, depth: int = 2, *, methods: bool = True) -> bool:
    """Whether ``obj`` refers to ``target`` through its attributes (``methods``: its bound
    methods count too)."""
    if obj is target or (methods and getattr(obj, "__self__", None) is target):
        return True
    if depth == 0 or not hasattr(obj, "__dict__"):
        return False
    return any(_holds(v, target, depth - 1, methods=methods) for v in vars(obj).values())


def test_collaborators_hold_no_reference_to_the_operator() -> None:
    model, data = mlp(), classification_data(n=8, batch=8)
    op = HessianOperator(model, data, SUP, engine="functional")
    op @ torch.randn(op.size, dtype=torch.float64)
    for collaborator in (op.guard, op._states, op.recorder):
        assert not _holds(collaborator, op), type(collaborator).__name__
    # the selector and the runners hold the curvature's hooks and pure product (what they run),
    # never the operator itself
    for holder in (op._engines, op._engines.runner):
        assert not _holds(holder, op, methods=False), type(holder).__name__


def test_every_operators_module_has_a_layer() -> None:
    """The layers contract inside ``operators/`` places every module (the registry, data only,
    has a contract of its own), so a new module cannot sit outside it unnoticed."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    config = tomllib.loads((PACKAGE.parents[1] / "pyproject.toml").read_text())
    contract = next(
        c
        for c in config["tool"]["importlinter"]["contracts"]
        if c["name"].startswith("Layers inside operators/")
    )
    placed = {
        name.strip().strip("()").removeprefix("hessian_eigenthings.operators.")
        for layer in contract["layers"]
        for name in layer.replace("|", ":").split(":")
    }
    modules = {p.stem for p in PACKAGE.glob("*.py")} | {
        p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists()
    }
    assert modules - placed - {"__init__", "registry"} == set()


def test_using_engine_switches_and_restores() -> None:
    """``op.using_engine(name)``: products on that engine inside, the operator's own selector
    (with what it had decided) restored after, errors on entry for a bad name."""
    model, data = mlp(), classification_data(n=8, batch=8)
    op = HessianOperator(model, data, SUP, engine="autograd")
    v = torch.randn(op.size, dtype=torch.float64)
    before = op @ v
    own = op._engines
    with op.using_engine("functional"):
        assert op.engine == "functional"
        inside = op @ v
    assert op._engines is own and op.engine == "autograd"
    torch.testing.assert_close(inside, before, rtol=1e-10, atol=1e-12)
    with pytest.raises(ValueError, match="engine must be one of"), op.using_engine("fast"):  # type: ignore[arg-type]
        pass
    assert op._engines is own
