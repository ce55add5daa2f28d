import pytest
import torch
from torch import nn

from hessian_eigenthings.param_utils import (
    ParamLayout,
    match_names,
    match_regex,
    params_to_vector,
    select_parameters,
    total_size,
    vector_to_params,
)
from tests.conftest import mlp


def test_select_all_trainable_by_default() -> None:
    model = mlp()
    model[0].bias.requires_grad_(False)
    names = list(select_parameters(model))
    assert names == ["0.weight", "2.weight", "2.bias"]


def test_globs_regex_callables_and_frozen_selection() -> None:
    model = mlp()
    model[0].weight.requires_grad_(False)
    assert list(select_parameters(model, match_names("0.*"))) == ["0.weight", "0.bias"]
    assert list(select_parameters(model, match_regex(r"bias$"))) == ["0.bias", "2.bias"]
    assert list(select_parameters(model, "2.weight")) == ["2.weight"]
    assert list(select_parameters(model, ["2.weight", "0.bias"])) == ["0.bias", "2.weight"]
    assert list(select_parameters(model, lambda n, p: p.dim() == 1)) == ["0.bias", "2.bias"]


def test_empty_selection_names_the_fix() -> None:
    with pytest.raises(ValueError, match="selected zero parameters"):
        select_parameters(mlp(), match_names("nope.*"))
    frozen = mlp().requires_grad_(False)
    with pytest.raises(ValueError, match="requires_grad"):
        select_parameters(frozen)
    with pytest.raises(TypeError):
        select_parameters(mlp(), 3)  # type: ignore[arg-type]


def test_tied_parameters_counted_once() -> None:
    emb = nn.Embedding(5, 3)
    head = nn.Linear(3, 5, bias=False)
    head.weight = emb.weight
    model = nn.Sequential(emb, head)
    assert len(select_parameters(model)) == 1


def test_layout_views_share_storage() -> None:
    model = mlp()
    layout = ParamLayout.from_named(select_parameters(model))
    assert layout.size == sum(p.numel() for p in model.parameters())
    v = torch.arange(layout.size, dtype=torch.float64)
    views = layout.split(v)
    assert [tuple(x.shape) for x in views] == [tuple(p.shape) for p in model.parameters()]
    for x in views:
        assert (
            x.data_ptr() >= v.data_ptr()
            and x.untyped_storage().data_ptr() == v.untyped_storage().data_ptr()
        )
    B = torch.randn(4, layout.size, dtype=torch.float64)
    rows = layout.split_rows(B)
    for i, (r, p) in enumerate(zip(rows, model.parameters(), strict=True)):
        assert r.shape == (4, *p.shape)
        o = layout.offsets[i]
        torch.testing.assert_close(r.reshape(4, -1), B[:, o : o + p.numel()])
        assert r.untyped_storage().data_ptr() == B.untyped_storage().data_ptr()
    with pytest.raises(ValueError):
        layout.split(torch.zeros(layout.size + 1))


def test_layout_rejects_mixed_dtypes_and_devices() -> None:
    a = nn.Parameter(torch.zeros(2))
    b = nn.Parameter(torch.zeros(2, dtype=torch.float64))
    with pytest.raises(ValueError, match="several dtypes"):
        ParamLayout.from_named([("a", a), ("b", b)])
    m = torch.zeros(2, device="meta")
    with pytest.raises(ValueError, match="several devices"):
        ParamLayout.from_named([("a", a), ("m", m)])


def test_vector_roundtrip() -> None:
    model = mlp()
    params = list(model.parameters())
    v = params_to_vector(params)
    w = torch.randn_like(v)
    vector_to_params(w, params)
    torch.testing.assert_close(params_to_vector(params), w)
    with pytest.raises(ValueError):
        vector_to_params(w[:-1], params)


def test_alpha_dict_forms() -> None:
    # the 1.0 alpha's contracts: select_parameters is a dict, total_size counts entries,
    # vector_to_params with a dict returns views of the vector by name (nothing written)
    model = mlp()
    params = select_parameters(model)
    assert isinstance(params, dict) and list(params) == [n for n, _ in model.named_parameters()]
    assert total_size(params) == sum(p.numel() for p in model.parameters())
    assert total_size(list(params.values())) == total_size(params)
    before = params_to_vector(params)
    w = torch.randn_like(before)
    split = vector_to_params(w, params)
    assert list(split) == list(params)
    for name, p in params.items():
        assert split[name].shape == p.shape
        assert split[name].untyped_storage().data_ptr() == w.untyped_storage().data_ptr()
    torch.testing.assert_close(torch.cat([t.reshape(-1) for t in split.values()]), w)
    torch.testing.assert_close(params_to_vector(params), before)  # the model is unchanged
    with pytest.raises(ValueError, match="1-D"):
        vector_to_params(w.reshape(1, -1), params)
    with pytest.raises(ValueError, match="elements"):
        vector_to_params(w[:-1], params)
