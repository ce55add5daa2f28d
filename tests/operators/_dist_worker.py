"""One rank of a distributed test group (run by tests/operators/test_distributed.py).

Usage: ``python _dist_worker.py OUT_DIR`` with RANK, WORLD_SIZE, MASTER_ADDR and
MASTER_PORT set. Runs every check in one process group (process start-up is the
expensive part) and writes ``OUT_DIR/rank{r}.json``: per check either its
numbers or the exception it raised. Every rank builds the single-process
reference on the union of all ranks' data itself, so comparisons are local
(the layer walk's slow references: on one rank each, broadcast).
"""

from __future__ import annotations

import datetime
import os
import sys
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from _dist_checks import run_checks_and_exit  # this folder: the workers run as scripts
from torch import nn

import hessian_eigenthings.operators.distributed as hd
from hessian_eigenthings import _torch_compat
from hessian_eigenthings.linalg_distributed import DistributedBackend, is_main_process
from hessian_eigenthings.operators import (
    EmpiricalFisherOperator,
    GGNOperator,
    HessianOperator,
    LambdaOperator,
)

RANK = int(os.environ["RANK"])
WORLD = int(os.environ["WORLD_SIZE"])

CHECKS: dict[str, Callable[[], dict[str, Any]]] = {}


def check(fn: Callable[[], dict[str, Any]]) -> Callable[[], dict[str, Any]]:
    CHECKS[fn.__name__] = fn
    return fn


def mlp(seed: int = 0, dtype: torch.dtype = torch.float64) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3)).to(dtype)


def loss_fn(model: nn.Module, batch: Any) -> torch.Tensor:
    x, y = batch
    return F.cross_entropy(model(x), y)


def make_batches(sizes: list[int], seed: int = 1, dtype: torch.dtype = torch.float64) -> list[Any]:
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(b, 5, generator=g).to(dtype), torch.randint(0, 3, (b,), generator=g))
        for b in sizes
    ]


# uneven shards: different numbers of batches of different sizes per rank
SIZES = [5, 3, 4, 2, 6, 1, 3]
BOUNDS = {1: [0, 7], 2: [0, 5, 7], 3: [0, 4, 6, 7], 4: [0, 2, 4, 6, 7]}[WORLD]
ALL = make_batches(SIZES)
MINE = ALL[BOUNDS[RANK] : BOUNDS[RANK + 1]]


def rand(n: int, *lead: int, seed: int = 2, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    return torch.randn(
        *lead, n, generator=torch.Generator().manual_seed(seed), dtype=torch.float64
    ).to(dtype)


def err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max())


def gather_equal(t: torch.Tensor) -> bool:
    """Bitwise equal on every rank."""
    parts = [torch.empty_like(t) for _ in range(WORLD)]
    dist.all_gather(parts, t.contiguous())
    return all(torch.equal(p, parts[0]) for p in parts)


def params_snapshot(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def unchanged(model: nn.Module, snap: list[torch.Tensor]) -> bool:
    return all(
        torch.equal(p.detach(), s) for p, s in zip(model.parameters(), snap, strict=True)
    ) and all(p.grad is None for p in model.parameters())


# --------------------------------------------------------------------------
# data parallel
# --------------------------------------------------------------------------


@check
def ddp_autograd() -> dict[str, Any]:
    model = mlp()
    snap = params_snapshot(model)
    op = hd.DDPHessianOperator(model, MINE, loss_fn)
    ref = HessianOperator(mlp(), ALL, loss_fn)
    v, V = rand(op.size), rand(op.size, 4, seed=3).T.contiguous()
    hv, HV = op @ v, op @ V
    hv2 = op @ v  # second product: graph reuse path
    return {
        "matvec": err(hv, ref @ v),
        "matmat": err(HV, ref @ V),
        "reuse": err(hv2, hv),
        "same_on_ranks": gather_equal(hv) and gather_equal(HV),
        "model_unchanged": unchanged(model, snap),
        "backend": type(op.backend).__name__,
        # the layer walk per rank, then the same all-reduce (NOTE [layer walk])
        "layers": err(
            hd.DDPHessianOperator(model, MINE, loss_fn, engine="layers", layers="") @ v, ref @ v
        ),
    }


@check
def ddp_functional_engine() -> dict[str, Any]:
    ref = HessianOperator(mlp(), ALL, loss_fn)
    ref_ggn = GGNOperator(mlp(), ALL, lambda m, b: m(b[0]), hd_ce_out())
    v = rand(ref.size)
    op = hd.DDPHessianOperator(mlp(), MINE, loss_fn, engine="functional")
    ggn = hd.DDPGGNOperator(mlp(), MINE, lambda m, b: m(b[0]), hd_ce_out(), engine="functional")
    auto = hd.DDPHessianOperator(mlp(), MINE, loss_fn)
    auto.expect_products(10_000)
    return {
        "hessian": err(op @ v, ref @ v),
        "ggn": err(ggn @ v, ref_ggn @ v),
        "engine": op.engine,
        "auto": err(auto @ v, ref @ v),
        "auto_engine": auto.engine,  # ranks never time engines on their own
        "same_on_ranks": gather_equal(op @ v),
    }


def hd_ce_out() -> Any:
    from hessian_eigenthings.loss_fns import supervised_loss_of_output

    return supervised_loss_of_output(nn.CrossEntropyLoss())


@check
def ddp_finite_difference() -> dict[str, Any]:
    op = hd.DDPHessianOperator(mlp(), MINE, loss_fn, method="finite_difference")
    ref_fd = HessianOperator(mlp(), ALL, loss_fn, method="finite_difference")
    ref = HessianOperator(mlp(), ALL, loss_fn)
    V = rand(op.size, 2).T.contiguous()
    HV = op @ V
    return {
        "vs_fd": err(HV, ref_fd @ V),
        "vs_autograd": err(HV, ref @ V),
        "same_on_ranks": gather_equal(HV),
    }


@check
def ddp_wrapped_model() -> dict[str, Any]:
    from torch.nn.parallel import DistributedDataParallel

    inner = mlp()
    snap = params_snapshot(inner)
    wrapped = DistributedDataParallel(inner)
    op = hd.DDPHessianOperator(wrapped, MINE, loss_fn)
    ref = HessianOperator(mlp(), ALL, loss_fn)
    v = rand(op.size)
    hv = op @ v
    # the wrapper still trains normally afterwards: DDP's reducer saw nothing of ours
    wrapped(ALL[0][0]).sum().backward()
    reducer_ok = all(p.grad is not None for p in inner.parameters())
    for p in inner.parameters():
        p.grad = None
    return {
        "matvec": err(hv, ref @ v),
        "uses_inner": op.model is inner,
        "model_unchanged": unchanged(inner, snap),
        "train_step_after": reducer_ok,
    }


@check
def ddp_cycling_blocks_microbatches() -> dict[str, Any]:
    # full_dataset=False: product i uses batch i of every rank (cycling per rank)
    op = hd.DDPHessianOperator(mlp(), MINE, loss_fn, full_dataset=False, graph_reuse=False)
    v = rand(op.size)
    errs = []
    for i in range(3):
        union = [ALL[BOUNDS[r] + i % (BOUNDS[r + 1] - BOUNDS[r])] for r in range(WORLD)]
        errs.append(err(op @ v, HessianOperator(mlp(), union, loss_fn) @ v))
    # several passes per block (packed-copy path) and microbatches
    chunked = hd.DDPHessianOperator(mlp(), MINE, loss_fn, max_block_size=2, microbatch_size=2)
    V = rand(op.size, 5).T.contiguous()
    ref = HessianOperator(mlp(), ALL, loss_fn)
    return {"cycling": max(errs), "chunked_blocks": err(chunked @ V, ref @ V)}


@check
def ddp_low_precision() -> dict[str, Any]:
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        batches = make_batches(SIZES, dtype=dtype)
        # precision="model": the products and the ranks' exchange in the model's 16-bit dtype
        op = hd.DDPHessianOperator(
            mlp(dtype=dtype), batches[BOUNDS[RANK] : BOUNDS[RANK + 1]], loss_fn, precision="model"
        )
        ref = HessianOperator(mlp(), make_batches(SIZES), loss_fn)
        v = rand(op.size)
        hv = op @ v.to(dtype)
        out[str(dtype).split(".")[-1]] = err(hv, ref @ v)
        out[f"{str(dtype).split('.')[-1]}_same"] = gather_equal(hv)
    return out


def _failing_loss(bad_rank: int) -> Callable[[nn.Module, Any], torch.Tensor]:
    calls = {"n": 0}

    def fn(model: nn.Module, batch: Any) -> torch.Tensor:
        calls["n"] += 1
        if bad_rank == RANK and calls["n"] == 2:
            raise ArithmeticError("boom on purpose")
        return loss_fn(model, batch)

    return fn


def _expect_raise(fn: Callable[[], Any]) -> dict[str, Any]:
    t0 = time.perf_counter()
    try:
        fn()
    except Exception as exc:
        return {
            "type": type(exc).__name__,
            "msg": str(exc),
            "notes": list(getattr(exc, "__notes__", [])),
            "seconds": time.perf_counter() - t0,
        }
    return {"type": None, "seconds": time.perf_counter() - t0}


@check
def ddp_rank_failure() -> dict[str, Any]:
    bad = WORLD - 1
    model = mlp()
    snap = params_snapshot(model)
    # rank `bad` raises on its second batch, so use a shard with >= 2 batches there
    shards = [ALL[:2]] * WORLD
    op = hd.DDPHessianOperator(model, shards[RANK], _failing_loss(bad), graph_reuse=False)
    v = rand(op.size)
    res = _expect_raise(lambda: op @ v)
    # the group is still usable: the next product (the failing call is past) works
    ok = hd.DDPHessianOperator(model, MINE, loss_fn)
    res["after"] = err(ok @ v, HessianOperator(mlp(), ALL, loss_fn) @ v)
    res["model_unchanged"] = unchanged(model, snap)
    return res


@check
def ddp_mismatched_parameters() -> dict[str, Any]:
    flt = "2.*" if RANK == WORLD - 1 else None
    mismatch = _expect_raise(lambda: hd.DDPHessianOperator(mlp(), MINE, loss_fn, param_filter=flt))
    # same count, different layout: rank `last` selects weights of another shape order
    swap = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3)).double()
    if RANK == WORLD - 1:
        swap = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3)).double()
        swap[0].weight = nn.Parameter(torch.zeros(5, 7, dtype=torch.float64))
    layout = _expect_raise(lambda: hd.DDPHessianOperator(swap, MINE, loss_fn))
    # a rank whose constructor raises: the others raise too, naming it
    flt2 = "nothing.*" if RANK == 0 else None
    failed = _expect_raise(lambda: hd.DDPHessianOperator(mlp(), MINE, loss_fn, param_filter=flt2))
    return {"count": mismatch, "layout": layout, "ctor_failure": failed}


