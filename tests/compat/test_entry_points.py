"""Behaviour of each 0.x entry point: signatures, defaults, return types, errors."""

from __future__ import annotations

import inspect
import logging

import deprecation
import numpy as np
import pytest
import scipy.sparse.linalg
import torch

import hessian_eigenthings as he
from hessian_eigenthings import compat
from hessian_eigenthings.loss_fns import supervised_loss
from hessian_eigenthings.operators import HessianOperator, LambdaOperator
from tests.compat.cases import mlp_problem, symmetric_matrix

legacy = pytest.mark.filterwarnings("ignore::deprecation.DeprecatedWarning")


# -- signatures ----------------------------------------------------------------

SIGNATURES = {
    compat.compute_hessian_eigenthings: "(model, dataloader, loss, num_eigenthings=10, full_dataset=True, "
    "mode='power_iter', use_gpu=True, fp16=False, max_possible_gpu_samples=65536, **kwargs)",
    compat.HVPOperator: "(model, dataloader, criterion, use_gpu=True, fp16=False, full_dataset=True, "
    "max_possible_gpu_samples=256)",
    compat.power_iteration: "(operator, steps=20, error_threshold=0.0001, momentum=0.0, use_gpu=True, "
    "fp16=False, init_vec=None)",
    compat.deflated_power_iteration: "(operator, num_eigenthings=10, power_iter_steps=20, "
    "power_iter_err_threshold=0.0001, momentum=0.0, use_gpu=True, fp16=False, to_numpy=True)",
    compat.lanczos: "(operator, num_eigenthings=10, which='LM', max_steps=20, tol=1e-06, "
    "num_lanczos_vectors=None, init_vec=None, use_gpu=False, fp16=False)",
    compat.LambdaOperator: "(apply_fn, size)",
}


@pytest.mark.parametrize("fn", list(SIGNATURES), ids=lambda f: f.__name__)
def test_0x_signatures(fn: object) -> None:
    sig = inspect.signature(fn)  # type: ignore[arg-type]
    plain = sig.replace(
        parameters=[p.replace(annotation=inspect.Parameter.empty) for p in sig.parameters.values()],
        return_annotation=inspect.Signature.empty,
    )
    assert str(plain) == SIGNATURES[fn]  # type: ignore[index]


# -- compute_hessian_eigenthings ------------------------------------------------


@legacy
@pytest.mark.filterwarnings(
    "ignore::hessian_eigenthings.algorithms.ConvergenceWarning"
)  # order is tested, not accuracy
@pytest.mark.parametrize(
    ("mode", "order"), [("power_iter", "descending"), ("lanczos", "ascending")]
)
def test_compute_hessian_eigenthings_returns_numpy_in_0x_order(mode: str, order: str) -> None:
    model, criterion, data = mlp_problem()
    n = sum(p.numel() for p in model.parameters())
    vals, vecs = compat.compute_hessian_eigenthings(
        model,
        data,
        criterion,
        3,
        mode=mode,
        use_gpu=False,
        **({"power_iter_steps": 200} if mode == "power_iter" else {}),
    )
    assert isinstance(vals, np.ndarray) and isinstance(vecs, np.ndarray)
    assert vals.shape == (3,) and vecs.shape == (3, n)
    steps = np.diff(vals)
    assert np.all(steps <= 0) if order == "descending" else np.all(steps >= 0)
    np.testing.assert_allclose(np.linalg.norm(vecs, axis=1), 1.0, rtol=1e-4)


@legacy
def test_compute_hessian_eigenthings_rejects_bad_mode_and_kwargs() -> None:
    model, criterion, data = mlp_problem()
    with pytest.raises(ValueError, match=r"mode must be 'power_iter' or 'lanczos'.*1\.0"):
        compat.compute_hessian_eigenthings(model, data, criterion, mode="arnoldi", use_gpu=False)
    with pytest.raises(TypeError, match="max_steps"):
        compat.compute_hessian_eigenthings(
            model, data, criterion, mode="power_iter", use_gpu=False, max_steps=3
        )


