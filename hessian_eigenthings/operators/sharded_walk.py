"""The layer walk on a model sharded with FSDP2 (NOTE [sharded layer walk]).

:class:`ShardGather` lets :class:`~hessian_eigenthings.operators.engines.layers.LayerWalk` run with each
stage's parameters and direction gathered whole just before the stage and its block of the
product reduced over the ranks and cut back to this rank's shard just after: exact products on
sharded parameters and sharded vectors, no rank ever holding more than two layers (the one that
computes and the next one, whose gather is in flight: NOTE [prefetched gathers]) and the parameters
outside the layers whole.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from hessian_eigenthings import _torch_compat
from hessian_eigenthings._checks import InternalError

# NOTE [sharded layer walk]
# FSDP2 holds each parameter as a DTensor sharded on dim 0 and gathers it in
# hooks around each fully_shard'ed module's forward, outside autograd, so no
# function transform sees through them. The walk gathers instead:
# - the batch's layer calls are recorded by one ordinary FSDP forward (no
#   graph; a half model's in float32, NOTE [recording in the product's
#   dtype]): every rank runs its own batch, of any size;
# - during the walk FSDP's forward hooks are set aside (the modules are then
#   plain modules whose registered parameters are the sharded DTensors, which
#   the walk replaces by whole tensors for each call), and each stage's
#   parameters and direction are gathered whole in one all-gather (each rank's
#   shards padded to FSDP's chunk of rows and packed), issued while the stage
#   before it computes (NOTE [prefetched gathers]);
# - a stage's blocks of H_r v (rank r's batch, mean loss over its b_r samples)
#   are scaled by b_r / B (B = Σ_r b_r) and summed over the ranks by one
#   reduce-scatter that hands each rank its rows (FSDP2's `torch.chunk` split
#   of dim 0): the batch-size-weighted product of the union of the batches.
# Every rank walks the stages in one order, so the collectives match. Memory
# per rank: the boundary activations of its own batch (values and tangents),
# one layer (two while the next one arrives, NOTE [prefetched gathers]) and
# the outside parameters whole, one layer's block of the product whole.
# Communication per vector and layer: two all-gathers (the forward and the
# backward walk; one for a layer whose graph is kept, NOTE [kept layer
# graphs]) and one reduce-scatter, as many as an FSDP training step has per
# layer.

# NOTE [prefetched gathers]
# A collective waited where it is issued leaves the GPU idle while it runs: per
# layer and vector, two all-gathers and a reduce-scatter with no compute beside
# them. So the walk (LayerWalk.hvp, .sandwich) names the stages it will take,
# in its order: the outside, the layers forward, then the layers the backward
# walk gathers again (for a Hessian product, those whose graphs are not kept
# and the first kept one while it is checked once, NOTE [kept layer graphs];
# the ranks agreed how many to keep before the forward walk, so the plan is
# known by then). When a stage starts, its gather's handle is waited and the
# next planned stage's all-gather issued (`ShardGather.gather_async`: the same
# packing, collective and unpacking as `gather`, so the same bits) before the
# stage computes; a stage's reduce-scatter (`finish_async`) is left in flight
# until the next stage's is issued or the walk ends, and its blocks are read
# only after. In flight at any time: one all-gather and one reduce-scatter.
# Memory per rank: the outside parameters whole (as before), the layer that
# computes and the one arriving (FSDP2's own prefetch holds as much), the last
# layer's packed blocks of the product until its reduce-scatter is waited, and
# the kept layer graphs with the layers they hold (within keep_bytes). A layer
# is released before the next one arrives (the GGN's backward walk drops each
# layer's pullback before it takes the next layer).
# Order: collectives pair up by the order each rank issues them (NCCL runs one
# stream per communicator; gloo matches by a counter). Every rank plans the
# same stages (the plan depends on the layer count and on agreed numbers
# only) and issues them in plan order, interleaved alike with the
# reduce-scatters and agreements. Where the walk leaves its plan (a kept layer
# refused mid-walk, NOTE [kept layer graphs]), it does so on every rank alike:
# the gather in flight is waited and dropped, the rest of the walk gathers
# each stage where it starts. On an exception what is in flight is dropped
# unwaited: waiting could hang on a rank that never issued it. `prefetch =
# False` on the LayerWalk waits each collective where it is issued (the same
# bits; for timing both).

# NOTE [recording in the product's dtype]
# The walk records each layer's call (its arguments besides the hidden state, NOTE [layer
# walk]) in one forward without a graph. Some of those arguments are computed by the model
# outside the layers: a Llama's rotary (cos, sin) and its attention mask, from the embeddings'
# dtype. Recorded by FSDP's own forward of a bfloat16 model they would carry bfloat16 rounding
# (~4e-3 relative, ~1e-2 in the Hessian) into every float32 product. So when the walk computes
# in another dtype than the model (a half model's float32, NOTE [half models] in `precision`),
# the recording forward runs in that dtype too, the way the single-process default runs it:
# the batch's half inputs cast, FSDP's hooks set aside, each fully_shard'ed module's own
# parameters (those of its subtree not under a nested fully_shard'ed module) gathered whole
# and cast by the walk's `gather` just before its call and put back as shards right after it,
# the rank's half buffers upcast. Memory per rank is FSDP's: the root's own parameters (the
# outside of the layers) and one layer whole at a time, in float32. The collectives are
# FSDP's too: one all-gather per fully_shard'ed module's call, in the same order on every
# rank. The gathered blocks stand in as parameters that require grad as the model's do, so
# the walk's check that no recorded argument depends on the parameters still sees through
# them. The root's own parameters stay whole until the recording ends, as FSDP keeps them
# after its forward. In the model's own dtype (precision="model", a float32 model) the recording is
# FSDP's own forward.


def chunk_rows(rows: int, world: int) -> list[int]:
    """Rows of dim 0 on each rank under FSDP2's ``torch.chunk`` split: chunks of ``c = ceil(d /
    W)`` rows on the first ranks, the last ones shorter or empty (rank r holds rows ``[r·c,
    r·c + n_r)``)."""
    chunk = -(-rows // world)
    return [max(0, min(chunk, rows - r * chunk)) for r in range(world)]


def _fsdp_hooks(model: nn.Module, fsdp_cls: type) -> list[dict[Any, Any]]:
    return [
        getattr(m, attr)
        for m in model.modules()
        if isinstance(m, fsdp_cls)
        for attr in ("_forward_pre_hooks", "_forward_hooks")
    ]


@contextlib.contextmanager
def without_fsdp_hooks(model: nn.Module, fsdp_cls: type) -> Iterator[None]:
    """FSDP's forward hooks set aside for the duration (put back in their order)."""
    saved = [(d, list(d.items())) for d in _fsdp_hooks(model, fsdp_cls)]
    for d, _ in saved:
        d.clear()
    try:
        yield
    finally:
        for d, items in saved:
            d.clear()
            d.update(items)


