"""One rank of a distributed test group (run by tests/operators/test_distributed.py).

Usage: ``python _dist_worker.py OUT_DIR`` with RANK, WORLD_SIZE, MASTER_ADDR and
MASTER_PORT set. Runs every check in one process group (process start-up is the
expensive part) and writes ``OUT_DIR/rank{r}.json``: per check either its
numbers or the exception it raised. Every rank builds the single-process
reference on the union of all ranks' data itself, so comparisons are local.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import time
import traceback
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import hessian_eigenthings.operators.distributed as hd
from hessian_eigenthings import _torch_compat
from hessian_eigenthings.linalg_distributed import DistributedBackend, is_main_process
from hessian_eigenthings.operators import EmpiricalFisherOperator, GGNOperator, HessianOperator

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
        op = hd.DDPHessianOperator(
            mlp(dtype=dtype), batches[BOUNDS[RANK] : BOUNDS[RANK + 1]], loss_fn
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


def _shard(global_vec: torch.Tensor, ref_op: HessianOperator) -> torch.Tensor:
    """This rank's piece of a global vector, in NOTE [sharded vector layout] order."""
    pieces = []
    for view in ref_op.layout.split_rows(global_vec.reshape(-1, ref_op.size)):
        chunks = torch.chunk(view[0], WORLD, dim=0)
        pieces.append(chunks[RANK].reshape(-1) if len(chunks) > RANK else view.new_empty(0))
    return torch.cat(pieces)


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
    return {"input_ids": ids, "attention_mask": mask}


def _walk_model(kind: str) -> tuple[nn.Module, str]:
    import transformers

    torch.manual_seed(0)
    if kind == "gpt2":
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
        return transformers.GPT2LMHeadModel._from_config(
            cfg, attn_implementation="eager"
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
    # four ranks on a 2-core CI machine are slow: the GPT-2 product only there
    for kind in ("gpt2", "llama_tied", "llama_untied") if WORLD < 4 else ("gpt2",):
        model, layers = _walk_model(kind)
        ref = HessianOperator(
            copy.deepcopy(model),
            union,
            _walk_lm,
            engine="autograd" if kind == "gpt2" else "functional",
        )
        for block in model.get_submodule(layers):
            fully_shard(block)
        fully_shard(model)
        op = hd.FSDPHessianOperator(
            model, [_walk_batch(RANK)], _walk_lm, method="layers", layers=layers
        )
        v = rand(ref.size, seed=5)
        V = rand(ref.size, 2, seed=6)
        out[kind] = {
            "tied": model.get_output_embeddings().weight is model.get_input_embeddings().weight,
            "size_local": op.size,
            "size_global": ref.size,
            "product": err(op @ _shard(v, ref), _shard(ref @ v, ref)),
            "block": err(
                op.matmat(torch.stack([_shard(x, ref) for x in V]).T.contiguous()).T,
                torch.stack([_shard(x, ref) for x in (ref @ V.T).T]),
            ),
            "grads_none": all(p.grad is None for p in model.parameters()),
        }
        if kind == "gpt2" and WORLD < 4:
            from hessian_eigenthings.algorithms.lanczos import lanczos

            res = lanczos(op, k=3, seed=0, backend=op.backend, tol=1e-8, ncv=12)
            ref_res = lanczos(ref, k=3, seed=0, tol=1e-8, ncv=12)
            out[kind]["lanczos"] = err(res.eigenvalues, ref_res.eigenvalues)
            out[kind]["lanczos_converged"] = bool(res.converged.all())
    return out


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
    by rank alike) and the sharded empirical Fisher (against one process), on HF GPT-2."""
    import copy

    from hessian_eigenthings.loss_fns import supervised_loss_of_output

    if not _torch_compat.fsdp2_runs_on_cpu():
        return {"skip": f"FSDP2 runs on CPU from torch 2.6 (this is torch {torch.__version__})"}
    try:
        import transformers  # noqa: F401
    except ImportError:
        return {"skip": "needs transformers"}
    fully_shard = _torch_compat.fully_shard()
    model, layers = _walk_model("gpt2")
    replica = copy.deepcopy(model)
    for block in model.get_submodule(layers):
        fully_shard(block)
    fully_shard(model)
    loss = supervised_loss_of_output(nn.CrossEntropyLoss())

    def data(r: int) -> Any:
        b = _walk_batch(r)
        return (b, b["input_ids"][:, 1:].reshape(-1))

    union = [data(r) for r in range(WORLD)]
    out: dict[str, Any] = {}
    ref = GGNOperator(replica, union, _walk_forward, loss)
    op = hd.FSDPGGNOperator(model, [data(RANK)], _walk_forward, loss, layers=layers)
    v = rand(ref.size, seed=7)
    out["ggn"] = err(op @ _shard(v, ref), _shard(ref @ v, ref))
    mc = {"mc_samples": 2, "seed": 4}
    ddp = hd.DDPGGNOperator(replica, [data(RANK)], _walk_forward, loss, **mc)
    op_mc = hd.FSDPGGNOperator(model, [data(RANK)], _walk_forward, loss, layers=layers, **mc)
    out["ggn_mc_vs_ddp"] = err(op_mc @ _shard(v, ref), _shard(ddp @ v, ref))
    per_token = type(
        "PerToken",
        (),
        {
            "__call__": staticmethod(_walk_per_token),
            "sample_count": staticmethod(lambda b: b["input_ids"][:, 1:].numel()),
        },
    )()
    ref_ef = EmpiricalFisherOperator(replica, [_walk_batch(r) for r in range(WORLD)], per_token)
    op_ef = hd.FSDPEmpiricalFisherOperator(model, [_walk_batch(RANK)], per_token, layers=layers)
    out["fisher"] = err(op_ef @ _shard(v, ref), _shard(ref_ef @ v, ref))
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
    hess = hd.FSDPHessianOperator(model, FSDP_ALL[RANK], loss_fn, method="layers", layers="")
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


def main() -> None:
    out_dir = sys.argv[1]
    only = sys.argv[2].split(",") if len(sys.argv) > 2 else list(CHECKS)
    # like pytest's filterwarnings=error: a warning in our code fails its check
    warnings.simplefilter("error")
    # a hang becomes an error after 60 s instead of blocking CI
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    results: dict[str, Any] = {}
    for name in only:
        t0 = time.perf_counter()
        try:
            results[name] = CHECKS[name]()
        except Exception as exc:
            results[name] = {
                "error": f"{type(exc).__name__}: {exc}",
                "traceback": traceback.format_exc(),
            }
        results[name]["_seconds"] = time.perf_counter() - t0
    with open(os.path.join(out_dir, f"rank{RANK}.json"), "w") as f:
        json.dump(results, f, indent=1, default=str)
    # NOTE [worker exits without the gloo teardown]: on torch 2.4 a rank sometimes aborted while
    # the gloo process group was torn down after the checks ("terminate called without an active
    # exception", exit -6; every test of the module then errored at its fixture). The results are
    # on disk and the barrier shows every rank wrote its own, so the worker leaves at once,
    # without the teardown that can abort.
    dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
