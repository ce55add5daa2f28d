"""cross_entropy_hvp: every implementation against the float64 reference.

The Triton kernel runs on CUDA, or on the CPU under ``TRITON_INTERPRET=1``
(set by scripts/test.sh); the interpreter is slow, so the large vocabulary
gets two or three rows only.
"""

from __future__ import annotations

import os

import pytest
import torch

from hessian_eigenthings import _torch_compat
from hessian_eigenthings.kernels import (
    AUTO_EAGER_MAX_VOCAB,
    cross_entropy_hvp,
    cross_entropy_hvp_reference,
    resolve_impl,
)
from tests.kernels.tolerances import assert_matches

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TRITON_RUNS = _torch_compat.has_triton() and (
    DEVICE == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"
)
needs_triton = pytest.mark.skipif(
    not TRITON_RUNS, reason="needs triton and CUDA, or TRITON_INTERPRET=1 on the CPU"
)

# Odd shapes: V = 1, not a multiple of any block, one and several blocks.
SHAPES = [(9, 7, 41), (5, 1), (3, 1025), (2, 50257)]
LOW_PRECISION = [torch.float32, torch.bfloat16, torch.float16]


def _inputs(shape, dtype, *, masked, seed=0):
    g = torch.Generator().manual_seed(seed)
    z = (3 * torch.randn(shape, generator=g, dtype=torch.float64)).to(dtype).to(DEVICE)
    u = torch.randn(shape, generator=g, dtype=torch.float64).to(dtype).to(DEVICE)
    valid = None
    if masked:
        valid = torch.rand(shape[:-1], generator=g) > 0.4
        valid.view(-1)[0] = True  # n > 0
        valid = valid.to(DEVICE)
    return z, u, valid


def _ref64(z, u, valid, n=None):
    return cross_entropy_hvp_reference(z.double(), u.double(), valid, n)


# ---------------------------------------------------------------- reference


def test_reference_matches_dense_hessian_in_float64():
    z = torch.randn(4, 6, dtype=torch.float64)
    u = torch.randn(4, 6, dtype=torch.float64)
    y = torch.randint(0, 6, (4,))

    def loss(zz):
        return torch.nn.functional.cross_entropy(zz, y, reduction="sum") / 3.0

    _, hvp = torch.autograd.functional.hvp(loss, z, u)
    torch.testing.assert_close(cross_entropy_hvp_reference(z, u, None, 3.0), hvp)


def test_reference_counts_valid_rows_by_default():
    z, u, valid = _inputs((6, 5), torch.float64, masked=True)
    by_count = cross_entropy_hvp_reference(z, u, valid)
    explicit = cross_entropy_hvp_reference(z, u, valid, int(valid.sum()))
    torch.testing.assert_close(by_count, explicit)
    assert (by_count[~valid] == 0).all()


@pytest.mark.parametrize("dtype", LOW_PRECISION)
def test_eager_accumulates_in_float32(dtype):
    z, u, valid = _inputs((9, 7, 41), dtype, masked=True)
    out = cross_entropy_hvp(z, u, valid, impl="eager")
    assert out.dtype == dtype
    assert_matches(out, _ref64(z, u, valid), dtype)


# ---------------------------------------------------------------- dispatch


def test_auto_resolution():
    small = torch.zeros(2, AUTO_EAGER_MAX_VOCAB - 1)
    large = torch.zeros(2, AUTO_EAGER_MAX_VOCAB)
    assert resolve_impl("auto", small, small) == "eager"
    assert resolve_impl("auto", large.double(), large.double()) == "eager"
    expected = "compile" if _torch_compat.compile_supported() else "eager"
    assert resolve_impl("auto", large, large) == expected  # CPU: never Triton
    for impl in ("eager", "compile", "triton"):
        assert resolve_impl(impl, large, large) == impl


@pytest.mark.skipif(not torch.cuda.is_available(), reason="auto picks Triton only on CUDA")
def test_auto_prefers_triton_on_cuda():
    large = torch.zeros(2, AUTO_EAGER_MAX_VOCAB, device="cuda")
    expected = "triton" if _torch_compat.has_triton() else "compile"
    assert resolve_impl("auto", large, large) == expected
    grad = large.clone().requires_grad_()
    assert resolve_impl("auto", grad, large) != "triton"  # the kernel is not differentiable


