"""Algorithms on curvature operators: eigensolvers, trace, diagonal, spectral density, solves.

They see operators only through :class:`~hessian_eigenthings.operators.base.CurvatureOperator`
(``size``, ``device``, ``dtype``, ``matvec``, ``matmat``) and do every
reduction through a :class:`~hessian_eigenthings.linalg.LinAlgBackend`.
"""

from hessian_eigenthings.algorithms.diagonal import diagonal
from hessian_eigenthings.algorithms.lanczos import check_symmetry, lanczos, lanczos_tridiagonal
from hessian_eigenthings.algorithms.power_iteration import (
    PowerIterationResult,
    deflated_power_iteration,
    power_iteration_one,
)
from hessian_eigenthings.algorithms.refine import lanczos_tf32_refine, refine_eigenpairs
from hessian_eigenthings.algorithms.result import (
    ConvergenceWarning,
    DiagonalResult,
    EigenResult,
    LanczosTridiag,
    SolveResult,
    SpectralDensityResult,
    TraceResult,
)
from hessian_eigenthings.algorithms.solve import InverseOperator, inverse, solve
from hessian_eigenthings.algorithms.spectral_density import spectral_density
from hessian_eigenthings.algorithms.trace import hutch_plus_plus, hutchinson, trace, xtrace

__all__ = [
    "ConvergenceWarning",
    "DiagonalResult",
    "EigenResult",
    "InverseOperator",
    "LanczosTridiag",
    "PowerIterationResult",
    "SolveResult",
    "SpectralDensityResult",
    "TraceResult",
    "check_symmetry",
    "deflated_power_iteration",
    "diagonal",
    "hutch_plus_plus",
    "hutchinson",
    "inverse",
    "lanczos",
    "lanczos_tf32_refine",
    "lanczos_tridiagonal",
    "power_iteration_one",
    "refine_eigenpairs",
    "solve",
    "spectral_density",
    "trace",
    "xtrace",
]
