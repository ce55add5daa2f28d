"""The model guard: every product leaves the model exactly as it found it.

Parameters bit-identical with their version counters, ``.grad`` untouched,
train/eval flags and ``requires_grad`` as they were, buffers of training
modules (BatchNorm statistics) never written, the global precision switches
restored (NOTE [product precision]) — also when the user's loss raises half-way.
A half model's products run on float32 copies of its tensors, swapped in for the pass and
taken out after (:class:`Upcast`, NOTE [half models] in ``precision``). And a model that draws random numbers in its forward (dropout in training mode) is
said once.

Cost per pass of products: a few attribute reads and writes on the host, no device work.
"""

from __future__ import annotations

import contextlib
import itertools
import warnings
from collections.abc import Iterable, Iterator, Sequence
from types import TracebackType
from typing import Any, Literal

import torch
from torch import nn

from hessian_eigenthings import _torch_compat
from hessian_eigenthings._warnings import user_stacklevel

# NOTE [product precision]
# PyTorch lets matrix products (``torch.backends.cuda.matmul.allow_tf32``,
# ``torch.set_float32_matmul_precision``) and cuDNN convolutions
# (``torch.backends.cudnn.allow_tf32``, on by default) round float32 inputs to
# TF32's 10-bit mantissa. Measured on an H100: a ResNet-18 Hessian product
# 2.4% wrong (relative norm) under PyTorch's default cuDNN setting, an MLP
# 1.9% with TF32 matmuls, GPT-2 1e-3 — silently. So every product switches
# both to full float32 for its duration and puts back exactly what it found,
# also when the product raises; ``precision="tf32"`` opts in to the faster
# mode (1.6-2.1x on those workloads); ``precision="model"`` (a half model's
# products in its own dtype, NOTE [half models] in ``precision``) sets them as
# ``"fp32"`` does. Setting the flags is a few attribute
# writes on the host per product, no device work.

Precision = Literal["fp32", "tf32"]
PRECISIONS: tuple[str, ...] = ("fp32", "tf32")
#: a data operator's ``precision=``: the switches of ``"fp32"`` and ``"tf32"``, and ``"model"``
#: (products in a half model's own dtype, NOTE [half models] in ``precision``; switches as "fp32")
ProductPrecision = Literal["fp32", "tf32", "model"]


def check_precision(precision: object) -> Precision:
    if precision not in PRECISIONS:
        raise ValueError(
            f"precision must be 'fp32' (full float32 products, the default) or 'tf32' (TensorFloat-32 "
            f"matrix products and convolutions: faster, ~1e-3 to 2e-2 relative error), got {precision!r}"
        )
    return precision  # type: ignore[return-value]


def switch_precision(precision: ProductPrecision) -> tuple[str | None, bool]:
    """Set the switches for ``precision`` (NOTE [product precision]); returns what
    :func:`restore_precision` puts back: the matmul precision if it was changed, and cuDNN's flag."""
    tf32 = precision == "tf32"
    matmul = torch.get_float32_matmul_precision()
    cudnn = bool(torch.backends.cudnn.allow_tf32)
    want_matmul = "high" if tf32 else "highest"
    changed = matmul != want_matmul  # "medium" (bfloat16 passes) is below either mode
    if changed:
        torch.set_float32_matmul_precision(want_matmul)
    if cudnn != tf32:
        torch.backends.cudnn.allow_tf32 = tf32
    return (matmul if changed else None), cudnn


def restore_precision(saved: tuple[str | None, bool]) -> None:
    matmul, cudnn = saved
    if matmul is not None:
        torch.set_float32_matmul_precision(matmul)
    if torch.backends.cudnn.allow_tf32 != cudnn:
        torch.backends.cudnn.allow_tf32 = cudnn


@contextlib.contextmanager
def product_precision(precision: ProductPrecision) -> Iterator[None]:
    """Run the body with TF32 off (``"fp32"``) or on (``"tf32"``), then restore the user's switches."""
    saved: tuple[str | None, bool] | None = None
    try:
        saved = switch_precision(precision)
        yield
    finally:
        if saved is not None:
            restore_precision(saved)


