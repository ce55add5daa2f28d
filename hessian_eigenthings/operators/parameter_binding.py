"""What an operator's parameter directions are bound to, and which of them are constants.

:class:`ParameterBinding` ties an operator to the model and its selected parameters *by name*:
``model.load_state_dict(sd, assign=True)`` or ``module.weight = nn.Parameter(...)`` puts new
tensor objects in the model's slots, and an operator holding the old objects would
differentiate with respect to tensors the forward no longer reads (exact zeros, NOTE [replaced
parameters]); :func:`refuse_in_place_forward` refuses modules whose forward rewrites their own
weight. (Padding rows of embeddings are the model guard's: NOTE [padding rows].)

Cost: one identity comparison per slot on the path to each selected parameter, per product
(host work only: no tensor read, no device sync).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from hessian_eigenthings._checks import InternalError

# NOTE [replaced parameters]
# An operator lists its selected parameters once, at construction. Loading a
# state dict with `assign=True` (and `module.weight = nn.Parameter(...)`, or
# replacing a whole submodule) puts new tensor objects in the model: a product
# that differentiates with respect to the old ones gets `None` from
# `allow_unused=True`, a zero block, and eigenvalues of zero, without a word.
# The operator is bound to the model and the selection by name instead: every
# product first checks, for each selected name, that the attribute slots on its
# path (`model._modules["a"]`, ..., `module._parameters["weight"]`) still hold
# the objects seen last (one dictionary lookup and one `is` per slot, host work
# only). When one does not, the names are resolved again; a replacement of the
# same shape, dtype and device is followed (kept states, recordings and engine
# states keyed on the old objects are dropped by the operator), any other
# raises and names the parameter.


def _slots(model: nn.Module, name: str) -> list[tuple[dict[str, object], str, object]]:
    """The ``(dict, key, value)`` attribute slots from ``model`` to the parameter ``name``."""
    *path, leaf = name.split(".")
    out: list[tuple[dict[str, object], str, object]] = []
    module = model
    for part in path:
        child = module._modules[part]
        out.append((module._modules, part, child))  # type: ignore[arg-type]
        if child is None:
            raise InternalError("child is not None")
        module = child
    out.append((module._parameters, leaf, module._parameters[leaf]))  # type: ignore[arg-type]
    return out


class ParameterBinding:
    """The selected parameters of ``model`` by name and a cheap check that they are still there.
    ``offsets[i]``: where parameter ``i`` starts in the flat vector. Refuses, for ``owner``, a model
    whose forward rewrites its own parameters (:func:`refuse_in_place_forward`)."""

    def __init__(
        self,
        model: nn.Module,
        named_params: Sequence[tuple[str, torch.Tensor]],
        offsets: Sequence[int],
        owner: str,
    ) -> None:
        refuse_in_place_forward(model, owner)
        self.model = model
        self.names = [n for n, _ in named_params]
        self.offsets = offsets
        self._bind(named_params)

    def _bind(self, named_params: Sequence[tuple[str, torch.Tensor]]) -> None:
        self.tensors = [p for _, p in named_params]
        seen: dict[tuple[int, str], tuple[dict[str, object], str, object]] = {}
        for name, _ in named_params:
            for slot in _slots(self.model, name):
                seen.setdefault((id(slot[0]), slot[1]), slot)
        #: ``(dict, key, value)``: the attribute slots on the path to each selected parameter and
        #: what they held when bound (NOTE [replaced parameters])
        self.slots = list(seen.values())

    def current(self) -> bool:
        """Whether every slot still holds the object it held when last bound (NOTE [replaced parameters])."""
        return all(d.get(key) is value for d, key, value in self.slots)

    def follow(self) -> list[tuple[str, nn.Parameter]] | None:
        """``None`` while the model holds the bound tensors; else the ones it holds now under the
        bound names (then bound); raises ``ValueError`` naming a parameter that is gone or changed
        shape, dtype or device."""
        if self.current():
            return None
        now: list[tuple[str, nn.Parameter]] = []
        for name, old in zip(self.names, self.tensors, strict=True):
            try:
                p = self.model.get_parameter(name)
            except AttributeError:
                raise ValueError(
                    f"the selected parameter {name!r} is no longer a parameter of the model (replaced or "
                    "removed after the operator was built); build a new operator for the new model"
                ) from None
            if p.shape != old.shape or p.dtype != old.dtype or p.device != old.device:
                raise ValueError(
                    f"the selected parameter {name!r} was replaced by a tensor of another shape, dtype or "
                    f"device ({tuple(old.shape)} {old.dtype} {old.device} -> {tuple(p.shape)} {p.dtype} "
                    f"{p.device}) after the operator was built; build a new operator for the new parameters"
                )
            now.append((name, p))
        self._bind(now)
        return now


def refuse_in_place_forward(model: nn.Module, owner: str) -> None:
    """Raise for modules whose forward rewrites their own parameters: ``nn.Embedding(max_norm=...)``
    renormalizes the rows it reads in place, so a product would change the user's model (and the
    curvature would be of weights the forward itself rewrites)."""
    for name, m in model.named_modules():
        if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.max_norm is not None:
            raise ValueError(
                f"{owner}: the embedding {name or type(m).__name__!r} has max_norm={m.max_norm}: its forward "
                "renormalizes the weight in place, so every product would change your model's parameters. "
                "Renormalize once and switch it off for the analysis: `with torch.no_grad(): "
                "torch.embedding_renorm_(emb.weight, torch.arange(emb.num_embeddings), emb.max_norm, "
                "emb.norm_type)`, then `emb.max_norm = None` (the same forward from then on)"
            )
