"""``engine="auto"``'s choice as a pure function of what is known (DESIGN §8).

:func:`decide` takes the facts the selector gathered (what earlier runs recorded of this model
and curvature, what the model and the operator allow), the run's expected length and the timings
measured so far, and returns a :class:`Decision`: the engine products run on, why, the figures
behind it, and what the selector does next (keep it, judge again later, or measure something).
It reads no file, no clock and no tensor; :class:`~.auto.EngineSelector` does those, and every
other side effect (timing trials, switching runners, recording facts). The tuned constants are
one frozen :class:`AutoPolicy`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

# NOTE [auto engine]
# `engine="auto"` decides per operator, from measurement, once the operator
# knows how many products are coming (algorithms declare their budget with
# `op.expect_products(n)`; a bare `op @ v` assumes few):
# - fewer than AUTO_MIN_PRODUCTS expected: "autograd" (nothing is traced);
# - otherwise, at the operator's second product (its first is cold: the
#   allocator, kernels and library handles warm up, and it builds the graph
#   later products reuse; the first product of issue 27's 0.x script in a
#   fresh process took 394 ms on one H100 and over 667 ms on another, which
#   sent a 30-product run into a trial it never repaid, and made its time
#   bimodal; where products on a kept state are recorded as CUDA graphs, at
#   the third, since the second records: on an H200 the MLP's second product
#   took 3-5 ms against 0.8 ms replayed, and sent Hessian runs whose engines
#   are equally fast into trials): a "short run" — expected products × that product's time under
#   AUTO_TRACE_PAYBACK × what a trace is expected to cost — stays on
#   "autograd" (a trial that finds nothing faster then costs at most about a
#   third more than the run would have cost without it); the expected
#   trace cost is this model's last trace time (NOTE [trace times], kept
#   across processes), else TRACE_PRIOR_S_PER_MODULE per leaf module, at most
#   AUTO_MIN_RUN_MS (a 5-module MLP expects 0.08 s, not 20 s: its bare loops
#   of 1000 GGN products stayed on a path 1.5-4x slower than the traced one);
# - a longer run: the first kept batch is timed on
#   "autograd" and "functional"
#   (two products each after a warm-up; the results of the timing runs are
#   the operator's own products, nothing is computed twice) and the faster
#   one is kept;
# - "compiled" only when expected products × the expected saving exceed the
#   expected compile time: a compile time recorded by an earlier run (NOTE
#   [compile policy]) or else a prior of COMPILE_PRIOR_S + COMPILE_S_PER_NODE
#   per node of the tangent graph (H100, torch 2.11: 11 s at 138 nodes, 31 s
#   at 1857, 36 s at 3922), and a saving of COMPILED_SAVING of the eager
#   tangent time (measured 0-36%, median ~22%).
# The choice and its figures are on `op.engine_report`.
# A run that declares nothing (a bare `op @ v` loop) is judged as it goes: after
# AUTO_MIN_PRODUCTS products, and again each time their number doubles, `auto`
# assumes as many more are coming as were made (a loop that has run n products
# is as likely to stop before n more as after) and decides as above. A "short
# run" verdict is not final, so a loop that keeps going reaches the trial once
# its products so far have taken about AUTO_TRACE_PAYBACK × the trace's
# expected cost; a trial's verdict is final. Each check costs one
# synchronised product; the loop pays at most about AUTO_TRACE_PAYBACK × the
# trace's expected cost on the slower engine before the trial (ski rental: a
# bounded multiple of what knowing its length would have cost, trace
# included, when the estimate is right).
# (The names in capitals are `auto`'s module constants, the fields of
# AutoPolicy: AUTO_MIN_PRODUCTS is `min_products`, and so on.)

# NOTE [what auto remembers]
# A first run cannot be within a few percent of the best engine at every
# length of a loop that declares none: a trace is a fixed price paid before
# the faster products, so whichever product count `auto` switches at, a loop
# that stops soon after loses (the ski-rental bound; on the GPU MLP's GGN, a
# product of 2.1 ms on autograd against 0.5 ms traced and a trace of about
# 20 ms, no switching point keeps both the 20- and the 100-product loop
# within 40% of the best). What a run learns therefore goes into the record
# of NOTE [trace times], beside the trace's time, under the same key:
# - `functional_ratio`: the functional engine's product time over autograd's,
#   as the last trial measured it. With it, a run is long enough for the
#   functional engine at the break-even (expected products × autograd's
#   product time × (1 − ratio) over the trace's expected cost), not at
#   AUTO_TRACE_PAYBACK × the trace, and no second trial is run where
#   compiling cannot pay: one functional product is checked against the
#   autograd product of the same direction, and kept if they agree;
# - `products`: how many products an `auto` operator of this model had made
#   when last counted (at 8, 16, 32, ... products). A run that declares no
#   length is judged at its second product as if it declared that many, so
#   a script run again switches at once instead of after its first doublings;
#   at its first product already where the record holds a decision for a
#   model like its own (all four facts under its hint: the model's class,
#   parameter count and sizes, the curvature; `TraceTimes.any_decision`, a
#   look that makes no key), so that a rerun decided from records builds no
#   autograd state, and a single product of another model stays as cheap (on
#   the H200 MLP's GGN, a 20-product loop run again took 34 ms against 28 ms
#   on the functional engine, 5 ms of it the autograd first product). The
#   record sizes one run a process: the process's own count of that run
#   (what it had made when sized, then 8, 16, ...) sizes the operators after
#   it, so a script that runs a long Lanczos and then one `op @ v` a step on
#   fresh operators pays one trace that does not pay, not one a step (a
#   count written when an operator is deleted was tried and dropped: a
#   finalizer runs at the collector's time, inside other operators' products);
# - `autograd_ms`: autograd's product time when `auto` last timed it. Where
#   the trace time, the ratio and this are all recorded, the run is past the
#   break-even at those figures, and compiling cannot pay, `auto` decides
#   before any product is timed: functional from the run's first judged
#   product, with no autograd state built, no timing and no check (the ratio
#   was recorded only after the trial's products agreed with autograd's). A
#   Lanczos of 100 GGN products on GPT-2 6L run again (H200) took 2.45 s by
#   `auto` against 2.05 s on the functional engine, where the autograd
#   products, their kept graph and the checking product came before the
#   switch; decided before the first product, 2.08 s against 2.23 s.
# Facts that would not change what the file holds (a rerun's counts) are not
# written again. A first run behaves as NOTE [auto engine] says. The record is
# a guess about the next run; a wrong one costs at most one trace that does
# not pay, or a few doublings on autograd, after which the run's own counts
# take over.


@dataclass(frozen=True)
class AutoPolicy:
    """The tuned constants of ``auto`` (NOTE [auto engine]); ``auto``'s module constants of the
    same meaning (``AUTO_MIN_PRODUCTS``, ...) are these defaults."""

    #: fewer products expected: autograd, nothing traced (AUTO_MIN_PRODUCTS)
    min_products: int = 8
    #: a run is long enough for a trial when its products on autograd are expected to take this
    #: many times what a trace is expected to cost: a trial that finds no faster engine then costs
    #: the run at most about 1 / trace_payback more (the facade's 0.x scripts must never be
    #: slower) (AUTO_TRACE_PAYBACK)
    trace_payback: float = 3.0
    #: the most a trace is expected to cost (the threshold of a "short run" where nothing is
    #: known) (AUTO_MIN_RUN_MS)
    min_run_ms: float = 20_000.0
    #: a first trace's expected cost per leaf module where none was recorded: what recorded traces
    #: (NOTE [recording a trace], NOTE [programs written directly]) cost on an H200 host, torch
    #: 2.11, session 17 (Hessian / GGN: 0.020 / 0.008 s on a 5-module MLP, 0.74 / 0.65 s on GPT-2
    #: 12L's ~137; the same host with session 16's starting tree: 0.031 / 0.013 s and 1.59 / 0.82
    #: s) (TRACE_PRIOR_S_PER_MODULE)
    trace_prior_s_per_module: float = 0.006
    #: products of first derivatives only (GGN, Fisher) take this of it (TRACE_PRIOR_FIRST_ORDER)
    trace_prior_first_order: float = 0.4
    #: added where a process has not imported torch._dynamo yet: torch.func's transforms import
    #: it on their first use (0.65 s on a 2-core CPU host, torch 2.13), which the first trace
    #: pays (TRACE_IMPORT_PRIOR_S)
    trace_import_prior_s: float = 0.6
    #: a compilation's expected time where none was recorded: this plus compile_s_per_node per
    #: node of the tangent graph (COMPILE_PRIOR_S, COMPILE_S_PER_NODE)
    compile_prior_s: float = 8.0
    compile_s_per_node: float = 0.008
    #: the expected saving of a compiled product over the eager tangent time (COMPILED_SAVING)
    compiled_saving: float = 0.2
    #: a run expected to save less than this on a compiled product does not consider compiling
    #: before a trial has timed it (the least a compilation was seen to cost, a cache hit
    #: included) (MIN_COMPILE_S)
    min_compile_s: float = 1.0
    #: the products of a trial (per row of its block) that come before the chosen engine runs the
    #: rest of the run: what the compile rule does not count as saved
    trial_products: int = 7

    def judges(self, expected_products: int) -> bool:
        """Whether a run of this many products is worth judging (else autograd, nothing traced)."""
        return expected_products >= self.min_products

    def compile_estimate_s(self, recorded_s: float | None, tangent_nodes: int) -> float:
        """A program's expected compile time: the recorded one, else the prior per node."""
        if recorded_s is not None:
            return recorded_s
        return self.compile_prior_s + self.compile_s_per_node * tangent_nodes


