"""A Krylov basis off the device (``basis_device="cpu"``, NOTE [basis off the device] in
``algorithms/basis``): the same iteration as the basis on the device, with at most a chunk of
the basis on the device at once.

On the CPU "device" and "host" are both host memory, but the streamed basis still copies every
panel it uses into its staging buffer and back, so these tests run the streaming path for real,
with chunks of one or two vectors (``CHUNK_BYTES`` patched) to make many panels. Counts come from
the storage's own counters (numbers staged, copied in and out), never from timings.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch import nn

import hessian_eigenthings.algorithms.basis as basis_mod
import hessian_eigenthings.algorithms.krylov as krylov_mod
from hessian_eigenthings.algorithms import (
    EigenResult,
    lanczos,
    lanczos_tridiagonal,
    spectral_density,
)
from hessian_eigenthings.algorithms.basis import KrylovBasis, StreamedBasis, StreamedRuns
from hessian_eigenthings.algorithms.krylov import KrylovState, LanczosPlan
from hessian_eigenthings.linalg import SingleDeviceBackend
from hessian_eigenthings.operators import HessianOperator
from hessian_eigenthings.operators.base import LambdaOperator
from tests.algorithms.spectra import dense_matrix, spectrum
from tests.launch import launch_ranks

# the package's `lanczos` attribute is the function: the module by its name
lanczos_mod = importlib.import_module("hessian_eigenthings.algorithms.lanczos")

HERE = Path(__file__).resolve().parent
N = 200
TOL = 1e-12  # float64: the streamed sums differ from the device's in order only


class Counting(LambdaOperator):
    """A dense float64 operator that counts its products and raises ``KeyboardInterrupt`` at
    product ``stop_at`` (as Ctrl-C would)."""

    def __init__(self, m: np.ndarray, stop_at: int | None = None) -> None:
        self.A = torch.as_tensor(m, dtype=torch.float64)
        self.products = 0
        self.stop_at = stop_at
        super().__init__(
            lambda v: self._rows(v.unsqueeze(0))[0],
            m.shape[0],
            dtype=torch.float64,
            matmat_fn=self._rows,
        )

    def _rows(self, V: torch.Tensor) -> torch.Tensor:
        self.products += V.shape[0]
        if self.stop_at is not None and self.products >= self.stop_at:
            raise KeyboardInterrupt(f"interrupted at product {self.products}")
        return V @ self.A.T


def _chunk(monkeypatch: pytest.MonkeyPatch, vectors: int, n: int) -> int:
    """Let a streamed basis have ``vectors`` float64 vectors of length ``n`` on the device."""
    numbers = vectors * n
    monkeypatch.setattr(basis_mod, "CHUNK_BYTES", numbers * 8)
    return numbers


def _record(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """The bases that ``lanczos`` and ``tridiagonal_runs`` make, as they make them."""
    made: list[Any] = []

    def wrap(make: Callable[..., Any]) -> Callable[..., Any]:
        def record(*args: Any) -> Any:
            made.append(make(*args))
            return made[-1]

        return record

    monkeypatch.setattr(krylov_mod, "new_basis", wrap(basis_mod.new_basis))
    monkeypatch.setattr(lanczos_mod, "new_run_bases", wrap(basis_mod.new_run_bases))
    return made


def _assert_same_pairs(got: EigenResult, ref: EigenResult, vectors_tol: float = TOL) -> None:
    assert got.iterations == ref.iterations
    assert torch.equal(got.converged, ref.converged)
    torch.testing.assert_close(got.eigenvalues, ref.eigenvalues, rtol=0, atol=TOL)
    signs = torch.sign((got.eigenvectors * ref.eigenvectors).sum(1, keepdim=True))
    torch.testing.assert_close(got.eigenvectors * signs, ref.eigenvectors, rtol=0, atol=vectors_tol)
    torch.testing.assert_close(got.residuals, ref.residuals, rtol=0, atol=TOL)


CASES = [
    ("separated", "LM", TOL),  # SPD
    ("indefinite", "SA", TOL),
    ("indefinite", "LM", TOL),
    # six eigenvalues 1e-3 apart at 5: an eigenvector in the cluster moves by about ||A|| / gap
    # = 5e3 times a perturbation, so the order of the panel sums shows at 1.3e-12 (eigenvalues
    # still agree to 1e-14)
    ("clustered", "LA", 1e-11),
]


@pytest.mark.parametrize(("kind", "which", "vectors_tol"), CASES)
@pytest.mark.parametrize(("b", "vectors"), [(1, 1), (3, 2)])  # chunks of 1 and 2 vectors
def test_host_basis_lanczos_equals_the_device_basis(
    monkeypatch: pytest.MonkeyPatch, kind: str, which: str, vectors_tol: float, b: int, vectors: int
) -> None:
    m = dense_matrix(spectrum(kind, N, seed=0), seed=1)
    kw: dict[str, Any] = dict(k=5, which=which, seed=3, tol=1e-10, block_size=b, ncv=24)
    ref_op = Counting(m)
    ref = lanczos(ref_op, **kw)
    chunk = _chunk(monkeypatch, vectors, N)
    made = _record(monkeypatch)
    op = Counting(m)
    got = lanczos(op, basis_device="cpu", **kw)
    _assert_same_pairs(got, ref, vectors_tol)
    assert op.products == ref_op.products == got.iterations  # (b): the same products
    assert bool(ref.converged.all()) and ref.iterations > 24  # thick restarts happened
    (basis,) = made
    assert isinstance(basis, StreamedBasis) and len(basis.columns) > 10
    # (d): never more than the chunk of the basis on the device, in every operation
    assert basis.peak_device_numbers <= chunk
    assert basis.numbers_in > 3 * got.iterations * N  # every step streamed the basis
    assert got.eigenvectors.device.type == "cpu"


def test_exact_residuals_and_warm_start_on_a_host_basis(monkeypatch: pytest.MonkeyPatch) -> None:
    m = dense_matrix(spectrum("indefinite", N, seed=0), seed=1)
    kw: dict[str, Any] = dict(k=4, which="LA", seed=0, tol=1e-9, residuals="exact", block_size=2)
    ref = lanczos(Counting(m), **kw)
    _chunk(monkeypatch, 2, N)
    op = Counting(m)
    got = lanczos(op, basis_device="cpu", **kw)
    _assert_same_pairs(got, ref)
    assert op.products == got.iterations  # the k products of the check counted once
    near = m + 1e-5 * dense_matrix(spectrum("separated", N, seed=0), seed=2)
    warm_ref = lanczos(Counting(near), v0=ref, k=4, which="LA", seed=0, tol=1e-9)
    warm = lanczos(Counting(near), v0=got, k=4, which="LA", seed=0, tol=1e-9, basis_device="cpu")
    _assert_same_pairs(warm, warm_ref)


def _mlp_hessian() -> HessianOperator:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 4)).double()
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(32, 6, generator=gen, dtype=torch.float64)
    y = torch.randint(0, 4, (32,), generator=gen)
    ce = nn.CrossEntropyLoss()
    return HessianOperator(model, [(x, y)], lambda mod, batch: ce(mod(batch[0]), batch[1]))


def test_host_basis_on_a_model_hessian(monkeypatch: pytest.MonkeyPatch) -> None:
    op = _mlp_hessian()  # 136 parameters
    kw: dict[str, Any] = dict(k=4, seed=0, tol=1e-8, ncv=16)
    ref = lanczos(op, **kw)
    chunk = _chunk(monkeypatch, 1, op.size)
    made = _record(monkeypatch)
    got = lanczos(op, basis_device="cpu", **kw)
    _assert_same_pairs(got, ref)
    assert made[0].peak_device_numbers <= chunk


@pytest.mark.parametrize("reorthogonalize", [True, False])
def test_host_basis_spectral_density_and_tridiagonal(
    monkeypatch: pytest.MonkeyPatch, reorthogonalize: bool
) -> None:
    m = dense_matrix(spectrum("indefinite", N, seed=0), seed=1)
    kw: dict[str, Any] = dict(
        num_runs=5, lanczos_steps=40, seed=2, num_grid_points=300, reorthogonalize=reorthogonalize
    )
    ref = spectral_density(Counting(m), **kw)
    chunk = _chunk(monkeypatch, 2, N)
    made = _record(monkeypatch)
    got = spectral_density(Counting(m), basis_device="cpu", **kw)
    for name in ("raw_eigenvalues", "raw_weights", "density"):
        torch.testing.assert_close(
            getattr(got, name).nan_to_num(), getattr(ref, name).nan_to_num(), rtol=0, atol=TOL
        )
    (runs,) = made
    if reorthogonalize:  # the lockstep bases are streamed, a chunk at a time
        assert isinstance(runs, StreamedRuns) and len(runs.rows.columns) > 10
        assert runs.rows.peak_device_numbers <= chunk
    else:  # two vectors a run: they stay on the device
        assert not runs.streamed
    v0 = torch.randn(N, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    ref_t = lanczos_tridiagonal(Counting(m), v0, 30)
    got_t = lanczos_tridiagonal(
        Counting(m), v0, 30, basis_device="cpu", reorthogonalize=reorthogonalize
    )
    if not reorthogonalize:
        ref_t = lanczos_tridiagonal(Counting(m), v0, 30, reorthogonalize=False)
    for name in ("alphas", "betas", "basis"):
        torch.testing.assert_close(getattr(got_t, name), getattr(ref_t, name), rtol=0, atol=TOL)
    assert got_t.basis is not None and got_t.basis.device.type == "cpu"


def test_a_step_moves_three_passes_of_the_basis(monkeypatch: pytest.MonkeyPatch) -> None:
    """What moves per step (NOTE [basis off the device]): CGS2 streams the basis three times,
    plus the block to apply; the new block goes back."""
    m = dense_matrix(spectrum("separated", N, seed=0), seed=1)
    _chunk(monkeypatch, 2, N)
    for b in (1, 2):
        op = Counting(m)
        plan = LanczosPlan.for_call(
            op, k=3, max_iter=None, tol=1e-10, reorthogonalize=None, which="LM", ncv=20,
            block_size=b, residuals="recorded", precision=None, basis_device="cpu",
        )  # fmt: skip
        start = torch.linalg.qr(torch.randn(N, b, dtype=torch.float64))[0].T.contiguous()
        run = KrylovState(plan, op, SingleDeviceBackend(), torch.Generator().manual_seed(0), start)
        basis = run.basis
        assert isinstance(basis, StreamedBasis)
        for _ in range(4):
            before_in, before_out = basis.numbers_in, basis.numbers_out
            run.step()
            top = run.j + b
            assert basis.numbers_in - before_in == (3 * top + b) * N
            assert basis.numbers_out - before_out == b * N
            run.advance()


def test_device_basis_is_unchanged() -> None:
    """The default keeps the basis on the operator's device, in one tensor (the 1.0 path)."""
    m = dense_matrix(spectrum("separated", N, seed=0), seed=1)
    op = Counting(m)
    plan = LanczosPlan.for_call(
        op, k=3, max_iter=None, tol=1e-10, reorthogonalize=None, which="LM", ncv=20,
        block_size=1, residuals="recorded", precision=None,
    )  # fmt: skip
    assert plan.basis_device is None and "basis_panel" not in plan.config(op, 0, None)
    run = KrylovState(plan, op, SingleDeviceBackend(), torch.Generator(), torch.eye(1, N))
    assert type(run.basis) is KrylovBasis and run.Vn is not None


