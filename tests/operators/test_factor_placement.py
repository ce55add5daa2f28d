"""Kronecker factors placed by module (``factor_placement="by_module"``) and KFOC's distributed
forms, against the single-process operators on the union of the ranks' batches, in real process
groups (2 and 3 ranks, gloo on CPU, float64, uneven batches; FSDP shards uneven and empty on
some ranks; with one factor module, ranks that own nothing).

Each group is one launch of ``_dist_factor_placement_worker.py`` per rank (the shared launcher:
a deadline, and a 60 s collective timeout in the workers); the tests read the numbers the ranks
wrote. The assignment of modules to ranks is also checked here, in one process.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch.distributed as dist

from hessian_eigenthings.operators.factor_owners import assign_owners
from tests.operators.test_distributed import get, rank_results

# float64 factors summed over the ranks agree with one process to rounding (measured: at most
# 2.2e-15 relative on torch 2.13)
ROUNDING = 1e-12

needs_gloo = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()),
    reason="needs torch.distributed with gloo",
)


@pytest.fixture(scope="module", params=[2, 3], ids=lambda w: f"{w}ranks")
def ranks(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> list[dict[str, Any]]:
    world = request.param
    per_rank = rank_results(
        world, tmp_path_factory.mktemp(f"placement{world}"), "_dist_factor_placement_worker.py"
    )
    if "skip" in per_rank[0]:
        pytest.skip(per_rank[0]["skip"])
    return per_rank


def test_assign_owners_is_largest_first_to_the_least_loaded_rank() -> None:
    sizes = [("a", 10), ("b", 40), ("c", 30), ("d", 30), ("e", 5)]
    # b -> 0; c -> 1; d -> 2; a -> 1 (30 < 40, ties to the lower rank); e -> 2
    assert assign_owners(sizes, 3) == {"b": 0, "c": 1, "d": 2, "a": 1, "e": 2}
    assert assign_owners(sizes, 1) == dict.fromkeys("abcde", 0)
    # more ranks than modules: the last ranks own nothing
    assert assign_owners([("x", 3), ("y", 3)], 4) == {"x": 0, "y": 1}
    # ties between modules: the earlier first
    assert assign_owners([("x", 3), ("y", 3), ("z", 3)], 2) == {"x": 0, "y": 1, "z": 0}


BY_MODULE = [
    f"{kind}_{model}_{op}"
    for kind in ("ddp", "fsdp")
    for model in ("mlp", "conv_joined", "single")
    for op in ("KFAC", "EKFAC")
]


@needs_gloo
@pytest.mark.parametrize("case", BY_MODULE)
def test_by_module_equals_single_process_on_union(ranks: list[dict[str, Any]], case: str) -> None:
    """Products, block products, the damped inverse, an eigenvector, every eigenvalue, trace,
    logdet and the Frobenius norm of the operator with factors by module equal the
    single-process operator's on the union; the whole-operator numbers (and, with replicated
    vectors, the products) are the same bits on every rank."""
    for res in get(ranks, "by_module"):
        numbers = res[case]
        for key in (
            "matvec",
            "matmat",
            "inverse",
            "eigenvector",
            "eigenvalues",
            "trace",
            "logdet",
            "frobenius",
        ):
            assert numbers[key] < ROUNDING, (case, key, numbers[key])
        assert numbers["same_on_ranks"]
        if case.startswith("ddp"):
            assert numbers["product_same_on_ranks"]


@needs_gloo
@pytest.mark.parametrize("case", BY_MODULE)
def test_by_module_each_rank_holds_only_its_modules(ranks: list[dict[str, Any]], case: str) -> None:
    """The owners are the same on every rank, every module has one, and each rank holds its own
    modules' factors and decompositions only: the bytes over the ranks add up exactly to one
    rank's bytes with replicated factors, built and after every decomposition was made."""
    world = len(ranks)
    per_rank = [res[case] for res in get(ranks, "by_module")]
    owners = per_rank[0]["owners"]
    assert all(res["owners"] == owners for res in per_rank)
    assert sorted(owners) == per_rank[0]["modules"]
    for rank, res in enumerate(per_rank):
        assert res["owned"] == sorted(m for m, r in owners.items() if r == rank)
    for state in ("bytes_built", "bytes_decomposed"):
        held = [res[state][0] for res in per_rank]
        replicated = per_rank[0][state][1]
        assert all(res[state][1] == replicated for res in per_rank)
        assert sum(held) == replicated, (state, held, replicated)
        if not case.endswith("EKFAC") and state == "bytes_built":
            assert held == [res["bytes_own"] for res in per_rank]
    if len(owners) < world:  # one module: the other ranks hold nothing at all
        assert sorted(res["bytes_built"][0] == 0 for res in per_rank).count(True) == world - 1


