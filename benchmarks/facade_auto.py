"""What ``auto`` chose in a 0.x script run as written, in fresh processes (issue 27).

    python -m benchmarks.facade_auto [--script compat/readme_cnn_default_gpu.py] [--runs 5]
        [--priors 0.006,0.015]

Each run is a fresh Python process that runs the script unchanged (``runpy``) with
``TRACE_PRIOR_S_PER_MODULE`` set to one of ``--priors`` (alternated) and reports the script's
wall time, whether ``torch._dynamo`` was imported before the first product, and every ``auto``
operator's ``engine_report`` (chosen engine, reason, trace time). Records are off
(``HESSIAN_EIGENTHINGS_TRACE_TIMES=0``): every run is a first run. One JSON row per run.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

_CHILD = """
import json, runpy, sys, time, warnings
warnings.simplefilter("ignore")
from hessian_eigenthings.operators.engines import auto
from hessian_eigenthings.operators import base
auto.TRACE_PRIOR_S_PER_MODULE = float(sys.argv[2])
reports, dynamo = [], []
orig = auto.EngineSelector.before_block
def watched(self, *a, **k):
    dynamo.append("torch._dynamo" in sys.modules)
    if self not in seen:
        seen.append(self)
    return orig(self, *a, **k)
seen = []
auto.EngineSelector.before_block = watched
t0 = time.perf_counter()
runpy.run_path(sys.argv[1], run_name="__main__")
wall = time.perf_counter() - t0
print(json.dumps({"wall_s": round(wall, 3), "dynamo_before_first": dynamo[0] if dynamo else None,
                  "reports": [s.report() for s in seen]}, default=str))
"""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--script", default="compat/readme_cnn_default_gpu.py")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--priors", default="0.006,0.015")
    args = ap.parse_args()
    env = {**os.environ, "HESSIAN_EIGENTHINGS_TRACE_TIMES": "0"}
    for i in range(args.runs):
        for prior in args.priors.split(","):
            proc = subprocess.run(
                [sys.executable, "-c", _CHILD, args.script, prior],
                capture_output=True,
                text=True,
                env=env,
            )
            lines = proc.stdout.strip().splitlines()
            row = json.loads(lines[-1]) if proc.returncode == 0 and lines else {}
            row.update({"run": i, "prior": float(prior), "rc": proc.returncode})
            if proc.returncode:
                row["error"] = proc.stderr[-500:]
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
