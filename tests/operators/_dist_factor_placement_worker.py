"""One rank of the checks of Kronecker factors placed by module and of KFOC's distributed forms
(run by tests/operators/test_factor_placement.py).

Usage: ``python _dist_factor_placement_worker.py OUT_DIR`` with RANK, WORLD_SIZE, MASTER_ADDR
and MASTER_PORT set. Every rank builds the DDP operators on a replicated float64 model and the
FSDP operators on an FSDP2-sharded one (gloo, CPU), each on its own batches (uneven sizes), with
``factor_placement="by_module"`` and ``"replicated"``, and the single-process operators on the
union of every rank's batches; it writes ``OUT_DIR/rank{r}.json``: per check its numbers or the
exception it raised. The models, data and comparisons are ``_dist_kfac_worker``'s.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from _dist_checks import run_sharded_worker  # this folder: the workers run as scripts
from _dist_kfac_worker import (
    CE,
    RANK,
    WORLD,
    compare,
    conv_net,
    data,
    err,
    expect_raise,
    mlp,
    shard,
    shard_model,
)
from torch import nn

import hessian_eigenthings.operators.distributed as hd
from hessian_eigenthings.loss_fns import supervised_forward
from hessian_eigenthings.operators import EKFACOperator, KFACOperator, KFOCOperator

CHECKS: dict[str, Callable[[], dict[str, Any]]] = {}


def check(fn: Callable[[], dict[str, Any]]) -> Callable[[], dict[str, Any]]:
    CHECKS[fn.__name__] = fn
    return fn


def single() -> nn.Module:
    """One Linear: with factors by module, every rank but one owns nothing."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 3)).double()


def gathered(x: torch.Tensor) -> torch.Tensor:
    """``x`` of every rank, stacked (its first dimension ranks)."""
    parts = [torch.empty_like(x) for _ in range(WORLD)]
    dist.all_gather(parts, x.contiguous())
    return torch.stack(parts)


def whole_results(op: Any, ref: Any) -> dict[str, Any]:
    """The whole-operator numbers of ``op`` against ``ref`` (relative differences) and whether
    every rank got the same ones bit for bit."""
    pairs = {
        "eigenvalues": (op.eigenvalues(), ref.eigh().eigenvalues),
        "trace": (op.trace(), ref.trace()),
        "logdet": (op.logdet(0.1), ref.logdet(0.1)),
        "frobenius": (op.frobenius_norm(), ref.frobenius_norm()),
    }
    out: dict[str, Any] = {
        key: float((a - b).abs().max() / b.abs().max()) for key, (a, b) in pairs.items()
    }
    out["same_on_ranks"] = all(bool((gathered(a) == a).all()) for a, _ in pairs.values())
    return out


def placed(kind: str) -> tuple[Callable[..., Any], Callable[[nn.Module], nn.Module]]:
    """The distributed constructor family (``hd.DDP*`` or ``hd.FSDP*``) and how a model is
    prepared for it."""
    if kind == "ddp":
        return (lambda name: getattr(hd, f"DDP{name}Operator")), (lambda m: m)
    return (lambda name: getattr(hd, f"FSDP{name}Operator")), shard_model


def held_bytes(op: Any) -> int:
    """Bytes of the floating tensors (more than one number, not parameters) the operator holds:
    its factors, eigendecompositions and anything else kept, through its own objects (not the
    model, its data or its factor pass)."""
    from hessian_eigenthings.batching import BatchSource
    from hessian_eigenthings.operators.ranks import RankGroup

    skip = {"_pass", "source", "guard", "model", "params", "named_params", "options"}
    storages: dict[int, int] = {}
    seen: set[int] = set()
    stack: list[Any] = [op]
    while stack:
        obj = stack.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            if not isinstance(obj, nn.Parameter) and obj.is_floating_point() and obj.numel() > 1:
                storage = obj.untyped_storage()
                storages[storage.data_ptr()] = storage.nbytes()
        elif isinstance(obj, (nn.Module, BatchSource, RankGroup)):
            continue
        elif isinstance(obj, dict):
            stack.extend(obj.values())
        elif isinstance(obj, (list, tuple, set, frozenset)):
            stack.extend(obj)
        elif type(obj).__module__.startswith("hessian_eigenthings") and hasattr(obj, "__dict__"):
            stack.extend(v for k, v in vars(obj).items() if k not in skip)
    return sum(storages.values())


@check
def by_module() -> dict[str, Any]:
    """factor_placement="by_module" on DDP (replicated vectors) and FSDP (sharded vectors), KFAC
    and EKFAC: products, inverse products, eigenvalues, an eigenvector and the whole-operator
    reductions against one process on the union; the factor bytes held per rank."""
    out: dict[str, Any] = {}
    cases = [
        ("mlp", mlp, (5,), {}),
        ("conv_joined", conv_net, (2, 4, 4), {"separate_bias": False}),
        ("single", single, (5,), {}),
    ]
    for kind in ("ddp", "fsdp"):
        family, prepare = placed(kind)
        for name, make, shape, kwargs in cases:
            mine, union = data(shape)
            model = prepare(make())
            for label, ref_cls in (("KFAC", KFACOperator), ("EKFAC", EKFACOperator)):
                cls = family(label)
                op = cls(
                    model, mine, supervised_forward, CE, factor_placement="by_module", **kwargs
                )
                rep = cls(model, mine, supervised_forward, CE, **kwargs)
                ref = ref_cls(make(), union, supervised_forward, CE, **kwargs)
                layout = ref.layout
                res: dict[str, Any] = {
                    "owners": op.factor_owners,
                    "owned": sorted({b.module for b in op.owned_factors}),
                    "modules": sorted({b.module for b in ref.factors}),
                }
                # the bytes each rank holds right after construction, and after every
                # decomposition has been made (inverse products, eigenvalues)
                res["bytes_built"] = [held_bytes(op), held_bytes(rep)]
                if label == "KFAC":  # each rank holds exactly its own modules' G and A (the
                    # single-process operator's, the same sizes)
                    res["bytes_own"] = sum(
                        {
                            id(t): t.numel() * 8
                            for b in ref.factors
                            for t in (b.G, b.A)
                            if b.module in res["owned"] and t.numel() > 1
                        }.values()
                    )
                res.update(compare(op, ref, layout) if kind == "fsdp" else compare_whole(op, ref))
                res.update(whole_results(op, ref))
                probe = torch.ones(ref.size, dtype=torch.float64)
                rep.inverse(0.1) @ (shard(probe, layout) if kind == "fsdp" else probe)
                rep.eigh()
                res["bytes_decomposed"] = [held_bytes(op), held_bytes(rep)]
                out[f"{kind}_{name}_{label}"] = res
    return out


