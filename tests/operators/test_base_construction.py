"""How data operators are built (issue "Structure 2"): the shared keywords travel as one record
(``DataOptions``) yet every signature still lists them; capabilities are fixed before the base
constructor, which builds the engine selector; the strategies a curvature hands the base."""

from __future__ import annotations

import inspect
from typing import Any

import pytest
import torch
from torch import nn

from hessian_eigenthings.loss_fns import (
    supervised_forward,
    supervised_loss,
    supervised_loss_of_output,
    supervised_per_sample_loss,
)
from hessian_eigenthings.operators import (
    DataCurvatureOperator,
    EmpiricalFisherOperator,
    GGNOperator,
    HessianOperator,
)
from hessian_eigenthings.operators.base import BATCH_ROWS, DataOptions, SampleCount
from hessian_eigenthings.operators.engines.runner import EngineUnsupportedError
from hessian_eigenthings.operators.jacobian import JacobianOperator, TransposedJacobianOperator
from hessian_eigenthings.operators.lm_head import ChunkedHead
from hessian_eigenthings.operators.sandwich import OutputState

CE = nn.CrossEntropyLoss()
X = torch.randn(6, 4, dtype=torch.float64)
Y = torch.randint(0, 3, (6,))


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)).double()


def _ops() -> dict[str, Any]:
    model, data = _model(), [(X, Y)]
    return {
        "HessianOperator": HessianOperator(model, data, supervised_loss(CE)),
        "GGNOperator": GGNOperator(model, data, supervised_forward, supervised_loss_of_output(CE)),
        "EmpiricalFisherOperator": EmpiricalFisherOperator(
            model, data, supervised_per_sample_loss(CE)
        ),
    }


# -- signatures: the record written out --------------------------------------------------------

BASE_DEFAULTS = {
    name: p.default
    for name, p in inspect.signature(DataCurvatureOperator).parameters.items()
    if p.kind is p.KEYWORD_ONLY
}


@pytest.mark.parametrize("cls", [HessianOperator, GGNOperator, EmpiricalFisherOperator])
def test_every_shared_keyword_is_in_the_signature_with_its_default(cls: type) -> None:
    params = inspect.signature(cls).parameters
    assert not any(p.kind is p.VAR_KEYWORD for p in params.values())
    assert set(DataOptions.__annotations__) == set(BASE_DEFAULTS)
    for name, default in BASE_DEFAULTS.items():
        assert params[name].kind is inspect.Parameter.KEYWORD_ONLY, name
        assert params[name].default == default, name


def test_ggn_signature_is_the_designed_one() -> None:
    """DESIGN: ``GGNOperator(model, dataloader, forward_fn, loss_of_output_fn, *,
    param_filter=None, full_dataset=True, num_batches=None, loss_hvp="analytical", fd_eps=None,
    backend=None)``, and its own keywords keep their defaults."""
    params = inspect.signature(GGNOperator).parameters
    positional = [n for n, p in params.items() if p.kind is p.POSITIONAL_OR_KEYWORD]
    assert positional == ["model", "dataloader", "forward_fn", "loss_of_output_fn"]
    expected = {
        "param_filter": None,
        "full_dataset": True,
        "num_batches": None,
        "loss_hvp": "analytical",
        "fd_eps": None,
        "backend": None,
        "jvp": "auto",
        "chunked_lm_head": "auto",
        "lm_head_chunk_rows": None,
        "mc_samples": 0,
        "seed": 0,
        "curvature": None,
        "microbatch_size": None,
        "microbatch_unsafe": False,
    }
    assert {n: params[n].default for n in expected} == expected


@pytest.mark.parametrize("cls", [JacobianOperator, TransposedJacobianOperator])
def test_jacobian_record_in_the_signature_and_misspelt_keywords(cls: type) -> None:
    params = inspect.signature(cls).parameters
    assert list(params) == ["model", "dataloader", "forward_fn", "param_filter", "num_batches"]
    assert params["param_filter"].default is None and params["num_batches"].default is None
    with pytest.raises(TypeError) as info:
        cls(_model(), [(X, Y)], supervised_forward, num_batchs=1)
    assert str(info.value) == (
        f"{cls.__name__}() got an unexpected keyword argument 'num_batchs'; "
        "did you mean 'num_batches'?"
    )
    J = cls(_model(), [(X, Y)], supervised_forward, param_filter="0.*", num_batches=1)
    assert J.layout.size == 4 * 5 + 5


