"""Parameter selection and the flat-vector layout.

A curvature operator acts on the flat concatenation of the selected
parameters. :class:`ParamLayout` is the one object that knows the names,
shapes and offsets of that concatenation; everything else asks it for
per-parameter *views* of a flat vector ``(n,)`` or of a row block ``(k, n)``
instead of slicing offsets itself, so no product ever copies through
``torch.cat``.
"""

from __future__ import annotations

import difflib
import fnmatch
import functools
import math
import re
import warnings
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, overload

import torch
from torch import nn

from hessian_eigenthings._warnings import user_stacklevel

#: Decides whether a named parameter is selected.
ParamFilter = Callable[[str, nn.Parameter], bool]


class ParamFilterWarning(UserWarning):
    """A pattern of a ``param_filter`` matches no parameter while the others select some
    (``["2.weight", "2.bais"]``): most likely a typo."""


#: the patterns of the filters made by match_names / match_regex, and how one is matched
_PATTERNS: weakref.WeakKeyDictionary[
    Callable[..., bool], tuple[tuple[str, ...], Callable[[str, str], bool]]
] = weakref.WeakKeyDictionary()


def _glob_matches(pattern: str, name: str) -> bool:
    return fnmatch.fnmatchcase(name, pattern)


def _regex_matches(pattern: str, name: str) -> bool:
    return re.search(pattern, name) is not None


def match_names(*globs: str) -> ParamFilter:
    """Select parameters whose qualified name matches any shell-style glob.

    ``match_names("fc2.*", "*.bias")`` selects every parameter of ``fc2`` and
    every bias.
    """
    if not globs:
        raise ValueError("match_names needs at least one glob, e.g. match_names('fc2.*')")
    for g in globs:
        if not isinstance(g, str):
            raise TypeError(f"match_names takes strings, got {type(g).__name__}")

    def _filter(name: str, _param: nn.Parameter) -> bool:
        return any(fnmatch.fnmatchcase(name, g) for g in globs)

    _filter.__qualname__ = f"match_names{globs!r}"
    _PATTERNS[_filter] = (globs, _glob_matches)
    return _filter


def match_regex(*patterns: str) -> ParamFilter:
    """Select parameters whose qualified name matches any regex (``re.search``)."""
    if not patterns:
        raise ValueError("match_regex needs at least one pattern, e.g. match_regex(r'\\.weight$')")
    compiled = [re.compile(p) for p in patterns]

    def _filter(name: str, _param: nn.Parameter) -> bool:
        return any(c.search(name) is not None for c in compiled)

    _filter.__qualname__ = f"match_regex{patterns!r}"
    _PATTERNS[_filter] = (patterns, _regex_matches)
    return _filter


def _as_filter(param_filter: ParamFilter | str | Sequence[str] | None) -> ParamFilter | None:
    if param_filter is None or callable(param_filter):
        return param_filter
    if isinstance(param_filter, str):
        return match_names(param_filter)
    if isinstance(param_filter, Sequence) and all(isinstance(s, str) for s in param_filter):
        return match_names(*param_filter)
    raise TypeError(
        "param_filter must be a callable (name, param) -> bool, a glob string or a list of "
        f"globs; got {type(param_filter).__name__}"
    )


def as_param_filter(param_filter: ParamFilter | str | Sequence[str] | None) -> ParamFilter | None:
    """``param_filter`` as a callable ``(name, param) -> bool`` (globs become :func:`match_names`)."""
    return _as_filter(param_filter)


