"""spectral_density(checkpoint=...) and lanczos(checkpoint=...): an interrupted run resumed
from its file gives the uninterrupted result bit for bit and spends only the remaining
products; files of other arguments, of another algorithm, or truncated are refused."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from hessian_eigenthings.algorithms import EigenResult, lanczos, spectral_density
from hessian_eigenthings.operators.base import LambdaOperator
from tests.algorithms.spectra import dense_matrix, spectrum

N = 60


class Interrupting(LambdaOperator):
    """A dense operator (a diagonal one when ``m`` is 1-D) that raises ``error`` at product
    ``stop_at`` (KeyboardInterrupt: as Ctrl-C would)."""

    def __init__(
        self,
        m: np.ndarray,
        stop_at: int | None = None,
        *,
        dtype: torch.dtype = torch.float64,
        error: type[BaseException] = KeyboardInterrupt,
    ) -> None:
        self.A = torch.as_tensor(m, dtype=dtype)
        self.stop_at = stop_at
        self.error = error
        self.products = 0
        super().__init__(self._vector, m.shape[0], dtype=dtype, matmat_fn=self._rows)

    def _vector(self, v: torch.Tensor) -> torch.Tensor:
        return self._rows(v.unsqueeze(0))[0]

    def _rows(self, V: torch.Tensor) -> torch.Tensor:
        self.products += V.shape[0]
        if self.stop_at is not None and self.products >= self.stop_at:
            raise self.error(f"interrupted at product {self.products}")
        return V * self.A if self.A.dim() == 1 else V @ self.A.T


KW = dict(num_runs=7, lanczos_steps=15, num_grid_points=200, seed=3, checkpoint_runs=2)


def test_resume_is_bit_identical(tmp_path: Path) -> None:
    m = dense_matrix(spectrum("indefinite", N, seed=0), seed=1)
    whole = spectral_density(Interrupting(m), checkpoint=tmp_path / "whole.pt", **KW)  # type: ignore[arg-type]
    path = tmp_path / "run.pt"
    # groups of 2 runs x 15 steps = 30 products; stop inside the third group
    with pytest.raises(KeyboardInterrupt):
        spectral_density(Interrupting(m, stop_at=75), checkpoint=path, **KW)  # type: ignore[arg-type]
    assert path.exists() and not path.with_name(path.name + ".tmp").exists()
    op = Interrupting(m)
    resumed = spectral_density(op, checkpoint=path, **KW)  # type: ignore[arg-type]
    assert op.products == 7 * 15 - 2 * 30  # the two saved groups are not run again
    assert torch.equal(resumed.raw_eigenvalues.nan_to_num(), whole.raw_eigenvalues.nan_to_num())
    assert torch.equal(resumed.raw_weights, whole.raw_weights)
    assert torch.equal(resumed.density, whole.density)
    # a finished checkpoint returns at once, with the same result
    again = Interrupting(m)
    done = spectral_density(again, checkpoint=path, **KW)  # type: ignore[arg-type]
    assert again.products == 0 and torch.equal(done.density, whole.density)
    # the grouping does not change what a checkpointed run computes here (float64, exact rows)
    plain = spectral_density(
        Interrupting(m), **{k: v for k, v in KW.items() if k != "checkpoint_runs"}
    )  # type: ignore[arg-type]
    torch.testing.assert_close(
        plain.raw_eigenvalues.nan_to_num(), whole.raw_eigenvalues.nan_to_num()
    )


def test_checkpoint_of_other_arguments_is_refused(tmp_path: Path) -> None:
    m = dense_matrix(spectrum("separated", N, seed=0), seed=1)
    path = tmp_path / "c.pt"
    spectral_density(Interrupting(m), checkpoint=path, **KW)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"steps: 15 in the file, 16 now"):
        spectral_density(Interrupting(m), checkpoint=path, **{**KW, "lanczos_steps": 16})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="seed"):
        spectral_density(Interrupting(m), checkpoint=path, **{**KW, "seed": 4})  # type: ignore[arg-type]
    (tmp_path / "junk.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(ValueError, match="cannot be read"):
        spectral_density(Interrupting(m), checkpoint=tmp_path / "junk.pt", **KW)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="checkpoint_runs"):
        spectral_density(Interrupting(m), num_runs=2, checkpoint_runs=1)


# ---- lanczos -------------------------------------------------------------------------------

FIELDS = ("eigenvalues", "eigenvectors", "residuals", "converged")


def _same(a: EigenResult, b: EigenResult) -> bool:
    return a.iterations == b.iterations and all(
        torch.equal(getattr(a, f), getattr(b, f)) for f in FIELDS
    )


def _interrupted(op: Interrupting, path: Path, **kw: object) -> None:
    with pytest.raises((KeyboardInterrupt, RuntimeError)):
        lanczos(op, checkpoint=path, **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("which", ["LM", "LA", "SA"])
@pytest.mark.parametrize("warm", [False, True])
def test_lanczos_resume_is_bit_identical(
    tmp_path: Path, dtype: torch.dtype, which: str, warm: bool
) -> None:
    m = dense_matrix(spectrum("indefinite", 150, seed=0), seed=1)
    kw: dict[str, object] = dict(
        k=4, which=which, seed=5, tol=1e-6 if dtype == torch.float64 else 1e-4
    )
    if warm:  # the eigenvectors of a nearby matrix, as along training
        near = m + 1e-4 * dense_matrix(spectrum("separated", 150, seed=0), seed=2)
        kw["v0"] = lanczos(Interrupting(near, dtype=dtype), **kw)  # type: ignore[arg-type]
    plain = lanczos(Interrupting(m, dtype=dtype), **kw)  # type: ignore[arg-type]
    path = tmp_path / "lz.pt"
    whole = lanczos(Interrupting(m, dtype=dtype), checkpoint=path, **kw)  # type: ignore[arg-type]
    assert _same(whole, plain) and whole.eigenvectors.dtype == dtype
    assert not path.exists()  # a finished run deletes its checkpoint
    every = 7
    total = plain.iterations
    for stop in (every + 1, total // 2, total - 4 - 2):
        # an interrupted call saves every 7 products; the resumed one spends the rest only
        # (total counts the 4 products of the residual check after the iteration)
        _interrupted(Interrupting(m, stop, dtype=dtype), path, checkpoint_every=every, **kw)
        assert path.exists() and not path.with_name(path.name + ".tmp").exists()
        op = Interrupting(m, dtype=dtype)
        resumed = lanczos(op, checkpoint=path, checkpoint_every=every, **kw)  # type: ignore[arg-type]
        assert _same(resumed, plain), stop
        assert op.products == total - every * ((stop - 1) // every), stop
        assert not path.exists()
    # the default saves at each thick restart; an operator error interrupts as Ctrl-C does
    _interrupted(Interrupting(m, total - 2, dtype=dtype, error=RuntimeError), path, **kw)
    op = Interrupting(m, dtype=dtype)
    assert _same(lanczos(op, checkpoint=path, **kw), plain)  # type: ignore[arg-type]
    assert op.products < total  # the thick restart before the interruption was saved


@pytest.mark.parametrize(
    "case",
    [
        dict(block_size=3, which="LA"),  # block Lanczos
        dict(reorthogonalize=False, which="SA", tol=1e-6, kind="indefinite"),
        dict(
            large=True, which="LM"
        ),  # vector arithmetic in torch (not the small-operator host path)
    ],
    ids=["block", "local-reorth", "torch-steps"],
)
def test_lanczos_resume_variants(tmp_path: Path, case: dict[str, object]) -> None:
    case = dict(case)
    if case.pop("large", False):
        rng = np.random.default_rng(0)
        m = np.concatenate([[9.0, 8.5, 8.0], rng.uniform(0.0, 7.0, 5000)])
    else:
        m = dense_matrix(spectrum(str(case.pop("kind", "clustered")), 120, seed=0), seed=3)
    kw: dict[str, object] = {"k": 3, "seed": 1, "tol": 1e-8, **case}
    plain = lanczos(Interrupting(m), **kw)  # type: ignore[arg-type]
    path = tmp_path / "lz.pt"
    for stop in (plain.iterations // 3, plain.iterations - 4):
        _interrupted(Interrupting(m, stop), path, checkpoint_every=5, **kw)
        assert _same(lanczos(Interrupting(m), checkpoint=path, **kw), plain)  # type: ignore[arg-type]


def test_lanczos_checkpoint_is_basis_sized_and_atomic(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    n, ncv = 400, 20
    m = dense_matrix(spectrum("indefinite", n, seed=0), seed=1)
    kw: dict[str, object] = dict(k=3, seed=2, tol=1e-10, ncv=ncv)
    plain = lanczos(Interrupting(m), **kw)  # type: ignore[arg-type]
    assert plain.iterations > 2 * ncv
    path = tmp_path / "lz.pt"
    # saving at every step of the first basis: the file stays O(ncv · n), whatever the step
    _interrupted(Interrupting(m, ncv), path, checkpoint_every=1, **kw)
    assert path.stat().st_size < (ncv + 1) * n * 8 + 2**15
    # a save interrupted mid-write leaves the previous checkpoint whole
    real_save = torch.save
    calls = []

    def save_then_die(obj: object, f: object) -> None:
        calls.append(1)
        if len(calls) == 2:
            f.write(b"half a checkpoint")  # type: ignore[attr-defined]
            raise KeyboardInterrupt
        real_save(obj, f)  # type: ignore[arg-type]

    monkeypatch.setattr(torch, "save", save_then_die)
    path.unlink()
    _interrupted(Interrupting(m), path, checkpoint_every=3, **kw)
    monkeypatch.setattr(torch, "save", real_save)
    op = Interrupting(m)
    assert _same(lanczos(op, checkpoint=path, checkpoint_every=3, **kw), plain)  # type: ignore[arg-type]
    assert op.products == plain.iterations - 3  # the first save (3 products) was whole
    assert not path.exists() and not path.with_name(path.name + ".tmp").exists()


def test_lanczos_checkpoint_refusals(tmp_path: Path) -> None:
    m = dense_matrix(spectrum("separated", N, seed=0), seed=1)
    kw: dict[str, object] = dict(k=3, seed=2, tol=1e-10, ncv=10)
    path = tmp_path / "lz.pt"
    _interrupted(Interrupting(m, 25), path, checkpoint_every=2, **kw)
    with pytest.raises(ValueError, match=r"other arguments \(k: 3 in the file, 4 now\)"):
        lanczos(Interrupting(m), checkpoint=path, **{**kw, "k": 4})  # type: ignore[arg-type]
    with pytest.raises(
        ValueError, match=r"which: 'LM' in the file, 'SA' now; seed: 2 in the file, 3"
    ):
        lanczos(Interrupting(m), checkpoint=path, **{**kw, "which": "SA", "seed": 3})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"v0: None in the file, 'sha256:"):
        lanczos(Interrupting(m), checkpoint=path, v0=torch.ones(N, dtype=torch.float64), **kw)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="op_dtype"):
        lanczos(Interrupting(m, dtype=torch.float32), checkpoint=path, **kw)  # type: ignore[arg-type]
    # a truncated file (a copy cut short), junk, and another algorithm's checkpoint
    data = path.read_bytes()
    (tmp_path / "cut.pt").write_bytes(data[: len(data) // 2])
    with pytest.raises(
        ValueError, match=r"cannot be read as a lanczos checkpoint \(truncated or corrupt"
    ):
        lanczos(Interrupting(m), checkpoint=tmp_path / "cut.pt", **kw)  # type: ignore[arg-type]
    (tmp_path / "junk.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(ValueError, match="cannot be read"):
        lanczos(Interrupting(m), checkpoint=tmp_path / "junk.pt", **kw)  # type: ignore[arg-type]
    density = tmp_path / "sd.pt"
    spectral_density(Interrupting(m), checkpoint=density, **KW)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="written by spectral_density, not lanczos"):
        lanczos(Interrupting(m), checkpoint=density, **kw)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="written by lanczos, not spectral_density"):
        spectral_density(Interrupting(m), checkpoint=path, **KW)  # type: ignore[arg-type]
    # the refused file is left as it was, and still resumes
    assert path.read_bytes() == data
    assert lanczos(Interrupting(m), checkpoint=path, **kw).converged.all()  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="checkpoint_every is given without checkpoint="):
        lanczos(Interrupting(m), k=2, checkpoint_every=5)
    with pytest.raises(ValueError, match="checkpoint_every must be an int >= 1"):
        lanczos(Interrupting(m), k=2, checkpoint=path, checkpoint_every=0)
    with pytest.raises(TypeError, match="checkpoint must be a path"):
        lanczos(Interrupting(m), k=2, checkpoint=3)  # type: ignore[arg-type]


def test_lanczos_checkpoint_format_is_stable(tmp_path: Path) -> None:
    """The on-disk layout of a lanczos checkpoint (format 1): files written by earlier versions
    keep loading, so the names, types and shapes below change only with a new format number."""
    n, k, ncv, b = 60, 3, 12, 2
    m = dense_matrix(spectrum("separated", n, seed=0), seed=1)
    path = tmp_path / "lz.pt"
    kw: dict[str, object] = dict(k=k, seed=2, tol=1e-10, ncv=ncv, block_size=b)
    _interrupted(Interrupting(m, 2 * ncv), path, **kw)  # saved at the first thick restart
    payload = torch.load(path, weights_only=True)
    assert list(payload) == [
        "format",
        "algorithm",
        "config",
        "state",
        "generator",
        "generator_device",
    ]
    assert payload["format"] == 1 and payload["algorithm"] == "lanczos"
    assert payload["generator_device"] == "cpu"
    assert list(payload["config"]) == [
        "n", "op_dtype", "work_dtype", "k", "which", "tol", "max_iter", "ncv", "block_size",
        "reorthogonalize", "residuals", "seed", "v0",
    ]  # fmt: skip
    assert payload["config"]["n"] == n and payload["config"]["ncv"] == ncv
    assert payload["config"]["op_dtype"] == "torch.float64" and payload["config"]["v0"] is None
    state = payload["state"]
    assert list(state) == [
        "j", "restart_l", "products", "it", "anorm", "next_check", "last_check",
        "V", "T", "Hf", "lost", "theta", "S", "est", "order",
    ]  # fmt: skip
    for key in ("j", "restart_l", "products", "it", "next_check"):
        assert type(state[key]) is int, key
    assert type(state["anorm"]) is float
    assert isinstance(state["last_check"], list) and len(state["last_check"]) == 2
    rows = state["j"] + b
    assert state["restart_l"] == state["j"] and k <= state["j"] < ncv
    assert state["V"].shape == (rows, n) and state["V"].dtype == torch.float64
    assert state["V"].untyped_storage().nbytes() == rows * n * 8  # not a view of the buffer
    for key in ("T", "Hf"):
        assert state[key].shape == (rows, rows) and state[key].dtype == torch.float64, key
    assert state["lost"].shape == (1,) and state["lost"].dtype == torch.float64
    top = ncv  # the Ritz data of the restart's check: the whole basis
    assert state["theta"].shape == (top,) and state["theta"].dtype == torch.float64
    assert state["S"].shape == (top, top) and state["est"].shape == (top,)
    assert state["order"].shape == (top,) and state["order"].dtype == torch.int64
