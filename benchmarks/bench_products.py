"""One curvature product against one gradient, side by side in one process.

    python -m benchmarks.bench_products --device cuda --out bench_out/products

Variants (all fp32, eval mode, one batch): gradient (the unit); a 0.x-style
baseline Hessian-vector product (forward, create_graph backward, torch.cat of
the gradient, double backward, torch.cat of the result); our HessianOperator
without graph reuse, with graph reuse, and a block of 8 (per vector). Repeats
are interleaved across variants; medians after warm-ups; CUDA events on GPU.
Peak = max allocated during one call minus allocated before it.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from benchmarks.workloads import WORKLOADS, Workload
from hessian_eigenthings import HessianOperator


def _timer(device: torch.device) -> Callable[[Callable[[], Any]], tuple[float, float]]:
    def run(fn: Callable[[], Any]) -> tuple[float, float]:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            base = torch.cuda.memory_allocated(device)
            torch.cuda.reset_peak_memory_stats(device)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = fn()
            end.record()
            torch.cuda.synchronize(device)
            peak = (torch.cuda.max_memory_allocated(device) - base) / 2**20
            del out
            return start.elapsed_time(end), peak
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3, float("nan")

    return run


def gradient_fn(w: Workload, params: list[nn.Parameter]) -> Callable[[], Any]:
    def f() -> Any:
        return torch.autograd.grad(w.loss_fn(w.model, w.batch), params)

    return f


def baseline_0x_fn(w: Workload, params: list[nn.Parameter], v: torch.Tensor) -> Callable[[], Any]:
    """The 0.x algorithm: recompute the graph, flatten with torch.cat, double backward, cat again."""

    def f() -> Any:
        loss = w.loss_fn(w.model, w.batch)
        grads = torch.autograd.grad(loss, params, create_graph=True)
        flat = torch.cat([g.contiguous().view(-1) for g in grads])
        hv = torch.autograd.grad(flat, params, grad_outputs=v, only_inputs=True)
        return torch.cat([h.contiguous().view(-1) for h in hv])

    return f


def run_workload(w: Workload, device: torch.device, repeats: int, warmup: int) -> dict[str, Any]:
    params = [p for p in w.model.parameters() if p.requires_grad]
    n = sum(p.numel() for p in params)
    gen = torch.Generator(device="cpu").manual_seed(0)
    v = torch.randn(n, generator=gen).to(device)
    V = torch.randn(n, 8, generator=gen).to(device)
    data = [w.batch]
    fresh = HessianOperator(w.model, data, w.loss_fn, graph_reuse=False)
    reuse = HessianOperator(w.model, data, w.loss_fn, graph_reuse=True)
    eager = HessianOperator(w.model, data, w.loss_fn, graph_reuse=True, cuda_graphs=False)
    fresh_eager = HessianOperator(w.model, data, w.loss_fn, graph_reuse=False, cuda_graphs=False)
    variants: dict[str, Callable[[], Any]] = {
        "gradient": gradient_fn(w, params),
        "0.x-style HVP": baseline_0x_fn(w, params, v),
        "1.0 HVP (no reuse)": lambda: fresh @ v,
        "1.0 HVP (no reuse, no CUDA graph)": lambda: fresh_eager @ v,
        "1.0 HVP (reuse)": lambda: reuse @ v,
        "1.0 HVP (reuse, no CUDA graph)": lambda: eager @ v,
        "1.0 block-8 (no reuse)": lambda: fresh @ V,
        "1.0 block-8 (no reuse, no CUDA graph)": lambda: fresh_eager @ V,
        "1.0 block-8 (reuse)": lambda: reuse @ V,
        "1.0 block-8 (reuse, no CUDA graph)": lambda: eager @ V,
    }
    timer = _timer(device)
    times: dict[str, list[float]] = {k: [] for k in variants}
    peaks: dict[str, list[float]] = {k: [] for k in variants}
    errors: dict[str, str] = {}
    for i in range(warmup + repeats):
        for name, fn in variants.items():
            if name in errors:
                continue
            try:
                t, peak = timer(fn)
            except Exception as exc:  # one failing variant must not abort the run
                errors[name] = f"{type(exc).__name__}: {str(exc)[:120]}"
                continue
            if i >= warmup:
                times[name].append(t)
                peaks[name].append(peak)
    # correctness: ours equals the baseline
    ref = baseline_0x_fn(w, params, v)().detach()
    got = fresh @ v
    rel = float((got - ref).norm() / ref.norm())
    med = {k: statistics.median(x) if x else float("nan") for k, x in times.items()}
    grad = med["gradient"]
    rows = {}
    for k in variants:
        per_vec = med[k] / 8 if "block" in k else med[k]
        rows[k] = {
            "ms": med[k],
            "ms_per_vector": per_vec,
            "x_gradient": per_vec / grad,
            "peak_mib": max(peaks[k]) if peaks[k] else float("nan"),
            "error": errors.get(k),
        }
    # correctness of replays: the reuse operator (replaying by now on CUDA) equals a fresh product
    rel_reuse = float(((reuse @ v) - got).norm() / got.norm())
    kept_mib = {
        "reuse": reuse.held_bytes / 2**20,
        "reuse, no CUDA graph": eager.held_bytes / 2**20,
        "no reuse (recorded products)": fresh.held_bytes / 2**20,
    }
    return {"workload": w.name, "params": n, "rel_err_vs_0x": rel, "rel_err_reuse_vs_fresh": rel_reuse,
            "replays": reuse.num_replays, "kept_mib": kept_mib, "rows": rows,
            "reuse_vs_0x": med["1.0 HVP (reuse)"] / med["0.x-style HVP"],
            "noreuse_vs_0x": med["1.0 HVP (no reuse)"] / med["0.x-style HVP"],
            "noreuse_eager_vs_0x": med["1.0 HVP (no reuse, no CUDA graph)"] / med["0.x-style HVP"]}


def profile(w: Workload, device: torch.device) -> None:
    """Top kernels and CPU time of one 0.x-style product and one of ours (no reuse)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    params = [p for p in w.model.parameters() if p.requires_grad]
    v = torch.randn(sum(p.numel() for p in params), device=device)
    fresh = HessianOperator(w.model, [w.batch], w.loss_fn, graph_reuse=False)
    reuse = HessianOperator(w.model, [w.batch], w.loss_fn, graph_reuse=True)
    for label, fn in (("0.x-style", baseline_0x_fn(w, params, v)), ("1.0 no reuse", lambda: fresh @ v), ("1.0 reuse", lambda: reuse @ v)):
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        print(f"== {w.name}: {label}")
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12, max_name_column_width=60))


