"""Low-rank query gradients made layer by layer (NOTE [low-rank queries layer by layer] in
``influence.scores``): ``pairwise_scores(rank=r)`` against an independent float64 reference
(each example's gradient by its own ``autograd.grad``, ``(C + λI)⁻¹`` by ``torch.linalg.solve``
on the dense curvature, each weight matrix truncated by ``numpy.linalg.svd``), with the bias
alone or joined to its weight, on an MLP, a one-layer GPT-2 (Conv1D) and a model whose
per-example gradients need vmap; no whole row of per-example gradients formed (the largest
tensor any operation makes, recorded by a dispatch mode); checkpoints resume bit for bit."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from hessian_eigenthings import influence
from hessian_eigenthings.influence.gradients import PerExampleGradients
from tests.influence.tiny import Allocations, Interrupted, tiny_gpt2

DAMPING = 1e-2
Loss = Callable[[nn.Module, Any], torch.Tensor]


# -- models, data and their losses ----------------------------------------------------------------
def _mlp(width: int = 7, hidden: int = 2) -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = [nn.Linear(5, width), nn.Tanh()]
    for _ in range(hidden):
        layers += [nn.Linear(width, width), nn.Tanh()]
    return nn.Sequential(*layers, nn.Linear(width, 3)).double().eval()


def _mlp_data(n: int = 17) -> tuple[list[Any], list[Any]]:
    g = torch.Generator().manual_seed(4)
    X = torch.randn(n, 5, generator=g, dtype=torch.float64)
    y = torch.randint(0, 3, (n,), generator=g)
    train = [(X[:4], y[:4]), (X[4:8], y[4:8]), (X[8:10], y[8:10])]  # uneven
    query = [(X[10:15], y[10:15]), (X[15:], y[15:])]  # 5 queries: slices of 4 and 1, then 2
    return train, query


def _mlp_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    return F.cross_entropy(model(batch[0]), batch[1], reduction="none")


def _lm_data() -> tuple[list[dict[str, torch.Tensor]], list[dict[str, torch.Tensor]]]:
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 11, (12, 6), generator=g)
    labels = ids.clone()
    labels[1, 2] = -100  # a token that does not count
    train = [{"input_ids": ids[i : i + 3], "labels": labels[i : i + 3]} for i in (0, 3, 6)]
    query = [{"input_ids": ids[9:], "labels": labels[9:]}]
    return train, query


def _lm_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    logits = model(input_ids=batch["input_ids"], use_cache=False).logits[:, :-1]
    tgt = batch["labels"][:, 1:]
    ce = F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), tgt.reshape(-1), reduction="none", ignore_index=-100
    )
    return ce.view(tgt.shape).sum(1)


class _Conv(nn.Module):
    """A convolution (its per-example gradients need vmap: no hooked layer) and a Linear."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv = nn.Conv2d(1, 3, 2)
        self.fc = nn.Linear(12, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.tanh(self.conv(x)).flatten(1))


def _conv_data() -> tuple[list[Any], list[Any]]:
    g = torch.Generator().manual_seed(5)
    X = torch.randn(9, 1, 3, 3, generator=g, dtype=torch.float64)
    y = torch.randint(0, 3, (9,), generator=g)
    return [(X[:3], y[:3]), (X[3:6], y[3:6])], [(X[6:], y[6:])]


class _Coupled(nn.Module):
    """The examples of a batch meet in the forward (each input centred on the batch's mean):
    the hooked gradients are not per-example gradients, and the check must see it."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc1 = nn.Linear(4, 6)
        self.fc2 = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x - 0.5 * x.mean(0, keepdim=True))))


# -- the reference ---------------------------------------------------------------------------------
def _examples(batches: list[Any]) -> Iterator[Any]:
    for b in batches:
        if isinstance(b, dict):
            for i in range(b["input_ids"].shape[0]):
                yield {k: v[i : i + 1] for k, v in b.items()}
        else:
            for i in range(b[0].shape[0]):
                yield tuple(t[i : i + 1] for t in b)


def _alone(
    model: nn.Module, names: tuple[str, ...], loss: Loss, batches: list[Any]
) -> torch.Tensor:
    """Each example's gradient from its loss alone, ``(N, n)``."""
    params = dict(model.named_parameters())
    rows = []
    for single in _examples(batches):
        grads = torch.autograd.grad(loss(model, single).reshape(()), [params[n] for n in names])
        rows.append(torch.cat([g.reshape(-1) for g in grads]))
    return torch.stack(rows)


