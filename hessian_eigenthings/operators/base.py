"""The operator protocol and the data-driven base every curvature type shares.

:class:`CurvatureOperator` is a symmetric matrix-free operator over a flat
vector of length ``n``. Subclasses implement ``_matvec`` (one vector) or
``_matmat_rows`` (a row block ``(k, n)``); each gets the other for free. The
public ``matvec`` / ``matmat`` / ``@`` / ``__call__`` validate shape, dtype
and device, then call the private one.

:class:`DataCurvatureOperator` owns everything the Hessian, GGN and Fisher
have in common: parameter selection and layout, the data loop
(``full_dataset``, ``num_batches``, cycling), microbatching, batch-size
weighting ``Σ bᵢ·Cᵢ / Σ bᵢ``, the output buffer, block chunking, graph
reuse and restoring the model exactly. A curvature type writes two methods:
``_prepare(batch)`` (forward and whatever first-order graph it needs) and
``_apply(state, vecs, retain)`` (the per-batch product for a block).

Cost per product: whatever the subclass's per-batch product costs, plus one
copy of the result into a flat buffer; no ``torch.cat``, no host sync.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import warnings
from abc import ABC
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, TypedDict

import torch
from torch import nn

from hessian_eigenthings import _torch_compat
from hessian_eigenthings._checks import check_count
from hessian_eigenthings._warnings import user_stacklevel
from hessian_eigenthings.batching import (
    Batch,
    BatchSource,
    batch_size,
    check_microbatching,
    map_tensors,
    split_batch,
    to_device,
)
from hessian_eigenthings.linalg import LinAlgBackend, default_backend
from hessian_eigenthings.operators.engines import ENGINES, EngineName, EngineSelector
from hessian_eigenthings.operators.precision import (
    Precision,
    check_precision,
    precision_flags,
    product_precision,
)
from hessian_eigenthings.param_utils import (
    ParamFilter,
    ParamLayout,
    call_with_values,
    select_parameters,
)

# --------------------------------------------------------------------------
# The protocol
# --------------------------------------------------------------------------


def same_device(a: torch.device, b: torch.device) -> bool:
    """``cuda`` and ``cuda:0`` are the same device when 0 is the current one."""
    if a.type != b.type:
        return False
    if a.index is None or b.index is None:
        current = torch.cuda.current_device() if a.type == "cuda" and torch.cuda.is_available() else 0
        return (a.index if a.index is not None else current) == (b.index if b.index is not None else current)
    return a.index == b.index


class CurvatureOperator(ABC):
    """Symmetric linear operator ``A`` of shape ``(n, n)``, known through products.

    Implement ``_matvec(v)`` for ``v`` of shape ``(n,)`` or
    ``_matmat_rows(V)`` for a row block ``(k, n)`` (k products at once); the
    other one is derived. ``num_matvecs`` counts products computed (a block
    of k counts k), which tests and benchmarks use as a noise-free cost.
    """

    num_matvecs: int = 0

    # -- to be provided by subclasses ------------------------------------
    @property
    def size(self) -> int:
        return int(self._size)

    @property
    def device(self) -> torch.device:
        return torch.device(self._device)

    @property
    def dtype(self) -> torch.dtype:
        return self._dtype

    _size: int
    _device: torch.device
    _dtype: torch.dtype

    def _matvec(self, v: torch.Tensor) -> torch.Tensor:
        if type(self)._matmat_rows is CurvatureOperator._matmat_rows:
            raise NotImplementedError(f"{type(self).__name__} must implement _matvec or _matmat_rows")
        return self._matmat_rows(v.unsqueeze(0))[0]

    def _matmat_rows(self, V: torch.Tensor) -> torch.Tensor:
        if type(self)._matvec is CurvatureOperator._matvec:
            raise NotImplementedError(f"{type(self).__name__} must implement _matvec or _matmat_rows")
        out = torch.empty_like(V)
        for i in range(V.shape[0]):
            out[i] = self._matvec(V[i])
        return out

    # -- public API -------------------------------------------------------
    @property
    def shape(self) -> tuple[int, int]:
        return (self.size, self.size)

    def _check_input(self, x: torch.Tensor, what: str) -> None:
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{what} must be a torch.Tensor, got {type(x).__name__}")
        if x.dtype != self.dtype:
            raise TypeError(
                f"{what} has dtype {x.dtype} but the operator works in {self.dtype}; "
                f"pass x.to({self.dtype})"
            )
        if not same_device(x.device, self.device):
            raise ValueError(
                f"{what} is on {x.device} but the operator is on {self.device}; pass x.to('{self.device}')"
            )

    def matvec(self, v: torch.Tensor) -> torch.Tensor:
        """``A v`` for ``v`` of shape ``(n,)``."""
        self._check_input(v, "v")
        if v.dim() != 1 or v.shape[0] != self.size:
            raise ValueError(f"matvec expects a vector of shape ({self.size},), got {tuple(v.shape)}")
        out = self._matvec(v)
        self.num_matvecs += 1
        return out

    def rmatvec(self, v: torch.Tensor) -> torch.Tensor:
        """``Aᵀ v`` (= ``A v``: curvature operators are symmetric)."""
        return self.matvec(v)

    def matmat(self, V: torch.Tensor) -> torch.Tensor:
        """``A V`` for ``V`` of shape ``(n, k)``: k products in one pass over the data.

        A block stored as rows ``B (k, n)`` costs no copy: ``op.matmat(B.T).T``.
        """
        self._check_input(V, "V")
        if V.dim() != 2 or V.shape[0] != self.size:
            raise ValueError(f"matmat expects a block of shape ({self.size}, k), got {tuple(V.shape)}")
        if V.shape[1] == 0:
            return torch.empty_like(V)
        out = self._matmat_rows(V.T.contiguous())
        self.num_matvecs += V.shape[1]
        return out.T

    def inconsistency_causes(self) -> list[str]:
        """Why repeated products of this operator could disagree beyond rounding (for the
        algorithms' messages); empty when nothing specific is known."""
        causes = []
        if self.dtype in (torch.float16, torch.bfloat16):
            causes.append(f"{str(self.dtype).removeprefix('torch.')} products carry about 1e-3 (float16) to 1e-2 (bfloat16) relative error")
        return causes

    def expect_products(self, n: int) -> None:  # noqa: B027 - optional hook, not abstract
        """Declare that about ``n`` products are coming (algorithms call this with their budget);
        operators that choose how to run their products use it. No-op by default."""

    def __matmul__(self, x: torch.Tensor) -> torch.Tensor:
        if isinstance(x, torch.Tensor) and x.dim() == 2:
            return self.matmat(x)
        return self.matvec(x)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.__matmul__(x)

    def to_dense(self) -> torch.Tensor:
        """The full ``(n, n)`` matrix, by n products (for small n only)."""
        eye = torch.eye(self.size, dtype=self.dtype, device=self.device)
        return self.matmat(eye)

    def to_scipy(self) -> Any:
        """A ``scipy.sparse.linalg.LinearOperator`` over float64 numpy vectors.

        Each scipy product converts to the operator's dtype and device and
        back (a host round trip per product): for ``eigsh``, ``cg``, ``lobpcg``.
        """
        import numpy as np
        from scipy.sparse.linalg import LinearOperator as ScipyLinearOperator

        def mv(x: Any) -> Any:
            v = torch.as_tensor(np.ascontiguousarray(x).reshape(-1), device=self.device).to(self.dtype)
            return self.matvec(v).detach().to("cpu", torch.float64).numpy()

        def mm(X: Any) -> Any:
            V = torch.as_tensor(np.ascontiguousarray(X), device=self.device).to(self.dtype)
            return self.matmat(V).detach().to("cpu", torch.float64).numpy()

        return ScipyLinearOperator(
            shape=self.shape, matvec=mv, rmatvec=mv, matmat=mm, dtype=np.float64
        )

    def __repr__(self) -> str:
        return f"{type(self).__name__}(size={self.size}, dtype={self.dtype}, device={self.device})"

    # -- algebra (A + B, A - B, c * A, A / c, -A, X @ A, submatrix): see operators/algebra.py
    def __add__(self, other: object) -> CurvatureOperator: return _algebra().linear_combination(self, other, 1.0)
    def __sub__(self, other: object) -> CurvatureOperator: return _algebra().linear_combination(self, other, -1.0)
    def __mul__(self, c: object) -> CurvatureOperator: return _algebra().scale(self, c)
    __rmul__ = __mul__
    def __truediv__(self, c: object) -> CurvatureOperator: return _algebra().scale(self, c, divide=True)
    def __neg__(self) -> CurvatureOperator: return _algebra().scale(self, -1.0)
    def __rmatmul__(self, x: torch.Tensor) -> torch.Tensor: return _algebra().left_multiply(self, x)
    def submatrix(self, rows: Any, cols: Any = None) -> Any:
        """``A[rows][:, cols]`` (slices, int sequences or tensors, bool masks): a symmetric operator
        when ``cols`` is omitted or equal to ``rows``, else a rectangular one (``operators.algebra``)."""
        return _algebra().submatrix(self, rows, cols)


def _algebra() -> Any:
    from hessian_eigenthings.operators import algebra  # it imports this module: bound on first use

    return algebra


class LambdaOperator(CurvatureOperator):
    """An operator from a function ``v (n,) -> A v (n,)``.

    ``matmat_fn`` (optional) computes a row block ``(k, n) -> (k, n)`` at once;
    without it blocks are k calls of ``matvec_fn``.
    """

    def __init__(
        self,
        matvec_fn: Callable[[torch.Tensor], torch.Tensor],
        size: int,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        *,
        matmat_fn: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> None:
        if not callable(matvec_fn):
            raise TypeError("matvec_fn must be callable: v (n,) -> A v (n,)")
        if int(size) < 1:
            raise ValueError(f"size must be >= 1, got {size}")
        self._fn = matvec_fn
        self._block_fn = matmat_fn
        self._size = int(size)
        self._device = torch.device(device)
        self._dtype = dtype

    def _matvec(self, v: torch.Tensor) -> torch.Tensor:
        return self._fn(v)

    def inconsistency_causes(self) -> list[str]:
        causes = super().inconsistency_causes()
        if self.device.type == "cuda" and self.dtype == torch.float32:
            tf32 = [n for n, on in (("matmul", torch.backends.cuda.matmul.allow_tf32),
                                    ("cudnn", torch.backends.cudnn.allow_tf32)) if on]
            if tf32:
                causes.append(
                    f"TF32 is on for {' and '.join(tf32)} (torch.backends.*.allow_tf32): float32 products of "
                    "your function carry about 1e-3 relative error"
                )
        return causes

    def _matmat_rows(self, V: torch.Tensor) -> torch.Tensor:
        if self._block_fn is not None:
            return self._block_fn(V)
        return torch.stack([self._fn(V[i]) for i in range(V.shape[0])])


# --------------------------------------------------------------------------
# Model state guard
# --------------------------------------------------------------------------


class CallWithModel(nn.Module):
    """``fn(model, batch)`` as a module, so ``torch.func.functional_call`` can swap the model's parameters."""

    def __init__(self, model: nn.Module, fn: Callable[[nn.Module, Any], torch.Tensor]) -> None:
        super().__init__()
        self.model = model
        self.fn = fn

    def forward(self, batch: Any) -> torch.Tensor:
        return self.fn(self.model, batch)



@contextlib.contextmanager
def preserve_model(
    model: nn.Module,
    params: Sequence[nn.Parameter],
    *,
    double_backward: bool = False,
    modules: Sequence[nn.Module] | None = None,
) -> Iterator[None]:
    """Run a product and leave ``model`` exactly as it was.

    Enables ``requires_grad`` on selected frozen parameters for the duration
    and restores it, and the train/eval flags, in ``finally``; forces math
    SDPA when a double backward is needed. Buffers are protected per forward
    by :func:`private_buffers`.
    """
    frozen = [p for p in params if not p.requires_grad]
    mods = list(modules) if modules is not None else list(model.modules())
    modes = [m.training for m in mods]
    try:
        for p in frozen:
            p.requires_grad_(True)
        ctx = _torch_compat.math_sdpa() if double_backward else contextlib.nullcontext()
        with ctx:
            yield
    finally:
        for p in frozen:
            p.requires_grad_(False)
        for m, mode in zip(mods, modes, strict=True):
            if m.training != mode:
                m.training = mode


@contextlib.contextmanager
def private_buffers(model: nn.Module, modules: Sequence[nn.Module] | None = None) -> Iterator[None]:
    """Give one forward its own copies of the buffers of training modules.

    A module in training mode may update its buffers in place (BatchNorm
    running statistics). Swapping in fresh copies and putting the original
    tensor objects back leaves the user's buffers bit-identical with their
    version counters untouched, so graphs that saved them stay valid.
    """
    swapped: list[tuple[nn.Module, str, torch.Tensor]] = []
    try:
        for m in modules if modules is not None else model.modules():
            if not m.training:
                continue
            for name, b in list(m._buffers.items()):
                if b is not None:
                    swapped.append((m, name, b))
                    m._buffers[name] = b.detach().clone()
        yield
    finally:
        for m, name, b in swapped:
            m._buffers[name] = b


# --------------------------------------------------------------------------
# Graph reuse
# --------------------------------------------------------------------------

# NOTE [reuse key]
# A kept state (any engine's) answers for the model only while nothing it read
# has changed. The key covers every parameter and buffer of the model — selected
# or not, since frozen and unselected tensors shape the product too — by object
# and version counter, every module's training flag (dropout and BatchNorm
# change behaviour with it), the global precision switches (NOTE [product
# precision]), and the batch (below). Our own forwards never bump the user's
# versions: training modules get private buffer copies (`private_buffers`), and
# finite differences perturb copies. Reading it costs a tuple of host integers
# per product: no tensor reads, no device sync.

# NOTE [graph reuse]
# A Hessian product from scratch costs forward + backward(create_graph) +
# double backward. When the data of a product is one batch (or a few), the
# graph of the first backward can be kept, and every further product costs
# only the second backward. The cached state is valid while (a) no selected
# parameter and no buffer changed (tensor version counters, read on the host,
# no sync) and (b) the batch is the same: the same tensor objects at the same
# versions, else equal contents (one cheap comparison of the input batch).
# Memory is bounded by `graph_reuse_max_batches` and, on CUDA, by
# `graph_memory_budget` bytes measured when each graph is built.


# a failed capture is undone by restoring the CUDA generator (torch >= 2.4 can)
_RNG_RESTORABLE = hasattr(torch.Generator, "graphsafe_set_state") and hasattr(torch.Generator, "clone_state")


@dataclass
class _Replay:
    """A recorded product on a kept state, see NOTE [CUDA graphs]."""

    graph: Any  # torch.cuda.CUDAGraph
    inputs: list[torch.Tensor]
    outputs: Sequence[torch.Tensor | None]


@dataclass
class _CachedGraph:
    raw: tuple[list[Any], tuple[int, ...]]
    versions: tuple[Any, ...]
    state: Any
    size: int
    nbytes: int
    #: block widths that ran eagerly once on this state (warm-up before a capture)
    warm: set[int] = field(default_factory=set)
    #: block widths whose recording was attempted (one attempt per width and state)
    attempted: set[int] = field(default_factory=set)
    replays: dict[int, _Replay] = field(default_factory=dict)


@dataclass
class _RecordedProduct:
    """A whole product recorded for one batch signature, see NOTE [recorded products]."""

    #: storage addresses of the model's parameters and buffers the graph reads
    pointers: tuple[int, ...]
    #: the static batch the recording reads, and its tensors in ``_leaves`` order
    batch: Batch
    batch_inputs: list[torch.Tensor]
    replay: _Replay
    nbytes: int


# NOTE [CUDA graphs]
# With graph reuse, every product on a kept state is the same backward: the
# same kernels on the same saved tensors, only the input vectors differ. On
# CUDA the host side of that backward (autograd's engine visiting thousands
# of nodes, one launch per kernel) often costs more than the kernels: for a
# ResNet-18 at batch 128 most of a product is launch overhead. So the second
# product of a given block width on a kept state records the backward into a
# CUDA graph, and later products copy their vectors into its static inputs
# and replay it: the same kernels, without the host work.
# - All work on a kept state (its forward and first backward, every product)
#   runs on the operator's own stream, ordered against the caller's stream
#   on entry and exit. Autograd runs each backward node on the stream of its
#   forward, and a capture cannot involve the legacy default stream.
# - The first product of each width runs eagerly: cuDNN autotuning, cuBLAS
#   workspaces and lazy initialisation happen outside the capture.
# - A failed capture (an op that syncs with the host or cannot be captured)
#   turns the feature off for the operator with a warning; products then run
#   eagerly. Results never depend on it: replay runs the recorded kernels.
# - A graph reads the state's saved tensors by address, so it lives and dies
#   with its cache entry (invalidated as in NOTE [graph reuse]); its memory
#   pool counts against ``graph_memory_budget``.
# - Memory cannot be returned to the device during a capture, and a capture
#   that runs out of memory can leave torch's caching allocator broken (seen
#   on a 12-layer GPT-2 with blocks of 8). So a width is recorded only when
#   (k + 1) times the kept state fits the budget and the free device memory
#   after emptying the cache; otherwise it stays eager.

# NOTE [recorded products]
# A product without a kept state (graph_reuse=False, more batches than the
# budget keeps, a batch that changes on every product) runs the forward and
# both backwards. Their host cost is the same as on a kept state, three times
# over, so such products are recorded too: the whole product, for one batch
# signature (block width, shapes and dtypes of the batch's tensors, its other
# leaves, the modules' train/eval modes). Later products with that signature
# copy their batch tensors and vectors into the recording's static inputs and
# replay it; a dataloader of equal-shaped batches replays one recording.
# - The graph reads the parameters and buffers by address: in-place updates
#   (an optimizer step) are seen by the next replay; a parameter or buffer
#   given new storage drops the recording (addresses checked per product).
# - BatchNorm buffers of training modules are copied inside the recording
#   (``private_buffers``), so the user's buffers stay untouched. Dropout in a
#   training module draws fresh masks on every replay, as eager products do,
#   from a different position of the generator's stream.
# - The first product of a signature runs eagerly and measures the state it
#   builds; the second records when (k + 1) times that (what the pool will
#   hold, at most) fits the budget and (k + 2) times that is free. The pool
#   then holds about one product's peak between products (``cuda_graphs=False``
#   holds nothing). At most ``graph_reuse_max_batches`` signatures are recorded.


def _leaves(batch: Batch) -> list[Any]:
    if isinstance(batch, torch.Tensor):
        return [batch]
    if isinstance(batch, dict) or (hasattr(batch, "keys") and hasattr(batch, "__getitem__")):
        out: list[Any] = []
        for k in batch.keys():
            out.append(k)
            out.extend(_leaves(batch[k]))
        return out
    if isinstance(batch, (tuple, list)):
        out = []
        for b in batch:
            out.extend(_leaves(b))
        return out
    return [batch]


def _batch_key(batch: Batch) -> tuple[list[Any], tuple[int, ...]]:
    """Leaves of a batch and the version counters of its tensors, for NOTE [graph reuse]."""
    leaves = _leaves(batch)
    return leaves, tuple(x._version for x in leaves if isinstance(x, torch.Tensor))


def _same_batch(kept: tuple[list[Any], tuple[int, ...]], batch: Batch) -> bool:
    old_leaves, old_versions = kept
    new_leaves = _leaves(batch)
    if len(old_leaves) != len(new_leaves):
        return False
    versions = iter(old_versions)
    for x, y in zip(old_leaves, new_leaves, strict=True):
        if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor):
            version = next(versions)
            if x is y:
                if x._version != version:
                    return False  # modified in place since the graph was built
                continue
            if x.shape != y.shape or x.dtype != y.dtype or x.device != y.device:
                return False
            if x._version != version or not torch.equal(x, y):
                return False
        elif isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor) or x != y:
            return False
    return True


