"""How much memory one curvature product will need: an estimate made before a long run.

The estimate is built from two measured quantities and a table of factors:

- ``A``, the activation memory of one gradient step on a batch. On CUDA it
  is measured (peak of ``torch.cuda.max_memory_allocated`` over one forward
  and backward, minus the gradient itself). Elsewhere it is counted: every
  tensor autograd saves for the backward during one forward is seen through
  ``torch.autograd.graph.saved_tensors_hooks`` and its storage counted once
  (parameters excluded, since they are resident anyway).
- ``P``, the bytes of the selected parameters (one flat vector of size n).

A product on a block of ``k`` vectors is then expected to need, beyond the
model itself (see NOTE [memory factors])::

    product = activation_factor · A + vectors · P

and the algorithm keeps ``krylov_size`` vectors of its own (Lanczos basis,
Hutch++ sketch, SLQ bases). Everything here is an estimate: allocator
rounding and fragmentation, kernels' workspaces and framework overhead are
not modelled, and a model whose ops save more than one pass exposes is
under-counted. Treat numbers within a factor of about two.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from hessian_eigenthings import _torch_compat
from hessian_eigenthings.batching import batch_size
from hessian_eigenthings.operators import registry

__all__ = ["MemoryEstimate", "activation_bytes", "available_memory", "estimate_memory"]

# NOTE [memory factors]
# Factors applied to A (activation bytes of one gradient step), for a block of
# k vectors. Each curvature's row in hessian_eigenthings.operators.registry
# carries its own (MemoryFactors: first pass, per vector, extra vectors of size
# n); the reasoning for the built-in rows is here. They come from the structure
# of each computation; on CPU they were checked against torch.profiler's
# allocation timeline for tanh MLPs (tests/test_memory.py keeps that check): the
# measured peak was 1.0-1.35x the estimate for every operator and k in {1, 4},
# i.e. the estimate runs a little low. They have not been checked on CUDA, where
# the caching allocator and kernel workspaces add more; other architectures
# (attention, conv) save different things and may land elsewhere.
# - Hessian, autograd: the forward keeps A; the backward with create_graph
#   keeps a graph of about the same size again, and the second backward needs
#   temporaries of about half that per vector. Per vector of a block the
#   second backward runs batched, so: (1 + 1.5 k) · A, i.e. 2.5 A for k = 1.
# - Hessian, finite differences: two ordinary gradient steps per vector, one
#   after the other: 1 · A whatever k (blocks are looped).
# - GGN / empirical Fisher: the forward keeps A, the forward-mode JVP carries
#   one tangent per vector alongside the primal (about A each), then one
#   backward of Jᵀ: (1 + k) · A.
# Vectors of size n on top (units of P): the input block and the output
# buffer (2k), plus one gradient (autograd) or a saved copy of the
# parameters and two gradients (finite differences: 3).
# - Kronecker-factored rows (factored=True: KFAC, EKFAC, KFOC): products read
#   no data; the peak is the pass that builds the factors, a forward plus a
#   batched backward of up to column_chunk = 16 loss-Hessian columns, each
#   about one A of output gradients in the factor dtype. Measured on CPU for
#   the tanh MLP below (10 classes, so 10 columns): KFAC 10.4 A, EKFAC 24.5 A
#   (per-sample gradients in the eigenbasis), KFOC 19.7 A (per-sample
#   weights of its power iteration); per column about 0.95, 2.35 and 1.9 A.
#   first_pass is 1 + 16 columns at those rates (17, 39, 31): for the default
#   chunk, i.e. an overestimate (up to 1.7x) for fewer than 16 classes.
#   extra_vectors 8: the factors (2P for square layers) and a product's
#   gathered per-block copies and eigenbasis temporaries (about 6P at k = 4).
# Fraction of the free memory a run may plan to use: allocators fragment.
_HEADROOM = 0.9


def _fmt(nbytes: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(nbytes) < 1024 or unit == "GiB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.1f} {unit}"
        nbytes /= 1024
    return f"{nbytes:.1f} GiB"  # pragma: no cover - loop always returns


@dataclass(frozen=True)
class MemoryEstimate:
    """Expected peak memory of one product and of the algorithm's vectors (bytes)."""

    operator: str
    method: str
    block_size: int
    krylov_size: int
    parameter_bytes: int  # P: the selected parameters, one vector of size n
    activation_bytes: int  # A: saved activations of one gradient step on the (micro)batch
    product_bytes: int  # one product on a block, beyond the resident model
    algorithm_bytes: int  # krylov_size vectors kept by the algorithm
    available_bytes: int | None  # free memory on the device (None: unknown)
    measured: bool  # A measured on CUDA (True) or counted from saved tensors (False)
    batch_size: int | None  # samples per forward the estimate assumes
    #: the model's list of blocks, if it has one (the longest ``nn.ModuleList`` of one module type)
    block_list: str | None = None

    @property
    def required_bytes(self) -> int:
        """What the run adds to the resident model: one product plus the algorithm's vectors."""
        return self.product_bytes + self.algorithm_bytes

    @property
    def fits(self) -> bool:
        """Whether the requirement fits in 90% of the free memory (unknown free memory: True)."""
        if self.available_bytes is None:
            return True
        return self.required_bytes <= _HEADROOM * self.available_bytes

    def suggestions(self) -> list[str]:
        """Ways to lower the requirement, most effective first (empty when it fits)."""
        if self.fits:
            return []
        tips: list[str] = []
        row = registry.curvature(self.operator)
        # MemoryEstimate.method holds the factors' label (the method for curvatures with several)
        current = next(f for f in row.memory if f.label == self.method)
        act_factor = current.first_pass + current.per_vector * self.block_size
        if self.activation_bytes * act_factor > 0.3 * self.required_bytes:
            tips.append(
                "activations dominate: pass microbatch_size=... (same result, activations scale "
                "with the microbatch)"
            )
            if self.block_list is not None and self.operator in ("hessian", "ggn", "fisher"):
                tips.append(
                    f"walk the blocks one at a time: engine='layers', layers={self.block_list!r} "
                    "(exact; holds each block's input and its tangent instead of the whole graph; "
                    "each block's forward runs twice per product)"
                )
            for method, factors in zip(row.methods, row.memory, strict=True):
                other = factors.first_pass + factors.per_vector * self.block_size
                if other < act_factor:
                    tips.append(
                        f"use method={method!r} (about {other:.1f}x instead of {act_factor:.1f}x the "
                        "activations)"
                    )
        if self.block_size > 1:
            tips.append("use a smaller block (max_block_size=... on the operator, or block_size=1)")
        if self.algorithm_bytes > 0.3 * self.required_bytes:
            tips.append(
                "the algorithm's vectors dominate: use a smaller Krylov size (ncv / lanczos_steps, "
                "fewer SLQ runs at once, fewer Hutch++ products) or a narrower param_filter"
            )
        if not tips:
            tips.append("select fewer parameters with param_filter")
        return tips

    def summary(self) -> str:
        """A few human-readable lines, with suggestions when it does not fit."""
        src = "measured on CUDA" if self.measured else "counted from saved tensors"
        avail = "unknown" if self.available_bytes is None else _fmt(self.available_bytes)
        lines = [
            f"memory estimate ({self.operator}, {self.method}, block {self.block_size}): "
            f"~{_fmt(self.required_bytes)} needed, {avail} free",
            f"  parameters {_fmt(self.parameter_bytes)}, activations per gradient step "
            f"{_fmt(self.activation_bytes)} ({src}), one product ~{_fmt(self.product_bytes)}, "
            f"algorithm vectors ({self.krylov_size}) {_fmt(self.algorithm_bytes)}",
        ]
        if not self.fits:
            lines.append("  this will probably NOT fit; try:")
            lines.extend(f"  - {t}" for t in self.suggestions())
        return "\n".join(lines)


