"""Influence on a model sharded with FSDP2 (NOTE [influence on sharded ranks]): each rank fits on
its own shard with ``ranks=Sharded(model)`` and scores its shard; the scores are the columns of
one process's scores on the union (EK-FAC and K-FAC; pairwise, self-influence, low-rank and
token scores, top-k), on 2 and 3 gloo ranks, float64, one launch per rank count; the misuses are
refused in one line on every rank."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

from hessian_eigenthings import _torch_compat
from tests.launch import launch_ranks

HERE = Path(__file__).parent

pytestmark = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available() and _torch_compat.fsdp2_runs_on_cpu()),
    reason="needs torch.distributed, gloo, and FSDP2 on the CPU (torch >= 2.6)",
)


@pytest.fixture(scope="module", params=[2, 3], ids=["world2", "world3"])
def ranks(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    pytest.importorskip("transformers")
    out = tmp_path_factory.mktemp(f"fsdp_influence_{request.param}")
    return launch_ranks(HERE / "_fsdp_worker.py", request.param, out)


def results(ranks: list[dict[str, Any]], name: str) -> list[dict[str, Any]]:
    found = []
    for rank, res in enumerate(ranks):
        assert "error" not in res[name], f"rank {rank}, {name}: {res[name].get('traceback')}"
        found.append(res[name])
    return found


@pytest.mark.parametrize("curvature", ["ekfac", "kfac"])
def test_ranks_score_their_shards_as_one_process_on_the_union(
    ranks: list[dict[str, Any]], curvature: str
) -> None:
    columns = 0
    for rank, res in enumerate(results(ranks, curvature)):
        # the same factors summed in another order: rounding only (float64)
        for key in ("scores", "gathered", "self", "damping"):
            assert res[key] <= 1e-12, (rank, curvature, key, res)
        assert res["shape"] == [4, res["columns"]], (rank, res)
        assert res["fisher_type"] == ["type2", "type2"]
        assert res["same_parameters"] and res["top_k_same"] and res["model_untouched"], res
        if curvature == "ekfac":
            assert res["low_rank"] <= 1e-12 and res["tokens"] <= 1e-12, (rank, res)
        columns += res["columns"]
    assert columns == 4 * len(ranks)  # every training example scored once, on its own rank


def one_line(found: dict[str, Any], kind: str, words: str) -> None:
    assert found["type"] == kind, found
    assert words in found["message"] and "\n" not in found["message"], found


def test_misuses_are_refused_on_every_rank(ranks: list[dict[str, Any]]) -> None:
    for rank, res in enumerate(results(ranks, "misuse")):
        one_line(res["not_sharded"], "TypeError", "not sharded with fully_shard (FSDP2)")
        one_line(res["exact_route"], "ValueError", "runs on the Kronecker routes")
        for given in ("replicated_ranks", "no_ranks"):
            one_line(res[given], "TypeError", "pass ranks=Sharded(model)")
        one_line(res["conv2d"], "ValueError", "'0.weight' (a Conv2d's weight) would need vmap")
        for unhookable in ("examples_meet", "used_outside_its_layer"):
            one_line(res[unhookable], "ValueError", "differ from gradients of examples taken alone")
        one_line(res["queries_differ"], "ValueError", "query_data batch 0 differs across ranks")
        one_line(res["batch_counts_differ"], "ValueError", "at batch 2 the ranks differ")
        # a failure of one rank raises there and on every other rank, which names it
        bad, empty = res["one_rank_bad_token"], res["one_rank_empty_shard"]
        if rank == 1:
            one_line(bad, "ValueError", "token id 99 is outside the model's 11 embeddings")
        else:
            one_line(bad, "DistributedProductError", "rank 1 of")
        if rank == 0:
            one_line(empty, "ValueError", "train_data has no examples")
        else:
            one_line(empty, "DistributedProductError", "rank 0 of")
        # and the model scores as before afterwards (FSDP's state intact)
        assert res["scores_after"] == 0.0, (rank, res["scores_after"])


def test_checkpoints_resume_on_every_rank(ranks: list[dict[str, Any]]) -> None:
    for rank, res in enumerate(results(ranks, "checkpoint")):
        one_line(res["interrupted"], "RuntimeError", "interrupted")
        assert res["saved"] and res["bit_for_bit"] and res["removed_when_complete"], (rank, res)
        one_line(res["mismatch"], "ValueError", "the ranks differ in the training batches")
