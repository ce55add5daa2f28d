"""One pattern of a ``param_filter`` list that matches nothing is a typo until shown otherwise: warn,
naming the pattern and the parameter names close to it."""

from __future__ import annotations

import warnings

import pytest
import torch

import hessian_eigenthings as he
from hessian_eigenthings.loss_fns import supervised_loss
from hessian_eigenthings.param_utils import (
    ParamFilterWarning,
    match_names,
    match_regex,
    select_parameters,
)
from tests.conftest import classification_data, mlp


@pytest.mark.parametrize(
    "flt",
    [["2.weight", "2.bais"], ("2.weight", "2.bais"), match_names("2.weight", "2.bais")],
    ids=["list", "tuple", "match_names"],
)
def test_a_glob_matching_nothing_warns_with_close_names(flt: object) -> None:
    with pytest.warns(ParamFilterWarning, match=r"'2\.bais' matches no parameter") as rec:
        names = list(select_parameters(mlp(), flt))  # type: ignore[arg-type]
    assert names == ["2.weight"]
    assert len(rec) == 1
    assert "2.bias" in str(rec[0].message)
    assert rec[0].filename == __file__


def test_a_regex_matching_nothing_warns() -> None:
    with pytest.warns(ParamFilterWarning, match=r"'\^2\\\.bais\$' matches no parameter"):
        names = list(select_parameters(mlp(), match_regex(r"^2\.weight$", r"^2\.bais$")))
    assert names == ["2.weight"]


def test_no_warning_when_every_pattern_selects() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        select_parameters(mlp(), ["2.weight", "2.bias"])
        select_parameters(mlp(), "2.*")
        select_parameters(mlp(), match_names("*.bias", "0.*"))
        select_parameters(mlp(), match_regex("bias$"))
        select_parameters(
            mlp(), lambda n, p: n.endswith(("bais", "weight"))
        )  # a callable's intent is its own
        # a glob matching only a frozen or tied alias still counts as matching
        emb = torch.nn.Embedding(4, 3)
        tied = torch.nn.ModuleDict({"a": emb, "b": torch.nn.Linear(3, 4, bias=False)})
        tied["b"].weight = emb.weight
        select_parameters(tied, ["a.weight", "b.weight"])


def test_all_patterns_missing_is_still_an_error_with_close_names() -> None:
    with pytest.raises(ValueError, match="selected zero parameters") as err:
        select_parameters(mlp(), ["2.wieght"])
    assert "'2.wieght' matches no parameter; close names: 2.weight" in str(err.value)


def test_operator_warns_at_the_user_line() -> None:
    with pytest.warns(ParamFilterWarning, match="2.bais") as rec:
        op = he.HessianOperator(
            mlp(),
            classification_data(),
            supervised_loss(torch.nn.CrossEntropyLoss()),
            param_filter=["2.weight", "2.bais"],
        )
    assert op.size == 7 * 3
    assert rec[0].filename == __file__


def test_callables_of_any_kind_are_accepted_without_a_check() -> None:
    class Unhashable:
        __slots__ = ()
        __hash__ = None  # type: ignore[assignment]

        def __call__(self, name: str, p: torch.nn.Parameter) -> bool:
            return name.startswith("2.")

    assert list(select_parameters(mlp(), Unhashable())) == ["2.weight", "2.bias"]
