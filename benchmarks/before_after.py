"""Run one benchmark module in several source trees, interleaved, in one device session.

Each tree is a folder holding `hessian_eigenthings/` and `benchmarks/` (e.g. `git archive
COMMIT hessian_eigenthings benchmarks | tar -x -C trees/NAME`); the benchmark runs as
`python -m benchmarks.MODULE ARGS` with that folder as the working directory, so it imports
that tree's package. Trees take turns per workload; every JSON line printed is tagged with
its tree and written to --out.

    python -m benchmarks.before_after --trees trees/s0 trees/s1 . --module bench_engines \
        --workloads mlp resnet18 gpt2 -- --engines autograd,functional --reps 10
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--trees", nargs="+", required=True)
    ap.add_argument("--module", required=True)
    ap.add_argument("--workloads", nargs="+", default=[None])
    ap.add_argument("--out", required=True)
    ap.add_argument("--timeout", type=float, default=300)
    ap.add_argument("rest", nargs=argparse.REMAINDER)
    args = ap.parse_args()
    rest = [a for a in args.rest if a != "--"]
    with open(args.out, "a") as out:
        for workload in args.workloads:
            for tree in args.trees:
                cmd = [
                    sys.executable,
                    "-m",
                    f"benchmarks.{args.module}",
                    *([workload] if workload else []),
                    *rest,
                ]
                t0 = time.perf_counter()
                try:
                    proc = subprocess.run(
                        cmd,
                        cwd=tree,
                        capture_output=True,
                        text=True,
                        timeout=args.timeout,
                        env={
                            **os.environ,
                            "PYTHONPATH": os.pathsep.join(
                                p
                                for p in (os.path.abspath(tree), os.environ.get("PYTHONPATH"))
                                if p
                            ),
                        },
                    )
                    lines, err, rc = proc.stdout.splitlines(), proc.stderr[-1500:], proc.returncode
                except subprocess.TimeoutExpired:
                    lines, err, rc = [], "timeout", -1
                for line in lines:
                    try:
                        row = json.loads(line)
                    except json.JSONDecodeError:
                        continue
                    row["tree"] = tree
                    out.write(json.dumps(row) + "\n")
                    print(json.dumps(row)[:300], flush=True)
                meta = {
                    "tree": tree,
                    "workload": workload,
                    "rc": rc,
                    "wall_s": round(time.perf_counter() - t0, 1),
                }
                if rc != 0:
                    meta["stderr"] = err
                out.write(json.dumps({"cell": "run", **meta}) + "\n")
                print(json.dumps({"cell": "run", **meta})[:2000], flush=True)
                out.flush()


if __name__ == "__main__":
    main()
