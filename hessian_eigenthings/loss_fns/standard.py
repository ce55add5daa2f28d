"""Loss helpers for supervised batches ``(inputs, targets)``.

- ``supervised_loss(criterion)``: ``(model, batch) -> criterion(model(x), y)``
  for the Hessian.
- ``supervised_forward`` and ``supervised_loss_of_output(criterion)``: the
  same loss split at the model output, for the GGN. Cross-entropy and MSE
  with ``reduction="mean"`` or ``"sum"`` come back as closed-form
  :class:`~hessian_eigenthings.loss_fns.protocols.OutputHessianLoss` objects:

  - cross-entropy: ``∇²_z = (diag p − p pᵀ)/n`` per row (the label does not
    enter; label smoothing does not change it), rows with
    ``target == ignore_index`` left out, ``n`` = rows that count (mean) or 1
    (sum); applied by :func:`hessian_eigenthings.kernels.cross_entropy_hvp`.
  - MSE: ``∇² = 2 I / numel`` (mean over all elements) or ``2 I`` (sum).

  Any other criterion is differentiated twice by the operator.
- ``supervised_per_sample_loss(criterion)``: ``(model, batch) -> (N,)``, the
  criterion's own reduction applied to each sample alone, for the empirical
  Fisher.
"""

from __future__ import annotations

import copy
import weakref
from collections.abc import Callable, Mapping
from typing import Literal, TypeVar

import torch
import torch.nn.functional as F
from torch import nn

from hessian_eigenthings.batching import Batch
from hessian_eigenthings.loss_fns._cross_entropy import (
    IGNORE_INDEX,
    Impl,
    check_impl,
    cross_entropy_hvp_block,
)
from hessian_eigenthings.loss_fns.counter_rng import counter_normal, counter_uniform
from hessian_eigenthings.loss_fns.protocols import LossFn, LossOfOutputFn, PerSampleLossFn

Criterion = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
Reduction = Literal["mean", "sum"]
#: cross-entropy's reductions: ``"batchmean"`` sums the terms of each sample (the tokens of a
#: sequence) and averages over the samples (``output.shape[0]``), as influence's per-sequence loss
CrossEntropyReduction = Literal["mean", "sum", "batchmean"]
_F = TypeVar("_F", bound=Callable[..., object])


#: the callables of this module that read batches ``(inputs, targets)``: a label for messages, and
#: whether they call ``model(inputs)`` (the first-batch check of ``loss_fns.checks`` reads this)
SUPERVISED_READERS: weakref.WeakKeyDictionary[Callable[..., object], tuple[str, bool]] = (
    weakref.WeakKeyDictionary()
)


def _reads_supervised(label: str, *, calls_model: bool) -> Callable[[_F], _F]:
    def mark(fn: _F) -> _F:
        SUPERVISED_READERS[fn] = (label, calls_model)
        return fn

    return mark


def describe_batch(batch: object) -> str:
    """A few words on what a batch is, for messages: ``a Tensor of shape (8, 5)``,
    ``a dict with keys ['input_ids', 'labels']``, ``a list of length 1``."""
    if isinstance(batch, torch.Tensor):
        return f"a Tensor of shape {tuple(batch.shape)}"
    if isinstance(batch, Mapping) or (hasattr(batch, "keys") and hasattr(batch, "__getitem__")):
        return f"a {type(batch).__name__} with keys {list(batch.keys())}"
    if isinstance(batch, (tuple, list)):
        return f"a {type(batch).__name__} of length {len(batch)}"
    return f"a {type(batch).__name__}"


def unreadable_batch_hint(batch: object) -> str:
    """What to do when a supervised helper meets a batch that is not ``(inputs, targets)``."""
    if isinstance(batch, torch.Tensor):
        return (
            "If you passed one batch (x, y) as the data, put it in a list: did you mean [(x, y)]? "
            "For batches without targets write your own loss_fn(model, batch)"
        )
    if isinstance(batch, Mapping) or (hasattr(batch, "keys") and hasattr(batch, "__getitem__")):
        return (
            "For HuggingFace batches use hf_lm_loss() (hf_lm_forward() and hf_lm_loss_of_output() for "
            "the GGN); for other layouts write your own loss_fn(model, batch)"
        )
    return "Write your own loss_fn(model, batch) for other layouts"


def _inputs_targets(batch: Batch) -> tuple[object, torch.Tensor]:
    if not isinstance(batch, (tuple, list)) or len(batch) < 2:
        raise TypeError(
            f"supervised loss helpers expect batches (inputs, targets); got {describe_batch(batch)}. "
            + unreadable_batch_hint(batch)
        )
    return batch[0], batch[1]


# NOTE [targets checked against the criterion]
# Labels out of range for cross-entropy, float labels where it wants class indices, integer
# labels for MSELoss, a model that returns a tuple: torch says so many frames into the first
# product, in its own words (or, for the GGN's closed-form cross-entropy, not at all: its Hessian
# does not read the labels). The helpers of this module know their criterion, so they say it in
# one line with the fix. What the first batch alone tells (dtypes, shapes, negative labels) is
# checked when an operator is built (`check_first_targets`, called by the data operators with the
# batch BatchSource.first_batch read); what needs the model's output (a tensor, the number of
# classes) on the helper's first call, once: the label range costs one host sync, on that call
# only. Every call checks that the output is a tensor (no sync). A call under a trace (a dispatch
# mode, a functorch transform, torch.compile) or a CUDA-graph capture skips the value checks and
# leaves them to the next plain call, so no sync is recorded into a traced or captured product.


