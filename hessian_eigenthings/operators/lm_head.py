"""The GGN of a language model through its head, chunk by chunk (NOTE [chunked LM head]).

:class:`ChunkedHead` is the GGN operator's collaborator for a model whose
forward gives a linear head's logits and whose loss can apply its output
Hessian through that head from the head's input: the forward implements
``loss_fns.protocols.HiddenStatesForward``, the loss
``loss_fns.protocols.LinearHeadLoss`` (HuggingFace causal LMs:
``hf_lm_forward()`` and ``hf_lm_loss_of_output()``). The operator sees only
those protocols.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Literal

import torch
from torch import nn

from hessian_eigenthings.batching import Batch
from hessian_eigenthings.loss_fns.protocols import HiddenStatesForward, LinearHeadLoss

if TYPE_CHECKING:
    from hessian_eigenthings.operators.sandwich import OutputState

#: ``J v`` of the head's input for a block of directions: ``jvp(batch, vecs) -> (k, *h.shape)``
BodyJvp = Callable[[Batch, list[torch.Tensor]], torch.Tensor]
#: ``Jᵀ u`` through the head's input: ``vjp(h, u, retain)``, one per parameter (``None``: zero)
BodyVjp = Callable[[torch.Tensor, torch.Tensor, bool], Sequence[torch.Tensor | None]]

# NOTE [chunked LM head]
# For a causal LM whose forward and loss implement the protocols above
# (hf_lm_forward(), hf_lm_loss_of_output(), loss_hvp="analytical") and whose
# head is a plain nn.Linear, the (B, T, V) logits are never formed: the
# sandwiched function is the body (last hidden states h, (B, T, d)), and the
# loss applies the head and its Hessian chunk by chunk over rows
# (`kernels.lm_head_ce_ggn` for HuggingFace models): it takes the body's
# tangent dh = J_body v and the head's part of v and returns the pull-backs
# g_h (through the body by one backward), g_W and g_b (added to the head's
# parameters; a tied embedding gets both its body and head part). Memory
# O(chunk × V) instead of O(B·T·V) for logits, tangents and loss Hessian
# products. On the first batch the model's logits are compared once with
# lm_head(h): models that post-process the head's output (soft-capping,
# scaling) keep the generic path. `chunked_lm_head` = "auto" / True / False.


def plain_head(model: nn.Module, forward_fn: Any, loss: Any) -> nn.Linear | None:
    """The model's head when the chunked path applies (protocols implemented, a plain linear
    head without hooks), else ``None``."""
    if not (isinstance(forward_fn, HiddenStatesForward) and isinstance(loss, LinearHeadLoss)):
        return None
    get = getattr(model, "get_output_embeddings", None)
    head = get() if callable(get) else None
    if type(head) is not nn.Linear or head._forward_hooks or head._forward_pre_hooks:
        return None
    return head


def chunked_head(
    model: nn.Module,
    forward_fn: Any,
    loss: Any,
    setting: bool | Literal["auto"],
    chunk_rows: int | None,
    *,
    exact: bool,
    engine: str,
) -> ChunkedHead | None:
    """The GGN's chunked head for ``chunked_lm_head=setting`` (NOTE [chunked LM head]), or
    ``None`` for the generic path: only with the exact loss Hessian (``exact``) on the autograd
    engine; ``True`` raises where it cannot apply, ``"auto"`` takes the generic path there."""
    traced = engine in ("functional", "compiled")
    if setting is True and traced:
        raise ValueError(
            f"chunked_lm_head=True runs on engine='autograd'; engine={engine!r} sandwiches the "
            "whole logits (pass chunked_lm_head='auto' or engine='autograd')"
        )
    head = None if setting is False or traced or not exact else plain_head(model, forward_fn, loss)
    if head is None or not (
        isinstance(forward_fn, HiddenStatesForward) and isinstance(loss, LinearHeadLoss)
    ):
        if setting is True:
            raise ValueError(
                "chunked_lm_head=True needs forward_fn=hf_lm_forward(), loss_of_output_fn="
                "hf_lm_loss_of_output() with loss_hvp='analytical' (or any forward and loss "
                "implementing loss_fns.protocols.HiddenStatesForward and LinearHeadLoss), and a "
                "model whose get_output_embeddings() is a plain nn.Linear without hooks"
            )
        return None
    return ChunkedHead(head, forward_fn, loss, chunk_rows=chunk_rows, insist=setting is True)


class ChunkedHead:
    """Applies the head and the loss Hessian chunk by chunk for one GGN operator."""

    def __init__(
        self,
        head: nn.Linear,
        forward_fn: HiddenStatesForward,
        loss: LinearHeadLoss,
        *,
        chunk_rows: int | None,
        insist: bool,
    ) -> None:
        self.head = head
        self.forward_fn = forward_fn
        self.loss = loss
        self.chunk_rows = chunk_rows
        self.insist = insist
        self.checked = False

    def matches(self, model: nn.Module, batch: Batch, h: torch.Tensor) -> bool:
        """Once, on the first batch: do the model's logits equal ``head(hidden states)``?

        Models that post-process the head's output (logit soft-capping, scaling)
        differ; they keep the generic path. One host sync, once per operator.
        """
        self.checked = True
        with torch.no_grad():
            logits = self.forward_fn(model, batch)
            ok = logits.shape[:-1] == h.shape[:-1] and torch.allclose(
                self.head(h.detach()), logits, rtol=1e-4, atol=1e-5 * float(logits.abs().max())
            )
        if not ok and self.insist:
            raise ValueError(
                "chunked_lm_head=True, but the model's logits differ from lm_head(last hidden state) "
                "(soft-capping or scaling after the head?); pass chunked_lm_head='auto' or False"
            )
        return bool(ok)

    def prepare(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """The batch's targets that count (the loss's layout) and their number: the state the
        chunked product uses in place of the output curvature's."""
        return self.loss.head_targets(batch)

    def apply(
        self,
        state: OutputState,
        vecs: list[torch.Tensor],
        retain: bool,
        params: Sequence[torch.Tensor],
        *,
        jvp: BodyJvp,
        vjp: BodyVjp,
    ) -> Sequence[torch.Tensor | None]:
        """``G v`` for the block ``vecs`` over the selected ``params``: the body's tangent
        (``jvp``), the head's pull-backs from the loss, one backward through the body
        (``vjp``); the head's parameters add their own part."""
        head = self.head
        valid, n = state.curvature
        index = {id(p): i for i, p in enumerate(params)}
        iw, ib = index.get(id(head.weight)), None if head.bias is None else index.get(id(head.bias))
        dh = jvp(state.batch, vecs)  # body Jacobian times the direction: (k, B, T, d)
        g_h, g_w, g_b = self.loss.head_ggn(
            state.output.detach(),
            head.weight.detach(),
            None if head.bias is None else head.bias.detach(),
            dh,
            None if iw is None else vecs[iw],
            None if ib is None else vecs[ib],
            valid,
            n,
            chunk_rows=self.chunk_rows,
        )
        out = list(vjp(state.output, g_h, retain))  # the body's part
        for i, extra in ((iw, g_w), (ib, g_b)):
            if i is not None and extra is not None:
                body = out[i]
                out[i] = extra if body is None else body.add_(extra)
        return out
