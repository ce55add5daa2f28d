"""The 0.x facade against the 1.0 core it translates to, side by side in one process.

    python -m benchmarks.bench_facade                      # CPU
    python -m benchmarks.bench_facade --device cuda        # GPU (CUDA events)

For each legacy client of ``compat/`` the workload of the script (its model,
data, loss and call, same seeds) runs as a pair of callables: the facade call
exactly as the script makes it, and the 1.0 core code the facade translates
to (same operator settings, same algorithm arguments, the seed the facade
draws from torch's global generator). Repeats are interleaved (facade, core,
then core, facade, ...) after warm-up; the ratio is facade median / core
median. On the CPU both wall time and this thread's CPU time are recorded
(``--threads 1`` by default: CPU time then covers all the work and does not
count waiting for a core on a shared machine). Products (operator rows
computed) are counted on a separate, untimed run of each side.

With ``--device cuda`` the models, data and matrices go to the GPU, and
calls that pass ``use_gpu=False`` (their script keeps tensors on the CPU)
pass ``use_gpu=True``, the 0.x way to run them there.

Second part: the facade's ``lanczos`` against ``scipy.sparse.linalg.eigsh``
on the same operator (``op.to_scipy()``: a host round trip per product, as
0.x did), same ``k``, ``tol`` and ``ncv``; wall times and the largest
relative eigenvalue difference.

Writes ``results.json`` and ``results.md`` to ``--out`` (default
``bench_out/facade``).

``--real-0x PATH`` (a 0.x checkout outside this repository) runs instead the
legacy scripts through real 0.x and the facade, one process each:
``benchmarks/real0x.py``.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import platform
import statistics
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from unittest import mock

import numpy as np
import scipy
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import hessian_eigenthings as he
from hessian_eigenthings import algorithms, compat
from hessian_eigenthings.loss_fns import supervised_loss
from hessian_eigenthings.operators import HessianOperator, LambdaOperator
from hessian_eigenthings.operators.base import CurvatureOperator, DataCurvatureOperator

SEED = 0  # torch.manual_seed before every call: the facade draws its seed from it, as 0.x did

# --------------------------------------------------------------------------
# Counting products (untimed runs only)
# --------------------------------------------------------------------------

_USER_PRODUCTS = [0]  # products of user-written operators (the matrix workloads)


@contextlib.contextmanager
def count_products() -> Iterator[list[int]]:
    """Rows computed by data operators plus calls of user product functions."""
    box = [0]
    real = DataCurvatureOperator._matmat_rows

    def counted(self: DataCurvatureOperator, V: torch.Tensor) -> torch.Tensor:
        box[0] += V.shape[0]
        return real(self, V)

    _USER_PRODUCTS[0] = 0
    with mock.patch.object(DataCurvatureOperator, "_matmat_rows", counted):
        yield box
    box[0] += _USER_PRODUCTS[0]


def _ascending(vals: Any) -> np.ndarray[Any, Any]:
    if isinstance(vals, torch.Tensor):
        vals = vals.detach().cpu().numpy()
    return np.sort(np.asarray(vals, dtype=np.float64))


# --------------------------------------------------------------------------
# Workloads: one per legacy client
# --------------------------------------------------------------------------


@dataclass
class Pair:
    name: str
    script: str
    facade: Callable[[], Any]
    core: Callable[[], Any]
    values: Callable[[Any], np.ndarray[Any, Any]]  # eigenvalues of a result, ascending
    note: str = ""


def _seed_like_facade() -> int:
    """The seed the facade passes to the core: drawn from torch's global generator."""
    return int(torch.randint(0, 2**62, (1,)).item())


def _quiet(fn: Callable[[], Any]) -> Any:
    # budget-bound 0.x settings leave pairs unconverged on purpose; the facade silences the
    # core's ConvergenceWarning the same way (core_convergence_warning_off)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", algorithms.ConvergenceWarning)
        return fn()


