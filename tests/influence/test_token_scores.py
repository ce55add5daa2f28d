"""``Influence.token_scores``: each position's share of the pairwise scores, against an
independent reference: the derivative of a sequence's loss when the preconditioned query is
added to every scored layer's weights at that one position only. float64."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from hessian_eigenthings import influence
from tests.influence.tiny import tiny_gpt2


def _gpt2(vocab: int = 11) -> nn.Module:
    return tiny_gpt2(vocab)


def _data() -> tuple[list[dict[str, torch.Tensor]], list[dict[str, torch.Tensor]]]:
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, 11, (7, 5), generator=g)
    train = [{"input_ids": ids[:3]}, {"input_ids": ids[3:5]}]
    return train, [{"input_ids": ids[5:]}]


def _position_share(fitted: Any, q: torch.Tensor, ids: torch.Tensor, t: int) -> float:
    """``−d/dε L(z)`` with ``ε·q`` added to every scored layer at position ``t`` only."""
    model = fitted.model
    modules = dict(model.named_modules())
    views = dict(zip(fitted.layout.names, fitted.layout.split_rows(q[None]), strict=True))
    eps = torch.zeros((), dtype=torch.float64, requires_grad=True)
    handles = []
    for name in {n.rsplit(".", 1)[0] for n in fitted.layout.names}:
        module = modules[name]
        W = views[f"{name}.weight"][0]  # Conv1D: (in, out)
        b = views[f"{name}.bias"][0]

        def hook(_m: nn.Module, args: Any, out: torch.Tensor, W: Any = W, b: Any = b) -> Any:
            delta = torch.zeros_like(out)
            delta[:, t] = args[0][:, t] @ W + b
            return out + eps * delta

        handles.append(module.register_forward_hook(hook))
    try:
        loss = fitted.task.per_example_loss(model, {"input_ids": ids[None]})[0]
        (d,) = torch.autograd.grad(loss, [eps])
    finally:
        for h in handles:
            h.remove()
    return -float(d)


def test_token_scores_sum_to_pairwise_and_equal_the_position_derivative() -> None:
    model = _gpt2()
    train, query = _data()
    fitted = influence.fit(model, train, influence.causal_lm_task(), damping=1e-2)
    tokens = fitted.token_scores(query, train, progress=False)
    pairwise = fitted.pairwise_scores(query, train, progress=False)
    assert tokens.shape == (2, 5, 5)
    torch.testing.assert_close(tokens.sum(2), pairwise, rtol=1e-10, atol=1e-12)
    Q = fitted.query_gradients(query)
    ids = torch.cat([b["input_ids"] for b in train])
    for qi, zi, t in [(0, 0, 0), (1, 2, 3), (0, 4, 4), (1, 3, 1)]:
        expected = _position_share(fitted, Q[qi], ids[zi], t)
        assert tokens[qi, zi, t].item() == pytest.approx(expected, rel=1e-9, abs=1e-12)


def test_token_scores_refusals_in_one_line() -> None:
    model = _gpt2()
    train, query = _data()
    exact = influence.fit(model, train, influence.causal_lm_task(), curvature="ggn", damping=1e-2)
    with pytest.raises(ValueError, match=r"nn\.Linear / Conv1D") as exc:
        exact.token_scores(query, train, progress=False)  # every parameter: embeddings too
    assert "\n" not in str(exc.value)
    fitted = influence.fit(model, train, influence.causal_lm_task(), damping=1e-2)
    uneven = [train[0], {"input_ids": train[1]["input_ids"][:, :4]}]
    with pytest.raises(ValueError, match="pad every batch to one length"):
        fitted.token_scores(query, uneven, progress=False)
