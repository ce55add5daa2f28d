"""CUDA-graph recording and replay of products (NOTE [CUDA graphs], NOTE [recorded products]).

:class:`GraphRecorder` runs an operator's work on its own CUDA stream, records
the products of kept states (and whole products of batch signatures without
one) into CUDA graphs, and replays them: the same kernels without the host
work of launching them one by one.
"""

from __future__ import annotations

import contextlib
import gc
import warnings
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from hessian_eigenthings import _torch_compat
from hessian_eigenthings._warnings import user_stacklevel
from hessian_eigenthings.batching import Batch, batch_leaves, map_tensors
from hessian_eigenthings.operators.engines.runner import ProductCounts, ProductRunner
from hessian_eigenthings.operators.graph_reuse import KeptState, StateCache
from hessian_eigenthings.operators.model_guard import ModelGuard, model_tensors
from hessian_eigenthings.operators.protocol import same_device
from hessian_eigenthings.param_utils import RowBlock

# a failed capture is undone by restoring the CUDA generator (torch >= 2.4 can)
RNG_RESTORABLE = hasattr(torch.Generator, "graphsafe_set_state") and hasattr(
    torch.Generator, "clone_state"
)


@dataclass
class Replay:
    """A recorded product on a kept state, see NOTE [CUDA graphs]."""

    graph: Any  # torch.cuda.CUDAGraph
    inputs: list[torch.Tensor]
    outputs: Sequence[torch.Tensor | None]
    #: the static inputs as one row block when they are its views (one vector), else ``None``
    flat_input: torch.Tensor | None = None

    def __post_init__(self) -> None:
        # the static tensors as (k, numel) column blocks, made once (NOTE [views on demand]);
        # `record` leaves every output viewable so; an exact zero is a static block of zeros
        self.flat_inputs = [t.view(t.shape[0], -1) for t in self.inputs]
        k = self.inputs[0].shape[0]
        self.flat_outputs = FlatProduct(
            [
                i.new_zeros(k, i[0].numel()) if o is None else o.view(k, -1)
                for i, o in zip(self.inputs, self.outputs, strict=True)
            ]
        )

    def run(
        self,
        rows: RowBlock,
        before: Sequence[torch.Tensor] = (),
        into: Sequence[torch.Tensor] = (),
        *,
        copied: bool = False,
    ) -> FlatProduct:
        """Copy ``rows`` (and ``before`` into ``into``) into the static inputs, replay, and
        return the static outputs as column blocks. ``copied``: ``rows`` is in the static
        input already (NOTE [direction copied ahead])."""
        if copied:
            _torch_compat.foreach_copy_(list(into), list(before))
        elif self.flat_input is not None:
            _torch_compat.foreach_copy_([*into, self.flat_input], [*before, rows.block])
        else:
            _torch_compat.foreach_copy_([*into, *self.flat_inputs], [*before, *rows.flat()])
        self.graph.replay()
        return self.flat_outputs


def static_inputs(rows: RowBlock) -> tuple[list[torch.Tensor], torch.Tensor | None]:
    """Static inputs of a recording for directions shaped like ``rows``: for one vector, views
    of one flat buffer (copied into with one call); for a block, a tensor per parameter."""
    if rows.k == 1:
        flat = torch.empty_like(rows.block, memory_format=torch.contiguous_format)
        return rows.layout.split_rows(flat), flat
    return [torch.empty_like(v) for v in rows.views], None


def _column_ready(outputs: Sequence[torch.Tensor | None]) -> list[torch.Tensor | None]:
    """The outputs, each viewable as ``(k, numel)`` (a copy, recorded too, where its strides
    are not: e.g. a gradient laid out transposed)."""
    ready: list[torch.Tensor | None] = []
    for t in outputs:
        if t is not None:
            try:
                t.view(t.shape[0], -1)
            except RuntimeError:
                t = t.contiguous()
        ready.append(t)
    return ready


