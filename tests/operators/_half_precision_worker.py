"""One rank of the half-model FSDP2 check (run by tests/operators/test_half_precision_policy.py).

Usage: ``python _half_precision_worker.py OUT_DIR`` with RANK, WORLD_SIZE, MASTER_ADDR and
MASTER_PORT set. A bfloat16 MLP, sharded with ``fully_shard``; each rank its own batches. Every
rank builds the single-process reference on the union of the ranks' batches (the same bf16 weights,
unsharded, under the default float32 policy) and compares its piece of the sharded products with
its rows of the reference. Writes ``OUT_DIR/rank{r}.json``.
"""

from __future__ import annotations

import copy
import datetime
import json
import os
import sys
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from hessian_eigenthings import _torch_compat
from hessian_eigenthings.loss_fns import (
    supervised_forward,
    supervised_loss,
    supervised_loss_of_output,
)
from hessian_eigenthings.operators import GGNOperator, HessianOperator
from hessian_eigenthings.operators.distributed import Sharded

RANK = int(os.environ["RANK"])
WORLD = int(os.environ["WORLD_SIZE"])
CRITERION = nn.CrossEntropyLoss()


def batches(rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Rank ``rank``'s batches: the same count on every rank, different sizes, bf16 inputs."""
    g = torch.Generator().manual_seed(20 + rank)
    return [
        (torch.randn(n, 4, generator=g).to(torch.bfloat16), torch.randint(0, 3, (n,), generator=g))
        for n in (3 + rank, 2 * rank + 1)
    ]


def piece(global_rows: torch.Tensor, ref: Any) -> torch.Tensor:
    """This rank's piece of global rows (NOTE [sharded vector layout]: each parameter's rows
    split by ``torch.chunk`` on dim 0, concatenated in order)."""
    out = []
    for view in ref.layout.split_rows(global_rows):
        chunks = torch.chunk(view, WORLD, dim=1)
        mine = chunks[RANK] if len(chunks) > RANK else view[:, :0]
        out.append(mine.reshape(view.shape[0], -1))
    return torch.cat(out, dim=1)


def shards(model: nn.Module) -> list[tuple[Any, ...]]:
    out = []
    for p in model.parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        out.append((p.dtype, local.dtype, local.data_ptr(), local._version, local.detach().clone()))
    return out


def unchanged(a: list[tuple[Any, ...]], b: list[tuple[Any, ...]]) -> bool:
    return all(x[:4] == y[:4] and torch.equal(x[4], y[4]) for x, y in zip(a, b, strict=True))


def main(out_dir: str) -> None:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    result: dict[str, Any] = {}
    try:
        if not _torch_compat.fsdp2_runs_on_cpu():
            result["skip"] = f"FSDP2 runs on CPU from torch 2.6 (this is {torch.__version__})"
            return
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3)).to(torch.bfloat16)
        single = copy.deepcopy(model)
        model32 = copy.deepcopy(model).float()  # the same blocks, gathered in float32
        union = [b for r in range(WORLD) for b in batches(r)]
        fully_shard = _torch_compat.fully_shard()
        fully_shard(model[0])
        fully_shard(model[2])
        fully_shard(model)
        for m in (model32[0], model32[2], model32):
            fully_shard(m)
        mine = batches(RANK)
        loss = supervised_loss(CRITERION)
        ref_h = HessianOperator(single, union, loss)
        ref_g = GGNOperator(single, union, supervised_forward, supervised_loss_of_output(CRITERION))
        V = torch.randn(ref_h.size, 3, generator=torch.Generator().manual_seed(5))
        ops = {
            "walk_hessian": (
                HessianOperator(
                    model, mine, loss, ranks=Sharded(model), engine="layers", layers=""
                ),
                ref_h,
            ),
            "walk_ggn": (
                GGNOperator(
                    model,
                    mine,
                    supervised_forward,
                    supervised_loss_of_output(CRITERION),
                    ranks=Sharded(model),
                    engine="layers",
                    layers="",
                ),
                ref_g,
            ),
            "functional_hessian": (
                HessianOperator(model, mine, loss, ranks=Sharded(model), engine="functional"),
                ref_h,
            ),
        }
        ops["walk_hessian_fp32_model"] = (
            HessianOperator(
                model32,
                [(x.float(), y) for x, y in mine],
                loss,
                ranks=Sharded(model32),
                engine="layers",
                layers="",
            ),
            ref_h,
        )
        # the bytes the blocks travel in (a half model's blocks are cast after the all-gather)
        sent: list[int] = []
        all_gather = _torch_compat.all_gather_single

        def counted(out: torch.Tensor, inp: torch.Tensor, group: Any = None) -> Any:
            sent.append(inp.numel() * inp.element_size())
            return all_gather(out, inp, group=group)

        _torch_compat.all_gather_single = counted  # type: ignore[assignment]
        for name, (op, ref) in ops.items():
            before = shards(model)
            want = piece((ref @ V).T, ref)
            sent.clear()
            got = (op @ piece(V.T, ref).T.contiguous()).T
            result[name] = {
                "sent": sum(sent),
                "dtype": str(op.dtype),
                "rel": float((got.double() - want.double()).norm() / want.double().norm()),
                "shards_unchanged": unchanged(before, shards(model)),
            }
        try:
            HessianOperator(model, mine, loss, ranks=Sharded(model), method="finite_difference")
            result["differences_refused"] = ""
        except ValueError as exc:
            result["differences_refused"] = str(exc)
    finally:
        with open(os.path.join(out_dir, f"rank{RANK}.json"), "w") as f:
            json.dump(result, f)
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
