"""What the layer walk checks before it walks (NOTE [what the walk checks]).

The structure :class:`~hessian_eigenthings.operators.engines.layers.LayerWalk` needs of a model
(NOTE [layer walk]) is checked here, at construction and at capture, never per product: the
layers named (:func:`find_layers`), each selected parameter in one stage only
(:func:`partition`), the layers' calls recorded on a batch (:func:`record_calls`, NOTE
[key/value caches]) and checked for their order, the tail and what each stage reads.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from hessian_eigenthings.batching import Batch

# NOTE [what the walk checks]
# The walk is exact only for the structure of NOTE [layer walk]; what breaks it
# is refused at capture, once per batch signature (a sharded walk: on its first
# batch, which every rank has), never per product:
# - the calls: each layer once, in the order of the list (a loop over the
#   layers reversed, a layer called twice or skipped are refused), each fed the
#   output of the one before;
# - the tail: the loss run with the layers returning their recorded outputs and
#   their hooks set aside (as the tail stage runs) must give the loss of the
#   recording. A loss that reads what hooks on the layers collect (HF
#   transformers' output_hidden_states / output_attentions are gathered that
#   way) fails or differs there, and is refused naming the cause;
# - the reads (single device): one forward with a graph, cut at every layer's
#   input and output (fresh leaves standing in for them), the selected
#   parameters requiring grad for its duration. Which leaves each stage's
#   result reaches is what it reads: the head and the tail may read the
#   parameters outside the layers, the tail the last layer's output, layer i
#   its input and its own parameters, and a layer's other arguments nothing.
#   Anything more (weight decay on a layer's weight written into loss_fn, a
#   hook adding a selected parameter from outside the layer, a tail reading an
#   inner layer's output) is refused: its terms would be dropped. A sharded
#   walk's gathered parameters are FSDP's, not the leaves such a run reaches:
#   there only the layers' other arguments are checked (one forward with a
#   graph), as before.


# NOTE [key/value caches]
# A model that keeps a key/value cache (HF's default use_cache=True) hands each
# layer the cache object, which the layer appends to. The walk calls every
# layer several times per product, so a recorded cache would grow and change
# the attention. A cache that was empty when the first layer started holds only
# what the layers themselves add (each its own entry), and each layer computes
# the same without it: it is recorded as None. A cache that already held tokens (a past the user passed)
# is refused: pass the whole sequence instead.


def _is_cache(x: Any) -> bool:
    return callable(getattr(x, "get_seq_length", None))


def _cache_len(cache: Any) -> int:
    try:
        return int(cache.get_seq_length())
    except Exception:  # a cache that cannot say: treat as holding tokens (refused)
        return -1


def _without_cache(x: Any, empty: set[int]) -> Any:
    if not _is_cache(x):
        return x
    if id(x) in empty:
        return None
    raise LayerWalkError(
        "a layer received a key/value cache that already held tokens (past_key_values); the walk "
        "calls each layer several times and cannot replay a cache: pass the whole sequence, or "
        "use_cache=False"
    )


def _hf_collecting() -> list[str]:
    """The outputs HF transformers is collecting with hooks now (``output_hidden_states``...)."""
    capturing = sys.modules.get("transformers.utils.output_capturing")
    active = getattr(capturing, "_active_collector", None)
    try:
        got = active.get() if active is not None else None
    except Exception:  # another version's collector: nothing known
        return []
    return (
        [k for k in got if isinstance(k, str) and not k.startswith("_")]
        if isinstance(got, dict)
        else []
    )


def _tensors(tree: Any) -> list[torch.Tensor]:
    return [t for t in pytree.tree_leaves(tree) if isinstance(t, torch.Tensor)]


def _leaf(t: torch.Tensor) -> torch.Tensor:
    """A fresh leaf with ``t``'s values, requiring grad where its dtype can."""
    leaf = t.detach()
    return leaf.requires_grad_() if leaf.is_floating_point() or leaf.is_complex() else leaf


