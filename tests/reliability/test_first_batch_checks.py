"""A new user's mistakes with the data operators, said in one line with the fix: a misspelt
keyword names the class the user called and the keyword meant; targets that the criterion of a
supervised helper cannot take are refused when the operator is built (dtype, shape, negative
labels) or at the helper's first call (labels past the classes, a model that returns a tuple),
never as torch's own error (NOTE [targets checked against the criterion])."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import hessian_eigenthings as he
from hessian_eigenthings.loss_fns import (
    supervised_forward,
    supervised_loss,
    supervised_loss_of_output,
    supervised_per_sample_loss,
)

X = torch.randn(8, 5, generator=torch.Generator().manual_seed(0))
LABELS = torch.tensor([0, 1, 2, 1, 0, 1, 2, 0])


def _hessian(model: nn.Module, data: Any, criterion: Any, **kw: Any) -> Any:
    return he.HessianOperator(model, data, supervised_loss(criterion), **kw)


def _ggn(model: nn.Module, data: Any, criterion: Any, **kw: Any) -> Any:
    return he.GGNOperator(
        model, data, supervised_forward, supervised_loss_of_output(criterion), **kw
    )


def _fisher(model: nn.Module, data: Any, criterion: Any, **kw: Any) -> Any:
    return he.EmpiricalFisherOperator(model, data, supervised_per_sample_loss(criterion), **kw)


def _kfac(model: nn.Module, data: Any, criterion: Any, **kw: Any) -> Any:
    return he.KFACOperator(
        model, data, supervised_forward, supervised_loss_of_output(criterion), **kw
    )


DATA_OPERATORS: dict[str, Callable[..., Any]] = {
    "HessianOperator": _hessian,
    "GGNOperator": _ggn,
    "EmpiricalFisherOperator": _fisher,
}
LABELS_OF: dict[Callable[..., Any], str] = {
    _hessian: "supervised_loss",
    _ggn: "supervised_loss_of_output",
    _fisher: "supervised_per_sample_loss",
    _kfac: "supervised_loss_of_output",
}


# -- a: a misspelt keyword -------------------------------------------------------------


@pytest.mark.parametrize("name", list(DATA_OPERATORS))
@pytest.mark.parametrize(
    ("typo", "meant"),
    [
        ("microbatchsize", "microbatch_size"),
        ("graphreuse", "graph_reuse"),
        ("max_blocksize", "max_block_size"),
    ],
)
def test_misspelt_keyword_names_the_class_called_and_the_close_match(
    name: str, typo: str, meant: str
) -> None:
    make = DATA_OPERATORS[name]
    with pytest.raises(TypeError) as info:
        make(nn.Linear(5, 3), [(X, LABELS)], nn.CrossEntropyLoss(), **{typo: 16})
    assert str(info.value) == (
        f"{name}() got an unexpected keyword argument {typo!r}; did you mean {meant!r}?"
    )
    assert "DataOperatorSetup" not in str(info.value)


def test_unknown_keyword_without_a_close_match() -> None:
    with pytest.raises(
        TypeError, match=r"^HessianOperator\(\) got an unexpected keyword argument 'zzz'$"
    ):
        _hessian(nn.Linear(5, 3), [(X, LABELS)], nn.CrossEntropyLoss(), zzz=1)


# -- b: targets the criterion cannot take --------------------------------------------------

ALL = [_hessian, _ggn, _fisher, _kfac]


@pytest.mark.parametrize("make", ALL)
def test_float_labels_for_cross_entropy_refused_at_construction(make: Callable[..., Any]) -> None:
    with pytest.raises(TypeError) as info:
        make(nn.Linear(5, 3), [(X, LABELS.float())], nn.CrossEntropyLoss())
    message = str(info.value)
    assert message.startswith(f"{LABELS_OF[make]}(CrossEntropyLoss): labels must be class indices")
    assert "float32 labels of shape (8,)" in message and ".long()" in message
    assert "\n" not in message


@pytest.mark.parametrize("make", ALL)
def test_int32_and_negative_labels_refused_at_construction(make: Callable[..., Any]) -> None:
    with pytest.raises(TypeError, match=r"int32 labels .*convert them with \.long\(\)"):
        make(nn.Linear(5, 3), [(X, LABELS.int())], nn.CrossEntropyLoss())
    negative = LABELS.clone()
    negative[3] = -1
    with pytest.raises(ValueError, match=r"class indices >= 0 \(or ignore_index=-100\); got -1"):
        make(nn.Linear(5, 3), [(X, negative)], nn.CrossEntropyLoss())


@pytest.mark.parametrize("make", [_hessian, _ggn, _fisher])
def test_integer_labels_for_mse_refused_at_construction(make: Callable[..., Any]) -> None:
    with pytest.raises(TypeError) as info:
        make(nn.Linear(5, 1), [(X, LABELS)], nn.MSELoss())
    assert str(info.value) == (
        f"{LABELS_OF[make]}(MSELoss): MSELoss got int64 labels of shape (8,); convert them with "
        ".float() (or nn.CrossEntropyLoss() for class indices)"
    )


@pytest.mark.parametrize("make", ALL)
def test_labels_past_the_classes_said_at_the_first_product(make: Callable[..., Any]) -> None:
    """The number of classes is the model output's: known at the first forward (KFAC's is at
    construction); one clear line in place of torch's IndexError (or of nothing at all: the
    GGN's closed-form cross-entropy Hessian does not read the labels)."""
    labels = LABELS.clone()
    labels[3] = 7
    expected = (
        f"{LABELS_OF[make]}(CrossEntropyLoss): labels must be class indices in [0, 3) (int64); "
        "got values up to 7"
    )
    with pytest.raises(ValueError) as info:
        op = make(nn.Linear(5, 3), [(X, labels)], nn.CrossEntropyLoss())
        op.matvec(torch.randn(op.size))
    assert str(info.value) == expected


