"""The shapes of loss callables, and the protocol of losses with a closed-form output Hessian.

Three kinds of callables meet the operators:

- ``LossFn``: ``loss_fn(model, batch) -> scalar``, the mean loss of a batch
  (:class:`~hessian_eigenthings.operators.HessianOperator`).
- ``ForwardFn`` and ``LossOfOutputFn``: the same loss split at the model
  output, ``loss_of_output(forward_fn(model, batch), batch)``
  (:class:`~hessian_eigenthings.operators.GGNOperator`).
- ``PerSampleLossFn``: ``per_sample_loss_fn(model, batch) -> (N,)``, one
  loss per sample, not divided by ``N``
  (:class:`~hessian_eigenthings.operators.EmpiricalFisherOperator`).
  A per-sample loss whose samples are not the batch's rows (tokens of a
  language model) implements :class:`CountedPerSampleLoss`: it says how many
  samples a batch holds.

A loss of the output that knows its Hessian with respect to the output
implements :class:`OutputHessianLoss`; the GGN then applies that Hessian in
closed form instead of differentiating the loss twice.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, runtime_checkable

import torch
from torch import nn

from hessian_eigenthings.batching import Batch

LossFn = Callable[[nn.Module, Batch], torch.Tensor]
ForwardFn = Callable[[nn.Module, Batch], torch.Tensor]
LossOfOutputFn = Callable[[torch.Tensor, Batch], torch.Tensor]
PerSampleLossFn = Callable[[nn.Module, Batch], torch.Tensor]


@runtime_checkable
class CountedPerSampleLoss(Protocol):
    """Per-sample losses whose samples are not the rows of the batch (e.g. tokens).

    ``loss(model, batch)`` returns the losses in any shape (flattened by the
    operator); an entry that is not a sample must be exactly 0 and must not
    depend on the parameters (a masked position), so it adds nothing to
    ``Σ gᵢgᵢᵀ``. ``loss.sample_count(batch)`` is the number of samples
    ``N`` in the batch (an int or a 0-dim integer tensor): the mean divides by
    it, and batches are weighted by it. Each sample weighs the same.
    """

    def __call__(self, model: nn.Module, batch: Batch) -> torch.Tensor: ...

    def sample_count(self, batch: Batch) -> torch.Tensor | int: ...


@runtime_checkable
class OutputHessianLoss(Protocol):
    """A loss of the model output with a closed-form output-Hessian product.

    ``loss(output, batch)`` is the scalar mean loss of the batch.
    ``loss.hvp(output, batch, u)`` returns ``∇²_output loss · u`` for a block
    ``u`` of shape ``(k, *output.shape)`` (k directions at once), in the
    shape of ``u``. It must be exact and must not build an autograd graph.
    """

    def __call__(self, output: torch.Tensor, batch: Batch) -> torch.Tensor: ...

    def hvp(self, output: torch.Tensor, batch: Batch, u: torch.Tensor) -> torch.Tensor: ...


@runtime_checkable
class HiddenStatesForward(Protocol):
    """A forward whose output is the logits of a linear head (the model's
    ``get_output_embeddings()``) and that can return the head's input instead.

    ``forward(model, batch)`` returns the logits; ``forward.hidden_states(model,
    batch)`` the last hidden states the head maps to them, ``(..., d)``.
    """

    def __call__(self, model: nn.Module, batch: Batch) -> torch.Tensor: ...

    def hidden_states(self, model: nn.Module, batch: Batch) -> torch.Tensor: ...


@runtime_checkable
class LinearHeadLoss(Protocol):
    """A loss of a linear head's logits that applies its GGN through the head from the
    head's input, chunk by chunk, without forming the logits.

    ``loss.head_targets(batch)`` returns what the loss counts (``valid``, its
    own layout) and the count ``n`` (the mean's denominator);
    ``loss.head_ggn(h, W, b, dh, dW, db, valid, n, chunk_rows=...)`` takes the
    hidden states ``h`` ``(..., d)``, the head's weight ``W`` ``(V, d)`` and
    bias ``b``, and for a block of k directions the tangents ``dh`` ``(k, ...,
    d)`` of the hidden states and ``dW`` / ``db`` of the head (``None``: not
    selected); it returns the pull-backs ``(g_h, g_W, g_b)`` of ``H_L`` times
    the logits' tangent, in the shapes of ``dh``, ``dW``, ``db``. Exact, no
    autograd graph.
    """

    def __call__(self, output: torch.Tensor, batch: Batch) -> torch.Tensor: ...

    def head_targets(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]: ...

    def head_ggn(
        self,
        h: torch.Tensor,
        W: torch.Tensor,
        b: torch.Tensor | None,
        dh: torch.Tensor,
        dW: torch.Tensor | None,
        db: torch.Tensor | None,
        valid: torch.Tensor,
        n: torch.Tensor,
        *,
        chunk_rows: int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]: ...


@runtime_checkable
class SampledFisherLoss(Protocol):
    """A loss that is the negative log-likelihood of a distribution the output parametrises,
    for the Monte-Carlo Fisher (``GGNOperator(..., mc_samples=k)``).

    ``loss.sample_grads(output, batch, k, generator)`` draws k targets per sample from the
    model's predictive distribution (with ``generator``, no global random state) and returns
    the gradients of the per-sample negative log-likelihoods at them, ``(k, *output.shape)``
    (no graph). ``loss.sampled_hvp(output, batch, grads, u)`` applies
    ``H̃ = w · mean_s g_s g_sᵀ`` (per sample, ``w`` the loss's reduction weight) to a block
    ``u`` of shape ``(m, *output.shape)``: in expectation the loss's output Hessian, whose
    expectation over the targets is the Fisher.
    """

    def sample_grads(
        self, output: torch.Tensor, batch: Batch, k: int, generator: torch.Generator
    ) -> torch.Tensor: ...

    def sampled_hvp(
        self, output: torch.Tensor, batch: Batch, grads: torch.Tensor, u: torch.Tensor
    ) -> torch.Tensor: ...


@runtime_checkable
class KeyedSampledFisherLoss(SampledFisherLoss, Protocol):
    """A :class:`SampledFisherLoss` whose draws are a pure function of a key:
    ``loss.keyed_sample_grads(output, batch, k, key)`` with ``key`` a 0-d int64 tensor
    (counter-based random numbers, ``loss_fns.counter_rng``), traceable. The traced
    engines (``engine="functional"`` / ``"compiled"``) run the Monte-Carlo Fisher of such
    losses; see NOTE [sampled targets as data] in ``operators.ggn``."""

    def keyed_sample_grads(
        self, output: torch.Tensor, batch: Batch, k: int, key: torch.Tensor
    ) -> torch.Tensor: ...


@runtime_checkable
class OutputHessianSqrtLoss(Protocol):
    """A loss of the output whose output Hessian has a known per-sample square root, for the
    exact GGN diagonal (``diagonal(ggn, method="exact")``).

    ``loss.hessian_sqrt(output, batch)`` returns ``S`` of shape ``(N, K, *output.shape[1:])``
    (``N = output.shape[0]`` samples, ``K`` columns per sample) such that the loss Hessian at
    ``output`` is ``Σₙ Σₖ sₙₖ sₙₖᵀ`` with ``sₙₖ = S[n, k]`` placed at sample ``n`` (the
    Hessian has no terms between samples). No graph.
    """

    def hessian_sqrt(self, output: torch.Tensor, batch: Batch) -> torch.Tensor: ...


@runtime_checkable
class HessianColumnsLoss(Protocol):
    """A loss of the output that factors its Hessian into batch-wide columns, for the Kronecker
    factor pass (``KFACOperator``; ``loss_fns.output_curvature``).

    ``loss.term_weight(output, batch, dtype)`` is the reduction's weight per loss term ``w``
    (0-dim, ``dtype``; ``1/count`` for a mean) and the rows that count (``None``: all), so that
    the mean loss's Hessian is ``w`` times the sum of the terms'. ``loss.hessian_columns(output,
    batch, dtype)`` returns ``k`` and ``columns(start, stop) -> (stop - start, *output.shape)``,
    columns ``s_c`` each covering every row of the batch, with ``Σ_c s_c s_cᵀ`` equal to the loss
    Hessian within each row (terms between rows are not used). No graph.
    """

    def term_weight(
        self, output: torch.Tensor, batch: Batch, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor | None]: ...

    def hessian_columns(
        self, output: torch.Tensor, batch: Batch, dtype: torch.dtype
    ) -> tuple[int, Callable[[int, int], torch.Tensor]]: ...


@runtime_checkable
class SampledFisherSqrtLoss(Protocol):
    """A :class:`SampledFisherLoss` that also gives the square root of its sampled Hessian
    ``H̃`` (what ``sampled_hvp`` applies), in the layout of
    :meth:`OutputHessianSqrtLoss.hessian_sqrt`: ``(N, K, *output.shape[1:])``."""

    def sampled_hessian_sqrt(
        self, output: torch.Tensor, batch: Batch, grads: torch.Tensor
    ) -> torch.Tensor: ...
