"""Loss helpers for HuggingFace ``transformers`` models.

Batches are mappings (``dict`` / ``BatchEncoding``) with ``input_ids`` and
optionally ``attention_mask`` and ``labels``, or a bare ``input_ids`` tensor.

Causal LM (``hf_lm_*``): the logits at position ``t`` predict token
``t + 1``, mean cross-entropy over the positions that count, as
``transformers`` computes it:

- with ``batch["labels"]``: targets ``labels[:, 1:]``, positions whose label
  is ``-100`` left out; the attention mask is not consulted (HuggingFace does
  not consult it either: collators write ``-100`` at padding).
- without labels: targets ``input_ids[:, 1:]``, positions whose *target*
  token is padding (``attention_mask == 0``) left out, which is what
  ``DataCollatorForLanguageModeling`` produces.

The output Hessian of that loss is ``(diag p − p pᵀ)/n`` on every counted
row and zero on the last position (:func:`hf_lm_loss_of_output`, via
:func:`hessian_eigenthings.kernels.cross_entropy_hvp`). Logits in half
precision are upcast to float32 for the loss value, as HuggingFace does.

Per-sample losses for the empirical Fisher ``(1/N) Σ gᵢgᵢᵀ`` take one of two
meanings of "sample" (NOTE [language-model samples]):
:func:`hf_lm_per_sequence_loss` (a sequence, ``N = B``) and
:func:`hf_lm_per_token_loss` (a target token that counts, ``N`` = their number).

Nothing from ``transformers`` is imported: the helpers use only the calling
convention ``model(**inputs).logits``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import nn

from hessian_eigenthings.batching import Batch
from hessian_eigenthings.kernels import lm_head_ce_ggn
from hessian_eigenthings.loss_fns._cross_entropy import (
    IGNORE_INDEX,
    Impl,
    ShiftedCrossEntropy,
    upcast,
)
from hessian_eigenthings.loss_fns.protocols import LossFn, PerSampleLossFn


def _is_mapping(batch: object) -> bool:
    return (
        hasattr(batch, "keys")
        and hasattr(batch, "__getitem__")
        and not isinstance(batch, torch.Tensor)
    )


def _model_inputs(model: nn.Module, batch: Batch, *, drop_labels: bool = True) -> dict[str, Any]:
    if isinstance(batch, torch.Tensor):
        inputs: dict[str, Any] = {"input_ids": batch}
    elif _is_mapping(batch):
        inputs = {k: batch[k] for k in batch.keys() if not (drop_labels and k == "labels")}
    else:
        raise TypeError(
            "HuggingFace helpers expect a mapping batch (input_ids, attention_mask, labels, ...) "
            f"or an input_ids tensor, got {type(batch).__name__}"
        )
    # the key/value cache is for generation; here it only costs memory
    if (
        "use_cache" not in inputs
        and getattr(getattr(model, "config", None), "use_cache", None) is not None
    ):
        inputs["use_cache"] = False
    return inputs


def _logits(out: Any) -> torch.Tensor:
    logits = getattr(out, "logits", None)
    if logits is None and isinstance(out, (tuple, list)) and out:
        logits = out[0]
    if not isinstance(logits, torch.Tensor):
        raise TypeError(
            f"the model returned {type(out).__name__} without logits; is it a *ForCausalLM / *ForSeq2SeqLM model?"
        )
    return logits


class HFCausalLMForward:
    """``forward_fn(model, batch) -> logits (B, T, V)`` of a causal LM (``labels`` are not passed).

    ``hidden_states(model, batch)`` runs only the body (``model.base_model``)
    and returns the last hidden states ``(B, T, d)``: the GGN uses it to
    apply the LM head and the loss chunk by chunk
    (:func:`hessian_eigenthings.kernels.lm_head_ce_ggn`).
    """

    def __call__(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        return _logits(model(**_model_inputs(model, batch)))

    def hidden_states(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        body = getattr(model, "base_model", None)
        if not isinstance(body, nn.Module) or body is model:
            raise TypeError(f"{type(model).__name__} has no base_model (body without the LM head)")
        out = body(**_model_inputs(body, batch))
        h = getattr(out, "last_hidden_state", None)
        if h is None and isinstance(out, (tuple, list)) and out:
            h = out[0]
        if not isinstance(h, torch.Tensor):
            raise TypeError(
                f"{type(body).__name__} returned {type(out).__name__} without last_hidden_state"
            )
        return h

    def __repr__(self) -> str:
        return "hf_lm_forward()"


def hf_lm_forward() -> HFCausalLMForward:
    """``forward_fn(model, batch) -> logits (B, T, V)`` of a causal LM (``labels`` are not passed)."""
    return HFCausalLMForward()


class HFCausalLMLoss(ShiftedCrossEntropy):
    """Shifted causal-LM cross-entropy of the logits with ``ignore_index=-100``.

    ``fused`` is passed to :func:`hessian_eigenthings.kernels.cross_entropy_hvp`
    as ``impl``.
    """

    def targets(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        if isinstance(batch, torch.Tensor):
            tgt = batch[:, 1:]
            return tgt, torch.ones_like(tgt, dtype=torch.bool)
        if not _is_mapping(batch):
            raise TypeError(
                f"expected a mapping batch or an input_ids tensor, got {type(batch).__name__}"
            )
        keys = list(batch.keys())
        if "labels" in keys:
            tgt = batch["labels"][:, 1:]
            return tgt, tgt != IGNORE_INDEX
        if "input_ids" not in keys:
            raise KeyError(
                "the batch has neither 'labels' nor 'input_ids'; the causal-LM loss needs one of them"
            )
        tgt = batch["input_ids"][:, 1:]
        if "attention_mask" in keys and batch["attention_mask"] is not None:
            return tgt, batch["attention_mask"][:, 1:].bool()
        return tgt, torch.ones_like(tgt, dtype=torch.bool)

    # -- the chunked LM head (loss_fns.protocols.LinearHeadLoss) ---------------------
    def head_targets(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """The positions that count, ``(B, T - 1)`` (position t predicts token t + 1), and
        their number (at least 1)."""
        _, valid = self.targets(batch)
        return valid, valid.sum().clamp_min(1)

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
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """GGN pull-backs through the head for k directions, by
        :func:`hessian_eigenthings.kernels.lm_head_ce_ggn` (``fused`` is its ``impl``).
        ``h`` ``(B, T, d)``; the last position predicts nothing: its pull-back is zero."""
        k = dh.shape[0]
        g_h = torch.zeros_like(dh)
        g_w = None if dW is None else torch.empty_like(dW)
        g_b = None if db is None else torch.empty_like(db)
        rows = h[:, :-1]
        for j in range(k):
            gh, gw, gb = lm_head_ce_ggn(
                rows,
                W,
                b,
                dh[j, :, :-1],
                None if dW is None else dW[j],
                None if db is None else db[j],
                valid,
                n,
                chunk_rows=chunk_rows,
                impl=self.fused,
            )
            g_h[j, :, :-1] = gh
            if g_w is not None:
                g_w[j] = gw
            if g_b is not None and gb is not None:
                g_b[j] = gb
        return g_h, g_w, g_b


def hf_lm_loss_of_output(*, fused: Impl = "auto") -> HFCausalLMLoss:
    """Shifted causal-LM cross-entropy of the logits, closed-form output Hessian.

    ``fused``: ``"auto"`` / ``"eager"`` / ``"compile"`` / ``"triton"``, the
    kernel of the Hessian product.
    """
    return HFCausalLMLoss(fused=fused)


class HFCausalLMBatchLoss:
    """``loss_fn(model, batch)``: the batch's mean shifted causal-LM cross-entropy."""

    def __init__(self) -> None:
        self.forward = hf_lm_forward()
        self.loss = HFCausalLMLoss()

    def __call__(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        return self.loss(self.forward(model, batch), batch)

    def __repr__(self) -> str:
        return "hf_lm_loss()"


def hf_lm_loss() -> LossFn:
    """``loss_fn(model, batch)``: shifted causal-LM cross-entropy (``ignore_index=-100``)."""
    return HFCausalLMBatchLoss()


# NOTE [language-model samples]
# The empirical Fisher (1/N) Σ gᵢgᵢᵀ needs a choice of what a sample i is; for a causal LM
# there are two, and they give different matrices:
# - a sequence (hf_lm_per_sequence_loss): ℓᵢ = the mean loss over sequence i's target tokens
#   that count, N = B rows. Every sequence weighs the same, however many tokens count in it.
#   A sequence with none has ℓᵢ = 0 (gᵢ = 0) and still counts in N.
# - a token (hf_lm_per_token_loss): ℓ_(i,t) = the loss of one target token that counts, N =
#   the number of such tokens in the data. Every token weighs the same; a batch weighs its
#   token count. This is the sample the batch loss hf_lm_loss() averages over.
# The per-token losses come back as the full (B·(T-1),) grid with exact zeros (no gradient)
# where a position does not count, not as the (N,) vector of counted tokens: picking those
# out has a data-dependent shape, which costs a host sync per forward and cannot be traced
# by the functional and compiled engines. The zeros add nothing to Σ gᵢgᵢᵀ, and N comes from
# sample_count(batch) (the CountedPerSampleLoss protocol), not from the number of entries.


def hf_lm_per_sequence_loss() -> PerSampleLossFn:
    """``per_sample_loss_fn(model, batch) -> (B,)``: each sequence's mean shifted causal-LM
    cross-entropy over its target tokens that count, for
    :class:`~hessian_eigenthings.operators.EmpiricalFisherOperator`.

    Targets and the tokens that count are those of :func:`hf_lm_loss` (``labels`` shifted by
    one, ``-100`` left out). One sample per sequence: every sequence weighs the same, so
    the mean of these losses equals :func:`hf_lm_loss` only when every sequence has as many
    tokens that count. A sequence without any has loss 0 (no gradient) and still counts as
    a sample. See NOTE [language-model samples].
    """
    forward = hf_lm_forward()
    loss = HFCausalLMLoss()

    def per_sequence(model: nn.Module, batch: Batch) -> torch.Tensor:
        tokens, valid = loss.token_losses(forward(model, batch), batch)
        return tokens.sum(1) / valid.sum(1).clamp_min(1).to(tokens.dtype)

    return per_sequence


class HFCausalLMPerTokenLoss:
    """Per-token shifted causal-LM cross-entropy: ``(B·(T-1),)`` losses, exactly 0 where the
    target token does not count; ``sample_count(batch)``: the tokens that count.
    Implements :class:`~hessian_eigenthings.loss_fns.CountedPerSampleLoss`."""

    def __init__(self) -> None:
        self.forward = hf_lm_forward()
        self.loss = HFCausalLMLoss()

    def __call__(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        tokens, _ = self.loss.token_losses(self.forward(model, batch), batch)
        return tokens.reshape(-1)

    def sample_count(self, batch: Batch) -> torch.Tensor:
        return self.loss.targets(batch)[1].sum()

    def __repr__(self) -> str:
        return "hf_lm_per_token_loss()"


def hf_lm_per_token_loss() -> HFCausalLMPerTokenLoss:
    """``per_sample_loss_fn(model, batch)``: one sample per target token that counts, for
    :class:`~hessian_eigenthings.operators.EmpiricalFisherOperator`.

    Targets and the tokens that count are those of :func:`hf_lm_loss` (``labels`` shifted
    by one, ``-100`` left out), so ``N`` is the number of tokens that count over the data
    and the mean of the per-token losses is :func:`hf_lm_loss`. Every token weighs the
    same; a batch weighs its number of counted tokens. The losses come back as the whole
    ``(B·(T-1),)`` grid with exact zeros at positions that do not count; the operator
    divides by ``sample_count(batch)``, not by the grid's size. See NOTE [language-model
    samples].
    """
    return HFCausalLMPerTokenLoss()


def hf_seq2seq_loss() -> LossFn:
    """``loss_fn(model, batch)`` for encoder-decoder models: cross-entropy of the decoder
    logits against ``batch["labels"]`` (aligned, no shift; ``-100`` ignored).

    Decoder inputs come from ``decoder_input_ids`` when the batch has them,
    else from ``model.prepare_decoder_input_ids_from_labels`` (the labels
    shifted right), else the model derives them from ``labels`` itself.
    """

    def loss_fn(model: nn.Module, batch: Batch) -> torch.Tensor:
        if not _is_mapping(batch) or "labels" not in list(batch.keys()):
            raise KeyError("hf_seq2seq_loss needs batches with 'labels' (the decoder targets)")
        labels = batch["labels"]
        inputs = _model_inputs(model, batch)
        if "decoder_input_ids" not in inputs and "decoder_inputs_embeds" not in inputs:
            prepare = getattr(model, "prepare_decoder_input_ids_from_labels", None)
            if callable(prepare):
                inputs["decoder_input_ids"] = prepare(labels=labels)
            else:
                inputs["labels"] = labels
        logits = upcast(_logits(model(**inputs)))
        return F.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=IGNORE_INDEX
        )

    return loss_fn


# the 1.0 alpha's type names, kept importable: the ``fused=`` choices, and the signature of
# an output-Hessian product ``(output, batch, u) -> H_loss u``
FusedCEHvpBackend = Literal["auto", "eager", "compile", "triton"]
LossHvpFn = Callable[[torch.Tensor, Any, torch.Tensor], torch.Tensor]
