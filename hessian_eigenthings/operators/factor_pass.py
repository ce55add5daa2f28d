"""The pass over the data that Kronecker factors are made from (KFAC, EKFAC, KFOC).

For each batch: a forward with hooks on the factor modules, the modules whose parameters the
factors cover (``nn.Linear``; ``nn.Conv2d``; HuggingFace's ``Conv1D``, recognized without
importing ``transformers``: :class:`FactorModule`), that keeps each module's input ``a`` and
output ``z``; then, for the columns ``s_c`` of a factorization of the batch loss's output Hessian
(``fisher_type``: the exact square root, Monte-Carlo gradients, or the empirical gradient: the
strategies of ``loss_fns.output_curvature``), batched backwards of ``s_c`` from the model output
to the modules' outputs, giving ``g_c = ∂z`` per module. A caller's ``visit(module, a, g,
weight)`` reduces them into factors; this module never decides what a factor is, so KFAC's
moments, EKFAC's corrected eigenvalues and KFOC's rearranged products share one pass. (In the
code a "layer" is a block of a transformer stack, walked by ``engines.layers``; messages to users
still call a Linear or a convolution a layer, as they do.)

Inputs come as ``a (N, positions, q)`` (a conv's unfolded patches; a column of ones appended
for a joined bias) or, through ``on_input``, raw, for a moment computed without keeping them
(:func:`input_moment`). Output gradients come as ``g (k, N, positions, m)``.

Cost per batch: one forward and ``ceil(k / column_chunk)`` backwards to the module outputs (no
parameter gradients), ``k`` the number of columns (classes for type-2 cross-entropy).

NOTE [type-2 on a large vocabulary]: the exact type-2 factor has a column per output class, so a
language model's head of 50,257 words takes ``ceil(50,257 / column_chunk)`` = 3,142 backwards per
batch (GPT-2 small, 4 batches: not one pass in 150 s on an H100), where ``fisher_type="mc"``
takes ``mc_samples`` (one sampled label per output, Kronfluence's choice) and ``"empirical"`` one.
The default stays type-2 (changing it would change every result); the first batch of a pass
knows ``k``, and when the count exceeds :data:`BACKWARDS_WARNING` a
:class:`~hessian_eigenthings._warnings.FactorPassCostWarning` says so, with the fix, before the
work starts (once per operator).
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from hessian_eigenthings._checks import InternalError, check_count
from hessian_eigenthings._warnings import FactorPassCostWarning, user_stacklevel
from hessian_eigenthings.batching import (
    Batch,
    BatchSource,
    batch_size,
    batchnorm_modules,
    to_device,
)
from hessian_eigenthings.loss_fns.checks import check_first_batch, check_loss_argument
from hessian_eigenthings.loss_fns.output_curvature import (
    Columns,
    DrawKeys,
    Empirical,
    ExactLossHessian,
    MonteCarlo,
    OutputCurvature,
)
from hessian_eigenthings.loss_fns.protocols import ForwardFn, LossOfOutputFn
from hessian_eigenthings.loss_fns.standard import (
    BCEWithLogitsOutputLoss,
    CrossEntropyOutputLoss,
    MSEOutputLoss,
)
from hessian_eigenthings.operators.conv_factors import conv_input_moment
from hessian_eigenthings.operators.empty_batches import EmptyBatches
from hessian_eigenthings.operators.factor_options import FactorOptions, FisherType
from hessian_eigenthings.operators.model_guard import ModelGuard
from hessian_eigenthings.operators.parameter_binding import refuse_in_place_forward
from hessian_eigenthings.operators.precision import check_precision
from hessian_eigenthings.param_utils import ParamLayout, select_parameters

__all__ = [
    "BACKWARDS_WARNING",
    "FactorModule",
    "FactorPass",
    "FactorPassCostWarning",
    "FisherType",
    "Retry",
    "factor_curvature",
    "find_factor_modules",
    "input_moment",
    "input_rows",
]

#: more backward passes per batch than this warn (NOTE [type-2 on a large vocabulary])
BACKWARDS_WARNING = 64
_SUPPORTED = (nn.Linear, nn.Conv2d)
#: a module whose inputs were not kept (the factors take them as they come)
NO_INPUT = torch.empty(0)
#: the losses whose output Hessian the pass factors
FactoredLoss = CrossEntropyOutputLoss | MSEOutputLoss | BCEWithLogitsOutputLoss


def is_hf_conv1d(module: nn.Module) -> bool:
    """HuggingFace's ``transformers.pytorch_utils.Conv1D`` (GPT-2's linear layers: ``x @ W + b``,
    ``W (in, out)``), recognized without importing ``transformers``: if a model holds one, the
    module defining it is loaded already."""
    utils = sys.modules.get("transformers.pytorch_utils")
    cls = getattr(utils, "Conv1D", None)
    return cls is not None and isinstance(module, cls)


def _supported(module: nn.Module) -> bool:
    return isinstance(module, _SUPPORTED) or is_hf_conv1d(module)


def _joined(S: torch.Tensor, s: torch.Tensor, rows: int) -> torch.Tensor:
    """``Σ ã ãᵀ`` of the inputs with a one appended, ``ã = [a, 1]``, from ``Σ a aᵀ``, ``Σ a`` and the
    number of rows (no copy of the inputs)."""
    q = S.shape[0]
    out = S.new_empty(q + 1, q + 1)
    out[:q, :q] = S
    out[:q, q] = s
    out[q, :q] = s
    out[q, q] = rows
    return out


@dataclass
class FactorModule:
    """A module whose parameters the factors cover (a Linear, Conv2d or Conv1D), by its name in
    the model, and where its parameters sit in the layout."""

    name: str
    module: nn.Module
    weight: int | None  # index of the weight in the layout
    bias: int | None
    joint: bool  # bias appended to the input as a column of ones
    transposed: bool  # the weight is stored (in, out) (Conv1D)


#: the old name of :class:`FactorModule`, kept importable
Layer = FactorModule


def _check_module(name: str, module: nn.Module) -> None:
    if isinstance(module, nn.Conv2d):
        if module.groups != 1:
            raise ValueError(
                f"KFAC supports Conv2d with groups=1; layer {name!r} has groups={module.groups}"
            )
        if module.padding_mode != "zeros" or (
            isinstance(module.padding, str) and module.padding != "valid"
        ):
            raise ValueError(
                f"KFAC supports Conv2d with zero padding given as numbers; layer {name!r} has "
                f"padding={module.padding!r}, padding_mode={module.padding_mode!r}"
            )


def _conv_patches(module: nn.Conv2d, x: torch.Tensor) -> torch.Tensor:
    """Unfolded input patches ``(N, positions, in·kh·kw)`` in the weight's row-major order."""
    padding = (0, 0) if isinstance(module.padding, str) else module.padding  # "valid" (checked)
    cols = F.unfold(
        x, module.kernel_size, dilation=module.dilation, padding=padding, stride=module.stride
    )
    return cols.transpose(1, 2)


