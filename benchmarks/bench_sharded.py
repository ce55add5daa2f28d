"""Exact curvature products on FSDP2-sharded LMs, and the layer walk on one GPU.

Two ways to launch (the same file):

    # W ranks, FSDP2 (NCCL on GPUs, gloo with --tiny):
    torchrun --standalone --nproc_per_node=2 benchmarks/bench_sharded.py --workload gpt2_6l --out DIR
    # one process, one device: the whole-graph product (or its out-of-memory) and the layer walk
    python benchmarks/bench_sharded.py --workload llama1b --out DIR

Workloads (HF transformers, eager attention, random weights, no dropout, fp32):

- ``gpt2_6l``: GPT-2 6L d512, vocab 50257, 8 x 256 tokens (ANCHORS.md);
- ``gpt2_12l``: GPT-2 12L d768 (124 M), 4 x 512 tokens;
- ``llama1b``: the Llama-3.2-1B shape (d 2048, 16 layers, 32 heads / 8 key-value heads, MLP 8192,
  vocab 128256, tied embeddings; 1.24 B parameters), 8 x 1024 tokens;
- ``llama8b``: the Llama-3-8B shape (d 4096, 32 layers, 32 heads / 8 key-value heads, MLP 14336,
  vocab 128256, embeddings not tied; 8.03 B parameters), 4 x 1024 tokens; always built with
  ``--meta``.

``--meta``: the model is built on the meta device, ``fully_shard`` per block and at the root, then
materialized shard by shard (``to_empty`` and a seeded initialization of each rank's rows: NOTE
[seeded materialization]); the same weights on any number of ranks, and in the unsharded twin that
the ``reference`` and ``ddp`` sections use. The direction of the ``products`` section is drawn the
same way. Without it, the model is HF's initialization under ``torch.manual_seed(0)``, built whole
on every rank (what the earlier sessions measured).

Sections (``--sections``, comma list):

- ``products``: ``FSDPHessianOperator(engine="layers")`` and ``FSDPGGNOperator`` products on each
  rank's shard of the batch: median time, per-GPU peak (max over ranks, parameters included);
  ``--prefetch both`` times each also without the walk's prefetched gathers (NOTE [prefetched
  gathers]; rows ``fsdp_<op>_no_prefetch``, with whether the products are the same bits);
- ``train``: an FSDP2 training step (forward + backward) on the same shards, and each product's
  ratio to it;
- ``reference``: the single-GPU default product on the whole batch on every rank (the model
  unsharded), its time and peak, and each sharded product's error against it (max abs / max abs);
- ``lanczos``: top-``k`` lanczos at ``--tol`` on the sharded operators (and, with ``reference``,
  on the single-GPU ones): products, seconds, converged pairs, eigenvalues;
- ``ddp``: weak scaling of ``DDPHessianOperator``/``DDPGGNOperator`` with a fixed per-rank batch
  (half the workload's batch): W = 1 (rank 0 alone, a one-rank group) against W ranks;
- ``top_hessian``: the largest Hessian eigenvalue (lanczos ``k=1``, ``which="LA"``, ``--tol``,
  basis size ``--top-ncv``);
- ``slq``: the Hessian's spectral density by stochastic Lanczos quadrature (``--probes`` x
  ``--slq-steps``), its quadrature in the JSON, the density in ``..._slq.pt`` and a figure in
  ``..._slq.png``;
- ``weights``: every parameter and buffer gathered whole to rank 0 and saved (``weights_w<W>.pt``;
  small models, for the tests);
- single process only: ``whole`` (the default exact product on one device, out-of-memory
  recorded) and ``walk`` (``engine="layers"`` on one device).

Every section records each GPU's peak (``peak_gib``: the largest over the ranks;
``peak_gib_ranks``: each rank's) and each process's host peak so far (``host_peak_gib_ranks``).
``--basis-device cpu`` keeps the Krylov basis of every lanczos and SLQ call in host memory.

Runs longer than one command (NOTE [runs across commands]): ``--checkpoint-dir`` makes lanczos
and SLQ resumable (one file per rank and call) and keeps each finished section's row, so the same
command run again skips what is done and resumes what is not; ``--deadline-s`` stops the run
cleanly at the first saved point after that many seconds (``--max-products``: after that many
products of one call), writing the JSON with ``"complete": false``.

Writes ``bench_sharded_<workload>_<mode>.json`` to ``--out`` (rank 0).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import datetime
import functools
import gc
import hashlib
import json
import math
import os
import resource
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import hessian_eigenthings as he
from benchmarks.leave_group import leave_group
from hessian_eigenthings.loss_fns import supervised_loss_of_output
from hessian_eigenthings.operators.distributed import (
    DDPGGNOperator,
    DDPHessianOperator,
    FSDPGGNOperator,
    FSDPHessianOperator,
)

# (layers, width, heads, kv heads, mlp, vocab, sequences, tokens)
WORKLOADS: dict[str, dict[str, Any]] = {
    "gpt2_6l": {
        "family": "gpt2",
        "layers": 6,
        "d": 512,
        "heads": 8,
        "vocab": 50257,
        "batch": 8,
        "seq": 256,
    },
    "gpt2_12l": {
        "family": "gpt2",
        "layers": 12,
        "d": 768,
        "heads": 12,
        "vocab": 50257,
        "batch": 4,
        "seq": 512,
    },
    "llama1b": {
        "family": "llama",
        "layers": 16,
        "d": 2048,
        "heads": 32,
        "kv": 8,
        "mlp": 8192,
        "vocab": 128256,
        "tied": True,
        "batch": 8,
        "seq": 1024,
    },
    "llama8b": {
        "family": "llama",
        "layers": 32,
        "d": 4096,
        "heads": 32,
        "kv": 8,
        "mlp": 14336,
        "vocab": 128256,
        "tied": False,
        "batch": 4,
        "seq": 1024,
        "meta": True,
    },
}
TINY: dict[str, dict[str, Any]] = {
    "gpt2": {
        "family": "gpt2",
        "layers": 2,
        "d": 32,
        "heads": 2,
        "vocab": 101,
        "batch": 4,
        "seq": 16,
    },
    "llama": {
        "family": "llama",
        "layers": 2,
        "d": 32,
        "heads": 4,
        "kv": 2,
        "mlp": 64,
        "vocab": 101,
        "tied": True,
        "batch": 4,
        "seq": 16,
    },
}


def build(cfg: dict[str, Any]) -> tuple[nn.Module, str]:
    """A randomly initialised HF causal LM (eager attention, eval mode) and its blocks' path."""
    import transformers

    torch.manual_seed(0)
    if cfg["family"] == "gpt2":
        c = transformers.GPT2Config(
            n_layer=cfg["layers"],
            n_embd=cfg["d"],
            n_head=cfg["heads"],
            vocab_size=cfg["vocab"],
            n_positions=max(cfg["seq"], 256),
            attn_pdrop=0.0,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            bos_token_id=0,
            eos_token_id=0,
        )
        model = transformers.GPT2LMHeadModel._from_config(c, attn_implementation="eager")
        return model.eval(), "transformer.h"
    c = transformers.LlamaConfig(
        num_hidden_layers=cfg["layers"],
        hidden_size=cfg["d"],
        intermediate_size=cfg["mlp"],
        num_attention_heads=cfg["heads"],
        num_key_value_heads=cfg["kv"],
        vocab_size=cfg["vocab"],
        max_position_embeddings=max(cfg["seq"], 256),
        tie_word_embeddings=cfg.get("tied", True),
        rope_theta=500000.0,
    )
    model = transformers.LlamaForCausalLM._from_config(c, attn_implementation="eager")
    return model.eval(), "model.layers"


