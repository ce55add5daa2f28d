"""Generalized Gauss-Newton matrix of the mean loss, ``G = Jᵀ H_L J``.

Split the loss at the model output ``f = forward_fn(model, batch)``:
``L(θ) = ℓ(f(θ))`` with ``J = ∂f/∂θ`` (output Jacobian) and
``H_L = ∇²_f ℓ`` (loss Hessian at the output). The GGN drops the term of the
Hessian that carries second derivatives of the model, so it is positive
semi-definite whenever ``ℓ`` is convex in the output (cross-entropy, MSE).
Over several batches it is weighted by batch size like every operator.

One product ``G v`` per batch:

1. ``J v``: forward-mode AD through the model (see NOTE [GGN Jacobian-vector products]);
2. ``u = H_L (J v)``: in closed form when ``loss_of_output_fn`` implements
   :class:`~hessian_eigenthings.loss_fns.protocols.OutputHessianLoss`
   (cross-entropy through :func:`hessian_eigenthings.kernels.cross_entropy_hvp`),
   else by a double backward through the loss only (``loss_hvp="autograd"``),
   never through the model;
3. ``Jᵀ u``: one backward through the output's graph.

For HuggingFace causal LMs the head and the loss are applied chunk by chunk
without forming the logits (NOTE [chunked LM head] in ``lm_head``).

Cost per product and batch: one forward pass (kept across products with graph
reuse, see NOTE [graph reuse] in ``graph_reuse``), one forward-mode pass, one
backward pass; a block of k vectors goes through steps 1 and 3 batched. No
double backward through the model: kernels without one (flash attention,
fused ops) are fine.

:class:`~hessian_eigenthings.operators.sandwich.OutputSandwichOperator` holds
the machinery; the empirical Fisher is its sibling, with the per-sample
losses as the "output".
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Literal

import torch
from torch import nn
from typing_extensions import Unpack

from hessian_eigenthings._checks import check_count
from hessian_eigenthings.batching import Batch
from hessian_eigenthings.loss_fns.checks import check_first_batch, check_loss_argument
from hessian_eigenthings.loss_fns.output_curvature import (
    AutogradLossHessian,
    ExactLossHessian,
    MonteCarlo,
    OutputCurvature,
)
from hessian_eigenthings.loss_fns.protocols import (
    ForwardFn,
    LossOfOutputFn,
    OutputHessianLoss,
    SampledFisherLoss,
)
from hessian_eigenthings.operators.lm_head import chunked_head
from hessian_eigenthings.operators.sandwich import (
    OutputSandwichOperator,
    OutputState,
    SandwichOptions,
)


class GGNOperator(OutputSandwichOperator):
    """Generalized Gauss-Newton ``Jᵀ H_L J`` of ``loss_of_output_fn(forward_fn(model, batch), batch)``,
    averaged over the data (weighted by batch size).

    ``GGNOperator(model, dataloader, forward_fn, loss_of_output_fn, *,
    param_filter=None, full_dataset=True, num_batches=None,
    loss_hvp="analytical", fd_eps=None, backend=None)`` plus the
    microbatch, block, graph-reuse and engine options of
    :class:`~hessian_eigenthings.operators.base.DataCurvatureOperator`; those, ``jvp`` and
    ``fd_eps`` travel as one record (``**options``,
    :class:`~hessian_eigenthings.operators.sandwich.SandwichOptions`).

    - ``forward_fn(model, batch) -> output`` (a tensor, e.g. logits) and
      ``loss_of_output_fn(output, batch) -> scalar`` mean loss of the batch;
      helpers in :mod:`hessian_eigenthings.loss_fns`.
    - ``loss_hvp="analytical"``: ``loss_of_output_fn`` must implement
      :class:`~hessian_eigenthings.loss_fns.protocols.OutputHessianLoss`
      (``.hvp``), applied in closed form. ``"autograd"``: any loss, its
      output Hessian by a double backward through the loss only.
    - ``jvp``: ``"auto"`` (forward mode, finite differences if the model's
      ops lack forward-mode formulas), ``"forward_mode"`` or
      ``"finite_difference"``; ``fd_eps`` is the step of the latter (default
      by dtype). See NOTE [GGN Jacobian-vector products].
    - ``chunked_lm_head``: ``"auto"`` applies the LM head and the loss chunk
      by chunk (``lm_head_chunk_rows`` rows at a time, default sized to
      ~256 MiB) for HuggingFace causal LMs with a plain linear head, see
      NOTE [chunked LM head]; ``True`` insists, ``False`` never does.
      ``lm_head`` is the head module when the chunked path is in use.
    - ``mc_samples``: 0 (default) the exact GGN; ``k > 0`` the Monte-Carlo Fisher: the loss
      Hessian replaced by the mean of ``g gᵀ`` over k targets per sample drawn from the
      model's predictive distribution (``g`` the loss gradient at the output), for losses
      implementing :class:`~hessian_eigenthings.loss_fns.protocols.SampledFisherLoss`
      (cross-entropy, MSE as a Gaussian with variance 1/2, BCE with logits). Draws are keyed
      by ``seed`` and the chunk's position in a pass: one fixed matrix per operator, the global
      random state untouched, the same targets as ``KFACOperator(fisher_type="mc", seed=seed)``.
    - ``curvature``: the output curvature as a strategy of
      :mod:`hessian_eigenthings.loss_fns.output_curvature` (``ExactLossHessian``,
      ``AutogradLossHessian``, ``MonteCarlo``, ``Empirical`` or your own), in place of
      ``loss_hvp`` and ``mc_samples`` (which spell the first three).
    """

    def __init__(
        self,
        model: nn.Module,
        dataloader: Iterable[Batch],
        forward_fn: ForwardFn,
        loss_of_output_fn: LossOfOutputFn | OutputHessianLoss,
        *,
        loss_hvp: Literal["analytical", "autograd"] = "analytical",
        chunked_lm_head: bool | Literal["auto"] = "auto",
        lm_head_chunk_rows: int | None = None,
        mc_samples: int = 0,
        seed: int = 0,
        curvature: OutputCurvature | None = None,
        **options: Unpack[SandwichOptions],
    ) -> None:
        check_ggn(forward_fn, loss_of_output_fn, loss_hvp, chunked_lm_head)
        self.mc_samples: int = check_count("mc_samples", mc_samples, minimum=0)
        curvature = ggn_curvature(loss_of_output_fn, loss_hvp, self.mc_samples, curvature)
        self.loss_of_output_fn = loss_of_output_fn
        # the sampled outer products replace the loss Hessian
        self.loss_hvp = "analytical" if self.mc_samples else loss_hvp
        self.chunked_lm_head = chunked_lm_head
        self.lm_head_chunk_rows = lm_head_chunk_rows
        super().__init__(model, dataloader, forward_fn, curvature=curvature, seed=seed, **options)
        check_first_batch(model, self.source.first_batch(), forward_fn, loss_of_output_fn)
        #: the chunked LM head (NOTE [chunked LM head] in ``lm_head``); None: the generic path
        self._head = chunked_head(
            model,
            forward_fn,
            loss_of_output_fn,
            chunked_lm_head,
            lm_head_chunk_rows,
            exact=type(self.curvature) is ExactLossHessian,
            engine=self._engine_name,
        )
        if self._head is not None:
            self._set_forward(self._head.forward_fn.hidden_states)

    @property
    def lm_head(self) -> nn.Linear | None:
        """The head module when the chunked path is in use (NOTE [chunked LM head])."""
        return None if self._head is None else self._head.head

    def _prepare(self, batch: Batch) -> OutputState:
        state = super()._prepare(batch)  # with the chunked head: the last hidden states (B, T, d)
        head = self._head
        if head is None:
            return state
        if not head.checked and not head.matches(self.model, batch, state.output):
            self._head = None
            self._set_forward(head.forward_fn)  # the logits' forward again
            return super()._prepare(batch)
        state.curvature = head.prepare(state.batch)
        return state

    def _apply(
        self, state: OutputState, vecs: list[torch.Tensor], retain: bool
    ) -> Sequence[torch.Tensor | None]:
        if self._head is None:
            return super()._apply(state, vecs, retain)
        return self._head.apply(state, vecs, retain, self._at(), jvp=self._jvp, vjp=self._vjp)


def check_ggn(
    forward_fn: ForwardFn,
    loss_of_output_fn: LossOfOutputFn | OutputHessianLoss,
    loss_hvp: str,
    chunked_lm_head: object,
) -> None:
    """Refuse the GGN's own arguments that are not what they must be."""
    if chunked_lm_head not in (True, False, "auto"):
        raise ValueError(f"chunked_lm_head must be True, False or 'auto', got {chunked_lm_head!r}")
    if not callable(loss_of_output_fn):
        raise TypeError(
            "loss_of_output_fn must be callable as loss_of_output_fn(output, batch) -> scalar"
        )
    check_loss_argument(
        loss_of_output_fn, name="loss_of_output_fn", wrap="supervised_loss_of_output"
    )
    check_loss_argument(
        forward_fn, name="forward_fn", wrap="supervised_forward and supervised_loss_of_output"
    )
    if loss_hvp not in ("analytical", "autograd"):
        raise ValueError(f"loss_hvp must be 'analytical' or 'autograd', got {loss_hvp!r}")


