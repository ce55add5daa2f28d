"""Kronecker-factored curvature: KFAC and eigenvalue-corrected KFAC (EKFAC).

For a module ``z = W a (+ b)`` (``nn.Linear``; ``nn.Conv2d`` on unfolded patches; HuggingFace's
``Conv1D``, ``z = a W + b`` with ``W`` stored ``(in, out)``, as a Linear of weight ``Wᵀ``)
the GGN block of ``W`` is ``Σ_c (Σ_p g_cp ⊗ a_p)(Σ_p g_cp ⊗ a_p)ᵀ`` summed over
the samples, where ``a_p`` is the module's input at weight-sharing position ``p``
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
  the model's predictive distribution (counter-based draws keyed by ``seed`` and the
  batch's position, ``loss_fns.output_curvature.draw_key``: the GGN's draws for one
  seed; the global random state is untouched);
- ``"empirical"``: ``√w ∇ℓ(f, y)`` at the observed targets.

Biases: ``separate_bias=True`` (default) gives a bias its own block ``G ⊗ [1]``;
``False`` appends a column of ones to the module's input, so weight and bias form
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
columns, one backward to the modules' outputs (no parameter gradients); then an
eigendecomposition per factor on first use of ``inverse``/``eigh``/``logdet``. A convolution's
input factor is computed without unfolding where that is cheaper (see
:mod:`~hessian_eigenthings.operators.conv_factors`: about a third of unfolding's multiply-adds for
a 3×3 convolution on a large map; on a GPU only on maps above 32×32, where the multiply-adds saved
outweigh the extra kernel launches).
A product costs two small matrix products per block and never reads the data.

Shape: the keywords are one record, :class:`~hessian_eigenthings.operators.factor_options.
KroneckerOptions` (NOTE [Kronecker options]); the pass over the data is
:mod:`~hessian_eigenthings.operators.factor_pass`; the block-diagonal algebra (products, ``eigh``, ``inverse``, ``logdet``, ``trace``) is
:class:`~hessian_eigenthings.operators.kronecker.KroneckerOperator`, which these operators are:
this module only turns the pass's inputs and output gradients into factors, module by module
(:class:`ModuleKroneckerOperator`).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn
from typing_extensions import Unpack

from hessian_eigenthings.batching import Batch
from hessian_eigenthings.loss_fns.protocols import ForwardFn, LossOfOutputFn
from hessian_eigenthings.operators.factor_options import (
    FisherType,
    KFACApprox,
    KroneckerOptions,
    factor_options,
    with_options_signature,
)
from hessian_eigenthings.operators.factor_owners import (
    ReplicatedOwnedBlocks,
    assign_owners,
    factor_numels,
    refuse_not_finite_by_module,
)
from hessian_eigenthings.operators.factor_pass import (
    FactorModule,
    FactorPass,
    Retry,
    input_moment,
    input_rows,
)
from hessian_eigenthings.operators.factor_sums import WeightedSum
from hessian_eigenthings.operators.kronecker import (
    KroneckerBlock,
    KroneckerEigen,
    KroneckerEigenBlock,
    KroneckerOperator,
)
from hessian_eigenthings.operators.kronecker_blocks import Eigen, factor_slot
from hessian_eigenthings.operators.kronecker_eigen import (
    NOT_FINITE_FIX,
    not_finite_message,
    refuse_not_finite,
)
from hessian_eigenthings.operators.ranks import LOCAL, Ranks

__all__ = [
    "EKFACOperator",
    "FisherType",
    "KFACApprox",
    "KFACOperator",
    "KroneckerBlock",
    "KroneckerEigen",
    "KroneckerEigenBlock",
    "KroneckerOptions",
    "LayerKroneckerOperator",
    "ModuleKroneckerOperator",
]


class ModuleKroneckerOperator(KroneckerOperator):
    """A :class:`KroneckerOperator` over a model's factor modules (its Linear, Conv2d and Conv1D
    modules) whose factors a :class:`~hessian_eigenthings.operators.factor_pass.FactorPass`
    collects (KFAC, EKFAC, KFOC): the pass's options as attributes, and each module's blocks
    from its factors."""

    excluded_parameters: tuple[str, ...]
    #: whether a separate bias keeps a ``G`` of its own (KFOC), for the factors' sizes
    _separate_bias_factor = False

    def _start_pass(self, factor_pass: FactorPass) -> None:
        self.ranks.start_factor_pass(factor_pass)  # its key by rank; sharded: agreed batches
        #: ``{module: rank}`` with ``factor_placement="by_module"`` (NOTE [Kronecker factors
        #: by module] in ``factor_owners``), else ``None``
        self._owners: dict[str, int] | None = None
        if self.ranks.factor_placement == "by_module":
            if self.ranks.module_blocks is not None:
                raise ValueError(
                    "these ranks already hold another operator's factors by module; build one "
                    "ranks object per operator"
                )
            sizes = factor_numels(factor_pass, self._separate_bias_factor)
            self._owners = assign_owners(sizes, self.ranks.world_size)
        self._pass = factor_pass
        self.model = factor_pass.model
        self.forward_fn = factor_pass.forward_fn
        self.loss_of_output_fn = factor_pass.loss_of_output_fn
        #: the options of the factor pass, checked (``factor_options.FactorOptions``)
        self.options = options = factor_pass.options
        self.fisher_type: FisherType = options.fisher_type
        self.mc_samples, self.seed = options.mc_samples, options.seed
        self.column_chunk, self.precision = options.column_chunk, options.precision
        self.separate_bias = options.separate_bias
        self.source = factor_pass.source
        self.guard = factor_pass.guard
        #: selected parameters left out with ``exclude_unsupported=True`` (name and module type)
        self.excluded_parameters = factor_pass.excluded
        self.named_params = factor_pass.named_params
        self.params = factor_pass.params
        self.layout = factor_pass.layout
        self._size, self._device, self._dtype = (
            self.layout.size,
            self.layout.device,
            self.layout.dtype,
        )
        self.factor_dtype = factor_pass.factor_dtype

    def _zero_factor(self, n: int) -> torch.Tensor:
        """An ``(n, n)`` factor of a zero block (a module that never ran in the forward)."""
        return torch.zeros(n, n, dtype=self.factor_dtype, device=self.device)

    def _init_module_blocks(
        self,
        G_of: dict[str, torch.Tensor],
        A_of: dict[str, torch.Tensor],
        bias_G_of: dict[str, torch.Tensor] | None = None,
    ) -> None:
        """The operator's blocks, each module's in the layout's order: weight and bias joined, or the weight's
        ``G ⊗ A`` and the bias's ``G ⊗ [1]`` (``bias_G_of``: a separate bias's own ``G``).

        NOTE [factors not finite]: NaN or inf in the data or the parameters reach the factors; a
        decomposition would then fail with torch's "ill-conditioned" error and products return
        NaN, so the factors are checked once here (one synchronization per construction) and
        refused naming the module."""
        named = []
        for module in self._pass.modules:  # in the forward's order: inputs, then outputs
            for which, held in (("A", A_of), ("G", G_of), ("G of the bias", bias_G_of or {})):
                if module.name in held:
                    named.append((which, module.name, held[module.name]))
        self._refuse_not_finite(named)
        blocks = []
        for module in self._pass.modules:
            name = module.name
            if not self._owns(name):  # another rank's module: its slots hold nothing
                if module.weight is not None:
                    bias = module.bias if module.joint else None
                    blocks.append(
                        factor_slot(
                            self.layout, module.weight, bias, name, None, None, module.transposed
                        )
                    )
                if module.bias is not None and not module.joint:
                    blocks.append(factor_slot(self.layout, None, module.bias, name, None, None))
                continue
            if module.weight is not None:
                bias = module.bias if module.joint else None
                G, A = G_of[name], A_of[name]
                blocks.append(
                    factor_slot(self.layout, module.weight, bias, name, G, A, module.transposed)
                )
            if module.bias is not None and not module.joint:
                own = G_of[name] if bias_G_of is None else bias_G_of[name]
                blocks.append(factor_slot(self.layout, None, module.bias, name, own, None))
        self._init_blocks(self.layout, blocks, factor_dtype=self.factor_dtype)
        self._place_factors()

    def _owns(self, module: str) -> bool:
        """Whether this rank holds ``module``'s factors (every one unless placed by module)."""
        return self._owners is None or self._owners[module] == self.ranks.rank

    def _place_factors(self) -> None:
        """With factors by module, the blocks module by module, each on its owner (NOTE
        [Kronecker factors by module])."""
        if self._owners is not None:
            self.ranks.module_blocks = ReplicatedOwnedBlocks(
                self,
                self._owners,
                self.ranks.agreement,  # type: ignore[attr-defined]
            )

    def _refuse_not_finite(self, factors: list[tuple[str, str, torch.Tensor]]) -> None:
        """:func:`refuse_not_finite` of ``(factor, module, tensor)``, naming the parameters that
        hold NaN or inf, if any (NOTE [factors not finite]); by module, each rank checks the
        factors it owns and every rank raises."""
        try:
            if self._owners is not None:
                refuse_not_finite_by_module(
                    type(self).__name__,
                    [(w, m, t if self._owns(m) else None) for w, m, t in factors],
                    self.ranks.agreement,  # type: ignore[attr-defined]
                )
            else:
                refuse_not_finite(type(self).__name__, factors)
        except ValueError as exc:
            raise ValueError(self._diagnosed(str(exc))) from None

    def _not_finite(self, factor: str, module: str) -> ValueError:
        """The error for one factor found not finite (its norm is NaN or inf)."""
        return ValueError(
            self._diagnosed(not_finite_message(type(self).__name__, factor, module, ()))
        )

    def _diagnosed(self, message: str) -> str:
        """``message`` with its fix made precise: the model's parameters holding NaN or inf, or
        the data (a synchronization per parameter: on the way to an error only)."""
        bad = []
        for name, p in self.model.named_parameters():
            local = p.to_local() if hasattr(p, "to_local") else p  # an FSDP shard: this rank's
            if not bool(local.detach().isfinite().all()):
                bad.append(repr(name))
        if bad:
            shown = ", ".join(bad[:3]) + (f" and {len(bad) - 3} more" if len(bad) > 3 else "")
            fix = f"the model's parameter{'s' * (len(bad) > 1)} {shown} hold{'s' * (len(bad) == 1)} NaN/inf"
        else:
            fix = "the model's parameters are finite, so check the data for NaN/inf"
        return message.replace(NOT_FINITE_FIX, fix)

    def _repr_fields(self) -> str:
        return f"fisher_type={self.fisher_type!r}"

    def __repr__(self) -> str:
        extra = f", excluded={list(self.excluded_parameters)}" if self.excluded_parameters else ""
        return (
            f"{type(self).__name__}(size={self.size}, blocks={self.num_blocks}, {self._repr_fields()}, "
            f"dtype={self.dtype}{extra})"
        )


