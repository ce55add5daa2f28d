"""Kronecker-factored curvature: KFAC and eigenvalue-corrected KFAC (EKFAC).

For a layer ``z = W a (+ b)`` (``nn.Linear``; ``nn.Conv2d`` on unfolded patches; HuggingFace's
``Conv1D``, ``z = a W + b`` with ``W`` stored ``(in, out)``, as a Linear of weight ``Wᵀ``)
the GGN block of ``W`` is ``Σ_c (Σ_p g_cp ⊗ a_p)(Σ_p g_cp ⊗ a_p)ᵀ`` summed over
the samples, where ``a_p`` is the layer's input at weight-sharing position ``p``
(a token, a patch; one position without sharing), ``g_cp = ∂z_p`` of the model
output times column ``c`` of a factorization ``H_L = Σ_c s_c s_cᵀ`` of the
batch-mean loss's output Hessian. KFAC keeps one Kronecker product per block:

- ``kfac_approx="expand"``: positions count as extra samples,
  ``A = mean_{n,p} a aᵀ`` and ``G = Σ_{c,n,p} g gᵀ``;
- ``kfac_approx="reduce"``: ``A = mean_n ā āᵀ`` with ``ā = mean_p a`` and
  ``G = Σ_{c,n} ḡ ḡᵀ`` with ``ḡ = Σ_p g``.

Batches are weighted by their size like every operator (``A`` and ``G`` are
``Σ bᵢ·Fᵢ / Σ bᵢ`` of the per-batch factors), so ``G ⊗ A`` is the GGN block of
the mean loss over the dataset wherever KFAC is exact: a network whose blocks
see one input per sample (one data point; or any number of them when ``G`` does
not depend on the sample, e.g. a single ``Linear`` layer with MSE). These are
the conventions of curvlinops' ``KFACLinearOperator``; the tests check both.

The columns ``s_c`` (``fisher_type``) are:

- ``"type2"``: the exact square root of the loss Hessian: cross-entropy
  ``diag(p) - ppᵀ = S Sᵀ`` with ``S = (I - p 1ᵀ) diag(√p)`` (one column per
  class), MSE ``√(2w) e_c``, BCE with logits ``√(w σ(1-σ)) e_c``, ``w`` the
  reduction's weight (``1/count`` for a mean). One column covers every row (and
  position) of the batch at once, so a backward pass per class, batched;
- ``"mc"``: ``√(w/k) ∇ℓ(f, y_s)`` for ``k = mc_samples`` targets ``y_s`` drawn from
  the model's predictive distribution (the loss's ``sample_grads``), seeded by
  ``seed`` and the batch's position: the global random state is untouched;
- ``"empirical"``: ``√w ∇ℓ(f, y)`` at the observed targets.

Biases: ``separate_bias=True`` (default) gives a bias its own block ``G ⊗ [1]``;
``False`` appends a column of ones to the layer input, so weight and bias form
one block ``G ⊗ Ã`` (``Ã`` has the extra row/column ``[mean a, 1]``). Either
way the flat vector is the model's parameters in ``named_parameters`` order,
each weight row-major, as every other operator's (``op @ v`` lines up with
:class:`~hessian_eigenthings.operators.GGNOperator`).

EKFAC (George et al. 2018) keeps KFAC's eigenbases ``U_G``, ``U_A`` and replaces
the eigenvalues ``λ_G λ_Aᵀ`` by the second moments of the per-sample gradients
in that basis, ``Σ_{c,n} (U_Gᵀ (Σ_p g_cnp a_npᵀ) U_A)²`` (weighted by batch size
the same way): the exact diagonal of the GGN block in KFAC's eigenbasis. It costs
a second pass over the data.

Cost: one pass over the data (EKFAC: two), each a forward and, per batch of
columns, one backward to the layers' outputs (no parameter gradients); then an
eigendecomposition per factor on first use of ``inverse``/``eigh``/``logdet``. A convolution's
input factor is computed without unfolding where that is cheaper (see
:mod:`~hessian_eigenthings.operators.conv_factors`: about a third of unfolding's multiply-adds for
a 3×3 convolution on a large map; on a GPU only on maps above 32×32, where the multiply-adds saved
outweigh the extra kernel launches).
A product costs two small matrix products per block and never reads the data.
"""

from __future__ import annotations

import math
import sys
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import nn

from hessian_eigenthings._checks import check_count
from hessian_eigenthings._warnings import user_stacklevel
from hessian_eigenthings.batching import (
    Batch,
    BatchSource,
    batch_size,
    batchnorm_modules,
    to_device,
)
from hessian_eigenthings.loss_fns.checks import check_first_batch, check_loss_argument
from hessian_eigenthings.loss_fns.protocols import ForwardFn, LossOfOutputFn
from hessian_eigenthings.loss_fns.standard import (
    BCEWithLogitsOutputLoss,
    CrossEntropyOutputLoss,
    MSEOutputLoss,
)
from hessian_eigenthings.operators.conv_factors import conv_input_moment
from hessian_eigenthings.operators.empty_batches import EmptyBatches
from hessian_eigenthings.operators.model_guard import ModelGuard
from hessian_eigenthings.operators.parameter_binding import refuse_in_place_forward
from hessian_eigenthings.operators.precision import Precision, check_precision
from hessian_eigenthings.operators.protocol import CurvatureOperator
from hessian_eigenthings.param_utils import ParamFilter, ParamLayout, select_parameters

