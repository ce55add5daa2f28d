"""spectral_density(checkpoint=...): an interrupted run resumed from its file gives the
uninterrupted result bit for bit and spends only the remaining products."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from hessian_eigenthings.algorithms import spectral_density
from hessian_eigenthings.operators.base import LambdaOperator
from tests.algorithms.spectra import dense_matrix, spectrum

N = 60


class Interrupting(LambdaOperator):
    """A dense operator that raises KeyboardInterrupt at product ``stop_at`` (as Ctrl-C would)."""

    def __init__(self, m: np.ndarray, stop_at: int | None = None) -> None:
        self.A = torch.as_tensor(m)
        self.stop_at = stop_at
        self.products = 0
        super().__init__(self._vector, m.shape[0], dtype=torch.float64, matmat_fn=self._rows)

    def _vector(self, v: torch.Tensor) -> torch.Tensor:
        return self._rows(v.unsqueeze(0))[0]

    def _rows(self, V: torch.Tensor) -> torch.Tensor:
        self.products += V.shape[0]
        if self.stop_at is not None and self.products >= self.stop_at:
            raise KeyboardInterrupt
        return V @ self.A.T


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
    plain = spectral_density(Interrupting(m), **{k: v for k, v in KW.items() if k != "checkpoint_runs"})  # type: ignore[arg-type]
    torch.testing.assert_close(plain.raw_eigenvalues.nan_to_num(), whole.raw_eigenvalues.nan_to_num())


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
