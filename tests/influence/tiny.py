"""The tests' tiny causal LM (a one-layer GPT-2 from a config, float64, eval mode) and batches
that stop a pass part way (``Interrupted``, for the checkpoint tests)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from torch import nn


def tiny_gpt2(vocab: int = 11, seed: int = 1) -> nn.Module:
    import torch

    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(
        vocab_size=vocab,
        n_positions=8,
        n_embd=8,
        n_layer=1,
        n_head=2,
        attn_implementation="eager",
        bos_token_id=0,
        eos_token_id=0,
    )
    torch.manual_seed(seed)
    return transformers.GPT2LMHeadModel(config).double().eval()  # type: ignore[no-any-return]


class Interrupted:
    """The batches, and a KeyboardInterrupt before batch ``stop`` of a pass that reaches it."""

    def __init__(self, batches: list[Any], stop: int) -> None:
        self.batches, self.stop = batches, stop

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self) -> Iterator[Any]:
        for i, b in enumerate(self.batches):
            if i == self.stop:
                raise KeyboardInterrupt
            yield b