@dataclass
class FlatProduct:
    """A product as per-parameter column blocks ``(k, numel)``, the static outputs of a
    recording; the data loop writes them into its flat buffer."""

    parts: list[torch.Tensor]


#: what one chunk's product is handed back as: per-parameter tensors ``(k, *shape)`` of an
#: eager product, or the column blocks of a replayed one
Product = Sequence[torch.Tensor | None] | FlatProduct


@dataclass
class RecordedProduct:
    """A whole product recorded for one batch signature, see NOTE [recorded products]."""

    #: storage addresses of the model's parameters and buffers the graph reads
    pointers: tuple[int, ...]
    #: the static batch the recording reads, and its tensors in ``_leaves`` order
    batch: Batch
    batch_inputs: list[torch.Tensor]
    replay: Replay
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
#   (k + 1) times the kept state (k times for a traced program, which reads
#   the kept values in place) is free on the device after emptying the cache;
#   otherwise it stays eager. The pool the capture took is then measured and
#   the recording dropped if it does not fit the budget: the estimate is
#   conservative (GPT-2 12L, compiled Hessian: a 20.8 GB state, a 3.6 GB
#   pool), so it guards the capture, not the budget.

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


# NOTE [direction copied ahead]
# A replayed product's device work starts with copying the direction into the
# recording's static input, and the device idles while the host checks the reuse
# key and guards the model (about 0.5 ms for a 12-layer GPT-2). So a pass of one
# vector starts by copying the direction into the input of the recording the last
# such product replayed, on the operator's stream (ordered after that replay and
# after the caller's work); when the pass then replays that same recording the copy
# is done, and when it does not (the kept state was dropped, another chunk) nothing
# is lost but the early copy: a recording's input is always written before its replay.


def capture_graph(
    device: torch.device, pool: Any, fn: Callable[[], Sequence[torch.Tensor | None]]
) -> tuple[Any, list[torch.Tensor | None], int]:
    """Record ``fn()`` as a CUDA graph in ``pool``: ``(graph, its outputs, each viewable as
    column blocks, bytes the device's reserved memory grew by)``. A failed capture raises, the
    CUDA generator put back as it was (a capture that fails half-way leaves it in capture mode)."""
    graph = torch.cuda.CUDAGraph()
    before = _torch_compat.cuda_reserved(device)
    rng = torch.cuda.default_generators[
        device.index if device.index is not None else torch.cuda.current_device()
    ]
    rng_state = rng.clone_state()
    # NOTE [no collection during a capture]: an unreachable object that holds a CUDA graph
    # (an operator dropped by the user, still in a reference cycle) frees it when the
    # cyclic collector runs; freeing a graph while a stream captures breaks the capture
    # ("operation not permitted when stream is capturing"). The collector is kept off for
    # the capture (its state is put back); no collection is forced (one costs tens of ms).
    collecting = gc.isenabled()
    gc.disable()
    try:
        try:
            graph.capture_begin(pool=pool)
            try:
                with _torch_compat.CapturableScalars():
                    outputs = _column_ready(fn())
            finally:
                graph.capture_end()
        finally:
            if collecting:
                gc.enable()
    except Exception:
        rng.graphsafe_set_state(rng_state)
        raise
    return graph, outputs, max(0, _torch_compat.cuda_reserved(device) - before)


def product_signature(
    leaves: list[Any], k: int, device: torch.device, modules: Sequence[nn.Module]
) -> tuple[Any, ...] | None:
    """What a recorded product is keyed by (NOTE [recorded products]): the block width, the
    chunk's leaves (``batch_leaves``: tensors by shape and dtype, other leaves by value) and the
    ``modules``' train/eval modes; ``None`` when the chunk cannot be recorded (a tensor that
    requires grad or lives on another device than ``device``, a leaf that cannot be hashed)."""
    sig: list[Any] = [k, torch.is_grad_enabled()]
    for x in leaves:
        if isinstance(x, torch.Tensor):
            if x.requires_grad or not same_device(x.device, device):
                return None
            sig.append((x.shape, x.dtype))
        else:
            try:
                hash(x)
            except TypeError:
                return None
            sig.append(x)
    sig.append(tuple(m.training for m in modules))
    return tuple(sig)


