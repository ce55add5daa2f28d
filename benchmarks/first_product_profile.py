"""The first GGN product of a fresh process, profiled (issue 27: where a script's first product
goes before any engine's own work).

    python -m benchmarks.first_product_profile WORKLOAD ENGINE

Builds the workload's model and one batch, then times the operator's first three products
(synchronised), the first under cProfile (top 35 by cumulative time after the times line).
Run it in a fresh process per engine; the first process on a machine also fills Triton's and
the record's caches.
"""

from __future__ import annotations

import cProfile
import io
import os
import pstats
import sys
import time

import torch


def main() -> None:
    os.environ.setdefault("HESSIAN_EIGENTHINGS_TRACE_TIMES", "0")
    import hessian_eigenthings as he
    from benchmarks.workloads import build_parity
    from hessian_eigenthings.loss_fns import supervised_forward, supervised_loss_of_output

    workload, engine = sys.argv[1], sys.argv[2]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.backends.cuda.matmul.allow_tf32 = False
    w = build_parity(workload, device)
    op = he.GGNOperator(
        w.model, w.batches[:1], supervised_forward, supervised_loss_of_output(w.criterion),
        engine=engine,
    )
    v = torch.randn(op.size, device=op.device)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    times = []
    prof = cProfile.Profile()
    for i in range(3):
        sync()
        t = time.perf_counter()
        if i == 0:
            prof.enable()
        op @ v
        sync()
        if i == 0:
            prof.disable()
        times.append(round(time.perf_counter() - t, 3))
    print(workload, engine, "first", times[0], "second", times[1], "third", times[2])
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("cumulative").print_stats(35)
    print(out.getvalue()[:9000])


if __name__ == "__main__":
    main()
