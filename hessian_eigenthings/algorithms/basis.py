"""Where a Krylov basis lives: on the operator's device, or in host memory streamed in panels.

:class:`KrylovBasis` keeps the rows of a basis in one tensor on the device that the
algorithm computes on (the default, and the 1.0 behaviour). :class:`StreamedBasis` keeps them
on another device (host memory, pinned when the operator is on CUDA) and moves them to the
compute device a panel at a time for each product with the basis, so that the device holds
``O(chunk)`` numbers of the basis instead of ``O(ncv · n)``. Both offer the same operations
(the Gram-Schmidt products, the thick restart, the Ritz-vector assembly, rows in and out), so
the algorithms above them do not change. :class:`RunBases` and :class:`StreamedRuns` are the
same two placements for the ``r`` lockstep bases of stochastic Lanczos quadrature. See NOTE
[basis off the device].
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from hessian_eigenthings.algorithms._common import host_arithmetic
from hessian_eigenthings.linalg import LinAlgBackend

__all__ = [
    "CHUNK_BYTES",
    "KrylovBasis",
    "RunBases",
    "StreamedBasis",
    "StreamedRuns",
    "as_basis_device",
    "basis_too_large",
    "new_basis",
    "new_run_bases",
    "panel_width",
]

#: bytes of a streamed basis on the compute device at once: a staged panel and, in restarts and
#: the Ritz-vector assembly, the panel of their output. See NOTE [basis off the device].
CHUNK_BYTES = 2**30

# NOTE [basis off the device]
# At 8 B parameters sharded over 4 GPUs a vector is 2 B numbers a rank (8 GB in float32), and a
# Lanczos basis of ncv + b >= 12 of them does not fit an 80 GB card beside the model. With
# `basis_device="cpu"` the basis lives in host memory (pinned when the operator is on CUDA, so
# that copies are DMA and asynchronous) and moves to the device for each product with it.
# Layout: the columns (the vector's entries) are cut into panels of `w` columns; a panel holds
# those columns of every row, contiguous, so the rows [lo, hi) of a panel are one copy. Every
# product the algorithms make with the basis is a sum over columns (inner products) or acts on
# each column alone (W - Hᵀ V, Sₖ V), so it runs one panel at a time with one staged panel on
# the device. Panels rather than row chunks for two reasons: the thick restart V[:l] = Sₖ V[:m]
# overwrites rows that later outputs still read, which row chunks can only do with a second
# host buffer of l rows or l / chunk passes over the basis, while a panel is restarted in place
# in one pass; and the first pass's subtraction and the second pass's inner products of
# classical Gram-Schmidt twice (CGS2) read the same panel, so CGS2 streams the basis three
# times a step instead of four (inner products; subtraction and the second inner products;
# second subtraction). Each pass's inner products are summed over the panels locally, then
# all-reduced once (a sharded backend's all-reduce is unchanged; each rank streams its own
# shard's columns). Device memory: w is the largest width with cap · w numbers (cap: the rows)
# in half of CHUNK_BYTES, rounded down so that a panel's bytes fit a power of two (torch's
# pinned allocator rounds every allocation up to one); the staging buffer takes cap · w, an
# output panel at most as much, so the basis never has more than CHUNK_BYTES on the device
# (besides the block the next product is applied to, which the step needs anyway). What moves
# per step (b vectors a block, `top` rows streamed, n numbers a vector, s bytes a number): to
# the device (3 · top + b) · n · s (CGS2, and the block to apply), to the host b · n · s (the new
# block); a thick restart moves (top + b) rows in and (l + b) out; the Ritz vectors, top rows in
# and k out, to host memory (`result.eigenvectors` is then a host tensor). The copies are
# non-blocking on the compute device's current stream, so the order of copies and products is
# the stream's; the host reads the panels only after synchronizing it (checkpoints). Results
# equal the on-device basis' to rounding (sums over panels in another order): float64 runs
# agree to 1e-12 (tests/algorithms/test_host_basis.py). Pinned memory is handed back at the end
# of the call (torch's pinned allocator would otherwise keep it cached for the process).
# Measured on one H100 (pinned copies 55 GB/s each way; float32, n = 100 M, k = 5, ncv = 20):
# 1.7 GiB on the GPU for the solver instead of 11.9, 443 ms a step instead of 12.5 ms, the
# panels moving at 38 GB/s; the copy of a panel and its product run one after the other on one
# stream (the product takes a few percent of the copy), so a second staging buffer on a copy
# stream would gain little. On a CPU operator the option only adds copies: 2.2 times the thread
# time of the default (diagonal operator, n = 1e5 and 1e6, one thread).


def panel_width(rows: int, n: int, dtype: torch.dtype, chunk_bytes: int) -> int:
    """Columns per panel of a streamed basis of ``rows`` rows of length ``n``: See NOTE [basis
    off the device]."""
    half = max(1, chunk_bytes // 2)
    pow2 = 1 << (half.bit_length() - 1)  # the largest power of two <= half
    w = pow2 // max(1, rows * dtype.itemsize)
    return max(1, min(w, n))


def as_basis_device(device: str | torch.device | None) -> torch.device | None:
    """``basis_device`` as a ``torch.device`` (``None``: the operator's); raises ``ValueError``
    for what is not a device."""
    if device is None:
        return None
    if not isinstance(device, (str, torch.device)):
        raise TypeError(
            f"basis_device must be a device (e.g. 'cpu') or None, got {type(device).__name__}"
        )
    try:
        return torch.device(device)
    except RuntimeError as exc:
        raise ValueError(f"basis_device={device!r} is not a device: {exc}") from exc


def basis_too_large(
    rows: int, n: int, dtype: torch.dtype, device: torch.device, smaller: str = "a smaller ncv"
) -> str:
    """The one line for a Krylov basis that does not fit on its device; ``smaller``: the
    argument that shrinks it."""
    size = rows * n * (torch.finfo(dtype).bits // 8) / 1e9
    return (
        f"the Krylov basis ({rows} vectors of {n} {str(dtype).removeprefix('torch.')}, "
        f"{size:.1f} GB) does not fit on {device}: pass basis_device='cpu' (the basis in host "
        f"memory, moved per product) or {smaller}"
    )


class KrylovBasis:
    """``rows`` basis vectors of length ``n`` in ``dtype``, on ``device`` (the operator's), in
    one tensor ``V``. The operations are the algorithms' products with the basis."""

    streamed = False

    def __init__(self, rows: int, n: int, dtype: torch.dtype, device: torch.device) -> None:
        self.rows, self.n, self.dtype, self.device = rows, n, dtype, device
        try:
            self.V = torch.empty(rows, n, dtype=dtype, device=device)
        except torch.cuda.OutOfMemoryError as exc:  # say what the basis needs and the way out
            raise torch.cuda.OutOfMemoryError(basis_too_large(rows, n, dtype, device)) from exc

    def host_view(self, backend: LinAlgBackend) -> np.ndarray[Any, Any] | None:
        """The numpy view of ``V`` when steps run in numpy (NOTE [small operators on the host])."""
        return self.V.numpy() if host_arithmetic(self.V, backend) else None

    def read(self, lo: int, hi: int) -> torch.Tensor:
        """Rows ``[lo, hi)`` on the device."""
        return self.V[lo:hi]

    def write(self, row: int, X: torch.Tensor) -> None:
        """Rows ``[row, row + len(X))`` set to ``X`` (any device)."""
        self.V[row : row + X.shape[0]] = X

    def to_cpu(self, rows: slice) -> torch.Tensor:
        """A CPU copy of ``V[rows]``."""
        return self.V[rows].to("cpu", copy=True)

    def inner(self, lo: int, hi: int, W: torch.Tensor, backend: LinAlgBackend) -> torch.Tensor:
        """``<V[lo:hi], W>``: ``(hi - lo, p)`` for ``W (p, n)``, reduced over the shards."""
        return backend.inner_rows(self.V[lo:hi], W)

    def subtract(self, lo: int, hi: int, H: torch.Tensor, W: torch.Tensor) -> torch.Tensor:
        """``W - Hᵀ V[lo:hi]`` (a new tensor)."""
        return W - H.T @ self.V[lo:hi]

    def subtract_inner(
        self, lo: int, hi: int, H: torch.Tensor, W: torch.Tensor, backend: LinAlgBackend
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``W' = W - Hᵀ V[lo:hi]`` and ``<V[lo:hi], W'>``: a CGS pass's subtraction and the
        next pass's inner products."""
        W = self.subtract(lo, hi, H, W)
        return W, self.inner(lo, hi, W, backend)

    def project_out(self, Z: torch.Tensor, hi: int, backend: LinAlgBackend) -> torch.Tensor:
        """``Z`` less its projection on ``V[:hi]`` (one classical Gram-Schmidt pass)."""
        return Z - backend.inner_rows(Z, self.V[:hi]) @ self.V[:hi]

    def combine(self, C: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
        """``C V[lo:hi]`` for ``C (p, hi - lo)`` on the device, where the basis lives."""
        return C @ self.V[lo:hi]

    def restart(self, Sk: torch.Tensor, top: int, b: int) -> None:
        """Thick restart in place: ``V[:l] = Sk V[:top]`` and ``V[l : l + b] = V[top : top + b]``
        for ``Sk (l, top)`` on the device."""
        n_keep = Sk.shape[0]
        self.V[:n_keep] = Sk @ self.V[:top]
        self.V[n_keep : n_keep + b] = self.V[top : top + b].clone()  # the ranges may overlap

    def release(self) -> None:
        """Free what the basis holds beyond garbage collection (pinned memory): at the end of a
        call."""


class StreamedBasis(KrylovBasis):
    """A :class:`KrylovBasis` whose rows live on ``store`` (host memory) in column panels and
    move to ``device`` one panel at a time: See NOTE [basis off the device].

    Counters (for tests and benchmarks): ``peak_device_numbers``, the most numbers of the basis
    on the compute device at once; ``numbers_in`` / ``numbers_out``, the numbers copied to the
    device and back."""

    streamed = True

    def __init__(
        self,
        rows: int,
        n: int,
        dtype: torch.dtype,
        device: torch.device,
        store: torch.device,
        chunk_bytes: int | None = None,
    ) -> None:
        self.rows, self.n, self.dtype, self.device, self.store = rows, n, dtype, device, store
        w = panel_width(rows, n, dtype, CHUNK_BYTES if chunk_bytes is None else chunk_bytes)
        self.width = w
        self.pinned = store.type == "cpu" and device.type == "cuda"
        self.columns = [slice(a, min(a + w, n)) for a in range(0, max(n, 1), w)]
        self.panels = [
            torch.empty(rows, c.stop - c.start, dtype=dtype, device=store, pin_memory=self.pinned)
            for c in self.columns
        ]
        self.stage = torch.empty(rows * w, dtype=dtype, device=device)
        self.peak_device_numbers = self.stage.numel()
        self.numbers_in = 0
        self.numbers_out = 0

    def host_view(self, backend: LinAlgBackend) -> np.ndarray[Any, Any] | None:
        return None

    def staged(self, lo: int, hi: int) -> Iterator[tuple[int, slice, torch.Tensor]]:
        """For each panel: its index, its columns and its rows ``[lo, hi)`` on the device (in
        the staging buffer, valid until the next panel)."""
        for c, (cols, panel) in enumerate(zip(self.columns, self.panels, strict=True)):
            P = self.stage[: (hi - lo) * panel.shape[1]].view(hi - lo, panel.shape[1])
            P.copy_(panel[lo:hi], non_blocking=True)
            self.numbers_in += P.numel()
            yield c, cols, P

    def _output(self, Y: torch.Tensor) -> None:
        """Count an output panel ``Y`` on the device beside the staging buffer."""
        self.peak_device_numbers = max(self.peak_device_numbers, self.stage.numel() + Y.numel())

    def _put(self, c: int, row: int, Y: torch.Tensor) -> None:
        """Rows ``[row, row + len(Y))`` of panel ``c`` set to ``Y`` (non-blocking)."""
        self.panels[c][row : row + Y.shape[0]].copy_(Y, non_blocking=True)
        self.numbers_out += Y.numel()

    def _sync(self) -> None:
        """Wait for the copies in flight before the host touches the panels."""
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()

    def read(self, lo: int, hi: int) -> torch.Tensor:
        out = torch.empty(hi - lo, self.n, dtype=self.dtype, device=self.device)
        for _, cols, P in self.staged(lo, hi):
            out[:, cols] = P
        return out

    def write(self, row: int, X: torch.Tensor) -> None:
        if X.device.type != "cuda":
            self._sync()
        X = X.to(self.dtype)
        for c, cols in enumerate(self.columns):
            self._put(c, row, X[:, cols])

    def to_cpu(self, rows: slice) -> torch.Tensor:
        """The rows as one new host tensor, each panel's columns copied once into it (a
        checkpoint's copy: at 8 B parameters a row is 32 GB, so no second transient copy)."""
        self._sync()
        picked = [panel[rows] for panel in self.panels]
        out = torch.empty(picked[0].shape[0], self.n, dtype=self.dtype)
        for P, cols in zip(picked, self.columns, strict=True):
            out[:, cols] = P
        return out

    def inner(self, lo: int, hi: int, W: torch.Tensor, backend: LinAlgBackend) -> torch.Tensor:
        H = torch.zeros(hi - lo, W.shape[0], dtype=W.dtype, device=self.device)
        for _, cols, P in self.staged(lo, hi):
            H.addmm_(P, W[:, cols].T)
        return backend.all_reduce_sum(H)

    def subtract(self, lo: int, hi: int, H: torch.Tensor, W: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(W)
        for _, cols, P in self.staged(lo, hi):
            out[:, cols] = torch.addmm(W[:, cols], H.T, P, alpha=-1)
        return out

    def subtract_inner(
        self, lo: int, hi: int, H: torch.Tensor, W: torch.Tensor, backend: LinAlgBackend
    ) -> tuple[torch.Tensor, torch.Tensor]:
        out = torch.empty_like(W)
        H2 = torch.zeros_like(H)
        for _, cols, P in self.staged(lo, hi):
            w = torch.addmm(W[:, cols], H.T, P, alpha=-1)
            out[:, cols] = w
            H2.addmm_(P, w.T)
        return out, backend.all_reduce_sum(H2)

    def project_out(self, Z: torch.Tensor, hi: int, backend: LinAlgBackend) -> torch.Tensor:
        return self.subtract(0, hi, self.inner(0, hi, Z, backend), Z)

    def combine(self, C: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
        out = torch.empty(C.shape[0], self.n, dtype=self.dtype, device=self.store)
        for _, cols, P in self.staged(lo, hi):
            Y = C @ P
            self._output(Y)
            out[:, cols] = Y
            self.numbers_out += Y.numel()
        return out

    def restart(self, Sk: torch.Tensor, top: int, b: int) -> None:
        n_keep = Sk.shape[0]
        for c, _, P in self.staged(0, top + b):
            Y = Sk @ P[:top]
            self._output(Y)
            self._put(c, 0, Y)
            self._put(c, n_keep, P[top : top + b])  # staged before the writes: overlap is fine

    def release(self) -> None:
        self._sync()
        self.panels = []
        self.stage = torch.empty(0, dtype=self.dtype, device=self.device)
        if self.pinned:
            # torch keeps freed pinned memory cached for the process: hand it back
            empty = getattr(torch._C, "_host_emptyCache", None)
            if empty is not None:
                empty()


def new_basis(
    rows: int, n: int, dtype: torch.dtype, device: torch.device, store: torch.device | None
) -> KrylovBasis:
    """The basis of a Lanczos run: on ``device`` (``store=None``), else streamed from ``store``."""
    if store is None:
        return KrylovBasis(rows, n, dtype, device)
    return StreamedBasis(rows, n, dtype, device, store)


class RunBases:
    """The bases of ``r`` Lanczos runs in lockstep (SLQ): ``slots`` vectors a run, ``(r, slots,
    n)`` on the device; vector ``j`` of every run is ``Vb[:, j % slots]`` (two slots: the last
    two vectors, without reorthogonalization)."""

    streamed = False

    def __init__(
        self, r: int, slots: int, n: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        self.r, self.slots = r, slots
        try:
            self.Vb = torch.empty(r, slots, n, dtype=dtype, device=device)
        except torch.cuda.OutOfMemoryError as exc:  # as KrylovBasis: the size and the ways out
            shrink = "fewer num_runs or lanczos_steps, or reorthogonalize=False (two vectors a run)"
            raise torch.cuda.OutOfMemoryError(
                basis_too_large(r * slots, n, dtype, device, shrink)
            ) from exc

    def vector(self, j: int) -> torch.Tensor:
        """Vector ``j`` of every run, ``(r, n)`` on the device."""
        return self.Vb[:, j % self.slots]

    def set(self, j: int, X: torch.Tensor) -> None:
        self.Vb[:, j % self.slots] = X

    def reorthogonalize(
        self, t: int, W: torch.Tensor, backend: LinAlgBackend
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """CGS2 of each run's row of ``W (r, n)`` against its first ``t`` vectors; the new
        ``W`` and the summed projections ``(r, t)``."""
        basis = self.Vb[:, :t]
        H = backend.all_reduce_sum(torch.bmm(basis, W.unsqueeze(2)).squeeze(2))  # (r, t)
        W = W - torch.bmm(H.unsqueeze(1), basis).squeeze(1)
        H2 = backend.all_reduce_sum(torch.bmm(basis, W.unsqueeze(2)).squeeze(2))
        W = W - torch.bmm(H2.unsqueeze(1), basis).squeeze(1)
        return W, H + H2

    def basis(self, i: int, m: int) -> torch.Tensor:
        """Run ``i``'s first ``m`` vectors."""
        return self.Vb[i, :m]

    def release(self) -> None:
        """As :meth:`KrylovBasis.release`."""


class StreamedRuns(RunBases):
    """:class:`RunBases` streamed from ``store``: row ``j · r + i`` of a :class:`StreamedBasis`
    is run ``i``'s vector ``j``, so the first ``t`` vectors of every run are one range of rows.
    The last two vectors set stay on the device (the next product's input and, without
    reorthogonalization, the one before)."""

    streamed = True

    def __init__(
        self,
        r: int,
        slots: int,
        n: int,
        dtype: torch.dtype,
        device: torch.device,
        store: torch.device,
    ) -> None:
        self.r, self.slots = r, slots
        self.rows = StreamedBasis(r * slots, n, dtype, device, store)
        self.recent: dict[int, torch.Tensor] = {}

    def vector(self, j: int) -> torch.Tensor:
        if j in self.recent:
            return self.recent[j]
        return self.rows.read(j * self.r, (j + 1) * self.r)

    def set(self, j: int, X: torch.Tensor) -> None:
        self.rows.write(j * self.r, X)
        self.recent = {k: v for k, v in self.recent.items() if k == j - 1}
        self.recent[j] = X

    def reorthogonalize(
        self, t: int, W: torch.Tensor, backend: LinAlgBackend
    ) -> tuple[torch.Tensor, torch.Tensor]:
        r = self.r
        H = torch.zeros(r, t, dtype=W.dtype, device=W.device)
        for _, cols, P in self.rows.staged(0, t * r):
            P3 = P.view(t, r, -1)
            for i in range(r):
                H[i] += P3[:, i] @ W[i, cols]
        H = backend.all_reduce_sum(H)
        out = torch.empty_like(W)
        H2 = torch.zeros_like(H)
        for _, cols, P in self.rows.staged(0, t * r):
            P3 = P.view(t, r, -1)
            for i in range(r):
                w = W[i, cols] - H[i] @ P3[:, i]
                out[i, cols] = w
                H2[i] += P3[:, i] @ w
        H2 = backend.all_reduce_sum(H2)
        W2 = torch.empty_like(W)
        for _, cols, P in self.rows.staged(0, t * r):
            P3 = P.view(t, r, -1)
            for i in range(r):
                W2[i, cols] = out[i, cols] - H2[i] @ P3[:, i]
        return W2, H + H2

    def basis(self, i: int, m: int) -> torch.Tensor:
        return self.rows.to_cpu(slice(i, m * self.r, self.r))

    def release(self) -> None:
        self.recent = {}
        self.rows.release()


def new_run_bases(
    r: int,
    slots: int,
    n: int,
    dtype: torch.dtype,
    device: torch.device,
    store: torch.device | None,
) -> RunBases:
    """The bases of ``r`` lockstep runs: on ``device`` (``store=None``), else streamed."""
    if store is None:
        return RunBases(r, slots, n, dtype, device)
    return StreamedRuns(r, slots, n, dtype, device, store)
