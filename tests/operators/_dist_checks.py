"""Running a distributed test worker's checks on one rank and leaving (shared by the workers that
``test_distributed.launch`` starts: each is a script, so this is imported from their folder)."""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist

from hessian_eigenthings import _torch_compat


def run_checks_and_exit(
    checks: dict[str, Callable[[], dict[str, Any]]],
    names: Iterable[str],
    out_dir: str,
    rank: int,
    results: dict[str, Any] | None = None,
) -> None:
    """Run ``names`` of ``checks`` (an exception becomes the check's result), write this rank's
    results to ``out_dir/rank{rank}.json`` and leave the process."""
    results = {} if results is None else results
    for name in names:
        t0 = time.perf_counter()
        try:
            results[name] = checks[name]()
        except Exception as exc:
            results[name] = {
                "error": f"{type(exc).__name__}: {exc}",
                "traceback": traceback.format_exc(),
            }
        results[name]["_seconds"] = time.perf_counter() - t0
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(results, f, indent=1, default=str)
    # NOTE [worker exits without the gloo teardown]: on torch 2.4 a rank sometimes aborted while
    # the gloo process group was torn down after the checks ("terminate called without an active
    # exception", exit -6; every test of the module then errored at its fixture). The results are
    # on disk and the barrier shows every rank wrote its own, so the worker leaves at once,
    # without the teardown that can abort.
    dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_sharded_worker(checks: dict[str, Callable[[], dict[str, Any]]], rank: int) -> None:
    """A worker whose checks shard with FSDP2: warnings as errors (pytest's
    ``filterwarnings=error``), a 60 s gloo timeout instead of a hang, every check run, or none
    (a ``skip``) where FSDP2 does not run on the CPU; results to ``sys.argv[1]``."""
    import datetime
    import warnings

    warnings.simplefilter("error")
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    results: dict[str, Any] = {}
    if not _torch_compat.fsdp2_runs_on_cpu():
        results["skip"] = f"FSDP2 runs on CPU from torch 2.6 (this is torch {torch.__version__})"
    run_checks_and_exit(checks, checks if "skip" not in results else (), sys.argv[1], rank, results)
