"""One rank of the data-parallel influence test (run by tests/influence/test_ranks.py).

Usage: ``python _ddp_worker.py OUT_DIR`` with RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT set.
Every rank builds the same float64 MLP and data; rank ``r`` fits on its own uneven shard of the
training batches with ``ranks=Replicated()`` and scores the same queries against its shard; the
reference is one process fitted on the union of the shards, computed on each rank. Writes
``OUT_DIR/rank{r}.json``: the largest differences per curvature route.
"""

from __future__ import annotations

import datetime
import functools
import os
import sys
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from hessian_eigenthings import influence
from hessian_eigenthings.operators.distributed import Replicated
from tests.operators._dist_checks import run_checks_and_exit

RANK = int(os.environ["RANK"])
WORLD = int(os.environ["WORLD_SIZE"])


def data() -> tuple[list[Any], list[Any], list[list[Any]]]:
    g = torch.Generator().manual_seed(3)
    X = torch.randn(23, 4, generator=g, dtype=torch.float64)
    y = torch.randint(0, 3, (23,), generator=g)
    batches = [(X[a:b], y[a:b]) for a, b in [(0, 4), (4, 9), (9, 11), (11, 14), (14, 19)]]
    cuts = {2: [0, 2, 5], 3: [0, 2, 4, 5]}[WORLD]  # contiguous, uneven shards
    shards = [batches[cuts[r] : cuts[r + 1]] for r in range(WORLD)]
    return batches, [(X[19:], y[19:])], shards


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3)).double().eval()


def check(curvature: str, damping: float | None) -> dict[str, Any]:
    train, query, shards = data()
    task = influence.supervised_task(nn.CrossEntropyLoss())
    mine = shards[RANK]
    ref = influence.fit(model(), train, task, curvature=curvature, damping=damping, tol=1e-12)
    fitted = influence.fit(
        model(), mine, task, curvature=curvature, damping=damping, tol=1e-12, ranks=Replicated()
    )
    start = sum(len(b[1]) for r in range(RANK) for b in shards[r])
    stop = start + sum(len(b[1]) for b in mine)
    expected = ref.pairwise_scores(query, train, progress=False)[:, start:stop]
    got = fitted.pairwise_scores(query, mine, progress=False)
    if curvature == "ggn":  # one solve per training example: refused on several ranks
        try:
            fitted.self_influence(mine, progress=False)
            self_error = float("inf")
        except ValueError as exc:
            self_error = 0.0 if "Kronecker routes" in str(exc) else float("inf")
    else:
        own_self = fitted.self_influence(mine, progress=False)
        ref_self = ref.self_influence(train, progress=False)[start:stop]
        self_error = float((own_self - ref_self).abs().max() / ref_self.abs().max())
    scale = float(expected.abs().max())
    return {
        "scores": float((got - expected).abs().max()) / scale,
        "self": self_error,
        "damping": abs(fitted.damping - ref.damping) / ref.damping,
        "shape": list(got.shape),
        "columns": stop - start,
    }


def main() -> None:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    checks = {
        curvature: functools.partial(check, curvature, damping)
        for curvature, damping in [("ekfac", None), ("kfac", None), ("ggn", 1e-2)]
    }
    run_checks_and_exit(checks, checks, sys.argv[1], RANK)


if __name__ == "__main__":
    main()
