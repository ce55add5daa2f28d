"""Kronecker-factored optimal curvature (KFOC): per module, the ``G ⊗ A`` nearest the GGN block.

KFAC (:mod:`hessian_eigenthings.operators.kfac`) takes the factors of a module's GGN block as
separate averages of output gradients and inputs; KFOC takes the Kronecker product closest to
the block itself in Frobenius norm, ``argmin ‖B - G ⊗ A‖_F``, without forming ``B``.

The block. For a module ``z = W a (+ b)`` with ``W (m, q)``, the contribution of sample ``n``
and loss-Hessian column ``c`` (the columns of KFAC's module docstring; ``fisher_type``) is the
per-sample gradient ``J = Σ_p g_p a_pᵀ`` (``m × q``; a sum over the weight-sharing positions
``p``: patches of a conv, tokens; one position without sharing). That is
``weight_sharing="sample"``, exact for a loss with one term per sample (logits ``(N, C)``);
``weight_sharing="position"`` takes each position as its own term, ``J = g_p a_pᵀ``, exact
when position ``p`` is loss term ``p`` alone (a per-token network; NOTE [weight sharing]).
With ``vec`` the entries row-major as in the flat vector,

    B = Σ_b (|b| / Σ|b|) Σ_{c, n ∈ b} vec(J) vec(J)ᵀ,

batches weighted by their size as in every operator: the GGN block of the mean loss over the
dataset (of the Monte-Carlo or empirical Fisher for the other ``fisher_type`` values).

The nearest Kronecker product (Van Loan & Pitsianis 1993). Index ``B`` by
``((r, s), (r', s'))`` with ``r`` an output row and ``s`` an input column. Its rearrangement
``R[(r, r'), (s, s')] = B[(r, s), (r', s')]`` (``m² × q²``) turns ``G ⊗ A`` into the rank-one
``vec(G) vec(A)ᵀ`` while keeping the Frobenius norm, so the nearest ``G ⊗ A`` is ``σ₁ u vᵀ``
of the top singular triple of ``R``. The rearrangement of one term ``vec(J) vec(J)ᵀ`` is
``J ⊗ J``, so ``R = Σ w·(J ⊗ J)`` and its products need only the per-sample gradients:

    R vec(A)  = vec(Σ w·J A Jᵀ)     (an m × m matrix)
    Rᵀ vec(G) = vec(Σ w·Jᵀ G J)     (a q × q matrix).

Without weight sharing ``J = g aᵀ`` and these are ``Σ w·(aᵀ A a)·g gᵀ`` and
``Σ w·(gᵀ G g)·a aᵀ``: KFAC's sums with one scalar weight per sample. With sharing the
per-sample gradients ``J`` are formed a chunk of samples at a time. Power iteration on
``RᵀR`` alternates the two products from ``A₀ = I``. Both products map symmetric positive
semi-definite matrices to symmetric PSD ones (``J A Jᵀ`` is PSD for PSD ``A``), so every
iterate, and the limit (the top singular vectors of ``R`` can be taken PSD), is a symmetric
PSD factor. Each product is a
pass over the data (NOTE [a pass per product]). The result is ``G ⊗ A`` with ``G`` the last
left iterate (unit norm) and ``A = Rᵀ vec(G)``, the optimal partner of that ``G``; the scale
is then split so that ``‖G‖_F = ‖A‖_F``.

Biases: a separate bias block is ``m × 1``, so ``G ⊗ [1]`` can be any matrix and KFOC's ``G``
is the exact bias block ``Σ w·ḡ ḡᵀ`` (``ḡ = Σ_p g_p``; per position with
``weight_sharing="position"``), with no iteration; with
``separate_bias=False`` a column of ones joins the bias to the input, as in KFAC, and the
joint ``m × (q + 1)`` block is approximated as above.

Where KFAC is exact (one data point; a single ``Linear`` layer with MSE) the block is a
Kronecker product, ``R`` has rank one, and KFOC equals KFAC (the first iteration finds it,
the second sees no change). Elsewhere, once converged,
``‖B - G_KFOC ⊗ A_KFOC‖_F <= ‖B - G_KFAC ⊗ A_KFAC‖_F``.

Distributed (``DDPKFOCOperator``, ``FSDPKFOCOperator``): each rank runs every pass over its own
batches and the pass's sums and sample counts are summed over the ranks (one all-reduce per
pass), so every rank iterates on the union's sums and takes the same decisions; Monte-Carlo
draws are keyed by rank. Every rank needs every module's current iterate in every pass, so the
sums are all-reduced even with ``factor_placement="by_module"``, which places only the
converged factors (NOTE [Kronecker factors by module] in ``factor_owners``).

Cost: ``2·max_iter`` passes over the data at most (one per product with ``R`` or ``Rᵀ``),
each a forward and a backward per chunk of columns as KFAC's single pass; stopping when the
input-side factor changes by less than ``tol`` (unit Frobenius norm) between iterations. The
products, ``inverse``, ``eigh``, ``logdet``, ``trace`` and ``frobenius_norm`` are KFAC's
(the same Kronecker-block machinery).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Literal

import torch
from torch import nn
from typing_extensions import Unpack

from hessian_eigenthings._checks import check_count
from hessian_eigenthings.batching import Batch
from hessian_eigenthings.loss_fns.protocols import ForwardFn, LossOfOutputFn
from hessian_eigenthings.loss_fns.standard import CrossEntropyOutputLoss
from hessian_eigenthings.operators.factor_options import (
    KroneckerOptions,
    factor_options,
    with_options_signature,
)
from hessian_eigenthings.operators.factor_pass import FactorModule, FactorPass
from hessian_eigenthings.operators.kfac import ModuleKroneckerOperator
from hessian_eigenthings.operators.ranks import LOCAL, Ranks

__all__ = ["KFOCOperator", "WeightSharing"]

WeightSharing = Literal["sample", "position"]

# samples of per-sample gradients formed at once with weight sharing: about 2^24 numbers
_CHUNK_ELEMENTS = 1 << 24


def _per_sample_gradients(a: torch.Tensor, g: torch.Tensor) -> Iterable[torch.Tensor]:
    """``J = Σ_p g_p a_pᵀ`` for every column and sample, a chunk of samples at a time, each chunk
    ``(k, chunk, m, q)``."""
    k, N, _, m = g.shape
    q = a.shape[-1]
    step = max(1, _CHUNK_ELEMENTS // max(1, k * m * q))
    for s in range(0, N, step):
        yield torch.einsum("cnpm,npq->cnmq", g[:, s : s + step], a[s : s + step])


# The contractions below are written as one matrix product over every (column, sample) pair
# each: a three-operand einsum may build the (k, N, m, m) intermediate first.
def rearranged_product(a: torch.Tensor, g: torch.Tensor, A: torch.Tensor) -> torch.Tensor:
    """``Σ_{c,n} J A Jᵀ`` ``(m, m)`` for inputs ``a (N, P, q)`` and output gradients
    ``g (k, N, P, m)``: the rearranged block times ``vec(A)``, for one batch (unweighted)."""
    m = g.shape[-1]
    if g.shape[2] == 1:  # J = g aᵀ: J A Jᵀ = (aᵀ A a) g gᵀ
        a0, g0 = a[:, 0], g[:, :, 0]
        s = ((a0 @ A) * a0).sum(-1)  # (N,)
        return (g0 * s.unsqueeze(-1)).reshape(-1, m).T @ g0.reshape(-1, m)
    out = g.new_zeros(m, m)
    for J in _per_sample_gradients(a, g):
        Jt = J.transpose(-1, -2)  # (k, chunk, q, m)
        out += (A @ Jt).reshape(-1, m).T @ Jt.reshape(-1, m)  # A symmetric: (J A)ᵀ = A Jᵀ
    return out


def rearranged_transpose_product(a: torch.Tensor, g: torch.Tensor, G: torch.Tensor) -> torch.Tensor:
    """``Σ_{c,n} Jᵀ G J`` ``(q, q)``: the transposed rearranged block times ``vec(G)``."""
    q = a.shape[-1]
    if g.shape[2] == 1:  # J = g aᵀ: Jᵀ G J = (gᵀ G g) a aᵀ
        a0, g0 = a[:, 0], g[:, :, 0]
        t = ((g0 @ G) * g0).sum((0, -1))  # (N,), summed over the columns
        return (a0 * t.unsqueeze(-1)).T @ a0
    out = a.new_zeros(q, q)
    for J in _per_sample_gradients(a, g):
        out += (G @ J).reshape(-1, q).T @ J.reshape(-1, q)
    return out


def _symmetric(M: torch.Tensor) -> torch.Tensor:
    return (M + M.T) / 2


class KFOCOperator(ModuleKroneckerOperator):
    """Kronecker-factored optimal curvature: per module, the ``G ⊗ A`` nearest the GGN block.

    ``KFOCOperator(model, dataloader, forward_fn, loss_of_output_fn, *, fisher_type="type2",
    param_filter=None, mc_samples=1, seed=0, curvature=None, num_batches=None, separate_bias=True,
    exclude_unsupported=False, precision="fp32", column_chunk=16, weight_sharing="sample",
    max_iter=10, tol=1e-4)``:
    the arguments and conventions of :class:`~hessian_eigenthings.operators.KFACOperator` (the
    family's record, :class:`~hessian_eigenthings.operators.factor_options.KroneckerOptions`)
    but ``kfac_approx`` (KFOC approximates the block itself), plus

    - ``weight_sharing``: ``"sample"`` (a sample's gradient sums the positions of a Conv2d or
      a Linear on ``(N, T, d)``: the exact block for a loss with one term per sample) or
      ``"position"`` (one outer product per position, as KFAC's ``"expand"``: the exact block
      when every position is its own loss term and the model does not mix positions);
    - ``max_iter``: most power iterations (two passes over the data each) per construction;
    - ``tol``: stop once every module's input-side factor, scaled to unit Frobenius norm,
      moved by less than ``tol`` in an iteration (``0``: run ``max_iter`` iterations).

    ``.iterations`` is the number of iterations run and ``.converged`` whether every module met
    ``tol``. The factors are computed at construction; build a new operator after the model
    changes. Factors that are not finite (NaN or inf in the data or the parameters) are refused
    at the first pass, naming the module; the backward count per batch is KFAC's (a
    ``FactorPassCostWarning`` for many), in each of the passes. ``op @ v``, ``op.inverse(damping)``, ``op.eigh()``, ``op.logdet()``,
    ``op.trace()``, ``op.frobenius_norm()`` and ``op.factors`` as for KFAC. Given ``ranks``
    (``DDPKFOCOperator``, ``FSDPKFOCOperator``) each pass's sums are summed over the ranks. The
    module docstring states the math.
    """

    _separate_bias_factor = True

    @with_options_signature
    def __init__(
        self,
        model: nn.Module,
        dataloader: Iterable[Batch],
        forward_fn: ForwardFn,
        loss_of_output_fn: LossOfOutputFn,
        *,
        weight_sharing: WeightSharing = "sample",
        max_iter: int = 10,
        tol: float = 1e-4,
        ranks: Ranks | None = None,
        **options: Unpack[KroneckerOptions],
    ) -> None:
        # a misspelt keyword names the class called and the close match (NOTE [Kronecker options])
        # (kfac_approx stays "expand", unread: the block's per-sample gradients sum over positions)
        record = factor_options(type(self), KFOCOperator, options)
        self.ranks = ranks or LOCAL
        if weight_sharing not in ("sample", "position"):
            raise ValueError(
                f"weight_sharing must be 'sample' or 'position', got {weight_sharing!r}"
            )
        self.weight_sharing: WeightSharing = weight_sharing
        self.max_iter: int = check_count("max_iter", max_iter)
        try:
            self.tol = float(tol)
        except (TypeError, ValueError):
            raise ValueError(f"tol must be a number >= 0, got {tol!r}") from None
        if not math.isfinite(self.tol) or self.tol < 0:
            raise ValueError(f"tol must be a finite number >= 0, got {tol!r}")
        #: power iterations run (each two passes over the data)
        self.iterations = 0
        #: whether every module's factors met ``tol`` within ``max_iter`` iterations
        self.converged = False
        factor_pass = FactorPass(
            type(self).__name__, model, dataloader, forward_fn, loss_of_output_fn, record
        )
        factor_pass.check_output = self._check_output
        self._start_pass(factor_pass)
        self._init_module_blocks(*self._compute_factors())

    def _sum_pass(
        self,
        contribution: Callable[[FactorModule, torch.Tensor, torch.Tensor], dict[str, torch.Tensor]],
        sides: dict[str, int],
    ) -> dict[str, torch.Tensor]:
        """``Σ_b |b|·Σ_batch contribution / Σ|b|`` over the data, by key (modules that never ran
        in the forward are missing: their blocks are zero). Given ranks, the sums and weights of
        every rank: each of the keys ``sides`` (``key: n`` of an ``(n, n)`` sum) is summed over
        the ranks, as zeros where this rank's batches never reached its module."""
        sums: dict[str, torch.Tensor] = {}

        def visit(module: FactorModule, a: torch.Tensor, g: torch.Tensor, size: float) -> None:
            for key, value in contribution(module, a, g).items():
                value = value.mul_(size)
                sums[key] = value if key not in sums else sums[key].add_(value)

        def run() -> tuple[dict[str, torch.Tensor], float]:
            total = self._pass.run(visit, None)
            if self.ranks.sums_factors:
                for key, n in sides.items():
                    if key not in sums:
                        sums[key] = self._zero_factor(n)
                values = [sums[key] for key in sides]
                total = self.ranks.sum_factors(values, total)  # every rank iterates on them
            return sums, total

        sums, total = self.ranks.factor_pass(run)
        return {key: _symmetric(value.div_(total)) for key, value in sums.items()}

    def _compute_factors(
        self,
    ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """``G`` and ``A`` of each module with a weight, and each separate bias's own ``G``."""
        modules = self._pass.modules
        shapes = {module.name: self._pass.matrix_shape(module) for module in modules}
        q_of = {
            module.name: shapes[module.name][1] + int(module.joint)
            for module in modules
            if module.weight is not None
        }
        separate = {
            module.name for module in modules if module.bias is not None and not module.joint
        }
        G_unit, A_unit, sigma, bias_G = self._power_iteration(q_of, separate)
        G_of: dict[str, torch.Tensor] = {}
        A_of: dict[str, torch.Tensor] = {}
        for name, q in q_of.items():
            root = math.sqrt(sigma[name])
            if root == 0.0:
                m = shapes[name][0]
                G_of[name], A_of[name] = self._zero_factor(m), self._zero_factor(q)
            else:
                G_of[name] = G_unit[name] * root
                A_of[name] = A_unit[name] * root
        for name in separate - bias_G.keys():  # the module never ran: a zero block
            m = shapes[name][0]
            bias_G[name] = self._zero_factor(m)
        return G_of, A_of, bias_G

    # NOTE [a pass per product]: each product with the rearranged block R needs every
    # per-sample gradient, so it is a pass over the data; keeping the output gradients of all
    # samples and columns instead (k·N·P·m numbers per module, k = classes for type-2) would make
    # the iterations free but does not scale with the dataset. The first pass starts from A = I,
    # so no pass is spent on an initial guess; a module that met tol stops contributing work.
    def _power_iteration(
        self, q_of: dict[str, int], separate: set[str]
    ) -> tuple[
        dict[str, torch.Tensor], dict[str, torch.Tensor], dict[str, float], dict[str, torch.Tensor]
    ]:
        """Unit ``G``, ``A`` and ``σ`` of each module with a weight, from ``A₀ = I`` (module
        docstring), and the exact ``G`` of each separate bias (from the first pass)."""

        def eye(n: int) -> torch.Tensor:
            return torch.eye(n, dtype=self.factor_dtype, device=self.device) / math.sqrt(n)

        A_unit = {name: eye(q) for name, q in q_of.items()}
        m_of = {module.name: self._pass.matrix_shape(module)[0] for module in self._pass.modules}
        order = list(m_of)
        G_unit: dict[str, torch.Tensor] = {}
        sigma = dict.fromkeys(q_of, 0.0)
        active = set(q_of)
        first = True
        bias_G: dict[str, torch.Tensor] = {}

        def left(module: FactorModule, a: torch.Tensor, g: torch.Tensor) -> dict[str, torch.Tensor]:
            a, g = self._terms(a, g)
            out = {}
            if module.name in active:
                out[module.name] = rearranged_product(a, g, A_unit[module.name])
            if first and module.name in separate:
                g_bar = g.sum(2).reshape(-1, g.shape[-1])  # the bias gradient sums positions
                out["bias:" + module.name] = g_bar.T @ g_bar
            return out

        def right(
            module: FactorModule, a: torch.Tensor, g: torch.Tensor
        ) -> dict[str, torch.Tensor]:
            if module.name not in active:
                return {}
            a, g = self._terms(a, g)
            return {module.name: rearranged_transpose_product(a, g, G_unit[module.name])}

        self.iterations = 0
        while first or (active and self.iterations < self.max_iter):
            # in the modules' order, the same on every rank (a set's order is not)
            sides = {name: m_of[name] for name in order if name in active}
            if first:
                sides.update({"bias:" + name: m_of[name] for name in order if name in separate})
            sums = self._sum_pass(left, sides)
            if first:
                bias_G = {k.removeprefix("bias:"): v for k, v in sums.items() if k[:5] == "bias:"}
                first = False
                # NOTE [factors not finite]: refused at the first pass, not after max_iter of them
                self._refuse_not_finite(
                    [
                        (
                            "G of the bias" if key[:5] == "bias:" else "G",
                            key.removeprefix("bias:"),
                            G,
                        )
                        for key, G in sums.items()
                    ]
                )
            if not active:  # only separate biases: their blocks are exact after one pass
                break
            for name in list(active):
                G = sums.get(name)
                norm = 0.0 if G is None else float(torch.linalg.matrix_norm(G))
                if not math.isfinite(norm):
                    raise self._not_finite("G", name)
                if (
                    G is None or norm == 0.0
                ):  # a zero block: the module never ran or got no gradient
                    sigma[name] = 0.0
                    active.discard(name)
                else:
                    G_unit[name] = G / norm
            if not active:
                break
            sums = self._sum_pass(right, {name: q_of[name] for name in order if name in active})
            self.iterations += 1
            for name in list(active):
                A = sums[name]
                # σ of the pair: ‖Rᵀ vec(G)‖ for a unit G, the optimal A for that G
                sigma[name] = float(torch.linalg.matrix_norm(A))
                if not math.isfinite(sigma[name]):
                    raise self._not_finite("A", name)
                if sigma[name] == 0.0:
                    active.discard(name)
                    continue
                new = A / sigma[name]
                change = float(torch.linalg.matrix_norm(new - A_unit[name]))
                A_unit[name] = new
                if change <= self.tol:
                    active.discard(name)
        self.converged = not active
        return G_unit, A_unit, sigma, bias_G

    def _terms(self, a: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``a (N, P, q)``, ``g (k, N, P, m)`` regrouped so that dimension 1 indexes the loss terms
        whose gradients the block sums outer products of (NOTE [weight sharing])."""
        if self.weight_sharing == "sample" or a.shape[1] == 1:
            return a, g
        k, N, P, m = g.shape
        return a.reshape(N * P, 1, -1), g.reshape(k, N * P, 1, m)

    def _check_output(self, output: torch.Tensor) -> None:
        # NOTE [weight sharing]: a column of the loss Hessian covers every loss term of the batch
        # at once, so the backward keeps samples apart (and positions, as the module sees them)
        # but adds up the terms of one sample. With one term per sample (logits (N, C), targets
        # (N, d)) a sample's gradient Σ_p g_p a_pᵀ is exact: "sample". With several (a sequence
        # model's (N, T, C)) that sum mixes the terms' gradients, and the exact block is only
        # reachable when position p of the module is term p alone (no mixing across positions):
        # "position", one outer product per position, KFAC's "expand" grouping.
        if self.weight_sharing == "sample" and output.dim() > 2:
            if isinstance(self.loss_of_output_fn, CrossEntropyOutputLoss):
                per_sample = output[0].numel() // output.shape[1]
            else:
                per_sample = output[0].numel() // output.shape[-1]
            if per_sample > 1:
                raise ValueError(
                    f"the model output {tuple(output.shape)} has {per_sample} loss terms per sample; "
                    "KFOC's weight_sharing='sample' needs one (e.g. logits (N, C)). Pass "
                    "weight_sharing='position' when each position of the layers is its own loss "
                    "term (a model that does not mix positions, such as a per-token MLP)"
                )

    def _repr_fields(self) -> str:
        return (
            f"fisher_type={self.fisher_type!r}, weight_sharing={self.weight_sharing!r}, "
            f"iterations={self.iterations}, converged={self.converged}"
        )
