"""The curvature registry: every built-in row is exported, documented and a CLI choice, and
memory reads its factors from the rows; a new curvature is one module plus one registered row
(``tests/operators/toy_curvature.py``), checked through memory, the contract, Lanczos and
the traced engine against a dense float64 oracle."""

from __future__ import annotations

import contextlib
import importlib.util
import io
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch import nn

import hessian_eigenthings as he
import hessian_eigenthings.operators as ops
from hessian_eigenthings import cli
from hessian_eigenthings.memory import activation_bytes, estimate_memory
from hessian_eigenthings.operators import registry
from hessian_eigenthings.operators.registry import Curvature
from tests.conftest import classification_data, mlp
from tests.operators.contract import check_contract
from tests.operators.toy_curvature import ROW, BatchGradientOuterProduct
from tests.test_memory import _peak_cpu_bytes

REPO = Path(__file__).resolve().parents[2]
REFERENCE = REPO / "docs" / "reference" / "operators.md"
_spec = importlib.util.spec_from_file_location(
    "docs_registry", REPO / "scripts" / "docs_registry.py"
)
assert _spec is not None and _spec.loader is not None
docs_registry = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(docs_registry)
CE = he.supervised_loss(nn.CrossEntropyLoss())


def _cli_accepts(*argv: str) -> bool:
    with contextlib.redirect_stderr(io.StringIO()):
        try:
            cli.build_parser().parse_args(list(argv))
        except SystemExit:
            return False
    return True


def wiring_gaps(row: Curvature) -> list[str]:
    """What a row lacks of the wiring a shipped curvature has (empty: none)."""
    gaps = []
    # the page as mkdocs renders it: its hook adds an entry for a row the page lacks
    reference = docs_registry.with_registry_entries(REFERENCE.read_text())
    for cls in (row.operator_class(),):
        name = cls.__name__
        if name not in ops.__all__ or getattr(ops, name, None) is not cls:
            gaps.append(f"{name} not exported from hessian_eigenthings.operators")
        if name not in he.__all__ or getattr(he, name, None) is not cls:
            gaps.append(f"{name} not exported from hessian_eigenthings")
        if f"::: {cls.__module__}.{cls.__qualname__}\n" not in reference:
            gaps.append(f"{name} not in docs/reference/operators.md")
    if not _cli_accepts("--operator", row.name):
        gaps.append(f"--operator {row.name} not a CLI choice")
    gaps.extend(
        f"--method {m} not a CLI choice"
        for m in row.methods
        if not _cli_accepts("--operator", row.name, "--method", m)
    )
    return gaps


@pytest.mark.parametrize("row", registry.BUILTIN, ids=lambda r: r.name)
def test_builtin_rows_are_exported_documented_and_cli_choices(row: Curvature) -> None:
    assert wiring_gaps(row) == []
    # a factored operator reads the data when built, so it is not a DataCurvatureOperator
    assert issubclass(row.operator_class(), ops.DataCurvatureOperator) != row.factored
    assert issubclass(row.operator_class(), ops.CurvatureOperator)
    # the row's builder lives beside the operators: nothing in the table points up into the CLI
    assert row.builder().__module__ == "hessian_eigenthings.operators.builders"
    assert row.builder() is getattr(cli, row.builder().__name__)  # the CLI re-exports them


def test_distributed_names_are_constructors_of_registered_rows_not_rows() -> None:
    from hessian_eigenthings.operators import distributed

    reference = docs_registry.with_registry_entries(REFERENCE.read_text())
    operators = {row.operator_class() for row in registry.BUILTIN}
    constructors = [n for n in distributed.__all__ if n.startswith(("DDP", "FSDP"))]
    assert len(constructors) == 12
    for name in constructors:
        cls = getattr(distributed, name)
        assert any(issubclass(cls, op) for op in operators), name  # a shipped curvature's
        assert getattr(ops, name) is cls and getattr(he, name) is cls
        assert f"::: {cls.__module__}.{cls.__qualname__}\n" in reference, name
    assert not any(n.startswith(("DDP", "FSDP")) for n in registry.exported_names())