#: a product without a reusable state: ``product(chunk, vectors)``
FreshProduct = Callable[[Batch, list[torch.Tensor]], Sequence[torch.Tensor | None]]


class GraphRecorder:
    """The CUDA stream, graph pool and recordings of one operator (option ``cuda_graphs``).

    It records the products of ``params`` (the selected parameters) of the model that ``guard``
    watches, on ``device``; its pools count against ``states``' budget, next to the kept states
    they read; ``counts`` receives the replays and forwards; at most ``max_recorded`` batch
    signatures are recorded; ``owner`` names the operator in warnings. The caller asks for
    recordings only while they are on (``cuda_graphs=True``, CUDA, a recordable runner, and
    ``RNG_RESTORABLE``); the runner of each product is an argument.
    """

    def __init__(
        self,
        device: torch.device,
        params: Sequence[nn.Parameter],
        guard: ModelGuard,
        states: StateCache,
        counts: ProductCounts,
        *,
        max_recorded: int,
        owner: str,
    ) -> None:
        self.device = device
        self.params = params
        self.guard = guard
        self.states = states
        self.counts = counts
        self.max_recorded = max_recorded
        self.owner = owner
        self.stream: Any = None  # the operator's CUDA stream
        self.pool: Any = None
        self.failures: set[int] = set()  # block widths whose capture failed
        self.in_own_stream = False
        self.warned = False
        # NOTE [recorded products]: recordings by signature, state sizes measured by the
        # eager first product of each signature, signatures whose recording was attempted
        self.recorded: dict[tuple[Any, ...], RecordedProduct] = {}
        self.warm_products: dict[tuple[Any, ...], int] = {}
        self.attempted_products: set[tuple[Any, ...]] = set()
        # NOTE [direction copied ahead]: the recording the last single-vector product on a
        # kept state replayed, and the direction copied into it ahead of this product
        # (a weak reference: a dropped kept state frees its recording)
        self.last_replay: weakref.ref[Replay] | None = None
        self.copied_ahead: tuple[weakref.ref[Replay], torch.Tensor] | None = None

    def copy_ahead(self, rows: RowBlock) -> None:
        """Start copying a single direction into the recording it will most likely replay."""
        self.copied_ahead = None
        replay = self.last_replay() if self.last_replay is not None else None
        if (
            replay is None
            or replay.flat_input is None
            or rows.k != 1
            or len(self.states.entries) != 1
        ):
            return  # (a product over several kept chunks replays several recordings)
        with self.own_stream():
            replay.flat_input.copy_(rows.block)
        self.copied_ahead = (weakref.ref(replay), rows.block)

    def clear(self) -> None:
        self.recorded.clear()
        self.attempted_products.clear()
        self.last_replay = self.copied_ahead = None

    def private_leaves(self) -> list[torch.Tensor] | None:
        """Leaves standing in for the parameters in a graph that will be recorded, else ``None``.

        They share the parameters' storage and version counters but have
        their own gradient accumulators: a kept graph built on our stream
        would otherwise pin the parameters' accumulators to that stream, and
        the user's own backward passes would then run across streams.
        """
        if not self.in_own_stream:
            return None
        return [p.detach().requires_grad_(True) for p in self.params]

    @contextlib.contextmanager
    def own_stream(self) -> Iterator[None]:
        """Run the body on the operator's stream, ordered after and before the caller's."""
        caller = torch.cuda.current_stream(self.device)
        if self.stream is None:
            self.stream = torch.cuda.Stream(self.device)
        self.stream.wait_stream(caller)
        outer = self.in_own_stream
        self.in_own_stream = True
        try:
            with torch.cuda.stream(self.stream):
                yield
        finally:
            self.in_own_stream = outer
            caller.wait_stream(self.stream)

    def apply_own_stream(
        self, runner: ProductRunner, state: Any, vecs: list[torch.Tensor], retain: bool
    ) -> Sequence[torch.Tensor | None]:
        """An eager product on a state built on the operator's stream."""
        caller = torch.cuda.current_stream(self.device)
        with self.own_stream():
            prods = runner.apply(state, vecs, retain)
        for t in prods:
            if t is not None:  # made on our stream, read on the caller's: keep it until then
                t.record_stream(caller)
        return prods

    def apply_kept(self, runner: ProductRunner, entry: KeptState, rows: RowBlock) -> Product:
        """A product on a kept state: eager the first time per width, then replayed."""
        k = rows.k
        replay = entry.replays.get(k)
        if (
            replay is None
            and k in entry.warm
            and k not in entry.attempted
            and k not in self.failures
        ):
            with self.own_stream():
                replay = self.capture(runner, entry, rows)
        if replay is None:
            entry.warm.add(k)
            return self.apply_own_stream(runner, entry.state, rows.views, retain=True)
        ahead, self.copied_ahead = self.copied_ahead, None
        copied = ahead is not None and ahead[0]() is replay and ahead[1] is rows.block
        with self.own_stream():
            out = replay.run(rows, copied=copied)
        if k == 1:
            self.last_replay = weakref.ref(replay)
        self.counts.replays += 1
        return out

    def room_for(self, need: int, free: int | None = None) -> bool:
        """Whether a recording that will hold about ``need`` bytes fits the budget, and
        ``free`` bytes (default ``need``) are free on the device for its capture.

        Memory is never freed back to the device during a capture, and a capture that
        runs out of memory can leave the caching allocator unusable: check first. (The pool a
        capture really took is checked against the budget again afterwards, in ``record``.)
        """
        budget = self.states.budget()
        if budget is not None and self.states.nbytes + need > budget:
            return False
        torch.cuda.empty_cache()
        return bool(torch.cuda.mem_get_info(self.device)[0] >= (need if free is None else free))

    def record(
        self, what: str, k: int, fn: Callable[[], Sequence[torch.Tensor | None]]
    ) -> tuple[Any, list[torch.Tensor | None], int] | None:
        """Record ``fn()`` as a CUDA graph in the operator's pool.

        Returns ``(graph, outputs, bytes the pool grew by)``, or ``None`` when the
        capture failed (the operator warns once, unless it ran out of memory) or
        when the pool outgrew the budget.
        """
        live = self.recorded or any(entry.replays for entry in self.states.entries.values())
        if self.pool is None or not live:
            # torch releases a pool with its last graph; its handle cannot take another capture
            self.pool = torch.cuda.graph_pool_handle()
        try:
            graph, outputs, extra = capture_graph(self.device, self.pool, fn)
        except Exception as exc:  # any failure: eager products, same results
            if not self.warned and not isinstance(exc, torch.cuda.OutOfMemoryError):
                self.warned = True  # once per operator; out of memory: quietly eager
                warnings.warn(
                    f"{self.owner}: recording {what} as a CUDA graph failed for blocks "
                    f"of {k} ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}); such "
                    "products run eagerly. Pass cuda_graphs=False to skip the attempt.",
                    RuntimeWarning,
                    stacklevel=user_stacklevel(),
                )
            return None
        budget = self.states.budget()
        if budget is not None and self.states.nbytes + extra > budget:
            return None  # the graph and its pool are freed
        return graph, outputs, extra

    def capture(self, runner: ProductRunner, entry: KeptState, rows: RowBlock) -> Replay | None:
        """Record ``_apply`` on ``entry`` for vectors shaped like ``rows``; ``None`` if it cannot be."""
        k = rows.k
        entry.attempted.add(k)  # a refused or failed width stays eager: no re-check per product
        # room for the recording's pool, conservatively: an autograd backward through a kept
        # graph may hold about the graph again per vector, plus one; a traced tangent program
        # reads the kept values in place and its temporaries (tangents of kept values) are
        # about the kept state per vector
        factor = k if runner.traced else k + 1
        # the budget is checked on the pool the capture really took (``record``), the estimate
        # only guards the capture against running out of device memory (NOTE [CUDA graphs])
        if not self.room_for(0, free=factor * entry.nbytes):
            return None
        inputs, flat = static_inputs(rows)
        recorded = self.record(
            "the kept backward", k, lambda: runner.apply(entry.state, inputs, True)
        )
        if recorded is None:
            self.failures.add(k)
            return None
        graph, outputs, extra = recorded
        entry.nbytes += extra
        self.states.nbytes += extra
        replay = Replay(graph=graph, inputs=inputs, outputs=outputs, flat_input=flat)
        entry.replays[k] = replay
        return replay

    # -- recorded products, NOTE [recorded products] ----------------------------
    def signature(self, leaves: list[Any], k: int) -> tuple[Any, ...] | None:
        """What a recorded product is keyed by (``product_signature``)."""
        return product_signature(leaves, k, self.device, self.guard.modules)

    def pointers(self) -> tuple[int, ...]:
        return tuple(t.data_ptr() for t in model_tensors(self.guard.modules))

    def fresh_product(
        self, runner: ProductRunner, chunk: Batch, rows: RowBlock, product: FreshProduct
    ) -> Product:
        """A product without a kept state: eager (``product``), or replayed from a recording."""
        leaves = batch_leaves(chunk)
        sig = self.signature(leaves, rows.k) if leaves else None
        if sig is None:
            with self.guard.private_buffers():
                return product(chunk, rows.views)
        rec = self.recorded.get(sig)
        if rec is not None and rec.pointers != self.pointers():
            del self.recorded[sig]  # new storage under a parameter or buffer: record again
            self.states.nbytes -= rec.nbytes
            self.attempted_products.discard(sig)
            rec = None
        if rec is None and sig in self.warm_products and sig not in self.attempted_products:
            with self.own_stream():
                rec = self.record_product(runner, sig, chunk, rows)
        if (
            rec is None
        ):  # eager; the first product of a signature measures its state for the room check
            measure = sig not in self.warm_products
            before = _torch_compat.cuda_allocated(self.device) if measure else 0
            with self.guard.private_buffers():
                state = runner.prepare(chunk)
                if measure:
                    self.warm_products[sig] = _torch_compat.cuda_allocated(self.device) - before
                return runner.apply(state, rows.views, False)
        with self.own_stream():
            tensors = [t for t in leaves if isinstance(t, torch.Tensor)]
            out = rec.replay.run(rows, before=tensors, into=rec.batch_inputs)
        self.counts.replays += 1
        self.counts.forwards += 1
        return out

    def record_product(
        self, runner: ProductRunner, sig: tuple[Any, ...], chunk: Batch, rows: RowBlock
    ) -> RecordedProduct | None:
        self.attempted_products.add(sig)  # one attempt per signature
        k = rows.k
        if len(self.recorded) >= self.max_recorded:
            return None
        state = self.warm_products[sig]
        # held afterwards: the pool, about one product's peak (the state plus the
        # backward's temporaries, up to a state per vector); a margin on free memory
        if not self.room_for((k + 1) * state, free=(k + 2) * state):
            return None
        static = map_tensors(chunk, torch.empty_like)  # outside the capture: not in its pool
        inputs, flat = static_inputs(rows)

        def product() -> Sequence[torch.Tensor | None]:
            with self.guard.private_buffers():
                return runner.apply(runner.prepare(static, self.private_leaves()), inputs, False)

        forwards = self.counts.forwards
        recorded = self.record("the product", k, product)
        self.counts.forwards = forwards  # a capture runs nothing
        if recorded is None:
            return None
        graph, outputs, extra = recorded
        rec = RecordedProduct(
            pointers=self.pointers(),
            batch=static,
            batch_inputs=[t for t in batch_leaves(static) if isinstance(t, torch.Tensor)],
            replay=Replay(graph=graph, inputs=inputs, outputs=outputs, flat_input=flat),
            nbytes=extra,
        )
        self.recorded[sig] = rec
        self.states.nbytes += extra
        return rec
