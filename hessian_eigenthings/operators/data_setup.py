"""What every data operator is built with: its options, their validation, its collaborators.

:class:`DataOperatorSetup` (the base of ``base.DataCurvatureOperator``) selects and binds the
parameters, reads the options (:class:`DataOptions`), and builds the collaborators each option
configures, giving each what it uses: the model guard, the kept states (NOTE [graph reuse]), the
CUDA-graph recorder and the engine selector (which runner computes the per-batch products). It
also declares the hooks a curvature implements (``_prepare`` / ``_apply`` for the autograd
runner, ``functional_product`` for the traced ones). The data loop itself is ``base``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import functools
import inspect
import re
import sys
from collections.abc import Callable, Iterable, Iterator, Sequence, Sized
from typing import Any, Literal, TypedDict, get_args, get_origin

import torch
from torch import nn
from typing_extensions import Unpack, is_typeddict

from hessian_eigenthings._checks import check_count
from hessian_eigenthings.batching import (
    Batch,
    BatchSource,
    check_microbatching,
)
from hessian_eigenthings.linalg import LinAlgBackend
from hessian_eigenthings.loss_fns.standard import check_first_targets, target_check
from hessian_eigenthings.operators.cuda_graphs import GraphRecorder
from hessian_eigenthings.operators.empty_batches import EmptyBatches
from hessian_eigenthings.operators.engines.auto import EngineSelector
from hessian_eigenthings.operators.engines.layer_checks import find_layers
from hessian_eigenthings.operators.engines.runner import (
    ENGINES,
    CountField,
    EngineName,
    ProductCounts,
    unsupported,
)
from hessian_eigenthings.operators.graph_reuse import StateCache
from hessian_eigenthings.operators.model_guard import ModelGuard
from hessian_eigenthings.operators.parameter_binding import ParameterBinding
from hessian_eigenthings.operators.precision import (
    ProductPrecision,
    Upcast,
    check_product_precision,
    product_dtype,
)
from hessian_eigenthings.operators.protocol import CurvatureOperator
from hessian_eigenthings.operators.ranks import LOCAL, Ranks
from hessian_eigenthings.param_utils import ParamFilter, ParamLayout, select_parameters

__all__ = ["DataOperatorSetup", "DataOptions", "Reuse", "options_signature", "unexpected_keyword"]

Reuse = bool | Literal["auto"]


class DataOptions(TypedDict, total=False):
    """The keywords every data operator takes (``**options``), the one record its constructors
    pass on: which parameters (``param_filter``, default ``None``: every trainable one), the data
    (``full_dataset=True``, ``num_batches=None``, ``microbatch_size=None``,
    ``microbatch_unsafe=False``), blocks (``max_block_size=None``, ``block_memory_budget=None``),
    kept states (``graph_reuse="auto"``, ``graph_reuse_max_batches=4``,
    ``graph_memory_budget=None``), ``cuda_graphs=True``, the engine (``engine="auto"``,
    ``layers=None``), ``precision="fp32"`` (``"tf32"``, ``"model"``), the vector ``backend`` (``None``: the single-device
    one) and the ``ranks`` products span (``None``: this process). What each does:
    :class:`~hessian_eigenthings.operators.base.DataCurvatureOperator`."""

    param_filter: ParamFilter | str | Sequence[str] | None
    full_dataset: bool
    num_batches: int | None
    microbatch_size: int | None
    microbatch_unsafe: bool
    max_block_size: int | None
    block_memory_budget: int | None
    graph_reuse: Reuse
    graph_reuse_max_batches: int
    graph_memory_budget: int | None
    cuda_graphs: bool
    engine: EngineName
    precision: ProductPrecision
    layers: str | Sequence[nn.Module] | None
    backend: LinAlgBackend | None
    ranks: Ranks | None


def unexpected_keyword(cls: type, name: str, owner: type | None = None) -> TypeError:
    """``Cls() got an unexpected keyword argument 'name'; did you mean ...?`` for the class the
    user called: the keywords of its ``__init__`` and of those its ``**options`` reach, up to
    ``owner`` (the class whose ``__init__`` took the unknown keyword; default the data operators'
    base, whose options are ``DataOptions``)."""
    accepted: set[str] = set(DataOptions.__annotations__) if owner is None else set()
    for klass in cls.__mro__:
        init = vars(klass).get("__init__")
        if init is None:
            continue
        params = inspect.signature(init).parameters.values()
        accepted.update(
            p.name
            for p in params
            if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.name != "self"
        )
        if klass is (owner or DataOperatorSetup) or not any(
            p.kind is p.VAR_KEYWORD for p in params
        ):
            break
    close = difflib.get_close_matches(name, sorted(accepted), n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    return TypeError(f"{cls.__name__}() got an unexpected keyword argument {name!r}{hint}")


# NOTE [signatures with options]
# A constructor takes the shared keywords as one record, `**options: Unpack[DataOptions]` (or a
# record that extends it), and passes it on whole: no constructor lists them again. So that
# inspect.signature, help() and the "did you mean" of `unexpected_keyword` still see every
# argument, the constructor's `__signature__` writes the record out: its fields as keyword-only
# parameters after the constructor's own, each with the annotation and default of the first
# constructor that takes it by name, up the class's MRO (for `DataOptions`: the base's). The
# record is found by name in the constructor's module (`Unpack[Name]`, under postponed
# annotations) and must be defined or imported before the class.
def options_signature(init: Callable[..., Any], takers: Sequence[type]) -> inspect.Signature | None:
    """``init``'s signature with its ``**options: Unpack[Record]`` written out, the defaults from
    the constructors of ``takers`` (NOTE [signatures with options]); ``None`` when it takes no
    record."""
    sig = inspect.signature(init)
    *own, last = sig.parameters.values()
    if last.kind is not last.VAR_KEYWORD:
        return None
    annotation = last.annotation
    if isinstance(annotation, str):
        match = re.fullmatch(r"Unpack\[(\w+)\]", annotation.replace(" ", ""))
        module = sys.modules.get(getattr(init, "__module__", ""))
        record = getattr(module, match.group(1), None) if match else None
    else:
        args = get_args(annotation) if get_origin(annotation) is Unpack else ()
        record = args[0] if args else None
    if not is_typeddict(record):
        return None
    names = {p.name for p in own}
    extra = []
    for name in record.__annotations__:
        taker = None if name in names else _taker(takers, name)
        if taker is not None:
            extra.append(taker.replace(kind=inspect.Parameter.KEYWORD_ONLY))
    return sig.replace(parameters=[*own, *extra])


def _taker(takers: Sequence[type], name: str) -> inspect.Parameter | None:
    """The parameter ``name`` of the first constructor of ``takers`` that takes it by name."""
    for klass in takers:
        init = vars(klass).get("__init__")
        if init is None:
            continue
        param = inspect.signature(init).parameters.get(name)
        if param is not None and param.kind in (param.POSITIONAL_OR_KEYWORD, param.KEYWORD_ONLY):
            return param
    return None


# NOTE [checks after construction]
# Some checks need the whole construction: the first-batch check of the targets (NOTE [targets
# checked against the criterion] in loss_fns.standard) needs the loss callables, which a
# curvature may store after calling the base constructor (the how-to's own curvature does), and
# the ranks finish setting the operator up (a sharded one cuts its layout to the rank's shards
# and walks the layers its thin constructor sets last). So every subclass's __init__ is wrapped
# (`__init_subclass__`): when the outermost constructor returns, or fails, the ranks agree that
# each built the operator (or raise together), then `_constructed` runs the checks on the first
# batch the construction read (the source keeps it until then: the loader is iterated once for
# all the construction's checks). `_constructing` tells the outermost constructor from those it
# calls.
def then_constructed(
    init: Callable[..., None], signature: inspect.Signature | None
) -> Callable[..., None]:
    """``init`` followed, for the outermost constructor, by the ranks' agreement and
    ``_constructed`` (NOTE [checks after construction]); shown with ``signature``."""

    @functools.wraps(init)
    def __init__(self: DataOperatorSetup, *args: Any, **kw: Any) -> None:
        outermost = not self._constructing
        self._constructing = True
        failure: Exception | None = None
        try:
            init(self, *args, **kw)
        except Exception as exc:
            if not outermost:
                raise
            failure = exc
        finally:
            if outermost:
                del self._constructing  # the class's False again
        if outermost:
            # a thin constructor (DDPHessianOperator) sets the ranks before the curvature's own
            (kw.get("ranks") or self.ranks).constructed(self, failure)
            self._constructed()

    setattr(__init__, "_then_constructed", True)  # noqa: B010 (not an attribute of a function type)
    if signature is not None:
        setattr(__init__, "__signature__", signature)  # noqa: B010 (read by inspect)
    return __init__


def check_engine(
    cls: type, model: nn.Module, engine: object, layers: str | Sequence[nn.Module] | None
) -> None:
    """Refuse now (not at the first product) an ``engine=`` / ``layers=`` pair that ``cls``
    cannot run; a wrong ``layers=`` path fails here."""
    if engine not in ENGINES:
        raise ValueError(f"engine must be one of {ENGINES}, got {engine!r}")
    if (engine == "layers") != (layers is not None):
        raise ValueError(
            "engine='layers' walks the layers that layers= names (a dotted path to the model's "
            "module list, e.g. 'transformer.h', or the modules), and layers= applies to it only; "
            f"got engine={engine!r}, layers={layers!r}"
        )
    if engine == "layers" and not hasattr(cls, "layer_walk_runner"):
        raise unsupported("layers", cls.__name__, "it has no layer walk")
    if layers is not None:
        find_layers(model, layers)


def check_switches(graph_reuse: object, cuda_graphs: object) -> None:
    """Refuse a ``graph_reuse=`` or ``cuda_graphs=`` that is not one of their values."""
    if graph_reuse not in (True, False, "auto"):
        raise ValueError(f"graph_reuse must be True, False or 'auto', got {graph_reuse!r}")
    if not isinstance(cuda_graphs, bool):
        raise TypeError(f"cuda_graphs must be True or False, got {cuda_graphs!r}")


def cycled(source: BatchSource, graph_reuse: Reuse) -> bool:
    """Whether ``graph_reuse="auto"`` keeps nothing because every product takes the next batch of
    several (``full_dataset=False`` over a loader of more than one batch, or of unknown length)."""
    if graph_reuse != "auto" or source.full_dataset:
        return False
    try:
        return not isinstance(source.dataloader, Sized) or len(source.dataloader) != 1
    except TypeError:
        return True


class DataOperatorSetup(CurvatureOperator):
    """Construction of a data operator (the base of ``base.DataCurvatureOperator``, whose
    docstring lists the options, the capabilities and the hooks): validation, parameter
    selection and binding, the collaborators each option configures, and the engine selector,
    built here from the capabilities the curvature declared before calling this constructor."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        init = vars(cls).get("__init__")
        if init is not None and not getattr(init, "_then_constructed", False):
            wrapped = then_constructed(init, options_signature(init, cls.__mro__[1:]))
            setattr(cls, "__init__", wrapped)  # noqa: B010 (mypy refuses assigning a method)

    #: True while a constructor runs (NOTE [checks after construction])
    _constructing: bool = False
    #: the processes products span (NOTE [rank agreement] in ``ranks``): one by default
    ranks: Ranks = LOCAL
    #: the attributes that hold the loss callables of the curvatures (checked once built)
    _loss_attributes = ("loss_fn", "forward_fn", "loss_of_output_fn", "per_sample_loss_fn")

    def _constructed(self) -> None:
        """Checks that need the whole construction (NOTE [checks after construction])."""
        try:
            fns = [getattr(self, name, None) for name in self._loss_attributes]
            if any(target_check(fn) is not None for fn in fns):
                check_first_targets(self.source.first_batch(), *fns)
        finally:
            self.source.release_first()

    # -- capabilities: class attributes, or set by the curvature before this constructor, which
    # builds the engine selector from them (see DataCurvatureOperator)
    #: ``_apply`` may run several times on one state (kept states, NOTE [graph reuse]).
    supports_graph_reuse: bool = False
    #: products need a double backward.
    needs_double_backward: bool = True
    #: ``_apply`` on a kept state can be recorded as a CUDA graph.
    supports_cuda_graphs: bool = False
    #: the curvature defines ``functional_product`` (engines other than autograd).
    supports_functional: bool = False
    #: ``"size"``: batches weighted by their sample count (``Σ bᵢ·Pᵢ / Σ bᵢ``);
    #: ``"uniform"``: every batch weighs the same (the 0.x facade). See NOTE [batch weighting].
    batch_weighting: Literal["size", "uniform"] = "size"

    def __init__(
        self,
        model: nn.Module,
        dataloader: Iterable[Batch],
        *,
        param_filter: ParamFilter | str | Sequence[str] | None = None,
        full_dataset: bool = True,
        num_batches: int | None = None,
        microbatch_size: int | None = None,
        microbatch_unsafe: bool = False,
        max_block_size: int | None = None,
        block_memory_budget: int | None = None,
        graph_reuse: Reuse = "auto",
        graph_reuse_max_batches: int = 4,
        graph_memory_budget: int | None = None,
        cuda_graphs: bool = True,
        engine: EngineName = "auto",
        precision: ProductPrecision = "fp32",
        layers: str | Sequence[nn.Module] | None = None,
        backend: LinAlgBackend | None = None,
        ranks: Ranks | None = None,
        **unknown: object,
    ) -> None:
        self.ranks = ranks or LOCAL
        if unknown:
            # a misspelt option reaches this base through the subclass's **options: name the
            # class the user called, not this one
            raise unexpected_keyword(type(self), next(iter(unknown)))
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        self.ranks.check_model(model, type(self).__name__)
        self.microbatch_size = check_count("microbatch_size", microbatch_size, allow_none=True)
        self.max_block_size = check_count("max_block_size", max_block_size, allow_none=True)
        self.graph_reuse_max_batches = check_count(
            "graph_reuse_max_batches", graph_reuse_max_batches, minimum=0
        )
        check_switches(graph_reuse, cuda_graphs)
        check_microbatching(model, self.microbatch_size, microbatch_unsafe)
        self.model = model
        self.named_params = list(select_parameters(model, param_filter).items())
        self.params = [p for _, p in self.named_params]
        self.layout = ParamLayout.from_named(self.named_params)
        self._binding = ParameterBinding(
            model, self.named_params, self.layout.offsets, type(self).__name__
        )
        self.precision = check_product_precision(precision)
        #: the dtype of the parameters' values as the user holds them; products and vectors are
        #: in ``dtype`` (float32 for a half model under the default, NOTE [half models])
        self.param_dtype = self.layout.dtype
        if product_dtype(self.param_dtype, self.precision) != self.param_dtype:
            self.layout = dataclasses.replace(
                self.layout, dtype=product_dtype(self.param_dtype, self.precision)
            )
        self._empty = EmptyBatches(type(self).__name__)
        self._size = self.layout.size
        self._device = self.layout.device
        self._dtype = self.layout.dtype
        self.source = BatchSource(dataloader, full_dataset=full_dataset, num_batches=num_batches)
        self.source.keep_first = True  # released by _constructed (NOTE [checks after construction])
        self.microbatch_unsafe = microbatch_unsafe
        self.block_memory_budget = block_memory_budget
        self.graph_reuse: Reuse = graph_reuse if self.ranks.keeps_states else False
        self.graph_memory_budget = graph_memory_budget
        self.cuda_graphs = cuda_graphs
        self.backend = self.ranks.backend(backend)
        check_engine(type(self), model, engine, layers)
        #: the layers ``engine="layers"`` walks (NOTE [layer walk])
        self.layers = layers
        self._engine_name = engine
        #: passes over the data (one per batch chunk), forward passes, replayed products: cost checks
        self.counts = ProductCounts()
        self._collaborators()
        self._per_vector_bytes: float | None = None
        #: widest block that fit after an out-of-memory retry (NOTE [block out of memory])
        self._oom_block_limit: int | None = None
        self.chunk_position = 0
        #: which runner computes the per-batch products (``using_engine`` swaps it for a block)
        self._engine_selector = EngineSelector(self, engine)

    @property
    def rank(self) -> int:
        """This process's rank among the operator's ranks (0 on one process)."""
        return self.ranks.rank

    @property
    def world_size(self) -> int:
        return self.ranks.world_size

    @property
    def process_group(self) -> Any:
        """The ranks' process group (``None`` on one process)."""
        return self.ranks.group

    @property
    def auto_trials(self) -> bool:
        """Whether ``engine="auto"`` may time engines (not across ranks: they must agree)."""
        return self.ranks.auto_trials

    num_passes = CountField("passes")
    num_forwards = CountField("forwards")
    num_replays = CountField("replays")

    def _collaborators(self) -> None:
        """The model guard, kept states (NOTE [graph reuse]) and CUDA-graph recordings, for the
        parameters bound now; a batch cycled on every product (``full_dataset=False`` over more
        than one batch) is not kept under ``graph_reuse="auto"``."""
        self.guard = ModelGuard(self.model, self.params)
        #: the float32 copies a half model's products run on (NOTE [half models]); ranks that
        #: gather the parameters (FSDP2) cast each gathered block instead
        self._upcast: Upcast | None = None
        if self._dtype != self.param_dtype and not self.ranks.gathers_parameters:
            self._upcast = Upcast(self.guard.modules, self.params, self._dtype)
        self.guard.upcast = self._upcast
        self._states = StateCache(
            self.guard.modules,
            self._device,
            max_batches=self.graph_reuse_max_batches,
            memory_budget=self.graph_memory_budget,
            keep=not cycled(self.source, self.graph_reuse),
        )
        self.recorder = GraphRecorder(
            self._device,
            self.params,
            self.guard,
            self._states,
            self.counts,
            max_recorded=self.graph_reuse_max_batches,
            owner=type(self).__name__,
        )

    @property
    def _engines(self) -> EngineSelector:
        """The engine selector products use now (built by the constructor)."""
        return self._engine_selector

    def functional_unsupported_reason(self) -> str:
        return f"{type(self).__name__} defines no functional product"

    def functional_product(
        self, state: dict[str, torch.Tensor], batch: Batch, tangent: list[torch.Tensor]
    ) -> list[torch.Tensor]:
        """The per-batch product for one direction as a pure function (see ``operators.engines``)."""
        raise NotImplementedError

    def inconsistency_causes(self) -> list[str]:
        causes = super().inconsistency_causes()
        random = self.guard.random_cause()
        if random:
            causes.append(random)
        if not self.source.full_dataset:
            causes.append("full_dataset=False takes another batch for every product")
        if self.precision == "tf32":
            causes.append("precision='tf32' runs products with TF32 (about 1e-3 relative error)")
        return causes

    @property
    def engine(self) -> str:
        """The engine running products now (``"auto"`` resolves to one after its measurement)."""
        return self._engine_selector.active

    @property
    def engine_report(self) -> dict[str, Any]:
        """The engine, ``auto``'s choice with its timings, traces and compilations."""
        return self._engine_selector.report()

    @contextlib.contextmanager
    def using_engine(self, engine: EngineName) -> Iterator[None]:
        """Products on ``engine`` inside the ``with`` block, then this operator's own engine again,
        with what ``auto`` had decided. Kept states belong to one engine: they are dropped on the
        way in and out. An engine the operator cannot run raises ``EngineUnsupportedError`` on entry."""
        if engine not in ENGINES:
            raise ValueError(f"engine must be one of {ENGINES}, got {engine!r}")
        if engine == "layers" and self.layers is None:
            raise unsupported(
                "layers",
                type(self).__name__,
                "it was built without layers=; build it with engine='layers', layers=<the path to "
                "its module list of blocks>",
            )
        own = self._engine_selector
        self.clear_cache()
        made = self.counts.products
        self._engine_selector = EngineSelector(self, engine)
        try:
            yield
        finally:
            self.clear_cache()
            own.discount(self.counts.products - made)  # not products of its run
            self._engine_selector = own

    def expect_products(self, n: int) -> None:
        """Declare how many products are coming (algorithms pass their budget): ``engine="auto"``
        traces or compiles only when that many products pay for it. Kept states whose parameters
        changed without a version bump are dropped here (NOTE [updates that keep the version])."""
        self._follow_parameters()
        self._states.drop_changed()
        self._engine_selector.expect(n)

    # -- hooks for subclasses -------------------------------------------------
    def _prepare(self, batch: Batch) -> Any:
        """Forward (and first-order graph) on one batch; returns the state. A hook may take a
        second argument, ``params``: tensors standing in for the selected parameters in the graph
        it builds (``None``: the parameters themselves; see NOTE [CUDA graphs])."""
        raise NotImplementedError

    def _apply(
        self, state: Any, vecs: list[torch.Tensor], retain: bool
    ) -> Sequence[torch.Tensor | None]:
        """Per-batch product of the mean-loss curvature with a block.

        ``vecs[i]`` has shape ``(k, *shape_i)``. Return one ``(k, *shape_i)``
        tensor per parameter (``None`` for an exact zero). ``retain``: keep
        the graph of ``state`` alive for another call.
        """
        raise NotImplementedError

    def _engine_batch(self, batch: Batch) -> Batch:
        """The batch a traced engine's product receives (the batch, or the batch with per-chunk inputs)."""
        return batch

    @property
    def held_bytes(self) -> int:
        """Device bytes held between products: kept graphs, CUDA-graph pools (0 on the CPU), and
        the float32 copies of a half model's tensors (NOTE [half models])."""
        copies = 0 if self._upcast is None else self._upcast.nbytes
        return self._states.nbytes + copies

    def clear_cache(self) -> None:
        """Drop kept graphs, recorded products and a half model's float32 copies (they are
        dropped or refreshed automatically when stale)."""
        self._states.clear()
        self.recorder.clear()
        if self._upcast is not None:
            self._upcast.clear()

    def _follow_parameters(self) -> None:
        """NOTE [replaced parameters]: drop what was keyed on replaced tensors (states, recordings,
        programs); the selector is built again for the new parameters, on the engine it ran."""
        if (named := self._binding.follow()) is not None:
            self.named_params, self.params = named, [p for _, p in named]
            self._collaborators()
            self._engine_selector = EngineSelector(self, self._engine_selector.requested)
