"""CUDA-graph replay of products on a kept state (NOTE [CUDA graphs] in operators.cuda_graphs).

Replays run the recorded kernels, so results must equal eager products with
graphs off; the cost counters say how many products were replayed.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from torch import nn

from hessian_eigenthings.loss_fns import supervised_loss
from hessian_eigenthings.operators import HessianOperator
from hessian_eigenthings.operators.graph_reuse import batch_leaves

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _cnn() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
        nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 8 * 8, 5),
    ).eval()


def _problem(device: str) -> tuple[nn.Module, list[tuple[torch.Tensor, torch.Tensor]]]:
    model = _cnn().to(device)
    g = torch.Generator().manual_seed(1)
    batch = (torch.randn(16, 3, 8, 8, generator=g).to(device), torch.randint(0, 5, (16,), generator=g).to(device))
    return model, [batch]


def test_option_is_validated() -> None:
    model, data = _problem("cpu")
    with pytest.raises(TypeError, match="cuda_graphs"):
        HessianOperator(model, data, supervised_loss(nn.CrossEntropyLoss()), cuda_graphs="yes")  # type: ignore[arg-type]


def test_cpu_operators_never_record() -> None:
    model, data = _problem("cpu")
    op = HessianOperator(model, data, supervised_loss(nn.CrossEntropyLoss()), graph_reuse=True)
    v = torch.randn(op.size)
    first = op @ v
    for _ in range(3):
        torch.testing.assert_close(op @ v, first, rtol=0, atol=0)
    assert op.num_replays == 0


@cuda
@pytest.mark.parametrize("k", [1, 4])
def test_replayed_products_equal_eager_products(k: int) -> None:
    model, data = _problem("cuda")
    loss = supervised_loss(nn.CrossEntropyLoss())
    graphed = HessianOperator(model, data, loss, graph_reuse=True, cuda_graphs=True)
    eager = HessianOperator(model, data, loss, graph_reuse=True, cuda_graphs=False)
    g = torch.Generator(device="cuda").manual_seed(2)
    for step in range(4):
        V = torch.randn(graphed.size, k, device="cuda", generator=g).squeeze(-1)
        torch.testing.assert_close(graphed @ V, eager @ V, rtol=1e-5, atol=1e-6)
        # first product builds and runs eagerly, the second records, later ones replay
        assert graphed.num_replays == max(0, step)
    assert graphed.num_forwards == 1 and eager.num_replays == 0


@cuda
@pytest.mark.parametrize("engine", ["functional", "compiled"])
@pytest.mark.parametrize("k", [1, 3])
def test_traced_engines_replay_their_products(engine: str, k: int) -> None:
    """Both traced engines' products on a kept batch are recorded (the compiled one after its
    compiling first run) and replay the autograd engine's numbers."""
    model, data = _problem("cuda")
    loss = supervised_loss(nn.CrossEntropyLoss())
    traced = HessianOperator(model, data, loss, engine=engine)
    reference = HessianOperator(model, data, loss, engine="autograd", cuda_graphs=False)
    g = torch.Generator(device="cuda").manual_seed(3)
    for step in range(4):
        V = torch.randn(traced.size, k, device="cuda", generator=g).squeeze(-1)
        torch.testing.assert_close(traced @ V, reference @ V, rtol=1e-4, atol=1e-5)
        assert traced.num_replays == max(0, step)
    assert traced.engine_report["active"] == engine


def _recorded_then_stepped(graph_reuse: bool) -> tuple[nn.Module, list[Any], Any, HessianOperator, torch.Tensor, torch.Tensor]:
    """An operator past its recording, then an in-place update of every parameter (an
    optimizer step); returns ``(model, data, loss, operator, v, eager product after the step)``."""
    model, data = _problem("cuda")
    loss = supervised_loss(nn.CrossEntropyLoss())
    graphed = HessianOperator(model, data, loss, graph_reuse=graph_reuse)
    v = torch.randn(graphed.size, device="cuda")
    for _ in range(3):
        graphed @ v
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.1)
    expected = HessianOperator(model, data, loss, graph_reuse=False, cuda_graphs=False) @ v
    return model, data, loss, graphed, v, expected


@cuda
def test_parameter_change_invalidates_the_recording() -> None:
    _, _, _, graphed, v, expected = _recorded_then_stepped(graph_reuse=True)
    for _ in range(3):  # rebuilt and run eagerly, recorded into a fresh pool, replayed
        torch.testing.assert_close(graphed @ v, expected, rtol=1e-4, atol=1e-5)
    assert graphed.num_forwards == 2 and graphed.num_replays == 2 + 2


