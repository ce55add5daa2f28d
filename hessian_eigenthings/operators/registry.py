"""One table of the curvatures the library knows: what reads it, and how to add a row.

Each :class:`Curvature` row names an operator class and says what the rest of
the package needs to know about it without importing it:

- ``hessian_eigenthings.memory.estimate_memory(operator=name, method=...)``
  reads :attr:`Curvature.memory` (NOTE [memory factors] in ``memory``);
- the command line offers every row as ``--operator name`` and builds it with
  :attr:`Curvature.build` from ``(model, dataloader, criterion)`` (a builder of
  ``operators.builders``, one per kind of loss argument, for the built-in rows);
  ``--method`` offers the union of the rows' :attr:`Curvature.methods`;
- ``hessian_eigenthings.operators`` and the top level export every row's class
  by name, from the row (NOTE [exports from the registry]);
  ``tests/operators/test_registry.py`` checks every row for them.

A row has no distributed twins: any data operator runs over several processes when given
``ranks=`` (``operators.ranks``, DESIGN §8); the ``DDP*``/``FSDP*`` names of
``operators.distributed`` are constructors that build those ranks for the shipped curvatures.

A new curvature is one module with a :class:`DataCurvatureOperator` subclass
plus one :func:`register` call (docs/howto/new-curvature.md). A row with
``factored=True`` names an operator that reads the data only while it is built
(Kronecker factors: KFAC, EKFAC, KFOC): a plain ``CurvatureOperator`` whose
products never touch the data, so its memory factors describe the pass that
builds it and a product's vectors (NOTE [memory factors] in ``memory``). The table is data
and lookups: the operator classes are named by import path and imported on
first use, so ``memory`` (which the algorithms import) reads the table
without importing an operator module; an import-linter contract in
``pyproject.toml`` keeps it that way.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

__all__ = [
    "BUILTIN",
    "CLIBuilder",
    "Curvature",
    "MemoryFactors",
    "curvature",
    "curvatures",
    "export_into",
    "exported_class",
    "exported_names",
    "names",
    "register",
    "unregister",
]

Criterion = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
#: ``build(cls, model, dataloader, criterion, options) -> operator``: how the command line makes
#: the operator from a model, a dataloader of ``(inputs, targets)`` and a criterion
#: ``criterion(model(inputs), targets) -> mean loss`` (the 0.x contract). ``options`` holds
#: ``num_batches``, ``microbatch_size`` and, for rows with :attr:`Curvature.methods`, ``method``.
#: A ``ValueError`` it raises is shown by the command line as a usage error.
CLIBuilder = Callable[[type, nn.Module, Iterable[Any], Criterion, Mapping[str, Any]], Any]


@dataclass(frozen=True)
class MemoryFactors:
    """What one product on a block of ``k`` vectors adds to the resident model, in units of
    ``A`` (activation bytes of one gradient step) and ``P`` (bytes of the selected parameters):
    ``(first_pass + per_vector · k) · A + (2k + extra_vectors) · P``. See NOTE [memory factors]."""

    first_pass: float  # × A once per block pass (the forward's saved activations, kept graphs)
    per_vector: float  # × A for each vector of the block (tangents, batched backward temporaries)
    extra_vectors: int  # × P beyond the block's input and output (gradients, saved parameters)
    label: str  # what a product runs, shown as MemoryEstimate.method


@dataclass(frozen=True)
class Curvature:
    """One curvature: its operator, how the command line builds it, its memory factors."""

    name: str  # key of estimate_memory(operator=...) and the CLI's --operator
    #: the DataCurvatureOperator subclass (a CurvatureOperator when factored), or
    #: "package.module:Class"
    operator: str | type
    title: str  # how output names it, e.g. "generalized Gauss-Newton (GGN)"
    description: str  # one line: what it is, for --help and the docs
    #: how the command line builds it: a :data:`CLIBuilder` or the import path
    #: "package.module:function" of one; ``hessian_eigenthings.operators.builders`` has one per
    #: kind of loss argument (a mean loss, the output's loss, per-sample losses, Kronecker factors)
    build: str | CLIBuilder
    #: one entry per method when ``methods`` is given (same order), else exactly one
    memory: tuple[MemoryFactors, ...]
    #: values of the operator's ``method=`` argument, the default first; () when it has none
    methods: tuple[str, ...] = ()
    #: the operator reads the data once, when built, and keeps factors (a ``CurvatureOperator``,
    #: not a ``DataCurvatureOperator``): ``memory`` then holds the building pass's activations
    #: (``first_pass``; ``per_vector`` 0, products touch no activations) and the kept factors
    #: and a product's temporaries (``extra_vectors``)
    factored: bool = False

    def __post_init__(self) -> None:
        if not self.name.isidentifier() or not self.name.islower():
            raise ValueError(
                f"Curvature.name must be a lower-case identifier (it is a CLI choice), got {self.name!r}"
            )
        expected = len(self.methods) or 1
        if len(self.memory) != expected:
            raise ValueError(
                f"curvature {self.name!r}: memory needs {expected} MemoryFactors "
                f"({'one per method ' + repr(self.methods) if self.methods else 'one'}), got {len(self.memory)}"
            )
        labels = [f.label for f in self.memory]
        if len(set(labels)) != len(labels):
            # MemoryEstimate.method holds the label; memory's suggestions find the factors by it
            raise ValueError(
                f"curvature {self.name!r}: MemoryFactors labels must differ, got {labels}"
            )

    def operator_class(self) -> type:
        """The operator class (imported on first use when given as an import path)."""
        cls = _resolve(self.operator)
        if not isinstance(cls, type):
            raise TypeError(f"curvature {self.name!r}: operator {self.operator!r} is not a class")
        return cls

    def builder(self) -> CLIBuilder:
        """The command line's builder (imported on first use when given as an import path)."""
        return _resolve(self.build)

    def class_names(self) -> tuple[str, ...]:
        """The names its operator is exported under (nothing imported)."""
        return (_name_of(self.operator),)

    def memory_factors(self, method: str | None = None) -> MemoryFactors:
        """The factors of ``method`` (default: the first); rows without methods have one set."""
        if not self.methods or method is None:
            return self.memory[0]
        if method not in self.methods:
            raise ValueError(
                f"method must be one of {self.methods} for curvature {self.name!r}, got {method!r}"
            )
        return self.memory[self.methods.index(method)]