__all__ = [
    "EKFACOperator",
    "FisherType",
    "KFACApprox",
    "KFACOperator",
    "KroneckerBlock",
    "KroneckerEigen",
    "KroneckerEigenBlock",
    "KroneckerProductOperator",
]

FisherType = Literal["type2", "mc", "empirical"]
KFACApprox = Literal["expand", "reduce"]
_SUPPORTED = (nn.Linear, nn.Conv2d)


def _is_hf_conv1d(module: nn.Module) -> bool:
    """HuggingFace's ``transformers.pytorch_utils.Conv1D`` (GPT-2's linear layers: ``x @ W + b``,
    ``W (in, out)``), recognized without importing ``transformers``: if a model holds one, the
    module defining it is loaded already."""
    utils = sys.modules.get("transformers.pytorch_utils")
    cls = getattr(utils, "Conv1D", None)
    return cls is not None and isinstance(module, cls)


def _supported(module: nn.Module) -> bool:
    return isinstance(module, _SUPPORTED) or _is_hf_conv1d(module)


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


@dataclass(frozen=True)
class KroneckerBlock:
    """One diagonal block ``G ⊗ A`` of the operator over the parameters ``names``.

    The block acts on the matrix ``X (m, q)`` made of the parameters' entries:
    the weight's rows (a conv weight flattened to ``(out, in·kh·kw)``; a ``Conv1D`` weight
    ``(in, out)`` transposed), then the bias as a last column when it is joined to the weight; a bias alone is
    ``(m, 1)`` with ``A = [[1]]``. ``G`` is ``(m, m)``, ``A`` is ``(q, q)``.
    """

    names: tuple[str, ...]
    module: str  # the layer's name in the model
    G: torch.Tensor  # (m, m) output-side factor
    A: torch.Tensor  # (q, q) input-side factor


@dataclass(frozen=True)
class KroneckerEigenBlock:
    names: tuple[str, ...]
    eigenvalues: torch.Tensor  # (m, q): eigenvalue of u_G[:, i] ⊗ u_A[:, j] at [i, j]
    G_eigenvectors: torch.Tensor  # (m, m), columns
    A_eigenvectors: torch.Tensor  # (q, q), columns


@dataclass(frozen=True)
class KroneckerEigen:
    """Eigendecomposition of a Kronecker-factored operator, block by block.

    The eigenvector of ``blocks[b].eigenvalues[i, j]`` is ``u_G,i ⊗ u_A,j`` laid
    out in the block's parameters (zero elsewhere)."""

    blocks: tuple[KroneckerEigenBlock, ...]

    @property
    def eigenvalues(self) -> torch.Tensor:  # (n,) every eigenvalue, ascending
        return torch.cat([b.eigenvalues.reshape(-1) for b in self.blocks]).sort().values


@dataclass
class _Layer:
    name: str
    module: nn.Module
    weight: int | None  # index of the weight in the layout
    bias: int | None
    joint: bool  # bias appended to the input as a column of ones
    A: torch.Tensor | None = None
    G: torch.Tensor | None = None


@dataclass
class _Block:
    layer: _Layer
    part: Literal["weight", "bias", "joint"]
    #: the block's own output-side factor where it is not the layer's (KFOC's separate bias)
    own_G: torch.Tensor | None = None

    def A(self) -> torch.Tensor:
        if self.part == "bias":
            G = self.G()
            return torch.ones(1, 1, dtype=G.dtype, device=G.device)
        assert self.layer.A is not None
        return self.layer.A

    def G(self) -> torch.Tensor:
        if self.own_G is not None:
            return self.own_G
        assert self.layer.G is not None
        return self.layer.G


def _check_layer(name: str, module: nn.Module) -> None:
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


_NO_INPUT = torch.empty(0)  # a layer whose inputs were not kept (the factors take them as they come)


class _WeightedSum:
    """``Σ wᵢ Xᵢ / total``, accumulated in place; the first term's weight is applied late.

    NOTE [factor weights applied late]: with one batch (the common case) a factor's weights cancel
    (``size · X / size``), and a multiply and a divide per factor, two launches each on dozens of
    layers, cost more host time than the arithmetic they do; so the first term is kept as it
    comes and its weight is folded into the next term's scaling or into the final division."""

    __slots__ = ("scale", "value")

    def __init__(self) -> None:
        self.value: torch.Tensor | None = None
        self.scale = 1.0

    def _settle(self) -> torch.Tensor:
        assert self.value is not None
        if self.scale != 1.0:
            self.value.mul_(self.scale)
            self.scale = 1.0
        return self.value

    def add(self, X: torch.Tensor, weight: float) -> None:
        if self.value is None:
            self.value, self.scale = X, weight
        else:
            self._settle().add_(X, alpha=weight)

    def addmm(self, a: torch.Tensor, b: torch.Tensor, weight: float) -> None:
        """Adds ``weight · a @ b`` (one fused product-and-add after the first term)."""
        if self.value is None:
            self.value, self.scale = a @ b, weight
        else:
            self._settle().addmm_(a, b, alpha=weight)

    def mean(self, total: float) -> torch.Tensor:
        assert self.value is not None
        factor = self.scale / total
        return self.value if factor == 1.0 else self.value.mul_(factor)


