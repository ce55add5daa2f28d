"""What tracing a product costs: recorded (NOTE [recording a trace]) against make_fx (issue 27).

    python -m benchmarks.bench_trace [--workloads gpt2_4l,gpt2_12l,resnet18,mlp]
        [--curvatures hessian,ggn] [--repeats 3] > rows.jsonl

Per workload and curvature, both tracers trace the operator's pure product on one batch,
alternately (``--repeats`` times each, in one process; each compiles its programs' text, as a
first process does, NOTE [stored bytecode]),
and each program's product for one direction is compared with the other's. Rows: graph nodes,
trace seconds (median and all), the ratio of medians, the largest relative difference. The GPT-2
workloads are HF GPT-2 (vocabulary 50257, eager attention) on 1 x 8 tokens so that the ops' own
time stays small beside the tracing on a CPU; ``gpt2_12l_narrow`` (d64, vocabulary 1000) has GPT-2
12L's graph with little arithmetic, so its trace time is the tracer's host time (what a GPU host
pays, where the ops run asynchronously).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from collections.abc import Callable
from typing import Any

import torch
from torch import nn


def _gpt2(
    layers: int, width: int = 768, vocab: int = 50257
) -> tuple[nn.Module, list[Any], Callable[..., torch.Tensor]]:
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(
        n_layer=layers,
        n_embd=width,
        n_head=12 if width % 12 == 0 else 4,
        vocab_size=vocab,
        n_positions=64,
        attn_pdrop=0.0,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
    )
    try:
        model = GPT2LMHeadModel._from_config(cfg, attn_implementation="eager").eval()
    except (TypeError, ValueError):  # older transformers
        cfg._attn_implementation = "eager"
        model = GPT2LMHeadModel(cfg).eval()
    ids = torch.randint(0, vocab, (1, 8))

    def loss(m: nn.Module, b: dict[str, torch.Tensor]) -> torch.Tensor:
        logits = m(input_ids=b["input_ids"], use_cache=False).logits
        return nn.functional.cross_entropy(
            logits[:, :-1].reshape(-1, logits.shape[-1]), b["input_ids"][:, 1:].reshape(-1)
        )

    return model, [{"input_ids": ids}], loss


def _vision(key: str) -> tuple[nn.Module, list[Any], Callable[..., torch.Tensor]]:
    from benchmarks.workloads import mlp, resnet18

    w = (mlp if key == "mlp" else resnet18)("cpu", 0.05)
    return w.model, [w.batch], w.loss_fn


WORKLOADS: dict[str, Callable[[], tuple[nn.Module, list[Any], Callable[..., torch.Tensor]]]] = {
    "gpt2_4l": lambda: _gpt2(4),
    "gpt2_12l": lambda: _gpt2(12),
    # GPT-2 12L's graph (the same nodes) with little arithmetic: the tracers' host time alone
    "gpt2_12l_narrow": lambda: _gpt2(12, width=64, vocab=1000),
    "resnet18": lambda: _vision("resnet18"),
    "mlp": lambda: _vision("mlp"),
}


def main() -> None:
    from hessian_eigenthings.loss_fns import (
        hf_lm_forward,
        hf_lm_loss_of_output,
        supervised_forward,
        supervised_loss_of_output,
    )
    from hessian_eigenthings.operators import GGNOperator, HessianOperator
    from hessian_eigenthings.operators.engines import trace_times, tracing
    from hessian_eigenthings.operators.engines.functional import FunctionalRunner
    from hessian_eigenthings.operators.engines.trace_times import ENV

    ap = argparse.ArgumentParser()
    ap.add_argument("--workloads", default="mlp,resnet18,gpt2_4l,gpt2_12l_narrow,gpt2_12l")
    ap.add_argument("--curvatures", default="hessian,ggn")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    os.environ[ENV] = "0"
    for key in args.workloads.split(","):
        torch.manual_seed(0)
        model, batches, loss = WORKLOADS[key]()
        for curv in args.curvatures.split(","):
            if curv == "hessian":
                op: Any = HessianOperator(model, batches, loss, engine="functional")
            elif isinstance(batches[0], dict):
                op = GGNOperator(
                    model, batches, hf_lm_forward(), hf_lm_loss_of_output(), engine="functional"
                )
            else:
                op = GGNOperator(
                    model,
                    batches,
                    supervised_forward,
                    supervised_loss_of_output(nn.CrossEntropyLoss()),
                    engine="functional",
                )
            batch = op._engine_batch(batches[0])
            times: dict[str, list[float]] = {"make_fx": [], "record": []}
            outs: dict[str, list[torch.Tensor]] = {}
            nodes: dict[str, int] = {}
            for _ in range(args.repeats):
                for tracer in ("make_fx", "record"):
                    tracing.TRACER = tracer
                    trace_times._codes.clear()  # each trace compiles its programs' text
                    runner = FunctionalRunner(model, op.params, op.functional_product)
                    prog = runner._tracer.trace(batch, general=True)
                    times[tracer].append(prog.trace_s)
                    nodes[tracer] = prog.nodes
                    if tracer not in outs:
                        gen = torch.Generator().manual_seed(0)
                        v = [torch.randn(p.shape, generator=gen, dtype=p.dtype) for p in op.params]
                        with torch.no_grad():
                            kept = prog.primal(*runner._tracer.primal_inputs(batch, prog))
                            outs[tracer] = list(prog.tangent(*kept, *v))
            tracing.TRACER = "record"
            diff = max(
                float(
                    torch.linalg.vector_norm(a - b) / torch.linalg.vector_norm(b).clamp_min(1e-30)
                )
                for a, b in zip(outs["record"], outs["make_fx"], strict=True)
            )
            med = {k: statistics.median(v) for k, v in times.items()}
            print(
                json.dumps(
                    {
                        "workload": key,
                        "curvature": curv,
                        "torch": torch.__version__,
                        "nodes": nodes,
                        "trace_s_median": med,
                        "trace_s": times,
                        "make_fx_over_record": med["make_fx"] / med["record"],
                        "max_rel_diff": diff,
                    }
                ),
                flush=True,
            )


if __name__ == "__main__":
    main()
