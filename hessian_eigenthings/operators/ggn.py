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
without forming the logits (NOTE [chunked LM head] in ``lm_head``).

Cost per product and batch: one forward pass (kept across products with graph
reuse, see NOTE [graph reuse] in ``graph_reuse``), one forward-mode pass, one
backward pass; a block of k vectors goes through steps 1 and 3 batched. No
double backward through the model: kernels without one (flash attention,
fused ops) are fine.

:class:`~hessian_eigenthings.operators.sandwich.OutputSandwichOperator` holds
the machinery; the empirical Fisher is its sibling, with the per-sample
losses as the "output".
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Literal

import torch
from torch import nn
from typing_extensions import Unpack

from hessian_eigenthings._checks import check_count
from hessian_eigenthings.batching import Batch
from hessian_eigenthings.linalg import LinAlgBackend
from hessian_eigenthings.loss_fns.checks import check_first_batch, check_loss_argument
from hessian_eigenthings.loss_fns.protocols import (
    ForwardFn,
    HiddenStatesForward,
    KeyedSampledFisherLoss,
    LinearHeadLoss,
    LossOfOutputFn,
    OutputHessianLoss,
    OutputHessianSqrtLoss,
    SampledFisherLoss,
    SampledFisherSqrtLoss,
)
from hessian_eigenthings.operators.base import DataOptions
from hessian_eigenthings.operators.lm_head import ChunkedHead, plain_head
from hessian_eigenthings.operators.sandwich import JvpMethod, OutputSandwichOperator, OutputState
from hessian_eigenthings.param_utils import ParamFilter