# --------------------------------------------------------------------------
# The data-driven base
# --------------------------------------------------------------------------

Reuse = bool | Literal["auto"]


class RandomForwardWarning(UserWarning):
    """The model draws random numbers in its forward (dropout in training mode)."""


_RANDOM_MODULES = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout, nn.FeatureAlphaDropout)


def _draws_randomly(m: nn.Module) -> bool:
    return m.training and isinstance(m, _RANDOM_MODULES) and getattr(m, "p", 0.0) > 0


class DataOptions(TypedDict, total=False):
    """Block, graph-reuse and CUDA-graph options every data operator accepts (``**options``)."""

    max_block_size: int | None
    block_memory_budget: int | None
    graph_reuse: Reuse
    graph_reuse_max_batches: int
    graph_memory_budget: int | None
    cuda_graphs: bool
    engine: EngineName
    precision: Precision


class DataCurvatureOperator(CurvatureOperator):
    """Base of curvature operators defined by a model, data and a loss.

    Parameters shared by every subclass:

    - ``param_filter``: which parameters (callable, glob or list of globs).
    - ``full_dataset``: average over every batch (``True``) or take the next
      batch on each product, cycling (``False``).
    - ``num_batches``: cap on the batches of one product.
    - ``microbatch_size``: split each batch into chunks of this many samples
      (same result, lower peak memory; refused for BatchNorm in training
      mode unless ``microbatch_unsafe=True``).
    - ``max_block_size``: most vectors per pass of a block product;
      ``block_memory_budget``: bytes a block pass may add on CUDA (the chunk
      is sized from the measured cost of the first pass).
    - ``graph_reuse``: ``"auto"`` / ``True`` / ``False``, see NOTE [graph reuse].
      ``graph_reuse_max_batches``: most kept states; ``graph_memory_budget``:
      bytes they may hold on CUDA (default a quarter of the device).
    - ``cuda_graphs``: record products as CUDA graphs and replay them
      (default ``True``; CUDA only, operators that support it): on a kept
      state its second backward (NOTE [CUDA graphs]), without one the whole
      product per batch signature (NOTE [recorded products]). The recordings
      hold memory between products (``held_bytes``); ``False`` records nothing.
    """

    #: Subclasses set this when ``_apply`` may run several times on one state.
    supports_graph_reuse: bool = False
    #: Subclasses set this when products need a double backward.
    needs_double_backward: bool = True
    #: Subclasses set this when ``_apply`` on a kept state can be recorded as a CUDA graph.
    supports_cuda_graphs: bool = False
    #: ``"size"``: batches weighted by their sample count (``Σ bᵢ·Pᵢ / Σ bᵢ``);
    #: ``"uniform"``: every batch weighs the same (the 0.x facade). See NOTE [batch weighting].
    batch_weighting: Literal["size", "uniform"] = "size"

    def __init__(
        self,
        model: nn.Module,
        dataloader: Iterable[Batch],
        *,
        param_filter: ParamFilter | str | Sequence[str] | None = None,
        full_dataset: bool = True,
        num_batches: int | None = None,
        microbatch_size: int | None = None,
        microbatch_unsafe: bool = False,
        max_block_size: int | None = None,
        block_memory_budget: int | None = None,
        graph_reuse: Reuse = "auto",
        graph_reuse_max_batches: int = 4,
        graph_memory_budget: int | None = None,
        cuda_graphs: bool = True,
        engine: EngineName = "auto",
        precision: Precision = "fp32",
        backend: LinAlgBackend | None = None,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        microbatch_size = check_count("microbatch_size", microbatch_size, allow_none=True)
        max_block_size = check_count("max_block_size", max_block_size, allow_none=True)
        graph_reuse_max_batches = check_count("graph_reuse_max_batches", graph_reuse_max_batches, minimum=0)  # type: ignore[assignment]
        if graph_reuse not in (True, False, "auto"):
            raise ValueError(f"graph_reuse must be True, False or 'auto', got {graph_reuse!r}")
        if not isinstance(cuda_graphs, bool):
            raise TypeError(f"cuda_graphs must be True or False, got {cuda_graphs!r}")
        check_microbatching(model, microbatch_size, microbatch_unsafe)
        self.model = model
        # the module list is walked on every product (modes, buffers): list it once
        self._modules: list[nn.Module] = list(model.modules())
        self.named_params = list(select_parameters(model, param_filter).items())
        self.params = [p for _, p in self.named_params]
        self.layout = ParamLayout.from_named(self.named_params)
        self._size = self.layout.size
        self._device = self.layout.device
        self._dtype = self.layout.dtype
        self.source = BatchSource(dataloader, full_dataset=full_dataset, num_batches=num_batches)
        self.microbatch_size = microbatch_size
        self.microbatch_unsafe = microbatch_unsafe
        self.max_block_size = max_block_size
        self.block_memory_budget = block_memory_budget
        self.graph_reuse = graph_reuse
        self.graph_reuse_max_batches = graph_reuse_max_batches
        self.graph_memory_budget = graph_memory_budget
        self.cuda_graphs = cuda_graphs
        self._stream: Any = None  # the operator's CUDA stream, see NOTE [CUDA graphs]
        self._graph_pool: Any = None
        self._graph_failures: set[int] = set()  # block widths whose capture failed
        self._in_own_stream = False
        self._graph_warned = False
        #: products replayed from CUDA graphs, for cost checks
        self.num_replays = 0
        self.backend = default_backend(backend)
        self._cache: dict[tuple[int, int], _CachedGraph] = {}
        self._cache_bytes = 0
        self._default_budget: int | None = None  # a quarter of the device, see _graph_budget
        #: bytes of the last state that did not fit the budget (no keeping until room frees up)
        self._unkept_bytes = 0
        # NOTE [recorded products]: recordings by signature, state sizes measured by the
        # eager first product of each signature, signatures whose recording was attempted
        self._recorded: dict[tuple[Any, ...], _RecordedProduct] = {}
        self._warm_products: dict[tuple[Any, ...], int] = {}
        self._attempted_products: set[tuple[Any, ...]] = set()
        self._per_vector_bytes: float | None = None
        #: widest block that fit after an out-of-memory retry (NOTE [block out of memory])
        self._oom_block_limit: int | None = None
        #: passes over the data (one per batch chunk) and forward passes, for cost checks
        self.num_passes = 0
        self.num_forwards = 0
        self.precision = check_precision(precision)
        if engine not in ENGINES:
            raise ValueError(f"engine must be one of {ENGINES}, got {engine!r}")
        self._engine_name = engine

    @property
    def _engines(self) -> EngineSelector:
        # built on first use: subclasses finish their own setup after this base's __init__
        sel = self.__dict__.get("_engine_selector")
        if sel is None:
            sel = self.__dict__["_engine_selector"] = EngineSelector(self, self._engine_name)
        return sel

    #: Subclasses set this when they define ``functional_product`` (engines other than autograd).
    supports_functional: bool = False

    def functional_unsupported_reason(self) -> str:
        return f"{type(self).__name__} defines no functional product"

    def functional_product(
        self, state: dict[str, torch.Tensor], batch: Batch, tangent: list[torch.Tensor]
    ) -> list[torch.Tensor]:
        """The per-batch product for one direction as a pure function (see ``operators.engines``)."""
        raise NotImplementedError

    def _selected_function(
        self, call: nn.Module, state: dict[str, torch.Tensor], batch: Batch
    ) -> tuple[Callable[..., Any], tuple[torch.Tensor, ...]]:
        """``call(batch)`` (a :class:`CallWithModel`) as a function of the selected parameters,
        the other parameters and buffers fixed at ``state``; and the selected values."""
        names = self.layout.names
        selected = set(names)
        fixed = {f"model.{n}": t for n, t in state.items() if n not in selected}
        call_names = [f"model.{n}" for n in names]

        def f(*values: torch.Tensor) -> Any:
            full = dict(fixed)
            full.update(zip(call_names, values, strict=True))
            return call_with_values(call, full, (batch,))

        return f, tuple(state[n] for n in names)

    def inconsistency_causes(self) -> list[str]:
        causes = super().inconsistency_causes()
        random = [name or type(m).__name__ for name, m in self.model.named_modules() if _draws_randomly(m)]
        if random:
            causes.append(
                f"modules in training mode draw random masks on every forward ({', '.join(random[:3])}"
                f"{', ...' if len(random) > 3 else ''}): call model.eval()"
            )
        if not self.source.full_dataset:
            causes.append("full_dataset=False takes another batch for every product")
        if self.precision == "tf32":
            causes.append("precision='tf32' runs products with TF32 (about 1e-3 relative error)")
        return causes

    def _warn_random_forward(self) -> None:
        """Once per operator: a forward that draws random masks makes the operator a different
        matrix on every product (or, with a kept state, one arbitrary draw)."""
        if self.__dict__.get("_random_checked") or self._engines.traced:
            return  # a traced engine refuses such a model with its own error
        self._random_checked = True
        random = [name or type(m).__name__ for name, m in self.model.named_modules() if _draws_randomly(m)]
        if random:
            warnings.warn(
                f"{type(self).__name__}: dropout in training mode ({', '.join(random[:3])}"
                f"{', ...' if len(random) > 3 else ''}) draws a new random mask on every forward, so the "
                "curvature is of one random draw (kept between products) or changes between products; call "
                "model.eval() for the curvature of the deterministic model",
                RandomForwardWarning,
                stacklevel=user_stacklevel(),
            )

    @property
    def engine(self) -> str:
        """The engine running products now (``"auto"`` resolves to one after its measurement)."""
        return self._engines.active

    @property
    def engine_report(self) -> dict[str, Any]:
        """The engine, ``auto``'s choice with its timings, traces and compilations."""
        return self._engines.report()

    def expect_products(self, n: int) -> None:
        """Declare how many products are coming (algorithms pass their budget): ``engine="auto"``
        traces or compiles only when that many products pay for it."""
        self._engines.expect(n)

    # -- hooks for subclasses -------------------------------------------------
    def _prepare(self, batch: Batch) -> Any:
        """Forward (and first-order graph) on one batch; returns the state."""
        raise NotImplementedError

    def _apply(self, state: Any, vecs: list[torch.Tensor], retain: bool) -> Sequence[torch.Tensor | None]:
        """Per-batch product of the mean-loss curvature with a block.

        ``vecs[i]`` has shape ``(k, *shape_i)``. Return one ``(k, *shape_i)``
        tensor per parameter (``None`` for an exact zero). ``retain``: keep
        the graph of ``state`` alive for another call.
        """
        raise NotImplementedError

    def _product(self, batch: Batch, vecs: list[torch.Tensor]) -> Sequence[torch.Tensor | None]:
        """A product without a reusable state (e.g. finite differences)."""
        return self._engines.apply(self._engines.prepare(batch), vecs, retain=False)

    # -- graph reuse ----------------------------------------------------------
    def _reuse_enabled(self) -> bool:
        return self.supports_graph_reuse and self.graph_reuse is not False

    @property
    def held_bytes(self) -> int:
        """Device bytes held between products: kept graphs and CUDA-graph pools (0 on the CPU)."""
        return self._cache_bytes

    def clear_cache(self) -> None:
        """Drop kept graphs and recorded products (they are dropped automatically when stale)."""
        self._cache.clear()
        self._recorded.clear()
        self._attempted_products.clear()
        self._cache_bytes = 0
        self._unkept_bytes = 0

    def _versions(self) -> tuple[Any, ...]:
        """The reuse key's model part, see NOTE [reuse key]."""
        tensors = tuple(
            (id(t), t._version)
            for m in self._modules
            for t in itertools.chain(m._parameters.values(), m._buffers.values())
            if t is not None
        )
        return tensors, tuple(m.training for m in self._modules), precision_flags()

    def _cached_entry(self, key: tuple[int, int], raw: Batch) -> _CachedGraph | None:
        entry = self._cache.get(key)
        if entry is None:
            return None
        if entry.versions != self._versions() or not _same_batch(entry.raw, raw):
            self._cache_bytes -= entry.nbytes
            del self._cache[key]
            return None
        return entry

    def _graph_budget(self) -> int | None:
        if self.graph_memory_budget is not None or self.device.type != "cuda":
            return self.graph_memory_budget
        if self._default_budget is None:  # read once: this is asked on every product without a kept state
            self._default_budget = int(0.25 * torch.cuda.get_device_properties(self.device).total_memory)
        return self._default_budget

    def _may_keep(self) -> bool:
        """Whether the state of the next chunk may be kept (else it is a fresh product)."""
        if self.graph_reuse == "auto" and not self.source.full_dataset:
            try:
                cycle_len = len(self.source.dataloader)  # type: ignore[arg-type]
            except TypeError:
                cycle_len = -1
            if cycle_len != 1:  # a cycled batch changes every product: nothing to reuse
                return False
        if len(self._cache) >= self.graph_reuse_max_batches:
            return False
        budget = self._graph_budget()
        return budget is None or self._cache_bytes + self._unkept_bytes <= budget

    def _build_state(self, key: tuple[int, int], raw: Batch, chunk: Batch) -> tuple[Any, bool]:
        """Build the state of one chunk; keep it when the budget allows. Returns (state, kept)."""
        cuda = self.device.type == "cuda"
        before = _torch_compat.cuda_allocated(self.device) if cuda else 0
        versions = self._versions()
        raw_key = _batch_key(raw)
        with self._own_stream(), private_buffers(self.model, self._modules):
            state = self._engines.prepare(chunk)
        nbytes = (_torch_compat.cuda_allocated(self.device) - before) if cuda else 0
        budget = self._graph_budget()
        if budget is not None and self._cache_bytes + nbytes > budget:
            self._unkept_bytes = nbytes
            return state, False
        self._unkept_bytes = 0
        self._cache[key] = _CachedGraph(raw=raw_key, versions=versions, state=state, size=self._samples(chunk), nbytes=nbytes)
        self._cache_bytes += nbytes
        return state, True

    # -- CUDA graphs, NOTE [CUDA graphs] ---------------------------------------------
    def _graphs_on(self) -> bool:
        # a traced engine's products are plain tensor programs: recordable whatever the curvature
        recordable = self.supports_cuda_graphs if not self._engines.traced else self._engines.recordable
        return self.cuda_graphs and recordable and self.device.type == "cuda" and _RNG_RESTORABLE

    def _private_leaves(self) -> list[torch.Tensor] | None:
        """Leaves standing in for the parameters in a graph that will be recorded, else ``None``.

        They share the parameters' storage and version counters but have
        their own gradient accumulators: a kept graph built on our stream
        would otherwise pin the parameters' accumulators to that stream, and
        the user's own backward passes would then run across streams.
        """
        if not self._in_own_stream:
            return None
        return [p.detach().requires_grad_(True) for p in self.params]

    @contextlib.contextmanager
    def _own_stream(self) -> Iterator[None]:
        """Run the body on the operator's stream, ordered after and before the caller's."""
        if not self._graphs_on():
            yield
            return
        caller = torch.cuda.current_stream(self.device)
        if self._stream is None:
            self._stream = torch.cuda.Stream(self.device)
        self._stream.wait_stream(caller)
        outer = self._in_own_stream
        self._in_own_stream = True
        try:
            with torch.cuda.stream(self._stream):
                yield
        finally:
            self._in_own_stream = outer
            caller.wait_stream(self._stream)

    def _apply_own_stream(self, state: Any, vecs: list[torch.Tensor], retain: bool) -> Sequence[torch.Tensor | None]:
        """An eager product on a state built on the operator's stream."""
        if not self._graphs_on():
            return self._engines.apply(state, vecs, retain)
        caller = torch.cuda.current_stream(self.device)
        with self._own_stream():
            prods = self._engines.apply(state, vecs, retain)
        for t in prods:
            if t is not None:  # made on our stream, read on the caller's: keep it until then
                t.record_stream(caller)
        return prods

    def _apply_kept(self, entry: _CachedGraph, vecs: list[torch.Tensor]) -> Sequence[torch.Tensor | None]:
        """A product on a kept state: eager the first time per width, then replayed."""
        k = vecs[0].shape[0]
        if not self._graphs_on():
            return self._engines.apply(entry.state, vecs, retain=True)
        replay = entry.replays.get(k)
        if replay is None and k in entry.warm and k not in entry.attempted and k not in self._graph_failures:
            with self._own_stream():
                replay = self._capture(entry, vecs)
        if replay is None:
            entry.warm.add(k)
            return self._apply_own_stream(entry.state, vecs, retain=True)
        with self._own_stream():
            _torch_compat.foreach_copy_(replay.inputs, vecs)
            replay.graph.replay()
        self.num_replays += 1
        return replay.outputs

    def _room_for(self, need: int, free: int | None = None) -> bool:
        """Whether a recording that will hold about ``need`` bytes fits the budget, and
        ``free`` bytes (default ``need``) are free on the device for its capture.

        Memory is never freed back to the device during a capture, and a capture that
        runs out of memory can leave the caching allocator unusable: check first.
        """
        budget = self._graph_budget()
        if budget is not None and self._cache_bytes + need > budget:
            return False
        torch.cuda.empty_cache()
        return bool(torch.cuda.mem_get_info(self.device)[0] >= (need if free is None else free))

    def _record(
        self, what: str, k: int, fn: Callable[[], Sequence[torch.Tensor | None]]
    ) -> tuple[Any, list[torch.Tensor | None], int] | None:
        """Record ``fn()`` as a CUDA graph in the operator's pool.

        Returns ``(graph, outputs, bytes the pool grew by)``, or ``None`` when the
        capture failed (the operator warns once, unless it ran out of memory) or
        when the pool outgrew the budget.
        """
        graph = torch.cuda.CUDAGraph()
        live = self._recorded or any(entry.replays for entry in self._cache.values())
        if self._graph_pool is None or not live:
            # torch releases a pool with its last graph; its handle cannot take another capture
            self._graph_pool = torch.cuda.graph_pool_handle()
        before = _torch_compat.cuda_reserved(self.device)
        # a capture that fails half-way leaves the CUDA generator in capture mode: keep its state
        rng = torch.cuda.default_generators[self.device.index if self.device.index is not None else torch.cuda.current_device()]
        rng_state = rng.clone_state()
        try:
            graph.capture_begin(pool=self._graph_pool)
            try:
                with _torch_compat.CapturableScalars():
                    outputs = fn()
            finally:
                graph.capture_end()
        except Exception as exc:  # any failure: eager products, same results
            rng.graphsafe_set_state(rng_state)
            if not self._graph_warned and not isinstance(exc, torch.cuda.OutOfMemoryError):
                self._graph_warned = True  # once per operator; out of memory: quietly eager
                warnings.warn(
                    f"{type(self).__name__}: recording {what} as a CUDA graph failed for blocks "
                    f"of {k} ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}); such "
                    "products run eagerly. Pass cuda_graphs=False to skip the attempt.",
                    RuntimeWarning,
                    stacklevel=5,
                )
            return None
        extra = max(0, _torch_compat.cuda_reserved(self.device) - before)
        budget = self._graph_budget()
        if budget is not None and self._cache_bytes + extra > budget:
            return None  # the graph and its pool are freed
        return graph, list(outputs), extra

    def _capture(self, entry: _CachedGraph, vecs: list[torch.Tensor]) -> _Replay | None:
        """Record ``_apply`` on ``entry`` for vectors shaped like ``vecs``; ``None`` if it cannot be."""
        k = vecs[0].shape[0]
        entry.attempted.add(k)  # a refused or failed width stays eager: no re-check per product
        # room for the recording's pool, conservatively: an autograd backward through a kept
        # graph may hold about the graph again per vector, plus one; a traced tangent program
        # reads the kept values in place and its temporaries (tangents of kept values) are
        # about the kept state per vector
        factor = k if self._engines.traced else k + 1
        if not self._room_for(factor * entry.nbytes):
            return None
        inputs = [torch.empty_like(v) for v in vecs]
        recorded = self._record("the kept backward", k, lambda: self._engines.apply(entry.state, inputs, retain=True))
        if recorded is None:
            self._graph_failures.add(k)
            return None
        graph, outputs, extra = recorded
        entry.nbytes += extra
        self._cache_bytes += extra
        replay = _Replay(graph=graph, inputs=inputs, outputs=outputs)
        entry.replays[k] = replay
        return replay

    # -- recorded products, NOTE [recorded products] ----------------------------
    def _signature(self, leaves: list[Any], k: int) -> tuple[Any, ...] | None:
        """What a recorded product is keyed by (``leaves``: ``_leaves`` of the chunk); ``None``
        when this chunk cannot be recorded."""
        sig: list[Any] = [k, torch.is_grad_enabled()]
        for x in leaves:
            if isinstance(x, torch.Tensor):
                if x.requires_grad or not same_device(x.device, self.device):
                    return None
                sig.append((x.shape, x.dtype))
            else:
                try:
                    hash(x)
                except TypeError:
                    return None
                sig.append(x)
        sig.append(tuple(m.training for m in self._modules))
        return tuple(sig)

    def _pointers(self) -> tuple[int, ...]:
        return tuple(
            t.data_ptr()
            for m in self._modules
            for t in itertools.chain(m._parameters.values(), m._buffers.values())
            if t is not None
        )

    def _fresh_product(self, chunk: Batch, vecs: list[torch.Tensor]) -> Sequence[torch.Tensor | None]:
        """A product without a kept state: eager, or replayed from a recording."""
        leaves = _leaves(chunk) if self._graphs_on() else []
        sig = self._signature(leaves, vecs[0].shape[0]) if leaves else None
        if sig is None:
            with private_buffers(self.model, self._modules):
                return self._product(chunk, vecs)
        rec = self._recorded.get(sig)
        if rec is not None and rec.pointers != self._pointers():
            del self._recorded[sig]  # new storage under a parameter or buffer: record again
            self._cache_bytes -= rec.nbytes
            self._attempted_products.discard(sig)
            rec = None
        if rec is None and sig in self._warm_products and sig not in self._attempted_products:
            with self._own_stream():
                rec = self._record_product(sig, chunk, vecs)
        if rec is None:  # eager; the first product of a signature measures its state for the room check
            measure = sig not in self._warm_products
            before = _torch_compat.cuda_allocated(self.device) if measure else 0
            with private_buffers(self.model, self._modules):
                state = self._engines.prepare(chunk)
                if measure:
                    self._warm_products[sig] = _torch_compat.cuda_allocated(self.device) - before
                return self._engines.apply(state, vecs, retain=False)
        with self._own_stream():
            tensors = [t for t in leaves if isinstance(t, torch.Tensor)]
            _torch_compat.foreach_copy_(rec.batch_inputs + rec.replay.inputs, tensors + vecs)
            rec.replay.graph.replay()
        self.num_replays += 1
        self.num_forwards += 1
        return rec.replay.outputs

    def _record_product(
        self, sig: tuple[Any, ...], chunk: Batch, vecs: list[torch.Tensor]
    ) -> _RecordedProduct | None:
        self._attempted_products.add(sig)  # one attempt per signature
        k = vecs[0].shape[0]
        if len(self._recorded) >= self.graph_reuse_max_batches:
            return None
        state = self._warm_products[sig]
        # held afterwards: the pool, about one product's peak (the state plus the
        # backward's temporaries, up to a state per vector); a margin on free memory
        if not self._room_for((k + 1) * state, free=(k + 2) * state):
            return None
        static = map_tensors(chunk, torch.empty_like)  # outside the capture: not in its pool
        inputs = [torch.empty_like(v) for v in vecs]

        def product() -> Sequence[torch.Tensor | None]:
            with private_buffers(self.model, self._modules):
                return self._engines.apply(self._engines.prepare(static), inputs, retain=False)

        forwards = self.num_forwards
        recorded = self._record("the product", k, product)
        self.num_forwards = forwards  # a capture runs nothing
        if recorded is None:
            return None
        graph, outputs, extra = recorded
        rec = _RecordedProduct(
            pointers=self._pointers(),
            batch=static,
            batch_inputs=[t for t in _leaves(static) if isinstance(t, torch.Tensor)],
            replay=_Replay(graph=graph, inputs=inputs, outputs=outputs),
            nbytes=extra,
        )
        self._recorded[sig] = rec
        self._cache_bytes += extra
        return rec

    # -- the data loop ----------------------------------------------------------
    def _chunks(self, raw: Batch) -> list[Batch]:
        batch = to_device(raw, self.device)
        if self.microbatch_size is None:
            return [batch]
        return split_batch(batch, self.microbatch_size)

    def _block_limit(self, k: int) -> int:
        limit = self.max_block_size or k
        if self._oom_block_limit is not None:
            limit = min(limit, self._oom_block_limit)
        if self.block_memory_budget is not None and self._per_vector_bytes:
            limit = min(limit, max(1, int(self.block_memory_budget // self._per_vector_bytes)))
        elif self.block_memory_budget is not None:
            limit = min(limit, 1)  # measure one vector first
        return max(1, min(limit, k))

    def _matmat_rows(self, V: torch.Tensor) -> torch.Tensor:
        self._warn_random_forward()
        k = V.shape[0]
        out = self.layout.empty(k)
        start = 0
        first = self._block_limit(k)
        if self._engines.before_block(V[:first], out[:first]):
            start = first
        while start < k:
            start = self._block_step(V, out, start)
        return out

    def _block_step(self, V: torch.Tensor, out: torch.Tensor, start: int) -> int:
        """One pass for rows ``start:`` (as many as the block limit allows); returns the next start."""
        k = V.shape[0]
        stop = min(k, start + self._block_limit(k - start))
        cuda = self.device.type == "cuda" and self.block_memory_budget is not None
        if cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
            base = _torch_compat.cuda_allocated(self.device)
        try:
            self._pass(V[start:stop], out[start:stop])
        except torch.cuda.OutOfMemoryError:
            # NOTE [block out of memory]: a block too wide for the device is retried in
            # halves (each chunk's rows of ``out`` are written whole by its own pass).
            # Not when a pass moves the data on (full_dataset=False), nor for one vector.
            if stop - start == 1 or not self.source.full_dataset:
                raise
            self._oom_block_limit = max(1, (stop - start) // 2)
            return start
        if cuda:
            peak = torch.cuda.max_memory_allocated(self.device) - base
            self._per_vector_bytes = max(self._per_vector_bytes or 0.0, peak / (stop - start))
        return stop

    def _pass(self, V: torch.Tensor, out: torch.Tensor) -> None:
        """One pass over the data for the row block ``V`` (k, n), written into ``out``.

        ``out = Σ bᵢ·Pᵢ / Σ bᵢ`` over the chunks of the pass, where ``Pᵢ`` is
        the product of chunk ``i`` (mean loss over its ``bᵢ`` samples). With
        one chunk this is a single copy into the buffer.
        """
        vecs = self.layout.split_rows(V)
        out_views = self.layout.split_rows(out)
        count = 0
        total = 0.0
        math_sdpa = self.needs_double_backward or self._engines.traced
        with product_precision(self.precision), preserve_model(
            self.model, self.params, double_backward=math_sdpa, modules=self._modules
        ):
            for prods, size in self._contributions(vecs):
                pairs = [(o, p) for o, p in zip(out_views, prods, strict=True) if p is not None]
                if count == 0:
                    _torch_compat.foreach_copy_([o for o, _ in pairs], [p for _, p in pairs])
                    for o, p in zip(out_views, prods, strict=True):
                        if p is None:
                            o.zero_()
                else:
                    if count == 1:
                        out.mul_(float(total))
                    _torch_compat.foreach_add_([o for o, _ in pairs], [p for _, p in pairs], alpha=float(size))
                count += 1
                total += size
        if count == 0:
            raise ValueError("the dataloader yielded no batch; check that the dataset is not empty")
        self._finish_pass(out, count, total)

    def _finish_pass(self, out: torch.Tensor, count: int, total: float) -> None:
        """Normalize the weighted sum. ``out`` holds ``P₁`` when ``count == 1``,
        else ``Σ wᵢ·Pᵢ``; ``total = Σ wᵢ`` (``wᵢ = bᵢ`` unless NOTE [batch weighting]). Distributed wrappers override this
        to reduce across ranks before dividing."""
        if count > 1:
            out.mul_(1.0 / total)

    def _contributions(
        self, vecs: list[torch.Tensor]
    ) -> Iterator[tuple[Sequence[torch.Tensor | None], float]]:
        """``(product, weight)`` of every chunk of one pass (weight: its samples, see ``_weight``)."""
        reuse = self._reuse_enabled()
        for position, raw in enumerate(self.source.batches()):
            if not reuse:
                for chunk in self._chunks(raw):
                    self.num_passes += 1
                    yield self._fresh_product(chunk, vecs), self._weight(self._samples(chunk), raw)
                continue
            chunks: list[Batch] | None = None
            n_chunks = 1
            if self.microbatch_size is not None:
                n_chunks = math.ceil(batch_size(raw) / self.microbatch_size)
            for c in range(n_chunks):
                key = (position, c)
                entry = self._cached_entry(key, raw)
                if entry is not None:
                    yield self._apply_kept(entry, vecs), self._weight(entry.size, raw)
                    continue
                if chunks is None:
                    chunks = self._chunks(raw)
                chunk = chunks[c]
                self.num_passes += 1
                if not self._may_keep():
                    yield self._fresh_product(chunk, vecs), self._weight(self._samples(chunk), raw)
                    continue
                state, kept = self._build_state(key, raw, chunk)
                if kept:
                    prods = self._apply_kept(self._cache[key], vecs)
                else:
                    prods = self._apply_own_stream(state, vecs, retain=False)
                yield prods, self._weight(self._samples(chunk), raw)

    # NOTE [batch weighting]
    # The default weights each chunk by its samples, so the product is that of
    # the mean loss over all samples and a short last batch does not bias it.
    # 0.x averaged per batch with equal weights; the 0.x facade sets
    # batch_weighting = "uniform" to keep its results. Then a chunk of a split
    # batch weighs chunk/batch samples, so each batch still counts once and its
    # own product is its exact mean.
    def _weight(self, samples: int, raw: Batch) -> float:
        """Weight of a chunk of ``samples`` samples cut from the batch ``raw``."""
        if self.batch_weighting == "size":
            return samples
        return samples / self._samples(raw)

    def _samples(self, chunk: Batch) -> int:
        """Samples in a chunk (the empirical Fisher counts tokens for a per-token loss)."""
        return batch_size(chunk)
