"""Per-example gradients over a fixed set of parameters, as rows ``(B, n)`` of the flat layout.

``torch.func.vmap(torch.func.grad(L))`` over the examples of a batch, with the selected
parameters passed through ``torch.func.functional_call`` (the others, and the buffers, are the
model's own, read as constants): one batched backward per batch. A model that vmap cannot run
(data-dependent control flow, ``.item()``, in-place writes into captured tensors, some custom
kernels) falls back, once and for good, to a loop with one backward per example, which gives
the same numbers.

NOTE [per-example gradients of linear layers]: when every selected parameter is the weight or
bias of an ``nn.Linear`` (or HuggingFace ``Conv1D``) called once per forward, as the Kronecker
routes select, the gradients come from one ordinary forward and backward of the batch's summed
loss instead: hooks keep each layer's input ``a`` and output, the backward gives the output
gradients ``g``, and example ``n``'s weight gradient is ``Σ_t g[n, t] a[n, t]ᵀ`` (one batched
matrix product per layer; the bias's ``Σ_t g[n, t]``). That holds when each example's loss
depends on its own inputs only, as in eval mode; the first batch checks it against the
one-example-at-a-time gradients of two of its examples, and a model where it does not hold uses
vmap for good. Measured on GPT-2 124 M (8 × 512 tokens, fp32, H100): the vmapped gradients
peaked at 36 GB, the hooked ones at the memory of a training step plus the rows.

NOTE [per-example gradients on sharded ranks]: on a model sharded with FSDP2 (``fit(...,
ranks=Sharded(model))``) FSDP shards parameters, never activations: inside the forward each
layer runs on its whole (gathered) weight, so the hooked rows above are whole and exact on
each rank. vmap and the one-example loop swap the parameters through ``functional_call``,
which FSDP's own gathering overrides, so they are not used there: every scored parameter must
be a hooked layer's (refused in one line otherwise), and the first batch's check takes its
reference per example from the gathered parameters the forward used (captured by a pre-forward
hook, differentiated with ``torch.autograd.grad``: nothing is accumulated into ``.grad``). Each
pass is FSDP forwards and backwards, collectives: every rank runs the same passes (the check
two, whatever its batch size), and the ranks meet between a pass's forward and its backward, so
that a loss failing on one rank raises on all.

The model is left as it was: no parameter is written, ``.grad`` is never touched (the gradients
are returned, not accumulated), nor are ``requires_grad`` flags or train/eval modes. Tied
parameters (GPT-2's ``lm_head.weight`` is ``transformer.wte.weight``) are passed under their
first name and ``functional_call`` ties the other uses to it, so a tied parameter's gradient
sums over every use.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple, Protocol

import torch
from torch import nn

from hessian_eigenthings._checks import InternalError
from hessian_eigenthings.batching import Batch, batch_size, map_tensors
from hessian_eigenthings.operators.factor_pass import is_hf_conv1d
from hessian_eigenthings.param_utils import ParamLayout

__all__ = [
    "Layer",
    "PerExampleGradients",
    "ShardedPasses",
    "position_scores",
    "refuse_unhooked",
]

PerExampleLoss = Callable[[nn.Module, Batch], torch.Tensor]


class ShardedPasses(Protocol):
    """What the gradients of a model sharded with FSDP2 ask of its ranks (NOTE [per-example
    gradients on sharded ranks])."""

    def meet(self, failure: BaseException | None, what: str) -> None:
        """Every rank meets; raises on every rank when one brought a ``failure``."""

    def reshard(self) -> None:
        """Every FSDP module back to its shards."""


def _as_plain(batch: Batch) -> Batch:
    """A mapping batch (``BatchEncoding``) as a dict: vmap walks dicts, tuples and lists."""
    if hasattr(batch, "keys") and hasattr(batch, "__getitem__") and not isinstance(batch, dict):
        return {k: batch[k] for k in batch.keys()}
    return batch


class PerExampleGradients:
    """``gradients(batch) -> (B, n)``: the gradient of ``loss(model, batch)[i]`` with respect to
    the parameters of ``layout`` (by name, in its order), for each example ``i``."""

    def __init__(
        self,
        model: nn.Module,
        layout: ParamLayout,
        loss: PerExampleLoss,
        sharded: ShardedPasses | None = None,
    ) -> None:
        self.model, self.layout, self.loss = model, layout, loss
        params = dict(model.named_parameters())
        missing = [n for n in layout.names if n not in params]
        if missing:
            raise ValueError(f"the model has no parameters named {missing[:3]}")
        self._params = {n: params[n] for n in layout.names}
        #: whether vmap ran this model; None until the first batch says so
        self.vmap_works: bool | None = None
        #: NOTE [per-example gradients of linear layers]: the layers, or None (vmap); checked
        #: on the first batch (``linear_checked``)
        self.linear: list[_LinearSlot] | None = _linear_slots(model, layout.names)
        self.linear_checked = False
        #: the ranks of a model sharded with FSDP2 (NOTE [per-example gradients on sharded ranks])
        self.sharded = sharded
        if sharded is not None:
            refuse_unhooked(model, layout.names)

    def __call__(self, batch: Batch, out: torch.Tensor | None = None) -> torch.Tensor:
        """The rows ``(B, n)``, into ``out`` when given (NOTE [rows written in place])."""
        batch = _as_plain(batch)
        B = batch_size(batch)
        _check_out(out, B, self.layout)
        if B == 0:
            empty = torch.zeros(0, self.layout.size, dtype=self.layout.dtype)
            return _into(out, empty.to(self.layout.device))
        if self.sharded is None and self.linear is not None:
            rows = self._hooked(batch, B, out)
            if rows is not None:
                return rows
        return _into(out, self._unhooked(batch, B))

    def _unhooked(self, batch: Batch, B: int) -> torch.Tensor:
        """The rows of sharded ranks, or from vmap, or one example at a time."""
        if self.sharded is not None:
            return self._sharded_rows(self.sharded, batch, B)
        if self.vmap_works is not False:
            try:
                rows = self._vmapped(batch)
            except Exception:
                if self.vmap_works:  # it ran before: this failure is the batch's own
                    raise
                self.vmap_works = False
            else:
                self.vmap_works = True
                return rows
        return self._looped(batch, B)

    def dots(self, batch: Batch, Q: torch.Tensor) -> torch.Tensor:
        """``Q @ gradients(batch).T``, ``(k, B)``, parameter by parameter in the layout's order
        (NOTE [scores layer by layer]): with the hooked linear layers (once checked), each
        layer's per-example gradients are contracted with its columns of ``Q`` as the backward
        reaches it, so a batch's rows ``(B, n)`` are never all held."""
        plain = _as_plain(batch)
        B = batch_size(plain)
        if B and self.sharded is None and self.linear is not None and self.linear_checked:
            parts: dict[int, torch.Tensor] = {}
            views = self.layout.split_rows(Q)

            def use(slot: _LinearSlot, a3: torch.Tensor, g3: torch.Tensor) -> None:
                for j, grad in _slot_gradients(slot, a3, g3):
                    parts[j] = _dot(views[j], grad.to(Q.dtype))

            try:
                linear_backward(self.model, self.loss, self.linear, plain, B, use)
            except _NotLinear:
                self.linear = None
            else:
                return _summed(parts, Q, B)
        rows = self(plain)
        views, row_views = self.layout.split_rows(Q), self.layout.split_rows(rows)
        parts = {
            j: _dot(v, r.to(Q.dtype)) for j, (v, r) in enumerate(zip(views, row_views, strict=True))
        }
        del rows, row_views
        return _summed(parts, Q, B)

    def by_layer(self, batch: Batch, use: Callable[[Layer], None]) -> bool:
        """One forward and backward of ``batch`` calling ``use(layer)`` for each hooked layer as
        the backward reaches it (NOTE [per-example gradients of linear layers]; no rows made),
        and True; False, with nothing called, where the hooked layers do not apply: not checked
        yet (:meth:`check_hooks`), a model that needs vmap, an empty batch, sharded ranks (whose
        passes meet: the caller makes rows, as :meth:`dots` does there)."""
        plain = _as_plain(batch)
        B = batch_size(plain)
        if not B or self.sharded is not None or self.linear is None or not self.linear_checked:
            return False

        def relay(slot: _LinearSlot, a3: torch.Tensor, g3: torch.Tensor) -> None:
            use(Layer(slot.weight, slot.bias, slot.conv1d, a3, g3))

        try:
            linear_backward(self.model, self.loss, self.linear, plain, B, relay)
        except _NotLinear:  # raised before the backward: ``use`` was not called
            self.linear = None
            return False
        return True

    def check_hooks(self, batch: Batch) -> bool:
        """Whether the hooked layers give this model's per-example gradients, checked once (on
        up to two examples of ``batch``; False for good if not, and on sharded ranks, which check
        their own way) without rows: each example's hooked gradients are compared parameter by
        parameter, as the backward reaches each layer, with the gradient of that example's loss
        alone (memory of one example's gradient, as a training step's ``.grad``), with the
        tolerance of the check the rows pass (NOTE [per-example gradients of linear layers])."""
        if self.sharded is not None or self.linear is None:
            return False
        if self.linear_checked:
            return True
        plain = _as_plain(batch)
        n = min(batch_size(plain), 2)
        if n == 0:
            return False
        pair = map_tensors(plain, lambda t: t[:n])
        dtype = self.layout.dtype
        error = torch.zeros((), dtype=dtype, device=self.layout.device)
        scale = torch.zeros((), dtype=dtype, device=self.layout.device)
        for i in range(n):
            reference = self._example_gradient(map_tensors(pair, _row(i)))
            reached: set[int] = set()

            def compare(
                slot: _LinearSlot,
                a3: torch.Tensor,
                g3: torch.Tensor,
                i: int = i,
                reference: list[torch.Tensor] = reference,
                reached: set[int] = reached,
            ) -> None:
                nonlocal error
                for j, grad in _slot_gradients(slot, a3[i : i + 1], g3[i : i + 1]):
                    error = error + (grad[0].to(dtype) - reference[j]).square().sum()
                    reached.add(j)

            try:
                linear_backward(self.model, self.loss, self.linear, pair, n, compare)
            except _NotLinear:
                self.linear = None
                return False
            for j, ref in enumerate(reference):
                scale = scale + ref.square().sum()
                if j not in reached:  # its hooked gradient is zero
                    error = error + ref.square().sum()
        relative = error.sqrt() / scale.sqrt().clamp_min(torch.finfo(dtype).tiny)
        if not _hooks_agree(float(relative), dtype):
            self.linear = None  # the examples meet in the forward: vmap for good
            return False
        self.linear_checked = True
        return True

    def _hooked(self, batch: Batch, B: int, out: torch.Tensor | None) -> torch.Tensor | None:
        """NOTE [per-example gradients of linear layers]; None when this model cannot (for good)."""
        slots = self.linear
        if slots is None:
            raise RuntimeError("unreachable: _hooked without linear layers")
        try:
            rows = _linear_gradients(self.model, self.loss, self.layout, slots, batch, B, out=out)
        except _NotLinear:
            self.linear = None
            return None
        if not self.linear_checked:
            n = min(B, 2)
            reference = self._looped(map_tensors(batch, lambda t: t[:n]), n)
            scale = reference.norm().clamp_min(torch.finfo(rows.dtype).tiny)
            if not _hooks_agree(float((rows[:n] - reference).norm() / scale), rows.dtype):
                self.linear = None  # the examples meet in the forward: vmap for good
                return None
            self.linear_checked = True
        return rows

    def _sharded_rows(self, sharded: ShardedPasses, batch: Batch, B: int) -> torch.Tensor:
        """The hooked rows on a model sharded with FSDP2, checked on the first batch against
        gradients of two examples alone (NOTE [per-example gradients on sharded ranks])."""
        slots = self.linear
        if slots is None:
            raise InternalError("hooked layers, checked at construction on sharded ranks")
        try:
            rows = _linear_gradients(
                self.model, self.loss, self.layout, slots, batch, B, sharded.meet
            )
            if not self.linear_checked:
                # two passes on every rank, whatever its batch size: FSDP's collectives pair up
                picks = [0, min(1, B - 1)]
                reference = torch.stack(
                    [self._gathered_gradient(sharded, map_tensors(batch, _row(i))) for i in picks]
                )
                scale = reference.norm().clamp_min(torch.finfo(rows.dtype).tiny)
                error = float((rows[picks] - reference).norm() / scale)
                failure = None
                if not _hooks_agree(error, rows.dtype):
                    failure = ValueError(
                        "per-example gradients from the layers' hooks differ from gradients of "
                        f"examples taken alone (relative {error:.2g}): the examples of a batch "
                        "meet in the forward, or a scored parameter is used outside its layer; "
                        "on a model sharded with FSDP2 there is no vmap to fall back to"
                    )
                sharded.meet(failure, "checking per-example gradients")
                self.linear_checked = True
        except _NotLinear:
            raise ValueError(
                "on a model sharded with FSDP2 every scored nn.Linear / Conv1D layer must be "
                "called exactly once per forward and the loss be one value per example (per-"
                "example gradients come from the layers' hooks only)"
            ) from None
        finally:
            sharded.reshard()
        return rows

    def _gathered_gradient(self, sharded: ShardedPasses, single: Batch) -> torch.Tensor:
        """The gradient of one example's loss with respect to the gathered (whole) parameters
        its forward used, captured as each layer is called (NOTE [per-example gradients on
        sharded ranks])."""
        slots = self.linear
        if slots is None:
            raise InternalError("hooked layers, checked at construction on sharded ranks")
        used: dict[int, torch.Tensor] = {}

        def capture(slot: _LinearSlot) -> Callable[[nn.Module, tuple[Any, ...]], None]:
            def hook(module: nn.Module, _args: tuple[Any, ...]) -> None:
                for role in ("weight", "bias"):
                    index = getattr(slot, role)
                    if index is not None:
                        used[index] = getattr(module, role)

            return hook

        handles = [s.module.register_forward_pre_hook(capture(s)) for s in slots]
        failure: BaseException | None = None
        value = None
        try:
            with torch.enable_grad():
                value = self.loss(self.model, single).reshape(())
            if len(used) != len(self.layout.names):
                raise _NotLinear
        except Exception as exc:  # met below, so that every rank raises
            failure = exc
        finally:
            for h in handles:
                h.remove()
        sharded.meet(failure, "a per-example gradient")
        if value is None:
            raise InternalError("a loss after the ranks met without a failure")
        order = sorted(used)
        grads = torch.autograd.grad(value, [used[i] for i in order], allow_unused=True)
        out = torch.zeros(self.layout.size, dtype=self.layout.dtype, device=self.layout.device)
        views = self.layout.split(out)
        for i, g in zip(order, grads, strict=True):
            if g is not None:
                views[i].copy_(g.reshape(views[i].shape))
        return out

    def _flat(self, grads: dict[str, torch.Tensor], B: int) -> torch.Tensor:
        return torch.cat([grads[n].reshape(B, -1) for n in self.layout.names], dim=1)

    def _vmapped(self, batch: Batch) -> torch.Tensor:
        model, loss = self.model, self.loss

        def example_loss(params: dict[str, torch.Tensor], example: Batch) -> torch.Tensor:
            single = map_tensors(example, lambda t: t.unsqueeze(0))
            return _call_with(model, params, lambda: loss(model, single)).reshape(())

        detached = {n: p.detach() for n, p in self._params.items()}
        with torch.no_grad():  # the unselected parameters: constants (torch.func.grad ignores it)
            grads = torch.func.vmap(torch.func.grad(example_loss), in_dims=(None, 0))(
                detached, batch
            )
        return self._flat(grads, batch_size(batch))

    def _looped(self, batch: Batch, B: int) -> torch.Tensor:
        out = torch.empty(B, self.layout.size, dtype=self.layout.dtype, device=self.layout.device)
        for i in range(B):
            grads = self._example_gradient(map_tensors(batch, _row(i)))
            out[i] = torch.cat([g.reshape(-1) for g in grads]).to(out.dtype)
        return out

    def _example_gradient(self, single: Batch) -> list[torch.Tensor]:
        """The gradient of one example's loss, parameter by parameter in the layout's order (a
        parameter the loss does not reach: zeros)."""
        leaves = {n: p.detach().requires_grad_(True) for n, p in self._params.items()}

        def run() -> torch.Tensor:
            return self.loss(self.model, single)

        with torch.enable_grad():
            value = _call_with(self.model, leaves, run)
            grads = torch.autograd.grad(value.reshape(()), list(leaves.values()), allow_unused=True)
        return [
            (torch.zeros_like(p) if g is None else g).to(self.layout.dtype)
            for g, p in zip(grads, leaves.values(), strict=True)
        ]


