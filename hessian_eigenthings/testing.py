"""Dense oracles for tests, and a cheap self-check of any operator.

The oracles (``dense_hessian``, ``dense_jacobian``) are exact curvature matrices of small
models in any dtype, built with ``torch.func`` on a functional copy of the model, independent of
the operators' code paths. Cost O(n²) memory: for models of a few thousand parameters.

:func:`check_operator` measures, on a few random vectors, whether an operator is symmetric and
gives the same products on every engine: a handful of products, for models of any size.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from hessian_eigenthings._torch_compat import math_sdpa
from hessian_eigenthings.batching import Batch, batch_size, batchnorm_modules
from hessian_eigenthings.operators.base import DataCurvatureOperator
from hessian_eigenthings.operators.protocol import CurvatureOperator


def _pairs(
    named: Mapping[str, torch.Tensor] | Sequence[tuple[str, torch.Tensor]],
) -> list[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` pairs of ``select_parameters``'s dict (or of a list of pairs)."""
    return list(named.items()) if isinstance(named, Mapping) else list(named)


def _each_slot(model: nn.Module, by_id: Mapping[int, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Substitutes keyed by attribute slot, each slot once: a tied tensor (embedding = LM head)
    is replaced in every slot that holds it, and a module registered under two names
    (``nn.Sequential(blk, blk)``) is swapped once, so restoring it puts the parameters back."""
    out: dict[str, torch.Tensor] = {}
    for prefix, m in model.named_modules():  # each module object once
        for attr, t in [*m._parameters.items(), *m._buffers.items()]:
            if t is not None and id(t) in by_id:
                out[f"{prefix}.{attr}" if prefix else attr] = by_id[id(t)]
    return out


def _flat_fn(
    model: nn.Module,
    names: Sequence[str],
    shapes: Sequence[torch.Size],
    fn: Callable[[nn.Module, Batch], torch.Tensor],
    batch: Batch,
) -> Callable[[torch.Tensor], torch.Tensor]:
    sizes = [s.numel() for s in shapes]
    current = dict(model.named_parameters(remove_duplicate=False))
    ids = [id(current[n]) for n in names]

    def f(theta: torch.Tensor) -> torch.Tensor:
        parts = torch.split(theta, sizes)
        by_id = {i: p.view(s) for i, p, s in zip(ids, parts, shapes, strict=True)}
        # fresh buffer copies: BatchNorm in training mode updates its statistics in place
        by_id.update({id(b): b.clone() for b in model.buffers()})

        class _Call(nn.Module):
            def forward(self_inner) -> torch.Tensor:
                return fn(model, batch)

        with torch.nn.utils.stateless._reparametrize_module(model, _each_slot(model, by_id)):
            return _Call()()

    return f


def dense_hessian(
    model: nn.Module,
    batches: Iterable[Batch],
    loss_fn: Callable[[nn.Module, Batch], torch.Tensor],
    named_params: Mapping[str, torch.Tensor] | Sequence[tuple[str, torch.Tensor]],
) -> torch.Tensor:
    """``Σ bᵢ ∇²L_i / Σ bᵢ`` over ``batches`` as a dense ``(n, n)`` matrix."""
    named_params = _pairs(named_params)
    names = [n for n, _ in named_params]
    shapes = [p.shape for _, p in named_params]
    theta = torch.cat([p.detach().reshape(-1) for _, p in named_params])
    total = 0
    acc = torch.zeros(theta.numel(), theta.numel(), dtype=theta.dtype)
    for batch in batches:
        b = batch_size(batch)
        # reverse-over-reverse by plain autograd under math attention (flash SDPA has no double
        # backward); row by row when BatchNorm trains (vmap mishandles its in-place statistics
        # updates). Not torch.func.jacrev twice: on HF GPT-2 with every parameter selected, its
        # LayerNorm-weight rows came out 30-50% wrong (torch 2.13) where autograd's are exact.
        vectorize = not batchnorm_modules(model)
        f = _flat_fn(model, names, shapes, loss_fn, batch)
        with math_sdpa():
            H = torch.autograd.functional.hessian(f, theta, vectorize=vectorize)
        acc += b * H.detach().to(acc.device)
        total += b
    return acc / total


def dense_jacobian(
    model: nn.Module,
    batch: Batch,
    fn: Callable[[nn.Module, Batch], torch.Tensor],
    named_params: Mapping[str, torch.Tensor] | Sequence[tuple[str, torch.Tensor]],
) -> torch.Tensor:
    """Jacobian of ``fn(model, batch)`` (flattened) w.r.t. the flat parameters: ``(m, n)``."""
    named_params = _pairs(named_params)
    names = [n for n, _ in named_params]
    shapes = [p.shape for _, p in named_params]
    theta = torch.cat([p.detach().reshape(-1) for _, p in named_params])
    f = _flat_fn(model, names, shapes, fn, batch)
    with math_sdpa():
        return torch.func.jacrev(lambda t: f(t).reshape(-1))(theta).detach()


# -- a cheap self-check of any operator ---------------------------------------------------------


@dataclass(frozen=True)
class OperatorCheck:
    """What :func:`check_operator` measured. Errors are relative (0 = exact, about 1 = unrelated)."""

    #: ``max |uᵢᵀAuⱼ − uⱼᵀAuᵢ| / (‖Auᵢ‖‖uⱼ‖ + ‖Auⱼ‖‖uᵢ‖)`` over pairs of the random vectors
    symmetry_error: float
    #: per engine: ``‖A_e U − A_ref U‖ / ‖A_ref U‖`` against the first engine (``engines[0]``)
    engine_errors: Mapping[str, float]
    #: the engines compared (the first is the reference); empty for operators without engines
    engines: tuple[str, ...]
    #: engines that could not run this operator, with their reason
    skipped_engines: Mapping[str, str]
    #: the threshold every error is held to
    tolerance: float
    #: why products could disagree beyond rounding anyway (``op.inconsistency_causes()``)
    notes: tuple[str, ...]
    num_vectors: int

    @property
    def passed(self) -> bool:
        return self.symmetry_error <= self.tolerance and all(
            e <= self.tolerance for e in self.engine_errors.values()
        )


#: default threshold by dtype: rounding of a product, with room (a wrong product is off by O(1))
_CHECK_TOL = {torch.float64: 1e-8, torch.float32: 1e-3}


def check_operator(
    op: CurvatureOperator,
    *,
    num_vectors: int = 4,
    seed: int = 0,
    engines: Sequence[str] | None = None,
    tolerance: float | None = None,
) -> OperatorCheck:
    """Check that ``op`` is a symmetric matrix, the same on every engine, on a few random vectors.

    One block product of ``num_vectors`` Gaussian vectors ``U`` per engine (so about
    ``num_vectors × len(engines)`` products, counted in ``op.num_matvecs``). Symmetry compares
    ``uᵢᵀ(A uⱼ)`` with ``uⱼᵀ(A uᵢ)``; engine agreement compares ``A U`` across engines. ``engines``:
    by default ``("autograd", "functional")`` for a data operator that has a functional product,
    none otherwise; ``"compiled"`` may be added (it compiles, so it is slow on a CPU). The operator's
    own engine is restored afterwards. ``tolerance`` defaults to 1e-8 in float64, 1e-3 in float32,
    1e-2 in half precision. Operators whose products change between calls (``full_dataset=False``,
    dropout in training mode) cannot pass; ``notes`` says so.
    """
    from hessian_eigenthings.operators.engines import EngineUnsupportedError

    if not isinstance(op, CurvatureOperator):
        raise TypeError(f"op must be a CurvatureOperator, got {type(op).__name__}")
    if isinstance(num_vectors, bool) or not isinstance(num_vectors, int) or num_vectors < 2:
        raise ValueError(
            f"num_vectors must be an int >= 2 (symmetry compares pairs), got {num_vectors!r}"
        )
    data_op = op if isinstance(op, DataCurvatureOperator) else None
    if engines is None:
        engines = (
            ("autograd", "functional")
            if data_op is not None and data_op.supports_functional
            else ()
        )
    engines = tuple(engines)
    if engines and data_op is None:
        raise ValueError(
            f"engines={engines!r}: {type(op).__name__} has no engines to compare; pass engines=() "
            "(symmetry only)"
        )
    tol = tolerance if tolerance is not None else _CHECK_TOL.get(op.dtype, 1e-2)
    g = torch.Generator().manual_seed(seed)
    U = torch.randn(op.size, num_vectors, generator=g, dtype=torch.float64).to(op.device, op.dtype)

    products: dict[str, torch.Tensor] = {}
    skipped: dict[str, str] = {}
    if data_op is None or not engines:
        AU = op @ U
    else:
        for name in engines:
            try:
                with data_op.using_engine(name):  # type: ignore[arg-type]
                    products[name] = op @ U
            except (EngineUnsupportedError, NotImplementedError) as exc:
                # an engine refusing the model, or torch lacking a rule it needs (e.g. no
                # forward-mode derivative of embedding_bag): reported, not raised
                skipped[name] = f"{type(exc).__name__}: {exc}"
        if not products:
            raise ValueError(f"none of the engines {engines} can run this operator: {skipped}")
        AU = next(iter(products.values()))

    a, u = AU.double(), U.double()
    M = u.T @ a  # M[i, j] = uᵢᵀ A uⱼ
    norms_a, norms_u = a.norm(dim=0), u.norm(dim=0)
    scale = torch.outer(norms_a, norms_u) + torch.outer(norms_u, norms_a)
    asym = (M - M.T).abs() / scale.clamp_min(torch.finfo(torch.float64).tiny)
    ref = a.norm().clamp_min(torch.finfo(torch.float64).tiny)
    errors = {name: float((p.double() - a).norm() / ref) for name, p in list(products.items())[1:]}
    return OperatorCheck(
        symmetry_error=float(asym.max()),
        engine_errors=errors,
        engines=tuple(products),
        skipped_engines=skipped,
        tolerance=tol,
        notes=tuple(op.inconsistency_causes()),
        num_vectors=num_vectors,
    )
