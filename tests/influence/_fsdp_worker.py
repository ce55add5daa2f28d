"""One rank of the sharded influence test (run by tests/influence/test_fsdp.py).

Usage: ``python _fsdp_worker.py OUT_DIR`` with RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT set.
Every rank builds the same float64 one-layer GPT-2, shards it with FSDP2 (gloo, CPU), fits
influence on its own shard of the training batches (two batches of uneven sizes) with
``ranks=Sharded(model)`` and scores the same queries against its shard; the reference is one
process fitted on the union of the shards (an unsharded copy of the model), computed on every
rank. Then the misuses, each refused on every rank. Writes ``OUT_DIR/rank{r}.json``: per check its
numbers or the exception it raised.
"""

from __future__ import annotations

import datetime
import os
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from hessian_eigenthings import _torch_compat, influence
from hessian_eigenthings.operators.distributed import Replicated, Sharded
from tests.influence.tiny import tiny_gpt2
from tests.operators._dist_checks import run_checks_and_exit

RANK = int(os.environ["RANK"])
WORLD = int(os.environ["WORLD_SIZE"])
TASK = influence.causal_lm_task()
#: two training batches per rank, of uneven sizes (their counts must agree: FSDP's collectives)
SIZES = [[3, 1], [2, 2], [1, 3]][:WORLD]

CHECKS: dict[str, Callable[[], dict[str, Any]]] = {}


def check(fn: Callable[[], dict[str, Any]]) -> Callable[[], dict[str, Any]]:
    CHECKS[fn.__name__] = fn
    return fn


def sharded_gpt2() -> nn.Module:
    """The tiny GPT-2, its block and its root each an FSDP module (tied head in the root)."""
    model = tiny_gpt2()
    fully_shard = _torch_compat.fully_shard()
    for block in model.transformer.h:  # type: ignore[union-attr]
        fully_shard(block)
    fully_shard(model)
    return model


def sequences(n: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 11, (n, 6), generator=g)
    labels = ids.clone()
    labels[:, -1] = -100  # a label left out
    return {"input_ids": ids, "labels": labels}


def shards() -> list[list[dict[str, torch.Tensor]]]:
    return [[sequences(b, 10 * r + i) for i, b in enumerate(s)] for r, s in enumerate(SIZES)]


MINE = shards()[RANK]
UNION = [b for shard in shards() for b in shard]  # rank after rank, as the columns
START = sum(SIZES[r][i] for r in range(RANK) for i in range(2))
STOP = START + sum(SIZES[RANK])
QUERIES = [sequences(3, 99), sequences(1, 98)]  # the first sliced by the smallest first batch


def relative(got: torch.Tensor, expected: torch.Tensor) -> float:
    return float((got - expected).abs().max() / expected.abs().max())


def gathered(columns: torch.Tensor) -> torch.Tensor:
    """Every rank's columns, rank after rank."""
    parts: list[Any] = [None] * WORLD
    dist.all_gather_object(parts, columns)
    return torch.cat(parts, dim=-1)


FITTED: dict[str, Any] = {}


def route(curvature: str) -> dict[str, Any]:
    ref = influence.fit(tiny_gpt2(), UNION, TASK, curvature=curvature)
    model = sharded_gpt2()
    before = {n: p.to_local().clone() for n, p in model.named_parameters()}  # type: ignore[operator]
    fitted = influence.fit(model, MINE, TASK, curvature=curvature, ranks=Sharded(model))
    FITTED[curvature] = fitted
    expected = ref.pairwise_scores(QUERIES, UNION, progress=False)
    got = fitted.pairwise_scores(QUERIES, MINE, progress=False)
    own_self = fitted.self_influence(MINE, progress=False)
    ref_self = ref.self_influence(UNION, progress=False)
    everyone = gathered(got)
    top, ref_top = influence.top_k(everyone, 3), influence.top_k(expected, 3)
    result = {
        "scores": relative(got, expected[:, START:STOP]),
        "gathered": relative(everyone, expected),
        "self": relative(own_self, ref_self[START:STOP]),
        "damping": abs(fitted.damping - ref.damping) / ref.damping,
        "shape": list(got.shape),
        "columns": STOP - START,
        "fisher_type": [fitted.fisher_type, ref.fisher_type],
        "same_parameters": fitted.layout.names == ref.layout.names
        and fitted.excluded_parameters == ref.excluded_parameters,
        "top_k_same": bool(
            torch.equal(top.positive_indices, ref_top.positive_indices)
            and torch.equal(top.negative_indices, ref_top.negative_indices)
        ),
        # the model as it was: parameters sharded again, unchanged, no .grad
        "model_untouched": all(
            type(p).__name__ == "DTensor"
            and p.grad is None
            and torch.equal(p.to_local(), before[n])  # type: ignore[operator]
            for n, p in model.named_parameters()
        ),
    }
    if curvature == "ekfac":
        low = fitted.pairwise_scores(QUERIES, MINE, rank=2, progress=False)
        result["low_rank"] = relative(
            low, ref.pairwise_scores(QUERIES, UNION, rank=2, progress=False)[:, START:STOP]
        )
        tokens = fitted.token_scores(QUERIES, MINE, progress=False)
        ref_tokens = ref.token_scores(QUERIES, UNION, progress=False)
        result["tokens"] = relative(tokens, ref_tokens[:, START:STOP])
    return result


@check
def ekfac() -> dict[str, Any]:
    return route("ekfac")


@check
def kfac() -> dict[str, Any]:
    return route("kfac")


