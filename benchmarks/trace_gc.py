"""The cycle collector during a trace (issue 27): collections and their time, per variant.

    python -m benchmarks.trace_gc [--workload gpt2_large] [--curvatures ggn,hessian] [--repeats 3]

Traces the workload's product (``bench_trace_reuse``'s operators, on CUDA where there is one)
``--repeats`` times per policy of the cycle collector during a trace, alternated: "off" (the
library's: no collection, NOTE [the collector during a trace]) and "freeze" (session 16's: the
objects older than the trace kept out of the passes, put in here in place of the library's), and
prints per trace its time and the collections that ran between its start and the row (count
and seconds by generation), one JSON row each.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import sys
import time
from collections.abc import Iterator
from typing import Any

import torch


@contextlib.contextmanager
def _frozen() -> Iterator[None]:
    """Session 16's policy: the objects older than the trace kept out of the collector's passes
    (nothing done where the process froze objects itself)."""
    if gc.get_freeze_count():
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def main() -> None:
    import hessian_eigenthings as he
    from benchmarks.workloads import build_parity
    from hessian_eigenthings.loss_fns import supervised_forward, supervised_loss_of_output
    from hessian_eigenthings.operators.engines import trace_times, tracing
    from hessian_eigenthings.operators.engines.functional import FunctionalRunner

    ap = argparse.ArgumentParser()
    ap.add_argument("--workload", default="gpt2_large")
    ap.add_argument("--curvatures", default="ggn,hessian")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--scale", type=float, default=1.0)
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    w = build_parity(args.workload, device, scale=args.scale)
    stats: dict[int, list[float]] = {}
    start = [0.0]

    def watch(phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            start[0] = time.perf_counter()
        else:
            row = stats.setdefault(info["generation"], [0, 0.0])
            row[0] += 1
            row[1] += time.perf_counter() - start[0]

    gc.callbacks.append(watch)
    policies = {"freeze": _frozen, "off": tracing._collector_paused}
    for curv in args.curvatures.split(","):
        if curv == "hessian":
            op: Any = he.HessianOperator(
                w.model, w.batches[:1], he.supervised_loss(w.criterion), engine="functional"
            )
        else:
            op = he.GGNOperator(
                w.model,
                w.batches[:1],
                supervised_forward,
                supervised_loss_of_output(w.criterion),
                engine="functional",
            )
        batch = op._engine_batch(w.batches[0])
        for i in range(args.repeats):
            for variant in ("freeze", "off"):
                tracing._collector_paused = policies[variant]
                trace_times._codes.clear()
                runner = FunctionalRunner(w.model, op.params, op.functional_product)
                stats.clear()
                prog = runner._tracer.trace(batch, general=True)
                row = {
                    "workload": args.workload,
                    "curvature": curv,
                    "variant": variant,
                    "repeat": i,
                    "trace_s": round(prog.trace_s, 4),
                    "collections": {g: [n, round(t, 4)] for g, (n, t) in sorted(stats.items())},
                    "python": sys.version.split()[0],
                }
                print(json.dumps(row), flush=True)
                del runner, prog
    tracing._collector_paused = policies["off"]


if __name__ == "__main__":
    main()
