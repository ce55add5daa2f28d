"""Batches: iteration, size, device moves, microbatch split, BatchNorm guard.

A batch is a tensor, a tuple/list of batches, or a mapping of names to
batches (``dict``, HuggingFace ``BatchEncoding`` and anything with ``keys``
and ``__getitem__``). Its size is the leading dimension of its first tensor
(for mappings, ``input_ids`` when present).
"""

from __future__ import annotations

import contextlib
import itertools
import random
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch
from torch import nn

from hessian_eigenthings._checks import check_count

Batch = Any


def _is_mapping(batch: object) -> bool:
    return isinstance(batch, Mapping) or (
        hasattr(batch, "keys")
        and hasattr(batch, "__getitem__")
        and not isinstance(batch, torch.Tensor)
    )


def _first_tensor(batch: Batch) -> torch.Tensor | None:
    if isinstance(batch, torch.Tensor):
        return batch
    if _is_mapping(batch):
        keys = list(batch.keys())
        if "input_ids" in keys:
            keys.remove("input_ids")
            keys.insert(0, "input_ids")
        for key in keys:
            t = _first_tensor(batch[key])
            if t is not None:
                return t
        return None
    if isinstance(batch, (tuple, list)):
        for item in batch:
            t = _first_tensor(item)
            if t is not None:
                return t
    return None


def iter_tensors(batch: Batch) -> Iterator[torch.Tensor]:
    """Every tensor of a batch, depth first (mappings in key order)."""
    if isinstance(batch, torch.Tensor):
        yield batch
    elif _is_mapping(batch):
        for key in batch.keys():
            yield from iter_tensors(batch[key])
    elif isinstance(batch, (tuple, list)):
        for item in batch:
            yield from iter_tensors(item)


def batch_leaves(batch: Batch) -> list[Any]:
    """The leaves of a batch in order (tensors, other values, and a mapping's keys)."""
    if isinstance(batch, torch.Tensor):
        return [batch]
    if isinstance(batch, dict) or (hasattr(batch, "keys") and hasattr(batch, "__getitem__")):
        out: list[Any] = []
        for k in batch.keys():
            out.append(k)
            out.extend(batch_leaves(batch[k]))
        return out
    if isinstance(batch, (tuple, list)):
        out = []
        for b in batch:
            out.extend(batch_leaves(b))
        return out
    return [batch]


def batch_key(batch: Batch) -> tuple[list[Any], tuple[int, ...]]:
    """Leaves of a batch and the version counters of its tensors (NOTE [graph reuse] in
    ``operators.graph_reuse``: what a kept state was built from)."""
    leaves = batch_leaves(batch)
    return leaves, tuple(x._version for x in leaves if isinstance(x, torch.Tensor))


def same_batch(kept: tuple[list[Any], tuple[int, ...]], batch: Batch) -> bool:
    """Whether ``batch`` is the one ``kept`` (its ``batch_key``) was taken of: the same tensors at
    the same versions, else equal contents (a device comparison only for tensors that are other
    objects than the kept ones)."""
    old_leaves, old_versions = kept
    new_leaves = batch_leaves(batch)
    if len(old_leaves) != len(new_leaves):
        return False
    versions = iter(old_versions)
    for x, y in zip(old_leaves, new_leaves, strict=True):
        if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor):
            version = next(versions)
            if x is y:
                if x._version != version:
                    return False  # modified in place since the graph was built
                continue
            if x.shape != y.shape or x.dtype != y.dtype or x.device != y.device:
                return False
            if x._version != version or not torch.equal(x, y):
                return False
        elif isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor) or x != y:
            return False
    return True


def batch_size(batch: Batch) -> int:
    """Number of samples in a batch: leading dimension of its first tensor."""
    t = _first_tensor(batch)
    if t is None:
        raise TypeError(
            f"cannot find a tensor in a batch of type {type(batch).__name__}; batches must be "
            "tensors, tuples/lists or mappings of tensors"
        )
    if t.dim() == 0:
        raise ValueError(
            "the first tensor of the batch is a scalar; batch tensors need a leading batch dimension"
        )
    return int(t.shape[0])