@check
def ddp_toy_curvature() -> dict[str, Any]:
    """A curvature the package does not know (tests/operators/toy_curvature.py), distributed by
    being given replicated ranks: no class or code of its own for it."""
    from tests.operators.toy_curvature import BatchGradientOuterProduct

    model = mlp()
    snap = params_snapshot(model)
    op = BatchGradientOuterProduct(model, MINE, loss_fn, ranks=hd.Replicated())
    blocks = BatchGradientOuterProduct(
        mlp(), MINE, loss_fn, ranks=hd.Replicated(), max_block_size=3
    )
    ref = BatchGradientOuterProduct(mlp(), ALL, loss_fn)
    v, V = rand(op.size), rand(op.size, 4, seed=3).T.contiguous()
    hv, HV = op @ v, op @ V
    mismatch = _expect_raise(
        lambda: BatchGradientOuterProduct(
            mlp(), MINE, loss_fn, ranks=hd.Replicated(), param_filter="0.*" if RANK == 0 else None
        )
    )
    return {
        "matvec": err(hv, ref @ v),
        "matmat": err(HV, ref @ V),
        "blocks": err(blocks @ V, ref @ V),
        "reuse": err(op @ v, hv),
        "same_on_ranks": gather_equal(hv) and gather_equal(HV),
        "model_unchanged": unchanged(model, snap),
        "world_size": op.world_size,
        "mismatch": mismatch["type"],
    }


@check
def ddp_ggn_fisher() -> dict[str, Any]:
    from hessian_eigenthings.loss_fns import (
        supervised_forward,
        supervised_loss_of_output,
        supervised_per_sample_loss,
    )
    from hessian_eigenthings.operators import EmpiricalFisherOperator, GGNOperator

    criterion = nn.CrossEntropyLoss()
    ggn_args = (supervised_forward, supervised_loss_of_output(criterion))
    ggn = hd.DDPGGNOperator(mlp(), MINE, *ggn_args)
    fisher = hd.DDPEmpiricalFisherOperator(mlp(), MINE, supervised_per_sample_loss(criterion))
    V = rand(ggn.size, 3).T.contiguous()
    G, Fi = ggn @ V, fisher @ V
    return {
        "ggn": err(G, GGNOperator(mlp(), ALL, *ggn_args) @ V),
        "fisher": err(
            Fi, EmpiricalFisherOperator(mlp(), ALL, supervised_per_sample_loss(criterion)) @ V
        ),
        "same_on_ranks": gather_equal(G) and gather_equal(Fi),
    }


# --------------------------------------------------------------------------
# backend
# --------------------------------------------------------------------------


