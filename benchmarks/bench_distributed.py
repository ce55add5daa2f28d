"""Distributed Hessian products (DDP and FSDP2) against one device: equality, time, scaling.

Launch on 2-4 GPUs (NCCL), one process per GPU:

    torchrun --standalone --nproc_per_node=4 benchmarks/bench_distributed.py --out results/distributed

Workload (ANCHORS.md): GPT-2 style LM, 6 layers, d=512, vocab 50257, global batch 8 x 256
tokens, eager attention, fp32, built locally from ``transformers.GPT2Config`` (no download;
a hand-written GPT of the same shape when transformers is missing). The global batch is
split across ranks by sequences (uneven when W does not divide 8).

Measured, each a median of ``--repeats`` calls after ``--warmup`` (synchronised):

- single: ``HessianOperator`` on the whole batch on one device (every rank runs it, so
  the check is local), with the graph kept across products (``reuse``) and without
  (``fresh``);
- ddp: ``DDPHessianOperator`` with each rank's shard; ``rel_err_vs_single`` (max abs
  difference / max abs value) and scaling efficiency ``t_single / (W · t_ddp)``;
- allreduce: one all-reduce of the product's size alone (the communication floor);
- fsdp: ``FSDPHessianOperator`` (finite differences, each transformer block and the root
  sharded), its local shard compared with the single-device finite-difference product,
  time against single-device finite differences; and ``engine="layers"`` (the exact sharded
  walk): time, peak memory, error against one device's autograd product, and its ratio to an
  FSDP training step (forward and backward) on the same shard;
- lanczos: top-10 ``lanczos`` with the DDP operator and with the FSDP operators
  (``backend=op.backend``; the walk at tol 1e-4), eigenvalues identical on every rank,
  against one device.

Rank 0 writes ``bench_distributed.json`` and ``bench_distributed.md`` to ``--out``.
``--tiny`` runs a toy size on CPU with gloo (what the test suite does).
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import math
import os
import platform
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.leave_group import leave_group
from hessian_eigenthings.operators import HessianOperator
from hessian_eigenthings.operators.distributed import (
    DDPHessianOperator,
    FSDPHessianOperator,
    is_main_process,
)

# --------------------------------------------------------------------------
# workload
# --------------------------------------------------------------------------


class _Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        B, T, d = h.shape
        q, k, v = (
            self.qkv(self.ln1(h)).view(B, T, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        )
        att = (q @ k.transpose(-1, -2)) / math.sqrt(d // self.heads)
        mask = torch.ones(T, T, dtype=torch.bool, device=h.device).triu(1)
        att = att.masked_fill(mask, float("-inf")).softmax(-1)  # eager: has a double backward
        h = h + self.proj((att @ v).transpose(1, 2).reshape(B, T, d))
        return h + self.out(F.gelu(self.fc(self.ln2(h))))


class SimpleGPT(nn.Module):
    """GPT-2 shaped fallback (tied embeddings, pre-LN blocks, eager attention)."""

    def __init__(self, vocab: int, d: int, layers: int, heads: int, ctx: int) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(ctx, d)
        self.h = nn.ModuleList(_Block(d, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)

    def blocks(self) -> list[nn.Module]:
        return list(self.h)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.wte(ids) + self.wpe(torch.arange(ids.shape[1], device=ids.device))
        for block in self.h:
            h = block(h)
        return self.ln_f(h) @ self.wte.weight.T


def build_model(
    cfg: dict[str, int], prefer_hf: bool
) -> tuple[
    nn.Module, str, Callable[[nn.Module, Any], torch.Tensor], Callable[[nn.Module], list[nn.Module]]
]:
    """(model, name, loss_fn(model, ids), blocks(model)) with eval-mode dropout off."""
    if prefer_hf:
        try:
            from transformers import GPT2Config, GPT2LMHeadModel
        except ImportError:
            pass
        else:
            config = GPT2Config(
                n_layer=cfg["layers"],
                n_embd=cfg["d"],
                n_head=cfg["heads"],
                vocab_size=cfg["vocab"],
                n_positions=cfg["ctx"],
                attn_pdrop=0.0,
                resid_pdrop=0.0,
                embd_pdrop=0.0,
                bos_token_id=0,
                eos_token_id=0,
            )
            config._attn_implementation = "eager"  # math attention: has a double backward
            torch.manual_seed(0)
            hf = GPT2LMHeadModel(config).eval()

            def hf_loss(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
                return model(input_ids=ids, labels=ids).loss  # type: ignore[no-any-return]

            return hf, "transformers.GPT2LMHeadModel", hf_loss, lambda m: list(m.transformer.h)  # type: ignore[union-attr]
    torch.manual_seed(0)
    simple = SimpleGPT(cfg["vocab"], cfg["d"], cfg["layers"], cfg["heads"], cfg["ctx"]).eval()

    def simple_loss(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        logits = model(ids)
        return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))

    return simple, "SimpleGPT (transformers missing)", simple_loss, lambda m: m.blocks()  # type: ignore[operator]


# --------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(
    fn: Callable[[], Any], device: torch.device, warmup: int, repeats: int
) -> tuple[float, Any]:
    """Median milliseconds of ``fn`` and its last result."""
    out = None
    for _ in range(warmup):
        out = fn()
    times = []
    for _ in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        out = fn()
        sync(device)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times), out


def peak_mib(device: torch.device, base: int) -> float | None:
    if device.type != "cuda":
        return None
    return (torch.cuda.max_memory_allocated(device) - base) / 2**20


def reset_peak(device: torch.device) -> int:
    if device.type != "cuda":
        return 0
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    return torch.cuda.memory_allocated(device)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a64, b64 = a.detach().double(), b.detach().double()
    return float((a64 - b64).abs().max() / b64.abs().max().clamp_min(1e-300))


def max_over_ranks(x: float, device: torch.device) -> float:
    t = torch.tensor([x], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def same_on_ranks(t: torch.Tensor, device: torch.device) -> bool:
    """Bitwise equal on every rank (moved to ``device``: NCCL gathers CUDA tensors only)."""
    t = t.detach().to(device).contiguous()
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, t)
    return all(torch.equal(p, parts[0]) for p in parts)


def local_shard(
    global_vec: torch.Tensor, ref: HessianOperator, rank: int, world: int
) -> torch.Tensor:
    """This rank's piece of a global vector (FSDP2 shards dim 0 like ``torch.chunk``)."""
    pieces = []
    for view in ref.layout.split(global_vec):
        chunks = torch.chunk(view, world, dim=0)
        pieces.append(chunks[rank].reshape(-1) if rank < len(chunks) else view.new_empty(0))
    return torch.cat(pieces)


