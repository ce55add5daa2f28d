"""The smallest AOTInductor round trip on this machine (issue 27): is the crash of
``benchmarks/aoti_reuse.py`` on the H200 ours or the build's?

    python -m benchmarks.aoti_minimal --dir DIR

A two-op function through the documented path (``torch.export.export`` ->
``torch._inductor.aoti_compile_and_package`` -> ``torch._inductor.aoti_load_package``), loaded in
the compiling process and in a fresh one, on CUDA where there is one. One JSON row per step; a
crashed child is reported with its return code and the end of its stderr (``-X faulthandler``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import torch


class _Tiny(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x @ x.T) + 1.0


def _load_and_run(path: str, device: str) -> dict[str, object]:
    t0 = time.perf_counter()
    runner = torch._inductor.aoti_load_package(path)
    t1 = time.perf_counter()
    x = torch.ones(8, 8, device=device)
    out = runner(x)
    ok = bool(torch.allclose(out.cpu(), _Tiny()(x).cpu()))
    return {"load_s": round(t1 - t0, 3), "ok": ok}


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--child":
        print(json.dumps(_load_and_run(sys.argv[2], sys.argv[3])), flush=True)
        return
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", required=True)
    args = ap.parse_args()
    os.makedirs(args.dir, exist_ok=True)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    x = torch.ones(8, 8, device=device)
    t0 = time.perf_counter()
    ep = torch.export.export(_Tiny().to(device), (x,))
    path = torch._inductor.aoti_compile_and_package(ep, package_path=os.path.join(args.dir, "t.pt2"))
    print(json.dumps({"step": "compile", "s": round(time.perf_counter() - t0, 1), "device": device}))
    sys.stdout.flush()
    cmd = [sys.executable, "-X", "faulthandler", "-m", "benchmarks.aoti_minimal", "--child"]
    out = subprocess.run([*cmd, path, device], capture_output=True, text=True, check=False)
    row: dict[str, object] = {"step": "fresh process", "rc": out.returncode}
    if out.returncode == 0:
        row.update(json.loads(out.stdout.strip().splitlines()[-1]))
    else:
        row["stderr"] = out.stderr[-1500:]
    print(json.dumps(row), flush=True)
    print(json.dumps({"step": "compiling process", **_load_and_run(path, device)}), flush=True)


if __name__ == "__main__":
    main()
