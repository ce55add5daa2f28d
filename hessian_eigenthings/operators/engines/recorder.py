"""A function's aten ops recorded as a list, for the traced engines (NOTE [recording a trace]).

``record_real`` runs the function once under a dispatch mode and keeps each op with its
arguments (``Recording``); ``tracing.split_recording`` writes programs of it. Cost: the
function's own ops, plus the host work of recording each.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from hessian_eigenthings import _torch_compat

# NOTE [recording a trace]
# `make_fx` in real mode costs about a millisecond of host time per aten op
# (proxies, a fake tensor per value for node metadata, decomposition checks):
# 13.7-21 s on GPT-2 12L on an H100 host. The traced engines need less: the
# aten ops that run, in order, with their arguments. `record_real` runs the
# function under a dispatch mode at the bottom of the dispatcher (below
# autograd and functorch, where make_fx's mode sits), so it sees the same ops
# on plain tensors, and appends each to a list (`Recording`): a value is found
# by its tensor object (through a weak reference, so nothing is kept alive),
# an op's results become new values (an in-place op's operand is its new
# result from then on), and a tensor no recorded op made is a constant.
# `tracing()` is true inside: code that writes into tensors outside the
# dispatcher (Triton kernels, preallocated outputs) takes its functional
# path, as under make_fx. Autocast's weight cache is off, as under make_fx.
# Unlike make_fx, Python's dispatcher stays off: composite ops decompose in
# C++, which records `_unsafe_view` where Python's decompositions wrote `view`
# (the compiled engine treats both alike, NOTE [views the compiler may not
# keep]) and eval-mode batch norm as `native_batch_norm`; the products were
# bit-identical on an MLP, ResNet-18 and GPT-2 4L (CPU, torch 2.13), and
# recording took 0.22 s against 0.39-0.40 s on GPT-2 12L's graph at d64.
# No metadata is recorded; inductor makes its own. A constant that
# shares storage with an input would bake today's parameter values into the
# program: recording refuses it (`RecordingError`) and the caller traces with
# make_fx. `tracing.split_recording` writes the programs of only the ops
# they need (NOTE [programs written directly]). Measured on the CPU (torch 2.13, `benchmarks/bench_trace.py`):
# GPT-2 12L's graph at d64, Hessian, 13,591 ops, 4.41 s -> 1.02 s; the
# products are bit-identical.


class RecordingError(RuntimeError):
    """``record_real`` could not record this function faithfully (the caller uses make_fx)."""


class Ref:
    """One value of a :class:`Recording`: input ``i``, constant ``i``, or output ``item`` of op
    ``i`` (``item`` -1: the op's only result)."""

    __slots__ = ("i", "item", "kind")

    def __init__(self, kind: str, i: int, item: int = -1) -> None:
        self.kind, self.i, self.item = kind, i, item


class Recording:
    """An aten program as a list: ``ops[j] = (func, args, kwargs, reads)`` with values as
    :class:`Ref` (``reads``: the refs among its arguments), ``outputs`` as refs, and the
    ``constants`` it reads. ``tracing.split_recording`` makes programs of it."""

    def __init__(self, num_inputs: int) -> None:
        self.inputs = [Ref("input", i) for i in range(num_inputs)]
        self.ops: list[tuple[Any, Any, Any, list[Ref]]] = []
        self.outputs: list[Ref] = []
        self.constants: list[torch.Tensor] = []
        #: the function returned a tuple or list (else one tensor)
        self.sequence = True


def record_real(fn: Callable[..., Any], *args: torch.Tensor) -> Recording:
    """``fn(*args)`` recorded in real mode as a :class:`Recording` (NOTE [recording a trace])."""
    import weakref

    from torch.fx.experimental.proxy_tensor import disable_autocast_cache
    from torch.utils._python_dispatch import TorchDispatchMode

    rec = Recording(len(args))
    ops, constants = rec.ops, rec.constants
    # id(tensor) -> (a weak reference to it, its ref); a dead or different referent is a stale id
    refs: dict[int, tuple[Any, Ref]] = {}
    Tensor, new_ref = torch.Tensor, weakref.ref

    def ref_of(t: torch.Tensor, reads: list[Ref]) -> Ref:
        hit = refs.get(id(t))
        if hit is None or hit[0]() is not t:
            r = Ref("constant", len(constants))
            constants.append(t)
            refs[id(t)] = (new_ref(t), r)
        else:
            r = hit[1]
        reads.append(r)
        return r

    plain = (int, float, bool, type(None), str, torch.dtype, torch.device, torch.layout)

    def as_seq(xs: Any, reads: list[Ref]) -> list[Any]:
        # one call per argument list, not one per argument: most are plain values
        out: list[Any] = []
        for a in xs:
            if isinstance(a, Tensor):
                out.append(ref_of(a, reads))
            elif a.__class__ in plain:
                out.append(a)
            else:
                out.append(as_args(a, reads))
        return out

    def as_args(x: Any, reads: list[Ref]) -> Any:
        if isinstance(x, Tensor):
            return ref_of(x, reads)
        if isinstance(x, (list, tuple)):
            return type(x)(as_seq(x, reads)) if x else x
        if isinstance(x, dict):
            return {k: as_args(v, reads) for k, v in x.items()}
        return x

    class Recorder(TorchDispatchMode):
        # torch >= 2.8 wraps a mode's __torch_dispatch__ in a dynamo-disabling frame unless
        # this says no: that wrapper cost 0.03 of GPT-2 12L's 0.34 s recording (CPU, torch
        # 2.13), and a recording never runs under torch.compile
        @classmethod
        def _should_skip_dynamo(cls) -> bool:
            return False

        def __torch_dispatch__(
            self, func: Any, types: Any, args: Any = (), kwargs: Any = None
        ) -> Any:
            kwargs = kwargs or {}
            out = func(*args, **kwargs)
            reads: list[Ref] = []
            j = len(ops)
            ops.append(
                (func, tuple(as_seq(args, reads)), as_args(kwargs, reads) if kwargs else {}, reads)
            )
            if isinstance(out, Tensor):
                refs[id(out)] = (new_ref(out), Ref("op", j))
            elif isinstance(out, (tuple, list)):
                for i, o in enumerate(out):
                    if isinstance(o, Tensor):
                        refs[id(o)] = (new_ref(o), Ref("op", j, i))
            return out

    for a, r in zip(args, rec.inputs, strict=True):
        refs[id(a)] = (new_ref(a), r)
    # `tracing()`: code that writes outside the dispatcher takes its traced path
    with _torch_compat.recording(), disable_autocast_cache(), Recorder():
        out = fn(*args)
    rec.sequence = isinstance(out, (list, tuple))
    flat = list(out) if rec.sequence else [out]
    if not all(isinstance(o, Tensor) for o in flat):
        raise RecordingError("the function returned something other than tensors")
    unseen: list[Ref] = []
    rec.outputs = [ref_of(o, unseen) for o in flat]
    if any(r.kind == "constant" for r in unseen):
        raise RecordingError("an output was not computed by the recorded ops")
    inputs = {a.untyped_storage().data_ptr() for a in args if a.numel()}
    for c in constants:
        if c.numel() and c.untyped_storage().data_ptr() in inputs:
            raise RecordingError("a constant of the graph shares storage with an input")
    return rec