def test_a_misspelt_shared_keyword_names_the_ggn() -> None:
    with pytest.raises(TypeError) as info:
        GGNOperator(
            _model(), [(X, Y)], supervised_forward, supervised_loss_of_output(CE), fd_esp=1e-3
        )
    assert str(info.value) == (
        "GGNOperator() got an unexpected keyword argument 'fd_esp'; did you mean 'fd_eps'?"
    )


# -- capabilities and the engine selector --------------------------------------------------------


@pytest.mark.parametrize("name", ["HessianOperator", "GGNOperator", "EmpiricalFisherOperator"])
def test_the_selector_is_built_by_the_constructor(name: str) -> None:
    op = _ops()[name]
    assert "_engine_selector" in vars(op)
    assert op._engines is op._engine_selector
    assert op._engine_selector.functional == op.supports_functional is True


def test_finite_differences_declare_their_capabilities_before_the_base() -> None:
    op = HessianOperator(_model(), [(X, Y)], supervised_loss(CE), method="finite_difference")
    assert not (op.supports_graph_reuse or op.supports_cuda_graphs or op.supports_functional)
    assert not op.needs_double_backward and not op._engine_selector.second_order
    assert "_product" not in vars(HessianOperator)  # the base's, on the curvature's hooks
    exact = HessianOperator(_model(), [(X, Y)], supervised_loss(CE))
    v = torch.randn(op.size, dtype=torch.float64)
    torch.testing.assert_close(op @ v, exact @ v, rtol=1e-6, atol=1e-8)
    with pytest.raises(EngineUnsupportedError, match="method='finite_difference'"):
        HessianOperator(
            _model(), [(X, Y)], supervised_loss(CE), method="finite_difference", engine="functional"
        )


def test_using_engine_and_replaced_parameters_rebuild_no_private_dict_entry() -> None:
    op = _ops()["HessianOperator"]
    own = op._engine_selector
    with op.using_engine("functional"):
        assert op.engine == "functional" and op._engine_selector is not own
    assert op._engine_selector is own
    model = op.model
    model[0].weight = nn.Parameter(model[0].weight.detach().clone())
    op @ torch.randn(op.size, dtype=torch.float64)
    assert op._engine_selector is not own and op._engine_selector.params[0] is model[0].weight


# -- strategies handed to the base ------------------------------------------------------------


def test_sample_counter_is_the_rows_unless_the_loss_counts() -> None:
    ops = _ops()
    assert all(op.sample_counter is BATCH_ROWS for op in ops.values())
    assert BATCH_ROWS.samples((X, Y)) == 6
    with pytest.raises(ValueError, match="zero samples to average over"):
        SampleCount().check(0, 0.0)


def test_chunked_head_takes_the_body_products_as_arguments() -> None:
    """NOTE [chunked LM head]: the head's product gets the body's ``J v`` and ``Jᵀ u`` as
    functions, and the selected parameters; it never reaches into the operator."""
    head = nn.Linear(3, 5)
    body = nn.Parameter(torch.randn(2))
    params = [body, head.weight]  # the head's bias not selected
    h = torch.randn(2, 3)
    calls: list[str] = []

    class Loss:
        def head_targets(self, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
            return torch.ones(2, dtype=torch.bool), torch.tensor(2)

        def head_ggn(
            self, h: Any, W: Any, b: Any, dh: Any, dW: Any, db: Any, *rest: Any, **kw: Any
        ) -> Any:
            assert db is None and dW.shape == (1, 5, 3)
            return 2 * dh, torch.full_like(dW, 3.0), None

    def jvp(batch: Any, vecs: list[torch.Tensor]) -> torch.Tensor:
        calls.append("jvp")
        return torch.ones(vecs[0].shape[0], *h.shape)

    def vjp(output: torch.Tensor, u: torch.Tensor, retain: bool) -> list[torch.Tensor | None]:
        calls.append(f"vjp retain={retain}")
        return [u.sum((1, 2)).unsqueeze(1).expand(-1, 2).clone(), None]

    chunked = ChunkedHead(head, Any, Loss(), chunk_rows=None, insist=False)  # type: ignore[arg-type]
    state = OutputState(batch=None, output=h, curvature=Loss().head_targets(None))
    vecs = [torch.randn(1, 2), torch.randn(1, 5, 3)]
    out = chunked.apply(state, vecs, True, params, jvp=jvp, vjp=vjp)
    assert calls == ["jvp", "vjp retain=True"]
    torch.testing.assert_close(out[0], torch.full((1, 2), 12.0))  # Σ of 2·dh over (2, 3)
    torch.testing.assert_close(out[1], torch.full((1, 5, 3), 3.0))  # the head's own part