class Retry(Exception):
    """Raised inside a pass when the forward found a module's output changed in place."""


def _check_options(
    who: str,
    model: nn.Module,
    forward_fn: ForwardFn,
    loss_of_output_fn: LossOfOutputFn,
    options: FactorOptions,
) -> None:
    fisher_type, kfac_approx = options.fisher_type, options.kfac_approx
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if fisher_type not in ("type2", "mc", "empirical"):
        raise ValueError(f"fisher_type must be 'type2', 'mc' or 'empirical', got {fisher_type!r}")
    if kfac_approx not in ("expand", "reduce"):
        raise ValueError(f"kfac_approx must be 'expand' or 'reduce', got {kfac_approx!r}")
    if not callable(forward_fn) or not callable(loss_of_output_fn):
        raise TypeError(
            "forward_fn(model, batch) and loss_of_output_fn(output, batch) must be callable"
        )
    check_loss_argument(
        loss_of_output_fn, name="loss_of_output_fn", wrap="supervised_loss_of_output"
    )
    check_loss_argument(
        forward_fn, name="forward_fn", wrap="supervised_forward and supervised_loss_of_output"
    )
    # a curvature= strategy brings its own columns: any loss goes with it
    if options.curvature is None and not isinstance(
        loss_of_output_fn, (CrossEntropyOutputLoss, MSEOutputLoss, BCEWithLogitsOutputLoss)
    ):
        raise ValueError(
            f"{who} needs the loss's distribution to factor its Hessian; supported: "
            "cross_entropy_loss_of_output(), mse_loss_of_output() and supervised_loss_of_output(...) of "
            f"nn.CrossEntropyLoss(), nn.MSELoss() or nn.BCEWithLogitsLoss(), or any loss with a "
            f"curvature= strategy that gives columns; got {loss_of_output_fn!r}"
        )
    count = check_count("mc_samples", options.mc_samples)
    if fisher_type != "mc" and count != 1:
        raise ValueError(
            f"mc_samples={options.mc_samples} applies to fisher_type='mc' only (got {fisher_type!r})"
        )


