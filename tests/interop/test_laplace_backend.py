"""laplace-torch backends (hessian_eigenthings.interop.laplace) against laplace-torch's own.

References: laplace-torch's curvlinops backend (KFAC factors, exact diagonals, dense matrices;
its dense ``full`` multiplies a float32 identity, so it agrees to about 1e-7 only), the
torch.func implementations of laplace-torch's ``GGNInterface`` / ``EFInterface`` (float64,
exact), and dense float64 matrices built here (the summed curvature's eigendecomposition,
per-sample gradients of the last layer).
"""

from __future__ import annotations

import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

laplace = pytest.importorskip("laplace")

with warnings.catch_warnings():
    warnings.filterwarnings("ignore", message=".*torch.jit.script.*")
    from laplace import Laplace
    from laplace.curvature import (
        CurvlinopsEF,
        CurvlinopsGGN,
        CurvlinopsHessian,
        EFInterface,
        GGNInterface,
    )
    from laplace.utils import FeatureExtractor

from hessian_eigenthings.interop.laplace import (  # noqa: E402
    HessianEigenthingsEF,
    HessianEigenthingsGGN,
    HessianEigenthingsHessian,
    LanczosLowRankLaplace,
)

OURS = {"ggn": HessianEigenthingsGGN, "ef": HessianEigenthingsEF}
THEIRS = {"ggn": CurvlinopsGGN, "ef": CurvlinopsEF}
EXACT = {"ggn": GGNInterface, "ef": EFInterface}  # laplace-torch's torch.func versions


def _model(d_out: int) -> nn.Module:
    gen = torch.Generator().manual_seed(1)
    model = nn.Sequential(nn.Linear(3, 6), nn.Tanh(), nn.Linear(6, d_out)).double()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float64) * 0.7)
    return model


def _data(likelihood: str, n: int = 23) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(2)
    X = torch.randn(n, 3, generator=gen, dtype=torch.float64)
    if likelihood == "classification":
        return X, (X[:, 0] > 0).long() + (X[:, 1] > 0.5).long()
    return X, torch.stack([X[:, 0].sin(), X[:, 1] * X[:, 2]], dim=1)


def _problem(likelihood: str) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    X, y = _data(likelihood)
    return _model(3 if likelihood == "classification" else 2), X, y


def _loader(likelihood: str) -> DataLoader:
    X, y = _data(likelihood)
    return DataLoader(TensorDataset(X, y), batch_size=10)  # 10, 10, 3: uneven on purpose


def _close(a: torch.Tensor, b: torch.Tensor, rtol: float) -> None:
    scale = float(b.abs().max())
    err = float((a - b).abs().max())
    assert err <= rtol * max(scale, 1e-30), (
        f"relative error {err / max(scale, 1e-30):.2e} > {rtol:g}"
    )


def _optimize_prior(la: object) -> None:
    with warnings.catch_warnings():
        # laplace-torch reminds of its default link_approx on every classification call
        warnings.filterwarnings("ignore", message=".*By default `link_approx` is `probit`.*")
        la.optimize_prior_precision(method="marglik", n_steps=20)  # type: ignore[attr-defined]


# -- numbers: each structure against laplace-torch's own backends --------------------------------


@pytest.mark.parametrize("likelihood", ["classification", "regression"])
@pytest.mark.parametrize("kind", ["ggn", "ef"])
def test_full_matches_laplace(likelihood: str, kind: str) -> None:
    model, X, y = _problem(likelihood)
    ours = OURS[kind](model, likelihood)
    loss, H = ours.full(X, y, N=40)
    exact_loss, exact = EXACT[kind].full(ours, X, y)  # torch.func Jacobians / gradients, float64
    _close(H, exact, 1e-10)
    torch.testing.assert_close(loss, exact_loss, rtol=1e-12, atol=0)
    their_loss, theirs = THEIRS[kind](model, likelihood).full(X, y, N=40)
    _close(H, theirs, 1e-6)  # curvlinops' dense matrix goes through a float32 identity
    torch.testing.assert_close(loss, their_loss, rtol=1e-12, atol=0)
    assert H.dtype == torch.float64 and H.shape == (sum(p.numel() for p in model.parameters()),) * 2


