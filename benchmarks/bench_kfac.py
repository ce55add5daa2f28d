"""KFAC factor computation: ours against curvlinops' ``KFACLinearOperator``, and a gradient.

    python -m benchmarks.bench_kfac --device cuda --out bench_out/kfac.json
    python -m benchmarks.bench_kfac --quick          # CPU smoke run, small models

Side by side in one process, repeats interleaved, medians after a warm-up (CUDA events on a
GPU), TF32 off. Workloads (``--workloads``), one batch each, cross-entropy, fp32, eval mode:

- ``mlp``: 784-1024-1024-10, batch ``--batch``;
- ``resnet_like``: the small ResNet-like CNN written here (width 32, 32×32), batch ``--batch``;
- ``resnet18``: ResNet-18 (ImageNet stem, 32×32 inputs; ``benchmarks.workloads``), batch
  ``--batch``; KFAC over its Conv2d / Linear layers (BatchNorm left out of both operators);
- ``gpt2``: GPT-2 style 6 layers, d=512, 8 heads, vocabulary 50257, 8×256 random tokens, eager
  attention (``benchmarks.workloads``), next-token cross-entropy; KFAC over the transformer
  blocks' ``Conv1D`` layers (the tied ``lm_head``/``wte``, position embeddings and LayerNorms left
  out). Only the ``mc`` and ``empirical`` Fisher types (type-2 has a column per vocabulary entry).

Per cell:

- ``gradient``: ``torch.autograd.grad`` of the mean loss over every parameter (the unit);
- ``ours``: ``KFACOperator(...)`` construction, which computes the factors;
- ``curvlinops``: ``KFACLinearOperator(...)`` construction plus ``compute_kronecker_factors()``
  on the same parameters; an exception (a layer type it does not support) is reported in the
  cell's ``errors`` instead of a time.

Each Fisher type in ``--fisher`` (default ``mc`` with one sample, and ``empirical``). Every cell is
printed as a JSON line as soon as it is measured; ``--out`` writes all of them with the versions.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from hessian_eigenthings import KFACOperator
from hessian_eigenthings.loss_fns import supervised_forward, supervised_loss_of_output
from hessian_eigenthings.operators.conv_factors import conv_factor_plan, conv_input_moment


class Block(nn.Module):
    def __init__(self, c_in: int, c_out: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.skip: nn.Module = nn.Identity()
        if stride != 1 or c_in != c_out:
            self.skip = nn.Sequential(
                nn.Conv2d(c_in, c_out, 1, stride, bias=False), nn.BatchNorm2d(c_out)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(h)) + self.skip(x))


def resnet_like(width: int = 32, classes: int = 10) -> nn.Module:
    """ResNet-18's shape at CIFAR scale: a stem, four stages of two blocks, a linear head."""
    stages, c = [], width
    for i, w in enumerate((width, 2 * width, 4 * width, 8 * width)):
        stages += [Block(c, w, 1 if i == 0 else 2), Block(w, w, 1)]
        c = w
    return nn.Sequential(
        nn.Conv2d(3, width, 3, 1, 1, bias=False),
        nn.BatchNorm2d(width),
        nn.ReLU(),
        *stages,
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(c, classes),
    )


def mlp(d: int = 784, hidden: int = 1024, classes: int = 10) -> nn.Module:
    return nn.Sequential(
        nn.Linear(d, hidden),
        nn.ReLU(),
        nn.Linear(hidden, hidden),
        nn.ReLU(),
        nn.Linear(hidden, classes),
    )


def _timer(device: torch.device) -> Callable[[Callable[[], Any]], float]:
    def run(fn: Callable[[], Any]) -> float:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize(device)
            return float(start.elapsed_time(end))
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3

    return run


@dataclass
class Cell:
    name: str
    model: nn.Module  # batch[0] -> logits (rows, classes)
    batch: tuple[torch.Tensor, torch.Tensor]
    kfac_params: list[str]  # names of the parameters both KFACs cover
    num_data: int
    loss_terms: int = 1  # per sample (curvlinops' num_per_example_loss_terms)


