"""``auto``'s choice as a pure function (DESIGN §8): rows of facts, run length and timings, each
with the engine, the step and the reason ``decide`` must give (every branch of NOTE [auto engine]
and NOTE [what auto remembers]); and the reports recorded in ``benchmarks/results`` replayed."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import FrozenInstanceError

import pytest

from benchmarks.replay_auto import replay, reports
from hessian_eigenthings.operators.engines import auto
from hessian_eigenthings.operators.engines.policy import (
    DEFAULT_POLICY,
    AutoPolicy,
    Facts,
    decide,
    trace_estimate_ms,
)

# a model whose last run recorded everything (NOTE [what auto remembers]): functional at half
# autograd's time, a 1 ms trace, autograd at 1 ms a product
KNOWN = {"functional_ratio": 0.5, "trace_s": 0.001, "autograd_ms": 1.0}
NO_COMPILE = {"compile_supported": False}
# 5 leaf modules, second order, torch.func loaded: a 0.03 s trace expected
FRESH = Facts(leaf_modules=5)
REFUSED = "batches are not kept between products (no state for a traced engine to reuse)"

ROWS: list[tuple[str, Facts, int, Mapping[str, float], str, str, str]] = [
    # (id, facts, expected products, timings, engine, step, reason starts with)
    ("few products", FRESH, 7, {}, "autograd", "later", "few products expected"),
    ("few products, even when known", Facts(recorded=KNOWN, first_look=True), 4, {},
     "autograd", "later", "few products expected"),
    ("enough: time the run's own product", FRESH, 8, {}, "autograd", "time first", "undecided"),
    ("refused: autograd, final", Facts(refusal=REFUSED), 100, {}, "autograd", "keep", REFUSED),
    # decided before the first product from the records
    ("records decide", Facts(recorded=KNOWN, first_look=True, **NO_COMPILE), 100, {},
     "functional", "adopt", "faster in this model's last trial (functional/autograd 0.50), at "
     "its recorded product time: decided before the first product"),
    ("records read at the first look only", Facts(recorded=KNOWN, **NO_COMPILE), 100, {},
     "autograd", "time first", "undecided"),
    ("records: the break-even not reached", Facts(recorded={**KNOWN, "trace_s": 1.0},
     first_look=True, **NO_COMPILE), 100, {},
     "autograd", "time first", "undecided"),
    ("records: a ratio of 1 or more", Facts(recorded={**KNOWN, "functional_ratio": 1.3},
     first_look=True, **NO_COMPILE), 100, {}, "autograd", "time first", "undecided"),
    ("records: one fact missing", Facts(recorded={"functional_ratio": 0.5, "trace_s": 0.001},
     first_look=True, **NO_COMPILE), 100, {}, "autograd", "time first", "undecided"),
    ("records: compiling may pay", Facts(recorded={**KNOWN, "autograd_ms": 100.0},
     first_look=True), 1000, {}, "autograd", "time first", "undecided"),
    ("records, but refused", Facts(recorded=KNOWN, first_look=True, refusal=REFUSED,
     **NO_COMPILE), 100, {}, "autograd", "keep", REFUSED),
    # the run's own product timed: short run or trial (NOTE [auto engine])
    ("short run at the payback", FRESH, 100, {"autograd_first": 0.5}, "autograd", "later",
     "short run: expected products x product time under 3 x the trace's expected 0.03 s"),
    ("long enough: trial", FRESH, 100, {"autograd_first": 1.0}, "autograd", "trial", "long"),
    ("short run at the recorded break-even", Facts(recorded={"functional_ratio": 0.5,
     "trace_s": 1.0}), 100, {"autograd_first": 1.0}, "autograd", "later",
     "short run: expected saving at the last run's functional/autograd ratio 0.50 under the "
     "trace's expected 1 s"),
    ("a ratio of 1 or more: the payback rule", Facts(recorded={"functional_ratio": 1.3,
     "trace_s": 0.001}), 100, {"autograd_first": 0.001}, "autograd", "later",
     "short run: expected products x product time under 3 x"),
    ("recorded ratio, compiling cannot pay: one check", Facts(recorded=KNOWN, **NO_COMPILE),
     100, {"autograd_first": 1.0}, "functional", "check",
     "faster in this model's last trial (functional/autograd 0.50)"),
    ("recorded ratio, compiling may pay: trial", Facts(recorded=KNOWN), 100_000,
     {"autograd_first": 1.0}, "autograd", "trial", "long"),
    # the trial's timings (per pass of one row)
    ("trial: functional faster, nothing to compile", Facts(compile_supported=False), 100,
     {"autograd": 2.0, "functional": 1.0}, "functional", "keep", "measured faster"),
    ("trial: a tie keeps autograd", Facts(compile_supported=False), 100,
     {"autograd": 1.0, "functional": 1.0}, "autograd", "keep", "measured faster"),
    ("trial: compiling would not pay", Facts(programs=((None, 100),)), 100,
     {"autograd": 2.0, "functional": 1.0}, "functional", "keep",
     "measured faster; compiling would not pay"),
    ("trial: compiling may pay", Facts(programs=((1.0, 100),)), 100_000,
     {"autograd": 2.0, "functional": 1.0}, "functional", "time compiled", "compiling may pay"),
    ("compiled faster", Facts(programs=((1.0, 100),)), 100_000,
     {"autograd": 2.0, "functional": 1.0, "compiled": 0.5}, "compiled", "keep",
     "expected saving exceeds the compile time"),
    ("compiled not faster", Facts(programs=((1.0, 100),)), 100_000,
     {"autograd": 2.0, "functional": 1.0, "compiled": 1.5}, "functional", "keep",
     "measured faster; compiling would not pay"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("facts", "n", "timings", "engine", "step", "reason"),
    [pytest.param(*row[1:], id=row[0]) for row in ROWS],
)
def test_decide(
    facts: Facts, n: int, timings: Mapping[str, float], engine: str, step: str, reason: str
) -> None:
    d = decide(facts, n, timings)
    assert (d.engine, d.step) == (engine, step)
    assert d.reason.startswith(reason), d.reason


def test_decide_gives_the_figures_it_rests_on() -> None:
    d = decide(Facts(recorded=KNOWN, first_look=True, compile_supported=False), 100, {})
    assert (d.trace_estimate_s, d.trace_estimate_from) == (0.001, "this model's last trace")
    assert (d.functional_ratio, d.recorded_autograd_ms) == (0.5, 1.0)
    d = decide(FRESH, 100, {"autograd_first": 1.0})
    assert d.trace_estimate_s == pytest.approx(0.03) and d.functional_ratio is None
    d = decide(Facts(programs=((None, 100), (2.0, 7))), 100, {"autograd": 2.0, "functional": 1})
    assert d.compile_estimate_s == pytest.approx(8.0 + 0.008 * 100 + 2.0)


def test_the_compile_rule_counts_the_products_after_the_trial() -> None:
    """Compiling pays when the products left after the trial's save more than it costs."""
    timings = {"autograd": 2.0, "functional": 1.0}  # compiled saves 0.2 ms a product
    facts = Facts(programs=((1.0, 0),))  # a 1 s compile: 5000 products repay it
    assert decide(facts, 5000 + 7, timings).step == "keep"
    assert decide(facts, 5000 + 8, timings).step == "time compiled"
    wide = Facts(programs=((1.0, 0),), trial_rows=4)
    assert decide(wide, 4 * 5000 + 28, timings).step == "keep"


