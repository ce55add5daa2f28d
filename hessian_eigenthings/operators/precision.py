"""The precision policy of products: the ``precision=`` option of data operators (``"fp32"``, the
default; ``"tf32"``; ``"model"``), the dtype products compute in, and the switches set around
every product (NOTE [product precision] in ``model_guard``, which sets and restores them).

A model whose selected parameters are float16 or bfloat16 computes its products in float32 by
default (NOTE [half models]); ``precision="model"`` runs them in the model's own dtype.
"""

from __future__ import annotations

import torch
from torch.utils import _pytree as pytree

from hessian_eigenthings.batching import Batch
from hessian_eigenthings.operators.model_guard import (
    HALF_DTYPES,
    PRECISIONS,
    Precision,
    ProductPrecision,
    Upcast,
    check_precision,
    product_precision,
    restore_precision,
    switch_precision,
)

__all__ = [
    "HALF_DTYPES",
    "PRECISIONS",
    "PRODUCT_PRECISIONS",
    "Precision",
    "ProductPrecision",
    "Upcast",
    "check_precision",
    "check_product_precision",
    "product_dtype",
    "product_precision",
    "restore_precision",
    "switch_precision",
    "upcast_batch",
]

# NOTE [half models]
# Users load large models in bfloat16 (or float16). Products in that dtype carry its rounding:
# bfloat16 keeps 8 bits of mantissa, so each product is off by ~1e-2 relative, and a Krylov
# method that multiplies and reorthogonalizes against such products finds eigenvalues a few
# percent off, with residuals that stall near that level. So for a model whose selected
# parameters are half, products compute in float32 by default (`precision="fp32"`, "at least
# float32 arithmetic"):
# - the parameters and floating buffers of a half dtype are copied to float32 (`Upcast` in
#   `model_guard`), the copies swapped into the modules' slots for the pass of products and the
#   user's tensors put back after it, also when the loss raises. The user's model is never cast
#   or written: its tensors keep their dtype, storage and version counters. The copies are kept
#   between products while the user's tensors are unchanged (same object, same version), so a
#   kept graph or traced state stays valid, and freed by `op.clear_cache()`;
# - floating inputs of a half dtype in the batch are cast to float32 (`upcast_batch`): the
#   model's first layers see float32 as they would with a float32 model;
# - the operator's dtype (`op.dtype`) is float32: the algorithms' vectors and the products are
#   float32, and the weights are exactly the half weights (every bfloat16 and float16 value is a
#   float32 value): the product is that of the bf16 model's loss, rounded as float32 rounds.
# The sharded ranks (FSDP2, `Sharded(model)`) never hold a float32 copy of the whole model: the
# layer walk and the gathered functional product cast each block to float32 as it is gathered
# (`ShardGather`, NOTE [sharded layer walk]) and the rank's buffers for the walk; the walk's
# recording forward runs in float32 the same way, block by block, so the layers' arguments the
# model computes (a Llama's rotary cos/sin, its attention mask) are float32 too (NOTE
# [recording in the product's dtype] in `sharded_walk`).
# Cost: memory for a float32 copy of the parameters (4 bytes per parameter beside the model's 2,
# held between products) and activations in float32 (twice those of the half model); time of
# float32 arithmetic (on GPUs without TF32, about 2-4x a bfloat16 matmul; `precision="tf32"`
# runs the float32 copies' matmuls in TF32). `precision="model"` computes in the model's own
# dtype: products and `op.dtype` are half, the 1.0 releases' behaviour and the 0.x facade's.
# Float32 and float64 models are unaffected: there "model" is "fp32".

PRODUCT_PRECISIONS: tuple[str, ...] = ("fp32", "tf32", "model")


def check_product_precision(precision: object) -> ProductPrecision:
    """The ``precision=`` of a data operator, or one line saying what it takes."""
    if precision not in PRODUCT_PRECISIONS:
        raise ValueError(
            f"precision must be 'fp32' (at least float32 products, the default; a half model's products "
            f"run on float32 copies), 'tf32' (float32 with TensorFloat-32 matrix products: faster, ~1e-3 "
            f"relative error) or 'model' (products in the model's own dtype: bfloat16 for a bfloat16 "
            f"model), got {precision!r}"
        )
    return precision  # type: ignore[return-value]


def product_dtype(param_dtype: torch.dtype, precision: ProductPrecision) -> torch.dtype:
    """The dtype products of a model whose selected parameters are ``param_dtype`` compute in
    (NOTE [half models]): float32 for a half model unless ``precision="model"``, else its own."""
    if param_dtype in HALF_DTYPES and precision != "model":
        return torch.float32
    return param_dtype


def upcast_batch(batch: Batch, dtype: torch.dtype) -> Batch:
    """``batch`` with its floating tensors of a half dtype cast to ``dtype`` (NOTE [half models]);
    the batch itself when it has none."""
    leaves, spec = pytree.tree_flatten(batch)
    if not any(isinstance(x, torch.Tensor) and x.dtype in HALF_DTYPES for x in leaves):
        return batch
    cast = [
        x.to(dtype) if isinstance(x, torch.Tensor) and x.dtype in HALF_DTYPES else x for x in leaves
    ]
    return pytree.tree_unflatten(cast, spec)