# The optimizer step counter of NOTE [updates that keep the version] (graph_reuse): part of the
# model's key below.
_optimizer_steps = 0
_hook_registered = False


def _count_step(optimizer: Any, args: Any, kwargs: Any) -> None:
    global _optimizer_steps
    _optimizer_steps += 1


def watch_optimizer_steps() -> None:
    """Register the step counter of NOTE [updates that keep the version] (once per process)."""
    global _hook_registered
    if not _hook_registered:
        from torch.optim.optimizer import register_optimizer_step_post_hook

        register_optimizer_step_post_hook(_count_step)
        _hook_registered = True


def model_tensors(modules: Iterable[nn.Module]) -> Iterator[torch.Tensor]:
    """Every parameter and buffer of ``modules`` (each module's own, in registration order):
    what a product reads besides the batch. During a pass of a half model, the user's tensors,
    not the float32 copies standing in for them (:class:`Upcast`)."""
    if _UPCAST_ORIGINALS:
        for m in modules:
            for t in itertools.chain(m._parameters.values(), m._buffers.values()):
                if t is not None:
                    yield _UPCAST_ORIGINALS.get(id(t), t)
        return
    for m in modules:
        for t in itertools.chain(m._parameters.values(), m._buffers.values()):
            if t is not None:
                yield t


def model_key(modules: Sequence[nn.Module]) -> tuple[Any, ...]:
    """The model's part of the reuse key (NOTE [reuse key] in graph_reuse): host integers only."""
    tensors = tuple((id(t), t._version) for t in model_tensors(modules))
    # the global switches a product's numbers depend on (NOTE [product precision])
    precision = (
        bool(torch.backends.cuda.matmul.allow_tf32),
        bool(torch.backends.cudnn.allow_tf32),
        torch.get_float32_matmul_precision(),
    )
    return tensors, tuple(m.training for m in modules), precision, _optimizer_steps


#: the copy's id -> the user's tensor, for the copies swapped in now (:class:`Upcast`): the reuse
#: key and the kept states' watch read the user's tensors during a pass
_UPCAST_ORIGINALS: dict[int, torch.Tensor] = {}

#: the half dtypes whose models compute in float32 by default (NOTE [half models] in ``precision``)
HALF_DTYPES = (torch.float16, torch.bfloat16)


