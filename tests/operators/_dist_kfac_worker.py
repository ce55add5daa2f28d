"""One rank of the sharded KFAC/EKFAC checks (run by tests/operators/test_distributed_kfac.py).

Usage: ``python _dist_kfac_worker.py OUT_DIR`` with RANK, WORLD_SIZE, MASTER_ADDR and
MASTER_PORT set. Every rank shards tiny float64 models with FSDP2 (gloo, CPU), builds the FSDP
operators on its own batches (uneven sizes) and the single-process operators on the union of
every rank's batches, compares them shard by shard, and writes ``OUT_DIR/rank{r}.json``: per
check its numbers or the exception it raised.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from _dist_checks import run_sharded_worker  # this folder: the workers run as scripts
from torch import nn

import hessian_eigenthings.operators.distributed as hd
from hessian_eigenthings import _torch_compat
from hessian_eigenthings.loss_fns import supervised_forward, supervised_loss_of_output
from hessian_eigenthings.operators import EKFACOperator, KFACOperator
from hessian_eigenthings.param_utils import ParamLayout

RANK = int(os.environ["RANK"])
WORLD = int(os.environ["WORLD_SIZE"])
CE = supervised_loss_of_output(nn.CrossEntropyLoss())

CHECKS: dict[str, Callable[[], dict[str, Any]]] = {}


def check(fn: Callable[[], dict[str, Any]]) -> Callable[[], dict[str, Any]]:
    CHECKS[fn.__name__] = fn
    return fn


def mlp() -> nn.Module:
    """Rows 7, 4 and 3: on 3 ranks the bias-free layer's last shard is empty."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 4, bias=False), nn.Tanh(), nn.Linear(4, 3)
    ).double()


def inplace_net() -> nn.Module:
    """A layer output changed in place (the factor pass starts again, copying outputs) and a
    LayerNorm, which no block covers (left out with exclude_unsupported)."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(5, 7), nn.ReLU(inplace=True), nn.LayerNorm(7), nn.Linear(7, 3)
    ).double()


def conv_net() -> nn.Module:
    """Conv2d (kernels flattened), a one-channel Conv2d (empty shards from 2 ranks on) and, where
    transformers is installed, its Conv1D (weight stored (in, out): its rows are inputs)."""
    torch.manual_seed(0)
    try:
        from transformers.pytorch_utils import Conv1D

        middle: nn.Module = Conv1D(5, 9)
    except ImportError:
        middle = nn.Linear(9, 5)
    return nn.Sequential(
        nn.Conv2d(2, 3, 3, padding=1),
        nn.Tanh(),
        nn.Conv2d(3, 1, 2),
        nn.Flatten(),
        middle,
        nn.Tanh(),
        nn.Linear(5, 3),
    ).double()


def shard_model(model: nn.Module) -> nn.Module:
    """Each Conv2d and Linear but the last its own FSDP module; the rest the root's (a Conv1D
    returns a view, which FSDP warns about at a module's output)."""
    fully_shard = _torch_compat.fully_shard()
    layers = [m for m in model.modules() if isinstance(m, (nn.Conv2d, nn.Linear))]
    for layer in layers[:-1]:
        fully_shard(layer)
    fully_shard(model)
    return model


def batches(shape: tuple[int, ...], sizes: list[int], seed: int) -> list[Any]:
    g = torch.Generator().manual_seed(seed)
    return [
        (
            torch.randn(b, *shape, generator=g, dtype=torch.float64),
            torch.randint(0, 3, (b,), generator=g),
        )
        for b in sizes
    ]


# two batches per rank, of uneven sizes
SIZES = [[3, 5], [2, 4], [6, 1]][:WORLD]


def data(shape: tuple[int, ...]) -> tuple[list[Any], list[Any]]:
    """This rank's batches and the union of every rank's."""
    per_rank = [batches(shape, s, seed=10 + r) for r, s in enumerate(SIZES)]
    return per_rank[RANK], [b for mine in per_rank for b in mine]


