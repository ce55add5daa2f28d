"""The ``auto`` engine policy, and the selector that owns which runner an operator's products use.

:class:`EngineSelector` builds the runners of one curvature (autograd from its reverse-mode hooks,
functional and compiled from its pure product) and, for ``engine="auto"``, chooses among them by
timing the operator's own products (NOTE [auto engine]). It holds the curvature's hooks and
product function, never the operator: a trial receives the product to time as an argument.
"""

from __future__ import annotations

import inspect
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import nn

from hessian_eigenthings import _torch_compat
from hessian_eigenthings._warnings import user_stacklevel
from hessian_eigenthings.batching import Batch
from hessian_eigenthings.operators.engines.compiled import CompiledRunner, recorded_compile_s
from hessian_eigenthings.operators.engines.functional import (
    FunctionalRunner,
    check_functional_model,
)
from hessian_eigenthings.operators.engines.runner import (
    ENGINES,
    MISMATCH_TOL,
    AutogradRunner,
    EngineUnsupportedError,
    ProductCounts,
    ProductRunner,
    unsupported,
)
from hessian_eigenthings.operators.engines.trace_times import TRACE_TIMES, structure_key
from hessian_eigenthings.operators.engines.tracing import SplitProgram, selected_names


class EngineMismatchWarning(RuntimeWarning):
    """``auto``'s timing runs gave different products on two engines: it keeps ``autograd``."""


class Curvature(Protocol):
    """What the selector reads from a curvature when it is built (and keeps no reference to)."""

    model: nn.Module
    params: list[nn.Parameter]
    supports_functional: bool

    @property
    def device(self) -> torch.device: ...

    def functional_product(
        self, state: dict[str, torch.Tensor], batch: Batch, tangent: list[torch.Tensor]
    ) -> list[torch.Tensor]: ...

    def functional_unsupported_reason(self) -> str: ...

    def _prepare(self, batch: Batch) -> Any: ...

    def _apply(
        self, state: Any, vecs: list[torch.Tensor], retain: bool
    ) -> Sequence[torch.Tensor | None]: ...

    def _engine_batch(self, batch: Batch) -> Batch: ...


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

AUTO_MIN_PRODUCTS = 8
COMPILE_PRIOR_S = 8.0
COMPILE_S_PER_NODE = 0.008
COMPILED_SAVING = 0.2


@dataclass
class AutoChoice:
    """What ``engine="auto"`` chose and why (``op.engine_report``)."""

    chosen: str = "autograd"
    expected_products: int = 1
    timings_ms: dict[str, float] = field(default_factory=dict)
    compile_estimate_s: float | None = None
    reason: str = "few products expected"
    #: what a trace was expected to cost when the run's length was judged, and why
    trace_estimate_s: float | None = None
    trace_estimate_from: str = ""
    #: where ``expected_products`` came from: declared, this model's last run, or products so far
    expected_from: str = "declared"
    #: the functional/autograd product-time ratio an earlier run's trial measured, where one was used
    functional_ratio: float | None = None

    def as_dict(self) -> dict[str, Any]:
        return {
            "chosen": self.chosen,
            "expected_products": self.expected_products,
            "timings_ms": {k: round(v, 3) for k, v in self.timings_ms.items()},
            "compile_estimate_s": None
            if self.compile_estimate_s is None
            else round(self.compile_estimate_s, 1),
            "reason": self.reason,
            "trace_estimate_s": None
            if self.trace_estimate_s is None
            else round(self.trace_estimate_s, 3),
            "trace_estimate_from": self.trace_estimate_from,
            "expected_from": self.expected_from,
            "functional_ratio": None
            if self.functional_ratio is None
            else round(self.functional_ratio, 3),
        }


def compile_estimate(prog: SplitProgram, k: int) -> float:
    recorded = recorded_compile_s(prog, k)
    if recorded is not None:
        return recorded
    return COMPILE_PRIOR_S + COMPILE_S_PER_NODE * prog.tangent.num_nodes


