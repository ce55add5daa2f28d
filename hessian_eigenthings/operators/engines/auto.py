"""The ``auto`` engine policy, and the selector that owns which runner an operator's products use.

:class:`EngineSelector` builds the runners of one curvature (autograd from its reverse-mode hooks,
functional and compiled from its pure product) and, for ``engine="auto"``, chooses among them by
timing the operator's own products (NOTE [auto engine] in ``policy``). What it chooses is
``policy.decide``'s answer on the facts it gathers; the selector does the side effects: the
timings (through the product it is given), the switches of runner, the facts it records. It
holds the curvature's hooks and product function, never the operator.
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
from hessian_eigenthings._checks import InternalError
from hessian_eigenthings._warnings import user_stacklevel
from hessian_eigenthings.batching import Batch
from hessian_eigenthings.operators.engines.compiled import CompiledRunner, recorded_compile_s
from hessian_eigenthings.operators.engines.functional import (
    FunctionalRunner,
    check_functional_model,
)
from hessian_eigenthings.operators.engines.policy import (
    DEFAULT_POLICY,
    AutoPolicy,
    Decision,
    Facts,
    decide,
    trace_estimate_ms,
)
from hessian_eigenthings.operators.engines.records import TRACE_TIMES, structure_key
from hessian_eigenthings.operators.engines.runner import (
    ENGINES,
    MISMATCH_TOL,
    AutogradRunner,
    EngineUnsupportedError,
    ProductCounts,
    ProductRunner,
    unsupported,
)
from hessian_eigenthings.operators.engines.tracing import SplitProgram, selected_names


class EngineMismatchWarning(RuntimeWarning):
    """``auto``'s timing runs gave different products on two engines: it keeps ``autograd``."""


class Curvature(Protocol):
    """What the selector reads from a curvature when it is built (and keeps no reference to)."""

    model: nn.Module
    params: list[nn.Parameter]
    supports_functional: bool
    counts: ProductCounts

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


#: ``auto``'s constants by name (tests and benchmarks patch them here; ``current_policy`` reads
#: them at each decision); their values and reasons are :class:`~.policy.AutoPolicy`'s
AUTO_MIN_PRODUCTS = DEFAULT_POLICY.min_products
AUTO_MIN_RUN_MS = DEFAULT_POLICY.min_run_ms
AUTO_TRACE_PAYBACK = DEFAULT_POLICY.trace_payback
TRACE_PRIOR_S_PER_MODULE = DEFAULT_POLICY.trace_prior_s_per_module
TRACE_PRIOR_FIRST_ORDER = DEFAULT_POLICY.trace_prior_first_order
TRACE_IMPORT_PRIOR_S = DEFAULT_POLICY.trace_import_prior_s
COMPILE_PRIOR_S = DEFAULT_POLICY.compile_prior_s
COMPILE_S_PER_NODE = DEFAULT_POLICY.compile_s_per_node
COMPILED_SAVING = DEFAULT_POLICY.compiled_saving
MIN_COMPILE_S = DEFAULT_POLICY.min_compile_s


def current_policy() -> AutoPolicy:
    """The policy at this module's constants (as patched, where a test or benchmark patched one)."""
    return AutoPolicy(
        min_products=AUTO_MIN_PRODUCTS,
        trace_payback=AUTO_TRACE_PAYBACK,
        min_run_ms=AUTO_MIN_RUN_MS,
        trace_prior_s_per_module=TRACE_PRIOR_S_PER_MODULE,
        trace_prior_first_order=TRACE_PRIOR_FIRST_ORDER,
        trace_import_prior_s=TRACE_IMPORT_PRIOR_S,
        compile_prior_s=COMPILE_PRIOR_S,
        compile_s_per_node=COMPILE_S_PER_NODE,
        compiled_saving=COMPILED_SAVING,
        min_compile_s=MIN_COMPILE_S,
    )


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

    def take(self, decision: Decision) -> None:
        """The figures ``decision`` rests on (those it has; the others stay as they were)."""
        d = decision
        if d.trace_estimate_s is not None:
            self.trace_estimate_s, self.trace_estimate_from = (
                d.trace_estimate_s,
                d.trace_estimate_from,
            )
        if d.functional_ratio is not None:
            self.functional_ratio = d.functional_ratio
        if d.compile_estimate_s is not None:
            self.compile_estimate_s = d.compile_estimate_s
        if d.recorded_autograd_ms is not None:
            self.timings_ms["autograd_recorded"] = d.recorded_autograd_ms

    def settle(self, decision: Decision) -> None:
        """``decision``'s engine and reason are the choice (with its figures)."""
        self.take(decision)
        self.chosen, self.reason = decision.engine, decision.reason

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
    """What compiling ``prog`` for blocks of ``k`` is expected to cost (s): the recorded time,
    else the policy's prior per node."""
    return current_policy().compile_estimate_s(recorded_compile_s(prog, k), prog.tangent.num_nodes)