@check
def distributed_backend() -> dict[str, Any]:
    n = 23
    a, b = rand(n, seed=4), rand(n, seed=5)
    A, B = rand(n, 3, seed=6), rand(n, 2, seed=7)
    cuts = [round(i * n / WORLD) for i in range(WORLD + 1)]
    cuts[1] = 0 if WORLD > 2 else cuts[1]  # an empty shard on rank 0 when W > 2
    s = slice(cuts[RANK], cuts[RANK + 1])
    be = DistributedBackend()
    return {
        "dot": float(abs(be.dot(a[s], b[s]) - a @ b)),
        "norm": float(abs(be.norm(a[s]) - a.norm())),
        "inner_rows": float((be.inner_rows(A[:, s], B[:, s]) - A @ B.T).abs().max()),
        "all_reduce_sum": float((be.all_reduce_sum(A[:, s].sum(1)) - A.sum(1)).abs().max()),
        "rank": be.rank,
        "is_main": is_main_process(),
    }


# --------------------------------------------------------------------------
# FSDP2
# --------------------------------------------------------------------------

FSDP_SIZES = [[3 + r, 2 * r + 1] for r in range(WORLD)]  # same count, different sizes
FSDP_ALL = [make_batches(s, seed=10 + r) for r, s in enumerate(FSDP_SIZES)]


def _sharded_mlp() -> nn.Module:
    if not _torch_compat.fsdp2_runs_on_cpu():
        raise RuntimeError(f"FSDP2 runs on CPU from torch 2.6 (this is torch {torch.__version__})")
    fully_shard = _torch_compat.fully_shard()  # moved to torch.distributed.fsdp in 2.6

    model = mlp()
    fully_shard(model[0])
    fully_shard(model[2])
    fully_shard(model)
    return model


def _shard(global_vec: torch.Tensor, ref_op: HessianOperator, rank: int = RANK) -> torch.Tensor:
    """Rank ``rank``'s piece of a global vector, in NOTE [sharded vector layout] order."""
    pieces = []
    for view in ref_op.layout.split_rows(global_vec.reshape(-1, ref_op.size)):
        chunks = torch.chunk(view[0], WORLD, dim=0)
        pieces.append(chunks[rank].reshape(-1) if len(chunks) > rank else view.new_empty(0))
    return torch.cat(pieces)


def _unshard(pieces: list[torch.Tensor], ref_op: HessianOperator) -> torch.Tensor:
    """The global rows ``(b, n)`` whose pieces on the ranks are ``pieces[r] (b, n_r)``."""
    where = torch.arange(ref_op.size, dtype=torch.float64)
    out = pieces[0].new_empty(pieces[0].shape[0], ref_op.size)
    for r, rows in enumerate(pieces):
        out[:, _shard(where, ref_op, r).long()] = rows
    return out


def _rank_probes(
    ref_op: HessianOperator, seed: int, rows: int, distribution: str, same_stream: bool = False
) -> torch.Tensor:
    """The global probe rows ``(rows, n)`` that a randomized algorithm seeded ``seed`` draws on
    sharded vectors in one draw: each rank its own piece from its own stream (seed +
    1_000_003 · rank, ``make_generator``), in float64 on the CPU. ``same_stream``: as if every
    rank drew from rank 0's stream (the pieces of a probe then repeat each other), the mistake
    the per-rank streams avoid."""
    where = torch.arange(ref_op.size, dtype=torch.float64)
    pieces = []
    for r in range(WORLD):
        n_r = _shard(where, ref_op, r).numel()
        g = torch.Generator().manual_seed(seed + 1_000_003 * (0 if same_stream else r))
        if distribution == "gaussian":
            pieces.append(torch.randn(rows, n_r, generator=g, dtype=torch.float64))
        else:
            signs = torch.randint(0, 2, (rows, n_r), generator=g, dtype=torch.int8)
            pieces.append(signs.to(torch.float64).mul_(2).sub_(1))
    return _unshard(pieces, ref_op)


def _vectors_err(
    local: torch.Tensor, ref_rows: torch.Tensor, ref_op: HessianOperator, backend: Any
) -> float:
    """Largest distance, over whole vectors (every rank's piece), between sharded unit rows
    ``local (k, n_r)`` and global unit rows ``ref_rows (k, n)``, each sign aligned."""
    shards = torch.stack([_shard(x, ref_op) for x in ref_rows.to(torch.float64)])
    local = local.to(torch.float64)
    signs = torch.sign(backend.all_reduce_sum((local * shards).sum(1)))
    diff = local - signs.unsqueeze(1) * shards
    return float(backend.all_reduce_sum(diff.square().sum(1)).sqrt().max())


class _TiedTokens(nn.Module):
    """An embedding with a padding row whose weight is also the output head."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.emb = nn.Embedding(7, 4, padding_idx=2)
        self.mix = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(
            torch.tanh(self.mix(self.emb(x))).mean(1), self.emb.weight
        )


def _tied_tokens_batch(r: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(40 + r)
    ids = torch.randint(0, 7, (r + 2, 5), generator=g)
    ids[:, -1] = 2
    return ids, torch.randint(0, 7, (r + 2,), generator=g)


@check
def fsdp_tied_padding_finite_difference() -> dict[str, Any]:
    """NOTE [padding rows] under FSDP finite differences: the padding lookup reads the row of θ
    (one rank holds it), the tied head's use of it keeps its curvature."""
    if not _torch_compat.fsdp2_runs_on_cpu():
        return {"skip": f"FSDP2 runs on CPU from torch 2.6 (this is torch {torch.__version__})"}
    union = [_tied_tokens_batch(r) for r in range(WORLD)]
    ref = HessianOperator(_TiedTokens().double(), union, loss_fn)
    model = _TiedTokens().double()
    _torch_compat.fully_shard()(model)
    op = hd.FSDPHessianOperator(model, [union[RANK]], loss_fn)
    V = rand(ref.size, 3, seed=9)
    RV = (ref @ V.T).T
    got = op.matmat(torch.stack([_shard(x, ref) for x in V]).T.contiguous()).T
    pad_row = ref @ torch.eye(ref.size, dtype=torch.float64)[:, 8:12]
    return {
        "vs_autograd": err(got, torch.stack([_shard(x, ref) for x in RV])),
        "pad_row_norm": float(pad_row.norm()),
    }


