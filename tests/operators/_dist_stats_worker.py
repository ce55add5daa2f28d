"""One rank of the sharded estimators' statistical checks (run by tests/operators/test_distributed.py).

Usage: ``python _dist_stats_worker.py OUT_DIR [CHECKS]`` with RANK, WORLD_SIZE, MASTER_ADDR and
MASTER_PORT set, as ``_dist_worker.py`` (whose sharded MLP, vector layout and dense stand-in
``_ShardedDense`` these checks reuse). Writes ``OUT_DIR/rank{r}.json``: per check its raw
numbers; the tests hold the statistics (tests/operators/test_distributed.py,
``test_sharded_estimators_statistically``).
"""

from __future__ import annotations

import datetime
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from _dist_checks import run_checks_and_exit  # this folder: the workers run as scripts
from _dist_worker import (
    FSDP_ALL,
    RANK,
    WORLD,
    _count_products,
    _expect_raise,
    _shard,
    _sharded_mlp_hessian,
    _ShardedDense,
    _uncount,
    gather_equal,
    mlp,
)

from hessian_eigenthings.operators import LambdaOperator

CHECKS: dict[str, Callable[[], dict[str, Any]]] = {}


def check(fn: Callable[[], dict[str, Any]]) -> Callable[[], dict[str, Any]]:
    CHECKS[fn.__name__] = fn
    return fn


# Seeds: the sharded runs take 0, 1, ...; the one-process reference 100_000 + i. They must not
# overlap: rank 0's piece of a sharded probe is drawn from the stream the one-process call of the
# same seed starts with (NOTE [checkpoints of sharded runs]), so the same seed would correlate
# the two samples the tests compare.
REFERENCE_SEED = 100_000
#: sharded calls per estimator (one launch runs them all) and one-process reference calls
SHARDED_CALLS = 600
REFERENCE_CALLS = 2000
#: budgets: below rank(H) = 58, so that Hutch++ and XTrace still have a spread to check
# Hutchinson: 4 probes a call (one product and one reduction), over 4x the calls of the others:
# its mean is the most sensitive check of the probes themselves (NOTE [statistical bands] in
# test_distributed.py).
HUTCHINSON_PROBES, HUTCHINSON_CALLS = 4, 2400
HUTCH_PP_MATVECS = 30  # a sketch of 10 probes, 10 products for A Q, 10 Hutchinson probes
XTRACE_MATVECS = 20  # 10 probes
#: SLQ: runs per call, Lanczos steps (the quadrature is exact for degree <= 2 * steps - 1)
SLQ_CALLS, SLQ_RUNS, SLQ_STEPS = 100, 10, 10


def _dense_hessian() -> tuple[torch.Tensor, torch.Tensor]:
    """The union's Hessian by ``torch.autograd.functional.hessian`` of the mean loss over the
    ranks' first batches as a function of the flat parameter vector (``named_parameters``
    order, as the operators' layout), and that vector."""
    model = mlp()
    names = [n for n, _ in model.named_parameters()]
    shapes = [p.shape for p in model.parameters()]
    theta = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    x = torch.cat([FSDP_ALL[r][0][0] for r in range(WORLD)])
    y = torch.cat([FSDP_ALL[r][0][1] for r in range(WORLD)])

    def loss(flat: torch.Tensor) -> torch.Tensor:
        params, at = {}, 0
        for name, shape in zip(names, shapes, strict=True):
            params[name] = flat[at : at + shape.numel()].reshape(shape)
            at += shape.numel()
        return F.cross_entropy(torch.func.functional_call(model, params, (x,)), y)

    H = torch.autograd.functional.hessian(loss, theta)
    return 0.5 * (H + H.T), theta


