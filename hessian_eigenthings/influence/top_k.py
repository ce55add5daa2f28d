"""The most influential training examples of each query, with their text when a tokenizer is
given. Signs follow NOTE [influence sign] in ``influence.scores``: positive scores raise the
query's loss (harmful), negative ones lower it (helpful)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from hessian_eigenthings.batching import Batch

__all__ = ["TopInfluences", "top_k"]


@dataclass(frozen=True)
class TopInfluences:
    """Per query, the ``k`` training examples of largest and of smallest score, in order."""

    positive_indices: torch.Tensor  # (n_query, k) largest scores first: raise the query's loss
    positive_scores: torch.Tensor  # (n_query, k)
    negative_indices: torch.Tensor  # (n_query, k) smallest scores first: lower the query's loss
    negative_scores: torch.Tensor  # (n_query, k)
    positive_texts: tuple[tuple[str, ...], ...] | None = None  # (n_query, k) with a tokenizer
    negative_texts: tuple[tuple[str, ...], ...] | None = None

    def __str__(self) -> str:
        lines = []
        for q in range(self.positive_indices.shape[0]):
            lines.append(f"query {q}:")
            for label, idx, val, texts in (
                (
                    "lowers its loss (helpful)",
                    self.negative_indices,
                    self.negative_scores,
                    self.negative_texts,
                ),
                (
                    "raises its loss (harmful)",
                    self.positive_indices,
                    self.positive_scores,
                    self.positive_texts,
                ),
            ):
                lines.append(f"  {label}:")
                for j in range(idx.shape[1]):
                    text = f"  {texts[q][j]!r}" if texts is not None else ""
                    lines.append(f"    #{int(idx[q, j])}  {float(val[q, j]):+.4g}{text}")
        return "\n".join(lines)


def top_k(
    scores: torch.Tensor,
    k: int,
    *,
    train_data: Iterable[Batch] | None = None,
    tokenizer: Any = None,
) -> TopInfluences:
    """The ``k`` most positive and ``k`` most negative training examples of each query.

    ``scores``: ``(n_query, n_train)`` of ``Influence.pairwise_scores`` (a vector ``(n_train,)``,
    self-influence, counts as one query). Ties keep the lower index first. With ``tokenizer``
    (anything with ``decode(ids)``) and ``train_data`` (the batches scored, in the same order;
    ``input_ids`` in a mapping, or a tensor of token ids), the chosen examples' text too
    (padding left out where an ``attention_mask`` says so).
    """
    if not isinstance(scores, torch.Tensor) or scores.dim() not in (1, 2):
        raise ValueError(
            "scores must be a tensor (n_query, n_train) or (n_train,), got "
            f"{tuple(scores.shape) if isinstance(scores, torch.Tensor) else type(scores).__name__}"
        )
    S = scores.unsqueeze(0) if scores.dim() == 1 else scores
    n = S.shape[1]
    if not isinstance(k, int) or isinstance(k, bool) or k < 1:
        raise ValueError(f"k must be an integer >= 1, got {k!r}")
    if k > n:
        raise ValueError(f"k={k} but there are {n} training examples; pass k <= {n}")
    if bool(S.isnan().any()):
        raise ValueError("scores hold NaN; they cannot be ranked (check the damping and the data)")
    order = torch.sort(S, dim=1, descending=True, stable=True).indices
    pos = order[:, :k]
    neg = torch.sort(S, dim=1, stable=True).indices[:, :k]
    pos_texts = neg_texts = None
    if tokenizer is not None:
        if train_data is None:
            raise ValueError("a tokenizer needs train_data (the batches scored) to show their text")
        texts = _texts(train_data, tokenizer, n)
        pos_texts = tuple(tuple(texts[int(i)] for i in row) for row in pos)
        neg_texts = tuple(tuple(texts[int(i)] for i in row) for row in neg)
    return TopInfluences(pos, S.gather(1, pos), neg, S.gather(1, neg), pos_texts, neg_texts)


def _ids(batch: Batch) -> tuple[torch.Tensor, torch.Tensor | None]:
    if isinstance(batch, torch.Tensor):
        return batch, None
    if hasattr(batch, "keys") and "input_ids" in batch.keys():
        mask = batch["attention_mask"] if "attention_mask" in batch.keys() else None
        return batch["input_ids"], mask
    if isinstance(batch, (tuple, list)) and batch and isinstance(batch[0], torch.Tensor):
        return batch[0], None
    raise TypeError(
        f"top_k reads token ids from batches that are tensors, mappings with input_ids or "
        f"(ids, ...) tuples; got {type(batch).__name__}"
    )


def _texts(data: Iterable[Batch], tokenizer: Any, n: int) -> list[str]:
    size = len(tokenizer) if hasattr(tokenizer, "__len__") else None
    out: list[str] = []
    for batch in data:
        ids, mask = _ids(batch)
        if size is not None and ids.numel() and int(ids.max()) >= size:
            raise ValueError(
                f"token id {int(ids.max())} is outside the tokenizer's {size} tokens: the scored "
                "batches were made with another tokenizer"
            )
        for i in range(ids.shape[0]):
            row = ids[i] if mask is None else ids[i][mask[i].bool()]
            out.append(str(tokenizer.decode(row.tolist())))
    if len(out) != n:
        raise ValueError(
            f"train_data has {len(out)} examples but the scores have {n}: pass the batches scored"
        )
    return out
