"""Exact curvature products by walking a model's layers one at a time (NOTE [layer walk]).

:class:`LayerWalk` splits ``loss_fn(model, batch)`` at a list of layers the user names (the
blocks of a transformer: ``"transformer.h"``, ``"model.layers"``) into a head (everything
before the first layer), the layers, and a tail (everything after the last, the loss
included), and computes ``H v`` stage by stage: a forward walk that carries each layer's input
and its tangent, then a backward walk that differentiates each stage's pullback along the
direction. Only the layers' boundary activations (and their tangents) are held; the graph of
one stage at a time is built and freed. The products are exact (no finite differences); they
equal the whole-graph Hessian product to rounding.

This is the single-device form of the walk that sharded products run with each layer's
parameters gathered in turn (issue 28). It needs a stack: each layer called once per batch in
the order of the list, its first positional argument the previous layer's output (its first
element, if a tuple), the first layer's input from the head, nothing after the layers reading
an intermediate layer's output, and each selected parameter read in its own stage only
(checked at capture, NOTE [what the walk checks], in ``layer_checks``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from hessian_eigenthings import _torch_compat
from hessian_eigenthings.batching import Batch
from hessian_eigenthings.operators.autodiff import CallWithModel
from hessian_eigenthings.operators.engines.functional import check_functional_model
from hessian_eigenthings.operators.engines.layer_checks import (
    LayerCall,
    LayerWalkError,
    _relative_gap,
    check_constant_arguments,
    check_order,
    check_reads,
    check_tail,
    find_layers,
    partition,
    record_calls,
)
from hessian_eigenthings.operators.engines.runner import ProductCounts
from hessian_eigenthings.operators.engines.tracing import batch_signature
from hessian_eigenthings.param_utils import call_with_values

# NOTE [layer walk]
# With the head h₀ = f₀(θ), the layers hᵢ₊₁ = fᵢ(hᵢ, θᵢ) and the tail L = g(h_L, θ),
# the gradient is the pullback chain aᵢ = ∂ₕfᵢᵀ aᵢ₊₁ (a_L = ∂ₕg), collecting
# ∂_θfᵢᵀ aᵢ₊₁, ∂_θg and ∂_θf₀ᵀ a₀. H v is that gradient's derivative along v:
# 1. forward walk: (hᵢ₊₁, ḣᵢ₊₁) = jvp(fᵢ, (hᵢ, θᵢ), (ḣᵢ, vᵢ)), keeping every hᵢ, ḣᵢ;
# 2. tail: (a_L, g_θ), their tangents = jvp(grad g, (h_L, θ), (ḣ_L, v));
# 3. backward walk: ((aᵢ, gᵢ), (ȧᵢ, ġᵢ)) = jvp(pullback of fᵢ, (hᵢ, θᵢ, aᵢ₊₁),
#    (ḣᵢ, vᵢ, ȧᵢ₊₁)); ġᵢ is the layer's block of H v;
# 4. head: ġ₀ from jvp(pullback of f₀, (θ, a₀), (v, ȧ₀)), added to the tail's ġ_θ
#    (tied weights, e.g. an embedding and the LM head, get both uses).
# Each stage's forward runs twice (walk 1 and 3); memory is the boundary
# activations twice over plus one stage's graph. The head and the tail run the
# whole loss_fn with the layers replaced by stubs (the head stops at the first
# layer's input; in the tail the layers return their recorded outputs and the
# last returns h_L), so any model code outside the layers runs as written.
# Layer parameters must belong to one layer only: a parameter shared between a
# layer and anything else is refused (its cross terms would be dropped), whether
# shared by registration (checked at construction) or read from outside the
# layer's call (checked at capture, NOTE [what the walk checks]).
# Parameters not selected (param_filter) are constants: every stage reads them
# detached, so no product builds a graph to them.
# A sandwich Jᵀ H J v (GGN, Fisher) is the first walk to the output, H applied
# there, and the pullbacks back (each stage's forward again, no tangents).


# NOTE [kept layer graphs]
# The backward walk of NOTE [layer walk] runs each layer's forward with
# tangents again: in forward-costs F of the layer (a matmul's tangent is two
# matmuls), the forward walk takes 3F and the backward walk 9F (3F forward
# again, then the pullback and its tangent, 6F), 12F against a training
# step's 3F. Where memory allows, the forward walk instead records the
# layer's jvp under vjp (reverse over forward), φ(x, θ, ẋ) = (y, ẏ) with
# ẏ = J_x ẋ + J_θ v, and the backward walk pulls the pair (ȧᵢ₊₁, aᵢ₊₁) back
# through it: ∂ₓ is ȧᵢ, ∂_θ is ġᵢ, and ∂_ẋ is J_xᵀ aᵢ₊₁ = aᵢ (ẏ is linear in
# ẋ). Mixed second derivatives are symmetric, so this is the jvp of the
# pullback to rounding, at 9F instead of 12F and without gathering the layer
# again; the price is the jvp's graph (about twice a training step's
# activations of the layer) held from the forward walk to the layer's turn in
# the backward walk. Layers are kept in order while their graphs fit
# `keep_bytes`. By default, on CUDA, that is what is free when the product
# starts (free to the driver plus the allocator's unused cache) less the walk's
# own working set and a tenth of the device: the first product of each batch
# signature keeps nothing and reads its working set off the allocator's peak
# (an upper bound when an earlier peak of the process was higher: then less is
# kept); the size of a graph is measured as the allocation grows. Both are
# kept per batch signature, since both grow with the batch (an uneven last
# batch is measured on its own). On the CPU nothing is kept.
# Not every forward-mode formula of torch can be differentiated in reverse:
# layer_norm's reads its mean and inverse deviation as constants (they are
# non-differentiable outputs of the native op), so reverse over forward drops
# terms (0.7 relative error on one call, torch 2.13). While a kept graph is
# recorded, F.layer_norm runs as its composite formula. Against formulas not
# known, the first kept layer of a walk is also computed the recomputing way
# once and compared (to the square root of the dtype's epsilon); if they
# differ, keeping is off for the walk (`keep_refused` says why).


# NOTE [hooks on the layers]
# Hooks the user put on a layer (a steering vector added to its output, a
# pre-hook that edits its input) belong to the layer's stage: the walk calls
# the layer through its __call__, so they run there once, on the layer's input
# as it came (recorded before any pre-hook) and on its output. In the stubbed
# head and tail the layers' hooks are set aside: the head stops at the first
# layer's input as it came, and in the tail each layer returns its recorded
# output, which its hooks had already made.


def _primary(out: Any) -> torch.Tensor:
    """The hidden state in a layer's output: the tensor, or the first element of a tuple."""
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
        return out[0]
    raise LayerWalkError(
        f"a layer returned {type(out).__name__}; the walk needs a tensor or a tuple whose first "
        "element is the hidden state"
    )


