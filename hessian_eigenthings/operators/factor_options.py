"""The keywords of the Kronecker family's pass over the data, declared once.

KFAC, EKFAC and KFOC (and their DDP and FSDP versions) take the same keywords for the pass that
collects their factors (:mod:`~hessian_eigenthings.operators.factor_pass`): which parameters,
the loss-Hessian columns (``fisher_type``, ``mc_samples``, ``seed``, ``curvature``), the data
(``num_batches``), the blocks (``separate_bias``, ``exclude_unsupported``), ``precision`` and
``column_chunk``. :class:`KroneckerOptions` types a constructor's ``**options`` and
:class:`FactorOptions` holds them with their defaults: the one object a constructor hands to
the pass (NOTE [Kronecker options]).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal, TypedDict, TypeVar

from hessian_eigenthings._checks import InternalError
from hessian_eigenthings.loss_fns.output_curvature import OutputCurvature
from hessian_eigenthings.operators.data_setup import unexpected_keyword
from hessian_eigenthings.operators.precision import Precision
from hessian_eigenthings.param_utils import ParamFilter

__all__ = [
    "FactorOptions",
    "FisherType",
    "KFACApprox",
    "KroneckerOptions",
    "factor_options",
    "with_options_signature",
]

FisherType = Literal["type2", "mc", "empirical"]
KFACApprox = Literal["expand", "reduce"]


class KroneckerOptions(TypedDict, total=False):
    """The keywords every Kronecker-factored operator built from a model takes (``**options``;
    their defaults are :class:`FactorOptions`'): ``fisher_type="type2"``, ``param_filter=None``
    (every trainable parameter), ``mc_samples=1``, ``seed=0``, ``curvature=None``,
    ``num_batches=None`` (the whole loader), ``separate_bias=True``,
    ``exclude_unsupported=False``, ``precision="fp32"``, ``column_chunk=16``. What each does:
    :class:`~hessian_eigenthings.operators.KFACOperator`."""

    fisher_type: FisherType
    param_filter: ParamFilter | str | Sequence[str] | None
    mc_samples: int
    seed: int
    curvature: OutputCurvature | None
    num_batches: int | None
    separate_bias: bool
    exclude_unsupported: bool
    precision: Precision
    column_chunk: int


@dataclass(frozen=True)
class FactorOptions:
    """The options of a factor pass: :class:`KroneckerOptions` with their defaults, and
    ``kfac_approx`` (KFAC's and EKFAC's keyword: how inputs at weight-sharing positions are
    grouped; KFOC's pass leaves it at ``"expand"`` and does not read it). As given: the pass
    checks them (:class:`~hessian_eigenthings.operators.factor_pass.FactorPass`)."""

    fisher_type: FisherType = "type2"
    param_filter: ParamFilter | str | Sequence[str] | None = None
    mc_samples: int = 1
    seed: int = 0
    curvature: OutputCurvature | None = None
    num_batches: int | None = None
    separate_bias: bool = True
    exclude_unsupported: bool = False
    precision: Precision = "fp32"
    column_chunk: int = 16
    kfac_approx: KFACApprox = "expand"


# NOTE [Kronecker options]
# A constructor of the family takes the shared keywords as `**options: Unpack[KroneckerOptions]`
# (typed for a type checker) and turns them into one `FactorOptions` (`factor_options`), which
# the pass takes whole: no constructor lists them again. A keyword outside the record is a
# misspelling, raised as Python's own TypeError for the class the user called, with the closest
# keyword (`data_setup.unexpected_keyword`). So that `inspect.signature`, `help()` and that "did
# you mean" still see every keyword, `with_options_signature` writes the record out in the
# constructor's `__signature__`: the fields as keyword-only parameters with `FactorOptions`'
# annotations and defaults, before the constructor's own keyword-only ones.
#: the record's fields in their order of declaration
_NAMES = tuple(KroneckerOptions.__annotations__)

_Init = TypeVar("_Init", bound=Callable[..., None])


def factor_options(
    cls: type, owner: type, options: KroneckerOptions, kfac_approx: KFACApprox = "expand"
) -> FactorOptions:
    """The record of a constructor's ``options`` (NOTE [Kronecker options]); a keyword outside it
    raises ``TypeError`` naming ``cls``, the class the user called, and the closest keyword of
    its constructors up to ``owner``'s, the one that took ``**options``."""
    for name in options:
        if name not in _NAMES:
            raise unexpected_keyword(cls, name, owner)
    return FactorOptions(kfac_approx=kfac_approx, **options)


def with_options_signature(init: _Init) -> _Init:
    """``init`` shown with its ``**options: Unpack[KroneckerOptions]`` written out (NOTE
    [Kronecker options]): the record's fields after the positional parameters."""
    sig = inspect.signature(init)
    *own, last = sig.parameters.values()
    if last.kind is not last.VAR_KEYWORD:
        raise InternalError(f"{init.__qualname__} takes the options as **options")
    at = next((i for i, p in enumerate(own) if p.kind is p.KEYWORD_ONLY), len(own))
    fields = inspect.signature(FactorOptions).parameters
    written = [fields[name].replace(kind=inspect.Parameter.KEYWORD_ONLY) for name in _NAMES]
    signature = sig.replace(parameters=[*own[:at], *written, *own[at:]])
    setattr(init, "__signature__", signature)  # noqa: B010 (read by inspect)
    return init