def find_factor_modules(
    who: str, model: nn.Module, options: FactorOptions
) -> tuple[list[tuple[str, nn.Parameter]], list[FactorModule], tuple[str, ...]]:
    """The selected parameters that factor modules own, in selection order, those modules, and
    the selected parameters of other modules (an error unless ``exclude_unsupported``)."""
    selected = select_parameters(model, options.param_filter)
    owner: dict[int, tuple[str, nn.Module, str]] = {}
    users: dict[int, list[str]] = {}
    for mname, module in model.named_modules(remove_duplicate=False):
        for pname, p in module.named_parameters(recurse=False, remove_duplicate=False):
            owner.setdefault(id(p), (mname, module, pname))
            users.setdefault(id(p), []).append(f"{mname}.{pname}" if mname else pname)
    tied = [" = ".join(users[id(p)]) for p in selected.values() if len(users[id(p)]) > 1]
    if tied:
        raise ValueError(
            f"{who} gives each layer its own block; these selected parameters are tied "
            f"(shared by several layers): {'; '.join(tied)}. Leave them out with param_filter"
        )
    unsupported = []
    named = []
    for name, p in selected.items():
        mname, module, pname = owner[id(p)]
        if _supported(module) and pname in ("weight", "bias"):
            _check_module(mname, module)
            named.append((name, p))
        else:
            unsupported.append(f"{name} ({type(module).__name__})")
    if unsupported and not options.exclude_unsupported:
        raise ValueError(
            f"{who} covers nn.Linear, nn.Conv2d and transformers' Conv1D layers; these selected parameters belong to "
            f"none: {', '.join(unsupported)}. Leave them out with param_filter, or pass "
            "exclude_unsupported=True to drop them (listed in .excluded_parameters)"
        )
    if not named:
        raise ValueError(
            "no selected parameter belongs to an nn.Linear, nn.Conv2d or transformers' Conv1D layer"
        )
    modules: dict[str, FactorModule] = {}
    for index, (_, p) in enumerate(named):
        mname, module, pname = owner[id(p)]
        covered = modules.get(mname)
        if covered is None:
            transposed = not isinstance(module, _SUPPORTED) and is_hf_conv1d(module)
            covered = modules[mname] = FactorModule(mname, module, None, None, False, transposed)
        setattr(covered, pname, index)
    for covered in modules.values():
        covered.joint = (
            not options.separate_bias and covered.weight is not None and covered.bias is not None
        )
    return named, list(modules.values()), tuple(unsupported)