# --------------------------------------------------------------------------
# main
# --------------------------------------------------------------------------


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--tiny", action="store_true", help="toy size on CPU/gloo (for the test suite)")
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--warmup", type=int, default=None)
    ap.add_argument("--k", type=int, default=None, help="eigenpairs for lanczos (default 10)")
    ap.add_argument(
        "--no-hf",
        action="store_true",
        help="use the hand-written GPT even if transformers is there",
    )
    ap.add_argument(
        "--fd-eps", type=float, default=None, help="finite-difference step (default: by dtype)"
    )
    ap.add_argument("--skip", default="", help="comma list of sections to skip: ddp,fsdp,lanczos")
    args = ap.parse_args()
    skip = set(filter(None, args.skip.split(",")))

    use_cuda = torch.cuda.is_available() and not args.tiny
    if use_cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if use_cuda else "gloo", timeout=datetime.timedelta(minutes=10))
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device()) if use_cuda else torch.device("cpu")
    if args.tiny:
        cfg = {"layers": 2, "d": 32, "heads": 2, "vocab": 101, "ctx": 16, "batch": 4}
        repeats, warmup, k = args.repeats or 2, args.warmup or 1, args.k or 3
    else:
        cfg = {"layers": 6, "d": 512, "heads": 8, "vocab": 50257, "ctx": 256, "batch": 8}
        repeats, warmup, k = args.repeats or 10, args.warmup or 3, args.k or 10
    main_rank = is_main_process()

    def log(msg: str) -> None:
        if main_rank:
            print(f"[bench_distributed] {msg}", flush=True)

    model, model_name, loss_fn, blocks = build_model(cfg, prefer_hf=not args.no_hf)
    model = model.to(device)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg["vocab"], (cfg["batch"], cfg["ctx"]), generator=gen).to(device)
    shard = torch.tensor_split(ids, world)[rank]  # uneven when world does not divide the batch
    n_params = sum(p.numel() for p in model.parameters())
    v = torch.randn(n_params, generator=gen).to(device)
    report: dict[str, Any] = {
        "world_size": world,
        "device": torch.cuda.get_device_name(device) if use_cuda else platform.processor() or "cpu",
        "backend": dist.get_backend(),
        "torch": torch.__version__,
        "model": model_name,
        "config": cfg,
        "params": n_params,
        "sequences_per_rank": [len(s) for s in torch.tensor_split(ids, world)],
        "repeats": repeats,
        "fd_eps": args.fd_eps,
        "warmup": warmup,
    }
    log(f"{model_name}, {n_params / 1e6:.1f} M params, {world} ranks on {report['device']}")

    # -- single device and DDP ----------------------------------------------------
    if "ddp" not in skip:
        res: dict[str, Any] = {}
        ref_hv = None
        for mode, reuse in (("reuse", "auto"), ("fresh", False)):
            base = reset_peak(device)
            single = HessianOperator(model, [ids], loss_fn, graph_reuse=reuse)
            t_single, hv_single = timed(lambda op=single: op @ v, device, warmup, repeats)
            res[f"single_{mode}_ms"] = t_single
            res[f"single_{mode}_peak_mib"] = peak_mib(device, base)
            del single
            base = reset_peak(device)
            ddp = DDPHessianOperator(model, [shard], loss_fn, graph_reuse=reuse)
            t_ddp, hv_ddp = timed(lambda op=ddp: op @ v, device, warmup, repeats)
            del ddp
            res[f"ddp_{mode}_ms"] = max_over_ranks(t_ddp, device)
            res[f"ddp_{mode}_peak_mib"] = peak_mib(device, base)
            res[f"efficiency_{mode}"] = t_single / (world * res[f"ddp_{mode}_ms"])
            res[f"rel_err_{mode}"] = max_over_ranks(rel_err(hv_ddp, hv_single), device)
            res[f"same_on_ranks_{mode}"] = same_on_ranks(hv_ddp, device)
            ref_hv = hv_single
            log(
                f"{mode}: single {t_single:.1f} ms, ddp {res[f'ddp_{mode}_ms']:.1f} ms, "
                f"efficiency {res[f'efficiency_{mode}']:.2f}, rel err {res[f'rel_err_{mode}']:.1e}"
            )
        res["rel_err_vs_single"] = max(res["rel_err_reuse"], res["rel_err_fresh"])
        buf = torch.empty(n_params + 1 + world, device=device)
        res["allreduce_ms"], _ = timed(lambda: dist.all_reduce(buf), device, warmup, repeats)
        report["ddp"] = res
        del ref_hv

    # -- FSDP2 --------------------------------------------------------------------
    if "fsdp" not in skip:
        fsdp: dict[str, Any] = {}
        try:
            from torch.distributed.fsdp import fully_shard

            sharded = copy.deepcopy(model)
            for block in blocks(sharded):
                fully_shard(block)
            fully_shard(sharded)
        except Exception as exc:  # report, don't hide: FSDP2 may be missing or refuse this setup
            fsdp["skip"] = f"fully_shard failed: {type(exc).__name__}: {exc}"
            log(fsdp["skip"])
        else:
            base = reset_peak(device)
            ref_fd = HessianOperator(
                model, [ids], loss_fn, method="finite_difference", fd_eps=args.fd_eps
            )
            t_ref, hv_ref = timed(lambda: ref_fd @ v, device, warmup, repeats)
            fsdp["single_fd_ms"] = t_ref
            fsdp["single_fd_peak_mib"] = peak_mib(device, base)
            base = reset_peak(device)
            ref_autograd = HessianOperator(model, [ids], loss_fn, graph_reuse=False) @ v
            fsdp["single_autograd_peak_mib"] = peak_mib(device, base)
            base = reset_peak(device)
            op = FSDPHessianOperator(sharded, [shard], loss_fn, fd_eps=args.fd_eps)
            v_local = local_shard(v, ref_fd, rank, world)
            t_fsdp, hv_fsdp = timed(lambda: op @ v_local, device, warmup, repeats)
            fsdp["fsdp_fd_ms"] = max_over_ranks(t_fsdp, device)
            fsdp["fsdp_fd_peak_mib"] = peak_mib(device, base)
            fsdp["efficiency"] = t_ref / (world * fsdp["fsdp_fd_ms"])
            fsdp["local_size"] = op.size
            fsdp["rel_err_vs_single_fd"] = max_over_ranks(
                rel_err(hv_fsdp, local_shard(hv_ref, ref_fd, rank, world)), device
            )
            fsdp["rel_err_vs_autograd"] = max_over_ranks(
                rel_err(hv_fsdp, local_shard(ref_autograd, ref_fd, rank, world)), device
            )
            log(
                f"fsdp fd: single {t_ref:.1f} ms, fsdp {fsdp['fsdp_fd_ms']:.1f} ms, "
                f"rel err vs single fd {fsdp['rel_err_vs_single_fd']:.1e}, vs autograd {fsdp['rel_err_vs_autograd']:.1e}"
            )
            # the exact sharded walk (NOTE [sharded layer walk]) and an FSDP training step
            base = reset_peak(device)
            walk_op = FSDPHessianOperator(
                sharded, [shard], loss_fn, engine="layers", layers=blocks(sharded)
            )
            t_walk, hv_walk = timed(lambda: walk_op @ v_local, device, warmup, repeats)
            fsdp["fsdp_walk_ms"] = max_over_ranks(t_walk, device)
            fsdp["fsdp_walk_peak_mib"] = peak_mib(device, base)
            fsdp["rel_err_walk_vs_autograd"] = max_over_ranks(
                rel_err(hv_walk, local_shard(ref_autograd, ref_fd, rank, world)), device
            )
            trainable = [p for p in sharded.parameters() if p.requires_grad]

            def train_step() -> None:
                loss_fn(sharded, shard).backward()
                for p in trainable:
                    p.grad = None

            fsdp["fsdp_train_step_ms"], _ = timed(train_step, device, warmup, repeats)
            fsdp["walk_over_train_step"] = fsdp["fsdp_walk_ms"] / fsdp["fsdp_train_step_ms"]
            log(
                f"fsdp walk: {fsdp['fsdp_walk_ms']:.1f} ms ({fsdp['walk_over_train_step']:.2f} FSDP "
                f"training steps), rel err vs autograd {fsdp['rel_err_walk_vs_autograd']:.1e}"
            )
            del ref_fd, ref_autograd
            report["_fsdp_op"] = op
            report["_walk_op"] = walk_op
        report["fsdp"] = fsdp

    # -- lanczos --------------------------------------------------------------------
    if "lanczos" not in skip:
        lz: dict[str, Any] = {}
        try:
            from hessian_eigenthings.algorithms.lanczos import lanczos
        except ImportError as exc:
            lz["skip"] = f"algorithms not importable: {exc}"
        else:
            runs: list[tuple[str, Callable[[], Any]]] = [
                ("single", lambda: lanczos(HessianOperator(model, [ids], loss_fn), k=k, seed=0)),
                ("ddp", lambda: lanczos(DDPHessianOperator(model, [shard], loss_fn), k=k, seed=0)),
            ]
            fsdp_op = report.pop("_fsdp_op", None)
            walk_op = report.pop("_walk_op", None)
            if walk_op is not None:
                runs.append(
                    (
                        "fsdp_walk",
                        lambda: lanczos(walk_op, k=k, seed=0, backend=walk_op.backend, tol=1e-4),
                    )
                )
            if fsdp_op is not None:
                # finite differences in fp32 are accurate to ~1e-4: a tighter tol cannot be met
                runs.append(
                    (
                        "fsdp",
                        lambda: lanczos(fsdp_op, k=k, seed=0, backend=fsdp_op.backend, tol=1e-3),
                    )
                )
            for name, run in runs:
                sync(device)
                t0 = time.perf_counter()
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    result = run()
                sync(device)
                lz[f"{name}_warnings"] = sorted({str(w.message) for w in caught})
                lz[f"{name}_converged"] = int(torch.as_tensor(result.converged).sum())
                lz[f"{name}_s"] = max_over_ranks(time.perf_counter() - t0, device)
                lz[f"{name}_eigenvalues"] = [float(x) for x in result.eigenvalues]
                lz[f"{name}_iterations"] = (
                    int(result.iterations)
                    if not isinstance(result.iterations, torch.Tensor)
                    else result.iterations.tolist()
                )
                lz[f"{name}_same_on_ranks"] = same_on_ranks(result.eigenvalues, device)
                log(f"lanczos {name}: {lz[f'{name}_s']:.1f} s, top {lz[f'{name}_eigenvalues'][:3]}")
            ev = torch.tensor(lz["single_eigenvalues"], dtype=torch.float64)
            for name in ("ddp", "fsdp", "fsdp_walk"):
                if f"{name}_eigenvalues" in lz:
                    lz[f"{name}_rel_err"] = rel_err(
                        torch.tensor(lz[f"{name}_eigenvalues"], dtype=torch.float64), ev
                    )
        report["lanczos"] = lz
    report.pop("_fsdp_op", None)
    report.pop("_walk_op", None)

    if main_rank:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "bench_distributed.json").write_text(json.dumps(report, indent=1))
        (args.out / "bench_distributed.md").write_text(markdown(report))
        log(f"wrote {args.out / 'bench_distributed.json'}")
    leave_group()


