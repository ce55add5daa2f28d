"""``KroneckerOperator`` from given factors, without a model or data, against the dense float64
block-diagonal matrix built with ``torch.kron``: products, eigh, eigenvectors, damped inverse,
logdet, trace and Frobenius norm; the reading rules of a block (weight rows, a transposed
weight, a joined bias, a bias alone); and the KFAC family rebuilt from its own factors."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from torch import nn

from hessian_eigenthings import EKFACOperator, KFACOperator, KFOCOperator
from hessian_eigenthings.loss_fns import cross_entropy_loss_of_output, supervised_forward
from hessian_eigenthings.operators.kronecker import (
    KroneckerBlock,
    KroneckerEigenBlock,
    KroneckerOperator,
)
from hessian_eigenthings.param_utils import ParamLayout
from tests.conftest import classification_data

F64 = torch.float64

# parameter name -> shape; the blocks below cover each once (odd sizes on purpose)
SHAPES: dict[str, tuple[int, ...]] = {
    "conv.weight": (3, 2, 2, 2),  # (out, in, kh, kw): X (3, 8)
    "conv.bias": (3,),  # alone: X (3, 1)
    "fc.weight": (5, 7),  # joined with fc.bias: X (5, 8)
    "fc.bias": (5,),
    "gpt.weight": (4, 6),  # stored (in, out): X (6, 4)
    "norm.weight": (9,),  # alone
}
# names, transposed, (m, q)
BLOCKS = [
    (("conv.weight",), False, (3, 8)),
    (("conv.bias",), False, (3, 1)),
    (("fc.weight", "fc.bias"), False, (5, 8)),
    (("gpt.weight",), True, (6, 4)),
    (("norm.weight",), False, (9, 1)),
]


def _spd(n: int, rank: int | None = None, dtype: torch.dtype = F64) -> torch.Tensor:
    B = torch.randn(n, rank or n + 2, dtype=dtype)
    return B @ B.T / B.shape[1]


def _layout() -> ParamLayout:
    return ParamLayout.from_named([(n, torch.empty(s, dtype=F64)) for n, s in SHAPES.items()])


def _factor_blocks(dtype: torch.dtype = F64) -> list[KroneckerBlock]:
    G_conv = _spd(3, dtype=dtype)  # shared by the conv weight and bias, as KFAC's
    out = []
    for names, transposed, (m, q) in BLOCKS:
        G = G_conv if names[0].startswith("conv") else _spd(m, dtype=dtype)
        A = torch.ones(1, 1, dtype=dtype) if q == 1 else _spd(q, dtype=dtype)
        out.append(KroneckerBlock(names, names[0].split(".")[0], G, A, transposed))
    return out


def _positions(layout: ParamLayout, names: tuple[str, ...], transposed: bool) -> torch.Tensor:
    """Flat indices ``(m, q)`` of the block's matrix ``X``, written out independently of the
    operator: row-major weights, a transposed weight's columns, a bias as the last column."""
    where = {n: (layout.offsets[i], layout.shapes[i]) for i, n in enumerate(layout.names)}
    start, shape = where[names[0]]
    idx = torch.arange(start, start + shape.numel())
    if len(shape) <= 1:
        return idx.reshape(-1, 1)
    X = idx.reshape(shape[0], shape[1]).T if transposed else idx.reshape(shape[0], -1)
    if len(names) == 2:
        b_start, b_shape = where[names[1]]
        X = torch.cat([X, torch.arange(b_start, b_start + b_shape.numel()).reshape(-1, 1)], 1)
    return X


def _dense(layout: ParamLayout, blocks: list[KroneckerBlock], damping: float = 0.0) -> torch.Tensor:
    K = torch.zeros(layout.size, layout.size, dtype=F64)
    for b in blocks:
        P = _positions(layout, b.names, b.transposed).reshape(-1)
        K[P.unsqueeze(1), P.unsqueeze(0)] = torch.kron(b.G.to(F64), b.A.to(F64))
    return K + damping * torch.eye(layout.size, dtype=F64)


