"""Measure columns on one workload in one process: interleaved repeats, medians after warm-ups."""

from __future__ import annotations

import gc
import statistics
import traceback
from collections.abc import Callable
from typing import Any

import torch

from benchmarks.harness.adapters import (
    Adapter,
    Closure,
    gradient_closure,
    load_adapter,
    probe_indices,
    seeded_vectors,
)
from benchmarks.harness.timing import timed
from benchmarks.workloads import ParityWorkload

PRODUCT_TASKS = ("hvp", "block8", "ggn", "fisher")
ALGO_TASKS = ("eigs", "trace", "slq")
SUITES: dict[str, tuple[str, ...]] = {
    "parity": PRODUCT_TASKS + ALGO_TASKS,
    "products": PRODUCT_TASKS,
    "algorithms": ("hvp", *ALGO_TASKS),
}
BLOCK = 8


def _err(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:160] if str(exc).strip() else ''}"


def _cell_from(times: list[float], peaks: list[float]) -> dict[str, Any]:
    finite = [p for p in peaks if p == p]
    return {
        "ms": statistics.median(times) if times else float("nan"),
        "ms_all": times,
        "peak_mib": max(finite) if finite else float("nan"),
    }


def _closure(adapter: Adapter, task: str, v: torch.Tensor, V: torch.Tensor, cfg: dict[str, Any]) -> Closure:
    if task == "hvp":
        return adapter.hvp(v)
    if task == "block8":
        return adapter.block(V)
    if task == "ggn":
        return adapter.ggn(v)
    if task == "fisher":
        return adapter.fisher(v)
    if task == "eigs":
        return adapter.top_eigs(cfg["eig_k"], cfg["eig_tol"])
    if task == "trace":
        return adapter.trace(cfg["trace_matvecs"])
    if task == "slq":
        return adapter.slq(cfg["slq_runs"], cfg["slq_steps"])
    raise KeyError(task)


def _closures(
    adapters: dict[str, Adapter], tasks: list[str], v: torch.Tensor, V: torch.Tensor,
    cfg: dict[str, Any], out: dict[str, Any],
) -> dict[tuple[str, str], Closure]:
    """Closures of every (task, column); a column that cannot do a task gets its reason in the cell."""
    closures: dict[tuple[str, str], Closure] = {}
    for task in tasks:
        for col, ad in adapters.items():
            try:
                closures[(task, col)] = _closure(ad, task, v, V, cfg)
            except NotImplementedError as exc:
                out["columns"][col]["cells"][task] = {"na": str(exc) or "not supported"}
            except Exception as exc:
                out["columns"][col]["cells"][task] = {"error": _err(exc)}
    return closures


