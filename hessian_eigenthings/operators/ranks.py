"""Ranks: the processes one operator's products span, a collaborator of the data loop.

A data operator is given its ranks as it is given its runner (DESIGN §8). The data loop asks
them, at fixed points of a pass: which chunks this rank runs (:meth:`Ranks.chunks`), how a
chunk's product is taken (:meth:`Ranks.chunk_product`), what scope a pass runs in
(:meth:`Ranks.product_pass`), where the output lives (:meth:`Ranks.output`) and how a product
finishes (:meth:`Ranks.finish`); the operator asks them how vectors are reduced
(:meth:`Ranks.backend`). Three values of the protocol:

- :data:`LOCAL` (:class:`Ranks` itself): one process; a product finishes with its weighting.
- :class:`Replicated`: the model on every rank, the data split (DDP); a product finishes with
  one all-reduce (``operators.replicated``).
- ``sharded.Sharded``: the parameters sharded with FSDP2, vectors sharded the same way; a
  chunk's product arrives reduced onto the shards (``operators.sharded``).

Every status or count exchange that makes a failing rank raise on all of them is
:meth:`RankGroup.agree` (NOTE [rank agreement]).
"""

from __future__ import annotations

import contextlib
import functools
import math
import zlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Literal, Protocol

import torch
import torch.distributed as dist
from torch import nn

from hessian_eigenthings._checks import InternalError
from hessian_eigenthings.batching import Batch
from hessian_eigenthings.linalg import LinAlgBackend, default_backend
from hessian_eigenthings.linalg_distributed import resolve_process_group
from hessian_eigenthings.operators.cuda_graphs import Product

__all__ = [
    "FACTOR_PLACEMENTS",
    "LOCAL",
    "DistributedProductError",
    "FactorPlacement",
    "RankGroup",
    "Ranks",
    "Replicated",
    "is_dtensor",
    "layout_signature",
    "local_shard",
]


class DistributedProductError(RuntimeError):
    """Raised on every rank that did not fail itself when some rank failed
    during a collective step (construction or a product); ``ranks`` lists them.
    The failed ranks raise their own exception."""

    def __init__(self, ranks: Sequence[int], world_size: int, what: str) -> None:
        self.ranks = tuple(ranks)
        names = ", ".join(str(r) for r in self.ranks)
        super().__init__(
            f"rank {names} of {world_size} raised during {what}; see that rank's traceback. "
            "This rank stops too, so that no rank waits forever in a collective."
        )


# NOTE [rank agreement]
# A rank that raises alone leaves the others waiting forever in the next
# collective. So each collective step is preceded by an agreement: every rank
# sends its row [failed, values...] (an all-reduce of a table that is zero
# outside its row: an all-gather on every backend, exact for flags and counts),
# and when any row is flagged every rank raises: the failed rank its own
# exception (annotated with its rank), the others DistributedProductError
# naming them. A span of agreements (`RankGroup.meetings`: a factor pass) also
# catches a failure between two of them and brings it to the next one,
# flagged, unless an agreement already raised it everywhere or the span's last
# agreement is behind (`agree(..., last=True)`).