@pytest.mark.parametrize("likelihood", ["classification", "regression"])
@pytest.mark.parametrize("kind", ["ggn", "ef"])
def test_diag_matches_laplace(likelihood: str, kind: str) -> None:
    model, X, y = _problem(likelihood)
    loss, d = OURS[kind](model, likelihood).diag(X, y, N=40)
    their_loss, theirs = THEIRS[kind](model, likelihood).diag(X, y, N=40)
    _close(d, theirs, 1e-10)
    torch.testing.assert_close(loss, their_loss, rtol=1e-12, atol=0)


@pytest.mark.parametrize("likelihood", ["classification", "regression"])
@pytest.mark.parametrize("kind", ["ggn", "ef"])
def test_kron_factors_match_curvlinops_backend(likelihood: str, kind: str) -> None:
    model, X, y = _problem(likelihood)
    # a batch of 10 of N = 37 samples: the batch's share M/N sits on the second factor
    loss, K = OURS[kind](model, likelihood).kron(X[:10], y[:10], N=37)
    their_loss, theirs = THEIRS[kind](model, likelihood).kron(X[:10], y[:10], N=37)
    assert [len(F) for F in K.kfacs] == [len(F) for F in theirs.kfacs] == [2, 1, 2, 1]
    for F, G in zip(K.kfacs, theirs.kfacs, strict=True):
        for a, b in zip(F, G, strict=True):
            assert a.shape == b.shape
            _close(a, b, 1e-10)
    torch.testing.assert_close(loss, their_loss, rtol=1e-12, atol=0)


@pytest.mark.parametrize("structure", ["full", "kron", "diag"])
def test_last_layer_matches_laplace(structure: str) -> None:
    model, X, y = _problem("classification")
    fe = FeatureExtractor(model, last_layer_name="2")
    ours = HessianEigenthingsGGN(fe, "classification", last_layer=True)
    theirs = CurvlinopsGGN(fe, "classification", last_layer=True)
    loss, H = getattr(ours, structure)(X, y, N=30)
    their_loss, T = getattr(theirs, structure)(X, y, N=30)
    if structure == "kron":
        assert len(H.kfacs) == 2
        for F, G in zip(H.kfacs, T.kfacs, strict=True):
            for a, b in zip(F, G, strict=True):
                _close(a, b, 1e-10)
    elif structure == "full":
        _close(H, T, 1e-6)  # float32 identity on their side
        _close(H, GGNInterface.full(ours, X, y)[1], 1e-10)  # last-layer Jacobians, float64
    else:
        _close(H, T, 1e-10)
    torch.testing.assert_close(loss, their_loss, rtol=1e-12, atol=0)