@check
def fsdp_finite_difference() -> dict[str, Any]:
    try:
        model = _sharded_mlp()
    except Exception as exc:  # fully_shard unavailable on this build
        return {"skip": f"fully_shard failed: {type(exc).__name__}: {exc}"}
    # an eval forward first: FSDP keeps the root unsharded afterwards (see _set_shards)
    with torch.no_grad():
        model(ALL[0][0])
    union = [b for r in range(WORLD) for b in FSDP_ALL[r]]
    ref = HessianOperator(mlp(), union, loss_fn)
    ref_fd = HessianOperator(mlp(), union, loss_fn, method="finite_difference")
    op = hd.FSDPHessianOperator(model, FSDP_ALL[RANK], loss_fn)
    v = rand(ref.size)
    V = rand(ref.size, 3, seed=8)
    hv = op @ _shard(v, ref)
    HV = op.matmat(torch.stack([_shard(x, ref) for x in V]).T.contiguous())
    local = [p.to_local().detach().clone() for p in model.parameters()]
    hv2 = op @ _shard(v, ref)
    out: dict[str, Any] = {
        "size_local": op.size,
        "global_size": op.global_size,
        "size_global": ref.size,
        "vs_fd": err(hv, _shard(ref_fd @ v, ref)),
        "vs_autograd": err(hv, _shard(ref @ v, ref)),
        "block_vs_fd": err(HV.T, torch.stack([_shard(x, ref) for x in (ref_fd @ V.T).T])),
        "repeat": err(hv2, hv),
        "params_restored": all(
            torch.equal(p.to_local(), s) for p, s in zip(model.parameters(), local, strict=True)
        ),
        "grads_none": all(p.grad is None for p in model.parameters()),
        "backend": type(op.backend).__name__,
    }
    try:
        from hessian_eigenthings.algorithms.lanczos import lanczos
    except ImportError as exc:
        out["lanczos"] = f"skip: {exc}"
        return out
    # ncv below every rank's local size: lanczos caps ncv by op.size, the local size
    t0 = time.perf_counter()
    res = lanczos(op, k=2, seed=0, backend=op.backend, tol=1e-6, ncv=10)
    out["lanczos_seconds"] = time.perf_counter() - t0
    out["lanczos_matvecs"] = op.num_matvecs
    ref_res = lanczos(ref, k=2, seed=0, tol=1e-6, ncv=10)
    out["lanczos"] = err(res.eigenvalues.to(torch.float64), ref_res.eigenvalues.to(torch.float64))
    out["lanczos_same_on_ranks"] = gather_equal(res.eigenvalues)
    return out


@check
def fsdp_failures() -> dict[str, Any]:
    try:
        model = _sharded_mlp()
    except Exception as exc:
        return {"skip": f"fully_shard failed: {type(exc).__name__}: {exc}"}
    bad = WORLD - 1

    calls = {"n": 0}

    def late_failing(m: nn.Module, batch: Any) -> torch.Tensor:
        logits = m(batch[0])  # the FSDP collectives of the forward are done
        calls["n"] += 1
        if bad == RANK and calls["n"] == 3:
            raise ArithmeticError("boom on purpose")
        return F.cross_entropy(logits, batch[1])

    op = hd.FSDPHessianOperator(model, FSDP_ALL[RANK], late_failing)
    union = [b for r in range(WORLD) for b in FSDP_ALL[r]]
    ref = HessianOperator(mlp(), union, loss_fn)
    v = rand(ref.size)
    res: dict[str, Any] = {"loss": _expect_raise(lambda: op @ _shard(v, ref))}
    res["after"] = err(op @ _shard(v, ref), _shard(ref @ v, ref))  # recovered
    uneven = FSDP_ALL[RANK][: 1 if RANK == 0 else 2]
    op2 = hd.FSDPHessianOperator(model, uneven, loss_fn)
    res["uneven_batches"] = _expect_raise(lambda: op2 @ _shard(v, ref))
    res["autograd"] = _expect_raise(
        lambda: hd.FSDPHessianOperator(model, uneven, loss_fn, method="autograd")
    )
    res["ddp_on_sharded"] = _expect_raise(lambda: hd.DDPHessianOperator(model, uneven, loss_fn))
    res["not_sharded"] = _expect_raise(lambda: hd.FSDPHessianOperator(mlp(), uneven, loss_fn))
    return res


@check
def fsdp_toy_curvature() -> dict[str, Any]:
    """A curvature the package does not know (tests/operators/toy_curvature.py) on an FSDP2-sharded
    model, built as a user would: given Sharded ranks and engine="functional" (its
    functional_product on the whole model gathered per chunk, NOTE [gathered functional
    product]); no class or code of its own. Uneven shards: each rank's two batches differ in size
    from the other ranks'."""
    from tests.operators.toy_curvature import BatchGradientOuterProduct

    try:
        model = _sharded_mlp()
    except Exception as exc:
        return {"skip": f"fully_shard failed: {type(exc).__name__}: {exc}"}
    snap = [p.to_local().detach().clone() for p in model.parameters()]
    union = [b for r in range(WORLD) for b in FSDP_ALL[r]]
    ref = BatchGradientOuterProduct(mlp(), union, loss_fn)

    def toy(**options: Any) -> Any:
        return BatchGradientOuterProduct(
            model, FSDP_ALL[RANK], loss_fn, ranks=hd.Sharded(model), engine="functional", **options
        )

    op, blocks = toy(), toy(max_block_size=2)
    v, V = rand(ref.size), rand(ref.size, 3, seed=8)
    hv = op @ _shard(v, ref)
    pieces = torch.stack([_shard(x, ref) for x in V])
    HV = op.matmat(pieces.T.contiguous()).T
    ref_pieces = torch.stack([_shard(x, ref) for x in (ref @ V.T).T])
    # the package's own curvatures take the same ranks: the Hessian's functional product against
    # the sharded layer walk and one process
    ref_h = HessianOperator(mlp(), union, loss_fn)
    hess = HessianOperator(
        model, FSDP_ALL[RANK], loss_fn, ranks=hd.Sharded(model), engine="functional"
    )
    walk = hd.FSDPHessianOperator(model, FSDP_ALL[RANK], loss_fn, engine="layers", layers="")
    no_engine = _expect_raise(
        lambda: BatchGradientOuterProduct(model, FSDP_ALL[RANK], loss_fn, ranks=hd.Sharded(model))
    )
    return {
        "matvec": err(hv, _shard(ref @ v, ref)),
        "matmat": err(HV, ref_pieces),
        "blocks": err(blocks.matmat(pieces.T.contiguous()).T, ref_pieces),
        "repeat": err(op @ _shard(v, ref), hv),
        "hessian": err(hess @ _shard(v, ref), _shard(ref_h @ v, ref)),
        "hessian_vs_walk": err(hess @ _shard(v, ref), walk @ _shard(v, ref)),
        "size_local": op.size,
        "size_global": ref.size,
        "global_size": op.global_size,
        "backend": type(op.backend).__name__,
        "engine": op.engine,
        "forwards": op.num_forwards,
        "params_unchanged": all(
            torch.equal(p.to_local(), s) for p, s in zip(model.parameters(), snap, strict=True)
        ),
        "grads_none": all(p.grad is None for p in model.parameters()),
        "no_engine": no_engine,
    }