def mlp_power_iter(device: torch.device) -> Pair:
    torch.manual_seed(0)
    X = torch.randn(128, 8)
    y = (X[:, 0] + 0.5 * X[:, 1] > 0).long()
    loader = DataLoader(TensorDataset(X.to(device), y.to(device)), batch_size=64)
    model = nn.Sequential(nn.Linear(8, 12), nn.Tanh(), nn.Linear(12, 2)).to(device)
    criterion = nn.CrossEntropyLoss()

    def facade() -> Any:
        torch.manual_seed(SEED)
        return compat.compute_hessian_eigenthings(
            model, loader, criterion, 3, power_iter_steps=100, power_iter_err_threshold=1e-6
        )

    def core() -> Any:
        torch.manual_seed(SEED)
        seed = _seed_like_facade()
        op = HessianOperator(model, loader, supervised_loss(criterion))
        return _quiet(
            lambda: algorithms.deflated_power_iteration(op, k=3, max_iter=100, tol=1e-3, seed=seed)
        )

    return Pair("MLP power iteration", "mlp_power_iter.py", facade, core, _values)


def cnn_lanczos(device: torch.device) -> Pair:
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv1 = nn.Conv2d(1, 4, 3, padding=1)
            self.bn1 = nn.BatchNorm2d(4)
            self.fc = nn.Linear(4 * 3 * 3, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = F.max_pool2d(torch.tanh(self.bn1(self.conv1(x))), 2)
            return self.fc(x.view(x.size(0), -1))

    torch.manual_seed(0)
    images = torch.randn(64, 1, 6, 6)
    labels = torch.randint(0, 3, (64,))
    loader = DataLoader(TensorDataset(images.to(device), labels.to(device)), batch_size=32, shuffle=False)
    model = Net().to(device)
    criterion = nn.CrossEntropyLoss()
    use_gpu = device.type == "cuda"  # the script says False (its model is on the CPU)

    def facade() -> Any:
        torch.manual_seed(SEED)
        return compat.compute_hessian_eigenthings(
            model, loader, criterion, num_eigenthings=4, mode="lanczos", use_gpu=use_gpu, max_steps=50
        )

    def core() -> Any:
        # ncv = eigsh's default min(n, max(2k + 1, 20)); max_iter = ncv + max_steps (ncv - k)
        torch.manual_seed(SEED)
        seed = _seed_like_facade()
        op = HessianOperator(model, loader, supervised_loss(criterion))
        return _quiet(
            lambda: algorithms.lanczos(
                op, k=4, which="LM", tol=1e-6, ncv=20, max_iter=20 + 50 * 16, seed=seed
            )
        )

    return Pair("CNN (BatchNorm) Lanczos", "cnn_lanczos.py", facade, core, _values)


def _values(result: Any) -> np.ndarray[Any, Any]:
    if isinstance(result, tuple):
        return _ascending(result[0])
    if hasattr(result, "eigenvalues"):
        return _ascending(result.eigenvalues)
    return _ascending([result.eigenvalue])


def custom_operator(device: torch.device) -> Pair:
    torch.manual_seed(0)
    n = 60
    U, _ = torch.linalg.qr(torch.randn(n, 4))
    U = U.to(device)
    s = torch.tensor([10.0, 6.0, 3.0, 1.5], device=device)
    d = 0.1

    def apply(vec: torch.Tensor) -> torch.Tensor:
        _USER_PRODUCTS[0] += 1
        return U @ (s * (U.t() @ vec)) + d * vec

    class LowRankPlusDiagonal(compat.Operator):
        def __init__(self) -> None:
            super().__init__(n)

        def apply(self, vec: torch.Tensor) -> torch.Tensor:
            return apply(vec)

    class LowRankPlusDiagonalCore(CurvatureOperator):
        """The same operator written against 1.0: a CurvatureOperator with _matvec."""

        def __init__(self) -> None:
            self._size, self._device, self._dtype = n, device, torch.float32

        def _matvec(self, v: torch.Tensor) -> torch.Tensor:
            return apply(v)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        old_op = LowRankPlusDiagonal()
    new_op = LowRankPlusDiagonalCore()
    use_gpu = device.type == "cuda"

    def facade() -> Any:
        torch.manual_seed(SEED)
        return compat.deflated_power_iteration(
            old_op, num_eigenthings=3, power_iter_steps=200, power_iter_err_threshold=1e-7, use_gpu=use_gpu
        )

    def core() -> Any:
        torch.manual_seed(SEED)
        seed = _seed_like_facade()
        return _quiet(
            lambda: algorithms.deflated_power_iteration(
                new_op, k=3, max_iter=200, tol=math.sqrt(1e-7), seed=seed
            )
        )

    return Pair("custom Operator, deflated power iteration", "custom_operator.py", facade, core, _values)


def fp16_hvp(device: torch.device) -> Pair:
    torch.manual_seed(0)
    data = [(torch.randn(32, 5).to(device), torch.randint(0, 3, (32,)).to(device)) for _ in range(2)]
    model = nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 3)).to(device)
    criterion = nn.CrossEntropyLoss()
    use_gpu = device.type == "cuda"

    def facade() -> Any:
        torch.manual_seed(SEED)
        return compat.compute_hessian_eigenthings(
            model, data, criterion, num_eigenthings=2, use_gpu=use_gpu, fp16=True,
            power_iter_steps=100, power_iter_err_threshold=1e-3,
        )

    def core() -> Any:
        # 1.0 has no fp16 switch: half vectors through a LambdaOperator around the float32 Hessian
        torch.manual_seed(SEED)
        seed = _seed_like_facade()
        op = HessianOperator(model, data, supervised_loss(criterion))
        half = LambdaOperator(
            lambda v: op.matvec(v.to(op.dtype)).to(torch.float16),
            op.size,
            op.device,
            torch.float16,
            # a block stays one pass (one batched backward per batch), as through the facade
            matmat_fn=lambda V: op.matmat(V.T.to(op.dtype)).T.to(torch.float16),
        )
        return _quiet(
            lambda: algorithms.deflated_power_iteration(
                half, k=2, max_iter=100, tol=math.sqrt(1e-3), seed=seed
            )
        )

    return Pair("fp16 vectors, power iteration", "fp16_hvp.py", facade, core, _values)


