"""MC-Fisher products, damped GGN solves and TF32-then-refine Lanczos, side by side with a gradient.

    python -m benchmarks.bench_zoo WORKLOAD [--scale S] [--cells mc,solve,tf32] > rows.jsonl

One JSON line per cell, in one process per workload (the parity workloads of
``benchmarks.workloads``, on CUDA when available; TF32 flags off outside the
cells that opt in):

- ``gradient``: one ``torch.autograd.grad`` of the batch loss (median ms);
- ``ggn_product`` / ``mc_fisher_product``: ``op @ v`` of the exact GGN and of
  ``GGNOperator(mc_samples=1)`` per engine (``--engines``; median ms on a kept batch
  after the first product, which traces/compiles, and the ratio to the gradient);
- ``ggn_solve``: ``he.solve(ggn, b, damping=λ, tol=1e-6 and 1e-4)`` with CG, ``λ`` 1e-2
  and 1e-1 of the top eigenvalue (Lanczos to 1e-2, not counted), or a tenth of the mean
  diagonal with ``--solve-trace-damping``: iterations, products, wall time, the true
  relative residual ``||(G + λI)x - b|| / ||b||`` recomputed after the run;
- ``hessian_product_precision``: one Hessian product with ``precision="fp32"`` and
  ``"tf32"`` on one operator (median ms each, relative difference);
- ``lanczos_fp32`` / ``lanczos_tf32_refine``: top-5 (``which="LA"``) Hessian
  eigenvalues at ``tol`` 1e-3 and 1e-4 from a fresh operator each (wall time
  includes building kept state), products, and the largest relative eigenvalue
  difference of the TF32-then-refine run to the fp32 run.
"""

from __future__ import annotations

import argparse
import gc
import json
import warnings
from typing import Any

import torch

from benchmarks.bench_engines import _triton_version, median_ms, wall_s
from benchmarks.workloads import build_parity


