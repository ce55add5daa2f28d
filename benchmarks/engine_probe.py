"""Product-engine probe: what plain torch.func, a tangent/primal split and inductor reach.

One process per workload (``python -m benchmarks.engine_probe WORKLOAD``); prints one JSON
line per variant. Variants (ms, median of ``--reps`` after warm-ups, CUDA events):

- ``grad``: one gradient (forward + backward) — the unit every ratio is taken against;
- ``hvp_0x``: 0.x-style reverse-over-reverse Hessian product from scratch;
- ``hvp_kept_autograd``: the first-order graph kept, one double backward per product;
- ``hvp_fwd_rev``: ``jvp(grad(loss))`` from scratch, eager;
- ``hvp_split`` / ``hvp_split_compiled``: the forward-over-reverse product traced once with
  ``make_fx``, split into the part that reads only parameters and data (run once, kept)
  and the part that reads the tangent (run per product; eager or compiled by inductor);
- ``ggn_*`` / ``ef_*``: the same for ``Jᵀ H J`` (cross-entropy in closed form) and the
  empirical Fisher ``Jᵀ J / N`` of the per-sample losses.

Relative errors are against the kept autograd product of the same curvature (float32).
TF32 is off for every variant.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn


def _timeit(fn: Callable[[], Any], reps: int, warm: int = 3) -> float:
    for _ in range(warm):
        fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        times = []
        for _ in range(reps):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            torch.cuda.synchronize()
            times.append(a.elapsed_time(b))
    else:
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    times.sort()
    return times[len(times) // 2]


def split_by_tangent(gm: torch.fx.GraphModule, n_primal: int) -> tuple[torch.fx.GraphModule, torch.fx.GraphModule]:
    """Split a traced ``(primals..., tangents...) -> outputs`` graph into
    ``primal_part(primals) -> kept`` and ``tangent_part(kept..., tangents...) -> outputs``."""
    graph = gm.graph
    ph = [n for n in graph.nodes if n.op == "placeholder"]
    dep: set[torch.fx.Node] = set(ph[n_primal:])
    for n in graph.nodes:
        if n.op not in ("placeholder", "output", "get_attr") and any(a in dep for a in n.all_input_nodes):
            dep.add(n)
    out_node = next(n for n in graph.nodes if n.op == "output")
    boundary: list[torch.fx.Node] = []
    seen: set[torch.fx.Node] = set()
    for n in graph.nodes:
        if n in dep or n is out_node:
            for a in n.all_input_nodes:
                if a not in dep and a not in seen:
                    seen.add(a)
                    boundary.append(a)
    # primal part
    pg = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    for n in graph.nodes:
        if n in dep or n.op == "output":
            continue
        if n.op == "placeholder" and n not in ph[:n_primal]:
            continue
        env[n] = pg.node_copy(n, lambda x: env[x])
    pg.output(tuple(env[b] for b in boundary))
    pg.eliminate_dead_code()
    primal = torch.fx.GraphModule(gm, pg)
    # tangent part
    tg = torch.fx.Graph()
    env2: dict[torch.fx.Node, torch.fx.Node] = {}
    for i, b in enumerate(boundary):
        p = tg.placeholder(f"kept_{i}")
        p.meta = dict(b.meta)
        env2[b] = p
    for t in ph[n_primal:]:
        env2[t] = tg.node_copy(t)
    for n in graph.nodes:
        if n in dep and n.op != "placeholder":
            env2[n] = tg.node_copy(n, lambda x: env2[x])
    tg.output(torch.fx.node.map_arg(out_node.args[0], lambda x: env2[x]))
    tg.eliminate_dead_code()
    tangent = torch.fx.GraphModule(gm, tg)
    return primal, tangent


def workload(key: str, device: str, scale: float = 1.0) -> tuple[nn.Module, Any, Callable[..., torch.Tensor], Callable[..., torch.Tensor]]:
    """``(model, batch, logits_fn(model, batch) -> (N, C), targets)``."""
    sys.path.insert(0, os.getcwd())
    from benchmarks import workloads as W

    torch.manual_seed(0)
    if key in ("mlp", "resnet18"):
        w = W.WORKLOADS[key](device, scale)
        x, y = w.batch
        return w.model, (x, y), (lambda m, b: m(b[0])), y
    pw = W.parity_gpt2(device, scale) if key == "gpt2" else W.parity_gpt2_large(device, scale)
    x, y = pw.batches[0]
    return pw.model, (x, y), (lambda m, b: m(b[0])), y


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("workload")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--scale", type=float, default=1.0)
    ap.add_argument("--skip", default="", help="comma-separated variant prefixes to skip")
    args = ap.parse_args()
    skip = [s for s in args.skip.split(",") if s]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    model, batch, logits_fn, y = workload(args.workload, device, args.scale)
    model.eval()
    names = [n for n, _ in model.named_parameters()]
    params = {n: p.detach() for n, p in model.named_parameters()}
    buffers = {n: b for n, b in model.named_buffers()}
    plist = [p for p in model.parameters()]
    N = y.shape[0]

    def logits_at(p: dict[str, torch.Tensor]) -> torch.Tensor:
        return torch.func.functional_call(model, {**p, **buffers}, (batch[0],))

    def loss_at(p: dict[str, torch.Tensor]) -> torch.Tensor:
        return nn.functional.cross_entropy(logits_at(p), y)

    def per_sample_at(p: dict[str, torch.Tensor]) -> torch.Tensor:
        ls = nn.functional.cross_entropy(logits_at(p), y, reduction="none")
        return ls.view(batch[0].shape[0], -1).mean(1)

    gen = torch.Generator(device=device).manual_seed(1)
    v = {n: torch.randn(p.shape, device=device, generator=gen) for n, p in params.items()}
    vl = [v[n] for n in names]
    rows: list[dict[str, Any]] = []

    def emit(name: str, ms: float, ref: list[torch.Tensor] | None = None, out: Any = None, **extra: Any) -> None:
        row: dict[str, Any] = {"workload": args.workload, "variant": name, "ms": round(ms, 3), **extra}
        if ref is not None and out is not None:
            o = out if isinstance(out, (list, tuple)) else [out[n] for n in names]
            num = torch.sqrt(sum(((a.double() - b.double()) ** 2).sum() for a, b in zip(o, ref)))
            den = torch.sqrt(sum((b.double() ** 2).sum() for b in ref))
            row["rel_err"] = float(num / den)
        rows.append(row)
        print(json.dumps(row), flush=True)

    def want(name: str) -> bool:
        return not any(name.startswith(s) for s in skip)

    # --- gradient ---------------------------------------------------------------
    def grad() -> Any:
        return torch.autograd.grad(nn.functional.cross_entropy(model(batch[0]), y), plist)

    g_ms = _timeit(grad, args.reps)
    emit("grad", g_ms)

    # --- Hessian ----------------------------------------------------------------
    def hvp_0x() -> list[torch.Tensor]:
        g = torch.autograd.grad(nn.functional.cross_entropy(model(batch[0]), y), plist, create_graph=True)
        return list(torch.autograd.grad(g, plist, vl))

    if want("hvp"):
        emit("hvp_0x", _timeit(hvp_0x, args.reps))
        g_kept = torch.autograd.grad(nn.functional.cross_entropy(model(batch[0]), y), plist, create_graph=True)

        def hvp_kept() -> list[torch.Tensor]:
            return list(torch.autograd.grad(g_kept, plist, vl, retain_graph=True))

        ref_h = hvp_kept()
        emit("hvp_kept_autograd", _timeit(hvp_kept, args.reps), ref_h, ref_h)

        def fwd_rev(p: dict[str, torch.Tensor], t: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
            return torch.func.jvp(torch.func.grad(loss_at), (p,), (t,))[1]

        if want("hvp_fwd_rev"):
            emit("hvp_fwd_rev", _timeit(lambda: fwd_rev(params, v), args.reps), ref_h, fwd_rev(params, v))
        del g_kept
        _split_variants("hvp", fwd_rev, params, v, names, ref_h, emit, args.reps, want)
        del ref_h

    # --- GGN and empirical Fisher -------------------------------------------------
    def ce_h(out: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        p = torch.softmax(out, -1)
        return (p * t - p * (p * t).sum(-1, keepdim=True)) / out.shape[0]

    def ggn_prod(p: dict[str, torch.Tensor], t: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        out, vjp_fn = torch.func.vjp(logits_at, p)
        _, jv = torch.func.jvp(logits_at, (p,), (t,))
        return vjp_fn(ce_h(out, jv))[0]

    def ef_prod(p: dict[str, torch.Tensor], t: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        out, vjp_fn = torch.func.vjp(per_sample_at, p)
        _, jv = torch.func.jvp(per_sample_at, (p,), (t,))
        return vjp_fn(jv / out.shape[0])[0]

    for tag, prod in (("ggn", ggn_prod), ("ef", ef_prod)):
        if not want(tag):
            continue
        ref = [prod(params, v)[n] for n in names]
        emit(f"{tag}_fresh_functional", _timeit(lambda prod=prod: prod(params, v), args.reps), ref, prod(params, v))
        _split_variants(tag, prod, params, v, names, ref, emit, args.reps, want)
        # linearize-based kept state (torch.func, eager)
        fn = logits_at if tag == "ggn" else per_sample_at
        try:
            out, jvp_fn = torch.func.linearize(fn, params)
            _, vjp_fn = torch.func.vjp(fn, params)

            def lin(out=out, jvp_fn=jvp_fn, vjp_fn=vjp_fn, tag=tag) -> dict[str, torch.Tensor]:
                jv = jvp_fn(v)
                return vjp_fn(ce_h(out, jv) if tag == "ggn" else jv / out.shape[0])[0]

            emit(f"{tag}_linearize", _timeit(lin, args.reps), ref, lin())
            del out, jvp_fn, vjp_fn
        except Exception as exc:  # noqa: BLE001
            emit(f"{tag}_linearize", float("nan"), error=repr(exc)[:300])
    print(json.dumps({"workload": args.workload, "summary": rows}))


def _split_variants(
    tag: str,
    prod: Callable[[dict[str, torch.Tensor], dict[str, torch.Tensor]], dict[str, torch.Tensor]],
    params: dict[str, torch.Tensor],
    v: dict[str, torch.Tensor],
    names: list[str],
    ref: list[torch.Tensor],
    emit: Callable[..., None],
    reps: int,
    want: Callable[[str], bool],
) -> None:
    from torch.fx.experimental.proxy_tensor import make_fx

    P = len(names)

    def flat(*args: torch.Tensor) -> list[torch.Tensor]:
        p = dict(zip(names, args[:P]))
        t = dict(zip(names, args[P:]))
        out = prod(p, t)
        return [out[n] for n in names]

    pl = [params[n] for n in names]
    vl = [v[n] for n in names]
    try:
        t0 = time.perf_counter()
        gm = make_fx(flat, _error_on_data_dependent_ops=False)(*pl, *vl)
        primal, tangent = split_by_tangent(gm, P)
        trace_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        kept = list(primal(*pl))
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        prep_s = time.perf_counter() - t0
        kept_mb = sum(k.numel() * k.element_size() for k in kept if isinstance(k, torch.Tensor)) / 2**20
        emit(f"{tag}_split", _timeit(lambda: tangent(*kept, *vl), reps), ref, tangent(*kept, *vl),
             trace_s=round(trace_s, 2), prep_s=round(prep_s, 3), kept_mb=round(kept_mb, 1),
             nodes=len(gm.graph.nodes), tangent_nodes=len(tangent.graph.nodes))
    except Exception as exc:  # noqa: BLE001
        emit(f"{tag}_split", float("nan"), error=repr(exc)[:400])
        return
    if want(f"{tag}_split_compiled"):
        try:
            t0 = time.perf_counter()
            ctan = torch.compile(tangent, fullgraph=True, dynamic=False)
            first = ctan(*kept, *vl)
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            comp_s = time.perf_counter() - t0
            emit(f"{tag}_split_compiled", _timeit(lambda: ctan(*kept, *vl), reps), ref, first, compile_s=round(comp_s, 1))
        except Exception as exc:  # noqa: BLE001
            emit(f"{tag}_split_compiled", float("nan"), error=repr(exc)[:400])
    if want(f"{tag}_fresh_compiled"):
        try:
            t0 = time.perf_counter()
            cprod = torch.compile(prod, fullgraph=True, dynamic=False)
            first = cprod(params, v)
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            comp_s = time.perf_counter() - t0
            emit(f"{tag}_fresh_compiled", _timeit(lambda: cprod(params, v), reps), ref, first, compile_s=round(comp_s, 1))
        except Exception as exc:  # noqa: BLE001
            emit(f"{tag}_fresh_compiled", float("nan"), error=repr(exc)[:400])
    del kept


if __name__ == "__main__":
    main()
