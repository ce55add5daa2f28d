"""Workloads of ../shared/ANCHORS.md, built locally (no downloads).

Each workload is ``(model, batch, loss_fn)`` with ``loss_fn(model, batch)``
returning the mean loss; ``batch`` is already on the device.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn


@dataclass
class Workload:
    name: str
    model: nn.Module
    batch: Any
    loss_fn: Callable[[nn.Module, Any], torch.Tensor]


def _ce(model: nn.Module, batch: Any) -> torch.Tensor:
    return nn.functional.cross_entropy(model(batch[0]), batch[1])


class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.short: nn.Module = nn.Identity()
        if stride != 1 or cin != cout:
            self.short = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(h)) + self.short(x))


class ResNet18(nn.Module):
    """The standard ResNet-18 layout (ImageNet stem), 10 classes."""

    def __init__(self, num_classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64), nn.ReLU(), nn.MaxPool2d(3, 2, 1))
        layers: list[nn.Module] = []
        cin = 64
        for cout, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
            layers += [BasicBlock(cin, cout, stride), BasicBlock(cout, cout, 1)]
            cin = cout
        self.layers = nn.Sequential(*layers)
        self.fc = nn.Linear(512, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.layers(self.stem(x))
        return self.fc(torch.flatten(nn.functional.adaptive_avg_pool2d(h, 1), 1))


def mlp(device: str, scale: float = 1.0) -> Workload:
    b = max(8, int(1024 * scale))
    model = nn.Sequential(nn.Linear(784, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10))
    batch = (torch.randn(b, 784), torch.randint(0, 10, (b,)))
    return Workload("MLP 784-1024-1024-10", model.to(device).eval(), tuple(t.to(device) for t in batch), _ce)


def resnet18(device: str, scale: float = 1.0) -> Workload:
    b = max(4, int(128 * scale))
    batch = (torch.randn(b, 3, 32, 32), torch.randint(0, 10, (b,)))
    return Workload("ResNet-18 32x32", ResNet18().to(device).eval(), tuple(t.to(device) for t in batch), _ce)


def gpt2(device: str, scale: float = 1.0) -> Workload:
    from transformers import GPT2Config, GPT2LMHeadModel

    layers = 6 if scale >= 1 else 2
    seq = 256 if scale >= 1 else 64
    cfg = GPT2Config(n_layer=layers, n_embd=512, n_head=8, vocab_size=50257, n_positions=max(seq, 256),
                     attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0)
    try:
        model = GPT2LMHeadModel._from_config(cfg, attn_implementation="eager")
    except (TypeError, ValueError):
        cfg._attn_implementation = "eager"
        model = GPT2LMHeadModel(cfg)
    ids = torch.randint(0, 50257, (max(1, int(8 * min(scale, 1))), seq))

    def lm_loss(m: nn.Module, batch: Any) -> torch.Tensor:
        logits = m(input_ids=batch["input_ids"]).logits
        return nn.functional.cross_entropy(
            logits[:, :-1].reshape(-1, logits.shape[-1]), batch["input_ids"][:, 1:].reshape(-1)
        )

    return Workload("GPT-2 style 6L d512", model.to(device).eval(), {"input_ids": ids.to(device)}, lm_loss)


WORKLOADS: dict[str, Callable[[str, float], Workload]] = {"mlp": mlp, "resnet18": resnet18, "gpt2": gpt2}
