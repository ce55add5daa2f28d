"""Product engines (``engine=``): every engine equals the dense float64 oracle, leaves the model
and the global precision switches as found, and ``auto`` / ``compiled`` behave as documented."""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

from hessian_eigenthings import _torch_compat
from hessian_eigenthings.algorithms import lanczos
from hessian_eigenthings.loss_fns import (
    supervised_forward,
    supervised_loss,
    supervised_loss_of_output,
    supervised_per_sample_loss,
)
from hessian_eigenthings.loss_fns.forward_rules import ElementwiseLosses
from hessian_eigenthings.operators import EmpiricalFisherOperator, GGNOperator, HessianOperator
from hessian_eigenthings.operators.engines import (
    TRACE_TIMES,
    CompileFallbackWarning,
    EngineUnsupportedError,
    recorder,
    split_by_tangent,
)
from hessian_eigenthings.operators.engines import auto as engines_mod
from hessian_eigenthings.operators.engines import compiled as compiled_mod
from hessian_eigenthings.param_utils import match_names, select_parameters
from hessian_eigenthings.testing import dense_hessian
from tests.conftest import SmallCNN, TinyTransformer, classification_data, mlp
from tests.operators.contract import assert_unchanged, check_contract, snapshot
from tests.operators.curvature_oracles import dense_empirical_fisher, dense_ggn

CE = nn.CrossEntropyLoss()
SUP = supervised_loss(CE)
CE_OUT = supervised_loss_of_output(CE)
PER_SAMPLE = supervised_per_sample_loss(CE)
TRACED = ["functional", "compiled"]
compile_only = pytest.mark.skipif(
    not _torch_compat.compile_supported(), reason="torch.compile unsupported here"
)


def lm_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    logits = model(batch["input_ids"])
    return nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]), batch["input_ids"][:, 1:].reshape(-1)
    )


# -- every engine against the dense oracle -------------------------------------------------


@pytest.mark.parametrize("engine", ["functional"])
def test_hessian_mlp_uneven_batches(engine: str) -> None:
    model, data = mlp(), classification_data(n=10, batch=4)  # batches of 4, 4, 2
    op = HessianOperator(model, data, SUP, engine=engine)
    check_contract(op, dense_hessian(model, data, SUP, select_parameters(model)), model)
    assert op.engine == engine
    # two batch signatures (4 and 2 samples): two traced programs, reused by every later product
    assert op.engine_report["traces"] == 2


@pytest.mark.parametrize("engine", ["functional"])
def test_hessian_param_filter_subset(engine: str) -> None:
    model, data = mlp(), classification_data(n=8, batch=4)
    flt = match_names("2.*")
    op = HessianOperator(model, data, SUP, param_filter=flt, engine=engine)
    check_contract(op, dense_hessian(model, data, SUP, select_parameters(model, flt)), model)


def test_hessian_cnn_batchnorm_eval() -> None:
    model = SmallCNN().double().eval()
    data = [
        (torch.randn(3, 2, 4, 4, dtype=torch.float64), torch.randint(0, 4, (3,))) for _ in range(2)
    ]
    op = HessianOperator(model, data, SUP, engine="functional")
    check_contract(op, dense_hessian(model, data, SUP, select_parameters(model)), model, rtol=1e-8)


def test_hessian_tiny_transformer_dict_batches() -> None:
    model = TinyTransformer().double()
    ids = torch.randint(0, 11, (3, 5))
    data = [{"input_ids": ids[:2]}, {"input_ids": ids[2:]}]
    flt = match_names("qkv.*", "head.bias")
    op = HessianOperator(model, data, lm_loss, param_filter=flt, engine="functional")
    check_contract(
        op, dense_hessian(model, data, lm_loss, select_parameters(model, flt)), model, rtol=1e-8
    )


@pytest.mark.parametrize("loss_hvp", ["analytical", "autograd"])
def test_ggn_functional(loss_hvp: str) -> None:
    model, data = mlp(), classification_data(n=10, batch=4)
    op = GGNOperator(
        model, data, supervised_forward, CE_OUT, loss_hvp=loss_hvp, engine="functional"
    )  # type: ignore[arg-type]
    dense = dense_ggn(model, data, supervised_forward, CE_OUT, select_parameters(model))
    check_contract(op, dense, model)


def test_empirical_fisher_functional() -> None:
    model, data = mlp(), classification_data(n=10, batch=4)
    op = EmpiricalFisherOperator(model, data, PER_SAMPLE, engine="functional")
    dense = dense_empirical_fisher(model, data, PER_SAMPLE, select_parameters(model))
    check_contract(op, dense, model)


def _flushes_denormals() -> bool:
    return bool((torch.tensor([1e-310], dtype=torch.float64) * 1.0).item() == 0.0)


@compile_only
def test_compiled_engine_matches_oracle_and_compiles_once_per_batch_size() -> None:
    model, data = mlp(), classification_data(n=10, batch=4)  # batch sizes 4, 4, 2
    op = HessianOperator(model, data, SUP, engine="compiled")
    H = dense_hessian(model, data, SUP, select_parameters(model))
    before = snapshot(model)
    v = torch.randn(op.size, dtype=torch.float64)
    flushes = _flushes_denormals()
    for _ in range(3):
        torch.testing.assert_close(op @ v, H @ v, rtol=1e-10, atol=1e-10)
    # the process's floating-point mode is the user's: torch 2.4's inductor loads CPU kernels
    # that switch it to flush-to-zero; the compiled engine switches it back
    assert _flushes_denormals() == flushes
    # one artifact per batch signature: the uneven last batch costs exactly one more
    assert op.engine_report["compilations"] == 2
    assert op.engine_report["fallbacks"] == 0
    assert op.engine_report["compile_s"] > 0
    assert_unchanged(model, before)


@compile_only
def test_compiled_ggn_block() -> None:
    model, data = mlp(), classification_data(n=8, batch=4)
    op = GGNOperator(model, data, supervised_forward, CE_OUT, engine="compiled")
    dense = dense_ggn(model, data, supervised_forward, CE_OUT, select_parameters(model))
    V = torch.randn(op.size, 3, dtype=torch.float64)
    torch.testing.assert_close(op @ V, dense @ V, rtol=1e-10, atol=1e-10)
    assert op.engine_report["compilations"] == 1  # one batch signature, one block width