def check_every_parameter(model: nn.Module, names: Sequence[str]) -> None:
    """Refuse a sharded layer walk that does not take every parameter of ``model``."""
    left = [n for n, _ in model.named_parameters() if n not in set(names)]
    if left:
        raise ValueError(
            f"engine='layers' on a sharded model takes every parameter; param_filter left out "
            f"{left[:4]}{' ...' if len(left) > 4 else ''} (their shards would meet whole tensors "
            "in the walk's calls)"
        )


def _owned_slots(
    model: nn.Module, fsdp_cls: type, named: dict[str, torch.Tensor]
) -> dict[int, tuple[list[str], list[tuple[dict[str, Any], str, str]]]]:
    """For each fully_shard'ed module (by id): the names (in ``named``) of its own parameters,
    those of its subtree not under a nested fully_shard'ed module, and their slots ``(the
    module's _parameters, slot name, parameter name)``; a parameter held in two slots is
    gathered once."""
    name_of = {id(p): n for n, p in named.items()}
    out: dict[int, tuple[list[str], list[tuple[dict[str, Any], str, str]]]] = {}
    for unit in model.modules():
        if not isinstance(unit, fsdp_cls):
            continue
        names: list[str] = []
        slots: list[tuple[dict[str, Any], str, str]] = []
        stack = [unit]
        while stack:
            m = stack.pop()
            for slot, p in m._parameters.items():
                if p is None or id(p) not in name_of:
                    continue
                if name_of[id(p)] not in names:
                    names.append(name_of[id(p)])
                slots.append((m._parameters, slot, name_of[id(p)]))
            stack.extend(c for c in m.children() if not isinstance(c, fsdp_cls))
        out[id(unit)] = (names, slots)
    return out


