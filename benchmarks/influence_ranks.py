"""hessian_eigenthings.influence on several GPUs: EK-FAC factors and pairwise scores of a
Llama-3.2-1B-shaped model, each rank fitting and scoring its shard of the training sequences.

    # issue 40's setting on W GPUs (NCCL):
    torchrun --standalone --nproc-per-node 2 benchmarks/influence_ranks.py --workload llama1b \\
        --n-train 2000 --length 512 --queries 16 --batch 8 --rank 64 --dtype bf16 --out result.json
    # the same on CPU ranks (gloo), a tiny Llama:
    torchrun --standalone --nproc-per-node 2 benchmarks/influence_ranks.py --workload tiny \\
        --device cpu --n-train 8 --length 16 --queries 2 --batch 2 --rank 2 --out tiny.json

Without torchrun the script runs as one process (no process group, ``ranks=None``).

Setting. ``llama1b``: the Llama-3.2-1B shape of ``benchmarks/bench_sharded.py`` (its ``build``:
hidden 2048, 16 layers, 32 heads / 8 key-value heads, MLP 8192, vocab 128256, tied embeddings,
eager attention, HF's initialization under ``torch.manual_seed(0)``, eval mode); ``tiny``: 2
layers, hidden 64, vocab 512 (for tests). Every rank builds the same model and draws the same
random token sequences (``--n-train`` training, ``--queries`` query sequences of ``--length``
tokens); rank ``r`` of ``W`` takes the contiguous shard ``[r·N/W, (r+1)·N/W)`` of the training
sequences in batches of ``--batch``. Each rank then runs
``influence.fit(model, shard, influence.causal_lm_task(), fisher_type="mc",
separate_bias=False, ranks=Replicated())`` (EK-FAC over every untied ``nn.Linear``: the tied
head/embedding is left out, as ``fit``'s default does; the factors of the union of the shards on
every rank, NOTE [influence on several ranks] in ``hessian_eigenthings.influence.scores``) and
``pairwise_scores(queries, shard, rank=--rank)`` (``--rank 0``: exact), its columns of the
``(queries, n_train)`` scores. Monte-Carlo labels are drawn from keys of (seed, rank, batch), so W
ranks draw other labels than one process on the union (the same distribution; with ``--fisher
empirical`` the ranks' scores are one process's on the union, to rounding: the tests check
that). ``--factor-placement by_module``: each factor decomposed on one rank, not on all
(``Replicated(factor_placement=)``). Rank 0 gathers the columns and every rank's figures and writes
the JSON (``--out``; a partial one, ``"complete": false``, once the factors are fitted).

Figures. Two phases, each between two barriers (and a CUDA synchronize): ``fit`` and ``scores``
(the query gradients, their preconditioning and low-rank factors, and the training gradients
streamed against them). The job is both phases (model building and data drawing excluded);
``seconds_per_1000_train`` is the job's wall (and the score phase's alone) divided by
``n_train / 1000``: the time to score 1,000 training sequences against every query on W ranks.
Each rank's CUDA allocator peak per phase (``torch.cuda.max_memory_allocated``, reset at each
boundary; parameters included), each rank's time inside each phase before its closing barrier
(``busy_seconds``: the imbalance), the scored parameter count, the versions. TF32 off.

Memory at the llama1b shape (float32; halve the parameter-sized rows for ``--dtype bf16``, the
Kronecker factors stay float32). 973 M parameters are scored (16 layers × 7 Linear weights), so
one whole query row (a gradient, or ``(C + λI)⁻¹`` of it) is 3.9 GB and 16 exact queries are
62 GB, beside 5.0 GB of float32 weights: ``--rank`` (Kronfluence's low-rank queries, ``r·(m + q)``
numbers per ``m × q`` weight: at rank 64, 45 M numbers for all 16 layers, 0.18 GB a query) is
the default path at this shape, and ``--rank 0`` is for small workloads. The factors ``A`` and ``G``
are ``Σ d_in² + d_out²`` = 3.83 G numbers over the 112 layers (15.3 GB in float32: the
down-projections' 8192² inputs and the gate/up projections' 8192² outputs are 84% of it), the
eigenbases as many (15.3 GB; both are held while the eigenbases are taken, then ``fit`` frees the
factors: NOTE [EK-FAC keeps its eigenbases only]), and EK-FAC's corrected eigenvalues one number a
parameter (3.9 GB): ~19 GB held while scoring, replicated on every rank. Whether
``pairwise_scores`` forms the 16 query rows whole before factoring them (62 GB in float32), and a
training batch's rows whole for the low-rank contraction (8 × 3.9 GB), decides whether the score
phase fits a GPU of 80 GB: the per-phase peaks in the JSON record what a run held.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import resource
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import hessian_eigenthings as he
from benchmarks.bench_sharded import WORKLOADS, build
from benchmarks.leave_group import leave_group
from hessian_eigenthings import influence
from hessian_eigenthings.operators.distributed import Replicated

CONFIGS: dict[str, dict[str, Any]] = {
    "llama1b": {k: v for k, v in WORKLOADS["llama1b"].items() if k not in ("batch", "seq")},
    "tiny": {
        "family": "llama",
        "layers": 2,
        "d": 64,
        "heads": 4,
        "kv": 2,
        "mlp": 128,
        "vocab": 512,
        "tied": True,
    },
}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp64": torch.float64}


def build_model(workload: str, length: int, dtype: torch.dtype, device: torch.device) -> nn.Module:
    """The workload's model, the same on every rank (built on the CPU from ``manual_seed(0)``,
    then moved), in eval mode."""
    model, _ = build({**CONFIGS[workload], "seq": length})
    return model.to(device=device, dtype=dtype).eval()


def sequences(workload: str, n_train: int, queries: int, length: int) -> tuple[Any, Any]:
    """``(train (n_train, length), query (queries, length))`` random token ids, on the CPU, the
    same on every rank."""
    g = torch.Generator().manual_seed(1)
    vocab = CONFIGS[workload]["vocab"]
    train = torch.randint(0, vocab, (n_train, length), generator=g)
    query = torch.randint(0, vocab, (queries, length), generator=g)
    return train, query


def shard_bounds(n: int, world: int) -> list[tuple[int, int]]:
    """Rank ``r``'s contiguous rows ``[r·n/W, (r+1)·n/W)``: sizes differ by at most one."""
    return [(r * n // world, (r + 1) * n // world) for r in range(world)]


def batches(ids: torch.Tensor, size: int) -> list[dict[str, torch.Tensor]]:
    return [{"input_ids": ids[s : s + size]} for s in range(0, len(ids), size)]


class Group:
    """This process's place among the ranks (one process: no group) and the boundary of a phase."""

    def __init__(self, device: torch.device) -> None:
        self.distributed = dist.is_initialized()
        self.rank = dist.get_rank() if self.distributed else 0
        self.world = dist.get_world_size() if self.distributed else 1
        self.device = device

    def boundary(self) -> float:
        """Every rank here, the device's work done: the clock, and a fresh allocator peak."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        if self.distributed:
            dist.barrier()
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        return time.perf_counter()

    def peak(self) -> int | None:
        if self.device.type != "cuda":
            return None
        return int(torch.cuda.max_memory_allocated(self.device))

    def gathered(self, value: Any) -> list[Any]:
        """``value`` of every rank, in rank order."""
        if not self.distributed:
            return [value]
        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, value)
        return out


def host_peak_gib() -> float:
    # ru_maxrss is in KiB on Linux
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def fingerprint(model: nn.Module) -> float:
    """A float64 sum over every parameter: ranks that built different models differ in it."""
    with torch.no_grad():
        return sum(float(p.double().sum()) * (i + 1) for i, p in enumerate(model.parameters()))


def phase(
    group: Group, fn: Callable[[], Any], log: Callable[[str], None], name: str
) -> tuple[Any, dict[str, Any]]:
    """``fn()`` between two boundaries: its result, the wall, this rank's busy time and peak."""
    log(f"{name} ...")
    start = group.boundary()
    out = fn()
    if group.device.type == "cuda":
        torch.cuda.synchronize(group.device)
    busy = time.perf_counter() - start
    peak = group.peak()
    wall = group.boundary() - start
    held = "no CUDA peak" if peak is None else f"peak {peak / 2**30:.2f} GiB"
    log(f"{name}: {wall:.1f} s (rank 0: busy {busy:.1f} s, {held})")
    return out, {"wall": wall, "busy": busy, "peak_bytes": peak}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--workload", choices=sorted(CONFIGS), default="llama1b")
    p.add_argument("--n-train", type=int, default=2000)
    p.add_argument("--length", type=int, default=512, help="tokens a sequence")
    p.add_argument("--queries", type=int, default=16)
    p.add_argument("--batch", type=int, default=8, help="training sequences a batch")
    p.add_argument("--rank", type=int, default=64, help="low-rank queries (0: exact)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    p.add_argument("--fisher", choices=("mc", "empirical"), default="mc")
    p.add_argument(
        "--damping", type=float, default=None, help="default: fit's (0.1 x the mean eigenvalue)"
    )
    p.add_argument(
        "--factor-placement",
        choices=("replicated", "by_module"),
        default="replicated",
        help="Replicated(factor_placement=): every rank decomposes every factor, or each its own",
    )
    p.add_argument("--device", choices=("cuda", "cpu"), default=None)
    p.add_argument("--out", type=Path, default=None)
    a = p.parse_args(argv)
    for name in ("n_train", "length", "queries", "batch"):
        if getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    if a.length < 2:
        p.error("--length must be at least 2 (a causal LM's loss needs a next token)")
    if a.rank < 0:
        p.error("--rank must be >= 0 (0: exact scores)")
    device_type = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device_type == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda, but torch sees no CUDA device")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if a.n_train < world:
        p.error(f"--n-train {a.n_train} leaves a rank of {world} without training sequences")

    t0 = time.perf_counter()
    if device_type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    if "RANK" in os.environ:
        dist.init_process_group(
            "nccl" if device.type == "cuda" else "gloo", timeout=datetime.timedelta(minutes=15)
        )
    group = Group(device)

    def log(msg: str) -> None:
        if group.rank == 0:
            tag = f"influence_ranks {a.workload} W={group.world}"
            print(f"[{tag} +{time.perf_counter() - t0:.0f}s] {msg}", flush=True)

    import transformers

    dtype = DTYPES[a.dtype]
    model = build_model(a.workload, a.length, dtype, device)
    prints = group.gathered(fingerprint(model))
    if len(set(prints)) != 1:
        raise RuntimeError(f"the ranks built different models (parameter sums {prints})")
    train, query = sequences(a.workload, a.n_train, a.queries, a.length)
    bounds = shard_bounds(a.n_train, group.world)
    start, stop = bounds[group.rank]
    shard = batches(train[start:stop].to(device), a.batch)
    query_batches = [{"input_ids": query.to(device)}]
    built = time.perf_counter() - t0
    log(f"model and data ready in {built:.1f} s; this rank's sequences [{start}, {stop})")

    ranks = (
        Replicated(device=device, factor_placement=a.factor_placement)
        if group.distributed
        else None
    )
    fitted, fit_row = phase(
        group,
        lambda: influence.fit(
            model,
            shard,
            influence.causal_lm_task(),
            damping=a.damping,
            fisher_type=a.fisher,
            separate_bias=False,
            ranks=ranks,
        ),
        log,
        "fit",
    )
    report: dict[str, Any] = {
        "workload": a.workload,
        "config": CONFIGS[a.workload],
        "setting": {k: v for k, v in vars(a).items() if k != "out"},
        "world_size": group.world,
        "backend": dist.get_backend() if group.distributed else None,
        "versions": {
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "hessian_eigenthings": he.__version__,
            "python": platform.python_version(),
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "cuda": torch.version.cuda,
            "tf32": bool(torch.backends.cuda.matmul.allow_tf32),
        },
        "parameters_total": sum(p.numel() for p in model.parameters()),
        "parameters_scored": fitted.layout.size,
        "excluded_parameters": list(fitted.excluded_parameters),
        "damping": fitted.damping,
        "fisher_type": fitted.fisher_type,
        "shards": bounds,
        "build_seconds": built,
        "complete": False,
    }
    fit_rows = group.gathered(fit_row)
    report["fit"] = ranks_row(fit_rows)
    write(report, a.out, group)

    scores, score_row = phase(
        group,
        lambda: fitted.pairwise_scores(
            query_batches,
            shard,
            rank=a.rank or None,
            progress=None if group.rank == 0 else False,
        ),
        log,
        "scores",
    )
    mine = {"row": score_row, "scores": scores.double().cpu().tolist(), "host": host_peak_gib()}
    everyone = group.gathered(mine)
    # every rank's columns in rank order: the training sequences' order
    whole = torch.cat([torch.tensor(r["scores"], dtype=torch.float64) for r in everyone], dim=1)
    job = report["fit"]["seconds"] + everyone[0]["row"]["wall"]
    report.update(
        scores_phase=ranks_row([r["row"] for r in everyone]),
        job_seconds=job,
        seconds_per_1000_train={
            "job": job / a.n_train * 1000,
            "scores": everyone[0]["row"]["wall"] / a.n_train * 1000,
        },
        host_peak_gib_ranks=[r["host"] for r in everyone],
        scores_shape=list(whole.shape),
        scores=whole.tolist(),
        complete=True,
    )
    report["peak_bytes_max"] = max(
        (b for b in report["fit"]["peak_bytes"] + report["scores_phase"]["peak_bytes"] if b),
        default=None,
    )
    log(
        f"{a.n_train} training sequences scored against {a.queries} queries: job {job:.1f} s, "
        f"{report['seconds_per_1000_train']['job']:.1f} s per 1,000 training sequences"
    )
    write(report, a.out, group)
    if group.distributed:
        leave_group()  # the JSON is on disk


def ranks_row(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """A phase's figures: rank 0's wall (the barriers make it every rank's), each rank's busy
    time and peak."""
    return {
        "seconds": rows[0]["wall"],
        "busy_seconds": [r["busy"] for r in rows],
        "peak_bytes": [r["peak_bytes"] for r in rows],
    }


def write(report: dict[str, Any], out: Path | None, group: Group) -> None:
    if group.rank != 0:
        return
    text = json.dumps(report, indent=1)
    if out is None:
        if report["complete"]:
            print(json.dumps({k: v for k, v in report.items() if k != "scores"}, indent=1))
        return
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(out)  # a reader never sees half a file


if __name__ == "__main__":
    main()