def _concrete(t: torch.Tensor) -> bool:
    """Whether ``t``'s values can be read now without recording the read into a trace."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    if t.device.type == "meta" or torch.compiler.is_compiling():
        return False
    if _get_current_dispatch_mode() is not None:
        return False
    if torch._C._functorch.peek_interpreter_stack() is not None:
        return False
    return not (t.is_cuda and torch.cuda.is_current_stream_capturing())


def _dtype(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def _what(obj: object) -> str:
    if isinstance(obj, (tuple, list)):
        return f"a {type(obj).__name__} of {len(obj)} items"
    return f"a {type(obj).__name__}"


#: criteria that take class indices (cross-entropy also takes class probabilities shaped like the logits)
_CLASS_CRITERIA: tuple[type, ...] = (nn.CrossEntropyLoss, nn.NLLLoss)
#: criteria that take real-valued targets shaped like the output
_VALUE_CRITERIA: tuple[type, ...] = (
    nn.MSELoss,
    nn.L1Loss,
    nn.SmoothL1Loss,
    nn.HuberLoss,
    nn.BCEWithLogitsLoss,
    nn.BCELoss,
)


class TargetCheck:
    """What a helper's criterion takes as targets, checked on the first batch (NOTE [targets
    checked against the criterion]). ``label`` names the helper in messages
    (``supervised_loss(CrossEntropyLoss)``); ``source`` what produced the output."""

    def __init__(
        self,
        label: str,
        criterion: str,
        kind: Literal["classes", "probabilities", "values"],
        *,
        ignore_index: int | None = None,
        source: str = "the model",
    ) -> None:
        self.label = label
        self.criterion = criterion
        self.kind = kind
        self.ignore_index = ignore_index
        self.source = source
        self._checked = False
        #: the first batch's smallest and largest counted label, read when an operator was built
        #: (``targets``, one host sync there), so that the first product compares it with the
        #: output's classes without a sync; ``False``: not read
        self._span: tuple[int, int] | Literal[False] | None = False

    @classmethod
    def of(cls, label: str, criterion: object, *, source: str = "the model") -> TargetCheck | None:
        """The check for an ``nn`` criterion this module knows, None for any other callable."""
        name = type(criterion).__name__
        if isinstance(criterion, _CLASS_CRITERIA):
            kind: Literal["classes", "probabilities", "values"] = (
                "probabilities" if isinstance(criterion, nn.CrossEntropyLoss) else "classes"
            )
            index = getattr(criterion, "ignore_index", None)
            return cls(label, name, kind, ignore_index=index, source=source)
        if isinstance(criterion, _VALUE_CRITERIA):
            return cls(label, name, "values", source=source)
        return None

    def targets(self, y: object, *, values: bool = True) -> None:
        """The targets' dtype and shape and, with ``values``, no negative class index (one host
        sync)."""
        if not isinstance(y, torch.Tensor):
            return
        shape = tuple(y.shape)
        if self.kind == "values":
            if not (y.is_floating_point() or y.is_complex()):
                hint = (
                    ""
                    if "BCE" in self.criterion
                    else " (or nn.CrossEntropyLoss() for class indices)"
                )
                raise TypeError(
                    f"{self.label}: {self.criterion} got {_dtype(y)} labels of shape {shape}; "
                    f"convert them with .float(){hint}"
                )
            return
        if y.is_floating_point():
            if self.kind == "probabilities" and y.dim() >= 2:
                return  # class probabilities, shaped like the logits (torch compares the shapes)
            probabilities = (
                " (float targets are class probabilities, shaped like the logits (N, C))"
                if self.kind == "probabilities"
                else ""
            )
            raise TypeError(
                f"{self.label}: labels must be class indices (int64); got {_dtype(y)} labels of shape "
                f"{shape}: convert them with .long(){probabilities}"
            )
        if y.dtype not in (torch.int64, torch.uint8):
            raise TypeError(
                f"{self.label}: labels must be class indices as int64; got {_dtype(y)} labels of "
                f"shape {shape}: convert them with .long()"
            )
        if values and _concrete(y):
            span = self._range(y)
            self._negative(span)
            self._span = span

    def _negative(self, span: tuple[int, int] | None) -> None:
        if span is not None and span[0] < 0:
            raise ValueError(
                f"{self.label}: labels must be class indices >= 0 (or ignore_index={self.ignore_index}); "
                f"got {span[0]}"
            )

    def _range(self, y: torch.Tensor) -> tuple[int, int] | None:
        """Smallest and largest label that counts, None when none does (one host sync)."""
        y = y.reshape(-1).long()
        if not y.numel():
            return None
        valid = (
            y != self.ignore_index
            if self.ignore_index is not None
            else torch.ones_like(y, dtype=torch.bool)
        )
        low = torch.where(valid, y, torch.iinfo(torch.int64).max).min()
        high = torch.where(valid, y, torch.iinfo(torch.int64).min).max()
        low_, high_, counted = torch.stack([low, high, valid.any().long()]).tolist()
        return (int(low_), int(high_)) if counted else None

    def output(self, output: object, y: object) -> None:
        """On every call, that the output is a tensor (no sync); on the first plain call, the
        targets and the class range against the output (one host sync)."""
        if not isinstance(output, torch.Tensor):
            wanted = "logits" if self.kind != "values" else "predictions"
            fix = (
                f"wrap the model so that it returns the {wanted} (a module whose forward returns "
                "model(x)[0])"
                if self.source == "the model"
                else f"pass a forward_fn that returns the {wanted}, e.g. lambda model, batch: model(batch[0])[0]"
            )
            raise TypeError(
                f"{self.label}: {self.source} returned {_what(output)}, not a tensor; {fix}"
            )
        if self._checked or not isinstance(y, torch.Tensor) or not _concrete(y):
            return
        self._checked = True
        self.targets(y, values=False)
        if self.kind == "values" or y.is_floating_point() or output.dim() < 1:
            return
        classes = output.shape[1] if output.dim() >= 2 else output.shape[0]
        if self._span is False:  # not read at construction: one host sync, on this call only
            span = self._range(y)
            self._negative(span)
        else:
            span = self._span
        if span is not None and span[1] >= classes:
            raise ValueError(
                f"{self.label}: labels must be class indices in [0, {classes}) (int64); got values "
                f"up to {span[1]}"
            )


#: the checks of the closures this module returns (the classes below carry theirs as ``targets_check``)
TARGET_CHECKS: weakref.WeakKeyDictionary[Callable[..., object], TargetCheck] = (
    weakref.WeakKeyDictionary()
)


def target_check(fn: object) -> TargetCheck | None:
    """The :class:`TargetCheck` of one of this module's helpers, None for anything else."""
    check = getattr(fn, "targets_check", None)
    if isinstance(check, TargetCheck):
        return check
    try:
        return TARGET_CHECKS.get(fn) if callable(fn) else None
    except TypeError:  # not weak-referenceable: not one of ours
        return None