@dataclass(frozen=True)
class Facts:
    """What the selector knows of a model and curvature when it decides (plain values)."""

    #: what earlier runs recorded (NOTE [what auto remembers]): ``trace_s``,
    #: ``functional_ratio``, ``products``, ``autograd_ms``
    recorded: Mapping[str, float] = field(default_factory=dict)
    #: why the traced engines are out of the question here (no functional product, ranks that
    #: must agree, batches not kept, a model torch.func cannot trace), if they are
    refusal: str | None = None
    #: whether the curvature has a functional product at all
    functional: bool = True
    #: the model's leaf modules (the trace prior's unit)
    leaf_modules: int = 1
    #: a product of first derivatives only (GGN, Fisher): a shorter trace
    first_order: bool = False
    #: whether torch.func's first use (its import of torch._dynamo) has been paid
    torch_func_loaded: bool = True
    #: whether torch.compile can run here
    compile_supported: bool = True
    #: the first judged block: recorded facts may decide before any product is timed
    first_look: bool = False
    #: the traced programs of the trial as (recorded compile time or None, tangent graph nodes)
    programs: tuple[tuple[float | None, int], ...] = ()
    #: rows of the trial's block (its products are single directions)
    trial_rows: int = 1


#: what the selector does next with a :class:`Decision`:
#: "keep": products run on ``engine`` from here (final); "later": ``engine`` for now, judged
#: again if the run goes on; "adopt": ``engine`` from this product on, unchecked (the recorded
#: ratio was noted only after a checked trial); "check": ``engine`` if one product agrees with
#: autograd's; "time first": time the run's own product on autograd, then decide again;
#: "trial": time autograd and functional, then decide again; "time compiled": time the compiled
#: engine, then decide again
Step = Literal["keep", "later", "adopt", "check", "time first", "trial", "time compiled"]


