"""The two top-level names that are both 0.x and 1.0 functions: ``lanczos`` and
``deflated_power_iteration``. Each call goes to one of them by its arguments.

NOTE [routing colliding names]
A call takes the 0.x path when its arguments bind only to the 0.x signature
(positional arguments after the operator, or 0.x-only keywords such as
``num_eigenthings``), or when they bind to both signatures and the operator
is a 0.x type (``Operator``, ``HVPOperator``, 0.x ``LambdaOperator``, or any
object with ``size`` and ``apply`` that is no 1.0 operator). Otherwise it
takes the 1.0 path, which never warns. Arguments that bind to neither raise
``TypeError`` naming the 0.x-only and 1.0-only arguments that were mixed.

The 0.x path warns (DeprecatedWarning, at the user's line) and returns 0.x
types; the 1.0 path is the core function itself, called with the same
arguments. Binding costs a few microseconds per call, nothing next to a solve.
"""

from __future__ import annotations

import inspect
import types
from collections.abc import Callable
from typing import Any

from hessian_eigenthings.algorithms.lanczos import lanczos as core_lanczos
from hessian_eigenthings.algorithms.power_iteration import (
    deflated_power_iteration as core_deflated_power_iteration,
)
from hessian_eigenthings.compat.hvp_operator import HVPOperator
from hessian_eigenthings.compat.lanczos import lanczos as legacy_lanczos
from hessian_eigenthings.compat.operator import Operator
from hessian_eigenthings.compat.power_iter import (
    deflated_power_iteration as legacy_deflated_power_iteration,
)
from hessian_eigenthings.operators.base import CurvatureOperator


def is_0x_operator(obj: Any) -> bool:
    """Whether ``obj`` is an operator only 0.x code could have made."""
    if isinstance(obj, (Operator, HVPOperator)):
        return True
    return not isinstance(obj, CurvatureOperator) and hasattr(obj, "apply") and hasattr(obj, "size")


class _Route:
    """Chooses between a 0.x and a 1.0 function of one name. See NOTE [routing colliding names]."""

    def __init__(self, name: str, old: Callable[..., Any], new: Callable[..., Any]) -> None:
        self.name = name
        self.old, self.new = old, new
        self.old_sig, self.new_sig = inspect.signature(old), inspect.signature(new)
        self.old_params = set(self.old_sig.parameters)
        self.new_params = set(self.new_sig.parameters)

    @staticmethod
    def _binds(sig: inspect.Signature, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
        try:
            sig.bind(*args, **kwargs)
        except TypeError:
            return False
        return True

    def wants_0x(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
        old = self._binds(self.old_sig, args, kwargs)
        new = self._binds(self.new_sig, args, kwargs)
        if old and new:
            operator = args[0] if args else kwargs.get("operator", kwargs.get("op"))
            return is_0x_operator(operator)
        if old or new:
            return old
        raise TypeError(self._mixed_message(args, kwargs))

    def _mixed_message(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
        given = set(kwargs)
        only_old = sorted(given & (self.old_params - self.new_params))
        only_new = sorted(given & (self.new_params - self.old_params))
        unknown = sorted(given - self.old_params - self.new_params)
        parts = [f"{self.name}() arguments match neither signature:"]
        if unknown:
            parts.append(f"unknown keyword arguments {unknown};")
        if only_old and only_new:
            parts.append(
                f"0.x-only arguments {only_old} are mixed with 1.0-only arguments {only_new};"
            )
        if args[1:] and only_new:
            parts.append(
                "positional arguments after the operator are 0.x style, keywords like "
                f"{only_new} are 1.0 style;"
            )
        parts.append(
            f"1.0 is {self.name}{self.new_sig}; 0.x (deprecated) is {self.name}{self.old_sig}. "
            "See migration_guide.md."
        )
        return " ".join(parts)


_LANCZOS = _Route("lanczos", legacy_lanczos, core_lanczos)
_DEFLATED = _Route(
    "deflated_power_iteration", legacy_deflated_power_iteration, core_deflated_power_iteration
)


def lanczos(*args: Any, **kwargs: Any) -> Any:
    # shows the 1.0 signature and docstring: See NOTE [routed signatures]
    if _LANCZOS.wants_0x(args, kwargs):
        return legacy_lanczos(*args, **kwargs)
    return core_lanczos(*args, **kwargs)


def deflated_power_iteration(*args: Any, **kwargs: Any) -> Any:
    # shows the 1.0 signature and docstring: See NOTE [routed signatures]
    if _DEFLATED.wants_0x(args, kwargs):
        return legacy_deflated_power_iteration(*args, **kwargs)
    return core_deflated_power_iteration(*args, **kwargs)


# NOTE [routed signatures]
# The routed functions take (*args, **kwargs), which is all that help(), inspect.signature and IDEs
# would show of the library's main functions. They show the 1.0 function instead: its signature
# (__signature__, which inspect and pydoc read first) and its docstring, closed by a paragraph on
# the 0.x calls. No __wrapped__: the router is not the core function (a 0.x call does not reach
# it), and __module__/__qualname__ stay the router's so that pickling finds the router.
_ROUTED_0X = """

    Calls written for 0.x are routed too: {old} (deprecated) still works, warns and returns
    0.x's numpy pair. A call goes to 0.x when its arguments bind only to that signature, or
    bind to both and the operator is a 0.x type; see NOTE [routing colliding names] in
    ``hessian_eigenthings.compat.routing``.
    """


def _show_core(routed: Callable[..., Any], route: _Route) -> None:
    """Give ``routed`` the 1.0 function's signature and docstring. See NOTE [routed signatures]."""
    setattr(routed, "__signature__", route.new_sig)  # noqa: B010
    doc = (route.new.__doc__ or "").rstrip()
    params = ", ".join(
        p.name if p.default is inspect.Parameter.empty else f"{p.name}={p.default!r}"
        for p in route.old_sig.parameters.values()
    )
    routed.__doc__ = doc + _ROUTED_0X.format(old=f"``{route.name}({params})``")


_show_core(lanczos, _LANCZOS)
_show_core(deflated_power_iteration, _DEFLATED)

# `import hessian_eigenthings.lanczos as lz` binds lz to the package attribute, which is the routed
# function (not the 0.x module): give it the module's one public name so 0.x `lz.lanczos(...)` works.
setattr(lanczos, "lanczos", legacy_lanczos)  # noqa: B010


class CallableModule(types.ModuleType):
    """Module type of ``hessian_eigenthings.lanczos`` (the 0.x module path).

    The package binds the name ``lanczos`` to the routed function; should the
    import system ever rebind it to the module (a re-import after the module
    was dropped from ``sys.modules``), calling the module still routes.
    """

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return lanczos(*args, **kwargs)