def gpu_flag_on_cpu(device: torch.device) -> Pair:
    torch.manual_seed(0)
    data = [(torch.randn(20, 4).to(device), torch.randint(0, 2, (20,)).to(device)) for _ in range(2)]
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 2)).to(device)
    criterion = nn.CrossEntropyLoss()

    def facade() -> Any:
        torch.manual_seed(SEED)
        op = compat.HVPOperator(model, data, criterion, use_gpu=True, max_possible_gpu_samples=8)
        vals, _ = compat.deflated_power_iteration(op, 2, 100, 1e-6, 0.0, True)
        lvals, _ = compat.lanczos(op, 2, use_gpu=True)
        return vals, lvals

    def core() -> Any:
        torch.manual_seed(SEED)
        op = HessianOperator(model, data, supervised_loss(criterion), microbatch_size=8)
        seed = _seed_like_facade()
        res = _quiet(
            lambda: algorithms.deflated_power_iteration(op, k=2, max_iter=100, tol=1e-3, seed=seed)
        )
        seed = _seed_like_facade()
        # 0.x lanczos defaults: tol 1e-6, max_steps 20, ncv = min(n, max(2k + 1, 20))
        lres = _quiet(
            lambda: algorithms.lanczos(op, k=2, tol=1e-6, ncv=20, max_iter=20 + 20 * 18, seed=seed)
        )
        return res.eigenvalues, lres.eigenvalues

    def values(result: Any) -> np.ndarray[Any, Any]:
        return np.concatenate([_ascending(result[0]), _ascending(result[1])])

    return Pair("use_gpu=True, power iteration + Lanczos", "gpu_flag_on_cpu.py", facade, core, values)


