"""One launch of the fused cross-entropy kernel, for a hardware-counter profile (issue 27).

    ncu --clock-control none --set full -k regex:_ce_hvp -s 1 -c 1 python -m benchmarks.ce_kernel_ncu [--dtype bf16] [--V 50304] [--rows 16384] [--chunk 4096 --warps 4]

Runs the default configuration (or the one given) twice on random logits: the first launch
compiles, the second is the one to read.
"""

from __future__ import annotations

import argparse

import torch

from hessian_eigenthings.kernels.cross_entropy_triton import (
    TritonConfig,
    cross_entropy_hvp_triton,
    default_config,
)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    ap.add_argument("--V", type=int, default=50304)
    ap.add_argument("--rows", type=int, default=64 * 256)
    ap.add_argument("--chunk", type=int, default=0)
    ap.add_argument("--warps", type=int, default=0)
    args = ap.parse_args()
    dt = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    z = (3 * torch.randn(args.rows, args.V, device="cuda")).to(dt)
    u = torch.randn(args.rows, args.V, device="cuda").to(dt)
    cfg = (
        TritonConfig(chunk=args.chunk, num_warps=args.warps)
        if args.chunk
        else default_config(args.V)
    )
    for _ in range(2):
        cross_entropy_hvp_triton(z, u, None, float(args.rows), out=u.clone(), config=cfg)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
