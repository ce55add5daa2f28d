"""FSDPKFACOperator and FSDPEKFACOperator against the single-process operators, in real process
groups (2 and 3 ranks, gloo on CPU, float64).

Each group is one launch of ``_dist_kfac_worker.py`` per rank (the launcher of
``test_distributed.py``: a deadline, and a 60 s collective timeout in the workers); the
tests read the numbers the ranks wrote.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch.distributed as dist

from tests.operators.test_distributed import get, rank_results

pytestmark = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()),
    reason="needs torch.distributed with gloo",
)

# float64 factors summed over the ranks agree with one process to rounding
ROUNDING = 1e-10


@pytest.fixture(scope="module", params=[2, 3], ids=lambda w: f"{w}ranks")
def ranks(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> list[dict[str, Any]]:
    world = request.param
    per_rank = rank_results(world, tmp_path_factory.mktemp(f"kfac{world}"), "_dist_kfac_worker.py")
    if "skip" in per_rank[0]:
        pytest.skip(per_rank[0]["skip"])
    return per_rank


CASES = [
    f"{model}_{op}_{fisher}"
    for model, fishers in (
        ("mlp", ("type2", "empirical")),
        ("mlp_joined", ("type2",)),
        ("conv_joined", ("type2",)),
        ("inplace_excluded", ("type2",)),
    )
    for op in ("kfac", "ekfac")
    for fisher in fishers
]


@pytest.mark.parametrize("case", CASES)
def test_fsdp_kronecker_equals_single_process_on_union(
    ranks: list[dict[str, Any]], case: str
) -> None:
    """Products, block products, the damped inverse, an eigenvector (shard by shard) and the
    eigenvalues of the FSDP operator equal the single-process operator's on the union of the
    ranks' batches (uneven sizes; shards uneven, and empty on some ranks)."""
    per_rank = get(ranks, "products")
    sizes = [res[case]["sizes"] for res in per_rank]
    assert sum(local for local, _, _, _ in sizes) == sizes[0][1] == sizes[0][2]
    for res in per_rank:
        numbers = res[case]
        for key in ("matvec", "matmat", "inverse", "eigenvector", "eigenvalues"):
            assert numbers[key] < ROUNDING, (case, key, numbers[key])
        local, global_size, _, expected_local = numbers["sizes"]
        assert local == expected_local and global_size == sizes[0][2]
        assert numbers["backend"] == "DistributedBackend"


def test_fsdp_kronecker_leaves_the_model_and_reads_conv1d(ranks: list[dict[str, Any]]) -> None:
    for res in get(ranks, "products"):
        for model in ("mlp", "mlp_joined", "conv_joined", "inplace_excluded"):
            assert res[f"{model}_untouched"], model
        # a transposed (Conv1D) block, when transformers is installed
        pytest.importorskip("transformers")
        assert res["conv_joined_transposed"]


def test_fsdp_kronecker_lanczos_monte_carlo_and_training(ranks: list[dict[str, Any]]) -> None:
    for res in get(ranks, "algorithms_and_training"):
        assert res["lanczos"] < 1e-8  # sharded Lanczos through op.backend
        assert res["mc_vs_ddp"] < ROUNDING  # draws keyed by rank, as the DDP operator's
        assert res["trains_after"]


def test_fsdp_kronecker_misuse_raises_clearly_on_every_rank(ranks: list[dict[str, Any]]) -> None:
    world = len(ranks)
    for rank, res in enumerate(get(ranks, "misuse")):
        uneven = res["uneven_batches"]
        assert uneven["type"] == "ValueError" and "same number of batches" in uneven["msg"]
        assert "rank 0: a batch" in uneven["msg"] and "no batch left" in uneven["msg"]
        for case, own in (
            ("rank_failure", "ArithmeticError"),
            ("construction_failure", "TypeError"),
        ):
            failure = res[case]
            if rank == world - 1:
                assert failure["type"] == own
                assert f"rank {rank} of {world}" in failure["notes"][0]
            else:
                assert failure["type"] == "DistributedProductError"
                assert f"rank {world - 1} of {world}" in failure["msg"]
            assert failure["seconds"] < 10, "ranks must not wait for the collective timeout"
        assert res["not_sharded"]["type"] == "TypeError"
        assert "DDPKFACOperator" in res["not_sharded"]["msg"]
        assert res["columns_sharded"]["type"] == "NotImplementedError"
        assert "dim 0" in res["columns_sharded"]["msg"]
        assert res["after"] < ROUNDING  # the group stays usable