def hvp_minibatch(device: torch.device) -> Pair:
    torch.manual_seed(0)
    batches = [(torch.randn(16, 6).to(device), torch.randn(16, 1).to(device)) for _ in range(3)]
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 1)).to(device)
    criterion = nn.MSELoss()
    n = sum(p.numel() for p in model.parameters())
    vec = torch.randn(n).to(device)
    use_gpu = device.type == "cuda"

    def facade() -> Any:
        torch.manual_seed(SEED)
        op = compat.HVPOperator(model, batches, criterion, use_gpu=use_gpu, full_dataset=False)
        products = [op.apply(vec) for _ in range(len(batches))]
        op.zero_grad()
        full_op = compat.HVPOperator(model, batches, criterion, use_gpu=use_gpu, full_dataset=True)
        val, _ = compat.power_iteration(full_op, steps=200, error_threshold=1e-6, use_gpu=use_gpu)
        return val, products

    def core() -> Any:
        torch.manual_seed(SEED)
        op = HessianOperator(model, batches, supervised_loss(criterion), full_dataset=False)
        products = [op.matvec(vec) for _ in range(len(batches))]
        model.zero_grad(set_to_none=False)
        full_op = HessianOperator(model, batches, supervised_loss(criterion))
        seed = _seed_like_facade()
        res = algorithms.power_iteration_one(full_op, max_iter=200, tol=1e-3, seed=seed)
        return res.eigenvalue, products

    def values(result: Any) -> np.ndarray[Any, Any]:
        return np.array([result[0]] + [float(p.norm()) for p in result[1]])

    return Pair(
        "HVPOperator per batch + power iteration",
        "hvp_minibatch.py",
        facade,
        core,
        values,
        "the script's log/progress_bar/format_time printing is left out",
    )


def lanczos_smallest(device: torch.device) -> Pair:
    torch.manual_seed(0)
    n = 80
    Q, _ = torch.linalg.qr(torch.randn(n, n))
    spectrum = torch.linspace(-2.0, 5.0, n)
    A = (Q @ torch.diag(spectrum) @ Q.t()).to(device)
    init_vec = torch.ones(n, device=device)

    def apply(vec: torch.Tensor) -> torch.Tensor:
        _USER_PRODUCTS[0] += 1
        return A @ vec

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        old_op = compat.LambdaOperator(apply, n)
    new_op = LambdaOperator(apply, n, device=device)
    use_gpu = device.type == "cuda"

    def facade() -> Any:
        torch.manual_seed(SEED)
        return compat.lanczos(
            old_op, num_eigenthings=3, which="SA", max_steps=100, tol=1e-6, init_vec=init_vec,
            use_gpu=use_gpu,
        )

    def core() -> Any:
        torch.manual_seed(SEED)
        return algorithms.lanczos(
            new_op, k=3, which="SA", tol=1e-6, ncv=20, max_iter=20 + 100 * 17, v0=init_vec
        )

    return Pair("Lanczos which='SA' from init_vec", "lanczos_smallest.py", facade, core, _values)


def control(device: torch.device) -> Pair:
    """Noise floor: the core side of ``mlp_power_iter`` against itself (true ratio 1)."""
    pair = mlp_power_iter(device)
    return Pair(
        "control: core vs itself (MLP power iteration)",
        "(A/A control)",
        pair.core,
        pair.core,
        _values,
        "both sides are the same callable: any distance from 1.000 is measurement noise",
    )


WORKLOADS: list[Callable[[torch.device], Pair]] = [
    mlp_power_iter,
    cnn_lanczos,
    custom_operator,
    fp16_hvp,
    gpu_flag_on_cpu,
    hvp_minibatch,
    lanczos_smallest,
    control,
]

# --------------------------------------------------------------------------
# Timing
# --------------------------------------------------------------------------


