"""Tracing a curvature's pure product into a program split by the direction (NOTE [tangent split]).

:class:`Tracer` traces ``product(state, batch, tangent)`` (parameters and buffers by registered
name) into one aten graph (``trace_real``: recorded, NOTE [recording a trace] in ``recorder``,
or by ``make_fx``) and splits it into the part that reads only parameters and data (run once per
kept batch) and the part that reads the direction (run per product). Cost: host work once per
batch signature, the ops' own time plus tens of microseconds per graph node when recorded (about
a millisecond per node through ``make_fx``).
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import itertools
import operator
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from keyword import iskeyword
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from hessian_eigenthings import _torch_compat
from hessian_eigenthings.batching import Batch
from hessian_eigenthings.loss_fns.forward_rules import ElementwiseLosses
from hessian_eigenthings.operators.engines.bytecode_cache import program_code
from hessian_eigenthings.operators.engines.recorder import Recording, Ref, record_real

#: a curvature's per-batch product for one direction as a pure function of ``state`` (every
#: parameter and buffer of the model, by registered name), the batch and the tangent
PureProduct = Callable[[dict[str, torch.Tensor], Batch, list[torch.Tensor]], Sequence[torch.Tensor]]


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
# branch) has the values it read baked in. When a value read depends on no
# input (HF GPT-2 asks whether positions it built with `arange` are packed
# sequences: a function of the shapes alone), the program stays general.
# When it depends on an input, the program is valid for that batch only
# ("specialized", kept by the batch's identity) and is never reused for
# another. A model that cannot be traced with the batch as an input at all is
# traced with the batch as a constant, also specialized. Measured (CPU, HF
# GPT-2 4 layers d768, 16 tokens): tracing as general used to stop at the
# first value read (0.8 s) and trace again with the batch as a constant
# (7.5 s), and every further batch traced again.


def from_graph_module(gm: torch.fx.GraphModule) -> Recording:
    """``gm`` (an aten graph of call_function nodes, as make_fx writes) as a :class:`Recording`."""
    phs = [n for n in gm.graph.nodes if n.op == "placeholder"]
    rec = Recording(len(phs))
    env: dict[torch.fx.Node, Ref] = dict(zip(phs, rec.inputs, strict=True))
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            value: Any = gm
            for part in str(node.target).split("."):
                value = getattr(value, part)
            env[node] = Ref("constant", len(rec.constants))
            rec.constants.append(value)
        elif node.op == "call_function" and node.target is operator.getitem:
            base = env[node.args[0]]
            env[node] = Ref("op", base.i, int(node.args[1]))
        elif node.op == "call_function":
            reads: list[Ref] = []

            def sub(x: torch.fx.Node, reads: list[Ref] = reads) -> Any:
                reads.append(env[x])
                return env[x]

            args = torch.fx.node.map_arg(node.args, sub)
            kwargs = torch.fx.node.map_arg(node.kwargs, sub)
            env[node] = Ref("op", len(rec.ops))
            rec.ops.append((node.target, args, dict(kwargs), reads))
        elif node.op == "output":
            out = node.args[0]
            rec.sequence = isinstance(out, (list, tuple))
            rec.outputs = [env[x] for x in (out if rec.sequence else [out])]
        elif node.op != "placeholder":
            raise ValueError(f"unexpected {node.op} node {node.name} in an aten graph")
    return rec


def _mutates(func: Any) -> bool:
    schema = getattr(func, "_schema", None)
    return bool(schema is not None and schema.is_mutable)


def _live(rec: Recording, roots: Sequence[Ref], among: Sequence[bool] | None = None) -> list[bool]:
    """Ops needed for ``roots`` (and ops that write into their arguments), among ``among``."""
    ops = rec.ops
    needed = {r.i for r in roots if r.kind == "op"}
    live = [False] * len(ops)
    for j in range(len(ops) - 1, -1, -1):
        if among is not None and not among[j]:
            continue
        func, _, _, reads = ops[j]
        if j in needed or _mutates(func):
            live[j] = True
            needed.update(r.i for r in reads if r.kind == "op")
    return live


@dataclass(frozen=True)
class Part:
    """The ``live`` ops of ``rec`` from ``placeholders`` (refs and names) to ``outputs`` (a
    tuple of them if ``sequence``, else the one); ``root`` holds the constants."""

    rec: Recording
    root: nn.Module
    live: Sequence[bool]
    placeholders: Sequence[tuple[Ref, str]]
    outputs: Sequence[Ref]
    sequence: bool


def _emit(part: Part) -> torch.fx.GraphModule:
    """``part`` as an FX GraphModule."""
    rec, placeholders = part.rec, part.placeholders
    graph = torch.fx.Graph()
    env: dict[int, torch.fx.Node] = {}
    op_node: dict[int, torch.fx.Node] = {}
    for r, name in placeholders:
        env[id(r)] = graph.placeholder(name)

    def node(r: Ref) -> torch.fx.Node:
        n = env.get(id(r))
        if n is None:
            if r.kind == "constant":
                n = graph.get_attr(f"_tensor_constant{r.i}")
            elif r.item < 0:
                n = op_node[r.i]
            else:
                n = graph.call_function(operator.getitem, (op_node[r.i], r.item))
            env[id(r)] = n
        return n

    def sub(x: Any) -> Any:
        if isinstance(x, Ref):
            return node(x)
        if isinstance(x, (list, tuple)):
            return type(x)([sub(a) for a in x]) if x else x
        if isinstance(x, dict):
            return {k: sub(v) for k, v in x.items()}
        return x

    for j, (func, args, kwargs, _) in enumerate(rec.ops):
        if part.live[j]:
            op_node[j] = graph.call_function(func, sub(args), sub(kwargs))
    results = [node(r) for r in part.outputs]
    graph.output(tuple(results) if part.sequence else results[0])
    return torch.fx.GraphModule(part.root, graph)


# NOTE [programs written directly]
# The primal and tangent programs run as Python functions written from the
# recording's live ops: one line per op, calling the op's overload (a global of
# the function, not `torch.ops.aten.<name>.<overload>` looked up per call), and
# a `del` after each value's last use, so intermediates are freed as early as
# in FX's code. FX graphs (`Program.module`) are built only when something asks
# for one (the compiled engine hands it to inductor; benchmarks and tests read
# its nodes): on GPT-2 12L's graph at d64 (CPU, torch 2.13), making the two
# GraphModules (nodes, FX's code, its compilation) took about half of the
# 0.86 s trace. The text opens with a comment per global (the op overload, an
# argument such as a dtype or device, a constant's layout), so that it names
# everything FX's code named: the program's key is a digest of it.

_LITERALS = (bool, int, str, type(None))


class Program:
    """The live ops of a recording between ``placeholders`` and ``outputs``, as a Python
    function (NOTE [programs written directly]); ``module``: the same program as an FX
    GraphModule, made on first use."""

    def __init__(self, part: Part) -> None:
        self.part = part
        self._module: torch.fx.GraphModule | None = None
        self.code, env = _write(part)
        scope: dict[str, Any] = {}
        #: where the bytecode came from: "compiled", "process" or "disk" (NOTE [stored bytecode])
        code, self.code_from = program_code(self.code, "<hessian_eigenthings program>")
        exec(code, env, scope)
        self.fn: Callable[..., Any] = scope["program"]
        #: what the FX graph would count: placeholders, ops, their picked outputs, constants, output
        self.num_nodes: int = env.pop("__nodes__")

    def __call__(self, *args: torch.Tensor) -> Any:
        return self.fn(*args)

    @property
    def module(self) -> torch.fx.GraphModule:
        if self._module is None:
            self._module = _emit(self.part)
        return self._module

    @property
    def graph(self) -> torch.fx.Graph:
        return self.module.graph


def _write(part: Part) -> tuple[str, dict[str, Any]]:
    """The source of ``program(...)`` and its globals (NOTE [programs written directly])."""
    rec, live, placeholders, outputs = part.rec, part.live, part.placeholders, part.outputs
    env: dict[str, Any] = {}
    bound: dict[int, str] = {}

    def bind(value: Any, prefix: str) -> str:
        name = bound.get(id(value))
        if name is None:
            name = f"{prefix}{len(bound)}"
            bound[id(value)] = name
            env[name] = value
        return name

    names: dict[int, str] = {}  # id(ref) -> variable
    args = []
    for i, (r, _) in enumerate(placeholders):
        names[id(r)] = f"a{i}"
        args.append(f"a{i}")
    picked: set[tuple[int, int]] = set()
    consts: set[int] = set()

    def var(r: Ref) -> str:
        known = names.get(id(r))
        if known is not None:
            return known
        if r.kind == "constant":
            consts.add(r.i)
            return bind(rec.constants[r.i], "c")
        if r.item < 0:
            return f"v{r.i}"
        picked.add((r.i, r.item))
        return f"v{r.i}_{r.item}"

    def src(x: Any) -> str:
        if isinstance(x, Ref):
            return var(x)
        t = type(x)
        if t in _LITERALS or (t is float and x == x and abs(x) != float("inf")):
            return repr(x)
        if isinstance(x, list):  # FX's immutable lists too (a make_fx trace)
            return "[" + ", ".join(src(a) for a in x) + "]"
        if isinstance(x, tuple) and t is not torch.Size:
            return "(" + "".join(src(a) + ", " for a in x) + ")"
        return bind(x, "k")

    lines: list[tuple[str, list[str], str]] = []  # (code, names read, name defined)
    for j, (func, a, kw, _) in enumerate(rec.ops):
        if not live[j]:
            continue
        named = [f"{k}={src(v)}" for k, v in kw.items() if k.isidentifier() and not iskeyword(k)]
        odd = [f"{k!r}: {src(v)}" for k, v in kw.items() if not k.isidentifier() or iskeyword(k)]
        call = ", ".join(
            [src(x) for x in a] + named + (["**{" + ", ".join(odd) + "}"] if odd else [])
        )
        read = [var(r) for r in rec.ops[j][3] if r.kind != "constant"]
        lines.append((f"v{j} = {bind(func, 'f')}({call})", read, f"v{j}"))
    result = [var(r) for r in outputs]
    # picked outputs of multi-output ops: taken right after the op, the tuple dropped
    by_op: dict[int, list[int]] = {}
    for i, item in sorted(picked):
        by_op.setdefault(i, []).append(item)
    body: list[tuple[str, list[str], str]] = []
    for code, read, name in lines:
        body.append((code, read, name))
        j = int(name[1:])
        for item in by_op.get(j, ()):
            body.append((f"v{j}_{item} = v{j}[{item}]", [name], f"v{j}_{item}"))
    last: dict[str, int] = {}
    for n, (_, read, name) in enumerate(body):
        last.setdefault(name, n)
        for v in read:
            last[v] = n
    keep = set(result) | set(args)
    dead_after: dict[int, list[str]] = {}
    for v, n in last.items():
        if v not in keep:
            dead_after.setdefault(n, []).append(v)
    # what each global is, so that the text names everything the program computes with (the
    # program's key is a digest of it, NOTE [compile policy]); readable where it is printed
    out = [f"# {name}: {_describe(value)}" for name, value in env.items()]
    out.append("def program(" + ", ".join(args) + "):")
    for n, (code, _, _) in enumerate(body):
        out.append("    " + code)
        if n in dead_after:
            out.append("    del " + ", ".join(dead_after[n]))
    ret = "(" + "".join(r + ", " for r in result) + ")" if part.sequence else result[0]
    out.append(f"    return {ret}")
    env["__nodes__"] = len(placeholders) + len(lines) + len(picked) + len(consts) + 1
    return "\n".join(out) + "\n", env


def _describe(value: Any) -> str:
    """A global of a written program in one line (a constant tensor by its layout, not its
    values, as an FX graph's code names its constants)."""
    if isinstance(value, torch.Tensor):
        return f"tensor {tuple(value.shape)} {value.dtype} {value.device.type}"
    if isinstance(value, torch._ops.OpOverload):
        return str(value)  # aten.sin.default
    return repr(value).replace("\n", " ")


def _constants_root(rec: Recording) -> nn.Module:
    root = nn.Module()
    for i, c in enumerate(rec.constants):
        setattr(root, f"_tensor_constant{i}", c)
    return root


def to_graph_module(rec: Recording) -> torch.fx.GraphModule:
    """``rec`` as one GraphModule of its inputs (ops nothing needs are left out)."""
    return _emit(
        Part(
            rec,
            _constants_root(rec),
            _live(rec, rec.outputs),
            [(r, f"arg{r.i}") for r in rec.inputs],
            rec.outputs,
            rec.sequence,
        )
    )


def _depends(rec: Recording, inputs: Sequence[Ref]) -> list[bool]:
    """For each op of ``rec``, whether it reads (transitively) one of ``inputs``."""
    ids = {id(r) for r in inputs}
    dep = [False] * len(rec.ops)
    for j, (_, _, _, reads) in enumerate(rec.ops):
        dep[j] = any((r.kind == "op" and dep[r.i]) or id(r) in ids for r in reads)
    return dep


def split_recording(rec: Recording, n_primal: int) -> tuple[Program, Program, int]:
    """``rec(primals..., tangents...)`` as ``primal(primals...) -> kept`` and
    ``tangent(kept..., tangents...)`` (NOTE [tangent split]); returns both and the number of
    kept values. Ops nothing needs are left out of both."""
    ops = rec.ops
    tangent_inputs = {id(r) for r in rec.inputs[n_primal:]}
    dep = _depends(rec, rec.inputs[n_primal:])

    def is_dep(r: Ref) -> bool:
        return (r.kind == "op" and dep[r.i]) or id(r) in tangent_inputs

    live = _live(rec, rec.outputs)
    tangent_live = [lv and d for lv, d in zip(live, dep, strict=True)]
    boundary: list[Ref] = []
    seen: set[int] = set()
    for reads in [ops[j][3] for j in range(len(ops)) if tangent_live[j]] + [rec.outputs]:
        for r in reads:
            if not is_dep(r) and id(r) not in seen and r.kind != "constant":
                seen.add(id(r))
                boundary.append(r)
    primal_live = _live(
        rec, boundary, among=[lv and not d for lv, d in zip(live, dep, strict=True)]
    )
    root = _constants_root(rec)
    primal = Program(
        Part(
            rec,
            root,
            primal_live,
            [(r, f"arg{r.i}") for r in rec.inputs[:n_primal]],
            boundary,
            True,
        )
    )
    tangent_in = [(r, f"kept_{i}") for i, r in enumerate(boundary)]
    tangent_in += [(r, f"arg{r.i}") for r in rec.inputs[n_primal:]]
    tangent = Program(Part(rec, root, tangent_live, tangent_in, rec.outputs, rec.sequence))
    return primal, tangent, len(boundary)


def split_by_tangent(gm: torch.fx.GraphModule, n_primal: int) -> tuple[Program, Program, int]:
    """``gm(primals..., tangents...)`` as ``primal(primals...) -> kept`` and
    ``tangent(kept..., tangents...)``; returns both and the number of kept values."""
    return split_recording(from_graph_module(gm), n_primal)


@dataclass
class SplitProgram:
    """A traced product split by NOTE [tangent split]."""

    primal: Program
    tangent: Program
    num_kept: int
    #: identifies the tangent part (its code and input layouts): compiled artifacts are keyed by it
    key: str
    #: valid for every batch of its signature (traced with the batch as an input, reading no
    #: input's value)
    general: bool
    trace_s: float
    nodes: int
    #: a specialized program whose Python read the value of a parameter or buffer (so it is
    #: valid only while they are unchanged; NOTE [what a specialized program read])
    reads_state: bool = True
    #: the batch's tensors are inputs of the primal part (a general program, or one traced as
    #: general whose Python then read an input's value: specialized, NOTE [tangent split])
    takes_batch: bool = False
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


def batch_identity(batch: Batch, model: nn.Module, reads_state: bool = True) -> tuple[Any, ...]:
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
        tuple(
            (id(x), x._version) if isinstance(x, torch.Tensor) else ("V", repr(x)) for x in leaves
        ),
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


def reads_inputs(rec: Recording, first: int | None = None) -> bool:
    """Whether a host read in ``rec`` depends on one of its inputs (the ``first`` ones only, if
    given; NOTE [what a specialized program read])."""
    funcs = {func for func, _, _, _ in rec.ops}
    host = {f for f in funcs if any(h in str(f) for h in _HOST_READS)}
    if not host:  # most programs read no value at all: no dependence walk
        return False
    depends = _depends(rec, rec.inputs if first is None else rec.inputs[:first])
    return any(d and func in host for d, (func, _, _, _) in zip(depends, rec.ops, strict=True))


def is_data_dependent(exc: BaseException) -> bool:
    text = str(exc)
    return "data-dependent" in text or "_local_scalar_dense" in text or "data dependent" in text


#: how programs are traced: "record" (``recorder.record_real``, NOTE [recording a trace]; make_fx
#: where recording fails) or "make_fx"
TRACER = "record"


def trace_real(fn: Callable[..., Any], args: Sequence[torch.Tensor]) -> Recording:
    """``fn(*args)`` as a :class:`Recording` of aten ops in real mode, by TRACER (reading tensor
    values allowed)."""
    if TRACER == "record":
        try:
            return record_real(fn, *args)
        except torch.cuda.OutOfMemoryError:
            raise  # a second tracer would run out of memory too
        except Exception:  # make_fx traces it (or raises the function's own error)
            pass
    return from_graph_module(_torch_compat.make_fx_real(fn, data_dependent_ok=True)(*args))


def selected_names(model: nn.Module, params: Sequence[torch.Tensor]) -> list[str]:
    """The registered names of ``params`` in ``model``."""
    ids = {id(p): n for n, p in model.named_parameters()}
    return [ids[id(p)] for p in params]


# NOTE [the collector during a trace]
# A trace makes tens of thousands of Python objects (the recording, the written
# programs' text), few of them in reference cycles. Left alone, the cycle
# collector runs over and over during it, and the first trace of a fresh process
# sets off a full collection over every object the imports made (torch's,
# transformers'): 0.15-0.22 s on the H200 host for GPT-2 12L, ResNet-18 or the
# MLP, against traces of 0.0043-0.33 s once warm. Session 16 kept the objects
# older than the trace out of the collector's passes (`gc.freeze`, undone
# after); collections of the trace's own objects still ran (140 of the
# youngest generation, 13 of the middle one on GPT-2 12L's Hessian) and the
# first full collection still fell inside the first trace. Now no collection
# runs during a trace (`gc.disable`, the collector's state restored after; a
# process that disabled it keeps it disabled, one that froze objects keeps them
# frozen). H200 host, torch 2.11, Python 3.12, warm traces: GPT-2 12L Hessian
# 0.32-0.34 s either way, GGN 0.168 s against 0.173 s; a process's first
# trace pays no full collection (`python -m benchmarks.trace_gc`, which puts
# session 16's policy in for comparison). The work is
# not removed, only moved out of the trace: garbage of the trace that forms
# cycles waits for the next collection, and a fresh process's first full
# collection comes when its next allocations call for it.


@contextlib.contextmanager
def _collector_paused() -> Iterator[None]:
    """No cycle collection during a trace (NOTE [the collector during a trace])."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


class Tracer:
    """Traces ``product`` (a curvature's pure per-batch product over ``model`` with respect to
    ``params``) into :class:`SplitProgram` objects."""

    def __init__(
        self, model: nn.Module, params: Sequence[torch.Tensor], product: PureProduct
    ) -> None:
        self.model = model
        self.product = product
        self.names = selected_names(model, params)

    def inputs(self) -> tuple[list[str], dict[str, torch.Tensor]]:
        """Names of the other parameters and buffers, and all state tensors detached."""
        model = self.model
        state = {n: t.detach() for n, t in model.named_parameters()}
        state.update({n: t.detach() for n, t in model.named_buffers()})
        others = [n for n in state if n not in set(self.names)]
        return others, state

    def trace(self, batch: Batch, general: bool) -> SplitProgram:
        others, state = self.inputs()
        names = self.names
        n_sel, n_other = len(names), len(others)
        leaves, spec = pytree.tree_flatten(batch)
        tensor_pos = (
            [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)] if general else []
        )
        pure = self.product

        def product(*args: torch.Tensor) -> list[torch.Tensor]:
            sel, oth = args[:n_sel], args[n_sel : n_sel + n_other]
            rest = args[n_sel + n_other :]
            if general:
                flat = list(leaves)
                for i, t in zip(tensor_pos, rest[: len(tensor_pos)], strict=True):
                    flat[i] = t
                b = pytree.tree_unflatten(flat, spec)
                tangent = list(rest[len(tensor_pos) :])
            else:
                b, tangent = batch, list(rest)
            full = dict(zip(names, sel, strict=True))
            full.update(zip(others, oth, strict=True))
            return list(pure(full, b, tangent))

        primals = (
            [state[n] for n in names] + [state[n] for n in others] + [leaves[i] for i in tensor_pos]
        )
        tangents = [torch.zeros_like(state[n]) for n in names]
        _torch_compat.load_forward_ad_decompositions()
        t0 = time.perf_counter()
        with _collector_paused():
            with ElementwiseLosses():  # NOTE [losses without forward-mode rules]
                rec = trace_real(product, (*primals, *tangents))
            takes_batch = general
            # a general trace whose Python read an input's value: this batch's program only
            general = general and not reads_inputs(rec)
            reads_state = not general and reads_inputs(rec, first=n_sel + n_other)
            primal, tangent, num_kept = split_recording(rec, len(primals))
        trace_s = time.perf_counter() - t0
        key = hashlib.sha1(tangent.code.encode()).hexdigest()[:16]
        return SplitProgram(
            primal,
            tangent,
            num_kept,
            key,
            general,
            trace_s,
            len(rec.ops),
            reads_state=reads_state,
            takes_batch=takes_batch,
        )

    def primal_inputs(self, batch: Batch, program: SplitProgram) -> list[torch.Tensor]:
        others, state = self.inputs()
        out = [state[n] for n in self.names] + [state[n] for n in others]
        if program.takes_batch:
            out += [x for x in pytree.tree_leaves(batch) if isinstance(x, torch.Tensor)]
        return out