class Upcast:
    """Float32 copies of a half model's tensors, standing in for them during a pass of products
    (NOTE [half models] in ``precision``).

    :meth:`enter` puts, in every module of ``modules``, a copy in ``dtype`` in the slot of each
    parameter and floating buffer of a half dtype (a parameter's copy is an ``nn.Parameter``
    requiring grad as the user's does; a tensor held by two modules gets one copy, so ties stay
    ties); :meth:`exit` puts the user's tensors back. The user's tensors are never written, and
    no reference to a copy is left in the model. The copies are kept between passes while the
    user's tensor is the same object at the same version (a kept graph or a traced state made
    from a copy stays the graph of that copy) and dropped by :meth:`clear`: ``nbytes`` of the
    device's memory, on top of the model.
    """

    def __init__(
        self,
        modules: Sequence[nn.Module],
        selected: Sequence[torch.Tensor],
        dtype: torch.dtype = torch.float32,
    ) -> None:
        self.modules = modules
        self.selected = list(selected)
        self.dtype = dtype
        #: id of the user's tensor -> (that tensor, its version when copied, the copy)
        self._copies: dict[int, tuple[torch.Tensor, int, torch.Tensor]] = {}
        self._swapped: list[tuple[dict[str, Any], str, torch.Tensor]] = []
        #: the copies of the selected parameters, in their order (set by :meth:`enter`)
        self.params: list[torch.Tensor] = []

    @property
    def nbytes(self) -> int:
        """Bytes the copies hold."""
        return sum(c.numel() * c.element_size() for _, _, c in self._copies.values())

    def clear(self) -> None:
        self._copies = {}
        self.params = []

    def _copy(self, t: torch.Tensor, parameter: bool) -> torch.Tensor:
        entry = self._copies.get(id(t))
        if entry is not None and entry[0] is t and entry[1] == t._version:
            copy = entry[2]
        else:
            with torch.no_grad():
                data = t.detach().to(self.dtype)
            copy = nn.Parameter(data, requires_grad=False) if parameter else data
            self._copies[id(t)] = (t, t._version, copy)
        if parameter and copy.requires_grad != t.requires_grad:
            copy.requires_grad_(t.requires_grad)
        return copy

    def enter(self) -> None:
        """Swap the copies in (NOTE [half models])."""
        seen: dict[int, tuple[torch.Tensor, int, torch.Tensor]] = {}
        try:
            for m in self.modules:
                pairs: tuple[tuple[dict[str, Any], bool], ...] = (
                    (m._parameters, True),
                    (m._buffers, False),
                )
                for slots, parameter in pairs:
                    for name, t in list(slots.items()):
                        if t is None or t.dtype not in HALF_DTYPES:
                            continue
                        copy = self._copy(t, parameter)
                        seen[id(t)] = self._copies[id(t)]
                        slots[name] = copy
                        self._swapped.append((slots, name, t))
                        _UPCAST_ORIGINALS[id(copy)] = t
            self.params = [seen[id(p)][2] for p in self.selected]
        except BaseException:
            self.exit()
            raise
        self._copies = seen  # copies of tensors the model no longer holds are let go

    def exit(self) -> None:
        """Put the user's tensors back in their slots."""
        swapped, self._swapped = self._swapped, []
        for slots, name, t in reversed(swapped):
            _UPCAST_ORIGINALS.pop(id(slots[name]), None)
            slots[name] = t


# NOTE [padding rows]
# `nn.Embedding(padding_idx=i)` reads row `i` in its forward, but its backward
# gives that row no gradient through the lookup: training treats the padding
# lookup as a constant. Reverse mode (gradients, `Jᵀu`, double backward)
# follows that; forward mode (`jvp`, `J v`) does not, it carries the row's
# tangent into every padding position. The same row may also be read
# elsewhere — a tied output head (HF `tie_word_embeddings` with a
# `pad_token_id`, a GPT-2-style head given a padding index) — and there it
# has a gradient like any weight. The curvature is that of the loss as torch
# differentiates it: only the padding *lookup* contributes nothing. So, for
# the duration of every pass of products, each padding embedding gets a
# forward hook that makes its output at padding positions a constant
# (`where(ids == i, out.detach(), out)`: the same values, no derivative).
# Every engine then computes the same symmetric matrix — reverse and forward
# mode, kept graphs, traced and compiled products, the layer walk, sharded
# forwards — and the head's use of the row keeps its curvature. Finite
# differences move the parameters themselves, so there the hook reads the
# padding row as it was before the step (`PaddingLookups.frozen`). Cost:
# one elementwise select per padding embedding per forward; a model without
# padding embeddings pays nothing. `EmbeddingBag(padding_idx=...)` leaves the
# padding row out of its forward already: nothing to do.


def padding_embeddings(modules: Iterable[nn.Module]) -> list[nn.Embedding]:
    """The ``nn.Embedding`` modules with a padding row (NOTE [padding rows])."""
    return [m for m in modules if isinstance(m, nn.Embedding) and m.padding_idx is not None]


class _ConstantPaddingLookup:
    """The forward hook of one padding embedding (NOTE [padding rows]); one object per module
    for an operator's life, so that a compiled product sees the same hook on every pass."""

    def __init__(self, module: nn.Embedding) -> None:
        self.module = module
        #: the padding row to read at padding positions instead of the forward's (finite
        #: differences); ``None``: the forward's own, detached
        self.frozen: torch.Tensor | None = None

    def __call__(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any
    ) -> Any:
        ids = args[0] if args else kwargs.get("input")
        if not isinstance(ids, torch.Tensor) or not isinstance(out, torch.Tensor):
            return None
        pad = torch.eq(ids, self.module.padding_idx or 0).unsqueeze(-1)
        constant = out.detach() if self.frozen is None else self.frozen.to(out.dtype)
        return torch.where(pad, constant, out)


