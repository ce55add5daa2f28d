"""Top Hessian eigenvalues on ranks spread over several nodes, checked against one process.

One process per GPU (or CPU process) on every node, started by ``torchrun`` on each node
(docs/distributed.md, "Several nodes"). Every rank builds the same small model and the same
dataset from one seed, takes its own slice of the samples, and builds the curvature operator
over the ranks: replicated (``DDPHessianOperator``, whole vectors) by default, sharded over the
ranks with ``--sharded`` (FSDP2 ``fully_shard`` and the exact layer walk, torch >= 2.6). A
top-``k`` ``lanczos`` runs with the same arguments on every rank; then each rank computes the
same eigenvalues in one process on the union of the samples and compares. Rank 0 prints the
result and, with ``--out FILE``, writes it as JSON. Exit status 1 when they differ.

    # two nodes, 8 GPUs each (run on node 0 and node 1; NODE0 is node 0's address)
    torchrun --nnodes=2 --nproc-per-node=8 --node-rank=0 --rdzv-backend=c10d \\
        --rdzv-endpoint=NODE0:29500 scripts/multinode_lanczos.py
    # the same on one host, two CPU "nodes" of one process each (gloo)
    python -m torch.distributed.run --nnodes=2 --nproc-per-node=1 --node-rank=0 \\
        --master-addr=127.0.0.1 --master-port=29500 scripts/multinode_lanczos.py &
    python -m torch.distributed.run --nnodes=2 --nproc-per-node=1 --node-rank=1 \\
        --master-addr=127.0.0.1 --master-port=29500 scripts/multinode_lanczos.py
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from hessian_eigenthings import (
    DDPHessianOperator,
    FSDPHessianOperator,
    HessianOperator,
    is_main_process,
    lanczos,
)

SAMPLES, WIDTH, CLASSES = 96, 16, 4


def make_model(dtype: torch.dtype) -> nn.Module:
    torch.manual_seed(0)  # the same weights on every rank
    return nn.Sequential(
        nn.Linear(8, WIDTH),
        nn.Tanh(),
        nn.Linear(WIDTH, WIDTH),
        nn.Tanh(),
        nn.Linear(WIDTH, CLASSES),
    ).to(dtype)


def make_data(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)  # the same dataset on every rank
    return torch.randn(SAMPLES, 8, generator=g, dtype=dtype), torch.randint(
        0, CLASSES, (SAMPLES,), generator=g
    )


def loss_fn(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return F.cross_entropy(model(x), y)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--k", type=int, default=3)
    parser.add_argument("--sharded", action="store_true", help="FSDP2 shards and the layer walk")
    parser.add_argument(
        "--replicated", dest="sharded", action="store_false", help="whole vectors (the default)"
    )
    parser.add_argument("--out", help="rank 0 writes the result here (JSON)")
    args = parser.parse_args()

    use_cuda = torch.cuda.is_available()
    # a hang becomes an error after a minute instead of blocking the job
    dist.init_process_group("nccl" if use_cuda else "gloo", timeout=datetime.timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    local = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device("cuda", local) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    dtype = torch.float32 if use_cuda else torch.float64

    x, y = make_data(dtype)
    # this rank's samples: an exact split (uneven when the count does not divide)
    mine = torch.tensor_split(torch.arange(SAMPLES), world)[rank]
    batch = (x[mine].to(device), y[mine].to(device))
    model = make_model(dtype).to(device).eval()
    if args.sharded:
        from torch.distributed.fsdp import fully_shard  # torch >= 2.6

        for i in (0, 2, 4):
            fully_shard(model[i])
        fully_shard(model)
        # a toy model is no stack of blocks: layers="" walks none, gathering every parameter whole
        # for the product (a real model names its blocks, e.g. layers="transformer.h")
        op = FSDPHessianOperator(model, [batch], loss_fn, engine="layers", layers="")
    else:
        op = DDPHessianOperator(model, [batch], loss_fn)
    result = lanczos(op, k=args.k, seed=0, tol=1e-10, backend=op.backend)

    # the same call in one process on the union of every rank's samples (each rank, on its own)
    ref_op = HessianOperator(make_model(dtype).to(device), [(x.to(device), y.to(device))], loss_fn)
    ref = lanczos(ref_op, k=args.k, seed=0, tol=1e-10)
    got, want = result.eigenvalues.double().cpu(), ref.eigenvalues.double().cpu()
    rel = float((got - want).abs().max() / want.abs().max())
    ok = rel < (1e-10 if dtype == torch.float64 else 1e-4) and bool(result.converged.all())
    if is_main_process():
        report = {
            "world_size": world,
            "host": socket.gethostname(),
            "operator": type(op).__name__,
            "eigenvalues": got.tolist(),
            "one_process": want.tolist(),
            "relative_difference": rel,
            "products": result.iterations,
            "converged": bool(result.converged.all()),
            "ok": ok,
        }
        print(json.dumps(report))
        if args.out:
            with open(args.out, "w") as f:
                json.dump(report, f)
    dist.barrier()  # every rank done before any tears down (gloo can abort a rank otherwise)
    dist.destroy_process_group()
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
