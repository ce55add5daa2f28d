"""A full GGN product on the GPT-2-style model at B64·T256: time and peak memory per path.

    python -m benchmarks.bench_lm_ggn --device cuda --out bench_out/lm_ggn

Paths (same model, data and vector; fp32; eval mode; no graph reuse):
- ``eager CE``: the whole logits tensor, the eager cross-entropy output Hessian
  (softmax temporaries at vocabulary size);
- ``fused CE``: the whole logits tensor, the fused kernel (``fused="auto"``);
- ``chunked LM head``: ``Jv`` at the logits, the fused output Hessian and its
  pull-back to the last hidden states and the unembedding, chunk by chunk
  over rows, never holding a full ``(B·T, V)`` tensor (NOTE [chunked LM head]).
Median of ``--repeats`` interleaved calls after ``--warmup``; CUDA events;
peak = max allocated during one call minus allocated before it.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

import torch

from benchmarks.bench_products import _timer, env_info
from benchmarks.workloads import gpt2
from hessian_eigenthings import GGNOperator
from hessian_eigenthings.loss_fns import hf_lm_forward, hf_lm_loss_of_output


def run(device: torch.device, batch: int, seq: int, repeats: int, warmup: int) -> dict[str, Any]:
    w = gpt2(str(device), 1.0)
    torch.manual_seed(0)
    ids = torch.randint(0, w.model.config.vocab_size, (batch, seq), device=device)
    data = [{"input_ids": ids}]
    ops = {
        "eager CE": GGNOperator(w.model, data, hf_lm_forward(), hf_lm_loss_of_output(fused="eager"),
                                chunked_lm_head=False, graph_reuse=False),
        "fused CE": GGNOperator(w.model, data, hf_lm_forward(), hf_lm_loss_of_output(fused="auto"),
                                chunked_lm_head=False, graph_reuse=False),
        "chunked LM head": GGNOperator(w.model, data, hf_lm_forward(), hf_lm_loss_of_output(fused="auto"),
                                       chunked_lm_head=True, graph_reuse=False),
    }
    n = next(iter(ops.values())).size
    v = torch.randn(n, generator=torch.Generator().manual_seed(1)).to(device)
    timer = _timer(device)
    times: dict[str, list[float]] = {k: [] for k in ops}
    peaks: dict[str, list[float]] = {k: [] for k in ops}
    errors: dict[str, str] = {}
    for i in range(warmup + repeats):
        for name, op in ops.items():
            if name in errors:
                continue
            try:
                t, peak = timer(lambda op=op: op @ v)
            except Exception as exc:  # out of memory on one path must not end the run
                errors[name] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
                torch.cuda.empty_cache()
                continue
            if i >= warmup:
                times[name].append(t)
                peaks[name].append(peak)
    ref_name = next(k for k in ops if k not in errors)
    ref = ops[ref_name] @ v
    rows = {}
    for name, op in ops.items():
        if name in errors:
            rows[name] = {"error": errors[name]}
            continue
        got = op @ v
        rows[name] = {"ms": statistics.median(times[name]), "peak_mib": max(peaks[name]),
                      "rel_diff_vs_" + ref_name: float((got - ref).norm() / ref.norm())}
    return {"batch": batch, "seq": seq, "params": n, "vocab": w.model.config.vocab_size, "rows": rows}


def to_markdown(r: dict[str, Any], info: dict[str, str]) -> str:
    lines = [f"Device: {info.get('gpu', info.get('cpu'))}; torch {info['torch']}, triton {info['triton']}, "
             f"Python {info['python']}; GPT-2 style 6L d512, {r['params'] / 1e6:.1f} M parameters, "
             f"B{r['batch']}·T{r['seq']}, V{r['vocab']}, fp32", "",
             "| path | ms | peak MiB | rel. diff |", "|---|---|---|---|"]
    for name, row in r["rows"].items():
        if "error" in row:
            lines.append(f"| {name} | {row['error']} | | |")
            continue
        diff = next(v for k, v in row.items() if k.startswith("rel_diff"))
        lines.append(f"| {name} | {row['ms']:.1f} | {row['peak_mib']:.0f} | {diff:.1e} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--out", default="bench_out/lm_ggn")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    result = run(device, args.batch, args.seq, args.repeats, args.warmup)
    info = env_info(device)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "lm_ggn.json").write_text(json.dumps({"env": info, "result": result}, indent=1))
    md = to_markdown(result, info)
    (out / "lm_ggn.md").write_text(md + "\n")
    print(md)


if __name__ == "__main__":
    main()
