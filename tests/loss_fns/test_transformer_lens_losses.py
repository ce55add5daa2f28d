"""TransformerLens helpers with a stand-in that follows HookedTransformer's calling convention."""

from __future__ import annotations

import sys

import pytest
import torch
from torch import nn

from hessian_eigenthings.loss_fns import (
    OutputHessianLoss,
    tlens_forward,
    tlens_loss,
    tlens_loss_of_output,
)
from hessian_eigenthings.operators import GGNOperator, HessianOperator


class StandIn(nn.Module):
    """``model(tokens, return_type="logits", attention_mask=None)`` like ``HookedTransformer``."""

    def __init__(self, vocab: int = 7, d: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.unembed = nn.Linear(d, vocab)
        self.seen_mask: torch.Tensor | None = None

    def forward(
        self,
        tokens: torch.Tensor,
        return_type: str = "logits",
        attention_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        assert return_type == "logits"
        self.seen_mask = attention_mask
        h = torch.cumsum(self.embed(tokens), dim=1)  # causal mixing
        return self.unembed(torch.tanh(h))


def reference_loss(
    logits: torch.Tensor, tokens: torch.Tensor, mask: torch.Tensor | None
) -> torch.Tensor:
    # transformer_lens.utils.lm_cross_entropy_loss, restated
    logp = torch.log_softmax(logits, dim=-1)[:, :-1].gather(-1, tokens[:, 1:, None])[..., 0]
    if mask is None:
        return -logp.mean()
    keep = torch.logical_and(mask[:, :-1], mask[:, 1:])
    return -(logp * keep).sum() / keep.sum()


def test_nothing_imported_from_transformer_lens() -> None:
    assert "transformer_lens" not in sys.modules


@pytest.mark.parametrize("with_mask", [False, True])
def test_loss_matches_transformer_lens_formula(with_mask: bool) -> None:
    model = StandIn().double()
    tokens = torch.randint(0, 7, (3, 5))
    mask = torch.ones_like(tokens)
    mask[0, :2] = 0  # left padding
    batch = {"tokens": tokens, "attention_mask": mask} if with_mask else tokens
    logits = tlens_forward()(model, batch)
    assert (model.seen_mask is mask) == with_mask
    expected = reference_loss(logits, tokens, mask if with_mask else None)
    torch.testing.assert_close(tlens_loss()(model, batch), expected)
    loss = tlens_loss_of_output()
    assert isinstance(loss, OutputHessianLoss)
    torch.testing.assert_close(loss(logits, batch), expected)
    out = logits.detach()
    H = torch.func.jacrev(torch.func.jacrev(lambda o: loss(o, batch)))(out).reshape(out.numel(), -1)
    U = torch.randn(2, *out.shape, dtype=torch.float64)
    torch.testing.assert_close(
        loss.hvp(out, batch, U).reshape(2, -1), U.reshape(2, -1) @ H.T, rtol=1e-10, atol=1e-12
    )


def test_input_ids_key_and_operators() -> None:
    model = StandIn().double()
    data = [{"input_ids": torch.randint(0, 7, (2, 4))} for _ in range(2)]
    G = GGNOperator(model, data, tlens_forward(), tlens_loss_of_output())
    H = HessianOperator(model, data, tlens_loss())
    v = torch.randn(G.size, dtype=torch.float64)
    assert torch.isfinite(G @ v).all() and torch.isfinite(H @ v).all()
    with pytest.raises(KeyError, match="tokens"):
        tlens_forward()(model, {"ids": torch.zeros(1, 2, dtype=torch.long)})