def _time_once(fn: Callable[[], Any], device: torch.device) -> tuple[float, float]:
    """(wall ms, CPU ms of this thread); wall by CUDA events on GPU.

    The garbage collector is run before and kept off during the call (as ``timeit`` does), so a
    collection triggered by one side's garbage is not charged to the other.
    """
    gc.collect()
    gc.disable()
    try:
        return _time_call(fn, device)
    finally:
        gc.enable()


def _time_call(fn: Callable[[], Any], device: torch.device) -> tuple[float, float]:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        c0 = time.thread_time()
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize(device)
        return start.elapsed_time(end), (time.thread_time() - c0) * 1e3
    c0, t0 = time.thread_time(), time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3, (time.thread_time() - c0) * 1e3


def interleaved(
    fns: dict[str, Callable[[], Any]], device: torch.device, repeats: int, warmup: int
) -> dict[str, dict[str, float]]:
    names = list(fns)
    for _ in range(warmup):
        for name in names:
            fns[name]()
    wall: dict[str, list[float]] = {k: [] for k in names}
    cpu: dict[str, list[float]] = {k: [] for k in names}
    for r in range(repeats):
        for name in names if r % 2 == 0 else names[::-1]:
            w, c = _time_once(fns[name], device)
            wall[name].append(w)
            cpu[name].append(c)
    out: dict[str, dict[str, float]] = {
        k: {
            "wall_ms": statistics.median(wall[k]),
            "cpu_ms": statistics.median(cpu[k]),
            "wall_iqr_ms": _iqr(wall[k]),
            "cpu_min_ms": min(cpu[k]),
        }
        for k in names
    }
    if len(names) == 2:
        # median of the ratios of the two calls of each repeat (adjacent in time, so a change
        # of load between repeats cancels)
        a, b = names
        out["paired"] = {
            "wall": statistics.median(x / y for x, y in zip(wall[a], wall[b], strict=True)),
            "cpu": statistics.median(x / y for x, y in zip(cpu[a], cpu[b], strict=True)),
        }
    return out


def _iqr(xs: list[float]) -> float:
    q = statistics.quantiles(xs, n=4)
    return q[2] - q[0]


def run_pair(pair: Pair, device: torch.device, repeats: int, warmup: int) -> dict[str, Any]:
    with warnings.catch_warnings():
        # the scripts' own warnings (deprecations, CPU fallback) are shown once per call site
        # by Python's default filter; here they are the same line every repeat: keep stderr quiet
        warnings.simplefilter("ignore")
        with count_products() as fc:
            f_res = pair.facade()
        with count_products() as cc:
            c_res = pair.core()
        fv, cv = pair.values(f_res), pair.values(c_res)
        diff = float(np.max(np.abs(fv - cv) / np.maximum(np.abs(cv), 1e-30)))
        med = interleaved({"facade": pair.facade, "core": pair.core}, device, repeats, warmup)
    return {
        "workload": pair.name,
        "script": pair.script,
        "facade_wall_ms": med["facade"]["wall_ms"],
        "core_wall_ms": med["core"]["wall_ms"],
        "facade_cpu_ms": med["facade"]["cpu_ms"],
        "core_cpu_ms": med["core"]["cpu_ms"],
        "facade_wall_iqr_ms": med["facade"]["wall_iqr_ms"],
        "core_wall_iqr_ms": med["core"]["wall_iqr_ms"],
        "ratio_wall": med["facade"]["wall_ms"] / med["core"]["wall_ms"],
        "ratio_cpu": med["facade"]["cpu_ms"] / med["core"]["cpu_ms"],
        "paired_ratio_wall": med["paired"]["wall"],
        "paired_ratio_cpu": med["paired"]["cpu"],
        "min_ratio_cpu": med["facade"]["cpu_min_ms"] / med["core"]["cpu_min_ms"],
        "products_facade": fc[0],
        "products_core": cc[0],
        "max_rel_diff": diff,
        "note": pair.note,
    }


