"""hessian-eigenthings: curvature of a model's loss as matrix-free operators."""

# 0.x facade (DESIGN.md §3): `lanczos` and `deflated_power_iteration` are both 0.x and 1.0
# functions, so the top-level names route by the call (NOTE [routing colliding names] in
# compat/routing.py); hessian_eigenthings.algorithms has the plain 1.0 ones. The 0.x module
# hessian_eigenthings.lanczos is loaded before the name `lanczos` is bound, so a later
# `import hessian_eigenthings.lanczos` finds it loaded and cannot rebind the name to the module.
# 0.x's package imported these modules, so scripts reach them as attributes
# (`hessian_eigenthings.utils.log(...)`), and it had a `name` attribute
import hessian_eigenthings.hvp_operator as hvp_operator  # noqa: F401 -- 0.x attribute
import hessian_eigenthings.lanczos as _lanczos_module
import hessian_eigenthings.operator as operator  # noqa: F401 -- 0.x attribute
import hessian_eigenthings.power_iter as power_iter  # noqa: F401 -- 0.x attribute
import hessian_eigenthings.utils as utils  # noqa: F401 -- 0.x attribute
from hessian_eigenthings._version import __version__
from hessian_eigenthings._warnings import EmptyBatchWarning
from hessian_eigenthings.algorithms import (
    ConvergenceWarning,
    DiagonalResult,
    EigenResult,
    LanczosTridiag,
    SolveResult,
    SpectralDensityResult,
    TraceResult,
    diagonal,
    hutch_plus_plus,
    hutchinson,
    inverse,
    lanczos_tf32_refine,
    lanczos_tridiagonal,
    power_iteration_one,
    refine_eigenpairs,
    solve,
    spectral_density,
    trace,
)
from hessian_eigenthings.compat import HVPOperator, compute_hessian_eigenthings, power_iteration
from hessian_eigenthings.compat.routing import deflated_power_iteration, lanczos
from hessian_eigenthings.interop import from_curvlinops, to_curvlinops
from hessian_eigenthings.landscape import LandscapeResult, loss_landscape, random_directions
from hessian_eigenthings.linalg_distributed import DistributedBackend, is_main_process
from hessian_eigenthings.loss_fns import (
    OutputHessianLoss,
    OutputHessianSqrtLoss,
    cross_entropy_loss_of_output,
    hf_lm_forward,
    hf_lm_loss,
    hf_lm_loss_of_output,
    hf_lm_per_sequence_loss,
    hf_lm_per_token_loss,
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
from hessian_eigenthings.memory import MemoryEstimate, estimate_memory
from hessian_eigenthings.operators import (
    CompileFallbackWarning,
    CurvatureOperator,
    DDPEKFACOperator,
    DDPEmpiricalFisherOperator,
    DDPGGNOperator,
    DDPHessianOperator,
    DDPKFACOperator,
    DDPKFOCOperator,
    EKFACOperator,
    EmpiricalFisherOperator,
    EngineMismatchWarning,
    EngineUnsupportedError,
    FSDPEKFACOperator,
    FSDPEmpiricalFisherOperator,
    FSDPGGNOperator,
    FSDPHessianOperator,
    FSDPKFACOperator,
    FSDPKFOCOperator,
    GGNOperator,
    HessianOperator,
    JacobianOperator,
    KFACOperator,
    KFOCOperator,
    KroneckerBlock,
    KroneckerOperator,
    LambdaOperator,
    RandomForwardWarning,
    TransposedJacobianOperator,
)
from hessian_eigenthings.operators import registry as _registry
from hessian_eigenthings.param_utils import (
    ParamFilter,
    ParamFilterWarning,
    match_names,
    match_regex,
    params_to_vector,
    select_parameters,
    vector_to_params,
)
from hessian_eigenthings.tracking import CurvatureTracker, TrackRecord

name = "hessian_eigenthings"

del _lanczos_module

__all__ = [
    "CompileFallbackWarning",
    "ConvergenceWarning",
    "CurvatureOperator",
    "CurvatureTracker",
    "DDPEKFACOperator",
    "DDPEmpiricalFisherOperator",
    "DDPGGNOperator",
    "DDPHessianOperator",
    "DDPKFACOperator",
    "DDPKFOCOperator",
    "DiagonalResult",
    "DistributedBackend",
    "EKFACOperator",
    "EigenResult",
    "EmpiricalFisherOperator",
    "EmptyBatchWarning",
    "EngineMismatchWarning",
    "EngineUnsupportedError",
    "FSDPEKFACOperator",
    "FSDPEmpiricalFisherOperator",
    "FSDPGGNOperator",
    "FSDPHessianOperator",
    "FSDPKFACOperator",
    "FSDPKFOCOperator",
    "GGNOperator",
    "HVPOperator",
    "HessianOperator",
    "JacobianOperator",
    "KFACOperator",
    "KFOCOperator",
    "KroneckerBlock",
    "KroneckerOperator",
    "LambdaOperator",
    "LanczosTridiag",
    "LandscapeResult",
    "MemoryEstimate",
    "OutputHessianLoss",
    "OutputHessianSqrtLoss",
    "ParamFilter",
    "ParamFilterWarning",
    "RandomForwardWarning",
    "SolveResult",
    "SpectralDensityResult",
    "TraceResult",
    "TrackRecord",
    "TransposedJacobianOperator",
    "__version__",
    "compute_hessian_eigenthings",
    "cross_entropy_loss_of_output",
    "deflated_power_iteration",
    "diagonal",
    "estimate_memory",
    "from_curvlinops",
    "hf_lm_forward",
    "hf_lm_loss",
    "hf_lm_loss_of_output",
    "hf_lm_per_sequence_loss",
    "hf_lm_per_token_loss",
    "hf_seq2seq_loss",
    "hutch_plus_plus",
    "hutchinson",
    "inverse",
    "is_main_process",
    "lanczos",
    "lanczos_tf32_refine",
    "lanczos_tridiagonal",
    "loss_landscape",
    "match_names",
    "match_regex",
    "mse_loss_of_output",
    "params_to_vector",
    "power_iteration",
    "power_iteration_one",
    "random_directions",
    "refine_eigenpairs",
    "select_parameters",
    "solve",
    "spectral_density",
    "supervised_forward",
    "supervised_loss",
    "supervised_loss_of_output",
    "supervised_per_sample_loss",
    "tlens_forward",
    "tlens_loss",
    "tlens_loss_of_output",
    "to_curvlinops",
    "trace",
    "vector_to_params",
]


# every registry row's classes, also those not imported above (NOTE [exports from the registry])
_registry.export_into(__all__)


def __getattr__(attr: str) -> object:
    # `he.testing` (dense oracles, check_operator) and `he.influence` (influence scores) without
    # importing them with the package
    if attr in ("testing", "influence"):
        import importlib

        return importlib.import_module(f"hessian_eigenthings.{attr}")
    cls = _registry.exported_class(attr)
    if cls is not None:
        return cls
    raise AttributeError(f"module 'hessian_eigenthings' has no attribute {attr!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
