"""What a traced engine's first product costs in a first process and in the next ones (issue 27).

    python -m benchmarks.bench_trace_reuse WORKLOAD [--curvatures hessian,ggn]
        [--engines functional,compiled] [--processes 2] [--record-dir DIR] > rows.jsonl

For each curvature and engine, ``--processes`` fresh Python processes run one after another with
one record of trace times (``HESSIAN_EIGENTHINGS_TRACE_TIMES=DIR``, emptied first) and one
inductor cache (``TORCHINDUCTOR_CACHE_DIR``, as set by the caller): each builds the operator,
times its first product (trace, primal part, compile) and its second one, and reports
``engine_report`` and inductor's cache counters (``BENCH_TRACE_REUSE_PROFILE=1`` or ``tottime``: a
cProfile of the first product on stderr, by cumulative or own time). Every process traces (recording, NOTE [recording a trace]); for ``compiled``,
the next processes' identical programs find inductor's cached artifact. One autograd product is
timed first in every process (imports and CUDA context are not the engine's). TF32 off.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from typing import Any

import torch


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def child(workload: str, curv: str, engine: str, scale: float) -> dict[str, Any]:
    import hessian_eigenthings as he
    from benchmarks.workloads import build_parity
    from hessian_eigenthings.loss_fns import supervised_forward, supervised_loss_of_output

    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    w = build_parity(workload, device, scale=scale)
    model, batches, crit = w.model, w.batches[:1], w.criterion

    def make(e: str) -> Any:
        if curv == "hessian":
            return he.HessianOperator(model, batches, he.supervised_loss(crit), engine=e)
        return he.GGNOperator(
            model, batches, supervised_forward, supervised_loss_of_output(crit), engine=e
        )

    warm = make("autograd")
    v = torch.randn(
        warm.size, device=warm.device, generator=torch.Generator(warm.device).manual_seed(0)
    )
    t0 = time.perf_counter()
    warm @ v
    _sync()
    autograd_first = time.perf_counter() - t0
    t0 = time.perf_counter()
    ref = warm @ v
    _sync()
    autograd_ms = (time.perf_counter() - t0) * 1e3
    del warm
    op = make(engine)
    prof = None
    if os.environ.get("BENCH_TRACE_REUSE_PROFILE"):
        import cProfile

        prof = cProfile.Profile()
        prof.enable()
    t0 = time.perf_counter()
    out = op @ v
    _sync()
    first = time.perf_counter() - t0
    if prof is not None:
        import pstats

        prof.disable()
        order = os.environ["BENCH_TRACE_REUSE_PROFILE"]
        order = order if order in ("tottime", "cumulative") else "cumulative"
        pstats.Stats(prof, stream=sys.stderr).sort_stats(order).print_stats(40)
    t0 = time.perf_counter()
    op @ v
    _sync()
    second_ms = (time.perf_counter() - t0) * 1e3
    err = float(torch.linalg.vector_norm(out - ref) / torch.linalg.vector_norm(ref))
    return {
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "torch": torch.__version__,
        "autograd_first_s": round(autograd_first, 3),
        "autograd_ms": round(autograd_ms, 2),
        "first_s": round(first, 3),
        "second_ms": round(second_ms, 2),
        "rel_err_vs_autograd": err,
        "report": op.engine_report,
        "inductor_counters": _inductor_counters(),
    }


def _inductor_counters() -> dict[str, int]:
    """Inductor's and AOT autograd's cache hits, misses and bypasses in this process."""
    try:
        from torch._dynamo.utils import counters
    except Exception:
        return {}
    return {
        f"{group}.{key}": int(n)
        for group in ("inductor", "aot_autograd")
        for key, n in counters[group].items()
        if "cache" in key or "fxgraph" in key
    }


def run_child(cmd: list[str], env: dict[str, str], row: dict[str, Any]) -> str:
    """Run a child that prints one JSON line last: into ``row`` its wall time and that line, or
    the last lines of its error; returns its stderr."""
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    row["process_wall_s"] = round(time.perf_counter() - t0, 2)
    if proc.returncode == 0:
        row.update(json.loads(proc.stdout.strip().splitlines()[-1]))
    else:
        row["error"] = proc.stderr.strip().splitlines()[-3:]
    return proc.stderr


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("workload")
    ap.add_argument("--curvatures", default="hessian,ggn")
    ap.add_argument("--engines", default="functional,compiled")
    ap.add_argument("--processes", type=int, default=2)
    ap.add_argument("--scale", type=float, default=1.0)
    ap.add_argument("--record-dir", default="/tmp/he_trace_reuse")
    ap.add_argument("--child", nargs=2, metavar=("CURVATURE", "ENGINE"))
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.workload, *args.child, args.scale)), flush=True)
        return
    from hessian_eigenthings.operators.engines import trace_times

    for curv in args.curvatures.split(","):
        for engine in args.engines.split(","):
            shutil.rmtree(args.record_dir, ignore_errors=True)
            env = {**os.environ, trace_times.ENV: args.record_dir}
            for n in range(args.processes):
                cmd = [
                    sys.executable,
                    "-m",
                    "benchmarks.bench_trace_reuse",
                    args.workload,
                    "--scale",
                    str(args.scale),
                    "--child",
                    curv,
                    engine,
                ]
                row: dict[str, Any] = {
                    "workload": args.workload,
                    "curvature": curv,
                    "engine": engine,
                    "process": n + 1,
                }
                stderr = run_child(cmd, env, row)
                if os.environ.get("BENCH_TRACE_REUSE_PROFILE"):
                    sys.stderr.write(f"--- {curv} {engine} process {n + 1}\n" + stderr[-20000:])
                print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
