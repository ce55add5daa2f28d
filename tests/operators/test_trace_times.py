"""Trace times remembered for ``auto`` (NOTE [trace times]), and recorded programs being the same
in every process (what lets inductor's cache serve a second process)."""

from __future__ import annotations

import json
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
from hessian_eigenthings.operators.engines import TRACE_TIMES, trace_times
from hessian_eigenthings.operators.engines import auto as engines_mod
from tests.conftest import classification_data, mlp

CE = nn.CrossEntropyLoss()
SUP = supervised_loss(CE)
CE_OUT = supervised_loss_of_output(CE)


def _structure(op: HessianOperator | GGNOperator) -> str:
    return op._engines._make("functional").structure()  # type: ignore[union-attr]


def test_a_trace_records_its_time_for_this_model(record_dir: Path) -> None:
    model, data = mlp(), classification_data(n=8, batch=4)
    op = HessianOperator(model, data, SUP, engine="functional")
    op @ torch.randn(op.size, dtype=torch.float64)
    key = _structure(op)
    seconds = op.engine_report["trace_s"]
    assert TRACE_TIMES.expected_s(key) == pytest.approx(seconds, abs=1e-3)
    path = record_dir / trace_times.FILE
    assert json.loads(path.read_text())[key] == {"trace_s": pytest.approx(seconds, abs=1e-3)}
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(record_dir.stat().st_mode) == 0o700
    TRACE_TIMES.clear()  # as a new process: the file answers
    assert TRACE_TIMES.expected_s(key) == pytest.approx(seconds, abs=1e-3)
    # another curvature of the same model is another key
    ggn = GGNOperator(model, data, lambda m, b: m(b[0]), CE_OUT)
    assert TRACE_TIMES.expected_s(_structure(ggn)) is None


def test_a_record_holds_what_auto_learnt_and_reads_older_ones(record_dir: Path) -> None:
    model, data = mlp(), classification_data(n=4, batch=4)
    key = _structure(HessianOperator(model, data, SUP))
    TRACE_TIMES.note(key, 0.25)
    TRACE_TIMES.note_facts(key, functional_ratio=0.4, products=64.0)
    TRACE_TIMES.clear()
    assert TRACE_TIMES.facts(key) == {"trace_s": 0.25, "functional_ratio": 0.4, "products": 64.0}
    # session 14's records held a trace time alone; unknown or negative entries are dropped
    path = record_dir / trace_times.FILE
    path.write_text(json.dumps({key: 0.5, "other": {"trace_s": -1.0, "colour": 2.0}}))
    TRACE_TIMES.clear()
    assert TRACE_TIMES.facts(key) == {"trace_s": 0.5}
    assert TRACE_TIMES.facts("other") == {}


