# mypy: disallow-untyped-defs=False, disallow-incomplete-defs=False, disallow-untyped-decorators=False
"""Triton kernel for the cross-entropy output-Hessian product.

Row-wise, with ``p = softmax(z)``::

    out = exp(z − M) / s · (u − t / s) · valid / n,
    M = max z,  s = Σ exp(z − M),  t = Σ exp(z − M) · u

The floor is one read of ``z``, one read of ``u`` and one write of ``out``.
Streaming a row twice (statistics, then output) moves 5 row-lengths instead
of 3, about 1.67× the floor, so every program holds its columns in
registers from their one read to their one write.

NOTE [split rows]
No single multiprocessor holds a long row: at V = 128256 in bfloat16, logits
and direction are 513 KB, against 256 KB of registers and 228 KB of shared
memory. A row is therefore split into ``split = ⌈V / chunk⌉`` chunks of
``chunk`` columns (a power of two), one program per chunk. Rows up to
``SINGLE_PASS_MAX_V`` columns are one chunk, and their program needs nobody
else. For longer rows:

1. A program takes a ticket from a counter (``atomic_add``), which names its
   row and chunk, loads the chunk, and writes the chunk's ``(m, s, t)`` to a
   workspace.
2. It counts itself in on the row's counter (release) and spins until all of
   the row's chunks are in (acquire).
3. It combines the row's statistics in chunk order (``s = Σ s_k·exp(m_k −
   M)``, the same for ``t``; bitwise reproducible), rescales its chunk, and
   writes the output.

The spin cannot deadlock as long as the device holds ``split`` programs at
once. Tickets are handed out in order, so every row except the newest has all
its chunks held by running programs, which finish. Only the newest row can
wait on programs that have not started, and those start as soon as the
programs of older rows finish. The host falls back to two launches, one
writing the statistics and one the output (reading the inputs twice), where
``split`` exceeds the number of multiprocessors, and always on the Triton
interpreter, which runs programs one after another.

Extra memory: the workspace, ``4 + 12·s`` bytes per row, ``s`` being
``split`` rounded up to a power of two (0.15% of bfloat16 logits at
V = 128256), and none for rows of one chunk.

An earlier version kept one program per row, a head of the row in registers
and the rest streamed twice with L2 eviction hints; it sat at 1.22–1.59× the
floor on long rows where this one reaches 1.03–1.27×
(benchmarks/RESULTS_kernels.md).
"""

# No ``from __future__ import annotations`` here: triton 3.0's interpreter
# (TRITON_INTERPRET=1, the torch 2.4 line) recognizes constexpr parameters
# only by evaluated ``tl.constexpr`` annotations, not by strings.

import functools
import math
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from hessian_eigenthings._checks import InternalError

# Finite stand-in for −inf as the running maximum: exp(-inf - (-inf)) is NaN,
# exp(-inf - _MIN) is 0, so masked lanes and ignored rows contribute nothing.
_MIN = tl.constexpr(-3.0e38)