# --------------------------------------------------------------------------
# Facade lanczos against ARPACK
# --------------------------------------------------------------------------


def arpack_problem(device: torch.device, width: int) -> tuple[compat.HVPOperator, str]:
    """An HVPOperator (0.x style) on an MLP classifier with one batch (graph kept across products)."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(32, width), nn.Tanh(), nn.Linear(width, width), nn.Tanh(), nn.Linear(width, 10)
    ).to(device)
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(256, 32, generator=g).to(device), torch.randint(0, 10, (256,), generator=g).to(device))]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        op = compat.HVPOperator(model, data, nn.CrossEntropyLoss(), use_gpu=device.type == "cuda")
    return op, f"MLP 32-{width}-{width}-10 Hessian, batch 256"


def run_arpack(device: torch.device, repeats: int, width: int, k: int, tol: float) -> dict[str, Any]:
    from scipy.sparse.linalg import eigsh

    op, desc = arpack_problem(device, width)
    n = op.size
    ncv = min(n, max(2 * k + 1, 20))
    v0 = torch.ones(n, device=device) / math.sqrt(n)
    counts = {"facade": 0, "eigsh": 0}

    def facade() -> np.ndarray[Any, Any]:
        before = op.num_matvecs
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            vals, _ = compat.lanczos(
                op, num_eigenthings=k, which="LM", max_steps=1000, tol=tol,
                num_lanczos_vectors=ncv, init_vec=v0, use_gpu=device.type == "cuda",
            )
        counts["facade"] = op.num_matvecs - before
        return vals

    def arpack() -> np.ndarray[Any, Any]:
        before = op.num_matvecs
        vals = eigsh(
            op.to_scipy(), k=k, which="LM", maxiter=1000, tol=tol, ncv=ncv,
            v0=v0.double().cpu().numpy(), return_eigenvectors=True,
        )[0]
        counts["eigsh"] = op.num_matvecs - before
        return np.sort(vals)

    ours, ref = facade(), arpack()
    rel = float(np.max(np.abs(np.sort(ours) - ref) / np.abs(ref)))
    med = interleaved({"facade lanczos": facade, "eigsh": arpack}, device, repeats, warmup=1)
    return {
        "operator": desc,
        "n": n,
        "k": k,
        "tol": tol,
        "ncv": ncv,
        "facade_wall_ms": med["facade lanczos"]["wall_ms"],
        "eigsh_wall_ms": med["eigsh"]["wall_ms"],
        "speedup": med["eigsh"]["wall_ms"] / med["facade lanczos"]["wall_ms"],
        "products_facade": counts["facade"],
        "products_eigsh": counts["eigsh"],
        "max_rel_eig_diff": rel,
        "eigenvalues": ref.tolist(),
    }


# --------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------


def environment(device: torch.device, threads: int) -> dict[str, Any]:
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or platform.machine()
    return {
        "device": f"{device.type} ({name})",
        "torch": torch.__version__,
        "numpy": np.__version__,
        "scipy": scipy.__version__,
        "python": platform.python_version(),
        "hessian_eigenthings": he.__version__,
        "torch_threads": threads,
    }


def markdown(env: dict[str, Any], rows: list[dict[str, Any]], arpack: dict[str, Any], args: argparse.Namespace) -> str:
    lines = [
        f"device: {env['device']}, torch {env['torch']}, numpy {env['numpy']}, scipy {env['scipy']}, "
        f"Python {env['python']}, hessian-eigenthings {env['hessian_eigenthings']}, "
        f"torch threads {env['torch_threads']}; median of {args.repeats} interleaved repeats after "
        f"{args.warmup} warm-ups.",
        "",
        "Ratios: facade median / core median; 'paired' = median of the per-repeat ratios; "
        "'min' = ratio of the fastest repeats (noise only adds time). "
        "CPU = this thread's CPU time (GPU runs: host time, wall = CUDA events).",
        "",
        "| legacy script | workload | facade ms | core ms | facade/core wall | paired | facade/core CPU | paired | min | products facade / core | max rel diff |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| `{r['script']}` | {r['workload']} | {r['facade_wall_ms']:.2f} | {r['core_wall_ms']:.2f} | "
            f"{r['ratio_wall']:.3f} | {r['paired_ratio_wall']:.3f} | {r['ratio_cpu']:.3f} | "
            f"{r['paired_ratio_cpu']:.3f} | {r['min_ratio_cpu']:.3f} | {r['products_facade']} / {r['products_core']} | "
            f"{r['max_rel_diff']:.1e} |"
        )
    a = arpack
    lines += [
        "",
        f"Facade `lanczos` vs `eigsh` on the same operator ({a['operator']}, n = {a['n']:,}; k = {a['k']}, "
        f"tol = {a['tol']:g}, ncv = {a['ncv']}, same start vector; eigsh through `op.to_scipy()`, "
        "a host round trip per product as 0.x did):",
        "",
        "| solver | wall ms | products | max rel eigenvalue diff |",
        "|---|---:|---:|---:|",
        f"| facade lanczos | {a['facade_wall_ms']:.1f} | {a['products_facade']} | {a['max_rel_eig_diff']:.1e} |",
        f"| eigsh (ARPACK) | {a['eigsh_wall_ms']:.1f} | {a['products_eigsh']} | (reference) |",
        "",
        f"eigsh / facade wall time: {a['speedup']:.2f}x",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    args_list = sys.argv[1:] if argv is None else argv
    if any(a == "--real-0x" or a.startswith("--real-0x=") for a in args_list):
        # the real-0.x column: the legacy scripts through real 0.x and the facade, one worker
        # process each (they share the import name); see benchmarks/real0x.py
        from benchmarks import real0x

        raise SystemExit(real0x.main(args_list))
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu")
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (0: leave torch's default)")
    p.add_argument("--arpack-width", type=int, default=128, help="hidden width of the ARPACK comparison's MLP")
    p.add_argument("--arpack-k", type=int, default=4)
    p.add_argument("--arpack-tol", type=float, default=1e-6)
    p.add_argument("--arpack-repeats", type=int, default=5)
    p.add_argument("--only", nargs="*", help="script names to run (default: all)")
    p.add_argument("--out", default="bench_out/facade")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    env = environment(device, torch.get_num_threads())
    print(env, flush=True)
    rows = []
    for make in WORKLOADS:
        pair = make(device)
        if args.only and pair.script not in args.only and pair.script[:-3] not in args.only:
            continue
        row = run_pair(pair, device, args.repeats, args.warmup)
        rows.append(row)
        print(
            f"{row['script']:22s} facade {row['facade_wall_ms']:8.2f} ms  core {row['core_wall_ms']:8.2f} ms  "
            f"wall {row['ratio_wall']:.3f} ({row['paired_ratio_wall']:.3f})  cpu {row['ratio_cpu']:.3f} "
            f"({row['paired_ratio_cpu']:.3f}, min {row['min_ratio_cpu']:.3f})  products "
            f"{row['products_facade']}/{row['products_core']}  diff {row['max_rel_diff']:.1e}",
            flush=True,
        )
    arpack = run_arpack(device, args.arpack_repeats, args.arpack_width, args.arpack_k, args.arpack_tol)
    print(
        f"lanczos vs eigsh: {arpack['facade_wall_ms']:.1f} ms vs {arpack['eigsh_wall_ms']:.1f} ms "
        f"({arpack['speedup']:.2f}x), products {arpack['products_facade']}/{arpack['products_eigsh']}, "
        f"max rel diff {arpack['max_rel_eig_diff']:.1e}",
        flush=True,
    )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"env": env, "args": vars(args), "workloads": rows, "arpack": arpack}, indent=2))
    (out / "results.md").write_text(markdown(env, rows, arpack, args))
    print(f"wrote {out / 'results.json'} and {out / 'results.md'}")


if __name__ == "__main__":
    main()
