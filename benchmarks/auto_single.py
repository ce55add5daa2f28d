"""One product from a fresh operator, ``auto`` against ``autograd``, many times in one process
(issue 27: the one-product cell of `bench_defaults`, without its single-run noise).

    python -m benchmarks.auto_single WORKLOAD [--curvatures ggn,ef] [--repeats 40]
        [--record-dir DIR] > rows.jsonl

After the warm-ups of ``bench_defaults`` (an autograd product, a 3-product lanczos and one trace
per curvature), ``--repeats`` rounds each build an ``auto`` and an ``autograd`` operator (order
alternating between rounds), each timing its one product, synchronised; every ``auto`` operator
starts with an empty record folder of its own, as a first run. A row per curvature: the median
and quartiles of each engine's times in ms and the median of the paired ratios.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import statistics
import time

import torch

from benchmarks.curvatures import makers as curvature_makers
from benchmarks.curvatures import sync as _sync
from benchmarks.curvatures import warm_process
from benchmarks.workloads import build_parity


def main() -> None:
    from hessian_eigenthings.operators.engines import TRACE_TIMES, trace_times

    ap = argparse.ArgumentParser()
    ap.add_argument("workload")
    ap.add_argument("--curvatures", default="ggn,ef")
    ap.add_argument("--repeats", type=int, default=40)
    ap.add_argument("--record-dir", default="/tmp/he_auto_single")
    args = ap.parse_args()
    os.environ[trace_times.ENV] = "0"
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    makers = curvature_makers(build_parity(args.workload, device))
    warm_process(makers, args.curvatures.split(","))
    for curv in args.curvatures.split(","):
        times: dict[str, list[float]] = {"auto": [], "autograd": []}
        for i in range(args.repeats):
            for eng in ("auto", "autograd") if i % 2 == 0 else ("autograd", "auto"):
                folder = os.path.join(args.record_dir, f"{curv}-{i}")
                shutil.rmtree(folder, ignore_errors=True)
                os.environ[trace_times.ENV] = folder if eng == "auto" else "0"
                TRACE_TIMES.clear()
                gc.collect()
                op = makers[curv](eng)
                v = torch.randn(op.size, device=op.device, generator=torch.Generator(op.device).manual_seed(0))
                _sync()
                t0 = time.perf_counter()
                op @ v
                _sync()
                times[eng].append((time.perf_counter() - t0) * 1e3)
                del op
        q = {e: statistics.quantiles(t, n=4) for e, t in times.items()}
        ratios = [a / b for a, b in zip(times["auto"], times["autograd"], strict=True)]
        print(json.dumps({
            "workload": args.workload, "curvature": curv, "repeats": args.repeats,
            "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
            **{f"{e}_ms": [round(x, 4) for x in q[e]] for e in q},
            "ratio_median": round(statistics.median(ratios), 4),
        }), flush=True)


if __name__ == "__main__":
    main()