def test_facts_the_file_holds_already_are_not_written_again(
    record_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """NOTE [what auto remembers]: a rerun counting its products as the last run did writes
    nothing; a changed fact is written."""
    TRACE_TIMES.note_facts("key", products=16.0, functional_ratio=0.5)
    TRACE_TIMES.clear()  # a new process
    writes: list[str] = []
    real = trace_times.os.replace
    monkeypatch.setattr(trace_times.os, "replace", lambda a, b: writes.append(b) or real(a, b))
    assert TRACE_TIMES.facts("key") == {"products": 16.0, "functional_ratio": 0.5}
    TRACE_TIMES.note_facts("key", products=16.0)
    assert not writes
    TRACE_TIMES.note_facts("key", products=32.0)
    assert len(writes) == 1
    TRACE_TIMES.clear()
    assert TRACE_TIMES.facts("key") == {"products": 32.0, "functional_ratio": 0.5}
    # what another process wrote since is read again (the file changed)
    path = record_dir / trace_times.FILE
    path.write_text(json.dumps({"key": {"products": 64.0}}))
    assert TRACE_TIMES.facts("other") == {}
    TRACE_TIMES.clear()
    assert TRACE_TIMES.facts("key") == {"products": 64.0}


def test_any_decision_needs_all_four_facts_a_faster_engine_and_a_long_run(
    record_dir: Path,
) -> None:
    full = {"trace_s": 0.01, "functional_ratio": 0.5, "autograd_ms": 1.0, "products": 16.0}
    assert not TRACE_TIMES.any_decision("h", 8)
    for missing in full:
        rest = {k: v for k, v in full.items() if k != missing}
        TRACE_TIMES.note_facts("k-" + missing, hint="h", **rest)
    TRACE_TIMES.note_facts("slower", hint="h", **{**full, "functional_ratio": 1.2})
    TRACE_TIMES.note_facts("short", hint="h", **{**full, "products": 4.0})
    TRACE_TIMES.note_facts("other", hint="other", **full)
    assert not TRACE_TIMES.any_decision("h", 8)
    TRACE_TIMES.clear()  # from the file alone, as a new process
    assert not TRACE_TIMES.any_decision("h", 8)
    assert TRACE_TIMES.any_decision("other", 8)
    TRACE_TIMES.note_facts("full", hint="h", **full)
    assert TRACE_TIMES.any_decision("h", 8)
    TRACE_TIMES.clear()
    assert TRACE_TIMES.any_decision("h", 8)
    assert not TRACE_TIMES.any_decision("h", 32)
    # the hint is kept beside the facts, not among them, and a later fact keeps it
    assert TRACE_TIMES.facts("full") == full
    TRACE_TIMES.note_facts("full", products=64.0)
    TRACE_TIMES.clear()
    assert TRACE_TIMES.any_decision("h", 32)
    assert json.loads((record_dir / trace_times.FILE).read_text())["full"]["hint"] == "h"


_SCRIPT = textwrap.dedent(
    """
    import json, torch
    from torch import nn
    from hessian_eigenthings.loss_fns import supervised_loss
    from hessian_eigenthings.operators import HessianOperator
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3)).double()
    data = [(torch.randn(4, 5, dtype=torch.float64), torch.randint(0, 3, (4,))) for _ in range(2)]
    op = HessianOperator(model, data, supervised_loss(nn.CrossEntropyLoss()))
    estimate = op._engines.trace_estimate_ms()
    with op.using_engine("functional"):
        out = op @ torch.ones(op.size, dtype=torch.float64)
        runner = op._engine_selector.runner
        keys = [p.key for p in runner._programs.values()]
        code_from = [(p.primal.code_from, p.tangent.code_from) for p in runner._programs.values()]
        report = op.engine_report
    print(json.dumps({"estimate": estimate, "report": report, "keys": keys,
                      "code_from": code_from, "out": out.tolist()}))
    """
)


def test_a_second_process_expects_the_first_ones_trace_and_records_the_same_program(
    record_dir: Path,
) -> None:
    env = {**os.environ, trace_times.ENV: str(record_dir)}
    runs = []
    for _ in range(2):
        proc = subprocess.run(
            [sys.executable, "-c", _SCRIPT], capture_output=True, text=True, env=env, check=True
        )
        runs.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    assert runs[0]["estimate"][1].startswith("prior")
    assert runs[1]["estimate"][1] == "this model's last trace"
    assert runs[1]["estimate"][0] == pytest.approx(runs[0]["report"]["trace_s"] * 1e3, abs=1.0)
    # the same program code in both (inductor's cache keys compiled artifacts on it)
    assert runs[0]["keys"] == runs[1]["keys"] and runs[0]["keys"]
    # the second process loaded the bytecode the first compiled (NOTE [stored bytecode])
    assert runs[0]["code_from"] == [["compiled", "compiled"]]
    assert runs[1]["code_from"] == [["disk", "disk"]]
    assert runs[1]["out"] == runs[0]["out"]


_TEXT = "def program(a0):\n    v0 = a0 * 2\n    return v0\n"


def _run(code: object) -> object:
    scope: dict[str, object] = {}
    exec(code, {}, scope)  # type: ignore[call-overload]
    return scope["program"](21)  # type: ignore[operator]


def test_written_programs_are_compiled_once_per_process_and_once_per_machine(
    record_dir: Path,
) -> None:
    trace_times._codes.clear()
    code, source = trace_times.program_code(_TEXT, "<p>")
    assert source == "compiled" and _run(code) == 42
    again, source = trace_times.program_code(_TEXT, "<p>")
    assert source == "process" and again is code
    files = list((record_dir / trace_times.CODE_DIR).iterdir())
    assert len(files) == 1 and stat.S_IMODE(files[0].stat().st_mode) == 0o600
    trace_times._codes.clear()  # as a new process
    loaded, source = trace_times.program_code(_TEXT, "<p>")
    assert source == "disk" and _run(loaded) == 42
    # another text, or the same text under another file name, is another program
    other = _TEXT.replace("* 2", "* 3")
    code3, source = trace_times.program_code(other, "<p>")
    assert source == "compiled" and _run(code3) == 63
    assert trace_times.program_code(_TEXT, "<q>")[1] == "compiled"
    assert len(list((record_dir / trace_times.CODE_DIR).iterdir())) == 3


def test_stored_bytecode_others_could_write_or_that_is_broken_is_compiled_anew(
    record_dir: Path,
) -> None:
    trace_times._codes.clear()
    trace_times.program_code(_TEXT, "<p>")
    (path,) = (record_dir / trace_times.CODE_DIR).iterdir()
    path.chmod(0o666)
    trace_times._codes.clear()
    assert trace_times.program_code(_TEXT, "<p>")[1] == "compiled"
    path.chmod(0o600)
    path.write_bytes(b"not bytecode")
    trace_times._codes.clear()
    code, source = trace_times.program_code(_TEXT, "<p>")
    assert source == "compiled" and _run(code) == 42
    trace_times._codes.clear()
    assert trace_times.program_code(_TEXT, "<p>")[1] == "disk"  # written again
    # a folder others could write is not read from
    (record_dir / trace_times.CODE_DIR).chmod(0o777)
    trace_times._codes.clear()
    assert trace_times.program_code(_TEXT, "<p>")[1] == "compiled"


def test_stored_bytecode_keeps_the_most_recent_programs(
    record_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(trace_times, "MAX_CODES", 2)
    trace_times._codes.clear()
    texts = [_TEXT.replace("* 2", f"* {k}") for k in range(3, 6)]
    for k, text in enumerate(texts):
        trace_times.program_code(text, "<p>")
        path = max((record_dir / trace_times.CODE_DIR).iterdir(), key=lambda f: f.stat().st_mtime_ns)
        os.utime(path, ns=(k * 10**9, k * 10**9))  # distinct ages on any filesystem
    assert len(trace_times._codes) == 2
    assert len(list((record_dir / trace_times.CODE_DIR).iterdir())) == 2
    trace_times._codes.clear()
    assert trace_times.program_code(texts[1], "<p>")[1] == "disk"  # used now: the newest
    assert trace_times.program_code(texts[0], "<p>")[1] == "compiled"  # the oldest went
    # writing texts[0] again sends away the least recently used, texts[2], not texts[1]
    trace_times._codes.clear()
    assert trace_times.program_code(texts[1], "<p>")[1] == "disk"
    assert trace_times.program_code(texts[2], "<p>")[1] == "compiled"


def test_nothing_of_a_program_is_written_when_the_record_is_off(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(trace_times.ENV, "0")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    trace_times._codes.clear()
    assert trace_times.program_code(_TEXT, "<p>")[1] == "compiled"
    assert trace_times.program_code(_TEXT, "<p>")[1] == "process"
    assert not list(tmp_path.rglob("*.bytecode"))


def test_what_changes_a_program_changes_its_key() -> None:
    torch.manual_seed(0)
    model = mlp()
    names = [n for n, _ in model.named_parameters()]
    op = HessianOperator(model, classification_data(n=4, batch=4), SUP)
    base = trace_times.structure_key(model, names, op.functional_product)
    # the same model's values changed: same key (values are inputs of the program)
    with torch.no_grad():
        next(model.parameters()).add_(1.0)
    assert trace_times.structure_key(model, names, op.functional_product) == base
    assert trace_times.structure_key(model, names[:2], op.functional_product) != base
    other = mlp(hidden=9)
    assert trace_times.structure_key(other, names, op.functional_product) != base
    model.eval()
    assert trace_times.structure_key(model, names, op.functional_product) != base
    model.train()
    ggn = GGNOperator(model, classification_data(n=4, batch=4), lambda m, b: m(b[0]), CE_OUT)
    assert trace_times.structure_key(model, names, ggn.functional_product) != base
    other_loss = HessianOperator(
        model, classification_data(n=4, batch=4), supervised_loss(nn.MultiMarginLoss())
    )
    assert trace_times.structure_key(model, names, other_loss.functional_product) != base


def test_a_record_others_could_write_is_not_read(record_dir: Path) -> None:
    model, data = mlp(), classification_data(n=4, batch=4)
    op = HessianOperator(model, data, SUP, engine="functional")
    op @ torch.randn(op.size, dtype=torch.float64)
    path = record_dir / trace_times.FILE
    path.chmod(0o666)
    TRACE_TIMES.clear()
    assert TRACE_TIMES.expected_s(_structure(op)) is None


def test_nothing_is_written_when_the_record_is_off(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(trace_times.ENV, "0")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    model, data = mlp(), classification_data(n=4, batch=4)
    op = HessianOperator(model, data, SUP, engine="functional")
    op @ torch.randn(op.size, dtype=torch.float64)
    assert trace_times.record_dir() is None
    assert not list(tmp_path.rglob(trace_times.FILE))
    assert TRACE_TIMES.expected_s(_structure(op)) is not None  # the process still knows


def test_auto_expects_this_models_last_trace(record_dir: Path) -> None:
    del record_dir
    model, data = mlp(), classification_data(n=4, batch=4)
    op = HessianOperator(model, data, SUP)
    ms, why = op._engines.trace_estimate_ms()
    leaves = sum(1 for m in model.modules() if next(m.children(), None) is None)
    assert why == f"prior: {leaves} leaf modules"
    assert ms == pytest.approx(engines_mod.TRACE_PRIOR_S_PER_MODULE * leaves * 1e3)
    traced = HessianOperator(model, data, SUP, engine="functional")
    traced @ torch.randn(op.size, dtype=torch.float64)
    ms, why = op._engines.trace_estimate_ms()
    assert why == "this model's last trace"
    assert ms == pytest.approx(traced.engine_report["trace_s"] * 1e3, abs=1.0)


def test_the_record_keeps_the_most_recent_models(
    record_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(trace_times, "MAX_RECORDS", 2)
    keys = []
    for hidden in (4, 5, 6):
        model, data = mlp(hidden=hidden), classification_data(n=4, batch=4)
        op = HessianOperator(model, data, SUP, engine="functional")
        op @ torch.randn(op.size, dtype=torch.float64)
        keys.append(_structure(op))
    assert list(json.loads((record_dir / trace_times.FILE).read_text())) == keys[1:]


def test_the_records_live_in_inductors_own_cache_directory(monkeypatch: pytest.MonkeyPatch) -> None:
    # inductor names its default directory by the login name; $USER is unset in many containers
    cache_dir_utils = pytest.importorskip("torch._inductor.runtime.cache_dir_utils")
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    monkeypatch.delenv("USER", raising=False)
    assert trace_times.inductor_cache_base() == cache_dir_utils.default_cache_dir()
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "relative/cache")
    assert trace_times.inductor_cache_base() == os.path.abspath("relative/cache")
