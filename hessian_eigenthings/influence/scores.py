"""Influence scores from a fitted curvature: pairwise scores and self-influence.

Convention (NOTE [influence sign]): the score of a training example ``z`` on a query ``q`` is

    score(q, z) = −∇L(q)ᵀ (C + λI)⁻¹ ∇L(z)

the rate at which the query's loss changes when ``z`` is up-weighted in the training objective
(Koh & Liang's ``I_up,loss``, with the per-example loss ``L`` and the objective of the task,
``influence.tasks``). **Positive: up-weighting ``z`` raises the query's loss (``z`` is harmful to
``q``); negative: it lowers it (``z`` helps ``q``).** Kronfluence reports
``∇L(q)ᵀ (C + λI)⁻¹ ∇L(z)`` without the minus sign, so its scores are ours negated: its
"most positive" (helpful) examples are our most negative ones.

Cost. ``fit`` builds ``C`` once: EK-FAC two passes over the training data (K-FAC one), the exact
GGN or Hessian nothing until a solve. Query gradients are preconditioned once: one exact
damped inverse of the Kronecker operator (an eigendecomposition per factor, cached), or one
block CG (MINRES for the Hessian) over the data with every query as a column. Training
gradients are then streamed batch by batch, one batched backward per batch
(``influence.gradients``), each block of scores a product ``(n_query, n) @ (n, B)``. With
``rank=`` on the Kronecker routes neither side forms whole rows: each query slice is
preconditioned and factored layer by layer, and each training batch scored against the factors
from the layers' inputs and output gradients (NOTE [low-rank queries layer by layer] in ``influence.low_rank``).
Self-influence preconditions every training gradient (a block solve per batch on the exact
routes: slow on large data).
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, Literal

import torch
from torch import nn

from hessian_eigenthings._checks import InternalError
from hessian_eigenthings.algorithms import solve
from hessian_eigenthings.algorithms._checkpoint import (
    checkpoint_path,
    load_checkpoint,
    remove_checkpoint,
    save_checkpoint,
)
from hessian_eigenthings.algorithms._common import progress_bar
from hessian_eigenthings.batching import (
    Batch,
    BatchSource,
    batch_size,
    map_tensors,
    no_batch_message,
)
from hessian_eigenthings.influence.gradients import (
    PerExampleGradients,
    position_scores,
    refuse_unhooked,
)
from hessian_eigenthings.influence.low_rank import (
    LowRank,
    QueryFactors,
    example_slice,
    streams_queries,
)
from hessian_eigenthings.influence.sharded import (
    ShardedScoring,
    check_sharded_fit,
    refuse_sharded_model,
    whole_kronecker,
)
from hessian_eigenthings.influence.tasks import InfluenceTask
from hessian_eigenthings.operators import (
    EKFACOperator,
    GGNOperator,
    HessianOperator,
    KFACOperator,
)
from hessian_eigenthings.operators.distributed import (
    FSDPEKFACOperator,
    FSDPKFACOperator,
    Sharded,
)
from hessian_eigenthings.operators.engines import EngineName
from hessian_eigenthings.operators.factor_pass import FisherType, is_hf_conv1d
from hessian_eigenthings.operators.protocol import CurvatureOperator
from hessian_eigenthings.operators.ranks import Ranks
from hessian_eigenthings.param_utils import ParamFilter, ParamLayout, select_parameters

__all__ = ["Curvature", "Influence", "fit"]

Curvature = Literal["ekfac", "kfac", "ggn", "hessian"]
_CURVATURES = ("ekfac", "kfac", "ggn", "hessian")
#: more output classes than this take fisher_type="mc" by default: type-2 takes a batched
#: backward per column_chunk (16) classes, mc one plain backward
_TYPE2_MAX_CLASSES = 16


class _OperatorBatches:
    """The training data as the task's operator batches, re-iterable as the data is."""

    def __init__(self, data: Iterable[Batch], task: InfluenceTask) -> None:
        self.data = data
        self.task = task

    def __iter__(self) -> Iterator[Batch]:
        for batch in self.data:
            yield self.task.operator_batch(batch)

    def __len__(self) -> int:
        return len(self.data)  # type: ignore[arg-type]