def shard(vecs: torch.Tensor, layout: ParamLayout) -> torch.Tensor:
    """This rank's piece of global rows ``(k, n)`` (NOTE [sharded vector layout]): each
    parameter's ``torch.chunk`` of rows, flattened, in layout order."""
    pieces = []
    for view in layout.split_rows(vecs.reshape(-1, layout.size)):
        chunks = torch.chunk(view, WORLD, dim=1)
        pieces.append(
            chunks[RANK].reshape(view.shape[0], -1)
            if len(chunks) > RANK
            else view.new_empty(view.shape[0], 0)
        )
    return torch.cat(pieces, dim=1).reshape(*vecs.shape[:-1], -1)


def err(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest difference relative to the largest entry, over every rank's shard."""
    t = torch.stack([(a - b).abs().max(), b.abs().max()]) if b.numel() else torch.zeros(2)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t[0] / t[1])


def compare(op: Any, ref: Any, layout: ParamLayout) -> dict[str, float]:
    """Products, block products, the damped inverse and an eigenvector, shard by shard."""
    V = torch.randn(3, ref.size, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    out = {
        "matvec": err(op @ shard(V[0], layout), shard(ref @ V[0], layout)),
        "matmat": err(op.matmat(shard(V, layout).T).T, shard(ref.matmat(V.T).T, layout)),
        "inverse": err(
            op.inverse(0.1) @ shard(V[1], layout), shard(ref.inverse(0.1) @ V[1], layout)
        ),
    }
    # the largest eigenvalues' eigenvector of the last block, its sign aligned over the ranks
    last = ref.num_blocks - 1
    found, expected = op.eigenvector(last, -1, -1), shard(ref.eigenvector(last, -1, -1), layout)
    sign = (found * expected).sum()
    dist.all_reduce(sign)
    out["eigenvector"] = err(found * sign.sign(), expected)
    # factors by module refuse eigh() (every eigenbasis on every rank): their eigenvalues()
    found_values = op.eigenvalues() if op.factor_owners is not None else op.eigh().eigenvalues
    out["eigenvalues"] = err(found_values, ref.eigh().eigenvalues)
    return out


def untouched(model: nn.Module, snapshot: list[torch.Tensor]) -> bool:
    params = list(model.parameters())
    return all(
        torch.equal(hd._local(p).detach(), s) for p, s in zip(params, snapshot, strict=True)
    ) and all(p.grad is None for p in params)


@check
def products() -> dict[str, Any]:
    """FSDP operators against one process on the union, for both Fisher types, KFAC and EKFAC,
    separate and joined biases, on an MLP, on convolutions (+ Conv1D) and on a model the factor
    pass handles specially (in-place outputs, an uncovered layer)."""
    out: dict[str, Any] = {}
    cases = [
        ("mlp", mlp, (5,), {}),
        ("mlp_joined", mlp, (5,), {"separate_bias": False}),
        ("conv_joined", conv_net, (2, 4, 4), {"separate_bias": False}),
        ("inplace_excluded", inplace_net, (5,), {"exclude_unsupported": True}),
    ]
    for name, make, shape, kwargs in cases:
        mine, union = data(shape)
        model = shard_model(make())
        snapshot = [hd._local(p).detach().clone() for p in model.parameters()]
        for fisher in ("type2", "empirical"):
            for label, cls, ref_cls in (
                ("kfac", hd.FSDPKFACOperator, KFACOperator),
                ("ekfac", hd.FSDPEKFACOperator, EKFACOperator),
            ):
                if name != "mlp" and fisher == "empirical":
                    continue  # the variants differ in the blocks, not in the pass
                op = cls(model, mine, supervised_forward, CE, fisher_type=fisher, **kwargs)
                ref = ref_cls(make(), union, supervised_forward, CE, fisher_type=fisher, **kwargs)
                res: dict[str, Any] = compare(op, ref, ref.layout)
                res["sizes"] = [
                    op.size,
                    op.global_size,
                    ref.size,
                    shard(torch.zeros(ref.size), ref.layout).numel(),
                ]
                res["backend"] = type(op.backend).__name__
                out[f"{name}_{label}_{fisher}"] = res
        out[f"{name}_untouched"] = untouched(model, snapshot)
        out[f"{name}_transposed"] = any(b.transposed for b in ref.factors)
    return out


@check
def algorithms_and_training() -> dict[str, Any]:
    """Lanczos on sharded vectors through op.backend; Monte-Carlo factors equal the DDP
    operator's (both key their draws by rank); the model still trains afterwards."""
    from hessian_eigenthings.algorithms import lanczos

    mine, union = data((5,))
    model = shard_model(mlp())
    op = hd.FSDPKFACOperator(model, mine, supervised_forward, CE)
    ref = KFACOperator(mlp(), union, supervised_forward, CE)
    found = lanczos(op, k=3, tol=1e-10, seed=0, backend=op.backend)
    expected = lanczos(ref, k=3, tol=1e-10, seed=0)
    out: dict[str, Any] = {"lanczos": err(found.eigenvalues, expected.eigenvalues)}
    mc = hd.FSDPEKFACOperator(model, mine, supervised_forward, CE, fisher_type="mc", mc_samples=2)
    ddp = hd.DDPEKFACOperator(mlp(), mine, supervised_forward, CE, fisher_type="mc", mc_samples=2)
    v = torch.randn(ddp.size, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    out["mc_vs_ddp"] = err(mc @ shard(v, ddp.layout), shard(ddp @ v, ddp.layout))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    before = [hd._local(p).detach().clone() for p in model.parameters()]
    x, y = mine[0]
    nn.functional.cross_entropy(model(x), y).backward()
    optimizer.step()
    out["trains_after"] = all(
        not torch.equal(hd._local(p).detach(), b)
        for p, b in zip(model.parameters(), before, strict=True)
        if b.numel()
    )
    return out


def expect_raise(fn: Callable[[], Any]) -> dict[str, Any]:
    t0 = time.perf_counter()
    try:
        fn()
    except Exception as exc:
        notes = getattr(exc, "__notes__", [])
        return {
            "type": type(exc).__name__,
            "msg": str(exc),
            "notes": notes,
            "seconds": time.perf_counter() - t0,
        }
    return {"type": None, "msg": "", "notes": [], "seconds": time.perf_counter() - t0}


@check
def misuse() -> dict[str, Any]:
    """Refusals, raised on every rank before any rank waits in a collective."""
    mine, union = data((5,))
    model = shard_model(mlp())
    out: dict[str, Any] = {}
    extra = mine + mine[:1] if RANK == 0 else mine
    out["uneven_batches"] = expect_raise(
        lambda: hd.FSDPKFACOperator(model, extra, supervised_forward, CE)
    )

    def failing_forward(m: nn.Module, batch: Any) -> torch.Tensor:
        logits = m(batch[0])
        if RANK == WORLD - 1:
            raise ArithmeticError("boom")
        return logits

    out["rank_failure"] = expect_raise(
        lambda: hd.FSDPEKFACOperator(model, mine, failing_forward, CE)
    )
    # a one-shot iterator on the last rank fails before the ranks first meet
    shaky = iter(mine) if RANK == WORLD - 1 else mine
    out["construction_failure"] = expect_raise(
        lambda: hd.FSDPKFACOperator(model, shaky, supervised_forward, CE)
    )
    out["not_sharded"] = expect_raise(
        lambda: hd.FSDPKFACOperator(mlp(), mine, supervised_forward, CE)
    )
    torch.manual_seed(0)
    by_columns = nn.Sequential(nn.Linear(6, 4)).double()  # 6 columns: even on 2 and 3 ranks
    _torch_compat.fully_shard()(by_columns, shard_placement_fn=_last_dim)
    wide = batches((6,), [4], seed=3)
    out["columns_sharded"] = expect_raise(
        lambda: hd.FSDPKFACOperator(by_columns, wide, supervised_forward, CE)
    )
    ref = KFACOperator(mlp(), union, supervised_forward, CE)
    op = hd.FSDPKFACOperator(model, mine, supervised_forward, CE)
    v = torch.randn(ref.size, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    out["after"] = err(op @ shard(v, ref.layout), shard(ref @ v, ref.layout))
    return out


def _last_dim(p: nn.Parameter) -> Any:
    from torch.distributed.tensor import Shard

    return Shard(p.dim() - 1)


def main() -> None:
    run_sharded_worker(CHECKS, RANK)


if __name__ == "__main__":
    main()
