"""Checkpoints of sharded runs (NOTE [checkpoints of sharded runs]): each rank resumes from its
own file, bit for bit; a file of another rank, of another rank count or of one process is refused
in one line naming both. Ranks are threads (``test_sharded._on_ranks``); the same on gloo ranks:
``tests/operators/test_distributed.py``, ``sharded_checkpoint_refusals``."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from hessian_eigenthings.algorithms import lanczos, spectral_density
from tests.algorithms.spectra import dense_matrix, spectrum
from tests.algorithms.test_sharded import _on_ranks


class _Interrupted(Exception):
    pass


def _stopping_at(op: Any, stop: int) -> None:
    """``op`` raises at its product ``stop`` (a block of ``b`` counts ``b``). Every rank makes the
    same products, so all stop at once, as a job killed on every node."""
    count = {"n": 0}
    matmat = op.matmat

    def counted(V: torch.Tensor) -> torch.Tensor:
        count["n"] += V.shape[1]
        if count["n"] >= stop:
            raise _Interrupted(f"product {count['n']}")
        return matmat(V)

    op.matmat = counted
    op.matvec = lambda v: counted(v.unsqueeze(1))[:, 0]


LANCZOS = dict(k=3, seed=2, tol=1e-10, ncv=8)
DENSITY = dict(num_runs=4, lanczos_steps=10, num_grid_points=50, seed=3, checkpoint_runs=2)


def _lanczos(op: Any, be: Any, path: Path) -> Any:
    return lanczos(op, backend=be, checkpoint=path, checkpoint_every=4, **LANCZOS)  # type: ignore[arg-type]


def _density(op: Any, be: Any, path: Path) -> Any:
    return spectral_density(op, backend=be, checkpoint=path, **DENSITY)  # type: ignore[arg-type]


RUNS: dict[str, tuple[Callable[[Any, Any, Path], Any], int]] = {
    # (the call, a product in its second save interval / second group of runs)
    "lanczos": (_lanczos, 10),
    "spectral_density": (_density, 25),
}


def _interrupted(m: np.ndarray, shards: list[int], folder: Path, name: str) -> list[Path]:
    """Files ``folder/r{rank}.pt`` of a run of ``name`` on ``shards`` stopped on every rank."""
    call, stop = RUNS[name]
    folder.mkdir()

    def run(op: Any, be: Any) -> None:
        _stopping_at(op, stop)
        with pytest.raises(_Interrupted):
            call(op, be, folder / f"r{be.rank}.pt")

    _on_ranks(m, shards, run)
    files = [folder / f"r{r}.pt" for r in range(len(shards))]
    assert all(f.exists() for f in files)
    return files


def _refusals(m: np.ndarray, shards: list[int], files: list[Path], name: str) -> list[str]:
    """What each rank of ``shards`` says resuming ``name`` from ``files[rank]``."""
    call, _ = RUNS[name]

    def run(op: Any, be: Any) -> str:
        with pytest.raises(ValueError) as info:
            call(op, be, files[be.rank])
        return str(info.value)

    return _on_ranks(m, shards, run)


@pytest.fixture(scope="module")
def matrix() -> np.ndarray:
    return dense_matrix(spectrum("separated", 12, seed=4), seed=4)


@pytest.mark.parametrize("name", list(RUNS))
def test_each_rank_resumes_its_own_file_bit_for_bit(
    matrix: np.ndarray, tmp_path: Path, name: str
) -> None:
    call, _ = RUNS[name]
    # the uninterrupted run saves too: saving must not change what it computes
    whole = _on_ranks(matrix, [6, 6], lambda op, be: call(op, be, tmp_path / f"w{be.rank}.pt"))
    files = _interrupted(matrix, [6, 6], tmp_path / "files", name)
    resumed = _on_ranks(matrix, [6, 6], lambda op, be: call(op, be, files[be.rank]))
    for a, b in zip(resumed, whole, strict=True):
        if name == "lanczos":
            assert a.iterations == b.iterations
            assert torch.equal(a.eigenvalues, b.eigenvalues)
            assert torch.equal(a.eigenvectors, b.eigenvectors)  # this rank's pieces
        else:
            assert torch.equal(a.density, b.density)
            assert torch.equal(a.raw_weights, b.raw_weights)


@pytest.mark.parametrize("name", list(RUNS))
def test_another_ranks_file_is_refused(matrix: np.ndarray, tmp_path: Path, name: str) -> None:
    """Equal shards: the pieces have the same length, so only the recorded rank tells the files
    apart (and the generators in them differ: NOTE [checkpoints of sharded runs])."""
    files = _interrupted(matrix, [6, 6], tmp_path / "files", name)
    said = _refusals(matrix, [6, 6], files[::-1], name)
    for rank, msg in enumerate(said):
        other = 1 - rank
        assert f"was written by rank {other} of 2, this is rank {rank} of 2" in msg, msg
        assert "each rank from its own file" in msg and "\n" not in msg


@pytest.mark.parametrize("name", list(RUNS))
def test_a_file_of_another_rank_count_is_refused(
    matrix: np.ndarray, tmp_path: Path, name: str
) -> None:
    three = _interrupted(matrix, [4, 4, 4], tmp_path / "three", name)
    for rank, msg in enumerate(_refusals(matrix, [6, 6], three, name)):
        assert f"written by rank {rank} of 3, this is rank {rank} of 2" in msg, msg
    # one process against ranks, both ways
    call, stop = RUNS[name]
    single = tmp_path / "single.pt"
    op = _on_ranks(matrix, [12], lambda op, be: op)[0]  # the whole matrix, one "rank"
    _stopping_at(op, stop)
    with pytest.raises(_Interrupted):
        call(op, None, single)
    for msg in _refusals(matrix, [6, 6], [single, single], name):
        assert "written by one process (no rank recorded), this is rank" in msg, msg
    two = _interrupted(matrix, [6, 6], tmp_path / "two", name)
    op = _on_ranks(matrix, [12], lambda op, be: op)[0]
    with pytest.raises(ValueError, match=r"written by rank 0 of 2, this is one process"):
        call(op, None, two[0])