def available_memory(device: torch.device | str) -> int | None:
    """Bytes a new tensor can take on ``device``.

    CUDA: free device memory (``torch.cuda.mem_get_info``) plus what torch's
    caching allocator holds unused (reserved minus allocated), which it hands
    out before asking the device. Linux CPUs: ``MemAvailable``.
    """
    device = torch.device(device)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(
            free + _torch_compat.cuda_reserved(device) - _torch_compat.cuda_allocated(device)
        )
    if device.type == "cpu":
        try:
            with open("/proc/meminfo") as f:
                for line in f:
                    if line.startswith("MemAvailable:"):
                        return int(line.split()[1]) * 1024
        except OSError:
            pass
        if hasattr(os, "sysconf"):
            try:
                return int(os.sysconf("SC_AVPHYS_PAGES")) * int(os.sysconf("SC_PAGE_SIZE"))
            except (ValueError, OSError):
                return None
    return None


def _default_forward(model: nn.Module, batch: Any) -> Any:
    if isinstance(batch, torch.Tensor):
        return model(batch)
    if isinstance(batch, Mapping):
        return model(**batch)
    if isinstance(batch, (tuple, list)):
        return model(batch[0])
    raise TypeError(
        f"cannot guess how to call the model on a batch of type {type(batch).__name__}; "
        "pass loss_fn(model, batch) -> scalar"
    )


