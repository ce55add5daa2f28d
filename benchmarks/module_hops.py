"""How many times one steady-state product changes module, and which files it enters.

`sys.setprofile` over the fourth `op @ v` of a 3-layer MLP (CPU, float64): every Python call
into `hessian_eigenthings` whose module differs from the previous such call counts as one
change. Prints one JSON line per engine. `python -m benchmarks.module_hops`
"""

from __future__ import annotations

import itertools
import json
import sys
import warnings
from types import FrameType
from typing import Any

import torch
from torch import nn


def hops(op: Any, v: torch.Tensor) -> tuple[int, list[str], int]:
    for _ in range(3):
        op @ v
    trail: list[str] = []

    def prof(frame: FrameType, event: str, arg: Any) -> None:
        if event != "call":
            return
        name = frame.f_globals.get("__name__", "")
        if name.startswith("hessian_eigenthings"):
            trail.append(name)

    sys.setprofile(prof)
    try:
        op @ v
    finally:
        sys.setprofile(None)
    changes = sum(1 for a, b in itertools.pairwise(trail) if a != b)
    files = sorted(set(trail))
    return changes, files, len(trail)


def measure(engine: str) -> dict[str, Any]:
    """The module changes, calls and modules of one steady product on ``engine``."""
    import hessian_eigenthings as he

    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3)
    ).double()
    data = [(torch.randn(32, 8, dtype=torch.float64), torch.randint(0, 3, (32,)))]
    loss = he.supervised_loss(nn.CrossEntropyLoss())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        op = he.HessianOperator(model, data, loss, engine=engine)
        v = torch.randn(op.size, dtype=torch.float64)
        changes, files, calls = hops(op, v)
    operators_files = [f for f in files if f.startswith("hessian_eigenthings.operators")]
    return {
        "engine": engine,
        "module_changes": changes,
        "calls": calls,
        "operators_modules": operators_files,
        "modules": files,
    }


def main() -> None:
    for engine in ("auto", "autograd", "functional", "compiled"):
        print(json.dumps(measure(engine)), flush=True)


if __name__ == "__main__":
    main()
