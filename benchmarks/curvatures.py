"""The three curvatures' operators on a parity workload, and the warm-ups that take a process's
one-time costs before anything is timed (shared by the default-engine benchmarks)."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable
from typing import Any

import torch


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def makers(w: Any) -> dict[str, Callable[[str], Any]]:
    """``engine -> operator`` per curvature ("hessian", "ggn", "ef") of workload ``w``."""
    import hessian_eigenthings as he
    from hessian_eigenthings.loss_fns import supervised_forward, supervised_loss_of_output

    model, batches, crit = w.model, w.batches, w.criterion
    return {
        "hessian": lambda e: he.HessianOperator(model, batches, he.supervised_loss(crit), engine=e),
        "ggn": lambda e: he.GGNOperator(
            model, batches, supervised_forward, supervised_loss_of_output(crit), engine=e
        ),
        "ef": lambda e: he.EmpiricalFisherOperator(model, batches, w.per_sample_loss, engine=e),
    }


def warm_autograd(make: Callable[[str], Any]) -> None:
    """An autograd product and a 3-product lanczos: the first operator's and the first lanczos's
    costs of a process (imports, allocator, library handles)."""
    import hessian_eigenthings as he

    op = make("autograd")
    op @ torch.ones(op.size, device=op.device)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        he.lanczos(op, k=1, max_iter=3, tol=1e-12, seed=0)
    sync()


def warm_trace(make: Callable[[str], Any]) -> Any:
    """One traced product (the process's first trace loads forward-mode decompositions); its
    operator's ``engine_report``."""
    op = make("functional")
    op @ torch.ones(op.size, device=op.device)
    sync()
    return op.engine_report


def warm_process(make: dict[str, Callable[[str], Any]], curvatures: Iterable[str]) -> None:
    """``warm_autograd`` and ``warm_trace`` per curvature, untimed."""
    for curv in curvatures:
        warm_autograd(make[curv])
        warm_trace(make[curv])
