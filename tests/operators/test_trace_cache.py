"""Traced programs reused across operators and processes (NOTE [trace reuse]).

Every product is checked against a dense float64 oracle; what was traced, found or checked is
read off the runner's counters (noise-free)."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

from hessian_eigenthings.loss_fns import supervised_loss, supervised_loss_of_output
from hessian_eigenthings.operators import GGNOperator, HessianOperator
from hessian_eigenthings.operators.engines import TRACE_STORE, trace_cache
from hessian_eigenthings.operators.engines import auto as engines_mod
from hessian_eigenthings.param_utils import select_parameters
from hessian_eigenthings.testing import dense_hessian
from tests.conftest import classification_data, mlp
from tests.operators.curvature_oracles import dense_ggn

CE = nn.CrossEntropyLoss()
SUP = supervised_loss(CE)
CE_OUT = supervised_loss_of_output(CE)


@pytest.fixture
def store_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    folder = tmp_path / "traces"
    monkeypatch.setenv(trace_cache.ENV, str(folder))
    return folder


def _runner(op: HessianOperator | GGNOperator):  # type: ignore[no-untyped-def]
    return op._engines.runner


def _product(op: HessianOperator | GGNOperator, v: torch.Tensor) -> torch.Tensor:
    return op @ v


def test_a_second_operator_reuses_the_program_in_the_process(store_dir: Path) -> None:
    del store_dir
    model, data = mlp(), classification_data(n=8, batch=4)
    H = dense_hessian(model, data, SUP, select_parameters(model))
    v = torch.randn(H.shape[0], dtype=torch.float64)
    first = HessianOperator(model, data, SUP, engine="functional")
    torch.testing.assert_close(first @ v, H @ v, rtol=1e-10, atol=1e-10)
    assert _runner(first).num_traces == 1
    second = HessianOperator(model, data, SUP, engine="functional")
    rng = torch.get_rng_state()
    torch.testing.assert_close(second @ v, H @ v, rtol=1e-10, atol=1e-10)
    assert torch.equal(torch.get_rng_state(), rng)  # the check draws from a private generator
    report = second.engine_report
    assert report["traces"] == 0 and report["traces_reused"] == {"process": 1, "disk": 0}
    assert report["reuse_failed"] == 0


def test_a_new_process_loads_the_program_from_disk(store_dir: Path) -> None:
    model, data = mlp(), classification_data(n=8, batch=4)
    first = HessianOperator(model, data, SUP, engine="functional")
    v = torch.randn(first.size, dtype=torch.float64)
    first @ v
    files = list(store_dir.glob("*.pt"))
    assert len(files) == 1
    assert stat.S_IMODE(files[0].stat().st_mode) == 0o600
    assert stat.S_IMODE(store_dir.stat().st_mode) == 0o700
    TRACE_STORE.clear()  # as a new process: nothing in memory
    second = HessianOperator(model, data, SUP, engine="functional")
    H = dense_hessian(model, data, SUP, select_parameters(model))
    torch.testing.assert_close(second @ v, H @ v, rtol=1e-10, atol=1e-10)
    assert second.engine_report["traces_reused"] == {"process": 0, "disk": 1}
    assert _runner(second).num_traces == 0


def test_a_real_second_process_loads_the_program(store_dir: Path) -> None:
    script = textwrap.dedent(
        """
        import json, sys, torch
        from torch import nn
        from hessian_eigenthings.loss_fns import supervised_loss
        from hessian_eigenthings.operators import HessianOperator
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3)).double()
        data = [(torch.randn(4, 5, dtype=torch.float64), torch.randint(0, 3, (4,))) for _ in range(2)]
        op = HessianOperator(model, data, supervised_loss(nn.CrossEntropyLoss()), engine="functional")
        out = op @ torch.ones(op.size, dtype=torch.float64)
        print(json.dumps({"report": op.engine_report, "out": out.tolist()}))
        """
    )
    env = {**os.environ, trace_cache.ENV: str(store_dir)}
    runs = []
    for _ in range(2):
        proc = subprocess.run(
            [sys.executable, "-c", script], capture_output=True, text=True, env=env, check=True
        )
        import json

        runs.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    assert runs[0]["report"]["traces"] == 1
    assert runs[1]["report"]["traces"] == 0
    assert runs[1]["report"]["traces_reused"] == {"process": 0, "disk": 1}
    assert runs[0]["out"] == runs[1]["out"]


def test_the_ggn_program_is_reused_too(store_dir: Path) -> None:
    del store_dir
    model, data = mlp(), classification_data(n=8, batch=4)
    named = list(model.named_parameters())
    G = dense_ggn(model, data, lambda m, b: m(b[0]), CE_OUT, named)
    v = torch.randn(G.shape[0], dtype=torch.float64)
    for n, source in enumerate((None, "process")):
        op = GGNOperator(model, data, lambda m, b: m(b[0]), CE_OUT, engine="functional")
        torch.testing.assert_close(op @ v, G @ v, rtol=1e-10, atol=1e-10)
        assert _runner(op).num_traces == (1 if n == 0 else 0)
        if source:
            assert op.engine_report["traces_reused"][source] == 1


class _Scaled(nn.Module):
    """Reads a module-level constant the store's key cannot see."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(5, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x)) * SCALE


