"""One check for every integer argument of the 1.0 core (the 0.x facade translates 0.x's looser
values before calling in): ``True`` is not 1 here, ``2.5`` is not a count, and the message names
the argument."""

from __future__ import annotations

import operator
from typing import Literal, overload


@overload
def check_count(
    name: str, value: object, *, minimum: int | None = 1, allow_none: Literal[False] = False
) -> int: ...


@overload
def check_count(
    name: str, value: object, *, minimum: int | None = 1, allow_none: bool
) -> int | None: ...


def check_count(
    name: str, value: object, *, minimum: int | None = 1, allow_none: bool = False
) -> int | None:
    """``value`` as an int (anything with ``__index__`` but a bool), at least ``minimum``."""
    if value is None and allow_none:
        return None
    bound = "" if minimum is None else f" >= {minimum}"
    what = f"an int{bound}" + (" or None" if allow_none else "")
    if isinstance(value, bool):
        raise ValueError(f"{name} must be {what}, got {value!r} (a bool)")
    try:
        number = operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise ValueError(f"{name} must be {what}, got {value!r}") from None
    if minimum is not None and number < minimum:
        raise ValueError(f"{name} must be {what}, got {number}")
    return number


class InternalError(RuntimeError):
    """An invariant of the package's own code did not hold: a bug of hessian-eigenthings, never a
    mistake of the caller (those get a ValueError or TypeError saying how to fix them). Raised
    where an ``assert`` would vanish under ``python -O``; the package has no ``assert``
    (ruff's S101)."""

    def __init__(self, what: str) -> None:
        super().__init__(
            f"hessian-eigenthings internal error: expected {what}; please report this with the "
            "traceback"
        )
