"""Smoke test of the parity harness (benchmarks/harness): tiny workload, CPU, in-process columns."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

pytest.importorskip("scipy")

from benchmarks.harness.adapters import IN_PROCESS  # noqa: E402
from benchmarks.harness.report import derived, merge, to_markdown  # noqa: E402
from benchmarks.harness.runner import SUITES  # noqa: E402
from benchmarks.harness.suite import run  # noqa: E402


def _finite(x: object) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(float(x))


def test_parity_suite_tiny_cpu(tmp_path: Path) -> None:
    out = tmp_path / "parity"
    run(suite="parity", device="cpu", repeats=1, warmup=1, workloads="tiny", trace_matvecs=9,
              columns=",".join((*IN_PROCESS, "a5")), peers_dir=str(tmp_path / "no-peers"),
              slq_runs=2, slq_steps=8, out=str(out), log=lambda m: None)
    data = json.loads((out / "parity.json").read_text())
    assert (out / "parity.md").read_text().startswith("Device: cpu")
    assert data["env"]["torch"] and data["env"]["python"]
    (res,) = data["results"]
    assert _finite(res["gradient"]["ms"])
    for col in IN_PROCESS:
        cells = res["columns"][col]["cells"]
        assert set(cells) == set(SUITES["parity"]), col
        for task, cell in cells.items():
            assert "error" not in cell, (col, task, cell)
            if "na" in cell:  # only what 0.x never had
                assert col in ("facade", "baseline-0x") and task in ("ggn", "fisher", "trace", "slq"), (col, task)
                continue
            assert _finite(cell["ms"]) and cell["ms"] > 0, (col, task)
        assert cells["hvp"]["rel_err_vs_core"] < 1e-5, col
        assert _finite(cells["block8"]["ms_per_vector"])
        assert cells["eigs"]["matvecs"] > 0 and len(cells["eigs"]["values"]) == 10
    # core and baseline agree on the spectrum and the trace budget
    core, base = res["columns"]["core"]["cells"], res["columns"]["baseline-0x"]["cells"]
    assert core["eigs"]["values"][0] == pytest.approx(base["eigs"]["values"][0], rel=1e-3)
    assert core["trace"]["matvecs"] == 9
    # a peer that is not installed gets its reason in every cell, not a blank
    a5 = res["columns"]["a5"]["cells"]
    assert all("not installed" in a5[t]["na"] for t in SUITES["parity"])
    d = derived(data["results"][0])
    assert _finite(d["facade_over_core"]) and _finite(d["speedup_vs_fastest_peer"])
    assert "| tiny MLP" in to_markdown(data)
    both = merge([data, data])  # `python -m benchmarks report A B`: one row per workload
    assert len(both["results"]) == 1 and set(both["results"][0]["columns"]) == set(res["columns"])


def test_engine_columns_run_side_by_side(tmp_path: Path) -> None:
    """One column per product engine: each runs every parity task on its engine, agrees with
    the core column, and reports its engine (traces, compilations) in the product cell."""
    out = tmp_path / "engines"
    run(suite="parity", device="cpu", repeats=1, warmup=1, workloads="tiny", trace_matvecs=9,
        columns="core,core-autograd,core-functional", peers_dir=str(tmp_path / "no-peers"),
        slq_runs=2, slq_steps=8, out=str(out), log=lambda m: None)
    (res,) = json.loads((out / "parity.json").read_text())["results"]
    for col, engine in (("core-autograd", "autograd"), ("core-functional", "functional")):
        cells = res["columns"][col]["cells"]
        assert all("error" not in cell for cell in cells.values()), (col, cells)
        assert cells["hvp"]["rel_err_vs_core"] < 1e-6, col
        assert cells["hvp"]["engine"]["active"] == engine
        assert f"engine={engine}" in res["columns"][col]["version"]
    assert res["columns"]["core-functional"]["cells"]["hvp"]["engine"]["traces"] >= 1