def _resolve(ref: Any) -> Any:
    """``ref`` itself, or the object an import path ``"package.module:Name"`` names."""
    if not isinstance(ref, str):
        return ref
    module, sep, qualname = ref.partition(":")
    if not sep or not qualname:
        raise ValueError(f"an import path reads 'package.module:Name', got {ref!r}")
    obj: Any = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def _name_of(ref: str | type) -> str:
    return ref.rpartition(":")[2].rpartition(".")[2] if isinstance(ref, str) else ref.__name__


# -- the table ----------------------------------------------------------------

_OPS = "hessian_eigenthings.operators"
_BUILD = f"{_OPS}.builders"

#: The curvatures shipped with the library, in the order the CLI lists them.
#: Factors: NOTE [memory factors] in ``hessian_eigenthings.memory``.
BUILTIN: tuple[Curvature, ...] = (
    Curvature(
        name="hessian",
        operator=f"{_OPS}.hessian:HessianOperator",
        title="Hessian",
        description="Hessian of the mean loss, by a double backward or finite differences of gradients",
        build=f"{_BUILD}:build_from_loss",
        methods=("autograd", "finite_difference"),
        memory=(
            MemoryFactors(first_pass=1.0, per_vector=1.5, extra_vectors=1, label="autograd"),
            MemoryFactors(
                first_pass=1.0, per_vector=0.0, extra_vectors=3, label="finite_difference"
            ),
        ),
    ),
    Curvature(
        name="ggn",
        operator=f"{_OPS}.ggn:GGNOperator",
        title="generalized Gauss-Newton (GGN)",
        description="generalized Gauss-Newton Jᵀ H_out J: the Hessian without the model's second derivatives",
        build=f"{_BUILD}:build_from_loss_of_output",
        memory=(
            MemoryFactors(
                first_pass=1.0, per_vector=1.0, extra_vectors=1, label="Jacobian products"
            ),
        ),
    ),
    Curvature(
        name="fisher",
        operator=f"{_OPS}.fisher:EmpiricalFisherOperator",
        title="empirical Fisher",
        description="empirical Fisher (1/N) Σ ∇ℓᵢ ∇ℓᵢᵀ of the per-sample losses",
        build=f"{_BUILD}:build_from_per_sample_loss",
        memory=(
            MemoryFactors(
                first_pass=1.0, per_vector=1.0, extra_vectors=1, label="per-sample gradients"
            ),
        ),
    ),
    Curvature(
        name="kfac",
        operator=f"{_OPS}.kfac:KFACOperator",
        title="KFAC (Kronecker-factored GGN)",
        description="KFAC: one Kronecker product G ⊗ A per Linear/Conv2d layer of the type-2 GGN",
        build=f"{_BUILD}:build_kronecker_factored",
        memory=(
            MemoryFactors(
                first_pass=17.0, per_vector=0.0, extra_vectors=8, label="Kronecker factors"
            ),
        ),
        factored=True,
    ),
    Curvature(
        name="ekfac",
        operator=f"{_OPS}.kfac:EKFACOperator",
        title="EKFAC (eigenvalue-corrected KFAC)",
        description="EKFAC: KFAC's eigenbases with eigenvalues refit to the per-sample gradients",
        build=f"{_BUILD}:build_kronecker_factored",
        memory=(
            MemoryFactors(
                first_pass=39.0,
                per_vector=0.0,
                extra_vectors=8,
                label="Kronecker factors, corrected eigenvalues",
            ),
        ),
        factored=True,
    ),
    Curvature(
        name="kfoc",
        operator=f"{_OPS}.kfoc:KFOCOperator",
        title="KFOC (nearest Kronecker product of the GGN blocks)",
        description="KFOC: the G ⊗ A nearest each Linear/Conv2d layer's type-2 GGN block",
        build=f"{_BUILD}:build_kronecker_factored",
        memory=(
            MemoryFactors(
                first_pass=31.0,
                per_vector=0.0,
                extra_vectors=8,
                label="Kronecker factors by power iteration",
            ),
        ),
        factored=True,
    ),
)