def compare_whole(op: Any, ref: Any) -> dict[str, Any]:
    """:func:`compare` on replicated vectors, and whether every rank got the same product."""
    V = torch.randn(3, ref.size, generator=torch.Generator().manual_seed(7), dtype=torch.float64)

    def rel(a: torch.Tensor, b: torch.Tensor) -> float:
        return float((a - b).abs().max() / b.abs().max())

    found = op @ V[0]
    last = ref.num_blocks - 1
    vec, expected = op.eigenvector(last, -1, -1), ref.eigenvector(last, -1, -1)
    return {
        "matvec": rel(found, ref @ V[0]),
        "matmat": rel(op.matmat(V.T), ref.matmat(V.T)),
        "inverse": rel(op.inverse(0.1) @ V[1], ref.inverse(0.1) @ V[1]),
        "eigenvector": rel(vec * (vec @ expected).sign(), expected),
        "product_same_on_ranks": bool((gathered(found) == found).all()),
    }


@check
def by_module_refusals() -> dict[str, Any]:
    """What factors by module refuse, in one line naming the alternative, on every rank; an
    undamped inverse of a singular operator refused as with replicated factors; a failing
    rank (in the factor pass, and an owner in a product) raises on every rank."""
    mine, _ = data((5,))
    op = hd.DDPEKFACOperator(mlp(), mine, supervised_forward, CE, factor_placement="by_module")
    rep = hd.DDPEKFACOperator(mlp(), mine, supervised_forward, CE)
    out: dict[str, Any] = {
        "eigh": expect_raise(op.eigh),
        "factors": expect_raise(lambda: op.factors),
        "corrected": expect_raise(lambda: op.corrected_eigenvalues),
        "bad_value": expect_raise(
            lambda: hd.DDPKFACOperator(mlp(), mine, supervised_forward, CE, factor_placement="rows")
        ),
        "undamped": expect_raise(op.inverse),
        "undamped_replicated": expect_raise(rep.inverse),
    }

    def failing_forward(m: nn.Module, batch: Any) -> torch.Tensor:
        logits = m(batch[0])
        if RANK == WORLD - 1:
            raise ArithmeticError("boom")
        return logits

    out["pass_failure"] = expect_raise(
        lambda: hd.DDPEKFACOperator(mlp(), mine, failing_forward, CE, factor_placement="by_module")
    )
    broken = hd.DDPKFACOperator(mlp(), mine, supervised_forward, CE, factor_placement="by_module")
    if RANK == WORLD - 1:  # an owner's factor changed in place to NaN: its eigh fails
        broken.owned_factors[0].G.fill_(float("nan"))
    v = torch.ones(broken.size, dtype=torch.float64)
    out["product_failure"] = expect_raise(lambda: broken.inverse(0.1) @ v)
    out["after"] = float((op @ v - rep @ v).abs().max())  # the group stays usable
    return out


@check
def kfoc() -> dict[str, Any]:
    """DDPKFOCOperator and FSDPKFOCOperator (factors replicated and by module) against one
    process on the union; Monte-Carlo draws keyed by rank alike in both."""
    out: dict[str, Any] = {}
    for name, make, shape, kwargs in (
        ("mlp", mlp, (5,), {}),
        ("conv_joined", conv_net, (2, 4, 4), {"separate_bias": False}),
    ):
        mine, union = data(shape)
        ref = KFOCOperator(make(), union, supervised_forward, CE, **kwargs)
        for kind in ("ddp", "fsdp"):
            family, prepare = placed(kind)
            model = prepare(make())
            for placement in ("replicated", "by_module"):
                op = family("KFOC")(
                    model, mine, supervised_forward, CE, factor_placement=placement, **kwargs
                )
                res: dict[str, Any] = (
                    compare(op, ref, ref.layout) if kind == "fsdp" else compare_whole(op, ref)
                )
                res.update(whole_results(op, ref) if placement == "by_module" else {})
                res["iterations"] = [op.iterations, ref.iterations]
                res["converged"] = [op.converged, ref.converged]
                out[f"{kind}_{name}_{placement}"] = res
    mine, _ = data((5,))
    mc = {"fisher_type": "mc", "mc_samples": 2}
    sharded = hd.FSDPKFOCOperator(shard_model(mlp()), mine, supervised_forward, CE, **mc)
    ddp = hd.DDPKFOCOperator(mlp(), mine, supervised_forward, CE, **mc)
    v = torch.randn(ddp.size, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    out["mc_vs_ddp"] = err(sharded @ shard(v, ddp.layout), shard(ddp @ v, ddp.layout))
    return out


def main() -> None:
    run_sharded_worker(CHECKS, RANK)


if __name__ == "__main__":
    main()