def to_device(batch: Batch, device: torch.device | str) -> Batch:
    """Move every tensor of a batch to ``device`` (other leaves untouched)."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if hasattr(batch, "to") and _is_mapping(batch) and not isinstance(batch, dict):
        return batch.to(device)  # BatchEncoding-like objects know how to move themselves
    if _is_mapping(batch):
        return {k: to_device(batch[k], device) for k in batch.keys()}
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # namedtuple
        return type(batch)(*(to_device(b, device) for b in batch))
    if isinstance(batch, (tuple, list)):
        return type(batch)(to_device(b, device) for b in batch)
    return batch


def map_tensors(batch: Batch, fn: Callable[[torch.Tensor], torch.Tensor]) -> Batch:
    """The batch with every tensor ``t`` replaced by ``fn(t)``; other leaves kept.

    Mappings come back as ``dict`` (a ``BatchEncoding`` too), namedtuples,
    tuples and lists as their own type.
    """
    if isinstance(batch, torch.Tensor):
        return fn(batch)
    if _is_mapping(batch):
        return {k: map_tensors(batch[k], fn) for k in batch.keys()}
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):
        return type(batch)(*(map_tensors(b, fn) for b in batch))
    if isinstance(batch, (tuple, list)):
        return type(batch)(map_tensors(b, fn) for b in batch)
    return batch


def _slice(batch: Batch, start: int, stop: int, size: int) -> Batch:
    return map_tensors(batch, lambda t: t[start:stop] if t.dim() > 0 and t.shape[0] == size else t)


def split_batch(batch: Batch, microbatch_size: int) -> list[Batch]:
    """Split along the leading dimension into chunks of at most ``microbatch_size``.

    Tensors whose leading dimension is not the batch size (and non-tensor
    leaves) are shared by every chunk.
    """
    if microbatch_size < 1:
        raise ValueError(f"microbatch_size must be >= 1, got {microbatch_size}")
    size = batch_size(batch)
    if size <= microbatch_size:
        return [batch]
    return [
        _slice(batch, s, min(s + microbatch_size, size), size)
        for s in range(0, size, microbatch_size)
    ]


def batchnorm_modules(model: nn.Module) -> list[str]:
    """Names of the BatchNorm modules of ``model`` that are in training mode."""
    return [
        name
        for name, m in model.named_modules()
        if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.training
    ]


def check_microbatching(model: nn.Module, microbatch_size: int | None, unsafe: bool) -> None:
    """Raise when microbatching would change the curvature (BatchNorm in training mode)."""
    if microbatch_size is None or unsafe:
        return
    bns = batchnorm_modules(model)
    if bns:
        raise ValueError(
            f"microbatching changes the result of BatchNorm layers in training mode ({bns[:3]}...): "
            "their statistics depend on the whole batch. Call model.eval(), drop microbatch_size, "
            "or pass microbatch_unsafe=True to accept the approximation"
        )


# NOTE [one batch passed as the data]
# HessianOperator(model, (x, y), loss) passes one batch where an iterable of batches belongs;
# iterating it gives x, then y, and the loss sees a bare tensor as its batch. A list or tuple of
# bare-tensor batches is legitimate data though (losses that take tensors), so the rule looks at
# the structure and flags only what the batches of one dataset cannot be: a tuple or list of 2 to
# 8 items, each with a tensor, the leading dimensions of whose first tensors are all equal (the
# samples of one batch), while the items are of different kinds: a tensor beside a mapping or a
# sequence, or tensors of different dtypes or ranks (float inputs (N, d) and int64 targets (N,)).
# Batches of one dataset share kind, dtype and rank; a smaller last batch has another leading
# size; token batches of different lengths share dtype and rank: none of them is flagged. Not
# caught: (x, y) with x and y of one dtype and rank (regression, autoencoders), which two tensor
# batches could be; a supervised helper then finds a tensor where it wants (inputs, targets), and
# loss_fns.checks.check_first_batch asks the same question when the operator is built.
# DataLoader's default collation makes a batch a list [x, y]: lists are looked at like tuples.


def _kind(item: Batch) -> tuple[object, ...]:
    if isinstance(item, torch.Tensor):
        return ("tensor", item.dtype, item.dim())
    if _is_mapping(item):
        return ("mapping",)
    if isinstance(item, (tuple, list)):
        return ("sequence",)
    return ("other", type(item))


def looks_like_one_batch(data: object) -> bool:
    """True when ``data`` is a single batch rather than an iterable of batches
    (NOTE [one batch passed as the data]; no false positives on legitimate data)."""
    if not isinstance(data, (tuple, list)) or not 2 <= len(data) <= 8:
        return False
    sizes = set()
    for item in data:
        t = _first_tensor(item)
        if t is None or t.dim() == 0:
            return False
        sizes.add(t.shape[0])
    return len(sizes) == 1 and len({_kind(item) for item in data}) > 1


def _one_batch_message(data: tuple[Batch, ...] | list[Batch]) -> str:
    names = ("x", "y", "w")[: len(data)] if len(data) <= 3 else ("x", "y", "...")
    parts = []
    for item in data:
        if isinstance(item, torch.Tensor):
            parts.append(f"{str(item.dtype).removeprefix('torch.')} {tuple(item.shape)}")
        else:
            parts.append(type(item).__name__)
    return (
        f"the data looks like one batch, not an iterable of batches: a {type(data).__name__} of "
        f"{len(data)} items of one leading size ({', '.join(parts)}), which would be read as {len(data)} "
        f"batches; did you mean [({', '.join(names)})]? (a list holding the one batch, or a DataLoader)"
    )


@contextlib.contextmanager
def _rng_untouched() -> Iterator[None]:
    """Put back torch's (CPU and initialised CUDA devices), Python's and NumPy's global RNG states."""
    py_state = random.getstate()
    np = sys.modules.get("numpy")
    np_state = np.random.get_state() if np is not None else None
    devices = list(range(torch.cuda.device_count())) if torch.cuda.is_initialized() else []
    with torch.random.fork_rng(devices=devices):
        try:
            yield
        finally:
            random.setstate(py_state)
            if np is not None:
                np.random.set_state(np_state)