_TABLE: dict[str, Curvature] = {row.name: row for row in BUILTIN}


def names() -> tuple[str, ...]:
    """Names of the known curvatures: the built-in ones first, then registered ones."""
    return tuple(_TABLE)


def curvatures() -> tuple[Curvature, ...]:
    return tuple(_TABLE.values())


def curvature(name: str) -> Curvature:
    """The row called ``name``; ``ValueError`` naming the known ones otherwise."""
    row = _TABLE.get(name) if isinstance(name, str) else None
    if row is None:
        known = ", ".join(repr(n) for n in _TABLE)
        raise ValueError(
            f"unknown curvature {name!r}; known: {known} (add one with "
            "hessian_eigenthings.operators.registry.register)"
        )
    return row


# NOTE [exports from the registry]: ``hessian_eigenthings.operators`` and the top level export
# every row's classes from the row, so a curvature shipped with the library needs no line in
# either ``__init__``: each hands its ``__all__`` to :func:`export_into`, which appends the rows'
# class names (and keeps them in step with register/unregister), and its module ``__getattr__``
# imports a row's class on first access through :func:`exported_class`. The shipped operators
# are also imported explicitly there, for type checkers and IDEs (a module ``__getattr__`` is
# invisible to them); the rows are the source of truth, which tests/operators/test_registry.py
# checks. A name the package already exports otherwise is never taken over by a row.
_SURFACES: list[tuple[list[str], set[str]]] = []  # (a package's __all__, the names rows added)


def exported_names() -> tuple[str, ...]:
    """The class names of every row's operator, in table order."""
    return tuple(dict.fromkeys(n for row in _TABLE.values() for n in row.class_names()))


def exported_class(name: str) -> type | None:
    """The row class exported as ``name`` (imported on first use), or ``None``."""
    for row in _TABLE.values():
        for ref in (row.operator,):
            if _name_of(ref) == name:
                cls = _resolve(ref)
                if not isinstance(cls, type):
                    raise TypeError(f"curvature {row.name!r}: {ref!r} is not a class")
                return cls
    return None


def export_into(names: list[str]) -> None:
    """Keep ``names`` (a package's ``__all__``) listing every row's class names, now and after
    each :func:`register` / :func:`unregister` (NOTE [exports from the registry])."""
    _SURFACES.append((names, set()))
    _sync_exports()


def _sync_exports() -> None:
    wanted = exported_names()
    for names, added in _SURFACES:
        for name in sorted(added - set(wanted)):
            names.remove(name)
            added.discard(name)
        for name in wanted:
            if name not in names:
                names.append(name)
                added.add(name)


def register(row: Curvature, *, replace: bool = False) -> Curvature:
    """Add a curvature to the table, so that ``estimate_memory(operator=row.name)`` and the
    command line's ``--operator row.name`` (for parsers built afterwards) know it, and
    ``hessian_eigenthings.operators`` and the top level export its classes by name.

    ``replace=True`` overwrites an earlier registration of the same name; the built-in
    rows cannot be replaced. Returns ``row``.
    """
    if not isinstance(row, Curvature):
        raise TypeError(f"register takes a Curvature row, got {type(row).__name__}")
    if any(b.name == row.name for b in BUILTIN):
        raise ValueError(f"{row.name!r} is a built-in curvature; register yours under another name")
    if row.name in _TABLE and not replace:
        raise ValueError(
            f"curvature {row.name!r} is already registered; pass replace=True to overwrite it"
        )
    taken = {n: r.name for r in _TABLE.values() if r.name != row.name for n in r.class_names()}
    clashes = [f"{n} (curvature {taken[n]!r})" for n in row.class_names() if n in taken]
    if clashes:
        raise ValueError(
            f"curvature {row.name!r}: its classes are exported by name, and these names are "
            f"taken: {', '.join(clashes)}; rename the class"
        )
    _TABLE[row.name] = row
    _sync_exports()
    return row


def unregister(name: str) -> None:
    """Remove a curvature added by :func:`register` (built-in rows stay)."""
    if any(b.name == name for b in BUILTIN):
        raise ValueError(f"{name!r} is a built-in curvature and cannot be removed")
    if name not in _TABLE:
        raise ValueError(f"curvature {name!r} is not registered")
    del _TABLE[name]
    _sync_exports()