def refused(run: Callable[[], Any]) -> dict[str, Any]:
    """The exception ``run()`` raised on this rank (its type and message)."""
    try:
        run()
    except Exception as exc:
        return {"type": type(exc).__name__, "message": str(exc)}
    return {"type": None, "message": ""}


@check
def misuse() -> dict[str, Any]:
    model = sharded_gpt2()
    fitted = FITTED["ekfac"]
    wrong_rank_queries = QUERIES if RANK else [sequences(3, 97), QUERIES[1]]
    extra = [*MINE, sequences(2, 55)] if RANK == 0 else MINE
    bad_token = [dict(b) for b in MINE]
    if RANK == 1:
        bad_token[1] = {"input_ids": torch.full((2, 6), 99)}
    results = {
        "not_sharded": refused(
            lambda: influence.fit(tiny_gpt2(), MINE, TASK, ranks=Sharded(sharded_gpt2()))
        ),
        "exact_route": refused(
            lambda: influence.fit(
                model, MINE, TASK, curvature="ggn", damping=1e-2, ranks=Sharded(model)
            )
        ),
        "replicated_ranks": refused(lambda: influence.fit(model, MINE, TASK, ranks=Replicated())),
        "no_ranks": refused(lambda: influence.fit(model, MINE, TASK)),
        "conv2d": refused(conv_fit),
        "examples_meet": refused(lambda: unhookable_scores(outside=False)),
        "used_outside_its_layer": refused(lambda: unhookable_scores(outside=True)),
        "queries_differ": refused(lambda: fitted.pairwise_scores(wrong_rank_queries, MINE)),
        "batch_counts_differ": refused(lambda: fitted.self_influence(extra, progress=False)),
        "one_rank_bad_token": refused(lambda: fitted.pairwise_scores(QUERIES, bad_token)),
        "one_rank_empty_shard": refused(
            lambda: influence.fit(model, MINE if RANK else [], TASK, ranks=Sharded(model))
        ),
    }
    # the model still scores as before after every refusal
    again = fitted.pairwise_scores(QUERIES, MINE, progress=False)
    results["scores_after"] = relative(again, FITTED["ekfac_scores"])
    return results


def conv_fit() -> Any:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(1, 2, 3), nn.Flatten(), nn.Linear(8, 3)).double().eval()
    _torch_compat.fully_shard()(net)
    g = torch.Generator().manual_seed(RANK)
    data = [(torch.randn(4, 1, 4, 4, generator=g, dtype=torch.float64), torch.tensor([0, 1, 2, 0]))]
    task = influence.supervised_task(nn.CrossEntropyLoss())
    return influence.fit(net, data, task, ranks=Sharded(net))


class Unhookable(nn.Module):
    """Per-example gradients the layers' hooks cannot give: the examples meet (a batch mean), or
    a layer's weight is used outside the layer too."""

    def __init__(self, outside: bool) -> None:
        super().__init__()
        self.a, self.b, self.outside = nn.Linear(4, 5), nn.Linear(5, 3), outside

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        if self.outside:
            return self.b(h) + (x @ self.a.weight.T)[:, :3]
        return self.b(h - h.mean(0, keepdim=True))


def unhookable_scores(outside: bool) -> Any:
    torch.manual_seed(0)
    net = Unhookable(outside).double().eval()
    _torch_compat.fully_shard()(net)
    g = torch.Generator().manual_seed(RANK)
    data = [(torch.randn(3, 4, generator=g, dtype=torch.float64), torch.tensor([0, 1, 2]))]
    task = influence.supervised_task(nn.CrossEntropyLoss())
    return influence.fit(net, data, task, ranks=Sharded(net)).self_influence(data, progress=False)


@check
def ekfac_scores_kept() -> dict[str, Any]:
    """The sharded EK-FAC scores, kept for ``misuse``'s check after the refusals."""
    FITTED["ekfac_scores"] = FITTED["ekfac"].pairwise_scores(QUERIES, MINE, progress=False)
    return {}


class Interrupted:
    """This rank's shard, interrupted after its first batch (a failure reading the second)."""

    def __iter__(self) -> Any:
        yield MINE[0]
        raise RuntimeError("interrupted")


@check
def checkpoint() -> dict[str, Any]:
    """A checkpoint on every rank resumes bit for bit; ranks whose checkpoints hold different
    batches are refused (they would skip different batches)."""
    fitted = FITTED["ekfac"]
    path = os.path.join(sys.argv[1], f"scores{RANK}.pt")

    def broken() -> dict[str, Any]:
        return refused(
            lambda: fitted.pairwise_scores(QUERIES, Interrupted(), checkpoint=path, progress=False)
        )

    interrupted = broken()
    saved = os.path.exists(path)
    resumed = fitted.pairwise_scores(QUERIES, MINE, checkpoint=path, progress=False)
    removed = not os.path.exists(path)  # the scores complete
    broken()
    if RANK == 0:
        os.remove(path)
    mismatch = refused(lambda: fitted.pairwise_scores(QUERIES, MINE, checkpoint=path))
    if os.path.exists(path):
        os.remove(path)
    return {
        "interrupted": interrupted,
        "saved": saved,
        "bit_for_bit": torch.equal(resumed, FITTED["ekfac_scores"]),
        "removed_when_complete": removed,
        "mismatch": mismatch,
    }


def main() -> None:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    names = ["ekfac", "kfac", "ekfac_scores_kept", "checkpoint", "misuse"]
    run_checks_and_exit(CHECKS, names, sys.argv[1], RANK)


if __name__ == "__main__":
    main()
