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

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from hessian_eigenthings import _torch_compat
from hessian_eigenthings.batching import Batch
from hessian_eigenthings.operators.engines.functional import check_functional_model
from hessian_eigenthings.operators.engines.layer_checks import (
    LayerWalkError,
    check_constant_arguments,
    check_order,
    check_reads,
    check_tail,
    record_calls,
    relative_gap,
)
from hessian_eigenthings.operators.engines.layer_keep import (
    WALK_FREE_FRACTION,
    DifferentiableNorms,
    Keep,
    keep_room,
)
from hessian_eigenthings.operators.engines.layer_stages import (
    Agree,
    Finish,
    Gather,
    WalkStages,
    WalkState,
    primary,
)
from hessian_eigenthings.operators.engines.runner import ProductCounts
from hessian_eigenthings.operators.engines.tracing import batch_signature

__all__ = [
    "WALK_FREE_FRACTION",
    "Agree",
    "Finish",
    "Gather",
    "LayerWalk",
    "LayerWalkRunner",
    "WalkState",
]

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


class LayerWalk:
    """``H v`` of ``loss_fn(model, batch)`` with respect to the parameters ``names`` (the
    model's registered names), one layer at a time (module docstring, NOTE [layer walk]). The
    stages it composes are :class:`~hessian_eigenthings.operators.engines.layer_stages.WalkStages`
    (``stages``)."""

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
        """``gather([(name, shard), ...])``: issues, and returns the handle of, the gather of
        each whole parameter ``name`` (``shard`` None) or whole direction from this process's
        ``shard`` of it (its ``wait()`` returns them); ``finish([(name, block), ...])``: what the
        product returns for each parameter's block of the result, and the handle to wait before
        they are read. One call each per stage; both are the identity on one device (``None``); a
        sharded model gathers stage by stage and reduces each block to its shard (NOTE [sharded
        layer walk] in ``sharded_walk``), the next stage's gather in flight while a stage
        computes unless ``prefetch`` is set False (NOTE [prefetched gathers]). ``keep_bytes``: room for layers' graphs kept from the forward walk to the
        backward walk of a Hessian product (NOTE [kept layer graphs]; None: on CUDA, what is
        free beyond the walk's working set and a tenth of the device, none on the CPU; on the CPU
        a number counts layers). ``agree(x, "min" | "max")``:
        ``x`` reduced over the processes that walk together (a sharded model's ranks), so that
        they keep the same layers and gather alike."""
        self.model = model
        self.keep_bytes = keep_bytes
        self._agree = agree
        self.stages = WalkStages(model, loss_fn, names, layers, gather, finish)
        self.layers, self.names = self.stages.layers, self.stages.names
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
        #: the batch signatures whose structure was checked (NOTE [what the walk checks])
        self._checked: set[Any] = set()

    @property
    def prefetch(self) -> bool:
        """Whether a sharded walk gathers each stage while the one before it computes and leaves
        a stage's reduce-scatter in flight until the next one's (NOTE [prefetched gathers] in
        ``sharded_walk``; default True). False: each collective waited where it is issued. The
        products are the same bits either way."""
        return self.stages.prefetch

    @prefetch.setter
    def prefetch(self, on: bool) -> None:
        self.stages.prefetch = bool(on)

    def capture(self, batch: Batch) -> WalkState:
        """Run the loss once without a graph, recording each layer's call; check the stack (NOTE
        [what the walk checks])."""
        # each stage runs more than once per product: what changes between calls is refused
        check_functional_model(self.model, "layers")
        st = self.stages
        rec = record_calls(st.call, self.layers, batch)
        check_order(rec.order, len(self.layers))
        for i in range(1, len(rec.calls)):
            if rec.inputs[i] is not primary(rec.calls[i - 1].output):
                raise LayerWalkError(
                    f"layer {i}'s input is not layer {i - 1}'s output: the walk needs a stack of "
                    "layers, each fed by the one before"
                )
        state = WalkState(batch, rec.calls)
        sharded = st.gather is not None or self._agree is not None
        key = "first" if sharded else batch_signature(batch)
        if key not in self._checked:
            h = primary(state.calls[-1].output)
            check_tail(lambda: st.tail(state, h, {}), rec.output, rec.collected)
            if sharded:
                check_constant_arguments(st.call, batch, self.layers)
            else:
                check_reads(st.call, batch, self.model, self.names, st.local, self.layers)
            self._checked.add(key)
        return state

    # -- the product ---------------------------------------------------------------
    def _forward_walk(
        self,
        state: WalkState,
        v: dict[str, torch.Tensor],
        out_theta: dict[str, torch.Tensor],
        out_v: dict[str, torch.Tensor],
        *,
        keep_tangents: bool,
        keep: Keep | None = None,
    ) -> tuple[list[torch.Tensor], list[torch.Tensor], list[Callable[..., Any] | None]]:
        """Every layer's input hᵢ (and h_L) with its tangent along ``v``: all the tangents when
        ``keep_tangents``, else the last one only; and each layer's kept pullback of its jvp, or
        None (NOTE [kept layer graphs])."""
        st = self.stages
        if out_theta:
            h, hd = _jvp(lambda th: st.head(state, th), (out_theta,), (out_v,))
        else:  # the layers' input does not depend on the parameters
            h = st.head(state, {})
            hd = torch.zeros_like(h)
        hs, hds = [h], [hd]
        pulls: list[Callable[..., Any] | None] = []
        for i in range(len(self.layers)):
            mark = keep.mark() if keep is not None and keep.admits() else None
            theta, vi = st.stage(i, v)

            def layer(x: torch.Tensor, th: dict[str, torch.Tensor], _i: int = i) -> torch.Tensor:
                return st.layer(state, _i, x, th)

            if keep is not None and mark is not None:

                def tangent(
                    x: torch.Tensor,
                    th: dict[str, torch.Tensor],
                    xd: torch.Tensor,
                    _f: Callable[..., torch.Tensor] = layer,
                    _vi: dict[str, torch.Tensor] = vi,
                ) -> Any:
                    return _jvp(_f, (x, th), (xd, _vi))

                with DifferentiableNorms():
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

    def hvp(self, state: WalkState, v: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``H v`` by the walk of NOTE [layer walk]; ``v`` and the result by parameter name.
        Each layer's parameters are gathered once on the way forward and once back."""
        _torch_compat.load_forward_ad_decompositions()
        st = self.stages
        like = next(iter(v.values()))
        start = _torch_compat.cuda_allocated(like.device) if like.device.type == "cuda" else 0
        st.begin()
        layers = range(len(self.layers))
        with st.visiting([(None, v), *((i, v) for i in layers)]):
            out_theta, out_v = st.stage(None, v)
            result: dict[str, torch.Tensor] = {}

            # 1. forward walk
            sizes_key = batch_signature(state.batch)
            working, size = self._sizes.get(sizes_key, (None, None))
            keep = keep_room(
                0 if self.keep_refused is not None else self.keep_bytes,
                like,
                working,
                size,
                layers=len(self.layers),
                agree=self._agree,
            )
            st.plan((i, v) for i in self._gathered_back(keep))
            hs, hds, pulls = self._forward_walk(
                state, v, out_theta, out_v, keep_tangents=True, keep=keep
            )
            self.layer_graph_bytes, self.kept_layers = keep.size, keep.count
            # 2. tail
            grad_tail = torch.func.grad(
                lambda x, th: st.tail(state, x, th).reshape(()), argnums=(0, 1)
            )
            (a, _), (ad, g_tail) = _jvp(grad_tail, (hs[-1], out_theta), (hds[-1], out_v))
            for n, t in g_tail.items():
                result[n] = t
            # 3. backward walk
            for i in reversed(layers):
                kept, pulls[i] = pulls[i], None
                if kept is not None:  # NOTE [kept layer graphs]
                    ad_new, g, a_new = kept((ad, a))
                    del kept
                    if not self._keep_checked:
                        ref = self._pullback_tangent(state, i, v, hs[i], hds[i], a, ad)
                        if not self._kept_agrees((a_new, ad_new, g), ref):
                            pulls = [None] * len(pulls)
                            a_new, ad_new, g = ref
                else:
                    a_new, ad_new, g = self._pullback_tangent(state, i, v, hs[i], hds[i], a, ad)
                result.update(st.layer_blocks(i, g))
                a, ad = a_new, ad_new
                hs[i + 1] = hds[i + 1] = None  # type: ignore[call-overload]  # freed as the walk goes
            # 4. head
            if st.outside:

                def pull_head(th: dict[str, torch.Tensor], cot: torch.Tensor) -> Any:
                    _, fn = _vjp(lambda t: st.head(state, t), th)
                    return fn(cot)[0]

                _, g_head = _jvp(pull_head, (out_theta, a), (out_v, ad))
                for n, t in g_head.items():
                    result[n] = result[n] + t
            result.update(st.done({n: result[n] for n in st.outside}))
            st.settle()
        if like.device.type == "cuda" and keep.count == 0:  # NOTE [kept layer graphs]
            working = torch.cuda.max_memory_allocated(like.device) - start
        self._sizes[sizes_key] = (working, keep.size)
        # detached: a hook or closure may read a trainable parameter that is not selected (a
        # constant of the product, NOTE [what the walk checks]) and leave a graph to it
        return {n: result[n].detach() for n in self.names}

    def _gathered_back(self, keep: Keep) -> list[int]:
        """The layers the backward walk of a Hessian product gathers again, in its order: those
        whose graphs are not kept, and the first kept one while it is checked once (NOTE [kept
        layer graphs]). Known beforehand where the ranks agreed how many to keep (``keep.limit``);
        else every layer is planned, and those kept leave the plan (NOTE [prefetched gathers])."""
        layers = len(self.layers)
        if keep.limit is None:
            return list(reversed(range(layers)))
        kept = min(keep.limit, layers)
        back = list(reversed(range(kept, layers)))
        return [*back, kept - 1] if kept and not self._keep_checked else back

    def _kept_agrees(self, kept: Sequence[Any], ref: Sequence[Any]) -> bool:
        """The walk's first kept layer against the recomputed one (NOTE [kept layer graphs]): if
        they differ beyond the square root of the dtype's epsilon, keeping is off for the walk."""
        self._keep_checked = True
        gap = relative_gap(kept, ref)
        if self._agree is not None:
            gap = self._agree(gap, "max")
        if gap > float(torch.finfo(kept[0].dtype).eps) ** 0.5:
            self.keep_refused = (
                f"a kept layer's product differed from the recomputed one by {gap:.1e}"
            )
            return False
        return True

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
        st = self.stages

        def pull(x: torch.Tensor, th: dict[str, torch.Tensor], cot: torch.Tensor) -> Any:
            _, fn = _vjp(lambda y, t: st.layer(state, i, y, t), x, th)
            return fn(cot)

        theta, vi = st.stage(i, v)
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
        st = self.stages
        st.begin()
        layers = range(len(self.layers))
        back: dict[str, torch.Tensor] = {}  # the backward walk gathers parameters only
        visits = [(None, v), *((i, v) for i in layers), *((i, back) for i in reversed(layers))]
        with st.visiting(visits):
            out_theta, out_v = st.stage(None, v)
            hs, (hd,), _ = self._forward_walk(state, v, out_theta, out_v, keep_tangents=False)
            out, pull_tail = _vjp(lambda x, th: st.tail(state, x, th), hs[-1], out_theta)
            jv = _jvp(lambda x, th: st.tail(state, x, th), (hs[-1], out_theta), (hd, out_v))[1]
            a, g_tail = pull_tail(output_product(out.detach(), jv))
            result = dict(g_tail)
            for i in reversed(layers):
                theta, _ = st.stage(i, back)
                _, pull = _vjp(lambda y, t, _i=i: st.layer(state, _i, y, t), hs[i], theta)
                a, g = pull(a)
                # the pullback holds the layer's parameters: freed before the next layer's
                # arrive (NOTE [prefetched gathers])
                del theta, pull
                result.update(st.layer_blocks(i, g))
            if st.outside:
                _, pull_head = _vjp(lambda t: st.head(state, t), out_theta)
                for n, t in pull_head(a)[0].items():
                    result[n] = result[n] + t
            result.update(st.done({n: result[n] for n in st.outside}))
            st.settle()
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
