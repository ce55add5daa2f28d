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
  vocab 128256, tied embeddings; 1.24 B parameters), 8 x 1024 tokens.

Sections (``--sections``, comma list):

- ``products``: ``FSDPHessianOperator(engine="layers")`` and ``FSDPGGNOperator`` products on each
  rank's shard of the batch: median time, per-GPU peak (max over ranks, parameters included);
- ``train``: an FSDP2 training step (forward + backward) on the same shards, and each product's
  ratio to it;
- ``reference``: the single-GPU default product on the whole batch on every rank (the model
  unsharded), its time and peak, and each sharded product's error against it (max abs / max abs);
- ``lanczos``: top-``k`` lanczos at ``--tol`` on the sharded operators (and, with ``reference``,
  on the single-GPU ones): products, seconds, converged pairs, eigenvalues;
- ``ddp``: weak scaling of ``DDPHessianOperator``/``DDPGGNOperator`` with a fixed per-rank batch
  (half the workload's batch): W = 1 (rank 0 alone, a one-rank group) against W ranks;
- single process only: ``whole`` (the default exact product on one device, out-of-memory
  recorded) and ``walk`` (``engine="layers"`` on one device).

Writes ``bench_sharded_<workload>_<mode>.json`` to ``--out`` (rank 0).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import datetime
import gc
import json
import os
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
        "batch": 8,
        "seq": 1024,
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
        tie_word_embeddings=True,
        rope_theta=500000.0,
    )
    model = transformers.LlamaForCausalLM._from_config(c, attn_implementation="eager")
    return model.eval(), "model.layers"


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

    def barrier(self) -> None:
        if self.on:
            dist.barrier()


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
    op: Any, k: int, tol: float, ncv: int | None, ranks: Ranks, backend: Any = None
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
        backend=backend,
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
        "eigenvalues": [float(x) for x in res.eigenvalues],
        "peak_gib": ranks.max(peak_gib(ranks.device)),
    }


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
    model, path = build(cfg)
    n = sum(p.numel() for p in model.parameters())
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg["vocab"], (cfg["batch"], cfg["seq"]), generator=gen)
    v = torch.randn(n, generator=gen)
    mine = torch.tensor_split(ids, ranks.world)[ranks.rank].to(device)
    out["sequences_per_rank"] = [len(s) for s in torch.tensor_split(ids, ranks.world)]
    sections, ops = args.sections, args.ops
    products: dict[str, torch.Tensor] = {}

    if sections & {"products", "train", "lanczos"}:
        sharded = copy.deepcopy(model) if "reference" in sections or "ddp" in sections else model
        for block in sharded.get_submodule(path):
            fully_shard(block)
        fully_shard(sharded)
        fresh_peak(device)
        out["fsdp_params_gib"] = ranks.max(
            torch.cuda.memory_allocated(device) / 2**30 if device.type == "cuda" else None
        )
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
            out["train_step_peak_gib"] = ranks.max(peak_gib(device))
            log(
                f"FSDP training step {out['train_step_s']:.3f} s, peak {out['train_step_peak_gib']} GiB"
            )
        for name in ops:
            op = made[name]()
            assert op.size == v_local.numel(), (op.size, v_local.numel())
            if "products" in sections:
                fresh_peak(device)
                times, hv = timed(lambda op=op: op @ v_local, device, args.warmup, args.repeats)
                products[name] = hv.cpu()
                row = {
                    "s": ranks.max(statistics.median(times)),
                    "times_s": times,
                    "peak_gib": ranks.max(peak_gib(device)),
                }
                if "train_step_s" in out:
                    row["over_train_step"] = row["s"] / out["train_step_s"]
                out[f"fsdp_{name}"] = row
                if args.profile:
                    profile(
                        lambda op=op: op @ v_local,
                        device,
                        args.out / f"profile_{args.workload}_{name}_rank{ranks.rank}.txt",
                    )
                log(
                    f"FSDP {name} walk {row['s']:.3f} s ({row.get('over_train_step', 0):.2f} steps), peak {row['peak_gib']} GiB"
                )
            if "lanczos" in sections:
                out[f"fsdp_{name}_lanczos"] = row = lanczos_row(
                    op, args.k, args.tol, args.ncv, ranks, op.backend
                )
                log(
                    f"FSDP {name} lanczos: {row['converged']}/{args.k} in {row['products']} products, {row['s']:.1f} s, {row['eigenvalues']}"
                )
                save(out)
            del op
        del sharded
        fresh_peak(device)

    if "reference" in sections:
        model = model.to(device)
        batch = {"input_ids": ids.to(device)}
        made_single = {
            "hessian": lambda: he.HessianOperator(model, [batch], lm_loss),
            "ggn": lambda: he.GGNOperator(model, [ggn_batch(batch["input_ids"])], lm_logits, CE),
        }
        vd = v.to(device)
        for name in ops:
            fresh_peak(device)
            op = made_single[name]()
            times, hv = timed(lambda op=op: op @ vd, device, args.warmup, args.repeats)
            row = {
                "s": ranks.max(statistics.median(times)),
                "peak_gib": ranks.max(peak_gib(device)),
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
                    op, args.k, args.tol, args.ncv, ranks
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
        vd = v.to(device)
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
    model, path = build(cfg)
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
    ap.add_argument("--ncv", type=int, default=None, help="lanczos basis size (default: lanczos's)")
    args = ap.parse_args()
    distributed = "RANK" in os.environ
    default = "products,train,reference,lanczos,ddp" if distributed else "whole,walk"
    args.sections = set((args.sections or default).split(","))
    args.ops = [o for o in args.ops.split(",") if o]
    tiny = args.workload.startswith("tiny_")
    cfg = TINY[args.workload[5:]] if tiny else WORKLOADS[args.workload]
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
    t_start = time.perf_counter()

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
        "args": {k: v for k, v in vars(args).items() if k not in ("out", "sections")},
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
    if ranks.rank == 0:
        args.out.mkdir(parents=True, exist_ok=True)
        path = args.out / f"bench_sharded_{args.workload}_{report['mode']}.json"
        path.write_text(json.dumps(report, indent=1))
        log(f"wrote {path}")
    if distributed:
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