@legacy
@pytest.mark.parametrize(
    ("kwargs", "error", "words"),
    [
        # only values 0.x itself crashed on raise (NOTE [0.x argument values])
        ({"num_eigenthings": 2.5}, TypeError, "range"),
        ({"max_possible_gpu_samples": 0}, ValueError, "ZeroDivisionError"),
        ({"power_iter_steps": 0}, ValueError, "UnboundLocalError"),
    ],
)
def test_bad_0x_arguments_raise_the_0x_error_kind_and_name_the_1x_way(
    kwargs: dict, error: type, words: str
) -> None:
    model, criterion, data = mlp_problem()
    args = {"use_gpu": False, **kwargs}
    with pytest.raises(error, match=words):
        compat.compute_hessian_eigenthings(model, data, criterion, **args)


# -- HVPOperator ----------------------------------------------------------------


def _hvp(*args: object, **kwargs: object) -> compat.HVPOperator:
    with pytest.warns(deprecation.DeprecatedWarning):
        return compat.HVPOperator(*args, use_gpu=False, **kwargs)  # type: ignore[arg-type, misc]


def test_hvp_operator_matches_hessian_operator_on_equal_batches() -> None:
    model, criterion, data = mlp_problem()
    hvp = _hvp(model, data, criterion)
    core = HessianOperator(model, data, supervised_loss(criterion))
    v = torch.randn(hvp.size)
    assert hvp.size == core.size
    torch.testing.assert_close(hvp.apply(v), core.matvec(v))


def test_hvp_operator_keeps_0x_per_batch_average_on_a_short_last_batch() -> None:
    model, criterion, data = mlp_problem(batches=2, batch=16, last=3)
    v = torch.randn(sum(p.numel() for p in model.parameters()))
    per_batch = [HessianOperator(model, [b], supervised_loss(criterion)).matvec(v) for b in data]
    uniform = torch.stack(per_batch).mean(0)  # what 0.x computed
    weighted = HessianOperator(model, data, supervised_loss(criterion)).matvec(
        v
    )  # what 1.0 computes
    assert not torch.allclose(uniform, weighted, atol=1e-4)  # the difference is real here
    torch.testing.assert_close(_hvp(model, data, criterion).apply(v), uniform)


def test_hvp_operator_chunks_are_the_exact_batch_mean() -> None:
    model, criterion, data = mlp_problem(batches=2, batch=10)
    v = torch.randn(sum(p.numel() for p in model.parameters()))
    whole = _hvp(model, data, criterion).apply(v)
    chunked = _hvp(model, data, criterion, max_possible_gpu_samples=4)  # chunks of 4, 4, 2
    torch.testing.assert_close(chunked.apply(v), whole)
    assert chunked.microbatch_size == 4


def test_hvp_operator_full_dataset_false_cycles_batches() -> None:
    model, criterion, data = mlp_problem(batches=3)
    op = _hvp(model, data, criterion, full_dataset=False)
    v = torch.randn(op.size)
    per_batch = [HessianOperator(model, [b], supervised_loss(criterion)).matvec(v) for b in data]
    for i in range(5):
        torch.testing.assert_close(op.apply(v), per_batch[i % 3])


def test_hvp_operator_fp16_vectors_and_zero_grad() -> None:
    model, criterion, data = mlp_problem()
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    op = _hvp(model, data, criterion, fp16=True)
    assert op.dtype == torch.float16
    out = op.apply(torch.ones(op.size))  # float32 in, as 0.x allowed
    assert out.dtype == torch.float16
    full = HessianOperator(model, data, supervised_loss(criterion)).matvec(torch.ones(op.size))
    torch.testing.assert_close(out.float(), full, rtol=2e-3, atol=2e-3)
    assert all(
        torch.equal(p.grad, torch.ones_like(p)) for p in model.parameters()
    )  # products leave .grad alone
    op.zero_grad()
    assert all(not p.grad.any() for p in model.parameters())


ALGORITHMS = {
    "lanczos": lambda op: he.algorithms.lanczos(op, k=2, tol=1e-3),
    "deflated_power_iteration": lambda op: he.algorithms.deflated_power_iteration(
        op, k=1, max_iter=300, tol=1e-3
    ),
    "power_iteration_one": lambda op: he.algorithms.power_iteration_one(op, max_iter=300, tol=1e-3),
    "trace": lambda op: he.algorithms.trace(op, num_matvecs=12, seed=0),
    "diagonal": lambda op: he.algorithms.diagonal(op, num_matvecs=12, seed=0),
    "spectral_density": lambda op: he.algorithms.spectral_density(
        op, num_runs=2, lanczos_steps=8, num_grid_points=50, seed=0
    ),
}


