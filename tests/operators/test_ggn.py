"""GGNOperator against dense float64 ``Jᵀ H_L J`` (reverse-mode torch.func) on small models."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hessian_eigenthings.loss_fns import (
    OutputHessianLoss,
    hf_lm_forward,
    hf_lm_loss_of_output,
    mse_loss_of_output,
    supervised_forward,
    supervised_loss,
    supervised_loss_of_output,
)
from hessian_eigenthings.operators import GGNOperator, HessianOperator
from hessian_eigenthings.param_utils import match_names, select_parameters
from tests.conftest import SmallCNN, classification_data, mlp
from tests.operators.contract import assert_unchanged, check_contract, snapshot
from tests.operators.curvature_oracles import dense_ggn

CE = nn.CrossEntropyLoss()
CE_OUT = supervised_loss_of_output(CE)


def ggn_dense(model, data, loss=CE_OUT, flt=None):
    return dense_ggn(model, data, supervised_forward, loss, select_parameters(model, flt))


@pytest.mark.parametrize("reuse", [False, True])
def test_mlp_cross_entropy_uneven_batches(reuse: bool) -> None:
    model, data = mlp(), classification_data(n=10, batch=4)  # batches of 4, 4, 2
    op = GGNOperator(model, data, supervised_forward, CE_OUT, graph_reuse=reuse)
    check_contract(op, ggn_dense(model, data), model)
    assert op.jvp_method == "forward_mode"


def test_linear_model_cross_entropy_ggn_is_the_hessian() -> None:
    # f is linear in θ: the dropped term of the Hessian vanishes
    model = nn.Linear(5, 3).double()
    data = classification_data(n=9, batch=4)
    G = GGNOperator(model, data, supervised_forward, CE_OUT).to_dense()
    H = HessianOperator(model, data, supervised_loss(CE)).to_dense()
    torch.testing.assert_close(G, H, rtol=1e-10, atol=1e-12)


def test_mse_closed_form() -> None:
    model = mlp(d_out=2)
    X = torch.randn(7, 5, dtype=torch.float64)
    Y = torch.randn(7, 2, dtype=torch.float64)
    data = [(X[:4], Y[:4]), (X[4:], Y[4:])]
    loss = mse_loss_of_output()
    op = GGNOperator(model, data, supervised_forward, loss)
    check_contract(op, ggn_dense(model, data, loss), model)
    # MSE: H_L = 2I/numel, so G = 2 JᵀJ / numel per batch
    torch.testing.assert_close(
        op.to_dense(),
        GGNOperator(model, data, supervised_forward, loss, loss_hvp="autograd").to_dense(),
        rtol=1e-10,
        atol=1e-12,
    )


def test_autograd_loss_hessian_equals_analytical() -> None:
    model, data = mlp(), classification_data(n=10, batch=4)
    analytical = GGNOperator(model, data, supervised_forward, CE_OUT)
    autograd = GGNOperator(model, data, supervised_forward, CE_OUT, loss_hvp="autograd")
    V = torch.randn(analytical.size, 6, dtype=torch.float64)
    torch.testing.assert_close(autograd @ V, analytical @ V, rtol=1e-10, atol=1e-12)


def test_loss_without_closed_form_by_autograd() -> None:
    model, data = mlp(), classification_data()
    y_onehot = [(x, nn.functional.one_hot(y, 3).double()) for x, y in data]
    huber = supervised_loss_of_output(nn.HuberLoss(delta=0.3))
    assert not isinstance(huber, OutputHessianLoss)
    op = GGNOperator(model, y_onehot, supervised_forward, huber, loss_hvp="autograd")
    check_contract(op, ggn_dense(model, y_onehot, huber), model)


def test_analytical_without_hvp_is_refused_with_the_fix() -> None:
    model, data = mlp(), classification_data()
    with pytest.raises(ValueError, match="loss_hvp='autograd'"):
        GGNOperator(model, data, supervised_forward, lambda out, batch: CE(out, batch[1]))
    with pytest.raises(ValueError, match="loss_hvp"):
        GGNOperator(model, data, supervised_forward, CE_OUT, loss_hvp="exact")  # type: ignore[arg-type]


def test_forward_mode_and_finite_difference_agree() -> None:
    model, data = mlp(), classification_data(n=10, batch=4)
    fwd = GGNOperator(model, data, supervised_forward, CE_OUT)
    fd = GGNOperator(model, data, supervised_forward, CE_OUT, jvp="finite_difference")
    V = torch.randn(fwd.size, 4, dtype=torch.float64)
    torch.testing.assert_close(fd @ V, fwd @ V, rtol=1e-7, atol=1e-9)
    assert fd.jvp_method == "finite_difference"
    # a single vector takes the forward-mode path without vmap
    v = V[:, 0].contiguous()
    torch.testing.assert_close(fwd @ v, (fwd @ V)[:, 0], rtol=1e-12, atol=1e-14)


class _TanhNoForwardAD(torch.autograd.Function):
    """tanh with a backward but no forward-mode formula (like many fused kernels)."""

    @staticmethod
    def forward(ctx, x):  # type: ignore[no-untyped-def]
        y = torch.tanh(x)
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx, g):  # type: ignore[no-untyped-def]
        (y,) = ctx.saved_tensors
        return g * (1 - y * y)


class _FusedMLP(nn.Module):
    def __init__(self, fused: bool) -> None:
        super().__init__()
        self.fc1, self.fc2, self.fused = nn.Linear(5, 7), nn.Linear(7, 3), fused

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc1(x)
        return self.fc2(_TanhNoForwardAD.apply(h) if self.fused else torch.tanh(h))


def test_finite_difference_fallback_when_forward_mode_is_missing() -> None:
    model = _FusedMLP(fused=True).double()
    reference = _FusedMLP(fused=False).double()
    reference.load_state_dict(model.state_dict())
    data = classification_data(n=10, batch=4)
    op = GGNOperator(model, data, supervised_forward, CE_OUT)
    check_contract(op, ggn_dense(reference, data), model, rtol=1e-6, atol=1e-8)
    assert op.jvp_method == "finite_difference"


def test_graph_reuse_equals_fresh_and_saves_forwards() -> None:
    model, data = mlp(), classification_data(n=6, batch=6)
    fresh = GGNOperator(model, data, supervised_forward, CE_OUT, graph_reuse=False)
    kept = GGNOperator(model, data, supervised_forward, CE_OUT, graph_reuse=True)
    V = torch.randn(fresh.size, 3, dtype=torch.float64)
    for _ in range(3):
        torch.testing.assert_close(kept @ V, fresh @ V, rtol=1e-12, atol=1e-14)
    assert kept.num_forwards == 1 and fresh.num_forwards == 3
    with torch.no_grad():  # parameters move: the kept graph is stale
        model[0].bias.add_(0.1)
    torch.testing.assert_close(kept @ V, fresh @ V, rtol=1e-12, atol=1e-14)
    assert kept.num_forwards == 2


def test_weighting_is_by_batch_size() -> None:
    model, data = mlp(), classification_data(n=10, batch=4)
    X = torch.cat([b[0] for b in data])
    Y = torch.cat([b[1] for b in data])
    whole = GGNOperator(model, [(X, Y)], supervised_forward, CE_OUT)
    split = GGNOperator(model, data, supervised_forward, CE_OUT)
    micro = GGNOperator(model, [(X, Y)], supervised_forward, CE_OUT, microbatch_size=3)
    V = torch.randn(whole.size, 2, dtype=torch.float64)
    torch.testing.assert_close(split @ V, whole @ V, rtol=1e-12, atol=1e-13)
    torch.testing.assert_close(micro @ V, whole @ V, rtol=1e-12, atol=1e-13)


def test_param_filter_subset() -> None:
    model, data = mlp(), classification_data()
    flt = match_names("2.*")
    op = GGNOperator(model, data, supervised_forward, CE_OUT, param_filter=flt)
    assert op.size == 7 * 3 + 3
    check_contract(op, ggn_dense(model, data, flt=flt), model)


def test_frozen_parameter_selected_explicitly_stays_frozen() -> None:
    model, data = mlp(), classification_data()
    model[0].weight.requires_grad_(False)
    flt = match_names("0.weight")
    op = GGNOperator(model, data, supervised_forward, CE_OUT, param_filter=flt)
    check_contract(op, ggn_dense(model, data, flt=flt), model)
    assert not model[0].weight.requires_grad


@pytest.mark.parametrize("mode", ["eval", "train"])
def test_cnn_with_batchnorm(mode: str) -> None:
    model = SmallCNN().double().train(mode == "train")
    X = torch.randn(6, 2, 4, 4, dtype=torch.float64)
    Y = torch.randint(0, 4, (6,))
    data = [(X[:4], Y[:4]), (X[4:], Y[4:])]
    op = GGNOperator(model, data, supervised_forward, CE_OUT)
    check_contract(op, ggn_dense(model, data), model)  # includes: running statistics untouched


class _Boom(RuntimeError):
    pass


@pytest.mark.parametrize("where", ["hvp", "jvp_forward", "fd_forward"])
def test_model_state_restored_when_the_loss_raises(where: str) -> None:
    model, data = mlp(), classification_data()
    model.train()
    model[2].weight.requires_grad_(False)
    model[0].bias.grad = torch.ones_like(model[0].bias)
    calls = {"n": 0}

    def forward(m: nn.Module, batch):  # type: ignore[no-untyped-def]
        calls["n"] += 1
        if where != "hvp" and calls["n"] == 2:  # the Jacobian-vector pass (forward mode or FD)
            raise _Boom("mid-way")
        return m(batch[0])

    class Loss:
        def __call__(self, out, batch):  # type: ignore[no-untyped-def]
            return CE(out, batch[1])

        def hvp(self, out, batch, u):  # type: ignore[no-untyped-def]
            raise _Boom("mid-way")

    loss = Loss() if where == "hvp" else CE_OUT
    jvp = "finite_difference" if where == "fd_forward" else "forward_mode"
    op = GGNOperator(model, data, forward, loss, param_filter=lambda n, p: True, jvp=jvp)
    before = snapshot(model)
    with pytest.raises(_Boom):
        op @ torch.randn(op.size, dtype=torch.float64)
    assert_unchanged(model, before)
    assert model.training and not model[2].weight.requires_grad


def test_input_validation() -> None:
    model, data = mlp(), classification_data()
    with pytest.raises(TypeError, match="forward_fn"):
        GGNOperator(model, data, None, CE_OUT)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="jvp"):
        GGNOperator(model, data, supervised_forward, CE_OUT, jvp="reverse")  # type: ignore[arg-type]
    op = GGNOperator(model, data, lambda m, b: (m(b[0]),), CE_OUT)
    with pytest.raises(TypeError, match="must return a tensor"):
        op @ torch.randn(op.size, dtype=torch.float64)


# -- a tiny HuggingFace GPT-2 with dict batches -----------------------------------------


def _gpt2(attn: str) -> nn.Module:
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(
        vocab_size=13,
        n_positions=8,
        n_embd=8,
        n_layer=1,
        n_head=2,
        bos_token_id=0,
        eos_token_id=0,
        attn_implementation=attn,
    )
    return transformers.GPT2LMHeadModel(config).double().eval()


def _lm_batches() -> list[dict[str, torch.Tensor]]:
    ids = torch.randint(0, 13, (5, 6))
    mask = torch.ones_like(ids)
    mask[0, 4:] = 0
    labels = ids.clone()
    labels[0, 4:] = -100
    labels[3, :2] = -100
    return [
        {"input_ids": ids[:3], "attention_mask": mask[:3], "labels": labels[:3]},
        {"input_ids": ids[3:], "attention_mask": mask[3:], "labels": labels[3:]},
    ]


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_tiny_gpt2_dict_batches(attn: str) -> None:
    model = _gpt2(attn)
    data = _lm_batches() if attn == "eager" else _lm_batches()[:1]
    forward, loss = hf_lm_forward(), hf_lm_loss_of_output(fused="eager")
    op = GGNOperator(model, data, forward, loss)
    dense = dense_ggn(model, data, forward, loss, select_parameters(model))
    check_contract(op, dense, model, rtol=1e-9, atol=1e-11)
    assert op.jvp_method == "forward_mode"


# -- the chunked LM head (kernels.lm_head_ce_ggn) ---------------------------------------


@pytest.mark.parametrize("tied", [True, False])
def test_chunked_lm_head_equals_unchunked(tied: bool) -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(
        vocab_size=13,
        n_positions=8,
        n_embd=8,
        n_layer=1,
        n_head=2,
        bos_token_id=0,
        eos_token_id=0,
        tie_word_embeddings=tied,
        attn_implementation="eager",
    )
    model = transformers.GPT2LMHeadModel(config).double().eval()
    data = _lm_batches()
    forward, loss = hf_lm_forward(), hf_lm_loss_of_output(fused="eager")
    chunked = GGNOperator(
        model, data, forward, loss, lm_head_chunk_rows=4
    )  # 3·5 and 2·5 rows: several chunks
    full = GGNOperator(model, data, forward, loss, chunked_lm_head=False)
    assert chunked.lm_head is model.lm_head and full.lm_head is None
    V = torch.randn(full.size, 3, dtype=torch.float64)
    before = snapshot(model)
    torch.testing.assert_close(chunked @ V, full @ V, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(
        chunked @ V[:, 0].contiguous(), (full @ V)[:, 0], rtol=1e-10, atol=1e-12
    )
    assert_unchanged(model, before)
    # a subset without the head, and one with the head only
    for flt in (match_names("transformer.h.*"), match_names("lm_head.*", "transformer.wte.*")):
        c = GGNOperator(model, data, forward, loss, param_filter=flt, lm_head_chunk_rows=4)
        f = GGNOperator(model, data, forward, loss, param_filter=flt, chunked_lm_head=False)
        W = torch.randn(c.size, 2, dtype=torch.float64)
        torch.testing.assert_close(c @ W, f @ W, rtol=1e-10, atol=1e-12)


def test_chunked_lm_head_falls_back_when_logits_are_post_processed() -> None:
    transformers = pytest.importorskip("transformers")

    class Scaled(transformers.GPT2LMHeadModel):  # type: ignore[misc, name-defined]
        def forward(self, *args, **kwargs):  # type: ignore[no-untyped-def]
            out = super().forward(*args, **kwargs)
            out.logits = 2.0 * out.logits  # like logit soft-capping: not lm_head(h)
            return out

    config = transformers.GPT2Config(
        vocab_size=13, n_positions=8, n_embd=8, n_layer=1, n_head=2, bos_token_id=0, eos_token_id=0
    )
    model = Scaled(config).double().eval()
    data = _lm_batches()[:1]
    forward, loss = hf_lm_forward(), hf_lm_loss_of_output()
    auto = GGNOperator(model, data, forward, loss)
    full = GGNOperator(model, data, forward, loss, chunked_lm_head=False)
    V = torch.randn(full.size, 2, dtype=torch.float64)
    torch.testing.assert_close(auto @ V, full @ V, rtol=1e-10, atol=1e-12)
    assert auto.lm_head is None
    strict = GGNOperator(model, data, forward, loss, chunked_lm_head=True)
    with pytest.raises(ValueError, match="differ"):
        strict @ V
    with pytest.raises(ValueError, match="chunked_lm_head=True needs"):
        GGNOperator(model, data, forward, loss, loss_hvp="autograd", chunked_lm_head=True)