@pytest.mark.parametrize("row", registry.BUILTIN, ids=lambda r: r.name)
def test_memory_estimate_reads_the_rows_factors(row: Curvature) -> None:
    model = nn.Sequential(nn.Linear(10, 32), nn.Tanh(), nn.Linear(32, 3))
    batch = (torch.randn(64, 10), torch.randint(0, 3, (64,)))
    A = activation_bytes(model, batch, CE)
    P = sum(p.numel() for p in model.parameters()) * 4
    for method, f in zip(row.methods or (None,), row.memory, strict=True):
        est = estimate_memory(model, batch, CE, operator=row.name, method=method, block_size=3)
        assert est.product_bytes == int(
            (f.first_pass + 3 * f.per_vector) * A + (6 + f.extra_vectors) * P
        )
        assert est.method == f.label


@pytest.fixture
def toy() -> Iterator[Curvature]:
    registry.register(ROW)
    try:
        yield ROW
    finally:
        registry.unregister(ROW.name)


def test_a_registered_row_is_wired_by_its_row_alone(toy: Curvature) -> None:
    # registered at test time, named nowhere else: exported, documented, a CLI choice, built
    assert wiring_gaps(toy) == []
    page = docs_registry.with_registry_entries(REFERENCE.read_text())
    assert docs_registry.MARKER not in page
    assert (
        "## More curvatures\n\n::: tests.operators.toy_curvature.BatchGradientOuterProduct\n"
        in page
    )
    for package in (ops, he):
        assert package.BatchGradientOuterProduct is BatchGradientOuterProduct
        assert "BatchGradientOuterProduct" in package.__all__
        assert "BatchGradientOuterProduct" in dir(package)
        namespace: dict[str, object] = {}
        exec(f"from {package.__name__} import *", namespace)
        assert namespace["BatchGradientOuterProduct"] is BatchGradientOuterProduct
    registry.unregister(toy.name)
    try:
        assert "toy_curvature" not in docs_registry.with_registry_entries(REFERENCE.read_text())
        for package in (ops, he):
            assert "BatchGradientOuterProduct" not in package.__all__
            assert not hasattr(package, "BatchGradientOuterProduct")
        assert "HessianOperator" in ops.__all__ and "HessianOperator" in he.__all__
    finally:
        registry.register(toy)


def test_a_row_class_name_taken_by_another_row_is_refused(toy: Curvature) -> None:
    twin = type("HessianOperator", (BatchGradientOuterProduct,), {})
    with pytest.raises(ValueError, match=r"taken: HessianOperator \(curvature 'hessian'\)"):
        registry.register(Curvature(**{**vars(toy), "name": "twin", "operator": twin}))
    assert "twin" not in registry.names()
    assert he.HessianOperator is registry.curvature("hessian").operator_class()


