"""HuggingFace helpers against transformers' own losses on tiny locally built models."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hessian_eigenthings.loss_fns import (
    CountedPerSampleLoss,
    HFCausalLMLoss,
    OutputHessianLoss,
    hf_lm_forward,
    hf_lm_loss,
    hf_lm_loss_of_output,
    hf_lm_per_sequence_loss,
    hf_lm_per_token_loss,
    hf_seq2seq_loss,
)

transformers = pytest.importorskip("transformers")


def gpt2() -> torch.nn.Module:
    config = transformers.GPT2Config(
        vocab_size=11, n_positions=8, n_embd=8, n_layer=1, n_head=2, bos_token_id=0, eos_token_id=0
    )
    return transformers.GPT2LMHeadModel(config).double().eval()


def lm_batch() -> dict[str, torch.Tensor]:
    ids = torch.randint(0, 11, (3, 6))
    mask = torch.ones_like(ids)
    mask[1, 4:] = 0
    labels = ids.masked_fill(mask == 0, -100)
    labels[2, 1] = -100
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def close_to_hf(ours: torch.Tensor, theirs: torch.Tensor) -> None:
    # transformers computes the loss in float32 even for float64 logits; we keep float64
    torch.testing.assert_close(ours, theirs.to(ours.dtype), rtol=1e-5, atol=1e-6)


def test_lm_loss_equals_transformers_loss() -> None:
    model, batch = gpt2(), lm_batch()
    close_to_hf(hf_lm_loss()(model, batch), model(**batch).loss)
    logits = hf_lm_forward()(model, batch)
    torch.testing.assert_close(logits, model(**batch).logits)


def test_without_labels_padding_targets_are_left_out() -> None:
    model, batch = gpt2(), lm_batch()
    no_labels = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
    collated = batch["input_ids"].masked_fill(
        batch["attention_mask"] == 0, -100
    )  # what HF collators write
    close_to_hf(hf_lm_loss()(model, no_labels), model(**no_labels, labels=collated).loss)
    ids_only = batch["input_ids"]  # a bare tensor batch: every position counts
    close_to_hf(hf_lm_loss()(model, ids_only), model(input_ids=ids_only, labels=ids_only).loss)


def test_lm_loss_of_output_hvp_equals_autograd_hessian() -> None:
    batch = lm_batch()
    logits = torch.randn(3, 6, 11, dtype=torch.float64)
    loss = hf_lm_loss_of_output(fused="eager")
    assert isinstance(loss, OutputHessianLoss) and isinstance(loss, HFCausalLMLoss)
    H = torch.func.jacrev(torch.func.jacrev(lambda o: loss(o, batch)))(logits).reshape(
        logits.numel(), -1
    )
    U = torch.randn(2, 3, 6, 11, dtype=torch.float64)
    got = loss.hvp(logits, batch, U)
    torch.testing.assert_close(got.reshape(2, -1), U.reshape(2, -1) @ H.T, rtol=1e-10, atol=1e-12)
    assert torch.all(got[:, :, -1] == 0)  # the last position predicts nothing


def test_per_sequence_and_per_token_losses() -> None:
    model, batch = gpt2(), lm_batch()
    batch["labels"][0] = -100  # a sequence without a token that counts
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    labels = batch["labels"][:, 1:]
    valid = labels != -100
    # each target token's own loss, one cross_entropy call per token
    own = torch.zeros(labels.shape, dtype=torch.float64)
    for i, t in valid.nonzero().tolist():
        own[i, t] = F.cross_entropy(logits[i, t], labels[i, t])
    per_token = hf_lm_per_token_loss()
    assert isinstance(per_token, CountedPerSampleLoss)
    torch.testing.assert_close(per_token(model, batch), own.reshape(-1), rtol=1e-12, atol=1e-12)
    assert int(per_token.sample_count(batch)) == int(valid.sum())
    # tokens weigh the same: their mean is the batch loss
    torch.testing.assert_close(own.sum() / valid.sum(), hf_lm_loss()(model, batch), rtol=1e-12, atol=0)
    seq = hf_lm_per_sequence_loss()(model, batch)
    assert seq.shape == (3,) and seq[0] == 0
    for i in (1, 2):
        torch.testing.assert_close(seq[i], own[i][valid[i]].mean(), rtol=1e-12, atol=0)
    # without labels: padding targets are left out, as hf_lm_loss does
    no_labels = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
    assert int(per_token.sample_count(no_labels)) == int(batch["attention_mask"][:, 1:].sum())
    torch.testing.assert_close(
        per_token(model, no_labels).sum() / per_token.sample_count(no_labels), hf_lm_loss()(model, no_labels)
    )


def test_half_precision_logits_loss_in_float32() -> None:
    batch = lm_batch()
    logits = torch.randn(3, 6, 11, dtype=torch.bfloat16)
    loss = hf_lm_loss_of_output()(logits, batch)
    assert loss.dtype == torch.float32
    assert (
        hf_lm_loss_of_output()
        .hvp(logits, batch, torch.randn(1, 3, 6, 11, dtype=torch.bfloat16))
        .dtype
        == torch.bfloat16
    )


def test_seq2seq_loss_equals_transformers_loss() -> None:
    config = transformers.T5Config(
        vocab_size=11,
        d_model=8,
        d_kv=4,
        d_ff=16,
        num_layers=1,
        num_decoder_layers=1,
        num_heads=2,
        decoder_start_token_id=0,
        pad_token_id=0,
        eos_token_id=1,
    )
    model = transformers.T5ForConditionalGeneration(config).double().eval()
    ids = torch.randint(2, 11, (2, 5))
    labels = torch.randint(2, 11, (2, 4))
    labels[0, 3] = -100
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}
    close_to_hf(hf_seq2seq_loss()(model, batch), model(**batch).loss)
    with pytest.raises(KeyError, match="labels"):
        hf_seq2seq_loss()(model, {"input_ids": ids})


def test_bad_batches() -> None:
    model = gpt2()
    with pytest.raises(TypeError, match="mapping"):
        hf_lm_forward()(model, [torch.zeros(2, 3, dtype=torch.long)])
    with pytest.raises(KeyError, match="input_ids"):
        hf_lm_loss_of_output()(torch.randn(2, 3, 11), {"attention_mask": torch.ones(2, 3)})
    with pytest.raises(ValueError, match="batch, seq, vocab"):
        hf_lm_loss_of_output()(
            torch.randn(2, 11), {"input_ids": torch.zeros(2, 3, dtype=torch.long)}
        )
