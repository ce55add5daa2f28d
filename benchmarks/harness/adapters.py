"""The column interface, and the plain-PyTorch 0.x-style baseline column.

An adapter is built once per workload (setup is not timed) and hands out
closures; the runner times the closures. Every method may raise
``NotImplementedError(reason)``: the cell then reads "n/a (reason)".

Products return a flat tensor (``(n,)``, or ``(n, k)`` for blocks);
algorithms return a dict with ``matvecs`` (products used) and results
(``values``/``converged`` for eigenpairs, ``estimate`` for the trace,
``eigenvalues`` range for SLQ).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch import nn

from benchmarks.workloads import ParityWorkload

Closure = Callable[[], Any]

#: column name -> "module:Class"; the module is imported only when the column runs
REGISTRY: dict[str, str] = {
    "core": "benchmarks.harness.adapters_core:CoreAdapter",
    "core-noreuse": "benchmarks.harness.adapters_core:CoreNoReuseAdapter",
    "core-autograd": "benchmarks.harness.adapters_core:CoreAutogradAdapter",
    "core-functional": "benchmarks.harness.adapters_core:CoreFunctionalAdapter",
    "core-compiled": "benchmarks.harness.adapters_core:CoreCompiledAdapter",
    "facade": "benchmarks.harness.adapters_core:FacadeAdapter",
    "baseline-0x": "benchmarks.harness.adapters:BaselineAdapter",
    "a5": "benchmarks.harness.adapters_peers:A5Adapter",
    "curvlinops": "benchmarks.harness.adapters_peers:CurvlinopsAdapter",
}
IN_PROCESS = ("core", "core-noreuse", "facade", "baseline-0x")
#: one column per product engine (``core`` is ``engine="auto"``); in-process, opt-in with --columns
ENGINE_COLUMNS = ("core-autograd", "core-functional", "core-compiled")
PEERS = ("a5", "curvlinops")
LABELS = {
    "core": "1.0 core (reuse)",
    "core-noreuse": "1.0 core (no reuse)",
    "core-autograd": "1.0 core, engine=autograd",
    "core-functional": "1.0 core, engine=functional",
    "core-compiled": "1.0 core, engine=compiled",
    "facade": "0.x facade",
    "baseline-0x": "0.x-style baseline",
    "a5": "1.0.0a5",
    "curvlinops": "curvlinops 3.0.1",
}


def load_adapter(column: str) -> type[Adapter]:
    mod, cls = REGISTRY[column].split(":")
    return getattr(importlib.import_module(mod), cls)  # type: ignore[no-any-return]


class Adapter:
    column = "?"

    def __init__(self, w: ParityWorkload, device: torch.device, options: dict[str, Any]) -> None:
        self.w = w
        self.device = device
        self.options = options
        self.params = [p for p in w.model.parameters() if p.requires_grad]
        self.n = sum(p.numel() for p in self.params)

    def version(self) -> str:
        return ""

    def held_mib(self) -> float:
        """Memory the column holds between Hessian products (kept graphs, CUDA-graph pools); nan if unknown."""
        return float("nan")

    def hvp(self, v: torch.Tensor) -> Closure:
        raise NotImplementedError("no Hessian product")

    def block(self, V: torch.Tensor) -> Closure:
        raise NotImplementedError("no block product")

    def ggn(self, v: torch.Tensor) -> Closure:
        raise NotImplementedError("no GGN")

    def fisher(self, v: torch.Tensor) -> Closure:
        raise NotImplementedError("no empirical Fisher")

    def top_eigs(self, k: int, tol: float) -> Closure:
        raise NotImplementedError("no eigensolver")

    def trace(self, num_matvecs: int) -> Closure:
        raise NotImplementedError("no trace estimator")

    def slq(self, runs: int, steps: int) -> Closure:
        raise NotImplementedError("no spectral density")


class OperatorAdapter(Adapter):
    """A column whose products are ``op(kind) @ x`` for kind ``"hessian"``, ``"ggn"``, ``"fisher"``."""

    def op(self, kind: str) -> Any:
        raise NotImplementedError(kind)

    def _product(self, kind: str, x: torch.Tensor) -> Closure:
        op = self.op(kind)  # built now, outside the timed calls
        return lambda: op @ x

    def hvp(self, v: torch.Tensor) -> Closure:
        return self._product("hessian", v)

    def block(self, V: torch.Tensor) -> Closure:
        return self._product("hessian", V)

    def ggn(self, v: torch.Tensor) -> Closure:
        return self._product("ggn", v)

    def fisher(self, v: torch.Tensor) -> Closure:
        return self._product("fisher", v)


def check_arpack_size(n: int, k: int) -> None:
    """Refuse scipy ``eigsh`` where it would crash the process.

    ARPACK keeps an (n, ncv) basis addressed with 32-bit BLAS offsets: past
    2^31 entries scipy segfaults (seen at 124 M parameters). The cell gets
    this error instead of the run dying.
    """
    ncv = max(2 * k + 1, 20)  # eigsh's default
    if n * ncv >= 2**31:
        raise RuntimeError(
            f"scipy ARPACK cannot run at this size: its basis has n*ncv = {n}*{ncv} >= 2^31 entries "
            "(32-bit BLAS indexing; it segfaults)"
        )


def gradient_closure(w: ParityWorkload) -> Closure:
    """The unit: one gradient of the mean loss over every batch (plain autograd)."""
    params = [p for p in w.model.parameters() if p.requires_grad]

    def f() -> Any:
        grads = None
        for batch in w.batches:
            g = torch.autograd.grad(w.loss_fn(w.model, batch), params)
            grads = g if grads is None else tuple(a + b for a, b in zip(grads, g, strict=True))
        return grads

    return f


def seeded_vectors(n: int, k: int, device: torch.device, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """The probe vector ``v (n,)`` and block ``V (n, k)``, identical in every process."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    v = torch.randn(n, generator=gen)
    V = torch.randn(n, k, generator=gen)
    return v.to(device), V.to(device)


