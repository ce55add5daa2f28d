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


def _gpt2_lm(layers: int, width: int, heads: int, positions: int) -> nn.Module:
    """A randomly initialised GPT-2 LM (vocabulary 50257, no dropout) with eager attention."""
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(n_layer=layers, n_embd=width, n_head=heads, vocab_size=50257, n_positions=positions,
                     attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0)
    try:
        return GPT2LMHeadModel._from_config(cfg, attn_implementation="eager")
    except (TypeError, ValueError):  # older transformers
        cfg._attn_implementation = "eager"
        return GPT2LMHeadModel(cfg)


#: the GPT-2 workload below scale 1 (CPU runs): layers, width, heads, tokens. Small enough
#: that the algorithm cells (about 2,000 products over all columns) run in minutes on
#: one CPU thread; the vocabulary stays at 50257, the part that dominates an LM product.
GPT2_REDUCED = (2, 128, 2, 32)


def gpt2(device: str, scale: float = 1.0) -> Workload:
    layers, width, heads, seq = (6, 512, 8, 256) if scale >= 1 else GPT2_REDUCED
    model = _gpt2_lm(layers, width, heads, max(seq, 256))
    ids = torch.randint(0, 50257, (max(1, int(8 * min(scale, 1))), seq))

    def lm_loss(m: nn.Module, batch: Any) -> torch.Tensor:
        # no key/value cache: a product needs none, and its setup copies host tensors
        logits = m(input_ids=batch["input_ids"], use_cache=False).logits
        return nn.functional.cross_entropy(
            logits[:, :-1].reshape(-1, logits.shape[-1]), batch["input_ids"][:, 1:].reshape(-1)
        )

    return Workload("GPT-2 style 6L d512", model.to(device).eval(), {"input_ids": ids.to(device)}, lm_loss)


WORKLOADS: dict[str, Callable[[str, float], Workload]] = {"mlp": mlp, "resnet18": resnet18, "gpt2": gpt2}


# --------------------------------------------------------------------------
# Parity workloads (benchmarks/harness, `python -m benchmarks run --suite parity`)
# --------------------------------------------------------------------------
# Every parity workload is framework-neutral: ``model(X) -> logits (N, C)``,
# a list of ``(X, y)`` batches and a mean cross-entropy criterion, so the same
# definition runs against our core, the 0.x facade, a plain-PyTorch baseline,
# hessian-eigenthings 1.0.0a5 and curvlinops. This module must not import
# ``hessian_eigenthings``: peer columns import it in a subprocess where that
# name is another release.


@dataclass
class ParityWorkload:
    key: str
    name: str
    model: nn.Module  # X -> logits (N, C)
    batches: list[tuple[torch.Tensor, torch.Tensor]]
    criterion: nn.Module
    #: the HuggingFace causal LM inside ``model`` (LM workloads): the core may use its LM helpers
    lm: nn.Module | None = None
    note: str = ""

    def loss_fn(self, model: nn.Module, batch: Any) -> torch.Tensor:
        return self.criterion(model(batch[0]), batch[1])

    def per_sample_loss(self, model: nn.Module, batch: Any) -> torch.Tensor:
        """``(N,)`` losses, one per sample of the batch (per sequence on LMs: mean over its tokens)."""
        x, y = batch
        losses = nn.functional.cross_entropy(model(x), y, reduction="none")
        return losses.view(x.shape[0], -1).mean(1)

    @property
    def num_samples(self) -> int:
        return sum(int(x.shape[0]) for x, _ in self.batches)


class LMLogits(nn.Module):
    """``input_ids (B, T) -> shifted logits (B·(T-1), V)``: a causal LM as a classifier of next tokens."""

    def __init__(self, lm: nn.Module) -> None:
        super().__init__()
        self.lm = lm

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        logits = self.lm(input_ids=ids, use_cache=False).logits
        return logits[:, :-1].reshape(-1, logits.shape[-1])