@pytest.mark.parametrize("damping", [0.0, 0.3])
def test_products_match_the_dense_block_diagonal_kron(damping: float) -> None:
    torch.manual_seed(0)
    layout, blocks = _layout(), _factor_blocks()
    op = KroneckerOperator(layout, blocks, damping=damping)
    K = _dense(layout, blocks, damping)
    V = torch.randn(layout.size, 4, dtype=F64)
    torch.testing.assert_close(op @ V[:, 0], K @ V[:, 0])
    torch.testing.assert_close(op.matmat(V), K @ V)
    torch.testing.assert_close(op.to_dense(), K)


@pytest.mark.parametrize("damping", [0.0, 0.3])
def test_matrix_functions_match_dense_linear_algebra(damping: float) -> None:
    torch.manual_seed(1)
    layout, blocks = _layout(), _factor_blocks()
    op = KroneckerOperator(layout, blocks, damping=damping)
    K = _dense(layout, blocks, damping)
    torch.testing.assert_close(op.eigh().eigenvalues, torch.linalg.eigvalsh(K))
    torch.testing.assert_close(op.trace(), K.trace())
    torch.testing.assert_close(op.frobenius_norm(), torch.linalg.matrix_norm(K))
    for extra in (0.05, 1.0):
        eye = torch.eye(layout.size, dtype=F64)
        torch.testing.assert_close(op.logdet(extra), torch.linalg.slogdet(K + extra * eye)[1])
        torch.testing.assert_close(
            op.inverse(extra).to_dense(), torch.linalg.inv(K + extra * eye), rtol=1e-9, atol=1e-9
        )


def test_eigenvectors_in_the_flat_layout() -> None:
    torch.manual_seed(2)
    layout, blocks = _layout(), _factor_blocks()
    op = KroneckerOperator(layout, blocks, damping=0.1)
    K = _dense(layout, blocks, 0.1)
    eig = op.eigh()
    for index in (0, 7, -1, -2):
        b, i, j = eig.locate(index)
        v = op.eigenvector(b, i, j)
        value = eig.blocks[b].eigenvalues[i, j]
        assert v.shape == (layout.size,)
        assert value == eig.eigenvalues[index]
        torch.testing.assert_close(v.norm(), torch.tensor(1.0, dtype=F64))
        torch.testing.assert_close(K @ v, value * v)
        outside = torch.ones(layout.size, dtype=torch.bool)
        outside[_positions(layout, blocks[b].names, blocks[b].transposed).reshape(-1)] = False
        assert torch.all(v[outside] == 0)
    with pytest.raises(IndexError):
        op.eigenvector(len(blocks), 0, 0)
    with pytest.raises(IndexError):
        eig.locate(layout.size)


def test_named_shapes_give_the_factors_dtype_and_a_wider_factor_dtype_is_kept() -> None:
    torch.manual_seed(3)
    blocks = _factor_blocks()
    op = KroneckerOperator(SHAPES, blocks)
    assert op.dtype == F64 and op.size == _layout().size
    # parameters in float32, factors in float64: products computed in float64, returned float32
    low = ParamLayout.from_named([(n, torch.empty(s)) for n, s in SHAPES.items()])
    op32 = KroneckerOperator(low, blocks)
    assert op32.dtype == torch.float32 and op32.factor_dtype == F64
    v = torch.randn(op32.size)
    torch.testing.assert_close(op32 @ v, (_dense(low, blocks) @ v.double()).float())