def check_first_targets(batch: Batch | None, *fns: object) -> None:
    """Raise when the targets of ``batch`` (the data's first batch) cannot be what the criteria
    of this module's helpers among ``fns`` take (NOTE [targets checked against the criterion]);
    other callables and batches that are not ``(inputs, targets)`` pass."""
    if not isinstance(batch, (tuple, list)) or len(batch) < 2:
        return
    for fn in fns:
        check = target_check(fn)
        if check is not None:
            check.targets(batch[1])


def _class_call(cls: type) -> str:
    """How the user would write an instance of ``cls``: ``nn.CrossEntropyLoss()``, ``MyLoss()``."""
    if getattr(nn, cls.__name__, None) is cls:
        return f"nn.{cls.__name__}()"
    return f"{cls.__name__}()"


def check_criterion(criterion: object, *, name: str = "criterion") -> None:
    """Raise ``TypeError`` unless ``criterion`` can be called as ``criterion(output, target)``.

    A class (``nn.CrossEntropyLoss`` for ``nn.CrossEntropyLoss()``) is callable too, but calling it
    builds a module: without this check the mistake surfaces deep inside the first product.
    """
    if isinstance(criterion, type):
        raise TypeError(
            f"{name} got the class {_class_call(criterion)[:-2]}, not a criterion; "
            f"pass an instance: {_class_call(criterion)}"
        )
    if not callable(criterion):
        raise TypeError(
            f"criterion must be callable as criterion(output, target), got {type(criterion).__name__}"
        )


def _check_reduction(reduction: str) -> None:
    if reduction not in ("mean", "sum"):
        raise ValueError(
            f"reduction must be 'mean' or 'sum' (a curvature needs a scalar loss), got {reduction!r}"
        )


@_reads_supervised("supervised_forward", calls_model=True)
def supervised_forward(model: nn.Module, batch: Batch) -> torch.Tensor:
    """``model(inputs)`` for a batch ``(inputs, targets)``."""
    x, _ = _inputs_targets(batch)
    return model(x)


def supervised_loss(criterion: Criterion) -> LossFn:
    """``loss_fn(model, (x, y)) = criterion(model(x), y)``."""
    check_criterion(criterion, name="supervised_loss")
    check = TargetCheck.of(f"supervised_loss({type(criterion).__name__})", criterion)

    @_reads_supervised("supervised_loss(...)", calls_model=True)
    def loss_fn(model: nn.Module, batch: Batch) -> torch.Tensor:
        x, y = _inputs_targets(batch)
        output = model(x)
        if check is not None:
            check.output(output, y)
        return criterion(output, y)

    if check is not None:
        TARGET_CHECKS[loss_fn] = check
    return loss_fn


def _key_from(generator: torch.Generator, device: torch.device) -> torch.Tensor:
    """A counter key (0-d int64 on ``device``) drawn from ``generator``."""
    key = torch.randint(
        0, 2**62, (), generator=generator, device=generator.device, dtype=torch.int64
    )
    return key.to(device)


def _per_sample_output(output: torch.Tensor) -> None:
    if output.dim() < 1:
        raise ValueError(
            "a per-sample square root of the loss Hessian needs a batched output (N, ...), got a scalar"
        )


def _rowwise_sqrt(factor: torch.Tensor, output: torch.Tensor) -> torch.Tensor:
    """Factor columns of a loss whose Hessian is block diagonal over positions, laid out per sample.

    ``factor`` is ``(N, P, r, C)``: for sample n and position t (the P entries of the dimensions
    after the class dimension 1 of ``output``), r columns over the C classes. The result is
    ``(N, r·P, *output.shape[1:])``: column (j, t) holds position t's j-th column at t, zeros
    elsewhere (the Hessian has no terms between positions).
    """
    N, P, r, _ = factor.shape
    if output.dim() <= 2:  # (N, C): one position per sample
        return factor[:, 0]
    # out[n, j, t, c, t'] = δ(t, t') factor[n, t, j, c]
    spread = torch.diag_embed(factor.permute(0, 2, 3, 1))  # (N, r, C, P, P)
    return spread.permute(0, 1, 3, 2, 4).reshape(N, r * P, *output.shape[1:])