class Dense0x(compat.Operator):
    """A user's 0.x operator: knows only size and apply."""

    def __init__(self, A: torch.Tensor) -> None:
        super().__init__(A.shape[0])
        self.A = A

    def apply(self, vec: torch.Tensor) -> torch.Tensor:
        return self.A @ vec


@pytest.mark.parametrize("algorithm", list(ALGORITHMS))
@pytest.mark.parametrize("kind", ["HVPOperator", "Operator"])
def test_0x_operators_work_with_every_1x_algorithm(kind: str, algorithm: str) -> None:
    if kind == "HVPOperator":
        model, criterion, data = mlp_problem(batches=1)
        op: he.CurvatureOperator = _hvp(model, data, criterion)
    else:
        with pytest.warns(deprecation.DeprecatedWarning):
            op = Dense0x(symmetric_matrix(30))
    ALGORITHMS[algorithm](op)  # must run without error or warning


# -- Operator / LambdaOperator ------------------------------------------------------


class Doubling(compat.Operator):
    def __init__(self, n: int, dtype: torch.dtype = torch.float32) -> None:
        super().__init__(n)
        self.out_dtype = dtype

    def apply(self, vec: torch.Tensor) -> torch.Tensor:
        return (2.0 * vec).to(self.out_dtype)


@legacy
def test_bare_operator_dtype_and_device_come_from_the_first_output() -> None:
    op = Doubling(6, torch.float64)
    assert (op.dtype, op.device, op.size) == (torch.float32, torch.device("cpu"), 6)
    out = op.matvec(torch.ones(6))
    assert out.dtype == torch.float32  # the product comes back in the caller's dtype
    assert op.dtype == torch.float64  # and the operator now reports what apply returns


@legacy
def test_operator_without_apply_says_how_to_fix() -> None:
    with pytest.raises(NotImplementedError, match="apply"):
        compat.Operator(3).matvec(torch.ones(3))
    with pytest.raises(ValueError, match="size"):
        compat.Operator(0)
    with pytest.raises(TypeError, match="LambdaOperator"):
        compat.LambdaOperator("not callable", 3)  # type: ignore[arg-type]


@legacy
def test_custom_operator_works_with_1x_algorithms() -> None:
    A = symmetric_matrix(20)
    op = compat.LambdaOperator(lambda v: A @ v, 20)
    res = he.algorithms.lanczos(op, k=2, tol=1e-6)
    torch.testing.assert_close(
        res.eigenvalues, torch.tensor([7.0, 5.0]), rtol=1e-4, atol=1e-4, check_dtype=False
    )


# -- power iteration ----------------------------------------------------------------


@legacy
def test_power_iteration_returns_float_and_tensor() -> None:
    A = symmetric_matrix(20)
    val, vec = compat.power_iteration(
        compat.LambdaOperator(lambda v: A @ v, 20), steps=300, error_threshold=1e-8, use_gpu=False
    )
    assert isinstance(val, float) and isinstance(vec, torch.Tensor) and vec.shape == (20,)
    assert val == pytest.approx(7.0, rel=1e-3)


@legacy
def test_power_iteration_init_vec_is_used() -> None:
    A = symmetric_matrix(20)
    op = compat.LambdaOperator(lambda v: A @ v, 20)
    top = torch.linalg.eigh(A.double()).eigenvectors[:, -1].float()
    val, _vec = compat.power_iteration(
        op, steps=1, init_vec=top, use_gpu=False
    )  # already an eigenvector
    assert val == pytest.approx(7.0, rel=1e-4)


