"""CurvatureTracker during training: cost per call against a cold-start lanczos.

    python -m benchmarks.bench_tracker [--workload gpt2] [--steps 150] [--every 50] [--k 5]

Trains the parity workload (``benchmarks.workloads``) with Adam (lr 1e-4, not fused) on its
batch and tracks the top-k Hessian eigenvalues every ``--every`` steps on the same batch,
warm-started. After each call, a cold ``lanczos`` (fresh operator, random start) on the same
parameters gives the reference cost and values. One JSON line per call: products and seconds
of the tracked call and of the cold run, and the largest relative eigenvalue difference.
fp32, TF32 off.
"""

from __future__ import annotations

import argparse
import json
import time
import warnings
from typing import Any

import torch

from benchmarks.workloads import build_parity


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def main() -> None:
    import hessian_eigenthings as he

    ap = argparse.ArgumentParser()
    ap.add_argument("--workload", default="gpt2")
    ap.add_argument("--scale", type=float, default=1.0)
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--every", type=int, default=50)
    ap.add_argument("--k", type=int, default=5)
    ap.add_argument("--tol", type=float, default=1e-3)
    ap.add_argument("--lr", type=float, default=1e-4, help="Adam's learning rate")
    ap.add_argument("--engine", default="auto", help="the tracker operator's engine")
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    w = build_parity(args.workload, device, args.scale)
    model, batch, crit = w.model, w.batches[0], w.criterion
    loss_fn = he.supervised_loss(crit)
    tracker = he.CurvatureTracker(model, loss_fn, batch=batch, every=args.every, k=args.k, tol=args.tol,
                                  engine=args.engine)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr, foreach=True)

    def emit(row: dict[str, Any]) -> None:
        print(json.dumps({"workload": args.workload, **row}), flush=True)

    emit({"cell": "env", "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
          "torch": torch.__version__, "tf32": False, "k": args.k, "tol": args.tol, "every": args.every,
          "lr": args.lr, "engine": args.engine})
    for step in range(1, args.steps + 1):
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(model, batch)
        loss.backward()
        opt.step()
        _sync()
        t0 = time.perf_counter()
        rec = tracker.step(step)
        _sync()
        if rec is None:
            continue
        tracked_s = time.perf_counter() - t0
        top = tracker.operator
        counters = {"replays": top.num_replays, "passes": top.num_passes, "forwards": top.num_forwards,
                    "engine": top.engine_report}
        op = he.HessianOperator(model, [batch], loss_fn)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            _sync()
            t0 = time.perf_counter()
            cold = he.algorithms.lanczos(op, k=args.k, which="LA", tol=args.tol, seed=step)
            _sync()
        cold_s = time.perf_counter() - t0
        vals = torch.as_tensor(rec.eigenvalues, dtype=torch.float64)
        diff = float(((vals - cold.eigenvalues).abs() / cold.eigenvalues.abs()).max())
        emit({"cell": "track", "step": step, "loss": float(loss.detach()), "tracked_products": rec.products,
              "tracked_s": tracked_s, "cold_products": cold.iterations, "cold_s": cold_s,
              "cost_ratio_s": tracked_s / cold_s, "max_rel_diff": diff, "tracker_op": counters,
              "cold_op": {"replays": op.num_replays, "passes": op.num_passes},
              "eigenvalues": [float(x) for x in vals], "cold_eigenvalues": [float(x) for x in cold.eigenvalues]})
        del op


if __name__ == "__main__":
    main()