def env_info(device: torch.device) -> dict[str, str]:
    info = {"torch": torch.__version__, "python": platform.python_version(), "device": str(device)}
    try:
        import triton

        info["triton"] = triton.__version__
    except Exception:
        info["triton"] = "not installed"
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    else:
        info["cpu"] = platform.processor() or platform.machine()
    return info


def to_markdown(results: list[dict[str, Any]], info: dict[str, str]) -> str:
    lines = [f"Device: {info.get('gpu', info.get('cpu'))}; torch {info['torch']}, triton {info['triton']}, Python {info['python']}", ""]
    lines.append("| workload | params | variant | ms (per vector for blocks) | × gradient | peak MiB |")
    lines.append("|---|---|---|---|---|---|")
    for r in results:
        for k, row in r["rows"].items():
            cell = row["error"] or f"{row['ms_per_vector']:.3f}"
            lines.append(f"| {r['workload']} | {r['params'] / 1e6:.2f} M | {k} | {cell} | {row['x_gradient']:.2f} | {row['peak_mib']:.0f} |")
        kept = ", ".join(f"{k} {x:.0f}" for k, x in r["kept_mib"].items())
        lines.append(f"| {r['workload']} | | ratios | reuse/0.x {r['reuse_vs_0x']:.2f}, no-reuse/0.x {r['noreuse_vs_0x']:.2f} (no CUDA graph {r['noreuse_eager_vs_0x']:.2f}), rel err {r['rel_err_vs_0x']:.1e}, reuse vs fresh {r['rel_err_reuse_vs_fresh']:.1e}, replays {r['replays']} | kept MiB: {kept} | |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--workloads", default="mlp,resnet18,gpt2")
    ap.add_argument("--scale", type=float, default=1.0, help="batch-size scale (CPU runs use < 1)")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--out", default="bench_out/products")
    ap.add_argument("--cudnn-benchmark", action="store_true", help="let cuDNN autotune (same for every variant)")
    ap.add_argument("--profile", action="store_true", help="print the top GPU kernels of the 0.x baseline and ours")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    torch.backends.cudnn.benchmark = bool(args.cudnn_benchmark)
    if args.profile:
        for name in args.workloads.split(","):
            profile(WORKLOADS[name](args.device, args.scale), device)
        return
    torch.manual_seed(0)
    results = []
    for name in args.workloads.split(","):
        w = WORKLOADS[name](args.device, args.scale)
        results.append(run_workload(w, device, args.repeats, args.warmup))
        print(to_markdown(results[-1:], env_info(device)), flush=True)
        del w
        if device.type == "cuda":
            torch.cuda.empty_cache()
    info = env_info(device)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "products.json").write_text(json.dumps({"env": info, "results": results}, indent=1))
    md = to_markdown(results, info)
    (out / "products.md").write_text(md + "\n")
    print(md)


if __name__ == "__main__":
    main()
