"""Product engines: how a curvature's per-batch product runs (DESIGN §6).

A curvature is defined once, as a pure function of (parameters as a dict of
tensors, batch, one tangent dict) returning the product as a dict
(``functional_product`` on the operator). How that function runs is the
engine's business:

- ``"autograd"``: the operator's own reverse-mode code (kept first-order
  graphs, CUDA-graph replay); the fallback for what ``torch.func`` cannot trace.
- ``"functional"``: the product traced once per batch signature into an aten
  graph and split (NOTE [tangent split]) into the part that reads only
  parameters and data — run once per kept batch, its results kept — and the
  part that reads the direction, run per product. A product on a kept batch is
  the tangent work only. Blocks of k directions go through ``vmap`` of the
  tangent part.
- ``"compiled"``: the same split, with the tangent part compiled by inductor
  (NOTE [compile policy]).
- ``"auto"``: chosen per operator from measurement (:class:`AutoChoice`).

Cost: tracing is host work (about a second per thousand graph nodes),
paid once per batch signature; a kept batch costs the primal part once
(forward, plus the backward for the Hessian); each product then costs the
tangent part. Kept state is about the activations the tangent part reads.
"""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import itertools
import json
import os
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import torch
from torch import nn
from torch.utils import _pytree as pytree

from hessian_eigenthings import _torch_compat
from hessian_eigenthings._warnings import user_stacklevel
from hessian_eigenthings.batching import Batch

EngineName = Literal["auto", "autograd", "functional", "compiled"]
ENGINES: tuple[str, ...] = ("auto", "autograd", "functional", "compiled")


class CompileFallbackWarning(RuntimeWarning):
    """Compiling a product failed (or kept recompiling); products run on the functional engine."""


class EngineMismatchWarning(RuntimeWarning):
    """``auto``'s timing runs gave different products on two engines: it keeps ``autograd``."""


#: relative difference between two engines' products beyond which ``auto`` distrusts the traced
#: one (rounding differs between engines, a wrong trace differs by O(1))
MISMATCH_TOL: dict[torch.dtype, float] = {torch.float64: 1e-8, torch.float32: 1e-3}


class EngineUnsupportedError(ValueError):
    """The chosen engine cannot run this model or batch; the message names the alternative."""


class FunctionalCurvature(Protocol):
    """What an engine needs from an operator."""

    model: nn.Module
    params: list[nn.Parameter]

    def functional_product(
        self, state: dict[str, torch.Tensor], batch: Batch, tangent: list[torch.Tensor]
    ) -> list[torch.Tensor]:
        """The per-batch product for one direction, a pure function of ``state``
        (every parameter and buffer of the model, by registered name) and the batch."""
        ...


# NOTE [tangent split]
# `make_fx` traces the whole product — parameters, buffers, batch tensors and
# the direction as inputs — into one aten graph. Every node that depends on
# the direction (transitively) belongs to the tangent part; the others form
# the primal part, whose values read by the tangent part ("kept") are its
# outputs. For the Hessian `jvp(grad(loss))` the primal part is the forward
# and the first backward, the tangent part the rest, so a product on a kept
# batch does no primal work at all; for the GGN the primal part is the
# forward(s), and the loss-Hessian product and the backward are tangent work.
# Unlike `torch.func.linearize`, which folds the primal values into graph
# constants, the kept values are ordinary inputs of the tangent part: the
# compiled tangent part sees real strides (inductor's "cannot view a tensor
# with shape ... and strides ..." on constants of linearize's graph does not
# arise), and one compiled artifact serves every batch of a signature.
# A model whose Python reads tensor values (`.item()`, a data-dependent
# branch) cannot be traced with the batch as an input; it is then traced with
# the batch as a constant and the values it read baked in: such a program is
# valid for that batch only ("specialized") and is never reused for another.


