"""Peer columns, through their public APIs: hessian-eigenthings 1.0.0a5 and curvlinops.

They run in a worker subprocess (``benchmarks.harness.worker``) whose
``PYTHONPATH`` is the peer's own target directory: 1.0.0a5 has our import
name, so it can never share a process with our package.
"""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np
import torch

from benchmarks.harness.adapters import Adapter, Closure, OperatorAdapter, check_arpack_size
from benchmarks.workloads import ParityWorkload

A5_VERSION = "1.0.0a5"


def _count_matvecs(op: Any) -> list[int]:
    """Count ``op.matvec`` calls (instance attribute wrapping the bound method)."""
    count = [0]
    inner = op.matvec

    def matvec(v: torch.Tensor) -> torch.Tensor:
        count[0] += 1
        return inner(v)

    op.matvec = matvec
    return count


class A5Adapter(Adapter):
    """hessian-eigenthings 1.0.0a5: one vector per product, no graph reuse, no blocks (a loop).

    LM workloads use its HuggingFace helpers, whose batches carry ``labels``
    (``model(**batch).loss``, the same shifted mean cross-entropy).
    """

    column = "a5"

    def __init__(self, w: ParityWorkload, device: torch.device, options: dict[str, Any]) -> None:
        super().__init__(w, device, options)
        import hessian_eigenthings as a5

        if a5.__version__ != A5_VERSION:
            raise RuntimeError(f"expected hessian_eigenthings {A5_VERSION}, imported {a5.__version__} from {a5.__file__}")
        self.a5 = a5
        self.lm_helpers = w.lm is not None and options.get("core_lm_loss", "hf") == "hf"
        self._ops: dict[str, tuple[Any, list[int]]] = {}

    def version(self) -> str:
        extra = ", hf_lm helpers" if self.lm_helpers else ""
        return f"hessian_eigenthings {self.a5.__version__} ({self.a5.__file__}){extra}"

    def op(self, kind: str) -> tuple[Any, list[int]]:
        if kind in self._ops:
            return self._ops[kind]
        a5, w = self.a5, self.w
        if kind == "hessian":
            if self.lm_helpers:
                assert w.lm is not None
                op = a5.HessianOperator(w.lm, [{"input_ids": x, "labels": x} for x, _ in w.batches], a5.hf_lm_loss())
            else:
                op = a5.HessianOperator(w.model, list(w.batches), a5.supervised_loss(w.criterion))
        elif kind == "ggn":
            if self.lm_helpers:
                assert w.lm is not None
                op = a5.GGNOperator(w.lm, [{"input_ids": x, "labels": x} for x, _ in w.batches], a5.hf_lm_forward(),
                                    a5.hf_lm_loss_of_output())
            else:
                op = a5.GGNOperator(w.model, list(w.batches), a5.supervised_forward,
                                    a5.supervised_loss_of_output(w.criterion))
        elif kind == "fisher":
            if w.lm is not None:
                raise NotImplementedError("1.0.0a5's Fisher vmaps single samples of (X, y); LM targets are per token")
            op = a5.EmpiricalFisherOperator(w.model, list(w.batches), a5.supervised_per_sample_loss(w.criterion))
        else:
            raise KeyError(kind)
        entry = (op, _count_matvecs(op))
        self._ops[kind] = entry
        return entry

    def hvp(self, v: torch.Tensor) -> Closure:
        op, _ = self.op("hessian")
        return lambda: op.matvec(v)

    def block(self, V: torch.Tensor) -> Closure:
        op, _ = self.op("hessian")
        return lambda: torch.stack([op.matvec(V[:, i]) for i in range(V.shape[1])], dim=1)

    def ggn(self, v: torch.Tensor) -> Closure:
        op, _ = self.op("ggn")
        return lambda: op.matvec(v)

    def fisher(self, v: torch.Tensor) -> Closure:
        op, _ = self.op("fisher")
        return lambda: op.matvec(v)

    def top_eigs(self, k: int, tol: float) -> Closure:
        op, count = self.op("hessian")

        def run() -> dict[str, Any]:
            before = count[0]
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                res = self.a5.lanczos(op, k=k, tol=tol, seed=0)
            vals = sorted((float(x) for x in res.eigenvalues.tolist()), key=abs, reverse=True)
            return {"matvecs": count[0] - before, "values": vals, "converged": int(res.converged.sum())}

        return run

    def trace(self, num_matvecs: int) -> Closure:
        op, count = self.op("hessian")

        def run() -> dict[str, Any]:
            before = count[0]
            res = self.a5.trace(op, num_matvecs=num_matvecs, method="hutch++", seed=0)
            return {"matvecs": count[0] - before, "estimate": float(res.estimate)}

        return run

    def slq(self, runs: int, steps: int) -> Closure:
        op, count = self.op("hessian")

        def run() -> dict[str, Any]:
            before = count[0]
            res = self.a5.spectral_density(op, num_runs=runs, lanczos_steps=steps, seed=0, num_grid_points=1000)
            nodes = torch.as_tensor(res.raw_eigenvalues)
            return {"matvecs": count[0] - before, "range": [float(nodes.min()), float(nodes.max())]}

        return run


