"""Curvature products with the data split across ranks and the model replicated (DDP).

Every rank holds the whole model and its own shard of the data, of any size. An operator given
:class:`~hessian_eigenthings.operators.ranks.Replicated` ranks runs the ordinary data loop over
its chunks ``i`` on rank ``r`` and gets ``S_r = Σ_i b_ri·P_ri`` and ``B_r = Σ_i b_ri``; the
product is

    C v = (Σ_r S_r) / (Σ_r B_r),

the single-process product over the union of the ranks' batches weighted by batch size,
whatever the shard sizes. NOTE [replicated product]: one all-reduce per product carries
``[S_r (k·n) | B_r | f_0 … f_{W-1}]`` in the operator's flat output buffer (``ranks.output``
leaves room behind the output), where ``f_r`` = 1 when rank ``r`` failed; every rank reads the
``1 + W`` trailing numbers (one host sync per product, the price of raising instead of hanging)
and raises together, naming the failed ranks. 16-bit dtypes cannot hold sample counts exactly,
so there the counts and flags go in a tiny float64 all-reduce first and the data follows in a
second one. Cost per product: the local product on ``1/W`` of the data, plus one all-reduce of
``k·n + 1 + W`` elements (a ring sends about ``2·k·n`` elements per rank) and, when a rank runs
a single chunk, one extra scaling of the output by ``b``. Vectors are replicated: every rank
passes the same ``v`` and gets the same ``C v``, bit for bit.

Any data operator runs so when given ``ranks=Replicated(group)``; the ``DDP*`` classes here are
constructors that build those ranks (unwrapping a ``DistributedDataParallel`` model). The
Kronecker operators take the same ranks: each rank's factor passes over its own batches, the
factor sums summed over the ranks (``Replicated.sum_factors``), the factors on every rank or,
with ``factor_placement="by_module"``, each module's on one rank (NOTE [Kronecker factors by
module] in ``operators.factor_owners``).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from hessian_eigenthings.operators.base import DataCurvatureOperator
from hessian_eigenthings.operators.fisher import EmpiricalFisherOperator
from hessian_eigenthings.operators.ggn import GGNOperator
from hessian_eigenthings.operators.hessian import HessianOperator
from hessian_eigenthings.operators.kfac import EKFACOperator, KFACOperator
from hessian_eigenthings.operators.kfoc import KFOCOperator
from hessian_eigenthings.operators.ranks import FactorPlacement, Replicated, replicated

__all__ = [
    "DDPEKFACOperator",
    "DDPEmpiricalFisherOperator",
    "DDPGGNOperator",
    "DDPHessianOperator",
    "DDPKFACOperator",
    "DDPKFOCOperator",
    "DataParallelMixin",
    "KroneckerDataParallelMixin",
    "Replicated",
]

# NOTE [DDP wrapper]
# A model wrapped in DistributedDataParallel is unwrapped to `model.module`,
# and `loss_fn` receives the inner module. Products through the wrapper would
# work too (checked on torch 2.13 and 2.15: `autograd.grad` runs no AccumulateGrad
# node, so DDP's gradient hooks never fire, and no "reduction not finished"
# error follows), but every wrapper forward broadcasts buffers from rank 0
# and prepares the reducer: a collective per forward that deadlocks as soon
# as ranks run different numbers of batches, and per-forward overhead
# (plus a C++ warning with find_unused_parameters=True). Our one all-reduce
# per product is all the communication a product needs.


class DataParallelMixin(DataCurvatureOperator):
    """The data-parallel constructor of a data-driven curvature operator.

    ``class DDPMyOperator(DataParallelMixin, MyOperator): pass`` takes ``MyOperator``'s
    arguments plus ``process_group`` (default: the DDP wrapper's group, else the default group)
    and builds ``MyOperator`` given :class:`Replicated` ranks: the same as
    ``MyOperator(model, ..., ranks=Replicated(process_group))``. Each rank passes its own
    dataloader shard; products equal the single-process product over the union of the shards,
    weighted by batch size, and are identical on every rank. Vectors are replicated, so the
    backend stays the single-device one.
    """

    def __init__(
        self, model: nn.Module, *args: Any, process_group: Any = None, **kwargs: Any
    ) -> None:
        model, self.ranks = replicated(model, process_group)
        super().__init__(model, *args, ranks=self.ranks, **kwargs)


class DDPHessianOperator(DataParallelMixin, HessianOperator):
    """:class:`HessianOperator` with the data split across ranks.

    ``DDPHessianOperator(model, dataloader, loss_fn, *, ..., process_group=None)``:
    the arguments of :class:`HessianOperator` plus ``process_group``.
    ``model`` may be wrapped in ``DistributedDataParallel`` (see NOTE [DDP wrapper]);
    ``dataloader`` is this rank's shard (e.g. a ``DistributedSampler``, shards
    of any size). Both methods work; graph reuse and blocks work per rank.
    """


class DDPGGNOperator(DataParallelMixin, GGNOperator):
    """:class:`GGNOperator` with the data split across ranks: its arguments plus
    ``process_group``. See :class:`DDPHessianOperator`."""


class DDPEmpiricalFisherOperator(DataParallelMixin, EmpiricalFisherOperator):
    """:class:`EmpiricalFisherOperator` with the data split across ranks: its
    arguments plus ``process_group``; ``(1/N) Σ gᵢgᵢᵀ`` over the samples of
    every rank. See :class:`DDPHessianOperator`."""


class KroneckerDataParallelMixin:
    """The data-parallel constructor of a KFAC-family operator: each rank runs the factor
    passes over its own batches (of any size and number) and the factors' sums and sample
    counts are summed over the ranks (one status agreement and one all-reduce per pass), so
    every rank holds the factors of the union of the batches. ``class DDPMyKFAC(
    KroneckerDataParallelMixin, MyKFAC)`` takes ``MyKFAC``'s arguments plus ``process_group``
    and ``factor_placement`` (``MyKFAC(..., ranks=Replicated(process_group,
    factor_placement=...))``); the model is replicated (a ``DistributedDataParallel`` wrapper is
    unwrapped). Monte-Carlo draws are keyed by rank. Vectors are replicated: every rank passes
    the same ``v`` and gets the same ``op @ v``.

    ``factor_placement``: ``"replicated"`` (default): every rank holds every module's ``G``, ``A``
    and, once used, their eigendecompositions, and every method runs locally after construction.
    ``"by_module"``: each module's factors are reduced onto one owner rank
    (``op.factor_owners``, balanced by factor size), which alone keeps and decomposes them, so
    factor memory and eigendecomposition time per rank fall by about the number of ranks.
    Products, ``inverse(damping)`` products, ``trace``, ``logdet``, ``frobenius_norm``,
    ``eigenvalues()`` and ``eigenvector(block, i, j)`` then work on every rank together (one
    all-reduce each: every rank must call them, in the same order); ``eigh()``, ``factors`` and
    EKFAC's ``corrected_eigenvalues`` are refused (they would gather every module's tensors on
    each rank), ``owned_factors`` gives this rank's. NOTE [Kronecker factors by module] in
    ``operators.factor_owners`` says what each pass costs.
    """

    def __init__(
        self,
        model: nn.Module,
        *args: Any,
        process_group: Any = None,
        factor_placement: FactorPlacement = "replicated",
        **kwargs: Any,
    ) -> None:
        model, ranks = replicated(model, process_group, factor_placement)
        super().__init__(model, *args, ranks=ranks, **kwargs)  # type: ignore[call-arg]


class DDPKFACOperator(KroneckerDataParallelMixin, KFACOperator):
    """:class:`KFACOperator` with the data split across ranks: its arguments plus
    ``process_group`` and ``factor_placement``; the factors of the union of the ranks' batches on every rank. See
    :class:`KroneckerDataParallelMixin`."""


class DDPEKFACOperator(KroneckerDataParallelMixin, EKFACOperator):
    """:class:`EKFACOperator` with the data split across ranks (both passes summed over the
    ranks; by module, the second pass holds every module's eigenbases on every rank while it
    runs). See :class:`KroneckerDataParallelMixin`."""


class DDPKFOCOperator(KroneckerDataParallelMixin, KFOCOperator):
    """:class:`KFOCOperator` with the data split across ranks: its arguments plus
    ``process_group`` and ``factor_placement``; every pass of the power iteration summed over the
    ranks (one all-reduce each), so every rank iterates on the union's sums and stops at the
    same iteration. See :class:`KroneckerDataParallelMixin`."""
