"""Curvature operators: Hessian, generalized Gauss-Newton, empirical Fisher."""

from hessian_eigenthings.loss_fns.protocols import ForwardFn, LossOfOutputFn, PerSampleLossFn
from hessian_eigenthings.operators.base import (
    CurvatureOperator,
    DataCurvatureOperator,
    LambdaOperator,
)
from hessian_eigenthings.operators.distributed import (
    DataParallelMixin,
    DDPEmpiricalFisherOperator,
    DDPGGNOperator,
    DDPHessianOperator,
    DistributedProductError,
    FSDPHessianOperator,
)
from hessian_eigenthings.operators.fisher import EmpiricalFisherOperator
from hessian_eigenthings.operators.ggn import GGNOperator
from hessian_eigenthings.operators.hessian import HessianOperator, HvpMethod, LossFn

__all__ = [
    "CurvatureOperator",
    "DDPEmpiricalFisherOperator",
    "DDPGGNOperator",
    "DDPHessianOperator",
    "DataCurvatureOperator",
    "DataParallelMixin",
    "DistributedProductError",
    "EmpiricalFisherOperator",
    "FSDPHessianOperator",
    "ForwardFn",
    "GGNOperator",
    "HessianOperator",
    "HvpMethod",
    "LambdaOperator",
    "LossFn",
    "LossOfOutputFn",
    "PerSampleLossFn",
]