class _KroneckerFactored(CurvatureOperator):
    """The shared part of KFAC and EKFAC: layers, factor pass, blocks and their algebra."""

    def __init__(
        self,
        model: nn.Module,
        dataloader: Iterable[Batch],
        forward_fn: ForwardFn,
        loss_of_output_fn: LossOfOutputFn,
        *,
        fisher_type: FisherType = "type2",
        kfac_approx: KFACApprox = "expand",
        param_filter: ParamFilter | str | Sequence[str] | None = None,
        mc_samples: int = 1,
        seed: int = 0,
        num_batches: int | None = None,
        separate_bias: bool = True,
        exclude_unsupported: bool = False,
        precision: Precision = "fp32",
        column_chunk: int = 16,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        if fisher_type not in ("type2", "mc", "empirical"):
            raise ValueError(
                f"fisher_type must be 'type2', 'mc' or 'empirical', got {fisher_type!r}"
            )
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
        if not isinstance(
            loss_of_output_fn, (CrossEntropyOutputLoss, MSEOutputLoss, BCEWithLogitsOutputLoss)
        ):
            raise ValueError(
                f"{type(self).__name__} needs the loss's distribution to factor its Hessian; supported: "
                "cross_entropy_loss_of_output(), mse_loss_of_output() and supervised_loss_of_output(...) of "
                f"nn.CrossEntropyLoss(), nn.MSELoss() or nn.BCEWithLogitsLoss(); got {loss_of_output_fn!r}"
            )
        self.mc_samples: int = check_count("mc_samples", mc_samples)  # type: ignore[assignment]
        if fisher_type != "mc" and self.mc_samples != 1:
            raise ValueError(
                f"mc_samples={mc_samples} applies to fisher_type='mc' only (got {fisher_type!r})"
            )
        self.seed: int = check_count("seed", seed, minimum=0)  # type: ignore[assignment]
        self.column_chunk: int = check_count("column_chunk", column_chunk)  # type: ignore[assignment]
        if not isinstance(separate_bias, bool) or not isinstance(exclude_unsupported, bool):
            raise TypeError("separate_bias and exclude_unsupported must be True or False")
        refuse_in_place_forward(model, type(self).__name__)
        self.model = model
        self.forward_fn = forward_fn
        self.loss_of_output_fn = loss_of_output_fn
        self.fisher_type: FisherType = fisher_type
        self.kfac_approx: KFACApprox = kfac_approx
        self.separate_bias = separate_bias
        self.precision = check_precision(precision)
        self.source = BatchSource(dataloader, full_dataset=True, num_batches=num_batches)
        check_first_batch(model, self.source.first_batch(), forward_fn, loss_of_output_fn)

        selected = select_parameters(model, param_filter)
        owner: dict[int, tuple[str, nn.Module, str]] = {}
        users: dict[int, list[str]] = {}
        for mname, module in model.named_modules(remove_duplicate=False):
            for pname, p in module.named_parameters(recurse=False, remove_duplicate=False):
                owner.setdefault(id(p), (mname, module, pname))
                users.setdefault(id(p), []).append(f"{mname}.{pname}" if mname else pname)
        tied = [" = ".join(users[id(p)]) for p in selected.values() if len(users[id(p)]) > 1]
        if tied:
            raise ValueError(
                f"{type(self).__name__} gives each layer its own block; these selected parameters are tied "
                f"(shared by several layers): {'; '.join(tied)}. Leave them out with param_filter"
            )
        unsupported = []
        named = []
        for name, p in selected.items():
            mname, module, pname = owner[id(p)]
            if _supported(module) and pname in ("weight", "bias"):
                _check_layer(mname, module)
                named.append((name, p))
            else:
                unsupported.append(f"{name} ({type(module).__name__})")
        if unsupported and not exclude_unsupported:
            raise ValueError(
                f"{type(self).__name__} covers nn.Linear, nn.Conv2d and transformers' Conv1D layers; these selected parameters belong to "
                f"none: {', '.join(unsupported)}. Leave them out with param_filter, or pass "
                "exclude_unsupported=True to drop them (listed in .excluded_parameters)"
            )
        if not named:
            raise ValueError(
                "no selected parameter belongs to an nn.Linear, nn.Conv2d or transformers' Conv1D layer"
            )
        #: selected parameters left out with ``exclude_unsupported=True`` (name and layer type)
        self.excluded_parameters: tuple[str, ...] = tuple(unsupported)
        self.named_params = named
        self.params = [p for _, p in named]
        self.layout = ParamLayout.from_named(named)
        self._size = self.layout.size
        self._device = self.layout.device
        self._dtype = self.layout.dtype
        #: factors and reductions run in float32 or better
        self.factor_dtype = torch.promote_types(self._dtype, torch.float32)

        layers: dict[str, _Layer] = {}
        for index, (_, p) in enumerate(named):
            mname, module, pname = owner[id(p)]
            layer = layers.setdefault(mname, _Layer(mname, module, None, None, False))
            setattr(layer, pname, index)
        for layer in layers.values():
            layer.joint = not separate_bias and layer.weight is not None and layer.bias is not None
        self._layers = list(layers.values())
        self._blocks: list[_Block] = []
        for layer in self._layers:
            if layer.joint:
                self._blocks.append(_Block(layer, "joint"))
            else:
                if layer.weight is not None:
                    self._blocks.append(_Block(layer, "weight"))
                if layer.bias is not None:
                    self._blocks.append(_Block(layer, "bias"))
        self.guard = ModelGuard(model, self.params)
        coupled = batchnorm_modules(model)
        if coupled:
            # NOTE [samples independent]: a column of the loss Hessian covers every row of the batch
            # at once, which is exact only when no row's output depends on another row's input
            warnings.warn(
                f"{type(self).__name__}: BatchNorm in training mode ({', '.join(coupled[:3])}"
                f"{', ...' if len(coupled) > 3 else ''}) couples the samples of a batch; KFAC's factors "
                "assume independent samples (call model.eval() for the curvature of the deterministic model)",
                UserWarning,
                stacklevel=user_stacklevel(),
            )
        #: NOTE [layer outputs changed in place]: set once a forward modified a layer's output
        self._clone_outputs = False
        self._empty = EmptyBatches(type(self).__name__)
        self._eigen: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] | None = None
        self._compute_factors()
        self._after_factors()

    def _after_factors(self) -> None:
        """What a subclass computes once the factors are known (EKFAC: its second pass)."""

    # -- the pass over the data ---------------------------------------------------------------
    def _inputs(self, layer: _Layer, x: torch.Tensor) -> torch.Tensor:
        """The layer input ``(N, positions, d_in)`` (ones appended for a joint bias), factor dtype."""
        module = layer.module
        x = x.detach()
        if isinstance(module, nn.Conv2d):
            a = _conv_patches(module, x)
        else:
            if x.dim() < 2:
                raise ValueError(
                    f"KFAC needs a batch dimension at the input of layer {layer.name!r}"
                )
            a = x.reshape(x.shape[0], -1, x.shape[-1])
        a = a.to(self.factor_dtype)
        if layer.joint:
            a = torch.cat([a, a.new_ones(*a.shape[:-1], 1)], dim=-1)
        return a

    def _input_moment(self, layer: _Layer, x: torch.Tensor) -> tuple[torch.Tensor, int]:
        """``(Σ ã ãᵀ, rows)`` over the layer input's rows (positions as samples, or a sample's
        mean position with ``reduce``), in the factor dtype; a convolution's by the route
        :func:`conv_input_moment` plans (unfolded or row shifts), its patch sums only for a joined bias."""
        module = layer.module
        x = x.detach().to(self.factor_dtype)
        reduce = self.kfac_approx == "reduce"
        if isinstance(module, nn.Conv2d):
            padding = (0, 0) if isinstance(module.padding, str) else module.padding  # "valid"
            S, s, rows = conv_input_moment(
                x,
                module.kernel_size,  # type: ignore[arg-type]
                module.stride,  # type: ignore[arg-type]
                padding,  # type: ignore[arg-type]
                module.dilation,  # type: ignore[arg-type]
                reduce=reduce,
                sums=layer.joint,
            )
        else:
            if x.dim() < 2:
                raise ValueError(
                    f"KFAC needs a batch dimension at the input of layer {layer.name!r}"
                )
            a = x.reshape(x.shape[0], -1, x.shape[-1])
            flat = a.mean(1) if reduce else a.reshape(-1, a.shape[-1])
            S, rows = flat.T @ flat, flat.shape[0]
            s = flat.sum(0) if layer.joint else S.new_empty(0)
        if layer.joint:
            S = _joined(S, s, rows)
        return S, rows

    def _grads(self, layer: _Layer, g: torch.Tensor) -> torch.Tensor:
        """Output gradients ``(k, N, positions, d_out)`` of a block of ``k`` columns."""
        g = g.detach().to(self.factor_dtype)
        if isinstance(layer.module, nn.Conv2d):
            return g.flatten(3).transpose(2, 3)
        return g.reshape(g.shape[0], g.shape[1], -1, g.shape[-1])

    def _columns(
        self, output: torch.Tensor, batch: Batch, position: int
    ) -> tuple[int, Callable[[int, int], torch.Tensor]]:
        """``k`` and ``columns(start, stop) -> (stop - start, *output.shape)``: the columns ``s_c``
        of the batch loss's output Hessian, made a chunk at a time (NOTE [column chunks])."""
        loss = self.loss_of_output_fn
        out = output.detach()
        if isinstance(loss, CrossEntropyOutputLoss):
            if out.dim() < 2:
                raise ValueError(
                    f"cross-entropy KFAC needs logits (N, C, ...), got shape {tuple(out.shape)}"
                )
            y = batch[1] if isinstance(batch, (tuple, list)) else None
            if not isinstance(y, torch.Tensor):
                raise ValueError("cross-entropy KFAC reads the targets from batch[1]")
            valid = None if y.is_floating_point() else (y != loss.ignore_index)
            rows = out.numel() // out.shape[1]
            count = (
                torch.tensor(float(rows), dtype=torch.float64)
                if valid is None
                else valid.sum().clamp_min(1)
            )
            w = 1.0 / count.to(self.factor_dtype) if loss.reduction == "mean" else torch.ones(())
            mask = None if valid is None else valid.unsqueeze(1).to(out.dtype)
        else:
            w = torch.tensor(
                1.0 / out.numel() if loss.reduction == "mean" else 1.0, dtype=torch.float64
            )
            mask = None
        w = w.to(self.factor_dtype)  # 0-dim: the reduction's weight per loss term
        if self.fisher_type == "empirical":
            leaf = out.requires_grad_(True)
            with torch.enable_grad():
                (grad,) = torch.autograd.grad(loss(leaf, batch), leaf)
            empirical = (grad / w.sqrt()).unsqueeze(0).to(out.dtype)
            return 1, lambda a, b: empirical[a:b]
        if self.fisher_type == "mc":
            generator = torch.Generator(device=out.device)
            generator.manual_seed(self.seed * 1_000_003 + position)
            samples = loss.sample_grads(out, batch, self.mc_samples, generator)
            sampled = (samples * (w / self.mc_samples).sqrt()).to(out.dtype)
            return self.mc_samples, lambda a, b: sampled[a:b]
        if isinstance(loss, CrossEntropyOutputLoss):
            p = torch.softmax(out.to(self.factor_dtype), dim=1).movedim(1, -1)  # (rows..., C)
            C = p.shape[-1]
            eye = torch.eye(C, dtype=p.dtype, device=p.device).reshape(C, *([1] * (p.dim() - 1)), C)
            root = p.movedim(-1, 0).sqrt().unsqueeze(-1) * w.sqrt()  # (C, rows..., 1)

            def ce_columns(a: int, b: int) -> torch.Tensor:
                cols = ((eye[a:b] - p.unsqueeze(0)) * root[a:b]).movedim(
                    -1, 2
                )  # (b - a, *out.shape)
                return (cols if mask is None else cols * mask).to(out.dtype)

            return C, ce_columns
        if isinstance(loss, MSEOutputLoss):
            diag = torch.full_like(out, 2.0) * w
        else:
            s = torch.sigmoid(out)
            diag = s * (1 - s) * w
        base = diag.sqrt().unsqueeze(0)
        if out.dim() <= 1:
            return 1, lambda a, b: base[a:b]
        C = out.shape[-1]
        eye = torch.eye(C, dtype=out.dtype, device=out.device).reshape(
            C, *([1] * (out.dim() - 1)), C
        )
        return C, lambda a, b: base * eye[a:b]

    def _run(
        self,
        visit: Callable[[_Layer, torch.Tensor, torch.Tensor, float], None],
        on_input: Callable[[_Layer, torch.Tensor, float], None] | None,
    ) -> float:
        """One pass: for each batch, ``on_input(layer, x, weight)`` in the forward (``x`` the
        layer's raw input; without it, the inputs are kept as ``a``) and
        ``visit(layer, a_or_empty, g, weight)`` after the backward. Returns the total weight."""
        total = 0.0
        seen = skipped = 0
        with self.guard.product(self.precision, double_backward=False):
            for position, raw in enumerate(self.source.batches()):
                seen += 1
                if batch_size(raw) == 0:  # NOTE [empty batches] (positions kept: MC draws unchanged)
                    skipped += 1
                    continue
                batch = to_device(raw, self.device)
                size = float(batch_size(batch))
                inputs, outputs = self._forward(batch, on_input, size)
                output = self._output
                k, columns = self._columns(output, batch, position)
                layers = [layer for layer in self._layers if layer.name in outputs]
                targets = [outputs[layer.name] for layer in layers]
                # NOTE [column chunks]: type-2 has a column per class; a batched backward of all of
                # them at once holds k copies of the activations' gradients (and the columns
                # themselves k outputs), so they are made and go through in chunks of
                # ``column_chunk`` (the factors are sums over columns: the same result)
                for start in range(0, k, self.column_chunk):
                    chunk = columns(start, min(k, start + self.column_chunk))
                    last = start + self.column_chunk >= k
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
                    for layer, g, y in zip(layers, grads, targets, strict=True):
                        if g is None:
                            g = torch.zeros(
                                (chunk.shape[0], *y.shape), dtype=y.dtype, device=y.device
                            )
                        visit(
                            layer,
                            inputs.get(layer.name, _NO_INPUT),
                            self._grads(layer, g),
                            size,
                        )
                total += size
                del self._output
        self._empty.say(skipped, seen)
        if total == 0:
            raise EmptyBatches.none_error(seen)
        return total

    def _forward(
        self,
        batch: Batch,
        on_input: Callable[[_Layer, torch.Tensor, float], None] | None,
        size: float,
    ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        inputs: dict[str, torch.Tensor] = {}
        outputs: dict[str, torch.Tensor] = {}
        versions: dict[str, int] = {}
        handles = []

        def hook(
            layer: _Layer, module: nn.Module, args: tuple[Any, ...], out: torch.Tensor
        ) -> torch.Tensor | None:
            if layer.name in outputs:
                raise ValueError(
                    f"layer {layer.name!r} ran twice in one forward; KFAC needs each layer called once per batch"
                )
            if on_input is not None:
                on_input(layer, args[0], size)
            else:
                inputs[layer.name] = self._inputs(layer, args[0])
            outputs[layer.name] = out
            versions[layer.name] = out._version
            return out.clone() if self._clone_outputs else None

        for layer in self._layers:
            handles.append(
                layer.module.register_forward_hook(
                    lambda m, a, o, layer=layer: hook(layer, m, a, o)
                )
            )
        try:
            with torch.enable_grad(), self.guard.private_buffers():
                self._output = self.forward_fn(self.model, batch)
            # NOTE [layer outputs changed in place]: an in-place op after a layer (ReLU(inplace=True))
            # rewrites the output tensor we differentiate against; such models run every forward with
            # the hooks returning a copy, so the captured tensor keeps its value and graph
            if not self._clone_outputs and any(
                outputs[k]._version != v for k, v in versions.items()
            ):
                self._clone_outputs = True
                if on_input is not None:
                    raise _Retry
                inputs.clear()
                outputs.clear()
                versions.clear()
                with torch.enable_grad(), self.guard.private_buffers():
                    self._output = self.forward_fn(self.model, batch)
        finally:
            for h in handles:
                h.remove()
        if not isinstance(self._output, torch.Tensor):
            raise TypeError(
                f"forward_fn must return a tensor (the model output), got {type(self._output).__name__}"
            )
        return inputs, outputs

    # -- KFAC's factors ---------------------------------------------------------------------
    def _compute_factors(self) -> None:
        for layer in self._layers:
            layer.A = layer.G = None
        sums_A: dict[str, _WeightedSum] = {}
        sums_G: dict[str, _WeightedSum] = {}

        def on_input(layer: _Layer, x: torch.Tensor, size: float) -> None:
            if layer.weight is None:
                return
            S, rows = self._input_moment(layer, x)
            # the batch's mean over rows, weighted by its size
            sums_A.setdefault(layer.name, _WeightedSum()).add(S, size / rows)

        def visit(layer: _Layer, _a: torch.Tensor, g: torch.Tensor, size: float) -> None:
            g = g.sum(2, keepdim=True) if self.kfac_approx == "reduce" else g
            flat = g.reshape(-1, g.shape[-1])
            sums_G.setdefault(layer.name, _WeightedSum()).addmm(flat.T, flat, size)

        try:
            total = self._run(visit, on_input)
        except (
            _Retry
        ):  # the first forward found outputs changed in place: start again, copying them
            sums_A.clear()
            sums_G.clear()
            total = self._run(visit, on_input)
        for layer in self._layers:
            if layer.name in sums_A:
                layer.A = sums_A[layer.name].mean(total)
            if layer.name in sums_G:
                layer.G = sums_G[layer.name].mean(total)
            if layer.G is None:  # the layer never ran in the forward: its GGN block is zero
                m = (
                    self._weight_matrix_shape(layer)[0]
                    if layer.weight is not None
                    else self.params[layer.bias].shape[0]  # type: ignore[index]
                )
                layer.G = torch.zeros(m, m, dtype=self.factor_dtype, device=self.device)
            if layer.A is None and layer.weight is not None:
                q = self._weight_matrix_shape(layer)[1] + int(layer.joint)
                layer.A = torch.zeros(q, q, dtype=self.factor_dtype, device=self.device)

    @property
    def factors(self) -> tuple[KroneckerBlock, ...]:
        """The blocks ``G ⊗ A`` in the order of the flat vector's parameters."""
        return tuple(
            KroneckerBlock(self._names(b), b.layer.name, b.G(), b.A()) for b in self._blocks
        )

    def _names(self, block: _Block) -> tuple[str, ...]:
        idx = {"weight": [block.layer.weight], "bias": [block.layer.bias]}.get(
            block.part, [block.layer.weight, block.layer.bias]
        )
        return tuple(self.layout.names[i] for i in idx if i is not None)

    # -- blocks as matrices ------------------------------------------------------------------
    def _weight_matrix_shape(self, layer: _Layer) -> tuple[int, int]:
        """``(out, in)`` of the layer's weight as a matrix (a Conv2d's kernel flattened)."""
        assert layer.weight is not None
        shape = self.params[layer.weight].shape
        if _is_hf_conv1d(layer.module):
            return shape[1], shape[0]
        return shape[0], shape[1:].numel()

    def _gather(self, block: _Block, views: list[torch.Tensor]) -> torch.Tensor:
        """``(k, m, q)`` of the block's parameters in a row block's per-parameter views."""
        layer = block.layer
        parts = []
        if block.part in ("weight", "joint"):
            assert layer.weight is not None
            w = views[layer.weight]
            if _is_hf_conv1d(layer.module):  # (k, in, out) entries: X is the transpose
                parts.append(w.transpose(1, 2))
            else:
                parts.append(w.reshape(w.shape[0], w.shape[1], -1))
        if block.part in ("bias", "joint"):
            assert layer.bias is not None
            parts.append(views[layer.bias].unsqueeze(-1))
        X = parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)
        return X.to(self.factor_dtype)

    def _scatter(self, block: _Block, Y: torch.Tensor, views: list[torch.Tensor]) -> None:
        layer = block.layer
        if block.part == "bias":
            assert layer.bias is not None
            views[layer.bias].copy_(Y[..., 0])
            return
        assert layer.weight is not None
        w = views[layer.weight]
        d = self._weight_matrix_shape(layer)[1]
        if _is_hf_conv1d(layer.module):
            w.copy_(Y[..., :d].transpose(-1, -2))
        else:
            w.copy_(Y[..., :d].reshape(w.shape))
        if block.part == "joint":
            assert layer.bias is not None
            views[layer.bias].copy_(Y[..., d])

    def _block_product(self, index: int, X: torch.Tensor) -> torch.Tensor:
        block = self._blocks[index]
        return block.G() @ X @ block.A()

    def _matmat_rows(self, V: torch.Tensor) -> torch.Tensor:
        out = self.layout.empty(V.shape[0])
        views, out_views = self.layout.split_rows(V), self.layout.split_rows(out)
        for i, block in enumerate(self._blocks):
            self._scatter(block, self._block_product(i, self._gather(block, views)), out_views)
        return out

    # -- the eigendecomposition and what it gives ----------------------------------------------
    def _block_eigenvalues(
        self, index: int, lam_G: torch.Tensor, lam_A: torch.Tensor
    ) -> torch.Tensor:
        return lam_G.unsqueeze(1) * lam_A.unsqueeze(0)

    def _eigen_blocks(self) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """``(D (m, q), U_G, U_A)`` per block (computed once; factors are symmetric PSD)."""
        if self._eigen is None:
            cache: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

            def eig(M: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
                if id(M) not in cache:
                    lam, U = torch.linalg.eigh(M)
                    cache[id(M)] = (lam, U)
                return cache[id(M)]

            result = []
            for i, block in enumerate(self._blocks):
                A = block.A()
                lam_G, U_G = eig(block.G())
                lam_A, U_A = eig(A)
                result.append((self._block_eigenvalues(i, lam_G, lam_A), U_G, U_A))
            self._eigen = result
        return self._eigen

    def eigh(self) -> KroneckerEigen:
        """Eigenvalues of the whole operator with the factors' eigenvectors, block by block."""
        return KroneckerEigen(
            tuple(
                KroneckerEigenBlock(self._names(b), D, U_G, U_A)
                for b, (D, U_G, U_A) in zip(self._blocks, self._eigen_blocks(), strict=True)
            )
        )

    def trace(self) -> torch.Tensor:
        """``tr`` of the operator (sum of its eigenvalues), a 0-dim tensor in the factors' dtype."""
        return sum(
            (D.sum() for D, _, _ in self._eigen_blocks()),
            torch.zeros((), dtype=self.factor_dtype, device=self.device),
        )

    def logdet(self, damping: float = 0.0) -> torch.Tensor:
        """``log det (K + damping·I)`` (e.g. a Laplace posterior's precision with an isotropic prior).

        Without damping a singular operator (cross-entropy's ``G`` always has the null vector of
        ones) gives ``-inf``, or ``nan`` where rounding left an eigenvalue slightly below zero."""
        damping = _check_damping(damping)
        zero = torch.zeros((), dtype=self.factor_dtype, device=self.device)
        return sum(((D + damping).log().sum() for D, _, _ in self._eigen_blocks()), zero)

    def frobenius_norm(self) -> torch.Tensor:
        """``‖·‖_F`` of the operator."""
        squares = sum(
            (D.square().sum() for D, _, _ in self._eigen_blocks()),
            torch.zeros((), dtype=self.factor_dtype, device=self.device),
        )
        return squares.sqrt()

    def inverse(self, damping: float = 0.0) -> CurvatureOperator:
        """``(K + damping·I)⁻¹`` applied exactly through the eigendecompositions of each block.

        NOTE [exact damping]: K-FAC optimizers often damp each factor instead, ``(G + √λ I) ⊗
        (A + √λ I)``, which adds cross terms ``√λ (G ⊗ I + I ⊗ A)`` and is not ``K + λI``. Here
        every block is ``U (D + λ)⁻¹ Uᵀ`` with ``U = U_G ⊗ U_A``: the inverse of the damped
        operator itself (what a Laplace posterior or a linear solve needs), at the price of one
        eigendecomposition per factor (cached). With ``damping=0`` a singular block gives inf.
        """
        damping = _check_damping(damping)
        return _EigenFunction(self, lambda D: 1.0 / (D + damping))

    def _eigen_apply(
        self, V: torch.Tensor, fn: Callable[[torch.Tensor], torch.Tensor]
    ) -> torch.Tensor:
        out = self.layout.empty(V.shape[0])
        views, out_views = self.layout.split_rows(V), self.layout.split_rows(out)
        for block, (D, U_G, U_A) in zip(self._blocks, self._eigen_blocks(), strict=True):
            X = U_G.T @ self._gather(block, views) @ U_A
            self._scatter(block, U_G @ (X * fn(D)) @ U_A.T, out_views)
        return out

    def __repr__(self) -> str:
        extra = f", excluded={list(self.excluded_parameters)}" if self.excluded_parameters else ""
        return (
            f"{type(self).__name__}(size={self.size}, blocks={len(self._blocks)}, fisher_type={self.fisher_type!r}, "
            f"kfac_approx={self.kfac_approx!r}, dtype={self.dtype}{extra})"
        )


def _check_damping(damping: object) -> float:
    value = float(damping)  # type: ignore[arg-type]
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"damping must be a finite number >= 0, got {damping!r}")
    return value


