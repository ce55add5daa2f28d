"""Hutch++ with the previous call's sketch as a warm start, along training (issue 19).

    python -m benchmarks.bench_trace_warm [--budget 30] [--seeds 200] [--steps 40] [--every 5]

Trains a small tanh MLP (float64, CPU) with SGD on a fixed batch and, every ``--every`` steps,
takes its dense Hessian ``H`` on a probe batch. At each tracked step, for ``--seeds`` chains
(each chain one fixed seed, as CurvatureTracker calls it): a cold ``hutch_plus_plus`` and a
warm one (``sketch=`` the same chain's previous result). Reports per step the RMS error against
``tr(H)`` over the chains, and the noise-free part of the variance, ``||P H P||_F²`` with
``P = I − QQᵀ`` (Hutchinson's variance on the deflated rest is ``2||PHP||_F² / g``, Gaussian
probes), for the sketches of chain 0. Then the cold budget that matches the warm error.
"""

from __future__ import annotations

import argparse

import numpy as np
import torch
from torch import nn
from torch.func import functional_call

from hessian_eigenthings.algorithms import hutch_plus_plus
from hessian_eigenthings.operators import LambdaOperator


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 24), nn.Tanh(), nn.Linear(24, 4)).double()


def _dense_hessian(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    names = [n for n, _ in model.named_parameters()]
    shapes = [p.shape for p in model.parameters()]
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    ce = nn.CrossEntropyLoss()

    def f(v: torch.Tensor) -> torch.Tensor:
        parts = torch.split(v, [s.numel() for s in shapes])
        state = {n: t.reshape(s) for n, t, s in zip(names, parts, shapes, strict=True)}
        return ce(functional_call(model, state, (x,)), y)

    return torch.autograd.functional.hessian(f, flat)


def _op(h: torch.Tensor) -> LambdaOperator:
    return LambdaOperator(lambda v: h @ v, h.shape[0], dtype=h.dtype, matmat_fn=lambda r: r @ h)


def _remainder(h: torch.Tensor, q: torch.Tensor) -> float:
    p = torch.eye(h.shape[0], dtype=h.dtype) - q.T @ q
    return float((p @ h @ p).square().sum())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--budget", type=int, default=30)
    ap.add_argument("--seeds", type=int, default=200)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--every", type=int, default=5)
    ap.add_argument("--lr", type=float, default=0.05)
    a = ap.parse_args()
    g = torch.Generator().manual_seed(1)
    x = torch.randn(128, 8, dtype=torch.float64, generator=g)
    y = torch.randint(0, 4, (128,), generator=g)
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=a.lr)
    ce = nn.CrossEntropyLoss()
    prev: list[object] = [None] * a.seeds
    warm_err, cold_err, hs = [], [], []
    print(f"n = {sum(p.numel() for p in model.parameters())}, budget {a.budget}, {a.seeds} chains")
    print("step  tr(H)     rms cold  rms warm  ||PHP||_F² cold  warm")
    for step in range(a.steps + 1):
        if step % a.every == 0:
            h = _dense_hessian(model, x, y)
            hs.append(h)
            truth = float(torch.trace(h))
            cold, warm = [], []
            for s in range(a.seeds):
                c = hutch_plus_plus(_op(h), num_matvecs=a.budget, seed=s, keep_sketch=True)
                w = hutch_plus_plus(
                    _op(h), num_matvecs=a.budget, seed=s, keep_sketch=True, sketch=prev[s] or None
                )  # type: ignore[arg-type]
                prev[s] = w
                cold.append(c.estimate - truth)
                warm.append(w.estimate - truth)
                if s == 0:
                    rc, rw = _remainder(h, c.sketch), _remainder(h, w.sketch)  # type: ignore[arg-type]
            rms_c, rms_w = np.sqrt(np.mean(np.square(cold))), np.sqrt(np.mean(np.square(warm)))
            cold_err.append(rms_c)
            warm_err.append(rms_w)
            print(f"{step:4d}  {truth:8.4f}  {rms_c:.2e}  {rms_w:.2e}  {rc:.3e}        {rw:.3e}")
        opt.zero_grad()
        ce(model(x), y).backward()
        opt.step()
    target = float(np.mean(warm_err[1:]))
    print(
        f"mean rms error over warm calls (all but the first): warm {target:.2e}, "
        f"cold {float(np.mean(cold_err[1:])):.2e}"
    )
    for budget in (a.budget, int(1.5 * a.budget), 2 * a.budget, 3 * a.budget):
        errs = []
        for h in hs[1:]:
            truth = float(torch.trace(h))
            errs.append(
                np.sqrt(
                    np.mean(
                        [
                            (hutch_plus_plus(_op(h), num_matvecs=budget, seed=s).estimate - truth)
                            ** 2
                            for s in range(a.seeds)
                        ]
                    )
                )
            )
        print(f"cold budget {budget:4d}: mean rms error {float(np.mean(errs)):.2e}")


if __name__ == "__main__":
    main()