class CurvlinopsAdapter(OperatorAdapter):
    """curvlinops 3.0.1: ``HessianLinearOperator`` / ``GGNLinearOperator`` / ``EFLinearOperator``.

    Blocks are its native ``op @ V``; eigenpairs through ``scipy`` ``eigsh`` on
    ``op.to_scipy()`` (its documented route); trace ``hutchpp_trace``; SLQ
    ``lanczos_approximate_spectrum`` (which estimates the spectrum's
    boundaries with extra products of its own: not counted).
    """

    column = "curvlinops"

    def __init__(self, w: ParityWorkload, device: torch.device, options: dict[str, Any]) -> None:
        super().__init__(w, device, options)
        import curvlinops

        self.cl = curvlinops
        self._ops: dict[str, Any] = {}

    def version(self) -> str:
        import importlib.metadata as md

        try:
            ver = md.version("curvlinops-for-pytorch")
        except md.PackageNotFoundError:
            ver = "?"
        return f"curvlinops {ver} ({self.cl.__file__})"

    def op(self, kind: str) -> Any:
        if kind not in self._ops:
            cls = {"hessian": self.cl.HessianLinearOperator, "ggn": self.cl.GGNLinearOperator,
                   "fisher": self.cl.EFLinearOperator}[kind]
            self._ops[kind] = cls(self.w.model, self.w.criterion, self.params, list(self.w.batches),
                                  progressbar=False, check_deterministic=False, num_data=self.w.num_samples)
        return self._ops[kind]

    def top_eigs(self, k: int, tol: float) -> Closure:
        from scipy.sparse.linalg import LinearOperator, eigsh

        op = self.op("hessian")
        check_arpack_size(op.shape[0], k)

        def run() -> dict[str, Any]:
            sp = op.to_scipy()
            count = [0]

            def mv(x: np.ndarray) -> np.ndarray:
                count[0] += 1
                return sp @ x

            lin = LinearOperator(sp.shape, matvec=mv, dtype=sp.dtype)
            v0 = np.random.default_rng(0).standard_normal(sp.shape[0]).astype(sp.dtype)
            vals = eigsh(lin, k=k, which="LM", tol=tol, v0=v0, return_eigenvectors=False)
            out = sorted((float(x) for x in vals), key=abs, reverse=True)
            return {"matvecs": count[0], "values": out, "converged": k}

        return run

    def trace(self, num_matvecs: int) -> Closure:
        op = self.op("hessian")

        def run() -> dict[str, Any]:
            torch.manual_seed(0)
            est = self.cl.hutchpp_trace(op, num_matvecs)
            return {"matvecs": num_matvecs, "estimate": float(est)}

        return run

    def slq(self, runs: int, steps: int) -> Closure:
        op = self.op("hessian")

        def run() -> dict[str, Any]:
            torch.manual_seed(0)
            np.random.seed(0)
            grid, _density = self.cl.lanczos_approximate_spectrum(op, steps, num_points=1000, num_repeats=runs)
            grid = torch.as_tensor(grid)
            return {"matvecs": runs * steps, "range": [float(grid.min()), float(grid.max())],
                    "note": "plus uncounted boundary estimation"}

        return run
