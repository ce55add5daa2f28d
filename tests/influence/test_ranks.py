"""Influence on several ranks (NOTE [influence on several ranks]): each rank fits on its own
shard with replicated ranks and scores its shard; the scores are the columns of one process's
scores on the union (EK-FAC, K-FAC, exact GGN), on 2 and 3 gloo ranks. float64."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch.distributed as dist

from tests.launch import launch_ranks

HERE = Path(__file__).parent


@pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()), reason="needs torch.distributed, gloo"
)
@pytest.mark.parametrize("world", [2, 3])
def test_ranks_score_their_shards_as_one_process_on_the_union(world: int, tmp_path: Path) -> None:
    results = launch_ranks(HERE / "_ddp_worker.py", world, tmp_path)
    columns = 0
    for rank, res in enumerate(results):
        for route, check in res.items():
            assert "error" not in check, f"rank {rank}, {route}: {check.get('traceback')}"
            tol = 1e-7 if route == "ggn" else 1e-10  # CG to 1e-12 against Kronecker's exact inverse
            assert check["scores"] <= tol, (rank, route, check)
            assert check["self"] <= tol, (rank, route, check)
            assert check["damping"] <= 1e-12, (rank, route, check)
            assert check["shape"] == [4, check["columns"]], (rank, route)
        columns += results[rank]["ekfac"]["columns"]
    assert columns == 19  # every training example scored once, on its own rank
