"""Product engines: how a curvature's per-batch products run (DESIGN §6, §7).

A curvature is defined once: reverse-mode hooks (``_prepare`` / ``_apply``) and a pure function
of (parameters and buffers by name, batch, one tangent) returning the product
(``functional_product``). Runners (``runner.ProductRunner``: ``prepare(batch, params)``,
``apply(state, vectors, retain)``) run it:

- ``"autograd"`` (``runner.AutogradRunner``): the curvature's own reverse-mode code (kept
  first-order graphs, CUDA-graph replay); the fallback for what ``torch.func`` cannot trace.
- ``"functional"`` (``functional.FunctionalRunner``): the product traced once per batch signature
  and split (``tracing``, NOTE [tangent split]) into the part that reads only parameters and data,
  run once per kept batch, and the part that reads the direction, run per product; blocks of k
  directions through ``vmap`` of the tangent part.
- ``"compiled"`` (``compiled.CompiledRunner``): the same split, the tangent part compiled by
  inductor (NOTE [compile policy]).
- ``"auto"``: chosen per operator from measurement: ``policy.decide`` chooses from the facts,
  the run's length and the timings (NOTE [auto engine]); ``auto.EngineSelector`` gathers them and
  switches runners.

Cost: tracing is host work (the product's own ops once, plus recording each op: ``recorder``,
NOTE [recording a trace]), paid once per batch signature, and its time is remembered for ``auto``
(``records``, NOTE [trace times]; the written programs' bytecode: ``bytecode_cache``); a kept batch costs the primal part once (forward, plus the backward for the
Hessian); each product then costs the tangent part. Kept state is about the activations the
tangent part reads.
"""

from hessian_eigenthings.operators.engines.auto import (
    AUTO_MIN_PRODUCTS,
    AUTO_MIN_RUN_MS,
    AUTO_TRACE_PAYBACK,
    COMPILE_PRIOR_S,
    COMPILE_S_PER_NODE,
    COMPILED_SAVING,
    TRACE_PRIOR_S_PER_MODULE,
    AutoChoice,
    EngineMismatchWarning,
    EngineSelector,
    compile_estimate,
    timed,
)
from hessian_eigenthings.operators.engines.compiled import (
    MAX_COMPILATIONS,
    CompiledRunner,
    CompileFallbackWarning,
    record_compile,
    recorded_compile_s,
    views_as_reshapes,
)
from hessian_eigenthings.operators.engines.functional import (
    FunctionalRunner,
    check_functional_model,
)
from hessian_eigenthings.operators.engines.records import TRACE_TIMES, TraceTimes
from hessian_eigenthings.operators.engines.runner import (
    ENGINES,
    MISMATCH_TOL,
    AutogradRunner,
    EngineName,
    EngineUnsupportedError,
    ProductCounts,
    ProductRunner,
)
from hessian_eigenthings.operators.engines.tracing import (
    SplitProgram,
    SplitState,
    Tracer,
    batch_signature,
    reads_inputs,
    split_by_tangent,
)

__all__ = [
    "AUTO_MIN_PRODUCTS",
    "AUTO_MIN_RUN_MS",
    "AUTO_TRACE_PAYBACK",
    "COMPILED_SAVING",
    "COMPILE_PRIOR_S",
    "COMPILE_S_PER_NODE",
    "ENGINES",
    "MAX_COMPILATIONS",
    "MISMATCH_TOL",
    "TRACE_PRIOR_S_PER_MODULE",
    "TRACE_TIMES",
    "AutoChoice",
    "AutogradRunner",
    "CompileFallbackWarning",
    "CompiledRunner",
    "EngineMismatchWarning",
    "EngineName",
    "EngineSelector",
    "EngineUnsupportedError",
    "FunctionalRunner",
    "ProductCounts",
    "ProductRunner",
    "SplitProgram",
    "SplitState",
    "TraceTimes",
    "Tracer",
    "batch_signature",
    "check_functional_model",
    "compile_estimate",
    "reads_inputs",
    "record_compile",
    "recorded_compile_s",
    "split_by_tangent",
    "timed",
    "views_as_reshapes",
]
