"""The ``precision=`` option of data operators (``"fp32"``, ``"tf32"``) and the product's precision
switch. They live with the model guard, which sets and restores the global switches around every
product (NOTE [product precision] in ``model_guard``); this module keeps their import path.
"""

from hessian_eigenthings.operators.model_guard import (
    PRECISIONS,
    Precision,
    check_precision,
    product_precision,
    restore_precision,
    switch_precision,
)

__all__ = [
    "PRECISIONS",
    "Precision",
    "check_precision",
    "product_precision",
    "restore_precision",
    "switch_precision",
]
