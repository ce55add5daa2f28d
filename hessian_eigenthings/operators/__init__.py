"""Curvature operators: Hessian, generalized Gauss-Newton, empirical Fisher, Kronecker-factored
(KFAC, EKFAC, KFOC), and their algebra."""

from hessian_eigenthings.loss_fns.protocols import ForwardFn, LossOfOutputFn, PerSampleLossFn
from hessian_eigenthings.operators import registry
from hessian_eigenthings.operators.algebra import (
    LinearCombinationOperator,
    RectangularSubmatrix,
    SubmatrixOperator,
)
from hessian_eigenthings.operators.base import (
    CurvatureOperator,
    DataCurvatureOperator,
    LambdaOperator,
    RandomForwardWarning,
)
from hessian_eigenthings.operators.distributed import (
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
)
from hessian_eigenthings.operators.engines import (
    CompileFallbackWarning,
    EngineMismatchWarning,
    EngineUnsupportedError,
)
from hessian_eigenthings.operators.fisher import EmpiricalFisherOperator
from hessian_eigenthings.operators.ggn import GGNOperator
from hessian_eigenthings.operators.hessian import HessianOperator, HvpMethod, LossFn
from hessian_eigenthings.operators.jacobian import JacobianOperator, TransposedJacobianOperator
from hessian_eigenthings.operators.kfac import EKFACOperator, KFACOperator
from hessian_eigenthings.operators.kfoc import KFOCOperator
from hessian_eigenthings.operators.kronecker import (
    KroneckerBlock,
    KroneckerEigen,
    KroneckerEigenBlock,
    KroneckerOperator,
)

__all__ = [
    "CompileFallbackWarning",
    "CurvatureOperator",
    "DDPEKFACOperator",
    "DDPEmpiricalFisherOperator",
    "DDPGGNOperator",
    "DDPHessianOperator",
    "DDPKFACOperator",
    "DDPKFOCOperator",
    "DataCurvatureOperator",
    "DataParallelMixin",
    "DistributedProductError",
    "EKFACOperator",
    "EmpiricalFisherOperator",
    "EngineMismatchWarning",
    "EngineUnsupportedError",
    "FSDPEKFACOperator",
    "FSDPEmpiricalFisherOperator",
    "FSDPGGNOperator",
    "FSDPHessianOperator",
    "FSDPKFACOperator",
    "FSDPKFOCOperator",
    "ForwardFn",
    "GGNOperator",
    "HessianOperator",
    "HvpMethod",
    "JacobianOperator",
    "KFACOperator",
    "KFOCOperator",
    "KroneckerBlock",
    "KroneckerDataParallelMixin",
    "KroneckerEigen",
    "KroneckerEigenBlock",
    "KroneckerOperator",
    "LambdaOperator",
    "LinearCombinationOperator",
    "LossFn",
    "LossOfOutputFn",
    "PerSampleLossFn",
    "RandomForwardWarning",
    "RectangularSubmatrix",
    "ShardedKroneckerMixin",
    "ShardedMixin",
    "SubmatrixOperator",
    "TransposedJacobianOperator",
]
# every registry row's classes, also those not imported above (NOTE [exports from the registry])
registry.export_into(__all__)


def __getattr__(name: str) -> type:
    cls = registry.exported_class(name)
    if cls is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return cls


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