def split_by_tangent(gm: torch.fx.GraphModule, n_primal: int) -> tuple[torch.fx.GraphModule, torch.fx.GraphModule, int]:
    """``gm(primals..., tangents...)`` as ``primal(primals...) -> kept`` and
    ``tangent(kept..., tangents...)``; returns both and the number of kept values."""
    graph = gm.graph
    ph = [n for n in graph.nodes if n.op == "placeholder"]
    dep: set[torch.fx.Node] = set(ph[n_primal:])
    for n in graph.nodes:
        if n.op not in ("placeholder", "output", "get_attr") and any(a in dep for a in n.all_input_nodes):
            dep.add(n)
    out_node = next(n for n in graph.nodes if n.op == "output")
    boundary: list[torch.fx.Node] = []
    seen: set[torch.fx.Node] = set()
    for n in graph.nodes:
        if n in dep or n is out_node:
            for a in n.all_input_nodes:
                if a not in dep and a not in seen:
                    seen.add(a)
                    boundary.append(a)
    primal_graph = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    primal_inputs = set(ph[:n_primal])
    for n in graph.nodes:
        if n in dep or n.op == "output" or (n.op == "placeholder" and n not in primal_inputs):
            continue
        env[n] = primal_graph.node_copy(n, lambda x: env[x])
    primal_graph.output(tuple(env[b] for b in boundary))
    primal_graph.eliminate_dead_code()
    tangent_graph = torch.fx.Graph()
    env2: dict[torch.fx.Node, torch.fx.Node] = {}
    for i, b in enumerate(boundary):
        p = tangent_graph.placeholder(f"kept_{i}")
        p.meta = dict(b.meta)
        env2[b] = p
    for n in graph.nodes:
        if n in dep:
            env2[n] = tangent_graph.node_copy(n, lambda x: env2[x])
    tangent_graph.output(torch.fx.node.map_arg(out_node.args[0], lambda x: env2[x]))
    tangent_graph.eliminate_dead_code()
    return torch.fx.GraphModule(gm, primal_graph), torch.fx.GraphModule(gm, tangent_graph), len(boundary)


@dataclass
class SplitProgram:
    """A traced product split by NOTE [tangent split]."""

    primal: torch.fx.GraphModule
    tangent: torch.fx.GraphModule
    num_kept: int
    #: identifies the tangent part (its code and input layouts): compiled artifacts are keyed by it
    key: str
    #: traced with the batch as an input (valid for every batch of its signature)
    general: bool
    trace_s: float
    nodes: int
    #: a specialized program whose Python read the value of a parameter or buffer (so it is
    #: valid only while they are unchanged; NOTE [what a specialized program read])
    reads_state: bool = True
    #: the tangent part for blocks of k directions (traced through vmap), by k
    blocks: dict[int, torch.fx.GraphModule] = field(default_factory=dict)
    #: compiled tangent parts by k (None: compiling failed, the eager one runs)
    compiled: dict[int, Any] = field(default_factory=dict)


@dataclass
class SplitState:
    """A kept batch: the program and the primal values its tangent part reads."""

    program: SplitProgram
    kept: tuple[torch.Tensor, ...]