def _reached(roots: Sequence[Any], candidates: Sequence[tuple[str, torch.Tensor]]) -> list[str]:
    """The names of the ``candidates`` that the graph of ``roots`` reaches."""
    roots = [r for r in roots if isinstance(r, torch.Tensor) and r.requires_grad]
    candidates = [(n, t) for n, t in candidates if t.requires_grad]
    if not roots or not candidates:
        return []
    grads = torch.autograd.grad(
        roots,
        [t for _, t in candidates],
        grad_outputs=[torch.ones_like(r) for r in roots],
        retain_graph=True,
        allow_unused=True,
    )
    return [n for (n, _), g in zip(candidates, grads, strict=True) if g is not None]


def _same_values(got: Any, ref: Any) -> bool:
    """Whether two outputs hold the same tensors, to the square root of their dtype's epsilon
    relative to the reference's largest entry (NaN where the reference has NaN)."""
    a, b = _tensors(got), _tensors(ref)
    if len(a) != len(b):
        return False
    for x, y in zip(a, b, strict=True):
        x, y = x.detach(), y.detach()
        if x.shape != y.shape or x.dtype != y.dtype:
            return False
        if not (y.is_floating_point() or y.is_complex()):
            if not torch.equal(x, y):
                return False
            continue
        tol = float(torch.finfo(y.real.dtype).eps) ** 0.5
        finite = y.abs()[torch.isfinite(y)]
        scale = float(finite.max()) if finite.numel() else 0.0
        if not torch.isclose(x, y, rtol=tol, atol=tol * scale, equal_nan=True).all():
            return False
    return True


class LayerWalkError(ValueError):
    """The model, its layers or the loss cannot be walked layer by layer (the message says why)."""


@dataclass
class LayerCall:
    """One layer's call on a batch: its arguments after the hidden state, and its output."""

    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    output: Any


def find_layers(model: nn.Module, layers: str | Sequence[nn.Module]) -> list[nn.Module]:
    """The layers named by a dotted path to a module list (``"transformer.h"``) or given."""
    if isinstance(layers, str):
        try:
            found = model.get_submodule(layers)
        except AttributeError as exc:
            raise LayerWalkError(f"layers={layers!r}: no such submodule of the model") from exc
        mods = list(found.children()) if isinstance(found, (nn.ModuleList, nn.Sequential)) else None
        if not mods:
            raise LayerWalkError(
                f"layers={layers!r} is a {type(found).__name__}; name an nn.ModuleList or "
                "nn.Sequential of the layers"
            )
        return mods
    mods = list(layers)
    if not mods or not all(isinstance(m, nn.Module) for m in mods):
        raise LayerWalkError("layers must name a module list or be a sequence of modules")
    return mods


def relative_gap(got: Sequence[Any], ref: Sequence[Any]) -> float:
    """The largest ``‖got − ref‖ / ‖ref‖`` over matching tensors (dicts compared by key)."""
    worst = 0.0
    for x, y in zip(got, ref, strict=True):
        pairs = [(x[k], y[k]) for k in y] if isinstance(y, dict) else [(x, y)]
        for a, b in pairs:
            scale = float(b.norm())
            worst = max(worst, float((a - b).norm()) / scale if scale > 0 else float(a.norm()))
    return worst


@dataclass
class Partition:
    """The selected parameters by stage: ``local[i]`` layer ``i``'s (local name -> name),
    ``outside`` those outside the layers; the parameters not selected, read as constants
    (NOTE [layer walk]): ``fixed_local[i]`` by local name in layer ``i``, ``fixed_outside`` by
    name outside the layers, one name per tensor and stage."""

    local: list[dict[str, str]]
    outside: list[str]
    fixed_local: list[dict[str, str]]
    fixed_outside: list[str]


