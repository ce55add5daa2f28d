"""Low-rank preconditioned query gradients (``pairwise_scores(rank=r)``): their factors, made
layer by layer where the hooks apply, and scores of training batches against them with no
per-example gradient formed (NOTE [low-rank queries layer by layer])."""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from hessian_eigenthings._checks import InternalError
from hessian_eigenthings.batching import Batch, batch_size, map_tensors
from hessian_eigenthings.influence.gradients import Layer, PerExampleGradients
from hessian_eigenthings.influence.sharded import ShardedScoring
from hessian_eigenthings.operators.protocol import CurvatureOperator
from hessian_eigenthings.param_utils import ParamLayout

__all__ = ["LowRank", "Part", "QueryFactors", "example_slice", "factor", "streams_queries"]

# NOTE [low-rank queries layer by layer]: with ``rank=`` each preconditioned query gradient's
# weight matrices are kept as rank-``r`` factors ``left (m, r) = U·S`` and ``right (q, r) = V``
# of the weight as stored (HuggingFace's Conv1D ``(in, out)``), biases and other vectors whole
# (Kronfluence's low-rank queries); a bias joined to its weight in the curvature's block
# (``separate_bias=False``) is preconditioned with it and kept whole all the same.
#
# Queries. On the Kronecker routes the whole rows ``(n_query, n)`` are never formed (at
# Llama-3.2-1B's shape, 973 M scored parameters, they are 62 GB for 16 float32 queries).
# ``(C + λI)⁻¹`` is block-diagonal, one block per layer's weight and bias (joined, or the bias
# alone: the operator's own blocks), so a slice of as many queries as the first training batch
# goes through one forward and backward whose hooks precondition each layer's per-example block
# in the damped inverse's eigenbasis (``U_G ((U_Gᵀ X U_A) / (D + λ)) U_Aᵀ``, the rows' inverse)
# and factor it by SVD as the backward reaches it. Memory: a few copies of the slice's largest
# layer block (8 × 8192 × 2048, 0.5 GB at that shape) plus the factors (``16·32·Σ(m + q)``
# floats at rank 32: 1.4 GB). The hooks are checked once, also without rows (each of two
# examples' hooked gradients against its own gradient, parameter by parameter).
#
# Training batches. No per-example gradient is formed either (31 GB of rows for a batch of 8 at
# that shape): a layer's example gradient is ``Σ_t g_t a_tᵀ`` (inputs ``a_t``, output gradients
# ``g_t``: NOTE [per-example gradients of linear layers]), so for a Linear's factors
#
#     ⟨left·rightᵀ, Σ_t g_t a_tᵀ⟩ = Σ_t Σ_r (left_rᵀ g_t)(right_rᵀ a_t)
#
# (a Conv1D's swap roles): two products of the layer's activations with the factors, ``(B·T, m)
# @ (m, k·r)``, in slices of the queries no larger than the activations, multiplied and summed
# over positions and ranks; a bias's part is ``Σ_t g_t`` against its whole query rows. The parts
# are summed in the layout's order, so a resumed run equals an unbroken one bit for bit.
#
# Elsewhere the same factors and scores come from rows, the same truncation to rounding: a model
# whose layers have no hooks (vmap) or whose hooks fail the check, and sharded ranks (whose
# passes meet in FSDP's collectives: as before there), make each query slice's rows,
# precondition and factor them, and score each training batch from its rows. The exact routes
# solve for every query at once (one block solve), and the Kronecker routes with each module's
# factors on one rank apply their inverse collectively to the same rows on every rank: their
# queries are whole rows, as before, then factored; their training batches are scored by layer.
Part = tuple[str, Any]  # ("dense", (k, size)) or ("factored", (left (k, m, r), right (k, q, r)))


def factor(view: torch.Tensor, rank: int) -> Part:
    """A parameter's query rows ``view (k, *shape)`` as kept: a matrix (a tensor of more than
    two dimensions flattened to ``(shape[0], rest)``) as its top-``rank`` singular triplets
    ``left = U·S``, ``right = V``; a vector whole."""
    k, shape = view.shape[0], view.shape[1:]
    if len(shape) < 2:
        return ("dense", view.reshape(k, shape.numel()).clone())  # no -1: k may be 0
    M = view.reshape(k, shape[0], shape[1:].numel())
    U, S, Vh = torch.linalg.svd(M, full_matrices=False)
    r = min(rank, S.shape[-1])
    left = U[..., :r] * S[:, None, :r]  # (k, m, r)
    right = Vh[:, :r, :].transpose(1, 2)  # (k, q, r)
    return ("factored", (left.contiguous(), right.contiguous()))


