"""KFAC factor computation: ours against curvlinops' ``KFACLinearOperator``, and a gradient.

    python -m benchmarks.bench_kfac --device cuda --out bench_out/kfac.json
    python -m benchmarks.bench_kfac --quick          # CPU smoke run, seconds

Side by side in one process, repeats interleaved, medians after a warm-up (CUDA events on a
GPU). Per workload (an MLP and a small ResNet-like CNN written here, no torchvision), one batch
of ``--batch`` samples, cross-entropy, fp32, eval mode:

- ``gradient``: ``torch.autograd.grad`` of the mean loss (the unit);
- ``ours``: ``KFACOperator(...)`` construction, which computes the factors;
- ``curvlinops``: ``KFACLinearOperator(...)`` construction plus ``compute_kronecker_factors()``.

Each Fisher type in ``--fisher`` (default ``mc`` with one sample, and ``empirical``; ``type2``
backpropagates a column per class). Results are printed and written as JSON (``--out``).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from hessian_eigenthings import KFACOperator
from hessian_eigenthings.loss_fns import supervised_forward, supervised_loss_of_output


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


def bench(
    name: str,
    model: nn.Module,
    batch: tuple[torch.Tensor, torch.Tensor],
    fisher: str,
    repeats: int,
    device: torch.device,
) -> dict[str, Any]:
    model = model.to(device).eval()
    data = [batch]
    criterion = nn.CrossEntropyLoss()
    params = [p for p in model.parameters() if p.requires_grad]
    # our KFAC covers Linear and Conv2d; BatchNorm's parameters are left out of both operators
    names = [n for n, m in model.named_modules() if isinstance(m, (nn.Linear, nn.Conv2d))]
    kfac_params = [p for n in names for p in model.get_submodule(n).parameters()]
    ids = {id(p) for p in kfac_params}
    flt = [n for n, p in model.named_parameters() if id(p) in ids]

    def gradient() -> Any:
        return torch.autograd.grad(criterion(model(batch[0]), batch[1]), params)

    def ours() -> Any:
        return KFACOperator(
            model,
            data,
            supervised_forward,
            supervised_loss_of_output(criterion),
            fisher_type=fisher,
            param_filter=flt,
        )  # type: ignore[arg-type]

    variants: dict[str, Callable[[], Any]] = {"gradient": gradient, "ours": ours}
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
                num_data=batch[0].shape[0],
                num_per_example_loss_terms=1,
            )
            op.compute_kronecker_factors()
            return op

        variants["curvlinops"] = theirs
    except ImportError:
        pass
    timer = _timer(device)
    times: dict[str, list[float]] = {k: [] for k in variants}
    for fn in variants.values():  # warm-up (cuDNN autotuning, allocator)
        fn()
    for _ in range(repeats):
        for key, fn in variants.items():
            times[key].append(timer(fn))
    med = {k: statistics.median(v) for k, v in times.items()}
    row: dict[str, Any] = {
        "workload": name,
        "fisher_type": fisher,
        "batch": batch[0].shape[0],
        "ms": med,
    }
    row["ours_over_gradient"] = med["ours"] / med["gradient"]
    if "curvlinops" in med:
        row["ours_over_curvlinops"] = med["ours"] / med["curvlinops"]
        row["curvlinops_over_gradient"] = med["curvlinops"] / med["gradient"]
    return row


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument(
        "--fisher", nargs="+", default=["mc", "empirical"], choices=["type2", "mc", "empirical"]
    )
    ap.add_argument("--quick", action="store_true", help="tiny models, 2 repeats (CPU smoke run)")
    ap.add_argument("--out", default=None, help="JSON file for the results")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.manual_seed(0)
    if args.quick:
        args.batch, args.repeats = min(args.batch, 16), 2
        models = {"mlp": (mlp(64, 64), (64,)), "resnet_like": (resnet_like(8), (3, 16, 16))}
    else:
        models = {"mlp": (mlp(), (784,)), "resnet_like": (resnet_like(), (3, 32, 32))}
    rows = []
    for name, (model, shape) in models.items():
        x = torch.randn(args.batch, *shape, device=device)
        y = torch.randint(0, 10, (args.batch,), device=device)
        for fisher in args.fisher:
            row = bench(name, model, (x, y), fisher, args.repeats, device)
            print(json.dumps(row))
            rows.append(row)
    meta = {
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else platform.processor() or "cpu",
    }
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
