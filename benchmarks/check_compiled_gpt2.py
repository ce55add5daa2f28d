"""Does engine="compiled" compile HF GPT-2 (eager and SDPA attention) without falling back?

One JSON line per cell: compile time, fallbacks (with the compiler's traceback tail when one
happened), product ms and the product's error against engine="autograd". GPU run:

    python -m benchmarks.check_compiled_gpt2 --configs 6L,12L --attn eager,sdpa

``--without-fix`` compiles the traced graph as recorded (no `views_as_reshapes`), to show
what NOTE [views the compiler may not keep] in operators/engines/compiled.py fixes.
"""

from __future__ import annotations

import argparse
import json
import time
import traceback
from typing import Any

import torch

CONFIGS = {
    "6L": (6, 512, 8, 256, 8),
    "12L": (12, 768, 12, 512, 4),
}  # layers, width, heads, tokens, batch


def build(
    config: str, attn: str, device: str, mask: bool
) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    from transformers import GPT2Config, GPT2LMHeadModel

    layers, width, heads, seq, b = CONFIGS[config]
    torch.manual_seed(0)
    cfg = GPT2Config(
        n_layer=layers,
        n_embd=width,
        n_head=heads,
        n_positions=seq,
        attn_pdrop=0.0,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
    )
    model = GPT2LMHeadModel._from_config(cfg, attn_implementation=attn).to(device).eval()
    ids = torch.randint(0, cfg.vocab_size, (b, seq), device=device)
    batch = {"input_ids": ids}
    if mask:  # right padding: the last quarter of the second row, as in a padded token batch
        attention_mask = torch.ones_like(ids)
        attention_mask[1, -seq // 4 :] = 0
        labels = ids.masked_fill(attention_mask == 0, -100)
        batch.update(attention_mask=attention_mask, labels=labels)
    return model, batch


def median_ms(fn: Any, reps: int = 5) -> float:
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return sorted(times)[len(times) // 2]


def main() -> None:
    import hessian_eigenthings as he
    from hessian_eigenthings.operators.engines import compiled as engines

    ap = argparse.ArgumentParser()
    ap.add_argument("--configs", default="6L,12L")
    ap.add_argument("--attn", default="eager,sdpa")
    ap.add_argument("--curvatures", default="hessian")
    ap.add_argument("--without-fix", action="store_true")
    ap.add_argument(
        "--mask", action="store_true", help="batches with an attention mask and padded rows"
    )
    ap.add_argument("--block", type=int, default=1, help="directions per product")
    ap.add_argument(
        "--budget-s", type=float, default=1e9, help="skip cells that start after this many seconds"
    )
    args = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    if args.without_fix:
        engines.views_as_reshapes = lambda gm: gm  # type: ignore[assignment]
    failures: list[str] = []
    original = engines.CompiledRunner._fallback

    def record(self: Any, prog: Any, k: int, exc: BaseException) -> None:
        failures.append("".join(traceback.format_exception(exc))[-3000:])
        original(self, prog, k, exc)

    engines.CompiledRunner._fallback = record  # type: ignore[method-assign]
    env = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "tf32": False}
    import transformers

    env["transformers"] = transformers.__version__
    print(json.dumps({"cell": "env", **env}), flush=True)
    start = time.perf_counter()
    loss = he.hf_lm_loss()
    for config in args.configs.split(","):
        for attn in args.attn.split(","):
            for curv in args.curvatures.split(","):
                if time.perf_counter() - start > args.budget_s:
                    print(
                        json.dumps({"cell": f"{config}/{attn}/{curv}", "skipped": "budget"}),
                        flush=True,
                    )
                    continue
                model, batch = build(config, attn, "cuda", args.mask)

                def make(
                    engine: str, curv: str = curv, model: Any = model, batch: Any = batch
                ) -> Any:
                    if curv == "hessian":
                        return he.HessianOperator(model, [batch], loss, engine=engine)
                    return he.GGNOperator(
                        model, [batch], he.hf_lm_forward(), he.hf_lm_loss_of_output(), engine=engine
                    )

                failures.clear()
                op = make("compiled")
                v = torch.randn(
                    op.size, device="cuda", generator=torch.Generator("cuda").manual_seed(0)
                )
                t0 = time.perf_counter()
                out = op @ v
                torch.cuda.synchronize()
                first_s = time.perf_counter() - t0
                ms = median_ms(lambda op=op, v=v: op @ v)
                report = op.engine_report
                del op
                ref_op = make("autograd")
                ref = ref_op @ v
                ref_ms = median_ms(lambda ref_op=ref_op, v=v: ref_op @ v)
                del ref_op
                row = {
                    "cell": f"{config}/{attn}/{curv}",
                    "fix": not args.without_fix,
                    "first_s": round(first_s, 1),
                    "compiled_ms": round(ms, 2),
                    "autograd_ms": round(ref_ms, 2),
                    "rel_err": float((out - ref).norm() / ref.norm()),
                    "report": report,
                    "fallback_traceback": failures[0] if failures else None,
                }
                print(json.dumps(row), flush=True)
                del model, out, ref
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
