"""The tests' tiny causal LM (a one-layer GPT-2 from a config, float64, eval mode), batches
that stop a pass part way (``Interrupted``, for the checkpoint tests) and a record of the memory
operations allocate (``Allocations``, for the memory tests)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


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


class Allocations(TorchDispatchMode):
    """The memory, in elements, that each operation allocates for the tensors it returns (a
    view of its inputs' memory, as ``expand``, allocates none), in call order."""

    def __init__(self) -> None:
        super().__init__()
        self.numels: list[int] = []

    @property
    def numel(self) -> int:
        """The largest of them (0 when none)."""
        return max(self.numels, default=0)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        held = {
            t.untyped_storage().data_ptr()
            for t in tree_leaves((args, kwargs))
            if isinstance(t, torch.Tensor)
        }
        out = func(*args, **kwargs)
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in held:
                self.numels.append(t.untyped_storage().nbytes() // t.element_size())
        return out