def _with_primary(out: Any, h: torch.Tensor) -> Any:
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


#: ``agree(x, "min" | "max")``: ``x`` reduced over the ranks that walk together
Agree = Callable[[float, str], float]
#: ``gather([(name, shard or None), ...]) -> whole tensors`` and ``finish([(name, block), ...])
#: -> the product's blocks``, one call per stage (NOTE [sharded layer walk])
Gather = Callable[[list[tuple[str, "torch.Tensor | None"]]], list[torch.Tensor]]
Finish = Callable[[list[tuple[str, torch.Tensor]]], list[torch.Tensor]]


def _jvp(
    f: Callable[..., Any], primals: tuple[Any, ...], tangents: tuple[Any, ...]
) -> tuple[Any, Any]:
    """``torch.func.jvp`` without auxiliary outputs: (outputs, their tangents)."""
    out = torch.func.jvp(f, primals, tangents)
    return out[0], out[1]


def _vjp(f: Callable[..., Any], *primals: Any) -> tuple[Any, Callable[..., Any]]:
    """``torch.func.vjp`` without auxiliary outputs: (outputs, the pullback)."""
    out = torch.func.vjp(f, *primals)
    return out[0], out[1]


def _layer_norm(
    x: torch.Tensor,
    normalized_shape: Sequence[int],
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    eps: float = 1e-5,
) -> torch.Tensor:
    dims = tuple(range(-len(normalized_shape), 0))
    centred = x - x.mean(dims, keepdim=True)
    out = centred * torch.rsqrt(centred.pow(2).mean(dims, keepdim=True) + eps)
    if weight is not None:
        out = out * weight
    return out + bias if bias is not None else out