def timed(device: torch.device, fn: Callable[[], Any]) -> tuple[Any, float]:
    """``fn()`` and its wall time in ms (synchronised on CUDA)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    out = fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return out, (time.perf_counter() - t0) * 1e3


#: the most a trace is expected to cost (the threshold of a "short run" where nothing is known)
AUTO_MIN_RUN_MS = 20_000.0
#: a run is long enough for a trial when its products on autograd are expected to take this many
#: times what a trace is expected to cost: a trial that finds no faster engine then costs the run
#: at most about 1 / AUTO_TRACE_PAYBACK more (the facade's 0.x scripts must never be slower)
AUTO_TRACE_PAYBACK = 3.0
#: a first trace's expected cost per leaf module where none was recorded: what recorded traces
#: (NOTE [recording a trace], NOTE [programs written directly]) cost on an H200 host, torch 2.11,
#: session 17 (Hessian / GGN: 0.020 / 0.008 s on a 5-module MLP, 0.74 / 0.65 s on GPT-2 12L's
#: ~137; the same host with session 16's starting tree: 0.031 / 0.013 s and 1.59 / 0.82 s):
#: products of first derivatives only (GGN, Fisher) take TRACE_PRIOR_FIRST_ORDER of it
TRACE_PRIOR_S_PER_MODULE = 0.006
TRACE_PRIOR_FIRST_ORDER = 0.4
#: added where a process has not imported torch._dynamo yet: torch.func's transforms import it on
#: their first use (0.65 s on a 2-core CPU host, torch 2.13), which the first trace pays
TRACE_IMPORT_PRIOR_S = 0.6
#: a run expected to save less than this on a compiled product does not consider compiling
#: before a trial has timed it (the least a compilation was seen to cost, a cache hit included)
MIN_COMPILE_S = 1.0

#: the operator's product of a row block ``V (k, n)`` into ``out`` (one pass over the data)
BlockProduct = Callable[[torch.Tensor, torch.Tensor], None]


class EngineSelector:
    """Owns which runner computes a curvature's per-batch products, and ``auto``'s choice.

    ``runner`` is the active :class:`ProductRunner`; the operator calls :meth:`before_block`
    before a block product (``auto`` decides there, timing the ``product`` it is given).
    """

    def __init__(self, curvature: Curvature, engine: str) -> None:
        if engine not in ENGINES:
            raise ValueError(f"engine must be one of {ENGINES}, got {engine!r}")
        self.requested = engine
        self.owner = type(curvature).__name__
        self.device = curvature.device
        self.auto_trials = bool(getattr(curvature, "auto_trials", True))
        self.model = curvature.model
        #: a product of second derivatives (the Hessian): a longer trace (TRACE_PRIOR_FIRST_ORDER)
        self.second_order = bool(getattr(curvature, "needs_double_backward", True))
        self.params = list(curvature.params)
        self.product = curvature.functional_product
        self.batch_of = curvature._engine_batch
        self.functional = curvature.supports_functional
        self.unsupported_reason = (
            "" if self.functional else curvature.functional_unsupported_reason()
        )
        #: the curvature's layer-walk runner factory (``engine="layers"``), if it has one
        self.layer_walk: Callable[[], ProductRunner] | None = getattr(
            curvature, "layer_walk_runner", None
        )
        prepare = curvature._prepare
        takes = "params" in inspect.signature(prepare).parameters
        self.autograd = AutogradRunner(prepare, curvature._apply, takes_params=takes)
        self.runner: ProductRunner = self.autograd
        self.expected_products = 1
        self.auto = AutoChoice(chosen="autograd", reason="undecided")
        self.decided = engine != "auto"
        #: ``auto`` decides on the next block (enough products expected, not decided yet)
        self.pending = False
        self.trial_products = 0
        #: products (single directions) seen while ``auto`` is undecided, and the count at which
        #: a bare loop is judged next (NOTE [auto engine]); the operator's data loop counts
        self.seen = 0
        self.next_check: float = 1 if engine == "auto" else float("inf")
        #: the model-and-curvature key of NOTE [trace times], made at the first judgement
        self._structure: str | None = None
        self._hint: str | None = None
        #: whether the records were read for a decision before the first product
        self._records_tried = engine != "auto"
        if engine in ("functional", "compiled", "layers"):
            self.runner = self._make(engine)

    # -- which engine ---------------------------------------------------------------
    @property
    def active(self) -> str:
        return self.runner.name

    @property
    def traced(self) -> bool:
        """Whether products run through a traced program (math attention, functional checks)."""
        return self.runner.traced

    def _make(self, name: str) -> ProductRunner:
        if name == "autograd":
            return self.autograd
        if name == "layers":
            if self.layer_walk is None:
                raise unsupported(name, self.owner, "it has no layer walk")
            return self.layer_walk()
        if not self.functional:
            raise unsupported(name, self.owner, self.unsupported_reason)
        cls = CompiledRunner if name == "compiled" else FunctionalRunner
        return cls(self.model, self.params, self.product, self.batch_of)

    def _switch(self, name: str, on_switch: Callable[[], None]) -> None:
        if name == self.active:
            return
        old, new = self.runner, self._make(name)
        if isinstance(new, FunctionalRunner) and isinstance(old, FunctionalRunner):
            new.adopt(old)  # traced programs carry over: no second trace
        self.runner = new
        on_switch()  # kept states belong to one engine

    def expect(self, n: int) -> None:
        self.expected_products = max(1, int(n))
        self.pending = not self.decided and self.expected_products >= AUTO_MIN_PRODUCTS

    def judge_loop(self) -> None:
        """A loop of ``seen`` products so far: expect as many more, decide on the next block, and
        judge again when the count doubles (NOTE [auto engine]). The first look, at the first
        product of a run that declared no length where some record holds a decision (else at its
        second), expects as many products as this model's last counted run made (NOTE [what auto
        remembers]); each later one records the count."""
        if self.seen < AUTO_MIN_PRODUCTS:
            self.next_check = AUTO_MIN_PRODUCTS
            if not self.decided and self.expected_products < AUTO_MIN_PRODUCTS:
                if self.seen == 1 and not (
                    self.functional and TRACE_TIMES.any_decision(self.hint(), AUTO_MIN_PRODUCTS)
                ):
                    self.next_check = 2  # no run left a decision: look at the second product
                    return
                known = self.facts().get("products", 0.0)
                if known >= AUTO_MIN_PRODUCTS:
                    self.expect(int(known))
                    self.auto.expected_from = "this model's last run"
                    # the process's next operators are sized by this run's own counts, not the
                    # record's again (NOTE [what auto remembers]); the file keeps the record's
                    TRACE_TIMES.note_in_process(self.structure(), products=float(self.seen))
            return
        self.note_facts(products=float(self.seen))
        self.next_check = 2 * self.seen
        if self.decided:
            return
        if self.seen > self.expected_products:
            self.expect(self.seen)
            self.auto.expected_from = "products so far"

    def structure(self) -> str:
        """This model and curvature's key (NOTE [trace times]); fingerprinted once."""
        if self._structure is None:
            names = selected_names(self.model, self.params)
            self._structure = structure_key(self.model, names, self.product)
        return self._structure

    def hint(self) -> str:
        """A description of this model and curvature cheap enough for a first product (the
        model's class, its selected parameters' count and sizes, the curvature), which the record
        keeps beside the facts of this key (``TraceTimes.any_decision``)."""
        if self._hint is None:
            m = self.model
            sizes = sum(p.numel() for p in self.params)
            self._hint = (
                f"{type(m).__module__}.{type(m).__qualname__}:{len(self.params)}:{sizes}:"
                f"{self.owner}"
            )
        return self._hint

    def facts(self) -> dict[str, float]:
        """What earlier runs recorded of this model and curvature (NOTE [what auto remembers])."""
        return TRACE_TIMES.facts(self.structure()) if self.functional else {}

    def note_facts(self, **facts: float) -> None:
        if self.functional:
            TRACE_TIMES.note_facts(self.structure(), hint=self.hint(), **facts)

    def before_block(
        self,
        V: torch.Tensor,
        out: torch.Tensor,
        *,
        product: BlockProduct,
        keeps_states: bool,
        on_switch: Callable[[], None],
        counts: ProductCounts,
        cold: int = 1,
    ) -> bool:
        """``auto``: decide on this block if the run is long enough (NOTE [auto engine]), timing
        ``product`` (``on_switch`` drops the operator's kept states when the runner changes;
        ``keeps_states``: whether its batches are kept between products; ``cold``: how many
        products come before a representative one: 2 where the second records a CUDA graph).
        Returns True when ``out`` already holds ``A V`` (the decision's last product)."""
        if not self.pending:
            return False  # few products: autograd, undecided (a later budget may change that)
        if not self._records_tried:
            self._records_tried = True
            ratio = self._recorded_choice(keeps_states)
            if ratio is not None:
                _Trial(self, product, on_switch).functional_from_records(V, out, ratio)
                return True
        if self.seen <= cold * V.shape[0]:
            return False  # the operator's first products are cold: decide later (NOTE [auto engine])
        self.decided, self.pending = True, False
        a = self.auto
        a.expected_products = self.expected_products
        reason = self._refusal(keeps_states)
        if reason is not None:
            a.chosen, a.reason = "autograd", reason
            self.next_check = float("inf")
            return False
        # the first product is the run's own (counted) and sizes the run
        self._switch("autograd", on_switch)
        try:
            _, first = timed(self.device, lambda: product(V, out))
        except BaseException:
            self.decided = False  # judged again later (NOTE [auto engine])
            raise
        per = first / V.shape[0]
        a.timings_ms["autograd_first"] = per
        self.note_facts(autograd_ms=round(per, 4))
        trace_ms, why = self.trace_estimate_ms()
        a.trace_estimate_s, a.trace_estimate_from = trace_ms / 1e3, why
        ratio = self.facts().get("functional_ratio")
        if ratio is not None and ratio < 1.0:  # NOTE [what auto remembers]: the break-even
            a.functional_ratio = ratio
            short = per * self.expected_products * (1.0 - ratio) < trace_ms
            rule = f"expected saving at the last run's functional/autograd ratio {ratio:.2f} under"
        else:
            short = per * self.expected_products < AUTO_TRACE_PAYBACK * trace_ms
            rule = f"expected products x product time under {AUTO_TRACE_PAYBACK:g} x"
        if short:
            a.chosen, a.reason = (
                "autograd",
                f"short run: {rule} the trace's expected {trace_ms / 1e3:.2g} s",
            )
            self.decided = False  # judged again if the run goes on (NOTE [auto engine])
            return True
        # the last run's trial measured the engines: no second trial where compiling cannot pay,
        # one check of agreement
        known = ratio is not None and ratio < 1.0 and (
            not _torch_compat.compile_supported()
            or per * ratio * COMPILED_SAVING * self.expected_products < MIN_COMPILE_S * 1e3
        )
        # the trial runs single products (a few per engine, whatever the block width) into a
        # scratch row; they are reported (trial_products), not counted as the run's
        passes, forwards = counts.passes, counts.forwards
        try:
            if known:
                assert ratio is not None
                _Trial(self, product, on_switch).adopt_functional(V[:1], out[:1], ratio)
            else:
                _Trial(self, product, on_switch).run(V[:1], out[:1].clone(), out[:1].clone())
        finally:
            counts.passes, counts.forwards = passes, forwards
        return True

    def _recorded_choice(self, keeps_states: bool) -> float | None:
        """Whether this model's last runs measured everything a decision needs and it is the
        functional engine, before any product is timed (NOTE [what auto remembers]): the recorded
        functional/autograd ratio if so (the choice is reported), else None (measured later)."""
        facts = self.facts()
        ratio, trace_s, per = (facts.get(k) for k in ("functional_ratio", "trace_s", "autograd_ms"))
        if ratio is None or trace_s is None or per is None or ratio >= 1.0:
            return None
        n = self.expected_products
        if per * n * (1.0 - ratio) <= trace_s * 1e3:
            return None  # the break-even is not reached: measured as a first run would be
        if _torch_compat.compile_supported() and per * ratio * COMPILED_SAVING * n >= (
            MIN_COMPILE_S * 1e3
        ):
            return None  # compiling may pay: the trial measures it
        if self._refusal(keeps_states) is not None:
            return None
        self.decided, self.pending = True, False
        a = self.auto
        a.expected_products, a.functional_ratio = n, ratio
        a.trace_estimate_s, a.trace_estimate_from = trace_s, "this model's last trace"
        a.timings_ms["autograd_recorded"] = per
        return ratio

    def trace_estimate_ms(self) -> tuple[float, str]:
        """What a trace is expected to cost before the functional engine's first product, and
        why (NOTE [auto engine]): this model and curvature's last trace time (NOTE [trace times]),
        else TRACE_PRIOR_S_PER_MODULE per leaf module (and TRACE_IMPORT_PRIOR_S where torch.func's
        first use is still to come); at most AUTO_MIN_RUN_MS."""
        if not self.functional:
            return AUTO_MIN_RUN_MS, "no functional engine"
        known = self.facts().get("trace_s")
        if known is not None:
            return min(AUTO_MIN_RUN_MS, known * 1e3), "this model's last trace"
        leaves = sum(1 for m in self.model.modules() if next(m.children(), None) is None)
        prior = TRACE_PRIOR_S_PER_MODULE * max(1, leaves)
        why = f"prior: {leaves} leaf modules"
        if not self.second_order:
            prior *= TRACE_PRIOR_FIRST_ORDER
            why += " (first derivatives)"
        if "torch._dynamo" not in sys.modules:
            prior += TRACE_IMPORT_PRIOR_S
            why += ", and torch.func's first import"
        return min(AUTO_MIN_RUN_MS, prior * 1e3), why

    def _refusal(self, keeps_states: bool) -> str | None:
        """Why ``auto`` keeps autograd without a trial, if it does."""
        if not self.functional:
            return f"functional engines unavailable ({self.unsupported_reason})"
        if not self.auto_trials:
            return "ranks must agree: distributed operators take engine= explicitly"
        if not keeps_states:
            return "batches are not kept between products (no state for a traced engine to reuse)"
        try:
            check_functional_model(self.model, "functional")
        except EngineUnsupportedError as exc:
            return str(exc).split(";")[1].strip() if ";" in str(exc) else str(exc)
        return None

    def report(self) -> dict[str, Any]:
        out: dict[str, Any] = {"requested": self.requested, "active": self.active}
        if self.requested == "auto":
            out["auto"] = self.auto.as_dict()
            out["trial_products"] = self.trial_products
        out.update(self.runner.describe())
        return out


