"""The layer walk's old import path: the walk and its runner are in ``engines/layers.py`` (its
stages in ``engines/layer_stages.py``, its kept layer graphs in ``engines/layer_keep.py``), what it
checks before it walks in ``engines/layer_checks.py`` (DESIGN §8: a layer is a block of a stack
walked by ``engines/layers.py``). Every name this module had is importable from here."""

from __future__ import annotations

from hessian_eigenthings.operators.engines.layer_checks import (
    LayerCall,
    LayerWalkError,
    find_layers,
)
from hessian_eigenthings.operators.engines.layers import (
    WALK_FREE_FRACTION,
    Agree,
    Finish,
    Gather,
    LayerWalk,
    LayerWalkRunner,
    WalkState,
)

__all__ = [
    "WALK_FREE_FRACTION",
    "Agree",
    "Finish",
    "Gather",
    "LayerCall",
    "LayerWalk",
    "LayerWalkError",
    "LayerWalkRunner",
    "WalkState",
    "find_layers",
]


def __getattr__(name: str) -> object:
    """The walk's private helpers, as this module had them (tests and old code read them here):
    looked up in their new modules, not imported by name (no module of ``operators/`` imports a
    private name of another)."""
    from hessian_eigenthings.operators.engines import layer_checks, layer_keep, layer_stages, layers

    renamed = {"_Keep": "Keep", "_DifferentiableNorms": "DifferentiableNorms"}
    renamed |= {"_layer_norm": "composite_layer_norm", "_relative_gap": "relative_gap"}
    renamed |= {"_primary": "primary", "_with_primary": "with_primary"}
    if name.startswith("_"):
        for module in (layers, layer_checks, layer_stages, layer_keep):
            for found in (name, renamed.get(name)):
                if found is not None and found in vars(module):
                    return vars(module)[found]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
