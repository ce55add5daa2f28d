"""hessian-eigenthings: curvature of a model's loss as matrix-free operators."""

from hessian_eigenthings._version import __version__
from hessian_eigenthings.linalg_distributed import DistributedBackend, is_main_process
from hessian_eigenthings.loss_fns import (
    OutputHessianLoss,
    cross_entropy_loss_of_output,
    hf_lm_forward,
    hf_lm_loss,
    hf_lm_loss_of_output,
    hf_seq2seq_loss,
    mse_loss_of_output,
    supervised_forward,
    supervised_loss,
    supervised_loss_of_output,
    supervised_per_sample_loss,
    tlens_forward,
    tlens_loss,
    tlens_loss_of_output,
)
from hessian_eigenthings.operators import (
    CurvatureOperator,
    DDPHessianOperator,
    EmpiricalFisherOperator,
    FSDPHessianOperator,
    GGNOperator,
    HessianOperator,
    LambdaOperator,
)

__all__ = [
    "CurvatureOperator",
    "DDPHessianOperator",
    "DistributedBackend",
    "EmpiricalFisherOperator",
    "FSDPHessianOperator",
    "GGNOperator",
    "HessianOperator",
    "LambdaOperator",
    "OutputHessianLoss",
    "__version__",
    "cross_entropy_loss_of_output",
    "hf_lm_forward",
    "hf_lm_loss",
    "hf_lm_loss_of_output",
    "hf_seq2seq_loss",
    "is_main_process",
    "mse_loss_of_output",
    "supervised_forward",
    "supervised_loss",
    "supervised_loss_of_output",
    "supervised_per_sample_loss",
    "tlens_forward",
    "tlens_loss",
    "tlens_loss_of_output",
]
