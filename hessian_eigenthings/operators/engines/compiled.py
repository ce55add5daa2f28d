"""The compiled runner: the functional runner with the tangent part compiled by inductor.

Compilation stays visible and bounded (NOTE [compile policy]); compile times are remembered beside
inductor's on-disk cache for ``auto``. Cost: one compilation per tangent program and block width
(seconds to a minute), then the compiled tangent part per product.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
import warnings
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from hessian_eigenthings import _torch_compat
from hessian_eigenthings._checks import InternalError
from hessian_eigenthings._warnings import user_stacklevel
from hessian_eigenthings.operators.engines.functional import FunctionalRunner
from hessian_eigenthings.operators.engines.records import inductor_cache_base
from hessian_eigenthings.operators.engines.tracing import SplitProgram, SplitState


class CompileFallbackWarning(RuntimeWarning):
    """Compiling a product failed (or kept recompiling); products run on the functional engine."""


# NOTE [compile policy]
# Recompilation and silent eager fallbacks are what made compiled code slower
# than promised, so the compiled engine keeps compilation visible and bounded:
# - the tangent part is already an aten graph: inductor compiles it directly
#   (`torch._inductor.compile`), without a dynamo frame, so there are no
#   guards to fail and nothing recompiles behind the operator's back; a
#   compiled artifact is exactly one compilation;
# - one artifact per tangent program and block width; a program is shared by
#   every batch of one signature, so an uneven last batch costs one more
#   program, hence one more compilation (`num_compilations` counts them);
# - at most MAX_COMPILATIONS per operator: a model traced per batch (its Python
#   reads tensor values, NOTE [tangent split]) would otherwise compile once per
#   new batch; past the bound it warns and runs the functional engine;
# - a compile failure warns once (`CompileFallbackWarning`) and the products
#   continue on the functional engine: never an exception;
# - compile time (the compilation and its first run) is summed in `compile_s`
#   and recorded in a small JSON file beside inductor's on-disk cache, which
#   `auto` reads to decide whether compiling pays; a second process hits
#   inductor's cache (NOTE [inductor's caches for an aten graph]) and compiles
#   in a fraction of the time, so a record of a first compilation is read as
#   CACHED_COMPILE_FRACTION of its time and a record of a hit as it is.


MAX_COMPILATIONS = 16
#: a cache hit's share of a first compilation's time (NOTE [inductor's caches for an aten graph]):
#: CPU MLP 2.1 of 11.3 s (torch 2.13)
CACHED_COMPILE_FRACTION = 0.2


class CompiledRunner(FunctionalRunner):
    """The functional engine with the tangent part compiled by inductor (NOTE [compile policy])."""

    name = "compiled"

    def __init__(self, *args: Any, **kwargs: Any) -> None:  # FunctionalRunner's arguments
        super().__init__(*args, **kwargs)
        self._warned = False
        self.compile_s = 0.0
        self.num_compilations = 0
        self.num_fallbacks = 0

    def apply(
        self, state: SplitState, vecs: list[torch.Tensor], retain: bool
    ) -> Sequence[torch.Tensor | None]:
        """One direction on a program compiled for it: the compiled tangent part, called here;
        else (a block, not compiled yet, or fallen back) ``FunctionalRunner.apply``, which calls
        :meth:`run`. The same call either way, one module fewer on the steady product."""
        prog = state.program
        fn = prog.compiled.get(1) if vecs[0].shape[0] == 1 else None
        if fn is None:
            return super().apply(state, vecs, retain)
        with torch.no_grad():
            out = fn(*laid_out(prog, (*state.kept, *(v[0] for v in vecs))))
        return [o.unsqueeze(0) for o in out]  # (1, *shape) each

    def run(
        self, prog: SplitProgram, k: int, args: tuple[torch.Tensor, ...]
    ) -> Sequence[torch.Tensor]:
        fn = prog.compiled.get(k, ...)
        if fn is None:
            return super().run(prog, k, args)
        args = laid_out(prog, args)
        if fn is not ...:
            return fn(*args)
        if self.num_compilations >= MAX_COMPILATIONS:
            self._fallback(
                prog,
                k,
                RuntimeError(
                    f"{MAX_COMPILATIONS} compilations already: this model is traced per batch (its Python reads "
                    "tensor values), so every new batch would compile again"
                ),
            )
            return super().run(prog, k, args)
        tangent = self.tangent_graph(prog, k, args)
        t0 = time.perf_counter()
        try:
            if not _torch_compat.compile_supported():
                raise RuntimeError("torch.compile does not support this Python")
            compiler = _torch_compat.inductor_backend()
            hits = _torch_compat.inductor_cache_hits()
            with _quiet_compile(), _torch_compat.denormals_kept():
                fn = compiler(views_as_reshapes(tangent), list(args))
                out = fn(*args)
            if args[0].is_cuda:
                torch.cuda.synchronize(args[0].device)
        except Exception as exc:  # any compile failure: the eager tangent part, same numbers
            self._fallback(prog, k, exc)
            return super().run(prog, k, args)
        seconds = time.perf_counter() - t0
        self.num_compilations += 1
        self.compile_s += seconds
        prog.compiled[k] = fn
        record_compile(prog, k, seconds, cache_hit=_torch_compat.inductor_cache_hits() > hits)
        return out

    def _fallback(self, prog: SplitProgram, k: int, exc: BaseException) -> None:
        prog.compiled[k] = None
        self.num_fallbacks += 1
        if not self._warned:
            self._warned = True
            cause = getattr(exc, "inner_exception", None) or exc.__cause__ or exc
            text = str(cause).strip()
            first = text.splitlines()[0][:200] if text else ""
            warnings.warn(
                f"engine='compiled': compiling the product failed ({type(cause).__name__}: {first}); products "
                "run on engine='functional' (same numbers, not compiled)",
                CompileFallbackWarning,
                stacklevel=user_stacklevel(),
            )

    def describe(self) -> dict[str, Any]:
        out = super().describe()
        out.update(
            compilations=self.num_compilations,
            compile_s=round(self.compile_s, 2),
            fallbacks=self.num_fallbacks,
        )
        return out


def laid_out(prog: SplitProgram, args: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    """``args`` in the layouts the compiled code assumes. Kept values come out of the same primal
    graph every time (same layouts, passed as they are: no copy per product); directions are
    views of the caller's block, made contiguous (a copy only for k > 1)."""
    m = prog.num_kept
    return args[:m] + tuple(a if a.is_contiguous() else a.contiguous() for a in args[m:])