def _truncated(P: torch.Tensor, shapes: tuple[torch.Size, ...], rank: int | None) -> torch.Tensor:
    """Each row's matrices (a tensor of more dimensions as ``(shape[0], rest)``) replaced by their
    best rank-``rank`` approximation (numpy's SVD); vectors whole."""
    out = P.detach().numpy().copy()
    at = 0
    for shape in shapes:
        size = shape.numel()
        if len(shape) >= 2 and rank is not None:
            for i in range(out.shape[0]):
                M = out[i, at : at + size].reshape(shape[0], -1)
                U, S, Vt = np.linalg.svd(M, full_matrices=False)
                out[i, at : at + size] = ((U[:, :rank] * S[:rank]) @ Vt[:rank]).reshape(-1)
        at += size
    return torch.from_numpy(out)


def _reference(
    fitted: Any, model: nn.Module, loss: Loss, query: list[Any], train: list[Any], rank: int | None
) -> torch.Tensor:
    names = fitted.layout.names
    C = fitted.operator.to_dense()
    gq, gt = _alone(model, names, loss, query), _alone(model, names, loss, train)
    P = torch.linalg.solve(C + DAMPING * torch.eye(C.shape[0], dtype=C.dtype), gq.T).T
    return -_truncated(P, fitted.layout.shapes, rank) @ gt.T


