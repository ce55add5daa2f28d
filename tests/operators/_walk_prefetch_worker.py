"""One rank of the prefetched-gather checks (run by tests/operators/test_walk_prefetch.py).

Usage: ``python _walk_prefetch_worker.py OUT_DIR`` with RANK, WORLD_SIZE, MASTER_ADDR and
MASTER_PORT set; writes ``OUT_DIR/rank{r}.json``. The sharded layer walk (NOTE [prefetched
gathers] in ``sharded_walk``) with and without prefetching on tiny HF models in float64: the
same bits, equal to one process on the union of the ranks' batches; and the order of its
collectives and computations, recorded.
"""

from __future__ import annotations

import copy
import gc
import os
import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from _dist_checks import run_sharded_worker  # this folder: the workers run as scripts
from _dist_worker import _shard, _walk_batch, _walk_forward, _walk_lm, _walk_model, err, rand
from torch import nn

import hessian_eigenthings.operators.distributed as hd
from hessian_eigenthings import _torch_compat
from hessian_eigenthings.loss_fns import supervised_loss_of_output
from hessian_eigenthings.operators import GGNOperator, HessianOperator

RANK = int(os.environ["RANK"])
WORLD = int(os.environ["WORLD_SIZE"])
CHECKS: dict[str, Callable[[], dict[str, Any]]] = {}
CE = supervised_loss_of_output(nn.CrossEntropyLoss())


def check(fn: Callable[[], dict[str, Any]]) -> Callable[[], dict[str, Any]]:
    CHECKS[fn.__name__] = fn
    return fn


def _ggn_data(r: int) -> Any:
    b = _walk_batch(r)
    return (b, b["input_ids"][:, 1:].reshape(-1))


def _sharded(kind: str) -> tuple[nn.Module, nn.Module, str]:
    """The model sharded per block and at the root, and its unsharded twin."""
    model, layers = _walk_model(kind)
    replica = copy.deepcopy(model)
    fully_shard = _torch_compat.fully_shard()
    for block in model.get_submodule(layers):
        fully_shard(block)
    fully_shard(model)
    return model, replica, layers


def _walk(op: Any) -> Any:
    """The operator's layer walk (``LayerWalk``)."""
    return op.ranks.product.walk.walk