@dataclass(eq=False)
class InverseBlock:
    """One block of ``(C + λI)⁻¹`` in its eigenbasis, ``U_G ((U_Gᵀ X U_A) ⊙ scale) U_Aᵀ`` on the
    block's matrix ``X (m, q)``: a weight's (``transposed``: stored ``(in, out)``, read as its
    transpose) and a bias as a last column, or a bias alone ``(m, 1)``."""

    weight: int | None  # layout indices
    bias: int | None
    transposed: bool
    U_G: torch.Tensor  # (m, m)
    U_A: torch.Tensor  # (q, q)
    scale: torch.Tensor  # (m, q): 1 / (D + λ)

    def factored(
        self, grads: dict[int, torch.Tensor], dtype: torch.dtype, rank: int
    ) -> Iterator[tuple[int, Part]]:
        """``(layout index, part)`` of the block's preconditioned per-example gradients
        ``grads`` (by layout index, ``(k, *shape)``), read and written back as the rows' inverse
        reads them (``kronecker_blocks.gather`` / ``scatter``)."""
        columns = []
        if self.weight is not None:
            w = grads[self.weight]
            columns.append(w.transpose(1, 2) if self.transposed else w)
        if self.bias is not None:
            columns.append(grads[self.bias].unsqueeze(-1))
        d = columns[0].shape[-1] if self.weight is not None else 0  # the weight's columns
        X = (columns[0] if len(columns) == 1 else torch.cat(columns, dim=-1)).to(self.U_G.dtype)
        del columns
        # U_Gᵀ X U_A and back, each factor on the right of a (k·rows, ·) fold: a factor on the
        # left of a batch (U_Gᵀ @ X) is broadcast to (k, m, m) first
        Z = (X.transpose(1, 2) @ self.U_G).transpose(1, 2) @ self.U_A
        del X
        Z.mul_(self.scale)
        Y = ((Z.transpose(1, 2) @ self.U_G.T).transpose(1, 2) @ self.U_A.T).to(dtype)
        del Z
        if self.weight is not None:
            W = Y[..., :d]
            yield self.weight, factor(W.transpose(1, 2) if self.transposed else W, rank)
        if self.bias is not None:
            yield self.bias, ("dense", Y[..., -1].clone())


def _digest(tensors: Iterable[torch.Tensor]) -> str:
    """A hash of tensors' dtypes, shapes and bytes (read one tensor at a time on the host)."""
    digest = hashlib.blake2b(digest_size=16)
    for t in tensors:
        digest.update(f"{t.dtype}{tuple(t.shape)}".encode())
        digest.update(
            t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        )
    return digest.hexdigest()


