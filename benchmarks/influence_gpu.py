"""hessian_eigenthings.influence against Kronfluence 1.0.1 at LM scale, side by side in one process.

The issue's setting: GPT-2 124 M (12 layers, from its config, random weights), 1,000 training
sequences × 512 tokens, 16 queries, EK-FAC over the blocks' Linear layers (HuggingFace's
Conv1D turned into nn.Linear, which Kronfluence tracks; the tied head left out by both), the
same per-sequence summed loss, one Monte-Carlo label per token (both tools' default for a
vocabulary), weight and bias in one block (Kronfluence's), the same absolute damping, the same
batch sizes. Wall = factor fitting + pairwise scores, each tool as a user runs it (Kronfluence
writes its factors and scores to a directory, on local disk here). Peak = the CUDA allocator's
peak during the tool's run. ``--dtype bf16``: the model's parameters in bfloat16 as users load
them (both tools keep their factors in float32).

Kronfluence is not a dependency: on the device it travels as a wheel (see benchmarks/device/).

    python benchmarks/influence_gpu.py --out result.json            # the issue's setting
    python benchmarks/influence_gpu.py --layers 2 --n-train 16 --length 32 --queries 4 --device cpu
"""

from __future__ import annotations

import argparse
import copy
import functools
import gc
import json
import platform
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
import transformers
from torch import nn
from torch.utils.data import Dataset

from hessian_eigenthings import influence


def build_model(layers: int, dtype: torch.dtype, device: str) -> nn.Module:
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=layers, attn_implementation="eager")
    model = transformers.GPT2LMHeadModel(config)
    return conv1d_as_linear(model).to(device=device, dtype=dtype).eval()


def conv1d_as_linear(model: nn.Module) -> nn.Module:
    """HuggingFace's Conv1D (``x @ W + b``, ``W (in, out)``) replaced by the nn.Linear of ``Wᵀ``,
    which Kronfluence tracks; in place."""
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if type(child).__name__ == "Conv1D":
                linear = nn.Linear(child.weight.shape[0], child.weight.shape[1])
                with torch.no_grad():
                    linear.weight.copy_(child.weight.T)
                    linear.bias.copy_(child.bias)
                setattr(module, name, linear)
    return model


class Sequences(Dataset[dict[str, torch.Tensor]]):
    def __init__(self, ids: torch.Tensor) -> None:
        self.ids = ids

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i]}


def summed_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    rows = logits[:, :-1].float()
    return F.cross_entropy(
        rows.reshape(-1, rows.shape[-1]), labels[:, 1:].reshape(-1), reduction="sum"
    )


def kronfluence_task(tracked: list[str]) -> Any:
    from kronfluence.task import Task

    class LMTask(Task):  # type: ignore[misc]
        def compute_train_loss(
            self, batch: Any, model: nn.Module, sample: bool = False
        ) -> torch.Tensor:
            logits = model(input_ids=batch["input_ids"], use_cache=False).logits
            if not sample:
                return summed_loss(logits, batch["input_ids"])
            with torch.no_grad():  # one label per token from the model's distribution
                # summed_loss pairs position t's logits with label t + 1: draw that label from
                # position t's distribution (the draw at the last position is never read)
                probs = logits[:, :-1].detach().float().softmax(-1)
                drawn = torch.multinomial(probs.reshape(-1, probs.shape[-1]), 1)
                labels = batch["input_ids"].clone()
                labels[:, 1:] = drawn.view(probs.shape[:2])
            return summed_loss(logits, labels)

        def compute_measurement(self, batch: Any, model: nn.Module) -> torch.Tensor:
            logits = model(input_ids=batch["input_ids"], use_cache=False).logits
            return summed_loss(logits, batch["input_ids"])

        def get_influence_tracked_modules(self) -> list[str]:
            return tracked

    return LMTask()


def run_kronfluence(
    model: nn.Module, tracked: list[str], train: torch.Tensor, query: torch.Tensor, a: Any
) -> torch.Tensor:
    from kronfluence.analyzer import Analyzer, prepare_model
    from kronfluence.arguments import FactorArguments, ScoreArguments

    task = kronfluence_task(tracked)
    prepared = prepare_model(model, task)
    with tempfile.TemporaryDirectory() as out:
        analyzer = Analyzer(
            "bench", prepared, task, cpu=a.device == "cpu", disable_tqdm=True, output_dir=out
        )
        analyzer.fit_all_factors(
            "ekfac",
            Sequences(train),
            per_device_batch_size=a.batch,
            factor_args=FactorArguments(
                strategy="ekfac", use_empirical_fisher=a.fisher == "empirical"
            ),
            overwrite_output_dir=True,
        )
        analyzer.compute_pairwise_scores(
            "scores",
            "ekfac",
            Sequences(query),
            Sequences(train),
            per_device_query_batch_size=a.queries,
            per_device_train_batch_size=a.batch,
            score_args=ScoreArguments(damping_factor=a.damping),
            overwrite_output_dir=True,
        )
        scores = analyzer.load_pairwise_scores("scores")
        if scores is None:
            raise RuntimeError("Kronfluence wrote no scores")
        return -scores["all_modules"].float().cpu()  # NOTE [influence sign]: ours is negated


