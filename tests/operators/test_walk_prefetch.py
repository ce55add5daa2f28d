"""Prefetched gathers of the sharded layer walk (NOTE [prefetched gathers] in ``sharded_walk``).

On 2 and 3 gloo ranks (``_walk_prefetch_worker.py``, float64, tiny HF GPT-2 and Llama): Hessian
and GGN products with prefetching equal those without bit for bit and the single-process product
on the union of the ranks' batches to 1e-12; the next stage's all-gather is issued before the
current stage computes, no more than two layers' gathered parameters are alive at once, one
reduce-scatter at most is in flight, every collective is waited, and the ranks issue the same
collectives in the same order. In one process, with gathers that hand the parameters over as they
are: a walk that leaves its plan (kept layers, a refused kept layer, a plan that is wrong) drops
the gather in flight and stays exact.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import hessian_eigenthings as he
from hessian_eigenthings.loss_fns import supervised_loss
from hessian_eigenthings.operators.engines.layers import LayerWalk
from hessian_eigenthings.param_utils import select_parameters
from hessian_eigenthings.testing import dense_hessian
from tests.launch import launch_ranks

HERE = Path(__file__).resolve().parent
SUP = supervised_loss(nn.CrossEntropyLoss())


@pytest.fixture(scope="module", params=[2, 3])
def ranks(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    if not (dist.is_available() and dist.is_gloo_available()):
        pytest.skip("needs torch.distributed with gloo")
    pytest.importorskip("transformers")
    out = tmp_path_factory.mktemp(f"prefetch{request.param}")
    results = launch_ranks(HERE / "_walk_prefetch_worker.py", request.param, out)
    if "skip" in results[0]:
        pytest.skip(results[0]["skip"])
    return results


def _get(ranks: list[dict[str, Any]], check: str) -> list[dict[str, Any]]:
    for rank, r in enumerate(ranks):
        assert "error" not in r[check], f"rank {rank}: {r[check].get('traceback')}"
    return [r[check] for r in ranks]


def test_prefetched_products_are_the_same_bits(ranks: list[dict[str, Any]]) -> None:
    for res in _get(ranks, "products"):
        for case in ("gpt2_hessian", "gpt2_ggn", "llama_tied_hessian", "llama_tied_ggn"):
            r = res[case]
            assert r["bitwise"], (case, r)
            assert r["changed"], case
            assert r["product"] < 1e-12 and r["block"] < 1e-12, (case, r)


def test_prefetched_products_with_kept_layers(ranks: list[dict[str, Any]]) -> None:
    for res in _get(ranks, "kept_layers"):
        # the first product keeps one layer (and recomputes it once to check it), the next both
        assert res["first"]["kept"] == [1, 1] and res["second"]["kept"] == [2, 2], res
        for product in ("first", "second"):
            assert res[product]["bitwise"], res
            assert res[product]["product"] < 1e-12, res


def test_the_next_gather_is_in_flight_while_a_stage_computes(ranks: list[dict[str, Any]]) -> None:
    per_rank = _get(ranks, "order")
    for res in per_rank:
        for name in ("hessian", "ggn"):
            on, off = res[f"{name}_on"], res[f"{name}_off"]
            # the outside, 3 layers forward, 3 layers back: each one's successor issued before
            # it computes; without prefetching never
            assert len(on["ahead"]) == 6 and all(on["ahead"]), on
            assert not any(off["ahead"]), off
            # one layer computing and one arriving (the outside parameters stay whole); without
            # prefetching one at a time
            assert on["max_alive"] == 2 and off["max_alive"] == 1, (name, on, off)
            assert on["max_reduces_in_flight"] == 1 and off["max_reduces_in_flight"] == 1
            assert on["all_waited"] and off["all_waited"]
            # the same gathers and reduce-scatters either way, in their order; only the gathers
            # are issued earlier
            for kind in ("issue", "reduce"):
                assert [c for c in on["collectives"] if c[0] == kind] == [
                    c for c in off["collectives"] if c[0] == kind
                ], (name, kind, on, off)
            assert on["collectives"] != off["collectives"]
    # every rank issues the same collectives in the same order
    for name in ("hessian_on", "ggn_on"):
        assert all(r[name]["collectives"] == per_rank[0][name]["collectives"] for r in per_rank)


# -- one process: gathers that hand the parameters over as they are ------------------------------
class _Handed:
    """``gather`` and ``finish`` of one process that record what is issued and waited."""

    def __init__(self, model: nn.Module) -> None:
        self.params = dict(model.named_parameters())
        self.issued: list[list[str]] = []  # each gather's names
        self.waited: list[int] = []  # the gathers waited, by their place in ``issued``
        self.reduces = 0
        self.in_flight = 0
        self.most_in_flight = 0

    def _handle(self, k: int | None, result: list[torch.Tensor]) -> Any:
        handed, done = self, []

        class Handle:
            def wait(self) -> list[torch.Tensor]:
                assert not done, "a collective waited twice"
                done.append(True)
                if k is not None:
                    handed.waited.append(k)
                handed.in_flight -= 1
                return result

        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        return Handle()

    def gather(self, items: list[tuple[str, torch.Tensor | None]]) -> Any:
        self.issued.append([n for n, _ in items])
        whole = [self.params[n].detach() if t is None else t for n, t in items]
        return self._handle(len(self.issued) - 1, whole)

    def finish(self, items: list[tuple[str, torch.Tensor]]) -> Any:
        self.reduces += 1
        blocks = [b for _, b in items]
        return blocks, self._handle(None, blocks)


def _product(walk: LayerWalk, op: Any, batch: Any, v: torch.Tensor) -> torch.Tensor:
    vs = dict(zip(op.layout.names, [t[0] for t in op.layout.split_rows(v[None])], strict=True))
    out = walk.hvp(walk.capture(batch), vs)
    return torch.cat([out[n].reshape(-1) for n in op.layout.names])


class _NativeNorm(nn.Module):
    """A layer whose kept graph disagrees with the recomputed one (a native layer_norm's
    reverse over forward, NOTE [kept layer graphs]): the walk turns keeping off mid-walk."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(torch.layer_norm(self.lin(x), (4,)))