# NOTE [views the compiler may not keep]
# `make_fx` records a `reshape` that happened to be a view of the traced tensors
# as `aten.view`, valid for the strides those tensors had. Inductor lays out
# intermediate tensors as it likes; when one comes out transposed in memory, the
# recorded `view` cannot address it and compiling fails ("Cannot view a tensor
# with shape ... and strides ..."), so the product falls back to the functional
# engine. This was reported on HF GPT-2 12L with eager attention (H100, torch
# 2.11; a key of shape (4, 12, 64, 512), strides (393216, 64, 1, 768), viewed as
# (48, 64, 512)) and hit `linearize` + compile of GPT-2 6L; at this module's
# version it did not recur on an H100 in 12L/6L, eager/SDPA, masked batches,
# blocks or the GGN (benchmarks/check_compiled_gpt2.py), so the rewrite below
# guards the class of failure rather than one measured case. The graph handed to the compiler asks for `reshape` instead: a view
# wherever the strides allow it (no copy, same numbers), a copy elsewhere. A
# copy would not see a later in-place write to the tensors it was taken from,
# so a view stays a view when anything sharing its storage (through view ops,
# either way) is written in place. The eager tangent part is not rewritten.


def _aliases_input(node: torch.fx.Node) -> bool:
    target = node.target
    if not isinstance(target, torch._ops.OpOverload) or not node.args:
        return False
    if target is torch.ops.aten._unsafe_view.default:  # a view its schema does not declare
        return isinstance(node.args[0], torch.fx.Node)
    rets = target._schema.returns
    return bool(rets) and rets[0].alias_info is not None and isinstance(node.args[0], torch.fx.Node)


def views_as_reshapes(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A copy of ``gm`` whose ``aten.view`` and ``aten._unsafe_view`` nodes read ``aten.reshape``
    where no tensor sharing their storage is written in place (NOTE [views the compiler may not
    keep])."""
    views = (torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default)
    reshape = torch.ops.aten.reshape.default
    nodes = list(gm.graph.nodes)
    root = {n: n for n in nodes}

    def find(n: torch.fx.Node) -> torch.fx.Node:
        while root[n] is not n:
            root[n] = root[root[n]]
            n = root[n]
        return n

    written: list[torch.fx.Node] = []
    for n in nodes:
        if _aliases_input(n):
            base = n.args[0]
            if not (isinstance(base, torch.fx.Node)):
                raise InternalError("isinstance(base, torch.fx.Node)")
            root[find(n)] = find(base)
            if n.target._schema.is_mutable:
                written.append(base)
    dirty = {find(n) for n in written}
    graph = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    for node in nodes:
        new = graph.node_copy(node, lambda x: env[x])
        if node.target in views and find(node) not in dirty:
            new.target = reshape
        env[node] = new
    return torch.fx.GraphModule(gm, graph)


@contextlib.contextmanager
def _quiet_compile() -> Iterator[None]:
    # inductor may warn about its own choices (e.g. TF32 being off); not the user's business.
    # Only this call's warnings are filtered (the product path never resets the registry).
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", module=r"torch\._inductor.*")
        warnings.filterwarnings("ignore", module=r"torch\._dynamo.*")
        yield


def _record_path() -> str:
    return os.path.join(inductor_cache_base(), "hessian_eigenthings_compile_times.json")


def record_compile(prog: SplitProgram, k: int, seconds: float, cache_hit: bool = False) -> None:
    """Remember a compile time beside inductor's cache (best effort: a read-only cache is fine),
    and whether inductor found the compiled graph in its cache."""
    path = _record_path()
    try:
        data: dict[str, Any] = {}
        if os.path.exists(path):
            with open(path) as f:
                data = json.load(f)
        data[f"{prog.key}:{k}"] = {
            "compile_s": round(seconds, 3),
            "nodes": prog.nodes,
            "cache_hit": bool(cache_hit),
        }
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            json.dump(data, f)
    except (OSError, ValueError):
        pass


def recorded_compile_s(prog: SplitProgram, k: int) -> float | None:
    """What compiling this program is expected to cost, from an earlier run's record: a cache
    hit's time, or a first compilation's time × CACHED_COMPILE_FRACTION (its artifact is in
    the cache beside the record now, where inductor keeps one)."""
    try:
        with open(_record_path()) as f:
            entry = json.load(f).get(f"{prog.key}:{k}")
        if entry is None:
            return None
        seconds = float(entry["compile_s"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    if entry.get("cache_hit", False) or not _torch_compat.inductor_graph_cache_on():
        return seconds
    return seconds * CACHED_COMPILE_FRACTION
