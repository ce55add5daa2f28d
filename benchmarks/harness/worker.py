"""Subprocess entry of one peer column: ``python -m benchmarks.harness.worker SPEC.json OUT.json``.

Runs with ``PYTHONPATH`` = the peer's target directory and the working
directory = a copy of ``benchmarks/`` (without our package), builds the same
seeded workload, measures the column and this process's gradient with the
same runner, and writes the result JSON plus ``OUT.json.pt`` (the probes).
"""

from __future__ import annotations

import json
import os
import sys
import warnings
from typing import Any

import torch


def main(argv: list[str]) -> int:
    spec_path, out_path = argv
    with open(spec_path) as f:
        spec = json.load(f)
    from benchmarks.harness.runner import measure
    from benchmarks.harness.timing import env_info
    from benchmarks.workloads import build_parity

    if spec.get("threads"):
        torch.set_num_threads(int(spec["threads"]))
    torch.backends.cudnn.benchmark = bool(spec.get("cudnn_benchmark"))
    device = torch.device(spec["device"])
    warnings.simplefilter("ignore")
    w = build_parity(spec["workload"], spec["device"], float(spec["scale"]))
    def save(res: dict[str, Any], final: bool = False) -> None:
        """Write what is measured so far: cells finished before a crash survive it."""
        doc = {k: v for k, v in res.items() if k != "probes"}
        torch.save(res.get("probes", {}), out_path + ".pt")
        doc["env"] = env_info(device)
        doc["sys_path_head"] = sys.path[:3]
        if not final:
            doc["partial"] = True
        with open(out_path + ".tmp", "w") as f:
            json.dump(doc, f)
        os.replace(out_path + ".tmp", out_path)

    res = measure(w, device, [spec["column"]], tuple(spec["tasks"]), spec["cfg"],
                  log=lambda m: print(m, flush=True), checkpoint=save)
    save(res, final=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