def ggn_curvature(
    loss: LossOfOutputFn | OutputHessianLoss,
    loss_hvp: str,
    mc_samples: int,
    curvature: OutputCurvature | None = None,
) -> OutputCurvature:
    """The output curvature that ``loss_hvp=`` and ``mc_samples=`` spell, or ``curvature=``
    (which replaces them)."""
    if curvature is not None:
        if mc_samples or loss_hvp != "analytical":
            raise ValueError("curvature= replaces loss_hvp= and mc_samples=; pass one or the other")
        return curvature
    if mc_samples:
        if not isinstance(loss, SampledFisherLoss):
            raise ValueError(
                f"mc_samples={mc_samples} samples targets from the model's predictive distribution; "
                f"{loss!r} cannot (no .sample_grads, see loss_fns.SampledFisherLoss). Use "
                "supervised_loss_of_output(...) of nn.CrossEntropyLoss(), nn.MSELoss() or nn.BCEWithLogitsLoss(), "
                "or mc_samples=0 for the exact GGN"
            )
        return MonteCarlo(loss, mc_samples)
    if loss_hvp == "autograd":
        return AutogradLossHessian(loss)
    if not isinstance(loss, OutputHessianLoss):
        raise ValueError(
            f"loss_hvp='analytical' needs a loss with a closed-form output Hessian (an .hvp(output, "
            f"batch, u) method, see loss_fns.OutputHessianLoss); {loss!r} has none. Pass "
            "loss_hvp='autograd' to differentiate it twice, or use a closed-form helper such as "
            "loss_fns.supervised_loss_of_output(nn.CrossEntropyLoss()) or hf_lm_loss_of_output()"
        )
    return ExactLossHessian(loss)