def input_moment(
    module: FactorModule, x: torch.Tensor, dtype: torch.dtype, reduce: bool
) -> tuple[torch.Tensor, int]:
    """``(Σ ã ãᵀ, rows)`` over the module input's rows (positions as samples, or a sample's
    mean position with ``reduce``), in ``dtype``; a convolution's by the route
    :func:`conv_input_moment` plans (unfolded or row shifts), its patch sums only for a joined bias."""
    conv = module.module
    x = x.detach().to(dtype)
    if isinstance(conv, nn.Conv2d):
        padding = (0, 0) if isinstance(conv.padding, str) else conv.padding  # "valid"
        S, s, rows = conv_input_moment(
            x,
            conv.kernel_size,  # type: ignore[arg-type]
            conv.stride,  # type: ignore[arg-type]
            padding,  # type: ignore[arg-type]
            conv.dilation,  # type: ignore[arg-type]
            reduce=reduce,
            sums=module.joint,
        )
    else:
        if x.dim() < 2:
            raise ValueError(f"KFAC needs a batch dimension at the input of layer {module.name!r}")
        a = x.reshape(x.shape[0], -1, x.shape[-1])
        flat = a.mean(1) if reduce else a.reshape(-1, a.shape[-1])
        S, rows = flat.T @ flat, flat.shape[0]
        s = flat.sum(0) if module.joint else S.new_empty(0)
    if module.joint:
        S = _joined(S, s, rows)
    return S, rows


def input_rows(
    module: FactorModule, x: torch.Tensor, dtype: torch.dtype, reduce: bool
) -> torch.Tensor | None:
    """The rows ``ã`` whose moment ``Σ ã ãᵀ`` is :func:`input_moment`'s, for a module that is
    not a convolution (``(rows, q)``, a column of ones appended for a joined bias, in ``dtype``),
    so that the moment can be accumulated on its upper blocks (:meth:`WeightedSum.addgram`);
    ``None`` for a convolution (its moment has its own routes)."""
    if isinstance(module.module, nn.Conv2d):
        return None
    x = x.detach().to(dtype)
    if x.dim() < 2:
        raise ValueError(f"KFAC needs a batch dimension at the input of layer {module.name!r}")
    a = x.reshape(x.shape[0], -1, x.shape[-1])
    flat = a.mean(1) if reduce else a.reshape(-1, a.shape[-1])
    if module.joint:
        flat = torch.cat([flat, flat.new_ones(flat.shape[0], 1)], dim=1)
    return flat


# NOTE [fresh draws]: a pass that estimates a second moment in a basis made by an earlier pass
# (EK-FAC's corrected eigenvalues in KFAC's eigenbases) draws its Monte-Carlo labels afresh, from
# another stream of the same seed. With the first pass's labels, every sampled gradient lies in
# the span the factors were made of, so each direction outside it gets a corrected eigenvalue of
# exactly zero, where the Fisher has curvature: with few sequences most of them (76% on a
# two-layer GPT-2 of width 768, 16 × 64 tokens), whose damped inverse is then ``1/λ`` and whose
# influence scores came out 40× those of 8 draws or of Kronfluence (which draws again too).
# Given the basis, fresh labels make each corrected eigenvalue an unbiased estimate of the
# Fisher's diagonal there. Still a pure function of ``seed``, the batch's position and the rank.
FRESH_DRAWS_OFFSET = 1 << 40


def factor_curvature(
    loss: FactoredLoss, fisher_type: FisherType, mc_samples: int
) -> OutputCurvature:
    """The output curvature that ``fisher_type=`` spells (``mc_samples`` draws for ``"mc"``)."""
    if fisher_type == "empirical":
        return Empirical(loss)
    if fisher_type == "mc":
        return MonteCarlo(loss, mc_samples)
    return ExactLossHessian(loss)


#: ``visit(module, a_or_empty, g, weight)`` after a backward; ``on_input(module, x, weight)`` in
#: the forward
Visit = Callable[[FactorModule, torch.Tensor, torch.Tensor, float], None]
OnInput = Callable[[FactorModule, torch.Tensor, float], None]


