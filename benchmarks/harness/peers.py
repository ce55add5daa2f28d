"""Peer packages in isolated directories, and their worker subprocesses.

    python -m benchmarks peers download .peers/wheels      # needs the network (pip download --no-deps)
    python -m benchmarks peers install .peers/wheels --target .peers/t   # offline: --no-index --no-deps

``install`` makes two pip ``--target`` directories, ``T/a5`` (1.0.0a5,
whose import name is ours) and ``T/curvlinops`` (curvlinops and its pure-
Python dependencies). torch / torchvision / numpy / scipy are never
installed: pip resolves nothing, the machine's own are used.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "benchmarks"

WHEELS: dict[str, list[str]] = {
    "a5": ["hessian-eigenthings==1.0.0a5", "tqdm"],
    "curvlinops": ["curvlinops-for-pytorch==3.0.1", "backpack-for-pytorch==1.7.1", "einconv==0.1.0",
                   "unfoldNd==0.2.3", "einops==0.8.2", "linear_operator==0.6.1", "opt-einsum==3.4.0", "tqdm"],
}


def _wheel_prefix(req: str) -> str:
    name = req.split("==")[0]
    return name.replace("-", "_").lower() + "-" + (req.split("==")[1] if "==" in req else "")


def download(dest: str) -> int:
    reqs = sorted({r for rs in WHEELS.values() for r in rs})
    Path(dest).mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-d", dest, *reqs]
    print(" ".join(cmd), flush=True)
    return subprocess.call(cmd)


def install(wheel_dir: str, target: str) -> int:
    wheels = sorted(Path(wheel_dir).glob("*.whl"))
    rc = 0
    for peer, reqs in WHEELS.items():
        files = []
        for req in reqs:
            pre = _wheel_prefix(req)
            match = [w for w in wheels if w.name.lower().startswith(pre)]
            if not match:
                print(f"{peer}: no wheel for {req} in {wheel_dir}", flush=True)
                rc = 1
                continue
            files.append(str(match[-1]))
        dest = Path(target) / peer
        if dest.exists():
            shutil.rmtree(dest)
        cmd = [sys.executable, "-m", "pip", "install", "--no-index", "--no-deps", "--target", str(dest), *files]
        print(" ".join(cmd), flush=True)
        rc |= subprocess.call(cmd)
    return rc


def peer_path(column: str, peers_dir: str | None) -> tuple[str | None, str]:
    """(PYTHONPATH for the worker, or None when the peer is unavailable; a note)."""
    if peers_dir:
        d = Path(peers_dir) / column
        if d.is_dir():
            return str(d.resolve()), f"{d}"
    if column == "curvlinops":
        import importlib.util

        if importlib.util.find_spec("curvlinops") is not None:
            return "", "the running environment"
    hint = f"run `python -m benchmarks peers install WHEELS --target DIR` and pass --peers DIR (looked in {peers_dir})"
    return None, f"not installed: {hint}"


def _bench_copy() -> str:
    """A directory holding a copy of benchmarks/ (workloads + harness) and nothing of our package."""
    tmp = tempfile.mkdtemp(prefix="he_peer_")
    dst = Path(tmp) / "benchmarks"
    (dst / "harness").mkdir(parents=True)
    (dst / "__init__.py").write_text("")
    shutil.copy(BENCH / "workloads.py", dst / "workloads.py")
    for f in (BENCH / "harness").glob("*.py"):
        shutil.copy(f, dst / "harness" / f.name)
    return tmp


def run_peer(column: str, pythonpath: str, spec: dict[str, Any], timeout: float,
             log: Callable[[str], None] = print) -> dict[str, Any]:
    """Run one peer column in a worker subprocess; returns the runner's result (probes included)."""
    tmp = _bench_copy()
    try:
        spec_path = Path(tmp) / "spec.json"
        out_path = Path(tmp) / "out.json"
        spec_path.write_text(json.dumps({**spec, "column": column}))
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        if pythonpath:
            env["PYTHONPATH"] = pythonpath
        env["PYTHONNOUSERSITE"] = "1"
        cmd = [sys.executable, "-m", "benchmarks.harness.worker", str(spec_path), str(out_path)]
        try:
            proc = subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True, timeout=timeout)
            rc, stdout, stderr = proc.returncode, proc.stdout, proc.stderr
        except subprocess.TimeoutExpired as exc:
            rc = -1
            stdout = exc.stdout.decode(errors="replace") if isinstance(exc.stdout, bytes) else (exc.stdout or "")
            stderr = f"timed out after {timeout:.0f} s"
        for line in stdout.splitlines():
            log(f"  [{column}] {line}")
        failed = rc != 0
        if failed:
            tail = (stderr.strip().splitlines() or ["?"])[-1][:200]
            log(f"  [{column}] worker failed (rc {rc}): {stderr[-2000:]}")
            if not out_path.exists():
                raise RuntimeError(f"worker rc {rc}: {tail}")
        res: dict[str, Any] = json.loads(out_path.read_text())
        res["probes"] = torch.load(str(out_path) + ".pt")
        if failed:  # the cells it finished before dying stay; the others say how it died
            cells = res["columns"].setdefault(column, {}).setdefault("cells", {})
            for task in spec["tasks"]:
                if task not in cells:
                    cells[task] = {"error": f"worker died in this task (rc {rc}): {tail}"}
            res.pop("partial", None)
        return res
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