class PaddingLookups:
    """The padding lookups of a model made constants for a pass (NOTE [padding rows])."""

    def __init__(self, modules: Iterable[nn.Module]) -> None:
        self.hooks = [_ConstantPaddingLookup(m) for m in padding_embeddings(modules)]

    def __bool__(self) -> bool:
        return bool(self.hooks)

    def attach(self) -> list[Any]:
        return [h.module.register_forward_hook(h, with_kwargs=True) for h in self.hooks]

    def rows(self) -> dict[nn.Module, torch.Tensor]:
        """Each embedding's padding row as it is now (a detached view)."""
        return {h.module: h.module.weight.detach()[h.module.padding_idx] for h in self.hooks}

    @contextlib.contextmanager
    def frozen(self, rows: dict[nn.Module, torch.Tensor] | None = None) -> Iterator[None]:
        """Inside: each embedding in ``rows`` (default: :meth:`rows`, taken on entry) reads the
        given padding row at its padding positions, whatever its weight holds then."""
        rows = self.rows() if rows is None else rows
        try:
            for h in self.hooks:
                h.frozen = rows.get(h.module)
            yield
        finally:
            for h in self.hooks:
                h.frozen = None


class RandomForwardWarning(UserWarning):
    """The model draws random numbers in its forward (dropout in training mode)."""


_RANDOM_MODULES = (
    nn.Dropout,
    nn.Dropout1d,
    nn.Dropout2d,
    nn.Dropout3d,
    nn.AlphaDropout,
    nn.FeatureAlphaDropout,
)


def draws_randomly(m: nn.Module) -> bool:
    return m.training and isinstance(m, _RANDOM_MODULES) and getattr(m, "p", 0.0) > 0


def preserve_model(
    model: nn.Module,
    params: Sequence[nn.Parameter],
    *,
    double_backward: bool = False,
    modules: Sequence[nn.Module] | None = None,
) -> _ProductScope:
    """Run a product and leave ``model`` exactly as it was.

    Enables ``requires_grad`` on selected frozen parameters for the duration
    and restores it, and the train/eval flags, on the way out (also when the
    body raises); forces math SDPA when a double backward is needed. Buffers
    are protected per forward by :func:`private_buffers`.
    """
    mods = list(modules) if modules is not None else list(model.modules())
    return _ProductScope(params, mods, None, double_backward, padding=PaddingLookups(mods))


@contextlib.contextmanager
def private_buffers(model: nn.Module, modules: Sequence[nn.Module] | None = None) -> Iterator[None]:
    """Give one forward its own copies of the buffers of training modules.

    A module in training mode may update its buffers in place (BatchNorm
    running statistics). Swapping in fresh copies and putting the original
    tensor objects back leaves the user's buffers bit-identical with their
    version counters untouched, so graphs that saved them stay valid.
    """
    swapped: list[tuple[nn.Module, str, torch.Tensor]] = []
    try:
        for m in modules if modules is not None else model.modules():
            if not m.training:
                continue
            for name, b in list(m._buffers.items()):
                if b is not None:
                    swapped.append((m, name, b))
                    m._buffers[name] = b.detach().clone()
        yield
    finally:
        for m, name, b in swapped:
            m._buffers[name] = b


