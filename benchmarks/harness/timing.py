"""Timer (CUDA events on GPU, wall clock on CPU) with peak memory, and run metadata."""

from __future__ import annotations

import platform
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class Sample:
    ms: float
    peak_mib: float  # max allocated during the call minus allocated before (CUDA); nan on CPU
    out: Any = None


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], Any], device: torch.device, keep: bool = False) -> Sample:
    """One call of ``fn``; on CUDA: synchronize, CUDA events around the call, peak over the call."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        out = fn()
        end.record()
        torch.cuda.synchronize(device)
        peak = (torch.cuda.max_memory_allocated(device) - base) / 2**20
        return Sample(start.elapsed_time(end), peak, out if keep else None)
    t0 = time.perf_counter()
    out = fn()
    return Sample((time.perf_counter() - t0) * 1e3, float("nan"), out if keep else None)


def env_info(device: torch.device) -> dict[str, str]:
    info = {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "device": str(device),
        "threads": str(torch.get_num_threads()),
    }
    try:
        import triton  # type: ignore[import-not-found, unused-ignore]

        info["triton"] = str(triton.__version__)
    except Exception:
        info["triton"] = "not installed"
    try:
        import transformers

        info["transformers"] = str(transformers.__version__)
    except Exception:
        info["transformers"] = "not installed"
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
        info["cuda"] = str(torch.version.cuda)
    else:
        info["cpu"] = platform.processor() or platform.machine()
    return info
