"""Tracing a curvature's pure product into a program split by the direction (NOTE [tangent split]).

:class:`Tracer` traces ``product(state, batch, tangent)`` (parameters and buffers by registered
name) with ``make_fx`` into one aten graph and splits it into the part that reads only
parameters and data (run once per kept batch) and the part that reads the direction (run per
product). Cost: host work, about a second per thousand graph nodes, once per batch signature.
"""

from __future__ import annotations

import hashlib
import itertools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from hessian_eigenthings import _torch_compat
from hessian_eigenthings.batching import Batch
from hessian_eigenthings.loss_fns.forward_rules import ElementwiseLosses

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


def split_by_tangent(
    gm: torch.fx.GraphModule, n_primal: int
) -> tuple[torch.fx.GraphModule, torch.fx.GraphModule, int]:
    """``gm(primals..., tangents...)`` as ``primal(primals...) -> kept`` and
    ``tangent(kept..., tangents...)``; returns both and the number of kept values."""
    graph = gm.graph
    ph = [n for n in graph.nodes if n.op == "placeholder"]
    dep: set[torch.fx.Node] = set(ph[n_primal:])
    for n in graph.nodes:
        if n.op not in ("placeholder", "output", "get_attr") and any(
            a in dep for a in n.all_input_nodes
        ):
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
    return (
        torch.fx.GraphModule(gm, primal_graph),
        torch.fx.GraphModule(gm, tangent_graph),
        len(boundary),
    )


@dataclass
class SplitProgram:
    """A traced product split by NOTE [tangent split]."""

    primal: torch.fx.GraphModule
    tangent: torch.fx.GraphModule
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


def reads_inputs(gm: torch.fx.GraphModule, first: int | None = None) -> bool:
    """Whether a host read in ``gm`` depends on one of its inputs (the ``first`` ones only, if
    given; NOTE [what a specialized program read])."""
    depends: dict[torch.fx.Node, bool] = {}
    position = 0
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            depends[node] = first is None or position < first
            position += 1
            continue
        depends[node] = any(depends.get(a, False) for a in node.all_input_nodes)
        if (
            node.op == "call_function"
            and depends[node]
            and any(h in str(node.target) for h in _HOST_READS)
        ):
            return True
    return False


def is_data_dependent(exc: BaseException) -> bool:
    text = str(exc)
    return "data-dependent" in text or "_local_scalar_dense" in text or "data dependent" in text


def selected_names(model: nn.Module, params: Sequence[torch.Tensor]) -> list[str]:
    """The registered names of ``params`` in ``model``."""
    ids = {id(p): n for n, p in model.named_parameters()}
    return [ids[id(p)] for p in params]


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
        from torch.fx.experimental.proxy_tensor import make_fx

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
        with ElementwiseLosses():  # NOTE [losses without forward-mode rules]
            gm = _torch_compat.make_fx_real(product, data_dependent_ok=True)(*primals, *tangents)
        takes_batch = general
        # a general trace whose Python read an input's value: this batch's program only
        general = general and not reads_inputs(gm)
        reads_state = not general and reads_inputs(gm, first=n_sel + n_other)
        primal, tangent, num_kept = split_by_tangent(gm, len(primals))
        trace_s = time.perf_counter() - t0
        del make_fx
        key = hashlib.sha1(tangent.code.encode()).hexdigest()[:16]
        return SplitProgram(
            primal,
            tangent,
            num_kept,
            key,
            general,
            trace_s,
            len(gm.graph.nodes),
            reads_state=reads_state,
            takes_batch=takes_batch,
        )

    def primal_inputs(self, batch: Batch, program: SplitProgram) -> list[torch.Tensor]:
        others, state = self.inputs()
        out = [state[n] for n in self.names] + [state[n] for n in others]
        if program.takes_batch:
            out += [x for x in pytree.tree_leaves(batch) if isinstance(x, torch.Tensor)]
        return out