@compile_only
def test_a_program_compiled_again_is_found_in_inductors_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # NOTE [inductor's caches for an aten graph]: without the compiler's tracing context every
    # compilation bypassed inductor's FX graph cache ("No shape env"), so a second process
    # compiled from scratch
    if not _torch_compat.inductor_graph_cache_on():
        pytest.skip("this torch's inductor keeps no graph cache by default")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    model, data = mlp(), classification_data(n=4, batch=4)
    H = dense_hessian(model, data, SUP, select_parameters(model))
    v = torch.randn(H.shape[0], dtype=torch.float64)
    first = HessianOperator(model, data, SUP, engine="compiled")
    hits = _torch_compat.inductor_cache_hits()
    torch.testing.assert_close(first @ v, H @ v, rtol=1e-10, atol=1e-10)
    assert _torch_compat.inductor_cache_hits() == hits  # a new directory: nothing to find
    (prog,) = first._engines.runner._programs.values()
    spent = first.engine_report["compile_s"]
    # the record of a first compilation is read as the cache hit it makes of the next one
    assert compiled_mod.recorded_compile_s(prog, 1) == pytest.approx(
        compiled_mod.CACHED_COMPILE_FRACTION * spent, rel=0.01, abs=6e-3
    )
    second = HessianOperator(model, data, SUP, engine="compiled")
    torch.testing.assert_close(second @ v, H @ v, rtol=1e-10, atol=1e-10)
    assert _torch_compat.inductor_cache_hits() == hits + 1
    assert second.engine_report["compilations"] == 1
    assert compiled_mod.recorded_compile_s(prog, 1) == pytest.approx(
        second.engine_report["compile_s"], rel=0.01, abs=6e-3
    )


# -- fallbacks, refusals and the model-state guarantees --------------------------------------


def test_compile_failure_warns_once_and_falls_back(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken() -> object:
        def backend(gm: object, inputs: object) -> object:
            raise RuntimeError("injected inductor failure")

        return backend

    monkeypatch.setattr(_torch_compat, "inductor_backend", broken)
    monkeypatch.setattr(_torch_compat, "compile_supported", lambda: True)
    model, data = mlp(), classification_data(n=10, batch=4)
    op = HessianOperator(model, data, SUP, engine="compiled")
    H = dense_hessian(model, data, SUP, select_parameters(model))
    v = torch.randn(op.size, dtype=torch.float64)
    with pytest.warns(CompileFallbackWarning, match="injected inductor failure") as rec:
        out1 = op @ v
        out2 = op @ torch.randn(op.size, 2, dtype=torch.float64)
    assert len([w for w in rec if issubclass(w.category, CompileFallbackWarning)]) == 1
    assert rec[0].filename == __file__
    torch.testing.assert_close(out1, H @ v, rtol=1e-10, atol=1e-10)
    assert out2.shape == (op.size, 2)
    assert op.engine_report["fallbacks"] >= 2


def test_training_mode_batchnorm_is_refused_by_traced_engines_with_the_alternative() -> None:
    model = SmallCNN().double().train()
    data = [(torch.randn(3, 2, 4, 4, dtype=torch.float64), torch.randint(0, 4, (3,)))]
    op = HessianOperator(model, data, SUP, engine="functional")
    with pytest.raises(EngineUnsupportedError, match="engine='autograd'"):
        op @ torch.randn(op.size, dtype=torch.float64)
    assert model.training


def test_dropout_in_training_mode_is_refused() -> None:
    model = nn.Sequential(nn.Linear(5, 7), nn.Dropout(0.5), nn.Linear(7, 3)).double().train()
    op = HessianOperator(model, classification_data(n=4, batch=4), SUP, engine="functional")
    with pytest.raises(EngineUnsupportedError, match="dropout"):
        op @ torch.randn(op.size, dtype=torch.float64)


def test_finite_differences_need_the_autograd_engine() -> None:
    model, data = mlp(), classification_data(n=4, batch=4)
    with pytest.raises(EngineUnsupportedError, match="finite_difference"):
        HessianOperator(model, data, SUP, method="finite_difference", engine="functional")
    with pytest.raises(EngineUnsupportedError, match="finite_difference"):
        GGNOperator(
            model, data, supervised_forward, CE_OUT, jvp="finite_difference", engine="compiled"
        )


def test_unknown_engine_and_precision_are_refused() -> None:
    model, data = mlp(), classification_data(n=4, batch=4)
    with pytest.raises(ValueError, match="engine must be one of"):
        HessianOperator(model, data, SUP, engine="fast")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="precision must be"):
        HessianOperator(model, data, SUP, precision="bf16")  # type: ignore[arg-type]


def test_functional_engine_keeps_parameter_versions_and_grads() -> None:
    model, data = mlp(), classification_data(n=4, batch=4)
    loss = SUP(model, data[0])  # the user's pending graph
    versions = [p._version for p in model.parameters()]
    op = HessianOperator(model, data, SUP, engine="functional")
    op @ torch.randn(op.size, dtype=torch.float64)
    assert [p._version for p in model.parameters()] == versions
    loss.backward()  # still valid
    assert all(p.grad is not None for p in model.parameters())


def test_loss_raising_mid_product_restores_the_model_and_flags() -> None:
    model, data = mlp(), classification_data(n=6, batch=4)  # two signatures: the loss runs twice
    calls = {"n": 0}

    def flaky(m: nn.Module, b: object) -> torch.Tensor:
        calls["n"] += 1
        if calls["n"] == 2:
            raise KeyboardInterrupt
        return SUP(m, b)

    op = HessianOperator(model, data, flaky, engine="functional")
    before = snapshot(model)
    flags = (torch.backends.cudnn.allow_tf32, torch.get_float32_matmul_precision())
    torch.backends.cudnn.allow_tf32 = True
    torch.set_float32_matmul_precision("high")
    try:
        with pytest.raises(KeyboardInterrupt):
            op @ torch.randn(op.size, dtype=torch.float64)
        assert torch.backends.cudnn.allow_tf32 is True
        assert torch.get_float32_matmul_precision() == "high"
    finally:
        torch.backends.cudnn.allow_tf32, prec = flags
        torch.set_float32_matmul_precision(prec)
    assert_unchanged(model, before)


# -- precision -----------------------------------------------------------------------------


@pytest.mark.parametrize("engine", ["autograd", "functional"])
def test_products_run_at_full_precision_and_restore_the_user_flags(engine: str) -> None:
    seen: list[tuple[bool, str]] = []

    def spy(m: nn.Module, b: object) -> torch.Tensor:
        seen.append((torch.backends.cudnn.allow_tf32, torch.get_float32_matmul_precision()))
        return SUP(m, b)

    model, data = mlp(), classification_data(n=4, batch=4)
    saved = (torch.backends.cudnn.allow_tf32, torch.get_float32_matmul_precision())
    torch.backends.cudnn.allow_tf32 = True
    torch.set_float32_matmul_precision("medium")
    try:
        op = HessianOperator(model, data, spy, engine=engine)  # type: ignore[arg-type]
        op @ torch.randn(op.size, dtype=torch.float64)
        assert seen and all(s == (False, "highest") for s in seen)
        assert torch.backends.cudnn.allow_tf32 is True
        assert torch.get_float32_matmul_precision() == "medium"
        seen.clear()
        op32 = HessianOperator(model, data, spy, engine=engine, precision="tf32")  # type: ignore[arg-type]
        op32 @ torch.randn(op32.size, dtype=torch.float64)
        assert seen and all(s == (True, "high") for s in seen)
        assert torch.get_float32_matmul_precision() == "medium"
    finally:
        torch.backends.cudnn.allow_tf32, prec = saved
        torch.set_float32_matmul_precision(prec)


