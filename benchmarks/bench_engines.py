"""Product engines side by side: Hessian, GGN and empirical Fisher products per engine, against
the gradient and a 0.x-style Hessian product measured in the same process.

    python -m benchmarks.bench_engines WORKLOAD [--blocks] [--algorithms] > rows.jsonl

One JSON line per cell. Product cells time ``op @ v`` on a kept batch (median of ``--reps``
after warm-ups; the first call — tracing, compiling, building the kept state — is reported as
``first_s``), with the relative difference to the autograd engine's product. ``--blocks`` adds
blocks of 8 (ms per vector). ``--algorithms`` adds a 100-product Lanczos (top 10), Hutch++ (99
products) and SLQ (3 runs of 30 steps) on the Hessian, wall time from a fresh operator —
compile and trial time included — for ``autograd`` and ``auto``. TF32 is off (products run at
full float32 whatever the flags say; the gradient and 0.x columns set the flags off too).
Workloads are those of ``benchmarks.workloads`` (parity set), on CUDA when available.
"""

from __future__ import annotations

import argparse
import gc
import json
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch

from benchmarks.workloads import build_parity


def _triton_version() -> str | None:
    try:
        import triton
    except ImportError:
        return None
    return str(triton.__version__)


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def median_ms(fn: Callable[[], Any], reps: int, warm: int = 3) -> float:
    for _ in range(warm):
        fn()
    times = []
    for _ in range(reps):
        _sync()
        t0 = time.perf_counter()
        fn()
        _sync()
        times.append((time.perf_counter() - t0) * 1e3)
    times.sort()
    return times[len(times) // 2]


def wall_s(fn: Callable[[], Any]) -> tuple[Any, float]:
    _sync()
    t0 = time.perf_counter()
    out = fn()
    _sync()
    return out, time.perf_counter() - t0


def main() -> None:
    import hessian_eigenthings as he
    from hessian_eigenthings.loss_fns import supervised_forward, supervised_loss_of_output

    ap = argparse.ArgumentParser()
    ap.add_argument("workload")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--engines", default="autograd,functional,compiled")
    ap.add_argument("--curvatures", default="hessian,ggn,ef")
    ap.add_argument("--blocks", action="store_true")
    ap.add_argument("--algorithms", action="store_true")
    ap.add_argument(
        "--algo-engines", default="autograd,auto", help="engines of the --algorithms runs"
    )
    ap.add_argument("--algos", default="lanczos,hutch++,slq", help="which --algorithms runs")
    ap.add_argument(
        "--layers",
        default=None,
        help="the blocks engine='layers' walks (parity LMs: lm.transformer.h)",
    )
    ap.add_argument(
        "--graph-budget-gib", type=float, default=None, help="graph_memory_budget of the operators"
    )
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    w = build_parity(args.workload, device)
    model, batches, crit = w.model, w.batches, w.criterion
    params = [p for p in model.parameters() if p.requires_grad]
    x, y = batches[0]
    env = {
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "torch": torch.__version__,
        "triton": _triton_version(),
        "tf32": False,
    }

    def emit(row: dict[str, Any]) -> None:
        print(json.dumps({"workload": args.workload, **row}), flush=True)

    emit({"cell": "env", **env, "params": sum(p.numel() for p in params), "batches": len(batches)})

    def grad() -> Any:
        return torch.autograd.grad(crit(model(x), y), params)

    v_list = [torch.randn_like(p) for p in params]

    def hvp_0x() -> Any:
        g = torch.autograd.grad(crit(model(x), y), params, create_graph=True)
        return torch.autograd.grad(g, params, v_list)

    if len(batches) == 1:
        emit({"cell": "gradient", "ms": median_ms(grad, args.reps)})
        emit({"cell": "hvp_0x_style", "ms": median_ms(hvp_0x, args.reps)})

    sup = he.supervised_loss(crit)
    budget = None if args.graph_budget_gib is None else int(args.graph_budget_gib * 2**30)

    def walk(e: str) -> dict[str, Any]:
        return {"layers": args.layers} if e == "layers" else {}

    makers: dict[str, Callable[[str], Any]] = {
        "hessian": lambda e: he.HessianOperator(
            model, batches, sup, engine=e, graph_memory_budget=budget, **walk(e)
        ),
        "ggn": lambda e: he.GGNOperator(
            model,
            batches,
            supervised_forward,
            supervised_loss_of_output(crit),
            engine=e,
            graph_memory_budget=budget,
            **walk(e),
        ),
        "ef": lambda e: he.EmpiricalFisherOperator(
            model, batches, w.per_sample_loss, engine=e, graph_memory_budget=budget, **walk(e)
        ),
    }
    engines = args.engines.split(",")
    for curv in args.curvatures.split(","):
        ref: torch.Tensor | None = None
        for eng in engines:
            gc.collect()
            if device == "cuda":
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
            try:
                op = makers[curv](eng)
                v = torch.randn(
                    op.size, device=op.device, generator=torch.Generator(op.device).manual_seed(0)
                )
                out, first = wall_s(lambda op=op, v=v: op @ v)
                if ref is None:
                    ref = out
                err = float((out - ref).norm() / ref.norm())
                ms = median_ms(lambda op=op, v=v: op @ v, args.reps)
                again = op @ v  # after the timed (possibly replayed) products: still the product?
                err_after = float((again - ref).norm() / ref.norm())
                row: dict[str, Any] = {
                    "cell": f"{curv}_product",
                    "engine": eng,
                    "ms": ms,
                    "first_s": first,
                    "rel_err_vs_autograd": err,
                    "rel_err_after_timing": err_after,
                    "held_mib": op.held_bytes / 2**20,
                    "peak_mib": torch.cuda.max_memory_allocated() / 2**20
                    if device == "cuda"
                    else None,
                    "report": op.engine_report,
                }
                if args.blocks:
                    V = torch.randn(op.size, 8, device=op.device)
                    op @ V
                    row["block8_ms_per_vector"] = (
                        median_ms(lambda op=op, V=V: op @ V, max(3, args.reps // 2), warm=1) / 8
                    )
                emit(row)
                del op, out
            except Exception as exc:
                emit(
                    {
                        "cell": f"{curv}_product",
                        "engine": eng,
                        "error": f"{type(exc).__name__}: {str(exc)[:300]}",
                    }
                )
        ref = None

    if args.algorithms:
        for eng in args.algo_engines.split(","):
            for algo in args.algos.split(","):
                gc.collect()
                if device == "cuda":
                    torch.cuda.empty_cache()
                op = makers["hessian"](eng)
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    if algo == "lanczos":
                        res, s = wall_s(
                            lambda op=op: he.lanczos(op, k=10, max_iter=100, tol=1e-12, seed=0)
                        )
                        value = [float(t) for t in res.eigenvalues[:3]]
                    elif algo == "hutch++":
                        res, s = wall_s(lambda op=op: he.trace(op, num_matvecs=99, seed=0))
                        value = float(res.estimate)
                    else:
                        res, s = wall_s(
                            lambda op=op: he.spectral_density(
                                op, num_runs=3, lanczos_steps=30, seed=0
                            )
                        )
                        value = float(res.grid[res.density.argmax()])
                emit(
                    {
                        "cell": f"hessian_{algo}",
                        "engine": eng,
                        "s": s,
                        "products": op.num_matvecs,
                        "value": value,
                        "report": op.engine_report,
                    }
                )
                del op


if __name__ == "__main__":
    main()