def timed(device: torch.device, fn: Callable[[], Any]) -> tuple[Any, float]:
    """``fn()`` and its wall time in ms (synchronised on CUDA)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    out = fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return out, (time.perf_counter() - t0) * 1e3


#: the operator's product of a row block ``V (k, n)`` into ``out`` (one pass over the data)
BlockProduct = Callable[[torch.Tensor, torch.Tensor], None]


class EngineSelector:
    """Owns which runner computes a curvature's per-batch products, and ``auto``'s choice.

    ``runner`` is the active :class:`ProductRunner`. The operator's data loop counts the
    directions it is asked for (``counts.products``) and calls :meth:`block` when the count
    reaches ``look_at`` (``auto`` judges the loop and decides there, timing the ``product`` it is
    given); a steady product reads ``look_at`` and nothing else of the selector.
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
        self.trial_products = 0
        #: the operator's count of products; this selector's start at ``counts.products - _made``
        self.counts = curvature.counts
        self._start = self.counts.products
        self._pending = False
        self._next_check: float = 1 if engine == "auto" else float("inf")
        #: the operator's product count at which its data loop calls ``block`` next
        self.look_at: float = 0.0
        self._arm()
        #: the model-and-curvature key of NOTE [trace times], made at the first judgement
        self._structure: str | None = None
        self._hint: str | None = None
        #: whether the records were read for a decision before the first product
        self._records_tried = engine != "auto"
        if engine in ("functional", "compiled", "layers"):
            self.runner = self._make(engine)

    # -- when the data loop calls ------------------------------------------------------
    @property
    def seen(self) -> int:
        """Products (single directions) the operator made since this selector was built."""
        return self.counts.products - self._start

    @seen.setter
    def seen(self, value: int) -> None:
        self._start = self.counts.products - value
        self._arm()

    @property
    def pending(self) -> bool:
        """``auto`` decides on the next block (enough products expected, not decided yet)."""
        return self._pending

    @pending.setter
    def pending(self, value: bool) -> None:
        self._pending = value
        self._arm()

    @property
    def next_check(self) -> float:
        """The count of products at which a bare loop is judged next (NOTE [auto engine])."""
        return self._next_check

    @next_check.setter
    def next_check(self, value: float) -> None:
        self._next_check = value
        self._arm()

    def _arm(self) -> None:
        """``look_at``: the next block while a decision is pending, else the next judgement."""
        self.look_at = float("-inf") if self._pending else self._start + self._next_check

    def discount(self, products: int) -> None:
        """``products`` made on another selector (``using_engine``) are not this run's."""
        self._start += products
        self._arm()

    def block(
        self,
        V: torch.Tensor,
        out: torch.Tensor,
        *,
        first: int,
        product: BlockProduct,
        keeps_states: bool,
        on_switch: Callable[[], None],
        counts: ProductCounts,
        cold: int = 1,
    ) -> int:
        """The data loop's call for the block ``V`` (k, n) once its count reached ``look_at``:
        judge a loop that declared no length, and decide on the first ``first`` rows where a
        decision is pending (:meth:`before_block`). Returns the first row the loop computes
        (``first`` where the decision's last product wrote ``out[:first]``, else 0)."""
        if self.seen >= self._next_check:  # a loop that declared no budget (NOTE [auto engine])
            self.judge_loop()
        if self._pending and self.before_block(
            V[:first],
            out[:first],
            product=product,
            keeps_states=keeps_states,
            cold=cold,
            on_switch=on_switch,
            counts=counts,
        ):
            return first
        return 0

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
        self.pending = not self.decided and current_policy().judges(self.expected_products)

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
        What to do is ``policy.decide``'s; this runs it. Returns True when ``out`` already holds
        ``A V`` (the decision's last product)."""
        if not self.pending:
            return False  # few products: autograd, undecided (a later budget may change that)
        return _Trial(self, product, on_switch).judge(V, out, keeps_states, counts, cold)

    def facts_now(
        self,
        keeps_states: bool | None = None,
        *,
        first_look: bool = False,
        programs: Sequence[SplitProgram] = (),
        rows: int = 1,
    ) -> Facts:
        """What ``decide`` is given: the records of this model and curvature, why traced engines
        are refused (where ``keeps_states`` is given), the trace prior's inputs, and the compile
        estimates' inputs of ``programs`` compiled for blocks of ``rows``."""
        leaves = sum(1 for m in self.model.modules() if next(m.children(), None) is None)
        compiles = _torch_compat.compile_supported()
        return Facts(
            recorded=self.facts(),
            refusal=None if keeps_states is None else self._refusal(keeps_states),
            functional=self.functional,
            leaf_modules=leaves,
            first_order=not self.second_order,
            torch_func_loaded="torch._dynamo" in sys.modules,
            compile_supported=compiles,
            first_look=first_look,
            programs=tuple((recorded_compile_s(p, rows), p.tangent.num_nodes) for p in programs)
            if compiles
            else (),
            trial_rows=rows,
        )

    def trace_estimate_ms(self) -> tuple[float, str]:
        """What a trace is expected to cost before the functional engine's first product, and
        why (``policy.trace_estimate_ms`` on this model's facts)."""
        return trace_estimate_ms(self.facts_now(), current_policy())

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
    """``auto``'s judgement of a block and its timing of the engines on single products (NOTE
    [auto engine]): what ``policy.decide`` says to measure or adopt, done."""

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

    def judge(
        self,
        V: torch.Tensor,
        out: torch.Tensor,
        keeps_states: bool,
        counts: ProductCounts,
        cold: int,
    ) -> bool:
        """``EngineSelector.before_block`` on a block where a decision is pending: what
        ``policy.decide`` says, run (NOTE [auto engine]). True when ``out`` holds ``A V``."""
        sel, on_switch = self.sel, self.on_switch
        n, a = sel.expected_products, sel.auto
        if not sel._records_tried:
            sel._records_tried = True
            d = decide(sel.facts_now(keeps_states, first_look=True), n, {}, current_policy())
            if d.step == "adopt":  # decided from records (NOTE [what auto remembers])
                sel.decided, sel.pending = True, False
                a.expected_products = n
                a.take(d)
                self.functional_from_records(V, out, d)
                return True
        if sel.seen <= cold * V.shape[0]:
            # the operator's first products are cold: decide later (NOTE [auto engine])
            return False
        sel.decided, sel.pending = True, False
        a.expected_products = n
        d = decide(sel.facts_now(keeps_states), n, {}, current_policy())
        if d.step == "keep":  # the traced engines are refused here
            a.settle(d)
            sel.next_check = float("inf")
            return False
        # the first product is the run's own (counted) and sizes the run
        sel._switch("autograd", on_switch)
        try:
            _, first = timed(sel.device, lambda: self.product(V, out))
        except BaseException:
            sel.decided = False  # judged again later (NOTE [auto engine])
            raise
        per = first / V.shape[0]
        a.timings_ms["autograd_first"] = per
        sel.note_facts(autograd_ms=round(per, 4))
        d = decide(sel.facts_now(), n, {"autograd_first": per}, current_policy())
        a.take(d)
        if d.step == "later":  # a short run
            a.settle(d)
            sel.decided = False  # judged again if the run goes on (NOTE [auto engine])
            return True
        # the trial runs single products (a few per engine, whatever the block width) into a
        # scratch row; they are reported (trial_products), not counted as the run's
        passes, forwards = counts.passes, counts.forwards
        try:
            if d.step == "check":
                self.adopt_functional(V[:1], out[:1], d)
            else:
                self.run(V[:1], out[:1].clone(), out[:1].clone())
        finally:
            counts.passes, counts.forwards = passes, forwards
        return True

    def adopt_functional(self, V: torch.Tensor, reference: torch.Tensor, d: Decision) -> None:
        """The functional engine without timing the engines again (an earlier run's trial found it
        faster, NOTE [what auto remembers]): one product, checked against autograd's
        ``reference`` of the same direction."""
        scratch = torch.empty_like(reference)
        try:
            self.sel._switch("functional", self.on_switch)
            self._pass(V, scratch)
        except (RuntimeError, NotImplementedError, EngineUnsupportedError) as exc:
            self._failed(exc)
            return
        if self._agree(scratch, reference):
            self.sel.auto.settle(d)

    def functional_from_records(self, V: torch.Tensor, out: torch.Tensor, d: Decision) -> None:
        """The functional engine from the first product on, unchecked: the ratio this model's
        last trial recorded was noted only after its products agreed with autograd's (NOTE [what
        auto remembers]); ``out = A V`` on whichever engine ends up active."""
        try:
            self.sel._switch("functional", self.on_switch)
            self.product(V, out)
        except (RuntimeError, NotImplementedError, EngineUnsupportedError) as exc:
            self._failed(exc)
            self.product(V, out)
            return
        self.sel.auto.settle(d)

    def run(self, V: torch.Tensor, out: torch.Tensor, reference: torch.Tensor) -> None:
        """Time autograd and functional (and compiled, where ``decide`` says it may pay) and keep
        what ``decide`` chooses."""
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
        runner = sel.runner
        if not (isinstance(runner, FunctionalRunner)):
            raise InternalError("isinstance(runner, FunctionalRunner)")
        facts = sel.facts_now(programs=list(runner._programs.values()), rows=V.shape[0])
        timings = {name: a.timings_ms[name] for name in ("autograd", "functional")}
        d = decide(facts, sel.expected_products, timings, current_policy())
        if d.step == "time compiled":
            a.take(d)
            timings["compiled"] = a.timings_ms["compiled"] = self._time("compiled", V, out, False)
            d = decide(facts, sel.expected_products, timings, current_policy())
        a.settle(d)
        sel._switch(d.engine, self.on_switch)
