"""Empirical Fisher, ``F = (1/N) Σᵢ gᵢ gᵢᵀ``, without forming the N × P gradient matrix.

``gᵢ = ∇_θ ℓᵢ`` is the gradient of sample ``i``'s own loss ``ℓᵢ`` (not
divided by ``N``): ``per_sample_loss_fn(model, batch)`` returns the vector
``ℓ`` of shape ``(N,)``. With ``J = ∂ℓ/∂θ`` (N × P, never formed)::

    F v = Jᵀ (J v) / N

``J v`` by forward-mode AD (one pass for a block of vectors; finite
differences where the model's ops have no forward-mode formulas), ``Jᵀ w``
by one backward of ``⟨ℓ, w⟩``. This is the GGN of the per-sample losses
under the loss ``‖ℓ‖²/2N`` and shares its machinery (NOTE [GGN
Jacobian-vector products] in ``ggn``). Each batch's product is its own mean
``(1/b) Σ gᵢgᵢᵀ``, and batches are weighted by size, so the result is the
mean over all samples. A loss whose samples are not the batch's rows (per-token losses,
:class:`~hessian_eigenthings.loss_fns.CountedPerSampleLoss`) says how many it holds: the
batch's product divides by that count and the batch weighs it (one host sync per batch
read, none on a kept state). Cost per product and batch: one forward (kept across
products with graph reuse), one forward-mode pass, one backward.

``F`` is not the Hessian of the mean loss, nor the Fisher information of
the model's predictive distribution (that one samples labels from the
model); it equals neither in general, even at a minimum.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn
from typing_extensions import Unpack

from hessian_eigenthings._checks import check_count
from hessian_eigenthings.batching import Batch, batch_size
from hessian_eigenthings.loss_fns.checks import check_first_batch, check_loss_argument
from hessian_eigenthings.loss_fns.huggingface import HFCausalLMBatchLoss
from hessian_eigenthings.loss_fns.output_curvature import EmpiricalOfLosses
from hessian_eigenthings.loss_fns.protocols import CountedPerSampleLoss, PerSampleLossFn
from hessian_eigenthings.operators.base import SampleCount
from hessian_eigenthings.operators.sandwich import OutputSandwichOperator, SandwichOptions


class EmpiricalFisherOperator(OutputSandwichOperator):
    """``(1/N) Σᵢ ∇ℓᵢ ∇ℓᵢᵀ`` over all samples of the data.

    ``EmpiricalFisherOperator(model, dataloader, per_sample_loss_fn, *,
    param_filter=None, full_dataset=True, num_batches=None, sample_dim=0,
    backend=None)`` plus the microbatch, block, graph-reuse and engine options of
    :class:`~hessian_eigenthings.operators.base.DataCurvatureOperator`; all but
    ``sample_dim`` travel as one record (``**options``,
    :class:`~hessian_eigenthings.operators.sandwich.SandwichOptions`).

    - ``per_sample_loss_fn(model, batch)`` returns one loss per sample, laid
      out along ``sample_dim`` (e.g. ``reduction="none"``; see
      :func:`hessian_eigenthings.loss_fns.supervised_per_sample_loss`). Any
      further dimensions (e.g. per-token losses ``(N, T)``) are averaged into
      their sample's loss. The number of samples must equal the batch's size
      (its leading dimension), which the data loop weights batches by.
    - Unless the function has a ``sample_count(batch)`` method
      (:class:`~hessian_eigenthings.loss_fns.CountedPerSampleLoss`): then
      its losses, in any shape, are flattened, ``N`` per batch is
      ``sample_count(batch)`` and batches weigh their ``N``; ``sample_dim``
      does not apply. :func:`~hessian_eigenthings.loss_fns.hf_lm_per_token_loss`
      is one (a sample per token); for a sample per sequence use
      :func:`~hessian_eigenthings.loss_fns.hf_lm_per_sequence_loss`.
    - ``jvp`` / ``fd_eps``: how ``J v`` is computed, as for
      :class:`~hessian_eigenthings.operators.GGNOperator`.
    """

    _what_output = "per_sample_loss_fn"

    def __init__(
        self,
        model: nn.Module,
        dataloader: Iterable[Batch],
        per_sample_loss_fn: PerSampleLossFn,
        *,
        sample_dim: int = 0,
        **options: Unpack[SandwichOptions],
    ) -> None:
        check_per_sample_loss(per_sample_loss_fn)
        self.per_sample_loss_fn = per_sample_loss_fn
        self.sample_dim = check_count("sample_dim", sample_dim, minimum=None)
        #: the loss when it counts its own samples (CountedPerSampleLoss), else None
        self._counted = (
            per_sample_loss_fn if isinstance(per_sample_loss_fn, CountedPerSampleLoss) else None
        )
        if self._counted is not None:
            if self.sample_dim != 0:
                raise ValueError(
                    f"sample_dim={self.sample_dim} does not apply to {per_sample_loss_fn!r}: it counts its own "
                    "samples (sample_count); leave sample_dim at 0"
                )
            # batches weigh the samples the loss counts (NOTE [batch weighting] in ``base``)
            self.sample_counter = CountedSamples(self._counted)
        curvature = EmpiricalOfLosses(
            self._count, counted=self._counted is not None, name=repr(per_sample_loss_fn)
        )
        super().__init__(model, dataloader, self._per_sample_losses, curvature=curvature, **options)
        check_first_batch(model, self.source.first_batch(), per_sample_loss_fn)

    # NOTE [un-batched per-sample functions]
    # The 1.0 alpha took per_sample_loss_fn(model, sample) for ONE un-batched sample and
    # vmapped it over the batch; 1.0 takes a batch and wants (N,) losses. A function that
    # returns a scalar for the whole batch is taken for the alpha's kind: it is vmapped over
    # sample_dim from then on (decided once per operator). A batched loss with a mean
    # reduction lands here too, and is right as well: its mean over one sample is that
    # sample's loss. If vmapping fails, the error says both ways to write the function.
    _unbatched_fn: bool = False
    #: it returned per-sample losses for a whole batch (errors from it are then real errors)
    _batched_fn: bool = False

    def _per_sample_losses(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        if self._counted is not None:
            counted = self._counted(model, batch)
            if not isinstance(counted, torch.Tensor):
                raise TypeError(
                    f"per_sample_loss_fn must return a tensor of per-sample losses, got {type(counted).__name__}"
                )
            return counted.reshape(-1)
        if self._unbatched_fn:
            losses = self._vmapped(model, batch)
        else:
            try:
                losses = self.per_sample_loss_fn(model, batch)
            except Exception:
                if self._batched_fn:
                    raise  # it took this operator's batches before: a real error
                # the alpha's kind may fail on a whole batch (it indexes one sample's shape)
                try:
                    losses = torch.func.vmap(
                        lambda sample: self.per_sample_loss_fn(model, sample),
                        in_dims=self.sample_dim,
                    )(batch)
                except Exception:
                    pass
                else:
                    if isinstance(losses, torch.Tensor) and losses.dim() == 1:
                        self._unbatched_fn = True
                        return losses
                raise  # the batch's own error: the function is meant for batches
            if isinstance(losses, torch.Tensor) and losses.dim() > 0:
                self._batched_fn = True
        if not isinstance(losses, torch.Tensor):
            raise TypeError(
                f"per_sample_loss_fn must return a tensor of per-sample losses, got {type(losses).__name__}"
            )
        if losses.dim() == 0:
            losses = self._vmapped(model, batch)
            self._unbatched_fn = True
        if not -losses.dim() <= self.sample_dim < losses.dim():
            raise ValueError(
                f"sample_dim={self.sample_dim} is out of range for losses of shape {tuple(losses.shape)}"
            )
        losses = losses.movedim(self.sample_dim, 0)
        n = batch_size(batch)
        if losses.shape[0] != n:
            raise ValueError(
                f"per_sample_loss_fn returned {losses.shape[0]} losses along sample_dim={self.sample_dim} for a "
                f"batch of {n} samples (its leading dimension); batches are weighted by that size, so the two "
                "must agree: return one loss per sample, or set sample_dim; losses of other samples "
                "(tokens) need a sample_count(batch) method (loss_fns.CountedPerSampleLoss, e.g. "
                "hf_lm_per_token_loss())"
            )
        return losses.reshape(n, -1).mean(1) if losses.dim() > 1 else losses

    def _count(self, batch: Batch, output: torch.Tensor) -> torch.Tensor | int:
        """``N`` of one batch: the mean's denominator."""
        if self._counted is None:
            return output.shape[0]
        n = self._counted.sample_count(batch)
        n = n if isinstance(n, torch.Tensor) else torch.tensor(n)
        # a batch without samples has all-zero losses: a zero product, not 0/0
        return n.to(device=output.device, dtype=output.dtype).clamp_min(1)

    def _vmapped(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        """Per-sample losses of an un-batched ``per_sample_loss_fn``; see NOTE [un-batched per-sample functions]."""
        try:
            return torch.func.vmap(
                lambda sample: self.per_sample_loss_fn(model, sample), in_dims=self.sample_dim
            )(batch)
        except Exception as exc:
            helper = (
                _HF_HELPERS
                if hasattr(batch, "keys")  # a dict or BatchEncoding: HuggingFace inputs
                else "e.g. loss_fns.supervised_per_sample_loss(criterion) for (inputs, targets) batches"
            )
            raise ValueError(
                "per_sample_loss_fn returned a scalar for the batch, and calling it on one sample at a "
                f"time (vmapped over sample_dim={self.sample_dim}, as the 1.0 alpha did) failed: {exc}. "
                "Return one loss per sample, shape (N,), with reduction='none' "
                f"({helper}), or write it for one un-batched sample"
            ) from exc


def check_per_sample_loss(per_sample_loss_fn: object) -> None:
    """Refuse what cannot be a per-sample loss (a mean loss of HuggingFace's among them)."""
    if not callable(per_sample_loss_fn):
        raise TypeError(
            "per_sample_loss_fn must be callable as per_sample_loss_fn(model, batch) -> (N,) losses"
        )
    check_loss_argument(
        per_sample_loss_fn, name="per_sample_loss_fn", wrap="supervised_per_sample_loss"
    )
    if isinstance(per_sample_loss_fn, HFCausalLMBatchLoss):
        raise TypeError(
            "per_sample_loss_fn got hf_lm_loss(), the mean loss of a batch; the empirical Fisher needs "
            f"one loss per sample: {_HF_HELPERS}"
        )


class CountedSamples(SampleCount):
    """The samples of a loss that counts its own (``sample_count(batch)``, e.g. the tokens that
    count), one host sync per batch read; a pass that counted none says so."""

    def __init__(self, loss: CountedPerSampleLoss) -> None:
        self.loss = loss

    def samples(self, chunk: Batch) -> int:
        return int(self.loss.sample_count(chunk))  # the host sync of a batch read

    def check(self, count: int, total: float) -> None:
        if total == 0:
            raise ValueError(
                f"{self.loss!r} counted no sample in the data (sample_count was 0 for every "
                "batch: are all labels -100?)"
            )
        super().check(count, total)


_HF_HELPERS = (
    "for HuggingFace causal LMs pass loss_fns.hf_lm_per_sequence_loss() (a sample per sequence) or "
    "hf_lm_per_token_loss() (a sample per token that counts)"
)