def _linear_and_conv(model: nn.Module) -> list[str]:
    names = [n for n, m in model.named_modules() if isinstance(m, (nn.Linear, nn.Conv2d))]
    ids = {id(p) for n in names for p in model.get_submodule(n).parameters()}
    return [n for n, p in model.named_parameters() if id(p) in ids]


def _image_cell(
    name: str, model: nn.Module, shape: tuple[int, ...], batch: int, device: torch.device
) -> Cell:
    x = torch.randn(batch, *shape, device=device)
    y = torch.randint(0, 10, (batch,), device=device)
    model = model.to(device).eval()
    return Cell(name, model, (x, y), _linear_and_conv(model), batch)


def _gpt2_cell(device: torch.device, quick: bool) -> Cell:
    from benchmarks.workloads import build_parity

    w = build_parity("gpt2", str(device), 0.25 if quick else 1.0)
    ids, targets = w.batches[0]
    blocks = re.compile(r"lm\.transformer\.h\.\d+\.(attn|mlp)\.c_\w+\.(weight|bias)")
    names = [n for n, _ in w.model.named_parameters() if blocks.fullmatch(n)]
    return Cell(w.name, w.model.eval(), (ids, targets), names, ids.shape[0], ids.shape[1] - 1)


def bench(cell: Cell, fisher: str, repeats: int, device: torch.device) -> dict[str, Any]:
    model, batch = cell.model, cell.batch
    data = [batch]
    criterion = nn.CrossEntropyLoss()
    params = [p for p in model.parameters() if p.requires_grad]
    named = dict(model.named_parameters())
    kfac_params = [named[n] for n in cell.kfac_params]

    def gradient() -> Any:
        return torch.autograd.grad(criterion(model(batch[0]), batch[1]), params)

    def ours() -> Any:
        return KFACOperator(
            model,
            data,
            supervised_forward,
            supervised_loss_of_output(criterion),
            fisher_type=fisher,  # type: ignore[arg-type]
            param_filter=cell.kfac_params,
        )

    variants: dict[str, Callable[[], Any]] = {"gradient": gradient, "ours": ours}
    errors: dict[str, str] = {}
    try:
        import curvlinops

        def theirs() -> Any:
            op = curvlinops.KFACLinearOperator(
                model,
                criterion,
                kfac_params,
                data,
                check_deterministic=False,
                fisher_type={"type2": "type-2"}.get(fisher, fisher),
                num_data=cell.num_data,
                num_per_example_loss_terms=cell.loss_terms,
            )
            op.compute_kronecker_factors()
            return op

        variants["curvlinops"] = theirs
    except ImportError as e:
        errors["curvlinops"] = f"not installed: {e}"
    timer = _timer(device)
    for key, fn in list(variants.items()):  # warm-up (cuDNN autotuning, allocator)
        try:
            fn()
        except Exception as e:  # a model the implementation does not cover: say so in the cell
            errors[key] = f"{type(e).__name__}: {str(e)[:300]}"
            del variants[key]
    times: dict[str, list[float]] = {k: [] for k in variants}
    for _ in range(repeats):
        for key, fn in variants.items():
            times[key].append(timer(fn))
    med = {k: statistics.median(v) for k, v in times.items()}
    row: dict[str, Any] = {
        "workload": cell.name,
        "fisher_type": fisher,
        "batch": int(batch[0].shape[0]),
        "kfac_parameters": sum(p.numel() for p in kfac_params),
        "repeats": repeats,
        "ms": med,
    }
    if "ours" in med and "gradient" in med:
        row["ours_over_gradient"] = med["ours"] / med["gradient"]
    if "curvlinops" in med and "ours" in med:
        row["ours_over_curvlinops"] = med["ours"] / med["curvlinops"]
        row["curvlinops_over_gradient"] = med["curvlinops"] / med["gradient"]
    if errors:
        row["errors"] = errors
    return row


