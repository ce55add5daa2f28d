"""HessianOperator against dense float64 Hessians (torch.func) on small models."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hessian_eigenthings.loss_fns import supervised_loss
from hessian_eigenthings.operators import HessianOperator
from hessian_eigenthings.param_utils import match_names, select_parameters
from hessian_eigenthings.testing import dense_hessian
from tests.conftest import SmallCNN, TinyTransformer, classification_data, mlp
from tests.operators.contract import assert_unchanged, check_contract, snapshot

CE = nn.CrossEntropyLoss()


def sup_loss(model, batch):
    return CE(model(batch[0]), batch[1])


def lm_loss(model, batch):
    logits = model(batch["input_ids"])
    return nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), batch["input_ids"][:, 1:].reshape(-1))


@pytest.mark.parametrize("reuse", [False, True])
def test_mlp_uneven_batches_matches_dense(reuse: bool) -> None:
    model, data = mlp(), classification_data(n=10, batch=4)  # batches of 4, 4, 2
    op = HessianOperator(model, data, sup_loss, graph_reuse=reuse)
    H = dense_hessian(model, data, sup_loss, select_parameters(model))
    check_contract(op, H, model)


def test_weighting_is_by_batch_size_not_per_batch() -> None:
    model, data = mlp(), classification_data(n=10, batch=4)
    X = torch.cat([b[0] for b in data])
    Y = torch.cat([b[1] for b in data])
    whole = HessianOperator(model, [(X, Y)], sup_loss)
    split = HessianOperator(model, data, sup_loss)
    v = torch.randn(whole.size, dtype=torch.float64)
    torch.testing.assert_close(split @ v, whole @ v, rtol=1e-12, atol=1e-12)


def test_param_filter_subset() -> None:
    model, data = mlp(), classification_data()
    flt = match_names("2.*")
    op = HessianOperator(model, data, sup_loss, param_filter=flt)
    H = dense_hessian(model, data, sup_loss, select_parameters(model, flt))
    assert op.size == 7 * 3 + 3
    check_contract(op, H, model)


def test_frozen_parameter_selected_explicitly_stays_frozen() -> None:
    model, data = mlp(), classification_data()
    model[0].weight.requires_grad_(False)
    op = HessianOperator(model, data, sup_loss, param_filter=match_names("0.weight"))
    H = dense_hessian(model, data, sup_loss, select_parameters(model, match_names("0.weight")))
    check_contract(op, H, model)
    assert not model[0].weight.requires_grad


@pytest.mark.parametrize("mode", ["eval", "train"])
def test_cnn_with_batchnorm(mode: str) -> None:
    model = SmallCNN().double()
    model.train(mode == "train")
    X = torch.randn(6, 2, 4, 4, dtype=torch.float64)
    Y = torch.randint(0, 4, (6,))
    data = [(X[:3], Y[:3]), (X[3:], Y[3:])]
    op = HessianOperator(model, data, sup_loss)
    H = dense_hessian(model, data, sup_loss, select_parameters(model))
    check_contract(op, H, model)  # includes: BatchNorm running statistics restored in train mode


def test_microbatching_equals_whole_batches() -> None:
    model = SmallCNN().double().eval()
    X = torch.randn(7, 2, 4, 4, dtype=torch.float64)
    Y = torch.randint(0, 4, (7,))
    data = [(X, Y)]
    H = dense_hessian(model, data, sup_loss, select_parameters(model))
    for reuse in (False, True):
        op = HessianOperator(model, data, sup_loss, microbatch_size=3, graph_reuse=reuse)
        check_contract(op, H, model)
        assert op.num_forwards >= 3


def test_microbatching_refused_for_training_batchnorm() -> None:
    model = SmallCNN().double().train()
    with pytest.raises(ValueError, match="BatchNorm"):
        HessianOperator(model, [(torch.zeros(2, 2, 4, 4), torch.zeros(2))], sup_loss, microbatch_size=1)
    HessianOperator(model, [(torch.zeros(2, 2, 4, 4), torch.zeros(2))], sup_loss, microbatch_size=1, microbatch_unsafe=True)


def test_tiny_transformer_dict_batches() -> None:
    model = TinyTransformer().double()
    ids = torch.randint(0, 11, (3, 5))
    data = [{"input_ids": ids[:2]}, {"input_ids": ids[2:]}]
    op = HessianOperator(model, data, lm_loss, param_filter=match_names("qkv.*", "head.bias"))
    H = dense_hessian(model, data, lm_loss, select_parameters(model, match_names("qkv.*", "head.bias")))
    check_contract(op, H, model, rtol=1e-8, atol=1e-10)


def test_attention_backends_without_double_backward_still_work() -> None:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    model = TinyTransformer().double()
    data = [{"input_ids": torch.randint(0, 11, (2, 5))}]
    op = HessianOperator(model, data, lm_loss, param_filter=match_names("qkv.*"))
    ref = HessianOperator(model, data, lm_loss, param_filter=match_names("qkv.*")) @ torch.ones(op.size, dtype=torch.float64)
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.MATH]):
        torch.testing.assert_close(op @ torch.ones(op.size, dtype=torch.float64), ref)


def test_graph_reuse_costs_one_forward_and_refreshes_when_stale() -> None:
    model, data = mlp(), [classification_data(n=6, batch=6)[0]]
    op = HessianOperator(model, data, sup_loss)
    fresh = HessianOperator(model, data, sup_loss, graph_reuse=False)
    v = torch.randn(op.size, dtype=torch.float64)
    for _ in range(5):
        torch.testing.assert_close(op @ v, fresh @ v, rtol=1e-13, atol=1e-13)
    assert op.num_forwards == 1 and fresh.num_forwards == 5
    # a parameter update (optimizer step) invalidates the kept graph
    with torch.no_grad():
        model[0].weight.mul_(1.1)
    torch.testing.assert_close(op @ v, fresh @ v, rtol=1e-13, atol=1e-13)
    assert op.num_forwards == 2
    # changed data invalidates it too
    data[0][0].add_(0.5)
    torch.testing.assert_close(op @ v, fresh @ v, rtol=1e-13, atol=1e-13)
    assert op.num_forwards == 3


def test_graph_reuse_detects_new_but_equal_batches() -> None:
    model = mlp()
    X, Y = torch.randn(4, 5, dtype=torch.float64), torch.randint(0, 3, (4,))

    class Loader:
        def __len__(self) -> int:
            return 1

        def __iter__(self):  # new tensor objects each time, as a DataLoader yields
            yield (X.clone(), Y.clone())

    op = HessianOperator(model, Loader(), sup_loss)
    v = torch.randn(op.size, dtype=torch.float64)
    a, b = op @ v, op @ v
    torch.testing.assert_close(a, b)
    assert op.num_forwards == 1


def test_block_product_uses_one_pass() -> None:
    model, data = mlp(), [classification_data(n=6, batch=6)[0]]
    op = HessianOperator(model, data, sup_loss, graph_reuse=False)
    V = torch.randn(op.size, 8, dtype=torch.float64)
    AV = op @ V
    assert op.num_forwards == 1 and op.num_matvecs == 8
    H = dense_hessian(model, data, sup_loss, select_parameters(model))
    torch.testing.assert_close(AV, H @ V)


def test_block_chunking_respects_max_block_size() -> None:
    model, data = mlp(), [classification_data(n=6, batch=6)[0]]
    op = HessianOperator(model, data, sup_loss, graph_reuse=False, max_block_size=3)
    V = torch.randn(op.size, 8, dtype=torch.float64)
    H = dense_hessian(model, data, sup_loss, select_parameters(model))
    torch.testing.assert_close(op @ V, H @ V)
    assert op.num_forwards == 3  # chunks of 3, 3, 2


def test_full_dataset_false_cycles_batches() -> None:
    model, data = mlp(), classification_data(n=12, batch=4)
    op = HessianOperator(model, data, sup_loss, full_dataset=False)
    v = torch.randn(op.size, dtype=torch.float64)
    for i in range(5):
        H = dense_hessian(model, [data[i % 3]], sup_loss, select_parameters(model))
        torch.testing.assert_close(op @ v, H @ v)


def test_num_batches_caps_the_pass() -> None:
    model, data = mlp(), classification_data(n=12, batch=4)
    op = HessianOperator(model, data, sup_loss, num_batches=2)
    H = dense_hessian(model, data[:2], sup_loss, select_parameters(model))
    v = torch.randn(op.size, dtype=torch.float64)
    torch.testing.assert_close(op @ v, H @ v)


@pytest.mark.parametrize(
    ("dtype", "rtol"),
    [(torch.float64, 1e-7), (torch.float32, 2e-3)],
)
def test_finite_difference_accuracy_per_dtype(dtype: torch.dtype, rtol: float) -> None:
    model = mlp().to(dtype)
    data = [(b[0].to(dtype), b[1]) for b in classification_data()]
    op = HessianOperator(model, data, sup_loss, method="finite_difference")
    H = dense_hessian((mlp().double().load_state_dict(model.state_dict()) and model.double()) or model, [(b[0].double(), b[1]) for b in data], sup_loss, select_parameters(model)) if False else None
    model64 = mlp()
    model64.load_state_dict({k: v.double() for k, v in model.state_dict().items()})
    H = dense_hessian(model64, [(b[0].double(), b[1]) for b in data], sup_loss, select_parameters(model64))
    before = snapshot(model)
    V = torch.randn(op.size, 3, dtype=torch.float64)
    got = (op @ V.to(dtype)).double()
    ref = H @ V
    rel = (got - ref).norm() / ref.norm()
    assert rel < rtol, rel
    assert_unchanged(model, before)
    assert not torch.equal(got[:, 0], torch.zeros_like(got[:, 0]))


def test_finite_difference_zero_vector_gives_zero() -> None:
    model, data = mlp(), classification_data()
    op = HessianOperator(model, data, sup_loss, method="finite_difference")
    out = op @ torch.zeros(op.size, dtype=torch.float64)
    assert torch.all(out == 0)


def test_finite_difference_step_defaults_by_dtype() -> None:
    model = mlp()
    assert HessianOperator(model, [], sup_loss, method="finite_difference").fd_eps == 6e-6
    assert HessianOperator(model.float(), [], sup_loss, method="finite_difference").fd_eps == 5e-3
    # a half model's products run in float32 (NOTE [half models]): float32's step; in its own
    # dtype (precision="model"), its dtype's
    assert HessianOperator(model.bfloat16(), [], sup_loss, method="finite_difference").fd_eps == 5e-3
    fd = {"method": "finite_difference", "precision": "model"}
    assert HessianOperator(model.half(), [], sup_loss, **fd).fd_eps == 5e-2
    assert HessianOperator(model.bfloat16(), [], sup_loss, **fd).fd_eps == 0.2


@pytest.mark.parametrize("method", ["autograd", "finite_difference"])
def test_model_restored_when_loss_raises_midway(method: str) -> None:
    model, data = mlp(), classification_data()
    calls = {"n": 0}

    def flaky(m, b):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("boom")
        return sup_loss(m, b)

    model[2].weight.grad = torch.ones_like(model[2].weight)
    model[0].bias.requires_grad_(False)
    op = HessianOperator(model, data, flaky, method=method, param_filter=lambda n, p: True)
    before = snapshot(model)
    with pytest.raises(RuntimeError, match="boom"):
        op @ torch.randn(op.size, dtype=torch.float64)
    assert_unchanged(model, before)


def test_bad_inputs_name_the_fix() -> None:
    model, data = mlp(), classification_data()
    op = HessianOperator(model, data, sup_loss)
    with pytest.raises(ValueError, match="shape"):
        op @ torch.zeros(op.size + 1, dtype=torch.float64)
    with pytest.raises(TypeError, match="dtype"):
        op @ torch.zeros(op.size, dtype=torch.float32)
    with pytest.raises(ValueError, match="on meta"):
        op @ torch.zeros(op.size, dtype=torch.float64, device="meta")
    with pytest.raises(ValueError, match="shape"):
        op.matmat(torch.zeros(3, op.size, dtype=torch.float64))
    with pytest.raises(ValueError, match="no batch"):
        HessianOperator(model, [], sup_loss) @ torch.zeros(op.size, dtype=torch.float64)
    with pytest.raises(ValueError, match="scalar"):
        HessianOperator(model, data, lambda m, b: CE(m(b[0]), b[1]) * torch.ones(2)) @ torch.zeros(op.size, dtype=torch.float64)
    with pytest.raises(ValueError, match="method"):
        HessianOperator(model, data, sup_loss, method="bogus")  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        HessianOperator(model, data, "loss")  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        HessianOperator("model", data, sup_loss)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="fd_eps"):
        HessianOperator(model, data, sup_loss, method="finite_difference", fd_eps=-1.0)


def test_device_without_index_accepts_indexed_vectors() -> None:
    from hessian_eigenthings.operators.base import same_device

    assert same_device(torch.device("cpu"), torch.device("cpu"))
    assert not same_device(torch.device("cpu"), torch.device("meta"))
    assert same_device(torch.device("cuda"), torch.device("cuda", 0)) or not torch.cuda.is_available()


def test_a_block_that_runs_out_of_memory_is_retried_in_halves() -> None:
    """NOTE [block out of memory]: same product, narrower passes, the limit is remembered."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 2))
    data = [(torch.randn(8, 4), torch.randint(0, 2, (8,)))]

    widths: list[int] = []

    class Tight(HessianOperator):
        def _pass(self, V: torch.Tensor, out: torch.Tensor) -> None:
            widths.append(V.shape[0])
            if V.shape[0] > 3:
                raise torch.cuda.OutOfMemoryError("simulated")
            super()._pass(V, out)

    loss = supervised_loss(nn.CrossEntropyLoss())
    op = Tight(model, data, loss)
    V = torch.randn(op.size, 10)
    expected = HessianOperator(model, data, loss) @ V
    torch.testing.assert_close(op @ V, expected)
    assert widths == [10, 5, 2, 2, 2, 2, 2]
    assert op._oom_block_limit == 2
    cycling = Tight(model, data, loss, full_dataset=False)
    with pytest.raises(torch.cuda.OutOfMemoryError):
        cycling @ V  # a retry would take the next batch: the error reaches the caller
