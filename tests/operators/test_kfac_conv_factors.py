"""A convolution's input factor without unfolding (``operators.conv_factors``) against the unfolded
patches (``F.unfold``) in float64: every route, odd shapes, stride, padding, dilation, kernels
1×1 to 7×7, and through ``KFACOperator`` (expand / reduce, a bias apart or joined)."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from hessian_eigenthings import KFACOperator
from hessian_eigenthings.loss_fns import cross_entropy_loss_of_output, supervised_forward
from hessian_eigenthings.operators.conv_factors import conv_factor_plan, conv_input_moment


def _patches(x: torch.Tensor, kernel, stride, padding, dilation) -> torch.Tensor:
    """``(N, positions, C·kh·kw)``: the reference, from ``F.unfold``."""
    return F.unfold(x, kernel, dilation=dilation, padding=padding, stride=stride).transpose(1, 2)


SHAPES = [(7, 5), (1, 1), (2, 3), (12, 9), (4, 4), (5, 16)]
KERNELS = [(1, 1), (3, 3), (5, 5), (3, 2), (1, 3), (7, 7)]
GEOMETRY = [
    # (stride, padding, dilation)
    ((1, 1), (1, 1), (1, 1)),
    ((1, 1), (0, 0), (1, 1)),
    ((1, 1), (2, 2), (1, 1)),
    ((2, 2), (1, 1), (1, 1)),
    ((2, 1), (1, 0), (1, 1)),
    ((3, 2), (3, 3), (1, 1)),
    ((1, 1), (2, 2), (2, 2)),
    ((2, 2), (2, 1), (2, 1)),
    ((1, 2), (1, 2), (1, 2)),
]


def _cases():
    for (H, W), kernel, (stride, padding, dilation) in itertools.product(SHAPES, KERNELS, GEOMETRY):
        out = [
            (size + 2 * p - d * (k - 1) - 1) // s + 1
            for size, k, s, p, d in zip((H, W), kernel, stride, padding, dilation, strict=True)
        ]
        if min(out) >= 1:
            yield (H, W), kernel, stride, padding, dilation


@pytest.mark.parametrize("impl", ["auto", "unfold", "rows"])
@pytest.mark.parametrize("reduce", [False, True], ids=["expand", "reduce"])
def test_moments_equal_the_unfolded_patches(impl: str, reduce: bool) -> None:
    torch.manual_seed(0)
    count = 0
    for (H, W), kernel, stride, padding, dilation in _cases():
        x = torch.randn(2, 3, H, W, dtype=torch.float64)
        a = _patches(x, kernel, stride, padding, dilation)
        a = a.mean(1) if reduce else a.reshape(-1, a.shape[-1])
        S, s, rows = conv_input_moment(
            x,
            kernel,
            stride,
            padding,
            dilation,
            reduce=reduce,
            impl=impl,  # type: ignore[arg-type]
        )
        case = f"{(H, W)} kernel {kernel} stride {stride} padding {padding} dilation {dilation}"
        assert rows == a.shape[0], case
        torch.testing.assert_close(S, a.T @ a, rtol=1e-12, atol=1e-12, msg=case)
        torch.testing.assert_close(s, a.sum(0), rtol=1e-12, atol=1e-12, msg=case)
        count += 1
    assert count > 200


@pytest.mark.parametrize(
    "shape,kernel,stride,padding,dilation",
    [
        ((12, 9), (3, 3), (1, 1), (1, 1), (1, 1)),  # the shift runs along rows
        ((5, 16), (3, 3), (1, 1), (1, 1), (1, 1)),  # along columns (the transposed image)
        ((12, 9), (5, 5), (2, 2), (2, 2), (1, 1)),  # two representative rows
        ((12, 9), (3, 3), (1, 1), (2, 2), (2, 2)),  # dilation
        ((1, 1), (3, 3), (1, 1), (1, 1), (1, 1)),  # one live kernel offset
        ((3, 3), (5, 5), (1, 1), (1, 1), (1, 1)),  # a live box inside the kernel
    ],
)
def test_row_shift_route_on_larger_channel_counts(shape, kernel, stride, padding, dilation) -> None:
    torch.manual_seed(1)
    x = torch.randn(3, 11, *shape, dtype=torch.float64)
    a = _patches(x, kernel, stride, padding, dilation)
    a = a.reshape(-1, a.shape[-1])
    for impl in ("auto", "rows"):
        S, s, _ = conv_input_moment(x, kernel, stride, padding, dilation, impl=impl)  # type: ignore[arg-type]
        torch.testing.assert_close(S, a.T @ a, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(s, a.sum(0), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("impl", ["auto", "unfold", "rows"])
def test_sums_can_be_skipped(impl: str) -> None:
    x = torch.randn(2, 3, 6, 5, dtype=torch.float64)
    geometry = ((3, 3), (1, 1), (1, 1), (1, 1))
    S, s, rows = conv_input_moment(x, *geometry, impl=impl, sums=False)  # type: ignore[arg-type]
    S_ref, _, rows_ref = conv_input_moment(x, *geometry, impl="unfold")
    assert s.numel() == 0 and rows == rows_ref
    torch.testing.assert_close(S, S_ref, rtol=1e-12, atol=1e-12)
    S, s, rows = conv_input_moment(x, *geometry, impl=impl, sums=False, reduce=True)  # type: ignore[arg-type]
    S_ref, _, rows_ref = conv_input_moment(x, *geometry, impl="unfold", reduce=True)
    assert s.numel() == 0 and rows == rows_ref
    torch.testing.assert_close(S, S_ref, rtol=1e-12, atol=1e-12)


def test_a_gpu_plan_weighs_launches() -> None:
    # NOTE [launches count on a GPU]: ResNet-18's maps at 32×32 inputs (8×8 and smaller) are
    # unfolded on a GPU, where the row shifts' launches cost more than the multiply-adds they
    # save; on a CPU the same shapes take the row shifts. A 56×56 map saves enough for them
    # on either.
    for shape in [(128, 64, 8, 8), (128, 128, 4, 4)]:
        geometry = ((3, 3), (1, 1), (1, 1), (1, 1))
        assert conv_factor_plan(shape, *geometry).route == "rows"
        assert conv_factor_plan(shape, *geometry, device_type="cuda").route == "unfold"
    stem = ((128, 3, 32, 32), (7, 7), (2, 2), (3, 3), (1, 1))
    assert conv_factor_plan(*stem, device_type="cuda").route == "unfold"
    cifar = ((128, 32, 32, 32), (3, 3), (1, 1), (1, 1), (1, 1))
    assert conv_factor_plan(*cifar).route == "rows"
    assert conv_factor_plan(*cifar, device_type="cuda").route == "unfold"
    imagenet = ((128, 64, 56, 56), (3, 3), (1, 1), (1, 1), (1, 1))
    assert conv_factor_plan(*imagenet, device_type="cuda").route == "rows"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_plans_give_the_cpu_factors() -> None:
    # a GPU unfolds the maps a CPU takes the row shifts on (NOTE [launches count on a GPU]):
    # the same factors either way (H100, float64: 2e-15 on ResNet-18 and the ResNet-like CNN)
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 16, 3, 2, 1), nn.ReLU(),
        nn.Conv2d(16, 16, 3, padding=1), nn.Flatten(), nn.Linear(16 * 16 * 16, 4),
    ).double()
    x, y = torch.randn(6, 3, 32, 32, dtype=torch.float64), torch.randint(0, 4, (6,))
    plans = {
        dev: conv_factor_plan((6, 16, 16, 16), (3, 3), (1, 1), (1, 1), (1, 1), device_type=dev)
        for dev in ("cpu", "cuda")
    }
    assert plans["cpu"].route == "rows" and plans["cuda"].route == "unfold"
    factors = {}
    for dev in ("cpu", "cuda"):
        op = KFACOperator(
            model.to(dev), [(x.to(dev), y.to(dev))], supervised_forward,
            cross_entropy_loss_of_output(), fisher_type="empirical",
        )
        factors[dev] = [(b.A.cpu(), b.G.cpu()) for b in op.factors]
    for (A, G), (A2, G2) in zip(factors["cpu"], factors["cuda"], strict=True):
        torch.testing.assert_close(A2, A, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(G2, G, rtol=1e-12, atol=1e-12)


def test_bad_impl_is_named() -> None:
    with pytest.raises(ValueError, match="impl must be"):
        conv_input_moment(torch.zeros(1, 1, 3, 3), (3, 3), (1, 1), (1, 1), (1, 1), impl="fast")  # type: ignore[arg-type]


@pytest.mark.parametrize("approx", ["expand", "reduce"])
@pytest.mark.parametrize("separate", [True, False])
@pytest.mark.parametrize(
    "conv",
    [
        dict(kernel_size=3, padding=1),
        dict(kernel_size=(3, 2), stride=2, padding=(0, 1)),
        dict(kernel_size=5, padding=2, dilation=(2, 1)),
        dict(kernel_size=1),
    ],
    ids=["3x3", "3x2-stride2", "5x5-dilated", "1x1"],
)
def test_kfac_input_factor_is_the_unfolded_second_moment(approx: str, separate: bool, conv) -> None:
    torch.manual_seed(2)
    layer = nn.Conv2d(3, 4, **conv).double()
    with torch.no_grad():
        out = layer(torch.zeros(1, 3, 9, 7, dtype=torch.float64)).shape
    model = nn.Sequential(layer, nn.Flatten(), nn.Linear(out[1:].numel(), 3)).double()
    X = torch.randn(7, 3, 9, 7, dtype=torch.float64)
    y = torch.randint(0, 3, (7,))
    data = [(X[:4], y[:4]), (X[4:], y[4:])]
    op = KFACOperator(
        model,
        data,
        supervised_forward,
        cross_entropy_loss_of_output(),
        kfac_approx=approx,  # type: ignore[arg-type]
        separate_bias=separate,
        param_filter=["0.weight", "0.bias"],
    )
    expected = torch.zeros(())
    for xb, _ in data:
        a = _patches(xb, layer.kernel_size, layer.stride, layer.padding, layer.dilation)
        a = a.mean(1, keepdim=True) if approx == "reduce" else a
        if not separate:
            a = torch.cat([a, torch.ones(*a.shape[:-1], 1, dtype=a.dtype)], dim=-1)
        flat = a.reshape(-1, a.shape[-1])
        expected = expected + (flat.T @ flat) * (xb.shape[0] / flat.shape[0])
    expected = expected / X.shape[0]
    torch.testing.assert_close(op.factors[0].A, expected, rtol=1e-12, atol=1e-14)


def test_plan_counts_and_routes() -> None:
    # a 3×3 convolution on a 32×32 map: one representative kernel row and two edge rows
    plan = conv_factor_plan((128, 64, 32, 32), (3, 3), (1, 1), (1, 1), (1, 1))
    assert plan.route == "rows" and plan.period == 1 and plan.shifts == (0, 1, 2)
    assert plan.multiply_adds == (32 + 4) * 64 * 3 * (64 * 9) * 128 * 32
    assert plan.multiply_adds < 0.4 * plan.unfold_multiply_adds
    # a 1×1 map with padding 1: only the centre offset reads the input
    plan = conv_factor_plan((128, 512, 1, 1), (3, 3), (1, 1), (1, 1), (1, 1))
    assert plan.box == (1, 2, 1, 2) and plan.multiply_adds == 512 * 512 * 128
    # a wide, short map shifts along columns
    assert conv_factor_plan((64, 32, 4, 64), (3, 3), (1, 1), (1, 1), (1, 1)).transpose
    # a 1×1 convolution has nothing to shift
    assert conv_factor_plan((8, 16, 9, 9), (1, 1), (2, 2), (0, 0), (1, 1)).route == "unfold"
    with pytest.raises(ValueError, match="impl must be"):
        conv_factor_plan((1, 1, 3, 3), (3, 3), (1, 1), (1, 1), (1, 1), impl="fast")  # type: ignore[arg-type]
