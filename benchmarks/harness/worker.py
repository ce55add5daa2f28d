"""Subprocess entry of one peer column: ``python -m benchmarks.harness.worker SPEC.json OUT.json``.

Runs with ``PYTHONPATH`` = the peer's target directory and the working
directory = a copy of ``benchmarks/`` (without our package), builds the same
seeded workload, measures the column and this process's gradient with the
same runner, and writes the result JSON plus ``OUT.json.pt`` (the probes).
"""

from __future__ import annotations

import json
import sys
import warnings

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
    res = measure(w, device, [spec["column"]], tuple(spec["tasks"]), spec["cfg"],
                  log=lambda m: print(m, flush=True))
    probes = res.pop("probes")
    torch.save(probes, out_path + ".pt")
    res["env"] = env_info(device)
    res["sys_path_head"] = sys.path[:3]
    with open(out_path, "w") as f:
        json.dump(res, f)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
