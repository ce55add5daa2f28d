"""GGN product through an LM head and cross-entropy, chunked over rows.

For rows ``i`` with last hidden state ``hᵢ`` (d), head ``z = h Wᵀ + b``
(``W``: (V, d)), per-row loss Hessian ``Hᵢ = diag(pᵢ) − pᵢpᵢᵀ`` scaled by
``vᵢ / n``, and a direction whose head part is ``(dW, db)`` and whose body
part arrives as the hidden-state tangent ``dh = J_body · δθ_body``::

    jvᵢ = dhᵢ Wᵀ + hᵢ dWᵀ + db          (the logits' tangent)
    uᵢ  = Hᵢ jvᵢ · vᵢ / n                (cross_entropy_hvp)
    g_h = u W,   g_W = Σᵢ uᵢᵀ hᵢ,   g_b = Σᵢ uᵢ

``g_h`` is then pulled back through the body by its vector-Jacobian product;
``(g_h → body, g_W, g_b)`` is the GGN-vector product ``Jᵀ H J δ``. Rows are
processed ``chunk_rows`` at a time: memory O(chunk_rows × V) for the logits
and the tangent of one chunk (the tangent buffer is reused for ``u``), never
(N, V). Cost per chunk: three (chunk × d × V) matrix products for ``z``,
``jv`` (two when ``dh`` or ``dW`` is absent) and two for the pull-backs, plus
one fused product.
"""

from __future__ import annotations

import torch

from hessian_eigenthings.kernels.cross_entropy import Impl, cross_entropy_hvp

#: Default bytes for one (chunk_rows, V) buffer (two are live at a time).
_CHUNK_BYTES = 256 * 2**20


def lm_head_ce_ggn(
    h: torch.Tensor,
    W: torch.Tensor,
    b: torch.Tensor | None,
    dh: torch.Tensor | None,
    dW: torch.Tensor | None,
    db: torch.Tensor | None,
    labels_or_valid: torch.Tensor | None,
    n: float | torch.Tensor | None = None,
    *,
    ignore_index: int = -100,
    chunk_rows: int | None = None,
    impl: Impl = "auto",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """GGN-vector product of mean cross-entropy through an LM head.

    Contract (for ``GGNOperator`` on HuggingFace causal LMs):

    * ``h``: ``(..., d)`` hidden states *already aligned with their targets*.
      For a causal LM whose loss predicts token ``t+1`` from position ``t``,
      pass ``h = hidden[:, :-1]`` and ``labels[:, 1:]`` (sliced views are
      fine). ``W``: ``(V, d)`` (``lm_head.weight``), ``b``: ``(V,)`` or None.
    * ``dh``: tangent of ``h`` (``(..., d)``, the body's Jacobian-vector
      product of the direction; None when the direction has no body part).
      ``dW`` ``(V, d)`` / ``db`` ``(V,)``: the head's part of the direction
      (None: zero). With tied embeddings, ``dW`` is the embedding's part and
      the caller adds the body's contribution to the shared weight itself.
    * ``labels_or_valid``: integer labels ``(...)`` (rows equal to
      ``ignore_index``, default -100, are ignored; the label values
      themselves do not enter the cross-entropy Hessian), a boolean mask
      ``(...)`` of rows that count, or None (all rows).
    * ``n``: the mean's denominator, a number or 0-d tensor (no host sync).
      None: the number of valid rows in *this call*, which matches
      ``F.cross_entropy(..., ignore_index=-100)`` of the same rows. When one
      loss is averaged over several calls (micro-batches), pass the total.

    Returns ``(g_h, g_W, g_b)``: ``g_h`` shaped like ``h`` (to be pulled back
    through the body), ``g_W`` like ``W``, ``g_b`` like ``b`` (None without
    bias). Computed without autograd (the result is not differentiable);
    products in the inputs' dtype, the loss Hessian with fp32 accumulation,
    ``g_W`` / ``g_b`` accumulated over chunks in ``W``'s / ``b``'s dtype.
    """
    d = h.shape[-1]
    if W.dim() != 2 or W.shape[1] != d:
        raise ValueError(f"W must be (V, {d}) to match h (..., {d}), got {tuple(W.shape)}")
    V = W.shape[0]
    for name, t, shape in (
        ("dh", dh, h.shape),
        ("dW", dW, W.shape),
        ("b", b, (V,)),
        ("db", db, (V,)),
    ):
        if t is not None and tuple(t.shape) != tuple(shape):
            raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(t.shape)}")
    if labels_or_valid is not None and labels_or_valid.shape != h.shape[:-1]:
        raise ValueError(
            f"labels_or_valid must have shape {tuple(h.shape[:-1])} (one entry per row of h), "
            f"got {tuple(labels_or_valid.shape)}"
        )

    hf = h.reshape(-1, d)
    N = hf.shape[0]
    dhf = dh.reshape(-1, d) if dh is not None else None
    if labels_or_valid is None:
        valid = None
    elif labels_or_valid.dtype == torch.bool:
        valid = labels_or_valid.reshape(-1)
    else:
        valid = labels_or_valid.reshape(-1) != ignore_index
    if n is None:
        n = valid.sum() if valid is not None else N
    if chunk_rows is None:
        chunk_rows = max(1, _CHUNK_BYTES // max(1, V * h.element_size()))
    if chunk_rows < 1:
        raise ValueError(f"chunk_rows must be >= 1, got {chunk_rows}")

    g_h = torch.empty((N, d), dtype=h.dtype, device=h.device)
    g_W = torch.zeros_like(W)
    g_b = torch.zeros_like(b) if b is not None else None
    with torch.no_grad():
        for start in range(0, N, chunk_rows):
            rows = slice(start, min(N, start + chunk_rows))
            hc = hf[rows]
            logits = hc @ W.T if b is None else torch.addmm(b, hc, W.T)
            if dhf is not None:
                jv = dhf[rows] @ W.T
                if dW is not None:
                    jv.addmm_(hc, dW.T)
            elif dW is not None:
                jv = hc @ dW.T
            else:
                jv = torch.zeros_like(logits)
            if db is not None:
                jv += db
            u = cross_entropy_hvp(
                logits, jv, valid[rows] if valid is not None else None, n, impl=impl, out=jv
            )
            torch.mm(u, W, out=g_h[rows])
            g_W.addmm_(u.T, hc)
            if g_b is not None:
                g_b += u.sum(0)
    return g_h.reshape(h.shape), g_W, g_b