def _walk_matrix(walk: Any, ref: Any) -> torch.Tensor:
    """The sharded walk's own matrix ``(n, n)``: its products with the pieces of the unit
    vectors (one block), each rank's rows put in place and summed over the ranks."""
    n = ref.size
    rows = _shard(torch.arange(n, dtype=torch.float64), ref).long()
    eye = torch.eye(n, dtype=torch.float64)
    local = walk.matmat(eye[rows].contiguous())  # (n_r, n): rank r's rows of H e_j
    M = torch.zeros(n, n, dtype=torch.float64)
    M[rows] = local
    dist.all_reduce(M)
    return 0.5 * (M + M.T)


def _one_process(H: torch.Tensor) -> LambdaOperator:
    """``H`` on whole vectors in one process (``matmat_fn`` takes rows ``(b, n)``)."""
    return LambdaOperator(lambda v: H @ v, H.shape[0], dtype=H.dtype, matmat_fn=lambda V: V @ H)


def _slq_moments(sd: Any) -> tuple[list[float], list[float]]:
    """Each run's first two moments of its quadrature, Σ_j w_j θ_j^p (p = 1, 2)."""
    nodes, w = sd.raw_eigenvalues.nan_to_num(), sd.raw_weights
    return (w * nodes).sum(1).tolist(), (w * nodes.square()).sum(1).tolist()


def _estimates(
    op: Any, seeds: list[int], hutchinson_seeds: list[int], backend: Any
) -> dict[str, list[float]]:
    """Every estimator's estimate for each seed (Hutchinson: for each of ``hutchinson_seeds``;
    SLQ: each run's moments, over the first ``SLQ_CALLS`` seeds)."""
    from hessian_eigenthings.algorithms import (
        hutch_plus_plus,
        hutchinson,
        spectral_density,
        xtrace,
    )

    out: dict[str, list[float]] = {"hutchinson": [], "hutch++": [], "xtrace": []}
    for s in hutchinson_seeds:
        hu = hutchinson(op, num_samples=HUTCHINSON_PROBES, seed=s, backend=backend)
        out["hutchinson"].append(hu.estimate)
    for s in seeds:
        kw: dict[str, Any] = {"seed": s, "backend": backend}
        out["hutch++"].append(hutch_plus_plus(op, num_matvecs=HUTCH_PP_MATVECS, **kw).estimate)
        out["xtrace"].append(xtrace(op, num_matvecs=XTRACE_MATVECS, **kw).estimate)
    out["slq_first"], out["slq_second"] = [], []
    for s in seeds[:SLQ_CALLS]:
        sd = spectral_density(
            op,
            num_runs=SLQ_RUNS,
            lanczos_steps=SLQ_STEPS,
            num_grid_points=50,
            seed=s,
            backend=backend,
        )
        first, second = _slq_moments(sd)
        out["slq_first"] += first
        out["slq_second"] += second
    return out


@check
def estimator_statistics() -> dict[str, Any]:
    """Hutchinson, Hutch++, XTrace and SLQ on sharded vectors over many seeds, with what the tests
    compare them with: the exact trace, ||H||_F², Σ H_ii² and the same for H² of the dense
    float64 Hessian (``torch.autograd.functional.hessian``), and the one-process estimators on
    that Hessian over other seeds (half of them on each rank, gathered).

    The sharded operator is ``_ShardedDense`` of the sharded walk's own matrix (its products with
    the unit vectors' pieces): the estimators' arithmetic on sharded vectors, every reduction
    through the ranks, with the walk's curvature, at the cost of a tiny matrix product instead
    of a walk (~40 ms a product here) per product."""
    walk, ref, H_ref = _sharded_mlp_hessian()
    H_dense, _theta = _dense_hessian()
    H_walk = _walk_matrix(walk, ref)
    op = _ShardedDense(H_walk, ref)
    sharded = _estimates(op, list(range(SHARDED_CALLS)), list(range(HUTCHINSON_CALLS)), op.backend)
    # the one-process reference: REFERENCE_CALLS seeds split between the ranks, then gathered
    half = REFERENCE_CALLS // WORLD
    mine = [REFERENCE_SEED + RANK * half + i for i in range(half)]
    local = _estimates(_one_process(H_dense), mine, mine, None)
    reference: dict[str, list[float]] = {}
    for key, values in local.items():
        parts = [torch.empty(len(values), dtype=torch.float64) for _ in range(WORLD)]
        dist.all_gather(parts, torch.tensor(values, dtype=torch.float64))
        reference[key] = torch.cat(parts).tolist()
    H2 = H_dense @ H_dense
    scale = float(H_dense.abs().max())
    return {
        "n": ref.size,
        "rank_H": int(torch.linalg.matrix_rank(H_dense)),
        "walk_vs_dense": float((H_walk - H_dense).abs().max()) / scale,
        "operator_vs_dense": float((H_ref - H_dense).abs().max()) / scale,
        "trace": float(H_dense.trace()),
        "fro2": float(H_dense.square().sum()),
        "diag2": float(H_dense.diagonal().square().sum()),
        "fro2_H2": float(H2.square().sum()),
        "diag2_H2": float(H2.diagonal().square().sum()),
        "sharded": sharded,
        "reference": reference,
        "same_on_ranks": gather_equal(torch.tensor(sharded["hutch++"] + sharded["slq_first"])),
        "budgets": {
            "hutchinson": HUTCHINSON_PROBES,
            "hutch++": HUTCH_PP_MATVECS,
            "xtrace": XTRACE_MATVECS,
            "slq_runs": SLQ_RUNS,
        },
    }


