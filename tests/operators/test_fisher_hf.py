"""The empirical Fisher of a tiny GPT-2 with a sample per sequence and a sample per token,
against ``(1/N) Σ gᵢgᵢᵀ`` from per-sample gradients taken one by one with torch.autograd
(each sample's loss from a forward of its own sequence alone), with ``-100`` labels, a
padded sequence and a sequence without any token that counts."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from hessian_eigenthings.loss_fns import hf_lm_loss, hf_lm_per_sequence_loss, hf_lm_per_token_loss
from hessian_eigenthings.operators import EmpiricalFisherOperator
from tests.operators.contract import check_contract

transformers = pytest.importorskip("transformers")

V = 11


def gpt2() -> nn.Module:
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=V, n_positions=8, n_embd=4, n_layer=1, n_head=2, n_inner=8, bos_token_id=0, eos_token_id=0
    )
    return transformers.GPT2LMHeadModel(config).double().eval()


def batches() -> list[dict[str, torch.Tensor]]:
    """Two batches of unequal sizes and unequal numbers of tokens that count."""
    gen = torch.Generator().manual_seed(3)
    out = []
    for b, t in ((3, 6), (2, 6)):
        ids = torch.randint(0, V, (b, t), generator=gen)
        mask = torch.ones_like(ids)
        labels = ids.clone()
        out.append({"input_ids": ids, "attention_mask": mask, "labels": labels})
    first, second = out
    first["attention_mask"][1, 4:] = 0  # padding, labelled -100 as collators do
    first["labels"][1, 4:] = -100
    first["labels"][2, 2] = -100
    second["labels"][0] = -100  # a sequence with no token that counts
    return out


def per_sample_gradients(model: nn.Module, data: list[dict[str, torch.Tensor]], per: str) -> torch.Tensor:
    """Rows gᵢ of every sample, each from its own backward; a sequence with no token that counts
    gives a zero row (it is a sample of the per-sequence Fisher)."""
    params = [p for p in model.parameters() if p.requires_grad]
    rows: list[torch.Tensor] = []
    for batch in data:
        for i in range(batch["input_ids"].shape[0]):
            ids, mask = batch["input_ids"][i : i + 1], batch["attention_mask"][i : i + 1]
            targets = batch["labels"][i, 1:]
            counted = (targets != -100).nonzero().flatten().tolist()
            if per == "sequence" and not counted:
                rows.append(torch.zeros(sum(p.numel() for p in params), dtype=torch.float64))
                continue
            for group in ([counted] if per == "sequence" else [[t] for t in counted]):
                logits = model(input_ids=ids, attention_mask=mask).logits[0, :-1]
                loss = F.cross_entropy(logits[group], targets[group])  # mean over the sequence's tokens
                grads = torch.autograd.grad(loss, params, allow_unused=True)
                rows.append(torch.cat([(torch.zeros_like(p) if g is None else g).reshape(-1) for g, p in zip(grads, params, strict=True)]))
    return torch.stack(rows)


def dense_fisher(model: nn.Module, data: list[dict[str, torch.Tensor]], per: str) -> torch.Tensor:
    G = per_sample_gradients(model, data, per)
    return G.T @ G / G.shape[0]


OPTIONS: list[dict[str, Any]] = [
    {},  # kept states
    {"graph_reuse": False},  # a fresh forward per product
    {"microbatch_size": 2},  # chunks of a batch weigh their own samples
    {"engine": "functional"},
]


@pytest.mark.parametrize("options", OPTIONS, ids=["kept", "fresh", "microbatched", "functional"])
@pytest.mark.parametrize("per", ["sequence", "token"])
def test_fisher_equals_mean_outer_product_of_per_sample_gradients(per: str, options: dict[str, Any]) -> None:
    model, data = gpt2(), batches()
    dense = dense_fisher(model, data, per)
    n_samples = 5 if per == "sequence" else sum(int((b["labels"][:, 1:] != -100).sum()) for b in data)
    assert per_sample_gradients(model, data, per).shape[0] == n_samples
    loss = hf_lm_per_sequence_loss() if per == "sequence" else hf_lm_per_token_loss()
    op = EmpiricalFisherOperator(model, data, loss, **options)
    check_contract(op, dense, model, rtol=1e-9, atol=1e-12)


def test_the_two_samplings_differ() -> None:
    """With unequal token counts the two matrices differ: the weighting is a real choice."""
    model, data = gpt2(), batches()
    v = torch.randn(sum(p.numel() for p in model.parameters()), dtype=torch.float64)
    seq = EmpiricalFisherOperator(model, data, hf_lm_per_sequence_loss()) @ v
    tok = EmpiricalFisherOperator(model, data, hf_lm_per_token_loss()) @ v
    assert not torch.allclose(seq, tok, rtol=1e-3)


def test_the_batch_loss_is_refused_with_the_helpers_named() -> None:
    with pytest.raises(TypeError, match=r"hf_lm_per_sequence_loss\(\).*hf_lm_per_token_loss\(\)"):
        EmpiricalFisherOperator(gpt2(), batches(), hf_lm_loss())


def test_a_scalar_loss_of_dict_batches_names_the_hf_helpers() -> None:
    model = gpt2()
    inner = hf_lm_loss()

    def batch_mean(m: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return inner(m, batch)

    op = EmpiricalFisherOperator(model, batches(), batch_mean)
    with pytest.raises(ValueError, match=r"hf_lm_per_sequence_loss\(\)") as info:
        op @ torch.randn(op.size, dtype=torch.float64)
    assert "supervised_per_sample_loss" not in str(info.value)


def test_sample_dim_does_not_apply_to_per_token_losses() -> None:
    with pytest.raises(ValueError, match="sample_dim=1 does not apply"):
        EmpiricalFisherOperator(gpt2(), batches(), hf_lm_per_token_loss(), sample_dim=1)


def test_no_token_that_counts_is_an_error() -> None:
    data = batches()
    for b in data:
        b["labels"][:] = -100
    op = EmpiricalFisherOperator(gpt2(), data, hf_lm_per_token_loss())
    with pytest.raises(ValueError, match="counted no sample"):
        op @ torch.randn(op.size, dtype=torch.float64)