class FactorPass:
    """A model's factor modules and passes over its data that hand each module's inputs and
    output gradients to a caller (module docstring). Checks its options as the KFAC family's
    constructors document them (:attr:`options`: the checked ones); ``who`` names the operator
    in messages."""

    def __init__(
        self,
        who: str,
        model: nn.Module,
        dataloader: Iterable[Batch],
        forward_fn: ForwardFn,
        loss_of_output_fn: LossOfOutputFn,
        options: FactorOptions,
    ) -> None:
        _check_options(who, model, forward_fn, loss_of_output_fn, options)
        mc_samples = check_count("mc_samples", options.mc_samples)
        seed = check_count("seed", options.seed, minimum=0)
        column_chunk = check_count("column_chunk", options.column_chunk)
        if not isinstance(options.separate_bias, bool) or not isinstance(
            options.exclude_unsupported, bool
        ):
            raise TypeError("separate_bias and exclude_unsupported must be True or False")
        refuse_in_place_forward(model, who)
        self.who = who
        #: the process's rank in a data-parallel factor pass (its Monte-Carlo draws' key)
        self.rank = 0
        self.model = model
        self.forward_fn = forward_fn
        self.loss_of_output_fn = loss_of_output_fn
        #: ``H`` of the output, factored into columns (``loss_fns.output_curvature``)
        self.curvature = options.curvature or factor_curvature(
            cast(FactoredLoss, loss_of_output_fn),
            options.fisher_type,
            mc_samples,  # checked above
        )
        self._keys = DrawKeys(seed)
        precision = check_precision(options.precision)
        #: the options, checked (counts as ints, ``precision`` normalized)
        self.options = replace(
            options,
            mc_samples=mc_samples,
            seed=seed,
            column_chunk=column_chunk,
            precision=precision,
        )
        self.source = BatchSource(dataloader, full_dataset=True, num_batches=options.num_batches)
        check_first_batch(model, self.source.first_batch(), forward_fn, loss_of_output_fn)
        named, self.modules, self.excluded = find_factor_modules(who, model, options)
        self.named_params = named
        self.params = [p for _, p in named]
        self.layout = ParamLayout.from_named(named)
        #: factors and reductions run in float32 or better
        self.factor_dtype = torch.promote_types(self.layout.dtype, torch.float32)
        self.guard = ModelGuard(model, self.params)
        coupled = batchnorm_modules(model)
        if coupled:
            # NOTE [samples independent]: a column of the loss Hessian covers every row of the batch
            # at once, which is exact only when no row's output depends on another row's input
            warnings.warn(
                f"{who}: BatchNorm in training mode ({', '.join(coupled[:3])}"
                f"{', ...' if len(coupled) > 3 else ''}) couples the samples of a batch; KFAC's factors "
                "assume independent samples (call model.eval() for the curvature of the deterministic model)",
                UserWarning,
                stacklevel=user_stacklevel(),
            )
        #: NOTE [module outputs changed in place]: set once a forward modified a module's output
        self._clone_outputs = False
        self._empty = EmptyBatches(who)
        #: checks the model output of each batch before its columns are made (KFOC's terms)
        self.check_output: Callable[[torch.Tensor], None] | None = None
        #: the most columns per batch whose backwards were counted (NOTE [type-2 on a large
        #: vocabulary]): a pass with more columns (row by row) is counted again
        self._cost_told = 0
        self._exact_columns = isinstance(self.curvature, ExactLossHessian)

    def _tell_cost(self, k: int) -> None:
        """Warn once when ``k`` columns make more than :data:`BACKWARDS_WARNING` backwards per
        batch (NOTE [type-2 on a large vocabulary])."""
        self._cost_told = k
        passes = -(-k // self.options.column_chunk)
        if passes <= BACKWARDS_WARNING:
            return
        if self._exact_columns:
            what, columns = "the exact type-2 factor", "columns, one per output class or unit"
            fix = (
                "pass fisher_type='mc' (one sampled label per output, as Kronfluence does: one "
                "backward per batch) or 'empirical' (one backward at the observed labels)"
            )
        else:
            what, columns = f"the curvature {self.curvature!r}", "columns"
            fix = "use fewer columns (mc_samples), fisher_type='empirical'"
        warnings.warn(
            FactorPassCostWarning(
                f"{self.who}: {what} takes {passes} backward passes per batch in each pass over "
                f"the data (one per column_chunk={self.options.column_chunk} of its {k} loss-Hessian "
                f"{columns}); {fix}, or a larger column_chunk (memory: that many activation "
                "gradients at once)"
            ),
            stacklevel=user_stacklevel(),
        )

    def matrix_shape(self, module: FactorModule) -> tuple[int, int]:
        """``(m, q)`` of the module's weight as a matrix (a Conv2d's kernel flattened; the bias
        alone ``(m, 1)``), without a joined bias's column."""
        if module.weight is None:
            if module.bias is None:
                raise InternalError("module.bias is not None")
            return self.params[module.bias].shape[0], 1
        shape = self.params[module.weight].shape
        if module.transposed:
            return shape[1], shape[0]
        return shape[0], shape[1:].numel()

    def inputs(self, module: FactorModule, x: torch.Tensor) -> torch.Tensor:
        """The module input ``(N, positions, d_in)`` (ones appended for a joint bias), factor dtype."""
        conv = module.module
        x = x.detach()
        if isinstance(conv, nn.Conv2d):
            a = _conv_patches(conv, x)
        else:
            if x.dim() < 2:
                raise ValueError(
                    f"KFAC needs a batch dimension at the input of layer {module.name!r}"
                )
            a = x.reshape(x.shape[0], -1, x.shape[-1])
        a = a.to(self.factor_dtype)
        if module.joint:
            a = torch.cat([a, a.new_ones(*a.shape[:-1], 1)], dim=-1)
        return a

    def _grads(self, module: FactorModule, g: torch.Tensor) -> torch.Tensor:
        """Output gradients ``(k, N, positions, d_out)`` of a block of ``k`` columns."""
        g = g.detach().to(self.factor_dtype)
        if isinstance(module.module, nn.Conv2d):
            return g.flatten(3).transpose(2, 3)
        return g.reshape(g.shape[0], g.shape[1], -1, g.shape[-1])

    def _columns(
        self, output: torch.Tensor, batch: Batch, position: int, per_row: bool, fresh: bool
    ) -> tuple[int, Columns]:
        if self.check_output is not None:
            self.check_output(output)
        # the key of the GGN's draws at this position: one seed, one set of targets; a pass
        # with fresh draws reads another stream of the same seed (NOTE [fresh draws])
        at = position + FRESH_DRAWS_OFFSET if fresh else position
        key = self._keys(at, self.rank, output.device) if self.curvature.keyed else None
        state = self.curvature.prepare(output, batch, key)
        if per_row:  # NOTE [columns row by row] in loss_fns.output_curvature
            return self.curvature.row_columns(state, self.factor_dtype)
        return self.curvature.columns(state, self.factor_dtype)

    def run(
        self,
        visit: Visit,
        on_input: OnInput | None,
        *,
        per_row: bool = False,
        fresh_draws: bool = False,
    ) -> float:
        """One pass: for each batch, ``on_input(module, x, weight)`` in the forward (``x`` the
        module's raw input; without it, the inputs are kept as ``a``) and
        ``visit(module, a_or_empty, g, weight)`` after the backward. Returns the total weight.
        ``per_row``: the output curvature's columns split row by row, for per-sample moments
        (NOTE [columns row by row] in ``loss_fns.output_curvature``). ``fresh_draws``:
        Monte-Carlo labels other than the first pass's, from the same seed (NOTE [fresh
        draws]).
        Raises :class:`Retry` when ``on_input`` was given and a forward changed a module's output
        in place (the caller starts again; later passes copy the outputs)."""
        total = 0.0
        seen = skipped = 0
        with self.guard.product(self.options.precision, double_backward=False):
            for position, raw in enumerate(self.source.batches()):
                seen += 1
                if (
                    batch_size(raw) == 0
                ):  # NOTE [empty batches] (positions kept: MC draws unchanged)
                    skipped += 1
                    continue
                batch = to_device(raw, self.device)
                size = float(batch_size(batch))
                output, inputs, outputs = self._forward(batch, on_input, size)
                self._backward(
                    output, batch, position, inputs, outputs, visit, size, per_row, fresh_draws
                )
                total += size
                del output, inputs, outputs  # the batch's activations go before the next forward
        self._empty.say(skipped, seen)
        if total == 0:
            raise EmptyBatches.none_error(seen)
        return total

    @property
    def device(self) -> torch.device:
        return self.layout.device

    def _backward(
        self,
        output: torch.Tensor,
        batch: Batch,
        position: int,
        inputs: dict[str, torch.Tensor],
        outputs: dict[str, torch.Tensor],
        visit: Visit,
        size: float,
        per_row: bool = False,
        fresh: bool = False,
    ) -> None:
        k, columns = self._columns(output, batch, position, per_row, fresh)
        if k > self._cost_told:
            self._tell_cost(k)
        modules = [module for module in self.modules if module.name in outputs]
        targets = [outputs[module.name] for module in modules]
        # NOTE [column chunks]: type-2 has a column per class; a batched backward of all of
        # them at once holds k copies of the activations' gradients (and the columns
        # themselves k outputs), so they are made and go through in chunks of
        # ``column_chunk`` (the factors are sums over columns: the same result)
        step = self.options.column_chunk
        for start in range(0, k, step):
            chunk = columns(start, min(k, start + step))
            last = start + step >= k
            if chunk.shape[0] == 1:
                grads = torch.autograd.grad(
                    output, targets, chunk[0], allow_unused=True, retain_graph=not last
                )
                grads = tuple(None if g is None else g.unsqueeze(0) for g in grads)
            else:
                grads = torch.autograd.grad(
                    output,
                    targets,
                    chunk,
                    is_grads_batched=True,
                    allow_unused=True,
                    retain_graph=not last,
                )
            for module, g, y in zip(modules, grads, targets, strict=True):
                if g is None:
                    g = torch.zeros((chunk.shape[0], *y.shape), dtype=y.dtype, device=y.device)
                visit(module, inputs.get(module.name, NO_INPUT), self._grads(module, g), size)

    def _forward(
        self, batch: Batch, on_input: OnInput | None, size: float
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        inputs: dict[str, torch.Tensor] = {}
        outputs: dict[str, torch.Tensor] = {}
        versions: dict[str, int] = {}
        handles = []

        def hook(
            module: FactorModule, _module: nn.Module, args: tuple[Any, ...], out: torch.Tensor
        ) -> torch.Tensor | None:
            if module.name in outputs:
                raise ValueError(
                    f"layer {module.name!r} ran twice in one forward; KFAC needs each layer called once per batch"
                )
            if on_input is not None:
                on_input(module, args[0], size)
            else:
                inputs[module.name] = self.inputs(module, args[0])
            outputs[module.name] = out
            versions[module.name] = out._version
            return out.clone() if self._clone_outputs else None

        for module in self.modules:
            handles.append(
                module.module.register_forward_hook(
                    lambda m, a, o, module=module: hook(module, m, a, o)
                )
            )
        try:
            with torch.enable_grad(), self.guard.private_buffers():
                output = self.forward_fn(self.model, batch)
            # NOTE [module outputs changed in place]: an in-place op after a module (ReLU(inplace=True))
            # rewrites the output tensor we differentiate against; such models run every forward with
            # the hooks returning a copy, so the captured tensor keeps its value and graph
            if not self._clone_outputs and any(
                outputs[k]._version != v for k, v in versions.items()
            ):
                self._clone_outputs = True
                if on_input is not None:
                    raise Retry
                inputs.clear()
                outputs.clear()
                versions.clear()
                with torch.enable_grad(), self.guard.private_buffers():
                    output = self.forward_fn(self.model, batch)
        finally:
            for h in handles:
                h.remove()
        if not isinstance(output, torch.Tensor):
            raise TypeError(
                f"forward_fn must return a tensor (the model output), got {type(output).__name__}"
            )
        return output, inputs, outputs