@dataclass(frozen=True)
class Decision:
    """An engine, why, the figures it rests on (``None``: not part of this decision), and what the
    selector does next (``step``)."""

    engine: str
    reason: str
    step: Step = "keep"
    trace_estimate_s: float | None = None
    trace_estimate_from: str = ""
    functional_ratio: float | None = None
    compile_estimate_s: float | None = None
    #: autograd's product time as the record holds it (a decision before any product is timed)
    recorded_autograd_ms: float | None = None


DEFAULT_POLICY = AutoPolicy()


def decide(
    facts: Facts,
    expected_products: int,
    timings: Mapping[str, float],
    policy: AutoPolicy = DEFAULT_POLICY,
) -> Decision:
    """``auto``'s choice (NOTE [auto engine], NOTE [what auto remembers]) for a run of
    ``expected_products`` products, from ``facts`` and the ``timings`` measured so far (ms):
    ``autograd_first`` (the run's own product on autograd, per row), then the trial's
    ``autograd`` and ``functional`` (per pass of ``facts.trial_rows`` rows), then ``compiled``."""
    n = expected_products
    if not policy.judges(n):
        return Decision("autograd", "few products expected", "later")
    if "compiled" in timings:
        return _after_compiled(facts, n, timings, policy)
    if "functional" in timings:
        return _after_trial(facts, n, timings, policy)
    if "autograd_first" in timings:
        return _after_first_product(facts, n, timings["autograd_first"], policy)
    if facts.first_look:
        recorded = _from_records(facts, n, policy)
        if recorded is not None:
            return recorded
    if facts.refusal is not None:
        return Decision("autograd", facts.refusal)
    return Decision("autograd", "undecided", "time first")


def trace_estimate_ms(facts: Facts, policy: AutoPolicy = DEFAULT_POLICY) -> tuple[float, str]:
    """What a trace is expected to cost before the functional engine's first product, and why
    (NOTE [auto engine]): this model and curvature's last trace time (NOTE [trace times]), else
    the prior per leaf module (and torch.func's import where its first use is still to come); at
    most ``policy.min_run_ms``."""
    if not facts.functional:
        return policy.min_run_ms, "no functional engine"
    known = facts.recorded.get("trace_s")
    if known is not None:
        return min(policy.min_run_ms, known * 1e3), "this model's last trace"
    leaves = facts.leaf_modules
    prior = policy.trace_prior_s_per_module * max(1, leaves)
    why = f"prior: {leaves} leaf modules"
    if facts.first_order:
        prior *= policy.trace_prior_first_order
        why += " (first derivatives)"
    if not facts.torch_func_loaded:
        prior += policy.trace_import_prior_s
        why += ", and torch.func's first import"
    return min(policy.min_run_ms, prior * 1e3), why


