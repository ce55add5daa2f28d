"""Markdown tables and a PNG from a run's JSON (``parity.json``)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from benchmarks.harness.adapters import IN_PROCESS, LABELS, PEERS

PEER_COLUMNS = ("baseline-0x", *PEERS)  # what the core is compared against (the facade is ours)


def clean(x: Any) -> Any:
    """JSON-safe copy: NaN / inf -> None."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [clean(v) for v in x]
    return x


def _num(x: Any) -> float:
    return float(x) if isinstance(x, (int, float)) and x is not None and math.isfinite(float(x)) else float("nan")


def _esc(s: str) -> str:
    return s.replace("|", "\\|").replace("\n", " ")


def _bad(cell: dict[str, Any] | None) -> str | None:
    if cell is None:
        return "not run"
    if cell.get("error"):
        return f"error: {_esc(str(cell['error']))[:90]}"
    if cell.get("na"):
        return f"n/a ({_esc(str(cell['na']))[:60]})"
    return None


def _peak(cell: dict[str, Any]) -> str:
    """Peak MiB of a product cell, with what the operator holds between products when known."""
    peak = _f(_num(cell.get("peak_mib")), 2)
    held = cell.get("held_mib")
    return f"{peak} (+ {_f(_num(held), 2)})" if isinstance(held, (int, float)) and held > 0 else peak


def _f(x: float, digits: int = 3) -> str:
    if not math.isfinite(x):
        return "–"
    if abs(x) >= 100:
        return f"{x:.0f}"
    if abs(x) >= 10:
        return f"{x:.1f}"
    return f"{x:.{digits - 1}f}" if abs(x) >= 1 else f"{x:.{digits}f}"


def grad_ms(res: dict[str, Any], col: str) -> float:
    c = res["columns"].get(col, {})
    g = c.get("gradient") if c.get("subprocess") else res.get("gradient")
    return _num((g or {}).get("ms"))


def ms(res: dict[str, Any], col: str, task: str) -> float:
    cell = res["columns"].get(col, {}).get("cells", {}).get(task)
    if not cell or _bad(cell):
        return float("nan")
    return _num(cell.get("ms_per_vector", cell.get("ms")))


def derived(res: dict[str, Any]) -> dict[str, float]:
    """Headline ratios of one workload."""
    core = ms(res, "core", "hvp")
    core_x = core / grad_ms(res, "core")
    peer_ms = {c: ms(res, c, "hvp") for c in PEER_COLUMNS}
    peer_x = {c: v / grad_ms(res, c) for c, v in peer_ms.items()}
    finite = [v for v in peer_ms.values() if math.isfinite(v)]
    finite_x = [v for v in peer_x.values() if math.isfinite(v)]
    peak = {c: _num(res["columns"].get(c, {}).get("cells", {}).get("hvp", {}).get("peak_mib")) for c in res["columns"]}
    return {
        "core_x_gradient": core_x,
        "speedup_vs_fastest_peer": (min(finite) / core) if finite else float("nan"),
        "speedup_vs_fastest_peer_by_gradient": (min(finite_x) / core_x) if finite_x else float("nan"),
        "noreuse_speedup_vs_fastest_peer": (min(finite) / ms(res, "core-noreuse", "hvp")) if finite else float("nan"),
        "facade_over_core": ms(res, "facade", "hvp") / core,
        "core_peak_over_baseline": peak.get("core", float("nan")) / peak.get("baseline-0x", float("nan")),
        "noreuse_peak_over_baseline": peak.get("core-noreuse", float("nan")) / peak.get("baseline-0x", float("nan")),
    }


def _hvp_cell(res: dict[str, Any], col: str) -> str:
    cell = res["columns"].get(col, {}).get("cells", {}).get("hvp")
    return _bad(cell) or _f(_num(cell.get("ms")) if cell else float("nan"))


def _algo(cell: dict[str, Any] | None) -> str:
    bad = _bad(cell)
    if bad:
        return bad
    assert cell is not None
    s = f"{_f(_num(cell.get('ms')) / 1e3)} s ({cell.get('matvecs', '?')} mv"
    if "converged" in cell:
        s += f", {cell['converged']} conv"
    return s + ")"


