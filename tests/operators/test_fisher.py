"""EmpiricalFisherOperator against ``(1/N) Σ gᵢgᵢᵀ`` from dense float64 per-sample gradients."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hessian_eigenthings.loss_fns import supervised_per_sample_loss
from hessian_eigenthings.operators import EmpiricalFisherOperator
from hessian_eigenthings.param_utils import match_names, select_parameters
from tests.conftest import SmallCNN, classification_data, mlp
from tests.operators.contract import check_contract
from tests.operators.curvature_oracles import dense_empirical_fisher

CE_PER_SAMPLE = supervised_per_sample_loss(nn.CrossEntropyLoss())


def fisher_dense(model, data, loss=CE_PER_SAMPLE, flt=None):
    return dense_empirical_fisher(model, data, loss, select_parameters(model, flt))


@pytest.mark.parametrize("reuse", [False, True])
def test_mlp_cross_entropy_uneven_batches(reuse: bool) -> None:
    model, data = (
        mlp(),
        classification_data(n=10, batch=4),
    )  # 4, 4, 2: the mean runs over all 10 samples
    op = EmpiricalFisherOperator(model, data, CE_PER_SAMPLE, graph_reuse=reuse)
    check_contract(op, fisher_dense(model, data), model)


def test_is_the_mean_of_outer_products_of_per_sample_gradients() -> None:
    # explicit construction, independent of the oracle module: gᵢ by one backward per sample
    model, data = mlp(), classification_data(n=6, batch=3)
    params = list(model.parameters())
    rows = []
    for x, y in data:
        for i in range(x.shape[0]):
            loss = nn.functional.cross_entropy(model(x[i : i + 1]), y[i : i + 1])
            rows.append(torch.cat([g.reshape(-1) for g in torch.autograd.grad(loss, params)]))
    G = torch.stack(rows)
    F = EmpiricalFisherOperator(model, data, CE_PER_SAMPLE).to_dense()
    torch.testing.assert_close(F, G.T @ G / 6, rtol=1e-10, atol=1e-12)


def test_mse_multi_output_per_sample_mean() -> None:
    model = mlp(d_out=2)
    X, Y = torch.randn(7, 5, dtype=torch.float64), torch.randn(7, 2, dtype=torch.float64)
    data = [(X[:4], Y[:4]), (X[4:], Y[4:])]
    loss = supervised_per_sample_loss(nn.MSELoss())
    op = EmpiricalFisherOperator(model, data, loss)
    check_contract(op, fisher_dense(model, data, loss), model)


def test_plain_function_criterion_is_mapped_over_samples() -> None:
    model, data = mlp(), classification_data()
    loss = supervised_per_sample_loss(lambda out, y: nn.functional.cross_entropy(out, y))
    F1 = EmpiricalFisherOperator(model, data, loss).to_dense()
    F2 = EmpiricalFisherOperator(model, data, CE_PER_SAMPLE).to_dense()
    torch.testing.assert_close(F1, F2, rtol=1e-12, atol=1e-14)


def test_sample_dim_and_extra_dims() -> None:
    model, data = mlp(), classification_data()

    def transposed(m, batch):  # samples along dim 1
        return CE_PER_SAMPLE(m, batch).unsqueeze(0)

    def per_token(m, batch):  # (N, 2) "tokens" with equal losses: averaged into the sample's loss
        return CE_PER_SAMPLE(m, batch).unsqueeze(1).expand(-1, 2)

    V = torch.randn(sum(p.numel() for p in model.parameters()), 3, dtype=torch.float64)
    ref = EmpiricalFisherOperator(model, data, CE_PER_SAMPLE) @ V
    torch.testing.assert_close(
        EmpiricalFisherOperator(model, data, transposed, sample_dim=1) @ V, ref
    )
    torch.testing.assert_close(EmpiricalFisherOperator(model, data, per_token) @ V, ref)


def test_unbatched_per_sample_function_as_in_the_alpha() -> None:
    # the 1.0 alpha's form: one un-batched sample -> scalar (vmapped over the batch); a
    # batched loss with a mean reduction is read the same way, and is right too
    model, data = mlp(), classification_data()
    ref = fisher_dense(model, data)
    v = torch.randn(ref.shape[0], dtype=torch.float64)
    one = nn.CrossEntropyLoss()
    for fn in (
        lambda m, sample: one(m(sample[0]), sample[1]),
        lambda m, b: CE_PER_SAMPLE(m, b).mean(),
    ):
        op = EmpiricalFisherOperator(model, data, fn)
        torch.testing.assert_close(op @ v, ref @ v, rtol=1e-10, atol=1e-12)


def test_alpha_function_that_fails_on_a_whole_batch() -> None:
    """The alpha's per-sample functions often add the batch axis themselves
    (``m(x.unsqueeze(0))``), so on a whole batch they raise instead of returning a scalar: they
    are vmapped too. A function that took this operator's batches before keeps its errors."""
    model, data = mlp(), classification_data()
    ref = fisher_dense(model, data)
    v = torch.randn(ref.shape[0], dtype=torch.float64)

    def alpha(m: nn.Module, s: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return nn.functional.cross_entropy(m(s[0].unsqueeze(0)), s[1].unsqueeze(0))

    op = EmpiricalFisherOperator(model, data, alpha)
    torch.testing.assert_close(op @ v, ref @ v, rtol=1e-10, atol=1e-12)
    broken = {"now": False}

    def flaky(m: nn.Module, b: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        if broken["now"]:
            raise RuntimeError("the user's own failure")
        return CE_PER_SAMPLE(m, b)

    batched = EmpiricalFisherOperator(model, data, flaky, graph_reuse=False)
    batched @ v
    broken["now"] = True
    with pytest.raises(RuntimeError, match="the user's own failure"):
        batched @ v


def test_wrong_per_sample_shapes_are_refused() -> None:
    model, data = mlp(), classification_data()
    # a scalar for the batch that cannot run on one sample either (it reads a batch axis)
    scalar = EmpiricalFisherOperator(
        model, data, lambda m, b: CE_PER_SAMPLE(m, b).sum() / b[0].shape[1]
    )
    with pytest.raises(ValueError, match="reduction='none'"):
        scalar @ torch.randn(scalar.size, dtype=torch.float64)
    wrong = EmpiricalFisherOperator(model, data, lambda m, b: CE_PER_SAMPLE(m, b)[:2])
    with pytest.raises(ValueError, match="samples"):
        wrong @ torch.randn(wrong.size, dtype=torch.float64)
    with pytest.raises(TypeError, match="per_sample_loss_fn"):
        EmpiricalFisherOperator(model, data, None)  # type: ignore[arg-type]


def test_finite_difference_jv_agrees() -> None:
    model, data = mlp(), classification_data()
    fwd = EmpiricalFisherOperator(model, data, CE_PER_SAMPLE)
    fd = EmpiricalFisherOperator(model, data, CE_PER_SAMPLE, jvp="finite_difference")
    V = torch.randn(fwd.size, 3, dtype=torch.float64)
    torch.testing.assert_close(fd @ V, fwd @ V, rtol=1e-7, atol=1e-9)


def test_microbatching_and_param_filter() -> None:
    model = SmallCNN().double().eval()
    X, Y = torch.randn(7, 2, 4, 4, dtype=torch.float64), torch.randint(0, 4, (7,))
    flt = match_names("fc.*", "conv.bias")
    whole = EmpiricalFisherOperator(model, [(X, Y)], CE_PER_SAMPLE, param_filter=flt)
    micro = EmpiricalFisherOperator(
        model, [(X, Y)], CE_PER_SAMPLE, param_filter=flt, microbatch_size=3
    )
    check_contract(micro, fisher_dense(model, [(X, Y)], flt=flt), model)
    V = torch.randn(whole.size, 2, dtype=torch.float64)
    torch.testing.assert_close(micro @ V, whole @ V, rtol=1e-12, atol=1e-14)
