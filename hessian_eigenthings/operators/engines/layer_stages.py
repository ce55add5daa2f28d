"""The stages of a layer walk (NOTE [layer walk] in ``engines.layers``): the head, each layer and
the tail of ``loss_fn(model, batch)`` as functions of their own parameters.

:class:`WalkStages` finds the layers and partitions the selected parameters among the stages
(``layer_checks``), runs each stage on given values (the head and the tail through the whole
loss with the layers stubbed, NOTE [hooks on the layers]), and hands each stage its parameters
and direction (gathered whole on a sharded model) and the product its blocks (reduced to this
rank's shards there). :class:`~hessian_eigenthings.operators.engines.layers.LayerWalk` composes
the stages into products.
"""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn

from hessian_eigenthings.batching import Batch
from hessian_eigenthings.operators.autodiff import CallWithModel
from hessian_eigenthings.operators.engines.layer_checks import (
    LayerCall,
    LayerWalkError,
    find_layers,
    partition,
)
from hessian_eigenthings.param_utils import call_with_values

# NOTE [hooks on the layers]
# Hooks the user put on a layer (a steering vector added to its output, a
# pre-hook that edits its input) belong to the layer's stage: the walk calls
# the layer through its __call__, so they run there once, on the layer's input
# as it came (recorded before any pre-hook) and on its output. In the stubbed
# head and tail the layers' hooks are set aside: the head stops at the first
# layer's input as it came, and in the tail each layer returns its recorded
# output, which its hooks had already made.


def primary(out: Any) -> torch.Tensor:
    """The hidden state in a layer's output: the tensor, or the first element of a tuple."""
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
        return out[0]
    raise LayerWalkError(
        f"a layer returned {type(out).__name__}; the walk needs a tensor or a tuple whose first "
        "element is the hidden state"
    )


def with_primary(out: Any, h: torch.Tensor) -> Any:
    """``out`` (a layer's output) with its hidden state replaced by ``h``."""
    if isinstance(out, torch.Tensor):
        return h
    return type(out)([h, *out[1:]]) if isinstance(out, tuple) else [h, *out[1:]]


@dataclass
class WalkState:
    """A batch and its layers' recorded calls (what the stages close over); ``key``: the draw key
    of a sampled output curvature."""

    batch: Batch
    calls: list[LayerCall]
    key: Any = None


class _Stop(Exception):
    def __init__(self, h: torch.Tensor) -> None:
        super().__init__()
        self.h = h


class Pending(Protocol):
    """A collective in flight: ``wait()`` waits for it (once) and returns its tensors."""

    def wait(self) -> list[torch.Tensor]: ...


#: ``agree(x, "min" | "max")``: ``x`` reduced over the ranks that walk together
Agree = Callable[[float, str], float]
#: what a stage gathers: ``(name, shard of a direction)``, or ``(name, None)`` for a parameter
Items = list[tuple[str, "torch.Tensor | None"]]
#: ``gather(items)``: the whole tensors' all-gather, issued (``wait()`` returns them);
#: ``finish([(name, block), ...])``: the product's blocks (written once the handle is waited) and
#: the reduce-scatter's handle; one call each per stage (NOTE [sharded layer walk], NOTE
#: [prefetched gathers] in ``sharded_walk``)
Gather = Callable[[Items], Pending]
Finish = Callable[[list[tuple[str, torch.Tensor]]], tuple[list[torch.Tensor], Pending]]
#: a stage the walk takes: its index (``None``: the parameters outside the layers) and the
#: direction whose blocks it gathers
Visit = tuple["int | None", dict[str, torch.Tensor]]


def _same(a: Items, b: Items) -> bool:
    """Whether two gathers take the same pieces (the very same direction tensors)."""
    return len(a) == len(b) and all(
        na == nb and ta is tb for (na, ta), (nb, tb) in zip(a, b, strict=True)
    )


