"""Distributed operators against single-process results, in real process groups.

Each group (2 and 3 ranks, gloo on CPU) is one launch of ``_dist_worker.py``
per rank that runs every check and writes its numbers; the tests below read
them. Launches have a deadline and the workers a 60 s collective timeout, so
a hang fails the test instead of blocking CI.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch.distributed as dist

from hessian_eigenthings import _torch_compat
from tests.launch import REPO, launch

pytestmark = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()),
    reason="needs torch.distributed with gloo",
)

HERE = Path(__file__).resolve().parent

# float64 products on the union of the shards agree with one process to rounding;
# central differences agree with autograd to O(h²) + rounding/h.
ROUNDING = 1e-13
FD = 1e-8


def rank_results(world: int, out: Path, worker: str, *args: str) -> list[dict[str, Any]]:
    """Launch ``world`` ranks of the worker script ``worker`` (in this folder) writing to ``out``;
    what each rank wrote (``out/rank{r}.json``)."""
    launch(world, out, [str(HERE / worker), str(out), *args])
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]


def test_a_native_crash_relaunches_the_group_once(tmp_path: Path) -> None:
    """The harness itself: a rank that dies of a native crash is relaunched once; a second crash
    (or any other failure) fails the launch."""
    script = tmp_path / "crash_once.py"
    script.write_text(
        "import os, sys\n"
        "mark = os.path.join(sys.argv[1], 'crashed')\n"
        "if not os.path.exists(mark) or sys.argv[2] == 'always':\n"
        "    open(mark, 'w').close()\n"
        "    print('malloc(): unaligned tcache chunk detected', flush=True)\n"
        "    sys.exit(134)\n"
    )
    launch(1, tmp_path, [str(script), str(tmp_path), "once"])
    (tmp_path / "crashed").unlink()
    with pytest.raises(AssertionError, match="exited with 134"):
        launch(1, tmp_path, [str(script), str(tmp_path), "always"])


@pytest.fixture(scope="module", params=[2, 3], ids=lambda w: f"{w}ranks")
def ranks(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> list[dict[str, Any]]:
    world = request.param
    return rank_results(world, tmp_path_factory.mktemp(f"dist{world}"), "_dist_worker.py")


def get(ranks: list[dict[str, Any]], check: str) -> list[dict[str, Any]]:
    per_rank = [r[check] for r in ranks]
    for rank, res in enumerate(per_rank):
        if "error" in res:
            pytest.fail(f"check {check} raised on rank {rank}: {res['error']}\n{res['traceback']}")
    return per_rank


def test_ddp_equals_single_process_on_union(ranks: list[dict[str, Any]]) -> None:
    for res in get(ranks, "ddp_autograd"):
        assert res["matvec"] < ROUNDING and res["matmat"] < ROUNDING
        assert res["layers"] < ROUNDING
        assert res["reuse"] == 0.0
        assert res["same_on_ranks"]
        assert res["model_unchanged"]
        assert res["backend"] == "SingleDeviceBackend"  # replicated vectors


def test_ddp_functional_engine(ranks: list[dict[str, Any]]) -> None:
    for res in get(ranks, "ddp_functional_engine"):
        assert res["hessian"] < ROUNDING and res["ggn"] < ROUNDING and res["auto"] < ROUNDING
        assert res["engine"] == "functional" and res["auto_engine"] == "autograd"
        assert res["same_on_ranks"]


def test_ddp_finite_difference(ranks: list[dict[str, Any]]) -> None:
    for res in get(ranks, "ddp_finite_difference"):
        assert res["vs_fd"] < ROUNDING
        assert res["vs_autograd"] < FD
        assert res["same_on_ranks"]


def test_ddp_wrapped_model_is_unwrapped_and_still_trains(ranks: list[dict[str, Any]]) -> None:
    for res in get(ranks, "ddp_wrapped_model"):
        assert res["matvec"] < ROUNDING
        assert res["uses_inner"] and res["model_unchanged"] and res["train_step_after"]


def test_ddp_cycling_chunked_blocks_microbatches(ranks: list[dict[str, Any]]) -> None:
    for res in get(ranks, "ddp_cycling_blocks_microbatches"):
        assert res["cycling"] < ROUNDING
        assert res["chunked_blocks"] < ROUNDING


def test_ddp_ggn_and_empirical_fisher(ranks: list[dict[str, Any]]) -> None:
    for res in get(ranks, "ddp_ggn_fisher"):
        assert res["ggn"] < ROUNDING and res["fisher"] < ROUNDING
        assert res["same_on_ranks"]


def test_a_new_curvature_runs_on_replicated_ranks_without_a_twin(
    ranks: list[dict[str, Any]],
) -> None:
    """A test-only curvature given ``ranks=Replicated()`` equals itself on the union of the
    shards, with blocks and graph reuse, and agrees on its layout at construction."""
    for res in get(ranks, "ddp_toy_curvature"):
        assert res["matvec"] < ROUNDING and res["matmat"] < ROUNDING and res["blocks"] < ROUNDING
        assert res["reuse"] == 0.0
        assert res["same_on_ranks"]
        assert res["model_unchanged"]
        assert res["world_size"] == len(ranks)
        assert res["mismatch"] == "ValueError"


def test_ddp_low_precision(ranks: list[dict[str, Any]]) -> None:
    for res in get(ranks, "ddp_low_precision"):
        assert res["float32"] < 1e-5
        assert res["bfloat16"] < 5e-2  # the 16-bit path: counts in a separate float64 exchange
        assert res["float32_same"] and res["bfloat16_same"]


def test_rank_failure_raises_on_every_rank(ranks: list[dict[str, Any]]) -> None:
    world = len(ranks)
    per_rank = get(ranks, "ddp_rank_failure")
    for rank, res in enumerate(per_rank):
        assert res["seconds"] < 10, "ranks must not wait for the collective timeout"
        if rank == world - 1:
            assert res["type"] == "ArithmeticError"
            assert f"rank {rank} of {world}" in res["notes"][0]
        else:
            assert res["type"] == "DistributedProductError"
            assert f"rank {world - 1} of {world}" in res["msg"]
        assert res["after"] < ROUNDING  # the group stays usable
        assert res["model_unchanged"]


def test_mismatched_parameters_detected_at_construction(ranks: list[dict[str, Any]]) -> None:
    world = len(ranks)
    for rank, res in enumerate(get(ranks, "ddp_mismatched_parameters")):
        assert (
            res["count"]["type"] == "ValueError" and "different parameters" in res["count"]["msg"]
        )
        assert "66 parameters" in res["count"]["msg"] and "24 parameters" in res["count"]["msg"]
        assert res["layout"]["type"] == "ValueError" and "checksum" in res["layout"]["msg"]
        ctor = res["ctor_failure"]
        if rank == 0:
            assert ctor["type"] == "ValueError" and "selected zero parameters" in ctor["msg"]
        else:
            assert ctor["type"] == "DistributedProductError" and f"rank 0 of {world}" in ctor["msg"]
        for case in ("count", "layout", "ctor_failure"):
            assert res[case]["seconds"] < 10


def test_distributed_backend_reduces_shards(ranks: list[dict[str, Any]]) -> None:
    for rank, res in enumerate(get(ranks, "distributed_backend")):
        for key in ("dot", "norm", "inner_rows", "all_reduce_sum"):
            assert res[key] < 1e-13, key
        assert res["rank"] == rank
        assert res["is_main"] == (rank == 0)


def _fsdp(ranks: list[dict[str, Any]], check: str) -> list[dict[str, Any]]:
    per_rank = get(ranks, check)
    if "skip" in per_rank[0]:
        pytest.skip(per_rank[0]["skip"])
    return per_rank


def test_fsdp_finite_differences_of_a_tied_padding_row(ranks: list[dict[str, Any]]) -> None:
    for res in _fsdp(ranks, "fsdp_tied_padding_finite_difference"):
        assert res["pad_row_norm"] > 1e-2
        assert res["vs_autograd"] < FD, res


def test_fsdp_finite_difference_equals_single_process(ranks: list[dict[str, Any]]) -> None:
    per_rank = _fsdp(ranks, "fsdp_finite_difference")
    assert sum(r["size_local"] for r in per_rank) == per_rank[0]["size_global"]
    assert all(r["global_size"] == r["size_global"] for r in per_rank)
    for res in per_rank:
        assert res["vs_fd"] < FD and res["block_vs_fd"] < FD
        assert res["vs_autograd"] < FD
        assert res["repeat"] == 0.0
        assert res["params_restored"] and res["grads_none"]
        assert res["backend"] == "DistributedBackend"
        if isinstance(res.get("lanczos"), str):
            continue  # algorithms not importable in this tree
        assert res["lanczos"] < 1e-6
        assert res["lanczos_same_on_ranks"]


def test_a_new_curvature_runs_on_sharded_ranks_without_a_twin(
    ranks: list[dict[str, Any]],
) -> None:
    """The test-only curvature on an FSDP2-sharded model, given ``ranks=Sharded(model)`` and
    ``engine="functional"`` (NOTE [gathered functional product]): equal to one process on the
    union of the ranks' uneven batches, with blocks; the Hessian so built equals one process and
    the sharded layer walk; without an engine the construction says what to pass."""
    per_rank = _fsdp(ranks, "fsdp_toy_curvature")
    assert sum(r["size_local"] for r in per_rank) == per_rank[0]["size_global"]
    for res in per_rank:
        assert res["matvec"] < 1e-13 and res["matmat"] < 1e-13 and res["blocks"] < 1e-13, res
        assert res["repeat"] == 0.0
        assert res["hessian"] < 1e-13 and res["hessian_vs_walk"] < 1e-13, res
        assert res["global_size"] == res["size_global"]
        assert res["backend"] == "DistributedBackend" and res["engine"] == "functional"
        assert res["forwards"] == 2 * (1 + 3 + 1)  # a forward per direction and chunk
        assert res["params_unchanged"] and res["grads_none"]
        assert res["no_engine"]["type"] == "TypeError"
        assert "engine='functional'" in res["no_engine"]["msg"]


def test_fsdp_method_layers_is_a_deprecated_spelling(ranks: list[dict[str, Any]]) -> None:
    """``FSDPHessianOperator(method="layers")`` still walks, warning once at the caller's line
    (``rec[0].filename == __file__`` in the worker) with the package's DeprecationWarning class;
    ``engine="layers"`` gives the same products."""
    for res in _fsdp(ranks, "fsdp_method_layers_deprecated"):
        assert res["deprecations"] == 1 and res["warnings"] == [
            f"DeprecatedWarning: {res['message']}"
        ]
        assert res["category"] == "DeprecatedWarning" and res["at_caller"], res
        assert "FSDPHessianOperator(method='layers') is deprecated as of 1.0.0" in res["message"]
        assert "engine='layers'" in res["message"]
        assert res["same_products"] and res["exact"] < 1e-13
        assert res["both_spellings"]["type"] == "ValueError"


def test_fsdp_method_layers_warns_before_anything_else() -> None:
    """The deprecation is said first, at the caller's line, also where the construction then
    fails (here: a model that is not sharded, in a process without a group)."""
    import deprecation
    import torch
    from torch import nn

    from hessian_eigenthings.operators.distributed import FSDPHessianOperator

    def loss(m: nn.Module, b: Any) -> torch.Tensor:
        return m(b).sum()

    with pytest.warns(deprecation.DeprecatedWarning) as rec, pytest.raises(TypeError):
        FSDPHessianOperator(nn.Linear(2, 1), [torch.ones(1, 2)], loss, method="layers", layers="")
    assert len(rec) == 1 and issubclass(rec[0].category, DeprecationWarning)
    assert rec[0].filename == __file__
    assert "Pass engine='layers'" in str(rec[0].message)


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """Four ranks for the sharded checks only (the other checks run on 2 and 3)."""
    checks = "fsdp_layer_walk,fsdp_walk_sandwiches,sharded_eigensolvers,sharded_estimators"
    return rank_results(4, tmp_path_factory.mktemp("dist4"), "_dist_worker.py", checks)


def test_fsdp_layer_walk_is_exact(ranks: list[dict[str, Any]]) -> None:
    _check_layer_walk(ranks)


def test_fsdp_layer_walk_on_four_ranks(four_ranks: list[dict[str, Any]]) -> None:
    _check_layer_walk(four_ranks, lanczos=False)
    _check_walk_sandwiches(four_ranks)


def test_sharded_algorithms_on_four_ranks(four_ranks: list[dict[str, Any]]) -> None:
    _check_eigensolvers(four_ranks)
    _check_estimators(four_ranks)


WALK_MODELS = (("gpt2", True), ("llama_tied", True), ("llama_untied", False))


def _check_layer_walk(ranks: list[dict[str, Any]], lanczos: bool = True) -> None:
    """The sharded layer walk equals the single-process product on the union of the ranks'
    batches (uneven token counts) to rounding in float64: GPT-2 (tied), Llama tied and untied;
    a sharded Lanczos finds the single-process top 5 of GPT-2 (``lanczos``: not on four ranks,
    whose products are slow on a 2-core machine)."""
    per_rank = _fsdp(ranks, "fsdp_layer_walk")
    for kind, tied in WALK_MODELS:
        assert sum(r[kind]["size_local"] for r in per_rank) == per_rank[0][kind]["size_global"]
        for res in per_rank:
            assert res[kind]["tied"] == tied
            # the Llamas have a padding row (NOTE [padding rows]), on one rank's shard; tied, the
            # head's use of it keeps its curvature
            assert res[kind]["padding"] == (kind != "gpt2")
            assert res[kind]["product"] < 1e-10 and res[kind]["block"] < 1e-10, (kind, res[kind])
            assert res[kind]["grads_none"]
    for res in per_rank if lanczos else ():
        lz = res["gpt2"]["lanczos"]
        assert lz["converged"] and lz["same_on_ranks"], lz
        assert lz["values"] < 1e-8 and lz["vectors"] < 1e-6, lz
        # HF's default SDPA attention walks too (its math kernel), equal to the eager model's
        assert res["gpt2_sdpa"] < 1e-10, res["gpt2_sdpa"]


def test_fsdp_walk_sandwiches_are_exact(ranks: list[dict[str, Any]]) -> None:
    _check_walk_sandwiches(ranks)


def _check_walk_sandwiches(ranks: list[dict[str, Any]]) -> None:
    """FSDPGGNOperator (exact: against one process on the union; Monte-Carlo: against
    DDPGGNOperator, whose draws are keyed by rank alike) and FSDPEmpiricalFisherOperator, on
    GPT-2 and Llama with tied and untied embeddings."""
    for res in _fsdp(ranks, "fsdp_walk_sandwiches"):
        for kind, tied in WALK_MODELS:
            r = res[kind]
            assert r["tied"] == tied
            assert r["ggn"] < 1e-10 and r["ggn_mc_vs_ddp"] < 1e-10 and r["fisher"] < 1e-10, r
            assert r["ggn_mc_vs_exact"] > 1e-3, r  # two draws are not the exact GGN


def test_ddp_kronecker_factors(ranks: list[dict[str, Any]]) -> None:
    for res in get(ranks, "ddp_kronecker_factors"):
        for key in ("kfac_type2", "ekfac_type2", "kfac_empirical", "ekfac_empirical"):
            assert res[key] < ROUNDING, (key, res[key])


def test_sharded_solves(ranks: list[dict[str, Any]]) -> None:
    """CG (sharded GGN) and MINRES (sharded Hessian) on sharded vectors find the single-process
    solutions."""
    for res in _fsdp(ranks, "sharded_solves"):
        assert res["cg_converged"] and res["minres_converged"]
        assert res["cg"] < 1e-8 and res["minres"] < 1e-8, res


def test_sharded_eigensolvers(ranks: list[dict[str, Any]]) -> None:
    _check_eigensolvers(ranks)


def _check_eigensolvers(ranks: list[dict[str, Any]]) -> None:
    """Lanczos top-5 (default basis; ncv=11, which forces thick restarts; blocks of 2) and power
    iteration on sharded vectors find the dense eigenpairs, the same on every rank."""
    for res in _fsdp(ranks, "sharded_eigensolvers"):
        for name in ("lanczos_default", "lanczos_restart", "lanczos_block"):
            lz = res[name]
            assert lz["converged"] and lz["same_on_ranks"], (name, lz)
            assert lz["values"] < 1e-8 and lz["vectors"] < 1e-8, (name, lz)
        # a basis of 11 rows holds 11 products: more products means it was restarted
        assert res["lanczos_restart"]["products"] > res["ncv"]
        # the walk's products on two and three ranks only
        assert ("power_walk" in res) == (len(ranks) < 4)
        for name in ("power_walk", "power_dense") if "power_walk" in res else ("power_dense",):
            pi = res[name]
            assert pi["converged"] and pi["same_on_ranks"], (name, pi)
            assert pi["value"] < 1e-10 and pi["vector"] < 1e-6, (name, pi)


def test_sharded_trace_and_density(ranks: list[dict[str, Any]]) -> None:
    _check_estimators(ranks)


def _check_estimators(ranks: list[dict[str, Any]]) -> None:
    """Trace estimators and SLQ on sharded vectors: each rank draws its piece of a probe from its
    own stream (identical pieces would correlate a probe's entries: the "same stream" numbers
    show that such probes would not pass), and every reduction spans the ranks."""
    for res in _fsdp(ranks, "sharded_estimators"):
        hu = res["hutchinson"]
        assert hu["samples"] < 1e-12 and hu["vs_same_stream"] > 1e-2, hu
        # 96 Gaussian probes, a seeded draw: within 4 standard errors of the dense trace
        assert hu["estimate_minus_trace_in_stderrs"] < 4, hu
        # rank(H) = 58 < the sketch's probes: exact up to rounding (relative to ||H||_F)
        assert res["rank_H"] == 58
        assert res["hutch++"]["estimate"] < 1e-12 and res["xtrace"]["estimate"] < 1e-12, res
        slq = res["slq"]
        assert slq["first_moment"] < 1e-12 and slq["second_moment"] < 1e-12, slq
        assert slq["vs_same_stream"] > 1e-2, slq
        assert slq["weights_sum"] < 1e-12 and slq["nodes_are_eigenvalues"] < 1e-10, slq
        assert slq["steps"] < res["sizes"][0]  # the runs stopped at an exhausted Krylov space
        for key in ("hutchinson", "hutch++", "xtrace", "slq"):
            assert res[key]["same_on_ranks"], key


def test_sharded_checkpoints_resume_bit_for_bit(ranks: list[dict[str, Any]]) -> None:
    """Lanczos and SLQ checkpoints, one file per rank: a run interrupted on every rank and
    resumed gives the uninterrupted result bit for bit, spending only the unsaved products."""
    for res in _fsdp(ranks, "sharded_checkpoints"):
        for name, every in (("walk_every5", 5), ("dense_restarts", None)):
            lz = res[name]
            assert lz["stopped"] == "_Interrupted" and lz["files_hold_pieces"], (name, lz)
            assert lz["same"] and lz["file_removed"], (name, lz)
            assert lz["resumed_products"] == lz["products"] - lz["saved_products"], (name, lz)
            if every is not None:
                assert lz["saved_products"] == every * ((lz["stop"] - 1) // every), (name, lz)
            else:  # saved at the last thick restart before the interruption
                assert 0 < lz["saved_products"] < lz["stop"], (name, lz)
        sd = res["density"]
        assert sd["stopped"] == "_Interrupted" and sd["file"] and sd["same"], sd
        assert sd["resumed_products"] == 2 * 10  # the first group of 2 runs was saved


def test_fsdp_failures(ranks: list[dict[str, Any]]) -> None:
    per_rank = _fsdp(ranks, "fsdp_failures")
    world = len(per_rank)
    for rank, res in enumerate(per_rank):
        loss = res["loss"]
        assert loss["seconds"] < 10
        if rank == world - 1:
            assert loss["type"] == "ArithmeticError"
        else:
            assert (
                loss["type"] == "DistributedProductError"
                and f"rank {world - 1} of {world}" in loss["msg"]
            )
        assert res["after"] < FD
        assert res["uneven_batches"]["type"] == "ValueError"
        assert "same number of batches" in res["uneven_batches"]["msg"]
        assert res["autograd"]["type"] == "NotImplementedError"
        assert (
            res["ddp_on_sharded"]["type"] == "TypeError"
            and "FSDPHessianOperator" in res["ddp_on_sharded"]["msg"]
        )
        assert res["not_sharded"]["type"] == "TypeError"


def test_not_initialized_error_is_clear() -> None:
    import torch
    from torch import nn

    from hessian_eigenthings.operators.distributed import DDPHessianOperator

    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    model = nn.Linear(2, 1)
    with pytest.raises(RuntimeError, match="torchrun"):
        DDPHessianOperator(model, [(torch.ones(1, 2),)], lambda m, b: m(b[0]).sum())


def test_benchmark_runs_tiny_on_cpu(tmp_path: Path) -> None:
    out = tmp_path / "bench"
    out.mkdir()
    launch(
        2,
        tmp_path,
        [str(REPO / "benchmarks" / "bench_distributed.py"), "--tiny", "--out", str(out)],
    )
    data = json.loads((out / "bench_distributed.json").read_text())
    assert data["world_size"] == 2
    assert data["ddp"]["rel_err_vs_single"] < 1e-4
    if "skip" not in data["fsdp"]:
        assert data["fsdp"]["rel_err_vs_single_fd"] < 1e-3
    assert (out / "bench_distributed.md").read_text().startswith("#")


# --------------------------------------------------------------------------
# the estimators on sharded vectors, checked statistically (one launch of 2 ranks)
# --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def stats_ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return rank_results(2, tmp_path_factory.mktemp("stats2"), "_dist_stats_worker.py")


# NOTE [statistical bands]
# Each estimator is unbiased, so over N seeds its mean estimate is the exact value up to a
# standard error SE = sqrt(Var / N) (N >= 600 calls: the mean is close to Gaussian). A band of
# 4 SE fails a correct estimator with probability 6e-5 per check, and a biased one once its
# bias passes 4 SE: a probe missing a rank's piece estimates the trace of the other rank's
# block only, a sum missing a rank a partial quadratic form; each moves the mean by O(||H||)
# against SE ~ 0.03 ||H|| here. The spread: the sample variance s² of N draws has
# Var(s²) ≈ σ⁴ (κ − 1) / N (κ: the fourth standardized moment, 3 for a Gaussian), so log(s²/σ²)
# has a standard deviation of about sqrt((κ − 1) / N), and for two independent samples the two
# terms add. We check |log(s²_sharded / σ²)| < 4 of those, with σ² the closed form where there
# is one (Hutchinson with Rademacher probes, Var = 2(||H||_F² − Σ H_ii²) per probe; SLQ's
# moments are Rademacher quadratic forms of H and H² over n, which a 10-node quadrature gives
# exactly) and otherwise the one-process estimator's variance over 2000 other seeds on the
# same matrix (Hutch++, XTrace), κ taken from that reference sample: ±0.26 in log variance at
# N = 600 (±14% in standard deviation). The one-process reference is checked the same way
# (its mean, and its spread against the closed forms), so a wrong reference cannot hide a
# wrong sharded estimator. Measured with these seeds (torch 2.13, CPU): correct, the largest
# |z| is 2.1 (Hutchinson's mean, XTrace's spread); with rank 1's piece of every probe zeroed,
# Hutchinson's mean is 16 SE off, Hutch++'s and XTrace's 6 SE and their spreads 16, SLQ's second
# moment 4 SE and its spread 6; with row_dots' all-reduce dropped (a sum missing a rank),
# means 15 to 55 SE off; with one probe stream for both ranks (pieces that repeat each other),
# Hutchinson's mean 7 SE off (its bias is a sum of cross entries of H that another matrix
# could cancel: sharded_estimators' exact "same stream" numbers guard that mistake too).
Z_BAND = 4.0


def _z(mean: float, exact: float, var: float, count: int) -> float:
    return (mean - exact) / math.sqrt(var / count)


def _log_var_ratio(samples: np.ndarray, var: float, kappa: float, ref_count: int | None) -> float:
    """log(s² / var) in units of its standard deviation (NOTE [statistical bands]);
    ``ref_count``: ``var`` is itself a sample variance of that many draws (else exact)."""
    spread = (kappa - 1.0) * (1.0 / samples.size + (1.0 / ref_count if ref_count else 0.0))
    return math.log(samples.var(ddof=1) / var) / math.sqrt(spread)


def _kurtosis(x: np.ndarray) -> float:
    c = x - x.mean()
    return float((c**4).mean() / (c**2).mean() ** 2)


@pytest.mark.skipif(not _torch_compat.fsdp2_runs_on_cpu(), reason="FSDP2 on the CPU: torch >= 2.6")
def test_sharded_estimators_statistically(stats_ranks: list[dict[str, Any]]) -> None:
    """Hutchinson, Hutch++, XTrace and SLQ on sharded vectors (2 gloo ranks, the FSDP2 MLP's walk
    matrix, float64) over many seeds against the dense Hessian of
    ``torch.autograd.functional.hessian``: means within 4 standard errors of the exact trace (SLQ:
    of tr(H)/n and ||H||_F²/n), spreads within 4 standard deviations of the sample variance of
    the closed-form variance or of the one-process estimator's (NOTE [statistical bands])."""
    per_rank = get(stats_ranks, "estimator_statistics")
    res = per_rank[0]
    assert all(r["sharded"] == res["sharded"] for r in per_rank)  # every rank, one answer
    assert res["same_on_ranks"]
    # the sharded walk's matrix is the dense float64 Hessian (rank 58 < the sketches' probes
    # would make Hutch++ and XTrace exact: their budgets stay below it)
    assert res["walk_vs_dense"] < 1e-13 and res["operator_vs_dense"] < 1e-13
    assert res["rank_H"] == 58
    n = res["n"]
    per_probe = 2.0 * (res["fro2"] - res["diag2"])  # Hutchinson, Rademacher
    exact: dict[str, tuple[float, float | None]] = {
        "hutchinson": (res["trace"], per_probe / res["budgets"]["hutchinson"]),
        "hutch++": (res["trace"], None),
        "xtrace": (res["trace"], None),
        "slq_first": (res["trace"] / n, per_probe / n**2),
        "slq_second": (res["fro2"] / n, 2.0 * (res["fro2_H2"] - res["diag2_H2"]) / n**2),
    }
    for key, (value, closed) in exact.items():
        sharded = np.asarray(res["sharded"][key])
        ref = np.asarray(res["reference"][key])
        assert sharded.size >= 600 and ref.size >= 2000, key
        kappa = _kurtosis(ref)
        ref_var = float(ref.var(ddof=1))
        var, ref_count = (closed, None) if closed is not None else (ref_var, ref.size)
        # the one-process reference itself: unbiased, and its spread the closed form's
        assert abs(_z(float(ref.mean()), value, var, ref.size)) < Z_BAND, key
        if closed is not None:
            assert abs(_log_var_ratio(ref, closed, kappa, None)) < Z_BAND, key
        # the sharded estimator
        z = _z(float(sharded.mean()), value, var, sharded.size)
        assert abs(z) < Z_BAND, (key, z, float(sharded.mean()), value)
        spread = _log_var_ratio(sharded, var, kappa, ref_count)
        assert abs(spread) < Z_BAND, (key, spread, float(sharded.var(ddof=1)), var)