@check
def sharded_checkpoint_refusals() -> dict[str, Any]:
    """Per-rank Lanczos and SLQ checkpoints of the sharded MLP (``_ShardedDense`` of its Hessian,
    uneven pieces: NOTE [checkpoints of sharded runs]) resumed from another rank's file (the
    ranks' files swapped), and from a file one process wrote: each refused in one line."""
    from hessian_eigenthings.algorithms import lanczos, spectral_density

    _walk, ref, H = _sharded_mlp_hessian()
    dense = _ShardedDense(H, ref)
    folder = Path(sys.argv[1]) / "refusals"
    folder.mkdir(exist_ok=True)
    runs: dict[str, tuple[Callable[..., Any], dict[str, Any], int]] = {
        "lanczos": (lanczos, dict(k=3, seed=2, tol=1e-10, ncv=8, checkpoint_every=4), 10),
        "density": (
            spectral_density,
            dict(num_runs=4, lanczos_steps=10, num_grid_points=50, seed=3, checkpoint_runs=2),
            25,
        ),
    }
    out: dict[str, Any] = {"sizes": dense.size}
    for name, (fn, kw, stop) in runs.items():
        mine, other = (folder / f"{name}_rank{r}.pt" for r in (RANK, 1 - RANK))
        _count_products(dense, stop)
        stopped = _expect_raise(lambda fn=fn, kw=kw, p=mine: fn(dense, checkpoint=p, **kw))
        _uncount(dense)
        dist.barrier()  # both files written before either rank reads the other's
        swapped = _expect_raise(lambda fn=fn, kw=kw, p=other: fn(dense, checkpoint=p, **kw))
        # one process (the whole matrix, no ranks) writes a file; a rank resumes from it
        single = folder / f"{name}_single_rank{RANK}.pt"
        whole = _one_process(H)
        _count_products(whole, stop)
        stopped_single = _expect_raise(
            lambda fn=fn, kw=kw, p=single, w=whole: fn(w, checkpoint=p, **kw)
        )
        _uncount(whole)
        from_single = _expect_raise(lambda fn=fn, kw=kw, p=single: fn(dense, checkpoint=p, **kw))
        dist.barrier()
        out[name] = {
            "stopped": [stopped["type"], stopped_single["type"]],
            "swapped": swapped,
            "from_single": from_single,
        }
    return out


def main() -> None:
    out_dir = sys.argv[1]
    only = sys.argv[2].split(",") if len(sys.argv) > 2 else list(CHECKS)
    warnings.simplefilter("error")  # like pytest's filterwarnings=error
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    run_checks_and_exit(CHECKS, only, out_dir, RANK)


if __name__ == "__main__":
    main()
