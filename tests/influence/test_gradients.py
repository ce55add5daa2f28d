"""Per-example gradients (``influence.gradients``): the hooked path of linear layers (NOTE
[per-example gradients of linear layers]) against each example's gradient taken alone, and its
refusals, which fall back to vmap with the same numbers. float64."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from hessian_eigenthings.influence.gradients import PerExampleGradients
from hessian_eigenthings.param_utils import ParamLayout, select_parameters

Loss = Callable[[nn.Module, Any], torch.Tensor]


def _alone(
    model: nn.Module, names: tuple[str, ...], loss: Loss, batch: Any, B: int
) -> torch.Tensor:
    """Reference: each example's loss on its own, one autograd.grad each."""
    params = dict(model.named_parameters())
    rows = []
    for i in range(B):
        single = (
            {k: v[i : i + 1] for k, v in batch.items()}
            if isinstance(batch, dict)
            else tuple(t[i : i + 1] for t in batch)
        )
        value = loss(model, single).reshape(())
        grads = torch.autograd.grad(value, [params[n] for n in names])
        rows.append(torch.cat([g.reshape(-1) for g in grads]))
    return torch.stack(rows)


def _mlp_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    x, y = batch
    return F.cross_entropy(model(x), y, reduction="none")


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3)).double().eval()


def _mlp_batch(B: int = 6) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(B, 5, generator=g, dtype=torch.float64), torch.randint(
        0, 3, (B,), generator=g
    )


def _counting(model: nn.Module) -> list[int]:
    calls = [0]
    model.register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    return calls


def test_linear_layers_hooked_equal_each_example_alone() -> None:
    model = _mlp()
    layout = ParamLayout.from_named(select_parameters(model, None))
    grads = PerExampleGradients(model, layout, _mlp_loss)
    calls = _counting(model)
    batch, other = _mlp_batch(), _mlp_batch(4)
    rows = grads(batch)
    assert calls[0] == 1 + 2  # the batch, then two examples alone for the first batch's check
    assert grads.linear is not None and grads.linear_checked
    rows_other = grads(other)
    assert calls[0] == 1 + 2 + 1  # checked once: one forward per later batch
    torch.testing.assert_close(
        rows, _alone(model, layout.names, _mlp_loss, batch, 6), rtol=1e-12, atol=1e-14
    )
    torch.testing.assert_close(
        rows_other, _alone(model, layout.names, _mlp_loss, other, 4), rtol=1e-12, atol=1e-14
    )
    assert all(p.grad is None for p in model.parameters())


def test_gpt2_conv1d_layers_hooked_equal_each_example_alone() -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(
        vocab_size=13, n_positions=8, n_embd=8, n_layer=2, n_head=2, attn_implementation="eager"
    )
    torch.manual_seed(2)
    model = transformers.GPT2LMHeadModel(config).double().eval()

    def loss(m: nn.Module, batch: Any) -> torch.Tensor:
        ids = batch["input_ids"]
        logits = m(input_ids=ids, use_cache=False).logits[:, :-1]
        ce = F.cross_entropy(logits.reshape(-1, 13), ids[:, 1:].reshape(-1), reduction="none")
        return ce.view(ids.shape[0], -1).sum(1)

    layout = ParamLayout.from_named(
        select_parameters(model, lambda n, p: ".attn.c_" in n or ".mlp.c_" in n)
    )
    grads = PerExampleGradients(model, layout, loss)
    batch = {"input_ids": torch.randint(0, 13, (4, 6), generator=torch.Generator().manual_seed(3))}
    rows = grads(batch)
    assert grads.linear is not None and grads.linear_checked
    torch.testing.assert_close(
        rows, _alone(model, layout.names, loss, batch, 4), rtol=1e-11, atol=1e-13
    )


class _BatchCentred(nn.Module):
    """Subtracts the batch mean: each example's loss depends on the others."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(5, 7)
        self.b = nn.Linear(7, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        return self.b(torch.tanh(h - h.mean(0, keepdim=True)))


class _Twice(nn.Module):
    """One linear layer called twice per forward."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(5, 5)
        self.b = nn.Linear(5, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(torch.tanh(self.a(x)))))


@pytest.mark.parametrize("build", [_BatchCentred, _Twice])
def test_models_the_hooked_path_cannot_run_fall_back_to_vmap_with_the_same_numbers(
    build: Callable[[], nn.Module],
) -> None:
    torch.manual_seed(0)
    model = build().double().eval()
    layout = ParamLayout.from_named(select_parameters(model, None))
    grads = PerExampleGradients(model, layout, _mlp_loss)
    batch = _mlp_batch()
    rows = grads(batch)
    assert grads.linear is None  # refused for good
    # vmap's semantics: each example's gradient as if it were alone in the batch
    torch.testing.assert_close(
        rows, _alone(model, layout.names, _mlp_loss, batch, 6), rtol=1e-12, atol=1e-14
    )


def test_a_parameter_outside_a_linear_layer_uses_vmap() -> None:
    model = nn.Sequential(nn.Linear(5, 7), nn.LayerNorm(7), nn.Linear(7, 3)).double().eval()
    layout = ParamLayout.from_named(select_parameters(model, None))
    grads = PerExampleGradients(model, layout, _mlp_loss)
    assert grads.linear is None
    batch = _mlp_batch()
    torch.testing.assert_close(
        grads(batch), _alone(model, layout.names, _mlp_loss, batch, 6), rtol=1e-12, atol=1e-14
    )


def test_query_slices_give_the_same_preconditioned_gradients() -> None:
    from hessian_eigenthings import influence

    model = _mlp()
    x, y = _mlp_batch(9)
    train = [(x[:3], y[:3]), (x[3:6], y[3:6])]
    fitted = influence.fit(model, train, influence.supervised_task(nn.CrossEntropyLoss()))
    query = [(x[:5], y[:5]), (x[5:], y[5:])]
    whole = fitted.query_gradients(query)
    sliced = fitted.query_gradients(query, examples_at_once=2)
    torch.testing.assert_close(sliced, whole, rtol=1e-12, atol=1e-14)
    scores = fitted.pairwise_scores(query, train, progress=False)  # slices of 3 (train batches)
    torch.testing.assert_close(scores, -whole @ torch.cat([fitted.gradients(b) for b in train]).T)
