"""Generalized Gauss-Newton matrix of the mean loss, ``G = Jᵀ H_L J``.

Split the loss at the model output ``f = forward_fn(model, batch)``:
``L(θ) = ℓ(f(θ))`` with ``J = ∂f/∂θ`` (output Jacobian) and
``H_L = ∇²_f ℓ`` (loss Hessian at the output). The GGN drops the term of the
Hessian that carries second derivatives of the model, so it is positive
semi-definite whenever ``ℓ`` is convex in the output (cross-entropy, MSE).
Over several batches it is weighted by batch size like every operator.

One product ``G v`` per batch:

1. ``J v``: forward-mode AD through the model (see NOTE [GGN Jacobian-vector products]);
2. ``u = H_L (J v)``: in closed form when ``loss_of_output_fn`` implements
   :class:`~hessian_eigenthings.loss_fns.protocols.OutputHessianLoss`
   (cross-entropy through :func:`hessian_eigenthings.kernels.cross_entropy_hvp`),
   else by a double backward through the loss only (``loss_hvp="autograd"``),
   never through the model;
3. ``Jᵀ u``: one backward through the output's graph.

For HuggingFace causal LMs the head and the loss are applied chunk by chunk
without forming the logits (NOTE [chunked LM head]).

Cost per product and batch: one forward pass (kept across products with graph
reuse, see NOTE [graph reuse] in ``base``), one forward-mode pass, one
backward pass; a block of k vectors goes through steps 1 and 3 batched. No
double backward through the model: kernels without one (flash attention,
fused ops) are fine.

:class:`_OutputSandwichOperator` holds the machinery; the empirical Fisher
reuses it with the per-sample losses as the "output".
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn
from typing_extensions import Unpack

from hessian_eigenthings import _torch_compat
from hessian_eigenthings.batching import Batch
from hessian_eigenthings.kernels import lm_head_ce_ggn
from hessian_eigenthings.linalg import LinAlgBackend
from hessian_eigenthings.loss_fns.checks import check_loss_argument
from hessian_eigenthings.loss_fns.huggingface import HFCausalLMForward, HFCausalLMLoss
from hessian_eigenthings.loss_fns.protocols import ForwardFn, LossOfOutputFn, OutputHessianLoss
from hessian_eigenthings.operators.base import CallWithModel, DataCurvatureOperator, DataOptions
from hessian_eigenthings.operators.hessian import default_fd_eps
from hessian_eigenthings.param_utils import ParamFilter, call_with_values

JvpMethod = Literal["auto", "forward_mode", "finite_difference"]

# NOTE [GGN Jacobian-vector products]
# `J v` is computed by forward-mode AD: `torch.func.jvp` of the model as a
# function of the selected parameters (`torch.func.functional_call` on a
# wrapper module that calls `forward_fn(model, batch)`), so the model itself
# is never modified. A block of k vectors goes through one pass with
# `torch.func.vmap` over the tangents. Measured on CPU (MLP 128-256-256-10,
# batch 128, k = 8, float32 and float64), vmap-over-jvp and the
# double-backward trick `J v = ∂/∂w ⟨Jᵀw, v⟩` (`is_grads_batched`) cost the
# same within ~10% (a k-loop of forward-mode passes costs ~1.6x); vmap-over-jvp
# wins because it needs no double backward through the model (attention
# kernels without one work, no second-order graph is held).
#
# Fallbacks, decided on the first product and kept:
# - vmap fails (an op without a batching rule, data-dependent Python on a
#   batched tensor, in-place updates of unbatched buffers): a loop of k
#   `torch.func.jvp` calls; still exact.
# - forward-mode AD fails (an op without a forward-AD formula, a custom
#   autograd.Function without `jvp`): central finite differences
#   `J v ≈ (f(θ + h v̂) − f(θ − h v̂)) ‖v‖ / 2h`, two forward passes per
#   vector under no_grad, parameters perturbed out of place through
#   functional_call (the output graph kept for `Jᵀ` stays valid), h from
#   `default_fd_eps` (NOTE [finite-difference step] in `hessian`). Error O(h²).
# Forward mode runs under math SDPA (the fused attention kernels have no
# forward-mode formulas). `jvp="finite_difference"` forces the fallback;
# `jvp_method` says what ran.
# Active dropout makes the forward-mode pass draw other masks than the output
# graph: call `model.eval()` (BatchNorm in training mode is consistent: both
# passes use batch statistics, on private copies of the running statistics).

# NOTE [chunked LM head]
# For a HuggingFace causal LM (forward_fn=hf_lm_forward(), loss
# hf_lm_loss_of_output(), loss_hvp="analytical") whose head is a plain
# nn.Linear, the (B, T, V) logits are never formed: the sandwiched function is
# the body (last hidden states h, (B, T, d)), and the head and the loss are
# applied by `kernels.lm_head_ce_ggn` chunk by chunk over rows, which takes
# the body's tangent dh = J_body v and the head's part of v and returns the
# pull-backs g_h (through the body by one backward), g_W and g_b (added to
# the head's parameters; a tied embedding gets both its body and head part).
# Memory O(chunk × V) instead of O(B·T·V) for logits, tangents and loss
# Hessian products. On the first batch the model's logits are compared once
# with lm_head(h): models that post-process the head's output (soft-capping,
# scaling) keep the generic path. `chunked_lm_head` = "auto" / True / False.


@dataclass
class _OutputState:
    batch: Batch
    output: torch.Tensor  # f(θ) with its graph to the parameters
    loss_grad: torch.Tensor | None = None  # ∇_f ℓ built with create_graph (autograd loss Hessian)
    output_leaf: torch.Tensor | None = None  # the detached output ∇_f ℓ is taken at
    valid: torch.Tensor | None = None  # chunked LM head: target positions that count (B, T-1)
    n: torch.Tensor | None = None  # chunked LM head: their number (the mean's denominator)


class _OutputSandwichOperator(DataCurvatureOperator):
    """``Σ Jᵀ H J`` over the data for a model output ``f`` and an output-space Hessian ``H``.

    Subclasses define the output (``_output``) and the product with ``H``
    (``_loss_hvp``, optionally preparing state in ``_loss_state``).
    """

    supports_graph_reuse = True
    needs_double_backward = False
    #: what produced the output, for error messages
    _what_output = "forward_fn"

    def __init__(
        self,
        model: nn.Module,
        dataloader: Iterable[Batch],
        forward_fn: ForwardFn,
        *,
        jvp: JvpMethod = "auto",
        fd_eps: float | None = None,
        **base: Any,
    ) -> None:
        if not callable(forward_fn):
            raise TypeError(
                "forward_fn must be callable as forward_fn(model, batch) -> output tensor"
            )
        if jvp not in ("auto", "forward_mode", "finite_difference"):
            raise ValueError(
                f"jvp must be 'auto', 'forward_mode' or 'finite_difference', got {jvp!r}"
            )
        if fd_eps is not None and not fd_eps > 0:
            raise ValueError(f"fd_eps must be positive, got {fd_eps}")
        super().__init__(model, dataloader, **base)
        self.jvp = jvp
        self.fd_eps = fd_eps if fd_eps is not None else default_fd_eps(self.dtype)
        self._set_forward(forward_fn)
        self._call_names = [f"model.{n}" for n in self.layout.names]
        # the traced engines sandwich the whole output (never the chunked LM head's hidden states)
        self._functional_call = CallWithModel(self.model, forward_fn)
        self.supports_functional = jvp != "finite_difference"
        self._engines  # noqa: B018 - validates engine= against jvp= now, not at the first product
        #: how the last Jv was computed: "forward_mode" or "finite_difference" (None before the first product)
        self.jvp_method: str | None = None
        self._forward_ok: bool | None = None if jvp == "auto" else jvp == "forward_mode"
        self._vmap_ok: bool | None = None
        self._vjp_batched_ok: bool | None = None

    def _set_forward(self, forward_fn: ForwardFn) -> None:
        """The function whose Jacobian the operator sandwiches (and its functional wrapper)."""
        self.forward_fn = forward_fn
        self._call = CallWithModel(self.model, forward_fn)

    def functional_unsupported_reason(self) -> str:
        return "jvp='finite_difference' is not a traced product"

    def functional_product(
        self, state: dict[str, torch.Tensor], batch: Batch, tangent: list[torch.Tensor]
    ) -> list[torch.Tensor]:
        """``Jᵀ H (J v)`` as a pure function: ``vjp(f)(H · jvp(f)(v))`` (see ``operators.engines``)."""
        call, primal = self._selected_function(self._functional_call, state, batch)

        def f(*selected: torch.Tensor) -> torch.Tensor:
            return self._checked_output(call(*selected))

        out, vjp_fn = torch.func.vjp(f, *primal)[:2]
        jv = torch.func.jvp(f, primal, tuple(tangent))[1]
        return list(vjp_fn(self._functional_loss_hvp(out, batch, jv)))

    def _functional_loss_hvp(self, output: torch.Tensor, batch: Batch, u: torch.Tensor) -> torch.Tensor:
        """``H u`` for one direction ``u`` shaped like ``output``, traceable."""
        raise NotImplementedError

    # -- hooks ------------------------------------------------------------------
    def _output(self, batch: Batch) -> torch.Tensor:
        return self.forward_fn(self.model, batch)

    def _loss_state(self, state: _OutputState) -> None:
        """Prepare what ``_loss_hvp`` needs (e.g. a loss-gradient graph)."""

    def _loss_hvp(self, state: _OutputState, u: torch.Tensor) -> torch.Tensor:
        """``H u`` for a block ``u`` of shape ``(k, *output.shape)``."""
        raise NotImplementedError

    # -- per-batch product ----------------------------------------------------------
    def _checked_output(self, out: Any) -> torch.Tensor:
        if not isinstance(out, torch.Tensor):
            raise TypeError(
                f"{self._what_output} must return a tensor, got {type(out).__name__}; "
                "return e.g. the logits (outputs.logits for HuggingFace models)"
            )
        return out

    def _prepare(self, batch: Batch) -> _OutputState:
        self.num_forwards += 1
        output = self._checked_output(self._output(batch))
        if not output.requires_grad:
            raise ValueError(
                f"the output of {self._what_output} does not depend on the selected parameters (no autograd "
                "graph); check that it calls the model and that the parameters require grad"
            )
        state = _OutputState(batch=batch, output=output)
        self._loss_state(state)
        return state

    def _apply(
        self, state: _OutputState, vecs: list[torch.Tensor], retain: bool
    ) -> Sequence[torch.Tensor | None]:
        jv = self._jvp(state.batch, vecs)
        if jv.shape[1:] != state.output.shape:
            raise RuntimeError(
                f"{self._what_output} returned shape {tuple(state.output.shape)} in the forward pass but "
                f"{tuple(jv.shape[1:])} in the Jacobian-vector pass; it must be deterministic in shape"
            )
        u = self._loss_hvp(state, jv)
        return self._vjp(state.output, u, retain)

    # -- J v --------------------------------------------------------------------
    def _param_dict(self, tensors: Sequence[torch.Tensor]) -> dict[str, torch.Tensor]:
        named = dict(zip(self._call_names, tensors, strict=True))
        # modules in training mode update buffers in place (BatchNorm statistics):
        # give this extra pass private copies so the user's buffers never move
        for mname, m in self.model.named_modules():
            if m.training:
                for bname, b in m.named_buffers(recurse=False):
                    named[f"model.{mname}.{bname}" if mname else f"model.{bname}"] = (
                        b.detach().clone()
                    )
        return named

    def _call_at(self, tensors: Sequence[torch.Tensor], batch: Batch) -> torch.Tensor:
        out = call_with_values(self._call, self._param_dict(tensors), (batch,))
        return self._checked_output(out)

    def _jvp(self, batch: Batch, vecs: list[torch.Tensor]) -> torch.Tensor:
        """``J v`` for each of the k rows of ``vecs``: ``(k, *output.shape)``.

        See NOTE [GGN Jacobian-vector products].
        """
        if self._forward_ok is not False:
            try:
                out = self._jvp_forward_mode(batch, vecs)
            except (RuntimeError, NotImplementedError):
                if self._forward_ok:  # forward mode worked before, or was asked for: a real error
                    raise
                self._forward_ok = False
            else:
                self._forward_ok = True
                return out
        self.jvp_method = "finite_difference"
        return self._jvp_finite_difference(batch, vecs)

    def _jvp_forward_mode(self, batch: Batch, vecs: list[torch.Tensor]) -> torch.Tensor:
        primals = tuple(p.detach() for p in self.params)

        def f(*tensors: torch.Tensor) -> torch.Tensor:
            return self._call_at(tensors, batch)

        def one(*tangents: torch.Tensor) -> torch.Tensor:
            return torch.func.jvp(f, primals, tangents)[1]

        # math attention: the fused SDPA kernels have no forward-mode formulas
        with _torch_compat.math_sdpa(), warnings.catch_warnings():
            # torch's first forward-mode call loads its decompositions through the deprecated
            # torch.jit.script and warns about it: torch's own business, not the user's
            warnings.filterwarnings("ignore", message=r".*torch\.jit\.script.*deprecated")
            return self._jvp_forward_mode_block(one, vecs)

    def _jvp_forward_mode_block(
        self, one: Callable[..., torch.Tensor], vecs: list[torch.Tensor]
    ) -> torch.Tensor:
        k = vecs[0].shape[0]
        if k > 1 and self._vmap_ok is not False:
            try:
                with warnings.catch_warnings():
                    # vmap warns and loops when an op has no batching rule: take that as unsupported
                    warnings.simplefilter("error", UserWarning)
                    out = torch.func.vmap(one)(*vecs)
            except (RuntimeError, NotImplementedError, ValueError, UserWarning):
                if self._vmap_ok:
                    raise
                self._vmap_ok = False
            else:
                self._vmap_ok = True
                self.jvp_method = "forward_mode"
                return out
        first = one(*(v[0] for v in vecs))
        out = torch.empty((k, *first.shape), dtype=first.dtype, device=first.device)
        out[0] = first
        for j in range(1, k):
            out[j] = one(*(v[j] for v in vecs))
        self.jvp_method = "forward_mode"
        return out

    def _jvp_finite_difference(self, batch: Batch, vecs: list[torch.Tensor]) -> torch.Tensor:
        k = vecs[0].shape[0]
        primals = [p.detach() for p in self.params]
        out: torch.Tensor | None = None
        with torch.no_grad():
            for j in range(k):
                vj = [v[j] for v in vecs]
                norm = torch.linalg.vector_norm(
                    torch.stack([torch.linalg.vector_norm(x) for x in vj])
                )
                # step h along v/‖v‖; a zero v gives a zero product (NOTE [finite-difference step])
                scale = self.fd_eps / norm.clamp_min(torch.finfo(norm.dtype).tiny ** 0.5)
                plus = self._call_at(
                    [p + scale * x for p, x in zip(primals, vj, strict=True)], batch
                )
                minus = self._call_at(
                    [p - scale * x for p, x in zip(primals, vj, strict=True)], batch
                )
                if out is None:
                    out = torch.empty((k, *plus.shape), dtype=plus.dtype, device=plus.device)
                torch.mul(plus - minus, 0.5 / scale, out=out[j])
        assert out is not None
        return out

    # -- Jᵀ u -----------------------------------------------------------------------
    def _vjp(
        self, output: torch.Tensor, u: torch.Tensor, retain: bool
    ) -> Sequence[torch.Tensor | None]:
        k = u.shape[0]
        if k == 1:
            g = torch.autograd.grad(
                output, self.params, u[0], retain_graph=retain, allow_unused=True
            )
            return [None if x is None else x.unsqueeze(0) for x in g]
        if self._vjp_batched_ok is not False:
            first = self._vjp_batched_ok is None
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("error", UserWarning)
                    g = torch.autograd.grad(
                        output,
                        self.params,
                        u,
                        is_grads_batched=True,
                        retain_graph=retain or first,
                        allow_unused=True,
                    )
            except (RuntimeError, NotImplementedError, UserWarning):
                if not first:
                    raise
                self._vjp_batched_ok = False
            else:
                self._vjp_batched_ok = True
                return list(g)
        rows = [
            torch.autograd.grad(
                output, self.params, u[j], retain_graph=retain or j < k - 1, allow_unused=True
            )
            for j in range(k)
        ]
        return [
            None if rows[0][i] is None else torch.stack([r[i] for r in rows])
            for i in range(len(self.params))
        ]


class GGNOperator(_OutputSandwichOperator):
    """Generalized Gauss-Newton ``Jᵀ H_L J`` of ``loss_of_output_fn(forward_fn(model, batch), batch)``,
    averaged over the data (weighted by batch size).

    ``GGNOperator(model, dataloader, forward_fn, loss_of_output_fn, *,
    param_filter=None, full_dataset=True, num_batches=None,
    loss_hvp="analytical", fd_eps=None, backend=None)`` plus the
    microbatch, block and graph-reuse options of
    :class:`~hessian_eigenthings.operators.base.DataCurvatureOperator`.

    - ``forward_fn(model, batch) -> output`` (a tensor, e.g. logits) and
      ``loss_of_output_fn(output, batch) -> scalar`` mean loss of the batch;
      helpers in :mod:`hessian_eigenthings.loss_fns`.
    - ``loss_hvp="analytical"``: ``loss_of_output_fn`` must implement
      :class:`~hessian_eigenthings.loss_fns.protocols.OutputHessianLoss`
      (``.hvp``), applied in closed form. ``"autograd"``: any loss, its
      output Hessian by a double backward through the loss only.
    - ``jvp``: ``"auto"`` (forward mode, finite differences if the model's
      ops lack forward-mode formulas), ``"forward_mode"`` or
      ``"finite_difference"``; ``fd_eps`` is the step of the latter (default
      by dtype). See NOTE [GGN Jacobian-vector products].
    - ``chunked_lm_head``: ``"auto"`` applies the LM head and the loss chunk
      by chunk (``lm_head_chunk_rows`` rows at a time, default sized to
      ~256 MiB) for HuggingFace causal LMs with a plain linear head, see
      NOTE [chunked LM head]; ``True`` insists, ``False`` never does.
      ``lm_head`` is the head module when the chunked path is in use.
    """

    def __init__(
        self,
        model: nn.Module,
        dataloader: Iterable[Batch],
        forward_fn: ForwardFn,
        loss_of_output_fn: LossOfOutputFn | OutputHessianLoss,
        *,
        param_filter: ParamFilter | str | Sequence[str] | None = None,
        full_dataset: bool = True,
        num_batches: int | None = None,
        loss_hvp: Literal["analytical", "autograd"] = "analytical",
        fd_eps: float | None = None,
        backend: LinAlgBackend | None = None,
        jvp: JvpMethod = "auto",
        chunked_lm_head: bool | Literal["auto"] = "auto",
        lm_head_chunk_rows: int | None = None,
        microbatch_size: int | None = None,
        microbatch_unsafe: bool = False,
        **options: Unpack[DataOptions],
    ) -> None:
        if chunked_lm_head not in (True, False, "auto"):
            raise ValueError(
                f"chunked_lm_head must be True, False or 'auto', got {chunked_lm_head!r}"
            )
        if not callable(loss_of_output_fn):
            raise TypeError(
                "loss_of_output_fn must be callable as loss_of_output_fn(output, batch) -> scalar"
            )
        check_loss_argument(loss_of_output_fn, name="loss_of_output_fn", wrap="supervised_loss_of_output")
        check_loss_argument(forward_fn, name="forward_fn", wrap="supervised_forward and supervised_loss_of_output")
        if loss_hvp not in ("analytical", "autograd"):
            raise ValueError(f"loss_hvp must be 'analytical' or 'autograd', got {loss_hvp!r}")
        if loss_hvp == "analytical" and not isinstance(loss_of_output_fn, OutputHessianLoss):
            raise ValueError(
                f"loss_hvp='analytical' needs a loss with a closed-form output Hessian (an .hvp(output, "
                f"batch, u) method, see loss_fns.OutputHessianLoss); {loss_of_output_fn!r} has none. Pass "
                "loss_hvp='autograd' to differentiate it twice, or use a closed-form helper such as "
                "loss_fns.supervised_loss_of_output(nn.CrossEntropyLoss()) or hf_lm_loss_of_output()"
            )
        super().__init__(
            model,
            dataloader,
            forward_fn,
            jvp=jvp,
            fd_eps=fd_eps,
            param_filter=param_filter,
            full_dataset=full_dataset,
            num_batches=num_batches,
            microbatch_size=microbatch_size,
            microbatch_unsafe=microbatch_unsafe,
            backend=backend,
            **options,
        )
        self.loss_of_output_fn = loss_of_output_fn
        self.loss_hvp = loss_hvp
        self.chunked_lm_head = chunked_lm_head
        self.lm_head_chunk_rows = lm_head_chunk_rows
        self._logits_fn = forward_fn
        #: the LM head applied chunk by chunk (see NOTE [chunked LM head]); None: the generic path
        self.lm_head: nn.Linear | None = None
        self._lm_head_checked = False
        traced = self._engine_name in ("functional", "compiled")
        if chunked_lm_head is True and traced:
            raise ValueError(
                f"chunked_lm_head=True runs on engine='autograd'; engine={self._engine_name!r} sandwiches the "
                "whole logits (pass chunked_lm_head='auto' or engine='autograd')"
            )
        if chunked_lm_head is not False and not traced:
            head = self._plain_lm_head()
            if head is None and chunked_lm_head is True:
                raise ValueError(
                    "chunked_lm_head=True needs forward_fn=hf_lm_forward(), loss_of_output_fn="
                    "hf_lm_loss_of_output() with loss_hvp='analytical', and a model whose "
                    "get_output_embeddings() is a plain nn.Linear without hooks"
                )
            if head is not None:
                self.lm_head = head
                forward = forward_fn
                assert isinstance(forward, HFCausalLMForward)
                self._set_forward(forward.hidden_states)

    # -- chunked LM head ----------------------------------------------------------
    def _plain_lm_head(self) -> nn.Linear | None:
        if not (
            isinstance(self._logits_fn, HFCausalLMForward)
            and isinstance(self.loss_of_output_fn, HFCausalLMLoss)
            and self.loss_hvp == "analytical"
        ):
            return None
        get = getattr(self.model, "get_output_embeddings", None)
        head = get() if callable(get) else None
        if type(head) is not nn.Linear or head._forward_hooks or head._forward_pre_hooks:
            return None
        return head

    def _check_lm_head(self, batch: Batch, h: torch.Tensor) -> bool:
        """Once, on the first batch: do the model's logits equal ``lm_head(hidden states)``?

        Models that post-process the head's output (logit soft-capping, scaling)
        differ; they keep the generic path. One host sync, once per operator.
        """
        assert self.lm_head is not None
        with torch.no_grad():
            logits = self._logits_fn(self.model, batch)
            ok = logits.shape[:-1] == h.shape[:-1] and torch.allclose(
                self.lm_head(h.detach()), logits, rtol=1e-4, atol=1e-5 * float(logits.abs().max())
            )
        if not ok and self.chunked_lm_head is True:
            raise ValueError(
                "chunked_lm_head=True, but the model's logits differ from lm_head(last hidden state) "
                "(soft-capping or scaling after the head?); pass chunked_lm_head='auto' or False"
            )
        return bool(ok)

    def _prepare(self, batch: Batch) -> _OutputState:
        if self.lm_head is None:
            return super()._prepare(batch)
        state = super()._prepare(batch)  # output: the last hidden states (B, T, d)
        if not self._lm_head_checked:
            self._lm_head_checked = True
            if not self._check_lm_head(batch, state.output):
                self.lm_head = None
                self._set_forward(self._logits_fn)
                return super()._prepare(batch)
        loss = self.loss_of_output_fn
        assert isinstance(loss, HFCausalLMLoss)
        _, state.valid = loss.targets(batch)
        state.n = state.valid.sum().clamp_min(1)
        return state

    def _apply(
        self, state: _OutputState, vecs: list[torch.Tensor], retain: bool
    ) -> Sequence[torch.Tensor | None]:
        if state.valid is None:
            return super()._apply(state, vecs, retain)
        head = self.lm_head
        loss = self.loss_of_output_fn
        assert head is not None and isinstance(loss, HFCausalLMLoss) and state.n is not None
        index = {id(p): i for i, p in enumerate(self.params)}
        iw, ib = index.get(id(head.weight)), None if head.bias is None else index.get(id(head.bias))
        dh = self._jvp(state.batch, vecs)  # body Jacobian times the direction: (k, B, T, d)
        h = state.output.detach()[:, :-1]  # position t predicts token t + 1
        W = head.weight.detach()
        b = None if head.bias is None else head.bias.detach()
        k = dh.shape[0]
        g_h = torch.zeros_like(dh)  # the last position gets no loss: zero pull-back
        g_w = None if iw is None else torch.empty_like(vecs[iw])
        g_b = None if ib is None else torch.empty_like(vecs[ib])
        for j in range(k):
            gh, gw, gb = lm_head_ce_ggn(
                h,
                W,
                b,
                dh[j, :, :-1],
                None if iw is None else vecs[iw][j],
                None if ib is None else vecs[ib][j],
                state.valid,
                state.n,
                chunk_rows=self.lm_head_chunk_rows,
                impl=loss.fused,
            )
            g_h[j, :, :-1] = gh
            if g_w is not None:
                g_w[j] = gw
            if g_b is not None and gb is not None:
                g_b[j] = gb
        out = list(self._vjp(state.output, g_h, retain))  # the body's part
        # the head's own parameters add their part (a tied embedding gets both)
        for i, extra in ((iw, g_w), (ib, g_b)):
            if i is not None and extra is not None:
                body = out[i]
                out[i] = extra if body is None else body.add_(extra)
        return out

    def _functional_loss_hvp(self, output: torch.Tensor, batch: Batch, u: torch.Tensor) -> torch.Tensor:
        loss = self.loss_of_output_fn
        if self.loss_hvp == "analytical":
            return loss.hvp(output, batch, u.unsqueeze(0))[0]  # type: ignore[union-attr]

        def scalar(o: torch.Tensor) -> torch.Tensor:
            value = loss(o, batch)
            if not isinstance(value, torch.Tensor) or value.numel() != 1:
                raise ValueError("loss_of_output_fn must return a scalar (the mean loss of the batch)")
            return value.reshape(())

        hu: torch.Tensor = torch.func.jvp(torch.func.grad(scalar), (output,), (u,))[1]
        return hu

    def _loss_state(self, state: _OutputState) -> None:
        if self.loss_hvp == "analytical":
            return
        leaf = state.output.detach().requires_grad_(True)
        loss = self.loss_of_output_fn(leaf, state.batch)
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
            raise ValueError(
                f"loss_of_output_fn must return a scalar (the mean loss of the batch), got {shape}"
            )
        (grad,) = torch.autograd.grad(loss.reshape(()), leaf, create_graph=True)
        state.output_leaf = leaf
        state.loss_grad = grad

    def _loss_hvp(self, state: _OutputState, u: torch.Tensor) -> torch.Tensor:
        if self.loss_hvp == "analytical":
            hu = self.loss_of_output_fn.hvp(state.output.detach(), state.batch, u)  # type: ignore[union-attr]
            if not isinstance(hu, torch.Tensor) or hu.shape != u.shape:
                got = tuple(hu.shape) if isinstance(hu, torch.Tensor) else type(hu).__name__
                raise ValueError(
                    f"{self.loss_of_output_fn!r}.hvp returned {got} for u of shape {tuple(u.shape)}; it must keep u's shape"
                )
            return hu
        grad, leaf = state.loss_grad, state.output_leaf
        assert grad is not None and leaf is not None
        if not grad.requires_grad:  # the loss is linear in the output: H_L = 0
            return torch.zeros_like(u)
        # the loss graph is small and belongs to this state: keep it for graph reuse
        k = u.shape[0]
        if k == 1:
            (hu,) = torch.autograd.grad(grad, leaf, u[0], retain_graph=True, allow_unused=True)
            return torch.zeros_like(u) if hu is None else hu.unsqueeze(0)
        (hu,) = torch.autograd.grad(
            grad, leaf, u, is_grads_batched=True, retain_graph=True, allow_unused=True
        )
        return torch.zeros_like(u) if hu is None else hu

#: the 1.0 alpha's name for the ``loss_hvp`` values
LossHvpMethod = Literal["analytical", "autograd"]