def test_lookups_and_registration_errors(toy: Curvature) -> None:
    assert registry.names() == ("hessian", "ggn", "fisher", "kfac", "ekfac", "kfoc", toy.name)
    assert registry.curvature(toy.name) is toy
    with pytest.raises(
        ValueError, match=r"unknown curvature 'laplacian'; known: 'hessian', 'ggn'.*register"
    ):
        registry.curvature("laplacian")
    with pytest.raises(ValueError, match="already registered; pass replace=True"):
        registry.register(toy)
    assert registry.register(toy, replace=True) is toy
    with pytest.raises(ValueError, match="built-in"):
        registry.register(Curvature(**{**vars(toy), "name": "ggn"}))
    with pytest.raises(ValueError, match="built-in"):
        registry.unregister("hessian")
    with pytest.raises(ValueError, match="not registered"):
        registry.unregister("laplacian")
    with pytest.raises(TypeError, match="Curvature row"):
        registry.register("laplacian")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="lower-case identifier"):
        Curvature(**{**vars(toy), "name": "Batch-Outer"})
    with pytest.raises(ValueError, match=r"needs 2 MemoryFactors \(one per method \('a', 'b'\)\)"):
        Curvature(**{**vars(toy), "methods": ("a", "b")})
    twice = (toy.memory[0], toy.memory[0])
    with pytest.raises(ValueError, match="labels must differ"):
        Curvature(**{**vars(toy), "methods": ("a", "b"), "memory": twice})
    with pytest.raises(ValueError, match="method must be one of"):
        registry.curvature("hessian").memory_factors("forward")
    with pytest.raises(ValueError, match=r"package\.module:Name"):
        Curvature(**{**vars(toy), "operator": "BatchGradientOuterProduct"}).operator_class()
    with pytest.raises(TypeError, match="not a class"):
        Curvature(**{**vars(toy), "operator": "hessian_eigenthings.cli:main"}).operator_class()
    with pytest.raises(ValueError, match="operator: unknown curvature"):
        estimate_memory(mlp(), torch.randn(2, 5, dtype=torch.float64), operator="laplacian")
    with pytest.raises(ValueError, match="has one product method"):
        estimate_memory(
            mlp(),
            torch.randn(2, 5, dtype=torch.float64),
            operator="ggn",
            method="finite_difference",
        )
    with pytest.raises(SystemExit), contextlib.redirect_stderr(io.StringIO()) as err:
        cli.main(["--operator", toy.name, "--method", "finite_difference"])
    assert (
        f"applies to --operator hessian only ({toy.name} has one product method)" in err.getvalue()
    )


# -- the toy curvature through the paths a user would take -------------------


def dense_batch_gradient_outer(model: nn.Module, data: list) -> torch.Tensor:  # type: ignore[type-arg]
    """``Σ n_b g_b g_bᵀ / Σ n_b`` in float64 from ``torch.func.grad`` of a functional call."""
    params = {n: p.detach() for n, p in model.named_parameters()}
    acc = torch.zeros(
        sum(p.numel() for p in params.values()),
        sum(p.numel() for p in params.values()),
        dtype=torch.float64,
    )
    total = 0
    for x, y in data:

        def loss(
            p: dict[str, torch.Tensor], x: torch.Tensor = x, y: torch.Tensor = y
        ) -> torch.Tensor:
            return nn.functional.cross_entropy(torch.func.functional_call(model, p, (x,)), y)

        g = torch.cat([t.reshape(-1) for t in torch.func.grad(loss)(params).values()]).double()
        acc += x.shape[0] * torch.outer(g, g)
        total += x.shape[0]
    return acc / total


@pytest.mark.parametrize("engine", ["autograd", "functional"])
@pytest.mark.parametrize("reuse", [False, True])
def test_toy_matches_the_dense_oracle(toy: Curvature, engine: str, reuse: bool) -> None:
    model, data = mlp(), classification_data(n=10, batch=4)  # batches of 4, 4, 2
    op = toy.operator_class()(model, data, CE, graph_reuse=reuse, engine=engine)
    check_contract(op, dense_batch_gradient_outer(model, data), model)
    assert op.engine == engine
    if engine == "autograd":  # kept gradients: one forward per batch whatever the products
        assert (op.num_forwards == 3) == reuse


def test_toy_lanczos_and_to_dense(toy: Curvature) -> None:
    torch.manual_seed(0)
    model, data = mlp(), classification_data(n=12, batch=4)  # rank 3
    op = BatchGradientOuterProduct(model, data, CE)
    dense = dense_batch_gradient_outer(model, data)
    torch.testing.assert_close(op.to_dense(), dense, rtol=1e-10, atol=1e-12)
    eig = he.lanczos(op, k=2, which="LA", seed=0)
    torch.testing.assert_close(
        eig.eigenvalues, torch.linalg.eigvalsh(dense).flip(0)[:2], rtol=1e-8, atol=1e-12
    )