def _hooks_agree(relative: float, dtype: torch.dtype) -> bool:
    """Whether hooked per-example gradients ``relative`` from those of examples taken alone are
    the same gradients (rounding of a few products): the one tolerance of the three checks of
    the hooks (NOTE [per-example gradients of linear layers])."""
    return relative <= max(1e-3, 64 * torch.finfo(dtype).eps)


def _row(i: int) -> Callable[[torch.Tensor], torch.Tensor]:
    def row(t: torch.Tensor) -> torch.Tensor:
        return t[i : i + 1]

    return row


def _call_with(
    model: nn.Module, params: dict[str, torch.Tensor], run: Callable[[], torch.Tensor]
) -> torch.Tensor:
    """``run()`` with the module's parameters ``params`` swapped in for the call (the loss calls
    the model itself: ``functional_call`` reaches its forward through a one-off wrapper)."""
    wrapper = _Swap(model, run)
    named = {f"model.{n}": t for n, t in params.items()}
    result: Any = torch.func.functional_call(wrapper, named, (), {}, strict=False)
    return result


class _Swap(nn.Module):
    """Holds the model as a submodule so that ``functional_call`` swaps its parameters while
    ``run`` (which calls the model through the user's loss) executes."""

    def __init__(self, model: nn.Module, run: Callable[[], torch.Tensor]) -> None:
        super().__init__()
        self.model = model
        self._run = run

    def forward(self) -> torch.Tensor:
        return self._run()