class RankGroup:
    """A process group and its agreements (NOTE [rank agreement])."""

    def __init__(self, process_group: Any, device: torch.device) -> None:
        self.group = resolve_process_group(process_group)
        self.rank = dist.get_rank(self.group)
        self.world_size = dist.get_world_size(self.group)
        #: where the agreements' small tensors live (NCCL needs them on the GPU)
        self.device = device
        self._settled = True

    def exchange(self, row: Sequence[float]) -> torch.Tensor:
        """Every rank's ``row``, as a ``(W, len(row))`` float64 table on the host."""
        table = torch.zeros(self.world_size, len(row), dtype=torch.float64, device=self.device)
        table[self.rank] = torch.tensor(row, dtype=torch.float64)
        dist.all_reduce(table, group=self.group)
        return table.cpu()

    def agree(
        self, failure: BaseException | None, *values: float, what: str, last: bool = False
    ) -> torch.Tensor:
        """Every rank's ``values`` as a ``(W, len(values))`` table, after raising on every rank
        when one of them brought a ``failure``. ``last``: the last agreement of a span of
        :meth:`meetings` (a failure after it joins none)."""
        table = self.exchange([float(failure is not None), *map(float, values)])
        failed = [r for r in range(self.world_size) if table[r, 0] > 0]
        if failed or last:
            self._settled = True
        self.raise_failed(failed, failure, what)
        return table[:, 1:]

    def raise_failed(self, failed: Sequence[int], own: BaseException | None, what: str) -> None:
        """Raise on every rank when any rank failed: the failed rank its own
        exception (annotated with its rank), the others :class:`DistributedProductError`."""
        if own is not None:
            note = f"[hessian_eigenthings] raised on rank {self.rank} of {self.world_size} during {what}"
            if hasattr(own, "add_note"):  # Python >= 3.11
                own.add_note(note)
            raise own
        if failed:
            raise DistributedProductError(failed, self.world_size, what)

    @contextlib.contextmanager
    def meetings(self, what: str, width: int = 1) -> Iterator[None]:
        """A span of agreements of ``width`` values each: a rank failing between two of them
        joins the next one flagged, so that every rank raises."""
        self._settled = False
        try:
            yield
        except Exception as exc:
            if not self._settled:
                self._settled = True
                self.agree(exc, *([0.0] * width), what=what)
            raise

    def refuse(self, message: str) -> None:
        """Raise ``ValueError(message)``: every rank found the same thing at an agreement."""
        self._settled = True
        raise ValueError(message)

    def check_layout(
        self, failure: BaseException | None, signature: tuple[int, int, int], what: str
    ) -> None:
        """Every rank built an operator over the same parameters (count, tensors, names and shapes)."""
        table = self.agree(failure, *signature, what=what)
        rows = [tuple(int(x) for x in table[r]) for r in range(self.world_size)]
        if len(set(rows)) > 1:
            detail = "; ".join(
                f"rank {r}: {row[0]} parameters in {row[1]} tensors" for r, row in enumerate(rows)
            )
            raise ValueError(
                f"the ranks selected different parameters ({detail}; names/shapes checksum "
                f"{[row[2] for row in rows]}). Every rank must build the operator over the same model "
                "with the same param_filter."
            )


def layout_signature(
    names: Sequence[str], shapes: Sequence[Sequence[int]], dtype: torch.dtype
) -> tuple[int, int, int]:
    """Numbers, tensors and a checksum of the names and shapes: the same on every rank."""
    numel = sum(math.prod(s) for s in shapes)
    # crc32, not hash(): Python randomizes str hashes per process
    crc = zlib.crc32(repr((list(names), [tuple(s) for s in shapes], str(dtype))).encode())
    return numel, len(names), crc


def first_device(model: Any) -> torch.device:
    """Where the collectives' small tensors live (the model's device: NCCL needs CUDA).
    Never raises: a bad model must fail inside the constructor, after the ranks agreed."""
    if isinstance(model, nn.Module):
        for p in model.parameters():
            return p.device
    return torch.device("cpu")


@functools.lru_cache(maxsize=1)
def _dtensor_type() -> type | None:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch < 2.5 kept it private
        try:
            from torch.distributed._tensor import DTensor  # type: ignore[attr-defined]
        except ImportError:
            return None
    return DTensor


def is_dtensor(t: torch.Tensor) -> bool:
    cls = _dtensor_type()
    return cls is not None and isinstance(t, cls)