@legacy
@pytest.mark.parametrize("to_numpy", [True, False])
def test_deflated_power_iteration_is_sorted_descending(to_numpy: bool) -> None:
    A = symmetric_matrix(20)  # largest magnitudes 7, 5, -4
    vals, vecs = compat.deflated_power_iteration(
        compat.LambdaOperator(lambda v: A @ v, 20), 3, 400, 1e-8, use_gpu=False, to_numpy=to_numpy
    )
    # 0.x returned numpy arrays whatever to_numpy said (NOTE [0.x deflated results])
    assert isinstance(vals, np.ndarray) and isinstance(vecs, np.ndarray)
    assert (vals.dtype, vecs.dtype) == (np.float64, np.float32)
    np.testing.assert_allclose(vals.copy(), [7.0, 5.0, -4.0], rtol=1e-3)
    assert tuple(vecs.shape) == (3, 20)


def test_unconverged_lanczos_warns_in_0x_words_at_the_user_line() -> None:
    A = symmetric_matrix(
        40, spectrum=torch.linspace(1.0, 2.0, 40)
    )  # no gap: one restart cannot converge
    op = LambdaOperator(lambda v: A @ v, 40)
    with (
        pytest.warns(he.algorithms.ConvergenceWarning) as rec,
        pytest.warns(deprecation.DeprecatedWarning),
    ):
        compat.lanczos(op, 3, "LM", 1, 1e-12, 6)
    mine = [r for r in rec if r.category is he.algorithms.ConvergenceWarning]
    assert len(mine) == 1 and mine[0].filename == __file__
    assert "max_steps" in str(mine[0].message) and "max_iter" not in str(mine[0].message)


def test_unconverged_deflated_power_iteration_is_silent_as_in_0x() -> None:
    A = symmetric_matrix(40, spectrum=torch.linspace(1.0, 2.0, 40))
    with pytest.warns(deprecation.DeprecatedWarning) as rec:
        compat.deflated_power_iteration(
            LambdaOperator(lambda v: A @ v, 40), 2, 3, 1e-12, use_gpu=False
        )
    assert {r.category for r in rec} == {deprecation.DeprecatedWarning}


# -- lanczos ------------------------------------------------------------------------


def _lanczos_0x(*args: object, **kwargs: object):  # type: ignore[no-untyped-def]
    with pytest.warns(deprecation.DeprecatedWarning):
        return compat.lanczos(*args, **kwargs)


@pytest.mark.parametrize("which", ["LM", "LA", "SA"])
def test_lanczos_matches_eigsh_float64(which: str) -> None:
    A = symmetric_matrix(60, dtype=torch.float64)
    op = LambdaOperator(lambda v: A @ v, 60, dtype=torch.float64)
    vals, vecs = _lanczos_0x(op, 4, which, 100, 1e-10)
    ref_vals, ref_vecs = scipy.sparse.linalg.eigsh(A.numpy(), k=4, which=which, tol=1e-10)
    assert np.all(np.diff(vals) >= 0)  # ascending, like eigsh
    scale = np.abs(ref_vals).max()
    np.testing.assert_allclose(vals, ref_vals, atol=1e-8 * scale, rtol=0)
    cos = np.abs(np.sum(vecs * ref_vecs.T, axis=1))  # rows vs eigsh's columns
    assert np.all(cos >= 1 - 1e-6)


def test_lanczos_matches_eigsh_float32_defaults() -> None:
    A = symmetric_matrix(60)
    vals, _ = _lanczos_0x(LambdaOperator(lambda v: A @ v, 60), num_eigenthings=4)
    ref = scipy.sparse.linalg.eigsh(A.double().numpy(), k=4, which="LM", return_eigenvectors=False)
    np.testing.assert_allclose(vals, np.sort(ref), atol=1e-4 * np.abs(ref).max(), rtol=0)


@pytest.mark.parametrize("which", ["SM", "BE"])
def test_lanczos_arpack_only_modes_go_to_eigsh(which: str) -> None:
    A = symmetric_matrix(30, dtype=torch.float64)
    op = LambdaOperator(lambda v: A @ v, 30, dtype=torch.float64)
    vals, vecs = _lanczos_0x(op, 2, which, 200, 1e-10, 30)
    ref = scipy.sparse.linalg.eigsh(
        A.numpy(), k=2, which=which, tol=1e-10, ncv=30, return_eigenvectors=False
    )
    np.testing.assert_allclose(np.sort(vals), np.sort(ref), atol=1e-8)
    assert vecs.shape == (2, 30)