class _NotLinear(Exception):
    """The hooked path does not apply to this model (a layer called twice or not at all, an
    output that does not need a gradient)."""


class _LinearSlot:
    """One linear layer and where its weight's and bias's gradients go in the layout."""

    def __init__(self, module: nn.Module, conv1d: bool) -> None:
        self.module = module
        self.conv1d = conv1d  # weight stored (in, out)
        self.weight: int | None = None  # index in the layout
        self.bias: int | None = None


class Layer(NamedTuple):
    """One hooked layer as the backward reaches it (:meth:`PerExampleGradients.by_layer`)."""

    weight: int | None  # the weight's index in the layout (None: not scored)
    bias: int | None  # the bias's index in the layout (None: not scored, or none)
    conv1d: bool  # the weight is stored (in, out), HuggingFace's Conv1D; else (out, in)
    a: torch.Tensor  # (B, positions, in) the layer's inputs
    g: torch.Tensor  # (B, positions, out) the summed loss's gradients at its outputs

    def gradients(self) -> Iterator[tuple[int, torch.Tensor]]:
        """``(layout index, (B, *shape))`` per-example gradients of the weight and the bias."""
        if self.weight is not None:
            if self.conv1d:
                yield self.weight, torch.bmm(self.a.transpose(1, 2), self.g)  # (B, in, out)
            else:
                yield self.weight, torch.bmm(self.g.transpose(1, 2), self.a)  # (B, out, in)
        if self.bias is not None:
            yield self.bias, self.g.sum(1)