def local_shard(p: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor parameter: a view sharing its storage."""
    return p.to_local() if is_dtensor(p) else p  # type: ignore[attr-defined]


#: where a distributed Kronecker operator keeps its factors: every module's on every rank, or
#: each module's on one rank (NOTE [Kronecker factors by module] in ``operators.factor_owners``)
FactorPlacement = Literal["replicated", "by_module"]
FACTOR_PLACEMENTS: tuple[FactorPlacement, ...] = ("replicated", "by_module")


def check_factor_placement(value: object) -> FactorPlacement:
    """``value`` if it is a :data:`FactorPlacement`, else one clear ``ValueError``."""
    if value not in FACTOR_PLACEMENTS:
        raise ValueError(
            f"factor_placement must be 'replicated' (every module's factors on every rank) or "
            f"'by_module' (each module's factors on one rank), got {value!r}"
        )
    return value


def global_rank(group: Any, rank: int) -> int:
    """The default group's number of ``rank`` of ``group`` (what ``dist.reduce``'s ``dst``,
    ``dist.broadcast``'s ``src``, ``gather`` and ``scatter`` take)."""
    if group is None or group is dist.GroupMember.WORLD:
        return rank
    return int(dist.get_global_rank(group, rank))


class ModuleBlocks(Protocol):
    """A Kronecker operator's blocks one module's blocks at a time: on sharded vectors
    (``operators.sharded_kronecker``), or with each module's factors on one rank
    (``operators.factor_owners``): what ``KroneckerOperator`` calls in place of its own
    products, decompositions and eigenvectors when its ranks hold them."""

    #: each module's factors on one rank: the whole-operator reductions (``total``,
    #: ``eigenvalues``) replace the operator's own, and ``eigen`` is refused
    by_module: bool

    def apply(
        self, V: torch.Tensor, fn: Callable[[Any, torch.Tensor], torch.Tensor]
    ) -> torch.Tensor:
        """``fn(module's operator, whole rows of V)`` per module, this rank's rows of the result."""
        ...

    def eigen(self) -> list[Any]:
        """The modules' eigendecompositions, block after block."""
        ...

    def eigenvector(self, block: int, i: int, j: int) -> torch.Tensor:
        """This rank's shard of an eigenvector of block ``block``."""
        ...

    def total(self, fn: Callable[[Any], torch.Tensor]) -> torch.Tensor:
        """``Σ fn(module's operator)`` over the modules (0-dim), the same on every rank."""
        ...

    def eigenvalues(self) -> list[torch.Tensor]:
        """Each block's undamped eigenvalues ``(m, q)``, block after block, on every rank."""
        ...


class Ranks:
    """One process (:data:`LOCAL`), and the protocol the data loop calls.

    Subclasses span several processes (:class:`Replicated`, ``sharded.Sharded``); what the
    data loop and the Kronecker operators call is defined here, with its meaning on one rank.
    """

    rank = 0
    world_size = 1
    group: Any = None
    #: more than one process: the data loop calls the hooks of one product (on one process it
    #: runs their local meaning itself, NOTE [one process, no ranks module] in ``base``)
    distributed = False
    #: CUDA-graph recording and ``engine="auto"``'s timing trials (ranks running the same
    #: engine would have to agree on both: distributed products are eager, engine= explicit)
    records_graphs = True
    auto_trials = True
    #: whether products may keep per-batch states between products (NOTE [graph reuse])
    keeps_states = True
    #: a Kronecker operator's blocks module by module (``None``: vectors whole on each rank and
    #: every factor on it)
    module_blocks: ModuleBlocks | None = None
    #: where a Kronecker operator's factors live (one process: all of them here)
    factor_placement: FactorPlacement = "replicated"
    #: the ranks gather the parameters block by block (FSDP2) and cast a half model's blocks as
    #: they are gathered: the operator swaps no float32 copy into the modules (NOTE [half models])
    gathers_parameters = False

    # -- construction ---------------------------------------------------------------
    def constructed(self, op: Any, failure: BaseException | None) -> None:
        """The end of ``op``'s construction (``failure``: what it raised): the ranks finish
        setting it up and agree that each built it over the same parameters, or raise together."""
        if failure is not None:
            raise failure

    def check_model(self, model: nn.Module, who: str) -> None:
        """Refuse a model these ranks cannot run (called first in the base constructor)."""

    def backend(self, backend: LinAlgBackend | None) -> LinAlgBackend:
        """The vector arithmetic the algorithms use on this operator's vectors."""
        return default_backend(backend)

    # -- one product ----------------------------------------------------------------
    def output(self, V: torch.Tensor, one_pass: bool) -> torch.Tensor:
        """The flat output buffer of the block ``V`` (``one_pass``: a single pass fills it)."""
        return torch.empty_like(V, memory_format=torch.contiguous_format)

    def product_pass(
        self, V: torch.Tensor, out: torch.Tensor
    ) -> contextlib.AbstractContextManager[None]:
        """The scope of one pass over the data for the rows ``V``, written into ``out``."""
        return contextlib.nullcontext()

    def chunks(
        self, chunks: Iterator[tuple[Batch, Batch]], weigh: Callable[[Batch, Batch], float]
    ) -> Iterator[tuple[Batch, Batch]]:
        """``(batch, chunk)`` of the chunks this rank runs in a pass without kept states
        (``weigh(batch, chunk)``: a chunk's weight)."""
        return chunks

    def chunk_product(
        self,
        chunk: Batch,
        vecs: list[torch.Tensor],
        product: Callable[[Batch, list[torch.Tensor]], Product],
        weigh: Callable[[], float],
    ) -> tuple[Product, float]:
        """A chunk's product (``product(chunk, vecs)``) and its weight (``weigh()``)."""
        return product(chunk, vecs), weigh()

    def finish(
        self,
        out: torch.Tensor,
        count: int,
        total: float,
        check: Callable[[int, float], None],
    ) -> None:
        """Normalize the pass's weighted sum. ``out`` holds ``P₁`` when ``count == 1``, else
        ``Σ wᵢ·Pᵢ``; ``total = Σ wᵢ``. ``check(count, total)`` raises when nothing counted."""
        check(count, total)
        if count > 1:
            out.mul_(1.0 / total)

    # -- Kronecker factors (NOTE [factor weights applied late] in kfac) --------------
    def start_factor_pass(self, factor_pass: Any) -> None:
        """Set up a factor pass before it runs (its Monte-Carlo key, its batches)."""

    def factor_pass(self, run: Callable[[], Any]) -> Any:
        """``run()``: a factor pass and the sums made from it."""
        return run()

    @property
    def sums_factors(self) -> bool:
        """Whether factor sums are summed over the ranks before they are divided."""
        return False

    def sum_factors(
        self, sums: list[torch.Tensor], total: float, owners: Sequence[int] | None = None
    ) -> float:
        """Sum ``sums`` (in place) and ``total`` over the ranks; the summed total. ``owners``:
        the rank of each sum (factors by module): it alone receives the sum, the other ranks'
        copies are left undefined (to be freed)."""
        return total

    def __repr__(self) -> str:
        return "LOCAL"


#: one process
LOCAL = Ranks()


class Replicated(Ranks):
    """The model on every rank, each rank its own shard of the data (DDP); see
    ``operators.replicated`` for the product's one all-reduce (NOTE [replicated product])."""

    records_graphs = False
    auto_trials = False
    distributed = True

    def __init__(
        self,
        process_group: Any = None,
        device: torch.device | None = None,
        *,
        factor_placement: FactorPlacement = "replicated",
    ) -> None:
        #: where a Kronecker operator given these ranks keeps its factors (NOTE [Kronecker
        #: factors by module] in ``operators.factor_owners``)
        self.factor_placement = check_factor_placement(factor_placement)
        self.agreement = RankGroup(process_group, device or torch.device("cpu"))
        self.group = self.agreement.group
        self.rank = self.agreement.rank
        self.world_size = self.agreement.world_size
        #: the flat buffer behind the output of a one-pass product (see ``output``)
        self._flat: torch.Tensor | None = None
        self._reduced = False

    def constructed(self, op: Any, failure: BaseException | None) -> None:
        signature = (0, 0, 0)
        if failure is None:
            try:
                layout = getattr(op, "global_layout", None) or op.layout
                signature = layout_signature(layout.names, layout.shapes, op.dtype)
            except Exception as exc:
                failure = exc
        # a rank that failed still joins, so that the others raise instead of waiting
        self.agreement.check_layout(failure, signature, f"construction of {type(op).__name__}")

    def check_model(self, model: nn.Module, who: str) -> None:
        if isinstance(model, nn.Module) and any(is_dtensor(p) for p in model.parameters()):
            raise TypeError(
                f"the model's parameters are sharded (FSDP2 / DTensor); {who} needs a "
                "replicated model: use FSDPHessianOperator for sharded models"
            )

    def output(self, V: torch.Tensor, one_pass: bool) -> torch.Tensor:
        if not one_pass:  # several passes: each reduces through a packed copy
            return super().output(V, one_pass)
        # room for the count and the flags behind the output, so that the all-reduce runs in
        # place on the output buffer
        k, n = V.shape
        flat = torch.empty(k * n + 1 + self.world_size, dtype=V.dtype, device=V.device)
        self._flat = flat
        return flat[: k * n].view(k, n)

    def product_pass(
        self, V: torch.Tensor, out: torch.Tensor
    ) -> contextlib.AbstractContextManager[None]:
        return self._joined(out)

    @contextlib.contextmanager
    def _joined(self, out: torch.Tensor) -> Iterator[None]:
        """A pass that fails before its all-reduce joins the other ranks' all-reduce, flagged."""
        self._reduced = False
        try:
            yield
        except Exception as exc:
            if self._reduced:
                raise
            # join the all-reduce the other ranks wait in, flagged; raises on every rank
            self._reduce(out, 0, 0.0, exc)
            raise
        finally:
            if self._flat is not None and self._flat.data_ptr() == out.data_ptr():
                self._flat = None

    def finish(
        self,
        out: torch.Tensor,
        count: int,
        total: float,
        check: Callable[[int, float], None],
    ) -> None:
        total, summed = self._reduce(out, count, total, None)
        check(int(total > 0), total)
        if summed is out:
            out.mul_(1.0 / total)
        else:
            torch.mul(summed, 1.0 / total, out=out)

    # NOTE [replicated product]: see the module docstring of ``operators.replicated``
    def _reduce(
        self, out: torch.Tensor, count: int, total: float, failure: BaseException | None
    ) -> tuple[float, torch.Tensor]:
        """``Σ_r S_r`` in one all-reduce (in ``out``, or in the packed copy returned), and
        ``Σ_r B_r``; raise everywhere if a rank failed."""
        self._reduced = True
        agreement, world = self.agreement, self.world_size
        m = out.numel()
        if failure is None and count == 1:
            out.mul_(float(total))  # P₁ → b₁·P₁, so that ranks add up as Σ b·P
        if out.dtype not in (torch.float32, torch.float64):
            # 16-bit dtypes cannot hold sample counts exactly: counts first, in float64
            table = agreement.agree(failure, total, what="a product")
            dist.all_reduce(out, group=self.group)
            return float(table[:, 0].sum()), out
        flat = self._flat
        in_place = (
            flat is not None and flat.data_ptr() == out.data_ptr() and flat.numel() == m + 1 + world
        )
        if in_place:
            if flat is None:
                raise InternalError("flat is not None")
            buf = flat
        else:
            buf = torch.empty(m + 1 + world, dtype=out.dtype, device=out.device)
            buf[:m].copy_(out.reshape(-1))
        tail = torch.zeros(1 + world, dtype=torch.float64)
        tail[0] = float(total)
        if failure is not None:
            tail[1 + self.rank] = 1.0
        buf[m:].copy_(tail)
        dist.all_reduce(buf, group=self.group)
        status = buf[m:].cpu()  # the one host sync of a product
        failed = [r for r in range(world) if status[1 + r] > 0]
        agreement.raise_failed(failed, failure, "a product")
        return float(status[0]), (out if in_place else buf[:m].view_as(out))

    # -- Kronecker factors: each rank's batches, the sums over the ranks ------------
    def start_factor_pass(self, factor_pass: Any) -> None:
        factor_pass.rank = self.rank  # Monte-Carlo draws keyed by rank

    def factor_pass(self, run: Callable[[], Any]) -> Any:
        with self.agreement.meetings("a factor pass"):
            return run()

    @property
    def sums_factors(self) -> bool:
        return True

    def sum_factors(
        self, sums: list[torch.Tensor], total: float, owners: Sequence[int] | None = None
    ) -> float:
        table = self.agreement.agree(None, total, what="a factor pass", last=True)
        if owners is None:
            self._reduce_onto(sums, None)
        else:  # NOTE [Kronecker factors by module]: each sum onto its owner, one reduce per rank
            for r in range(self.world_size):
                self._reduce_onto([t for t, o in zip(sums, owners, strict=True) if o == r], r)
        return float(table[:, 0].sum())

    def _reduce_onto(self, sums: list[torch.Tensor], owner: int | None) -> None:
        """``sums`` summed over the ranks, packed in one buffer: on every rank (``owner=None``:
        an all-reduce) or on ``owner`` alone (a reduce)."""
        if not sums:
            return
        flat = torch.cat([t.reshape(-1) for t in sums])
        if owner is None:
            dist.all_reduce(flat, group=self.group)
        else:
            dist.reduce(flat, global_rank(self.group, owner), group=self.group)
            if owner != self.rank:
                return
        offset = 0
        for t in sums:
            t.copy_(flat[offset : offset + t.numel()].view_as(t))
            offset += t.numel()

    def __repr__(self) -> str:
        placed = (
            f", factor_placement={self.factor_placement!r}"
            if self.factor_placement != "replicated"
            else ""
        )
        return f"Replicated(rank={self.rank}, world_size={self.world_size}{placed})"


def unwrap_replica(model: Any, process_group: Any) -> tuple[Any, Any]:
    """A ``DistributedDataParallel`` wrapper unwrapped (NOTE [DDP wrapper] in
    ``operators.replicated``), its group the default ``process_group``."""
    from torch.nn.parallel import DistributedDataParallel

    if isinstance(model, DistributedDataParallel):
        if process_group is None:
            process_group = getattr(model, "process_group", None)
        model = model.module
    return model, process_group


def replicated(
    model: Any, process_group: Any = None, factor_placement: FactorPlacement = "replicated"
) -> tuple[Any, Replicated]:
    """A replicated model (unwrapped) and its ranks."""
    model, process_group = unwrap_replica(model, process_group)
    return model, Replicated(process_group, first_device(model), factor_placement=factor_placement)