def test_a_block_in_its_eigenbasis() -> None:
    torch.manual_seed(4)
    layout, blocks = _layout(), _factor_blocks()
    eigen = KroneckerOperator(layout, blocks).eigh().blocks
    corrected = [
        KroneckerEigenBlock(
            e.names,
            torch.rand_like(e.eigenvalues),
            e.G_eigenvectors,
            e.A_eigenvectors,
            e.transposed,
        )
        for e in eigen
    ]
    mixed: list[KroneckerBlock | KroneckerEigenBlock] = [corrected[0], *blocks[1:]]
    op = KroneckerOperator(layout, mixed)
    D, U_G, U_A = corrected[0].eigenvalues, corrected[0].G_eigenvectors, corrected[0].A_eigenvectors
    U = torch.kron(U_G, U_A)
    K = _dense(layout, blocks)
    P = _positions(layout, blocks[0].names, False).reshape(-1)
    K[P.unsqueeze(1), P.unsqueeze(0)] = U @ torch.diag(D.reshape(-1)) @ U.T
    torch.testing.assert_close(op.to_dense(), K)
    torch.testing.assert_close(op.trace(), K.trace())
    torch.testing.assert_close(op.frobenius_norm(), torch.linalg.matrix_norm(K))
    torch.testing.assert_close(
        op.logdet(0.2), torch.linalg.slogdet(K + 0.2 * torch.eye(op.size, dtype=F64))[1]
    )
    with pytest.raises(ValueError, match="eigenbasis"):
        op.factors  # noqa: B018


@pytest.mark.parametrize(
    ("blocks", "error", "match"),
    [
        ([], ValueError, "at least one block"),
        ([(("fc.weight",), None, None)], TypeError, "KroneckerBlock"),
        ("unknown", ValueError, "unknown"),
        ("twice", ValueError, "in several"),
        ("missing", ValueError, "in none"),
        ("G shape", ValueError, r"G of the block over \('fc.weight', 'fc.bias'\) must be \(5, 5\)"),
        ("bias shape", ValueError, "bias of shape"),
        ("dtypes", TypeError, "one floating dtype"),
    ],
)
def test_invalid_blocks_say_what_to_fix(blocks: object, error: type, match: str) -> None:
    good = _factor_blocks()
    fc = good[2]
    cases = {
        "unknown": [KroneckerBlock(("fc.wieght",), "fc", fc.G, fc.A), *good],
        "twice": [*good, good[1]],
        "missing": good[:-1],
        "G shape": [*good[:2], KroneckerBlock(fc.names, "fc", fc.A, fc.A), *good[3:]],
        "bias shape": [
            *good[:2],
            KroneckerBlock(("fc.weight", "conv.bias"), "fc", fc.G, fc.A),
            *good[3:],
        ],
        "dtypes": [
            KroneckerBlock(fc.names, "fc", fc.G.float(), fc.A.float()),
            *good[:2],
            *good[3:],
        ],
    }
    given = cases.get(blocks, blocks) if isinstance(blocks, str) else blocks
    with pytest.raises(error, match=match):
        KroneckerOperator(_layout(), given)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="damping"):
        KroneckerOperator(_layout(), good, damping=-1.0)


def _model_and_data() -> tuple[nn.Module, list[tuple[torch.Tensor, torch.Tensor]]]:
    torch.manual_seed(5)
    model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)).double()
    return model, classification_data(n=12, d_in=4, classes=3, batch=7)


@pytest.mark.parametrize("cls", [KFACOperator, KFOCOperator])
@pytest.mark.parametrize("separate", [True, False])
def test_kfac_family_is_a_kronecker_operator_of_its_own_factors(cls: type, separate: bool) -> None:
    model, data = _model_and_data()
    op = cls(
        model, data, supervised_forward, cross_entropy_loss_of_output(), separate_bias=separate
    )
    assert isinstance(op, KroneckerOperator)
    rebuilt = KroneckerOperator(op.layout, op.factors)
    torch.testing.assert_close(rebuilt.to_dense(), op.to_dense(), rtol=0, atol=0)
    torch.testing.assert_close(rebuilt.logdet(0.1), op.logdet(0.1), rtol=0, atol=0)