@pytest.mark.parametrize("layer", ["linear", "native_norm"])
def test_a_walk_that_leaves_its_plan_stays_exact(layer: str) -> None:
    """Kept layers without an agreement on how many (every layer planned, the kept ones never
    taken) and a kept layer refused mid-walk: the products equal the dense Hessian's and the walk
    without gathers bit for bit, every gather issued is waited once, and no more than one gather
    and one reduce-scatter are in flight."""
    torch.manual_seed(0)
    if layer == "linear":
        blocks: list[nn.Module] = [nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4), nn.Tanh()]
    else:
        blocks = [_NativeNorm(), _NativeNorm()]
    model = nn.Sequential(*blocks, nn.Linear(4, 3)).double()
    data = [(torch.randn(6, 4, dtype=torch.float64), torch.randint(0, 3, (6,)))]
    op = he.HessianOperator(model, data, SUP)
    H = dense_hessian(model, data, SUP, select_parameters(model))
    plain = LayerWalk(model, SUP, op.layout.names, "", keep_bytes=2)
    handed = _Handed(model)
    walk = LayerWalk(
        model, SUP, op.layout.names, "", gather=handed.gather, finish=handed.finish, keep_bytes=2
    )
    v = torch.randn(op.size, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    for _ in range(2):
        want = _product(plain, op, data[0], v)
        got = _product(walk, op, data[0], v)
        assert torch.equal(got, want)
        torch.testing.assert_close(got, H @ v, rtol=1e-12, atol=1e-13)
    assert walk.kept_layers == plain.kept_layers
    assert (walk.keep_refused is not None) == (layer == "native_norm")
    assert sorted(k for k in handed.waited if k >= 0) == list(range(len(handed.issued)))
    assert handed.reduces > 0 and handed.in_flight == 0
    assert handed.most_in_flight <= 2  # one gather, one reduce-scatter


def test_a_wrong_plan_falls_back_to_gathering_in_turn() -> None:
    """A stage taken out of the plan: the gather in flight is waited and dropped, that stage and
    the rest are gathered in turn, each with its own parameters."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3), nn.Linear(3, 2)).double()
    handed = _Handed(model)
    walk = LayerWalk(model, SUP, [n for n, _ in model.named_parameters()], "", gather=handed.gather)
    st = walk.stages
    v = {n: torch.randn_like(p) for n, p in model.named_parameters()}
    st.begin()
    with st.visiting([(None, v), (2, v), (0, v)]):
        got = [st.stage(i, v) for i in (None, 0, 1, 2)]
    for i, (theta, vi) in zip((None, 0, 1, 2), got, strict=True):
        names = st.outside if i is None else list(st.local[i].values())
        assert [t.data_ptr() for t in theta.values()] == [
            model.get_parameter(n).data_ptr() for n in names
        ]
        assert all(vi[loc] is v[n] for loc, n in (st.local[i].items() if i is not None else ()))
    # issued: None, then 2 ahead (dropped when 0 came instead), then 0, 1, 2 in turn
    layer_of = {n: i for i, names in enumerate(st.local) for n in names.values()}
    stages = [layer_of.get(names[0]) if names else None for names in handed.issued]
    assert stages == [None, 2, 0, 1, 2]
    assert sorted(handed.waited) == list(range(5)) and handed.in_flight == 0
