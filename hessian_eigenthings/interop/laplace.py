"""Curvature backends for laplace-torch computed with this library's operators.

laplace-torch (``pip install laplace-torch``; ``hessian-eigenthings[laplace]``) asks a backend,
a subclass of its ``laplace.curvature.CurvatureInterface``, for the curvature of the training
loss one batch at a time. The backends here answer with our operators:

- :class:`HessianEigenthingsGGN`: the generalized Gauss-Newton (``stochastic=True``: its
  Monte-Carlo Fisher, ``num_samples`` sampled targets per sample);
- :class:`HessianEigenthingsEF`: the empirical Fisher;
- :class:`HessianEigenthingsHessian`: the Hessian (``full`` and ``lowrank`` only).

Each structure of ``Laplace(..., hessian_structure=...)`` maps to one of our tools:

- ``"full"``: the dense matrix of :class:`~hessian_eigenthings.operators.GGNOperator` /
  :class:`~hessian_eigenthings.operators.EmpiricalFisherOperator` /
  :class:`~hessian_eigenthings.operators.HessianOperator` on the batch (``n`` products in one
  block; with ``subnetwork_indices``, only those ``k`` columns);
- ``"diag"``: ``diagonal(op, method="exact")``, exact (no probes);
- ``"kron"``: the factors of :class:`~hessian_eigenthings.operators.KFACOperator`
  (``fisher_type`` ``"type2"``, ``"mc"`` or ``"empirical"``), one Kronecker pair per weight and
  a single factor per bias, as laplace-torch's ``Kron`` holds them;
- ``"lowrank"`` (``eig_lowrank``; :class:`LanczosLowRankLaplace`): the top ``low_rank`` eigenpairs of the curvature summed over the whole training
  set, from :func:`~hessian_eigenthings.algorithms.lanczos` (``which="LA"``); the pairs whose
  eigenvalue is not clearly positive are dropped (laplace-torch inverts them).

Conventions are laplace-torch's (those of its curvlinops backend, which the tests match to
rounding): the loss is the batch's *summed* negative log-likelihood (``CrossEntropyLoss``
summed for classification, ``0.5 · MSELoss`` summed for regression: a unit-variance Gaussian),
and the curvature is that of this summed loss. The prior, ``sigma_noise`` and ``temperature``
are laplace-torch's to apply. In ``kron`` the second factor of a weight (the input-side one of an
``nn.Linear``) is scaled by ``M/N`` (``M`` the batch's size, ``N`` the training set's), as
laplace-torch's curvlinops backend does: laplace-torch adds the factors of its batches.

Last-layer Laplace (laplace-torch's default ``subset_of_weights="last_layer"``): the features of
the penultimate layer are computed once per batch without gradients and the operators run on the
last layer alone. Subnetwork Laplace: ``full`` and ``diag`` restricted to ``subnetwork_indices``.

Options (``Laplace(..., backend_kwargs={...})``): ``low_rank`` (default 10) and
``lanczos_options`` (keywords of ``lanczos``, e.g. ``{"tol": 1e-8}``) for ``"lowrank"``;
``stochastic``, ``num_samples`` and ``seed`` for the Monte-Carlo Fisher; ``kfac_approx``
(``"expand"``/``"reduce"``) through ``Laplace(..., asdl_fisher_kwargs={"kfac_approx": ...})``
as for laplace-torch's own backends.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterable, Mapping, MutableMapping
from typing import Any

import torch
from torch import nn

from hessian_eigenthings.algorithms.diagonal import diagonal
from hessian_eigenthings.algorithms.lanczos import lanczos
from hessian_eigenthings.loss_fns.standard import (
    supervised_loss_of_output,
    supervised_per_sample_loss,
)
from hessian_eigenthings.operators.fisher import EmpiricalFisherOperator
from hessian_eigenthings.operators.ggn import GGNOperator
from hessian_eigenthings.operators.hessian import HessianOperator
from hessian_eigenthings.operators.kfac import KFACOperator
from hessian_eigenthings.operators.protocol import CurvatureOperator


def _import_laplace() -> tuple[Any, Any, Any, Any, Any, Any]:
    try:
        # laplace imports curvlinops, whose linear_operator dependency warns at import on
        # torch >= 2.10 (torch.jit.script): third-party noise that is not the user's to act on
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*torch.jit.script.*")
            from laplace.baselaplace import LowRankLaplace, ParametricLaplace
            from laplace.curvature import CurvatureInterface, EFInterface, GGNInterface
            from laplace.utils import Kron
    except ImportError as exc:
        if exc.name is not None and exc.name.split(".")[0] == "laplace":
            raise ImportError(
                "hessian_eigenthings.interop.laplace needs laplace-torch; install it with "
                "`pip install laplace-torch` (or `pip install hessian-eigenthings[laplace]`)"
            ) from None
        raise ImportError(
            f"laplace-torch is installed but importing it failed ({exc}); install the package it "
            f"names (e.g. `pip install --no-deps backpack-for-pytorch` for 'backpack')"
        ) from exc
    return CurvatureInterface, GGNInterface, EFInterface, Kron, LowRankLaplace, ParametricLaplace


(
    CurvatureInterface,
    GGNInterface,
    EFInterface,
    Kron,
    LowRankLaplace,
    ParametricLaplace,
) = _import_laplace()

__all__ = [
    "HessianEigenthingsEF",
    "HessianEigenthingsGGN",
    "HessianEigenthingsHessian",
    "LanczosLowRankLaplace",
]

_KRON_KWARGS = ("kfac_approx",)


def _call_model(model: nn.Module, batch: Any) -> torch.Tensor:
    """``model(x)`` for a batch ``(x, y)`` (``x`` a tensor or laplace-torch's dict input)."""
    out: torch.Tensor = model(batch[0])
    return out


def _batch_size(x: Any, y: torch.Tensor) -> int:
    return int(y.shape[0])


class _Backend(CurvatureInterface):  # type: ignore[misc,valid-type]
    """What the three backends share: the batch's module and data, the summed loss, and the
    structures built from an operator (``full``, ``diag``, ``eig_lowrank``)."""

    #: the curvature's name in messages
    _what = "curvature"

    def _setup(
        self,
        low_rank: int,
        lanczos_options: Mapping[str, Any] | None,
        seed: int,
    ) -> None:
        if isinstance(low_rank, bool) or not isinstance(low_rank, int) or low_rank < 1:
            raise ValueError(f"low_rank must be an int >= 1, got {low_rank!r}")
        self.low_rank = low_rank
        self.lanczos_options = dict(lanczos_options or {})
        for key in ("k", "which"):
            if key in self.lanczos_options:
                raise ValueError(
                    f"lanczos_options may not set {key!r}: the backend sets it "
                    f"(k from low_rank, which='LA'); pass low_rank={self.low_rank} instead"
                    if key == "k"
                    else f"lanczos_options may not set {key!r}: the backend sets it (which='LA')"
                )
        self.seed = int(seed)
        self._draws = 0  # Monte-Carlo draws so far: each batch gets its own seed

    # -- the batch --------------------------------------------------------------------------------
    def _module_and_batch(self, x: Any, y: torch.Tensor) -> tuple[nn.Module, tuple[Any, Any]]:
        """The module the operators run on and its batch: the model and ``(x, y)``, or for
        last-layer Laplace the last layer and ``(features, y)`` (features without gradients)."""
        if not self.last_layer:
            return self.model, (x, y)
        with torch.no_grad():
            _, features = self.model.forward_with_features(x)
        return self.model.last_layer, (features.detach(), y)

    def _param_filter(self, module: nn.Module) -> Any:
        """Select laplace-torch's parameters (those of ``module`` that require gradients), in
        ``module.named_parameters()`` order, as laplace-torch lays them out."""
        wanted = {name for name, p in module.named_parameters() if p.requires_grad}
        if not wanted:
            raise ValueError(
                "the model has no parameter that requires gradients; laplace-torch's posterior "
                "is over those: set requires_grad=True on the parameters to include"
            )
        return lambda name, _p: name in wanted

    def _summed_loss(self, module: nn.Module, batch: tuple[Any, Any]) -> torch.Tensor:
        """laplace-torch's loss of the batch: ``factor · lossfunc`` summed over the samples."""
        with torch.no_grad():
            out = _call_model(module, batch)
            loss: torch.Tensor = self.factor * self.lossfunc(out, batch[1])
        return loss.detach()

    def _operator(
        self, module: nn.Module, batch: tuple[Any, Any]
    ) -> tuple[CurvatureOperator, float]:
        """``(op, scale)``: ``scale · op`` is the curvature of the batch's summed loss."""
        raise NotImplementedError

    def _subnetwork(self, n: int) -> torch.Tensor | None:
        idx = self.subnetwork_indices
        if idx is None:
            return None
        idx = torch.as_tensor(idx, dtype=torch.long)
        if idx.dim() != 1 or (idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= n)):
            raise ValueError(
                f"subnetwork_indices must be a 1-d LongTensor of indices in [0, {n}); "
                f"got shape {tuple(idx.shape)}"
            )
        return idx

    # -- laplace-torch's structures ---------------------------------------------------------------
    def full(self, x: Any, y: torch.Tensor, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """``(loss, H)``: the dense curvature ``(P, P)`` of the batch's summed loss (``(k, k)``
        over ``subnetwork_indices`` when set)."""
        module, batch = self._module_and_batch(x, y)
        op, scale = self._operator(module, batch)
        idx = self._subnetwork(op.size)
        dense = op.to_dense() if idx is None else op.submatrix(idx.to(op.device)).to_dense()
        H = (scale * dense).to(self._param_dtype())
        return self._summed_loss(module, batch), H.detach()

    def diag(self, x: Any, y: torch.Tensor, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """``(loss, d)``: the exact diagonal ``(P,)`` of the batch's curvature."""
        module, batch = self._module_and_batch(x, y)
        op, scale = self._operator(module, batch)
        d = diagonal(op, method="exact").estimate
        idx = self._subnetwork(op.size)
        if idx is not None:
            d = d[idx.to(d.device)]
        return self._summed_loss(module, batch), (scale * d).to(self._param_dtype()).detach()

    def kron(self, x: Any, y: torch.Tensor, N: int, **kwargs: Any) -> tuple[torch.Tensor, Any]:
        """``(loss, Kron)``: KFAC of the batch's summed loss in laplace-torch's ``Kron`` form."""
        raise NotImplementedError(
            f"{type(self).__name__} has no Kronecker-factored {self._what}; use "
            "HessianEigenthingsGGN or HessianEigenthingsEF for hessian_structure='kron'"
        )

    def eig_lowrank(
        self, data_loader: Iterable[Any]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(U (P, k), eigenvalues (k,), loss)``: the top ``low_rank`` eigenpairs of the curvature
        summed over ``data_loader`` (Lanczos, ``which="LA"``), positive eigenvalues only."""
        if self.subnetwork_indices is not None:
            raise ValueError(
                "hessian_structure='lowrank' covers all the parameters; subnetwork Laplace takes "
                "'full' or 'diag'"
            )
        batches = [self._batch_of(data) for data in data_loader]
        if not batches:
            raise ValueError("eig_lowrank got an empty data loader; pass the training data")
        pairs = [self._module_and_batch(x, y) for x, y in batches]
        module = pairs[0][0]
        data = [batch for _, batch in pairs]
        total = sum(_batch_size(*b) for b in data)
        loss = sum((self._summed_loss(module, b) for b in data), torch.zeros(()))
        op, scale = self._mean_operator(module, data, total)
        options: dict[str, Any] = {"seed": self.seed, "tol": 1e-6}
        options.update(self.lanczos_options)
        k = min(self.low_rank, op.size)
        result = lanczos(op, k=k, which="LA", **options)
        values = scale * result.eigenvalues
        vectors = result.eigenvectors.T  # (P, k) columns
        order = torch.argsort(values, descending=True)
        values, vectors = values[order], vectors[:, order]
        if values.numel() == 0 or not bool(values[0] > 0):
            raise ValueError(
                f"the {self._what} has no positive eigenvalue among its top {k}; a low-rank "
                "Laplace needs a positive curvature (train the model first, or use "
                "hessian_structure='diag')"
            )
        # laplace-torch inverts the eigenvalues: drop those within rounding of zero or below
        floor = values[0] * op.size * torch.finfo(values.dtype).eps * 100
        keep = values > floor
        dtype = self._param_dtype()
        return vectors[:, keep].to(dtype), values[keep].to(dtype), loss.to(dtype)

    def _mean_operator(
        self, module: nn.Module, data: list[tuple[Any, Any]], total: int
    ) -> tuple[CurvatureOperator, float]:
        """``(op, scale)`` over all the batches: ``scale · op`` is the curvature summed over the
        ``total`` samples. Our operators weight each batch by its size, so each batch's loss is
        its summed loss divided by its size (laplace-torch's loss per sample)."""
        raise NotImplementedError

    # -- helpers ----------------------------------------------------------------------------------
    def _batch_of(self, data: Any) -> tuple[Any, torch.Tensor]:
        device = next(self.model.parameters()).device
        if isinstance(data, MutableMapping):
            return data, data[self.dict_key_y].to(device)
        x, y = data
        return x.to(device), y.to(device)

    def _param_dtype(self) -> torch.dtype:
        return next(iter(self.params)).dtype if self.params else torch.get_default_dtype()

    def _per_sample_mean_criterion(self) -> tuple[nn.Module, float]:
        """``(criterion, per_sample)``: a mean-reduced criterion whose value times ``per_sample``
        (outputs per sample for MSE, which averages over them too; 1 for cross-entropy) is the
        batch's summed loss divided by its size."""
        if self.likelihood == "regression":
            return nn.MSELoss(reduction="mean"), math.nan  # the outputs per sample: known later
        return nn.CrossEntropyLoss(reduction="mean"), 1.0

    def _next_seed(self) -> int:
        self._draws += 1
        return self.seed + self._draws - 1


class _OutputCurvatureBackend(_Backend):
    """GGN and empirical Fisher: KFAC for ``kron``."""

    _fisher_type = "type2"

    def _kron_fisher_type(self) -> str:
        return self._fisher_type

    def kron(self, x: Any, y: torch.Tensor, N: int, **kwargs: Any) -> tuple[torch.Tensor, Any]:
        unknown = sorted(set(kwargs) - set(_KRON_KWARGS))
        if unknown:
            raise TypeError(
                f"{type(self).__name__}.kron got unexpected options {unknown}; it takes "
                f"{list(_KRON_KWARGS)} (Laplace(..., asdl_fisher_kwargs=...))"
            )
        if self.subnetwork_indices is not None:
            raise ValueError(
                "a Kronecker-factored curvature covers whole layers; subnetwork Laplace takes "
                "'full' or 'diag'"
            )
        if isinstance(N, bool) or not isinstance(N, int) or N < 1:
            raise ValueError(f"N (the training set's size) must be an int >= 1, got {N!r}")
        module, batch = self._module_and_batch(x, y)
        M = _batch_size(*batch)
        fisher_type = self._kron_fisher_type()
        options: dict[str, Any] = {"kfac_approx": kwargs.get("kfac_approx", "expand")}
        if fisher_type == "mc":
            options.update(mc_samples=self.num_samples, seed=self._next_seed())
        op = KFACOperator(
            module,
            [batch],
            _call_model,
            supervised_loss_of_output(self.lossfunc),  # summed: G = Σ g gᵀ over the batch
            fisher_type=fisher_type,  # type: ignore[arg-type]
            param_filter=self._param_filter(module),
            separate_bias=True,
            **options,
        )
        kron = Kron(self._kron_factors(op, module, M / N))
        return self._summed_loss(module, batch), kron

    def _kron_factors(
        self, op: KFACOperator, module: nn.Module, share: float
    ) -> list[list[torch.Tensor]]:
        """laplace-torch's factors, one entry per parameter in ``module.parameters()`` order:
        ``[G·√c, A·share·√c]`` for a weight (``[A·√c, G·share·√c]`` for a weight stored
        ``(in, out)``, laplace-torch reading it as stored) and ``[G·c]`` for a bias, ``c`` the
        likelihood's factor (laplace-torch's ``Kron * c`` spreads ``c`` the same way). The batch's
        share ``M/N`` goes on the second factor, where laplace-torch puts it (its curvlinops
        backend and ``KronLaplace`` rescale ``F[1]``): laplace-torch adds the factors of its
        batches, so where the share goes changes the sum."""
        dtype = self._param_dtype()
        root = math.sqrt(self.factor)
        by_name: dict[str, list[torch.Tensor]] = {}
        for block in op.factors:
            G = block.G.detach().to(dtype)
            if len(block.names) != 1:
                raise ValueError(
                    f"KFAC joined {block.names} in one block; laplace-torch's Kron holds one block "
                    "per parameter"
                )
            (name,) = block.names
            if block.A.shape == (1, 1) and _is_bias(op, name):
                by_name[name] = [G * self.factor]
                continue
            A = block.A.detach().to(dtype)
            first, second = (A, G) if block.transposed else (G, A)
            by_name[name] = [first * root, second * (share * root)]
        order = [name for name, p in module.named_parameters() if p.requires_grad]
        missing = [name for name in order if name not in by_name]
        if missing:
            raise ValueError(
                f"KFAC has no block for {missing}; laplace-torch's Kron needs one per parameter "
                "(only nn.Linear, nn.Conv2d and transformers' Conv1D layers, each parameter used "
                "by one layer): freeze the others (requires_grad=False) or use 'full'/'diag'"
            )
        return [by_name[name] for name in order]


def _is_bias(op: KFACOperator, name: str) -> bool:
    """Whether ``name`` is a layer's bias in ``op``'s blocks (its block has no weight)."""
    shapes = dict(zip(op.layout.names, op.layout.shapes, strict=True))
    return len(tuple(shapes[name])) == 1


class HessianEigenthingsGGN(_OutputCurvatureBackend, GGNInterface):  # type: ignore[misc,valid-type]
    """laplace-torch backend: the generalized Gauss-Newton from this library's operators.

    ``Laplace(model, likelihood, hessian_structure="full"|"diag"|"kron"|"lowrank",
    backend=HessianEigenthingsGGN)``. ``stochastic=True`` (``backend_kwargs``) gives the
    Monte-Carlo Fisher with ``num_samples`` sampled targets per sample, seeded by ``seed`` (each
    batch its own draws; the global random state is untouched). The module docstring states the
    conventions.
    """

    _what = "GGN"

    def __init__(
        self,
        model: nn.Module,
        likelihood: Any,
        last_layer: bool = False,
        subnetwork_indices: torch.LongTensor | None = None,
        dict_key_x: str = "input_ids",
        dict_key_y: str = "labels",
        stochastic: bool = False,
        num_samples: int = 1,
        *,
        low_rank: int = 10,
        lanczos_options: Mapping[str, Any] | None = None,
        seed: int = 0,
    ) -> None:
        if isinstance(num_samples, bool) or not isinstance(num_samples, int) or num_samples < 1:
            raise ValueError(f"num_samples must be an int >= 1, got {num_samples!r}")
        GGNInterface.__init__(
            self,
            model,
            likelihood,
            last_layer,
            subnetwork_indices,
            dict_key_x,
            dict_key_y,
            stochastic=bool(stochastic),
            num_samples=num_samples,
        )
        self._setup(low_rank, lanczos_options, seed)

    def _kron_fisher_type(self) -> str:
        return "mc" if self.stochastic else "type2"

    def _ggn(self, module: nn.Module, data: list[tuple[Any, Any]], loss: Any) -> GGNOperator:
        mc = {"mc_samples": self.num_samples, "seed": self._next_seed()} if self.stochastic else {}
        return GGNOperator(
            module,
            data,
            _call_model,
            loss,
            param_filter=self._param_filter(module),
            **mc,
        )

    def _operator(
        self, module: nn.Module, batch: tuple[Any, Any]
    ) -> tuple[CurvatureOperator, float]:
        # the GGN of the summed loss; laplace-torch's factor (0.5 for regression) times it
        return self._ggn(module, [batch], supervised_loss_of_output(self.lossfunc)), self.factor

    def _mean_operator(
        self, module: nn.Module, data: list[tuple[Any, Any]], total: int
    ) -> tuple[CurvatureOperator, float]:
        criterion, per_sample = self._per_sample_mean_criterion()
        if math.isnan(per_sample):
            per_sample = _outputs_per_sample(module, data[0])
        op = self._ggn(module, data, supervised_loss_of_output(criterion))
        return op, self.factor * total * per_sample


class HessianEigenthingsEF(_OutputCurvatureBackend, EFInterface):  # type: ignore[misc,valid-type]
    """laplace-torch backend: the empirical Fisher ``Σ gᵢgᵢᵀ`` from this library's operators.

    ``Laplace(model, likelihood, hessian_structure="full"|"diag"|"kron"|"lowrank",
    backend=HessianEigenthingsEF)``; ``kron`` is KFAC with ``fisher_type="empirical"``. The
    module docstring states the conventions.
    """

    _what = "empirical Fisher"
    _fisher_type = "empirical"

    def __init__(
        self,
        model: nn.Module,
        likelihood: Any,
        last_layer: bool = False,
        subnetwork_indices: torch.LongTensor | None = None,
        dict_key_x: str = "input_ids",
        dict_key_y: str = "labels",
        *,
        low_rank: int = 10,
        lanczos_options: Mapping[str, Any] | None = None,
        seed: int = 0,
    ) -> None:
        EFInterface.__init__(
            self, model, likelihood, last_layer, subnetwork_indices, dict_key_x, dict_key_y
        )
        self._setup(low_rank, lanczos_options, seed)

    def _ef(self, module: nn.Module, data: list[tuple[Any, Any]]) -> EmpiricalFisherOperator:
        # F = (1/N) Σ gᵢgᵢᵀ, gᵢ the gradient of sample i's summed loss
        return EmpiricalFisherOperator(
            module,
            data,
            supervised_per_sample_loss(self.lossfunc),
            param_filter=self._param_filter(module),
        )

    def _operator(
        self, module: nn.Module, batch: tuple[Any, Any]
    ) -> tuple[CurvatureOperator, float]:
        return self._ef(module, [batch]), self.factor * _batch_size(*batch)

    def _mean_operator(
        self, module: nn.Module, data: list[tuple[Any, Any]], total: int
    ) -> tuple[CurvatureOperator, float]:
        return self._ef(module, data), self.factor * total


class HessianEigenthingsHessian(_Backend):
    """laplace-torch backend: the Hessian of the summed loss from this library's
    :class:`~hessian_eigenthings.operators.HessianOperator`.

    ``hessian_structure="full"`` (the dense Hessian, which may be indefinite away from a
    minimum) and ``"lowrank"`` (its top ``low_rank`` positive eigenpairs by Lanczos, as
    laplace-torch's asdfghjkl Hessian backend gives). ``diag`` and ``kron`` are refused: this
    library has no exact Hessian diagonal or Kronecker factorization of the Hessian (use
    :class:`HessianEigenthingsGGN`).
    """

    _what = "Hessian"

    def __init__(
        self,
        model: nn.Module,
        likelihood: Any,
        last_layer: bool = False,
        subnetwork_indices: torch.LongTensor | None = None,
        dict_key_x: str = "input_ids",
        dict_key_y: str = "labels",
        *,
        low_rank: int = 10,
        lanczos_options: Mapping[str, Any] | None = None,
        seed: int = 0,
    ) -> None:
        CurvatureInterface.__init__(
            self, model, likelihood, last_layer, subnetwork_indices, dict_key_x, dict_key_y
        )
        self._setup(low_rank, lanczos_options, seed)

    def _hessian(
        self, module: nn.Module, data: list[tuple[Any, Any]], criterion: nn.Module
    ) -> HessianOperator:
        def loss_fn(model: nn.Module, batch: Any) -> torch.Tensor:
            out: torch.Tensor = criterion(_call_model(model, batch), batch[1])
            return out

        return HessianOperator(module, data, loss_fn, param_filter=self._param_filter(module))

    def _operator(
        self, module: nn.Module, batch: tuple[Any, Any]
    ) -> tuple[CurvatureOperator, float]:
        return self._hessian(module, [batch], self.lossfunc), self.factor

    def _mean_operator(
        self, module: nn.Module, data: list[tuple[Any, Any]], total: int
    ) -> tuple[CurvatureOperator, float]:
        criterion, per_sample = self._per_sample_mean_criterion()
        if math.isnan(per_sample):
            per_sample = _outputs_per_sample(module, data[0])
        return self._hessian(module, data, criterion), self.factor * total * per_sample

    def diag(self, x: Any, y: torch.Tensor, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError(
            "HessianEigenthingsHessian has no exact Hessian diagonal; use "
            "HessianEigenthingsGGN for hessian_structure='diag' (or he.diagonal(op, "
            "method='xdiag') for an estimate outside laplace-torch)"
        )


def _outputs_per_sample(module: nn.Module, batch: tuple[Any, Any]) -> float:
    """The model's outputs per sample (MSE's mean averages over them too)."""
    with torch.no_grad():
        out = _call_model(module, batch)
    return out.numel() / max(1, out.shape[0])


class LanczosLowRankLaplace(LowRankLaplace):  # type: ignore[misc,valid-type]
    """laplace-torch's ``LowRankLaplace`` with the eigenpairs from one of the backends here.

    ``LanczosLowRankLaplace(model, likelihood, backend=HessianEigenthingsGGN,
    backend_kwargs={"low_rank": k})``, then ``fit``, ``optimize_prior_precision``, predictions as
    for any laplace-torch posterior: the precision is ``U diag(λ) Uᵀ + P₀`` with the top ``k``
    eigenpairs of the curvature summed over the training set (Lanczos).

    ``Laplace(..., hessian_structure="lowrank")`` builds laplace-torch's own class, which refuses
    to start unless the old ``asdfghjkl`` package (its default backend; only on GitHub) is
    importable, whatever the backend; this class is the same posterior without that check. Its
    registry key is ``("all", "lowrank_lanczos")``, so importing it leaves what
    ``hessian_structure="lowrank"`` builds unchanged.
    """

    _key = ("all", "lowrank_lanczos")

    def __init__(
        self,
        model: nn.Module,
        likelihood: Any,
        backend: type = HessianEigenthingsGGN,
        sigma_noise: float | torch.Tensor = 1,
        prior_precision: float | torch.Tensor = 1,
        prior_mean: float | torch.Tensor = 0,
        temperature: float = 1,
        enable_backprop: bool = False,
        dict_key_x: str = "input_ids",
        dict_key_y: str = "labels",
        backend_kwargs: dict[str, Any] | None = None,
    ) -> None:
        if not isinstance(backend, type) or not callable(getattr(backend, "eig_lowrank", None)):
            raise TypeError(
                f"LanczosLowRankLaplace needs a backend class with eig_lowrank, got {backend!r}; "
                "pass backend=HessianEigenthingsGGN, HessianEigenthingsEF or HessianEigenthingsHessian"
            )
        ParametricLaplace.__init__(
            self,
            model,
            likelihood,
            sigma_noise=sigma_noise,
            prior_precision=prior_precision,
            prior_mean=prior_mean,
            temperature=temperature,
            enable_backprop=enable_backprop,
            dict_key_x=dict_key_x,
            dict_key_y=dict_key_y,
            backend=backend,
            backend_kwargs=backend_kwargs,
        )
