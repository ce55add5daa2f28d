"""The data-driven base every curvature type shares: the data loop.

:class:`DataCurvatureOperator` owns what the Hessian, GGN and Fisher have in
common. Its construction (options, parameter selection and binding, the
collaborators) is ``data_setup``; here is the loop of one product: the
data (``full_dataset``, ``num_batches``, cycling), microbatching, batch-size
weighting ``Σ bᵢ·Cᵢ / Σ bᵢ``, the flat output buffer and block chunking. A
curvature type writes the per-batch product: ``_prepare(batch)`` (forward
and whatever first-order graph it needs) and ``_apply(state, vecs, retain)``
for the autograd engine, ``functional_product`` for the traced ones.

Collaborators, each beside its NOTE, each given what it uses (none holds the
operator): ``model_guard.ModelGuard`` (the model and the precision switches
left exactly as found), ``graph_reuse.StateCache`` (kept states and the
reuse key), ``cuda_graphs.GraphRecorder`` (CUDA-graph recording and replay),
and the runner that ``engines.EngineSelector`` chose (how products run:
``prepare(batch, params)`` / ``apply(state, vectors, retain)``). The operator
protocol itself (:class:`CurvatureOperator`, :class:`LambdaOperator`) is
``operators.protocol``, re-exported here.

One product on a kept state, in four files of ``operators/``: protocol
(validation) → ``_matmat_rows`` (the binding check) → ``_pass`` (model guard in,
which reads the model's reuse key once; one loop over the data: the kept state's
check, ``kept_state``, the runner (the curvature's module or its engine), the
weighted copy into the buffer; model guard out).

Cost per product: whatever the subclass's per-batch product costs, plus one
copy of the result into a flat buffer; no ``torch.cat``, no host sync.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from hessian_eigenthings import _torch_compat
from hessian_eigenthings.batching import (
    Batch,
    batch_size,
    same_batch,
    split_batch,
    to_device,
)
from hessian_eigenthings.operators.cuda_graphs import RNG_RESTORABLE, FlatProduct, Product
from hessian_eigenthings.operators.data_setup import DataOperatorSetup, DataOptions
from hessian_eigenthings.operators.engines.runner import ProductRunner
from hessian_eigenthings.operators.graph_reuse import KeptState, StateCache
from hessian_eigenthings.operators.model_guard import (
    RandomForwardWarning,
    preserve_model,
    private_buffers,
)
from hessian_eigenthings.operators.precision import upcast_batch
from hessian_eigenthings.operators.protocol import CurvatureOperator, LambdaOperator, same_device
from hessian_eigenthings.param_utils import RowBlock

__all__ = [
    "CurvatureOperator",
    "DataCurvatureOperator",
    "DataOptions",
    "LambdaOperator",
    "RandomForwardWarning",
    "SampleCount",
    "preserve_model",
    "private_buffers",
    "same_device",
]


# NOTE [batch weighting]
# The default weights each chunk by its samples, so the product is that of
# the mean loss over all samples and a short last batch does not bias it.
# 0.x averaged per batch with equal weights; the 0.x facade sets
# batch_weighting = "uniform" to keep its results. Then a chunk of a split
# batch weighs chunk/batch samples, so each batch still counts once and its
# own product is its exact mean.
class SampleCount:
    """How a data operator counts a chunk's samples (NOTE [batch weighting]) and what it says
    when a pass counted none; this one counts the batch's rows. A curvature whose loss counts
    its own samples (the empirical Fisher of a per-token loss) sets its operator's
    ``sample_counter`` to one of its own before calling the base constructor."""

    def samples(self, chunk: Batch) -> int:
        """Samples in ``chunk``."""
        return batch_size(chunk)

    def check(self, count: int, total: float) -> None:
        """Raise when a pass (over every rank) counted nothing: ``count`` chunks, of total
        weight ``total``."""
        if count == 0:
            raise ValueError(
                "the data has zero samples to average over (every batch is empty or has no weight)"
            )


#: the default count: a chunk's rows
BATCH_ROWS = SampleCount()


class DataCurvatureOperator(DataOperatorSetup):
    """Base of curvature operators defined by a model, data and a loss.

    Options shared by every subclass (:class:`DataOptions`, passed on as one record):

    - ``param_filter``: which parameters (callable, glob or list of globs).
    - ``full_dataset``: average over every batch (``True``) or take the next batch on each
      product, cycling (``False``); ``num_batches``: cap on the batches of one product.
    - ``microbatch_size``: split each batch into chunks of this many samples (same result, lower
      peak memory; refused for BatchNorm in training mode unless ``microbatch_unsafe=True``).
    - ``max_block_size``: most vectors per pass of a block product; ``block_memory_budget``:
      bytes a block pass may add on CUDA (the chunk is sized from the measured cost of the
      first pass).
    - ``graph_reuse``: ``"auto"`` / ``True`` / ``False``, see NOTE [graph reuse].
      ``graph_reuse_max_batches``: most kept states; ``graph_memory_budget``: bytes they may
      hold on CUDA (default half the device, NOTE [memory budget]).
    - ``cuda_graphs``: record products as CUDA graphs and replay them (default ``True``; CUDA
      only; NOTE [CUDA graphs], NOTE [recorded products]), held between products (``held_bytes``).
    - ``engine``: ``"auto"``, ``"autograd"``, ``"functional"``, ``"compiled"`` or ``"layers"``
      (with ``layers=``, the dotted path to the model's blocks: NOTE [layer walk]).
    - ``precision``: ``"fp32"`` (default; a half model's products on float32 copies), ``"tf32"``
      or ``"model"`` (the model's own dtype), NOTE [half models] in ``operators.precision``;
      ``backend``: the vectors' arithmetic (default the single-device one); ``ranks``: the
      processes products span (default this one).

    A curvature writes the hooks ``_prepare`` / ``_apply`` (and, for the traced engines,
    ``functional_product`` with ``_engine_batch``; for ``engine="layers"``,
    ``layer_walk_runner``). It declares what the base may do as class attributes, or as
    instance attributes set before it calls this constructor, which builds the engine selector
    from them: ``supports_graph_reuse``, ``needs_double_backward``, ``supports_cuda_graphs``,
    ``supports_functional``, ``batch_weighting``, and ``sample_counter``: the
    :class:`SampleCount` that counts a chunk's samples (its rows by default).
    """

    #: counts a chunk's samples, the weights of NOTE [batch weighting] (its rows by default)
    sample_counter: SampleCount = BATCH_ROWS

    def _chunks(self, raw: Batch) -> list[Batch]:
        batch = to_device(raw, self.device)
        if self._upcast is not None:  # a half model's inputs (NOTE [half models]; sharded: later)
            batch = upcast_batch(batch, self._dtype)
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

    def _product(self, batch: Batch, vecs: list[torch.Tensor]) -> Sequence[torch.Tensor | None]:
        """A product without a reusable state (e.g. finite differences)."""
        runner = self._engines.runner
        return runner.apply(runner.prepare(batch), vecs, False)

    def _reuse_enabled(self) -> bool:
        return self.supports_graph_reuse and self.graph_reuse is not False

    def _matmat_rows(self, V: torch.Tensor) -> torch.Tensor:
        # NOTE [replaced parameters]: each slot on the path to a selected parameter still holds what
        # was bound (host work, one lookup and one `is` per slot; checked here, once per call).
        # ParameterBinding.current() is the same test, written out here so that a steady product
        # does not enter parameter_binding (tests/perf/test_module_hops.py)
        if not all(d.get(key) is value for d, key, value in self._binding.slots):
            self._follow_parameters()
        return self._products(V)

    def _products(self, V: torch.Tensor) -> torch.Tensor:
        sel = self._engine_selector
        # said once; a traced engine refuses such a model with its own error
        if not self.guard.random_said and not sel.runner.traced:
            self.guard.warn_random_forward(type(self).__name__)
        k = V.shape[0]
        # the flat output buffer: V is a (k, n) block in the layout's dtype and device
        if self.ranks.distributed:  # see NOTE [one process, no ranks module]
            out = self.ranks.output(V, self._block_limit(k) >= k)
        else:
            out = torch.empty_like(V, memory_format=torch.contiguous_format)
        start = 0
        counts = self.counts
        counts.products += k
        if counts.products >= sel.look_at:  # engine="auto" looks at this block (NOTE [auto engine])
            keeps = self._reuse_enabled() and self._states.may_keep()
            start = sel.block(
                V,
                out,
                first=self._block_limit(k),
                product=self._rows,
                keeps_states=keeps,
                cold=2 if keeps and self._records_graphs(sel.runner) else 1,
                on_switch=self.clear_cache,
                counts=counts,
            )
        while start < k:
            start = self._block_step(V, out, start)
        return out

    def _rows(self, V: torch.Tensor, out: torch.Tensor) -> None:
        """``out = A V`` in as many passes as the block limit takes (``auto`` times this)."""
        start = 0
        while start < V.shape[0]:
            start = self._block_step(V, out, start)

    def _block_step(self, V: torch.Tensor, out: torch.Tensor, start: int) -> int:
        """One pass for rows ``start:`` (as many as the block limit allows); returns the next start."""
        k = V.shape[0]
        stop = min(k, start + self._block_limit(k - start))
        cuda = self._device.type == "cuda" and self.block_memory_budget is not None
        if cuda:
            torch.cuda.reset_peak_memory_stats(self._device)
            base = _torch_compat.cuda_allocated(self._device)
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
            peak = torch.cuda.max_memory_allocated(self._device) - base
            self._per_vector_bytes = max(self._per_vector_bytes or 0.0, peak / (stop - start))
        return stop

    def _records_graphs(self, runner: ProductRunner) -> bool:
        """Whether ``runner``'s products on kept states are recorded as CUDA graphs (NOTE [CUDA
        graphs]): a traced runner's products are plain tensor programs, recordable whatever the
        curvature."""
        return bool(
            self.cuda_graphs
            and self.ranks.records_graphs
            and self._device.type == "cuda"
            and RNG_RESTORABLE
            and self._upcast is None  # stand-ins: the user's half tensors (NOTE [half models])
            and getattr(runner, "recordable", True)
            and (runner.traced or self.supports_cuda_graphs)
        )

    def _pass(self, V: torch.Tensor, out: torch.Tensor) -> None:
        """One pass over the data for the row block ``V`` (k, n), written into ``out``.

        ``out = Σ bᵢ·Pᵢ / Σ bᵢ`` over the chunks of the pass, where ``Pᵢ`` is
        the product of chunk ``i`` (mean loss over its ``bᵢ`` samples). With
        one chunk this is a single copy into the buffer. The pass runs in its ranks' scope
        (``ranks.product_pass``: a distributed pass joins the other ranks when it fails).
        """
        if not self.ranks.distributed:  # NOTE [one process, no ranks module]
            self._weighted_pass(V, out)
            return
        with self.ranks.product_pass(V, out):
            self._weighted_pass(V, out)

    def _weighted_pass(self, V: torch.Tensor, out: torch.Tensor) -> None:
        """``_pass`` inside its ranks' scope."""
        runner = self._engine_selector.runner
        graphs = self._records_graphs(runner)
        # the model's reuse key, read once per pass under its switches when a state is kept
        key = bool(self._states.entries) and self._reuse_enabled()
        rows = RowBlock(self.layout, V)
        out_rows = RowBlock(self.layout, out)
        if graphs:
            self.recorder.copy_ahead(rows)  # NOTE [direction copied ahead]
        count = 0
        total = 0.0
        math_sdpa = self.needs_double_backward or runner.traced
        with self.guard.product(self.precision, double_backward=math_sdpa, key=key) as model:
            for product, size in self._contributions(rows, runner, graphs, model):
                if size == 0:
                    continue  # no samples to average over (NOTE [empty batches])
                if count == 1:
                    out.mul_(float(total))  # out held P₁; from here on it holds Σ wᵢ·Pᵢ
                accumulate(out, out_rows, product, count == 0, size)
                count += 1
                total += size
        self._finish_pass(out, count, total)

    def _finish_pass(self, out: torch.Tensor, count: int, total: float) -> None:
        """Normalize the weighted sum (NOTE [one process, no ranks module])."""
        if self.ranks.distributed:
            self.ranks.finish(out, count, total, self.sample_counter.check)
            return
        self.sample_counter.check(count, total)
        if count > 1:
            out.mul_(1.0 / total)

    def _fresh_chunks(self) -> Iterator[tuple[Batch, Batch]]:
        """``(batch, chunk)`` for every chunk of one pass that this rank runs (products without
        kept states; ``ranks.chunks``: sharded ranks agree before each)."""
        chunks = (
            (raw, chunk)
            for raw in self._empty.filter(self.source)  # NOTE [empty batches]
            for chunk in self._chunks(raw)
        )
        return self.ranks.chunks(chunks, self._chunk_weight)

    def _chunk_product(
        self, raw: Batch, chunk: Batch, rows: RowBlock, runner: ProductRunner, graphs: bool
    ) -> tuple[Product, float]:
        """The product of one chunk without a kept state, and its weight (``_weight``), as its
        ranks take it (``ranks.chunk_product``: sharded ranks sum it over the ranks)."""
        if graphs:
            product = self.recorder.fresh_product(runner, chunk, rows, self._product)
            return product, self._chunk_weight(raw, chunk)
        with self.guard.private_buffers():
            return self.ranks.chunk_product(
                chunk, rows.views, self._product, lambda: self._chunk_weight(raw, chunk)
            )

    def _state_builder(self, runner: ProductRunner, graphs: bool) -> Callable[[Batch], Any]:
        """How a chunk's state to keep is built: private buffers, and with recordings on the
        operator's stream with stand-in leaves for the parameters (NOTE [CUDA graphs])."""

        def prepare(chunk: Batch) -> Any:
            if not graphs:
                with self.guard.private_buffers():
                    return runner.prepare(chunk)
            with self.recorder.own_stream(), self.guard.private_buffers():
                return runner.prepare(chunk, self.recorder.private_leaves())

        return prepare

    def _contributions(
        self, rows: RowBlock, runner: ProductRunner, graphs: bool, model: tuple[Any, ...] | None
    ) -> Iterator[tuple[Product, float]]:
        """``(product, weight)`` of every chunk of one pass (weight: its samples, see ``_weight``).
        A chunk whose state is kept costs its product and the reuse key's check (NOTE [reuse key];
        ``model``: the model's part, read by the guard's scope, ``None`` when no state is kept)."""
        self.chunk_position = -1  # which chunk of the pass is being computed (0, 1, ...)
        counts = self.counts
        if not self._reuse_enabled():
            for raw, chunk in self._fresh_chunks():
                counts.passes += 1
                self.chunk_position += 1
                yield self._chunk_product(raw, chunk, rows, runner, graphs)
            return
        states, source, per_sample = self._states, self.source, self.batch_weighting == "size"
        counter = self.sample_counter
        # NOTE [empty batches]: a batch with a kept state has samples; others are checked here
        seen = skipped = 0
        for position, raw in enumerate(
            source.batches() if source.full_dataset else self._empty.filter(source)
        ):
            seen += 1
            entry = kept_state(states, (position, 0), raw, model)
            if entry is None and batch_size(raw) == 0:
                skipped += 1
                continue
            chunks: list[Batch] | None = None
            n_chunks = 1
            if self.microbatch_size is not None:
                n_chunks = math.ceil(batch_size(raw) / self.microbatch_size)
            for c in range(n_chunks):
                self.chunk_position += 1
                if c:
                    entry = kept_state(states, (position, c), raw, model)
                if entry is not None:
                    if graphs:
                        product = self.recorder.apply_kept(runner, entry, rows)
                    else:
                        product = runner.apply(entry.state, rows.views, True)
                    yield product, (entry.size if per_sample else self._weight(entry.size, raw))
                    continue
                if chunks is None:
                    chunks = self._chunks(raw)
                chunk = chunks[c]
                counts.passes += 1
                if not states.may_keep():
                    yield self._chunk_product(raw, chunk, rows, runner, graphs)
                    continue
                build = self._state_builder(runner, graphs)
                state, kept = states.build((position, c), raw, chunk, build, counter.samples)
                if kept and graphs:
                    product = self.recorder.apply_kept(runner, states.entries[(position, c)], rows)
                elif kept:
                    product = runner.apply(state, rows.views, True)
                elif graphs:  # built on the operator's stream
                    product = self.recorder.apply_own_stream(runner, state, rows.views, False)
                else:
                    product = runner.apply(state, rows.views, False)
                yield product, self._chunk_weight(raw, chunk)
        if skipped:
            self._empty.finish(skipped, seen)

    def _weight(self, samples: int, raw: Batch) -> float:
        """Weight of a chunk of ``samples`` samples cut from the batch ``raw`` (NOTE [batch
        weighting])."""
        if self.batch_weighting == "size":
            return samples
        return samples / self.sample_counter.samples(raw)

    def _chunk_weight(self, raw: Batch, chunk: Batch) -> float:
        """Weight of the chunk ``chunk`` cut from the batch ``raw``."""
        return self._weight(self.sample_counter.samples(chunk), raw)


# NOTE [one process, no ranks module]
# `_finish_pass`: `out` holds P₁ when count == 1, else Σ wᵢ·Pᵢ; total = Σ wᵢ (wᵢ = bᵢ unless NOTE
# [batch weighting]). The ranks finish it (distributed ones reduce across the ranks before
# dividing). On one process (LOCAL) the data loop does what Ranks would do without calling it, so
# that a steady product stays in the modules tests/perf/test_module_hops.py pins (Ranks.finish
# is this same finish).


def accumulate(
    out: torch.Tensor, out_rows: RowBlock, product: Product, first: bool, size: float
) -> None:
    """A chunk's ``product`` into the pass's buffer ``out`` (``out_rows``: its views): copied when
    ``first`` (the rows of an exact zero zeroed), else added with weight ``size``."""
    if isinstance(product, FlatProduct) and first:
        # a replayed product comes as column blocks: one call, no per-parameter views (NOTE
        # [views on demand])
        torch.cat(product.parts, dim=1, out=out)
        return
    if isinstance(product, FlatProduct):
        out_views: Sequence[torch.Tensor] = out_rows.flat()
        prods: Sequence[torch.Tensor | None] = product.parts
    else:
        out_views, prods = out_rows.views, product
    pairs = [(o, p) for o, p in zip(out_views, prods, strict=True) if p is not None]
    if not first:
        _torch_compat.foreach_add_([o for o, _ in pairs], [p for _, p in pairs], alpha=float(size))
        return
    _torch_compat.foreach_copy_([o for o, _ in pairs], [p for _, p in pairs])
    for o, p in zip(out_views, prods, strict=True):
        if p is None:
            o.zero_()


def kept_state(
    states: StateCache, key: tuple[int, int], raw: Batch, model: tuple[Any, ...] | None
) -> KeptState | None:
    """The kept state of chunk ``key`` if it still answers for the model (``model``, its key) and
    the batch ``raw`` (NOTE [reuse key]); a stale one is dropped. Checked here, in the data loop:
    a product on a kept state enters no other collaborator than the guard."""
    entry = states.entries.get(key)
    if entry is None or (entry.versions == model and same_batch(entry.raw, raw)):
        return entry
    states.drop(key)
    return None
