"""The default engine against each fixed engine, at every run length (issue 27's first target).

    python -m benchmarks.bench_defaults WORKLOAD [--curvatures hessian,ggn,ef]
        [--engines auto,autograd,functional,compiled] [--lengths 1,20,100,1000]
        [--lanczos-lengths 20,100] > rows.jsonl

Per curvature and engine, from a fresh operator (trace and compile included):

- ``loop``: a bare ``op @ v`` loop of n products per n of ``lengths``, each from a fresh operator
  (a loop declares no length; ``auto`` judges it as it goes, and on a rerun from what the same
  loop left in its record, NOTE [what auto remembers]);
- ``lanczos``: one ``lanczos(op, k=min(10, n // 3), max_iter=n, tol=1e-12)`` per ``n`` of
  ``--lanczos-lengths`` (its budget is declared, so ``auto`` may choose differently per n).

Before any timed cell, one untimed product and a 3-product lanczos per curvature, and one traced
product, take the process's one-time costs (first operator, first lanczos, the first trace's
loading of forward-mode decompositions), which otherwise fell on the first engine timed (auto: 34
against 5.6 ms for one Hessian product on the MLP, H200, session 13; a trace of 0.72 against
0.08 s on the CPU, session 14).

``--record cold`` (the default): every ``auto`` cell starts with nothing recorded, as a user's
first run, and keeps what it learns in its own folder under ``--record-dir``; ``--record rerun``
(after a cold process with the same ``--record-dir``): every ``auto`` cell starts from what its
cold run left, as the same script run again; ``--record warm``: the warm-up traces each curvature
once and records its time (NOTE [trace times]), as an earlier run would have.

Then, per curvature, mode and length, ``default_vs_best`` = auto's time / the best fixed
engine's. The gradient and a 0.x-style Hessian product are timed first, in the same process.
A compiled engine reuses inductor's on-disk cache from earlier processes (and from its own
earlier cells): clear ``TORCHINDUCTOR_CACHE_DIR`` for cold figures. TF32 off.
"""

from __future__ import annotations

import argparse
import gc
import json
import time
import warnings
from typing import Any

import torch

from benchmarks.bench_engines import median_ms
from benchmarks.curvatures import makers as curvature_makers
from benchmarks.curvatures import sync as _sync
from benchmarks.curvatures import warm_autograd, warm_trace
from benchmarks.workloads import build_parity