def activation_bytes(
    model: nn.Module,
    batch: Any,
    loss_fn: Callable[[nn.Module, Any], torch.Tensor] | None = None,
) -> int:
    """Bytes of the tensors autograd saves for the backward of one forward on ``batch``.

    Every saved tensor's storage counts once (views of one storage share it);
    parameter storages do not count. ``loss_fn(model, batch)`` is run when
    given (so the loss's own saved tensors count), otherwise the model is
    called on ``batch`` (a tensor, ``batch[0]`` of a tuple, or ``**batch``).
    Runs on the model's device; nothing is kept, ``.grad`` is untouched.
    """
    param_ptrs = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr not in param_ptrs and ptr != 0:
            seen[ptr] = storage.nbytes()
        return t

    def unpack(t: torch.Tensor) -> torch.Tensor:
        return t

    with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        out = loss_fn(model, batch) if loss_fn is not None else _default_forward(model, batch)
    del out
    return int(sum(seen.values()))


def _measured_activation_bytes(
    model: nn.Module,
    batch: Any,
    loss_fn: Callable[[nn.Module, Any], torch.Tensor],
    params: Sequence[torch.Tensor],
    device: torch.device,
) -> int:
    """Peak of one gradient step on CUDA, minus the gradient (``torch.cuda.max_memory_allocated``)."""
    torch.cuda.synchronize(device)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    loss = loss_fn(model, batch)
    grads = torch.autograd.grad(loss, list(params), allow_unused=True)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - base
    grad_bytes = sum(g.numel() * g.element_size() for g in grads if g is not None)
    del loss, grads
    return max(0, int(peak - grad_bytes))


