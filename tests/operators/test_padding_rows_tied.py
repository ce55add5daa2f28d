"""A padding row that is also read elsewhere (a tied output head): only the padding *lookup* is a
constant (NOTE [padding rows]), the head's use of the row keeps its curvature.

Oracles, float64, built without the package's hook: the model is called through
``torch.func.functional_call(..., tie_weights=False)`` with the embedding's slot given the
weight whose padding row is a detached copy and every other slot (the head) the weight itself;
the Hessian is ``torch.autograd.functional.hessian`` of that function, the GGN ``Jᵀ H J`` from
its Jacobian, the empirical Fisher from its per-sample gradients.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from hessian_eigenthings import (
    EmpiricalFisherOperator,
    GGNOperator,
    HessianOperator,
    JacobianOperator,
)
from hessian_eigenthings.algorithms import diagonal
from hessian_eigenthings.loss_fns import (
    supervised_forward,
    supervised_loss,
    supervised_loss_of_output,
    supervised_per_sample_loss,
)

CE = nn.CrossEntropyLoss()


class RegisteredHead(nn.Module):
    """The issue's model: a linear head registered with the embedding's weight."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(4, 2, padding_idx=0)
        self.head = nn.Linear(2, 4, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.emb(x)))


class FunctionalHead(nn.Module):
    """Tokens averaged over a sequence, the head read as ``F.linear(h, emb.weight)``."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(5, 3, padding_idx=0)
        self.mix = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor, lookup: torch.Tensor | None = None) -> torch.Tensor:
        # ``lookup``: the oracle's weight for the lookup alone (the head reads the same slot)
        e = self.emb(x) if lookup is None else F.embedding(x, lookup, padding_idx=0)
        h = self.mix(torch.tanh(e)).tanh().mean(1)
        return F.linear(h, self.emb.weight)


def _registered() -> tuple[nn.Module, list[Any]]:
    torch.manual_seed(0)
    model = RegisteredHead().double()
    # the issue's repro (no padding id read) and a batch that reads the padding row
    return model, [
        (torch.tensor([1, 2, 3, 1]), torch.tensor([0, 2, 1, 3])),
        (torch.tensor([0, 2, 0]), torch.tensor([1, 0, 3])),
    ]


def _functional() -> tuple[nn.Module, list[Any]]:
    torch.manual_seed(1)
    model = FunctionalHead().double()
    x = torch.tensor([[0, 1, 2], [3, 0, 0], [4, 4, 0], [1, 2, 3], [0, 0, 2]])
    y = torch.tensor([0, 1, 2, 3, 4])
    return model, [(x[:3], y[:3]), (x[3:], y[3:])]


MODELS: dict[str, Callable[[], tuple[nn.Module, list[Any]]]] = {
    "registered": _registered,
    "functional": _functional,
}


def _constant_lookup_call(model: nn.Module) -> tuple[Callable[..., Any], torch.Tensor]:
    """``call(flat, *args)``: the model at the flat parameters with the padding lookups constant,
    and the flat parameters now."""
    named = list(model.named_parameters())
    name_of = {id(p): n for n, p in named}
    slots = list(model.named_parameters(remove_duplicate=False))
    pads = {
        f"{name}.weight": m.padding_idx
        for name, m in model.named_modules()
        if isinstance(m, nn.Embedding) and m.padding_idx is not None
    }
    shapes = [p.shape for _, p in named]
    sizes = [p.numel() for _, p in named]

    def call(flat: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        values = dict(
            zip(
                [n for n, _ in named],
                [v.reshape(s) for v, s in zip(flat.split(sizes), shapes, strict=True)],
                strict=True,
            )
        )
        params: dict[str, torch.Tensor] = {}
        for slot, p in slots:
            v = values[name_of[id(p)]]
            if slot in pads:
                i = pads[slot]
                lookup = torch.cat([v[:i], p.detach()[i : i + 1], v[i + 1 :]])
                if isinstance(model, FunctionalHead):
                    kwargs = {**kwargs, "lookup": lookup}
                else:
                    v = lookup
            params[slot] = v
        return torch.func.functional_call(model, params, args, kwargs, tie_weights=False)

    flat = torch.cat([p.detach().reshape(-1) for _, p in named])
    return call, flat


def _weighted(data: Sequence[Any], per_batch: Callable[[Any], torch.Tensor]) -> torch.Tensor:
    total = sum(len(b[1]) for b in data)
    return sum(len(b[1]) * per_batch(b) for b in data) / total  # type: ignore[return-value]


def _hessian(model: nn.Module, data: Sequence[Any]) -> torch.Tensor:
    call, flat = _constant_lookup_call(model)
    return _weighted(
        data,
        lambda b: torch.autograd.functional.hessian(lambda t: CE(call(t, b[0]), b[1]), flat),
    )


def _ggn(model: nn.Module, data: Sequence[Any]) -> torch.Tensor:
    call, flat = _constant_lookup_call(model)

    def one(b: Any) -> torch.Tensor:
        out = call(flat, b[0]).detach()
        J = torch.autograd.functional.jacobian(lambda t: call(t, b[0]).reshape(-1), flat)
        H = torch.autograd.functional.hessian(
            lambda o: CE(o.reshape(out.shape), b[1]), out.reshape(-1)
        )
        return J.T @ H @ J

    return _weighted(data, one)


def _fisher(model: nn.Module, data: Sequence[Any]) -> torch.Tensor:
    call, flat = _constant_lookup_call(model)
    rows = []
    for x, y in data:
        G = torch.autograd.functional.jacobian(
            lambda t, x=x, y=y: F.cross_entropy(call(t, x), y, reduction="none"), flat
        )
        rows.append(G)
    G = torch.cat(rows)
    return G.T @ G / G.shape[0]


def _op(kind: str, model: nn.Module, data: list[Any], **kw: Any) -> Any:
    if kind == "hessian":
        return HessianOperator(model, data, supervised_loss(CE), **kw)
    if kind == "ggn":
        return GGNOperator(model, data, supervised_forward, supervised_loss_of_output(CE), **kw)
    return EmpiricalFisherOperator(model, data, supervised_per_sample_loss(CE), **kw)


ORACLES = {"hessian": _hessian, "ggn": _ggn, "fisher": _fisher}


def test_the_issue_repro_keeps_the_heads_curvature_of_the_padding_row() -> None:
    model, data = _registered()
    A = HessianOperator(model, data[:1], supervised_loss(CE)).to_dense()
    ref = torch.autograd.functional.hessian(
        lambda W: CE(
            F.linear(torch.tanh(F.embedding(data[0][0], W, padding_idx=0)), W), data[0][1]
        ),
        model.emb.weight.detach().clone(),
    ).reshape(8, 8)
    torch.testing.assert_close(A, ref, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(
        A[0, :3], torch.tensor([0.0484, 0.0090, -0.0432], dtype=A.dtype), atol=1e-4, rtol=0
    )


@pytest.mark.parametrize("which", list(MODELS))
@pytest.mark.parametrize("engine", ["autograd", "functional"])
@pytest.mark.parametrize("kind", ["hessian", "ggn", "fisher"])
def test_tied_padding_row_on_every_engine(kind: str, engine: str, which: str) -> None:
    model, data = MODELS[which]()
    before = [p.detach().clone() for p in model.parameters()]
    ref = ORACLES[kind](model, data)
    A = _op(kind, model, data, engine=engine).to_dense()
    assert ref[0].abs().max() > 1e-3  # the padding row has curvature through the head
    torch.testing.assert_close(A, A.T, rtol=0, atol=1e-12)
    torch.testing.assert_close(A, ref, rtol=1e-9, atol=1e-11)
    # the products leave no hook behind and the weights untouched
    assert all(not m._forward_hooks for m in model.modules())
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


@pytest.mark.parametrize("which", list(MODELS))
def test_tied_padding_row_by_finite_differences(which: str) -> None:
    model, data = MODELS[which]()
    A = HessianOperator(model, data, supervised_loss(CE), method="finite_difference").to_dense()
    torch.testing.assert_close(A, _hessian(model, data), rtol=1e-6, atol=1e-7)


def test_tied_padding_row_compiled() -> None:
    # inductor's C++ backend on the CPU: slow, so one small case
    model, data = _functional()
    op = _op("hessian", model, data, engine="compiled")
    A = op @ torch.eye(op.size, dtype=torch.float64)
    torch.testing.assert_close(A, _hessian(model, data), rtol=1e-9, atol=1e-11)


def test_tied_padding_row_jacobian_both_ways() -> None:
    model, data = _functional()
    x = data[0][0]
    call, flat = _constant_lookup_call(model)
    J_ref = torch.autograd.functional.jacobian(lambda t: call(t, x).reshape(-1), flat)
    J = JacobianOperator(model, [(x, data[0][1])], supervised_forward)
    n = flat.numel()
    torch.testing.assert_close(J @ torch.eye(n, dtype=torch.float64), J_ref, rtol=1e-10, atol=1e-12)
    m = J_ref.shape[0]
    torch.testing.assert_close(
        J.T @ torch.eye(m, dtype=torch.float64), J_ref.T, rtol=1e-10, atol=1e-12
    )


def test_tied_padding_row_exact_diagonal() -> None:
    model, data = _functional()
    op = _op("ggn", model, data)
    d = diagonal(op, method="exact").estimate
    torch.testing.assert_close(d, torch.diagonal(_ggn(model, data)), rtol=1e-9, atol=1e-12)


# -- a tiny HF Llama with tie_word_embeddings=True and a pad_token_id -------------------------

transformers = pytest.importorskip("transformers")


def _llama(attn: str) -> nn.Module:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=11,
        hidden_size=8,
        intermediate_size=8,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=16,
        tie_word_embeddings=True,
        pad_token_id=0,
        attn_implementation=attn,
    )
    return transformers.LlamaForCausalLM(cfg).double().eval()


def _lm_batch() -> dict[str, torch.Tensor]:
    ids = torch.tensor([[5, 3, 7, 2, 0, 0], [4, 9, 1, 6, 8, 3]])
    mask = (ids != 0).long()
    labels = ids.masked_fill(mask == 0, -100)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def _lm_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return model(**batch).loss


@functools.cache
def _llama_hessian(attn: str) -> torch.Tensor:
    model = _llama(attn)
    batch = _lm_batch()
    call, flat = _constant_lookup_call(model)
    with sdpa_kernel(SDPBackend.MATH):  # the one attention kernel with a second derivative
        return torch.autograd.functional.hessian(
            lambda t: call(t, **batch).loss, flat, vectorize=True
        )


@pytest.mark.parametrize(
    ("engine", "attn"),
    [("autograd", "eager"), ("functional", "sdpa"), ("layers", "eager"), ("layers", "sdpa")],
)
def test_tied_llama_with_a_pad_token(engine: str, attn: str) -> None:
    model = _llama(attn)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert model.model.embed_tokens.padding_idx == 0
    batch = _lm_batch()
    ref = _llama_hessian(attn)
    kw: dict[str, Any] = {"engine": engine}
    if engine == "layers":
        kw["layers"] = "model.layers"
    op = HessianOperator(model, [batch], _lm_loss, **kw)
    d = model.model.embed_tokens.weight.shape[1]
    # directions that move the padding row (the first row of the shared weight) and the rest
    V = torch.randn(op.size, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    V[:d, 0] = 0.0
    V[d:, 1] = 0.0
    got, want = op @ V, ref @ V
    assert ref[:d].abs().max() > 1e-3
    # HF's attention takes its softmax in float32 whatever the model's dtype: agreement to float32
    # rounding (the lost head curvature was 12-15% of the matrix on such models)
    assert float((got - want).norm() / want.norm()) < 1e-6
    assert float((got[:d] - want[:d]).norm() / want[:d].norm()) < 1e-5
