"""The Jacobian of the model output over the data, ``J = ∂f/∂θ``, and its transpose.

Math. For the batches ``b = 1..B`` of a dataloader with outputs
``f_b = forward_fn(model, batch_b)`` (``N_b`` samples, ``C`` entries per sample, flattened
row-major), ``J`` stacks the per-batch Jacobians ``J_b = ∂ vec(f_b) / ∂θ`` in loader order:
shape ``(N·C, n)`` with ``N = Σ N_b`` and ``n`` the selected parameters' size.
``J v = [J_1 v; …; J_B v]`` (forward-mode AD per batch, ``torch.func.jvp``, a block of
vectors vmapped over its columns) and ``Jᵀ u = Σ_b J_bᵀ u_b`` (reverse mode per batch,
``torch.func.vjp``, vmapped likewise). Nothing is averaged: these are the plain Jacobian and
its transpose, as in ``G = Jᵀ H J``.

These operators are not square, so they are not :class:`CurvatureOperator`\\ s (no
eigensolver takes them); they have ``shape``, ``matvec``, ``rmatvec``, ``matmat``, ``@``
(also ``X @ J`` for a block of rows), ``.T``, ``to_dense`` and ``to_scipy``.

Cost. A product with a block of k columns is one pass over the data: per batch one forward
and one vmapped forward-mode (``J V``) or backward (``Jᵀ U``) pass. The number of outputs
``N·C`` is learnt by one forward pass over the data without gradients, on first use.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, TypedDict

import torch
from torch import nn
from typing_extensions import Unpack

from hessian_eigenthings import _torch_compat
from hessian_eigenthings._checks import InternalError
from hessian_eigenthings.batching import Batch, BatchSource, to_device
from hessian_eigenthings.loss_fns.checks import check_first_batch
from hessian_eigenthings.loss_fns.protocols import ForwardFn
from hessian_eigenthings.operators.autodiff import CallWithModel
from hessian_eigenthings.operators.data_setup import options_signature, unexpected_keyword
from hessian_eigenthings.operators.model_guard import preserve_model, private_buffers
from hessian_eigenthings.operators.parameter_binding import ParameterBinding
from hessian_eigenthings.param_utils import (
    ParamFilter,
    ParamLayout,
    call_with_values,
    select_parameters,
)

__all__ = ["JacobianOperator", "JacobianOptions", "TransposedJacobianOperator"]


class _DataJacobian:
    """What both operators share: the data, the parameters, the two products as row blocks."""

    def __init__(
        self,
        model: nn.Module,
        dataloader: Iterable[Batch],
        forward_fn: ForwardFn,
        *,
        param_filter: ParamFilter | str | Sequence[str] | None = None,
        num_batches: int | None = None,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        if not callable(forward_fn):
            raise TypeError(
                "forward_fn must be callable as forward_fn(model, batch) -> output tensor"
            )
        self.model = model
        self.forward_fn = forward_fn
        self.named_params = list(select_parameters(model, param_filter).items())
        self.layout = ParamLayout.from_named(self.named_params)
        # NOTE [replaced parameters], NOTE [padding rows]
        self._binding = ParameterBinding(
            model, self.named_params, self.layout.offsets, "JacobianOperator"
        )
        self.source = BatchSource(dataloader, full_dataset=True, num_batches=num_batches)
        check_first_batch(model, self.source.first_batch(), forward_fn)
        self._call = CallWithModel(model, forward_fn)
        self._sizes: list[int] | None = None
        self._shapes: list[torch.Size] | None = None

    @property
    def dtype(self) -> torch.dtype:
        return self.layout.dtype

    @property
    def device(self) -> torch.device:
        return self.layout.device

    def _batches(self) -> Iterator[Batch]:
        for raw in self.source.batches():
            yield to_device(raw, self.device)

    def _output(self, out: Any) -> torch.Tensor:
        if not isinstance(out, torch.Tensor):
            raise TypeError(
                f"forward_fn must return a tensor, got {type(out).__name__}; return e.g. the logits"
            )
        return out

    @property
    def output_sizes(self) -> list[int]:
        """The number of output entries of each batch (``N_b·C``), learnt by one pass on first use."""
        if self._sizes is None:
            shapes = []
            with torch.no_grad():
                for batch in self._batches():
                    with private_buffers(self.model):  # the user's running statistics stay put
                        shapes.append(self._output(self.forward_fn(self.model, batch)).shape)
            if not shapes:
                raise ValueError(
                    "the dataloader yielded no batch; check that the dataset is not empty"
                )
            self._shapes = shapes
            self._sizes = [s.numel() for s in shapes]
        return self._sizes

    @property
    def num_outputs(self) -> int:
        """``N·C``: the rows of ``J``."""
        return sum(self.output_sizes)

    def _follow_parameters(self) -> None:
        """Follow parameters the model replaced since the last product (NOTE [replaced parameters])."""
        named = self._binding.follow()
        if named is not None:
            self.named_params = named

    def _functions(self) -> Iterator[tuple[Any, tuple[torch.Tensor, ...], int]]:
        """``(f, primal, b)`` per batch: ``f(*params)`` its output, checked against the first pass."""
        sizes = self.output_sizes
        names = self.layout.names
        selected = set(names)
        fixed = {
            f"model.{n}": p.detach() for n, p in self.model.named_parameters() if n not in selected
        }
        buffers = {f"model.{n}": b.detach() for n, b in self.model.named_buffers()}
        primal = tuple(p.detach() for _, p in self.named_params)
        keys = [f"model.{n}" for n in names]
        count = 0
        for b, batch in enumerate(self._batches()):
            if b >= len(sizes):
                raise RuntimeError(
                    "the dataloader yielded more batches than on the first pass; it must not change"
                )

            def f(*values: torch.Tensor, batch: Batch = batch) -> torch.Tensor:
                # buffers cloned inside the call: a training module (BatchNorm) updates them in
                # place, on tensors of this call only (the user's stay put, the transforms allow it)
                full = {**fixed, **{k: t.clone() for k, t in buffers.items()}}
                full.update(zip(keys, values, strict=True))
                return self._output(call_with_values(self._call, full, (batch,)))

            yield f, primal, b
            count += 1
        if count != len(sizes):
            raise RuntimeError(
                "the dataloader yielded fewer batches than on the first pass; it must not change"
            )

    def _check_size(self, out: torch.Tensor, b: int, lead: int) -> None:
        if self._shapes is None:
            raise InternalError("self._shapes is not None")
        if out.shape[lead:] != self._shapes[b]:
            raise RuntimeError(
                f"forward_fn returned shape {tuple(out.shape[lead:])} for batch {b}, {tuple(self._shapes[b])} on the "
                "first pass; the data and the forward must be deterministic in shape"
            )

    def jv_rows(self, V: torch.Tensor) -> torch.Tensor:
        """``(J Vᵀ)ᵀ`` for a row block ``V (k, n)``: ``(k, N·C)``."""
        self._follow_parameters()
        k = V.shape[0]
        out = torch.empty(k, self.num_outputs, dtype=self.dtype, device=self.device)
        tangents = self.layout.split_rows(V)
        offsets = [0]
        for s in self.output_sizes:
            offsets.append(offsets[-1] + s)
        with preserve_model(self.model, []), _torch_compat.math_sdpa(), warnings.catch_warnings():
            # torch's first forward-mode call loads its decompositions through the deprecated
            # torch.jit.script and warns about it: torch's own business, not the user's
            warnings.filterwarnings("ignore", message=r".*torch\.jit\.script.*deprecated")
            for f, primal, b in self._functions():

                def one(
                    *t: torch.Tensor, f: Any = f, primal: tuple[torch.Tensor, ...] = primal
                ) -> torch.Tensor:
                    return torch.func.jvp(f, primal, t)[1]

                jv = torch.func.vmap(one)(*tangents)
                self._check_size(jv, b, 1)
                out[:, offsets[b] : offsets[b + 1]] = jv.reshape(k, -1)
        return out

    def jtu_rows(self, U: torch.Tensor) -> torch.Tensor:
        """``(Jᵀ Uᵀ)ᵀ`` for a row block ``U (k, N·C)``: ``(k, n)``."""
        self._follow_parameters()
        k = U.shape[0]
        out = torch.zeros(k, self.layout.size, dtype=self.dtype, device=self.device)
        parts = self.layout.split_rows(out)
        start = 0
        with preserve_model(self.model, []):
            for f, primal, b in self._functions():
                value, vjp_fn = torch.func.vjp(f, *primal)[:2]
                self._check_size(value, b, 0)
                stop = start + value.numel()
                grads = torch.func.vmap(vjp_fn)(U[:, start:stop].reshape(k, *value.shape))
                for acc, g in zip(parts, grads, strict=True):
                    acc.add_(g)
                start = stop
        return out


class JacobianOptions(TypedDict, total=False):
    """The keywords of the Jacobian operators besides the model, the data and the forward, passed
    on as one record: ``param_filter`` (default ``None``: every trainable parameter) and
    ``num_batches`` (default ``None``: every batch)."""

    param_filter: ParamFilter | str | Sequence[str] | None
    num_batches: int | None


class _Rectangular:
    """Products, shapes and adapters of a rectangular operator defined by two row-block maps."""

    num_matvecs: int = 0
    _jac: _DataJacobian
    _transposed: bool

    def __init__(
        self,
        model: nn.Module,
        dataloader: Iterable[Batch],
        forward_fn: ForwardFn,
        **options: Unpack[JacobianOptions],
    ) -> None:
        if unknown := sorted(options.keys() - JacobianOptions.__annotations__.keys()):
            raise unexpected_keyword(type(self), unknown[0], _Rectangular)
        self._jac = _DataJacobian(model, dataloader, forward_fn, **options)

    @property
    def shape(self) -> tuple[int, int]:
        m, n = self._jac.num_outputs, self._jac.layout.size
        return (n, m) if self._transposed else (m, n)

    @property
    def dtype(self) -> torch.dtype:
        return self._jac.dtype

    @property
    def device(self) -> torch.device:
        return self._jac.device

    @property
    def layout(self) -> ParamLayout:
        """The selected parameters' layout (the ``n`` side)."""
        return self._jac.layout

    def _rows(self, X: torch.Tensor, forward: bool) -> torch.Tensor:
        """``(A Xᵀ)ᵀ`` (``forward``) or ``(Aᵀ Xᵀ)ᵀ`` for a row block ``X``."""
        use_jv = forward != self._transposed
        self.num_matvecs += X.shape[0]
        return self._jac.jv_rows(X) if use_jv else self._jac.jtu_rows(X)

    def _apply(self, x: object, forward: bool, name: str, dims: tuple[int, ...]) -> torch.Tensor:
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} needs a torch.Tensor, got {type(x).__name__}")
        if x.dtype != self.dtype:
            raise TypeError(
                f"{name}: the input has dtype {x.dtype}, the operator works in {self.dtype}"
            )
        width = self.shape[1] if forward else self.shape[0]
        if x.dim() not in dims or x.shape[0] != width:
            want = " or ".join(f"({width},)" if d == 1 else f"({width}, k)" for d in dims)
            raise ValueError(f"{name} needs shape {want}, got {tuple(x.shape)}")
        x = x.to(self.device)
        if x.dim() == 1:
            return self._rows(x.unsqueeze(0), forward)[0]
        if x.shape[1] == 0:
            return x.new_empty(self.shape[0] if forward else self.shape[1], 0)
        return self._rows(x.T.contiguous(), forward).T

    def matvec(self, v: torch.Tensor) -> torch.Tensor:
        """``A v``."""
        return self._apply(v, True, "matvec", (1,))

    def rmatvec(self, u: torch.Tensor) -> torch.Tensor:
        """``Aᵀ u``."""
        return self._apply(u, False, "rmatvec", (1,))

    def matmat(self, V: torch.Tensor) -> torch.Tensor:
        """``A V`` for a block ``V`` of k columns: one pass over the data."""
        return self._apply(V, True, "matmat", (2,))

    def __matmul__(self, x: torch.Tensor) -> torch.Tensor:
        return self._apply(x, True, "A @ x", (1, 2))

    def __rmatmul__(self, x: torch.Tensor) -> torch.Tensor:
        # X A = (Aᵀ Xᵀ)ᵀ
        if isinstance(x, torch.Tensor) and x.dim() == 2:
            return self._apply(x.T, False, "X @ A", (2,)).T
        return self._apply(x, False, "x @ A", (1,))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.__matmul__(x)

    def to_dense(self) -> torch.Tensor:
        """The dense matrix, by products with the identity (small sizes only)."""
        return self.matmat(torch.eye(self.shape[1], dtype=self.dtype, device=self.device))

    def to_scipy(self) -> Any:
        """A ``scipy.sparse.linalg.LinearOperator`` over float64 numpy arrays (``matvec``,
        ``rmatvec``, ``matmat``; a host round trip per product), for ``lsqr`` or ``svds``."""
        import numpy as np
        from scipy.sparse.linalg import LinearOperator as ScipyLinearOperator

        def wrap(fn: Any) -> Any:
            def call(x: Any) -> Any:
                t = torch.as_tensor(np.ascontiguousarray(x), device=self.device).to(self.dtype)
                if t.dim() == 2 and t.shape[1] == 1 and fn is not self.matmat:
                    t = t.reshape(-1)
                return fn(t).detach().to("cpu", torch.float64).numpy()

            return call

        return ScipyLinearOperator(
            shape=self.shape,
            matvec=wrap(self.matvec),
            rmatvec=wrap(self.rmatvec),
            matmat=wrap(self.matmat),
            dtype=np.float64,
        )

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(shape={self.shape}, dtype={self.dtype}, device={self.device})"
        )