@check
def fsdp_method_layers_deprecated() -> dict[str, Any]:
    """method="layers" on FSDPHessianOperator: the deprecated spelling of engine="layers", same
    products, a DeprecationWarning subclass at the caller's line."""
    import inspect

    try:
        model = _sharded_mlp()
    except Exception as exc:
        return {"skip": f"fully_shard failed: {type(exc).__name__}: {exc}"}
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        line = inspect.currentframe().f_lineno + 1  # type: ignore[union-attr]
        old = hd.FSDPHessianOperator(model, FSDP_ALL[RANK], loss_fn, method="layers", layers="")
    new = hd.FSDPHessianOperator(model, FSDP_ALL[RANK], loss_fn, engine="layers", layers="")
    union = [b for r in range(WORLD) for b in FSDP_ALL[r]]
    ref = HessianOperator(mlp(), union, loss_fn)
    v = rand(ref.size)
    deprecations = [r for r in rec if issubclass(r.category, DeprecationWarning)]
    first = deprecations[0] if deprecations else None
    return {
        "warnings": [f"{r.category.__name__}: {r.message}" for r in rec],
        "deprecations": len(deprecations),
        "category": None if first is None else first.category.__name__,
        "message": None if first is None else str(first.message),
        "at_caller": first is not None and (first.filename, first.lineno) == (__file__, line),
        "same_products": torch.equal(old @ _shard(v, ref), new @ _shard(v, ref)),
        "exact": err(new @ _shard(v, ref), _shard(ref @ v, ref)),
        "both_spellings": _expect_raise(
            lambda: hd.FSDPHessianOperator(
                model,
                FSDP_ALL[RANK],
                loss_fn,
                method="finite_difference",
                engine="layers",
                layers="",
            )
        ),
    }


def _walk_lm(m: nn.Module, b: Any) -> torch.Tensor:
    logits = m(input_ids=b["input_ids"], attention_mask=b["attention_mask"], use_cache=False).logits
    return F.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]), b["input_ids"][:, 1:].reshape(-1)
    )


def _walk_batch(r: int) -> dict[str, torch.Tensor]:
    """Rank ``r``'s batch: ``r + 1`` rows of 7 tokens, its last row padded: uneven token counts."""
    g = torch.Generator().manual_seed(100 + r)
    ids = torch.randint(0, 50, (r + 1, 7), generator=g)
    mask = torch.ones(r + 1, 7, dtype=torch.long)
    mask[-1, 4 + r % 2 :] = 0
    ids[mask == 0] = 1  # the padding id of the Llama models (NOTE [padding rows])
    return {"input_ids": ids, "attention_mask": mask}


def _walk_model(kind: str) -> tuple[nn.Module, str]:
    import transformers

    torch.manual_seed(0)
    if kind in ("gpt2", "gpt2_sdpa"):
        cfg = transformers.GPT2Config(
            n_layer=2,
            n_embd=16,
            n_head=2,
            vocab_size=50,
            n_positions=32,
            attn_pdrop=0.0,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
        )
        attention = "sdpa" if kind == "gpt2_sdpa" else "eager"
        return transformers.GPT2LMHeadModel._from_config(
            cfg, attn_implementation=attention
        ).double().eval(), "transformer.h"
    cfg = transformers.LlamaConfig(
        num_hidden_layers=2,
        hidden_size=16,
        intermediate_size=32,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=50,
        max_position_embeddings=32,
        tie_word_embeddings=kind == "llama_tied",
        # a padding row (NOTE [padding rows]): held by one rank's shard of the embedding; tied,
        # the head's use of the row keeps its curvature
        pad_token_id=1,
    )
    return transformers.LlamaForCausalLM._from_config(
        cfg, attn_implementation="eager"
    ).double().eval(), "model.layers"


@check
def fsdp_layer_walk() -> dict[str, Any]:
    """NOTE [sharded layer walk]: exact sharded products against one process on the union of the
    ranks' batches (the functional engine for Llama: its eager softmax runs in float32, where
    forward-over-reverse and reverse-over-reverse differ by its rounding), and a sharded Lanczos."""
    import copy

    if not _torch_compat.fsdp2_runs_on_cpu():
        return {"skip": f"FSDP2 runs on CPU from torch 2.6 (this is torch {torch.__version__})"}
    try:
        import transformers  # noqa: F401
    except ImportError:
        return {"skip": "needs transformers"}
    fully_shard = _torch_compat.fully_shard()
    union = [_walk_batch(r) for r in range(WORLD)]
    out: dict[str, Any] = {}
    kinds = ("gpt2", "llama_tied", "llama_untied")
    models = [_walk_model(kind) for kind in kinds]
    refs = [
        HessianOperator(
            copy.deepcopy(model),
            union,
            _walk_lm,
            engine="autograd" if kind == "gpt2" else "functional",
        )
        for kind, (model, _) in zip(kinds, models, strict=True)
    ]
    # each model's reference products on one rank, the ranks working at once (the functional
    # engine's first product traces the model: ~2.5 s alone, ~10 s with four ranks on two cores)
    Xs = [torch.cat([rand(ref.size, 1, seed=5), rand(ref.size, 2, seed=6)]) for ref in refs]
    RXs = [
        (ref @ X.T).T.contiguous() if i % WORLD == RANK else torch.empty_like(X)
        for i, (ref, X) in enumerate(zip(refs, Xs, strict=True))
    ]
    for i, RX in enumerate(RXs):
        dist.broadcast(RX, src=i % WORLD)
    for kind, (model, layers), ref, X, RX in zip(kinds, models, refs, Xs, RXs, strict=True):
        for block in model.get_submodule(layers):
            fully_shard(block)
        fully_shard(model)
        op = hd.FSDPHessianOperator(
            model, [_walk_batch(RANK)], _walk_lm, engine="layers", layers=layers
        )
        pieces = torch.stack([_shard(x, ref) for x in X])
        ref_pieces = torch.stack([_shard(x, ref) for x in RX])
        out[kind] = {
            "tied": model.get_output_embeddings().weight is model.get_input_embeddings().weight,
            "padding": model.get_input_embeddings().padding_idx is not None,
            "size_local": op.size,
            "size_global": ref.size,
            "product": err(op @ pieces[0], ref_pieces[0]),
            "block": err(op.matmat(pieces[1:].T.contiguous()).T, ref_pieces[1:]),
            "grads_none": all(p.grad is None for p in model.parameters()),
        }
        # four ranks on a 2-core CI machine are slow: products only there
        if kind == "gpt2" and WORLD < 4:
            out[kind]["lanczos"] = _lanczos_top5(op, ref)
            # HF's default attention (SDPA), whose flash kernel has no forward-mode derivative:
            # the walk runs its math kernel, and equals the eager model's product
            sdpa, _ = _walk_model("gpt2_sdpa")
            for block in sdpa.get_submodule(layers):
                fully_shard(block)
            fully_shard(sdpa)
            op_sdpa = hd.FSDPHessianOperator(
                sdpa, [_walk_batch(RANK)], _walk_lm, engine="layers", layers=layers
            )
            out["gpt2_sdpa"] = err(op_sdpa @ pieces[0], ref_pieces[0])
    return out