#: the old name of :class:`ModuleKroneckerOperator`, kept importable
LayerKroneckerOperator = ModuleKroneckerOperator


class _KFACFactors(ModuleKroneckerOperator):
    """KFAC's factors from one pass (the constructor KFAC and EKFAC share)."""

    @with_options_signature
    def __init__(
        self,
        model: nn.Module,
        dataloader: Iterable[Batch],
        forward_fn: ForwardFn,
        loss_of_output_fn: LossOfOutputFn,
        *,
        kfac_approx: KFACApprox = "expand",
        ranks: Ranks | None = None,
        **options: Unpack[KroneckerOptions],
    ) -> None:
        # a misspelt keyword names the class called and the close match (NOTE [Kronecker options])
        record = factor_options(type(self), _KFACFactors, options, kfac_approx)
        self.ranks = ranks or LOCAL
        factor_pass = FactorPass(
            type(self).__name__, model, dataloader, forward_fn, loss_of_output_fn, record
        )
        self._start_pass(factor_pass)
        self.kfac_approx: KFACApprox = kfac_approx
        G_of, A_of = self.ranks.factor_pass(self._kfac_factors)
        self._init_module_blocks(G_of, A_of)
        self._after_factors()

    def _after_factors(self) -> None:
        """What a subclass computes once the factors are known (EKFAC: its second pass)."""

    def _repr_fields(self) -> str:
        return f"fisher_type={self.fisher_type!r}, kfac_approx={self.kfac_approx!r}"

    def _kfac_factors(self) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """``G`` and ``A`` of every module (zero for a module that never ran: its block is zero)."""
        sums_A: dict[str, WeightedSum] = {}
        sums_G: dict[str, WeightedSum] = {}
        reduce = self.kfac_approx == "reduce"

        def on_input(module: FactorModule, x: torch.Tensor, size: float) -> None:
            if module.weight is None:
                return
            flat = input_rows(module, x, self.factor_dtype, reduce)
            if flat is not None:  # the batch's mean over rows, weighted by its size
                sums_A.setdefault(module.name, WeightedSum()).addgram(flat, size / flat.shape[0])
                return
            S, rows = input_moment(module, x, self.factor_dtype, reduce)
            sums_A.setdefault(module.name, WeightedSum()).add(S, size / rows)

        def visit(module: FactorModule, _a: torch.Tensor, g: torch.Tensor, size: float) -> None:
            g = g.sum(2, keepdim=True) if reduce else g
            flat = g.reshape(-1, g.shape[-1])
            sums_G.setdefault(module.name, WeightedSum()).addgram(flat, size)

        try:
            total = self._pass.run(visit, on_input)
        except Retry:  # the first forward found outputs changed in place: start again, copying them
            sums_A.clear()
            sums_G.clear()
            total = self._pass.run(visit, on_input)
        G_of: dict[str, WeightedSum | torch.Tensor] = {}
        A_of: dict[str, WeightedSum | torch.Tensor] = {}
        for module in self._pass.modules:
            name = module.name
            if name in sums_G:  # a module that ran has both (A only with a weight)
                G_of[name] = sums_G[name]
                if name in sums_A:
                    A_of[name] = sums_A[name]
            else:  # it never ran in the forward: its GGN block is zero
                m, q = self._pass.matrix_shape(module)
                G_of[name] = self._zero_factor(m)
                if module.weight is not None:
                    A_of[name] = self._zero_factor(q + int(module.joint))
        if self._owners is not None:  # each module's sums onto its owner
            self._sum_owners = [self._owners[n] for n in (*G_of, *A_of)]
        means = iter(self._means([*G_of.values(), *A_of.values()], total))
        return {n: next(means) for n in G_of}, {n: next(means) for n in A_of}

    #: the rank each sum of the running pass is reduced onto (factors by module), else ``None``
    _sum_owners: list[int] | None = None

    def _means(self, sums: list[WeightedSum | torch.Tensor], total: float) -> list[torch.Tensor]:
        """Each weighted sum over the batches divided by the total weight (a plain tensor: a sum
        of zeros). One process: one scaling per sum, none with one batch (NOTE [factor weights
        applied late]); data parallel: the sums are summed over the processes first (by module:
        onto their owners, ``_sum_owners``; the other ranks' copies are left to be dropped)."""
        if not self.ranks.sums_factors and total > 0:
            return [s.mean(total) if isinstance(s, WeightedSum) else s for s in sums]
        values = [s.mean(1.0) if isinstance(s, WeightedSum) else s for s in sums]
        owners, self._sum_owners = self._sum_owners, None
        total = self.ranks.sum_factors(values, total, owners)
        return [v.div_(total) for v in values]


