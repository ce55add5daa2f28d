"""The output-space curvature ``H`` that the GGN, the empirical Fisher and the Kronecker
factor pass sandwich between output Jacobians: one axis, four strategies.

Every Fisher type of the library is ``Σ Jᵀ H J`` for some output ``f`` and some ``H``:

- :class:`ExactLossHessian`: ``H = ∇²_f ℓ`` in closed form (the loss's ``.hvp``); the GGN
  and KFAC's type-2 Fisher.
- :class:`AutogradLossHessian`: the same ``H`` by a double backward through the loss only.
- :class:`MonteCarlo`: ``H̃ = w · mean_s g_s g_sᵀ`` over ``k`` targets drawn from the model's
  predictive distribution (``g_s`` the loss gradient at a draw); the MC Fisher.
- :class:`Empirical`: ``H̃ = w · g gᵀ`` per term at the observed targets; KFAC's empirical
  Fisher. :class:`EmpiricalOfLosses` is the empirical Fisher written on the per-sample
  losses themselves (``H = I/N``), what ``EmpiricalFisherOperator`` sandwiches.

A strategy has three parts: ``prepare(output, batch, key) -> state`` once per batch (the
operators keep the state across products), ``apply(state, u)`` for a block ``u`` of shape
``(k, *output.shape)`` (the product path: no host sync, no allocation beyond the result), and
``columns(state, dtype)``: ``k`` and ``columns(start, stop)`` with ``H = Σ_c s_c s_cᵀ`` over
batch-wide columns (the Kronecker factor pass backpropagates them). ``sample_columns(state)``
gives the same factorization per sample for the exact diagonal, and ``traced_apply`` is the
product as one traceable function for the functional and compiled engines.

One key per chunk of a pass, :func:`draw_key` of (seed, rank, position): the GGN, its
exact diagonal and KFAC's factor pass draw the same targets for one seed. See NOTE [sampled
targets as data] in ``operators.ggn``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from hessian_eigenthings._checks import InternalError, check_count
from hessian_eigenthings.batching import Batch
from hessian_eigenthings.loss_fns.protocols import (
    HessianColumnsLoss,
    KeyedSampledFisherLoss,
    LossOfOutputFn,
    OutputHessianLoss,
    OutputHessianSqrtLoss,
    SampledFisherLoss,
    SampledFisherSqrtLoss,
)
from hessian_eigenthings.loss_fns.standard import Columns

__all__ = [
    "AutogradLossHessian",
    "Columns",
    "DrawKey",
    "Empirical",
    "EmpiricalOfLosses",
    "ExactLossHessian",
    "MonteCarlo",
    "OutputCurvature",
    "draw_key",
]


def draw_key(seed: int, position: int, rank: int = 0) -> int:
    """The one key derivation of every Monte-Carlo draw: chunk ``position`` of a pass, on
    process ``rank``, for the operator's ``seed``."""
    return ((seed * 1_000_003 + rank) * 1_000_033 + position) % 2**62


@dataclass(frozen=True)
class DrawKey:
    """A chunk's key as a number (for a generator) and as a 0-d int64 tensor (for counter-based
    draws; the same tensor object per position, so a traced program sees the same input)."""

    value: int
    tensor: torch.Tensor


class DrawKeys:
    """The key tensors of one operator, made once per (value, device)."""

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self._made: dict[int, torch.Tensor] = {}

    def __call__(self, position: int, rank: int, device: torch.device) -> DrawKey:
        value = draw_key(self.seed, position, rank)
        key = self._made.get(value)
        if key is None or key.device != device:
            key = torch.tensor(value, dtype=torch.int64, device=device)
            self._made[value] = key
        return DrawKey(value, key)


