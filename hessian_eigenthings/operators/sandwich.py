"""The sandwich ``Σ Jᵀ H J`` over the data, for a model output ``f`` and an
output-space Hessian ``H``: the machinery the GGN and the empirical Fisher
share (they differ in the output and in ``H``).

One product per batch: ``J v`` by forward-mode AD through the model (NOTE
[GGN Jacobian-vector products]), ``u = H (J v)`` by the subclass, ``Jᵀ u`` by
one backward through the output's graph (kept across products with graph
reuse, NOTE [graph reuse] in ``graph_reuse``). No double backward through the
model.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn
from typing_extensions import Unpack

from hessian_eigenthings import _torch_compat
from hessian_eigenthings._checks import InternalError, check_count
from hessian_eigenthings.batching import Batch, batch_size
from hessian_eigenthings.loss_fns.output_curvature import DrawKey, DrawKeys, OutputCurvature
from hessian_eigenthings.loss_fns.protocols import ForwardFn
from hessian_eigenthings.operators.autodiff import (
    CallWithModel,
    batched_backward,
    central_points,
    default_fd_eps,
    selected_function,
)
from hessian_eigenthings.operators.base import DataCurvatureOperator, DataOptions
from hessian_eigenthings.operators.engines.layers import LayerWalk, LayerWalkRunner
from hessian_eigenthings.operators.engines.runner import unsupported
from hessian_eigenthings.param_utils import call_with_values

JvpMethod = Literal["auto", "forward_mode", "finite_difference"]

# NOTE [GGN Jacobian-vector products]
# `J v` is computed by forward-mode AD: `torch.func.jvp` of the model as a
# function of the selected parameters (`torch.func.functional_call` on a
# wrapper module that calls `forward_fn(model, batch)`), so the model itself
# is never modified. A block of k vectors goes through one pass with
# `torch.func.vmap` over the tangents. Measured on CPU (MLP 128-256-256-10,
# batch 128, k = 8, float32 and float64), vmap-over-jvp and the
# double-backward trick `J v = ∂/∂w ⟨Jᵀw, v⟩` (`is_grads_batched`) cost the
# same within ~10% (a k-loop of forward-mode passes costs ~1.6x); vmap-over-jvp
# wins because it needs no double backward through the model (attention
# kernels without one work, no second-order graph is held).
#
# Fallbacks, decided on the first product and kept:
# - vmap fails (an op without a batching rule, data-dependent Python on a
#   batched tensor, in-place updates of unbatched buffers): a loop of k
#   `torch.func.jvp` calls; still exact.
# - forward-mode AD fails (an op without a forward-AD formula, a custom
#   autograd.Function without `jvp`): central finite differences
#   `J v ≈ (f(θ + h v̂) − f(θ − h v̂)) ‖v‖ / 2h`, two forward passes per
#   vector under no_grad, parameters perturbed out of place through
#   functional_call (the output graph kept for `Jᵀ` stays valid), h from
#   `default_fd_eps` (NOTE [finite-difference step] in `autodiff`). Error O(h²).
# Forward mode runs under math SDPA (the fused attention kernels have no
# forward-mode formulas). `jvp="finite_difference"` forces the fallback;
# `jvp_method` says what ran.
# Active dropout makes the forward-mode pass draw other masks than the output
# graph: call `model.eval()` (BatchNorm in training mode is consistent: both
# passes use batch statistics, on private copies of the running statistics).


@dataclass
class OutputState:
    batch: Batch
    output: torch.Tensor  # f(θ) with its graph to the parameters
    curvature: Any = None  # the output curvature's prepared state (the chunked LM head's targets)


class OutputSandwichOperator(DataCurvatureOperator):
    """``Σ Jᵀ H J`` over the data for a model output ``f`` and an output-space Hessian ``H``.

    Subclasses define the output (``_output``); ``H`` is the ``curvature`` strategy
    (:mod:`hessian_eigenthings.loss_fns.output_curvature`), its draws keyed by ``seed``.
    """

    supports_graph_reuse = True
    needs_double_backward = False
    #: what produced the output, for error messages
    _what_output = "forward_fn"

    def __init__(
        self,
        model: nn.Module,
        dataloader: Iterable[Batch],
        forward_fn: ForwardFn,
        *,
        curvature: OutputCurvature,
        seed: int = 0,
        jvp: JvpMethod = "auto",
        fd_eps: float | None = None,
        **options: Unpack[DataOptions],
    ) -> None:
        check_sandwich(forward_fn, jvp, fd_eps, curvature)
        self.curvature = curvature
        self.seed: int = check_count("seed", seed, minimum=0)
        self._keys = DrawKeys(self.seed)
        self.jvp = jvp
        # before the base builds the engine selector: what the traced engines and the layer walk
        # take (the whole output, never the chunked LM head's hidden states)
        self.supports_functional = self._functional_blocker() is None
        self._functional_call = CallWithModel(model, forward_fn)
        super().__init__(model, dataloader, **options)
        self.fd_eps = fd_eps if fd_eps is not None else default_fd_eps(self.dtype)
        self._set_forward(forward_fn)
        self._call_names = [f"model.{n}" for n in self.layout.names]
        #: how the last Jv was computed: "forward_mode" or "finite_difference" (None before the first product)
        self.jvp_method: str | None = None
        self._forward_ok: bool | None = None if jvp == "auto" else jvp == "forward_mode"
        self._vmap_ok: bool | None = None
        self._vjp_batched_ok: bool | None = None

    def _set_forward(self, forward_fn: ForwardFn) -> None:
        """The function whose Jacobian the operator sandwiches (and its functional wrapper)."""
        self.forward_fn = forward_fn
        self._call = CallWithModel(self.model, forward_fn)

    def _functional_blocker(self) -> str | None:
        """Why this operator's products cannot be traced, or ``None``."""
        if self.jvp == "finite_difference":
            return "jvp='finite_difference' is not a traced product"
        return self.curvature.traced_blocker()

    def _draw_key(self) -> DrawKey | None:
        """The key of the current chunk's draws (NOTE [sampled targets as data] in ``ggn``)."""
        if not self.curvature.keyed:
            return None
        return self._keys(self.chunk_position, self.ranks.rank, self.device)

    def _engine_batch(self, batch: Batch) -> Batch:
        # NOTE [sampled targets as data] in ``ggn``: the key travels beside the batch
        key = self._draw_key()
        return batch if key is None else (batch, key.tensor)

    def functional_unsupported_reason(self) -> str:
        return self._functional_blocker() or ""

    def layer_walk_runner(self, **walk: Any) -> LayerWalkRunner:
        """``engine="layers"``: ``Jᵀ H J v`` one layer at a time (NOTE [layer walk]); ``walk``: more
        arguments of :class:`LayerWalk` (a sharded operator's ``gather`` and ``finish``)."""
        blocker = self._functional_blocker()
        if blocker is not None:
            raise unsupported("layers", type(self).__name__, blocker)
        if self.layers is None:  # checked at construction
            raise InternalError("self.layers is not None")
        return LayerWalkRunner(
            LayerWalk(self.model, self._functional_call.fn, self.layout.names, self.layers, **walk),
            self.counts,
            batch_of=self._engine_batch,
            output_product=self.curvature.traced_apply,
            keyed=self.curvature.keyed,
        )

    def functional_product(
        self, state: dict[str, torch.Tensor], batch: Batch, tangent: list[torch.Tensor]
    ) -> list[torch.Tensor]:
        """``Jᵀ H (J v)`` as a pure function: ``vjp(f)(H · jvp(f)(v))`` (see ``operators.engines``)."""
        key = None
        if self.curvature.keyed:
            batch, key = batch
        call, primal = selected_function(self._functional_call, self.layout.names, state, batch)

        def f(*selected: torch.Tensor) -> torch.Tensor:
            return self._checked_output(call(*selected))

        out, vjp_fn = torch.func.vjp(f, *primal)[:2]
        jv = torch.func.jvp(f, primal, tuple(tangent))[1]
        return list(vjp_fn(self.curvature.traced_apply(out, batch, key, jv)))

    def _output(self, batch: Batch) -> torch.Tensor:
        return self.forward_fn(self.model, batch)

    # -- the exact diagonal ------------------------------------------------------------
    #: most entries of one sample's output the exact diagonal backpropagates (one column each)
    exact_diagonal_max_outputs: int = 4096
    #: about how many columns (samples x K) one vmapped backward of the exact diagonal takes
    _exact_group_columns: int = 1024

    def exact_diagonal(self) -> torch.Tensor:
        """``diag`` of the operator's matrix, exactly, in one pass over the data.

        See NOTE [exact diagonal]. Cost per chunk: one forward, then per sample one forward and
        K backward passes (batched with ``torch.func.vmap``), K columns of the output Hessian's
        square root per sample (the output size for the exact GGN).
        """
        _check_exact_diagonal(self)
        acc = self.layout.empty()
        acc.zero_()
        parts = self.layout.split(acc)
        total = 0.0
        self.chunk_position = -1
        with self.guard.product(self.precision, double_backward=False):
            # read in the pass: a half model's float32 copies (NOTE [half models] in ``precision``)
            state = {n: t.detach() for n, t in self.model.named_parameters()}
            state.update({n: t.detach().clone() for n, t in self.model.named_buffers()})
            for raw, chunk in self._fresh_chunks():
                self.chunk_position += 1
                with torch.no_grad(), self.guard.private_buffers():
                    output = self._checked_output(self._functional_call(chunk))
                N = batch_size(chunk)
                if output.dim() < 1 or output.shape[0] != N:
                    raise ValueError(
                        f"the exact diagonal needs {self._what_output} to return one row per sample (leading "
                        f"dimension {N}), got shape {tuple(output.shape)}"
                    )
                per_sample = output[0].numel() if N else 0
                if (
                    self.curvature.columns_scale_with_output
                    and per_sample > self.exact_diagonal_max_outputs
                ):
                    # the square root has about one column per output entry of a sample
                    # (N · M² numbers, M backward columns per sample): LM-sized outputs cannot
                    raise ValueError(
                        f"the exact diagonal backpropagates about one column per output entry of a sample, and a "
                        f"sample has {per_sample} (more than exact_diagonal_max_outputs="
                        f"{self.exact_diagonal_max_outputs}); use diagonal(op, method='xdiag') for an estimate"
                    )
                S = self.curvature.sample_columns(
                    self.curvature.prepare(output, chunk, self._draw_key())
                )
                weight = self._chunk_weight(raw, chunk)
                group = max(1, self._exact_group_columns // max(S.shape[1], 1))
                call = _CheckedCall(self._functional_call, self._checked_output)
                add_squared_vjps(parts, chunk, S, state, weight, call, self.layout.names, group)
                total += weight
        if total == 0:
            raise ValueError("the dataloader yielded no batch; check that the dataset is not empty")
        # NOTE [padding rows]: reverse mode, under the pass's constant padding lookups
        return acc.div_(total)

    # -- per-batch product ----------------------------------------------------------
    def _checked_output(self, out: Any) -> torch.Tensor:
        if not isinstance(out, torch.Tensor):
            raise TypeError(
                f"{self._what_output} must return a tensor, got {type(out).__name__}; "
                "return e.g. the logits (outputs.logits for HuggingFace models)"
            )
        return out

    def _prepare(self, batch: Batch) -> OutputState:
        self.num_forwards += 1
        output = self._checked_output(self._output(batch))
        if not output.requires_grad:
            raise ValueError(
                f"the output of {self._what_output} does not depend on the selected parameters (no autograd "
                "graph); check that it calls the model and that the parameters require grad"
            )
        prepared = self.curvature.prepare(output, batch, self._draw_key())
        return OutputState(batch=batch, output=output, curvature=prepared)

    def _apply(
        self, state: OutputState, vecs: list[torch.Tensor], retain: bool
    ) -> Sequence[torch.Tensor | None]:
        jv = self._jvp(state.batch, vecs)
        if jv.shape[1:] != state.output.shape:
            raise RuntimeError(
                f"{self._what_output} returned shape {tuple(state.output.shape)} in the forward pass but "
                f"{tuple(jv.shape[1:])} in the Jacobian-vector pass; it must be deterministic in shape"
            )
        u = self.curvature.apply(state.curvature, jv)
        return self._vjp(state.output, u, retain)

    # -- J v --------------------------------------------------------------------
    def _call_at(self, tensors: Sequence[torch.Tensor], batch: Batch) -> torch.Tensor:
        named = dict(zip(self._call_names, tensors, strict=True))
        named.update(training_buffers(self.model))
        out = call_with_values(self._call, named, (batch,))
        return self._checked_output(out)

    def _jvp(self, batch: Batch, vecs: list[torch.Tensor]) -> torch.Tensor:
        """``J v`` for each of the k rows of ``vecs``: ``(k, *output.shape)``.

        See NOTE [GGN Jacobian-vector products].
        """
        if self._forward_ok is not False:
            try:
                out = self._jvp_forward_mode(batch, vecs)
            except (RuntimeError, NotImplementedError):
                if self._forward_ok:  # forward mode worked before, or was asked for: a real error
                    raise
                self._forward_ok = False
            else:
                self._forward_ok = True
                return out
        self.jvp_method = "finite_difference"
        return self._jvp_finite_difference(batch, vecs)

    def _at(self) -> Sequence[torch.Tensor]:
        """The selected parameters a product runs on: a half model's float32 copies during its
        pass (NOTE [half models] in ``precision``), else the parameters."""
        return self.params if self._upcast is None else self._upcast.params

    def _jvp_forward_mode(self, batch: Batch, vecs: list[torch.Tensor]) -> torch.Tensor:
        primals = tuple(p.detach() for p in self._at())

        def f(*tensors: torch.Tensor) -> torch.Tensor:
            return self._call_at(tensors, batch)

        def one(*tangents: torch.Tensor) -> torch.Tensor:
            return torch.func.jvp(f, primals, tangents)[1]

        # math attention: the fused SDPA kernels have no forward-mode formulas
        with _torch_compat.math_sdpa(), warnings.catch_warnings():
            # torch's first forward-mode call loads its decompositions through the deprecated
            # torch.jit.script and warns about it: torch's own business, not the user's
            warnings.filterwarnings("ignore", message=r".*torch\.jit\.script.*deprecated")
            return self._jvp_forward_mode_block(one, vecs)

    def _jvp_forward_mode_block(
        self, one: Callable[..., torch.Tensor], vecs: list[torch.Tensor]
    ) -> torch.Tensor:
        k = vecs[0].shape[0]
        if k > 1 and self._vmap_ok is not False:
            try:
                with warnings.catch_warnings():
                    # vmap warns and loops when an op has no batching rule: take that as unsupported
                    warnings.simplefilter("error", UserWarning)
                    out = torch.func.vmap(one)(*vecs)
            except (RuntimeError, NotImplementedError, ValueError, UserWarning):
                if self._vmap_ok:
                    raise
                self._vmap_ok = False
            else:
                self._vmap_ok = True
                self.jvp_method = "forward_mode"
                return out
        first = one(*(v[0] for v in vecs))
        out = torch.empty((k, *first.shape), dtype=first.dtype, device=first.device)
        out[0] = first
        for j in range(1, k):
            out[j] = one(*(v[j] for v in vecs))
        self.jvp_method = "forward_mode"
        return out

    def _jvp_finite_difference(self, batch: Batch, vecs: list[torch.Tensor]) -> torch.Tensor:
        k = vecs[0].shape[0]
        primals = [p.detach() for p in self._at()]
        out: torch.Tensor | None = None
        with torch.no_grad():
            for j in range(k):
                at_plus, at_minus, inv = central_points(primals, [v[j] for v in vecs], self.fd_eps)
                plus, minus = self._call_at(at_plus, batch), self._call_at(at_minus, batch)
                if out is None:
                    out = torch.empty((k, *plus.shape), dtype=plus.dtype, device=plus.device)
                torch.mul(plus - minus, inv, out=out[j])
        if out is None:
            raise InternalError("out is not None")
        return out

    # -- Jᵀ u -----------------------------------------------------------------------
    def _vjp(
        self, output: torch.Tensor, u: torch.Tensor, retain: bool
    ) -> Sequence[torch.Tensor | None]:
        inputs = self.params if self._upcast is None else self._upcast.params
        grads, self._vjp_batched_ok = batched_backward(
            [output], inputs, [u], retain, self._vjp_batched_ok
        )
        return grads


def check_sandwich(
    forward_fn: object, jvp: object, fd_eps: float | None, curvature: object
) -> None:
    """Refuse a sandwich's arguments that are not what they must be."""
    if not callable(forward_fn):
        raise TypeError("forward_fn must be callable as forward_fn(model, batch) -> output tensor")
    if jvp not in ("auto", "forward_mode", "finite_difference"):
        raise ValueError(f"jvp must be 'auto', 'forward_mode' or 'finite_difference', got {jvp!r}")
    if fd_eps is not None and not fd_eps > 0:
        raise ValueError(f"fd_eps must be positive, got {fd_eps}")
    if not isinstance(curvature, OutputCurvature):
        raise TypeError(
            "curvature must be an output-curvature strategy (loss_fns.output_curvature: ExactLossHessian, "
            f"AutogradLossHessian, MonteCarlo, Empirical), got {type(curvature).__name__}"
        )


def training_buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    """Private copies of the buffers of ``model``'s modules in training mode, named as a
    :class:`CallWithModel` of it names them: such modules update buffers in place (BatchNorm
    statistics), and an extra pass on the copies leaves the user's where they were."""
    return {
        f"model.{mname}.{bname}" if mname else f"model.{bname}": b.detach().clone()
        for mname, m in model.named_modules()
        if m.training
        for bname, b in m.named_buffers(recurse=False)
    }


class SandwichOptions(DataOptions, total=False):
    """:class:`~hessian_eigenthings.operators.base.DataOptions` and how ``J v`` is computed:
    ``jvp`` (``"auto"``, ``"forward_mode"`` or ``"finite_difference"``, default ``"auto"``) and
    ``fd_eps`` (the finite-difference step; default ``None``: by dtype). NOTE [GGN
    Jacobian-vector products]."""

    jvp: JvpMethod
    fd_eps: float | None


# NOTE [exact diagonal]
# With the output-space matrix of a chunk written as Σₙ Σₖ sₙₖ sₙₖᵀ (no terms between
# samples), diag(Σₙ Jₙᵀ Hₙ Jₙ) = Σₙ Σₖ (Jₙᵀ sₙₖ)² elementwise: a vector-Jacobian product
# per sample and column, squared. Samples cannot share a backward (the square of a sum
# is not the sum of squares), so each sample runs alone through torch.func.vmap of
# vjp over the model called on a batch of one (functional_call, the user's module
# untouched); the K columns of a sample go through one vmapped vjp. Samples are taken
# in groups of about 1024 / K to bound the memory of the vmapped backward. A model
# whose samples interact (BatchNorm in training mode) has no per-sample Jacobian and
# is refused. Chunks are weighted by size exactly as the products are, and the MC
# Fisher draws the same targets (seeded by chunk position) as its products.
def _check_exact_diagonal(op: OutputSandwichOperator) -> None:
    """Refuse what has no exact per-sample diagonal (NOTE [exact diagonal])."""
    if op.ranks.world_size > 1:
        raise NotImplementedError(
            "the exact diagonal of a data-parallel operator is not implemented (each rank would see its own "
            "data only); compute it on one process, or use diagonal(op, method='xdiag')"
        )
    op._follow_parameters()  # NOTE [replaced parameters]
    random = op.guard.random_cause()
    if random:
        raise ValueError(f"the exact diagonal needs a deterministic forward, but {random}")
    for name, m in op.model.named_modules():
        if m.training and isinstance(m, nn.modules.batchnorm._BatchNorm):
            raise ValueError(
                f"the exact diagonal needs per-sample Jacobians, but {name or type(m).__name__} is a BatchNorm "
                "in training mode (samples interact through the batch statistics); call model.eval() or use "
                "diagonal(op, method='xdiag')"
            )


@dataclass(frozen=True)
class _CheckedCall:
    """The functional call of the model with its output checked to be a tensor."""

    call: CallWithModel
    check: Callable[[Any], torch.Tensor]


def add_squared_vjps(
    parts: list[torch.Tensor],
    chunk: Batch,
    S: torch.Tensor,
    state: dict[str, torch.Tensor],
    weight: float,
    call: _CheckedCall,
    names: Sequence[str],
    group: int,
) -> None:
    """``parts += weight · Σₙ Σₖ (Jₙᵀ S[n, k])²`` (NOTE [exact diagonal]), ``group`` samples
    per vmapped backward."""
    N = S.shape[0]

    def sample_dims(x: Any) -> int | None:
        return 0 if isinstance(x, torch.Tensor) and x.dim() > 0 and x.shape[0] == N else None

    dims = torch.utils._pytree.tree_map(sample_dims, chunk)

    def one_sample(sample: Batch, cols: torch.Tensor) -> tuple[torch.Tensor, ...]:
        alone = torch.utils._pytree.tree_map(
            lambda x, d: x.unsqueeze(0) if d == 0 else x, sample, dims
        )
        f, primal = selected_function(call.call, names, state, alone)
        vjp_fn = torch.func.vjp(lambda *v: call.check(f(*v)), *primal)[1]
        grads = torch.func.vmap(vjp_fn)(cols.unsqueeze(1))  # K columns, each (1, ...)
        return tuple((g * g).sum(0) for g in grads)

    mapped = torch.func.vmap(one_sample, in_dims=(dims, 0))
    for start in range(0, N, group):
        rows = slice(start, min(N, start + group))
        piece = torch.utils._pytree.tree_map(
            lambda x, d, r=rows: x[r] if d == 0 else x, chunk, dims
        )
        for acc, sq in zip(parts, mapped(piece, S[rows]), strict=True):
            acc.add_(sq.sum(0), alpha=weight)
