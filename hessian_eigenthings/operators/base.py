"""The data-driven base every curvature type shares.

:class:`DataCurvatureOperator` owns what the Hessian, GGN and Fisher have in
common: validation, parameter selection and layout, the data loop
(``full_dataset``, ``num_batches``, cycling), microbatching, batch-size
weighting ``Σ bᵢ·Cᵢ / Σ bᵢ``, the flat output buffer and block chunking. A
curvature type writes the per-batch product: ``_prepare(batch)`` (forward
and whatever first-order graph it needs) and ``_apply(state, vecs, retain)``
for the autograd engine, ``functional_product`` for the traced ones.

Collaborators, each beside its NOTE: ``model_guard.ModelGuard`` (the model
left exactly as found), ``graph_reuse.StateCache`` (kept states and the reuse
key), ``cuda_graphs.GraphRecorder`` (CUDA-graph recording and replay),
``engines.EngineSelector`` (how products run). The operator protocol itself
(:class:`CurvatureOperator`, :class:`LambdaOperator`) is ``operators.protocol``,
re-exported here.

Cost per product: whatever the subclass's per-batch product costs, plus one
copy of the result into a flat buffer; no ``torch.cat``, no host sync.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, Literal, TypedDict

import torch
from torch import nn

from hessian_eigenthings import _torch_compat
from hessian_eigenthings._checks import check_count
from hessian_eigenthings.batching import (
    Batch,
    BatchSource,
    batch_size,
    check_microbatching,
    split_batch,
    to_device,
)
from hessian_eigenthings.linalg import LinAlgBackend, default_backend
from hessian_eigenthings.operators.cuda_graphs import FlatProduct, GraphRecorder, Product
from hessian_eigenthings.operators.empty_batches import EmptyBatches
from hessian_eigenthings.operators.engines import ENGINES, EngineName, EngineSelector
from hessian_eigenthings.operators.graph_reuse import StateCache
from hessian_eigenthings.operators.model_guard import (
    ModelGuard,
    RandomForwardWarning,
    preserve_model,
    private_buffers,
)
from hessian_eigenthings.operators.parameter_binding import ParameterBinding, project_rows_
from hessian_eigenthings.operators.precision import Precision, check_precision
from hessian_eigenthings.operators.protocol import CurvatureOperator, LambdaOperator, same_device
from hessian_eigenthings.param_utils import ParamFilter, ParamLayout, RowBlock, select_parameters

__all__ = [
    "CurvatureOperator",
    "DataCurvatureOperator",
    "DataOptions",
    "LambdaOperator",
    "RandomForwardWarning",
    "preserve_model",
    "private_buffers",
    "same_device",
]

Reuse = bool | Literal["auto"]


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
        self.named_params = list(select_parameters(model, param_filter).items())
        self.params = [p for _, p in self.named_params]
        self.layout = ParamLayout.from_named(self.named_params)
        self._binding = ParameterBinding(model, self.named_params, self.layout.offsets, type(self).__name__)
        self._empty = EmptyBatches(type(self).__name__)
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
        self.backend = default_backend(backend)
        self.precision = check_precision(precision)
        if engine not in ENGINES:
            raise ValueError(f"engine must be one of {ENGINES}, got {engine!r}")
        self._engine_name = engine
        # collaborators: the model guard, kept states (NOTE [graph reuse]), CUDA-graph recordings
        self.guard = ModelGuard(model, self.params)
        self._states = StateCache(self)
        self.recorder = GraphRecorder(self)
        self._per_vector_bytes: float | None = None
        #: widest block that fit after an out-of-memory retry (NOTE [block out of memory])
        self._oom_block_limit: int | None = None
        #: passes over the data (one per batch chunk), forward passes, replayed products: cost checks
        self.num_passes = 0
        self.num_forwards = 0
        self.num_replays = 0
        self.chunk_position = 0

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

    def inconsistency_causes(self) -> list[str]:
        causes = super().inconsistency_causes()
        random = self.guard.random_cause()
        if random:
            causes.append(random)
        if not self.source.full_dataset:
            causes.append("full_dataset=False takes another batch for every product")
        if self.precision == "tf32":
            causes.append("precision='tf32' runs products with TF32 (about 1e-3 relative error)")
        return causes

    def _warn_random_forward(self) -> None:
        if not self._engines.traced:  # a traced engine refuses such a model with its own error
            self.guard.warn_random_forward(type(self).__name__)

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
        traces or compiles only when that many products pay for it. Kept states whose parameters
        changed without a version bump are dropped here (NOTE [updates that keep the version])."""
        self._follow_parameters()
        self._states.drop_changed()
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

    def _engine_batch(self, batch: Batch) -> Batch:
        """The batch a traced engine's product receives (the batch, or the batch with per-chunk inputs)."""
        return batch

    def _product(self, batch: Batch, vecs: list[torch.Tensor]) -> Sequence[torch.Tensor | None]:
        """A product without a reusable state (e.g. finite differences)."""
        return self._engines.apply(self._engines.prepare(batch), vecs, retain=False)

    def _reuse_enabled(self) -> bool:
        return self.supports_graph_reuse and self.graph_reuse is not False

    @property
    def held_bytes(self) -> int:
        """Device bytes held between products: kept graphs and CUDA-graph pools (0 on the CPU)."""
        return self._states.nbytes

    def clear_cache(self) -> None:
        """Drop kept graphs and recorded products (they are dropped automatically when stale)."""
        self._states.clear()
        self.recorder.clear()

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

    def _follow_parameters(self) -> None:
        """NOTE [replaced parameters]: drop what was keyed on replaced tensors (states, recordings, programs)."""
        if (named := self._binding.follow()) is not None:
            self.named_params, self.params = named, [p for _, p in named]
            self.guard, self.recorder = ModelGuard(self.model, self.params), GraphRecorder(self)
            self.clear_cache()
            self.__dict__.pop("_engine_selector", None)

    def _matmat_rows(self, V: torch.Tensor) -> torch.Tensor:
        self._follow_parameters()
        if rows := self._binding.constant_rows:  # NOTE [padding rows]: P·A·P, on a copy of the caller's V
            return project_rows_(self._products(project_rows_(V.clone(), rows)), rows)
        return self._products(V)

    def _products(self, V: torch.Tensor) -> torch.Tensor:
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
        rows = RowBlock(self.layout, V)
        out_rows = RowBlock(self.layout, out)
        self.recorder.copy_ahead(rows)  # NOTE [direction copied ahead]
        count = 0
        total = 0.0
        math_sdpa = self.needs_double_backward or self._engines.traced
        with self.guard.product(self.precision, double_backward=math_sdpa):
            for product, size in self._contributions(rows):
                if size == 0:
                    continue  # no samples to average over (NOTE [empty batches])
                if count == 1:
                    out.mul_(float(total))  # out held P₁; from here on it holds Σ wᵢ·Pᵢ
                if isinstance(product, FlatProduct) and count == 0:
                    # a replayed product comes as column blocks: one call, no per-parameter
                    # views (NOTE [views on demand])
                    torch.cat(product.parts, dim=1, out=out)
                else:
                    if isinstance(product, FlatProduct):
                        out_views: Sequence[torch.Tensor] = out_rows.flat()
                        prods: Sequence[torch.Tensor | None] = product.parts
                    else:
                        out_views, prods = out_rows.views, product
                    pairs = [(o, p) for o, p in zip(out_views, prods, strict=True) if p is not None]
                    if count == 0:
                        _torch_compat.foreach_copy_([o for o, _ in pairs], [p for _, p in pairs])
                        for o, p in zip(out_views, prods, strict=True):
                            if p is None:
                                o.zero_()
                    else:
                        _torch_compat.foreach_add_([o for o, _ in pairs], [p for _, p in pairs], alpha=float(size))
                count += 1
                total += size
        if count == 0:
            raise ValueError("the data has zero samples to average over (every batch is empty or has no weight)")
        self._finish_pass(out, count, total)

    def _finish_pass(self, out: torch.Tensor, count: int, total: float) -> None:
        """Normalize the weighted sum. ``out`` holds ``P₁`` when ``count == 1``,
        else ``Σ wᵢ·Pᵢ``; ``total = Σ wᵢ`` (``wᵢ = bᵢ`` unless NOTE [batch weighting]). Distributed wrappers override this
        to reduce across ranks before dividing."""
        if count > 1:
            out.mul_(1.0 / total)

    def _fresh_chunks(self) -> Iterator[tuple[Batch, Batch]]:
        """``(batch, chunk)`` for every chunk of one pass (products without kept states)."""
        for raw in self._empty.filter(self.source):  # NOTE [empty batches]
            for chunk in self._chunks(raw):
                yield raw, chunk

    def _chunk_product(self, raw: Batch, chunk: Batch, rows: RowBlock) -> tuple[Product, float]:
        """The product of one chunk without a kept state, and its weight (``_weight``)."""
        return self.recorder.fresh_product(chunk, rows), self._weight(self._samples(chunk), raw)

    def _contributions(self, rows: RowBlock) -> Iterator[tuple[Product, float]]:
        """``(product, weight)`` of every chunk of one pass (weight: its samples, see ``_weight``)."""
        self.chunk_position = -1  # which chunk of the pass is being computed (0, 1, ...)
        if not self._reuse_enabled():
            for raw, chunk in self._fresh_chunks():
                self.num_passes += 1
                self.chunk_position += 1
                yield self._chunk_product(raw, chunk, rows)
            return
        for position, raw in enumerate(self._empty.filter(self.source)):
            chunks: list[Batch] | None = None
            n_chunks = 1
            if self.microbatch_size is not None:
                n_chunks = math.ceil(batch_size(raw) / self.microbatch_size)
            for c in range(n_chunks):
                key = (position, c)
                self.chunk_position += 1
                entry = self._states.get(key, raw)
                if entry is not None:
                    yield self.recorder.apply_kept(entry, rows), self._weight(entry.size, raw)
                    continue
                if chunks is None:
                    chunks = self._chunks(raw)
                chunk = chunks[c]
                self.num_passes += 1
                if not self._states.may_keep():
                    yield self._chunk_product(raw, chunk, rows)
                    continue
                state, kept = self._states.build(key, raw, chunk)
                if kept:
                    prods = self.recorder.apply_kept(self._states.entries[key], rows)
                else:
                    prods = self.recorder.apply_own_stream(state, rows.views, retain=False)
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