class OutputCurvature:
    """One choice of ``H`` (module docstring). Subclasses write ``prepare`` and ``apply``;
    ``columns`` and ``sample_columns`` where a factorization is known."""

    #: whether the draws depend on the key (the traced engines then take it as an input)
    keyed: bool = False
    #: whether ``sample_columns`` has about one column per output entry (else a few per sample)
    columns_scale_with_output: bool = True

    def prepare(self, output: torch.Tensor, batch: Batch, key: DrawKey | None) -> Any:
        """What ``apply`` needs for this batch's ``output`` (computed once, kept)."""
        raise NotImplementedError

    def apply(self, state: Any, u: torch.Tensor) -> torch.Tensor:
        """``H u`` for a block ``u`` of shape ``(k, *output.shape)``."""
        raise NotImplementedError

    def columns(self, state: Any, dtype: torch.dtype) -> tuple[int, Columns]:
        """``k`` and the batch-wide columns ``s_c`` of ``H = Σ_c s_c s_cᵀ``, a chunk at a time;
        ``dtype``: that of the sums they enter (the Kronecker factors)."""
        raise NotImplementedError(f"{self!r} gives no columns of its output curvature")

    def row_columns(self, state: Any, dtype: torch.dtype) -> tuple[int, Columns]:
        """Columns whose per-sample parts add up to each sample's own ``H`` with no term that
        joins two of its rows (NOTE [columns row by row]): :meth:`columns` itself, for draws
        (independent per row: such terms have mean zero) and the empirical Fisher (whose
        objective is the sample's whole gradient)."""
        return self.columns(state, dtype)

    def sample_columns(self, state: Any) -> torch.Tensor:
        """``S (N, K, *output.shape[1:])`` with ``H = Σₙ Σₖ sₙₖ sₙₖᵀ``, ``sₙₖ`` at sample ``n``
        (see ``loss_fns.protocols.OutputHessianSqrtLoss``)."""
        raise NotImplementedError(f"{self!r} has no per-sample square root")

    def traced_apply(
        self, output: torch.Tensor, batch: Batch, key: torch.Tensor | None, u: torch.Tensor
    ) -> torch.Tensor:
        """``H u`` for one direction ``u`` shaped like ``output``, as one traceable function."""
        state = self.prepare(output, batch, None if key is None else DrawKey(0, key))
        return self.apply(state, u.unsqueeze(0))[0]

    def traced_blocker(self) -> str | None:
        """Why ``traced_apply`` cannot run, or ``None``."""
        return None


def _term_weight(loss: object, out: torch.Tensor, batch: Batch, dtype: torch.dtype) -> torch.Tensor:
    """The reduction's weight per loss term (0-dim, ``dtype``), from the loss."""
    return _columns_loss(loss).term_weight(out, batch, dtype)[0]


def _columns_loss(loss: object) -> HessianColumnsLoss:
    if not isinstance(loss, HessianColumnsLoss):
        raise ValueError(
            f"columns of the output curvature need a loss that factors its Hessian (.term_weight and "
            "hessian_columns, see loss_fns.protocols.HessianColumnsLoss: cross_entropy_loss_of_output(), "
            f"mse_loss_of_output(), supervised_loss_of_output(...)); got {loss!r}"
        )
    return loss