def test_lanczos_init_vec_and_fp16() -> None:
    A = symmetric_matrix(30)
    op = LambdaOperator(lambda v: A @ v, 30)
    vals, vecs = _lanczos_0x(
        op, 2, "LA", 50, 1e-3, None, np.ones(30, dtype=np.float32), False, True
    )
    assert vals.dtype == vecs.dtype == np.float64  # as 0.x: scipy upcast the half products
    np.testing.assert_allclose(vals, [5.0, 7.0], rtol=1e-2)


@pytest.mark.parametrize(
    ("kwargs", "error", "words"),
    [
        ({"which": "XX"}, ValueError, "which must be one of"),
        ({"num_lanczos_vectors": 2, "num_eigenthings": 3}, ValueError, "ncv="),
        ({"max_steps": 0}, ValueError, "max_iter"),
        ({"num_eigenthings": 0}, ValueError, "k=..."),
        ({"init_vec": torch.ones(7)}, ValueError, "init_vec"),
        ({"num_eigenthings": 31}, ValueError, "k=..."),
    ],
)
def test_lanczos_bad_arguments(kwargs: dict, error: type, words: str) -> None:
    A = symmetric_matrix(30)
    with pytest.raises(error, match=words):
        _lanczos_0x(LambdaOperator(lambda v: A @ v, 30), **kwargs)


def test_lanczos_rejects_non_operators() -> None:
    with pytest.raises(TypeError, match="CurvatureOperator"):
        _lanczos_0x(np.eye(3))


# -- utils --------------------------------------------------------------------------


@legacy
def test_utils(capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO):
        compat.log("hello")  # 0.x: logging.info with a prefix, nothing on stdout
    assert caplog.messages == ["[hessian_eigenthings] hello"]
    for i in range(4):
        compat.progress_bar(i, 4, "msg")
    out = capsys.readouterr().out
    assert "hello" not in out and "4/4 | msg" in out and out.endswith("\n")
    assert compat.maybe_fp16(torch.ones(2, dtype=torch.float64), True).dtype == torch.float16
    assert compat.maybe_fp16(torch.ones(2, dtype=torch.float64), False).dtype == torch.float32
    assert compat.format_time(3725.0) == "1h2m"
    assert compat.format_time(0.0123) == "12ms"
    assert compat.format_time(90061) == "1D1h"


@pytest.mark.parametrize("descending", [True, False])
def test_sorted_pairs_orders_stably_and_keeps_pairs(descending: bool) -> None:
    from hessian_eigenthings.compat._translate import sorted_pairs

    values = torch.tensor([2.0, -1.0, 2.0, 5.0], dtype=torch.float64)
    vectors = torch.arange(4.0).unsqueeze(1).repeat(1, 3)  # row i holds i
    got_vals, got_vecs = sorted_pairs(values, vectors, descending=descending)
    order = np.argsort(-values.numpy() if descending else values.numpy(), kind="stable")
    np.testing.assert_array_equal(got_vals.numpy(), values.numpy()[order])
    np.testing.assert_array_equal(got_vecs[:, 0].numpy(), order)  # each vector stays with its value
    in_order = torch.tensor([5.0, 2.0, 1.0]) if descending else torch.tensor([1.0, 2.0, 5.0])
    vals, vecs = sorted_pairs(in_order, vectors[:3], descending=descending)
    assert vecs is vectors[:3] or torch.equal(vecs, vectors[:3])
    np.testing.assert_array_equal(vals.numpy(), in_order.numpy())


def test_operator_products_keep_the_input_dtype_after_plain_ones() -> None:
    """After a product shaped and typed like its input, outputs pass through; an input
    of another dtype is still answered in its own dtype."""
    torch.manual_seed(4)
    m = symmetric_matrix(6)

    class Dense(compat.Operator):
        def apply(self, vec: torch.Tensor) -> torch.Tensor:
            return m.to(vec.dtype) @ vec if vec.dtype == torch.float32 else m @ vec.float()

    with pytest.warns(deprecation.DeprecatedWarning):
        op = Dense(6)
    v = torch.randn(6)
    for _ in range(2):
        torch.testing.assert_close(op.matvec(v), m @ v)
    v64 = v.double()
    out = op._matvec(v64)  # apply answers in float32: cast back to the input's dtype
    assert out.dtype == torch.float64
    torch.testing.assert_close(out, (m @ v).double())