def bench_conv_factors(cell: Cell, repeats: int, device: torch.device) -> dict[str, Any]:
    """The input factors of every Conv2d alone, on the inputs one forward gives them: the
    unfolded patches' product (``F.unfold``, what KFAC did before) against
    ``conv_input_moment`` (``impl="auto"``), with the multiply-adds of each."""
    inputs: list[tuple[nn.Conv2d, torch.Tensor]] = []
    hooks = [
        m.register_forward_hook(lambda m, a, o: inputs.append((m, a[0].detach())))
        for m in cell.model.modules()
        if isinstance(m, nn.Conv2d)
    ]
    with torch.no_grad():
        cell.model(cell.batch[0])
    for h in hooks:
        h.remove()

    def geometry(m: nn.Conv2d) -> tuple[Any, Any, Any, Any]:
        return m.kernel_size, m.stride, m.padding, m.dilation

    def unfolded() -> None:
        for m, x in inputs:
            k, st, pad, dil = geometry(m)
            a = F.unfold(x, k, dilation=dil, padding=pad, stride=st).transpose(1, 2)
            flat = a.reshape(-1, a.shape[-1])
            flat.T @ flat

    def ours() -> None:
        for m, x in inputs:
            conv_input_moment(x, *geometry(m))

    plans = [conv_factor_plan(x.shape, *geometry(m), device_type=x.device.type) for m, x in inputs]
    timer = _timer(device)
    times: dict[str, list[float]] = {"unfold": [], "ours": []}
    unfolded()  # warm-up
    ours()
    for _ in range(repeats):
        times["unfold"].append(timer(unfolded))
        times["ours"].append(timer(ours))
    med = {k: statistics.median(v) for k, v in times.items()}
    macs = sum(p.multiply_adds for p in plans)
    ref = sum(p.unfold_multiply_adds for p in plans)
    return {
        "workload": cell.name,
        "cell": "conv input factors alone",
        "batch": int(cell.batch[0].shape[0]),
        "layers": len(plans),
        "routes": {r: sum(p.route == r for p in plans) for r in ("rows", "unfold", "zero")},
        "ms": med,
        "ours_over_unfold": med["ours"] / med["unfold"],
        "gmac": {"unfold": ref / 1e9, "ours": macs / 1e9},
        "macs_ours_over_unfold": macs / ref,
    }


WORKLOADS = ("mlp", "resnet_like", "resnet18", "gpt2")


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--batch", type=int, default=128, help="images per batch (not GPT-2: 8×256)")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument(
        "--fisher", nargs="+", default=["mc", "empirical"], choices=["type2", "mc", "empirical"]
    )
    ap.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=WORKLOADS)
    ap.add_argument("--quick", action="store_true", help="small models, 2 repeats (CPU smoke run)")
    ap.add_argument(
        "--factors",
        action="store_true",
        help="also time the conv input factors alone (unfolded product vs ours) per CNN",
    )
    ap.add_argument("--out", default=None, help="JSON file for the results")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.manual_seed(0)
    if args.quick:
        args.batch, args.repeats = min(args.batch, 16), 2
    meta = {
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else platform.processor() or "cpu",
        "threads": torch.get_num_threads(),
    }
    try:
        import curvlinops

        meta["curvlinops"] = curvlinops.__version__
    except (ImportError, AttributeError):
        pass
    rows = []
    for key in args.workloads:
        torch.manual_seed(0)
        if key == "mlp":
            cell = _image_cell("MLP 784-1024-1024-10", mlp(), (784,), args.batch, device)
            if args.quick:
                cell = _image_cell(
                    "MLP 64-64-64-10 (quick)", mlp(64, 64), (64,), args.batch, device
                )
        elif key == "resnet_like":
            width, side = (8, 16) if args.quick else (32, 32)
            name = f"ResNet-like CNN width {width}, {side}x{side}"
            cell = _image_cell(name, resnet_like(width), (3, side, side), args.batch, device)
        elif key == "resnet18":
            from benchmarks.workloads import ResNet18

            cell = _image_cell("ResNet-18 32x32", ResNet18(), (3, 32, 32), args.batch, device)
        else:
            cell = _gpt2_cell(device, args.quick)
        if args.factors and key in ("resnet_like", "resnet18"):
            row = bench_conv_factors(cell, args.repeats, device)
            row["device"] = meta["device"]
            print(json.dumps(row), flush=True)
            rows.append(row)
        for fisher in args.fisher:
            if key == "gpt2" and fisher == "type2":
                continue  # a backward per vocabulary entry
            row = bench(cell, fisher, args.repeats, device)
            row["device"] = meta["device"]
            print(json.dumps(row), flush=True)
            rows.append(row)
        del cell
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