class BNConvNet(nn.Module):
    """A small CIFAR-style CNN with BatchNorm (run in eval mode)."""

    def __init__(self, num_classes: int = 10) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        for cin, cout in ((3, 32), (32, 64), (64, 128)):
            layers += [nn.Conv2d(cin, cout, 3, 1, 1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(), nn.MaxPool2d(2)]
        self.features = nn.Sequential(*layers)
        self.fc = nn.Linear(128, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.flatten(nn.functional.adaptive_avg_pool2d(self.features(x), 1), 1))


def _supervised(key: str, w: Workload, note: str = "") -> ParityWorkload:
    return ParityWorkload(key, w.name, w.model, [w.batch], nn.CrossEntropyLoss(), note=note)


def _lm(key: str, name: str, lm: nn.Module, ids: torch.Tensor, note: str = "") -> ParityWorkload:
    batch = (ids, ids[:, 1:].reshape(-1))
    return ParityWorkload(key, name, LMLogits(lm).eval(), [batch], nn.CrossEntropyLoss(), lm=lm, note=note)


def parity_mlp(device: str, scale: float = 1.0) -> ParityWorkload:
    w = mlp(device, scale)
    return _supervised("mlp", w)


def parity_resnet18(device: str, scale: float = 1.0) -> ParityWorkload:
    return _supervised("resnet18", resnet18(device, scale))


def parity_cnn_bn(device: str, scale: float = 1.0) -> ParityWorkload:
    b = max(4, int(256 * scale))
    batch = (torch.randn(b, 3, 32, 32), torch.randint(0, 10, (b,)))
    model = BNConvNet().to(device).eval()
    w = Workload("CNN+BatchNorm (eval) 32x32", model, tuple(t.to(device) for t in batch), _ce)
    return _supervised("cnn_bn", w)


def parity_mlp_4batches(device: str, scale: float = 1.0) -> ParityWorkload:
    """The MLP over a 4-batch dataset (full_dataset products: one pass over all batches)."""
    b = max(4, int(256 * scale))
    model = nn.Sequential(nn.Linear(784, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10))
    batches = [(torch.randn(b, 784).to(device), torch.randint(0, 10, (b,)).to(device)) for _ in range(4)]
    return ParityWorkload("mlp_4batches", "MLP 784-1024-1024-10, 4 batches", model.to(device).eval(), batches,
                          nn.CrossEntropyLoss())


def parity_gpt2(device: str, scale: float = 1.0) -> ParityWorkload:
    w = gpt2(device, scale)
    assert isinstance(w.batch, dict)
    if scale >= 1:
        return _lm("gpt2", w.name, w.model, w.batch["input_ids"])
    layers, width, _, seq = GPT2_REDUCED
    note = f"reduced: {layers} layers, d={width}, {seq} tokens"
    return _lm("gpt2", f"GPT-2 style {layers}L d{width} (reduced)", w.model, w.batch["input_ids"], note)


def parity_gpt2_large(device: str, scale: float = 1.0) -> ParityWorkload:
    """GPT-2 small geometry (12 layers, d=768, 12 heads), 4 x 512 tokens. GPU only."""
    seq = 512
    model = _gpt2_lm(12, 768, 12, 1024)
    ids = torch.randint(0, 50257, (max(1, int(4 * min(scale, 1))), seq))
    return _lm("gpt2_large", "GPT-2 style 12L d768, 4x512", model.to(device).eval(), ids.to(device))


def parity_tiny(device: str, scale: float = 1.0) -> ParityWorkload:
    """A 2-batch toy MLP for smoke tests (not in the default list)."""
    model = nn.Sequential(nn.Linear(12, 16), nn.Tanh(), nn.Linear(16, 5))
    batches = [(torch.randn(16, 12).to(device), torch.randint(0, 5, (16,)).to(device)) for _ in range(2)]
    return ParityWorkload("tiny", "tiny MLP 12-16-5, 2 batches", model.to(device).eval(), batches, nn.CrossEntropyLoss())


PARITY_WORKLOADS: dict[str, Callable[[str, float], ParityWorkload]] = {
    "tiny": parity_tiny,
    "mlp": parity_mlp,
    "resnet18": parity_resnet18,
    "gpt2": parity_gpt2,
    "cnn_bn": parity_cnn_bn,
    "mlp_4batches": parity_mlp_4batches,
    "gpt2_large": parity_gpt2_large,
}
#: workloads skipped on the CPU (too large for a shared CPU run)
GPU_ONLY = {"gpt2_large"}


def build_parity(key: str, device: str, scale: float = 1.0, seed: int = 0) -> ParityWorkload:
    """The workload ``key``, built identically in every process (seeded, built on the CPU then moved)."""
    torch.manual_seed(seed)
    return PARITY_WORKLOADS[key](device, scale)