def _length(obj: object) -> int | None:
    try:
        return len(obj)  # type: ignore[arg-type]
    except TypeError:
        return None


def no_batch_message(dataloader: object) -> str:
    """Why ``dataloader`` yielded no batch, with the fix: a DataLoader whose ``drop_last=True``
    drops every sample (a batch size above the number of samples), or an empty dataset."""
    batcher = getattr(dataloader, "batch_sampler", None)
    drop_last = getattr(batcher, "drop_last", getattr(dataloader, "drop_last", False))
    size = getattr(batcher, "batch_size", getattr(dataloader, "batch_size", None))
    sampler = getattr(batcher, "sampler", None)
    samples = _length(sampler) if sampler is not None else None
    if samples is None:
        samples = _length(getattr(dataloader, "dataset", None))
    name = type(dataloader).__name__ if hasattr(dataloader, "dataset") else "dataloader"
    if drop_last is True and isinstance(size, int) and samples is not None and 0 < samples < size:
        return (
            f"the {name} yielded no batch: drop_last=True with batch_size={size} drops every sample "
            f"of a dataset of {samples}; use drop_last=False or a batch_size of at most {samples}"
        )
    if samples == 0:
        return f"the {name} yielded no batch: its dataset is empty"
    return f"the {name} yielded no batch; check that the dataset is not empty"


# NOTE [one operator, one dataset]
# `full_dataset=True` promises one fixed matrix: every product reads the same
# batches (the first `num_batches` of them when set). That needs data that can
# be iterated again; a generator or any other one-shot iterator would hand the
# first product its batches and later products the next ones (or none), so
# such inputs are refused when the operator is built.