class _Retry(Exception):
    """Raised inside a pass when the forward found a layer output changed in place."""


class _EigenFunction(CurvatureOperator):
    """``f(K)`` of a Kronecker-factored operator ``K``, block by block in its eigenbasis."""

    def __init__(self, op: _KroneckerFactored, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self._op = op
        self._fn = fn
        self._size, self._device, self._dtype = op.size, op.device, op.dtype

    def _matmat_rows(self, V: torch.Tensor) -> torch.Tensor:
        return self._op._eigen_apply(V, self._fn)


class KroneckerProductOperator(_KroneckerFactored):
    """Base of the operators whose blocks are exactly ``G ⊗ A`` (KFAC; KFOC in ``kfoc``): the
    layers, the data pass, the block algebra, and trace and norm from the factors. A subclass
    sets each layer's factors in ``_compute_factors`` (called once, at construction)."""

    def trace(self) -> torch.Tensor:
        """``Σ tr(G)·tr(A)`` over the blocks (no eigendecomposition)."""
        zero = torch.zeros((), dtype=self.factor_dtype, device=self.device)
        return sum((b.G().trace() * b.A().trace() for b in self._blocks), zero)

    def frobenius_norm(self) -> torch.Tensor:
        """``sqrt(Σ ‖G‖²_F ‖A‖²_F)`` over the blocks (no eigendecomposition)."""
        zero = torch.zeros((), dtype=self.factor_dtype, device=self.device)
        return sum((b.G().square().sum() * b.A().square().sum() for b in self._blocks), zero).sqrt()


class KFACOperator(KroneckerProductOperator):
    """Kronecker-factored approximate curvature (KFAC) of the GGN / Fisher of a mean loss.

    ``KFACOperator(model, dataloader, forward_fn, loss_of_output_fn, *, fisher_type="type2",
    kfac_approx="expand", param_filter=None, mc_samples=1, seed=0, num_batches=None,
    separate_bias=True, exclude_unsupported=False, precision="fp32", column_chunk=16)``; the calling conventions
    of :class:`~hessian_eigenthings.operators.GGNOperator` (``forward_fn(model, batch) ->
    output``, ``loss_of_output_fn(output, batch) -> mean loss``).

    - ``fisher_type``: ``"type2"`` (exact loss-Hessian square root: KFAC of the GGN),
      ``"mc"`` (``mc_samples`` sampled targets per sample, seeded; the global random state is
      untouched), ``"empirical"`` (gradients at the observed targets).
    - ``kfac_approx``: ``"expand"`` or ``"reduce"`` for layers with weight sharing (Conv2d,
      Linear on ``(N, T, d)``); the same thing without sharing.
    - ``separate_bias``: a bias in its own block ``G ⊗ [1]`` (default) or joined to its weight
      through a column of ones (one block ``G ⊗ Ã``).
    - ``column_chunk``: most loss-Hessian columns (type-2: one per class; mc: ``mc_samples``)
      backpropagated together in one batched backward (memory: that many activation gradients).
    - Selected parameters outside ``nn.Linear``/``nn.Conv2d``/``transformers``' ``Conv1D`` raise a ``ValueError`` naming
      them; ``exclude_unsupported=True`` leaves them out (``.excluded_parameters``).

    The factors are computed once, at construction (one pass over ``dataloader``); build a new
    operator after the model changes. ``op @ v``, ``op.matmat``, ``op.inverse(damping)``,
    ``op.eigh()``, ``op.logdet()``, ``op.trace()``, ``op.frobenius_norm()``; ``op.factors``
    holds the blocks. The module docstring states the conventions.
    """


class EKFACOperator(_KroneckerFactored):
    """Eigenvalue-corrected KFAC (George et al. 2018): KFAC's eigenbases, with the eigenvalues
    re-estimated as the second moments of the per-sample gradients in that basis.

    Same arguments as :class:`KFACOperator`. The corrected eigenvalues
    ``Σ_{c,n} (U_Gᵀ (Σ_p g_cnp a_npᵀ) U_A)²`` (weighted by batch size) are per-sample: the
    gradient of a sample sums over its weight-sharing positions, whatever ``kfac_approx`` (which
    chooses the factors whose eigenbases are used). NOTE [EKFAC per sample]: a per-position
    moment would not be the second moment of any gradient; per sample, the corrected eigenvalues
    are exactly the diagonal of the GGN block in KFAC's eigenbasis (and EKFAC equals KFAC where
    KFAC is exact). Costs a second pass over the data.
    """

    _scalings: list[torch.Tensor] | None = None

    def _after_factors(self) -> None:
        self._scalings = self._compute_scalings()
        self._eigen = None  # the eigenvalues change from KFAC's to the corrected ones

    def _compute_scalings(self) -> list[torch.Tensor]:
        bases = self._eigen_blocks_of_kfac()
        sums: list[torch.Tensor | None] = [None] * len(self._blocks)
        by_layer: dict[str, list[int]] = {}
        for i, b in enumerate(self._blocks):
            by_layer.setdefault(b.layer.name, []).append(i)

        def visit(layer: _Layer, a: torch.Tensor, g: torch.Tensor, size: float) -> None:
            # g: (k, N, P, m); a: (N, P, q)
            for i in by_layer[layer.name]:
                block = self._blocks[i]
                _, U_G, U_A = bases[i]
                g_rot = g @ U_G  # (k, N, P, m)
                if block.part == "bias":
                    value = g_rot.sum(2).square().sum((0, 1)).unsqueeze(-1)  # (m, 1)
                else:
                    a_rot = a @ U_A  # (N, P, q)
                    value = self._rotated_moment(g_rot, a_rot)
                sums[i] = value.mul_(size) if sums[i] is None else sums[i].add_(value.mul_(size))  # type: ignore[union-attr]

        total = self._run(visit, None)
        return [s.div_(total) for s in sums if s is not None]

    @staticmethod
    def _rotated_moment(g_rot: torch.Tensor, a_rot: torch.Tensor) -> torch.Tensor:
        """``Σ_{c,n} (Σ_p g_rot[c,n,p] a_rot[n,p]ᵀ)²`` as ``(m, q)``, chunked over samples."""
        k, N, P, m = g_rot.shape
        q = a_rot.shape[-1]
        if P == 1:  # an outer product per sample: its square is the outer product of squares
            return torch.einsum("cnm,nq->mq", g_rot[:, :, 0].square(), a_rot[:, 0].square())
        out = g_rot.new_zeros(m, q)
        step = max(1, (1 << 24) // max(1, k * m * q))
        for s in range(0, N, step):
            grads = torch.einsum("cnpm,npq->cnmq", g_rot[:, s : s + step], a_rot[s : s + step])
            out += grads.square().sum((0, 1))
        return out

    def _eigen_blocks_of_kfac(self) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        self._eigen = None
        return super()._eigen_blocks()

    def _block_eigenvalues(
        self, index: int, lam_G: torch.Tensor, lam_A: torch.Tensor
    ) -> torch.Tensor:
        scalings = self._scalings
        if scalings is None:  # during construction: KFAC's eigenvalues (only the bases are used)
            return super()._block_eigenvalues(index, lam_G, lam_A)
        return scalings[index]

    @property
    def corrected_eigenvalues(self) -> tuple[torch.Tensor, ...]:
        """Per block ``(m, q)``: the eigenvalues replacing ``λ_G λ_Aᵀ``."""
        assert self._scalings is not None
        return tuple(self._scalings)

    def _matmat_rows(self, V: torch.Tensor) -> torch.Tensor:
        return self._eigen_apply(V, lambda D: D)