class Pending:
    """A collective in flight (NOTE [prefetched gathers]): ``wait()`` waits for it, once, and
    returns its tensors; ``keep``: what must stay alive until then (a send buffer)."""

    def __init__(
        self, work: Any, result: Callable[[], list[torch.Tensor]], keep: Any = None
    ) -> None:
        self._work: Any = work
        self._result: Callable[[], list[torch.Tensor]] | None = result
        self._keep = keep

    def wait(self) -> list[torch.Tensor]:
        work, result = self._work, self._result
        if result is None:
            raise InternalError("a collective in flight is waited once")
        # the buffers go with the handle's references (what the result views stays alive)
        self._work = self._result = self._keep = None
        if work is not None:
            work.wait()
        return result()


@dataclass
class _Packed:
    """One all-gather's send buffer and how to cut what it receives (``ShardGather._pack``):
    each piece's (shape, slot bytes, numbers in its chunk, numbers a row, dtype)."""

    flat: torch.Tensor
    metas: list[tuple[torch.Size, int, int, int, torch.dtype]]
    wire: torch.dtype
    unit: int


class ShardGather:
    """The gathering and reducing of NOTE [sharded layer walk] for one FSDP2 model: ``gather`` and
    ``finish`` are a :class:`~hessian_eigenthings.operators.engines.layers.LayerWalk`'s arguments
    (and what NOTE [gathered functional product] gathers and reduces with);
    :meth:`walking` is the scope of one chunk's walk."""

    def __init__(
        self, model: nn.Module, fsdp_cls: type, group: Any, dtype: torch.dtype | None = None
    ) -> None:
        """``dtype``: the dtype every gathered tensor and the rank's half buffers are cast to
        during a walk (a half model's float32, NOTE [half models] in ``precision``); ``None``:
        their own."""
        self.model = model
        self.fsdp_cls = fsdp_cls
        self.group = group
        self.dtype = dtype
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self._now: dict[str, torch.Tensor] = {}
        #: where the collectives' small tensors live (NCCL needs them on the GPU)
        self.device = next(iter(model.parameters())).device
        self._scale = 1.0

    def reshard(self) -> None:
        """Every FSDP module back to its shards (FSDP may keep the root whole after a forward)."""
        for m in self.model.modules():
            if isinstance(m, self.fsdp_cls):
                m.reshard()  # type: ignore[operator]

    @contextlib.contextmanager
    def walking(self, scale: float) -> Iterator[None]:
        """One chunk's walk: the shards as the parameters to gather, FSDP's hooks set aside, each
        block of the product scaled by ``scale`` (b_r / B) before it is summed over the ranks."""
        self.reshard()
        self._now, self._scale = dict(self.model.named_parameters()), scale
        try:
            with without_fsdp_hooks(self.model, self.fsdp_cls), self.upcast_buffers():
                yield
        finally:
            self._now = {}

    @contextlib.contextmanager
    def recording(self) -> Iterator[None]:
        """The model's forward in ``dtype`` for the walk's recording (NOTE [recording in the
        product's dtype]): FSDP's hooks set aside, each fully_shard'ed module's own parameters
        gathered whole for its call and put back after it, the rank's half buffers upcast. The
        user's model is as found after (also when the forward raises)."""
        self.reshard()
        self._now = dict(self.model.named_parameters())
        owners = _owned_slots(self.model, self.fsdp_cls, self._now)
        #: by module: the parameters its call swapped out (its slots, the user's parameter)
        swapped: dict[int, list[tuple[dict[str, Any], str, torch.Tensor]]] = {}
        depth: dict[int, int] = {}
        units = [m for m in self.model.modules() if isinstance(m, self.fsdp_cls)]
        inner = {id(m) for u in units for m in u.modules() if m is not u}
        roots = {id(u) for u in units if id(u) not in inner}

        def gather(module: nn.Module, args: Any) -> None:
            depth[id(module)] = depth.get(id(module), 0) + 1
            names, slots = owners[id(module)]
            if id(module) in swapped or not names:  # a call inside its own call, or the root's
                return
            # whole, and requiring grad as the user's parameter does (NOTE above); one tensor
            # for a parameter held in two slots
            whole = {
                n: nn.Parameter(t, requires_grad=self._now[n].requires_grad)
                for n, t in zip(names, self.gather([(n, None) for n in names]), strict=True)
            }
            out = swapped.setdefault(id(module), [])
            for params, slot, name in slots:
                out.append((params, slot, params[slot]))
                params[slot] = whole[name]

        def release(module: nn.Module, args: Any, out: Any) -> None:
            depth[id(module)] -= 1
            # the root's own parameters stay whole until the recording ends, as FSDP keeps
            # them after its forward (a loss may read them after the model's call)
            if depth[id(module)] == 0 and id(module) not in roots:
                for params, slot, p in reversed(swapped.pop(id(module), [])):
                    params[slot] = p

        try:
            with without_fsdp_hooks(self.model, self.fsdp_cls), self.upcast_buffers():
                handles = [
                    h
                    for m in units
                    for h in (
                        m.register_forward_pre_hook(gather, prepend=True),
                        m.register_forward_hook(release),
                    )
                ]
                try:
                    yield
                finally:
                    for h in handles:
                        h.remove()
        finally:
            for left in reversed(list(swapped.values())):  # a call that raised
                for params, slot, p in reversed(left):
                    params[slot] = p
            self._now = {}

    @contextlib.contextmanager
    def upcast_buffers(self) -> Iterator[None]:
        """The rank's half buffers (replicated, not sharded) as ``dtype`` copies for the walk,
        the user's put back after (NOTE [half models] in ``precision``); nothing without
        ``dtype``."""
        swapped: list[tuple[dict[str, Any], str, torch.Tensor]] = []
        try:
            if self.dtype is not None:
                for m in self.model.modules():
                    for name, b in list(m._buffers.items()):
                        if b is not None and b.is_floating_point() and b.dtype != self.dtype:
                            swapped.append((m._buffers, name, b))
                            m._buffers[name] = b.detach().to(self.dtype)
            yield
        finally:
            for slots, name, b in reversed(swapped):
                slots[name] = b

    def agree(self, value: float, op: str) -> float:
        """``value`` reduced over the ranks (``"min"`` or ``"max"``)."""
        t = torch.tensor([value], dtype=torch.float64, device=self.device)
        dist.all_reduce(
            t, op=dist.ReduceOp.MIN if op == "min" else dist.ReduceOp.MAX, group=self.group
        )
        return float(t)

    def _rows(self, shape: torch.Size) -> tuple[list[int], int, int]:
        """Rows of dim 0 each rank holds (FSDP2's ``torch.chunk`` split: chunks of ``c = ceil(d /
        W)`` rows, the last ones shorter or empty), ``c``, and the numbers in one row. Read off the
        shape only: indexing a DTensor would gather it."""
        if len(shape) == 0:
            return [1] + [0] * (self.world - 1), 1, 1
        rows = chunk_rows(shape[0], self.world)
        return rows, max(rows[0], 1), math.prod(shape[1:])

    def gather(self, items: list[tuple[str, torch.Tensor | None]]) -> list[torch.Tensor]:
        """Whole tensors for ``(name, shard)`` pairs (``shard`` None: the parameter itself), all
        in one all-gather: each rank's shards padded to FSDP's chunk of rows and packed. Only
        the last ranks' chunks are short, so rank r's chunk of a tensor lands at rows ``r·c``
        of its padded whole, and the whole is its first ``d`` rows.

        Pieces of one dtype travel as that dtype; pieces of several (a half model's parameter
        blocks beside float32 directions) travel as bytes, each in its own dtype, and a half
        block is cast to ``dtype`` once gathered: exact, with the bytes of its own dtype
        (NOTE [half models] in ``precision``)."""
        return self.gather_async(items).wait()

    def gather_async(self, items: list[tuple[str, torch.Tensor | None]]) -> Pending:
        """:meth:`gather` issued without waiting (NOTE [prefetched gathers]): the same all-gather
        of the same packed shards, read now; ``wait()`` returns what :meth:`gather` returns, bit
        for bit (the same unpacking)."""
        if not items:
            return Pending(None, list)
        packed = self._pack(items)
        parts = packed.flat.new_empty(self.world * packed.flat.numel())
        work = _torch_compat.all_gather_single_async(parts, packed.flat, group=self.group)
        return Pending(work, lambda: self._unpack(packed, parts))

    def _pack(self, items: list[tuple[str, torch.Tensor | None]]) -> _Packed:
        """This rank's pieces of ``items``, each written once into its padded slot of one send
        buffer (the layout :meth:`gather` describes)."""
        locals_, metas = [], []
        for name, shard in items:
            p = self._now[name]
            local = (p.to_local() if shard is None else shard).detach()  # type: ignore[attr-defined]
            locals_.append(local)
            _, chunk, width = self._rows(p.shape)
            # each piece's slot in bytes, a multiple of 8 so that every slot is aligned
            size = -(-chunk * width * local.element_size() // 8) * 8
            metas.append((p.shape, size, chunk * width, width, local.dtype))
        dtypes = {m[4] for m in metas}
        wire = next(iter(dtypes)) if len(dtypes) == 1 else torch.uint8
        unit = 1 if wire == torch.uint8 else torch.empty((), dtype=wire).element_size()
        flat = locals_[0].new_zeros(sum(m[1] for m in metas) // unit, dtype=wire)
        offset = 0
        for local, (_, size, _, _, dtype) in zip(locals_, metas, strict=True):
            slot = flat[offset // unit : (offset + size) // unit]
            slot = slot.view(dtype) if wire == torch.uint8 else slot
            slot[: local.numel()] = local.reshape(-1)
            offset += size
        return _Packed(flat, metas, wire, unit)

    def _unpack(self, packed: _Packed, parts: torch.Tensor) -> list[torch.Tensor]:
        """The whole tensors out of every rank's send buffer, ``parts`` (rank by rank)."""
        unit, wire = packed.unit, packed.wire
        parts = parts.view(self.world, -1)
        whole, offset = [], 0
        for shape, size, numel, width, dtype in packed.metas:
            rows = shape[0] if len(shape) else 1
            slots = parts[:, offset // unit : (offset + size) // unit]
            slots = slots.view(dtype) if wire == torch.uint8 else slots
            block = slots[:, :numel].reshape(-1, width)[:rows].reshape(shape)
            if self.dtype is not None and block.is_floating_point() and block.dtype != self.dtype:
                block = block.to(self.dtype)
            whole.append(block)
            offset += size
        return whole

    def finish(self, items: list[tuple[str, torch.Tensor]]) -> list[torch.Tensor]:
        """This rank's rows of ``Σ_r scale_r · block_r`` for each ``(name, block)``, in one
        reduce-scatter: each block padded to ``W`` chunks of ``c`` rows, the ranks' chunks of all
        blocks packed rank by rank, so that rank r receives its rows of every block."""
        return self.finish_async(items)[1].wait()

    def finish_async(
        self, items: list[tuple[str, torch.Tensor]]
    ) -> tuple[list[torch.Tensor], Pending]:
        """:meth:`finish` issued without waiting (NOTE [prefetched gathers]): this rank's rows of
        each block, written once the handle is waited, and the handle (whose ``wait()`` returns
        them)."""
        if not items:
            return [], Pending(None, list)
        packed, mine, out = self._pack_blocks(items)
        work = _torch_compat.reduce_scatter_single_async(mine, packed.view(-1), group=self.group)
        # the send buffer stays referenced until the reduce-scatter is waited
        return out, Pending(work, lambda: out, keep=packed)

    def _pack_blocks(
        self, items: list[tuple[str, torch.Tensor]]
    ) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
        """The send buffer of :meth:`finish`, its receive buffer, and this rank's rows of each
        block as views of the receive buffer."""
        metas = []
        for _, block in items:
            rows, chunk, width = self._rows(block.shape)
            metas.append((rows[self.rank], chunk * width, width, block.shape))
        # each block scaled once into its padded columns of one (W, Σ c·width) send buffer
        first = items[0][1]
        packed = first.new_zeros(self.world, sum(size for _, size, _, _ in metas))
        offset = 0
        for (_, block), (_, size, _, _) in zip(items, metas, strict=True):
            # rank r's rows are the block's r-th run of `size` numbers; only the last runs are short
            values, slots = block.reshape(-1), packed[:, offset : offset + size]
            full, rest = divmod(values.numel(), size)
            torch.mul(values[: full * size].view(full, size), self._scale, out=slots[:full])
            if rest:
                torch.mul(values[full * size :], self._scale, out=slots[full, :rest])
            offset += size
        mine = packed.new_empty(packed.shape[1])
        out, offset = [], 0
        for held, size, width, shape in metas:
            out.append(mine[offset : offset + held * width].view(held, *shape[1:]))
            offset += size
        return packed, mine, out