def partition(model: nn.Module, names: Sequence[str], prefixes: Sequence[str]) -> Partition:
    """Which selected parameters each layer owns (its parameters' names start with
    ``prefixes[i]``), and those outside them; a selected parameter shared between a layer and
    anything else is refused (checked at construction, NOTE [layer walk])."""
    owner: dict[int, set[int]] = {}  # parameter -> the stages holding it (-1: outside)
    slots: list[tuple[str, nn.Parameter, int]] = []
    for slot, p in model.named_parameters(remove_duplicate=False):
        stage = next((i for i, pre in enumerate(prefixes) if slot.startswith(pre)), -1)
        owner.setdefault(id(p), set()).add(stage)
        slots.append((slot, p, stage))
    params = dict(model.named_parameters())
    chosen = {id(params[n]) for n in names}
    fixed_local: list[dict[str, str]] = [{} for _ in prefixes]
    fixed_outside: list[str] = []
    seen: set[tuple[int, int]] = set()
    for slot, p, stage in slots:
        if id(p) in chosen or (stage, id(p)) in seen:
            continue
        seen.add((stage, id(p)))
        if stage == -1:
            fixed_outside.append(slot)
        else:
            fixed_local[stage][slot[len(prefixes[stage]) :]] = slot
    local: list[dict[str, str]] = [{} for _ in prefixes]
    outside: list[str] = []
    for name in names:
        stages = owner[id(params[name])]
        if len(stages) > 1 and stages != {-1}:
            raise LayerWalkError(
                f"parameter {name!r} is shared between a layer and other parts of the model; "
                "the layer walk cannot take its cross terms (use the whole-graph product)"
            )
        (stage,) = stages
        if stage == -1:
            outside.append(name)
        else:
            local[stage][name[len(prefixes[stage]) :]] = name
    return Partition(local, outside, fixed_local, fixed_outside)


@dataclass
class Recording:
    """One run of the loss without a graph: each layer's call and input in the order made, the
    layers' indices in that order, the call's output, and the outputs HF transformers was
    collecting with hooks meanwhile."""

    calls: list[LayerCall]
    order: list[int]
    inputs: list[Any]
    output: Any
    collected: list[str]


