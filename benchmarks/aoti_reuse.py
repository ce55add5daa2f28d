"""A route for issue 27's "a second process reuses the trace and the compiled program in <= 1 s":
the traced programs compiled ahead of time by AOTInductor into shared libraries, loaded by a fresh
process without tracing, fake tensors or inductor's Python (an experiment; not used by the library).

    python -m benchmarks.aoti_reuse WORKLOAD [--curvature hessian|ggn] [--scale S] --dir DIR

The parent process traces the curvature's product (engine="functional"), compiles its primal
part (parameters, buffers and batch -> kept values) and its tangent part (kept values and one
direction -> product) with ``torch._inductor.aot_compile``, and saves the inputs and the
functional engine's product. Then ``--processes`` fresh processes each load both libraries, run
the primal part and one product, and compare with the saved product: the load and first-product
times are what a second process would pay where the programs' inputs are known without tracing
(parameters, buffers and batch tensors in the traced order). JSON rows on stdout. TF32 off.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import subprocess
import sys
import time
from typing import Any

import torch


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _compile(
    gm: torch.fx.GraphModule, args: tuple[torch.Tensor, ...], path: str
) -> tuple[str, str, float]:
    """``gm`` compiled by AOTInductor into the package ``path`` (kernels in the library)."""
    from torch._inductor.package import package_aoti

    t0 = time.perf_counter()
    options: dict[str, Any] = {"aot_inductor.package": True}
    if torch.cuda.is_available():
        options["aot_inductor.embed_kernel_binary"] = True
    files = torch._inductor.aot_compile(gm, args, options=options)
    assert isinstance(files, list)
    package_aoti(path, files)  # type: ignore[arg-type]
    libs = [f for f in files if isinstance(f, str) and f.endswith(".so")]
    return path, libs[0], time.perf_counter() - t0


def parent(args: argparse.Namespace) -> None:
    import hessian_eigenthings as he
    from benchmarks.workloads import build_parity
    from hessian_eigenthings.loss_fns import supervised_forward, supervised_loss_of_output
    from hessian_eigenthings.operators.engines.compiled import views_as_reshapes
    from hessian_eigenthings.operators.engines.functional import FunctionalRunner

    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    w = build_parity(args.workload, device, scale=args.scale)
    model, batches, crit = w.model, w.batches[:1], w.criterion
    if args.curvature == "hessian":
        op = he.HessianOperator(model, batches, he.supervised_loss(crit), engine="functional")
    else:
        op = he.GGNOperator(
            model, batches, supervised_forward, supervised_loss_of_output(crit), engine="functional"
        )
    seen: dict[str, Any] = {}
    real = FunctionalRunner.prepare

    def capture(self: FunctionalRunner, batch: Any, params: Any = None) -> Any:
        state = real(self, batch, params)
        b = self.batch_of(batch) if self.batch_of is not None else batch
        seen["primal_inputs"] = tuple(self._tracer.primal_inputs(b, state.program))
        seen["state"] = state
        return state

    real_run = FunctionalRunner.run

    def run(self: FunctionalRunner, prog: Any, k: int, args: tuple[torch.Tensor, ...]) -> Any:
        # the first product runs eagerly (later ones may replay a CUDA graph)
        seen.setdefault("directions", tuple(a.clone() for a in args[prog.num_kept :]))
        return real_run(self, prog, k, args)

    FunctionalRunner.prepare = capture  # type: ignore[method-assign]
    FunctionalRunner.run = run  # type: ignore[method-assign]
    v = torch.randn(op.size, device=op.device, generator=torch.Generator(op.device).manual_seed(0))
    t0 = time.perf_counter()
    ref = op @ v
    _sync()
    first_functional = time.perf_counter() - t0
    FunctionalRunner.prepare = real  # type: ignore[method-assign]
    FunctionalRunner.run = real_run  # type: ignore[method-assign]
    for _ in range(3):
        op @ v
    _sync()
    t0 = time.perf_counter()
    for _ in range(10):
        op @ v
    _sync()
    functional_ms = (time.perf_counter() - t0) * 100
    state = seen["state"]
    prog = state.program
    primal_in = seen["primal_inputs"]
    row: dict[str, Any] = {
        "workload": args.workload,
        "curvature": args.curvature,
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "torch": torch.__version__,
        "trace_s": prog.trace_s,
        "primal_nodes": prog.primal.num_nodes,
        "tangent_nodes": prog.tangent.num_nodes,
        "first_functional_s": first_functional,
        "functional_ms": functional_ms,
    }
    os.makedirs(args.dir, exist_ok=True)
    primal_pt2, primal_so, row["aot_compile_primal_s"] = _compile(
        views_as_reshapes(prog.primal.module), primal_in, os.path.join(args.dir, "primal.pt2")
    )
    # one direction's tangent inputs as the functional runner passes them
    directions = seen["directions"]
    tangent_args = (*state.kept, *directions)
    tangent_pt2, tangent_so, row["aot_compile_tangent_s"] = _compile(
        views_as_reshapes(prog.tangent.module), tangent_args, os.path.join(args.dir, "tangent.pt2")
    )
    torch.save(
        {"primal": list(primal_in), "directions": list(directions), "ref": ref.cpu()},
        os.path.join(args.dir, "inputs.pt"),
    )
    print(json.dumps(row), flush=True)
    runs = [(primal_so, tangent_so, "")] * args.processes + [(primal_so, tangent_so, "1")]
    runs += [(primal_pt2, tangent_pt2, "")]
    for i, (primal_file, tangent_file, preimport) in enumerate(runs):
        env = dict(os.environ, PYTHONPATH=os.getcwd(), AOTI_REUSE_PREIMPORT=preimport)
        cmd = [sys.executable, "-X", "faulthandler", "-m", "benchmarks.aoti_reuse", "--child"]
        cmd += [args.dir, primal_file, tangent_file]
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
        if out.returncode != 0:
            err = {"child": i, "rc": out.returncode, "stderr": out.stderr[-3000:]}
            print(json.dumps({**err, "stdout": out.stdout[-2000:]}), flush=True)
            continue
        child_row = json.loads(out.stdout.strip().splitlines()[-1])
        child_row["preimport"] = bool(preimport)
        child_row.update(child=i, workload=args.workload, curvature=args.curvature)
        print(json.dumps(child_row), flush=True)
    if torch.cuda.is_available():  # the library loaded by the process that compiled it
        t0 = time.perf_counter()
        lib = torch._C._aoti.AOTIModelContainerRunnerCuda(tangent_so, 1, "cuda")
        out_in = lib.run([*state.kept, *directions])
        torch.cuda.synchronize()
        flat = torch.cat([o.reshape(-1) for o in out_in]).cpu()
        err = float((flat - ref.reshape(-1).cpu()).norm() / ref.norm().cpu())
        print(json.dumps({"in_process_load_and_run_s": time.perf_counter() - t0, "rel_err": err}))


def child(folder: str, primal_so: str, tangent_so: str) -> None:
    t_start = time.perf_counter()
    if os.environ.get("AOTI_REUSE_PREIMPORT"):
        importlib.import_module("torch._inductor.codecache")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    data = torch.load(os.path.join(folder, "inputs.pt"), map_location=device)
    if device == "cuda":
        torch.cuda.init()
        torch.empty(1, device=device)
    _sync()
    print("loading", primal_so, tangent_so, file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    if primal_so.endswith(".pt2"):  # the package (extracted, through inductor's Python)
        primal = torch._inductor.aoti_load_package(primal_so).loader
        tangent = torch._inductor.aoti_load_package(tangent_so).loader
    elif device == "cuda":  # the library alone, kernels inside it
        primal = torch._C._aoti.AOTIModelContainerRunnerCuda(primal_so, 1, device)
        tangent = torch._C._aoti.AOTIModelContainerRunnerCuda(tangent_so, 1, device)
    else:
        primal = torch._C._aoti.AOTIModelContainerRunnerCpu(primal_so, 1)
        tangent = torch._C._aoti.AOTIModelContainerRunnerCpu(tangent_so, 1)
    t1 = time.perf_counter()
    print("loaded", file=sys.stderr, flush=True)
    kept = primal.run(list(data["primal"]))
    print("primal ran", file=sys.stderr, flush=True)
    out = tangent.run([*kept, *data["directions"]])
    _sync()
    t2 = time.perf_counter()
    for _ in range(3):
        out = tangent.run([*kept, *data["directions"]])
    _sync()
    t3 = time.perf_counter()
    for _ in range(10):
        out = tangent.run([*kept, *data["directions"]])
    _sync()
    steady = (time.perf_counter() - t3) * 100
    flat = torch.cat([o.reshape(-1) for o in out]).cpu()
    ref = data["ref"].reshape(-1)
    err = float((flat - ref).norm() / ref.norm()) if flat.numel() == ref.numel() else None
    print(
        json.dumps(
            {
                "loaded": "package" if primal_so.endswith(".pt2") else "library",
                "load_s": t1 - t0,
                "first_primal_and_product_s": t2 - t1,
                "steady_ms": steady,
                "rel_err": err,
                "process_s": time.perf_counter() - t_start,
            }
        )
    )


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(*sys.argv[2:5])
        return
    ap = argparse.ArgumentParser()
    ap.add_argument("workload")
    ap.add_argument("--curvature", default="hessian", choices=("hessian", "ggn"))
    ap.add_argument("--scale", type=float, default=1.0)
    ap.add_argument("--dir", required=True)
    ap.add_argument("--processes", type=int, default=2)
    parent(ap.parse_args())


if __name__ == "__main__":
    main()
