"""The Kronecker family's keywords as one record (``operators.factor_options``): declared once,
written out in the constructors' signatures with the defaults they always had, misspellings named
for the class called, and the old names of the factor modules' classes still importable."""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any

import pytest
import torch

import hessian_eigenthings as he
from hessian_eigenthings.loss_fns import cross_entropy_loss_of_output, supervised_forward
from hessian_eigenthings.operators.factor_options import FactorOptions, KroneckerOptions
from tests.conftest import classification_data, mlp

CE = cross_entropy_loss_of_output()

# the keywords and defaults of the constructors before the record (1.0)
SHARED = {
    "fisher_type": "type2",
    "param_filter": None,
    "mc_samples": 1,
    "seed": 0,
    "curvature": None,
    "num_batches": None,
    "separate_bias": True,
    "exclude_unsupported": False,
    "precision": "fp32",
    "column_chunk": 16,
}
KEYWORDS = {
    "KFACOperator": {**SHARED, "kfac_approx": "expand", "ranks": None},
    "EKFACOperator": {**SHARED, "kfac_approx": "expand", "ranks": None},
    # ranks since the data-parallel and sharded KFOC (DDPKFOCOperator, FSDPKFOCOperator)
    "KFOCOperator": {
        **SHARED,
        "weight_sharing": "sample",
        "max_iter": 10,
        "tol": 1e-4,
        "ranks": None,
    },
}
POSITIONAL = ["model", "dataloader", "forward_fn", "loss_of_output_fn"]


def test_the_record_and_its_defaults_name_the_same_keywords() -> None:
    fields = {f.name: f.default for f in dataclasses.fields(FactorOptions)}
    assert list(KroneckerOptions.__annotations__) == list(SHARED)
    assert fields == {**SHARED, "kfac_approx": "expand"}


@pytest.mark.parametrize("name", list(KEYWORDS))
def test_the_signature_writes_the_record_out(name: str) -> None:
    params = inspect.signature(getattr(he, name)).parameters
    assert list(params)[:4] == POSITIONAL
    keywords = {n: p.default for n, p in params.items() if n not in POSITIONAL}
    assert keywords == KEYWORDS[name]
    assert all(params[n].kind is inspect.Parameter.KEYWORD_ONLY for n in keywords)
    assert all(params[n].annotation is not inspect.Parameter.empty for n in keywords)


@pytest.mark.parametrize("name", list(KEYWORDS))
def test_every_keyword_given_its_default_builds_the_same_operator(name: str) -> None:
    torch.manual_seed(0)
    model = mlp().double()
    data = [(x.double(), y) for x, y in classification_data(n=6, batch=3)]
    cls = getattr(he, name)
    plain = cls(model, data, supervised_forward, CE)
    given = cls(model, data, supervised_forward, CE, **KEYWORDS[name])
    for a, b in zip(plain.factors, given.factors, strict=True):
        assert a.names == b.names and a.module == b.module
        assert torch.equal(a.G, b.G) and torch.equal(a.A, b.A)
    for attribute in ("fisher_type", "mc_samples", "seed", "column_chunk", "separate_bias"):
        assert getattr(given, attribute) == SHARED[attribute]
    assert given.precision == "fp32"


@pytest.mark.parametrize(
    ("name", "typo", "meant"),
    [
        ("KFACOperator", "column_chunks", "column_chunk"),
        ("EKFACOperator", "kfac_aprox", "kfac_approx"),
        ("KFOCOperator", "weight_share", "weight_sharing"),
        ("KFOCOperator", "excluded_unsupported", "exclude_unsupported"),
    ],
)
def test_a_misspelt_keyword_names_the_class_called(name: str, typo: str, meant: str) -> None:
    kw: dict[str, Any] = {typo: 1}
    with pytest.raises(TypeError) as info:
        getattr(he, name)(mlp(), classification_data(n=6, batch=3), supervised_forward, CE, **kw)
    assert str(info.value) == (
        f"{name}() got an unexpected keyword argument {typo!r}; did you mean {meant!r}?"
    )


def test_kfoc_takes_no_kfac_approx() -> None:
    kw: dict[str, Any] = {"kfac_approx": None}
    with pytest.raises(
        TypeError, match=r"^KFOCOperator\(\) got an unexpected keyword argument 'kfac_approx'"
    ):
        he.KFOCOperator(mlp(), classification_data(n=6, batch=3), supervised_forward, CE, **kw)


def test_the_old_names_of_the_factor_modules_classes_still_import() -> None:
    from hessian_eigenthings.operators.factor_pass import FactorModule, Layer
    from hessian_eigenthings.operators.kfac import (
        LayerKroneckerOperator,
        ModuleKroneckerOperator,
    )

    assert Layer is FactorModule
    assert LayerKroneckerOperator is ModuleKroneckerOperator
    assert issubclass(he.KFOCOperator, ModuleKroneckerOperator)