# NOTE [columns row by row]: a loss's batch-wide columns ``s_c`` (``columns``) cover every row
# of the output at once (the tokens of a sequence, one class column each), so within a sample
# ``Σ_c s_c s_cᵀ`` holds terms joining two of its rows that the loss Hessian, block-diagonal over
# rows, does not. KFAC's factors take them as the expand approximation takes the positions (as
# curvlinops does); a per-sample second moment does not: EK-FAC's corrected eigenvalues are the
# diagonal of the GGN in KFAC's eigenbasis only if each column sits on one row of a sample
# (measured on a one-layer GPT-2 of 11 words: up to 5.8× that diagonal with the columns whole,
# the diagonal to rounding split). ``row_columns`` splits each column into one per row (the
# rows: every output index but the batch's and the loss's ``column_dim``, its classes or
# units), ``k·T`` columns for ``T`` rows per sample: that many backwards per batch, in chunks of
# ``column_chunk``. Draws need no split (independent per row: the joining terms have mean zero),
# nor the empirical Fisher (its per-sample gradient is the objective's own).
def split_by_row(
    k: int, columns: Columns, output: torch.Tensor, column_dim: int | None, loss: object
) -> tuple[int, Columns]:
    """``k`` batch-wide columns as ``k·T`` columns, column ``c·T + t`` on row ``t`` alone
    (NOTE [columns row by row]); unchanged for one row per sample."""
    if output.dim() <= 2:
        return k, columns
    if column_dim is None:
        raise ValueError(
            f"{loss!r} gives batch-wide columns over an output of {output.dim() - 1} dimensions per "
            "sample without saying which dimension holds its classes or units (.column_dim), so "
            "they cannot be split row by row for per-sample moments (EK-FAC's type-2 "
            "eigenvalues); set column_dim on the loss, or use fisher_type='mc' or 'empirical'"
        )
    cd = column_dim % output.dim()
    rows = torch.zeros((), dtype=torch.long, device=output.device)
    T = 1
    for d in range(1, output.dim()):
        if d == cd:
            continue
        n = output.shape[d]
        shape = [1] * output.dim()
        shape[d] = n
        rows = rows * n + torch.arange(n, device=output.device).view(shape)
        T *= n
    if T == 1:
        return k, columns
    lead = (-1, *([1] * output.dim()))

    def split(a: int, b: int) -> torch.Tensor:
        first = a // T
        base = columns(first, (b - 1) // T + 1)
        picked = torch.tensor([j // T - first for j in range(a, b)], device=base.device)
        on = torch.tensor([j % T for j in range(a, b)], device=base.device).view(lead)
        return base.index_select(0, picked) * (rows.unsqueeze(0) == on).to(base.dtype)

    return k * T, split


def _hessian_sqrt(loss: object, output: torch.Tensor, batch: Batch) -> torch.Tensor:
    """The loss's per-sample square root of its Hessian, checked (``OutputHessianSqrtLoss``)."""
    if not isinstance(loss, OutputHessianSqrtLoss):
        raise TypeError(
            f"the exact GGN diagonal needs a square root of the loss Hessian, and {loss!r} has none "
            "(.hessian_sqrt, see loss_fns.protocols.OutputHessianSqrtLoss); use supervised_loss_of_output("
            "nn.CrossEntropyLoss() / nn.MSELoss() / nn.BCEWithLogitsLoss()), mc_samples=k, or "
            "diagonal(op, method='xdiag') for an estimate"
        )
    S = loss.hessian_sqrt(output, batch)
    if (
        S.dim() != output.dim() + 1
        or S.shape[0] != output.shape[0]
        or S.shape[2:] != output.shape[1:]
    ):
        raise ValueError(
            f"{loss!r}.hessian_sqrt returned shape {tuple(S.shape)} for an output of shape "
            f"{tuple(output.shape)}; it must be (N, K, *output.shape[1:])"
        )
    return S


@dataclass
class LossAt:
    """A loss's state at one batch: the detached output and the batch."""

    output: torch.Tensor
    batch: Batch


class ExactLossHessian(OutputCurvature):
    """``H = ∇²_f ℓ`` by the loss's closed-form ``.hvp`` (:class:`OutputHessianLoss`)."""

    def __init__(self, loss: OutputHessianLoss) -> None:
        self.loss = loss

    def prepare(self, output: torch.Tensor, batch: Batch, key: DrawKey | None) -> LossAt:
        return LossAt(output.detach(), batch)

    def apply(self, state: LossAt, u: torch.Tensor) -> torch.Tensor:
        hu = self.loss.hvp(state.output, state.batch, u)
        if not isinstance(hu, torch.Tensor) or hu.shape != u.shape:
            got = tuple(hu.shape) if isinstance(hu, torch.Tensor) else type(hu).__name__
            raise ValueError(
                f"{self.loss!r}.hvp returned {got} for u of shape {tuple(u.shape)}; it must keep u's shape"
            )
        return hu

    def traced_apply(
        self, output: torch.Tensor, batch: Batch, key: torch.Tensor | None, u: torch.Tensor
    ) -> torch.Tensor:
        return self.loss.hvp(output, batch, u.unsqueeze(0))[0]

    def columns(self, state: LossAt, dtype: torch.dtype) -> tuple[int, Columns]:
        return _columns_loss(self.loss).hessian_columns(state.output, state.batch, dtype)

    def row_columns(self, state: LossAt, dtype: torch.dtype) -> tuple[int, Columns]:
        """:meth:`columns` split row by row (NOTE [columns row by row])."""
        loss = _columns_loss(self.loss)
        k, columns = loss.hessian_columns(state.output, state.batch, dtype)
        return split_by_row(k, columns, state.output, getattr(loss, "column_dim", None), loss)

    def sample_columns(self, state: LossAt) -> torch.Tensor:
        return _hessian_sqrt(self.loss, state.output, state.batch)

    def __repr__(self) -> str:
        return f"ExactLossHessian({self.loss!r})"


@dataclass
class LossGraph:
    """``∇_f ℓ`` with its graph (``create_graph``) at the detached output ``leaf``."""

    grad: torch.Tensor
    leaf: torch.Tensor
    batch: Batch


class AutogradLossHessian(OutputCurvature):
    """``H = ∇²_f ℓ`` by a double backward through the loss only (any scalar loss)."""

    def __init__(self, loss: LossOfOutputFn) -> None:
        self.loss = loss

    def _scalar(self, value: Any) -> torch.Tensor:
        if not isinstance(value, torch.Tensor) or value.numel() != 1:
            shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
            raise ValueError(
                f"loss_of_output_fn must return a scalar (the mean loss of the batch), got {shape}"
            )
        return value.reshape(())

    def prepare(self, output: torch.Tensor, batch: Batch, key: DrawKey | None) -> LossGraph:
        leaf = output.detach().requires_grad_(True)
        (grad,) = torch.autograd.grad(self._scalar(self.loss(leaf, batch)), leaf, create_graph=True)
        return LossGraph(grad, leaf, batch)

    def apply(self, state: LossGraph, u: torch.Tensor) -> torch.Tensor:
        grad, leaf = state.grad, state.leaf
        if not grad.requires_grad:  # the loss is linear in the output: H = 0
            return torch.zeros_like(u)
        # the loss graph is small and belongs to this state: kept for graph reuse
        if u.shape[0] == 1:
            (hu,) = torch.autograd.grad(grad, leaf, u[0], retain_graph=True, allow_unused=True)
            return torch.zeros_like(u) if hu is None else hu.unsqueeze(0)
        (hu,) = torch.autograd.grad(
            grad, leaf, u, is_grads_batched=True, retain_graph=True, allow_unused=True
        )
        return torch.zeros_like(u) if hu is None else hu

    def traced_apply(
        self, output: torch.Tensor, batch: Batch, key: torch.Tensor | None, u: torch.Tensor
    ) -> torch.Tensor:
        def scalar(o: torch.Tensor) -> torch.Tensor:
            return self._scalar(self.loss(o, batch))

        hu: torch.Tensor = torch.func.jvp(torch.func.grad(scalar), (output,), (u,))[1]
        return hu

    def sample_columns(self, state: LossGraph) -> torch.Tensor:
        return _hessian_sqrt(self.loss, state.leaf.detach(), state.batch)

    def __repr__(self) -> str:
        return f"AutogradLossHessian({self.loss!r})"


@dataclass
class Draws:
    """A batch's loss gradients at drawn (or observed) targets, ``(k, *output.shape)``."""

    output: torch.Tensor
    batch: Batch
    grads: torch.Tensor


class MonteCarlo(OutputCurvature):
    """``H̃ = w · mean_s g_s g_sᵀ`` over ``samples`` targets per sample drawn from the model's
    predictive distribution (:class:`SampledFisherLoss`); draws are a function of the key."""

    keyed = True

    def __init__(self, loss: SampledFisherLoss, samples: int = 1) -> None:
        if not isinstance(loss, SampledFisherLoss):
            raise ValueError(
                f"Monte-Carlo draws sample targets from the model's predictive distribution; {loss!r} cannot "
                "(no .sample_grads, see loss_fns.SampledFisherLoss). Use supervised_loss_of_output(...) of "
                "nn.CrossEntropyLoss(), nn.MSELoss() or nn.BCEWithLogitsLoss()"
            )
        self.loss = loss
        #: draws per sample: 0 would average no draws (every product NaN), a negative count is none
        self.samples: int = check_count("MonteCarlo(samples=...)", samples, minimum=1)

    def draw(self, output: torch.Tensor, batch: Batch, key: DrawKey | None) -> torch.Tensor:
        """The loss gradients at this chunk's draws (NOTE [sampled targets as data] in ``operators.ggn``)."""
        if key is None:
            raise ValueError(
                "Monte-Carlo draws need a key (see loss_fns.output_curvature.draw_key)"
            )
        if isinstance(self.loss, KeyedSampledFisherLoss):  # the traced engines' draws exactly
            return self.loss.keyed_sample_grads(output, batch, self.samples, key.tensor)
        generator = torch.Generator(device=output.device)
        generator.manual_seed(key.value)
        return self.loss.sample_grads(output, batch, self.samples, generator)

    def prepare(self, output: torch.Tensor, batch: Batch, key: DrawKey | None) -> Draws:
        out = output.detach()
        return Draws(out, batch, self.draw(out, batch, key))

    def apply(self, state: Draws, u: torch.Tensor) -> torch.Tensor:
        return self.loss.sampled_hvp(state.output, state.batch, state.grads, u)

    def traced_apply(
        self, output: torch.Tensor, batch: Batch, key: torch.Tensor | None, u: torch.Tensor
    ) -> torch.Tensor:
        if not (isinstance(self.loss, KeyedSampledFisherLoss) and key is not None):
            raise InternalError("isinstance(self.loss, KeyedSampledFisherLoss) and key is not None")
        grads = self.loss.keyed_sample_grads(output.detach(), batch, self.samples, key)
        return self.loss.sampled_hvp(output, batch, grads, u.unsqueeze(0))[0]

    def traced_blocker(self) -> str | None:
        if isinstance(self.loss, KeyedSampledFisherLoss):
            return None
        return (
            f"mc_samples={self.samples} with a loss whose draws are not a function of a key "
            "(no .keyed_sample_grads, see loss_fns.KeyedSampledFisherLoss) runs on engine='autograd'"
        )

    def columns(self, state: Draws, dtype: torch.dtype) -> tuple[int, Columns]:
        w = _term_weight(self.loss, state.output, state.batch, dtype)
        sampled = (state.grads * (w / self.samples).sqrt()).to(state.output.dtype)
        return self.samples, lambda a, b: sampled[a:b]

    def sample_columns(self, state: Draws) -> torch.Tensor:
        if not isinstance(self.loss, SampledFisherSqrtLoss):
            raise TypeError(
                f"the exact diagonal of the Monte-Carlo Fisher needs {self.loss!r} to give the square root of "
                "its sampled Hessian (.sampled_hessian_sqrt, see loss_fns.protocols.SampledFisherSqrtLoss)"
            )
        return self.loss.sampled_hessian_sqrt(state.output, state.batch, state.grads)

    def __repr__(self) -> str:
        return f"MonteCarlo({self.loss!r}, samples={self.samples})"


@dataclass
class Observed(Draws):
    """:class:`Draws` at the observed targets, and the mean loss's gradient they came from."""

    mean_grad: torch.Tensor


class Empirical(MonteCarlo):
    """``H̃ = w · g gᵀ`` per loss term, ``g`` the term's gradient at the observed targets:
    the empirical Fisher written on the model output (one "draw": the data's own targets)."""

    keyed = False

    def __init__(self, loss: SampledFisherLoss) -> None:
        super().__init__(loss, 1)

    def prepare(self, output: torch.Tensor, batch: Batch, key: DrawKey | None) -> Observed:
        leaf = output.detach().requires_grad_(True)
        with torch.enable_grad():
            (grad,) = torch.autograd.grad(self.loss(leaf, batch), leaf)  # type: ignore[operator]
        # the mean loss's gradient is w times a term's: divide the reduction's weight out
        w = _term_weight(self.loss, leaf, batch, grad.dtype)
        return Observed(output.detach(), batch, (grad / w).unsqueeze(0), grad)

    def columns(self, state: Observed, dtype: torch.dtype) -> tuple[int, Columns]:  # type: ignore[override]
        w = _term_weight(self.loss, state.output, state.batch, dtype)
        column = (state.mean_grad / w.sqrt()).unsqueeze(0).to(state.output.dtype)
        return 1, lambda a, b: column[a:b]

    def traced_apply(
        self, output: torch.Tensor, batch: Batch, key: torch.Tensor | None, u: torch.Tensor
    ) -> torch.Tensor:
        return OutputCurvature.traced_apply(self, output, batch, key, u)

    def traced_blocker(self) -> str | None:
        return "the empirical output curvature differentiates the loss while preparing; it runs on engine='autograd'"

    def __repr__(self) -> str:
        return f"Empirical({self.loss!r})"


@dataclass
class LossCount:
    """The per-sample losses of a batch (detached) and their number ``N``."""

    output: torch.Tensor
    n: torch.Tensor | int


class EmpiricalOfLosses(OutputCurvature):
    """``H = I / N`` on the per-sample losses ``ℓ`` as the output (the Hessian of ``‖ℓ‖²/2N``):
    ``Jᵀ H J = (1/N) Σᵢ gᵢgᵢᵀ``, the empirical Fisher. ``count(batch, output)`` is ``N``;
    ``counted``: the losses count their own samples (tokens), not one per row."""

    columns_scale_with_output = False  # one column per sample, whatever the loss's shape

    def __init__(
        self,
        count: Callable[[Batch, torch.Tensor], torch.Tensor | int],
        *,
        counted: bool,
        name: str = "the loss",
    ) -> None:
        self.count = count
        self.counted = counted
        self.name = name  # for messages

    def prepare(self, output: torch.Tensor, batch: Batch, key: DrawKey | None) -> LossCount:
        return LossCount(output.detach(), self.count(batch, output))

    def apply(self, state: LossCount, u: torch.Tensor) -> torch.Tensor:
        return u / state.n

    def traced_apply(
        self, output: torch.Tensor, batch: Batch, key: torch.Tensor | None, u: torch.Tensor
    ) -> torch.Tensor:
        return u / self.count(batch, output)

    def sample_columns(self, state: LossCount) -> torch.Tensor:
        # one column 1/√N per sample
        if self.counted:
            raise ValueError(
                f"the exact diagonal of the empirical Fisher needs one loss per row of the batch; {self.name} "
                "counts its own samples (tokens): use diagonal(op, method='xdiag') for an estimate"
            )
        return torch.full_like(state.output, state.output.shape[0] ** -0.5).unsqueeze(1)

    def __repr__(self) -> str:
        return f"EmpiricalOfLosses(counted={self.counted})"