def select_parameters(
    model: nn.Module,
    param_filter: ParamFilter | str | Sequence[str] | None = None,
) -> dict[str, nn.Parameter]:
    """The parameters a curvature operator acts on, by name, in ``named_parameters`` order.

    A ``dict`` as in the 1.0 alpha (``.items()`` gives the ``(name, parameter)`` pairs).

    Without a filter: every parameter with ``requires_grad``. With a filter:
    the parameters it accepts (a frozen parameter may be selected explicitly;
    operators enable its gradient only for the duration of a product).
    Shared (tied) parameters are listed once, under their first name.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    flt = _as_filter(param_filter)
    # a tied parameter has several names (GPT-2's lm_head.weight is transformer.wte.weight):
    # a filter that accepts any of them selects it, listed under its first (registered) name
    aliases: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(p), []).append(name)
    selected: dict[str, nn.Parameter] = {}
    for name, p in model.named_parameters():  # named_parameters de-duplicates tied weights
        if flt is None:
            keep = p.requires_grad
        else:
            keep = any(bool(flt(alias, p)) for alias in aliases.get(id(p), [name]))
        if keep:
            selected[name] = p
    if not selected:
        if flt is None:
            raise ValueError(
                "the model has no parameter with requires_grad=True; unfreeze some or pass "
                "param_filter=match_names(...) to select them explicitly"
            )
        names = [n for n, _ in model.named_parameters()]
        shown = ", ".join(names[:8]) + (f", ... ({len(names)} in all)" if len(names) > 8 else "")
        typos = "".join(f"; {m}" for m in _unmatched_patterns(flt, aliases))
        raise ValueError(
            f"param_filter {getattr(flt, '__qualname__', flt)!r} selected zero parameters{typos}; "
            f"the model's parameters are: {shown}"
        )
    for message in _unmatched_patterns(flt, aliases):
        warnings.warn(
            f"param_filter: {message} (the other patterns select {len(selected)} parameters; "
            "a pattern that is meant to match nothing can be dropped)",
            ParamFilterWarning,
            stacklevel=user_stacklevel(),
        )
    return selected


def _unmatched_patterns(flt: ParamFilter | None, aliases: Mapping[int, list[str]]) -> list[str]:
    """One line per pattern of a match_names / match_regex filter that matches no parameter name,
    with the names closest to it (a typo's likely fix)."""
    try:
        known = _PATTERNS.get(flt) if flt is not None else None
    except TypeError:  # an unhashable or not weak-referenceable callable: not one of ours
        return []
    if known is None:
        return []
    patterns, matches = known
    names = [n for group in aliases.values() for n in group]
    out = []
    for pattern in patterns:
        if not any(matches(pattern, n) for n in names):
            close = difflib.get_close_matches(pattern, names, n=3, cutoff=0.6)
            hint = (
                f"close names: {', '.join(close)}" if close else "no parameter name is close to it"
            )
            out.append(f"'{pattern}' matches no parameter; {hint}")
    return out


@dataclass(frozen=True)
class ParamLayout:
    """Names, shapes and offsets of the flat parameter vector.

    ``split(v)`` returns per-parameter views of ``v`` (shape ``(n,)``) and
    ``split_rows(V)`` per-parameter views ``(k, *shape)`` of a row block ``V``
    of shape ``(k, n)``. Neither copies.
    """

    names: tuple[str, ...]
    shapes: tuple[torch.Size, ...]
    offsets: tuple[int, ...]  # offsets[i] = start of parameter i; offsets[-1] = size
    dtype: torch.dtype
    device: torch.device

    @classmethod
    def from_named(
        cls, named: Mapping[str, torch.Tensor] | Sequence[tuple[str, torch.Tensor]]
    ) -> ParamLayout:
        """The layout of ``(name, tensor)`` pairs, or of a dict such as ``select_parameters``'s."""
        if isinstance(named, Mapping):
            named = list(named.items())
        if not named:
            raise ValueError("a parameter layout needs at least one parameter")
        dtypes = {p.dtype for _, p in named}
        devices = {p.device for _, p in named}
        if len(dtypes) > 1:
            raise ValueError(
                f"the selected parameters have several dtypes {sorted(map(str, dtypes))}; "
                "cast the model to one dtype or select parameters of one dtype with param_filter"
            )
        if len(devices) > 1:
            raise ValueError(
                f"the selected parameters live on several devices {sorted(map(str, devices))}; "
                "move the model to one device or select the parameters of one device"
            )
        offsets = [0]
        for _, p in named:
            offsets.append(offsets[-1] + p.numel())
        return cls(
            names=tuple(n for n, _ in named),
            shapes=tuple(p.shape for _, p in named),
            offsets=tuple(offsets),
            dtype=next(iter(dtypes)),
            device=next(iter(devices)),
        )

    @property
    def size(self) -> int:
        return self.offsets[-1]

    @functools.cached_property
    def numels(self) -> list[int]:
        return [math.prod(s) for s in self.shapes]

    def split(self, vec: torch.Tensor) -> list[torch.Tensor]:
        """Per-parameter views of a flat vector ``(n,)``."""
        if vec.dim() != 1 or vec.shape[0] != self.size:
            raise ValueError(f"expected a vector of shape ({self.size},), got {tuple(vec.shape)}")
        # one split call instead of a Python slice per parameter: this runs on every product
        return [t.view(s) for t, s in zip(vec.split(self.numels), self.shapes, strict=True)]

    def split_rows(self, block: torch.Tensor) -> list[torch.Tensor]:
        """Per-parameter views ``(k, *shape)`` of a row block ``(k, n)``."""
        if block.dim() != 2 or block.shape[1] != self.size:
            raise ValueError(
                f"expected a block of shape (k, {self.size}), got {tuple(block.shape)}"
            )
        k = block.shape[0]
        return [
            t.view(k, *s) for t, s in zip(block.split(self.numels, dim=1), self.shapes, strict=True)
        ]

    def split_flat(self, block: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Per-parameter column blocks ``(k, numel)`` of a row block ``(k, n)``: one call,
        no Python loop (what a recorded product copies in and out, NOTE [views on demand])."""
        return block.split(self.numels, dim=1)

    def empty(self, *lead: int) -> torch.Tensor:
        """A fresh flat buffer of shape ``(*lead, n)`` in the layout's dtype and device."""
        return torch.empty(*lead, self.size, dtype=self.dtype, device=self.device)


# NOTE [views on demand]
# Splitting a row block into per-parameter views of their own shapes is one
# Python call per parameter: for a 124 M-parameter GPT-2 (148 tensors) the
# input and output views of one product cost about 1.5 ms of host time, which
# the device spends idle when the caller waits for each product (Lanczos does).
# A product replayed from a CUDA graph needs no shaped views: it copies the
# direction into its static inputs and its static outputs into the result as
# ``(k, numel)`` column blocks, which ``Tensor.split`` makes in one call. So the
# data loop hands a :class:`RowBlock` around and the shaped views are made only
# when an eager product asks for them.


class RowBlock:
    """A row block ``(k, n)`` of directions; its per-parameter views are made on first use."""

    __slots__ = ("_views", "block", "layout")

    def __init__(self, layout: ParamLayout, block: torch.Tensor) -> None:
        self.layout = layout
        self.block = block
        self._views: list[torch.Tensor] | None = None

    @property
    def k(self) -> int:
        return int(self.block.shape[0])

    @property
    def views(self) -> list[torch.Tensor]:
        """Per-parameter views ``(k, *shape)`` (``ParamLayout.split_rows``), made once."""
        if self._views is None:
            self._views = self.layout.split_rows(self.block)
        return self._views

    def flat(self) -> tuple[torch.Tensor, ...]:
        """Per-parameter column blocks ``(k, numel)`` (``ParamLayout.split_flat``)."""
        return self.layout.split_flat(self.block)


def total_size(params: Mapping[str, torch.Tensor] | Iterable[torch.Tensor]) -> int:
    """Number of entries of all tensors (a dict such as ``select_parameters``'s, or tensors)."""
    items = params.values() if isinstance(params, Mapping) else params
    return sum(int(p.numel()) for p in items)


def _tensors(params: Mapping[str, torch.Tensor] | Iterable[torch.Tensor]) -> list[torch.Tensor]:
    return list(params.values() if isinstance(params, Mapping) else params)


def params_to_vector(params: Mapping[str, torch.Tensor] | Iterable[torch.Tensor]) -> torch.Tensor:
    """Flatten tensors (or a dict of them, in its order) into one new vector (a copy, detached)."""
    plist = _tensors(params)
    if not plist:
        raise ValueError("params_to_vector got no tensors")
    layout = ParamLayout.from_named([(str(i), p) for i, p in enumerate(plist)])
    out = layout.empty()
    with torch.no_grad():
        for view, p in zip(layout.split(out), plist, strict=True):
            view.copy_(p)
    return out


@overload
def vector_to_params(
    vec: torch.Tensor, params: Mapping[str, torch.Tensor]
) -> dict[str, torch.Tensor]: ...
@overload
def vector_to_params(vec: torch.Tensor, params: Iterable[torch.Tensor]) -> None: ...
def vector_to_params(
    vec: torch.Tensor, params: Mapping[str, torch.Tensor] | Iterable[torch.Tensor]
) -> dict[str, torch.Tensor] | None:
    """Split a flat vector by the shapes of ``params``.

    ``params`` a dict (e.g. from ``select_parameters``): returns a dict of
    views of ``vec`` shaped like its values, as the 1.0 alpha did. ``params``
    a sequence of tensors: copies the slices into them, in place.
    """
    plist = _tensors(params)
    layout = ParamLayout.from_named([(str(i), p) for i, p in enumerate(plist)])
    if vec.dim() != 1 or vec.numel() != layout.size:
        raise ValueError(
            f"expected a 1-D vector of {layout.size} elements (the parameters' total), "
            f"got shape {tuple(vec.shape)}"
        )
    if isinstance(params, Mapping):
        return dict(zip(params.keys(), layout.split(vec), strict=True))
    with torch.no_grad():
        for p, view in zip(
            plist, layout.split(vec.to(device=layout.device, dtype=layout.dtype)), strict=True
        ):
            p.copy_(view)
    return None


# NOTE [each slot once]
# torch.func.functional_call(..., tie_weights=True) substitutes a value under every name of
# the tensor it replaces. A module object registered twice (nn.Sequential(blk, blk),
# nn.ModuleList([blk] * 2)) gives one attribute slot two names, so torch swaps that slot
# twice: the second swap records the first's substitute as the "original", and the restore
# leaves the substitute (a plain tensor, or a tracer's proxy) in the model. Here every slot is
# named once (named_modules() lists each module object once) and receives the value of any
# name it was given under; genuinely tied weights (one tensor in two slots, GPT-2's
# lm_head.weight and transformer.wte.weight) still get the value in both slots. The call
# then runs with tie_weights=False: the mapping is already complete.
def slot_values(module: nn.Module, values: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``values`` (qualified name of a parameter or buffer -> substitute) re-keyed so that each
    attribute slot holding one of those tensors appears once; see NOTE [each slot once]."""
    by_name: dict[str, torch.Tensor] = dict(module.named_parameters(remove_duplicate=False))
    by_name.update(module.named_buffers(remove_duplicate=False))
    slots: dict[int, list[str]] = {}
    for prefix, m in module.named_modules():
        for attr, t in [*m._parameters.items(), *m._buffers.items()]:
            if t is not None:
                slots.setdefault(id(t), []).append(f"{prefix}.{attr}" if prefix else attr)
    out: dict[str, torch.Tensor] = {}
    for name, value in values.items():
        current = by_name.get(name)
        for slot in [name] if current is None else slots[id(current)]:
            if out.setdefault(slot, value) is not value:
                raise ValueError(f"two values were given for {slot!r} (under two of its names)")
    return out


def call_with_values(
    module: nn.Module, values: Mapping[str, torch.Tensor], args: tuple[Any, ...]
) -> Any:
    """``module(*args)`` with the named parameters and buffers replaced by ``values`` (any of a
    tensor's names will do) for the call only; the module is left as it was."""
    return torch.func.functional_call(module, slot_values(module, values), args, tie_weights=False)