def to_markdown(doc: dict[str, Any]) -> str:
    env = doc["env"]
    dev = env.get("gpu", env.get("cpu", "?"))
    cfg = doc.get("config", {})
    lines = [
        f"Device: {env.get('device')} ({dev}); torch {env.get('torch')}, triton {env.get('triton')}, "
        f"transformers {env.get('transformers')}, Python {env.get('python')}, {env.get('threads')} threads. "
        f"Suite `{doc.get('suite')}`, scale {doc.get('scale')}, median of {cfg.get('repeats')} interleaved "
        f"repeats after {cfg.get('warmup')} warm-ups; algorithms: {cfg.get('algo_repeats')} run(s) each.",
        "",
    ]
    if doc.get("command"):
        lines += [f"Command: `{doc['command']}`", ""]
    cols = [c for c in doc.get("columns", []) if c]
    versions: dict[str, str] = {}
    for res in doc["results"]:
        for c, v in res.get("columns", {}).items():
            if v.get("version") and c not in versions:
                versions[c] = str(v["version"]).split(" (/")[0].split(" (from")[0]
    if versions:
        lines += ["Columns: " + "; ".join(f"{LABELS.get(c, c)} = {_esc(versions[c])}" for c in cols if c in versions), ""]
    head = ["workload", "params", "gradient ms", *[f"HVP ms {LABELS.get(c, c)}" for c in cols],
            "core × gradient", "core speedup vs fastest peer (abs / by gradient)", "no-reuse speedup vs fastest peer",
            "facade / core", "peak MiB (+ held) core / no-reuse / 0.x-style"]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for res in doc["results"]:
        if res.get("skipped"):
            lines.append(f"| {res['name']} | skipped: {res['skipped']} |" + " |" * (len(head) - 2))
            continue
        d = derived(res)
        pk = [_peak(res["columns"].get(c, {}).get("cells", {}).get("hvp", {}))
              for c in ("core", "core-noreuse", "baseline-0x")]
        row = [res["name"], f"{res['params'] / 1e6:.2f} M", _f(grad_ms(res, "core")),
               *[_hvp_cell(res, c) for c in cols], _f(d["core_x_gradient"]),
               f"{_f(d['speedup_vs_fastest_peer'])} / {_f(d['speedup_vs_fastest_peer_by_gradient'])}",
               _f(d["noreuse_speedup_vs_fastest_peer"]), _f(d["facade_over_core"]), " / ".join(pk)]
        lines.append("| " + " | ".join(row) + " |")
    lines += [
        "",
        "Notes: peers (0.x-style baseline, 1.0.0a5, curvlinops) are the columns the core is compared with; "
        "1.0.0a5 and curvlinops run in their own subprocess (1.0.0a5 shares our import name), so their "
        "repeats cannot interleave with ours: their '× gradient' uses the gradient measured in their own "
        "process, 'by gradient' speedups compare those ratios, 'abs' compares milliseconds across processes. "
        "Peak = max allocated during one call minus allocated before (CUDA only; '–' on CPU). A graph kept "
        "by graph reuse and the pools of CUDA-graph recordings are allocated before the call and so not in its "
        "peak: they are the '+ held' figure (bytes the operator holds between products). Relative errors: fixed entries "
        "(≤ 2^20) of each product against the core's.",
        "",
    ]
    for res in doc["results"]:
        if res.get("skipped"):
            continue
        lines += [f"### {res['name']} ({res['params'] / 1e6:.2f} M params, {res['batches']} batch(es), "
                  f"{res['samples']} samples{'; ' + res['note'] if res.get('note') else ''})", ""]
        head2 = ["column", "gradient ms", "HVP ms", "× gradient", "peak MiB (+ held)", "rel err", "block-8 ms/vector (× grad)",
                 "GGN ms", "Fisher ms", "top-10 eigs", "Hutch++ trace", "SLQ"]
        lines += ["| " + " | ".join(head2) + " |", "|" + "---|" * len(head2)]
        for col in cols:
            c = res["columns"].get(col)
            if c is None:
                continue
            cells = c.get("cells", {})
            g = grad_ms(res, col)
            hvp = cells.get("hvp")
            bad = _bad(hvp)
            hv = _num(hvp.get("ms")) if hvp and not bad else float("nan")
            blk = cells.get("block8")
            blk_s = _bad(blk) or f"{_f(_num(blk.get('ms_per_vector')))} ({_f(_num(blk.get('ms_per_vector')) / g)})" if blk else "not run"
            rel = _num(hvp.get("rel_err_vs_core")) if hvp else float("nan")

            def prod(task: str, cells: dict[str, Any] = cells) -> str:
                cell = cells.get(task)
                return _bad(cell) or _f(_num(cell.get("ms") if cell else None))

            row = [LABELS.get(col, col) + (" (subprocess)" if c.get("subprocess") else ""), _f(g),
                   bad or _f(hv), _f(hv / g), _peak(hvp) if hvp else "–",
                   f"{rel:.1e}" if math.isfinite(rel) else "–", blk_s, prod("ggn"), prod("fisher"),
                   _algo(cells.get("eigs")), _algo(cells.get("trace")), _algo(cells.get("slq"))]
            lines.append("| " + " | ".join(row) + " |")
        vals = {col: res["columns"][col].get("cells", {}).get("eigs", {}).get("values") for col in cols
                if col in res["columns"]}
        shown = {k: v for k, v in vals.items() if v}
        if shown:
            lines.append("")
            lines.append("Top eigenvalues (by magnitude, first 3): " + "; ".join(
                f"{LABELS.get(k, k)} " + ", ".join(f"{x:.4g}" for x in v[:3]) for k, v in shown.items()))
        lines.append("")
    return "\n".join(lines)