def _linear_slots(
    model: nn.Module, names: Sequence[str], why: list[str] | None = None
) -> list[_LinearSlot] | None:
    """The layers of NOTE [per-example gradients of linear layers], or None when a selected
    parameter is not a linear layer's own weight or bias (or is shared, or frozen): then
    ``why`` receives the first such parameter, and what it is."""
    owners: dict[int, list[tuple[nn.Module, str]]] = {}
    for module in model.modules():
        for pname, p in module.named_parameters(recurse=False):
            owners.setdefault(id(p), []).append((module, pname))
    params = dict(model.named_parameters(remove_duplicate=False))
    slots: dict[int, _LinearSlot] = {}
    for index, name in enumerate(names):
        p = params[name]
        uses = owners.get(id(p), [])
        reason = None
        if len(uses) != 1:
            reason = f"{name!r} (used by {len(uses)} modules)"
        elif not p.requires_grad:
            reason = f"{name!r} (frozen)"
        else:
            module, role = uses[0]
            conv1d = is_hf_conv1d(module)  # x @ W + b, W stored (in, out)
            if not (isinstance(module, nn.Linear) or conv1d) or role not in ("weight", "bias"):
                reason = f"{name!r} (a {type(module).__name__}'s {role})"
        if reason is not None:
            if why is not None:
                why.append(reason)
            return None
        slot = slots.setdefault(id(module), _LinearSlot(module, conv1d))
        setattr(slot, role, index)
    return list(slots.values()) or None


