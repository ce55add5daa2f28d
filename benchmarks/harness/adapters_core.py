"""Our columns: the 1.0 core (graph reuse on / off) and the 0.x facade, through public APIs only."""

from __future__ import annotations

import warnings
from typing import Any

import torch

import hessian_eigenthings as he
from benchmarks.harness.adapters import Adapter, Closure, OperatorAdapter
from benchmarks.workloads import ParityWorkload


class CoreAdapter(OperatorAdapter):
    """``HessianOperator`` / ``GGNOperator`` / ``EmpiricalFisherOperator`` and the 1.0 algorithms.

    LM workloads use the library's HuggingFace helpers (``hf_lm_loss``,
    ``hf_lm_forward``, ``hf_lm_loss_of_output``) on the causal LM itself with
    ``{"input_ids": ...}`` batches, as a user of 1.0 would (option
    ``core_lm_loss="generic"`` uses the shared ``model(X) -> logits`` form
    instead). The empirical Fisher always uses the shared form, with one
    loss per sequence on LMs (``ParityWorkload.per_sample_loss``).
    """

    column = "core"
    reuse: bool = True
    engine: str = "auto"

    def __init__(self, w: ParityWorkload, device: torch.device, options: dict[str, Any]) -> None:
        super().__init__(w, device, options)
        self.lm_helpers = w.lm is not None and options.get("core_lm_loss", "hf") == "hf"
        if self.lm_helpers:
            assert w.lm is not None
            self.model = w.lm
            self.data: list[Any] = [{"input_ids": x} for x, _ in w.batches]
        else:
            self.model = w.model
            self.data = list(w.batches)
        self._ops: dict[str, Any] = {}

    def version(self) -> str:
        extra = ", hf_lm helpers" if self.lm_helpers else ""
        return f"hessian_eigenthings {he.__version__} (graph_reuse={self.reuse}, engine={self.engine}{extra})"

    def op(self, kind: str) -> Any:
        if kind in self._ops:
            return self._ops[kind]
        w = self.w
        if kind == "hessian":
            loss = he.hf_lm_loss() if self.lm_helpers else he.supervised_loss(w.criterion)
            op = he.HessianOperator(self.model, self.data, loss, graph_reuse=self.reuse, engine=self.engine)
        elif kind == "ggn":
            if self.lm_helpers:
                op = he.GGNOperator(self.model, self.data, he.hf_lm_forward(), he.hf_lm_loss_of_output(),
                                    graph_reuse=self.reuse, engine=self.engine)
            else:
                op = he.GGNOperator(w.model, list(w.batches), he.supervised_forward,
                                    he.supervised_loss_of_output(w.criterion), graph_reuse=self.reuse, engine=self.engine)
        elif kind == "fisher":
            per_sample = w.per_sample_loss if w.lm is not None else he.supervised_per_sample_loss(w.criterion)
            op = he.EmpiricalFisherOperator(w.model, list(w.batches), per_sample, graph_reuse=self.reuse, engine=self.engine)
        else:
            raise KeyError(kind)
        self._ops[kind] = op
        return op

    def held_mib(self) -> float:
        return self.op("hessian").held_bytes / 2**20 if "hessian" in self._ops else float("nan")

    def engine_report(self) -> dict[str, Any]:
        """The Hessian operator's engine: auto's choice, traces, compilations and compile time."""
        return dict(self.op("hessian").engine_report) if "hessian" in self._ops else {}

    def top_eigs(self, k: int, tol: float) -> Closure:
        op = self.op("hessian")

        def run() -> dict[str, Any]:
            before = op.num_matvecs
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                res = he.algorithms.lanczos(op, k=k, tol=tol, seed=0)
            vals = sorted((float(x) for x in res.eigenvalues.tolist()), key=abs, reverse=True)
            return {"matvecs": op.num_matvecs - before, "values": vals, "converged": int(res.converged.sum())}

        return run

    def trace(self, num_matvecs: int) -> Closure:
        op = self.op("hessian")

        def run() -> dict[str, Any]:
            before = op.num_matvecs
            res = he.algorithms.trace(op, num_matvecs=num_matvecs, method="hutch++", seed=0)
            return {"matvecs": op.num_matvecs - before, "estimate": float(res.estimate)}

        return run

    def slq(self, runs: int, steps: int) -> Closure:
        op = self.op("hessian")

        def run() -> dict[str, Any]:
            before = op.num_matvecs
            res = he.algorithms.spectral_density(op, num_runs=runs, lanczos_steps=steps, seed=0,
                                                 num_grid_points=1000, progress=False)
            nodes, _ = res.quadrature()
            return {"matvecs": op.num_matvecs - before, "range": [float(nodes.min()), float(nodes.max())]}

        return run


class CoreNoReuseAdapter(CoreAdapter):
    column = "core-noreuse"
    reuse = False


class CoreAutogradAdapter(CoreAdapter):
    column = "core-autograd"
    engine = "autograd"


class CoreFunctionalAdapter(CoreAdapter):
    column = "core-functional"
    engine = "functional"


class CoreCompiledAdapter(CoreAdapter):
    column = "core-compiled"
    engine = "compiled"


class FacadeAdapter(Adapter):
    """The 0.x API as 0.x code calls it: ``HVPOperator(...).apply``, 0.x ``lanczos``.

    ``max_possible_gpu_samples`` is the largest batch (no 0.x chunking).
    Deprecation warnings are silenced. 0.x had no blocks (a loop of
    ``apply``), no GGN / Fisher / trace / density.
    """

    column = "facade"

    def __init__(self, w: ParityWorkload, device: torch.device, options: dict[str, Any]) -> None:
        super().__init__(w, device, options)
        biggest = max(int(x.shape[0]) for x, _ in w.batches)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self.op = he.HVPOperator(w.model, list(w.batches), w.criterion, use_gpu=device.type == "cuda",
                                     full_dataset=True, max_possible_gpu_samples=biggest)

    def version(self) -> str:
        return f"hessian_eigenthings {he.__version__} 0.x facade"

    def held_mib(self) -> float:
        return self.op.held_bytes / 2**20

    def hvp(self, v: torch.Tensor) -> Closure:
        return lambda: self.op.apply(v)

    def block(self, V: torch.Tensor) -> Closure:
        return lambda: torch.stack([self.op.apply(V[:, i]) for i in range(V.shape[1])], dim=1)

    def ggn(self, v: torch.Tensor) -> Closure:
        raise NotImplementedError("0.x had no GGN")

    def fisher(self, v: torch.Tensor) -> Closure:
        raise NotImplementedError("0.x had no Fisher")

    def top_eigs(self, k: int, tol: float) -> Closure:
        def run() -> dict[str, Any]:
            before = self.op.num_matvecs
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                vals, _ = he.lanczos(self.op, num_eigenthings=k, tol=tol, use_gpu=self.device.type == "cuda")
            out = sorted((float(x) for x in vals), key=abs, reverse=True)
            return {"matvecs": self.op.num_matvecs - before, "values": out, "converged": k}

        return run

    def trace(self, num_matvecs: int) -> Closure:
        raise NotImplementedError("0.x had no trace estimator")

    def slq(self, runs: int, steps: int) -> Closure:
        raise NotImplementedError("0.x had no spectral density")
