"""Checkpoint files of the resumable algorithms (``spectral_density``, ``lanczos``).

One file holds what an algorithm needs to continue (its ``state``), the arguments of the
call that wrote it (``config``) and the state of its random generator. See NOTE
[checkpoint files].
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "checkpoint_path",
    "load_checkpoint",
    "rank_entries",
    "remove_checkpoint",
    "save_checkpoint",
]

_FORMAT = 1

# NOTE [checkpoint files]
# A checkpoint is written with torch.save to `<file>.tmp`, flushed to disk (fsync), then moved
# over `<file>` with os.replace, which is atomic on POSIX and Windows: an interruption while
# writing (Ctrl-C, a killed job) leaves the previous checkpoint whole, at worst beside a stale
# `.tmp` that the next save overwrites. Reading uses torch.load(weights_only=True): only
# tensors and plain Python values, never arbitrary pickled objects. A file is refused, with a
# ValueError that says why, when it cannot be read (truncated or corrupt), was written by
# another algorithm, or by a call with other arguments (each differing argument named, with
# both values): resuming under other arguments would silently give another answer than
# either call. Results are bit for bit those of an uninterrupted call on the same device and
# versions (torch, BLAS, thread count); a checkpoint belongs to one operator, which the file
# cannot check beyond its size and dtype.

# NOTE [checkpoints of sharded runs]
# On sharded vectors each rank saves its own file: its piece of every basis vector, and its
# generator, which draws this rank's pieces of the probes from a stream of its own (seed +
# 1_000_003 · rank, `make_generator`). Another rank's file has pieces of another length (or,
# with equal shards, of other entries) and, worse, that rank's generator: resumed, two ranks
# would draw identical pieces from then on, a silently wrong probe distribution (SLQ's file
# holds only global numbers besides it, so nothing else would catch that). A file of another
# rank count cuts the vectors elsewhere. So a sharded call records its rank and world size
# (`rank_entries`) and a file is refused, in one line naming both, unless it was written by
# the same rank of as many ranks; one process records nothing (its files are as before), and
# a replicated (DDP) run has whole vectors and one stream on every rank, so its ranks'
# files are interchangeable.


def rank_entries(backend: Any) -> dict[str, int]:
    """``{"rank", "world_size"}`` of a sharded ``backend`` for a checkpoint's config; empty on
    one process or replicated vectors (NOTE [checkpoints of sharded runs])."""
    world = int(getattr(backend, "world_size", 1))
    if world <= 1:
        return {}
    return {"rank": int(getattr(backend, "rank", 0)), "world_size": world}


def _ranks_of(config: dict[str, Any]) -> str:
    if config.get("world_size") is None:
        return "one process (no rank recorded)"
    return f"rank {config.get('rank')} of {config['world_size']}"


def checkpoint_path(checkpoint: str | os.PathLike[str] | None) -> Path | None:
    if checkpoint is None:
        return None
    if not isinstance(checkpoint, (str, os.PathLike)):
        raise TypeError(
            f"checkpoint must be a path (str or os.PathLike), got {type(checkpoint).__name__}"
        )
    return Path(checkpoint)


def _tmp(path: Path) -> Path:
    return path.with_name(path.name + ".tmp")


def save_checkpoint(
    path: Path, algorithm: str, config: dict[str, Any], state: dict[str, Any], gen: torch.Generator
) -> None:
    """Write ``state`` atomically (NOTE [checkpoint files]). Tensors in ``state`` must not be
    views of larger buffers: torch.save writes a view's whole storage."""
    payload = {
        "format": _FORMAT,
        "algorithm": algorithm,
        "config": config,
        "state": state,
        "generator": gen.get_state(),
        "generator_device": str(gen.device),
    }
    tmp = _tmp(path)
    with open(tmp, "wb") as f:
        torch.save(payload, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def load_checkpoint(
    path: Path, algorithm: str, config: dict[str, Any], gen: torch.Generator
) -> dict[str, Any]:
    """The ``state`` saved in ``path``; ``gen`` is set to the saved generator state. Raises
    ``ValueError`` for a file that is unreadable, of another algorithm or of other arguments."""
    where = f"checkpoint {str(path)!r}"
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise ValueError(
            f"{where} cannot be read as a {algorithm} checkpoint (truncated or corrupt?): {exc}; "
            "remove it to start afresh"
        ) from exc
    keys = ("format", "algorithm", "config", "state", "generator", "generator_device")
    if not isinstance(payload, dict) or any(key not in payload for key in keys):
        raise ValueError(f"{where} is not a {algorithm} checkpoint; remove it or pass another file")
    if payload["format"] != _FORMAT:
        raise ValueError(
            f"{where} has format {payload['format']!r}, this version reads format {_FORMAT}; "
            "remove it to start afresh"
        )
    if payload["algorithm"] != algorithm:
        raise ValueError(
            f"{where} was written by {payload['algorithm']}, not {algorithm}; pass another file"
        )
    saved = payload["config"]
    if not isinstance(saved, dict):
        raise ValueError(f"{where} is not a {algorithm} checkpoint; remove it or pass another file")
    written, now = _ranks_of(saved), _ranks_of(config)
    if written != now:  # NOTE [checkpoints of sharded runs]
        raise ValueError(
            f"{where} was written by {written}, this is {now}: resume on as many ranks as "
            "wrote it, each rank from its own file"
        )
    diff = [
        f"{key}: {saved.get(key)!r} in the file, {value!r} now"
        for key, value in config.items()
        if saved.get(key) != value
    ]
    # an argument that only some calls record (None when absent): the file's, not this call's
    diff += [
        f"{key}: {value!r} in the file, None now"
        for key, value in saved.items()
        if key not in config and value is not None
    ]
    if diff:
        raise ValueError(
            f"{where} was written by a call with other arguments ({'; '.join(diff)}); "
            "pass the same arguments to resume, or another file to start afresh"
        )
    if payload["generator_device"] != str(gen.device):
        raise ValueError(
            f"{where} was written with a generator on {payload['generator_device']}, "
            f"this call's is on {gen.device}: resume on the same device"
        )
    gen.set_state(payload["generator"])
    state = payload["state"]
    if not isinstance(state, dict):
        raise ValueError(f"{where} is not a {algorithm} checkpoint; remove it or pass another file")
    return state


def remove_checkpoint(path: Path) -> None:
    """Delete ``path`` and a stale temporary beside it."""
    path.unlink(missing_ok=True)
    _tmp(path).unlink(missing_ok=True)
