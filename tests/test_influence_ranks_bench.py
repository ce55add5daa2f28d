"""benchmarks/influence_ranks.py (issue 40's several-GPU influence run) on gloo CPU ranks with its
tiny Llama in float64: the columns the ranks write are one process's scores on the union of
their shards (``influence.fit`` + ``pairwise_scores`` without ranks), and the figures add up."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Literal

import pytest
import torch
import torch.distributed as dist
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

pytest.importorskip("transformers")

from benchmarks import influence_ranks as ir  # noqa: E402
from hessian_eigenthings import influence  # noqa: E402
from tests.launch import launch  # noqa: E402

no_gloo = not (dist.is_available() and dist.is_gloo_available())
SCRIPT = str(ROOT / "benchmarks" / "influence_ranks.py")
# 7 sequences of 12 tokens: uneven shards (3 and 4) on 2 ranks, a short last batch on one
N_TRAIN, LENGTH, QUERIES, BATCH = 7, 12, 3, 2
SHAPE = ["--workload", "tiny", "--device", "cpu", "--dtype", "fp64"]
SHAPE += ["--n-train", str(N_TRAIN), "--length", str(LENGTH), "--queries", str(QUERIES)]
SHAPE += ["--batch", str(BATCH)]


def _run(world: int, out: Path, *args: str) -> dict[str, Any]:
    out.mkdir(parents=True, exist_ok=True)
    launch(world, out, [SCRIPT, *SHAPE, *args, "--out", str(out / "result.json")])
    report: dict[str, Any] = json.loads((out / "result.json").read_text())
    return report


def _reference(
    fisher: Literal["mc", "empirical"], shards: list[tuple[int, int]]
) -> tuple[Any, list[Any], list[Any], nn.Module]:
    """One process on the union of the training sequences, in the ranks' batches (each shard
    cut into batches of BATCH): HF's eager attention takes its softmax in float32, so a float64
    model's forward differs at ~1e-8 between batch shapes, and the fitted curvature with it."""
    model = ir.build_model("tiny", LENGTH, torch.float64, torch.device("cpu"))
    train, query = ir.sequences("tiny", N_TRAIN, QUERIES, LENGTH)
    batches = [
        {"input_ids": train[s : min(s + BATCH, b)]} for a, b in shards for s in range(a, b, BATCH)
    ]
    fitted = influence.fit(
        model, batches, influence.causal_lm_task(), fisher_type=fisher, separate_bias=False
    )
    return fitted, batches, [{"input_ids": query}], model


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).abs().max() / want.abs().max())


def _check_figures(report: dict[str, Any], world: int, model: nn.Module) -> None:
    assert report["complete"] and report["world_size"] == world
    assert report["backend"] == "gloo"
    assert report["scores_shape"] == [QUERIES, N_TRAIN]
    # the scored parameters: every Linear weight but the head tied to the embedding
    linear = [m for n, m in model.named_modules() if isinstance(m, nn.Linear) and n != "lm_head"]
    assert report["parameters_scored"] == sum(m.weight.numel() for m in linear)
    assert any("tied" in e for e in report["excluded_parameters"])
    fit, scores = report["fit"]["seconds"], report["scores_phase"]["seconds"]
    assert fit > 0 and scores > 0
    assert report["job_seconds"] == pytest.approx(fit + scores, rel=1e-12)
    per = report["seconds_per_1000_train"]
    assert per["job"] == pytest.approx(report["job_seconds"] / N_TRAIN * 1000, rel=1e-12)
    assert per["scores"] == pytest.approx(scores / N_TRAIN * 1000, rel=1e-12)
    for row in (report["fit"], report["scores_phase"]):
        assert len(row["busy_seconds"]) == world
        # each rank's own clock: positive (not compared with rank 0's phase, another clock)
        assert all(b > 0 for b in row["busy_seconds"])
        assert row["peak_bytes"] == [None] * world  # no CUDA allocator on the CPU
    assert len(report["host_peak_gib_ranks"]) == world


@pytest.mark.slow
@pytest.mark.skipif(no_gloo, reason="needs torch.distributed, gloo")
def test_two_ranks_write_one_process_low_rank_scores_on_the_union(tmp_path: Path) -> None:
    """Empirical labels (Monte-Carlo draws are keyed by rank: NOTE in the script's docstring),
    low-rank queries of rank 2: the ranks' columns, concatenated, are the scores of one process
    on all 7 sequences."""
    report = _run(2, tmp_path, "--fisher", "empirical", "--rank", "2")
    fitted, train, query, model = _reference("empirical", [(0, 3), (3, 7)])
    want = fitted.pairwise_scores(query, train, rank=2, progress=False)
    got = torch.tensor(report["scores"], dtype=torch.float64)
    assert report["shards"] == [[0, 3], [3, 7]]
    assert _relative(got, want) <= 1e-10
    assert report["damping"] == pytest.approx(fitted.damping, rel=1e-12)
    # --rank reached pairwise_scores: the exact scores are another matrix
    assert _relative(fitted.pairwise_scores(query, train, progress=False), want) > 1e-3
    _check_figures(report, 2, model)


@pytest.mark.slow
@pytest.mark.skipif(no_gloo, reason="needs torch.distributed, gloo")
def test_one_rank_with_monte_carlo_labels_writes_the_exact_scores(tmp_path: Path) -> None:
    """The benchmark's labels (one Monte-Carlo draw per token, rank 0's keys) and exact scores
    (``--rank 0``) on a group of one rank."""
    report = _run(1, tmp_path, "--fisher", "mc", "--rank", "0")
    fitted, train, query, model = _reference("mc", [(0, N_TRAIN)])
    want = fitted.pairwise_scores(query, train, progress=False)
    got = torch.tensor(report["scores"], dtype=torch.float64)
    assert report["fisher_type"] == "mc" and report["shards"] == [[0, N_TRAIN]]
    assert _relative(got, want) <= 1e-10
    # the labels reached fit: the empirical Fisher's scores are another matrix
    empirical, *_ = _reference("empirical", [(0, N_TRAIN)])
    assert _relative(empirical.pairwise_scores(query, train, progress=False), want) > 1e-3
    _check_figures(report, 1, model)


def test_more_ranks_than_training_sequences_are_refused(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(SystemExit):
        ir.main(["--workload", "tiny", "--device", "cpu", "--n-train", "3"])
    assert "--n-train 3 leaves a rank of 4 without training sequences" in capsys.readouterr().err
