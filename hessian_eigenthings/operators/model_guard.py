"""The model guard: every product leaves the model exactly as it found it.

Parameters bit-identical with their version counters, ``.grad`` untouched,
train/eval flags and ``requires_grad`` as they were, buffers of training
modules (BatchNorm statistics) never written, the global precision switches
restored — also when the user's loss raises half-way. And a model that draws
random numbers in its forward (dropout in training mode) is said once.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator, Sequence

import torch
from torch import nn

from hessian_eigenthings import _torch_compat
from hessian_eigenthings._warnings import user_stacklevel
from hessian_eigenthings.operators.precision import Precision, product_precision


class RandomForwardWarning(UserWarning):
    """The model draws random numbers in its forward (dropout in training mode)."""


_RANDOM_MODULES = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout, nn.FeatureAlphaDropout)


def draws_randomly(m: nn.Module) -> bool:
    return m.training and isinstance(m, _RANDOM_MODULES) and getattr(m, "p", 0.0) > 0


@contextlib.contextmanager
def preserve_model(
    model: nn.Module,
    params: Sequence[nn.Parameter],
    *,
    double_backward: bool = False,
    modules: Sequence[nn.Module] | None = None,
) -> Iterator[None]:
    """Run a product and leave ``model`` exactly as it was.

    Enables ``requires_grad`` on selected frozen parameters for the duration
    and restores it, and the train/eval flags, in ``finally``; forces math
    SDPA when a double backward is needed. Buffers are protected per forward
    by :func:`private_buffers`.
    """
    frozen = [p for p in params if not p.requires_grad]
    mods = list(modules) if modules is not None else list(model.modules())
    modes = [m.training for m in mods]
    try:
        for p in frozen:
            p.requires_grad_(True)
        ctx = _torch_compat.math_sdpa() if double_backward else contextlib.nullcontext()
        with ctx:
            yield
    finally:
        for p in frozen:
            p.requires_grad_(False)
        for m, mode in zip(mods, modes, strict=True):
            if m.training != mode:
                m.training = mode


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
        self._random_said = False

    @contextlib.contextmanager
    def product(self, precision: Precision, *, double_backward: bool) -> Iterator[None]:
        """One pass of products: the precision switches and the model restored afterwards."""
        with product_precision(precision), preserve_model(
            self.model, self.params, double_backward=double_backward, modules=self.modules
        ):
            yield

    def private_buffers(self) -> contextlib.AbstractContextManager[None]:
        """One forward with private copies of the training modules' buffers."""
        return private_buffers(self.model, self.modules)

    def random_modules(self) -> list[str]:
        return [name or type(m).__name__ for name, m in self.model.named_modules() if draws_randomly(m)]

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
        if self._random_said:
            return
        self._random_said = True
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
