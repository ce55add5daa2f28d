"""Benchmark harness CLI.

    python -m benchmarks run --suite parity|products|algorithms [--device cpu|cuda] [--scale S]
        [--repeats R] [--warmup W] [--workloads a,b] [--columns c,d] [--out DIR] [--peers DIR]
    python -m benchmarks peers download DIR             # pip download --no-deps (network)
    python -m benchmarks peers install DIR --target T   # offline: pip --no-index --no-deps --target T/<peer>
    python -m benchmarks report DIR [DIR ...] --out DIR # merge runs, later wins cell by cell

Workloads: mlp, resnet18, gpt2, cnn_bn, mlp_4batches, gpt2_large (GPU only).
Columns: core, core-noreuse, facade, baseline-0x (this process, interleaved);
a5, curvlinops (one worker subprocess each, from --peers DIR/<column>).
Writes parity.json, parity.md and parity.png to --out. See benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

import torch


def _run(args: argparse.Namespace) -> int:
    from benchmarks.harness.suite import DEFAULT_WORKLOADS, run

    if args.threads:
        torch.set_num_threads(args.threads)
    workloads = args.workloads or DEFAULT_WORKLOADS
    command = "python -m benchmarks " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    doc = run(suite=args.suite, device=args.device, scale=args.scale, repeats=args.repeats,
              warmup=args.warmup, workloads=workloads, columns=args.columns, peers_dir=args.peers,
              algo_repeats=args.algo_repeats, eig_k=args.eig_k, eig_tol=args.eig_tol,
              trace_matvecs=args.trace_matvecs, slq_runs=args.slq_runs, slq_steps=args.slq_steps,
              core_lm_loss=args.core_lm_loss, cudnn_benchmark=args.cudnn_benchmark,
              peer_timeout=args.peer_timeout, cell_budget_s=args.cell_budget, out=args.out, command=command, debug=args.debug)
    from benchmarks.harness.report import to_markdown

    print(to_markdown(doc))
    print(f"\nwrote {args.out}/parity.json, parity.md, parity.png")
    return 0


def _peers(args: argparse.Namespace) -> int:
    from benchmarks.harness import peers

    if args.action == "download":
        return peers.download(args.dir)
    if not args.target:
        print("peers install needs --target", file=sys.stderr)
        return 2
    return peers.install(args.dir, args.target)


def _report(args: argparse.Namespace) -> int:
    from benchmarks.harness.report import merge, to_markdown
    from benchmarks.harness.suite import write

    merged = merge([json.loads((Path(d) / "parity.json").read_text()) for d in args.dirs])
    write(merged, Path(args.out), final=True)

    print(to_markdown(merged))
    return 0


def main(argv: list[str] | None = None) -> int:
    from benchmarks.harness.adapters import IN_PROCESS, PEERS

    ap = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="run a suite")
    r.add_argument("--suite", choices=("parity", "products", "algorithms"), default="parity")
    r.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    r.add_argument("--scale", type=float, default=1.0, help="batch-size scale (CPU runs use < 1)")
    r.add_argument("--repeats", type=int, default=10)
    r.add_argument("--warmup", type=int, default=3)
    r.add_argument("--workloads", default=None, help="comma list (default: all; gpt2_large GPU only)")
    r.add_argument("--columns", default=",".join(IN_PROCESS + PEERS),
                   help="columns to run; also core-autograd, core-functional, core-compiled (one per product engine)")
    r.add_argument("--out", default="bench_out/parity")
    r.add_argument("--peers", default=None, help="directory made by `peers install` (DIR/a5, DIR/curvlinops)")
    r.add_argument("--algo-repeats", type=int, default=1)
    r.add_argument("--eig-k", type=int, default=10)
    r.add_argument("--eig-tol", type=float, default=1e-4)
    r.add_argument("--trace-matvecs", type=int, default=99)
    r.add_argument("--slq-runs", type=int, default=4)
    r.add_argument("--slq-steps", type=int, default=30)
    r.add_argument("--core-lm-loss", choices=("hf", "generic"), default="hf",
                   help="LM workloads: the core (and 1.0.0a5) use the HuggingFace LM helpers, or model(X)->logits")
    r.add_argument("--cudnn-benchmark", action="store_true")
    r.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    r.add_argument("--peer-timeout", type=float, default=1800.0, help="seconds per peer worker")
    r.add_argument("--cell-budget", type=float, default=60.0,
                   help="a product slower than this (s) is timed once and not repeated")
    r.add_argument("--debug", action="store_true", help="print tracebacks of failing cells")
    p = sub.add_parser("peers", help="download / install the peer wheels")
    p.add_argument("action", choices=("download", "install"))
    p.add_argument("dir")
    p.add_argument("--target", default=None)
    m = sub.add_parser("report", help="merge runs into one report")
    m.add_argument("dirs", nargs="+")
    m.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    return {"run": _run, "peers": _peers, "report": _report}[args.cmd](args)


if __name__ == "__main__":
    raise SystemExit(main())