def _compiling_may_pay(facts: Facts, n: int, per: float, ratio: float, policy: AutoPolicy) -> bool:
    """Whether a compiled product could save more than the least compilation costs, at the
    recorded ratio, before a trial has timed it."""
    saved_ms = per * ratio * policy.compiled_saving * n
    return facts.compile_supported and saved_ms >= policy.min_compile_s * 1e3


def _from_records(facts: Facts, n: int, policy: AutoPolicy) -> Decision | None:
    """The functional engine before any product is timed, where the records hold everything a
    decision needs and it is that (NOTE [what auto remembers]); else None (measured later)."""
    r = facts.recorded
    ratio, trace_s, per = (r.get(k) for k in ("functional_ratio", "trace_s", "autograd_ms"))
    if ratio is None or trace_s is None or per is None or ratio >= 1.0:
        return None
    if per * n * (1.0 - ratio) <= trace_s * 1e3:
        return None  # the break-even is not reached: measured as a first run would be
    if _compiling_may_pay(facts, n, per, ratio, policy):
        return None  # compiling may pay: the trial measures it
    if facts.refusal is not None:
        return None
    return Decision(
        "functional",
        f"faster in this model's last trial (functional/autograd {ratio:.2f}), at its recorded "
        "product time: decided before the first product",
        "adopt",
        trace_estimate_s=trace_s,
        trace_estimate_from="this model's last trace",
        functional_ratio=ratio,
        recorded_autograd_ms=per,
    )


def _after_first_product(facts: Facts, n: int, per: float, policy: AutoPolicy) -> Decision:
    """A short run stays on autograd (judged again if it goes on); a longer one is checked at the
    recorded ratio where compiling cannot pay, else tried."""
    trace_ms, why = trace_estimate_ms(facts, policy)
    ratio = facts.recorded.get("functional_ratio")
    if ratio is not None and ratio < 1.0:  # NOTE [what auto remembers]: the break-even
        short = per * n * (1.0 - ratio) < trace_ms
        rule = f"expected saving at the last run's functional/autograd ratio {ratio:.2f} under"
        known = not _compiling_may_pay(facts, n, per, ratio, policy)
    else:
        ratio = None
        short = per * n < policy.trace_payback * trace_ms
        rule = f"expected products x product time under {policy.trace_payback:g} x"
        known = False
    step: Step
    if short:
        engine, step = "autograd", "later"
        reason = f"short run: {rule} the trace's expected {trace_ms / 1e3:.2g} s"
    elif known:
        # the last run's trial measured the engines: no second trial, one check of agreement
        engine, step = "functional", "check"
        reason = f"faster in this model's last trial (functional/autograd {ratio:.2f})"
    else:
        engine, step, reason = "autograd", "trial", "long enough for a trial"
    return Decision(
        engine,
        reason,
        step,
        trace_estimate_s=trace_ms / 1e3,
        trace_estimate_from=why,
        functional_ratio=ratio,
    )


def _after_trial(
    facts: Facts, n: int, timings: Mapping[str, float], policy: AutoPolicy
) -> Decision:
    """The faster of the timed engines, unless compiling is expected to save more than it costs
    over the products left after the trial (then the compiled engine is timed too)."""
    best = min(("autograd", "functional"), key=lambda name: timings[name])
    if not (facts.programs and facts.compile_supported):
        return Decision(best, "measured faster")
    k = facts.trial_rows
    remaining = max(0, n - policy.trial_products * k) / k  # passes left after the trial
    est = sum(policy.compile_estimate_s(s, nodes) for s, nodes in facts.programs)
    saving_ms = timings[best] - (1 - policy.compiled_saving) * timings["functional"]
    if remaining * saving_ms / 1e3 > est:
        return Decision(best, "compiling may pay", "time compiled", compile_estimate_s=est)
    return Decision(best, "measured faster; compiling would not pay", compile_estimate_s=est)


def _after_compiled(
    facts: Facts, n: int, timings: Mapping[str, float], policy: AutoPolicy
) -> Decision:
    trial = _after_trial(facts, n, timings, policy)
    if timings["compiled"] < timings[trial.engine]:
        return Decision(
            "compiled",
            "expected saving exceeds the compile time",
            compile_estimate_s=trial.compile_estimate_s,
        )
    return Decision(
        trial.engine,
        "measured faster; compiling would not pay",
        compile_estimate_s=trial.compile_estimate_s,
    )
