"""CurvatureTracker during training: cost per call against a cold-start lanczos.

    python -m benchmarks.bench_tracker [--workload gpt2] [--steps 150] [--every 50] [--k 5]

Trains the parity workload (``benchmarks.workloads``) with Adam (lr 1e-4, not fused) and tracks
the top-k Hessian eigenvalues every ``--every`` steps on a probe batch, warm-started. With
``--data batch`` (default) the training runs on the probe batch itself (it memorises the batch:
the spectrum moves fast); with ``--data stream`` (GPT-2 only) every step trains on a fresh batch
of sequences from a fixed random Markov chain over 512 tokens (four likely successors per token,
a structure the model learns gradually), and the probe is one more batch from the chain. After each call, a cold ``lanczos`` (fresh operator, random start) on the same
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


def _markov_stream(shape: torch.Size, device: str) -> Any:
    """Batches ``(ids, next ids)`` of ``shape`` from a fixed random Markov chain over 512 tokens."""
    g = torch.Generator().manual_seed(1)
    succ = torch.randint(0, 512, (512, 4), generator=g)
    probs = torch.tensor([0.55, 0.25, 0.15, 0.05])
    stream = torch.Generator(device=device).manual_seed(2)
    succ, probs = succ.to(device), probs.to(device)

    def draw() -> tuple[torch.Tensor, torch.Tensor]:
        B, T = shape
        ids = torch.empty(B, T, dtype=torch.long, device=device)
        ids[:, 0] = torch.randint(0, 512, (B,), generator=stream, device=device)
        for t in range(1, T):
            pick = torch.multinomial(probs.expand(B, 4), 1, generator=stream).squeeze(1)
            ids[:, t] = succ[ids[:, t - 1], pick]
        return ids, ids[:, 1:].reshape(-1)

    return draw


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
    ap.add_argument("--data", choices=["batch", "stream"], default="batch")
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    w = build_parity(args.workload, device, args.scale)
    model, batch, crit = w.model, w.batches[0], w.criterion
    loss_fn = he.supervised_loss(crit)
    draw = None
    if args.data == "stream":
        if args.workload != "gpt2":
            raise SystemExit("--data stream is for the gpt2 workload")
        draw = _markov_stream(batch[0].shape, device)
        batch = draw()
    tracker = he.CurvatureTracker(model, loss_fn, batch=batch, every=args.every, k=args.k, tol=args.tol,
                                  engine=args.engine)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr, foreach=True)

    def emit(row: dict[str, Any]) -> None:
        print(json.dumps({"workload": args.workload, **row}), flush=True)

    emit({"cell": "env", "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
          "torch": torch.__version__, "tf32": False, "k": args.k, "tol": args.tol, "every": args.every,
          "lr": args.lr, "engine": args.engine, "data": args.data})
    for step in range(1, args.steps + 1):
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(model, batch if draw is None else draw())
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