def _lanczos_top5(op: hd.FSDPHessianOperator, ref: HessianOperator) -> dict[str, Any]:
    """A sharded Lanczos for the top 5 against the same call in one process (the start vectors
    differ: a sharded one draws each piece from its rank's stream)."""
    from hessian_eigenthings.algorithms import lanczos

    res = lanczos(op, k=5, seed=0, tol=1e-8, backend=op.backend)
    ref_res = lanczos(ref, k=5, seed=0, tol=1e-8)
    return {
        "values": err(res.eigenvalues, ref_res.eigenvalues),
        "vectors": _vectors_err(res.eigenvectors, ref_res.eigenvectors, ref, op.backend),
        "converged": bool(res.converged.all()) and bool(ref_res.converged.all()),
        "products": res.iterations,
        "same_on_ranks": gather_equal(res.eigenvalues),
    }


def _walk_forward(m: nn.Module, b: Any) -> torch.Tensor:
    batch = b[0]  # (the batch, its next-token targets)
    logits = m(
        input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False
    ).logits
    return logits[:, :-1].reshape(-1, logits.shape[-1])


def _walk_per_token(m: nn.Module, b: Any) -> torch.Tensor:
    logits = m(input_ids=b["input_ids"], attention_mask=b["attention_mask"], use_cache=False).logits
    return F.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]),
        b["input_ids"][:, 1:].reshape(-1),
        reduction="none",
    ).reshape(b["input_ids"].shape[0], -1)


@check
def fsdp_walk_sandwiches() -> dict[str, Any]:
    """The sharded GGN (exact: against one process; Monte-Carlo: against DDP, whose draws are keyed
    by rank alike) and the sharded empirical Fisher (against one process), on HF GPT-2 and Llama
    (tied and untied embeddings)."""
    import copy

    from hessian_eigenthings.loss_fns import supervised_loss_of_output

    if not _torch_compat.fsdp2_runs_on_cpu():
        return {"skip": f"FSDP2 runs on CPU from torch 2.6 (this is torch {torch.__version__})"}
    try:
        import transformers  # noqa: F401
    except ImportError:
        return {"skip": "needs transformers"}
    fully_shard = _torch_compat.fully_shard()
    loss = supervised_loss_of_output(nn.CrossEntropyLoss())

    def data(r: int) -> Any:
        b = _walk_batch(r)
        return (b, b["input_ids"][:, 1:].reshape(-1))

    union = [data(r) for r in range(WORLD)]
    per_token = type(
        "PerToken",
        (),
        {
            "__call__": staticmethod(_walk_per_token),
            "sample_count": staticmethod(lambda b: b["input_ids"][:, 1:].numel()),
        },
    )()
    out: dict[str, Any] = {}
    for kind in ("gpt2", "llama_tied", "llama_untied"):
        model, layers = _walk_model(kind)
        replica = copy.deepcopy(model)
        for block in model.get_submodule(layers):
            fully_shard(block)
        fully_shard(model)
        ref = GGNOperator(replica, union, _walk_forward, loss)
        op = hd.FSDPGGNOperator(model, [data(RANK)], _walk_forward, loss, layers=layers)
        v = rand(ref.size, seed=7)
        res: dict[str, Any] = {"ggn": err(op @ _shard(v, ref), _shard(ref @ v, ref))}
        mc = {"mc_samples": 2, "seed": 4}
        ddp = hd.DDPGGNOperator(replica, [data(RANK)], _walk_forward, loss, **mc)
        op_mc = hd.FSDPGGNOperator(model, [data(RANK)], _walk_forward, loss, layers=layers, **mc)
        mc_v = op_mc @ _shard(v, ref)
        res["ggn_mc_vs_ddp"] = err(mc_v, _shard(ddp @ v, ref))
        # the draws happened: two samples are far from the exact GGN (else the line above is moot)
        res["ggn_mc_vs_exact"] = err(mc_v, _shard(ref @ v, ref))
        ref_ef = EmpiricalFisherOperator(replica, [_walk_batch(r) for r in range(WORLD)], per_token)
        op_ef = hd.FSDPEmpiricalFisherOperator(model, [_walk_batch(RANK)], per_token, layers=layers)
        res["fisher"] = err(op_ef @ _shard(v, ref), _shard(ref_ef @ v, ref))
        res["tied"] = model.get_output_embeddings().weight is model.get_input_embeddings().weight
        out[kind] = res
    return out


@check
def ddp_kronecker_factors() -> dict[str, Any]:
    """DDPKFACOperator and DDPEKFACOperator (type-2 and empirical Fisher): each rank's factor pass
    on its own batches, summed over the ranks, gives the factors of the union (one process)."""
    from hessian_eigenthings.loss_fns import supervised_forward, supervised_loss_of_output
    from hessian_eigenthings.operators import EKFACOperator, KFACOperator

    loss = supervised_loss_of_output(nn.CrossEntropyLoss())
    v = rand(sum(p.numel() for p in mlp().parameters()), seed=12)
    out: dict[str, Any] = {}
    for fisher in ("type2", "empirical"):
        for name, ddp_cls, cls in (
            ("kfac", hd.DDPKFACOperator, KFACOperator),
            ("ekfac", hd.DDPEKFACOperator, EKFACOperator),
        ):
            op = ddp_cls(mlp(), MINE, supervised_forward, loss, fisher_type=fisher)
            ref = cls(mlp(), ALL, supervised_forward, loss, fisher_type=fisher)
            out[f"{name}_{fisher}"] = err(op @ v, ref @ v)
    return out


@check
def sharded_solves() -> dict[str, Any]:
    """CG on the sharded GGN and MINRES on the sharded Hessian (both by the exact walk, sharded
    vectors through op.backend) against the same solves in one process on the union."""
    from hessian_eigenthings.algorithms.solve import solve
    from hessian_eigenthings.loss_fns import supervised_forward, supervised_loss_of_output

    try:
        model = _sharded_mlp()
    except Exception as exc:
        return {"skip": f"fully_shard failed: {type(exc).__name__}: {exc}"}
    union = [b for r in range(WORLD) for b in FSDP_ALL[r]]
    loss = supervised_loss_of_output(nn.CrossEntropyLoss())
    ref_ggn = GGNOperator(mlp(), union, supervised_forward, loss)
    ref_h = HessianOperator(mlp(), union, loss_fn)
    ggn = hd.FSDPGGNOperator(model, FSDP_ALL[RANK], supervised_forward, loss, layers="")
    hess = hd.FSDPHessianOperator(model, FSDP_ALL[RANK], loss_fn, engine="layers", layers="")
    b = rand(ref_h.size, seed=11)
    cg = solve(ggn, _shard(b, ref_h), damping=0.1, tol=1e-10)
    cg_ref = solve(ref_ggn, b, damping=0.1, tol=1e-10)
    mr = solve(hess, _shard(b, ref_h), damping=0.5, method="minres", tol=1e-10)
    mr_ref = solve(ref_h, b, damping=0.5, method="minres", tol=1e-10)
    return {
        "cg": err(cg.x, _shard(cg_ref.x, ref_h)),
        "cg_converged": bool(torch.as_tensor(cg.converged).all()),
        "minres": err(mr.x, _shard(mr_ref.x, ref_h)),
        "minres_converged": bool(torch.as_tensor(mr.converged).all()),
    }


