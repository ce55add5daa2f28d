"""Small fixed problems and counting tools shared by the parity guards of ``tests/perf``.

Everything here is deterministic: fixed seeds, fixed shapes, counters that do
not depend on the machine (products, passes over the data, forward and
backward passes, allocations).
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any
from unittest import mock

import torch
from torch import nn

from hessian_eigenthings.operators import LambdaOperator


def diagonal_spectrum(n: int = 200) -> torch.Tensor:
    """A fixed float64 spectrum with a few separated top eigenvalues (fast, predictable convergence)."""
    rest = torch.linspace(-1.0, 1.0, n - 4, dtype=torch.float64)
    return torch.cat([torch.tensor([10.0, 8.0, 6.5, -5.0], dtype=torch.float64), rest])


@dataclass
class CountingOperator:
    """A ``LambdaOperator`` over ``A = Q diag(d) Qᵀ`` that counts the calls the algorithms make.

    ``vector_calls``: calls of the single-vector function; ``block_calls`` and
    ``block_sizes``: calls of the block function and their widths. The
    operator's own ``num_matvecs`` counts products (a block of k counts k).
    """

    spectrum: torch.Tensor
    vector_calls: int = 0
    block_calls: int = 0
    block_sizes: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        n = self.spectrum.shape[0]
        g = torch.Generator().manual_seed(7)
        Q, _ = torch.linalg.qr(torch.randn(n, n, generator=g, dtype=torch.float64))
        self.A = (Q * self.spectrum) @ Q.T
        self.A = 0.5 * (self.A + self.A.T)
        self.op = LambdaOperator(self._vec, n, dtype=torch.float64, matmat_fn=self._block)

    def _vec(self, v: torch.Tensor) -> torch.Tensor:
        self.vector_calls += 1
        return self.A @ v

    def _block(self, V: torch.Tensor) -> torch.Tensor:  # rows (k, n)
        self.block_calls += 1
        self.block_sizes.append(V.shape[0])
        return V @ self.A

    @property
    def calls(self) -> int:
        """Operator invocations of either kind (what a pass over data would cost)."""
        return self.vector_calls + self.block_calls


def mlp(d_in: int = 20, hidden: int = 64, d_out: int = 10, *, seed: int = 0) -> nn.Module:
    """Float32 MLP whose largest parameter (hidden x hidden) is well below the total size."""
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(d_in, hidden), nn.Tanh(), nn.Linear(hidden, hidden), nn.Tanh(), nn.Linear(hidden, d_out)
    )


def batches(
    count: int, size: int = 32, d_in: int = 20, classes: int = 10, *, seed: int = 1
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(size, d_in, generator=g), torch.randint(0, classes, (size,), generator=g))
        for _ in range(count)
    ]


def num_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


@dataclass
class PassCounter:
    """Forward passes of a model (forward hook; forward-mode passes count too) and
    ``torch.autograd.grad`` calls (each is one backward pass through a graph)."""

    forwards: int = 0
    backwards: int = 0

    def reset(self) -> None:
        self.forwards = 0
        self.backwards = 0


@contextlib.contextmanager
def count_passes(model: nn.Module) -> Iterator[PassCounter]:
    counter = PassCounter()

    def hook(_module: nn.Module, _args: Any) -> None:
        counter.forwards += 1

    real_grad = torch.autograd.grad

    def grad(*args: Any, **kwargs: Any) -> Any:
        counter.backwards += 1
        return real_grad(*args, **kwargs)

    handle = model.register_forward_pre_hook(hook)
    try:
        with mock.patch("torch.autograd.grad", grad):
            yield counter
    finally:
        handle.remove()


# --------------------------------------------------------------------------
# Allocation counting
# --------------------------------------------------------------------------

#: size of the canary allocation made inside every profiled region (an odd number of bytes
#: no tensor of the tests has), proving the profiler recorded allocations at all
_CANARY_NUMEL = 12_345


def cpu_allocations(fn: Callable[[], Any]) -> list[int]:
    """Byte sizes of every CPU allocation made while ``fn()`` runs, in order.

    Uses ``torch.profiler`` with ``profile_memory=True``: each allocation of
    the CPU allocator is a ``[memory]`` event with a positive byte count (a
    free is negative). Kineto's raw events carry the per-allocation sizes;
    the aggregated ``FunctionEvent`` view folds them into their op. A canary
    tensor allocated inside the region must show up, so the count can never
    be vacuously zero.
    """
    from torch.profiler import ProfilerActivity, profile

    with warnings.catch_warnings():
        # Emitted once per process where CUDA is present (about a scheduling
        # option not used here); under filterwarnings=error it would fail the
        # first test that counts.
        warnings.filterwarnings("ignore", message=r".*Profiler clears events", category=UserWarning)
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True) as prof:
            canary = torch.empty(_CANARY_NUMEL, dtype=torch.int8)
            fn()
    del canary
    sizes = [
        int(e.nbytes())
        for e in prof.profiler.kineto_results.events()  # type: ignore[union-attr]
        if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU and e.nbytes() > 0
    ]
    assert _CANARY_NUMEL in sizes, "torch.profiler recorded no CPU allocations: the guard cannot see anything"
    sizes.remove(_CANARY_NUMEL)
    return sizes


def at_least(sizes: list[int], nbytes: int) -> list[int]:
    return [s for s in sizes if s >= nbytes]