class WalkStages:
    """The head, layers and tail of ``loss_fn(model, batch)`` split at ``layers`` (a dotted path
    or the modules), for the selected parameters ``names`` (the module docstring). ``gather`` and
    ``finish``: as :class:`~hessian_eigenthings.operators.engines.layers.LayerWalk` takes them
    (``None``: the identity, one device)."""

    def __init__(
        self,
        model: nn.Module,
        loss_fn: Callable[[nn.Module, Batch], torch.Tensor],
        names: Sequence[str],
        layers: str | Sequence[nn.Module],
        gather: Gather | None = None,
        finish: Finish | None = None,
    ) -> None:
        self.model = model
        self.call = CallWithModel(model, loss_fn)
        self.layers = find_layers(model, layers)
        self.names = list(names)
        self.gather = gather
        self.finish = finish
        prefix = {id(m): n for n, m in model.named_modules()}
        self.prefixes = []
        for layer in self.layers:
            if id(layer) not in prefix:
                raise LayerWalkError("every layer must be a submodule of the model")
            self.prefixes.append(prefix[id(layer)] + ".")
        part = partition(model, self.names, self.prefixes)
        self.local, self.outside = part.local, part.outside
        self.fixed_local, self.fixed_outside = part.fixed_local, part.fixed_outside
        #: the model's parameters by name, read at each product's start (``begin``)
        self.params: dict[str, torch.Tensor] = {}
        self._const_out: dict[str, torch.Tensor] = {}
        self._const_in: list[dict[str, torch.Tensor]] = [{} for _ in self.layers]
        #: whether the next stage's gather is issued as a stage starts and a stage's
        #: reduce-scatter left in flight until the next one's (NOTE [prefetched gathers] in
        #: ``sharded_walk``); off: each collective waited where it is issued
        self.prefetch = True
        self._plan: deque[Items] = deque()  # the gathers of the stages planned, not yet issued
        self._ahead: tuple[Items, Pending] | None = None  # the next stage's gather, in flight
        self._reducing: Pending | None = None  # the last stage's reduce-scatter, in flight

    def begin(self) -> None:
        """Read the parameters at a product's start; the trainable ones not selected, detached,
        for each stage that reads them: they are constants of the product (NOTE [layer walk])."""
        self.params = dict(self.model.named_parameters())
        get = self.model.get_parameter
        self._const_out = {
            f"model.{n}": get(n).detach() for n in self.fixed_outside if get(n).requires_grad
        }
        self._const_in = [
            {loc: get(n).detach() for loc, n in names.items() if get(n).requires_grad}
            for names in self.fixed_local
        ]

    # -- running the stages -----------------------------------------------------------
    @contextlib.contextmanager
    def stubbed(self, stub: Callable[[int, tuple[Any, ...]], Any]) -> Iterator[None]:
        """The layers' calls replaced by ``stub(i, args)`` for the duration, their hooks set aside
        (NOTE [hooks on the layers])."""
        own = [layer.__dict__.get("forward") for layer in self.layers]
        hooks = [
            (d, list(d.items()))
            for layer in self.layers
            for d in (layer._forward_pre_hooks, layer._forward_hooks)
        ]
        for d, _ in hooks:
            d.clear()
        for i, layer in enumerate(self.layers):
            layer.forward = lambda *a, _i=i, **kw: stub(_i, a)
        try:
            yield
        finally:
            for layer, fwd in zip(self.layers, own, strict=True):
                del layer.forward
                if fwd is not None:
                    layer.forward = fwd
            for d, items in hooks:
                d.clear()
                d.update(items)

    def _outside_values(self, theta: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        values = {f"model.{n}": t for n, t in theta.items()}
        return {**self._const_out, **values} if self._const_out else values

    def head(self, state: WalkState, theta: dict[str, torch.Tensor]) -> torch.Tensor:
        """h₀: the first layer's input, as a function of the parameters outside the layers."""

        def stub(i: int, args: tuple[Any, ...]) -> Any:
            raise _Stop(args[0])

        with self.stubbed(stub):
            try:
                call_with_values(self.call, self._outside_values(theta), (state.batch,))
            except _Stop as stop:
                return stop.h
        raise LayerWalkError("the loss never called the first layer")

    def layer(
        self, state: WalkState, i: int, h: torch.Tensor, theta: dict[str, torch.Tensor]
    ) -> torch.Tensor:
        """Layer ``i``'s hidden state out, as a function of its input and its parameters."""
        c = state.calls[i]
        if self._const_in[i]:
            theta = {**self._const_in[i], **theta}
        out = torch.func.functional_call(self.layers[i], theta, (h, *c.args), c.kwargs)
        return primary(out)

    def tail(
        self, state: WalkState, h: torch.Tensor, theta: dict[str, torch.Tensor]
    ) -> torch.Tensor:
        """What the call returns (the loss, or the output a sandwich differentiates) as a function
        of the last layer's output and the parameters outside the layers."""
        last = len(self.layers) - 1

        def stub(i: int, args: tuple[Any, ...]) -> Any:
            out = state.calls[i].output
            return with_primary(out, h) if i == last else out

        with self.stubbed(stub):
            return call_with_values(self.call, self._outside_values(theta), (state.batch,))

    # -- stage values ---------------------------------------------------------------
    def _items(
        self, i: int | None, v: dict[str, torch.Tensor]
    ) -> tuple[list[tuple[str, str]], list[tuple[str, str]], Items]:
        """Stage ``i``'s (local name, name) pairs, those of them moving along ``v``, and what it
        gathers: its parameters, then its blocks of ``v``."""
        pairs = [(n, n) for n in self.outside] if i is None else list(self.local[i].items())
        moving = [(loc, n) for loc, n in pairs if n in v]
        items: Items = [(n, None) for _, n in pairs]
        items += [(n, v[n]) for _, n in moving]
        return pairs, moving, items

    @contextlib.contextmanager
    def visiting(self, visits: Iterable[Visit]) -> Iterator[None]:
        """One product's walk, which takes the stages ``visits`` in this order (more may be
        planned as the walk learns them): with ``prefetch``, each one's gather is issued as the
        one before it starts (NOTE [prefetched gathers] in ``sharded_walk``). A gather planned
        but not taken is waited at the end; on an exception what is in flight is dropped."""
        self._plan.clear()
        self.plan(visits)
        try:
            yield
            self.settle()
        finally:
            self._plan.clear()
            self._ahead = self._reducing = None

    def plan(self, visits: Iterable[Visit]) -> None:
        """The stages the walk takes after those planned so far, in order."""
        if self.gather is not None and self.prefetch:
            self._plan.extend(self._items(i, v)[2] for i, v in visits)

    def settle(self) -> None:
        """Every collective in flight waited: the blocks ``done`` returned are written."""
        ahead, self._ahead = self._ahead, None
        if ahead is not None:  # planned, never taken: every rank issued it, so it completes
            ahead[1].wait()
        reducing, self._reducing = self._reducing, None
        if reducing is not None:
            reducing.wait()

    def _take(self, items: Items) -> list[torch.Tensor]:
        """The whole tensors of ``items``: from the gather issued ahead when it is this one, else
        gathered now; then the next planned stage's gather issued (NOTE [prefetched gathers])."""
        if self.gather is None:
            raise LayerWalkError("a walk without gather reads its parameters whole")
        ahead, self._ahead = self._ahead, None
        if ahead is not None and _same(ahead[0], items):
            whole = ahead[1].wait()
        else:
            if ahead is not None or (self._plan and not _same(self._plan[0], items)):
                # the walk took another stage than planned, alike on every rank (its choices
                # are agreed): the gather in flight completes and is dropped, the plan with it
                if ahead is not None:
                    ahead[1].wait()
                self._plan.clear()
            elif self._plan:
                self._plan.popleft()
            whole = self.gather(items).wait()
        if self.prefetch and self._plan:
            nxt = self._plan.popleft()
            self._ahead = (nxt, self.gather(nxt))
        return whole

    def stage(
        self, i: int | None, v: dict[str, torch.Tensor]
    ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """Stage ``i``'s parameters and direction (those in ``v``) by local name (``None``: the
        parameters outside the layers, by full name), gathered whole in one ``gather``."""
        pairs, moving, items = self._items(i, v)
        if self.gather is None:
            whole = [self.params[n].detach() if t is None else t for n, t in items]
        else:
            whole = self._take(items)
        theta = {loc: t for (loc, _), t in zip(pairs, whole, strict=False)}
        return theta, {loc: t for (loc, _), t in zip(moving, whole[len(pairs) :], strict=True)}

    def done(self, blocks: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The result's blocks as the product returns them (one ``finish`` per stage); with
        ``prefetch`` written once the next stage's ``done`` or ``settle`` returned."""
        if self.finish is None or not blocks:
            return blocks
        reducing, self._reducing = self._reducing, None
        if reducing is not None:  # one reduce-scatter in flight at a time
            reducing.wait()
        out, pending = self.finish(list(blocks.items()))
        if self.prefetch:
            self._reducing = pending
        else:
            pending.wait()
        return dict(zip(blocks, out, strict=True))

    def layer_blocks(self, i: int, g: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Layer ``i``'s blocks of the product (``g`` by local name), as the product returns them."""
        return self.done({n: g[loc] for loc, n in self.local[i].items()})