@pytest.mark.skipif(not _torch_compat.fsdp2_runs_on_cpu(), reason="FSDP2 on the CPU: torch >= 2.6")
def test_sharded_checkpoints_of_another_rank_are_refused(
    stats_ranks: list[dict[str, Any]],
) -> None:
    """Per-rank Lanczos and SLQ checkpoints (NOTE [checkpoints of sharded runs]): another rank's
    file (uneven pieces), and a file one process wrote, are refused in one line naming both."""
    for rank, res in enumerate(get(stats_ranks, "sharded_checkpoint_refusals")):
        for name in ("lanczos", "density"):
            r = res[name]
            assert r["stopped"] == ["_Interrupted", "_Interrupted"], r
            assert r["swapped"]["type"] == "ValueError", r
            assert (
                f"written by rank {1 - rank} of 2, this is rank {rank} of 2" in r["swapped"]["msg"]
            )
            assert r["from_single"]["type"] == "ValueError", r
            msg = r["from_single"]["msg"]
            assert f"one process (no rank recorded), this is rank {rank} of 2" in msg, msg
            assert "\n" not in r["swapped"]["msg"] + msg


# --------------------------------------------------------------------------
# several nodes: two rendezvous groups on one host
# --------------------------------------------------------------------------

MULTINODE_DEADLINE_S = 170