def _relative(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float((actual - expected).norm() / expected.norm())


def _no_rows(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The batch sizes of every call that makes rows of per-example gradients."""
    made: list[int] = []
    call = PerExampleGradients.__call__

    def counted(
        self: PerExampleGradients, batch: Any, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        rows = call(self, batch, out)
        made.append(rows.shape[0])
        return rows

    monkeypatch.setattr(PerExampleGradients, "__call__", counted)
    return made


# -- the numbers -----------------------------------------------------------------------------------
@pytest.mark.parametrize("separate_bias", [True, False])
@pytest.mark.parametrize("curvature", ["ekfac", "kfac"])
def test_mlp_streamed_low_rank_equals_truncated_reference(
    curvature: str, separate_bias: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = _mlp()
    train, query = _mlp_data()
    fitted = influence.fit(
        model,
        train,
        influence.supervised_task(nn.CrossEntropyLoss()),
        curvature=curvature,  # type: ignore[arg-type]
        damping=DAMPING,
        separate_bias=separate_bias,
    )
    made = _no_rows(monkeypatch)
    for rank in (1, 3):
        scores = fitted.pairwise_scores(query, train, rank=rank, progress=False)
        assert scores.shape == (7, 10)
        assert _relative(scores, _reference(fitted, model, _mlp_loss, query, train, rank)) < 1e-10
    # a rank at least every matrix's full rank: the exact scores
    full = fitted.pairwise_scores(query, train, rank=7, progress=False)
    assert made == []  # every query slice and training batch layer by layer
    exact = fitted.pairwise_scores(query, train, progress=False)
    assert _relative(full, exact) < 1e-10
    assert _relative(exact, _reference(fitted, model, _mlp_loss, query, train, None)) < 1e-10


@pytest.mark.parametrize("separate_bias", [True, False])
def test_gpt2_conv1d_streamed_low_rank_equals_truncated_reference(
    separate_bias: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = tiny_gpt2()
    train, query = _lm_data()
    fitted = influence.fit(
        model, train, influence.causal_lm_task(), damping=DAMPING, separate_bias=separate_bias
    )
    made = _no_rows(monkeypatch)
    for rank in (1, 2):
        scores = fitted.pairwise_scores(query, train, rank=rank, progress=False)
        assert _relative(scores, _reference(fitted, model, _lm_loss, query, train, rank)) < 1e-10
    full = fitted.pairwise_scores(query, train, rank=32, progress=False)  # c_fc: 8 x 32
    assert made == []
    exact = fitted.pairwise_scores(query, train, progress=False)
    assert _relative(full, exact) < 1e-10
    assert _relative(exact, _reference(fitted, model, _lm_loss, query, train, None)) < 1e-10


def test_vmap_model_low_rank_from_slices_of_rows_equals_reference(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # a Conv2d: no hooked layer; each query slice's rows are preconditioned and factored
    model = _Conv().double().eval()
    train, query = _conv_data()
    fitted = influence.fit(
        model, train, influence.supervised_task(nn.CrossEntropyLoss()), damping=DAMPING
    )
    made = _no_rows(monkeypatch)
    for rank in (1, 2):
        scores = fitted.pairwise_scores(query, train, rank=rank, progress=False)
        assert _relative(scores, _reference(fitted, model, _mlp_loss, query, train, rank)) < 1e-10
    assert made == [3, 3, 3] * 2  # the query slice's rows, then each training batch's


def test_examples_that_meet_in_the_forward_fall_back_to_vmap(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # the hooks' check, made without rows, must refuse this model: its hooked gradients are not
    # per-example gradients (vmap runs each example alone, as the reference)
    model = _Coupled().double().eval()
    train, query = _mlp_data()
    train = [(x[:, :4], y) for x, y in train]
    query = [(x[:, :4], y) for x, y in query]
    fitted = influence.fit(
        model, train, influence.supervised_task(nn.CrossEntropyLoss()), damping=DAMPING
    )
    made = _no_rows(monkeypatch)
    scores = fitted.pairwise_scores(query, train, rank=2, progress=False)
    assert made == [4, 1, 2, 4, 4, 2]  # rows of every query slice and training batch
    assert _relative(scores, _reference(fitted, model, _mlp_loss, query, train, 2)) < 1e-10


def test_exact_route_low_rank_scores_training_batches_by_layer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    model = _mlp()
    train, query = _mlp_data()
    fitted = influence.fit(
        model,
        train,
        influence.supervised_task(nn.CrossEntropyLoss()),
        curvature="ggn",
        damping=DAMPING,
        tol=1e-13,
        engine="autograd",
    )
    made = _no_rows(monkeypatch)
    scores = fitted.pairwise_scores(query, train, rank=2, progress=False)
    assert made == [4, 1, 2]  # the query slices' rows (one block solve); no training batch's
    assert _relative(scores, _reference(fitted, model, _mlp_loss, query, train, 2)) < 1e-10


# -- memory: no whole row formed ------------------------------------------------------------------
@pytest.mark.parametrize("model_name", ["mlp", "gpt2"])
def test_no_tensor_as_large_as_a_row_of_gradients(model_name: str) -> None:
    if model_name == "mlp":
        model: nn.Module = _mlp(width=16, hidden=6)  # more parameters than 4 of one layer
        train, query = _mlp_data()
        task = influence.supervised_task(nn.CrossEntropyLoss())
    else:
        model = tiny_gpt2()
        train, query = _lm_data()
        task = influence.causal_lm_task()
    fitted = influence.fit(model, train, task, damping=DAMPING)
    n = fitted.layout.size
    n_query = sum(len(b[1]) if isinstance(b, tuple) else len(b["input_ids"]) for b in query)
    with Allocations() as low:
        fitted.pairwise_scores(query, train, rank=2, progress=False)
    # the measure sees whole rows where they are made: the exact scores hold Q (n_query, n)
    with Allocations() as exact:
        fitted.pairwise_scores(query, train, progress=False)
    assert exact.numel >= n_query * n
    # no tensor of the low-rank scores as large as one example's whole gradient (n), let alone
    # the queries' rows (n_query, n) or a training batch's (B, n)
    assert low.numel < n, (low.numel, n)


# -- checkpoints ----------------------------------------------------------------------------------
def test_checkpoint_of_low_rank_scores_resumes_bit_for_bit(tmp_path: Path) -> None:
    model = tiny_gpt2()
    train, query = _lm_data()
    fitted = influence.fit(model, train, influence.causal_lm_task(), damping=DAMPING)
    unbroken = fitted.pairwise_scores(query, train, rank=2, progress=False)
    path = tmp_path / "scores.pt"
    with pytest.raises(KeyboardInterrupt):
        fitted.pairwise_scores(
            query, Interrupted(train, 2), rank=2, checkpoint=path, progress=False
        )
    assert path.exists()
    with pytest.raises(ValueError, match=r"other arguments.*rank"):  # another rank: refused
        fitted.pairwise_scores(query, train, rank=1, checkpoint=path, progress=False)
    other = [{k: v[:2] for k, v in query[0].items()}]
    with pytest.raises(ValueError, match=r"other arguments.*queries"):  # other queries
        fitted.pairwise_scores(other, train, rank=2, checkpoint=path, progress=False)
    resumed = fitted.pairwise_scores(query, train, rank=2, checkpoint=path, progress=False)
    assert torch.equal(resumed, unbroken)
    assert not path.exists()


# -- empty batches --------------------------------------------------------------------------------
def test_empty_query_and_training_batches() -> None:
    model = _mlp()
    train, query = _mlp_data()
    fitted = influence.fit(
        model, train, influence.supervised_task(nn.CrossEntropyLoss()), damping=DAMPING
    )
    none = [(query[0][0][:0], query[0][1][:0])]
    assert fitted.pairwise_scores(none, train, rank=2, progress=False).shape == (0, 10)
    expected = fitted.pairwise_scores(query, train, rank=2, progress=False)
    with_empty = fitted.pairwise_scores(
        none + query, [train[0], none[0], *train[1:]], rank=2, progress=False
    )
    assert _relative(with_empty, expected) < 1e-12