def estimate_memory(
    model: nn.Module,
    batch: Any,
    loss_fn: Callable[[nn.Module, Any], torch.Tensor] | None = None,
    *,
    operator: str = "hessian",
    method: str | None = None,
    block_size: int = 1,
    microbatch_size: int | None = None,
    krylov_size: int = 0,
    params: Sequence[torch.Tensor] | None = None,
    work_dtype: torch.dtype | None = None,
    measure: bool | None = None,
) -> MemoryEstimate:
    """Estimate the peak memory of one product of ``operator`` on ``batch``.

    Args:
        batch: one batch as the operator's dataloader yields it (the estimate
            is per batch: the data loop holds one at a time).
        loss_fn: ``loss_fn(model, batch) -> scalar``; needed to measure on
            CUDA, and makes the CPU count include the loss's saved tensors.
        operator: a curvature of :mod:`hessian_eigenthings.operators.registry`:
            ``"hessian"``, ``"ggn"``, ``"fisher"`` or one added with ``register``.
            Its row's :class:`~hessian_eigenthings.operators.registry.MemoryFactors`
            give the estimate.
        method: for curvatures with several product methods (the Hessian:
            ``"autograd"``, ``"finite_difference"``), which one; default the
            first. Others have one (``"autograd"`` is accepted for them).
        block_size: vectors per product pass (``op @ V`` with ``V (n, k)``).
        microbatch_size: activations are scaled by ``microbatch / batch``.
        krylov_size: vectors of size n the algorithm keeps (Lanczos ``ncv``,
            SLQ ``runs · steps``, Hutch++ ``num_matvecs / 3``).
        params: the selected parameters (default: all that require grad).
        work_dtype: dtype of the algorithm's vectors (default: the parameters').
        measure: measure ``A`` on CUDA (default: when the model is on CUDA and
            ``loss_fn`` is given); otherwise count saved tensors.

    See the module docstring and NOTE [memory factors] for what is modelled.
    """
    try:
        row = registry.curvature(operator)
    except ValueError as exc:
        raise ValueError(f"operator: {exc}") from None
    if not row.methods and method not in (None, "autograd"):
        raise ValueError(
            f"operator {operator!r} has one product method; leave method unset, got {method!r}"
        )
    factors = row.memory_factors(method)
    if not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be an int >= 1, got {block_size!r}")
    if krylov_size < 0:
        raise ValueError(f"krylov_size must be >= 0, got {krylov_size}")
    if microbatch_size is not None and microbatch_size < 1:
        raise ValueError(f"microbatch_size must be >= 1 or None, got {microbatch_size}")
    selected = (
        list(params) if params is not None else [p for p in model.parameters() if p.requires_grad]
    )
    if not selected:
        raise ValueError("no parameters selected: the model has no parameter that requires grad")
    device = selected[0].device
    itemsize = selected[0].element_size()
    n = sum(p.numel() for p in selected)
    param_bytes = n * itemsize
    if measure is None:
        measure = device.type == "cuda" and loss_fn is not None
    if measure:
        if loss_fn is None or device.type != "cuda":
            raise ValueError("measure=True needs a CUDA model and a loss_fn")
        act = _measured_activation_bytes(model, batch, loss_fn, selected, device)
    else:
        act = activation_bytes(model, batch, loss_fn)
    try:
        bs: int | None = batch_size(batch)
    except (TypeError, ValueError):
        bs = None
    if microbatch_size is not None and bs is not None and microbatch_size < bs:
        act = int(act * microbatch_size / bs)
        bs = microbatch_size
    factor = factors.first_pass + factors.per_vector * block_size
    vectors = 2 * block_size + factors.extra_vectors
    product = int(factor * act + vectors * param_bytes)
    wd_size = (
        torch.empty((), dtype=work_dtype).element_size() if work_dtype is not None else itemsize
    )
    return MemoryEstimate(
        operator=operator,
        method=factors.label,
        block_size=block_size,
        krylov_size=krylov_size,
        parameter_bytes=param_bytes,
        activation_bytes=act,
        product_bytes=product,
        algorithm_bytes=krylov_size * n * wd_size,
        available_bytes=available_memory(device),
        measured=bool(measure),
        batch_size=bs,
        block_list=find_block_list(model),
    )


def find_block_list(model: nn.Module) -> str | None:
    """The dotted path of the model's longest ``nn.ModuleList`` of two or more modules of one
    type (a transformer's blocks: ``"transformer.h"``, ``"model.layers"``), or ``None``."""
    best: tuple[int, str] | None = None
    for name, m in model.named_modules():
        one_type = isinstance(m, nn.ModuleList) and len({type(c) for c in m}) == 1
        if one_type and len(m) >= 2 and (best is None or len(m) > best[0]):
            best = (len(m), name)
    return None if best is None else best[1]
