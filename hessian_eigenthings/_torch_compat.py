"""Every torch / triton version check of the package lives here, nowhere else.

Versions are compared with :mod:`packaging.version` only.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
from collections.abc import Iterator

import torch
from packaging.version import Version

TORCH_VERSION = Version(torch.__version__.split("+")[0])

#: Oldest torch this package supports (see pyproject.toml).
MIN_TORCH = Version("2.4")


@functools.lru_cache(maxsize=1)
def triton_version() -> Version | None:
    """Installed triton version, or ``None`` when triton does not import."""
    if importlib.util.find_spec("triton") is None:
        return None
    try:
        import triton
    except Exception:  # a broken triton install must not break the package
        return None
    return Version(triton.__version__.split("+")[0])


def has_triton() -> bool:
    return triton_version() is not None


@functools.lru_cache(maxsize=1)
def compile_supported() -> bool:
    """Whether ``torch.compile`` can run here (dynamo lags new Python releases)."""
    try:
        from torch._dynamo.eval_frame import is_dynamo_supported
    except Exception:
        return False
    return bool(is_dynamo_supported())


@contextlib.contextmanager
def math_sdpa() -> Iterator[None]:
    """Force the math backend of ``scaled_dot_product_attention``.

    The flash and memory-efficient SDPA kernels have no double backward; the
    math backend does. Used for the duration of a second-order product.
    """
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel([SDPBackend.MATH]):
        yield


def foreach_add_(dst: list[torch.Tensor], src: list[torch.Tensor], alpha: float = 1.0) -> None:
    """``dst[i] += alpha * src[i]`` with one grouped launch where torch allows it."""
    if not dst:
        return
    if dst[0].device.type == "meta":
        return
    torch._foreach_add_(dst, src, alpha=alpha)


def foreach_copy_(dst: list[torch.Tensor], src: list[torch.Tensor]) -> None:
    """``dst[i].copy_(src[i])`` with grouped launches (``_foreach_copy_`` exists from 2.2)."""
    if not dst:
        return
    torch._foreach_copy_(dst, src)