def refuse_unhooked(model: nn.Module, names: Sequence[str]) -> None:
    """Refuse, on a model sharded with FSDP2, a scored parameter that is not a hooked layer's
    (NOTE [per-example gradients on sharded ranks])."""
    why: list[str] = []
    if _linear_slots(model, names, why) is None:
        raise ValueError(
            "on a model sharded with FSDP2, influence takes per-example gradients from hooks on "
            f"nn.Linear / Conv1D weights and biases only; {why[0] if why else 'no parameter'} "
            "would need vmap over FSDP's sharded parameters, which is not supported: leave it "
            "out with param_filter"
        )


LayerUse = Callable[["_LinearSlot", torch.Tensor, torch.Tensor], None]
#: the ranks meeting between a pass's forward and its backward (``ShardedPasses.meet``)
Meet = Callable[[BaseException | None, str], None]


def _linear_gradients(
    model: nn.Module,
    loss: PerExampleLoss,
    layout: ParamLayout,
    slots: list[_LinearSlot],
    batch: Batch,
    B: int,
    meet: Meet | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Rows ``(B, n)`` from one forward and backward (NOTE [per-example gradients of linear
    layers]), into ``out`` when given (NOTE [rows written in place]); raises
    :class:`_NotLinear` when a layer is not called exactly once."""
    if out is None:
        rows = torch.zeros(B, layout.size, dtype=layout.dtype, device=layout.device)
    else:
        rows = out.zero_()
    views = layout.split_rows(rows)

    def use(slot: _LinearSlot, a3: torch.Tensor, g3: torch.Tensor) -> None:
        for j, grad in _slot_gradients(slot, a3, g3):
            views[j].copy_(grad)

    linear_backward(model, loss, slots, batch, B, use, meet)
    return rows


# NOTE [rows written in place]: the preconditioned query rows ``(n_query, n)`` are held whole on
# the exact route (5.4 GB for 16 GPT-2 124M sequences in float32). Made a slice of examples at a
# time, each slice's rows would be a second buffer beside them, alive with that slice's
# activations (2.7 GB for a slice of 8): the query phase's peak. The hooked layers write each
# slice's per-example gradients into its rows of the whole buffer instead; the other routes
# (vmap, one example at a time, sharded ranks) make their rows and copy them in.
def _check_out(out: torch.Tensor | None, B: int, layout: ParamLayout) -> None:
    if out is None:
        return
    if (tuple(out.shape), out.dtype, out.device) != ((B, layout.size), layout.dtype, layout.device):
        raise InternalError(
            f"out must be ({B}, {layout.size}) {layout.dtype} on {layout.device}, "
            f"got {tuple(out.shape)} {out.dtype} on {out.device}"
        )


def _into(out: torch.Tensor | None, rows: torch.Tensor) -> torch.Tensor:
    if out is None:
        return rows
    return out.copy_(rows)


def _slot_gradients(
    slot: _LinearSlot, a3: torch.Tensor, g3: torch.Tensor
) -> Iterator[tuple[int, torch.Tensor]]:
    """``(layout index, (B, *shape))`` per-example gradients of a layer's weight and bias from
    its inputs ``a3`` and output gradients ``g3``, both ``(B, positions, ·)``."""
    return Layer(slot.weight, slot.bias, slot.conv1d, a3, g3).gradients()


# NOTE [scores layer by layer]: a training batch's pairwise scores ``Q Gᵀ`` are a sum over
# parameters of ``Q_j G_jᵀ``. Made as the backward reaches each layer, they never need the
# batch's rows ``G (B, n)`` (2.7 GB for 8 GPT-2 sequences in float32), only one layer's per-example
# gradients at a time (Kronfluence scores so too). Each parameter's part is one product of
# contiguous operands, and the parts are summed in the layout's order, so that a batch's scores
# are the same bits whichever way they were made (the first batch, which checks the hooks, and
# sharded ranks make rows): a resumed run equals an unbroken one.
def _dot(q: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """``(k, B)`` dots of a parameter's query columns ``q (k, *shape)``, a view of the queries'
    rows (read in place: a row-major operand with its own stride), with its per-example
    gradients ``g (B, *shape)``, made contiguous (NOTE [scores layer by layer])."""
    k, B = q.shape[0], g.shape[0]
    return q.reshape(k, -1) @ g.reshape(B, -1).contiguous().T


def _summed(parts: dict[int, torch.Tensor], Q: torch.Tensor, B: int) -> torch.Tensor:
    """The parts summed in the layout's order (parameters the backward did not reach: zero)."""
    out = torch.zeros(Q.shape[0], B, dtype=Q.dtype, device=Q.device)
    for j in sorted(parts):
        out += parts[j]
    return out


def position_scores(
    grads: PerExampleGradients, batch: Batch, Q: torch.Tensor
) -> torch.Tensor | None:
    """``(k, B, positions)``: for each row ``q`` of ``Q (k, n)`` and each example and input
    position ``t`` of ``batch``, ``Σ_layers ⟨q, g_t a_tᵀ⟩`` (and ``⟨q_bias, g_t⟩``), the share of
    position ``t`` in ``⟨q, ∇L(z)⟩`` (NOTE [per-example gradients of linear layers]: the example's
    gradient is the sum of these terms over its positions). None when the hooked path does not
    apply to the model."""
    slots = grads.linear
    if slots is None:
        return None
    B = batch_size(batch)
    k = Q.shape[0]
    views = grads.layout.split_rows(Q.to(grads.layout.dtype))
    total: list[torch.Tensor] = []  # one (k, B, positions) sum, made by the first layer reached

    def use(slot: _LinearSlot, a3: torch.Tensor, g3: torch.Tensor) -> None:
        if not total:
            total.append(torch.zeros(k, B, g3.shape[1], dtype=g3.dtype, device=g3.device))
        if slot.weight is not None:
            W = views[slot.weight]
            W = W.transpose(1, 2) if slot.conv1d else W  # (k, out, in)
            h = torch.einsum("btj,kij->kbti", a3, W)  # (k, B, positions, out)
            total[0] += (h * g3.unsqueeze(0)).sum(-1)
        if slot.bias is not None:
            total[0] += torch.einsum("bti,ki->kbt", g3, views[slot.bias])

    try:
        meet = grads.sharded.meet if grads.sharded is not None else None
        linear_backward(grads.model, grads.loss, slots, batch, B, use, meet)
    except _NotLinear:
        return None
    if not total:
        return torch.zeros(k, B, 0, dtype=Q.dtype, device=Q.device)
    return total[0].to(Q.dtype)


def linear_backward(
    model: nn.Module,
    loss: PerExampleLoss,
    slots: list[_LinearSlot],
    batch: Batch,
    B: int,
    use: LayerUse,
    meet: Meet | None = None,
) -> None:
    """One forward and backward of ``loss(model, batch).sum()``, calling ``use(slot, a, g)`` for
    each layer with its input ``a`` and output gradient ``g``, both ``(B, positions, ·)``.

    Each layer's output gradient is used as the backward reaches it and then dropped (a tensor
    hook on ``output + 0``, the backward asked for the gradient of that shared zero only), so
    the backward never holds every layer's output gradient at once. Raises :class:`_NotLinear`
    when a layer is not called exactly once or the loss is not one value per example. ``meet``:
    the ranks of a sharded model meet between the forward and the backward (a failure of one
    rank's forward or loss raises on every rank, before FSDP's backward collectives)."""
    first = next(iter(slots)).module
    param = next(first.parameters())
    zero = torch.zeros((), dtype=param.dtype, device=param.device, requires_grad=True)
    called: set[int] = set()

    def consume(slot: _LinearSlot, a: torch.Tensor) -> Callable[[torch.Tensor], None]:
        def on_grad(g: torch.Tensor) -> None:
            use(slot, a.reshape(B, -1, a.shape[-1]), g.reshape(B, -1, g.shape[-1]))

        return on_grad

    def keep(i: int) -> Callable[[nn.Module, tuple[Any, ...], torch.Tensor], torch.Tensor]:
        def hook(_m: nn.Module, args: tuple[Any, ...], out: torch.Tensor) -> torch.Tensor:
            if i in called or not isinstance(out, torch.Tensor) or not out.requires_grad:
                raise _NotLinear
            called.add(i)
            tracked = out + zero  # the same values; a node the backward passes through
            tracked.register_hook(consume(slots[i], args[0].detach()))
            return tracked

        return hook

    handles = [s.module.register_forward_hook(keep(i)) for i, s in enumerate(slots)]
    failure: BaseException | None = None
    losses = None
    try:
        with torch.enable_grad():
            losses = loss(model, batch)
        if len(called) != len(slots) or tuple(losses.shape) != (B,):
            raise _NotLinear
    except Exception as exc:
        failure = exc
    finally:
        for h in handles:
            h.remove()
    if meet is not None:
        meet(failure, "per-example gradients")  # raises on every rank if one failed
    if failure is not None:
        raise failure
    if losses is None:
        raise InternalError("losses after a forward without a failure")
    torch.autograd.grad(losses.sum(), [zero], allow_unused=True)