def _sharded_mlp_hessian() -> tuple[hd.FSDPHessianOperator, HessianOperator, torch.Tensor]:
    """The exact walk of the sharded MLP on this rank's first batch, the one-process operator on
    the union of those batches, and its dense float64 Hessian ``(n, n)`` (rank 58 of 66: the
    softmax's shift invariance leaves 8 null directions)."""
    model = _sharded_mlp()
    union = [FSDP_ALL[r][0] for r in range(WORLD)]
    ref = HessianOperator(mlp(), union, loss_fn)
    H = ref @ torch.eye(ref.size, dtype=torch.float64)
    op = hd.FSDPHessianOperator(model, FSDP_ALL[RANK][:1], loss_fn, engine="layers", layers="")
    return op, ref, 0.5 * (H + H.T)


class _ShardedDense(LambdaOperator):
    """A dense symmetric ``H (n, n)`` on sharded vectors in the layout of ``_shard``: one
    product is the all-reduce of the ranks' ``H[:, piece_r] v_r``, then each rank keeps its
    piece. The algorithms see it as they see a sharded operator (``backend``, ``global_size``,
    local ``size``), at the cost of a tiny matrix product: for the estimators that need
    hundreds of products (a sharded walk product of the MLP costs ~40 ms here)."""

    def __init__(self, H: torch.Tensor, ref_op: HessianOperator) -> None:
        self.rows = _shard(torch.arange(H.shape[0], dtype=torch.float64), ref_op).long()
        self.H = H
        self.backend = DistributedBackend()
        self.global_size = H.shape[0]
        super().__init__(self._vector, self.rows.numel(), dtype=H.dtype, matmat_fn=self._block)

    def _block(self, V: torch.Tensor) -> torch.Tensor:
        return self.backend.all_reduce_sum(V @ self.H[self.rows])[:, self.rows]

    def _vector(self, v: torch.Tensor) -> torch.Tensor:
        return self._block(v.unsqueeze(0))[0]


def _top5_vs_dense(res: Any, H: torch.Tensor, ref: HessianOperator, backend: Any) -> dict[str, Any]:
    """A sharded top-5 (by |λ|) against the dense eigendecomposition of ``H``."""
    evals, evecs = torch.linalg.eigh(H)
    top = evals.abs().argsort(descending=True)[:5]
    return {
        "values": err(res.eigenvalues, evals[top]),
        "vectors": _vectors_err(res.eigenvectors, evecs[:, top].T, ref, backend),
        "converged": bool(res.converged.all()),
        "products": res.iterations,
        "same_on_ranks": gather_equal(res.eigenvalues),
    }


@check
def sharded_eigensolvers() -> dict[str, Any]:
    """Lanczos top-5 (a thick restart; blocks of 2) and power iteration on sharded vectors, every
    reduction through op.backend, against the dense float64 Hessian of the union: on
    ``_ShardedDense``, and power iteration on the sharded MLP's exact walk too (not on four
    ranks)."""
    from hessian_eigenthings.algorithms import lanczos, power_iteration_one

    try:
        walk, ref, H = _sharded_mlp_hessian()
    except Exception as exc:  # fully_shard unavailable on this build
        return {"skip": f"fully_shard failed: {type(exc).__name__}: {exc}"}
    dense = _ShardedDense(H, ref)
    out: dict[str, Any] = {"ncv": 11}
    # ncv=11 is far below the products the run needs: the basis is restarted thick
    for name, kw in (("default", {}), ("restart", {"ncv": 11}), ("block", {"block_size": 2})):
        res = lanczos(dense, k=5, seed=0, tol=1e-10, backend=dense.backend, **kw)
        out[f"lanczos_{name}"] = _top5_vs_dense(res, H, ref, dense.backend)
    evals, evecs = torch.linalg.eigh(H)
    first = int(evals.abs().argmax())
    # four ranks on a 2-core CI machine: the walk's ~80 products only on two and three
    for name, op in (("walk", walk), ("dense", dense)) if WORLD < 4 else (("dense", dense),):
        pi = power_iteration_one(op, max_iter=500, tol=1e-8, seed=1, backend=op.backend)
        out[f"power_{name}"] = {
            "value": abs(pi.eigenvalue - float(evals[first])) / abs(float(evals[first])),
            "vector": _vectors_err(
                pi.eigenvector.unsqueeze(0), evecs[:, first : first + 1].T, ref, op.backend
            ),
            "converged": pi.converged,
            "products": pi.iterations,
            "same_on_ranks": gather_equal(torch.tensor([pi.eigenvalue, pi.residual])),
        }
    return out


@check
def sharded_estimators() -> dict[str, Any]:
    """Hutchinson, Hutch++, XTrace and SLQ on sharded vectors (``_ShardedDense`` of the sharded
    MLP's Hessian) against the dense Hessian: Hutchinson's samples are the quadratic forms of
    the probes the ranks' streams give; Hutch++ and XTrace are exact once their sketch spans
    range(H); SLQ's first two moments per run are those of its Rademacher start vector, and
    its nodes are eigenvalues of H once the Krylov space is exhausted."""
    from hessian_eigenthings.algorithms import hutch_plus_plus, hutchinson, spectral_density, xtrace

    try:
        _op, ref, H = _sharded_mlp_hessian()
    except Exception as exc:
        return {"skip": f"fully_shard failed: {type(exc).__name__}: {exc}"}
    op = _ShardedDense(H, ref)
    n = ref.size
    evals = torch.linalg.eigvalsh(H)
    rank = int((evals.abs() > 1e-10 * evals.abs().max()).sum())
    out: dict[str, Any] = {"rank_H": rank, "sizes": [n, op.size]}
    trace = float(H.trace())
    scale = float(H.norm())  # ||H||_F: the size of one probe's error, so of its rounding too
    hu = hutchinson(op, num_samples=96, distribution="gaussian", seed=11, block_size=96)
    Z, Z_same = (_rank_probes(ref, 11, 96, "gaussian", same) for same in (False, True))
    out["hutchinson"] = {
        "samples": err(hu.samples, ((Z @ H) * Z).sum(1)),
        "vs_same_stream": err(hu.samples, ((Z_same @ H) * Z_same).sum(1)),
        "estimate_minus_trace_in_stderrs": abs(hu.estimate - trace) / hu.stderr,
        "same_on_ranks": gather_equal(hu.samples),
    }
    # more sketch probes than rank(H): the sketch spans range(H), the deflated rest is zero
    hpp = hutch_plus_plus(op, num_matvecs=3 * (rank + 2), seed=12)
    xt = xtrace(op, num_matvecs=2 * (rank + 2), seed=13)
    out["hutch++"] = {
        "estimate": abs(hpp.estimate - trace) / scale,
        "same_on_ranks": gather_equal(hpp.samples),
    }
    out["xtrace"] = {
        "estimate": abs(xt.estimate - trace) / scale,
        "same_on_ranks": gather_equal(xt.samples),
    }
    # SLQ run i from the Rademacher z_i (|z_i|² = n): Σ_j w_ij θ_ij^p = z_iᵀ H^p z_i / n, p = 1, 2
    sd = spectral_density(op, num_runs=3, lanczos_steps=n, seed=14, num_grid_points=50)
    Z, Z_same = (_rank_probes(ref, 14, 3, "rademacher", same) for same in (False, True))
    nodes, w = sd.raw_eigenvalues.nan_to_num(), sd.raw_weights
    HZ = Z @ H
    weighty = sd.raw_weights > 1e-12
    node_gap = (sd.raw_eigenvalues[weighty].unsqueeze(1) - evals.unsqueeze(0)).abs().min(1).values
    out["slq"] = {
        "first_moment": err((w * nodes).sum(1), (Z * HZ).sum(1) / n),
        "second_moment": err((w * nodes.square()).sum(1), HZ.square().sum(1) / n),
        "vs_same_stream": err((w * nodes).sum(1), (Z_same * (Z_same @ H)).sum(1) / n),
        "weights_sum": float((w.sum(1) - 1).abs().max()),
        "nodes_are_eigenvalues": float(node_gap.max() / evals.abs().max()),
        "steps": sd.raw_eigenvalues.shape[1],
        "same_on_ranks": gather_equal(sd.raw_weights) and gather_equal(nodes),
    }
    return out


