"""A script run as users run it: a bare ``op @ v`` loop from a fresh process, ``auto`` run once
and then again, against each fixed engine in a fresh process of its own (issue 27).

    python -m benchmarks.auto_fresh WORKLOAD [--curvatures ggn,hessian] [--length 20]
        [--reruns 2] [--record-dir DIR] > rows.jsonl

Per curvature, processes one after another: ``auto`` on an emptied record folder (a first run),
``--reruns`` more ``auto`` processes on that folder (the script run again), then ``autograd`` and
``functional`` (record off). Each process builds the model and batch, then times, from the
operator's construction to the loop's end (synchronised), ``--length`` products of one
direction: no warm-up, so CUDA's, cuBLAS's and cuDNN's first use in the process, the trace and
the first product all fall inside, as in a user's script. A row per process: that time, the
process's wall time, ``engine_report``. TF32 off.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from typing import Any

import torch

from benchmarks.bench_trace_reuse import run_child


def child(workload: str, curv: str, engine: str, length: int) -> dict[str, Any]:
    import hessian_eigenthings as he
    from benchmarks.workloads import build_parity
    from hessian_eigenthings.loss_fns import supervised_forward, supervised_loss_of_output

    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    w = build_parity(workload, device)
    model, batches, crit = w.model, w.batches[:1], w.criterion
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    if curv == "hessian":
        op = he.HessianOperator(model, batches, he.supervised_loss(crit), engine=engine)
    elif curv == "ggn":
        op = he.GGNOperator(
            model, batches, supervised_forward, supervised_loss_of_output(crit), engine=engine
        )
    else:
        op = he.EmpiricalFisherOperator(model, batches, w.per_sample_loss, engine=engine)
    v = torch.randn(op.size, device=op.device, generator=torch.Generator(op.device).manual_seed(0))
    for _ in range(length):
        op @ v
    sync()
    loop_s = time.perf_counter() - t0
    return {
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "torch": torch.__version__,
        "loop_s": round(loop_s, 4),
        "report": op.engine_report,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("workload")
    ap.add_argument("--curvatures", default="ggn,hessian")
    ap.add_argument("--length", type=int, default=20)
    ap.add_argument("--reruns", type=int, default=2)
    ap.add_argument("--record-dir", default="/tmp/he_auto_fresh")
    ap.add_argument("--child", nargs=2, metavar=("CURVATURE", "ENGINE"))
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.workload, *args.child, args.length)), flush=True)
        return
    from hessian_eigenthings.operators.engines import trace_times

    for curv in args.curvatures.split(","):
        shutil.rmtree(args.record_dir, ignore_errors=True)
        runs = [("auto", "first")] + [("auto", f"rerun {i + 1}") for i in range(args.reruns)]
        runs += [("autograd", "fixed"), ("functional", "fixed")]
        for engine, what in runs:
            env = {**os.environ, trace_times.ENV: args.record_dir if engine == "auto" else "0"}
            cmd = [sys.executable, "-m", "benchmarks.auto_fresh", args.workload, "--length",
                   str(args.length), "--child", curv, engine]
            row: dict[str, Any] = {"workload": args.workload, "curvature": curv, "engine": engine,
                                   "run": what, "length": args.length}
            run_child(cmd, env, row)
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