def test_last_layer_ef_diag_matches_per_sample_gradients() -> None:
    # laplace-torch's own EFInterface.diag reads the last layer's parameters by the wrong names
    # on a FeatureExtractor (0.3), so the reference is built here from per-sample gradients
    model, X, y = _problem("classification")
    fe = FeatureExtractor(model, last_layer_name="2")
    _, d = HessianEigenthingsEF(fe, "classification", last_layer=True).diag(X, y)
    features = model[:2](X).detach()
    W, b = model[2].weight.detach(), model[2].bias.detach()

    def loss(w: torch.Tensor, c: torch.Tensor, f: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(f @ w.T + c, t, reduction="sum")

    gw, gb = torch.func.vmap(torch.func.grad(loss, argnums=(0, 1)), in_dims=(None, None, 0, 0))(
        W, b, features.unsqueeze(1), y.unsqueeze(1)
    )
    g = torch.cat([gw.flatten(1), gb], dim=1)
    _close(d, g.square().sum(0), 1e-12)


def test_subnetwork_full_and_diag_are_the_submatrix() -> None:
    model, X, y = _problem("classification")
    idx = torch.tensor([0, 3, 5, 17, 30, 40, 44], dtype=torch.long)
    whole = HessianEigenthingsGGN(model, "classification")
    sub = HessianEigenthingsGGN(model, "classification", subnetwork_indices=idx)
    dense = whole.full(X, y)[1]
    _close(sub.full(X, y)[1], dense[idx][:, idx], 1e-12)
    _close(sub.diag(X, y)[1], dense.diagonal()[idx], 1e-12)
    la = Laplace(
        model,
        "classification",
        subset_of_weights="subnetwork",
        subnetwork_indices=idx,
        hessian_structure="full",
        backend=HessianEigenthingsGGN,
    )
    la.fit(_loader("classification"))
    assert la.H.shape == (len(idx), len(idx))
    probs = la(X[:4], pred_type="glm", link_approx="probit")
    torch.testing.assert_close(probs.sum(-1), torch.ones(4, dtype=torch.float64))


def test_hessian_backend_full_matches_curvlinops_and_refuses_diag_and_kron() -> None:
    model, X, y = _problem("regression")
    ours = HessianEigenthingsHessian(model, "regression")
    loss, H = ours.full(X, y)
    their_loss, theirs = CurvlinopsHessian(model, "regression").full(X, y)
    _close(H, theirs, 1e-6)  # float32 identity on their side

    params = dict(model.named_parameters())

    def summed(flat: torch.Tensor) -> torch.Tensor:
        parts = torch.split(flat, [p.numel() for p in params.values()])
        shaped = {n: t.view_as(p) for (n, p), t in zip(params.items(), parts, strict=True)}
        out = torch.func.functional_call(model, shaped, (X,))
        return 0.5 * (out - y).square().sum()

    flat = torch.cat([p.detach().reshape(-1) for p in params.values()])
    _close(H, torch.autograd.functional.hessian(summed, flat), 1e-10)
    torch.testing.assert_close(loss, their_loss, rtol=1e-12, atol=0)
    with pytest.raises(
        NotImplementedError, match="no exact Hessian diagonal; use HessianEigenthingsGGN"
    ):
        ours.diag(X, y)
    with pytest.raises(NotImplementedError, match="no Kronecker-factored Hessian"):
        ours.kron(X, y, N=23)


# -- laplace-torch's posteriors with our backends ------------------------------------------------


@pytest.mark.parametrize("structure", ["full", "kron", "diag"])
@pytest.mark.parametrize("kind", ["ggn", "ef"])
def test_laplace_classification_fit_predict_and_prior(structure: str, kind: str) -> None:
    loader = _loader("classification")
    X, _ = _data("classification")
    posteriors = []
    for backend in (OURS[kind], THEIRS[kind]):
        la = Laplace(
            _model(3),
            "classification",
            subset_of_weights="all",
            hessian_structure=structure,
            backend=backend,
        )
        la.fit(loader)
        posteriors.append(la)
    ours, theirs = posteriors
    # the same posterior: the log marginal likelihood at a few prior precisions
    for prior in (0.1, 1.0, 10.0):
        p = torch.tensor(prior, dtype=torch.float64)
        a, b = ours.log_marginal_likelihood(p), theirs.log_marginal_likelihood(p)
        assert abs(float(a - b)) <= 1e-6 * abs(float(b)), (prior, float(a), float(b))
    probs = ours(X[:5], pred_type="glm", link_approx="probit")
    assert probs.shape == (5, 3)
    torch.testing.assert_close(probs.sum(-1), torch.ones(5, dtype=torch.float64))
    _optimize_prior(ours)
    assert bool(torch.isfinite(ours.prior_precision).all()) and bool(
        (ours.prior_precision > 0).all()
    )


@pytest.mark.parametrize("structure", ["full", "kron", "diag"])
def test_laplace_regression_fit_predict_and_prior(structure: str) -> None:
    loader = _loader("regression")
    X, _ = _data("regression")
    posteriors = []
    for backend in (HessianEigenthingsGGN, CurvlinopsGGN):
        la = Laplace(
            _model(2),
            "regression",
            subset_of_weights="all",
            hessian_structure=structure,
            backend=backend,
            sigma_noise=0.5,
        )
        la.fit(loader)
        posteriors.append(la)
    ours, theirs = posteriors
    a, b = ours.log_marginal_likelihood(), theirs.log_marginal_likelihood()
    assert abs(float(a - b)) <= 1e-6 * abs(float(b))
    mean, var = ours(X[:4], pred_type="glm")
    assert mean.shape == (4, 2) and var.shape == (4, 2, 2)
    assert bool((torch.linalg.eigvalsh(var) > 0).all())
    _optimize_prior(ours)
    assert bool(torch.isfinite(ours.prior_precision).all())


@pytest.mark.parametrize("structure", ["full", "kron", "diag"])
def test_last_layer_laplace_default_subset(structure: str) -> None:
    # laplace-torch's default subset_of_weights is "last_layer"
    loader = _loader("classification")
    X, _ = _data("classification")
    lml = []
    for backend in (HessianEigenthingsGGN, CurvlinopsGGN):
        la = Laplace(_model(3), "classification", hessian_structure=structure, backend=backend)
        la.fit(loader)
        lml.append(float(la.log_marginal_likelihood()))
        probs = la(X[:3], pred_type="glm", link_approx="probit")
        torch.testing.assert_close(probs.sum(-1), torch.ones(3, dtype=torch.float64))
    assert abs(lml[0] - lml[1]) <= 1e-6 * abs(lml[1])


# -- low rank: Lanczos eigenpairs -----------------------------------------------------------------


@pytest.mark.parametrize("likelihood", ["classification", "regression"])
@pytest.mark.parametrize(
    "backend", [HessianEigenthingsGGN, HessianEigenthingsEF, HessianEigenthingsHessian]
)
def test_eig_lowrank_is_the_top_of_the_summed_curvature(likelihood: str, backend: type) -> None:
    model = _model(3 if likelihood == "classification" else 2)
    loader = _loader(likelihood)
    b = backend(model, likelihood, low_rank=3, lanczos_options={"tol": 1e-10})
    U, values, loss = b.eig_lowrank(loader)
    summed = sum(b.full(x, y)[1] for x, y in loader)  # the batches' curvatures add up
    dense = torch.linalg.eigvalsh(summed).flip(0)[:3]
    _close(values, dense, 1e-9)
    _close(summed @ U, U * values, 1e-7)
    torch.testing.assert_close(U.T @ U, torch.eye(3, dtype=torch.float64), atol=1e-8, rtol=0)
    total = sum(b.full(x, y)[0] for x, y in loader)
    torch.testing.assert_close(loss, total, rtol=1e-12, atol=0)


def test_lowrank_laplace_fit_predict_and_prior() -> None:
    loader = _loader("classification")
    X, _ = _data("classification")
    la = LanczosLowRankLaplace(
        _model(3), "classification", backend=HessianEigenthingsGGN, backend_kwargs={"low_rank": 4}
    )
    la.fit(loader)
    U, values = la.H
    assert U.shape == (45, 4) and values.shape == (4,) and bool((values > 0).all())
    probs = la(X[:5], pred_type="glm", link_approx="probit")
    torch.testing.assert_close(probs.sum(-1), torch.ones(5, dtype=torch.float64))
    # the posterior's log-determinant is that of U diag(λ) Uᵀ + δ I, dense
    delta = 2.0
    la.prior_precision = delta
    P = U @ torch.diag(values) @ U.T + delta * torch.eye(45, dtype=torch.float64)
    torch.testing.assert_close(
        la.log_det_posterior_precision, torch.linalg.slogdet(P).logabsdet, rtol=1e-9, atol=0
    )
    _optimize_prior(la)
    assert bool(torch.isfinite(la.prior_precision).all())


def test_laplace_lowrank_dispatch_uses_our_eig_lowrank(monkeypatch: pytest.MonkeyPatch) -> None:
    # laplace-torch's LowRankLaplace refuses to start unless the old asdfghjkl package (on GitHub
    # only) is importable; with that check satisfied, hessian_structure="lowrank" runs our backend
    import laplace.baselaplace as base

    monkeypatch.setattr(base, "find_spec", lambda name: object())
    la = Laplace(
        _model(3),
        "classification",
        subset_of_weights="all",
        hessian_structure="lowrank",
        backend=HessianEigenthingsGGN,
        backend_kwargs={"low_rank": 2},
    )
    assert type(la) is base.LowRankLaplace  # our class does not take over laplace's registry key
    la.fit(_loader("classification"))
    assert la.H[0].shape == (45, 2)


# -- stochastic GGN (Monte-Carlo Fisher) ----------------------------------------------------------


def test_stochastic_ggn_is_seeded_and_close_to_the_ggn() -> None:
    model, X, y = _problem("classification")
    exact = HessianEigenthingsGGN(model, "classification").full(X, y)[1]
    a = HessianEigenthingsGGN(model, "classification", stochastic=True, num_samples=400, seed=3)
    b = HessianEigenthingsGGN(model, "classification", stochastic=True, num_samples=400, seed=3)
    Ha, Hb = a.full(X, y)[1], b.full(X, y)[1]
    torch.testing.assert_close(Ha, Hb, rtol=0, atol=0)  # same seed, same draws
    assert not torch.equal(a.full(X, y)[1], Ha)  # the next batch gets new draws
    assert float((Ha - exact).norm() / exact.norm()) < 0.2
    _, K = a.kron(X, y, N=23)
    _, d = a.diag(X, y)
    assert [len(F) for F in K.kfacs] == [2, 1, 2, 1] and d.shape == (45,)


# -- misuse: one clear line -----------------------------------------------------------------------


def test_import_without_laplace_names_the_install(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(sys.modules):
        if name == "laplace" or name.startswith("laplace."):
            monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "laplace", None)  # import laplace -> ImportError
    monkeypatch.delitem(sys.modules, "hessian_eigenthings.interop.laplace")
    with pytest.raises(
        ImportError, match=r"needs laplace-torch; install it with `pip install laplace-torch`"
    ):
        import hessian_eigenthings.interop.laplace  # noqa: F401


def test_importing_the_package_does_not_import_laplace() -> None:
    code = "import sys, hessian_eigenthings, hessian_eigenthings.interop; print('laplace' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_kron_refuses_a_layer_kfac_does_not_cover() -> None:
    model = nn.Sequential(nn.Linear(3, 6), nn.LayerNorm(6), nn.Linear(6, 3)).double()
    X, y = _data("classification")
    with pytest.raises(ValueError, match=r"1\.weight") as info:
        HessianEigenthingsGGN(model, "classification").kron(X, y, N=23)
    assert "\n" not in str(info.value)
    # freezing it is the fix the message names; full and diag cover any layer
    model[1].requires_grad_(False)
    _, K = HessianEigenthingsGGN(model, "classification").kron(X, y, N=23)
    assert len(K.kfacs) == 4
    model[1].requires_grad_(True)
    assert HessianEigenthingsGGN(model, "classification").diag(X, y)[1].shape == (57,)


def test_kron_refuses_a_layer_called_twice() -> None:
    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(3, 3).double()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.a(torch.tanh(self.a(x)))

    X, y = _data("classification")
    with pytest.raises(ValueError, match="layer 'a' ran twice in one forward") as info:
        HessianEigenthingsGGN(Tied(), "classification").kron(X, y, N=23)
    assert "\n" not in str(info.value)


def test_bad_options_are_refused() -> None:
    model, X, y = _problem("classification")
    with pytest.raises(ValueError, match="low_rank must be an int >= 1"):
        HessianEigenthingsGGN(model, "classification", low_rank=0)
    with pytest.raises(ValueError, match="lanczos_options may not set 'k'"):
        HessianEigenthingsGGN(model, "classification", lanczos_options={"k": 3})
    with pytest.raises(ValueError, match="num_samples must be an int >= 1"):
        HessianEigenthingsGGN(model, "classification", stochastic=True, num_samples=0)
    with pytest.raises(TypeError, match="unexpected options \\['damping'\\]"):
        HessianEigenthingsGGN(model, "classification").kron(X, y, N=23, damping=1.0)
    with pytest.raises(TypeError, match="needs a backend class with eig_lowrank"):
        LanczosLowRankLaplace(model, "classification", backend=CurvlinopsGGN)
    sub = HessianEigenthingsGGN(model, "classification", subnetwork_indices=torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="subnetwork Laplace takes 'full' or 'diag'"):
        sub.kron(X, y, N=23)


# -- the how-to ------------------------------------------------------------------------------------


def test_howto_laplace_torch_block_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # docs/howto/laplace.md fences its laplace-torch block `py` (see the comment beside it), so
    # tests/test_docs.py does not run it: this test does
    page = Path(__file__).resolve().parents[2] / "docs" / "howto" / "laplace.md"
    blocks = re.findall(r"^```py\n(.*?)^```", page.read_text(), re.MULTILINE | re.DOTALL)
    assert len(blocks) == 1 and blocks[0].startswith("# requires: laplace")
    monkeypatch.chdir(tmp_path)
    namespace: dict[str, object] = {"__name__": "docs_laplace_torch"}
    with warnings.catch_warnings():
        # laplace-torch reminds of its default link_approx on every classification call
        warnings.filterwarnings("ignore", message=".*By default `link_approx` is `probit`.*")
        exec(compile(blocks[0], "laplace.md (laplace-torch block)", "exec"), namespace)
    la, lowrank = namespace["la"], namespace["lowrank"]
    assert float(la.prior_precision) > 0  # type: ignore[attr-defined]
    assert lowrank.H[0].shape[1] == 8  # type: ignore[attr-defined]