class _Interrupted(Exception):
    pass


def _count_products(op: Any, stop: int | None = None) -> dict[str, int]:
    """Count ``op``'s products from now on (a block of ``b`` counts ``b``), raising
    ``_Interrupted`` at product ``stop``: every rank makes the same products, so all stop at
    once (as a job killed on every node). ``_uncount(op)`` puts the operator back."""
    count = {"n": 0}
    matvec, matmat = op.matvec, op.matmat

    def tick(b: int) -> None:
        count["n"] += b
        if stop is not None and count["n"] >= stop:
            raise _Interrupted(f"interrupted at product {count['n']}")

    def counted_matvec(v: torch.Tensor) -> torch.Tensor:
        tick(1)
        return matvec(v)

    def counted_matmat(V: torch.Tensor) -> torch.Tensor:
        tick(V.shape[1])
        return matmat(V)

    op.matvec, op.matmat = counted_matvec, counted_matmat
    return count


def _uncount(op: Any) -> None:
    del op.matvec, op.matmat


def _resume_lanczos(
    op: Any, ref: HessianOperator, folder: Any, every: int | None, stop: int, **kw: Any
) -> dict[str, Any]:
    """``lanczos(op, **kw)`` with a checkpoint file per rank, interrupted on every rank at
    product ``stop``, then resumed: against the uninterrupted call."""
    from hessian_eigenthings.algorithms import lanczos

    plain = lanczos(op, **kw)
    path = folder / f"lanczos_rank{RANK}.pt"
    _count_products(op, stop)
    stopped = _expect_raise(lambda: lanczos(op, checkpoint=path, checkpoint_every=every, **kw))
    _uncount(op)
    dist.barrier()  # every rank has saved before it stopped
    where = torch.arange(ref.size, dtype=torch.float64)
    files = [folder / f"lanczos_rank{r}.pt" for r in range(WORLD)]
    states = [torch.load(f, weights_only=True)["state"] if f.exists() else None for f in files]
    dist.barrier()  # every rank has read the others' files before they are resumed (and removed)
    count = _count_products(op)
    resumed = lanczos(op, checkpoint=path, checkpoint_every=every, **kw)
    _uncount(op)
    fields = ("eigenvalues", "eigenvectors", "residuals", "converged")
    return {
        "products": plain.iterations,
        "stopped": stopped["type"],
        "stop": stop,
        # one file per rank, holding that rank's piece of the basis
        "files_hold_pieces": all(
            st is not None and st["V"].shape[1] == _shard(where, ref, r).numel()
            for r, st in enumerate(states)
        ),
        "saved_products": None if states[RANK] is None else states[RANK]["products"],
        "resumed_products": count["n"],
        "same": resumed.iterations == plain.iterations
        and all(torch.equal(getattr(resumed, f), getattr(plain, f)) for f in fields),
        "file_removed": not path.exists(),
    }


@check
def sharded_checkpoints() -> dict[str, Any]:
    """lanczos(checkpoint=) and spectral_density(checkpoint=) on sharded vectors, each rank with
    its own file: interrupted on every rank, then resumed, they give the uninterrupted result bit
    for bit and spend only the products after the last save. Lanczos on the sharded MLP's walk
    (a save every 5 products), then on ``_ShardedDense`` (saves at thick restarts) and SLQ."""
    from pathlib import Path

    from hessian_eigenthings.algorithms import spectral_density

    try:
        walk, ref, H = _sharded_mlp_hessian()
    except Exception as exc:
        return {"skip": f"fully_shard failed: {type(exc).__name__}: {exc}"}
    folder = Path(sys.argv[1]) / "checkpoints"
    folder.mkdir(exist_ok=True)
    dense = _ShardedDense(H, ref)
    out: dict[str, Any] = {
        # a run of ~25 products (k=1: the walk's products cost ~40 ms each here)
        "walk_every5": _resume_lanczos(walk, ref, folder, 5, 13, k=1, seed=2, tol=1e-6, ncv=4),
        # the default saves at each thick restart (ncv=8: several before product 66)
        "dense_restarts": _resume_lanczos(
            dense, ref, folder, None, 66, k=3, seed=2, tol=1e-10, ncv=8
        ),
    }
    # SLQ: groups of 2 runs x 10 steps; stopped in the second group, the first is not run again
    path = folder / f"density_rank{RANK}.pt"
    kw: dict[str, Any] = dict(
        num_runs=4, lanczos_steps=10, num_grid_points=50, seed=3, checkpoint_runs=2
    )
    whole = spectral_density(dense, checkpoint=folder / f"density_whole_rank{RANK}.pt", **kw)
    _count_products(dense, 25)
    stopped = _expect_raise(lambda: spectral_density(dense, checkpoint=path, **kw))
    _uncount(dense)
    count = _count_products(dense)
    resumed = spectral_density(dense, checkpoint=path, **kw)
    _uncount(dense)
    out["density"] = {
        "stopped": stopped["type"],
        "file": path.exists(),
        "same": torch.equal(resumed.density, whole.density)
        and torch.equal(resumed.raw_weights, whole.raw_weights)
        and torch.equal(resumed.raw_eigenvalues.nan_to_num(), whole.raw_eigenvalues.nan_to_num()),
        "resumed_products": count["n"],
    }
    return out


def main() -> None:
    out_dir = sys.argv[1]
    only = sys.argv[2].split(",") if len(sys.argv) > 2 else list(CHECKS)
    # like pytest's filterwarnings=error: a warning in our code fails its check
    warnings.simplefilter("error")
    # a hang becomes an error after 60 s instead of blocking CI
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    run_checks_and_exit(CHECKS, only, out_dir, RANK)


if __name__ == "__main__":
    main()