@needs_gloo
def test_by_module_refusals_and_failures_raise_on_every_rank(ranks: list[dict[str, Any]]) -> None:
    world = len(ranks)
    for rank, res in enumerate(get(ranks, "by_module_refusals")):
        for key, alternative in (
            ("eigh", "op.eigenvalues()"),
            ("factors", "op.owned_factors"),
            ("corrected", "op.eigenvalues(by_block=True)"),
        ):
            refused = res[key]
            assert refused["type"] == "ValueError", (key, refused)
            assert "factor_placement='by_module'" in refused["msg"]
            assert alternative in refused["msg"] and "'replicated'" in refused["msg"]
        assert res["bad_value"]["type"] == "ValueError"
        assert "'by_module'" in res["bad_value"]["msg"] and "'rows'" in res["bad_value"]["msg"]
        # an undamped inverse of a singular operator: the same refusal as replicated factors
        assert res["undamped"]["type"] == "ValueError"
        assert res["undamped"]["msg"] == res["undamped_replicated"]["msg"]
        for case, own in (("pass_failure", "ArithmeticError"), ("product_failure", "ValueError")):
            failure = res[case]
            if rank == world - 1:
                assert failure["type"] == own, (case, failure)
                assert f"rank {rank} of {world}" in failure["notes"][0]
            else:
                assert failure["type"] == "DistributedProductError", (case, failure)
                assert f"rank {world - 1} of {world}" in failure["msg"]
            assert failure["seconds"] < 10, "ranks must not wait for the collective timeout"
        if rank == world - 1:  # the owner whose factor was made NaN names it
            assert "is not finite" in res["product_failure"]["msg"]
        assert res["after"] < ROUNDING  # the group stays usable


KFOC = [
    f"{kind}_{model}_{placement}"
    for kind in ("ddp", "fsdp")
    for model in ("mlp", "conv_joined")
    for placement in ("replicated", "by_module")
]


@needs_gloo
@pytest.mark.parametrize("case", KFOC)
def test_distributed_kfoc_equals_single_process_on_union(
    ranks: list[dict[str, Any]], case: str
) -> None:
    """DDPKFOCOperator and FSDPKFOCOperator: the same iterations and convergence as one process
    on the union, and the same products, inverse products, eigenvector and eigenvalues."""
    for res in get(ranks, "kfoc"):
        numbers = res[case]
        for key in ("matvec", "matmat", "inverse", "eigenvector"):
            assert numbers[key] < ROUNDING, (case, key, numbers[key])
        if "eigenvalues" in numbers:
            assert numbers["eigenvalues"] < ROUNDING
        if case.endswith("by_module"):
            for key in ("trace", "logdet", "frobenius"):
                assert numbers[key] < ROUNDING, (case, key, numbers[key])
        found, expected = numbers["iterations"]
        assert found == expected and found >= 2  # a real iteration, stopped where one process did
        assert numbers["converged"] == [True, True]
        if case.startswith("ddp"):
            assert numbers["product_same_on_ranks"]


@needs_gloo
def test_kfoc_monte_carlo_draws_are_keyed_by_rank_alike(ranks: list[dict[str, Any]]) -> None:
    for res in get(ranks, "kfoc"):
        assert res["mc_vs_ddp"] < ROUNDING
