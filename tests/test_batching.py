from collections import namedtuple

import pytest
import torch
from torch import nn

from hessian_eigenthings.batching import (
    BatchSource,
    batch_size,
    check_microbatching,
    split_batch,
    to_device,
)


class BatchEncodingLike:
    """Mapping-like but not a dict, as HuggingFace's BatchEncoding."""

    def __init__(self, data: dict) -> None:
        self.data = data

    def keys(self):
        return self.data.keys()

    def __getitem__(self, k):
        return self.data[k]


def test_batch_size_of_every_batch_kind() -> None:
    x = torch.zeros(6, 3)
    assert batch_size(x) == 6
    assert batch_size((x, torch.zeros(6))) == 6
    assert batch_size([("meta", 1), x]) == 6
    assert batch_size({"attention_mask": torch.zeros(4, 2), "input_ids": torch.zeros(5, 2)}) == 5
    assert batch_size(BatchEncodingLike({"input_ids": torch.zeros(3, 9)})) == 3
    NT = namedtuple("NT", "x y")
    assert batch_size(NT(x, x)) == 6
    with pytest.raises(TypeError):
        batch_size(("no", "tensor"))
    with pytest.raises(ValueError):
        batch_size(torch.tensor(1.0))


def test_split_keeps_structure_and_shared_leaves() -> None:
    x = torch.arange(10).reshape(5, 2)
    y = torch.arange(5)
    table = torch.ones(3)  # not batch-shaped: shared
    parts = split_batch({"x": x, "y": y, "t": table, "name": "a"}, 2)
    assert [batch_size(p) for p in parts] == [2, 2, 1]
    torch.testing.assert_close(torch.cat([p["x"] for p in parts]), x)
    assert all(p["t"] is table and p["name"] == "a" for p in parts)
    assert split_batch((x, y), 10)[0][0] is x
    with pytest.raises(ValueError):
        split_batch(x, 0)


def test_to_device_keeps_types() -> None:
    NT = namedtuple("NT", "x y")
    b = to_device(NT(torch.zeros(2), [torch.ones(2), "s"]), "cpu")
    assert isinstance(b, NT) and isinstance(b.y, list) and b.y[1] == "s"


def test_batchnorm_guard() -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))
    with pytest.raises(ValueError, match="BatchNorm"):
        check_microbatching(model, 2, unsafe=False)
    check_microbatching(model, 2, unsafe=True)
    check_microbatching(model, None, unsafe=False)
    model.eval()
    check_microbatching(model, 2, unsafe=False)  # eval-mode BatchNorm is per-sample


def test_batch_source_cycles_and_caps() -> None:
    data = [torch.full((1,), float(i)) for i in range(3)]
    cyc = BatchSource(data, full_dataset=False)
    seen = [next(iter(cyc.batches())).item() for _ in range(7)]
    assert seen == [0, 1, 2, 0, 1, 2, 0]
    full = BatchSource(data, num_batches=2)
    assert [b.item() for b in full.batches()] == [0, 1]
    assert [b.item() for b in full.batches()] == [0, 1]
    with pytest.raises(ValueError, match="no batch"):
        list(BatchSource([]).batches())
    with pytest.raises(ValueError, match="no batch"):
        list(BatchSource([], full_dataset=False).batches())
    with pytest.raises(TypeError):
        BatchSource(torch.zeros(3))
    with pytest.raises(ValueError):
        BatchSource(data, num_batches=0)