def _leaf_sig(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return ("T", tuple(x.shape), x.dtype, str(x.device), x.requires_grad)
    if x is None or isinstance(x, (bool, int, float, str)):
        return ("V", x)
    return None


def batch_signature(batch: Batch) -> tuple[Any, ...] | None:
    """Tree structure, tensor shapes/dtypes and plain values of ``batch``; ``None`` when a
    leaf is neither a tensor nor a plain value (such batches are traced per batch)."""
    leaves, spec = pytree.tree_flatten(batch)
    sig = [_leaf_sig(x) for x in leaves]
    if any(s is None for s in sig):
        return None
    return (str(spec), tuple(sig))


#: programs specialized to one batch kept per engine (a few batches cycled through products)
MAX_SPECIALIZED = 4


def _batch_identity(batch: Batch, model: nn.Module, reads_state: bool = True) -> tuple[Any, ...]:
    """What a specialized program may have baked in: the values its Python read can come from
    the batch or (``reads_state``) from any parameter or buffer, so it is valid while the
    batch's tensors, its plain values, the modules' modes and (then) every parameter and buffer
    (object and version) are unchanged (NOTE [what a specialized program read])."""
    leaves = pytree.tree_leaves(batch)
    state = (
        tuple((id(t), t._version) for t in itertools.chain(model.parameters(), model.buffers()))
        if reads_state
        else None
    )
    return (
        tuple((id(x), x._version) if isinstance(x, torch.Tensor) else ("V", repr(x)) for x in leaves),
        state,
        tuple(m.training for m in model.modules()),
    )


# NOTE [what a specialized program read]
# A program traced with the batch as a constant has the values its Python read
# baked in. If those reads come from the batch alone (HF GPT-2 checks its
# attention mask with `.all()`: one read, of a tensor built from the batch),
# the program stays valid when the parameters change — an optimizer step between
# two tracked calls must not cost a new trace and compilation (it cost 20-60 s per
# call on GPT-2). Parameters and buffers are inputs of the trace, so a read that
# depends on them is a host-read node (`_local_scalar_dense`, `equal`, ...) with a
# path from an input; only then is the program keyed on the parameters' versions.
_HOST_READS = ("_local_scalar_dense", "aten.equal", "aten.is_nonzero", "aten.allclose", "aten.item")


def reads_inputs(gm: torch.fx.GraphModule) -> bool:
    """Whether a host read in ``gm`` depends on one of its inputs (NOTE [what a specialized
    program read])."""
    depends: dict[torch.fx.Node, bool] = {}
    for node in gm.graph.nodes:
        depends[node] = node.op == "placeholder" or any(depends.get(a, False) for a in node.all_input_nodes)
        if node.op == "call_function" and depends[node] and any(h in str(node.target) for h in _HOST_READS):
            return True
    return False


def _is_data_dependent(exc: BaseException) -> bool:
    text = str(exc)
    return "data-dependent" in text or "_local_scalar_dense" in text or "data dependent" in text


class _Tracer:
    """Traces an operator's ``functional_product`` into :class:`SplitProgram` objects."""

    def __init__(self, op: FunctionalCurvature) -> None:
        self.op = op
        self.names = _selected_names(op)

    def inputs(self) -> tuple[list[str], dict[str, torch.Tensor]]:
        """Names of the other parameters and buffers, and all state tensors detached."""
        model = self.op.model
        state = {n: t.detach() for n, t in model.named_parameters()}
        state.update({n: t.detach() for n, t in model.named_buffers()})
        others = [n for n in state if n not in set(self.names)]
        return others, state

    def trace(self, batch: Batch, general: bool) -> SplitProgram:
        from torch.fx.experimental.proxy_tensor import make_fx

        others, state = self.inputs()
        names = self.names
        n_sel, n_other = len(names), len(others)
        leaves, spec = pytree.tree_flatten(batch)
        tensor_pos = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)] if general else []
        op = self.op

        def product(*args: torch.Tensor) -> list[torch.Tensor]:
            sel, oth = args[:n_sel], args[n_sel : n_sel + n_other]
            rest = args[n_sel + n_other :]
            if general:
                flat = list(leaves)
                for i, t in zip(tensor_pos, rest[: len(tensor_pos)], strict=True):
                    flat[i] = t
                b = pytree.tree_unflatten(flat, spec)
                tangent = list(rest[len(tensor_pos):])
            else:
                b, tangent = batch, list(rest)
            full = dict(zip(names, sel, strict=True))
            full.update(zip(others, oth, strict=True))
            return list(op.functional_product(full, b, tangent))

        primals = [state[n] for n in names] + [state[n] for n in others] + [leaves[i] for i in tensor_pos]
        tangents = [torch.zeros_like(state[n]) for n in names]
        _torch_compat.load_forward_ad_decompositions()
        t0 = time.perf_counter()
        with _ElementwiseLosses():  # NOTE [losses without forward-mode rules]
            gm = _torch_compat.make_fx_real(product, data_dependent_ok=not general)(*primals, *tangents)
        reads_state = not general and reads_inputs(gm)
        primal, tangent, num_kept = split_by_tangent(gm, len(primals))
        trace_s = time.perf_counter() - t0
        del make_fx
        key = hashlib.sha1(tangent.code.encode()).hexdigest()[:16]
        return SplitProgram(
            primal, tangent, num_kept, key, general, trace_s, len(gm.graph.nodes), reads_state=reads_state
        )

    def primal_inputs(self, batch: Batch, program: SplitProgram) -> list[torch.Tensor]:
        others, state = self.inputs()
        out = [state[n] for n in self.names] + [state[n] for n in others]
        if program.general:
            out += [x for x in pytree.tree_leaves(batch) if isinstance(x, torch.Tensor)]
        return out