SCALE = 1.0


def test_a_found_program_that_computes_something_else_is_traced_again(
    store_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    del store_dir
    model = _Scaled().double()
    data = classification_data(n=4, batch=4)
    v = torch.randn(sum(p.numel() for p in model.parameters()), dtype=torch.float64)
    HessianOperator(model, data, SUP, engine="functional") @ v  # stored with SCALE = 1
    monkeypatch.setattr(sys.modules[__name__], "SCALE", 3.0)
    op = HessianOperator(model, data, SUP, engine="functional")
    H = dense_hessian(model, data, SUP, select_parameters(model))
    torch.testing.assert_close(op @ v, H @ v, rtol=1e-10, atol=1e-10)
    report = op.engine_report
    assert report["reuse_failed"] == 1 and report["traces"] == 1
    # the program traced again replaced the wrong one: a third operator finds the right one
    third = HessianOperator(model, data, SUP, engine="functional")
    torch.testing.assert_close(third @ v, H @ v, rtol=1e-10, atol=1e-10)
    assert third.engine_report["reuse_failed"] == 0 and third.engine_report["traces"] == 0


def test_what_changes_a_program_changes_its_key() -> None:
    torch.manual_seed(0)
    model = mlp()
    names = [n for n, _ in model.named_parameters()]
    op = HessianOperator(model, classification_data(n=4, batch=4), SUP)
    base = trace_cache.structure_key(model, names, op.functional_product)
    # the same model's values changed: same key (values are inputs of the program)
    with torch.no_grad():
        next(model.parameters()).add_(1.0)
    assert trace_cache.structure_key(model, names, op.functional_product) == base
    assert trace_cache.structure_key(model, names[:2], op.functional_product) != base
    other = mlp(hidden=9)
    assert trace_cache.structure_key(other, names, op.functional_product) != base
    model.eval()
    assert trace_cache.structure_key(model, names, op.functional_product) != base
    model.train()
    ggn = GGNOperator(model, classification_data(n=4, batch=4), lambda m, b: m(b[0]), CE_OUT)
    assert trace_cache.structure_key(model, names, ggn.functional_product) != base
    mse = HessianOperator(
        model, classification_data(n=4, batch=4), supervised_loss(nn.MultiMarginLoss())
    )
    assert trace_cache.structure_key(model, names, mse.functional_product) != base
    assert trace_cache.program_key(base, ("sig", 1)) != trace_cache.program_key(base, ("sig", 2))


def test_files_others_could_write_are_not_read(store_dir: Path) -> None:
    model, data = mlp(), classification_data(n=4, batch=4)
    v = torch.randn(sum(p.numel() for p in model.parameters()), dtype=torch.float64)
    HessianOperator(model, data, SUP, engine="functional") @ v
    (path,) = store_dir.glob("*.pt")
    path.chmod(0o666)
    TRACE_STORE.clear()
    op = HessianOperator(model, data, SUP, engine="functional")
    op @ v
    assert op.engine_report["traces"] == 1  # not loaded: traced again (and written privately)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


def test_nothing_is_written_when_the_store_is_off(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(trace_cache.ENV, "0")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    model, data = mlp(), classification_data(n=4, batch=4)
    HessianOperator(model, data, SUP, engine="functional") @ torch.randn(
        sum(p.numel() for p in model.parameters()), dtype=torch.float64
    )
    assert trace_cache.cache_dir() is None
    assert list(tmp_path.rglob("*.pt")) == []


def test_auto_expects_what_a_trace_of_this_model_cost(store_dir: Path) -> None:
    del store_dir
    model, data = mlp(), classification_data(n=4, batch=4)
    op = HessianOperator(model, data, SUP)
    ms, why = op._engines.trace_estimate_ms()
    leaves = sum(1 for m in model.modules() if next(m.children(), None) is None)
    assert why == f"prior: {leaves} leaf modules"
    assert ms == pytest.approx(engines_mod.TRACE_PRIOR_S_PER_MODULE * leaves * 1e3)
    v = torch.randn(op.size, dtype=torch.float64)
    HessianOperator(model, data, SUP, engine="functional") @ v
    assert op._engines.trace_estimate_ms() == (
        0.0,
        "a program of this model is kept in the process",
    )
    TRACE_STORE.clear()
    ms, why = op._engines.trace_estimate_ms()
    assert why == "a program of this model is stored on disk" and ms == 1000.0  # no load timed yet
    HessianOperator(model, data, SUP, engine="functional") @ v  # loads it
    TRACE_STORE._programs.clear()  # the times stay, the program is gone from memory
    ms, why = op._engines.trace_estimate_ms()
    assert why == "a program of this model is stored on disk" and 0 < ms < 1000.0


def test_the_disk_keeps_the_most_recent_programs(
    store_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(trace_cache, "MAX_ON_DISK", 2)
    for hidden in (4, 5, 6):
        model, data = mlp(hidden=hidden), classification_data(n=4, batch=4)
        v = torch.randn(sum(p.numel() for p in model.parameters()), dtype=torch.float64)
        HessianOperator(model, data, SUP, engine="functional") @ v
    assert len(list(store_dir.glob("*.pt"))) == 2