class _Trial:
    """``auto``'s timing of the engines on single products (NOTE [auto engine])."""

    def __init__(
        self, selector: EngineSelector, product: BlockProduct, on_switch: Callable[[], None]
    ) -> None:
        self.sel = selector
        self.product = product
        self.on_switch = on_switch

    def _pass(self, V: torch.Tensor, out: torch.Tensor) -> None:
        self.sel.trial_products += V.shape[0]
        self.product(V, out)

    def _time(self, name: str, V: torch.Tensor, out: torch.Tensor, warm: bool) -> float:
        """Best of two timed passes on ``name`` (after one untimed pass that builds its state,
        unless ``warm``)."""
        self.sel._switch(name, self.on_switch)
        if not warm:
            self._pass(V, out)
        best = float("inf")
        for _ in range(2):
            _, ms = timed(self.sel.device, lambda: self._pass(V, out))
            best = min(best, ms)
        return best

    def _agree(self, out: torch.Tensor, reference: torch.Tensor) -> bool:
        """Whether the functional product ``out`` agrees with autograd's ``reference``; if not,
        back to autograd, with a warning."""
        sel, a = self.sel, self.sel.auto
        diff = float(
            torch.linalg.vector_norm(out - reference)
            / torch.linalg.vector_norm(reference).clamp_min(1e-30)
        )
        if diff <= MISMATCH_TOL.get(out.dtype, 5e-2):
            return True
        sel._switch("autograd", self.on_switch)
        a.chosen, a.reason = (
            "autograd",
            f"the functional product differed from autograd's by {diff:.1e} (relative)",
        )
        warnings.warn(
            f"{sel.owner}: engine='auto' compared the traced product with autograd's and they "
            f"differ by {diff:.1e} (relative); keeping engine='autograd'. A loss or model that writes into "
            "preallocated buffers or reads global state can do this; please report it",
            EngineMismatchWarning,
            stacklevel=user_stacklevel(),
        )
        return False

    def _failed(self, exc: BaseException) -> None:
        """The functional engine failed: back to autograd, saying why."""
        self.sel._switch("autograd", self.on_switch)
        self.sel.auto.chosen, self.sel.auto.reason = (
            "autograd",
            f"functional engine failed: {type(exc).__name__}: {str(exc)[:120]}",
        )

    def adopt_functional(self, V: torch.Tensor, reference: torch.Tensor, ratio: float) -> None:
        """The functional engine without timing the engines again (an earlier run's trial found it
        faster, NOTE [what auto remembers]): one product, checked against autograd's
        ``reference`` of the same direction."""
        sel, a = self.sel, self.sel.auto
        scratch = torch.empty_like(reference)
        try:
            sel._switch("functional", self.on_switch)
            self._pass(V, scratch)
        except (RuntimeError, NotImplementedError, EngineUnsupportedError) as exc:
            self._failed(exc)
            return
        if self._agree(scratch, reference):
            a.chosen = "functional"
            a.reason = f"faster in this model's last trial (functional/autograd {ratio:.2f})"

    def functional_from_records(self, V: torch.Tensor, out: torch.Tensor, ratio: float) -> None:
        """The functional engine from the first product on, unchecked: the ratio this model's
        last trial recorded was noted only after its products agreed with autograd's (NOTE [what
        auto remembers]); ``out = A V`` on whichever engine ends up active."""
        sel, a = self.sel, self.sel.auto
        try:
            sel._switch("functional", self.on_switch)
            self.product(V, out)
        except (RuntimeError, NotImplementedError, EngineUnsupportedError) as exc:
            self._failed(exc)
            self.product(V, out)
            return
        a.chosen = "functional"
        a.reason = (
            f"faster in this model's last trial (functional/autograd {ratio:.2f}), at its "
            "recorded product time: decided before the first product"
        )

    def run(self, V: torch.Tensor, out: torch.Tensor, reference: torch.Tensor) -> None:
        sel = self.sel
        a = sel.auto
        a.timings_ms["autograd"] = self._time("autograd", V, out, warm=True)
        try:
            a.timings_ms["functional"] = self._time("functional", V, out, warm=False)
        except (RuntimeError, NotImplementedError, EngineUnsupportedError) as exc:
            self._failed(exc)
            return
        if not self._agree(out, reference):
            return
        sel.note_facts(
            functional_ratio=a.timings_ms["functional"] / a.timings_ms["autograd"],
            autograd_ms=round(a.timings_ms["autograd"] / V.shape[0], 4),
        )
        best = min(("autograd", "functional"), key=lambda name: a.timings_ms[name])
        runner = sel.runner
        assert isinstance(runner, FunctionalRunner)
        progs = list(runner._programs.values())
        k = V.shape[0]
        remaining = max(0, sel.expected_products - 7 * k) / k  # passes left after the trial
        if progs and _torch_compat.compile_supported():
            est = sum(compile_estimate(p, k) for p in progs)
            a.compile_estimate_s = est
            saving_ms = a.timings_ms[best] - (1 - COMPILED_SAVING) * a.timings_ms["functional"]
            if remaining * saving_ms / 1e3 > est:
                a.timings_ms["compiled"] = self._time("compiled", V, out, warm=False)
                if a.timings_ms["compiled"] < a.timings_ms[best]:
                    a.chosen, a.reason = "compiled", "expected saving exceeds the compile time"
                    return
        a.chosen = best
        a.reason = "measured faster" + (
            "" if a.compile_estimate_s is None else "; compiling would not pay"
        )
        sel._switch(best, self.on_switch)