def plot(doc: dict[str, Any], path: Path) -> bool:
    """HVP × gradient and top-10 eigenpair time per column and workload; False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception:
        return False
    results = [r for r in doc["results"] if not r.get("skipped")]
    if not results:
        return False
    cols = [c for c in doc.get("columns", [])]
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
    width = 0.8 / max(1, len(cols))
    for j, col in enumerate(cols):
        xs = [i + j * width for i in range(len(results))]
        hx = [ms(r, col, "hvp") / grad_ms(r, col) for r in results]
        ev = [_num(r["columns"].get(col, {}).get("cells", {}).get("eigs", {}).get("ms")) / 1e3
              if not _bad(r["columns"].get(col, {}).get("cells", {}).get("eigs")) else float("nan") for r in results]
        axes[0].bar(xs, [0 if not math.isfinite(x) else x for x in hx], width, label=LABELS.get(col, col))
        axes[1].bar(xs, [0 if not math.isfinite(x) else x for x in ev], width, label=LABELS.get(col, col))
    for ax, title in zip(axes, ("Hessian-vector product / gradient (lower is better)", "top-10 eigenpairs, s (log)"),
                         strict=True):
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(results))])
        ax.set_xticklabels([r["workload"] for r in results], rotation=20)
        ax.set_title(title, fontsize=10)
    axes[1].set_yscale("log")
    axes[0].legend(fontsize=7)
    env = doc["env"]
    fig.suptitle(f"{env.get('gpu', env.get('cpu'))}, torch {env.get('torch')}, scale {doc.get('scale')}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def merge(docs: list[dict[str, Any]]) -> dict[str, Any]:
    """One document from several runs (e.g. a products run and an algorithms run).

    Workloads are matched by key; a later run wins cell by cell (and for the
    gradients and column metadata it brings), so list runs oldest first.
    """
    merged = dict(docs[0])
    merged["results"] = []
    by_key: dict[str, dict[str, Any]] = {}
    for d in docs:
        for r in d["results"]:
            old = by_key.get(r["workload"])
            if old is None or old.get("skipped"):
                fresh = {**r, "columns": {c: {**v, "cells": dict(v.get("cells", {}))}
                                          for c, v in r.get("columns", {}).items()}}
                by_key[r["workload"]] = fresh
                merged["results"].append(fresh)
                if old is not None:
                    merged["results"].remove(old)
                continue
            if r.get("skipped"):
                continue
            if "gradient" in r and any(c in IN_PROCESS for c in r.get("columns", {})):
                old["gradient"] = r["gradient"]  # the unit of the in-process columns it brings
            for col, v in r.get("columns", {}).items():
                tgt = old["columns"].setdefault(col, {"cells": {}})
                tgt.update({k: x for k, x in v.items() if k != "cells"})
                tgt["cells"].update(v.get("cells", {}))
    merged["columns"] = list(dict.fromkeys(c for d in docs for c in d.get("columns", [])))
    merged["tasks"] = list(dict.fromkeys(t for d in docs for t in d.get("tasks", [])))
    merged["suite"] = "+".join(dict.fromkeys(str(d.get("suite")) for d in docs))
    merged["command"] = " ; ".join(d.get("command", "") for d in docs if d.get("command"))
    return merged