def probe_indices(n: int, most: int = 2**20) -> torch.Tensor:
    """Fixed entries compared across columns (all of them up to ``most``)."""
    return torch.arange(0, n, max(1, -(-n // most)))


class BaselineAdapter(Adapter):
    """What 0.x did, written against plain PyTorch.

    Product: per batch, forward + backward(create_graph) + ``torch.cat`` of the
    gradient + double backward + ``torch.cat``, averaged over batches. Blocks:
    a loop of products. Eigenpairs: scipy ``eigsh`` (ARPACK) with a host round
    trip per product, as 0.x's ``lanczos``. Trace (Hutch++) and SLQ: loops of
    single products and a Lanczos with a Python loop over the basis (0.x had
    neither; this is the hand-written equivalent).
    """

    column = "baseline-0x"

    def version(self) -> str:
        return f"plain torch {torch.__version__}"

    def _hv(self, v: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor | None = None
        for batch in self.w.batches:
            loss = self.w.loss_fn(self.w.model, batch)
            grads = torch.autograd.grad(loss, self.params, create_graph=True)
            flat = torch.cat([g.contiguous().view(-1) for g in grads])
            hv = torch.autograd.grad(flat, self.params, grad_outputs=v, only_inputs=True)
            prod = torch.cat([h.contiguous().view(-1) for h in hv])
            out = prod if out is None else out + prod
        assert out is not None
        return out / len(self.w.batches)

    def hvp(self, v: torch.Tensor) -> Closure:
        return lambda: self._hv(v)

    def block(self, V: torch.Tensor) -> Closure:
        return lambda: torch.stack([self._hv(V[:, i]) for i in range(V.shape[1])], dim=1)

    def top_eigs(self, k: int, tol: float) -> Closure:
        from scipy.sparse.linalg import LinearOperator, eigsh

        check_arpack_size(self.n, k)

        def run() -> dict[str, Any]:
            count = [0]

            def mv(x: np.ndarray) -> np.ndarray:
                count[0] += 1
                t = torch.from_numpy(np.ascontiguousarray(x).reshape(-1)).to(self.device).float()
                return self._hv(t).detach().cpu().numpy()

            op = LinearOperator((self.n, self.n), matvec=mv)  # dtype inferred by one product, as 0.x
            v0 = np.random.default_rng(0).standard_normal(self.n)
            vals = eigsh(op, k=k, which="LM", tol=tol, v0=v0, return_eigenvectors=False)
            vals = sorted((float(x) for x in vals), key=abs, reverse=True)
            return {"matvecs": count[0], "values": vals, "converged": k}

        return run

    def trace(self, num_matvecs: int) -> Closure:
        def run() -> dict[str, Any]:
            s = num_matvecs // 3
            gen = torch.Generator(device="cpu").manual_seed(0)
            S = (torch.randint(0, 2, (self.n, s), generator=gen) * 2 - 1).float().to(self.device)
            G = (torch.randint(0, 2, (self.n, s), generator=gen) * 2 - 1).float().to(self.device)
            Y = torch.stack([self._hv(S[:, i]) for i in range(s)], dim=1)
            Q, _ = torch.linalg.qr(Y)
            G = G - Q @ (Q.T @ G)
            t_low = sum(torch.dot(Q[:, i], self._hv(Q[:, i])) for i in range(s))
            t_res = sum(torch.dot(G[:, i], self._hv(G[:, i])) for i in range(s)) / s
            return {"matvecs": 3 * s, "estimate": float(t_low + t_res)}

        return run

    def slq(self, runs: int, steps: int) -> Closure:
        def run() -> dict[str, Any]:
            gen = torch.Generator(device="cpu").manual_seed(0)
            nodes: list[float] = []
            for _ in range(runs):
                q = torch.randn(self.n, generator=gen).to(self.device)
                q = q / q.norm()
                basis = [q]
                alphas: list[float] = []
                betas: list[float] = []
                beta = 0.0
                prev = torch.zeros_like(q)
                for j in range(steps):
                    w = self._hv(basis[j]) - beta * prev
                    alpha = float(torch.dot(w, basis[j]))
                    w = w - alpha * basis[j]
                    for b in basis:  # full reorthogonalization, one basis vector at a time
                        w = w - torch.dot(w, b) * b
                    alphas.append(alpha)
                    beta = float(w.norm())
                    if j == steps - 1 or beta < 1e-10:
                        break
                    betas.append(beta)
                    prev = basis[j]
                    basis.append(w / beta)
                T = np.diag(alphas) + np.diag(betas[: len(alphas) - 1], 1) + np.diag(betas[: len(alphas) - 1], -1)
                nodes.extend(np.linalg.eigvalsh(T).tolist())
            return {"matvecs": runs * steps, "range": [min(nodes), max(nodes)]}

        return run


def model_params(model: nn.Module) -> list[nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]