class _HostSyncIdentity(torch.autograd.Function):
    """Identity whose backward reads a value on the host: it cannot be recorded."""

    @staticmethod
    def forward(ctx, x):  # type: ignore[no-untyped-def, override]
        return x.clone()

    @staticmethod
    def backward(ctx, grad):  # type: ignore[no-untyped-def, override]
        if float(grad.abs().sum()) < 0:  # a host sync
            raise AssertionError
        return grad


class _Square(torch.autograd.Function):
    """x² whose backward goes through ``_HostSyncIdentity``, so the second backward syncs."""

    @staticmethod
    def forward(ctx, x):  # type: ignore[no-untyped-def, override]
        ctx.save_for_backward(x)
        return x * x

    @staticmethod
    def backward(ctx, grad):  # type: ignore[no-untyped-def, override]
        (x,) = ctx.saved_tensors
        return _HostSyncIdentity.apply(2 * x * grad)


@cuda
@pytest.mark.parametrize(
    ("reuse", "what"), [(True, "the kept backward"), (False, "the product")], ids=["kept-state", "whole-product"]
)
def test_a_capture_that_fails_warns_once_and_falls_back(reuse: bool, what: str) -> None:
    model = nn.Linear(6, 1).cuda()
    x = torch.randn(10, 6, device="cuda")

    def loss_fn(m: nn.Module, batch: torch.Tensor) -> torch.Tensor:
        return _Square.apply(m(batch)).mean()

    graphed = HessianOperator(model, [x], loss_fn, graph_reuse=reuse)
    eager = HessianOperator(model, [x], loss_fn, graph_reuse=reuse, cuda_graphs=False)
    v = torch.randn(graphed.size, device="cuda")
    expected = eager @ v
    torch.testing.assert_close(graphed @ v, expected)
    with pytest.warns(RuntimeWarning, match=f"recording {what} as a CUDA graph failed"):
        got = graphed @ v
    torch.testing.assert_close(got, expected)
    torch.testing.assert_close(graphed @ v, expected)  # no second attempt, no second warning
    assert graphed.num_replays == 0 and not graphed.recorder.recorded
    torch.randn(3, device="cuda")  # the failed capture left the random generator usable


def test_private_leaves_give_the_same_products() -> None:
    """The forward a recorded state is built with (functional_call on stand-in leaves) is the same Hessian."""
    torch.manual_seed(3)
    shared = nn.Linear(5, 5)
    model = nn.Sequential(shared, nn.Tanh(), shared, nn.Tanh(), nn.Linear(5, 2))  # tied layers
    data = [(torch.randn(7, 5), torch.randint(0, 2, (7,)))]
    op = HessianOperator(model, data, supervised_loss(nn.CrossEntropyLoss()), graph_reuse=False)
    V = torch.randn(op.size, 3)
    expected = op @ V
    op.recorder.in_own_stream = True  # what the CUDA path sets while it builds a state to record
    got = op @ V
    op.recorder.in_own_stream = False
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-7)


@cuda
def test_the_users_own_backward_is_untouched() -> None:
    """A recorded state must not tie the parameters' gradient accumulators to the operator's stream."""
    import warnings

    model, data = _problem("cuda")
    loss = supervised_loss(nn.CrossEntropyLoss())
    graphed = HessianOperator(model, data, loss, graph_reuse=True)
    v = torch.randn(graphed.size, device="cuda")
    for _ in range(3):
        graphed @ v
    assert graphed.num_replays == 2  # eager, recorded + replayed, replayed
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loss(model, data[0]).backward()  # the user's training step, on the default stream
    assert all(p.grad is not None for p in model.parameters())


# -- recorded products without a kept state (NOTE [recorded products]) -----------------