@triton.jit
def _ce_hvp_kernel(
    z_ptr,
    u_ptr,
    out_ptr,
    valid_ptr,
    n_ptr,
    part_ptr,
    count_ptr,
    inner,
    V,
    split,
    z_s0,
    z_s1,
    z_sv,
    u_s0,
    u_s1,
    u_sv,
    o_s0,
    o_s1,
    o_sv,
    inv_n,
    HAS_VALID: tl.constexpr,
    N_ON_DEVICE: tl.constexpr,
    CHUNK: tl.constexpr,
    SPLIT_P2: tl.constexpr,
    PHASE: tl.constexpr,
):
    # See NOTE [split rows]. PHASE 0: the whole row in this program. 1: write
    # this chunk's statistics only. 2: combine the statistics, write the
    # output. 3: 1, wait for the row's other chunks, then 2.
    if PHASE == 3:  # noqa: SIM108 (constexpr branch)
        ticket = tl.atomic_add(count_ptr, 1)
    else:
        ticket = tl.program_id(0)
    row = ticket // split
    part = ticket % split
    # Rows are (outer, inner) pairs so sliced logits (e.g. ``z[:, :-1]``) need
    # no copy; int64 offsets because B·T·V exceeds 2**31.
    r0 = (row // inner).to(tl.int64)
    r1 = (row % inner).to(tl.int64)
    c = part * CHUNK + tl.arange(0, CHUNK)
    cin = c < V
    if HAS_VALID:
        ok = tl.load(valid_ptr + row) != 0
        cload = c < V * ok.to(tl.int32)  # ignored rows are never read (masked loads move no bytes)
    else:
        cload = cin
    z = tl.load(z_ptr + r0 * z_s0 + r1 * z_s1 + c * z_sv, mask=cload, other=-float("inf"))
    u = tl.load(u_ptr + r0 * u_s0 + r1 * u_s1 + c * u_sv, mask=cload, other=0.0).to(tl.float32)
    m = tl.maximum(tl.max(z.to(tl.float32), axis=0), _MIN)
    e = tl.exp(z.to(tl.float32) - m)
    stats = part_ptr + row.to(tl.int64) * (3 * SPLIT_P2)
    if PHASE != 2:
        s = tl.sum(e, axis=0)
        t = tl.sum(e * u, axis=0)
    if PHASE == 1 or PHASE == 3:
        tl.store(stats + part, m)
        tl.store(stats + SPLIT_P2 + part, s)
        tl.store(stats + 2 * SPLIT_P2 + part, t)
    if PHASE == 3:
        # Every thread's stores are ordered before the release that counts
        # this chunk in; the acquire that sees all of them orders the reads.
        tl.debug_barrier()
        arrived = tl.atomic_add(count_ptr + 1 + row, 1, sem="release") + 1
        while arrived < split:
            arrived = tl.atomic_add(count_ptr + 1 + row, 0, sem="acquire")
        tl.debug_barrier()
    if PHASE >= 2:
        # ".cg": other multiprocessors wrote these; read them from L2, not a
        # line this multiprocessor's L1 may hold from a neighbouring row.
        k = tl.arange(0, SPLIT_P2)
        kin = k < split
        pm = tl.load(stats + k, mask=kin, other=_MIN, cache_modifier=".cg")
        ps = tl.load(stats + SPLIT_P2 + k, mask=kin, other=0.0, cache_modifier=".cg")
        pt = tl.load(stats + 2 * SPLIT_P2 + k, mask=kin, other=0.0, cache_modifier=".cg")
        mm = tl.max(pm, axis=0)
        w = tl.exp(pm - mm)
        s = tl.sum(ps * w, axis=0)
        t = tl.sum(pt * w, axis=0)
        e = e * tl.exp(m - mm)
    if PHASE != 1:
        if N_ON_DEVICE:  # noqa: SIM108 (constexpr branch, resolved at compile time)
            scale = 1.0 / tl.load(n_ptr).to(tl.float32)
        else:
            scale = inv_n
        if HAS_VALID:
            # s and t are 0 on ignored rows: a is 0, b is 0/1, the output 0.
            a = tl.where(ok, scale, 0.0) / tl.where(ok, s, 1.0)
            b = t / tl.where(ok, s, 1.0)
        else:
            a = scale / s
            b = t / s
        o = e * a * (u - b)
        tl.store(
            out_ptr + r0 * o_s0 + r1 * o_s1 + c * o_sv, o.to(out_ptr.dtype.element_ty), mask=cin
        )


@dataclass(frozen=True)
class TritonConfig:
    """Launch parameters of the kernel (NOTE [split rows]).

    ``chunk``: columns per program, a power of two >= 16; a row of ``V``
    columns takes ``⌈V / chunk⌉`` programs (one when ``V <= chunk``).
    ``num_warps``: warps per program.
    """

    chunk: int = 4096
    num_warps: int = 4

    def __post_init__(self) -> None:
        if self.chunk < 16 or self.chunk & (self.chunk - 1):
            raise ValueError(f"TritonConfig.chunk must be a power of two >= 16, got {self.chunk}")
        if self.num_warps not in (1, 2, 4, 8, 16, 32):
            raise ValueError(
                f"TritonConfig.num_warps must be a power of two <= 32, got {self.num_warps}"
            )


def _next_pow2(x: int) -> int:
    return 1 << max(4, (x - 1).bit_length())


#: Longest row (in columns) that one program holds whole by default.
SINGLE_PASS_MAX_V = 16384

#: Columns per program when a longer row is split (NOTE [split rows]).
SPLIT_CHUNK = 4096


def default_config(V: int) -> TritonConfig:
    """Launch parameters chosen from the row length.

    From the sweeps of benchmarks/bench_kernels.py on an H100 (see
    benchmarks/RESULTS_kernels.md): 32 columns per thread was the best point
    at every row length. Rows up to 16384 columns are one program each;
    longer rows are split into 4096-column chunks of 4 warps, 1.03× (float32,
    V = 50304) to 1.26× (bfloat16) the bandwidth floor.
    """
    if V <= SINGLE_PASS_MAX_V:
        chunk = _next_pow2(V)
        return TritonConfig(chunk=chunk, num_warps=min(16, max(1, chunk // 1024)))
    return TritonConfig(chunk=SPLIT_CHUNK, num_warps=4)


@functools.lru_cache(maxsize=16)
def _num_sms(index: int) -> int:
    return int(torch.cuda.get_device_properties(index).multi_processor_count)


def _row_layout(*xs: torch.Tensor) -> tuple[int, list[tuple[int, int, int]]] | None:
    """A row addressing shared by tensors of one shape ``(..., V)``.

    Returns ``inner`` and per tensor ``(s0, s1, sv)`` such that row ``r``
    starts at ``(r // inner)·s0 + (r % inner)·s1``; leading dims are merged
    where every tensor allows it. ``None`` when more than two remain (the
    caller then copies).
    """
    shape = xs[0].shape[:-1]
    keep_dims = [i for i, size in enumerate(shape) if size != 1]
    groups: list[list[int]] = []
    for i in keep_dims:
        if groups and all(x.stride(groups[-1][-1]) == x.stride(i) * shape[i] for x in xs):
            groups[-1].append(i)
        else:
            groups.append([i])
    if len(groups) > 2:
        return None
    while len(groups) < 2:
        groups.insert(0, [])
    inner = math.prod(shape[i] for i in groups[1])
    strides = [
        (
            x.stride(groups[0][-1]) if groups[0] else 0,
            x.stride(groups[1][-1]) if groups[1] else 0,
            x.stride(-1),
        )
        for x in xs
    ]
    return inner, strides


def interpreter_active() -> bool:
    """Whether triton was imported in interpreter mode (CPU tensors allowed)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def cross_entropy_hvp_triton(
    logits: torch.Tensor,
    u: torch.Tensor,
    valid: torch.Tensor | None,
    n: float | torch.Tensor | None,
    out: torch.Tensor | None = None,
    config: TritonConfig | None = None,
) -> torch.Tensor:
    """Fused product on CUDA (or on CPU under ``TRITON_INTERPRET=1``).

    Shapes and dtypes are checked by the caller (``cross_entropy_hvp``).
    ``n``: number, 0-d tensor (read on device, no host sync), or ``None``
    (number of valid rows, counted on device).
    """
    V = logits.shape[-1]
    if out is None:
        out = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
    rows = logits.numel() // V if V else 0
    if rows == 0 or V == 0:
        return out
    cfg = config if config is not None else default_config(V)

    target = out
    layout = _row_layout(logits, u, out)
    if layout is None:
        # More than two non-mergeable leading dims: flat copies, and an output
        # buffer we can address (copied back into ``out`` at the end).
        logits, u = logits.reshape(rows, V), u.reshape(rows, V)
        target = torch.empty((rows, V), dtype=out.dtype, device=out.device)
        layout = _row_layout(logits, u, target)
        if layout is None:
            raise InternalError("layout is not None")
    inner, strides = layout

    valid_flat = valid.reshape(rows).view(torch.uint8) if valid is not None else None
    n_dev: torch.Tensor | None = None
    inv_n = 1.0
    if isinstance(n, torch.Tensor):
        n_dev = n.reshape(())
    elif n is None:
        if valid_flat is not None:
            n_dev = valid_flat.sum()
        else:
            inv_n = 1.0 / rows
    else:
        inv_n = 1.0 / float(n) if n != 0 else math.inf

    _launch(logits, u, target, valid_flat, n_dev, inv_n, rows, V, inner, strides, cfg)
    if target is not out:
        out.copy_(target.reshape(out.shape))
    return out


def _launch(
    logits: torch.Tensor,
    u: torch.Tensor,
    out: torch.Tensor,
    valid_flat: torch.Tensor | None,
    n_dev: torch.Tensor | None,
    inv_n: float,
    rows: int,
    V: int,
    inner: int,
    strides: list[tuple[int, int, int]],
    cfg: TritonConfig,
) -> None:
    """Rows in ``cfg.chunk``-column chunks, one program each (NOTE [split rows])."""
    chunk = min(cfg.chunk, _next_pow2(V))
    split = -(-V // chunk)
    split_p2 = 1 << (split - 1).bit_length()
    if rows * split >= 2**31:
        raise ValueError(f"{rows} rows of {split} chunks exceed the kernel's int32 row index")
    (z0, z1, zv), (u0, u1, uv), (o0, o1, ov) = strides
    dev = logits.device
    # Placeholder pointers stand in for what a launch does not use.
    partials = counts = logits
    if split == 1:
        phases: tuple[int, ...] = (0,)
    else:
        partials = torch.empty(rows * 3 * split_p2, dtype=torch.float32, device=dev)
        if logits.is_cuda and split <= _num_sms(dev.index or 0):
            counts = torch.zeros(rows + 1, dtype=torch.int32, device=dev)
            phases = (3,)
        else:
            phases = (1, 2)
    for phase in phases:
        _ce_hvp_kernel[(rows * split,)](
            logits,
            u,
            out,
            valid_flat if valid_flat is not None else logits,
            n_dev if n_dev is not None else logits,
            partials,
            counts,
            inner,
            V,
            split,
            z0,
            z1,
            zv,
            u0,
            u1,
            uv,
            o0,
            o1,
            ov,
            inv_n,
            HAS_VALID=valid_flat is not None,
            N_ON_DEVICE=n_dev is not None,
            CHUNK=chunk,
            SPLIT_P2=split_p2,
            PHASE=phase,
            num_warps=cfg.num_warps,
        )