class KFACOperator(_KFACFactors):
    """Kronecker-factored approximate curvature (KFAC) of the GGN / Fisher of a mean loss.

    ``KFACOperator(model, dataloader, forward_fn, loss_of_output_fn, *, fisher_type="type2",
    kfac_approx="expand", param_filter=None, mc_samples=1, seed=0, curvature=None, num_batches=None,
    separate_bias=True, exclude_unsupported=False, precision="fp32", column_chunk=16)`` (the
    keywords but ``kfac_approx`` are the family's record,
    :class:`~hessian_eigenthings.operators.factor_options.KroneckerOptions`); the calling conventions
    of :class:`~hessian_eigenthings.operators.GGNOperator` (``forward_fn(model, batch) ->
    output``, ``loss_of_output_fn(output, batch) -> mean loss``).

    - ``fisher_type``: ``"type2"`` (exact loss-Hessian square root: KFAC of the GGN),
      ``"mc"`` (``mc_samples`` sampled targets per sample, seeded; the global random state is
      untouched; the same draws as ``GGNOperator(mc_samples=k, seed=seed)``), ``"empirical"``
      (gradients at the observed targets). ``curvature``: any output-curvature strategy with
      columns (``loss_fns.output_curvature``), in place of ``fisher_type``.
    - ``kfac_approx``: ``"expand"`` or ``"reduce"`` for modules with weight sharing (Conv2d,
      Linear on ``(N, T, d)``); the same thing without sharing.
    - ``separate_bias``: a bias in its own block ``G ⊗ [1]`` (default) or joined to its weight
      through a column of ones (one block ``G ⊗ Ã``).
    - ``column_chunk``: most loss-Hessian columns (type-2: one per class; mc: ``mc_samples``)
      backpropagated together in one batched backward (memory: that many activation gradients).
      Type-2 thus costs ``ceil(classes / column_chunk)`` backwards per batch: 3,142 for GPT-2's
      50,257 words. Above :data:`~hessian_eigenthings.operators.factor_pass.BACKWARDS_WARNING`
      (64) a :class:`~hessian_eigenthings._warnings.FactorPassCostWarning` says so when the first
      batch is seen; ``fisher_type="mc"`` (one sampled label per output, as Kronfluence does) or
      ``"empirical"`` is one backward per batch (NOTE [type-2 on a large vocabulary]).
    - Selected parameters outside ``nn.Linear``/``nn.Conv2d``/``transformers``' ``Conv1D`` raise a ``ValueError`` naming
      them; ``exclude_unsupported=True`` leaves them out (``.excluded_parameters``).

    The factors are computed once, at construction (one pass over ``dataloader``); build a new
    operator after the model changes. Factors that are not finite (NaN or inf in the data or
    the parameters) are refused there, naming the module and any parameter holding NaN/inf. The
    operator holds its factors (``op.factors`` hands out the tensors themselves); a change to
    them in place is followed by products and by the cached decompositions alike (NOTE
    [factors changed in place] in ``kronecker.py``). ``op @ v``, ``op.matmat``, ``op.inverse(damping)``,
    ``op.eigh()``, ``op.eigenvector(block, i, j)``, ``op.logdet()``, ``op.trace()``,
    ``op.frobenius_norm()`` (those of :class:`~hessian_eigenthings.operators.KroneckerOperator`);
    ``op.factors`` holds the blocks. The module docstring states the conventions.
    """


