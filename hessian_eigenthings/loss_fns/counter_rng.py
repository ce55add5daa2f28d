"""Counter-based random numbers: a pure function of (key, index), traceable and device-free.

``counter_uniform(key, shape)`` hashes ``key · φ + index`` with splitmix64 (Steele, Lea &
Flood 2014), in int64 tensor arithmetic (wrapping multiplication, masked shifts for the
logical ones), and maps the top 53 bits to ``(0, 1)``. The same key gives the same numbers on
every device and under every transform (eager, ``make_fx`` traces, inductor), with no
generator object and no global random state: see NOTE [sampled targets as data] in
``operators.ggn``.
"""

from __future__ import annotations

import math

import torch

__all__ = ["counter_normal", "counter_uniform"]

# the 64-bit constants as signed int64 (two's complement)
_GOLDEN = 0x9E3779B97F4A7C15 - 2**64
_MIX1 = 0xBF58476D1CE4E5B9 - 2**64
_MIX2 = 0x94D049BB133111EB - 2**64


def _shr(x: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 values (torch's ``>>`` is arithmetic)."""
    return (x >> s) & ((1 << (64 - s)) - 1)


def _splitmix64(x: torch.Tensor) -> torch.Tensor:
    z = x + _GOLDEN
    z = (z ^ _shr(z, 30)) * _MIX1
    z = (z ^ _shr(z, 27)) * _MIX2
    return z ^ _shr(z, 31)


def counter_uniform(
    key: torch.Tensor,
    shape: tuple[int, ...],
    *,
    stream: int = 0,
    dtype: torch.dtype = torch.float64,
) -> torch.Tensor:
    """Uniform numbers in ``(0, 1)`` of ``shape`` on ``key``'s device, a function of
    ``(key, stream, position)`` only. ``key``: a 0-d int64 tensor."""
    n = math.prod(shape)
    idx = torch.arange(n, device=key.device, dtype=torch.int64)
    x = _splitmix64(key * _GOLDEN + (idx * 2 + stream * 2 * n + 1))
    bits = _shr(_splitmix64(x), 11)  # 53 random bits
    u = (bits.to(torch.float64) + 0.5) * 2.0**-53
    return u.reshape(shape).to(dtype)


def counter_normal(
    key: torch.Tensor, shape: tuple[int, ...], *, dtype: torch.dtype = torch.float64
) -> torch.Tensor:
    """Standard normal numbers (Box-Muller on two counter streams)."""
    u1 = counter_uniform(key, shape, stream=0)
    u2 = counter_uniform(key, shape, stream=1)
    return (torch.sqrt(-2.0 * torch.log(u1)) * torch.cos(2.0 * math.pi * u2)).to(dtype)