def test_input_validation():
    z = torch.zeros(3, 5)
    with pytest.raises(ValueError, match="impl must be"):
        cross_entropy_hvp(z, z, impl="fast")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="same shape"):
        cross_entropy_hvp(z, torch.zeros(3, 4))
    with pytest.raises(ValueError, match="one flag per row"):
        cross_entropy_hvp(z, z, torch.ones(5, dtype=torch.bool))
    with pytest.raises(TypeError, match="bool mask"):
        cross_entropy_hvp(z, z, torch.tensor([1.0, 0.5, 0.0]))  # a weight is no mask
    with pytest.raises(ValueError, match="out must be"):
        cross_entropy_hvp(z, z, out=torch.zeros(3, 4))


@pytest.mark.parametrize("impl", ["eager", "triton"])
@pytest.mark.parametrize("mask_dtype", [torch.float32, torch.float64, torch.int64])
def test_zero_one_masks_of_other_dtypes_mean_the_bool_mask(impl, mask_dtype):
    # the 1.0 alpha's kernel took a float 0/1 row mask
    z, u, valid = _inputs((9, 7, 41), torch.float32, masked=True)
    expected = _ref64(z, u, valid)
    assert_matches(cross_entropy_hvp(z, u, valid.to(mask_dtype), impl=impl), expected, torch.float32)
    assert_matches(
        cross_entropy_hvp(z, u, valid.to(mask_dtype), 5.0, impl=impl), _ref64(z, u, valid, 5.0),
        torch.float32,
    )


# ---------------------------------------------------------------- compile


@pytest.mark.slow
def test_compile_on_one_tiny_shape():
    # One shape only: the first CPU compilation takes ~20 s.
    z, u, valid = _inputs((9, 7, 41), torch.float32, masked=True)
    expected = _ref64(z, u, valid)
    assert_matches(cross_entropy_hvp(z, u, valid, impl="compile"), expected, torch.float32)
    n = valid.sum()
    inplace = u.clone()
    out = cross_entropy_hvp(z, inplace, valid, n, impl="compile", out=inplace)
    assert out is inplace
    assert_matches(inplace, expected, torch.float32)


# ---------------------------------------------------------------- triton


@needs_triton
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", LOW_PRECISION, ids=str)
@pytest.mark.parametrize("masked", [False, True], ids=["all-rows", "masked"])
def test_triton_matches_reference(shape, dtype, masked):
    z, u, valid = _inputs(shape, dtype, masked=masked)
    out = torch.full(shape, float("nan"), dtype=dtype, device=DEVICE)  # poisoned
    res = cross_entropy_hvp(z, u, valid, impl="triton", out=out)
    assert res is out
    assert not out.isnan().any(), "every element must be written"
    assert_matches(out, _ref64(z, u, valid), dtype)
    if valid is not None:
        assert (out[~valid] == 0).all()


@needs_triton
@pytest.mark.parametrize(
    "config",
    [
        dict(chunk=16, num_warps=1),  # 65 chunks per row
        dict(chunk=64, num_warps=2),  # 17 chunks, the last one 1 column
        dict(chunk=1024, num_warps=8),  # 2 chunks of very different lengths
        dict(chunk=2048, num_warps=4),  # one chunk: the whole row
    ],
    ids=["split65", "split17", "split2", "split1"],
)
def test_triton_configs(config):
    from hessian_eigenthings.kernels.cross_entropy_triton import (
        TritonConfig,
        cross_entropy_hvp_triton,
    )

    z, u, valid = _inputs((5, 3, 1025), torch.float32, masked=True)
    out = cross_entropy_hvp_triton(z, u, valid, None, config=TritonConfig(**config))
    assert_matches(out, _ref64(z, u, valid), torch.float32)