def measure(
    w: ParityWorkload,
    device: torch.device,
    columns: list[str],
    tasks: tuple[str, ...],
    cfg: dict[str, Any],
    log: Callable[[str], None] = print,
    checkpoint: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """Every (column, task) cell of one workload, plus the gradient (the unit) of this process.

    Product cells: ``warmup`` + ``repeats`` rounds; each round calls the
    gradient and then every (task, column) closure once (interleaved); the
    median of the timed rounds is reported. Algorithm cells: ``algo_repeats``
    rounds after the product warm-ups (caches and graphs warm), interleaved
    across columns. ``probes`` holds fixed entries of each product for the
    relative-error check against the core.
    """
    repeats, warmup = int(cfg["repeats"]), int(cfg["warmup"])
    n = sum(p.numel() for p in w.model.parameters() if p.requires_grad)
    v, V = seeded_vectors(n, BLOCK, device)
    idx = probe_indices(n).to(device)
    out: dict[str, Any] = {"workload": w.key, "name": w.name, "params": n, "batches": len(w.batches),
                           "samples": w.num_samples, "note": w.note, "columns": {}, "probes": {}}
    adapters: dict[str, Adapter] = {}
    for col in columns:
        cells: dict[str, Any] = {}
        out["columns"][col] = {"version": "", "cells": cells}
        try:
            adapters[col] = load_adapter(col)(w, device, cfg.get("options", {}))
            out["columns"][col]["version"] = adapters[col].version()
        except Exception as exc:
            log(f"  {col}: setup failed: {_err(exc)}")
            for t in tasks:
                cells[t] = {"error": f"setup: {_err(exc)}"}
    # ---- products, interleaved ------------------------------------------------
    closures = _closures(adapters, [t for t in tasks if t in PRODUCT_TASKS], v, V, cfg, out)
    grad = gradient_closure(w)
    times: dict[Any, list[float]] = {k: [] for k in [*closures, "gradient"]}
    peaks: dict[Any, list[float]] = {k: [] for k in [*closures, "gradient"]}
    failed: dict[Any, str] = {}
    slow: dict[Any, float] = {}
    budget_ms = 1e3 * float(cfg.get("cell_budget_s", 60.0))
    for i in range(warmup + repeats):
        for key, fn in [("gradient", grad), *closures.items()]:
            if key in failed:
                continue
            try:
                s = timed(fn, device)
            except Exception as exc:  # a failing cell must not abort the run
                failed[key] = _err(exc)
                log(f"  {key}: {failed[key]}")
                if cfg.get("debug"):
                    traceback.print_exc()
                continue
            if i >= warmup or s.ms > budget_ms:
                times[key].append(s.ms)
                peaks[key].append(s.peak_mib)
            if s.ms > budget_ms and key != "gradient":
                slow[key] = s.ms  # one sample is all it gets: keeps a pathological cell from eating the run
                failed[key] = "slow"
    out["gradient"] = {"error": failed["gradient"]} if "gradient" in failed else _cell_from(times["gradient"], peaks["gradient"])
    for (task, col) in closures:
        if (task, col) in slow:
            cell = {**_cell_from(times[(task, col)], peaks[(task, col)]),
                    "note": f"one call only: {slow[(task, col)] / 1e3:.0f} s > cell budget"}
        elif (task, col) in failed:
            cell = {"error": failed[(task, col)]}
        else:
            cell = _cell_from(times[(task, col)], peaks[(task, col)])
        if task == "block8" and "ms" in cell:
            cell["ms_per_vector"] = cell["ms"] / BLOCK
        if task == "hvp" and "ms" in cell:
            held = adapters[col].held_mib()
            if held == held:
                cell["held_mib"] = held
            report = getattr(adapters[col], "engine_report", None)
            if report is not None and report():
                cell["engine"] = report()  # engine, auto's choice, traces, compilations, compile_s
        out["columns"][col]["cells"][task] = cell
    # ---- correctness probes (one more call each) --------------------------------
    for (task, col), fn in closures.items():
        if task not in ("hvp", "ggn", "fisher") or (task, col) in failed:
            continue
        try:
            res = fn()
            out["probes"].setdefault(col, {})[task] = res.detach().reshape(-1)[idx].double().cpu()
        except Exception as exc:
            out["columns"][col]["cells"][task]["probe_error"] = _err(exc)
    closures.clear()
    # ---- algorithms -------------------------------------------------------------
    if checkpoint is not None:
        checkpoint(out)  # a worker that dies later keeps the finished cells
    algo = _closures(adapters, [t for t in tasks if t in ALGO_TASKS], v, V, cfg, out)
    for task in (t for t in tasks if t in ALGO_TASKS):
        runs: dict[str, list[Any]] = {}
        for _ in range(int(cfg["algo_repeats"])):
            for col in adapters:
                fn = algo.get((task, col))
                if fn is None or (col in runs and runs[col] and isinstance(runs[col][-1], str)):
                    continue
                try:
                    s = timed(fn, device, keep=True)
                    runs.setdefault(col, []).append(s)
                except Exception as exc:
                    runs.setdefault(col, []).append(_err(exc))
                    log(f"  {task}/{col}: {_err(exc)}")
                    if cfg.get("debug"):
                        traceback.print_exc()
        for col, samples in runs.items():
            if isinstance(samples[-1], str):
                out["columns"][col]["cells"][task] = {"error": samples[-1]}
                continue
            cell = _cell_from([s.ms for s in samples], [s.peak_mib for s in samples])
            cell.update(samples[-1].out)
            out["columns"][col]["cells"][task] = cell
        if checkpoint is not None:
            checkpoint(out)
        log(f"  {task}: " + ", ".join(f"{c} {out['columns'][c]['cells'].get(task, {}).get('ms', float('nan')) / 1e3:.2f}s"
                                       for c in runs))
    algo.clear()
    adapters.clear()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out


def rel_errors(result: dict[str, Any], reference: str = "core") -> None:
    """``rel_err_vs_core`` on every product cell, from the probes (fixed entries of each product)."""
    probes = result.get("probes", {})
    ref = probes.get(reference, {})
    for col, tasks in probes.items():
        for task, p in tasks.items():
            r = ref.get(task)
            cell = result["columns"][col]["cells"].get(task)
            if r is None or cell is None or r.shape != p.shape:
                continue
            cell["rel_err_vs_core"] = float((p - r).norm() / r.norm().clamp_min(1e-300))
