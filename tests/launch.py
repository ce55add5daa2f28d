"""Run a worker script on several gloo ranks in subprocesses (the tests' distributed launcher).

``launch(world, out, argv)`` starts ``python *argv`` once per rank with RANK, WORLD_SIZE,
MASTER_ADDR and MASTER_PORT set (logs in ``out/log{r}.txt``), fails the test at the deadline
naming a rank that hangs, relaunches the group once after a native crash, and asserts every
rank exited 0. ``launch_ranks(script, world, out)`` runs ``script out`` so and returns what each
rank wrote to ``out/rank{r}.json``.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[1]
LAUNCH_DEADLINE_S = 170


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# A rank of the CPU/gloo group once died of heap corruption in the C++ runtime ("malloc():
# unaligned tcache chunk detected", no Python traceback, its results never written) while two
# tox environments ran beside the suite on the 2-core machine; six more launches of the same
# worker passed, and so did the suite before and after. Such a native crash (and only that)
# relaunches the group once; a second one, or any Python error, fails as before.
NATIVE_CRASH = (
    "malloc(): ",
    "double free",
    "corrupted ",
    "Segmentation fault",
    "Fatal Python error",
)


def launch(
    world: int, out: Path, argv: list[str], deadline: float = LAUNCH_DEADLINE_S
) -> list[subprocess.CompletedProcess[str]]:
    """Start ``world`` ranks of ``argv`` (a script and its arguments); kill them all at the
    deadline; relaunch once after a native crash (above)."""
    results = _launch_once(world, out, argv, deadline)
    crashed = any(r.returncode != 0 and any(m in r.stdout for m in NATIVE_CRASH) for r in results)
    if crashed:
        for rank in range(world):
            (out / f"rank{rank}.json").unlink(missing_ok=True)
        results = _launch_once(world, out, argv, deadline)
    for rank, r in enumerate(results):
        assert r.returncode == 0, f"rank {rank} exited with {r.returncode}:\n{r.stdout[-4000:]}"
    return results


def _launch_once(
    world: int, out: Path, argv: list[str], deadline: float
) -> list[subprocess.CompletedProcess[str]]:
    port = free_port()
    procs = []
    for rank in range(world):
        env = dict(
            os.environ,
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE=str(world),
            LOCAL_WORLD_SIZE=str(world),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            OMP_NUM_THREADS="1",
            PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
        )
        log = open(out / f"log{rank}.txt", "w")  # noqa: SIM115 -- closed below
        procs.append(
            (
                subprocess.Popen(
                    [sys.executable, *argv],
                    env=env,
                    cwd=REPO,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    text=True,
                ),
                log,
            )
        )
    results = []
    try:
        for rank, (p, _log) in enumerate(procs):
            try:
                p.wait(timeout=deadline)
            except subprocess.TimeoutExpired:
                pytest.fail(f"rank {rank} of {world} still running after {deadline} s (a hang?)")
            results.append(
                subprocess.CompletedProcess(
                    argv, p.returncode, (out / f"log{rank}.txt").read_text(), ""
                )
            )
    finally:
        for p, log in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
            log.close()
    return results


def launch_ranks(
    script: Path, world: int, out: Path, deadline: float = LAUNCH_DEADLINE_S
) -> list[dict[str, Any]]:
    """``script out`` on ``world`` ranks (:func:`launch`); what each rank wrote
    (``out/rank{r}.json``)."""
    try:
        launch(world, out, [str(script), str(out)], deadline)
    except AssertionError as exc:  # say whether the failing rank got as far as its results
        wrote = [r for r in range(world) if (out / f"rank{r}.json").exists()]
        raise AssertionError(f"{exc}\n(ranks that wrote their results: {wrote})") from None
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]
