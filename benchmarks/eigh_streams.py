"""float64 ``eigh`` of GPT-2 124M's KFAC factors, one after another against a few at a time on
their own CUDA streams (threads), and float32 ``eigh`` for scale (issue 40: the eigenbases
phase; whether decomposing the factors side by side, as the reverted fb23245 did, is worth it).
Random symmetric positive definite matrices of the factors' sizes (12 layers: A 769,
769, 769, 3073; G 2304, 768, 3072, 768), medians of ``--repeats`` rounds, results checked equal.

    python benchmarks/eigh_streams.py --out eigh.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch


def factors(layers: int, device: str) -> list[torch.Tensor]:
    g = torch.Generator(device=device).manual_seed(0)
    sizes = [769, 769, 769, 3073, 2304, 768, 3072, 768] * layers
    out = []
    for n in sizes:
        X = torch.randn(n + 64, n, generator=g, dtype=torch.float64, device=device)
        out.append((X.T @ X / n).to(torch.float32))
    return out


def one_by_one(Ms: list[torch.Tensor]) -> list[torch.Tensor]:
    return [torch.linalg.eigh(M.to(torch.float64))[0] for M in Ms]


def in_streams(Ms: list[torch.Tensor], workers: int) -> list[torch.Tensor]:
    streams = [torch.cuda.Stream() for _ in range(workers)]
    order = sorted(range(len(Ms)), key=lambda i: -Ms[i].shape[0])
    ready = torch.cuda.current_stream()

    def work(w: int) -> list[tuple[int, torch.Tensor]]:
        done = []
        with torch.cuda.stream(streams[w]):
            streams[w].wait_stream(ready)
            for i in order[w::workers]:
                done.append((i, torch.linalg.eigh(Ms[i].to(torch.float64))[0]))
        return done

    with ThreadPoolExecutor(workers) as pool:
        parts = list(pool.map(work, range(workers)))
    for s in streams:
        ready.wait_stream(s)
    out: list[torch.Tensor] = [torch.empty(0)] * len(Ms)
    for part in parts:
        for i, lam in part:
            out[i] = lam
    return out


def timed(fn, repeats: int) -> tuple[float, list[torch.Tensor]]:  # type: ignore[no-untyped-def]
    times, out = [], []
    for _ in range(repeats):
        torch.cuda.synchronize()
        t = time.perf_counter()
        out = fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return statistics.median(times), out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default=None)
    a = p.parse_args()
    Ms = factors(a.layers, "cuda")
    one_by_one(Ms[:8])  # warm-up: cusolver's handles and workspaces
    report: dict[str, object] = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    base_s, base = timed(lambda: one_by_one(Ms), a.repeats)
    report["float64_one_by_one_s"] = round(base_s, 3)
    f32_s, _ = timed(lambda: [torch.linalg.eigh(M)[0] for M in Ms], a.repeats)
    report["float32_one_by_one_s"] = round(f32_s, 3)
    for w in (2, 4, 8):
        s, got = timed(lambda w=w: in_streams(Ms, w), a.repeats)
        same = all(torch.equal(x, y) for x, y in zip(got, base, strict=True))
        report[f"float64_streams_{w}_s"] = round(s, 3)
        report[f"float64_streams_{w}_bitwise_equal"] = same
    print(json.dumps(report, indent=2))
    Path(a.out or os.devnull).write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