@needs_triton
def test_triton_split_rows_beyond_resident_programs():
    # 257 chunks per row: more than any device holds at once, so the host
    # takes the two-launch path (see NOTE [split rows]); rows still match.
    from hessian_eigenthings.kernels.cross_entropy_triton import (
        TritonConfig,
        cross_entropy_hvp_triton,
    )

    z, u, valid = _inputs((3, 4099), torch.bfloat16, masked=True)
    out = torch.full(z.shape, float("nan"), dtype=z.dtype, device=DEVICE)
    cross_entropy_hvp_triton(z, u, valid, None, out=out, config=TritonConfig(chunk=16))
    assert_matches(out, _ref64(z, u, valid), torch.bfloat16)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the cross-program wait runs on CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_triton_split_rows_on_device(dtype):
    # Thousands of rows of 13 chunks in flight at once: every chunk written,
    # equal to the reference, bitwise the same on every run (the statistics
    # are combined in chunk order, not in order of arrival), and the only
    # extra memory is the workspace of NOTE [split rows].
    from hessian_eigenthings.kernels.cross_entropy_triton import SPLIT_CHUNK

    rows, V = 3000, 50257
    split_p2 = 16
    assert split_p2 >= -(-V // SPLIT_CHUNK)
    z, u, valid = _inputs((rows, V), dtype, masked=True)
    expected = _ref64(z, u, valid)
    outs = []
    for _ in range(3):
        out = torch.full(z.shape, float("nan"), dtype=dtype, device=DEVICE)
        cross_entropy_hvp(z, u, valid, impl="triton", out=out)
        outs.append(out)
    assert not outs[0].isnan().any()
    assert_matches(outs[0], expected, dtype)
    assert all(torch.equal(outs[0], o) for o in outs[1:])
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    cross_entropy_hvp(z, u, valid, impl="triton", out=u)
    torch.cuda.synchronize()
    workspace = rows * (4 + 12 * split_p2) + 4
    assert (
        torch.cuda.max_memory_allocated() - base <= workspace + 3 * 512
    )  # rounding per allocation


@needs_triton
@pytest.mark.parametrize("n_kind", ["number", "tensor", "int-tensor", "none"])
def test_triton_scale(n_kind):
    z, u, valid = _inputs((4, 3, 41), torch.float32, masked=True)
    n = {
        "number": 7.5,
        "tensor": torch.tensor(7.5, device=DEVICE),
        "int-tensor": torch.tensor(7, device=DEVICE),
        "none": None,
    }[n_kind]
    n64 = n if not isinstance(n, torch.Tensor) else float(n)
    assert_matches(
        cross_entropy_hvp(z, u, valid, n, impl="triton"), _ref64(z, u, valid, n64), torch.float32
    )


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_triton_in_place(dtype):
    z, u, valid = _inputs((9, 7, 1025), dtype, masked=True)
    expected = _ref64(z, u, valid)
    res = cross_entropy_hvp(z, u, valid, impl="triton", out=u)
    assert res is u
    assert_matches(u, expected, dtype)


@needs_triton
def test_triton_sliced_logits_without_copy():
    # The causal-LM case: logits[:, :-1] and a direction with its own strides.
    big = torch.randn(3, 6, 1025, device=DEVICE)
    z = big[:, :-1]
    u = torch.randn(3, 5, 2050, device=DEVICE)[..., ::2]  # column stride 2
    out = torch.full((3, 8, 1025), float("nan"), device=DEVICE)[:, 1:6]
    cross_entropy_hvp(z, u, None, 4, impl="triton", out=out)
    assert_matches(out, _ref64(z, u, None, 4), torch.float32)


@needs_triton
def test_triton_unmergeable_leading_dims():
    # Three leading dims that no two-level row index can address: copied path,
    # still written into the caller's strided output.
    base = torch.randn(3, 4, 5, 41, device=DEVICE)
    z = base[:2, ::2, 1:]
    u = torch.randn(2, 2, 4, 41, device=DEVICE)
    valid = torch.rand(2, 2, 4, device=DEVICE) > 0.3
    valid[0, 0, 0] = True
    holder = torch.full((2, 3, 4, 41), float("nan"), device=DEVICE)
    out = holder[:, ::2]  # not mergeable with the other leading dims
    cross_entropy_hvp(z, u, valid, impl="triton", out=out)
    assert_matches(out, _ref64(z, u, valid), torch.float32)
    assert holder[:, 1].isnan().all(), "rows outside out must be untouched"


@needs_triton
def test_triton_refuses_what_it_cannot_do():
    z = torch.randn(2, 41, device=DEVICE)
    with pytest.raises(TypeError, match="float64"):
        cross_entropy_hvp(z.double(), z.double(), impl="triton")
    with pytest.raises(RuntimeError, match="not differentiable"):
        cross_entropy_hvp(z.clone().requires_grad_(), z, impl="triton")


@needs_triton
def test_triton_empty_inputs():
    z = torch.zeros(0, 7, device=DEVICE)
    assert cross_entropy_hvp(z, z, impl="triton").shape == (0, 7)
