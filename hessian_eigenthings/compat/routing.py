"""The two top-level names that are both 0.x and 1.0 functions: ``lanczos`` and
``deflated_power_iteration``. Each call goes to one of them by its arguments.

NOTE [routing colliding names]
A call takes the 0.x path only where it can only mean 0.x: it passes a 0.x-only
keyword (``num_eigenthings``, ``max_steps``, ``num_lanczos_vectors``,
``init_vec``, ``use_gpu``, ``fp16``, ``power_iter_steps``, ``operator``, ...),
or its operator is a 0.x type (``Operator``, ``HVPOperator``, 0.x
``LambdaOperator``, or any object with ``size`` and ``apply`` that is no 1.0
operator) and it passes no 1.0-only keyword. Position alone never routes: a
1.0 operator always gets the 1.0 result, its second positional argument binds
to ``k`` (``lanczos(op, 5)`` is ``lanczos(op, k=5)``), and a third is a
``TypeError``. The 1.0 path never warns. A keyword that neither signature knows
raises ``TypeError`` naming it, with the closest known name; 0.x-only and
1.0-only keywords in one call raise ``TypeError`` naming both sides.

(Positional arguments after any operator used to mean 0.x: a new
user's ``lanczos(HessianOperator(...), 5)`` then got 0.x's ascending numpy pair,
and the deprecation warning was hidden where the call sat in an imported
module.)

The 0.x path warns (DeprecatedWarning, at the user's line) and returns 0.x
types; the 1.0 path is the core function itself. Routing looks at keyword
names and one isinstance: about a microsecond per call, nothing next to a solve.
"""

from __future__ import annotations

import difflib
import inspect
import types
from collections.abc import Callable
from typing import Any

from hessian_eigenthings.algorithms.lanczos import lanczos as core_lanczos
from hessian_eigenthings.algorithms.power_iteration import (
    deflated_power_iteration as core_deflated_power_iteration,
)
from hessian_eigenthings.compat._deprecations import GUIDE
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


def _closest(name: str, names: list[str]) -> list[str]:
    """The known name ``name`` was likely meant as: the closest by difflib, else one that it
    begins with or that begins with it (``tolerance`` for ``tol``); ``[]`` where none is close."""
    close = difflib.get_close_matches(name, names, n=1)
    if close or len(name) < 3:
        return close
    return [n for n in names if len(n) >= 3 and (name.startswith(n) or n.startswith(name))][:1]


class _Route:
    """Chooses between a 0.x and a 1.0 function of one name. See NOTE [routing colliding names]."""

    def __init__(self, name: str, old: Callable[..., Any], new: Callable[..., Any]) -> None:
        self.name = name
        self.old, self.new = old, new
        self.old_sig, self.new_sig = inspect.signature(old), inspect.signature(new)
        self.old_params = set(self.old_sig.parameters)
        self.new_params = set(self.new_sig.parameters)
        #: the 1.0 parameter that a second positional argument binds to (``k``)
        self.positional = next(
            p.name for p in self.new_sig.parameters.values() if p.kind is p.KEYWORD_ONLY
        )

    def route(
        self, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[bool, tuple[Any, ...], dict[str, Any]]:
        """``(to 0.x, args, kwargs)``: the path of a call and the arguments to pass on it."""
        unknown = [name for name in kwargs if name not in self.old_params | self.new_params]
        if unknown:
            raise TypeError(self._unknown_message(unknown))
        only_old = sorted(kwargs.keys() & (self.old_params - self.new_params))
        only_new = sorted(kwargs.keys() & (self.new_params - self.old_params))
        if only_old and only_new:
            raise TypeError(
                f"{self.name}() mixes 0.x-only arguments {only_old} with 1.0-only arguments "
                f"{only_new}; {self._both()}"
            )
        if only_old:
            return True, args, kwargs  # can only mean 0.x
        operator = args[0] if args else kwargs.get("op")
        extra = args[1:]
        if is_0x_operator(operator):
            if not only_new:
                return True, args, kwargs  # fits both: the 0.x operator decides
            if extra:
                raise TypeError(
                    f"{self.name}() got {len(extra)} positional argument(s) after a 0.x operator "
                    f"(0.x style) with 1.0-only keywords {only_new}; {self._both()}"
                )
            return False, args, kwargs
        # a 1.0 operator always gets the 1.0 result: the second positional argument is k
        if not extra:
            return False, args, kwargs
        if len(extra) > 1:
            raise TypeError(
                f"{self.name}() takes the operator and {self.positional} positionally, got "
                f"{len(args)} positional arguments; pass the others by keyword, as in "
                f"{self.name}(op, {self._example()}) "
                f"(0.x's positional form takes a 0.x operator; see {GUIDE}, "
                f"section 'Routing of `lanczos` and `deflated_power_iteration`')"
            )
        if self.positional in kwargs:
            raise TypeError(f"{self.name}() got multiple values for argument '{self.positional}'")
        return False, args[:1], {**kwargs, self.positional: extra[0]}

    def _unknown_message(self, unknown: list[str]) -> str:
        names = sorted(self.old_params | self.new_params)
        guesses = {name: _closest(name, names) for name in unknown}
        if len(unknown) == 1:
            ((name, close),) = guesses.items()
            hint = f"did you mean '{close[0]}'?" if close else f"it takes {self._new_names()}"
            return f"{self.name}() got an unknown argument '{name}'; {hint}"
        listed = ", ".join(
            f"'{name}'" + (f" (did you mean '{close[0]}'?)" if close else "")
            for name, close in guesses.items()
        )
        return f"{self.name}() got unknown arguments {listed}; it takes {self._new_names()}"

    def _example(self) -> str:
        keywords = [p for p in self.new_sig.parameters.values() if p.kind is p.KEYWORD_ONLY]
        return ", ".join(f"{p.name}=..." for p in keywords[:3])

    def _new_names(self) -> str:
        return ", ".join(self.new_sig.parameters)

    def _both(self) -> str:
        return (
            f"use one of them: 1.0 is {self.name}(op, {self._example()}); see {GUIDE}, "
            "section 'Routing of `lanczos` and `deflated_power_iteration`'"
        )


_LANCZOS = _Route("lanczos", legacy_lanczos, core_lanczos)
_DEFLATED = _Route(
    "deflated_power_iteration", legacy_deflated_power_iteration, core_deflated_power_iteration
)


def lanczos(*args: Any, **kwargs: Any) -> Any:
    # shows the 1.0 signature and docstring: See NOTE [routed signatures]
    old, args, kwargs = _LANCZOS.route(args, kwargs)
    if old:
        return legacy_lanczos(*args, **kwargs)
    return core_lanczos(*args, **kwargs)


def deflated_power_iteration(*args: Any, **kwargs: Any) -> Any:
    # shows the 1.0 signature and docstring: See NOTE [routed signatures]
    old, args, kwargs = _DEFLATED.route(args, kwargs)
    if old:
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
    0.x's numpy pair. A call goes to 0.x only where it can only mean 0.x: a 0.x-only keyword,
    or a 0.x operator type; a 1.0 operator always gets the 1.0 result, and a second
    positional argument is ``k``. See NOTE [routing colliding names] in
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