def test_toy_memory_estimate_against_measured_cpu_peak(toy: Curvature) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(32, 128), nn.Tanh(), nn.Linear(128, 128), nn.Tanh(), nn.Linear(128, 10)
    )
    batch = (torch.randn(1024, 32), torch.randint(0, 10, (1024,)))
    A = activation_bytes(model, batch, CE)
    P = sum(p.numel() for p in model.parameters()) * 4
    est = estimate_memory(model, batch, CE, operator=toy.name, block_size=4)
    assert (est.product_bytes, est.method) == (int(A + 9 * P), "batch gradients")
    op = BatchGradientOuterProduct(model, [batch], CE, graph_reuse=False)
    V = torch.randn(op.size, 4)
    op @ V  # warm-up: one-time allocations are not part of a product
    measured = _peak_cpu_bytes(lambda: op @ V)
    assert 0.5 <= measured / est.product_bytes <= 2.0, (measured, est.product_bytes)


def test_toy_built_by_the_command_line(toy: Curvature) -> None:
    model, data = mlp(), classification_data(n=10, batch=4)
    problem = cli.Problem(model, data, nn.CrossEntropyLoss(), "toy")
    op = cli.build_operator(problem, toy.name, num_batches=2)
    assert isinstance(op, BatchGradientOuterProduct)
    torch.testing.assert_close(
        op.to_dense(), dense_batch_gradient_outer(model, data[:2]), rtol=1e-10, atol=1e-12
    )
    with pytest.raises(cli.CLIError, match="unknown curvature"):
        cli.build_operator(problem, "laplacian")


# -- the Kronecker-factored rows -------------------------------------------------


FACTORED = [row for row in registry.BUILTIN if row.factored]


def test_the_kronecker_factored_operators_are_rows() -> None:
    assert [row.name for row in FACTORED] == ["kfac", "ekfac", "kfoc"]
    assert [row.operator_class() for row in FACTORED] == [
        he.KFACOperator,
        he.EKFACOperator,
        he.KFOCOperator,
    ]


@pytest.mark.parametrize("row", FACTORED, ids=lambda r: r.name)
def test_factored_rows_built_by_the_command_line_equal_the_operator(row: Curvature) -> None:
    model, data = mlp(), classification_data(n=10, batch=4)  # batches of 4, 4, 2
    problem = cli.Problem(model, data, nn.CrossEntropyLoss(), "toy")
    op = cli.build_operator(problem, row.name, num_batches=2)
    direct = row.operator_class()(
        model, data[:2], he.supervised_forward, he.cross_entropy_loss_of_output()
    )
    assert type(op) is type(direct)
    torch.testing.assert_close(op.to_dense(), direct.to_dense(), rtol=1e-12, atol=1e-14)
    with pytest.raises(cli.CLIError, match="--microbatch-size does not apply"):
        cli.build_operator(problem, row.name, microbatch_size=2)
    norm = nn.Sequential(nn.Linear(5, 4), nn.LayerNorm(4), nn.Linear(4, 3)).double()
    with pytest.raises(cli.CLIError, match=r"1\.weight \(LayerNorm\)"):
        cli.build_operator(cli.Problem(norm, data, nn.CrossEntropyLoss(), "n"), row.name)


@pytest.mark.parametrize("row", FACTORED, ids=lambda r: r.name)
def test_factored_memory_estimate_against_the_measured_building_pass(row: Curvature) -> None:
    # the peak of a factored operator is the pass that builds it (NOTE [memory factors])
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(32, 128), nn.Tanh(), nn.Linear(128, 128), nn.Tanh(), nn.Linear(128, 10)
    )
    batch = (torch.randn(1024, 32), torch.randint(0, 10, (1024,)))
    est = estimate_memory(model, batch, CE, operator=row.name, block_size=1)
    cls = row.operator_class()
    args = (model, [batch], he.supervised_forward, he.cross_entropy_loss_of_output())
    cls(*args)  # warm-up
    measured = _peak_cpu_bytes(lambda: cls(*args))
    assert 0.5 <= measured / est.product_bytes <= 2.0, (measured, est.product_bytes)