class ModelGuard:
    """What an operator does around its products to leave ``model`` as found."""

    def __init__(self, model: nn.Module, params: Sequence[nn.Parameter]) -> None:
        self.model = model
        self.params = params
        # walked on every product (modes, buffers): listed once
        self.modules: list[nn.Module] = list(model.modules())
        self.random_said = False
        #: padding lookups made constants during products (NOTE [padding rows])
        self.padding = PaddingLookups(self.modules)
        #: the float32 copies a half model's products run on (NOTE [half models] in
        #: ``precision``); ``None``: products run on the model's own tensors
        self.upcast: Upcast | None = None

    def product(
        self, precision: ProductPrecision, *, double_backward: bool, key: bool = False
    ) -> _ProductScope:
        """One pass of products: the precision switches and the model restored afterwards
        (``preserve_model`` and ``product_precision`` as one scope: one call in, one out). With
        ``key``, entering it gives the model's reuse key (:func:`model_key`) under the pass's
        switches, read once for the pass's kept-state checks; else ``None``."""
        return _ProductScope(
            self.params, self.modules, precision, double_backward, key, self.padding, self.upcast
        )

    def private_buffers(self) -> contextlib.AbstractContextManager[None]:
        """One forward with private copies of the training modules' buffers."""
        return private_buffers(self.model, self.modules)

    def random_modules(self) -> list[str]:
        return [
            name or type(m).__name__ for name, m in self.model.named_modules() if draws_randomly(m)
        ]

    def random_cause(self) -> str | None:
        """Why products may disagree with each other, if the forward draws random masks."""
        random = self.random_modules()
        if not random:
            return None
        more = ", ..." if len(random) > 3 else ""
        return f"modules in training mode draw random masks on every forward ({', '.join(random[:3])}{more}): call model.eval()"

    def warn_random_forward(self, owner: str) -> None:
        """Once: a forward that draws random masks makes the operator a different matrix on every
        product (or, with a kept state, one arbitrary draw)."""
        if self.random_said:
            return
        self.random_said = True
        random = self.random_modules()
        if random:
            warnings.warn(
                f"{owner}: dropout in training mode ({', '.join(random[:3])}"
                f"{', ...' if len(random) > 3 else ''}) draws a new random mask on every forward, so the "
                "curvature is of one random draw (kept between products) or changes between products; call "
                "model.eval() for the curvature of the deterministic model",
                RandomForwardWarning,
                stacklevel=user_stacklevel(),
            )


class _ProductScope:
    """What a pass of products does around itself: :func:`preserve_model` (``params``, the selected
    parameters; ``modules``, the model's), and with a ``precision`` the product's precision
    switches (:func:`product_precision`). One object: the hot path enters and leaves this module
    once per pass."""

    def __init__(
        self,
        params: Sequence[nn.Parameter],
        modules: Sequence[nn.Module],
        precision: ProductPrecision | None,
        double_backward: bool,
        key: bool = False,
        padding: PaddingLookups | None = None,
        upcast: Upcast | None = None,
    ) -> None:
        self.params = params
        self.modules = modules
        self.precision = precision
        self.key = key
        self.padding = padding
        self.upcast = upcast
        self.entered_upcast = False
        self.handles: list[Any] = []
        self.sdpa = _torch_compat.math_sdpa() if double_backward else None
        self.saved: tuple[str | None, bool] | None = None

    def __enter__(self) -> tuple[Any, ...] | None:
        self.frozen = [p for p in self.params if not p.requires_grad]
        self.modes = [m.training for m in self.modules]
        if self.precision is not None:
            self.saved = switch_precision(self.precision)
        for p in self.frozen:
            p.requires_grad_(True)
        # read before the SDPA switch, whose context calls out of this module
        key = model_key(self.modules) if self.key else None
        try:
            if self.upcast is not None:  # after the key: it reads the user's tensors
                self.entered_upcast = True
                self.upcast.enter()
            if self.padding:
                self.handles = self.padding.attach()
            if self.sdpa is not None:
                self.sdpa.__enter__()
        except BaseException:
            self.sdpa = None
            self.__exit__(None, None, None)
            raise
        return key

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        # the switches are independent: the SDPA one goes back last, so that leaving this scope
        # calls out of this module once
        try:
            for h in self.handles:
                h.remove()
            self.handles = []
            if self.entered_upcast and self.upcast is not None:
                self.entered_upcast = False
                self.upcast.exit()
            for p in self.frozen:
                p.requires_grad_(False)
            for m, mode in zip(self.modules, self.modes, strict=True):
                if m.training != mode:
                    m.training = mode
            if self.saved is not None:
                restore_precision(self.saved)
        finally:
            if self.sdpa is not None:
                self.sdpa.__exit__(kind, exc, tb)
