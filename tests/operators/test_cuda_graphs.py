"""CUDA-graph replay of products on a kept state (NOTE [CUDA graphs] in operators.base).

Replays run the recorded kernels, so results must equal eager products with
graphs off; the cost counters say how many products were replayed.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hessian_eigenthings.loss_fns import supervised_loss
from hessian_eigenthings.operators import HessianOperator

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _cnn() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
        nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 8 * 8, 5),
    ).eval()


def _problem(device: str) -> tuple[nn.Module, list[tuple[torch.Tensor, torch.Tensor]]]:
    model = _cnn().to(device)
    g = torch.Generator().manual_seed(1)
    batch = (torch.randn(16, 3, 8, 8, generator=g).to(device), torch.randint(0, 5, (16,), generator=g).to(device))
    return model, [batch]


def test_option_is_validated() -> None:
    model, data = _problem("cpu")
    with pytest.raises(TypeError, match="cuda_graphs"):
        HessianOperator(model, data, supervised_loss(nn.CrossEntropyLoss()), cuda_graphs="yes")  # type: ignore[arg-type]


def test_cpu_operators_never_record() -> None:
    model, data = _problem("cpu")
    op = HessianOperator(model, data, supervised_loss(nn.CrossEntropyLoss()), graph_reuse=True)
    v = torch.randn(op.size)
    first = op @ v
    for _ in range(3):
        torch.testing.assert_close(op @ v, first, rtol=0, atol=0)
    assert op.num_replays == 0


@cuda
@pytest.mark.parametrize("k", [1, 4])
def test_replayed_products_equal_eager_products(k: int) -> None:
    model, data = _problem("cuda")
    loss = supervised_loss(nn.CrossEntropyLoss())
    graphed = HessianOperator(model, data, loss, graph_reuse=True, cuda_graphs=True)
    eager = HessianOperator(model, data, loss, graph_reuse=True, cuda_graphs=False)
    g = torch.Generator(device="cuda").manual_seed(2)
    for step in range(4):
        V = torch.randn(graphed.size, k, device="cuda", generator=g).squeeze(-1)
        torch.testing.assert_close(graphed @ V, eager @ V, rtol=1e-5, atol=1e-6)
        # first product builds and runs eagerly, the second records, later ones replay
        assert graphed.num_replays == max(0, step)
    assert graphed.num_forwards == 1 and eager.num_replays == 0


@cuda
def test_parameter_change_invalidates_the_recording() -> None:
    model, data = _problem("cuda")
    loss = supervised_loss(nn.CrossEntropyLoss())
    graphed = HessianOperator(model, data, loss, graph_reuse=True)
    v = torch.randn(graphed.size, device="cuda")
    for _ in range(3):
        graphed @ v
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.1)
    fresh = HessianOperator(model, data, loss, graph_reuse=False)
    torch.testing.assert_close(graphed @ v, fresh @ v, rtol=1e-4, atol=1e-5)
    assert graphed.num_forwards == 2


class _HostSyncIdentity(torch.autograd.Function):
    """Identity whose backward reads a value on the host: it cannot be recorded."""

    @staticmethod
    def forward(ctx, x):  # type: ignore[no-untyped-def, override]
        return x.clone()

    @staticmethod
    def backward(ctx, grad):  # type: ignore[no-untyped-def, override]
        if float(grad.abs().sum()) < 0:  # a host sync
            raise AssertionError
        return grad


class _Square(torch.autograd.Function):
    """x² whose backward goes through ``_HostSyncIdentity``, so the second backward syncs."""

    @staticmethod
    def forward(ctx, x):  # type: ignore[no-untyped-def, override]
        ctx.save_for_backward(x)
        return x * x

    @staticmethod
    def backward(ctx, grad):  # type: ignore[no-untyped-def, override]
        (x,) = ctx.saved_tensors
        return _HostSyncIdentity.apply(2 * x * grad)


@cuda
def test_a_capture_that_fails_warns_and_falls_back() -> None:
    model = nn.Linear(6, 1).cuda()
    x = torch.randn(10, 6, device="cuda")

    def loss_fn(m: nn.Module, batch: torch.Tensor) -> torch.Tensor:
        return _Square.apply(m(batch)).mean()

    graphed = HessianOperator(model, [x], loss_fn, graph_reuse=True)
    eager = HessianOperator(model, [x], loss_fn, graph_reuse=True, cuda_graphs=False)
    v = torch.randn(graphed.size, device="cuda")
    expected = eager @ v
    torch.testing.assert_close(graphed @ v, expected)
    with pytest.warns(RuntimeWarning, match="CUDA graph"):
        got = graphed @ v
    torch.testing.assert_close(got, expected)
    torch.testing.assert_close(graphed @ v, expected)  # no second attempt, no second warning
    assert graphed.num_replays == 0
    torch.randn(3, device="cuda")  # the failed capture left the random generator usable


def test_private_leaves_give_the_same_products() -> None:
    """The forward a recorded state is built with (functional_call on stand-in leaves) is the same Hessian."""
    torch.manual_seed(3)
    shared = nn.Linear(5, 5)
    model = nn.Sequential(shared, nn.Tanh(), shared, nn.Tanh(), nn.Linear(5, 2))  # tied layers
    data = [(torch.randn(7, 5), torch.randint(0, 2, (7,)))]
    op = HessianOperator(model, data, supervised_loss(nn.CrossEntropyLoss()), graph_reuse=False)
    V = torch.randn(op.size, 3)
    expected = op @ V
    op._in_own_stream = True  # what the CUDA path sets while it builds a state to record
    got = op @ V
    op._in_own_stream = False
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-7)


@cuda
def test_the_users_own_backward_is_untouched() -> None:
    """A recorded state must not tie the parameters' gradient accumulators to the operator's stream."""
    import warnings

    model, data = _problem("cuda")
    loss = supervised_loss(nn.CrossEntropyLoss())
    graphed = HessianOperator(model, data, loss, graph_reuse=True)
    v = torch.randn(graphed.size, device="cuda")
    for _ in range(3):
        graphed @ v
    assert graphed.num_replays == 2  # eager, recorded + replayed, replayed
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loss(model, data[0]).backward()  # the user's training step, on the default stream
    assert all(p.grad is not None for p in model.parameters())
