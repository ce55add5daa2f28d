"""Fused cross-entropy Hessian product: time against the bandwidth floor.

    python benchmarks/bench_kernels.py --out DIR [--quick] [--budget-s S]

On CUDA, for the ANCHORS.md shapes: measured copy bandwidth (bytes read +
written), floor = (read logits + read u + write out) / bandwidth, time of
eager / compile / every Triton config of a chunk x warps sweep (median of
``triton.testing.do_bench``), ratio to the floor, relative error against the
float32 reference, extra peak memory (``out=None`` and ``out=u``); a
vocabulary sweep for the ``auto`` threshold; the fused loss's double backward
against ``F.cross_entropy``'s. Writes ``kernels.json`` and ``kernels.md`` to
``--out`` after every section (a run cut short keeps what it measured) and
prints a compact table last. A failing config records its error and the run
goes on. Without CUDA (``--quick`` on a laptop) it runs tiny shapes, with
Triton only under ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import platform
import statistics
import sys
import time
import traceback
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _import_kernels() -> types.ModuleType:
    try:
        return importlib.import_module("hessian_eigenthings.kernels")
    except Exception:
        # Other layers of the package may be mid-edit in this tree; the
        # kernels need only _torch_compat, so load them without the top-level
        # __init__.
        for name in [m for m in sys.modules if m.startswith("hessian_eigenthings")]:
            del sys.modules[name]
        pkg = types.ModuleType("hessian_eigenthings")
        pkg.__path__ = [str(ROOT / "hessian_eigenthings")]
        sys.modules["hessian_eigenthings"] = pkg
        return importlib.import_module("hessian_eigenthings.kernels")


K = _import_kernels()
CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
TRITON_OK = K._dispatch._torch_compat.has_triton() and (
    CUDA or os.environ.get("TRITON_INTERPRET") == "1"
)
if TRITON_OK:
    from hessian_eigenthings.kernels.cross_entropy_triton import (
        TritonConfig,
        cross_entropy_hvp_triton,
        default_config,
    )

GiB = 2**30
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


# ------------------------------------------------------------------ timing


def bench(fn: Callable[[], Any], reps_ms: int = 100) -> float:
    """Median milliseconds."""
    if CUDA:
        try:
            import triton.testing

            return float(triton.testing.do_bench(fn, warmup=25, rep=reps_ms, return_mode="median"))
        except ImportError:
            pass
        fn()
        times = []
        for _ in range(20):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b))
        return statistics.median(times)
    fn()
    times = []
    for _ in range(3):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def extra_peak_gib(fn: Callable[[], Any]) -> float | None:
    if not CUDA:
        return None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    res = fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    del res
    return peak / GiB


def copy_bandwidth(nbytes: int) -> float:
    """Bytes read + written per second by a large device-to-device copy."""
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=DEV).uniform_()
    dst = torch.empty_like(src)
    ms = bench(lambda: dst.copy_(src))
    return 2 * nbytes / (ms * 1e-3)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    diff = (out.float() - ref).abs().max()
    return float(diff / ref.abs().max().clamp_min(1e-30))


# ------------------------------------------------------------------ sections


def sweep_configs(quick: bool, sweep: str = "full") -> list[TritonConfig | None]:
    """None = the default config for the shape; then chunk x warps with 8 to
    32 columns per thread (NOTE [split rows])."""
    if quick:
        return [None, TritonConfig(chunk=64, num_warps=1)]
    if sweep == "none":
        return [None]
    return [None] + [
        TritonConfig(chunk=chunk, num_warps=warps)
        for chunk in (2048, 4096, 8192, 16384, 32768)
        for warps in (2, 4, 8, 16, 32)
        if 8 <= chunk // (32 * warps) <= 32
    ]


def product_section(
    label: str,
    rows: int,
    V: int,
    dtype: torch.dtype,
    bw: float,
    quick: bool,
    deadline: float,
    sweep: str = "full",
    sliced: bool = False,
) -> dict[str, Any]:
    torch.manual_seed(0)
    valid: torch.Tensor | None = None
    n: float | torch.Tensor
    if sliced:
        # The causal-LM layout: logits[:, :-1] of (B, T+1, V), ~5% ignored
        # rows, n on device.
        B = 8
        full = (3 * torch.randn(B, rows // B + 1, V, device=DEV)).to(dtype)
        logits = full[:, :-1]
        u = torch.randn(B, rows // B, V, device=DEV).to(dtype)
        valid = torch.rand(B, rows // B, device=DEV) > 0.05
        n = valid.sum()
    else:
        logits = (3 * torch.randn(rows, V, device=DEV)).to(dtype)
        u = torch.randn(rows, V, device=DEV).to(dtype)
        n = float(rows)
    ref = K.cross_entropy_hvp_reference(logits.float(), u.float(), valid, n)
    elem = logits.element_size()
    floor_ms = 3 * rows * V * elem / bw * 1e3
    res: dict[str, Any] = {
        "shape": label,
        "rows": rows,
        "V": V,
        "dtype": str(dtype).replace("torch.", ""),
        "floor_ms": floor_ms,
        "impls": [],
    }

    def record(name: str, run: Callable[[torch.Tensor | None], torch.Tensor]) -> None:
        entry: dict[str, Any] = {"impl": name}
        try:
            if time.time() > deadline:
                raise TimeoutError("skipped: time budget spent")
            poisoned = torch.full(logits.shape, float("nan"), dtype=dtype, device=DEV)
            out = run(poisoned)
            entry["rel_err"] = rel_err(out, ref)
            entry["unwritten"] = int(out.isnan().sum())
            del out, poisoned
            entry["ms"] = bench(lambda: run(None))
            entry["x_floor"] = entry["ms"] / floor_ms
            entry["extra_peak_gib"] = extra_peak_gib(lambda: run(None))
            scratch = u.clone()  # out=u: in place
            entry["extra_peak_gib_out_u"] = extra_peak_gib(lambda: run(scratch))
        except Exception as e:  # one failing config must not end the run
            entry["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
            entry["trace"] = traceback.format_exc()[-2000:]
        res["impls"].append(entry)
        print(f"  {label} {name}: {_fmt_entry(entry)}", flush=True)

    def with_out(f: Callable[..., torch.Tensor]) -> Callable[[torch.Tensor | None], torch.Tensor]:
        def run(out: torch.Tensor | None) -> torch.Tensor:
            return f(out)

        return run

    # ``out`` is a NaN-poisoned buffer for the check, u's clone for the
    # in-place memory figure, or None.
    record(
        "eager", with_out(lambda o: K.cross_entropy_hvp(logits, u, valid, n, impl="eager", out=o))
    )
    record(
        "compile",
        with_out(lambda o: K.cross_entropy_hvp(logits, u, valid, n, impl="compile", out=o)),
    )
    if TRITON_OK:
        for cfg in sweep_configs(quick, "none" if sliced else sweep):
            c = cfg or default_config(V)
            name = f"triton{'*' if cfg is None else ''} c{c.chunk} w{c.num_warps}"
            record(
                name,
                with_out(
                    lambda o, c=c: cross_entropy_hvp_triton(logits, u, valid, n, out=o, config=c)
                ),
            )
    return res


def threshold_section(quick: bool, deadline: float) -> dict[str, Any]:
    """eager vs fused over the vocabulary size, for AUTO_EAGER_MAX_VOCAB."""
    vocabs = (64, 512) if quick else (128, 256, 512, 1024, 2048, 4096, 8192, 16384)
    row_counts = (8,) if quick else (512, 8192)
    out: list[dict[str, Any]] = []
    for rows in row_counts:
        for V in vocabs:
            if time.time() > deadline:
                break
            z = torch.randn(rows, V, device=DEV)
            u = torch.randn(rows, V, device=DEV)
            entry: dict[str, Any] = {"rows": rows, "V": V}
            for impl in ("eager", "compile", "triton"):
                if impl == "triton" and not TRITON_OK:
                    continue
                try:
                    entry[impl] = bench(
                        lambda impl=impl, z=z, u=u: K.cross_entropy_hvp(z, u, None, 3.0, impl=impl),
                        50,
                    )
                except Exception as e:
                    entry[impl] = f"{type(e).__name__}"
            out.append(entry)
            print(f"  threshold {entry}", flush=True)
    # Smallest V from which the fused kernel wins at the largest row count
    # (at few rows every implementation is launch-bound and the order is noise).
    fused = "triton" if TRITON_OK else "compile"
    big = [e for e in out if e["rows"] == max(row_counts)]
    suggested = None
    for i, e in enumerate(big):
        if all(isinstance(f.get(fused), float) and f[fused] <= f["eager"] for f in big[i:]):
            suggested = e["V"]
            break
    return {"points": out, "fused": fused, "suggested_threshold": suggested}


def loss_section(quick: bool) -> dict[str, Any]:
    """HVP through the loss w.r.t. logits: fused double backward vs F.cross_entropy's."""
    B, T, V = (2, 9, 300) if quick else (8, 512, 50304)
    dtype = torch.float32 if quick else torch.bfloat16
    torch.manual_seed(0)
    logits = (3 * torch.randn(B, T + 1, V, device=DEV)).to(dtype)
    labels = torch.randint(0, V, (B, T), device=DEV)
    labels[:, :3] = -100
    w = torch.randn_like(logits)

    def hvp(loss_fn: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        z = logits.detach().requires_grad_()
        (g,) = torch.autograd.grad(loss_fn(z[:, :-1]), z, create_graph=True)
        (hv,) = torch.autograd.grad(g, z, grad_outputs=w)
        return hv

    def fused(z: torch.Tensor) -> torch.Tensor:
        return K.fused_cross_entropy(z, labels)

    def torch_ce(z: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(z.reshape(-1, V), labels.reshape(-1))

    res: dict[str, Any] = {"shape": f"B{B} T{T} V{V}", "dtype": str(dtype).replace("torch.", "")}
    ref = None
    for name, fn in (("F.cross_entropy", torch_ce), ("fused_cross_entropy", fused)):
        try:
            out = hvp(fn)
            if ref is None:
                ref = hvp(lambda z: torch_ce(z.float())).float()
            res[name] = {
                "ms": bench(lambda fn=fn: hvp(fn)),
                "extra_peak_gib": extra_peak_gib(lambda fn=fn: hvp(fn)),
                "rel_err_vs_fp32": rel_err(out, ref),
            }
        except Exception as e:
            res[name] = {"error": f"{type(e).__name__}: {e}"[:300]}
        print(f"  loss {name}: {res[name]}", flush=True)
    return res


def kernel_stats() -> list[dict[str, Any]]:
    """Registers and spills of each compiled variant (best effort: triton internals)."""
    if not (CUDA and TRITON_OK):
        return []
    try:
        from hessian_eigenthings.kernels.cross_entropy_triton import _ce_hvp_kernel

        stats = []
        if hasattr(_ce_hvp_kernel, "device_caches"):  # triton >= 3.2
            caches = [entry[0] for entry in _ce_hvp_kernel.device_caches.values()]
        else:
            caches = list(_ce_hvp_kernel.cache.values())
        for per_device in caches:
            for key, kern in per_device.items():
                stats.append(
                    {
                        "key": str(key)[-300:],
                        "n_regs": getattr(kern, "n_regs", None),
                        "n_spills": getattr(kern, "n_spills", None),
                        "num_warps": getattr(getattr(kern, "metadata", None), "num_warps", None),
                    }
                )
        return stats
    except Exception as e:
        return [{"error": repr(e)}]


# ------------------------------------------------------------------ output


def _fmt(x: Any, spec: str) -> str:
    return format(x, spec) if isinstance(x, (int, float)) else "-"


def _fmt_entry(e: dict[str, Any]) -> str:
    if "error" in e:
        return f"ERROR {e['error']}"
    return (
        f"{e['ms']:.3f} ms, {e['x_floor']:.2f}x floor, rel err {e['rel_err']:.1e}, "
        f"unwritten {e['unwritten']}, extra peak {_fmt(e['extra_peak_gib'], '.2f')} / "
        f"{_fmt(e['extra_peak_gib_out_u'], '.2f')} GiB (out=u)"
    )


def markdown(report: dict[str, Any]) -> str:
    env = report["env"]
    lines = [
        "# bench_kernels",
        "",
        f"device {env['device']}, torch {env['torch']}, triton {env['triton']}, "
        f"copy bandwidth {_fmt(env.get('copy_bw_tbs'), '.2f')} TB/s (read + written)",
        "",
        "| shape | dtype | impl | ms | × floor | rel err | extra peak GiB (out=None / out=u) |",
        "|---|---|---|---|---|---|---|",
    ]
    for sec in report["products"]:
        lines.append(
            f"| {sec['shape']} | {sec['dtype']} | floor | {sec['floor_ms']:.3f} | 1.00 | | |"
        )
        for e in sec["impls"]:
            if "error" in e:
                lines.append(
                    f"| {sec['shape']} | {sec['dtype']} | {e['impl']} | ERROR: {e['error']} | | | |"
                )
                continue
            lines.append(
                f"| {sec['shape']} | {sec['dtype']} | {e['impl']} | {e['ms']:.3f} | "
                f"{e['x_floor']:.2f} | {e['rel_err']:.1e}{' UNWRITTEN' if e['unwritten'] else ''} | "
                f"{_fmt(e['extra_peak_gib'], '.2f')} / {_fmt(e['extra_peak_gib_out_u'], '.2f')} |"
            )
    th = report.get("threshold")
    if th and "points" in th:
        lines += [
            "",
            f"auto threshold (fused = {th['fused']}): suggested {th['suggested_threshold']}",
            "",
        ]
        lines += ["| rows | V | eager ms | compile ms | triton ms |", "|---|---|---|---|---|"]
        for p in th["points"]:
            lines.append(
                f"| {p['rows']} | {p['V']} | {_fmt(p.get('eager'), '.4f')} | "
                f"{_fmt(p.get('compile'), '.4f')} | {_fmt(p.get('triton'), '.4f')} |"
            )
    loss = report.get("loss")
    if loss:
        lines += ["", f"HVP through the loss, {loss['shape']} {loss['dtype']}:", ""]
        for name in ("F.cross_entropy", "fused_cross_entropy"):
            lines.append(f"- {name}: {loss.get(name)}")
    return "\n".join(lines) + "\n"


def compact(report: dict[str, Any]) -> str:
    rows = []
    for sec in report["products"]:
        ok = [e for e in sec["impls"] if "error" not in e]
        best = min(
            (e for e in ok if e["impl"].startswith("triton")), key=lambda e: e["ms"], default=None
        )
        get = {e["impl"]: e for e in ok}
        rows.append(
            f"{sec['shape']:>18} {sec['dtype']:>5} floor {sec['floor_ms']:.3f} | "
            f"eager {_fmt(get.get('eager', {}).get('x_floor'), '.2f')}x "
            f"compile {_fmt(get.get('compile', {}).get('x_floor'), '.2f')}x "
            + (f"best triton {best['x_floor']:.2f}x [{best['impl']}]" if best else "no triton")
        )
        failed = [e["impl"] for e in sec["impls"] if "error" in e]
        if failed:
            rows.append(f"{'':>18} failed: {', '.join(failed)}")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--quick", action="store_true", help="tiny shapes, two configs")
    ap.add_argument("--budget-s", type=float, default=330.0, help="stop sweeping after this")
    ap.add_argument("--sweep", choices=["none", "full"], default="full")
    ap.add_argument("--shapes", default="", help="comma-separated shape labels (default: all)")
    ap.add_argument("--products-only", action="store_true", help="skip the loss and threshold")
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    deadline = time.time() + args.budget_s

    tv = K._dispatch._torch_compat.triton_version()
    env: dict[str, Any] = {
        "device": torch.cuda.get_device_name() if CUDA else platform.processor() or "cpu",
        "torch": torch.__version__,
        "triton": str(tv) if tv else None,
        "python": platform.python_version(),
    }
    if CUDA:
        props = torch.cuda.get_device_properties(0)
        env["sms"] = props.multi_processor_count
        env["l2_mb"] = getattr(props, "L2_cache_size", 0) / 1e6
    report: dict[str, Any] = {"env": env, "products": []}

    def save() -> None:
        (args.out / "kernels.json").write_text(json.dumps(report, indent=1, default=str))
        (args.out / "kernels.md").write_text(markdown(report))

    bw = copy_bandwidth(2 * GiB if CUDA and not args.quick else 64 * 2**20)
    env["copy_bw_tbs"] = bw / 1e12
    print(f"env: {env}", flush=True)
    save()

    if args.quick:
        shapes = [("B2 T9 V1025", 18, 1025, "fp32"), ("B2 T3 V50257", 6, 50257, "bf16")]
    else:
        shapes = [
            ("B64 T256 V50304", 64 * 256, 50304, "fp32"),
            ("B64 T256 V50304", 64 * 256, 50304, "bf16"),
            ("B8 T1024 V128256", 8 * 1024, 128256, "bf16"),
            ("B8 T1024 V128256 sliced+mask", 8 * 1024, 128256, "bf16"),
            ("B64 T256 V16384", 64 * 256, 16384, "bf16"),
        ]
    if args.shapes:
        keep = {x.strip() for x in args.shapes.split(",")}
        shapes = [sh for sh in shapes if f"{sh[0]} {sh[3]}" in keep or sh[0] in keep]
    start = time.time()
    for i, (label, rows, V, dt) in enumerate(shapes):
        # Each shape gets its share of the budget, so a slow sweep cannot
        # starve the shapes after it.
        shape_deadline = start + args.budget_s * (i + 1) / len(shapes)
        try:
            report["products"].append(
                product_section(
                    label,
                    rows,
                    V,
                    DTYPES[dt],
                    bw,
                    args.quick,
                    shape_deadline,
                    args.sweep,
                    sliced="sliced" in label,
                )
            )
            if CUDA:
                torch.cuda.empty_cache()
        except Exception as e:
            report["products"].append(
                {
                    "shape": label,
                    "dtype": dt,
                    "floor_ms": float("nan"),
                    "impls": [],
                    "error": repr(e),
                }
            )
        save()
    for name, section in (("loss", loss_section), ("threshold", threshold_section)):
        if args.products_only:
            break
        try:
            report[name] = (
                section(args.quick) if name == "loss" else section(args.quick, deadline + 60)
            )
        except Exception as e:
            report[name] = {"error": repr(e)}
        save()
    report["kernel_stats"] = kernel_stats()
    save()
    print(markdown(report))
    print(compact(report))


if __name__ == "__main__":
    main()