def main() -> None:
    import hessian_eigenthings as he
    from hessian_eigenthings.loss_fns import supervised_forward, supervised_loss_of_output

    ap = argparse.ArgumentParser()
    ap.add_argument("workload")
    ap.add_argument("--scale", type=float, default=1.0)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--cells", default="mc,solve,tf32")
    ap.add_argument("--solve-trace-damping", action="store_true")
    ap.add_argument("--engines", default="autograd,functional,compiled", help="engines of the product cells")
    args = ap.parse_args()
    cells = set(args.cells.split(","))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    w = build_parity(args.workload, device, args.scale)
    model, batches, crit = w.model, w.batches, w.criterion
    params = [p for p in model.parameters() if p.requires_grad]
    x, y = batches[0]

    def emit(row: dict[str, Any]) -> None:
        print(json.dumps({"workload": args.workload, **row}), flush=True)

    emit({
        "cell": "env",
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "torch": torch.__version__,
        "triton": _triton_version(),
        "tf32": "off (only the tf32 cells opt in)",
        "params": sum(p.numel() for p in params),
        "batches": len(batches),
    })

    grad_ms = median_ms(lambda: torch.autograd.grad(crit(model(x), y), params), args.reps)
    emit({"cell": "gradient", "ms": grad_ms})
    sup = he.supervised_loss(crit)

    def ggn(**kw: Any) -> Any:
        return he.GGNOperator(model, batches, supervised_forward, supervised_loss_of_output(crit), **kw)

    def fresh() -> None:
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()

    if "mc" in cells:
        variants = [("ggn_product", {"engine": e}) for e in args.engines.split(",")]
        variants += [("mc_fisher_product", {"mc_samples": 1, "seed": 0, "engine": e}) for e in args.engines.split(",")]
        for name, kw in variants:
            fresh()
            try:
                op = ggn(**kw)
                v = torch.randn(op.size, device=op.device, generator=torch.Generator(op.device).manual_seed(0))
                _, first = wall_s(lambda op=op, v=v: op @ v)
                ms = median_ms(lambda op=op, v=v: op @ v, args.reps)
                emit({"cell": name, "engine": kw["engine"], "ms": ms, "per_gradient": ms / grad_ms,
                      "first_s": first, "report": op.engine_report})
                del op
            except Exception as exc:  # a cell's failure is a row, not the end of the run
                emit({"cell": name, "engine": kw["engine"], "error": f"{type(exc).__name__}: {str(exc)[:300]}"})

    if "solve" in cells:
        fresh()
        try:
            op = ggn()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                tr = he.trace(op, num_matvecs=30, seed=0)
                top = he.algorithms.lanczos(op, k=1, which="LA", tol=1e-2, seed=0)
            lam_max = float(top.eigenvalues[0])
            b = torch.randn(op.size, device=op.device, generator=torch.Generator(op.device).manual_seed(1))
            # λ: 1e-2 and 1e-1 of λ_max (condition numbers about 100 and 10); a tenth of the mean
            # diagonal (--solve-trace-damping; cond ~ 10 λ_max n / tr, CG needs thousands of products)
            rules = [("1e-2 lambda_max", 1e-2 * lam_max), ("1e-1 lambda_max", 1e-1 * lam_max)]
            if args.solve_trace_damping:
                rules.append(("0.1 tr/n", 0.1 * abs(tr.estimate) / op.size))
            for label, lam in rules:
                for tol in (1e-6, 1e-4):
                    res, s = wall_s(lambda lam=lam, tol=tol: he.solve(op, b, damping=lam, tol=tol, max_iter=500,
                                                                      progress=False))
                    true_rel = float(((op @ res.x) + lam * res.x - b).norm() / b.norm())
                    emit({"cell": "ggn_solve", "method": "cg", "damping": lam, "damping_rule": label, "tol": tol,
                          "lambda_max": lam_max, "iterations": res.iterations, "products": res.num_matvecs, "s": s,
                          "converged": bool(res.converged.all()), "true_relative_residual": true_rel,
                          "report": op.engine_report})
            del op
        except Exception as exc:
            emit({"cell": "ggn_solve", "error": f"{type(exc).__name__}: {str(exc)[:300]}"})

    if "precision" in cells or "tf32" in cells:
        # the premise: one Hessian product in TF32 against fp32, same operator, kept state warm
        fresh()
        op = he.HessianOperator(model, batches, sup)
        v = torch.randn(op.size, device=op.device, generator=torch.Generator(op.device).manual_seed(0))
        row = {"cell": "hessian_product_precision"}
        outs = {}
        for prec in ("fp32", "tf32", "fp32"):
            op.precision = prec
            outs[prec] = op @ v
            row[f"{prec}_ms"] = median_ms(lambda op=op, v=v: op @ v, args.reps)
        row["tf32_rel_err"] = float((outs["tf32"] - outs["fp32"]).norm() / outs["fp32"].norm())
        row["report"] = op.engine_report
        emit(row)
        del op
    if "tf32" in cells:
        for tol in (1e-3, 1e-4):
            ref: torch.Tensor | None = None
            for name in ("lanczos_fp32", "lanczos_tf32_refine"):
                fresh()
                try:
                    op = he.HessianOperator(model, batches, sup)
                    with warnings.catch_warnings():
                        warnings.simplefilter("ignore")
                        if name == "lanczos_fp32":
                            res, s = wall_s(lambda op=op, tol=tol: he.algorithms.lanczos(op, k=5, which="LA", tol=tol, seed=0))
                        else:
                            res, s = wall_s(lambda op=op, tol=tol: he.lanczos_tf32_refine(op, k=5, which="LA", tol=tol, seed=0))
                    vals = res.eigenvalues
                    row: dict[str, Any] = {"cell": name, "tol": tol, "s": s, "products": res.iterations,
                                           "eigenvalues": [float(t) for t in vals],
                                           "converged": int(res.converged.sum()),
                                           "max_rel_residual": float((res.residuals / vals.abs()).max())}
                    if ref is None:
                        ref = vals
                    else:
                        row["max_rel_diff_to_fp32"] = float(((vals - ref).abs() / ref.abs()).max())
                    emit(row)
                    del op
                except Exception as exc:
                    emit({"cell": name, "tol": tol, "error": f"{type(exc).__name__}: {str(exc)[:300]}"})


if __name__ == "__main__":
    main()