@pytest.mark.parametrize(
    ("facts", "ms", "why"),
    [
        (Facts(functional=False), 20_000.0, "no functional engine"),
        (Facts(recorded={"trace_s": 0.25}), 250.0, "this model's last trace"),
        (Facts(recorded={"trace_s": 1e6}), 20_000.0, "this model's last trace"),
        (Facts(leaf_modules=5), 30.0, "prior: 5 leaf modules"),
        (Facts(leaf_modules=0), 6.0, "prior: 0 leaf modules"),
        (
            Facts(leaf_modules=5, first_order=True),
            12.0,
            "prior: 5 leaf modules (first derivatives)",
        ),
        (
            Facts(leaf_modules=5, torch_func_loaded=False),
            630.0,
            "prior: 5 leaf modules, and torch.func's first import",
        ),
    ],
)
def test_trace_estimate(facts: Facts, ms: float, why: str) -> None:
    got_ms, got_why = trace_estimate_ms(facts)
    assert got_ms == pytest.approx(ms) and got_why == why


def test_policy_is_frozen_and_the_selector_reads_the_module_constants(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with pytest.raises(FrozenInstanceError):
        DEFAULT_POLICY.min_products = 2  # type: ignore[misc]
    assert auto.current_policy() == AutoPolicy()
    monkeypatch.setattr(auto, "AUTO_MIN_RUN_MS", 5.0)
    assert auto.current_policy() == AutoPolicy(min_run_ms=5.0)


def test_recorded_reports_replay_to_the_same_choice() -> None:
    """Each ``auto`` report in ``benchmarks/results`` made by today's rules: ``decide`` on the
    facts it shows gives its engine and reason."""
    kinds: dict[str, int] = {}
    for path, report in reports():
        kind, detail = replay(report)
        assert kind != "differs", (str(path), report["reason"], detail)
        kinds[kind] = kinds.get(kind, 0) + 1
    assert kinds.get("same", 0) >= 300, kinds
