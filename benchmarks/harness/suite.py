"""A whole run: every workload, in-process columns side by side, peer columns in workers."""

from __future__ import annotations

import gc
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from benchmarks.harness.adapters import ENGINE_COLUMNS, IN_PROCESS, PEERS
from benchmarks.harness.peers import peer_path, run_peer
from benchmarks.harness.runner import SUITES, _err, measure, rel_errors
from benchmarks.harness.timing import env_info
from benchmarks.workloads import GPU_ONLY, build_parity

DEFAULT_WORKLOADS = "mlp,resnet18,gpt2,cnn_bn,mlp_4batches,gpt2_large"


def run(
    *,
    suite: str = "parity",
    device: str = "cpu",
    scale: float = 1.0,
    repeats: int = 10,
    warmup: int = 3,
    workloads: str = DEFAULT_WORKLOADS,
    columns: str = ",".join(IN_PROCESS + PEERS),
    peers_dir: str | None = None,
    algo_repeats: int = 1,
    eig_k: int = 10,
    eig_tol: float = 1e-4,
    trace_matvecs: int = 99,
    slq_runs: int = 4,
    slq_steps: int = 30,
    core_lm_loss: str = "hf",
    cudnn_benchmark: bool = False,
    peer_timeout: float = 1800.0,
    cell_budget_s: float = 60.0,
    out: str | None = None,
    command: str = "",
    debug: bool = False,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    dev = torch.device(device)
    torch.backends.cudnn.benchmark = cudnn_benchmark
    tasks = SUITES[suite]
    cols = [c.strip() for c in columns.split(",") if c.strip()]
    in_proc = [c for c in cols if c in IN_PROCESS or c in ENGINE_COLUMNS]
    peers = [c for c in cols if c in PEERS]
    cfg: dict[str, Any] = {
        "repeats": repeats, "warmup": warmup, "algo_repeats": algo_repeats, "eig_k": eig_k,
        "eig_tol": eig_tol, "trace_matvecs": trace_matvecs, "slq_runs": slq_runs, "slq_steps": slq_steps,
        "options": {"core_lm_loss": core_lm_loss}, "debug": debug,
        "cell_budget_s": cell_budget_s,
    }
    doc: dict[str, Any] = {
        "suite": suite, "command": command, "env": env_info(dev), "scale": scale, "tasks": list(tasks),
        "columns": cols, "config": {k: v for k, v in cfg.items() if k != "debug"},
        "started": time.strftime("%Y-%m-%d %H:%M:%S"), "results": [],
    }
    out_dir = Path(out) if out else None
    for key in [k.strip() for k in workloads.split(",") if k.strip()]:
        if dev.type == "cpu" and key in GPU_ONLY:
            doc["results"].append({"workload": key, "name": key, "skipped": "GPU only (too large for a CPU run)"})
            continue
        t0 = time.perf_counter()
        log(f"== {key} ({device}, scale {scale})")
        w = build_parity(key, device, scale)
        res = measure(w, dev, in_proc, tasks, cfg, log=log)
        del w
        gc.collect()
        if dev.type == "cuda":
            torch.cuda.empty_cache()
        spec = {"workload": key, "device": device, "scale": scale, "tasks": list(tasks), "cfg": cfg,
                "threads": torch.get_num_threads(), "cudnn_benchmark": cudnn_benchmark}
        for peer in peers:
            pypath, note = peer_path(peer, peers_dir)
            if pypath is None:
                res["columns"][peer] = {"version": note, "cells": {t: {"na": note} for t in tasks}}
                continue
            try:
                pr = run_peer(peer, pypath, spec, peer_timeout, log=log)
                col = pr["columns"][peer]
                col["gradient"] = pr["gradient"]
                col["subprocess"] = True
                col["env"] = pr.get("env", {})
                res["columns"][peer] = col
                res["probes"][peer] = pr["probes"].get(peer, {})
            except Exception as exc:
                res["columns"][peer] = {"version": f"from {note}",
                                        "cells": {t: {"error": f"worker: {_err(exc)}"} for t in tasks}}
        rel_errors(res)
        res.pop("probes", None)
        res["seconds"] = time.perf_counter() - t0
        doc["results"].append(res)
        if out_dir is not None:  # partial results survive a timeout
            write(doc, out_dir)
        log(f"   done in {res['seconds']:.0f} s")
    doc["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
    if out_dir is not None:
        write(doc, out_dir, final=True)
    return doc


def write(doc: dict[str, Any], out_dir: Path, final: bool = False) -> None:
    from benchmarks.harness.report import clean, plot, to_markdown

    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "parity.json").write_text(json.dumps(clean(doc), indent=1))
    (out_dir / "parity.md").write_text(to_markdown(doc) + "\n")
    if final:
        plot(doc, out_dir / "parity.png")
