"""Where a traced Hessian product's time goes: the operator's compiled product taken apart.

    python -m benchmarks.hessian_gap WORKLOAD [--scale S] [--reps R] > rows.jsonl

One JSON line per variant, ms per product (median of ``--reps`` after warm-ups), on one kept
batch, TF32 off:

- ``gradient`` and ``hvp_0x_style`` (reverse-over-reverse from scratch): the units;
- ``op_<engine>``: ``op @ v`` through the operator (data loop, buffer, guards included);
- ``tangent_eager`` / ``tangent_inductor``: the operator's own tangent program called directly
  on its kept values (eager, and the artifact the compiled engine made): the operator's
  overhead is ``op_compiled - tangent_inductor``;
- ``tangent_dynamo``: the same tangent graph compiled through ``torch.compile`` instead;
- ``tangent_inductor_graph``: the inductor artifact replayed as a CUDA graph (launch overhead);
- ``closed_*``: the product traced with the batch and buffers closed over (constants), as a
  stand-alone script would, split the same way.

Each row carries the kept bytes, node counts and the relative difference to the autograd
product; the ``ops`` row lists the aten ops whose counts differ between the two tangent graphs.
"""

from __future__ import annotations

import argparse
import collections
import gc
import json
import time
from collections.abc import Callable
from typing import Any

import torch

from benchmarks.bench_engines import median_ms
from benchmarks.workloads import build_parity


def _ops(gm: torch.fx.GraphModule) -> collections.Counter[str]:
    return collections.Counter(str(n.target) for n in gm.graph.nodes if n.op == "call_function")


def _nbytes(ts: Any) -> int:
    return sum(t.untyped_storage().nbytes() for t in {id(t): t for t in ts if isinstance(t, torch.Tensor)}.values())


def _bound(fn: Callable[..., Any], args: tuple[Any, ...]) -> Callable[[], Any]:
    return lambda: fn(*args)


def _cuda_graph(fn: Callable[..., Any], args: tuple[torch.Tensor, ...], kept: int) -> Callable[[], Any]:
    """``fn(*args)`` recorded once; the kept values are read in place, the directions copied in."""
    static = [a if i < kept else a.clone() for i, a in enumerate(args)]
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            fn(*static)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = fn(*static)
    del out
    return g.replay