# NOTE [seeded materialization]
# A model of 8 B parameters is not built whole on every rank (32 GB of host memory and minutes of
# initialization per rank): it is built on the meta device (shapes only), `fully_shard` per block
# and at the root as FSDP2 users do, and each rank then allocates its shards (`to_empty`) and
# fills them. HF's initialization draws the whole tensors from one generator in module order,
# which a rank holding rows [a, b) of a parameter cannot reproduce without drawing everything.
# So the weights are drawn by row blocks instead: the rows of parameter `name` are cut into
# blocks of `INIT_BLOCK_NUMBERS` numbers (whole rows, at least one), block `i` is drawn from a
# generator seeded with a hash of (seed, name, i), and a rank draws the blocks that meet its
# rows and keeps its rows of them. A weight is then a function of (seed, name, row) alone: the
# same on 1, 2 or W ranks, in the unsharded twin (`build_eager_seeded`, every row of every
# block) and in every run. FSDP2 cuts dim 0 as `torch.chunk` does (rank r holds rows
# [r·c, min((r + 1)·c, rows)), c = ceil(rows / W)); a rank draws at most two blocks a parameter
# beyond its own rows. Matrices and embeddings are N(0, 0.02²) as HF's default (GPT-2's
# residual projections N(0, (0.02 / sqrt(2 · layers))²), as HF's GPT-2), norm scales 1 and
# biases 0. Numbers are drawn on the compute device (`gen_device`): CPU and CUDA generators
# differ, so a CPU run and a GPU run of the same seed have other weights (each reproducible).
# Buffers are not parameters: `to_empty` leaves them uninitialized, and HF's rotary tables are
# recomputed by building their module again from its config (`rebuild_buffers`).

#: numbers per block of the seeded initialization: See NOTE [seeded materialization]
INIT_BLOCK_NUMBERS = 2**22
INIT_STD = 0.02


