"""The query rows written slice by slice into one buffer (NOTE [rows written in place] in
``influence.gradients``): no second buffer of a slice's rows beside the whole rows, and the same
rows as the query batch made whole."""

from __future__ import annotations

import pytest
import torch

from hessian_eigenthings import influence
from hessian_eigenthings._checks import InternalError
from tests.influence.tiny import Allocations, tiny_gpt2


def _data() -> tuple[list[dict[str, torch.Tensor]], list[dict[str, torch.Tensor]]]:
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, 11, (11, 6), generator=g)
    labels = ids.clone()
    labels[7, 3] = -100  # a query token that does not count
    train = [{"input_ids": ids[i : i + 2], "labels": labels[i : i + 2]} for i in (0, 2)]
    query = [{"input_ids": ids[6:], "labels": labels[6:]}]  # 5 queries, slices of 2
    return train, query


@pytest.mark.parametrize("route", ["hooked", "vmap"])
def test_query_slices_are_written_into_the_whole_rows(route: str) -> None:
    model = tiny_gpt2()
    train, query = _data()
    fitted = influence.fit(model, train, influence.causal_lm_task(), damping=1e-2)
    fitted.pairwise_scores(query, train, progress=False)  # the hooks checked on a first batch
    n = fitted.layout.size
    if route == "vmap":
        fitted._grads.linear = None  # the rows of vmap, copied into the buffer
    whole = fitted._grads(query[0])
    with Allocations() as seen:
        sliced = fitted._sliced_gradients(query[0], 2)
    # the same rows as the batch made whole (float64; slices sum their tokens alone)
    torch.testing.assert_close(sliced, whole, rtol=1e-12, atol=1e-15)
    assert sliced.shape == (5, n)
    slice_rows = [k for k in seen.numels if k in (2 * n, n)]
    if route == "hooked":
        # one buffer of the 5 rows; no slice's rows (2 · n) nor the last slice's (n) beside it
        assert seen.numels.count(5 * n) == 1
        assert slice_rows == []
    else:  # vmap makes each slice's rows, then copies them in
        assert slice_rows == [2 * n, 2 * n, n]


def test_a_buffer_of_the_wrong_shape_is_refused() -> None:
    model = tiny_gpt2()
    train, query = _data()
    fitted = influence.fit(model, train, influence.causal_lm_task(), damping=1e-2)
    n = fitted.layout.size
    with pytest.raises(InternalError, match=r"out must be \(5, "):
        fitted._grads(query[0], torch.empty(4, n, dtype=torch.float64))
    with pytest.raises(InternalError, match="float64"):
        fitted._grads(query[0], torch.empty(5, n, dtype=torch.float32))
