"""Ritz-check schedules of ``lanczos`` side by side: products and eigensolves.

    python -m benchmarks.check_schedule          # CPU, about a minute

Runs ``lanczos`` on dense float64 operators with known spectra (separated,
power-law, clustered, exponential, indefinite) at n = 40 and 300, for
which = LM/LA/SA, k = 3/6/10 and tol = 1e-4/1e-6/1e-8 (270 runs), once per
rule for the gap between two Ritz checks (``every``: each step; ``half``:
half the geometric prediction; ``cap4``/``cap8``: that, at most a quarter /
an eighth of the products so far, the rule of ``algorithms._common.check_gap``
being ``cap4``). Skipping a check never changes the iterates, so a rule can
only stop later than ``every``: reported are the runs that did and by how
many products in all, and the eigensolves of ``T`` (checks plus restarts).
See NOTE [ritz check schedule] in ``hessian_eigenthings/algorithms/lanczos.py``.
"""

from __future__ import annotations

import importlib
import json
import math
import warnings
from collections.abc import Callable, Iterator

import numpy as np
import torch

from hessian_eigenthings import LambdaOperator, algorithms

_lanczos_module = importlib.import_module("hessian_eigenthings.algorithms.lanczos")

Rule = Callable[[float, int, "tuple[int, float] | None", int], int]


def _half(ratio: float, products: int, last: tuple[int, float] | None, b: int = 1) -> int:
    if last is None or not (ratio > 1.0) or not math.isfinite(ratio):
        return b
    p_prev, r_prev = last
    if not (r_prev > ratio) or products <= p_prev:
        return b
    rate = math.log(r_prev / ratio) / (products - p_prev)
    return max(b, b * int(0.5 * math.log(ratio) / rate / b))


def _capped(frac: float) -> Rule:
    def rule(ratio: float, products: int, last: tuple[int, float] | None, b: int = 1) -> int:
        return max(b, min(_half(ratio, products, last, b), b * int(products * frac / b)))

    return rule


RULES: dict[str, Rule] = {
    "every": lambda ratio, products, last, b=1: b,
    "half": _half,
    "cap4": _capped(0.25),
    "cap8": _capped(0.125),
}


def _spectra(n: int) -> Iterator[tuple[str, torch.Tensor]]:
    f64 = torch.float64
    yield (
        "separated",
        torch.cat(
            [
                torch.tensor([10.0, 8.0, 6.5, -5.0], dtype=f64),
                torch.linspace(-1, 1, n - 4, dtype=f64),
            ]
        ),
    )
    yield "powerlaw", torch.arange(1, n + 1, dtype=f64) ** -1.5
    yield (
        "clustered",
        torch.cat([10 + 1e-3 * torch.arange(5, dtype=f64), torch.linspace(0, 5, n - 5, dtype=f64)]),
    )
    yield "exponential", torch.exp(-0.1 * torch.arange(n, dtype=f64))
    yield "indefinite", torch.linspace(-3, 4, n, dtype=f64) ** 3


def _operator(d: torch.Tensor) -> LambdaOperator:
    n = d.numel()
    gen = torch.Generator().manual_seed(0)
    q, _ = torch.linalg.qr(torch.randn(n, n, dtype=torch.float64, generator=gen))
    a = (q * d) @ q.T
    return LambdaOperator(lambda v: a @ v, size=n, dtype=torch.float64)


def main() -> None:
    warnings.simplefilter("ignore", algorithms.ConvergenceWarning)
    stats = {
        name: {"late_runs": 0, "extra_products": 0, "eigensolves": 0, "runs": 0} for name in RULES
    }
    eigh = np.linalg.eigh
    saved = _lanczos_module.check_gap
    try:
        for n in (40, 300):
            for _, d in _spectra(n):
                op = _operator(d)
                for which in ("LM", "LA", "SA"):
                    for k in (3, 6, 10):
                        for tol in (1e-4, 1e-6, 1e-8):
                            base = None
                            for name, rule in RULES.items():
                                calls = [0]

                                def counted(a: np.ndarray, calls: list[int] = calls) -> object:
                                    calls[0] += 1
                                    return eigh(a)

                                _lanczos_module.check_gap = rule
                                np.linalg.eigh = counted
                                try:
                                    res = algorithms.lanczos(
                                        op, k=k, which=which, tol=tol, seed=0, max_iter=3000
                                    )
                                finally:
                                    np.linalg.eigh = eigh
                                s = stats[name]
                                s["runs"] += 1
                                s["eigensolves"] += calls[0]
                                if base is None:
                                    base = res.iterations
                                elif res.iterations > base:
                                    s["late_runs"] += 1
                                    s["extra_products"] += res.iterations - base
    finally:
        _lanczos_module.check_gap = saved
    print(json.dumps(stats, indent=1))


if __name__ == "__main__":
    main()
