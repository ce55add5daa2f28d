"""``XᵀX`` of a factor pass's activations: the full product against the upper block triangle only
(``factor_sums.gram_add_``), by block size, on the shapes of GPT-2 and Llama factor modules
(a microbenchmark, not a test). Medians of CUDA-event timings, TF32 off.

    python benchmarks/gram_blocks.py --out gram.json
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

from hessian_eigenthings.operators import factor_sums


def timed(fn, reps: int) -> float:  # type: ignore[no-untyped-def]
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rows", type=int, default=4096)
    p.add_argument("--dims", default="768,769,2304,2305,3072,3073,4096,14336")
    p.add_argument("--blocks", default="0,512,768,1024,1536")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--out", default=None)
    a = p.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    rows = []
    for d in (int(x) for x in a.dims.split(",")):
        X = torch.randn(a.rows, d, device="cuda")
        out = torch.zeros(d, d, device="cuda")
        full = timed(lambda X=X, out=out: out.addmm_(X.T, X), a.reps)
        row = {"rows": a.rows, "d": d, "full_ms": round(full, 4)}
        for block in (int(x) for x in a.blocks.split(",")):
            if block == 0:
                continue
            ms = timed(
                lambda X=X, out=out, block=block: factor_sums.gram_add_(out, X, 1.0, block), a.reps
            )
            row[f"block{block}_ms"] = round(ms, 4)
            row[f"block{block}_ratio"] = round(ms / full, 3)
        print(row, flush=True)
        rows.append(row)
    info = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "tf32": False}
    if a.out:
        Path(a.out).write_text(json.dumps({"info": info, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