def _profile(fn: Callable[[], Any], calls: int = 3) -> dict[str, Any]:
    """GPU time per call by kernel kind (matrix products vs the rest), and the top kernels."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    rows = [(e.key, e.device_time_total / 1e3 / calls, e.count // calls) for e in prof.key_averages()]
    rows = [r for r in rows if r[1] > 0]
    rows.sort(key=lambda r: -r[1])
    gemm = sum(t for k, t, _ in rows if any(s in k.lower() for s in ("gemm", "cutlass", "sm90", "xmma", "ampere")))
    total = sum(t for _, t, _ in rows)
    return {"gpu_ms": round(total, 2), "gemm_ms": round(gemm, 2), "kernels": sum(c for _, _, c in rows),
            "top": [(k[:80], round(t, 2), c) for k, t, c in rows[:12]]}


def emit_units(
    model: torch.nn.Module, x: Any, y: Any, crit: Any, params: list[torch.Tensor], reps: int,
    emit: Callable[[dict[str, Any]], None],
) -> tuple[list[torch.Tensor], Callable[[], Any]]:
    """Emit the ``env``, ``gradient`` and ``hvp_0x_style`` rows (the units every table divides
    by); returns the direction used and the 0.x-style product."""
    cuda = torch.cuda.is_available()
    emit({"variant": "env", "device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__,
          "params": sum(p.numel() for p in params), "tf32": False})
    emit({"variant": "gradient", "ms": median_ms(lambda: torch.autograd.grad(crit(model(x), y), params), reps)})
    vl = [torch.randn_like(p) for p in params]

    def hvp_0x() -> Any:
        g = torch.autograd.grad(crit(model(x), y), params, create_graph=True)
        return torch.autograd.grad(g, params, vl)

    emit({"variant": "hvp_0x_style", "ms": median_ms(hvp_0x, reps)})
    return vl, hvp_0x


def main() -> None:
    import hessian_eigenthings as he
    from hessian_eigenthings import _torch_compat
    from hessian_eigenthings.operators.engines import split_by_tangent

    ap = argparse.ArgumentParser()
    ap.add_argument("workload", nargs="?", default="gpt2")
    ap.add_argument("--scale", type=float, default=1.0)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--skip", default="")
    args = ap.parse_args()
    skip = set(filter(None, args.skip.split(",")))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    cuda = device == "cuda"
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    w = build_parity(args.workload, device, args.scale)
    model, batches, crit = w.model, w.batches, w.criterion
    x, y = batches[0]
    params = [p for p in model.parameters() if p.requires_grad]

    def emit(row: dict[str, Any]) -> None:
        print(json.dumps({"workload": args.workload, **row}), flush=True)

    vl, _ = emit_units(model, x, y, crit, params, args.reps, emit)
    sup = he.supervised_loss(crit)
    ref: torch.Tensor | None = None

    def err(out: torch.Tensor) -> float | None:
        return None if ref is None else float((out.double() - ref.double()).norm() / ref.double().norm())

    def flat(parts: Any) -> torch.Tensor:
        return torch.cat([t.reshape(-1) for t in parts])

    op_graph = None
    for eng in ("autograd", "functional", "compiled"):
        if f"op_{eng}" in skip:
            continue
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
        op = he.HessianOperator(model, batches, sup, engine=eng, graph_memory_budget=60 * 2**30)
        v = flat(vl)
        t0 = time.perf_counter()
        out = op @ v
        first = time.perf_counter() - t0
        if ref is None:
            ref = out
        ms = median_ms(lambda op=op, v=v: op @ v, args.reps)
        emit({"variant": f"op_{eng}", "ms": ms, "first_s": round(first, 2), "rel_err": err(out),
              "rel_err_after": err(op @ v), "replays": op.num_replays,
              "held_mib": op.held_bytes / 2**20, "report": op.engine_report})
        if eng == "autograd":
            del op
            continue
        entry = next(iter(op._states.entries.values()))
        state = entry.state
        prog = state.program
        kept = state.kept
        parts = [t[0] for t in op.layout.split_rows(v.unsqueeze(0))]
        targs = (*kept, *parts)
        info = {"kept": len(kept), "kept_mib": _nbytes(kept) / 2**20, "nodes": prog.nodes,
                "tangent_nodes": prog.tangent.num_nodes, "primal_nodes": prog.primal.num_nodes}
        if eng == "functional":
            op_graph = prog.tangent
            emit({"variant": "tangent_eager", "ms": median_ms(_bound(prog.tangent, targs), args.reps),
                  "rel_err": err(flat(prog.tangent(*targs))), **info})
            strides = collections.Counter(
                "contiguous" if k.is_contiguous() else "strided" for k in kept if isinstance(k, torch.Tensor)
            )
            emit({"variant": "kept_layouts", **strides})
        else:
            fn = prog.compiled.get(1)
            if fn:
                emit({"variant": "tangent_inductor", "ms": median_ms(_bound(fn, targs), args.reps),
                      "rel_err": err(flat(fn(*targs))), **info})
                if cuda and "profile" not in skip:
                    emit({"variant": "tangent_inductor_profile", **_profile(_bound(fn, targs))})
                if cuda and "graph" not in skip:
                    try:
                        replay = _cuda_graph(fn, targs, len(kept))
                        emit({"variant": "tangent_inductor_graph", "ms": median_ms(replay, args.reps)})
                    except Exception as exc:
                        emit({"variant": "tangent_inductor_graph", "error": repr(exc)[:300]})
            if "dynamo" not in skip:
                try:
                    t0 = time.perf_counter()
                    dyn = torch.compile(prog.tangent.module, fullgraph=True, dynamic=False)
                    o = dyn(*targs)
                    cs = time.perf_counter() - t0
                    emit({"variant": "tangent_dynamo", "ms": median_ms(_bound(dyn, targs), args.reps),
                          "compile_s": round(cs, 1), "rel_err": err(flat(o))})
                except Exception as exc:
                    emit({"variant": "tangent_dynamo", "error": repr(exc)[:300]})
        op = entry = state = kept = targs = None  # free the kept state before the next engine
    # --- the product traced with the batch and buffers closed over --------------------------
    if "closed" in skip:
        return
    from torch.fx.experimental.proxy_tensor import make_fx

    names = [n for n, p in model.named_parameters() if p.requires_grad]
    buffers = dict(model.named_buffers())

    def loss_at(p: dict[str, torch.Tensor]) -> torch.Tensor:
        return crit(torch.func.functional_call(model, {**p, **buffers}, (x,)), y)

    P = len(names)

    def product(*a: torch.Tensor) -> list[torch.Tensor]:
        p = dict(zip(names, a[:P], strict=True))
        t = dict(zip(names, a[P:], strict=True))
        out = torch.func.jvp(torch.func.grad(loss_at), (p,), (t,))[1]
        return [out[n] for n in names]

    pl = [p.detach() for p in params]
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    for decomp in (False, True):
        if decomp:
            _torch_compat.load_forward_ad_decompositions()
        t0 = time.perf_counter()
        gm = make_fx(product, _error_on_data_dependent_ops=False)(*pl, *vl)
        primal, tangent, nk = split_by_tangent(gm, P)
        trace_s = time.perf_counter() - t0
        with torch.no_grad():
            kept = tuple(primal(*pl))
            targs = (*kept, *vl)
            tag = "closed_decomp" if decomp else "closed"
            emit({"variant": f"{tag}_eager", "ms": median_ms(_bound(tangent, targs), args.reps),
                  "rel_err": err(flat(tangent(*targs))), "kept": nk, "kept_mib": _nbytes(kept) / 2**20,
                  "nodes": len(gm.graph.nodes), "tangent_nodes": len(tangent.graph.nodes), "trace_s": round(trace_s, 1)})
            if op_graph is not None and not decomp:
                a, b = _ops(op_graph), _ops(tangent)
                diff = {k: (a.get(k, 0), b.get(k, 0)) for k in set(a) | set(b) if a.get(k, 0) != b.get(k, 0)}
                emit({"variant": "ops_operator_vs_closed", "diff": dict(sorted(diff.items()))})
            if f"{tag}_dynamo" not in skip:
                try:
                    t0 = time.perf_counter()
                    dyn = torch.compile(tangent, fullgraph=True, dynamic=False)
                    o = dyn(*targs)
                    cs = time.perf_counter() - t0
                    emit({"variant": f"{tag}_dynamo", "ms": median_ms(_bound(dyn, targs), args.reps),
                          "compile_s": round(cs, 1), "rel_err": err(flat(o))})
                except Exception as exc:
                    emit({"variant": f"{tag}_dynamo", "error": repr(exc)[:300]})
        kept = targs = gm = primal = tangent = None
        gc.collect()


if __name__ == "__main__":
    main()
