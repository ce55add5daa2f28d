"""0.x ``compute_hessian_eigenthings``: build the 0.x Hessian operator, run one solver.

Equivalent 1.0 code::

    op = HessianOperator(model, dataloader, supervised_loss(criterion))
    result = lanczos(op, k=10)                       # mode="lanczos" (the solver to use)
    result = deflated_power_iteration(op, k=10)      # mode="power_iter"
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from torch import nn

from hessian_eigenthings.compat._deprecations import warn_deprecated
from hessian_eigenthings.compat.hvp_operator import Criterion, _HVPOperator
from hessian_eigenthings.compat.lanczos import run_lanczos
from hessian_eigenthings.compat.power_iter import run_deflated_power_iteration

#: keyword arguments each mode forwards to its 0.x algorithm
_MODE_KWARGS = {
    "power_iter": ("power_iter_steps", "power_iter_err_threshold", "momentum", "to_numpy"),
    "lanczos": ("which", "max_steps", "tol", "num_lanczos_vectors", "init_vec"),
}


def compute_hessian_eigenthings(
    model: nn.Module,
    dataloader: Iterable[Any],
    loss: Criterion,
    num_eigenthings: int = 10,
    full_dataset: bool = True,
    mode: str = "power_iter",
    use_gpu: bool = True,
    fp16: bool = False,
    max_possible_gpu_samples: int = 2**16,
    **kwargs: Any,
) -> tuple[Any, Any]:
    """0.x driver. Deprecated: use ``HessianOperator`` with ``lanczos`` (or ``deflated_power_iteration``).

    Returns ``(eigenvalues (k,), eigenvectors (k, n))`` as numpy arrays:
    descending for ``mode="power_iter"``, ascending for ``mode="lanczos"``
    (as 0.x, whose Lanczos was ARPACK).
    """
    warn_deprecated("compute_hessian_eigenthings")
    if mode not in _MODE_KWARGS:
        raise ValueError(
            f"mode must be 'power_iter' or 'lanczos', got {mode!r} (1.0: call lanczos(op, k=...) "
            "or deflated_power_iteration(op, k=...) on a HessianOperator)"
        )
    unknown = sorted(set(kwargs) - set(_MODE_KWARGS[mode]))
    if unknown:
        raise TypeError(
            f"compute_hessian_eigenthings(mode={mode!r}) got unexpected keyword arguments {unknown}; "
            f"this mode accepts {list(_MODE_KWARGS[mode])}"
        )
    op = _HVPOperator(
        model,
        dataloader,
        loss,
        use_gpu=use_gpu,
        fp16=fp16,
        full_dataset=full_dataset,
        max_possible_gpu_samples=max_possible_gpu_samples,
    )
    # the operator already decided the device (and warned if CUDA is missing)
    if mode == "power_iter":
        return run_deflated_power_iteration(op, num_eigenthings, use_gpu=False, fp16=fp16, **kwargs)
    return run_lanczos(op, num_eigenthings, use_gpu=False, fp16=fp16, **kwargs)