@pytest.mark.parametrize(
    ("rendezvous", "operator"),
    [("c10d", "--sharded"), ("static", "--replicated")],
    ids=["c10d-sharded", "static-replicated"],
)
def test_two_rendezvous_groups_on_one_host(tmp_path: Path, rendezvous: str, operator: str) -> None:
    """``scripts/multinode_lanczos.py`` (the recipe of docs/distributed.md, "Several nodes") under
    ``torchrun --nnodes=2 --nproc-per-node=1``, one launcher per "node" on this host (gloo, CPU):
    the top-3 Hessian eigenvalues of the ranks' FSDP2 or replicated operator equal one process's
    on the union of the samples to 1e-10, converged."""
    if operator == "--sharded" and not _torch_compat.fsdp2_runs_on_cpu():
        pytest.skip("FSDP2 on the CPU: torch >= 2.6")
    import importlib.util
    import os
    import subprocess
    import sys

    from tests.launch import free_port

    if importlib.util.find_spec("torch.distributed.run") is None:
        pytest.skip("torch.distributed.run is not in this torch build")
    port = free_port()
    if rendezvous == "c10d":  # the ranks come from the rendezvous (node_rank is not used)
        where = ["--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}"]
    else:
        where = ["--master-addr=127.0.0.1", f"--master-port={port}"]
    out = tmp_path / "result.json"
    env = dict(
        os.environ,
        OMP_NUM_THREADS="1",
        PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    )
    script = [str(REPO / "scripts" / "multinode_lanczos.py"), f"--out={out}", operator]
    procs = []
    for node in (0, 1):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=1"]
        cmd += [f"--node-rank={node}", *where, *script]
        log = open(tmp_path / f"node{node}.txt", "w")  # noqa: SIM115 -- closed below
        procs.append(
            (subprocess.Popen(cmd, env=env, cwd=REPO, stdout=log, stderr=subprocess.STDOUT), log)
        )
    try:
        for node, (p, _) in enumerate(procs):
            try:
                p.wait(timeout=MULTINODE_DEADLINE_S)
            except subprocess.TimeoutExpired:
                pytest.fail(f"node {node} still running after {MULTINODE_DEADLINE_S} s (a hang?)")
    finally:
        for p, log in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
            log.close()
    for node, (p, _) in enumerate(procs):
        text = (tmp_path / f"node{node}.txt").read_text()
        assert p.returncode == 0, f"node {node} exited with {p.returncode}:\n{text[-4000:]}"
    res = json.loads(out.read_text())
    assert res["world_size"] == 2 and res["ok"] and res["converged"], res
    assert res["operator"] == (
        "FSDPHessianOperator" if operator == "--sharded" else "DDPHessianOperator"
    )
    assert res["relative_difference"] < 1e-10, res
    assert len(res["eigenvalues"]) == 3
