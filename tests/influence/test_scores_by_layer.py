"""Pairwise scores made layer by layer as the backward reaches each layer (NOTE [scores layer by
layer] in ``influence.gradients``): no batch's rows of per-example gradients held after the
first batch, and the same bits as scores made from the rows."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from hessian_eigenthings import influence
from hessian_eigenthings.influence import gradients as gradients_module
from tests.influence.tiny import tiny_gpt2


def _data() -> tuple[list[dict[str, torch.Tensor]], list[dict[str, torch.Tensor]]]:
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 11, (11, 6), generator=g)
    labels = ids.clone()
    labels[1, 2] = -100
    train = [{"input_ids": ids[i : i + 3], "labels": labels[i : i + 3]} for i in (0, 3, 6)]
    query = [{"input_ids": ids[9:], "labels": labels[9:]}]
    return train, query


def _fit(model: Any, train: list[Any]) -> Any:
    return influence.fit(model, train, influence.causal_lm_task(), damping=1e-2)


def test_rows_are_made_only_for_the_first_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    model, (train, query) = tiny_gpt2(), _data()
    fitted = _fit(model, train)
    calls: list[int] = []
    made = gradients_module._linear_gradients

    def counted(*args: Any, **kwargs: Any) -> torch.Tensor:
        rows = made(*args, **kwargs)
        calls.append(rows.shape[0])
        return rows

    monkeypatch.setattr(gradients_module, "_linear_gradients", counted)
    scores = fitted.pairwise_scores(query, train, progress=False)
    # the query batch (whose first batch checks the hooks) only: every training batch by layer
    assert calls == [2]
    # the same scores as the rows of every batch would give (float64, sum order aside)
    Q = fitted.query_gradients(query)
    G = torch.cat([fitted.gradients(b) for b in train])
    torch.testing.assert_close(scores, -(Q @ G.T), rtol=1e-12, atol=1e-14)


def test_layer_by_layer_and_rows_give_the_same_bits(monkeypatch: pytest.MonkeyPatch) -> None:
    """Batches scored from their rows (as before the hooks are checked, and on sharded ranks)
    and by layer give the same bits: a resumed run equals an unbroken one wherever it resumes."""
    model, (train, query) = tiny_gpt2(), _data()
    by_layer = _fit(model, train).pairwise_scores(query, train, progress=False)
    fitted = _fit(model, train)
    dots = gradients_module.PerExampleGradients.dots
    rows_made: list[int] = []

    def from_rows(self: Any, batch: Any, Q: torch.Tensor) -> torch.Tensor:
        self.linear_checked = False  # each batch checked again: made from its rows
        rows_made.append(1)
        return dots(self, batch, Q)

    monkeypatch.setattr(gradients_module.PerExampleGradients, "dots", from_rows)
    from_rows_scores = fitted.pairwise_scores(query, train, progress=False)
    assert len(rows_made) == len(train)
    assert torch.equal(from_rows_scores, by_layer)
