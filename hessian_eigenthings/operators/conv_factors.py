"""The input-side Kronecker factor of a 2-d convolution, ``Σ a aᵀ`` over its patches, without unfolding.

A convolution (groups 1, zero padding) sees at output position ``p = (p_h, p_w)`` the patch
``a_p[c, k] = x̃[c, s·p + d·k]`` (``x̃`` the zero-padded input, ``k = (k_h, k_w)`` a kernel
offset, ``s`` the stride, ``d`` the dilation). KFAC's ``expand`` factor is the second moment of
the patches; unfolding them and multiplying costs ``(C·K_h·K_w)²`` per position, ``K_h·K_w``
times the convolution's own forward.

NOTE [row shifts]: two kernel rows ``k_h`` and ``k_h' = k_h - δ`` with ``d·δ = s·t`` (``t`` a
whole number of output rows) read the same input rows, ``t`` output rows apart, so their blocks
of the factor differ only in which output rows are summed:

    A[(·, k_h, ·), (·, j_h, ·)] = Σ_{r ∈ [t, t + OH)} P[r][(·, k_h - δ, ·), (·, j_h - δ, ·)]

where ``P[r]`` is the moment of output row ``r`` alone (over samples and output columns; rows
past the last read zero padding past the input). Every kernel row is reached from a
representative row (the smallest of its class ``d·k_h mod s``: one for stride 1) by such a
shift, applied to whichever of the pair has the smaller shift (the other block is the transpose
of its mirror). So the representative rows' patches are multiplied with all patches once over
the first ``OH`` output rows, and once per output row for the ``max t`` rows at either edge;
a range ``[t, t + OH)`` is the first sum minus the top ``t`` rows plus the next ``t``. Cost
``(OH + 2·max t)·R / (OH·K_h)`` of unfolding's multiply-adds (``R`` representatives; ``≈ 1/3``
for a 3×3 stride-1 convolution on a large map), plus an intermediate per edge row and the
assembly of the blocks. The same works along columns; the cheaper direction is used, and
unfolding where neither saves by an estimate of multiply-adds, memory traffic and, on a GPU,
kernel launches (small maps, strided small kernels, 1×1 kernels; NOTE [launches count on a GPU]).

Kernel offsets whose every patch entry falls into the padding (a 3×3 convolution on a 1×1 map)
have zero rows and columns: they are left out of the products and the box of live offsets is
computed alone. Everything is exact: sums of the same products as the unfolded route, in
another order.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F

__all__ = [
    "ConvFactorImpl",
    "ConvFactorPlan",
    "conv_factor_plan",
    "conv_input_moment",
    "conv_output_size",
]

ConvFactorImpl = Literal["auto", "unfold", "rows"]


def conv_output_size(size: int, kernel: int, stride: int, padding: int, dilation: int) -> int:
    return (size + 2 * padding - dilation * (kernel - 1) - 1) // stride + 1


def _live(size: int, out: int, kernel: int, stride: int, padding: int, dilation: int) -> list[int]:
    """Kernel offsets along one axis that read at least one real (non-padding) input entry."""
    live = []
    for k in range(kernel):  # some p in [0, out) with 0 <= s·p + d·k - padding < size
        first = max(0, -((dilation * k - padding) // stride))
        if first < out and stride * first + dilation * k - padding < size:
            live.append(k)
    return live


def _row_plan(kernel: int, stride: int, dilation: int) -> tuple[int, list[int]]:
    """``R`` representatives and the output-row shift ``t`` of each kernel row (NOTE [row shifts])."""
    period = min(kernel, stride // math.gcd(stride, dilation))  # representatives 0..period-1
    shifts = [dilation * (k - k % period) // stride for k in range(kernel)]
    return period, shifts


#: one float moved through memory costs about as much time as this many multiply-adds
#: (fp32, H100: ~30 TFLOP/s over ~3 TB/s; two CPU cores: similar): the per-row route writes an
#: intermediate per output row, which only pays where products over samples and columns are long
_MEMORY_WEIGHT = 32.0
#: NOTE [launches count on a GPU]: one kernel launch costs about as much time as this many
#: multiply-adds. On a GPU the factor pass is bound by the host: launching a kernel (with its
#: Python) takes ~15-25 us, in which an H100 does 2-4e8 fp32 multiply-adds, and the host runs
#: ahead of the device, so the row shifts' launches (and their small, slow kernels) cost more
#: than the multiply-adds they save on maps up to 32×32. Measured, the whole KFAC pass (H100,
#: batch 128, mc): ResNet-18 at 32×32 19.5 ms with the row shifts on every layer, 12.0 ms
#: unfolded (gradient 7.1 ms); the ResNet-like CNN of bench_kfac (maps 32×32 to 4×4) 21.8 ms
#: and 16.3 ms (gradient 9.0 ms). The weight is set so that a GPU unfolds up to there and
#: takes the row shifts where they save tens of GMACs (56×56 maps of an ImageNet ResNet). On
#: a CPU a kernel is its arithmetic: no weight.
_LAUNCH_WEIGHT = {"cuda": 6e8}


def _costs(
    C: int, kh: int, kw: int, N: int, OH: int, OW: int, s: int, d: int
) -> tuple[float, float]:
    """Estimated cost (multiply-adds) of unfolding and of the row-shift route along this axis."""
    q = C * kh * kw
    M = N * OH * OW
    unfold = q * q * M + _MEMORY_WEIGHT * (2 * q * M + 2 * q * q)
    if kh == 1:
        return unfold, math.inf
    period, shifts = _row_plan(kh, s, d)
    most = max(shifts)
    rows = OH + 2 * most  # the first OH output rows, and each edge row once more
    left = period * C * kw
    lag = rows * left * q * N * OW + _MEMORY_WEIGHT * (
        2 * (OH + most) * q * N * OW + (3 * most + len(set(shifts))) * left * q + 12 * q * q
    )  # 12 q²: the blocks' strided copies and transposes (calibrated on CPU against unfolding)
    return unfold, lag


@dataclass(frozen=True)
class ConvFactorPlan:
    """How :func:`conv_input_moment` computes ``Σ a aᵀ`` for one input shape and convolution."""

    route: Literal["unfold", "rows", "zero"]  # "zero": every patch entry is padding
    transpose: bool  # the row shifts run along the image's columns
    box: tuple[int, int, int, int]  # live kernel offsets: rows [h0, h1), columns [w0, w1)
    period: int  # representative kernel rows (along the shifted axis); = box rows when unfolded
    shifts: tuple[int, ...]  # output-row shift of each kernel row of the box
    multiply_adds: int  # of the products
    unfold_multiply_adds: int  # of one product of the unfolded patches of the whole kernel


def conv_factor_plan(
    shape: tuple[int, ...] | torch.Size,
    kernel_size: tuple[int, int],
    stride: tuple[int, int],
    padding: tuple[int, int],
    dilation: tuple[int, int],
    impl: ConvFactorImpl = "auto",
    device_type: str = "cpu",
) -> ConvFactorPlan:
    """The plan for an input of ``shape (N, C, H, W)`` (shapes only: no data is read) on a device
    of ``device_type`` (``"cuda"``: kernel launches are weighed too, NOTE [launches count on a
    GPU])."""
    if impl not in ("auto", "unfold", "rows"):
        raise ValueError(f"impl must be 'auto', 'unfold' or 'rows', got {impl!r}")
    geometry = (tuple(kernel_size), tuple(stride), tuple(padding), tuple(dilation))
    return _plan(tuple(shape), *geometry, impl, _LAUNCH_WEIGHT.get(device_type, 0.0))


@functools.lru_cache(maxsize=256)  # plain arithmetic, but per module and pass: kept per shape
def _plan(
    shape: tuple[int, ...],
    kernel_size: tuple[int, int],
    stride: tuple[int, int],
    padding: tuple[int, int],
    dilation: tuple[int, int],
    impl: ConvFactorImpl,
    launch: float,
) -> ConvFactorPlan:
    N, C, H, W = shape
    KH, KW = kernel_size
    OH = conv_output_size(H, KH, stride[0], padding[0], dilation[0])
    OW = conv_output_size(W, KW, stride[1], padding[1], dilation[1])
    reference = (C * KH * KW) ** 2 * N * OH * OW
    live_h = _live(H, OH, KH, stride[0], padding[0], dilation[0])
    live_w = _live(W, OW, KW, stride[1], padding[1], dilation[1])
    if not live_h or not live_w:
        return ConvFactorPlan("zero", False, (0, 0, 0, 0), 0, (), 0, reference)

    def costs(box: tuple[int, int, int, int]) -> tuple[float, float, float]:
        bh, bw = box[1] - box[0], box[3] - box[2]
        unfold, lag_h = _costs(C, bh, bw, N, OH, OW, stride[0], dilation[0])
        _, lag_w = _costs(C, bw, bh, N, OW, OH, stride[1], dilation[1])
        return unfold, lag_h, lag_w

    box = (live_h[0], live_h[-1] + 1, live_w[0], live_w[-1] + 1)
    unfold, lag_h, lag_w = costs(box)
    whole = (0, KH, 0, KW)
    if impl == "auto" and box != whole:  # embedding a box costs a zero fill and a strided copy
        q_box = C * (box[1] - box[0]) * (box[3] - box[2])
        embed = _MEMORY_WEIGHT * ((C * KH * KW) ** 2 + 2 * q_box**2)
        if min(costs(whole)) <= min(unfold, lag_h, lag_w) + embed:
            box = whole
            unfold, lag_h, lag_w = costs(box)
    bh, bw = box[1] - box[0], box[3] - box[2]
    # launches: unfolding 3 (a pad, the patches' copy, one product), the row shifts ~9 + kh²
    unfold += 3 * launch
    lag_h += (9 + bh * bh) * launch
    lag_w += (9 + bw * bw) * launch
    transpose = lag_w < lag_h
    if transpose:
        bh, bw, OH, OW = bw, bh, OW, OH
    axis = 1 if transpose else 0
    q = C * bh * bw
    if (impl == "rows" or (impl == "auto" and min(lag_h, lag_w) < unfold)) and bh > 1:
        period, shifts = _row_plan(bh, stride[axis], dilation[axis])
        macs = (OH + 2 * max(shifts)) * period * C * bw * q * N * OW
        return ConvFactorPlan("rows", transpose, box, period, tuple(shifts), macs, reference)
    macs = q * q * N * OH * OW
    return ConvFactorPlan("unfold", transpose, box, bh, (0,) * bh, macs, reference)


def conv_input_moment(
    x: torch.Tensor,
    kernel_size: tuple[int, int],
    stride: tuple[int, int],
    padding: tuple[int, int],
    dilation: tuple[int, int],
    *,
    reduce: bool = False,
    impl: ConvFactorImpl = "auto",
    sums: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """``(S, s, rows)``: ``S = Σ a aᵀ`` (``(q, q)``, ``q = C·K_h·K_w`` in the weight's row-major
    order ``(c, k_h, k_w)``), ``s = Σ a`` (``(q,)``) and the number of rows summed, over every
    sample and output position of ``x (N, C, H, W)`` (``reduce``: over samples, ``a`` the mean of
    a sample's patches: window sums, no products per position).

    ``impl``: ``"unfold"`` (one product of the unfolded patches of the live kernel offsets),
    ``"rows"`` (NOTE [row shifts], wherever the shifted axis has more than one live offset) or
    ``"auto"`` (the cheaper of the two by an estimate of multiply-adds, memory traffic and, on a
    GPU, launches; see :func:`conv_factor_plan`). ``sums=False`` skips ``s`` (an empty tensor
    comes back), for a caller with no bias joined to the weight."""
    plan = conv_factor_plan(x.shape, kernel_size, stride, padding, dilation, impl, x.device.type)
    N, C, H, W = x.shape
    KH, KW = kernel_size
    OH = conv_output_size(H, KH, stride[0], padding[0], dilation[0])
    OW = conv_output_size(W, KW, stride[1], padding[1], dilation[1])
    if reduce:  # the mean patch of each sample: window sums of the padded input, no unfolding
        xp = F.pad(x, (padding[1], padding[1], padding[0], padding[0]))
        view = _patches(xp, kernel_size, stride, dilation, (OH, OW))
        mean = view.sum((-2, -1)).reshape(N, -1).div_(OH * OW)  # (N, q)
        return mean.T @ mean, (mean.sum(0) if sums else mean.new_empty(0)), N
    q = C * KH * KW
    s = x.new_zeros(C, KH, KW) if sums else x.new_empty(0)
    if plan.route == "zero":
        return x.new_zeros(q, q), s.reshape(-1), N * OH * OW
    h0, h1, w0, w1 = plan.box
    full = plan.box == (0, KH, 0, KW)
    S_full = (x.new_empty if full else x.new_zeros)(C, KH, KW, C, KH, KW)
    S = S_full
    box = (h1 - h0, w1 - w0)
    # the input padded (negative: cropped) so that the box's offsets start at 0
    pad_h = padding[0] - dilation[0] * h0
    pad_w = padding[1] - dilation[1] * w0
    transpose = plan.transpose
    if transpose:  # shift columns instead: the same computation on the transposed image
        x, box = x.transpose(2, 3), (box[1], box[0])
        pad_h, pad_w = pad_w, pad_h
        stride, dilation = (stride[1], stride[0]), (dilation[1], dilation[0])
        OH, OW = OW, OH
    kh, kw = box
    sh, sw = stride
    dh, dw = dilation
    period, shifts = plan.period, list(plan.shifts)
    rows = OH + max(shifts)
    # enough zero rows / columns after the input for every output row evaluated
    need_h = sh * (rows - 1) + dh * (kh - 1) + 1
    need_w = sw * (OW - 1) + dw * (kw - 1) + 1
    xp = F.pad(x, (pad_w, need_w - pad_w - x.shape[3], pad_h, need_h - pad_h - x.shape[2]))
    view = _patches(xp, box, stride, dilation, (rows, OW))  # (N, C, kh, kw, rows, OW)
    if (
        sums
    ):  # Σ a: window sums of the input summed over samples (one pass over x, then N times smaller)
        s_box = _patches(xp.sum(0, keepdim=True), box, stride, dilation, (OH, OW)).sum((0, -2, -1))
        s[:, h0:h1, w0:w1] = s_box.transpose(1, 2) if transpose else s_box
    if transpose:  # write through a view of S in the transposed axes
        S = S.permute(0, 2, 1, 3, 5, 4)
        h0, h1, w0, w1 = w0, w1, h0, h1
    target = S[:, h0:h1, w0:w1, :, h0:h1, w0:w1]  # (C, kh, kw, C, kh, kw)
    if period == kh:  # unfolded: one product over every position
        flat = view.permute(0, 4, 5, 1, 2, 3).reshape(-1, C * kh * kw)  # (positions, q)
        if full and not transpose:  # the product is the factor itself
            return flat.T @ flat, s.reshape(-1), N * OH * OW
        target.copy_((flat.T @ flat).view(C, kh, kw, C, kh, kw))
    else:
        _shifted_rows(view, period, shifts, OH, target)
    return S_full.reshape(q, q), s.reshape(-1), N * OH * OW


def _patches(
    xp: torch.Tensor,
    kernel: tuple[int, int],
    stride: tuple[int, int],
    dilation: tuple[int, int],
    out: tuple[int, int],
) -> torch.Tensor:
    """The strided view ``(N, C, K_h, K_w, OH, OW)`` of the padded input: ``[n, c, k, p] = xp[n, c,
    s·p + d·k]`` (no copy)."""
    N, C = xp.shape[:2]
    sN, sC, sH, sW = xp.stride()
    return xp.as_strided(
        (N, C, kernel[0], kernel[1], out[0], out[1]),
        (sN, sC, dilation[0] * sH, dilation[1] * sW, stride[0] * sH, stride[1] * sW),
        xp.storage_offset(),
    )


def _shifted_rows(
    view: torch.Tensor, period: int, shifts: list[int], OH: int, out: torch.Tensor
) -> None:
    """Writes ``S (C, K_h, K_w, C, K_h, K_w)`` into ``out`` from the representative rows' moments
    over shifted ranges of output rows (NOTE [row shifts])."""
    N, C, kh, kw, rows, OW = view.shape
    ck, M = C * kw, N * OW
    # (k_h, c, k_w | row, n, p_w): any range of output rows is a contiguous slice of columns
    patches = view.permute(2, 1, 3, 4, 0, 5).reshape(kh * ck, rows, M)
    rep = patches[: period * ck]
    # rows [t, t + OH) = rows [0, OH) - rows [0, t) + rows [OH, OH + t): one product over the
    # first OH rows, and one per output row at the two edges
    base = rep[:, :OH].reshape(period * ck, -1) @ patches[:, :OH].reshape(kh * ck, -1).T
    most = max(shifts)
    ranges = {0: base}
    if most:
        edge = torch.cat(
            [patches[:, :most], patches[:, OH : OH + most]], dim=1
        )  # (kh·ck, 2·most, M)
        per_row = torch.bmm(
            edge[: period * ck].transpose(0, 1), edge.permute(1, 2, 0)
        )  # (2·most, period·ck, kh·ck)
        change = (per_row[most:] - per_row[:most]).cumsum(0)
        for t in set(shifts) - {0}:
            ranges[t] = base + change[t - 1]
    blocks = out.new_empty(kh, ck, kh, ck)  # rows (k_h, c, k_w), columns (j_h, c', j_w)
    for a in range(kh):  # block row k_h = a, block column j_h = b
        for b in range(kh):
            da, db = a - a % period, b - b % period  # kernel-row shifts to the representatives
            if da <= db:
                r, j = a % period, b - da
                blocks[a, :, b] = ranges[shifts[a]][r * ck : (r + 1) * ck, j * ck : (j + 1) * ck]
            else:
                r, j = b % period, a - db
                blocks[a, :, b] = ranges[shifts[b]][r * ck : (r + 1) * ck, j * ck : (j + 1) * ck].T
    out.copy_(blocks.view(kh, C, kw, kh, C, kw).permute(1, 0, 2, 4, 3, 5))