def _elementwise_sqrt(scale: torch.Tensor) -> torch.Tensor:
    """Square root of a diagonal loss Hessian ``diag(scale)`` (``scale`` shaped like the output),
    laid out per sample: ``(N, M, *output.shape[1:])`` with column m = √scale_m e_m."""
    N = scale.shape[0]
    M = scale[0].numel() if N else 0
    return torch.diag_embed(scale.clamp_min(0).sqrt().reshape(N, M)).reshape(N, M, *scale.shape[1:])


#: columns ``(stop - start, *output.shape)`` of a factorization ``H = Σ_c s_c s_cᵀ``
Columns = Callable[[int, int], torch.Tensor]


def _elementwise_columns(diag: torch.Tensor) -> tuple[int, Columns]:
    """Batch-wide columns of a diagonal loss Hessian ``diag`` (shaped like the output): one per
    entry of the last dimension, covering every other index at once."""
    base = diag.sqrt().unsqueeze(0)
    if diag.dim() <= 1:
        return 1, lambda a, b: base[a:b]
    C = diag.shape[-1]
    eye = torch.eye(C, dtype=diag.dtype, device=diag.device).reshape(
        C, *([1] * (diag.dim() - 1)), C
    )
    return C, lambda a, b: base * eye[a:b]


def _numel_weight(
    loss_reduction: Reduction, output: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    w = torch.tensor(1.0 / output.numel() if loss_reduction == "mean" else 1.0, dtype=torch.float64)
    return w.to(dtype)


class CrossEntropyOutputLoss:
    """``F.cross_entropy(output, targets)`` with its output Hessian in closed form.

    ``output``: logits ``(N, C)``, ``(N, C, d1, ...)`` or ``(C,)`` like
    :func:`torch.nn.functional.cross_entropy`; targets: class indices or class
    probabilities, taken from ``batch[1]``. ``impl`` picks the kernel of
    :func:`hessian_eigenthings.kernels.cross_entropy_hvp`. ``reduction``: ``"mean"`` over the
    terms that count, ``"sum"``, or ``"batchmean"``: the sum over the terms divided by the number
    of samples ``output.shape[0]`` (a sequence's token losses summed, averaged over sequences).
    """

    #: the output dimension of its classes (its batch-wide columns run along it; NOTE [columns
    #: row by row] in ``loss_fns.output_curvature``)
    column_dim = 1

    def __init__(
        self,
        *,
        ignore_index: int = IGNORE_INDEX,
        reduction: CrossEntropyReduction = "mean",
        label_smoothing: float = 0.0,
        impl: Impl = "auto",
    ) -> None:
        if reduction not in ("mean", "sum", "batchmean"):
            raise ValueError(
                "reduction must be 'mean', 'sum' or 'batchmean' (a curvature needs a scalar loss), "
                f"got {reduction!r}"
            )
        check_impl(impl)
        self.ignore_index = ignore_index
        self.reduction: CrossEntropyReduction = reduction
        self.label_smoothing = label_smoothing
        self.impl: Impl = impl
        #: NOTE [targets checked against the criterion]
        self.targets_check = TargetCheck(
            "cross_entropy_loss_of_output()",
            "CrossEntropyLoss",
            "probabilities",
            ignore_index=ignore_index,
            source="forward_fn",
        )

    def _targets(self, output: torch.Tensor, batch: Batch) -> torch.Tensor:
        _, y = _inputs_targets(batch)
        self.targets_check.output(output, y)
        return y

    def _samples(self, output: torch.Tensor) -> float:
        """``"batchmean"``'s divisor: the samples (1 for a single ``(C,)`` output)."""
        return float(output.shape[0]) if output.dim() > 1 else 1.0

    def __call__(self, output: torch.Tensor, batch: Batch) -> torch.Tensor:
        y = self._targets(output, batch)
        batchmean = self.reduction == "batchmean"
        loss = F.cross_entropy(
            output,
            y,
            ignore_index=self.ignore_index,
            reduction="sum" if batchmean else self.reduction,
            label_smoothing=self.label_smoothing,
        )
        return loss / self._samples(output) if batchmean else loss

    def hvp(self, output: torch.Tensor, batch: Batch, u: torch.Tensor) -> torch.Tensor:
        y = self._targets(output, batch)
        # classes last, as the kernel wants; (C,) and (N, C) already are
        moved = output.dim() > 2
        logits = output.movedim(1, -1).contiguous() if moved else output
        block = u.movedim(2, -1).contiguous() if moved else u
        valid: torch.Tensor | None = None
        n: float | torch.Tensor
        if y.is_floating_point():  # class probabilities: every row counts
            n = float(logits.numel() // max(logits.shape[-1], 1))
        else:
            valid = y != self.ignore_index
            n = valid.sum().clamp_min(1)  # all rows ignored: zero Hessian (the loss is NaN)
        if self.reduction == "sum":
            n = 1.0
        elif self.reduction == "batchmean":
            n = self._samples(output)
        out = cross_entropy_hvp_block(logits, block, valid, n, impl=self.impl)
        return out.movedim(-1, 2) if moved else out

    # -- the Monte-Carlo Fisher (loss_fns.protocols.SampledFisherLoss) -----------------
    def _rows(
        self, output: torch.Tensor, batch: Batch
    ) -> tuple[torch.Tensor, torch.Tensor | None, float | torch.Tensor]:
        """Logits with classes last, the rows that count (None: all) and the mean's denominator."""
        y = self._targets(output, batch)
        logits = output.movedim(1, -1) if output.dim() > 2 else output
        valid = None if y.is_floating_point() else y != self.ignore_index
        if self.reduction == "sum":
            n: float | torch.Tensor = 1.0
        elif self.reduction == "batchmean":
            n = self._samples(output)
        elif valid is None:
            n = float(logits.numel() // max(logits.shape[-1], 1))
        else:
            n = valid.sum().clamp_min(1)
        return logits, valid, n

    def sample_grads(
        self, output: torch.Tensor, batch: Batch, k: int, generator: torch.Generator
    ) -> torch.Tensor:
        """``softmax(f) - onehot(y_s)``, ``y_s ~ Categorical(softmax(f))``, zero on ignored rows."""
        return self.keyed_sample_grads(output, batch, k, _key_from(generator, output.device))

    def keyed_sample_grads(
        self, output: torch.Tensor, batch: Batch, k: int, key: torch.Tensor
    ) -> torch.Tensor:
        """:meth:`sample_grads` with the draws a pure function of ``key`` (a 0-d int64 tensor):
        ``y_s`` by inverse CDF of counter-based uniforms (``loss_fns.counter_rng``), traceable."""
        logits, valid, _ = self._rows(output.detach(), batch)
        # half-precision logits: probabilities in float32 (the sums need them)
        p = torch.softmax(logits.float() if logits.element_size() < 4 else logits, dim=-1)
        flat = p.reshape(-1, p.shape[-1])
        rows, C = flat.shape
        cdf = torch.cumsum(flat, dim=-1)
        u = counter_uniform(key, (rows, k), dtype=cdf.dtype) * cdf[:, -1:]
        draws = torch.searchsorted(cdf, u).clamp_max(C - 1)  # (rows, k)
        onehot = draws.t().unsqueeze(-1) == torch.arange(C, device=flat.device)  # (k, rows, C)
        g = (flat.unsqueeze(0) - onehot.to(flat.dtype)).reshape(k, *p.shape)
        if valid is not None:
            g = g * valid.unsqueeze(-1).to(g.dtype)
        g = g.to(output.dtype)
        return g.movedim(-1, 2) if output.dim() > 2 else g

    def sampled_hvp(
        self, output: torch.Tensor, batch: Batch, grads: torch.Tensor, u: torch.Tensor
    ) -> torch.Tensor:
        _, _, n = self._rows(output, batch)
        dim = 2 if output.dim() > 1 else 1  # the class dimension of a (k, *output.shape) block
        # per row: mean_s g_s ⟨g_s, u⟩ / n, for every direction of the block u (m, *output.shape)
        dots = (grads.unsqueeze(1) * u.unsqueeze(0)).sum(dim=dim + 1, keepdim=True)  # (k, m, ...)
        return (grads.unsqueeze(1) * dots).mean(0) / n

    # -- square roots of the Hessian, for the exact GGN diagonal (loss_fns.protocols.OutputHessianSqrtLoss)
    def _row_layout(self, output: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """``t`` with classes last, shaped ``(N, P, C)`` (P positions per sample)."""
        moved = t.movedim(1, -1) if t.dim() > 2 else t
        return moved.reshape(t.shape[0], -1, t.shape[1])

    # -- batch-wide columns, for the Kronecker factor pass (loss_fns.protocols.HessianColumnsLoss)
    def term_weight(
        self, output: torch.Tensor, batch: Batch, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The reduction's weight per loss term (0-dim, ``dtype``) and the rows that count
        ``(N, 1, ...)`` (``None``: all)."""
        if output.dim() < 2:
            raise ValueError(
                f"cross-entropy KFAC needs logits (N, C, ...), got shape {tuple(output.shape)}"
            )
        y = batch[1] if isinstance(batch, (tuple, list)) else None
        if not isinstance(y, torch.Tensor):
            raise ValueError("cross-entropy KFAC reads the targets from batch[1]")
        self.targets_check.output(output, y)
        valid = None if y.is_floating_point() else (y != self.ignore_index)
        rows = output.numel() // output.shape[1]
        count = (
            torch.tensor(float(rows), dtype=torch.float64)
            if valid is None
            else valid.sum().clamp_min(1)
        )
        if self.reduction == "mean":
            w = 1.0 / count.to(dtype)
        elif self.reduction == "batchmean":
            w = torch.tensor(1.0 / self._samples(output), dtype=torch.float64)
        else:
            w = torch.ones(())
        mask = None if valid is None else valid.unsqueeze(1).to(output.dtype)
        return w.to(dtype), mask

    def hessian_columns(
        self, output: torch.Tensor, batch: Batch, dtype: torch.dtype
    ) -> tuple[int, Columns]:
        """``w (diag(p) - ppᵀ) = S Sᵀ`` with ``S = (I - p 1ᵀ) diag(√(w p))``, one column per
        class covering every row, zero on ignored rows; computed in ``dtype``."""
        w, mask = self.term_weight(output, batch, dtype)
        p = torch.softmax(output.to(dtype), dim=1).movedim(1, -1)  # (rows..., C)
        C = p.shape[-1]
        eye = torch.eye(C, dtype=p.dtype, device=p.device).reshape(C, *([1] * (p.dim() - 1)), C)
        root = p.movedim(-1, 0).sqrt().unsqueeze(-1) * w.sqrt()  # (C, rows..., 1)

        def ce_columns(a: int, b: int) -> torch.Tensor:
            cols = ((eye[a:b] - p.unsqueeze(0)) * root[a:b]).movedim(
                -1, 2
            )  # (b - a, *output.shape)
            return (cols if mask is None else cols * mask).to(output.dtype)

        return C, ce_columns

    def hessian_sqrt(self, output: torch.Tensor, batch: Batch) -> torch.Tensor:
        """Per row ``(diag(√p) − p √pᵀ) / √n`` (its product with its transpose is
        ``(diag p − p pᵀ)/n``), zero on ignored rows; layout ``(N, C·P, *output.shape[1:])``."""
        _per_sample_output(output)
        if output.dim() == 1:
            raise ValueError(
                "hessian_sqrt needs logits with a batch dimension (N, C, ...), got (C,)"
            )
        logits, valid, n = self._rows(output.detach(), batch)
        p = torch.softmax(logits.float() if logits.element_size() < 4 else logits, dim=-1)
        p = self._row_layout(output, p.movedim(-1, 1) if output.dim() > 2 else p)  # (N, P, C)
        C = p.shape[-1]
        eye = torch.eye(C, dtype=p.dtype, device=p.device)
        # factor[n, t, j, c] = √p_j (δ_jc − p_c): column j of diag(√p) − p √pᵀ
        factor = p.sqrt().unsqueeze(-1) * (eye - p.unsqueeze(-2))
        if valid is not None:
            factor = factor * valid.reshape(p.shape[0], -1, 1, 1).to(factor.dtype)
        factor = factor / (n.to(factor.dtype).sqrt() if isinstance(n, torch.Tensor) else n**0.5)
        return _rowwise_sqrt(factor.to(output.dtype), output)

    def sampled_hessian_sqrt(
        self, output: torch.Tensor, batch: Batch, grads: torch.Tensor
    ) -> torch.Tensor:
        """The k sampled gradients of each row over ``√(k n)`` (what ``sampled_hvp`` applies is
        their mean outer product over n); layout ``(N, k·P, *output.shape[1:])``."""
        _per_sample_output(output)
        if output.dim() == 1:
            raise ValueError(
                "sampled_hessian_sqrt needs logits with a batch dimension (N, C, ...), got (C,)"
            )
        _, _, n = self._rows(output, batch)
        k = grads.shape[0]
        g = torch.stack(
            [self._row_layout(output, grads[s]) for s in range(k)], dim=2
        )  # (N, P, k, C)
        scale = (n.to(g.dtype) * k).sqrt() if isinstance(n, torch.Tensor) else (n * k) ** 0.5
        return _rowwise_sqrt(g / scale, output)

    def __repr__(self) -> str:
        return (
            f"CrossEntropyOutputLoss(ignore_index={self.ignore_index}, reduction={self.reduction!r}, "
            f"label_smoothing={self.label_smoothing}, impl={self.impl!r})"
        )


class MSEOutputLoss:
    """``F.mse_loss(output, batch[1])`` with ``∇² = 2 I / numel`` (mean) or ``2 I`` (sum)."""

    #: the output dimension of its units (its batch-wide columns run along it; NOTE [columns
    #: row by row] in ``loss_fns.output_curvature``)
    column_dim = -1

    def __init__(self, *, reduction: Reduction = "mean") -> None:
        _check_reduction(reduction)
        self.reduction: Reduction = reduction
        #: NOTE [targets checked against the criterion]
        self.targets_check = TargetCheck(
            "mse_loss_of_output()", "MSELoss", "values", source="forward_fn"
        )

    def __call__(self, output: torch.Tensor, batch: Batch) -> torch.Tensor:
        _, y = _inputs_targets(batch)
        self.targets_check.output(output, y)
        return F.mse_loss(output, y, reduction=self.reduction)

    def hvp(self, output: torch.Tensor, batch: Batch, u: torch.Tensor) -> torch.Tensor:
        scale = 2.0 / output.numel() if self.reduction == "mean" else 2.0
        return u * scale

    # -- the Monte-Carlo Fisher: (f - y)² is the Gaussian NLL with variance 1/2, up to a constant
    def sample_grads(
        self, output: torch.Tensor, batch: Batch, k: int, generator: torch.Generator
    ) -> torch.Tensor:
        """``2 (f - y_s)``, ``y_s ~ N(f, 1/2)``: ``√2 z``, ``z ~ N(0, 1)`` (sign irrelevant)."""
        return self.keyed_sample_grads(output, batch, k, _key_from(generator, output.device))

    def keyed_sample_grads(
        self, output: torch.Tensor, batch: Batch, k: int, key: torch.Tensor
    ) -> torch.Tensor:
        """:meth:`sample_grads` with counter-based normals of ``key`` (traceable)."""
        return counter_normal(key, (k, *output.shape), dtype=output.dtype) * 2.0**0.5

    def sampled_hvp(
        self, output: torch.Tensor, batch: Batch, grads: torch.Tensor, u: torch.Tensor
    ) -> torch.Tensor:
        w = 1.0 / output.numel() if self.reduction == "mean" else 1.0
        return u * ((grads * grads).mean(0) * w)

    def term_weight(
        self, output: torch.Tensor, batch: Batch, dtype: torch.dtype
    ) -> tuple[torch.Tensor, None]:
        """The reduction's weight per element (0-dim, ``dtype``); every element counts."""
        return _numel_weight(self.reduction, output, dtype), None

    def hessian_columns(
        self, output: torch.Tensor, batch: Batch, dtype: torch.dtype
    ) -> tuple[int, Columns]:
        """``√(2w) e_c`` along the last dimension, covering every other index."""
        return _elementwise_columns(
            torch.full_like(output, 2.0) * self.term_weight(output, batch, dtype)[0]
        )

    def hessian_sqrt(self, output: torch.Tensor, batch: Batch) -> torch.Tensor:
        """``√(2w) I`` per sample (``w = 1/numel`` for the mean), ``(N, M, *output.shape[1:])``."""
        _per_sample_output(output)
        w = 2.0 / output.numel() if self.reduction == "mean" else 2.0
        return _elementwise_sqrt(torch.full_like(output.detach(), w))

    def sampled_hessian_sqrt(
        self, output: torch.Tensor, batch: Batch, grads: torch.Tensor
    ) -> torch.Tensor:
        """``√(w · mean_s g_s²)`` per element: the diagonal matrix ``sampled_hvp`` applies."""
        _per_sample_output(output)
        w = 1.0 / output.numel() if self.reduction == "mean" else 1.0
        return _elementwise_sqrt((grads * grads).mean(0) * w)

    def __repr__(self) -> str:
        return f"MSEOutputLoss(reduction={self.reduction!r})"


class BCEWithLogitsOutputLoss:
    """``F.binary_cross_entropy_with_logits(output, batch[1])`` with ``∇² = σ(f)(1 - σ(f))``
    per element (divided by the element count for ``"mean"``)."""

    #: the output dimension of its units (its batch-wide columns run along it; NOTE [columns
    #: row by row] in ``loss_fns.output_curvature``)
    column_dim = -1

    def __init__(self, *, reduction: Reduction = "mean") -> None:
        _check_reduction(reduction)
        self.reduction: Reduction = reduction
        #: NOTE [targets checked against the criterion]
        self.targets_check = TargetCheck(
            "BCEWithLogitsOutputLoss", "BCEWithLogitsLoss", "values", source="forward_fn"
        )

    def __call__(self, output: torch.Tensor, batch: Batch) -> torch.Tensor:
        _, y = _inputs_targets(batch)
        self.targets_check.output(output, y)
        return F.binary_cross_entropy_with_logits(output, y, reduction=self.reduction)

    def _weight(self, output: torch.Tensor) -> float:
        return 1.0 / output.numel() if self.reduction == "mean" else 1.0

    def hvp(self, output: torch.Tensor, batch: Batch, u: torch.Tensor) -> torch.Tensor:
        s = torch.sigmoid(output)
        return u * (s * (1 - s) * self._weight(output))

    def sample_grads(
        self, output: torch.Tensor, batch: Batch, k: int, generator: torch.Generator
    ) -> torch.Tensor:
        """``σ(f) - y_s``, ``y_s ~ Bernoulli(σ(f))``."""
        return self.keyed_sample_grads(output, batch, k, _key_from(generator, output.device))

    def keyed_sample_grads(
        self, output: torch.Tensor, batch: Batch, k: int, key: torch.Tensor
    ) -> torch.Tensor:
        """:meth:`sample_grads` with counter-based uniforms of ``key`` (traceable)."""
        s = torch.sigmoid(output.detach())
        draws = (counter_uniform(key, (k, *s.shape), dtype=s.dtype) < s).to(s.dtype)
        return s - draws

    def sampled_hvp(
        self, output: torch.Tensor, batch: Batch, grads: torch.Tensor, u: torch.Tensor
    ) -> torch.Tensor:
        return u * ((grads * grads).mean(0) * self._weight(output))

    def term_weight(
        self, output: torch.Tensor, batch: Batch, dtype: torch.dtype
    ) -> tuple[torch.Tensor, None]:
        """The reduction's weight per element (0-dim, ``dtype``); every element counts."""
        return _numel_weight(self.reduction, output, dtype), None

    def hessian_columns(
        self, output: torch.Tensor, batch: Batch, dtype: torch.dtype
    ) -> tuple[int, Columns]:
        """``√(w σ(1-σ)) e_c`` along the last dimension, covering every other index."""
        s = torch.sigmoid(output)
        return _elementwise_columns(s * (1 - s) * self.term_weight(output, batch, dtype)[0])

    def hessian_sqrt(self, output: torch.Tensor, batch: Batch) -> torch.Tensor:
        """``√(w σ(f)(1 − σ(f)))`` per element, ``(N, M, *output.shape[1:])``."""
        _per_sample_output(output)
        s = torch.sigmoid(output.detach())
        return _elementwise_sqrt(s * (1 - s) * self._weight(output))

    def sampled_hessian_sqrt(
        self, output: torch.Tensor, batch: Batch, grads: torch.Tensor
    ) -> torch.Tensor:
        """``√(w · mean_s g_s²)`` per element: the diagonal matrix ``sampled_hvp`` applies."""
        _per_sample_output(output)
        return _elementwise_sqrt((grads * grads).mean(0) * self._weight(output))

    def __repr__(self) -> str:
        return f"BCEWithLogitsOutputLoss(reduction={self.reduction!r})"


def cross_entropy_loss_of_output(
    *,
    ignore_index: int = IGNORE_INDEX,
    reduction: CrossEntropyReduction = "mean",
    label_smoothing: float = 0.0,
    impl: Impl = "auto",
) -> CrossEntropyOutputLoss:
    """Cross-entropy of the logits against ``batch[1]``, closed-form output Hessian."""
    return CrossEntropyOutputLoss(
        ignore_index=ignore_index, reduction=reduction, label_smoothing=label_smoothing, impl=impl
    )


def mse_loss_of_output(*, reduction: Reduction = "mean") -> MSEOutputLoss:
    """Mean squared error against ``batch[1]``, closed-form output Hessian."""
    return MSEOutputLoss(reduction=reduction)


class _CriterionOfOutput:
    """``criterion(output, batch[1])`` without a closed-form Hessian (the GGN differentiates it)."""

    def __init__(self, criterion: Criterion) -> None:
        self.criterion = criterion
        #: NOTE [targets checked against the criterion] (None: a criterion it does not know)
        self.targets_check = TargetCheck.of(
            f"supervised_loss_of_output({type(criterion).__name__})", criterion, source="forward_fn"
        )

    def __call__(self, output: torch.Tensor, batch: Batch) -> torch.Tensor:
        _, y = _inputs_targets(batch)
        if self.targets_check is not None:
            self.targets_check.output(output, y)
        return self.criterion(output, y)

    def __repr__(self) -> str:
        return f"supervised_loss_of_output({self.criterion!r})"


def supervised_loss_of_output(
    criterion: Criterion,
) -> CrossEntropyOutputLoss | MSEOutputLoss | BCEWithLogitsOutputLoss | LossOfOutputFn:
    """``loss_of_output(output, (x, y)) = criterion(output, y)``.

    ``nn.CrossEntropyLoss`` (no class weights), ``nn.MSELoss`` and
    ``nn.BCEWithLogitsLoss`` (no weights) with reduction ``"mean"`` or ``"sum"``
    become closed-form losses (use the GGN's
    default ``loss_hvp="analytical"``); anything else is a plain callable for
    ``loss_hvp="autograd"``.
    """
    check_criterion(criterion, name="supervised_loss_of_output")
    loss = _loss_of_output(criterion)
    check = target_check(loss)
    if check is not None:
        check.label = f"supervised_loss_of_output({type(criterion).__name__})"
    return loss


def _loss_of_output(
    criterion: Criterion,
) -> CrossEntropyOutputLoss | MSEOutputLoss | BCEWithLogitsOutputLoss | LossOfOutputFn:
    reduction = getattr(criterion, "reduction", None)
    if (
        isinstance(criterion, nn.CrossEntropyLoss)
        and criterion.weight is None
        and reduction in ("mean", "sum")
    ):
        return CrossEntropyOutputLoss(
            ignore_index=criterion.ignore_index,
            reduction=criterion.reduction,  # type: ignore[arg-type]
            label_smoothing=criterion.label_smoothing,
        )
    if isinstance(criterion, nn.MSELoss) and reduction in ("mean", "sum"):
        return MSEOutputLoss(reduction=criterion.reduction)  # type: ignore[arg-type]
    if (
        isinstance(criterion, nn.BCEWithLogitsLoss)
        and criterion.weight is None
        and criterion.pos_weight is None
        and reduction in ("mean", "sum")
    ):
        return BCEWithLogitsOutputLoss(reduction=criterion.reduction)  # type: ignore[arg-type]
    return _CriterionOfOutput(criterion)


def supervised_per_sample_loss(criterion: Criterion) -> PerSampleLossFn:
    """``(model, (x, y)) -> (N,)``: sample ``i``'s loss is the criterion on sample ``i`` alone.

    Built as ``reduction="none"`` followed by a mean over each sample's
    elements (a sum for ``reduction="sum"``), so with equal-sized samples and
    no ignored targets the mean of the per-sample losses is the batch loss. Callables without a
    ``reduction`` attribute are mapped over samples with ``torch.func.vmap``.
    Samples whose every target is ``ignore_index`` get loss 0 (no gradient).
    """
    check_criterion(criterion, name="supervised_per_sample_loss")
    check = TargetCheck.of(f"supervised_per_sample_loss({type(criterion).__name__})", criterion)
    reduction = getattr(criterion, "reduction", None)
    if isinstance(criterion, nn.Module) and reduction in ("mean", "sum", "none"):
        unreduced = copy.copy(criterion)
        setattr(unreduced, "reduction", "none")  # noqa: B010  (nn.Module types attributes as Tensor | Module)
        reduce_sum = reduction == "sum"

        @_reads_supervised("supervised_per_sample_loss(...)", calls_model=True)
        def per_sample(model: nn.Module, batch: Batch) -> torch.Tensor:
            x, y = _inputs_targets(batch)
            output = model(x)
            if check is not None:
                check.output(output, y)
            losses = unreduced(output, y)
            if losses.dim() <= 1:
                return losses
            flat = losses.reshape(losses.shape[0], -1)
            return flat.sum(1) if reduce_sum else flat.mean(1)

        if check is not None:
            TARGET_CHECKS[per_sample] = check
        return per_sample

    @_reads_supervised("supervised_per_sample_loss(...)", calls_model=True)
    def per_sample_mapped(model: nn.Module, batch: Batch) -> torch.Tensor:
        x, y = _inputs_targets(batch)
        out = model(x)
        if check is not None:
            check.output(out, y)
        return torch.func.vmap(lambda o, t: criterion(o.unsqueeze(0), t.unsqueeze(0)))(out, y)

    if check is not None:
        TARGET_CHECKS[per_sample_mapped] = check
    return per_sample_mapped
