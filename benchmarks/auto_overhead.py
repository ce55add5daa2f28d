"""Where `auto`'s short runs lose to the best fixed engine: per-product times and the host work
of a switch (issue 27, the 20-product cells).

    python -m benchmarks.auto_overhead WORKLOAD [--curvatures ggn,ef] [--lengths 20,100]
        [--profile] > rows.jsonl

Per curvature, in one process after the warm-ups of ``bench_defaults`` (an autograd product, a
3-product lanczos and one trace per curvature), each of these runs a bare ``op @ v`` loop from a
fresh operator, synchronising after every product:

- ``autograd`` and ``functional``: the fixed engines;
- ``auto_cold``: nothing recorded (a first run); ``auto_rerun``: the record its cold run left.

A row per cell gives the wall time, every product's time in ms, and the time spent in the pieces
of a switch, timed by wrapping them for the run: traces, CUDA-graph captures (and the free-memory
check before each, which empties torch's cache), the operator's dropped states, the record's reads
and writes, ``auto``'s judgement. ``--profile`` adds a cProfile of each ``auto`` cell (top
functions by own time and by cumulative time; it slows the host work it measures).
"""

from __future__ import annotations

import argparse
import cProfile
import functools
import gc
import io
import json
import os
import pstats
import shutil
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch

from benchmarks.curvatures import makers as curvature_makers
from benchmarks.curvatures import sync as _sync
from benchmarks.curvatures import warm_process
from benchmarks.workloads import build_parity

#: (owner, attribute, label) of what is timed while wrapped
WRAPPED = (
    ("hessian_eigenthings.operators.engines.tracing:Tracer", "trace", "trace"),
    ("hessian_eigenthings.operators.cuda_graphs:GraphRecorder", "room_for", "room_for"),
    ("hessian_eigenthings.operators.cuda_graphs:GraphRecorder", "record", "capture"),
    ("hessian_eigenthings.operators.cuda_graphs:GraphRecorder", "record_product", "record_product"),
    ("hessian_eigenthings.operators.data_setup:DataOperatorSetup", "clear_cache", "clear_cache"),
    ("hessian_eigenthings.operators.engines.trace_times:TraceTimes", "facts", "record_read"),
    ("hessian_eigenthings.operators.engines.trace_times:TraceTimes", "note_facts", "record_write"),
    ("hessian_eigenthings.operators.engines.trace_times:TraceTimes", "note", "record_write"),
    ("hessian_eigenthings.operators.engines.auto:EngineSelector", "structure", "structure_key"),
    ("hessian_eigenthings.operators.engines.auto:EngineSelector", "before_block", "before_block"),
    ("hessian_eigenthings.operators.engines.auto:EngineSelector", "judge_loop", "judge_loop"),
    ("hessian_eigenthings.operators.engines.auto:EngineSelector", "_switch", "switch"),
    ("hessian_eigenthings.operators.engines.functional:FunctionalRunner", "prepare", "functional_prepare"),
    ("hessian_eigenthings.operators.engines.runner:AutogradRunner", "prepare", "autograd_prepare"),
)


def _wrap(spent: dict[str, list[float]]) -> None:
    """Time every entry of WRAPPED into ``spent`` (label -> seconds per call)."""
    import importlib

    for where, attr, label in WRAPPED:
        mod, cls = where.split(":")
        try:
            owner = getattr(importlib.import_module(mod), cls)
            fn = getattr(owner, attr)
        except (ImportError, AttributeError):
            continue

        def timed(*a: Any, _fn: Callable[..., Any] = fn, _label: str = label, **kw: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return _fn(*a, **kw)
            finally:
                spent[_label].append(time.perf_counter() - t0)

        setattr(owner, attr, functools.wraps(fn)(timed))


def main() -> None:
    from hessian_eigenthings.operators.engines import TRACE_TIMES, trace_times

    ap = argparse.ArgumentParser()
    ap.add_argument("workload")
    ap.add_argument("--curvatures", default="ggn,ef")
    ap.add_argument("--lengths", default="20,100")
    ap.add_argument("--record-dir", default="/tmp/he_auto_overhead")
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args()

    def use_record(folder: str | None, clear: bool) -> None:
        TRACE_TIMES.clear()
        if folder is None:
            os.environ[trace_times.ENV] = "0"
            return
        if clear:
            shutil.rmtree(folder, ignore_errors=True)
        os.environ[trace_times.ENV] = folder

    use_record(None, False)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    w = build_parity(args.workload, device)

    def emit(row: dict[str, Any]) -> None:
        print(json.dumps({"workload": args.workload, **row}), flush=True)

    emit({"cell": "env", "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
          "torch": torch.__version__, "tf32": False})
    makers = curvature_makers(w)

    def fresh(curv: str, eng: str) -> Any:
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()
        return makers[curv](eng)

    curvs = args.curvatures.split(",")
    warm_process(makers, curvs)  # the process's one-time costs, as bench_defaults takes them

    spent: dict[str, list[float]] = defaultdict(list)
    _wrap(spent)

    def loop(curv: str, eng: str, n: int, cell: str, profile: bool) -> None:
        op = fresh(curv, "auto" if eng in ("auto_cold", "auto_rerun") else eng)
        v = torch.randn(op.size, device=op.device, generator=torch.Generator(op.device).manual_seed(0))
        spent.clear()
        per: list[float] = []
        prof = cProfile.Profile() if profile else None
        _sync()
        t0 = time.perf_counter()
        if prof is not None:
            prof.enable()
        for _ in range(n):
            t = time.perf_counter()
            op @ v
            _sync()
            per.append((time.perf_counter() - t) * 1e3)
        if prof is not None:
            prof.disable()
        s = time.perf_counter() - t0
        rep = op.engine_report
        row: dict[str, Any] = {
            "cell": cell, "curvature": curv, "engine": eng, "length": n, "s": s,
            "per_ms": [round(x, 3) for x in per],
            "spent_ms": {k: [round(x * 1e3, 3) for x in v] for k, v in spent.items()},
            "active": rep.get("active"), "auto": rep.get("auto"), "trace_s": rep.get("trace_s"),
            "counts": {k: getattr(op.counts, k) for k in ("passes", "forwards", "replays") if hasattr(op.counts, k)},
        }
        if prof is not None:
            for key in ("tottime", "cumulative"):
                buf = io.StringIO()
                pstats.Stats(prof, stream=buf).sort_stats(key).print_stats(30)
                row[f"profile_{key}"] = buf.getvalue()[-9000:]
        emit(row)
        del op

    for curv in curvs:
        for n in [int(x) for x in args.lengths.split(",")]:
            folder = os.path.join(args.record_dir, f"{curv}-{n}")
            for eng in ("autograd", "functional"):
                use_record(None, False)
                loop(curv, eng, n, "fixed", False)
            use_record(folder, clear=True)
            loop(curv, "auto_cold", n, "auto", False)
            use_record(folder, clear=False)
            loop(curv, "auto_rerun", n, "auto", False)
            if args.profile:
                use_record(folder + "-p", clear=True)
                loop(curv, "auto_cold", n, "auto_profiled", True)
                use_record(folder + "-p", clear=False)
                loop(curv, "auto_rerun", n, "auto_profiled", True)


if __name__ == "__main__":
    main()