def main() -> None:
    import hessian_eigenthings as he

    ap = argparse.ArgumentParser()
    ap.add_argument("workload")
    ap.add_argument("--curvatures", default="hessian,ggn,ef")
    ap.add_argument("--engines", default="auto,autograd,functional,compiled")
    ap.add_argument("--lengths", default="1,20,100,1000")
    ap.add_argument("--lanczos-lengths", default="20,100")
    ap.add_argument("--scale", type=float, default=1.0)
    ap.add_argument("--record", choices=("cold", "rerun", "warm"), default="cold",
                    help="cold: each cell as a first run (nothing recorded; what it learns is kept per "
                    "cell under --record-dir); rerun: each cell as the same script run again (it reads "
                    "what its cold run left); warm: the warm-up traces each curvature once and records "
                    "its time, as an earlier run would have")
    ap.add_argument("--record-dir", default="/tmp/he_trace_times")
    args = ap.parse_args()
    import os
    import shutil

    try:
        from hessian_eigenthings.operators.engines import TRACE_TIMES, trace_times
    except ImportError:  # a release before trace times (before/after runs): nothing to set
        TRACE_TIMES = trace_times = None

    def use_record(cell: str | None) -> None:
        """Where auto's record lives for the next cell (NOTE [what auto remembers])."""
        if trace_times is None:
            return
        TRACE_TIMES.clear()  # every cell a new run of a script: the process's memory is not kept
        if args.record == "warm":
            os.environ[trace_times.ENV] = args.record_dir
        elif cell is None:
            os.environ[trace_times.ENV] = "0"
        else:
            folder = os.path.join(args.record_dir, cell)
            if args.record == "cold":
                shutil.rmtree(folder, ignore_errors=True)
            os.environ[trace_times.ENV] = folder

    use_record(None)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    w = build_parity(args.workload, device, scale=args.scale)
    model, batches, crit = w.model, w.batches, w.criterion
    params = [p for p in model.parameters() if p.requires_grad]
    x, y = batches[0]

    def emit(row: dict[str, Any]) -> None:
        print(json.dumps({"workload": args.workload, **row}), flush=True)

    emit({"cell": "env", "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
          "torch": torch.__version__, "tf32": False, "params": sum(p.numel() for p in params),
          "record": args.record})
    v_list = [torch.randn_like(p) for p in params]

    def hvp_0x() -> Any:
        g = torch.autograd.grad(crit(model(x), y), params, create_graph=True)
        return torch.autograd.grad(g, params, v_list)

    emit({"cell": "gradient", "ms": median_ms(lambda: torch.autograd.grad(crit(model(x), y), params), 10)})
    emit({"cell": "hvp_0x_style", "ms": median_ms(hvp_0x, 10)})

    makers = curvature_makers(w)
    lengths = sorted(int(n) for n in args.lengths.split(","))
    lanczos_lengths = [int(n) for n in args.lanczos_lengths.split(",") if n]
    engines = args.engines.split(",")

    def fresh(curv: str, eng: str, cell: str | None = None) -> Any:
        if args.record != "warm" or cell is None:
            use_record(cell if eng == "auto" else None)
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()
        return makers[curv](eng)

    # one-time costs of the process (the first operator, the first lanczos: imports, allocator and
    # library handles) fall on no engine's cell: one untimed run of each first, reported apart
    for curv in args.curvatures.split(","):
        _sync()
        t0 = time.perf_counter()
        warm_autograd(lambda e, c=curv: fresh(c, e))
        emit({"cell": f"{curv}_warmup", "s": time.perf_counter() - t0})
        # the process's first trace loads torch's forward-mode decompositions (0.6 s on a CPU);
        # it falls on no cell either. With --record warm the trace's time is kept, as an earlier
        # run would have left it (NOTE [trace times])
        t0 = time.perf_counter()
        report = warm_trace(lambda e, c=curv: fresh(c, e))
        emit({"cell": f"{curv}_warmup_trace", "s": time.perf_counter() - t0, "report": report})

    for curv in args.curvatures.split(","):
        times: dict[tuple[str, int], dict[str, float]] = {}
        for eng in engines:
            try:
                for n in lengths:  # one loop per length: a loop run again is judged by its own record
                    op = fresh(curv, eng, f"{curv}-loop-{n}")
                    v = torch.randn(op.size, device=op.device, generator=torch.Generator(op.device).manual_seed(0))
                    _sync()
                    t0 = time.perf_counter()
                    for _ in range(n):
                        op @ v
                    _sync()
                    s = time.perf_counter() - t0
                    emit({"cell": f"{curv}_loop", "engine": eng, "length": n, "s": s, "report": op.engine_report})
                    times.setdefault(("loop", n), {})[eng] = s
                    del op
                for n in lanczos_lengths:
                    op = fresh(curv, eng, f"{curv}-lanczos-{n}")
                    _sync()
                    t0 = time.perf_counter()
                    with warnings.catch_warnings():
                        warnings.simplefilter("ignore")
                        res = he.lanczos(op, k=max(1, min(10, n // 3)), max_iter=n, tol=1e-12, seed=0)
                    _sync()
                    s = time.perf_counter() - t0
                    emit({"cell": f"{curv}_lanczos", "engine": eng, "budget": n, "s": s,
                          "products": op.num_matvecs, "top": float(res.eigenvalues[0]),
                          "report": op.engine_report})
                    times.setdefault(("lanczos", n), {})[eng] = s
                    del op
            except Exception as exc:
                emit({"cell": curv, "engine": eng, "error": f"{type(exc).__name__}: {str(exc)[:300]}"})
        for (mode, n), by_engine in sorted(times.items()):
            fixed = {e: s for e, s in by_engine.items() if e != "auto"}
            if "auto" in by_engine and fixed:
                best = min(fixed, key=fixed.__getitem__)
                emit({"cell": f"{curv}_default_vs_best", "mode": mode, "length": n, "auto_s": by_engine["auto"],
                      "best": best, "best_s": fixed[best], "ratio": by_engine["auto"] / fixed[best]})


if __name__ == "__main__":
    main()
