"""The old home of ``auto``'s records (``records``) and of the stored bytecode
(``bytecode_cache``), kept for the names benchmarks and tests read here (``trace_times.ENV``,
``trace_times.program_code``, ...).

Each name here is a view of the module that holds it: read here, it is that module's; set here
(a test's ``monkeypatch.setattr(trace_times, "MAX_CODES", 2)``, undone after), it is set there,
where it is used.
"""

from __future__ import annotations

import sys
import types
from typing import Any

from hessian_eigenthings.operators.engines import bytecode_cache, records


def _view(home: types.ModuleType, name: str) -> property:
    def get(_: types.ModuleType) -> Any:
        return getattr(home, name)

    def set_(_: types.ModuleType, value: Any) -> None:
        setattr(home, name, value)

    return property(get, set_)


_VIEWS: dict[str, Any] = {}
for _home in (bytecode_cache, records):  # the first home of a name wins
    for _name in vars(_home):
        if not _name.startswith("__"):
            _VIEWS.setdefault(_name, _view(_home, _name))

sys.modules[__name__].__class__ = type("TraceTimesModule", (types.ModuleType,), _VIEWS)