def _block_seed(seed: int, name: str, block: int) -> int:
    digest = hashlib.sha256(f"{seed}/{name}/{block}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1  # a non-negative int64


def init_std(name: str, shape: torch.Size, cfg: dict[str, Any]) -> float | None:
    """The standard deviation of parameter ``name``'s draw; ``None`` for a constant (norm scales
    1, biases 0). See NOTE [seeded materialization]."""
    if len(shape) < 2:
        return None
    if cfg["family"] == "gpt2" and name.endswith("c_proj.weight"):
        return INIT_STD / math.sqrt(2 * cfg["layers"])
    return INIT_STD


def shard_rows(p: torch.Tensor) -> tuple[torch.Tensor, int]:
    """This rank's rows of ``p`` (a tensor that writes through to it) and the first row's index:
    an FSDP2 parameter's local shard (dim 0 cut as by ``torch.chunk``), or all of a plain one."""
    from torch.distributed.tensor import DTensor

    if not isinstance(p, DTensor):
        return p.data, 0
    local = p.to_local()
    rank, world = p.device_mesh.get_local_rank(), p.device_mesh.size()
    chunk = -(-p.shape[0] // world)
    first = min(rank * chunk, p.shape[0])
    assert local.shape[0] == max(0, min(chunk, p.shape[0] - first)), (local.shape, p.shape)
    return local, first


def fill_rows(
    local: torch.Tensor,
    shape: torch.Size,
    first: int,
    *,
    seed: int,
    name: str,
    std: float,
    gen_device: torch.device,
) -> None:
    """Write rows ``[first, first + len(local))`` of the seeded draw of a ``shape`` tensor into
    ``local``: See NOTE [seeded materialization]."""
    rows = shape[0]
    width = math.prod(shape[1:])
    per = max(1, INIT_BLOCK_NUMBERS // max(width, 1))
    lo, hi = first, first + local.shape[0]
    if hi <= lo:  # a rank past the last row holds none of this parameter
        return
    flat = local.view(local.shape[0], width)
    for block in range(lo // per, -(-hi // per)):
        a, z = block * per, min((block + 1) * per, rows)
        gen = torch.Generator(device=gen_device).manual_seed(_block_seed(seed, name, block))
        draw = torch.randn(z - a, width, generator=gen, device=gen_device, dtype=local.dtype)
        s, e = max(a, lo), min(z, hi)
        flat[s - lo : e - lo].copy_(draw[s - a : e - a].mul_(std))


@torch.no_grad()
def seeded_init(model: nn.Module, cfg: dict[str, Any], seed: int, gen_device: torch.device) -> None:
    """Every parameter of ``model`` (sharded or whole) set to the seeded initialization."""
    for name, p in model.named_parameters():
        local, first = shard_rows(p)
        std = init_std(name, p.shape, cfg)
        if std is None:
            local.fill_(0.0 if name.endswith("bias") else 1.0)
        else:
            fill_rows(local, p.shape, first, seed=seed, name=name, std=std, gen_device=gen_device)


@torch.no_grad()
def rebuild_buffers(model: nn.Module, device: torch.device) -> None:
    """Buffers after ``to_empty`` (uninitialized memory) recomputed: each module that holds one
    is built again from its ``config`` and its buffers copied (HF's rotary tables)."""
    for path, module in model.named_modules():
        own = dict(module.named_buffers(recurse=False))
        if not own:
            continue
        config = getattr(module, "config", None)
        if config is None:
            raise ValueError(
                f"{path} ({type(module).__name__}) has buffers but no config to rebuild them "
                "from after a meta-device build"
            )
        with torch.device("cpu"):
            fresh = dict(type(module)(config).named_buffers(recurse=False))
        for key, buf in own.items():
            buf.copy_(fresh[key].to(device))


def build_meta_sharded(
    cfg: dict[str, Any], device: torch.device, seed: int
) -> tuple[nn.Module, str]:
    """The model built on the meta device, ``fully_shard`` per block and at the root, and
    materialized on ``device`` shard by shard (NOTE [seeded materialization])."""
    from torch.distributed.fsdp import fully_shard

    with torch.device("meta"):
        model, path = build(cfg)
    for block in model.get_submodule(path):
        fully_shard(block)
    fully_shard(model)
    model.to_empty(device=device)
    seeded_init(model, cfg, seed, device)
    rebuild_buffers(model, device)
    return model, path


def build_eager_seeded(
    cfg: dict[str, Any], seed: int, gen_device: torch.device
) -> tuple[nn.Module, str]:
    """The unsharded twin of :func:`build_meta_sharded`: built whole on the CPU, same weights."""
    model, path = build(cfg)
    seeded_init(model, cfg, seed, gen_device)
    return model, path


def seeded_vector(
    model: nn.Module, seed: int, gen_device: torch.device, dtype: torch.dtype
) -> torch.Tensor:
    """This rank's piece of a random direction over ``model``'s parameters, drawn as the weights
    are (N(0, 1) by row blocks): the same whole vector on any number of ranks, in the sharded
    layout (NOTE [sharded vector layout])."""
    pieces = []
    for name, p in model.named_parameters():
        local, first = shard_rows(p)
        piece = torch.empty(local.shape, dtype=dtype, device=gen_device)
        fill_rows(
            piece, p.shape, first, seed=seed, name=f"vector/{name}", std=1.0, gen_device=gen_device
        )
        pieces.append(piece.reshape(-1))
    return torch.cat(pieces)


def lm_loss(m: nn.Module, batch: Any) -> torch.Tensor:
    logits = m(input_ids=batch["input_ids"], use_cache=False).logits
    return F.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]), batch["input_ids"][:, 1:].reshape(-1)
    )


def lm_logits(m: nn.Module, batch: Any) -> torch.Tensor:
    logits = m(input_ids=batch[0]["input_ids"], use_cache=False).logits
    return logits[:, :-1].reshape(-1, logits.shape[-1])


CE = supervised_loss_of_output(nn.CrossEntropyLoss())


def ggn_batch(ids: torch.Tensor) -> Any:
    return ({"input_ids": ids}, ids[:, 1:].reshape(-1))


# --------------------------------------------------------------------------
# measuring
# --------------------------------------------------------------------------


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(
    fn: Callable[[], Any], device: torch.device, warmup: int, repeats: int
) -> tuple[list[float], Any]:
    """Seconds of each of ``repeats`` calls after ``warmup``, and the last result."""
    out = None
    for _ in range(warmup):
        out = fn()
    times = []
    for _ in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        out = fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return times, out


def fresh_peak(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def peak_gib(device: torch.device) -> float | None:
    """Peak allocated since the last :func:`fresh_peak`, everything on the device included."""
    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a64, b64 = a.detach().double().cpu(), b.detach().double().cpu()
    return float((a64 - b64).abs().max() / b64.abs().max().clamp_min(1e-300))


class Ranks:
    def __init__(self, device: torch.device) -> None:
        self.on = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if self.on else 0
        self.world = dist.get_world_size() if self.on else 1
        self.device = device

    def max(self, x: float | None) -> float | None:
        if x is None or not self.on:
            return x
        t = torch.tensor([x], dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t)

    def each(self, x: float | None) -> list[float] | None:
        """``x`` of every rank, in rank order (``None`` where ``x`` is ``None``: CPU peaks)."""
        if x is None:
            return None
        if not self.on:
            return [x]
        t = torch.zeros(self.world, dtype=torch.float64, device=self.device)
        t[self.rank] = x
        dist.all_reduce(t)
        return t.tolist()

    def any(self, flag: bool) -> bool:
        """Whether ``flag`` holds on some rank (every rank gets the same answer)."""
        if not self.on:
            return flag
        t = torch.tensor([float(flag)], device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return bool(t.item() > 0)

    def barrier(self) -> None:
        if self.on:
            dist.barrier()


def host_peak_gib() -> float:
    """This process's largest resident set so far (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def peaks(ranks: Ranks) -> dict[str, Any]:
    """Each GPU's peak since the last :func:`fresh_peak` (the largest, and every rank's) and each
    process's host peak so far."""
    each = ranks.each(peak_gib(ranks.device))
    return {
        "peak_gib": max(each) if each else None,
        "peak_gib_ranks": each,
        "host_peak_gib_ranks": ranks.each(host_peak_gib()),
    }


# NOTE [runs across commands]
# A command on the lent GPU machines ends after 10 minutes; an 8 B model's lanczos can take
# longer. `--checkpoint-dir` gives each lanczos / spectral_density call a file per rank
# (`<dir>/<section>_<op>.rank<r>of<W>.pt`: the algorithms' own resumable checkpoints, which
# refuse another rank's file or another call's arguments) and keeps each finished section's row
# (`<dir>/done_<section>_<op>.json`, with the arguments that produced it: a row of other
# arguments is refused in one line). Run the same command again and it skips what is done and
# resumes what is not. `--deadline-s` stops the run cleanly: each product of a resumable call
# first asks every rank whether the deadline has passed (one all-reduce of one number, beside
# products of seconds) and, if so, stops when the call's checkpoint has just been written (its
# file changed since the last product), so no work past the last save is lost; lanczos saves at
# its thick restarts (or every `--checkpoint-every` products), SLQ after each probe.
# `--max-products` stops the same way after that many products of one call in this command: a
# deterministic stop for the tests. A stopped run writes its JSON with `"complete": false` and
# the point it stopped at, and exits 0. Without `--checkpoint-dir` a deadline stops at the next
# product and the call's work is lost (the JSON says so).


class Stopped(Exception):
    """Raised between two products of a resumable call: See NOTE [runs across commands]."""


class ProductGate:
    """Asks before each product of ``op`` whether to stop: See NOTE [runs across commands]."""

    def __init__(
        self,
        ranks: Ranks,
        deadline_at: float | None,
        max_products: int | None,
        checkpoint: Path | None,
    ) -> None:
        self.ranks, self.deadline_at, self.max_products = ranks, deadline_at, max_products
        self.checkpoint = checkpoint
        self.products = 0
        self.seen = self._stamp()

    def _stamp(self) -> tuple[int, int, int] | None:
        if self.checkpoint is None or not self.checkpoint.exists():
            return None
        st = self.checkpoint.stat()
        return (st.st_ino, st.st_mtime_ns, st.st_size)

    def before_product(self) -> None:
        due = (self.deadline_at is not None and time.perf_counter() >= self.deadline_at) or (
            self.max_products is not None and self.products >= self.max_products
        )
        stamp = self._stamp()
        saved = stamp is not None and stamp != self.seen
        self.seen = stamp
        # every rank stops at the same product, or a collective of the next one would hang
        if self.ranks.any(due) and (self.checkpoint is None or not self.ranks.any(not saved)):
            raise Stopped(f"after {self.products} products")
        self.products += 1

    @contextlib.contextmanager
    def around(self, op: Any) -> Any:
        """``op``'s ``matvec`` and ``matmat`` (what the algorithms call) gated while inside."""
        matvec, matmat = op.matvec, op.matmat

        def gated_matvec(v: torch.Tensor) -> torch.Tensor:
            self.before_product()
            return matvec(v)

        def gated_matmat(V: torch.Tensor) -> torch.Tensor:
            self.before_product()
            return matmat(V)

        op.matvec, op.matmat = gated_matvec, gated_matmat
        try:
            yield self
        finally:
            del op.matvec, op.matmat


class Progress:
    """The ``--checkpoint-dir`` of a run: the algorithms' per-rank files and the finished
    sections' rows (NOTE [runs across commands])."""

    def __init__(self, root: Path | None, key: dict[str, Any], ranks: Ranks) -> None:
        self.root, self.key, self.ranks = root, key, ranks
        if root is not None:
            root.mkdir(parents=True, exist_ok=True)

    def file(self, name: str) -> Path | None:
        if self.root is None:
            return None
        return self.root / f"{name}.rank{self.ranks.rank}of{self.ranks.world}.pt"

    def done(self, name: str) -> dict[str, Any] | None:
        if self.root is None or not (self.root / f"done_{name}.json").exists():
            return None
        saved = json.loads((self.root / f"done_{name}.json").read_text())
        if saved["key"] != self.key:
            diff = sorted(
                k for k in {*saved["key"], *self.key} if saved["key"].get(k) != self.key.get(k)
            )
            raise SystemExit(
                f"{self.root}/done_{name}.json was written with other arguments ({', '.join(diff)}): "
                "pass the same arguments to resume, or another --checkpoint-dir"
            )
        row: dict[str, Any] = saved["row"]
        return row

    def record(self, name: str, row: dict[str, Any]) -> None:
        if self.root is not None and self.ranks.rank == 0:
            path = self.root / f"done_{name}.json"
            tmp = path.with_name(path.name + ".tmp")
            tmp.write_text(json.dumps({"key": self.key, "row": row}, indent=1))
            os.replace(tmp, path)
        self.ranks.barrier()  # no rank looks for the row before it is written


def local_shard(vec: torch.Tensor, model: nn.Module, rank: int, world: int) -> torch.Tensor:
    """Rank ``rank``'s piece of a whole vector over ``model``'s parameters (FSDP2 shards dim 0
    like ``torch.chunk``; NOTE [sharded vector layout])."""
    pieces, offset = [], 0
    for p in model.parameters():
        view = vec[offset : offset + p.numel()].view(p.shape)
        offset += p.numel()
        chunks = torch.chunk(view, world, dim=0)
        pieces.append(chunks[rank].reshape(-1) if rank < len(chunks) else view.new_empty(0))
    assert offset == vec.numel()
    return torch.cat(pieces)


def lanczos_row(
    op: Any,
    ranks: Ranks,
    *,
    k: int,
    tol: float,
    ncv: int | None,
    backend: Any = None,
    which: str = "LM",
    basis_device: str | None = None,
    checkpoint: Path | None = None,
    checkpoint_every: int | None = None,
) -> dict[str, Any]:
    from hessian_eigenthings.algorithms.lanczos import lanczos

    fresh_peak(ranks.device)
    sync(ranks.device)
    t0 = time.perf_counter()
    res = lanczos(
        op,
        k=k,
        tol=tol,
        seed=0,
        ncv=ncv,
        which=which,  # type: ignore[arg-type]
        backend=backend,
        basis_device=basis_device,
        checkpoint=checkpoint,
        checkpoint_every=checkpoint_every if checkpoint is not None else None,
        progress=None if ranks.rank == 0 else False,
    )
    sync(ranks.device)
    return {
        "s": ranks.max(time.perf_counter() - t0),
        "products": int(res.iterations)
        if not isinstance(res.iterations, torch.Tensor)
        else res.iterations.tolist(),
        "converged": int(torch.as_tensor(res.converged).sum()),
        "k": k,
        "which": which,
        "eigenvalues": [float(x) for x in res.eigenvalues],
        "residuals": [float(x) for x in res.residuals],
        **peaks(ranks),
    }


def slq_row(
    op: Any,
    ranks: Ranks,
    args: argparse.Namespace,
    checkpoint: Path | None,
    stem: Path,
    top: list[float] | None,
) -> dict[str, Any]:
    """The Hessian's spectral density (``args.probes`` x ``args.slq_steps``); rank 0 writes it
    to ``stem``.pt and its figure to ``stem``.png."""
    from hessian_eigenthings.algorithms.spectral_density import spectral_density

    fresh_peak(ranks.device)
    sync(ranks.device)
    t0 = time.perf_counter()
    res = spectral_density(
        op,
        num_runs=args.probes,
        lanczos_steps=args.slq_steps,
        seed=0,
        backend=op.backend,
        reorthogonalize=args.slq_reorth == "full",
        basis_device=args.basis_device,
        checkpoint=checkpoint,
        checkpoint_runs=1 if checkpoint is not None else None,
        progress=None if ranks.rank == 0 else False,
    )
    sync(ranks.device)
    row = {
        "s": ranks.max(time.perf_counter() - t0),
        "probes": args.probes,
        "steps": args.slq_steps,
        "reorthogonalize": args.slq_reorth == "full",
        "sigma": res.sigma,
        "nodes": res.raw_eigenvalues.tolist(),
        "weights": res.raw_weights.tolist(),
        "mass": float(torch.trapezoid(res.density, res.grid)),
        **peaks(ranks),
    }
    if ranks.rank == 0:
        torch.save(
            {
                "grid": res.grid,
                "density": res.density,
                "raw_eigenvalues": res.raw_eigenvalues,
                "raw_weights": res.raw_weights,
                "sigma": res.sigma,
            },
            stem.with_suffix(".pt"),
        )
        row["png"] = slq_figure(res, top, stem.with_suffix(".png"), args)
    return row


def slq_figure(res: Any, top: list[float] | None, path: Path, args: argparse.Namespace) -> str:
    """The command line's summary figure (``cli.plots.spectrum_figure``) of the density, with
    the top Hessian eigenvalue when the run has it, else the largest quadrature node."""
    from hessian_eigenthings.cli import plots

    if top is not None:
        values, note = torch.tensor(top, dtype=torch.float64), "eigenvalue: top_hessian (lanczos)"
    else:
        values = res.quadrature()[0].max().reshape(1)
        note = "marked: the largest quadrature node (no top_hessian row)"
    fig = plots.spectrum_figure(
        values,
        res,
        None,
        "LA",
        f"Hessian spectral density, {args.workload} ({args.probes} probe(s) x {args.slq_steps} "
        f"Lanczos steps, FSDP2 over {dist.get_world_size() if dist.is_initialized() else 1} ranks)",
        note,
    )
    plots.save(path, fig)
    return path.name


def profile(fn: Callable[[], Any], device: torch.device, path: Path) -> None:
    """One call of ``fn`` under the profiler: its top operators by device and by host time."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    sync(device)
    with torch_profile(activities=acts) as prof:
        fn()
        sync(device)
    table = prof.key_averages()
    path.parent.mkdir(parents=True, exist_ok=True)
    sort = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    path.write_text(
        table.table(sort_by=sort, row_limit=40, max_name_column_width=60)
        + "\n\n"
        + table.table(sort_by="cpu_time_total", row_limit=25, max_name_column_width=60)
    )


# --------------------------------------------------------------------------
# sections
# --------------------------------------------------------------------------


def run_key(args: argparse.Namespace, cfg: dict[str, Any], ranks: Ranks) -> dict[str, Any]:
    """What a finished section's row depends on (NOTE [runs across commands])."""
    keep = ("workload", "meta", "seed", "ops", "k", "tol", "ncv", "top_ncv", "probes")
    keep += ("slq_steps", "slq_reorth", "basis_device", "checkpoint_every")
    return {
        "config": cfg,
        "world_size": ranks.world,
        "dtype": str(torch.get_default_dtype()),
        **{k: getattr(args, k) for k in keep},
    }


def save_weights(model: nn.Module, ranks: Ranks, out: Path) -> str:
    """Every parameter and buffer of ``model`` gathered whole (a collective) and saved by rank 0
    to ``out/weights_w<W>.pt``: small models only."""
    from torch.distributed.tensor import DTensor

    whole = {}
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        full = t.full_tensor() if isinstance(t, DTensor) else t
        whole[name] = full.detach().cpu().clone()
    path = out / f"weights_w{ranks.world}.pt"
    if ranks.rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        torch.save(whole, path)
    return path.name


def sharded_sections(
    args: argparse.Namespace,
    cfg: dict[str, Any],
    device: torch.device,
    ranks: Ranks,
    log: Callable[[str], None],
    save: Callable[[dict[str, Any]], None],
) -> dict[str, Any]:
    from torch.distributed.fsdp import fully_shard

    out: dict[str, Any] = {}
    sections, ops = args.sections, args.ops
    needs_twin = bool(sections & {"reference", "ddp"})
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg["vocab"], (cfg["batch"], cfg["seq"]), generator=gen)
    if args.meta:
        # the unsharded twin only where a section needs it: See NOTE [seeded materialization]
        model = build_eager_seeded(cfg, args.seed, device)[0] if needs_twin else None
        v = None
    else:
        model = build(cfg)[0]
        v = torch.randn(sum(p.numel() for p in model.parameters()), generator=gen)
    mine = torch.tensor_split(ids, ranks.world)[ranks.rank].to(device)
    out["sequences_per_rank"] = [len(s) for s in torch.tensor_split(ids, ranks.world)]
    products: dict[str, torch.Tensor] = {}
    progress = Progress(args.checkpoint_dir, run_key(args, cfg, ranks), ranks)
    deadline_at = None if args.deadline_s is None else args.t_start + args.deadline_s

    def gate(name: str) -> ProductGate:
        return ProductGate(ranks, deadline_at, args.max_products, progress.file(name))

    def run_resumable(name: str, op: Any, compute: Callable[[], dict[str, Any]]) -> None:
        row = progress.done(name)
        if row is not None:
            out[name] = {**row, "from_checkpoint_dir": True}
            log(f"{name}: done in an earlier command")
            return
        g = gate(name)
        try:
            with g.around(op):
                row = compute()
        except Stopped as stop:
            where = progress.file(name)
            out["stopped"] = {
                "section": name,
                "products_this_command": g.products,
                "at_s": time.perf_counter() - args.t_start,
                "checkpoint": None if where is None else where.name,
                "checkpoint_bytes": where.stat().st_size if where and where.exists() else None,
                "resumable": where is not None,
            }
            log(f"{name} stopped {stop}; run the same command again to resume")
            raise
        row["products_this_command"] = g.products
        out[name] = row
        progress.record(name, row)

    wanted = [o for o in ops if sections & {"products", "lanczos"}]
    if sections & {"top_hessian", "slq"} and "hessian" not in wanted:
        wanted.insert(0, "hessian")
    if wanted or sections & {"train", "weights"}:
        t0 = time.perf_counter()
        if args.meta:
            sharded, path = build_meta_sharded(cfg, device, args.seed)
        else:
            sharded, path = (copy.deepcopy(model) if needs_twin else model), build(cfg)[1]
            for block in sharded.get_submodule(path):
                fully_shard(block)
            fully_shard(sharded)
        out["build_s"] = ranks.max(time.perf_counter() - t0)
        out["parameters"] = sum(p.numel() for p in sharded.parameters())
        fresh_peak(device)
        out["fsdp_params_gib"] = ranks.max(
            torch.cuda.memory_allocated(device) / 2**30 if device.type == "cuda" else None
        )
        log(f"built {out['parameters'] / 1e9:.3f} B parameters in {out['build_s']:.1f} s")
        if "weights" in sections:
            out["weights"] = save_weights(sharded, ranks, args.out)
        if args.meta:
            v_local = seeded_vector(sharded, args.seed + 1, device, torch.get_default_dtype())
        else:
            assert v is not None and model is not None
            v_local = local_shard(v, model, ranks.rank, ranks.world).to(device)
        made = {
            "hessian": lambda: FSDPHessianOperator(
                sharded, [{"input_ids": mine}], lm_loss, engine="layers", layers=path
            ),
            "ggn": lambda: FSDPGGNOperator(sharded, [ggn_batch(mine)], lm_logits, CE, layers=path),
        }
        if "train" in sections:
            params = [p for p in sharded.parameters() if p.requires_grad]

            def step() -> None:
                lm_loss(sharded, {"input_ids": mine}).backward()
                for p in params:
                    p.grad = None

            fresh_peak(device)
            times, _ = timed(step, device, args.warmup, args.repeats)
            out["train_step_s"] = ranks.max(statistics.median(times))
            out["train"] = {"s": out["train_step_s"], "times_s": times, **peaks(ranks)}
            out["train_step_peak_gib"] = out["train"]["peak_gib"]
            log(
                f"FSDP training step {out['train_step_s']:.3f} s, peak {out['train_step_peak_gib']} GiB"
            )
        try:
            for name in wanted:
                op = made[name]()
                assert op.size == v_local.numel(), (op.size, v_local.numel())
                # NOTE [prefetched gathers]: --prefetch both times the walk without it as well
                modes = {"on": [True], "off": [False], "both": [True, False]}[args.prefetch]
                if "products" in sections:
                    for prefetch in modes:
                        op.ranks.product.walk.walk.prefetch = prefetch
                        fresh_peak(device)
                        times, hv = timed(
                            lambda op=op: op @ v_local, device, args.warmup, args.repeats
                        )
                        row = {
                            "s": ranks.max(statistics.median(times)),
                            "times_s": times,
                            "prefetch": prefetch,
                            **peaks(ranks),
                        }
                        if "train_step_s" in out:
                            row["over_train_step"] = row["s"] / out["train_step_s"]
                        if prefetch == modes[0]:
                            products[name] = hv.cpu()
                            out[f"fsdp_{name}"] = row
                        else:
                            differ = not torch.equal(hv.cpu(), products[name])
                            row["same_bits"] = not ranks.any(differ)
                            out[f"fsdp_{name}_no_prefetch"] = row
                            log(
                                f"FSDP {name} walk without prefetching {row['s']:.3f} s ({row.get('over_train_step', 0):.2f} steps), peak {row['peak_gib']} GiB, same bits {row['same_bits']}"
                            )
                    op.ranks.product.walk.walk.prefetch = modes[0]
                    row = out[f"fsdp_{name}"]
                    if args.profile:
                        profile(
                            lambda op=op: op @ v_local,
                            device,
                            args.out / f"profile_{args.workload}_{name}_rank{ranks.rank}.txt",
                        )
                    log(
                        f"FSDP {name} walk {row['s']:.3f} s ({row.get('over_train_step', 0):.2f} steps), peak {row['peak_gib']} GiB"
                    )
                common = {
                    "backend": op.backend,
                    "basis_device": args.basis_device,
                    "checkpoint_every": args.checkpoint_every,
                }
                if "lanczos" in sections and name in ops:
                    key = f"fsdp_{name}_lanczos"
                    run_resumable(
                        key,
                        op,
                        functools.partial(
                            lanczos_row, op, ranks, k=args.k, tol=args.tol, ncv=args.ncv,
                            checkpoint=progress.file(key), **common,
                        ),
                    )  # fmt: skip
                    row = out[key]
                    log(
                        f"FSDP {name} lanczos: {row['converged']}/{args.k} in {row['products']} products, {row['s']:.1f} s, {row['eigenvalues']}"
                    )
                    save(out)
                if name == "hessian" and "top_hessian" in sections:
                    run_resumable(
                        "top_hessian",
                        op,
                        functools.partial(
                            lanczos_row, op, ranks, k=1, tol=args.tol, ncv=args.top_ncv,
                            which="LA", checkpoint=progress.file("top_hessian"), **common,
                        ),
                    )  # fmt: skip
                    row = out["top_hessian"]
                    log(
                        f"top Hessian eigenvalue {row['eigenvalues']} ({row['converged']}/1 at tol {args.tol}) in {row['products']} products, {row['s']:.1f} s"
                    )
                    save(out)
                if name == "hessian" and "slq" in sections:
                    # the figure marks the top eigenvalue when this run (or an earlier command) has it
                    top = out.get("top_hessian", {}).get("eigenvalues") or (
                        (progress.done("top_hessian") or {}).get("eigenvalues")
                    )
                    stem = args.out / f"bench_sharded_{args.workload}_slq"
                    run_resumable(
                        "slq",
                        op,
                        functools.partial(
                            slq_row, op, ranks, args, progress.file("slq"), stem, top
                        ),
                    )
                    row = out["slq"]
                    log(
                        f"SLQ {row['probes']} x {row['steps']}: {row['s']:.1f} s, peak {row['peak_gib']} GiB"
                    )
                    save(out)
                del op
        except Stopped:
            return out
        del sharded
        fresh_peak(device)
    if needs_twin:
        assert model is not None
        model = model.to(device)
        # the whole direction: the sharded products' pieces are its rows (local_shard)
        vd = (
            seeded_vector(model, args.seed + 1, device, torch.get_default_dtype())
            if args.meta
            else v.to(device)  # type: ignore[union-attr]
        )
    if "reference" in sections:
        batch = {"input_ids": ids.to(device)}
        made_single = {
            "hessian": lambda: he.HessianOperator(model, [batch], lm_loss),
            "ggn": lambda: he.GGNOperator(model, [ggn_batch(batch["input_ids"])], lm_logits, CE),
        }
        for name in ops:
            fresh_peak(device)
            op = made_single[name]()
            times, hv = timed(lambda op=op: op @ vd, device, args.warmup, args.repeats)
            row = {
                "s": ranks.max(statistics.median(times)),
                **peaks(ranks),
                "engine": str(getattr(op, "engine_report", ""))[:400],
            }
            if name in products:
                row["fsdp_rel_err"] = ranks.max(
                    rel_err(products[name], local_shard(hv.cpu(), model, ranks.rank, ranks.world))
                )
                if out.get(f"fsdp_{name}", {}).get("peak_gib") and row["peak_gib"]:
                    row["fsdp_peak_over_single"] = out[f"fsdp_{name}"]["peak_gib"] / row["peak_gib"]
            out[f"single_{name}"] = row
            log(
                f"single {name} {row['s']:.3f} s, peak {row['peak_gib']} GiB, FSDP error {row.get('fsdp_rel_err')}"
            )
            del op
            if "lanczos" in sections:
                op = made_single[name]()
                out[f"single_{name}_lanczos"] = row = lanczos_row(
                    op, ranks, k=args.k, tol=args.tol, ncv=args.ncv, basis_device=args.basis_device
                )
                ref = torch.tensor(row["eigenvalues"], dtype=torch.float64)
                fs = out.get(f"fsdp_{name}_lanczos")
                if fs:
                    fs["rel_err_vs_single"] = rel_err(
                        torch.tensor(fs["eigenvalues"], dtype=torch.float64), ref
                    )
                log(
                    f"single {name} lanczos: {row['converged']}/{args.k} in {row['products']} products, {row['s']:.1f} s"
                )
                del op
        model = model.cpu()
        fresh_peak(device)

    if "ddp" in sections:
        # weak scaling: each rank keeps half the workload's batch whatever W is
        model = model.to(device)
        per = max(1, cfg["batch"] // 2)
        local = torch.randint(
            0,
            cfg["vocab"],
            (per, cfg["seq"]),
            generator=torch.Generator().manual_seed(10 + ranks.rank),
        ).to(device)
        alone = dist.new_group([0])
        made_ddp = {
            "hessian": lambda g: DDPHessianOperator(
                model, [{"input_ids": local}], lm_loss, process_group=g
            ),
            "ggn": lambda g: DDPGGNOperator(
                model, [ggn_batch(local)], lm_logits, CE, process_group=g
            ),
        }
        for name in ops:
            row: dict[str, Any] = {"per_rank_sequences": per}
            if ranks.rank == 0:
                op = made_ddp[name](alone)
                times, _ = timed(lambda op=op: op @ vd, device, args.warmup, args.repeats)
                row["w1_s"] = statistics.median(times)
                del op
            ranks.barrier()
            op = made_ddp[name](None)
            times, _ = timed(lambda op=op: op @ vd, device, args.warmup, args.repeats)
            del op
            row[f"w{ranks.world}_s"] = ranks.max(statistics.median(times))
            if ranks.rank == 0:
                row["ratio"] = row[f"w{ranks.world}_s"] / row["w1_s"]
                log(
                    f"DDP {name}: W=1 {row['w1_s']:.4f} s, W={ranks.world} {row[f'w{ranks.world}_s']:.4f} s, ratio {row['ratio']:.3f}"
                )
            out[f"ddp_{name}"] = row
        model = model.cpu()
    return out


def single_sections(
    args: argparse.Namespace, cfg: dict[str, Any], device: torch.device, log: Callable[[str], None]
) -> dict[str, Any]:
    out: dict[str, Any] = {}
    model, path = build_eager_seeded(cfg, args.seed, device) if args.meta else build(cfg)
    model = model.to(device)
    n = sum(p.numel() for p in model.parameters())
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg["vocab"], (cfg["batch"], cfg["seq"]), generator=gen).to(device)
    v = torch.randn(n, generator=gen).to(device)
    ranks = Ranks(device)
    kinds: dict[str, dict[str, Any]] = {}
    if "whole" in args.sections:
        kinds["whole"] = {}
    if "walk" in args.sections:
        kinds["walk"] = {"engine": "layers", "layers": path}
    results: dict[str, torch.Tensor] = {}
    for kind, extra in kinds.items():
        for name in args.ops:
            fresh_peak(device)
            row: dict[str, Any] = {}
            op = None
            try:
                if name == "hessian":
                    op = he.HessianOperator(model, [{"input_ids": ids}], lm_loss, **extra)
                else:
                    op = he.GGNOperator(model, [ggn_batch(ids)], lm_logits, CE, **extra)
                times, hv = timed(
                    lambda o=op: o @ v, device, args.warmup if kind == "walk" else 1, args.repeats
                )
                row.update(s=statistics.median(times), times_s=times)
                results[f"{kind}_{name}"] = hv.cpu()
            except torch.cuda.OutOfMemoryError as exc:
                row["oom"] = str(exc).splitlines()[0][:300]
            except Exception as exc:  # the memory pre-flight's refusal, say: record what users see
                row["error"] = f"{type(exc).__name__}: {str(exc)[:600]}"
                row["trace"] = traceback.format_exc()[-1500:]
            row["peak_gib"] = peak_gib(device)
            del op
            fresh_peak(device)
            out[f"{kind}_{name}"] = row
            log(f"{kind} {name}: {row}")
    for name in args.ops:
        if f"whole_{name}" in results and f"walk_{name}" in results:
            out[f"walk_{name}"]["rel_err_vs_whole"] = rel_err(
                results[f"walk_{name}"], results[f"whole_{name}"]
            )
    del ranks
    return out


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--workload",
        default="gpt2_6l",
        help=f"{sorted(WORKLOADS)}, or tiny_gpt2 / tiny_llama (CPU)",
    )
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument(
        "--sections", default=None, help="comma list (default: all of the launch mode's)"
    )
    ap.add_argument("--ops", default="hessian,ggn")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--k", type=int, default=5)
    ap.add_argument("--tol", type=float, default=1e-4)
    ap.add_argument("--profile", action="store_true", help="profile one sharded product of each op")
    ap.add_argument(
        "--prefetch",
        choices=("on", "off", "both"),
        default="on",
        help="the sharded walk's prefetched gathers (both: the products section times each)",
    )
    ap.add_argument("--ncv", type=int, default=None, help="lanczos basis size (default: lanczos's)")
    ap.add_argument(
        "--meta",
        action="store_true",
        help="build on the meta device, shard, materialize by seeded rows (llama8b: always)",
    )
    ap.add_argument("--seed", type=int, default=0, help="of the --meta initialization")
    ap.add_argument("--batch", type=int, default=None, help="sequences (default: the workload's)")
    ap.add_argument(
        "--seq", type=int, default=None, help="tokens a sequence (default: the workload's)"
    )
    ap.add_argument("--top-ncv", type=int, default=None, help="top_hessian's lanczos basis size")
    ap.add_argument("--probes", type=int, default=1, help="SLQ start vectors")
    ap.add_argument("--slq-steps", type=int, default=30, help="Lanczos steps a probe")
    ap.add_argument(
        "--slq-reorth",
        choices=("full", "none"),
        default="full",
        help="SLQ's reorthogonalization (none: two vectors a probe instead of --slq-steps)",
    )
    ap.add_argument(
        "--basis-device",
        choices=("cpu",),
        default=None,
        help="where lanczos and SLQ keep their Krylov basis (default: the operator's device)",
    )
    ap.add_argument(
        "--checkpoint-dir", type=Path, default=None, help="resume across commands (per-rank files)"
    )
    ap.add_argument(
        "--checkpoint-every",
        type=int,
        default=None,
        help="lanczos saves every this many products (default: at thick restarts)",
    )
    ap.add_argument(
        "--deadline-s",
        type=float,
        default=None,
        help="stop at the first saved point after this many seconds from the script's start",
    )
    ap.add_argument(
        "--max-products",
        type=int,
        default=None,
        help="stop at the first saved point after this many products of one call",
    )
    args = ap.parse_args()
    args.t_start = time.perf_counter()
    distributed = "RANK" in os.environ
    default = "products,train,reference,lanczos,ddp" if distributed else "whole,walk"
    args.sections = set((args.sections or default).split(","))
    args.ops = [o for o in args.ops.split(",") if o]
    tiny = args.workload.startswith("tiny_")
    if args.workload not in WORKLOADS and not (tiny and args.workload[5:] in TINY):
        ap.error(f"--workload must be one of {sorted(WORKLOADS)} or tiny_gpt2 / tiny_llama")
    cfg = dict(TINY[args.workload[5:]] if tiny else WORKLOADS[args.workload])
    cfg.update({k: getattr(args, k) for k in ("batch", "seq") if getattr(args, k) is not None})
    args.meta = args.meta or bool(cfg.pop("meta", False))
    known = {"products", "train", "reference", "lanczos", "ddp", "top_hessian", "slq", "weights"}
    known |= {"whole", "walk"}
    if args.sections - known:
        ap.error(f"unknown sections {sorted(args.sections - known)}; known: {sorted(known)}")
    if args.checkpoint_every is not None and args.checkpoint_dir is None:
        ap.error("--checkpoint-every needs --checkpoint-dir (where lanczos saves)")
    if not distributed and args.sections & {"top_hessian", "slq", "weights"}:
        ap.error("the top_hessian, slq and weights sections run under torchrun (FSDP2 ranks)")
    use_cuda = torch.cuda.is_available() and not tiny
    if use_cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    if tiny:
        torch.set_default_dtype(torch.float64)
    if distributed:
        dist.init_process_group(
            "nccl" if use_cuda else "gloo", timeout=datetime.timedelta(minutes=15)
        )
    device = torch.device("cuda", torch.cuda.current_device()) if use_cuda else torch.device("cpu")
    ranks = Ranks(device)
    t_start = args.t_start

    def log(msg: str) -> None:
        if ranks.rank == 0:
            print(
                f"[bench_sharded {args.workload} +{time.perf_counter() - t_start:.0f}s] {msg}",
                flush=True,
            )

    import transformers

    with contextlib.suppress(ImportError):
        import triton  # noqa: F401  (its version only)

    report: dict[str, Any] = {
        "workload": args.workload,
        "config": cfg,
        "mode": f"fsdp{ranks.world}" if distributed else "single",
        "world_size": ranks.world,
        "device": torch.cuda.get_device_name(device) if use_cuda else "cpu",
        "torch": torch.__version__,
        "triton": getattr(sys.modules.get("triton"), "__version__", None),
        "transformers": transformers.__version__,
        "tf32": bool(torch.backends.cuda.matmul.allow_tf32),
        "dtype": str(torch.get_default_dtype()),
        "sections": sorted(args.sections),
        "args": {
            k: str(v) if isinstance(v, Path) else v
            for k, v in vars(args).items()
            if k not in ("out", "sections", "t_start")
        },
    }
    log(f"{report['device']}, W={ranks.world}, {cfg}")
    if distributed:

        def save(partial: dict[str, Any]) -> None:
            if ranks.rank == 0:
                args.out.mkdir(parents=True, exist_ok=True)
                (args.out / f"bench_sharded_{args.workload}_partial.json").write_text(
                    json.dumps({**report, **partial}, indent=1)
                )

        report.update(sharded_sections(args, cfg, device, ranks, log, save))
    else:
        report.update(single_sections(args, cfg, device, log))
    report["wall_s"] = time.perf_counter() - t_start
    report["complete"] = "stopped" not in report
    if ranks.rank == 0:
        args.out.mkdir(parents=True, exist_ok=True)
        path = args.out / f"bench_sharded_{args.workload}_{report['mode']}.json"
        path.write_text(json.dumps(report, indent=1))
        log(f"wrote {path}")
    if distributed:
        leave_group()


if __name__ == "__main__":
    main()