class BatchSource:
    """The batches one product runs over.

    ``full_dataset=True``: every batch of ``dataloader`` (at most
    ``num_batches``), re-iterated on every product. ``full_dataset=False``:
    one batch per product, the next one each time, cycling back to the start
    when the loader is exhausted.
    """

    def __init__(
        self,
        dataloader: Iterable[Batch],
        *,
        full_dataset: bool = True,
        num_batches: int | None = None,
        device: torch.device | None = None,
    ) -> None:
        if isinstance(dataloader, torch.Tensor):
            raise TypeError(
                f"the data is one tensor of shape {tuple(dataloader.shape)}, not an iterable of batches "
                "(a DataLoader or a list of batches); did you mean [x]? (a list holding the one batch)"
            )
        if _is_mapping(dataloader):
            raise TypeError(
                f"the data is one batch (a {type(dataloader).__name__} with keys {list(dataloader.keys())}), "  # type: ignore[attr-defined]
                "not an iterable of batches (a DataLoader or a list of batches); did you mean [batch]? "
                "(a list holding the one batch)"
            )
        if isinstance(dataloader, (tuple, list)) and looks_like_one_batch(dataloader):
            raise TypeError(_one_batch_message(dataloader))
        if not isinstance(dataloader, Iterable):
            raise TypeError(f"dataloader must be iterable, got {type(dataloader).__name__}")
        if isinstance(dataloader, Iterator):
            # a generator or an iterator is used up by the first product: every later product
            # would see other batches, or none (NOTE [one operator, one dataset])
            raise TypeError(
                f"dataloader is a one-shot iterator ({type(dataloader).__name__}): an operator reads its data on "
                "every product, and an iterator is used up by the first. Pass something that can be iterated "
                "again: a list of batches (list(your_generator)), a torch DataLoader, or a class with __iter__"
            )
        num_batches = check_count("num_batches", num_batches, allow_none=True)
        self.dataloader = dataloader
        self.full_dataset = full_dataset
        self.num_batches = num_batches
        self.device = device
        self._cycle: Iterator[Batch] | None = None
        #: keep the first batch once read (``[batch]``) until ``release_first``: an operator's
        #: construction reads it for more than one check, from one iteration of the loader
        self.keep_first = False
        self._first: list[Batch] | None = None

    def _fresh(self) -> Iterator[Batch]:
        it = iter(self.dataloader)
        if self.num_batches is not None:
            it = itertools.islice(it, self.num_batches)
        return it

    def _next_cycled(self) -> Batch:
        if self._cycle is not None:
            try:
                return next(self._cycle)
            except StopIteration:
                pass
        self._cycle = self._fresh()
        try:
            return next(self._cycle)
        except StopIteration:
            raise ValueError(no_batch_message(self.dataloader)) from None

    def batches(self) -> Iterator[Batch]:
        """Batches of one product, moved to the device."""
        if not self.full_dataset:
            batch = self._next_cycled()
            yield batch if self.device is None else to_device(batch, self.device)
            return
        empty = True
        for batch in self._fresh():
            empty = False
            yield batch if self.device is None else to_device(batch, self.device)
        if empty:
            raise ValueError(no_batch_message(self.dataloader))

    def first_batch(self) -> Batch | None:
        """The data's first batch as given (not moved to a device), None when there is none.

        Read once when an operator is built, for its checks: from a fresh iterator (the cycle of
        ``full_dataset=False`` does not move), with the global RNG states put back (a shuffled
        DataLoader draws its order from torch's RNG; a dataset may use Python's or NumPy's).
        """
        if self._first is not None:
            return self._first[0]
        with _rng_untouched():
            it = iter(self.dataloader)
            try:
                batch = next(it, None)
            finally:
                close = getattr(it, "close", None)  # a generator's __iter__: run its cleanup now
                if callable(close):
                    close()
        if self.keep_first:
            self._first = [batch]
        return batch

    def release_first(self) -> None:
        """Stop keeping the first batch (``keep_first``): the next ``first_batch`` reads it again."""
        self.keep_first = False
        self._first = None

    def single_batch_hint(self) -> bool:
        """True when the data of one product is known up front to be a single batch."""
        if not self.full_dataset or self.num_batches == 1:
            return True
        try:
            return len(self.dataloader) == 1  # type: ignore[arg-type]
        except TypeError:
            return False


def assert_microbatch_safe(model: nn.Module) -> None:
    """Raise ``ValueError`` when splitting batches would change ``model``'s loss (the 1.0 alpha's check).

    BatchNorm layers in training mode normalise by the statistics of the
    batch they see, so the Hessian over microbatches is that of another loss.
    The operators run this check themselves (``microbatch_size=`` with
    ``microbatch_unsafe=False``); this function is kept for code that called it.
    """
    check_microbatching(model, 1, unsafe=False)


def iterate_batches(source: Iterable[Any], num_batches: int | None = None) -> Iterator[Any]:
    """The batches of ``source``, at most ``num_batches`` of them (the 1.0 alpha's helper)."""
    return iter(source) if num_batches is None else itertools.islice(source, num_batches)


#: the 1.0 alpha's name of :func:`to_device`
move_batch_to_device = to_device
