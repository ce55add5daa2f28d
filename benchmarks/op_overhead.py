"""Where an operator's product spends time beyond its recorded tangent program.

    python -m benchmarks.op_overhead WORKLOAD [--engine compiled] [--reps R] [--trace DIR]

On one kept batch, TF32 off, one JSON line per measurement (ms, median of ``--reps``):

- ``gradient`` / ``hvp_0x_style``: the units, same process;
- ``op``: ``op @ v`` with a device sync around each call (how the parity tables time it);
- ``interleaved``: the 0.x-style product and ``op @ v`` in turns, the median of the
  per-turn speedups (and their range);
- ``op_pipelined``: ``--reps`` products back to back, one sync at the end, per product;
- ``replay``: the operator's own CUDA graph of the product replayed alone;
- ``copy_in`` / ``copy_out``: the direction copied into the recording's inputs, its outputs
  into the flat result buffer;
- ``host_to_launch``: host time from the call to the graph's launch (the device idles then
  when calls are synchronised);
- ``profile``: torch.profiler's top host ops by self time over a few calls.
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from typing import Any

import torch

from benchmarks.bench_engines import median_ms
from benchmarks.hessian_gap import emit_units
from benchmarks.workloads import build_parity


def main() -> None:
    import hessian_eigenthings as he

    ap = argparse.ArgumentParser()
    ap.add_argument("workload", nargs="?", default="gpt2")
    ap.add_argument("--engine", default="compiled")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--trace", default=None, help="folder for a chrome trace of three products")
    ap.add_argument("--blas", default="default",
                    help="comma list of cuBLAS front ends to record the product with (default, cublaslt)")
    args = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    w = build_parity(args.workload, device)
    model, batches, crit = w.model, w.batches, w.criterion
    x, y = batches[0]
    params = [p for p in model.parameters() if p.requires_grad]

    def emit(row: dict[str, Any]) -> None:
        print(json.dumps({"workload": args.workload, "engine": args.engine, **row}), flush=True)

    vl, hvp_0x = emit_units(model, x, y, crit, params, args.reps, emit)
    v = torch.cat([t.reshape(-1) for t in vl])
    for blas in args.blas.split(","):
        op = _measure(he, model, batches, crit, v, args, blas, emit, hvp_0x)
        del op
        gc.collect()
        torch.cuda.empty_cache()


def _measure(
    he: Any, model: Any, batches: Any, crit: Any, v: torch.Tensor, args: Any, blas: str, emit_row: Any,
    hvp_0x: Any,
) -> Any:
    from hessian_eigenthings import _torch_compat

    cuda = v.is_cuda
    op = he.HessianOperator(model, batches, he.supervised_loss(crit), engine=args.engine,
                            graph_memory_budget=60 * 2**30)
    # the front end in force while the product is traced, compiled and recorded: a replay
    # runs the recorded kernels whatever the flag says later
    lib = torch.backends.cuda.preferred_blas_library() if cuda else None
    if cuda and blas != "default":
        torch.backends.cuda.preferred_blas_library(blas)
    t0 = time.perf_counter()
    for _ in range(3):
        op @ v
    if cuda:
        torch.backends.cuda.preferred_blas_library(lib)

    def emit(row: dict[str, Any]) -> None:
        emit_row({**row, "blas": blas})

    emit({"variant": "first", "s": round(time.perf_counter() - t0, 2), "report": op.engine_report})
    emit({"variant": "op", "ms": median_ms(lambda: op @ v, args.reps)})
    # the baseline and the product in turns, so drift of the device's clocks between two
    # blocks of measurements does not enter the ratio: median of the per-turn ratios
    pairs = []
    for _ in range(args.reps):
        pairs.append((median_ms(hvp_0x, 1, warm=0), median_ms(lambda: op @ v, 1, warm=0)))
    ratios = sorted(a / b for a, b in pairs)
    emit({"variant": "interleaved", "hvp_0x_style_ms": sorted(a for a, _ in pairs)[len(pairs) // 2],
          "op_ms": sorted(b for _, b in pairs)[len(pairs) // 2], "speedup_median": ratios[len(ratios) // 2],
          "speedup_min": ratios[0], "speedup_max": ratios[-1]})

    def pipelined() -> None:
        for _ in range(args.reps):
            op @ v

    emit({"variant": "op_pipelined", "ms": median_ms(pipelined, 3, warm=1) / args.reps})
    entry = next(iter(op._states.entries.values()))
    replay = entry.replays.get(1)
    emit({"variant": "recording", "replays": op.num_replays, "recorded": replay is not None,
          "held_mib": op.held_bytes / 2**20})
    vecs = op.layout.split_rows(v.unsqueeze(0))
    out = op.layout.empty(1)
    outs = op.layout.split_rows(out)
    if replay is not None:
        emit({"variant": "replay", "ms": median_ms(replay.graph.replay, args.reps)})
        emit({"variant": "copy_in", "ms": median_ms(lambda: _torch_compat.foreach_copy_(replay.inputs, vecs), args.reps)})
        pairs = [(o, p) for o, p in zip(outs, replay.outputs, strict=True) if p is not None]
        emit({"variant": "copy_out", "ms": median_ms(
            lambda: _torch_compat.foreach_copy_([o for o, _ in pairs], [p for _, p in pairs]), args.reps)})
        # host time from the call to the replay's launch: patch the graph's replay to stamp it
        stamps: list[float] = []
        real = replay.graph.replay

        def stamped() -> None:
            stamps.append(time.perf_counter())
            real()

        replay.graph.replay = stamped  # type: ignore[method-assign]
        lead = []
        for _ in range(args.reps):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            op @ v
            lead.append((stamps[-1] - t0) * 1e3)
            torch.cuda.synchronize()
        replay.graph.replay = real  # type: ignore[method-assign]
        lead.sort()
        emit({"variant": "host_to_launch", "ms": lead[len(lead) // 2]})
    if replay is not None:
        # Python's view of the same calls (the graph launch and the device wait included)
        import cProfile
        import pstats

        prof_py = cProfile.Profile()
        prof_py.enable()
        for _ in range(args.reps):
            op @ v
            torch.cuda.synchronize()
        prof_py.disable()
        st = pstats.Stats(prof_py)
        top = sorted(st.stats.items(), key=lambda kv: -kv[1][2])[:30]  # type: ignore[attr-defined]
        emit({"variant": "cprofile_tottime_ms", "top": [
            (f"{fn[0].split('/')[-1]}:{fn[1]}:{fn[2]}", round(v[2] * 1e3 / args.reps, 4), v[1] // args.reps)
            for fn, v in top]})
    t_alloc = median_ms(lambda: op.layout.empty(1), args.reps)
    emit({"variant": "alloc_out", "ms": t_alloc})
    from torch.profiler import ProfilerActivity, profile

    sync = torch.cuda.synchronize if cuda else (lambda: None)
    sync()
    acts = [ProfilerActivity.CPU, ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]
    with profile(activities=acts) as prof:
        for _ in range(3):
            op @ v
            sync()
    if args.trace:
        prof.export_chrome_trace(f"{args.trace}/op_{args.workload}.json")
    rows = [(e.key, e.self_cpu_time_total / 1e3 / 3, e.count // 3, e.device_time_total / 1e3 / 3)
            for e in prof.key_averages()]
    rows.sort(key=lambda r: -r[1])
    emit({"variant": "profile_host", "top": [(k[:70], round(t, 3), c, round(d, 3)) for k, t, c, d in rows[:25]]})
    rows.sort(key=lambda r: -r[3])
    emit({"variant": "profile_device", "top": [(k[:70], round(t, 3), c, round(d, 3)) for k, t, c, d in rows[:15]]})
    return op


if __name__ == "__main__":
    main()