def _refuse_training_mode(model: nn.Module) -> None:
    training = [name or type(model).__name__ for name, m in model.named_modules() if m.training]
    if training:
        raise ValueError(
            f"the model is in training mode ({training[0]!r}{' and more' if len(training) > 1 else ''}): "
            "dropout would make every gradient random and BatchNorm would couple the examples; "
            "call model.eval() before computing influence"
        )


def _first_batch(data: Iterable[Batch], what: str) -> Batch:
    source = BatchSource(data)
    first = source.first_batch()
    if first is None:
        raise ValueError(f"{what} has no examples ({no_batch_message(data)})")
    return first


def _kronecker_selection(model: nn.Module) -> tuple[list[str], tuple[str, ...]]:
    """The default parameters of the Kronecker routes: every trainable weight and bias of an
    ``nn.Linear`` / ``nn.Conv2d`` / ``Conv1D`` layer that no other module uses; and those left
    out, with why (NOTE [tied heads])."""
    owners: dict[int, list[tuple[str, nn.Module, str]]] = {}
    for mname, module in model.named_modules(remove_duplicate=False):
        for pname, p in module.named_parameters(recurse=False, remove_duplicate=False):
            owners.setdefault(id(p), []).append((mname, module, pname))
    chosen: list[str] = []
    left_out: list[str] = []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        uses = owners[id(p)]
        if len(uses) > 1:
            aliases = " = ".join(f"{m}.{n}" if m else n for m, _, n in uses)
            left_out.append(f"{name} (tied: {aliases})")
            continue
        _, module, pname = uses[0]
        covered = isinstance(module, (nn.Linear, nn.Conv2d)) or is_hf_conv1d(module)
        if covered and pname in ("weight", "bias"):
            chosen.append(name)
        else:
            left_out.append(f"{name} ({type(module).__name__})")
    if not chosen:
        raise ValueError(
            "the model has no trainable, untied nn.Linear / nn.Conv2d / Conv1D parameter for "
            "curvature='ekfac'/'kfac'; use curvature='ggn' (exact, any parameter)"
        )
    return chosen, tuple(left_out)