def markdown(r: dict[str, Any]) -> str:
    def fmt(x: Any) -> str:
        if x is None:
            return "-"
        if isinstance(x, float):
            return f"{x:.3g}"
        return str(x)

    lines = [
        f"# Distributed Hessian products: {r['world_size']} ranks, {r['device']} ({r['backend']})",
        "",
        f"{r['model']}, {r['params'] / 1e6:.2f} M parameters, config {r['config']}, sequences per rank "
        f"{r['sequences_per_rank']}, torch {r['torch']}; median of {r['repeats']} calls after {r['warmup']} warm-ups.",
        "",
    ]
    if "ddp" in r:
        d = r["ddp"]
        lines += [
            "## Data parallel (autograd)",
            "",
            "| graph | single ms | DDP ms | efficiency t1/(W·tW) | rel err vs single | same on ranks | peak MiB single / DDP |",
            "|---|---|---|---|---|---|---|",
        ]
        for mode in ("reuse", "fresh"):
            lines.append(
                f"| {mode} | {fmt(d[f'single_{mode}_ms'])} | {fmt(d[f'ddp_{mode}_ms'])} | {fmt(d[f'efficiency_{mode}'])} "
                f"| {fmt(d[f'rel_err_{mode}'])} | {d[f'same_on_ranks_{mode}']} | {fmt(d[f'single_{mode}_peak_mib'])} / {fmt(d[f'ddp_{mode}_peak_mib'])} |"
            )
        lines += [
            "",
            f"One all-reduce of the product's size alone: {fmt(d['allreduce_ms'])} ms.",
            "",
        ]
    if "fsdp" in r:
        f = r["fsdp"]
        lines += ["## FSDP2 (finite differences, sharded vectors)", ""]
        if "skip" in f:
            lines += [f"Skipped: {f['skip']}", ""]
        else:
            lines += [
                "| single FD ms | FSDP FD ms | efficiency | rel err vs single FD | rel err vs autograd | local size | peak MiB single / FSDP |",
                "|---|---|---|---|---|---|---|",
                f"| {fmt(f['single_fd_ms'])} | {fmt(f['fsdp_fd_ms'])} | {fmt(f['efficiency'])} | {fmt(f['rel_err_vs_single_fd'])} "
                f"| {fmt(f['rel_err_vs_autograd'])} | {f['local_size']} | {fmt(f['single_fd_peak_mib'])} / {fmt(f['fsdp_fd_peak_mib'])} |",
                "",
                'Exact sharded walk (`engine="layers"`):',
                "",
                "| FSDP walk ms | FSDP training step ms | walk / step | rel err vs autograd | peak MiB single autograd / walk |",
                "|---|---|---|---|---|",
                f"| {fmt(f.get('fsdp_walk_ms'))} | {fmt(f.get('fsdp_train_step_ms'))} | {fmt(f.get('walk_over_train_step'))} "
                f"| {fmt(f.get('rel_err_walk_vs_autograd'))} | {fmt(f.get('single_autograd_peak_mib'))} / {fmt(f.get('fsdp_walk_peak_mib'))} |",
                "",
            ]
    if "lanczos" in r:
        lz = r["lanczos"]
        lines += ["## Top-k lanczos", ""]
        if "skip" in lz:
            lines += [f"Skipped: {lz['skip']}", ""]
        else:
            lines += [
                "| operator | seconds | converged | top eigenvalues | rel err vs single | same on ranks |",
                "|---|---|---|---|---|---|",
            ]
            for name in ("single", "ddp", "fsdp", "fsdp_walk"):
                if f"{name}_s" in lz:
                    top = ", ".join(f"{x:.4g}" for x in lz[f"{name}_eigenvalues"][:5])
                    lines.append(
                        f"| {name} | {fmt(lz[f'{name}_s'])} | {lz[f'{name}_converged']}/{len(lz[f'{name}_eigenvalues'])} | {top} | {fmt(lz.get(f'{name}_rel_err'))} | {lz[f'{name}_same_on_ranks']} |"
                    )
            lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
