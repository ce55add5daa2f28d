"""KFAC and EKFAC against dense float64 references: the GGN where KFAC is exact, the block
structure ``G ⊗ A`` in the flat layout, and inverse / eigh / logdet / trace / Frobenius norm
against dense linear algebra of the materialized operator."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hessian_eigenthings import EKFACOperator, GGNOperator, KFACOperator
from hessian_eigenthings.loss_fns import (
    cross_entropy_loss_of_output,
    mse_loss_of_output,
    supervised_forward,
    supervised_loss_of_output,
)
from hessian_eigenthings.param_utils import match_regex, select_parameters
from tests.conftest import classification_data
from tests.operators.curvature_oracles import dense_ggn

CE = cross_entropy_loss_of_output()
MSE = mse_loss_of_output()


def _mlp() -> nn.Module:
    return nn.Sequential(
        nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 3)
    ).double()


def _cnn(inplace: bool = False) -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(2, 3, 3, padding=1),
        nn.ReLU(inplace=inplace),
        nn.Conv2d(3, 2, 2, stride=2),
        nn.Flatten(),
        nn.Linear(2 * 3 * 3, 3),
    ).double()


def _image_data(n: int = 5, split: int = 3) -> list[tuple[torch.Tensor, torch.Tensor]]:
    X = torch.randn(n, 2, 6, 6, dtype=torch.float64)
    y = torch.randint(0, 3, (n,))
    return [(X[:split], y[:split]), (X[split:], y[split:])]


def _regression_data(n: int = 7, split: int = 4, d_in: int = 4, d_out: int = 3):
    X = torch.randn(n, d_in, dtype=torch.float64)
    Y = torch.randn(n, d_out, dtype=torch.float64)
    return [(X[:split], Y[:split]), (X[split:], Y[split:])]


def _ggn(model: nn.Module, data: list, loss: object, param_filter: object = None) -> torch.Tensor:
    return dense_ggn(model, data, supervised_forward, loss, select_parameters(model, param_filter))  # type: ignore[arg-type]


def _block_mask(op: KFACOperator | EKFACOperator) -> torch.Tensor:
    """True on the diagonal blocks (the parameters of each block, wherever they sit)."""
    offsets = dict(
        zip(
            op.layout.names,
            zip(op.layout.offsets[:-1], op.layout.offsets[1:], strict=True),
            strict=True,
        )
    )
    mask = torch.zeros(op.size, op.size, dtype=torch.bool)
    for block in op.factors:
        idx = torch.cat([torch.arange(*offsets[n]) for n in block.names])
        mask[idx.unsqueeze(1), idx.unsqueeze(0)] = True
    return mask


# -- exactness -------------------------------------------------------------------------------
def test_single_linear_layer_mse_is_the_exact_ggn_over_uneven_batches() -> None:
    model = nn.Linear(4, 3).double()
    data = _regression_data()
    G = _ggn(model, data, MSE)
    joint = KFACOperator(model, data, supervised_forward, MSE, separate_bias=False).to_dense()
    torch.testing.assert_close(joint, G, rtol=1e-12, atol=1e-14)
    # separate blocks: the same matrix without its weight-bias cross terms
    separate = KFACOperator(model, data, supervised_forward, MSE).to_dense()
    mask = torch.zeros_like(G, dtype=torch.bool)
    mask[:12, :12] = mask[12:, 12:] = True
    torch.testing.assert_close(separate, torch.where(mask, G, 0.0), rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("loss", [CE, MSE], ids=["ce", "mse"])
def test_one_data_point_gives_the_block_diagonal_of_the_ggn(loss: object) -> None:
    model = _mlp()
    X = torch.randn(1, 4, dtype=torch.float64)
    y = torch.randint(0, 3, (1,)) if loss is CE else torch.randn(1, 3, dtype=torch.float64)
    data = [(X, y)]
    G = _ggn(model, data, loss)
    for separate in (True, False):
        op = KFACOperator(model, data, supervised_forward, loss, separate_bias=separate)  # type: ignore[arg-type]
        mask = _block_mask(op)
        torch.testing.assert_close(op.to_dense(), torch.where(mask, G, 0.0), rtol=1e-10, atol=1e-14)
        ek = EKFACOperator(model, data, supervised_forward, loss, separate_bias=separate)  # type: ignore[arg-type]
        torch.testing.assert_close(ek.to_dense(), torch.where(mask, G, 0.0), rtol=1e-10, atol=1e-14)


def test_deep_linear_network_with_weight_sharing_expand_is_exact() -> None:
    # MSE on a deep linear network over sequences: the output gradient of a layer, g = W_upᵀ e_c,
    # depends on neither the sample nor the position, so Σ_{c,n,t} (g ⊗ a_nt)(g ⊗ a_nt)ᵀ is
    # (Σ_{c,t} g gᵀ) ⊗ mean_{n,t} a aᵀ exactly: expand's factors (any data, uneven batches)
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2)).double()
    x = torch.randn(5, 6, 3, dtype=torch.float64)
    y = torch.randn(5, 6, 2, dtype=torch.float64)
    data = [(x[:3], y[:3]), (x[3:], y[3:])]
    op = KFACOperator(model, data, supervised_forward, MSE, separate_bias=False)
    G = _ggn(model, data, MSE)
    torch.testing.assert_close(
        op.to_dense(), torch.where(_block_mask(op), G, 0.0), rtol=1e-10, atol=1e-14
    )


def test_empirical_on_one_data_point_is_the_gradient_outer_product_blocks() -> None:
    model = _mlp()
    data = [(torch.randn(1, 4, dtype=torch.float64), torch.tensor([2]))]
    op = KFACOperator(model, data, supervised_forward, CE, fisher_type="empirical")
    params = list(model.parameters())
    grads = torch.autograd.grad(CE(model(data[0][0]), data[0]), params)
    g = torch.cat([t.reshape(-1) for t in grads])
    torch.testing.assert_close(
        op.to_dense(), torch.where(_block_mask(op), torch.outer(g, g), 0.0), rtol=1e-10, atol=1e-14
    )


def test_ekfac_eigenvalues_are_the_ggn_diagonal_in_kfacs_eigenbasis() -> None:
    model = _cnn()
    data = _image_data()
    G = _ggn(model, data, CE)
    for approx in ("expand", "reduce"):
        op = EKFACOperator(model, data, supervised_forward, CE, kfac_approx=approx)  # type: ignore[arg-type]
        offsets = dict(zip(op.layout.names, op.layout.offsets[:-1], strict=True))
        for block in op.eigh().blocks:
            (name,) = block.names
            m, q = block.eigenvalues.shape
            U = torch.kron(block.G_eigenvectors, block.A_eigenvectors)
            s = offsets[name]
            diag = torch.diagonal(U.T @ G[s : s + m * q, s : s + m * q] @ U).reshape(m, q)
            torch.testing.assert_close(block.eigenvalues, diag, rtol=1e-9, atol=1e-14)


# -- structure --------------------------------------------------------------------------------
@pytest.mark.parametrize("separate", [True, False])
@pytest.mark.parametrize("approx", ["expand", "reduce"])
def test_blocks_are_kronecker_products_in_the_flat_layout(separate: bool, approx: str) -> None:
    model = _cnn()
    data = _image_data()
    op = KFACOperator(
        model, data, supervised_forward, CE, kfac_approx=approx, separate_bias=separate
    )  # type: ignore[arg-type]
    K = op.to_dense()
    torch.testing.assert_close(K, K.T, rtol=0, atol=1e-15)
    assert torch.all(K[~_block_mask(op)] == 0)
    offsets = dict(
        zip(
            op.layout.names,
            zip(op.layout.offsets[:-1], op.layout.offsets[1:], strict=True),
            strict=True,
        )
    )
    shapes = dict(zip(op.layout.names, op.layout.shapes, strict=True))
    assert len(op.factors) == (6 if separate else 3)
    for block in op.factors:
        # the block's flat entries as the (m, q) matrix: weight rows, then the bias column
        m = block.G.shape[0]
        grid = []
        for name in block.names:
            idx = torch.arange(*offsets[name]).reshape(m, -1)
            grid.append(idx)
        index = torch.cat(grid, dim=1).reshape(-1)
        dense_block = K[index.unsqueeze(1), index.unsqueeze(0)]
        torch.testing.assert_close(
            dense_block, torch.kron(block.G, block.A), rtol=1e-12, atol=1e-15
        )
        if "weight" in block.names[0]:
            assert block.A.shape[0] == shapes[block.names[0]][1:].numel() + (len(block.names) - 1)


def test_product_layout_matches_the_ggn_operator_and_blocks() -> None:
    model = _mlp()
    data = classification_data(n=9, d_in=4, batch=4)
    op = KFACOperator(model, data, supervised_forward, CE)
    ggn = GGNOperator(model, data, supervised_forward, CE)
    assert op.size == ggn.size and op.layout.names == ggn.layout.names
    V = torch.randn(op.size, 3, dtype=torch.float64)
    torch.testing.assert_close(op @ V, op.to_dense() @ V, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(op @ V[:, 0], (op @ V)[:, 0], rtol=1e-12, atol=1e-14)


def test_param_filter_selects_sub_blocks() -> None:
    model = _mlp()
    data = classification_data(n=9, d_in=4, batch=4)
    full = KFACOperator(model, data, supervised_forward, CE)
    K = full.to_dense()
    flt = ["2.weight", "0.bias", "4.bias"]
    sub = KFACOperator(model, data, supervised_forward, CE, param_filter=flt)
    offsets = dict(
        zip(
            full.layout.names,
            zip(full.layout.offsets[:-1], full.layout.offsets[1:], strict=True),
            strict=True,
        )
    )
    idx = torch.cat([torch.arange(*offsets[n]) for n in sub.layout.names])
    assert sub.layout.names == ("0.bias", "2.weight", "4.bias")
    torch.testing.assert_close(
        sub.to_dense(), K[idx.unsqueeze(1), idx.unsqueeze(0)], rtol=1e-12, atol=1e-15
    )


def test_num_batches_caps_the_data() -> None:
    model = _mlp()
    data = classification_data(n=9, d_in=4, batch=4)
    capped = KFACOperator(model, data, supervised_forward, CE, num_batches=2).to_dense()
    torch.testing.assert_close(
        capped, KFACOperator(model, data[:2], supervised_forward, CE).to_dense(), rtol=0, atol=0
    )
    assert not torch.allclose(capped, KFACOperator(model, data, supervised_forward, CE).to_dense())


def test_column_chunks_give_the_same_factors() -> None:
    model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 6)).double()
    data = classification_data(n=9, d_in=4, classes=6, batch=4)
    whole = KFACOperator(model, data, supervised_forward, CE).to_dense()
    for chunk in (1, 4):
        torch.testing.assert_close(
            KFACOperator(model, data, supervised_forward, CE, column_chunk=chunk).to_dense(),
            whole,
            rtol=1e-13,
            atol=1e-16,
        )


def test_inplace_activation_after_a_layer_changes_nothing() -> None:
    data = _image_data()
    a, b = _cnn(), _cnn(inplace=True)
    b.load_state_dict(a.state_dict())
    ka = KFACOperator(a, data, supervised_forward, CE).to_dense()
    kb = KFACOperator(b, data, supervised_forward, CE).to_dense()
    torch.testing.assert_close(kb, ka, rtol=1e-13, atol=1e-16)
    ea = EKFACOperator(a, data, supervised_forward, CE).to_dense()
    eb = EKFACOperator(b, data, supervised_forward, CE).to_dense()
    torch.testing.assert_close(eb, ea, rtol=1e-12, atol=1e-15)


# -- inverse, eigh, logdet, trace, Frobenius norm -----------------------------------------------
@pytest.mark.parametrize("cls", [KFACOperator, EKFACOperator])
def test_spectral_methods_match_dense_linear_algebra(cls: type) -> None:
    model = _cnn()
    data = _image_data(n=8, split=5)
    op = cls(model, data, supervised_forward, CE, separate_bias=False)
    K = op.to_dense()
    evals = torch.linalg.eigvalsh(K)
    torch.testing.assert_close(op.eigh().eigenvalues, evals, rtol=1e-9, atol=1e-13)
    torch.testing.assert_close(op.trace(), K.trace(), rtol=1e-12, atol=0)
    torch.testing.assert_close(op.frobenius_norm(), torch.linalg.matrix_norm(K), rtol=1e-12, atol=0)
    damping = 1e-2
    Kd = K + damping * torch.eye(op.size, dtype=K.dtype)
    inv = op.inverse(damping)
    V = torch.randn(op.size, 2, dtype=torch.float64)
    torch.testing.assert_close(inv @ V, torch.linalg.solve(Kd, V), rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(Kd @ (inv @ V[:, 0]), V[:, 0], rtol=1e-9, atol=1e-10)
    torch.testing.assert_close(
        op.logdet(damping), torch.linalg.slogdet(Kd).logabsdet, rtol=1e-10, atol=0
    )


@pytest.mark.parametrize("cls", [KFACOperator, EKFACOperator])
def test_logdet_of_a_nonsingular_operator(cls: type) -> None:
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()
    data = _regression_data(n=12, split=7, d_in=3, d_out=2)
    op = cls(model, data, supervised_forward, MSE)
    sign, logabs = torch.linalg.slogdet(op.to_dense())
    assert sign > 0
    torch.testing.assert_close(op.logdet(), logabs, rtol=1e-10, atol=0)


def test_eigh_vectors_reconstruct_the_blocks() -> None:
    model = _mlp()
    data = classification_data(n=9, d_in=4, batch=4)
    op = KFACOperator(model, data, supervised_forward, CE)
    for block, eig in zip(op.factors, op.eigh().blocks, strict=True):
        U = torch.kron(eig.G_eigenvectors, eig.A_eigenvectors)
        torch.testing.assert_close(
            U @ torch.diag(eig.eigenvalues.reshape(-1)) @ U.T,
            torch.kron(block.G, block.A),
            rtol=1e-10,
            atol=1e-14,
        )


# -- mc, model state, RNG ---------------------------------------------------------------------
def test_mc_is_seeded_and_leaves_the_global_rng() -> None:
    model = _mlp()
    data = classification_data(n=9, d_in=4, batch=4)
    state = torch.get_rng_state()
    a = KFACOperator(model, data, supervised_forward, CE, fisher_type="mc", seed=3).to_dense()
    assert torch.equal(torch.get_rng_state(), state)
    b = KFACOperator(model, data, supervised_forward, CE, fisher_type="mc", seed=3).to_dense()
    c = KFACOperator(model, data, supervised_forward, CE, fisher_type="mc", seed=4).to_dense()
    assert torch.equal(a, b) and not torch.equal(a, c)


@pytest.mark.parametrize(
    "criterion",
    [nn.CrossEntropyLoss(), nn.MSELoss(), nn.BCEWithLogitsLoss()],
    ids=["ce", "mse", "bce"],
)
def test_mc_approaches_type2(criterion: nn.Module) -> None:
    model = _mlp()
    if isinstance(criterion, nn.CrossEntropyLoss):
        data = classification_data(n=9, d_in=4, batch=4)
    else:
        data = _regression_data(n=9)
        if isinstance(criterion, nn.BCEWithLogitsLoss):
            data = [(x, (y > 0).double()) for x, y in data]
    loss = supervised_loss_of_output(criterion)
    exact = KFACOperator(model, data, supervised_forward, loss).to_dense()
    many = KFACOperator(
        model, data, supervised_forward, loss, fisher_type="mc", mc_samples=4000, column_chunk=1000
    )
    assert (many.to_dense() - exact).norm() / exact.norm() < 0.05


def test_model_is_left_as_found() -> None:
    model = _cnn(inplace=True)
    model[2].weight.requires_grad_(False)
    model.train()
    before = {n: (p.clone(), p._version) for n, p in model.named_parameters()}
    data = _image_data()
    EKFACOperator(model, data, supervised_forward, CE, param_filter=lambda n, p: True)
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n][0]) and p._version == before[n][1] and p.grad is None
    assert not model[2].weight.requires_grad and model.training
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())


# -- errors -----------------------------------------------------------------------------------
def test_unsupported_layers_are_named_or_excluded_on_request() -> None:
    model = nn.Sequential(nn.Linear(4, 5), nn.LayerNorm(5), nn.Linear(5, 3)).double()
    data = classification_data(n=6, d_in=4, batch=3)
    with pytest.raises(
        ValueError, match=r"1\.weight \(LayerNorm\), 1\.bias \(LayerNorm\).*exclude_unsupported"
    ):
        KFACOperator(model, data, supervised_forward, CE)
    op = KFACOperator(model, data, supervised_forward, CE, exclude_unsupported=True)
    assert op.excluded_parameters == ("1.weight (LayerNorm)", "1.bias (LayerNorm)")
    assert op.layout.names == ("0.weight", "0.bias", "2.weight", "2.bias")
    ref = KFACOperator(model, data, supervised_forward, CE, param_filter=["0.*", "2.*"])
    torch.testing.assert_close(op.to_dense(), ref.to_dense(), rtol=0, atol=0)


def test_bad_arguments_raise_clear_errors() -> None:
    model = _mlp()
    data = classification_data(n=6, d_in=4, batch=3)
    with pytest.raises(ValueError, match="fisher_type"):
        KFACOperator(model, data, supervised_forward, CE, fisher_type="exact")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="kfac_approx"):
        KFACOperator(model, data, supervised_forward, CE, kfac_approx="sum")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="mc_samples"):
        KFACOperator(model, data, supervised_forward, CE, mc_samples=3)
    with pytest.raises(ValueError, match="mc_samples"):
        KFACOperator(model, data, supervised_forward, CE, fisher_type="mc", mc_samples=0)
    with pytest.raises(ValueError, match="supported"):
        KFACOperator(model, data, supervised_forward, supervised_loss_of_output(nn.L1Loss()))
    with pytest.raises(ValueError, match="damping"):
        KFACOperator(model, data, supervised_forward, CE).inverse(-1.0)
    grouped = nn.Sequential(nn.Conv2d(2, 2, 3, groups=2), nn.Flatten(), nn.Linear(32, 3)).double()
    with pytest.raises(ValueError, match="groups"):
        KFACOperator(grouped, _image_data(), supervised_forward, CE)

    class Twice(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.lin(torch.tanh(self.lin(x)))

    with pytest.raises(ValueError, match="'lin' ran twice"):
        KFACOperator(Twice().double(), _regression_data(d_out=4), supervised_forward, MSE)
    with pytest.raises(ValueError, match=r"tied .*0\.weight = 2\.weight"):
        KFACOperator(
            nn.Sequential(twice := nn.Linear(4, 4), nn.Tanh(), twice).double(),
            _regression_data(d_out=4),
            supervised_forward,
            MSE,
        )
    tied = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4)).double()
    tied[2].weight = tied[0].weight
    with pytest.raises(ValueError, match=r"tied .*0\.weight = 2\.weight"):
        KFACOperator(tied, _regression_data(d_out=4), supervised_forward, MSE)


def test_batchnorm_in_training_mode_is_said() -> None:
    model = nn.Sequential(nn.Linear(4, 5), nn.BatchNorm1d(5), nn.Linear(5, 3)).double()
    data = classification_data(n=8, d_in=4, batch=4)
    with pytest.warns(UserWarning, match=r"BatchNorm in training mode \(1\)") as rec:
        KFACOperator(model, data, supervised_forward, CE, param_filter=["0.*", "2.*"])
    assert rec[0].filename == __file__
    model.eval()
    KFACOperator(model, data, supervised_forward, CE, param_filter=["0.*", "2.*"])  # no warning


def test_a_layer_outside_the_forward_has_a_zero_block() -> None:
    class Unused(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.used, self.unused = nn.Linear(4, 3), nn.Linear(4, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.used(x)

    model = Unused().double()
    data = _regression_data()
    K = KFACOperator(model, data, supervised_forward, MSE).to_dense()
    assert torch.all(K[15:] == 0) and torch.all(K[:, 15:] == 0)
    torch.testing.assert_close(
        K[:15, :15],
        KFACOperator(model, data, supervised_forward, MSE, param_filter="used.*").to_dense(),
    )


# -- HuggingFace Conv1D (GPT-2's linear layers: x @ W + b, W stored (in, out)) ----------------
def _conv1d_net() -> tuple[nn.Module, nn.Module]:
    """A Conv1D network and the same network with nn.Linear (weights transposed)."""
    transformers = pytest.importorskip("transformers")
    Conv1D = transformers.pytorch_utils.Conv1D
    lin = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)).double()
    conv = nn.Sequential(Conv1D(5, 4), nn.Tanh(), Conv1D(3, 5)).double()
    with torch.no_grad():
        for c, ln in ((conv[0], lin[0]), (conv[2], lin[2])):
            c.weight.copy_(torch.randn_like(c.weight))
            c.bias.copy_(torch.randn_like(c.bias))
            ln.weight.copy_(c.weight.T)
            ln.bias.copy_(c.bias)
    return conv, lin


@pytest.mark.parametrize("separate", [True, False])
@pytest.mark.parametrize("approx", ["expand", "reduce"])
def test_hf_conv1d_is_a_linear_layer_with_the_weight_transposed(
    separate: bool, approx: str
) -> None:
    conv, lin = _conv1d_net()
    x = torch.randn(5, 6, 4, dtype=torch.float64)
    y = torch.randint(0, 3, (5, 6))
    data = [(x[:3], y[:3]), (x[3:], y[3:])]
    CE3 = supervised_loss_of_output(nn.CrossEntropyLoss())

    def forward(model: nn.Module, batch: tuple) -> torch.Tensor:  # (N, classes, T) for CE
        return model(batch[0]).transpose(1, 2)

    kw = dict(kfac_approx=approx, separate_bias=separate)
    K_conv = KFACOperator(conv, data, forward, CE3, **kw).to_dense()  # type: ignore[arg-type]
    K_lin = KFACOperator(lin, data, forward, CE3, **kw).to_dense()  # type: ignore[arg-type]
    # the flat index of the Conv1D layout in the Linear layout (weights transposed)
    perm, offset = [], 0
    for p in lin.parameters():
        idx = torch.arange(p.numel()) + offset
        perm.append(idx.view(p.shape).T.reshape(-1) if p.dim() == 2 else idx)
        offset += p.numel()
    P = torch.cat(perm)
    torch.testing.assert_close(K_conv, K_lin[P][:, P], rtol=1e-12, atol=1e-14)
    ek_conv = EKFACOperator(conv, data, forward, CE3, **kw).to_dense()  # type: ignore[arg-type]
    ek_lin = EKFACOperator(lin, data, forward, CE3, **kw).to_dense()  # type: ignore[arg-type]
    torch.testing.assert_close(ek_conv, ek_lin[P][:, P], rtol=1e-9, atol=1e-12)


class _NextTokenLogits(nn.Module):
    def __init__(self, lm: nn.Module) -> None:
        super().__init__()
        self.lm = lm

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        logits = self.lm(input_ids=ids, use_cache=False).logits
        return logits.reshape(-1, logits.shape[-1])


@pytest.mark.parametrize("separate", [True, False])
def test_tiny_gpt2_blocks_on_one_token_are_the_ggn_blocks(separate: bool) -> None:
    # one sequence of one token: every layer sees one input, so KFAC is the GGN's block diagonal
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(
        vocab_size=11, n_positions=4, n_embd=8, n_layer=2, n_head=2, attn_implementation="eager"
    )
    torch.manual_seed(3)
    model = _NextTokenLogits(transformers.GPT2LMHeadModel(config).double().eval())
    data = [(torch.tensor([[4]]), torch.tensor([7]))]
    flt = match_regex(r"lm\.transformer\.h\.\d+\.(attn|mlp)\.c_\w+\.(weight|bias)")
    op = KFACOperator(model, data, supervised_forward, CE, param_filter=flt, separate_bias=separate)
    assert len(op.layout.names) == 16
    G = _ggn(model, data, CE, flt)
    mask = _block_mask(op)
    torch.testing.assert_close(op.to_dense(), torch.where(mask, G, 0.0), rtol=1e-9, atol=1e-12)


def test_one_batch_factors_are_scaled_once_on_one_process() -> None:
    """NOTE [factor weights applied late]: with one batch on one process a factor's batch weight
    and the division by the total cancel, so the factor pass (and EKFAC's scaling pass) launches
    no division and rescales only the input factors (their mean over rows). The data-parallel split of session 13 had
    added a multiply and a divide per factor (ResNet-18 on an H200: 14.0 against 12.6 ms)."""
    from collections import Counter

    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.ops: Counter[str] = Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            self.ops[str(func.overloadpacket)] += 1
            return func(*args, **(kwargs or {}))

    model = _mlp()
    X, y = torch.randn(6, 4, dtype=torch.float64), torch.randint(0, 3, (6,))
    data = [(X, y)]
    with Count() as counted:
        op = KFACOperator(model, data, supervised_forward, CE, fisher_type="empirical")
    linear = sum(isinstance(m, nn.Linear) for m in model.modules())
    assert counted.ops["aten.div_"] == 0
    assert counted.ops["aten.mul_"] == linear  # the input factors' 1 / rows
    # EKFAC's second pass (its scalings) too
    with Count() as counted:
        EKFACOperator(model, data, supervised_forward, CE, fisher_type="empirical")
    assert counted.ops["aten.div_"] == 0
    assert counted.ops["aten.mul_"] == linear
    # the factors are the same means as those of the general path: the same samples in two
    # batches take the weighted sum and the final division
    split = KFACOperator(model, [(X[:2], y[:2]), (X[2:], y[2:])], supervised_forward, CE, fisher_type="empirical")
    for (A1, G1), (A2, G2) in zip(
        ((b.A, b.G) for b in op.factors), ((b.A, b.G) for b in split.factors), strict=True
    ):
        torch.testing.assert_close(A1, A2, rtol=1e-12, atol=1e-14)
        torch.testing.assert_close(G1, G2, rtol=1e-12, atol=1e-14)
