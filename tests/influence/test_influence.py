"""hessian_eigenthings.influence against dense float64 references.

The references are built without the package: per-example gradients and the model output's
Jacobian from ``torch.autograd.functional.jacobian`` of a flat-parameter function, the loss's
output Hessian from ``torch.autograd.functional.hessian``, ``G = (1/N) Σ_n J_nᵀ H_n J_n``, and
``−g_qᵀ (G + λI)⁻¹ g_z`` by ``torch.linalg.solve``.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from hessian_eigenthings import influence
from tests.influence.tiny import Interrupted, tiny_gpt2

DAMPING = 1e-2


# -- models and data -------------------------------------------------------------------------------
def _mlp() -> tuple[nn.Module, list[Any], list[Any]]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3)).double().eval()
    X = torch.randn(13, 4, dtype=torch.float64)
    y = torch.randint(0, 3, (13,))
    train = [(X[:4], y[:4]), (X[4:8], y[4:8]), (X[8:10], y[8:10])]  # uneven batches
    query = [(X[10:], y[10:])]
    return model, train, query


def _gpt2(vocab: int = 11) -> nn.Module:
    return tiny_gpt2(vocab)


def _lm_data() -> tuple[list[dict[str, torch.Tensor]], list[dict[str, torch.Tensor]]]:
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, 11, (8, 5), generator=g)
    labels = ids.clone()
    labels[0, 2] = -100  # a token that does not count
    labels[3, 1:3] = -100
    train = [{"input_ids": ids[i : i + 3], "labels": labels[i : i + 3]} for i in range(0, 6, 3)]
    query = [{"input_ids": ids[6:], "labels": labels[6:]}]
    return train, query


# -- dense references ------------------------------------------------------------------------------
def _flat_fn(
    model: nn.Module, names: tuple[str, ...], fn: Callable[[nn.Module], torch.Tensor]
) -> tuple[Callable[[torch.Tensor], torch.Tensor], torch.Tensor]:
    params = dict(model.named_parameters())
    shapes = [params[n].shape for n in names]
    flat = torch.cat([params[n].detach().reshape(-1) for n in names])

    def f(v: torch.Tensor) -> torch.Tensor:
        parts = v.split([s.numel() for s in shapes])
        swapped = {n: p.view(s) for n, p, s in zip(names, parts, shapes, strict=True)}
        return torch.func.functional_call(
            _Call(model, fn), {f"m.{k}": t for k, t in swapped.items()}, ()
        )

    return f, flat


class _Call(nn.Module):
    def __init__(self, model: nn.Module, fn: Callable[[nn.Module], torch.Tensor]) -> None:
        super().__init__()
        self.m = model
        self.fn = fn

    def forward(self) -> torch.Tensor:
        return self.fn(self.m)


def _mlp_losses(batches: list[Any]) -> Callable[[nn.Module], torch.Tensor]:
    X = torch.cat([b[0] for b in batches])
    y = torch.cat([b[1] for b in batches])
    return lambda m: F.cross_entropy(m(X), y, reduction="none")


def _lm_losses(batches: list[dict[str, torch.Tensor]]) -> Callable[[nn.Module], torch.Tensor]:
    def losses(m: nn.Module) -> torch.Tensor:
        out = []
        for b in batches:
            logits = m(input_ids=b["input_ids"], use_cache=False).logits[:, :-1]
            tgt = b["labels"][:, 1:]
            ce = F.cross_entropy(
                logits.reshape(-1, logits.shape[-1]),
                tgt.reshape(-1),
                reduction="none",
                ignore_index=-100,
            )
            out.append(ce.view(tgt.shape).sum(1))
        return torch.cat(out)

    return losses


def _grads(
    model: nn.Module, names: tuple[str, ...], losses: Callable[[nn.Module], torch.Tensor]
) -> torch.Tensor:
    f, flat = _flat_fn(model, names, losses)
    return torch.autograd.functional.jacobian(f, flat)  # (N, n)


def _dense_ggn_mlp(model: nn.Module, names: tuple[str, ...], train: list[Any]) -> torch.Tensor:
    X = torch.cat([b[0] for b in train])
    y = torch.cat([b[1] for b in train])
    f, flat = _flat_fn(model, names, lambda m: m(X))
    J = torch.autograd.functional.jacobian(f, flat)  # (N, C, n)
    out = f(flat).detach()
    G = torch.zeros(flat.numel(), flat.numel(), dtype=torch.float64)
    for i in range(len(X)):
        H = torch.autograd.functional.hessian(lambda o, i=i: F.cross_entropy(o, y[i]), out[i])
        G += J[i].T @ H @ J[i]
    return G / len(X)


def _dense_ggn_lm(
    model: nn.Module, names: tuple[str, ...], train: list[dict[str, torch.Tensor]]
) -> torch.Tensor:
    n = sum(dict(model.named_parameters())[k].numel() for k in names)
    G = torch.zeros(n, n, dtype=torch.float64)
    N = 0
    for b in train:
        for i in range(b["input_ids"].shape[0]):
            ids, tgt = b["input_ids"][i : i + 1], b["labels"][i, 1:]
            f, flat = _flat_fn(
                model, names, lambda m, ids=ids: m(input_ids=ids, use_cache=False).logits[0, :-1]
            )
            J = torch.autograd.functional.jacobian(f, flat, vectorize=True).reshape(
                -1, n
            )  # (T-1·V, n)
            out = f(flat).detach()

            def seq_loss(o: torch.Tensor, tgt: torch.Tensor = tgt) -> torch.Tensor:
                return F.cross_entropy(o, tgt, reduction="sum", ignore_index=-100)

            H = torch.autograd.functional.hessian(seq_loss, out).reshape(J.shape[0], J.shape[0])
            G += J.T @ H @ J
            N += 1
    return G / N


def _dense_scores(C: torch.Tensor, gq: torch.Tensor, gt: torch.Tensor) -> torch.Tensor:
    M = C + DAMPING * torch.eye(C.shape[0], dtype=C.dtype)
    return -gq @ torch.linalg.solve(M, gt.T)


def _close(actual: torch.Tensor, expected: torch.Tensor, tol: float) -> None:
    scale = float(expected.abs().max())
    torch.testing.assert_close(actual, expected, rtol=tol, atol=tol * scale)


# -- the exact route ------------------------------------------------------------------------------
def test_exact_ggn_scores_equal_dense_influence_mlp() -> None:
    model, train, query = _mlp()
    task = influence.supervised_task(nn.CrossEntropyLoss())
    fitted = influence.fit(
        model, train, task, curvature="ggn", damping=DAMPING, tol=1e-13, engine="autograd"
    )
    scores = fitted.pairwise_scores(query, train, progress=False)
    names = fitted.layout.names
    G = _dense_ggn_mlp(model, names, train)
    expected = _dense_scores(
        G, _grads(model, names, _mlp_losses(query)), _grads(model, names, _mlp_losses(train))
    )
    assert scores.shape == (3, 10)
    _close(scores, expected, 1e-8)


def test_exact_ggn_scores_equal_dense_influence_tiny_lm() -> None:
    # per-sequence summed token loss, -100 labels left out, the tied head scored with both uses
    # (a few parameters and a larger damping, tol 1e-11: CG on the LM's GGN converges in few products)
    model = _gpt2()
    train, query = _lm_data()
    fitted = influence.fit(
        model,
        train,
        influence.causal_lm_task(),
        curvature="ggn",
        engine="autograd",
        damping=0.3,
        tol=1e-11,
        param_filter=["lm_head.weight", "transformer.h.0.attn.c_proj.*"],
    )
    assert fitted.layout.names[0] == "transformer.wte.weight"  # the tied head, its first name
    scores = fitted.pairwise_scores(query, train, progress=False)
    names = fitted.layout.names
    G = _dense_ggn_lm(model, names, train)
    gq, gt = _grads(model, names, _lm_losses(query)), _grads(model, names, _lm_losses(train))
    M = G + 0.3 * torch.eye(G.shape[0], dtype=G.dtype)
    _close(scores, -gq @ torch.linalg.solve(M, gt.T), 1e-8)


def test_damped_hessian_route_equals_dense_hessian_influence() -> None:
    model, train, query = _mlp()
    task = influence.supervised_task(nn.CrossEntropyLoss())
    fitted = influence.fit(
        model, train, task, curvature="hessian", damping=0.5, tol=1e-13, engine="autograd"
    )
    scores = fitted.pairwise_scores(query, train, progress=False)
    names = fitted.layout.names
    f, flat = _flat_fn(model, names, lambda m: _mlp_losses(train)(m).mean())
    H = torch.autograd.functional.hessian(f, flat)
    M = H + 0.5 * torch.eye(H.shape[0], dtype=H.dtype)
    gq, gt = _grads(model, names, _mlp_losses(query)), _grads(model, names, _mlp_losses(train))
    _close(scores, -gq @ torch.linalg.solve(M, gt.T), 1e-8)


# -- the Kronecker routes -------------------------------------------------------------------------
@pytest.mark.parametrize("separate_bias", [True, False])
@pytest.mark.parametrize("curvature", ["ekfac", "kfac"])
def test_kronecker_scores_equal_dense_operator_influence_mlp(
    curvature: str, separate_bias: bool
) -> None:
    model, train, query = _mlp()
    task = influence.supervised_task(nn.CrossEntropyLoss())
    fitted = influence.fit(
        model,
        train,
        task,
        curvature=curvature,  # type: ignore[arg-type]
        damping=DAMPING,
        separate_bias=separate_bias,
    )
    assert fitted.fisher_type == "type2"  # 3 classes
    scores = fitted.pairwise_scores(query, train, progress=False)
    names = fitted.layout.names
    K = fitted.operator.to_dense()
    expected = _dense_scores(
        K, _grads(model, names, _mlp_losses(query)), _grads(model, names, _mlp_losses(train))
    )
    _close(scores, expected, 1e-10)


@pytest.mark.parametrize("fisher_type", ["empirical", "mc"])
def test_ekfac_scores_equal_dense_operator_influence_tiny_lm(fisher_type: str) -> None:
    model = _gpt2()
    train, query = _lm_data()
    fitted = influence.fit(
        model,
        train,
        influence.causal_lm_task(),
        damping=DAMPING,
        fisher_type=fisher_type,  # type: ignore[arg-type]
    )
    assert isinstance(fitted.operator, influence.scores.EKFACOperator)
    # NOTE [EK-FAC keeps its eigenbases only]: KFAC's factors released, refused in one line
    with pytest.raises(ValueError, match="released by release_factors"):
        fitted.operator.factors  # noqa: B018 -- the read is the test
    # NOTE [tied heads]: the tied embedding/head is left out and named
    assert "transformer.wte.weight" not in fitted.layout.names
    assert any(e.startswith("transformer.wte.weight (tied") for e in fitted.excluded_parameters)
    scores = fitted.pairwise_scores(query, train, progress=False)
    names = fitted.layout.names
    K = fitted.operator.to_dense()
    expected = _dense_scores(
        K, _grads(model, names, _lm_losses(query)), _grads(model, names, _lm_losses(train))
    )
    _close(scores, expected, 1e-10)


def test_ekfac_of_the_lm_task_is_the_per_sequence_second_moment() -> None:
    # the empirical EK-FAC's diagonal in its eigenbasis is the mean over sequences of the squared
    # rotated per-sequence gradients of the summed loss (Kronfluence's Λ): the task's 1/B scale
    model = _gpt2()
    train, _ = _lm_data()
    fitted = influence.fit(
        model, train, influence.causal_lm_task(), damping=DAMPING, fisher_type="empirical"
    )
    names = fitted.layout.names
    g = _grads(model, names, _lm_losses(train))  # (N, n)
    K = fitted.operator.to_dense()
    eig = fitted.operator.eigh()  # type: ignore[attr-defined]
    b = 0
    V = fitted.operator.eigenvector(b, 0, 0)  # type: ignore[attr-defined]
    lam = eig.blocks[b].eigenvalues[0, 0]
    torch.testing.assert_close(V @ K @ V, lam, rtol=1e-10, atol=1e-14)
    torch.testing.assert_close((g @ V).square().mean(), lam, rtol=1e-10, atol=1e-14)


def test_default_fisher_type_is_mc_for_a_vocabulary() -> None:
    model = _gpt2(vocab=40)
    ids = torch.randint(0, 40, (4, 5), generator=torch.Generator().manual_seed(0))
    train = [{"input_ids": ids}]
    fitted = influence.fit(model, train, influence.causal_lm_task())
    assert fitted.fisher_type == "mc"
    assert fitted.damping > 0  # the default: 0.1 · the mean eigenvalue
    torch.testing.assert_close(
        torch.tensor(fitted.damping, dtype=torch.float64),
        0.1 * fitted.operator.trace() / fitted.operator.size,  # type: ignore[attr-defined]
    )


# -- self-influence, low rank, top_k --------------------------------------------------------------
@pytest.mark.parametrize("curvature", ["ekfac", "ggn"])
def test_self_influence_is_the_diagonal_of_train_train_scores(curvature: str) -> None:
    model, train, _ = _mlp()
    task = influence.supervised_task(nn.CrossEntropyLoss())
    fitted = influence.fit(
        model,
        train,
        task,
        curvature=curvature,
        damping=DAMPING,
        tol=1e-13,
        engine="autograd" if curvature == "ggn" else "auto",
    )  # type: ignore[arg-type]
    pairwise = fitted.pairwise_scores(train, train, progress=False)
    own = fitted.self_influence(train, progress=False)
    assert own.shape == (10,)
    _close(own, pairwise.diagonal(), 1e-10)
    assert bool((own < 0).all())  # C + λI positive definite: −gᵀ(C + λI)⁻¹g < 0


def test_low_rank_at_full_rank_equals_exact_and_rank_one_truncates() -> None:
    model, train, query = _mlp()
    task = influence.supervised_task(nn.CrossEntropyLoss())
    fitted = influence.fit(model, train, task, damping=DAMPING)
    exact = fitted.pairwise_scores(query, train, progress=False)
    _close(fitted.pairwise_scores(query, train, rank=6, progress=False), exact, 1e-12)
    # rank 1: each preconditioned weight gradient replaced by its best rank-1 approximation
    P = fitted.query_gradients(query)
    parts = []
    for view, shape in zip(fitted.layout.split_rows(P), fitted.layout.shapes, strict=True):
        if len(shape) == 2:
            U, S, Vh = torch.linalg.svd(view)
            view = S[:, :1, None] * U[:, :, :1] @ Vh[:, :1, :]
        parts.append(view.reshape(P.shape[0], -1))
    gt = torch.cat([fitted.gradients(b) for b in train])
    _close(
        fitted.pairwise_scores(query, train, rank=1, progress=False),
        -torch.cat(parts, 1) @ gt.T,
        1e-12,
    )


class _Tokenizer:
    def __len__(self) -> int:
        return 11

    def decode(self, ids: list[int]) -> str:
        return " ".join(f"t{i}" for i in ids)


def test_top_k_against_a_sort_with_text() -> None:
    g = torch.Generator().manual_seed(0)
    scores = torch.randn(3, 6, generator=g, dtype=torch.float64)
    scores[1, 4] = scores[1, 2]  # a tie: the lower index first
    top = influence.top_k(scores, 2)
    for q in range(3):
        order = sorted(range(6), key=lambda j: (-float(scores[q, j]), j))
        assert top.positive_indices[q].tolist() == order[:2]
        order = sorted(range(6), key=lambda j: (float(scores[q, j]), j))
        assert top.negative_indices[q].tolist() == order[:2]
        assert top.positive_scores[q].tolist() == scores[q, top.positive_indices[q]].tolist()
    train, _ = _lm_data()
    top = influence.top_k(scores, 1, train_data=train, tokenizer=_Tokenizer())
    j = int(top.positive_indices[0, 0])
    row = torch.cat([b["input_ids"] for b in train])[j]
    assert top.positive_texts is not None and top.positive_texts[0][0] == " ".join(
        f"t{i}" for i in row.tolist()
    )
    assert "query 2:" in str(top)
    # a vector (self-influence) is one query
    assert influence.top_k(scores[0], 2).positive_indices.shape == (1, 2)


# -- checkpoints ----------------------------------------------------------------------------------
def test_checkpoint_resume_equals_unbroken_run_bit_for_bit(tmp_path: Path) -> None:
    model, train, query = _mlp()
    task = influence.supervised_task(nn.CrossEntropyLoss())
    fitted = influence.fit(model, train, task, damping=DAMPING)
    unbroken = fitted.pairwise_scores(query, train, progress=False)
    path = tmp_path / "scores.pt"
    with pytest.raises(KeyboardInterrupt):
        fitted.pairwise_scores(query, Interrupted(train, 2), checkpoint=path, progress=False)
    assert path.exists()
    # other queries: the file is refused, naming why
    with pytest.raises(ValueError, match=r"other arguments.*queries"):
        fitted.pairwise_scores([train[0]], train, checkpoint=path, progress=False)
    resumed = fitted.pairwise_scores(query, train, checkpoint=path, progress=False)
    assert torch.equal(resumed, unbroken)
    assert not path.exists()  # complete: removed


# -- the model is left as it was; vmap and the loop agree ------------------------------------------
def test_model_left_exactly_as_found_and_loop_equals_vmap() -> None:
    model, train, query = _mlp()
    model[0].weight.grad = torch.ones_like(model[0].weight)
    model[2].bias.requires_grad_(False)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    task = influence.supervised_task(nn.CrossEntropyLoss())
    fitted = influence.fit(model, train, task, param_filter=["0.weight", "2.bias"], damping=DAMPING)
    scores = fitted.pairwise_scores(query, train, progress=False)
    fitted.self_influence(train, progress=False)
    assert fitted.layout.names == ("0.weight", "2.bias")
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n])
    assert torch.equal(model[0].weight.grad, torch.ones_like(model[0].weight))
    assert model[2].weight.grad is None
    assert not model[2].bias.requires_grad and model[0].bias.requires_grad
    assert not any(m.training for m in model.modules())
    vmapped = fitted.gradients(train[0])
    fitted._grads.vmap_works = False  # the loop every model can run
    torch.testing.assert_close(fitted.gradients(train[0]), vmapped, rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(
        fitted.pairwise_scores(query, train, progress=False), scores, rtol=1e-12, atol=1e-15
    )


# -- misuse: one clear line each ------------------------------------------------------------------
def _one_line(exc: pytest.ExceptionInfo[BaseException]) -> str:
    text = str(exc.value)
    assert "\n" not in text
    return text


def test_misuse_training_mode_and_empty_data() -> None:
    model, train, query = _mlp()
    task = influence.supervised_task(nn.CrossEntropyLoss())
    model.train()
    with pytest.raises(ValueError, match=r"training mode.*model\.eval\(\)") as exc:
        influence.fit(model, train, task, damping=DAMPING)
    _one_line(exc)
    model.eval()
    with pytest.raises(ValueError, match="train_data has no examples") as exc:
        influence.fit(model, [], task, damping=DAMPING)
    _one_line(exc)
    fitted = influence.fit(model, train, task, damping=DAMPING)
    with pytest.raises(ValueError, match="train_data has no examples"):
        fitted.pairwise_scores(query, [], progress=False)
    with pytest.raises(ValueError, match="query_data has no examples"):
        fitted.pairwise_scores([], train, progress=False)
    with pytest.raises(TypeError, match="one batch"):
        fitted.pairwise_scores(query[0], train, progress=False)
    model.train()  # switched to training after fitting: refused at scoring too
    with pytest.raises(ValueError, match="training mode"):
        fitted.pairwise_scores(query, train, progress=False)


def test_misuse_language_model_batches() -> None:
    model = _gpt2()
    train, query = _lm_data()
    task = influence.causal_lm_task()
    silent = [
        {"input_ids": train[0]["input_ids"], "labels": torch.full_like(train[0]["labels"], -100)}
    ]
    with pytest.raises(ValueError, match=r"no token that counts \(every label -100") as exc:
        influence.fit(model, silent, task, damping=DAMPING)
    _one_line(exc)
    fitted = influence.fit(model, train, task, damping=DAMPING, fisher_type="empirical")
    with pytest.raises(ValueError, match="query_data batch 0: sequences"):
        fitted.pairwise_scores(silent, train, progress=False)
    other = [{"input_ids": query[0]["input_ids"] + 20}]  # ids of a larger vocabulary
    with pytest.raises(ValueError, match="another tokenizer") as exc:
        fitted.pairwise_scores(other, train, progress=False)
    _one_line(exc)
    # a query of another length than the training sequences is fine: scores are per sequence
    longer = [
        {"input_ids": torch.randint(0, 11, (2, 7), generator=torch.Generator().manual_seed(5))}
    ]
    assert fitted.pairwise_scores(longer, train, progress=False).shape == (2, 6)

    class Small(_Tokenizer):
        def __len__(self) -> int:
            return 5

    scores = torch.zeros(1, 6)
    with pytest.raises(ValueError, match="another tokenizer"):
        influence.top_k(scores, 2, train_data=train, tokenizer=Small())


def test_misuse_options() -> None:
    model, train, query = _mlp()
    task = influence.supervised_task(nn.CrossEntropyLoss())
    with pytest.raises(ValueError, match="needs damping"):
        influence.fit(model, train, task, curvature="ggn")
    with pytest.raises(ValueError, match="curvature must be one of"):
        influence.fit(model, train, task, curvature="fisher", damping=DAMPING)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="task must be an influence task"):
        influence.fit(model, train, nn.CrossEntropyLoss(), damping=DAMPING)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="reduction='mean'"):
        influence.supervised_task(nn.CrossEntropyLoss(reduction="sum"))
    with pytest.raises(ValueError, match="k=11 but there are 10"):
        influence.top_k(torch.zeros(2, 10), 11)
    fitted = influence.fit(model, train, task, damping=DAMPING)
    with pytest.raises(ValueError, match="rank must be"):
        fitted.pairwise_scores(query, train, rank=0, progress=False)


def test_tied_head_selected_explicitly_is_refused_for_kronecker() -> None:
    model = _gpt2()
    train, _ = _lm_data()
    with pytest.raises(ValueError, match="tied") as exc:
        influence.fit(
            model,
            train,
            influence.causal_lm_task(),
            param_filter=["lm_head.weight"],
            fisher_type="empirical",
        )
    _one_line(exc)