def run_ours(
    model: nn.Module, tracked: list[str], train: torch.Tensor, query: torch.Tensor, a: Any
) -> torch.Tensor:
    chosen = set(tracked)
    train_batches = [{"input_ids": train[i : i + a.batch]} for i in range(0, len(train), a.batch)]
    fitted = influence.fit(
        model,
        train_batches,
        influence.causal_lm_task(),
        damping=a.damping,
        fisher_type=a.fisher,
        separate_bias=False,
        param_filter=lambda name, p: name.rsplit(".", 1)[0] in chosen,
    )
    scores = fitted.pairwise_scores([{"input_ids": query}], train_batches, progress=False)
    return scores.float().cpu()


def timed(fn: Callable[[], torch.Tensor], device: str) -> tuple[torch.Tensor, float, int]:
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    start = time.perf_counter()
    out = fn()
    if device == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    peak = torch.cuda.max_memory_allocated() - base if device == "cuda" else 0
    return out, seconds, peak


def spearman(a: torch.Tensor, b: torch.Tensor) -> float:
    ra = a.argsort().argsort().double()
    rb = b.argsort().argsort().double()
    return float(torch.corrcoef(torch.stack([ra, rb]))[0, 1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--n-train", type=int, default=1000)
    p.add_argument("--length", type=int, default=512)
    p.add_argument("--queries", type=int, default=16)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--damping", type=float, default=1e-3)
    p.add_argument("--fisher", choices=("mc", "empirical"), default="mc")
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--order", default="ours,kronfluence", help="which tools, in this order")
    p.add_argument("--out", default=None)
    a = p.parse_args()
    dtype = torch.float32 if a.dtype == "fp32" else torch.bfloat16
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    g = torch.Generator().manual_seed(1)
    vocab = transformers.GPT2Config().vocab_size
    train = torch.randint(0, vocab, (a.n_train, a.length), generator=g).to(a.device)
    query = torch.randint(0, vocab, (a.queries, a.length), generator=g).to(a.device)
    model = build_model(a.layers, dtype, a.device)
    tracked = [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and n != "lm_head"]
    report: dict[str, Any] = {
        "setting": {k: v for k, v in vars(a).items() if k != "out"},
        "tracked_modules": len(tracked),
        "parameters_scored": sum(
            p.numel() for n, p in model.named_parameters() if n.rsplit(".", 1)[0] in tracked
        ),
        "versions": {
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "python": platform.python_version(),
            "device": torch.cuda.get_device_name() if a.device == "cuda" else platform.processor(),
            "tf32": False,
        },
    }
    results: dict[str, torch.Tensor] = {}
    runners = {"ours": run_ours, "kronfluence": run_kronfluence}
    for name in a.order.split(","):
        # Kronfluence's prepare_model wraps modules and freezes parameters in place: a copy each
        scores, seconds, peak = timed(
            functools.partial(runners[name], copy.deepcopy(model), tracked, train, query, a),
            a.device,
        )
        results[name] = scores
        report[name] = {"seconds": round(seconds, 2), "peak_bytes": peak}
        print(json.dumps({name: report[name]}), flush=True)
    if "ours" in results and "kronfluence" in results:
        ours, theirs = results["ours"], results["kronfluence"]
        overlap = [
            len(set(ours[q].argsort()[:10].tolist()) & set(theirs[q].argsort()[:10].tolist())) / 10
            for q in range(len(ours))
        ]
        report["wall_ratio_ours_over_kronfluence"] = round(
            report["ours"]["seconds"] / report["kronfluence"]["seconds"], 3
        )
        report["peak_ratio_ours_over_kronfluence"] = round(
            report["ours"]["peak_bytes"] / max(report["kronfluence"]["peak_bytes"], 1), 3
        )
        report["spearman_all"] = spearman(ours.flatten(), theirs.flatten())
        report["top10_helpful_overlap_mean"] = sum(overlap) / len(overlap)
        report["max_relative_difference"] = float((ours - theirs).abs().max() / theirs.abs().max())
    text = json.dumps(report, indent=2)
    print(text)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
