"""The LM head's matrix products at GPT-2's vocabulary (50257, odd) against a padded one (50304).

    python -m benchmarks.head_alignment [--tokens 2048] [--width 768] > rows.jsonl

A row-major (N, 50257) float32 matrix has an odd leading dimension, so cuBLAS takes kernels
without vectorised loads for every product that reads or writes it. This times the head's
products of a Hessian product at both sizes, TF32 off (issue 27: where the 124 M LM Hessian's
time goes): the logits ``h Wᵀ``, the input gradient ``g W`` and the weight gradient ``gᵀ h``.
"""

from __future__ import annotations

import argparse
import json

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--width", type=int, default=768)
    args = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    from triton.testing import do_bench

    n, d = args.tokens, args.width
    for vocab in (50257, 50304):
        h = torch.randn(n, d, device="cuda")
        w = torch.randn(vocab, d, device="cuda")
        g = torch.randn(n, vocab, device="cuda")
        row = {"vocab": vocab, "tokens": n, "width": d, "device": torch.cuda.get_device_name()}
        for name, fn in (
            ("logits h W^T", lambda h=h, w=w: h @ w.T),
            ("input grad g W", lambda g=g, w=w: g @ w),
            ("weight grad g^T h", lambda g=g, h=h: g.T @ h),
        ):
            ms = do_bench(fn, warmup=10, rep=50)
            row[name] = round(ms, 4)
            row[name + " TFLOP/s"] = round(2 * n * d * vocab / ms / 1e9, 1)
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
