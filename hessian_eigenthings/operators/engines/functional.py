"""The functional runner: a curvature's pure product, traced and split by the direction (DESIGN §6).

A batch's state is the primal part's values (run once per kept batch); a product is the tangent
part only, blocks of k directions through ``vmap`` of it (NOTE [tangent split] in ``tracing``).
Cost: tracing once per batch signature; the primal part once per kept batch; the tangent part per
product. Kept state: about the activations the tangent part reads.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from hessian_eigenthings.batching import Batch
from hessian_eigenthings.operators.engines.records import TRACE_TIMES, structure_key
from hessian_eigenthings.operators.engines.runner import EngineUnsupportedError
from hessian_eigenthings.operators.engines.tracing import (
    MAX_SPECIALIZED,
    PureProduct,
    SplitProgram,
    SplitState,
    Tracer,
    batch_identity,
    batch_signature,
    is_data_dependent,
    to_graph_module,
    trace_real,
)


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
        if (
            isinstance(m, (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout))
            and m.p > 0
        ):
            raise EngineUnsupportedError(
                f"engine={engine!r} traces the product once; module {name!r} (dropout, p={m.p}) is in training "
                "mode and draws random masks. Call model.eval(), or pass engine='autograd'"
            )


class FunctionalRunner:
    """Runs a curvature's pure product (``functional_product``) through a traced tangent split.

    ``batch_of`` gives the batch the traced product receives (the curvature's ``_engine_batch``:
    the batch, or the batch with what the product reads besides it, NOTE [sampled targets as data]).
    """

    name = "functional"
    #: both traced runners' products are plain tensor programs: recordable as CUDA graphs whatever
    #: the curvature (the compiled one's first run, which compiles, is eager; a recording reads the
    #: kept values in place and copies only the directions)
    traced = True

    def __init__(
        self,
        model: nn.Module,
        params: Sequence[torch.Tensor],
        product: PureProduct,
        batch_of: Callable[[Batch], Batch] | None = None,
    ) -> None:
        self.model = model
        self.batch_of = batch_of
        self._tracer = Tracer(model, params, product)
        #: general programs by (batch signature, modes)
        self._programs: dict[tuple[Any, ...], SplitProgram] = {}
        self._general_ok = True
        #: programs specialized to one batch, by batch identity (most recent last)
        self._specialized: list[tuple[tuple[Any, ...], SplitProgram]] = []
        self._vmap_ok: bool | None = None
        #: tracing time spent, and programs traced (for cost checks and reports)
        self.trace_s = 0.0
        self.num_traces = 0
        self._structure: str | None = None

    def program(self, batch: Batch) -> SplitProgram:
        sig = batch_signature(batch) if self._general_ok else None
        key = None if sig is None else (sig, tuple(m.training for m in self.model.modules()))
        if key is not None and key in self._programs:
            return self._programs[key]
        # a program specialized to one batch serves that batch again while it is unchanged
        # (same tensor objects, same versions): products whose state is not kept stay cheap
        idents = {flag: batch_identity(batch, self.model, flag) for flag in (True, False)}
        for kept_ident, kept_prog in self._specialized:
            if kept_ident == idents[kept_prog.reads_state]:
                return kept_prog
        prog = None
        if key is not None:
            try:
                prog = self._tracer.trace(batch, general=True)
            except RuntimeError as exc:
                if not is_data_dependent(exc):
                    raise
                self._general_ok = False  # see NOTE [tangent split]: trace per batch from now on
        if prog is None:
            prog = self._tracer.trace(batch, general=False)
        self.trace_s += prog.trace_s
        self.num_traces += 1
        if prog.general and key is not None:
            self._programs[key] = prog
            # what this model's trace cost, for auto's estimate (NOTE [trace times])
            TRACE_TIMES.note(self.structure(), prog.trace_s)
        elif not prog.general:
            self._specialized = [
                *self._specialized[-(MAX_SPECIALIZED - 1) :],
                (idents[prog.reads_state], prog),
            ]
        return prog

    def structure(self) -> str:
        """The key of this runner's model and curvature (NOTE [trace times]), made once."""
        if self._structure is None:
            self._structure = structure_key(self.model, self._tracer.names, self._tracer.product)
        return self._structure

    def adopt(self, other: FunctionalRunner) -> None:
        """Take over ``other``'s traced programs (switching engines costs no second trace)."""
        self._programs, self._general_ok, self._specialized = (
            other._programs,
            other._general_ok,
            other._specialized,
        )
        self._structure = other._structure

    def prepare(self, batch: Batch, params: Sequence[torch.Tensor] | None = None) -> SplitState:
        del params  # the program reads the parameters as inputs of its own
        if self.batch_of is not None:
            batch = self.batch_of(batch)
        check_functional_model(self.model, self.name)
        prog = self.program(batch)
        with torch.no_grad():
            kept = tuple(prog.primal(*self._tracer.primal_inputs(batch, prog)))
        return SplitState(prog, kept)

    def tangent_fn(
        self, prog: SplitProgram, k: int, args: tuple[torch.Tensor, ...]
    ) -> Callable[..., Any]:
        """The tangent part for k directions: the written program itself for one (called here
        directly, NOTE [programs written directly]), a graph of its own per k > 1 (vmap traced
        away), so each block width is one plain program to run or compile."""
        return prog.tangent.fn if k == 1 else self.tangent_graph(prog, k, args)

    def tangent_graph(
        self, prog: SplitProgram, k: int, args: tuple[torch.Tensor, ...]
    ) -> torch.fx.GraphModule:
        """The tangent part for k directions as an FX graph (what inductor compiles)."""
        if k == 1:
            return prog.tangent.module
        graph = prog.blocks.get(k)
        if graph is None:
            dims = (None,) * prog.num_kept + (0,) * (len(args) - prog.num_kept)
            batched = torch.func.vmap(prog.tangent.fn, in_dims=dims)
            graph = to_graph_module(trace_real(batched, args))
            prog.blocks[k] = graph
        return graph

    def apply(
        self, state: SplitState, vecs: list[torch.Tensor], retain: bool
    ) -> Sequence[torch.Tensor | None]:
        del retain  # kept values are plain tensors
        k = vecs[0].shape[0]
        prog = state.program
        with torch.no_grad():
            if k == 1:
                out = self.run(prog, 1, (*state.kept, *(v[0] for v in vecs)))
                return list(map(torch.unsqueeze, out, itertools.repeat(0)))  # (1, *shape) each
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

    def run(
        self, prog: SplitProgram, k: int, args: tuple[torch.Tensor, ...]
    ) -> Sequence[torch.Tensor]:
        return self.tangent_fn(prog, k, args)(*args)

    def describe(self) -> dict[str, Any]:
        return {"engine": self.name, "traces": self.num_traces, "trace_s": round(self.trace_s, 3)}