def _batches(device: str, sizes: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(4)
    return [
        (torch.randn(b, 3, 8, 8, generator=g).to(device), torch.randint(0, 5, (b,), generator=g).to(device))
        for b in sizes
    ]


def test_signatures_key_recordings_by_shapes_and_modes() -> None:
    model, data = _problem("cpu")
    op = HessianOperator(model, data, supervised_loss(nn.CrossEntropyLoss()), graph_reuse=False)

    def sig(batch: object, k: int) -> object:
        return op.recorder.signature(batch_leaves(batch), k)

    a, b = _batches("cpu", [16, 16])
    assert sig(a, 1) == sig(b, 1)
    assert sig(a, 1) != sig(a, 4)
    assert sig(a, 1) != sig(_batches("cpu", [7])[0], 1)
    assert sig({"x": a[0], "tag": {1}}, 1) is None  # an unhashable leaf: never recorded
    assert sig((a[0].requires_grad_(), a[1]), 1) is None
    before = sig(b, 1)
    model.train()
    assert sig(b, 1) != before


@cuda
@pytest.mark.parametrize("k", [1, 4])
def test_recorded_products_equal_eager_products(k: int) -> None:
    model, data = _problem("cuda")
    loss = supervised_loss(nn.CrossEntropyLoss())
    graphed = HessianOperator(model, data, loss, graph_reuse=False)
    eager = HessianOperator(model, data, loss, graph_reuse=False, cuda_graphs=False)
    g = torch.Generator(device="cuda").manual_seed(2)
    for step in range(4):
        V = torch.randn(graphed.size, k, device="cuda", generator=g).squeeze(-1)
        torch.testing.assert_close(graphed @ V, eager @ V, rtol=1e-5, atol=1e-6)
        # the first product runs eagerly, the second records and replays, later ones replay
        assert graphed.num_replays == step
    assert graphed.num_forwards == 4 and graphed.num_passes == 4 and eager.num_replays == 0
    assert graphed.held_bytes > 0 and not graphed._states.entries  # a recording, no kept graph


@cuda
def test_one_recording_serves_every_batch_of_its_shape() -> None:
    model, _ = _problem("cuda")
    data = _batches("cuda", [16, 16, 16, 9])  # an uneven last batch: a second signature
    loss = supervised_loss(nn.CrossEntropyLoss())
    graphed = HessianOperator(model, data, loss, graph_reuse=False)
    eager = HessianOperator(model, data, loss, graph_reuse=False, cuda_graphs=False)
    v = torch.randn(graphed.size, device="cuda")
    for _ in range(3):
        torch.testing.assert_close(graphed @ v, eager @ v, rtol=1e-5, atol=1e-6)
    assert len(graphed.recorder.recorded) == 2
    # 4 batches per product. Pass 1: the first batch warms, the second records and replays,
    # the third replays, the short batch warms its own signature; then 4 replays per pass
    assert graphed.num_replays == 2 + 4 + 4


@cuda
def test_cycling_batches_replay_with_their_own_contents() -> None:
    model, _ = _problem("cuda")
    data = _batches("cuda", [16, 16, 16])
    loss = supervised_loss(nn.CrossEntropyLoss())
    graphed = HessianOperator(model, data, loss, full_dataset=False)
    eager = HessianOperator(model, data, loss, full_dataset=False, cuda_graphs=False)
    v = torch.randn(graphed.size, device="cuda")
    results = []
    for _ in range(6):
        got = graphed @ v
        torch.testing.assert_close(got, eager @ v, rtol=1e-5, atol=1e-6)
        results.append(got)
    assert graphed.num_replays == 5
    assert not torch.allclose(results[3], results[4])  # batches differ, so do their products


@cuda
def test_recordings_follow_parameter_updates_and_new_storage() -> None:
    # the in-place step is read by the next replay
    model, data, loss, graphed, v, expected = _recorded_then_stepped(graph_reuse=False)
    replays = graphed.num_replays
    torch.testing.assert_close(graphed @ v, expected, rtol=1e-5, atol=1e-6)
    assert graphed.num_replays == replays + 1
    first = model[0]
    first.weight.data = first.weight.data * 0.5  # new storage: the recording is dropped
    expected = HessianOperator(model, data, loss, graph_reuse=False, cuda_graphs=False) @ v
    torch.testing.assert_close(graphed @ v, expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(graphed @ v, expected, rtol=1e-5, atol=1e-6)


@cuda
def test_recorded_products_leave_training_buffers_alone() -> None:
    model, data = _problem("cuda")
    model.train()  # BatchNorm in training mode updates running statistics in eager forwards
    loss = supervised_loss(nn.CrossEntropyLoss())
    buffers = {n: b.clone() for n, b in model.named_buffers()}
    graphed = HessianOperator(model, data, loss, graph_reuse=False)
    eager = HessianOperator(model, data, loss, graph_reuse=False, cuda_graphs=False)
    v = torch.randn(graphed.size, device="cuda")
    for _ in range(4):
        torch.testing.assert_close(graphed @ v, eager @ v, rtol=1e-5, atol=1e-6)
    assert graphed.num_replays == 3
    for n, b in model.named_buffers():
        assert torch.equal(b, buffers[n]), n


@cuda
def test_no_recording_past_the_memory_budget() -> None:
    model, data = _problem("cuda")
    loss = supervised_loss(nn.CrossEntropyLoss())
    op = HessianOperator(model, data, loss, graph_reuse=False, graph_memory_budget=1)
    v = torch.randn(op.size, device="cuda")
    for _ in range(3):
        op @ v
    assert op.num_replays == 0 and op.held_bytes == 0


@cuda
def test_states_past_the_kept_count_are_recorded_products() -> None:
    model, _ = _problem("cuda")
    data = _batches("cuda", [16, 16])
    loss = supervised_loss(nn.CrossEntropyLoss())
    graphed = HessianOperator(model, data, loss, graph_reuse=True, graph_reuse_max_batches=1)
    eager = HessianOperator(model, data, loss, graph_reuse=False, cuda_graphs=False)
    v = torch.randn(graphed.size, device="cuda")
    for _ in range(4):
        torch.testing.assert_close(graphed @ v, eager @ v, rtol=1e-5, atol=1e-6)
    assert len(graphed._states.entries) == 1 and len(graphed.recorder.recorded) == 1
    # both batches run eagerly in the first product (batch 1 builds its kept graph, batch 2
    # warms its signature), then both are recorded in the second and replayed from then on
    assert graphed.num_replays == 3 + 3


class _ScalarMask(nn.Module):
    """A forward that builds a scalar tensor on the device, as HuggingFace's eager attention mask does."""

    def __init__(self) -> None:
        super().__init__()
        self.net = _cnn()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.net(x)
        zero = torch.tensor(0.0, device=out.device, dtype=out.dtype)
        return torch.where(out > -1e9, out, zero)


def test_scalar_tensors_pass_through_off_the_gpu() -> None:
    from hessian_eigenthings._torch_compat import CapturableScalars

    with CapturableScalars():
        t = torch.tensor(2.5, dtype=torch.float64)
        u = torch.tensor([1, 2])
        w = torch.tensor(True, device="cpu")
    assert t.dtype == torch.float64 and float(t) == 2.5 and u.tolist() == [1, 2] and w.dtype == torch.bool


@cuda
def test_scalar_tensors_built_in_the_forward_are_recorded() -> None:
    from hessian_eigenthings._torch_compat import CapturableScalars

    with CapturableScalars():
        for value, dtype in [(0.5, torch.float32), (3, torch.int64), (True, torch.bool)]:
            t = torch.tensor(value, device="cuda")
            assert t.dtype == dtype and t.item() == value and t.shape == ()
    model = _ScalarMask().cuda()
    _, data = _problem("cuda")
    loss = supervised_loss(nn.CrossEntropyLoss())
    graphed = HessianOperator(model, data, loss, graph_reuse=False)
    eager = HessianOperator(model, data, loss, graph_reuse=False, cuda_graphs=False)
    v = torch.randn(graphed.size, device="cuda")
    for _ in range(3):
        torch.testing.assert_close(graphed @ v, eager @ v, rtol=1e-5, atol=1e-6)
    assert graphed.num_replays == 2


@cuda
def test_allocator_readings_match_torch() -> None:
    from hessian_eigenthings import _torch_compat

    dev = torch.device("cuda")
    x = torch.empty(3 * 2**20, device=dev)
    assert _torch_compat.cuda_allocated(dev) == torch.cuda.memory_allocated(dev)
    assert _torch_compat.cuda_reserved(dev) == torch.cuda.memory_reserved(dev)
    del x


@cuda
def test_a_dropped_operator_collected_during_a_capture_does_not_break_it() -> None:
    """NOTE [no collection during a capture]: an operator dropped in a reference cycle frees
    its recordings whenever the cyclic collector runs; with the collector made eager, it would
    run inside the next capture and break it. Recordings must still succeed, silently."""
    import gc

    model, data = _problem("cuda")
    loss = supervised_loss(nn.CrossEntropyLoss())
    v = torch.randn(HessianOperator(model, data, loss).size, device="cuda")
    threshold = gc.get_threshold()
    gc.set_threshold(1)
    try:
        for _ in range(3):
            dropped = HessianOperator(model, data, loss, graph_reuse=False)
            for _ in range(3):
                dropped @ v
            assert dropped.num_replays == 2
            del dropped  # unreachable, still in a cycle (its collaborators point back at it)
        fresh = HessianOperator(model, data, loss, graph_reuse=False)
        expected = HessianOperator(model, data, loss, graph_reuse=False, cuda_graphs=False) @ v
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)
            for _ in range(3):
                torch.testing.assert_close(fresh @ v, expected, rtol=1e-5, atol=1e-6)
        assert fresh.num_replays == 2
    finally:
        gc.set_threshold(*threshold)


@cuda
@pytest.mark.parametrize("engine", ["autograd", "functional"])
@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("reuse", [True, False])
def test_replayed_products_make_no_shaped_views(
    engine: str, k: int, reuse: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """NOTE [views on demand]: a replayed product copies its direction in and its result out
    as column blocks; the per-parameter shaped views (a Python call per parameter) are not
    made. Results equal eager products with graphs off."""
    from hessian_eigenthings.param_utils import ParamLayout

    model, data = _problem("cuda")
    loss = supervised_loss(nn.CrossEntropyLoss())
    graphed = HessianOperator(model, data, loss, graph_reuse=reuse, cuda_graphs=True, engine=engine)  # type: ignore[arg-type]
    eager = HessianOperator(model, data, loss, graph_reuse=reuse, cuda_graphs=False, engine=engine)  # type: ignore[arg-type]
    V = torch.randn(graphed.size, k, device="cuda")
    ref = eager @ V
    for _ in range(3):  # eager, recorded, replayed
        graphed @ V
    calls = []
    real = ParamLayout.split_rows
    monkeypatch.setattr(ParamLayout, "split_rows", lambda self, b: calls.append(1) or real(self, b))
    replays = graphed.num_replays
    out = graphed @ V
    assert graphed.num_replays == replays + 1
    assert calls == []
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)


@cuda
@pytest.mark.parametrize("engine", ["autograd", "functional"])
def test_direction_copied_ahead_is_the_one_replayed(engine: str) -> None:
    """NOTE [direction copied ahead]: a single-vector pass copies its direction into the last
    recording before checking the reuse key; products stay equal to eager ones when the
    directions change every call, when the kept state is dropped (a parameter changed) and
    when a block of another width comes in between."""
    model, data = _problem("cuda")
    loss = supervised_loss(nn.CrossEntropyLoss())
    graphed = HessianOperator(model, data, loss, cuda_graphs=True, engine=engine)  # type: ignore[arg-type]
    eager = HessianOperator(model, data, loss, cuda_graphs=False, engine=engine)  # type: ignore[arg-type]
    g = torch.Generator(device="cuda").manual_seed(0)
    for step in range(8):
        v = torch.randn(graphed.size, device="cuda", generator=g)
        if step == 4:
            with torch.no_grad():
                model[0].weight.mul_(1.5)  # drops the kept state and its recording
        if step == 6:
            W = torch.randn(graphed.size, 2, device="cuda", generator=g)
            torch.testing.assert_close(graphed @ W, eager @ W, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(graphed @ v, eager @ v, rtol=1e-5, atol=1e-6)
    assert graphed.num_replays > 0
    rec = graphed.recorder
    assert rec.last_replay is not None and rec.last_replay() is not None


@cuda
def test_default_memory_budget_is_half_the_device_with_a_free_floor(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """NOTE [memory budget]: by default states may hold half the device, and none is kept while
    less than a tenth of the device would stay free; an explicit budget skips the free check."""
    from hessian_eigenthings.operators import graph_reuse

    model, data = _problem("cuda")
    loss = supervised_loss(nn.CrossEntropyLoss())
    op = HessianOperator(model, data, loss)
    total = torch.cuda.get_device_properties(0).total_memory
    assert op._states.budget() == int(0.5 * total)
    v = torch.randn(op.size, device="cuda")
    op @ v
    assert op.held_bytes > 0 and len(op._states.entries) == 1
    # a device nearly full (as the driver reports it): the default keeps nothing
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (0, total))
    monkeypatch.setattr(graph_reuse._torch_compat, "cuda_reserved", lambda device: 0)
    full = HessianOperator(model, data, loss)
    expected = full @ v
    assert len(full._states.entries) == 0 and full._states.unkept_bytes > 0
    torch.testing.assert_close(expected, op @ v, rtol=1e-5, atol=1e-6)
    explicit = HessianOperator(model, data, loss, graph_memory_budget=2**34, cuda_graphs=False)
    explicit @ v
    assert len(explicit._states.entries) == 1
