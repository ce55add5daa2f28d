"""Resolution of ``impl=`` for the cross-entropy product (the one place it happens)."""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections.abc import Callable

import torch

from hessian_eigenthings import _torch_compat
from hessian_eigenthings.kernels.cross_entropy import cross_entropy_hvp_reference

IMPLS = ("auto", "eager", "compile", "triton")

#: ``impl="auto"`` runs the eager reference below this many classes: there
#: every implementation is bound by launch overhead (H200, 8192 rows: eager
#: and Triton tie at V=128, Triton wins from V=256, torch.compile from V=512;
#: see benchmarks/RESULTS_kernels.md).
AUTO_EAGER_MAX_VOCAB = 512


def _tracks_grad(*xs: torch.Tensor) -> bool:
    return torch.is_grad_enabled() and any(x.requires_grad for x in xs)


def resolve(impl: str, logits: torch.Tensor, u: torch.Tensor) -> str:
    """The implementation that ``impl`` names for these inputs."""
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    if impl != "auto":
        return impl
    if _torch_compat.tracing():
        return "eager"  # traced by a product engine: the formula, which inductor fuses itself
    if logits.dtype == torch.float64 or u.dtype == torch.float64:
        return "eager"  # the fused kernels accumulate in float32
    if logits.shape[-1] < AUTO_EAGER_MAX_VOCAB:
        return "eager"
    if logits.is_cuda and _torch_compat.has_triton() and not _tracks_grad(logits, u):
        return "triton"
    if _torch_compat.compile_supported():
        return "compile"
    return "eager"


def _scaled_product(
    logits: torch.Tensor, u: torch.Tensor, valid: torch.Tensor | None, n: torch.Tensor | None
) -> torch.Tensor:
    return cross_entropy_hvp_reference(logits, u, valid, n)


def _scaled_product_into(
    logits: torch.Tensor,
    u: torch.Tensor,
    valid: torch.Tensor | None,
    n: torch.Tensor | None,
    out: torch.Tensor,
) -> torch.Tensor:
    # The copy inside the graph lets inductor store straight into ``out``
    # instead of materialising the result and copying it afterwards.
    out.copy_(cross_entropy_hvp_reference(logits, u, valid, n))
    return out


@functools.cache
def _compiled(into: bool) -> Callable[..., torch.Tensor]:
    fn = _scaled_product_into if into else _scaled_product
    return torch.compile(fn, dynamic=None)


def _run_compile(
    logits: torch.Tensor,
    u: torch.Tensor,
    valid: torch.Tensor | None,
    n: float | torch.Tensor | None,
    out: torch.Tensor | None,
) -> torch.Tensor:
    # A Python number would be baked into the graph (one recompilation per
    # value); a 0-d tensor is an input. torch.full launches a fill, no copy.
    n_t = (
        n
        if isinstance(n, torch.Tensor) or n is None
        else torch.full((), float(n), device=logits.device)
    )
    # inductor's CPU kernels can switch the process to flush-to-zero as they load (torch 2.4)
    keep = (
        _torch_compat.denormals_kept() if logits.device.type == "cpu" else contextlib.nullcontext()
    )
    with warnings.catch_warnings(), keep:
        # torch.compile's own machinery uses torch.jit.script internally on
        # some versions and warns about it; nothing a caller can act on.
        warnings.filterwarnings("ignore", message=r".*torch\.jit\.script.*deprecated")
        if out is None:
            return _compiled(False)(logits, u, valid, n_t)
        return _compiled(True)(logits, u, valid, n_t, out)


def run(
    logits: torch.Tensor,
    u: torch.Tensor,
    valid: torch.Tensor | None,
    n: float | torch.Tensor | None,
    *,
    impl: str,
    out: torch.Tensor | None,
) -> torch.Tensor:
    chosen = resolve(impl, logits, u)
    if chosen == "triton":
        return _run_triton(logits, u, valid, n, out)
    if chosen == "compile":
        return _run_compile(logits, u, valid, n, out)
    res = cross_entropy_hvp_reference(logits, u, valid, n)
    if out is None:
        return res
    out.copy_(res)
    return out


def _run_triton(
    logits: torch.Tensor,
    u: torch.Tensor,
    valid: torch.Tensor | None,
    n: float | torch.Tensor | None,
    out: torch.Tensor | None,
) -> torch.Tensor:
    if not _torch_compat.has_triton():
        raise RuntimeError("impl='triton' needs the triton package (pip install triton)")
    from hessian_eigenthings.kernels import cross_entropy_triton as ct

    if not logits.is_cuda and not ct.interpreter_active():
        raise RuntimeError(
            f"impl='triton' needs CUDA tensors (got {logits.device}); on the CPU set "
            "TRITON_INTERPRET=1 before importing triton, or use impl='compile' or 'eager'"
        )
    if logits.dtype == torch.float64:
        raise TypeError("impl='triton' accumulates in float32; use impl='eager' for float64 logits")
    if _tracks_grad(logits, u):
        raise RuntimeError(
            "impl='triton' is not differentiable; use impl='eager' or 'compile' when logits or u "
            "require grad, or call it under torch.no_grad()"
        )
    return ct.cross_entropy_hvp_triton(logits, u, valid, n, out)
