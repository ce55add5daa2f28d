"""Curvature products with the data (DDP) or the parameters (FSDP) split across ranks.

A data operator is distributed by being given ranks (``operators.ranks``, DESIGN §8): which
chunks a rank runs, how a product finishes, how vectors are laid out and reduced, and one
agreement for every status exchange. This module is the public surface of the distributed
forms; the mechanisms live beside it, one module each:

- ``operators.ranks``: the protocol (:class:`Ranks`, one process), the agreement between ranks
  (:class:`RankGroup`, NOTE [rank agreement]) and :class:`Replicated` ranks;
- ``operators.replicated``: the data split across ranks, the model replicated (the ``DDP*``
  constructors; one all-reduce per product, NOTE [replicated product]);
- ``operators.sharded``: parameters sharded with FSDP2, vectors sharded (the ``FSDP*`` data
  operators; the sharded layer walk and central differences, NOTE [sharded vector layout]);
- ``operators.sharded_kronecker``: Kronecker factors of an FSDP2 model (NOTE [sharded Kronecker
  factors]);
- ``operators.factor_owners``: Kronecker factors placed by module, each module's on one rank
  (``factor_placement="by_module"``, NOTE [Kronecker factors by module]).
"""

from __future__ import annotations

from hessian_eigenthings.linalg_distributed import DistributedBackend, is_main_process
from hessian_eigenthings.operators.ranks import (
    LOCAL,
    DistributedProductError,
    RankGroup,
    Ranks,
    Replicated,
    layout_signature,
    local_shard,
)
from hessian_eigenthings.operators.replicated import (
    DataParallelMixin,
    DDPEKFACOperator,
    DDPEmpiricalFisherOperator,
    DDPGGNOperator,
    DDPHessianOperator,
    DDPKFACOperator,
    DDPKFOCOperator,
    KroneckerDataParallelMixin,
)
from hessian_eigenthings.operators.sharded import (
    FSDPEmpiricalFisherOperator,
    FSDPGGNOperator,
    FSDPHessianOperator,
    Sharded,
    ShardedMixin,
)
from hessian_eigenthings.operators.sharded_kronecker import (
    FSDPEKFACOperator,
    FSDPKFACOperator,
    FSDPKFOCOperator,
    ShardedFactors,
    ShardedKroneckerMixin,
)

__all__ = [
    "LOCAL",
    "DDPEKFACOperator",
    "DDPEmpiricalFisherOperator",
    "DDPGGNOperator",
    "DDPHessianOperator",
    "DDPKFACOperator",
    "DDPKFOCOperator",
    "DataParallelMixin",
    "DistributedBackend",
    "DistributedProductError",
    "FSDPEKFACOperator",
    "FSDPEmpiricalFisherOperator",
    "FSDPGGNOperator",
    "FSDPHessianOperator",
    "FSDPKFACOperator",
    "FSDPKFOCOperator",
    "KroneckerDataParallelMixin",
    "RankGroup",
    "Ranks",
    "Replicated",
    "Sharded",
    "ShardedFactors",
    "ShardedKroneckerMixin",
    "ShardedMixin",
    "is_main_process",
    "layout_signature",
]

# the public path (DESIGN §2): documented, pickled and named under this module
for _cls in (
    DataParallelMixin,
    DDPEKFACOperator,
    DDPEmpiricalFisherOperator,
    DDPGGNOperator,
    DDPHessianOperator,
    DDPKFACOperator,
    DDPKFOCOperator,
    DistributedProductError,
    FSDPEKFACOperator,
    FSDPEmpiricalFisherOperator,
    FSDPGGNOperator,
    FSDPHessianOperator,
    FSDPKFACOperator,
    FSDPKFOCOperator,
    KroneckerDataParallelMixin,
    ShardedKroneckerMixin,
    ShardedMixin,
):
    _cls.__module__ = __name__
del _cls

#: a parameter's local shard (the name the test workers of ``tests/operators`` read it by)
_local = local_shard