def test_bad_basis_devices_are_refused() -> None:
    op = Counting(dense_matrix(spectrum("separated", 30, seed=0), seed=1))
    with pytest.raises(ValueError, match="basis_device='nowhere' is not a device"):
        lanczos(op, k=2, basis_device="nowhere")
    with pytest.raises(TypeError, match="basis_device must be a device"):
        lanczos(op, k=2, basis_device=3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="is not a device"):
        spectral_density(op, num_runs=2, lanczos_steps=5, basis_device="nowhere")


def test_a_basis_too_large_for_the_device_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    """A device basis that does not fit (lanczos's defaults on a 1.24 B-parameter model asked an
    80 GB H100 for 96.7 GiB) is refused in one line naming its size and the way out, still as
    the allocator's out-of-memory error; the allocation fails as CUDA's would (no CUDA here)."""
    op = Counting(dense_matrix(spectrum("separated", N, seed=0), seed=1))
    empty = torch.empty

    def no_room(*size: Any, **kwargs: Any) -> torch.Tensor:
        shape = size[0] if len(size) == 1 and isinstance(size[0], tuple) else size
        two, three = len(shape) == 2 and shape[0] >= 10, len(shape) == 3
        basis = (two or three) and shape[-1] == N
        if basis:  # Lanczos's (rows, n) basis, or the lockstep runs' (runs, steps, n)
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate ...")
        return empty(*size, **kwargs)

    monkeypatch.setattr(basis_mod.torch, "empty", no_room)
    with pytest.raises(torch.cuda.OutOfMemoryError) as err:
        lanczos(op, k=3, ncv=12)
    message = str(err.value)
    assert "Krylov basis (" in message and f"vectors of {N} float64" in message
    assert "basis_device='cpu'" in message and "smaller ncv" in message
    # spectral density's lockstep runs: the same line, with its own arguments to shrink it
    with pytest.raises(torch.cuda.OutOfMemoryError) as err:
        spectral_density(op, num_runs=2, lanczos_steps=8)
    message = str(err.value)
    assert f"(16 vectors of {N} float64" in message and "basis_device='cpu'" in message
    assert "fewer num_runs or lanczos_steps, or reorthogonalize=False" in message
    monkeypatch.undo()
    # the one line's size: rows × n × bytes
    line = basis_mod.basis_too_large(20, 1_235_814_400, torch.float32, torch.device("cuda", 0))
    assert "(20 vectors of 1235814400 float32, 98.9 GB) does not fit on cuda:0" in line