# NOTE [losses without forward-mode rules]
# Forward-over-reverse needs the forward-mode derivative of each loss's
# backward. In torch 2.13 that of `mse_loss_backward` is broken (eagerly
# "ZeroTensors are immutable"; under make_fx the process dies with a
# segmentation fault), and `huber_loss_backward` and
# `soft_margin_loss_backward` have none. While an engine traces a product,
# these losses are computed from elementwise operations instead (same values;
# a torch function mode, active for the trace only, so nothing of the user's
# changes), which every transform handles.


def _reduce(loss: torch.Tensor, reduction: str) -> torch.Tensor:
    if reduction == "mean":
        return loss.mean()
    if reduction == "sum":
        return loss.sum()
    if reduction == "none":
        return loss
    raise ValueError(f"{reduction} is not a valid value for reduction")


def _mse(input: torch.Tensor, target: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    a, b = torch.broadcast_tensors(input, target)
    d = a - b
    return _reduce(d * d, reduction)


def _huber(input: torch.Tensor, target: torch.Tensor, reduction: str = "mean", delta: float = 1.0) -> torch.Tensor:
    a, b = torch.broadcast_tensors(input, target)
    d = (a - b).abs()
    return _reduce(torch.where(d < delta, 0.5 * d * d, delta * (d - 0.5 * delta)), reduction)


def _soft_margin(input: torch.Tensor, target: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    return _reduce(nn.functional.softplus(-target * input), reduction)


_ELEMENTWISE_LOSSES: dict[Callable[..., Any], Callable[..., torch.Tensor]] = {
    nn.functional.mse_loss: _mse,
    nn.functional.huber_loss: _huber,
    nn.functional.soft_margin_loss: _soft_margin,
}


class _ElementwiseLosses(torch.overrides.TorchFunctionMode):
    """See NOTE [losses without forward-mode rules]."""

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        impl = _ELEMENTWISE_LOSSES.get(func)
        if impl is None:
            return func(*args, **kwargs)
        bound = inspect.signature(func).bind(*args, **kwargs)
        bound.apply_defaults()
        given = dict(bound.arguments)
        # the legacy size_average/reduce arguments and a per-element weight keep torch's own code
        if any(given.pop(k, None) is not None for k in ("size_average", "reduce", "weight")):
            return func(*args, **kwargs)
        return impl(**given)


def _selected_names(op: FunctionalCurvature) -> list[str]:
    ids = {id(p): n for n, p in op.model.named_parameters()}
    return [ids[id(p)] for p in op.params]


def check_functional_model(model: nn.Module, engine: str) -> None:
    """Refuse what the traced engines do not reproduce like ``autograd`` (modules in training mode
    with buffers or random forwards)."""
    for name, m in model.named_modules():
        if not m.training:
            continue
        if any(b is not None for b in m._buffers.values()):
            raise EngineUnsupportedError(
                f"engine={engine!r} traces the product with the model's buffers as inputs; module "
                f"{name or type(m).__name__!r} ({type(m).__name__}) is in training mode and updates its buffers "
                "in the forward (e.g. BatchNorm batch statistics). Call model.eval(), or pass engine='autograd'"
            )
        if isinstance(m, (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout)) and m.p > 0:
            raise EngineUnsupportedError(
                f"engine={engine!r} traces the product once; module {name!r} (dropout, p={m.p}) is in training "
                "mode and draws random masks. Call model.eval(), or pass engine='autograd'"
            )


class FunctionalEngine:
    """Runs an operator's ``functional_product`` through a traced tangent split."""

    name = "functional"

    def __init__(self, op: FunctionalCurvature) -> None:
        self.op = op
        self._tracer = _Tracer(op)
        #: general programs by (batch signature, modes)
        self._programs: dict[tuple[Any, ...], SplitProgram] = {}
        self._general_ok = True
        #: programs specialized to one batch, by batch identity (most recent last)
        self._specialized: list[tuple[tuple[Any, ...], SplitProgram]] = []
        self._vmap_ok: bool | None = None
        #: tracing time spent, and programs traced (for cost checks and reports)
        self.trace_s = 0.0
        self.num_traces = 0

    def program(self, batch: Batch) -> SplitProgram:
        sig = batch_signature(batch) if self._general_ok else None
        key = None if sig is None else (sig, tuple(m.training for m in self.op.model.modules()))
        if key is not None and key in self._programs:
            return self._programs[key]
        # a program specialized to one batch serves that batch again while it is unchanged
        # (same tensor objects, same versions): products whose state is not kept stay cheap
        idents = {flag: _batch_identity(batch, self.op.model, flag) for flag in (True, False)}
        for kept_ident, kept_prog in self._specialized:
            if kept_ident == idents[kept_prog.reads_state]:
                return kept_prog
        prog = None
        if key is not None:
            try:
                prog = self._tracer.trace(batch, general=True)
            except RuntimeError as exc:
                if not _is_data_dependent(exc):
                    raise
                self._general_ok = False  # see NOTE [tangent split]: trace per batch from now on
        if prog is None:
            prog = self._tracer.trace(batch, general=False)
        self.trace_s += prog.trace_s
        self.num_traces += 1
        if prog.general and key is not None:
            self._programs[key] = prog
        elif not prog.general:
            self._specialized = [*self._specialized[-(MAX_SPECIALIZED - 1):], (idents[prog.reads_state], prog)]
        return prog

    def prepare(self, batch: Batch) -> SplitState:
        check_functional_model(self.op.model, self.name)
        prog = self.program(batch)
        with torch.no_grad():
            kept = tuple(prog.primal(*self._tracer.primal_inputs(batch, prog)))
        return SplitState(prog, kept)

    def tangent_fn(self, prog: SplitProgram, k: int, args: tuple[torch.Tensor, ...]) -> torch.fx.GraphModule:
        """The tangent part for k directions: a graph of its own per k (vmap traced away), so
        each block width is one plain graph to run or compile."""
        if k == 1:
            return prog.tangent
        graph = prog.blocks.get(k)
        if graph is None:
            dims = (None,) * prog.num_kept + (0,) * (len(args) - prog.num_kept)
            batched = torch.func.vmap(prog.tangent, in_dims=dims)
            graph = _torch_compat.make_fx_real(batched, data_dependent_ok=True)(*args)
            prog.blocks[k] = graph
        return graph

    def apply(self, state: SplitState, vecs: list[torch.Tensor], retain: bool) -> Sequence[torch.Tensor | None]:
        del retain  # kept values are plain tensors
        k = vecs[0].shape[0]
        prog = state.program
        with torch.no_grad():
            if k == 1:
                out = self.run(prog, 1, (*state.kept, *(v[0] for v in vecs)))
                return [o.unsqueeze(0) for o in out]
            if self._vmap_ok is not False:
                try:
                    res = list(self.run(prog, k, (*state.kept, *vecs)))
                except (RuntimeError, NotImplementedError):
                    if self._vmap_ok:
                        raise
                    self._vmap_ok = False
                else:
                    self._vmap_ok = True
                    return res
            rows = [self.run(prog, 1, (*state.kept, *(v[j] for v in vecs))) for j in range(k)]
            return [torch.stack([r[i] for r in rows]) for i in range(len(vecs))]

    def run(self, prog: SplitProgram, k: int, args: tuple[torch.Tensor, ...]) -> Sequence[torch.Tensor]:
        return self.tangent_fn(prog, k, args)(*args)

    def describe(self) -> dict[str, Any]:
        return {"engine": self.name, "traces": self.num_traces, "trace_s": round(self.trace_s, 3)}


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
#   inductor's cache and compiles in a fraction of the time.


MAX_COMPILATIONS = 16


class CompiledEngine(FunctionalEngine):
    """The functional engine with the tangent part compiled by inductor (NOTE [compile policy])."""

    name = "compiled"

    def __init__(self, op: FunctionalCurvature) -> None:
        super().__init__(op)
        self._warned = False
        self.compile_s = 0.0
        self.num_compilations = 0
        self.num_fallbacks = 0

    def run(self, prog: SplitProgram, k: int, args: tuple[torch.Tensor, ...]) -> Sequence[torch.Tensor]:
        fn = prog.compiled.get(k, ...)
        if fn is None:
            return super().run(prog, k, args)
        # The compiled code assumes the layouts it was compiled for. Kept values come out of the
        # same primal graph every time (same layouts, passed as they are: no copy per product);
        # directions are views of the caller's block, made contiguous (a copy only for k > 1).
        m = prog.num_kept
        args = args[:m] + tuple(a if a.is_contiguous() else a.contiguous() for a in args[m:])
        if fn is not ...:
            return fn(*args)
        if self.num_compilations >= MAX_COMPILATIONS:
            self._fallback(prog, k, RuntimeError(
                f"{MAX_COMPILATIONS} compilations already: this model is traced per batch (its Python reads "
                "tensor values), so every new batch would compile again"
            ))
            return super().run(prog, k, args)
        tangent = self.tangent_fn(prog, k, args)
        t0 = time.perf_counter()
        try:
            if not _torch_compat.compile_supported():
                raise RuntimeError("torch.compile does not support this Python")
            compiler = _torch_compat.inductor_backend()
            with _quiet_compile():
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
        record_compile(prog, k, seconds)
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
        out.update(compilations=self.num_compilations, compile_s=round(self.compile_s, 2), fallbacks=self.num_fallbacks)
        return out


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
    rets = target._schema.returns
    return bool(rets) and rets[0].alias_info is not None and isinstance(node.args[0], torch.fx.Node)


def views_as_reshapes(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A copy of ``gm`` whose ``aten.view`` nodes read ``aten.reshape`` where no tensor sharing
    their storage is written in place (NOTE [views the compiler may not keep])."""
    view, reshape = torch.ops.aten.view.default, torch.ops.aten.reshape.default
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
            assert isinstance(base, torch.fx.Node)
            root[find(n)] = find(base)
            if n.target._schema.is_mutable:
                written.append(base)
    dirty = {find(n) for n in written}
    graph = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    for node in nodes:
        new = graph.node_copy(node, lambda x: env[x])
        if node.target is view and find(node) not in dirty:
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
    base = os.environ.get("TORCHINDUCTOR_CACHE_DIR") or os.path.join(
        os.environ.get("TMPDIR", "/tmp"), f"torchinductor_{os.environ.get('USER', 'user')}"
    )
    return os.path.join(base, "hessian_eigenthings_compile_times.json")


def record_compile(prog: SplitProgram, k: int, seconds: float) -> None:
    """Remember a compile time beside inductor's cache (best effort: a read-only cache is fine)."""
    path = _record_path()
    try:
        data: dict[str, Any] = {}
        if os.path.exists(path):
            with open(path) as f:
                data = json.load(f)
        data[f"{prog.key}:{k}"] = {"compile_s": round(seconds, 3), "nodes": prog.nodes}
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            json.dump(data, f)
    except (OSError, ValueError):
        pass


def recorded_compile_s(prog: SplitProgram, k: int) -> float | None:
    try:
        with open(_record_path()) as f:
            entry = json.load(f).get(f"{prog.key}:{k}")
    except (OSError, ValueError):
        return None
    return None if entry is None else float(entry["compile_s"])


# NOTE [auto engine]
# `engine="auto"` decides per operator, from measurement, once the operator
# knows how many products are coming (algorithms declare their budget with
# `op.expect_products(n)`; a bare `op @ v` assumes few):
# - fewer than AUTO_MIN_PRODUCTS expected: "autograd" (nothing is traced);
# - otherwise the first kept batch is timed on "autograd" and "functional"
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

    def as_dict(self) -> dict[str, Any]:
        return {
            "chosen": self.chosen,
            "expected_products": self.expected_products,
            "timings_ms": {k: round(v, 3) for k, v in self.timings_ms.items()},
            "compile_estimate_s": None if self.compile_estimate_s is None else round(self.compile_estimate_s, 1),
            "reason": self.reason,
        }


def compile_estimate(prog: SplitProgram, k: int) -> float:
    recorded = recorded_compile_s(prog, k)
    if recorded is not None:
        return recorded
    return COMPILE_PRIOR_S + COMPILE_S_PER_NODE * len(prog.tangent.graph.nodes)


def timed(device: torch.device, fn: Callable[[], Any]) -> tuple[Any, float]:
    """``fn()`` and its wall time in ms (synchronised on CUDA)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    out = fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return out, (time.perf_counter() - t0) * 1e3


AUTO_MIN_RUN_MS = 20_000.0


class EngineHost(FunctionalCurvature, Protocol):
    """The operator as the selector sees it."""

    @property
    def device(self) -> torch.device: ...

    num_passes: int
    num_forwards: int
    supports_functional: bool

    def _prepare(self, batch: Batch) -> Any: ...

    def _engine_batch(self, batch: Batch) -> Batch: ...

    def _apply(self, state: Any, vecs: list[torch.Tensor], retain: bool) -> Sequence[torch.Tensor | None]: ...

    def _pass(self, V: torch.Tensor, out: torch.Tensor) -> None: ...

    def clear_cache(self) -> None: ...

    def _reuse_enabled(self) -> bool: ...

    @property
    def _states(self) -> Any: ...

    def functional_unsupported_reason(self) -> str: ...


class EngineSelector:
    """Owns an operator's engine: which one runs its per-batch products, and ``auto``'s choice.

    The operator calls :meth:`prepare` / :meth:`apply` where it would call its own
    ``_prepare`` / ``_apply`` (its autograd engine), and :meth:`before_block` before a
    block product; everything else (data loop, kept states, weighting) stays the operator's.
    """

    def __init__(self, op: EngineHost, engine: str) -> None:
        if engine not in ENGINES:
            raise ValueError(f"engine must be one of {ENGINES}, got {engine!r}")
        self.op = op
        self.requested = engine
        self.expected_products = 1
        self.auto = AutoChoice(chosen="autograd", reason="undecided")
        self._impl: FunctionalEngine | None = None
        self._decided = engine != "auto"
        self.trial_products = 0
        if engine in ("functional", "compiled"):
            self._impl = self._make(engine)

    # -- which engine ---------------------------------------------------------------
    @property
    def active(self) -> str:
        return "autograd" if self._impl is None else self._impl.name

    def _make(self, name: str) -> FunctionalEngine:
        if not self.op.supports_functional:
            raise EngineUnsupportedError(
                f"engine={name!r} is not available for {type(self.op).__name__} with these options "
                f"({self.op.functional_unsupported_reason()}); pass engine='autograd'"
            )
        return CompiledEngine(self.op) if name == "compiled" else FunctionalEngine(self.op)

    def _switch(self, name: str) -> None:
        if name == self.active:
            return
        old = self._impl
        if name == "autograd":
            self._impl = None
        else:
            new = self._make(name)
            if old is not None:  # traced programs carry over: no second trace
                new._programs = old._programs
                new._general_ok = old._general_ok
                new._specialized = old._specialized
            self._impl = new
        self.op.clear_cache()

    # -- the hooks the operator calls -------------------------------------------------
    def prepare(self, batch: Batch) -> Any:
        if self._impl is None:
            return self.op._prepare(batch)
        # what the traced product reads besides the batch, as inputs (NOTE [sampled targets as data])
        return self._impl.prepare(self.op._engine_batch(batch))

    def apply(self, state: Any, vecs: list[torch.Tensor], retain: bool) -> Sequence[torch.Tensor | None]:
        if self._impl is None:
            return self.op._apply(state, vecs, retain)
        return self._impl.apply(state, vecs, retain)

    @property
    def traced(self) -> bool:
        """Whether products run through a traced program (math attention, functional checks)."""
        return self._impl is not None

    @property
    def recordable(self) -> bool:
        """Whether the operator may record this engine's products as CUDA graphs: both traced
        engines' are plain tensor programs (the compiled one's first run, which compiles, is
        eager; the recording reads the kept values in place and copies only the directions)."""
        return self.active in ("functional", "compiled")

    def expect(self, n: int) -> None:
        self.expected_products = max(1, int(n))

    def before_block(self, V: torch.Tensor, out: torch.Tensor) -> bool:
        """``auto``: decide on this block if the run is long enough (NOTE [auto engine]).
        Returns True when ``out`` already holds ``A V`` (the decision's last product)."""
        if self._decided:
            return False
        if self.expected_products < AUTO_MIN_PRODUCTS:
            return False  # few products: autograd, undecided (a later budget may change that)
        self._decided = True
        a = self.auto
        a.expected_products = self.expected_products
        if not self.op.supports_functional:
            a.chosen, a.reason = "autograd", f"functional engines unavailable ({self.op.functional_unsupported_reason()})"
            return False
        if not getattr(self.op, "auto_trials", True):
            a.chosen, a.reason = "autograd", "ranks must agree: distributed operators take engine= explicitly"
            return False
        if not (self.op._reuse_enabled() and self.op._states.may_keep()):
            a.chosen, a.reason = "autograd", "batches are not kept between products (no state for a traced engine to reuse)"
            return False
        try:
            check_functional_model(self.op.model, "functional")
        except EngineUnsupportedError as exc:
            a.chosen, a.reason = "autograd", str(exc).split(";")[1].strip() if ";" in str(exc) else str(exc)
            return False
        # the first product is the run's own (counted) and sizes the run
        self._switch("autograd")
        _, first = timed(self.op.device, lambda: self.op._pass(V, out))
        a.timings_ms["autograd_first"] = first / V.shape[0]
        if first / V.shape[0] * self.expected_products < AUTO_MIN_RUN_MS:
            a.chosen, a.reason = "autograd", f"short run: expected products x product time under {AUTO_MIN_RUN_MS / 1e3:.0f} s"
            return True
        # the trial runs single products (a few per engine, whatever the block width) into a
        # scratch row; they are reported (trial_products), not counted as the run's
        passes, forwards = self.op.num_passes, self.op.num_forwards
        try:
            self._trial(V[:1], out[:1].clone(), out[:1].clone())
        finally:
            self.op.num_passes, self.op.num_forwards = passes, forwards
        return True

    def _trial_pass(self, V: torch.Tensor, out: torch.Tensor) -> None:
        self.trial_products += V.shape[0]
        self.op._pass(V, out)

    def _time_engine(self, name: str, V: torch.Tensor, out: torch.Tensor, warm: bool) -> float:
        """Best of two timed passes on ``name`` (after one untimed pass that builds its state,
        unless ``warm``)."""
        self._switch(name)
        if not warm:
            self._trial_pass(V, out)
        best = float("inf")
        for _ in range(2):
            _, ms = timed(self.op.device, lambda: self._trial_pass(V, out))
            best = min(best, ms)
        return best

    def _trial(self, V: torch.Tensor, out: torch.Tensor, reference: torch.Tensor) -> None:
        a = self.auto
        a.timings_ms["autograd"] = self._time_engine("autograd", V, out, warm=True)
        try:
            a.timings_ms["functional"] = self._time_engine("functional", V, out, warm=False)
        except (RuntimeError, NotImplementedError, EngineUnsupportedError) as exc:
            self._switch("autograd")
            a.chosen, a.reason = "autograd", f"functional engine failed: {type(exc).__name__}: {str(exc)[:120]}"
            return
        diff = float(torch.linalg.vector_norm(out - reference) / torch.linalg.vector_norm(reference).clamp_min(1e-30))
        if not diff <= MISMATCH_TOL.get(out.dtype, 5e-2):
            self._switch("autograd")
            a.chosen, a.reason = "autograd", f"the functional product differed from autograd's by {diff:.1e} (relative)"
            warnings.warn(
                f"{type(self.op).__name__}: engine='auto' compared the traced product with autograd's and they "
                f"differ by {diff:.1e} (relative); keeping engine='autograd'. A loss or model that writes into "
                "preallocated buffers or reads global state can do this; please report it",
                EngineMismatchWarning,
                stacklevel=user_stacklevel(),
            )
            return
        best = min(("autograd", "functional"), key=lambda name: a.timings_ms[name])
        impl = self._impl
        assert impl is not None
        progs = list(impl._programs.values())
        k = V.shape[0]
        remaining = max(0, self.expected_products - 7 * k) / k  # passes left after the trial
        if progs and _torch_compat.compile_supported():
            est = sum(compile_estimate(p, k) for p in progs)
            a.compile_estimate_s = est
            saving_ms = a.timings_ms[best] - (1 - COMPILED_SAVING) * a.timings_ms["functional"]
            if remaining * saving_ms / 1e3 > est:
                a.timings_ms["compiled"] = self._time_engine("compiled", V, out, warm=False)
                if a.timings_ms["compiled"] < a.timings_ms[best]:
                    a.chosen, a.reason = "compiled", "expected saving exceeds the compile time"
                    return
        a.chosen = best
        a.reason = "measured faster" + ("" if a.compile_estimate_s is None else "; compiling would not pay")
        self._switch(best)

    def report(self) -> dict[str, Any]:
        out: dict[str, Any] = {"requested": self.requested, "active": self.active}
        if self.requested == "auto":
            out["auto"] = self.auto.as_dict()
            out["trial_products"] = self.trial_products
        if self._impl is not None:
            out.update(self._impl.describe())
        return out


