"""Shared models and data for the test suite (float64 unless a test says otherwise)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from hessian_eigenthings.operators.engines import TRACE_TIMES

# NOTE [trace times]: no test reads or writes the user's record of trace times, and none sees a
# time another test recorded (auto's choices must not depend on the order tests run in); the
# record's own tests point it at a temporary directory. Subprocesses inherit this.
os.environ["HESSIAN_EIGENTHINGS_TRACE_TIMES"] = "0"


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)
    TRACE_TIMES.clear()


# NOTE [a steady clock for auto]
# engine="auto" times products to choose a runner (NOTE [auto engine]); on a machine whose cores
# other jobs load, a product can take 100x its quiet time, and a test that counts forwards,
# passes or warnings then saw another engine's counts (tox -e torch24 on a busy 2-core host:
# num_forwards 1 against 2). Tests therefore see auto time every pass at a fixed 1 ms, so its
# choices follow from product counts alone; auto's own tests (marked real_clock) use the clock.
STEADY_PASS_MS = 1.0


@pytest.fixture(autouse=True)
def _steady_clock(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    if request.node.get_closest_marker("real_clock") is not None:
        return
    from hessian_eigenthings.operators.engines import auto

    def steady(device: torch.device, fn: Any) -> tuple[Any, float]:
        return fn(), STEADY_PASS_MS

    monkeypatch.setattr(auto, "timed", steady)


@pytest.fixture
def record_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The record of NOTE [trace times] in a temporary folder (off in every other test)."""
    from hessian_eigenthings.operators.engines import trace_times

    folder = tmp_path / "record"
    monkeypatch.setenv(trace_times.ENV, str(folder))
    return folder


def mlp(d_in: int = 5, hidden: int = 7, d_out: int = 3) -> nn.Module:
    return nn.Sequential(nn.Linear(d_in, hidden), nn.Tanh(), nn.Linear(hidden, d_out)).double()


class SmallCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 3, 3, padding=1)
        self.bn = nn.BatchNorm2d(3)
        self.fc = nn.Linear(3 * 4 * 4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.bn(self.conv(x)))
        return self.fc(h.flatten(1))


class TinyTransformer(nn.Module):
    """Embedding + one attention block + head; batches are dicts."""

    def __init__(self, vocab: int = 11, d: int = 8) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.qkv = nn.Linear(d, 3 * d)
        self.out = nn.Linear(d, d)
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(input_ids)
        q, k, v = self.qkv(h).chunk(3, dim=-1)
        a = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        h = self.norm(h + self.out(a))
        return self.head(h)


def classification_data(n: int = 10, d_in: int = 5, classes: int = 3, batch: int = 4):
    X = torch.randn(n, d_in, dtype=torch.float64)
    Y = torch.randint(0, classes, (n,))
    return [(X[i : i + batch], Y[i : i + batch]) for i in range(0, n, batch)]