# NOTE [signatures with options] in ``data_setup``: the record written out, defaults from
# _DataJacobian's constructor
setattr(  # noqa: B010 (read by inspect)
    _Rectangular.__init__,
    "__signature__",
    options_signature(_Rectangular.__init__, [_DataJacobian]),
)


class JacobianOperator(_Rectangular):
    """The Jacobian ``J = ∂f/∂θ`` of the model output over the data, shape ``(N·C, n)``.

    ``JacobianOperator(model, dataloader, forward_fn, *, param_filter=None, num_batches=None)``:
    ``forward_fn(model, batch) -> output`` (e.g. :func:`~hessian_eigenthings.loss_fns.supervised_forward`);
    rows are the batches' outputs flattened row-major, in loader order (the dataloader must be
    re-iterable and deterministic); columns the selected parameters' flat layout. ``J @ v``
    (``(n,)`` or ``(n, k)``) by forward-mode AD, ``J.rmatvec(u)`` / ``u @ J`` by reverse mode,
    ``J.T`` the :class:`TransposedJacobianOperator`. Products run on the model as it is (train
    or eval mode; buffers of training modules are not updated), the model is left untouched.
    """

    _transposed = False

    @property
    def T(self) -> TransposedJacobianOperator:
        """``Jᵀ``, sharing this operator's data and parameters."""
        out = TransposedJacobianOperator.__new__(TransposedJacobianOperator)
        out._jac = self._jac
        return out


class TransposedJacobianOperator(_Rectangular):
    """``Jᵀ``, shape ``(n, N·C)``: ``Jᵀ u = Σ_b J_bᵀ u_b`` (reverse mode, one backward per
    batch for a block). Same arguments as :class:`JacobianOperator`; ``.T`` is ``J``."""

    _transposed = True

    @property
    def T(self) -> JacobianOperator:
        """``J``, sharing this operator's data and parameters."""
        out = JacobianOperator.__new__(JacobianOperator)
        out._jac = self._jac
        return out
