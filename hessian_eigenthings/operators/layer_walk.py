"""The layer walk's old import path: the walk and its runner are in ``engines/layers.py``, what it
checks before it walks in ``engines/layer_checks.py`` (DESIGN §8: a layer is a block of a stack
walked by ``engines/layers.py``). Every name this module had is importable from here."""

from __future__ import annotations

from hessian_eigenthings.operators.engines.layer_checks import (
    LayerCall,
    LayerWalkError,
    _cache_len,
    _hf_collecting,
    _is_cache,
    _leaf,
    _reached,
    _relative_gap,
    _same_values,
    _tensors,
    _without_cache,
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
    _DifferentiableNorms,
    _jvp,
    _Keep,
    _layer_norm,
    _primary,
    _Stop,
    _vjp,
    _with_primary,
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
    "_DifferentiableNorms",
    "_Keep",
    "_Stop",
    "_cache_len",
    "_hf_collecting",
    "_is_cache",
    "_jvp",
    "_layer_norm",
    "_leaf",
    "_primary",
    "_reached",
    "_relative_gap",
    "_same_values",
    "_tensors",
    "_vjp",
    "_with_primary",
    "_without_cache",
    "find_layers",
]