# -- auto ----------------------------------------------------------------------------------


def test_auto_is_autograd_for_a_bare_product() -> None:
    model, data = mlp(), classification_data(n=4, batch=4)
    op = HessianOperator(model, data, SUP)
    op @ torch.randn(op.size, dtype=torch.float64)
    assert op.engine == "autograd"
    assert op.engine_report["auto"]["reason"] == "undecided"


def test_auto_keeps_autograd_on_a_short_run(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(engines_mod, "AUTO_MIN_RUN_MS", 1e12)  # any run is short: no timing noise
    monkeypatch.setattr(engines_mod, "TRACE_PRIOR_S_PER_MODULE", 1e9)
    model, data = mlp(), classification_data(n=4, batch=4)
    op = HessianOperator(model, data, SUP)
    res = lanczos(op, k=2, seed=0)
    report = op.engine_report["auto"]
    assert op.engine == "autograd" and report["reason"].startswith("short run")
    assert report["expected_products"] >= engines_mod.AUTO_MIN_PRODUCTS
    H = dense_hessian(model, data, SUP, select_parameters(model))
    top = torch.linalg.eigvalsh(H)
    top = top[top.abs().argsort(descending=True)][:2]
    torch.testing.assert_close(
        res.eigenvalues.abs().sort().values, top.abs().sort().values, rtol=1e-6, atol=1e-8
    )


def _judgements(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The product counts at which ``auto``'s selector is asked to decide, as they come."""
    judged: list[int] = []
    real = engines_mod.EngineSelector.before_block
    monkeypatch.setattr(
        engines_mod.EngineSelector,
        "before_block",
        lambda self, *a, **kw: judged.append(self.seen) or real(self, *a, **kw),
    )
    return judged


def test_auto_judges_a_bare_loop_as_it_goes(monkeypatch: pytest.MonkeyPatch) -> None:
    """NOTE [auto engine]: a loop that declares no budget is judged after AUTO_MIN_PRODUCTS
    products and at each doubling; "short run" verdicts are not final, a trial's is."""
    monkeypatch.setattr(engines_mod, "AUTO_MIN_RUN_MS", 1e12)  # every run short: no trial
    monkeypatch.setattr(engines_mod, "TRACE_PRIOR_S_PER_MODULE", 1e9)
    monkeypatch.setattr(engines_mod, "COMPILE_PRIOR_S", 1e9)  # never compile here
    model, data = mlp(), classification_data(n=4, batch=4)
    H = dense_hessian(model, data, SUP, select_parameters(model))
    op = HessianOperator(model, data, SUP)
    v = torch.randn(op.size, dtype=torch.float64)
    judged = _judgements(monkeypatch)
    for _ in range(40):
        torch.testing.assert_close(op @ v, H @ v, rtol=1e-10, atol=1e-10)
    assert judged == [8, 16, 32]
    assert op.engine == "autograd" and op.engine_report["auto"]["reason"].startswith("short run")
    assert op.engine_report["auto"]["expected_products"] == 32
    # the loop has gone on long enough: the next check runs the trial, whose verdict is final
    monkeypatch.setattr(engines_mod, "AUTO_MIN_RUN_MS", 0.0)
    for _ in range(40):
        torch.testing.assert_close(op @ v, H @ v, rtol=1e-10, atol=1e-10)
    assert judged == [8, 16, 32, 64]
    report = op.engine_report["auto"]
    assert report["reason"].startswith("measured faster")
    assert set(report["timings_ms"]) == {"autograd_first", "autograd", "functional"}
    assert op.engine == report["chosen"]
    # what the run learnt is kept for the next (NOTE [what auto remembers])
    facts = op._engines.facts()
    t = report["timings_ms"]
    assert facts["products"] == 64
    assert facts["functional_ratio"] == pytest.approx(t["functional"] / t["autograd"], rel=1e-2)
    # an engine given explicitly is never judged
    fixed = HessianOperator(model, data, SUP, engine="autograd")
    for _ in range(20):
        fixed @ v
    assert fixed._engines.next_check == float("inf") and judged == [8, 16, 32, 64]


def test_auto_does_not_judge_on_the_cold_first_product(monkeypatch: pytest.MonkeyPatch) -> None:
    """NOTE [auto engine]: a slow first product (here a sleep in the loss's first call, as a
    fresh process's first product is slow) does not send a short run into a trial: the run is
    sized from the operator's second product."""
    import time

    monkeypatch.setattr(engines_mod, "AUTO_MIN_RUN_MS", 2000.0)
    monkeypatch.setattr(engines_mod, "TRACE_PRIOR_S_PER_MODULE", 1e9)  # the threshold: 2 s
    model, data = mlp(), classification_data(n=4, batch=4)
    calls: list[int] = []

    def slow_first(m: nn.Module, batch: object) -> torch.Tensor:
        if not calls:
            time.sleep(0.5)
        calls.append(1)
        return SUP(m, batch)

    op = HessianOperator(model, data, slow_first)
    op.expect_products(10)  # 10 x 0.5 s would pass the threshold; 10 warm products do not
    v = torch.randn(op.size, dtype=torch.float64)
    H = dense_hessian(model, data, SUP, select_parameters(model))
    for _ in range(3):
        torch.testing.assert_close(op @ v, H @ v, rtol=1e-10, atol=1e-10)
    report = op.engine_report
    assert report["auto"]["reason"].startswith("short run"), report
    assert report["trial_products"] == 0 and op.engine == "autograd"
    assert report["auto"]["timings_ms"]["autograd_first"] < 200  # the second product's time


def test_auto_measures_and_chooses_on_a_long_run(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(engines_mod, "AUTO_MIN_RUN_MS", 0.0)
    monkeypatch.setattr(engines_mod, "COMPILE_PRIOR_S", 1e9)  # never compile here
    model, data = mlp(), classification_data(n=8, batch=4)
    op = HessianOperator(model, data, SUP)
    H = dense_hessian(model, data, SUP, select_parameters(model))
    op.expect_products(500)
    v = torch.randn(op.size, dtype=torch.float64)
    torch.testing.assert_close(op @ v, H @ v, rtol=1e-10, atol=1e-10)
    # the operator's first product is cold: nothing is judged on it (NOTE [auto engine])
    assert op.engine_report["auto"]["reason"] == "undecided" and op.num_passes == 2
    torch.testing.assert_close(op @ v, H @ v, rtol=1e-10, atol=1e-10)
    report = op.engine_report
    assert set(report["auto"]["timings_ms"]) == {"autograd_first", "autograd", "functional"}
    assert (
        report["auto"]["chosen"]
        == op.engine
        == min(("autograd", "functional"), key=report["auto"]["timings_ms"].get)
    )
    assert (
        report["trial_products"] >= 5
    )  # two more on autograd, three on functional: reported apart
    # the run's own first product (two batches); its second reuses the kept states; the trial's
    # passes are not counted
    assert op.num_passes == 2
    torch.testing.assert_close(op @ v, H @ v, rtol=1e-10, atol=1e-10)


def test_auto_compiles_when_it_pays_and_falls_back_on_failure(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def broken() -> object:
        def backend(gm: object, inputs: object) -> object:
            raise RuntimeError("injected inductor failure")

        return backend

    monkeypatch.setattr(engines_mod, "AUTO_MIN_RUN_MS", 0.0)
    monkeypatch.setattr(engines_mod, "COMPILE_PRIOR_S", 0.0)
    monkeypatch.setattr(engines_mod, "COMPILE_S_PER_NODE", 0.0)
    monkeypatch.setattr(engines_mod, "COMPILED_SAVING", 1.0)  # any measured time is worth saving
    monkeypatch.setattr(engines_mod, "recorded_compile_s", lambda prog, k: None)
    monkeypatch.setattr(_torch_compat, "compile_supported", lambda: True)
    monkeypatch.setattr(_torch_compat, "inductor_backend", broken)
    model, data = mlp(), classification_data(n=8, batch=4)
    op = HessianOperator(model, data, SUP)
    op.expect_products(10_000)
    H = dense_hessian(model, data, SUP, select_parameters(model))
    v = torch.randn(op.size, dtype=torch.float64)
    with pytest.warns(CompileFallbackWarning) as rec:
        out = op @ v
        out2 = op @ v
    assert len([w for w in rec if issubclass(w.category, CompileFallbackWarning)]) == 1
    torch.testing.assert_close(out, H @ v, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(out2, H @ v, rtol=1e-10, atol=1e-10)
    assert "compiled" in op.engine_report["auto"]["timings_ms"]


def test_auto_remembers_a_loops_length_and_the_engines_ratio(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """NOTE [what auto remembers]: a loop run again is judged as long as the last one (from its
    first product where the record holds a decision, measured at its second), and goes to the
    functional engine at the break-even without a second trial."""
    monkeypatch.setattr(engines_mod, "TRACE_PRIOR_S_PER_MODULE", 1e9)  # a first run: all short
    monkeypatch.setattr(engines_mod, "TRACE_IMPORT_PRIOR_S", 0.0)
    model, data = mlp(), classification_data(n=4, batch=4)
    H = dense_hessian(model, data, SUP, select_parameters(model))
    v = torch.randn(H.shape[0], dtype=torch.float64)
    first = HessianOperator(model, data, SUP)
    for _ in range(40):
        first @ v
    assert first.engine == "autograd"
    assert set(first._engines.facts()) == {"products", "autograd_ms"}
    assert first._engines.facts()["products"] == 32.0
    assert first._engines.facts()["autograd_ms"] > 0
    # an earlier trial found the functional engine at half autograd's time, a trace cheap; the
    # recorded product time is too small to pass the break-even, so the run is measured first
    first._engines.note_facts(functional_ratio=0.5, trace_s=1e-6, autograd_ms=1e-12)
    judged = _judgements(monkeypatch)
    again = HessianOperator(model, data, SUP)
    for _ in range(3):
        torch.testing.assert_close(again @ v, H @ v, rtol=1e-10, atol=1e-10)
    assert judged == [1, 2]  # the records, then (the first product being cold) the measurement
    report = again.engine_report
    assert again.engine == "functional"
    assert report["auto"]["expected_products"] == 32
    assert report["auto"]["expected_from"] == "this model's last run"
    assert report["auto"]["reason"].startswith("faster in this model's last trial")
    assert report["auto"]["functional_ratio"] == 0.5
    assert report["trial_products"] == 1  # one check of agreement, no timing runs
    assert set(report["auto"]["timings_ms"]) == {"autograd_first"}
    # the run noted its own product time: the next run decides before timing anything
    assert again._engines.facts()["autograd_ms"] == pytest.approx(
        report["auto"]["timings_ms"]["autograd_first"], abs=1e-3
    )
    # a ratio that says the functional engine was not faster: the first run's rule again
    first._engines.note_facts(functional_ratio=1.3, trace_s=1e6, products=32.0)
    third = HessianOperator(model, data, SUP)
    for _ in range(3):
        third @ v
    assert third.engine == "autograd"
    assert third.engine_report["auto"]["reason"].startswith("short run: expected products x")


def _count_autograd_states(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """A list that grows by one each time an autograd state is built (``AutogradRunner.prepare``)."""
    prepared: list[int] = []
    real = engines_mod.AutogradRunner.prepare
    monkeypatch.setattr(
        engines_mod.AutogradRunner,
        "prepare",
        lambda self, *a, **kw: prepared.append(1) or real(self, *a, **kw),
    )
    return prepared


def test_auto_decides_before_the_first_product_from_records(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """NOTE [what auto remembers]: with the trace time, the ratio and autograd's product time
    recorded, a declared run past the break-even is functional from its first product: no
    autograd pass, no timing, no check; a recorded time under the break-even is measured."""
    model, data = mlp(), classification_data(n=8, batch=4)
    H = dense_hessian(model, data, SUP, select_parameters(model))
    v = torch.randn(H.shape[0], dtype=torch.float64)
    seed = HessianOperator(model, data, SUP)
    # a trace of 1 s: 3000 products of 1 ms at half the time repay it, 10 do not, whatever this
    # machine's real product time (the measured rule then finds 10 products short too)
    seed._engines.note_facts(functional_ratio=0.5, trace_s=1.0, autograd_ms=1.0)
    prepared = _count_autograd_states(monkeypatch)
    op = HessianOperator(model, data, SUP)
    op.expect_products(3000)  # 3000 x 1 ms x (1 - 0.5) = 1.5 s saved against a 1 s trace
    for _ in range(3):
        torch.testing.assert_close(op @ v, H @ v, rtol=1e-10, atol=1e-10)
    report = op.engine_report
    assert op.engine == "functional" and not prepared
    assert report["trial_products"] == 0 and op.num_passes == 2  # the first product's two batches
    assert report["auto"]["reason"].endswith("decided before the first product")
    assert report["auto"]["timings_ms"] == {"autograd_recorded": 1.0}
    assert report["auto"]["functional_ratio"] == 0.5 and report["traces"] == 1
    # the real trace was recorded in its place; with a trace of 1 s again, 10 products save
    # 5 ms: measured as a first run would be
    assert seed._engines.facts()["trace_s"] == pytest.approx(report["trace_s"], abs=1e-3)
    seed._engines.note_facts(trace_s=1.0)
    short = HessianOperator(model, data, SUP)
    short.expect_products(10)
    for _ in range(3):
        torch.testing.assert_close(short @ v, H @ v, rtol=1e-10, atol=1e-10)
    assert short.engine == "autograd" and prepared
    assert "autograd_first" in short.engine_report["auto"]["timings_ms"]


def test_a_loop_run_again_is_decided_from_records_at_its_first_product(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """NOTE [what auto remembers]: a bare loop whose last run left all four facts goes to the
    functional engine at its first product: no autograd state is built, nothing is timed."""
    model, data = mlp(), classification_data(n=4, batch=4)
    H = dense_hessian(model, data, SUP, select_parameters(model))
    v = torch.randn(H.shape[0], dtype=torch.float64)
    seed = HessianOperator(model, data, SUP)
    seed._engines.note_facts(functional_ratio=0.5, trace_s=1e-6, autograd_ms=1.0, products=32.0)
    prepared = _count_autograd_states(monkeypatch)
    op = HessianOperator(model, data, SUP)
    for _ in range(3):
        torch.testing.assert_close(op @ v, H @ v, rtol=1e-10, atol=1e-10)
    report = op.engine_report
    assert op.engine == "functional" and not prepared
    assert report["trial_products"] == 0 and report["traces"] == 1
    assert report["auto"]["expected_from"] == "this model's last run"
    assert report["auto"]["expected_products"] == 32
    assert report["auto"]["reason"].endswith("decided before the first product")


def test_the_record_sizes_one_run_a_process(record_dir: Path) -> None:
    """NOTE [what auto remembers]: after a long run, fresh operators making one product each pay
    one trace that does not pay (the first, sized by the record), not one each; the file keeps
    the long run's count for the next process."""
    model, data = mlp(), classification_data(n=4, batch=4)
    H = dense_hessian(model, data, SUP, select_parameters(model))
    v = torch.randn(H.shape[0], dtype=torch.float64)
    seed = HessianOperator(model, data, SUP)
    key = seed._engines.structure()
    seed._engines.note_facts(functional_ratio=0.5, trace_s=1e-6, autograd_ms=1.0, products=32.0)
    engines = []
    for _ in range(3):
        op = HessianOperator(model, data, SUP)
        torch.testing.assert_close(op @ v, H @ v, rtol=1e-10, atol=1e-10)
        engines.append(op.engine)
    assert engines == ["functional", "autograd", "autograd"]
    assert TRACE_TIMES.facts(key)["products"] == 1.0
    TRACE_TIMES.clear()  # a new process: the file's count
    assert TRACE_TIMES.facts(key)["products"] == 32.0
    # a run counted at 8, 16, ... keeps its count, in the process and in the file
    op = HessianOperator(model, data, SUP)
    for _ in range(9):
        op @ v
    assert TRACE_TIMES.facts(key)["products"] == 8.0
    TRACE_TIMES.clear()
    assert TRACE_TIMES.facts(key)["products"] == 8.0


def test_a_first_product_makes_no_key_where_no_record_holds_a_decision(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A single ``op @ v`` stays as cheap as autograd's product where no run left a decision
    for a model like its own (``TraceTimes.any_decision``): its key is made at the second
    product."""
    made: list[int] = []
    real = engines_mod.structure_key
    monkeypatch.setattr(
        engines_mod, "structure_key", lambda *a: made.append(1) or real(*a)
    )
    model, data = mlp(), classification_data(n=4, batch=4)
    op = HessianOperator(model, data, SUP)
    v = torch.randn(op.size, dtype=torch.float64)
    hint = op._engines.hint()
    full = {"functional_ratio": 0.5, "trace_s": 1e-3, "autograd_ms": 1.0, "products": 32.0}
    # a decision for another model (another hint), and one without a ratio (a run that never
    # ran a trial) for a model like this one, are no reason to look
    TRACE_TIMES.note_facts("another model", hint=hint + "x", **full)
    TRACE_TIMES.note_facts("this kind", hint=hint, **{**full, "functional_ratio": 1.0})
    op @ v
    assert not made and op.engine == "autograd"
    op @ v
    assert made
    # a decision for a model like this one: the first product looks up its own key
    TRACE_TIMES.note_facts("this kind", functional_ratio=0.5)
    made.clear()
    HessianOperator(model, data, SUP) @ v
    assert made
    # the hint tells models apart by class, parameters and curvature
    ggn = GGNOperator(model, data, lambda m, b: m(b[0]), supervised_loss_of_output(CE))
    wider = HessianOperator(mlp(hidden=9), data, SUP)
    assert len({hint, ggn._engines.hint(), wider._engines.hint()}) == 3


def test_auto_from_records_falls_back_when_the_functional_engine_fails(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    model, data = mlp(), classification_data(n=4, batch=4)
    H = dense_hessian(model, data, SUP, select_parameters(model))
    v = torch.randn(H.shape[0], dtype=torch.float64)
    seed = HessianOperator(model, data, SUP)
    seed._engines.note_facts(functional_ratio=0.5, trace_s=0.01, autograd_ms=1.0)

    def broken(self: object, *a: object, **kw: object) -> object:
        raise RuntimeError("injected trace failure")

    monkeypatch.setattr(engines_mod.FunctionalRunner, "prepare", broken)
    op = HessianOperator(model, data, SUP)
    op.expect_products(100)
    torch.testing.assert_close(op @ v, H @ v, rtol=1e-10, atol=1e-10)
    assert op.engine == "autograd"
    assert "injected trace failure" in op.engine_report["auto"]["reason"]
    torch.testing.assert_close(op @ v, H @ v, rtol=1e-10, atol=1e-10)


def test_auto_times_no_product_that_records_a_cuda_graph() -> None:
    """Where the second product on a kept state records a CUDA graph, ``auto`` times the third
    (NOTE [auto engine])."""
    model, data = mlp(), classification_data(n=4, batch=4)
    op = HessianOperator(model, data, SUP)
    op.expect_products(10_000)
    v = torch.randn(op.size, dtype=torch.float64)
    op @ v
    sel = op._engines
    V = v[None].clone()
    out = torch.empty_like(V)

    def decide() -> bool:
        sel.seen += 1
        return sel.before_block(
            V,
            out,
            product=op._rows,
            keeps_states=True,
            on_switch=op.clear_cache,
            counts=op.counts,
            cold=2,
        )

    assert not decide() and sel.auto.reason == "undecided"  # the second: a recording
    assert decide() and "autograd_first" in sel.auto.timings_ms  # the third is timed


def test_auto_expects_torch_funcs_first_import(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch._dynamo  # noqa: F401 - imported, as after any trace

    model, data = mlp(), classification_data(n=4, batch=4)
    op = HessianOperator(model, data, SUP)
    ms, why = op._engines.trace_estimate_ms()
    monkeypatch.delitem(sys.modules, "torch._dynamo")
    ms_fresh, why_fresh = op._engines.trace_estimate_ms()
    assert ms_fresh == pytest.approx(ms + engines_mod.TRACE_IMPORT_PRIOR_S * 1e3)
    assert why_fresh == why + ", and torch.func's first import"


def test_auto_distrusts_a_traced_product_that_disagrees(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(engines_mod, "AUTO_MIN_RUN_MS", 0.0)
    model, data = mlp(), classification_data(n=4, batch=4)

    class Wrong(HessianOperator):
        # the selector takes the product when the operator is built: a subclass's, here
        def functional_product(self, state, batch, tangent):  # type: ignore[no-untyped-def]
            return [2 * t for t in super().functional_product(state, batch, tangent)]

    op = Wrong(model, data, SUP)
    op.expect_products(500)
    H = dense_hessian(model, data, SUP, select_parameters(model))
    v = torch.randn(op.size, dtype=torch.float64)
    op @ v  # the operator's first product: cold, never judged (NOTE [auto engine])
    with pytest.warns(engines_mod.EngineMismatchWarning):
        out = op @ v
    torch.testing.assert_close(out, H @ v, rtol=1e-10, atol=1e-10)
    assert op.engine == "autograd"


# -- the split itself ----------------------------------------------------------------------


def test_split_by_tangent_separates_primal_work() -> None:
    from torch.fx.experimental.proxy_tensor import make_fx

    def f(x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        a = torch.sin(x) * torch.exp(x)  # primal only
        return a * t + torch.cos(x) * t * t

    x, t = torch.randn(4, dtype=torch.float64), torch.randn(4, dtype=torch.float64)
    gm = make_fx(f)(x, t)
    primal, tangent, num_kept = split_by_tangent(gm, 1)
    kept = primal(x)
    assert len(kept) == num_kept
    torch.testing.assert_close(tangent(*kept, t), f(x, t))
    ops = {str(n.target) for n in tangent.graph.nodes if n.op == "call_function"}
    assert not any("sin" in o or "exp" in o or "cos" in o for o in ops), ops


def test_written_programs_equal_their_fx_graphs_and_free_what_they_no_longer_read() -> None:
    """NOTE [programs written directly]: the Python a program is written as computes what its FX
    graph computes, counts the graph's nodes, and deletes every value it makes after its last
    read (what FX's code frees); odd arguments (a keyword that Python reserves, infinities,
    dtypes, sizes) pass through."""
    from hessian_eigenthings.operators.engines import tracing as tracing_mod

    def f(x: torch.Tensor, t: torch.Tensor) -> list[torch.Tensor]:
        a = torch.sin(x) * torch.exp(x)
        m, _ = torch.max(a.view(2, 2), dim=1)  # a multi-output op: one output picked, one not
        c = (
            torch.clamp(a * t, min=-float("inf"), max=3.0)
            .to(torch.float32)
            .reshape(torch.Size([4]))
        )
        return [c.double() + t * t, m.sum() * t]

    x, t = torch.randn(4, dtype=torch.float64), torch.randn(4, dtype=torch.float64)
    rec = recorder.record_real(f, x, t)
    primal, tangent, num_kept = tracing_mod.split_recording(rec, 1)
    for prog in (primal, tangent):
        assert prog.num_nodes == len(prog.graph.nodes)
    kept = primal(x)
    assert len(kept) == num_kept
    for a, b in zip(tangent(*kept, t), tangent.module(*kept, t), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    torch.testing.assert_close(list(tangent(*kept, t)), f(x, t))
    import re

    name = re.compile(r"\b[av]\d+(?:_\d+)?\b")
    for prog in (primal, tangent):
        text = prog.code.splitlines()
        lines = [
            ln.strip()
            for ln in text[next(i for i, ln in enumerate(text) if ln.startswith("def ")) + 1 :]
        ]
        returned = set(name.findall(lines[-1]))
        made = [ln.split(" = ")[0] for ln in lines if " = " in ln]
        dels = {n: ln[4:].split(", ") for n, ln in enumerate(lines) if ln.startswith("del ")}
        deleted = [v for vs in dels.values() for v in vs]
        assert sorted(deleted) == sorted(v for v in made if v not in returned), prog.code
        for n, vs in dels.items():  # right after the last line that reads (or makes) each value
            for v in vs:
                uses = [k for k, ln in enumerate(lines) if k not in dels and v in name.findall(ln)]
                assert max(uses) == n - 1, (v, prog.code)

    # the text (the program's key) tells apart programs that differ only in an op or a dtype
    def g(op: str, dtype: torch.dtype) -> object:
        return lambda x: getattr(torch, op)(x).to(dtype)

    codes = {
        tracing_mod.split_recording(recorder.record_real(g(op, dt), x), 1)[0].code
        for op in ("sin", "cos")
        for dt in (torch.float32, torch.float16)
    }
    assert len(codes) == 4
    # a keyword Python reserves, as a function recorded by another tracer may carry
    odd = recorder.Recording(1)
    odd.ops.append(
        (lambda a, **kw: a + kw["from"], (odd.inputs[0],), {"from": 2.0}, [odd.inputs[0]])
    )
    odd.outputs = [recorder.Ref("op", 0)]
    odd.sequence = False
    live = [True]
    part = tracing_mod.Part(odd, nn.Module(), live, [(odd.inputs[0], "x")], odd.outputs, False)
    prog = tracing_mod.Program(part)
    torch.testing.assert_close(prog(x), x + 2.0)


def test_a_trace_leaves_the_cycle_collector_as_found(monkeypatch: pytest.MonkeyPatch) -> None:
    import gc

    from hessian_eigenthings.operators.engines import tracing

    model, data = mlp(), classification_data(n=4, batch=4)
    assert gc.get_freeze_count() == 0 and gc.isenabled()
    seen: list[bool] = []
    record = tracing.trace_real

    def watched(fn: object, args: object) -> object:
        seen.append(gc.isenabled())
        return record(fn, args)  # type: ignore[arg-type]

    monkeypatch.setattr(tracing, "trace_real", watched)
    op = HessianOperator(model, data, SUP, engine="functional")
    op @ torch.randn(op.size, dtype=torch.float64)
    monkeypatch.undo()
    assert seen == [False]  # no collection during the trace (NOTE [the collector during a trace])
    assert gc.get_freeze_count() == 0 and gc.isenabled()
    # a process that disabled the collector keeps it disabled
    gc.disable()
    try:
        op = HessianOperator(model, data, SUP, engine="functional")
        op @ torch.randn(op.size, dtype=torch.float64)
        assert not gc.isenabled()
    finally:
        gc.enable()
    # a process that froze objects of its own keeps them frozen
    gc.freeze()
    try:
        frozen = gc.get_freeze_count()
        op = HessianOperator(model, data, SUP, engine="functional")
        op @ torch.randn(op.size, dtype=torch.float64)
        assert gc.get_freeze_count() > frozen // 2  # frozen objects may die, none are unfrozen
    finally:
        gc.unfreeze()


def test_no_warning_filter_is_left_behind() -> None:
    model, data = mlp(), classification_data(n=4, batch=4)
    filters = list(warnings.filters)
    op = HessianOperator(model, data, SUP, engine="functional")
    op @ torch.randn(op.size, dtype=torch.float64)
    assert list(warnings.filters) == filters


def _reads_a_parameter(model: nn.Module, batch: object) -> torch.Tensor:
    # Python reads a parameter's value: the program is traced per batch with it baked in
    # (detached: torch 2.13 warns on float() of a tensor that requires grad, once per process)
    scale = 1.0 + abs(float(model[0].bias.detach().sum()))  # type: ignore[index]
    return scale * SUP(model, batch)


def test_a_program_specialized_to_a_batch_is_retraced_when_a_parameter_changes() -> None:
    model, data = mlp(), classification_data(n=4, batch=4)
    op = HessianOperator(model, data, _reads_a_parameter, engine="functional", graph_reuse=False)
    ref = HessianOperator(model, data, _reads_a_parameter, engine="autograd", graph_reuse=False)
    v = torch.randn(op.size, dtype=torch.float64)
    torch.testing.assert_close(op @ v, ref @ v, rtol=1e-10, atol=1e-12)
    op @ v
    assert op.engine_report["traces"] == 1  # unchanged batch and model: the program is reused
    with torch.no_grad():
        model[0].bias.add_(0.5)  # type: ignore[index]
    torch.testing.assert_close(op @ v, ref @ v, rtol=1e-10, atol=1e-12)
    assert op.engine_report["traces"] == 2


@compile_only
def test_compilations_are_bounded_per_operator(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(compiled_mod, "MAX_COMPILATIONS", 1)
    model, data = mlp(), classification_data(n=10, batch=4)  # two batch signatures
    op = HessianOperator(model, data, SUP, engine="compiled")
    H = dense_hessian(model, data, SUP, select_parameters(model))
    v = torch.randn(op.size, dtype=torch.float64)
    with pytest.warns(CompileFallbackWarning, match="1 compilations already"):
        out = op @ v
    torch.testing.assert_close(out, H @ v, rtol=1e-10, atol=1e-10)
    assert op.engine_report["compilations"] == 1 and op.engine_report["fallbacks"] == 1


# -- losses whose backward has no usable forward-mode rule ------------------------------


REGRESSION_LOSSES = {
    "mse": nn.MSELoss(),
    "mse_sum": nn.MSELoss(reduction="sum"),
    "huber": nn.HuberLoss(delta=0.5),
    "soft_margin": None,  # targets in {-1, 1}, below
}


@pytest.mark.parametrize("name", list(REGRESSION_LOSSES))
def test_regression_losses_trace_without_forward_mode_rules(name: str) -> None:
    """NOTE [losses without forward-mode rules]: mse_loss's backward has a broken forward-mode
    rule in torch 2.13 (tracing it crashed the process), huber's and soft margin's have none.
    Every traced engine computes them elementwise while tracing: same values as the oracle, and
    the user's torch functions are as they were afterwards."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()
    X = torch.randn(10, 3, dtype=torch.float64)
    Y = torch.randn(10, 2, dtype=torch.float64)
    crit = REGRESSION_LOSSES[name]
    if crit is None:
        crit, Y = nn.SoftMarginLoss(), Y.sign()
    data = [(X[:6], Y[:6]), (X[6:], Y[6:])]
    loss = supervised_loss(crit)
    op = HessianOperator(model, data, loss, engine="functional")
    with warnings.catch_warnings():  # the oracle's batched backward: torch's batching-rule notice
        warnings.filterwarnings("ignore", message=".*batching rule", category=UserWarning)
        dense = dense_hessian(model, data, loss, select_parameters(model))
        dense_g = dense_ggn(
            model,
            data,
            supervised_forward,
            supervised_loss_of_output(crit),
            select_parameters(model),
        )
    check_contract(op, dense, model)
    closed_form = isinstance(crit, nn.MSELoss)
    ggn = GGNOperator(
        model,
        data,
        supervised_forward,
        supervised_loss_of_output(crit),
        engine="functional",
        loss_hvp="analytical" if closed_form else "autograd",
    )
    check_contract(ggn, dense_g, model)
    assert torch.overrides._get_current_function_mode() is None
    assert nn.functional.mse_loss(torch.ones(2), torch.zeros(2)).item() == 1.0


def test_legacy_loss_arguments_keep_torchs_own_loss() -> None:
    """A legacy ``size_average``/``reduce`` argument is not rewritten (torch's own code runs)."""
    mode = ElementwiseLosses()
    a, b = torch.randn(4, 3), torch.randn(4, 3)
    with mode:
        torch.testing.assert_close(nn.functional.mse_loss(a, b), ((a - b) ** 2).mean())
        torch.testing.assert_close(
            nn.functional.huber_loss(a, b, delta=0.3), nn.functional.huber_loss(a, b, delta=0.3)
        )
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # torch's deprecation of size_average
            torch.testing.assert_close(
                nn.functional.mse_loss(a, b, size_average=False), ((a - b) ** 2).sum()
            )


def _reads_the_batch(model: nn.Module, batch: object) -> torch.Tensor:
    # Python reads a value of the batch only: the program is traced per batch, and stays
    # valid when the parameters change (NOTE [what a specialized program read])
    x, _ = batch  # type: ignore[misc]
    scale = 1.0 + float(x.abs().max())
    return scale * SUP(model, batch)


@pytest.mark.parametrize("reuse", [True, False])
def test_a_program_that_read_only_the_batch_survives_parameter_changes(reuse: bool) -> None:
    model, data = mlp(), classification_data(n=4, batch=4)
    op = HessianOperator(model, data, _reads_the_batch, engine="functional", graph_reuse=reuse)
    v = torch.randn(op.size, dtype=torch.float64)
    for _ in range(3):
        H = dense_hessian(model, data, _reads_the_batch, select_parameters(model))
        torch.testing.assert_close(op @ v, H @ v, rtol=1e-10, atol=1e-12)
        with torch.no_grad():
            model[0].weight.mul_(1.3)  # type: ignore[index]
    assert op.engine_report["traces"] == 1
    # a new batch (other values) is traced anew
    data[0] = (data[0][0] * 2, data[0][1])
    H = dense_hessian(model, data, _reads_the_batch, select_parameters(model))
    torch.testing.assert_close(op @ v, H @ v, rtol=1e-10, atol=1e-12)
    assert op.engine_report["traces"] == 2


class _ReadsAShape(nn.Module):
    """Python reads a value built from the batch's shape alone (as HF GPT-2's mask code does
    with positions from ``arange``): the program stays general."""

    def __init__(self) -> None:
        super().__init__()
        self.body = mlp()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(x.shape[0])
        if bool((positions[-1:] == 0).all()):  # a host read of a value no input feeds
            x = x * 0
        return self.body(x)


def test_a_value_read_that_no_input_feeds_keeps_the_program_general() -> None:
    """NOTE [tangent split]: one trace serves every batch of a signature when the values Python
    read depend on no input; a read of the batch makes the program that batch's own."""
    model = _ReadsAShape().double()
    data = classification_data(n=12, batch=4)  # three batches, one signature
    op = HessianOperator(model, data, SUP, engine="functional")
    v = torch.randn(op.size, dtype=torch.float64)
    H = dense_hessian(model, data, SUP, select_parameters(model))
    torch.testing.assert_close(op @ v, H @ v, rtol=1e-10, atol=1e-12)
    assert op.engine_report["traces"] == 1
    per_batch = HessianOperator(mlp(), data, _reads_the_batch, engine="functional")
    H = dense_hessian(per_batch.model, data, _reads_the_batch, select_parameters(per_batch.model))
    torch.testing.assert_close(per_batch @ v, H @ v, rtol=1e-10, atol=1e-12)
    assert per_batch.engine_report["traces"] == 3


# -- recording a trace (NOTE [recording a trace]) -------------------------------------------


def _tiny_gpt2() -> tuple[nn.Module, list[dict[str, torch.Tensor]]]:
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(
        n_layer=2, n_embd=8, n_head=2, vocab_size=13, n_positions=16, bos_token_id=0,
        eos_token_id=0, attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0,
    )  # fmt: skip
    model = transformers.GPT2LMHeadModel(cfg).double().eval()
    return model, [{"input_ids": torch.randint(0, 13, (2, 6))}]


def _hf_lm_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return lm_loss(lambda ids: model(input_ids=ids, use_cache=False).logits, batch)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "case", ["mlp_hessian", "cnn_ggn", "transformer_hessian", "gpt2_hessian", "gpt2_ggn"]
)
def test_recorded_programs_equal_make_fx_programs(
    case: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The recorder and make_fx trace the same product into programs that compute the same
    numbers, for every direction; the recorded ones leave out ops nothing needs."""
    from hessian_eigenthings.loss_fns import hf_lm_forward, hf_lm_loss_of_output
    from hessian_eigenthings.operators.engines import FunctionalRunner
    from hessian_eigenthings.operators.engines import tracing as tracing_mod

    if case == "mlp_hessian":
        model, data = mlp(), classification_data(n=4, batch=4)
        op = HessianOperator(model, data, SUP)
    elif case == "cnn_ggn":
        model = SmallCNN().double().eval()  # batch statistics are not traced
        data = [(torch.randn(3, 2, 4, 4, dtype=torch.float64), torch.randint(0, 4, (3,)))]
        op = GGNOperator(model, data, supervised_forward, CE_OUT)
    elif case == "transformer_hessian":
        model = TinyTransformer().double()
        data = [{"input_ids": torch.randint(0, 11, (2, 5))}]
        op = HessianOperator(model, data, lm_loss)
    else:
        model, data = _tiny_gpt2()
        if case == "gpt2_hessian":
            op = HessianOperator(model, data, _hf_lm_loss)
        else:
            op = GGNOperator(model, data, hf_lm_forward(), hf_lm_loss_of_output())
    batch = op._engine_batch(data[0])
    programs = {}
    for tracer in ("make_fx", "record"):
        monkeypatch.setattr(tracing_mod, "TRACER", tracer)
        runner = FunctionalRunner(model, op.params, op.functional_product)
        with _torch_compat.math_sdpa():  # as the operator's guard runs a traced engine
            programs[tracer] = (runner, runner._tracer.trace(batch, general=True))
    for _ in range(2):
        v = [torch.randn_like(p) for p in op.params]
        outs = []
        for runner, prog in programs.values():
            with torch.no_grad():
                kept = prog.primal(*runner._tracer.primal_inputs(batch, prog))
                outs.append(prog.tangent(*kept, *v))
        for a, b in zip(*outs, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)
    recorded, traced = programs["record"][1], programs["make_fx"][1]
    assert recorded.general and traced.general
    size = {
        k: sum(1 for n in p.tangent.graph.nodes if n.op == "call_function")
        for k, (_, p) in programs.items()
    }
    assert size["record"] <= size["make_fx"], size


def test_recording_refuses_a_constant_that_aliases_an_input() -> None:
    """A tensor the function reads that no recorded op made, sharing an input's storage, would
    bake that input's present values into the program: recording refuses, make_fx traces."""
    from hessian_eigenthings.operators.engines import tracing as tracing_mod

    x = torch.randn(4, dtype=torch.float64)
    view = x[:2]  # made before recording: a constant of the graph, aliasing the input

    def f(a: torch.Tensor) -> torch.Tensor:
        return a * 2 + view.sum()

    with pytest.raises(recorder.RecordingError, match="shares storage"):
        recorder.record_real(f, x)
    assert not _torch_compat.tracing()  # recording is over, even after an error
    rec = tracing_mod.trace_real(f, [x])  # make_fx instead
    gm = tracing_mod.to_graph_module(rec)
    torch.testing.assert_close(gm(x)[0] if isinstance(gm(x), tuple) else gm(x), f(x))


def test_code_that_writes_outside_the_dispatcher_sees_tracing() -> None:
    seen = []

    def f(a: torch.Tensor) -> torch.Tensor:
        seen.append(_torch_compat.tracing())
        return a + 1

    recorder.record_real(f, torch.ones(2))
    assert seen == [True] and not _torch_compat.tracing()
