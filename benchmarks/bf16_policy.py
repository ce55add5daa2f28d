"""The half-model policy on a Llama-3.2-1B-shaped model: eigenvalues and cost (issue 39).

    python -m benchmarks.bf16_policy --out bench_out/bf16_policy.json            # 1B, one GPU
    python -m benchmarks.bf16_policy --device cpu --layers 1 --hidden 32 --heads 4 \\
        --kv-heads 2 --intermediate 64 --vocab 101 --batch 2 --length 16            # smoke run

A randomly initialized (seeded) ``LlamaConfig`` model (hidden 2048, 16 layers, 32 heads / 8
key-value heads, intermediate 8192, vocabulary 128256 by default), loaded once in float32 and
once as bfloat16 (``.to(torch.bfloat16)`` of the same weights); one batch of ``--batch`` x
``--length`` random tokens. Three runs, one after the other (each operator freed before the
next):

- ``fp32``: the float32 model;
- ``bf16_default``: the bfloat16 model under the default policy (products on float32 copies,
  NOTE [half models] in ``operators.precision``);
- ``bf16_model``: the bfloat16 model with ``precision="model"`` (bfloat16 arithmetic).

Each: the top ``--k`` eigenvalues of the GGN (``--curvature hessian``: the Hessian) by
``lanczos(op, k=5, tol=1e-4, seed=0)``, the products that took and its time, seconds per product
(median of ``--repeats`` products after Lanczos, its state kept), peak GPU memory from the
operator's construction to the end of its timed products. Relative differences of the
eigenvalues against ``fp32`` (note: the bfloat16 weights are the float32 weights rounded, so
even exact arithmetic differs from ``fp32`` by the rounding of the weights) and of
``bf16_model`` against ``bf16_default`` (the same weights: the arithmetic alone). Writes JSON to
stdout and to ``--out``.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from hessian_eigenthings import lanczos
from hessian_eigenthings.loss_fns import hf_lm_forward, hf_lm_loss, hf_lm_loss_of_output
from hessian_eigenthings.operators import GGNOperator, HessianOperator


def build_model(args: argparse.Namespace, device: torch.device) -> torch.nn.Module:
    import transformers

    config = transformers.LlamaConfig(
        hidden_size=args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        intermediate_size=args.intermediate,
        vocab_size=args.vocab,
        max_position_embeddings=max(args.length, 128),
        tie_word_embeddings=True,
        attn_implementation="sdpa",
    )
    torch.manual_seed(args.seed)
    return transformers.LlamaForCausalLM(config).to(device).eval()


def environment(device: torch.device) -> dict[str, Any]:
    info: dict[str, Any] = {"torch": torch.__version__, "device": str(device)}
    for name in ("triton", "transformers"):
        try:
            info[name] = __import__(name).__version__
        except Exception:
            info[name] = "not installed"
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    info["tf32"] = {
        "cuda.matmul.allow_tf32": bool(torch.backends.cuda.matmul.allow_tf32),
        "cudnn.allow_tf32": bool(torch.backends.cudnn.allow_tf32),
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
        "note": "the operators run products with TF32 off (precision='fp32') and restore these",
    }
    return info


def make_operator(
    args: argparse.Namespace, model: torch.nn.Module, batch: dict[str, torch.Tensor], precision: str
) -> Any:
    options: dict[str, Any] = {"engine": args.engine, "precision": precision}
    if args.curvature == "hessian":
        return HessianOperator(model, [batch], hf_lm_loss(), **options)
    return GGNOperator(model, [batch], hf_lm_forward(), hf_lm_loss_of_output(), **options)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def one_run(
    args: argparse.Namespace,
    model: torch.nn.Module,
    batch: dict[str, torch.Tensor],
    precision: str,
    device: torch.device,
) -> dict[str, Any]:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    op = make_operator(args, model, batch, precision)
    sync(device)
    t0 = time.perf_counter()
    res = lanczos(
        op,
        k=args.k,
        tol=args.tol,
        seed=0,
        max_iter=args.max_iter,
        ncv=args.ncv,
        basis_device=args.basis_device,
    )
    sync(device)
    lanczos_s = time.perf_counter() - t0
    products = op.num_matvecs
    v = torch.randn(op.size, generator=torch.Generator().manual_seed(1)).to(device, op.dtype)
    times = []
    for _ in range(args.repeats):
        sync(device)
        t = time.perf_counter()
        op @ v
        sync(device)
        times.append(time.perf_counter() - t)
    out: dict[str, Any] = {
        "precision": precision,
        "param_dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
        "op_dtype": str(op.dtype).removeprefix("torch."),
        "engine": op.engine,
        "eigenvalues": [float(x) for x in res.eigenvalues],
        "residuals": [float(x) for x in res.residuals],
        "converged": [bool(x) for x in res.converged],
        "lanczos_products": products,
        "lanczos_s": round(lanczos_s, 3),
        "s_per_product": round(statistics.median(times), 4),
        "held_bytes": op.held_bytes,
    }
    if device.type == "cuda":
        out["peak_gpu_bytes"] = torch.cuda.max_memory_allocated(device) - base
        out["model_bytes"] = base
    del op, res, v
    gc.collect()
    return out


def relative(a: list[float], b: list[float]) -> list[float]:
    """|a_i - b_i| / |b_i|, eigenvalues matched by rank (both sorted by the same rule)."""
    return [abs(x - y) / abs(y) if y else float("inf") for x, y in zip(a, b, strict=True)]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--intermediate", type=int, default=8192)
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--length", type=int, default=1024)
    ap.add_argument("--curvature", choices=["ggn", "hessian"], default="ggn")
    ap.add_argument("--engine", default="autograd")
    ap.add_argument("--k", type=int, default=5)
    ap.add_argument("--tol", type=float, default=1e-4)
    ap.add_argument(
        "--max-iter", type=int, default=60, help="cap on Lanczos products (keeps the 1B run short)"
    )
    ap.add_argument("--ncv", type=int, default=None, help="Lanczos basis size (None: its default)")
    ap.add_argument(
        "--basis-device",
        default=None,
        help="where the Krylov basis lives (cpu: host memory; None: the operator's device)",
    )
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--runs",
        default="fp32,bf16_default,bf16_model",
        help="which of fp32, bf16_default, bf16_model to run (comma-separated)",
    )
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    device = torch.device(args.device)

    model = build_model(args, device)
    g = torch.Generator().manual_seed(args.seed + 1)
    ids = torch.randint(0, args.vocab, (args.batch, args.length), generator=g).to(device)
    batch = {"input_ids": ids, "labels": ids}
    report: dict[str, Any] = {
        "config": {k: v for k, v in vars(args).items() if k != "out"},
        "parameters": sum(p.numel() for p in model.parameters()),
        "environment": environment(device),
        "runs": {},
    }
    runs = args.runs.split(",")

    def run(name: str, precision: str) -> None:
        report["runs"][name] = one_run(args, model, batch, precision, device)
        print(json.dumps({name: report["runs"][name]}), flush=True)  # kept if a later run is cut

    if "fp32" in runs:
        run("fp32", "fp32")
    model = model.to(torch.bfloat16)  # the same weights, rounded to bfloat16
    if "bf16_default" in runs:
        run("bf16_default", "fp32")
    if "bf16_model" in runs:
        run("bf16_model", "model")
    got = report["runs"]
    diffs: dict[str, Any] = {}
    for name in ("bf16_default", "bf16_model"):
        if name in got and "fp32" in got:
            diffs[f"{name}_vs_fp32"] = relative(
                got[name]["eigenvalues"], got["fp32"]["eigenvalues"]
            )
    if "bf16_model" in got and "bf16_default" in got:
        diffs["bf16_model_vs_bf16_default"] = relative(
            got["bf16_model"]["eigenvalues"], got["bf16_default"]["eigenvalues"]
        )
    report["relative_differences"] = diffs
    text = json.dumps(report, indent=2)
    print(text)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    return report


if __name__ == "__main__":
    main()