class EKFACOperator(_KFACFactors):
    """Eigenvalue-corrected KFAC (George et al. 2018): KFAC's eigenbases, with the eigenvalues
    re-estimated as the second moments of the per-sample gradients in that basis.

    Same arguments as :class:`KFACOperator`. The corrected eigenvalues
    ``Σ_{c,n} (U_Gᵀ (Σ_p g_cnp a_npᵀ) U_A)²`` (weighted by batch size) are per-sample: the
    gradient of a sample sums over its weight-sharing positions, whatever ``kfac_approx`` (which
    chooses the factors whose eigenbases are used). NOTE [EKFAC per sample]: a per-position
    moment would not be the second moment of any gradient; per sample, the corrected eigenvalues
    are exactly the diagonal of the GGN block in KFAC's eigenbasis (and EKFAC equals KFAC where
    KFAC is exact). For an output with several rows per sample (a sequence's positions) the
    type-2 columns of that pass are split row by row, one per class and row, so that no term
    joins two rows of a sample (NOTE [columns row by row] in ``loss_fns.output_curvature``):
    ``T`` times the first pass's backwards for ``T`` rows; Monte-Carlo draws and the empirical
    Fisher need no split. With ``fisher_type="mc"`` the second pass draws its labels afresh from
    the same seed (NOTE [fresh draws] in ``operators.factor_pass``): given KFAC's eigenbasis, an
    unbiased estimate of the Fisher's diagonal there. Costs a second pass over the data.
    ``factors`` are KFAC's; the operator's blocks are in their eigenbases with the corrected
    eigenvalues, fixed at construction: a change in place to ``factors`` does not change the
    operator (its eigenbases were taken from them then), a change to ``corrected_eigenvalues`` or to ``eigh()``'s eigenvectors (the
    tensors themselves) is followed by every method.
    """

    def _after_factors(self) -> None:
        self._kfac_blocks = self._factor_blocks = self._blocks
        owners = self._by_module()
        if owners is None:
            bases = self._eigen()
        else:  # every block's eigenbasis on every rank for the pass (NOTE [Kronecker factors by module])
            bases = owners.shared_bases()  # type: ignore[attr-defined]
            self._sum_owners = [self._owners[b.module] for b in self._blocks]  # type: ignore[index]
        scalings = self.ranks.factor_pass(lambda: self._compute_scalings(bases))
        self._init_blocks(
            self.layout,
            [
                factor_slot(
                    self.layout,
                    b.weight,
                    b.bias,
                    b.module,
                    None,
                    None,
                    b.transposed,
                    (D, U_G, U_A) if self._owns(b.module) else None,
                )
                for b, D, (_, U_G, U_A) in zip(self._kfac_blocks, scalings, bases, strict=True)
            ],
            factor_dtype=self.factor_dtype,
        )
        if owners is not None:
            self.ranks.module_blocks = None
            self._place_factors()

    @property
    def factors(self) -> tuple[KroneckerBlock, ...]:
        """KFAC's blocks ``G ⊗ A`` (whose eigenbases EKFAC keeps)."""
        self._refuse_by_module("factors", "op.owned_factors gives this rank's modules' blocks")
        return self._public_factors(self._factor_slots())

    def release_factors(self) -> None:
        """Free KFAC's ``G`` and ``A``: after construction the operator uses only their
        eigenbases and the corrected eigenvalues, so products, ``eigh()``, ``inverse()``,
        ``trace()`` and the rest are unchanged; ``factors`` and ``owned_factors`` are refused
        after it. Saves ``Σ m² + q²`` numbers (1.3 GB for GPT-2's 48 block layers in float32).
        :func:`hessian_eigenthings.influence.fit` calls it (NOTE [EK-FAC keeps its
        eigenbases only] there). Idempotent."""
        self._factors_released = (
            "KFAC's factors were released by release_factors() (the operator keeps only its "
            "eigenbases and corrected eigenvalues); eigh() gives those, or build the operator "
            "again to read the factors"
        )
        self._kfac_blocks = self._factor_blocks = []

    def _compute_scalings(self, bases: list[Eigen]) -> list[torch.Tensor]:
        sums = [WeightedSum() for _ in self._blocks]
        by_module: dict[str, list[int]] = {}
        for i, b in enumerate(self._blocks):
            by_module.setdefault(b.module, []).append(i)

        def visit(module: FactorModule, a: torch.Tensor, g: torch.Tensor, size: float) -> None:
            # g: (k, N, P, m); a: (N, P, q)
            for i in by_module[module.name]:
                _, U_G, U_A = bases[i]
                g_rot = g @ U_G  # (k, N, P, m)
                if self._blocks[i].weight is None:  # a bias alone
                    value = g_rot.sum(2).square().sum((0, 1)).unsqueeze(-1)  # (m, 1)
                else:
                    a_rot = a @ U_A  # (N, P, q)
                    value = self._rotated_moment(g_rot, a_rot)
                sums[i].add(value, size)

        # per-sample moments: the columns row by row (NOTE [columns row by row]); labels drawn
        # again (NOTE [fresh draws] in factor_pass)
        total = self._pass.run(visit, None, per_row=True, fresh_draws=True)
        # a block whose module never ran is zero (its KFAC block is)
        return self._means(
            [
                s if s.value is not None else b_D.new_zeros(b_D.shape)
                for s, (b_D, _, _) in zip(sums, bases, strict=True)
            ],
            total,
        )

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

    @property
    def corrected_eigenvalues(self) -> tuple[torch.Tensor, ...]:
        """Per block ``(m, q)``: the eigenvalues replacing ``λ_G λ_Aᵀ`` (refused with
        ``factor_placement="by_module"``: ``eigenvalues(by_block=True)`` gathers them)."""
        self._refuse_by_module(
            "corrected_eigenvalues",
            "op.eigenvalues(by_block=True) gathers every block's onto every rank",
        )
        return tuple(b.eigen[0] for b in self._blocks)  # type: ignore[index]
