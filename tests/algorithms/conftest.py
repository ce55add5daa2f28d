"""Algorithm tests use small dense products: one thread (torch and BLAS) is
faster than several fighting over two cores, and keeps timings stable when
CI runs test files in parallel."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    limit: contextlib.AbstractContextManager[object] = contextlib.nullcontext()
    with contextlib.suppress(ImportError):
        from threadpoolctl import threadpool_limits

        limit = threadpool_limits(1)
    try:
        with limit:
            yield
    finally:
        torch.set_num_threads(before)