def test_ekfac_is_a_kronecker_operator_of_its_eigenbases() -> None:
    model, data = _model_and_data()
    op = EKFACOperator(model, data, supervised_forward, cross_entropy_loss_of_output())
    rebuilt = KroneckerOperator(op.layout, op.eigh().blocks)
    torch.testing.assert_close(rebuilt.to_dense(), op.to_dense(), rtol=0, atol=0)
    b, i, j = op.eigh().locate(-1)
    v = op.eigenvector(b, i, j)
    torch.testing.assert_close(op @ v, op.eigh().eigenvalues[-1] * v)


def test_float32_factors_are_decomposed_in_float64() -> None:
    """NOTE [factors decomposed in float64]: a float32 operator's damped inverse equals the
    float64 operator of the same factors to float32 rounding (with float32 ``eigh`` it is 1e-3
    off on these factors: eigenvalues 1e3 to 1e-1, above the rounding-level cut)."""
    gen = torch.Generator().manual_seed(0)

    def spd(n: int) -> torch.Tensor:
        Q, _ = torch.linalg.qr(torch.randn(n, n, dtype=F64, generator=gen))
        return ((Q * torch.logspace(3, -1, n, dtype=F64)) @ Q.T).float()

    m, q = 96, 128
    G, A = spd(m), spd(q)

    def op(dtype: torch.dtype) -> KroneckerOperator:
        layout = ParamLayout.from_named([("w", torch.empty(m, q, dtype=dtype))])
        return KroneckerOperator(layout, [KroneckerBlock(("w",), "lin", G.to(dtype), A.to(dtype))])

    v = torch.randn(m * q, dtype=F64, generator=gen)
    single, double = op(torch.float32), op(F64)
    for damping in (1e-3, 1e-1):
        got = (single.inverse(damping) @ v.float()).double()
        want = double.inverse(damping) @ v
        assert float((got - want).norm() / want.norm()) < 1e-5
    values = single.eigh()
    assert values.blocks[0].G_eigenvectors.dtype == torch.float32  # stored in the factors' dtype
    torch.testing.assert_close(
        values.eigenvalues.double(), double.eigh().eigenvalues, rtol=1e-6, atol=0
    )


def test_ekfac_released_factors_change_no_number_and_are_freed() -> None:
    model, data = _model_and_data()
    op = EKFACOperator(model, data, supervised_forward, cross_entropy_loss_of_output())
    V = torch.randn(op.size, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(0))

    def numbers() -> tuple[torch.Tensor, ...]:
        return (
            op @ V,
            op.inverse(0.1) @ V,
            op.to_dense(),
            op.trace(),
            op.logdet(0.1),
            op.eigh().eigenvalues,
            KroneckerOperator(op.layout, op.eigh().blocks) @ V,
        )

    before = numbers()
    # every G and A but a bias's constant [[1]], which the operator keeps for any bias alone
    held = [weakref.ref(t) for b in op.factors for t in (b.G, b.A) if t.numel() > 1]
    assert len(held) == 6
    op.release_factors()
    op.release_factors()  # idempotent
    gc.collect()
    assert all(r() is None for r in held), "KFAC's G and A are still referenced"
    after = numbers()
    for x, y in zip(before, after, strict=True):
        assert torch.equal(x, y)
    for read in (lambda: op.factors, lambda: op.owned_factors):
        with pytest.raises(ValueError, match=r"released by release_factors\(\)"):
            read()


def test_ekfac_block_of_a_layer_outside_the_forward_is_zero() -> None:
    class Unused(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.used, self.unused = nn.Linear(4, 3), nn.Linear(4, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            out: torch.Tensor = self.used(x)
            return out

    torch.manual_seed(6)
    model = Unused().double()
    data = classification_data(n=9, d_in=4, classes=3, batch=5)
    loss = cross_entropy_loss_of_output()
    K = EKFACOperator(model, data, supervised_forward, loss).to_dense()
    assert torch.all(K[15:] == 0) and torch.all(K[:, 15:] == 0)
    used = EKFACOperator(model, data, supervised_forward, loss, param_filter="used.*")
    torch.testing.assert_close(K[:15, :15], used.to_dense())