def _factored_dots(
    g: torch.Tensor, a: torch.Tensor, g_side: torch.Tensor, a_side: torch.Tensor
) -> torch.Tensor:
    """``(k, B)``: ``Σ_t Σ_r (g_side[j, :, r]ᵀ g[b, t])(a_side[j, :, r]ᵀ a[b, t])`` for output
    gradients ``g (B, T, m)``, inputs ``a (B, T, d)`` and factors ``(k, m, r)``, ``(k, d, r)``
    (NOTE [low-rank queries layer by layer]), in slices of the queries whose products are no
    larger than the activations."""
    B, T, m = g.shape
    d = a.shape[-1]
    k, _, r = g_side.shape
    gf, af = g.reshape(B * T, m), a.reshape(B * T, d)
    step = max(1, max(gf.numel(), af.numel()) // max(1, B * T * r))
    out = torch.empty(k, B, dtype=g.dtype, device=g.device)
    for s in range(0, k, step):
        gs, as_ = g_side[s : s + step], a_side[s : s + step]
        c = gs.shape[0]
        pg = gf @ gs.permute(1, 0, 2).reshape(m, c * r)  # (B·T, c·r)
        pa = af @ as_.permute(1, 0, 2).reshape(d, c * r)
        out[s : s + c] = pg.mul_(pa).reshape(B, T, c, r).sum((1, 3)).T
    return out


class LowRank:
    """Scores against preconditioned query gradients kept as rank-``r`` factors per weight
    matrix: ``Σ_i s_i u_iᵀ G v_i`` for a training gradient's matrix ``G`` (vectors whole; NOTE
    [low-rank queries layer by layer])."""

    def __init__(self, layout: ParamLayout, parts: list[Part]) -> None:
        self.layout = layout
        self.parts = parts

    @classmethod
    def of_rows(cls, Q: torch.Tensor, layout: ParamLayout, rank: int) -> LowRank:
        """From the whole preconditioned rows ``Q (k, n)``."""
        return cls(layout, [factor(view, rank) for view in layout.split_rows(Q)])

    @classmethod
    def joined(cls, layout: ParamLayout, pieces: list[list[Part]], rank: int) -> LowRank:
        """From the parts of consecutive slices of the queries, joined along the queries."""
        if not pieces:  # no query: empty factors of the right shapes
            return cls.of_rows(layout.empty(0), layout, rank)
        if len(pieces) == 1:
            return cls(layout, pieces[0])
        parts: list[Part] = []
        for held in zip(*pieces, strict=True):
            kind = held[0][0]
            if kind == "dense":
                parts.append((kind, torch.cat([h for _, h in held])))
            else:
                left = torch.cat([h[0] for _, h in held])
                parts.append((kind, (left, torch.cat([h[1] for _, h in held]))))
        return cls(layout, parts)

    @property
    def n_query(self) -> int:
        kind, held = self.parts[0]
        return int((held if kind == "dense" else held[0]).shape[0])

    def fingerprint(self) -> str:
        """A hash of the factors: a checkpoint belongs to one set of queries."""
        return _digest(
            t for kind, held in self.parts for t in ((held,) if kind == "dense" else held)
        )

    def scores(self, grads: PerExampleGradients, batch: Batch) -> torch.Tensor:
        """``(k, B)`` scores of a training batch, layer by layer as the backward reaches each
        layer where the hooks apply (no per-example gradient formed), else from its rows; the
        parameters' parts summed in the layout's order."""
        found: dict[int, torch.Tensor] = {}
        if not grads.by_layer(batch, lambda layer: self._layer_dots(layer, found)):
            return self(grads(batch).to(self.layout.dtype))
        out = torch.zeros(
            self.n_query, batch_size(batch), dtype=self.layout.dtype, device=self.layout.device
        )
        for j in sorted(found):
            out += found[j]
        return out

    def _layer_dots(self, layer: Layer, found: dict[int, torch.Tensor]) -> None:
        dtype = self.layout.dtype
        if layer.weight is not None:
            kind, held = self.parts[layer.weight]
            if kind != "factored":
                raise InternalError("a hooked layer's weight is a matrix, kept factored")
            left, right = held  # the weight as stored: Conv1D's (in, out), Linear's (out, in)
            g_side, a_side = (right, left) if layer.conv1d else (left, right)
            found[layer.weight] = _factored_dots(
                layer.g.to(dtype), layer.a.to(dtype), g_side, a_side
            )
        if layer.bias is not None:
            _, dense = self.parts[layer.bias]
            found[layer.bias] = dense @ layer.g.sum(1).to(dtype).T

    def __call__(self, G: torch.Tensor) -> torch.Tensor:
        B = G.shape[0]
        total: torch.Tensor | None = None
        for (kind, held), view in zip(self.parts, self.layout.split_rows(G), strict=True):
            if kind == "dense":
                term = held @ view.reshape(B, held.shape[1]).T
            else:
                left, right = held
                M = view.reshape(B, left.shape[1], right.shape[1])
                term = torch.einsum("jmr,bmq,jqr->jb", left, M, right)
            total = term if total is None else total + term
        if total is None:
            raise InternalError("total is not None")
        return total


def streams_queries(
    curvature: str, operator: CurvatureOperator, sharded: ShardedScoring | None
) -> bool:
    """Whether low-rank queries are made slice by slice (NOTE [low-rank queries layer by
    layer]): the Kronecker routes, whose inverse acts on each row alone, and with no collective
    (not with each module's factors on one rank, whose inverse the ranks apply together to the
    same rows)."""
    if curvature not in ("ekfac", "kfac"):
        return False
    ranks = getattr(operator, "ranks", None)
    return sharded is not None or ranks is None or ranks.module_blocks is None


class QueryFactors:
    """A slice of queries' preconditioned gradients as factors, each layer's block
    preconditioned in the damped inverse's eigenbasis and factored as the backward reaches it
    (NOTE [low-rank queries layer by layer]). ``blocks``: each scored parameter's block of
    ``(C + λI)⁻¹`` (the operator's own blocks: a bias alone or joined to its weight), by layout
    index; None where a block is not one hooked layer's weight and bias."""

    def __init__(
        self,
        operator: CurvatureOperator,
        layout: ParamLayout,
        damping: float,
        grads: PerExampleGradients,
    ) -> None:
        self.layout = layout
        self.grads = grads
        self.blocks = _inverse_blocks(operator, layout, damping)

    @staticmethod
    def joined(
        layout: ParamLayout,
        batches: Iterable[Batch],
        step: int | None,
        rank: int,
        layers: QueryFactors | None,
        rows: Callable[[Batch], torch.Tensor],
    ) -> LowRank:
        """The factors of ``batches`` of queries, in slices of ``step`` examples (None: whole
        batches), each slice by ``layers`` where the hooks apply, else from its preconditioned
        ``rows`` (sharded ranks, vmap, a failed check)."""
        pieces: list[list[Part]] = []
        for batch in batches:
            B = batch_size(batch)
            at_once = B if step is None else step
            for s in range(0, B, at_once):
                piece = batch if at_once >= B else map_tensors(batch, example_slice(s, s + at_once))
                parts = None if layers is None else layers.of_slice(piece, rank)
                if parts is None:
                    held = rows(piece)
                    parts = [factor(view, rank) for view in layout.split_rows(held)]
                    del held
                pieces.append(parts)
        return LowRank.joined(layout, pieces, rank)

    def of_slice(self, piece: Batch, rank: int) -> list[Part] | None:
        """The slice's factors, or None where the hooked layers do not apply (the caller makes
        them from the slice's rows)."""
        blocks = self.blocks
        if blocks is None or not self.grads.check_hooks(piece):
            return None
        dtype = self.layout.dtype
        found: dict[int, Part] = {}

        def use(layer: Layer) -> None:
            grads = {j: g.to(dtype) for j, g in layer.gradients()}
            for block in {id(blocks[j]): blocks[j] for j in grads}.values():
                if any(i is not None and i not in grads for i in (block.weight, block.bias)):
                    raise InternalError("a Kronecker block over one hooked layer's parameters")
                for j, part in block.factored(grads, dtype, rank):
                    found[j] = part

        if not self.grads.by_layer(piece, use):
            return None
        k = batch_size(piece)
        return [
            found[j]
            if j in found  # a layer the backward did not reach: zero, as its rows
            else factor(torch.zeros(k, *shape, dtype=dtype, device=self.layout.device), rank)
            for j, shape in enumerate(self.layout.shapes)
        ]


def _inverse_blocks(
    operator: CurvatureOperator, layout: ParamLayout, damping: float
) -> dict[int, InverseBlock] | None:
    index = {name: i for i, name in enumerate(layout.names)}
    shapes = layout.shapes
    out: dict[int, InverseBlock] = {}
    for b in operator.eigh().blocks:  # type: ignore[attr-defined]
        if any(name not in index for name in b.names):
            return None
        ids = [index[name] for name in b.names]
        weight: int | None = ids[0]
        bias: int | None = ids[1] if len(ids) == 2 else None
        if len(ids) == 1 and len(shapes[ids[0]]) == 1 and not b.transposed:
            weight, bias = None, ids[0]  # a bias alone
        if weight is not None and len(shapes[weight]) != 2:
            return None  # a convolution's weight: no hooked layer
        # 1 / (D + λ) as the rows' inverse (eigh's D carries the operator's own damping)
        scale = (b.eigenvalues + damping).reciprocal()
        block = InverseBlock(weight, bias, b.transposed, b.G_eigenvectors, b.A_eigenvectors, scale)
        for i in (weight, bias):
            if i is not None:
                out[i] = block
    return out


def example_slice(start: int, stop: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """Rows ``start:stop`` of a batch's tensors (for ``map_tensors``)."""

    def rows(t: torch.Tensor) -> torch.Tensor:
        return t[start:stop]

    return rows