class _DifferentiableNorms(torch.overrides.TorchFunctionMode):
    """``F.layer_norm`` as its composite formula, whose forward-mode derivative differentiates in
    reverse (NOTE [kept layer graphs])."""

    def __torch_function__(
        self, func: Any, types: Any, args: Sequence[Any] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        if func is torch.nn.functional.layer_norm:
            return _layer_norm(*args, **(kwargs or {}))
        return func(*args, **(kwargs or {}))


#: by default kept layer graphs leave this fraction of the device free (NOTE [kept layer graphs])
WALK_FREE_FRACTION = 0.1


class _Keep:
    """The room left for kept layer graphs in one product (NOTE [kept layer graphs]): a layer is
    kept while the graphs kept so far plus one more of the last measured size fit ``room``."""

    def __init__(
        self, room: int, device: torch.device, size: int | None, count: int | None = None
    ) -> None:
        self.room = room
        self.limit = count  # the number of layers to keep, when agreed beforehand
        self.device = device
        self.size = size  # one graph's bytes, once measured (else the first is admitted unseen)
        self.used = 0
        self.count = 0

    def admits(self) -> bool:
        if self.limit is not None:
            return self.count < self.limit
        if self.room <= 0:
            return False
        return self.size is None or self.used + self.size <= self.room

    def mark(self) -> int:
        return _torch_compat.cuda_allocated(self.device) if self.device.type == "cuda" else 0

    def grew(self, mark: int) -> None:
        self.count += 1
        if self.device.type == "cuda":
            self.size = max(0, _torch_compat.cuda_allocated(self.device) - mark)
            self.used += self.size
        else:  # no allocator to read: the room counts layers (keep_bytes=k keeps k of them)
            self.size = 1
            self.used += 1


class LayerWalk:
    """``H v`` of ``loss_fn(model, batch)`` with respect to the parameters ``names`` (the
    model's registered names), one layer at a time (module docstring, NOTE [layer walk])."""

    def __init__(
        self,
        model: nn.Module,
        loss_fn: Callable[[nn.Module, Batch], torch.Tensor],
        names: Sequence[str],
        layers: str | Sequence[nn.Module],
        *,
        gather: Gather | None = None,
        finish: Finish | None = None,
        keep_bytes: int | None = None,
        agree: Agree | None = None,
    ) -> None:
        """``gather([(name, shard), ...])``: for each, the whole parameter ``name`` (``shard``
        None) or the whole direction from this process's ``shard`` of it; ``finish([(name,
        block), ...])``: what the product returns for each parameter's block of the result. One
        call per stage; both are the identity on one device; a sharded model gathers stage by
        stage and reduces each block to its shard (NOTE [sharded layer walk] in
        ``sharded_walk``). ``keep_bytes``: room for layers' graphs kept from the forward walk to the
        backward walk of a Hessian product (NOTE [kept layer graphs]; None: on CUDA, what is
        free beyond the walk's working set and a tenth of the device, none on the CPU; on the CPU
        a number counts layers). ``agree(x, "min" | "max")``:
        ``x`` reduced over the processes that walk together (a sharded model's ranks), so that
        they keep the same layers and gather alike."""
        self.model = model
        self.keep_bytes = keep_bytes
        self._agree = agree
        #: the last kept layer graph's size in bytes (NOTE [kept layer graphs])
        self.layer_graph_bytes: int | None = None
        #: how many layers the last Hessian product kept
        self.kept_layers = 0
        #: why keeping is off for this walk (its first kept layer disagreed with the recomputed one)
        self.keep_refused: str | None = None
        self._keep_checked = False
        #: by batch signature (a graph's size and the walk's working set grow with the batch):
        #: an upper bound of what a product without kept graphs allocates at its peak, and one
        #: kept layer graph's size, once measured (CUDA)
        self._sizes: dict[Any, tuple[int | None, int | None]] = {}
        self._gather = gather
        self._finish = finish
        #: the batch signatures whose structure was checked (NOTE [what the walk checks])
        self._checked: set[Any] = set()
        self.call = CallWithModel(model, loss_fn)
        self.layers = find_layers(model, layers)
        self.names = list(names)
        prefix = {id(m): n for n, m in model.named_modules()}
        self.prefixes = []
        for layer in self.layers:
            if id(layer) not in prefix:
                raise LayerWalkError("every layer must be a submodule of the model")
            self.prefixes.append(prefix[id(layer)] + ".")
        part = partition(model, self.names, self.prefixes)
        self.local, self.outside = part.local, part.outside
        self.fixed_local, self.fixed_outside = part.fixed_local, part.fixed_outside
        self._const_out: dict[str, torch.Tensor] = {}
        self._const_in: list[dict[str, torch.Tensor]] = [{} for _ in self.layers]

    # -- the batch's layer calls ------------------------------------------------
    def capture(self, batch: Batch) -> WalkState:
        """Run the loss once without a graph, recording each layer's call; check the stack (NOTE
        [what the walk checks])."""
        # each stage runs more than once per product: what changes between calls is refused
        check_functional_model(self.model, "layers")
        rec = record_calls(self.call, self.layers, batch)
        check_order(rec.order, len(self.layers))
        for i in range(1, len(rec.calls)):
            if rec.inputs[i] is not _primary(rec.calls[i - 1].output):
                raise LayerWalkError(
                    f"layer {i}'s input is not layer {i - 1}'s output: the walk needs a stack of "
                    "layers, each fed by the one before"
                )
        state = WalkState(batch, rec.calls)
        sharded = self._gather is not None or self._agree is not None
        key = "first" if sharded else batch_signature(batch)
        if key not in self._checked:
            h = _primary(state.calls[-1].output)
            check_tail(lambda: self.tail(state, h, {}), rec.output, rec.collected)
            if sharded:
                check_constant_arguments(self.call, batch, self.layers)
            else:
                check_reads(self.call, batch, self.model, self.names, self.local, self.layers)
            self._checked.add(key)
        return state

    # -- the stages --------------------------------------------------------------
    @contextlib.contextmanager
    def _stubbed(self, stub: Callable[[int, tuple[Any, ...]], Any]) -> Iterator[None]:
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

    def _constants(self) -> None:
        """The trainable parameters not selected, detached, for each stage that reads them: they
        are constants of the product (NOTE [layer walk]). Read at each product's start."""
        get = self.model.get_parameter
        self._const_out = {
            f"model.{n}": get(n).detach() for n in self.fixed_outside if get(n).requires_grad
        }
        self._const_in = [
            {loc: get(n).detach() for loc, n in names.items() if get(n).requires_grad}
            for names in self.fixed_local
        ]

    def head(self, state: WalkState, theta: dict[str, torch.Tensor]) -> torch.Tensor:
        """h₀: the first layer's input, as a function of the parameters outside the layers."""

        def stub(i: int, args: tuple[Any, ...]) -> Any:
            raise _Stop(args[0])

        with self._stubbed(stub):
            try:
                call_with_values(self.call, self._outside_values(theta), (state.batch,))
            except _Stop as stop:
                return stop.h
        raise LayerWalkError("the loss never called the first layer")

    def layer(
        self, state: WalkState, i: int, h: torch.Tensor, theta: dict[str, torch.Tensor]
    ) -> torch.Tensor:
        c = state.calls[i]
        if self._const_in[i]:
            theta = {**self._const_in[i], **theta}
        out = torch.func.functional_call(self.layers[i], theta, (h, *c.args), c.kwargs)
        return _primary(out)

    def tail(
        self, state: WalkState, h: torch.Tensor, theta: dict[str, torch.Tensor]
    ) -> torch.Tensor:
        """What the call returns (the loss, or the output a sandwich differentiates) as a function
        of the last layer's output and the parameters outside the layers."""
        last = len(self.layers) - 1

        def stub(i: int, args: tuple[Any, ...]) -> Any:
            out = state.calls[i].output
            return _with_primary(out, h) if i == last else out

        with self._stubbed(stub):
            return call_with_values(self.call, self._outside_values(theta), (state.batch,))

    # -- stage values ---------------------------------------------------------------
    def _stage(
        self, i: int | None, v: dict[str, torch.Tensor]
    ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """Stage ``i``'s parameters and direction (those in ``v``) by local name (``None``: the
        parameters outside the layers, by full name), gathered whole in one ``gather``."""
        pairs = [(n, n) for n in self.outside] if i is None else list(self.local[i].items())
        moving = [(loc, n) for loc, n in pairs if n in v]
        items: list[tuple[str, torch.Tensor | None]] = [(n, None) for _, n in pairs]
        items += [(n, v[n]) for _, n in moving]
        if self._gather is None:
            whole = [self._params[n].detach() if t is None else t for n, t in items]
        else:
            whole = self._gather(items)
        theta = {loc: t for (loc, _), t in zip(pairs, whole, strict=False)}
        return theta, {loc: t for (loc, _), t in zip(moving, whole[len(pairs) :], strict=True)}

    def _done(self, blocks: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The result's blocks as the product returns them (one ``finish`` per stage)."""
        if self._finish is None or not blocks:
            return blocks
        return dict(zip(blocks, self._finish(list(blocks.items())), strict=True))

    # -- the product ---------------------------------------------------------------
    def _forward_walk(
        self,
        state: WalkState,
        v: dict[str, torch.Tensor],
        out_theta: dict[str, torch.Tensor],
        out_v: dict[str, torch.Tensor],
        *,
        keep_tangents: bool,
        keep: _Keep | None = None,
    ) -> tuple[list[torch.Tensor], list[torch.Tensor], list[Callable[..., Any] | None]]:
        """Every layer's input hᵢ (and h_L) with its tangent along ``v``: all the tangents when
        ``keep_tangents``, else the last one only; and each layer's kept pullback of its jvp, or
        None (NOTE [kept layer graphs])."""
        if out_theta:
            h, hd = _jvp(lambda th: self.head(state, th), (out_theta,), (out_v,))
        else:  # the layers' input does not depend on the parameters
            h = self.head(state, {})
            hd = torch.zeros_like(h)
        hs, hds = [h], [hd]
        pulls: list[Callable[..., Any] | None] = []
        for i in range(len(self.layers)):
            mark = keep.mark() if keep is not None and keep.admits() else None
            theta, vi = self._stage(i, v)

            def layer(x: torch.Tensor, th: dict[str, torch.Tensor], _i: int = i) -> torch.Tensor:
                return self.layer(state, _i, x, th)

            if keep is not None and mark is not None:

                def tangent(
                    x: torch.Tensor,
                    th: dict[str, torch.Tensor],
                    xd: torch.Tensor,
                    _f: Callable[..., torch.Tensor] = layer,
                    _vi: dict[str, torch.Tensor] = vi,
                ) -> Any:
                    return _jvp(_f, (x, th), (xd, _vi))

                with _DifferentiableNorms():
                    (h, hd), pull = _vjp(tangent, hs[-1], theta, hds[-1])
                keep.grew(mark)
                pulls.append(pull)
            else:
                h, hd = _jvp(layer, (hs[-1], theta), (hds[-1], vi))
                pulls.append(None)
            hs.append(h)
            hds = [*hds, hd] if keep_tangents else [hd]
            del theta, vi
        return hs, hds, pulls

    def _keep(self, like: torch.Tensor, working: int | None, size: int | None) -> _Keep:
        """The room for this product's kept layer graphs (NOTE [kept layer graphs]), given the
        working set and graph size measured on this batch signature."""
        room = self.keep_bytes
        if self.keep_refused is not None:
            room = 0
        elif room is None:
            room = 0
            if like.device.type == "cuda" and working is not None:
                free, total = torch.cuda.mem_get_info(like.device)
                unused = _torch_compat.cuda_reserved(like.device) - _torch_compat.cuda_allocated(
                    like.device
                )
                room = max(0, free + unused - working - int(WALK_FREE_FRACTION * total))
        count = None
        if self._agree is not None:
            # ranks keep the same layers, so that their gathers pair up: as many as fit every rank
            # (none on the first product, one to measure on the next)
            fits = (1 if room > 0 else 0) if size is None else room // max(size, 1)
            count = int(self._agree(float(min(fits, len(self.layers))), "min"))
        return _Keep(room, like.device, size, count)

    def hvp(self, state: WalkState, v: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``H v`` by the walk of NOTE [layer walk]; ``v`` and the result by parameter name.
        Each layer's parameters are gathered once on the way forward and once back."""
        _torch_compat.load_forward_ad_decompositions()
        like = next(iter(v.values()))
        start = _torch_compat.cuda_allocated(like.device) if like.device.type == "cuda" else 0
        self._params = dict(self.model.named_parameters())
        self._constants()
        out_theta, out_v = self._stage(None, v)
        result: dict[str, torch.Tensor] = {}

        # 1. forward walk
        sizes_key = batch_signature(state.batch)
        working, size = self._sizes.get(sizes_key, (None, None))
        keep = self._keep(like, working, size)
        hs, hds, pulls = self._forward_walk(
            state, v, out_theta, out_v, keep_tangents=True, keep=keep
        )
        self.layer_graph_bytes, self.kept_layers = keep.size, keep.count
        # 2. tail
        grad_tail = torch.func.grad(
            lambda x, th: self.tail(state, x, th).reshape(()), argnums=(0, 1)
        )
        (a, _), (ad, g_tail) = _jvp(grad_tail, (hs[-1], out_theta), (hds[-1], out_v))
        for n, t in g_tail.items():
            result[n] = t
        # 3. backward walk
        for i in reversed(range(len(self.layers))):
            kept, pulls[i] = pulls[i], None
            if kept is not None:  # NOTE [kept layer graphs]
                ad_new, g, a_new = kept((ad, a))
                del kept
                if not self._keep_checked:
                    self._keep_checked = True
                    ref = self._pullback_tangent(state, i, v, hs[i], hds[i], a, ad)
                    gap = _relative_gap((a_new, ad_new, g), ref)
                    if self._agree is not None:
                        gap = self._agree(gap, "max")
                    if gap > float(torch.finfo(a_new.dtype).eps) ** 0.5:
                        self.keep_refused = (
                            f"a kept layer's product differed from the recomputed one by {gap:.1e}"
                        )
                        pulls = [None] * len(pulls)
                        a_new, ad_new, g = ref
            else:
                a_new, ad_new, g = self._pullback_tangent(state, i, v, hs[i], hds[i], a, ad)
            result.update(self._done({n: g[loc] for loc, n in self.local[i].items()}))
            a, ad = a_new, ad_new
            hs[i + 1] = hds[i + 1] = None  # type: ignore[call-overload]  # freed as the walk goes
        # 4. head
        if self.outside:

            def pull_head(th: dict[str, torch.Tensor], cot: torch.Tensor) -> Any:
                _, fn = _vjp(lambda t: self.head(state, t), th)
                return fn(cot)[0]

            _, g_head = _jvp(pull_head, (out_theta, a), (out_v, ad))
            for n, t in g_head.items():
                result[n] = result[n] + t
        result.update(self._done({n: result[n] for n in self.outside}))
        if like.device.type == "cuda" and keep.count == 0:  # NOTE [kept layer graphs]
            working = torch.cuda.max_memory_allocated(like.device) - start
        self._sizes[sizes_key] = (working, keep.size)
        # detached: a hook or closure may read a trainable parameter that is not selected (a
        # constant of the product, NOTE [what the walk checks]) and leave a graph to it
        return {n: result[n].detach() for n in self.names}

    def _pullback_tangent(
        self,
        state: WalkState,
        i: int,
        v: dict[str, torch.Tensor],
        h: torch.Tensor,
        hd: torch.Tensor,
        a: torch.Tensor,
        ad: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        """Layer ``i``'s pullback of ``a`` and its tangent, recomputed: (aᵢ, ȧᵢ, ġᵢ)."""

        def pull(x: torch.Tensor, th: dict[str, torch.Tensor], cot: torch.Tensor) -> Any:
            _, fn = _vjp(lambda y, t: self.layer(state, i, y, t), x, th)
            return fn(cot)

        theta, vi = self._stage(i, v)
        (a_new, _), (ad_new, g) = _jvp(pull, (h, theta, a), (hd, vi, ad))
        return a_new, ad_new, g

    def sandwich(
        self,
        state: WalkState,
        v: dict[str, torch.Tensor],
        output_product: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    ) -> dict[str, torch.Tensor]:
        """``Jᵀ H J v`` of the call's output (``output_product(output, u) = H u``) by a forward walk
        of ``J v`` and a backward walk of the pullbacks (NOTE [layer walk]); no second order term."""
        _torch_compat.load_forward_ad_decompositions()
        self._params = dict(self.model.named_parameters())
        self._constants()
        out_theta, out_v = self._stage(None, v)
        hs, (hd,), _ = self._forward_walk(state, v, out_theta, out_v, keep_tangents=False)
        out, pull_tail = _vjp(lambda x, th: self.tail(state, x, th), hs[-1], out_theta)
        jv = _jvp(lambda x, th: self.tail(state, x, th), (hs[-1], out_theta), (hd, out_v))[1]
        a, g_tail = pull_tail(output_product(out.detach(), jv))
        result = dict(g_tail)
        for i in reversed(range(len(self.layers))):
            theta, _ = self._stage(i, {})
            _, pull = _vjp(lambda y, t, _i=i: self.layer(state, _i, y, t), hs[i], theta)
            a, g = pull(a)
            del theta
            result.update(self._done({n: g[loc] for loc, n in self.local[i].items()}))
        if self.outside:
            _, pull_head = _vjp(lambda t: self.head(state, t), out_theta)
            for n, t in pull_head(a)[0].items():
                result[n] = result[n] + t
        result.update(self._done({n: result[n] for n in self.outside}))
        # detached: a hook or closure may read a trainable parameter that is not selected (a
        # constant of the product, NOTE [what the walk checks]) and leave a graph to it
        return {n: result[n].detach() for n in self.names}


class LayerWalkRunner:
    """``engine="layers"``: a curvature's per-batch products by :class:`LayerWalk` (the runner
    interface of ``engines.runner``). A batch's state is its layers' recorded calls (the boundary
    activations); a product walks the layers once per direction. Not recorded as a CUDA graph."""

    name = "layers"
    traced = False
    recordable = False

    def __init__(
        self,
        walk: LayerWalk,
        counts: ProductCounts,
        *,
        batch_of: Callable[[Batch], Batch] | None = None,
        output_product: Callable[[torch.Tensor, Batch, Any, torch.Tensor], torch.Tensor]
        | None = None,
        keyed: bool = False,
    ) -> None:
        """``output_product(output, batch, key, u) = H u``: the products are the sandwich
        ``Jᵀ H J v`` of the walk's call (else its Hessian); ``batch_of`` gives the batch with its
        draw key beside it when ``keyed`` (the curvature's ``_engine_batch``)."""
        self.walk = walk
        self.counts = counts
        self.batch_of = batch_of
        self.output_product = output_product
        self.keyed = keyed

    def prepare(self, batch: Batch, params: Sequence[torch.Tensor] | None = None) -> WalkState:
        del params  # the walk reads the model's parameters at each product
        self.counts.forwards += 1
        key = None
        if self.batch_of is not None:
            batch = self.batch_of(batch)
            if self.keyed:
                batch, key = batch
        with _torch_compat.math_sdpa():  # the attention the walk differentiates (see apply)
            state = self.walk.capture(batch)
        state.key = key
        return state

    def _product(self, state: WalkState, v: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        if self.output_product is None:
            return self.walk.hvp(state, v)
        op = self.output_product
        return self.walk.sandwich(state, v, lambda out, u: op(out, state.batch, state.key, u))

    def apply(
        self, state: WalkState, vectors: list[torch.Tensor], retain: bool
    ) -> Sequence[torch.Tensor | None]:
        del retain  # the state holds plain tensors
        names = self.walk.names
        rows = []
        for j in range(vectors[0].shape[0]):
            # SDPA's flash and memory-efficient kernels have no forward-mode derivative: the math
            # kernel, whatever the user's SDPA switches (restored after)
            with _torch_compat.math_sdpa():
                out = self._product(state, {n: v[j] for n, v in zip(names, vectors, strict=True)})
            rows.append([out[n] for n in names])
        return [torch.stack([r[i] for r in rows]) for i in range(len(names))]

    def describe(self) -> dict[str, Any]:
        walk = self.walk
        out: dict[str, Any] = {"engine": self.name, "layers": len(walk.layers)}
        # NOTE [kept layer graphs]: how many the last Hessian product kept
        out["kept_layers"] = walk.kept_layers
        if walk.keep_refused is not None:
            out["keep_refused"] = walk.keep_refused
        return out
