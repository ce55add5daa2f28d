"""Data mistakes caught when an operator is built: one batch passed where an iterable of batches
is expected, batches the loss helper cannot read, data of another dtype than the model."""

from __future__ import annotations

import random

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import hessian_eigenthings as he
from hessian_eigenthings.batching import BatchSource, looks_like_one_batch
from hessian_eigenthings.loss_fns import (
    cross_entropy_loss_of_output,
    supervised_forward,
    supervised_loss,
    supervised_loss_of_output,
    supervised_per_sample_loss,
)
from hessian_eigenthings.loss_fns.checks import check_first_batch
from tests.conftest import classification_data, mlp

CE = nn.CrossEntropyLoss()


def _xy(n: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(n, 5, dtype=torch.float64), torch.randint(0, 3, (n,))


# -- one batch passed as the data -------------------------------------------------------------
@pytest.mark.parametrize("wrap", [tuple, list], ids=["tuple", "list"])
def test_one_supervised_batch_as_the_data_is_refused(wrap: type) -> None:
    x, y = _xy()
    with pytest.raises(TypeError, match=r"did you mean \[\(x, y\)\]"):
        BatchSource(wrap((x, y)))


def test_one_dict_batch_as_the_data_is_refused() -> None:
    with pytest.raises(TypeError, match=r"did you mean \[batch\]"):
        BatchSource({"input_ids": torch.zeros(2, 4, dtype=torch.long)})


def test_one_batch_of_three_and_nested_inputs() -> None:
    x, y = _xy()
    with pytest.raises(TypeError, match=r"did you mean \[\(x, y, w\)\]"):
        BatchSource((x, y, torch.ones(8)))
    with pytest.raises(TypeError, match=r"did you mean \[\(x, y\)\]"):
        BatchSource(({"input_ids": torch.zeros(8, 4, dtype=torch.long)}, y))


@pytest.mark.parametrize(
    "data",
    [
        lambda: [torch.randn(4, 5), torch.randn(4, 5)],  # bare tensor batches, same shape
        lambda: (torch.randn(4, 5), torch.randn(2, 5)),  # a smaller last batch
        lambda: [torch.randn(4, 5)],
        lambda: [
            torch.randint(0, 9, (4, 7)),
            torch.randint(0, 9, (4, 9)),
        ],  # token batches, other lengths
        lambda: [_xy(), _xy()],
        lambda: [_xy(4), _xy(2)],
        lambda: [(torch.randn(8, 5), torch.randn(8, 5))],
        lambda: [{"input_ids": torch.zeros(2, 4)}, {"input_ids": torch.zeros(2, 6)}],
        lambda: [],
    ],
)
def test_legitimate_data_is_not_mistaken_for_one_batch(data: object) -> None:
    d = data()  # type: ignore[operator]
    assert not looks_like_one_batch(d)
    BatchSource(d)


def test_regression_batch_as_the_data_is_caught_by_the_loss_check() -> None:
    """(x, y) of one dtype and rank could be two bare-tensor batches; a supervised helper's
    first 'batch' is then a tensor, which the first-batch check explains."""
    x, y = torch.randn(8, 3, dtype=torch.float64), torch.randn(8, 3, dtype=torch.float64)
    source = BatchSource((x, y))
    with pytest.raises(TypeError, match=r"did you mean \[\(x, y\)\]"):
        check_first_batch(mlp(3, 4, 3), source.first_batch(), supervised_loss(nn.MSELoss()))


@pytest.mark.parametrize(
    "build",
    [
        lambda m, d: he.HessianOperator(m, d, supervised_loss(CE)),
        lambda m, d: he.GGNOperator(m, d, supervised_forward, supervised_loss_of_output(CE)),
        lambda m, d: he.EmpiricalFisherOperator(m, d, supervised_per_sample_loss(CE)),
        lambda m, d: he.KFACOperator(m, d, supervised_forward, supervised_loss_of_output(CE)),
    ],
    ids=["hessian", "ggn", "fisher", "kfac"],
)
def test_operators_refuse_one_batch(build: object) -> None:
    with pytest.raises(TypeError, match=r"did you mean \[\(x, y\)\]"):
        build(mlp(), _xy())  # type: ignore[operator]


# -- the first batch, read without side effects ------------------------------------------------
def test_first_batch_leaves_the_rng_and_the_cycle_alone() -> None:
    x, y = _xy(12)
    loader = DataLoader(TensorDataset(x, y), batch_size=4, shuffle=True)
    source = BatchSource(loader)
    torch.manual_seed(3)
    random.seed(3)
    first = source.first_batch()
    after = torch.rand(4), random.random()
    torch.manual_seed(3)
    random.seed(3)
    assert torch.equal(after[0], torch.rand(4)) and after[1] == random.random()
    assert isinstance(first, list) and first[0].shape == (4, 5)

    data = classification_data()
    cycling = BatchSource(data, full_dataset=False)
    assert cycling.first_batch() is data[0]
    assert next(cycling.batches()) is data[0]  # the peek did not advance the cycle
    assert cycling.first_batch() is data[0]
    assert next(cycling.batches()) is data[1]
    assert BatchSource([]).first_batch() is None


# -- what the loss helper will read ------------------------------------------------------------
def test_dtype_mismatch_names_both_fixes() -> None:
    model = mlp()  # float64
    x, y = _xy()
    batch = (x.float(), y)
    for loss in (supervised_loss(CE), supervised_per_sample_loss(CE)):
        with pytest.raises(
            TypeError,
            match=r"model parameters are float64 but the batch's inputs are float32: "
            r"convert the data \(x\.double\(\)\) or the model \(model\.float\(\)\)",
        ):
            check_first_batch(model, batch, loss)
    with pytest.raises(TypeError, match="float64"):
        check_first_batch(model, batch, supervised_forward, supervised_loss_of_output(CE))
    with pytest.raises(
        TypeError,
        match=r"float32 but the batch's inputs are float64: convert the data \(x\.float\(\)\)",
    ):
        check_first_batch(mlp().float(), (x, y), supervised_loss(CE))


def test_matching_or_unknown_layouts_pass() -> None:
    model = mlp()
    x, y = _xy()
    check_first_batch(model, (x, y), supervised_loss(CE))
    check_first_batch(model, None, supervised_loss(CE))  # no batch to look at
    # integer inputs (token ids) carry no dtype to match
    emb = nn.Sequential(nn.Embedding(9, 3), nn.Flatten(), nn.Linear(12, 3)).double()
    check_first_batch(emb, (torch.randint(0, 9, (8, 4)), y), supervised_loss(CE))
    # a loss of the user's own may cast the inputs itself: not ours to judge
    check_first_batch(model, (x.float(), y), lambda m, b: CE(m(b[0].double()), b[1]))
    # a closed-form loss of the output reads only the targets
    check_first_batch(
        model, (x.float(), y), lambda m, b: m(b[0].double()), cross_entropy_loss_of_output()
    )


def test_dict_batches_with_a_supervised_helper_are_refused() -> None:
    batch = {
        "input_ids": torch.zeros(2, 4, dtype=torch.long),
        "labels": torch.zeros(2, 4, dtype=torch.long),
    }
    with pytest.raises(
        TypeError,
        match=r"supervised_loss\(\.\.\.\) reads batches \(inputs, targets\).*dict with keys "
        r"\['input_ids', 'labels'\].*hf_lm_loss\(\)",
    ):
        check_first_batch(mlp(), batch, supervised_loss(CE))
    with pytest.raises(
        TypeError, match=r"CrossEntropyOutputLoss reads batches \(inputs, targets\)"
    ):
        check_first_batch(
            mlp(), batch, lambda m, b: m(b["input_ids"]), cross_entropy_loss_of_output()
        )
    with pytest.raises(TypeError, match=r"a list of length 1"):
        check_first_batch(mlp(), [torch.zeros(2, 5)], supervised_loss(CE))


# -- end to end: needs the operators to call check_first_batch at construction ------------------
def test_operators_check_the_first_batch_at_construction() -> None:
    """Fails until operators/*.py call loss_fns.checks.check_first_batch (see the lead's wiring)."""
    x, y = _xy()
    data = [(x.float(), y)]
    with pytest.raises(
        TypeError, match="model parameters are float64 but the batch's inputs are float32"
    ):
        he.HessianOperator(mlp(), data, supervised_loss(CE))
    with pytest.raises(TypeError, match="model parameters are float64"):
        he.GGNOperator(mlp(), data, supervised_forward, supervised_loss_of_output(CE))
    with pytest.raises(TypeError, match="model parameters are float64"):
        he.EmpiricalFisherOperator(mlp(), data, supervised_per_sample_loss(CE))
    with pytest.raises(TypeError, match="model parameters are float64"):
        he.KFACOperator(mlp(), data, supervised_forward, supervised_loss_of_output(CE))
    dicts = [{"input_ids": torch.zeros(2, 4, dtype=torch.long)}]
    with pytest.raises(TypeError, match=r"reads batches \(inputs, targets\)"):
        he.HessianOperator(mlp(), dicts, supervised_loss(CE))


# -- a DataLoader that yields no batch ------------------------------------------------------------
def test_drop_last_with_a_batch_larger_than_the_dataset_says_so() -> None:
    """drop_last=True and batch_size=128 over 64 samples: every sample is dropped; the message
    says that (not "check that the dataset is not empty"), for every data operator and both
    ways of reading the data."""
    x, y = _xy(64)
    loader = DataLoader(TensorDataset(x, y), batch_size=128, drop_last=True)
    expected = (
        "the DataLoader yielded no batch: drop_last=True with batch_size=128 drops every sample of a "
        "dataset of 64; use drop_last=False or a batch_size of at most 64"
    )
    makers = [
        lambda **kw: he.HessianOperator(mlp(), loader, supervised_loss(CE), **kw),
        lambda **kw: he.GGNOperator(
            mlp(), loader, supervised_forward, supervised_loss_of_output(CE), **kw
        ),
        lambda **kw: he.EmpiricalFisherOperator(
            mlp(), loader, supervised_per_sample_loss(CE), **kw
        ),
    ]
    for make in makers:
        for full_dataset in (True, False):
            op = make(full_dataset=full_dataset)
            with pytest.raises(ValueError) as info:
                op.matvec(torch.randn(op.size, dtype=op.dtype))
            assert str(info.value) == expected


def test_empty_data_messages() -> None:
    from hessian_eigenthings.batching import no_batch_message

    x, y = _xy(0)
    assert no_batch_message(DataLoader(TensorDataset(x, y), batch_size=4)) == (
        "the DataLoader yielded no batch: its dataset is empty"
    )
    assert no_batch_message([]) == (
        "the dataloader yielded no batch; check that the dataset is not empty"
    )
    x, y = _xy(64)
    # a batch_size the dataset fills once: not the drop_last case
    loader = DataLoader(TensorDataset(x, y), batch_size=64, drop_last=True)
    assert "drop_last" not in no_batch_message(loader)
