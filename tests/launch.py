"""Run a worker script on several gloo ranks in subprocesses (the tests' distributed launcher).

``launch_ranks(script, world, out)`` starts ``python script out`` once per rank with RANK,
WORLD_SIZE, MASTER_ADDR and MASTER_PORT set, waits for every rank (a hang fails the test after
``deadline`` seconds, naming the rank), asserts each exited 0 (its log's tail in the message),
and returns each rank's ``out/rank{r}.json``.
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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def launch_ranks(
    script: Path, world: int, out: Path, deadline: float = 300.0
) -> list[dict[str, Any]]:
    port = free_port()
    procs = []
    for rank in range(world):
        env = dict(
            os.environ,
            RANK=str(rank),
            WORLD_SIZE=str(world),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            OMP_NUM_THREADS="1",
            PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
        )
        log = open(out / f"log{rank}.txt", "w")  # noqa: SIM115 -- closed below
        worker = [sys.executable, str(script), str(out)]
        procs.append((subprocess.Popen(worker, env=env, cwd=REPO, stdout=log, stderr=log), log))
    try:
        for rank, (p, _) in enumerate(procs):
            try:
                code = p.wait(timeout=deadline)
            except subprocess.TimeoutExpired:
                pytest.fail(f"rank {rank} still running after {deadline} s (a hang?)")
            text = (out / f"log{rank}.txt").read_text()
            assert code == 0, f"rank {rank} exited with {code}:\n{text[-4000:]}"
    finally:
        for p, log in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
            log.close()
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]