FIELDS = ("eigenvalues", "eigenvectors", "residuals", "converged")


def _same(a: EigenResult, b: EigenResult) -> bool:
    return a.iterations == b.iterations and all(
        torch.equal(getattr(a, f), getattr(b, f)) for f in FIELDS
    )


@pytest.mark.parametrize("b", [1, 2])
def test_host_basis_checkpoint_resumes_bit_for_bit(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, b: int
) -> None:
    m = dense_matrix(spectrum("indefinite", N, seed=0), seed=1)
    kw: dict[str, Any] = dict(
        k=4, which="SA", seed=5, tol=1e-9, ncv=16, block_size=b, basis_device="cpu"
    )
    _chunk(monkeypatch, 2, N)
    plain = lanczos(Counting(m), **kw)
    assert plain.iterations > 3 * 16
    path = tmp_path / "lz.pt"
    for stop in (plain.iterations // 3, plain.iterations - 3):
        with pytest.raises(KeyboardInterrupt):
            lanczos(Counting(m, stop_at=stop), checkpoint=path, checkpoint_every=5, **kw)
        saved = torch.load(path, weights_only=True)["state"]["products"]
        op = Counting(m)
        resumed = lanczos(op, checkpoint=path, checkpoint_every=5, **kw)
        assert _same(resumed, plain)
        assert op.products == plain.iterations - saved  # only the remaining products
    # a file of a host basis and one of a device basis do not resume each other
    device_kw = {key: v for key, v in kw.items() if key != "basis_device"}
    for writer, reader in ((kw, device_kw), (device_kw, kw)):
        with pytest.raises(KeyboardInterrupt):
            lanczos(Counting(m, stop_at=30), checkpoint=path, checkpoint_every=5, **writer)
        with pytest.raises(ValueError, match="basis_panel"):
            lanczos(Counting(m), checkpoint=path, **reader)
        path.unlink()


def test_host_basis_spectral_density_checkpoint(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    m = dense_matrix(spectrum("indefinite", N, seed=0), seed=1)
    kw: dict[str, Any] = dict(
        num_runs=5, lanczos_steps=20, seed=3, num_grid_points=200, checkpoint_runs=2
    )
    _chunk(monkeypatch, 2, N)
    whole = spectral_density(Counting(m), checkpoint=tmp_path / "w.pt", basis_device="cpu", **kw)
    path = tmp_path / "sd.pt"
    with pytest.raises(KeyboardInterrupt):
        spectral_density(Counting(m, stop_at=50), checkpoint=path, basis_device="cpu", **kw)
    resumed = spectral_density(Counting(m), checkpoint=path, basis_device="cpu", **kw)
    assert torch.equal(resumed.density, whole.density)
    with pytest.raises(ValueError, match="basis_panel"):
        spectral_density(Counting(m), checkpoint=path, **kw)


# (e) sharded vectors on real ranks: gloo, 2 processes, _host_basis_worker.py
LAUNCH_DEADLINE_S = 170


@pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()), reason="needs torch.distributed, gloo"
)
def test_host_basis_on_sharded_vectors_over_gloo(tmp_path: Path) -> None:
    results = launch_ranks(HERE / "_host_basis_worker.py", 2, tmp_path, LAUNCH_DEADLINE_S)
    for rank, res in enumerate(results):
        for name, check in res.items():
            assert "error" not in check, f"rank {rank}, {name}: {check.get('traceback')}"
            assert check["products"] == check["products_ref"], (rank, name)
            assert check["eigenvalues"] <= TOL and check["eigenvectors"] <= TOL, (rank, name)
            assert check["streamed"] and check["peak"] <= check["chunk"], (rank, name)
            assert check.get("converged", True), (rank, name)
    # every rank reports the same eigenvalues (the all-reduced inner products)
    for name in results[0]:
        assert results[0][name]["values"] == results[1][name]["values"]
