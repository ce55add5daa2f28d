"""Where hessian_eigenthings.influence spends its time and memory at LM scale (a profile, not a test).

Runs ``benchmarks/influence_gpu.py``'s setting for our tool only and reports, per phase, the
wall seconds (synchronized) and the CUDA allocator's peak: the factor passes (KFAC's and the
EK-FAC correction's), the eigenbases and float64 ``eigh`` alone, the query rows (their
per-example gradients and preconditioning), the training batches scored layer by layer. A
nested phase counts inside its outer one too; peaks are kept for the outermost phases.

    python benchmarks/influence_phases.py --n-train 200
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parent))
import influence_gpu

from hessian_eigenthings.influence import gradients as grads_module
from hessian_eigenthings.influence import scores as scores_module
from hessian_eigenthings.operators import factor_pass, kronecker_eigen

TIMES: dict[str, float] = collections.defaultdict(float)
PEAKS: dict[str, int] = collections.defaultdict(int)
CALLS: dict[str, int] = collections.defaultdict(int)
DEPTH = [0]


def phase(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        cuda = torch.cuda.is_available()
        outer = DEPTH[0] == 0
        if cuda and outer:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        DEPTH[0] += 1
        start = time.perf_counter()
        try:
            with torch.profiler.record_function(f"phase: {name}"):
                return fn(*args, **kwargs)
        finally:
            DEPTH[0] -= 1
            if cuda:
                torch.cuda.synchronize()
            TIMES[name] += time.perf_counter() - start
            CALLS[name] += 1
            if cuda and outer:
                PEAKS[name] = max(PEAKS[name], torch.cuda.max_memory_allocated())

    return wrapped


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--n-train", type=int, default=1000)
    p.add_argument("--length", type=int, default=512)
    p.add_argument("--queries", type=int, default=16)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--damping", type=float, default=1e-3)
    p.add_argument("--fisher", default="mc")
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", default=None)
    p.add_argument("--profile", default=None, help="a file for torch.profiler's table of kernels")
    a = p.parse_args()
    factor_pass.FactorPass.run = phase("factor passes", factor_pass.FactorPass.run)  # type: ignore[method-assign]
    decompositions = kronecker_eigen.FactorDecompositions
    decompositions.eigen = phase("eigenbases", decompositions.eigen)  # type: ignore[method-assign]
    grads_module.PerExampleGradients.__call__ = phase(  # type: ignore[method-assign]
        "per-example gradients", grads_module.PerExampleGradients.__call__
    )
    decompositions._decompose = phase("eigh", decompositions._decompose)  # type: ignore[method-assign]
    grads_module.PerExampleGradients.dots = phase(  # type: ignore[method-assign]
        "scores by layer", grads_module.PerExampleGradients.dots
    )
    scores_module.Influence._query_gradients = phase(  # type: ignore[method-assign]
        "query rows", scores_module.Influence._query_gradients
    )
    scores_module.Influence._kronecker_precondition = phase(  # type: ignore[method-assign]
        "precondition", scores_module.Influence._kronecker_precondition
    )
    dtype = torch.float32 if a.dtype == "fp32" else torch.bfloat16
    torch.backends.cuda.matmul.allow_tf32 = False
    g = torch.Generator().manual_seed(1)
    train = torch.randint(0, 50257, (a.n_train, a.length), generator=g).to(a.device)
    query = torch.randint(0, 50257, (a.queries, a.length), generator=g).to(a.device)
    model = influence_gpu.build_model(a.layers, dtype, a.device)
    tracked = [
        n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n != "lm_head"
    ]
    start = time.perf_counter()
    if a.profile:
        acts = [torch.profiler.ProfilerActivity.CPU]
        if a.device == "cuda":
            acts.append(torch.profiler.ProfilerActivity.CUDA)
        with torch.profiler.profile(activities=acts) as prof:
            influence_gpu.run_ours(model, tracked, train, query, a)
        key = "self_cuda_time_total" if a.device == "cuda" else "self_cpu_time_total"
        table = prof.key_averages().table(sort_by=key, row_limit=45, max_name_column_width=70)
        Path(a.profile).write_text(table)
        print(table)
    else:
        influence_gpu.run_ours(model, tracked, train, query, a)
    total = time.perf_counter() - start
    report = {
        "setting": vars(a),
        "total_seconds": round(total, 2),
        "phases": {
            k: {"seconds": round(TIMES[k], 2), "calls": CALLS[k], "peak_bytes": PEAKS[k]}
            for k in TIMES
        },
    }
    text = json.dumps(report, indent=2)
    print(text)
    if a.out:
        Path(a.out).write_text(text)


if __name__ == "__main__":
    main()