class GGNOperator(OutputSandwichOperator):
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
    - ``mc_samples``: 0 (default) the exact GGN; ``k > 0`` the Monte-Carlo Fisher: the loss
      Hessian replaced by the mean of ``g gᵀ`` over k targets per sample drawn from the
      model's predictive distribution (``g`` the loss gradient at the output), for losses
      implementing :class:`~hessian_eigenthings.loss_fns.protocols.SampledFisherLoss`
      (cross-entropy, MSE as a Gaussian with variance 1/2, BCE with logits). Draws are seeded
      by ``seed`` and the chunk's position in a pass: one fixed matrix per operator, the global
      random state untouched. Runs on the autograd engine.
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
        mc_samples: int = 0,
        seed: int = 0,
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
        self.mc_samples: int = check_count("mc_samples", mc_samples, minimum=0)  # type: ignore[assignment]
        self.seed: int = check_count("seed", seed, minimum=0)  # type: ignore[assignment]
        self._mc_keys: dict[int, torch.Tensor] = {}
        self._mc_keyed = isinstance(loss_of_output_fn, KeyedSampledFisherLoss)
        self._traced_key: torch.Tensor | None = None
        if self.mc_samples and not isinstance(loss_of_output_fn, SampledFisherLoss):
            raise ValueError(
                f"mc_samples={mc_samples} samples targets from the model's predictive distribution; "
                f"{loss_of_output_fn!r} cannot (no .sample_grads, see loss_fns.SampledFisherLoss). Use "
                "supervised_loss_of_output(...) of nn.CrossEntropyLoss(), nn.MSELoss() or nn.BCEWithLogitsLoss(), "
                "or mc_samples=0 for the exact GGN"
            )
        if self.mc_samples:
            loss_hvp = "analytical"  # the sampled outer products replace the loss Hessian
        elif loss_hvp == "analytical" and not isinstance(loss_of_output_fn, OutputHessianLoss):
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
        check_first_batch(model, self.source.first_batch(), forward_fn, loss_of_output_fn)
        self.chunked_lm_head = chunked_lm_head
        self.lm_head_chunk_rows = lm_head_chunk_rows
        self._logits_fn = forward_fn
        #: the chunked LM head (NOTE [chunked LM head] in ``lm_head``); None: the generic path
        self._head: ChunkedHead | None = None
        traced = self._engine_name in ("functional", "compiled")
        if chunked_lm_head is True and traced:
            raise ValueError(
                f"chunked_lm_head=True runs on engine='autograd'; engine={self._engine_name!r} sandwiches the "
                "whole logits (pass chunked_lm_head='auto' or engine='autograd')"
            )
        plain = chunked_lm_head is not False and not traced and loss_hvp == "analytical" and not self.mc_samples
        head = None if not plain else plain_head(
            model, forward_fn, loss_of_output_fn
        )
        if head is None and chunked_lm_head is True:
            raise ValueError(
                "chunked_lm_head=True needs forward_fn=hf_lm_forward(), loss_of_output_fn="
                "hf_lm_loss_of_output() with loss_hvp='analytical' (or any forward and loss implementing "
                "loss_fns.protocols.HiddenStatesForward and LinearHeadLoss), and a model whose "
                "get_output_embeddings() is a plain nn.Linear without hooks"
            )
        if head is not None:
            assert isinstance(forward_fn, HiddenStatesForward) and isinstance(loss_of_output_fn, LinearHeadLoss)
            self._head = ChunkedHead(
                head, forward_fn, loss_of_output_fn, chunk_rows=lm_head_chunk_rows, insist=chunked_lm_head is True
            )
            self._set_forward(forward_fn.hidden_states)

    @property
    def lm_head(self) -> nn.Linear | None:
        """The head module when the chunked path is in use (NOTE [chunked LM head])."""
        return None if self._head is None else self._head.head

    def _prepare(self, batch: Batch) -> OutputState:
        state = super()._prepare(batch)  # with the chunked head: the last hidden states (B, T, d)
        head = self._head
        if head is None:
            return state
        if not head.checked and not head.matches(self.model, batch, state.output):
            self._head = None
            self._set_forward(self._logits_fn)
            return super()._prepare(batch)
        head.prepare(state)
        return state

    def _apply(
        self, state: OutputState, vecs: list[torch.Tensor], retain: bool
    ) -> Sequence[torch.Tensor | None]:
        if state.valid is None or self._head is None:
            return super()._apply(state, vecs, retain)
        return self._head.apply(self, state, vecs, retain)

    def _mc_key(self) -> torch.Tensor:
        """The counter key of the current chunk's draws (one tensor per chunk position, reused:
        a program traced for one batch sees the same input object again)."""
        rank = int(getattr(self, "rank", 0))
        value = ((self.seed * 1_000_003 + rank) * 1_000_033 + self.chunk_position) % 2**62
        key = self._mc_keys.get(value)
        if key is None or key.device != self.device:
            key = torch.tensor(value, dtype=torch.int64, device=self.device)
            self._mc_keys[value] = key
        return key

    def _engine_batch(self, batch: Batch) -> Batch:
        # NOTE [sampled targets as data]
        return (batch, self._mc_key()) if self.mc_samples else batch

    def functional_product(
        self, state: dict[str, torch.Tensor], batch: Batch, tangent: list[torch.Tensor]
    ) -> list[torch.Tensor]:
        if self.mc_samples:
            batch, self._traced_key = batch
        return super().functional_product(state, batch, tangent)

    def _functional_loss_hvp(self, output: torch.Tensor, batch: Batch, u: torch.Tensor) -> torch.Tensor:
        loss = self.loss_of_output_fn
        if self.mc_samples:
            assert isinstance(loss, KeyedSampledFisherLoss)
            grads = loss.keyed_sample_grads(output.detach(), batch, self.mc_samples, self._traced_key)
            return loss.sampled_hvp(output, batch, grads, u.unsqueeze(0))[0]
        if self.loss_hvp == "analytical":
            return loss.hvp(output, batch, u.unsqueeze(0))[0]  # type: ignore[union-attr]

        def scalar(o: torch.Tensor) -> torch.Tensor:
            value = loss(o, batch)
            if not isinstance(value, torch.Tensor) or value.numel() != 1:
                raise ValueError("loss_of_output_fn must return a scalar (the mean loss of the batch)")
            return value.reshape(())

        hu: torch.Tensor = torch.func.jvp(torch.func.grad(scalar), (output,), (u,))[1]
        return hu

    def _functional_blocker(self) -> str | None:
        if self.mc_samples and not self._mc_keyed:
            return (
                f"mc_samples={self.mc_samples} with a loss whose draws are not a function of a key "
                "(no .keyed_sample_grads, see loss_fns.KeyedSampledFisherLoss) runs on engine='autograd'"
            )
        return super()._functional_blocker()

    def _loss_state(self, state: OutputState) -> None:
        if self.mc_samples:
            # NOTE [sampled targets]: one draw per chunk of a pass, seeded by (seed, rank, chunk
            # position), so every product of the operator uses the same draws (a fixed matrix,
            # kept state or not) and nothing reads or moves the global random state
            state.samples = self._sample_grads(state.output.detach(), state.batch)
            return
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

    def _sample_grads(self, output: torch.Tensor, batch: Batch) -> torch.Tensor:
        """The loss gradients at this chunk's sampled targets (NOTE [sampled targets])."""
        sampler = self.loss_of_output_fn
        if isinstance(sampler, KeyedSampledFisherLoss):  # the traced engines' draws exactly
            return sampler.keyed_sample_grads(output, batch, self.mc_samples, self._mc_key())
        generator = torch.Generator(device=output.device)
        rank = int(getattr(self, "rank", 0))
        generator.manual_seed((self.seed * 1_000_003 + rank) * 1_000_033 + self.chunk_position)
        sampler = self.loss_of_output_fn
        assert isinstance(sampler, SampledFisherLoss)
        return sampler.sample_grads(output, batch, self.mc_samples, generator)

    def _output_hessian_sqrt(self, output: torch.Tensor, batch: Batch) -> torch.Tensor:
        loss = self.loss_of_output_fn
        if self.mc_samples:
            if not isinstance(loss, SampledFisherSqrtLoss):
                raise TypeError(
                    f"the exact diagonal of the Monte-Carlo Fisher needs {loss!r} to give the square root of "
                    "its sampled Hessian (.sampled_hessian_sqrt, see loss_fns.protocols.SampledFisherSqrtLoss)"
                )
            return loss.sampled_hessian_sqrt(output, batch, self._sample_grads(output, batch))
        if not isinstance(loss, OutputHessianSqrtLoss):
            raise TypeError(
                f"the exact GGN diagonal needs a square root of the loss Hessian, and {loss!r} has none "
                "(.hessian_sqrt, see loss_fns.protocols.OutputHessianSqrtLoss); use supervised_loss_of_output("
                "nn.CrossEntropyLoss() / nn.MSELoss() / nn.BCEWithLogitsLoss()), mc_samples=k, or "
                "diagonal(op, method='xdiag') for an estimate"
            )
        S = loss.hessian_sqrt(output, batch)
        if S.dim() != output.dim() + 1 or S.shape[0] != output.shape[0] or S.shape[2:] != output.shape[1:]:
            raise ValueError(
                f"{loss!r}.hessian_sqrt returned shape {tuple(S.shape)} for an output of shape "
                f"{tuple(output.shape)}; it must be (N, K, *output.shape[1:])"
            )
        return S

    def _loss_hvp(self, state: OutputState, u: torch.Tensor) -> torch.Tensor:
        if state.samples is not None:
            sampler = self.loss_of_output_fn
            assert isinstance(sampler, SampledFisherLoss)
            return sampler.sampled_hvp(state.output.detach(), state.batch, state.samples, u)
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


# NOTE [sampled targets as data]
# The traced engines trace a product once per batch signature and replay it for every chunk,
# so a draw made inside the trace with a generator would be baked in (or untraceable). The
# Monte-Carlo Fisher's draws are instead a pure function of a key: counter-based random
# numbers (loss_fns.counter_rng: splitmix64 of key and position, in int64 tensor arithmetic)
# turned into targets by inverse CDF (cross-entropy), comparison (BCE) or Box-Muller (MSE).
# The key of a chunk, (seed, rank, chunk position), is handed to the traced product as an
# input beside the batch (`_engine_batch`), one tensor object per chunk position so that a
# program traced for one batch serves it again; the draws depend only on primal values, so
# the tangent split keeps the sampled gradients with the kept state and products run the
# tangent work only. The autograd engine draws with the same function and key: every engine
# computes the same matrix (up to a target whose uniform falls within rounding of a CDF step).
# Losses with only a generator-based `sample_grads` stay on the autograd engine.
