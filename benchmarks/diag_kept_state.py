"""Why a product is or is not kept between calls: per engine and graph-memory budget, the kept
state's bytes, the bytes of a state that did not fit, the cost counters and the product time.

    python -m benchmarks.diag_kept_state WORKLOAD [--engines autograd,compiled] [--budgets-gib default,60]

One JSON line per (engine, budget). ``default`` is the operator's own budget (a quarter of the
device). TF32 off.
"""

from __future__ import annotations

import argparse
import gc
import json
from typing import Any

import torch

from benchmarks.bench_engines import median_ms, wall_s
from benchmarks.workloads import build_parity


def main() -> None:
    import hessian_eigenthings as he

    ap = argparse.ArgumentParser()
    ap.add_argument("workload")
    ap.add_argument("--engines", default="autograd,compiled")
    ap.add_argument("--budgets-gib", default="default,60")
    ap.add_argument("--curvature", default="hessian")
    ap.add_argument("--reps", type=int, default=10)
    args = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    w = build_parity(args.workload, "cuda")
    model, batches, crit = w.model, w.batches, w.criterion
    params = [p for p in model.parameters() if p.requires_grad]
    x, y = batches[0]

    def emit(row: dict[str, Any]) -> None:
        print(json.dumps({"workload": args.workload, **row}), flush=True)

    emit(
        {
            "cell": "env",
            "device": torch.cuda.get_device_name(),
            "torch": torch.__version__,
            "total_gib": torch.cuda.get_device_properties(0).total_memory / 2**30,
        }
    )
    emit(
        {
            "cell": "gradient",
            "ms": median_ms(lambda: torch.autograd.grad(crit(model(x), y), params), args.reps),
        }
    )
    for eng in args.engines.split(","):
        for b in args.budgets_gib.split(","):
            gc.collect()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            budget = None if b == "default" else int(float(b) * 2**30)
            if args.curvature == "hessian":
                op = he.HessianOperator(
                    model, batches, he.supervised_loss(crit), engine=eng, graph_memory_budget=budget
                )
            else:
                from hessian_eigenthings.loss_fns import (
                    supervised_forward,
                    supervised_loss_of_output,
                )

                op = he.GGNOperator(
                    model,
                    batches,
                    supervised_forward,
                    supervised_loss_of_output(crit),
                    engine=eng,
                    graph_memory_budget=budget,
                )
            v = torch.randn(op.size, device=op.device)
            try:
                _, first = wall_s(lambda op=op, v=v: op @ v)
                ms = median_ms(lambda op=op, v=v: op @ v, args.reps)
                states = op._states
                emit(
                    {
                        "cell": "kept",
                        "engine": eng,
                        "budget_gib": b,
                        "ms": ms,
                        "first_s": first,
                        "held_mib": op.held_bytes / 2**20,
                        "state_budget_mib": (states.budget() or 0) / 2**20,
                        "unkept_mib": states.unkept_bytes / 2**20,
                        "entries": len(states.entries),
                        "passes": op.counts.passes,
                        "forwards": op.counts.forwards,
                        "replays": op.counts.replays,
                        "peak_gib": torch.cuda.max_memory_allocated() / 2**30,
                        "report": op.engine_report,
                    }
                )
            except Exception as exc:
                emit(
                    {
                        "cell": "kept",
                        "engine": eng,
                        "budget_gib": b,
                        "error": f"{type(exc).__name__}: {str(exc)[:300]}",
                    }
                )
            del op


if __name__ == "__main__":
    main()