def fit(
    model: nn.Module,
    train_data: Iterable[Batch],
    task: InfluenceTask,
    *,
    curvature: Curvature = "ekfac",
    damping: float | None = None,
    param_filter: ParamFilter | str | Sequence[str] | None = None,
    fisher_type: FisherType | None = None,
    mc_samples: int = 1,
    seed: int = 0,
    tol: float = 1e-8,
    max_iter: int | None = None,
    engine: EngineName = "auto",
    separate_bias: bool = True,
    ranks: Ranks | None = None,
) -> Influence:
    """The curvature ``C`` of the task's objective over ``train_data``, ready to score.

    Args:
        model: in eval mode (refused in training mode: dropout makes gradients random).
        train_data: an iterable of batches that can be read again (a list, a DataLoader).
        task: :func:`~hessian_eigenthings.influence.supervised_task` or
            :func:`~hessian_eigenthings.influence.causal_lm_task` (or a subclass of
            :class:`~hessian_eigenthings.influence.InfluenceTask`).
        curvature: ``"ekfac"`` (default, :class:`~hessian_eigenthings.operators.EKFACOperator`),
            ``"kfac"`` (:class:`~hessian_eigenthings.operators.KFACOperator`), both inverted
            exactly with their damping; ``"ggn"`` (the exact GGN, solved by block CG on its
            products) or ``"hessian"`` (the exact Hessian, block MINRES: ``H + λI`` may be
            indefinite), for small and medium models.
        damping: ``λ``. Default for the Kronecker routes: ``0.1 ·`` the operator's mean
            eigenvalue (``trace / size``, Kronfluence's heuristic); the exact routes need it.
        param_filter: the parameters scored. Default: every trainable parameter for the exact
            routes; for the Kronecker routes the weights and biases of ``nn.Linear`` /
            ``nn.Conv2d`` / ``Conv1D`` layers, tied parameters left out (NOTE [tied heads];
            listed in ``.excluded_parameters``).
        fisher_type: the Kronecker routes' ``"type2"``, ``"mc"`` or ``"empirical"``; default
            ``"type2"`` for outputs of at most 16 classes (one batched backward), else ``"mc"`` (a language model's
            vocabulary: type-2 takes a backward per 16 classes, mc one per batch; Kronfluence
            samples one label per token too).
        mc_samples: labels drawn per output for ``fisher_type="mc"``.
        seed: the draws' seed for ``fisher_type="mc"``.
        tol: the exact routes' solves' relative residual.
        max_iter: the exact routes' solves' iterations per column.
        engine: the exact routes' product engine (``engine=`` of the data operators).
        separate_bias: the Kronecker routes' bias in its own block (default) or joined to its
            weight through a column of ones (``False``: one block per layer, as Kronfluence's).
        ranks: several processes, each with its own shard of ``train_data`` (NOTE [influence on
            several ranks]): ``operators.distributed.Replicated()`` for a replicated model,
            ``operators.distributed.Sharded(model)`` for a model sharded with FSDP2's
            ``fully_shard`` (the Kronecker routes); the curvature is that of the union of the
            shards on every rank. ``None``: one process.

    NOTE [influence on several ranks]: given replicated ranks, the curvature operator is built
    with them (Kronecker factors summed over the ranks, exact products all-reduced), so ``C``,
    its default damping and the preconditioned queries are the same on every rank; every rank
    passes the same queries and its own training shard, and ``pairwise_scores`` /
    ``token_scores`` / ``self_influence`` return this rank's columns (its shard's examples, in
    its order). Scores need no communication. Given sharded ranks (a model sharded with FSDP2),
    the curvature is ``FSDPEKFACOperator`` / ``FSDPKFACOperator`` (factors from every rank's
    shard, replicated); per-example gradients are whole on every rank (FSDP shards parameters,
    not activations) and come from hooks on ``nn.Linear`` / ``Conv1D`` layers only (another
    scored parameter is refused: vmap cannot run over FSDP's sharded parameters); the exact
    routes are refused. The columns are returned as for replicated ranks, but each batch's
    gradients are FSDP forwards and backwards, collectives: every rank calls the same methods
    with the same queries and the same number of training batches (sizes may differ; an empty
    batch on every rank or on none), refused in one line on every rank otherwise (NOTE
    [influence on sharded ranks] in ``influence.sharded``). ``layout`` is then the whole
    parameters' and ``operator`` the FSDP operator (sharded vectors, ``global_layout``).

    NOTE [EK-FAC keeps its eigenbases only]: once fitted, EK-FAC's blocks are its eigenbases
    and corrected eigenvalues; KFAC's factors ``G`` and ``A`` that gave the eigenbases are used
    by nothing that scores, so ``fit`` releases them
    (:meth:`~hessian_eigenthings.operators.EKFACOperator.release_factors`: 1.3 GB for GPT-2 in
    float32, as much as the eigenbases), as Kronfluence keeps only eigenbases for scoring.
    ``operator.factors`` is then refused in one line; build an ``EKFACOperator`` to read them.

    NOTE [tied heads]: a parameter used by two modules (GPT-2's ``lm_head.weight`` is
    ``transformer.wte.weight``) has one gradient summing both uses, while a Kronecker block sees
    one layer's use. Kronfluence tracks ``lm_head`` as a Linear and ignores the embedding use
    in both its factors and its gradients. Here the default leaves tied parameters out of the
    Kronecker routes (named in ``excluded_parameters``), and a ``param_filter`` that selects one
    is refused by the operator; the exact routes (``"ggn"``, ``"hessian"``) score them with
    their whole gradient.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(task, InfluenceTask):
        raise TypeError(
            "task must be an influence task: influence.supervised_task(criterion), "
            f"influence.causal_lm_task() or an InfluenceTask subclass; got {type(task).__name__}"
        )
    if curvature not in _CURVATURES:
        raise ValueError(
            f"curvature must be one of {', '.join(map(repr, _CURVATURES))}; got {curvature!r}"
        )
    sharded: ShardedScoring | None = None
    if isinstance(ranks, Sharded):
        check_sharded_fit(model, ranks, curvature)
        sharded = ShardedScoring(model, ranks)
    else:
        refuse_sharded_model(model, ranks)
    _refuse_training_mode(model)

    def first_batch() -> Batch:
        batch = _first_batch(train_data, "train_data")
        task.check_batch(model, batch, "train_data's first batch")
        return batch

    # sharded: a rank without data must not leave the others in FSDP's collectives
    first = first_batch() if sharded is None else sharded.agreed(first_batch, "reading train_data")
    data = _OperatorBatches(train_data, task)
    excluded: tuple[str, ...] = ()
    op: CurvatureOperator
    if curvature in ("ekfac", "kfac"):
        if param_filter is None:
            names, excluded = _kronecker_selection(model)
            chosen = set(names)
            param_filter = _named_filter(chosen)
        if sharded is not None:  # before the factor pass: the same on every rank
            refuse_unhooked(model, list(select_parameters(model, param_filter)))
        if fisher_type is None:

            def classes() -> int:
                with torch.no_grad():
                    out = task.forward(model, task.operator_batch(first))
                return int(out.shape[1]) if out.dim() > 1 else 1

            if sharded is None:
                count = classes()
            else:
                count = sharded.agreed(classes, "the model's output")
                sharded.reshard()  # FSDP keeps the root whole after a forward without backward
            fisher_type = "type2" if count <= _TYPE2_MAX_CLASSES else "mc"
        options: dict[str, Any] = dict(
            fisher_type=fisher_type,
            param_filter=param_filter,
            mc_samples=mc_samples,
            seed=seed,
            separate_bias=separate_bias,
        )
        if sharded is not None:
            fsdp = FSDPEKFACOperator if curvature == "ekfac" else FSDPKFACOperator
            op = fsdp(
                model,
                data,
                task.forward,
                task.loss_of_output,
                process_group=sharded.ranks.group,
                **options,
            )
        else:
            cls = EKFACOperator if curvature == "ekfac" else KFACOperator
            op = cls(model, data, task.forward, task.loss_of_output, ranks=ranks, **options)
        if damping is None:
            # the mean eigenvalue of the whole operator (sharded: op.size is this rank's piece)
            damping = 0.1 * float(op.trace()) / getattr(op, "global_size", op.size)
        if isinstance(op, EKFACOperator):  # NOTE [EK-FAC keeps its eigenbases only]
            op.release_factors()
    else:
        if fisher_type is not None:
            raise ValueError(
                f"fisher_type applies to curvature='ekfac'/'kfac'; curvature={curvature!r} is exact"
            )
        if damping is None:
            raise ValueError(
                f"curvature={curvature!r} needs damping=λ > 0 (e.g. 1e-3 · the curvature's mean "
                "eigenvalue, he.trace(op) / op.size)"
            )
        if curvature == "ggn":
            op = GGNOperator(
                model,
                data,
                task.forward,
                task.loss_of_output,
                param_filter=param_filter,
                engine=engine,
                ranks=ranks,
            )
        else:

            def loss_fn(m: nn.Module, batch: Batch) -> torch.Tensor:
                return task.loss_of_output(task.forward(m, batch), batch)

            op = HessianOperator(
                model, data, loss_fn, param_filter=param_filter, engine=engine, ranks=ranks
            )
    if not isinstance(damping, (int, float)) or not math.isfinite(damping) or damping < 0:
        raise ValueError(f"damping must be a finite number >= 0, got {damping!r}")
    if damping == 0 and curvature in ("ggn", "hessian"):
        raise ValueError(f"curvature={curvature!r} needs damping > 0 (the curvature is singular)")
    return Influence(
        model, task, op, float(damping), curvature, fisher_type, excluded, tol, max_iter, sharded
    )


def _named_filter(names: set[str]) -> ParamFilter:
    def keep(name: str, _p: nn.Parameter) -> bool:
        return name in names

    return keep


class Influence:
    """A fitted curvature and the task it belongs to (made by :func:`fit`).

    Attributes: ``operator`` (``C``, undamped), ``damping`` (``λ``), ``curvature``,
    ``fisher_type`` (the Kronecker routes'), ``layout`` (the scored parameters: names, shapes),
    ``excluded_parameters`` (left out by the default selection, with why).

    ``pairwise_scores(query_data, train_data)`` ``(n_query, n_train)``,
    ``self_influence(train_data)`` ``(n_train,)``, ``gradients(batch)`` ``(B, n)``,
    ``precondition(G)`` ``(C + λI)⁻¹`` applied to rows ``(k, n)``, ``token_scores(query_data,
    train_data)`` ``(n_query, n_train, positions)``. Scores follow NOTE
    [influence sign] (module docstring): positive raises the query's loss.
    """

    def __init__(
        self,
        model: nn.Module,
        task: InfluenceTask,
        operator: CurvatureOperator,
        damping: float,
        curvature: Curvature,
        fisher_type: FisherType | None,
        excluded: tuple[str, ...],
        tol: float,
        max_iter: int | None,
        sharded: ShardedScoring | None = None,
    ) -> None:
        self.model = model
        self.task = task
        self.operator = operator
        self.damping = damping
        self.curvature: Curvature = curvature
        self.fisher_type = fisher_type
        self.excluded_parameters = excluded
        #: the scored parameters, whole (on sharded ranks too: NOTE [influence on sharded ranks])
        self.layout: ParamLayout = getattr(operator, "global_layout", None) or operator.layout  # type: ignore[attr-defined]
        self.tol = tol
        self.max_iter = max_iter
        self._sharded = sharded
        self._grads = PerExampleGradients(model, self.layout, task.per_example_loss, sharded)
        self._inverse: CurvatureOperator | None = None
        self._batches = _CheckedBatches(model, task, sharded)

    def __repr__(self) -> str:
        return (
            f"Influence(curvature={self.curvature!r}, damping={self.damping:.3g}, "
            f"parameters={self.layout.size}, task={self.task!r})"
        )

    # -- the pieces ------------------------------------------------------------------------------
    def gradients(self, batch: Batch) -> torch.Tensor:
        """``∇L`` of each example of ``batch``, rows ``(B, n)`` in ``layout``'s order (sharded
        ranks: whole rows, and a collective call: every rank calls it with a batch)."""
        return self._grads(batch)

    def precondition(self, G: torch.Tensor) -> torch.Tensor:
        """``(C + λI)⁻¹ g`` for each row ``g`` of ``G (k, n)``."""
        if G.shape[0] == 0:
            return G.clone()
        if self.curvature in ("ekfac", "kfac"):
            return self._kronecker_precondition(G.clone())
        result = solve(
            self.operator,
            G.T,
            damping=self.damping,
            method="cg" if self.curvature == "ggn" else "minres",
            tol=self.tol,
            max_iter=self.max_iter,
            progress=False,
        )
        return result.x.T

    def _sliced_gradients(self, batch: Batch, at_once: int | None) -> torch.Tensor:
        B = batch_size(batch)
        if at_once is None or at_once >= B:
            return self.gradients(batch)
        out = torch.empty(B, self.layout.size, dtype=self.layout.dtype, device=self.layout.device)
        for s in range(0, B, at_once):  # NOTE [rows written in place]
            self._grads(map_tensors(batch, example_slice(s, s + at_once)), out[s : s + at_once])
        return out

    def _kronecker_precondition(self, G: torch.Tensor, rows: int = 4) -> torch.Tensor:
        """``G`` overwritten by ``(C + λI)⁻¹ G`` a few rows at a time (the Kronecker inverse
        acts on each row alone): memory of ``G`` plus a few rows, not of two copies of it."""
        inverse = self._kronecker_inverse()
        for s in range(0, G.shape[0], rows):
            G[s : s + rows] = (inverse @ G[s : s + rows].T).T
        return G

    def _kronecker_inverse(self) -> CurvatureOperator:
        """``(C + λI)⁻¹`` of a Kronecker route, made once (sharded ranks: over whole rows, from
        the replicated factors)."""
        if self._inverse is None:
            self._inverse = whole_kronecker(self.operator).inverse(self.damping)  # type: ignore[attr-defined]
        if self._inverse is None:
            raise InternalError("the inverse of a Kronecker operator is None")
        return self._inverse

    def query_gradients(
        self, query_data: Iterable[Batch], *, examples_at_once: int | None = None
    ) -> torch.Tensor:
        """``(C + λI)⁻¹ ∇L(q)`` of every query, rows ``(n_query, n)``. ``examples_at_once``:
        a query batch larger than this goes through the model in slices of that many examples
        (``pairwise_scores`` passes the training batches' size: the activations' memory the
        user chose; ``None``: whole batches)."""
        with _span(self._sharded, "influence.query_gradients"):
            return self._query_gradients(query_data, examples_at_once, last=True)

    def _query_gradients(
        self, query_data: Iterable[Batch], examples_at_once: int | None, *, last: bool
    ) -> torch.Tensor:
        if self._sharded is not None:  # the same slices on every rank
            at_once = examples_at_once or 0
            examples_at_once = self._sharded.smallest(lambda: at_once, "query_data") or None
        rows = [
            self._sliced_gradients(b, examples_at_once)
            for _, b in self._batches(query_data, "query_data", last=last)
        ]
        G = rows[0] if len(rows) == 1 else torch.cat(rows)
        del rows
        if self.curvature in ("ekfac", "kfac") and G.shape[0] > 0:
            return self._kronecker_precondition(G)  # in place: G is ours
        return self.precondition(G)

    # -- scores ----------------------------------------------------------------------------------
    def pairwise_scores(
        self,
        query_data: Iterable[Batch],
        train_data: Iterable[Batch],
        *,
        rank: int | None = None,
        checkpoint: str | os.PathLike[str] | None = None,
        checkpoint_every: int = 1,
        progress: bool | None = None,
    ) -> torch.Tensor:
        """``score(q, z)`` for every query and training example, ``(n_query, n_train)``.

        The query gradients are preconditioned once; the training gradients are streamed batch
        by batch. ``rank``: keep the top-``rank`` singular triplets of each preconditioned query
        gradient's parameter matrices (Kronfluence's low-rank queries: memory ``rank·(m + q)``
        per ``m × q`` weight instead of ``m·q``; vectors stay whole); ``None``: exact. On the
        Kronecker routes the queries are then never held as whole rows ``(n_query, n)``: a slice
        of as many queries as the first training batch goes through one backward, each layer's
        block preconditioned and factored as the backward reaches it, and each training batch
        is scored against the factors layer by layer with no per-example gradient formed
        (NOTE [low-rank queries layer by layer]: memory of one layer's block of a slice plus the
        factors; on sharded ranks and for layers without hooks, from each slice's and batch's
        rows). The exact routes solve for every query at once: whole rows, then factors.
        ``checkpoint``: a file the scores so far are saved to every ``checkpoint_every``
        training batches, and resumed from (bit for bit those of an unbroken run; refused if
        written by another call: other queries, curvature, damping or rank); removed when the
        scores are complete. ``progress``: a bar over the training batches (``None``: on a
        terminal).
        """
        if rank is not None and (not isinstance(rank, int) or isinstance(rank, bool) or rank < 1):
            raise ValueError(f"rank must be an integer >= 1 or None, got {rank!r}")
        if not isinstance(checkpoint_every, int) or checkpoint_every < 1:
            raise ValueError(f"checkpoint_every must be an integer >= 1, got {checkpoint_every!r}")
        with _span(self._sharded, "influence.pairwise_scores"):
            return self._pairwise_scores(
                query_data, train_data, rank, checkpoint, checkpoint_every, progress
            )

    def _pairwise_scores(
        self,
        query_data: Iterable[Batch],
        train_data: Iterable[Batch],
        rank: int | None,
        checkpoint: str | os.PathLike[str] | None,
        checkpoint_every: int,
        progress: bool | None,
    ) -> torch.Tensor:
        # before the queries' work: an empty set says so now
        at_once = max(1, _first_size(train_data, self._sharded))
        Q: torch.Tensor | None = None
        scorer: LowRank | None = None
        if rank is not None and streams_queries(self.curvature, self.operator, self._sharded):
            # NOTE [low-rank queries layer by layer]: never the whole rows (n_query, n)
            scorer = self._low_rank_queries(query_data, at_once, rank)
        else:
            Q = self._query_gradients(query_data, at_once, last=False)
            if rank is not None:
                scorer = LowRank.of_rows(Q, self.layout, rank)
                Q = None  # the factors replace the rows
        saved = _ScoresCheckpoint(
            checkpoint,
            lambda: scorer.fingerprint() if scorer is not None else _fingerprint(_held(Q)),
            curvature=self.curvature,
            damping=self.damping,
            rank=rank,
            n_query=scorer.n_query if scorer is not None else int(_held(Q).shape[0]),
            parameters=list(self.layout.names),
        )
        done, blocks = saved.resume()
        if self._sharded is not None:  # the ranks skip the same batches: FSDP's collectives
            self._sharded.same(done, "the training batches their checkpoints hold")
        with progress_bar(_length(train_data), "influence scores", progress) as bar:
            bar.update(done)
            for i, batch in self._batches(train_data, "train_data", last=True):
                if i < done:
                    continue
                if scorer is not None:  # NOTE [low-rank queries layer by layer]
                    blocks.append(-scorer.scores(self._grads, batch))
                else:  # NOTE [scores layer by layer]: no rows of the batch held at once
                    blocks.append(-self._grads.dots(batch, _held(Q)))
                bar.update(1)
                if saved.path is not None and (i + 1 - done) % checkpoint_every == 0:
                    blocks = [saved.save(i + 1, blocks)]
        return saved.done(blocks)

    def _low_rank_queries(
        self, query_data: Iterable[Batch], examples_at_once: int, rank: int
    ) -> LowRank:
        """The preconditioned query gradients as rank-``rank`` factors, slice by slice of
        ``examples_at_once`` queries (NOTE [low-rank queries layer by layer] in
        ``influence.low_rank``)."""
        step: int | None = examples_at_once
        layers: QueryFactors | None = None
        if self._sharded is not None:  # the same slices on every rank, as _query_gradients
            step = self._sharded.smallest(lambda: examples_at_once, "query_data") or None
        else:
            self._kronecker_inverse()  # the rows' inverse: the same refusal of a singular one
            layers = QueryFactors(self.operator, self.layout, self.damping, self._grads)
        batches = (b for _, b in self._batches(query_data, "query_data", last=False))
        rows = lambda piece: self._kronecker_precondition(self.gradients(piece))  # noqa: E731
        return QueryFactors.joined(self.layout, batches, step, rank, layers, rows)

    def self_influence(
        self, train_data: Iterable[Batch], *, progress: bool | None = None
    ) -> torch.Tensor:
        """``score(z, z) = −∇L(z)ᵀ (C + λI)⁻¹ ∇L(z)`` for every training example, ``(n_train,)``
        (never positive: ``C + λI`` is positive definite on the GGN and Kronecker routes)."""
        ranks = getattr(self.operator, "ranks", None)
        if self.curvature in ("ggn", "hessian") and ranks is not None and ranks.distributed:
            raise ValueError(
                f"self_influence on several ranks runs on the Kronecker routes: curvature="
                f"{self.curvature!r} solves one system per training example, and each rank's "
                "examples differ while its products are collective"
            )
        out: list[torch.Tensor] = []
        with (
            _span(self._sharded, "influence.self_influence"),
            progress_bar(_length(train_data), "self-influence", progress) as bar,
        ):
            for _, batch in self._batches(train_data, "train_data", last=True):
                G = self.gradients(batch)
                out.append(-(self.precondition(G) * G).sum(1))
                bar.update(1)
        return torch.cat(out)

    def token_scores(
        self,
        query_data: Iterable[Batch],
        train_data: Iterable[Batch],
        *,
        progress: bool | None = None,
    ) -> torch.Tensor:
        """Each training position's share of the pairwise scores, ``(n_query, n_train,
        positions)``: ``−Σ_layers ⟨(C + λI)⁻¹∇L(q), g_t a_tᵀ⟩`` for the input position ``t`` of
        a training sequence (``a_t`` a layer's input there, ``g_t`` the sequence loss's gradient
        at the layer's output there), so the positions of an example sum to its
        :meth:`pairwise_scores` entry (NOTE [per-example gradients of linear layers]). Needs the
        scored parameters to be ``nn.Linear`` / ``Conv1D`` weights and biases (the Kronecker
        routes' default selection) and every training batch of one length."""
        with _span(self._sharded, "influence.token_scores"):
            return self._token_scores(query_data, train_data, progress)

    def _token_scores(
        self, query_data: Iterable[Batch], train_data: Iterable[Batch], progress: bool | None
    ) -> torch.Tensor:
        at_once = max(1, _first_size(train_data, self._sharded))
        Q = self._query_gradients(query_data, at_once, last=False)
        out: list[torch.Tensor] = []
        with progress_bar(_length(train_data), "influence token scores", progress) as bar:
            for i, batch in self._batches(train_data, "train_data", last=True):
                if not self._grads.linear_checked:
                    self.gradients(batch)  # the first batch's check of the hooked path
                scores = position_scores(self._grads, batch, Q)
                if scores is None:
                    raise ValueError(
                        "token_scores needs every scored parameter to be the weight or bias of an "
                        "nn.Linear / Conv1D layer called once per forward, and examples that do "
                        "not meet in the forward (the Kronecker routes' default selection; pass "
                        "param_filter= selecting such layers)"
                    )
                if out and scores.shape[2] != out[0].shape[2]:
                    raise ValueError(
                        f"token_scores: train_data batch {i} has {scores.shape[2]} positions, the "
                        f"first {out[0].shape[2]}; pad every batch to one length"
                    )
                out.append(-scores)
                bar.update(1)
        return torch.cat(out, dim=1)


class _ScoresCheckpoint:
    """The file ``pairwise_scores`` saves its scores so far to (``checkpoint``; None: no file),
    refused when written by another call (``config``). ``queries``: the queries' fingerprint,
    hashed only for a file (it reads every byte of the queries on the host)."""

    def __init__(
        self, checkpoint: str | os.PathLike[str] | None, queries: Callable[[], str], **config: Any
    ) -> None:
        self.path = checkpoint_path(checkpoint)
        self.config = {**config, "queries": queries() if self.path is not None else None}
        self.gen = torch.Generator()  # the checkpoint format's; nothing here is random

    def resume(self) -> tuple[int, list[torch.Tensor]]:
        """The training batches done and their scores (none without a file)."""
        if self.path is None or not self.path.exists():
            return 0, []
        state = load_checkpoint(self.path, "influence.pairwise_scores", self.config, self.gen)
        return int(state["batches"]), [state["scores"]]

    def save(self, batches: int, blocks: list[torch.Tensor]) -> torch.Tensor:
        """The scores so far as one block, saved."""
        so_far = torch.cat(blocks, dim=1)
        state = {"batches": batches, "scores": so_far.clone()}
        if self.path is not None:
            save_checkpoint(self.path, "influence.pairwise_scores", self.config, state, self.gen)
        return so_far

    def done(self, blocks: list[torch.Tensor]) -> torch.Tensor:
        """All the scores; the file removed."""
        scores = torch.cat(blocks, dim=1)
        if self.path is not None:
            remove_checkpoint(self.path)
        return scores


class _CheckedBatches:
    """``(i, batch)`` of a user's data, each checked by the task; on sharded ranks read in step
    (``last``: the end of the caller's loop is its last agreement)."""

    def __init__(
        self, model: nn.Module, task: InfluenceTask, sharded: ShardedScoring | None
    ) -> None:
        self.model, self.task, self.sharded = model, task, sharded

    def __call__(
        self, data: Iterable[Batch], what: str, *, last: bool = False
    ) -> Iterator[tuple[int, Batch]]:
        def start() -> Iterator[Batch]:
            _first_batch(data, what)  # an iterable of batches, not one batch; not empty
            _refuse_training_mode(self.model)
            return iter(data)

        def check(i: int, batch: Batch) -> None:
            self.task.check_batch(self.model, batch, f"{what} batch {i}")

        if self.sharded is not None:
            same = what == "query_data"
            yield from self.sharded.batches(start, what, check, same=same, last=last)
            return
        for i, batch in enumerate(start()):
            check(i, batch)
            yield i, batch


def _span(sharded: ShardedScoring | None, what: str) -> contextlib.AbstractContextManager[None]:
    """A scoring call on sharded ranks (a rank failing between agreements raises on all)."""
    return contextlib.nullcontext() if sharded is None else sharded.span(what)


def _first_size(train_data: Iterable[Batch], sharded: ShardedScoring | None) -> int:
    """The first training batch's size (sharded ranks: the smallest over the ranks, so that
    query batches go through the model in the same slices on every rank)."""

    def size() -> int:
        return batch_size(_first_batch(train_data, "train_data"))

    return size() if sharded is None else sharded.smallest(size, "reading train_data")


def _length(data: Iterable[Batch]) -> int | None:
    try:
        return len(data)  # type: ignore[arg-type]
    except TypeError:
        return None


def _fingerprint(Q: torch.Tensor, rows_per_read: int = 4) -> str:
    """A hash of the preconditioned query gradients' bytes (in their own dtype, with it and the
    shape): a checkpoint belongs to one set. Read a few rows at a time (host memory of a few
    rows, not a float64 copy of all: 16 GPT-2 queries are 5 GB in float32)."""
    digest = hashlib.blake2b(f"{Q.dtype}{tuple(Q.shape)}".encode(), digest_size=16)
    flat = Q.detach().reshape(Q.shape[0], -1)
    for s in range(0, flat.shape[0], rows_per_read):
        rows = flat[s : s + rows_per_read].to("cpu").contiguous()
        digest.update(rows.view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def _held(Q: torch.Tensor | None) -> torch.Tensor:
    if Q is None:
        raise InternalError("the queries' rows are held when no factors are")
    return Q