def _reference(op: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Three probes and ``op``'s products of them, computed on rank 0 and broadcast (one
    process's slow reference)."""
    X = torch.cat([rand(op.size, 1, seed=5), rand(op.size, 2, seed=6)])
    RX = (op @ X.T).T.contiguous() if RANK == 0 else torch.empty_like(X)
    dist.broadcast(RX, src=0)
    return X, RX


def _pair(make: Callable[[], Any]) -> tuple[Any, Any]:
    """Two operators of one sharded model: prefetching (the default) and not."""
    on, off = make(), make()
    assert _walk(on).prefetch
    _walk(off).prefetch = False
    return on, off


def _compare(on: Any, off: Any, ref: Any, X: torch.Tensor, RX: torch.Tensor) -> dict[str, Any]:
    pieces = torch.stack([_shard(x, ref) for x in X])
    want = torch.stack([_shard(x, ref) for x in RX])
    got = {}
    for name, op in (("on", on), ("off", off)):
        got[name] = (op @ pieces[0], op.matmat(pieces[1:].T.contiguous()).T)
    return {
        "bitwise": all(torch.equal(a, b) for a, b in zip(got["on"], got["off"], strict=True)),
        "product": err(got["on"][0], want[0]),
        "block": err(got["on"][1], want[1:]),
        "changed": bool((got["on"][0] != 0).any()),
    }


@check
def products() -> dict[str, Any]:
    """Hessian and GGN products with and without prefetching: the same bits, and equal to one
    process on the union of the ranks' batches (uneven token counts)."""
    out: dict[str, Any] = {}
    union = [_walk_batch(r) for r in range(WORLD)]
    for kind in ("gpt2", "llama_tied"):
        model, replica, layers = _sharded(kind)
        # Llama's eager softmax runs in float32: forward-over-reverse (the walk) and
        # reverse-over-reverse differ by its rounding, so its reference is the functional engine
        engine = "autograd" if kind == "gpt2" else "functional"
        ref = HessianOperator(replica, union, _walk_lm, engine=engine)
        X, RX = _reference(ref)
        on, off = _pair(
            lambda m=model, p=layers: hd.FSDPHessianOperator(
                m, [_walk_batch(RANK)], _walk_lm, engine="layers", layers=p
            )
        )
        out[f"{kind}_hessian"] = _compare(on, off, ref, X, RX)
        ref_g = GGNOperator(replica, [_ggn_data(r) for r in range(WORLD)], _walk_forward, CE)
        X, RX = _reference(ref_g)
        on, off = _pair(
            lambda m=model, p=layers: hd.FSDPGGNOperator(
                m, [_ggn_data(RANK)], _walk_forward, CE, layers=p
            )
        )
        out[f"{kind}_ggn"] = _compare(on, off, ref_g, X, RX)
    return out


@check
def kept_layers() -> dict[str, Any]:
    """Kept layer graphs (NOTE [kept layer graphs]; on the CPU ``keep_bytes`` counts layers): the
    first product keeps one layer and checks it by recomputing (a planned gather), the second
    keeps both (no gather on the way back). Each product with and without prefetching: the same
    bits, equal to one process."""
    model, replica, layers = _sharded("gpt2")
    union = [_walk_batch(r) for r in range(WORLD)]
    ref = HessianOperator(replica, union, _walk_lm)
    X, RX = _reference(ref)
    on, off = _pair(
        lambda: hd.FSDPHessianOperator(
            model, [_walk_batch(RANK)], _walk_lm, engine="layers", layers=layers
        )
    )
    v, want = _shard(X[0], ref), _shard(RX[0], ref)
    out: dict[str, Any] = {}
    for op in (on, off):
        _walk(op).keep_bytes = 2
    for product in ("first", "second"):
        got = [op @ v for op in (on, off)]
        out[product] = {
            "bitwise": torch.equal(got[0], got[1]),
            "product": err(got[0], want),
            "kept": [_walk(op).kept_layers for op in (on, off)],
        }
    return out


class Recorder:
    """The walk's collectives and stage computations, in order, through wrappers around its
    ``gather``, ``finish`` and stages: ``("issue", k, stage)`` when the k-th gather is issued,
    ``("wait", k, stage)`` when its tensors are handed over, ``("compute", stage)`` for each
    call of a stage's function, ``("reduce", j, stage)`` and ``("reduced", j, stage)`` for the
    reduce-scatters. ``alive``: at each gather of a layer issued or waited, how many layers'
    gathered tensors are alive (weak references; a gather in flight counts), besides the
    parameters outside the layers (whole for the whole product)."""

    def __init__(self, walk: Any) -> None:
        self.stages = walk.stages
        self.events: list[tuple[Any, ...]] = []
        self.alive: list[int] = []
        self.in_flight_reduces: list[int] = []
        self._refs: dict[int, list[weakref.ref[torch.Tensor]]] = {}
        self._pending: set[int] = set()
        self._reducing: set[int] = set()
        st = self.stages
        gather, finish = st.gather, st.finish
        layer, head, tail = st.layer, st.head, st.tail
        st.gather = self._wrap_gather(gather)
        st.finish = self._wrap_finish(finish)
        st.layer = lambda state, i, *a: self._compute(i, layer, state, i, *a)
        st.head = lambda state, *a: self._compute(None, head, state, *a)
        st.tail = lambda state, *a: self._compute(None, tail, state, *a)

    def _stage(self, name: str) -> int | None:
        hits = [i for i, p in enumerate(self.stages.prefixes) if name.startswith(p)]
        return hits[0] if hits else None

    def _compute(self, stage: int | None, fn: Callable[..., Any], *args: Any) -> Any:
        self.events.append(("compute", stage))
        return fn(*args)

    def _layers_alive(self) -> int:
        return sum(
            1
            for k, refs in self._refs.items()
            if k in self._pending or any(r() is not None for r in refs)
        )

    def _wrap_gather(self, gather: Callable[..., Any]) -> Callable[..., Any]:
        rec = self

        class Handle:
            def __init__(self, k: int, stage: int | None, inner: Any) -> None:
                self.k, self.stage, self.inner = k, stage, inner

            def wait(self) -> list[torch.Tensor]:
                whole = self.inner.wait()
                rec.events.append(("wait", self.k, self.stage))
                rec._pending.discard(self.k)
                if self.stage is not None:
                    rec._refs[self.k] = [weakref.ref(t) for t in whole]
                    rec.alive.append(rec._layers_alive())
                return whole

        def wrapped(items: list[Any]) -> Any:
            k = sum(1 for e in rec.events if e[0] == "issue")
            stage = rec._stage(items[0][0]) if items else None
            rec.events.append(("issue", k, stage))
            if stage is not None:
                rec._pending.add(k)
                rec._refs[k] = []
                rec.alive.append(rec._layers_alive())
            return Handle(k, stage, gather(items))

        return wrapped

    def _wrap_finish(self, finish: Callable[..., Any]) -> Callable[..., Any]:
        rec = self

        class Handle:
            def __init__(self, j: int, stage: int | None, inner: Any) -> None:
                self.j, self.stage, self.inner = j, stage, inner

            def wait(self) -> list[torch.Tensor]:
                out = self.inner.wait()
                rec.events.append(("reduced", self.j, self.stage))
                rec._reducing.discard(self.j)
                return out

        def wrapped(items: list[Any]) -> Any:
            j = sum(1 for e in rec.events if e[0] == "reduce")
            stage = rec._stage(items[0][0])
            rec.events.append(("reduce", j, stage))
            rec._reducing.add(j)
            rec.in_flight_reduces.append(len(rec._reducing))
            out, inner = finish(items)
            return out, Handle(j, stage, inner)

        return wrapped

    def ahead(self) -> list[bool]:
        """For each gather but the last: whether the next one was issued before its stage's
        first computation after its tensors were handed over."""
        ev = self.events
        issues = [e for e in ev if e[0] == "issue"]
        out = []
        for k, (_, _, stage) in enumerate(issues[:-1]):
            w = ev.index(("wait", k, stage))
            first = next(i for i in range(w, len(ev)) if ev[i] == ("compute", stage))
            out.append(ev.index(("issue", k + 1, issues[k + 1][2])) < first)
        return out

    def summary(self) -> dict[str, Any]:
        waited = {e[1] for e in self.events if e[0] == "wait"}
        issued = {e[1] for e in self.events if e[0] == "issue"}
        reduced = {e[1] for e in self.events if e[0] == "reduced"}
        reduces = {e[1] for e in self.events if e[0] == "reduce"}
        return {
            "ahead": self.ahead(),
            "max_alive": max(self.alive),
            "max_reduces_in_flight": max(self.in_flight_reduces),
            "all_waited": waited == issued and reduced == reduces,
            # the collectives' order (it must be the same on every rank)
            "collectives": [[e[0], e[2]] for e in self.events if e[0] in ("issue", "reduce")],
        }


def _gpt2_three_layers() -> tuple[nn.Module, str]:
    """The tiny GPT-2 of ``_walk_model`` with three layers: a layer held past its turn would
    make three alive at once."""
    import transformers

    torch.manual_seed(0)
    cfg = transformers.GPT2Config(
        n_layer=3,
        n_embd=16,
        n_head=2,
        vocab_size=50,
        n_positions=32,
        attn_pdrop=0.0,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
    )
    model = transformers.GPT2LMHeadModel._from_config(cfg, attn_implementation="eager")
    model = model.double().eval()
    fully_shard = _torch_compat.fully_shard()
    for block in model.transformer.h:
        fully_shard(block)
    fully_shard(model)
    return model, "transformer.h"


@check
def order() -> dict[str, Any]:
    """The order of one Hessian and one GGN product's collectives and computations with and
    without prefetching, and how many layers' gathered parameters are alive at once."""
    model, layers = _gpt2_three_layers()
    made = {
        "hessian": lambda: hd.FSDPHessianOperator(
            model, [_walk_batch(RANK)], _walk_lm, engine="layers", layers=layers
        ),
        "ggn": lambda: hd.FSDPGGNOperator(
            model, [_ggn_data(RANK)], _walk_forward, CE, layers=layers
        ),
    }
    out: dict[str, Any] = {}
    for name, make in made.items():
        for prefetch in (True, False):
            op = make()
            _walk(op).prefetch = prefetch
            v = rand(op.size, seed=RANK)
            op @ v  # the first product records the calls' checks: not the one recorded
            rec = Recorder(_walk(op))
            # cycles collected by the garbage collector would make the count depend on when it
            # runs: off, a tensor held only by a cycle counts as alive
            gc.disable()
            try:
                op @ v
            finally:
                gc.enable()
            out[f"{name}_{'on' if prefetch else 'off'}"] = rec.summary()
    return out


if __name__ == "__main__":
    run_sharded_worker(CHECKS, RANK)