class _ReturnsTuple(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(5, 3)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.linear(x), x


@pytest.mark.parametrize("make", [_hessian, _fisher])
def test_model_returning_a_tuple(make: Callable[..., Any]) -> None:
    op = make(_ReturnsTuple(), [(X, LABELS)], nn.CrossEntropyLoss())
    with pytest.raises(TypeError) as info:
        op.matvec(torch.randn(op.size))
    message = str(info.value)
    assert message.startswith(
        f"{LABELS_OF[make]}(CrossEntropyLoss): the model returned a tuple of 2 items, not a tensor; "
        "wrap the model so that it returns the logits"
    )


@pytest.mark.parametrize("make", ALL)
def test_what_cross_entropy_takes_still_passes(make: Callable[..., Any]) -> None:
    """ignore_index labels, uint8 labels and class probabilities are cross-entropy's own."""
    model = nn.Linear(5, 3)
    ignored = LABELS.clone()
    ignored[3] = -100
    probabilities = torch.softmax(torch.randn(8, 3, generator=torch.Generator().manual_seed(1)), 1)
    for y in (ignored, LABELS.to(torch.uint8), probabilities):
        op = make(model, [(X, y)], nn.CrossEntropyLoss())
        assert torch.isfinite(op.matvec(torch.ones(op.size))).all()
    all_ignored = torch.full((8,), -100)
    _hessian(model, [(X, all_ignored)], nn.CrossEntropyLoss())  # nothing to check: no error


def test_the_first_batch_is_read_once_at_construction() -> None:
    """The targets' check reads the batch the construction's other checks read: one iteration."""

    class Counting:
        def __init__(self) -> None:
            self.iterations = 0

        def __iter__(self) -> Any:
            self.iterations += 1
            return iter([(X, LABELS)])

    data = Counting()
    _hessian(nn.Linear(5, 3), data, nn.CrossEntropyLoss())
    assert data.iterations == 1


def test_the_range_check_syncs_once_when_built_and_never_in_a_product() -> None:
    """The label range is read once, when the operator is built (one host sync there); products
    compare it with the output's classes without reading anything (no sync on the product path)."""
    from hessian_eigenthings.loss_fns.standard import TargetCheck

    reads = []
    original = TargetCheck._range

    def counted(self: TargetCheck, y: torch.Tensor) -> object:
        reads.append(1)
        return original(self, y)

    TargetCheck._range = counted  # type: ignore[method-assign,assignment]
    try:
        loss = supervised_loss(nn.CrossEntropyLoss())
        op = he.HessianOperator(nn.Linear(5, 3), [(X, LABELS)], loss, graph_reuse=False)
        assert len(reads) == 1
        for _ in range(3):
            op.matvec(torch.randn(op.size))
        assert len(reads) == 1
    finally:
        TargetCheck._range = original  # type: ignore[method-assign]


def test_labels_past_the_classes_without_a_construction_check_sync_once() -> None:
    """A helper called outside an operator reads the range on its first call only."""
    from hessian_eigenthings.loss_fns.standard import target_check

    loss = supervised_loss(nn.CrossEntropyLoss())
    check = target_check(loss)
    assert check is not None
    reads = []
    original = check._range
    check._range = lambda y: reads.append(1) or original(y)  # type: ignore[method-assign]
    model = nn.Linear(5, 3)
    for _ in range(3):
        loss(model, (X, LABELS))
    assert len(reads) == 1