def record_calls(
    call: Callable[[Batch], Any], layers: Sequence[nn.Module], batch: Batch
) -> Recording:
    """Run ``call(batch)`` once without a graph, recording each layer's call as it came (NOTE
    [hooks on the layers]) and its output after its hooks; empty key/value caches recorded as
    None, a cache holding tokens refused (NOTE [key/value caches])."""
    index = {id(m): i for i, m in enumerate(layers)}
    calls: list[LayerCall] = []
    order: list[int] = []
    inputs: list[Any] = []
    raw: list[tuple[tuple[Any, ...], dict[str, Any]]] = []
    empty: set[int] = set()
    collected: set[str] = set()

    def before(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        # NOTE [hooks on the layers]: the call as it comes, before any pre-hook of the layer
        if not args or not isinstance(args[0], torch.Tensor):
            raise LayerWalkError(
                f"layer {type(module).__name__} was called without its hidden state as first "
                "positional argument"
            )
        # NOTE [key/value caches]: the caches that hold nothing when the first layer starts
        if module is layers[0]:
            empty.update(
                id(c) for c in [*args, *kwargs.values()] if _is_cache(c) and _cache_len(c) == 0
            )
        collected.update(_hf_collecting())
        raw.append((args, dict(kwargs)))

    def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> None:
        args, kwargs = raw.pop()  # the layer's call before its pre-hooks
        order.append(index[id(module)])
        inputs.append(args[0])
        calls.append(
            LayerCall(
                tuple(_without_cache(a, empty) for a in args[1:]),
                {k: _without_cache(a, empty) for k, a in kwargs.items()},
                out,  # after every forward hook of the layer (this one runs last)
            )
        )

    handles = [
        *(m.register_forward_pre_hook(before, with_kwargs=True, prepend=True) for m in layers),
        *(m.register_forward_hook(hook, with_kwargs=True) for m in layers),
    ]
    try:
        with torch.no_grad():
            output = call(batch)
    finally:
        for h in handles:
            h.remove()
    return Recording(calls, order, inputs, output, sorted(collected))


def check_order(order: list[int], count: int) -> None:
    """Each of the ``count`` layers called once, in the order of the list (NOTE [what the walk
    checks])."""
    if order == list(range(count)):
        return
    seen = ", ".join(map(str, order[:8])) + (" ..." if len(order) > 8 else "")
    if sorted(order) != list(range(count)):
        raise LayerWalkError(
            f"the loss called the layers {len(order)} times for {count} layers "
            f"(in the order {seen or 'none'}); the walk needs each layer called once per "
            "batch, in the order of the list: use engine='autograd'"
        )
    raise LayerWalkError(
        f"the loss called the layers in the order {seen}, not in the order of the list; the "
        "walk needs each layer called once per batch, in the order of the list: list them in "
        "the order the model calls them, or use engine='autograd'"
    )


def check_tail(tail: Callable[[], Any], output: Any, collected: list[str]) -> None:
    """The tail stage, run as the walk runs it (``tail()``: the layers returning their recorded
    outputs, their hooks set aside), gives the recording's ``output`` (NOTE [what the walk
    checks])."""
    cause = (
        f"the loss asks the model for {' and '.join(f'output_{k}' for k in collected)} "
        "(transformers collects them with hooks on the layers), which the layer walk cannot "
        "provide; use engine='autograd', or do not ask for them in the loss"
        if collected
        else "the loss reads something that the layers' hooks collect or that the layers' "
        "calls change besides their outputs, which the walk's tail cannot reproduce; use "
        "engine='autograd'"
    )
    try:
        with torch.no_grad():
            again = tail()
    except LayerWalkError:
        raise
    except Exception as exc:
        raise LayerWalkError(
            f"{cause} (with the layers replaced by their recorded outputs it raised "
            f"{type(exc).__name__}: {str(exc)[:120]})"
        ) from exc
    if not _same_values(again, output):
        raise LayerWalkError(
            f"{cause} (with the layers replaced by their recorded outputs it gave another value)"
        )


def check_reads(
    call: Callable[[Batch], Any],
    batch: Batch,
    model: nn.Module,
    names: Sequence[str],
    local: Sequence[dict[str, str]],
    layers: Sequence[nn.Module],
) -> None:
    """What each stage reads, by a forward with a graph cut at the layers' inputs and outputs
    (NOTE [what the walk checks]): one forward and about one backward, per batch signature."""
    index = {id(m): i for i, m in enumerate(layers)}
    params = dict(model.named_parameters())
    # the selected parameters, by the name a message gives them, and the layer of each
    selected: list[tuple[str, torch.Tensor]] = [(f"parameter {n!r}", params[n]) for n in names]
    stage = {f"parameter {n!r}": i for i, loc in enumerate(local) for n in loc.values()}
    heads: list[torch.Tensor] = []
    ins: list[torch.Tensor | None] = [None] * len(layers)
    outs: list[Any] = [None] * len(layers)
    cuts: list[list[tuple[int, torch.Tensor]]] = [[] for _ in layers]
    extra: list[list[torch.Tensor]] = [[] for _ in layers]

    def before(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        i = index[id(module)]
        extra[i] = [t for t in _tensors((args[1:], kwargs)) if t.requires_grad]
        if i == 0:
            heads.append(args[0])
        leaf = _leaf(args[0])
        ins[i] = leaf
        return (leaf.clone(), *args[1:]), kwargs

    def after(module: nn.Module, args: Any, kwargs: Any, out: Any) -> Any:
        i = index[id(module)]
        items = list(out) if isinstance(out, (tuple, list)) else [out]
        outs[i] = items[0]  # the hidden state (the recording checked every layer's output)
        fresh = []
        for k, t in enumerate(items):
            if isinstance(t, torch.Tensor) and t.requires_grad:
                leaf = _leaf(t)
                cuts[i].append((k, leaf))
                t = leaf.clone()
            fresh.append(t)
        if isinstance(out, torch.Tensor):
            return fresh[0]
        return type(out)(fresh) if isinstance(out, tuple) else fresh

    frozen = [p for _, p in selected if not p.requires_grad]
    handles = [
        *(m.register_forward_pre_hook(before, with_kwargs=True, prepend=True) for m in layers),
        *(m.register_forward_hook(after, with_kwargs=True) for m in layers),
    ]
    try:
        for p in frozen:  # a selected frozen parameter: read as the others for the check
            p.requires_grad_(True)
        with torch.enable_grad():
            result = call(batch)
        theirs = [(n, p) for n, p in selected if n in stage]
        cut = [(f"layer {j}'s output", t) for j in range(len(layers)) for _, t in cuts[j]]
        cut += [(f"layer {i}'s input", t) for i, t in enumerate(ins) if t is not None]
        # a layer's other arguments: constants (they read no selected parameter, no layer)
        for i, args in enumerate(extra):
            if _reached(args, [*selected, *cut]):
                raise LayerWalkError(
                    f"layer {i} ({type(layers[i]).__name__}) received a tensor argument "
                    "besides its hidden state that depends on the parameters; the walk would "
                    "take it as a constant: use engine='autograd'"
                )
        # the head: the first layer's input reads no layer's parameter
        hit = _reached(heads[:1], theirs)
        if hit:
            raise LayerWalkError(
                f"the model reads {hit[0]} of layer {stage[hit[0]]} before the first layer; "
                "the walk takes a layer's parameters in its own stage only: leave it out of "
                "param_filter, or use engine='autograd'"
            )
        # each layer: its output reads its input and its own parameters only
        for i, out in enumerate(outs):
            others = [(n, p) for n, p in selected if stage.get(n) != i]
            others += [(n, t) for n, t in cut if t is not ins[i]]
            hit = _reached([out], others)
            if hit:
                raise LayerWalkError(
                    f"layer {i}'s call reads {hit[0]}, which is not its own (e.g. a hook or "
                    "closure adding a learned tensor from outside the layer); the walk would "
                    "drop its terms: register it in the layer, leave it out of param_filter, "
                    "or use engine='autograd'"
                )
        # the tail: the last layer's output and the parameters outside the layers only
        last = [t for k, t in cuts[-1] if k == 0]
        hit = _reached(
            [t for t in _tensors(result) if t.requires_grad],
            [*theirs, *((n, t) for n, t in cut if not any(t is u for u in last))],
        )
        if hit and hit[0] in stage:
            raise LayerWalkError(
                f"the loss reads {hit[0]} of layer {stage[hit[0]]} outside the layer (e.g. "
                "weight decay written into loss_fn); the walk would drop those terms: leave the penalty out of loss_fn and add its curvature separately, or "
                "use engine='autograd'"
            )
        if hit:
            raise LayerWalkError(
                f"the loss reads {hit[0]} after the layers, besides the last layer's output "
                "(e.g. a residual over the stack, or hidden states kept aside); the walk needs "
                "each layer's output read by the next layer only: use engine='autograd'"
            )
    finally:
        for p in frozen:
            p.requires_grad_(False)
        for h in handles:
            h.remove()


def check_constant_arguments(
    call: Callable[[Batch], Any], batch: Batch, layers: Sequence[nn.Module]
) -> None:
    """Refuse a tensor argument of a layer, besides its hidden state, that depends on the
    parameters (the walk takes such arguments as constants). The recording runs without a
    graph, so this is one forward with one, on the first batch only."""
    found: list[str] = []

    def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if any(
            isinstance(t, torch.Tensor) and t.requires_grad for t in [*args[1:], *kwargs.values()]
        ):
            found.append(type(module).__name__)

    handles = [m.register_forward_pre_hook(hook, with_kwargs=True, prepend=True) for m in layers]
    try:
        with torch.enable_grad():
            call(batch)
    finally:
        for h in handles:
            h.remove()
    if found:
        raise LayerWalkError(
            f"layer {found[0]} received a tensor argument besides its hidden state that depends "
            "on the parameters; the walk would take it as a constant"
        )