#: the 1.0 alpha's name for the ``loss_hvp`` values
LossHvpMethod = Literal["analytical", "autograd"]


# NOTE [sampled targets as data]
# The traced engines trace a product once per batch signature and replay it for every chunk,
# so a draw made inside the trace with a generator would be baked in (or untraceable). The
# Monte-Carlo Fisher's draws are instead a pure function of a key: counter-based random
# numbers (loss_fns.counter_rng: splitmix64 of key and position, in int64 tensor arithmetic)
# turned into targets by inverse CDF (cross-entropy), comparison (BCE) or Box-Muller (MSE).
# One draw per chunk of a pass, so every product of the operator uses the same draws (a fixed
# matrix, kept state or not) and nothing reads or moves the global random state. The key of a
# chunk is `loss_fns.output_curvature.draw_key(seed, position, rank)`, the one derivation that
# KFAC's factor pass uses too (one seed, one set of targets). It is handed to the traced product
# as an input beside the batch (`_engine_batch` in `sandwich`), one tensor object per chunk position so that a
# program traced for one batch serves it again; the draws depend only on primal values, so
# the tangent split keeps the sampled gradients with the kept state and products run the
# tangent work only. The autograd engine draws with the same function and key: every engine
# computes the same matrix (up to a target whose uniform falls within rounding of a CDF step).
# Losses with only a generator-based `sample_grads` stay on the autograd engine.
